# Copyright 2026 The Qwen3.5 fused-kernels authors. Licensed under the Apache License, Version 2.0.
"""The multi-token-prediction (MTP) head that Qwen3.5 checkpoints ship beside the model (``mtp.*``), in plain torch.

Layout, as the real checkpoints have it (confirmed against vLLM's ``vllm/model_executor/models/qwen3_5_mtp.py`` and
``qwen3_next_mtp.py``, which load these keys; ``text_config.mtp_num_hidden_layers: 1`` in the real configs, with
``mtp_use_dedicated_embeddings: false``)::

    mtp.pre_fc_norm_embedding.weight   [H]        zero-centred RMSNorm (1 + w) of the next token's embedding
    mtp.pre_fc_norm_hidden.weight      [H]        zero-centred RMSNorm (1 + w) of the backbone's hidden state
    mtp.fc.weight                      [H, 2H]    over concat(normed embedding, normed hidden), embedding first
    mtp.layers.{i}.*                              one full-attention decoder layer per ``mtp_num_hidden_layers``,
                                                  with the backbone's layer keys (``self_attn.*``, ``mlp.*`` or the
                                                  MoE block's ``mlp.gate`` / ``mlp.experts.*`` /
                                                  ``mlp.shared_expert*``, ``input_layernorm``,
                                                  ``post_attention_layernorm``)
    mtp.norm.weight                    [H]        zero-centred RMSNorm of the layer's output

The token embedding and the LM head are the model's own (shared, not stored under ``mtp.``). The hidden state fed
in is the backbone's LAST hidden state AFTER its final norm: vLLM's Qwen3.5 / Qwen3-Next model returns
``self.norm(hidden_states, residual)`` and its speculative decoding hands exactly that to the MTP head (in
transformers: ``model(...).last_hidden_state``, or ``hidden_states[-1]`` of ``output_hidden_states``).

One draft step, per position t (``hidden_states[:, t]`` is the backbone's state at token t, ``input_ids[:, t]``
the token t + 1)::

    x = fc(concat(norm_e(embed(token t+1)), norm_h(h_t)))        # [B, T, H]
    x = decoder_layer(x)                                           # causal attention over the head's own positions
    draft = norm(x);  logits = lm_head(draft)                      # predicts token t + 2

A chained step feeds ``draft`` back as the hidden state with the drafted token, one position on. Positions are the
hidden state's (vLLM's choice; a constant shift of every position would not change the attention, which RoPE makes
relative). The head's attention keeps its own cache (a plain ``DynamicCache``: one full-attention layer per MTP
layer), separate from the backbone's.

The layers are stock's building blocks, so the math is stock's: ``Qwen3_5DecoderLayer`` (``Qwen3_5MoeDecoderLayer``
for the MoE models), ``Qwen3_5RMSNorm`` (``Qwen3_5MoeRMSNorm``), the text rotary embedding (non-persistent buffers
only: no checkpoint key).
"""

import copy

import torch
from torch import nn
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    Qwen3_5DecoderLayer,
    Qwen3_5RMSNorm,
    Qwen3_5TextRotaryEmbedding,
)
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
    Qwen3_5MoeDecoderLayer,
    Qwen3_5MoeRMSNorm,
    Qwen3_5MoeTextRotaryEmbedding,
)

from .fused_compat import DECODER_CACHE_KW, MASK_CACHE_KW, MASK_TAKES_LAYER_IDX, stock

MTP_PREFIX = "mtp."  # the head's checkpoint keys, at the root of the text-only and the composite layouts alike

# Stock's building blocks per text model type: (decoder layer, RMSNorm, rotary embedding).
_STOCK_BLOCKS = {
    "qwen3_5_text": (Qwen3_5DecoderLayer, Qwen3_5RMSNorm, Qwen3_5TextRotaryEmbedding),
    "qwen3_5_moe_text": (Qwen3_5MoeDecoderLayer, Qwen3_5MoeRMSNorm, Qwen3_5MoeTextRotaryEmbedding),
}


def mtp_layer_count(config) -> int:
    """``mtp_num_hidden_layers`` of ``config``'s text config (0 when the config does not name it)."""
    return int(getattr(config.get_text_config(), "mtp_num_hidden_layers", 0) or 0)


def _full_attention_layer(config, layer_cls: type, index: int) -> nn.Module:
    """Stock's ``layer_cls`` built as a full-attention layer whose attention uses cache layer ``index``.

    Stock reads a layer's kind from ``config.layer_types[layer_idx]``, at construction only; the backbone's list says
    nothing about the head's layers. The layer is built from a shallow copy of ``config`` that marks them full
    attention, then each of its modules that kept the copy gets ``config`` itself back: the attention reads
    ``_attn_implementation`` and the experts ``_experts_implementation`` from it at every call, and a model's
    ``set_attn_implementation`` changes the model's config."""
    view = copy.copy(config)
    view.layer_types = ["full_attention"] * (index + 1)
    layer = layer_cls(view, index)
    for module in layer.modules():
        if getattr(module, "config", None) is view:
            module.config = config
    return layer


class Qwen3_5MultiTokenPredictor(nn.Module):
    """The MTP head (``mtp.*``) of a Qwen3.5 text config (dense or MoE), ``mtp_num_hidden_layers`` layers.

    ``forward`` returns the draft hidden state; :meth:`draft_logits` adds the shared LM head. The embedding and the
    LM head are passed in (the model's own: the head holds no copy, so its state dict is exactly the checkpoint's
    ``mtp.*`` keys).
    """

    def __init__(self, config):
        super().__init__()
        text_config = config.get_text_config()
        if text_config.model_type not in _STOCK_BLOCKS:
            raise ValueError(f"no MTP head for model_type {text_config.model_type!r}; known: {sorted(_STOCK_BLOCKS)}")
        layer_cls, norm_cls, rotary_cls = _STOCK_BLOCKS[text_config.model_type]
        layers = mtp_layer_count(text_config)
        if layers < 1:
            raise ValueError(f"mtp_num_hidden_layers must be at least 1 for an MTP head, got {layers}")
        if text_config._attn_implementation is None:
            # stock's attention would run eager attention without a causal mask (the mask is left to SDPA's flag)
            raise ValueError("the config's attention implementation is unset: build the head with the model's config "
                             "(a PreTrainedModel resolves it), or set config._attn_implementation first")
        hidden, eps = text_config.hidden_size, text_config.rms_norm_eps
        self.config = text_config
        self.pre_fc_norm_embedding = norm_cls(hidden, eps=eps)
        self.pre_fc_norm_hidden = norm_cls(hidden, eps=eps)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.layers = nn.ModuleList([_full_attention_layer(text_config, layer_cls, i) for i in range(layers)])
        self.norm = norm_cls(hidden, eps=eps)
        self.rotary_emb = rotary_cls(config=text_config)

    def forward(self, hidden_states: torch.Tensor, input_ids: torch.Tensor, embed_tokens: nn.Module,
                position_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                cache=None, layer: int = 0) -> torch.Tensor:
        """The draft hidden state ``norm(layer(fc(...)))`` [B, T, H]: at position t, from the backbone's state there
        and the token that follows, what predicts the token after that.

        Args:
            hidden_states: [B, T, H], the backbone's last hidden state (after its final norm) at positions t (or, for
                a chained step, the head's own draft hidden state of the step before).
            input_ids: [B, T] int, the token at t + 1 for each position t.
            embed_tokens: the model's input embedding (shared).
            position_ids: [B, T] (or [3, B, T] mRoPE) positions of ``hidden_states``; default: after what ``cache``
                holds, else 0..T-1.
            attention_mask: [B, past + T] padding mask (1 = token), as for the backbone; None: no padding.
            cache: the head's own cache (``DynamicCache()``), updated in place; None: no cache.
            layer: which MTP layer (``spec_step % mtp_num_hidden_layers`` in a chain, as vLLM cycles them).
        """
        batch, length = input_ids.shape
        if hidden_states.shape[:2] != (batch, length):
            raise ValueError(f"hidden_states {tuple(hidden_states.shape)} and input_ids {tuple(input_ids.shape)} must "
                             "share [B, T]")
        embeds = embed_tokens(input_ids)  # [B, T, H]
        if position_ids is None:
            past = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(past, past + length, device=embeds.device).expand(batch, length)
        text_positions = position_ids[0] if position_ids.ndim == 3 else position_ids  # [B, T]
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden_states)], dim=-1))
        # sized against this layer's own cache entries (a chain cycling several MTP layers fills them unevenly)
        at_layer = {"layer_idx": layer} if MASK_TAKES_LAYER_IDX else {}
        mask = stock.create_causal_mask(config=self.config, inputs_embeds=x, attention_mask=attention_mask,
                                        position_ids=text_positions, **{MASK_CACHE_KW: cache}, **at_layer)
        # the rotary module takes the [3, B, T] mRoPE rows (transformers 5.17 requires them; 5.24 broadcasts [B, T])
        rope_positions = position_ids if position_ids.ndim == 3 else position_ids[None].expand(3, -1, -1)
        x = self.layers[layer](x, position_embeddings=self.rotary_emb(x, rope_positions), attention_mask=mask,
                               position_ids=text_positions, **{DECODER_CACHE_KW: cache})
        return self.norm(x)

    def draft_logits(self, hidden_states: torch.Tensor, input_ids: torch.Tensor, embed_tokens: nn.Module,
                     lm_head: nn.Module, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """``(lm_head(draft), draft)``: the draft logits [B, T, V] (position t: the token at t + 2) through the
        model's LM head, and the draft hidden state [B, T, H] a chained step takes. ``kwargs``: :meth:`forward`'s."""
        draft = self(hidden_states, input_ids, embed_tokens, **kwargs)
        return lm_head(draft), draft
