# Copyright 2026 The Qwen3.5 fused-kernels authors. Licensed under the Apache License, Version 2.0.
"""The buffers ``generate_batch`` runs its requests on (:class:`BatchState`), and the row operations its scheduler
(``fused_batch``) makes on them.

One decode state of R rows (:class:`fused_decode.DecodeState`), every row an independent request; views of its first
rows at a few row counts (``ROW_BUCKETS``), each with its own captured decode step; and a batch-1 state the prompts
are prefilled in (the fused prefill, replayed from a captured graph per prompt-length bucket) before their state is
copied into a row.

How independent requests share the decode step. The step writes every row's new key / value at one cache index, the
shared ``slot`` [1], and each row attends over the indices 0..slot its ``key_valid`` row marks. So each request's
keys sit in a window that ends at the slot: a request that joins when the slot is S with a P-token prompt gets its
prompt's keys / values at [S - P, S), ``key_valid`` True there only, its conv and recurrent state copied into its row
and its positions at P. The keys are stored rotated at each request's own positions and the masks are per row, so
where a window sits in the cache does not change what the row computes. The live windows together span [lo, S), lo
the oldest live request's first index; the scheduler moves that span as a whole (:meth:`BatchState.shift`): left by
lo when the slot reaches the end of the cache (or the dead prefix [0, lo) grows large: every row reads it on a model
split over devices, below), right when a request joins whose prompt is longer than S. A free row is not read: its
outputs are ignored and its row is overwritten when a request takes it.

What a step reads. Each row's attention reads its own window, from its first key (``row_start``, kept here with every
row operation) to the slot, not the whole span [0, S) the windows share; a free row's start is L, so it reads no key.
The DeltaNet rule step runs the live rows only (``live``, set before each step): a free row of a row bucket's step
(129 live rows run the 256-row graph) neither reads nor writes its 2 MB of state a layer (4B). On a model split over
devices neither is kept, and every row reads from 0.
"""

import torch

from .fused_compat import read_attention_layer, read_linear_layer
from .fused_decode import DecodeState, decode_len_bucket
from .fused_graphs import FORWARD_GRAPH_MAX_LEN, forward_len_bucket
from .fused_plan import FusedPlan

# The decode step runs at the smallest of these row counts that holds the live requests (at most the state's R rows,
# which is a bucket too): one captured graph each, the graph of R rows not recaptured when fewer requests remain.
# Above 32 rows, finer steps (48 and 96 halfway between powers of two, then every 32 rows): a step's GEMMs and free
# rows cost by the bucket, not the live rows (4B, 256 rows, H100: the decode steps of one workload 13.04 s against
# 13.23 s with powers of two). Beyond the last entry the step runs at R.
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 160, 192, 224)
# A move of a window whose source and destination overlap goes through a temporary of at most this many tokens a
# chunk (rows x KV x chunk x D elements), so a shift never allocates a copy of the whole cache.
SHIFT_CHUNK = 1024


def prefill_len_for(prompt: int) -> int:
    """Tokens of the batch-1 prefill state for prompts of up to ``prompt`` tokens: the prompt left-padded to its
    forward length bucket, plus the one token its captured prefill is sized for, in a decode length bucket."""
    return decode_len_bucket(forward_len_bucket(prompt) + 1)


def group_len_for(prefill_len: int) -> int:
    """Tokens of a group prefill state beside a batch-1 state of ``prefill_len``: as long, up to the longest prompt a
    group takes (``FORWARD_GRAPH_MAX_LEN``: longer prompts are prefilled alone), so that a call with one 32k-token
    prompt does not size every group state for it (at 4B, 32k tokens of keys and values are 1 GiB a row)."""
    return min(prefill_len, prefill_len_for(FORWARD_GRAPH_MAX_LEN))


def row_bucket(rows: int, most: int) -> int:
    """The row count the step runs ``rows`` live requests at: the smallest ``ROW_BUCKETS`` entry >= rows, or
    ``most`` (the state's rows) beyond them."""
    for bucket in ROW_BUCKETS:
        if bucket >= rows:
            return min(bucket, most)
    return most


def move_span(t: torch.Tensor, dim: int, lo: int, hi: int, delta: int) -> None:
    """Move ``t``'s indices [lo, hi) along ``dim`` to [lo + delta, hi + delta), in place. Chunks are moved in the
    order that reads each source chunk before anything overwrites it (ascending to the left, descending to the
    right); a chunk longer than ``|delta|`` overlaps its destination and is copied through a temporary."""
    n = hi - lo
    if n <= 0 or delta == 0:
        return
    chunk = min(n, max(abs(delta), SHIFT_CHUNK))
    starts = list(range(lo, hi, chunk))
    for a in starts if delta < 0 else reversed(starts):
        size = min(chunk, hi - a)
        src = t.narrow(dim, a, size)
        t.narrow(dim, a + delta, size).copy_(src.clone() if size > abs(delta) else src)


class BatchState:
    """The buffers of ``generate_batch`` for R rows and a cache of L tokens a row (see the module docstring).

    - ``state``: the R-row :class:`DecodeState` (conv [R, conv_dim, K] and fp32 recurrent [R, HV, Dk, Dv] per
      DeltaNet layer, keys / values [R, KV, L, D] per attention layer, ``positions`` [3, R, 1], ``key_valid`` [R, L],
      the shared ``slot`` [1]);
    - ``views``: row count -> a :meth:`DecodeState.view_rows` of its first rows (its own step graph);
    - ``prefill``: a batch-1 :class:`DecodeState` of ``prefill_len`` tokens, the prompts' fused prefill target;
    - ``groups``: batch -> a :class:`DecodeState` of that many rows of ``group_len_for(prefill_len)`` tokens, where
      prompts of one length bucket are prefilled together (``group_prefill``; made on a group's first prompt);
    - ``tokens`` [R] int64: each row's last chosen token, the next step's input (it never leaves the device);
    - ``history`` [R, L + 1] int64 and ``lengths`` [R] int64: each row's prompt and chosen tokens, kept only when a
      logits processor reads the sequence (``ensure_history``).

    Every operation here is a device copy queued on the stream: none waits for the GPU.
    """

    def __init__(self, text_model, plan: FusedPlan, rows: int, max_len: int, prefill_len: int,
                 prefill: DecodeState | None = None, groups: dict | None = None):
        """``prefill``: a batch-1 state of at least ``prefill_len`` tokens to prefill in (kept from earlier buffers,
        with its prompt graphs), else a new one; ``groups``: the group prefill states kept with it."""
        self.state = DecodeState(text_model, plan, rows, max_len)
        if prefill is None:
            prefill = DecodeState(text_model, plan, 1, prefill_len)
        self.rows, self.max_len, self.prefill_len = rows, max_len, prefill.max_len
        self.prefill = prefill
        self.groups = dict(groups or {})
        if not self.state.multi_device:
            self.state.track_rows()
        self.live_rows = 0  # the host's copy of ``state.live`` (written when it changes)
        self.views = {rows: self.state}
        with torch.inference_mode(False):
            self.tokens = torch.zeros(rows, dtype=torch.long, device=self.state.device)
        self.history = None
        self.lengths = None
        self.sized_for = None  # the call's ``fused_batch_budget.sized_for`` key, set by ``allocate``

    def view(self, live: int) -> DecodeState:
        """The state the step runs ``live`` packed rows at (rows 0..live-1 hold the requests)."""
        rows = row_bucket(live, self.rows)
        view = self.views.get(rows)
        if view is None:
            view = self.views[rows] = DecodeState.view_rows(self.state, rows)
        return view

    def grow_prefill(self, text_model, plan: FusedPlan, prompt: int) -> None:
        """A prefill state for prompts of ``prompt`` tokens, in place of a smaller one (its graphs go with it)."""
        self.prefill.drop()
        self.prefill_len = prefill_len_for(prompt)
        self.prefill = DecodeState(text_model, plan, 1, self.prefill_len)

    def group_prefill(self, text_model, plan: FusedPlan, batch: int, prompt: int) -> DecodeState:
        """The state ``batch`` (> 1) prompts of up to ``prompt`` tokens are prefilled in together: the group state of
        that batch, made (or remade longer, its prompt graphs going with the old one) when needed."""
        need = max(group_len_for(self.prefill_len), prefill_len_for(prompt))
        state = self.groups.get(batch)
        if state is None or state.max_len < need:
            if state is not None:
                state.drop()
            state = self.groups[batch] = DecodeState(text_model, plan, batch, need)
        return state

    def ensure_history(self) -> None:
        if self.history is None:
            with torch.inference_mode(False):
                self.history = torch.zeros(self.rows, self.max_len + 1, dtype=torch.long, device=self.state.device)
                self.lengths = torch.zeros(self.rows, dtype=torch.long, device=self.state.device)

    def nbytes(self) -> int:
        return self.state.nbytes() + self.prefill.nbytes() + sum(g.nbytes() for g in self.groups.values())

    def drop(self, keep_prefill: bool = False) -> None:
        """Free every graph (the runner released the buffers, or replaced them), the prefill state's unless
        ``keep_prefill`` (new buffers take it over)."""
        for view in self.views.values():
            view.drop()
        if not keep_prefill:
            self.prefill.drop()
            for group in self.groups.values():
                group.drop()

    def drop_stale_graphs(self) -> None:
        """Capture again where a parameter was replaced since a capture (an adapter injected, a reload)."""
        for view in self.views.values():
            if view.graph and not view.graph_weights.unchanged():
                view.drop_graph()

    def describe(self) -> dict:
        return {
            "rows": self.rows,
            "max_len": self.max_len,
            "prefill_len": self.prefill_len,
            "cache_bytes": self.nbytes(),
            "row_buckets_captured": sorted(rows for rows, view in self.views.items() if view.graph),
            "prompt_buckets_captured": sorted(n for n, g in self.prefill.prefill_graphs.items() if g.graph),
            "group_prompt_buckets_captured": {b: sorted(n for n, g in st.prefill_graphs.items() if g.graph)
                                              for b, st in sorted(self.groups.items())},
        }

    # -- row operations ----------------------------------------------------------------------------------------------

    def load_prompt(self, row: int, slot: int, pad: int, length: int, prompt: torch.Tensor,
                    first: torch.Tensor, source: DecodeState | None = None, index: int = 0) -> None:
        """Row ``row`` <- the request row ``index`` of ``source`` (``prefill`` when None, or a group state) holds now,
        its ``length`` real tokens at [pad, pad + length) there:
        conv and recurrent state, keys / values at [slot - length, slot), ``key_valid`` True there only, positions
        ``length`` (the next token's), ``tokens[row]`` = ``first`` [1] (the token chosen from the prompt's logits);
        with a history, ``prompt`` [length] and ``first`` as its first ``length + 1`` entries."""
        st, pre = self.state, self.prefill if source is None else source
        for i, conv in st.conv.items():
            conv[row].copy_(pre.conv[i][index])
            st.recurrent[i][row].copy_(pre.recurrent[i][index])
        lo = slot - length
        for kv, src in ((st.keys, pre.keys), (st.values, pre.values)):
            for i, t in kv.items():
                t[row, :, lo:slot].copy_(src[i][index, :, pad : pad + length])
        self._finish_row(row, slot, length, prompt, first)

    def load_stock_cache(self, row: int, slot: int, cache, length: int, prompt: torch.Tensor,
                         first: torch.Tensor) -> None:
        """Row ``row`` <- a request prefilled in chunks into the stock ``cache`` (a ``DynamicCache`` holding its
        ``length`` prompt tokens, none padding), as :meth:`load_prompt` loads one from ``prefill``."""
        st = self.state
        for i, conv in st.conv.items():
            conv_state, recurrent = read_linear_layer(cache, i)
            conv[row].copy_(conv_state[0])
            st.recurrent[i][row].copy_(recurrent[0])
        lo = slot - length
        for i, keys in st.keys.items():
            k, v = read_attention_layer(cache, i)
            keys[row, :, lo:slot].copy_(k[0])
            st.values[i][row, :, lo:slot].copy_(v[0])
        self._finish_row(row, slot, length, prompt, first)

    def _finish_row(self, row: int, slot: int, length: int, prompt: torch.Tensor, first: torch.Tensor) -> None:
        """The rest of a row a prompt was loaded into: ``key_valid`` True on [slot - length, slot) only, positions
        ``length``, the first token, the history."""
        st = self.state
        st.key_valid[row].zero_()
        st.key_valid[row, slot - length : slot] = True
        if st.row_start is not None:
            st.row_start[row].fill_(slot - length)
        st.positions[:, row].fill_(length)
        self.tokens[row : row + 1].copy_(first)
        if self.history is not None:
            self.history[row, :length].copy_(prompt)
            self.history[row, length : length + 1].copy_(first)
            self.lengths[row : row + 1].fill_(length + 1)

    def move_row(self, src: int, dst: int, lo: int, hi: int) -> None:
        """Row ``dst`` <- row ``src`` (a request moving down as the rows are packed): conv / recurrent state, the
        keys / values of its window [lo, hi), ``key_valid``, positions, last token and history."""
        st = self.state
        for states in (st.conv, st.recurrent):
            for t in states.values():
                t[dst].copy_(t[src])
        for kv in (st.keys, st.values):
            for t in kv.values():
                t[dst, :, lo:hi].copy_(t[src, :, lo:hi])
        st.key_valid[dst].copy_(st.key_valid[src])
        if st.row_start is not None:
            st.row_start[dst].copy_(st.row_start[src])
        st.positions[:, dst].copy_(st.positions[:, src])
        self.tokens[dst : dst + 1].copy_(self.tokens[src : src + 1])
        if self.history is not None:
            self.history[dst].copy_(self.history[src])
            self.lengths[dst : dst + 1].copy_(self.lengths[src : src + 1])

    def shift(self, live: int, lo: int, hi: int, delta: int) -> None:
        """Move the span [lo, hi) of rows 0..live-1 to [lo + delta, hi + delta) in every attention layer's keys /
        values and in ``key_valid`` (False outside it), and set the shared slot to ``hi + delta``. One read and one
        write of the span per layer (``move_span``)."""
        st = self.state
        if live and delta:
            for kv in (st.keys, st.values):
                for t in kv.values():
                    move_span(t[:live], 2, lo, hi, delta)
            valid = st.key_valid[:live]
            move_span(valid, 1, lo, hi, delta)
            valid[:, : max(0, lo + delta)] = False
            valid[:, hi + delta :] = False
            if st.row_start is not None:
                st.row_start[:live] += delta
        st.slot.fill_(hi + delta)

    def set_slot(self, slot: int) -> None:
        self.state.slot.fill_(slot)

    def free_row(self, row: int) -> None:
        """Row ``row`` holds no request now: its attention reads no key from the next step on."""
        if self.state.row_start is not None:
            self.state.row_start[row].fill_(self.max_len)

    def free_all(self) -> None:
        """No row holds a request (a new scheduler over kept buffers)."""
        if self.state.row_start is not None:
            self.state.row_start.fill_(self.max_len)
        self.set_live(0)

    def set_live(self, live: int) -> None:
        """Rows 0..live-1 hold the requests of the next step (a device write only when the count changed)."""
        if self.state.live is not None and live != self.live_rows:
            self.state.live.fill_(live)
            self.live_rows = live
