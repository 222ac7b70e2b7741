# Copyright 2026 The Qwen3.5 fused-kernels authors. Licensed under the Apache License, Version 2.0.
"""``generate_batch``'s mixed step: one decode step of the running rows with a chunk of a joining prompt riding on it.

Why: prefilled apart, a prompt holds the running requests up for its length, and each chunk reads every weight once
more. At 9B on the H200 the 512 prompts of the benchmark's workload took 18.8 of its 36.2 s of GPU time, the decode
steps 17.3 (docs/DESIGN.md, "Many requests"), and a decode step of 64 rows reads its weights with its tensor cores
mostly idle. Here every projection, norm and MLP runs once over ``B + C`` rows (the B decode rows, then the C prompt
tokens): the chunk's tokens ride on the decode step's weight reads, and the decode rows on the chunk's compute.

What runs apart is the part of each layer that reads a sequence's own state:

- DeltaNet: the decode rows' conv step and gated delta rule step on their state slots (``DecodeState.deltanet_core``,
  the step's own ops); the chunk's conv and chunked rule from its stock cache (``FusedGatedDeltaNet.core``, the fused
  forward's own code), its state left in that cache;
- attention: the decode rows' ``attn_prep`` + ``decode_attention`` at the shared slot
  (``DecodeState.attention_core``); the chunk's attention over its cached keys and its own, causal
  (``FusedAttention.attend``, the mask the stock text model builds).

Reference: the same tokens as the chunk prefilled by the fused forward over its stock cache
(``BatchEngine._chunk``'s separate forward) followed by the decode step; the CPU tests compare the tokens with whole
prompts and with batch-1 ``generate``.

Not captured in a CUDA graph: the chunk's length and its cache grow from call to call. It runs eagerly, and that is
its cost: at 4B on the H200 a 512-token chunk takes ~100 ms of GPU time, riding or apart, where the captured prefill
of a whole prompt runs at 37 us a token; the GPU waits on the host's launches (~60 ms a chunk, ~10 ms of kernels;
docs/BENCHMARKS.md, "Prompt chunks", ``scripts/profile_chunked_prefill.py``).
"""

import torch

from .fused_compat import MASK_CACHE_KW, stock
from .fused_decode import DecodeState, run_layers


def mixed_step_blocker(text_model, state: DecodeState) -> str | None:
    """Why chunks cannot ride on the decode step of ``state`` (None: they can). Checked once per engine."""
    plan = text_model.plan
    if state.multi_device:
        return "the model is split over devices (device_map)"
    for kind in ("linear_attention", "full_attention"):
        if not plan.runs(kind):
            return f"the {kind} layers run stock's forward ({plan.kind_reasons.get(kind)})"
    return None


def mixed_step(state: DecodeState, text_model, chunk_ids: torch.Tensor, cache, past: int) -> tuple:
    """One decode step of ``state``'s B rows (as :meth:`DecodeState.step`: their embeddings in ``state.embeds``,
    slot and positions moved on) and the prompt chunk ``chunk_ids`` [1, C] at positions ``past`` .. ``past + C - 1``
    continuing ``cache`` (a stock ``DynamicCache`` holding the prompt's first ``past`` tokens; updated in place).

    Returns the decode rows' final-norm hidden state [B, 1, hidden] and the chunk's last token's [1, 1, hidden]."""
    ops = state.ops
    B, C = state.batch, chunk_ids.shape[1]
    chunk = text_model.embed_tokens(chunk_ids)  # [1, C, hidden]
    h = torch.cat([state.embeds.view(B, -1), chunk.view(C, -1)])  # [N, hidden]: the residual stream, B rows first
    cos, sin = state.step_rope(text_model.rotary_emb, state.embeds)  # marks the slot's key, moves positions on
    text_positions = torch.arange(past, past + C, device=chunk.device)[None]  # [1, C]
    chunk_rope = text_model.rotary_emb(chunk, text_positions[None].expand(3, -1, -1))
    # built before any layer adds the chunk to the cache: the mask spans the cached keys and the chunk's
    mask = stock.create_causal_mask(config=text_model.config, inputs_embeds=chunk, attention_mask=None,
                                    position_ids=text_positions, **{MASK_CACHE_KW: cache})

    def mix(layer, x, i):
        if layer.block_type == "linear_attention":
            return _deltanet(state, layer.linear_attn, x, i, B, cache)
        return _attention(state, layer.self_attn, x, i, B, (cos, sin), chunk_rope, mask, text_positions, cache)

    out = run_layers(text_model, ops, h, mix, lambda layer, x: layer.mlp(x[None])[0])  # MLP over all N rows
    state.slot.add_(1)
    return out[:B, None], out[-1:, None]


def _deltanet(state: DecodeState, m, x: torch.Tensor, i: int, B: int, cache) -> torch.Tensor:
    """DeltaNet layer ``i`` over ``x`` [N, hidden]: one GEMM, the decode rows' step and the chunk's rule, one
    ``out_proj``. Returns [N, hidden]."""
    w, _ = m.packed_weight()
    proj = torch.nn.functional.linear(x, w)  # [N, conv_dim + value_dim + 2 HV]
    rows = proj[:B]
    mixed, z, b, a = torch.split(rows, [m.conv_dim, m.value_dim, m.num_v_heads, m.num_v_heads], dim=-1)
    mixed = state.ops.causal_conv1d_step(mixed, state.conv[i], m.conv1d.weight.squeeze(1), m.conv1d.bias)
    decoded = state.deltanet_core(m, mixed, z, b, a, i)  # [B, value_dim]
    prompt = m.core(proj[None, B:], cache)[0]  # [C, value_dim]
    return m.out_proj(torch.cat([decoded, prompt]))


def _attention(state: DecodeState, m, x, i: int, B: int, rope, chunk_rope, mask, text_positions, cache):
    """Attention layer ``i`` over ``x`` [N, hidden]: one GEMM, the decode rows at the shared slot and the chunk over
    its cache, one ``o_proj``. Returns [N, hidden]."""
    w, bias = m.packed_weight()
    qkv = torch.nn.functional.linear(x, w, bias)  # [N, (2 H + 2 KV) D]
    decoded = state.attention_core(m, qkv[:B, None], *rope, state.key_valid, state.slot, i)  # [B, H * D]
    prompt, _ = m.attend(qkv[None, B:], chunk_rope, mask, cache, {"position_ids": text_positions})
    return m.o_proj(torch.cat([decoded, prompt[0]]))
