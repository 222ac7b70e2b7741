# Copyright 2026 The Qwen3.5 fused-kernels authors. Licensed under the Apache License, Version 2.0.
"""The sparse MoE block of Qwen3.5-MoE (`qwen3_5_moe_text`): routing and the routed experts, each op beside its
plain-torch reference.

- `moe_route`: softmax over the router logits in float32, top-k, renormalised, cast back; replaces stock
  `Qwen3_5MoeTopKRouter.forward` after its linear.
- `moe_experts`: the routed experts' SwiGLU MLPs on the tokens that picked them, weighted and summed per token, plus
  the shared expert's output (or, given its weights, the shared expert itself) times the sigmoid of its gate;
  replaces stock `Qwen3_5MoeExperts.forward` and the `expert_output + sigmoid(shared_expert_gate(x)) *
  shared_expert_output` of `Qwen3_5MoeSparseMoeBlock.forward`. Up to `_DECODE_MAX_T` tokens it runs two GEMV kernels
  here (decode; for one token the shared expert as one more slot of both, `moe_shared_in_slots`); past that the
  grouped GEMMs of `fused_ops_moe_gemm` (prefill: a counting sort by expert, then the two GEMMs and the combine).

Each op: kernel -> wrapper (validates; ValueError names the values) -> torch `name_ref` below it (dtypes: runtime).
Shape alphabet here: T tokens, H hidden size, E experts, k experts per token, I expert intermediate size.
"""

import torch
import torch.nn.functional as F

from .fused_ops_moe_gemm import moe_experts_prefill
from .fused_ops_norm import swiglu
from .fused_ops_runtime import (
    HAS_TRITON,
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
# Routing: softmax over the experts, top-k, renormalised
#
# Why a kernel of our own: after the router linear stock launches softmax, topk, sum, divide and the cast, each a
# pass over a [T, E] or [T, k] tensor: five launches a decode step where one does. One program holds a token's whole
# row of logits (E <= 512 floats), so one launch does it all from registers.
# ---------------------------------------------------------------------------------------------------------------------

_ROUTE_MAX_E = 512
_ROUTE_MAX_K = 16

if HAS_TRITON:

    @triton.jit(do_not_specialize=["T"])
    def _moe_route_kernel(
        l_ptr, w_ptr, i_ptr, T, E, stride_l,
        TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
    ):
        _pdl_wait(PDL)  # the logits come from the router linear just before
        o_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT] tokens
        m_t = o_t < T
        o_e = tl.arange(0, BLOCK_E)  # [BE] experts
        m_te = m_t[:, None] & (o_e < E)[None, :]  # [BT, BE]
        b_l = tl.load(l_ptr + o_t.to(tl.int64)[:, None] * stride_l + o_e[None, :], mask=m_te,
                      other=float("-inf")).to(tl.float32)  # [BT, BE]
        b_p = tl.exp(b_l - tl.max(b_l, axis=1)[:, None])  # lanes past E: exp(-inf) = 0
        b_p = b_p / tl.sum(b_p, axis=1)[:, None]  # [BT, BE] probabilities, float32 as stock's softmax
        # top-k by logit (softmax is monotone), largest first, a tie to the lower expert index
        avail = m_te
        o_k = tl.arange(0, BLOCK_K)
        b_w = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
        b_i = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
        for j in tl.static_range(TOP_K):
            b_v = tl.max(tl.where(avail, b_l, float("-inf")), axis=1)  # [BT]
            b_idx = tl.min(tl.where(avail & (b_l == b_v[:, None]), o_e[None, :], BLOCK_E), axis=1)  # [BT]
            sel = o_e[None, :] == b_idx[:, None]  # [BT, BE]
            avail = avail & ~sel
            b_w = tl.where(o_k[None, :] == j, tl.sum(tl.where(sel, b_p, 0.0), axis=1)[:, None], b_w)
            b_i = tl.where(o_k[None, :] == j, b_idx[:, None], b_i)
        b_w = b_w / tl.sum(b_w, axis=1)[:, None]  # renormalised over the k picked (unused lanes are 0)
        m_tk = m_t[:, None] & (o_k < TOP_K)[None, :]
        p_o = o_t.to(tl.int64)[:, None] * TOP_K + o_k[None, :]
        dt = w_ptr.dtype.element_ty
        tl.store(w_ptr + p_o, _round_to(b_w, dt).to(dt), mask=m_tk)
        tl.store(i_ptr + p_o, b_i.to(tl.int64), mask=m_tk)


def moe_route(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's top-k: `p = softmax(logits)` in float32, its k largest, `w = p_top / sum(p_top)`, cast to
    logits.dtype; one launch, no host sync.

    Ties: the k experts are the k largest logits (the order of the probabilities, which softmax keeps), largest
    first, and among equal logits the lower expert index first. `torch.topk` (stock, `moe_route_ref`) leaves the
    order of ties unspecified, and on CPU does not take the lower index (16 equal logits, k=2 -> [10, 11]); the two
    agree on the weights always, and on the ids wherever no two picked experts (or a picked and an unpicked one)
    have equal logits. Experts whose float32 probability underflows to 0 (logits ~90 or more below the row's max) are
    ordered by logit here, by torch's tie order there; their weight is 0 in both.

    Args:
        logits: [T, E] router logits, float32 / bfloat16 / float16, E <= 512, last dim contiguous (any row stride).
        top_k: experts per token, 1 <= top_k <= min(E, 16).

    Returns:
        (weights [T, top_k] in logits.dtype, ids [T, top_k] int64), both contiguous; replaces stock
        `Qwen3_5MoeTopKRouter.forward` after its linear (softmax, topk, sum, divide, cast).
    """
    _check_triton("moe_route")
    _check_float("logits", logits)
    if logits.dim() != 2 or not 1 <= logits.shape[1] <= _ROUTE_MAX_E:
        raise ValueError(f"moe_route needs logits [T, E] with 1 <= E <= {_ROUTE_MAX_E}, got {tuple(logits.shape)}.")
    if not 1 <= top_k <= min(logits.shape[1], _ROUTE_MAX_K):
        raise ValueError(f"moe_route needs 1 <= top_k <= min(E, {_ROUTE_MAX_K}) = "
                         f"{min(logits.shape[1], _ROUTE_MAX_K)}, got top_k={top_k}; use moe_route_ref for more.")
    _check_last_dim_contiguous("logits", logits)
    T, E = logits.shape
    weights = torch.empty(T, top_k, dtype=logits.dtype, device=logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=logits.device)
    if T == 0:
        return weights, ids
    BLOCK_E = triton.next_power_of_2(E)
    BLOCK_T = _units_per_program(T, BLOCK_E, cap=16)
    with _device_guard(logits):
        pdl = pdl_enabled(logits.device)
        _moe_route_kernel[(triton.cdiv(T, BLOCK_T),)](
            logits, weights, ids, T, E, logits.stride(0),
            TOP_K=top_k, BLOCK_T=BLOCK_T, BLOCK_E=BLOCK_E, BLOCK_K=triton.next_power_of_2(top_k), PDL=pdl,
            num_warps=_num_warps(BLOCK_T * BLOCK_E), **_pdl_launch(pdl),
        )
    return weights, ids


def moe_route_ref(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch `moe_route`, as stock `Qwen3_5MoeTopKRouter.forward` computes it after its linear.

    Args:
        logits: [T, E] router logits (any float dtype).
        top_k: experts per token, 1 <= top_k <= E.

    Returns:
        (weights [T, top_k] in logits.dtype, ids [T, top_k] int64): the top-k softmax probabilities (softmax in
        float32) divided by their sum, in descending order, and the experts they belong to.
    """
    if logits.dim() != 2 or not 1 <= top_k <= logits.shape[-1]:
        raise ValueError(f"moe_route needs logits [T, E] and 1 <= top_k <= E, got {tuple(logits.shape)} and "
                         f"top_k={top_k}.")
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    top, ids = torch.topk(probs, top_k, dim=-1)
    top = top / top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype), ids


# ---------------------------------------------------------------------------------------------------------------------
# Routed experts at decode (T <= _DECODE_MAX_T): a gate|up GEMV over the picked experts' rows with the SwiGLU in its
# epilogue, then a down GEMV that also weighs and sums each token's k experts and adds the gated shared expert
#
# Why kernels of our own: a decode step of the MoE block is a weight read of the k picked experts (8 of 256: 50 MB
# at the 35B-A3B shape in bf16, against 1.6 GB for all), and stock's paths either loop over the experts hit with
# ~10 launches each and a host sync (`eager`), read the [T*k, 2I, H] gathered weights back after copying them
# (`batched_mm`), or run a grouped GEMM built for many rows per expert (`grouped_mm`). Here each program reads the
# rows of its expert straight from the stacked [E, 2I, H] / [E, H, I] weights by the id the router wrote, so the
# step reads the picked weights once, launches twice, never syncs and allocates only h and y (CUDA-graph safe).
# The down kernel's program owns an H tile of one token and sums that token's k experts in a fixed order: no
# atomics, so the result is deterministic.
#
# The shared expert, when its weights are handed over (`shared_experts`, an intermediate size equal to the routed
# experts') at batch 1, is one more slot of both GEMVs (slot k, weight sigmoid(shared_gate)): the decode step then
# launches no SwiGLU and no shared down GEMV of its own, and its router GEMV reads E + 1 rows instead of
# 2 I_s + E + 1. Not past batch 1: each token's slot reads the shared expert again (at batch 8 seven more reads,
# 44 MB a layer at 35B-A3B: the step measured 8.00 ms a token folded against 7.35 unfolded).
# ---------------------------------------------------------------------------------------------------------------------

_DECODE_MAX_T = 16  # a decode step of batch 1-16; more tokens take the grouped GEMMs
# (BLOCK_N, BLOCK_K, warps, loop unroll) of the two GEMVs, chosen by the 35B-A3B decode step's ms per token through
# `generate` (all 40 layers, CUDA graphs, PDL on, H200, 2026-12-02; 17 gate|up and 14 down configs in two runs, the
# shipped pair read 2.549-2.553 ms at batch 1 in both): gate|up (4, 512, 4, 2) 2.412 / 6.688 ms at batch 1 / 8 against
# 2.549 / 6.894 for the (16, 256, 4, 1) before it (the loop unrolled twice: a later weight tile's load issues before
# an earlier tile's FMAs wait); with it the down GEMV (16, 128, 8, 4) 2.258 ms at batch 1 but 6.989 at batch 8, where
# (4, 256, 4, 1) read 6.688 (2.412 at batch 1), hence one config for a lone token and one for more. The down GEMV
# runs all k slots at once (against 12.4 us a layer for the slot-by-slot loop it replaced: k dependent loads in series);
# its [8 * BLOCK_N, BLOCK_K] float32 accumulator takes 64 registers a thread in both configs.
_DECODE_GATE_UP = (4, 512, 4, 2)
_DECODE_DOWN = (4, 256, 4, 1)  # 2-16 tokens
_DECODE_DOWN_ONE_TOKEN = (16, 128, 8, 4)


def _decode_down_config(T: int) -> tuple[int, int, int, int]:
    """The down GEMV's (BLOCK_N, BLOCK_K, warps, unroll) for a decode step of T tokens (see above)."""
    return _DECODE_DOWN_ONE_TOKEN if T == 1 else _DECODE_DOWN


# How the shared expert enters `moe_experts` (the kernels' SHARED constexpr)
_NO_SHARED, _SHARED_OUTPUT, _SHARED_WEIGHTS = 0, 1, 2

if HAS_TRITON:

    @triton.jit
    def _moe_gate_up_gemv_kernel(
        x_ptr, w_ptr, ws_ptr, ids_ptr, h_ptr, E, I, H, stride_xt, stride_it,
        TOP_K: tl.constexpr, SLOTS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UNROLL: tl.constexpr,
        PDL: tl.constexpr,
    ):
        if PDL:  # ids come from the router kernel just before; the down GEMV may launch once they are in (it reads
            tl.extra.cuda.gdc_wait()  # them, and its first weight tiles, before its own wait)
            tl.extra.cuda.gdc_launch_dependents()
        i_p = tl.program_id(0)  # one (token, slot) pair: t * SLOTS + j; slot TOP_K (if any) is the shared expert
        i_t = i_p // SLOTS
        i_j = i_p % SLOTS
        i_e = tl.load(ids_ptr + i_t * stride_it + i_j, mask=i_j < TOP_K, other=0)
        i_e = tl.where((i_e >= 0) & (i_e < E), i_e, 0).to(tl.int64)  # an id outside [0, E) is dropped by the down
        p_base = w_ptr + i_e * (2 * I * H)  # [2I, H] this slot's gate rows, then its up rows
        if SLOTS > TOP_K:
            if i_j == TOP_K:
                p_base = ws_ptr  # the shared expert's gate|up [2I, H]
        o_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] rows of h
        m_n = o_n < I
        p_g = p_base + o_n.to(tl.int64)[:, None] * H  # [BN, 1] gate rows; up rows I*H below
        acc_g = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in tl.range(0, H, BLOCK_K, loop_unroll_factor=UNROLL):  # UNROLL > 1: later tiles' loads issue early
            o_k = k0 + tl.arange(0, BLOCK_K)
            m_k = o_k < H
            m_w = m_n[:, None] & m_k[None, :]
            b_x = tl.load(x_ptr + i_t.to(tl.int64) * stride_xt + o_k, mask=m_k, other=0.0).to(tl.float32)  # [BK]
            acc_g += tl.load(p_g + o_k[None, :], mask=m_w, other=0.0).to(tl.float32) * b_x[None, :]
            acc_u += tl.load(p_g + I * H + o_k[None, :], mask=m_w, other=0.0).to(tl.float32) * b_x[None, :]
        dt = h_ptr.dtype.element_ty
        b_g = _round_to(tl.sum(acc_g, axis=1), dt)  # [BN] stock: the gate|up linear rounded,
        b_s = _round_to(b_g / (1.0 + tl.exp(-b_g)), dt)  # silu(gate) rounded,
        b_h = _round_to(b_s * _round_to(tl.sum(acc_u, axis=1), dt), dt)  # times up, rounded
        tl.store(h_ptr + i_p.to(tl.int64) * I + o_n, b_h.to(dt), mask=m_n)

    @triton.jit
    def _moe_down_gemv_kernel(
        h_ptr, w_ptr, ws_ptr, wt_ptr, ids_ptr, s_ptr, sg_ptr, y_ptr, E, I, H,
        stride_wt, stride_it, stride_st, stride_sgt, stride_yt,
        TOP_K: tl.constexpr, SLOTS: tl.constexpr, SHARED: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, UNROLL: tl.constexpr, PDL: tl.constexpr,
    ):
        # Before the PDL wait, what no kernel still running writes: the ids (the router kernel finished before the
        # gate|up GEMV let this one launch) and the first weight tiles; after it, h from the gate|up GEMV.
        i_t = tl.program_id(0).to(tl.int64)  # one token
        i_n = tl.program_id(1) * BLOCK_N
        # rows r = (slot j, output n) of all TOP_K routed slots at once: their weight loads do not wait on each other
        o_r = tl.arange(0, BLOCK_J * BLOCK_N)  # [R]
        o_j = o_r // BLOCK_N
        o_n = i_n + o_r % BLOCK_N  # [R] outputs (hidden features)
        m_j = o_j < TOP_K
        b_e = tl.load(ids_ptr + i_t * stride_it + o_j, mask=m_j, other=-1)  # [R] each row's expert
        valid = m_j & (b_e >= 0) & (b_e < E)  # an id outside [0, E) reads nothing and adds nothing
        m_r = valid & (o_n < H)
        p_w = w_ptr + tl.where(valid, b_e, 0).to(tl.int64) * (H * I) + o_n.to(tl.int64) * I  # [R] down rows
        p_h = h_ptr + (i_t * SLOTS + o_j) * I  # [R] each slot's SwiGLU output
        o_s = i_n + tl.arange(0, BLOCK_N)  # [BN] the shared expert's rows (slot TOP_K)
        m_s = o_s < H
        p_ws = ws_ptr + o_s.to(tl.int64)[:, None] * I  # [BN, 1]
        o_k = tl.arange(0, BLOCK_K)
        m_k = o_k < I
        b_w = tl.load(p_w[:, None] + o_k[None, :], mask=m_r[:, None] & m_k[None, :], other=0.0)  # [R, BK] tile 0
        if SHARED == 2:
            b_ws = tl.load(p_ws + o_k[None, :], mask=m_s[:, None] & m_k[None, :], other=0.0)  # [BN, BK]
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        acc = tl.zeros([BLOCK_J * BLOCK_N, BLOCK_K], dtype=tl.float32)
        acc_s = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in tl.range(0, I, BLOCK_K, loop_unroll_factor=UNROLL):
            o_k = k0 + tl.arange(0, BLOCK_K)
            m_k = o_k < I
            m = m_r[:, None] & m_k[None, :]
            if k0 > 0:  # tile 0 was loaded before the wait
                b_w = tl.load(p_w[:, None] + o_k[None, :], mask=m, other=0.0)
            b_h = tl.load(p_h[:, None] + o_k[None, :], mask=m, other=0.0).to(tl.float32)  # [R, BK]
            acc += b_w.to(tl.float32) * b_h
            if SHARED == 2:
                if k0 > 0:
                    b_ws = tl.load(p_ws + o_k[None, :], mask=m_s[:, None] & m_k[None, :], other=0.0)
                b_hs = tl.load(h_ptr + (i_t * SLOTS + TOP_K) * I + o_k, mask=m_k, other=0.0).to(tl.float32)  # [BK]
                acc_s += b_ws.to(tl.float32) * b_hs[None, :]
        dt = y_ptr.dtype.element_ty
        b_d = _round_to(tl.sum(acc, axis=1), dt)  # [R] each slot's down linear, rounded as stock rounds it
        b_wt = tl.load(wt_ptr + i_t * stride_wt + o_j, mask=valid, other=0.0).to(tl.float32)  # [R]
        b_y = tl.sum(tl.reshape(b_wt * b_d, [BLOCK_J, BLOCK_N]), axis=0)  # [BN] weighted sum over the slots, fp32
        if SHARED > 0:
            b_sg = tl.load(sg_ptr + i_t * stride_sgt).to(tl.float32)
            if SHARED == 2:  # slot TOP_K: the shared expert's own down linear
                b_s = _round_to(tl.sum(acc_s, axis=1), dt)
            else:  # its output, handed over
                b_s = tl.load(s_ptr + i_t * stride_st + o_s, mask=m_s, other=0.0).to(tl.float32)
            b_y += b_s / (1.0 + tl.exp(-b_sg))
        tl.store(y_ptr + i_t * stride_yt + o_s, _round_to(b_y, dt).to(dt), mask=m_s)


def _moe_experts_decode(x, gate_up, down, weights, ids, shared, shared_gate, shared_experts) -> torch.Tensor:
    """`moe_experts` for T <= `_DECODE_MAX_T`: the two GEMVs above (inputs validated by the caller)."""
    T, H = x.shape
    E, I = down.shape[0], down.shape[2]
    k = ids.shape[1]
    mode = _SHARED_WEIGHTS if shared_experts is not None else _SHARED_OUTPUT if shared is not None else _NO_SHARED
    slots = k + (mode == _SHARED_WEIGHTS)
    h = torch.empty(T, slots, I, dtype=x.dtype, device=x.device)  # [T, slots, I] each (token, slot)'s SwiGLU
    y = torch.empty(T, H, dtype=x.dtype, device=x.device)
    gu_n, gu_k, gu_warps, gu_unroll = _DECODE_GATE_UP
    dn_n, dn_k, dn_warps, dn_unroll = _decode_down_config(T)
    ws_gu, ws_down = shared_experts if shared_experts is not None else (gate_up, down)
    s = shared if shared is not None else y
    sg = shared_gate if shared_gate is not None else y
    with _device_guard(x):
        pdl = pdl_enabled(x.device)
        _moe_gate_up_gemv_kernel[(T * slots, triton.cdiv(I, gu_n))](
            x, gate_up, ws_gu, ids, h, E, I, H, x.stride(0), ids.stride(0),
            TOP_K=k, SLOTS=slots, BLOCK_N=gu_n, BLOCK_K=min(gu_k, triton.next_power_of_2(H)), UNROLL=gu_unroll,
            PDL=pdl,
            num_warps=gu_warps, **_pdl_launch(pdl),
        )
        _moe_down_gemv_kernel[(T, triton.cdiv(H, dn_n))](
            h, down, ws_down, weights, ids, s, sg, y, E, I, H,
            weights.stride(0), ids.stride(0), s.stride(0), sg.stride(0), y.stride(0),
            TOP_K=k, SLOTS=slots, SHARED=mode, BLOCK_J=triton.next_power_of_2(k), BLOCK_N=dn_n,
            BLOCK_K=min(dn_k, triton.next_power_of_2(I)), UNROLL=dn_unroll, PDL=pdl,
            num_warps=dn_warps, **_pdl_launch(pdl),
        )
    return y


def _check_experts(x, gate_up, down, weights, ids, shared, shared_gate, shared_experts) -> None:
    """`moe_experts`'s input checks: shapes, dtypes, layouts, devices; nothing that reads a value (no host sync)."""
    for name, t in (("x", x), ("gate_up", gate_up), ("down", down), ("weights", weights)):
        _check_float(name, t)
    if x.dim() != 2 or gate_up.dim() != 3 or down.dim() != 3:
        raise ValueError(f"moe_experts needs x [T, H], gate_up [E, 2*I, H] and down [E, H, I], got "
                         f"{tuple(x.shape)}, {tuple(gate_up.shape)} and {tuple(down.shape)}.")
    T, H = x.shape
    E, I = down.shape[0], down.shape[2]
    if gate_up.shape != (E, 2 * I, H) or down.shape != (E, H, I):
        raise ValueError(f"moe_experts: with x [T, H={H}] and down [E={E}, H, I={I}], gate_up must be "
                         f"[E, 2*I, H] = {(E, 2 * I, H)} and down {(E, H, I)}; got {tuple(gate_up.shape)} and "
                         f"{tuple(down.shape)}.")
    if weights.dim() != 2 or ids.shape != weights.shape or weights.shape[0] != T or weights.shape[1] < 1:
        raise ValueError(f"moe_experts needs weights [T, k] and ids [T, k] with T = {T} and k >= 1, got "
                         f"{tuple(weights.shape)} and {tuple(ids.shape)}.")
    if ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"moe_experts needs int64 or int32 ids (moe_route's), got {ids.dtype}.")
    if shared is not None and shared_experts is not None:
        raise ValueError("moe_experts takes the shared expert's output (shared) or its weights (shared_experts), "
                         "not both.")
    if (shared is None and shared_experts is None) != (shared_gate is None):
        raise ValueError("moe_experts takes shared_gate with shared or shared_experts, and only with them.")
    tensors = {"gate_up": gate_up, "down": down, "weights": weights}
    if shared_gate is not None and shared_gate.shape != (T, 1):
        raise ValueError(f"moe_experts needs shared_gate [T, 1] = {(T, 1)}, got {tuple(shared_gate.shape)}.")
    if shared is not None:
        if shared.shape != (T, H):
            raise ValueError(f"moe_experts needs shared [T, H] = {(T, H)}, got {tuple(shared.shape)}.")
        tensors.update(shared=shared, shared_gate=shared_gate)
    if shared_experts is not None:
        gu_s, down_s = shared_experts
        I_s = down_s.shape[-1] if down_s.dim() == 2 else -1
        if gu_s.dim() != 2 or down_s.dim() != 2 or gu_s.shape != (2 * I_s, H) or down_s.shape != (H, I_s):
            raise ValueError(f"moe_experts needs shared_experts = (gate_up [2*I_s, H], down [H, I_s]) with H = {H}, "
                             f"got {tuple(gu_s.shape)} and {tuple(down_s.shape)}.")
        if not (gu_s.is_contiguous() and down_s.is_contiguous()):
            raise ValueError(f"moe_experts needs contiguous shared-expert weights, got strides {gu_s.stride()} and "
                             f"{down_s.stride()}; pass .contiguous() ones.")
        tensors.update(shared_gate_up=gu_s, shared_down=down_s, shared_gate=shared_gate)
    wrong = {name: t.dtype for name, t in tensors.items() if t.dtype != x.dtype}
    if wrong:
        raise ValueError(f"moe_experts needs every float input in x's dtype ({x.dtype}), got {wrong}; cast them.")
    if not (gate_up.is_contiguous() and down.is_contiguous()):
        raise ValueError(f"moe_experts needs contiguous expert weights (stock's parameters are), got gate_up strides "
                         f"{gate_up.stride()} and down strides {down.stride()}; pass .contiguous() ones.")
    for name, t in (("x", x), ("weights", weights), ("ids", ids), ("shared", shared)):
        if t is not None:
            _check_last_dim_contiguous(name, t)
    _check_same_device(x=x, ids=ids, **tensors)


def moe_shared_in_slots(T: int, I: int, I_shared: int) -> bool:
    """Whether `moe_experts` runs the shared expert itself as one more slot of its GEMVs (`shared_experts`) for T
    tokens: one token (see the GEMVs' comment) and the routed experts' intermediate size. The MoE block asks here
    which projections to compute before `moe_experts` (otherwise the shared gate|up rides in its packed GEMM)."""
    return T == 1 and I == I_shared


def moe_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    shared: torch.Tensor | None = None,
    shared_gate: torch.Tensor | None = None,
    shared_experts: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The routed experts' SwiGLU MLPs weighted and summed per token, plus the gated shared expert:
    `y[t] = sum_j weights[t, j] * down[e_j] @ (silu(g) * u) + sigmoid(shared_gate[t]) * shared[t]`, with
    `g | u = gate_up[e_j] @ x[t]` and `e_j = ids[t, j]`; no host sync, no atomics (deterministic).

    Up to `_DECODE_MAX_T` (16) tokens: two GEMV launches reading only the picked experts' rows (above). More: the
    grouped GEMMs of `fused_ops_moe_gemm.moe_experts_prefill` (tokens sorted by expert). One decision point, here.
    Rounding: each linear's output and the SwiGLU are rounded to x.dtype where stock rounds them; the weighted sum of
    a token's k experts and the shared expert's gated add are done in float32 and rounded once (stock rounds each
    product and each add: this is at least as accurate).

    Args:
        x: [T, H] tokens, float32 / bfloat16 / float16, last dim contiguous (any row stride).
        gate_up: [E, 2*I, H] contiguous, each expert's gate rows then up rows (stock `experts.gate_up_proj`).
        down: [E, H, I] contiguous (stock `experts.down_proj`).
        weights: [T, k] routing weights in x.dtype (`moe_route`).
        ids: [T, k] int64 / int32 experts of the weights; an id outside [0, E) (an expert-parallel sentinel)
            contributes nothing. Not checked on the host: that would need a sync.
        shared: optional [T, H], the shared expert's output (stock `shared_expert(x)`), last dim contiguous.
        shared_gate: [T, 1] with `shared` or `shared_experts`, the shared expert's gate logit (stock
            `shared_expert_gate(x)`), last dim contiguous.
        shared_experts: optional, instead of `shared`: the shared expert's weights (gate_up [2*I_s, H], its gate
            rows then up rows; down [H, I_s]), both contiguous; computed here as stock's `shared_expert(x)`, as one
            more slot of the decode GEMVs where `moe_shared_in_slots` says so.

    Returns:
        y [T, H] contiguous in x.dtype; replaces stock `Qwen3_5MoeExperts.forward` (every experts implementation)
        and the shared-expert sum of `Qwen3_5MoeSparseMoeBlock.forward`.
    """
    _check_triton("moe_experts")
    _check_experts(x, gate_up, down, weights, ids, shared, shared_gate, shared_experts)
    T = x.shape[0]
    if T == 0:
        return torch.empty_like(x, memory_format=torch.contiguous_format)
    if shared_experts is not None and not moe_shared_in_slots(T, down.shape[2], shared_experts[1].shape[1]):
        gu_s, down_s = shared_experts  # stock's shared expert: its linears rounded, the SwiGLU between them
        shared, shared_experts = F.linear(swiglu(F.linear(x, gu_s)), down_s), None
    if T <= _DECODE_MAX_T:
        return _moe_experts_decode(x, gate_up, down, weights, ids, shared, shared_gate, shared_experts)
    return moe_experts_prefill(x, gate_up, down, weights, ids, shared, shared_gate)


def _check_routing(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> None:
    if x.dim() != 2 or weights.dim() != 2 or ids.shape != weights.shape or ids.shape[0] != x.shape[0]:
        raise ValueError(f"moe_experts needs x [T, H], weights [T, k] and ids [T, k], got {tuple(x.shape)}, "
                         f"{tuple(weights.shape)} and {tuple(ids.shape)}.")


def moe_experts_ref(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    shared: torch.Tensor | None = None,
    shared_gate: torch.Tensor | None = None,
    shared_experts: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Plain-torch `moe_experts`, as stock `Qwen3_5MoeExperts.forward` (the eager loop over the experts hit, in
    ascending expert order, each product rounded to x.dtype) and the shared-expert sum of
    `Qwen3_5MoeSparseMoeBlock.forward`.

    Args:
        x: [T, H] tokens.
        gate_up: [E, 2*I, H] each expert's gate and up projections (stock `experts.gate_up_proj`).
        down: [E, H, I] each expert's down projection (stock `experts.down_proj`).
        weights: [T, k] routing weights (`moe_route`), in x.dtype.
        ids: [T, k] expert of each weight, integer; an id outside [0, E) adds nothing (as in `moe_experts`).
        shared: optional [T, H], the shared expert's output (stock `shared_expert(x)`).
        shared_gate: [T, 1] with `shared` or `shared_experts`, the shared expert's gate logit (stock
            `shared_expert_gate(x)`).
        shared_experts: optional, instead of `shared`: (gate_up [2*I_s, H], down [H, I_s]), the shared expert's
            weights; its output is then computed as stock's `Qwen3_5MoeMLP`.

    Returns:
        y [T, H] in x.dtype: `sum_j weights[t, j] * down[e_j] @ (silu(g) * u)` with `g, u` the halves of
        `gate_up[e_j] @ x[t]`, plus `sigmoid(shared_gate) * shared` when given.
    """
    _check_routing(x, weights, ids)
    if shared_experts is not None:
        gate, up = F.linear(x, shared_experts[0]).chunk(2, dim=-1)
        shared = F.linear(F.silu(gate) * up, shared_experts[1])
    if (shared is None) != (shared_gate is None):
        raise ValueError("moe_experts takes shared_gate with shared or shared_experts, and only with them.")
    y = torch.zeros_like(x)
    for e in torch.unique(ids).tolist():  # sorted ascending, as stock's `expert_hit`
        if not 0 <= e < gate_up.shape[0]:  # a sentinel id adds nothing (stock skips id E; the kernels any outside)
            continue
        token, slot = torch.where(ids == e)
        gate, up = torch.nn.functional.linear(x[token], gate_up[e]).chunk(2, dim=-1)
        h = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, down[e])
        y.index_add_(0, token, (h * weights[token, slot, None]).to(y.dtype))
    if shared is not None:
        y = y + torch.sigmoid(shared_gate) * shared
    return y
