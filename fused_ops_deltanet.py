# Copyright 2026 The Qwen3.5 fused-kernels authors. Licensed under the Apache License, Version 2.0.
"""Fused Gated DeltaNet ops of Qwen3.5 for decode: Triton kernels, each beside its plain-torch reference. A prompt's
ops (`deltanet_prep`, `gated_delta_rule_prefill`) are in `fused_ops_deltanet_prefill`.

- `causal_conv1d_step`, `gated_delta_rule_step`: the single-token (decode) step of a Gated DeltaNet layer, state
  updated in place, CUDA-graph capturable; replace stock `causal_conv1d_update` and
  `torch_recurrent_gated_delta_rule` (with its q / k `l2norm`, `b.sigmoid()` and the decay `g`) for T=1.
- `causal_conv1d_steps`, `gated_delta_rule_steps`: the same over a few tokens with the state after each kept (the
  speculative verify pass).

`_conv_step_tile` is the one conv step (window shift + depthwise conv + SiLU) that `causal_conv1d_step` and the
GEMV's conv epilogue (`fused_ops_gemv`) both run.

Each op: kernel -> wrapper (validates; ValueError names the values) -> torch `name_ref` below it (dtypes: runtime).
"""

import torch

from .fused_ops_runtime import (
    HAS_TRITON,
    _check_float,
    _check_last_dim_contiguous,
    _check_same_device,
    _check_triton,
    _device_guard,
    _num_warps,
    _on_gpu,
    _pdl_launch,
    pdl_enabled,
    tl,
    triton,
)

if HAS_TRITON:  # the shared `@triton.jit` helpers exist only with triton
    from .fused_ops_runtime import _exp_exact, _pdl_wait, _round_to, _softplus


# ---------------------------------------------------------------------------------------------------------------------
# Gated DeltaNet decode step (T=1), part 1: causal depthwise conv1d update + SiLU
#
# This section and the next are the kernels of a CUDA-graph-capturable single-token step of a Gated DeltaNet layer:
# they update their state tensors in place (fixed addresses a graph can replay), allocate nothing but their output
# (and nothing at all given `out=`), never read a value back to the host, and take a batch of B rows.
# ---------------------------------------------------------------------------------------------------------------------

# Channels per program. Not measured on an H200 yet; the reasoning: the step moves a few bytes per channel, so it is
# latency-bound, and 256 channels x W=4 taps (4 warps, 8 elements per thread) cuts the 6144-10240 conv channels of
# the real models into 24-40 programs per row instead of 6-10 with 1024.
_CONV_BLOCK_D = 256

if HAS_TRITON:

    @triton.jit
    def _conv_step_tile(b_x, p_s, m_s, stride_s_w, p_w, m_w, p_bias, m_bias,
                        W: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_W: tl.constexpr):
        """One decode step of the depthwise causal conv1d + SiLU for a tile of channels, the state shifted in place:
        `s <- [s[1:], x]`, `y = silu(sum_w s[w] * weight[w] + bias)`, rounded as stock `causal_conv1d_update`: the
        window to the weight dtype (stored in the state's), the conv output and the SiLU to the weight dtype. The one
        conv step of `causal_conv1d_step` and of the GEMV's conv epilogue (`fused_ops_gemv`).

        Each channel tensor carries a trailing tap axis of size 1 ([..., 1]; any leading shape): b_x, the new value
        (float32); p_s, the channel's tap 0 in the state (taps `stride_s_w` apart); m_s, the channels to step. p_w /
        m_w: the channel's weight row (taps contiguous), broadcastable to p_s. p_bias / m_bias ([...], no tap axis):
        the bias, read with HAS_BIAS. Returns y [...] in float32, rounded to the weight dtype."""
        o_w = tl.arange(0, BLOCK_W)  # [BW] taps
        w_dt = p_w.dtype.element_ty
        s_dt = p_s.dtype.element_ty
        p_s = p_s + o_w * stride_s_w  # [..., BW]
        # the window after the step: old taps 1..W-1, then x
        b_s = tl.load(p_s + stride_s_w, mask=m_s & (o_w < W - 1), other=0.0).to(tl.float32)  # [..., BW]
        b_s = tl.where(o_w == W - 1, b_x, b_s)
        # the shift stores tap w, which another thread of this program may still have to load (as the old tap w for
        # its window's w - 1): every thread finishes its loads before any thread stores
        tl.debug_barrier()
        # stock casts the window to the weight dtype, then copies it into the state (casting to the state dtype)
        b_s = _round_to(b_s, w_dt)
        tl.store(p_s, _round_to(b_s, s_dt).to(s_dt), mask=m_s & (o_w < W))

        b_w = tl.load(p_w + o_w, mask=m_w & (o_w < W), other=0.0).to(tl.float32)  # [..., BW]
        b_y = tl.sum(b_s * b_w, axis=-1)  # [...]
        if HAS_BIAS:
            b_y += tl.load(p_bias, mask=m_bias, other=0.0).to(tl.float32)
        # stock: conv1d output in the weight dtype, SiLU in the weight dtype (the caller casts to its output dtype)
        b_y = _round_to(b_y, w_dt)
        return _round_to(b_y / (1.0 + tl.exp(-b_y)), w_dt)

    @triton.jit
    def _causal_conv1d_step_kernel(
        x_ptr,
        s_ptr,
        w_ptr,
        bias_ptr,
        y_ptr,
        D,
        stride_x,
        stride_s_b,
        stride_s_d,
        stride_s_w,
        stride_w,
        stride_y,
        W: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_W: tl.constexpr,
    ):
        i_b = tl.program_id(0).to(tl.int64)
        o_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # [BD] channels
        m_d = o_d < D

        b_x = tl.load(x_ptr + i_b * stride_x + o_d, mask=m_d, other=0.0).to(tl.float32)  # [BD]
        p_s = s_ptr + i_b * stride_s_b + o_d[:, None] * stride_s_d  # [BD, 1]
        b_y = _conv_step_tile(b_x[:, None], p_s, m_d[:, None], stride_s_w, w_ptr + o_d[:, None] * stride_w,
                              m_d[:, None], bias_ptr + o_d, m_d, W, HAS_BIAS, BLOCK_W)  # [BD]
        # stock: the SiLU's output (weight dtype) cast to x's dtype
        y_dt = y_ptr.dtype.element_ty
        tl.store(y_ptr + i_b * stride_y + o_d, _round_to(b_y, y_dt).to(y_dt), mask=m_d)


def causal_conv1d_step(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode step of the depthwise causal conv1d + SiLU, updating the conv state in place.

    Math per row and channel (fp32 inside, rounded where stock rounds): `s <- [s[1:], x]`,
    `y = silu(sum_w s[w] * weight[w] + bias)`.

    Args:
        x: [B, D] float32 / bfloat16 / float16, the new token's pre-conv channels (mixed_qkv); last dim contiguous,
            any row stride (e.g. a column slice of a wider projection output).
        conv_state: [B, D, W] float32 / bfloat16 / float16, any strides; updated in place (shifted left by one tap,
            x appended), so a CUDA graph can replay the step on its fixed address.
        weight: [D, W] (`conv1d.weight.squeeze(1)`), float32 / bfloat16 / float16, last dim contiguous.
        bias: optional [D], contiguous, any float dtype (read as float32). Qwen3.5 has none.
        out: optional [B, D] in x.dtype, last dim contiguous, any row stride: written and returned, so the step
            allocates nothing.

    Returns:
        y [B, D] in x.dtype (`out` when given, else a new contiguous tensor).

    Replaces stock `causal_conv1d_update(x[..., None], conv_state, weight, bias, "silu")` in
    `Qwen3_5GatedDeltaNet.forward` (single-token cached decode), with its rounding: the window is cast to the weight
    dtype, the conv output and the SiLU are rounded to the weight dtype, the result to x's dtype. No host sync.
    """
    _check_triton("causal_conv1d_step")
    _check_float("x", x)
    _check_float("conv_state", conv_state)
    _check_float("weight", weight)
    if x.dim() != 2:
        raise ValueError(f"x must be [B, D], got shape {tuple(x.shape)}.")
    B, D = x.shape
    if conv_state.dim() != 3 or conv_state.shape[:2] != (B, D) or conv_state.shape[2] < 1:
        raise ValueError(f"conv_state must be [B, D, W] = [{B}, {D}, W] for x {tuple(x.shape)}, got "
                         f"{tuple(conv_state.shape)}.")
    W = conv_state.shape[2]
    if weight.shape != (D, W):
        raise ValueError(f"weight must be [D, W] = {(D, W)} to match x {tuple(x.shape)} and conv_state "
                         f"{tuple(conv_state.shape)}, got {tuple(weight.shape)}.")
    _check_last_dim_contiguous("x", x)
    _check_last_dim_contiguous("weight", weight)
    tensors = dict(x=x, conv_state=conv_state, weight=weight)
    if bias is not None:
        if bias.shape != (D,):
            raise ValueError(f"bias must have shape ({D},), got {tuple(bias.shape)}.")
        _check_float("bias", bias)
        _check_last_dim_contiguous("bias", bias)
        tensors["bias"] = bias
    if out is None:
        out = torch.empty(B, D, dtype=x.dtype, device=x.device)
    else:
        if out.shape != (B, D) or out.dtype != x.dtype:
            raise ValueError(f"out must be [B, D] = {(B, D)} in x's dtype {x.dtype}, got {tuple(out.shape)} "
                             f"{out.dtype}.")
        _check_last_dim_contiguous("out", out)
        tensors["out"] = out
    _check_same_device(**tensors)

    if B > 0 and D > 0:
        BLOCK_D = min(triton.next_power_of_2(D), _CONV_BLOCK_D)
        BLOCK_W = triton.next_power_of_2(W)
        with _device_guard(x):
            _causal_conv1d_step_kernel[(B, triton.cdiv(D, BLOCK_D))](
                x,
                conv_state,
                weight,
                bias if bias is not None else weight,
                out,
                D,
                x.stride(0),
                *conv_state.stride(),
                weight.stride(0),
                out.stride(0),
                W=W,
                HAS_BIAS=bias is not None,
                BLOCK_D=BLOCK_D,
                BLOCK_W=BLOCK_W,
                num_warps=_num_warps(BLOCK_D * BLOCK_W),
            )
    return out


def causal_conv1d_step_ref(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-torch `causal_conv1d_step` (conv_state updated in place, `out` written and returned when given),
    rounding as stock `causal_conv1d_update`."""
    # stock: the window cast to the weight dtype is both the conv input and the new state
    window = torch.cat([conv_state[:, :, 1:].to(weight.dtype), x[:, :, None].to(weight.dtype)], dim=-1)  # [B, D, W]
    conv_state.copy_(window)
    y = (window.float() * weight.float()).sum(-1)  # [B, D], fp32 accumulation as conv1d's
    if bias is not None:
        y = y + bias.float()
    y = torch.nn.functional.silu(y.to(weight.dtype)).to(x.dtype)
    return out.copy_(y) if out is not None else y


if HAS_TRITON:

    @triton.jit
    def _causal_conv1d_steps_kernel(
        x_ptr,
        s_ptr,
        w_ptr,
        bias_ptr,
        y_ptr,
        saved_ptr,
        D,
        stride_x_b,
        stride_x_t,
        stride_s_b,
        stride_s_d,
        stride_s_w,
        stride_w,
        stride_y_b,
        stride_y_t,
        stride_sv_t,
        stride_sv_b,
        stride_sv_d,
        stride_sv_w,
        T: tl.constexpr,
        W: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        SAVE: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_W: tl.constexpr,
    ):
        i_b = tl.program_id(0).to(tl.int64)
        o_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # [BD] channels
        m_d = o_d < D
        o_w = tl.arange(0, BLOCK_W)  # [BW] taps
        p_s = s_ptr + i_b * stride_s_b + o_d[:, None] * stride_s_d  # [BD, 1]
        y_dt = y_ptr.dtype.element_ty
        for t in tl.static_range(T):
            if t > 0:
                tl.debug_barrier()  # the last token's state stores land before this token's loads
            b_x = tl.load(x_ptr + i_b * stride_x_b + t * stride_x_t + o_d, mask=m_d, other=0.0).to(tl.float32)
            b_y = _conv_step_tile(b_x[:, None], p_s, m_d[:, None], stride_s_w, w_ptr + o_d[:, None] * stride_w,
                                  m_d[:, None], bias_ptr + o_d, m_d, W, HAS_BIAS, BLOCK_W)  # [BD]
            tl.store(y_ptr + i_b * stride_y_b + t * stride_y_t + o_d, _round_to(b_y, y_dt).to(y_dt), mask=m_d)
            if SAVE:  # the window after token t, as the step stored it
                tl.debug_barrier()
                m_sw = m_d[:, None] & (o_w < W)[None, :]
                b_s = tl.load(p_s + o_w[None, :] * stride_s_w, mask=m_sw, other=0.0)
                p_sv = (saved_ptr + t * stride_sv_t + i_b * stride_sv_b + o_d[:, None] * stride_sv_d
                        + o_w[None, :] * stride_sv_w)
                tl.store(p_sv, b_s.to(saved_ptr.dtype.element_ty), mask=m_sw)


def causal_conv1d_steps(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    saved: torch.Tensor | None = None,
) -> torch.Tensor:
    """T consecutive `causal_conv1d_step` calls in one launch (the speculative verify pass), the conv state after
    each token written to `saved`.

    Args:
        x: [B, T, D]: token t's pre-conv channels; last dim contiguous, other strides arbitrary.
        conv_state, weight, bias: as `causal_conv1d_step`; conv_state ends after all T tokens.
        saved: optional [T, B, D, W] in conv_state's dtype: saved[t] <- the conv state after token t.

    Returns:
        y [B, T, D] in x.dtype, contiguous: each token's output as the single-token step gives it.

    Why our own kernel: the verify pass must be able to end after any of its tokens, so it needs the conv state after
    each; the single-token step and a copy after each token cost 2T launches a layer. No host sync; capturable.
    """
    _check_triton("causal_conv1d_steps")
    _check_float("x", x)
    _check_float("conv_state", conv_state)
    _check_float("weight", weight)
    if x.dim() != 3:
        raise ValueError(f"x must be [B, T, D], got shape {tuple(x.shape)}.")
    B, T, D = x.shape
    if conv_state.dim() != 3 or conv_state.shape[:2] != (B, D) or conv_state.shape[2] < 1:
        raise ValueError(f"conv_state must be [B, D, W] = [{B}, {D}, W] for x {tuple(x.shape)}, got "
                         f"{tuple(conv_state.shape)}.")
    W = conv_state.shape[2]
    if weight.shape != (D, W):
        raise ValueError(f"weight must be [D, W] = {(D, W)} to match x {tuple(x.shape)} and conv_state "
                         f"{tuple(conv_state.shape)}, got {tuple(weight.shape)}.")
    _check_last_dim_contiguous("x", x)
    _check_last_dim_contiguous("weight", weight)
    tensors = dict(x=x, conv_state=conv_state, weight=weight)
    if bias is not None:
        if bias.shape != (D,):
            raise ValueError(f"bias must have shape ({D},), got {tuple(bias.shape)}.")
        _check_float("bias", bias)
        _check_last_dim_contiguous("bias", bias)
        tensors["bias"] = bias
    if saved is not None:
        if saved.shape != (T, B, D, W) or saved.dtype != conv_state.dtype:
            raise ValueError(f"saved must be [T, B, D, W] = {(T, B, D, W)} in conv_state's dtype "
                             f"{conv_state.dtype}, got {tuple(saved.shape)} {saved.dtype}.")
        tensors["saved"] = saved
    _check_same_device(**tensors)
    out = torch.empty(B, T, D, dtype=x.dtype, device=x.device)
    if B > 0 and T > 0 and D > 0:
        BLOCK_D = min(triton.next_power_of_2(D), _CONV_BLOCK_D)
        BLOCK_W = triton.next_power_of_2(W)
        with _device_guard(x):
            _causal_conv1d_steps_kernel[(B, triton.cdiv(D, BLOCK_D))](
                x,
                conv_state,
                weight,
                bias if bias is not None else weight,
                out,
                saved if saved is not None else conv_state,  # not read without SAVE
                D,
                x.stride(0),
                x.stride(1),
                *conv_state.stride(),
                weight.stride(0),
                out.stride(0),
                out.stride(1),
                *(saved.stride() if saved is not None else (0, 0, 0, 0)),
                T=T,
                W=W,
                HAS_BIAS=bias is not None,
                SAVE=saved is not None,
                BLOCK_D=BLOCK_D,
                BLOCK_W=BLOCK_W,
                num_warps=_num_warps(BLOCK_D * BLOCK_W),
            )
    return out


def causal_conv1d_steps_ref(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    saved: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-torch `causal_conv1d_steps`: `causal_conv1d_step_ref` token by token, the state copied to `saved[t]`."""
    outs = []
    for t in range(x.shape[1]):
        outs.append(causal_conv1d_step_ref(x[:, t], conv_state, weight, bias))
        if saved is not None:
            saved[t].copy_(conv_state)
    if not outs:
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return torch.stack(outs, dim=1)


# ---------------------------------------------------------------------------------------------------------------------
# Gated DeltaNet decode step (T=1), part 2: gate, beta, q/k L2 norm and the gated delta rule state update
# ---------------------------------------------------------------------------------------------------------------------

# Value columns per program; the K rows of the state sit whole in registers. Not measured on an H200 yet; the
# reasoning: a [128, 32] fp32 state tile is 32 registers per thread at 4 warps, and at B=1 it gives the real models
# HV * 4 = 64-192 programs, about one per SM of the 132, where 64 columns would leave most SMs idle.
_GDR_BLOCK_V = 32
# The state tile holds the whole K dim; past 256 rows it would spill out of the registers.
_GDR_MAX_K = 256
# Epsilon of stock's q / k `l2norm` in `torch_recurrent_gated_delta_rule` (fixed there, not a config value).
_GDR_L2_EPS = 1e-6

if HAS_TRITON:

    @triton.jit
    def _gdr_token(b_s, b_q, b_k, b_v, b_a, b_bt, neg_A, scale, eps, BETA_DT: tl.constexpr, ON_GPU: tl.constexpr):
        """One token of the gated delta rule on a state tile, all in fp32: b_s [BK, BV] the state; b_q, b_k [BK] raw
        q / k; b_v [BV]; b_a the gate input plus dt_bias; b_bt the beta input; neg_A = -exp(A_log). q, k L2-normalised
        (q also scaled), decay exp(neg_A * softplus(b_a)) as torch computes it (`_softplus`), beta = sigmoid(b_bt)
        rounded to BETA_DT as stock's `b.sigmoid()`. Returns the new state and the output S^T q [BV] (fp32). The
        math of `gated_delta_rule_step` and of each token of `gated_delta_rule_steps`."""
        b_q = b_q * tl.math.rsqrt(tl.sum(b_q * b_q) + eps) * scale
        b_k = b_k * tl.math.rsqrt(tl.sum(b_k * b_k) + eps)
        b_decay = tl.exp(neg_A * _softplus(b_a, ON_GPU))
        b_beta = _round_to(1.0 / (1.0 + tl.exp(-b_bt)), BETA_DT)
        b_s = b_s * b_decay
        b_kv = tl.sum(b_s * b_k[:, None], axis=0)  # [BV] = S^T k
        b_s += b_k[:, None] * ((b_v - b_kv) * b_beta)[None, :]
        return b_s, tl.sum(b_s * b_q[:, None], axis=0)  # [BV] = S^T q

    @triton.jit
    def _gated_delta_rule_step_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        a_ptr,
        b_ptr,
        A_log_ptr,
        dt_bias_ptr,
        s_ptr,
        o_ptr,
        live_ptr,
        stride_q_b,
        stride_q_h,
        stride_k_b,
        stride_k_h,
        stride_v_b,
        stride_v_h,
        stride_a_b,
        stride_a_h,
        stride_b_b,
        stride_b_h,
        stride_s_b,
        stride_s_h,
        stride_s_k,
        stride_o_b,
        stride_o_h,
        scale,
        eps,
        GROUP: tl.constexpr,
        K: tl.constexpr,
        V: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_V: tl.constexpr,
        PREFETCH_STATE: tl.constexpr,
        HAS_LIVE: tl.constexpr,
        PDL: tl.constexpr,
        ON_GPU: tl.constexpr,
    ):
        # program (row, value head, block of V columns); value head i_hv reads key head i_hv // GROUP
        i_b = tl.program_id(0).to(tl.int64)
        i_hv = tl.program_id(1).to(tl.int64)
        i_h = i_hv // GROUP
        o_k = tl.arange(0, BLOCK_K)  # [BK]
        o_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)  # [BV]
        m_k = o_k < K
        m_v = o_v < V
        if HAS_LIVE:  # a row past the live ones: zeros out, its state neither read nor written
            if i_b >= tl.load(live_ptr):  # no kernel of the step writes `live`: read before the PDL wait
                _pdl_wait(PDL)  # the output's memory may still be read by the kernel before
                o_dt = o_ptr.dtype.element_ty
                tl.store(o_ptr + i_b * stride_o_b + i_hv * stride_o_h + o_v, tl.zeros([BLOCK_V], o_dt), mask=m_v)
                return
        m_s = m_k[:, None] & m_v[None, :]  # [BK, BV]
        p_s = s_ptr + i_b * stride_s_b + i_hv * stride_s_h + o_k[:, None] * stride_s_k + o_v[None, :]  # [BK, BV]
        if PREFETCH_STATE and PDL:  # the caller vouches that no kernel still running writes the state
            tl.extra.cuda.gdc_launch_dependents()
            b_s = tl.load(p_s, mask=m_s, other=0.0)  # the state tile loads while the kernel before drains
            tl.extra.cuda.gdc_wait()  # then q, k, v, a, b, written by an earlier kernel
        else:
            _pdl_wait(PDL)  # before any load: an earlier kernel writes this one's inputs
            b_s = tl.load(p_s, mask=m_s, other=0.0)

        b_q = tl.load(q_ptr + i_b * stride_q_b + i_h * stride_q_h + o_k, mask=m_k, other=0.0).to(tl.float32)  # [BK]
        b_k = tl.load(k_ptr + i_b * stride_k_b + i_h * stride_k_h + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_a = tl.load(a_ptr + i_b * stride_a_b + i_hv * stride_a_h).to(tl.float32)
        b_a += tl.load(dt_bias_ptr + i_hv).to(tl.float32)
        neg_A = -_exp_exact(tl.load(A_log_ptr + i_hv).to(tl.float32), ON_GPU)
        b_bt = tl.load(b_ptr + i_b * stride_b_b + i_hv * stride_b_h).to(tl.float32)
        b_v = tl.load(v_ptr + i_b * stride_v_b + i_hv * stride_v_h + o_v, mask=m_v, other=0.0).to(tl.float32)  # [BV]
        b_s, b_o = _gdr_token(b_s, b_q, b_k, b_v, b_a, b_bt, neg_A, scale, eps, b_ptr.dtype.element_ty, ON_GPU)
        tl.store(p_s, b_s, mask=m_s)
        o_dt = o_ptr.dtype.element_ty
        tl.store(o_ptr + i_b * stride_o_b + i_hv * stride_o_h + o_v, _round_to(b_o, o_dt).to(o_dt), mask=m_v)


def _check_live(live: torch.Tensor) -> None:
    if live.numel() != 1 or live.dtype != torch.long:
        raise ValueError(f"live must be a one-element int64 tensor, got {tuple(live.shape)} {live.dtype}.")


def _check_gdr_inputs(q, k, v, a, b, A_log, dt_bias, state, lead: str) -> tuple:
    """The input checks `gated_delta_rule_step` (``lead`` "B": q [B, H, K]) and `gated_delta_rule_steps` ("B, T":
    q [B, T, H, K]) share, each a one-line ``ValueError``. Returns (the lead sizes, H, K, HV, V)."""
    for name, t in (("q", q), ("k", k), ("v", v), ("a", a), ("b", b), ("A_log", A_log), ("dt_bias", dt_bias)):
        _check_float(name, t)
    n = lead.count(",") + 1
    if q.dim() != n + 2 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [{lead}, H, K], got {tuple(q.shape)} and {tuple(k.shape)}.")
    sizes, (H, K) = tuple(q.shape[:n]), q.shape[n:]
    if v.dim() != n + 2 or tuple(v.shape[:n]) != sizes or v.shape[n] < 1 or H < 1 or v.shape[n] % H:
        raise ValueError(f"v must be [{lead}, HV, V] = [{', '.join(map(str, sizes))}, HV, V] with HV a multiple of "
                         f"H = {H} for q {tuple(q.shape)}, got {tuple(v.shape)}.")
    HV, V = v.shape[n:]
    if not 1 <= K <= _GDR_MAX_K or V < 1:
        raise ValueError(f"K must be in [1, {_GDR_MAX_K}] (the state's K rows sit in registers) and V >= 1, got "
                         f"K={K}, V={V}.")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}.")
    for name, t in (("a", a), ("b", b)):
        if t.shape != (*sizes, HV):
            raise ValueError(f"{name} must be [{lead}, HV] = {(*sizes, HV)} to match v {tuple(v.shape)}, got "
                             f"{tuple(t.shape)}.")
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
        if t.shape != (HV,):
            raise ValueError(f"{name} must have shape ({HV},) to match v {tuple(v.shape)}, got {tuple(t.shape)}.")
        _check_last_dim_contiguous(name, t)
    B = sizes[0]
    if state.shape != (B, HV, K, V) or state.dtype != torch.float32:
        raise ValueError(f"state must be [B, HV, K, V] = {(B, HV, K, V)} float32, got {tuple(state.shape)} "
                         f"{state.dtype}.")
    for name, t in (("q", q), ("k", k), ("v", v), ("state", state)):
        _check_last_dim_contiguous(name, t)
    return sizes, H, K, HV, V


def gated_delta_rule_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    prefetch_state: bool = False,
    live: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode step of the gated delta rule with its gate and beta, updating the recurrent state in place.

    Math per row and value head (fp32): with `q, k <- l2norm(q) * scale, l2norm(k)`,
    `g = -exp(A_log) * softplus(a + dt_bias)`, `beta = sigmoid(b)`:
    `S <- S * exp(g) + k (beta * (v - (S * exp(g))^T k))^T`, `o = S^T q`.

    Args:
        q, k: [B, H, K] float32 / bfloat16 / float16 (one dtype with v); last dim contiguous, other strides
            arbitrary (e.g. views of a column slice of the conv output). K <= 256.
        v: [B, HV, V], same dtype; HV a multiple of H: key head h serves value heads [h * HV/H, (h+1) * HV/H), as
            stock's `repeat_interleave`. Last dim contiguous, other strides arbitrary.
        a, b: [B, HV] float32 / bfloat16 / float16, any strides: the `in_proj_a` / `in_proj_b` outputs. `beta` is
            rounded to b's dtype, as stock's `b.sigmoid()`.
        A_log, dt_bias: [HV], contiguous, any float dtype (read as float32).
        state: [B, HV, K, V] float32, last dim contiguous, other strides arbitrary; updated in place, so a CUDA
            graph can replay the step on its fixed address.
        scale: multiplies the normalised q; default K ** -0.5 (stock's fixed `query / sqrt(K)`).
        out: optional [B, HV, V] in q's dtype, last dim contiguous: written and returned, so the step allocates
            nothing.
        prefetch_state: with programmatic dependent launch on (`pdl_enabled`), load the state before waiting on
            the kernel launched before this one, so its read overlaps that kernel's drain. Only for a caller that
            knows no kernel that may still be running writes `state`: the decode step, where the state's last
            writer is this kernel one token earlier, in the step before; between two steps the generate loop runs
            torch kernels, launched without PDL, which start only once all earlier work is done. Not for two calls
            in a row on one state: the second would read the state before the first has written it.
        live: optional [1] int64 on q's device, read on the device: only rows 0..live-1 run; the others get zeros
            out and their state is neither read nor written (``generate_batch``'s free rows in a row bucket's step:
            each reads and writes 2 MB of state a layer at 4B). None: every row.

    Returns:
        o [B, HV, V] in q's dtype (`out` when given, else a new contiguous tensor).

    Replaces, in `Qwen3_5GatedDeltaNet.forward` at single-token cached decode, `beta = b.sigmoid()`,
    `g = -A_log.float().exp() * softplus(a.float() + dt_bias)` and stock
    `torch_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=state, output_final_state=True,
    use_qk_l2norm_in_kernel=True)` with T=1 (whose new state is written back over `state`). No host sync.
    """
    _check_triton("gated_delta_rule_step")
    (B,), H, K, HV, V = _check_gdr_inputs(q, k, v, a, b, A_log, dt_bias, state, "B")
    tensors = dict(q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias, state=state)
    if out is None:
        out = torch.empty(B, HV, V, dtype=q.dtype, device=q.device)
    else:
        if out.shape != (B, HV, V) or out.dtype != q.dtype:
            raise ValueError(f"out must be [B, HV, V] = {(B, HV, V)} in q's dtype {q.dtype}, got "
                             f"{tuple(out.shape)} {out.dtype}.")
        _check_last_dim_contiguous("out", out)
        tensors["out"] = out
    if live is not None:
        _check_live(live)
        tensors["live"] = live
    _check_same_device(**tensors)
    scale = K**-0.5 if scale is None else float(scale)

    if B > 0:
        BLOCK_K = triton.next_power_of_2(K)
        BLOCK_V = min(triton.next_power_of_2(V), _GDR_BLOCK_V)
        with _device_guard(q):
            pdl = pdl_enabled(q.device)
            _gated_delta_rule_step_kernel[(B, HV, triton.cdiv(V, BLOCK_V))](
                q,
                k,
                v,
                a,
                b,
                A_log,
                dt_bias,
                state,
                out,
                live if live is not None else out,
                q.stride(0),
                q.stride(1),
                k.stride(0),
                k.stride(1),
                v.stride(0),
                v.stride(1),
                a.stride(0),
                a.stride(1),
                b.stride(0),
                b.stride(1),
                state.stride(0),
                state.stride(1),
                state.stride(2),
                out.stride(0),
                out.stride(1),
                scale,
                _GDR_L2_EPS,
                GROUP=HV // H,
                K=K,
                V=V,
                BLOCK_K=BLOCK_K,
                BLOCK_V=BLOCK_V,
                PREFETCH_STATE=bool(prefetch_state),
                HAS_LIVE=live is not None,
                # about 32 state values per thread: 4 warps for the real [128, 32] tile
                num_warps=max(1, min(8, BLOCK_K * BLOCK_V // (32 * 32))),
                PDL=pdl,
                ON_GPU=_on_gpu(q),
                **_pdl_launch(pdl),
            )
    return out


def gated_delta_rule_step_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    prefetch_state: bool = False,
    live: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-torch `gated_delta_rule_step` (state updated in place, `out` written and returned when given), rounding
    as stock does. `prefetch_state` is taken and ignored: it orders a kernel's loads, and there is no kernel here.
    With `live`, the rows from `live` on get zeros and keep their state (a device mask: no host read)."""
    if live is not None:
        keep = torch.arange(q.shape[0], device=q.device) < live.to(q.device)  # [B]
        before = state.clone()
        o = gated_delta_rule_step_ref(q, k, v, a, b, A_log, dt_bias, state, scale)
        state.copy_(torch.where(keep[:, None, None, None], state, before))
        o = torch.where(keep[:, None, None], o, torch.zeros_like(o))
        return o if out is None else out.copy_(o)
    group = v.shape[1] // q.shape[1]
    beta = b.sigmoid().float()[..., None]  # [B, HV, 1], rounded to b's dtype first as stock
    g = -A_log.float().exp() * torch.nn.functional.softplus(a.float() + dt_bias.float())  # [B, HV]
    scale = q.shape[-1] ** -0.5 if scale is None else scale

    def l2norm(x):  # [B, H, K] -> [B, HV, K], fp32
        x = x.float()
        return (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + _GDR_L2_EPS)).repeat_interleave(group, dim=1)

    q, k = l2norm(q) * scale, l2norm(k)
    s = state * g.exp()[..., None, None]  # [B, HV, K, V]
    kv = (s * k[..., None]).sum(-2)  # [B, HV, V]
    s = s + k[..., None] * ((v.float() - kv) * beta)[..., None, :]
    state.copy_(s)
    o = (s * q[..., None]).sum(-2).to(v.dtype)  # [B, HV, V]
    return o if out is None else out.copy_(o)


# ---------------------------------------------------------------------------------------------------------------------
# Gated DeltaNet over a few tokens with the state after each kept (the speculative verify pass)
#
# Why our own kernel: the verify pass checks k drafts in one pass over T = k + 1 tokens and must be able to end after
# any of them, so it needs the recurrent state after every token. fla's recurrent and chunked kernels take a block of
# tokens but hand back the last state only; T single-token steps plus a state copy after each cost 2T launches a
# layer. This one keeps the state tile in registers across the T tokens and writes each token's state once.
# ---------------------------------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit
    def _gated_delta_rule_steps_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        a_ptr,
        b_ptr,
        A_log_ptr,
        dt_bias_ptr,
        s_ptr,
        saved_ptr,
        o_ptr,
        stride_q_b,
        stride_q_t,
        stride_q_h,
        stride_k_b,
        stride_k_t,
        stride_k_h,
        stride_v_b,
        stride_v_t,
        stride_v_h,
        stride_a_b,
        stride_a_t,
        stride_a_h,
        stride_b_b,
        stride_b_t,
        stride_b_h,
        stride_s_b,
        stride_s_h,
        stride_s_k,
        stride_sv_t,
        stride_sv_b,
        stride_sv_h,
        stride_sv_k,
        stride_o_b,
        stride_o_t,
        stride_o_h,
        scale,
        eps,
        T: tl.constexpr,
        GROUP: tl.constexpr,
        K: tl.constexpr,
        V: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_V: tl.constexpr,
        SAVE: tl.constexpr,
        PDL: tl.constexpr,
        ON_GPU: tl.constexpr,
    ):
        # program (row, value head, block of V columns), as the single-token kernel; the T tokens in order
        i_b = tl.program_id(0).to(tl.int64)
        i_hv = tl.program_id(1).to(tl.int64)
        i_h = i_hv // GROUP
        o_k = tl.arange(0, BLOCK_K)  # [BK]
        o_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)  # [BV]
        m_k = o_k < K
        m_v = o_v < V
        m_s = m_k[:, None] & m_v[None, :]  # [BK, BV]
        p_s = s_ptr + i_b * stride_s_b + i_hv * stride_s_h + o_k[:, None] * stride_s_k + o_v[None, :]  # [BK, BV]
        _pdl_wait(PDL)  # before any load: an earlier kernel writes this one's inputs
        b_s = tl.load(p_s, mask=m_s, other=0.0)
        neg_A = -_exp_exact(tl.load(A_log_ptr + i_hv).to(tl.float32), ON_GPU)
        dt_bias = tl.load(dt_bias_ptr + i_hv).to(tl.float32)
        o_dt = o_ptr.dtype.element_ty
        for t in tl.static_range(T):
            b_q = tl.load(q_ptr + i_b * stride_q_b + t * stride_q_t + i_h * stride_q_h + o_k, mask=m_k,
                          other=0.0).to(tl.float32)  # [BK]
            b_k = tl.load(k_ptr + i_b * stride_k_b + t * stride_k_t + i_h * stride_k_h + o_k, mask=m_k,
                          other=0.0).to(tl.float32)
            b_a = tl.load(a_ptr + i_b * stride_a_b + t * stride_a_t + i_hv * stride_a_h).to(tl.float32) + dt_bias
            b_bt = tl.load(b_ptr + i_b * stride_b_b + t * stride_b_t + i_hv * stride_b_h).to(tl.float32)
            b_v = tl.load(v_ptr + i_b * stride_v_b + t * stride_v_t + i_hv * stride_v_h + o_v, mask=m_v,
                          other=0.0).to(tl.float32)  # [BV]
            b_s, b_o = _gdr_token(b_s, b_q, b_k, b_v, b_a, b_bt, neg_A, scale, eps, b_ptr.dtype.element_ty, ON_GPU)
            if SAVE:
                p_sv = (saved_ptr + t * stride_sv_t + i_b * stride_sv_b + i_hv * stride_sv_h
                        + o_k[:, None] * stride_sv_k + o_v[None, :])
                tl.store(p_sv, b_s, mask=m_s)
            tl.store(o_ptr + i_b * stride_o_b + t * stride_o_t + i_hv * stride_o_h + o_v,
                     _round_to(b_o, o_dt).to(o_dt), mask=m_v)
        tl.store(p_s, b_s, mask=m_s)


def gated_delta_rule_steps(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    saved: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """T consecutive `gated_delta_rule_step` calls in one launch, the state after each token written to `saved`.

    Args:
        q, k: [B, T, H, K]; v: [B, T, HV, V]; a, b: [B, T, HV]: token t's inputs of `gated_delta_rule_step`, with the
            same dtypes, head grouping and rounding; last dim of q, k, v contiguous, other strides arbitrary. K <= 256.
        A_log, dt_bias: [HV], contiguous.
        state: [B, HV, K, V] float32, last dim contiguous; updated in place to the state after all T tokens.
        saved: optional [T, B, HV, K, V] float32, last dim contiguous: saved[t] <- the state after token t.
        scale: as `gated_delta_rule_step`.

    Returns:
        o [B, T, HV, V] in q's dtype, contiguous: token t's output, as the single-token step gives it.

    The state tile stays in registers across the tokens. No host sync; capturable.
    """
    _check_triton("gated_delta_rule_steps")
    (B, T), H, K, HV, V = _check_gdr_inputs(q, k, v, a, b, A_log, dt_bias, state, "B, T")
    tensors = dict(q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias, state=state)
    if saved is not None:
        if saved.shape != (T, B, HV, K, V) or saved.dtype != torch.float32:
            raise ValueError(f"saved must be [T, B, HV, K, V] = {(T, B, HV, K, V)} float32, got "
                             f"{tuple(saved.shape)} {saved.dtype}.")
        _check_last_dim_contiguous("saved", saved)
        tensors["saved"] = saved
    _check_same_device(**tensors)
    out = torch.empty(B, T, HV, V, dtype=q.dtype, device=q.device)
    scale = K**-0.5 if scale is None else float(scale)
    if B > 0 and T > 0:
        BLOCK_K = triton.next_power_of_2(K)
        BLOCK_V = min(triton.next_power_of_2(V), _GDR_BLOCK_V)
        sv = saved if saved is not None else state  # not read without SAVE
        sv_strides = saved.stride()[:4] if saved is not None else (0, 0, 0, 0)
        with _device_guard(q):
            pdl = pdl_enabled(q.device)
            _gated_delta_rule_steps_kernel[(B, HV, triton.cdiv(V, BLOCK_V))](
                q, k, v, a, b, A_log, dt_bias, state, sv, out,
                q.stride(0), q.stride(1), q.stride(2),
                k.stride(0), k.stride(1), k.stride(2),
                v.stride(0), v.stride(1), v.stride(2),
                a.stride(0), a.stride(1), a.stride(2),
                b.stride(0), b.stride(1), b.stride(2),
                state.stride(0), state.stride(1), state.stride(2),
                *sv_strides,
                out.stride(0), out.stride(1), out.stride(2),
                scale,
                _GDR_L2_EPS,
                T=T,
                GROUP=HV // H,
                K=K,
                V=V,
                BLOCK_K=BLOCK_K,
                BLOCK_V=BLOCK_V,
                SAVE=saved is not None,
                num_warps=max(1, min(8, BLOCK_K * BLOCK_V // (32 * 32))),
                PDL=pdl,
                ON_GPU=_on_gpu(q),
                **_pdl_launch(pdl),
            )
    return out


def gated_delta_rule_steps_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    saved: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Plain-torch `gated_delta_rule_steps`: `gated_delta_rule_step_ref` token by token, the state copied to
    `saved[t]` after token t."""
    outs = []
    for t in range(q.shape[1]):
        outs.append(gated_delta_rule_step_ref(q[:, t], k[:, t], v[:, t], a[:, t], b[:, t], A_log, dt_bias, state,
                                              scale))
        if saved is not None:
            saved[t].copy_(state)
    if not outs:
        return torch.empty(v.shape, dtype=q.dtype, device=q.device)
    return torch.stack(outs, dim=1)
