# Copyright 2026 The Qwen3.5 fused-kernels authors. Licensed under the Apache License, Version 2.0.
"""Everything that depends on the transformers version or touches a private transformers API, in one place.

The fused classes subclass stock Qwen3.5 (public API). Three things are not public and live here only:

- the keyword names that carry the cache (``cache`` from 5.2x; before that ``cache_params`` for the DeltaNet layer
  and ``past_key_values`` elsewhere), and the output fields that return it;
- the generate hooks the fused decode path overrides: ``GenerationMixin._prepare_cache_for_generation`` (hand
  generate a :class:`FusedDecodeCache`), ``_sample`` (the lean decode loop) and ``_prefill`` (called by that loop),
  plus ``GenerationConfig._pad_token_tensor``. Their signatures are checked once, at import: on a transformers whose
  hooks differ, ``GENERATE_HOOKS_REASON`` says why, the fused layers still run, and ``generate`` decodes with the stock
  code (announced once);
- the stock module's DeltaNet helpers, which transformers swaps for flash-linear-attention's Triton kernels when fla
  is installed, whatever the tensors' device: :func:`torch_reference_kernels` routes CPU calls to the plain-torch
  versions.
"""

import contextlib
import inspect
import threading

import torch

from transformers.cache_utils import Cache
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.stopping_criteria import MaxLengthCriteria
from transformers.generation.utils import GenerateDecoderOnlyOutput, GenerationMixin
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.models.qwen3_5 import modeling_qwen3_5 as stock
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    ALL_ATTENTION_FUNCTIONS,
    Qwen3_5Attention,
    Qwen3_5ForCausalLM,
    Qwen3_5GatedDeltaNet,
    Qwen3_5TextModel,
    eager_attention_forward,
)

__all__ = [
    "ALL_ATTENTION_FUNCTIONS", "Cache", "GenerateDecoderOnlyOutput", "GenerationMode", "MaxLengthCriteria",
    "eager_attention_forward", "stock",
]


def _has_param(fn, name: str) -> bool:
    return name in inspect.signature(fn).parameters


# -- cache keywords and output fields ---------------------------------------------------------------------------------

DELTANET_CACHE_KW = "cache" if _has_param(Qwen3_5GatedDeltaNet.forward, "cache") else "cache_params"
ATTENTION_CACHE_KW = "cache" if _has_param(Qwen3_5Attention.forward, "cache") else "past_key_values"
CACHE_KWS = ("cache", "cache_params", "past_key_values")
GENERATE_CACHE_KW = "cache" if _has_param(Qwen3_5ForCausalLM.forward, "cache") else "past_key_values"
OUTPUT_CACHE_FIELD = "cache" if "cache" in BaseModelOutputWithPast.__dataclass_fields__ else "past_key_values"
GENERATE_OUTPUT_CACHE_FIELD = (
    "cache" if "cache" in GenerateDecoderOnlyOutput.__dataclass_fields__ else "past_key_values"
)
MASK_CACHE_KW = "cache" if _has_param(stock.create_causal_mask, "cache") else "past_key_values"
# stock 5.2x hands the attention call's kwargs to the cache layer's update (5.17 passes none)
ATTENTION_UPDATE_EXTRA = ATTENTION_CACHE_KW == "cache"
TEXT_FORWARD_ARGS = tuple(inspect.signature(Qwen3_5TextModel.forward).parameters)[1:]


def pop_cache(kwargs: dict):
    """Remove and return the cache object from ``kwargs``, whatever stock keyword carries it."""
    cache = None
    for kw in CACHE_KWS:
        value = kwargs.pop(kw, None)
        if value is not None:
            cache = value
    return cache


def find_cache(kwargs: dict):
    """The cache object in ``kwargs`` (left in place), whatever stock keyword carries it."""
    return next((kwargs[kw] for kw in CACHE_KWS if kwargs.get(kw) is not None), None)


def cache_update_kwargs(kwargs: dict) -> dict:
    """The extra keywords stock's attention passes to ``Cache.update`` on this version."""
    return {"kwargs": kwargs} if ATTENTION_UPDATE_EXTRA else {}


def with_signature_of(stock_fn):
    """Give a ``forward(self, *args, **kwargs)`` override the stock method's signature, so that code inspecting it
    (``main_input_name`` checks, Trainer's column filtering) sees the stock parameters."""

    def decorate(fn):
        fn.__signature__ = inspect.signature(stock_fn)
        fn.__doc__ = fn.__doc__ or stock_fn.__doc__
        return fn

    return decorate


def bind_forward_args(args: tuple, kwargs: dict) -> dict:
    """Positional arguments of the text model's forward, in the stock order, merged into ``kwargs``."""
    if args:
        kwargs.update(zip(TEXT_FORWARD_ARGS, args))
    return kwargs


# -- the private generate hooks ---------------------------------------------------------------------------------------

_HOOK_PARAMS = {
    "_prepare_cache_for_generation": ("generation_config", "model_kwargs", "generation_mode", "batch_size",
                                      "max_cache_length"),
    "_sample": ("input_ids", "logits_processor", "stopping_criteria", "generation_config", "synced_gpus", "streamer"),
    "_prefill": ("input_ids", "generation_config", "model_kwargs"),
}


def _check_generate_hooks() -> str | None:
    """None when every private generate hook the fused decode path overrides or calls has the parameters it relies
    on (in order), else the reason it does not."""
    for name, wanted in _HOOK_PARAMS.items():
        fn = getattr(GenerationMixin, name, None)
        if fn is None:
            return f"transformers' GenerationMixin has no {name}"
        params = [p for p in inspect.signature(fn).parameters if p != "self"]
        if tuple(params[: len(wanted)]) != wanted:
            return f"transformers' GenerationMixin.{name} takes ({', '.join(params)}), not ({', '.join(wanted)}, ...)"
    return None


# None when the fused decode loop can hook into this transformers' generate; else why it cannot (stock decoding).
GENERATE_HOOKS_REASON = _check_generate_hooks()
_HOOK_SIGNATURES = {} if GENERATE_HOOKS_REASON else {
    name: inspect.signature(getattr(GenerationMixin, name)) for name in _HOOK_PARAMS
}


def hook_args(name: str, args: tuple, kwargs: dict) -> dict:
    """The arguments of a call to generate hook ``name`` (``_sample``, ``_prepare_cache_for_generation``) by
    parameter name, with its ``**model_kwargs`` (if any) as one dict under ``"model_kwargs"``."""
    signature = _HOOK_SIGNATURES[name]
    bound = signature.bind(None, *args, **kwargs)
    bound.apply_defaults()
    out = dict(bound.arguments)
    out.pop(next(iter(signature.parameters)))  # self
    for param in signature.parameters.values():
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            out["model_kwargs"] = out.pop(param.name, {})
    return out


def run_prefill(model, input_ids, generation_config, model_kwargs):
    """Stock generate's prefill stage (``GenerationMixin._prefill``): the prompt's forward, with generate's own input
    preparation, through whatever cache ``model_kwargs`` holds."""
    return model._prefill(input_ids, generation_config, model_kwargs)


def pad_token_tensor(generation_config):
    """The pad token generate prepared, as a tensor (or None)."""
    return getattr(generation_config, "_pad_token_tensor", None)


def generation_mode_name(mode) -> str:
    return getattr(mode, "value", str(mode))


FUSED_GENERATION_MODES = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE)


# -- stock's DeltaNet helpers on CPU tensors --------------------------------------------------------------------------

# Stock functions that transformers swaps for flash-linear-attention / causal-conv1d kernels at import when those
# packages are installed, whatever the device of the tensors. On CPU their plain-torch versions run instead.
_STOCK_KERNEL_FNS = (
    "torch_chunk_gated_delta_rule",
    "torch_recurrent_gated_delta_rule",
    "causal_conv1d_fn",
    "causal_conv1d_update",
)
_route_lock = threading.Lock()
_route_users = 0
_route_saved: dict = {}


def _stock_uses_triton_helpers() -> bool:
    return any(
        inspect.unwrap(getattr(stock, n)) is not getattr(stock, n) for n in _STOCK_KERNEL_FNS if hasattr(stock, n)
    )


# Whether stock's DeltaNet helpers are fla / causal-conv1d kernels (which CPU tensors crash), read once at import,
# before any routing below swaps them (a check made while another thread has them swapped would read "no").
STOCK_USES_TRITON_HELPERS = _stock_uses_triton_helpers()


@contextlib.contextmanager
def torch_reference_kernels():
    """Route stock's DeltaNet helpers to their plain-torch versions while CPU tensors run through the stock code.

    Stock transformers replaces them by fla's Triton kernels when fla is installed, and those crash on CPU tensors
    ("0 active drivers"). The swap is reference-counted under a lock: concurrent callers (threads) share it, and the
    last one out restores stock's functions, so no caller ever sees them restored mid-call. While it is active, a
    stock call on CUDA tensors in another thread runs the torch versions too (slower, same results).
    """
    global _route_users
    with _route_lock:
        if _route_users == 0:
            _route_saved.update({n: getattr(stock, n) for n in _STOCK_KERNEL_FNS if hasattr(stock, n)})
            for name, fn in _route_saved.items():
                setattr(stock, name, inspect.unwrap(fn))
        _route_users += 1
    try:
        yield
    finally:
        with _route_lock:
            _route_users -= 1
            if _route_users == 0:
                for name, fn in _route_saved.items():
                    setattr(stock, name, fn)
                _route_saved.clear()


def stock_call(fn, hidden_states, *args, **kwargs):
    """``fn(hidden_states, *args, **kwargs)`` (a stock forward), through :func:`torch_reference_kernels` when the
    tensors are off CUDA and stock would send them into fla's kernels."""
    if hidden_states.device.type != "cuda" and STOCK_USES_TRITON_HELPERS and not torch.compiler.is_compiling():
        with torch_reference_kernels():
            return fn(hidden_states, *args, **kwargs)
    return fn(hidden_states, *args, **kwargs)
