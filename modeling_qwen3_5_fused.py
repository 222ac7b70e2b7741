"""Fused Qwen3.5 model classes (remote code).

Each class subclasses its stock transformers Qwen3.5 class and only adds the fused inference path:

- ``Qwen3_5FusedTextModel`` / ``Qwen3_5FusedForCausalLM``: the text backbone and the causal LM.
- ``Qwen3_5FusedModel`` / ``Qwen3_5FusedForConditionalGeneration``: the composite vision-language model that real
  Qwen3.5 checkpoints use; the vision tower is the stock one, untouched, and the text backbone is fused.

How it works. After the stock ``__init__`` builds the stock modules, the decoder modules are switched (by class, in
place: no parameter is added, removed or renamed) to the ``Fused*`` subclasses below, and each group of projections
is packed into one matrix:

- Gated DeltaNet: ``in_proj_qkv | in_proj_z | in_proj_b | in_proj_a``,
- attention: ``q_proj`` (query with its gate) ``| k_proj | v_proj``,
- MLP: ``gate_proj | up_proj``.

The packed matrix is ``[sum(out), in]`` row-major, so each original ``nn.Linear.weight`` is a contiguous row slice
(a view) of it and parameter memory does not grow. Both GEMM operands are then K-major (``x`` is ``[M, in]``, the
weight ``[N, in]``), the layout cuBLAS and Hopper's wgmma read without a transpose. The state dict keeps the stock
keys and shapes, so ``save_pretrained`` writes a stock checkpoint and stock transformers / vLLM / SGLang load it.

The path is decided once per module and call kind: fused where the kernels cover the call, else the stock
``forward`` (announced once, with the reason). The stock path is taken without fused kernels (``fused_kernels``
off), on CPU, without triton / flash-linear-attention, in training mode, with gradients enabled, and for inputs the
fused path does not cover yet. ``describe()`` reports what runs where.
"""

import contextlib
import inspect

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModel
from transformers.models.qwen3_5 import modeling_qwen3_5 as stock
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    ALL_ATTENTION_FUNCTIONS,
    Qwen3_5Attention,
    Qwen3_5DecoderLayer,
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5GatedDeltaNet,
    Qwen3_5MLP,
    Qwen3_5Model,
    Qwen3_5RMSNorm,
    Qwen3_5TextModel,
    eager_attention_forward,
)
from transformers.utils import logging

from .configuration_qwen3_5_fused import (
    Qwen3_5FusedConfig,
    Qwen3_5FusedTextConfig,
    check_switch,
    resolve_switch,
)
from .fused_ops import (
    HAS_FLA,
    attn_prep,
    fla_causal_conv1d,
    fla_chunk_gated_delta_rule,
    fla_rms_norm_gated,
    kernels_available,
    rms_norm,
    sigmoid_gate_mul,
    swiglu,
)

logger = logging.get_logger(__name__)

SUPPORTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_text")

# The stock keyword that carries the cache differs across transformers 5.x ("cache" from 5.2x, before that
# "cache_params" for the DeltaNet layer and "past_key_values" for attention and decoder layers).
_DELTANET_CACHE_KW = "cache" if "cache" in inspect.signature(Qwen3_5GatedDeltaNet.forward).parameters else "cache_params"
_ATTENTION_CACHE_KW = "cache" if "cache" in inspect.signature(Qwen3_5Attention.forward).parameters else "past_key_values"
_CACHE_KWS = ("cache", "cache_params", "past_key_values")

# Stock functions that transformers swaps for flash-linear-attention / causal-conv1d kernels at import when those
# packages are installed, whatever the device of the tensors. On CPU we call their plain-torch versions instead.
_STOCK_KERNEL_FNS = (
    "torch_chunk_gated_delta_rule",
    "torch_recurrent_gated_delta_rule",
    "causal_conv1d_fn",
    "causal_conv1d_update",
)

_announced: set[str] = set()


def _announce(key: str, message: str) -> None:
    """Log ``message`` once per process for ``key``: every fallback is said once, never silently."""
    if key not in _announced:
        _announced.add(key)
        logger.warning(message)


@contextlib.contextmanager
def _torch_reference_kernels():
    """Route the stock DeltaNet helpers to their plain-torch versions while CPU tensors run through the stock code.

    Stock transformers replaces them by fla's Triton kernels when fla is installed, and those crash on CPU tensors
    ("0 active drivers"). Not thread-safe: it swaps module attributes of ``modeling_qwen3_5`` for the call.
    """
    saved = {name: getattr(stock, name) for name in _STOCK_KERNEL_FNS if hasattr(stock, name)}
    try:
        for name, fn in saved.items():
            setattr(stock, name, inspect.unwrap(fn))
        yield
    finally:
        for name, fn in saved.items():
            setattr(stock, name, fn)


def _stock_needs_torch_route(hidden_states: torch.Tensor) -> bool:
    if hidden_states.device.type == "cuda":
        return False
    return any(inspect.unwrap(getattr(stock, n)) is not getattr(stock, n) for n in _STOCK_KERNEL_FNS if hasattr(stock, n))


def _pop_cache(kwargs: dict):
    """Remove and return the cache object from ``kwargs`` whatever stock keyword carries it."""
    cache = None
    for kw in _CACHE_KWS:
        value = kwargs.pop(kw, None)
        if value is not None:
            cache = value
    return cache


# --------------------------------------------------------------------------------------------------------------------
# Packed projections
# --------------------------------------------------------------------------------------------------------------------


def pack_linears(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """Pack the weights (and biases) of ``linears`` into one ``[sum(out), in]`` matrix; each Linear keeps a view.

    Already-packed groups are returned as they are, so calling this again (after ``.to()``, a load, ...) is cheap.
    Returns ``(weight, bias)`` (``bias`` None when the Linears have none), or None while the weights are on the meta
    device (not materialised yet: `from_pretrained` packs after loading).
    """
    weights = [lin.weight for lin in linears]
    has_bias = linears[0].bias is not None
    packed = getattr(linears[0], "_packed", None)
    if packed is not None and _still_packed(linears, packed):
        return packed
    if any(w.device.type == "meta" for w in weights):
        return None
    fused_w = torch.cat([w.detach() for w in weights], dim=0)
    fused_b = torch.cat([lin.bias.detach() for lin in linears], dim=0) if has_bias else None
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight = nn.Parameter(fused_w[start : start + rows], requires_grad=lin.weight.requires_grad)
        if has_bias:
            lin.bias = nn.Parameter(fused_b[start : start + rows], requires_grad=lin.bias.requires_grad)
        start += rows
    for lin in linears:
        lin._packed = (fused_w, fused_b)
    return fused_w, fused_b


def _still_packed(linears, packed) -> bool:
    fused_w, fused_b = packed
    start = 0
    for lin in linears:
        w = lin.weight
        rows = w.shape[0]
        if (
            w.device != fused_w.device
            or w.dtype != fused_w.dtype
            or w.untyped_storage().data_ptr() != fused_w.untyped_storage().data_ptr()
            or w.data_ptr() != fused_w[start].data_ptr()
        ):
            return False
        if fused_b is not None and lin.bias.data_ptr() != fused_b[start].data_ptr():
            return False
        start += rows
    return start == fused_w.shape[0]


class _FusedModule:
    """Mixin of every fused module: the switch, the per-call decision and weight packing after moves."""

    _fused_kind = "module"
    _fused_groups: tuple[tuple[str, ...], ...] = ()

    def _setup_fused(self, enabled: bool, unavailable: str | None) -> None:
        self._fused_enabled = enabled
        self._fused_unavailable = unavailable
        self._pack()

    def _pack(self) -> None:
        for group in self._fused_groups:
            pack_linears([getattr(self, name) for name in group])

    def _packed_weight(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The packed matrix of this module's projection group (each fused module has one), packed again if its
        parameters were replaced since (``load_state_dict(..., assign=True)``, ``copy.deepcopy``, a parameter set by
        hand), so the fused GEMM never reads a stale copy. The check is two pointer reads."""
        group = self._fused_groups[0]
        head, tail = getattr(self, group[0]), getattr(self, group[-1])
        packed = getattr(head, "_packed", None)
        if (
            packed is None
            or head.weight.data_ptr() != packed[0].data_ptr()
            or tail.weight.data_ptr() + tail.weight.nbytes != packed[0].data_ptr() + packed[0].nbytes
            or getattr(tail, "_packed", None) is not packed
        ):
            packed = pack_linears([getattr(self, name) for name in group])
        return packed

    def _apply(self, fn, recurse=True):
        # .to() / .half() / .cuda() give every parameter a new storage; pack again so the views are restored.
        out = super()._apply(fn, recurse)
        if getattr(self, "_fused_enabled", False):
            self._pack()
        return out

    def _fused_ok(self, x: torch.Tensor) -> bool:
        """One decision point: may this call take the fused path? Announces the reason once when it may not."""
        if not getattr(self, "_fused_enabled", False):
            return False
        reason = self._fused_unavailable
        if reason is None:
            if x.device.type != "cuda":
                reason = f"inputs are on {x.device.type}"
            elif self.training:
                reason = "the model is in training mode"
            elif torch.is_grad_enabled():
                reason = "gradients are enabled (run under torch.no_grad() or torch.inference_mode())"
        if reason is not None:
            _announce(reason, f"Qwen3.5 fused kernels: running the stock transformers code because {reason}.")
            return False
        return True

    def _fallback(self, kind: str, reason: str) -> None:
        _announce(f"{self._fused_kind}/{kind}", f"Qwen3.5 fused kernels: {self._fused_kind} runs the stock transformers code for {kind}: {reason}.")


class FusedRMSNorm(_FusedModule, Qwen3_5RMSNorm):
    """Zero-centred RMSNorm ``x / rms(x) * (1 + w)`` as one Triton kernel."""

    _fused_kind = "rms_norm"

    def forward(self, x):
        if self._fused_ok(x):
            return rms_norm(x, self.weight, self.eps)
        return super().forward(x)


class FusedMLP(_FusedModule, Qwen3_5MLP):
    """SwiGLU MLP: one GEMM for ``gate_proj | up_proj``, a fused ``silu(g) * u``, then ``down_proj``."""

    _fused_kind = "mlp"
    _fused_groups = (("gate_proj", "up_proj"),)

    def forward(self, x):
        if self._fused_ok(x) and self.config.hidden_act in ("silu", "swish"):
            w, _ = self._packed_weight()
            return self.down_proj(swiglu(F.linear(x, w)))
        return super().forward(x)


class FusedAttention(_FusedModule, Qwen3_5Attention):
    """Gated full attention: one GEMM for ``q_proj (q | gate) | k_proj | v_proj``, one launch for split + q/k RMSNorm
    + partial mRoPE, the configured attention kernel (SDPA / flash), and the sigmoid output gate in one pass."""

    _fused_kind = "full_attention"
    _fused_groups = (("q_proj", "k_proj", "v_proj"),)

    def forward(self, hidden_states, position_embeddings, attention_mask=None, **kwargs):
        if not self._fused_ok(hidden_states):
            return super().forward(hidden_states, position_embeddings, attention_mask, **kwargs)
        cache = _pop_cache(kwargs)
        batch, seq_len = hidden_states.shape[:2]
        w, b = self._packed_weight()
        qkv = F.linear(hidden_states, w, b)
        cos, sin = position_embeddings
        query, key, value, gate = attn_prep(
            qkv,
            cos,
            sin,
            self.q_norm.weight,
            self.k_norm.weight,
            self.q_norm.eps,
            self.config.num_attention_heads,
            self.config.num_key_value_heads,
            self.head_dim,
        )
        if cache is not None:
            # stock 5.2x hands the call's kwargs to the cache layer (stock 5.17 passes none)
            extra = {"kwargs": kwargs} if _ATTENTION_CACHE_KW == "cache" else {}
            key, value = cache.update(key, value, self.layer_idx, **extra)
        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        attn_output, attn_weights = attention_interface(
            self, query, key, value, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs
        )
        attn_output = sigmoid_gate_mul(attn_output.view(batch, seq_len, -1, self.head_dim), gate)
        return self.o_proj(attn_output), attn_weights


class FusedGatedDeltaNet(_FusedModule, Qwen3_5GatedDeltaNet):
    """Gated DeltaNet: one GEMM for ``in_proj_qkv | in_proj_z | in_proj_b | in_proj_a`` → fla's causal conv →
    fla's chunked gated delta rule (gate from ``A_log`` / ``dt_bias``, beta sigmoid, q/k L2 norm and grouped value
    heads inside the kernel) → fla's gated RMSNorm → ``out_proj``.

    Covers forwards without a cache and the prefill that fills an empty cache; a call that continues from a cached
    state (decode, chunked prefill) runs the stock code.
    """

    _fused_kind = "linear_attention"
    _fused_groups = (("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),)

    def forward(self, hidden_states, *args, **kwargs):
        if self._fused_ok(hidden_states) and self.activation in ("silu", "swish"):
            cache = kwargs.get(_DELTANET_CACHE_KW, args[0] if args else None)
            if cache is None or not cache.has_previous_state(self.layer_idx):
                attention_mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
                return self._fused_forward(hidden_states, cache, attention_mask)
            self._fallback("decode", "continuing from a cached state is not fused yet")
        if _stock_needs_torch_route(hidden_states):
            with _torch_reference_kernels():
                return super().forward(hidden_states, *args, **kwargs)
        return super().forward(hidden_states, *args, **kwargs)

    def _fused_forward(self, hidden_states, cache, attention_mask):
        hidden_states = stock.apply_mask_to_padding_states(hidden_states, attention_mask)
        batch, seq_len, _ = hidden_states.shape
        w, _ = self._packed_weight()
        proj = F.linear(hidden_states, w)  # [B, T, conv_dim + value_dim + 2 * HV]
        mixed_qkv, z, b, a = torch.split(
            proj, [self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads], dim=-1
        )
        if cache is not None:
            cache.update_conv_state(mixed_qkv.transpose(1, 2), self.layer_idx, conv_kernel_size=self.conv_kernel_size)
        mixed_qkv, _ = fla_causal_conv1d(
            x=mixed_qkv, weight=self.conv1d.weight.squeeze(1), bias=self.conv1d.bias, activation="silu"
        )
        query, key, value = torch.split(mixed_qkv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        query = query.reshape(batch, seq_len, self.num_k_heads, self.head_k_dim)
        key = key.reshape(batch, seq_len, self.num_k_heads, self.head_k_dim)
        value = value.reshape(batch, seq_len, self.num_v_heads, self.head_v_dim)
        core, last_state = fla_chunk_gated_delta_rule(
            query,
            key,
            value,
            g=a,
            beta=b,
            output_final_state=cache is not None,
            use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True,
            A_log=self.A_log,
            dt_bias=self.dt_bias,
        )
        if cache is not None:
            cache.update_recurrent_state(last_state, self.layer_idx)
        core = fla_rms_norm_gated(
            core.reshape(-1, self.head_v_dim),
            z.reshape(-1, self.head_v_dim),
            self.norm.weight,
            self.norm.variance_epsilon,
        )
        return self.out_proj(core.reshape(batch, seq_len, -1))


class FusedDecoderLayer(_FusedModule, Qwen3_5DecoderLayer):
    """Decoder layer whose second norm also does the residual add (``h = x + r; y = norm(h)`` in one kernel)."""

    _fused_kind = "decoder_layer"

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, position_ids=None, **kwargs):
        if not self._fused_ok(hidden_states):
            return super().forward(
                hidden_states, position_embeddings, attention_mask=attention_mask, position_ids=position_ids, **kwargs
            )
        cache = _pop_cache(kwargs)
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        if self.block_type == "linear_attention":
            hidden_states = self.linear_attn(
                hidden_states=hidden_states, attention_mask=attention_mask, **{_DELTANET_CACHE_KW: cache}, **kwargs
            )
        else:
            hidden_states, _ = self.self_attn(
                hidden_states=hidden_states,
                position_embeddings=position_embeddings,
                attention_mask=attention_mask,
                position_ids=position_ids,
                **{_ATTENTION_CACHE_KW: cache},
                **kwargs,
            )
        ln = self.post_attention_layernorm
        hidden_states, residual = rms_norm(hidden_states, ln.weight, ln.eps, residual=residual)
        return residual + self.mlp(hidden_states)


_FUSED_CLASSES = {
    Qwen3_5RMSNorm: FusedRMSNorm,
    Qwen3_5MLP: FusedMLP,
    Qwen3_5Attention: FusedAttention,
    Qwen3_5GatedDeltaNet: FusedGatedDeltaNet,
    Qwen3_5DecoderLayer: FusedDecoderLayer,
}
_FUSED_KINDS = ("linear_attention", "full_attention", "mlp", "rms_norm", "decoder_layer")
_FUSED_OPS = {
    "linear_attention": "1 GEMM (qkv|z|b|a) + fla causal_conv1d + fla chunk_gated_delta_rule (gate, beta, q/k L2 norm in kernel) + fla gated RMSNorm",
    "full_attention": "1 GEMM (q+gate|k|v) + attn_prep (split, q/k RMSNorm, partial mRoPE) + attention + sigmoid gate",
    "mlp": "1 GEMM (gate|up) + SwiGLU",
    "rms_norm": "zero-centred RMSNorm kernel",
    "decoder_layer": "residual add fused into the post-attention RMSNorm",
}


def _fuse_text_model(text_model: Qwen3_5TextModel, config) -> None:
    """Switch the text backbone's decoder modules to the fused classes (in place) and pack their projections."""
    enabled = resolve_switch(config, "fused_kernels")
    unavailable = kernels_available() if enabled else None
    for module in text_model.modules():
        if module is text_model:
            continue
        # q_norm / k_norm stay stock: attn_prep fuses them on the fused path.
        target = _FUSED_CLASSES.get(type(module))
        if target is not None:
            module.__class__ = target
        if isinstance(module, _FusedModule):
            module._setup_fused(enabled, unavailable)
    for layer in text_model.layers:
        attn = getattr(layer, "self_attn", None)
        if attn is not None:
            for norm in (attn.q_norm, attn.k_norm):
                if isinstance(norm, FusedRMSNorm):
                    norm.__class__ = Qwen3_5RMSNorm
    text_model._fused_enabled = enabled
    text_model._fused_unavailable = unavailable


def _check_model_type(config) -> None:
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"The fused Qwen3.5 classes load Qwen3.5 checkpoints (model_type {' or '.join(SUPPORTED_MODEL_TYPES)}), "
            f"got model_type={model_type!r}."
        )


class _FusedPreTrainedMixin:
    """Shared by the four public classes: load-time switches, re-packing after load, ``describe()``."""

    def _text_model(self) -> Qwen3_5TextModel:
        raise NotImplementedError

    def _text_config(self):
        return getattr(self.config, "text_config", self.config)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        overrides = {name: check_switch(name, kwargs.pop(name)) for name in ("fused_kernels", "cuda_graphs") if name in kwargs}
        config = kwargs.get("config")
        if config is None and pretrained_model_name_or_path is not None:
            config_dict, _ = cls.config_class.get_config_dict(
                pretrained_model_name_or_path,
                **{k: kwargs[k] for k in ("revision", "cache_dir", "local_files_only", "token", "subfolder") if k in kwargs},
            )
            _check_model_type(type("C", (), {"model_type": config_dict.get("model_type")}))
        elif config is not None and not isinstance(config, (str, bytes)):
            _check_model_type(config)
        out = super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        model = out[0] if isinstance(out, tuple) else out
        for name, value in overrides.items():
            setattr(model.config, name, value)
        model._refresh_fused()
        return out

    def _sync_switches(self) -> None:
        text_config = self._text_config()
        if text_config is not self.config:
            for name in ("fused_kernels", "cuda_graphs"):
                setattr(text_config, name, check_switch(name, getattr(self.config, name, False)))

    def _refresh_fused(self) -> None:
        self._sync_switches()
        _fuse_text_model(self._text_model(), self._text_config())

    def set_fused_kernels(self, enabled: bool) -> "_FusedPreTrainedMixin":
        """Switch the fused path on or off for this model (also written to its config)."""
        self.config.fused_kernels = check_switch("fused_kernels", enabled)
        self._refresh_fused()
        return self

    def describe(self) -> dict:
        """What runs fused and what falls back, per layer kind, for this model on its current device."""
        text_model = self._text_model()
        enabled = text_model._fused_enabled
        unavailable = text_model._fused_unavailable
        try:
            device = next(text_model.parameters()).device
        except StopIteration:
            device = torch.device("cpu")
        if not enabled:
            reason = "fused_kernels is off"
        elif unavailable is not None:
            reason = unavailable
        elif device.type != "cuda":
            reason = f"the model is on {device.type}"
        elif self.training:
            reason = "the model is in training mode"
        else:
            reason = None
        kinds = {}
        for kind in _FUSED_KINDS:
            kinds[kind] = {
                "path": "fused" if reason is None else "stock",
                "ops": _FUSED_OPS[kind] if reason is None else "stock transformers forward",
                "reason": reason,
            }
        if reason is None:
            kinds["linear_attention"]["falls_back"] = "decode steps that continue from a cached state"
        return {
            "fused_kernels": enabled,
            "device": str(device),
            "layers": kinds,
            "vision_tower": "stock" if hasattr(self._composite_model(), "visual") else None,
            "announced_fallbacks": sorted(_announced),
        }

    def _composite_model(self):
        return self


class Qwen3_5FusedTextModel(_FusedPreTrainedMixin, Qwen3_5TextModel):
    config_class = Qwen3_5FusedTextConfig

    def __init__(self, config):
        _check_model_type(config)
        super().__init__(config)
        _fuse_text_model(self, config)

    def _text_model(self):
        return self


class Qwen3_5FusedForCausalLM(_FusedPreTrainedMixin, Qwen3_5ForCausalLM):
    config_class = Qwen3_5FusedTextConfig

    def __init__(self, config):
        _check_model_type(config)
        super().__init__(config)
        _fuse_text_model(self.model, config)

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
        text_config = config.get_text_config()
        for name in ("fused_kernels", "cuda_graphs"):
            setattr(text_config, name, check_switch(name, getattr(config, name, False)))
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


def _register_text_backbone(config) -> None:
    """Make the stock composite ``__init__`` build the fused text backbone.

    It builds it with ``AutoModel.from_config(config.text_config)``; registering the text config's class (by class,
    not by model type: stock ``qwen3_5_text`` keeps its stock class) makes that return the fused one. Registered
    from the config actually passed in, because a repo loaded from a local folder gets its code modules imported
    under per-file hashes, so its config class can be another copy than the one this module imported.
    """
    text_config_class = type(getattr(config, "text_config", None))
    if issubclass(text_config_class, Qwen3_5FusedTextConfig) or text_config_class.__name__ == Qwen3_5FusedTextConfig.__name__:
        AutoModel.register(text_config_class, Qwen3_5FusedTextModel, exist_ok=True)


class Qwen3_5FusedModel(_FusedPreTrainedMixin, Qwen3_5Model):
    config_class = Qwen3_5FusedConfig

    def __init__(self, config):
        _check_model_type(config)
        _register_text_backbone(config)
        super().__init__(config)
        self._refresh_fused()

    def _text_model(self):
        return self.language_model


class Qwen3_5FusedForConditionalGeneration(_FusedPreTrainedMixin, Qwen3_5ForConditionalGeneration):
    config_class = Qwen3_5FusedConfig

    def __init__(self, config):
        _check_model_type(config)
        _register_text_backbone(config)
        super().__init__(config)
        self._refresh_fused()

    def _text_model(self):
        return self.model.language_model

    def _composite_model(self):
        return self.model


__all__ = [
    "Qwen3_5FusedTextModel",
    "Qwen3_5FusedForCausalLM",
    "Qwen3_5FusedForCausalLMLoader",
    "Qwen3_5FusedModel",
    "Qwen3_5FusedForConditionalGeneration",
]
