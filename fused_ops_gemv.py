# Copyright 2026 The Qwen3.5 fused-kernels authors. Licensed under the Apache License, Version 2.0.
"""The decode step's linears (1-32 rows) and the per-shape choice between our kernels and cuBLAS.

- `gemv`: `x @ w.T` as one weight read on the CUDA cores (1-16 rows), optionally with the SwiGLU of the packed
  gate|up projection or the DeltaNet conv step (`causal_conv1d_step` on the first columns, state in place) in its
  epilogue; replaces stock's `nn.Linear` (and the `act_fn(gate) * up` / `causal_conv1d_update` launch after it) at
  decode.
- `skinny_gemm`: the same product on tensor cores for 2-32 rows (16-bit), optionally with the SwiGLU epilogue.
- `small_linear`: picks cuBLAS, a `gemv` config (one row) or a `skinny_gemm` config (2-32 rows) per shape by timing
  them once in a CUDA graph, and records the pick per card beside Triton's cache for later processes
  (`RECORD_CHOICES`), or takes the pick shipped for the card (`fused_tuning`); `small_linear_choices` reports the
  picks, `gemv_late_signal_min_elems` the PDL late-signal threshold (`_GEMV_LATE_TRIGGER_ELEMS`, read here: patch it
  on this module).

Each op: kernel -> wrapper (validates; ValueError names the values) -> torch `name_ref` below it (dtypes: runtime).
"""

import contextlib
import functools
import hashlib
import json
import logging
import os
import threading
from pathlib import Path
from typing import NamedTuple

import torch

from .fused_ops_deltanet import causal_conv1d_step, causal_conv1d_step_ref
from .fused_ops_norm import swiglu, swiglu_ref
from .fused_ops_runtime import (
    HAS_TRITON,
    _check_float,
    _check_last_dim_contiguous,
    _check_same_device,
    _check_triton,
    _device_guard,
    _dot_in_f32,
    _dot_precision,
    _pdl_launch,
    compile_in_parallel,
    pdl_enabled,
    reset_rng_after_failed_capture,
    tl,
    triton,
    triton_cache_dir,
)
from .fused_tuning import shipped_choices

if HAS_TRITON:  # the shared `@triton.jit` helpers exist only with triton
    from .fused_ops_deltanet import _conv_step_tile
    from .fused_ops_runtime import _round_to


# ---------------------------------------------------------------------------------------------------------------------
# Decode-batch linear (GEMV, M <= 16 rows), optionally with the SwiGLU epilogue, and the per-shape choice between
# it and cuBLAS
#
# Why a kernel of our own: a decode step reads every weight once for 1-16 rows, so a linear is a pure weight read.
# On the H200 (2026-11-30 profile, 4B, batch 1) cuBLAS's small-M kernels read the large matrices at ~84% of the copy
# rate and the small ones far below it, with a split-K reduce kernel after a third of them; together 1.24x the
# weight-read floor. Nothing maintained fuses the SwiGLU of the gate|up projection into a GEMV either. Whether this
# kernel beats cuBLAS is decided on the card, per shape: `small_linear` times both at the step's first (eager) call
# and keeps the faster, so it cannot make a shape slower than cuBLAS.
# ---------------------------------------------------------------------------------------------------------------------

# `GemvConfig`s tried per shape (`_GEMV_CONFIGS` below). In the sweeps (H200, weights cold in L2) few
# rows and long rows (2 x 1024-2048) win the matrices with few outputs (o_proj, out_proj, down_proj), 1-8 x 256-512
# the tall ones (gate|up, in_proj, the LM head). At 8 rows cuBLAS won every shape.
#
# The fourth field: True sums each weight tile across threads as it goes, False adds the tiles elementwise into a
# [rows, BLOCK_N, BLOCK_K] accumulator summed once after the loop, where that accumulator takes at most
# `_GEMV_ACC_REGS` registers a thread (every shipped config at one row; with more rows, the small tiles only).
# At one row the accumulator read the out / down projections 11-15% faster, the per-tile sum the LM heads and the
# 4B gate|up 2-3% faster (H200, 2026-12-01).
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


# Each the fastest for some decode shape in `scripts/benchmark_gemv.py`'s sweep (H200, 2026-12-01):
# the unrolled ones at one row for the 4B / 0.8B DeltaNet input, gate|up, attention input and 0.8B down projections,
# the per-tile sum for the LM heads; the first six also cover 9B's shapes, which that sweep did not time.
_GEMV_CONFIGS = tuple(GemvConfig(*c) for c in (
    (8, 512, 4, False), (2, 1024, 4, False), (2, 2048, 8, False), (4, 512, 4, False), (8, 256, 4, False),
    (1, 2048, 4, False), (4, 1024, 4, True), (8, 256, 4, True), (4, 512, 4, False, 2), (4, 512, 4, False, 4),
    (1, 512, 4, False, 2), (8, 256, 4, False, 2), (4, 2048, 8, False), (2, 2048, 8, False, 2),
))
_GEMV_MAX_M = 16
# `small_linear` times the GEMV against cuBLAS up to this many rows (`skinny_gemm` past it). cuBLAS
# won every 4B decode shape at 2 and at 4 rows (all six linears, full sweep in the decode step, H200, 2026-12-02)
# and every decode shape at 8 rows (the best GEMV 1.1x-3x slower; docs/DESIGN.md), while timing a new row count
# compiled the 14 configs of each kind of linear first: 9-28 s of the first call at batch 2-4 at 4B, for a choice
# that came out cuBLAS. One row is where the GEMV wins (5 or 6 of the 6 4B shapes); more rows go to tensor cores.
_GEMV_TIMED_MAX_M = 1
# With PDL a GEMV of at least this many weight elements lets the next kernel launch only after its K loop, not at its
# start. Launched at the start, the next kernel's programs (and, through its own early signal, the GEMV after it) take
# SM slots while this GEMV still has waves to run, and sit in their wait holding them. In-process A/B (H200,
# 2026-12-01): at 4B batch 1 the late signal on every GEMV read -0.022 and -0.088 ms a token on two
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
            p_s = s_ptr + o_m.to(tl.int64)[:, None, None] * stride_s_b + o_n.to(tl.int64)[None, :, None] * stride_s_d
            b_c = _conv_step_tile(b_y[:, :, None], p_s, m_mc[:, :, None], stride_s_w, cw_ptr + o_n[:, None] * stride_cw,
                                  m_c[:, None], cb_ptr + o_n, m_c, CONV_W, CONV_BIAS, BLOCK_W)  # [BM, BN]
            b_y = tl.where(m_c[None, :], _round_to(b_c, dt), b_y)
        p_y = y_ptr + o_m[:, None] * stride_ym + o_n[None, :]
        tl.store(p_y, b_y.to(dt), mask=(o_m < M)[:, None] & m_n[None, :])


def _check_linear(op: str, x: torch.Tensor, w: torch.Tensor, gate_up: bool, max_m: int) -> None:
    """`gemv`'s / `skinny_gemm`'s shared checks: x [M, K] with 1 <= M <= max_m and a contiguous last dim, w [N, K]
    contiguous in x's dtype on x's device, an even N with `gate_up`; a ValueError names the value."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"{op} needs x [M, K] and w [N, K], got {tuple(x.shape)} and {tuple(w.shape)}.")
    if not 1 <= x.shape[0] <= max_m:
        raise ValueError(f"{op} takes 1 to {max_m} rows, got M={x.shape[0]}.")
    if w.dtype != x.dtype or not w.is_contiguous():
        raise ValueError(f"{op} needs a contiguous weight in x's dtype ({x.dtype}), got {w.dtype}, "
                         f"contiguous={w.is_contiguous()}.")
    if gate_up and w.shape[0] % 2:
        raise ValueError(f"{op} with gate_up needs an even number of weight rows (gate | up), got {w.shape[0]}.")
    _check_same_device(x=x, w=w)
    _check_last_dim_contiguous("x", x)


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
    _check_linear("gemv", x, w, gate_up, _GEMV_MAX_M)
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
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    with _device_guard(x):
        _gemv_launch(x, w, y, gate_up, cfg, conv)
    return y


def _gemv_launch(x, w, y, gate_up: bool, cfg: GemvConfig, conv: ConvStep | None, warmup: bool = False):
    """Launch `_gemv_kernel` for `gemv`'s (validated) arguments; with `warmup`, only compile it (Triton's warm-up
    launch: nothing runs). The current device must be x's."""
    (M, K), N = x.shape, y.shape[1]
    state, conv_w, conv_b = conv if conv is not None else (w, w, None)
    C, W = state.shape[1:] if conv is not None else (0, 1)
    BLOCK_K = min(cfg.block_k, triton.next_power_of_2(K))
    BLOCK_M = triton.next_power_of_2(M)
    pdl = pdl_enabled(x.device)
    grid = (triton.cdiv(N, cfg.block_n),)
    launch = functools.partial(_gemv_kernel.warmup, grid=grid) if warmup else _gemv_kernel[grid]
    return launch(
        x, w, y, state, conv_w, conv_b if conv_b is not None else conv_w, M, N, K, C, x.stride(0), y.stride(0),
        *(state.stride() if conv is not None else (0, 0, 0)), conv_w.stride(0),
        SWIGLU=gate_up, CONV=conv is not None, CONV_W=W, CONV_BIAS=conv_b is not None,
        BLOCK_M=BLOCK_M, BLOCK_N=cfg.block_n, BLOCK_K=BLOCK_K, BLOCK_W=triton.next_power_of_2(W),
        ROW_ACC=_gemv_row_acc(cfg, BLOCK_M, BLOCK_K, gate_up), UNROLL=cfg.unroll, num_warps=cfg.warps,
        PDL=pdl, LATE_TRIGGER=_gemv_late_trigger(w, pdl),
        **_pdl_launch(pdl),
    )


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


# ---------------------------------------------------------------------------------------------------------------------
# Decode-batch linear on tensor cores (2-32 rows)
#
# Why a second kernel: `gemv` multiplies on the CUDA cores, so its arithmetic grows with the rows while the weight read
# does not; at 8 rows it lost to cuBLAS at every decode shape (1.1x-3x, H200). cuBLAS's small-M kernels in turn leave
# the 4B batch-8 step at 1.71x the weight-read floor (docs/BENCHMARKS.md). Here each program streams a [BLOCK_N, K]
# strip of the weight through a software pipeline (`num_stages` tiles in flight) and multiplies it against all rows of
# x at once with `tl.dot` (rows padded to BLOCK_M = 16 or 32, the smallest tensor-core tile): the weight is read once
# for up to 32 rows, and the arithmetic stays off the CUDA cores. 16-bit weights only (fp32 stays on cuBLAS, whose
# fp32 GEMM does not round through TF32).
# ---------------------------------------------------------------------------------------------------------------------


class SkinnyConfig(NamedTuple):
    """One `skinny_gemm` launch configuration: output columns per program, K per weight tile, warps, pipeline
    stages (weight tiles in flight a program)."""

    block_n: int
    block_k: int
    warps: int
    stages: int


_SKINNY_MAX_M = 32
_SKINNY_M16_MAX_M = 16  # up to this many rows one BLOCK_M = 16 kernel; 17-32 rows take BLOCK_M = 32 (a compile apart)
# The configs `small_linear` times against cuBLAS, two a kind of linear (`_skinny_candidates`), from a sweep of 13 over
# the 0.8B / 4B / 9B decode linears at 2, 8, 16 and 32 rows (`scripts/benchmark_gemv.py --kernels skinny`, H200,
# 2026-12-02): (16, 256, 2, 4) was the fastest on the narrow matrices (out / down projections, 0.8B's inputs),
# (64, 128, 4, 4) on the tall ones (4B / 9B inputs, LM heads within 1% of the best), (128, 128, 8, 3) on the 4B / 9B
# gate|up and (32, 256, 4, 4) on 0.8B's. At 8 rows the best of them read 4B's linears in 0.90-1.04x cuBLAS's time
# (the LM head 291 us against 313), 0.8B's in 0.72-1.02x.
_SKINNY_CONFIGS = tuple(SkinnyConfig(*c) for c in ((16, 256, 2, 4), (64, 128, 4, 4), (32, 256, 4, 4), (128, 128, 8, 3)))


def _skinny_candidates(gate_up: bool) -> tuple[SkinnyConfig, ...]:
    """The `_SKINNY_CONFIGS` `small_linear` times for a kind of linear: two, so a first step at a new row count
    compiles four kernels, not eight."""
    return _SKINNY_CONFIGS[2:] if gate_up else _SKINNY_CONFIGS[:2]


if HAS_TRITON:

    @triton.jit(do_not_specialize=["M"])
    def _skinny_gemm_kernel(
        x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_ym,
        SWIGLU: tl.constexpr, EVEN_K: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        PDL: tl.constexpr, LATE_TRIGGER: tl.constexpr,
    ):
        o_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output columns of this program
        m_n = o_n < N
        o_m = tl.arange(0, BLOCK_M)
        m_m = o_m < M
        dt = y_ptr.dtype.element_ty
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if PDL and not LATE_TRIGGER:
            tl.extra.cuda.gdc_launch_dependents()
        if PDL:
            tl.extra.cuda.gdc_wait()  # x is written by the kernel before
        p_w0 = w_ptr + o_n.to(tl.int64)[:, None] * K
        p_x0 = x_ptr + o_m[:, None] * stride_xm
        for k0 in range(0, K, BLOCK_K):
            o_k = k0 + tl.arange(0, BLOCK_K)
            if EVEN_K:
                m_w = m_n[:, None]
                m_x = m_m[:, None]
            else:
                m_w = m_n[:, None] & (o_k < K)[None, :]
                m_x = m_m[:, None] & (o_k < K)[None, :]
            b_x = tl.load(p_x0 + o_k[None, :], mask=m_x, other=0.0)  # [BM, BK]
            b_w = tl.load(p_w0 + o_k[None, :], mask=m_w, other=0.0)  # [BN, BK]
            if DOT_F32:  # the interpreter (see `_dot_in_f32`)
                b_x, b_w = b_x.to(tl.float32), b_w.to(tl.float32)
            acc = tl.dot(b_x, tl.trans(b_w), acc, input_precision=PRECISION)
            if SWIGLU:  # the up rows sit N rows below the gate rows of the packed gate|up matrix
                b_wu = tl.load(p_w0 + N.to(tl.int64) * K + o_k[None, :], mask=m_w, other=0.0)
                if DOT_F32:
                    b_wu = b_wu.to(tl.float32)
                acc_u = tl.dot(b_x, tl.trans(b_wu), acc_u, input_precision=PRECISION)
        if LATE_TRIGGER:
            tl.extra.cuda.gdc_launch_dependents()
        b_y = _round_to(acc, dt)  # the linear's output, rounded once as cuBLAS rounds it
        if SWIGLU:  # stock: silu(gate) rounded, times up (rounded), rounded
            b_s = _round_to(b_y / (1.0 + tl.exp(-b_y)), dt)
            b_y = _round_to(b_s * _round_to(acc_u, dt), dt)
        p_y = y_ptr + o_m[:, None] * stride_ym + o_n[None, :]
        tl.store(p_y, b_y.to(dt), mask=m_m[:, None] & m_n[None, :])


def skinny_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    gate_up: bool = False,
    config: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """`x @ w.T` for a decode batch of rows on tensor cores, as one weight read; with `gate_up`,
    `silu(x @ g.T) * (x @ u.T)` for `w = [g; u]`. Replaces stock's `nn.Linear` (and the SwiGLU after the gate|up
    projection) at a decode step of 2-32 rows.

    Args:
        x: [M, K], 1 <= M <= 32, bfloat16 / float16, last dim contiguous (any row stride).
        w: [N, K] contiguous, x's dtype and device; with `gate_up`, [2*I, K] (gate rows, then up rows).
        config: a `SkinnyConfig` or a tuple of its fields (BLOCK_N, BLOCK_K, num_warps, num_stages); default the
            first of `_SKINNY_CONFIGS`.

    Returns:
        y [M, N] (or [M, I] with `gate_up`) contiguous, in x.dtype: fp32 accumulation, one rounding (then `swiglu`'s
        roundings), as `F.linear` (+ `swiglu`); the sum's order differs from cuBLAS's.
    """
    _check_triton("skinny_gemm")
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"skinny_gemm takes bfloat16 or float16 x, got {x.dtype}; use F.linear for float32.")
    _check_linear("skinny_gemm", x, w, gate_up, _SKINNY_MAX_M)
    cfg = SkinnyConfig(*(config or _SKINNY_CONFIGS[0]))
    y = torch.empty(x.shape[0], w.shape[0] // 2 if gate_up else w.shape[0], dtype=x.dtype, device=x.device)
    with _device_guard(x):
        _skinny_launch(x, w, y, gate_up, cfg)
    return y


def _skinny_launch(x, w, y, gate_up: bool, cfg: SkinnyConfig, warmup: bool = False):
    """Launch `_skinny_gemm_kernel` for `skinny_gemm`'s (validated) arguments; with `warmup`, only compile it. The
    current device must be x's."""
    (M, K), N = x.shape, y.shape[1]
    BLOCK_K = min(cfg.block_k, max(16, triton.next_power_of_2(K)))
    pdl = pdl_enabled(x.device)
    grid = (triton.cdiv(N, cfg.block_n),)
    launch = functools.partial(_skinny_gemm_kernel.warmup, grid=grid) if warmup else _skinny_gemm_kernel[grid]
    return launch(
        x, w, y, M, N, K, x.stride(0), y.stride(0),
        SWIGLU=gate_up, EVEN_K=K % BLOCK_K == 0, DOT_F32=_dot_in_f32(x),
        PRECISION=_dot_precision(x.dtype), BLOCK_M=16 if M <= _SKINNY_M16_MAX_M else 32, BLOCK_N=cfg.block_n,
        BLOCK_K=BLOCK_K, PDL=pdl, LATE_TRIGGER=_gemv_late_trigger(w, pdl), num_warps=cfg.warps,
        num_stages=cfg.stages, **_pdl_launch(pdl),
    )


def skinny_gemm_ref(x: torch.Tensor, w: torch.Tensor, gate_up: bool = False) -> torch.Tensor:
    """Plain-torch `skinny_gemm`: `F.linear`, then stock's SwiGLU for `gate_up`."""
    return gemv_ref(x, w, gate_up)


# Per (M, N, K, gate_up, dtype, device): the chosen implementation, "cublas", a `_GEMV_CONFIGS` or a `_SKINNY_CONFIGS`
# entry.
_small_linear_choice: dict = {}
_timing_failed: set = set()


# How the candidates are timed: as the captured step runs them. Each is captured in a CUDA graph that calls it on the
# weight and on copies of it in turn, twice over, and the graph is replayed: every call reads its weight from HBM
# (the copies together exceed the H200's 50 MB L2, as one decode step reads each weight once), each kernel starts as
# soon as the one before it ends, and a kernel launched with programmatic dependent launch overlaps its start with the
# one before, as in the step. Two lone timings missed this and picked cuBLAS where the GEMV is faster in the step:
# timed eagerly, the GPU waited for Triton's slower host launch (0.8B gate|up: cuBLAS 11.1 us in the step against the
# GEMV's 5.8 in a graph); timed alone behind a GPU sleep with L2 flushed (H200, 2026-11-30), the
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
    """One call of `small_linear`'s `choice`: `gemv` (the conv step in its epilogue), or cuBLAS / `skinny_gemm`
    (with `gate_up` and the SwiGLU), then the conv step in place on the first C columns (one more launch)."""
    if isinstance(choice, GemvConfig):
        return gemv(x, w, gate_up, choice, conv)
    if choice == "cublas":
        y = torch.nn.functional.linear(x, w)
        y = swiglu(y) if gate_up else y
    else:
        y = skinny_gemm(x, w, gate_up, choice)
    if conv is not None:
        C = conv[0].shape[1]
        causal_conv1d_step(y[:, :C], *conv, out=y[:, :C])
    return y


# The per-card record of the choices. Timing a new decode shape compiles and times every candidate (tens of seconds
# for a new batch size at 4B on the H200, most of it compiling), so each choice is also written to a JSON file beside
# Triton's own on-disk cache (`triton.knobs.cache.dir`, which TRITON_CACHE_DIR sets), one file per card, torch,
# triton, candidate list and PDL setting: a later process on the same card reads the choice and compiles only that
# kernel. Clearing Triton's cache clears the record with the kernels. The file is rewritten whole (temp file + rename)
# under a lock per process; two processes writing at once can drop each other's new entries, never corrupt the file.
_RECORD_VERSION = 2
RECORD_CHOICES = True  # False: neither read nor write the record (a benchmark that must time every shape)
_record_lock = threading.Lock()
_records: dict = {}  # path -> {key string: choice as JSON}, read once per process
_told_rows: set = set()  # (row tier, device) announced as being timed (`_row_tier`)
_shipped: dict = {}  # device -> the shipped choices for its card (`shipped_choice`), read once per process


def _record_path(device: torch.device) -> Path | None:
    """The record file for `device` in this environment, or None (no Triton cache directory)."""
    cache_dir = triton_cache_dir()
    if not cache_dir or not RECORD_CHOICES:
        return None
    props = torch.cuda.get_device_properties(device)
    env = (_RECORD_VERSION, props.name, props.major, props.minor, torch.__version__, triton.__version__,
           _GEMV_CONFIGS, _GEMV_ACC_REGS, _SKINNY_CONFIGS, pdl_enabled(device))
    tag = hashlib.sha256(repr(env).encode()).hexdigest()[:16]
    return Path(cache_dir) / "qwen3_5_fused" / f"small_linear_{tag}.json"


def _record_key(key: tuple) -> str:
    m, n, k, gate_up, dtype, _device = key
    return f"{m}x{n}x{k}{'-gate_up' if gate_up else ''}-{str(dtype).removeprefix('torch.')}"


def _load_record(path: Path) -> dict:
    """The record at `path` ({} if absent or unreadable: it is rewritten whole at the next choice)."""
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def recorded_choice(path: Path | None, key: tuple):
    """The choice recorded for `key` ("cublas", a `GemvConfig` or a `SkinnyConfig`), or None."""
    if path is None:
        return None
    with _record_lock:
        if path not in _records:
            _records[path] = _load_record(path)
        saved = _records[path].get(_record_key(key))
    return _parse_choice(saved)


def candidates_fingerprint() -> str:
    """A digest of the candidate lists: a shipped table timed over other candidates is not used."""
    return hashlib.sha256(repr((_GEMV_CONFIGS, _GEMV_ACC_REGS, _SKINNY_CONFIGS)).encode()).hexdigest()[:16]


def shipped_choice(key: tuple):
    """The choice shipped for `key` on this card (`fused_tuning.shipped_choices`: measured ahead of time by
    `scripts/record_tuning.py`), or None. Read when the card's own record has none; off with `RECORD_CHOICES`."""
    device = key[-1]
    if not RECORD_CHOICES:
        return None
    if device not in _shipped:
        _shipped[device] = shipped_choices(device, candidates_fingerprint(), pdl_enabled(device))
    return _parse_choice(_shipped[device].get(_record_key(key)))


def _parse_choice(saved):
    """A record's JSON value as a choice, or None (absent, or not a current candidate)."""
    if saved == "cublas":
        return saved
    if isinstance(saved, list) and saved[:1] == ["skinny"] and tuple(saved[1:]) in _SKINNY_CONFIGS:
        return SkinnyConfig(*saved[1:])
    if isinstance(saved, list) and tuple(saved) in _GEMV_CONFIGS:
        return GemvConfig(*saved)
    return None


def choice_json(choice):
    """A choice as the record stores it: "cublas", ["skinny", *config] or the `gemv` config as a list."""
    return choice if choice == "cublas" else ["skinny", *choice] if isinstance(choice, SkinnyConfig) else list(choice)


def record_choice(path: Path | None, key: tuple, choice) -> None:
    """Add `key -> choice` to the record at `path` (merged with what another process wrote since)."""
    if path is None:
        return
    with _record_lock:
        record = {**_records.get(path, {}), **_load_record(path)}
        record[_record_key(key)] = choice_json(choice)
        _records[path] = record
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(record, indent=1, sort_keys=True))
            os.replace(tmp, path)
        except OSError as err:  # a read-only cache: the choice still holds for this process
            logging.getLogger(__name__).info("Qwen3.5 fused kernels: could not record %s (%s).", path, err)


def _row_tier(rows: int) -> str:
    """The row counts that share `small_linear`'s compiled candidates: one row (the `gemv` configs), 2-16 and 17-32
    (`skinny_gemm` at BLOCK_M 16 / 32; the row count is a run-time value of the kernel)."""
    return "1" if rows <= _GEMV_TIMED_MAX_M else "2-16" if rows <= _SKINNY_M16_MAX_M else "17-32"


def _announce_timing(rows: int, device: torch.device, path: Path | None) -> None:
    """One log line the first time a decode shape of `rows`' tier (`_row_tier`) is timed on `device` in this
    process: that step compiles the tier's candidates."""
    tier = _row_tier(rows)
    if (tier, device) in _told_rows:
        return
    _told_rows.add((tier, device))
    where = f"; the choices are recorded in {path.parent} for later processes" if path is not None else ""
    how_long = "tens of seconds" if tier == "1" else "a few seconds"
    logging.getLogger(__name__).warning(
        "Qwen3.5 fused kernels: first decode step with %s row(s) on this card: compiling and timing its linear "
        "kernels once (this call can take %s%s).", tier, how_long, where)


def _candidates(x: torch.Tensor, gate_up: bool) -> tuple:
    """What `small_linear` times for x's row count: the `gemv` configs at one row, two `skinny_gemm` configs at
    2-32 rows of a 16-bit dtype (`_skinny_candidates`), nothing else (cuBLAS is always timed)."""
    rows = x.shape[0]
    if rows <= _GEMV_TIMED_MAX_M:
        return _GEMV_CONFIGS
    if rows <= _SKINNY_MAX_M and x.dtype in (torch.bfloat16, torch.float16):
        return _skinny_candidates(gate_up)
    return ()


def _ahead_of_more_rows(x, w, gate_up) -> list:
    """At one row, whether its choice is timed or read (record, shipped table), the warm-up launches of the
    `skinny_gemm` configs that 2-16 rows of this shape may run (`_more_rows_configs`; same specialisation as the
    step's: x's row stride, 16-bit dtype), so they compile with the one-row kernels in the first step's pool and a
    later first step at 2-16 rows compiles nothing. Why: compiled at that step instead, the candidates' four compiles
    (2.14 s summed on the H200, 4B, empty Triton cache, 2026-12-02) took the first batch-2 call to a 2.59 s stall,
    past the 2 s target; in the one-row pool they overlap compiles that run anyway."""
    if x.shape[0] > _GEMV_TIMED_MAX_M or x.dtype not in (torch.bfloat16, torch.float16):
        return []
    return _two_row_warmups(x, w, gate_up, _more_rows_configs(x, w, gate_up))


def _two_row_warmups(x, w, gate_up, configs) -> list:
    """Warm-up launches of `skinny_gemm` at each of `configs` for 2 rows of x's shape (x's row stride, so the same
    specialisation as the step's)."""
    K = x.shape[1]
    x2 = torch.empty_strided((2, K), (max(x.stride(0), K), 1), dtype=x.dtype, device=x.device)
    y2 = torch.empty(2, w.shape[0] // 2 if gate_up else w.shape[0], dtype=x.dtype, device=x.device)
    return [functools.partial(_skinny_launch, x2, w, y2, gate_up, cfg, True) for cfg in configs]


def _recorded_warmups(x, w, gate_up, conv, choice) -> list:
    """For a choice read from a record at one row: the warm-up launches of that kernel and `_ahead_of_more_rows`',
    compiled together on the pool; [] at more rows. On a warm Triton cache these are loads from disk."""
    if x.shape[0] > _GEMV_TIMED_MAX_M:
        return []
    warmups = []
    if isinstance(choice, GemvConfig):
        y = torch.empty(x.shape[0], w.shape[0] // 2 if gate_up else w.shape[0], dtype=x.dtype, device=x.device)
        warmups.append(functools.partial(_gemv_launch, x, w, y, gate_up, choice, conv, True))
    return warmups + _ahead_of_more_rows(x, w, gate_up)


def _more_rows_configs(x, w, gate_up) -> tuple:
    """The `skinny_gemm` configs that 2-16 rows of x's shape may run: those the card's record or the shipped table
    chose at any of these row counts, or both candidates where some count has no choice yet (it will be timed).

    Every count, not the 2-row choice alone: the choices differ by row count (9 of the 31 shapes shipped for the H200
    take a skinny config at some count in 3-16 that is not their 2-row choice: the LM heads, 4B's down), and the
    CUDA test of new shapes saw `_skinny_gemm_kernel` compile at a later batch size on a record its own earlier run
    had left. Not both candidates always: with the shipped table every count is known, so a cold machine compiles
    only the configs its batches can run (at 4B the three of the 2-row picks)."""
    path, tail = _record_path(x.device), _key_tail(x, w, gate_up)
    known = [recorded_choice(path, (m, *tail)) or shipped_choice((m, *tail))
             for m in range(_GEMV_TIMED_MAX_M + 1, _SKINNY_M16_MAX_M + 1)]
    if None in known:
        return _skinny_candidates(gate_up)
    return tuple(dict.fromkeys(c for c in known if isinstance(c, SkinnyConfig)))


def _key_tail(x, w, gate_up) -> tuple:
    """`small_linear`'s choice key without its row count."""
    return (w.shape[0], w.shape[1], gate_up, x.dtype, x.device)


def _time_candidates(x, w, gate_up, conv, candidates) -> dict:
    """ms per call of "cublas" and each of `candidates` for this shape, as the captured step runs them (see
    `_time_in_graph_ms`); a candidate that fails is left out, said once."""
    with torch.cuda.device(x.device):  # the events must time x's device (device_map puts layers elsewhere)
        weights = _timing_weights(w)
        # with the conv, as it will run (cuBLAS then pays the conv step's launch), on a copy of its state
        scratch = (conv[0].clone(), *conv[1:]) if conv is not None else None
        # every kernel candidate compiled at once (`compile_in_parallel`), then each timed on its compiled kernel
        n = w.shape[0] // 2 if gate_up else w.shape[0]
        y = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
        warmups = [functools.partial(_skinny_launch, x, w, y, gate_up, cfg, True) if isinstance(cfg, SkinnyConfig)
                   else functools.partial(_gemv_launch, x, w, y, gate_up, cfg, scratch, True) for cfg in candidates]
        warmups += _ahead_of_more_rows(x, w, gate_up)
        compile_in_parallel(warmups)
        del y
        timings = {}
        for cand in ("cublas", *candidates):
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
    return timings


def small_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    gate_up: bool = False,
    conv: ConvStep | None = None,
) -> torch.Tensor:
    """The decode step's linear: `x @ w.T` ([M, K] x [N, K]), or with `gate_up` the SwiGLU of the packed gate|up
    projection, or with `conv` (`gemv`'s argument) the DeltaNet conv step on its first C columns, by cuBLAS
    (`F.linear`, then `swiglu` / `causal_conv1d_step`) or by `gemv` (one launch), whichever runs faster on this card
    for this shape. The choice is made once per shape, at its first call outside CUDA-graph capture (the decode
    step's eager warm-up): read from the card's record on disk (`recorded_choice`) if an earlier process made it, or
    from the choices shipped for this card (`shipped_choice`), else timed as the captured step runs it (each
    candidate in a CUDA graph over the weight and copies of it, weights cold in L2, `_time_in_graph_ms`; with the conv
    on a copy of its state, so cuBLAS's extra conv launch is timed too) and recorded; kept for the process. The
    candidates (`_candidates`): the `gemv` configs at one row, two `skinny_gemm` configs at 2-32 rows of a 16-bit
    dtype (the conv step then a launch of its own, as after cuBLAS). A shape first met inside a capture, with no
    candidate, or a weight the kernels do not take, uses cuBLAS. One decision point."""
    key = (x.shape[0], *_key_tail(x, w, gate_up))
    choice = _small_linear_choice.get(key)
    if choice is not None:
        return _run_small_linear(x, w, gate_up, choice, conv)
    eligible = HAS_TRITON and x.is_cuda and w.is_contiguous() and w.dtype == x.dtype
    candidates = _candidates(x, gate_up) if eligible else ()
    if not candidates or torch.cuda.is_current_stream_capturing():
        _small_linear_choice[key] = "cublas"
        return _run_small_linear(x, w, gate_up, "cublas", conv)
    path = _record_path(x.device)
    choice = recorded_choice(path, key) or shipped_choice(key)
    if choice is not None:
        try:  # the eager call this step needs anyway; a recorded kernel that no longer runs here is timed again
            compile_in_parallel(_recorded_warmups(x, w, gate_up, conv, choice))
            y = _run_small_linear(x, w, gate_up, choice, conv)
            _small_linear_choice[key] = choice
            return y
        except Exception:  # noqa: BLE001 - fall through to timing (conv state untouched: a launch failed first)
            pass
    _announce_timing(x.shape[0], x.device, path)
    timings = _time_candidates(x, w, gate_up, conv, candidates)
    # cuBLAS is the reference point: if it could not be timed (a capture that fails here), nothing is compared
    choice = min(timings, key=timings.get) if "cublas" in timings else "cublas"
    if "cublas" in timings:
        record_choice(path, key, choice)
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
