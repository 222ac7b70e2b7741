"""Shared test set-up.

- `@pytest.mark.cuda` tests are skipped where no GPU is visible (CI is CPU-only); run them on the device with
  `python -m pytest -m cuda`, or over several processes with `bash scripts/run_cuda_tests.sh`.
- Tests of our kernels on CPU tensors carry `helpers.needs_interpreter`: skipped where a GPU is visible. Under the
  interpreter, an unmarked test of tests/ops that launches a kernel fails (it would fail, not skip, on a GPU machine).
- Without a GPU, Triton kernels run under the interpreter (`TRITON_INTERPRET=1`), which must be set before
  `triton.jit` decorates anything, so it is set here, before any test module imports `fused_ops`.
- transformers' own tests (tests/upstream) run in subprocesses, started when collection ends so that they overlap
  with the rest of the suite; the test waits for them, and the session's end stops any still running. The sm_90
  compile checks of the kernel test files (`helpers.compile_for_sm90`) start the same way, in one process, and so do
  the loading probes that a test module lists in `PRESTART` (tests/packaging/test_hub_loading.py).
"""

import os
import sys
from pathlib import Path

import pytest

# The repo root (for `scripts.common` and the remote code) and tests/ itself (for `helpers`, one module for every test
# folder: tests/ops, tests/model, tests/packaging) go first on sys.path.
REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
for _path in (TESTS, REPO):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except Exception:  # pragma: no cover
    _HAS_CUDA = False

if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # One intra-op thread a process on CPU (unless the caller chose): the models here are tiny, and transformers' tests
    # and the sm_90 compiles run in background processes beside this one, on CI's 2 cores, where OpenMP threads that
    # wait for a busy core spin and burn it (one pair of runs on 2 cores: 6 min 35 s with torch's default threads,
    # 5 min 59 s with one; runs there spread by up to a minute).
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", "slow: takes more than a few seconds on CPU")


def pytest_collection_modifyitems(config, items):
    if _HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


# Tests of tests/ops that launch our kernels on CPU tensors must carry `helpers.needs_interpreter`: on a GPU machine
# (no interpreter) a launch on CPU tensors fails, where the marker skips. Here, under the interpreter, a kernel launched
# by an unmarked test of tests/ops fails the test at once, saying so (`_guard_cpu_launches`).
_unmarked_test: list = []  # the id of the unmarked tests/ops test running now, if any


def _guard_cpu_launches():
    if _HAS_CUDA or os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except Exception:  # pragma: no cover - depends on the Triton version
        return
    run = InterpretedFunction.run

    def run_if_marked(self, *args, **kwargs):
        if _unmarked_test and not kwargs.get("warmup", False):
            raise AssertionError(
                f"{_unmarked_test[0]} launches the Triton kernel {self.__name__} on CPU tensors without "
                "`helpers.needs_interpreter`: on a GPU machine it would fail instead of skipping; add the marker.")
        return run(self, *args, **kwargs)

    InterpretedFunction.run = run_if_marked


_guard_cpu_launches()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    import helpers

    ops = TESTS / "ops"
    unmarked = Path(item.path).is_relative_to(ops) and not any(
        m.kwargs.get("reason") == helpers.INTERPRETER_REASON for m in item.iter_markers("skipif"))
    if unmarked:
        _unmarked_test.append(item.nodeid)
    try:
        yield
    finally:
        _unmarked_test.clear()


_UPSTREAM_TEST = "test_fused_classes_pass_what_stock_passes"
_started = []  # the upstream test module, once its runs were started
_stops = []  # what ends the other background work at the session's end


def pytest_collection_finish(session):
    """When the session will run the upstream comparison (tests/upstream), start its subprocess runs now
    (`start_runs`), so they overlap with the rest of the suite instead of running after it; likewise the sm_90
    compiles of the selected `*_for_sm90` tests (each module's `_SM90_CALLS`), in one background process, and the
    subprocess fixtures that test modules list in `PRESTART` (`helpers.prestart`)."""
    if session.config.option.collectonly:
        return
    sm90 = []
    for item in session.items:
        calls = getattr(item.module, "_SM90_CALLS", None) if "sm90" in item.name else None
        if calls is not None and calls not in sm90 and not item.get_closest_marker("skip"):
            sm90.append(calls)
    if sm90:
        import helpers

        helpers.start_compiles_for_sm90(sm90)
        _stops.append(helpers.stop_compiles_for_sm90)
    # test modules' subprocess fixtures (`PRESTART`) that a selected, not skipped test uses
    prestart = {}
    for item in session.items:
        for name, start in (getattr(item.module, "PRESTART", None) or {}).items():
            if name in item.fixturenames and not item.get_closest_marker("skip"):
                prestart.setdefault(name, start)
    if prestart:
        import helpers

        for name, start in prestart.items():
            helpers.prestart(name, start)
        _stops.append(helpers.stop_prestarted)
    for item in session.items:
        if item.name == _UPSTREAM_TEST and hasattr(item.module, "start_runs"):
            item.module.start_runs()
            _started.append(item.module)
            return


def pytest_sessionfinish(session, exitstatus):
    for module in _started:
        module.stop_runs()
    for stop in _stops:
        stop()


def pytest_report_header(config):
    versions = []
    for name in ("torch", "transformers", "triton", "fla", "huggingface_hub"):
        try:
            module = __import__(name)
            versions.append(f"{name} {getattr(module, '__version__', '?')}")
        except Exception:
            versions.append(f"{name} -")
    return "versions: " + ", ".join(versions) + f"; cuda: {_HAS_CUDA}"
