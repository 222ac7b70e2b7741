"""The differential search against stock (scripts/fuzz_vs_stock.py): a fixed-seed slice of it passes (CPU emulation
here; the GPU path among the CUDA tests), and a fault planted in the fused path is found, shrunk and printed as a
command that reproduces it."""

import json
import random
from pathlib import Path

import pytest
import torch

import helpers
from helpers import plan_mod
from scripts import fuzz_vs_stock as fuzz

# CI's slice: short inputs (every edge up to 321 tokens), all three dtypes, dense and MoE, every call kind; ~30 s on
# one CPU core. The GPU slice runs minutes.
CPU_CASES, CPU_MAX_LEN = 40, 321


@pytest.fixture(autouse=True)
def _restore_emulation():
    yield
    plan_mod.EMULATE_ON_CPU = False


def test_a_fixed_seed_slice_finds_nothing_on_the_cpu_emulation():
    out = fuzz.search(seed=2026, device="cpu", cases=CPU_CASES, max_len=CPU_MAX_LEN, shrink_budget=0,
                      log=lambda *_: None)
    assert out["cases"] == CPU_CASES
    assert not out["failures"], [f["failures"][0] + "\n" + f["command"] for f in out["failures"]]
    assert "length mod 64" in out["coverage"]


def test_a_planted_fault_is_found_shrunk_and_replayed(monkeypatch):
    """The fused RMSNorm made wrong at one position only (the last of each row), as issue 43's symptom was: the
    search reports it, shrinks it to a smaller case that still fails the same check, and its replay command fails."""
    ops = plan_mod.REFERENCES
    good = ops.rms_norm

    def last_position_off(x, weight, eps, residual=None):
        out = good(x, weight, eps, residual=residual)
        y = out[0] if isinstance(out, tuple) else out
        if y.dim() == 3 and y.shape[1] > 1:
            y[:, -1] = y[:, -1] * 1.01
        return out

    monkeypatch.setattr(ops, "rms_norm", last_position_off)
    out = fuzz.search(seed=5, device="cpu", cases=3, dtypes=("fp32",), moe=0.0, max_len=96,
                      kinds=("forward",), shrink_budget=6, log=lambda *_: None)
    assert out["failures"], "the planted fault was not found"
    found = out["failures"][0]
    assert "logits" in found["failures"][0]
    small = found["shrunk"]
    assert small["config"]["num_hidden_layers"] <= found["case"]["config"]["num_hidden_layers"]
    replay = json.loads(found["command"].split("--replay ", 1)[1].strip("'"))
    assert replay == small and fuzz.run_case(replay), "the printed command does not reproduce the failure"


def test_cases_are_drawn_from_their_seed_alone():
    a = fuzz.draw_case(123, "cpu")
    assert a == fuzz.draw_case(123, "cpu") and a != fuzz.draw_case(124, "cpu")
    lengths = [fuzz.draw_case(s, "cpu")["call"]["length"] for s in range(300)]
    assert {64, 65, 63, 129, 257} <= set(lengths)  # the edges are drawn
    kinds = {fuzz.draw_case(s, "cpu")["call"]["kind"] for s in range(300)}
    assert kinds == set(fuzz.CALL_KINDS)
    for s in range(50):  # every drawn config is a valid stock config
        case = fuzz.draw_case(s, "cpu")
        assert "full_attention" in case["config"]["layer_types"]
        assert case["config"]["num_attention_heads"] % case["config"]["num_key_value_heads"] == 0


def test_a_config_pool_varies_everything_but_the_config():
    pool = fuzz.config_pool(4, moe=0.5)
    assert pool == fuzz.config_pool(4, moe=0.5)  # fixed: the same kernels compile in every run
    cases = [fuzz.draw_case(s, "cuda", pool=pool) for s in range(40)]
    assert {json.dumps(c["config"], sort_keys=True) for c in cases} == {json.dumps(c, sort_keys=True)
                                                                       for _, c in pool}
    assert len({(c["call"]["kind"], c["call"]["length"], c["dtype"]) for c in cases}) > 20


def test_tokens_may_part_only_at_a_near_tie_where_the_logits_pass():
    """Fused chose 7 where stock chose 8: a failure unless that step's logits pass and 7 is within the rounding at
    hand of stock's best (so a wrong token from a right forward, a fault in the decode loop, is caught)."""
    got, want = torch.tensor([[5, 6, 7]]), torch.tensor([[5, 6, 8]])
    logits = torch.randn(1, 1, 32)
    tie = logits.clone()
    tie[0, 0, 8], tie[0, 0, 7] = 6.0, 6.0 - 2e-3  # stock's best two, 2e-3 apart
    swapped = tie.clone()
    swapped[0, 0, 7] += 4e-3  # within the bf16 bound of stock's logits, and enough to swap its two best
    answer = tie.clone()
    answer[0, 0, 8] -= 3e-3  # stock's own bf16 error: the float32 answer has 7 first
    far = tie.clone()
    far[0, 0, 7] = 0.0
    for dtype, steps, parts in (
        ("bf16", (swapped, tie, answer), False),  # a near-tie within the rounding
        ("bf16", (tie * 2, tie, tie), True),  # the logits fail
        ("bf16", (tie, tie, tie), True),  # the same logits, another token: the loop, not the forward, is wrong
        ("bf16", (far * 1.001, far, far), True),  # logits pass, but 7 is far below stock's best
        ("fp32", (tie, tie, tie), True),
    ):
        check = fuzz.Compare({"dtype": dtype}, torch.device("cpu"))
        check.tokens("t", got, want, lambda row, pos: steps)
        assert bool(check.failures) == parts, (dtype, check.failures)
    near = logits.clone()
    near[0, 0, 8], near[0, 0, 7] = 3.0, 3.0 - 1e-6
    nudged = near.clone()
    nudged[0, 0, 7] += 2e-6  # within the fp32 bound of stock's logits, and enough to swap its two best
    fp32 = fuzz.Compare({"dtype": "fp32"}, torch.device("cpu"))
    fp32.tokens("t", got, want, lambda row, pos: (nudged, near, near))
    assert not fp32.failures, fp32.failures  # an fp32 near-tie may part


GPU_CASES = 6  # the GPU slice: cases drawn from 4 pooled configs (their kernels compile once)


@pytest.mark.cuda
def test_a_fixed_seed_slice_finds_nothing_on_the_gpu():
    """A fixed count, not a time: under a loaded machine (the suite's parallel processes) a two-minute slice ran one
    case, which says nothing. Six cases: sixteen (from 8 configs) were not through in 520 s beside the suite's 15
    other processes, each 16-bit case of a new config waiting on fla's autotuning; the long search is the script's."""
    out = fuzz.search(seed=2026, device="cuda", cases=GPU_CASES, shrink_budget=4, pool=4, log=print)
    assert out["cases"] == GPU_CASES
    assert not out["failures"], [f["failures"][0] + "\n" + f["command"] for f in out["failures"]]


# What the search has found: each case stays a test, on the GPU (where it was found) and on the CPU emulation.
FOUND = json.loads((Path(__file__).with_name("fuzz_found.json")).read_text())["cases"]


def _found_id(entry) -> str:
    case = entry["case"]
    return f"{case['seed']}-{case['dtype']}-{case['call']['kind']}-T{case['call']['length']}"


@pytest.mark.cuda
@pytest.mark.parametrize("entry", FOUND, ids=_found_id)
def test_what_the_search_found_passes_on_the_gpu(entry):
    found = fuzz.run_case(dict(entry["case"], device="cuda"))
    assert not found, f"{fuzz.describe(entry['case'])} ({entry['found']}): {found[0]}"


@pytest.mark.parametrize("entry", FOUND, ids=_found_id)
def test_what_the_search_found_passes_on_the_cpu_emulation(entry):
    case = dict(entry["case"], device="cpu")
    found = fuzz.run_case(case)
    assert not found, f"{fuzz.describe(case)} ({entry['found']}): {found[0]}"


@pytest.mark.cuda
def test_the_cpu_emulation_agrees_with_the_gpu():
    out = fuzz.emulation_check(seed=7, minutes=None, cases=12, pool=4, log=print)
    assert out["cases"] == 12 and not out["differing"], out["differing"]


def test_a_router_tie_is_the_dtype_floor_or_what_stocks_own_noise_can_swap():
    """A token is at a tie in some layer where the answer's gap between its k-th and (k+1)-th expert is below the
    floor, or below ROUTER_NOISE_FACTOR (4) x stock's largest deviation from the answer's probabilities there."""
    B, T, E = 1, 4, 3
    gaps = [torch.tensor([[1e-5, 5e-3, 5e-3, 5e-3]], dtype=torch.float64),
            torch.tensor([[1.0, 1.0, 3.5e-4, 3.5e-4]], dtype=torch.float64)]
    answer = [torch.full((B * T, E), 1 / 3, dtype=torch.float64) for _ in gaps]
    stock = [a.clone() for a in answer]
    stock[1][2, 0] += 1.1e-4  # 4 x 1.1e-4 > 3.5e-4: token 2 is at a tie in layer 1
    stock[1][3, 0] += 0.8e-4  # 4 x 0.8e-4 < 3.5e-4: token 3 is not
    ties = fuzz.router_ties(gaps, stock, answer, floor=3e-4)
    assert ties.tolist() == [[True, False, True, False]]
    assert fuzz.router_ties(gaps, [], [], floor=3e-4).tolist() == [[True, False, False, False]]  # the floor alone
    assert fuzz.router_ties([torch.zeros(2), torch.zeros(3)], stock, answer, floor=3e-4) is None


def test_fp32_beyond_the_bound_is_judged_against_stocks_own_error():
    """fp32 past FP32_BOUND (an ill-conditioned case) passes only when the fused error from the float64 answer is
    at most FP32_FACTOR x stock's own, and a token at a router tie is left out of the comparison."""
    want = torch.randn(1, 4, 16, dtype=torch.float64)
    got = want.clone()
    got[0, 2] *= 1 + 1e-4  # past the fp32 bound at position 2
    answer = want.clone()
    answer[0, 2] *= 1 + 0.8e-4  # stock is as far from the exact answer: ill-conditioned there
    check = fuzz.Compare({"dtype": "fp32"}, torch.device("cpu"))
    check.values("logits", got, want, answer)
    assert not check.failures, check.failures
    check.values("logits", got, want, want)  # stock exact there: the fused error is the fused path's
    assert check.failures and "float64 answer" in check.failures[0]
    tied = fuzz.Compare({"dtype": "fp32"}, torch.device("cpu"))
    tied.ties = torch.tensor([[False, False, True, False]])
    tied.values("logits", got, want, want)
    assert not tied.failures, tied.failures
    elsewhere = fuzz.Compare({"dtype": "fp32"}, torch.device("cpu"))
    elsewhere.ties = torch.tensor([[False, True, False, False]])  # a tie elsewhere excuses nothing
    elsewhere.values("logits", got, want, want)
    assert elsewhere.failures


def test_a_token_routed_apart_at_a_tie_excuses_the_rest_of_its_row_only():
    """A tied token whose own output fails (the two paths routed it apart) moves every later token of its row
    through attention / the DeltaNet state: that row is left out from there on, in this comparison and every later
    one of the case (continued calls, cache states). Earlier positions and other rows still count."""
    want = torch.randn(2, 6, 16, dtype=torch.float64)
    answer = want.clone()
    moved = want.clone()
    moved[0, 2:] *= 1 + 3e-2  # row 0 from its tied token on
    check = fuzz.Compare({"dtype": "fp32"}, torch.device("cpu"))
    check.ties = torch.tensor([[False, False, True, False, False, False], [False] * 6])
    check.values("logits", moved, want, answer)
    assert not check.failures and check.tainted == {0}, check.failures
    state = torch.randn(2, 3, 8, dtype=torch.float64)
    check.values("layer 0 recurrent", state + torch.tensor([1.0, 0.0])[:, None, None], state, state, whole=True)
    assert not check.failures, check.failures  # row 0's state is excused, row 1's is equal
    check.values("layer 0 recurrent", state + torch.tensor([0.0, 1.0])[:, None, None], state, state, whole=True)
    assert check.failures  # row 1 is not
    for bad in ((0, 1), (1, 3)):  # before the tie, or another row: not excused
        early = fuzz.Compare({"dtype": "fp32"}, torch.device("cpu"))
        early.ties = check.ties
        got = moved.clone()
        got[bad] *= 1 + 3e-2
        early.values("logits", got, want, answer)
        assert early.failures, bad
    held = fuzz.Compare({"dtype": "fp32"}, torch.device("cpu"))  # a tied token that passes taints nothing
    held.ties = check.ties
    held.values("logits", want.clone(), want, answer)
    assert not held.failures and not held.tainted


def test_routed_apart_is_read_from_the_routers_choices(monkeypatch):
    """The experts each router picked, recorded in stock and in the fused model (CPU emulation) on the same MoE
    forward: the fused path's bucket-padded rows are matched to stock's tokens (nothing apart in fp32, where no token
    is near a tie), and one token sent elsewhere is found at its place."""
    monkeypatch.setattr(plan_mod, "EMULATE_ON_CPU", True)
    case = fuzz.draw_case(7, "cpu", dtypes=("fp32",), moe=1.0)
    case["call"] = {"kind": "forward_padded", "batch": 2, "length": 37, "padding": "right", "data_seed": 5}
    stock, fused, _ = fuzz.build_pair(case, torch.device("cpu"))
    ids, mask = fuzz.make_inputs(case["call"], case["config"]["vocab_size"], "cpu")
    stock_ids, fused_ids = [], []
    with torch.inference_mode(), fuzz.stock_reference(True):
        with fuzz.router_choices(stock, stock_ids):
            stock(input_ids=ids, attention_mask=mask)
        with fuzz.router_choices(fused, fused_ids):
            fused(input_ids=ids, attention_mask=mask)
    assert stock_ids and len(stock_ids) == len(fused_ids)
    assert fused_ids[0].shape[0] > stock_ids[0].shape[0]  # the fused rows were padded to their bucket
    assert not fuzz.routed_apart(stock_ids, fused_ids, ids.shape).any()
    moved = [f.clone() for f in fused_ids]
    B, L = ids.shape[0], moved[1].shape[0] // ids.shape[0]
    moved[1].view(B, L, -1)[1, L - ids.shape[1] + 4] += 1  # row 1, position 4, one router
    apart = fuzz.routed_apart(stock_ids, moved, ids.shape)
    assert apart.nonzero().tolist() == [[1, 4]]
    assert fuzz.routed_apart(stock_ids, moved[:-1], ids.shape).all()  # calls that cannot be matched: all


def test_a_tie_routed_apart_before_the_kept_logits_leaves_its_row_out():
    """``logits_to_keep`` hides a tied token's own output: whether it was routed apart is read from the routers. Routed
    apart, its row is left out of the kept positions (and of later comparisons); routed alike, the row counts."""
    want = torch.randn(2, 1, 16, dtype=torch.float64)
    got = want.clone()
    got[0] *= 1 + 3e-2
    ties = torch.tensor([[False, True, False, False], [False] * 4])
    for apart, fails in ((ties, False), (torch.zeros_like(ties), True)):
        check = fuzz.Compare({"dtype": "fp32"}, torch.device("cpu"))
        check.ties, check.apart = ties, apart
        check.values("logits", got, want, want)
        assert bool(check.failures) == fails, (apart, check.failures)
        assert check.tainted == (set() if fails else {0})


def test_tokens_that_part_at_a_near_tie_may_end_at_other_lengths():
    """A near-tie at which one side picks EOS ends the two at other lengths: judged at the parting, as any near-tie.
    The same tokens over the common length, but one longer, is a stopping fault."""
    logits = torch.zeros(1, 1, 16)
    logits[0, 0, 2], logits[0, 0, 7] = 3.0, 3.0 - 1e-7  # EOS (2) and 7 tied
    check = fuzz.Compare({"dtype": "fp32"}, torch.device("cpu"))
    check.tokens("t", torch.tensor([[5, 7, 9, 9]]), torch.tensor([[5, 2]]), lambda row, pos: (logits, logits, logits))
    assert not check.failures, check.failures
    check.tokens("t", torch.tensor([[5, 2, 9]]), torch.tensor([[5, 2]]), lambda row, pos: (logits, logits, logits))
    assert check.failures and "common length" in check.failures[0]


def test_the_float64_answer_is_closer_than_stocks_fp32():
    """`float64_stock` keeps stock's own float32 casts in float64: the answer differs from stock's fp32 logits by
    fp32 rounding, and from a float64 run without it (float32 inside DeltaNet and the norms)."""
    case = fuzz.draw_case(11, "cpu", dtypes=("fp32",), moe=0.0)
    case["call"] = {"kind": "forward", "batch": 1, "length": 40, "padding": None, "data_seed": 3}
    stock, _, ref = fuzz.build_pair(case, torch.device("cpu"))
    assert ref.dtype == torch.float64
    ids, _ = fuzz.make_inputs(case["call"], case["config"]["vocab_size"], "cpu")
    with torch.no_grad(), fuzz.stock_reference(True):
        with fuzz.float64_stock():
            exact = ref(input_ids=ids).logits
        loose = ref(input_ids=ids).logits
        fp32 = stock(input_ids=ids).logits
    assert exact.dtype == torch.float64
    assert 0 < fuzz.rel_err(fp32, exact) < 1e-5
    assert fuzz.rel_err(loose, exact) > 0  # without it, stock computes parts of the float64 model in float32


def test_workers_merge_their_summaries(tmp_path, capsys):
    out = tmp_path / "fuzz.json"
    rc = fuzz.main(["--device", "cpu", "--cases", "1", "--workers", "2", "--dtypes", "fp32", "--moe", "0",
                    "--max-len", "16", "--seed", "4", "--out", str(out)])
    summary = json.loads(out.read_text())
    assert rc == 0 and summary["cases"] == 2 and summary["workers"] == 2 and not summary["failures"]
    assert "2 workers" in capsys.readouterr().out


def test_the_search_covers_speculative_and_batched_generation(monkeypatch):
    """The call kinds of the two newest paths run against stock: speculative `generate` (a random MTP head whose
    drafts are partly replaced by stock's own tokens) and `generate_batch`; and a speculative loop that accepts every
    draft (right or wrong) is found, though each forward it runs is right."""
    out = fuzz.search(seed=3, device="cpu", cases=6, max_len=160, kinds=("speculative", "batch"), shrink_budget=0,
                      log=lambda *_: None)
    assert out["cases"] == 6 and not out["failures"], [f["failures"][0] for f in out["failures"]]
    spec = helpers.import_module("fused_speculative")
    good = spec.accept

    def accept_all(p_scores, drafts, q, do_sample):
        n, token = good(p_scores, drafts, q, do_sample)
        last = p_scores.shape[1] - 1
        return (last, p_scores.argmax(-1)[:, last]) if not do_sample else (n, token)

    monkeypatch.setattr(spec, "accept", accept_all)
    out = fuzz.search(seed=3, device="cpu", cases=8, max_len=160, kinds=("speculative",), shrink_budget=0,
                      log=lambda *_: None)
    assert out["failures"] and "parts from stock" in out["failures"][0]["failures"][0]


def test_bisect_ops_names_the_op_that_adds_the_error(monkeypatch):
    """A fault planted in one op (the RMSNorm) goes away only when that op runs its reference: the bisection names
    it. On CPU the emulation's namespace stands in for the kernels: a copy of the references with the fault."""
    refs = plan_mod.REFERENCES
    good = refs.rms_norm

    def off(x, weight, eps, residual=None):
        out = good(x, weight, eps, residual=residual)
        (out[0] if isinstance(out, tuple) else out).mul_(1.01)
        return out

    faulty, clean = type(refs)(**vars(refs)), type(refs)(**vars(refs))
    faulty.rms_norm = off
    monkeypatch.setattr(plan_mod, "REFERENCES", faulty)  # what the emulated plan runs
    case = fuzz.draw_case(5, "cpu", dtypes=("fp32",), moe=0.0, kinds=("forward",), max_len=40)
    out = fuzz.bisect_ops(case, log=lambda *_: None, kernels=faulty, refs=clean)
    assert out["kernels"] and out["rms_norm"] is None and out["all references"] is None, out
    assert all(out[n] for n in out if n not in ("rms_norm", "all references")), out
