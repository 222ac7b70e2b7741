# Copyright 2026 The Qwen3.5 fused-kernels authors. Licensed under the Apache License, Version 2.0.
"""The fused layers of the Qwen3.5 MoE models (``qwen3_5_moe_text``): the sparse MoE block and the MoE decoder layer.

The MoE decoder layer is the dense fused layer (``fused_layers``: Gated DeltaNet, gated attention, RMSNorms,
unchanged; their stock MoE twins are the same code) with :class:`FusedSparseMoeBlock` where the dense layer has its
MLP. Every parameter keeps stock's name and shape (``mlp.gate.weight``, ``mlp.experts.gate_up_proj`` [E, 2I, H],
``mlp.experts.down_proj`` [E, H, I], ``mlp.shared_expert.*``, ``mlp.shared_expert_gate.weight``).

The block, on the fused path, for tokens ``x`` [T, H]:

1. one GEMM for everything that reads ``x`` besides the routed experts, packed as for the dense groups
   (``pack_linears``): ``shared_expert.gate_proj | shared_expert.up_proj | gate (router) | shared_expert_gate``,
   ``[2 * I_shared + E + 1, H]`` (the shared gate|up first, so the SwiGLU input starts at the matrix's own alignment);
2. ``moe_route`` on the router logits (softmax in float32, top-k, renormalised: stock's router after its linear);
3. ``swiglu`` of the shared expert's gate|up, then its down projection;
4. ``moe_experts``: the routed experts on the tokens that picked them, weighted and summed, plus
   ``sigmoid(shared_gate) * shared``.

Stock replaced: ``Qwen3_5MoeSparseMoeBlock.forward`` (four separate linears, the router's softmax / top-k, the
experts' loop over the experts hit with its host sync, the shared-expert gate). The fused decode step runs the same
block with every linear by ``small_linear`` and no host sync (:meth:`FusedSparseMoeBlock.decode_step`).

Router logits. transformers records them (``output_router_logits``) with a forward hook on the router module
(``Qwen3_5MoeTopKRouter``), as it records hidden states and attentions. The fused block therefore still calls its
router module, handing it the logits the packed GEMM computed: the hook sees stock's output ``(logits, weights, ids)``
and the fused path keeps running (no fallback for that call).
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock, Qwen3_5MoeTopKRouter

from .fused_decode import step_linear
from .fused_layers import FusedDecoderLayer, _FusedModule
from .fused_plan import FusedPlan

FUSED_MOE_OPS = (
    "1 GEMM (shared gate|up | router | shared-expert gate) + moe_route (softmax, top-k, renormalise) + SwiGLU + shared "
    "down projection + moe_experts (routed experts, weighted sum, plus the gated shared expert)"
)


class FusedTopKRouter(_FusedModule, Qwen3_5MoeTopKRouter):
    """Stock's router; on the fused path it is handed the logits the block's packed GEMM computed and only routes
    them (``moe_route``), so transformers' recording hook on this module sees stock's outputs."""

    _fused_kind = "moe"

    def __init__(self, config, plan: FusedPlan):
        super().__init__(config)
        self._init_fused(plan)

    def forward(self, hidden_states, logits: torch.Tensor | None = None):
        """Stock's ``(logits [T, E], weights [T, k], ids [T, k])``; with ``logits`` (fused path) they are routed
        here instead of computed from ``hidden_states``."""
        if logits is None:
            return super().forward(hidden_states)
        weights, ids = self.plan.ops.moe_route(logits, self.top_k)
        return logits, weights, ids


class FusedSparseMoeBlock(_FusedModule, Qwen3_5MoeSparseMoeBlock):
    """Stock's sparse MoE block with the fused path of the module docstring; the stock path is stock's forward."""

    _fused_kind = "moe"
    _fused_group = ("shared_expert.gate_proj", "shared_expert.up_proj", "gate", "shared_expert_gate")

    def __init__(self, config, plan: FusedPlan):
        super().__init__(config)
        self.gate = FusedTopKRouter(config, plan)  # stock's router, the same parameter (built once more: tiny)
        self._init_fused(plan)

    def _split(self, proj: torch.Tensor):
        """The packed projection [T, 2 * I_shared + E + 1] as (shared gate|up, router logits, shared gate logit)."""
        inter = self.shared_expert.intermediate_size
        return torch.split(proj, [2 * inter, self.gate.num_experts, 1], dim=-1)

    def _combine(self, ops, x: torch.Tensor, proj: torch.Tensor, linear) -> torch.Tensor:
        """Steps 2-4 of the module docstring for tokens ``x`` [T, H] and their packed projection ``proj``; ``linear``
        runs the shared down projection (``F.linear``, or ``small_linear`` in the decode step)."""
        shared_gate_up, logits, shared_gate = self._split(proj)
        _, weights, ids = self.gate(x, logits=logits)
        shared = linear(ops.swiglu(shared_gate_up), self.shared_expert.down_proj.weight)
        return ops.moe_experts(x, self.experts.gate_up_proj, self.experts.down_proj, weights, ids, shared,
                               shared_gate)

    def forward(self, hidden_states):
        if not self.plan.runs(self._fused_kind):
            return super().forward(hidden_states)
        batch, seq_len, hidden = hidden_states.shape
        x = hidden_states.reshape(-1, hidden)  # [T, H]
        w, _ = self.packed_weight()
        return self._combine(self.plan.ops, x, F.linear(x, w), F.linear).view(batch, seq_len, hidden)

    def add_to(self, residual, x):
        """``residual + self(x)``; ``residual`` is the decoder layer's fresh sum buffer (its fused norm allocated it),
        so the add runs in place."""
        return residual.add_(self(x))

    def decode_step(self, ops, x: torch.Tensor) -> torch.Tensor:
        """The block for the decode step's one token per row, ``x`` [B, 1, H] -> [B, 1, H]: every linear by
        ``small_linear`` (cuBLAS or our GEMV, as the dense step's), no host sync (capturable)."""
        batch = x.shape[0]
        x2 = x.view(batch, -1)
        w, _ = self.packed_weight()
        y = self._combine(ops, x2, ops.small_linear(x2, w), lambda a, weight: step_linear(ops, a, weight))
        return y.view(batch, 1, -1)


class FusedMoeDecoderLayer(FusedDecoderLayer):
    """The dense fused decoder layer with the sparse MoE block as its feed-forward (stock
    ``Qwen3_5MoeDecoderLayer``'s modules, names and forward)."""

    def _make_mlp(self, config, plan: FusedPlan) -> nn.Module:
        return FusedSparseMoeBlock(config, plan)
