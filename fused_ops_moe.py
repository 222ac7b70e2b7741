# Copyright 2026 The Qwen3.5 fused-kernels authors. Licensed under the Apache License, Version 2.0.
"""The sparse MoE block of Qwen3.5-MoE (`qwen3_5_moe_text`): routing and the routed experts, each op beside its
plain-torch reference.

- `moe_route`: softmax over the router logits in float32, top-k, renormalised, cast back; replaces stock
  `Qwen3_5MoeTopKRouter.forward` after its linear.
- `moe_experts`: the routed experts' SwiGLU MLPs on the tokens that picked them, weighted and summed per token, plus
  the shared expert's output times the sigmoid of its gate; replaces stock `Qwen3_5MoeExperts.forward` and the
  `expert_output + sigmoid(shared_expert_gate(x)) * shared_expert_output` of `Qwen3_5MoeSparseMoeBlock.forward`.

Each op: kernel -> wrapper (validates; ValueError names the values) -> torch `name_ref` below it (dtypes: runtime).
"""

import torch


def _check_routing(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, n_experts: int) -> None:
    if x.dim() != 2 or weights.dim() != 2 or ids.shape != weights.shape or ids.shape[0] != x.shape[0]:
        raise ValueError(f"moe_experts needs x [T, H], weights [T, k] and ids [T, k], got {tuple(x.shape)}, "
                         f"{tuple(weights.shape)} and {tuple(ids.shape)}.")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= n_experts):
        raise ValueError(f"moe_experts: expert ids must lie in [0, {n_experts}), got {int(ids.min())} to "
                         f"{int(ids.max())}.")


def moe_route_ref(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch `moe_route`, as stock `Qwen3_5MoeTopKRouter.forward` computes it after its linear.

    Args:
        logits: [T, E] router logits (any float dtype).
        top_k: experts per token, 1 <= top_k <= E.

    Returns:
        (weights [T, top_k] in logits.dtype, ids [T, top_k] int64): the top-k softmax probabilities (softmax in
        float32) divided by their sum, in descending order, and the experts they belong to.
    """
    if logits.dim() != 2 or not 1 <= top_k <= logits.shape[-1]:
        raise ValueError(f"moe_route needs logits [T, E] and 1 <= top_k <= E, got {tuple(logits.shape)} and "
                         f"top_k={top_k}.")
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    top, ids = torch.topk(probs, top_k, dim=-1)
    top = top / top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype), ids


def moe_experts_ref(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    shared: torch.Tensor | None = None,
    shared_gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-torch `moe_experts`, as stock `Qwen3_5MoeExperts.forward` (the eager loop over the experts hit, in
    ascending expert order, each product rounded to x.dtype) and the shared-expert sum of
    `Qwen3_5MoeSparseMoeBlock.forward`.

    Args:
        x: [T, H] tokens.
        gate_up: [E, 2*I, H] each expert's gate and up projections (stock `experts.gate_up_proj`).
        down: [E, H, I] each expert's down projection (stock `experts.down_proj`).
        weights: [T, k] routing weights (`moe_route`), in x.dtype.
        ids: [T, k] expert of each weight, integer.
        shared: optional [T, H], the shared expert's output (stock `shared_expert(x)`).
        shared_gate: [T, 1] with `shared`, the shared expert's gate logit (stock `shared_expert_gate(x)`).

    Returns:
        y [T, H] in x.dtype: `sum_j weights[t, j] * down[e_j] @ (silu(g) * u)` with `g, u` the halves of
        `gate_up[e_j] @ x[t]`, plus `sigmoid(shared_gate) * shared` when given.
    """
    _check_routing(x, weights, ids, gate_up.shape[0])
    if (shared is None) != (shared_gate is None):
        raise ValueError("moe_experts takes shared and shared_gate together (both or neither).")
    y = torch.zeros_like(x)
    for e in torch.unique(ids).tolist():  # sorted ascending, as stock's `expert_hit`
        token, slot = torch.where(ids == e)
        gate, up = torch.nn.functional.linear(x[token], gate_up[e]).chunk(2, dim=-1)
        h = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, down[e])
        y.index_add_(0, token, (h * weights[token, slot, None]).to(y.dtype))
    if shared is not None:
        y = y + torch.sigmoid(shared_gate) * shared
    return y
