"""transformers' own Qwen3.5 model tests, run against the fused classes: every test that passes with the stock
classes passes with the fused ones, except the cases in BY_DESIGN.

The upstream tests live beside the repo, in `<repo>/../shared/upstream-tests` (see its README; they are not copied
into the repo), or where QWEN3_5_UPSTREAM_TESTS points; the test skips, saying so, where that folder is absent. The upstream test file runs twice, in two parallel
subprocesses with the same options: as it is (stock), and with `-p fused_substitute` (the fused classes in place of
the stock ones, see that module). Outcomes are read per test from each run's JUnit XML. When the session will run
this test, `tests/conftest.py` starts both runs as soon as collection ends (`start_runs`), so they overlap with the
rest of the suite (which leaves a core idle most of the time); the test waits for them.

It runs wherever the suite runs: on CPU in CI, and on a GPU machine (`python -m pytest tests/upstream`), where the
fused kernels run and stock itself fails some tests (training with fla, ...): the comparison is always against
stock on the same machine. Without a GPU both runs hide flash-linear-attention (`-p no_fla`, which says why).
"""

import fnmatch
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch
import transformers

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
# The GPU machine gets the repo alone (not the shared folder beside it): there, QWEN3_5_UPSTREAM_TESTS names a copy
# that travels with the repo (see the README's "Tests" section).
UPSTREAM = Path(os.environ.get("QWEN3_5_UPSTREAM_TESTS") or REPO.parent / "shared" / "upstream-tests").resolve()
TEST_FILE = "tests/models/qwen3_5/test_modeling_qwen3_5.py"
# One run takes ~2 min on CI's 2 cores (~4 min for the two side by side); the limit, from a run's start, is for a
# hung run.
RUN_TIMEOUT_S = 1500

# Tests that pass with stock and cannot pass with the fused classes, by design: {test id pattern (fnmatch): reason}.
# Test ids are `Class::test_name[param]`.
_BY_NAME = ("transformers' test finds the class by its name in the static stock mappings ({}), where the fused "
            "classes' own names (Qwen3_5Fused*) are not listed")
BY_DESIGN: dict[str, str] = {
    "*::test_training*": _BY_NAME.format("MODEL_MAPPING_NAMES, to skip base models") + ": the fused base model is "
    "trained and returns no loss (stock's base model is skipped by the same lookup)",
    "*::test_model_rope_*": _BY_NAME.format("MODEL_MAPPING_NAMES, to pick the base model") + ": the test skips",
    "*::test_vision_axial_rope": _BY_NAME.format("MODEL_MAPPING_NAMES, to pick the base model") + ": the test skips",
    "*::test_causal_lm_loss_honors_shift_labels": _BY_NAME.format("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES") + ": the test "
    "skips",
    "*::test_can_load_from_already_mapped_keys": "transformers applies its checkpoint key conversions to its own "
    "classes only, none to remote code (the loaders here do their own mapping): the test skips",
}


def _stage(root: Path) -> Path:
    """A writable view of the upstream folder: a link to each of its entries, plus `src/transformers` pointing at
    the installed package (`tests/test_pipeline_mixin.py` reads the library source from there, see the README)."""
    import transformers

    stage = root / "upstream-tests"
    stage.mkdir()
    for entry in UPSTREAM.iterdir():
        (stage / entry.name).symlink_to(entry)
    (stage / "src").mkdir()
    (stage / "src" / "transformers").symlink_to(Path(transformers.__file__).parent)
    return stage


def _start(stage: Path, out: Path, plugins: list[str]) -> dict:
    """Start the upstream Qwen3.5 test file with `plugins` in a subprocess, its output to a file beside `out`."""
    junit, report, log = out.with_suffix(".xml"), out.with_suffix(".json"), out.with_suffix(".log")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTEST_ADDOPTS")}
    # TRITON_INTERPRET is set by the repo's conftest for our kernel tests; the upstream tests run as a user would.
    env["PYTHONPATH"] = os.pathsep.join([str(stage), str(HERE)] + [p for p in [env.get("PYTHONPATH")] if p])
    env["QWEN3_5_SUBSTITUTE_REPORT"] = str(report)
    env.setdefault("OMP_NUM_THREADS", "1")  # tiny models: one thread each, beside the rest of the suite
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "_peer_compat"]
    for plugin in plugins:
        cmd += ["-p", plugin]
    cmd += ["-q", "-rN", "--tb=line", f"--junitxml={junit}", TEST_FILE]
    with open(log, "w") as sink:
        proc = subprocess.Popen(cmd, cwd=stage, env=env, stdout=sink, stderr=subprocess.STDOUT)
    return {"proc": proc, "junit": junit, "report": report, "log": log, "started": time.monotonic()}


def _finish(run: dict) -> dict:
    """Wait for a run `_start` began (at most RUN_TIMEOUT_S from its start); returns {"outcomes": {test id: (outcome,
    first line)}, "tail": the end of its output, "timed_out", "substitutions": what fused_substitute reported}."""
    proc, timed_out = run["proc"], False
    try:
        proc.wait(timeout=max(1.0, RUN_TIMEOUT_S - (time.monotonic() - run["started"])))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        timed_out = True
    tail = run["log"].read_text(errors="replace")[-3000:] if run["log"].exists() else ""
    outcomes = _parse_junit(run["junit"]) if run["junit"].exists() else {}
    substitutions = json.loads(run["report"].read_text()) if run["report"].exists() else None
    return {"outcomes": outcomes, "tail": tail, "timed_out": timed_out, "substitutions": substitutions}


# The two runs of this session, once started: {"dir": their folder, "stock": ..., "fused": ...} (see start_runs).
_RUNS: dict = {}


def skip_reason() -> str | None:
    """Why this machine cannot run the comparison, or None."""
    if not (UPSTREAM / TEST_FILE).is_file():
        return f"transformers' Qwen3.5 tests not found at {UPSTREAM} (the shared folder beside the repo)"
    if importlib.util.find_spec("parameterized") is None:
        return "the upstream tests need `parameterized` (requirements.txt)"
    return None


def start_runs() -> None:
    """Start the stock and the fused run in the background, once per session (nothing where they cannot run)."""
    if _RUNS or skip_reason():
        return
    root = Path(tempfile.mkdtemp(prefix="qwen35-upstream-"))
    stage = _stage(root)
    common = [] if torch.cuda.is_available() else ["no_fla"]
    _RUNS.update(dir=root, stock=_start(stage, root / "stock", common),
                 fused=_start(stage, root / "fused", common + ["fused_substitute"]))


def stop_runs() -> None:
    """End of session: stop runs still going (their test was not reached) and remove their folder."""
    for key in ("stock", "fused"):
        if key in _RUNS and _RUNS[key]["proc"].poll() is None:
            _RUNS[key]["proc"].kill()
            _RUNS[key]["proc"].wait()
    if "dir" in _RUNS:
        shutil.rmtree(_RUNS["dir"], ignore_errors=True)
    _RUNS.clear()


def _parse_junit(path: Path) -> dict:
    """{`Class::test_name[param]`: (passed | failed | skipped, first line of the message)} from a JUnit XML file."""
    outcomes = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        test_id = f"{case.get('classname', '').rpartition('.')[2]}::{case.get('name')}"
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = "skipped" if child.tag == "skipped" else "failed"
                text = child.get("message") or child.text or ""
                message = next((line.strip() for line in text.splitlines() if line.strip()), "")
                break
        outcomes[test_id] = (outcome, message[:300])
    return outcomes


def _by_design(test_id: str) -> str | None:
    return next((reason for pattern, reason in BY_DESIGN.items() if fnmatch.fnmatchcase(test_id, pattern)), None)


@pytest.mark.slow
def test_fused_classes_pass_what_stock_passes():
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    start_runs()  # already running when conftest started them at the end of collection
    stock, fused = _finish(_RUNS["stock"]), _finish(_RUNS["fused"])

    for name, run in (("stock", stock), ("fused", fused)):
        assert not run["timed_out"], f"the {name} run took over {RUN_TIMEOUT_S} s; its output ends:\n{run['tail']}"
    assert fused["substitutions"], f"fused_substitute did not run; the fused run's output ends:\n{fused['tail']}"
    stock_passed = sorted(t for t, (outcome, _) in stock["outcomes"].items() if outcome == "passed")
    if not stock_passed:
        errors = [line for line in stock["tail"].splitlines() if line.startswith("E ")] or stock["tail"].splitlines()
        pytest.skip(f"no upstream test passes with stock transformers {transformers.__version__} here (the "
                    f"comparison holds: nothing to keep passing); the stock run: {' '.join(errors[-1:])}")

    regressions = []
    for test_id in stock_passed:
        outcome, message = fused["outcomes"].get(test_id, ("missing", "not run (collection error?)"))
        if outcome != "passed" and _by_design(test_id) is None:
            regressions.append(f"{test_id}: {outcome}: {message}")
    counts = {name: {o: sum(v[0] == o for v in run["outcomes"].values()) for o in ("passed", "failed", "skipped")}
              for name, run in (("stock", stock), ("fused", fused))}
    by_design = sorted(t for t in stock_passed if fused["outcomes"].get(t, ("missing",))[0] != "passed"
                       and _by_design(t) is not None)
    # Shown with `-s` (the device run keeps it for the closing note); pytest captures it otherwise.
    print(f"\nupstream Qwen3.5 tests, transformers {transformers.__version__}, "
          f"{'cuda' if torch.cuda.is_available() else 'cpu'}: stock {counts['stock']}, fused {counts['fused']}; "
          f"stock-pass / fused-not-pass: {len(regressions)} regressions, {len(by_design)} by design")
    assert not regressions, (
        f"{len(regressions)} upstream tests pass with stock but not with the fused classes "
        f"(stock {counts['stock']}, fused {counts['fused']}):\n" + "\n".join(regressions)
    )
