"""Tests of the fused ops in `fused_ops.py` against the stock transformers Qwen3.5 code, and against each op's `_ref`.

CPU tests run the Triton kernels under the interpreter (`TRITON_INTERPRET=1`, set in conftest.py), which costs
about 20-40 ms per program, so their shapes are tiny (the whole file takes about 30 s). The `@pytest.mark.cuda` tests
run the real head shapes on a GPU: `python -m pytest tests/ops/test_fused_ops.py -m cuda`.

Error bounds (relative, `helpers.rel_err`; `BOUNDS["kernel"]` in helpers.py), and why:
- fp32 <= 1e-6: the kernels sum squares in another order than torch and, on the GPU, use approximate rsqrt / exp /
  division; that moves results by a few fp32 units in the last place (~1e-7).
- bf16 <= 1e-2, fp16 <= 1e-3: the kernels round to the dtype at every step where stock does, so the only
  differences are the fp32 wobbles above flipping a rounding decision now and then, which changes an element by
  one unit in the last place: at most 2^-7 (bf16) or 2^-10 (fp16) of its value. The bounds would allow every
  output element to be one unit off; the few flips seen sit far below (measured on CPU: 0 to 1e-5).
- Pure copies (v, gate, the residual sum `h`) must be bit-exact.
"""

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from helpers import BOUNDS, DTYPE_IDS, DTYPES, assert_close, assert_exact, compile_for_sm90, fused_ops
from helpers import needs_interpreter
from transformers import AttentionInterface
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    Qwen3_5Attention,
    Qwen3_5MLP,
    Qwen3_5RMSNorm,
    Qwen3_5TextRotaryEmbedding,
)

REPO = Path(__file__).resolve().parents[2]
BOUND = BOUNDS["kernel"]
EPS = 1e-6


@pytest.fixture(autouse=True)
def _needs_triton(request):
    if not fused_ops.HAS_TRITON and request.node.originalname != "test_import_without_triton":
        pytest.skip("triton is not installed")


def poison(device, *shapes_dtypes) -> None:
    """Best effort: leave NaN-filled blocks of the outputs' sizes in the allocator's cache, so the op's
    `torch.empty` outputs likely start as NaN and an element it never writes shows up as NaN."""
    blocks = [torch.full(shape, float("nan"), dtype=dtype, device=device) for shape, dtype in shapes_dtypes]
    del blocks


def randn(*shape, dtype, device, row_pad=0):
    """Standard-normal [..., N]; with `row_pad`, a view of a [..., N + row_pad] buffer (row stride != N)."""
    if not row_pad:
        return torch.randn(*shape, dtype=dtype, device=device)
    buf = torch.randn(*shape[:-1], shape[-1] + row_pad, dtype=dtype, device=device)
    return buf[..., : shape[-1]]


def text_config(hidden, heads, kv_heads, head_dim, rotary_dim, intermediate=64):
    half = rotary_dim // 2
    return Qwen3_5TextConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        num_hidden_layers=4,
        rms_norm_eps=EPS,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": rotary_dim / head_dim,
            "mrope_section": [half - 2 * (half // 3), half // 3, half // 3],
            "mrope_interleaved": True,
        },
    )


# ---------------------------------------------------------------------------------------------------------------------
# Stock attention with a capturing attention function: it records the q / k / v stock hands to attention and returns
# the attention output the test chose, so with `o_proj` replaced by Identity the stock forward returns
# `o * sigmoid(gate)`.
# ---------------------------------------------------------------------------------------------------------------------

_CAPTURE = "fused_ops_test_capture"
_captured = {}


def _capture_attention(module, query, key, value, attention_mask, **kwargs):
    _captured.update(q=query, k=key, v=value)
    return _captured["o"], None


AttentionInterface.register(_CAPTURE, _capture_attention)


def stock_attention(device, dtype, H, KV, D, R, hidden=None):
    cfg = text_config(hidden or H * D, H, KV, D, R)
    cfg._attn_implementation = _CAPTURE
    attn = Qwen3_5Attention(cfg, layer_idx=3)
    with torch.no_grad():
        attn.q_norm.weight.normal_(0, 0.1)
        attn.k_norm.weight.normal_(0, 0.1)
    attn.o_proj = nn.Identity()
    return cfg, attn.to(device=device, dtype=dtype)


def stock_rope(cfg, B, T, dtype, device, cos_batch1=False):
    """cos / sin [B or 1, T, R] from the stock rotary embedding, with distinct t / h / w mRoPE positions."""
    rope = Qwen3_5TextRotaryEmbedding(cfg).to(device)
    pos = torch.randint(0, 4 * T + 8, (3, 1 if cos_batch1 else B, T), device=device)
    return rope(torch.empty(0, dtype=dtype, device=device), pos)


# ---------------------------------------------------------------------------------------------------------------------
# Shared checks (CPU and CUDA tests call the same ones with different sizes)
# ---------------------------------------------------------------------------------------------------------------------


def check_rms_norm(device, dtype, B, T, N, residual=False, row_pad=0, weight_dtype=None):
    torch.manual_seed(0)
    stock = Qwen3_5RMSNorm(N, eps=EPS).to(device=device, dtype=weight_dtype or dtype)
    with torch.no_grad():
        stock.weight.normal_(0, 0.1)
    x = randn(B, T, N, dtype=dtype, device=device, row_pad=row_pad)
    r = randn(B, T, N, dtype=dtype, device=device, row_pad=row_pad) if residual else None

    poison(device, ((B, T, N), dtype), ((B, T, N), dtype))
    with torch.no_grad():
        out = fused_ops.rms_norm(x, stock.weight, EPS, residual=r)
        ref = fused_ops.rms_norm_ref(x, stock.weight, EPS, residual=r)
        if residual:
            h_stock = r + x  # stock `hidden_states = residual + hidden_states`
            y_stock = stock(h_stock)
        else:
            y_stock = stock(x)

    if residual:
        (y, h), (y_ref, h_ref) = out, ref
        assert_exact("h vs stock residual + x", h, h_stock)
        assert_exact("h vs ref", h, h_ref)
        assert h.is_contiguous()
    else:
        y, y_ref = out, ref
    assert y.is_contiguous()
    assert_close("y vs stock Qwen3_5RMSNorm", y, y_stock, BOUND)
    assert_close("y vs rms_norm_ref", y, y_ref, BOUND)


def check_attn_prep(device, dtype, B, T, H, KV, D, R, row_pad=0, cos_batch1=False, hidden=None):
    torch.manual_seed(0)
    cfg, attn = stock_attention(device, dtype, H, KV, D, R, hidden)
    x = torch.randn(B, T, cfg.hidden_size, dtype=dtype, device=device)
    cos, sin = stock_rope(cfg, B, T, dtype, device, cos_batch1)
    with torch.no_grad():
        fused = torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], dim=-1)  # [B, T, H*2*D + 2*KV*D]
    qkv = randn(*fused.shape, dtype=dtype, device=device, row_pad=row_pad)
    qkv.copy_(fused)

    poison(device, *[((B, T, n, D), dtype) for n in (H, KV, KV, H)])
    q, k, v, gate = fused_ops.attn_prep(qkv, cos, sin, attn.q_norm.weight, attn.k_norm.weight, EPS, H, KV, D)
    q_ref, k_ref, v_ref, gate_ref = fused_ops.attn_prep_ref(
        qkv, cos, sin, attn.q_norm.weight, attn.k_norm.weight, EPS, H, KV, D
    )
    _captured["o"] = torch.zeros(B, T, H, D, dtype=dtype, device=device)
    with torch.no_grad():
        attn(x, (cos, sin), None)  # fills _captured with the stock q, k, v
        gate_stock = attn.q_proj(x).view(B, T, H, 2 * D)[..., D:].reshape(B, T, H * D)  # stock's chunk of q_proj

    for name, got, n in (("q", q, H), ("k", k, KV), ("v", v, KV)):
        assert got.shape == (B, n, T, D), f"{name}: shape {tuple(got.shape)}"
        # stock hands attention v as this view too (q and k it hands as contiguous [B, heads, T, D] copies)
        assert got.transpose(1, 2).is_contiguous(), f"{name}: not a transpose(1, 2) view of [B, T, heads, D]"
    assert gate.shape == (B, T, H * D) and gate.is_contiguous()
    assert_close("q vs stock", q, _captured["q"], BOUND)
    assert_close("k vs stock", k, _captured["k"], BOUND)
    assert_exact("v vs stock", v, _captured["v"])
    assert_exact("gate vs stock", gate, gate_stock)
    assert_close("q vs attn_prep_ref", q, q_ref, BOUND)
    assert_close("k vs attn_prep_ref", k, k_ref, BOUND)
    assert_exact("v vs attn_prep_ref", v, v_ref)
    assert_exact("gate vs attn_prep_ref", gate, gate_ref)


def check_attn_prep_into_cache(device, dtype, B, H, KV, D, R, L, slot, hidden=None, T=1):
    """A decode step's prep writing k / v of token t at `slot` + t of [B, KV, L, D] caches (T = 1: the decode step;
    T > 1: the speculative verify pass): q and gate as the plain call returns them, k / v bit-identical to its k / v
    there, every other cache position untouched; and the same caches as the reference's `index_copy_`."""
    torch.manual_seed(0)
    cfg, attn = stock_attention(device, dtype, H, KV, D, R, hidden)
    x = torch.randn(B, T, cfg.hidden_size, dtype=dtype, device=device)
    cos, sin = stock_rope(cfg, B, T, dtype, device)
    with torch.no_grad():
        qkv = torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], dim=-1)
    args = (qkv, cos, sin, attn.q_norm.weight, attn.k_norm.weight, EPS, H, KV, D)
    q, k, v, gate = fused_ops.attn_prep(*args)
    keys, values = (torch.randn(B, KV, L, D, dtype=dtype, device=device) for _ in range(2))
    keys_ref, values_ref = keys.clone(), values.clone()
    slot_t = torch.tensor([slot], device=device)
    q2, k2, v2, gate2 = fused_ops.attn_prep(*args, kv_cache=(keys, values, slot_t))
    assert k2 is None and v2 is None
    assert_exact("q", q2, q)
    assert_exact("gate", gate2, gate)
    expect_k, expect_v = keys_ref.clone(), values_ref.clone()
    expect_k[:, :, slot : slot + T], expect_v[:, :, slot : slot + T] = k, v
    assert_exact("keys", keys, expect_k)
    assert_exact("values", values, expect_v)
    fused_ops.attn_prep_ref(*args, kv_cache=(keys_ref, values_ref, slot_t))
    assert_close("keys vs attn_prep_ref", keys, keys_ref, BOUND)
    assert_exact("values vs attn_prep_ref", values, values_ref)


@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("B, H, KV, D, R, L, slot, T", [(1, 4, 2, 32, 8, 8, 0, 1), (3, 2, 1, 16, 16, 5, 4, 1),
                                                         (1, 4, 2, 32, 8, 9, 2, 4), (2, 2, 1, 16, 16, 6, 3, 3)],
                         ids=["B1-slot0", "B3-last-slot", "B1-T4", "B2-T3-to-the-end"])
def test_attn_prep_into_cache_cpu(dtype, B, H, KV, D, R, L, slot, T):
    check_attn_prep_into_cache("cpu", dtype, B, H, KV, D, R, L, slot, T=T)


def check_sigmoid_gate_mul(device, dtype, B, T, H, D, o_layout="bhtd", gate_pad=0):
    torch.manual_seed(0)
    cfg, attn = stock_attention(device, dtype, H, max(1, H // 4), D, 8)
    x = torch.randn(B, T, cfg.hidden_size, dtype=dtype, device=device)
    cos, sin = stock_rope(cfg, B, T, dtype, device)
    if o_layout == "bhtd":  # attention output [B, H, T, D] seen as [B, T, H, D]
        o = torch.randn(B, H, T, D, dtype=dtype, device=device).transpose(1, 2)
    else:  # "bthd": contiguous [B, T, H, D], or flattened to [B, T, H*D]
        o = torch.randn(B, T, H, D, dtype=dtype, device=device)
    with torch.no_grad():
        gate = attn.q_proj(x).view(B, T, H, 2 * D)[..., D:].reshape(B, T, H * D)
        _captured["o"] = o
        y_stock, _ = attn(x, (cos, sin), None)  # o_proj is Identity: stock `o * sigmoid(gate)`
    if gate_pad:
        gate = randn(B, T, H * D, dtype=dtype, device=device, row_pad=gate_pad).copy_(gate)
    o_in = o.reshape(B, T, H * D) if o_layout == "flat" else o

    poison(device, ((B, T, H * D), dtype))
    y = fused_ops.sigmoid_gate_mul(o_in, gate)
    assert y.is_contiguous()
    assert_close("y vs stock o * sigmoid(gate)", y, y_stock, BOUND)
    assert_close("y vs sigmoid_gate_mul_ref", y, fused_ops.sigmoid_gate_mul_ref(o_in, gate), BOUND)


def check_swiglu(device, dtype, B, T, hidden, I, row_pad=0):
    torch.manual_seed(0)
    cfg = text_config(hidden, 2, 1, 16, 8, intermediate=I)
    mlp = Qwen3_5MLP(cfg, I)
    mlp.down_proj = nn.Identity()
    mlp = mlp.to(device=device, dtype=dtype)
    x = torch.randn(B, T, hidden, dtype=dtype, device=device)
    with torch.no_grad():
        y_stock = mlp(x)  # down_proj is Identity: stock `act_fn(gate_proj(x)) * up_proj(x)`
        gu = randn(B, T, 2 * I, dtype=dtype, device=device, row_pad=row_pad)
        gu.copy_(torch.cat([mlp.gate_proj(x), mlp.up_proj(x)], dim=-1))

    poison(device, ((B, T, I), dtype))
    y = fused_ops.swiglu(gu)
    assert y.is_contiguous()
    assert_close("y vs stock Qwen3_5MLP", y, y_stock, BOUND)
    assert_close("y vs swiglu_ref", y, fused_ops.swiglu_ref(gu), BOUND)


# ---------------------------------------------------------------------------------------------------------------------
# CPU tests (interpreter): tiny shapes, odd sizes
# ---------------------------------------------------------------------------------------------------------------------


@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(
    "B, T, N", [(1, 1, 64), (2, 7, 1000), (1, 3, 48)], ids=["B1-T1-N64", "B2-T7-N1000", "B1-T3-N48"]
)
def test_rms_norm_cpu(dtype, B, T, N):
    check_rms_norm("cpu", dtype, B, T, N)


@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(
    "B, T, N, row_pad", [(1, 1, 64, 0), (2, 7, 40, 24)], ids=["B1-T1-N64", "B2-T7-N40-rowpad24"]
)
def test_rms_norm_residual(dtype, B, T, N, row_pad):
    check_rms_norm("cpu", dtype, B, T, N, residual=True, row_pad=row_pad)


@needs_interpreter
def test_rms_norm_t129():
    check_rms_norm("cpu", torch.bfloat16, 1, 129, 32, residual=True)


@needs_interpreter
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.float16], ids=["w-fp32", "w-fp16"])
def test_rms_norm_weight_dtype(weight_dtype):
    check_rms_norm("cpu", torch.bfloat16, 1, 5, 96, weight_dtype=weight_dtype)


@needs_interpreter
def test_rms_norm_1d_and_2d_views():
    torch.manual_seed(0)
    w = torch.randn(80) * 0.1
    x = torch.randn(80, dtype=torch.bfloat16)
    assert_close("1-D x", fused_ops.rms_norm(x, w, EPS), fused_ops.rms_norm_ref(x, w, EPS), BOUND)
    buf = torch.randn(5, 3 * 80, dtype=torch.bfloat16)
    x2 = buf[:, 80:160]  # [5, 80], row stride 240
    assert_close("2-D strided x", fused_ops.rms_norm(x2, w, EPS), fused_ops.rms_norm_ref(x2, w, EPS), BOUND)


@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(
    "B, T, H, KV, D, R, row_pad, cos_batch1",
    [
        (1, 1, 4, 2, 32, 8, 0, False),
        (1, 7, 2, 1, 48, 16, 16, False),
        (2, 3, 2, 1, 16, 16, 0, True),
    ],
    ids=["decode-B1-T1-H4-KV2-D32-R8", "B1-T7-H2-KV1-D48-R16-rowpad16", "B2-T3-H2-KV1-D16-fullR-cosB1"],
)
def test_attn_prep_cpu(dtype, B, T, H, KV, D, R, row_pad, cos_batch1):
    check_attn_prep("cpu", dtype, B, T, H, KV, D, R, row_pad=row_pad, cos_batch1=cos_batch1)


@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(
    "B, T, H, D, o_layout, gate_pad",
    [(1, 1, 4, 32, "bhtd", 0), (2, 7, 2, 48, "bhtd", 8), (1, 3, 4, 16, "flat", 0)],
    ids=["B1-T1-H4-D32-bhtd", "B2-T7-H2-D48-bhtd-gatepad8", "B1-T3-H4-D16-flat"],
)
def test_sigmoid_gate_mul_cpu(dtype, B, T, H, D, o_layout, gate_pad):
    check_sigmoid_gate_mul("cpu", dtype, B, T, H, D, o_layout, gate_pad)


@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(
    "B, T, hidden, I, row_pad",
    [(1, 1, 32, 48, 0), (2, 7, 40, 300, 8)],
    ids=["B1-T1-I48", "B2-T7-I300-rowpad8"],
)
def test_swiglu_cpu(dtype, B, T, hidden, I, row_pad):
    check_swiglu("cpu", dtype, B, T, hidden, I, row_pad)


@needs_interpreter
def test_swiglu_t129():
    check_swiglu("cpu", torch.bfloat16, 1, 129, 16, 24)


@needs_interpreter
@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the interpreter's numpy exp, on purpose
def test_swiglu_large_values():
    """silu of large |g| (exp overflow to inf for g << 0) must give 0 and g, like torch."""
    gu = torch.tensor([[-1e4, -90.0, 0.0, 90.0, 1e4, 2.0, 2.0, 2.0, 2.0, 2.0]], dtype=torch.float32)
    y = fused_ops.swiglu(gu)
    assert_close("y", y, fused_ops.swiglu_ref(gu), BOUND)


def test_empty_inputs_cpu():
    w = torch.zeros(16)
    assert fused_ops.rms_norm(torch.randn(0, 16), w, EPS).shape == (0, 16)
    assert fused_ops.swiglu(torch.randn(2, 0, 32)).shape == (2, 0, 16)
    assert fused_ops.sigmoid_gate_mul(torch.randn(1, 0, 2, 8), torch.randn(1, 0, 16)).shape == (1, 0, 16)
    cs = torch.randn(1, 0, 8)
    q, k, v, g = fused_ops.attn_prep(torch.randn(1, 0, 96), cs, cs, w, w, EPS, 2, 1, 16)
    assert q.shape == (1, 2, 0, 16) and k.shape == v.shape == (1, 1, 0, 16) and g.shape == (1, 0, 32)


_W16 = torch.zeros(16)


def _prep(width=96, rotary_shape=None, rotary_dtype=torch.float32, q_weight=_W16, T=2, kv_cache=None):
    """attn_prep on a [1, T, width] qkv with H=2, KV=1, D=16 (valid width 96) and the given cos / sin."""
    cs = torch.randn(rotary_shape or (1, T, 8), dtype=rotary_dtype)
    return fused_ops.attn_prep(torch.randn(1, T, width), cs, cs, q_weight, _W16, EPS, 2, 1, 16, kv_cache=kv_cache)


BAD_INPUTS = {
    "rms-weight-shape": (
        lambda: fused_ops.rms_norm(torch.randn(2, 16), torch.zeros(15), EPS),
        "weight must have shape",
    ),
    "rms-x-fp64": (lambda: fused_ops.rms_norm(torch.randn(2, 16).double(), _W16, EPS), "x must be float32"),
    "rms-last-dim-strided": (lambda: fused_ops.rms_norm(torch.randn(16, 2).t(), _W16, EPS), "contiguous last dim"),
    "rms-residual-dtype": (
        lambda: fused_ops.rms_norm(torch.randn(2, 16), _W16, EPS, residual=torch.randn(2, 16).half()),
        "residual must match x",
    ),
    "rms-rows-not-flat": (
        lambda: fused_ops.rms_norm(torch.randn(4, 3, 16)[:, :2].transpose(0, 1), _W16, EPS),
        "cannot be seen as",
    ),
    "prep-qkv-width": (lambda: _prep(width=95), "qkv must be"),
    "prep-odd-rotary": (lambda: _prep(rotary_shape=(1, 2, 7)), "rotary dim"),
    "prep-rotary-over-D": (lambda: _prep(rotary_shape=(1, 2, 18)), "rotary dim"),
    "prep-cos-T": (lambda: _prep(rotary_shape=(1, 3, 8)), "cos / sin must be"),
    "prep-cos-dtype": (lambda: _prep(rotary_dtype=torch.float16), "dtype"),
    "prep-q-weight-shape": (lambda: _prep(q_weight=torch.zeros(8)), "q_weight"),
    "prep-cache-shape": (
        lambda: _prep(T=1, kv_cache=(torch.zeros(1, 2, 4, 16),) * 2 + (torch.zeros(1, dtype=torch.long),)),
        "keys / values must be"),
    "prep-cache-slot-dtype": (
        lambda: _prep(T=1, kv_cache=(torch.zeros(1, 1, 4, 16),) * 2 + (torch.zeros(1, dtype=torch.int32),)),
        "slot must be"),
    "gate-shape": (lambda: fused_ops.sigmoid_gate_mul(torch.randn(1, 2, 2, 8), torch.randn(1, 2, 15)), "gate must be"),
    "gate-dtype": (
        lambda: fused_ops.sigmoid_gate_mul(torch.randn(1, 2, 2, 8), torch.randn(1, 2, 16).half()),
        "dtype",
    ),
    "swiglu-odd-width": (lambda: fused_ops.swiglu(torch.randn(2, 15)), "even last dim"),
    "rms-empty-features": (lambda: fused_ops.rms_norm(torch.randn(2, 0), torch.zeros(0), EPS), "non-empty"),
}


_SM90_CALLS = r"""
for at_slot in (False, True):
    compile_(fused_ops_attention._attn_prep_kernel,
             dict(qkv_ptr="*bf16", cos_ptr="*bf16", sin_ptr="*bf16", qw_ptr="*bf16", kw_ptr="*bf16", q_ptr="*bf16",
                  k_ptr="*bf16", v_ptr="*bf16", g_ptr="*bf16", slot_ptr="*i64" if at_slot else "*bf16", eps="fp32"),
             dict(H=16, KV=4, D=256, R=64, N_QB=4, BLOCK_H=4, BLOCK_D=256, AT_SLOT=at_slot), 4)
for residual in (False, True):
    compile_(fused_ops_norm._rms_norm_kernel,
             dict(x_ptr="*bf16", r_ptr="*bf16", w_ptr="*bf16", y_ptr="*bf16", h_ptr="*bf16", eps="fp32"),
             dict(HAS_RESIDUAL=residual, BLOCK_M=1, BLOCK_N=4096), 16)
"""


def test_attn_prep_compiles_for_sm90():
    """The real 4B / 9B attention shape, writing k / v to new buffers and into the caches at a slot; the decode
    step's RMSNorm at the 9B width."""
    assert compile_for_sm90(_SM90_CALLS) == 4


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_rejects_bad_inputs(case):
    call, match = BAD_INPUTS[case]
    with pytest.raises(ValueError, match=match):
        call()


def test_op_set_binds_the_kernels_or_references_taking_the_same_arguments():
    """`op_set()` is the model's fused ops, `op_set(reference=True)` their torch references; each reference takes
    exactly its kernel's parameters (names, kinds, defaults), so the fused control flow runs on either set."""
    kernels, refs = fused_ops.op_set(), fused_ops.op_set(reference=True)
    assert tuple(vars(kernels)) == tuple(vars(refs)) == fused_ops.KERNEL_OPS
    for name in fused_ops.KERNEL_OPS:
        kernel, ref = getattr(kernels, name), getattr(refs, name)
        assert kernel is getattr(fused_ops, name) and ref is getattr(fused_ops, f"{name}_ref")
        kernel_params, ref_params = ([(p.name, p.kind, p.default) for p in inspect.signature(f).parameters.values()]
                                     for f in (kernel, ref))
        assert ref_params == kernel_params, name


def test_import_without_triton():
    """Importing `fused_ops` must not raise where triton is missing; the refs still work, the kernels say why not."""
    code = f"""
import sys
sys.modules["triton"] = None  # makes `import triton` raise ImportError
# fla depends on triton, so such a machine has no fla either; blocking it also saves the ~8 s fla spends importing
sys.modules["fla"] = None
sys.path.insert(0, {str(REPO)!r})
import torch
from scripts.common import import_module
fused_ops = import_module("fused_ops")  # the facade imports every fused_ops_* module
assert fused_ops.HAS_TRITON is False and fused_ops.HAS_FLA is False
available = torch.cuda.is_available
torch.cuda.is_available = lambda: False
assert fused_ops.kernels_available() == "no CUDA device is available"  # first: no package would help
torch.cuda.is_available = lambda: True  # a GPU machine without triton
assert fused_ops.kernels_available() == "triton is not installed"
torch.cuda.is_available = available
x = torch.randn(2, 8)
fused_ops.rms_norm_ref(x, torch.zeros(8), 1e-6)
try:
    fused_ops.rms_norm(x, torch.zeros(8), 1e-6)
except RuntimeError as e:
    assert "triton" in str(e)
else:
    raise AssertionError("rms_norm ran without triton")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_a_cpu_kernel_launch_without_the_interpreter_marker_fails():
    """On a GPU machine the interpreter is off and a launch on CPU tensors fails, so every test here that runs our
    kernels on CPU tensors carries `needs_interpreter` (skipped there). Under the interpreter, tests/conftest.py fails
    an unmarked test of tests/ops at its first launch; this test is unmarked, so its launch must be refused."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the guard exists only under the Triton interpreter (no GPU)")
    x = torch.randn(2, 8)
    with pytest.raises(AssertionError, match="needs_interpreter"):
        fused_ops.rms_norm(x, torch.zeros(8), 1e-6)


# ---------------------------------------------------------------------------------------------------------------------
# CUDA tests: real Qwen3.5 shapes
# ---------------------------------------------------------------------------------------------------------------------

T_CUDA = [1, 7, 64, 129, 2048]
B_CUDA = [1, 3]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("B", B_CUDA, ids=lambda b: f"B{b}")
@pytest.mark.parametrize("T", T_CUDA, ids=lambda t: f"T{t}")
@pytest.mark.parametrize("N", [1000, 1024, 2560, 4096], ids=lambda n: f"N{n}")
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual-rowpad64"])
def test_rms_norm_cuda(dtype, B, T, N, residual):
    check_rms_norm("cuda", dtype, B, T, N, residual=residual, row_pad=64 if residual else 0)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("B", B_CUDA, ids=lambda b: f"B{b}")
@pytest.mark.parametrize("T", T_CUDA, ids=lambda t: f"T{t}")
@pytest.mark.parametrize("H, KV, hidden", [(8, 2, 1024), (16, 4, 4096)], ids=["H8-KV2", "H16-KV4"])
def test_attn_prep_cuda(dtype, B, T, H, KV, hidden):
    check_attn_prep("cuda", dtype, B, T, H, KV, 256, 64, hidden=hidden)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("T", [1, 129], ids=lambda t: f"T{t}")
def test_attn_prep_broadcast_cos_strided_qkv(dtype, T):
    check_attn_prep("cuda", dtype, 3, T, 16, 4, 256, 64, row_pad=128, cos_batch1=True, hidden=2560)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("B", [1, 3, 8], ids=lambda b: f"B{b}")
@pytest.mark.parametrize("H, KV, hidden", [(8, 2, 1024), (16, 4, 4096), (24, 4, 5120)], ids=["0.8B", "4B-9B", "27B"])
def test_attn_prep_into_cache_cuda(dtype, B, H, KV, hidden):
    check_attn_prep_into_cache("cuda", dtype, B, H, KV, 256, 64, 512, 300, hidden=hidden)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("T", [2, 4], ids=lambda t: f"T{t}")
@pytest.mark.parametrize("H, KV, hidden", [(16, 4, 2560), (24, 4, 5120)], ids=["4B", "27B"])
def test_attn_prep_into_cache_several_tokens_cuda(dtype, T, H, KV, hidden):
    """The speculative verify pass's prep: T tokens' k / v at slot .. slot + T - 1 of a batch-1 cache."""
    check_attn_prep_into_cache("cuda", dtype, 1, H, KV, 256, 64, 512, 300, hidden=hidden, T=T)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("B", B_CUDA, ids=lambda b: f"B{b}")
@pytest.mark.parametrize("T", T_CUDA, ids=lambda t: f"T{t}")
@pytest.mark.parametrize("H", [8, 16], ids=lambda h: f"H{h}")
def test_sigmoid_gate_mul_cuda(dtype, B, T, H):
    check_sigmoid_gate_mul("cuda", dtype, B, T, H, 256, "bhtd")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("o_layout", ["bthd", "flat"])
def test_sigmoid_gate_mul_layouts(dtype, o_layout):
    check_sigmoid_gate_mul("cuda", dtype, 3, 129, 16, 256, o_layout, gate_pad=256)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("B", B_CUDA, ids=lambda b: f"B{b}")
@pytest.mark.parametrize("T", T_CUDA, ids=lambda t: f"T{t}")
@pytest.mark.parametrize(
    "hidden, I, row_pad", [(1024, 3584, 0), (4096, 9216, 0), (1000, 1000, 40)], ids=["I3584", "I9216", "I1000-rowpad40"]
)
def test_swiglu_cuda(dtype, B, T, hidden, I, row_pad):
    check_swiglu("cuda", dtype, B, T, hidden, I, row_pad)
