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

For one token (``fused_ops.moe_shared_in_slots``: batch-1 decode, the shared expert as wide as a routed one) the
GEMM of step 1 reads only the router and shared-gate rows (a slice of the packed matrix: no copy) and ``moe_experts``
runs the shared expert as one more slot of its two GEMVs, so steps 3-4 are two launches, not four.

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
from .fused_ops import moe_shared_in_slots
from .fused_plan import FusedPlan

FUSED_MOE_OPS = (
    "1 GEMM (shared gate|up | router | shared-expert gate) + moe_route (softmax, top-k, renormalise) + SwiGLU + shared "
    "down projection + moe_experts (routed experts, weighted sum, plus the gated shared expert); one token: "
    "1 GEMV (router | shared-expert gate) + moe_route + moe_experts (the shared expert a slot of its 2 GEMVs)"
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
    # 2 I_shared + E + 1 rows (1,281 at 35B-A3B): unpadded, the projection's odd row stride sends cuBLAS to an
    # unaligned sm75 kernel (138 us of a 2,048-token prefill's layer on the H200, against ~10 us aligned)
    _fused_row_multiple = 8

    def __init__(self, config, plan: FusedPlan):
        super().__init__(config)
        self.gate = FusedTopKRouter(config, plan)  # stock's router, the same parameter (built once more: tiny)
        self._init_fused(plan)

    def _run(self, ops, x: torch.Tensor, linear) -> torch.Tensor:
        """The block on tokens ``x`` [T, H] -> [T, H] (the module docstring's steps); ``linear(a, weight)`` runs its
        dense projections (``F.linear``, or the decode step's ``small_linear``)."""
        w, _ = self.packed_weight()  # [2 * I_shared + E + 1 (+ zero rows), H]: shared gate|up, router, shared gate
        inter, E = self.shared_expert.intermediate_size, self.gate.num_experts
        experts, down_s = self.experts, self.shared_expert.down_proj.weight
        if moe_shared_in_slots(x.shape[0], experts.down_proj.shape[2], inter):
            proj = linear(x, w[2 * inter:])  # [T, E + 1 (+ zeros)] router logits, shared gate logit
            logits, shared_gate = proj[:, :E], proj[:, E : E + 1]
            _, weights, ids = self.gate(x, logits=logits)
            return ops.moe_experts(x, experts.gate_up_proj, experts.down_proj, weights, ids, shared_gate=shared_gate,
                                   shared_experts=(w[: 2 * inter], down_s))
        proj = linear(x, w)
        shared_gate_up, logits, shared_gate = proj[:, : 2 * inter], proj[:, 2 * inter : 2 * inter + E], \
            proj[:, 2 * inter + E : 2 * inter + E + 1]
        _, weights, ids = self.gate(x, logits=logits)
        shared = linear(ops.swiglu(shared_gate_up), down_s)
        return ops.moe_experts(x, experts.gate_up_proj, experts.down_proj, weights, ids, shared, shared_gate)

    def forward(self, hidden_states):
        if not self.plan.runs(self._fused_kind):
            return super().forward(hidden_states)
        batch, seq_len, hidden = hidden_states.shape
        x = hidden_states.reshape(-1, hidden)  # [T, H]
        return self._run(self.plan.ops, x, F.linear).view(batch, seq_len, hidden)

    def add_to(self, residual, x):
        """``residual + self(x)``; ``residual`` is the decoder layer's fresh sum buffer (its fused norm allocated it),
        so the add runs in place."""
        return residual.add_(self(x))

    def decode_step(self, ops, x: torch.Tensor) -> torch.Tensor:
        """The block for the decode step's one token per row, ``x`` [B, 1, H] -> [B, 1, H]: every linear by
        ``small_linear`` (cuBLAS or our GEMV, as the dense step's), no host sync (capturable)."""
        batch = x.shape[0]
        return self._run(ops, x.view(batch, -1), lambda a, weight: step_linear(ops, a, weight)).view(batch, 1, -1)


class FusedMoeDecoderLayer(FusedDecoderLayer):
    """The dense fused decoder layer with the sparse MoE block as its feed-forward (stock
    ``Qwen3_5MoeDecoderLayer``'s modules, names and forward)."""

    def _make_mlp(self, config, plan: FusedPlan) -> nn.Module:
        return FusedSparseMoeBlock(config, plan)
