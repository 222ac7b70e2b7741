# Copyright 2026 The Qwen3.5 fused-kernels authors. Licensed under the Apache License, Version 2.0.
"""Fused norms and the MLP activation of Qwen3.5: Triton kernels, each beside its plain-torch reference.

- `rms_norm`: zero-centred RMSNorm, optionally fused with the residual add before it; replaces stock
  `Qwen3_5RMSNorm` (and the `residual + hidden_states` before it).
- `swiglu`: `silu(g) * u` of the fused gate|up projection; replaces stock `act_fn(gate_proj(x)) * up_proj(x)`'s
  activation and product.
- `gated_rms_norm`: the gated RMSNorm after a Gated DeltaNet layer's rule, reading the gate z in place; replaces stock
  `Qwen3_5RMSNormGated` (and the copy of z fla's `rms_norm_gated` needed).

Each op: kernel -> wrapper (validates; ValueError names the values) -> torch `name_ref` below it (dtypes: runtime).
"""

import torch

from .fused_ops_runtime import (
    HAS_TRITON,
    _as_rows,
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
# RMSNorm (zero-centred weight), optionally fused with the residual add before it
# ---------------------------------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit(do_not_specialize=["n_rows"])
    def _rms_norm_kernel(
        x_ptr,
        r_ptr,
        w_ptr,
        y_ptr,
        h_ptr,
        n_rows,
        N,
        stride_x,
        stride_r,
        eps,
        HAS_RESIDUAL: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PDL: tl.constexpr,
    ):
        _pdl_wait(PDL)  # before any load: an earlier kernel writes this one's inputs
        o_m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] rows
        o_n = tl.arange(0, BLOCK_N)  # [BN] features
        m_n = o_n < N
        m = (o_m < n_rows)[:, None] & m_n[None, :]  # [BM, BN]

        b_x = tl.load(x_ptr + o_m[:, None] * stride_x + o_n[None, :], mask=m, other=0.0)  # [BM, BN]
        if HAS_RESIDUAL:
            b_r = tl.load(r_ptr + o_m[:, None] * stride_r + o_n[None, :], mask=m, other=0.0)
            # the sum is rounded to the model dtype, as stock `residual + hidden_states` is
            b_x = _round_to(b_x.to(tl.float32) + b_r.to(tl.float32), h_ptr.dtype.element_ty)
            tl.store(h_ptr + o_m[:, None] * N + o_n[None, :], b_x.to(h_ptr.dtype.element_ty), mask=m)
        b_x = b_x.to(tl.float32)

        b_rstd = tl.math.rsqrt(tl.sum(b_x * b_x, axis=1) / N + eps)  # [BM]
        b_w = 1.0 + tl.load(w_ptr + o_n, mask=m_n, other=0.0).to(tl.float32)  # [BN]
        b_y = _round_to(b_x * b_rstd[:, None] * b_w[None, :], y_ptr.dtype.element_ty)
        tl.store(y_ptr + o_m[:, None] * N + o_n[None, :], b_y.to(y_ptr.dtype.element_ty), mask=m)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Zero-centred RMSNorm over the last dim, optionally after adding a residual, in one pass.

    Math (fp32 inside): `h = x + residual` (rounded to x.dtype), `y = h * rsqrt(mean(h^2) + eps) * (1 + weight)`.

    Args:
        x: [..., N] float32 / bfloat16 / float16; last dim contiguous, any row stride (the leading dims must
            flatten to rows without a copy, e.g. a [rows, N] slice of a wider buffer).
        weight: [N], contiguous, any float dtype (read as float32); zero-centred, as stored by Qwen3.5.
        eps: the epsilon added to the mean square (config.rms_norm_eps).
        residual: optional [..., N], same shape, dtype and device as x; last dim contiguous, any row stride.

    Returns:
        `y` [..., N] contiguous in x.dtype; with `residual`, the tuple `(y, h)` where `h` [..., N] contiguous is
        the rounded sum, i.e. the next residual.

    Replaces stock `Qwen3_5RMSNorm.forward`, and `hidden_states = residual + hidden_states` followed by
    `post_attention_layernorm` / the next layer's `input_layernorm` in `Qwen3_5DecoderLayer.forward`.

    Example:
        >>> y, h = rms_norm(attn_out, layer.post_attention_layernorm.weight, 1e-6, residual=hidden)
    """
    _check_triton("rms_norm")
    _check_float("x", x)
    if x.dim() < 1 or x.shape[-1] < 1:
        raise ValueError(f"x must have a non-empty feature dim, got shape {tuple(x.shape)}.")
    N = x.shape[-1]
    if weight.shape != (N,):
        raise ValueError(f"weight must have shape ({N},) to match x {tuple(x.shape)}, got {tuple(weight.shape)}.")
    _check_float("weight", weight)
    _check_last_dim_contiguous("x", x)
    _check_last_dim_contiguous("weight", weight)
    _check_same_device(x=x, weight=weight)
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(
                f"residual must match x: x is {tuple(x.shape)} {x.dtype}, residual is "
                f"{tuple(residual.shape)} {residual.dtype}."
            )
        _check_last_dim_contiguous("residual", residual)
        _check_same_device(x=x, residual=residual)

    x_rows = _as_rows("x", x)
    r_rows = _as_rows("residual", residual) if residual is not None else x_rows
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    h = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else y
    n_rows = x_rows.shape[0]
    if n_rows > 0 and N > 0:
        BLOCK_N = triton.next_power_of_2(N)
        BLOCK_M = _units_per_program(n_rows, BLOCK_N)
        with _device_guard(x):
            pdl = pdl_enabled(x.device)
            _rms_norm_kernel[(triton.cdiv(n_rows, BLOCK_M),)](
                x_rows,
                r_rows,
                weight,
                y,
                h,
                n_rows,
                N,
                x_rows.stride(0),
                r_rows.stride(0),
                eps,
                HAS_RESIDUAL=residual is not None,
                BLOCK_M=BLOCK_M,
                BLOCK_N=BLOCK_N,
                num_warps=_num_warps(BLOCK_M * BLOCK_N),
                PDL=pdl,
                **_pdl_launch(pdl),
            )
    return (y, h) if residual is not None else y


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch `rms_norm`, written as stock `Qwen3_5RMSNorm` and the decoder layer's residual add compute it."""
    h = x + residual if residual is not None else x
    h_f32 = h.float()
    y = h_f32 * torch.rsqrt(h_f32.pow(2).mean(-1, keepdim=True) + eps)
    y = (y * (1.0 + weight.float())).to(x.dtype)
    return (y, h) if residual is not None else y


# ---------------------------------------------------------------------------------------------------------------------
# SwiGLU of the fused gate|up projection
# ---------------------------------------------------------------------------------------------------------------------

# swiglu has no reduction, so a row is cut into blocks of this many outputs: 1024 divides 3584 into 4 blocks
# (87.5% of lanes busy) and 9216 into 9 (100%), and gives 9 programs per token at decode instead of 3.
_SWIGLU_BLOCK = 1024

if HAS_TRITON:

    @triton.jit
    def _swiglu_kernel(gu_ptr, y_ptr, stride_gu, I, BLOCK_I: tl.constexpr):
        i_row = tl.program_id(0).to(tl.int64)
        o_i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)  # [BI]
        m = o_i < I
        dt = y_ptr.dtype.element_ty

        p_g = gu_ptr + i_row * stride_gu + o_i
        b_g = tl.load(p_g, mask=m, other=0.0).to(tl.float32)
        b_u = tl.load(p_g + I, mask=m, other=0.0).to(tl.float32)
        # stock rounds silu(gate) to the model dtype before the product
        b_s = _round_to(b_g / (1.0 + tl.exp(-b_g)), dt)
        tl.store(y_ptr + i_row * I + o_i, _round_to(b_s * b_u, dt).to(dt), mask=m)


def swiglu(gu: torch.Tensor) -> torch.Tensor:
    """SwiGLU of a fused gate|up projection: `y = silu(g) * u` with `g, u = gu.chunk(2, -1)`.

    Math: `y = g / (1 + exp(-g)) * u` (silu rounded to the dtype, then the product, as stock).

    Args:
        gu: [..., 2*I] float32 / bfloat16 / float16, the last-dim concatenation of stock `gate_proj(x)` and
            `up_proj(x)`; last dim contiguous, any row stride (the leading dims must flatten to rows without a copy).

    Returns:
        y [..., I] contiguous, in gu.dtype.

    Replaces `self.act_fn(self.gate_proj(x)) * self.up_proj(x)` in stock `Qwen3_5MLP.forward`
    (`hidden_act="silu"`, the Qwen3.5 setting).
    """
    _check_triton("swiglu")
    _check_float("gu", gu)
    if gu.dim() < 1 or gu.shape[-1] < 2 or gu.shape[-1] % 2:
        raise ValueError(f"gu must be [..., 2*I] with an even last dim >= 2, got {tuple(gu.shape)}.")
    _check_last_dim_contiguous("gu", gu)
    I = gu.shape[-1] // 2
    gu_rows = _as_rows("gu", gu)
    y = torch.empty(*gu.shape[:-1], I, dtype=gu.dtype, device=gu.device)
    n_rows = gu_rows.shape[0]
    if n_rows > 0 and I > 0:
        BLOCK_I = min(triton.next_power_of_2(I), _SWIGLU_BLOCK)
        with _device_guard(gu):
            _swiglu_kernel[(n_rows, triton.cdiv(I, BLOCK_I))](
                gu_rows, y, gu_rows.stride(0), I, BLOCK_I=BLOCK_I, num_warps=_num_warps(BLOCK_I)
            )
    return y


def swiglu_ref(gu: torch.Tensor) -> torch.Tensor:
    """Plain-torch `swiglu`, as stock `Qwen3_5MLP.forward` computes it before `down_proj`."""
    g, u = gu.chunk(2, dim=-1)
    return torch.nn.functional.silu(g) * u


# ---------------------------------------------------------------------------------------------------------------------
# Gated RMSNorm of the Gated DeltaNet output, the gate read in place
#
# Why our own kernel: fla's `rms_norm_gated` needs the gate as [rows, V] with one row stride, but z is a column
# slice of the packed projection ([B, T, HV * V], row stride = the projection's width), so every call copied it first;
# fla also writes a per-row rstd for its backward. This kernel reads z where it is and writes only y.
# ---------------------------------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit(do_not_specialize=["n_rows"])
    def _gated_rms_norm_kernel(
        x_ptr, z_ptr, w_ptr, y_ptr, n_rows, D, stride_x, stride_zt, eps,
        HV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
        PDL: tl.constexpr,
    ):
        _pdl_wait(PDL)  # before any load: an earlier kernel writes this one's inputs
        o_m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] rows = (token, head)
        o_d = tl.arange(0, BLOCK_D)
        m_d = o_d < D
        m = (o_m < n_rows)[:, None] & m_d[None, :]
        dt = y_ptr.dtype.element_ty
        w_dt = w_ptr.dtype.element_ty
        b_x = tl.load(x_ptr + o_m[:, None] * stride_x + o_d[None, :], mask=m, other=0.0).to(tl.float32)
        p_z = z_ptr + (o_m // HV)[:, None] * stride_zt + (o_m % HV)[:, None] * D + o_d[None, :]
        b_z = tl.load(p_z, mask=m, other=0.0).to(tl.float32)
        b_rstd = tl.math.rsqrt(tl.sum(b_x * b_x, axis=1) / D + eps)
        # stock `Qwen3_5RMSNormGated`: the normalised x rounded to x's dtype, times the weight (rounded to the
        # weight's dtype), times silu(z) in fp32, rounded to x's dtype
        b_h = _round_to(b_x * b_rstd[:, None], dt)
        b_h = _round_to(b_h * tl.load(w_ptr + o_d, mask=m_d, other=0.0).to(tl.float32)[None, :], w_dt)
        b_y = _round_to(b_h * (b_z / (1.0 + tl.exp(-b_z))), dt)
        tl.store(y_ptr + o_m[:, None] * D + o_d[None, :], b_y.to(dt), mask=m)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gated RMSNorm per value head: `y = x / rms(x) * weight * silu(z)`, with z read in place.

    Args:
        x: [..., HV, V] float32 / bfloat16 / float16 (the delta rule's output); last dim contiguous, and the dims
            before it must flatten to rows with one stride.
        z: [..., HV * V], same leading dims, x's dtype: the gate; last dim contiguous, the leading dims must flatten
            to one row stride (e.g. a column slice of the packed projection).
        weight: [V], contiguous, any float dtype (plain weight, not zero-centred).
        eps: the norm's epsilon (`norm.variance_epsilon`).

    Returns:
        y [..., HV * V] contiguous in x.dtype: what `out_proj` reads.

    Replaces stock `Qwen3_5RMSNormGated` (applied to `core.reshape(-1, V)` and `z.reshape(-1, V)`), with its
    roundings; fla's `rms_norm_gated` kept fp32 until the end.
    """
    _check_triton("gated_rms_norm")
    _check_float("x", x)
    _check_float("z", z)
    _check_float("weight", weight)
    if x.dim() < 2 or z.shape != (*x.shape[:-2], x.shape[-2] * x.shape[-1]) or z.dtype != x.dtype:
        raise ValueError(f"x must be [..., HV, V] and z [..., HV * V] in x's dtype; got x {tuple(x.shape)} "
                         f"{x.dtype}, z {tuple(z.shape)} {z.dtype}.")
    HV, D = x.shape[-2:]
    if weight.shape != (D,):
        raise ValueError(f"weight must have shape ({D},) to match x {tuple(x.shape)}, got {tuple(weight.shape)}.")
    for name, t in (("x", x), ("z", z), ("weight", weight)):
        _check_last_dim_contiguous(name, t)
    _check_same_device(x=x, z=z, weight=weight)
    x_rows = _as_rows("x", x)
    z_rows = _as_rows("z", z)
    y = torch.empty(z.shape, dtype=x.dtype, device=x.device)
    n_rows = x_rows.shape[0]
    if n_rows > 0 and D > 0:
        BLOCK_D = triton.next_power_of_2(D)
        BLOCK_M = _units_per_program(n_rows, BLOCK_D)
        with _device_guard(x):
            pdl = pdl_enabled(x.device)
            _gated_rms_norm_kernel[(triton.cdiv(n_rows, BLOCK_M),)](
                x_rows, z_rows, weight, y, n_rows, D, x_rows.stride(0), z_rows.stride(0), eps,
                HV=HV, BLOCK_M=BLOCK_M, BLOCK_D=BLOCK_D, num_warps=_num_warps(BLOCK_M * BLOCK_D),
                PDL=pdl, **_pdl_launch(pdl),
            )
    return y


def gated_rms_norm_ref(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Plain-torch `gated_rms_norm`, written as stock `Qwen3_5RMSNormGated` computes it."""
    D = x.shape[-1]
    h = x.reshape(-1, D).float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(x.dtype)
    h = h * torch.nn.functional.silu(z.reshape(-1, D).float())
    return h.to(x.dtype).reshape(z.shape)
