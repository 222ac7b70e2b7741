"""The per-card record of `small_linear`'s choices (`fused_ops_gemv`): written beside Triton's cache, read by later
processes, robust to a missing, corrupt or stale file (CPU: the record itself; CUDA: `small_linear` through it)."""

import json
import logging

import pytest
import torch

from helpers import fused_ops
from scripts.common import import_module

fused_ops_gemv = import_module("fused_ops_gemv")
KEY = (2, 4096, 2560, True, torch.bfloat16, torch.device("cuda", 0))
OTHER = (1, 2560, 4096, False, torch.bfloat16, torch.device("cuda", 0))


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(fused_ops_gemv, "_records", {})
    monkeypatch.setattr(fused_ops_gemv, "_told_rows", set())


def test_choices_round_trip_and_merge_with_another_writer(tmp_path, fresh):
    path = tmp_path / "qwen3_5_fused" / "small_linear_x.json"
    assert fused_ops_gemv.recorded_choice(path, KEY) is None  # no file yet
    config = fused_ops_gemv._GEMV_CONFIGS[3]
    fused_ops_gemv.record_choice(path, KEY, config)
    # another process adds its choice to the file meanwhile; ours is merged with it, not written over it
    on_disk = json.loads(path.read_text())
    path.write_text(json.dumps({**on_disk, "9x9x9-float32": "cublas"}))
    fused_ops_gemv.record_choice(path, OTHER, "cublas")
    on_disk = json.loads(path.read_text())
    assert on_disk["9x9x9-float32"] == "cublas" and on_disk["1x2560x4096-bfloat16"] == "cublas"
    fused_ops_gemv._records.clear()  # a new process reads the file
    assert fused_ops_gemv.recorded_choice(path, KEY) == config
    assert fused_ops_gemv.recorded_choice(path, OTHER) == "cublas"
    assert not list(path.parent.glob("*.tmp"))


def test_a_skinny_choice_round_trips_as_itself(tmp_path, fresh):
    """A `skinny_gemm` config is written tagged and read back as a `SkinnyConfig`, not as a `gemv` config."""
    path = tmp_path / "small_linear_x.json"
    config = fused_ops_gemv._SKINNY_CONFIGS[1]
    fused_ops_gemv.record_choice(path, KEY, config)
    assert json.loads(path.read_text())["2x4096x2560-gate_up-bfloat16"] == ["skinny", *config]
    fused_ops_gemv._records.clear()
    back = fused_ops_gemv.recorded_choice(path, KEY)
    assert back == config and isinstance(back, fused_ops_gemv.SkinnyConfig)


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"2x4096x2560-gate_up-bfloat16": [3, 3, 3]}',
                                     '{"2x4096x2560-gate_up-bfloat16": ["skinny", 3, 3, 3, 3]}'])
def test_corrupt_or_stale_records_are_ignored(tmp_path, fresh, content):
    """An unreadable file, or a config that is no longer a candidate, gives no choice (the shape is timed again and
    the file rewritten)."""
    path = tmp_path / "small_linear_x.json"
    path.write_text(content)
    assert fused_ops_gemv.recorded_choice(path, KEY) is None
    fused_ops_gemv.record_choice(path, KEY, "cublas")
    assert json.loads(path.read_text()) == {"2x4096x2560-gate_up-bfloat16": "cublas"}


def test_no_cache_dir_means_no_record(tmp_path, fresh):
    assert fused_ops_gemv.recorded_choice(None, KEY) is None
    fused_ops_gemv.record_choice(None, KEY, "cublas")  # nothing to write, no error
    assert fused_ops_gemv._records == {}


def test_timing_is_announced_once_per_row_tier(caplog, fresh, tmp_path):
    """One line per set of row counts that share compiled candidates (1; 2-16; 17-32): the steps that compile."""
    with caplog.at_level(logging.WARNING, logger=fused_ops_gemv.__name__):
        for rows in (1, 1, 2, 4, 16, 17, 32):
            fused_ops_gemv._announce_timing(rows, torch.device("cuda", 0), tmp_path / "q" / "f.json")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3, lines
    assert "with 1 row(s)" in lines[0] and "tens of seconds" in lines[0]
    assert "with 2-16 row(s)" in lines[1] and "a few seconds" in lines[1] and "with 17-32 row(s)" in lines[2]
    assert str(tmp_path / "q") in lines[0]


def test_candidates_by_rows_and_dtype():
    """The `gemv` configs at one row; two `skinny_gemm` configs at 2-32 rows of a 16-bit dtype (one pair for the
    gate|up kind, one for the rest); none (cuBLAS untimed) in float32 or past 32 rows."""
    def cands(rows, dtype=torch.bfloat16, gate_up=False):
        return fused_ops_gemv._candidates(torch.empty(rows, 8, dtype=dtype), gate_up)

    assert cands(1) == fused_ops_gemv._GEMV_CONFIGS
    plain, gate_up = cands(2), cands(32, torch.float16, True)
    assert len(plain) == len(gate_up) == 2 and not set(plain) & set(gate_up)
    assert all(isinstance(c, fused_ops_gemv.SkinnyConfig) for c in plain + gate_up)
    assert set(plain + gate_up) == set(fused_ops_gemv._SKINNY_CONFIGS)
    assert cands(8, torch.float32) == () and cands(33) == ()


@pytest.mark.cuda
def test_small_linear_reads_the_record_instead_of_timing(tmp_path, fresh, monkeypatch):
    """On the GPU: the first choice of a shape is timed and recorded; with the in-process choices forgotten (a new
    process), the record is read and nothing is timed; the result is the chosen kernel's."""
    import triton

    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path))
    monkeypatch.setattr(fused_ops_gemv, "_small_linear_choice", {})
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, 512, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16, generator=gen)
    y = fused_ops.small_linear(x, w)
    (choice,) = fused_ops_gemv._small_linear_choice.values()
    path = fused_ops_gemv._record_path(x.device)
    assert path.is_file() and fused_ops_gemv.recorded_choice(path, (1, 1024, 512, False, x.dtype, x.device)) == choice

    fused_ops_gemv._small_linear_choice.clear()
    fused_ops_gemv._records.clear()

    def no_timing(*args):
        raise AssertionError("timed although the choice was recorded")

    monkeypatch.setattr(fused_ops_gemv, "_time_candidates", no_timing)
    again = fused_ops.small_linear(x, w)
    assert list(fused_ops_gemv._small_linear_choice.values()) == [choice]
    assert torch.equal(again, y)


@pytest.mark.cuda
@pytest.mark.parametrize("rows, dtype", [(33, torch.bfloat16), (4, torch.float32)], ids=["33-rows", "fp32"])
def test_shapes_without_candidates_take_cublas_without_timing(monkeypatch, rows, dtype):
    """Past `_SKINNY_MAX_M` rows, or in float32 past one row, the choice is cuBLAS at once: nothing compiled or
    timed at a new batch size."""
    monkeypatch.setattr(fused_ops_gemv, "_small_linear_choice", {})

    def no_timing(*args):
        raise AssertionError("timed a shape without candidates")

    monkeypatch.setattr(fused_ops_gemv, "_time_candidates", no_timing)
    x = torch.randn(rows, 512, device="cuda", dtype=dtype)
    w = torch.randn(1024, 512, device="cuda", dtype=dtype)
    y = fused_ops.small_linear(x, w)
    assert list(fused_ops_gemv._small_linear_choice.values()) == ["cublas"]
    assert torch.equal(y, torch.nn.functional.linear(x, w))


@pytest.mark.cuda
@pytest.mark.parametrize("gate_up", [False, True], ids=["linear", "gate_up"])
def test_several_rows_time_the_skinny_pair_and_run_the_pick(monkeypatch, gate_up):
    """At 2-32 rows (bf16) cuBLAS and the two `skinny_gemm` candidates of the kind are timed; the pick runs, and
    its result is the picked kernel's, close to `F.linear`'s (+ SwiGLU)."""
    monkeypatch.setattr(fused_ops_gemv, "_small_linear_choice", {})
    monkeypatch.setattr(fused_ops_gemv, "RECORD_CHOICES", False)
    seen = {}
    real = fused_ops_gemv._time_candidates

    def spy(x, w, gate_up_, conv, candidates):
        seen["timings"] = real(x, w, gate_up_, conv, candidates)
        return seen["timings"]

    monkeypatch.setattr(fused_ops_gemv, "_time_candidates", spy)
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(5, 1024, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16, generator=gen) / 32
    y = fused_ops.small_linear(x, w, gate_up=gate_up)
    assert set(seen["timings"]) == {"cublas", *fused_ops_gemv._skinny_candidates(gate_up)}
    (choice,) = fused_ops_gemv._small_linear_choice.values()
    assert torch.equal(y, fused_ops_gemv._run_small_linear(x, w, gate_up, choice))
    torch.testing.assert_close(y, fused_ops.small_linear_ref(x, w, gate_up), rtol=2e-2, atol=2e-2)


def test_record_can_be_switched_off(monkeypatch):
    """`RECORD_CHOICES = False` (benchmark_gemv.py, which must time every shape): no record path, no CUDA call."""
    monkeypatch.setattr(fused_ops_gemv, "RECORD_CHOICES", False)
    assert fused_ops_gemv._record_path(torch.device("cuda", 0)) is None


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["gemv", "skinny"])
def test_timing_compiles_its_candidates_at_once_before_timing(tmp_path, monkeypatch, kind):
    """On the GPU: timing a shape compiles every candidate (GEMV or skinny GEMM) in one batch first
    (`compile_in_parallel`, on a pool of threads), so the timing loop after it compiles nothing. Counted with
    Triton's JIT hooks, on an empty on-disk cache and with the kernel's in-process binaries dropped."""
    import triton

    if import_module("fused_ops_runtime")._AsyncCompileMode is None:
        pytest.skip("this Triton has no asynchronous compile mode: the candidates compile one by one")
    kernel = fused_ops_gemv._gemv_kernel if kind == "gemv" else fused_ops_gemv._skinny_gemm_kernel
    candidates = fused_ops_gemv._GEMV_CONFIGS if kind == "gemv" else fused_ops_gemv._skinny_candidates(True)
    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path))
    monkeypatch.setattr(kernel, "device_caches", type(kernel.device_caches)(kernel.create_binder))
    compiled = {"before": 0, "timing": 0}
    phase = ["before"]

    def count(*, fn, **_):
        if fn.name.endswith(kernel.fn.__name__):
            compiled[phase[0]] += 1
        return False

    real_time = fused_ops_gemv._time_in_graph_ms

    def timing(*args, **kwargs):
        phase[0] = "timing"
        return real_time(*args, **kwargs)

    monkeypatch.setattr(triton.knobs.runtime, "jit_post_compile_hook", count)
    monkeypatch.setattr(fused_ops_gemv, "_time_in_graph_ms", timing)
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(3, 640, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(2 * 384, 640, device="cuda", dtype=torch.bfloat16, generator=gen)
    timings = fused_ops_gemv._time_candidates(x, w, True, None, candidates)
    assert set(timings) == {"cublas", *candidates}
    assert compiled["before"] >= 2 and compiled["timing"] == 0, compiled


@pytest.mark.cuda
def test_one_row_timing_compiles_the_skinny_pair_for_more_rows(tmp_path, monkeypatch):
    """On the GPU, empty Triton cache: the first one-row timing of a shape also compiles its two `skinny_gemm`
    candidates (`_ahead_of_more_rows`), so the first 2-16 row call of that shape times them without compiling."""
    import triton

    if import_module("fused_ops_runtime")._AsyncCompileMode is None:
        pytest.skip("this Triton has no asynchronous compile mode: warm-up launches compile nothing ahead")
    kernel = fused_ops_gemv._skinny_gemm_kernel
    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path))
    monkeypatch.setattr(kernel, "device_caches", type(kernel.device_caches)(kernel.create_binder))
    monkeypatch.setattr(fused_ops_gemv, "_small_linear_choice", {})
    monkeypatch.setattr(fused_ops_gemv, "RECORD_CHOICES", False)
    compiled = []

    def count(*, fn, **_):
        compiled.append(fn.name)
        return False

    monkeypatch.setattr(triton.knobs.runtime, "jit_post_compile_hook", count)
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(1536, 640, device="cuda", dtype=torch.bfloat16, generator=gen)
    fused_ops.small_linear(torch.randn(1, 640, device="cuda", dtype=torch.bfloat16, generator=gen), w)
    assert sum(name.endswith("_skinny_gemm_kernel") for name in compiled) == 2, compiled
    compiled.clear()
    fused_ops.small_linear(torch.randn(5, 640, device="cuda", dtype=torch.bfloat16, generator=gen), w)
    assert not [name for name in compiled if name.endswith("_skinny_gemm_kernel")], compiled


def test_the_skinny_pair_is_compiled_ahead_only_from_a_one_row_16_bit_timing(monkeypatch):
    """`_ahead_of_more_rows` gives the two skinny candidates' warm-up launches for a one-row bf16 / fp16 timing of
    a shape with no choices at 2-16 rows (2 rows, x's row stride), and nothing for float32 or at more rows."""
    monkeypatch.setattr(fused_ops_gemv, "_record_path", lambda device: None)
    monkeypatch.setattr(fused_ops_gemv, "shipped_choice", lambda key: None)
    w = torch.empty(64, 32, dtype=torch.bfloat16)
    ahead = fused_ops_gemv._ahead_of_more_rows(torch.empty(1, 32, dtype=torch.bfloat16), w, False)
    assert [p.args[4] for p in ahead] == list(fused_ops_gemv._skinny_candidates(False))
    assert all(p.args[0].shape == (2, 32) and p.args[0].stride(0) == 32 and p.args[5] is True for p in ahead)
    wide = torch.empty(1, 48, dtype=torch.float16)[:, :32]
    assert fused_ops_gemv._ahead_of_more_rows(wide, w.half(), True)[0].args[0].stride(0) == 48
    assert fused_ops_gemv._ahead_of_more_rows(torch.empty(1, 32), w.float(), False) == []
    assert fused_ops_gemv._ahead_of_more_rows(torch.empty(2, 32, dtype=torch.bfloat16), w, False) == []


def test_a_recorded_one_row_choice_compiles_the_skinny_configs_of_2_to_16_rows_with_it(monkeypatch):
    """A one-row choice read from the record or the shipped table compiles, in the same pool, the kernel it names
    and every skinny config that 2-16 rows of the shape may run: the ones chosen at any of those counts (they differ
    by count), or both candidates while some count has no choice (it will be timed). Nothing at more rows; no skinny
    kernel for float32."""
    one = fused_ops_gemv._GEMV_CONFIGS[0]
    a, b = fused_ops_gemv._skinny_candidates(False)
    w = torch.empty(64, 32, dtype=torch.bfloat16)
    x = torch.empty(1, 32, dtype=torch.bfloat16)
    table = {}
    monkeypatch.setattr(fused_ops_gemv, "_record_path", lambda device: None)
    monkeypatch.setattr(fused_ops_gemv, "shipped_choice", lambda key: table.get(key[0]))

    def pooled(gate_up=False, choice=one, x=x, w=w):
        return [p.args[4] for p in fused_ops_gemv._recorded_warmups(x, w, gate_up, None, choice)]

    assert pooled() == [one, a, b]  # nothing known at 2-16 rows: both candidates
    assert pooled(True, "cublas") == list(fused_ops_gemv._skinny_candidates(True))
    table.update({m: "cublas" for m in range(2, 17)})
    table[2] = b
    assert pooled() == [one, b]  # every count known: what they chose
    table[9] = a
    assert pooled() == [one, b, a]
    del table[16]
    assert pooled() == [one, a, b]
    table.update({m: "cublas" for m in range(2, 17)})
    assert pooled() == [one]
    del table[16]
    assert pooled(x=torch.empty(2, 32, dtype=torch.bfloat16)) == []
    assert pooled(x=torch.empty(1, 32), w=w.float()) == [one]
    part = fused_ops_gemv._recorded_warmups(x, w, False, None, one)[1]
    assert part.func is fused_ops_gemv._skinny_launch and part.args[0].shape == (2, 32) and part.args[5] is True
