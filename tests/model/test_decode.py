"""Fused decode through plain ``generate()`` / ``pipeline()`` against stock transformers: on CPU (emulated), and on
the GPU with the fused step and CUDA graphs (issue 4).

CPU tests (``@cpu_emulated``): the fused path runs with every kernel swapped for its plain-torch reference
(``helpers.emulate_fused_on_cpu``): what is tested is everything around the kernels, on both ends of the supported
transformers range: the ``FusedDecodeCache`` that ``generate`` gets, the fused prefill writing into its preallocated
buffers, the single-token step on those buffers (positions, padding mask, in-place K/V and state updates), bucket
reuse across calls, the fallbacks (one log line each) and the errors. The decode step's rotary test runs on both.

GPU tests (``@pytest.mark.cuda``; `python -m pytest -m cuda -q tests/model/test_decode.py`): greedy tokens must be
identical to stock in fp32 for 128 new tokens (random and trained weights, batch 1 and batch 4 with left padding) and
every step's logits within the forward bounds of ``test_model.py``; in bf16 the logits are compared up to the first
position where the two greedy sequences part (``scripts/eval_quality.py`` reports that position). The kernels
themselves are tested in ``tests/ops/test_decode_ops.py``.
"""

import logging
import types
from pathlib import Path

import pytest
import torch

import helpers
from helpers import compat, decode, generate_mod, graphs, plan_mod, runner_mod  # the repo modules these tests reach into
from helpers import BOUNDS, cache_of, composite_kwargs, cuda_pair, fused_ops, generate_fused, generate_stock, ieee_stock
from helpers import decode_caches, modeling
from helpers import padded_batch, rel_err, stock_and_fused_lm
from helpers import cpu_emulated, fused_on_cpu  # noqa: F401 - the fixture, used by every @cpu_emulated test
from scripts.common import import_module

REPO = Path(__file__).resolve().parents[2]
SCORE_BOUND = BOUNDS["cpu_emulation"]
BOUND = BOUNDS["model"]


def _prompts(batch=3, length=7, seed=1, pad_rows=((0, 3), (1, 1))):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 200, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    for row, n in pad_rows:
        if row < batch:
            ids[row, :n] = 0
            mask[row, :n] = 0
    return ids, mask


def _both(stock, fused, ids, mask=None, seed=None, **kw):
    kw = dict(pad_token_id=0, return_dict_in_generate=True, output_scores=True, **kw)
    with torch.no_grad():
        if seed is not None:
            torch.manual_seed(seed)
        a = generate_stock(stock, ids, attention_mask=mask, **kw)
        if seed is not None:
            torch.manual_seed(seed)
        b = generate_fused(fused, ids, attention_mask=mask, **kw)
    return a, b


def _assert_same(a, b):
    assert torch.equal(a.sequences, b.sequences)
    assert len(a.scores) == len(b.scores)
    for step, (x, y) in enumerate(zip(b.scores, a.scores)):
        finite = torch.isfinite(y)
        assert torch.equal(finite, torch.isfinite(x)), step
        err = rel_err(x[finite], y[finite])
        assert err <= SCORE_BOUND, (step, err)


@pytest.mark.parametrize("batch,length,new", [(1, 1, 5), (1, 7, 24), (3, 7, 20), (2, 129, 6)])
@cpu_emulated
def test_greedy_matches_stock(batch, length, new):
    stock, fused = stock_and_fused_lm(seed=0)
    ids, mask = _prompts(batch, length)
    if length == 1:
        mask = None
    a, b = _both(stock, fused, ids, mask, max_new_tokens=new, do_sample=False)
    assert isinstance(b.fused_cache, decode.FusedDecodeCache)
    _assert_same(a, b)
    # stock's DynamicCache as stock's generate returns it: prompt + new - 1 tokens, the same state
    assert cache_of(b).get_seq_length() == cache_of(a).get_seq_length() == length + new - 1
    helpers.assert_caches_close(cache_of(b), cache_of(a), fused.config.layer_types, SCORE_BOUND)
    assert fused.describe()["decode"]["path"] == "fused"


@cpu_emulated
def test_sampling_matches_stock():
    stock, fused = stock_and_fused_lm(seed=2)
    ids, mask = _prompts(3, 9)
    a, b = _both(stock, fused, ids, mask, seed=7, max_new_tokens=16, do_sample=True, temperature=0.7, top_k=20,
                 top_p=0.9)
    assert isinstance(b.fused_cache, decode.FusedDecodeCache)
    _assert_same(a, b)


@cpu_emulated
def test_eos_stops_rows_like_stock():
    stock, fused = stock_and_fused_lm(seed=0)
    ids, mask = _prompts(3, 7)
    free = _both(stock, fused, ids, mask, max_new_tokens=12, do_sample=False)[0].sequences
    eos = int(free[1, 7 + 3])  # row 1 emits it at step 3; the other rows go on (padded with 0 once done)
    a, b = _both(stock, fused, ids, mask, max_new_tokens=12, do_sample=False, eos_token_id=eos)
    _assert_same(a, b)
    assert (b.sequences[1, 7 + 4 :] == 0).all()


@cpu_emulated
def test_repeated_calls_reuse_buckets_and_stay_correct():
    stock, fused = stock_and_fused_lm(seed=3)
    for batch, length, new in [(2, 7, 8), (2, 11, 5), (1, 5, 9), (4, 3, 4), (2, 7, 8)]:
        ids, mask = _prompts(batch, length, seed=batch + length)
        a, b = _both(stock, fused, ids, mask, max_new_tokens=new, do_sample=False)
        _assert_same(a, b)
    buckets = fused.describe()["decode"]["buckets"]
    assert len(buckets) == runner_mod.MAX_DECODE_STATES  # least recently used beyond the limit were freed
    assert {(b["batch"], b["max_len"]) for b in buckets} == {(4, 256), (2, 256)}


@cpu_emulated
def test_bucket_grows_with_length():
    stock, fused = stock_and_fused_lm(seed=3)
    ids, mask = _prompts(1, 250, pad_rows=())
    a, b = _both(stock, fused, ids, mask, max_new_tokens=10, do_sample=False)
    _assert_same(a, b)
    assert b.fused_cache.max_cache_len == 512


@pytest.mark.parametrize("positions", ["none", "2d", "4d"])
@cpu_emulated
def test_forward_continues_a_returned_cache_like_stock(positions):
    """The model's forward on a returned fused cache (one token at a time, as stock `_sample` drives it under
    synced_gpus) matches stock's forward on its own cache, for each form of position ids stock accepts."""
    stock, fused = stock_and_fused_lm(seed=4)
    ids, mask = _prompts(2, 6)
    a, b = _both(stock, fused, ids, mask, max_new_tokens=3, do_sample=False)
    caches = {"stock": cache_of(a), "fused": cache_of(b)}
    seq, pos = a.sequences, (mask.cumsum(-1) - 1).clamp_min(0)[:, -1:] + 2  # position of the last token in seq
    full_mask = torch.cat([mask, torch.ones(2, 2, dtype=mask.dtype)], dim=-1)
    for step in range(3):
        tok = seq[:, -1:] if step == 0 else nxt
        kw = {}
        if positions == "2d":
            kw["position_ids"] = pos + step
        elif positions == "4d":
            kw["position_ids"] = (pos + step)[None].expand(4, -1, -1)
        full_mask = torch.cat([full_mask, torch.ones(2, 1, dtype=mask.dtype)], dim=-1)
        with torch.no_grad():
            want = helpers.run_stock(stock, input_ids=tok, attention_mask=full_mask,
                                     **{compat.GENERATE_CACHE_KW: caches["stock"]}, **kw).logits
            got = fused(input_ids=tok, attention_mask=full_mask, **{compat.GENERATE_CACHE_KW: caches["fused"]},
                        **kw).logits
        assert rel_err(got, want) <= SCORE_BOUND, step
        nxt = want[:, -1].argmax(-1, keepdim=True)


@cpu_emulated
def test_stale_cache_refuses_to_run_and_the_returned_cache_is_a_copy():
    """The fused cache of a finished call refuses to run once a later call took its buffers over; the stock cache the
    call returned is a copy, untouched by the later call."""
    stock, fused = stock_and_fused_lm(seed=0)
    ids, mask = _prompts(2, 5)
    _, first = _both(stock, fused, ids, mask, max_new_tokens=3, do_sample=False)
    kept = [t.clone() for t in (cache_of(first).layers[3].keys, cache_of(first).layers[0].recurrent_states[0])]
    _both(stock, fused, ids.flip(0), mask.flip(0), max_new_tokens=3, do_sample=False)  # same bucket: its buffers
    with pytest.raises(RuntimeError, match="earlier generate"):
        with torch.no_grad():
            fused(input_ids=ids[:, :1], **{compat.GENERATE_CACHE_KW: first.fused_cache})
    assert torch.equal(cache_of(first).layers[3].keys, kept[0])
    assert torch.equal(cache_of(first).layers[0].recurrent_states[0], kept[1])


@cpu_emulated
def test_continuing_with_several_tokens_is_refused():
    _, fused = stock_and_fused_lm(seed=0)
    ids, mask = _prompts(2, 5)
    with torch.no_grad():
        out = generate_fused(fused, ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0,
                             return_dict_in_generate=True)
        with pytest.raises(NotImplementedError, match="one token at a time"):
            fused(input_ids=ids[:, :3], **{compat.GENERATE_CACHE_KW: out.fused_cache})


@pytest.mark.parametrize("case", ["beam", "cache_passed", "static", "hidden_states"])
@cpu_emulated
def test_fallbacks_are_announced_and_correct(case, caplog):
    from transformers import DynamicCache

    stock, fused = stock_and_fused_lm(seed=0)
    ids, mask = _prompts(2, 6)
    kw = dict(max_new_tokens=6, do_sample=False)
    expect = {"beam": "generation mode", "cache_passed": "cache object was passed", "static": "cache_implementation",
              "hidden_states": "hidden states"}[case]
    if case == "beam":
        kw.update(num_beams=2)
    elif case == "static":
        kw.update(cache_implementation="static")
    elif case == "hidden_states":
        kw.update(output_hidden_states=True)
    with caplog.at_level(logging.WARNING):
        if case == "cache_passed":
            with torch.no_grad():
                a = generate_stock(stock, ids, attention_mask=mask, pad_token_id=0, return_dict_in_generate=True,
                                   output_scores=True, **kw)
                b = generate_fused(fused, ids, attention_mask=mask, pad_token_id=0, return_dict_in_generate=True,
                                   output_scores=True, **{compat.GENERATE_CACHE_KW: DynamicCache(config=fused.config)},
                                   **kw)
        else:
            a, b = _both(stock, fused, ids, mask, **kw)
    assert not isinstance(b.fused_cache, decode.FusedDecodeCache)
    messages = [r.getMessage() for r in caplog.records if "decodes with the stock" in r.getMessage()]
    assert len(messages) == 1 and expect in messages[0], messages
    assert torch.equal(a.sequences, b.sequences)


@cpu_emulated
def test_composite_model_generates_fused():
    from transformers import Qwen3_5ForConditionalGeneration

    torch.manual_seed(0)
    cfg = modeling.Qwen3_5FusedConfig(**composite_kwargs(), fused_kernels=True)
    fused = modeling.Qwen3_5FusedForConditionalGeneration(cfg).eval()
    stock = Qwen3_5ForConditionalGeneration(modeling.Qwen3_5FusedConfig(**composite_kwargs())).eval()
    stock.load_state_dict(fused.state_dict())
    ids, mask = _prompts(2, 8)
    a, b = _both(stock, fused, ids, mask, max_new_tokens=10, do_sample=False)
    assert isinstance(b.fused_cache, decode.FusedDecodeCache)
    _assert_same(a, b)


@cpu_emulated
def test_moving_the_model_frees_decode_buffers():
    _, fused = stock_and_fused_lm(seed=0)
    ids, mask = _prompts(2, 5)
    with torch.no_grad():
        out = generate_fused(fused, ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0,
                             return_dict_in_generate=True)
    assert len(fused.describe()["decode"]["buckets"]) == 1
    fused.to(torch.float64)
    assert fused.describe()["decode"]["buckets"] == []
    with pytest.raises(RuntimeError, match="earlier generate"):
        with torch.no_grad():
            fused(input_ids=ids[:, :1], **{compat.GENERATE_CACHE_KW: out.fused_cache})
    fused.set_fused_kernels(False)
    assert fused.describe()["decode"]["path"] == "stock"


@cpu_emulated
def test_describe_reports_pdl_and_the_gemv_late_signal(monkeypatch):
    """`describe()["decode"]` says whether our kernels use PDL and, when they do, the weight size from which the GEMV
    signals the next kernel after its loop (the live value of the constant, as an A/B sets it); neither on CPU."""
    _, fused = stock_and_fused_lm(seed=0)
    decode = fused.describe()["decode"]
    assert decode["pdl"] is False and decode["pdl_gemv_late_signal_min_weight_elems"] is None
    assert decode["shipped_choices"] is None  # no shipped kernel choices on CPU
    monkeypatch.setattr(plan_mod, "pdl_enabled", lambda device: True)
    fused._refresh_fused()  # the plan is resolved once, not per call
    assert fused.describe()["decode"]["pdl_gemv_late_signal_min_weight_elems"] == 9_000_000
    monkeypatch.setattr(import_module("fused_ops_gemv"), "_GEMV_LATE_TRIGGER_ELEMS", 123)
    decode = fused.describe()["decode"]
    assert decode["pdl"] is True and decode["pdl_gemv_late_signal_min_weight_elems"] == 123
    fused.set_fused_kernels(False)
    assert fused.describe()["decode"]["pdl_gemv_late_signal_min_weight_elems"] is None


@cpu_emulated
def test_trained_model_pipeline_streamer_and_chat_template():
    """The shipped checkpoint through pipeline("text-generation"), a TextStreamer and its chat template."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, TextStreamer, pipeline

    tok = AutoTokenizer.from_pretrained(REPO)
    config = modeling.Qwen3_5FusedConfig.from_pretrained(REPO)  # as AutoModelForCausalLM passes it
    fused = modeling.Qwen3_5FusedForCausalLMLoader.from_pretrained(REPO, config=config, dtype=torch.float32).eval()
    stock = AutoModelForCausalLM.from_pretrained(REPO, dtype=torch.float32).eval()  # stock, no remote code
    assert fused.describe()["decode"]["path"] == "fused"
    prompt = "def read_file(path):\n    with open(path"
    gen = dict(max_new_tokens=24, do_sample=False)
    with compat.torch_reference_kernels():
        want = pipeline("text-generation", model=stock, tokenizer=tok)(prompt, **gen)[0]["generated_text"]
    got = pipeline("text-generation", model=fused, tokenizer=tok)(prompt, **gen)[0]["generated_text"]
    assert got == want and len(got) > len(prompt)

    chat = [{"role": "user", "content": "import os"}]
    ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    printed = []

    class Collect(TextStreamer):
        def on_finalized_text(self, text, stream_end=False):
            printed.append(text)

    with torch.no_grad():
        out = fused.generate(**ids, **gen, streamer=Collect(tok, skip_prompt=True))
        ref = generate_stock(stock, **ids, **gen)
    assert torch.equal(out, ref)
    assert "".join(printed).strip() == tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).strip()


@cpu_emulated
def test_generate_runs_the_fused_loop_once_prefilled(monkeypatch):
    """generate() takes the fused loop: the model's forward runs once (the prefill), every token after is a step."""
    stock, fused = stock_and_fused_lm(seed=0)
    calls = {"run": 0, "loop": 0}
    run, loop = runner_mod.FusedRunner.run_on_cache, modeling.fused_sample

    def counting_run(self, *a, **k):
        calls["run"] += 1
        return run(self, *a, **k)

    def counting_loop(*a, **k):
        calls["loop"] += 1
        return loop(*a, **k)

    monkeypatch.setattr(runner_mod.FusedRunner, "run_on_cache", counting_run)
    monkeypatch.setattr(modeling, "fused_sample", counting_loop)
    ids, mask = _prompts(2, 6)
    a, b = _both(stock, fused, ids, mask, max_new_tokens=9, do_sample=False)
    _assert_same(a, b)
    assert calls == {"run": 1, "loop": 1}
    assert cache_of(b).get_seq_length() == 6 + 8


@cpu_emulated
def test_greedy_without_processors_takes_argmax_in_the_model_dtype(monkeypatch):
    """A greedy step whose logits nothing else reads (no processor, no scores kept) skips stock's float32
    conversion: bf16 tokens equal those of the float32 path (scores kept) and of stock, and the argmax saw bf16."""
    stock, fused = stock_and_fused_lm(seed=1)
    stock, fused = stock.to(torch.bfloat16), fused.to(torch.bfloat16)
    ids, mask = _prompts(2, 7)
    seen = []
    argmax = torch.argmax

    def spy(x, *a, **k):
        seen.append(x.dtype)
        return argmax(x, *a, **k)

    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = generate_stock(stock, ids, attention_mask=mask, **kw)
        kept = fused.generate(ids, attention_mask=mask, return_dict_in_generate=True, output_scores=True, **kw)
        monkeypatch.setattr(torch, "argmax", spy)
        plain = fused.generate(ids, attention_mask=mask, **kw)
    assert torch.equal(plain, kept.sequences) and torch.equal(plain, want)
    assert seen and set(seen) == {torch.bfloat16}


@cpu_emulated
def test_stop_rows_is_stocks_list_without_the_max_length_criterion(monkeypatch):
    """`_stop_rows` ORs every criterion as stock's `StoppingCriteriaList` does, except stock's `MaxLengthCriteria`
    (the loop's host-side `at_max` decides it), which still runs, and warns, past `max_position_embeddings`."""
    from transformers.generation.stopping_criteria import (
        EosTokenCriteria, MaxLengthCriteria, StoppingCriteria, StoppingCriteriaList)

    class Odd(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return input_ids[:, -1] % 2 == 1

    ids = torch.tensor([[5, 7, 2], [5, 7, 3], [5, 7, 4]])
    full = StoppingCriteriaList([MaxLengthCriteria(3), EosTokenCriteria(4), Odd()])
    assert full(ids, None).tolist() == [True] * 3  # stock: the max length stops every row
    assert generate_mod.stop_rows(full, ids, None).tolist() == [False, True, True]
    assert generate_mod.stop_rows(StoppingCriteriaList([MaxLengthCriteria(9)]), ids, None) is None
    from transformers.generation import stopping_criteria

    warned = []  # the criterion's own warning (warn-once and logger propagation vary with the test order)
    monkeypatch.setattr(stopping_criteria.logger, "warning_once", lambda msg, *a, **k: warned.append(msg))
    generate_mod.stop_rows([MaxLengthCriteria(9, max_position_embeddings=2)], ids, None)
    assert any("maximum length" in w for w in warned)


@cpu_emulated
def test_stop_flags_are_read_one_batch_late():
    """The rows' running flags are read a batch after they were queued (lag 1), at once with lag 0 (a streamer),
    and every pending batch when generate reaches its last step; the step returned is the first after which every
    row had stopped."""
    def run(lag, final_at=None, true_from=6, every=4):
        stops = generate_mod.StopFlags(every, lag)
        for step in range(1, 40):  # two rows: the first stops at step `true_from`, the second one step earlier
            got = stops.add(torch.tensor([step < true_from, step < true_from - 1]), step, final=step == final_at)
            if got is not None or step == final_at:
                return step, got
        return None

    assert run(lag=1) == (12, 6)  # the batch of steps 5-8 is read when steps 9-12 are queued
    assert run(lag=0) == (8, 6)
    assert run(lag=1, final_at=9) == (9, 6)
    assert run(lag=1, final_at=5, true_from=7) == (5, None)
    assert run(lag=1, true_from=1, every=1) == (2, 1)


@pytest.mark.parametrize("stop_after", [1, 5, generate_mod.STOP_CHECK_EVERY + 3, 2 * generate_mod.STOP_CHECK_EVERY + 1])
@cpu_emulated
def test_all_rows_stopping_early_cuts_the_extra_steps(stop_after):
    """A criterion that stops every row after `stop_after` tokens. Without a returned cache the batched stop check
    runs a few steps further: sequences equal stock's (the extra tokens cut) and the fused cache refuses to be
    continued. With one (`return_dict_in_generate`), every step is checked: scores and the cache are stock's."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class StopAfter(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= 6 + stop_after, dtype=torch.bool)

    stock, fused = stock_and_fused_lm(seed=0)
    ids, mask = _prompts(2, 6)
    # no EOS: the custom criterion is the only stop besides the length
    kw = dict(max_new_tokens=60, do_sample=False, eos_token_id=None,
              stopping_criteria=StoppingCriteriaList([StopAfter()]))
    a, b = _both(stock, fused, ids, mask, **kw)
    _assert_same(a, b)
    assert b.sequences.shape[1] == 6 + stop_after and not b.fused_cache._overrun
    assert cache_of(b).get_seq_length() == cache_of(a).get_seq_length() == 6 + stop_after - 1
    helpers.assert_caches_close(cache_of(b), cache_of(a), fused.config.layer_types, SCORE_BOUND)
    with decode_caches(fused) as made, torch.no_grad():
        plain = fused.generate(ids, attention_mask=mask, pad_token_id=0, **kw)
    assert torch.equal(plain, a.sequences)
    (cache,) = made
    if cache._overrun:
        with pytest.raises(RuntimeError, match="past the end"):
            with torch.no_grad():
                fused(input_ids=ids[:, :1], **{compat.GENERATE_CACHE_KW: cache})


@cpu_emulated
def test_step_across_devices_matches_stock(monkeypatch):
    """Issue 7: a model dispatched over several GPUs (device_map) decodes on the fused step, each layer's buffers and
    work on its own device, the stream moved between them. CPU has one device: odd layers are labelled ``cpu:1``
    (``.to("cpu:1")`` lands on ``cpu``), which runs every move in the step as a no-op copy. The real split runs on
    two GPUs in ``test_multi_gpu.py``."""
    allocate = decode.DecodeState._allocate

    def split_allocate(self, text_model, batch, max_len):
        allocate(self, text_model, batch, max_len)
        self.layer_devices = [torch.device("cpu", i % 2) for i in range(len(self.layer_devices))]
        self.multi_device = True

    monkeypatch.setattr(decode.DecodeState, "_allocate", split_allocate)
    stock, fused = stock_and_fused_lm(seed=0)
    ids, mask = _prompts(2, 6)
    a, b = _both(stock, fused, ids, mask, max_new_tokens=5, do_sample=False)
    assert isinstance(b.fused_cache, decode.FusedDecodeCache) and b.fused_cache._state.multi_device
    _assert_same(a, b)


@pytest.mark.parametrize("seq_len,batch,pad_rows", [(1, 1, ()), (7, 3, ((0, 3), (1, 1))), (129, 2, ((1, 40),))])
@cpu_emulated
def test_padded_prefill_matches_stock(seq_len, batch, pad_rows):
    """From a bucket's second prompt on, the prompt runs left-padded to its length bucket (the captured prefill on
    the GPU, the same padded forward eagerly here): tokens, every step's scores and the state must stay stock's."""
    stock, fused = stock_and_fused_lm(seed=0)
    ids, mask = _prompts(batch, seq_len, pad_rows=pad_rows)
    for _ in range(3):
        a, b = _both(stock, fused, ids, mask, max_new_tokens=6, do_sample=False)
        _assert_same(a, b)
    cache = b.fused_cache
    length = graphs.forward_len_bucket(seq_len)
    assert length in cache._state.prefill_graphs and cache._pad == length - seq_len > 0


@cpu_emulated
def test_prefill_that_does_not_fit_runs_unpadded(caplog):
    """A padded prompt plus the new tokens must fit the cache bucket; otherwise the prompt runs unpadded, said once."""
    stock, fused = stock_and_fused_lm(seed=0)
    ids, mask = _prompts(1, 129, pad_rows=())  # bucket 192 + 100 new > the 256 cache
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            a, b = _both(stock, fused, ids, mask, max_new_tokens=100, do_sample=False)
            _assert_same(a, b)
    assert not b.fused_cache._state.prefill_graphs and b.fused_cache._pad == 0
    assert sum("do not fit the cache bucket" in r.getMessage() for r in caplog.records) == 1


@cpu_emulated
def test_prefill_graph_load_places_the_prompt_at_the_tail():
    """The padded buffers: pads in front (mask 0), the prompt at the tail with its own positions (stock's 0..T-1 when
    none are given)."""
    _, fused = stock_and_fused_lm(seed=0)
    graph = graphs.PrefillGraph(2, fused.model.embed_tokens.weight.device, 64)
    ids = torch.randint(3, 200, (2, 5))
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    for positions in (None, torch.arange(10, 15).expand(2, 5)):
        graph.ids.fill_(7)  # stale content from an earlier, longer prompt
        assert graph.load(ids, mask, positions) == 59
        assert torch.equal(graph.ids[:, 59:], ids) and not graph.ids[:, :59].any()
        assert torch.equal(graph.mask[:, 59:], mask) and not graph.mask[:, :59].any()
        want = torch.arange(5) if positions is None else positions[0]
        assert torch.equal(graph.positions[:, 59:], want.expand(2, 5))
    assert graph.load(ids, None, None) == 59 and graph.mask[:, 59:].all()


@cpu_emulated
def test_lm_head_of_a_step_goes_through_small_linear_unless_wrapped(monkeypatch):
    """The step's LM head runs through `small_linear` (the per-shape cuBLAS / GEMV choice), inside the step, for a
    plain bias-free Linear; a head that is anything else (here a bias, as a wrapper or an adapter would add) runs as
    the module, after the step, and both give stock's tokens and scores."""
    seen = []
    real = plan_mod.REFERENCES.small_linear  # the kernel set this file's fixture runs

    def spy(x, w, *a, **k):
        seen.append(tuple(w.shape))
        return real(x, w, *a, **k)

    monkeypatch.setattr(plan_mod.REFERENCES, "small_linear", spy)
    ids, mask = _prompts(2, 5)
    for with_bias in (False, True):
        stock, fused = stock_and_fused_lm(seed=3)
        if with_bias:
            for model in (stock, fused):
                head = model.lm_head
                model.lm_head = torch.nn.Linear(head.in_features, head.out_features, bias=True)
                model.lm_head.weight = torch.nn.Parameter(head.weight.detach().clone())
                torch.nn.init.normal_(model.lm_head.bias, std=0.5)
            fused.lm_head.bias.data.copy_(stock.lm_head.bias.data)
        seen.clear()
        a, b = _both(stock, fused, ids, mask, max_new_tokens=4, do_sample=False)
        _assert_same(a, b)
        vocab_shape = tuple(fused.lm_head.weight.shape)
        assert (vocab_shape in seen) is not with_bias, (with_bias, seen)
        # the plain head runs inside the step (and its CUDA graph); the biased one after it
        assert (generate_mod.graph_head(fused, fused.model, b.fused_cache._state) is fused.lm_head) is not with_bias


ROPES = {
    "default": {"rope_type": "default"},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},  # scaling 1.139
    "linear": {"rope_type": "linear", "factor": 2.0},
}


def _rotary(rope: dict, sections, head_dim: int, factor: float):
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    config = Qwen3_5TextConfig(
        hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=head_dim, max_position_embeddings=4096,
        rope_parameters={"rope_theta": 1e7, "mrope_section": sections, "partial_rotary_factor": factor, **rope},
    )
    return Qwen3_5TextRotaryEmbedding(config)


class _Positions:
    """The attributes of a `DecodeState` that `step_rope` reads and writes: the rope plan, the kernel set, the
    positions, and the key mask [B, 8] whose column `slot` (5) the step marks valid."""

    def __init__(self, rope, positions, mrope_step):
        self.rope, self.positions = rope, positions
        self.ops = types.SimpleNamespace(mrope_step=mrope_step)
        self.key_valid = torch.zeros(positions.shape[1], 8, dtype=torch.bool, device=positions.device)
        self.slot = torch.tensor([5], device=positions.device)

    def check_marked(self):
        want = torch.zeros_like(self.key_valid)
        want[:, 5] = True
        assert torch.equal(self.key_valid, want)


@pytest.mark.parametrize("rope", list(ROPES))
@pytest.mark.parametrize("sections,head_dim,factor", [([11, 11, 10], 256, 0.25), ([2, 1, 1], 32, 0.5)],
                         ids=["real-4B", "tiny"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@cpu_emulated
def test_step_rope_equals_stock_rotary(rope, sections, head_dim, factor, dtype, batch, device, monkeypatch):
    """The decode step's cos / sin (a per-dimension gather of the t / h / w position row and the frequency) are
    bit-identical to stock's rotary module, for distinct t / h / w positions (a multimodal prompt's), large
    positions, and a type whose attention scaling is not 1 (yarn); the new key is marked valid and the positions
    move on by one: on the CPU through `mrope_step_ref` and (a CUDA test) on the GPU through the `mrope_step`
    kernel."""
    kernel = fused_ops.mrope_step_ref if device == "cpu" else fused_ops.mrope_step
    rot = _rotary(ROPES[rope], sections, head_dim, factor).to(device)
    plan = decode.rope_plan(rot, device)
    assert plan is not None
    gen = torch.Generator().manual_seed(batch)
    positions = torch.randint(0, 200_000, (3, batch, 1), generator=gen).to(device)
    before = positions.clone()
    h = torch.zeros(batch, 1, 64, dtype=dtype, device=device)
    want_cos, want_sin = rot(h, before)
    state = _Positions(plan, positions, kernel)
    cos, sin = decode.DecodeState.step_rope(state, rot, h)
    assert cos.shape == want_cos.shape and cos.dtype == dtype and cos.is_contiguous()
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    assert torch.equal(positions, before + 1)
    state.check_marked()


@cpu_emulated
def test_step_rope_calls_a_rotary_on_another_device_as_it_is():
    """A rotary module on another device than the step's buffers (a model split over devices) gets no plan: the step
    calls the module, through the hook that moves its inputs."""
    rot = _rotary(ROPES["default"], [2, 1, 1], 32, 0.5)
    assert decode.rope_plan(rot, "meta") is None
    assert decode.rope_plan(rot, torch.device("cpu")) is not None


@cpu_emulated
def test_step_rope_calls_a_dynamic_rotary_as_it_is():
    """A rotary type that updates its frequencies per call (dynamic) gets no plan: the step calls the module."""
    rot = _rotary({"rope_type": "dynamic", "factor": 2.0}, [2, 1, 1], 32, 0.5)
    assert decode.rope_plan(rot, "cpu") is None
    positions = torch.randint(0, 5000, (3, 2, 1))
    before = positions.clone()
    h = torch.zeros(2, 1, 64)
    want_cos, want_sin = rot(h, before)
    state = _Positions(None, positions, fused_ops.mrope_step_ref)
    cos, sin = decode.DecodeState.step_rope(state, rot, h)
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    assert torch.equal(positions, before + 1)
    state.check_marked()


# --------------------------------------------------------------------------------------------------------------------
# On the GPU (`@pytest.mark.cuda`)
# --------------------------------------------------------------------------------------------------------------------


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
        return generate_fused(model, input_ids=ids.cuda(), attention_mask=None if mask is None else mask.cuda(), **kw)


def _check_steps(a, b, bound, upto=None):
    for step, (x, y) in enumerate(zip(b.scores[:upto], a.scores[:upto])):
        assert rel_err(x.float(), y.float()) <= bound, step


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("batch,padding", [(1, None), (4, "left")], ids=["b1", "b4-left"])
@pytest.mark.cuda
def test_random_fp32_128_tokens_identical(batch, padding, graphs):
    stock, fused = cuda_pair(torch.float32)
    fused.set_cuda_graphs(graphs)
    ids, mask = padded_batch(batch, 21, padding)
    a = _generate(stock, ids, mask, max_new_tokens=128)
    b = _generate(fused, ids, mask, max_new_tokens=128)
    assert isinstance(b.fused_cache, decode.FusedDecodeCache)
    assert torch.equal(a.sequences, b.sequences)
    _check_steps(a, b, BOUND[torch.float32])
    buckets = fused.describe()["decode"]["buckets"]
    assert [bk["graph_captured"] for bk in buckets] == [graphs]


@pytest.mark.parametrize("batch", [1, 4], ids=["b1", "b4-left"])
@pytest.mark.cuda
def test_trained_fp32_128_tokens_identical(batch):
    stock, fused = _trained_pair(torch.float32)
    ids, mask = _text_prompts(batch)
    a = _generate(stock, ids, mask, max_new_tokens=128)
    b = _generate(fused, ids, mask, max_new_tokens=128)
    assert torch.equal(a.sequences, b.sequences)
    _check_steps(a, b, BOUND[torch.float32])


@pytest.mark.cuda
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


@pytest.mark.cuda
def test_a_kernel_that_ran_compiles_no_more_at_other_batch_sizes_and_prompts():
    """Once a kernel of this repo has run (batch 1, a short and a long prompt: both tile sizes of the prefill
    kernels), other batch sizes and prompt lengths compile it no more: row counts are run-time values, tile sizes do
    not follow them, and the GEMV is timed at one row only (a compile is what a first call at a new shape stalls
    on). A kernel that batch 1 did not need (the separate conv step, where one row took the GEMV's conv epilogue)
    may compile once. The config's widths are multiples of 16, as the real models' are, so Triton specialises the
    strides as it does for them. The calls still match stock."""
    stock, fused = cuda_pair(torch.bfloat16, head_dim=64, linear_num_key_heads=8, linear_num_value_heads=16,
                             max_position_embeddings=2048)
    with helpers.TritonCompiles() as warm:
        for length in (9, 700):
            ids, mask = padded_batch(1, length, None)
            _generate(fused, ids, mask, max_new_tokens=8)
    with helpers.TritonCompiles() as compiles:
        for batch, length in ((2, 9), (3, 13), (5, 40), (16, 9), (2, 300)):
            ids, mask = padded_batch(batch, length, "left")
            a = _generate(stock, ids, mask, max_new_tokens=8)
            b = _generate(fused, ids, mask, max_new_tokens=8)
            _check_steps(a, b, BOUND[torch.bfloat16], upto=1)
    again = {name: n for name, n in compiles.ours.items() if name in warm.ours}
    assert again == {}, f"compiled again: {again}; first compiled at batch 1: {warm.ours}"


@pytest.mark.cuda
def test_graph_replay_equals_eager_step_bf16():
    _, fused = cuda_pair(torch.bfloat16)
    ids, mask = padded_batch(2, 9, "left")
    fused.set_cuda_graphs(False)
    eager = _generate(fused, ids, mask, max_new_tokens=40)
    fused.set_cuda_graphs(True)
    graph = _generate(fused, ids, mask, max_new_tokens=40)
    assert torch.equal(eager.sequences, graph.sequences)
    for x, y in zip(graph.scores, eager.scores):
        assert torch.equal(x, y)


@pytest.mark.cuda
def test_programmatic_dependent_launch_changes_nothing_bf16(monkeypatch):
    """With PDL (each kernel of ours may start while the one before drains, and waits on the grid dependency before
    it touches that kernel's output) the graphed step gives the scores of plain launches, bit for bit: a missing
    wait would read a half-written input. 64 tokens, batch 3, left padding, so every kernel of the step runs."""
    if not fused_ops.pdl_enabled(torch.device("cuda")):
        pytest.skip("this GPU or Triton has no programmatic dependent launch")
    _, fused = cuda_pair(torch.bfloat16)
    ids, mask = padded_batch(3, 11, "left")
    runs = {}
    for pdl in (False, True):
        monkeypatch.setattr(import_module("fused_ops_runtime"), "PDL_ENABLED", pdl)
        fused.set_fused_kernels(False).set_fused_kernels(True)  # new graphs: PDL is a launch option, read at capture
        runs[pdl] = _generate(fused, ids, mask, max_new_tokens=64)
    assert torch.equal(runs[False].sequences, runs[True].sequences)
    for x, y in zip(runs[True].scores, runs[False].scores):
        assert torch.equal(x, y)


@pytest.mark.cuda
def test_repeated_calls_sampling_and_weight_swap():
    stock, fused = cuda_pair(torch.float32)
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


@pytest.mark.cuda
def test_memory_released_on_move():
    _, fused = cuda_pair(torch.bfloat16)
    ids, mask = padded_batch(2, 9, "left")
    _generate(fused, ids, mask, max_new_tokens=8)
    assert fused.describe()["decode"]["buckets"]
    fused.to("cpu")
    assert fused.describe()["decode"]["buckets"] == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("batch,padding,length", [(1, None, 21), (4, "left", 21), (2, "left", 129)],
                         ids=["b1-T21", "b4-left-T21", "b2-left-T129"])
@pytest.mark.cuda
def test_captured_prefill_matches_stock(dtype, batch, padding, length):
    """From a bucket's second prompt on, the prompt is replayed from its captured, left-padded prefill: tokens
    identical to stock in fp32 and every step within bound, for new prompts of the same bucket too."""
    stock, fused = cuda_pair(dtype)
    for seed in range(3):
        ids, mask = padded_batch(batch, length, padding, seed=seed)
        a = _generate(stock, ids, mask, max_new_tokens=32)
        b = _generate(fused, ids, mask, max_new_tokens=32)
        if dtype == torch.float32:
            assert torch.equal(a.sequences, b.sequences), seed
            _check_steps(a, b, BOUND[dtype])
        else:
            _check_steps(a, b, BOUND[dtype], upto=1)  # the prefill's logits; bf16 tokens may part later
    cache = b.fused_cache
    (graph,) = cache._state.prefill_graphs.values()
    assert graph.graph and cache._pad == graphs.forward_len_bucket(length) - length


def _syncing_forward():
    x = torch.ones(4, device="cuda")
    return x * float(x.sum().item())  # a host sync: illegal inside a capture, so the capture fails


@pytest.mark.cuda
def test_the_graph_pool_outlives_its_graphs_cuda():
    """A capture on the model's pool after every graph on it was freed while a tensor one of them allocated lives on
    (a generate_batch call at new sizes frees its buffers' prompt graphs) succeeds: on a bare ``graph_pool_handle()``
    the allocator's count of the pool's graphs is then 0 and the capture fails an internal assert, and that prompt
    bucket ran without its graph from then on."""
    _, fused = cuda_pair(torch.bfloat16)
    text_model = fused.model
    runner = text_model.runner
    x = torch.ones(8, device="cuda")
    first = graphs.capture_graph(text_model, lambda: x * 2, runner.pool(), "pool test")
    assert first is not None
    first[0].replay()
    out = first[1]
    del first  # the pool's only graph freed; its output still held
    second = graphs.capture_graph(text_model, lambda: x + 1, runner.pool(), "pool test")
    assert second is not None, "the capture after the pool's last graph was freed failed"
    second[0].replay()
    assert torch.equal(second[1], x + 1) and torch.equal(out, x * 2)


@pytest.mark.cuda
def test_failed_capture_leaves_random_ops_usable(caplog):
    """A capture that fails (a host sync inside it) is said once and leaves the CUDA generator usable: torch's
    capture_end raises before it takes the generator out of capture mode, and without the reset every later random
    op on the device fails, sampling included. Same seed, same numbers as a process in which nothing failed."""
    _, fused = cuda_pair(torch.bfloat16)
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
