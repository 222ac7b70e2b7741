# Copyright 2026 The Qwen3.5 fused-kernels authors. Licensed under the Apache License, Version 2.0.
"""CUDA-graph machinery of the fused path: capture and failed-capture recovery, the weights check before a replay,
length buckets, a least-recently-used store, and the two captured forwards (no-cache right-padded, and left-padded
with masked positions writing a decode state).

Every graph of a model shares one memory pool (graphs are replayed one at a time and their outputs copied out at
once). Off CUDA (the tests' CPU emulation) the same padded forwards run eagerly, with no capture.
"""

from collections import OrderedDict

import torch
from torch import nn

from .fused_compat import MASK_CACHE_KW, stock
from .fused_layers import pack_all, prefill_into
from .fused_ops import capture_error, reset_rng_after_failed_capture
from .fused_plan import announce

# Longest input (tokens) whose forward or prompt is captured; longer ones run the fused kernels eagerly.
FORWARD_GRAPH_MAX_LEN = 8192
# A bucket is captured on its second call: a length seen once runs eagerly, at its own length.
CAPTURE_AFTER = 2
# Length buckets a power-of-two octave is cut into (their step at least BUCKET_MIN_STEP tokens).
BUCKET_STEPS = 8
BUCKET_MIN_STEP = 64


def forward_len_bucket(seq_len: int) -> int:
    """Inputs are padded to this length. Steps of 1/``BUCKET_STEPS`` (8) of the enclosing power of two, at least
    ``BUCKET_MIN_STEP`` (64) tokens, so the padding costs at most ~12% of the compute beyond 512 tokens, and a few
    dozen buckets cover 1..8192."""
    if seq_len <= BUCKET_MIN_STEP:
        return BUCKET_MIN_STEP
    step = max(BUCKET_MIN_STEP, (1 << (seq_len - 1).bit_length()) // BUCKET_STEPS)
    return -(-seq_len // step) * step


class WeightsSnapshot:
    """What a captured graph reads: every parameter (owner, name, tensor, address) and every submodule (parent, name,
    module) of the given modules, taken at capture. ``unchanged()`` is checked before each replay: a parameter
    replaced (``load_state_dict(..., assign=True)``, assignment, ``.data =``) or a submodule swapped (an adapter
    injected) means the graph would read stale memory, so it is captured again. Checking the snapshot costs a
    fraction of walking the module tree again (~1.2 ms per call at 4B on a CPU-only host)."""

    def __init__(self, *roots: nn.Module):
        modules = [module for root in roots for module in root.modules()]
        self.params = [
            (module, name, p, p.data_ptr())
            for module in modules
            for name, p in module._parameters.items()
            if p is not None
        ]
        self.children = [(module, name, child) for module in modules for name, child in module._modules.items()]

    def unchanged(self) -> bool:
        return all(m._modules.get(n) is c for m, n, c in self.children) and all(
            m._parameters.get(n) is p and p.data_ptr() == ptr for m, n, p, ptr in self.params
        )


def capture_graph(text_model, forward, pool, what: str, warm: bool = True):
    """Pack every projection group, run ``forward()`` once eagerly when ``warm`` (every autotuned / JIT kernel is
    compiled before the capture), capture it into a new graph on ``pool``, and return ``(graph, output)``; None after
    a failed capture (said once; the caller runs eagerly)."""
    pack_all(text_model)
    if warm:
        forward()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, pool=pool):
            out = forward()
    except Exception as err:  # noqa: BLE001 - any capture failure: eager, said once
        reset_rng_after_failed_capture()
        err = capture_error(err)
        announce(
            f"graph-capture/{what}/{type(err).__name__}",
            f"Qwen3.5 fused kernels: CUDA graph capture of the {what} failed ({type(err).__name__}: {err}); running "
            "it with the fused kernels without graphs.",
        )
        return None
    return graph, out


def anchor_graph(pool, device) -> tuple | None:
    """``(graph, tensor)``: a graph of one in-place op on a tensor of its own, captured on ``pool``. Whoever holds it
    keeps one graph on the pool at all times, the allocator's count of the pool's graphs above 0 (see
    ``FusedRunner.pool``). None, said once, when the capture fails (the pool then lives as long as its other graphs)."""
    try:
        with torch.cuda.device(device), torch.inference_mode(False):
            flag = torch.zeros(1, device=device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                flag.add_(1)
    except Exception as err:  # noqa: BLE001 - without the anchor the graphs still work, as before it
        reset_rng_after_failed_capture()
        announce(f"graph-anchor/{type(err).__name__}", "Qwen3.5 fused kernels: the graph pool's anchor could not be "
                 f"captured ({type(err).__name__}: {err}); a capture after every graph on the pool was freed may fail "
                 "and run that forward without its graph.")
        return None
    return graph, flag


class LRU:
    """At most ``size`` entries, the least recently used dropped first (its ``drop()`` called)."""

    def __init__(self, size: int):
        self.size = size
        self.entries: OrderedDict = OrderedDict()

    def get(self, key):
        entry = self.entries.get(key)
        if entry is not None:
            self.entries.move_to_end(key)
        return entry

    def put(self, key, entry) -> None:
        while len(self.entries) >= self.size:
            self.entries.popitem(last=False)[1].drop()
        self.entries[key] = entry

    def pop(self, key) -> None:
        entry = self.entries.pop(key, None)
        if entry is not None:
            entry.drop()

    def clear(self) -> None:
        for entry in self.entries.values():
            entry.drop()
        self.entries.clear()

    def values(self):
        return list(self.entries.values())

    def items(self):
        return list(self.entries.items())


class _Captured:
    """A forward run at fixed shapes and addresses, captured once into a CUDA graph and replayed."""

    graph = None  # torch.cuda.CUDAGraph once captured; False after a failed capture (eager from then on)
    out = None
    weights = None

    def _graphed(self, text_model, forward, pool, capture: bool, replay: bool, what: str):
        """``forward()``'s output: replayed when captured and ``replay``; else run eagerly (captured first when
        ``capture``, on CUDA). None right after a failed capture (announced; the caller runs eagerly)."""
        if self.graph is None and capture and self.device.type == "cuda":
            captured = capture_graph(text_model, forward, pool, what)
            if captured is None:
                self.graph = False
                return None
            self.graph, self.out = captured
            self.weights = WeightsSnapshot(text_model)
        if self.graph and replay:
            self.graph.replay()
            return self.out
        return forward()


class ForwardGraph(_Captured):
    """One captured no-cache forward of the text backbone, for one (batch, length bucket, input kind).

    ``inputs``: ``[B, L]`` token ids or ``[B, L, hidden]`` embeddings at a fixed address; the caller's ``[B, T]``
    input is copied into its head and the tail keeps whatever the last call left there (causality makes it
    irrelevant: attention is causal and the conv / delta rule only look back). ``out``: the captured
    ``[B, L, hidden]`` final hidden states; each call returns a copy of ``out[:, :T]``.
    """

    def __init__(self, text_model, batch: int, length: int, embeds: bool):
        weight = text_model.embed_tokens.weight
        with torch.inference_mode(False):  # written in place under no_grad and inference_mode alike
            if embeds:
                self.inputs = torch.zeros(batch, length, weight.shape[1], dtype=weight.dtype, device=weight.device)
            else:
                self.inputs = torch.zeros(batch, length, dtype=torch.long, device=weight.device)
        self.embeds = embeds
        self.device = weight.device
        self.masks = None

    def _build_masks(self, text_model) -> dict:
        """The stock forward's mask mapping for the padded bucket, built once, eagerly. Built inside the capture,
        transformers cannot read the position ids to rule out packed sequences (reading them is a host sync), so it
        materialises a full [L, L] mask and SDPA loses its causal fast path (measured 3x slower attention)."""
        batch, length = self.inputs.shape[:2]
        weight = text_model.embed_tokens.weight
        shaped = torch.empty(batch, length, 1, dtype=weight.dtype, device=weight.device)  # shape / dtype / device
        kw = {
            "config": text_model.config,
            "inputs_embeds": shaped.expand(batch, length, weight.shape[1]),
            "attention_mask": None,
            MASK_CACHE_KW: None,
            "position_ids": torch.arange(length, device=weight.device).expand(batch, length),
        }
        return {
            "full_attention": stock.create_causal_mask(**kw),
            "linear_attention": stock.create_recurrent_attention_mask(**kw),
        }

    def _forward(self, text_model) -> torch.Tensor:
        kw = {"inputs_embeds" if self.embeds else "input_ids": self.inputs}
        return text_model.stock_forward(**kw, attention_mask=self.masks, use_cache=False).last_hidden_state

    def run(self, text_model, x: torch.Tensor, pool, capture: bool, replay: bool = True) -> torch.Tensor | None:
        """The hidden states [B, T, hidden] for ``x`` [B, T] (or [B, T, hidden]): replayed when captured and
        ``replay`` (graphs on); else run eagerly at the bucket's padded shape (the same kernels and shapes as the
        replay, so the same numbers), and captured when ``capture``. None after a failed capture (the caller runs the
        eager forward)."""
        seq_len = x.shape[1]
        self.inputs[:, :seq_len].copy_(x)
        if self.masks is None:
            self.masks = self._build_masks(text_model)
        out = self._graphed(text_model, lambda: self._forward(text_model), pool, capture, replay, "forward")
        return None if out is None else out[:, :seq_len].clone()

    def drop(self) -> None:
        self.graph = self.out = self.masks = None


class PrefillGraph(_Captured):
    """A prompt forward captured per (batch, length bucket): the prompt LEFT-padded to the bucket with masked
    positions (attention mask 0; ``ids``, ``mask``, ``positions`` [B, L] at fixed addresses), the layers writing
    their state into a decode cache (:func:`prefill_into`).

    The DeltaNet layers zero the hidden states of masked positions, and with no conv bias a zero input gives
    k = v = 0, so the conv window and the recurrent state after the prompt are the real tokens' exactly (zeros stay
    zeros, the decay of a zero state is zero); attention never reads the pads' K/V (the decode step's key mask
    starts from ``mask``). The real tokens keep their positions (``position_ids`` as given, or stock's 0..T-1).
    """

    def __init__(self, batch: int, device: torch.device, length: int):
        with torch.inference_mode(False):  # written in place under no_grad and inference_mode alike
            shape = (batch, length)
            self.ids = torch.zeros(shape, dtype=torch.long, device=device)
            self.mask = torch.zeros(shape, dtype=torch.long, device=device)
            self.positions = torch.zeros(shape, dtype=torch.long, device=device)
            self.arange = torch.arange(length, device=device)
        self.length = length
        self.device = torch.device(device)

    def load(self, input_ids, attention_mask, position_ids) -> int:
        """Copy the prompt [B, T] into the buffers' tail; returns the left padding L - T."""
        pad = self.length - input_ids.shape[1]
        self.ids[:, :pad].zero_()
        self.ids[:, pad:].copy_(input_ids)
        self.mask[:, :pad].zero_()
        if attention_mask is None:
            self.mask[:, pad:].fill_(1)
        else:
            self.mask[:, pad:].copy_(attention_mask)
        if position_ids is None:  # stock: 0..T-1 for every row
            torch.sub(self.arange.expand_as(self.positions), pad, out=self.positions)
        else:
            self.positions[:, :pad].zero_()
            self.positions[:, pad:].copy_(position_ids)
        return pad

    def _forward(self, text_model, cache) -> torch.Tensor:
        with prefill_into(cache):
            return text_model.stock_forward(
                input_ids=self.ids, attention_mask=self.mask, position_ids=self.positions, use_cache=False
            ).last_hidden_state

    def run(self, text_model, cache, pool, capture: bool, replay: bool = True) -> torch.Tensor | None:
        """The padded prompt's hidden states [B, L, hidden], its state written into ``cache``: replayed when
        captured and ``replay``, else eagerly at the padded shape (captured when ``capture``). None after a failed
        capture."""
        return self._graphed(text_model, lambda: self._forward(text_model, cache), pool, capture, replay,
                             "prompt (prefill)")

    def drop(self) -> None:
        self.graph = self.out = None
