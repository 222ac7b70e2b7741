"""Fused decode on the GPU (issue 4): ``generate()`` with the fused step and CUDA graphs against stock transformers.

Run on the device: `python -m pytest -m cuda -q tests/test_decode_cuda.py`. Greedy tokens must be identical to
stock in fp32 for 128 new tokens (random and trained weights, batch 1 and batch 4 with left padding) and every
step's logits within the forward bounds of ``test_model_cuda.py``; in bf16 the logits are compared up to the first
position where the two greedy sequences part (``scripts/eval_quality.py`` reports that position).
"""

from pathlib import Path

import pytest
import torch

from helpers import decode, graphs  # the repo modules these tests reach into
from helpers import cache_of, fused_ops, ieee_stock, modeling, padded_batch, rel_err, stock_and_fused_lm
from scripts.common import import_module

pytestmark = pytest.mark.cuda
REPO = Path(__file__).resolve().parents[1]
BOUND = {torch.float32: 2e-5, torch.bfloat16: 1.5e-2}


def _pair(dtype=torch.float32, **overrides):
    stock, fused = stock_and_fused_lm(dtype=torch.float32, **overrides)
    if dtype == torch.float32:
        ieee_stock(stock)
    return stock.to("cuda", dtype), fused.to("cuda", dtype)


def _trained_pair(dtype):
    from transformers import AutoModelForCausalLM

    config = modeling.Qwen3_5FusedConfig.from_pretrained(REPO)
    fused = modeling.Qwen3_5FusedForCausalLMLoader.from_pretrained(REPO, config=config, dtype=dtype)
    stock = AutoModelForCausalLM.from_pretrained(REPO, dtype=dtype)
    if dtype == torch.float32:
        ieee_stock(stock)
    return stock.to("cuda").eval(), fused.to("cuda").eval()


def _text_prompts(batch):
    """Left-padded snippets of the held-out text (different lengths), tokenized with the shipped tokenizer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(REPO, padding_side="left")
    text = (REPO / "data" / "heldout.txt").read_text()
    snippets = [text[1000 * i : 1000 * i + 60 + 25 * i] for i in range(batch)]
    enc = tok(snippets, return_tensors="pt", padding=True)
    return enc["input_ids"], enc["attention_mask"] if batch > 1 else None


def _generate(model, ids, mask, **kw):
    kw = {**dict(do_sample=False, pad_token_id=0, eos_token_id=None, return_dict_in_generate=True,
                 output_scores=True), **kw}
    with torch.inference_mode():
        return model.generate(input_ids=ids.cuda(), attention_mask=None if mask is None else mask.cuda(), **kw)


def _check_steps(a, b, bound, upto=None):
    for step, (x, y) in enumerate(zip(b.scores[:upto], a.scores[:upto])):
        assert rel_err(x.float(), y.float()) <= bound, step


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("batch,padding", [(1, None), (4, "left")], ids=["b1", "b4-left"])
def test_random_fp32_128_tokens_identical(batch, padding, graphs):
    stock, fused = _pair(torch.float32)
    fused.set_cuda_graphs(graphs)
    ids, mask = padded_batch(batch, 21, padding)
    a = _generate(stock, ids, mask, max_new_tokens=128)
    b = _generate(fused, ids, mask, max_new_tokens=128)
    assert isinstance(cache_of(b), decode.FusedDecodeCache)
    assert torch.equal(a.sequences, b.sequences)
    _check_steps(a, b, BOUND[torch.float32])
    buckets = fused.describe()["decode"]["buckets"]
    assert [bk["graph_captured"] for bk in buckets] == [graphs]


@pytest.mark.parametrize("batch", [1, 4], ids=["b1", "b4-left"])
def test_trained_fp32_128_tokens_identical(batch):
    stock, fused = _trained_pair(torch.float32)
    ids, mask = _text_prompts(batch)
    a = _generate(stock, ids, mask, max_new_tokens=128)
    b = _generate(fused, ids, mask, max_new_tokens=128)
    assert torch.equal(a.sequences, b.sequences)
    _check_steps(a, b, BOUND[torch.float32])


def test_trained_bf16_logits_within_bound_until_divergence():
    stock, fused = _trained_pair(torch.bfloat16)
    ids, mask = _text_prompts(4)
    a = _generate(stock, ids, mask, max_new_tokens=128)
    b = _generate(fused, ids, mask, max_new_tokens=128)
    new_a, new_b = a.sequences[:, ids.shape[1]:], b.sequences[:, ids.shape[1]:]
    differ = (new_a != new_b).any(0).nonzero()
    first = int(differ[0]) if len(differ) else new_a.shape[1]
    print(f"bf16 trained checkpoint, batch 4: first divergent position {first} of {new_a.shape[1]}")
    _check_steps(a, b, BOUND[torch.bfloat16], upto=first + 1)


def test_graph_replay_equals_eager_step_bf16():
    _, fused = _pair(torch.bfloat16)
    ids, mask = padded_batch(2, 9, "left")
    fused.set_cuda_graphs(False)
    eager = _generate(fused, ids, mask, max_new_tokens=40)
    fused.set_cuda_graphs(True)
    graph = _generate(fused, ids, mask, max_new_tokens=40)
    assert torch.equal(eager.sequences, graph.sequences)
    for x, y in zip(graph.scores, eager.scores):
        assert torch.equal(x, y)


def test_programmatic_dependent_launch_changes_nothing_bf16(monkeypatch):
    """With PDL (each kernel of ours may start while the one before drains, and waits on the grid dependency before
    it touches that kernel's output) the graphed step gives the scores of plain launches, bit for bit: a missing
    wait would read a half-written input. 64 tokens, batch 3, left padding, so every kernel of the step runs."""
    if not fused_ops.pdl_enabled(torch.device("cuda")):
        pytest.skip("this GPU or Triton has no programmatic dependent launch")
    _, fused = _pair(torch.bfloat16)
    ids, mask = padded_batch(3, 11, "left")
    runs = {}
    for pdl in (False, True):
        monkeypatch.setattr(import_module("fused_ops_runtime"), "PDL_ENABLED", pdl)
        fused.set_fused_kernels(False).set_fused_kernels(True)  # new graphs: PDL is a launch option, read at capture
        runs[pdl] = _generate(fused, ids, mask, max_new_tokens=64)
    assert torch.equal(runs[False].sequences, runs[True].sequences)
    for x, y in zip(runs[True].scores, runs[False].scores):
        assert torch.equal(x, y)


def test_repeated_calls_sampling_and_weight_swap():
    stock, fused = _pair(torch.float32)
    for batch, length, new in [(1, 5, 20), (3, 9, 12), (1, 30, 20), (3, 9, 12)]:
        ids, mask = padded_batch(batch, length, "left" if batch > 1 else None)
        a = _generate(stock, ids, mask, max_new_tokens=new)
        b = _generate(fused, ids, mask, max_new_tokens=new)
        assert torch.equal(a.sequences, b.sequences), (batch, length)
    ids, mask = padded_batch(3, 9, "left")
    kw = dict(max_new_tokens=16, do_sample=True, top_k=20, top_p=0.9, temperature=0.8)
    torch.manual_seed(0)
    s1 = _generate(fused, ids, mask, **kw).sequences
    torch.manual_seed(0)
    s2 = _generate(fused, ids, mask, **kw).sequences
    assert torch.equal(s1, s2)
    # a parameter replaced after capture: the graph is captured again and reads the new weights
    state = {k: v.clone() * 1.01 for k, v in stock.state_dict().items()}
    stock.load_state_dict(state)
    fused.load_state_dict(state, assign=True)
    a = _generate(stock, ids, mask, max_new_tokens=12)
    b = _generate(fused, ids, mask, max_new_tokens=12)
    assert torch.equal(a.sequences, b.sequences)
    _check_steps(a, b, BOUND[torch.float32])


def test_memory_released_on_move():
    _, fused = _pair(torch.bfloat16)
    ids, mask = padded_batch(2, 9, "left")
    _generate(fused, ids, mask, max_new_tokens=8)
    assert fused.describe()["decode"]["buckets"]
    fused.to("cpu")
    assert fused.describe()["decode"]["buckets"] == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("batch,padding,length", [(1, None, 21), (4, "left", 21), (2, "left", 129)],
                         ids=["b1-T21", "b4-left-T21", "b2-left-T129"])
def test_captured_prefill_matches_stock(dtype, batch, padding, length):
    """From a bucket's second prompt on, the prompt is replayed from its captured, left-padded prefill: tokens
    identical to stock in fp32 and every step within bound, for new prompts of the same bucket too."""
    stock, fused = _pair(dtype)
    for seed in range(3):
        ids, mask = padded_batch(batch, length, padding, seed=seed)
        a = _generate(stock, ids, mask, max_new_tokens=32)
        b = _generate(fused, ids, mask, max_new_tokens=32)
        if dtype == torch.float32:
            assert torch.equal(a.sequences, b.sequences), seed
            _check_steps(a, b, BOUND[dtype])
        else:
            _check_steps(a, b, BOUND[dtype], upto=1)  # the prefill's logits; bf16 tokens may part later
    cache = cache_of(b)
    (graph,) = cache._state.prefill_graphs.values()
    assert graph.graph and cache._pad == graphs.forward_len_bucket(length) - length


def _syncing_forward():
    x = torch.ones(4, device="cuda")
    return x * float(x.sum().item())  # a host sync: illegal inside a capture, so the capture fails


def test_failed_capture_leaves_random_ops_usable(caplog):
    """A capture that fails (a host sync inside it) is said once and leaves the CUDA generator usable: torch's
    capture_end raises before it takes the generator out of capture mode, and without the reset every later random
    op on the device fails, sampling included. Same seed, same numbers as a process in which nothing failed."""
    _, fused = _pair(torch.bfloat16)
    text_model = fused.model
    torch.cuda.manual_seed(7)
    want = torch.rand(5, device="cuda")
    torch.cuda.manual_seed(7)
    with caplog.at_level("WARNING"):
        assert graphs.capture_graph(text_model, _syncing_forward, torch.cuda.graph_pool_handle(), "test") is None
    said = [r.getMessage() for r in caplog.records if "capture of the test failed" in r.getMessage()]
    assert said
    # the host sync's own error is named, not capture_end's "operation failed due to a previous error" over it
    assert not any("previous error" in m for m in said), said
    assert torch.equal(torch.rand(5, device="cuda"), want)
    torch.multinomial(torch.ones(3, 10, device="cuda"), 1)
    w = torch.ones(8, device="cuda")
    with pytest.raises(Exception) as info:  # noqa: B017 - whatever CUDA / torch raises for the host sync
        import_module("fused_ops_gemv")._time_in_graph_ms(lambda w_: w_ * float(w_.sum().item()), [w])
    assert "previous error" not in str(info.value)
    torch.rand(5, device="cuda")


@pytest.mark.cuda
def test_repeat_calls_give_the_same_tokens_and_logits_at_real_shapes():
    """The same greedy `generate` and the same forward, three times in one process, give the same tokens and logits:
    the first call of a bucket computes at the padded shape the later replays use (4B head and projection shapes,
    4 layers, bf16, where a GEMM over another row count rounds differently)."""
    from scripts.common import real_text_kwargs

    torch.manual_seed(0)
    config = modeling.Qwen3_5FusedTextConfig(**real_text_kwargs("4B", num_hidden_layers=4), fused_kernels=True)
    with torch.device("cuda"):
        fused = modeling.Qwen3_5FusedForCausalLM(config).to(torch.bfloat16).eval()
    ids = torch.randint(3, 200_000, (1, 77), device="cuda")
    with torch.inference_mode():
        runs = [fused.generate(input_ids=ids, max_new_tokens=32, do_sample=False, return_dict_in_generate=True,
                               output_logits=True) for _ in range(3)]
        forwards = [fused(input_ids=ids, use_cache=False).logits for _ in range(3)]
    for run in runs[1:]:
        assert torch.equal(run.sequences, runs[0].sequences)
        assert all(torch.equal(a, b) for a, b in zip(run.logits, runs[0].logits))
    assert all(torch.equal(f, forwards[0]) for f in forwards[1:])
    assert fused.describe()["decode"]["buckets"][0]["prompt_buckets_captured"]  # the later calls were replays
