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

Decode. For greedy and sampling ``generate`` calls the model hands generate a :class:`FusedDecodeCache` (fixed-address
conv, recurrent and K/V buffers); the fused prefill fills it (from a bucket's second prompt on, replayed from a
captured, left-padded prefill: ``_PrefillGraph``), and every later token is one fused step over those buffers
(``_DecodeState.step``), replayed from a CUDA graph when ``cuda_graphs`` is on, inside a lean generate loop
(``_fused_sample``). Other generation modes keep the stock cache and decode code (announced once). A model split over
several GPUs (``device_map``) runs the same step eagerly, each layer's buffers on its own device.

Forwards. A forward under ``no_grad`` / ``inference_mode`` is replayed from a CUDA graph per length bucket, captured
on the bucket's second call: right-padded when it has no cache, padding or position ids (``_ForwardGraph``),
otherwise left-padded with masked positions, the returned cache built from the bucket's state
(``_MaskedForwardGraph``). Other forwards run the fused kernels eagerly.
"""

import contextlib
import inspect

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModel
from transformers.cache_utils import Cache
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.stopping_criteria import MaxLengthCriteria
from transformers.generation.utils import GenerateDecoderOnlyOutput
from transformers.modeling_outputs import BaseModelOutputWithPast
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
    env_switch,
    resolve_switch,
)
from .fused_ops import (
    HAS_FLA,
    attn_prep,
    capture_error,
    decode_attention,
    deltanet_prep,
    gated_delta_rule_prefill,
    gated_delta_rule_step,
    gated_rms_norm,
    gemv_late_signal_min_elems,
    kernels_available,
    mrope_step,
    pdl_enabled,
    prefill_rule_kernel,
    reset_rng_after_failed_capture,
    rms_norm,
    sigmoid_gate_mul,
    small_linear,
    small_linear_choices,
    swiglu,
)

logger = logging.get_logger(__name__)

SUPPORTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_text")

# The stock keyword that carries the cache differs across transformers 5.x ("cache" from 5.2x, before that
# "cache_params" for the DeltaNet layer and "past_key_values" for attention and decoder layers).
_DELTANET_CACHE_KW = "cache" if "cache" in inspect.signature(Qwen3_5GatedDeltaNet.forward).parameters else "cache_params"
_ATTENTION_CACHE_KW = "cache" if "cache" in inspect.signature(Qwen3_5Attention.forward).parameters else "past_key_values"
_CACHE_KWS = ("cache", "cache_params", "past_key_values")
# ... and the name under which `generate` and the model outputs carry it.
_GENERATE_CACHE_KW = "cache" if "cache" in inspect.signature(Qwen3_5ForCausalLM.forward).parameters else "past_key_values"
_OUTPUT_CACHE_FIELD = "cache" if "cache" in BaseModelOutputWithPast.__dataclass_fields__ else "past_key_values"

# Devices the fused path runs on. The tests widen it to "cpu" (with every kernel swapped for its torch reference) to
# run the fused control flow, cache and `generate` plumbing in CI without a GPU.
_FUSED_DEVICE_TYPES = ("cuda",)

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
            if x.device.type not in _FUSED_DEVICE_TYPES:
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

    def add_to(self, residual, x):
        """``residual + self(x)``, with the add done by the down projection's GEMM epilogue (cuBLAS with beta=1),
        which saves the separate add kernel. ``residual`` [..., N] is overwritten and returned: the decoder layer
        passes the sum buffer its fused norm has just allocated. Other calls (no fused path, hooks on the module)
        compute the plain sum."""
        fused = self._fused_ok(x) and self.config.hidden_act in ("silu", "swish") and self.down_proj.bias is None
        if fused and not (self._forward_hooks or self._forward_pre_hooks or hasattr(self, "_hf_hook")):
            w, _ = self._packed_weight()
            act = swiglu(F.linear(x, w))
            residual.view(-1, residual.shape[-1]).addmm_(act.view(-1, act.shape[-1]), self.down_proj.weight.t())
            return residual
        return residual + self(x)


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
    """Gated DeltaNet: one GEMM for ``in_proj_qkv | in_proj_z | in_proj_b | in_proj_a`` → ``deltanet_prep`` (causal
    conv + SiLU, q/k L2 norm, beta sigmoid, one launch) → fla's gated delta rule (``gated_delta_rule_prefill``: gate
    from ``A_log`` / ``dt_bias`` and grouped value heads inside the kernel; chunked, or per-token for IEEE fp32) →
    ``gated_rms_norm`` (z read in place) → ``out_proj``.

    Covers forwards without a cache and the prefill that fills an empty cache. A call that continues from a stock
    cache's state (decode outside the fused generate path, chunked prefill) runs the stock code; decode on a
    :class:`FusedDecodeCache` runs ``_DecodeState._deltanet_step`` instead of this forward.
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
        # One launch: conv + SiLU of the q|k|v columns, the q / k L2 norm, sigmoid(b) and a copied out contiguous,
        # so fla's delta rule neither normalises nor copies its inputs.
        query, key, value, beta, g = deltanet_prep(
            mixed_qkv, self.conv1d.weight.squeeze(1), self.conv1d.bias, b, a,
            self.num_k_heads, self.head_k_dim, self.head_v_dim,
        )
        core, last_state = gated_delta_rule_prefill(
            query, key, value, g, beta, self.A_log, self.dt_bias, output_final_state=cache is not None
        )
        if cache is not None:
            cache.update_recurrent_state(last_state, self.layer_idx)
        # the gate z is read where the GEMM wrote it (a column slice), not copied
        core = gated_rms_norm(core, z, self.norm.weight, self.norm.variance_epsilon)  # [B, T, value_dim]
        return self.out_proj(core)


class FusedDecoderLayer(_FusedModule, Qwen3_5DecoderLayer):
    """Decoder layer whose second norm also does the residual add (``h = x + r; y = norm(h)`` in one kernel)."""

    _fused_kind = "decoder_layer"

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, position_ids=None, **kwargs):
        if not self._fused_ok(hidden_states):
            return super().forward(
                hidden_states, position_embeddings, attention_mask=attention_mask, position_ids=position_ids, **kwargs
            )
        cache = _pop_cache(kwargs)
        if cache is None:
            cache = self.__dict__.get("_prefill_cache")  # set by FusedDecodeCache for the prefill it runs
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
        if isinstance(self.mlp, FusedMLP):
            return self.mlp.add_to(residual, hidden_states)  # residual is the norm's fresh sum buffer: ours to reuse
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
    "linear_attention": "1 GEMM (qkv|z|b|a) + deltanet_prep (conv, SiLU, q/k L2 norm, beta) + fla's gated delta rule (gate in kernel; its chunked kernel, or for fp32 at torch's default 'highest' matmul precision its IEEE per-token kernel) + gated RMSNorm",
    "full_attention": "1 GEMM (q+gate|k|v) + attn_prep (split, q/k RMSNorm, partial mRoPE) + attention + sigmoid gate",
    "mlp": "1 GEMM (gate|up) + SwiGLU",
    "rms_norm": "zero-centred RMSNorm kernel",
    "decoder_layer": "residual add fused into the post-attention RMSNorm, and into the down projection's GEMM",
}


# --------------------------------------------------------------------------------------------------------------------
# Fused decode: preallocated hybrid state, one fused step, CUDA graphs
# --------------------------------------------------------------------------------------------------------------------

# Cache lengths are rounded up to a power of two (at least this), so generate calls of nearby lengths share buffers
# and their captured graph. Attention reads the whole length each step (masked), at most 2x the tokens it needs.
_MIN_DECODE_LEN = 256
# Decode buckets (batch size x cache length) kept per model; the least recently used beyond this is freed.
_MAX_DECODE_STATES = 2


def _decode_len_bucket(needed: int) -> int:
    return max(_MIN_DECODE_LEN, 1 << max(0, needed - 1).bit_length())


class _WeightsSnapshot:
    """What a captured graph reads: every parameter (owner, name, tensor, address) and every submodule (parent, name,
    module) of the given modules (the text model, and the LM head when the graph runs it), taken at capture.
    ``unchanged()`` is checked before each replay: a parameter replaced (``load_state_dict(..., assign=True)``,
    assignment, ``.data =``) or a submodule swapped (an adapter injected) means the graph would read stale memory, so
    it is captured again. Checking the snapshot costs a fraction of walking the module tree again (~1.2 ms per call
    at 4B on a CPU-only host)."""

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


def _step_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for the decode step's [B, in] rows: ``small_linear`` (cuBLAS or our GEMV, whichever
    this card runs faster for the shape), or ``F.linear`` with a bias (none in Qwen3.5)."""
    if bias is not None:
        return F.linear(x, weight, bias)
    return small_linear(x, weight)


def _pack_all(text_model) -> None:
    """Pack (or re-pack) every projection group now, outside any capture, so no packing allocates inside one."""
    for module in text_model.modules():
        if isinstance(module, _FusedModule) and module._fused_groups:
            module._packed_weight()


def _graph_pool(text_model):
    """The memory pool every forward / prompt graph of this model is captured on (None off CUDA): graphs are replayed
    one at a time and their outputs copied out at once, so they can share it."""
    if text_model.embed_tokens.weight.device.type != "cuda":
        return None
    if "_forward_graph_pool" not in text_model.__dict__:
        text_model._forward_graph_pool = torch.cuda.graph_pool_handle()
    return text_model._forward_graph_pool


# Rotary types whose module computes cos / sin from a fixed ``inv_freq`` (no per-call update, unlike the dynamic and
# longrope types): for these the decode step computes stock's values itself, in fewer launches (``_step_rope``).
_STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _rope_plan(rot, device) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    """For stock's interleaved-mRoPE text rotary module ``rot`` with a static type: ``(sections [R], freqs [R],
    attention_scaling)`` for ``mrope_step``, R = 2 * len(inv_freq) the rotary dims of cos / sin: dimension d reads
    position row ``sections[d]`` (0 / 1 / 2 = t / h / w, stock's ``recomposition_frequencies``) and float32 frequency
    ``freqs[d] = inv_freq[d mod R/2]`` (stock's ``cat((f, f))``; a static type never changes ``inv_freq``). None for
    any other module (a subclass's forward, a dynamic type) and for a module on another device than ``device`` (a
    model split over devices, where accelerate's hook moves the module's inputs to it), which the step then calls as
    it is."""
    here, there = torch.device(device), rot.inv_freq.device
    if (
        type(rot).forward is not stock.Qwen3_5TextRotaryEmbedding.forward
        or getattr(rot, "rope_type", None) not in _STATIC_ROPE_TYPES
        or not hasattr(rot, "recomposition_frequencies")
        or here.type != there.type
        or None not in (here.index, there.index) and here.index != there.index
    ):
        return None
    half = rot.inv_freq.shape[0]
    sections = torch.zeros(half, dtype=torch.long)
    for row, offset in ((1, 1), (2, 2)):  # as recomposition_frequencies: h at 1, 4, 7, ...; w at 2, 5, 8, ...
        sections[offset : rot.mrope_section[row] * 3 : 3] = row
    freqs = rot.inv_freq.float().repeat(2)
    return sections.repeat(2).to(device), freqs, float(rot.attention_scaling)


class _DecodeState:
    """The fixed-address tensors one decode bucket keeps across ``generate`` calls, and its CUDA graph.

    Buffers, for batch B and cache length L (created once, updated in place):

    - linear-attention layer i: ``conv[i]`` [B, conv_dim, K] (model dtype, the last K pre-conv inputs, as stock's
      conv state) and ``recurrent[i]`` [B, HV, Dk, Dv] float32 (as fla's chunked kernel returns it);
    - full-attention layer i: ``keys[i]``, ``values[i]`` [B, KV, L, D] (model dtype);
    - step inputs: ``embeds`` [B, 1, hidden], ``positions`` [3, B, 1] (mRoPE t/h/w), ``slot`` [1] int64 (the cache
      index the next token is written to; the step advances it), ``key_valid`` [B, L] bool (padding mask of the
      keys written so far).

    The step (``step``) runs the whole decoder for one token on these buffers; with CUDA graphs it is captured
    once, on its second call (the first, eager, warms every kernel), and replayed for every later token.
    """

    def __init__(self, text_model, batch: int, max_len: int):
        # normal tensors even when generate runs under torch.inference_mode(): later calls may run without it, and
        # inference tensors cannot be updated in place outside it
        with torch.inference_mode(False):
            self._allocate(text_model, batch, max_len)
        self.graph = None  # torch.cuda.CUDAGraph once captured; False after a failed capture (eager from then on)
        self.graph_out = None
        self.graph_weights = None
        self.graph_head = None  # the LM head the graph runs (None: the graph ends at the final norm)
        self.warm = False
        self.owner = None
        self.prefill_graphs = {}  # prompt-length bucket -> _PrefillGraph
        self.prefill_calls = {}  # prompt-length bucket -> prefills seen (captured on the second)

    def _allocate(self, text_model, batch: int, max_len: int) -> None:
        weight = text_model.embed_tokens.weight
        dtype, device = weight.dtype, weight.device
        config = text_model.config
        self.batch, self.max_len, self.dtype, self.device = batch, max_len, dtype, device
        self.conv, self.recurrent, self.keys, self.values = {}, {}, {}, {}
        # A model dispatched over several GPUs (device_map) keeps each layer's buffers on that layer's device.
        self.layer_devices = [layer.input_layernorm.weight.device for layer in text_model.layers[: config.num_hidden_layers]]
        self.multi_device = any(d != device for d in self.layer_devices) or text_model.norm.weight.device != device
        for i, layer in enumerate(text_model.layers[: config.num_hidden_layers]):
            device = self.layer_devices[i]
            if layer.block_type == "linear_attention":
                m = layer.linear_attn
                self.conv[i] = torch.zeros(batch, m.conv_dim, m.conv_kernel_size, dtype=dtype, device=device)
                self.recurrent[i] = torch.zeros(
                    batch, m.num_v_heads, m.head_k_dim, m.head_v_dim, dtype=torch.float32, device=device
                )
            else:
                shape = (batch, config.num_key_value_heads, max_len, layer.self_attn.head_dim)
                self.keys[i] = torch.zeros(shape, dtype=dtype, device=device)
                self.values[i] = torch.zeros(shape, dtype=dtype, device=device)
        device = self.device
        self.embeds = torch.zeros(batch, 1, config.hidden_size, dtype=dtype, device=device)
        self.positions = torch.zeros(3, batch, 1, dtype=torch.long, device=device)
        self.slot = torch.zeros(1, dtype=torch.long, device=device)
        self.key_valid = torch.zeros(batch, max_len, dtype=torch.bool, device=device)
        self.rope = _rope_plan(text_model.rotary_emb, device)

    def nbytes(self) -> int:
        tensors = [*self.conv.values(), *self.recurrent.values(), *self.keys.values(), *self.values.values()]
        return sum(t.nbytes for t in tensors)

    def drop_graph(self) -> None:
        self.graph, self.graph_out, self.graph_weights, self.graph_head, self.warm = None, None, None, None, False
        self.prefill_graphs, self.prefill_calls = {}, {}

    def load_positions(self, position_ids, past: int, seq_len: int, advance: int) -> None:
        """Set ``positions`` [3, B, 1] to the last of ``position_ids`` plus ``advance``, reading them as stock's text
        model does: None -> ``past + t`` for every section; [B, T] -> text positions for all three mRoPE
        sections; [4, B, T] -> the text row first, then the sections; [3, B, T] -> the sections."""
        if position_ids is None:
            self.positions.fill_(past + seq_len - 1 + advance)
            return
        if position_ids.dim() == 2:
            last = position_ids[None, :, -1:]
        elif position_ids.shape[0] == 4:
            last = position_ids[1:, :, -1:]
        else:
            last = position_ids[..., -1:]
        self.positions.copy_(last + advance if advance else last)

    # -- the step ----------------------------------------------------------------------------------------------------

    def step(self, text_model) -> torch.Tensor:
        """One token for the whole batch, on the static buffers: no host sync, so it can be captured.

        Returns the final-norm hidden state [B, 1, hidden]."""
        h = self.embeds  # the residual stream
        cos, sin = self._step_rope(text_model.rotary_emb, h)  # also: the new key marked valid, the positions moved on
        if self.multi_device:  # the rotary module may sit on another device than the embeddings
            cos, sin = cos.to(self.device), sin.to(self.device)
        mlp_out = None  # each layer's MLP output is added to the stream inside the next norm (one launch, not two)
        step_inputs = {self.device: (cos, sin, self.key_valid, self.slot)}
        for i, layer in enumerate(text_model.layers[: text_model.config.num_hidden_layers]):
            if self.multi_device and h.device != self.layer_devices[i]:  # device_map: follow the layer
                dev = self.layer_devices[i]
                h = h.to(dev)
                mlp_out = None if mlp_out is None else mlp_out.to(dev)
                if dev not in step_inputs:
                    step_inputs[dev] = tuple(t.to(dev) for t in step_inputs[self.device])
            cos, sin, valid, slot = step_inputs[h.device]
            ln = layer.input_layernorm
            if mlp_out is None:
                x = rms_norm(h, ln.weight, ln.eps)
            else:
                x, h = rms_norm(mlp_out, ln.weight, ln.eps, residual=h)
            if layer.block_type == "linear_attention":
                y = self._deltanet_step(layer.linear_attn, x, i)
            else:
                y = self._attention_step(layer.self_attn, x, cos, sin, valid, slot, i)
            ln = layer.post_attention_layernorm
            x, h = rms_norm(y, ln.weight, ln.eps, residual=h)
            mlp_out = self._mlp_step(layer.mlp, x)
        self.slot.add_(1)
        norm = text_model.norm
        if h.device != norm.weight.device:
            h, mlp_out = h.to(norm.weight.device), mlp_out.to(norm.weight.device)
        return rms_norm(mlp_out, norm.weight, norm.eps, residual=h)[0]

    def _step_rope(self, rot, h):
        """The step's first launch: cos, sin [B, 1, R] in h's dtype for ``positions``, equal to stock's
        ``rot(h, positions)``; the key at ``slot`` marked valid in ``key_valid``; then every position moved on by one
        (every mRoPE section of a generated text token moves). With a plan (``_rope_plan``) all in one launch,
        ``mrope_step`` (the same float32 angle through the same cos / sin), where stock's module alone takes 14; any
        other module is called as it is, between the mask update and the increment."""
        if self.rope is None:
            self.key_valid.index_fill_(1, self.slot, True)
            cos, sin = rot(h, self.positions)
            self.positions.add_(1)
            return cos, sin
        sections, freqs, scaling = self.rope
        cos, sin = mrope_step(self.positions, sections, freqs, scaling, h.dtype, advance=True,
                              mark_valid=(self.key_valid, self.slot))
        return cos[:, None], sin[:, None]

    def _deltanet_step(self, m, x, i):
        B = self.batch
        w, _ = m._packed_weight()
        # [B, conv_dim + value_dim + 2 * HV]: q|k|v after the conv step + SiLU (its state updated in place, in the
        # GEMV's epilogue when the GEMV runs this shape), then z, b, a
        proj = small_linear(x.view(B, -1), w, conv=(self.conv[i], m.conv1d.weight.squeeze(1), m.conv1d.bias))
        mixed, z, b, a = torch.split(proj, [m.conv_dim, m.value_dim, m.num_v_heads, m.num_v_heads], dim=-1)
        q, k, v = torch.split(mixed, [m.key_dim, m.key_dim, m.value_dim], dim=-1)
        core = gated_delta_rule_step(
            q.view(B, m.num_k_heads, m.head_k_dim),
            k.view(B, m.num_k_heads, m.head_k_dim),
            v.view(B, m.num_v_heads, m.head_v_dim),
            a,
            b,
            m.A_log,
            m.dt_bias,
            self.recurrent[i],
            # its last writer is this layer's step one token back: it loads before the PDL wait
            prefetch_state=True,
        )  # [B, HV, Dv]; the state is updated in place
        core = gated_rms_norm(core, z, m.norm.weight, m.norm.variance_epsilon)  # [B, value_dim]
        return _step_linear(core, m.out_proj.weight, m.out_proj.bias).view(B, 1, -1)

    def _attention_step(self, m, x, cos, sin, valid, slot, i):
        B = self.batch
        H, KV, D = m.config.num_attention_heads, m.config.num_key_value_heads, m.head_dim
        w, bias = m._packed_weight()
        qkv = _step_linear(x.view(B, -1), w, bias).view(B, 1, -1)
        keys, values = self.keys[i], self.values[i]
        # k and v are written at `slot` of the caches by the prep kernel itself
        q, _, _, gate = attn_prep(qkv, cos, sin, m.q_norm.weight, m.k_norm.weight, m.q_norm.eps, H, KV, D,
                                  kv_cache=(keys, values, slot))
        # The H query heads of one token attend over the keys written so far (0..slot) that are not padding
        # (`valid`, [B, L]), then the output gate: two launches.
        o = decode_attention(q.reshape(B, H, D), keys, values, valid, slot, gate.view(B, H * D), m.scaling)
        return _step_linear(o, m.o_proj.weight, m.o_proj.bias).view(B, 1, -1)

    @staticmethod
    def _mlp_step(mlp, x):
        if mlp.config.hidden_act not in ("silu", "swish"):
            return mlp(x)
        B = x.shape[0]
        act = small_linear(x.view(B, -1), mlp._packed_weight()[0], gate_up=True)  # silu(gate) * up, [B, I]
        return _step_linear(act, mlp.down_proj.weight, mlp.down_proj.bias).view(B, 1, -1)

    # -- driving it --------------------------------------------------------------------------------------------------

    def decode(self, text_model, use_graph: bool, head: nn.Linear | None = None) -> torch.Tensor:
        """One step: with ``head`` (the LM head, see ``_graph_head``) the logits [B, vocab] in the model's dtype, the
        head run inside the step and its graph (no launch gap before it, and its first weight tiles load while the
        final norm runs); without, the final-norm hidden state [B, 1, hidden]."""
        if self.graph and self.graph_head is not head:  # captured with another head: capture again
            self.drop_graph()
        if not use_graph or self.graph is False:
            return self._step_out(text_model, head)
        if self.graph is not None:
            self.graph.replay()
            return self.graph_out
        if not self.warm:  # the first step runs eagerly: it warms (autotunes, JITs) every kernel before capture
            self.warm = True
            return self._step_out(text_model, head)
        return self._capture_and_replay(text_model, head)

    def _step_out(self, text_model, head: nn.Linear | None) -> torch.Tensor:
        hidden = self.step(text_model)
        if head is None:
            return hidden
        return small_linear(hidden.view(self.batch, -1), head.weight)

    def _capture_and_replay(self, text_model, head: nn.Linear | None) -> torch.Tensor:
        _pack_all(text_model)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                out = self._step_out(text_model, head)
        except Exception as err:  # noqa: BLE001 - any capture failure: decode eagerly, said once
            reset_rng_after_failed_capture()
            err = capture_error(err)
            self.graph = False
            _announce(
                f"graph-capture/{type(err).__name__}",
                f"Qwen3.5 fused kernels: CUDA graph capture of the decode step failed ({type(err).__name__}: {err}); "
                "decoding with the fused kernels without graphs.",
            )
            return self._step_out(text_model, head)
        roots = (text_model,) if head is None else (text_model, head)
        self.graph, self.graph_out, self.graph_weights, self.graph_head = graph, out, _WeightsSnapshot(*roots), head
        graph.replay()
        return out


class FusedDecodeCache(Cache):
    """The cache ``generate`` uses on the fused path: a transformers ``Cache`` over a :class:`_DecodeState`.

    Created by the model in ``generate`` (never by the user) for greedy and sampling generation. The prefill writes
    its conv, recurrent and K/V state straight into the preallocated buffers; each later token is one fused step,
    replayed from a CUDA graph when ``cuda_graphs`` is on. The buffers belong to the model and are reused by its
    next ``generate`` call with the same batch size and length bucket: a cache handed out by an earlier call then
    refuses to run (instead of reading another request's state).
    """

    def __init__(self, state: _DecodeState, layer_types, use_graph: bool, budget: int | None = None):
        super().__init__(layers=[])
        self._state = state
        self._layer_types = list(layer_types)
        self._use_graph = use_graph
        self._budget = budget  # tokens generate will hold at most (prompt + new), when generate said so
        self._seq_len = 0  # tokens cached (prompt + generated), as generate counts them
        self._pad = 0  # left padding a captured prefill added before the prompt: the next slot is _seq_len + _pad
        self._overrun = False
        state.owner = self

    def __repr__(self):
        st = self._state
        return (f"FusedDecodeCache(batch={st.batch}, max_len={st.max_len}, seq_len={self._seq_len}, "
                f"cuda_graphs={self._use_graph})")

    def _buffers(self) -> _DecodeState:
        if self._overrun:
            raise RuntimeError(
                "This FusedDecodeCache ran a few steps past the end of its generate() call (stop checks are batched "
                "to keep the host off the critical path), so it cannot be continued."
            )
        if self._state.owner is not self:
            raise RuntimeError(
                "This FusedDecodeCache was handed out by an earlier generate() call and its buffers now serve a later "
                "one on the same model; a fused decode cache cannot be reused after its generate() returns."
            )
        return self._state

    # -- what generate and the model ask of a Cache ------------------------------------------------------------------

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._seq_len

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self._state.max_len

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self._state.max_len

    @property
    def max_cache_len(self) -> int:
        return self._state.max_len

    @property
    def max_batch_size(self) -> int:
        return self._state.batch

    @property
    def batch_size(self) -> int:
        return self._state.batch

    @property
    def is_compileable(self) -> bool:
        return False  # the step is already captured; generate must not torch.compile the forward around it

    @property
    def is_croppable(self) -> bool:
        return False

    @property
    def is_sliding(self) -> list[bool]:
        return [False] * len(self._layer_types)

    @property
    def is_linear(self) -> list[bool]:
        return [t == "linear_attention" for t in self._layer_types]

    @property
    def is_initialized(self) -> bool:
        return True

    def __len__(self):
        return len(self._layer_types)

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        return self._seq_len > 0

    def get_conv_state(self, layer_idx: int, state_idx: int = 0):
        return self._buffers().conv.get(layer_idx) if self._seq_len else None

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0):
        return self._buffers().recurrent.get(layer_idx) if self._seq_len else None

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """Prefill: store the prompt's keys/values [B, KV, T, D] at [0, T) and hand them back unchanged."""
        st = self._buffers()
        T = key_states.shape[2]
        st.keys[layer_idx][:, :, :T].copy_(key_states)
        st.values[layer_idx][:, :, :T].copy_(value_states)
        return key_states, value_states

    def update_conv_state(self, conv_states, layer_idx: int, conv_kernel_size: int | None = None, **kwargs):
        """Prefill: keep the last K of the prompt's pre-conv inputs [B, conv_dim, T] (zero-padded on the left)."""
        buf = self._buffers().conv[layer_idx]
        K, T = buf.shape[-1], conv_states.shape[-1]
        if T >= K:
            buf.copy_(conv_states[..., T - K :])
        else:
            buf.zero_()
            buf[..., K - T :].copy_(conv_states)
        return conv_states

    def update_recurrent_state(self, recurrent_states, layer_idx: int, **kwargs):
        buf = self._buffers().recurrent[layer_idx]
        buf.copy_(recurrent_states)
        return buf

    def reset(self):
        self._seq_len = 0

    def _unsupported(self, what: str):
        raise NotImplementedError(
            f"The fused decode cache does not support {what}; generate() uses it only for greedy and sampling "
            "generation, and runs the stock cache for the rest."
        )

    def crop(self, tokens_to_remove: int):
        self._unsupported("crop() (assisted decoding)")

    def reorder_cache(self, beam_idx):
        self._unsupported("reorder_cache() (beam search)")

    def batch_repeat_interleave(self, repeats: int):
        self._unsupported("batch_repeat_interleave()")

    def batch_select_indices(self, indices):
        self._unsupported("batch_select_indices()")

    # -- the text model's forward on this cache ----------------------------------------------------------------------

    def run(self, text_model, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, **kwargs):
        st = self._buffers()
        x = inputs_embeds if inputs_embeds is not None else input_ids
        if x is None:
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        batch, seq_len = x.shape[:2]
        if batch != st.batch:
            raise ValueError(f"This fused decode cache holds batch size {st.batch}, got inputs of batch size {batch}.")
        if self._seq_len + self._pad + seq_len > st.max_len:
            raise ValueError(
                f"The fused decode cache holds {st.max_len} tokens; {self._seq_len + self._pad} are taken and "
                f"{seq_len} more were passed."
            )
        if self._seq_len == 0:
            out = self._prefill(text_model, input_ids, attention_mask, position_ids, inputs_embeds, kwargs)
        elif seq_len == 1:
            self._load_step_inputs(text_model, input_ids, inputs_embeds, position_ids)
            out = BaseModelOutputWithPast(last_hidden_state=st.decode(text_model, self._use_graph))
        else:
            raise NotImplementedError(
                f"The fused decode cache continues one token at a time; got {seq_len} new tokens after "
                f"{self._seq_len} cached ones. Start a new generate() call with the whole sequence instead."
            )
        self._seq_len += seq_len
        out[_OUTPUT_CACHE_FIELD] = self
        return out

    def _prefill(self, text_model, input_ids, attention_mask, position_ids, inputs_embeds, kwargs):
        st = self._state
        seq_len = (inputs_embeds if inputs_embeds is not None else input_ids).shape[1]
        if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2):
            raise ValueError(
                "The fused decode cache needs a 2D [batch, length] padding mask (or none) for the prompt, got "
                f"{type(attention_mask).__name__}"
                f"{tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else ''}."
            )
        for kw in _CACHE_KWS:
            kwargs.pop(kw, None)
        kwargs["use_cache"] = False
        out = self._graphed_prefill(text_model, input_ids, attention_mask, position_ids, inputs_embeds, kwargs)
        if out is not None:
            return out
        layers = text_model.layers
        # The stock forward builds the prompt's masks as for an empty cache (which this is) and the fused layers
        # write their state here through the side channel read by FusedDecoderLayer.
        try:
            for layer in layers:
                layer._prefill_cache = self
            out = Qwen3_5TextModel.forward(
                text_model,
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                inputs_embeds=inputs_embeds,
                **kwargs,
            )
        finally:
            for layer in layers:
                layer._prefill_cache = None
        st.key_valid.zero_()
        if attention_mask is None:
            st.key_valid[:, :seq_len] = True
        else:
            st.key_valid[:, :seq_len].copy_(attention_mask.bool())
        st.slot.fill_(seq_len)
        st.load_positions(position_ids, 0, seq_len, advance=1)  # the first generated token: one past the prompt
        return out

    def _graphed_prefill(self, text_model, input_ids, attention_mask, position_ids, inputs_embeds, kwargs):
        """The prompt through the state's captured prefill for its length bucket (left-padded; see
        :class:`_PrefillGraph`), or None: the bucket's first prompt, or a prompt the graph does not cover (said once).
        """
        st = self._state
        if not resolve_switch(text_model.config, "cuda_graphs") or st.device.type not in _FUSED_DEVICE_TYPES:
            return None
        reason = None
        if inputs_embeds is not None or input_ids is None:
            reason = "the prompt came as inputs_embeds"
        elif position_ids is not None and position_ids.dim() != 2:
            reason = "the prompt has 3D mRoPE position ids"
        elif st.multi_device:
            reason = "the model is split over several devices"
        elif input_ids.shape[1] > _FORWARD_GRAPH_MAX_LEN:
            reason = f"the prompt is longer than {_FORWARD_GRAPH_MAX_LEN} tokens"
        elif self._budget is None or _forward_len_bucket(input_ids.shape[1]) + self._budget - input_ids.shape[1] > st.max_len:
            reason = "the padded prompt and the new tokens do not fit the cache bucket"
        else:
            extra = [k for k, v in kwargs.items() if k != "use_cache" and v not in _GRAPH_NEUTRAL_KWARGS.get(k, (None,))]
            reason = f"generate passed {extra[0]}" if extra else None
        if reason is not None:
            _announce(f"prefill-graph/{reason}", f"Qwen3.5 fused kernels: the prompt runs without a CUDA graph because {reason}.")
            return None
        seq_len = input_ids.shape[1]
        length = _forward_len_bucket(seq_len)
        graph = st.prefill_graphs.get(length)
        if graph is None:
            st.prefill_calls[length] = st.prefill_calls.get(length, 0) + 1
            if st.prefill_calls[length] < _FORWARD_GRAPH_AFTER:
                return None
            graph = st.prefill_graphs[length] = _PrefillGraph(st.batch, st.device, length)
        elif graph.graph and not graph.weights.unchanged():
            graph.drop()  # a weight moved since the capture: capture again
        pad = graph.load(input_ids, attention_mask, position_ids)
        hidden = graph.run(text_model, self, _graph_pool(text_model))
        if hidden is None:
            return None  # capture failed (announced): this prompt runs eagerly
        st.key_valid.zero_()
        st.key_valid[:, :length].copy_(graph.mask)
        st.slot.fill_(length)
        st.load_positions(position_ids, 0, seq_len, advance=1)
        self._pad = pad
        return BaseModelOutputWithPast(last_hidden_state=hidden[:, pad:].clone())

    def next_logits(self, model, tokens: torch.Tensor) -> torch.Tensor:
        """The logits [B, vocab] of the step for ``tokens`` [B] (the tokens just chosen) in the model's dtype, as
        stock's ``outputs.logits[:, -1]``; the LM head runs inside the step when ``_graph_head`` allows. Used by the
        fused generate loop (``_fused_sample``). With CUDA graphs the result is the graph's output buffer, which the
        next step overwrites."""
        text_model = model._text_model()
        head = _graph_head(model, self._state)
        out = self.next_token(text_model, tokens, head)
        return out if head is not None else _step_logits(model, out)[:, -1]

    def next_token(self, text_model, tokens: torch.Tensor, head: nn.Linear | None = None) -> torch.Tensor:
        """Run the step for ``tokens`` [B] (the tokens just chosen) at the positions that follow the previous step's;
        returns the final-norm hidden state [B, 1, hidden], or with ``head`` the logits [B, vocab]."""
        st = self._buffers()
        if self._seq_len + self._pad >= st.max_len:
            raise ValueError(f"The fused decode cache holds {st.max_len} tokens and is full.")
        weight = text_model.embed_tokens.weight
        torch.index_select(weight, 0, tokens.to(weight.device), out=st.embeds.view(st.batch, -1))
        out = st.decode(text_model, self._use_graph, head)
        self._seq_len += 1
        return out

    def _load_step_inputs(self, text_model, input_ids, inputs_embeds, position_ids) -> None:
        """Copy this token's embedding and mRoPE positions into the step's static inputs (one launch each)."""
        st = self._state
        if inputs_embeds is not None:
            st.embeds.copy_(inputs_embeds)
        else:
            torch.index_select(text_model.embed_tokens.weight, 0, input_ids.reshape(-1), out=st.embeds.view(st.batch, -1))
        st.load_positions(position_ids, self._seq_len, 1, advance=0)


# The host's all-rows-stopped check (EOS) reads the per-step flags in batches of this many steps, and reads a batch
# only once the next one is queued: it then waits on a copy the GPU made a batch earlier, while the GPU still has a
# batch of steps queued, so the check never leaves the GPU idle. (Reading each batch as soon as it was queued made the
# GPU idle while the host queued the next step: 0.004-0.022 ms per token at batch 1, H200, PERFORMANCE.md.) A
# finished batch runs at most 2 * _STOP_CHECK_EVERY - 1 extra steps, which are cut from the output, so the result is
# stock's.
_STOP_CHECK_EVERY = 8


class _StopFlags:
    """Which rows of ``_fused_sample`` are still running after each step, read by the host a batch of steps at a time.

    ``add`` takes step ``steps``'s ``unfinished`` [B] bool (a new tensor each step: it is kept, not copied); every
    ``every`` steps the batch is reduced to one "any row running" flag per step in two launches, copied to the host
    without blocking it (pinned memory and an event on CUDA), and the batch before it is read (``lag=1``), or this
    batch at once (``lag=0``: a streamer waits for every token anyway). ``add(final=True)`` reads everything still
    pending. Returns the first step after which every row had stopped (the step stock stops after), or None."""

    def __init__(self, every: int, lag: int):
        self.every, self.lag = every, lag
        self.rows, self.queue = [], []  # queue: (host flags, event or None, steps of its first flag - 1)
        self.first = 0  # steps before self.rows[0]

    def add(self, unfinished: torch.Tensor, steps: int, final: bool = False) -> int | None:
        self.rows.append(unfinished)
        if not final and steps % self.every:
            return None
        flags = torch.stack(self.rows).any(dim=1)  # [steps of the batch]: some row still running
        if flags.is_cuda:
            host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
            host.copy_(flags, non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(flags.device))
        else:
            host, event = flags, None
        self.queue.append((host, event, self.first))
        self.rows, self.first = [], steps
        while self.queue and (final or len(self.queue) > self.lag):
            host, event, first = self.queue.pop(0)
            if event is not None:
                event.synchronize()
            running = host.tolist()
            if not all(running):
                return first + running.index(False) + 1
        return None


_GENERATE_OUTPUT_CACHE_FIELD = "cache" if "cache" in GenerateDecoderOnlyOutput.__dataclass_fields__ else "past_key_values"


def _step_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """The LM head on a decode step's final-norm hidden state [B, 1, hidden] -> logits [B, 1, vocab]: through
    ``small_linear`` (cuBLAS or our GEMV, timed per shape; the GEMV read the 4B head at 281 us against cuBLAS's 306
    in a graph on the H200) when the head is a plain bias-free ``nn.Linear`` in the hidden state's dtype and device;
    any other head (a PEFT wrapper, a bias, a dispatched module) runs as it is."""
    head = model.lm_head
    weight = getattr(head, "weight", None)
    if type(head) is nn.Linear and head.bias is None and weight.dtype == hidden.dtype and weight.device == hidden.device:
        B = hidden.shape[0]
        return small_linear(hidden.view(B, -1), weight).view(B, 1, -1)
    return head(hidden)


def _graph_head(model, state: _DecodeState) -> nn.Linear | None:
    """The LM head when the decode step can run it itself: a plain bias-free ``nn.Linear`` in the step's dtype, on the
    device the step ends on (the final norm's). Anything else (a PEFT wrapper, a bias, a dispatched module) runs after
    the step, as it is (``_step_logits``)."""
    head = model.lm_head
    weight = getattr(head, "weight", None)
    if type(head) is not nn.Linear or head.bias is not None or weight.dtype != state.dtype:
        return None
    return head if weight.device == model._text_model().norm.weight.device else None


def _stop_rows(criteria: list, input_ids: torch.Tensor, scores) -> torch.Tensor | None:
    """Stock ``StoppingCriteriaList.__call__`` (the OR of every criterion) without stock's ``MaxLengthCriteria``,
    whose verdict the loop takes on the host (``at_max``): its all-rows tensor and the OR with it were two launches a
    step and a third for the list's starting ``False``. The criterion still runs where it would warn (a length past
    the model's ``max_position_embeddings``). None when no other criterion is given."""
    done = None
    for c in criteria:
        if type(c) is MaxLengthCriteria:
            limit = c.max_position_embeddings
            if limit is not None and input_ids.shape[1] > limit:
                c(input_ids, scores)  # its one-time warning
            continue
        verdict = c(input_ids, scores)
        done = verdict if done is None else done | verdict
    return done


def _fused_sample(model, cache, input_ids, logits_processor, stopping_criteria, generation_config, streamer, model_kwargs):
    """Greedy / multinomial decoding on a :class:`FusedDecodeCache`: stock ``_sample``'s token rule, with the
    model call reduced to one replayed step plus the LM head, and the all-rows-stopped check batched.

    Same outputs as stock ``_sample`` (sequences, scores, logits, streamer calls): logits processors, stopping
    criteria (stock's max-length one decided on the host) and the padding of finished rows run as there, every step.
    """
    pad = generation_config._pad_token_tensor
    if pad is not None:
        pad = pad.to(input_ids.device)
    ret = generation_config.return_dict_in_generate
    scores = () if ret and generation_config.output_scores else None
    raw_logits = () if ret and generation_config.output_logits else None
    keep_logits = scores is not None or raw_logits is not None
    # Stock turns each step's logits into float32 for the processors, the sampling and the outputs. A greedy step
    # that nothing else reads takes its argmax in the model's dtype: the same token (the conversion is exact and
    # keeps the order, NaN included), one launch less.
    to_float = keep_logits or generation_config.do_sample or len(logits_processor) > 0
    has_eos = any(hasattr(c, "eos_token_id") for c in stopping_criteria)
    max_length = getattr(stopping_criteria, "max_length", None)
    check_every = 1 if streamer is not None else _STOP_CHECK_EVERY
    unfinished = torch.ones(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    outputs = model._prefill(input_ids, generation_config, model_kwargs)
    logits = outputs.logits[:, -1]
    logits = logits.to(copy=True, dtype=torch.float32 if to_float else logits.dtype, device=input_ids.device)
    del outputs
    prompt_len = input_ids.shape[1]
    stops = _StopFlags(check_every, lag=0 if streamer is not None else 1)
    stop_at = None
    while True:
        next_scores = logits_processor(input_ids, logits)
        if scores is not None:
            scores += (next_scores,)
        if raw_logits is not None:
            raw_logits += (logits,)
        if generation_config.do_sample:
            next_tokens = torch.multinomial(F.softmax(next_scores, dim=-1), num_samples=1).squeeze(1)
        else:
            next_tokens = torch.argmax(next_scores, dim=-1)
        if has_eos:  # stock's `next * unfinished + pad * (1 - unfinished)`, in one launch instead of four
            next_tokens = torch.where(unfinished, next_tokens, pad)
        input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
        done = _stop_rows(stopping_criteria, input_ids, scores)
        if done is not None:
            unfinished = unfinished & ~done.bool()
        if streamer is not None:
            streamer.put(next_tokens.cpu())
        at_max = max_length is not None and input_ids.shape[1] >= max_length
        stop_at = stops.add(unfinished, input_ids.shape[1] - prompt_len, final=at_max)
        if stop_at is not None or at_max:
            break
        logits = cache.next_logits(model, next_tokens).to(device=input_ids.device)
        if keep_logits:  # kept past the next step, which overwrites the graph's output buffer: a copy
            logits = logits.to(dtype=torch.float32, copy=True)
        elif to_float:
            logits = logits.float()

    if stop_at is not None and stop_at < input_ids.shape[1] - prompt_len:
        extra = input_ids.shape[1] - prompt_len - stop_at
        input_ids = input_ids[:, :-extra]
        scores = scores[:-extra] if scores is not None else None
        raw_logits = raw_logits[:-extra] if raw_logits is not None else None
        cache._overrun = True
    if streamer is not None:
        streamer.end()
    if not ret:
        return input_ids
    return GenerateDecoderOnlyOutput(
        sequences=input_ids, scores=scores, logits=raw_logits, attentions=None, hidden_states=None,
        **{_GENERATE_OUTPUT_CACHE_FIELD: cache},
    )


_TEXT_FORWARD_ARGS = tuple(inspect.signature(Qwen3_5TextModel.forward).parameters)[1:]


class _FusedTextForward:
    """The text backbone's ``forward``: calls that carry a :class:`FusedDecodeCache` run through it (fused prefill
    into its buffers, then one fused step per token); every other call is the stock ``forward``."""

    def forward(self, *args, **kwargs):
        if args:  # positional arguments, in the stock order
            kwargs.update(zip(_TEXT_FORWARD_ARGS, args))
        cache = next((kwargs[kw] for kw in _CACHE_KWS if kwargs.get(kw) is not None), None)
        if isinstance(cache, FusedDecodeCache):
            return cache.run(self, **kwargs)
        path, reason = _forward_graph_plan(self, kwargs)
        if path is not None:
            out = _graphed_forward(self, kwargs, path)
            if out is not None:
                return out
        elif reason:
            _announce(f"forward-graph/{reason}", f"Qwen3.5 fused kernels: forward without CUDA graphs because {reason}.")
        return super().forward(**kwargs)


class _FusedTextBackbone(_FusedTextForward, Qwen3_5TextModel):
    """The class a stock ``Qwen3_5TextModel`` inside a fused causal LM is switched to (no new parameters)."""


def _fuse_text_model(text_model: Qwen3_5TextModel, config) -> None:
    """Switch the text backbone's decoder modules to the fused classes (in place) and pack their projections."""
    if type(text_model) is Qwen3_5TextModel:
        text_model.__class__ = _FusedTextBackbone
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
    _release_decode_states(text_model)


def _release_decode_states(text_model) -> None:
    """Free the decode buffers and CUDA graphs, and the forward graphs (after a move, a dtype change or a switch of
    the fused path)."""
    _release_forward_graphs(text_model)
    states = text_model.__dict__.get("_decode_states")
    if states:
        for state in states.values():
            state.drop_graph()
            state.owner = None
        states.clear()
    text_model._decode_states = {}


def _decode_state(text_model, batch: int, max_len: int) -> _DecodeState:
    """The model's decode buffers for this bucket, created (and the least recently used beyond the limit freed)."""
    states = text_model._decode_states
    weight = text_model.embed_tokens.weight
    key = (batch, max_len, weight.dtype, weight.device)
    state = states.pop(key, None)
    if state is None:
        while len(states) >= _MAX_DECODE_STATES:
            old = states.pop(next(iter(states)))
            old.drop_graph()
            old.owner = None
        state = _DecodeState(text_model, batch, max_len)
    states[key] = state  # most recently used last
    if state.graph and not state.graph_weights.unchanged():
        state.drop_graph()  # a parameter was replaced since the capture: capture again
    return state


# --------------------------------------------------------------------------------------------------------------------
# Forward CUDA graphs: the no-cache forward (scoring, classification, eval harnesses) captured per length bucket
# --------------------------------------------------------------------------------------------------------------------

# Longest input (tokens) whose forward is captured; longer forwards run the fused kernels eagerly.
_FORWARD_GRAPH_MAX_LEN = 8192
# Captured forwards kept per model (least recently used freed first). They share one memory pool, so the pool is as
# large as the largest bucket's activations, not their sum.
_MAX_FORWARD_GRAPHS = 16
# Of those, the ones that return a cache (each keeps a bucket-sized conv / recurrent / K-V state: ~115 MB at the 4B
# shape and 2,048 tokens).
_MAX_CACHE_FORWARD_GRAPHS = 4
# A bucket is captured on its second call: a length seen once runs eagerly, at its own length.
_FORWARD_GRAPH_AFTER = 2


def _forward_len_bucket(seq_len: int) -> int:
    """Inputs are right-padded to this length. Steps of 1/8 of the enclosing power of two (at least 64), so the padding
    costs at most ~12% of the compute beyond 512 tokens, and a few dozen buckets cover 1..8192.

    Right padding is exact for the real positions: attention is causal and the conv / delta rule only look back."""
    if seq_len <= 64:
        return 64
    step = max(64, (1 << (seq_len - 1).bit_length()) // 8)
    return -(-seq_len // step) * step


class _ForwardGraph:
    """One captured no-cache forward of the text backbone, for one (batch, length bucket, input kind).

    ``inputs``: ``[B, L]`` token ids or ``[B, L, hidden]`` embeddings at a fixed address; the caller's ``[B, T]`` input
    is copied into its head and the tail keeps whatever the last call left there (causality makes it irrelevant).
    ``out``: the captured ``[B, L, hidden]`` final hidden states; each call returns a copy of ``out[:, :T]``.
    Off CUDA (the CPU emulation in the tests) the same padded forward runs eagerly, with no capture.
    """

    def __init__(self, text_model, batch: int, length: int, embeds: bool):
        weight = text_model.embed_tokens.weight
        with torch.inference_mode(False):  # written in place under no_grad and inference_mode alike
            if embeds:
                self.inputs = torch.zeros(batch, length, weight.shape[1], dtype=weight.dtype, device=weight.device)
            else:
                self.inputs = torch.zeros(batch, length, dtype=torch.long, device=weight.device)
        self.embeds = embeds
        self.graph = None
        self.out = None
        self.weights = None
        self.masks = None

    def _build_masks(self, text_model) -> dict:
        """The stock forward's mask mapping for the padded bucket, built once, eagerly. Built inside the capture,
        transformers cannot read the position ids to rule out packed sequences (reading them is a host sync), so it
        materialises a full [L, L] mask and SDPA loses its causal fast path (measured 3x slower attention)."""
        batch, length = self.inputs.shape[:2]
        weight = text_model.embed_tokens.weight
        shaped = torch.empty(batch, length, 1, dtype=weight.dtype, device=weight.device)  # shape / dtype / device only
        kw = {
            "config": text_model.config,
            "inputs_embeds": shaped.expand(batch, length, weight.shape[1]),
            "attention_mask": None,
            _MASK_CACHE_KW: None,
            "position_ids": torch.arange(length, device=weight.device).expand(batch, length),
        }
        return {
            "full_attention": stock.create_causal_mask(**kw),
            "linear_attention": stock.create_recurrent_attention_mask(**kw),
        }

    def _forward(self, text_model) -> torch.Tensor:
        kw = {"inputs_embeds" if self.embeds else "input_ids": self.inputs}
        return Qwen3_5TextModel.forward(
            text_model, **kw, attention_mask=self.masks, use_cache=False
        ).last_hidden_state

    def run(self, text_model, x: torch.Tensor, pool) -> torch.Tensor:
        seq_len = x.shape[1]
        self.inputs[:, :seq_len].copy_(x)
        if self.masks is None:
            self.masks = self._build_masks(text_model)
        if self.inputs.device.type != "cuda":
            return self._forward(text_model)[:, :seq_len].clone()
        if self.graph is None:
            self._capture(text_model, pool)
        if self.graph is False:
            return None  # capture failed (announced): the caller runs the eager forward at the input's own length
        self.graph.replay()
        return self.out[:, :seq_len].clone()

    def _capture(self, text_model, pool) -> None:
        captured = _capture_graph(text_model, lambda: self._forward(text_model), pool, "forward")
        if captured is None:
            self.graph = False
            return
        self.graph, self.out = captured
        self.weights = _WeightsSnapshot(text_model)

    def drop(self) -> None:
        self.graph = self.out = self.masks = None


class _PrefillGraph:
    """The prompt forward of the fused ``generate`` path, captured per prompt-length bucket of one decode state.

    The prompt is LEFT-padded to the bucket with masked positions (attention mask 0; ``ids``, ``mask``, ``positions``
    [B, L] at fixed addresses). The DeltaNet layers zero the hidden states of masked positions, and with no conv
    bias a zero input gives k = v = 0, so the conv window and the recurrent state after the prompt are the real
    tokens' exactly (zeros stay zeros, the decay of a zero state is zero); attention never reads the pads' K/V (the
    decode step's key mask starts from ``mask``). The real tokens keep their positions (``position_ids`` as given,
    or stock's default 0..T-1). Through the side channel the eager prefill uses, the replay writes the state's conv,
    recurrent and K/V buffers in place, so the first decode step continues at slot L.

    Off CUDA (the CPU emulation in the tests) the same padded forward runs eagerly, with no capture.
    """

    def __init__(self, batch: int, device: torch.device, length: int):
        with torch.inference_mode(False):  # written in place under no_grad and inference_mode alike
            shape = (batch, length)
            self.ids = torch.zeros(shape, dtype=torch.long, device=device)
            self.mask = torch.zeros(shape, dtype=torch.long, device=device)
            self.positions = torch.zeros(shape, dtype=torch.long, device=device)
            self.arange = torch.arange(length, device=device)
        self.length = length
        self.graph = None
        self.out = None
        self.weights = None

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
        try:
            for layer in text_model.layers:
                layer._prefill_cache = cache
            return Qwen3_5TextModel.forward(
                text_model, input_ids=self.ids, attention_mask=self.mask, position_ids=self.positions, use_cache=False
            ).last_hidden_state
        finally:
            for layer in text_model.layers:
                layer._prefill_cache = None

    def run(self, text_model, cache, pool) -> torch.Tensor | None:
        if self.ids.device.type != "cuda":
            return self._forward(text_model, cache)
        if self.graph is None:
            captured = _capture_graph(text_model, lambda: self._forward(text_model, cache), pool, "prompt (prefill)")
            self.graph, self.out = captured if captured else (False, None)
            if captured:
                self.weights = _WeightsSnapshot(text_model)
        if self.graph is False:
            return None
        self.graph.replay()
        return self.out

    def drop(self) -> None:
        self.graph = self.out = None


def _capture_graph(text_model, forward, pool, what: str):
    """Pack every projection group, run ``forward()`` once eagerly (every autotuned / JIT kernel is compiled before
    the capture), capture it into a new graph on ``pool``, and return ``(graph, output)``; None after a failed capture
    (said once; the caller runs eagerly)."""
    _pack_all(text_model)
    forward()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, pool=pool):
            out = forward()
    except Exception as err:  # noqa: BLE001 - any capture failure: eager, said once
        reset_rng_after_failed_capture()
        err = capture_error(err)
        _announce(
            f"graph-capture/{what}/{type(err).__name__}",
            f"Qwen3.5 fused kernels: CUDA graph capture of the {what} failed ({type(err).__name__}: {err}); running "
            "it with the fused kernels without graphs.",
        )
        return None
    return graph, out


_MASK_CACHE_KW = "cache" if "cache" in inspect.signature(stock.create_causal_mask).parameters else "past_key_values"
# Arguments a graphed forward accepts, with the values it accepts them at (anything else runs eagerly, said once).
_GRAPH_NEUTRAL_KWARGS = {"return_dict": (None, True), "output_attentions": (None, False),
                         "output_hidden_states": (None, False), "cache_position": (None,)}


def _forward_graph_plan(text_model, kwargs: dict) -> tuple[str | None, str]:
    """One decision point for the graphed forward: ``(path, reason)``.

    - ``("right", "")``: no cache, no padding, no position ids: right-padded to the bucket (:class:`_ForwardGraph`,
      SDPA's causal fast path).
    - ``("masked", "")`` / ``("masked+cache", "")``: a padded batch, explicit 2D position ids, or a call that returns
      a cache: left-padded with masked positions (:class:`_PrefillGraph`, exact for the state), the cache built
      from the bucket's state buffers.
    - ``(None, "")``: eager, silently (graphs off, or the fused path itself not taken, which the fused modules
      announce); ``(None, reason)``: eager, said once.
    """
    if not (text_model._fused_enabled and text_model._fused_unavailable is None):
        return None, ""
    if not resolve_switch(text_model.config, "cuda_graphs") or text_model.training or torch.is_grad_enabled():
        return None, ""
    ids, embeds = kwargs.get("input_ids"), kwargs.get("inputs_embeds")
    x = ids if ids is not None else embeds
    if x is None or (ids is None) == (embeds is None) or x.device.type not in _FUSED_DEVICE_TYPES:
        return None, ""
    if any(kwargs.get(kw) is not None for kw in _CACHE_KWS):
        return None, "the call continues from a cache"
    if x.shape[1] > _FORWARD_GRAPH_MAX_LEN:
        return None, f"the input has {x.shape[1]} tokens, more than the {_FORWARD_GRAPH_MAX_LEN} captured"
    device = text_model.embed_tokens.weight.device
    if text_model.norm.weight.device != device or any(
        layer.input_layernorm.weight.device != device for layer in text_model.layers
    ):
        return None, "the model is split over several devices (device_map); one graph cannot span devices"
    for name, value in kwargs.items():
        if name in ("input_ids", "inputs_embeds", "attention_mask", "position_ids", "use_cache", *_CACHE_KWS):
            continue
        if value not in _GRAPH_NEUTRAL_KWARGS.get(name, (None,)):
            return None, f"the argument {name}={value!r}"
    use_cache = kwargs.get("use_cache")
    if use_cache is None:
        use_cache = getattr(text_model.config, "use_cache", False)
    mask, positions = kwargs.get("attention_mask"), kwargs.get("position_ids")
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dim() != 2):
        return None, "the attention mask is not a 2D padding mask"
    if positions is not None and positions.dim() != 2:
        return None, "the position ids are not 2D (mRoPE position ids run eagerly)"
    padded = mask is not None and not bool(mask.all())  # one host read per call with a mask
    if not use_cache and not padded and positions is None:
        return "right", ""
    if embeds is not None:
        return None, "inputs_embeds come with a cache, padding or position ids"
    return ("masked+cache" if use_cache else "masked"), ""


def _graphed_forward(text_model, kwargs: dict, path: str) -> BaseModelOutputWithPast | None:
    """The forward from the model's captured graph for this bucket and path (captured on the bucket's second call);
    None when it runs eagerly instead (the bucket's first call, or a failed capture)."""
    ids, embeds = kwargs.get("input_ids"), kwargs.get("inputs_embeds")
    x = ids if ids is not None else embeds
    batch, seq_len = x.shape[:2]
    weight = text_model.embed_tokens.weight
    key = (path if path != "right" else ("right", embeds is not None), batch, _forward_len_bucket(seq_len),
           weight.dtype, weight.device)
    graphs = text_model.__dict__.setdefault("_forward_graphs", {})
    seen = text_model.__dict__.setdefault("_forward_graph_calls", {})
    entry = graphs.pop(key, None)
    if entry is None:
        seen[key] = seen.pop(key, 0) + 1
        while len(seen) > 4 * _MAX_FORWARD_GRAPHS:
            seen.pop(next(iter(seen)))
        if seen[key] < _FORWARD_GRAPH_AFTER:
            return None
        while len(graphs) >= _MAX_FORWARD_GRAPHS:
            graphs.pop(next(iter(graphs))).drop()
        if path == "masked+cache":  # each holds a bucket of state (K/V, conv, recurrent): fewer of them
            cached = [k for k in graphs if k[0] == "masked+cache"]
            if len(cached) >= _MAX_CACHE_FORWARD_GRAPHS:
                graphs.pop(cached[0]).drop()
        if path == "right":
            entry = _ForwardGraph(text_model, batch, key[2], embeds is not None)
        else:
            entry = _MaskedForwardGraph(text_model, batch, key[2], path == "masked+cache")
    elif entry.graph and not entry.weights.unchanged():
        entry.drop()  # a parameter was replaced since the capture: capture again
    graphs[key] = entry  # most recently used last
    pool = _graph_pool(text_model)
    if path == "right":
        hidden, cache = entry.run(text_model, x, pool), None
    else:
        out = entry.run(text_model, ids, kwargs.get("attention_mask"), kwargs.get("position_ids"), pool)
        hidden, cache = out if out is not None else (None, None)
    if hidden is None:
        return None
    return BaseModelOutputWithPast(last_hidden_state=hidden, **{_OUTPUT_CACHE_FIELD: cache})


class _MaskedForwardGraph:
    """A forward with padding, position ids or a returned cache, captured per (batch, length bucket): the input
    left-padded with masked positions through a :class:`_PrefillGraph`. With a cache, the graph also writes the
    conv / recurrent / K-V state into a bucket-sized :class:`_DecodeState` (the same side channel as generate's
    prefill), from which each call builds the stock ``DynamicCache`` stock's forward would return: the real tokens'
    K/V (the tail), the conv window and the recurrent state, copied out."""

    def __init__(self, text_model, batch: int, length: int, with_cache: bool):
        weight = text_model.embed_tokens.weight
        self.prefill = _PrefillGraph(batch, weight.device, length)
        self.state = _DecodeState(text_model, batch, length) if with_cache else None
        self.weights = None

    @property
    def graph(self):
        return self.prefill.graph

    def run(self, text_model, input_ids, attention_mask, position_ids, pool):
        pad = self.prefill.load(input_ids, attention_mask, position_ids)
        writer = None
        if self.state is not None:
            layer_types = text_model.config.layer_types[: text_model.config.num_hidden_layers]
            writer = FusedDecodeCache(self.state, layer_types, use_graph=False)
        hidden = self.prefill.run(text_model, writer, pool)
        if hidden is None:
            return None
        self.weights = self.prefill.weights
        hidden = hidden[:, pad:].clone()
        return hidden, (None if self.state is None else _stock_cache_from_state(text_model, self.state, pad))

    def drop(self) -> None:
        self.prefill.drop()


def _stock_cache_from_state(text_model, state: _DecodeState, pad: int):
    """The stock ``DynamicCache`` a stock forward over the real tokens returns, from a left-padded bucket's state:
    through the same update calls the fused layers make on a stock cache, with copies (the buffers are reused)."""
    from transformers.cache_utils import DynamicCache

    cache = DynamicCache(config=text_model.config)
    extra = {"kwargs": {}} if _ATTENTION_CACHE_KW == "cache" else {}
    for i, layer in enumerate(text_model.layers[: text_model.config.num_hidden_layers]):
        if layer.block_type == "linear_attention":
            m = layer.linear_attn
            cache.update_conv_state(state.conv[i].clone(), i, conv_kernel_size=m.conv_kernel_size)
            cache.update_recurrent_state(state.recurrent[i].clone(), i)
        else:
            cache.update(state.keys[i][:, :, pad:].clone(), state.values[i][:, :, pad:].clone(), i, **extra)
    return cache


def _release_forward_graphs(text_model) -> None:
    for entry in (text_model.__dict__.get("_forward_graphs") or {}).values():
        entry.drop()
    text_model._forward_graphs = {}
    text_model._forward_graph_calls = {}
    text_model.__dict__.pop("_forward_graph_pool", None)


def _tensor_parallel_requested(kwargs: dict) -> bool:
    if kwargs.get("tp_plan") is not None or kwargs.get("tp_size") is not None or kwargs.get("device_mesh") is not None:
        return True
    distributed = kwargs.get("distributed_config")
    return distributed is not None and (
        getattr(distributed, "tp_plan", None) is not None or getattr(distributed, "tp_size", None) is not None
    )


def _check_model_type(config) -> None:
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"The fused Qwen3.5 classes load Qwen3.5 checkpoints (model_type {' or '.join(SUPPORTED_MODEL_TYPES)}), "
            f"got model_type={model_type!r}."
        )


class _FusedPreTrainedMixin:
    """Shared by the four public classes: load-time switches, re-packing after load, ``describe()``."""

    # accelerate keeps modules whole by class *name*; the decoder layers are `FusedDecoderLayer`s here, so without
    # that name `device_map="auto"` could cut a layer between GPUs, even between the views of one packed matrix.
    _no_split_modules = ["Qwen3_5DecoderLayer", "FusedDecoderLayer", "Qwen3_5VisionBlock"]

    def _text_model(self) -> Qwen3_5TextModel:
        raise NotImplementedError

    def _text_config(self):
        return getattr(self.config, "text_config", self.config)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        overrides = {name: check_switch(name, kwargs.pop(name)) for name in ("fused_kernels", "cuda_graphs") if name in kwargs}
        config = kwargs.get("config")
        config_dict = None
        if config is None and pretrained_model_name_or_path is not None:
            config_dict, _ = cls.config_class.get_config_dict(
                pretrained_model_name_or_path,
                **{k: kwargs[k] for k in ("revision", "cache_dir", "local_files_only", "token", "subfolder") if k in kwargs},
            )
            _check_model_type(type("C", (), {"model_type": config_dict.get("model_type")}))
        elif config is not None and not isinstance(config, (str, bytes)):
            _check_model_type(config)
        if _tensor_parallel_requested(kwargs):
            fused = overrides.get("fused_kernels")
            if fused is None:
                fused = env_switch("fused_kernels")
            if fused is None:
                source = config if config is not None and not isinstance(config, (str, bytes)) else None
                fused = bool(getattr(source, "fused_kernels", None) if source is not None
                             else (config_dict or {}).get("fused_kernels", False))
            if fused:
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

    # -- generate: the fused decode cache ---------------------------------------------------------------------------

    def _fused_decode_blocker(self, generation_config, model_kwargs, generation_mode) -> str | None:
        """None when this ``generate`` call can decode on the fused path, else the reason it cannot."""
        text_model = self._text_model()
        if text_model._fused_unavailable is not None:
            return text_model._fused_unavailable
        device = text_model.embed_tokens.weight.device
        if device.type not in _FUSED_DEVICE_TYPES:
            return f"the model is on {device.type}"
        if self.training:
            return "the model is in training mode"
        if generation_mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
            return f"the generation mode is {getattr(generation_mode, 'value', generation_mode)} (fused: greedy and sampling)"
        if model_kwargs.get(_GENERATE_CACHE_KW) is not None:
            return "a cache object was passed to generate()"
        if generation_config.cache_implementation is not None:
            return f"cache_implementation={generation_config.cache_implementation!r} was requested"
        if getattr(generation_config, "prefill_chunk_size", None):
            return "prefill_chunk_size was set"
        if generation_config.output_attentions or generation_config.output_hidden_states:
            return "attention weights or hidden states were requested from generate()"
        for layer in text_model.layers:
            if layer.block_type == "linear_attention" and layer.linear_attn.activation not in ("silu", "swish"):
                return f"the DeltaNet activation is {layer.linear_attn.activation!r} (fused: silu)"
        return None

    def _prepare_cache_for_generation(
        self, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length, *args, **kwargs
    ):
        text_model = self._text_model()
        if text_model._fused_enabled and generation_config.use_cache is not False:
            reason = self._fused_decode_blocker(generation_config, model_kwargs, generation_mode)
            if reason is None:
                batch = batch_size * max(1, generation_config.num_return_sequences or 1)
                state = _decode_state(text_model, batch, _decode_len_bucket(max_cache_length + 1))
                use_graph = resolve_switch(self._text_config(), "cuda_graphs") and state.device.type == "cuda"
                if use_graph and state.multi_device:
                    use_graph = False
                    _announce(
                        "decode-graph/multi-device",
                        "Qwen3.5 fused kernels: the model is split over several devices (device_map); the fused decode "
                        "step runs without CUDA graphs (one graph cannot span devices).",
                    )
                layer_types = text_model.config.layer_types[: text_model.config.num_hidden_layers]
                model_kwargs[_GENERATE_CACHE_KW] = FusedDecodeCache(state, layer_types, use_graph, max_cache_length + 1)
                return None
            _announce(
                f"decode/{reason}",
                f"Qwen3.5 fused kernels: generate() decodes with the stock transformers cache and code because {reason}.",
            )
        return super()._prepare_cache_for_generation(
            generation_config, model_kwargs, generation_mode, batch_size, max_cache_length, *args, **kwargs
        )

    def _sample(self, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
                streamer=None, **model_kwargs):
        cache = model_kwargs.get(_GENERATE_CACHE_KW)
        if isinstance(cache, FusedDecodeCache) and not synced_gpus and cache.get_seq_length() == 0:
            return _fused_sample(
                self, cache, input_ids, logits_processor, stopping_criteria, generation_config, streamer, model_kwargs
            )
        return super()._sample(
            input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus, streamer, **model_kwargs
        )

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        try:
            text_model = self._text_model()
        except AttributeError:  # still inside __init__
            return out
        _release_decode_states(text_model)  # buffers and graphs point at the old storage
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
        elif device.type not in _FUSED_DEVICE_TYPES:
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
        graphs = resolve_switch(self._text_config(), "cuda_graphs")
        states = text_model.__dict__.get("_decode_states") or {}
        decode = {
            "path": "fused" if reason is None else "stock",
            "ops": (
                "one step per token on preallocated conv / recurrent / K-V buffers: the conv step in the DeltaNet "
                "input linear's epilogue + gated_delta_rule_step (states in place), attn_prep writing K/V into the "
                "cache + decode_attention (split "
                "keys, merged with the sigmoid gate), fused norms; each linear (gate|up with SwiGLU in its epilogue) "
                "by cuBLAS or our GEMV, whichever was timed faster for its shape, the LM head too"
                if reason is None else "stock transformers decode"
            ),
            "cuda_graphs": bool(graphs and reason is None and device.type == "cuda"),
            # our kernels launched with programmatic dependent launch (sm_90+; fused_ops.pdl_enabled)
            "pdl": bool(reason is None and pdl_enabled(device)),
            # with PDL, a GEMV of a weight this large lets the next kernel launch only after its weight loop
            "pdl_gemv_late_signal_min_weight_elems": (
                gemv_late_signal_min_elems() if reason is None and pdl_enabled(device) else None
            ),
            "falls_back": "beam search, assisted / contrastive decoding, a cache passed in, cache_implementation, "
            "output_attentions / output_hidden_states (a model split over devices decodes fused, without graphs)",
            "buckets": [
                {"batch": st.batch, "max_len": st.max_len, "graph_captured": bool(st.graph), "cache_bytes": st.nbytes(),
                 "prompt_buckets_captured": sorted(n for n, g in st.prefill_graphs.items() if g.graph)}
                for st in states.values()
            ],
            # the per-shape choice of small_linear, timed at a first decode step in this process
            "linears": {
                f"{m}x{n}x{k}{' gate|up+SwiGLU' if gate_up else ''} {str(dtype).removeprefix('torch.')} {dev}":
                "cublas" if choice == "cublas" else f"gemv {choice!r}"
                for (m, n, k, gate_up, dtype, dev), choice in small_linear_choices().items()
            },
            "reason": reason,
        }
        if reason is None:
            kinds["linear_attention"]["prefill_rule_kernel"] = prefill_rule_kernel(text_model.embed_tokens.weight.dtype)
            kinds["linear_attention"]["falls_back"] = "decode steps outside generate()'s fused cache (stock cache)"
        forward_graphs = {
            "used": bool(graphs and reason is None and device.type == "cuda"),
            "covers": f"forwards under no_grad / inference_mode up to {_FORWARD_GRAPH_MAX_LEN} tokens, captured on a "
            "bucket's second call: right-padded without cache, padding or position ids; left-padded with masked "
            "positions otherwise (padded batches, 2D position ids, a returned cache)",
            "buckets": [
                {"path": "right-padded" if isinstance(key[0], tuple) else key[0], "batch": key[1], "length": key[2],
                 "inputs_embeds": isinstance(key[0], tuple) and key[0][1], "graph_captured": bool(entry.graph)}
                for key, entry in (text_model.__dict__.get("_forward_graphs") or {}).items()
            ],
        }
        return {
            "fused_kernels": enabled,
            "cuda_graphs": graphs,
            "device": str(device),
            "layers": kinds,
            "decode": decode,
            "forward_graphs": forward_graphs,
            "vision_tower": "stock" if hasattr(self._composite_model(), "visual") else None,
            "announced_fallbacks": sorted(_announced),
        }

    def _composite_model(self):
        return self


class Qwen3_5FusedTextModel(_FusedPreTrainedMixin, _FusedTextForward, Qwen3_5TextModel):
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
