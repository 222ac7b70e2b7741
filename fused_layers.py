# Copyright 2026 The Qwen3.5 fused-kernels authors. Licensed under the Apache License, Version 2.0.
"""The fused layer modules: packed projections, and subclasses of the stock Qwen3.5 layers built as what they are.

Each module subclasses its stock class and keeps every parameter, name and shape (the state dict is stock's), so a
checkpoint written from it loads in stock transformers / vLLM / SGLang. Each reads the model's :class:`FusedPlan`
and takes the fused path when the plan says so; otherwise it runs the stock ``forward`` unchanged.

Packing. Each group of projections is packed into one ``[sum(out), in]`` row-major matrix, and each original
``nn.Linear.weight`` becomes a contiguous row slice (a view) of it, so parameter memory does not grow:

- Gated DeltaNet: ``in_proj_qkv | in_proj_z | in_proj_b | in_proj_a``,
- attention: ``q_proj`` (query with its gate) ``| k_proj | v_proj``,
- MLP: ``gate_proj | up_proj``.

Both GEMM operands are then K-major (``x`` is ``[M, in]``, the weight ``[N, in]``), the layout cuBLAS and Hopper's
wgmma read without a transpose. Groups are packed when the plan first runs fused, and packed again after a move, a
cast, a load or a parameter replaced by hand (checked by pointer before each fused call).
"""

import contextlib
import contextvars

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    Qwen3_5Attention,
    Qwen3_5DecoderLayer,
    Qwen3_5GatedDeltaNet,
    Qwen3_5MLP,
    Qwen3_5RMSNorm,
)

from .fused_compat import (
    ALL_ATTENTION_FUNCTIONS,
    ATTENTION_CACHE_KW,
    DELTANET_CACHE_KW,
    cached_recurrent_state,
    cache_update_kwargs,
    eager_attention_forward,
    is_recording_past,
    pop_cache,
    stock,
    stock_call,
)
from .fused_plan import FusedPlan

# What each fused kind runs, as describe() reports it.
FUSED_OPS = {
    "linear_attention": "1 GEMM (qkv|z|b|a) + deltanet_prep (conv, SiLU, q/k L2 norm, beta, gate) + fla's gated "
    "delta rule (its chunked kernel, or for fp32 at torch's default 'highest' matmul precision its IEEE per-token "
    "kernel) + gated RMSNorm",
    "full_attention": "1 GEMM (q+gate|k|v) + attn_prep (split, q/k RMSNorm, partial mRoPE) + attention + sigmoid gate",
    "mlp": "1 GEMM (gate|up) + SwiGLU",
    "rms_norm": "zero-centred RMSNorm kernel",
    "decoder_layer": "residual add fused into the post-attention RMSNorm, and into the down projection's GEMM",
}

# The cache the fused prefill of `generate` (and of a graphed forward that returns a cache) writes the prompt's state
# into: set for the duration of that forward by `prefill_into`, read by the decoder layers. A context variable (as
# transformers' own output capturing uses), so concurrent threads each see their own.
_PREFILL_TARGET: contextvars.ContextVar = contextvars.ContextVar("qwen3_5_fused_prefill_target", default=None)


@contextlib.contextmanager
def prefill_into(cache):
    """Run the stock text-model forward (which is told ``use_cache=False``, so its masks are those of an empty cache)
    with every fused decoder layer writing its state into ``cache``."""
    token = _PREFILL_TARGET.set(cache)
    try:
        yield
    finally:
        _PREFILL_TARGET.reset(token)


def _padded_rows(rows: int, multiple: int) -> int:
    return -(-rows // multiple) * multiple


def pack_linears(linears: list[nn.Linear], row_multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """Pack the weights (and biases) of ``linears`` into one ``[sum(out), in]`` matrix; each Linear keeps a view.
    With ``row_multiple`` > 1 the matrix gets zero rows after the last Linear's, up to a multiple of it (an output
    row of a multiple of 8 bf16 values keeps cuBLAS on its aligned kernels: the MoE group has 2 I + E + 1 rows).

    Returns ``(weight, bias)`` (``bias`` None when the Linears have none), or None while the weights are on the meta
    device (not materialised yet: loading packs afterwards)."""
    weights = [lin.weight for lin in linears]
    if any(w.device.type == "meta" for w in weights):
        return None
    has_bias = linears[0].bias is not None
    rows = sum(w.shape[0] for w in weights)
    pad = _padded_rows(rows, row_multiple) - rows
    parts = [w.detach() for w in weights] + ([weights[0].new_zeros(pad, weights[0].shape[1])] if pad else [])
    fused_w = torch.cat(parts, dim=0)
    fused_b = None
    if has_bias:
        biases = [lin.bias.detach() for lin in linears]
        fused_b = torch.cat(biases + ([biases[0].new_zeros(pad)] if pad else []), dim=0)
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight = nn.Parameter(fused_w[start : start + rows], requires_grad=lin.weight.requires_grad)
        if has_bias:
            lin.bias = nn.Parameter(fused_b[start : start + rows], requires_grad=lin.bias.requires_grad)
        start += rows
    return fused_w, fused_b


def _is_packed(linears: list[nn.Linear], packed, row_multiple: int = 1) -> bool:
    """Whether the Linears' parameters are still the row views of ``packed`` (two pointer reads per Linear)."""
    if packed is None:
        return False
    fused_w, fused_b = packed
    start = 0
    for lin in linears:
        w = lin.weight
        if w.dtype != fused_w.dtype or w.data_ptr() != fused_w[start].data_ptr():
            return False
        if fused_b is not None and lin.bias.data_ptr() != fused_b[start].data_ptr():
            return False
        start += w.shape[0]
    return _padded_rows(start, row_multiple) == fused_w.shape[0]


class _FusedModule:
    """Mixin of every fused module: the plan it reads, and its packed projection group (if it has one)."""

    _fused_kind = "module"
    _fused_group: tuple[str, ...] = ()  # submodule paths whose `weight` rows are packed, in this order
    _fused_row_multiple = 1  # the packed matrix's rows padded with zeros to a multiple of this (`pack_linears`)

    def _init_fused(self, plan: FusedPlan) -> None:
        self.plan = plan
        self._packed = None

    def _apply(self, fn, recurse=True):
        # .to() / .half() / .cuda() give every parameter a new storage: drop the old matrix (it would keep the old
        # copy alive) and pack the new parameters again, so the views, and the memory, are as before
        was_packed, self._packed = self._packed is not None, None
        out = super()._apply(fn, recurse)
        if was_packed:
            self.packed_weight()
        return out

    def packed_weight(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The packed matrix (and bias) of this module's projection group, packed (again) when its parameters are
        not the views of the current one (first use, a move, a load, ``load_state_dict(..., assign=True)``, a
        parameter set by hand), so the fused GEMM never reads a stale copy."""
        linears = [self.get_submodule(name) for name in self._fused_group]
        if not _is_packed(linears, self._packed, self._fused_row_multiple):
            self._packed = pack_linears(linears, self._fused_row_multiple)
        return self._packed


class FusedRMSNorm(_FusedModule, Qwen3_5RMSNorm):
    """Zero-centred RMSNorm ``y = x / rms(x) * (1 + w)`` as one Triton kernel."""

    _fused_kind = "rms_norm"

    def __init__(self, dim: int, eps: float, plan: FusedPlan):
        super().__init__(dim, eps=eps)
        self._init_fused(plan)

    def forward(self, x):
        if self.plan.runs(self._fused_kind):
            return self.plan.ops.rms_norm(x, self.weight, self.eps)
        return super().forward(x)


class FusedMLP(_FusedModule, Qwen3_5MLP):
    """SwiGLU MLP: one GEMM for ``gate_proj | up_proj``, a fused ``silu(g) * u``, then ``down_proj``."""

    _fused_kind = "mlp"
    _fused_group = ("gate_proj", "up_proj")

    def __init__(self, config, intermediate_size: int, plan: FusedPlan):
        super().__init__(config, intermediate_size)
        self._init_fused(plan)

    def forward(self, x):
        if self.plan.runs(self._fused_kind):
            w, _ = self.packed_weight()
            return self.down_proj(self.plan.ops.swiglu(F.linear(x, w)))
        return super().forward(x)

    def add_to(self, residual, x):
        """``residual + self(x)``, with the add done by the down projection's GEMM epilogue (cuBLAS with beta=1),
        which saves the separate add kernel. ``residual`` [..., N] is overwritten and returned: the decoder layer
        passes the sum buffer its fused norm has just allocated. Other calls (stock path, hooks on the module) compute
        the plain sum."""
        hooked = self._forward_hooks or self._forward_pre_hooks or hasattr(self, "_hf_hook")
        if hooked or self.down_proj.bias is not None or not self.plan.runs(self._fused_kind):
            return residual + self(x)
        w, _ = self.packed_weight()
        act = self.plan.ops.swiglu(F.linear(x, w))
        residual.view(-1, residual.shape[-1]).addmm_(act.view(-1, act.shape[-1]), self.down_proj.weight.t())
        return residual


class FusedAttention(_FusedModule, Qwen3_5Attention):
    """Gated full attention: one GEMM for ``q_proj (q | gate) | k_proj | v_proj``, one launch for split + q/k RMSNorm
    + partial mRoPE, the configured attention kernel (SDPA / flash / eager), and the sigmoid output gate in one pass.
    ``q_norm`` / ``k_norm`` stay stock modules (``attn_prep`` applies their weights)."""

    _fused_kind = "full_attention"
    _fused_group = ("q_proj", "k_proj", "v_proj")

    def __init__(self, config, layer_idx: int, plan: FusedPlan):
        super().__init__(config, layer_idx)
        self._init_fused(plan)

    def forward(self, hidden_states, position_embeddings, attention_mask=None, **kwargs):
        if not self.plan.runs(self._fused_kind):
            return super().forward(hidden_states, position_embeddings, attention_mask, **kwargs)
        cache = pop_cache(kwargs)
        w, b = self.packed_weight()
        attn_output, attn_weights = self.attend(F.linear(hidden_states, w, b), position_embeddings, attention_mask,
                                                cache, kwargs)
        return self.o_proj(attn_output), attn_weights

    def attend(self, qkv, position_embeddings, attention_mask, cache, kwargs: dict):
        """The fused attention after its one GEMM: ``qkv`` [B, T, (2 H + 2 KV) D] (the packed projection's output) ->
        the gated attention output [B, T, H * D] and the weights (when the interface returns them), ``cache`` updated
        with the new keys / values. ``generate_batch``'s mixed step runs the GEMM itself, over decode rows and a prompt
        chunk together (``fused_batch_mixed``)."""
        ops = self.plan.ops
        batch, seq_len = qkv.shape[:2]
        cos, sin = position_embeddings
        query, key, value, gate = ops.attn_prep(
            qkv, cos, sin, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
            self.config.num_attention_heads, self.config.num_key_value_heads, self.head_dim,
        )
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx, **cache_update_kwargs(kwargs))
        implementation = self.config._attn_implementation
        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention_forward)
        module = self
        if implementation == "sdpa" and attention_mask is not None and key.shape[1] == 1 < query.shape[1]:
            key, value, module = _repeated_single_kv_head(key, value, query.shape[1], self.is_causal)
        attn_output, attn_weights = attention_interface(
            module, query, key, value, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs
        )
        return ops.sigmoid_gate_mul(attn_output.view(batch, seq_len, -1, self.head_dim), gate), attn_weights


class _Ungrouped:
    """What stock's SDPA wrapper reads of an attention module, for keys / values already repeated to the query heads
    (no grouping left for it to do)."""

    num_key_value_groups = 1

    def __init__(self, is_causal: bool):
        self.is_causal = is_causal


def _repeated_single_kv_head(key, value, heads: int, is_causal: bool):
    """``key`` / ``value`` [B, 1, L, D] copied out to [B, heads, L, D], and the module stand-in to call SDPA with.

    With one key/value head, stock's ``repeat_kv`` is a view whose head stride is 0, and PyTorch's memory-efficient
    SDPA kernel (what a masked fp32 / 16-bit call runs on CUDA) returns wrong values for such keys / values when the
    key length is 1 mod 32 (pytorch/pytorch#191937): on the H200, torch 2.11, 8 query heads over 1 of 64, a 65-token
    padded fp32 batch, the last query's output was 400% off the float64 answer (stock's own logits there 67-100%
    off); with the heads copied out, 4.3e-7. Stock transformers runs into it at those lengths; the fused path does
    not (its buckets are multiples of 64, and at any other length this copy keeps it right)."""
    shape = (key.shape[0], heads, *key.shape[2:])
    return key.expand(shape).contiguous(), value.expand(shape).contiguous(), _Ungrouped(is_causal)


class FusedGatedDeltaNet(_FusedModule, Qwen3_5GatedDeltaNet):
    """Gated DeltaNet: one GEMM for ``in_proj_qkv | in_proj_z | in_proj_b | in_proj_a`` -> ``deltanet_prep`` (causal
    conv + SiLU, q/k L2 norm, beta sigmoid, the gate from ``A_log`` / ``dt_bias``, one launch) -> fla's gated delta
    rule (``gated_delta_rule_prefill``: grouped value heads inside the kernel; chunked, or per-token for IEEE fp32) ->
    ``gated_rms_norm`` (z read in place) -> ``out_proj``.

    Covers forwards without a cache, the prefill that fills an empty cache, and calls that continue a cache's state
    (a chunked prefill, a continued turn, decode outside the fused generate path): the cache's conv inputs are put
    in front of the new ones and its recurrent state starts the rule, as in stock. Decode on a fused decode cache
    runs the decode step (``fused_decode``) instead of this forward.
    """

    _fused_kind = "linear_attention"
    _fused_group = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")

    def __init__(self, config, layer_idx: int, plan: FusedPlan):
        super().__init__(config, layer_idx)
        self._init_fused(plan)

    def forward(self, hidden_states, *args, **kwargs):
        if self.plan.runs(self._fused_kind):
            cache = kwargs.get(DELTANET_CACHE_KW, args[0] if args else None)
            if cache is None or not is_recording_past(cache, self.layer_idx):
                attention_mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
                return self._fused_forward(hidden_states, cache, attention_mask)
            self.plan.fallback(self._fused_kind, "the cache records every token's state (assisted decoding), "
                               "which the fused forward does not keep")
        return stock_call(super().forward, hidden_states, *args, **kwargs)

    def _fused_forward(self, hidden_states, cache, attention_mask):
        hidden_states = stock.apply_mask_to_padding_states(hidden_states, attention_mask)
        w, _ = self.packed_weight()
        return self.out_proj(self.core(F.linear(hidden_states, w), cache))

    def core(self, proj, cache):
        """The fused DeltaNet after its one GEMM: ``proj`` [B, T, conv_dim + value_dim + 2 HV] (q|k|v before the
        conv, z, b, a) -> the gated-normed rule output [B, T, value_dim], before ``out_proj``; ``cache`` (None: no
        cache) continued and updated. ``generate_batch``'s mixed step runs the GEMM itself (``fused_batch_mixed``)."""
        ops = self.plan.ops
        mixed_qkv, z, b, a = torch.split(
            proj, [self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads], dim=-1
        )
        initial_state, prefix = None, 0
        if cache is not None:
            if cache.has_previous_state(self.layer_idx):
                initial_state = cached_recurrent_state(cache, self.layer_idx)
            # stock's cache returns its conv inputs [B, C, P + T]: the P cached (or zero-padded) ones, then ours
            window = cache.update_conv_state(mixed_qkv.transpose(1, 2), self.layer_idx,
                                             conv_kernel_size=self.conv_kernel_size)
            prefix = window.shape[-1] - mixed_qkv.shape[1]
            if prefix:  # a continued call: the conv sees the cached inputs first (a few rows of b, a in front)
                mixed_qkv = window.transpose(1, 2).contiguous()  # [B, P + T, C], the kernel's row layout
                b, a = F.pad(b, (0, 0, prefix, 0)), F.pad(a, (0, 0, prefix, 0))
        # One launch: conv + SiLU of the q|k|v columns, the q / k L2 norm, sigmoid(b) and the gate g, so fla's
        # delta rule neither normalises nor copies its inputs.
        query, key, value, beta, g = ops.deltanet_prep(
            mixed_qkv, self.conv1d.weight.squeeze(1), self.conv1d.bias, b, a, self.A_log, self.dt_bias,
            self.num_k_heads, self.head_k_dim, self.head_v_dim,
        )
        if prefix:
            query, key, value, beta, g = (t[:, prefix:].contiguous() for t in (query, key, value, beta, g))
        core, last_state = ops.gated_delta_rule_prefill(
            query, key, value, g, beta, output_final_state=cache is not None, initial_state=initial_state,
        )
        if cache is not None:
            cache.update_recurrent_state(last_state, self.layer_idx)
        # the gate z is read where the GEMM wrote it (a column slice), not copied
        return ops.gated_rms_norm(core, z, self.norm.weight, self.norm.variance_epsilon)  # [B, T, value_dim]


class FusedDecoderLayer(_FusedModule, Qwen3_5DecoderLayer):
    """Decoder layer built from the fused modules; its second norm also does the residual add (``h = x + r;
    y = norm(h)`` in one kernel) and the MLP's down GEMM adds the residual in its epilogue.

    ``__init__`` is stock's with the fused classes (no stock module is built and replaced)."""

    _fused_kind = "decoder_layer"

    def __init__(self, config, layer_idx: int, plan: FusedPlan):
        super(Qwen3_5DecoderLayer, self).__init__()  # stock's bases (GradientCheckpointingLayer, nn.Module)
        self.hidden_size = config.hidden_size
        self.block_type = config.layer_types[layer_idx]
        if self.block_type == "linear_attention":
            self.linear_attn = FusedGatedDeltaNet(config, layer_idx, plan)
        else:
            self.self_attn = FusedAttention(config, layer_idx, plan)
        self.mlp = self._make_mlp(config, plan)
        self.input_layernorm = FusedRMSNorm(config.hidden_size, config.rms_norm_eps, plan)
        self.post_attention_layernorm = FusedRMSNorm(config.hidden_size, config.rms_norm_eps, plan)
        self._init_fused(plan)

    def _make_mlp(self, config, plan: FusedPlan) -> nn.Module:
        """The layer's feed-forward block (the MoE layer builds its sparse block here); it provides ``add_to``."""
        return FusedMLP(config, config.intermediate_size, plan)

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, position_ids=None, **kwargs):
        if not self.plan.runs(self._fused_kind):
            return super().forward(
                hidden_states, position_embeddings, attention_mask=attention_mask, position_ids=position_ids, **kwargs
            )
        cache = pop_cache(kwargs)
        if cache is None:
            cache = _PREFILL_TARGET.get()
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        if self.block_type == "linear_attention":
            hidden_states = self.linear_attn(
                hidden_states=hidden_states, attention_mask=attention_mask, **{DELTANET_CACHE_KW: cache}, **kwargs
            )
        else:
            hidden_states, _ = self.self_attn(
                hidden_states=hidden_states,
                position_embeddings=position_embeddings,
                attention_mask=attention_mask,
                position_ids=position_ids,
                **{ATTENTION_CACHE_KW: cache},
                **kwargs,
            )
        ln = self.post_attention_layernorm
        hidden_states, residual = self.plan.ops.rms_norm(hidden_states, ln.weight, ln.eps, residual=residual)
        return self.mlp.add_to(residual, hidden_states)  # residual is the norm's fresh sum buffer: ours to reuse


def pack_all(text_model) -> None:
    """Pack (or re-pack) every projection group now, outside any capture, so no packing allocates inside one."""
    for module in text_model.modules():
        if isinstance(module, _FusedModule) and module._fused_group:
            module.packed_weight()
