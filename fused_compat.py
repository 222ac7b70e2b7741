# Copyright 2026 The Qwen3.5 fused-kernels authors. Licensed under the Apache License, Version 2.0.
"""Everything that depends on the transformers version or touches a private transformers API, in one place.

The fused classes subclass stock Qwen3.5 (public API). What is not public lives here only:

- the keyword names that carry the cache (``cache`` from 5.2x; before that ``cache_params`` for the DeltaNet layer
  and ``past_key_values`` elsewhere), and the output fields that return it;
- the generate hooks the fused decode path overrides: ``GenerationMixin._prepare_cache_for_generation`` (hand
  generate a :class:`FusedDecodeCache`), ``_sample`` (the lean decode loop) and ``_prefill`` (called by that loop),
  plus ``GenerationConfig._pad_token_tensor``. Their signatures are checked once, at import: on a transformers whose
  hooks differ, ``GENERATE_HOOKS_REASON`` says why, the fused layers still run, and ``generate`` decodes with the stock
  code (announced once);
- the stock cache a fused forward or ``generate`` returns, filled from the fused state (:func:`fill_linear_layer`,
  :func:`fill_attention_layer`; 5.25 keeps a token count per linear-attention layer), and the cache protocol stock's
  DeltaNet asks of a cache (:func:`is_recording_past`). Checked by behaviour, not by signature: the first fused model
  of a process runs :func:`returned_cache_reason` (a tiny stock model's own cache against one filled the fused way);
  on a transformers where they differ the model runs the stock code, announced once;
- ``generate_batch``'s result type (``continuous_batching.requests.GenerationOutput`` / ``RequestStatus``; a
  stand-in with the same fields where this transformers lacks it, ``BATCH_OUTPUT_REASON``) and the generate
  helpers it reuses (``_prepare_generation_config``, ``_prepare_special_tokens``, ``_get_logits_processor``);
- the stock module's DeltaNet helpers, which transformers swaps for flash-linear-attention's Triton kernels when fla
  is installed, whatever the tensors' device: :func:`torch_reference_kernels` routes CPU calls to the plain-torch
  versions;
- the load hook that keeps the multi-token-prediction head only when the checkpoint has it
  (``PreTrainedModel._load_pretrained_model``, which receives the checkpoint files before any tensor is read;
  checked once at import, ``LOAD_HOOK_REASON`` says why not);
- the MoE checkpoint layouts: transformers converts the Hub's per-expert tensors to its 3D expert parameters at load
  (and back at save) through its conversion mapping, which it skips for remote code unless the class name or
  its model type was registered (:func:`register_expert_layouts`; checked once at import, ``EXPERT_LAYOUTS_REASON``
  says why not); :func:`per_expert_save` makes a save write the per-expert layout whatever the load read, and keeps
  a MoE MTP head's experts in its checkpoint's layout (:func:`convert_head_experts` at load).
"""

import contextlib
import copy
import inspect
import re
import threading
from pathlib import Path

import torch
import transformers
from transformers.cache_utils import Cache
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.stopping_criteria import MaxLengthCriteria
from transformers.generation.utils import GenerateDecoderOnlyOutput, GenerationMixin
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.modeling_utils import PreTrainedModel
from transformers.models.qwen3_5 import modeling_qwen3_5 as stock
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as stock_moe
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
    "eager_attention_forward", "stock", "stock_moe",
]


_VERSION = transformers.__version__


def _has_param(fn, name: str) -> bool:
    return name in inspect.signature(fn).parameters


# -- cache keywords and output fields ---------------------------------------------------------------------------------

DELTANET_CACHE_KW = "cache" if _has_param(Qwen3_5GatedDeltaNet.forward, "cache") else "cache_params"
ATTENTION_CACHE_KW = "cache" if _has_param(Qwen3_5Attention.forward, "cache") else "past_key_values"
DECODER_CACHE_KW = "cache" if _has_param(stock.Qwen3_5DecoderLayer.forward, "cache") else "past_key_values"
CACHE_KWS = ("cache", "cache_params", "past_key_values")
GENERATE_CACHE_KW = "cache" if _has_param(Qwen3_5ForCausalLM.forward, "cache") else "past_key_values"
OUTPUT_CACHE_FIELD = "cache" if "cache" in BaseModelOutputWithPast.__dataclass_fields__ else "past_key_values"
GENERATE_OUTPUT_CACHE_FIELD = (
    "cache" if "cache" in GenerateDecoderOnlyOutput.__dataclass_fields__ else "past_key_values"
)
MASK_CACHE_KW = "cache" if _has_param(stock.create_causal_mask, "cache") else "past_key_values"
MASK_TAKES_LAYER_IDX = _has_param(stock.create_causal_mask, "layer_idx")  # which cache layer sizes the mask
# stock 5.2x hands the attention call's kwargs to the cache layer's update (5.17 passes none)
ATTENTION_UPDATE_EXTRA = ATTENTION_CACHE_KW == "cache"
TEXT_FORWARD_ARGS = tuple(inspect.signature(Qwen3_5TextModel.forward).parameters)[1:]


if hasattr(Cache, "get_recurrent_state"):

    def cached_recurrent_state(cache, layer_idx: int) -> torch.Tensor:
        """The recurrent state a cache holds for DeltaNet layer ``layer_idx`` (one that has a previous state)."""
        return cache.get_recurrent_state(layer_idx)

else:  # transformers 5.17: stock reads the cache layer's list

    def cached_recurrent_state(cache, layer_idx: int) -> torch.Tensor:
        """The recurrent state a cache holds for DeltaNet layer ``layer_idx`` (one that has a previous state)."""
        getter = getattr(cache, "get_recurrent_state", None)  # the fused decode cache has it on every version
        return getter(layer_idx) if getter is not None else cache.layers[layer_idx].recurrent_states[0]


def is_recording_past(cache, layer_idx: int) -> bool:
    """Whether ``cache`` records the states of every token it is given for layer ``layer_idx`` (5.25's assisted
    decoding: ``activate_past_recording``, so a rejected draft can be cropped away). The fused DeltaNet forward keeps
    no such history, so it hands such a call to the stock forward."""
    check = getattr(cache, "is_recording_past", None)
    if check is None:
        return False
    try:
        return bool(check(layer_idx))
    except (IndexError, KeyError):  # a cache with no layer there (the fused decode cache before 5.25's protocol)
        return False


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


# -- the stock cache the fused path returns ---------------------------------------------------------------------------
#
# A forward that returns a cache, and generate, hand the caller stock's `DynamicCache` built from the fused state
# (`fused_decode.stock_cache_from_state`): each layer's state is put in through stock's own update calls, then the
# layer's bookkeeping is made what stock's forward over the same tokens leaves. transformers 5.25 gave each linear-
# attention layer a token count of its own (`cumulative_length_linear`, which `DynamicCache.get_seq_length` reads
# on layer 0); 5.24 and older count only attention layers. Whether the result is stock's is not assumed from the
# version: `returned_cache_reason()` checks it once a process, on a tiny stock model.


def fill_linear_layer(cache, layer_idx: int, conv: torch.Tensor, recurrent: torch.Tensor, kernel_size: int,
                      tokens: int) -> None:
    """Put a DeltaNet layer's state into a stock cache as stock's forward over ``tokens`` tokens leaves it: ``conv``
    [B, C, K] the last K pre-conv inputs, ``recurrent`` [B, HV, Dk, Dv] (both kept, not copied: pass copies)."""
    cache.update_conv_state(conv, layer_idx, conv_kernel_size=kernel_size)
    cache.update_recurrent_state(recurrent, layer_idx)
    count = getattr(cache.layers[layer_idx], "cumulative_length_linear", None) if hasattr(cache, "layers") else None
    if isinstance(count, torch.Tensor):  # 5.25+: the layer counts its tokens; the conv update added K, not `tokens`
        count.fill_(tokens)


def fill_attention_layer(cache, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Put an attention layer's keys / values [B, KV, T, D] (the real tokens' only) into a stock cache."""
    cache.update(keys, values, layer_idx, **cache_update_kwargs({}))


def read_linear_layer(cache, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A stock cache's DeltaNet state for layer ``layer_idx`` after a forward: conv [B, C, K] (the last K pre-conv
    inputs) and recurrent [B, HV, Dk, Dv] (the cache's own tensors, not copies)."""
    getter = getattr(cache, "get_conv_state", None)
    if getter is not None:  # 5.2x
        return getter(layer_idx), cache.get_recurrent_state(layer_idx)
    layer = cache.layers[layer_idx]  # 5.17: the layer's lists
    return layer.conv_states[0], layer.recurrent_states[0]


def read_attention_layer(cache, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A stock cache's keys / values [B, KV, T, D] for attention layer ``layer_idx`` (its own tensors)."""
    layer = cache.layers[layer_idx]
    return layer.keys, layer.values


def _probe_config():
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, linear_key_head_dim=4, linear_value_head_dim=4, linear_num_key_heads=1,
        linear_num_value_heads=2, linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5,
                         "mrope_section": [1, 1, 0], "mrope_interleaved": True},
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )


def _probe_returned_cache(fill_linear=None) -> str | None:
    """None when a stock cache built as the fused path builds it (``fill_linear_layer``, ``fill_attention_layer``)
    behaves as the cache stock's own forward returns: the same length from every query a forward or generate makes,
    and a forward continuing it gives the same logits, bit for bit. Else what differs. A 2-layer, 16-wide stock model
    on CPU (~50 ms); the RNG state is left as it was."""
    from transformers import Qwen3_5ForCausalLM
    from transformers.cache_utils import DynamicCache

    fill_linear = fill_linear or fill_linear_layer
    config = _probe_config()
    with torch.random.fork_rng(devices=[]), torch.device("cpu"), torch.no_grad(), torch_reference_kernels():
        gen = torch.Generator().manual_seed(0)
        model = Qwen3_5ForCausalLM(config).float().eval()
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
        for prompt in (2, 6):  # shorter and longer than the conv window
            ids = torch.randint(3, 32, (1, prompt + 1), generator=gen)
            want = getattr(model(ids[:, :prompt], use_cache=True), OUTPUT_CACHE_FIELD)
            ours = DynamicCache(config=config)
            for i, kind in enumerate(config.layer_types):
                if kind == "linear_attention":
                    layer = model.model.layers[i].linear_attn
                    fill_linear(ours, i, want.layers[i].conv_states[0].clone(),
                                want.layers[i].recurrent_states[0].clone(), layer.conv_kernel_size, prompt)
                else:
                    fill_attention_layer(ours, i, want.layers[i].keys.clone(), want.layers[i].values.clone())
            for idx in (None, *range(len(config.layer_types))):
                got_len, want_len = (_seq_length(c, idx) for c in (ours, want))
                if got_len != want_len:
                    return (f"the returned cache's get_seq_length({'' if idx is None else idx}) reads {got_len} "
                            f"where stock's reads {want_len} after a {prompt}-token prompt")
            step = {"input_ids": ids[:, prompt:], "use_cache": True}
            got = model(**step, **{GENERATE_CACHE_KW: ours}).logits
            ref = model(**step, **{GENERATE_CACHE_KW: want}).logits
            if not torch.equal(got, ref):
                return (f"a forward continuing the returned cache differs from one continuing stock's (max abs "
                        f"difference {(got - ref).abs().max().item():.3g}) after a {prompt}-token prompt")
    return None


def _seq_length(cache, layer_idx):
    try:
        n = cache.get_seq_length() if layer_idx is None else cache.get_seq_length(layer_idx)
    except (ValueError, IndexError) as err:  # 5.24 refuses a linear layer's index: the same refusal is the same answer
        return f"{type(err).__name__}"
    return int(n)


_returned_cache_reason: list = []  # [reason] once probed


def returned_cache_reason() -> str | None:
    """Once a process: None when the stock cache the fused path returns behaves as stock's (``_probe_returned_cache``),
    else why not; the fused path then does not run on this transformers (the model runs stock, announced)."""
    if not _returned_cache_reason:
        try:
            reason = _probe_returned_cache()
        except Exception as err:  # noqa: BLE001 - any failure of the probe is a difference from what it expects
            reason = f"the returned-cache probe failed ({type(err).__name__}: {err})"
        _returned_cache_reason.append(reason)
    reason = _returned_cache_reason[0]
    return None if reason is None else f"transformers {_VERSION} is not supported by the fused path: {reason}"


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


# -- generate_batch ----------------------------------------------------------------------------------------------------

# transformers' continuous-batching result type (`generate_batch` returns request id -> GenerationOutput). Where this
# transformers lacks it, a dataclass with the same fields stands in (`BATCH_OUTPUT_REASON` says why; the fused
# `generate_batch` announces it once).
try:
    from transformers.generation.continuous_batching.requests import GenerationOutput, RequestStatus

    BATCH_OUTPUT_REASON = None
except ImportError as _err:
    import dataclasses as _dataclasses
    import enum as _enum
    import time as _time

    BATCH_OUTPUT_REASON = f"transformers {_VERSION} has no continuous-batching GenerationOutput ({_err})"

    class RequestStatus(_enum.IntEnum):
        PENDING = 0
        PREFILLING = 1
        DECODING = 2
        FINISHED = 3
        FAILED = 4

    @_dataclasses.dataclass
    class GenerationOutput:
        request_id: str
        prompt_ids: list = _dataclasses.field(default_factory=list)
        generated_tokens: list = _dataclasses.field(default_factory=list)
        logprobs: list = _dataclasses.field(default_factory=list)
        error: str | None = None
        status: RequestStatus = RequestStatus.PENDING
        created_time: float = _dataclasses.field(default_factory=_time.perf_counter)
        lifespan: tuple = (-1, -1)
        timestamps: list | None = None

        def is_finished(self) -> bool:
            return self.status >= RequestStatus.FINISHED


def generation_output(**fields) -> "GenerationOutput":
    """A ``GenerationOutput`` from the fields this transformers' class has (the others dropped)."""
    known = GenerationOutput.__dataclass_fields__
    return GenerationOutput(**{k: v for k, v in fields.items() if k in known})


def complete_generation_config(model, generation_config):
    """``generation_config`` (or the model's) completed as ``generate`` completes it: a copy, its unset values taken
    from the model's generation config, then transformers' global defaults (``max_length`` 20, ``top_k`` 50, ...)."""
    return model._prepare_generation_config(generation_config)[0]


def prepare_special_tokens(model, generation_config, device) -> None:
    """Stock generate's preparation of the special tokens (``_eos_token_tensor``, ``_pad_token_tensor``, ...) on
    ``generation_config``, in place: the logits processors read them."""
    model._prepare_special_tokens(generation_config, True, device=device)


def logits_processors(model, generation_config, prompt: torch.Tensor):
    """The ``LogitsProcessorList`` stock ``generate`` builds for one prompt [1, P] under ``generation_config`` (its
    special tokens prepared): the prompt length sets where ``min_new_tokens`` counts from, as in ``generate``."""
    return model._get_logits_processor(
        generation_config=generation_config, input_ids_seq_length=prompt.shape[-1], encoder_input_ids=prompt,
        device=prompt.device, model_kwargs={},
    )


# -- stock's DeltaNet helpers on CPU tensors --------------------------------------------------------------------------

# Stock functions that transformers swaps for flash-linear-attention / causal-conv1d kernels at import when those
# packages are installed, whatever the device of the tensors. On CPU their plain-torch versions run instead.
_STOCK_KERNEL_FNS = (
    "causal_conv1d_forward",  # 5.25+: a Hub-kernel layer function (kernels' `use_kernel_forward_from_hub`)
    "torch_chunk_gated_delta_rule",
    "torch_recurrent_gated_delta_rule",
    "causal_conv1d_fn",
    "causal_conv1d_update",
)
# The stock modules holding them: the dense model's, and the MoE model's (the same functions, its own copies).
_STOCK_KERNEL_MODULES = (stock, stock_moe)
_route_lock = threading.Lock()
_route_users = 0
_route_saved: dict = {}  # (module, name) -> stock's function


def _stock_uses_triton_helpers() -> bool:
    return any(
        inspect.unwrap(getattr(module, n)) is not getattr(module, n)
        for module in _STOCK_KERNEL_MODULES for n in _STOCK_KERNEL_FNS if hasattr(module, n)
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
            _route_saved.update({(module, n): getattr(module, n) for module in _STOCK_KERNEL_MODULES
                                 for n in _STOCK_KERNEL_FNS if hasattr(module, n)})
            for (module, name), fn in _route_saved.items():
                setattr(module, name, inspect.unwrap(fn))
        _route_users += 1
    try:
        yield
    finally:
        with _route_lock:
            _route_users -= 1
            if _route_users == 0:
                for (module, name), fn in _route_saved.items():
                    setattr(module, name, fn)
                _route_saved.clear()


def stock_call(fn, hidden_states, *args, **kwargs):
    """``fn(hidden_states, *args, **kwargs)`` (a stock forward), through :func:`torch_reference_kernels` when the
    tensors are off CUDA and stock would send them into fla's kernels."""
    if hidden_states.device.type != "cuda" and STOCK_USES_TRITON_HELPERS and not torch.compiler.is_compiling():
        with torch_reference_kernels():
            return fn(hidden_states, *args, **kwargs)
    return fn(hidden_states, *args, **kwargs)


# -- stock's rotary modules -------------------------------------------------------------------------------------------

# The text rotary forwards whose cos / sin the decode step computes itself (``fused_decode.rope_plan``): the dense and
# the MoE module are the same code.
STOCK_ROTARY_FORWARDS = (stock.Qwen3_5TextRotaryEmbedding.forward, stock_moe.Qwen3_5MoeTextRotaryEmbedding.forward)


# -- the experts implementation ---------------------------------------------------------------------------------------


def allow_experts_implementation(cls) -> None:
    """Let transformers set ``experts_implementation`` (``eager`` / ``grouped_mm`` / ...) on the remote MoE class
    ``cls``: its stock path runs stock's ``Qwen3_5MoeExperts``, which dispatches on it. transformers decides whether a
    class supports it by searching the class's module source for stock's decorator, which the remote module does not
    use, and refuses a requested implementation otherwise; the answer is cached on the class, where this sets it."""
    if hasattr(cls, "_can_set_experts_implementation"):
        cls._can_set_experts_implementation_cached_value = True


# -- the MoE checkpoint layouts ---------------------------------------------------------------------------------------

# Hub MoE checkpoints store one tensor per expert (`mlp.experts.{j}.gate_proj.weight`, `up_proj`, `down_proj`);
# stock's modules hold them as `experts.gate_up_proj` [E, 2I, H] (gate then up on dim 1) and `experts.down_proj`
# [E, H, I]. transformers merges them at load, and splits them again at save, through the conversion mapping of
# `qwen3_5_moe_text` (the per-expert merge it shares with `qwen2_moe`, plus the `language_model` prefix change); it
# skips that mapping for remote code unless its model type (or class name) is registered with it.
_EXPERT_SOURCE = "mlp.experts.*.down_proj.weight"


def _expert_mapping():
    from transformers import conversion_mapping

    return conversion_mapping, conversion_mapping.get_checkpoint_conversion_mapping("qwen3_5_moe_text")


def _check_expert_layouts() -> str | None:
    """None when this transformers can convert the per-expert layout for a registered remote class, else why not."""
    try:
        module, mapping = _expert_mapping()
    except (ImportError, AttributeError) as err:
        return f"transformers has no checkpoint conversion mapping ({err})"
    for name in ("register_checkpoint_conversion_mapping", "USER_REGISTERED_MAPPINGS"):
        if not hasattr(module, name):
            return f"transformers.conversion_mapping has no {name}"
    if not any(_EXPERT_SOURCE in (getattr(t, "source_patterns", None) or ()) for t in mapping or ()):
        return "transformers' conversion mapping for qwen3_5_moe_text has no per-expert merge"
    return None


# None when the remote MoE classes load (and save) the per-expert Hub layout through transformers' own conversion.
EXPERT_LAYOUTS_REASON = _check_expert_layouts()


def register_expert_layouts() -> None:
    """Let transformers apply stock's ``qwen3_5_moe_text`` conversion mapping to the remote MoE classes too.

    transformers looks a model's conversions up per submodule, by class name, then by model type, and skips remote
    code unless one of the two was registered by the user. Registering the model type (with the mapping stock already
    has for it, so stock's own classes see no change) makes every remote model holding a ``qwen3_5_moe_text``
    backbone convert as stock's does, scoped where the backbone sits: a per-expert checkpoint loads into the 3D
    parameters, and the causal LM reads a composite checkpoint's ``model.language_model.`` keys. (Registering the
    class names instead would give the causal LM the mapping twice, once for itself and once for its backbone.)
    Any other remote code for this model type in the process gets the same conversions. No-op where
    ``EXPERT_LAYOUTS_REASON`` says why not (the model announces it when built)."""
    if EXPERT_LAYOUTS_REASON is None:
        module, mapping = _expert_mapping()
        module.register_checkpoint_conversion_mapping("qwen3_5_moe_text", mapping, overwrite=True)


def _keep_off_head(conversions: list, model) -> list:
    """``conversions`` with each expert converter of a root model, which transformers applies to every key, kept to
    the keys under the model's backbone prefix (``model.``): a head beside the backbone keeps the layout of its own
    checkpoint keys (:func:`head_expert_conversions`). Scoped converters (a composite model's) are left as they are."""
    from transformers.core_model_loading import WeightConverter

    out = []
    for t in conversions:
        if isinstance(t, WeightConverter) and t.scope_prefix is None:
            t = copy.deepcopy(t)
            t.scope_prefix, t.base_model_prefix = model.base_model_prefix, ""
        out.append(t)
    return out


def head_expert_conversions(model, prefix: str) -> list:
    """transformers' per-expert conversions of ``model`` (its experts' ``*.experts.{j}.gate_proj.weight`` ... <->
    ``*.experts.gate_up_proj`` / ``down_proj``), scoped to the keys under ``prefix`` (``mtp``): a MoE head outside
    the backbone, which transformers' conversions (scoped to the backbone in a composite model) do not cover."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter

    out, seen = [], set()
    for t in get_model_conversion_mapping(model, add_legacy=False):
        if isinstance(t, WeightConverter) and tuple(t.source_patterns) not in seen:
            seen.add(tuple(t.source_patterns))
            t.scope_prefix, t.base_model_prefix = prefix, ""
            out.append(t)
    return out


def head_expert_layout(keys, prefix: str) -> str | None:
    """How checkpoint ``keys`` store the experts of the MoE head under ``prefix``: ``"per-expert"``
    (``{prefix}.layers.{i}.mlp.experts.{j}.gate_proj.weight``, ...), ``"3d"`` (``...mlp.experts.gate_up_proj`` /
    ``down_proj``), or None (no experts there: a dense head, or none)."""
    per_expert = re.compile(rf"^{re.escape(prefix)}\.layers\.\d+\.mlp\.experts\.\d+\.")
    flat = re.compile(rf"^{re.escape(prefix)}\.layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)$")
    if any(per_expert.match(k) for k in keys):
        return "per-expert"
    return "3d" if any(flat.match(k) for k in keys) else None


def convert_head_experts(load_config, model, prefix: str, layout: str | None) -> None:
    """Before a load: the load's conversions (``load_config.weight_mapping``) kept off the head's keys, plus the
    head's own per-expert conversions when the checkpoint stores its experts per expert (``layout``)."""
    if EXPERT_LAYOUTS_REASON is not None or layout is None or load_config.weight_mapping is None:
        return
    mapping = _keep_off_head(list(load_config.weight_mapping), model)
    if layout == "per-expert":
        mapping += head_expert_conversions(model, prefix)
    load_config.weight_mapping[:] = mapping  # the load's own list (the config object is frozen)


@contextlib.contextmanager
def per_expert_save(model, head_prefix: str | None = None, head_per_expert: bool = True):
    """While saving ``model``: write the experts in the per-expert Hub layout even when it was loaded from the 3D one.

    transformers reverts, at save, the conversions a load used (``model._weight_conversions``), so a model loaded from
    3D tensors would be saved as 3D tensors, which vLLM / SGLang do not read; the model's expert converters are added
    for the save (a model built without a load already saves per-expert: transformers then reverts all of them).

    A MoE head under ``head_prefix`` (``mtp``) keeps its own layout: per-expert when ``head_per_expert`` (what its
    checkpoint had, or a head built from a config), else its 3D tensors as they are; the backbone's converters are
    kept off its keys."""
    if EXPERT_LAYOUTS_REASON is not None or (head_prefix is None and
                                             getattr(model, "_weight_conversions", None) is None):
        yield
        return
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange, WeightConverter

    saved = getattr(model, "_weight_conversions", None)
    fresh = get_model_conversion_mapping(model, add_legacy=False)
    if saved is None:  # built without a load: transformers' own defaults, less the prefix a load would have changed
        used = [t for t in fresh if not isinstance(t, PrefixChange)]
    else:
        have = {tuple(t.source_patterns) for t in saved if isinstance(t, WeightConverter)}
        used = list(saved) + [t for t in fresh if isinstance(t, WeightConverter)
                              and tuple(t.source_patterns) not in have]
    if head_prefix is not None:  # the head's converters of the load (if any) replaced by those its layout asks for
        used = [t for t in _keep_off_head(used, model) if getattr(t, "scope_prefix", None) != head_prefix]
        used += head_expert_conversions(model, head_prefix) if head_per_expert else []
    model._weight_conversions = used
    try:
        yield
    finally:
        if saved is None:
            del model._weight_conversions
        else:
            model._weight_conversions = saved


# -- the load hook of the MTP head ------------------------------------------------------------------------------------
#
# A model whose config names an MTP head (`mtp_num_hidden_layers`) builds it, then drops it before the load when the
# checkpoint holds no `mtp.*` tensor: a fine-tune saved by stock transformers keeps `mtp_num_hidden_layers` in its
# config but not the head, and must load as it did (no missing keys, no randomly initialised head). The decision
# needs the checkpoint's tensor names, which transformers resolves inside `from_pretrained` and hands to
# `_load_pretrained_model(model, state_dict, checkpoint_files, load_config)` before reading any tensor.

_LOAD_HOOK_PARAMS = ("model", "state_dict", "checkpoint_files", "load_config")


def _check_load_hook() -> str | None:
    fn = getattr(PreTrainedModel, "_load_pretrained_model", None)
    if fn is None:
        return "transformers' PreTrainedModel has no _load_pretrained_model"
    params = tuple(inspect.signature(fn).parameters)
    if params[: len(_LOAD_HOOK_PARAMS)] != _LOAD_HOOK_PARAMS:
        return (f"transformers' PreTrainedModel._load_pretrained_model takes ({', '.join(params)}), not "
                f"({', '.join(_LOAD_HOOK_PARAMS)}, ...)")
    return None


# None when the fused classes can match their MTP head to the checkpoint at load; else why not (then a load builds no
# head, and the checkpoint's `mtp.*` tensors are ignored as stock ignores them).
LOAD_HOOK_REASON = _check_load_hook()


def load_hook_args(args: tuple, kwargs: dict) -> dict:
    """The arguments of a call to ``_load_pretrained_model`` by name (``model``, ``state_dict``,
    ``checkpoint_files``, ``load_config``)."""
    bound = dict(zip(_LOAD_HOOK_PARAMS, args))
    bound.update({k: v for k, v in kwargs.items() if k in _LOAD_HOOK_PARAMS})
    return bound


def checkpoint_keys(state_dict: dict | None, checkpoint_files: list | None) -> set[str] | None:
    """The tensor names a load reads: ``state_dict``'s, else the safetensors files' (their headers only); None for
    other formats (``.bin``, GGUF), whose names cannot be read without loading them."""
    if state_dict is not None:
        return set(state_dict)
    if not checkpoint_files or not all(str(f).endswith(".safetensors") for f in checkpoint_files):
        return None
    from safetensors import safe_open

    keys = set()
    for path in checkpoint_files:
        with safe_open(str(Path(path)), framework="pt") as f:
            keys.update(f.keys())
    return keys


def forget_device_map_entries(load_config, prefix: str) -> None:
    """Remove the entries of the load's device map (``load_config.device_map``, the dict ``from_pretrained`` also
    dispatches with) for a module ``prefix`` that was dropped before the load."""
    device_map = getattr(load_config, "device_map", None)
    if isinstance(device_map, dict):
        for name in [n for n in device_map if n == prefix or n.startswith(prefix + ".")]:
            del device_map[name]
