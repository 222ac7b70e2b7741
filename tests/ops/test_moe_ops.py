"""Tests of the MoE ops (`fused_ops_moe`: `moe_route`, `moe_experts`) against stock transformers' Qwen3.5-MoE block.

CPU tests run the Triton kernels under the interpreter (`TRITON_INTERPRET=1`, set in conftest.py) at tiny shapes: odd
H (40, 72), I not a power of two, T from 1 to 40 so both `moe_experts` paths run (decode up to
`fused_ops_moe._DECODE_MAX_T` = 16 tokens, the grouped GEMMs past it), experts nobody picks, an expert's rows
spanning several GEMM tiles with a partial last one, and exact ties in routing. The `@pytest.mark.cuda` tests run the
35B-A3B shape (H=2048, E=256, k=8, I=512) at T = 1, 4, 8 and 2048, and both paths inside a CUDA graph.

Reference points (stock first, STYLE.md 6):
- `moe_route` against stock `Qwen3_5MoeTopKRouter` (on an identity router weight, so its linear hands the logits
  through unchanged) and against the rule it documents (a stable descending sort: ties to the lower expert index).
  torch.topk's order of ties is unspecified, so against stock the ids are compared only where no tie decides them.
- `moe_experts` against stock `Qwen3_5MoeSparseMoeBlock` fed stock's own routing, and both against
  `moe_experts_ref` in float64 (the exact answer on the same rounded inputs). Bounds: `BOUNDS["moe_experts"]`.
"""

import functools

import pytest
import torch
import torch.nn.functional as F

from helpers import BOUNDS, assert_close, assert_exact, compile_for_sm90, fused_ops, needs_interpreter, rel_err
from scripts.common import import_module
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock, Qwen3_5MoeTopKRouter

moe = import_module("fused_ops_moe")
moe_gemm = import_module("fused_ops_moe_gemm")
KERNEL = BOUNDS["kernel"]
MOE = BOUNDS["moe_experts"]


@pytest.fixture(autouse=True)
def _needs_triton():
    if not fused_ops.HAS_TRITON:
        pytest.skip("triton is not installed")


@functools.lru_cache(maxsize=2)
def stock_block(E, k, H, I, dtype, device, shared_I=None, impl="eager", seed=0):
    """Stock `Qwen3_5MoeSparseMoeBlock` with random weights (each matrix ~ N(0, 1/fan_in)), in eval mode, built on
    `device` (the 35B-A3B block is 0.8 G parameters); the last two are kept for the next test."""
    cfg = Qwen3_5MoeTextConfig(hidden_size=H, num_experts=E, num_experts_per_tok=k, moe_intermediate_size=I,
                               shared_expert_intermediate_size=shared_I or I)
    cfg._experts_implementation = impl
    torch.manual_seed(seed)
    with torch.device(device):
        block = Qwen3_5MoeSparseMoeBlock(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, p.shape[-1] ** -0.5)
    return block.to(dtype=dtype).eval().requires_grad_(False)


def block_inputs(block, x):
    """What the fused block hands `moe_experts`, from stock's modules: (weights, ids) from stock's router, the
    shared expert's output and its gate logit."""
    with torch.no_grad():
        _, weights, ids = block.gate(x)
        return weights, ids, block.shared_expert(x), block.shared_expert_gate(x)


def truth(x, block, weights, ids, shared, shared_gate):
    """`moe_experts_ref` in float64 on the same (rounded) inputs: the exact answer both ours and stock approximate."""
    d = torch.float64
    ex = block.experts
    return fused_ops.moe_experts_ref(x.to(d), ex.gate_up_proj.to(d), ex.down_proj.to(d), weights.to(d), ids,
                                     None if shared is None else shared.to(d),
                                     None if shared_gate is None else shared_gate.to(d))


def shared_weights(block):
    """The shared expert's weights as `moe_experts(shared_experts=...)` takes them: (gate|up [2*I_s, H], down)."""
    se = block.shared_expert
    return torch.cat([se.gate_proj.weight, se.up_proj.weight]).detach(), se.down_proj.weight.detach()


def check_experts_vs_stock(device, dtype, T, E, k, H, I, shared=True, row_pad=0, seed=0, shared_I=None):
    """Ours on stock's routing against stock's block: within `MOE` of stock in float32; in bf16 / fp16 no further
    from the float64 answer than `MOE_OVER_STOCK` times stock's own distance from it. `shared`: True hands
    `moe_experts` the shared expert's output, "weights" its weights (`shared_experts`), False neither."""
    block = stock_block(E, k, H, I, dtype, device, seed=seed, shared_I=shared_I)
    buf = torch.randn(T, H + row_pad, device=device).to(dtype)
    x = buf[:, :H]  # row stride H + row_pad
    weights, ids, s, sg = block_inputs(block, x)
    if not shared:
        s = sg = None
    with torch.no_grad():
        y_stock = block(x.contiguous().unsqueeze(0))[0] if shared else block.experts(x, ids, weights)
    if shared == "weights":
        y = fused_ops.moe_experts(x, block.experts.gate_up_proj, block.experts.down_proj, weights, ids,
                                  shared_gate=sg, shared_experts=shared_weights(block))
    else:
        y = fused_ops.moe_experts(x, block.experts.gate_up_proj, block.experts.down_proj, weights, ids, s, sg)
    assert y.is_contiguous()
    assert_close("y vs stock block", y, y_stock, MOE)
    assert_no_worse_than_stock(y, y_stock, truth(x, block, weights, ids, s, sg))
    return y


def assert_no_worse_than_stock(y, y_stock, exact):
    """In bf16 / fp16, ours is at most `MOE_OVER_STOCK` times further from the float64 answer than stock is; in
    float32, within `MOE` of it."""
    err, err_stock = rel_err(y, exact), rel_err(y_stock, exact)
    if y.dtype == torch.float32:
        assert err <= MOE[torch.float32], f"ours {err:.3g} from float64"
        return
    assert err_stock > 0, "stock's rounding error should be measurable in half precision"
    factor = MOE_OVER_STOCK[y.dtype]
    assert err <= factor * err_stock, f"ours {err:.3g} from float64 > {factor} x stock's {err_stock:.3g}"


# How much further from the float64 answer than stock ours may be in half precision (rel_err ratio). Ours rounds
# where stock rounds up to each expert's down linear, then sums a token's experts and the shared expert in float32
# and rounds once, where stock rounds every product and add: measured 0.63-1.04x stock's error on CPU (interpreter,
# `EXPERT_CASES` in bf16 and fp16, two seeds; the 1.04 at T=1, H=40, where 40 outputs make the ratio noisy); 1.25
# leaves room for a GPU's other summation order, while a lost expert or a missed shared term is off by >= 10x.
MOE_OVER_STOCK = {torch.bfloat16: 1.25, torch.float16: 1.25}


# ---------------------------------------------------------------------------------------------------------------------
# moe_route
# ---------------------------------------------------------------------------------------------------------------------


def route_rule(logits, k):
    """The documented rule, independently: a stable descending sort of the logits (ties to the lower index), the
    float32 softmax's values there, renormalised."""
    order = torch.sort(logits.float(), dim=-1, descending=True, stable=True).indices[:, :k]
    top = torch.softmax(logits.float(), dim=-1).gather(1, order)
    return (top / top.sum(-1, keepdim=True)).to(logits.dtype), order


def stock_route(logits, k):
    """Stock `Qwen3_5MoeTopKRouter` on an identity weight: its linear returns the logits exactly."""
    E = logits.shape[1]
    router = Qwen3_5MoeTopKRouter(Qwen3_5MoeTextConfig(hidden_size=E, num_experts=E, num_experts_per_tok=k))
    router = router.to(device=logits.device, dtype=logits.dtype)
    with torch.no_grad():
        router.weight.copy_(torch.eye(E))
        out, weights, ids = router(logits)
    assert_exact("stock router linear on the identity", out, logits)
    return weights, ids


def check_route(logits, k):
    w, ids = fused_ops.moe_route(logits, k)
    assert ids.dtype == torch.int64 and w.dtype == logits.dtype and w.is_contiguous() and ids.is_contiguous()
    w_rule, ids_rule = route_rule(logits, k)
    assert_exact("ids vs the documented rule", ids, ids_rule)
    assert_close("weights vs the documented rule", w, w_rule, KERNEL)
    w_stock, ids_stock = stock_route(logits, k)
    assert_close("weights vs stock router", w, w_stock, KERNEL)
    # the same multiset of picked logits whatever the tie order; the same ids wherever no tie decides them
    picked = logits.float().gather(1, ids).sort(dim=-1).values
    assert_exact("picked logits vs stock's", picked, logits.float().gather(1, ids_stock).sort(dim=-1).values)
    ranked = logits.float().sort(dim=-1, descending=True).values[:, : min(k + 1, logits.shape[1])]
    untied = (ranked[:, 1:] != ranked[:, :-1]).all(dim=-1)
    assert_exact("ids vs stock where untied", ids[untied], ids_stock[untied])
    return w, ids


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("T, E, k", [(1, 8, 2), (7, 64, 8), (40, 60, 4), (3, 512, 10)],
                         ids=["T1-E8-k2", "T7-E64-k8", "T40-E60-k4", "T3-E512-k10"])
def test_moe_route_cpu(dtype, T, E, k):
    torch.manual_seed(0)
    check_route((torch.randn(T, E) * 2).to(dtype), k)


@needs_interpreter
def test_moe_route_exact_ties_go_to_the_lower_index():
    """Equal logits: all equal (the top k are experts 0..k-1), three equal maxima, a tie across the k-th place, a
    tie inside the top k, logits whose probabilities underflow to 0; the weights of tied experts are equal."""
    E, k = 16, 4
    logits = torch.randn(6, E)
    logits[0] = 0.0
    logits[1] = -1.0
    logits[1, [3, 9, 12]] = 2.0
    logits[2] = torch.arange(E, dtype=torch.float32) / E
    logits[2, [1, 5, 13]] = 5.0  # three above the rest, then a tie of two for the 4th place
    logits[2, [2, 7]] = 4.0
    logits[3, [4, 6]] = 9.0  # tied first place, then distinct
    logits[4] = -1e30  # (not -inf: stock's identity linear would make -inf * 0 a NaN)
    logits[4, 11] = 0.0  # one logit that counts: the other picks have probability 0, lowest indices first
    logits[5, :] = 1.0
    logits[5, 15] = 1.5
    w, ids = check_route(logits, k)
    assert ids[0].tolist() == [0, 1, 2, 3] and torch.equal(w[0], torch.full((k,), 0.25))
    assert ids[1, :3].tolist() == [3, 9, 12] and w[1, 0] == w[1, 1] == w[1, 2]
    assert ids[2].tolist() == [1, 5, 13, 2]
    assert ids[3, :2].tolist() == [4, 6] and w[3, 0] == w[3, 1]
    assert ids[4].tolist() == [11, 0, 1, 2] and w[4].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert ids[5].tolist() == [15, 0, 1, 2]
    wb, idsb = check_route(logits.bfloat16(), k)  # bf16 logits: the same picks
    assert torch.equal(idsb, ids)


# ---------------------------------------------------------------------------------------------------------------------
# moe_experts
# ---------------------------------------------------------------------------------------------------------------------

# (T, E, k, H, I): decode (T <= 16) and prefill (T > 16) at two expert counts; odd H, I not a power of two
EXPERT_CASES = [(1, 8, 2, 40, 24), (5, 8, 2, 40, 24), (16, 8, 2, 40, 24), (17, 8, 2, 40, 24), (40, 8, 2, 40, 24),
                (1, 64, 8, 72, 48), (3, 64, 8, 72, 48), (33, 64, 8, 72, 48)]
EXPERT_IDS = ["decode-T1-E8k2", "decode-T5-E8k2", "decode-T16-E8k2", "prefill-T17-E8k2", "prefill-T40-E8k2",
              "decode-T1-E64k8", "decode-T3-E64k8", "prefill-T33-E64k8"]


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T, E, k, H, I", EXPERT_CASES, ids=EXPERT_IDS)
def test_moe_experts_cpu(dtype, T, E, k, H, I):
    check_experts_vs_stock("cpu", dtype, T, E, k, H, I, row_pad=8 if T % 2 else 0)


@needs_interpreter
@pytest.mark.parametrize("T", [3, 24], ids=["decode-T3", "prefill-T24"])
def test_moe_experts_fp16_and_without_shared(T):
    check_experts_vs_stock("cpu", torch.float16, T, 8, 2, 40, 24)
    check_experts_vs_stock("cpu", torch.float32, T, 8, 2, 40, 24, shared=False)
    check_experts_vs_stock("cpu", torch.bfloat16, T, 8, 2, 40, 24, shared=False)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T, E, k, H, I, I_s", [(1, 8, 2, 40, 24, 24), (1, 64, 8, 72, 48, 48), (3, 64, 8, 72, 48, 48),
                                                (16, 8, 2, 40, 24, 24), (17, 8, 2, 40, 24, 24), (1, 8, 2, 40, 24, 40)],
                         ids=["slot-T1-E8k2", "slot-T1-E64k8", "decode-T3-E64k8", "decode-T16", "prefill-T17",
                              "decode-I_s-wider"])
def test_moe_experts_shared_expert_by_its_weights(dtype, T, E, k, H, I, I_s):
    """`shared_experts`: the shared expert run inside `moe_experts`, as one more GEMV slot for one token
    (`moe_shared_in_slots`), computed before the kernels otherwise (T > 1, or I_s != I): stock's block either way."""
    assert fused_ops.moe_shared_in_slots(T, I, I_s) == (T == 1 and I == I_s)
    check_experts_vs_stock("cpu", dtype, T, E, k, H, I, shared="weights", row_pad=8 if T % 2 else 0, shared_I=I_s)


def _skewed(T, E, k, hot, seed=0):
    """(weights, ids) where every token picks expert `hot` in slot 0 and k - 1 distinct others out of three; the
    other experts get nothing."""
    g = torch.Generator().manual_seed(seed)
    others = torch.tensor([e for e in (1, E // 2, E - 1) if e != hot][:3])
    ids = torch.stack([torch.cat([torch.tensor([hot]), others[torch.randperm(len(others), generator=g)[: k - 1]]])
                       for _ in range(T)])
    return torch.softmax(torch.randn(T, k, generator=g), -1), ids


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_moe_experts_expert_rows_over_several_tiles(monkeypatch, dtype):
    """BLOCK_M = 16 and 37 tokens all on one expert: its rows take three tiles, the last partly empty; most other
    experts are empty; the expert count (12) is not a power of two."""
    monkeypatch.setattr(moe_gemm, "_GATE_UP_TILES", (16, 16, 32, 4, 1))
    monkeypatch.setattr(moe_gemm, "_DOWN_TILES", (16, 16, 32, 4, 1))
    T, E, k, H, I = 37, 12, 3, 40, 24
    torch.manual_seed(0)
    block = stock_block(E, k, H, I, dtype, "cpu")
    x = torch.randn(T, H).to(dtype)
    w, ids = _skewed(T, E, k, hot=5)
    w = w.to(dtype)
    assert (ids == 5).sum() == T and len(torch.unique(ids)) < E
    s, sg = block.shared_expert(x).detach(), block.shared_expert_gate(x).detach()
    y = fused_ops.moe_experts(x, block.experts.gate_up_proj, block.experts.down_proj, w, ids, s, sg)
    with torch.no_grad():
        y_stock = block.experts(x, ids, w) + torch.sigmoid(sg) * s
    assert_close("y vs stock experts + shared", y, y_stock, MOE)
    assert_no_worse_than_stock(y, y_stock, truth(x, block, w, ids, s, sg))


@needs_interpreter
@pytest.mark.parametrize("T, E, k", [(40, 8, 2), (300, 64, 8), (7, 12, 3)], ids=["T40-E8k2", "T300-E64k8", "T7-E12k3"])
def test_moe_sort_is_torch_stable_sort_by_expert(monkeypatch, T, E, k):
    """The prefill's counting sort against `torch.sort(stable=True)` + `searchsorted`: the same order and bounds,
    across several of its P-blocks (block lowered to 64), with ids outside [0, E) that sort to either end (their
    own entries are not part of the result)."""
    monkeypatch.setattr(moe_gemm, "_SORT_BLOCK_P", 64)
    g = torch.Generator().manual_seed(T)
    ids = torch.randint(0, E, (T, k), generator=g)
    ids[0, 0], ids[T // 2, k - 1], ids[T - 1, 0] = -1, E, E + 3
    order, bounds = moe_gemm._sort_pairs(ids, E)
    flat = ids.flatten()
    sorted_ids, ref = torch.sort(flat, stable=True)
    ref_bounds = torch.searchsorted(sorted_ids, torch.arange(E + 1))
    assert_exact("bounds", bounds, ref_bounds)
    assert_exact("order inside [0, E)", order[bounds[0] : bounds[E]], ref[ref_bounds[0] : ref_bounds[E]])


@needs_interpreter
@pytest.mark.parametrize("T", [4, 20], ids=["decode-T4", "prefill-T20"])
def test_moe_experts_ids_outside_the_experts_add_nothing(T):
    """An id outside [0, E) (an expert-parallel sentinel, -1 or E) adds nothing; nothing checks ids on the host."""
    E, k, H, I = 8, 2, 40, 24
    block = stock_block(E, k, H, I, torch.float32, "cpu")
    x = torch.randn(T, H)
    w, ids, _, _ = block_inputs(block, x)
    ids = ids.clone()
    ids[0, 1], ids[T - 1, 0] = -1, E
    y = fused_ops.moe_experts(x, block.experts.gate_up_proj, block.experts.down_proj, w, ids)
    keep = (ids >= 0) & (ids < E)
    gate_up, down = block.experts.gate_up_proj.detach(), block.experts.down_proj.detach()
    want = fused_ops.moe_experts_ref(x, gate_up, down, w * keep, ids.clamp(0, E - 1))
    assert_close("y vs ref with the sentinels' weights zeroed", y, want, MOE)
    # the reference skips the sentinels as the kernels do (stock's loop skips id E the same way)
    assert_close("ref with sentinels", fused_ops.moe_experts_ref(x, gate_up, down, w, ids), want, MOE)


@needs_interpreter
def test_moe_experts_both_paths_agree_at_the_switch():
    """The first 16 tokens of a 17-token call (grouped GEMMs) and the same 16 alone (GEMVs): the same roundings,
    so at most a rounding flip apart; and int32 ids give the same result as int64."""
    E, k, H, I = 8, 2, 40, 24
    block = stock_block(E, k, H, I, torch.bfloat16, "cpu")
    x = torch.randn(17, H).bfloat16()
    w, ids, s, sg = block_inputs(block, x)
    args = (block.experts.gate_up_proj, block.experts.down_proj)
    y17 = fused_ops.moe_experts(x, *args, w, ids, s, sg)
    y16 = fused_ops.moe_experts(x[:16], *args, w[:16], ids[:16], s[:16], sg[:16])
    assert_close("decode vs prefill path", y16, y17[:16], KERNEL)
    assert_exact("int32 ids, prefill", fused_ops.moe_experts(x, *args, w, ids.int(), s, sg), y17)
    assert_exact("int32 ids, decode", fused_ops.moe_experts(x[:16], *args, w[:16], ids[:16].int(), s[:16], sg[:16]),
                 y16)


def test_moe_empty_inputs():
    E, k, H, I = 8, 2, 40, 24
    w, ids = fused_ops.moe_route(torch.randn(0, E), k)
    assert w.shape == ids.shape == (0, k)
    y = fused_ops.moe_experts(torch.randn(0, H), torch.randn(E, 2 * I, H), torch.randn(E, H, I), w, ids)
    assert y.shape == (0, H)


_E, _K, _H, _I = 8, 2, 16, 12


def _experts(T=3, x=None, gate_up=None, down=None, weights=None, ids=None, shared=None, shared_gate=None,
             shared_experts=None):
    x = torch.randn(T, _H) if x is None else x
    return fused_ops.moe_experts(
        x, torch.randn(_E, 2 * _I, _H) if gate_up is None else gate_up,
        torch.randn(_E, _H, _I) if down is None else down,
        torch.rand(x.shape[0], _K) if weights is None else weights,
        torch.zeros(x.shape[0], _K, dtype=torch.long) if ids is None else ids, shared, shared_gate,
        shared_experts=shared_experts)


_SHARED_W = (torch.randn(2 * _I, _H), torch.randn(_H, _I))


BAD_INPUTS = {
    "route-3d": (lambda: fused_ops.moe_route(torch.randn(1, 2, 8), 2), "logits \\[T, E\\]"),
    "route-E-over-512": (lambda: fused_ops.moe_route(torch.randn(2, 513), 2), "E <= 512"),
    "route-k-over-E": (lambda: fused_ops.moe_route(torch.randn(2, 8), 9), "top_k <= min"),
    "route-k-0": (lambda: fused_ops.moe_route(torch.randn(2, 8), 0), "top_k=0"),
    "route-k-over-16": (lambda: fused_ops.moe_route(torch.randn(2, 64), 17), "moe_route_ref for more"),
    "route-fp64": (lambda: fused_ops.moe_route(torch.randn(2, 8).double(), 2), "logits must be float32"),
    "route-strided": (lambda: fused_ops.moe_route(torch.randn(8, 2).t(), 2), "contiguous last dim"),
    "x-3d": (lambda: _experts(x=torch.randn(1, 3, _H)), "x \\[T, H\\]"),
    "gate-up-shape": (lambda: _experts(gate_up=torch.randn(_E, 2 * _I + 2, _H)), "gate_up must be"),
    "down-experts": (lambda: _experts(down=torch.randn(_E + 1, _H, _I)), "gate_up must be"),
    "weights-T": (lambda: _experts(weights=torch.rand(4, _K)), "weights \\[T, k\\]"),
    "ids-shape": (lambda: _experts(ids=torch.zeros(3, _K + 1, dtype=torch.long)), "ids \\[T, k\\]"),
    "ids-float": (lambda: _experts(ids=torch.zeros(3, _K)), "int64 or int32 ids"),
    "weights-dtype": (lambda: _experts(weights=torch.rand(3, _K).half()), "x's dtype"),
    "down-dtype": (lambda: _experts(down=torch.randn(_E, _H, _I).bfloat16()), "x's dtype"),
    "shared-alone": (lambda: _experts(shared=torch.randn(3, _H)), "shared_gate with shared or shared_experts"),
    "shared-weights-alone": (lambda: _experts(shared_experts=_SHARED_W), "shared_gate with shared or shared_experts"),
    "shared-both": (lambda: _experts(shared=torch.randn(3, _H), shared_gate=torch.randn(3, 1),
                                     shared_experts=_SHARED_W), "not both"),
    "shared-weights-shape": (lambda: _experts(shared_gate=torch.randn(3, 1),
                                              shared_experts=(_SHARED_W[0], _SHARED_W[1][:, :5])),
                             "down \\[H, I_s\\]\\) with H = 16, got \\(24, 16\\) and \\(16, 5\\)"),
    "shared-weights-strided": (lambda: _experts(shared_gate=torch.randn(3, 1),
                                                shared_experts=(_SHARED_W[0].t().contiguous().t(), _SHARED_W[1])),
                               "contiguous shared-expert weights"),
    "shared-shape": (lambda: _experts(shared=torch.randn(3, _H + 1), shared_gate=torch.randn(3, 1)),
                     "shared \\[T, H\\]"),
    "gate-up-strided": (lambda: _experts(gate_up=torch.randn(_E, _H, 2 * _I).transpose(1, 2)), "contiguous expert"),
    "x-strided": (lambda: _experts(x=torch.randn(_H, 3).t()), "contiguous last dim"),
    "device": (lambda: _experts(down=torch.randn(_E, _H, _I, device="meta")), "one device"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_rejects_bad_inputs(case):
    call, match = BAD_INPUTS[case]
    with pytest.raises(ValueError, match=match):
        call()


_SM90_CALLS = r"""
import torch
fused_ops_moe, fused_ops_moe_gemm = import_module("fused_ops_moe"), import_module("fused_ops_moe_gemm")
compile_(fused_ops_moe._moe_route_kernel, dict(l_ptr="*bf16", w_ptr="*bf16", i_ptr="*i64"),
         dict(TOP_K=8, BLOCK_T=1, BLOCK_E=256, BLOCK_K=8), 1)
gu_n, gu_k, gu_w, gu_u = fused_ops_moe._DECODE_GATE_UP
compile_(fused_ops_moe._moe_gate_up_gemv_kernel, dict(x_ptr="*bf16", w_ptr="*bf16", ws_ptr="*bf16", ids_ptr="*i64",
         h_ptr="*bf16"), dict(TOP_K=8, SLOTS=9, BLOCK_N=gu_n, BLOCK_K=gu_k, UNROLL=gu_u), gu_w)
for T, slots, shared in ((1, 9, fused_ops_moe._SHARED_WEIGHTS), (8, 8, fused_ops_moe._SHARED_OUTPUT)):
    dn_n, dn_k, dn_w, dn_u = fused_ops_moe._decode_down_config(T)
    compile_(fused_ops_moe._moe_down_gemv_kernel, dict(h_ptr="*bf16", w_ptr="*bf16", ws_ptr="*bf16",
             wt_ptr="*bf16", ids_ptr="*i64", s_ptr="*bf16", sg_ptr="*bf16", y_ptr="*bf16"),
             dict(TOP_K=8, SLOTS=slots, SHARED=shared, BLOCK_J=8, BLOCK_N=dn_n, BLOCK_K=dn_k, UNROLL=dn_u), dn_w)
g = fused_ops_moe_gemm
for dt, torch_dt, prec in (("bf16", torch.bfloat16, "tf32"), ("fp32", torch.float32, "ieee")):
    for kernel, tiles, N, K, out in ((g._moe_gate_up_gemm_kernel, g._GATE_UP_TILES, 512, 2048, "h_ptr"),
                                     (g._moe_down_gemm_kernel, g._DOWN_TILES, 2048, 512, "d_ptr")):
        bm, bn, bk, warps, stages = g._fit_tiles(tiles, N, K, torch_dt)
        consts = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, BLOCK_E=256, PRECISION=prec, DOT_F32=False)
        if kernel is g._moe_gate_up_gemm_kernel:
            consts["TOP_K"] = 8
        compile_(kernel, {"x_ptr" if out == "h_ptr" else "h_ptr": "*" + dt, "w_ptr": "*" + dt, "order_ptr": "*i64",
                 "bounds_ptr": "*i64", "tile_end_ptr": "*i32", out: "*" + dt}, consts, warps, stages)
compile_(g._moe_sort_kernel, dict(ids_ptr="*i64", order_ptr="*i64", bounds_ptr="*i64"),
         dict(BLOCK_P=g._SORT_BLOCK_P), 4)
compile_(g._moe_combine_kernel, dict(d_ptr="*bf16", wt_ptr="*bf16", ids_ptr="*i64", s_ptr="*bf16", sg_ptr="*bf16",
         y_ptr="*bf16"), dict(TOP_K=8, SHARED=True, BLOCK_T=4, BLOCK_N=1024), 4)
"""


def test_moe_kernels_compile_for_sm90():
    """Every MoE kernel at the 35B-A3B shape's launch constants, as the H200 compiles them (with PDL); the GEMMs in
    bf16 and in IEEE float32."""
    assert compile_for_sm90(_SM90_CALLS) == 10


# ---------------------------------------------------------------------------------------------------------------------
# CUDA tests: the 35B-A3B shape (H=2048, E=256, k=8, I=512, shared expert 512)
# ---------------------------------------------------------------------------------------------------------------------

REAL = dict(E=256, k=8, H=2048, I=512)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("T", [1, 4, 8, 16, 17, 2048], ids=lambda t: f"T{t}")
def test_moe_experts_cuda(dtype, T):
    check_experts_vs_stock("cuda", dtype, T, **REAL, row_pad=64 if T == 4 else 0)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T", [1, 8, 16, 2048], ids=lambda t: f"T{t}")
def test_moe_experts_shared_expert_by_its_weights_cuda(dtype, T):
    check_experts_vs_stock("cuda", dtype, T, **REAL, shared="weights")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T", [1, 8, 2048], ids=lambda t: f"T{t}")
def test_moe_route_cuda(dtype, T):
    torch.manual_seed(0)
    check_route(torch.randn(T, REAL["E"], device="cuda").to(dtype), REAL["k"])
    logits = torch.zeros(T, REAL["E"], device="cuda", dtype=dtype)  # every logit tied
    _, ids = fused_ops.moe_route(logits, REAL["k"])
    assert (ids == torch.arange(REAL["k"], device="cuda")).all()


@pytest.mark.cuda
@pytest.mark.parametrize("T", [1, 8, 2048], ids=lambda t: f"T{t}")
def test_moe_block_in_a_cuda_graph_is_deterministic(T):
    """Route + experts captured in a CUDA graph (a host sync or an allocation-order dependence fails the capture or
    the replay), replayed on new inputs: equal to an eager call, bit for bit, and two replays bit-equal; with the
    shared expert's output handed over, and with its weights (a GEMV slot at T = 1)."""
    E, k, H, I = REAL.values()
    block = stock_block(E, k, H, I, torch.bfloat16, "cuda")
    gu, dn = block.experts.gate_up_proj.detach(), block.experts.down_proj.detach()
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    logits = F.linear(x, block.gate.weight.detach())
    s, sg = torch.randn_like(x), torch.randn(T, 1, device="cuda", dtype=torch.bfloat16)

    shared_w = shared_weights(block)

    def step():
        w, ids = fused_ops.moe_route(logits, k)
        return (fused_ops.moe_experts(x, gu, dn, w, ids, s, sg),
                fused_ops.moe_experts(x, gu, dn, w, ids, shared_gate=sg, shared_experts=shared_w))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compiles
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = step()
    for buf in (x, logits, s, sg):
        buf.copy_(torch.randn_like(buf))
    graph.replay()
    first = [t.clone() for t in y]
    graph.replay()
    eager = step()
    w, ids = fused_ops.moe_route_ref(logits, k)
    with torch.no_grad():
        routed = block.experts(x, ids, w)
        stock = (routed + torch.sigmoid(sg) * s, routed + torch.sigmoid(sg) * block.shared_expert(x))
    for name, out, ref, again, y_stock in zip(("shared output", "shared weights"), y, first, eager, stock):
        assert_exact(f"two replays, {name}", out, ref)
        assert_exact(f"replay vs eager, {name}", ref, again)
        assert_close(f"replay vs stock, {name}", ref, y_stock, MOE)
