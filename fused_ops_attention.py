# Copyright 2026 The Qwen3.5 fused-kernels authors. Licensed under the Apache License, Version 2.0.
"""Fused full-attention ops of Qwen3.5: Triton kernels, each beside its plain-torch reference.

- `attn_prep`: split of the fused q|gate, k, v projection -> q / k RMSNorm -> partial (m)RoPE, one launch (for a
  decode step, writing k / v straight into the K/V cache at the step's slot); replaces stock
  `Qwen3_5Attention.forward`'s `chunk` / `q_norm` / `k_norm` / `apply_rotary_pos_emb` chain.
- `sigmoid_gate_mul`: the output gate `o * sigmoid(gate)`; replaces stock's `attn_output * torch.sigmoid(gate)`.
- `decode_attention`: the decode step's attention of one new token over the preallocated K/V cache (split keys,
  GQA, padding mask), merged with the output gate: two launches; replaces SDPA with a boolean mask, then the gate.
- `mrope_step`: the decode step's rotary cos / sin (stock's interleaved mRoPE), positions moved on in place, one
  launch; replaces stock `Qwen3_5TextRotaryEmbedding.forward` for one token.

Each op: kernel -> wrapper (validates; ValueError names the values) -> torch `name_ref` below it (dtypes: runtime).
"""

import torch

from .fused_ops_norm import rms_norm_ref
from .fused_ops_runtime import (
    _DTYPES,
    HAS_TRITON,
    _batch_stride,
    _check_float,
    _check_last_dim_contiguous,
    _check_same_device,
    _check_triton,
    _device_guard,
    _num_warps,
    _pdl_launch,
    _units_per_program,
    pdl_enabled,
    tl,
    triton,
)

if HAS_TRITON:  # the shared `@triton.jit` helpers exist only with triton
    from .fused_ops_runtime import _pdl_wait, _round_to


# ---------------------------------------------------------------------------------------------------------------------
# Attention input prep: split of the fused q|gate, k, v projection -> q/k RMSNorm -> partial RoPE -> gate
# ---------------------------------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit
    def _qk_norm_rope_tile(
        p_x,
        p_o,
        w_ptr,
        p_cos,
        p_sin,
        m_h,
        eps,
        D: tl.constexpr,
        R: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        """Normalise the heads at `p_x` ([BH, 1] pointers to each head's first element) over D, rotate their first
        R dims with the row's cos / sin, and store them at `p_o`, rounding after every step as stock does."""
        o_d = tl.arange(0, BLOCK_D)  # [BD]
        m_d = o_d < D
        m_rot = o_d < R
        # rotate_half partner: dim i < R/2 pairs with i + R/2 (and is negated), dim R/2 <= i < R with i - R/2
        o_p = tl.where(o_d < R // 2, o_d + R // 2, o_d - R // 2)
        o_p = tl.where(m_rot, o_p, o_d)
        m = m_h[:, None] & m_d[None, :]  # [BH, BD]
        m_p = m_h[:, None] & m_rot[None, :]
        dt = p_o.dtype.element_ty

        b_x = tl.load(p_x + o_d[None, :], mask=m, other=0.0).to(tl.float32)  # [BH, BD]
        b_xp = tl.load(p_x + o_p[None, :], mask=m_p, other=0.0).to(tl.float32)  # [BH, BD] partners
        b_rstd = tl.math.rsqrt(tl.sum(b_x * b_x, axis=1) / D + eps)  # [BH]
        b_w = 1.0 + tl.load(w_ptr + o_d, mask=m_d, other=0.0).to(tl.float32)  # [BD]
        b_wp = 1.0 + tl.load(w_ptr + o_p, mask=m_rot, other=0.0).to(tl.float32)
        # q_norm / k_norm output, rounded to the model dtype as `Qwen3_5RMSNorm` returns it
        b_n = _round_to(b_x * b_rstd[:, None] * b_w[None, :], dt)
        b_np = _round_to(b_xp * b_rstd[:, None] * b_wp[None, :], dt)

        b_cos = tl.load(p_cos + o_d, mask=m_rot, other=0.0).to(tl.float32)  # [BD]
        b_sin = tl.load(p_sin + o_d, mask=m_rot, other=0.0).to(tl.float32)
        b_sign = tl.where(o_d < R // 2, -1.0, 1.0)
        # stock `q * cos + rotate_half(q) * sin` in the model dtype: each product and the sum rounded
        b_a = _round_to(b_n * b_cos[None, :], dt)
        b_b = _round_to(b_np * b_sign[None, :] * b_sin[None, :], dt)
        b_o = tl.where(m_rot[None, :], _round_to(b_a + b_b, dt), b_n)
        tl.store(p_o + o_d[None, :], b_o.to(dt), mask=m)

    @triton.jit(do_not_specialize=["T"])
    def _attn_prep_kernel(
        qkv_ptr,
        cos_ptr,
        sin_ptr,
        qw_ptr,
        kw_ptr,
        q_ptr,
        k_ptr,
        v_ptr,
        g_ptr,
        slot_ptr,
        T,
        stride_qkv_b,
        stride_qkv_t,
        stride_cos_b,
        stride_cos_t,
        stride_sin_b,
        stride_sin_t,
        stride_kv_b,
        stride_kv_t,
        stride_kv_h,
        eps,
        H: tl.constexpr,
        KV: tl.constexpr,
        D: tl.constexpr,
        R: tl.constexpr,
        N_QB: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_D: tl.constexpr,
        AT_SLOT: tl.constexpr,
        TOKEN_SLOTS: tl.constexpr,
        PDL: tl.constexpr,
    ):
        _pdl_wait(PDL)  # before any load: an earlier kernel writes this one's inputs
        # program (token, head block): blocks [0, N_QB) hold query heads (+ their gates), the rest key heads (+ v)
        i_bt = tl.program_id(0).to(tl.int64)
        i_g = tl.program_id(1)
        i_b = i_bt // T
        i_t = i_bt % T
        p_row = qkv_ptr + i_b * stride_qkv_b + i_t * stride_qkv_t
        p_cos = cos_ptr + i_b * stride_cos_b + i_t * stride_cos_t
        p_sin = sin_ptr + i_b * stride_sin_b + i_t * stride_sin_t
        o_d = tl.arange(0, BLOCK_D)  # [BD]
        if i_g < N_QB:
            o_h = i_g * BLOCK_H + tl.arange(0, BLOCK_H)  # [BH] query heads
            m_h = o_h < H
            # q_proj output per head is [q (D) | gate (D)]
            p_x = p_row + o_h[:, None] * (2 * D)  # [BH, 1]
            p_o = q_ptr + i_bt * (H * D) + o_h[:, None] * D
            _qk_norm_rope_tile(p_x, p_o, qw_ptr, p_cos, p_sin, m_h, eps, D, R, BLOCK_D)
            m = m_h[:, None] & (o_d < D)[None, :]
            b_g = tl.load(p_x + D + o_d[None, :], mask=m)
            tl.store(g_ptr + i_bt * (H * D) + o_h[:, None] * D + o_d[None, :], b_g, mask=m)
        else:
            o_h = (i_g - N_QB) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BH] key / value heads
            m_h = o_h < KV
            p_x = p_row + H * 2 * D + o_h[:, None] * D  # [BH, 1]
            # k / v rows: [B, T, KV, D] buffers, or (AT_SLOT) position `slot` of [B, KV, L, D] caches, `slot` + t
            # with TOKEN_SLOTS (T > 1: the verify pass; the decode step's T = 1 compiles without the offset)
            if AT_SLOT:
                i_t_kv = tl.load(slot_ptr) + i_t if TOKEN_SLOTS else tl.load(slot_ptr)
            else:
                i_t_kv = i_t
            off = i_b * stride_kv_b + i_t_kv * stride_kv_t + o_h[:, None] * stride_kv_h  # [BH, 1]
            _qk_norm_rope_tile(p_x, k_ptr + off, kw_ptr, p_cos, p_sin, m_h, eps, D, R, BLOCK_D)
            m = m_h[:, None] & (o_d < D)[None, :]
            b_v = tl.load(p_x + KV * D + o_d[None, :], mask=m)
            tl.store(v_ptr + off + o_d[None, :], b_v, mask=m)


def attn_prep(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    kv_cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """Split the fused q|gate, k, v projection, RMSNorm q and k per head, rotate them, and keep the gate: one launch.

    Math per token and head (fp32 inside, rounded to the input dtype after each step exactly where stock rounds):
    `n = rmsnorm(x) * (1 + w)`, `out = n * cos + rotate_half(n) * sin` on dims [0, R), `out = n` on [R, D).

    Args:
        qkv: [B, T, H*2*D + KV*D + KV*D] float32 / bfloat16 / float16, the last-dim concatenation of stock
            `q_proj(x)` (per head [q (D) | gate (D)]), `k_proj(x)` and `v_proj(x)`; last dim contiguous, batch and
            token strides arbitrary.
        cos, sin: [B, T, R] or [1, T, R] (or batch stride 0), same dtype as qkv, as returned by stock
            `Qwen3_5TextRotaryEmbedding` (mRoPE sections interleaved, frequencies repeated); R even, 0 < R <= D;
            last dim contiguous.
        q_weight, k_weight: [D] contiguous, any float dtype: `q_norm.weight`, `k_norm.weight` (zero-centred).
        eps: `config.rms_norm_eps`.
        num_heads, num_kv_heads, head_dim: H, KV, D.
        kv_cache: optional `(keys, values, slot)` for a decode step: caches [B, KV, L, D] in qkv's dtype, last dim
            contiguous, and slot [1] int64 on the device; token t's k and v are written at
            position `slot` + t of the caches (read on the GPU: capturable) instead of into new buffers (T > 1: the
            speculative verify pass's tokens). `slot` + T <= L is the caller's to keep (checking it would wait for
            the GPU); the decode cache refuses a step once it is full.

    Returns:
        `(q, k, v, gate)`: q [B, H, T, D], k and v [B, KV, T, D], each a `.transpose(1, 2)` view of a contiguous
        [B, T, heads, D] buffer (the layout stock hands to the attention function); gate [B, T, H*D] contiguous.
        v and gate are exact copies. With `kv_cache`, k and v are None (they are in the caches).

    Replaces the chain in stock `Qwen3_5Attention.forward` from `torch.chunk(q_proj(...))` through `q_norm`,
    `k_norm`, the v view and `apply_rotary_pos_emb`. Rounding: stock's exactly (each product and sum of the
    rotation rounded to the dtype, which costs a few register ops), so the only differences come from the fp32
    sum of squares (another order) and, on the GPU, the approximate rsqrt; they move a bf16 / fp16 result by one
    unit in the last place, rarely. v and gate are bit-exact.
    """
    _check_triton("attn_prep")
    H, KV, D = num_heads, num_kv_heads, head_dim
    if min(H, KV, D) < 1:
        raise ValueError(f"num_heads, num_kv_heads, head_dim must be positive, got {H}, {KV}, {D}.")
    _check_float("qkv", qkv)
    width = H * 2 * D + 2 * KV * D
    if qkv.dim() != 3 or qkv.shape[-1] != width:
        raise ValueError(
            f"qkv must be [B, T, H*2*D + 2*KV*D] = [B, T, {width}] for H={H}, KV={KV}, D={D}, "
            f"got {tuple(qkv.shape)}."
        )
    B, T = qkv.shape[:2]
    if cos.shape != sin.shape:
        raise ValueError(f"cos and sin must have one shape, got {tuple(cos.shape)} and {tuple(sin.shape)}.")
    if cos.dim() != 3 or cos.shape[0] not in (1, B) or cos.shape[1] != T:
        raise ValueError(f"cos / sin must be [{B} or 1, {T}, R] for qkv {tuple(qkv.shape)}, got {tuple(cos.shape)}.")
    R = cos.shape[-1]
    if R < 2 or R % 2 or R > D:
        raise ValueError(f"the rotary dim R = cos.shape[-1] must be even and in [2, head_dim={D}], got {R}.")
    if cos.dtype != qkv.dtype or sin.dtype != qkv.dtype:
        raise ValueError(f"cos / sin must have qkv's dtype {qkv.dtype}, got {cos.dtype} / {sin.dtype}.")
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w.shape != (D,):
            raise ValueError(f"{name} must have shape ({D},), got {tuple(w.shape)}.")
        _check_float(name, w)
        _check_last_dim_contiguous(name, w)
    for name, t in (("qkv", qkv), ("cos", cos), ("sin", sin)):
        _check_last_dim_contiguous(name, t)
    _check_same_device(qkv=qkv, cos=cos, sin=sin, q_weight=q_weight, k_weight=k_weight)
    if kv_cache is not None:
        k, v, slot = kv_cache
        if k.dim() != 4 or k.shape[:2] != (B, KV) or k.shape[3] != D or v.shape != k.shape:
            raise ValueError(f"kv_cache keys / values must be [B, KV, L, D] = [{B}, {KV}, L, {D}], got "
                             f"{tuple(k.shape)} / {tuple(v.shape)}.")
        if k.dtype != qkv.dtype or v.dtype != qkv.dtype or k.stride() != v.stride():
            raise ValueError(f"kv_cache keys / values must have qkv's dtype {qkv.dtype} and one layout, got "
                             f"{k.dtype} / {v.dtype}, strides {k.stride()} / {v.stride()}.")
        if slot.numel() != 1 or slot.dtype != torch.long:
            raise ValueError(f"kv_cache slot must be a one-element int64 tensor, got {tuple(slot.shape)} {slot.dtype}.")
        _check_last_dim_contiguous("kv_cache keys", k)
        _check_same_device(qkv=qkv, keys=k, values=v, slot=slot)
        stride_kv = (k.stride(0), k.stride(2), k.stride(1))  # (row, position, head)
    else:
        k = torch.empty(B, T, KV, D, dtype=qkv.dtype, device=qkv.device)  # [B, T, KV, D]
        v = torch.empty(B, T, KV, D, dtype=qkv.dtype, device=qkv.device)  # [B, T, KV, D]
        slot = k
        stride_kv = (T * KV * D, KV * D, D)

    q = torch.empty(B, T, H, D, dtype=qkv.dtype, device=qkv.device)  # [B, T, H, D]
    gate = torch.empty(B, T, H * D, dtype=qkv.dtype, device=qkv.device)  # [B, T, H*D]
    n_rows = B * T
    if n_rows > 0:
        BLOCK_D = triton.next_power_of_2(D)
        BLOCK_H = _units_per_program(n_rows * (H + KV), BLOCK_D, cap=KV)
        n_qb = triton.cdiv(H, BLOCK_H)
        grid = (n_rows, n_qb + triton.cdiv(KV, BLOCK_H))

        with _device_guard(qkv):
            pdl = pdl_enabled(qkv.device)
            _attn_prep_kernel[grid](
                qkv,
                cos,
                sin,
                q_weight,
                k_weight,
                q,
                k,
                v,
                gate,
                slot,
                T,
                qkv.stride(0),
                qkv.stride(1),
                _batch_stride(cos),
                cos.stride(1),
                _batch_stride(sin),
                sin.stride(1),
                *stride_kv,
                eps,
                H=H,
                KV=KV,
                D=D,
                R=R,
                N_QB=n_qb,
                BLOCK_H=BLOCK_H,
                BLOCK_D=BLOCK_D,
                AT_SLOT=kv_cache is not None,
                TOKEN_SLOTS=kv_cache is not None and T > 1,
                num_warps=_num_warps(BLOCK_H * BLOCK_D),
                PDL=pdl,
                **_pdl_launch(pdl),
            )
    if kv_cache is not None:
        return q.transpose(1, 2), None, None, gate
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), gate


def attn_prep_ref(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    kv_cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """Plain-torch `attn_prep`, step by step as stock `Qwen3_5Attention.forward` computes it (with `kv_cache`, k / v
    copied into the caches at `slot` + t with `index_copy_`, as the decode step did before the kernel wrote them)."""
    if kv_cache is not None:
        q, k, v, gate = attn_prep_ref(qkv, cos, sin, q_weight, k_weight, eps, num_heads, num_kv_heads, head_dim)
        keys, values, slot = kv_cache
        at = slot + torch.arange(qkv.shape[1], device=slot.device)
        keys.index_copy_(2, at, k)
        values.index_copy_(2, at, v)
        return q, None, None, gate
    H, KV, D = num_heads, num_kv_heads, head_dim
    B, T = qkv.shape[:2]
    q_gate, k, v = torch.split(qkv, [H * 2 * D, KV * D, KV * D], dim=-1)
    q, gate = torch.chunk(q_gate.view(B, T, H, 2 * D), 2, dim=-1)  # [B, T, H, D] each
    gate = gate.reshape(B, T, H * D)
    q = rms_norm_ref(q, q_weight, eps).transpose(1, 2)  # [B, H, T, D]
    k = rms_norm_ref(k.reshape(B, T, KV, D), k_weight, eps).transpose(1, 2)  # [B, KV, T, D]
    v = v.reshape(B, T, KV, D).transpose(1, 2)  # [B, KV, T, D]

    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [B, 1, T, R]
    R = cos.shape[-1]

    def rotate(x):
        x_rot, x_pass = x[..., :R], x[..., R:]
        x1, x2 = x_rot[..., : R // 2], x_rot[..., R // 2 :]
        return torch.cat([x_rot * cos + torch.cat([-x2, x1], dim=-1) * sin, x_pass], dim=-1)

    return rotate(q), rotate(k), v, gate


# ---------------------------------------------------------------------------------------------------------------------
# Output gate of full attention: o * sigmoid(gate)
# ---------------------------------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit(do_not_specialize=["T"])
    def _sigmoid_gate_mul_kernel(
        o_ptr,
        g_ptr,
        y_ptr,
        T,
        stride_o_b,
        stride_o_t,
        stride_o_h,
        stride_o_d,
        stride_g_b,
        stride_g_t,
        H: tl.constexpr,
        D: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        i_bt = tl.program_id(0).to(tl.int64)
        i_b = i_bt // T
        i_t = i_bt % T
        o_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BH]
        o_d = tl.arange(0, BLOCK_D)  # [BD]
        m = (o_h < H)[:, None] & (o_d < D)[None, :]  # [BH, BD]
        dt = y_ptr.dtype.element_ty

        p_o = o_ptr + i_b * stride_o_b + i_t * stride_o_t + o_h[:, None] * stride_o_h + o_d[None, :] * stride_o_d
        b_o = tl.load(p_o, mask=m, other=0.0).to(tl.float32)
        b_g = tl.load(g_ptr + i_b * stride_g_b + i_t * stride_g_t + o_h[:, None] * D + o_d[None, :], mask=m, other=0.0)
        # stock rounds torch.sigmoid(gate) to the model dtype before the product
        b_s = _round_to(1.0 / (1.0 + tl.exp(-b_g.to(tl.float32))), dt)
        b_y = _round_to(b_o * b_s, dt)
        tl.store(y_ptr + i_bt * (H * D) + o_h[:, None] * D + o_d[None, :], b_y.to(dt), mask=m)


def sigmoid_gate_mul(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Gate the attention output: `y = o * sigmoid(gate)`, reading `o` in whatever layout attention left it.

    Math: `y = o * sigmoid(gate)` (sigmoid rounded to the dtype, then the product, as stock).

    Args:
        o: [B, T, H, D] float32 / bfloat16 / float16 with arbitrary strides (e.g. an attention output
            [B, H, T, D] `.transpose(1, 2)`), or [B, T, H*D] with any strides.
        gate: [B, T, H*D], same dtype and device as o; last dim contiguous, batch and token strides arbitrary
            (the `gate` returned by `attn_prep`).

    Returns:
        y [B, T, H*D] contiguous, in o.dtype.

    Replaces stock `attn_output.reshape(*input_shape, -1).contiguous()` and `attn_output * torch.sigmoid(gate)`
    in `Qwen3_5Attention.forward`.
    """
    _check_triton("sigmoid_gate_mul")
    _check_float("o", o)
    if o.dim() == 3:
        o = o.unsqueeze(2)  # [B, T, 1, H*D]
    if o.dim() != 4:
        raise ValueError(f"o must be [B, T, H, D] or [B, T, H*D], got {tuple(o.shape)}.")
    B, T, H, D = o.shape
    if gate.shape != (B, T, H * D):
        raise ValueError(
            f"gate must be [B, T, H*D] = {(B, T, H * D)} to match o {tuple(o.shape)}, got {tuple(gate.shape)}."
        )
    if gate.dtype != o.dtype:
        raise ValueError(f"gate must have o's dtype {o.dtype}, got {gate.dtype}.")
    _check_last_dim_contiguous("gate", gate)
    _check_same_device(o=o, gate=gate)

    y = torch.empty(B, T, H * D, dtype=o.dtype, device=o.device)
    n_rows = B * T
    if n_rows > 0 and H * D > 0:
        BLOCK_D = triton.next_power_of_2(D)
        BLOCK_H = _units_per_program(n_rows * H, BLOCK_D, cap=H)
        with _device_guard(o):
            _sigmoid_gate_mul_kernel[(n_rows, triton.cdiv(H, BLOCK_H))](
                o,
                gate,
                y,
                T,
                *o.stride(),
                gate.stride(0),
                gate.stride(1),
                H=H,
                D=D,
                BLOCK_H=BLOCK_H,
                BLOCK_D=BLOCK_D,
                num_warps=_num_warps(BLOCK_H * BLOCK_D),
            )
    return y


def sigmoid_gate_mul_ref(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Plain-torch `sigmoid_gate_mul`, as stock `Qwen3_5Attention.forward` computes it."""
    return o.reshape(*gate.shape).contiguous() * torch.sigmoid(gate)


# ---------------------------------------------------------------------------------------------------------------------
# Decode attention: one query token per row over the preallocated K/V cache, GQA, padding mask, output gate
#
# Why our own kernel: through SDPA with a boolean mask, the decode step's attention ran cuDNN's prefill flash kernel
# (64 x 128 query tiles for one query row) at 16.8 us per layer for a 256-key cache (H200, 2026-11-30; the 4B
# layer reads 1 MB of K/V, 0.25 us of bandwidth), then the gate as a second launch. Here the keys are split across
# programs (flash-decoding), each program serving all query heads of one KV head with two tensor-core dots per block
# of keys, and a second launch merges the splits and applies `o * sigmoid(gate)`. Keys after `slot` (the newest
# key) are not read, so a long preallocated cache costs only the keys written so far.
#
# The splits take the written blocks of keys round robin (split s: blocks s, s + S, s + 2S, ...), not one contiguous
# range each: the cache is a power-of-two bucket, and a 32,832-key context in its 65,536-key bucket left the ranges
# of 15 of 32 splits empty, so half the programs did all the work (4B, 32k context, H200, 2026-12-02: 4.04 ms a token
# against 2.60 at a short context; docs/DESIGN.md).
# ---------------------------------------------------------------------------------------------------------------------

_DA_BLOCK_L = 32  # keys per iteration (tl.dot needs >= 16)
_DA_MIN_SPLIT = 64  # a cache of L keys takes at most L / _DA_MIN_SPLIT splits (a short cache: few partials to merge)
_DA_PROGRAMS = 256  # split programs aimed at in all (B x KV x splits): about two per SM of an H200 (132 SMs)
_DA_FEWEST_SPLITS = 32  # a long cache takes at least this many splits per row and KV head, however many rows
_DA_MAX_SPLITS = 128  # and at most this many (the merge kernel's tile)
# From this many (row, KV head) pairs on (generate_batch's many rows), at least _DA_CROWDED_SPLITS splits a pair in
# place of _DA_FEWEST_SPLITS: 32 splits of a 1,142-key window leave each program about one block of 32 keys, and the
# [G, D] fp32 partials written and merged back add 268 MB a layer to its 1.2 GB of keys / values (4B, 256 rows, H100
# profile: split 630 us and merge 175 us a layer against 400 us of K/V at the copy rate). With it, generate_batch's
# decode steps took 2.2% less (4B, 256 rows, H100, one process: 12.36 against 12.64 s over one workload; DESIGN).
_DA_CROWDED_PAIRS = 256
_DA_CROWDED_SPLITS = 4
# Value loads masked by the valid marks: a stale NaN at an invalid position would otherwise reach the output as
# 0 x NaN. It adds one-byte loads of the marks to the sm_90 code (26 load instructions against 2; bf16, head dim
# 256), and generate_batch's decode steps took 3% longer with it (4B, 256 rows, H100: 13.23 against 12.83 s over one
# workload); `contiguous` (generate_batch's rows, `fused_decode.ROW_WINDOWS`) masks by the key index instead, and
# loads no mark.
_DA_MASK_VALUES = True
# The running max of a split that has seen no valid key is -1e30 (written inline in the kernels), not -inf: finite,
# so its weight exp(-1e30 - m) in the merge is 0 rather than NaN.

if HAS_TRITON:

    @triton.jit(do_not_specialize=["stride_valid_b", "L", "S"])
    def _decode_attention_split_kernel(
        q_ptr, k_ptr, v_ptr, valid_ptr, slot_ptr, start_ptr, m_ptr, l_ptr, acc_ptr,
        stride_q_b, stride_q_h, stride_k_b, stride_k_h, stride_k_l, stride_v_b, stride_v_h, stride_v_l,
        stride_valid_b, L, S, scale,
        H: tl.constexpr, KV: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_L: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, HAS_START: tl.constexpr,
        RANGE: tl.constexpr, MASK_VALUES: tl.constexpr, PDL: tl.constexpr,
    ):
        _pdl_wait(PDL)  # before any load: an earlier kernel writes this one's inputs
        # program (row b, KV head, split s): query heads [kv * G, (kv + 1) * G) against key blocks s, s + S, ...
        i_b = tl.program_id(0) // KV
        i_kv = tl.program_id(0) % KV
        i_s = tl.program_id(1)
        G = H // KV
        o_g = tl.arange(0, BLOCK_G)
        o_d = tl.arange(0, BLOCK_D)
        m_g = o_g < G
        m_d = o_d < D
        i_h = i_kv * G + o_g  # [BG] query heads
        b_q = tl.load(q_ptr + i_b * stride_q_b + i_h[:, None] * stride_q_h + o_d[None, :],
                      mask=m_g[:, None] & m_d[None, :], other=0.0)  # [BG, BD]
        n_keys = tl.minimum(tl.load(slot_ptr) + 1, L)
        n_blocks = tl.cdiv(n_keys, BLOCK_L)
        row_first = 0  # the row's first valid key (with RANGE: its keys row_first..slot are exactly the valid ones)
        if HAS_START:
            row_first = tl.load(start_ptr + i_b)
        first = row_first // BLOCK_L  # the first key block the row may hold a valid key in
        b_m = tl.full([BLOCK_G], -1.0e30, tl.float32)
        b_l = tl.zeros([BLOCK_G], tl.float32)
        b_acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        p_k = k_ptr + i_b.to(tl.int64) * stride_k_b + i_kv * stride_k_h
        p_v = v_ptr + i_b.to(tl.int64) * stride_v_b + i_kv * stride_v_h
        for i_blk in range(first + i_s, n_blocks, S):  # S is a run-time value: a longer cache compiles nothing new
            o_l = i_blk * BLOCK_L + tl.arange(0, BLOCK_L)
            m_l = o_l < n_keys
            if RANGE:
                ok = m_l & (o_l >= row_first)
            else:
                ok = tl.load(valid_ptr + i_b * stride_valid_b + o_l, mask=m_l, other=0) != 0
            m_kv = m_l[:, None] & m_d[None, :]
            b_k = tl.load(p_k + o_l[:, None] * stride_k_l + o_d[None, :], mask=m_kv, other=0.0)  # [BL, BD]
            if UPCAST:  # the interpreter (CPU) mis-multiplies 16-bit dots; fp32 products of 16-bit values are exact
                b_s = tl.dot(b_q.to(tl.float32), tl.trans(b_k.to(tl.float32)), input_precision="ieee")
            else:
                b_s = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PRECISION)
            b_s = b_s * scale  # [BG, BL] fp32
            b_s = tl.where(ok[None, :], b_s, float("-inf"))
            m_new = tl.maximum(b_m, tl.max(b_s, axis=1))
            alpha = tl.exp(b_m - m_new)
            b_p = tl.exp(b_s - m_new[:, None])
            b_l = b_l * alpha + tl.sum(b_p, axis=1)
            if MASK_VALUES:  # invalid positions load as zeros: their weight is 0, but 0 x a stale NaN is NaN
                b_v = tl.load(p_v + o_l[:, None] * stride_v_l + o_d[None, :], mask=m_kv & ok[:, None], other=0.0)
            else:
                b_v = tl.load(p_v + o_l[:, None] * stride_v_l + o_d[None, :], mask=m_kv, other=0.0)  # [BL, BD]
            # p rounded to the cache dtype for the second dot, as flash attention kernels round it
            v_dt = b_v.dtype
            b_p = _round_to(b_p, v_dt)
            if UPCAST:
                b_pv = tl.dot(b_p, b_v.to(tl.float32), input_precision="ieee")
            else:
                b_pv = tl.dot(b_p.to(v_dt), b_v, input_precision=DOT_PRECISION)
            b_acc = b_acc * alpha[:, None] + b_pv
            b_m = m_new
        row = (i_b * H + i_h) * S + i_s  # [BG] rows of the [B, H, S] partials
        tl.store(m_ptr + row, b_m, mask=m_g)
        tl.store(l_ptr + row, b_l, mask=m_g)
        tl.store(acc_ptr + row.to(tl.int64)[:, None] * D + o_d[None, :], b_acc, mask=m_g[:, None] & m_d[None, :])

    @triton.jit(do_not_specialize=["S"])
    def _decode_attention_merge_kernel(
        m_ptr, l_ptr, acc_ptr, gate_ptr, y_ptr, S, stride_gate_b,
        H: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
        PDL: tl.constexpr,
    ):
        _pdl_wait(PDL)  # before any load: an earlier kernel writes this one's inputs
        # program (row b, query head h): merge the S splits, round as SDPA's output, then o * sigmoid(gate)
        i_bh = tl.program_id(0)
        i_b = i_bh // H
        i_h = i_bh % H
        o_s = tl.arange(0, BLOCK_S)
        o_d = tl.arange(0, BLOCK_D)
        m_s = o_s < S
        m_d = o_d < D
        b_m = tl.load(m_ptr + i_bh * S + o_s, mask=m_s, other=-1.0e30)
        b_l = tl.load(l_ptr + i_bh * S + o_s, mask=m_s, other=0.0)
        b_w = tl.exp(b_m - tl.max(b_m, axis=0))  # [BS]; 0 for splits without a valid key
        rows = (i_bh * S + o_s).to(tl.int64)
        b_acc = tl.load(acc_ptr + rows[:, None] * D + o_d[None, :], mask=m_s[:, None] & m_d[None, :], other=0.0)
        den = tl.sum(b_w * b_l, axis=0)  # 0 only for a row without a valid key (its output is then 0)
        b_o = tl.sum(b_acc * b_w[:, None], axis=0) / tl.where(den > 0, den, 1.0)  # [BD]
        dt = y_ptr.dtype.element_ty
        b_o = _round_to(b_o, dt)
        b_g = tl.load(gate_ptr + i_b * stride_gate_b + i_h * D + o_d, mask=m_d, other=0.0).to(tl.float32)
        b_sg = _round_to(1.0 / (1.0 + tl.exp(-b_g)), dt)  # as sigmoid_gate_mul: sigmoid rounded, then the product
        tl.store(y_ptr + i_b * (H * D) + i_h * D + o_d, _round_to(b_o * b_sg, dt).to(dt), mask=m_d)


def _decode_attention_splits(L: int, heads: int) -> int:
    """Split programs per row and KV head for a cache of L keys and `heads` = B x KV (row, KV head) pairs: about
    _DA_PROGRAMS programs in all, between _DA_FEWEST_SPLITS and _DA_MAX_SPLITS per pair, and one per _DA_MIN_SPLIT
    keys of L at most. The splits share the written key blocks round robin, whatever part of L is written.

    H200, bf16, head dim 256, a 32,832-key context in its 65,536-key bucket (docs/DESIGN.md): 4 KV heads at batch 1
    ran 63.5 / 44.1 / 51.2 us at 32 / 64 / 128 splits, 2 KV heads 56.1 / 38.1 / 29.6; 32 KV-head rows (batch 8) ran
    262.5 / 272.4 / 275.3: two programs an SM, and no fewer than 32 splits once the rows fill the card."""
    fewest = _DA_CROWDED_SPLITS if heads >= _DA_CROWDED_PAIRS else _DA_FEWEST_SPLITS
    want = max(fewest, _DA_PROGRAMS // max(1, heads))
    return max(1, min(_DA_MAX_SPLITS, want, triton.cdiv(L, _DA_MIN_SPLIT)))


def decode_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor,
    slot: torch.Tensor,
    gate: torch.Tensor,
    scale: float,
    start: torch.Tensor | None = None,
    contiguous: bool = False,
) -> torch.Tensor:
    """Gated attention of one new token per row over a preallocated K/V cache: `o * sigmoid(gate)`, where `o` is
    softmax attention of q over the cache's keys 0..slot that `valid` marks (padding excluded). Two launches.

    Args:
        q: [B, H, D] float32 / bfloat16 / float16, last dim contiguous (the query, normed and rotated).
        keys, values: [B, KV, L, D], q's dtype, last dim contiguous; query head h reads KV head h // (H / KV).
        valid: [B, L] bool, contiguous rows: which cache positions hold a real (non-padding) key.
        slot: [1] int64 on q's device: the newest key's position; positions after it are not read.
        gate: [B, H * D], q's dtype, last dim contiguous (`attn_prep`'s gate).
        scale: the softmax scale (stock's `head_dim ** -0.5`).
        start: optional [B] int64 on q's device, read on the device: row b's keys before `start[b]` are not valid
            (the caller vouches) and not read. `generate_batch` keeps each row's window start there (a row reads
            its own keys, not the whole span of the rows' windows) and L for a free row (it reads nothing). None:
            from 0.
        contiguous: with `start`, the caller vouches that row b's valid keys are exactly start[b]..slot, and
            `valid` is not read: the key index alone masks scores and values (`generate_batch`'s rows, whose
            windows are contiguous; no one-byte mark loads in the key loop).

    Returns:
        y [B, H * D] in q's dtype: the attention output rounded to the dtype (as SDPA returns it), times
        `sigmoid(gate)` rounded, rounded (as `sigmoid_gate_mul`); zeros for a row without a valid key (SDPA gives
        NaN there).

    Replaces, in the decode step, `F.scaled_dot_product_attention(q, keys, values, attn_mask=valid)` over the whole
    cache and `sigmoid_gate_mul`. fp32 runs its dots in IEEE fp32. No host sync: capturable.
    """
    _check_triton("decode_attention")
    for name, t in (("q", q), ("keys", keys), ("values", values), ("gate", gate)):
        _check_float(name, t)
    if q.dim() != 3 or keys.dim() != 4 or values.shape != keys.shape:
        raise ValueError(f"decode_attention needs q [B, H, D] and keys / values [B, KV, L, D], got "
                         f"{tuple(q.shape)}, {tuple(keys.shape)}, {tuple(values.shape)}.")
    B, H, D = q.shape
    _, KV, L, _ = keys.shape
    if keys.shape[0] != B or keys.shape[3] != D or KV < 1 or H % KV:
        raise ValueError(f"keys must be [B={B}, KV, L, D={D}] with H={H} a multiple of KV, got {tuple(keys.shape)}.")
    if keys.dtype != q.dtype or values.dtype != q.dtype or gate.dtype != q.dtype:
        raise ValueError(f"q, keys, values and gate must have one dtype, got {q.dtype}, {keys.dtype}, "
                         f"{values.dtype}, {gate.dtype}.")
    if valid.shape != (B, L) or valid.dtype != torch.bool:
        raise ValueError(f"valid must be [B, L] = {(B, L)} bool, got {tuple(valid.shape)} {valid.dtype}.")
    if slot.numel() != 1 or slot.dtype != torch.long:
        raise ValueError(f"slot must be a one-element int64 tensor, got {tuple(slot.shape)} {slot.dtype}.")
    if gate.shape != (B, H * D):
        raise ValueError(f"gate must be [B, H*D] = {(B, H * D)}, got {tuple(gate.shape)}.")
    for name, t in (("q", q), ("keys", keys), ("values", values), ("valid", valid), ("gate", gate)):
        _check_last_dim_contiguous(name, t)
    if start is not None and (start.shape != (B,) or start.dtype != torch.long):
        raise ValueError(f"start must be [B] = {(B,)} int64, got {tuple(start.shape)} {start.dtype}.")
    if contiguous and start is None:
        raise ValueError("contiguous=True needs start (each row's first valid key): pass start, or contiguous=False.")
    _check_same_device(q=q, keys=keys, values=values, valid=valid, slot=slot, gate=gate,
                       **({} if start is None else {"start": start}))

    y = torch.empty(B, H * D, dtype=q.dtype, device=q.device)
    if B == 0 or L == 0:
        return y
    S = _decode_attention_splits(L, B * KV)
    m = torch.empty(B, H, S, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    acc = torch.empty(B, H, S, D, dtype=torch.float32, device=q.device)
    BLOCK_D = triton.next_power_of_2(D)
    with _device_guard(q):
        pdl = pdl_enabled(q.device)
        _decode_attention_split_kernel[(B * KV, S)](
            q, keys, values, valid, slot, slot if start is None else start, m, l, acc,
            q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), keys.stride(2),
            values.stride(0), values.stride(1), values.stride(2), valid.stride(0), L, S, float(scale),
            H=H, KV=KV, D=D, BLOCK_G=max(16, triton.next_power_of_2(H // KV)), BLOCK_D=BLOCK_D, BLOCK_L=_DA_BLOCK_L,
            DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            UPCAST=q.device.type == "cpu", HAS_START=start is not None, RANGE=contiguous,
            MASK_VALUES=_DA_MASK_VALUES or contiguous, num_warps=4,
            PDL=pdl, **_pdl_launch(pdl),
        )
        _decode_attention_merge_kernel[(B * H,)](
            m, l, acc, gate, y, S, gate.stride(0),
            H=H, D=D, BLOCK_S=_DA_MAX_SPLITS, BLOCK_D=BLOCK_D, num_warps=_num_warps(_DA_MAX_SPLITS * BLOCK_D),
            PDL=pdl, **_pdl_launch(pdl),
        )
    return y


def decode_attention_ref(q, keys, values, valid, slot, gate, scale, start=None, contiguous=False):
    """Plain-torch `decode_attention`: SDPA with the padding mask (and nothing after `slot`, nor before `start`;
    with `contiguous`, the window start..slot in place of the mask), then stock's gate; zeros for a row without a
    valid key."""
    B, H, D = q.shape
    KV, L = keys.shape[1], keys.shape[2]
    at = torch.arange(L, device=valid.device)
    if contiguous and start is None:
        raise ValueError("contiguous=True needs start (each row's first valid key): pass start, or contiguous=False.")
    mask = (torch.ones_like(valid) if contiguous else valid) & (at <= slot.to(valid.device))[None, :]  # [B, L]
    if start is not None:
        mask = mask & (at[None, :] >= start.to(valid.device)[:, None])
    o = torch.nn.functional.scaled_dot_product_attention(
        q.reshape(B, KV, H // KV, D), keys, values, attn_mask=mask[:, None, None, :], scale=scale
    )  # [B, KV, G, D]
    o = torch.where(mask.any(-1)[:, None, None, None], o, torch.zeros_like(o))
    return sigmoid_gate_mul_ref(o.reshape(B, 1, H, D), gate.view(B, 1, H * D)).view(B, H * D)


# ---------------------------------------------------------------------------------------------------------------------
# The decode step's rotary cos / sin: stock's interleaved mRoPE for one token per row, positions moved on in place
#
# Why our own kernel: stock's rotary module takes 14 launches a token (slices and concatenations recomposing the
# t / h / w rows), and its plain-torch rewrite (`mrope_step_ref`) still 7 plus the positions' increment, each a
# launch gap on the step's critical path. One program per row gathers each dimension's position and frequency,
# takes the same float32 angle through the same cos / sin, and moves the positions on after it has read them.
# ---------------------------------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit(do_not_specialize=["stride_ps", "stride_valid"])
    def _mrope_step_kernel(
        pos_ptr, sec_ptr, f_ptr, cos_ptr, sin_ptr, valid_ptr, slot_ptr, stride_ps, stride_pb, stride_valid, R, scaling,
        SCALE: tl.constexpr, ADVANCE: tl.constexpr, MARK: tl.constexpr, BLOCK_R: tl.constexpr, PDL: tl.constexpr,
    ):
        b = tl.program_id(0)
        o_r = tl.arange(0, BLOCK_R)
        m_r = o_r < R
        b_sec = tl.load(sec_ptr + o_r, mask=m_r, other=0)  # the plan: never written by a kernel, read before the wait
        b_f = tl.load(f_ptr + o_r, mask=m_r, other=0.0)
        _pdl_wait(PDL)  # the positions were moved on by the step before
        b_p = tl.load(pos_ptr + b_sec * stride_ps + b * stride_pb, mask=m_r, other=0)
        angle = b_p.to(tl.float32) * b_f  # stock: position.float() times inv_freq, one float32 product
        b_c = tl.cos(angle)
        b_s = tl.sin(angle)
        if SCALE:
            b_c = b_c * scaling
            b_s = b_s * scaling
        dt = cos_ptr.dtype.element_ty
        tl.store(cos_ptr + b * R + o_r, _round_to(b_c, dt).to(dt), mask=m_r)
        tl.store(sin_ptr + b * R + o_r, _round_to(b_s, dt).to(dt), mask=m_r)
        if MARK:  # the key the step writes at `slot` is valid from this step on
            tl.store(valid_ptr + b.to(tl.int64) * stride_valid + tl.load(slot_ptr), 1)
        if ADVANCE:
            tl.debug_barrier()  # every thread has read its position before any moves on
            o_s = tl.arange(0, 4)
            p_s = pos_ptr + o_s * stride_ps + b * stride_pb
            tl.store(p_s, tl.load(p_s, mask=o_s < 3, other=0) + 1, mask=o_s < 3)


def _check_mrope_step(positions, sections, freqs, mark_valid=None) -> None:
    if positions.dim() != 3 or positions.shape[0] != 3 or positions.shape[2] != 1 or positions.dtype != torch.long:
        raise ValueError(f"mrope_step needs int64 positions [3, B, 1] (t / h / w rows), got {tuple(positions.shape)} "
                         f"{positions.dtype}.")
    if sections.dim() != 1 or freqs.shape != sections.shape or freqs.dtype != torch.float32:
        raise ValueError(f"mrope_step needs sections [R] and float32 freqs [R], got {tuple(sections.shape)} and "
                         f"{tuple(freqs.shape)} {freqs.dtype}.")
    _check_same_device(positions=positions, sections=sections, freqs=freqs)
    if mark_valid is not None:
        valid, slot = mark_valid
        B = positions.shape[1]
        if valid.dtype != torch.bool or valid.dim() != 2 or valid.shape[0] != B or valid.stride(1) != 1:
            raise ValueError(f"mrope_step's mark_valid needs a bool [B, L] mask (B = {B}, last dim "
                             f"contiguous), got {tuple(valid.shape)} {valid.dtype}.")
        if slot.shape != (1,) or slot.dtype != torch.long:
            raise ValueError(f"mrope_step's mark_valid needs an int64 slot of shape (1,), got {tuple(slot.shape)} "
                             f"{slot.dtype}.")
        _check_same_device(positions=positions, valid=valid, slot=slot)


def mrope_step(
    positions: torch.Tensor, sections: torch.Tensor, freqs: torch.Tensor, scaling: float, dtype: torch.dtype,
    advance: bool = False, mark_valid: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, R] in `dtype` of one token per row, equal to stock's interleaved-mRoPE rotary module
    (`Qwen3_5TextRotaryEmbedding` with a static rope type) at `positions`; one launch.

    Args:
        positions: [3, B, 1] int64, the t / h / w position rows (stock's `position_ids` for one token).
        sections: [R] int64 (0 / 1 / 2): the position row dimension d reads (the model's `_rope_plan`).
        freqs: [R] float32: dimension d's frequency, `inv_freq[d mod R/2]`.
        scaling: the module's `attention_scaling`, multiplied in float32 as stock does (skipped when 1.0, which
            changes nothing).
        dtype: float32 / bfloat16 / float16, the hidden states' dtype (stock rounds cos / sin to it).
        advance: afterwards add 1 to every position in place (a generated text token moves every section on by
            one), in the same launch.
        mark_valid: optional `(valid [B, L] bool, slot [1] int64)`, the decode step's key padding mask and the cache
            index its new key goes to: sets `valid[:, slot] = True` in the same launch (the step's first launch then
            does all of the step's bookkeeping).
    """
    _check_triton("mrope_step")
    _check_mrope_step(positions, sections, freqs, mark_valid)
    if dtype not in _DTYPES:
        raise ValueError(f"mrope_step's dtype must be float32, bfloat16 or float16, got {dtype}.")
    B, R = positions.shape[1], sections.shape[0]
    cos = torch.empty(B, R, dtype=dtype, device=positions.device)
    sin = torch.empty_like(cos)
    if B > 0 and R > 0:
        with _device_guard(positions):
            pdl = pdl_enabled(positions.device)
            valid, slot = mark_valid if mark_valid is not None else (positions, positions)
            _mrope_step_kernel[(B,)](
                positions, sections, freqs, cos, sin, valid, slot, positions.stride(0), positions.stride(1),
                valid.stride(0), R, float(scaling), SCALE=float(scaling) != 1.0, ADVANCE=advance,
                MARK=mark_valid is not None, BLOCK_R=triton.next_power_of_2(R), num_warps=1, PDL=pdl,
                **_pdl_launch(pdl),
            )
    return cos, sin


def mrope_step_ref(
    positions: torch.Tensor, sections: torch.Tensor, freqs: torch.Tensor, scaling: float, dtype: torch.dtype,
    advance: bool = False, mark_valid: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch `mrope_step`: each dimension gathers its position row and frequency first (7 launches)."""
    _check_mrope_step(positions, sections, freqs, mark_valid)
    if mark_valid is not None:
        mark_valid[0].index_fill_(1, mark_valid[1], True)
    angles = positions[:, :, 0].T.index_select(1, sections).float() * freqs  # [B, R]
    cos, sin = angles.cos(), angles.sin()
    if scaling != 1.0:
        cos, sin = cos * scaling, sin * scaling
    if advance:
        positions.add_(1)
    return cos.to(dtype), sin.to(dtype)
