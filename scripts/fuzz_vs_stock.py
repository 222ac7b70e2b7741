"""Differential search: the fused classes against stock transformers over randomly drawn configs, weights and calls.

    # the H200 run of the issue: dense and MoE, fp32 / bf16 / fp16, 30 minutes, configs from a pool of 48
    python scripts/fuzz_vs_stock.py --minutes 30
    # CPU: the emulated fused path (the kernels' torch references) against stock, a fixed number of cases
    python scripts/fuzz_vs_stock.py --device cpu --cases 40 --seed 1
    # one case again, as a failure prints it (its shrunk form when the shrinker found one)
    python scripts/fuzz_vs_stock.py --replay '{"seed": 17, ...}'
    # the same, then with each fused op on its torch reference in turn: which kernel adds the error (GPU)
    python scripts/fuzz_vs_stock.py --replay '{"seed": 17, ...}' --bisect-ops
    # the CPU emulation of the GPU path against the GPU path itself, on the same cases (GPU only)
    python scripts/fuzz_vs_stock.py --minutes 5 --emulation-check
    # several searches side by side (seeds seed*100 + i), one summary: a device call is at most 10 minutes, and one
    # process leaves most of the GPU and the CPUs (which compile the kernels) idle
    python scripts/fuzz_vs_stock.py --minutes 8 --workers 6 --out fuzz.json

Each case is drawn from a seed (`draw_case`): a config (dense or MoE; hidden size, attention and linear-attention
head counts and dims, layer pattern, vocabulary, tied or untied embeddings, experts), weights with realistic spreads
(norm weights, `A_log`, `dt_bias`, gate / beta projection scales, conv taps: several paths diverge only with larger
gates or decays), a dtype and one call: a forward (padding side and amount, lengths at every bucket, chunk and tile
edge, `logits_to_keep`, explicit position ids, `output_hidden_states`, `use_cache`), a forward continuing the cache
it returned, `generate` (greedy, or sampling from a seed, with padding and stop tokens), speculative greedy `generate`
(a random MTP head on the fused model, k drafts a round, a share of them replaced by stock's own tokens so that every
acceptance length occurs) or `generate_batch` (prompts of their own lengths and token counts, rows and prefill chunk
drawn; each request against stock's `generate` of its prompt alone). Stock and fused run on the same weights in one
process and everything a user sees is compared (`run_case`): the logits of every real position (each position on its
own, so a fault at one position is not diluted by the others), hidden states, the returned cache's states and length,
generated tokens.

Bounds (`docs/DESIGN.md`, "How correctness is established"): fp32 against stock's IEEE torch code, per position,
`FP32_BOUND` (the model bound of the CUDA tests), or past it no further from a float64 answer than `FP32_FACTOR` x
stock's own fp32 error; bf16 / fp16 against the float32 answer on the same weights: the fused error at most
`LOW_PRECISION_FACTOR` x stock's own error there, or within the CUDA tests' model bound of stock. Tokens at an MoE
router tie (`ROUTER_TIE`, or within what twice stock's own router noise can swap: `router_ties`) are left out.
Generated tokens may part only at a near-tie: where that step's logits pass, and only to a token whose stock logit is
within 2x the rounding at hand of stock's best (so a wrong token from a right forward, a decode-loop fault, fails). A
failure is shrunk (`shrink`: fewer layers, smaller sizes, shorter inputs, while it still fails) and printed as one
command that reproduces it; the run ends with the cases per minute and the coverage of what it drew.
"""

import argparse
import contextlib
import copy
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from scripts.common import import_module, import_repo  # noqa: E402

configuration, modeling, _ = import_repo()
compat = import_module("fused_compat")
plan_mod = import_module("fused_plan")
graphs = import_module("fused_graphs")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# fp32, per real position: fused against stock's IEEE torch code (the CUDA tests' "model" bound: fp32 ulps over a
# few layers); the CPU emulation runs the same references as stock, so its bound is the emulation's.
FP32_BOUND = {"cuda": 2e-5, "cpu": 1e-5}
# bf16 / fp16: the fused path's error from the float32 answer may be at most this multiple of stock's own error
# there (stock rounds after every op, the fused kernels once per fused op: the two errors differ, neither is 0) ...
LOW_PRECISION_FACTOR = 2.0
# ... or within the CUDA tests' model bound of stock itself.
LOW_PRECISION_BOUND = {torch.bfloat16: 1.5e-2, torch.float16: 1.5e-2}
# fp32 beyond FP32_BOUND (widened weights make some cases ill-conditioned: large gates and decays over hundreds of
# tokens): the fused error from the float64 answer at most this multiple of stock's own fp32 error there.
FP32_FACTOR = 2.0
# An MoE router whose k-th and (k+1)-th expert probabilities (in the answer) are closer than this at a token picks
# either expert under the dtype's rounding: stock and fused may route that token differently, both right (a CPU fp16
# case: 2e-5 apart in the float32 answer, an exact tie in stock's fp16). Such tokens are left out of the comparison;
# every other position still counts. Rounding moves router probabilities by ~1e-7 in fp32; in 16 bits the router
# logits are rounded (fp16: ~5e-4 relative, ~3e-4 in a probability of ~0.2; bf16 8x that). A tied token that the two
# paths did route apart (its own output fails the comparison) also moves every later token of its row, through
# attention and the DeltaNet state (a CPU fp16 case: a layer-2 gap of 1.9e-5 at position 2, every later position
# 2-4e-2 off from there): that row is left out from the tied token on, and from every later comparison of the case
# (its continued calls, its cache states; ``Compare.tainted``).
# Past that floor, a router's own 16-bit noise at a token: stock's probabilities there (one layer, every expert) differ
# from the answer's by up to d (its router inputs carry every earlier layer's rounding, and wide router weights make
# large logits). The fused path is held to twice stock's error everywhere else, so 2d an expert, and two experts swap
# when their deviations differ by the gap: up to 4d. A token whose answer gap is below 4d at some layer is at a tie
# too (a CPU fp16 MoE case: last-layer gap 3.5e-4, stock 1.1e-4 off there, the fused path 2.2e-4, and routed apart;
# over the case's tokens the fused router was 1.0-1.25x stock's mean deviation a layer). ``router_ties``.
ROUTER_TIE = {torch.float32: 2e-6, torch.float16: 3e-4, torch.bfloat16: 2e-3}
ROUTER_NOISE_FACTOR = 4.0

# Lengths at the edges the fused path cares about: the 64-token forward buckets and their 1/8 steps, fla's 64-token
# chunks, deltanet_prep's 32- and 16-token tiles, the decode buckets (256 and powers of two), and one past each.
EDGES = sorted({t + d for t in (16, 32, 64, 96, 128, 192, 256, 320, 384, 512, 640) for d in (-1, 0, 1)} | {1, 2, 3})
CALL_KINDS = ("forward", "forward_padded", "forward_cache", "continue", "hidden_states", "generate", "sample",
              "speculative", "batch")


# -- drawing -----------------------------------------------------------------------------------------------------


def _rope(head_dim: int) -> dict:
    """Stock's interleaved mRoPE over a quarter of the head (sections t / h / w as the real models split them)."""
    half = max(1, head_dim // 8)
    third = half // 3
    return {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
            "mrope_section": [half - 2 * third, third, third], "mrope_interleaved": True}


def draw_config(rng: random.Random, moe: bool) -> dict:
    """Text-config kwargs of a small random Qwen3.5 (MoE when ``moe``)."""
    heads = rng.choice([1, 2, 4, 8])
    head_dim = rng.choice([32, 64, 128, 256])
    k_heads = rng.choice([1, 2, 4])
    layers = rng.choice([1, 2, 3, 4, 5, 6])
    pattern = rng.choice(["real", "random", "full"])
    if pattern == "real":  # 3 linear : 1 full, as every released Qwen3.5 (the last layer full when fewer than 4)
        types = ["full_attention" if i % 4 == 3 or i == layers - 1 else "linear_attention" for i in range(layers)]
    elif pattern == "random":  # at least one full-attention layer: stock's cache needs one to tell its length
        types = [rng.choice(["linear_attention", "full_attention"]) for _ in range(layers)]
        types[rng.randrange(layers)] = "full_attention"
    else:
        types = ["full_attention"] * layers
    kw = dict(
        vocab_size=rng.choice([64, 256, 1024]), hidden_size=rng.choice([32, 48, 64, 96, 128]),
        num_hidden_layers=layers, layer_types=types, num_attention_heads=heads,
        num_key_value_heads=rng.choice([d for d in (1, 2, 4, 8) if heads % d == 0]), head_dim=head_dim,
        rope_parameters=_rope(head_dim), linear_num_key_heads=k_heads,
        linear_num_value_heads=k_heads * rng.choice([1, 2, 4]), linear_key_head_dim=rng.choice([16, 32, 64, 128]),
        linear_value_head_dim=rng.choice([16, 32, 64, 128]), linear_conv_kernel_dim=4,
        tie_word_embeddings=rng.random() < 0.5, max_position_embeddings=4096, rms_norm_eps=1e-6,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    if moe:
        experts = rng.choice([4, 8, 16])
        kw.update(num_experts=experts, num_experts_per_tok=rng.choice([k for k in (1, 2, 4, 8) if k <= experts]),
                  moe_intermediate_size=rng.choice([16, 32, 48]),
                  shared_expert_intermediate_size=rng.choice([16, 32, 64]))
    else:
        kw["intermediate_size"] = rng.choice([32, 64, 96, 160])
    return kw


def draw_weights(rng: random.Random) -> dict:
    """Spreads of the weights a random init leaves narrow (``apply_spreads``)."""
    return {"norm": rng.choice([0.0, 0.1, 0.5]), "proj": rng.choice([0.5, 1.0, 2.0]),
            "gate": rng.choice([0.5, 1.0, 3.0]), "decay": rng.choice([0.25, 1.0, 4.0]),
            "conv": rng.choice([1.0, 3.0])}


def draw_length(rng: random.Random, max_len: int) -> int:
    return rng.choice([t for t in EDGES if t <= max_len]) if rng.random() < 0.7 else rng.randint(1, max_len)


def draw_call(rng: random.Random, max_len: int, kinds=CALL_KINDS, dtype: str = "fp32") -> dict:
    kind = rng.choice(kinds)
    if kind == "sample" and dtype != "fp32":  # a 16-bit rounding moves a sampled draw: greedy checks those values
        kind = "generate"
    batch = rng.choice([1, 2, 3, 4])
    length = draw_length(rng, max_len)
    side = rng.choice(["left", "right", None]) if kind != "forward" else None
    if kind in ("generate", "sample", "continue"):
        side = rng.choice(["left", None])  # generate pads on the left
    call = {"kind": kind, "batch": batch, "length": length, "padding": side, "data_seed": rng.randrange(1 << 30)}
    if kind in ("forward", "forward_padded"):
        call["logits_to_keep"] = rng.choice([0, 0, 1, 3])
        call["position_ids"] = rng.random() < 0.2
        call["use_cache"] = rng.choice([False, None])  # None: the config's (True), as `model(**inputs)` runs
    if kind == "continue":
        call["more"] = rng.choice([1, 1, 2, 5])
    if kind in ("generate", "sample"):
        call["new_tokens"] = rng.choice([1, 4, 16])
        call["stop_token"] = rng.random() < 0.3
    if kind == "speculative":  # one row, no padding (what speculative decoding runs); a random MTP head whose drafts
        # are replaced by stock's own tokens with probability `hit`, so every acceptance length is exercised
        call.update(batch=1, padding=None, new_tokens=rng.choice([1, 5, 16]), stop_token=rng.random() < 0.3,
                    drafts=rng.choice([1, 2, 3]), hit=rng.choice([0.0, 0.5, 0.9]),
                    attention_at_once=rng.random() < 0.5)  # fused_decode.VERIFY_ATTENTION_AT_ONCE for the call
    if kind == "batch":  # generate_batch: prompts of their own lengths and token counts, rows and prefill chunk drawn
        call["lengths"] = [draw_length(rng, max_len) for _ in range(batch)]
        call["length"] = max(call["lengths"])
        call.update(padding=None, new_tokens=[rng.choice([1, 3, 9]) for _ in range(batch)],
                    rows=rng.randint(1, batch), chunk=rng.choice([None, None, 16, 33, 64]),
                    group=rng.choice([1, 2, 4]), hold=rng.random() < 0.5)
    return call


def config_pool(size: int, moe: float) -> list[tuple[bool, dict]]:
    """``size`` configs drawn once (from fixed seeds) for the GPU search to draw from: every new head layout, head
    dimension or width compiles its Triton kernels afresh, and in bf16 / fp16 fla autotunes its chunked kernels for it.
    On the H200 a fresh config a case ran 42 fp32 cases a minute (fla's recurrent kernel, no autotuning), but the
    mixed-dtype search beside the CUDA suite only 2.3; from a pool the kernels compile once per config and the cases
    vary the rest (weights, dtype, lengths, padding, call)."""
    out = []
    for i in range(size):
        rng = random.Random(f"pool-{i}")
        is_moe = rng.random() < moe
        out.append((is_moe, draw_config(rng, is_moe)))
    return out


def draw_case(seed: int, device: str, dtypes=tuple(DTYPES), moe: float = 0.3, max_len: int = 700,
              kinds=CALL_KINDS, pool: list | None = None) -> dict:
    """The case of ``seed``: everything ``run_case`` needs, as plain JSON values (so it can be printed and replayed);
    its config from ``pool`` (``config_pool``) when given."""
    rng = random.Random(seed)
    is_moe = rng.random() < moe
    dtype = rng.choice(list(dtypes))
    config = draw_config(rng, is_moe)
    if pool:
        is_moe, config = copy.deepcopy(rng.choice(pool))
    return {"seed": seed, "device": device, "dtype": dtype, "moe": is_moe, "config": config,
            "weights": draw_weights(rng), "call": draw_call(rng, max_len, kinds, dtype)}


# -- building ----------------------------------------------------------------------------------------------------


def apply_spreads(model, spreads: dict, seed: int) -> None:
    """Widen the weights a random init leaves narrow: zero-centred norm weights, the gate and beta projections
    (``in_proj_a`` / ``in_proj_b``), ``A_log`` (decay rate) and ``dt_bias``, the conv taps, all projections."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            r = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight") and "linear_attn.norm" not in name:
                p.copy_(r * spreads["norm"])  # stock's (1 + w)
            elif "linear_attn.norm" in name:
                p.copy_(1 + r * spreads["norm"])  # the gated norm's plain w
            elif leaf == "A_log":
                p.copy_(torch.log(torch.rand(p.shape, generator=g) * 16 * spreads["decay"] + 1e-3))
            elif leaf == "dt_bias":
                p.copy_(r * spreads["gate"])
            elif "in_proj_a" in name or "in_proj_b" in name:
                p.mul_(spreads["gate"])
            elif "conv1d" in name:
                p.mul_(spreads["conv"])
            elif p.dim() == 2 and "embed" not in name:
                p.mul_(spreads["proj"])


def build_pair(case: dict, device: torch.device):
    """Stock and fused models on the same weights, in the case's dtype on ``device``, plus the float32 stock answer
    (16-bit cases only). Stock runs its IEEE torch DeltaNet in fp32 (fla's chunked rule is TF32)."""
    from transformers import (Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig,
                              Qwen3_5TextConfig)

    kw = dict(case["config"])
    torch.manual_seed(case["seed"])
    if case["moe"]:
        kw.setdefault("experts_implementation", "eager")
        stock = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**kw))
        fused_cls, fused_cfg = modeling.Qwen3_5MoeFusedForCausalLM, configuration.Qwen3_5MoeFusedTextConfig
    else:
        stock = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**kw))
        fused_cls, fused_cfg = modeling.Qwen3_5FusedForCausalLM, configuration.Qwen3_5FusedTextConfig
    apply_spreads(stock, case["weights"], case["seed"])
    head = case["call"]["kind"] == "speculative"  # the fused model gets an MTP head of its own (stock has none)
    fused = fused_cls(fused_cfg(**kw, fused_kernels=True, **({"mtp_num_hidden_layers": 1} if head else {})))
    missing, unexpected = fused.load_state_dict(stock.state_dict(), strict=not head)
    if head:
        assert all(k.startswith("mtp.") for k in missing) and not unexpected, (missing, unexpected)
    dtype = DTYPES[case["dtype"]]
    # the answer the errors are measured from: float32 for 16-bit cases, float64 for fp32 cases (`float64_stock`)
    ref = copy.deepcopy(stock).to(device, torch.float64 if dtype == torch.float32 else torch.float32).eval()
    return stock.to(device, dtype).eval(), fused.to(device, dtype).eval(), ref


class _Float64Torch:
    """``torch`` as stock's modeling modules see it inside ``float64_stock``: ``torch.float32`` / ``torch.float`` name
    float64, so the casts stock makes to float32 (DeltaNet's kernels, the norms, softmax) keep float64."""

    def __getattr__(self, name):
        return torch.float64 if name in ("float32", "float") else getattr(torch, name)


@contextlib.contextmanager
def float64_stock():
    """Stock's Qwen3.5 code computing in float64 throughout (on a float64 model): the fp32 cases' answer."""
    import transformers.models.qwen3_5.modeling_qwen3_5 as dense
    import transformers.models.qwen3_5_moe.modeling_qwen3_5_moe as moe

    saved = [(m, m.torch) for m in (dense, moe)]
    try:
        for m, _ in saved:
            m.torch = _Float64Torch()
        yield
    finally:
        for m, t in saved:
            m.torch = t


@contextlib.contextmanager
def router_gaps(model, into: list):
    """While active, each forward of ``model``'s MoE routers appends to ``into`` the gap between the k-th and the
    (k+1)-th expert probability of every token ([B, T] as the model's input ids, +inf where every expert is
    picked)."""
    hooks, shape = [], []

    def take_shape(module, args, kwargs):  # routers see the tokens flattened: the batch's [B, T] from the input
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None:
            shape[:] = ids.shape[:2]

    def hook(module, args, out):
        probs = out[0].double().softmax(-1).sort(-1, descending=True).values
        k = module.top_k
        gap = probs[:, k - 1] - probs[:, k] if k < probs.shape[-1] else torch.full_like(probs[:, 0], math.inf)
        into.append(gap.reshape(shape).cpu() if shape and gap.numel() == shape[0] * shape[1] else gap.cpu())

    hooks.append(model.register_forward_pre_hook(take_shape, with_kwargs=True))
    for name, module in model.named_modules():
        if name.endswith("mlp.gate") and hasattr(module, "top_k"):
            hooks.append(module.register_forward_hook(hook))
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


@contextlib.contextmanager
def on_routers(model, record):
    """While active, ``record(out)`` runs on the output ``(logits, weights, experts)`` of each forward of ``model``'s
    MoE routers."""
    hooks = [module.register_forward_hook(lambda m, a, out: record(out))
             for name, module in model.named_modules() if name.endswith("mlp.gate") and hasattr(module, "top_k")]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


def router_probs(model, into: list):
    """While active, each forward of ``model``'s MoE routers appends its probabilities over the experts ([N, E]
    float64 on the CPU; N the tokens it saw, flattened)."""
    return on_routers(model, lambda out: into.append(out[0].double().softmax(-1).cpu()))


def router_ties(gaps: list, stock_probs: list, answer_probs: list, floor: float) -> torch.Tensor | None:
    """[B, T] bool: the tokens at a router tie in some layer: the answer's gap between its k-th and (k+1)-th expert
    below ``floor`` (the dtype's rounding of the logits, ``ROUTER_TIE``) or below ``ROUTER_NOISE_FACTOR`` x stock's own
    largest deviation from the answer's probabilities at that token and layer. None when the calls' router shapes do not
    line up (a multi-call kind). The deviation is used only where every layer's shapes match."""
    if not gaps or gaps[0].dim() != 2 or any(g.shape != gaps[0].shape for g in gaps):
        return None
    ties = torch.stack(gaps).min(0).values < floor
    if len(stock_probs) == len(answer_probs) == len(gaps):
        B, T = gaps[0].shape
        for gap, s, a in zip(gaps, stock_probs, answer_probs):
            if s.shape != a.shape or s.shape[0] != B * T:
                return ties
            noise = (s - a).abs().amax(-1).view(B, T)
            ties |= gap < ROUTER_NOISE_FACTOR * noise
    return ties


def router_choices(model, into: list):
    """While active, each forward of ``model``'s MoE routers appends the experts it picked ([N, k], sorted, on the
    CPU; N the tokens it saw, flattened)."""
    return on_routers(model, lambda out: into.append(out[2].sort(-1).values.cpu()))


def routed_apart(stock_ids: list, fused_ids: list, shape) -> torch.Tensor:
    """[B, T] bool: the tokens some router sent to other experts in the fused model than in stock. Stock's routers see
    the B * T tokens of the call; the fused path's see the same, or each row left-padded to its length bucket (its
    captured forward), whose last T tokens are the row's. Where the calls cannot be matched, every token counts as
    routed apart (the comparison then leaves out every tied token's row from there on)."""
    B, T = shape
    apart = torch.zeros(B, T, dtype=torch.bool)
    if not stock_ids or len(stock_ids) != len(fused_ids):
        return ~apart
    for s, f in zip(stock_ids, fused_ids):
        if s.shape[0] != B * T or f.shape[0] % B or f.shape[0] // B < T or s.shape[1:] != f.shape[1:]:
            return ~apart
        f = f.view(B, f.shape[0] // B, -1)[:, -T:]
        apart |= (s.view(B, T, -1) != f).any(-1)
    return apart


@contextlib.contextmanager
def stock_reference(ieee: bool):
    """With ``ieee`` (fp32, and the float32 answer): stock's own torch DeltaNet code (fla's chunked rule is TF32; on
    CPU also what runs without fla's Triton kernels) and its attention through SDPA's math backend on a GPU (the
    memory-efficient one is wrong for stock's stride-0 single-head keys at key lengths 1 mod 32,
    pytorch/pytorch#191937). Else stock as it runs (16 bits on the GPU: fla, and whatever SDPA picks)."""
    if not ieee:
        yield
        return
    with compat.torch_reference_kernels(), contextlib.ExitStack() as stack:
        if torch.cuda.is_available():
            from torch.nn.attention import SDPBackend, sdpa_kernel

            stack.enter_context(sdpa_kernel([SDPBackend.MATH]))
        yield


def make_inputs(call: dict, vocab: int, device) -> tuple[torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(call["data_seed"])
    B, T = call["batch"], call["length"]
    ids = torch.randint(3, vocab, (B, T), generator=g)
    mask = None
    if call["padding"] is not None:
        mask = torch.ones(B, T, dtype=torch.long)
        for row in range(1, B):  # row 0 stays whole
            pad = int(torch.randint(0, T, (1,), generator=g))
            if call["padding"] == "left":
                mask[row, :pad] = 0
            else:
                mask[row, T - pad:] = 0
            ids[row][mask[row] == 0] = 0
    return ids.to(device), None if mask is None else mask.to(device)


# -- comparing ---------------------------------------------------------------------------------------------------


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def per_position_err(got: torch.Tensor, want: torch.Tensor, real: torch.Tensor | None) -> tuple[float, tuple]:
    """The largest relative error of one position's vector ([B, T, N] tensors; ``real`` [B, T] marks the positions
    compared), and where it is (row, position)."""
    g, w = got.detach().double().cpu(), want.detach().double().cpu()
    err = (g - w).norm(dim=-1) / w.norm(dim=-1).clamp_min(1e-30)
    if real is not None:
        err = err * real.cpu().to(err.dtype)
    flat = int(err.argmax())
    return float(err.flatten()[flat]), divmod(flat, err.shape[1])


class Compare:
    """Collects the checks of one case: each a name, the measured error, its bound, and where."""

    def __init__(self, case: dict, device: torch.device):
        self.case, self.device = case, device
        self.dtype = DTYPES[case["dtype"]]
        self.failures: list[str] = []
        self.checks = 0
        self.ties = None  # [B, T] tokens of the last call at a router tie (``ROUTER_TIE``), or None
        self.apart = None  # [B, T] those of them the fused model routed to other experts than stock did, or None
        self.tied_tokens = 0
        self.tainted: set[int] = set()  # rows routed apart at a tie: left out from there on (``ROUTER_TIE``)

    def values(self, name: str, got, want, ref=None, real=None, whole: bool = False) -> None:
        """``got`` (fused) against ``want`` (stock), per position ([B, T, N]; ``whole``: over the whole tensor, for
        cache states); in 16 bits also both against ``ref`` (the float32 answer): passes when within the 16-bit bound
        of stock, or no worse than ``LOW_PRECISION_FACTOR`` x stock's own error from the float32 answer."""
        self.checks += 1
        if got.shape != want.shape:
            self.failures.append(f"{name}: shape {tuple(got.shape)} != stock's {tuple(want.shape)}")
            return
        if not torch.isfinite(got).all() and torch.isfinite(want).all():
            self.failures.append(f"{name}: non-finite values where stock's are finite")
            return
        ties = self._ties_of(got) if not whole else None
        apart = self._ties_of(got, self.apart, before=True) if not whole else None
        rows = list(range(got.shape[0]))  # the rows compared: all but those routed apart at a tie earlier
        if whole and self.apart is not None and self.apart.shape[0] == got.shape[0]:
            # a state after a call whose tied token went to other experts: that row is left out from the call on
            self.tainted |= set(self.apart.any(dim=1).nonzero().flatten().tolist())
        if self.tainted and (whole or got.dim() >= 3):
            rows = [r for r in rows if r not in self.tainted]
            if not rows:
                return  # every row was routed apart at a tie earlier in the case: nothing left to compare
            index = torch.tensor(rows)
            got, want = got[index.to(got.device)], want[index.to(want.device)]
            ref = None if ref is None else ref[index.to(ref.device)]
            real = None if real is None else real[index.to(real.device)]
            ties = None if ties is None else ties[index]
            apart = None if apart is None else apart[index]
        if whole:  # one vector: the whole tensor
            got, want, ref = (None if t is None else t.reshape(1, 1, -1) for t in (got, want, ref))
        elif got.dim() == 2:
            got, want, ref = got[None], want[None], None if ref is None else ref[None]
        bound = FP32_BOUND[self.device.type] if self.dtype == torch.float32 else LOW_PRECISION_BOUND[self.dtype]
        if per_position_err(got, want, real)[0] <= bound:
            return
        if ties is not None and (ties.any() or (apart is not None and apart.any())):
            keep = ~ties if real is None else real.cpu() & ~ties  # the tokens at a router tie left out
            # a tied token routed apart moves its row from there on: leave that out too. Routed apart: seen in the
            # routers' choices (``apart``; a tie before the positions compared, cut off by logits_to_keep, starts the
            # row), or, where they could not be matched, the token's own output fails
            starts = {} if apart is None else {row: max(pos, 0) for row, pos in reversed(apart.nonzero().tolist())}
            if apart is None:
                for row, pos in ties.nonzero().tolist():
                    one = torch.zeros_like(ties)
                    one[row, pos] = True
                    if self._verdict(got, want, ref, one if real is None else one & real.cpu(), bound) is not None:
                        starts.setdefault(row, pos)
            for row, pos in starts.items():
                keep[row, pos:] = False
                self.tainted.add(rows[row])
            real = keep
        failure = self._verdict(got, want, ref, real, bound)
        if failure is not None:
            self.failures.append(f"{name}: {failure}")

    def _verdict(self, got, want, ref, real, bound) -> str | None:
        """The rule of ``values`` on the positions of ``real`` (None: all): None when they pass, else why not."""
        err, at = per_position_err(got, want, real)
        if err <= bound:
            return None
        if self.dtype == torch.float32:
            fused_err, _ = per_position_err(got, ref, real) if ref is not None else (math.inf, None)
            stock_err, _ = per_position_err(want, ref, real) if ref is not None else (0.0, None)
            if fused_err > FP32_FACTOR * stock_err:
                return (f"rel. error {err:.3g} at (row, position) {at} > {bound:g}; from the float64 answer fused "
                        f"{fused_err:.3g} > {FP32_FACTOR:g} x stock's {stock_err:.3g}")
            return None
        fused_err, _ = per_position_err(got.float(), ref.float(), real)
        stock_err, _ = per_position_err(want.float(), ref.float(), real)
        if fused_err > LOW_PRECISION_FACTOR * stock_err:
            return (f"{err:.3g} from stock at {at}; from the fp32 answer fused {fused_err:.3g} > "
                    f"{LOW_PRECISION_FACTOR:g} x stock's {stock_err:.3g}")
        return None

    def _ties_of(self, got: torch.Tensor, mask=None, before: bool = False):
        """A [B, T] mask of the last call (the router ties; or ``mask``) cut to ``got``'s positions (``logits_to_keep``
        keeps the last); with ``before``, a row marked before them is marked at their first."""
        mask = self.ties if mask is None and not before else mask
        if mask is None or mask.shape[0] != got.shape[0] or mask.shape[1] < got.shape[1]:
            return None
        cut = mask.shape[1] - got.shape[1]
        out = mask[:, cut:].clone()
        if before and cut:
            out[:, 0] |= mask[:, :cut].any(dim=1)
        return out

    def tokens(self, name: str, got: torch.Tensor, want: torch.Tensor, step_logits=None) -> None:
        """Generated tokens: they may part only at a step whose logits pass ``values``, and only to a token whose stock
        logit is within 2x the rounding at hand of stock's best (the fused-to-stock logit difference; in 16 bits also
        stock's own error from the float32 answer): a near-tie
        (``step_logits(row, position)``: fused, stock and float32-answer logits [1, 1, vocab] over the common
        prefix)."""
        self.checks += 1
        n = min(got.shape[-1], want.shape[-1])
        if got.shape[:-1] != want.shape[:-1]:
            self.failures.append(f"{name}: {tuple(got.shape)} tokens, stock {tuple(want.shape)}")
            return
        parted = got[:, :n] != want[:, :n]
        if not parted.any():
            if got.shape != want.shape:  # the same tokens, and one stopped where the other went on
                self.failures.append(f"{name}: {tuple(got.shape)} tokens, stock {tuple(want.shape)}, equal over the "
                                     "common length")
            return
        # each row that parts is judged at its first parting (a near-tie there may also end one side early, at an EOS,
        # so the lengths may differ); what follows a parting depends on it and is not compared
        for row in parted.any(dim=1).nonzero().flatten().tolist():
            pos = int(parted[row].nonzero()[0])
            if step_logits is None:
                self.failures.append(f"{name}: row {row} parts from stock at position {pos} ({int(got[row, pos])} vs "
                                     f"{int(want[row, pos])})")
                continue
            g, w, a = step_logits(row, pos)
            failed = len(self.failures)
            self.values(f"{name}: logits where row {row} parts from stock (position {pos})", g, w, a)
            if len(self.failures) == failed:
                # the fused token must be one of stock's best within the rounding at hand: the fused-to-stock logit
                # difference, or stock's own error from the answer (16 bits)
                w64 = w.double().flatten()
                margin = float(w64.max() - w64[int(got[row, pos])])
                tol = float((g.double() - w.double()).abs().max())
                if a is not None and self.dtype != torch.float32:
                    tol = max(tol, float((w.double() - a.double()).abs().max()))
                if margin > 2 * tol:
                    self.failures.append(f"{name}: row {row} parts from stock at position {pos} with token "
                                         f"{int(got[row, pos])}, whose stock logit is {margin:.3g} below stock's best "
                                         f"(> 2 x the rounding there, {tol:.3g})")

    def equal(self, name: str, got, want) -> None:
        self.checks += 1
        if got != want:
            self.failures.append(f"{name}: {got!r} != stock's {want!r}")


def _cache_states(cache, types):
    out = []
    for i, kind in enumerate(types):
        layer = cache.layers[i]
        if kind == "linear_attention":
            out += [(f"layer {i} conv", layer.conv_states[0]), (f"layer {i} recurrent", layer.recurrent_states[0])]
        else:
            out += [(f"layer {i} keys", layer.keys), (f"layer {i} values", layer.values)]
    return out


class StockRefuses(Exception):
    """Stock raised on the case's call: the case is not a valid call, so it compares nothing."""


# -- running -----------------------------------------------------------------------------------------------------


def run_case(case: dict) -> list[str]:
    """Run one case (stock and fused on the same weights and inputs); returns the failures (empty: it passed)."""
    device = torch.device(case["device"])
    plan_mod.EMULATE_ON_CPU = device.type == "cpu"
    stock, fused, ref = build_pair(case, device)
    if not fused.fused_plan.fused:
        return [f"the fused path does not run: {fused.fused_plan.reason}"]
    call, types = case["call"], case["config"]["layer_types"]
    check = Compare(case, device)
    ids, mask = make_inputs(call, case["config"]["vocab_size"], device)
    real = None if mask is None else mask.bool()
    kind = call["kind"]
    cache_kw = compat.GENERATE_CACHE_KW

    ieee = check.dtype == torch.float32 or device.type == "cpu"

    exact = float64_stock if check.dtype == torch.float32 else contextlib.nullcontext

    def both(fn):
        with torch.inference_mode():
            stock_ids, fused_ids, stock_probs, answer_probs = [], [], [], []
            with stock_reference(ieee), router_choices(stock, stock_ids), router_probs(stock, stock_probs):
                try:
                    want = fn(stock)
                except Exception as err:  # noqa: BLE001 - not a valid call: nothing to compare
                    raise StockRefuses(f"{type(err).__name__}: {err}") from err
            gaps = []
            with stock_reference(True), exact(), router_gaps(ref, gaps), router_probs(ref, answer_probs):
                answer = fn(ref)
            check.ties = router_ties(gaps, stock_probs, answer_probs, ROUTER_TIE[check.dtype])
            if check.ties is not None:
                check.tied_tokens += int(check.ties.sum())
            with router_choices(fused, fused_ids):
                got = fn(fused)
            check.apart = None if check.ties is None else check.ties & routed_apart(stock_ids, fused_ids,
                                                                                   check.ties.shape)
            return got, want, answer

    if kind in ("forward", "forward_padded", "hidden_states"):
        kw = {"input_ids": ids, "attention_mask": mask, "use_cache": call.get("use_cache", False)}
        keep = call.get("logits_to_keep", 0)
        if keep:
            kw["logits_to_keep"] = keep
        if call.get("position_ids"):
            kw["position_ids"] = torch.arange(ids.shape[1], device=device).expand_as(ids) + 3
        if kind == "hidden_states":
            kw["output_hidden_states"] = True
        got, want, answer = both(lambda m: m(**kw))
        sel = real if not keep or real is None else real[:, -keep:]
        check.values("logits", got.logits, want.logits, None if answer is None else answer.logits, sel)
        if kind == "hidden_states":
            check.equal("hidden states returned", len(got.hidden_states), len(want.hidden_states))
            for i, (g, w) in enumerate(zip(got.hidden_states, want.hidden_states)):
                a = None if answer is None else answer.hidden_states[i]
                check.values(f"hidden state {i}", g, w, a, real)
    elif kind in ("forward_cache", "continue"):
        kw = {"input_ids": ids, "attention_mask": mask, "use_cache": True}
        got, want, answer = both(lambda m: m(**kw))
        check.values("logits", got.logits, want.logits, None if answer is None else answer.logits, real)
        gc, wc = (getattr(o, compat.OUTPUT_CACHE_FIELD) for o in (got, want))
        check.equal("cache length", compat._seq_length(gc, None), compat._seq_length(wc, None))
        ac = None if answer is None else getattr(answer, compat.OUTPUT_CACHE_FIELD)
        for (name, g), (_, w), a in zip(_cache_states(gc, types), _cache_states(wc, types),
                                        _cache_states(ac, types) if ac is not None else [(None, None)] * 99):
            check.values(name, g, w, a[1], whole=True)
        if kind == "continue":
            g2 = torch.Generator().manual_seed(call["data_seed"] + 1)
            more = torch.randint(3, case["config"]["vocab_size"], (ids.shape[0], call["more"]), generator=g2)
            more = more.to(device)
            mask2 = None if mask is None else torch.cat([mask, torch.ones_like(more)], 1)
            caches = {id(fused): gc, id(stock): wc}
            if ref is not None:
                caches[id(ref)] = ac

            def step(m):
                return m(input_ids=more, attention_mask=mask2, use_cache=True, **{cache_kw: caches[id(m)]})

            got, want, answer = both(step)
            check.values("continued logits", got.logits, want.logits, None if answer is None else answer.logits)
    elif kind == "speculative":
        _speculative_call(case, check, stock, fused, ids, both)
    elif kind == "batch":
        _batch_call(case, check, stock, fused, device, both)
    else:  # generate / sample
        kw = {"input_ids": ids, "attention_mask": mask if mask is not None else torch.ones_like(ids),
              "max_new_tokens": call["new_tokens"], "do_sample": kind == "sample", "pad_token_id": 0}
        if call.get("stop_token"):
            kw["eos_token_id"] = int(ids[0, -1]) % case["config"]["vocab_size"]
        if kind == "sample":
            kw.update(top_k=0, temperature=1.0)

        def gen(m):
            torch.manual_seed(call["data_seed"])
            return m.generate(**kw)

        got, want, _ = both(gen)

        def step_logits(row, pos):
            """The three models' next-token logits after the prefix the rows share up to ``pos``."""
            seq = want[row:row + 1, :pos]
            seq_mask = torch.cat([kw["attention_mask"][row:row + 1], torch.ones_like(seq[:, ids.shape[1]:])], 1)
            got, want_, answer = both(lambda m: m(input_ids=seq, attention_mask=seq_mask, use_cache=False))
            return got.logits[:, -1:], want_.logits[:, -1:], answer.logits[:, -1:]

        check.tokens("generated tokens", got, want, step_logits)
    return check.failures


def _greedy_steps(both, prompt_len: int, want: torch.Tensor):
    """``Compare.tokens``' ``step_logits`` for greedy rows ``want`` [B, prompt + new] of unpadded prompts."""
    def step_logits(row, pos):
        seq = want[row:row + 1, :pos]
        got, want_, answer = both(lambda m: m(input_ids=seq, use_cache=False))
        return got.logits[:, -1:], want_.logits[:, -1:], answer.logits[:, -1:]
    return step_logits


def _speculative_call(case, check, stock, fused, ids, both) -> None:
    """Speculative greedy ``generate`` (k drafts a round from the fused model's MTP head, a share replaced by stock's
    own next tokens; the verify pass's attention per token or at once, drawn) against stock's plain greedy
    ``generate``: the tokens, as for ``generate``."""
    override_drafts = import_module("fused_speculative").override_drafts
    call, vocab = case["call"], case["config"]["vocab_size"]
    kw = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "max_new_tokens": call["new_tokens"],
          "do_sample": False, "pad_token_id": 0}
    if call.get("stop_token"):
        kw["eos_token_id"] = int(ids[0, -1]) % vocab
    with torch.inference_mode(), stock_reference(check.dtype == torch.float32 or ids.device.type == "cpu"):
        want = stock.generate(**kw)
    g = torch.Generator().manual_seed(call["data_seed"])

    def oracle(drafts, input_ids):  # stock's token at a draft's position with probability `hit`, else another one
        at = input_ids.shape[1]
        ref = want[:, at:at + drafts.shape[1]].to(drafts.device)
        right = (torch.rand(ref.shape[1], generator=g) < call["hit"]).to(drafts.device)
        out = drafts.clone()
        out[:, :ref.shape[1]] = torch.where(right, ref, (ref + 1) % vocab)
        return out

    decode_mod = import_module("fused_decode")
    saved = decode_mod.VERIFY_ATTENTION_AT_ONCE
    decode_mod.VERIFY_ATTENTION_AT_ONCE = call.get("attention_at_once", saved)
    try:
        with torch.inference_mode(), override_drafts(oracle):
            got = fused.generate(**kw, mtp_speculative_tokens=call["drafts"])
    finally:
        decode_mod.VERIFY_ATTENTION_AT_ONCE = saved
    check.tokens("speculative tokens", got, want, _greedy_steps(both, ids.shape[1], want))


def _batch_call(case, check, stock, fused, device, both) -> None:
    """``generate_batch`` (greedy; rows, per-request token counts, prefill chunk, ``PREFILL_GROUP`` and whether the
    groups and their wait run at the drawn rows) against stock's greedy ``generate`` of each prompt alone: each request's tokens, as
    for ``generate``."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    call, vocab = case["call"], case["config"]["vocab_size"]
    g = torch.Generator().manual_seed(call["data_seed"])
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in call["lengths"]]
    batch_mod = import_module("fused_batch")
    saved = batch_mod.PREFILL_GROUP, batch_mod.GROUP_HOLD_GROUPS
    batch_mod.PREFILL_GROUP = call.get("group", batch_mod.PREFILL_GROUP)
    if call.get("hold"):  # the drawn rows are few: groups (and the free rows' wait for one) at any row count
        batch_mod.GROUP_HOLD_GROUPS = 0
    try:
        out = fused.generate_batch(
            prompts, generation_config=GenerationConfig(do_sample=False, pad_token_id=0),
            max_new_tokens=list(call["new_tokens"]), prefill_chunk=call["chunk"],
            continuous_batching_config=ContinuousBatchingConfig(max_requests_per_batch=call["rows"]))
    finally:
        batch_mod.PREFILL_GROUP, batch_mod.GROUP_HOLD_GROUPS = saved
    for i, (prompt, new) in enumerate(zip(prompts, call["new_tokens"])):
        ids = torch.tensor([prompt], device=device)
        with torch.inference_mode(), stock_reference(check.dtype == torch.float32 or device.type == "cpu"):
            want = stock.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                  do_sample=False, pad_token_id=0)
        result = out.get(f"req_{i}")
        if result is None or result.error is not None:
            check.failures.append(f"request {i}: {'missing' if result is None else result.error}")
            continue
        got = torch.cat([ids, torch.tensor([result.generated_tokens], device=device)], 1)
        check.tokens(f"request {i} tokens", got, want, _greedy_steps(both, ids.shape[1], want))


# -- shrinking ---------------------------------------------------------------------------------------------------


def _shrinks(case: dict):
    """Smaller cases to try, most reducing first."""
    cfg, call = case["config"], case["call"]
    layers = cfg["num_hidden_layers"]
    for i in range(layers):
        if layers > 1:
            c = copy.deepcopy(case)
            c["config"]["layer_types"].pop(i)
            c["config"]["num_hidden_layers"] -= 1
            if "full_attention" in c["config"]["layer_types"]:
                yield c
    for key, smaller in (("batch", lambda b: b - 1), ("more", lambda m: 1), ("new_tokens", lambda n: max(1, n // 2))):
        if call.get(key, 1) > 1:
            c = copy.deepcopy(case)
            c["call"][key] = smaller(call[key])
            yield c
    for key in ("hidden_size", "intermediate_size", "vocab_size", "moe_intermediate_size",
                "shared_expert_intermediate_size", "num_experts"):
        if cfg.get(key, 0) > 16 and not (key == "num_experts" and cfg[key] // 2 < cfg.get("num_experts_per_tok", 0)):
            c = copy.deepcopy(case)
            c["config"][key] //= 2
            yield c
    for key, floor in (("linear_num_value_heads", cfg["linear_num_key_heads"]), ("num_attention_heads", 1),
                       ("linear_key_head_dim", 16), ("linear_value_head_dim", 16)):
        if cfg[key] > floor:
            c = copy.deepcopy(case)
            c["config"][key] //= 2
            if key == "num_attention_heads":
                c["config"]["num_key_value_heads"] = min(cfg["num_key_value_heads"], c["config"][key])
            if key == "linear_num_value_heads" and c["config"][key] % cfg["linear_num_key_heads"]:
                continue
            yield c
    if call["length"] > 64:  # shorter, keeping the length's place in its 64-token chunk
        c = copy.deepcopy(case)
        c["call"]["length"] -= 64
        yield c


def shrink(case: dict, failures: list[str], budget: int = 40, log=print) -> tuple[dict, list[str]]:
    """Greedy shrinking: take the first smaller case that still fails, until none does (or ``budget`` runs)."""
    runs = 0
    improved = True
    while improved and runs < budget:
        improved = False
        for smaller in _shrinks(case):
            runs += 1
            try:
                got = run_case(smaller)
            except StockRefuses:
                got = []
            except Exception as err:  # noqa: BLE001 - an exception is a failure too
                got = [f"raised {type(err).__name__}: {err}"]
            if got and _check_name(got[0]) == _check_name(failures[0]):  # the same check still fails
                case, failures, improved = smaller, got, True
                log(f"  shrunk: {describe(case)}")
                break
            if runs >= budget:
                break
    return case, failures


def _check_name(failure: str) -> str:
    return failure.split(":", 1)[0]


# -- the run -----------------------------------------------------------------------------------------------------


def describe(case: dict) -> str:
    c, call = case["config"], case["call"]
    heads = f"H{c['num_attention_heads']}/{c['num_key_value_heads']}x{c['head_dim']}"
    lin = (f"lin{c['linear_num_key_heads']}:{c['linear_num_value_heads']}x{c['linear_key_head_dim']}/"
           f"{c['linear_value_head_dim']}")
    layers = "".join("L" if t == "linear_attention" else "F" for t in c["layer_types"])
    moe = f" E{c['num_experts']}k{c['num_experts_per_tok']}" if case["moe"] else ""
    return (f"seed {case['seed']} {case['dtype']} {call['kind']} B{call['batch']} T{call['length']} "
            f"pad={call['padding']} d{c['hidden_size']} {heads} {lin} {layers}{moe}")


def replay_command(case: dict) -> str:
    return f"python scripts/fuzz_vs_stock.py --replay '{json.dumps(case, separators=(',', ':'))}'"


def coverage_table(cases: list[dict]) -> str:
    """What the run drew: lengths by their place in a 64-token chunk, head counts, dtypes, call kinds, MoE."""
    def place(t):
        r = t % 64
        return {0: "0 (edge)", 1: "1 (edge+1)", 63: "63 (edge-1)"}.get(r, "other")

    rows = {
        "length mod 64": Counter(place(c["call"]["length"]) for c in cases),
        "attention heads / kv": Counter(f"{c['config']['num_attention_heads']}/{c['config']['num_key_value_heads']}"
                                        for c in cases),
        "linear heads k:v": Counter(f"{c['config']['linear_num_key_heads']}:{c['config']['linear_num_value_heads']}"
                                    for c in cases),
        "dtype": Counter(c["dtype"] for c in cases),
        "call": Counter(c["call"]["kind"] for c in cases),
        "padding": Counter(str(c["call"]["padding"]) for c in cases),
        "model": Counter("MoE" if c["moe"] else "dense" for c in cases),
    }
    spec = [c["call"] for c in cases if c["call"]["kind"] == "speculative"]
    if spec:
        rows["verify attention (speculative)"] = Counter(
            "at once" if c.get("attention_at_once") else "per token" for c in spec)
    lines = ["| what | drawn (cases) |", "|---|---|"]
    for name, counts in rows.items():
        lines.append(f"| {name} | " + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())) + " |")
    return "\n".join(lines)


def search(seed: int, device: str, minutes: float | None = None, cases: int | None = None, dtypes=tuple(DTYPES),
           moe: float = 0.3, max_len: int = 700, kinds=CALL_KINDS, shrink_budget: int = 40, pool: int = 0,
           log=print) -> dict:
    """Draw and run cases from ``seed`` on until ``minutes`` or ``cases`` is reached (configs from a pool of ``pool``
    when not 0); returns the summary (failures with their shrunk case and replay command, the cases drawn, the
    rate)."""
    start, drawn, failures, refused = time.monotonic(), [], [], []
    rng = random.Random(seed)
    configs = config_pool(pool, moe) if pool else None
    while (cases is None or len(drawn) < cases) and (minutes is None or time.monotonic() - start < minutes * 60):
        case = draw_case(rng.randrange(1 << 31), device, dtypes, moe, max_len, kinds, configs)
        try:
            found = run_case(case)
        except StockRefuses as err:
            refused.append(f"{describe(case)}: {err}")
            continue
        except Exception as err:  # noqa: BLE001 - an exception where stock answers is a failure too
            found = [f"raised {type(err).__name__}: {err}"]
        drawn.append(case)
        if found:
            log(f"FAIL {describe(case)}: {found[0]}")
            small, small_found = shrink(case, found, shrink_budget, log) if shrink_budget else (case, found)
            failures.append({"case": case, "failures": found, "shrunk": small, "shrunk_failures": small_found,
                             "command": replay_command(small)})
            log(f"  reproduce: {replay_command(small)}")
        elif len(drawn) % 25 == 0:
            log(f"{len(drawn)} cases, {len(failures)} failing, {(time.monotonic() - start) / 60:.1f} min")
    elapsed = time.monotonic() - start
    return {"cases": len(drawn), "failures": failures, "stock_refused": refused, "minutes": elapsed / 60,
            "per_minute": len(drawn) / max(elapsed / 60, 1e-9), "coverage": coverage_table(drawn), "drawn": drawn}


def emulation_check(seed: int, minutes: float | None, cases: int | None, pool: int = 48, log=print) -> dict:
    """The CPU emulation against the GPU path on the same fp32 cases (configs from a pool of ``pool``): the fused
    logits of both devices agree on every real position (so a CPU pass says something about the GPU): within
    ``FP32_BOUND``, or, in an ill-conditioned case, within 2 x ``FP32_FACTOR`` x stock's own fp32 error from the
    float64 answer."""
    start, rng, done, bad = time.monotonic(), random.Random(seed), 0, []
    configs = config_pool(pool, 0.3) if pool else None
    while (cases is None or done < cases) and (minutes is None or time.monotonic() - start < minutes * 60):
        case = draw_case(rng.randrange(1 << 31), "cuda", ("fp32",), kinds=("forward", "forward_padded"),
                         pool=configs)
        outs = {}
        for device in ("cuda", "cpu"):
            c = dict(case, device=device)
            plan_mod.EMULATE_ON_CPU = device == "cpu"
            stock, fused, ref = build_pair(c, torch.device(device))
            ids, mask = make_inputs(c["call"], c["config"]["vocab_size"], device)
            with torch.inference_mode():
                outs[device] = fused(input_ids=ids, attention_mask=mask, use_cache=False).logits.float().cpu()
                if device == "cpu":  # how far fp32 rounding moves this case: stock's fp32 from the float64 answer
                    with stock_reference(True):
                        want = stock(input_ids=ids, attention_mask=mask).logits
                        with float64_stock():
                            answer = ref(input_ids=ids, attention_mask=mask).logits
        real = None if mask is None else mask.bool()
        err, at = per_position_err(outs["cpu"], outs["cuda"], real)
        done += 1
        if err > FP32_BOUND["cuda"]:  # past the bound: more than the case's own conditioning allows?
            stock_err, _ = per_position_err(want, answer, real)
            if err > 2 * FP32_FACTOR * stock_err:  # each side may be FP32_FACTOR x stock's error from the answer
                bad.append({"case": case, "err": err, "at": at, "stock_err": stock_err})
                log(f"EMULATION DIFFERS {describe(case)}: {err:.3g} at {at} (stock's own fp32 error {stock_err:.3g})")
    return {"cases": done, "differing": bad}


def run_workers(argv: list[str], workers: int, seed: int, log=print) -> dict:
    """``workers`` searches of this script side by side, worker i from seed ``seed * 100 + i`` (so two runs with
    different seeds never overlap), each on ``cpu_count // workers`` threads; their summaries merged: cases, rate,
    failures, and one coverage table over every case drawn."""
    threads = str(max(1, (os.cpu_count() or 1) // workers))
    env = dict(os.environ, OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, PYTHONUNBUFFERED="1")
    rest, skip = [], False
    for i, a in enumerate(argv):  # this run's arguments, less those the workers are given their own of
        if skip:
            skip = False
        elif a in ("--workers", "--seed", "--out"):
            skip = True
        elif not a.startswith(("--workers=", "--seed=", "--out=")):
            rest.append(a)
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for i in range(workers):
            out = Path(tmp) / f"worker{i}.json"
            cmd = [sys.executable, __file__, *rest, "--seed", str(seed * 100 + i), "--out", str(out), "--drawn"]
            procs.append((out, subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                text=True)))
        # each worker's failures and progress lines passed on as they come, so that a run cut short (a device call's
        # time limit) still shows what it found and how far it got
        texts = [[] for _ in procs]

        def relay(i, proc):
            for line in proc.stdout:
                texts[i].append(line.rstrip("\n"))
                if line.startswith(("FAIL", "  reproduce:", "  shrunk:")) or " cases, " in line:
                    log(f"[worker {i}] {line.rstrip()}")
                    sys.stdout.flush()

        readers = [threading.Thread(target=relay, args=(i, proc), daemon=True) for i, (_, proc) in enumerate(procs)]
        for reader in readers:
            reader.start()
        parts = []
        for i, (out, proc) in enumerate(procs):
            proc.wait()
            readers[i].join()
            if not out.exists():
                raise RuntimeError(f"fuzz worker {i} (seed {seed * 100 + i}) ended without a summary (exit "
                                   f"{proc.returncode}); its output ends:\n" + "\n".join(texts[i][-20:]))
            parts.append(json.loads(out.read_text()))
    drawn = [c for p in parts for c in p["drawn"]]
    minutes = max(p["minutes"] for p in parts)
    return {"cases": len(drawn), "failures": [f for p in parts for f in p["failures"]],
            "stock_refused": [r for p in parts for r in p["stock_refused"]], "minutes": minutes,
            "worker_minutes": sum(p["minutes"] for p in parts), "workers": workers,
            "per_minute": len(drawn) / max(minutes, 1e-9), "coverage": coverage_table(drawn), "drawn": drawn}


@contextlib.contextmanager
def reference_ops(names, kernels=None, refs=None):
    """Inside the block, the fused path's ops ``names`` (of ``fused_ops.KERNEL_OPS``) run their torch references in
    place of the kernels (every plan reads the one namespace ``kernels``, ``fused_plan.KERNELS`` by default; the
    references from ``refs``, ``fused_plan.REFERENCES``)."""
    kernels = plan_mod.KERNELS if kernels is None else kernels
    refs = plan_mod.REFERENCES if refs is None else refs
    saved = {n: getattr(kernels, n) for n in names}
    try:
        for n in names:
            setattr(kernels, n, getattr(refs, n))
        yield
    finally:
        for n, fn in saved.items():
            setattr(kernels, n, fn)


def bisect_ops(case: dict, log=print, kernels=None, refs=None) -> dict:
    """Replay ``case`` (on the GPU) with the kernels, then with each op of the fused path on its torch reference
    alone, then with all of them, then (on a GPU) with every SDPA call on its math backend: which change makes a
    failure go away says which kernel adds it. Returns variant -> the first failure (None: passes). ``kernels`` /
    ``refs`` as for ``reference_ops``."""
    names = list(vars(plan_mod.KERNELS if kernels is None else kernels))
    variants = [("kernels", [], False)] + [(n, [n], False) for n in names] + [("all references", names, False)]
    if torch.cuda.is_available():  # SDPA is stock's call, not one of the ops: its math backend for the fused path too
        variants.append(("SDPA math backend", [], True))
    out = {}
    for variant, swap, math_sdpa in variants:
        with reference_ops(swap, kernels, refs), (_math_sdpa() if math_sdpa else contextlib.nullcontext()):
            try:
                found = run_case(case)
            except Exception as err:  # noqa: BLE001 - reported as the variant's failure
                found = [f"raised {type(err).__name__}: {err}"]
        out[variant] = found[0] if found else None
        log(f"  {variant:>26}: {'pass' if not found else found[0][:150]}")
    return out


def _math_sdpa():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.MATH])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, help="run for this long")
    parser.add_argument("--cases", type=int, help="run this many cases (each worker)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cuda (the fused kernels) or cpu (their torch references, the tests' emulation)")
    parser.add_argument("--dtypes", default="fp32,bf16,fp16", help="comma-separated of fp32, bf16, fp16")
    parser.add_argument("--moe", type=float, default=0.3, help="share of MoE cases")
    parser.add_argument("--max-len", type=int, default=700, help="longest input drawn")
    parser.add_argument("--kinds", default=",".join(CALL_KINDS), help="call kinds drawn")
    parser.add_argument("--shrink", type=int, default=40, help="runs the shrinker may spend on each failure")
    parser.add_argument("--pool", type=int, help="draw configs from this many fixed ones (0: a new config a case; "
                        "default 0 on cpu, 48 on cuda, where each new config compiles its kernels)")
    parser.add_argument("--replay", help="run this one case (JSON, as a failure prints it)")
    parser.add_argument("--bisect-ops", action="store_true", help="with --replay: run it again with each fused op on "
                        "its torch reference in turn (which kernel adds the error)")
    parser.add_argument("--emulation-check", action="store_true", help="CPU emulation against the GPU, fp32")
    parser.add_argument("--workers", type=int, default=1, help="run this many searches side by side (seeds "
                        "seed*100 + i) and merge their summaries")
    parser.add_argument("--out", help="write the summary as JSON here")
    parser.add_argument("--drawn", action="store_true", help=argparse.SUPPRESS)  # a worker's summary keeps its cases
    args = parser.parse_args(argv)
    if args.replay:
        case = json.loads(args.replay)
        if args.bisect_ops:
            print(describe(case))
            out = bisect_ops(case)
            return 1 if out["kernels"] else 0
        found = run_case(case)
        print(describe(case), "->", "pass" if not found else "FAIL\n  " + "\n  ".join(found))
        return 1 if found else 0
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a GPU; pass --device cpu for the CPU emulation")
    if args.minutes is None and args.cases is None:
        parser.error("say how long: --minutes N or --cases N")
    if args.emulation_check:
        out = emulation_check(args.seed, args.minutes, args.cases, args.pool if args.pool is not None else 48)
        print(f"emulation check: {out['cases']} cases, {len(out['differing'])} differing")
        return 1 if out["differing"] else 0
    dtypes = tuple(args.dtypes.split(","))
    pool = args.pool if args.pool is not None else (48 if args.device == "cuda" else 0)
    if args.workers > 1:
        out = run_workers(sys.argv[1:] if argv is None else list(argv), args.workers, args.seed)
        runs = (f"{args.workers} workers, {out['worker_minutes']:.1f} worker-minutes in {out['minutes']:.1f} min "
                f"({out['per_minute']:.1f} cases a minute)")
    else:
        out = search(args.seed, args.device, args.minutes, args.cases, dtypes, args.moe, args.max_len,
                     tuple(args.kinds.split(",")), args.shrink, pool)
        runs = f"{out['minutes']:.1f} min ({out['per_minute']:.1f} a minute)"
    print(f"\n{out['cases']} cases in {runs} on {args.device}, seed {args.seed}: {len(out['failures'])} failing "
          f"({len(out['stock_refused'])} drawn calls stock itself refuses were not counted)\n")
    print(out["coverage"])
    for f in out["failures"]:
        print(f"\nFAIL {describe(f['case'])}\n  {f['failures'][0]}\n  shrunk to {describe(f['shrunk'])}: "
              f"{f['shrunk_failures'][0]}\n  {f['command']}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        keep = {k: v for k, v in out.items() if k != "drawn" or args.drawn}
        Path(args.out).write_text(json.dumps(keep, indent=2))
    return 1 if out["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
