# Copyright 2026 The Qwen3.5 fused-kernels authors. Licensed under the Apache License, Version 2.0.
"""Fused Qwen3.5 model classes (remote code): the public entry points.

Each class subclasses its stock transformers Qwen3.5 class and only adds the fused inference path:

- ``Qwen3_5FusedTextModel`` / ``Qwen3_5FusedForCausalLM``: the text backbone and the causal LM.
- ``Qwen3_5FusedModel`` / ``Qwen3_5FusedForConditionalGeneration``: the composite vision-language model that real
  Qwen3.5 checkpoints use; the vision tower is the stock one, untouched, and the text backbone is fused.
- ``Qwen3_5FusedForCausalLMLoader``: the ``AutoModelForCausalLM`` entry of composite repos.
- ``Qwen3_5Moe*``: the same five for the MoE models (``qwen3_5_moe`` / ``qwen3_5_moe_text``), their decoder layers
  the dense fused ones with the fused sparse MoE block (``fused_moe``). They load the Hub's per-expert checkpoint
  layout and stock's 3D one, and save the per-expert layout (``fused_compat.register_expert_layouts``).

The dense and MoE classes share their bodies (the ``_Fused*Mixin`` classes); each public class names its stock class,
its backbone and its config.

The classes with an LM head (the causal LMs and the composite models) also hold the multi-token-prediction head the
real checkpoints ship (``mtp.*``, ``fused_mtp``), which stock drops at load: when the config names it and the
checkpoint has it (``_FusedMTPMixin``).

The backbone is built from the fused layer modules (``fused_layers``), with stock's parameter names and shapes, so
the state dict is stock's. What runs is decided once, in the backbone's :class:`FusedPlan` (``fused_plan``),
resolved when the model is built, loaded, moved, cast, put in train / eval mode or switched; ``describe()`` renders
it. Calls that use the model's reusable GPU state (a fused ``generate``, a forward at its length bucket) go through
its :class:`FusedRunner` (``fused_runner``); the generate hooks here are thin: they hand generate a fused decode
cache and run the fused loop (``fused_generate``), and otherwise defer to stock. ``generate_batch`` and
``init_continuous_batching`` (continuous batching, which stock refuses for Qwen3.5) hand the call to ``fused_batch``
and ``fused_batch_manager``.
"""

import contextvars

import torch
from torch import nn
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoModelForSequenceClassification,
    GenerationMixin,
)
from transformers import initialization as stock_init
from transformers.modeling_layers import GenericForSequenceClassification
from transformers.modeling_outputs import BaseModelOutputWithPast, MoeModelOutputWithPast
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    Qwen3_5Attention,
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5ForSequenceClassification,
    Qwen3_5GatedDeltaNet,
    Qwen3_5Model,
    Qwen3_5RMSNorm,
    Qwen3_5TextForSequenceClassification,
    Qwen3_5TextModel,
    Qwen3_5TextRotaryEmbedding,
)
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
    Qwen3_5MoeExperts,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3_5MoeModel,
    Qwen3_5MoeSparseMoeBlock,
    Qwen3_5MoeTextModel,
    Qwen3_5MoeTextRotaryEmbedding,
    Qwen3_5MoeTopKRouter,
)
from transformers.utils.output_capturing import OutputRecorder

from .configuration_qwen3_5_fused import (
    SWITCHES,
    Qwen3_5FusedConfig,
    Qwen3_5FusedTextConfig,
    Qwen3_5MoeFusedConfig,
    Qwen3_5MoeFusedTextConfig,
    check_switch,
    resolve_switch,
)
from .fused_compat import (
    CACHE_KWS,
    EXPERT_LAYOUTS_REASON,
    FUSED_GENERATION_MODES,
    GENERATE_CACHE_KW,
    GENERATE_HOOKS_REASON,
    LOAD_HOOK_REASON,
    allow_experts_implementation,
    bind_forward_args,
    checkpoint_keys,
    convert_head_experts,
    find_cache,
    forget_device_map_entries,
    generation_mode_name,
    head_expert_layout,
    hook_args,
    load_hook_args,
    per_expert_save,
    register_expert_layouts,
    with_signature_of,
)
from .fused_batch import generate_batch as fused_generate_batch
from .fused_batch_manager import init_continuous_batching as fused_init_continuous_batching
from .fused_decode import FusedDecodeCache
from .fused_generate import fused_sample, with_stock_cache
from .fused_layers import FUSED_OPS, FusedDecoderLayer, FusedRMSNorm, pack_all
from .fused_ops import prefill_rule_kernel, small_linear_choices
from .fused_moe import FUSED_MOE_OPS, FusedMoeDecoderLayer
from .fused_mtp import MTP_PREFIX, Qwen3_5MultiTokenPredictor, mtp_layer_count
from .fused_plan import LAYER_KINDS, MOE_LAYER_KINDS, FusedPlan, announce, announced
from .fused_runner import FusedRunner
from .fused_speculative import (
    CALL_SPECULATIVE_TOKENS,
    SPECULATIVE_TOKENS_FIELD,
    check_speculative_tokens,
    describe_speculative,
    speculation_blocker,
    speculative_sample,
    speculative_tokens,
)

SUPPORTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_text")
MOE_MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")
_CONFIG_LOAD_KWARGS = ("revision", "cache_dir", "local_files_only", "token", "subfolder")


def _tensor_parallel_requested(kwargs: dict) -> bool:
    if kwargs.get("tp_plan") is not None or kwargs.get("tp_size") is not None or kwargs.get("device_mesh") is not None:
        return True
    distributed = kwargs.get("distributed_config")
    return distributed is not None and (
        getattr(distributed, "tp_plan", None) is not None or getattr(distributed, "tp_size", None) is not None
    )


def check_model_type(config, model_types=SUPPORTED_MODEL_TYPES) -> None:
    """``ValueError`` naming the model type and the classes to use, unless ``config``'s is one of ``model_types``."""
    model_type = getattr(config, "model_type", None)
    if model_type not in model_types:
        moe = model_type in MOE_MODEL_TYPES
        use = (" (an MoE checkpoint: use the Qwen3_5MoeFused* classes)" if moe and model_types != MOE_MODEL_TYPES else
               " (a dense checkpoint: use the Qwen3_5Fused* classes)" if model_type in SUPPORTED_MODEL_TYPES else "")
        raise ValueError(
            f"These fused Qwen3.5 classes load model_type {' or '.join(model_types)}, got model_type={model_type!r}"
            f"{use}."
        )


def _sync_switches(config) -> None:
    """Copy a composite config's switches into its text config (the backbone reads them there)."""
    text_config = getattr(config, "text_config", None)
    if text_config is not None:
        for name in SWITCHES:
            setattr(text_config, name, check_switch(name, getattr(config, name, None), allow_unset=True))


# True inside `from_pretrained`, which decides the load's `use_kernels` from the switches the caller passed (applied
# to the config only after the load): `set_use_kernels` then takes the value as it comes.
_LOAD_DECIDED_HUB_KERNELS: contextvars.ContextVar = contextvars.ContextVar("qwen3_5_load_hub_kernels", default=False)
# True inside `from_pretrained`: where transformers' load hook differs (`LOAD_HOOK_REASON`), a load builds no MTP head.
_LOADING: contextvars.ContextVar = contextvars.ContextVar("qwen3_5_loading", default=False)


def _hub_kernels_off(requested) -> bool:
    """transformers' Hub kernels (``use_kernels``; on by default from transformers 5.25) are not applied while the
    fused kernels are on: the fused path already replaces every layer they would swap (the zero-centred and gated
    RMSNorms, the Gated DeltaNet layer and its conv), and a swapped forward would bypass it. An explicit request is
    answered in one log line; the default is not (nothing the user asked for is dropped). Returns False, the value
    passed on to transformers."""
    if requested:
        announce("hub-kernels", "Qwen3.5 fused kernels: transformers' Hub kernels (use_kernels=True) are not applied "
                 "while fused_kernels is on: the fused path replaces the layers they would swap. Load with "
                 "fused_kernels=False to run stock's layers with Hub kernels instead.")
    return False


class _FusedPreTrainedMixin:
    """Shared by the public classes: load-time switches, the generate hooks, ``set_fused_kernels``, ``describe()``.

    Saving: each class names the Auto class it serves (``_auto_class``), so ``save_pretrained`` copies every code
    file next to the weights, as transformers does for remote code; the config writes stock ``architectures`` and
    the full ``auto_map`` (``configuration_qwen3_5_fused``). The saved folder loads fused with
    ``trust_remote_code=True`` and as a stock checkpoint without it.
    """

    # accelerate keeps modules whole by class *name*: without `FusedDecoderLayer`, `device_map="auto"` could cut a
    # layer between GPUs, even between the views of one packed matrix.
    _no_split_modules = ["Qwen3_5DecoderLayer", "FusedDecoderLayer", "Qwen3_5VisionBlock", "Qwen3_5MoeDecoderLayer",
                         "FusedMoeDecoderLayer", "Qwen3_5MoeVisionBlock"]
    _model_types = SUPPORTED_MODEL_TYPES  # the model types this class loads

    @classmethod
    def _check_model_type(cls, config) -> None:
        check_model_type(config, cls._model_types)
        if cls._model_types == MOE_MODEL_TYPES and EXPERT_LAYOUTS_REASON is not None:
            announce("moe/layouts", "Qwen3.5 fused MoE: only checkpoints in transformers' 3D expert layout load "
                     f"(experts.gate_up_proj / experts.down_proj), and saves keep it, because {EXPERT_LAYOUTS_REASON}.")

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
            cls._check_model_type(type("C", (), {"model_type": config_dict.get("model_type")}))
        elif config is not None and not isinstance(config, (str, bytes)):
            cls._check_model_type(config)
        source = config if config is not None and not isinstance(config, (str, bytes)) else None
        stated = getattr(source, "fused_kernels", None) if source is not None else (config_dict or {}).get(
            "fused_kernels")
        fused_on = resolve_switch(type("C", (), {"fused_kernels": overrides.get("fused_kernels", stated)}),
                                  "fused_kernels")
        if fused_on:
            kwargs["use_kernels"] = _hub_kernels_off(kwargs.get("use_kernels"))
        if _tensor_parallel_requested(kwargs):
            if fused_on:
                raise ValueError(
                    "Tensor parallel loading (tp_plan / tp_size / distributed_config) is not supported with "
                    "fused_kernels=True: the fused path packs q/k/v, qkv/z/b/a and gate/up into one matrix each and "
                    "reads whole-model head counts, so sharded weights would be computed wrongly. Load with "
                    "fused_kernels=False to use the stock tensor-parallel plan, use device_map='auto' to spread "
                    "layers over GPUs with the fused kernels, or serve the checkpoint with vLLM / SGLang."
                )
        token = _LOAD_DECIDED_HUB_KERNELS.set(True)  # the load's use_kernels is decided above: passed on as it is
        loading = _LOADING.set(True)
        try:
            out = super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        finally:
            _LOADING.reset(loading)
            _LOAD_DECIDED_HUB_KERNELS.reset(token)
        model = out[0] if isinstance(out, tuple) else out
        for name, value in overrides.items():
            setattr(model.config, name, value)
        model._refresh_fused()
        return out

    def set_use_kernels(self, use_kernels, *args, **kwargs):
        # transformers' Hub kernels (`kernelize`) swap the forward of stock layer classes ours subclass: they would
        # bypass the fused path, and the fused prefill's writes into the decode buffers with it. Off while fused.
        if use_kernels and not _LOAD_DECIDED_HUB_KERNELS.get() and resolve_switch(self.config, "fused_kernels"):
            use_kernels = _hub_kernels_off(use_kernels)
        return super().set_use_kernels(use_kernels, *args, **kwargs)

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
        # the per-call switch: taken here, so stock's model-kwargs check never sees it
        call_k = check_speculative_tokens(kwargs.pop(SPECULATIVE_TOKENS_FIELD, None), "generate() argument")
        token = CALL_SPECULATIVE_TOKENS.set(call_k)
        try:
            # a fused generate uses the model's shared decode buffers and graphs: one call at a time per model
            if self.fused_plan.decode_reason is None:
                with self._text_model().runner.lock:
                    return with_stock_cache(super().generate(*args, **kwargs), self._text_model())
            return super().generate(*args, **kwargs)
        finally:
            CALL_SPECULATIVE_TOKENS.reset(token)

    def speculative_tokens(self, generation_config=None) -> int:
        """How many tokens the MTP head drafts a round in a fused ``generate`` (0: off); see
        ``fused_speculative.speculative_tokens``."""
        return speculative_tokens(self, generation_config)

    def generate_batch(self, inputs, generation_config=None, continuous_batching_config=None,
                       record_timestamps: bool = False, progress_bar: bool = False, persistent_manager: bool = False,
                       warmup: bool = True, **kwargs):
        """transformers' ``generate_batch`` (continuous batching), which stock transformers refuses for Qwen3.5: the
        prompts ``inputs`` (lists of token ids) join and leave one running batch on the fused decode step; returns
        request id -> ``GenerationOutput``, as transformers does. Without the fused path each request runs through
        ``generate`` in turn (said once). See ``fused_batch.generate_batch``."""
        return fused_generate_batch(
            self, inputs, generation_config, continuous_batching_config, record_timestamps=record_timestamps,
            progress_bar=progress_bar, persistent_manager=persistent_manager, warmup=warmup, **kwargs,
        )

    def init_continuous_batching(self, generation_config=None, continuous_batching_config=None, **kwargs):
        """transformers' continuous-batching manager API (``add_request``, ``get_result``, ``request_id_iter``,
        streaming), over the same scheduler as ``generate_batch``, run by a background thread; transformers' own
        ``continuous_batching_context_manager`` starts and stops it. See ``fused_batch_manager``."""
        return fused_init_continuous_batching(self, generation_config, continuous_batching_config, **kwargs)

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
                k = self.speculative_tokens(a["generation_config"])
                if k:
                    reason = speculation_blocker(cache, a["input_ids"], a["model_kwargs"])
                    if reason is None:
                        announce(f"mtp/speculative/{k}", f"Qwen3.5 fused: generate() decodes speculatively: the MTP "
                                 f"head drafts {k} token(s) a round, one fused verify pass over {k + 1} checks them "
                                 f"({SPECULATIVE_TOKENS_FIELD}; 0 turns it off).")
                        return speculative_sample(self, text_model, cache, k, a["input_ids"], a["logits_processor"],
                                                  a["stopping_criteria"], a["generation_config"], a["streamer"],
                                                  a["model_kwargs"])
                    announce(f"mtp/speculative-off/{reason}", "Qwen3.5 fused: generate() decodes without the MTP "
                             f"head's drafts because {reason}.")
                return fused_sample(self, text_model, text_model.runner, cache, a["input_ids"],
                                    a["logits_processor"], a["stopping_criteria"], a["generation_config"],
                                    a["streamer"], a["model_kwargs"])
        return super()._sample(*args, **kwargs)

    # -- switches and reports ----------------------------------------------------------------------------------------

    def _describe_mtp(self) -> dict | None:
        head = getattr(self, "mtp", None)
        if head is None:
            return None
        return {"layers": len(head.layers), "keys": MTP_PREFIX + "*",
                "path": "stock layers, plain torch (mtp_draft(); a speculative generate's prompt pairs; its drafts: "
                        "speculative.drafting)",
                "speculative": describe_speculative(self)}

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
        for kind in text_model.layer_kinds:
            reason = plan.kind_reasons.get(kind, plan.reason)
            kinds[kind] = {
                "path": "fused" if reason is None else "stock",
                "ops": {**FUSED_OPS, "moe": FUSED_MOE_OPS}[kind] if reason is None else "stock transformers forward",
                "reason": reason,
            }
        if "moe" in kinds:
            config = text_model.config
            kinds["moe"].update(
                experts=config.num_experts, experts_per_token=config.num_experts_per_tok,
                router_logits="recorded from the router module, as stock (fused: the packed GEMM's logits)",
                checkpoint_layouts=("per-expert (Hub) and 3D; saved per-expert" if EXPERT_LAYOUTS_REASON is None
                                    else f"3D only: {EXPERT_LAYOUTS_REASON}"),
            )
        if plan.fused:
            kinds["linear_attention"]["prefill_rule_kernel"] = prefill_rule_kernel(plan.dtype)
            kinds["linear_attention"]["falls_back"] = "decode steps outside generate()'s fused cache (stock cache)"
        decode = {
            "path": "fused" if plan.decode_reason is None else "stock",
            "ops": (
                "one step per token on preallocated conv / recurrent / K-V buffers: the conv step in the DeltaNet "
                "input linear's epilogue + gated_delta_rule_step (states in place), attn_prep writing K/V into the "
                "cache + decode_attention (split keys, merged with the sigmoid gate), fused norms; each linear "
                "(gate|up with SwiGLU in its epilogue) by cuBLAS, our GEMV (1 row) or our skinny GEMM (2-32 rows), "
                "whichever was timed faster for its shape on this card or is shipped for the card, the LM head too"
                + ("; the sparse MoE block: one small_linear (shared gate|up, router, shared gate) + moe_route + "
                   "SwiGLU + shared down + moe_experts" if "moe" in kinds else "")
                if plan.decode_reason is None else "stock transformers decode"
            ),
            "cuda_graphs": plan.graphs,
            "pdl": plan.pdl,
            "shipped_choices": plan.shipped_choices,
            **{k: v for k, v in plan.render().items() if k == "pdl_gemv_late_signal_min_weight_elems"},
            "falls_back": "beam search, assisted / contrastive decoding, a cache passed in, cache_implementation, "
            "output_attentions / output_hidden_states (a model split over devices decodes fused, without graphs)",
            "generate_batch": runner.batch.describe() if runner.batch is not None else None,
            "buckets": [
                {"batch": st.batch, "max_len": st.max_len, "graph_captured": bool(st.graph),
                 "cache_bytes": st.nbytes(),
                 "prompt_buckets_captured": sorted(n for n, g in st.prefill_graphs.items() if g.graph)}
                for st in runner.decode_states.values()
            ],
            # the per-shape choice of small_linear, timed at a first decode step in this process
            "linears": {
                f"{m}x{n}x{k}{' gate|up+SwiGLU' if gate_up else ''} {str(dtype).removeprefix('torch.')} {dev}":
                "cublas" if choice == "cublas"
                else f"{'skinny_gemm' if type(choice).__name__ == 'SkinnyConfig' else 'gemv'} {choice!r}"
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
            "mtp": self._describe_mtp(),
            "announced_fallbacks": announced(),
        }


class _FusedTextModelMixin(_FusedPreTrainedMixin):
    """The text backbone, dense or MoE: stock's ``__init__`` with the fused classes (``_decoder_layer``; no stock
    module is built and replaced), its plan and runner, and stock's forward behind the runner."""

    _stock_model: type  # the stock text model class this one is
    _rotary: type
    _decoder_layer = FusedDecoderLayer
    layer_kinds = LAYER_KINDS  # the plan's layer kinds, as describe() reports them
    output_class = BaseModelOutputWithPast  # what stock's forward returns; the runner's fused calls return the same

    def __init__(self, config):
        self._check_model_type(config)
        super(self._stock_model, self).__init__(config)  # the stock class's bases; then stock's __init__, fused
        self.plan = FusedPlan()
        self.runner = FusedRunner(self.plan)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(
            [self._decoder_layer(config, layer_idx, self.plan) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = FusedRMSNorm(config.hidden_size, config.rms_norm_eps, self.plan)
        self.rotary_emb = self._rotary(config=config)
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

    def stock_forward(self, **kwargs):
        """Stock's forward of this backbone (masks, rotary, output recording) over the fused layers, bypassing the
        runner: what the runner and the captured forwards run."""
        return super(_FusedPreTrainedMixin, self).forward(**kwargs)

    @with_signature_of(Qwen3_5TextModel.forward)
    def forward(self, *args, **kwargs):
        """Stock's forward; a call carrying a fused decode cache (inside a fused ``generate``) runs the prompt or the
        decode step on it, and a forward the plan buckets runs at its length bucket's padded shape (replayed from a
        CUDA graph once captured)."""
        kwargs = bind_forward_args(args, kwargs)
        if torch.compiler.is_compiling():  # torch.compile traces stock's forward (the runner holds a lock, graphs)
            return self.stock_forward(**kwargs)
        cache = find_cache(kwargs)
        if isinstance(cache, FusedDecodeCache):
            for kw in CACHE_KWS:
                kwargs.pop(kw, None)
            return self.runner.run_on_cache(self, cache, **kwargs)
        out = self.runner.forward(self, kwargs)
        if out is not None:
            return out
        return self.stock_forward(**kwargs)


class _FusedMTPMixin:
    """The multi-token-prediction head of the classes with an LM head: ``self.mtp``
    (:class:`~fused_mtp.Qwen3_5MultiTokenPredictor`, checkpoint keys ``mtp.*``) or None.

    Held when the config names it (``mtp_num_hidden_layers >= 1`` in the text config) and, for a load, the checkpoint
    has it: the head is built with the model, and dropped before the load reads a tensor when the checkpoint holds no
    ``mtp.*`` key (a checkpoint without the head then loads exactly as before: no missing key). Saves write it back
    under the same keys. Stock classes ignore those keys at load (their ``_keys_to_ignore_on_load_unexpected``), so a
    repo with the head still loads as stock without remote code. The forward does not run it; a fused ``generate``
    drafts with it (``fused_speculative``, ``speculative_tokens``), and :meth:`mtp_draft` runs it directly.
    """

    def _build_mtp(self, config) -> None:
        wanted = mtp_layer_count(config) >= 1
        if wanted and LOAD_HOOK_REASON is not None and _LOADING.get():
            announce("mtp/load", "Qwen3.5 fused: the checkpoint's multi-token-prediction head (mtp.*) is not loaded "
                     f"(ignored, as stock ignores it) because {LOAD_HOOK_REASON}.")
            wanted = False
        self.mtp = Qwen3_5MultiTokenPredictor(config) if wanted else None
        # built for a load: the head is still to be matched to the checkpoint, by the load's first tensor read (later
        # reads, an adapter's through `load_adapter`, hold no head tensors and leave it as it is)
        self._mtp_unmatched = wanted and _LOADING.get()
        # how the checkpoint stored a MoE head's experts (`fused_compat.head_expert_layout`), written back so at save;
        # None: per expert, the Hub's layout (a head built from a config, or a dense head)
        self._mtp_expert_layout = None

    @classmethod
    def _load_pretrained_model(cls, *args, **kwargs):
        a = load_hook_args(args, kwargs)
        model = a.get("model")
        if getattr(model, "mtp", None) is not None and model._mtp_unmatched:
            model._mtp_unmatched = False
            prefix = MTP_PREFIX.rstrip(".")
            keys = checkpoint_keys(a.get("state_dict"), a.get("checkpoint_files"))
            if keys is None or not any(k.startswith(MTP_PREFIX) for k in keys):
                model.mtp = None
                forget_device_map_entries(a.get("load_config"), prefix)
            else:
                model._mtp_expert_layout = head_expert_layout(keys, prefix)
                convert_head_experts(a.get("load_config"), model, prefix, model._mtp_expert_layout)
        return super()._load_pretrained_model(*args, **kwargs)

    def mtp_draft(self, hidden_states: torch.Tensor, next_token_ids: torch.Tensor, **kwargs):
        """``(logits [B, T, V], draft [B, T, H])`` of the MTP head through the model's embedding and LM head:
        position t, from the backbone's last hidden state there (``hidden_states`` [B, T, H], after the final norm)
        and the token at t + 1 (``next_token_ids`` [B, T]), predicts the token at t + 2. ``kwargs``:
        ``position_ids``, ``attention_mask``, ``cache`` (the head's own ``DynamicCache``), ``layer``
        (``Qwen3_5MultiTokenPredictor.forward``)."""
        if self.mtp is None:
            raise ValueError("this model holds no MTP head: its config names none (mtp_num_hidden_layers) or its "
                             "checkpoint has no mtp.* tensors")
        return self.mtp.draft_logits(hidden_states, next_token_ids, self.get_input_embeddings(), self.lm_head,
                                     **kwargs)


class _FusedCausalLMMixin(_FusedMTPMixin, _FusedPreTrainedMixin):
    """The causal LM: stock's ``__init__`` with the fused backbone (``_backbone``) and the MTP head
    (``_FusedMTPMixin``)."""

    _stock_model: type
    _backbone: type
    _config_attributes: tuple[str, ...] = ()  # config values stock's __init__ copies onto the model

    def __init__(self, config):
        self._check_model_type(config)
        super(self._stock_model, self).__init__(config)  # the stock class's bases; then stock's __init__, fused
        self.model = self._backbone(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        for name in self._config_attributes:
            setattr(self, name, getattr(config, name))
        self._build_mtp(config)
        self.post_init()

    def _text_model(self):
        return self.model


class _FusedCausalLMLoaderMixin:
    """``AutoModelForCausalLM`` entry of composite (vision-language) repos, which is how real Qwen3.5 checkpoints
    are laid out: it loads the text backbone and LM head as the causal LM ``_causal_lm``.

    transformers registers a remote class under the repo's config class and requires the two to match by name, so
    composite repos need a causal-LM entry whose ``config_class`` is the composite config; stock transformers does
    the same extraction (``config.get_text_config()``) for its own causal LMs. The checkpoint keys
    ``model.language_model.*`` are read as ``model.*`` (``_key_mapping``: stock does this with its key mapping for
    the text model type, which transformers does not apply to remote code unless told).
    """

    _causal_lm: type
    _key_mapping: dict | None = {r"^model\.language_model\.": "model."}

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
            if cls._key_mapping:
                kwargs.setdefault("key_mapping", cls._key_mapping)
        return cls._causal_lm.from_pretrained(pretrained_model_name_or_path, *args, config=config, **kwargs)

    @classmethod
    def _from_config(cls, config, **kwargs):
        return cls._causal_lm._from_config(cls._text_config_of(config), **kwargs)


class _FusedCompositeModelMixin(_FusedPreTrainedMixin):
    """The composite backbone: stock's vision tower, the fused text backbone (``_backbone``)."""

    _stock_model: type
    _backbone: type

    def __init__(self, config):
        self._check_model_type(config)
        _sync_switches(config)
        super(self._stock_model, self).__init__(config)  # the stock class's bases; then stock's __init__, fused
        self.visual = AutoModel.from_config(config.vision_config)
        self.language_model = self._backbone._from_config(config.text_config)
        self.rope_deltas = None  # cache rope_deltas here (as stock)
        self.post_init()

    def _text_model(self):
        return self.language_model


class _FusedConditionalGenerationMixin(_FusedMTPMixin, _FusedPreTrainedMixin):
    """The composite model with its LM head: stock's ``__init__`` with the fused composite backbone and the MTP head
    (``_FusedMTPMixin``)."""

    _stock_model: type
    _backbone: type

    def __init__(self, config):
        self._check_model_type(config)
        super(self._stock_model, self).__init__(config)  # the stock class's bases; then stock's __init__, fused
        self.model = self._backbone(config)
        self.lm_head = nn.Linear(config.text_config.hidden_size, config.text_config.vocab_size, bias=False)
        self._build_mtp(config)
        self.post_init()

    def _text_model(self):
        return self.model.language_model

    def _composite_model(self):
        return self.model


# -- the dense models --------------------------------------------------------------------------------------------------


class Qwen3_5FusedTextModel(_FusedTextModelMixin, Qwen3_5TextModel):
    """The text backbone, built from the fused layers (stock's ``__init__`` with the fused classes)."""

    config_class = Qwen3_5FusedTextConfig
    _auto_class = "AutoModel"
    _stock_model = Qwen3_5TextModel
    _rotary = Qwen3_5TextRotaryEmbedding


class Qwen3_5FusedForCausalLM(_FusedCausalLMMixin, Qwen3_5ForCausalLM, GenerationMixin):
    config_class = Qwen3_5FusedTextConfig
    _auto_class = "AutoModelForCausalLM"
    _stock_model = Qwen3_5ForCausalLM
    _backbone = Qwen3_5FusedTextModel


class Qwen3_5FusedForCausalLMLoader(_FusedCausalLMLoaderMixin, Qwen3_5FusedForCausalLM):
    __doc__ = _FusedCausalLMLoaderMixin.__doc__
    config_class = Qwen3_5FusedConfig
    _causal_lm = Qwen3_5FusedForCausalLM


class Qwen3_5FusedModel(_FusedCompositeModelMixin, Qwen3_5Model):
    config_class = Qwen3_5FusedConfig
    _auto_class = "AutoModel"
    _stock_model = Qwen3_5Model
    _backbone = Qwen3_5FusedTextModel


class Qwen3_5FusedForConditionalGeneration(
    _FusedConditionalGenerationMixin, Qwen3_5ForConditionalGeneration, GenerationMixin
):
    config_class = Qwen3_5FusedConfig
    _auto_class = "AutoModelForImageTextToText"
    _stock_model = Qwen3_5ForConditionalGeneration
    _backbone = Qwen3_5FusedModel


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


# -- the MoE models (Qwen3.5-35B-A3B, ...) -----------------------------------------------------------------------------


class _FusedMoeMixin:
    """What the MoE classes share beyond the dense ones: the model types they load, the outputs transformers records
    (stock's router logits; hidden states and attentions from the fused layer classes, which subclass the dense
    stock layers: stock's MoE twins are the same code), and the weight init of those dense-typed layers."""

    _model_types = MOE_MODEL_TYPES
    _can_record_outputs = {
        "router_logits": OutputRecorder(Qwen3_5MoeTopKRouter, index=0),
        "hidden_states": FusedMoeDecoderLayer,
        "attentions": Qwen3_5Attention,
    }

    def _init_weights(self, module):
        if isinstance(module, (Qwen3_5MoeExperts, Qwen3_5MoeSparseMoeBlock)) and not hasattr(self.config,
                                                                                          "initializer_range"):
            # a composite model's own MoE block is its MTP head's (the backbone's is its text model's), and stock's
            # init reads initializer_range from the model's config, which a composite config keeps in its text config
            # (the router: the branch below)
            if isinstance(module, Qwen3_5MoeExperts):
                std = self.config.get_text_config().initializer_range
                stock_init.normal_(module.gate_up_proj, mean=0.0, std=std)
                stock_init.normal_(module.down_proj, mean=0.0, std=std)
            return
        super()._init_weights(module)  # stock MoE's: experts, linears, embeddings
        # stock MoE's init tests for its own DeltaNet / RMSNorm classes; the fused ones subclass the dense twins
        if isinstance(module, Qwen3_5MoeTopKRouter):
            # stock initializes the router from its parent block, a module with no parameters of its own, which
            # transformers skips for remote code (it reads such a module as initialized): the router would stay zero,
            # so every token would route to the same k experts. Here the router itself is the module.
            stock_init.normal_(module.weight, mean=0.0, std=self.config.get_text_config().initializer_range)
        elif isinstance(module, Qwen3_5GatedDeltaNet):
            stock_init.ones_(module.dt_bias)
            stock_init.copy_(
                module.A_log, torch.empty(module.num_v_heads, device=module.A_log.device).uniform_(0.01, 16).log_()
            )
        elif isinstance(module, Qwen3_5RMSNorm):
            stock_init.zeros_(module.weight)

    def save_pretrained(self, *args, **kwargs):
        """Stock's save, the backbone's experts always in the per-expert Hub layout, an MTP head's as its checkpoint
        had them (``fused_compat.per_expert_save``)."""
        head = MTP_PREFIX.rstrip(".") if getattr(self, "mtp", None) is not None else None
        with per_expert_save(self, head, getattr(self, "_mtp_expert_layout", None) != "3d"):
            return super().save_pretrained(*args, **kwargs)


class Qwen3_5MoeFusedTextModel(_FusedMoeMixin, _FusedTextModelMixin, Qwen3_5MoeTextModel):
    """The MoE text backbone, built from the fused layers: the dense fused DeltaNet, attention and norms, and the
    fused sparse MoE block (``fused_moe``)."""

    config_class = Qwen3_5MoeFusedTextConfig
    _auto_class = "AutoModel"
    _stock_model = Qwen3_5MoeTextModel
    _rotary = Qwen3_5MoeTextRotaryEmbedding
    _decoder_layer = FusedMoeDecoderLayer
    layer_kinds = MOE_LAYER_KINDS
    output_class = MoeModelOutputWithPast


class Qwen3_5MoeFusedForCausalLM(_FusedMoeMixin, _FusedCausalLMMixin, Qwen3_5MoeForCausalLM, GenerationMixin):
    config_class = Qwen3_5MoeFusedTextConfig
    _auto_class = "AutoModelForCausalLM"
    _stock_model = Qwen3_5MoeForCausalLM
    _backbone = Qwen3_5MoeFusedTextModel
    _config_attributes = ("router_aux_loss_coef", "num_experts", "num_experts_per_tok")


class Qwen3_5MoeFusedForCausalLMLoader(_FusedCausalLMLoaderMixin, Qwen3_5MoeFusedForCausalLM):
    __doc__ = _FusedCausalLMLoaderMixin.__doc__
    config_class = Qwen3_5MoeFusedConfig
    _causal_lm = Qwen3_5MoeFusedForCausalLM
    # stock's MoE conversion, registered (`register_expert_layouts`), changes the prefix itself, as for stock's class
    _key_mapping = None if EXPERT_LAYOUTS_REASON is None else _FusedCausalLMLoaderMixin._key_mapping


class Qwen3_5MoeFusedModel(_FusedMoeMixin, _FusedCompositeModelMixin, Qwen3_5MoeModel):
    config_class = Qwen3_5MoeFusedConfig
    _auto_class = "AutoModel"
    _stock_model = Qwen3_5MoeModel
    _backbone = Qwen3_5MoeFusedTextModel


class Qwen3_5MoeFusedForConditionalGeneration(
    _FusedMoeMixin, _FusedConditionalGenerationMixin, Qwen3_5MoeForConditionalGeneration, GenerationMixin
):
    config_class = Qwen3_5MoeFusedConfig
    _auto_class = "AutoModelForImageTextToText"
    _stock_model = Qwen3_5MoeForConditionalGeneration
    _backbone = Qwen3_5MoeFusedModel


__all__ = [
    "Qwen3_5FusedTextModel",
    "Qwen3_5FusedForCausalLM",
    "Qwen3_5FusedForCausalLMLoader",
    "Qwen3_5FusedModel",
    "Qwen3_5FusedForConditionalGeneration",
    "Qwen3_5FusedTextForSequenceClassification",
    "Qwen3_5FusedForSequenceClassification",
    "Qwen3_5MoeFusedTextModel",
    "Qwen3_5MoeFusedForCausalLM",
    "Qwen3_5MoeFusedForCausalLMLoader",
    "Qwen3_5MoeFusedModel",
    "Qwen3_5MoeFusedForConditionalGeneration",
]

# stock's per-expert conversion for the MoE backbone, wherever it sits (see `fused_compat.register_expert_layouts`)
register_expert_layouts()
for _moe_class in (Qwen3_5MoeFusedTextModel, Qwen3_5MoeFusedForCausalLM, Qwen3_5MoeFusedForCausalLMLoader,
                   Qwen3_5MoeFusedModel, Qwen3_5MoeFusedForConditionalGeneration):
    allow_experts_implementation(_moe_class)

# Registered with the Auto classes as remote loading registers them, by config class (stock `qwen3_5*` configs keep the
# stock classes): stock code that builds a backbone from a fused config (the composite's
# `AutoModel.from_config(config.text_config)`) gets the fused one, and `pipeline("text-generation")` recognises the
# fused causal LM as a causal LM.
for _text_config, _text_model, _causal_lm, _composite_config, _composite_model, _conditional in (
    (Qwen3_5FusedTextConfig, Qwen3_5FusedTextModel, Qwen3_5FusedForCausalLM, Qwen3_5FusedConfig, Qwen3_5FusedModel,
     Qwen3_5FusedForConditionalGeneration),
    (Qwen3_5MoeFusedTextConfig, Qwen3_5MoeFusedTextModel, Qwen3_5MoeFusedForCausalLM, Qwen3_5MoeFusedConfig,
     Qwen3_5MoeFusedModel, Qwen3_5MoeFusedForConditionalGeneration),
):
    AutoModel.register(_text_config, _text_model, exist_ok=True)
    AutoModel.register(_composite_config, _composite_model, exist_ok=True)
    AutoModelForCausalLM.register(_text_config, _causal_lm, exist_ok=True)
    AutoModelForImageTextToText.register(_composite_config, _conditional, exist_ok=True)
AutoModelForSequenceClassification.register(Qwen3_5FusedTextConfig, Qwen3_5FusedTextForSequenceClassification,
                                            exist_ok=True)
AutoModelForSequenceClassification.register(Qwen3_5FusedConfig, Qwen3_5FusedForSequenceClassification, exist_ok=True)
