# Copyright 2026 The Qwen3.5 fused-kernels authors. Licensed under the Apache License, Version 2.0.
"""Fused inference ops for Qwen3.5: the public API of the `fused_ops_*` modules, one per op family.

Model code imports the ops from here only. Each op is a Triton kernel (or fla glue) behind a `name()` wrapper that
validates its inputs, with a plain-torch `name_ref()` beside it taking the same arguments.

- `fused_ops_runtime`: the optional-import gate (`HAS_TRITON`, `HAS_FLA`, `kernels_available`), launch sizes, PDL
  (`pdl_enabled`), input checks, shared `@triton.jit` helpers, and the graph-capture helpers
  `reset_rng_after_failed_capture` / `capture_error`.
- `fused_ops_norm`: `rms_norm` (optionally with the residual add), `swiglu`, `gated_rms_norm`.
- `fused_ops_attention`: `attn_prep`, `sigmoid_gate_mul`, `decode_attention`, `mrope_step`.
- `fused_ops_deltanet`: `causal_conv1d_step`, `gated_delta_rule_step`, their few-token forms `causal_conv1d_steps`
  and `gated_delta_rule_steps` (the state after each token kept).
- `fused_ops_deltanet_prefill`: `deltanet_prep`, `gated_delta_rule_prefill` (with `prefill_rule_kernel`).
- `fused_ops_gemv`: `gemv`, `skinny_gemm`, `small_linear` (with `small_linear_choices`, `gemv_late_signal_min_elems`).
- `fused_ops_moe`: `moe_route`, `moe_experts` (Qwen3.5-MoE's sparse block; its prefill grouped GEMMs in
  `fused_ops_moe_gemm`).

A module constant (a block size, `PDL_ENABLED`, `_GEMV_LATE_TRIGGER_ELEMS`) is read by the module that defines it:
set or patch it there, not here.

`op_set()` binds the model's fused ops (`KERNEL_OPS`) to the kernels, `op_set(reference=True)` to their torch
references: the fused control flow run on torch, e.g. on CPU in tests.
"""

import types

from .fused_ops_attention import (
    attn_prep,
    attn_prep_ref,
    decode_attention,
    decode_attention_ref,
    mrope_step,
    mrope_step_ref,
    sigmoid_gate_mul,
    sigmoid_gate_mul_ref,
)
from .fused_ops_deltanet import (
    causal_conv1d_step,
    causal_conv1d_step_ref,
    causal_conv1d_steps,
    causal_conv1d_steps_ref,
    gated_delta_rule_step,
    gated_delta_rule_step_ref,
    gated_delta_rule_steps,
    gated_delta_rule_steps_ref,
)
from .fused_ops_deltanet_prefill import (
    deltanet_prep,
    deltanet_prep_ref,
    gated_delta_rule_prefill,
    gated_delta_rule_prefill_ref,
    prefill_rule_kernel,
)
from .fused_ops_gemv import (
    gemv,
    gemv_late_signal_min_elems,
    gemv_ref,
    skinny_gemm,
    skinny_gemm_ref,
    small_linear,
    small_linear_choices,
    small_linear_ref,
)
from .fused_ops_moe import moe_experts, moe_experts_ref, moe_route, moe_route_ref, moe_shared_in_slots
from .fused_ops_norm import gated_rms_norm, gated_rms_norm_ref, rms_norm, rms_norm_ref, swiglu, swiglu_ref
from .fused_ops_runtime import (
    HAS_FLA,
    HAS_TRITON,
    capture_error,
    kernels_available,
    pdl_enabled,
    reset_rng_after_failed_capture,
    triton_cache_dir,
    triton_cache_holds,
)

# The ops the model's fused path calls; each has a `name_ref` taking the same arguments.
KERNEL_OPS = (
    "rms_norm",
    "attn_prep",
    "sigmoid_gate_mul",
    "swiglu",
    "small_linear",
    "causal_conv1d_step",
    "causal_conv1d_steps",
    "gated_delta_rule_step",
    "gated_delta_rule_steps",
    "deltanet_prep",
    "gated_rms_norm",
    "gated_delta_rule_prefill",
    "decode_attention",
    "mrope_step",
    "moe_route",
    "moe_experts",
)


def op_set(reference: bool = False) -> types.SimpleNamespace:
    """The `KERNEL_OPS` as one namespace: the Triton kernels, or with `reference` their plain-torch `name_ref`
    references (same arguments), so the fused control flow can run on torch alone."""
    suffix = "_ref" if reference else ""
    return types.SimpleNamespace(**{name: globals()[name + suffix] for name in KERNEL_OPS})


__all__ = [
    "HAS_FLA",
    "HAS_TRITON",
    "KERNEL_OPS",
    "attn_prep",
    "attn_prep_ref",
    "capture_error",
    "causal_conv1d_step",
    "causal_conv1d_step_ref",
    "causal_conv1d_steps",
    "causal_conv1d_steps_ref",
    "decode_attention",
    "decode_attention_ref",
    "deltanet_prep",
    "deltanet_prep_ref",
    "gated_delta_rule_prefill",
    "gated_delta_rule_prefill_ref",
    "gated_delta_rule_step",
    "gated_delta_rule_step_ref",
    "gated_delta_rule_steps",
    "gated_delta_rule_steps_ref",
    "gated_rms_norm",
    "gated_rms_norm_ref",
    "gemv",
    "gemv_late_signal_min_elems",
    "gemv_ref",
    "kernels_available",
    "mrope_step",
    "mrope_step_ref",
    "moe_experts",
    "moe_experts_ref",
    "moe_route",
    "moe_route_ref",
    "moe_shared_in_slots",
    "op_set",
    "pdl_enabled",
    "prefill_rule_kernel",
    "reset_rng_after_failed_capture",
    "rms_norm",
    "rms_norm_ref",
    "sigmoid_gate_mul",
    "sigmoid_gate_mul_ref",
    "skinny_gemm",
    "skinny_gemm_ref",
    "small_linear",
    "small_linear_choices",
    "small_linear_ref",
    "swiglu",
    "swiglu_ref",
    "triton_cache_dir",
    "triton_cache_holds",
]
