"""Tests of the Gated DeltaNet prefill ops in `fused_ops.py` (`deltanet_prep`, `gated_rms_norm`) against the stock
transformers Qwen3.5 code, and against each op's `_ref`.

Stock code: `causal_conv1d_fn` and `l2norm` of `modeling_qwen3_5` (through `inspect.unwrap`: with fla installed
transformers routes those names to fla's kernels), `b.sigmoid()`, and the `Qwen3_5RMSNormGated` module. Inputs are
column slices of one wider buffer, as the packed projection hands them over.

CPU tests run the kernels under the Triton interpreter (`TRITON_INTERPRET=1`, set in conftest.py) on tiny shapes;
`@pytest.mark.cuda` tests run the real Qwen3.5 head shapes at T = 1, 7, 64, 129, 2048:
`python -m pytest tests/ops/test_deltanet_prefill_ops.py -m cuda`.

Error bounds (relative), and why:
- fp32 <= 1e-6: another summation order than torch and, on the GPU, approximate exp / sqrt / division; a few fp32
  units in the last place.
- bf16 <= 1e-2, fp16 <= 1e-3: the kernels round where stock rounds (conv output, SiLU, the normalised q / k; the
  gated norm's normalised x, weight product and output), so only those wobbles flipping a rounding decision remain,
  one unit in the last place of an element at most. Measured on CPU against the references: 0.
- v (a rounded conv + SiLU), beta (stock's `b.sigmoid()`, rounded to b's dtype) and the gate g (fp32, stock's
  `-A_log.float().exp() * softplus(a.float() + dt_bias)`) are compared with the same bounds; g also at gate inputs
  down to -40, where fla's approximate in-kernel softplus was off (`test_gate_matches_torch_where_exp_is_tiny_*`).
"""

import inspect

import pytest
import torch

from helpers import BOUNDS, DTYPE_IDS, DTYPES, assert_close, compile_for_sm90, fused_ops, needs_interpreter
from transformers.models.qwen3_5 import modeling_qwen3_5
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNormGated

STOCK_CONV = inspect.unwrap(modeling_qwen3_5.causal_conv1d_fn)
STOCK_L2NORM = modeling_qwen3_5.l2norm

BOUND = BOUNDS["kernel"]
PAD = 8  # extra columns around the packed projection's slices


@pytest.fixture(autouse=True)
def _set_up():
    """Skip without triton; stock fp32 convolutions in true fp32 (cuDNN may pick TF32); one CPU thread (stock's bf16
    CPU conv1d spins its OpenMP threads on busy cores)."""
    if not fused_ops.HAS_TRITON:
        pytest.skip("triton is not installed")
    saved = torch.backends.cudnn.allow_tf32, torch.get_num_threads()
    torch.backends.cudnn.allow_tf32 = False
    torch.set_num_threads(1)
    yield
    torch.backends.cudnn.allow_tf32 = saved[0]
    torch.set_num_threads(saved[1])


def close(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    assert_close(name, got, want, BOUND[want.dtype])


def packed_projection(B, T, HK, DK, HV, DV, dtype, device, seed=0):
    """Column slices (x = q|k|v, z, b, a) of one [B, T, C + HV*DV + 2*HV + 2*PAD] buffer, as the packed GEMM
    writes them, plus a conv weight [C, 4] with the init's scale."""
    gen = torch.Generator().manual_seed(seed)
    C = 2 * HK * DK + HV * DV
    widths = [C, HV * DV, HV, HV]
    buf = torch.randn(B, T, sum(widths) + 2 * PAD, generator=gen).to(device=device, dtype=dtype)
    parts, start = [], PAD
    for w in widths:
        parts.append(buf[..., start : start + w])
        start += w
    weight = (torch.randn(C, 4, generator=gen) * 0.5).to(device=device, dtype=dtype)
    return (*parts, weight)


def gate_params(HV, device, dtype=torch.float32, seed=3, spread=3.0):
    """A_log and dt_bias [HV] as the search draws them at its widest (decay rates up to 16, dt_bias x 3), where the
    gate input reaches far below 0."""
    gen = torch.Generator().manual_seed(seed)
    A_log = torch.log(torch.rand(HV, generator=gen) * 16 + 1e-3)
    dt_bias = torch.randn(HV, generator=gen) * spread
    return A_log.to(device=device, dtype=dtype), dt_bias.to(device=device, dtype=dtype)


def stock_gate(a, A_log, dt_bias):
    """Stock's gate (`Qwen3_5GatedDeltaNet.forward`)."""
    return -A_log.float().exp() * torch.nn.functional.softplus(a.float() + dt_bias)


def stock_prep(x, weight, b, a, A_log, dt_bias, HK, DK, DV):
    """Stock's conv + SiLU ([B, C, T] layout), split, q / k `l2norm` (fla's eps), `beta = b.sigmoid()` (b's dtype),
    the gate."""
    B, T, C = x.shape
    y = STOCK_CONV(x.transpose(1, 2), weight, None, activation="silu").transpose(1, 2)
    q, k, v = torch.split(y, [HK * DK, HK * DK, C - 2 * HK * DK], dim=-1)

    def l2(t):  # fla's l2norm (the path stock takes on the GPU): fp32 over the rounded conv output
        return STOCK_L2NORM(t.reshape(B, T, HK, DK).float(), dim=-1, eps=1e-6).to(x.dtype)

    return l2(q), l2(k), v.reshape(B, T, -1, DV), b.sigmoid().float(), stock_gate(a, A_log, dt_bias)


def check_prep(device, dtype, B, T, HK, DK, HV, DV):
    x, _, b, a, weight = packed_projection(B, T, HK, DK, HV, DV, dtype, device)
    A_log, dt_bias = gate_params(HV, device, dtype)
    got = fused_ops.deltanet_prep(x, weight, None, b, a, A_log, dt_bias, HK, DK, DV)
    ref = fused_ops.deltanet_prep_ref(x, weight, None, b, a, A_log, dt_bias, HK, DK, DV)
    stock = stock_prep(x, weight, b, a, A_log, dt_bias, HK, DK, DV)
    assert got[3].dtype == got[4].dtype == torch.float32
    # beta is a value of b's dtype carried in float32 (stock's b.sigmoid()): the kernel's sigmoid and torch's can round
    # an element to neighbouring values of that dtype (an H200 fp16 run: 1.4e-6 over 98k values), so it is compared
    # at b's dtype's bound
    as_b = lambda name, t: t.to(dtype) if name == "beta" else t  # noqa: E731
    assert torch.equal(got[3], got[3].to(dtype).float()), "beta is not rounded to b's dtype"
    for name, g, r in zip(("q", "k", "v", "beta", "g"), got, ref):
        assert g.is_contiguous(), f"{name} is not contiguous"
        close(f"{name} vs ref", as_b(name, g), as_b(name, r))
    for name, g, s in zip(("q", "k", "v", "beta", "g"), got, stock):
        close(f"{name} vs stock", as_b(name, g), as_b(name, s))


def check_gate_where_exp_is_tiny(device):
    """g at gate inputs from -40 to 30 (softplus from 4e-18 to 30, both sides of torch's threshold 20): within 4
    fp32 ulps of torch's. fla's in-kernel `lg2.approx(1 + ex2.approx(x))` is off by up to all of g below -16."""
    HV, T = 4, 71
    x, _, b, _, weight = packed_projection(1, T, 1, 8, HV, 8, torch.float32, device)
    a = torch.linspace(-40, 30, T * HV).reshape(1, T, HV).to(device)
    A_log, dt_bias = gate_params(HV, device)
    g = fused_ops.deltanet_prep(x, weight, None, b, a, A_log, dt_bias, 1, 8, 8)[4]
    want = stock_gate(a, A_log, dt_bias)
    rel = ((g - want).abs() / want.abs()).max().item()
    assert rel <= 4 * torch.finfo(torch.float32).eps, f"g is {rel:.3g} (relative) from torch's gate"


def check_gated_norm(device, dtype, B, T, HV, DV, weight_dtype=None):
    _, z, _, _, _ = packed_projection(B, T, 1, 8, HV, DV, dtype, device, seed=1)
    gen = torch.Generator().manual_seed(2)
    core = torch.randn(B, T, HV, DV, generator=gen).to(device=device, dtype=dtype)
    norm = Qwen3_5RMSNormGated(DV, eps=1e-6).to(device=device, dtype=weight_dtype or dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(DV, generator=gen))
    got = fused_ops.gated_rms_norm(core, z, norm.weight, 1e-6)
    close("vs ref", got, fused_ops.gated_rms_norm_ref(core, z, norm.weight, 1e-6))
    with torch.no_grad():
        stock = norm(core.reshape(-1, DV), z.reshape(-1, DV)).to(dtype).reshape(B, T, -1)
    close("vs stock Qwen3_5RMSNormGated", got, stock)


# ---------------------------------------------------------------------------------------------------------------------
# CPU (interpreter): tiny shapes, odd sizes, head dims that differ and are not powers of two
# ---------------------------------------------------------------------------------------------------------------------


@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(
    "B, T, HK, DK, HV, DV",
    [(1, 1, 2, 8, 4, 8), (2, 7, 2, 8, 4, 12), (3, 19, 1, 16, 3, 16), (1, 70, 2, 8, 2, 8)],
    ids=["T1", "T7-DV12", "B3-T19-HV3", "T70"],
)
def test_deltanet_prep_cpu(dtype, B, T, HK, DK, HV, DV):
    check_prep("cpu", dtype, B, T, HK, DK, HV, DV)


@needs_interpreter
def test_gate_matches_torch_where_exp_is_tiny_cpu():
    check_gate_where_exp_is_tiny("cpu")


@needs_interpreter
def test_deltanet_prep_bias():
    x, _, b, a, weight = packed_projection(2, 9, 2, 8, 4, 8, torch.float32, "cpu")
    bias = torch.randn(weight.shape[0])
    A_log, dt_bias = gate_params(4, "cpu")
    got = fused_ops.deltanet_prep(x, weight, bias, b, a, A_log, dt_bias, 2, 8, 8)
    for name, g, r in zip("qkv", got, fused_ops.deltanet_prep_ref(x, weight, bias, b, a, A_log, dt_bias, 2, 8, 8)):
        close(name, g, r)


@needs_interpreter
def test_deltanet_prep_causal():
    """A token's outputs depend on no later token: change the last token's inputs, the earlier outputs stay."""
    x, _, b, a, weight = packed_projection(1, 12, 2, 8, 4, 8, torch.float32, "cpu")
    A_log, dt_bias = gate_params(4, "cpu")
    before = fused_ops.deltanet_prep(x, weight, None, b, a, A_log, dt_bias, 2, 8, 8)
    x[:, -1] += 1.0
    after = fused_ops.deltanet_prep(x, weight, None, b, a, A_log, dt_bias, 2, 8, 8)
    for name, u, w in zip("qkv", before, after):
        assert torch.equal(u[:, :-1], w[:, :-1]), name
        assert not torch.equal(u[:, -1], w[:, -1]), name


@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("B, T, HV, DV", [(1, 1, 4, 8), (2, 7, 3, 12), (1, 33, 2, 16)], ids=["T1", "T7", "T33"])
def test_gated_rms_norm_cpu(dtype, B, T, HV, DV):
    check_gated_norm("cpu", dtype, B, T, HV, DV)


@needs_interpreter
def test_gated_rms_norm_fp32_weight():
    check_gated_norm("cpu", torch.bfloat16, 2, 5, 3, 8, weight_dtype=torch.float32)


@needs_interpreter
def test_gated_rms_norm_2d_decode_layout():
    """The decode step's layout: core [B, HV, V], z [B, HV * V] a column slice."""
    _, z, _, _, _ = packed_projection(3, 1, 1, 8, 4, 8, torch.bfloat16, "cpu")
    z = z[:, 0]
    core, w = torch.randn(3, 4, 8).bfloat16(), torch.rand(8).bfloat16()
    close("decode layout", fused_ops.gated_rms_norm(core, z, w, 1e-6), fused_ops.gated_rms_norm_ref(core, z, w, 1e-6))


@needs_interpreter
def test_empty_inputs():
    x, _, b, a, weight = packed_projection(2, 0, 2, 8, 4, 8, torch.float32, "cpu")
    q, k, v, beta, g = fused_ops.deltanet_prep(x, weight, None, b, a, *gate_params(4, "cpu"), 2, 8, 8)
    assert q.shape == (2, 0, 2, 8) and v.shape == (2, 0, 4, 8) and beta.shape == g.shape == (2, 0, 4)
    assert fused_ops.gated_rms_norm(torch.zeros(2, 0, 4, 8), torch.zeros(2, 0, 32), torch.ones(8), 1e-6).shape == (2, 0, 32)


@pytest.mark.parametrize(
    "case, match",
    [
        ("channels", "x has C=64 channels"),
        ("weight", r"weight must be \[C, W\]"),
        ("ba", "b, a \\[B, T, HV\\]"),
        ("int", "must be float32"),
        ("gate", r"dt_bias must have shape \(4,\)"),
        ("norm_z", r"z \[\.\.\., HV \* V\]"),
        ("norm_w", r"weight must have shape \(8,\)"),
    ],
)
def test_rejects_bad_inputs(case, match):
    x, z, b, a, weight = packed_projection(2, 3, 2, 8, 4, 8, torch.float32, "cpu")
    core = torch.randn(2, 3, 4, 8)
    A_log, dt_bias = gate_params(4, "cpu")
    calls = {
        "channels": lambda: fused_ops.deltanet_prep(x, weight, None, b, a, A_log, dt_bias, 2, 8, 4),
        "weight": lambda: fused_ops.deltanet_prep(x, weight[:-1], None, b, a, A_log, dt_bias, 2, 8, 8),
        "ba": lambda: fused_ops.deltanet_prep(x, weight, None, b, a[..., :-1], A_log, dt_bias, 2, 8, 8),
        "int": lambda: fused_ops.deltanet_prep(x, weight, None, b.long(), a, A_log, dt_bias, 2, 8, 8),
        "gate": lambda: fused_ops.deltanet_prep(x, weight, None, b, a, A_log, dt_bias[:-1], 2, 8, 8),
        "norm_z": lambda: fused_ops.gated_rms_norm(core, z[..., :-8], torch.ones(8), 1e-6),
        "norm_w": lambda: fused_ops.gated_rms_norm(core, z, torch.ones(7), 1e-6),
    }
    with pytest.raises(ValueError, match=match):
        calls[case]()


_SM90_CALLS = r"""
ptrs = dict(x_ptr="*bf16", w_ptr="*bf16", bias_ptr="*bf16", b_ptr="*bf16", a_ptr="*bf16", A_log_ptr="*fp32",
            dt_bias_ptr="*fp32", y_ptr="*bf16", beta_ptr="*fp32", g_ptr="*fp32", eps="fp32")
for block_t in (16, 64):
    compile_(fused_ops_deltanet_prefill._deltanet_prep_kernel, ptrs,
             dict(HK=16, DK=128, HV=32, DV=128, W=4, HAS_BIAS=False, BLOCK_T=block_t, BLOCK_D=128, BLOCK_HV=32,
                  ON_GPU=True), 8)
compile_(fused_ops_norm._gated_rms_norm_kernel,
         dict(x_ptr="*bf16", z_ptr="*bf16", w_ptr="*bf16", y_ptr="*bf16", eps="fp32"),
         dict(HV=32, BLOCK_M=8, BLOCK_D=128), 4)
"""


def test_kernels_compile_for_sm90():
    """The real-shape variants of both kernels compile for sm_90."""
    assert compile_for_sm90(_SM90_CALLS) == 3


# ---------------------------------------------------------------------------------------------------------------------
# CUDA: real Qwen3.5 linear-attention shapes (16 key heads, 16 / 32 / 48 value heads, head dims 128)
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("T", [1, 7, 64, 129, 2048])
@pytest.mark.parametrize("HV", [16, 32, 48])
def test_deltanet_prep_cuda(dtype, T, HV):
    check_prep("cuda", dtype, 1 if T == 2048 else 3, T, 16, 128, HV, 128)


@pytest.mark.cuda
def test_gate_matches_torch_where_exp_is_tiny_cuda():
    check_gate_where_exp_is_tiny("cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("T", [1, 7, 129, 2048])
@pytest.mark.parametrize("HV", [16, 32, 48])
def test_gated_rms_norm_cuda(dtype, T, HV):
    check_gated_norm("cuda", dtype, 1 if T == 2048 else 3, T, HV, 128)


# ---------------------------------------------------------------------------------------------------------------------
# The rule over a prompt: fla's chunked kernel, or its IEEE per-token kernel for fp32 (`prefill_rule_kernel`)
# ---------------------------------------------------------------------------------------------------------------------


def rule_inputs(device, dtype, B, T, H, K, HV, V, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g), dim=-1)
    v = torch.randn(B, T, HV, V, generator=g)
    a = torch.randn(B, T, HV, generator=g)
    beta = torch.rand(B, T, HV, generator=g)
    A_log, dt_bias = torch.randn(HV, generator=g) * 0.5, torch.randn(HV, generator=g)
    gate = stock_gate(a, A_log, dt_bias)  # [B, T, HV] float32, as deltanet_prep hands it over
    cast = dict(device=device, dtype=dtype)
    return q.to(**cast), k.to(**cast), v.to(**cast), gate.to(device), beta.to(device)


@pytest.fixture
def matmul_precision():
    saved = torch.get_float32_matmul_precision()
    yield torch.set_float32_matmul_precision
    torch.set_float32_matmul_precision(saved)


def test_prefill_rule_kernel_follows_fp32_matmul_precision(matmul_precision):
    assert fused_ops.prefill_rule_kernel(torch.float32) == "fused_recurrent"  # torch's default: "highest"
    assert fused_ops.prefill_rule_kernel(torch.bfloat16) == "chunk"
    assert fused_ops.prefill_rule_kernel(torch.float16) == "chunk"
    matmul_precision("high")  # the user allowed TF32 for fp32 matmuls
    assert fused_ops.prefill_rule_kernel(torch.float32) == "chunk"


def test_prefill_rule_ref_matches_stock_recurrent_rule_cpu():
    """The reference (stock's torch chunked rule on repeated key heads) against stock's per-token torch rule on the
    key heads repeated here: checks the head grouping."""
    q, k, v, gate, beta = rule_inputs("cpu", torch.float32, 2, 37, 2, 8, 6, 4)
    o, state = fused_ops.gated_delta_rule_prefill_ref(q, k, v, gate, beta, output_final_state=True)
    rule = inspect.unwrap(modeling_qwen3_5.torch_recurrent_gated_delta_rule)
    want_o, want_state = rule(q.repeat_interleave(3, dim=2), k.repeat_interleave(3, dim=2), v, g=gate, beta=beta,
                              initial_state=None, output_final_state=True, use_qk_l2norm_in_kernel=False)
    assert o.shape == (2, 37, 6, 4) and state.shape == (2, 6, 8, 4)
    assert_close("o", o, want_o, 1e-5)
    assert_close("state", state, want_state, 1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("T", [1, 7, 129, 2048])
@pytest.mark.parametrize("HV", [16, 32, 48])
def test_gated_delta_rule_prefill(dtype, T, HV):
    """fp32 (per-token kernel) <= 2e-5 from the torch reference; bf16 / fp16 (chunked kernel) within their bounds."""
    inputs = rule_inputs("cuda", dtype, 1 if T == 2048 else 2, T, 16, 128, HV, 128)
    o, state = fused_ops.gated_delta_rule_prefill(*inputs, output_final_state=True)
    ref = fused_ops.gated_delta_rule_prefill_ref(*[t.float() for t in inputs], output_final_state=True)
    bound = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}[dtype]
    assert o.dtype == dtype and state.dtype == torch.float32
    assert_close("o", o.float(), ref[0], bound)
    assert_close("state", state, ref[1], bound)


@pytest.mark.cuda
def test_gated_delta_rule_prefill_tf32_allowed_uses_chunk(matmul_precision):
    """With TF32 allowed, fp32 takes the chunked kernel: within TF32's reach of the reference, not fp32's."""
    matmul_precision("high")
    inputs = rule_inputs("cuda", torch.float32, 1, 129, 16, 128, 32, 128)
    o, _ = fused_ops.gated_delta_rule_prefill(*inputs)
    ref, _ = fused_ops.gated_delta_rule_prefill_ref(*inputs)
    assert_close("o", o, ref, 1e-2)
