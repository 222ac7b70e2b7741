# Copyright 2026 The Qwen3.5 fused-kernels authors. Licensed under the Apache License, Version 2.0.
"""Fused Gated DeltaNet ops of Qwen3.5 for a prompt (prefill): a Triton kernel and fla glue, each beside its
plain-torch reference. The decode step's ops are in `fused_ops_deltanet`.

- `deltanet_prep`: a prompt's causal conv + SiLU of q|k|v, the q / k L2 norm and beta, one launch, ready for fla's
  `chunk_gated_delta_rule`; replaces stock's `causal_conv1d_fn` -> split -> `l2norm` / `sigmoid` chain.
- `gated_delta_rule_prefill` (fla glue, no kernel of ours): a prompt's gated delta rule by fla's chunked kernel, or
  by its per-token kernel where fp32 must stay IEEE fp32 (`prefill_rule_kernel` decides); replaces stock
  `chunk_gated_delta_rule`.

Each op: kernel -> wrapper (validates; ValueError names the values) -> torch `name_ref` below it (dtypes: runtime).
"""

import inspect

import torch

from .fused_ops_deltanet import _GDR_L2_EPS
from .fused_ops_runtime import (
    HAS_TRITON,
    _check_float,
    _check_last_dim_contiguous,
    _check_same_device,
    _check_triton,
    _device_guard,
    _num_warps,
    _on_gpu,
    fla_chunk_gated_delta_rule,
    fla_fused_recurrent_gated_delta_rule,
    tl,
    triton,
)

if HAS_TRITON:
    from .fused_ops_runtime import _exp_exact, _round_to, _softplus

# ---------------------------------------------------------------------------------------------------------------------
# Gated DeltaNet prefill, input side: causal conv + SiLU of q|k|v, the q / k L2 norm, beta and the gate
#
# Why our own kernel: through fla, this stage is eight launches per layer: fla's conv once per q / k / v slice,
# `chunk_gated_delta_rule`'s L2 norm of q and of k, its beta sigmoid, and its input guard's copies of the strided
# b / a columns of the packed projection. Nothing maintained fuses them. This one launch reads those columns once
# and writes what fla's rule reads, ready: contiguous, normalised q and k, v, and beta and the gate g in fp32. The gate
# is computed here, not in fla's kernel: fla's in-kernel softplus is approximate where it matters (`_softplus`).
# ---------------------------------------------------------------------------------------------------------------------

# Tokens per program and warps. Measured on the H200 (2026-12-02, the 4B layer, bf16, each launch shape in a CUDA
# graph; docs/DESIGN.md): [32, 128] tiles on 4 warps took 3.9 / 35.6 / 513 us at T = 128 / 2048 / 32768, the
# [64, 128] tiles on 8 warps used before 4.4 / 40.9 / 582 us (16 to 128 tokens on 2 to 16 warps tried). A prompt
# of at most 16 tokens takes a 16-token tile: two tile sizes in all, so no third compile at a new prompt length.
_PREP_BLOCK_T = 32
_PREP_WARPS = 4

if HAS_TRITON:

    @triton.jit
    def _deltanet_prep_kernel(
        x_ptr, w_ptr, bias_ptr, b_ptr, a_ptr, A_log_ptr, dt_bias_ptr, y_ptr, beta_ptr, g_ptr,
        T, stride_xb, stride_xt, stride_w, stride_bb, stride_bt, stride_ab, stride_at, eps,
        HK: tl.constexpr, DK: tl.constexpr, HV: tl.constexpr, DV: tl.constexpr, W: tl.constexpr,
        HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HV: tl.constexpr,
        ON_GPU: tl.constexpr,
    ):
        i_t, i_b, i_h = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2)
        n_b = tl.num_programs(1).to(tl.int64)
        o_t = (i_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)  # [BT] tokens
        m_t = o_t < T
        dt = y_ptr.dtype.element_ty
        w_dt = w_ptr.dtype.element_ty
        if i_h < 2 * HK + HV:  # one q, k or v head of BLOCK_T tokens
            is_qk = i_h < 2 * HK
            D = tl.where(is_qk, DK, DV)
            col = tl.where(is_qk, i_h * DK, 2 * HK * DK + (i_h - 2 * HK) * DV)  # first input channel of the head
            # q, k and v are three contiguous blocks of y: [B, T, HK, DK], [B, T, HK, DK], [B, T, HV, DV]
            part = tl.where(i_h < HK, 0, tl.where(is_qk, 1, 2))
            base = part.to(tl.int64) * n_b * T * HK * DK
            width = tl.where(is_qk, HK * DK, HV * DV)
            o_col = tl.where(is_qk, (i_h - part * HK) * DK, (i_h - 2 * HK) * DV)
            o_d = tl.arange(0, BLOCK_D)
            m_d = o_d < D
            acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
            for j in tl.static_range(W):  # tap j reads token t - (W - 1) + j; tokens before 0 are zero
                t_src = o_t - (W - 1) + j
                m = (m_t & (t_src >= 0))[:, None] & m_d[None, :]
                p_x = x_ptr + i_b * stride_xb + t_src[:, None] * stride_xt + col + o_d[None, :]
                b_x = tl.load(p_x, mask=m, other=0.0).to(tl.float32)
                b_w = tl.load(w_ptr + (col + o_d) * stride_w + j, mask=m_d, other=0.0).to(tl.float32)
                acc += b_x * b_w[None, :]
            if HAS_BIAS:
                acc += tl.load(bias_ptr + col + o_d, mask=m_d, other=0.0).to(tl.float32)[None, :]
            # stock: the conv output and the SiLU in the weight dtype, then x's dtype
            b_y = _round_to(acc, w_dt)
            b_y = _round_to(_round_to(b_y / (1.0 + tl.exp(-b_y)), w_dt), dt)
            # fla's L2 norm of q and k: fp32 over the rounded conv output, 1 / sqrt(sum(x^2) + eps)
            b_y = tl.where(m_d[None, :], b_y, 0.0)
            b_rstd = 1.0 / tl.sqrt(tl.sum(b_y * b_y, axis=1) + eps)  # [BT]
            b_y = tl.where(is_qk, _round_to(b_y * b_rstd[:, None], dt), b_y)
            p_y = y_ptr + base + (i_b * T + o_t)[:, None] * width + o_col + o_d[None, :]
            tl.store(p_y, b_y.to(dt), mask=m_t[:, None] & m_d[None, :])
        else:  # the last program of each token block: beta = sigmoid(b) and the gate g, both fp32
            # (names differ from the other branch's: Triton wants one type per name across the two branches)
            o_v = tl.arange(0, BLOCK_HV)
            m_hv = o_v < HV
            m_v = m_t[:, None] & m_hv[None, :]
            b_b = tl.load(b_ptr + i_b * stride_bb + o_t[:, None] * stride_bt + o_v[None, :], mask=m_v, other=0.0)
            b_a = tl.load(a_ptr + i_b * stride_ab + o_t[:, None] * stride_at + o_v[None, :], mask=m_v, other=0.0)
            # stock: g = -A_log.float().exp() * softplus(a.float() + dt_bias), fp32
            b_A = _exp_exact(tl.load(A_log_ptr + o_v, mask=m_hv, other=0.0).to(tl.float32), ON_GPU)
            b_a = b_a.to(tl.float32) + tl.load(dt_bias_ptr + o_v, mask=m_hv, other=0.0).to(tl.float32)[None, :]
            o_bt = (i_b * T + o_t)[:, None] * HV + o_v[None, :]
            # beta = sigmoid(b) rounded to b's dtype, as stock's `b.sigmoid()` (its rule reads that, in fp32)
            tl.store(beta_ptr + o_bt, _round_to(tl.sigmoid(b_b.to(tl.float32)), b_ptr.dtype.element_ty), mask=m_v)
            tl.store(g_ptr + o_bt, -b_A[None, :] * _softplus(b_a, ON_GPU), mask=m_v)


def deltanet_prep(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    b: torch.Tensor,
    a: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    num_k_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    eps: float = _GDR_L2_EPS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gated DeltaNet prefill inputs in one launch: causal depthwise conv + SiLU over q|k|v (no initial state), the
    L2 norm of each q and k head, `beta = sigmoid(b)` and the gate `g = -exp(A_log) * softplus(a + dt_bias)`.

    Math per token t and channel c (fp32 inside, rounded where stock rounds): `y[t, c] = silu(sum_j x[t - W + 1 + j,
    c] * weight[c, j] + bias[c])` with x = 0 before the first token; then for q and k, per head,
    `y / sqrt(sum(y^2) + eps)` (fla's `l2norm_fwd`, over the rounded conv output).

    Args:
        x: [B, T, C] float32 / bfloat16 / float16, C = 2 * num_k_heads * head_k_dim + HV * head_v_dim: the q|k|v
            columns of the packed projection. Last dim contiguous, batch and token strides arbitrary (a column
            slice of the GEMM output).
        weight: [C, W] (`conv1d.weight.squeeze(1)`), float32 / bfloat16 / float16, last dim contiguous.
        bias: optional [C], contiguous (Qwen3.5 has none).
        b, a: [B, T, HV] float32 / bfloat16 / float16, last dim contiguous, other strides arbitrary: the
            `in_proj_b` / `in_proj_a` columns.
        A_log, dt_bias: [HV], contiguous, any float dtype (read as float32).
        num_k_heads, head_k_dim, head_v_dim: the layer's head layout (HV is b.shape[-1]).
        eps: the L2 norm's epsilon (stock and fla: 1e-6).

    Returns:
        `(q, k, v, beta, g)`: q, k [B, T, num_k_heads, head_k_dim] and v [B, T, HV, head_v_dim], contiguous, in
        x.dtype (q and k normalised); beta and g [B, T, HV] float32, contiguous (beta rounded to b's dtype first,
        as stock's `b.sigmoid()`). They are fla's rule's inputs with
        `use_qk_l2norm_in_kernel=False`, `use_beta_sigmoid_in_kernel=False`, `use_gate_in_kernel=False`.

    Replaces, in `Qwen3_5GatedDeltaNet.forward` without a cached state, `F.silu(self.conv1d(mixed_qkv)[..., :T])`,
    the split into q, k, v, `beta = b.sigmoid()`, `g = -self.A_log.float().exp() * F.softplus(a.float() +
    self.dt_bias)` and the q / k `l2norm` of the chunked rule.
    """
    _check_triton("deltanet_prep")
    for name, t in (("x", x), ("weight", weight), ("b", b), ("a", a), ("A_log", A_log), ("dt_bias", dt_bias)):
        _check_float(name, t)
        _check_last_dim_contiguous(name, t)
    if x.dim() != 3 or b.dim() != 3 or a.shape != b.shape or b.shape[:2] != x.shape[:2]:
        raise ValueError(f"x must be [B, T, C] and b, a [B, T, HV] with the same B, T; got x {tuple(x.shape)}, "
                         f"b {tuple(b.shape)}, a {tuple(a.shape)}.")
    B, T, C = x.shape
    HV = b.shape[2]
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
        if t.shape != (HV,):
            raise ValueError(f"{name} must have shape ({HV},) to match b {tuple(b.shape)}, got {tuple(t.shape)}.")
    key_dim, value_dim = num_k_heads * head_k_dim, HV * head_v_dim
    if min(num_k_heads, head_k_dim, head_v_dim, HV) < 1 or C != 2 * key_dim + value_dim:
        raise ValueError(f"x has C={C} channels, but num_k_heads={num_k_heads}, head_k_dim={head_k_dim}, HV={HV}, "
                         f"head_v_dim={head_v_dim} need 2 * {key_dim} + {value_dim}.")
    if weight.dim() != 2 or weight.shape[0] != C or weight.shape[1] < 1:
        raise ValueError(f"weight must be [C, W] = [{C}, W] for x {tuple(x.shape)}, got {tuple(weight.shape)}.")
    tensors = dict(x=x, weight=weight, b=b, a=a, A_log=A_log, dt_bias=dt_bias)
    if bias is not None:
        if bias.shape != (C,):
            raise ValueError(f"bias must have shape ({C},), got {tuple(bias.shape)}.")
        _check_float("bias", bias)
        _check_last_dim_contiguous("bias", bias)
        tensors["bias"] = bias
    _check_same_device(**tensors)

    y = torch.empty(B * T * C, dtype=x.dtype, device=x.device)
    q = y[: B * T * key_dim].view(B, T, num_k_heads, head_k_dim)
    k = y[B * T * key_dim : 2 * B * T * key_dim].view(B, T, num_k_heads, head_k_dim)
    v = y[2 * B * T * key_dim :].view(B, T, HV, head_v_dim)
    beta = torch.empty(B, T, HV, dtype=torch.float32, device=x.device)
    g = torch.empty(B, T, HV, dtype=torch.float32, device=x.device)
    if B > 0 and T > 0:
        BLOCK_T = min(_PREP_BLOCK_T, max(16, triton.next_power_of_2(T)))
        BLOCK_D = triton.next_power_of_2(max(head_k_dim, head_v_dim))
        with _device_guard(x):
            _deltanet_prep_kernel[(triton.cdiv(T, BLOCK_T), B, 2 * num_k_heads + HV + 1)](
                x, weight, bias if bias is not None else weight, b, a, A_log, dt_bias, y, beta, g,
                T, x.stride(0), x.stride(1), weight.stride(0), b.stride(0), b.stride(1), a.stride(0), a.stride(1),
                eps,
                HK=num_k_heads, DK=head_k_dim, HV=HV, DV=head_v_dim, W=weight.shape[1], HAS_BIAS=bias is not None,
                BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D, BLOCK_HV=triton.next_power_of_2(HV), ON_GPU=_on_gpu(x),
                num_warps=min(_PREP_WARPS, _num_warps(BLOCK_T * BLOCK_D)),
            )
    return q, k, v, beta, g


def deltanet_prep_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    b: torch.Tensor,
    a: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    num_k_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    eps: float = _GDR_L2_EPS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain-torch `deltanet_prep`: stock's conv1d + SiLU, then fla's L2 norm (fp32), stock's beta (`b.sigmoid()`
    in b's dtype, as float32) and stock's gate (fp32)."""
    B, T, C = x.shape
    W = weight.shape[1]
    y = torch.nn.functional.conv1d(x.transpose(1, 2).to(weight.dtype), weight.unsqueeze(1), bias, padding=W - 1,
                                   groups=C)[..., :T]
    y = torch.nn.functional.silu(y).to(x.dtype).transpose(1, 2)  # [B, T, C]
    key_dim = num_k_heads * head_k_dim
    q, k, v = torch.split(y, [key_dim, key_dim, C - 2 * key_dim], dim=-1)

    def l2(t):
        t = t.reshape(B, T, num_k_heads, head_k_dim).float()
        return (t / torch.sqrt(t.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)

    v = v.reshape(B, T, -1, head_v_dim).contiguous()
    g = -A_log.float().exp() * torch.nn.functional.softplus(a.float() + dt_bias.float())
    return l2(q), l2(k), v, b.sigmoid().float(), g


# ---------------------------------------------------------------------------------------------------------------------
# Gated DeltaNet prefill, the rule itself: fla's kernels, chosen for precision
#
# No kernel of ours. fla's chunked kernel computes its fp32 dots in TF32 (its triangular solve asks for TF32
# explicitly; its other dots take Triton's fp32 default, which is TF32 too). Measured on an H200 (2026-11-30, 4-layer
# random model, 16:16 heads, T=129, fp32): stock transformers with fla is 8.7e-4 (relative logit error) from stock's
# own torch rule, and so is the fused path through the chunked kernel; through fla's per-token kernel (no dots, IEEE
# fp32) the fused path is 6.8e-7 from stock's torch rule. torch's fp32 matmuls are IEEE unless the user allows TF32
# (`torch.set_float32_matmul_precision`), so fp32 follows that switch here too.
# ---------------------------------------------------------------------------------------------------------------------


def prefill_rule_kernel(dtype: torch.dtype, tokens: int | None = None) -> str:
    """Which fla kernel runs the gated delta rule over `tokens` tokens of `dtype`: "fused_recurrent" for fp32 while
    torch's fp32 matmul precision is "highest" (its default: no TF32), and for a single token (as stock, which runs
    its recurrent rule for one cached token); else "chunk". One decision point, read at every eager forward; a
    forward already captured in a CUDA graph keeps the kernel it was captured with."""
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return "fused_recurrent"
    return "fused_recurrent" if tokens == 1 else "chunk"


def gated_delta_rule_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    output_final_state: bool = False,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule over a prompt (from a zero state) or over the tokens that continue a cached state, by
    fla (`prefill_rule_kernel` picks the chunked or the per-token kernel), on the gate `deltanet_prep` computed.

    Args:
        q, k: [B, T, H, K], already L2-normalised (`deltanet_prep`); v: [B, T, HV, V], HV a multiple of H (grouped
            value heads, as stock's `repeat_interleave`); one dtype.
        g: [B, T, HV] float32, the gate `-exp(A_log) * softplus(a + dt_bias)` (the log of the decay); beta:
            [B, T, HV] float32, already `sigmoid(b)`.
        initial_state: optional [B, HV, K, V] (a cache's recurrent state), read as float32.

    Returns:
        o [B, T, HV, V] in q's dtype, and the final state [B, HV, K, V] float32 (None unless `output_final_state`).
    """
    kernel = prefill_rule_kernel(q.dtype, q.shape[1])
    if initial_state is not None:
        initial_state = initial_state.float()
    if kernel == "chunk":
        return fla_chunk_gated_delta_rule(
            q, k, v, g=g, beta=beta, initial_state=initial_state, output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False,
        )
    return fla_fused_recurrent_gated_delta_rule(
        q, k, v, g=g, beta=beta, initial_state=initial_state, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=False,
    )


def gated_delta_rule_prefill_ref(q, k, v, g, beta, output_final_state=False, initial_state=None):
    """Plain-torch `gated_delta_rule_prefill`: stock's torch rule on key heads repeated for their value heads (what
    stock runs without fla), the kernel `prefill_rule_kernel` picks for the GPU: per token (stock's recurrent rule)
    where it picks fla's per-token kernel (fp32, one token), else chunked. fp32 math inside; o in q's dtype, as fla
    returns it. The chunked rule's rounding depends on where its 64-token chunks fall, which a padded bucket moves: a
    CPU search case (fp32, decays at 4x spread) was 3x stock's own error from the float64 answer through the chunked
    rule with the chunks shifted by 15 tokens, where the GPU's per-token kernel has no chunks."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as stock  # lazy: only the references need transformers

    gate = g.float()
    group = v.shape[2] // q.shape[2]
    q, k = q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)
    per_token = prefill_rule_kernel(q.dtype, q.shape[1]) == "fused_recurrent"
    rule = inspect.unwrap(stock.torch_recurrent_gated_delta_rule if per_token else stock.torch_chunk_gated_delta_rule)
    if initial_state is not None:
        initial_state = initial_state.float()
    o, state = rule(q, k, v, g=gate, beta=beta, initial_state=initial_state, output_final_state=output_final_state,
                    use_qk_l2norm_in_kernel=False)
    return o.to(q.dtype).contiguous(), state  # laid out as fla's o, which the kernels after it read
