"""Tests of the Gated DeltaNet decode-step ops in `fused_ops.py` (`causal_conv1d_step`, `gated_delta_rule_step`)
against the stock transformers Qwen3.5 code, and against each op's `_ref`.

Stock code: `causal_conv1d_update` and `torch_recurrent_gated_delta_rule` of `modeling_qwen3_5`, taken through
`inspect.unwrap` because with fla installed transformers routes those names to fla's kernels; the gate and beta are
computed as stock `Qwen3_5GatedDeltaNet.forward` does, and q / k are repeated over the value heads before the stock
call as transformers 5.17 does in `forward` (5.24 does it inside the function, a no-op once repeated).

Every check runs STEPS consecutive decode steps, feeding each op's own state back, and compares after every step;
inputs are strided column slices of wider buffers (as the model will pass them) and the state must keep its address.

CPU tests run the kernels under the Triton interpreter (`TRITON_INTERPRET=1`, set in conftest.py) on tiny shapes
(the file takes about 25 s on 2 busy cores, 5 s of it compiling the kernels for sm_90 in a subprocess); the
`@pytest.mark.cuda` tests run the real Qwen3.5 shapes, CUDA-graph capture and allocation counts:
`python -m pytest tests/ops/test_decode_ops.py -m cuda`.

Error bounds (relative, `helpers.rel_err`; `BOUNDS["kernel"]` in helpers.py), and why:
- fp32 <= 1e-6, for outputs and for the recurrent state (fp32 whatever the input dtype): the kernels sum in another
  order than torch and, on the GPU, use approximate exp / log / rsqrt / division; that moves results by a few fp32
  units in the last place (~1e-7), and the gated delta rule does not amplify it over steps (the decay is <= 1 and,
  with an L2-normalised k and beta in [0, 1], the update `S (I - beta k k^T)` is a contraction).
- bf16 <= 1e-2, fp16 <= 1e-3 for outputs: the kernels round to the dtype exactly where stock rounds, so the only
  differences are the fp32 wobbles above flipping a rounding decision now and then, which changes an element by one
  unit in the last place: at most 2^-7 (bf16) or 2^-10 (fp16) of its value. The bounds would allow every element to
  be one unit off; measured on CPU: conv 0, delta rule up to 1.2e-5 (bf16) and 5.1e-5 (fp16) (fp32 at most 3.4e-7,
  the state 1.7e-7). Where the conv weight is narrower than x, its dtype's bound applies (stock rounds to it).
- The conv state is a pure copy of rounded inputs: bit-exact.
- The fp32 state bound holds for bf16 / fp16 inputs too because the test keeps `b` away from the few values where
  the rounding of beta = sigmoid(b) to b's dtype is a coin toss (`away_from_ties`).
"""

import inspect

import pytest
import torch
import torch.nn.functional as F

from helpers import BOUNDS, DTYPE_IDS, DTYPES, assert_close, assert_exact, compile_for_sm90, fused_ops
from helpers import needs_interpreter, rel_err
from scripts.common import import_module
from transformers.models.qwen3_5 import modeling_qwen3_5

fused_ops_runtime = import_module("fused_ops_runtime")
fused_ops_gemv = import_module("fused_ops_gemv")

STOCK_CONV_UPDATE = inspect.unwrap(modeling_qwen3_5.causal_conv1d_update)
STOCK_RECURRENT_GDR = inspect.unwrap(modeling_qwen3_5.torch_recurrent_gated_delta_rule)

BOUND = BOUNDS["kernel"]
STEPS = 5
# columns of padding on each side of the strided input slices
PAD = 8


@pytest.fixture(autouse=True)
def _set_up():
    """Skip without triton; run stock fp32 convolutions in true fp32 (cuDNN may otherwise pick TF32); one CPU
    thread, because stock's bf16 / fp16 CPU conv1d spins its OpenMP threads: on 2 busy cores one [3, 300] call took
    4.8 s with 2 threads and 5 ms with 1."""
    if not fused_ops.HAS_TRITON:
        pytest.skip("triton is not installed")
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32, torch.get_num_threads()
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    torch.set_num_threads(1)
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved[:2]
    torch.set_num_threads(saved[2])


def column_slice(B: int, N: int, dtype, device, gen) -> torch.Tensor:
    """Standard-normal [B, N] as columns [PAD, PAD + N) of a [B, N + 2 * PAD] buffer (row stride N + 2 * PAD)."""
    buf = torch.randn(B, N + 2 * PAD, generator=gen).to(device=device, dtype=dtype)
    return buf[:, PAD : PAD + N]


def nan_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan"))


def away_from_ties(b: torch.Tensor) -> torch.Tensor:
    """`b` (bfloat16 / float16) with every element whose sigmoid lies within 1/64 of a unit of a rounding tie of b's
    dtype moved until it does not. beta = sigmoid(b) is rounded to b's dtype (as stock does); at a tie, the last fp32
    bit of the sigmoid (the GPU kernel's approximate exp and division vs torch's) decides the rounding, and beta one
    unit apart (2^-8 / 2^-11 of its value) would move the fp32 state far past its 1e-6 bound: a difference of math
    libraries, not of the kernel. (The fp32 sigmoids differ by ~1e-6 of their value: at most 2e-3 of a unit.)"""
    if b.dtype == torch.float32:
        return b
    bits = {torch.bfloat16: 8, torch.float16: 11}[b.dtype]  # significand bits, the implicit one included
    for _ in range(16):
        s = torch.sigmoid(b.double())
        _, e = torch.frexp(s)  # s in [2^(e-1), 2^e): one unit of the dtype is 2^(e - bits)
        frac = torch.remainder(s / torch.ldexp(torch.ones_like(s), e - bits), 1.0)
        close = (frac - 0.5).abs() < 1 / 64
        if not close.any():
            return b
        b = torch.where(close, (b.float() + 0.1).to(b.dtype), b)
    raise AssertionError("could not move b away from the rounding ties of its sigmoid")


# ---------------------------------------------------------------------------------------------------------------------
# Stock steps
# ---------------------------------------------------------------------------------------------------------------------


def stock_conv_step(x, conv_state, weight, bias):
    """Stock single-token conv update: x [B, D] -> [B, D]; conv_state [B, D, W] updated in place."""
    return STOCK_CONV_UPDATE(x[:, :, None], conv_state, weight, bias, "silu")[:, :, 0]


def stock_gdr_step(q, k, v, a, b, A_log, dt_bias, state):
    """Stock gate, beta and recurrent gated delta rule at T=1: returns (o [B, HV, V], new state)."""
    beta = b.sigmoid()
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    group = v.shape[1] // q.shape[1]
    q, k = q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)
    o, new_state = STOCK_RECURRENT_GDR(
        q[:, None], k[:, None], v[:, None], g=g[:, None], beta=beta[:, None], initial_state=state,
        output_final_state=True, use_qk_l2norm_in_kernel=True,
    )
    return o[:, 0], new_state


# ---------------------------------------------------------------------------------------------------------------------
# Shared checks (CPU and CUDA tests call the same ones with different sizes)
# ---------------------------------------------------------------------------------------------------------------------


def conv_params(device, dtype, D, W, bias, weight_dtype, gen):
    weight = (torch.randn(D, W, generator=gen) * 0.5).to(device=device, dtype=weight_dtype or dtype)
    b = (torch.randn(D, generator=gen) * 0.1).to(device=device, dtype=weight_dtype or dtype) if bias else None
    return weight, b


def check_conv_step(device, dtype, B, D, W=4, bias=False, weight_dtype=None, state_dtype=None, use_out=False):
    gen = torch.Generator().manual_seed(0)
    weight, b = conv_params(device, dtype, D, W, bias, weight_dtype, gen)
    state = torch.randn(B, D, W, generator=gen).to(device=device, dtype=state_dtype or dtype)
    state_stock, state_ref = state.clone(), state.clone()
    ptr = state.data_ptr()
    out = torch.empty(B, 2 * D, dtype=dtype, device=device)[:, D:] if use_out else None  # strided out

    for step in range(STEPS):
        x = column_slice(B, D, dtype, device, gen)
        if out is not None:
            out.fill_(float("nan"))
        y = fused_ops.causal_conv1d_step(x, state, weight, b, out=out)
        y_stock = stock_conv_step(x, state_stock, weight, b)
        y_ref = fused_ops.causal_conv1d_step_ref(x, state_ref, weight, b)

        at = f"step {step}"
        assert state.data_ptr() == ptr, f"{at}: conv_state was not updated in place"
        if out is not None:
            assert y is out, f"{at}: out= was not returned"
        else:
            assert y.is_contiguous()
        assert_exact(f"{at}: conv_state vs stock", state, state_stock)
        assert_exact(f"{at}: conv_state vs ref", state, state_ref)
        # stock rounds the conv output and the SiLU to the weight dtype: a narrower weight sets the bound
        bound = max(BOUND[dtype], BOUND[weight.dtype])
        assert_close(f"{at}: y vs stock causal_conv1d_update", y, y_stock, bound)
        assert_close(f"{at}: y vs causal_conv1d_step_ref", y, y_ref, bound)


def check_conv_steps(device, dtype, B, T, D, W=4, bias=False, weight_dtype=None, save=True):
    """`causal_conv1d_steps` over T tokens (x a strided [B, T, D] slice, as the verify pass's projection columns)
    against T calls of the single-token kernel and its reference: each token's output, the final state and (with
    ``save``) the state after each token, exact where the single-token step is exact."""
    gen = torch.Generator().manual_seed(2)
    weight, b = conv_params(device, dtype, D, W, bias, weight_dtype, gen)
    state = torch.randn(B, D, W, generator=gen).to(device=device, dtype=dtype)
    state_steps, state_ref = state.clone(), state.clone()
    x = column_slice(B * T, D, dtype, device, gen).unflatten(0, (B, T))  # [B, T, D], row stride D + 2 * PAD
    saved = torch.full((T, B, D, W), float("nan"), dtype=dtype, device=device) if save else None
    saved_ref = torch.empty(T, B, D, W, dtype=dtype, device=device) if save else None
    ptr = state.data_ptr()
    y = fused_ops.causal_conv1d_steps(x, state, weight, b, saved=saved)
    y_ref = fused_ops.causal_conv1d_steps_ref(x, state_ref, weight, b, saved=saved_ref)
    assert y.shape == (B, T, D) and y.is_contiguous() and state.data_ptr() == ptr
    for t in range(T):
        y_t = fused_ops.causal_conv1d_step(x[:, t], state_steps, weight, b)
        assert_exact(f"token {t}: y vs the single-token kernel", y[:, t], y_t)
        if save:
            assert_exact(f"token {t}: saved state vs the single-token kernel's", saved[t], state_steps)
            assert_exact(f"token {t}: saved state vs ref", saved[t], saved_ref[t])
    assert_exact("final state vs the single-token kernel's", state, state_steps)
    assert_exact("final state vs ref", state, state_ref)
    assert_close("y vs ref", y, y_ref, max(BOUND[dtype], BOUND[weight.dtype]))


def gdr_params(device, dtype, HV, gen):
    """A_log and dt_bias as stock initialises them (A uniform in [0.01, 16]), dt_bias spread to cover softplus."""
    A_log = torch.empty(HV).uniform_(0.01, 16, generator=gen).log().to(device=device, dtype=dtype)
    dt_bias = (1.0 + torch.randn(HV, generator=gen)).to(device=device, dtype=dtype)
    return A_log, dt_bias


def gdr_inputs(device, dtype, B, H, HV, K, V, gen, a_transposed=False):
    """q, k, v as [B, heads, dim] views of one strided [B, 2*H*K + HV*V] row (the conv output layout), and a, b as
    column slices of one [B, 2*HV] projection row (or, with `a_transposed`, a as a transposed [HV, B] tensor)."""
    qkv = column_slice(B, 2 * H * K + HV * V, dtype, device, gen)
    q = qkv[:, : H * K].unflatten(1, (H, K))
    k = qkv[:, H * K : 2 * H * K].unflatten(1, (H, K))
    v = qkv[:, 2 * H * K :].unflatten(1, (HV, V))
    ab = column_slice(B, 2 * HV, dtype, device, gen) * 2.0
    a, b = ab[:, :HV], ab[:, HV:]
    b.copy_(away_from_ties(b))
    if a_transposed:
        a = (torch.randn(HV, B, generator=gen) * 2.0).to(device=device, dtype=dtype).t()
    return q, k, v, a, b


def check_gdr_step(device, dtype, B, H, HV, K, V, use_out=False, strided_state=False, a_transposed=False,
                   prefetch=False):
    """With `prefetch`, the state loads before the PDL wait (`prefetch_state`): safe here because the inputs of each
    step are made by torch kernels, which end any chain of early launches, after the step before."""
    gen = torch.Generator().manual_seed(0)
    A_log, dt_bias = gdr_params(device, dtype, HV, gen)
    if strided_state:  # [B, HV, K, V] inside a [B, HV, K, V + 8] buffer
        state = torch.empty(B, HV, K, V + 8, device=device)[..., :V]
        state.copy_(torch.randn(B, HV, K, V, generator=gen) * 0.1)
    else:
        state = (torch.randn(B, HV, K, V, generator=gen) * 0.1).to(device)
    state_stock, state_ref = state.clone(), state.clone()
    ptr = state.data_ptr()
    out = torch.empty(B, HV, 2 * V, dtype=dtype, device=device)[..., V:] if use_out else None  # strided out

    for step in range(STEPS):
        q, k, v, a, b = gdr_inputs(device, dtype, B, H, HV, K, V, gen, a_transposed)
        if out is not None:
            out.fill_(float("nan"))
        o = fused_ops.gated_delta_rule_step(q, k, v, a, b, A_log, dt_bias, state, out=out, prefetch_state=prefetch)
        o_stock, state_stock = stock_gdr_step(q, k, v, a, b, A_log, dt_bias, state_stock)
        o_ref = fused_ops.gated_delta_rule_step_ref(q, k, v, a, b, A_log, dt_bias, state_ref)

        at = f"step {step}"
        assert state.data_ptr() == ptr, f"{at}: state was not updated in place"
        if out is not None:
            assert o is out, f"{at}: out= was not returned"
        else:
            assert o.is_contiguous()
        assert_close(f"{at}: state vs stock", state, state_stock, BOUND)
        assert_close(f"{at}: state vs ref", state, state_ref, BOUND)
        assert_close(f"{at}: o vs stock torch_recurrent_gated_delta_rule", o, o_stock.to(dtype), BOUND)
        assert_close(f"{at}: o vs gated_delta_rule_step_ref", o, o_ref, BOUND)


def check_gdr_steps(device, dtype, B, T, H, HV, K, V, save=True):
    """`gated_delta_rule_steps` over T tokens (inputs as the verify pass lays them out: q / k / v views of a strided
    [B, T, 2HK + HV*V] conv output, a / b column slices of a [B, T, 2HV] projection) against T calls of the
    single-token kernel and against its reference: every token's output, the final state and (with ``save``) the
    state after each token."""
    gen = torch.Generator().manual_seed(1)
    A_log, dt_bias = gdr_params(device, dtype, HV, gen)
    state = (torch.randn(B, HV, K, V, generator=gen) * 0.1).to(device)
    state_steps, state_ref = state.clone(), state.clone()
    D = 2 * H * K + HV * V
    qkv = column_slice(B * T, D, dtype, device, gen).unflatten(0, (B, T))  # [B, T, D], row stride D + 2 * PAD
    q = qkv[..., : H * K].unflatten(2, (H, K))
    k = qkv[..., H * K : 2 * H * K].unflatten(2, (H, K))
    v = qkv[..., 2 * H * K :].unflatten(2, (HV, V))
    ab = column_slice(B * T, 2 * HV, dtype, device, gen).unflatten(0, (B, T)) * 2.0
    a, b = ab[..., :HV], ab[..., HV:]
    b.copy_(away_from_ties(b))
    saved = torch.full((T, B, HV, K, V), float("nan"), device=device) if save else None
    saved_ref = torch.empty(T, B, HV, K, V, device=device) if save else None
    ptr = state.data_ptr()
    o = fused_ops.gated_delta_rule_steps(q, k, v, a, b, A_log, dt_bias, state, saved=saved)
    o_ref = fused_ops.gated_delta_rule_steps_ref(q, k, v, a, b, A_log, dt_bias, state_ref, saved=saved_ref)
    assert o.shape == (B, T, HV, V) and o.is_contiguous() and state.data_ptr() == ptr
    for t in range(T):
        o_t = fused_ops.gated_delta_rule_step(q[:, t], k[:, t], v[:, t], a[:, t], b[:, t], A_log, dt_bias,
                                              state_steps)
        assert_close(f"token {t}: o vs the single-token kernel", o[:, t], o_t, BOUND)
        if save:
            assert_close(f"token {t}: saved state vs the single-token kernel's", saved[t], state_steps, BOUND)
            assert_close(f"token {t}: saved state vs ref", saved[t], saved_ref[t], BOUND)
    assert_close("o vs ref", o, o_ref, BOUND)
    assert_close("final state vs the single-token kernel's", state, state_steps, BOUND)
    assert_close("final state vs ref", state, state_ref, BOUND)


def check_decode_chain(device, dtype, B, H, HV, K, V, W=4, steps=STEPS, graph=False):
    """The two ops wired as the model will: conv on a column slice of the projection output, q / k / v as views of
    the conv output, a / b as column slices, all outputs through `out=`. With `graph`, the steps replay a CUDA graph
    captured once over fixed buffers whose contents each step overwrites. Compared with stock after every step."""
    gen = torch.Generator().manual_seed(0)
    D = 2 * H * K + HV * V
    weight, _ = conv_params(device, dtype, D, W, False, None, gen)
    A_log, dt_bias = gdr_params(device, dtype, HV, gen)
    conv_state = torch.randn(B, D, W, generator=gen).to(device=device, dtype=dtype)
    state = (torch.randn(B, HV, K, V, generator=gen) * 0.1).to(device)
    conv_state_stock, state_stock = conv_state.clone(), state.clone()

    proj = torch.zeros(B, D + 2 * HV + PAD, dtype=dtype, device=device)  # stands for the fused in-projection row
    x, a, b = proj[:, :D], proj[:, D : D + HV], proj[:, D + HV : D + 2 * HV]
    y = torch.empty(B, D, dtype=dtype, device=device)
    q = y[:, : H * K].unflatten(1, (H, K))
    k = y[:, H * K : 2 * H * K].unflatten(1, (H, K))
    v = y[:, 2 * H * K :].unflatten(1, (HV, V))
    o = torch.empty(B, HV, V, dtype=dtype, device=device)

    def step():
        fused_ops.causal_conv1d_step(x, conv_state, weight, out=y)
        fused_ops.gated_delta_rule_step(q, k, v, a, b, A_log, dt_bias, state, out=o)

    if graph:
        saved = conv_state.clone(), state.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compile and warm up outside the capture
            step()
        torch.cuda.current_stream().wait_stream(side)
        conv_state.copy_(saved[0])
        state.copy_(saved[1])
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            step()

    for i in range(steps):
        proj.copy_(torch.randn(B, proj.shape[1], generator=gen).to(device=device, dtype=dtype))
        b.copy_(away_from_ties(b))
        if graph:
            cuda_graph.replay()
        else:
            step()
        y_stock = stock_conv_step(x, conv_state_stock, weight, None)
        # stock's delta rule reads our conv output (the q / k / v views), so that a rounding flip in the conv output
        # (see the bounds above) does not show up as an fp32-sized state difference
        o_stock, state_stock = stock_gdr_step(q, k, v, a, b, A_log, dt_bias, state_stock)

        at = f"step {i}"
        assert_exact(f"{at}: conv_state vs stock", conv_state, conv_state_stock)
        assert_close(f"{at}: conv out vs stock", y, y_stock, BOUND)
        assert_close(f"{at}: state vs stock", state, state_stock, BOUND)
        assert_close(f"{at}: o vs stock", o, o_stock, BOUND)


# ---------------------------------------------------------------------------------------------------------------------
# CPU tests (interpreter): tiny shapes, odd sizes
# ---------------------------------------------------------------------------------------------------------------------


@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(
    "B, D, W, bias, use_out",
    [(1, 40, 4, False, False), (3, 300, 4, True, True)],
    ids=["B1-D40-W4", "B3-D300-W4-bias-out"],
)
def test_causal_conv1d_step_cpu(dtype, B, D, W, bias, use_out):
    check_conv_step("cpu", dtype, B, D, W, bias=bias, use_out=use_out)


@needs_interpreter
def test_causal_conv1d_step_odd_kernel_size():
    """W=3: a tap count that is not a power of two (masked taps)."""
    check_conv_step("cpu", torch.bfloat16, 2, 24, W=3)


@needs_interpreter
@pytest.mark.parametrize(
    "dtype, weight_dtype, state_dtype",
    [
        (torch.bfloat16, torch.float32, torch.bfloat16),
        (torch.bfloat16, torch.bfloat16, torch.float32),
        (torch.float32, torch.float16, torch.float32),
    ],
    ids=["x-bf16-w-fp32", "x-bf16-state-fp32", "x-fp32-w-fp16"],
)
def test_causal_conv1d_step_mixed_dtypes_cpu(dtype, weight_dtype, state_dtype):
    check_conv_step("cpu", dtype, 2, 40, bias=True, weight_dtype=weight_dtype, state_dtype=state_dtype)


@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(
    "B, H, HV, K, V",
    [(1, 2, 2, 32, 32), (2, 1, 2, 32, 32), (2, 1, 3, 24, 48)],
    ids=["B1-H2-HV2-K32-V32", "B2-H1-HV2-K32-V32", "B2-H1-HV3-K24-V48"],
)
def test_gated_delta_rule_step_cpu(dtype, B, H, HV, K, V):
    check_gdr_step("cpu", dtype, B, H, HV, K, V)


def check_gdr_step_live(device, dtype, B, live, prefetch=False):
    """``live``: rows 0..live-1 step as without it; the rest get zeros and keep their state bit for bit."""
    gen = torch.Generator().manual_seed(2)
    H, HV, K, V = 1, 2, 32, 32
    A_log, dt_bias = gdr_params(device, dtype, HV, gen)
    state = (torch.randn(B, HV, K, V, generator=gen) * 0.1).to(device)
    before, state_ref = state.clone(), state.clone()
    q, k, v, a, b = gdr_inputs(device, dtype, B, H, HV, K, V, gen)
    n = torch.tensor([live], device=device)
    o = fused_ops.gated_delta_rule_step(q, k, v, a, b, A_log, dt_bias, state, prefetch_state=prefetch, live=n)
    o_ref = fused_ops.gated_delta_rule_step_ref(q, k, v, a, b, A_log, dt_bias, state_ref)
    assert_close("live rows' output", o[:live], o_ref[:live], BOUND)
    assert_close("live rows' state", state[:live], state_ref[:live], BOUND)
    assert (o[live:] == 0).all(), "a row past live was not zeroed"
    assert torch.equal(state[live:], before[live:]), "a row past live had its state written"
    o_emulated = fused_ops.gated_delta_rule_step_ref(q, k, v, a, b, A_log, dt_bias, before, live=n)
    assert_close("the reference with live", o_emulated, o, BOUND)
    assert torch.equal(before[live:], state[live:])


@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("live", [0, 2, 4])
def test_gated_delta_rule_step_live_rows_cpu(dtype, live):
    check_gdr_step_live("cpu", dtype, 4, live)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("prefetch", [False, True])
def test_gated_delta_rule_step_live_rows_cuda(dtype, prefetch):
    check_gdr_step_live("cuda", dtype, 8, 3, prefetch=prefetch)


@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(
    "B, T, D, W, bias, save",
    [(1, 4, 40, 4, False, True), (2, 3, 300, 4, True, True), (2, 2, 40, 3, False, False), (1, 1, 40, 4, False, True)],
    ids=["B1-T4", "B2-T3-D300-bias", "B2-T2-W3-nosave", "B1-T1"],
)
def test_causal_conv1d_steps_cpu(dtype, B, T, D, W, bias, save):
    check_conv_steps("cpu", dtype, B, T, D, W, bias, save=save)


@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(
    "B, T, H, HV, K, V, save",
    [(1, 4, 2, 2, 32, 32, True), (2, 3, 1, 3, 24, 48, True), (2, 2, 1, 2, 16, 32, False), (1, 1, 1, 2, 16, 32, True)],
    ids=["B1-T4", "B2-T3-HV3-K24-V48", "B2-T2-nosave", "B1-T1"],
)
def test_gated_delta_rule_steps_cpu(dtype, B, T, H, HV, K, V, save):
    check_gdr_steps("cpu", dtype, B, T, H, HV, K, V, save)


@needs_interpreter
def test_gated_delta_rule_step_strided_state_and_out():
    """A state with a row stride past V, a transposed `a`, and a strided `out=`."""
    check_gdr_step("cpu", torch.bfloat16, 2, 1, 2, 16, 32, use_out=True, strided_state=True, a_transposed=True)


@needs_interpreter
def test_gated_delta_rule_step_prefetch_flag():
    """`prefetch_state` is taken everywhere (it changes only where the state loads under PDL, which the sm_90 compile
    test checks in the PTX; the CUDA test runs it)."""
    check_gdr_step("cpu", torch.float32, 2, 1, 2, 16, 32, prefetch=True)


@needs_interpreter
def test_gated_delta_rule_step_scale():
    """A non-default scale (stock has none to compare with: checked against the ref)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v, a, b = gdr_inputs("cpu", torch.float32, 1, 1, 2, 16, 16, gen)
    A_log, dt_bias = gdr_params("cpu", torch.float32, 2, gen)
    state = torch.randn(1, 2, 16, 16, generator=gen)
    state_ref = state.clone()
    o = fused_ops.gated_delta_rule_step(q, k, v, a, b, A_log, dt_bias, state, scale=0.3)
    o_ref = fused_ops.gated_delta_rule_step_ref(q, k, v, a, b, A_log, dt_bias, state_ref, scale=0.3)
    assert_close("state vs ref", state, state_ref, BOUND)
    assert_close("o vs ref", o, o_ref, BOUND)


@needs_interpreter
@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the interpreter's numpy exp, on purpose
def test_gated_delta_rule_step_extreme_gates():
    """softplus past its threshold (a + dt_bias > 20), far below zero (exp underflow), and saturated beta."""
    gen = torch.Generator().manual_seed(0)
    q, k, v, _, _ = gdr_inputs("cpu", torch.float32, 1, 1, 4, 16, 16, gen)
    a = torch.tensor([[30.0, -40.0, 0.5, -3.0]])
    b = torch.tensor([[90.0, -90.0, 0.0, 1.0]])
    A_log = torch.tensor([-4.0, 2.0, 0.0, 1.0])
    dt_bias = torch.zeros(4)
    state = torch.randn(1, 4, 16, 16, generator=gen)
    state_stock = state.clone()
    o = fused_ops.gated_delta_rule_step(q, k, v, a, b, A_log, dt_bias, state)
    o_stock, state_stock = stock_gdr_step(q, k, v, a, b, A_log, dt_bias, state_stock)
    assert_close("state vs stock", state, state_stock, BOUND)
    assert_close("o vs stock", o, o_stock, BOUND)


@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_decode_chain(dtype):
    check_decode_chain("cpu", dtype, 2, 1, 2, 16, 16, steps=3)


@needs_interpreter
def test_out_is_filled_and_returned():
    """With `out=`, the ops return that very tensor, fully written, and keep every other tensor where it was."""
    gen = torch.Generator().manual_seed(0)
    x = column_slice(2, 40, torch.bfloat16, "cpu", gen)
    conv_state = torch.randn(2, 40, 4, generator=gen).bfloat16()
    weight = torch.randn(40, 4, generator=gen).bfloat16()
    y = nan_like(x.contiguous())
    ptrs = y.data_ptr(), conv_state.data_ptr()
    assert fused_ops.causal_conv1d_step(x, conv_state, weight, out=y) is y
    assert (y.data_ptr(), conv_state.data_ptr()) == ptrs and not y.isnan().any()

    q, k, v, a, b = gdr_inputs("cpu", torch.float16, 2, 1, 2, 16, 16, gen)
    A_log, dt_bias = gdr_params("cpu", torch.float16, 2, gen)
    state = torch.randn(2, 2, 16, 16, generator=gen)
    o = torch.full((2, 2, 16), float("nan"), dtype=torch.float16)
    ptrs = o.data_ptr(), state.data_ptr()
    assert fused_ops.gated_delta_rule_step(q, k, v, a, b, A_log, dt_bias, state, out=o) is o
    assert (o.data_ptr(), state.data_ptr()) == ptrs and not o.isnan().any()


@needs_interpreter
def test_empty_batch():
    assert fused_ops.causal_conv1d_step(torch.randn(0, 8), torch.randn(0, 8, 4), torch.randn(8, 4)).shape == (0, 8)
    q = torch.randn(0, 1, 8)
    o = fused_ops.gated_delta_rule_step(
        q, q, torch.randn(0, 2, 8), torch.randn(0, 2), torch.randn(0, 2), torch.zeros(2), torch.zeros(2),
        torch.randn(0, 2, 8, 8),
    )
    assert o.shape == (0, 2, 8)


def _conv(x=(2, 16), state=(2, 16, 4), weight=(16, 4), bias=None, out=None, dtype=torch.float32, state_dtype=None):
    return fused_ops.causal_conv1d_step(
        torch.randn(x, dtype=dtype), torch.randn(state).to(state_dtype or dtype), torch.randn(weight),
        None if bias is None else torch.randn(bias), out=out,
    )


def _gdr(B=2, H=1, HV=2, K=8, V=8, a=None, A_log=None, state=None, out=None, dtype=torch.float32, v_dtype=None):
    return fused_ops.gated_delta_rule_step(
        torch.randn(B, H, K, dtype=dtype), torch.randn(B, H, K, dtype=dtype),
        torch.randn(B, HV, V, dtype=v_dtype or dtype),
        torch.randn(a or (B, HV)), torch.randn(B, HV), torch.zeros(A_log or HV), torch.zeros(HV),
        state if state is not None else torch.randn(B, HV, K, V), out=out,
    )


BAD_INPUTS = {
    "conv-x-3d": (lambda: _conv(x=(2, 16, 1)), r"x must be \[B, D\], got shape \(2, 16, 1\)"),
    "conv-x-fp64": (lambda: _conv(dtype=torch.float64), "x must be float32, bfloat16 or float16, got torch.float64"),
    "conv-state-shape": (
        lambda: _conv(state=(2, 15, 4)), r"conv_state must be \[B, D, W\] = \[2, 16, W\].*\(2, 15, 4\)"
    ),
    "conv-state-int": (lambda: _conv(state_dtype=torch.int32), "conv_state must be float32.*torch.int32"),
    "conv-weight-W": (lambda: _conv(weight=(16, 3)), r"weight must be \[D, W\] = \(16, 4\).*got \(16, 3\)"),
    "conv-bias-shape": (lambda: _conv(bias=(15,)), r"bias must have shape \(16,\), got \(15,\)"),
    "conv-out-dtype": (
        lambda: _conv(out=torch.empty(2, 16, dtype=torch.float16)),
        r"out must be \[B, D\] = \(2, 16\) in x's dtype torch.float32, got \(2, 16\) torch.float16",
    ),
    "conv-x-strided-last-dim": (
        lambda: fused_ops.causal_conv1d_step(torch.randn(16, 2).t(), torch.randn(2, 16, 4), torch.randn(16, 4)),
        "x must have a contiguous last dim",
    ),
    "gdr-k-shape": (
        lambda: fused_ops.gated_delta_rule_step(
            torch.randn(2, 1, 8), torch.randn(2, 1, 9), torch.randn(2, 2, 8), torch.randn(2, 2), torch.randn(2, 2),
            torch.zeros(2), torch.zeros(2), torch.randn(2, 2, 8, 8),
        ),
        r"q and k must both be \[B, H, K\], got \(2, 1, 8\) and \(2, 1, 9\)",
    ),
    "gdr-HV-not-multiple": (lambda: _gdr(H=2, HV=3), r"HV a multiple of H = 2.*got \(2, 3, 8\)"),
    "gdr-K-too-large": (lambda: _gdr(K=512, state=torch.empty(0)), r"K must be in \[1, 256\].*K=512"),
    "gdr-v-dtype": (
        lambda: _gdr(v_dtype=torch.float16),
        "q, k, v must have one dtype, got torch.float32, torch.float32, torch.float16",
    ),
    "gdr-a-shape": (lambda: _gdr(a=(2, 3)), r"a must be \[B, HV\] = \(2, 2\).*got \(2, 3\)"),
    "gdr-A_log-shape": (lambda: _gdr(A_log=3), r"A_log must have shape \(2,\).*got \(3,\)"),
    "gdr-state-bf16": (
        lambda: _gdr(state=torch.randn(2, 2, 8, 8, dtype=torch.bfloat16)),
        r"state must be \[B, HV, K, V\] = \(2, 2, 8, 8\) float32, got \(2, 2, 8, 8\) torch.bfloat16",
    ),
    "gdr-state-shape": (lambda: _gdr(state=torch.randn(2, 2, 8, 7)), r"state must be .* got \(2, 2, 8, 7\)"),
    "gdr-state-strided-last-dim": (
        lambda: _gdr(state=torch.randn(2, 2, 8, 8).transpose(2, 3)), "state must have a contiguous last dim"
    ),
    "gdr-out-shape": (
        lambda: _gdr(out=torch.empty(2, 2, 7)), r"out must be \[B, HV, V\] = \(2, 2, 8\) in q's dtype.*\(2, 2, 7\)"
    ),
    "gdr-steps-a-shape": (
        lambda: fused_ops.gated_delta_rule_steps(
            torch.randn(2, 3, 1, 8), torch.randn(2, 3, 1, 8), torch.randn(2, 3, 2, 8), torch.randn(2, 2, 2),
            torch.randn(2, 3, 2), torch.zeros(2), torch.zeros(2), torch.randn(2, 2, 8, 8),
        ),
        r"a must be \[B, T, HV\] = \(2, 3, 2\).*got \(2, 2, 2\)",
    ),
    "gdr-steps-saved-shape": (
        lambda: fused_ops.gated_delta_rule_steps(
            torch.randn(2, 3, 1, 8), torch.randn(2, 3, 1, 8), torch.randn(2, 3, 2, 8), torch.randn(2, 3, 2),
            torch.randn(2, 3, 2), torch.zeros(2), torch.zeros(2), torch.randn(2, 2, 8, 8),
            saved=torch.empty(2, 2, 2, 8, 8),
        ),
        r"saved must be \[T, B, HV, K, V\] = \(3, 2, 2, 8, 8\) float32, got \(2, 2, 2, 8, 8\)",
    ),
    "conv-steps-x-2d": (
        lambda: fused_ops.causal_conv1d_steps(torch.randn(2, 16), torch.randn(2, 16, 4), torch.randn(16, 4)),
        r"x must be \[B, T, D\], got shape \(2, 16\)",
    ),
    "conv-steps-saved-dtype": (
        lambda: fused_ops.causal_conv1d_steps(torch.randn(2, 3, 16), torch.randn(2, 16, 4), torch.randn(16, 4),
                                              saved=torch.empty(3, 2, 16, 4, dtype=torch.float16)),
        r"saved must be \[T, B, D, W\] = \(3, 2, 16, 4\) in conv_state's dtype torch.float32",
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_rejects_bad_inputs(case):
    call, match = BAD_INPUTS[case]
    with pytest.raises(ValueError, match=match):
        call()


# ---------------------------------------------------------------------------------------------------------------------
# The decode-batch linear (`gemv`, `small_linear`)
# ---------------------------------------------------------------------------------------------------------------------


def check_gemv(device, dtype, M, N, K, gate_up, config=None, seed=0, op="gemv"):
    """`gemv` (or `op`, e.g. "skinny_gemm") on a strided x (a column slice of a wider buffer, as the step passes it)
    against its `_ref`; no element left unwritten (NaN)."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(M, K + 24, generator=gen) * 0.5).to(device, dtype)[:, 8 : 8 + K]
    w = (torch.randn(2 * N if gate_up else N, K, generator=gen) / K**0.5).to(device, dtype)
    y = getattr(fused_ops, op)(x, w, gate_up, config)
    want = getattr(fused_ops, op + "_ref")(x, w, gate_up)
    assert y.shape == want.shape and y.dtype == dtype and y.is_contiguous()
    assert not y.isnan().any()
    err = rel_err(y.float(), want.float())
    assert err <= BOUND[dtype], f"rel_err {err:.3g} > {BOUND[dtype]:g}"


@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("M,N,K", [(1, 5, 16), (3, 37, 70), (8, 9, 33)])
@pytest.mark.parametrize("gate_up", [False, True], ids=["linear", "gate_up"])
def test_gemv_cpu(dtype, M, N, K, gate_up):
    check_gemv("cpu", dtype, M, N, K, gate_up, config=(4, 32, 1))


@needs_interpreter
@pytest.mark.parametrize("config", [(8, 16, 1), (4, 64, 2), (4, 16, 1, True), (4, 16, 1, False), (4, 16, 1, False, 2),
                                    (2, 8, 1, True, 3), (4, 16, 1, False, 4)])
@pytest.mark.parametrize("M", [1, 2])
def test_gemv_configs(config, M):
    """Every config field on CPU (interpreter): K = 50 over tiles of 8 / 16 / 64 leaves a partial tile, and with
    `unroll` a partial unrolled step."""
    check_gemv("cpu", torch.bfloat16, M, 21, 50, True, config=config)
    check_gemv("cpu", torch.float32, M, 21, 50, False, config=config)


def test_gemv_late_trigger_decision(monkeypatch):
    """With PDL a weight of `_GEMV_LATE_TRIGGER_ELEMS` elements or more signals the next kernel after the weight loop
    (the 4B linears from out_proj up, every 9B one, the LM heads), a smaller one at its start; without PDL neither."""
    small, big = torch.empty(1024, 3584), torch.empty(2560, 4096)  # 0.8B down, 4B out_proj
    assert not fused_ops_gemv._gemv_late_trigger(small, True) and fused_ops_gemv._gemv_late_trigger(big, True)
    assert not fused_ops_gemv._gemv_late_trigger(big, False)
    monkeypatch.setattr(fused_ops_gemv, "_GEMV_LATE_TRIGGER_ELEMS", small.numel())
    assert fused_ops_gemv._gemv_late_trigger(small, True)


def test_gemv_rejects_a_bad_unroll():
    x, w = torch.randn(1, 16), torch.randn(4, 16)
    with pytest.raises(ValueError, match="unroll must be 1 or more, got 0"):
        fused_ops.gemv(x, w, config=(4, 16, 1, False, 0))


def check_gemv_conv(device, dtype, M, N, K, C, W=4, config=None, bias=False, seed=0):
    """`gemv` with the conv step in its epilogue: output and conv state bit-identical to the two launches it replaces
    (`gemv`, then `causal_conv1d_step` on the first C columns) over two consecutive steps, and close to
    `gemv_ref`."""
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(N, K, generator=gen) / K**0.5).to(device, dtype)
    conv_w = (torch.randn(C, W, generator=gen) * 0.5).to(device, dtype)
    conv_b = (torch.randn(C, generator=gen) * 0.1).to(device, dtype) if bias else None
    state = torch.randn(M, C, W, generator=gen).to(device, dtype)
    state_two, state_ref = state.clone(), state.clone()
    for step in range(2):
        x = (torch.randn(M, K + 24, generator=gen) * 0.5).to(device, dtype)[:, 8 : 8 + K]
        y = fused_ops.gemv(x, w, config=config, conv=(state, conv_w, conv_b))
        two = fused_ops.gemv(x, w, config=config)
        fused_ops.causal_conv1d_step(two[:, :C], state_two, conv_w, conv_b, out=two[:, :C])
        want = fused_ops.gemv_ref(x, w, conv=(state_ref, conv_w, conv_b))
        assert not y.isnan().any()
        assert torch.equal(y, two), f"step {step}: output differs from gemv + causal_conv1d_step"
        assert torch.equal(state, state_two), f"step {step}: conv state differs from causal_conv1d_step's"
        err = rel_err(y.float(), want.float())
        assert err <= BOUND[dtype], f"step {step}: rel_err {err:.3g} > {BOUND[dtype]:g}"
        assert rel_err(state.float(), state_ref.float()) <= BOUND[dtype]


@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("M,N,K,C", [(1, 13, 16, 6), (3, 37, 40, 19), (2, 8, 24, 8)], ids=["M1", "M3", "all-conv"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_gemv_conv_cpu(dtype, M, N, K, C, bias):
    check_gemv_conv("cpu", dtype, M, N, K, C, config=(4, 32, 1), bias=bias)


@needs_interpreter
def test_small_linear_conv_on_cpu_is_two_launches():
    """The cuBLAS path of `small_linear` with `conv`: `F.linear`, then the conv step in place on the first C columns."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 16, generator=gen), torch.randn(12, 16, generator=gen)
    state, conv_w = torch.randn(2, 5, 4, generator=gen), torch.randn(5, 4, generator=gen)
    state_ref = state.clone()
    fused_ops_gemv._small_linear_choice.clear()
    y = fused_ops.small_linear(x, w, conv=(state, conv_w, None))
    want = fused_ops.small_linear_ref(x, w, conv=(state_ref, conv_w, None))
    torch.testing.assert_close(y, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(state, state_ref, rtol=0, atol=0)
    assert list(fused_ops_gemv._small_linear_choice.values()) == ["cublas"]


def test_pdl_only_on_cuda_and_switchable(monkeypatch):
    """Programmatic dependent launch is never asked of the CPU (the interpreter takes no launch options), and
    `PDL_ENABLED = False` turns it off without a CUDA call."""
    assert not fused_ops.pdl_enabled(torch.device("cpu"))
    assert fused_ops_runtime._pdl_launch(False) == {}
    monkeypatch.setattr(fused_ops_runtime, "PDL_ENABLED", False)
    assert not fused_ops.pdl_enabled(torch.device("cuda", 0))


@pytest.mark.parametrize("mb", [0.5, 4, 21, 63, 200])
def test_timing_weights_are_the_weight_and_bounded_copies(mb):
    """`small_linear` times each candidate over the weight and copies of it: the weight itself first, the copies
    equal to it in their own storage, at most `_TIMING_COPY_BYTES` of them, and for the decode shapes (weights of
    2 MB and more) a set larger than an H200's 50 MB L2."""
    w = torch.randn(int(mb * 2**20) // (4 * 256), 256)
    ws = fused_ops_gemv._timing_weights(w)
    assert ws[0] is w
    assert all(torch.equal(c, w) and c.data_ptr() != w.data_ptr() for c in ws[1:])
    assert sum(c.nbytes for c in ws[1:]) <= fused_ops_gemv._TIMING_COPY_BYTES
    if mb >= 2:
        assert sum(c.nbytes for c in ws) > 50 * 2**20


@needs_interpreter
def test_small_linear_on_cpu_is_cublas_path():
    """Off CUDA (and for shapes `gemv` does not take) the choice is `F.linear`, made once per shape."""
    x, w = torch.randn(2, 16), torch.randn(12, 16)
    fused_ops_gemv._small_linear_choice.clear()
    y = fused_ops.small_linear(x, w, gate_up=True)
    assert torch.equal(y, fused_ops.swiglu(F.linear(x, w)))
    assert list(fused_ops_gemv._small_linear_choice.values()) == ["cublas"]


@pytest.mark.parametrize(
    "case, match",
    [
        ("rows", "1 to 16 rows"),
        ("k", r"x \[M, K\] and w \[N, K\]"),
        ("odd", "even number of weight rows"),
        ("dtype", "contiguous weight in x's dtype"),
        ("conv-gate-up", "either gate_up or conv"),
        ("conv-wide", r"conv_state must be \[M, C, W\]"),
        ("conv-weight", r"conv weight must be \[C, W\]"),
        ("conv-bias", r"conv bias must have shape \(5,\)"),
    ],
)
def test_gemv_rejects_bad_inputs(case, match):
    x, w = torch.randn(2, 16), torch.randn(12, 16)
    state, conv_w = torch.zeros(2, 5, 4), torch.zeros(5, 4)
    args = {"rows": (torch.randn(17, 16), w, False), "k": (x, torch.randn(12, 8), False),
            "odd": (x, torch.randn(11, 16), True), "dtype": (x, w.half(), False),
            "conv-gate-up": (x, w, True, None, (state, conv_w, None)),
            "conv-wide": (x, w, False, None, (torch.zeros(2, 13, 4), torch.zeros(13, 4), None)),
            "conv-weight": (x, w, False, None, (state, torch.zeros(5, 3), None)),
            "conv-bias": (x, w, False, None, (state, conv_w, torch.zeros(4)))}[case]
    with pytest.raises(ValueError, match=match):
        fused_ops.gemv(*args)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("M", [1, 2, 7, 16, 17, 32])
@pytest.mark.parametrize("N,K,gate_up", [(48, 64, False), (21, 50, True), (33, 96, False)],
                         ids=["even", "gate_up-partial-k", "partial-n"])
def test_skinny_gemm_cpu(dtype, M, N, K, gate_up):
    """Both row tiles (16 and 32 rows), a K that leaves a partial tile, an N that leaves a partial program."""
    check_gemv("cpu", dtype, M, N, K, gate_up, config=(16, 32, 4, 2), op="skinny_gemm")


@pytest.mark.parametrize(
    "case, match",
    [
        ("rows", "1 to 32 rows"),
        ("fp32", "bfloat16 or float16 x, got torch.float32"),
        ("k", r"x \[M, K\] and w \[N, K\]"),
        ("odd", "even number of weight rows"),
        ("dtype", "contiguous weight in x's dtype"),
    ],
)
def test_skinny_gemm_rejects_bad_inputs(case, match):
    x, w = torch.randn(2, 16, dtype=torch.bfloat16), torch.randn(12, 16, dtype=torch.bfloat16)
    args = {"rows": (torch.randn(33, 16, dtype=torch.bfloat16), w, False), "fp32": (x.float(), w.float(), False),
            "k": (x, w[:, :8], False), "odd": (x, w[:11], True), "dtype": (x, w.half(), False)}[case]
    with pytest.raises(ValueError, match=match):
        fused_ops.skinny_gemm(*args)


_SM90_CALLS = r"""
compile_(fused_ops_deltanet._causal_conv1d_step_kernel,
         dict(x_ptr="*bf16", s_ptr="*bf16", w_ptr="*bf16", bias_ptr="*bf16", y_ptr="*bf16"),
         dict(W=4, HAS_BIAS=False, BLOCK_D=256, BLOCK_W=4), 4)
for prefetch, live in ((False, False), (True, False), (False, True), (True, True)):
    kernel = compile_(fused_ops_deltanet._gated_delta_rule_step_kernel,
                      dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", a_ptr="*bf16", b_ptr="*bf16",
                           A_log_ptr="*fp32", dt_bias_ptr="*fp32", s_ptr="*fp32", o_ptr="*bf16", live_ptr="*i64",
                           scale="fp32", eps="fp32"),
                      dict(GROUP=2, K=128, V=128, BLOCK_K=128, BLOCK_V=32, PREFETCH_STATE=prefetch, HAS_LIVE=live,
                           ON_GPU=True), 4)
    ptx = kernel.asm["ptx"]
    # with prefetch_state the state's loads come before the wait, else every load after it (with `live`, its own
    # load comes first either way)
    if fused_ops_runtime._HAS_GDC and not live:
        first_load, wait = ptx.index("ld.global"), ptx.index("griddepcontrol.wait")
        assert (first_load < wait) == prefetch, ("prefetch_state", prefetch, first_load, wait)
kernel = compile_(fused_ops_attention._mrope_step_kernel,
                  dict(pos_ptr="*i64", sec_ptr="*i64", f_ptr="*fp32", cos_ptr="*bf16", sin_ptr="*bf16",
                       valid_ptr="*i1", slot_ptr="*i64", scaling="fp32"),
                  dict(SCALE=True, ADVANCE=True, MARK=True, BLOCK_R=64), 1)
assert "approx" not in kernel.asm["ptx"], "mrope_step must take the full-precision cos / sin, as torch does"
# every config once, the epilogues and row counts taking turns (each pair of them at least twice)
GemvConfig = fused_ops_gemv.GemvConfig
configs = fused_ops_gemv._GEMV_CONFIGS + (GemvConfig(2, 1024, 4, False, 2), GemvConfig(2, 256, 4, False, 4))
for i, c in enumerate(configs):
    epilogue, block_m = ("plain", "swiglu", "conv")[i % 3], (1, 8)[i // 3 % 2]
    late = fused_ops_runtime._HAS_GDC and i % 2 == 1
    kernel = compile_(fused_ops_gemv._gemv_kernel,
                      dict(x_ptr="*bf16", w_ptr="*bf16", y_ptr="*bf16", s_ptr="*bf16", cw_ptr="*bf16", cb_ptr="*bf16"),
                      dict(SWIGLU=epilogue == "swiglu", CONV=epilogue == "conv", CONV_W=4, CONV_BIAS=False,
                           BLOCK_M=block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, BLOCK_W=4,
                           ROW_ACC=fused_ops_gemv._gemv_row_acc(c, block_m, c.block_k, epilogue == "swiglu"),
                           UNROLL=c.unroll, LATE_TRIGGER=late), c.warps)
    if fused_ops_runtime._HAS_GDC:  # the next kernel may launch before the wait, or (late) only after the weight loop
        ptx = kernel.asm["ptx"]
        launch, wait = ptx.index("griddepcontrol.launch_dependents"), ptx.index("griddepcontrol.wait")
        assert (launch > wait) == late and ptx.count("griddepcontrol.launch_dependents") == 1, (c, late)
# every skinny GEMM config, at both row tiles, with and without the SwiGLU epilogue (and a partial K tile)
for i, c in enumerate(fused_ops_gemv._SKINNY_CONFIGS):
    for block_m, swiglu in ((16, i % 2 == 0), (32, i % 2 == 1)):
        compile_(fused_ops_gemv._skinny_gemm_kernel, dict(x_ptr="*bf16", w_ptr="*bf16", y_ptr="*bf16"),
                 dict(SWIGLU=swiglu, EVEN_K=block_m == 16, DOT_F32=False, PRECISION="tf32", BLOCK_M=block_m,
                      BLOCK_N=c.block_n, BLOCK_K=c.block_k, LATE_TRIGGER=i % 2 == 1), c.warps, c.stages)
"""


def _mrope_inputs(B, R, device, seed=0):
    """Positions [3, B, 1] (distinct t / h / w rows, up to 200k), sections [R] and float32 freqs [R] as `_rope_plan`
    builds them (each half the same frequencies, an interleaved t / h / w section pattern)."""
    gen = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, 200_000, (3, B, 1), generator=gen)
    half = R // 2
    sections = torch.tensor([(i % 3) if i < 3 * (half // 3) else 0 for i in range(half)] * 2)
    freqs = (1e7 ** (-torch.arange(half, dtype=torch.float32) / half)).repeat(2)
    return positions.to(device), sections.to(device), freqs.to(device)


@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("B,R", [(1, 8), (3, 12), (2, 64)])
@pytest.mark.parametrize("scaling", [1.0, 1.1386])
@pytest.mark.parametrize("advance", [False, True])
def test_mrope_step_cpu(dtype, B, R, scaling, advance):
    """The kernel (interpreter) against `mrope_step_ref`: cos / sin within a unit in the last place (the interpreter's
    numpy cos / sin against torch's); the positions moved on by one only with `advance`; with `mark_valid`, the
    slot's column of the key mask set and nothing else touched."""
    positions, sections, freqs = _mrope_inputs(B, R, "cpu")
    ref_positions = positions.clone()
    mark = None
    if advance:  # the step passes both; the mask here has a row stride wider than its width
        valid = torch.zeros(B, 16, dtype=torch.bool)[:, :11]
        valid[0, 2] = True
        mark, ref_mark = (valid, torch.tensor([7])), (valid.clone(), torch.tensor([7]))
    cos, sin = fused_ops.mrope_step(positions, sections, freqs, scaling, dtype, advance=advance, mark_valid=mark)
    want_cos, want_sin = fused_ops.mrope_step_ref(ref_positions, sections, freqs, scaling, dtype, advance=advance,
                                                  mark_valid=ref_mark if advance else None)
    if advance:
        assert torch.equal(mark[0], ref_mark[0]) and mark[0][:, 7].all() and mark[0].sum() == B + 1
    assert cos.shape == (B, R) and cos.dtype == dtype
    ulp = {torch.float32: 1e-6, torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11}[dtype] * 1.2
    assert (cos.float() - want_cos.float()).abs().max() <= ulp and (sin.float() - want_sin.float()).abs().max() <= ulp
    assert torch.equal(positions, ref_positions)
    assert torch.equal(positions, _mrope_inputs(B, R, "cpu")[0] + int(advance))


def test_mrope_step_rejects_bad_inputs():
    positions, sections, freqs = _mrope_inputs(2, 8, "cpu")
    with pytest.raises(ValueError, match="int64 positions"):
        fused_ops.mrope_step(positions.float(), sections, freqs, 1.0, torch.float32)
    with pytest.raises(ValueError, match="float32 freqs"):
        fused_ops.mrope_step(positions, sections, freqs.double(), 1.0, torch.float32)
    with pytest.raises(ValueError, match="dtype"):
        fused_ops.mrope_step(positions, sections, freqs, 1.0, torch.float64)
    with pytest.raises(ValueError, match="bool"):
        fused_ops.mrope_step(positions, sections, freqs, 1.0, torch.float32,
                             mark_valid=(torch.zeros(2, 4), positions[0, 0]))
    with pytest.raises(ValueError, match="slot"):
        fused_ops.mrope_step(positions, sections, freqs, 1.0, torch.float32,
                             mark_valid=(torch.zeros(2, 4, dtype=torch.bool), torch.tensor([1.0])))


def test_kernels_compile_for_sm90():
    """The real-shape variants of this file's kernels compile for sm_90 (each GEMV config, and two more unrolled; each
    skinny GEMM config at both row tiles; the GPU tests run every config with every epilogue); `mrope_step`'s cos /
    sin are not the approximate instructions."""
    # the conv step, the rule step 4 ways (prefetch x live), mrope_step
    assert compile_for_sm90(_SM90_CALLS) == (6 + len(fused_ops_gemv._GEMV_CONFIGS) + 2
                                            + 2 * len(fused_ops_gemv._SKINNY_CONFIGS))


# ---------------------------------------------------------------------------------------------------------------------
# CUDA tests: real Qwen3.5 shapes (linear k heads 16, value heads 16 / 32 / 48, K = V = 128, conv kernel 4)
# ---------------------------------------------------------------------------------------------------------------------

B_CUDA = [1, 3, 8]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("B", B_CUDA, ids=lambda b: f"B{b}")
@pytest.mark.parametrize("HV", [16, 32, 48], ids=lambda hv: f"D{4096 + 128 * hv}")
def test_causal_conv1d_step_cuda(dtype, B, HV):
    check_conv_step("cuda", dtype, B, 2 * 16 * 128 + HV * 128, use_out=B == 3)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_causal_conv1d_step_mixed_dtypes_cuda(dtype):
    check_conv_step("cuda", dtype, 3, 8192, bias=True, weight_dtype=torch.float32)
    check_conv_step("cuda", dtype, 3, 8192, state_dtype=torch.float32)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("B", B_CUDA, ids=lambda b: f"B{b}")
@pytest.mark.parametrize(
    "H, HV, K, V",
    [(16, 16, 128, 128), (16, 32, 128, 128), (16, 48, 128, 128), (4, 12, 32, 32)],
    ids=["H16-HV16", "H16-HV32", "H16-HV48", "H4-HV12-K32"],
)
def test_gated_delta_rule_step_cuda(dtype, B, H, HV, K, V):
    check_gdr_step("cuda", dtype, B, H, HV, K, V, use_out=B == 3)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("T", [2, 4], ids=lambda t: f"T{t}")
@pytest.mark.parametrize("D", [8192, 10240], ids=lambda d: f"D{d}")
def test_causal_conv1d_steps_cuda(dtype, T, D):
    check_conv_steps("cuda", dtype, 1, T, D)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("T", [2, 4], ids=lambda t: f"T{t}")
@pytest.mark.parametrize("H, HV, K, V", [(16, 32, 128, 128), (16, 48, 128, 128)], ids=["H16-HV32", "H16-HV48"])
def test_gated_delta_rule_steps_cuda(dtype, T, H, HV, K, V):
    check_gdr_steps("cuda", dtype, 1, T, H, HV, K, V)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_gated_delta_rule_step_strided(dtype):
    check_gdr_step("cuda", dtype, 3, 16, 32, 128, 128, use_out=True, strided_state=True, a_transposed=True)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("B", B_CUDA, ids=lambda b: f"B{b}")
@pytest.mark.parametrize("HV", [16, 32, 48], ids=["0.8B", "4B", "9B"])
def test_gated_delta_rule_step_prefetch(dtype, B, HV):
    """The state loaded before the PDL wait gives what loading it after does (against stock and the reference)."""
    check_gdr_step("cuda", dtype, B, 16, HV, 128, 128, use_out=B == 3, prefetch=True)


@pytest.mark.cuda
def test_batch_64():
    check_conv_step("cuda", torch.bfloat16, 64, 8192)
    check_gdr_step("cuda", torch.bfloat16, 64, 16, 32, 128, 128)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("B", B_CUDA, ids=lambda b: f"B{b}")
def test_decode_chain_cuda_graph(dtype, B):
    """Both ops captured once in a CUDA graph (4B shapes) and replayed for STEPS steps on new inputs."""
    check_decode_chain("cuda", dtype, B, 16, 32, 128, 128, graph=True)


@pytest.mark.cuda
def test_allocations():
    """With `out=` the ops allocate nothing; without, exactly their output. No host sync either: each call must
    return while a long kernel queued before it is still running."""
    gen = torch.Generator().manual_seed(0)
    B, H, HV, K, V, D = 3, 16, 32, 128, 128, 8192
    x = column_slice(B, D, torch.bfloat16, "cuda", gen)
    conv_state = torch.randn(B, D, 4, device="cuda", dtype=torch.bfloat16)
    weight, _ = conv_params("cuda", torch.bfloat16, D, 4, False, None, gen)
    y = torch.empty(B, D, device="cuda", dtype=torch.bfloat16)
    q, k, v, a, b = gdr_inputs("cuda", torch.bfloat16, B, H, HV, K, V, gen)
    A_log, dt_bias = gdr_params("cuda", torch.bfloat16, HV, gen)
    state = torch.randn(B, HV, K, V, device="cuda") * 0.1
    o = torch.empty(B, HV, V, device="cuda", dtype=torch.bfloat16)

    def conv(out):
        return fused_ops.causal_conv1d_step(x, conv_state, weight, out=out)

    def gdr(out):
        return fused_ops.gated_delta_rule_step(q, k, v, a, b, A_log, dt_bias, state, out=out)

    def allocations():
        return torch.cuda.memory_stats()["allocation.all.allocated"]

    for call, out in ((conv, y), (gdr, o)):
        call(out)  # compile
        torch.cuda.synchronize()
        before = allocations()
        assert call(out) is out
        assert allocations() == before, f"{call.__name__}(out=...) allocated"
        result = call(None)
        assert allocations() == before + 1, f"{call.__name__}() allocated more than its output"
        del result

        torch.cuda._sleep(200_000_000)  # keeps the GPU busy for ~0.1 s
        call(out)
        assert not torch.cuda.current_stream().query(), f"{call.__name__} waited for the GPU (host sync)"
        torch.cuda.synchronize()


# Beyond `_GEMV_CONFIGS`: what `scripts/benchmark_gemv.py` sweeps (unrolled loops, small tiles whose accumulator
# fits at several rows), so a sweep winner added to the configs has already run on the GPU.
_GEMV_CUDA_EXTRA = ((8, 512, 4, False, 2), (2, 1024, 4, False, 4), (2, 256, 4), (4, 128, 4, False, 2))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("M", [1, 3, 8])
@pytest.mark.parametrize(
    "N,K,gate_up",
    [(12352, 2560, False), (2560, 4096, False), (9216, 2560, True), (2560, 9216, False), (1024, 3584, False)],
    ids=["4B-deltanet-in", "4B-out", "4B-gate-up", "4B-down", "0.8B-down"],
)
def test_gemv_cuda(dtype, M, N, K, gate_up):
    for config in (*fused_ops_gemv._GEMV_CONFIGS, *_GEMV_CUDA_EXTRA):
        check_gemv("cuda", dtype, M, N, K, gate_up, config=config)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("M", [2, 8, 16, 32])
@pytest.mark.parametrize(
    "N,K,gate_up",
    [(12352, 2560, False), (2560, 4096, False), (9216, 2560, True), (2560, 9216, False), (1024, 3584, False),
     (1000, 200, True)],
    ids=["4B-deltanet-in", "4B-out", "4B-gate-up", "4B-down", "0.8B-down", "partial"],
)
def test_skinny_gemm_cuda(dtype, M, N, K, gate_up):
    for config in fused_ops_gemv._SKINNY_CONFIGS:
        check_gemv("cuda", dtype, M, N, K, gate_up, config=config, op="skinny_gemm")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("M", [1, 3, 8])
@pytest.mark.parametrize("N,K,C", [(12352, 2560, 8192), (8224, 1024, 6144), (12352, 4096, 8192)],
                         ids=["4B-deltanet-in", "0.8B-deltanet-in", "9B-deltanet-in"])
def test_gemv_conv_cuda(dtype, M, N, K, C):
    for config in fused_ops_gemv._GEMV_CONFIGS:
        check_gemv_conv("cuda", dtype, M, N, K, C, config=config)


def test_capture_error_names_the_first_error():
    """Leaving `torch.cuda.graph` after an error calls `capture_end`, whose own error replaces the first one; the
    announcement names the first (the chain's earliest `__context__`), and stops at a cycle."""
    def failed_capture():
        try:
            raise ValueError("a host sync")
        finally:
            raise RuntimeError("operation failed due to a previous error during capture")

    with pytest.raises(RuntimeError) as info:
        failed_capture()
    first = fused_ops.capture_error(info.value)
    assert type(first) is ValueError and str(first) == "a host sync"
    alone = KeyError("x")
    assert fused_ops.capture_error(alone) is alone
    a, b = RuntimeError("a"), RuntimeError("b")
    a.__context__, b.__context__ = b, a
    assert fused_ops.capture_error(a) is b


@pytest.mark.cuda
def test_graph_timing_reads_the_weights_from_hbm():
    """`_time_in_graph_ms` times the calls it captured: a 4x larger weight takes over 2x longer, and a call runs at
    no more than the H200's copy rate (4.2 TB/s, so the weights are read from HBM, not L2) and above 0.5 TB/s."""
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    times = {}
    for n in (4096, 16384):
        w = torch.randn(n, 4096, device="cuda", dtype=torch.bfloat16)
        ws = fused_ops_gemv._timing_weights(w)
        times[n] = fused_ops_gemv._time_in_graph_ms(lambda w_: torch.nn.functional.linear(x, w_), ws)
        tb_s = w.nbytes / (times[n] * 1e-3) / 1e12
        assert 0.5 < tb_s < 4.3, f"N={n}: {times[n] * 1e3:.1f} us per call is {tb_s:.2f} TB/s"
        del w, ws
    assert times[16384] > 2 * times[4096], times


@pytest.mark.cuda
def test_small_linear_picks_and_captures():
    """The choice is made at the first eager call (timed in graphs, its copies and graphs freed after), then the same
    choice replays inside a CUDA graph."""
    fused_ops_gemv._small_linear_choice.clear()
    x = torch.randn(1, 2560, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(18432, 2560, device="cuda", dtype=torch.bfloat16) / 50
    fused_ops.small_linear(x, w[:2560])  # a first choice: the timing stream and its cuBLAS workspace now exist
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    eager = fused_ops.small_linear(x, w, gate_up=True)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - before <= eager.nbytes + (1 << 20), "the timing left memory allocated"
    fused_ops_gemv._small_linear_choice.pop((1, 2560, 2560, False, torch.bfloat16, x.device))
    (choice,) = fused_ops_gemv._small_linear_choice.values()
    assert choice == "cublas" or choice in fused_ops_gemv._GEMV_CONFIGS
    assert rel_err(eager.float(), fused_ops.gemv_ref(x, w, True).float()) <= BOUND[torch.bfloat16]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_ops.small_linear(x, w, gate_up=True)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert rel_err(out.float(), fused_ops.gemv_ref(x, w, True).float()) <= BOUND[torch.bfloat16]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("B", B_CUDA, ids=lambda b: f"B{b}")
@pytest.mark.parametrize("scaling", [1.0, 1.1386])
def test_mrope_step_cuda(dtype, B, scaling):
    """On the GPU the kernel's cos / sin are bit-identical to the torch reference (which the step's rotary tests hold
    bit-identical to stock's module) at the real rotary width (R = 64); the positions move on by one and the slot's
    key is marked valid."""
    positions, sections, freqs = _mrope_inputs(B, 64, "cuda", seed=B)
    ref_positions = positions.clone()
    valid = torch.rand(B, 300, device="cuda") < 0.5
    ref_valid, slot = valid.clone(), torch.tensor([257], device="cuda")
    cos, sin = fused_ops.mrope_step(positions, sections, freqs, scaling, dtype, advance=True, mark_valid=(valid, slot))
    want_cos, want_sin = fused_ops.mrope_step_ref(ref_positions, sections, freqs, scaling, dtype, advance=True,
                                                  mark_valid=(ref_valid, slot))
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    assert torch.equal(positions, ref_positions) and torch.equal(valid, ref_valid) and valid[:, 257].all()
