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


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"2x4096x2560-gate_up-bfloat16": [3, 3, 3]}'])
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


def test_timing_is_announced_once_per_row_count(caplog, fresh, tmp_path):
    with caplog.at_level(logging.WARNING, logger=fused_ops_gemv.__name__):
        for rows in (2, 2, 4):
            fused_ops_gemv._announce_timing(rows, torch.device("cuda", 0), tmp_path / "q" / "f.json")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "with 2 row(s)" in lines[0] and "with 4 row(s)" in lines[1]
    assert str(tmp_path / "q") in lines[0]


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
def test_more_rows_than_timed_take_cublas_without_timing(monkeypatch):
    """Past `_GEMV_TIMED_MAX_M` rows the choice is cuBLAS at once: nothing compiled or timed at a new batch size."""
    monkeypatch.setattr(fused_ops_gemv, "_small_linear_choice", {})

    def no_timing(*args):
        raise AssertionError("timed a row count past _GEMV_TIMED_MAX_M")

    monkeypatch.setattr(fused_ops_gemv, "_time_candidates", no_timing)
    rows = fused_ops_gemv._GEMV_TIMED_MAX_M + 1
    x = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16)
    y = fused_ops.small_linear(x, w)
    assert list(fused_ops_gemv._small_linear_choice.values()) == ["cublas"]
    assert torch.equal(y, torch.nn.functional.linear(x, w))


def test_record_can_be_switched_off(monkeypatch):
    """`RECORD_CHOICES = False` (benchmark_gemv.py, which must time every shape): no record path, no CUDA call."""
    monkeypatch.setattr(fused_ops_gemv, "RECORD_CHOICES", False)
    assert fused_ops_gemv._record_path(torch.device("cuda", 0)) is None


@pytest.mark.cuda
def test_timing_compiles_its_candidates_at_once_before_timing(tmp_path, monkeypatch):
    """On the GPU: timing a shape compiles every GEMV candidate in one batch first (`compile_in_parallel`, on a pool
    of threads), so the timing loop after it compiles nothing. Counted with Triton's JIT hooks, on an empty
    on-disk cache and with the kernel's in-process binaries dropped."""
    import triton

    if import_module("fused_ops_runtime")._AsyncCompileMode is None:
        pytest.skip("this Triton has no asynchronous compile mode: the candidates compile one by one")
    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path))
    monkeypatch.setattr(fused_ops_gemv._gemv_kernel, "device_caches", type(fused_ops_gemv._gemv_kernel.device_caches)(
        fused_ops_gemv._gemv_kernel.create_binder))
    compiled = {"before": 0, "timing": 0}
    phase = ["before"]

    def count(*, fn, **_):
        if fn.name.endswith("_gemv_kernel"):
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
    timings = fused_ops_gemv._time_candidates(x, w, True, None)
    assert set(timings) == {"cublas", *fused_ops_gemv._GEMV_CONFIGS}
    assert compiled["before"] >= 2 and compiled["timing"] == 0, compiled
