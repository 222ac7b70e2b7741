# Copyright 2026 The Qwen3.5 fused-kernels authors. Licensed under the Apache License, Version 2.0.
"""The routed experts of Qwen3.5-MoE for many tokens (prefill): grouped GEMMs over the experts the tokens picked.

- `moe_experts_prefill`: `moe_experts` (in `fused_ops_moe`, which decides the path and validates) for T > 16 tokens:
  the (token, slot) pairs sorted by expert (stable; a counting sort, `_moe_sort_kernel`), a grouped GEMM of x with
  each expert's gate|up rows with the SwiGLU in its epilogue, the grouped GEMM with the down projections writing
  each pair's row back in slot order, then one pass that weighs and sums each token's k rows in slot order
  (float32) and adds the gated shared expert.
  Replaces stock `Qwen3_5MoeExperts.forward` (eager loop, `batched_mm` or `grouped_mm`) and the shared-expert sum
  of `Qwen3_5MoeSparseMoeBlock.forward`.

The torch reference is `fused_ops_moe.moe_experts_ref` (the same function for both paths).
Shape alphabet: T tokens, H hidden size, E experts, k experts per token, I expert intermediate size, P = T * k pairs.
"""

import torch

from .fused_ops_runtime import (
    HAS_TRITON,
    _device_guard,
    _dot_in_f32,
    _dot_precision,
    _pdl_launch,
    pdl_enabled,
    tl,
    triton,
)

if HAS_TRITON:  # the shared `@triton.jit` helpers exist only with triton
    from .fused_ops_runtime import _pdl_wait, _round_to


# ---------------------------------------------------------------------------------------------------------------------
# Grouped GEMMs over the experts hit, SwiGLU in the first one's epilogue
#
# Why our own grouped GEMM rather than `torch._grouped_mm` (stock's `grouped_mm` path; torch 2.11 / 2.13 have it):
# on CUDA it takes bf16 only (torch's `F.grouped_mm` docs: bf16 on SM80+; fp32 / fp16 models would need a second
# path), wants 16-byte aligned strides and int32 offsets, and fuses nothing: it needs x gathered into expert order
# first (a [P, H] copy), a separate SwiGLU pass over [P, 2I], and the rows put back in token order after the down
# GEMM. Here the first GEMM loads x's rows through the sorted order (no gathered copy) and applies the SwiGLU before
# its single store, the second stores each row straight to its (token, slot) place, and the same three kernels run
# every dtype and run under the Triton interpreter (CPU tests).
# What this costs against CUTLASS's grouped GEMM (`torch._grouped_mm`) on an H200 is not measured yet:
# `scripts/benchmark_moe.py` times both (stock `grouped_mm` is that path) at the 35B-A3B shape.
#
# Scheduling without a host sync: expert e's rows [bounds[e], bounds[e+1]) of the sorted pairs take
# cdiv(rows, BLOCK_M) row tiles, numbered consecutively over the experts (`tile_end`, a cumulative sum); the grid
# is sized for the most tiles any routing can need, cdiv(P, BLOCK_M) + min(E, P), and a program past the last tile
# exits at once. Each program finds its expert by counting the experts whose tiles end at or before its own.
# ---------------------------------------------------------------------------------------------------------------------

# Tiles, (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) for bf16 / fp16: BLOCK_M x BLOCK_N outputs over BLOCK_K; the
# gate|up GEMM keeps two accumulators (gate and up), so it computes a BLOCK_M x 2*BLOCK_N tile; float32 halves
# BLOCK_K to stay within shared memory. BLOCK_M also bounds the waste: each expert's last tile is partly empty, at
# most E * (BLOCK_M - 1) rows in all, and each tile reads its expert's weights once more (from L2 when the tiles of
# one expert run together). `scripts/tune_moe_gemm.py` on the H200 at the 35B-A3B shape, T = 2048 (64 pairs an
# expert on average), two runs of 10 candidates each: gate|up (64, 64, 64, 4, 4) 8-9% faster than the usual Hopper
# tile (64, 128, 64, 4, 3) in both runs (no other candidate was); for the down GEMM no candidate beat that tile in
# both runs.
_GATE_UP_TILES = (64, 64, 64, 4, 4)
_DOWN_TILES = (64, 128, 64, 4, 3)

# The pairs sorted by expert, stable, in one launch. Why a kernel of our own: `torch.sort` (stable) + `searchsorted`
# took ~55 us of a 2,048-token prefill's layer on the H200 (cub's radix sort over 16,384 int64 keys, then
# the bounds); E experts need only a counting sort, and E programs that each scan the P ids twice (from L2) do it.
_SORT_BLOCK_P = 1024

if HAS_TRITON:

    @triton.jit(do_not_specialize=["P"])
    def _moe_sort_kernel(ids_ptr, order_ptr, bounds_ptr, P, E, BLOCK_P: tl.constexpr, PDL: tl.constexpr):
        """Program e: bounds[e] = #pairs with id < e (and bounds[E] = #pairs with id < E, by program E - 1), then the
        pairs with id == e, in pair order, written to order[bounds[e]:]: a stable counting sort by expert."""
        _pdl_wait(PDL)  # the ids come from the router kernel just before
        i_e = tl.program_id(0)
        n_lt = tl.sum(tl.zeros([BLOCK_P], dtype=tl.int32), axis=0)
        n_eq = n_lt
        for p0 in range(0, P, BLOCK_P):
            o_p = p0 + tl.arange(0, BLOCK_P)
            b_id = tl.load(ids_ptr + o_p, mask=o_p < P, other=E)  # [BP]; E (past the lanes) counts nowhere
            n_lt += tl.sum((b_id < i_e).to(tl.int32), axis=0)
            n_eq += tl.sum((b_id == i_e).to(tl.int32), axis=0)
        tl.store(bounds_ptr + i_e, n_lt.to(tl.int64))
        if i_e == E - 1:
            tl.store(bounds_ptr + E, (n_lt + n_eq).to(tl.int64))
        run = n_lt
        for p0 in range(0, P, BLOCK_P):
            o_p = p0 + tl.arange(0, BLOCK_P)
            m = tl.load(ids_ptr + o_p, mask=o_p < P, other=E) == i_e  # [BP]
            b_m = m.to(tl.int32)
            tl.store(order_ptr + run + tl.cumsum(b_m, axis=0) - 1, o_p.to(tl.int64), mask=m)
            run += tl.sum(b_m, axis=0)

    @triton.jit
    def _expert_tile(tile_end_ptr, bounds_ptr, E, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
        """This program's row tile of the sorted pairs: (expert, first row, end row of the expert); expert == E for
        a program past the last tile."""
        i_m = tl.program_id(1)
        o_e = tl.arange(0, BLOCK_E)
        b_end = tl.load(tile_end_ptr + o_e, mask=o_e < E, other=2**30)  # [BE] each expert's tiles end here
        i_e = tl.sum((b_end <= i_m).to(tl.int32), axis=0)  # the experts whose tiles all come before this one
        i_e_in = tl.minimum(i_e, E - 1)
        first_tile = tl.load(tile_end_ptr + i_e_in - 1, mask=i_e_in > 0, other=0)
        row0 = tl.load(bounds_ptr + i_e_in) + (i_m - first_tile) * BLOCK_M
        return i_e, row0, tl.load(bounds_ptr + i_e_in + 1)

    @triton.jit
    def _moe_gate_up_gemm_kernel(
        x_ptr, w_ptr, order_ptr, bounds_ptr, tile_end_ptr, h_ptr, E, I, H, stride_xt,
        TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        BLOCK_E: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr, PDL: tl.constexpr,
    ):
        _pdl_wait(PDL)  # x, the order and the tile table come from the kernels just before
        i_e, row0, row_end = _expert_tile(tile_end_ptr, bounds_ptr, E, BLOCK_M, BLOCK_E)
        if i_e < E:
            o_m = row0 + tl.arange(0, BLOCK_M)  # [BM] sorted pairs of expert i_e
            m_m = o_m < row_end
            o_t = (tl.load(order_ptr + o_m, mask=m_m, other=0) // TOP_K).to(tl.int64)  # [BM] their tokens
            o_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] columns of h
            m_n = o_n < I
            p_g = w_ptr + i_e.to(tl.int64) * (2 * I * H) + o_n.to(tl.int64)[None, :] * H  # [1, BN] gate rows
            acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for k0 in range(0, H, BLOCK_K):
                o_k = k0 + tl.arange(0, BLOCK_K)
                m_k = o_k < H
                b_x = tl.load(x_ptr + o_t[:, None] * stride_xt + o_k[None, :], mask=m_m[:, None] & m_k[None, :],
                              other=0.0)  # [BM, BK] gathered through the order: no copy of x in expert order
                m_w = m_k[:, None] & m_n[None, :]
                b_g = tl.load(p_g + o_k[:, None], mask=m_w, other=0.0)  # [BK, BN]
                b_u = tl.load(p_g + I * H + o_k[:, None], mask=m_w, other=0.0)
                if DOT_F32:  # the interpreter (see `_dot_in_f32`)
                    b_x, b_g, b_u = b_x.to(tl.float32), b_g.to(tl.float32), b_u.to(tl.float32)
                acc_g = tl.dot(b_x, b_g, acc_g, input_precision=PRECISION)
                acc_u = tl.dot(b_x, b_u, acc_u, input_precision=PRECISION)
            dt = h_ptr.dtype.element_ty
            b_g = _round_to(acc_g, dt)  # stock: the gate|up linear rounded,
            b_s = _round_to(b_g / (1.0 + tl.exp(-b_g)), dt)  # silu(gate) rounded,
            b_h = _round_to(b_s * _round_to(acc_u, dt), dt)  # times up, rounded
            tl.store(h_ptr + o_m.to(tl.int64)[:, None] * I + o_n[None, :], b_h.to(dt),
                     mask=m_m[:, None] & m_n[None, :])

    @triton.jit
    def _moe_down_gemm_kernel(
        h_ptr, w_ptr, order_ptr, bounds_ptr, tile_end_ptr, d_ptr, E, I, H,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
        PRECISION: tl.constexpr, DOT_F32: tl.constexpr, PDL: tl.constexpr,
    ):
        _pdl_wait(PDL)  # h comes from the gate|up GEMM just before
        i_e, row0, row_end = _expert_tile(tile_end_ptr, bounds_ptr, E, BLOCK_M, BLOCK_E)
        if i_e < E:
            o_m = row0 + tl.arange(0, BLOCK_M)  # [BM] sorted pairs of expert i_e
            m_m = o_m < row_end
            o_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] hidden features
            m_n = o_n < H
            p_w = w_ptr + i_e.to(tl.int64) * (H * I) + o_n.to(tl.int64)[None, :] * I  # [1, BN] down rows
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for k0 in range(0, I, BLOCK_K):
                o_k = k0 + tl.arange(0, BLOCK_K)
                m_k = o_k < I
                b_h = tl.load(h_ptr + o_m.to(tl.int64)[:, None] * I + o_k[None, :],
                              mask=m_m[:, None] & m_k[None, :], other=0.0)  # [BM, BK]
                b_w = tl.load(p_w + o_k[:, None], mask=m_k[:, None] & m_n[None, :], other=0.0)  # [BK, BN]
                if DOT_F32:  # the interpreter (see `_dot_in_f32`)
                    b_h, b_w = b_h.to(tl.float32), b_w.to(tl.float32)
                acc = tl.dot(b_h, b_w, acc, input_precision=PRECISION)
            o_p = tl.load(order_ptr + o_m, mask=m_m, other=0).to(tl.int64)  # [BM] each row's (token, slot) pair
            dt = d_ptr.dtype.element_ty
            tl.store(d_ptr + o_p[:, None] * H + o_n[None, :], _round_to(acc, dt).to(dt),  # stock rounds the linear
                     mask=m_m[:, None] & m_n[None, :])

    @triton.jit
    def _moe_combine_kernel(
        d_ptr, wt_ptr, ids_ptr, s_ptr, sg_ptr, y_ptr, T, E, H,
        stride_wt, stride_it, stride_st, stride_sgt, stride_yt,
        TOP_K: tl.constexpr, SHARED: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
    ):
        _pdl_wait(PDL)  # d comes from the down GEMM just before
        o_t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)  # [BT] tokens
        m_t = o_t < T
        o_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] hidden features
        m = m_t[:, None] & (o_n < H)[None, :]
        acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
        for j in tl.static_range(TOP_K):  # slot order: a fixed summation order, no atomics
            i_e = tl.load(ids_ptr + o_t * stride_it + j, mask=m_t, other=-1)
            valid = (i_e >= 0) & (i_e < E)  # [BT] a pair outside [0, E) was never computed: it adds nothing
            b_wt = tl.load(wt_ptr + o_t * stride_wt + j, mask=m_t & valid, other=0.0).to(tl.float32)
            b_d = tl.load(d_ptr + (o_t * TOP_K + j)[:, None] * H + o_n[None, :], mask=m & valid[:, None], other=0.0)
            acc += b_wt[:, None] * b_d.to(tl.float32)
        if SHARED:
            b_sg = tl.load(sg_ptr + o_t * stride_sgt, mask=m_t, other=0.0).to(tl.float32)  # [BT]
            b_s = tl.load(s_ptr + o_t[:, None] * stride_st + o_n[None, :], mask=m, other=0.0).to(tl.float32)
            acc += b_s / (1.0 + tl.exp(-b_sg))[:, None]
        dt = y_ptr.dtype.element_ty
        tl.store(y_ptr + o_t[:, None] * stride_yt + o_n[None, :], _round_to(acc, dt).to(dt), mask=m)


def _sort_pairs(ids: torch.Tensor, E: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (token, slot) pairs of ids [T, k] sorted by expert, stable (`_moe_sort_kernel`): order [P] int64, the pair
    t * k + j of each sorted row, and bounds [E + 1] int64, expert e's rows [bounds[e], bounds[e+1]). As
    `torch.sort(ids.flatten(), stable=True)` + `searchsorted`, except at the pairs with an id outside [0, E): their
    rows sort to either end, where no tile reads them, and their order entries are left unwritten."""
    flat = ids.reshape(-1)  # [P]
    order = torch.empty_like(flat, dtype=torch.int64)
    bounds = torch.empty(E + 1, dtype=torch.int64, device=ids.device)
    with _device_guard(ids):
        pdl = pdl_enabled(ids.device)
        _moe_sort_kernel[(E,)](flat, order, bounds, flat.shape[0], E, BLOCK_P=_SORT_BLOCK_P, PDL=pdl, num_warps=4,
                               **_pdl_launch(pdl))
    return order, bounds


def _tile_end(bounds: torch.Tensor, block_m: int) -> torch.Tensor:
    """[E] int32: expert e's row tiles of `block_m` sorted pairs end before tile tile_end[e] (a cumulative sum over
    the experts, from `bounds` [E + 1]: expert e's pairs are rows [bounds[e], bounds[e+1]) of the sorted order;
    pairs with an id outside [0, E) sort to either end, outside every expert's rows: no tile computes them)."""
    tiles = (bounds[1:] - bounds[:-1] + block_m - 1) // block_m
    return torch.cumsum(tiles, 0, dtype=torch.int32)


def _max_tiles(P: int, E: int, block_m: int) -> int:
    """The grid's row-tile count: the most tiles any routing of P pairs over E experts can need."""
    return triton.cdiv(P, block_m) + min(E, P)


def _fit_tiles(tiles, N: int, K: int, dtype: torch.dtype) -> tuple:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) for an N x K weight: BLOCK_N and BLOCK_K no wider than the
    matrix needs (at least 16, `tl.dot`'s minimum), BLOCK_K halved for float32 (twice the shared memory a tile)."""
    bm, bn, bk, warps, stages = tiles
    if dtype == torch.float32:
        bk //= 2
    return (bm, min(bn, max(16, triton.next_power_of_2(N))), min(bk, max(16, triton.next_power_of_2(K))), warps,
            stages)


def moe_experts_prefill(x, gate_up, down, weights, ids, shared=None, shared_gate=None, tiles=None) -> torch.Tensor:
    """`fused_ops_moe.moe_experts` for many tokens (its arguments, validated there): grouped GEMMs over the experts
    hit, then the weighted combine with the shared expert. No host sync (CUDA-graph safe), no atomics.

    Intermediates: h [P, I] (SwiGLU, rounded as stock) in expert order, d [P, H] (the down linear, rounded as stock)
    in (token, slot) order; then `y[t] = sum_j weights[t, j] * d[t*k + j] + sigmoid(shared_gate[t]) * shared[t]` in
    float32, rounded once. `tiles`: (gate|up, down) tile tuples in place of `_GATE_UP_TILES`, `_DOWN_TILES` (the
    tuning script's candidates). Returns y [T, H] contiguous in x.dtype."""
    T, H = x.shape
    E, I = down.shape[0], down.shape[2]
    k = ids.shape[1]
    P = T * k
    gu_tiles, dn_tiles = tiles if tiles is not None else (_GATE_UP_TILES, _DOWN_TILES)
    order, bounds = _sort_pairs(ids, E)
    h = torch.empty(P, I, dtype=x.dtype, device=x.device)
    d = torch.empty(P, H, dtype=x.dtype, device=x.device)
    y = torch.empty(T, H, dtype=x.dtype, device=x.device)
    common = dict(BLOCK_E=triton.next_power_of_2(E), PRECISION=_dot_precision(x.dtype), DOT_F32=_dot_in_f32(x))
    s, sg = (shared, shared_gate) if shared is not None else (y, y)
    block_t = 4
    with _device_guard(x):
        pdl = pdl_enabled(x.device)
        # grid axis 0 (fastest) over the columns: the programs running together share one expert's rows of x
        bm, bn, bk, warps, stages = _fit_tiles(gu_tiles, I, H, x.dtype)
        tile_end = {bm: _tile_end(bounds, bm)}  # one table per BLOCK_M (the two GEMMs share it when theirs match)
        _moe_gate_up_gemm_kernel[(triton.cdiv(I, bn), _max_tiles(P, E, bm))](
            x, gate_up, order, bounds, tile_end[bm], h, E, I, H, x.stride(0),
            TOP_K=k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, PDL=pdl, num_warps=warps, num_stages=stages,
            **common, **_pdl_launch(pdl),
        )
        bm, bn, bk, warps, stages = _fit_tiles(dn_tiles, H, I, x.dtype)
        if bm not in tile_end:
            tile_end[bm] = _tile_end(bounds, bm)
        _moe_down_gemm_kernel[(triton.cdiv(H, bn), _max_tiles(P, E, bm))](
            h, down, order, bounds, tile_end[bm], d, E, I, H,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, PDL=pdl, num_warps=warps, num_stages=stages,
            **common, **_pdl_launch(pdl),
        )
        bn = min(1024, triton.next_power_of_2(H))
        _moe_combine_kernel[(triton.cdiv(T, block_t), triton.cdiv(H, bn))](
            d, weights, ids, s, sg, y, T, E, H,
            weights.stride(0), ids.stride(0), s.stride(0), sg.stride(0), y.stride(0),
            TOP_K=k, SHARED=shared is not None, BLOCK_T=block_t, BLOCK_N=bn, PDL=pdl,
            num_warps=4, **_pdl_launch(pdl),
        )
    return y
