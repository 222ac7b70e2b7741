"""Fused inference ops for Qwen3.5: Triton kernels, fla glue, and a plain-torch reference beside each.

This is the only file of the repo that imports `triton` or `fla` (flash-linear-attention). Both imports sit in the
one gate below and never raise: where a package is missing, `HAS_TRITON` / `HAS_FLA` are False and the model falls
back to the stock transformers code (announced once by the model, never silently). transformers' remote-code import
check reads every file of a Hub repo, so nothing in this file may fail at import time.

Shape alphabet: B batch, T tokens, H attention heads, KV key/value heads, D head dim, R rotary dim, N hidden size,
I intermediate size, HV linear-attention value heads, K / V linear key / value head dims.

Triton ops (each `name()` beside its plain-torch `name_ref()`; fp32 / bf16 / fp16 in, fp32 math inside, rounded to
the input dtype exactly where stock rounds):
- `rms_norm`: zero-centred RMSNorm, optionally fused with the residual add before it.
- `attn_prep`: split of the fused q|gate, k, v projection -> q / k RMSNorm -> partial RoPE, one launch (for a decode
  step, writing k / v straight into the K/V cache at the step's slot).
- `sigmoid_gate_mul`: the full-attention output gate `o * sigmoid(gate)`.
- `swiglu`: `silu(g) * u` of the fused gate|up projection.
- `causal_conv1d_step`, `gated_delta_rule_step`: the single-token (decode) step of a Gated DeltaNet layer, state
  updated in place, CUDA-graph capturable.
- `deltanet_prep`: a Gated DeltaNet prefill's causal conv + SiLU of q|k|v, the q / k L2 norm and beta, one launch,
  ready for fla's `chunk_gated_delta_rule`; `gated_rms_norm`: the gated RMSNorm after it, reading z in place.
- `decode_attention`: the decode step's attention of one new token over the preallocated K/V cache (split keys,
  GQA, padding mask), merged with the output gate: two launches.
- `gated_delta_rule_prefill` (fla glue, no kernel of ours): a prompt's gated delta rule by fla's chunked kernel, or
  by its per-token kernel where fp32 must stay IEEE fp32 (`prefill_rule_kernel` decides).
- `gemv` (and `small_linear`, which picks it or cuBLAS per shape by timing both once): the decode step's linears
  for 1-16 rows as one weight read, optionally with the SwiGLU of the packed gate|up projection or the DeltaNet
  conv step (`causal_conv1d_step` on the first columns, state in place) in its epilogue.
- `mrope_step`: the decode step's rotary cos / sin (stock's interleaved mRoPE), positions moved on in place, one
  launch.
"""

import contextlib
import inspect
import logging
from typing import NamedTuple

import torch

try:  # the one optional-import gate of the repo
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:  # pragma: no cover - depends on the environment
    triton = None
    tl = None
    HAS_TRITON = False

try:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk_gated_delta_rule
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_fused_recurrent_gated_delta_rule

    HAS_FLA = True
except Exception:  # pragma: no cover - depends on the environment
    fla_chunk_gated_delta_rule = fla_fused_recurrent_gated_delta_rule = None
    HAS_FLA = False


def kernels_available() -> str | None:
    """None when the fused kernels can run here, else the reason they cannot (for the model's one log line)."""
    if not HAS_TRITON:
        return "triton is not installed"
    if not HAS_FLA:
        return "flash-linear-attention (fla) is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device is available"
    return None


_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Launch shapes. Not measured on an H200 yet; the reasoning: a tile of _TILE elements with 8 elements per thread
# gives every thread one 16-byte load of bf16, and we stop packing several rows (or heads) into one program once
# that would leave fewer than _MIN_PROGRAMS programs (4 per SM on the 132 SMs of an H200), so decode (T=1) and
# short prompts keep one row per program and spread over the SMs.
_TILE = 4096
_ELEMS_PER_THREAD = 8
_MIN_PROGRAMS = 4 * 132
# swiglu has no reduction, so a row is cut into blocks of this many outputs: 1024 divides 3584 into 4 blocks
# (87.5% of lanes busy) and 9216 into 9 (100%), and gives 9 programs per token at decode instead of 3.
_SWIGLU_BLOCK = 1024


def _num_warps(tile_elems: int) -> int:
    """Warps for a tile of `tile_elems` elements: about `_ELEMS_PER_THREAD` elements per thread, 1 to 16 warps."""
    return max(1, min(16, tile_elems // (32 * _ELEMS_PER_THREAD)))


def _units_per_program(n_units: int, unit_elems: int, cap: int) -> int:
    """How many rows (or heads) of `unit_elems` elements one program takes: a power of two that fills at most a
    `_TILE`-element tile, is at most `cap`, and still leaves `_MIN_PROGRAMS` programs for `n_units` units."""
    n = max(1, min(_TILE // unit_elems, n_units // _MIN_PROGRAMS, cap))
    return 1 << (n.bit_length() - 1)


def _device_guard(t: torch.Tensor):
    """Launch on `t`'s GPU even when another one is current (Triton launches on the current device)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


# Programmatic dependent launch (PDL, sm_90+). The decode step is ~300 small kernels per token, and each one
# otherwise starts only after the one before has drained: launch, ramp-up and tail are paid one after another.
# With PDL every kernel of ours is launched so that it may start while the one before finishes; it first signals
# that the next kernel may launch too (`gdc_launch_dependents`), then waits on the grid dependency (`gdc_wait`:
# every earlier kernel complete, its writes visible) before it reads or writes anything an earlier kernel touches;
# a GEMV of a large weight signals only after its weight loop instead (`_GEMV_LATE_TRIGGER_ELEMS`).
# The GEMV loads its first weight tile before the wait (no kernel writes the weights), so its reads overlap the
# kernel before it. Kernels that are not ours (cuBLAS, torch) are launched normally and wait as always. Set False
# to turn it off (an A/B switch for benchmarks; read at launch, so it takes effect at the next capture).
PDL_ENABLED = True
_pdl_capable: dict = {}


def _triton_has_pdl() -> bool:
    """This Triton has the grid dependency instructions and the `launch_pdl` launch option."""
    if not HAS_TRITON:
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions

        return hasattr(tl.extra.cuda, "gdc_wait") and "launch_pdl" in CUDAOptions.__dataclass_fields__
    except Exception:  # noqa: BLE001 - no NVIDIA backend: no PDL
        return False


_HAS_GDC = _triton_has_pdl()


def pdl_enabled(device: torch.device) -> bool:
    """Whether our kernels on `device` use programmatic dependent launch: `PDL_ENABLED`, a CUDA device of compute
    capability 9.0 or newer, and a Triton with grid dependency control. One decision point."""
    device = torch.device(device)
    if not (PDL_ENABLED and _HAS_GDC and device.type == "cuda"):
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _pdl_capable:
        _pdl_capable[index] = torch.cuda.get_device_capability(index) >= (9, 0)
    return _pdl_capable[index]


def _pdl_launch(pdl: bool) -> dict:
    """The launch option of a PDL kernel (none otherwise: the interpreter takes no launch options)."""
    return {"launch_pdl": True} if pdl else {}


def _check_triton(op: str) -> None:
    if not HAS_TRITON:
        raise RuntimeError(f"fused_ops.{op} needs triton, which is not installed; use {op}_ref instead.")


def _check_float(name: str, t: torch.Tensor) -> None:
    if t.dtype not in _DTYPES:
        raise ValueError(f"{name} must be float32, bfloat16 or float16, got {t.dtype}.")


def _check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"all tensors must be on one device, got {devices}.")


def _check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dim, got shape {tuple(t.shape)} strides {t.stride()}.")


def _batch_stride(t: torch.Tensor) -> int:
    """Stride of dim 0, or 0 where dim 0 has size 1 (broadcast over the batch)."""
    return 0 if t.shape[0] == 1 else t.stride(0)


def _as_rows(name: str, t: torch.Tensor) -> torch.Tensor:
    """`t` [..., N] as a [rows, N] view (any row stride), without a copy; ValueError where no such view exists."""
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        raise ValueError(
            f"{name} with shape {tuple(t.shape)} and strides {t.stride()} cannot be seen as [rows, {t.shape[-1]}] "
            "with one row stride; pass a tensor whose leading dims can be flattened without a copy."
        ) from None


if HAS_TRITON:

    @triton.jit
    def _round_to(x, DT: tl.constexpr):
        """`x` (float32) rounded to nearest-even in dtype DT, returned as float32. bfloat16 is rounded by hand because
        the Triton interpreter's float32 -> bfloat16 cast truncates; this keeps CPU (CI) and GPU results identical,
        and costs three integer ops on the GPU."""
        if DT == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            y = bits.to(tl.float32, bitcast=True)
        elif DT == tl.float16:
            y = x.to(tl.float16).to(tl.float32)
        else:
            y = x
        return y

    @triton.jit
    def _pdl_wait(PDL: tl.constexpr):
        """With PDL: let the next kernel launch, then wait until every earlier kernel is done (see `pdl_enabled`)."""
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()


# ---------------------------------------------------------------------------------------------------------------------
# 1. RMSNorm (zero-centred weight), optionally fused with the residual add before it
# ---------------------------------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit
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
        BLOCK_M = _units_per_program(n_rows, BLOCK_N, cap=triton.next_power_of_2(n_rows))
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
# 2. Attention input prep: split of the fused q|gate, k, v projection -> q/k RMSNorm -> partial RoPE -> gate
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

    @triton.jit
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
            # k / v rows: [B, T, KV, D] buffers, or (AT_SLOT, T = 1) position `slot` of [B, KV, L, D] caches
            i_t_kv = tl.load(slot_ptr) if AT_SLOT else i_t
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
        kv_cache: optional `(keys, values, slot)` for a decode step (T = 1): caches [B, KV, L, D] in qkv's dtype,
            last dim contiguous, and slot [1] int64 on the device; k and v are written at position `slot` of the
            caches (read on the GPU: capturable) instead of into new buffers. `slot` < L is the caller's to keep
            (checking it would wait for the GPU); the decode cache refuses a step once it is full.

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
        if T != 1:
            raise ValueError(f"kv_cache (a decode step's in-place K/V write) needs T = 1, got qkv {tuple(qkv.shape)}.")
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
    copied into the caches at `slot` with `index_copy_`, as the decode step did before the kernel wrote them)."""
    if kv_cache is not None:
        q, k, v, gate = attn_prep_ref(qkv, cos, sin, q_weight, k_weight, eps, num_heads, num_kv_heads, head_dim)
        keys, values, slot = kv_cache
        keys.index_copy_(2, slot, k)
        values.index_copy_(2, slot, v)
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
# 3. Output gate of full attention: o * sigmoid(gate)
# ---------------------------------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit
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
# 4. SwiGLU of the fused gate|up projection
# ---------------------------------------------------------------------------------------------------------------------

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
# 5. Gated DeltaNet decode step (T=1), part 1: causal depthwise conv1d update + SiLU
#
# Sections 5 and 6 are the kernels of a CUDA-graph-capturable single-token step of a Gated DeltaNet layer: they
# update their state tensors in place (fixed addresses a graph can replay), allocate nothing but their output (and
# nothing at all given `out=`), never read a value back to the host, and take a batch of B rows.
# ---------------------------------------------------------------------------------------------------------------------

# Channels per program. Not measured on an H200 yet; the reasoning: the step moves a few bytes per channel, so it is
# latency-bound, and 256 channels x W=4 taps (4 warps, 8 elements per thread) cuts the 6144-10240 conv channels of
# the real models into 24-40 programs per row instead of 6-10 with 1024.
_CONV_BLOCK_D = 256

if HAS_TRITON:

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
        o_w = tl.arange(0, BLOCK_W)  # [BW] taps
        m_d = o_d < D
        m = m_d[:, None] & (o_w < W)[None, :]  # [BD, BW]
        w_dt = w_ptr.dtype.element_ty

        b_x = tl.load(x_ptr + i_b * stride_x + o_d, mask=m_d, other=0.0).to(tl.float32)  # [BD]
        p_s = s_ptr + i_b * stride_s_b + o_d[:, None] * stride_s_d  # [BD, 1]
        # the window after the step: old taps 1..W-1, then x
        m_old = m_d[:, None] & (o_w < W - 1)[None, :]
        b_s = tl.load(p_s + (o_w[None, :] + 1) * stride_s_w, mask=m_old, other=0.0).to(tl.float32)  # [BD, BW]
        b_s = tl.where((o_w == W - 1)[None, :], b_x[:, None], b_s)
        # the shift stores tap w, which another thread of this program may still have to load (as the old tap w for
        # its window's w - 1): every thread finishes its loads before any thread stores
        tl.debug_barrier()
        # stock casts the window to the weight dtype, then copies it into the state (casting to the state dtype)
        b_s = _round_to(b_s, w_dt)
        s_dt = s_ptr.dtype.element_ty
        tl.store(p_s + o_w[None, :] * stride_s_w, _round_to(b_s, s_dt).to(s_dt), mask=m)

        b_w = tl.load(w_ptr + o_d[:, None] * stride_w + o_w[None, :], mask=m, other=0.0).to(tl.float32)  # [BD, BW]
        b_y = tl.sum(b_s * b_w, axis=1)  # [BD]
        if HAS_BIAS:
            b_y += tl.load(bias_ptr + o_d, mask=m_d, other=0.0).to(tl.float32)
        # stock: conv1d output in the weight dtype, SiLU in the weight dtype, then cast to x's dtype
        b_y = _round_to(b_y, w_dt)
        b_y = _round_to(b_y / (1.0 + tl.exp(-b_y)), w_dt)
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
    x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Plain-torch `causal_conv1d_step` (conv_state updated in place), rounding as stock `causal_conv1d_update`."""
    # stock: the window cast to the weight dtype is both the conv input and the new state
    window = torch.cat([conv_state[:, :, 1:].to(weight.dtype), x[:, :, None].to(weight.dtype)], dim=-1)  # [B, D, W]
    conv_state.copy_(window)
    y = (window.float() * weight.float()).sum(-1)  # [B, D], fp32 accumulation as conv1d's
    if bias is not None:
        y = y + bias.float()
    return torch.nn.functional.silu(y.to(weight.dtype)).to(x.dtype)


# ---------------------------------------------------------------------------------------------------------------------
# 6. Gated DeltaNet decode step (T=1), part 2: gate, beta, q/k L2 norm and the gated delta rule state update
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
        PDL: tl.constexpr,
    ):
        # program (row, value head, block of V columns); value head i_hv reads key head i_hv // GROUP
        i_b = tl.program_id(0).to(tl.int64)
        i_hv = tl.program_id(1).to(tl.int64)
        i_h = i_hv // GROUP
        o_k = tl.arange(0, BLOCK_K)  # [BK]
        o_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)  # [BV]
        m_k = o_k < K
        m_v = o_v < V
        m_s = m_k[:, None] & m_v[None, :]  # [BK, BV]
        p_s = s_ptr + i_b * stride_s_b + i_hv * stride_s_h + o_k[:, None] * stride_s_k + o_v[None, :]  # [BK, BV]
        if PREFETCH_STATE and PDL:  # the caller vouches that no kernel still running writes the state
            tl.extra.cuda.gdc_launch_dependents()
            b_s = tl.load(p_s, mask=m_s, other=0.0)  # the state tile loads while the kernel before drains
            tl.extra.cuda.gdc_wait()  # then q, k, v, a, b, written by an earlier kernel
        else:
            _pdl_wait(PDL)  # before any load: an earlier kernel writes this one's inputs
            b_s = tl.load(p_s, mask=m_s, other=0.0)

        # q, k L2-normalised in fp32; q also scaled
        b_q = tl.load(q_ptr + i_b * stride_q_b + i_h * stride_q_h + o_k, mask=m_k, other=0.0).to(tl.float32)  # [BK]
        b_k = tl.load(k_ptr + i_b * stride_k_b + i_h * stride_k_h + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_q = b_q * tl.math.rsqrt(tl.sum(b_q * b_q) + eps) * scale
        b_k = b_k * tl.math.rsqrt(tl.sum(b_k * b_k) + eps)

        # decay g = -exp(A_log) * softplus(a + dt_bias), fp32; softplus as torch's (threshold 20), with log1p(e)
        # computed as log(u) * e / (u - 1), u = 1 + e, which stays accurate where e is far below 1
        b_a = tl.load(a_ptr + i_b * stride_a_b + i_hv * stride_a_h).to(tl.float32)
        b_a += tl.load(dt_bias_ptr + i_hv).to(tl.float32)
        b_e = tl.exp(tl.minimum(b_a, 20.0))
        b_u = 1.0 + b_e
        b_sp = tl.where(b_u == 1.0, b_e, tl.log(b_u) * (b_e / tl.where(b_u == 1.0, 1.0, b_u - 1.0)))
        b_sp = tl.where(b_a > 20.0, b_a, b_sp)
        b_decay = tl.exp(-tl.exp(tl.load(A_log_ptr + i_hv).to(tl.float32)) * b_sp)
        # beta = sigmoid(b), rounded to b's dtype as stock's `b.sigmoid()` is
        b_bt = tl.load(b_ptr + i_b * stride_b_b + i_hv * stride_b_h).to(tl.float32)
        b_beta = _round_to(1.0 / (1.0 + tl.exp(-b_bt)), b_ptr.dtype.element_ty)

        b_v = tl.load(v_ptr + i_b * stride_v_b + i_hv * stride_v_h + o_v, mask=m_v, other=0.0).to(tl.float32)  # [BV]
        b_s = b_s * b_decay
        b_kv = tl.sum(b_s * b_k[:, None], axis=0)  # [BV] = S^T k
        b_s += b_k[:, None] * ((b_v - b_kv) * b_beta)[None, :]
        tl.store(p_s, b_s, mask=m_s)
        b_o = tl.sum(b_s * b_q[:, None], axis=0)  # [BV] = S^T q
        o_dt = o_ptr.dtype.element_ty
        tl.store(o_ptr + i_b * stride_o_b + i_hv * stride_o_h + o_v, _round_to(b_o, o_dt).to(o_dt), mask=m_v)


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

    Returns:
        o [B, HV, V] in q's dtype (`out` when given, else a new contiguous tensor).

    Replaces, in `Qwen3_5GatedDeltaNet.forward` at single-token cached decode, `beta = b.sigmoid()`,
    `g = -A_log.float().exp() * softplus(a.float() + dt_bias)` and stock
    `torch_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=state, output_final_state=True,
    use_qk_l2norm_in_kernel=True)` with T=1 (whose new state is written back over `state`). No host sync.
    """
    _check_triton("gated_delta_rule_step")
    for name, t in (("q", q), ("k", k), ("v", v), ("a", a), ("b", b), ("A_log", A_log), ("dt_bias", dt_bias)):
        _check_float(name, t)
    if q.dim() != 3 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [B, H, K], got {tuple(q.shape)} and {tuple(k.shape)}.")
    B, H, K = q.shape
    if v.dim() != 3 or v.shape[0] != B or v.shape[1] < 1 or H < 1 or v.shape[1] % H:
        raise ValueError(f"v must be [B, HV, V] = [{B}, HV, V] with HV a multiple of H = {H} for q "
                         f"{tuple(q.shape)}, got {tuple(v.shape)}.")
    HV, V = v.shape[1:]
    if not 1 <= K <= _GDR_MAX_K or V < 1:
        raise ValueError(f"K must be in [1, {_GDR_MAX_K}] (the state's K rows sit in registers) and V >= 1, got "
                         f"K={K}, V={V}.")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}.")
    for name, t in (("a", a), ("b", b)):
        if t.shape != (B, HV):
            raise ValueError(f"{name} must be [B, HV] = {(B, HV)} to match v {tuple(v.shape)}, got {tuple(t.shape)}.")
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
        if t.shape != (HV,):
            raise ValueError(f"{name} must have shape ({HV},) to match v {tuple(v.shape)}, got {tuple(t.shape)}.")
        _check_last_dim_contiguous(name, t)
    if state.shape != (B, HV, K, V) or state.dtype != torch.float32:
        raise ValueError(f"state must be [B, HV, K, V] = {(B, HV, K, V)} float32, got {tuple(state.shape)} "
                         f"{state.dtype}.")
    for name, t in (("q", q), ("k", k), ("v", v), ("state", state)):
        _check_last_dim_contiguous(name, t)
    tensors = dict(q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias, state=state)
    if out is None:
        out = torch.empty(B, HV, V, dtype=q.dtype, device=q.device)
    else:
        if out.shape != (B, HV, V) or out.dtype != q.dtype:
            raise ValueError(f"out must be [B, HV, V] = {(B, HV, V)} in q's dtype {q.dtype}, got "
                             f"{tuple(out.shape)} {out.dtype}.")
        _check_last_dim_contiguous("out", out)
        tensors["out"] = out
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
                # about 32 state values per thread: 4 warps for the real [128, 32] tile
                num_warps=max(1, min(8, BLOCK_K * BLOCK_V // (32 * 32))),
                PDL=pdl,
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
    prefetch_state: bool = False,
) -> torch.Tensor:
    """Plain-torch `gated_delta_rule_step` (state updated in place), rounding as stock does. `prefetch_state` is
    taken and ignored: it orders a kernel's loads, and there is no kernel here."""
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
    return (s * q[..., None]).sum(-2).to(v.dtype)


# ---------------------------------------------------------------------------------------------------------------------
# 7. Decode-batch linear (GEMV, M <= 16 rows), optionally with the SwiGLU epilogue, and the per-shape choice between
#    it and cuBLAS
#
# Why a kernel of our own: a decode step reads every weight once for 1-16 rows, so a linear is a pure weight read.
# On the H200 (2026-11-30 profile, 4B, batch 1) cuBLAS's small-M kernels read the large matrices at ~84% of the copy
# rate and the small ones far below it, with a split-K reduce kernel after a third of them; together 1.24x the
# weight-read floor. Nothing maintained fuses the SwiGLU of the gate|up projection into a GEMV either. Whether this
# kernel beats cuBLAS is decided on the card, per shape: `small_linear` times both at the step's first (eager) call
# and keeps the faster, so it cannot make a shape slower than cuBLAS.
# ---------------------------------------------------------------------------------------------------------------------

# `GemvConfig`s tried per shape (`_GEMV_CONFIGS` below). In the sweeps (H200, weights cold in L2; PERFORMANCE.md) few
# rows and long rows (2 x 1024-2048) win the matrices with few outputs (o_proj, out_proj, down_proj), 1-8 x 256-512
# the tall ones (gate|up, in_proj, the LM head). At 8 rows cuBLAS won every shape.
#
# The fourth field: True sums each weight tile across threads as it goes, False adds the tiles elementwise into a
# [rows, BLOCK_N, BLOCK_K] accumulator summed once after the loop, where that accumulator takes at most
# `_GEMV_ACC_REGS` registers a thread (every shipped config at one row; with more rows, the small tiles only).
# At one row the accumulator read the out / down projections 11-15% faster, the per-tile sum the LM heads and the
# 4B gate|up 2-3% faster (H200, 2026-12-01, PERFORMANCE.md).
_GEMV_ACC_REGS = 64


class GemvConfig(NamedTuple):
    """One `gemv` launch configuration: output rows per program, K per weight tile, warps; whether each tile is
    summed across threads as it goes (`sum_per_tile`) or added into one accumulator summed after the loop (when it
    fits in `_GEMV_ACC_REGS` registers a thread; the per-tile sum otherwise);
    and how many times the tile loop is unrolled (`unroll`: a later tile's load issues before an earlier tile's
    FMAs wait for theirs)."""

    block_n: int
    block_k: int
    warps: int
    sum_per_tile: bool = False
    unroll: int = 1


def _gemv_row_acc(cfg: GemvConfig, block_m: int, block_k: int, gate_up: bool) -> bool:
    """Whether `gemv` runs `cfg` with the one-accumulator loop (else it sums each tile across threads): asked for, and
    the [block_m, block_n, block_k] float32 accumulator (two with `gate_up`) fits `_GEMV_ACC_REGS` registers a
    thread."""
    elems = block_m * cfg.block_n * block_k * (2 if gate_up else 1)
    return not cfg.sum_per_tile and elems <= _GEMV_ACC_REGS * 32 * cfg.warps


# Each the fastest for some decode shape in `scripts/benchmark_gemv.py`'s sweep (H200, 2026-12-01, PERFORMANCE.md):
# the unrolled ones at one row for the 4B / 0.8B DeltaNet input, gate|up, attention input and 0.8B down projections,
# the per-tile sum for the LM heads; the first six also cover 9B's shapes, which that sweep did not time.
_GEMV_CONFIGS = tuple(GemvConfig(*c) for c in (
    (8, 512, 4, False), (2, 1024, 4, False), (2, 2048, 8, False), (4, 512, 4, False), (8, 256, 4, False),
    (1, 2048, 4, False), (4, 1024, 4, True), (8, 256, 4, True), (4, 512, 4, False, 2), (4, 512, 4, False, 4),
    (1, 512, 4, False, 2), (8, 256, 4, False, 2), (4, 2048, 8, False), (2, 2048, 8, False, 2),
))
_GEMV_MAX_M = 16
# With PDL a GEMV of at least this many weight elements lets the next kernel launch only after its K loop, not at its
# start. Launched at the start, the next kernel's programs (and, through its own early signal, the GEMV after it) take
# SM slots while this GEMV still has waves to run, and sit in their wait holding them. In-process A/B (H200,
# 2026-12-01, PERFORMANCE.md): at 4B batch 1 the late signal on every GEMV read -0.022 and -0.088 ms a token on two
# machines, on those of >= 9M elements alike (-0.087); at 0.8B on every GEMV +0.015 ms, at >= 9M (its LM head only)
# +0.0003. At 9B, whose linears are all past it, -0.044 ms (4B -0.034 in the same run); 27B not measured.
_GEMV_LATE_TRIGGER_ELEMS = 9_000_000


def gemv_late_signal_min_elems() -> int:
    """With PDL, the weight size (elements) from which `gemv` signals the next kernel after its loop (`describe()`)."""
    return _GEMV_LATE_TRIGGER_ELEMS


def _gemv_late_trigger(w: torch.Tensor, pdl: bool) -> bool:
    """Whether `gemv` on `w` lets the next kernel launch only after its K loop (`_GEMV_LATE_TRIGGER_ELEMS`)."""
    return pdl and w.numel() >= _GEMV_LATE_TRIGGER_ELEMS


# `gemv`'s / `small_linear`'s optional conv epilogue: (conv_state [M, C, W], conv weight [C, W], bias [C] or None)
ConvStep = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]

if HAS_TRITON:

    @triton.jit
    def _gemv_kernel(
        x_ptr, w_ptr, y_ptr, s_ptr, cw_ptr, cb_ptr, M, N, K, C, stride_xm, stride_ym,
        stride_s_b, stride_s_d, stride_s_w, stride_cw,
        SWIGLU: tl.constexpr, CONV: tl.constexpr, CONV_W: tl.constexpr, CONV_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_W: tl.constexpr,
        ROW_ACC: tl.constexpr, UNROLL: tl.constexpr, PDL: tl.constexpr, LATE_TRIGGER: tl.constexpr,
    ):
        o_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # output columns of this program
        m_n = o_n < N
        o_m = tl.arange(0, BLOCK_M)
        dt = y_ptr.dtype.element_ty
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if ROW_ACC:
            if BLOCK_M == 1:
                acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
                acc2_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
            else:
                acc3 = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
                acc3_u = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
        if PDL and not LATE_TRIGGER:  # the next kernel may launch now (else after the loop, below)
            tl.extra.cuda.gdc_launch_dependents()
        # the first weight tile, loaded before the loop: with PDL, while the kernel before drains (no kernel writes
        # the weights); [BN, BK], read once for every row of x
        o_k = tl.arange(0, BLOCK_K)
        m_w = m_n[:, None] & (o_k < K)[None, :]
        p_w = w_ptr + o_n.to(tl.int64)[:, None] * K + o_k[None, :]
        b_w = tl.load(p_w, mask=m_w, other=0.0).to(tl.float32)
        if SWIGLU:  # the up rows sit N rows below the gate rows of the packed gate|up matrix
            b_wu = tl.load(p_w + N.to(tl.int64) * K, mask=m_w, other=0.0).to(tl.float32)
        if PDL:
            tl.extra.cuda.gdc_wait()  # then x, written by an earlier kernel
        # UNROLL > 1: the loop body repeated, so a later tile's load can issue before an earlier tile's FMAs wait
        for k0 in tl.range(0, K, BLOCK_K, loop_unroll_factor=UNROLL):
            o_k = k0 + tl.arange(0, BLOCK_K)
            m_k = o_k < K
            m_w = m_n[:, None] & m_k[None, :]
            p_w = w_ptr + o_n.to(tl.int64)[:, None] * K + o_k[None, :]
            if k0 > 0:  # tile 0 was loaded before the loop
                b_w = tl.load(p_w, mask=m_w, other=0.0).to(tl.float32)
                if SWIGLU:
                    b_wu = tl.load(p_w + N.to(tl.int64) * K, mask=m_w, other=0.0).to(tl.float32)
            if ROW_ACC:  # elementwise FMAs into a [BM,] BN, BK accumulator, reduced once after the loop
                if BLOCK_M == 1:
                    b_x = tl.load(x_ptr + o_k, mask=m_k, other=0.0).to(tl.float32)
                    acc2 += b_w * b_x[None, :]
                    if SWIGLU:
                        acc2_u += b_wu * b_x[None, :]
                else:  # rows past M re-read row M-1; their store is masked
                    p_x = x_ptr + tl.minimum(o_m, M - 1)[:, None] * stride_xm + o_k[None, :]
                    b_x = tl.load(p_x, mask=m_k[None, :], other=0.0).to(tl.float32)  # [BM, BK]
                    acc3 += b_w[None, :, :] * b_x[:, None, :]
                    if SWIGLU:
                        acc3_u += b_wu[None, :, :] * b_x[:, None, :]
            else:
                for i_m in tl.static_range(BLOCK_M):
                    # rows past M (BLOCK_M is M rounded up to a power of two) re-read row M-1; their store is masked
                    b_x = tl.load(x_ptr + tl.minimum(i_m, M - 1) * stride_xm + o_k, mask=m_k, other=0.0).to(tl.float32)
                    sel = (o_m == i_m)[:, None]
                    acc = tl.where(sel, acc + tl.sum(b_w * b_x[None, :], axis=1)[None, :], acc)
                    if SWIGLU:
                        acc_u = tl.where(sel, acc_u + tl.sum(b_wu * b_x[None, :], axis=1)[None, :], acc_u)
        if LATE_TRIGGER:  # every weight tile of this program is in: the next kernel may launch
            tl.extra.cuda.gdc_launch_dependents()
        if ROW_ACC:
            if BLOCK_M == 1:
                acc = tl.sum(acc2, axis=1)[None, :]
                if SWIGLU:
                    acc_u = tl.sum(acc2_u, axis=1)[None, :]
            else:
                acc = tl.sum(acc3, axis=2)
                if SWIGLU:
                    acc_u = tl.sum(acc3_u, axis=2)
        b_y = _round_to(acc, dt)  # the linear's output, rounded once as cuBLAS rounds it
        if SWIGLU:  # stock: silu(gate) rounded, times up (rounded), rounded
            b_s = _round_to(b_y / (1.0 + tl.exp(-b_y)), dt)
            b_y = _round_to(b_s * _round_to(acc_u, dt), dt)
        if CONV:  # the conv step + SiLU of the first C columns, as `causal_conv1d_step` on them (same roundings)
            m_c = m_n & (o_n < C)  # [BN] conv channels of this program: no other program touches their state
            m_mc = (o_m < M)[:, None] & m_c[None, :]  # [BM, BN]
            o_w = tl.arange(0, BLOCK_W)
            w_dt = cw_ptr.dtype.element_ty
            p_s = (s_ptr + o_m.to(tl.int64)[:, None, None] * stride_s_b + o_n.to(tl.int64)[None, :, None] * stride_s_d
                   + o_w[None, None, :] * stride_s_w)  # [BM, BN, BW]
            m_old = m_mc[:, :, None] & (o_w < CONV_W - 1)[None, None, :]
            b_win = tl.load(p_s + stride_s_w, mask=m_old, other=0.0).to(tl.float32)  # old taps 1..W-1
            b_win = tl.where((o_w == CONV_W - 1)[None, None, :], b_y[:, :, None], b_win)  # then this token's value
            b_win = _round_to(b_win, w_dt)
            tl.debug_barrier()  # every thread has loaded the old taps before any thread shifts them
            s_dt = s_ptr.dtype.element_ty
            tl.store(p_s, _round_to(b_win, s_dt).to(s_dt), mask=m_mc[:, :, None] & (o_w < CONV_W)[None, None, :])
            m_cw = m_c[:, None] & (o_w < CONV_W)[None, :]
            b_cw = tl.load(cw_ptr + o_n[:, None] * stride_cw + o_w[None, :], mask=m_cw, other=0.0).to(tl.float32)
            b_c = tl.sum(b_win * b_cw[None, :, :], axis=2)  # [BM, BN]
            if CONV_BIAS:
                b_c += tl.load(cb_ptr + o_n, mask=m_c, other=0.0).to(tl.float32)[None, :]
            b_c = _round_to(b_c, w_dt)
            b_c = _round_to(b_c / (1.0 + tl.exp(-b_c)), w_dt)
            b_y = tl.where(m_c[None, :], _round_to(b_c, dt), b_y)
        p_y = y_ptr + o_m[:, None] * stride_ym + o_n[None, :]
        tl.store(p_y, b_y.to(dt), mask=(o_m < M)[:, None] & m_n[None, :])


def gemv(
    x: torch.Tensor,
    w: torch.Tensor,
    gate_up: bool = False,
    config: tuple[int, int, int] | None = None,
    conv: ConvStep | None = None,
):
    """`x @ w.T` for a few rows, as one weight read; with `gate_up`, `silu(x @ g.T) * (x @ u.T)` for `w = [g; u]`;
    with `conv`, the DeltaNet decode step's causal conv + SiLU applied to the first C output columns in the epilogue.

    Args:
        x: [M, K], 1 <= M <= 16, float32 / bfloat16 / float16, last dim contiguous (any row stride).
        w: [N, K] contiguous, x's dtype and device; with `gate_up`, [2*I, K] (gate rows, then up rows).
        config: a `GemvConfig` or a tuple of its fields (BLOCK_N, BLOCK_K, num_warps[, sum_per_tile[, unroll]]);
            default the first of `_GEMV_CONFIGS`.
        conv: optional `(conv_state [M, C, W], weight [C, W], bias [C] or None)` as `causal_conv1d_step` takes
            them, C <= N, not with `gate_up`: columns [0, C) of the output are the conv step of the linear's
            (rounded) output, and conv_state is updated in place. Saves the conv step's launch: each program owns
            its output columns, so it owns their conv state too.

    Returns:
        y [M, N] (or [M, I] with `gate_up`) contiguous, in x.dtype: fp32 accumulation, one rounding, as
        `F.linear` (then `swiglu`'s roundings, or `causal_conv1d_step`'s on the conv columns: bit-identical to the
        two launches).
    """
    _check_triton("gemv")
    _check_float("x", x)
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"gemv needs x [M, K] and w [N, K], got {tuple(x.shape)} and {tuple(w.shape)}.")
    if not 1 <= x.shape[0] <= _GEMV_MAX_M:
        raise ValueError(f"gemv takes 1 to {_GEMV_MAX_M} rows, got M={x.shape[0]}.")
    if w.dtype != x.dtype or not w.is_contiguous():
        raise ValueError(f"gemv needs a contiguous weight in x's dtype ({x.dtype}), got {w.dtype}, "
                         f"contiguous={w.is_contiguous()}.")
    if gate_up and w.shape[0] % 2:
        raise ValueError(f"gemv with gate_up needs an even number of weight rows (gate | up), got {w.shape[0]}.")
    _check_same_device(x=x, w=w)
    _check_last_dim_contiguous("x", x)
    M, K = x.shape
    N = w.shape[0] // 2 if gate_up else w.shape[0]
    state, conv_w, conv_b = conv if conv is not None else (w, w, None)
    C, W = 0, 1
    if conv is not None:
        if gate_up:
            raise ValueError("gemv takes either gate_up or conv, not both.")
        _check_float("conv_state", state)
        _check_float("conv weight", conv_w)
        if state.dim() != 3 or state.shape[0] != M or not 1 <= state.shape[1] <= N:
            raise ValueError(f"gemv's conv_state must be [M, C, W] with M = {M} and C <= N = {N}, got "
                             f"{tuple(state.shape)}.")
        C, W = state.shape[1:]
        if conv_w.shape != (C, W):
            raise ValueError(f"gemv's conv weight must be [C, W] = {(C, W)} to match conv_state "
                             f"{tuple(state.shape)}, got {tuple(conv_w.shape)}.")
        _check_last_dim_contiguous("conv weight", conv_w)
        if conv_b is not None:
            if conv_b.shape != (C,):
                raise ValueError(f"gemv's conv bias must have shape ({C},), got {tuple(conv_b.shape)}.")
            _check_float("conv bias", conv_b)
            _check_last_dim_contiguous("conv bias", conv_b)
        bias = {"conv_bias": conv_b} if conv_b is not None else {}
        _check_same_device(x=x, conv_state=state, conv_weight=conv_w, **bias)
    cfg = GemvConfig(*(config or _GEMV_CONFIGS[0]))
    if cfg.unroll < 1:
        raise ValueError(f"gemv's unroll must be 1 or more, got {cfg.unroll}.")
    BLOCK_N, BLOCK_K, num_warps = cfg.block_n, cfg.block_k, cfg.warps
    BLOCK_K = min(BLOCK_K, triton.next_power_of_2(K))
    BLOCK_M = triton.next_power_of_2(M)
    row_acc = _gemv_row_acc(cfg, BLOCK_M, BLOCK_K, gate_up)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    with _device_guard(x):
        pdl = pdl_enabled(x.device)
        _gemv_kernel[(triton.cdiv(N, BLOCK_N),)](
            x, w, y, state, conv_w, conv_b if conv_b is not None else conv_w, M, N, K, C, x.stride(0), y.stride(0),
            *(state.stride() if conv is not None else (0, 0, 0)), conv_w.stride(0),
            SWIGLU=gate_up, CONV=conv is not None, CONV_W=W, CONV_BIAS=conv_b is not None,
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, BLOCK_W=triton.next_power_of_2(W),
            ROW_ACC=row_acc, UNROLL=cfg.unroll, num_warps=num_warps,
            PDL=pdl, LATE_TRIGGER=_gemv_late_trigger(w, pdl),
            **_pdl_launch(pdl),
        )
    return y


def gemv_ref(
    x: torch.Tensor,
    w: torch.Tensor,
    gate_up: bool = False,
    conv: ConvStep | None = None,
) -> torch.Tensor:
    """Plain-torch `gemv`: `F.linear`, then stock's SwiGLU for `gate_up`, or `causal_conv1d_step_ref` on the first
    C columns for `conv` (its state updated in place)."""
    y = torch.nn.functional.linear(x, w)
    if conv is not None:
        state, conv_w, conv_b = conv
        C = state.shape[1]
        y[:, :C] = causal_conv1d_step_ref(y[:, :C], state, conv_w, conv_b)
    return swiglu_ref(y) if gate_up else y


# Per (M, N, K, gate_up, dtype, device): the chosen implementation, "cublas" or a `_GEMV_CONFIGS` entry.
_small_linear_choice: dict = {}
_timing_failed: set = set()


# How the candidates are timed: as the captured step runs them. Each is captured in a CUDA graph that calls it on the
# weight and on copies of it in turn, twice over, and the graph is replayed: every call reads its weight from HBM
# (the copies together exceed the H200's 50 MB L2, as one decode step reads each weight once), each kernel starts as
# soon as the one before it ends, and a kernel launched with programmatic dependent launch overlaps its start with the
# one before, as in the step. Two lone timings missed this and picked cuBLAS where the GEMV is faster in the step:
# timed eagerly, the GPU waited for Triton's slower host launch (0.8B gate|up: cuBLAS 11.1 us in the step against the
# GEMV's 5.8 in a graph); timed alone behind a GPU sleep with L2 flushed (H200, 2026-11-30, PERFORMANCE.md), the
# choice flipped between processes on the 4B out and down projections, which the GEMV reads in 7.7 / 14.1 us in a
# graph against cuBLAS's 9.8 / 16.1, and the runs that gave them to cuBLAS decoded 4B 0.1-0.25 ms slower.
# The copies are a transient of at most this many bytes (3% of the smallest model's, 0.8B's, peak memory), held
# only while the first decode step times its shapes.
_TIMING_COPY_BYTES = 64 << 20
_TIMING_REPLAYS = 5


def _timing_weights(w: torch.Tensor) -> list[torch.Tensor]:
    """`w` and enough copies of it that the set exceeds `_TIMING_COPY_BYTES` (at most that many bytes of copies)."""
    return [w] + [w.clone() for _ in range(min(_TIMING_COPY_BYTES // max(w.nbytes, 1), 31))]


_timing_streams: dict = {}


def _timing_stream(device: int) -> "torch.cuda.Stream":
    """One capture stream per device for `_time_in_graph_ms` (each new stream would get its own cuBLAS workspace)."""
    if device not in _timing_streams:
        _timing_streams[device] = torch.cuda.Stream(device)
    return _timing_streams[device]


def reset_rng_after_failed_capture() -> None:
    """Give the current device's default CUDA generator a fresh state (same seed, same offset) after a failed graph
    capture.

    torch's `CUDAGraph.capture_end` raises on an invalidated capture before it takes the generators it registered
    out of capture mode, and every later random op on the device then fails ("Offset increment outside graph
    capture encountered unexpectedly"): `generate`'s sampling included. A cloned state is not in capture mode.
    Graphs captured before keep the old state and advance it on replay, not the new one (the graphs of this repo
    draw no random numbers)."""
    gen = torch.cuda.default_generators[torch.cuda.current_device()]
    gen.graphsafe_set_state(gen.clone_state())


def capture_error(err: BaseException) -> BaseException:
    """The error that failed a graph capture. Leaving `torch.cuda.graph` after an error in its body calls
    `capture_end`, which raises its own "operation failed due to a previous error during capture" over the first
    error: that one is in the chain's `__context__`."""
    seen = {id(err)}
    while err.__context__ is not None and id(err.__context__) not in seen:
        err = err.__context__
        seen.add(id(err))
    return err


def _time_in_graph_ms(call, weights: list[torch.Tensor], passes: int = 2) -> float:
    """Median ms per call of `call(w)`, run over `weights` `passes` times inside one CUDA graph, over
    `_TIMING_REPLAYS` replays (host syncs and a capture: used outside capture only). The first call of each weight
    runs eagerly, outside the capture (compiles, autotunes; an error there propagates)."""
    side = _timing_stream(torch.cuda.current_device())
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):  # torch.cuda.graph would also empty the allocator's cache, once per candidate
        for w in weights:  # eager on the capture stream: cuBLAS's workspace for it is allocated here, not captured
            call(w)
        graph.capture_begin()
        try:
            for _ in range(passes):
                for w in weights:
                    call(w)
        except Exception:  # end the capture without letting its "previous error during capture" hide this one
            with contextlib.suppress(Exception):
                graph.capture_end()
            reset_rng_after_failed_capture()
            raise
        try:
            graph.capture_end()
        except Exception:
            reset_rng_after_failed_capture()
            raise
    torch.cuda.current_stream().wait_stream(side)
    graph.replay()
    times = []
    for _ in range(_TIMING_REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / (passes * len(weights)))
    del graph
    return sorted(times)[len(times) // 2]


def _run_small_linear(x, w, gate_up, choice, conv=None):
    if choice == "cublas":
        y = torch.nn.functional.linear(x, w)
        if conv is not None:  # the conv step in place on the first C columns: one more launch
            C = conv[0].shape[1]
            causal_conv1d_step(y[:, :C], *conv, out=y[:, :C])
        return swiglu(y) if gate_up else y
    return gemv(x, w, gate_up, choice, conv)


def small_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    gate_up: bool = False,
    conv: ConvStep | None = None,
) -> torch.Tensor:
    """The decode step's linear: `x @ w.T` ([M, K] x [N, K]), or with `gate_up` the SwiGLU of the packed gate|up
    projection, or with `conv` (`gemv`'s argument) the DeltaNet conv step on its first C columns, by cuBLAS
    (`F.linear`, then `swiglu` / `causal_conv1d_step`) or by `gemv` (one launch), whichever runs faster on this card
    for this shape. The choice is timed once per shape, at its first call outside CUDA-graph capture (the decode
    step's eager warm-up), as the captured step runs it: each candidate in a CUDA graph over the weight and copies of
    it, weights cold in L2 (`_time_in_graph_ms`; with the conv on a copy of its state, so cuBLAS's extra conv launch
    is timed too), and kept for the process; a shape first met inside a capture, more than 16 rows, or a weight
    `gemv` does not take, uses cuBLAS. One decision point."""
    key = (x.shape[0], w.shape[0], w.shape[1], gate_up, x.dtype, x.device)
    choice = _small_linear_choice.get(key)
    if choice is None:
        choice = "cublas"
        eligible = HAS_TRITON and x.is_cuda and x.shape[0] <= _GEMV_MAX_M and w.is_contiguous() and w.dtype == x.dtype
        if eligible and not torch.cuda.is_current_stream_capturing():
            with torch.cuda.device(x.device):  # the events must time x's device (device_map puts layers elsewhere)
                weights = _timing_weights(w)
                # with the conv, as it will run (cuBLAS then pays the conv step's launch), on a copy of its state
                scratch = (conv[0].clone(), *conv[1:]) if conv is not None else None
                timings = {}
                for cand in ("cublas", *_GEMV_CONFIGS):
                    try:
                        timings[cand] = _time_in_graph_ms(
                            lambda w_, cand=cand: _run_small_linear(x, w_, gate_up, cand, scratch), weights)
                    except Exception as err:  # noqa: BLE001 - a candidate that fails here is not chosen, said once
                        if cand not in _timing_failed:
                            _timing_failed.add(cand)
                            logging.getLogger(__name__).warning(
                                "Qwen3.5 fused kernels: timing the decode linear candidate %s failed here (%s: %s); "
                                "the decode step uses %s.", cand, type(err).__name__, err,
                                "cuBLAS" if cand == "cublas" else "the other candidates")
                del weights, scratch
            # cuBLAS is the reference point: if it could not be timed (a capture that fails here), nothing is compared
            choice = min(timings, key=timings.get) if "cublas" in timings else "cublas"
        _small_linear_choice[key] = choice
    return _run_small_linear(x, w, gate_up, choice, conv)


def small_linear_choices() -> dict:
    """A copy of the choices `small_linear` has made in this process: (M, N, K, gate_up, dtype, device) -> "cublas"
    or the `gemv` config."""
    return dict(_small_linear_choice)


def small_linear_ref(
    x: torch.Tensor,
    w: torch.Tensor,
    gate_up: bool = False,
    conv: ConvStep | None = None,
) -> torch.Tensor:
    """Plain-torch `small_linear`."""
    return gemv_ref(x, w, gate_up, conv)


# ---------------------------------------------------------------------------------------------------------------------
# 8. Gated DeltaNet prefill, input side: causal conv + SiLU of q|k|v, the q / k L2 norm, beta and the gate input
#
# Why our own kernel: through fla, this stage is eight launches per layer: fla's conv once per q / k / v slice,
# `chunk_gated_delta_rule`'s L2 norm of q and of k, its beta sigmoid, and its input guard's copies of the strided
# b / a columns of the packed projection. Nothing maintained fuses them. This one launch reads those columns once
# and writes what `chunk_gated_delta_rule` reads, ready: contiguous, normalised q and k, v, beta in fp32 and a.
# ---------------------------------------------------------------------------------------------------------------------

# Tokens per program. Not measured on an H200 yet; the reasoning: a [64, 128] tile of one head is 8K fp32 values
# (32 per thread at 8 warps) and gives the 4B shape at T=2048 2,080 programs; the W-1 tokens of halo each tile
# re-reads are 5% of its loads.
_PREP_BLOCK_T = 64

if HAS_TRITON:

    @triton.jit
    def _deltanet_prep_kernel(
        x_ptr, w_ptr, bias_ptr, b_ptr, a_ptr, y_ptr, beta_ptr, g_ptr,
        T, stride_xb, stride_xt, stride_w, stride_bb, stride_bt, stride_ab, stride_at, eps,
        HK: tl.constexpr, DK: tl.constexpr, HV: tl.constexpr, DV: tl.constexpr, W: tl.constexpr,
        HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HV: tl.constexpr,
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
        else:  # the last program of each token block: beta = sigmoid(b) in fp32, and a copied out contiguous
            # (names differ from the other branch's: Triton wants one type per name across the two branches)
            o_v = tl.arange(0, BLOCK_HV)
            m_v = m_t[:, None] & (o_v < HV)[None, :]
            b_b = tl.load(b_ptr + i_b * stride_bb + o_t[:, None] * stride_bt + o_v[None, :], mask=m_v, other=0.0)
            b_a = tl.load(a_ptr + i_b * stride_ab + o_t[:, None] * stride_at + o_v[None, :], mask=m_v, other=0.0)
            o_bt = (i_b * T + o_t)[:, None] * HV + o_v[None, :]
            tl.store(beta_ptr + o_bt, tl.sigmoid(b_b.to(tl.float32)), mask=m_v)
            tl.store(g_ptr + o_bt, b_a, mask=m_v)


def deltanet_prep(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    b: torch.Tensor,
    a: torch.Tensor,
    num_k_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    eps: float = _GDR_L2_EPS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gated DeltaNet prefill inputs in one launch: causal depthwise conv + SiLU over q|k|v (no initial state), the
    L2 norm of each q and k head, `beta = sigmoid(b)`, and `a` copied out contiguous.

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
        num_k_heads, head_k_dim, head_v_dim: the layer's head layout (HV is b.shape[-1]).
        eps: the L2 norm's epsilon (stock and fla: 1e-6).

    Returns:
        `(q, k, v, beta, g)`: q, k [B, T, num_k_heads, head_k_dim] and v [B, T, HV, head_v_dim], contiguous, in
        x.dtype (q and k normalised); beta [B, T, HV] float32; g [B, T, HV] a's values, contiguous, in a.dtype.
        They are `chunk_gated_delta_rule`'s inputs with `use_qk_l2norm_in_kernel=False`,
        `use_beta_sigmoid_in_kernel=False`, `use_gate_in_kernel=True`.

    Replaces, in `Qwen3_5GatedDeltaNet.forward` without a cached state, `F.silu(self.conv1d(mixed_qkv)[..., :T])`,
    the split into q, k, v, `beta = b.sigmoid()` and the q / k `l2norm` of the chunked rule.
    """
    _check_triton("deltanet_prep")
    for name, t in (("x", x), ("weight", weight), ("b", b), ("a", a)):
        _check_float(name, t)
        _check_last_dim_contiguous(name, t)
    if x.dim() != 3 or b.dim() != 3 or a.shape != b.shape or b.shape[:2] != x.shape[:2]:
        raise ValueError(f"x must be [B, T, C] and b, a [B, T, HV] with the same B, T; got x {tuple(x.shape)}, "
                         f"b {tuple(b.shape)}, a {tuple(a.shape)}.")
    B, T, C = x.shape
    HV = b.shape[2]
    key_dim, value_dim = num_k_heads * head_k_dim, HV * head_v_dim
    if min(num_k_heads, head_k_dim, head_v_dim, HV) < 1 or C != 2 * key_dim + value_dim:
        raise ValueError(f"x has C={C} channels, but num_k_heads={num_k_heads}, head_k_dim={head_k_dim}, HV={HV}, "
                         f"head_v_dim={head_v_dim} need 2 * {key_dim} + {value_dim}.")
    if weight.dim() != 2 or weight.shape[0] != C or weight.shape[1] < 1:
        raise ValueError(f"weight must be [C, W] = [{C}, W] for x {tuple(x.shape)}, got {tuple(weight.shape)}.")
    tensors = dict(x=x, weight=weight, b=b, a=a)
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
    g = torch.empty(B, T, HV, dtype=a.dtype, device=x.device)
    if B > 0 and T > 0:
        BLOCK_T = min(_PREP_BLOCK_T, max(16, triton.next_power_of_2(T)))
        BLOCK_D = triton.next_power_of_2(max(head_k_dim, head_v_dim))
        with _device_guard(x):
            _deltanet_prep_kernel[(triton.cdiv(T, BLOCK_T), B, 2 * num_k_heads + HV + 1)](
                x, weight, bias if bias is not None else weight, b, a, y, beta, g,
                T, x.stride(0), x.stride(1), weight.stride(0), b.stride(0), b.stride(1), a.stride(0), a.stride(1),
                eps,
                HK=num_k_heads, DK=head_k_dim, HV=HV, DV=head_v_dim, W=weight.shape[1], HAS_BIAS=bias is not None,
                BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D, BLOCK_HV=triton.next_power_of_2(HV),
                num_warps=min(8, _num_warps(BLOCK_T * BLOCK_D)),
            )
    return q, k, v, beta, g


def deltanet_prep_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    b: torch.Tensor,
    a: torch.Tensor,
    num_k_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    eps: float = _GDR_L2_EPS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain-torch `deltanet_prep`: stock's conv1d + SiLU, then fla's L2 norm (fp32) and beta sigmoid (fp32)."""
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
    return l2(q), l2(k), v, b.float().sigmoid(), a.contiguous()


# ---------------------------------------------------------------------------------------------------------------------
# 9. Gated RMSNorm of the Gated DeltaNet output, the gate read in place
#
# Why our own kernel: fla's `rms_norm_gated` needs the gate as [rows, V] with one row stride, but z is a column
# slice of the packed projection ([B, T, HV * V], row stride = the projection's width), so every call copied it first;
# fla also writes a per-row rstd for its backward. This kernel reads z where it is and writes only y.
# ---------------------------------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit
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
        BLOCK_M = _units_per_program(n_rows, BLOCK_D, cap=triton.next_power_of_2(n_rows))
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


# ---------------------------------------------------------------------------------------------------------------------
# 10. Gated DeltaNet prefill, the rule itself: fla's kernels, chosen for precision
#
# No kernel of ours. fla's chunked kernel computes its fp32 dots in TF32 (its triangular solve asks for TF32
# explicitly; its other dots take Triton's fp32 default, which is TF32 too). Measured on an H200 (2026-11-30, 4-layer
# random model, 16:16 heads, T=129, fp32): stock transformers with fla is 8.7e-4 (relative logit error) from stock's
# own torch rule, and so is the fused path through the chunked kernel; through fla's per-token kernel (no dots, IEEE
# fp32) the fused path is 6.8e-7 from stock's torch rule. torch's fp32 matmuls are IEEE unless the user allows TF32
# (`torch.set_float32_matmul_precision`), so fp32 follows that switch here too.
# ---------------------------------------------------------------------------------------------------------------------


def prefill_rule_kernel(dtype: torch.dtype) -> str:
    """Which fla kernel runs a prompt's gated delta rule for activations of `dtype`: "fused_recurrent" for fp32
    while torch's fp32 matmul precision is "highest" (its default: no TF32), else "chunk". One decision point, read
    at every eager forward; a forward already captured in a CUDA graph keeps the kernel it was captured with."""
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return "fused_recurrent"
    return "chunk"


def gated_delta_rule_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule over a prompt from a zero state, gate `-exp(A_log) * softplus(a + dt_bias)` computed in
    the kernel, by fla (`prefill_rule_kernel` picks the chunked or the per-token kernel).

    Args:
        q, k: [B, T, H, K], already L2-normalised (`deltanet_prep`); v: [B, T, HV, V], HV a multiple of H (grouped
            value heads, as stock's `repeat_interleave`); one dtype.
        a: [B, T, HV] the raw gate input; beta: [B, T, HV] float32, already `sigmoid(b)`.
        A_log, dt_bias: [HV].

    Returns:
        o [B, T, HV, V] in q's dtype, and the final state [B, HV, K, V] float32 (None unless `output_final_state`).
    """
    kernel = prefill_rule_kernel(q.dtype)
    if kernel == "chunk":
        return fla_chunk_gated_delta_rule(
            q, k, v, g=a, beta=beta, output_final_state=output_final_state, use_qk_l2norm_in_kernel=False,
            use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=False, A_log=A_log, dt_bias=dt_bias,
        )
    return fla_fused_recurrent_gated_delta_rule(
        q, k, v, g=a, beta=beta, output_final_state=output_final_state, use_qk_l2norm_in_kernel=False,
        use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
    )


def gated_delta_rule_prefill_ref(q, k, v, a, beta, A_log, dt_bias, output_final_state=False):
    """Plain-torch `gated_delta_rule_prefill`: stock's torch chunked rule on key heads repeated for their value heads
    (what stock runs without fla). fp32 math inside; o in q's dtype, as fla returns it."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as stock  # lazy: only the references need transformers

    gate = -A_log.float().exp() * torch.nn.functional.softplus(a.float() + dt_bias.float())
    group = v.shape[2] // q.shape[2]
    q, k = q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)
    rule = inspect.unwrap(stock.torch_chunk_gated_delta_rule)
    o, state = rule(q, k, v, g=gate, beta=beta, initial_state=None, output_final_state=output_final_state,
                    use_qk_l2norm_in_kernel=False)
    return o.to(q.dtype), state


# ---------------------------------------------------------------------------------------------------------------------
# 11. Decode attention: one query token per row over the preallocated K/V cache, GQA, padding mask, output gate
#
# Why our own kernel: through SDPA with a boolean mask, the decode step's attention ran cuDNN's prefill flash kernel
# (64 x 128 query tiles for one query row) at 16.8 us per layer for a 256-key cache (H200, 2026-11-30; the 4B
# layer reads 1 MB of K/V, 0.25 us of bandwidth), then the gate as a second launch. Here the keys are split across
# programs (flash-decoding), each program serving all query heads of one KV head with two tensor-core dots per block
# of keys, and a second launch merges the splits and applies `o * sigmoid(gate)`. Keys after `slot` (the newest
# key) are not read, so a long preallocated cache costs only the keys written so far.
# ---------------------------------------------------------------------------------------------------------------------

_DA_BLOCK_L = 32  # keys per iteration (tl.dot needs >= 16)
_DA_MIN_SPLIT = 64  # keys per program, at least; more for long caches so that the merge reads at most _DA_MAX_SPLITS
_DA_MAX_SPLITS = 32
# The running max of a split that has seen no valid key is -1e30 (written inline in the kernels), not -inf: finite,
# so its weight exp(-1e30 - m) in the merge is 0 rather than NaN.

if HAS_TRITON:

    @triton.jit
    def _decode_attention_split_kernel(
        q_ptr, k_ptr, v_ptr, valid_ptr, slot_ptr, m_ptr, l_ptr, acc_ptr,
        stride_q_b, stride_q_h, stride_k_b, stride_k_h, stride_k_l, stride_v_b, stride_v_h, stride_v_l,
        stride_valid_b, L, S, scale,
        H: tl.constexpr, KV: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
        SPLIT: tl.constexpr, BLOCK_L: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
        PDL: tl.constexpr,
    ):
        _pdl_wait(PDL)  # before any load: an earlier kernel writes this one's inputs
        # program (row b, KV head, split s): query heads [kv * G, (kv + 1) * G) against keys [s * SPLIT, ...)
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
        start = i_s * SPLIT
        end = tl.minimum(start + SPLIT, n_keys)
        b_m = tl.full([BLOCK_G], -1.0e30, tl.float32)
        b_l = tl.zeros([BLOCK_G], tl.float32)
        b_acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        p_k = k_ptr + i_b.to(tl.int64) * stride_k_b + i_kv * stride_k_h
        p_v = v_ptr + i_b.to(tl.int64) * stride_v_b + i_kv * stride_v_h
        for l0 in range(start, end, BLOCK_L):
            o_l = l0 + tl.arange(0, BLOCK_L)
            m_l = o_l < end
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

    @triton.jit
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
        b_o = tl.sum(b_acc * b_w[:, None], axis=0) / tl.sum(b_w * b_l, axis=0)  # [BD]
        dt = y_ptr.dtype.element_ty
        b_o = _round_to(b_o, dt)
        b_g = tl.load(gate_ptr + i_b * stride_gate_b + i_h * D + o_d, mask=m_d, other=0.0).to(tl.float32)
        b_sg = _round_to(1.0 / (1.0 + tl.exp(-b_g)), dt)  # as sigmoid_gate_mul: sigmoid rounded, then the product
        tl.store(y_ptr + i_b * (H * D) + i_h * D + o_d, _round_to(b_o * b_sg, dt).to(dt), mask=m_d)


def _decode_attention_split(L: int) -> int:
    """Keys per split program for a cache of L keys: _DA_MIN_SPLIT, doubled until at most _DA_MAX_SPLITS splits."""
    split = _DA_MIN_SPLIT
    while triton.cdiv(L, split) > _DA_MAX_SPLITS:
        split *= 2
    return split


def decode_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor,
    slot: torch.Tensor,
    gate: torch.Tensor,
    scale: float,
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

    Returns:
        y [B, H * D] in q's dtype: the attention output rounded to the dtype (as SDPA returns it), times
        `sigmoid(gate)` rounded, rounded (as `sigmoid_gate_mul`).

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
    _check_same_device(q=q, keys=keys, values=values, valid=valid, slot=slot, gate=gate)

    y = torch.empty(B, H * D, dtype=q.dtype, device=q.device)
    if B == 0 or L == 0:
        return y
    split = _decode_attention_split(L)
    S = triton.cdiv(L, split)
    m = torch.empty(B, H, S, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    acc = torch.empty(B, H, S, D, dtype=torch.float32, device=q.device)
    BLOCK_D = triton.next_power_of_2(D)
    with _device_guard(q):
        pdl = pdl_enabled(q.device)
        _decode_attention_split_kernel[(B * KV, S)](
            q, keys, values, valid, slot, m, l, acc,
            q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), keys.stride(2),
            values.stride(0), values.stride(1), values.stride(2), valid.stride(0), L, S, float(scale),
            H=H, KV=KV, D=D, BLOCK_G=max(16, triton.next_power_of_2(H // KV)), BLOCK_D=BLOCK_D, SPLIT=split,
            BLOCK_L=_DA_BLOCK_L, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            UPCAST=q.device.type == "cpu", num_warps=4, PDL=pdl, **_pdl_launch(pdl),
        )
        _decode_attention_merge_kernel[(B * H,)](
            m, l, acc, gate, y, S, gate.stride(0),
            H=H, D=D, BLOCK_S=max(2, triton.next_power_of_2(S)), BLOCK_D=BLOCK_D,
            num_warps=_num_warps(max(2, triton.next_power_of_2(S)) * BLOCK_D), PDL=pdl, **_pdl_launch(pdl),
        )
    return y


def decode_attention_ref(q, keys, values, valid, slot, gate, scale):
    """Plain-torch `decode_attention`: SDPA with the padding mask (and nothing after `slot`), then stock's gate."""
    B, H, D = q.shape
    KV, L = keys.shape[1], keys.shape[2]
    mask = valid & (torch.arange(L, device=valid.device) <= slot.to(valid.device))[None, :]  # [B, L]
    o = torch.nn.functional.scaled_dot_product_attention(
        q.reshape(B, KV, H // KV, D), keys, values, attn_mask=mask[:, None, None, :], scale=scale
    )  # [B, KV, G, D]
    return sigmoid_gate_mul_ref(o.reshape(B, 1, H, D), gate.view(B, 1, H * D)).view(B, H * D)


# ---------------------------------------------------------------------------------------------------------------------
# 12. The decode step's rotary cos / sin: stock's interleaved mRoPE for one token per row, positions moved on in place
#
# Why our own kernel: stock's rotary module takes 14 launches a token (slices and concatenations recomposing the
# t / h / w rows), and its plain-torch rewrite (`mrope_step_ref`) still 7 plus the positions' increment, each a
# launch gap on the step's critical path. One program per row gathers each dimension's position and frequency,
# takes the same float32 angle through the same cos / sin, and moves the positions on after it has read them.
# ---------------------------------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit
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
