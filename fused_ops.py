"""Fused inference ops for Qwen3.5: Triton kernels, fla glue, and a plain-torch reference beside each.

This is the only file of the repo that imports `triton` or `fla` (flash-linear-attention). Both imports sit in the
one gate below and never raise: where a package is missing, `HAS_TRITON` / `HAS_FLA` are False and the model falls
back to the stock transformers code (announced once by the model, never silently). transformers' remote-code import
check reads every file of a Hub repo, so nothing in this file may fail at import time.

Shape alphabet: B batch, T tokens, H attention heads, KV key/value heads, D head dim, R rotary dim, N hidden size,
I intermediate size, HV linear-attention value heads, K / V linear key / value head dims.
"""

import torch

try:  # the one optional-import gate of the repo
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:  # pragma: no cover - depends on the environment
    triton = None
    tl = None
    HAS_TRITON = False

try:
    from fla.modules.causal_conv1d import causal_conv1d as fla_causal_conv1d
    from fla.modules.norm.fused_norm_gate import rms_norm_gated as _fla_rms_norm_gated
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk_gated_delta_rule

    HAS_FLA = True
except Exception:  # pragma: no cover - depends on the environment
    fla_causal_conv1d = None
    fla_chunk_gated_delta_rule = None
    _fla_rms_norm_gated = None
    HAS_FLA = False


def kernels_available() -> str | None:
    """None when the fused kernels can run here, else the reason they cannot (for the model's one log line)."""
    if not HAS_TRITON:
        return "triton is not installed"
    if not HAS_FLA:
        return "flash-linear-attention (fla) is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device is available"
    return None


def fla_rms_norm_gated(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gated RMSNorm of the DeltaNet output through fla's fused kernel: ``y = x / rms(x) * w * silu(gate)``.

    x, gate: [M, V] (M = B * T * HV rows of one value head each); weight: [V]. Replaces stock
    ``Qwen3_5RMSNormGated`` (which rounds the normalised x to the input dtype before the weight and gate; fla keeps
    fp32 until the end, a bf16-rounding-level difference).
    """
    return _fla_rms_norm_gated(x, gate, weight, None, activation="swish", eps=eps)
