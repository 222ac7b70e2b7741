# Copyright 2026 The Qwen3.5 fused-kernels authors. Licensed under the Apache License, Version 2.0.
""":class:`FusedRunner`: what runs the fused model beyond its layers, one per text backbone.

It owns the model's reusable GPU state and runs the calls that use it:

- the decode buckets (:class:`DecodeState`, at most ``MAX_DECODE_STATES``, least recently used freed first) and the
  caches ``generate`` gets over them; the prompt of a fused ``generate`` (eager, or replayed from a captured,
  left-padded prefill per prompt bucket) and each later token's step;
- the captured forwards (at most ``MAX_FORWARD_GRAPHS``, on one memory pool): the no-cache forward right-padded to
  its length bucket, and forwards with padding, 2D position ids or a returned cache left-padded with masked
  positions, the returned stock cache built from the bucket's state;
- the rows of ``generate_batch`` (:class:`BatchState`, one at a time: a call that needs other sizes replaces it);
- one lock: calls that use this shared state (a fused ``generate`` or ``generate_batch``, a bucketed forward) run one
  at a time, so threads sharing one model each get their single-threaded result.
"""

import copy
import threading

import torch

from .fused_batch_state import BatchState
from .fused_compat import CACHE_KWS, OUTPUT_CACHE_FIELD
from .fused_decode import DecodeState, FusedDecodeCache, decode_len_bucket, stock_cache_from_state
from .fused_graphs import (
    CAPTURE_AFTER,
    FORWARD_GRAPH_MAX_LEN,
    LRU,
    ForwardGraph,
    PrefillGraph,
    anchor_graph,
    forward_len_bucket,
)
from .fused_layers import prefill_into
from .fused_plan import FusedPlan, announce

# Decode buckets (batch size x cache length) kept per model; the least recently used beyond this is freed.
MAX_DECODE_STATES = 2
# Captured forwards kept per model (least recently used freed first). They share one memory pool, so the pool is as
# large as the largest bucket's activations, not their sum.
MAX_FORWARD_GRAPHS = 16
# Of those, the ones that return a cache (each keeps a bucket-sized conv / recurrent / K-V state: ~115 MB at the 4B
# shape and 2,048 tokens).
MAX_CACHE_FORWARD_GRAPHS = 4
# generate_batch's prefill state (and its prompt graphs) is kept for a call at new sizes while it holds the call's
# longest prompt and is at most twice the length that needs, or at most this long (128 MiB of keys / values at the 4B
# shape): a state kept from a 32k-token prompt (~2 GiB at 4B) is not pinned by calls of short prompts.
KEEP_PREFILL_TOKENS = 4096
# Arguments a bucketed forward accepts, with the values it accepts them at (anything else runs eagerly, said once).
GRAPH_NEUTRAL_KWARGS = {"return_dict": (None, True), "output_attentions": (None, False),
                        "output_hidden_states": (None, False), "output_router_logits": (None, False),
                        "cache_position": (None,)}
# Of those, the ones whose None means the config's value (stock reads `config.output_hidden_states`, ...).
CONFIG_DEFAULTED_KWARGS = ("return_dict", "output_attentions", "output_hidden_states", "output_router_logits")


def graph_blocker(config, kwargs: dict) -> str | None:
    """The first argument of ``kwargs`` a bucketed forward or prompt does not serve, as ``name=value``, or None: a
    value outside ``GRAPH_NEUTRAL_KWARGS``, or an output flag left None where ``config`` sets it (stock returns the
    hidden states of a model whose config says ``output_hidden_states=True``; the bucketed run returns none)."""
    for name, value in kwargs.items():
        if name not in ("input_ids", "inputs_embeds", "attention_mask", "position_ids", "use_cache", *CACHE_KWS) \
                and value not in GRAPH_NEUTRAL_KWARGS.get(name, (None,)):
            return f"{name}={value!r}"
    for name in CONFIG_DEFAULTED_KWARGS:
        value = getattr(config, name, None)
        if kwargs.get(name) is None and value not in GRAPH_NEUTRAL_KWARGS[name]:
            return f"{name}={value!r} (from the config)"
    return None


class MaskedForwardGraph:
    """A forward with padding, position ids or a returned cache, per (batch, length bucket): the input left-padded
    with masked positions through a :class:`PrefillGraph`. With a cache, it also writes the conv / recurrent / K-V
    state into a bucket-sized :class:`DecodeState`, from which each call builds the stock ``DynamicCache`` stock's
    forward would return: the real tokens' K/V (the tail), the conv window and the recurrent state, copied out."""

    def __init__(self, text_model, plan: FusedPlan, batch: int, length: int, with_cache: bool):
        self.prefill = PrefillGraph(batch, text_model.embed_tokens.weight.device, length)
        self.state = DecodeState(text_model, plan, batch, length) if with_cache else None

    @property
    def graph(self):
        return self.prefill.graph

    @property
    def weights(self):
        return self.prefill.weights

    def run(self, text_model, input_ids, attention_mask, position_ids, pool, capture: bool, replay: bool):
        pad = self.prefill.load(input_ids, attention_mask, position_ids)
        writer = None
        if self.state is not None:
            layer_types = text_model.config.layer_types[: text_model.config.num_hidden_layers]
            writer = FusedDecodeCache(self.state, layer_types, use_graph=False)
        hidden = self.prefill.run(text_model, writer, pool, capture, replay)
        if hidden is None:
            return None
        hidden = hidden[:, pad:].clone()
        return hidden, (None if self.state is None else stock_cache_from_state(text_model, self.state, pad))

    def drop(self) -> None:
        self.prefill.drop()


class FusedRunner:
    """The decode buckets, captured forwards, graph pool and lock of one text backbone (see the module docstring)."""

    def __init__(self, plan: FusedPlan):
        self.plan = plan
        self.lock = threading.RLock()
        self.decode_states = LRU(MAX_DECODE_STATES)
        self.forward_graphs = LRU(MAX_FORWARD_GRAPHS)
        self.forward_calls: dict = {}
        self.batch: BatchState | None = None
        self._pool = self._anchor = None

    # A copy of a model (copy.deepcopy) gets a runner of its own, empty: buffers and graphs point at the original's
    # parameters, and a lock cannot be copied.
    def __deepcopy__(self, memo):
        return FusedRunner(copy.deepcopy(self.plan, memo))

    def __getstate__(self):
        return {"plan": self.plan}

    def __setstate__(self, state):
        self.__init__(state["plan"])

    def release(self) -> None:
        """Free every decode buffer, CUDA graph and the pool (after a move, a cast, a load or a switch)."""
        with self.lock:
            self.decode_states.clear()
            self.forward_graphs.clear()
            self.forward_calls.clear()
            self.drop_batch_state()
            self._pool = self._anchor = None

    def pool(self):
        """The memory pool every forward / prompt graph of this model is captured on (None off CUDA), with its anchor
        (``anchor_graph``): a one-op graph held here until :meth:`release`, so that the pool never runs out of graphs.

        The allocator counts the graphs that use a pool; when the last one is freed while the pool still holds
        blocks (a ``generate_batch`` call at new sizes frees its buffers' prompt graphs), the next capture on that id
        fails an internal assert of the allocator, and that prompt bucket then ran without its graph: ~38 ms a prompt
        whatever its length at 4B, against ~19 us a token replayed (measured, H100). A ``torch.cuda.MemPool`` held
        instead aborted the process when garbage collection freed it before the graphs on it."""
        if self._pool is None and self.plan.graphs:
            self._pool = torch.cuda.graph_pool_handle()
            self._anchor = anchor_graph(self._pool, self.plan.device)
        return self._pool

    # -- generate_batch ----------------------------------------------------------------------------------------------

    def batch_state(self, text_model, rows: int, max_len: int, prefill_len: int) -> BatchState:
        """The buffers of a ``generate_batch`` call: ``rows`` rows of ``max_len`` cache tokens and a batch-1 prefill
        state of at least ``prefill_len`` tokens; the ones kept from an earlier call when their sizes match (their
        graphs with them), else new rows (the old freed first) over the kept prefill state when it is long enough and
        not much longer (``KEEP_PREFILL_TOKENS``): its prompt graphs, one per prompt-length bucket, are what a call's
        first prompts pay to capture (~150 ms a bucket at 4B, 16 buckets for prompts of 32-2,048 tokens), and they do
        not depend on the rows."""
        kept = self.batch
        if kept is not None and (kept.rows, kept.max_len) == (rows, max_len) and kept.prefill_len >= prefill_len:
            kept.drop_stale_graphs()
            return kept
        keep = kept is not None and prefill_len <= kept.prefill_len <= max(2 * prefill_len, KEEP_PREFILL_TOKENS)
        prefill, groups = (kept.prefill, kept.groups) if keep else (None, None)
        del kept  # the old rows are freed before the new ones are allocated (the budget counted them as free)
        self.drop_batch_state(keep_prefill=prefill is not None)
        self.batch = BatchState(text_model, self.plan, rows, max_len, prefill_len, prefill, groups)
        return self.batch

    def drop_batch_state(self, keep_prefill: bool = False) -> None:
        if self.batch is not None:
            self.batch.drop(keep_prefill)
            self.batch = None

    # -- generate ----------------------------------------------------------------------------------------------------

    def new_cache(self, text_model, batch: int, max_cache_length: int) -> FusedDecodeCache:
        """A fused decode cache for a ``generate`` call of ``batch`` rows holding up to ``max_cache_length`` tokens,
        over the model's buffers for its bucket (created, or the least recently used freed)."""
        max_len = decode_len_bucket(max_cache_length + 1)
        key = (batch, max_len)
        state = self.decode_states.get(key)
        if state is None:
            state = DecodeState(text_model, self.plan, batch, max_len)
            self.decode_states.put(key, state)
        elif state.stale_graphs():
            state.drop_graph()  # a parameter was replaced since a capture: capture again
        if self.plan.cuda_graphs and self.plan.multi_device:
            announce(
                "decode-graph/multi-device",
                "Qwen3.5 fused kernels: the model is split over several devices (device_map); the fused decode step "
                "runs without CUDA graphs (one graph cannot span devices).",
            )
        layer_types = text_model.config.layer_types[: text_model.config.num_hidden_layers]
        return FusedDecodeCache(state, layer_types, self.plan.graphs, max_cache_length + 1)

    def run_on_cache(self, text_model, cache: FusedDecodeCache, input_ids=None, attention_mask=None,
                     position_ids=None, inputs_embeds=None, **kwargs):
        """The text model's forward for a call that carries a fused decode cache: the prompt (an empty cache) or one
        token."""
        st = cache._buffers()
        x = inputs_embeds if inputs_embeds is not None else input_ids
        if x is None:
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        batch, seq_len = x.shape[:2]
        if batch != st.batch:
            raise ValueError(f"This fused decode cache holds batch size {st.batch}, got inputs of batch size {batch}.")
        if cache._seq_len + cache._pad + seq_len > st.max_len:
            raise ValueError(
                f"The fused decode cache holds {st.max_len} tokens; {cache._seq_len + cache._pad} are taken and "
                f"{seq_len} more were passed."
            )
        if cache._seq_len == 0:
            out = self._prefill(text_model, cache, input_ids, attention_mask, position_ids, inputs_embeds, kwargs)
        elif seq_len == 1:
            self._load_step_inputs(text_model, cache, input_ids, inputs_embeds, position_ids)
            out = text_model.output_class(last_hidden_state=st.decode(text_model, cache._use_graph))
        else:
            raise NotImplementedError(
                f"The fused decode cache continues one token at a time; got {seq_len} new tokens after "
                f"{cache._seq_len} cached ones. Start a new generate() call with the whole sequence instead."
            )
        cache._seq_len += seq_len
        out[OUTPUT_CACHE_FIELD] = cache
        return out

    def _prefill(self, text_model, cache, input_ids, attention_mask, position_ids, inputs_embeds, kwargs):
        st = cache._state
        seq_len = (inputs_embeds if inputs_embeds is not None else input_ids).shape[1]
        if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2):
            raise ValueError(
                "The fused decode cache needs a 2D [batch, length] padding mask (or none) for the prompt, got "
                f"{type(attention_mask).__name__}"
                f"{tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else ''}."
            )
        for kw in CACHE_KWS:
            kwargs.pop(kw, None)
        kwargs["use_cache"] = False
        out = self._bucketed_prefill(text_model, cache, input_ids, attention_mask, position_ids, inputs_embeds, kwargs)
        if out is not None:
            return out
        # The stock forward builds the prompt's masks as for an empty cache (which this is); the fused layers write
        # their state into the cache's buffers.
        with prefill_into(cache):
            out = text_model.stock_forward(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                inputs_embeds=inputs_embeds, **kwargs,
            )
        st.key_valid.zero_()
        if attention_mask is None:
            st.key_valid[:, :seq_len] = True
        else:
            st.key_valid[:, :seq_len].copy_(attention_mask.bool())
        st.slot.fill_(seq_len)
        st.load_positions(position_ids, 0, seq_len, advance=1)  # the first generated token: one past the prompt
        return out

    def _bucket_blocker(self, text_model, cache, input_ids, position_ids, inputs_embeds, kwargs) -> str | None:
        st = cache._state
        if inputs_embeds is not None or input_ids is None:
            return "the prompt came as inputs_embeds"
        if position_ids is not None and position_ids.dim() != 2:
            return "the prompt has 3D mRoPE position ids"
        if input_ids.shape[1] > FORWARD_GRAPH_MAX_LEN:
            return f"the prompt is longer than {FORWARD_GRAPH_MAX_LEN} tokens"
        padded = forward_len_bucket(input_ids.shape[1])
        if cache._budget is None or padded + cache._budget - input_ids.shape[1] > st.max_len:
            return "the padded prompt and the new tokens do not fit the cache bucket"
        extra = graph_blocker(text_model.config, kwargs)
        return f"generate passed {extra}" if extra else None

    def _bucketed_prefill(self, text_model, cache, input_ids, attention_mask, position_ids, inputs_embeds, kwargs):
        """The prompt left-padded to its length bucket (see :class:`PrefillGraph`): eagerly on the bucket's first
        prompt, replayed from the graph captured on its second. None when the prompt runs at its own length: buckets
        off, or a prompt the bucket does not cover (said once)."""
        if not self.plan.buckets:
            return None
        reason = self._bucket_blocker(text_model, cache, input_ids, position_ids, inputs_embeds, kwargs)
        if reason is not None:
            announce(f"prefill-graph/{reason}",
                     f"Qwen3.5 fused kernels: the prompt runs without a CUDA graph because {reason}.")
            return None
        st = cache._state
        seq_len = input_ids.shape[1]
        length = forward_len_bucket(seq_len)
        graph = st.prefill_graphs.get(length)
        if graph is None:
            graph = st.prefill_graphs[length] = PrefillGraph(st.batch, st.device, length)
        elif graph.graph and not graph.weights.unchanged():
            graph.drop()  # a weight moved since the capture: capture again
        st.prefill_calls[length] = st.prefill_calls.get(length, 0) + 1
        pad = graph.load(input_ids, attention_mask, position_ids)
        capture = self.plan.graphs and st.prefill_calls[length] >= CAPTURE_AFTER
        hidden = graph.run(text_model, cache, self.pool(), capture, replay=self.plan.graphs)
        if hidden is None:
            return None  # capture failed (announced): this prompt runs eagerly at its own length
        st.key_valid.zero_()
        st.key_valid[:, :length].copy_(graph.mask)
        st.slot.fill_(length)
        st.load_positions(position_ids, 0, seq_len, advance=1)
        cache._pad = pad
        return text_model.output_class(last_hidden_state=hidden[:, pad:].clone())

    def next_token(self, text_model, cache: FusedDecodeCache, tokens: torch.Tensor, head=None) -> torch.Tensor:
        """Run the step for ``tokens`` [B] (the tokens just chosen) at the positions that follow the previous step's;
        returns the final-norm hidden state [B, 1, hidden], or with ``head`` the logits [B, vocab]."""
        st = cache._buffers()
        if cache._seq_len + cache._pad >= st.max_len:
            raise ValueError(f"The fused decode cache holds {st.max_len} tokens and is full.")
        weight = text_model.embed_tokens.weight
        torch.index_select(weight, 0, tokens.to(weight.device), out=st.embeds.view(st.batch, -1))
        out = st.decode(text_model, cache._use_graph, head)
        cache._seq_len += 1
        return out

    def _load_step_inputs(self, text_model, cache, input_ids, inputs_embeds, position_ids) -> None:
        """Copy this token's embedding and mRoPE positions into the step's static inputs (one launch each)."""
        st = cache._state
        if inputs_embeds is not None:
            st.embeds.copy_(inputs_embeds)
        else:
            torch.index_select(text_model.embed_tokens.weight, 0, input_ids.reshape(-1),
                               out=st.embeds.view(st.batch, -1))
        st.load_positions(position_ids, cache._seq_len, 1, advance=0)

    # -- bucketed forwards -------------------------------------------------------------------------------------------

    def forward_path(self, config, kwargs: dict) -> tuple[str | None, str]:
        """One decision point for the bucketed forward: ``(path, reason)``.

        - ``("right", "")``: no cache, no padding, no position ids: right-padded to the bucket (:class:`ForwardGraph`,
          SDPA's causal fast path).
        - ``("masked", "")`` / ``("masked+cache", "")``: a padded batch, explicit 2D position ids, or a call that
          returns a cache: left-padded with masked positions (:class:`MaskedForwardGraph`, exact for the state).
        - ``(None, "")``: eager, silently (buckets off, or gradients on, which the layers announce);
          ``(None, reason)``: eager, said once.
        """
        if not self.plan.buckets or torch.is_grad_enabled():
            return None, ""
        ids, embeds = kwargs.get("input_ids"), kwargs.get("inputs_embeds")
        x = ids if ids is not None else embeds
        if x is None or (ids is None) == (embeds is None):
            return None, ""
        if any(kwargs.get(kw) is not None for kw in CACHE_KWS):
            return None, "the call continues from a cache"
        if x.shape[1] > FORWARD_GRAPH_MAX_LEN:
            return None, f"the input has {x.shape[1]} tokens, more than the {FORWARD_GRAPH_MAX_LEN} captured"
        blocker = graph_blocker(config, kwargs)
        if blocker is not None:
            return None, f"the argument {blocker}"
        mask, positions = kwargs.get("attention_mask"), kwargs.get("position_ids")
        if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dim() != 2):
            return None, "the attention mask is not a 2D padding mask"
        if positions is not None and positions.dim() != 2:
            return None, "the position ids are not 2D (mRoPE position ids run eagerly)"
        return "pending", ""

    def forward(self, text_model, kwargs: dict):
        """The forward at its bucket's padded shape (replayed once captured), or None: the caller runs the stock
        forward (said once, with the reason, where it is not the plan's)."""
        path, reason = self.forward_path(text_model.config, kwargs)
        if path is None:
            if reason:
                announce(f"forward-graph/{reason}",
                         f"Qwen3.5 fused kernels: forward without CUDA graphs because {reason}.")
            return None
        use_cache = kwargs.get("use_cache")
        if use_cache is None:
            use_cache = getattr(text_model.config, "use_cache", False)
        embeds = kwargs.get("inputs_embeds")
        mask, positions = kwargs.get("attention_mask"), kwargs.get("position_ids")
        padded = mask is not None and not bool(mask.all())  # one host read per call with a mask
        if not use_cache and not padded and positions is None:
            path = "right"
        elif embeds is not None:
            announce("forward-graph/embeds", "Qwen3.5 fused kernels: forward without CUDA graphs because "
                     "inputs_embeds come with a cache, padding or position ids.")
            return None
        else:
            path = "masked+cache" if use_cache else "masked"
        with self.lock:
            return self._bucketed_forward(text_model, kwargs, path)

    def _bucketed_forward(self, text_model, kwargs: dict, path: str):
        ids, embeds = kwargs.get("input_ids"), kwargs.get("inputs_embeds")
        x = ids if ids is not None else embeds
        batch, seq_len = x.shape[:2]
        key = (path, embeds is not None, batch, forward_len_bucket(seq_len))
        entry = self.forward_graphs.get(key)
        if entry is None:
            if path == "masked+cache":  # each holds a bucket of state (K/V, conv, recurrent): fewer of them
                cached = [k for k, _ in self.forward_graphs.items() if k[0] == "masked+cache"]
                if len(cached) >= MAX_CACHE_FORWARD_GRAPHS:
                    self.forward_graphs.pop(cached[0])
            if path == "right":
                entry = ForwardGraph(text_model, batch, key[3], embeds is not None)
            else:
                entry = MaskedForwardGraph(text_model, self.plan, batch, key[3], path == "masked+cache")
            self.forward_graphs.put(key, entry)
        elif entry.graph and not entry.weights.unchanged():
            entry.drop()  # a parameter was replaced since the capture: capture again
        calls = self.forward_calls[key] = self.forward_calls.pop(key, 0) + 1
        while len(self.forward_calls) > 4 * MAX_FORWARD_GRAPHS:  # the counts of the least recently seen keys go
            self.forward_calls.pop(next(iter(self.forward_calls)))
        # captured on the bucket's second call with graphs on; a graph captured earlier is kept while graphs are
        # switched off (not replayed) and replayed again once they are back on
        graphs = self.plan.graphs
        capture = graphs and calls >= CAPTURE_AFTER
        if path == "right":
            hidden, cache = entry.run(text_model, x, self.pool(), capture, graphs), None
        else:
            out = entry.run(text_model, ids, kwargs.get("attention_mask"), kwargs.get("position_ids"), self.pool(),
                            capture, graphs)
            hidden, cache = out if out is not None else (None, None)
        if hidden is None:
            return None
        return text_model.output_class(last_hidden_state=hidden, **{OUTPUT_CACHE_FIELD: cache})
