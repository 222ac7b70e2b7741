# Copyright 2026 The Qwen3.5 fused-kernels authors. Licensed under the Apache License, Version 2.0.
"""``generate_batch`` on the fused path: many requests through one decode state, each joining and leaving the running
batch at any step (continuous batching), and the slow fallback where the fused path does not run.

transformers' ``generate_batch`` (its continuous-batching API, also behind ``transformers serve``) refuses Qwen3.5:
its paged cache has no linear-attention layer type. :func:`generate_batch` takes the same arguments and returns the
same result, request id -> ``GenerationOutput``, on the fused dense and MoE classes.

The scheduler (:class:`BatchEngine`) over the rows of a :class:`BatchState` (``fused_batch_state``), one iteration
(:meth:`BatchEngine.step`):

1. admit waiting requests into free rows: each prompt runs the batch-1 fused prefill (replayed from its prompt-length
   bucket's graph), its first token is chosen from the prompt's logits, and its state is copied into the next free
   row so that its keys end at the shared slot (the live span moved right first when the prompt is longer); with
   ``prefill_chunk``, at most that many prompt tokens run between two steps, and a longer prompt runs a chunk per
   step over a stock cache (:meth:`BatchEngine._chunk`) before it joins the same way, its chunk riding on the decode
   step while requests decode (``fused_batch_mixed``: one GEMM a projection over the decode rows and the chunk);
   from 64 rows on (``prefill_group``), whole prompts of one length bucket that join at one step run one batched
   prefill, up to ``PREFILL_GROUP`` of them (:meth:`BatchEngine._start_many`);
2. one decode step for rows 0..n-1 (rows stay packed: a request that leaves hands its row to the last one), at the
   smallest row bucket >= n, replayed from that bucket's CUDA graph; first, the live span moves left when the slot has
   reached the end of the cache or the dead prefix has grown to half of what the step reads;
3. each request's token by its own rule (:class:`TokenRule`: its logits processors, argmax or a draw from its own
   seeded generator), written back on the device as the next step's input;
4. the host reads each step's tokens one step late (``READ_LAG``), so the GPU always holds a step queued and the host
   never waits for it. A request leaves its row once it has been given ``max_new_tokens`` steps (known on the host)
   or when its EOS is read (its row then ran one step more, whose token is dropped).
"""

import copy
import time
from collections import deque
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import DynamicCache
from transformers.utils import logging

from .fused_compat import (
    BATCH_OUTPUT_REASON,
    FUSED_GENERATION_MODES,
    GENERATE_CACHE_KW,
    RequestStatus,
    complete_generation_config,
    generation_mode_name,
    generation_output,
    prepare_special_tokens,
)
from .fused_batch_budget import allocate, size_buffers, sized_for
from .fused_batch_mixed import mixed_step, mixed_step_blocker
from .fused_batch_rule import TokenRule, device_tokens, request_config
from .fused_decode import FusedDecodeCache
from .fused_generate import graph_head, step_logits
from .fused_graphs import FORWARD_GRAPH_MAX_LEN, forward_len_bucket
from .fused_plan import announce

logger = logging.get_logger(__name__)

# The host reads a step's tokens after it has queued the next step: it then waits on a step the GPU finished while it
# ran the one after, never on the step it just queued. A request that stops on EOS runs this many steps more.
READ_LAG = 1
# The live span also moves left when its dead prefix (keys of requests that left, which every step still reads) is at
# least this long and at least half of the keys the step reads.
COMPACT_MIN = 256
# Prompt tokens prefilled between two decode steps when the caller sets none (``prefill_chunk``); None: every prompt
# is prefilled whole at admission, through the batch-1 fused prefill (replayed from a captured graph per length
# bucket), holding up the running requests for its length. Chunks run the eager forward over a stock cache: which
# default serves throughput and latency best on the GPU is not measured yet.
PREFILL_CHUNK = None
# Whole prompts of one length bucket that join at one step are prefilled together, in one forward of up to this many
# (in batches of 2, 4, ... of them, each batch with its own prefill state and prompt graphs), where the rows are at
# least ``GROUP_HOLD_GROUPS`` groups; 1, or fewer rows: each prompt alone. With many rows about one request leaves a
# step, and prompts admitted one at a time would never share a forward: while requests decode and more wait, free
# rows are filled once there are this many (or as many as wait).
# 4: at 4B, 256 rows, on an H100 (one process, every bucket warmed; docs/BENCHMARKS.md) the 512 prompts took 8.58 s of
# GPU time in groups of up to 4 (16.2 us a prompt token in the batches of 4), 8.80 s in groups of up to 2 and 9.58 s
# alone (18.5 us), and the run 20.81 / 21.02 / 21.82 s: 3.13x / 3.10x / 2.98x the static batches.
PREFILL_GROUP = 4
# Groups (and the free rows' wait for one) from this many groups of rows on: 64 rows with groups of 4. Below, a row
# would wait on a larger share of the rows, and without the wait groups seldom form (the scheduler on CPU over the
# benchmark's 512 requests at 32 rows: 33 groups among 467 prompt forwards, against 135 among 159 at 64 and 256 rows),
# while each new (length bucket, batch) still costs a first call an eager forward and a capture. Measured at 256
# rows only.
GROUP_HOLD_GROUPS = 16
# How far down the waiting queue a group looks for prompts of its first prompt's length bucket (those it takes join
# before the ones they pass).
GROUP_LOOKAHEAD = 64


def prefill_group(rows: int) -> int:
    """How many prompts of one length bucket a step prefills together at ``rows`` rows (1: each alone)."""
    group = max(1, PREFILL_GROUP)
    return group if rows >= GROUP_HOLD_GROUPS * group else 1


@dataclass(eq=False)
class Request:
    """One request of a ``generate_batch`` call, as the scheduler tracks it (``output()`` is what the caller gets).

    ``row``: its row of the batch state while it decodes (None before, and once it has been given all its steps);
    ``start``: the cache index of its first key; ``issued``: tokens chosen for it on the device so far; ``tokens``:
    those the host has read."""

    request_id: str
    prompt: list[int]
    max_new: int
    eos: frozenset
    seed: int
    timestamps: bool = False
    streaming: bool = False  # the manager hands out its output after every token it is given
    created: float = field(default_factory=time.perf_counter)
    status: RequestStatus = RequestStatus.PENDING
    error: str | None = None
    lifespan: tuple = (-1, -1)
    tokens: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    times: list = field(default_factory=list)
    row: int | None = None
    start: int = 0
    issued: int = 0
    prompt_ids: torch.Tensor | None = None  # [P] on the model's device, once admitted
    processors: object = None  # its own LogitsProcessorList, when one reads the sequence
    generator: torch.Generator | None = None  # its own, when sampling
    settings: tuple = ()  # its own sampling settings, sorted (name, value) pairs (``sampling_settings``); (): none
    rule: object = None  # the token rule its settings give (``TokenRule.prepare``)

    @property
    def done(self) -> bool:
        return self.status >= RequestStatus.FINISHED

    def begin(self) -> None:
        self.status = RequestStatus.PREFILLING
        self.lifespan = (time.perf_counter(), -1)

    def end(self, status: RequestStatus, error: str | None = None) -> None:
        if self.lifespan[0] < 0:
            self.lifespan = (time.perf_counter(), -1)
        self.status, self.error = status, error
        self.lifespan = (self.lifespan[0], time.perf_counter())
        self.row = None

    def output(self):
        return generation_output(
            request_id=self.request_id, prompt_ids=list(self.prompt), generated_tokens=list(self.tokens),
            logprobs=list(self.logprobs), error=self.error, status=self.status, created_time=self.created,
            lifespan=self.lifespan, timestamps=list(self.times) if self.timestamps else None,
        )


@dataclass(eq=False)
class Chunked:
    """A prompt prefilled a chunk per step: its request, the stock cache its chunks continue, its tokens run."""

    request: Request
    cache: DynamicCache
    done: int = 0
    riding: int | None = None  # set by _chunk: the next decode step runs prompt tokens done..riding with its rows


class _HostSlot:
    """Pinned host memory for one entry's tokens [rows] int64 and logprobs [rows] float32, and the event recorded
    after the copies into it: reused entry after entry, so a step allocates nothing."""

    def __init__(self, rows: int):
        self.tokens = torch.empty(rows, dtype=torch.long, pin_memory=True)
        self.logprobs = torch.empty(rows, dtype=torch.float32, pin_memory=True)
        self.event = torch.cuda.Event()


class Readback:
    """The chosen tokens on their way to the host: each entry (tokens [k], logprobs [k] or None, the k requests of its
    rows) is copied without blocking into a pinned :class:`_HostSlot`, with an event; :meth:`ready` hands back the
    entries older than the last ``lag`` ones, waiting on each one's event (a step the GPU has finished, or is
    finishing). A slot goes back to the free list only once its event has been waited on and its values read, so no
    copy overwrites values not read yet; the list grows to the most entries ever in flight (``lag`` + 1 steps plus
    the first tokens of the prompts admitted between two reads) and is reused from then on. On CPU the entries are
    the tensors themselves."""

    def __init__(self, rows: int = 1):
        self.rows = rows  # the most tokens an entry holds (the batch state's rows)
        self.queue: deque = deque()
        self.free: list[_HostSlot] = []
        self.allocated = 0  # slots made so far (for the tests: constant once the steps repeat)

    def __len__(self) -> int:
        return len(self.queue)

    def _slot(self) -> _HostSlot:
        if self.free:
            return self.free.pop()
        self.allocated += 1
        return _HostSlot(self.rows)

    def push(self, tokens: torch.Tensor, logprobs: torch.Tensor | None, requests: list) -> None:
        if not tokens.is_cuda:
            self.queue.append((tokens, logprobs, None, requests))
            return
        k = tokens.shape[0]
        slot = self._slot()
        slot.tokens[:k].copy_(tokens, non_blocking=True)
        if logprobs is not None:
            slot.logprobs[:k].copy_(logprobs, non_blocking=True)
        slot.event.record(torch.cuda.current_stream(tokens.device))
        self.queue.append((slot, logprobs is not None, k, requests))

    def ready(self, lag: int):
        while len(self.queue) > lag:
            first, second, k, requests = self.queue.popleft()
            if k is None:  # CPU: the tensors themselves
                yield first.tolist(), (second.tolist() if second is not None else None), requests
                continue
            first.event.synchronize()
            tokens = first.tokens[:k].tolist()
            logprobs = first.logprobs[:k].tolist() if second else None
            self.free.append(first)  # read: the next entry may be copied into it
            yield tokens, logprobs, requests

    def clear(self) -> None:
        """Drop the entries not read (their slots are not reused: a copy into one may still be running)."""
        self.queue.clear()


class BatchEngine:
    """The continuous-batching scheduler over one :class:`BatchState` (see the module docstring). ``add`` queues a
    request; ``step`` runs one iteration; ``finished`` collects the requests that ended since it was last emptied
    (their ``output()`` is final); ``busy`` while anything is queued, decoding or unread."""

    def __init__(self, model, text_model, buffers, rule: TokenRule, max_prefill_tokens: int | None = None,
                 stream: bool = False, prefill_chunk: int | None = None):
        self.model, self.text_model, self.buffers, self.rule = model, text_model, buffers, rule
        self.plan = text_model.plan
        self.runner = text_model.runner
        self.max_prefill_tokens = max_prefill_tokens
        self.prefill_chunk = prefill_chunk  # prompt tokens prefilled between two decode steps (None: no limit)
        self.prefilling: Chunked | None = None  # the prompt being prefilled a chunk per step
        # whole prompts of one length bucket prefilled together, at most this many, and free rows waiting for a
        # group's worth (with requests decoding and more waiting): decided once, from the rows
        self.group = prefill_group(buffers.rows)
        self.hold = self.group > 1
        # chunks ride on the decode step (fused_batch_mixed) or, where they cannot, run before it: decided once
        self.ride = prefill_chunk is not None and _ride_blocker(text_model, buffers.state) is None
        self.layer_types = text_model.config.layer_types[: text_model.config.num_hidden_layers]
        self.head = graph_head(model, text_model, buffers.state)
        self.waiting: deque = deque()
        self.live: list[Request] = []  # row i's request, rows 0..n-1
        self.slot = 0  # the shared slot, as the host keeps it (the device's moves with each step)
        self.readback = Readback(buffers.rows)
        self.finished: list[Request] = []
        self.stream = stream
        self.updated: list[Request] = []  # with ``stream``: requests given tokens since it was last emptied
        if rule.per_request:
            buffers.ensure_history()
        buffers.free_all()

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.live or self.prefilling or len(self.readback))

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def step(self) -> None:
        self._admit()
        if self.live:
            self._decode()
        self._read(READ_LAG if self.live or self.waiting or self.prefilling else 0)

    def cancel(self, request_id: str) -> None:
        """End request ``request_id`` now, wherever it is (waiting, decoding, or its tokens on their way), as failed
        with the error ``"cancelled"`` and the tokens read so far; its row goes to the next request."""
        pending = (r for entry in self.readback.queue for r in entry[3])
        prefilling = [self.prefilling.request] if self.prefilling else []
        for req in [*self.waiting, *prefilling, *self.live, *pending]:
            if req.request_id == request_id and not req.done:
                if req in self.waiting:
                    self.waiting.remove(req)
                if req in prefilling:
                    self.prefilling = None
                if req.row is not None:
                    self._release(req)
                req.end(RequestStatus.FAILED, "cancelled")
                self.finished.append(req)
                return

    def fail_all(self, error: str) -> None:
        """End every request not finished yet with ``error`` (the finished ones keep their outputs)."""
        prefilling = [self.prefilling.request] if self.prefilling else []
        for req in [*self.waiting, *prefilling, *self.live, *(r for entry in self.readback.queue for r in entry[3])]:
            if not req.done:
                req.end(RequestStatus.FAILED, error)
                self.finished.append(req)
        self.waiting.clear()
        self.prefilling = None
        self.live.clear()
        self.readback.clear()

    # -- admission ---------------------------------------------------------------------------------------------------

    def _admit(self) -> None:
        """Prefill prompts into free rows, at most ``prefill_chunk`` prompt tokens (when set) and, past the first
        prompt, ``max_prefill_tokens`` between two steps. A prompt longer than ``prefill_chunk`` is prefilled a chunk
        per step (:meth:`_chunk`) while the running requests decode; the requests behind it wait for it (first come,
        first served)."""
        budget, taken = self.prefill_chunk, 0
        if self.prefilling is not None:
            taken = self._chunk(budget)
            if self.prefilling is not None:
                return
        while self.waiting and len(self.live) < self.buffers.rows:
            if self.hold and self.live and self.buffers.rows - len(self.live) < min(self.group, len(self.waiting)):
                break  # fewer free rows than a group: they fill at a later step, together
            req = self.waiting[0]
            P = len(req.prompt)
            if taken and self.max_prefill_tokens is not None and taken + P > self.max_prefill_tokens:
                break  # the rest joins at the next step: the running requests are not held up by more prompts
            chunked = budget is not None and P > budget
            if budget is not None and (taken >= budget or (not chunked and taken + P > budget)):
                break  # this step's prompt tokens are spent: it starts at the next one
            self.waiting.popleft()
            group = [req]
            try:
                if chunked:
                    taken += self._start_chunked(req, budget - taken)
                    if self.prefilling is not None:
                        return
                else:
                    group += self._partners(req, taken + P)
                    taken += sum(len(r.prompt) for r in group)
                    self._start_group(group)
            except Exception as err:  # they are in no queue now: end them here, then the caller fails the rest
                self.prefilling = None
                for r in group:
                    if not r.done:
                        self._fail(r, f"{type(err).__name__}: {err}")
                raise

    def _partners(self, first: Request, taken: int) -> list[Request]:
        """Waiting requests (among the next ``GROUP_LOOKAHEAD``) whose prompts share ``first``'s length bucket, to
        prefill with it: at most ``group - 1`` of them and the free rows but one, within ``max_prefill_tokens`` and
        ``prefill_chunk`` (``taken`` prompt tokens already counted); taken out of the queue, the others keep their
        order."""
        most = min(self.group, self.buffers.rows - len(self.live)) - 1
        if most < 1 or len(first.prompt) > FORWARD_GRAPH_MAX_LEN:
            return []
        bucket = forward_len_bucket(len(first.prompt))
        limit = min(t for t in (self.max_prefill_tokens, self.prefill_chunk, float("inf")) if t is not None)
        found, kept = [], []
        for _ in range(min(len(self.waiting), GROUP_LOOKAHEAD)):
            req = self.waiting.popleft()
            P = len(req.prompt)
            if len(found) < most and forward_len_bucket(P) == bucket and taken + P <= limit:
                found.append(req)
                taken += P
            else:
                kept.append(req)
        self.waiting.extendleft(reversed(kept))
        return found

    def _start_group(self, group: list[Request]) -> None:
        """Prefill the prompts of ``group`` (one length bucket) and give each a row: in batches of the largest power
        of two that is left (the prefill states' batches), a batch of one through :meth:`_start`."""
        group = [req for req in group if self._admissible(req)]
        while group:
            batch = 1 << (len(group).bit_length() - 1)
            part, group = group[:batch], group[batch:]
            if batch == 1:
                self._start(part[0], admitted=True)
            else:
                self._start_many(part)

    def _start_many(self, reqs: list[Request]) -> None:
        """Prefill the prompts of ``reqs`` (admitted, one length bucket) in one forward, left-padded to the longest
        (the runner pads them all on to the bucket), and give each a row as :meth:`_start` does. Out of memory, each
        runs alone instead."""
        lengths = [len(r.prompt) for r in reqs]
        longest = max(lengths)
        try:
            state = self.buffers.group_prefill(self.text_model, self.plan, len(reqs), longest)
            # ids and mask in one copy from the host (``device_tokens``: no wait for the GPU), left-padded
            flat = [t for r, P in zip(reqs, lengths) for t in [0] * (longest - P) + list(r.prompt)]
            flat += [int(j >= longest - P) for P in lengths for j in range(longest)]
            ids, mask = device_tokens(flat, state.device).view(2, len(reqs), longest).unbind(0)
            positions = (mask.cumsum(-1) - 1).clamp_(min=0)
            cache = FusedDecodeCache(state, self.layer_types, self.plan.graphs, budget=longest + 1)
            out = self.runner.run_on_cache(self.text_model, cache, input_ids=ids, attention_mask=mask,
                                           position_ids=positions)
            logits = self.model.lm_head(out.last_hidden_state[:, -1:])[:, -1]
        except torch.OutOfMemoryError:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            announce(f"batch-group-oom/{len(reqs)}", f"Qwen3.5 fused kernels: generate_batch's prefill of {len(reqs)} "
                     "prompts together ran out of GPU memory; those prompts are prefilled one at a time (groups that "
                     "fit still run together).")
            for req in reqs:
                self._start(req, admitted=True)
            return
        for i, (req, P) in enumerate(zip(reqs, lengths)):
            pad = cache._pad + longest - P

            def load(row, slot, first, req=req, i=i, pad=pad, P=P):
                self.buffers.load_prompt(row, slot, pad, P, req.prompt_ids, first, source=state, index=i)

            self._join(req, logits[i : i + 1], load)

    def _fail(self, req: Request, error: str) -> None:
        req.end(RequestStatus.FAILED, error)
        self.finished.append(req)

    def _admissible(self, req: Request) -> bool:
        """Whether ``req`` fits a row (else it fails alone, with an error naming the budget); marks it begun."""
        req.begin()
        P, L = len(req.prompt), self.buffers.max_len
        if req.max_new > 1 and P + req.max_new - 1 > L:
            self._fail(req, f"the request needs {P + req.max_new - 1} cache tokens ({P} prompt + {req.max_new} new "
                       f"- 1) and each row holds {L}: raise the budget (continuous_batching_config.num_blocks x "
                       "page_size) or lower max_requests_per_batch or max_new_tokens")
            return False
        req.prompt_ids = device_tokens(req.prompt, self.buffers.state.device)
        return True

    def _out_of_memory(self, req: Request, err: Exception) -> None:
        """``req``'s prefill ran out of memory: it fails alone, the others go on."""
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self._fail(req, f"out of memory prefilling its {len(req.prompt)}-token prompt ({str(err).splitlines()[0]})")

    def _start(self, req: Request, admitted: bool = False) -> None:
        """Prefill ``req``'s whole prompt through the batch-1 fused prefill and give it a row (``admitted``: its
        :meth:`_admissible` already passed)."""
        if not admitted and not self._admissible(req):
            return
        P = len(req.prompt)
        try:
            if P > self.buffers.prefill_len:
                self.buffers.grow_prefill(self.text_model, self.plan, P)
            pad, logits = self._prefill(req)
        except torch.OutOfMemoryError as err:  # one long prompt: it fails, the others go on
            self._out_of_memory(req, err)
            return
        self._join(req, logits, lambda row, slot, first: self.buffers.load_prompt(row, slot, pad, P, req.prompt_ids,
                                                                                   first))

    def _start_chunked(self, req: Request, tokens: int) -> int:
        """Begin prefilling ``req``'s prompt in chunks, the first of ``tokens`` tokens; returns the tokens run."""
        if not self._admissible(req):
            return 0
        self.prefilling = Chunked(req, DynamicCache(config=self.text_model.config))
        return self._chunk(tokens)

    def _chunk(self, tokens: int) -> int:
        """The next ``tokens`` tokens of the prompt being prefilled in chunks, continuing its stock cache (each DeltaNet
        layer starts from the cached conv inputs and recurrent state, each attention layer attends over the cached
        keys, as stock's chunked prefill). While requests decode (and ``ride``), the chunk rides on this step's decode
        step (:meth:`_decode`, ``fused_batch_mixed``); otherwise the fused layers' forward runs it now. After the last
        chunk the request joins the rows as a whole prompt does. Returns the tokens taken."""
        job = self.prefilling
        req, P = job.request, len(job.request.prompt)
        end = min(P, job.done + tokens)
        if self.ride and self.live:
            job.riding = end
            return end - job.done
        try:
            out = self.text_model(input_ids=req.prompt_ids[None, job.done : end], use_cache=True,
                                  **{GENERATE_CACHE_KW: job.cache})
        except torch.OutOfMemoryError as err:
            self.prefilling = None
            self._out_of_memory(req, err)
            return end - job.done
        ran = end - job.done
        self._chunk_ran(job, end, out.last_hidden_state[:, -1:])
        return ran

    def _chunk_ran(self, job: Chunked, end: int, last: torch.Tensor) -> None:
        """``job``'s prompt has run up to ``end``, ``last`` [1, 1, hidden] the final-norm hidden state of its last
        token: after the whole prompt, the request's first token and row (:meth:`_join`)."""
        req, P = job.request, len(job.request.prompt)
        job.done, job.riding = end, None
        if end == P:
            self.prefilling = None
            logits = self.model.lm_head(last)[:, -1]
            self._join(req, logits, lambda row, slot, first: self.buffers.load_stock_cache(
                row, slot, job.cache, P, req.prompt_ids, first))

    def _join(self, req: Request, logits: torch.Tensor, load) -> None:
        """``req``'s first token from its prompt's ``logits`` [1, vocab]; then, unless that was its only one, a row:
        the live span moved right first when its prompt is longer than the slot, and ``load(row, slot, first)``
        copying its prefilled state into the row so that its keys end at the slot."""
        P = len(req.prompt)
        self.rule.prepare(req)
        tokens, logprobs = self.rule.choose(logits, [req], lambda i: req.prompt_ids[None])
        req.status = RequestStatus.DECODING
        req.issued = 1
        self.readback.push(tokens, logprobs, [req])
        if req.issued >= req.max_new:
            return  # its one token is chosen: it ends when the host reads it
        if not self.live:
            self.slot = P  # a fresh span
            self.buffers.set_slot(P)
        elif P > self.slot:  # its prompt must end at the shared slot: move the live span right to make room
            lo = min(r.start for r in self.live)
            self.buffers.shift(len(self.live), lo, self.slot, P - self.slot)
            for r in self.live:
                r.start += P - self.slot
            self.slot = P
        req.row, req.start = len(self.live), self.slot - P
        load(req.row, self.slot, tokens)
        self.live.append(req)

    def _prefill(self, req: Request) -> tuple[int, torch.Tensor]:
        """The fused prefill of ``req``'s prompt into the batch-1 state (left-padded to its length bucket, replayed
        from that bucket's graph after its first prompt): returns the left padding and the prompt's last logits
        [1, vocab], as the causal LM's forward computes them in ``generate``."""
        P = len(req.prompt)
        cache = FusedDecodeCache(self.buffers.prefill, self.layer_types, self.plan.graphs, budget=P + 1)
        out = self.runner.run_on_cache(self.text_model, cache, input_ids=req.prompt_ids[None])
        logits = self.model.lm_head(out.last_hidden_state[:, -1:])[:, -1]
        return cache._pad, logits

    # -- the decode step ---------------------------------------------------------------------------------------------

    def _decode(self) -> None:
        """One decode step of the live rows (replayed from its row bucket's graph), or, with a chunk riding, the
        mixed step (eager) that runs the chunk's tokens through the same weight reads; then each row's token."""
        job = self.prefilling if self.prefilling is not None and self.prefilling.riding is not None else None
        self._make_room()
        n = len(self.live)
        self.buffers.set_live(n)
        view = self.buffers.view(n)
        weight = self.text_model.embed_tokens.weight
        torch.index_select(weight, 0, self.buffers.tokens[: view.batch], out=view.embeds.view(view.batch, -1))
        if job is None:
            out = view.decode(self.text_model, self.plan.graphs, self.head)
            logits = out if self.head is not None else step_logits(self.model, self.plan.ops, out)[:, -1]
        else:
            ids = job.request.prompt_ids[None, job.done : job.riding]
            hidden, chunk_last = mixed_step(view, self.text_model, ids, job.cache, job.done)
            logits = step_logits(self.model, self.plan.ops, hidden)[:, -1]
        tokens, logprobs = self.rule.choose(logits, self.live, self._sequence)
        buffers = self.buffers
        buffers.tokens[:n].copy_(tokens)
        if buffers.history is not None:
            buffers.history[:n].scatter_(1, buffers.lengths[:n, None], tokens[:, None])
            buffers.lengths[:n] += 1
        self.readback.push(tokens, logprobs, list(self.live))
        self.slot += 1
        for req in list(self.live):
            req.issued += 1
            if req.issued >= req.max_new:
                self._release(req)  # given all its steps: its row goes to the next request now
        if job is not None:
            self._chunk_ran(job, job.riding, chunk_last)

    def _sequence(self, i: int) -> torch.Tensor:
        """Row i's sequence so far [1, P + issued] (its prompt and chosen tokens), for processors that read it."""
        req = self.live[i]
        return self.buffers.history[i : i + 1, : len(req.prompt) + req.issued]

    def _make_room(self) -> None:
        """Move the live span [lo, slot) to the cache's start when the slot has reached the end, or when the dead
        prefix [0, lo) is at least ``COMPACT_MIN`` keys and half of what the step reads. A request never needs more
        than the cache holds (checked at admission), so after the move the slot is inside the cache."""
        lo = min(r.start for r in self.live)
        if self.slot >= self.buffers.max_len or (lo >= COMPACT_MIN and 2 * lo >= self.slot):
            self.buffers.shift(len(self.live), lo, self.slot, -lo)
            for r in self.live:
                r.start -= lo
            self.slot -= lo

    def _release(self, req: Request) -> None:
        """Free ``req``'s row; the last live row moves into it, so rows 0..n-2 stay packed."""
        row, last = req.row, len(self.live) - 1
        if row != last:
            mover = self.live[last]
            self.buffers.move_row(last, row, mover.start, self.slot)
            mover.row = row
            self.live[row] = mover
        self.live.pop()
        self.buffers.free_row(last)
        req.row = None

    # -- reading the tokens back -------------------------------------------------------------------------------------

    def _read(self, lag: int) -> None:
        for tokens, logprobs, requests in self.readback.ready(lag):
            now = time.perf_counter()
            for i, req in enumerate(requests):
                if req.done:
                    continue  # a step after its EOS, before the host saw it
                token = tokens[i]
                req.tokens.append(token)
                if logprobs is not None:
                    req.logprobs.append(logprobs[i])
                if req.timestamps:
                    req.times.append(now)
                if self.stream:
                    self.updated.append(req)
                if token in req.eos or len(req.tokens) >= req.max_new:
                    if req.row is not None:
                        self._release(req)
                    req.end(RequestStatus.FINISHED)
                    self.finished.append(req)


class EachEngine:
    """The fallback where the fused path does not run: :class:`BatchEngine`'s interface over the model's own
    ``generate``, one request per ``step`` at batch 1 (whatever path ``generate`` takes there), its seed set around
    the call. The same greedy tokens as the fused path; samples reproducible, but not the fused path's draws."""

    def __init__(self, model, generation_config, logprobs: bool):
        # the caller's config as given (None: the model's): generate completes it itself, and warns about values the
        # completion set (max_length) beside the max_new_tokens given here
        self.model, self.logprobs = model, logprobs
        self.config = model.generation_config if generation_config is None else generation_config
        self.waiting: deque = deque()
        self.finished: list[Request] = []
        self.updated: list[Request] = []

    @property
    def busy(self) -> bool:
        return bool(self.waiting)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def cancel(self, request_id: str) -> None:
        for req in list(self.waiting):
            if req.request_id == request_id:
                self.waiting.remove(req)
                req.end(RequestStatus.FAILED, "cancelled")
                self.finished.append(req)

    def fail_all(self, error: str) -> None:
        for req in self.waiting:
            req.end(RequestStatus.FAILED, error)
            self.finished.append(req)
        self.waiting.clear()

    def step(self) -> None:
        req = self.waiting.popleft()
        req.begin()
        device = self.model.device
        ids = torch.tensor([req.prompt], dtype=torch.long, device=device)
        eos = sorted(req.eos)
        config = copy.deepcopy(request_config(self.config, req.settings))
        config.max_new_tokens, config.eos_token_id = req.max_new, eos or None
        if config.pad_token_id is None:
            config.pad_token_id = (eos or [None])[0]
        config.return_dict_in_generate, config.output_scores = True, self.logprobs
        try:
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                torch.manual_seed(req.seed)
                out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                          generation_config=config)
        except Exception as err:  # noqa: BLE001 - this request fails, the others go on
            req.end(RequestStatus.FAILED, f"{type(err).__name__}: {err}")
            self.finished.append(req)
            return
        tokens = out.sequences[0, ids.shape[1] :].tolist()
        for i, token in enumerate(tokens):
            if token in req.eos:
                tokens = tokens[: i + 1]
                break
        req.tokens = tokens
        if self.logprobs:
            req.logprobs = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, tokens)]
        if req.timestamps:
            req.times = [time.perf_counter()] * len(tokens)
        req.end(RequestStatus.FINISHED)
        self.finished.append(req)


# -- building the engine ---------------------------------------------------------------------------------------------


# Whether the fused scheduler serves generate_batch on a GPU: on since its CUDA tests (tests/model/test_batch.py:
# greedy equality with batch-1 generate in fp32 at every row bucket, chunked prefill, per-request sampling seeds, the
# memory budget, no sync inside a step, bf16 reruns) passed on the H200 (transformers 5.25, docs/BENCHMARKS.md). Off,
# a GPU model serves generate_batch through generate() per request, said once.
FUSED_ON_GPU = True
# Whether prompt chunks (``prefill_chunk``) ride on the decode step on a GPU (``fused_batch_mixed``): on since its CUDA
# tests (tests/model/test_batch.py, ``test_chunks_ride_the_decode_step_cuda``: the mixed step against the step plus
# the fused forward, and fp32 greedy equality with batch-1 generate) passed (H100, transformers 5.25) and riding
# measured faster than chunks run apart (4B, H200, 128 rows, chunks of 512: 1,099 against 1,077 output tokens/s,
# docs/BENCHMARKS.md). Off, a GPU model runs each chunk through the fused forward before the decode step, said once.
# The CPU emulation always rides.
MIXED_ON_GPU = True


def _ride_blocker(text_model, state) -> str | None:
    """Why prompt chunks cannot ride on the decode step of ``state`` (announced once), else None."""
    reason = mixed_step_blocker(text_model, state)
    if reason is None and state.device.type == "cuda" and not MIXED_ON_GPU:
        reason = "the mixed step is switched off on a GPU (fused_batch.MIXED_ON_GPU)"
    if reason is not None:
        announce(f"batch/ride/{reason}", "Qwen3.5 fused kernels: generate_batch runs each prompt chunk on its own "
                 f"before the decode step, not riding on it, because {reason}.")
    return reason


def batch_blocker(model, generation_config) -> str | None:
    """None when the requests can run on the fused path, else why not (they then run through ``generate``)."""
    reason = model.fused_plan.decode_reason
    if reason is not None:
        return reason
    if model.fused_plan.device.type == "cuda" and not FUSED_ON_GPU:
        return "its fused scheduler is switched off on a GPU (fused_batch.FUSED_ON_GPU)"
    mode = generation_config.get_generation_mode()
    if mode not in FUSED_GENERATION_MODES:
        return f"the generation mode is {generation_mode_name(mode)} (fused: greedy and sampling)"
    return None


def eos_tokens(model, generation_config, eos=None) -> frozenset:
    """The EOS token ids a request stops on: ``eos``, else the generation config's, else the model config's
    (transformers' order); negative ids dropped (transformers' "no EOS")."""
    if eos is None:
        eos = generation_config.eos_token_id
    if eos is None:
        eos = getattr(model.config.get_text_config(), "eos_token_id", None)
    return frozenset(t for t in ([eos] if isinstance(eos, int) else eos or []) if t >= 0)


def base_seed(cb_config) -> int:
    """``continuous_batching_config.seed``, else one drawn from torch's default generator (so a call is reproducible
    after ``torch.manual_seed``); request i samples from its own generator seeded with this plus i."""
    seed = getattr(cb_config, "seed", None)
    return int(torch.randint(0, 2**62, (1,)).item()) if seed is None else int(seed)


def new_tokens(generation_config, prompt: list[int], max_new_tokens: int | None) -> int:
    """``max_new_tokens``, else the config's, else its ``max_length`` minus the prompt (at least 1), as ``generate``."""
    if max_new_tokens is None:
        max_new_tokens = generation_config.max_new_tokens
    if max_new_tokens is None:
        max_new_tokens = max(1, generation_config.max_length - len(prompt))
    return int(max_new_tokens)


def make_requests(model, inputs, generation_config, cb_config, max_new_tokens, record_timestamps) -> list[Request]:
    """The requests of one call, in the order and with the ids of transformers' ``generate_batch``: ``req_<i>`` per
    input, and with ``num_return_sequences`` n, ``req_<i>__child#<k>`` (k < n - 1) before each parent.
    ``max_new_tokens``: an int, one per input (a list: an extension of this repo), or None (``new_tokens``)."""
    n = max(1, generation_config.num_return_sequences or 1)
    if isinstance(max_new_tokens, (list, tuple)):
        if len(max_new_tokens) != len(inputs):
            raise ValueError(f"max_new_tokens has {len(max_new_tokens)} entries for {len(inputs)} inputs.")
        per_input = list(max_new_tokens)
    else:
        per_input = [max_new_tokens] * len(inputs)
    eos, seed = eos_tokens(model, generation_config), base_seed(cb_config)
    requests = []
    for i, (prompt, max_new) in enumerate(zip(inputs, per_input)):
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError(f"Input {i} of generate_batch is empty: every request needs a prompt token.")
        max_new = new_tokens(generation_config, prompt, max_new)
        for rid in [f"req_{i}__child#{k}" for k in range(n - 1)] + [f"req_{i}"]:
            requests.append(Request(rid, prompt, max_new, eos, seed + len(requests), record_timestamps))
    return requests


def build_engine(model, generation_config, cb_config, need: int, count: int, longest_prompt: int,
                 stream: bool = False, given_config=None, prefill_chunk: int | None = None):
    """The engine for requests of at most ``need`` cache tokens (``count`` of them, the longest prompt
    ``longest_prompt`` tokens), under ``generation_config`` (completed, as ``complete_generation_config`` returns
    it, from ``given_config``, the caller's): a :class:`BatchEngine` on the fused path, else an :class:`EachEngine`
    (said once, with the reason). ``prefill_chunk``: prompt tokens prefilled between two decode steps, longer prompts
    in chunks (None: ``PREFILL_CHUNK``). Call it under ``torch.inference_mode()``; the fused engine's calls hold the
    runner's lock."""
    logprobs = bool(getattr(cb_config, "return_logprobs", False))
    reason = batch_blocker(model, generation_config)
    if reason is not None:
        announce(f"batch/{reason}", "Qwen3.5 fused kernels: generate_batch runs each request through generate() at "
                 f"batch 1, one after another (correct, slow) because {reason}.")
        return EachEngine(model, given_config, logprobs)
    ignored = [name for name in ("stop_strings", "max_time") if getattr(generation_config, name, None)]
    if ignored:
        announce(f"batch/stopping/{ignored}", f"Qwen3.5 fused kernels: generate_batch stops a request on EOS and "
                 f"max_new_tokens only (as transformers' generate_batch); {ignored} in the generation config are "
                 "ignored.")
    text_model = model._text_model()
    device = text_model.plan.device
    prepare_special_tokens(model, generation_config, device)
    chunk = PREFILL_CHUNK if prefill_chunk is None else prefill_chunk
    if chunk is not None and chunk < 1:
        raise ValueError(f"prefill_chunk must be a positive number of tokens, got {chunk}.")
    if chunk is not None:  # longer prompts never go through the batch-1 prefill state
        longest_prompt = min(longest_prompt, chunk)
    rows, max_len, prefill_len = size_buffers(text_model, need, count, longest_prompt, cb_config, prefill_group)
    buffers = allocate(text_model, rows, max_len, prefill_len, sized_for(cb_config, count))
    rule = TokenRule(model, generation_config, device, logprobs, [0])
    return BatchEngine(model, text_model, buffers, rule, getattr(cb_config, "max_batch_tokens", None), stream,
                       chunk)


def generate_batch(model, inputs, generation_config=None, continuous_batching_config=None,
                   record_timestamps: bool = False, progress_bar: bool = False, persistent_manager: bool = False,
                   warmup: bool = True, **kwargs) -> dict:
    """transformers' ``generate_batch`` for the fused classes (see the module docstring): ``inputs`` a list of
    prompts (lists of token ids); returns request id (``req_<i>``) -> ``GenerationOutput`` in input order.

    ``generation_config`` (else the model's) is completed as ``generate`` completes it. On the fused path (greedy or
    sampling with ``fused_kernels`` on, on a GPU or the tests' CPU emulation) the requests share the decode step as
    described above; otherwise (said in one log line, with the reason) each runs through ``generate`` at batch 1,
    which is correct and slow. ``max_new_tokens`` (keyword) may be a list, one per input; ``prefill_chunk``
    (keyword, an extension of this repo) the prompt tokens prefilled between two decode steps, a longer prompt
    prefilled in chunks of it while the running requests decode (default ``PREFILL_CHUNK``).
    ``continuous_batching_config``: ``max_requests_per_batch`` (rows), ``num_blocks`` x ``page_size`` (the cache
    token budget), ``max_memory_percent``, ``max_batch_tokens`` (prompt tokens admitted between two steps),
    ``return_logprobs`` and ``seed`` are read; ``persistent_manager`` and ``warmup`` change nothing (the buffers and
    graphs stay with the model; each graph is captured on its bucket's second step). An error midway ends the
    requests not finished with it (``error``, status FAILED) and keeps the finished ones, as transformers does."""
    if not inputs:
        return {}
    if BATCH_OUTPUT_REASON is not None:
        announce("batch/output-type", "Qwen3.5 fused kernels: generate_batch returns a stand-in GenerationOutput "
                 f"with transformers' fields because {BATCH_OUTPUT_REASON}.")
    config = complete_generation_config(model, generation_config)
    max_new_tokens = kwargs.pop("max_new_tokens", None)
    prefill_chunk = kwargs.pop("prefill_chunk", None)
    if kwargs:
        announce(f"batch/kwargs/{sorted(kwargs)}", "Qwen3.5 fused kernels: generate_batch ignores the keyword "
                 f"arguments {sorted(kwargs)}, as transformers' generate_batch does (set them in the generation "
                 "config).")
    requests = make_requests(model, inputs, config, continuous_batching_config, max_new_tokens, record_timestamps)
    bar = None
    if progress_bar:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(requests), desc=f"Solving {len(requests)} requests", unit="request")
    decoding = [r for r in requests if r.max_new > 1] or requests
    need = max(len(r.prompt) + r.max_new - 1 for r in decoding)
    with torch.inference_mode(), model._text_model().runner.lock:
        engine = build_engine(model, config, continuous_batching_config, need, len(decoding),
                              max(len(r.prompt) for r in requests), given_config=generation_config,
                              prefill_chunk=prefill_chunk)
        for req in requests:
            engine.add(req)
        try:
            while engine.busy:
                engine.step()
                if bar is not None:
                    bar.update(len(engine.finished) - bar.n)
        except Exception as err:  # noqa: BLE001 - the finished requests are kept; the others end with the error
            logger.error(f"generate_batch: error during batch generation ({type(err).__name__}: {err})",
                         exc_info=True)
            engine.fail_all(f"{type(err).__name__}: {err}")
    if bar is not None:
        bar.close()
    failed = [r for r in requests if r.status == RequestStatus.FAILED]
    if failed:
        logger.error(f"Requests {[r.request_id for r in failed]} failed during generation (the first: "
                     f"{failed[0].error}).")
    return {r.request_id: r.output() for r in requests}
