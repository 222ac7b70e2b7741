# Copyright 2026 The Qwen3.5 fused-kernels authors. Licensed under the Apache License, Version 2.0.
"""Fused Qwen3.5 model classes (remote code): the public entry points.

Each class subclasses its stock transformers Qwen3.5 class and only adds the fused inference path:

- ``Qwen3_5FusedTextModel`` / ``Qwen3_5FusedForCausalLM``: the text backbone and the causal LM.
- ``Qwen3_5FusedModel`` / ``Qwen3_5FusedForConditionalGeneration``: the composite vision-language model that real
  Qwen3.5 checkpoints use; the vision tower is the stock one, untouched, and the text backbone is fused.
- ``Qwen3_5FusedForCausalLMLoader``: the ``AutoModelForCausalLM`` entry of composite repos.

The backbone is built from the fused layer modules (``fused_layers``), with stock's parameter names and shapes, so
the state dict is stock's. What runs is decided once, in the backbone's :class:`FusedPlan` (``fused_plan``),
resolved when the model is built, loaded, moved, cast, put in train / eval mode or switched; ``describe()`` renders
it. Calls that use the model's reusable GPU state (a fused ``generate``, a forward at its length bucket) go through
its :class:`FusedRunner` (``fused_runner``); the generate hooks here are thin: they hand generate a fused decode
cache and run the fused loop (``fused_generate``), and otherwise defer to stock.
"""

import torch
from torch import nn
from transformers.modeling_layers import GenericForSequenceClassification
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5ForSequenceClassification,
    Qwen3_5Model,
    Qwen3_5TextForSequenceClassification,
    Qwen3_5TextModel,
    Qwen3_5TextRotaryEmbedding,
)
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoModelForSequenceClassification,
    GenerationMixin,
)

from .configuration_qwen3_5_fused import (
    SWITCHES,
    Qwen3_5FusedConfig,
    Qwen3_5FusedTextConfig,
    check_switch,
    resolve_switch,
)
from .fused_compat import (
    CACHE_KWS,
    FUSED_GENERATION_MODES,
    GENERATE_CACHE_KW,
    GENERATE_HOOKS_REASON,
    bind_forward_args,
    find_cache,
    generation_mode_name,
    hook_args,
    with_signature_of,
)
from .fused_decode import FusedDecodeCache
from .fused_generate import fused_sample
from .fused_layers import FUSED_OPS, FusedDecoderLayer, FusedRMSNorm, pack_all
from .fused_ops import prefill_rule_kernel, small_linear_choices
from .fused_plan import LAYER_KINDS, FusedPlan, announce, announced
from .fused_runner import FusedRunner

SUPPORTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_text")
_CONFIG_LOAD_KWARGS = ("revision", "cache_dir", "local_files_only", "token", "subfolder")


def _tensor_parallel_requested(kwargs: dict) -> bool:
    if kwargs.get("tp_plan") is not None or kwargs.get("tp_size") is not None or kwargs.get("device_mesh") is not None:
        return True
    distributed = kwargs.get("distributed_config")
    return distributed is not None and (
        getattr(distributed, "tp_plan", None) is not None or getattr(distributed, "tp_size", None) is not None
    )


def check_model_type(config) -> None:
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"The fused Qwen3.5 classes load Qwen3.5 checkpoints (model_type {' or '.join(SUPPORTED_MODEL_TYPES)}), "
            f"got model_type={model_type!r}."
        )


def _sync_switches(config) -> None:
    """Copy a composite config's switches into its text config (the backbone reads them there)."""
    text_config = getattr(config, "text_config", None)
    if text_config is not None:
        for name in SWITCHES:
            setattr(text_config, name, check_switch(name, getattr(config, name, None), allow_unset=True))


class _FusedPreTrainedMixin:
    """Shared by the public classes: load-time switches, the generate hooks, ``set_fused_kernels``, ``describe()``.

    Saving: each class names the Auto class it serves (``_auto_class``), so ``save_pretrained`` copies every code
    file next to the weights, as transformers does for remote code; the config writes stock ``architectures`` and
    the full ``auto_map`` (``configuration_qwen3_5_fused``). The saved folder loads fused with
    ``trust_remote_code=True`` and as a stock checkpoint without it.
    """

    # accelerate keeps modules whole by class *name*: without `FusedDecoderLayer`, `device_map="auto"` could cut a
    # layer between GPUs, even between the views of one packed matrix.
    _no_split_modules = ["Qwen3_5DecoderLayer", "FusedDecoderLayer", "Qwen3_5VisionBlock"]

    def _text_model(self) -> "Qwen3_5FusedTextModel":
        raise NotImplementedError

    def _composite_model(self):
        return self

    @property
    def fused_plan(self) -> FusedPlan:
        """The resolved path of this model (see ``fused_plan.FusedPlan``)."""
        return self._text_model().plan

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        overrides = {name: check_switch(name, kwargs.pop(name)) for name in SWITCHES if name in kwargs}
        config = kwargs.get("config")
        config_dict = None
        if config is None and pretrained_model_name_or_path is not None:
            config_dict, _ = cls.config_class.get_config_dict(
                pretrained_model_name_or_path,
                **{k: kwargs[k] for k in _CONFIG_LOAD_KWARGS if k in kwargs},
            )
            check_model_type(type("C", (), {"model_type": config_dict.get("model_type")}))
        elif config is not None and not isinstance(config, (str, bytes)):
            check_model_type(config)
        if _tensor_parallel_requested(kwargs):
            source = config if config is not None and not isinstance(config, (str, bytes)) else None
            stated = getattr(source, "fused_kernels", None) if source is not None else (config_dict or {}).get(
                "fused_kernels")
            probe = type("C", (), {"fused_kernels": overrides.get("fused_kernels", stated)})
            if resolve_switch(probe, "fused_kernels"):
                raise ValueError(
                    "Tensor parallel loading (tp_plan / tp_size / distributed_config) is not supported with "
                    "fused_kernels=True: the fused path packs q/k/v, qkv/z/b/a and gate/up into one matrix each and "
                    "reads whole-model head counts, so sharded weights would be computed wrongly. Load with "
                    "fused_kernels=False to use the stock tensor-parallel plan, use device_map='auto' to spread "
                    "layers over GPUs with the fused kernels, or serve the checkpoint with vLLM / SGLang."
                )
        out = super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        model = out[0] if isinstance(out, tuple) else out
        for name, value in overrides.items():
            setattr(model.config, name, value)
        model._refresh_fused()
        return out

    # -- generate ----------------------------------------------------------------------------------------------------

    def _fused_decode_blocker(self, generation_config, model_kwargs, generation_mode) -> str | None:
        """None when this ``generate`` call can decode on the fused path, else the reason it cannot."""
        plan = self.fused_plan
        if plan.decode_reason is not None:
            return plan.decode_reason
        if generation_mode not in FUSED_GENERATION_MODES:
            return f"the generation mode is {generation_mode_name(generation_mode)} (fused: greedy and sampling)"
        if model_kwargs.get(GENERATE_CACHE_KW) is not None:
            return "a cache object was passed to generate()"
        if generation_config.cache_implementation is not None:
            return f"cache_implementation={generation_config.cache_implementation!r} was requested"
        if getattr(generation_config, "prefill_chunk_size", None):
            return "prefill_chunk_size was set"
        if generation_config.output_attentions or generation_config.output_hidden_states:
            return "attention weights or hidden states were requested from generate()"
        return None

    def generate(self, *args, **kwargs):
        # a fused generate uses the model's shared decode buffers and graphs: one call at a time per model
        if self.fused_plan.decode_reason is None:
            with self._text_model().runner.lock:
                return super().generate(*args, **kwargs)
        return super().generate(*args, **kwargs)

    def _prepare_cache_for_generation(self, *args, **kwargs):
        if GENERATE_HOOKS_REASON is None:
            a = hook_args("_prepare_cache_for_generation", args, kwargs)
            generation_config, model_kwargs = a["generation_config"], a["model_kwargs"]
            generation_mode, batch_size, max_cache_length = a["generation_mode"], a["batch_size"], a["max_cache_length"]
            if self.fused_plan.fused and generation_config.use_cache is not False:
                reason = self._fused_decode_blocker(generation_config, model_kwargs, generation_mode)
                if reason is None:
                    batch = batch_size * max(1, generation_config.num_return_sequences or 1)
                    text_model = self._text_model()
                    model_kwargs[GENERATE_CACHE_KW] = text_model.runner.new_cache(text_model, batch, max_cache_length)
                    return None
                announce(
                    f"decode/{reason}",
                    f"Qwen3.5 fused kernels: generate() decodes with the stock transformers cache and code because "
                    f"{reason}.",
                )
        elif self.fused_plan.fused:
            announce("decode/hooks", "Qwen3.5 fused kernels: generate() decodes with the stock transformers code "
                     f"because {GENERATE_HOOKS_REASON}.")
        return super()._prepare_cache_for_generation(*args, **kwargs)

    def _sample(self, *args, **kwargs):
        if GENERATE_HOOKS_REASON is None:
            a = hook_args("_sample", args, kwargs)
            cache = a["model_kwargs"].get(GENERATE_CACHE_KW)
            if isinstance(cache, FusedDecodeCache) and not a["synced_gpus"] and cache.get_seq_length() == 0:
                text_model = self._text_model()
                return fused_sample(self, text_model, text_model.runner, cache, a["input_ids"],
                                    a["logits_processor"], a["stopping_criteria"], a["generation_config"],
                                    a["streamer"], a["model_kwargs"])
        return super()._sample(*args, **kwargs)

    # -- switches and reports ----------------------------------------------------------------------------------------

    def _refresh_fused(self) -> None:
        _sync_switches(self.config)
        self._text_model().refresh_fused()

    def set_fused_kernels(self, enabled: bool) -> "_FusedPreTrainedMixin":
        """Switch the fused path on or off for this model (also written to its config)."""
        self.config.fused_kernels = check_switch("fused_kernels", enabled)
        self._refresh_fused()
        return self

    def set_cuda_graphs(self, enabled: bool) -> "_FusedPreTrainedMixin":
        """Switch CUDA graphs on or off for this model (also written to its config). Graphs captured before are
        kept while off (not replayed) and replayed again when switched back on."""
        self.config.cuda_graphs = check_switch("cuda_graphs", enabled)
        _sync_switches(self.config)
        text_model = self._text_model()
        text_model.plan.resolve(text_model)
        return self

    def describe(self) -> dict:
        """What runs fused and what falls back, per layer kind, for this model as it is now (the plan, rendered)."""
        text_model = self._text_model()
        plan, runner = text_model.plan, text_model.runner
        kinds = {}
        for kind in LAYER_KINDS:
            reason = plan.kind_reasons.get(kind, plan.reason)
            kinds[kind] = {
                "path": "fused" if reason is None else "stock",
                "ops": FUSED_OPS[kind] if reason is None else "stock transformers forward",
                "reason": reason,
            }
        if plan.fused:
            kinds["linear_attention"]["prefill_rule_kernel"] = prefill_rule_kernel(plan.dtype)
            kinds["linear_attention"]["falls_back"] = "decode steps outside generate()'s fused cache (stock cache)"
        decode = {
            "path": "fused" if plan.decode_reason is None else "stock",
            "ops": (
                "one step per token on preallocated conv / recurrent / K-V buffers: the conv step in the DeltaNet "
                "input linear's epilogue + gated_delta_rule_step (states in place), attn_prep writing K/V into the "
                "cache + decode_attention (split keys, merged with the sigmoid gate), fused norms; each linear "
                "(gate|up with SwiGLU in its epilogue) by cuBLAS or our GEMV, whichever was timed faster for its "
                "shape, the LM head too"
                if plan.decode_reason is None else "stock transformers decode"
            ),
            "cuda_graphs": plan.graphs,
            "pdl": plan.pdl,
            **{k: v for k, v in plan.render().items() if k == "pdl_gemv_late_signal_min_weight_elems"},
            "falls_back": "beam search, assisted / contrastive decoding, a cache passed in, cache_implementation, "
            "output_attentions / output_hidden_states (a model split over devices decodes fused, without graphs)",
            "buckets": [
                {"batch": st.batch, "max_len": st.max_len, "graph_captured": bool(st.graph),
                 "cache_bytes": st.nbytes(),
                 "prompt_buckets_captured": sorted(n for n, g in st.prefill_graphs.items() if g.graph)}
                for st in runner.decode_states.values()
            ],
            # the per-shape choice of small_linear, timed at a first decode step in this process
            "linears": {
                f"{m}x{n}x{k}{' gate|up+SwiGLU' if gate_up else ''} {str(dtype).removeprefix('torch.')} {dev}":
                "cublas" if choice == "cublas" else f"gemv {choice!r}"
                for (m, n, k, gate_up, dtype, dev), choice in small_linear_choices().items()
            },
            "reason": plan.decode_reason,
        }
        forward_graphs = {
            "used": plan.graphs,
            "buckets_padded": plan.buckets,
            "reason": plan.graphs_reason,
            "covers": "forwards under no_grad / inference_mode up to 8192 tokens at their length bucket's padded "
            "shape, captured on a bucket's second call: right-padded without cache, padding or position ids; "
            "left-padded with masked positions otherwise (padded batches, 2D position ids, a returned cache)",
            "buckets": [
                {"path": "right-padded" if key[0] == "right" else key[0], "batch": key[2], "length": key[3],
                 "inputs_embeds": key[1], "graph_captured": bool(entry.graph)}
                for key, entry in runner.forward_graphs.items()
            ],
        }
        return {
            "fused_kernels": plan.fused_kernels,
            "cuda_graphs": plan.cuda_graphs,
            "device": str(plan.device),
            "plan": plan.render(),
            "layers": kinds,
            "decode": decode,
            "forward_graphs": forward_graphs,
            "vision_tower": "stock" if hasattr(self._composite_model(), "visual") else None,
            "announced_fallbacks": announced(),
        }


class Qwen3_5FusedTextModel(_FusedPreTrainedMixin, Qwen3_5TextModel):
    """The text backbone, built from the fused layers (stock's ``__init__`` with the fused classes)."""

    config_class = Qwen3_5FusedTextConfig
    _auto_class = "AutoModel"

    def __init__(self, config):
        check_model_type(config)
        super(Qwen3_5TextModel, self).__init__(config)  # Qwen3_5PreTrainedModel: stock's bases
        self.plan = FusedPlan()
        self.runner = FusedRunner(self.plan)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(
            [FusedDecoderLayer(config, layer_idx, self.plan) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = FusedRMSNorm(config.hidden_size, config.rms_norm_eps, self.plan)
        self.rotary_emb = Qwen3_5TextRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.post_init()
        self.refresh_fused()

    def _text_model(self):
        return self

    def refresh_fused(self) -> None:
        """Resolve the plan again for the model as it is now, free the buffers and graphs (they point at the old
        storage or serve the old path), and pack the projection groups when the fused path runs."""
        self.plan.resolve(self)
        self.runner.release()
        if self.plan.fused:
            pack_all(self)

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        self.refresh_fused()  # a move or a cast: new device / dtype, buffers and graphs on the old storage
        return out

    def train(self, mode: bool = True):
        out = super().train(mode)
        self.plan.resolve(self)  # training mode runs stock; eval mode the fused path where it can
        if self.plan.fused:
            pack_all(self)
        return out

    @with_signature_of(Qwen3_5TextModel.forward)
    def forward(self, *args, **kwargs):
        """Stock's forward; a call carrying a fused decode cache (inside a fused ``generate``) runs the prompt or the
        decode step on it, and a forward the plan buckets runs at its length bucket's padded shape (replayed from a
        CUDA graph once captured)."""
        kwargs = bind_forward_args(args, kwargs)
        if torch.compiler.is_compiling():  # torch.compile traces stock's forward (the runner holds a lock, graphs)
            return super().forward(**kwargs)
        cache = find_cache(kwargs)
        if isinstance(cache, FusedDecodeCache):
            for kw in CACHE_KWS:
                kwargs.pop(kw, None)
            return self.runner.run_on_cache(self, cache, **kwargs)
        out = self.runner.forward(self, kwargs)
        if out is not None:
            return out
        return super().forward(**kwargs)


class Qwen3_5FusedForCausalLM(_FusedPreTrainedMixin, Qwen3_5ForCausalLM, GenerationMixin):
    config_class = Qwen3_5FusedTextConfig
    _auto_class = "AutoModelForCausalLM"

    def __init__(self, config):
        check_model_type(config)
        super(Qwen3_5ForCausalLM, self).__init__(config)  # stock's bases; then stock's __init__, fused backbone
        self.model = Qwen3_5FusedTextModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def _text_model(self):
        return self.model


class Qwen3_5FusedForCausalLMLoader(Qwen3_5FusedForCausalLM):
    """``AutoModelForCausalLM`` entry of composite (vision-language) repos, which is how real Qwen3.5 checkpoints
    are laid out: it loads the text backbone and LM head as a :class:`Qwen3_5FusedForCausalLM`.

    transformers registers a remote class under the repo's config class and requires the two to match by name, so
    composite repos need a causal-LM entry whose ``config_class`` is the composite config; stock transformers does
    the same extraction (``config.get_text_config()``) for its own ``Qwen3_5ForCausalLM``. The checkpoint keys
    ``model.language_model.*`` are read as ``model.*`` (stock does this with its key mapping for ``qwen3_5_text``,
    which transformers does not apply to remote code).
    """

    config_class = Qwen3_5FusedConfig

    @staticmethod
    def _text_config_of(config):
        if not hasattr(config, "text_config"):
            return config
        _sync_switches(config)
        text_config = config.get_text_config()
        if getattr(config, "quantization_config", None) is not None:
            text_config.quantization_config = config.quantization_config
        return text_config

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, config=None, **kwargs):
        if config is not None and not isinstance(config, (str, bytes)) and hasattr(config, "text_config"):
            config = cls._text_config_of(config)
            # transformers skips its own key mappings for remote code, so name the one stock uses here.
            kwargs.setdefault("key_mapping", {r"^model\.language_model\.": "model."})
        return Qwen3_5FusedForCausalLM.from_pretrained(pretrained_model_name_or_path, *args, config=config, **kwargs)

    @classmethod
    def _from_config(cls, config, **kwargs):
        return Qwen3_5FusedForCausalLM._from_config(cls._text_config_of(config), **kwargs)


class Qwen3_5FusedModel(_FusedPreTrainedMixin, Qwen3_5Model):
    config_class = Qwen3_5FusedConfig
    _auto_class = "AutoModel"

    def __init__(self, config):
        check_model_type(config)
        _sync_switches(config)
        super(Qwen3_5Model, self).__init__(config)  # stock's bases; then stock's __init__, fused text backbone
        self.visual = AutoModel.from_config(config.vision_config)
        self.language_model = Qwen3_5FusedTextModel._from_config(config.text_config)
        self.rope_deltas = None  # cache rope_deltas here (as stock)
        self.post_init()

    def _text_model(self):
        return self.language_model


class Qwen3_5FusedForConditionalGeneration(
    _FusedPreTrainedMixin, Qwen3_5ForConditionalGeneration, GenerationMixin
):
    config_class = Qwen3_5FusedConfig
    _auto_class = "AutoModelForImageTextToText"

    def __init__(self, config):
        check_model_type(config)
        super(Qwen3_5ForConditionalGeneration, self).__init__(config)  # stock's bases; then stock's __init__
        self.model = Qwen3_5FusedModel(config)
        self.lm_head = nn.Linear(config.text_config.hidden_size, config.text_config.vocab_size, bias=False)
        self.post_init()

    def _text_model(self):
        return self.model.language_model

    def _composite_model(self):
        return self.model


class Qwen3_5FusedTextForSequenceClassification(Qwen3_5TextForSequenceClassification):
    """Stock's sequence-classification head over the fused text backbone: the repo's
    ``AutoModelForSequenceClassification`` entry, so a classifier fine-tuned from this repo loads and saves like
    stock's."""

    config_class = Qwen3_5FusedTextConfig
    _auto_class = "AutoModelForSequenceClassification"
    _backbone = Qwen3_5FusedTextModel

    def __init__(self, config):
        # Stock's __init__ with the backbone built directly: stock's `AutoModel.from_config(config)` would ask for
        # trust_remote_code again for a config loaded as remote code (its `auto_map` names our AutoModel).
        check_model_type(config)
        super(GenericForSequenceClassification, self).__init__(config)
        self.num_labels = config.num_labels
        setattr(self, self.base_model_prefix, self._backbone(config))
        self.score = nn.Linear(config.get_text_config().hidden_size, self.num_labels, bias=False)
        self.post_init()


class Qwen3_5FusedForSequenceClassification(Qwen3_5ForSequenceClassification):
    """As :class:`Qwen3_5FusedTextForSequenceClassification`, for composite repos (the backbone is
    :class:`Qwen3_5FusedModel`)."""

    config_class = Qwen3_5FusedConfig
    _auto_class = "AutoModelForSequenceClassification"
    _backbone = Qwen3_5FusedModel
    __init__ = Qwen3_5FusedTextForSequenceClassification.__init__


__all__ = [
    "Qwen3_5FusedTextModel",
    "Qwen3_5FusedForCausalLM",
    "Qwen3_5FusedForCausalLMLoader",
    "Qwen3_5FusedModel",
    "Qwen3_5FusedForConditionalGeneration",
    "Qwen3_5FusedTextForSequenceClassification",
    "Qwen3_5FusedForSequenceClassification",
]

# Registered with the Auto classes as remote loading registers them, by config class (stock `qwen3_5*` configs keep the
# stock classes): stock code that builds a backbone from a fused config (the composite's
# `AutoModel.from_config(config.text_config)`) gets the fused one, and `pipeline("text-generation")` recognises the
# fused causal LM as a causal LM.
AutoModel.register(Qwen3_5FusedTextConfig, Qwen3_5FusedTextModel, exist_ok=True)
AutoModel.register(Qwen3_5FusedConfig, Qwen3_5FusedModel, exist_ok=True)
AutoModelForCausalLM.register(Qwen3_5FusedTextConfig, Qwen3_5FusedForCausalLM, exist_ok=True)
AutoModelForImageTextToText.register(Qwen3_5FusedConfig, Qwen3_5FusedForConditionalGeneration, exist_ok=True)
AutoModelForSequenceClassification.register(Qwen3_5FusedTextConfig, Qwen3_5FusedTextForSequenceClassification,
                                            exist_ok=True)
AutoModelForSequenceClassification.register(Qwen3_5FusedConfig, Qwen3_5FusedForSequenceClassification, exist_ok=True)
