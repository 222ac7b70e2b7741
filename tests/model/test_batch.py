"""``generate_batch`` (continuous batching) on the fused classes, which stock transformers refuses for Qwen3.5 (issue
46): requests join and leave one running batch on the fused decode step (``fused_batch``, ``fused_batch_state``).

CPU tests (``@cpu_emulated``): the fused control flow with each kernel replaced by its torch reference. Every request's
greedy tokens must equal a batch-1 fused ``generate`` of its prompt (and stock's), with more requests than rows, mixed
prompt lengths and ``max_new_tokens`` (requests joining and leaving mid-run), the live span moved right (a long
prompt joining) and left (a cache small enough to fill); sampling must be reproducible per request seed and
independent of the requests beside it; EOS and ``max_new_tokens`` stop each request alone; a request over the budget
or out of memory fails alone, and an error midway keeps the finished outputs; the result has transformers' type;
the streaming manager hands out each token as it comes.

Chunked prefill (``prefill_chunk``): prompts longer than the chunk prefilled a chunk per step between decode steps give
the same tokens as whole prompts (dense and MoE, chunks at multiples of 64 and odd ones).

GPU tests (``@pytest.mark.cuda``; ``python -m pytest -m cuda -q tests/model/test_batch.py``), the ones that justify
``fused_batch.FUSED_ON_GPU``: the same greedy equality in fp32 through the captured step at each row bucket, with and
without chunked prefill; sampling reproducible per request seed; the memory budget queueing and failing only the
requests over it; no synchronizing CUDA call inside a scheduler step once captured, and the read-back's pinned
buffers reused; bf16 reruns.
"""

import logging
import threading
import time
import weakref

import pytest
import torch
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching.requests import GenerationOutput, RequestStatus

import helpers
from helpers import cpu_emulated, fused_on_cpu  # noqa: F401 - the fixture, used by every @cpu_emulated test
from helpers import generate_stock, stock_and_fused_lm, stock_and_fused_moe_lm
from scripts.common import import_module

batch_mod = import_module("fused_batch")
budget_mod = import_module("fused_batch_budget")
batch_state = import_module("fused_batch_state")
decode_mod = import_module("fused_decode")
graphs_mod = import_module("fused_graphs")

# Weights at 5x the config's default spread: at 0.02 the tiny model's greedy tokens only repeat the prompt's last
# token, which any row mix-up would reproduce; at 0.1 each token depends on the context.
SPREAD = dict(initializer_range=0.1)
LENGTHS = (5, 1, 17, 9, 70, 3, 12)  # 70: joins after shorter prompts, so the live span moves right for it
NEW = (6, 3, 12, 1, 8, 20, 5)  # 1: a request that never takes a row


def _prompts(lengths, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 250, (n,), generator=g).tolist() for n in lengths]


def _greedy(**kw):
    return GenerationConfig(do_sample=False, pad_token_id=0, **{"eos_token_id": 255, **kw})


def _reference(model, prompt, new, stock=False, **kw):
    """The tokens a batch-1 ``generate`` gives ``prompt`` (fused, or stock's own code)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        run = generate_stock if stock else (lambda m, *a, **k: m.generate(*a, **k))
        out = run(model, ids, max_new_tokens=new, **{"do_sample": False, "pad_token_id": 0, "eos_token_id": 255, **kw})
    return out[0, len(prompt):].tolist()


@pytest.fixture
def shifts(monkeypatch):
    """The deltas of every move of the live span (> 0: right, for a long prompt; < 0: left, to make room)."""
    seen = []
    shift = batch_state.BatchState.shift

    def counting(self, live, lo, hi, delta):
        if live and delta:
            seen.append(delta)
        return shift(self, live, lo, hi, delta)

    monkeypatch.setattr(batch_state.BatchState, "shift", counting)
    return seen


@pytest.mark.parametrize("kind", ["dense", "moe"])
@cpu_emulated
def test_greedy_matches_batch_1_generate(kind, shifts):
    stock, fused = stock_and_fused_lm(seed=0, **SPREAD) if kind == "dense" else stock_and_fused_moe_lm(seed=0, **SPREAD)
    prompts = _prompts(LENGTHS)
    out = fused.generate_batch(prompts, generation_config=_greedy(), max_new_tokens=list(NEW),
                               continuous_batching_config=ContinuousBatchingConfig(max_requests_per_batch=3))
    assert list(out) == [f"req_{i}" for i in range(len(prompts))]
    for (rid, got), prompt, new in zip(out.items(), prompts, NEW):
        assert got.status == RequestStatus.FINISHED and got.error is None, (rid, got.error)
        want = _reference(fused, prompt, new)
        assert got.generated_tokens == want, rid
        assert want == _reference(stock, prompt, new, stock=True), rid
    assert any(d > 0 for d in shifts)  # the 70-token prompt joined a shorter live span
    assert fused.describe()["decode"]["generate_batch"]["rows"] == 3


GROUP_LENGTHS = (5, 1, 17, 9, 70, 3, 12, 100, 33, 2, 90, 64, 65, 40)
GROUP_NEW = (6, 3, 12, 1, 8, 20, 5, 4, 9, 2, 7, 11, 1, 3)


@pytest.mark.parametrize("group", [2, 4])
@pytest.mark.parametrize("kind", ["dense", "moe"])
@cpu_emulated
def test_prompts_of_one_bucket_prefilled_together_give_the_same_tokens(kind, group, monkeypatch, shifts):
    """``PREFILL_GROUP``: prompts of one length bucket that join at one step run one forward (left-padded to the
    longest, in batches of powers of two up to the group); every request's tokens stay a batch-1 ``generate``'s, and
    a request of one token (never a row) inside a group too. With requests decoding, free rows wait until a group's
    worth are free (the hold, here at 5 rows), so groups form after the first wave as well."""
    monkeypatch.setattr(batch_mod, "PREFILL_GROUP", group)
    monkeypatch.setattr(batch_mod, "GROUP_HOLD_GROUPS", 1)
    graphs = import_module("fused_graphs")
    calls = []
    many = batch_mod.BatchEngine._start_many

    def counting(self, reqs):
        calls.append(([len(r.prompt) for r in reqs], len(self.live)))
        return many(self, reqs)

    monkeypatch.setattr(batch_mod.BatchEngine, "_start_many", counting)
    _, fused = stock_and_fused_lm(seed=0, **SPREAD) if kind == "dense" else stock_and_fused_moe_lm(seed=0, **SPREAD)
    prompts = _prompts(GROUP_LENGTHS)
    out = fused.generate_batch(prompts, generation_config=_greedy(), max_new_tokens=list(GROUP_NEW),
                               continuous_batching_config=ContinuousBatchingConfig(max_requests_per_batch=5))
    for (rid, got), prompt, new in zip(out.items(), prompts, GROUP_NEW):
        assert got.status == RequestStatus.FINISHED and got.error is None, (rid, got.error)
        assert got.generated_tokens == _reference(fused, prompt, new), rid
    assert calls, "no prompts were prefilled together"
    for lengths, _ in calls:
        assert len(lengths) in (2, 4) and len(lengths) <= group
        assert len({graphs.forward_len_bucket(n) for n in lengths}) == 1, lengths
    assert any(live for _, live in calls), "no group formed while requests decoded"
    assert max(len(lengths) for lengths, _ in calls) == group
    groups = fused._text_model().runner.batch.groups
    assert sorted(groups) == [b for b in (2, 4) if b <= group]


@cpu_emulated
def test_few_rows_do_not_wait_for_a_group(monkeypatch):
    """Below ``GROUP_HOLD_GROUPS`` groups of rows each prompt is prefilled alone and a free row takes the next request
    at once (4 rows, groups of 4: the hold would wait for every row to empty); the tokens stay batch-1
    ``generate``'s. With the threshold at one group, the free rows do wait."""
    monkeypatch.setattr(batch_mod, "PREFILL_GROUP", 4)
    assert batch_mod.prefill_group(4) == 1 and batch_mod.prefill_group(4 * batch_mod.GROUP_HOLD_GROUPS) == 4
    waited, grouped = [], []
    start_many = batch_mod.BatchEngine._start_many
    monkeypatch.setattr(batch_mod.BatchEngine, "_start_many", lambda self, reqs: grouped.append(len(reqs))
                        or start_many(self, reqs))
    admit = batch_mod.BatchEngine._admit

    def watching(self):
        free = self.buffers.rows - len(self.live)
        admit(self)
        if self.live and free and self.waiting and self.buffers.rows - len(self.live) == free:
            waited.append(free)  # free rows and waiting requests, yet nobody joined

    monkeypatch.setattr(batch_mod.BatchEngine, "_admit", watching)
    _, fused = stock_and_fused_lm(seed=0, **SPREAD)
    prompts = _prompts(GROUP_LENGTHS)
    out = fused.generate_batch(prompts, generation_config=_greedy(), max_new_tokens=list(GROUP_NEW),
                               continuous_batching_config=ContinuousBatchingConfig(max_requests_per_batch=4))
    for got, prompt, new in zip(out.values(), prompts, GROUP_NEW):
        assert got.generated_tokens == _reference(fused, prompt, new)
    assert not waited and not grouped
    monkeypatch.setattr(batch_mod, "GROUP_HOLD_GROUPS", 1)  # groups and the hold on: free rows do wait
    fused.generate_batch(prompts, generation_config=_greedy(), max_new_tokens=list(GROUP_NEW),
                         continuous_batching_config=ContinuousBatchingConfig(max_requests_per_batch=4))
    assert waited


@cpu_emulated
def test_a_group_out_of_memory_prefills_each_prompt_alone(monkeypatch):
    """A group's forward that runs out of memory gives way to each of its prompts alone: the same tokens."""
    monkeypatch.setattr(batch_mod, "PREFILL_GROUP", 4)
    monkeypatch.setattr(batch_mod, "GROUP_HOLD_GROUPS", 1)  # groups at these few rows
    _, fused = stock_and_fused_lm(seed=0, **SPREAD)
    prompts = _prompts((5, 9, 12, 3))
    tried = []

    def failing(self, text_model, plan, batch, prompt):
        tried.append(batch)
        raise torch.OutOfMemoryError("CUDA out of memory (test)")

    monkeypatch.setattr(batch_state.BatchState, "group_prefill", failing)
    out = fused.generate_batch(prompts, generation_config=_greedy(), max_new_tokens=5,
                               continuous_batching_config=ContinuousBatchingConfig(max_requests_per_batch=4))
    assert tried == [4]
    for got, prompt in zip(out.values(), prompts):
        assert got.status == RequestStatus.FINISHED and got.generated_tokens == _reference(fused, prompt, 5)


@cpu_emulated
def test_a_call_at_new_sizes_keeps_the_prefill_state(monkeypatch):
    """A call whose rows or cache length differ from the last call's gets new rows over the same batch-1 prefill
    state (its prompt graphs with it) while that state holds the longest prompt and is not much longer than it needs
    (``KEEP_PREFILL_TOKENS``); a longer prompt gets a new one, and so does a call of short prompts after a long one.
    The tokens stay batch-1 ``generate``'s."""
    monkeypatch.setattr(helpers.runner_mod, "KEEP_PREFILL_TOKENS", 256)
    _, fused = stock_and_fused_lm(seed=0, **SPREAD)
    runner = fused._text_model().runner
    prompts = _prompts((70, 5, 17))

    def run(prompts, new, rows):
        out = fused.generate_batch(prompts, generation_config=_greedy(), max_new_tokens=new,
                                   continuous_batching_config=ContinuousBatchingConfig(max_requests_per_batch=rows))
        for got, prompt in zip(out.values(), prompts):
            assert got.generated_tokens == _reference(fused, prompt, new)
        return runner.batch

    first = run(prompts, 6, 3)
    prefill = first.prefill
    second = run(prompts[1:], 30, 2)  # other rows, another cache length: new rows
    assert second is not first and (second.rows, second.max_len) != (first.rows, first.max_len)
    assert second.prefill is prefill and second.prefill_len == prefill.max_len
    longer = _prompts((600,), seed=5)
    third = run(longer, 4, 2)
    assert third.prefill is not prefill and third.prefill_len >= 600
    fourth = run(prompts[1:], 6, 3)  # needs 256 tokens: the 1,024 kept would be more than twice that
    assert fourth.prefill is not third.prefill and fourth.prefill_len == prefill.max_len


@cpu_emulated
def test_the_buffers_a_call_replaces_count_as_free(monkeypatch):
    """On a GPU without a token budget the buffers are sized from the free memory, and the buffers an earlier call
    left count as free (they are reused or replaced, never kept beside new ones): the same call twice gets the same
    buffers, and a call at more rows after it the whole budget. Here a device whose free memory is a budget of 1,000
    cache tokens beside 3 rows, less what the runner's buffers hold."""
    _, fused = stock_and_fused_lm(seed=0, **SPREAD)
    text = fused._text_model()
    runner = text.runner
    per_token, per_row = budget_mod.state_bytes(text)
    prompts = _prompts((70, 5, 17))
    # the prefill states: the batch-1 one and, with groups at these rows (3 and 6), one of each group batch
    assert batch_mod.prefill_group(3) == batch_mod.prefill_group(6)
    states = budget_mod.prefill_rows(min(batch_mod.prefill_group(3), 3))
    prefill_bytes = states * (batch_state.prefill_len_for(70) * per_token + per_row)
    device_free = (1000 * per_token + prefill_bytes + 3 * per_row) / budget_mod.DEFAULT_MEMORY_FRACTION + per_token
    held = lambda: runner.batch.nbytes() if runner.batch is not None else 0  # noqa: E731
    monkeypatch.setattr(budget_mod, "_device_free", lambda device: int(device_free) - held())

    def run(rows):
        out = fused.generate_batch(prompts, generation_config=_greedy(), max_new_tokens=6,
                                   continuous_batching_config=ContinuousBatchingConfig(max_requests_per_batch=rows))
        for got, prompt in zip(out.values(), prompts):
            assert got.status == RequestStatus.FINISHED, got.error
            assert got.generated_tokens == _reference(fused, prompt, 6)
        return runner.batch

    first = run(3)
    assert (first.rows, first.max_len) == (3, 256)  # 768 of 1,000 tokens: no cut
    assert run(3) is first
    wide = run(6)  # 3 more rows' states off the 1,000 tokens, a sixth of it in 64s: 128; the longest needs 75
    assert (wide.rows, wide.max_len) == (6, 128)


@cpu_emulated
def test_the_rows_yield_to_the_longest_request_and_stay(monkeypatch, caplog):
    """On a GPU without a token budget, rows the caller asked for (``max_requests_per_batch``, a maximum) that the free
    memory holds only below the longest request yield to it: fewer rows, said once naming the setting, and every
    request finishes with batch-1 tokens (at 9B on an H100, 256 rows asked gave rows shorter than 125 of 512
    requests, which failed). A later call with less free memory (graphs captured since) keeps those buffers while
    they hold its requests, and sizes new ones when they do not, or when their rows yielded to a request over twice
    as long as its own."""
    _, fused = stock_and_fused_lm(seed=0, **SPREAD)
    text = fused._text_model()
    runner = text.runner
    per_token, per_row = budget_mod.state_bytes(text)
    prompts = _prompts((70, 5, 17, 9))
    new = [30, 6, 6, 6]  # the longest request needs 99 cache tokens: rows of 128
    prefill_bytes = batch_state.prefill_len_for(70) * per_token + per_row  # no groups at 4 rows
    budget = {"tokens": 300}  # two rows of 128, not four: four would be rows of 64, shorter than the first request
    held = lambda: runner.batch.nbytes() if runner.batch is not None else 0  # noqa: E731
    monkeypatch.setattr(budget_mod, "_device_free", lambda device: int(
        (budget["tokens"] * per_token + prefill_bytes + 4 * per_row) / budget_mod.DEFAULT_MEMORY_FRACTION) - held())
    cb = ContinuousBatchingConfig(max_requests_per_batch=4)

    def run(news):
        out = fused.generate_batch(prompts, generation_config=_greedy(), max_new_tokens=news,
                                   continuous_batching_config=cb)
        for got, prompt, n in zip(out.values(), prompts, news):
            assert got.status == RequestStatus.FINISHED, got.error
            assert got.generated_tokens == _reference(fused, prompt, n)
        return runner.batch

    helpers.plan_mod._announced.discard("batch-budget/2/128")
    with caplog.at_level(logging.WARNING):
        first = run(new)
    assert (first.rows, first.max_len) == (2, 128)
    said = [r.getMessage() for r in caplog.records if "max_requests_per_batch=4" in r.getMessage()]
    assert len(said) == 1 and "runs 2 requests at a time" in said[0], said
    budget["tokens"] = 200  # less free memory: it would size rows of 64 + 64 now
    assert run(new) is first  # kept: it holds the call
    assert run([60, 6, 6, 6]) is not first  # the first request needs 129 tokens: new buffers
    assert (runner.batch.rows, runner.batch.max_len) == (1, 192)
    # rows that yielded to a request over twice as long as a call's are sized anew: 3 requests of at most 22 tokens
    prompts = prompts[1:]
    run([6, 6, 6])
    assert (runner.batch.rows, runner.batch.max_len) == (3, 64)


def test_the_budget_counts_the_group_prefill_states(monkeypatch):
    """On a GPU without a token budget, the prefill states come off the free memory before the rows: the batch-1
    state and one of each group batch (2, 4, ... up to ``PREFILL_GROUP``), no batch larger than the rows or the
    requests (a group never outnumbers them), a group state's rows no longer than the longest prompt a group takes
    (``FORWARD_GRAPH_MAX_LEN``) whatever the call's longest prompt; and ``group_prefill`` makes them that long. Here
    a device whose free memory is known exactly."""
    _, fused = stock_and_fused_lm(seed=0, **SPREAD)
    text = fused._text_model()
    per_token, per_row = budget_mod.state_bytes(text)
    capped = batch_state.prefill_len_for(graphs_mod.FORWARD_GRAPH_MAX_LEN)
    free = 40 * (batch_state.prefill_len_for(20000) * per_token + per_row)  # the bytes the buffers may use
    monkeypatch.setattr(budget_mod, "free_bytes", lambda text_model: free)
    fraction = budget_mod.DEFAULT_MEMORY_FRACTION

    def cache_tokens(group, rows, count, longest=100, need=None):
        # a request of half a row: the budget cuts the cache's headroom (twice the request), not the rows
        need = need or free // per_token // rows // 2
        cb = ContinuousBatchingConfig(max_requests_per_batch=rows)
        got_rows, max_len, got_prefill = budget_mod.size_buffers(text, need, count, longest, cb, lambda r: group)
        assert (got_rows, got_prefill) == (rows, batch_state.prefill_len_for(longest))
        return max_len

    def expected(group_rows, rows, longest=100):
        state = lambda n: n * per_token + per_row  # noqa: E731
        prefill_len = batch_state.prefill_len_for(longest)
        prefill = state(prefill_len) + group_rows * state(min(prefill_len, capped))
        tokens = (int(fraction * free) - prefill - rows * per_row) // per_token
        return max(64, tokens // rows // 64 * 64)

    assert budget_mod.prefill_rows(1) == 1 and budget_mod.prefill_rows(4) == 7 and budget_mod.prefill_rows(3) == 3
    assert cache_tokens(1, 8, 50) == expected(0, 8)
    assert cache_tokens(4, 8, 50) == expected(6, 8) < expected(0, 8)  # group states of batch 2 and 4
    assert cache_tokens(4, 2, 50) == expected(2, 2)  # two rows: no group of 4, its state not counted
    assert cache_tokens(4, 8, 3) == expected(2, 8)  # three requests: likewise
    # the scheduler's own rule: no groups below GROUP_HOLD_GROUPS groups of rows, so no group state either
    for rows, group_rows in ((8, 0), (4 * batch_mod.GROUP_HOLD_GROUPS, 6)):
        cb = ContinuousBatchingConfig(max_requests_per_batch=rows)
        got = budget_mod.size_buffers(text, free // per_token // rows // 2, 500, 100, cb, batch_mod.prefill_group)[1]
        assert got == expected(group_rows, rows), rows
    # a 20k-token prompt: the batch-1 state holds it, the group states only what a group may hold
    assert batch_state.prefill_len_for(20000) > capped
    assert cache_tokens(4, 8, 50, longest=20000) == expected(6, 8, longest=20000)
    buffers = batch_state.BatchState(text, text.plan, 2, 256, batch_state.prefill_len_for(20000))
    assert buffers.group_prefill(text, text.plan, 2, 100).max_len == capped
    assert buffers.group_prefill(text, text.plan, 4, 5000).max_len == capped


@cpu_emulated
def test_a_call_at_new_sizes_frees_the_old_rows_first(monkeypatch):
    """The budget counts the rows an earlier call left as free: they are gone before the new rows are allocated
    (held while allocating, 256 rows after 128 ran out of memory on an H100 at 4B and ran at 128)."""
    _, fused = stock_and_fused_lm(seed=0, **SPREAD)
    runner = fused._text_model().runner
    prompts = _prompts((70, 5, 17))

    def run(rows):
        fused.generate_batch(prompts, generation_config=_greedy(), max_new_tokens=6,
                             continuous_batching_config=ContinuousBatchingConfig(max_requests_per_batch=rows))

    run(3)
    old = weakref.ref(runner.batch.state)
    alive = []
    init = batch_state.BatchState.__init__

    def allocating(self, *args, **kwargs):
        alive.append(old() is not None)
        init(self, *args, **kwargs)

    monkeypatch.setattr(batch_state.BatchState, "__init__", allocating)
    run(2)
    assert alive == [False] and runner.batch.rows == 2


@cpu_emulated
def test_the_live_span_moves_left_when_the_cache_fills(monkeypatch, shifts):
    """Two rows of 64 cache tokens (a token budget of 2 blocks of 64): the slot reaches the end of the cache while
    requests are live, the span moves left (through chunks of 3 tokens, so overlapping moves are exercised), and every
    request's tokens stay those of batch-1 generate."""
    monkeypatch.setattr(batch_state, "SHIFT_CHUNK", 3)
    _, fused = stock_and_fused_lm(seed=1, **SPREAD)
    lengths, new = (20, 9, 30, 4, 15), [30, 40, 25, 44, 30]
    prompts = _prompts(lengths, seed=4)
    cb = _cb_config(max_requests_per_batch=2, num_blocks=2, page_size=64)
    out = fused.generate_batch(prompts, generation_config=_greedy(), max_new_tokens=new, continuous_batching_config=cb)
    assert fused.describe()["decode"]["generate_batch"]["max_len"] == 64
    assert any(d < 0 for d in shifts)
    for (rid, got), prompt, n in zip(out.items(), prompts, new):
        assert got.generated_tokens == _reference(fused, prompt, n), rid


LENGTHS_NEW = (9, 20, 40, 4, 15, 3), [40, 30, 20, 44, 30, 7]


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("windows", [False, True], ids=["marks", "windows"])
@pytest.mark.parametrize("chunk", [None, 33])
@cpu_emulated
def test_each_step_reads_the_live_rows_own_windows(monkeypatch, shifts, chunk, windows, group):
    """Before every step: each live row's ``row_start`` is its window's first valid key and its valid keys run from
    there to the slot without a gap (the attention reads the window as a range), every free row's is the cache
    length (its attention reads nothing), and ``live`` counts the live rows (the DeltaNet step skips the others),
    through joins, span moves both ways, row moves and EOS; with whole and chunked prompts, alone and prefilled in
    groups (``PREFILL_GROUP``). The tokens are batch-1
    generate's with the step's attention through the valid marks and through the windows as ranges
    (``fused_decode.ROW_WINDOWS``), which the step then asks for on every call."""
    monkeypatch.setattr(batch_state, "SHIFT_CHUNK", 3)
    monkeypatch.setattr(decode_mod, "ROW_WINDOWS", windows)
    monkeypatch.setattr(batch_mod, "PREFILL_GROUP", group)
    monkeypatch.setattr(batch_mod, "GROUP_HOLD_GROUPS", 0)  # groups (and the hold) at these few rows
    _, fused = stock_and_fused_lm(seed=1, **SPREAD)
    asked = set()
    ops = fused._text_model().plan.ops
    attention = ops.decode_attention

    def spying(*args, contiguous=False, **kwargs):
        asked.add(contiguous)
        return attention(*args, contiguous=contiguous, **kwargs)

    monkeypatch.setattr(ops, "decode_attention", spying)
    checked = []
    decode = batch_mod.BatchEngine._decode

    def checking(self):
        self._make_room()
        st, n = self.buffers.state, len(self.live)
        starts = st.row_start.tolist()
        for r in range(st.batch):
            if r < n:
                first = int(st.key_valid[r].long().argmax())
                assert st.key_valid[r, first] and starts[r] == first == self.live[r].start, (r, starts[r], first)
                # the window is contiguous, start..slot - 1 (the step's attention reads it as a range, not the marks)
                assert int(st.key_valid[r].sum()) == self.slot - first and st.key_valid[r, self.slot - 1], r
            else:
                assert starts[r] == st.max_len, (r, starts[r])
        decode(self)
        assert int(st.live) == n
        checked.append(n)

    monkeypatch.setattr(batch_mod.BatchEngine, "_decode", checking)
    grouped, start_many = [], batch_mod.BatchEngine._start_many

    def recording(self, reqs):
        grouped.append(len(reqs))
        return start_many(self, reqs)

    monkeypatch.setattr(batch_mod.BatchEngine, "_start_many", recording)
    lengths, new = LENGTHS_NEW
    prompts = _prompts(lengths, seed=4)
    cb = _cb_config(max_requests_per_batch=3, num_blocks=3, page_size=64)
    out = fused.generate_batch(prompts, generation_config=_greedy(eos_token_id=[17, 255]), max_new_tokens=new,
                               continuous_batching_config=cb, prefill_chunk=chunk)
    assert any(d < 0 for d in shifts) and any(d > 0 for d in shifts)
    assert {1, 2, 3} <= set(checked)
    assert bool(grouped) == (group > 1), grouped  # with groups, rows were loaded from a group's prefill state
    assert asked == {windows}
    for (rid, got), prompt, n in zip(out.items(), prompts, new):
        assert got.generated_tokens == _reference(fused, prompt, n, eos_token_id=[17, 255]), rid


CHUNK_LENGTHS = (5, 1, 17, 130, 9, 70, 3, 200)  # 130, 200: longer than every chunk below, prefilled in pieces
CHUNK_NEW = (6, 3, 12, 9, 1, 8, 20, 5)


@pytest.mark.parametrize("chunk,ride", [(64, True), (128, True), (7, True), (33, True), (100, True), (64, False),
                                        (33, False)])
@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.filterwarnings("error::FutureWarning")
@cpu_emulated
def test_chunked_prefill_gives_the_same_tokens(kind, chunk, ride, monkeypatch):
    """Prompts longer than ``prefill_chunk`` are prefilled a chunk per step while the running requests decode (a
    decode step between two chunks of one prompt); every request's tokens are those of the unchunked call and of
    batch-1 generate. Chunk sizes at multiples of fla's 64-token chunk and odd ones. ``ride``: the chunks run inside
    the decode step while requests decode (the mixed step), and only then; else (the mixed step blocked) through the
    fused forward before it. No deprecation warning: the chunks pass the cache under the keyword this transformers
    names (5.25 warns on ``past_key_values``)."""
    _, fused = stock_and_fused_lm(seed=0, **SPREAD) if kind == "dense" else stock_and_fused_moe_lm(seed=0, **SPREAD)
    prompts = _prompts(CHUNK_LENGTHS, seed=8)
    events = []
    chunk_step, decode, mixed = batch_mod.BatchEngine._chunk, batch_mod.BatchEngine._decode, batch_mod.mixed_step
    if not ride:
        monkeypatch.setattr(batch_mod, "mixed_step_blocker", lambda *a: "the test blocks it")

    def chunk_logged(self, tokens):
        events.append(("chunk", self.prefilling.request.request_id))
        return chunk_step(self, tokens)

    def mixed_logged(state, text_model, ids, cache, past):
        assert state.batch >= 1 and 0 < ids.shape[1] <= chunk
        events.append(("mixed", past + ids.shape[1]))
        return mixed(state, text_model, ids, cache, past)

    def decode_logged(self):
        events.append(("decode", None))
        return decode(self)

    cb = ContinuousBatchingConfig(max_requests_per_batch=3)
    whole = fused.generate_batch(prompts, generation_config=_greedy(), max_new_tokens=list(CHUNK_NEW),
                                 continuous_batching_config=cb)
    assert not events
    monkeypatch.setattr(batch_mod.BatchEngine, "_chunk", chunk_logged)
    monkeypatch.setattr(batch_mod.BatchEngine, "_decode", decode_logged)
    monkeypatch.setattr(batch_mod, "mixed_step", mixed_logged)
    out = fused.generate_batch(prompts, generation_config=_greedy(), max_new_tokens=list(CHUNK_NEW),
                               continuous_batching_config=cb, prefill_chunk=chunk)
    for (rid, got), prompt, new in zip(out.items(), prompts, CHUNK_NEW):
        assert got.status == RequestStatus.FINISHED and got.error is None, (rid, got.error)
        assert got.generated_tokens == whole[rid].generated_tokens == _reference(fused, prompt, new), rid
    chunked = {rid for kind_, rid in events if kind_ == "chunk"}
    assert chunked == {f"req_{i}" for i, n in enumerate(CHUNK_LENGTHS) if n > chunk}
    for rid in chunked:  # the running requests decode between two chunks of one prompt
        at = [i for i, event in enumerate(events) if event == ("chunk", rid)]
        assert len(at) > 1 and ("decode", None) in events[at[0] : at[-1]], rid
    rode = [i for i, (kind_, _) in enumerate(events) if kind_ == "mixed"]
    assert bool(rode) == ride
    for i in rode:  # a mixed step runs inside a decode step, for the chunk just scheduled
        assert events[i - 1] == ("decode", None) and events[i - 2][0] == "chunk"


def _copy_state(state):
    """A deep copy of a ``DecodeState``'s buffers (the same class, its own tensors)."""
    copy_ = batch_state.DecodeState.__new__(batch_state.DecodeState)
    copy_.__dict__.update(state.__dict__)
    for name in ("conv", "recurrent", "keys", "values"):
        setattr(copy_, name, {i: t.clone() for i, t in getattr(state, name).items()})
    for name in ("embeds", "positions", "slot", "key_valid"):
        setattr(copy_, name, getattr(state, name).clone())
    copy_._no_graphs()
    return copy_


def _state_tensors(state):
    return {**{f"{n}{i}": t for n in ("conv", "recurrent", "keys", "values") for i, t in getattr(state, n).items()},
            **{n: getattr(state, n) for n in ("positions", "slot", "key_valid")}}


def _check_mixed_step(fused, B, C, past, slot, device, seed, atol):
    """``mixed_step`` against its reference: the decode step of B rows on a copy of the state, then the chunk of C
    prompt tokens through the fused forward over a copy of its cache (``past`` tokens in it). Hidden states, every
    state buffer and the chunk's cache must agree."""
    from transformers.cache_utils import DynamicCache

    mixed = helpers.import_module("fused_batch_mixed")
    text_model = fused._text_model()
    config = text_model.config
    g = torch.Generator().manual_seed(seed)
    state = batch_state.DecodeState(text_model, text_model.plan, B, slot + 8)
    for t in _state_tensors(state).values():
        if t.is_floating_point():
            t.copy_(torch.randn(t.shape, generator=g) * 0.5)
    state.key_valid.copy_(torch.rand(state.key_valid.shape, generator=g) < 0.8)
    state.slot.fill_(slot)
    state.positions.copy_(torch.randint(slot, 3 * slot + 4, (1, B, 1), generator=g).expand(3, B, 1))
    state.embeds.copy_(torch.randn(state.embeds.shape, generator=g))
    prompt = torch.randint(3, config.vocab_size, (1, past + C), generator=g).to(device)
    caches = [DynamicCache(config=config) for _ in range(2)]
    with torch.no_grad():
        if past:
            for cache in caches:
                text_model(input_ids=prompt[:, :past], use_cache=True, **{batch_mod.GENERATE_CACHE_KW: cache})
        ref = _copy_state(state)
        want_rows = ref.step(text_model)
        want_last = text_model(input_ids=prompt[:, past:], use_cache=True,
                               **{batch_mod.GENERATE_CACHE_KW: caches[0]}).last_hidden_state[:, -1:]
        rows, last = mixed.mixed_step(state, text_model, prompt[:, past:], caches[1], past)
    torch.testing.assert_close(rows, want_rows, atol=atol, rtol=atol)
    torch.testing.assert_close(last, want_last, atol=atol, rtol=atol)
    for name, want in _state_tensors(ref).items():
        torch.testing.assert_close(_state_tensors(state)[name], want, atol=atol, rtol=atol, msg=name)
    compat = helpers.import_module("fused_compat")
    for i, kind in enumerate(config.layer_types[: config.num_hidden_layers]):
        read = compat.read_linear_layer if kind == "linear_attention" else compat.read_attention_layer
        for got, want in zip(read(caches[1], i), read(caches[0], i)):
            torch.testing.assert_close(got, want, atol=atol, rtol=atol, msg=f"cache layer {i}")


# (B decode rows, C chunk tokens, past prompt tokens cached, shared slot): one row; chunks of 1, inside, at and past
# fla's 64-token chunk; a first chunk (no past) and continued ones, past a multiple of 64 and not
MIXED_SHAPES = [(1, 1, 0, 3), (3, 7, 5, 9), (2, 64, 0, 20), (4, 65, 64, 6), (3, 30, 100, 40)]


@pytest.mark.parametrize("B,C,past,slot", MIXED_SHAPES)
@pytest.mark.parametrize("kind", ["dense", "moe"])
@cpu_emulated
def test_the_mixed_step_is_the_step_and_the_chunk(kind, B, C, past, slot):
    _, fused = stock_and_fused_lm(seed=1, **SPREAD) if kind == "dense" else stock_and_fused_moe_lm(seed=1, **SPREAD)
    _check_mixed_step(fused, B, C, past, slot, torch.device("cpu"), seed=B * 1000 + C, atol=2e-5)


def test_a_split_model_runs_chunks_before_the_step():
    """A model whose decode state spans devices (or whose attention runs stock's forward) does not ride chunks."""
    mixed = helpers.import_module("fused_batch_mixed")

    class Plan:
        kind_reasons = {"full_attention": "stock's forward asked for"}

        def runs(self, kind):
            return kind != "full_attention"

    class Model:
        plan = Plan()

    class State:
        multi_device = False

    assert "full_attention" in mixed.mixed_step_blocker(Model(), State())
    State.multi_device = True
    assert "device_map" in mixed.mixed_step_blocker(Model(), State())


@cpu_emulated
def test_chunked_prefill_samples_the_same_tokens():
    """Sampling draws the same tokens with and without chunks (the same per-request seeds); ``prefill_chunk`` must be
    positive."""
    _, fused = stock_and_fused_lm(seed=2, **SPREAD)
    prompts = _prompts((90, 4, 150, 11), seed=9)
    config = GenerationConfig(do_sample=True, temperature=0.8, top_k=40, pad_token_id=0, eos_token_id=255)
    cb = ContinuousBatchingConfig(max_requests_per_batch=2, seed=5)
    runs = [fused.generate_batch(prompts, generation_config=config, max_new_tokens=8, continuous_batching_config=cb,
                                 prefill_chunk=chunk) for chunk in (None, 64, 50)]
    tokens = [[o.generated_tokens for o in run.values()] for run in runs]
    assert tokens[0] == tokens[1] == tokens[2]
    with pytest.raises(ValueError, match="prefill_chunk"):
        fused.generate_batch(prompts, generation_config=config, max_new_tokens=2, prefill_chunk=0)


@cpu_emulated
def test_a_request_cancelled_while_its_prompt_is_chunked_ends_alone():
    """Cancelled between two chunks of its prompt, a request ends failed with no token; the prompt behind it and the
    running request go on with batch-1 tokens."""
    _, fused = stock_and_fused_lm(seed=0, **SPREAD)
    prompts = _prompts((9, 150, 70), seed=10)  # 9 and 70 in two length buckets: no group forms
    config = batch_mod.complete_generation_config(fused, _greedy())
    cb = ContinuousBatchingConfig(max_requests_per_batch=2)
    with torch.inference_mode(), fused._text_model().runner.lock:
        engine = batch_mod.build_engine(fused, config, cb, need=200, count=3, longest_prompt=150, prefill_chunk=32)
        requests = batch_mod.make_requests(fused, prompts, config, cb, [10, 10, 6], False)
        for req in requests:
            engine.add(req)
        engine.step()  # request 0 whole (9 tokens), request 1's first chunk (the 23 left of the 32)
        assert engine.prefilling is not None and engine.prefilling.request is requests[1]
        engine.step()
        engine.cancel("req_1")
        assert engine.prefilling is None
        while engine.busy:
            engine.step()
    assert requests[1].status == RequestStatus.FAILED and requests[1].error == "cancelled"
    assert requests[1].tokens == []
    for i in (0, 2):
        assert requests[i].status == RequestStatus.FINISHED
        assert requests[i].tokens == _reference(fused, prompts[i], requests[i].max_new), i


@pytest.mark.parametrize("delta", [-5, -2, 2, 5])
@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_move_span_matches_a_copy(monkeypatch, delta, chunk):
    monkeypatch.setattr(batch_state, "SHIFT_CHUNK", chunk)
    t = torch.arange(2 * 3 * 20, dtype=torch.float32).view(2, 3, 20)
    for lo, hi in ((5, 13), (6, 7), (5, 15)):
        want = t.clone()
        want[:, :, lo + delta : hi + delta] = t[:, :, lo:hi]
        got = t.clone()
        batch_state.move_span(got, 2, lo, hi, delta)
        assert torch.equal(got, want), (lo, hi)


@cpu_emulated
def test_eos_stops_each_request_alone():
    _, fused = stock_and_fused_lm(seed=0, **SPREAD)
    prompts = _prompts(LENGTHS[:5])
    free = [_reference(fused, p, 12) for p in prompts]
    # request 0 stops at the first token it has not emitted before (from its third on); the others stop where they
    # emit it, or run to 12
    stop = next(i for i in range(2, 12) if free[0][i] not in free[0][:i])
    eos = free[0][stop]
    out = fused.generate_batch(prompts, generation_config=_greedy(eos_token_id=eos), max_new_tokens=12,
                               continuous_batching_config=ContinuousBatchingConfig(max_requests_per_batch=2))
    for (rid, got), prompt, tokens in zip(out.items(), prompts, free):
        want = tokens[: tokens.index(eos) + 1] if eos in tokens else tokens
        assert got.generated_tokens == want == _reference(fused, prompt, 12, eos_token_id=eos), rid
    assert len(out["req_0"].generated_tokens) == stop + 1 < 12


@cpu_emulated
def test_processors_that_read_the_sequence_and_logprobs_match_generate():
    """Processors that read each request's own sequence (kept on the device per row, moved with its row): a
    repetition penalty, no repeated token (``no_repeat_ngram_size=1``: every earlier token banned), ``min_new_tokens``;
    the log-probabilities are those of ``generate``'s processed scores."""
    _, fused = stock_and_fused_lm(seed=2, **SPREAD)
    prompts = _prompts(LENGTHS[:5], seed=5)
    new = [7, 3, 9, 4, 6]  # request 1 leaves before request 0: request 2 moves into row 1 mid-run, its sequence too
    kw = dict(repetition_penalty=1.3, no_repeat_ngram_size=1, min_new_tokens=3)
    cb = ContinuousBatchingConfig(max_requests_per_batch=2, return_logprobs=True)
    out = fused.generate_batch(prompts, generation_config=_greedy(**kw), max_new_tokens=new,
                               continuous_batching_config=cb)
    for (rid, got), prompt, n in zip(out.items(), prompts, new):
        with torch.no_grad():
            ref = fused.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0,
                                 eos_token_id=255, return_dict_in_generate=True, output_scores=True, **kw)
        tokens = ref.sequences[0, len(prompt):].tolist()
        assert got.generated_tokens == tokens, rid
        want = [torch.log_softmax(s[0], -1)[t].item() for s, t in zip(ref.scores, tokens)]
        assert got.logprobs == pytest.approx(want, abs=1e-5), rid


@cpu_emulated
def test_sampling_is_reproducible_per_request_seed_and_independent_of_the_batch():
    _, fused = stock_and_fused_lm(seed=2, **SPREAD)
    prompts = _prompts(LENGTHS[:5], seed=6)
    others = _prompts((8, 2), seed=7)
    config = GenerationConfig(do_sample=True, temperature=0.8, top_k=40, pad_token_id=0, eos_token_id=255)

    def run(inputs, rows, seed=11):
        cb = ContinuousBatchingConfig(max_requests_per_batch=rows, seed=seed)
        out = fused.generate_batch(inputs, generation_config=config, max_new_tokens=10, continuous_batching_config=cb)
        return [o.generated_tokens for o in out.values()]

    first = run(prompts, 2)
    assert run(prompts, 2) == first  # the same call again
    assert run(prompts, 5) == first  # all at once: other rows, other row buckets
    assert run([prompts[0], *others], 3)[0] == first[0]  # other requests beside it
    assert run(prompts, 2, seed=12) != first
    torch.manual_seed(0)
    unseeded = run(prompts, 2, seed=None)
    torch.manual_seed(0)
    assert run(prompts, 2, seed=None) == unseeded


@cpu_emulated
def test_a_request_over_the_budget_fails_alone():
    _, fused = stock_and_fused_lm(seed=0, **SPREAD)
    prompts = _prompts((6, 40, 9))
    cb = _cb_config(max_requests_per_batch=2, num_blocks=1, page_size=64)  # 64 cache tokens in all
    out = fused.generate_batch(prompts, generation_config=_greedy(), max_new_tokens=[5, 40, 7],
                               continuous_batching_config=cb)
    assert out["req_1"].status == RequestStatus.FAILED
    assert "needs 79 cache tokens" in out["req_1"].error and "num_blocks" in out["req_1"].error
    for rid, prompt, new in (("req_0", prompts[0], 5), ("req_2", prompts[2], 7)):
        assert out[rid].status == RequestStatus.FINISHED
        assert out[rid].generated_tokens == _reference(fused, prompt, new)
    # a budget that holds the request, not at the rows asked: the rows yield (one of 128 tokens) and it runs
    cb = _cb_config(max_requests_per_batch=2, num_blocks=2, page_size=64)
    out = fused.generate_batch(prompts, generation_config=_greedy(), max_new_tokens=[5, 40, 7],
                               continuous_batching_config=cb)
    assert fused.describe()["decode"]["generate_batch"]["rows"] == 1
    for (rid, got), prompt, new in zip(out.items(), prompts, [5, 40, 7]):
        assert got.status == RequestStatus.FINISHED, got.error
        assert got.generated_tokens == _reference(fused, prompt, new), rid


@cpu_emulated
def test_a_group_out_of_memory_prefills_its_prompts_alone(monkeypatch):
    """A group prefill that runs out of memory (its state or its forward) is said once, and its prompts are
    prefilled one at a time instead, each with batch-1 generate's tokens."""
    monkeypatch.setattr(batch_mod, "PREFILL_GROUP", 4)
    monkeypatch.setattr(batch_mod, "GROUP_HOLD_GROUPS", 0)
    _, fused = stock_and_fused_lm(seed=0, **SPREAD)
    tried = []

    def no_memory(self, *args):
        tried.append(args[-2])
        raise torch.OutOfMemoryError("CUDA out of memory (test)")

    monkeypatch.setattr(batch_state.BatchState, "group_prefill", no_memory)
    prompts = _prompts((9, 11, 12, 10, 5))  # one length bucket: they group
    helpers.plan_mod._announced.difference_update(
        [k for k in helpers.plan_mod.announced() if k.startswith("batch-group-oom/")])
    out = fused.generate_batch(prompts, generation_config=_greedy(), max_new_tokens=6,
                               continuous_batching_config=ContinuousBatchingConfig(max_requests_per_batch=5))
    assert tried and any(k.startswith("batch-group-oom/") for k in helpers.plan_mod.announced())
    for got, prompt in zip(out.values(), prompts):
        assert got.status == RequestStatus.FINISHED, got.error
        assert got.generated_tokens == _reference(fused, prompt, 6)


@cpu_emulated
def test_out_of_memory_fails_only_what_it_hits(monkeypatch):
    """The buffers halve their rows until they fit (said once); a prompt whose prefill runs out of memory fails alone;
    an error in a decode step ends the requests still running and keeps every finished output."""
    _, fused = stock_and_fused_lm(seed=0, **SPREAD)
    runner = fused._text_model().runner
    make, prefill, decode = runner.batch_state, batch_mod.BatchEngine._prefill, batch_mod.BatchEngine._decode

    def small_only(text_model, rows, *args):
        if rows > 1:
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return make(text_model, rows, *args)

    def prefill_oom(self, req):
        if len(req.prompt) == 70:
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return prefill(self, req)

    steps = []

    def decode_then_fail(self):
        steps.append(1)
        if len(steps) == 25:
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return decode(self)

    monkeypatch.setattr(runner, "batch_state", small_only)
    monkeypatch.setattr(batch_mod.BatchEngine, "_prefill", prefill_oom)
    monkeypatch.setattr(batch_mod.BatchEngine, "_decode", decode_then_fail)
    prompts = _prompts(LENGTHS)
    out = fused.generate_batch(prompts, generation_config=_greedy(), max_new_tokens=list(NEW),
                               continuous_batching_config=ContinuousBatchingConfig(max_requests_per_batch=4))
    assert any(key.startswith("batch-oom/") for key in helpers.plan_mod.announced())
    assert fused.describe()["decode"]["generate_batch"]["rows"] == 1
    assert "out of memory prefilling its 70-token prompt" in out["req_4"].error
    finished = [rid for rid, o in out.items() if o.status == RequestStatus.FINISHED]
    failed = [rid for rid, o in out.items() if o.status == RequestStatus.FAILED and "OutOfMemoryError" in o.error]
    assert finished and failed and len(finished) + len(failed) + 1 == len(prompts)
    for rid in finished:
        i = int(rid.removeprefix("req_"))
        assert out[rid].generated_tokens == _reference(fused, prompts[i], NEW[i]), rid


@cpu_emulated
def test_the_result_is_transformers_generate_batch_result():
    stock, fused = stock_and_fused_lm(seed=0, **SPREAD)
    prompts = _prompts((4, 7))
    with pytest.raises(ValueError, match="linear_attention"):  # the issue: stock refuses Qwen3.5
        stock.generate_batch(prompts, generation_config=_greedy(max_new_tokens=2))
    config = GenerationConfig(do_sample=True, num_return_sequences=2, max_new_tokens=3, pad_token_id=0,
                              eos_token_id=255)
    out = fused.generate_batch(prompts, generation_config=config, record_timestamps=True)
    assert list(out) == ["req_0__child#0", "req_0", "req_1__child#0", "req_1"]  # transformers' ids and order
    for rid, got in out.items():
        assert type(got) is GenerationOutput and got.request_id == rid
        assert got.prompt_ids == prompts[int(rid[4])] and len(got.generated_tokens) == 3
        assert got.status == RequestStatus.FINISHED and got.is_finished() and got.error is None
        assert got.logprobs == [] and len(got.timestamps) == 3
        assert got.created_time <= got.lifespan[0] <= got.lifespan[1]
    assert fused.generate_batch([]) == {}


@cpu_emulated
def test_without_the_fused_path_each_request_runs_generate(caplog):
    stock, fused = stock_and_fused_lm(seed=0, fused_kernels=False, **SPREAD)
    prompts = _prompts(LENGTHS[:3])
    with caplog.at_level(logging.WARNING):
        out = fused.generate_batch(prompts, generation_config=_greedy(), max_new_tokens=list(NEW[:3]))
    assert "generate_batch runs each request through generate() at batch 1" in caplog.text
    assert "fused_kernels is off" in caplog.text
    for (rid, got), prompt, new in zip(out.items(), prompts, NEW):
        assert got.status == RequestStatus.FINISHED
        assert got.generated_tokens == _reference(stock, prompt, new, stock=True), rid


@cpu_emulated
def test_the_manager_streams_tokens_and_cancels():
    """``init_continuous_batching`` gives the fused manager, which transformers' own context manager starts and stops:
    a streaming request's outputs grow one token at a time up to its finished one; a cancelled request ends failed
    with the tokens so far; the others match batch-1 generate."""
    _, fused = stock_and_fused_lm(seed=0, **SPREAD)
    prompts = _prompts(LENGTHS[:4])
    cb = ContinuousBatchingConfig(max_requests_per_batch=2)
    with fused.continuous_batching_context_manager(generation_config=_greedy(max_new_tokens=6),
                                                   continuous_batching_config=cb) as manager:
        assert type(manager).__name__ == "FusedBatchManager"
        streamed = manager.add_request(prompts[0], streaming=True, max_new_tokens=5)
        long = manager.add_request(prompts[1], max_new_tokens=4000)
        rest = manager.add_requests(prompts[2:])
        outputs = list(manager.request_id_iter(streamed))
        manager.cancel_request(long)
        results = {}
        while len(results) < 3:
            result = manager.get_result(timeout=30)
            assert result is not None, results
            results[result.request_id] = result
    assert [len(o.generated_tokens) for o in outputs] == [1, 2, 3, 4, 5]
    assert outputs[-1].status == RequestStatus.FINISHED and outputs[-2].status == RequestStatus.DECODING
    assert outputs[-1].generated_tokens == _reference(fused, prompts[0], 5)
    assert results[long].status == RequestStatus.FAILED and results[long].error == "cancelled"
    assert len(results[long].generated_tokens) < 4000
    for rid, prompt in zip(rest, prompts[2:]):
        assert results[rid].generated_tokens == _reference(fused, prompt, 6), rid
    assert not manager.is_running()



@cpu_emulated
def test_the_manager_sizes_its_prefill_state_once(monkeypatch):
    """The manager does not know its prompts in advance: its prefill state holds from the start the longest request
    its rows are sized for, so prompts of growing lengths never replace it (a state grown per longer prompt frees
    every prompt graph captured so far). The tokens stay batch-1 ``generate``'s."""
    _, fused = stock_and_fused_lm(seed=0, **SPREAD)
    grown = []
    grow = batch_state.BatchState.grow_prefill
    monkeypatch.setattr(batch_state.BatchState, "grow_prefill", lambda self, *a: grown.append(a[-1]) or grow(self, *a))
    prompts = _prompts((5, 70, 300, 700))
    cb = ContinuousBatchingConfig(max_requests_per_batch=2)
    with fused.continuous_batching_context_manager(generation_config=_greedy(max_new_tokens=3),
                                                   continuous_batching_config=cb) as manager:
        ids = [manager.add_request(p) for p in prompts]
        results = {}
        while len(results) < len(ids):
            result = manager.get_result(timeout=30)
            assert result is not None, results
            results[result.request_id] = result
    assert not grown, grown
    for rid, prompt in zip(ids, prompts):
        assert results[rid].generated_tokens == _reference(fused, prompt, 3), rid


def _top(model, prompt, tokens, k):
    """For each of ``tokens`` (generated after ``prompt``), the ``k`` likeliest tokens at its position (``model``:
    the stock twin)."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
    return [set(row.topk(k).indices.tolist()) for row in logits]


@cpu_emulated
def test_the_manager_takes_each_requests_sampling():
    """``add_request(..., temperature=, top_k=, top_p=)``, as ``transformers serve`` sends them: under a greedy config
    a request with top_k = 1 and one with none decode greedily beside sampling requests (rows of different rules in
    one step), a sampling request's tokens each lie in its top-k and are not all the greedy ones, and rerun with the
    same seed it draws the same; under a sampling config top_k = 1 is greedy. A bad value is refused naming it."""
    stock, fused = stock_and_fused_lm(seed=0, **SPREAD)
    prompts = _prompts(LENGTHS[:4])
    new = 10

    def run(config, settings):
        cb = ContinuousBatchingConfig(max_requests_per_batch=4, seed=7)
        with fused.continuous_batching_context_manager(generation_config=config,
                                                       continuous_batching_config=cb) as manager:
            ids = [manager.add_request(p, max_new_tokens=new, **kw) for p, kw in zip(prompts, settings)]
            results = {}
            while len(results) < len(ids):
                result = manager.get_result(timeout=30)
                assert result is not None, results
                results[result.request_id] = result
        return [results[i].generated_tokens for i in ids]

    hot = dict(temperature=3.0, top_k=20)
    settings = [{}, dict(top_k=1), hot, dict(hot, top_p=0.9)]
    first, again = run(_greedy(), settings), run(_greedy(), settings)
    greedy = [_reference(fused, p, new) for p in prompts]
    assert first[0] == greedy[0] and first[1] == greedy[1]
    for i in (2, 3):
        assert first[i] == again[i], i  # its own seeded generator
        assert first[i] != greedy[i], i
        assert all(t in top for t, top in zip(first[i], _top(stock, prompts[i], first[i], 20))), i
    sampled = run(GenerationConfig(do_sample=True, temperature=3.0, pad_token_id=0, eos_token_id=255),
                  [dict(top_k=1), {}, dict(top_k=1), {}])
    assert sampled[0] == greedy[0] and sampled[2] == greedy[2]
    manager = fused.init_continuous_batching(generation_config=_greedy())
    for bad, match in ((dict(temperature=0.0), "temperature must be > 0"), (dict(top_k="5"), "top_k must be int"),
                       (dict(top_p=1.5), r"top_p must be in \(0, 1\]")):
        with pytest.raises((ValueError, TypeError), match=match):
            manager.add_request(prompts[0], **bad)


@cpu_emulated
def test_transformers_serve_drives_the_manager():
    """``transformers serve --continuous-batching``'s runner (transformers' ``CBGenerateRunner``, where the installed
    transformers has it) over the fused manager, as the server calls it: a greedy request gives batch-1 tokens, a
    sampling one its own seeded draws within its top-k; the attributes it reads (``background_thread_status``,
    ``logit_processor.supported_keys``) are there."""
    import transformers

    try:
        from transformers.cli.serving.utils import CBGenerateRunner as runner_cls
    except Exception as err:  # noqa: BLE001 - older releases: another module layout, or serving extras missing
        pytest.skip(f"transformers {transformers.__version__} has no serve continuous-batching runner here ({err})")
    stock, fused = stock_and_fused_lm(seed=0, **SPREAD)
    fused.generation_config = _greedy()
    prompts = _prompts(LENGTHS[:2])
    finished, done = {}, threading.Event()

    def send_results(ids, tokens, ended):
        for request_id, result in ended:
            finished[request_id] = result
        if len(finished) == 2:
            done.set()

    runner = runner_cls(fused, None, send_results, ContinuousBatchingConfig(max_requests_per_batch=2))
    assert runner.manager.background_thread_status.fatal_error is None
    base = dict(max_new_tokens=8, eos_token_id=255)
    runner.generate(1, {"input_ids": prompts[0]}, dict(base, do_sample=False, temperature=None, top_k=None,
                                                        top_p=None), stream=False)
    runner.generate(2, {"input_ids": prompts[1]}, dict(base, do_sample=True, temperature=2.0, top_k=5, top_p=None,
                                                        seed=3), stream=False)
    assert done.wait(60), finished
    runner.manager.stop(block=True, timeout=30)
    # The runner's output thread polls `get_result(timeout=1)` until a fatal error, forever: on the stopped manager
    # each poll must wait its timeout, not return at once (a spinning thread held the GIL for the rest of the suite).
    began = time.monotonic()
    assert runner.manager.get_result(timeout=0.3) is None and time.monotonic() - began >= 0.25
    assert runner.manager.get_result() is None
    assert not isinstance(finished[1], Exception) and not isinstance(finished[2], Exception), finished
    tokens = {rid: list(getattr(r, "generated_tokens", r)) for rid, r in finished.items()}
    assert tokens[1] == _reference(fused, prompts[0], 8)
    assert all(t in top for t, top in zip(tokens[2], _top(stock, prompts[1], tokens[2], 5)))

@cpu_emulated
def test_the_manager_prefills_long_prompts_in_chunks(monkeypatch):
    """``init_continuous_batching(prefill_chunk=...)``: a long prompt added while another request streams is
    prefilled in chunks between its steps; both get batch-1 tokens."""
    _, fused = stock_and_fused_lm(seed=0, **SPREAD)
    prompts = _prompts((9, 150), seed=10)
    chunks = []
    chunk_step = batch_mod.BatchEngine._chunk

    def counting(self, tokens):
        chunks.append(tokens)
        return chunk_step(self, tokens)

    monkeypatch.setattr(batch_mod.BatchEngine, "_chunk", counting)
    manager = fused.init_continuous_batching(generation_config=_greedy(), prefill_chunk=32,
                                             continuous_batching_config=ContinuousBatchingConfig(
                                                 max_requests_per_batch=2))
    manager.start()
    try:
        short = manager.add_request(prompts[0], max_new_tokens=20, streaming=True)
        long = manager.add_request(prompts[1], max_new_tokens=6)
        results = {}
        while len(results) < 2:
            result = manager.get_result(timeout=30)
            assert result is not None, results
            if result.is_finished():
                results[result.request_id] = result
    finally:
        manager.stop(block=True)
    assert len(chunks) == 5  # 150 tokens in chunks of 32
    assert results[short].generated_tokens == _reference(fused, prompts[0], 20)
    assert results[long].generated_tokens == _reference(fused, prompts[1], 6)


def _cb_config(page_size=None, **kwargs):
    """A ContinuousBatchingConfig whose blocks hold ``page_size`` tokens (the field is `block_size` in 5.17)."""
    if page_size is not None:
        field = "page_size" if "page_size" in ContinuousBatchingConfig.__dataclass_fields__ else "block_size"
        kwargs[field] = page_size
    return ContinuousBatchingConfig(**kwargs)


# -- on the GPU (`@pytest.mark.cuda`) -----------------------------------------------------------------------------------
# They hold `fused_batch.FUSED_ON_GPU` on whatever it ships with: they are what switched it on.


@pytest.fixture
def fused_on_gpu(monkeypatch):
    monkeypatch.setattr(helpers.import_module("fused_batch"), "FUSED_ON_GPU", True)


@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.cuda
@pytest.mark.usefixtures("fused_on_gpu")
def test_greedy_matches_batch_1_generate_cuda(kind):
    """fp32 through the captured decode step at row buckets up to 4 (each captured on its second step, replayed after)
    and the captured prefill of the prompts' length buckets, on two calls; every request's tokens those of a batch-1
    fused ``generate``."""
    _, fused = stock_and_fused_lm(seed=0, **SPREAD) if kind == "dense" else stock_and_fused_moe_lm(seed=0, **SPREAD)
    fused = fused.cuda()
    prompts = _prompts((5, 1, 17, 9, 70, 3, 12, 33, 2))
    new = [24, 3, 40, 1, 16, 64, 5, 30, 48]
    cb = ContinuousBatchingConfig(max_requests_per_batch=4)
    for _ in range(2):
        out = fused.generate_batch(prompts, generation_config=_greedy(), max_new_tokens=new,
                                   continuous_batching_config=cb)
        for (rid, got), prompt, n in zip(out.items(), prompts, new):
            assert got.status == RequestStatus.FINISHED, got.error
            ids = torch.tensor([prompt], device="cuda")
            with torch.no_grad():
                want = fused.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=255)
            assert got.generated_tokens == want[0, len(prompt):].tolist(), rid
    info = fused.describe()["decode"]["generate_batch"]
    assert 4 in info["row_buckets_captured"] and set(info["row_buckets_captured"]) <= {1, 2, 4}
    assert 64 in info["prompt_buckets_captured"]  # most prompts share the 64-token bucket: replayed from its second


@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.cuda
@pytest.mark.usefixtures("fused_on_gpu")
def test_prompts_prefilled_together_match_batch_1_generate_cuda(kind, monkeypatch):
    """``PREFILL_GROUP`` 4 in fp32 on three calls: the groups' prompt graphs (batch 2 and 4 per length bucket) run
    eagerly, then are captured and replayed; every request's tokens those of a batch-1 fused ``generate``."""
    monkeypatch.setattr(batch_mod, "PREFILL_GROUP", 4)
    monkeypatch.setattr(batch_mod, "GROUP_HOLD_GROUPS", 1)  # groups at these few rows
    _, fused = stock_and_fused_lm(seed=0, **SPREAD) if kind == "dense" else stock_and_fused_moe_lm(seed=0, **SPREAD)
    fused = fused.cuda()
    prompts = _prompts(GROUP_LENGTHS)
    want = [_cuda_reference(fused, p, n) for p, n in zip(prompts, GROUP_NEW)]
    cb = ContinuousBatchingConfig(max_requests_per_batch=6)
    for _ in range(3):
        out = fused.generate_batch(prompts, generation_config=_greedy(), max_new_tokens=list(GROUP_NEW),
                                   continuous_batching_config=cb)
        for (rid, got), w in zip(out.items(), want):
            assert got.status == RequestStatus.FINISHED, got.error
            assert got.generated_tokens == w, rid
    captured = fused.describe()["decode"]["generate_batch"]["group_prompt_buckets_captured"]
    assert any(captured.values()), captured


def _cuda_reference(model, prompt, new, **kw):
    """The tokens a batch-1 fused ``generate`` on the GPU gives ``prompt``."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=new,
                             **{"do_sample": False, "pad_token_id": 0, "eos_token_id": 255, **kw})
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("chunk", [64, 33])
@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.cuda
@pytest.mark.usefixtures("fused_on_gpu")
def test_chunked_prefill_matches_batch_1_generate_cuda(kind, chunk, monkeypatch):
    """fp32: prompts longer than ``prefill_chunk`` prefilled in chunks between decode steps (the eager fused forward
    over a stock cache, ``MIXED_ON_GPU`` off: the path a model that cannot ride takes) give every request the tokens of
    a batch-1 fused ``generate``, as the unchunked call does."""
    monkeypatch.setattr(batch_mod, "MIXED_ON_GPU", False)
    _, fused = stock_and_fused_lm(seed=0, **SPREAD) if kind == "dense" else stock_and_fused_moe_lm(seed=0, **SPREAD)
    fused = fused.cuda()
    prompts = _prompts(CHUNK_LENGTHS, seed=8)
    cb = ContinuousBatchingConfig(max_requests_per_batch=4)
    out = fused.generate_batch(prompts, generation_config=_greedy(), max_new_tokens=list(CHUNK_NEW),
                               continuous_batching_config=cb, prefill_chunk=chunk)
    for (rid, got), prompt, new in zip(out.items(), prompts, CHUNK_NEW):
        assert got.status == RequestStatus.FINISHED, got.error
        assert got.generated_tokens == _cuda_reference(fused, prompt, new), rid


@pytest.mark.parametrize("chunk", [64, 33])
@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.cuda
@pytest.mark.usefixtures("fused_on_gpu")
def test_chunks_ride_the_decode_step_cuda(kind, chunk, monkeypatch):
    """fp32 on the GPU with ``fused_batch.MIXED_ON_GPU`` on: the mixed step against the decode step plus the fused
    forward at every ``MIXED_SHAPES`` shape, then chunked prefill riding on the decode step (it must ride) gives every
    request the tokens of a batch-1 fused ``generate``. The test that switched ``MIXED_ON_GPU`` on."""
    monkeypatch.setattr(batch_mod, "MIXED_ON_GPU", True)
    _, fused = stock_and_fused_lm(seed=1, **SPREAD) if kind == "dense" else stock_and_fused_moe_lm(seed=1, **SPREAD)
    fused = fused.cuda()
    for B, C, past, slot in MIXED_SHAPES:
        _check_mixed_step(fused, B, C, past, slot, torch.device("cuda"), seed=B * 1000 + C, atol=1e-4)
    rode = []
    mixed = batch_mod.mixed_step

    def mixed_logged(*args):
        rode.append(args[2].shape[1])
        return mixed(*args)

    monkeypatch.setattr(batch_mod, "mixed_step", mixed_logged)
    prompts = _prompts(CHUNK_LENGTHS, seed=8)
    cb = ContinuousBatchingConfig(max_requests_per_batch=4)
    out = fused.generate_batch(prompts, generation_config=_greedy(), max_new_tokens=list(CHUNK_NEW),
                               continuous_batching_config=cb, prefill_chunk=chunk)
    assert rode and max(rode) <= chunk
    for (rid, got), prompt, new in zip(out.items(), prompts, CHUNK_NEW):
        assert got.status == RequestStatus.FINISHED, got.error
        assert got.generated_tokens == _cuda_reference(fused, prompt, new), rid


@pytest.mark.cuda
@pytest.mark.usefixtures("fused_on_gpu")
def test_sampling_is_reproducible_per_request_seed_cuda():
    """fp32 on the GPU: each request draws from its own seeded generator, so the same call gives the same samples,
    and so do other row counts (other row buckets and graphs) and other requests beside it; another seed differs."""
    _, fused = stock_and_fused_lm(seed=2, **SPREAD)
    fused = fused.cuda()
    prompts = _prompts(LENGTHS[:5], seed=6)
    others = _prompts((8, 2, 40), seed=7)
    config = GenerationConfig(do_sample=True, temperature=0.8, top_k=40, top_p=0.95, pad_token_id=0, eos_token_id=255)

    def run(inputs, rows, seed=11):
        cb = ContinuousBatchingConfig(max_requests_per_batch=rows, seed=seed)
        out = fused.generate_batch(inputs, generation_config=config, max_new_tokens=24, continuous_batching_config=cb)
        assert all(o.status == RequestStatus.FINISHED for o in out.values())
        return [o.generated_tokens for o in out.values()]

    first = run(prompts, 2)
    assert run(prompts, 2) == first  # again: replayed from the graphs captured by the first call
    assert run(prompts, 5) == first
    assert run([prompts[0], *others], 4)[0] == first[0]
    assert run(prompts, 2, seed=12) != first


@pytest.mark.cuda
@pytest.mark.usefixtures("fused_on_gpu")
def test_memory_budget_cuda(monkeypatch):
    """A budget smaller than the requests queues them (fewer rows, said once) and fails only the requests longer than
    the whole budget, each with an error naming it, before anything of theirs runs; the others finish with batch-1
    tokens. ``max_memory_percent`` near 0 leaves one row of 64 tokens; ``num_blocks`` x ``page_size`` caps rows x
    cache."""
    _, fused = stock_and_fused_lm(seed=0, **SPREAD)
    fused = fused.cuda()
    prompts = _prompts((6, 40, 9, 20))
    new = [5, 40, 7, 30]
    for cb in (ContinuousBatchingConfig(max_memory_percent=1e-9),
               _cb_config(max_requests_per_batch=2, num_blocks=1, page_size=64)):
        out = fused.generate_batch(prompts, generation_config=_greedy(), max_new_tokens=new,
                                   continuous_batching_config=cb)
        info = fused.describe()["decode"]["generate_batch"]
        assert info["max_len"] == 64, info
        assert out["req_1"].status == RequestStatus.FAILED and "needs 79 cache tokens" in out["req_1"].error
        for i in (0, 2, 3):
            assert out[f"req_{i}"].status == RequestStatus.FINISHED, out[f"req_{i}"].error
            assert out[f"req_{i}"].generated_tokens == _cuda_reference(fused, prompts[i], new[i]), i
    assert any(key.startswith("batch-budget/") for key in helpers.plan_mod.announced())


@pytest.mark.cuda
@pytest.mark.usefixtures("fused_on_gpu")
def test_steps_do_not_wait_for_the_gpu_cuda(monkeypatch):
    """Once the row buckets' and prompt buckets' graphs are captured (two calls: a prompt bucket's graph, and a group's
    (on at these 4 rows, two groups of 4 and one prompt alone a call), is captured on its second forward), no
    scheduler step of the next call makes a synchronizing CUDA call (``torch.cuda.set_sync_debug_mode("error")``
    inside ``BatchEngine.step``: no ``.item()``, no pageable or blocking transfer; the read-back waits on its events
    only, which the mode does not count), and the token read-back reuses a few pinned host buffers rather than
    allocating per step."""
    monkeypatch.setattr(batch_mod, "GROUP_HOLD_GROUPS", 1)  # groups at these few rows: their replays checked too
    _, fused = stock_and_fused_lm(seed=0, **SPREAD)
    fused = fused.cuda()
    prompts = _prompts((5, 1, 17, 9, 60, 3, 12, 33, 2))
    new = [24, 3, 40, 1, 16, 64, 5, 30, 48]
    readbacks = []
    init = batch_mod.Readback.__init__

    def recording(self, *args):
        init(self, *args)
        readbacks.append(self)

    monkeypatch.setattr(batch_mod.Readback, "__init__", recording)
    cb = ContinuousBatchingConfig(max_requests_per_batch=4, seed=0)
    for _ in range(2):
        first = fused.generate_batch(prompts, generation_config=_greedy(), max_new_tokens=new,
                                     continuous_batching_config=cb)
    step = batch_mod.BatchEngine.step

    def strict_step(self):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return step(self)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(batch_mod.BatchEngine, "step", strict_step)
    again = fused.generate_batch(prompts, generation_config=_greedy(), max_new_tokens=new,
                                 continuous_batching_config=cb)
    assert [o.generated_tokens for o in again.values()] == [o.generated_tokens for o in first.values()]
    assert all(o.error is None for o in again.values())
    # in flight at once: the step read late, the step queued, and the first tokens of the prompts admitted between
    # (at most the 4 rows, plus the one request of a single token, which takes none)
    assert readbacks[-1].allocated <= 2 + 4 + 1, readbacks[-1].allocated


@pytest.mark.parametrize("chunk", [None, 64])
@pytest.mark.cuda
@pytest.mark.usefixtures("fused_on_gpu")
def test_bf16_first_tokens_and_reruns_cuda(chunk):
    """bf16: the first token of every request comes from the same batch-1 prefill as ``generate``'s (equal; with
    chunks only for the prompts not chunked, the others' prefill rounds in another order), and a second call gives the
    same tokens (the same graphs, the same per-request seeds)."""
    _, fused = stock_and_fused_lm(seed=0, dtype=torch.bfloat16, **SPREAD)
    fused = fused.cuda()
    prompts = _prompts((5, 17, 9, 70, 3, 12, 150))
    cb = ContinuousBatchingConfig(max_requests_per_batch=4)
    runs = [fused.generate_batch(prompts, generation_config=_greedy(), max_new_tokens=32,
                                 continuous_batching_config=cb, prefill_chunk=chunk) for _ in range(2)]
    assert [o.generated_tokens for o in runs[0].values()] == [o.generated_tokens for o in runs[1].values()]
    for got, prompt in zip(runs[0].values(), prompts):
        assert got.status == RequestStatus.FINISHED and len(got.generated_tokens) == 32, got.error
        if chunk is None or len(prompt) <= chunk:
            assert got.generated_tokens[0] == _cuda_reference(fused, prompt, 1)[0]


def test_a_gpu_model_takes_the_scheduler_only_when_switched_on(monkeypatch):
    """With ``FUSED_ON_GPU`` off, a GPU model serves generate_batch through generate (the reason is the one its log
    line gives); the CPU emulation always, and a GPU with the switch on, take the scheduler. It ships on: its CUDA
    tests passed on the H200."""
    import types

    fused_batch = helpers.import_module("fused_batch")
    config = GenerationConfig(do_sample=False)
    model = types.SimpleNamespace(fused_plan=types.SimpleNamespace(decode_reason=None, device=torch.device("cuda")))
    monkeypatch.setattr(fused_batch, "FUSED_ON_GPU", False)
    assert "switched off on a GPU" in fused_batch.batch_blocker(model, config)
    monkeypatch.setattr(fused_batch, "FUSED_ON_GPU", True)
    assert fused_batch.batch_blocker(model, config) is None
    assert helpers.import_module("fused_batch").FUSED_ON_GPU is True  # as shipped
    model.fused_plan.device = torch.device("cpu")
    monkeypatch.setattr(fused_batch, "FUSED_ON_GPU", False)
    assert fused_batch.batch_blocker(model, config) is None
