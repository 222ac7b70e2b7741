# Copyright 2026 The Qwen3.5 fused-kernels authors. Licensed under the Apache License, Version 2.0.
"""The fused decode step: one decode bucket's preallocated state, the step over it, its CUDA graph, and the cache
object ``generate`` carries.

A :class:`DecodeState` holds, for batch B and cache length L, fixed-address conv, recurrent and K/V buffers plus the
step's inputs; :meth:`DecodeState.step` runs the whole decoder for one token on them with no host sync, so it is
captured once (on its second call; the first, eager, warms every kernel) and replayed for every later token.
:class:`FusedDecodeCache` is the transformers ``Cache`` that generate holds: it owns nothing but its counters and a
reference to the state; :class:`fused_runner.FusedRunner` runs the model on it.
"""

from typing import NamedTuple

import torch
from torch import nn
from transformers.cache_utils import DynamicCache

from .fused_compat import STOCK_ROTARY_FORWARDS, Cache, fill_attention_layer, fill_linear_layer
from .fused_graphs import WeightsSnapshot, capture_graph
from .fused_plan import FusedPlan

# Cache lengths are rounded up to a power of two (at least this), so generate calls of nearby lengths share buffers
# and their captured graph. Attention reads only the keys written so far (``decode_attention`` splits over them).
MIN_DECODE_LEN = 256
# generate_batch's rows (``track_rows``) hold contiguous windows row_start..slot. True: the attention reads each as a
# range (``decode_attention(contiguous=True)``: no valid mark loaded, values masked by the key index); False: through
# the valid marks, as generate's rows. On: it took 3.4% off generate_batch's decode steps (4B, 256 rows, H100, one
# process: 12.64 against 13.08 s over one workload; DESIGN).
ROW_WINDOWS = True
# The speculative verify pass over T tokens at batch 1 runs each attention layer's prep and attention once for the T
# tokens (True: ``attn_prep`` writes their keys at slot .. slot + T - 1, and ``decode_attention`` takes them as T
# rows over the one cache row, each through its own causal marks) instead of once per token (False: 2T launches a
# layer, 64 at 4B for T = 4 over its 8 attention layers, in a pass of ~4 ms). Off: timed on an H100 against the
# per-token pass (4B, one process), it gained 4-8% with every draft rejected and lost 3-9% at acceptance 0.8 (k = 3:
# 2.280 against 2.101 ms a token; docs/DESIGN.md). Tested both ways, on CPU and on the GPU.
VERIFY_ATTENTION_AT_ONCE = False


def decode_len_bucket(needed: int) -> int:
    return max(MIN_DECODE_LEN, 1 << max(0, needed - 1).bit_length())


def step_linear(ops, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for the decode step's [B, in] rows: ``small_linear`` (cuBLAS or our GEMV, whichever
    this card runs faster for the shape), or ``F.linear`` with a bias (none in Qwen3.5)."""
    if bias is not None:
        return torch.nn.functional.linear(x, weight, bias)
    return ops.small_linear(x, weight)


# Rotary types whose module computes cos / sin from a fixed ``inv_freq`` (no per-call update, unlike the dynamic and
# longrope types): for these the decode step computes stock's values itself, in fewer launches (``step_rope``).
_STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def run_layers(text_model, ops, h: torch.Tensor, mix, mlp) -> torch.Tensor:
    """The decoder layers over the residual stream ``h`` [N, ..., hidden] on one device, each layer's MLP output added
    to the stream inside the next norm (one launch, not two): ``mix(layer, x, i)`` runs layer ``i``'s token mixer
    (DeltaNet or attention) over its normed input, ``mlp(layer, x)`` its MLP. Returns the final-norm hidden state,
    ``h``'s shape."""
    mlp_out = None
    for i, layer in enumerate(text_model.layers[: text_model.config.num_hidden_layers]):
        ln = layer.input_layernorm
        if mlp_out is None:
            x = ops.rms_norm(h, ln.weight, ln.eps)
        else:
            x, h = ops.rms_norm(mlp_out, ln.weight, ln.eps, residual=h)
        y = mix(layer, x, i)
        ln = layer.post_attention_layernorm
        x, h = ops.rms_norm(y, ln.weight, ln.eps, residual=h)
        mlp_out = mlp(layer, x)
    norm = text_model.norm
    return ops.rms_norm(mlp_out, norm.weight, norm.eps, residual=h)[0]


def rope_plan(rot, device) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    """For stock's interleaved-mRoPE text rotary module ``rot`` with a static type: ``(sections [R], freqs [R],
    attention_scaling)`` for ``mrope_step``, R = 2 * len(inv_freq) the rotary dims of cos / sin: dimension d reads
    position row ``sections[d]`` (0 / 1 / 2 = t / h / w, stock's ``recomposition_frequencies``) and float32 frequency
    ``freqs[d] = inv_freq[d mod R/2]`` (stock's ``cat((f, f))``; a static type never changes ``inv_freq``). None for
    any other module (a subclass's forward, a dynamic type) and for a module on another device than ``device`` (a
    model split over devices, where accelerate's hook moves the module's inputs to it), which the step then calls as
    it is."""
    here, there = torch.device(device), rot.inv_freq.device
    if (
        type(rot).forward not in STOCK_ROTARY_FORWARDS
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


class DecodeState:
    """The fixed-address tensors one decode bucket keeps across ``generate`` calls, and its CUDA graph.

    Buffers, for batch B and cache length L (created once, updated in place):

    - linear-attention layer i: ``conv[i]`` [B, conv_dim, K] (model dtype, the last K pre-conv inputs, as stock's
      conv state) and ``recurrent[i]`` [B, HV, Dk, Dv] float32 (as fla's chunked kernel returns it);
    - full-attention layer i: ``keys[i]``, ``values[i]`` [B, KV, L, D] (model dtype);
    - step inputs: ``embeds`` [B, 1, hidden], ``positions`` [3, B, 1] (mRoPE t/h/w), ``slot`` [1] int64 (the cache
      index the next token is written to; the step advances it), ``key_valid`` [B, L] bool (padding mask of the
      keys written so far);
    - with :meth:`track_rows` (``generate_batch``'s rows): ``row_start`` [B] int64, each row's first valid key (its
      attention reads from there, not from 0; L for a free row), and ``live`` [1] int64, the rows 0..live-1 that
      hold requests (the DeltaNet rule step skips the others' states). None otherwise: every row reads from 0.

    The step (``step``) runs the whole decoder for one token on these buffers; with CUDA graphs it is captured
    once, on its second call (the first, eager, warms every kernel), and replayed for every later token.
    """

    def __init__(self, text_model, plan: FusedPlan, batch: int, max_len: int):
        self.plan = plan
        self.ops = plan.ops
        # normal tensors even when generate runs under torch.inference_mode(): later calls may run without it, and
        # inference tensors cannot be updated in place outside it
        with torch.inference_mode(False):
            self._allocate(text_model, batch, max_len)
        self._no_graphs()

    def _no_graphs(self) -> None:
        self.graph = None  # torch.cuda.CUDAGraph once captured; False after a failed capture (eager from then on)
        self.graph_out = None
        self.graph_weights = None
        self.graph_head = None  # the LM head the graph runs (None: the graph ends at the final norm)
        self.warm = False
        self.owner = None
        self.prefill_graphs = {}  # prompt-length bucket -> _PrefillGraph
        self.prefill_calls = {}  # prompt-length bucket -> prefills seen (captured on the second)
        # (verify length T, buffer set 0 / 1) -> _VerifyGraph once captured, False after a failed capture; two sets so
        # that a pass's outputs (its saved states) outlive the next pass (pipelined speculative rounds)
        self.verify_graphs = {}
        self.verify_calls = {}  # the same keys -> verify passes seen (captured on the second)
        self.mtp_drafter = None  # fused_mtp_decode.MTPDecodeState: the MTP head's cache and draft graphs, once used

    @classmethod
    def view_rows(cls, parent: "DecodeState", rows: int) -> "DecodeState":
        """A state over the first ``rows`` rows of ``parent``'s buffers, at their addresses, with its own step graph:
        conv [rows, conv_dim, K], recurrent [rows, HV, Dk, Dv], keys / values [rows, KV, L, D], ``embeds`` [rows, 1,
        hidden], ``key_valid`` [rows, L] (first-dim slices, contiguous) and ``positions`` [3, rows, 1] (a strided view;
        ``mrope_step`` takes its strides). ``slot`` is ``parent``'s own tensor: every view writes at one shared cache
        index. ``generate_batch`` steps the view whose row count is the smallest bucket that holds its requests
        (``fused_batch_state``)."""
        if not 0 < rows <= parent.batch:
            raise ValueError(f"A view of a decode state holds 1..{parent.batch} rows, got {rows}.")
        view = cls.__new__(cls)
        view.plan, view.ops = parent.plan, parent.ops
        view.batch, view.max_len, view.dtype, view.device = rows, parent.max_len, parent.dtype, parent.device
        view.conv = {i: t[:rows] for i, t in parent.conv.items()}
        view.recurrent = {i: t[:rows] for i, t in parent.recurrent.items()}
        view.keys = {i: t[:rows] for i, t in parent.keys.items()}
        view.values = {i: t[:rows] for i, t in parent.values.items()}
        view.layer_devices, view.multi_device, view.rope = parent.layer_devices, parent.multi_device, parent.rope
        view.embeds = parent.embeds[:rows]
        view.positions = parent.positions[:, :rows]
        view.slot = parent.slot
        view.key_valid = parent.key_valid[:rows]
        view.row_start = None if parent.row_start is None else parent.row_start[:rows]
        view.live = parent.live
        view._no_graphs()
        return view

    def track_rows(self) -> None:
        """Keep ``row_start`` and ``live`` (see the class docstring): every row free until the caller loads one.
        Before any graph is captured (the step reads them from then on). One device only."""
        if self.multi_device:
            raise ValueError("row tracking runs on a state on one device")
        with torch.inference_mode(False):
            self.row_start = torch.full((self.batch,), self.max_len, dtype=torch.long, device=self.device)
            self.live = torch.zeros(1, dtype=torch.long, device=self.device)

    def _allocate(self, text_model, batch: int, max_len: int) -> None:
        weight = text_model.embed_tokens.weight
        dtype, device = weight.dtype, weight.device
        config = text_model.config
        self.batch, self.max_len, self.dtype, self.device = batch, max_len, dtype, device
        self.conv, self.recurrent, self.keys, self.values = {}, {}, {}, {}
        # A model dispatched over several GPUs (device_map) keeps each layer's buffers on that layer's device.
        layers = text_model.layers[: config.num_hidden_layers]
        self.layer_devices = [layer.input_layernorm.weight.device for layer in layers]
        self.multi_device = any(d != device for d in self.layer_devices) or text_model.norm.weight.device != device
        for i, layer in enumerate(layers):
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
        self.row_start, self.live = None, None  # `track_rows`
        self.rope = rope_plan(text_model.rotary_emb, device)

    def nbytes(self) -> int:
        tensors = [*self.conv.values(), *self.recurrent.values(), *self.keys.values(), *self.values.values()]
        return sum(t.nbytes for t in tensors)

    def drop(self) -> None:
        """Free the graphs and detach the cache that holds this state (the LRU evicted it)."""
        self.drop_graph()
        self.owner = None

    def drop_graph(self) -> None:
        self.graph, self.graph_out, self.graph_weights, self.graph_head, self.warm = None, None, None, None, False
        self.prefill_graphs, self.prefill_calls = {}, {}
        self.verify_graphs, self.verify_calls = {}, {}
        self.mtp_drafter = None

    def stale_graphs(self) -> bool:
        """True when a parameter or submodule that a captured graph of this state (the step, a verify pass) reads was
        replaced since its capture (checked once per ``generate`` call, not per step)."""
        snapshots = [self.graph_weights] if self.graph else []
        snapshots += [entry.weights for entry in self.verify_graphs.values() if entry]
        return any(not snapshot.unchanged() for snapshot in snapshots)

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
        cos, sin = self.step_rope(text_model.rotary_emb, h)  # also: the new key marked valid, the positions moved on
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
                x = self.ops.rms_norm(h, ln.weight, ln.eps)
            else:
                x, h = self.ops.rms_norm(mlp_out, ln.weight, ln.eps, residual=h)
            if layer.block_type == "linear_attention":
                y = self._deltanet_step(layer.linear_attn, x, i)
            else:
                y = self._attention_step(layer.self_attn, x, cos, sin, valid, slot, i)
            ln = layer.post_attention_layernorm
            x, h = self.ops.rms_norm(y, ln.weight, ln.eps, residual=h)
            mlp_out = self._mlp_step(layer.mlp, x)
        self.slot.add_(1)
        norm = text_model.norm
        if h.device != norm.weight.device:
            h, mlp_out = h.to(norm.weight.device), mlp_out.to(norm.weight.device)
        return self.ops.rms_norm(mlp_out, norm.weight, norm.eps, residual=h)[0]

    def step_rope(self, rot, h):
        """The step's first launch: cos, sin [B, 1, R] in h's dtype for ``positions``, equal to stock's
        ``rot(h, positions)``; the key at ``slot`` marked valid in ``key_valid``; then every position moved on by one
        (every mRoPE section of a generated text token moves). With a plan (``rope_plan``) all in one launch,
        ``mrope_step`` (the same float32 angle through the same cos / sin), where stock's module alone takes 14; any
        other module is called as it is, between the mask update and the increment."""
        if self.rope is None:
            self.key_valid.index_fill_(1, self.slot, True)
            cos, sin = rot(h, self.positions)
            self.positions.add_(1)
            return cos, sin
        sections, freqs, scaling = self.rope
        cos, sin = self.ops.mrope_step(self.positions, sections, freqs, scaling, h.dtype, advance=True,
                              mark_valid=(self.key_valid, self.slot))
        return cos[:, None], sin[:, None]

    def _deltanet_step(self, m, x, i):
        B = self.batch
        w, _ = m.packed_weight()
        # [B, conv_dim + value_dim + 2 * HV]: q|k|v after the conv step + SiLU (its state updated in place, in the
        # GEMV's epilogue when the GEMV runs this shape), then z, b, a
        proj = self.ops.small_linear(x.view(B, -1), w, conv=(self.conv[i], m.conv1d.weight.squeeze(1), m.conv1d.bias))
        mixed, z, b, a = torch.split(proj, [m.conv_dim, m.value_dim, m.num_v_heads, m.num_v_heads], dim=-1)
        # its last writer is this layer's step one token back: the state loads before the PDL wait
        core = self.deltanet_core(m, mixed, z, b, a, i, prefetch_state=True)
        return step_linear(self.ops, core, m.out_proj.weight, m.out_proj.bias).view(B, 1, -1)

    def deltanet_core(self, m, mixed, z, b, a, i, prefetch_state: bool = False):
        """DeltaNet layer ``i``'s rule step for one token a row, after the conv step: ``mixed`` [B, conv_dim] (q|k|v
        after conv + SiLU), ``z`` [B, value_dim], ``b`` / ``a`` [B, HV] (column slices of the projection are fine)
        -> the gated-normed output [B, value_dim], the recurrent state updated in place."""
        B = self.batch
        q, k, v = torch.split(mixed, [m.key_dim, m.key_dim, m.value_dim], dim=-1)
        core = self.ops.gated_delta_rule_step(
            q.view(B, m.num_k_heads, m.head_k_dim),
            k.view(B, m.num_k_heads, m.head_k_dim),
            v.view(B, m.num_v_heads, m.head_v_dim),
            a,
            b,
            m.A_log,
            m.dt_bias,
            self.recurrent[i],
            prefetch_state=prefetch_state,
            live=self.live,
        )  # [B, HV, Dv]; the state is updated in place
        return self.ops.gated_rms_norm(core, z, m.norm.weight, m.norm.variance_epsilon)  # [B, value_dim]

    def _attention_step(self, m, x, cos, sin, valid, slot, i):
        B = self.batch
        w, bias = m.packed_weight()
        qkv = step_linear(self.ops, x.view(B, -1), w, bias).view(B, 1, -1)
        o = self.attention_core(m, qkv, cos, sin, valid, slot, i)
        return step_linear(self.ops, o, m.o_proj.weight, m.o_proj.bias).view(B, 1, -1)

    def attention_core(self, m, qkv, cos, sin, valid, slot, i):
        """Attention layer ``i`` for one token a row after its GEMM: ``qkv`` [B, 1, (2 H + 2 KV) D] contiguous ->
        the gated output [B, H * D]; the new key / value written at ``slot`` of the layer's cache."""
        B = self.batch
        H, KV, D = m.config.num_attention_heads, m.config.num_key_value_heads, m.head_dim
        keys, values = self.keys[i], self.values[i]
        # k and v are written at `slot` of the caches by the prep kernel itself
        q, _, _, gate = self.ops.attn_prep(qkv, cos, sin, m.q_norm.weight, m.k_norm.weight, m.q_norm.eps, H, KV, D,
                                  kv_cache=(keys, values, slot))
        # The H query heads of one token attend over the keys written so far (0..slot) that are not padding
        # (`valid`, [B, L]), then the output gate: two launches. generate_batch's rows (``row_start``) hold
        # contiguous windows row_start..slot: the key index masks them, and `valid` is not read.
        return self.ops.decode_attention(q.reshape(B, H, D), keys, values, valid, slot, gate.view(B, H * D),
                                         m.scaling, start=self.row_start,
                                         contiguous=ROW_WINDOWS and self.row_start is not None)

    def _mlp_step(self, mlp, x):
        if hasattr(mlp, "decode_step"):  # the MoE models' sparse block (``fused_moe``)
            return mlp.decode_step(self.ops, x)
        if self.plan.kind_reasons["mlp"] is not None:
            return mlp(x)
        B = x.shape[0]
        act = self.ops.small_linear(x.view(B, -1), mlp.packed_weight()[0], gate_up=True)  # silu(gate) * up, [B, I]
        return step_linear(self.ops, act, mlp.down_proj.weight, mlp.down_proj.bias).view(B, 1, -1)

    # -- several tokens at once (the speculative verify step) ----------------------------------------------------------

    def verify(self, text_model, tokens: torch.Tensor) -> "Verified":
        """The decoder over ``tokens`` [B, T] (the last chosen token, then T - 1 drafted ones) in one pass, as T
        consecutive ``step`` calls would run it, keeping what :meth:`rollback` needs to end after any prefix.

        Every linear and norm runs once over the B * T rows (the weights read once, which is what a verify step
        saves over T steps); the per-token parts run token by token on the live buffers with the step's own ops:
        the rotary cos / sin and key mark, and ``attn_prep`` writing K/V at slot + t and ``decode_attention`` over the
        keys up to it; the conv step and the gated delta rule run the T tokens in one launch each
        (``causal_conv1d_steps``, ``gated_delta_rule_steps``: the conv and recurrent state after each token written
        aside, when T > 1). Afterwards the buffers hold the state after all T tokens (slot and positions moved on by
        T). Returns the final-norm hidden states [B, T, hidden] and the saved states."""
        B, T = tokens.shape
        N = B * T  # rows, b-major: row b * T + t is token t of sequence b
        ops = self.ops
        h = torch.index_select(text_model.embed_tokens.weight, 0, tokens.reshape(-1)).view(N, 1, -1)
        slot0, positions0 = self.slot.clone(), self.positions.clone()
        slots, ropes = [], []
        for t in range(T):
            slot = slot0 + t
            positions = positions0 + t
            if self.rope is None:
                self.key_valid.index_fill_(1, slot, True)
                cos, sin = text_model.rotary_emb(h[:B], positions)
            else:
                sections, freqs, scaling = self.rope
                cos, sin = ops.mrope_step(positions, sections, freqs, scaling, h.dtype,
                                          mark_valid=(self.key_valid, slot))
                cos, sin = cos[:, None], sin[:, None]
            slots.append(slot)
            ropes.append((cos, sin))
        conv_saved, recurrent_saved = {}, {}
        at_once = None
        if VERIFY_ATTENTION_AT_ONCE and B == 1 and T > 1 and not self.multi_device:
            # the T tokens as T rows over the one cache row: token t's marks are the row's up to slot + t
            L = self.key_valid.shape[1]
            ends = slot0 + torch.arange(T, device=self.key_valid.device)  # [T]
            marks = self.key_valid[:1] & (torch.arange(L, device=ends.device)[None, :] <= ends[:, None])  # [T, L]
            cos = torch.cat([c.reshape(1, 1, -1) for c, _ in ropes], dim=1)  # [1, T, R]
            sin = torch.cat([s_.reshape(1, 1, -1) for _, s_ in ropes], dim=1)
            at_once = (marks, cos, sin)

        def mix(layer, x, i):
            if layer.block_type == "linear_attention":
                return self._deltanet_verify(layer.linear_attn, x, i, B, T, conv_saved, recurrent_saved)
            if at_once is not None:
                return self._attention_verify_at_once(layer.self_attn, x, i, T, slots, at_once)
            return self._attention_verify(layer.self_attn, x, i, B, T, slots, ropes)

        hidden = run_layers(text_model, ops, h, mix, lambda layer, x: self._mlp_step(layer.mlp, x)).view(B, T, -1)
        self.slot.copy_(slot0 + T)
        self.positions.copy_(positions0 + T)
        return Verified(hidden, slot0, positions0, conv_saved, recurrent_saved)

    def _deltanet_verify(self, m, x, i, B, T, conv_saved, recurrent_saved):
        w, _ = m.packed_weight()
        proj = self.ops.small_linear(x.view(B * T, -1), w).view(B, T, -1)  # q|k|v before the conv, z, b, a
        mixed, z, b, a = torch.split(proj, [m.conv_dim, m.value_dim, m.num_v_heads, m.num_v_heads], dim=-1)
        conv_w = m.conv1d.weight.squeeze(1)
        # the states after tokens 0 .. T - 1, stacked: a rollback indexes them (on the host or the device), the last
        # one too, so that a round can be undone after the next one has run (pipelined speculative rounds)
        save = T > 1
        if save:
            conv_saved[i] = self.conv[i].new_empty((T, *self.conv[i].shape))
            recurrent_saved[i] = self.recurrent[i].new_empty((T, *self.recurrent[i].shape))
        # the T tokens' conv + SiLU, then their delta rule, one launch each, the state after each token kept aside
        qkv = self.ops.causal_conv1d_steps(mixed, self.conv[i], conv_w, m.conv1d.bias, saved=conv_saved.get(i))
        q, k, v = torch.split(qkv, [m.key_dim, m.key_dim, m.value_dim], dim=-1)  # [B, T, *]
        core = self.ops.gated_delta_rule_steps(
            q.unflatten(-1, (m.num_k_heads, m.head_k_dim)), k.unflatten(-1, (m.num_k_heads, m.head_k_dim)),
            v.unflatten(-1, (m.num_v_heads, m.head_v_dim)), a, b, m.A_log, m.dt_bias, self.recurrent[i],
            saved=recurrent_saved.get(i),
        ).view(B * T, m.num_v_heads, m.head_v_dim)
        core = self.ops.gated_rms_norm(core, z.reshape(B * T, -1), m.norm.weight, m.norm.variance_epsilon)
        return step_linear(self.ops, core, m.out_proj.weight, m.out_proj.bias).view(B * T, 1, -1)

    def _attention_verify(self, m, x, i, B, T, slots, ropes):
        H, KV, D = m.config.num_attention_heads, m.config.num_key_value_heads, m.head_dim
        w, bias = m.packed_weight()
        qkv = step_linear(self.ops, x.view(B * T, -1), w, bias).view(B, T, -1)
        keys, values = self.keys[i], self.values[i]
        outs = []
        for t in range(T):  # token t writes its K/V at slot + t and attends over the keys up to it
            cos, sin = ropes[t]
            q, _, _, gate = self.ops.attn_prep(qkv[:, t : t + 1].contiguous(), cos, sin, m.q_norm.weight,
                                               m.k_norm.weight, m.q_norm.eps, H, KV, D,
                                               kv_cache=(keys, values, slots[t]))
            outs.append(self.ops.decode_attention(q.reshape(B, H, D), keys, values, self.key_valid, slots[t],
                                                  gate.view(B, H * D), m.scaling))
        o = torch.stack(outs, dim=1).view(B * T, H * D)
        return step_linear(self.ops, o, m.o_proj.weight, m.o_proj.bias).view(B * T, 1, -1)

    def _attention_verify_at_once(self, m, x, i, T, slots, at_once):
        """:meth:`_attention_verify` at batch 1 in two launches for the T tokens (``VERIFY_ATTENTION_AT_ONCE``):
        ``attn_prep`` writes their K/V at slot .. slot + T - 1, then ``decode_attention`` runs them as T rows over
        the cache's one row (its keys and values seen T times through a batch stride of 0), row t through ``marks``
        [T, L] (the row's valid keys up to slot + t) and up to the last token's slot."""
        H, KV, D = m.config.num_attention_heads, m.config.num_key_value_heads, m.head_dim
        marks, cos, sin = at_once
        w, bias = m.packed_weight()
        qkv = step_linear(self.ops, x.view(T, -1), w, bias).view(1, T, -1)
        keys, values = self.keys[i], self.values[i]
        q, _, _, gate = self.ops.attn_prep(qkv, cos, sin, m.q_norm.weight, m.k_norm.weight, m.q_norm.eps, H, KV, D,
                                           kv_cache=(keys, values, slots[0]))
        o = self.ops.decode_attention(q[0].transpose(0, 1), keys.expand(T, -1, -1, -1), values.expand(T, -1, -1, -1),
                                      marks, slots[-1], gate.view(T, H * D), m.scaling)  # [T, H * D]
        return step_linear(self.ops, o, m.o_proj.weight, m.o_proj.bias).view(T, 1, -1)

    def rollback(self, verified: "Verified", keep: int, first_slot: int, overrun: bool = False) -> None:
        """End the state after the first ``keep`` + 1 tokens of ``verified``'s step (all of them: nothing to do,
        unless ``overrun``): the saved conv / recurrent states copied back, slot and positions set after that token,
        the later keys marked invalid (``first_slot``: the host's count of the slot the step started at). ``overrun``:
        a later step has run since (a pipelined round), so the state is restored even after all T tokens and every
        key past them is marked invalid too."""
        T = verified.hidden.shape[1]
        if keep >= T - 1 and not overrun:
            return
        for i, saved in verified.conv.items():
            self.conv[i].copy_(saved[keep])
            self.recurrent[i].copy_(verified.recurrent[i][keep])
        self.slot.copy_(verified.slot + keep + 1)
        self.positions.copy_(verified.positions + keep + 1)
        self.key_valid[:, first_slot + keep + 1 : None if overrun else first_slot + T] = False

    def verify_graphed(self, text_model, tokens: torch.Tensor, run, head: nn.Module, use_graph: bool,
                       buffers: int = 0):
        """``run(tokens)`` (a :meth:`verify` pass and the LM head over its rows: ``(logits, Verified)``), from one CUDA
        graph per (verify length T, ``buffers`` set 0 or 1): its first pass runs eagerly (it warms every kernel), the
        second is captured, every later one copies ``tokens`` [B, T] into the graph's input and replays. What it
        returns lives in the graph's memory until the next replay of that key (the speculative loop reads it and rolls
        back before it replays the same set again; pipelined rounds alternate the sets). Eager off CUDA, without
        ``use_graph``, and after a failed capture (announced once)."""
        T = tokens.shape[1]
        key = (T, buffers)
        entry = self.verify_graphs.get(key)
        if entry is None and use_graph and self.device.type == "cuda":
            self.verify_calls[key] = calls = self.verify_calls.get(key, 0) + 1
            if calls >= 2:
                static = tokens.clone()
                captured = capture_graph(text_model, lambda: run(static), None,
                                         f"speculative verify step ({T} tokens)", warm=False)
                self.verify_graphs[key] = entry = False if captured is None else _VerifyGraph(
                    captured[0], static, captured[1], WeightsSnapshot(text_model, head))
                if entry:
                    entry.graph.replay()
                    return entry.out
        if not entry:
            return run(tokens)
        entry.tokens.copy_(tokens)
        entry.graph.replay()
        return entry.out

    # -- driving it --------------------------------------------------------------------------------------------------

    def decode(self, text_model, use_graph: bool, head: nn.Linear | None = None) -> torch.Tensor:
        """One step: with ``head`` (the LM head, see ``fused_generate.graph_head``) the logits [B, vocab] in the
        model's dtype, the head run inside the step and its graph (no launch gap before it, and its first weight
        tiles load while the final norm runs); without, the final-norm hidden state [B, 1, hidden]."""
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
        return self.ops.small_linear(hidden.view(self.batch, -1), head.weight)

    def _capture_and_replay(self, text_model, head: nn.Linear | None) -> torch.Tensor:
        captured = capture_graph(text_model, lambda: self._step_out(text_model, head), None, "decode step", warm=False)
        if captured is None:  # announced: decode eagerly from now on
            self.graph = False
            return self._step_out(text_model, head)
        roots = (text_model,) if head is None else (text_model, head)
        self.graph, self.graph_out = captured
        self.graph_weights, self.graph_head = WeightsSnapshot(*roots), head
        self.graph.replay()
        return self.graph_out


class _VerifyGraph(NamedTuple):
    """One verify length's captured pass: the graph, its input tokens [B, T] (copied in before each replay), its
    output ``(logits, Verified)`` and the weights it read (``WeightsSnapshot``)."""

    graph: "torch.cuda.CUDAGraph"
    tokens: torch.Tensor
    out: tuple
    weights: WeightsSnapshot


class Verified(NamedTuple):
    """What :meth:`DecodeState.verify` returns: the final-norm hidden states [B, T, hidden], the slot [1] and
    positions [3, B, 1] the step started at, and per linear-attention layer the conv / recurrent states after each of
    its T tokens, stacked ([T, B, ...]; none when T = 1)."""

    hidden: torch.Tensor
    slot: torch.Tensor
    positions: torch.Tensor
    conv: dict
    recurrent: dict


def stock_cache_from_state(text_model, state: "DecodeState", pad: int, length: int | None = None) -> DynamicCache:
    """The stock ``DynamicCache`` a stock forward over the real tokens returns, from a bucket's state whose real tokens
    sit at slots [pad, pad + length) (``length`` None: to the end of the bucket): through the same update calls the
    fused layers make on a stock cache, with copies (the buffers are reused)."""
    end = state.max_len if length is None else pad + length
    cache = DynamicCache(config=text_model.config)
    for i, layer in enumerate(text_model.layers[: text_model.config.num_hidden_layers]):
        if layer.block_type == "linear_attention":
            fill_linear_layer(cache, i, state.conv[i].clone(), state.recurrent[i].clone(),
                              layer.linear_attn.conv_kernel_size, end - pad)
        else:
            fill_attention_layer(cache, i, state.keys[i][:, :, pad:end].clone(), state.values[i][:, :, pad:end].clone())
    return cache


class FusedDecodeCache(Cache):
    """The cache ``generate`` uses on the fused path: a transformers ``Cache`` over a :class:`DecodeState`.

    Created by the model in ``generate`` (never by the user) for greedy and sampling generation. The prefill writes
    its conv, recurrent and K/V state straight into the preallocated buffers; each later token is one fused step,
    replayed from a CUDA graph when ``cuda_graphs`` is on. The buffers belong to the model and are reused by its
    next ``generate`` call with the same batch size and length bucket: a cache handed out by an earlier call then
    refuses to run (instead of reading another request's state).
    """

    def __init__(self, state: DecodeState, layer_types, use_graph: bool, budget: int | None = None):
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

    def _buffers(self) -> DecodeState:
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

    # transformers 5.25's cache protocol, asked by stock's DeltaNet forward (a layer kind that runs stock code while
    # the prefill writes into this cache): this cache records no per-token history and counts its tokens itself.
    def is_recording_past(self, layer_idx: int | None = None) -> bool:
        return False

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        return 0

    def increase_count(self, layer_idx: int, state_idx: int = 0) -> None:
        pass

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

    def to_stock(self, text_model) -> DynamicCache:
        """The stock ``DynamicCache`` stock's ``generate`` would return for the same call (the tokens fed so far:
        the prompt and every generated token but the last), copied out of the buffers: what a fused ``generate``
        returns as ``past_key_values``, so a caller can keep, inspect or continue it like stock's."""
        return stock_cache_from_state(text_model, self._buffers(), self._pad, self._seq_len)

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

