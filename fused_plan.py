# Copyright 2026 The Qwen3.5 fused-kernels authors. Licensed under the Apache License, Version 2.0.
"""The path a fused model runs, resolved once: :class:`FusedPlan`.

One object per text backbone, shared by its fused modules, its runner and the public model. It is resolved when the
model is built, loaded, moved, cast, put in train / eval mode or switched (``set_fused_kernels``), never per call:

- ``reason``: None when the fused layers run, else why the whole model runs the stock code (switch off, no GPU, no
  triton / fla, training mode);
- per layer kind, the fused path or stock with its reason (an MLP activation other than SiLU, ...);
- ``graphs``: whether forwards, prompts and decode steps are captured in CUDA graphs, and why not;
- ``decode_reason``: None when ``generate`` can decode on the fused path (greedy and sampling), else why not;
- ``pdl``: whether our kernels launch with programmatic dependent launch;
- ``shipped_choices``: the card whose shipped kernel choices apply (``fused_tuning``), or None;
- ``ops``: the kernel functions the fused modules call (the Triton kernels; in the tests' CPU emulation, their torch
  references).

The per-call conditions left are contexts, not properties of the model: a call that records gradients
(``torch.is_grad_enabled()``) runs the stock code, said once, and so does a call torch.compile traces.
"""

import torch
from transformers.utils import logging

from .configuration_qwen3_5_fused import resolve_switches
from .fused_compat import GENERATE_HOOKS_REASON, returned_cache_reason
from .fused_ops import (
    gemv_late_signal_min_elems,
    kernels_available,
    op_set,
    pdl_enabled,
    triton_cache_dir,
    triton_cache_holds,
)
from .fused_tuning import card_entry, seed_fla_autotuners

logger = logging.get_logger(__name__)

# The tests set this to run the fused control flow (packed GEMMs, the fused prefill, the decode cache and step, the
# generate loop, the forward graphs' padding) on CPU tensors with every kernel replaced by its torch reference.
EMULATE_ON_CPU = False

KERNELS = op_set()  # the Triton / fla kernels
REFERENCES = op_set(reference=True)  # their torch references (the CPU emulation)

SWIGLU_ACTS = ("silu", "swish")
LAYER_KINDS = ("linear_attention", "full_attention", "mlp", "rms_norm", "decoder_layer")
# The MoE models' kinds: the sparse MoE block where the dense models have their MLP.
MOE_LAYER_KINDS = ("linear_attention", "full_attention", "moe", "rms_norm", "decoder_layer")

_announced: set[str] = set()


def announce(key: str, message: str) -> None:
    """Log ``message`` once per process for ``key``: every fallback is said once, never silently."""
    if key not in _announced:
        _announced.add(key)
        logger.warning(message)


def announced() -> list[str]:
    return sorted(_announced)


# The kernel every fused path compiles (the RMSNorm): when Triton's cache lacks it, the process is on a cold cache
_PROBE_KERNEL = "_rms_norm_kernel"
_cold_cache_checked = False


def cold_cache_notice(device: torch.device) -> None:
    """Once per process, at the first fused plan on a GPU: when Triton's on-disk cache holds none of the fused
    kernels, say that the first call compiles them (a fresh machine's first ``generate`` at 4B on the H200: 12-15 s
    with the choices shipped for the card, 48 s without, docs/BENCHMARKS.md "A fresh machine"), so the wait is not
    silent."""
    global _cold_cache_checked
    if _cold_cache_checked:
        return
    _cold_cache_checked = True
    if triton_cache_holds(_PROBE_KERNEL) is False:
        how_long = ("about 15 s at 4B on an H200 with the kernel choices shipped for this card" if card_entry(device)
                    else "about a minute at 4B on an H200 when no kernel choices are shipped for the card "
                    "(scripts/record_tuning.py records them)")
        announce("cold-triton-cache", f"Qwen3.5 fused kernels: Triton's cache ({triton_cache_dir()}) holds none of "
                 f"them yet: the first forward or generate compiles them and runs fla's autotuning, {how_long}, "
                 "once; later calls and processes reuse the cache.")


def _devices(text_model) -> tuple[torch.device, bool]:
    """The embeddings' device, and whether any decoder layer or the final norm sits elsewhere (``device_map``)."""
    device = text_model.embed_tokens.weight.device
    others = [layer.input_layernorm.weight.device for layer in text_model.layers]
    others.append(text_model.norm.weight.device)
    return device, any(d != device for d in others)


class FusedPlan:
    """The resolved path of one text backbone (see the module docstring). Read by the fused modules on every call;
    written only by :meth:`resolve`."""

    def __init__(self):
        self.fused_kernels = False
        self.cuda_graphs = False
        self.reason: str | None = "the model is not built yet"
        self.layer_kinds = LAYER_KINDS
        self.kind_reasons: dict[str, str | None] = {}
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self.multi_device = False
        self.emulated = False
        self.graphs = False
        self.graphs_reason: str | None = None
        self.buckets = False
        self.decode_reason: str | None = self.reason
        self.pdl = False
        self.shipped_choices: str | None = None
        self.ops = KERNELS

    def resolve(self, text_model) -> "FusedPlan":
        """Work the path out for ``text_model`` as it is now (its config, device, dtype, mode)."""
        switches = resolve_switches(text_model.config)
        self.fused_kernels, self.cuda_graphs = switches["fused_kernels"], switches["cuda_graphs"]
        self.device, self.multi_device = _devices(text_model)
        self.dtype = text_model.embed_tokens.weight.dtype
        self.emulated = EMULATE_ON_CPU and self.device.type == "cpu"
        self.ops = REFERENCES if self.emulated else KERNELS
        self.reason = self._model_reason(text_model)
        config = text_model.config
        fused = self.reason is None
        self.layer_kinds = getattr(text_model, "layer_kinds", LAYER_KINDS)
        self.kind_reasons = {kind: self.reason for kind in self.layer_kinds}
        for kind, what in (("mlp", "MLP"), ("moe", "experts'")):
            if fused and kind in self.kind_reasons and config.hidden_act not in SWIGLU_ACTS:
                self.kind_reasons[kind] = f"the {what} activation is {config.hidden_act!r} (fused: silu)"
        deltanet_act = getattr(config, "hidden_act", "silu")
        if fused and deltanet_act not in SWIGLU_ACTS:
            self.kind_reasons["linear_attention"] = f"the DeltaNet activation is {deltanet_act!r} (fused: silu)"
        self.graphs, self.graphs_reason = self._graphs()
        # Forwards and prompts run at their bucket's padded shape whenever the fused path runs on one device, graphs
        # or not (captured on CUDA with cuda_graphs on): the same call gives the same numbers whatever the switch,
        # first call or replay. The CPU emulation runs the same padded shapes eagerly, so the tests cover them.
        self.buckets = fused and not self.multi_device
        # the stock MoE block syncs with the host (the experts hit), so the fused step needs the fused one
        self.decode_reason = (self.reason or self.kind_reasons["linear_attention"] or self.kind_reasons.get("moe")
                              or GENERATE_HOOKS_REASON)
        self.pdl = fused and pdl_enabled(self.device)
        entry = card_entry(self.device) if fused else None
        self.shipped_choices = entry["name"] if entry else None
        if fused and self.device.type == "cuda":
            seed_fla_autotuners(self.device)
            cold_cache_notice(self.device)
        return self

    def _model_reason(self, text_model) -> str | None:
        if not self.fused_kernels:
            return "fused_kernels is off"
        unavailable = None if self.emulated else kernels_available()
        if unavailable is not None:
            return unavailable
        if self.device.type != "cuda" and not self.emulated:
            return f"the model is on {self.device.type}"
        if text_model.training:
            return "the model is in training mode"
        return returned_cache_reason()

    def _graphs(self) -> tuple[bool, str | None]:
        if self.reason is not None:
            return False, None
        if not self.cuda_graphs:
            return False, "cuda_graphs is off"
        if self.multi_device:
            return False, "the model is split over several devices (device_map); one graph cannot span devices"
        if self.device.type != "cuda":
            return False, f"the model is on {self.device.type}"
        return True, None

    @property
    def fused(self) -> bool:
        return self.reason is None

    def runs(self, kind: str) -> bool:
        """Whether a call of layer kind ``kind`` takes the fused path now (announces a fallback once)."""
        if torch.compiler.is_compiling():
            # torch.compile traces the stock code (our Triton launches and packed-weight checks are not traceable);
            # nothing is logged from inside a trace (a log call would break a fullgraph compile)
            return False
        reason = self.kind_reasons.get(kind, self.reason)
        if reason is None and torch.is_grad_enabled():
            reason = "gradients are enabled (run under torch.no_grad() or torch.inference_mode())"
        if reason is None:
            return True
        if self.fused_kernels:
            who = "the model runs" if reason == self.reason else f"{kind} runs"
            announce(reason, f"Qwen3.5 fused kernels: {who} the stock transformers code because {reason}.")
        return False

    def fallback(self, kind: str, reason: str) -> None:
        """Announce once that ``kind`` runs the stock code for one kind of call, because ``reason``."""
        announce(f"{kind}/{reason}", f"Qwen3.5 fused kernels: {kind} runs the stock transformers code: {reason}.")

    def render(self) -> dict:
        """The plan as ``describe()`` reports it."""
        return {
            "fused_kernels": self.fused_kernels,
            "cuda_graphs": self.cuda_graphs,
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "reason": self.reason,
            "graphs": self.graphs,
            "graphs_reason": self.graphs_reason,
            "buckets": self.buckets,
            "decode_reason": self.decode_reason,
            "pdl": self.pdl,
            "shipped_choices": self.shipped_choices,
            "pdl_gemv_late_signal_min_weight_elems": gemv_late_signal_min_elems() if self.pdl else None,
            "kernels": "torch references (CPU emulation)" if self.emulated else "triton / fla",
        }
