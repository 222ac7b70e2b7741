"""Tests of `fused_ops.decode_attention` (the decode step's gated attention over the preallocated K/V cache) against
its `_ref`: stock's SDPA with the padding mask, then stock's `o * sigmoid(gate)`.

CPU tests run the kernels under the Triton interpreter (`TRITON_INTERPRET=1`, set in conftest.py) at tiny shapes;
`@pytest.mark.cuda` tests run the real Qwen3.5 attention shapes (head dim 256; 8 / 2, 16 / 4 and 24 / 4 query / KV
heads) at cache lengths 1 to 2048: `python -m pytest tests/ops/test_decode_attention.py -m cuda`.

Error bounds (relative), and why:
- fp32 <= 1e-5: IEEE dots; another summation order than SDPA (online softmax over splits). Measured on CPU: 3e-7.
- bf16 <= 1e-2, fp16 <= 2e-3: the probabilities are rounded to the cache dtype before the second dot (as flash
  kernels do) and the output is rounded before the gate; a few units in the last place. Measured on CPU: 2.8e-3 /
  4.3e-4 against CPU SDPA.
"""


import pytest
import torch

from helpers import BOUNDS, DTYPE_IDS, DTYPES, TritonCompiles, assert_close, compile_for_sm90, fused_ops
from helpers import needs_interpreter
from scripts.common import import_module

fused_ops_attention = import_module("fused_ops_attention")
BOUND = BOUNDS["decode_attention"]


@pytest.fixture(autouse=True)
def _set_up():
    if not fused_ops.HAS_TRITON:
        pytest.skip("triton is not installed")
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


def inputs(device, dtype, B, H, KV, D, L, slot, seed=0, pad=True):
    """Cache of L keys with keys 0..slot written; some rows left-padded; `valid` also marks a few stale positions
    after `slot` (from an earlier, longer request), which must not be read."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, D, generator=g)
    keys, values = torch.randn(B, KV, L, D, generator=g), torch.randn(B, KV, L, D, generator=g)
    valid = torch.ones(B, L, dtype=torch.bool)
    if pad:
        for b in range(B):
            valid[b, : min(slot, 3 * b)] = False  # row b: 3b padding positions on the left
    valid[:, slot + 1 :] = torch.rand(B, L - slot - 1, generator=g) > 0.5
    keys[:, :, slot + 1 :] = values[:, :, slot + 1 :] = 1e4  # stale entries: any read of them shows
    gate = torch.randn(B, H * D, generator=g)
    cast = dict(device=device, dtype=dtype)
    return (q.to(**cast), keys.to(**cast), values.to(**cast), valid.to(device), torch.tensor([slot], device=device),
            gate.to(**cast), D**-0.5)


def check(device, dtype, B, H, KV, D, L, slot, pad=True):
    args = inputs(device, dtype, B, H, KV, D, L, slot, pad=pad)
    got = fused_ops.decode_attention(*args)
    want = fused_ops.decode_attention_ref(*args)
    assert_close("y", got, want, BOUND[dtype])


@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(
    "B, H, KV, D, L, slot",
    [(1, 4, 1, 16, 1, 0), (2, 4, 2, 16, 7, 6), (3, 6, 3, 24, 130, 100), (2, 8, 2, 16, 300, 299)],
    ids=["L1", "L7", "odd-D-3splits", "5splits"],
)
def test_decode_attention_cpu(dtype, B, H, KV, D, L, slot):
    check("cpu", dtype, B, H, KV, D, L, slot)


@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("L, slot", [(300, 290), (1024, 150)], ids=["full", "bucket-mostly-empty"])
def test_decode_attention_cpu_round_robin_splits(dtype, L, slot, monkeypatch):
    """More key blocks than splits, as a long cache has them, at a size the interpreter runs quickly: the cap lowered
    to 2 splits, so each split takes every other block of 32 keys; also with most of the cache not written yet (a
    short context in a large bucket), where contiguous ranges would have left splits without keys."""
    monkeypatch.setattr(fused_ops_attention, "_DA_MAX_SPLITS", 2)
    assert fused_ops_attention._decode_attention_splits(L, 2 * 2) == 2
    check("cpu", dtype, 2, 4, 2, 16, L, slot)


@needs_interpreter
def test_decode_attention_ignores_keys_after_slot():
    """Keys after `slot` are never read, even where `valid` still marks them (a longer earlier request)."""
    q, keys, values, valid, slot, gate, scale = inputs("cpu", torch.float32, 2, 4, 2, 16, 96, 40)
    valid[:, 41:] = True
    got = fused_ops.decode_attention(q, keys, values, valid, slot, gate, scale)
    short = fused_ops.decode_attention_ref(q, keys[:, :, :41], values[:, :, :41], valid[:, :41], slot, gate, scale)
    assert_close("y", got, short, BOUND[torch.float32])


def windows(device, dtype, B, L, slot, seed=0):
    """``generate_batch``'s layout: row b's keys valid on its own window [start_b, slot], stale NaN keys / values
    everywhere else before the slot (a free row's steps wrote them), the last row free (start L, nothing valid);
    row 1 starts at a key block's first key, and the whole blocks before it are still marked valid and hold large
    finite values (only ``start`` keeps them out: the kernel's contract is that no key before ``start`` is valid, and
    it skips the whole blocks before it)."""
    q, keys, values, valid, slot_t, gate, scale = inputs(device, dtype, B, 4, 2, 16, L, slot, seed=seed, pad=False)
    g = torch.Generator().manual_seed(seed + 1)
    start = torch.randint(0, slot + 1, (B,), generator=g)
    block = fused_ops_attention._DA_BLOCK_L
    assert slot >= block
    start[0], start[1] = 0, slot // block * block
    start[-1] = L
    valid[:] = False
    for b in range(B):
        valid[b, start[b] : slot + 1] = True
        keys[b, :, : min(start[b], slot + 1)] = float("nan")
        values[b, :, : min(start[b], slot + 1)] = float("nan")
    valid[1, : start[1]] = True
    keys[1, :, : start[1]] = values[1, :, : start[1]] = 1e2
    return q, keys, values, valid, slot_t, gate, scale, start.to(device)


@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("L, slot", [(40, 39), (300, 200)], ids=["one-split", "round-robin"])
def test_decode_attention_reads_each_row_from_its_start(dtype, L, slot, monkeypatch):
    """With ``start`` each row reads its own window only: the NaN keys / values before it (inside its first key block
    too) never reach the output, a row without a valid key (a free row) gives zeros, and the other rows equal the
    reference over their window; also with fewer splits than key blocks (each split starts at the row's first
    block). Without ``start`` the valid mask alone keeps the stale values out (invalid values load as zeros)."""
    monkeypatch.setattr(fused_ops_attention, "_DA_MAX_SPLITS", 2)
    q, keys, values, valid, slot_t, gate, scale, start = windows("cpu", dtype, 4, L, slot)
    got = fused_ops.decode_attention(q, keys, values, valid, slot_t, gate, scale, start=start)
    want = fused_ops.decode_attention_ref(q, keys.nan_to_num(), values.nan_to_num(), valid, slot_t, gate, scale,
                                         start=start)
    assert torch.isfinite(got).all()
    assert (got[-1] == 0).all()
    assert_close("y", got[:-1], want[:-1], BOUND[dtype])
    valid[1, : start[1]] = False
    unstarted = fused_ops.decode_attention(q, keys, values, valid, slot_t, gate, scale)
    assert_close("y without start", unstarted[:-1], want[:-1], BOUND[dtype])
    assert (unstarted[-1] == 0).all()


@needs_interpreter
def test_decode_attention_without_the_value_mask_over_finite_stale_values(monkeypatch):
    """``_DA_MASK_VALUES`` off (the A/B's other arm): stale finite values at invalid positions still weigh nothing."""
    monkeypatch.setattr(fused_ops_attention, "_DA_MASK_VALUES", False)
    q, keys, values, valid, slot_t, gate, scale, start = windows("cpu", torch.float32, 4, 40, 39)
    keys, values = keys.nan_to_num(nan=3.0), values.nan_to_num(nan=3.0)
    got = fused_ops.decode_attention(q, keys, values, valid, slot_t, gate, scale, start=start)
    want = fused_ops.decode_attention_ref(q, keys, values, valid, slot_t, gate, scale, start=start)
    assert (got[-1] == 0).all()
    assert_close("y", got[:-1], want[:-1], BOUND[torch.float32])


def contiguous_windows(device, dtype, B, L, slot):
    """``windows`` as generate_batch keeps them (row b's valid keys exactly start_b..slot), with ``valid`` scrambled:
    in ``contiguous`` mode the kernel must not read it. NaN keys / values before each start, inside its first key
    block too, and stale large values in the whole blocks before row 1's start."""
    q, keys, values, valid, slot_t, gate, scale, start = windows(device, dtype, B, L, slot)
    g = torch.Generator().manual_seed(7)
    scrambled = (torch.rand(valid.shape, generator=g) > 0.5).to(valid.device)
    want = fused_ops.decode_attention_ref(q, keys.nan_to_num(), values.nan_to_num(), valid, slot_t, gate, scale,
                                         start=start)
    return (q, keys, values, scrambled, slot_t, gate, scale, start), want


@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("L, slot", [(40, 39), (300, 200)], ids=["one-split", "round-robin"])
def test_decode_attention_over_contiguous_windows(dtype, L, slot, monkeypatch):
    """``contiguous``: each row's window start..slot alone decides what it attends to (``valid`` scrambled here is not
    read), the NaN values before a row's start inside its first key block stay out even with the marks' value mask
    off (the key index masks them), a free row gives zeros; the reference in the same mode agrees with the masked
    reference over the real windows."""
    monkeypatch.setattr(fused_ops_attention, "_DA_MAX_SPLITS", 2)
    monkeypatch.setattr(fused_ops_attention, "_DA_MASK_VALUES", False)
    args, want = contiguous_windows("cpu", dtype, 4, L, slot)
    got = fused_ops.decode_attention(*args, contiguous=True)
    assert torch.isfinite(got).all() and (got[-1] == 0).all()
    assert_close("y", got[:-1], want[:-1], BOUND[dtype])
    q, keys, values, scrambled, slot_t, gate, scale, start = args
    ref = fused_ops.decode_attention_ref(q, keys.nan_to_num(), values.nan_to_num(), scrambled, slot_t, gate, scale,
                                        start=start, contiguous=True)
    assert_close("ref", ref, want, 1e-6)


def several_tokens(device, dtype, T, H, KV, D, L, slot0):
    """The speculative verify pass's use: T query tokens of one sequence as T rows over its one cache row (keys and
    values seen T times through a batch stride of 0), row t through the row's marks up to slot0 + t, read up to the
    last token's slot; against T one-row calls, token t's at slot0 + t (and the reference)."""
    q, keys, values, valid, _, gate, scale = inputs(device, dtype, 1, H * T, KV * T, D, L, slot0 + T - 1, pad=False)
    q, gate = q.view(T, H, D), gate.view(T, H * D)  # T tokens' queries and gates
    keys, values = keys[:, :KV].contiguous(), values[:, :KV].contiguous()  # [1, KV, L, D]
    valid[0, :3] = False  # a left-padded row
    ends = slot0 + torch.arange(T, device=device)
    marks = valid & (torch.arange(L, device=device)[None, :] <= ends[:, None])  # [T, L]
    last = torch.tensor([slot0 + T - 1], device=device)
    got = fused_ops.decode_attention(q, keys.expand(T, -1, -1, -1), values.expand(T, -1, -1, -1), marks, last, gate,
                                     scale)
    for t in range(T):
        one = fused_ops.decode_attention(q[t : t + 1], keys, values, valid, ends[t : t + 1], gate[t : t + 1], scale)
        assert_close(f"token {t} vs its own call", got[t : t + 1], one, BOUND[dtype])
    want = fused_ops.decode_attention_ref(q, keys.expand(T, -1, -1, -1), values.expand(T, -1, -1, -1), marks, last,
                                          gate, scale)
    assert_close("y vs ref", got, want, BOUND[dtype])


@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("T, L, slot0", [(2, 16, 5), (4, 140, 100)], ids=["T2", "T4-splits"])
def test_decode_attention_several_tokens_over_one_row(dtype, T, L, slot0):
    several_tokens("cpu", dtype, T, 4, 2, 16, L, slot0)


def test_decode_attention_rejects_a_bad_start():
    q, keys, values, valid, slot, gate, scale = inputs("cpu", torch.float32, 2, 4, 2, 16, 8, 5)
    with pytest.raises(ValueError, match="contiguous=True needs start"):
        fused_ops.decode_attention_ref(q, keys, values, valid, slot, gate, scale, contiguous=True)
    if fused_ops.HAS_TRITON:
        with pytest.raises(ValueError, match="start must be"):
            fused_ops.decode_attention(q, keys, values, valid, slot, gate, scale, start=torch.zeros(3, dtype=torch.long))
        with pytest.raises(ValueError, match="contiguous=True needs start"):
            fused_ops.decode_attention(q, keys, values, valid, slot, gate, scale, contiguous=True)


@needs_interpreter
def test_decode_attention_strided_q_and_gate():
    """q and gate as the decode step hands them over: views into attn_prep's outputs (row strides wider)."""
    q, keys, values, valid, slot, gate, scale = inputs("cpu", torch.bfloat16, 3, 8, 2, 16, 33, 20)
    q_wide = torch.randn(3, 8, 40, dtype=torch.bfloat16)[..., 4:20]
    q_wide.copy_(q)
    gate_wide = torch.randn(3, 8 * 16 + 64, dtype=torch.bfloat16)[:, 32 : 32 + 8 * 16]
    gate_wide.copy_(gate)
    got = fused_ops.decode_attention(q_wide, keys, values, valid, slot, gate_wide, scale)
    assert_close("y", got, fused_ops.decode_attention_ref(q, keys, values, valid, slot, gate, scale),
                 BOUND[torch.bfloat16])


BAD_INPUTS = {
    "kv-heads": (dict(keys=(2, 3, 8, 16)), "multiple of KV"),
    "dtype": (dict(dtype_kv=torch.float16), "one dtype"),
    "valid-shape": (dict(valid=(2, 9)), "valid must be"),
    "slot-dtype": (dict(slot_dtype=torch.int32), "slot must be"),
    "gate-shape": (dict(gate=(2, 63)), "gate must be"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_decode_attention_rejects_bad_inputs(case):
    change, match = BAD_INPUTS[case]
    kv = change.get("keys", (2, 2, 8, 16))
    q = torch.zeros(2, 4, 16)
    keys = torch.zeros(kv, dtype=change.get("dtype_kv", torch.float32))
    valid = torch.ones(change.get("valid", (2, 8)), dtype=torch.bool)
    slot = torch.zeros(1, dtype=change.get("slot_dtype", torch.long))
    gate = torch.zeros(change.get("gate", (2, 64)))
    with pytest.raises(ValueError, match=match):
        fused_ops.decode_attention(q, keys, keys, valid, slot, gate, 0.25)


_SM90_CALLS = r"""
for (dt, prec), start, window in ((("bf16", "tf32"), False, False), (("fp32", "ieee"), False, False),
                                  (("bf16", "tf32"), True, False), (("bf16", "tf32"), True, True)):
    split = compile_(fused_ops_attention._decode_attention_split_kernel,
             dict(q_ptr=f"*{dt}", k_ptr=f"*{dt}", v_ptr=f"*{dt}", valid_ptr="*i1", slot_ptr="*i64", start_ptr="*i64",
                  m_ptr="*fp32", l_ptr="*fp32", acc_ptr="*fp32", scale="fp32"),
             dict(H=16, KV=4, D=256, BLOCK_G=16, BLOCK_D=256, BLOCK_L=32, DOT_PRECISION=prec, UPCAST=False,
                  HAS_START=start, RANGE=window, MASK_VALUES=fused_ops_attention._DA_MASK_VALUES or window),
             4)
    if window:  # generate_batch's rows: the key index masks scores and values, no valid mark is loaded
        import re
        assert not re.search(r"ld\.global[\w.]*\.[bsu]8\b", split.asm["ptx"]), "one-byte mark loads"
        print("window ok")
    compile_(fused_ops_attention._decode_attention_merge_kernel,
             dict(m_ptr="*fp32", l_ptr="*fp32", acc_ptr="*fp32", gate_ptr=f"*{dt}", y_ptr=f"*{dt}"),
             dict(H=16, D=256, BLOCK_S=128, BLOCK_D=256), 16)
"""


def test_decode_attention_compiles_for_sm90():
    # the split kernel without start (bf16, fp32), with start, with a contiguous window (no mark loads): 4 + 4 merges
    # + the window's check
    assert compile_for_sm90(_SM90_CALLS) == 9


def test_split_counts():
    """One split per 64 keys of the cache's length, whatever part of it is written; about 256 programs in all over
    the (row, KV head) pairs, 32 to 128 splits a pair."""
    splits = fused_ops_attention._decode_attention_splits
    assert [splits(L, 4) for L in (1, 64, 65, 256, 4096, 4097, 65536)] == [1, 1, 2, 4, 64, 64, 64]
    assert [splits(65536, h) for h in (1, 2, 4, 8, 16, 32, 128)] == [128, 128, 64, 32, 32, 32, 32]
    assert splits(4096, 1) == 64 and splits(100, 64) == 2


def test_split_counts_when_the_rows_fill_the_card(monkeypatch):
    """``_DA_CROWDED_PAIRS`` (256 as shipped): from that many (row, KV head) pairs on, ``_DA_CROWDED_SPLITS`` splits a
    pair at least in place of 32; fewer pairs keep the rule above."""
    splits = fused_ops_attention._decode_attention_splits
    assert [splits(5120, h) for h in (1024, 256, 255, 32, 4)] == [4, 4, 32, 32, 64]
    monkeypatch.setattr(fused_ops_attention, "_DA_CROWDED_SPLITS", 8)
    assert splits(5120, 1024) == 8 and splits(64, 1024) == 1
    monkeypatch.setattr(fused_ops_attention, "_DA_CROWDED_PAIRS", 1 << 30)
    assert splits(5120, 1024) == 32  # off: 256 rows x 4 KV heads take 32


# ---------------------------------------------------------------------------------------------------------------------
# CUDA: real Qwen3.5 attention shapes (head dim 256)
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("H, KV", [(8, 2), (16, 4), (24, 4)], ids=["0.8B", "4B-9B", "27B"])
@pytest.mark.parametrize("L, slot", [(1, 0), (8, 6), (256, 128), (2048, 2047), (4096, 3000), (16384, 8300)],
                         ids=["L1", "L8", "L256", "L2048", "L4096", "L16384-half-written"])
@pytest.mark.parametrize("B", [1, 3])
def test_decode_attention_cuda(dtype, H, KV, L, slot, B):
    check("cuda", dtype, B, H, KV, 256, L, slot)


@pytest.mark.cuda
def test_a_longer_cache_or_another_batch_compiles_nothing_new():
    """The split count and the key blocks per split are run-time values: after one call, longer caches (more blocks
    per split) and other batch sizes run the kernels already compiled, and stay correct."""
    check("cuda", torch.bfloat16, 1, 16, 4, 256, 256, 128)
    with TritonCompiles() as compiles:
        for B, L, slot in ((1, 4096, 3000), (3, 9000, 8999), (2, 20000, 17000)):
            check("cuda", torch.bfloat16, B, 16, 4, 256, L, slot)
    assert compiles.ours == {}


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("L, slot", [(256, 200), (4096, 3000)], ids=["L256", "L4096"])
def test_decode_attention_reads_each_row_from_its_start_cuda(dtype, L, slot):
    q, keys, values, valid, slot_t, gate, scale, start = windows("cuda", dtype, 5, L, slot)
    got = fused_ops.decode_attention(q, keys, values, valid, slot_t, gate, scale, start=start)
    want = fused_ops.decode_attention_ref(q, keys.nan_to_num(), values.nan_to_num(), valid, slot_t, gate, scale,
                                         start=start)
    assert torch.isfinite(got).all() and (got[-1] == 0).all()
    assert_close("y", got[:-1], want[:-1], BOUND[dtype])


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("L, slot", [(256, 200), (4096, 3000)], ids=["L256", "L4096"])
def test_decode_attention_over_contiguous_windows_cuda(dtype, L, slot):
    args, want = contiguous_windows("cuda", dtype, 5, L, slot)
    got = fused_ops.decode_attention(*args, contiguous=True)
    assert torch.isfinite(got).all() and (got[-1] == 0).all()
    assert_close("y", got[:-1], want[:-1], BOUND[dtype])


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("T", [2, 4])
@pytest.mark.parametrize("L, slot0", [(256, 200), (4096, 3000)], ids=["L256", "L4096"])
def test_decode_attention_several_tokens_over_one_row_cuda(dtype, T, L, slot0):
    several_tokens("cuda", dtype, T, 16, 4, 256, L, slot0)


@pytest.mark.cuda
def test_decode_attention_replays_in_graph():
    """Captured once, replayed as slot advances (read on the GPU), each replay matches the reference."""
    q, keys, values, valid, slot, gate, scale = inputs("cuda", torch.bfloat16, 2, 16, 4, 256, 512, 10, pad=False)
    valid[:, 11:] = False
    fused_ops.decode_attention(q, keys, values, valid, slot, gate, scale)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_ops.decode_attention(q, keys, values, valid, slot, gate, scale)
    for _ in range(3):
        slot += 37
        valid[:, : int(slot) + 1] = True
        keys[:, :, : int(slot) + 1].normal_()
        graph.replay()
        assert_close("y", out, fused_ops.decode_attention_ref(q, keys, values, valid, slot, gate, scale), 1e-2)
