"""transformers' own Qwen3.5 model tests, run against the fused classes: every test that passes with the stock
classes passes with the fused ones, except the cases in BY_DESIGN (and, on a GPU, BY_DESIGN_CUDA).

The upstream tests live beside the repo, in `<repo>/../shared/upstream-tests` (see its README; they are not copied
into the repo), or where QWEN3_5_UPSTREAM_TESTS points; the test skips, saying so, where that folder is absent.

The upstream test file runs with `-p fused_substitute` (the fused classes in place of the stock ones, see that
module) and, with the same options, as it is (stock), only on the tests the fused run did not pass: whether stock
passes a test the fused classes pass changes nothing, and a full stock run cost as much CPU as the fused one.
Stock's test ids are collected beside the fused run, so a test missing from the fused run counts as not passed.
Outcomes are read per test from each run's JUnit XML. When the session will run this test, `tests/conftest.py`
starts the fused run and the stock collection as soon as collection ends (`start_runs`), and a thread starts the
stock run when they end, so all of it overlaps with the rest of the suite; the test waits for them.

It runs wherever the suite runs: on CPU in CI, and on a GPU machine (`QWEN3_5_UPSTREAM_SHARDS=14 python -m pytest
tests/upstream`: each run split over 14 processes), where the fused kernels run and stock itself fails some tests
(training with fla, ...): the comparison is always against stock on the same machine. Without a GPU both runs hide
flash-linear-attention (`-p no_fla`, which says why), and the fused run takes the CPU emulation of the GPU path
(`QWEN3_5_SUBSTITUTE_EMULATE`, see `fused_substitute`).
"""

import fnmatch
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
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
# The fused run takes ~2.5 min beside the rest of the suite on CI's 2 cores, stock's (mostly skips) well under one;
# the limit, from a run's start, is for a hung run.
RUN_TIMEOUT_S = 1500
# QWEN3_5_UPSTREAM_SHARDS=N (default 1) splits the fused run and the stock run over N processes each, by test id:
# on the H200 the fused run compiles fla's kernels for every tiny config one after another and did not finish within
# one device call (600 s); N processes spread those compiles over N cores. With N > 1 the fused run starts once
# stock's ids are collected and runs exactly those ids (an id the fused classes do not collect fails its shard).
SHARDS = int(os.environ.get("QWEN3_5_UPSTREAM_SHARDS") or 1)

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

# On a GPU only (where the fused kernels run; on CPU these pass and stay checked):
BY_DESIGN_CUDA: dict[str, str] = {
    "*::test_save_load": "a remote-code class reloading as stock: the upstream testers also save and reload stock's "
    "classification heads (they stay stock in the substitution), built from the fused config, so over the fused "
    "backbone (registered with AutoModel as remote loading registers it); reloaded through stock's own config class "
    "they are stock, over fla's TF32 chunked rule. Measured on the H200 (fp32, Qwen3_5ModelTest): the sequence / "
    "token classification heads differ from before the save by 4.7e-6 / 3.8e-5 (the test's atol: 1e-5), while the "
    "fused classes of the test reload exactly (difference 0.0)",
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


def _start(stage: Path, out: Path, plugins: list[str], select: list[str] | None = None,
           collect_only: bool = False) -> dict:
    """Start the upstream Qwen3.5 test file with `plugins` in a subprocess, its output to a file beside `out`: every
    test, the tests in `select` (ids `Class::test_name[param]`), or (`collect_only`) only their ids."""
    junit, report, log = out.with_suffix(".xml"), out.with_suffix(".json"), out.with_suffix(".log")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTEST_ADDOPTS")}
    # TRITON_INTERPRET is set by the repo's conftest for our kernel tests; the upstream tests run as a user would.
    env["PYTHONPATH"] = os.pathsep.join([str(stage), str(HERE)] + [p for p in [env.get("PYTHONPATH")] if p])
    env["QWEN3_5_SUBSTITUTE_REPORT"] = str(report)
    env.setdefault("OMP_NUM_THREADS", "1")  # tiny models: one thread each, beside the rest of the suite
    if "fused_substitute" in plugins and not torch.cuda.is_available():
        # Without a GPU the fused classes would take the stock fallback (stock's own code, which tests/model checks
        # bit for bit); the fused run emulates the GPU path instead (its control flow with the kernels' torch
        # references), where the regressions live. QWEN3_5_SUBSTITUTE_EMULATE=0 runs the fallback.
        env.setdefault("QWEN3_5_SUBSTITUTE_EMULATE", "1")
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "_peer_compat", "-p", "testing_bridge"]
    for plugin in plugins:
        cmd += ["-p", plugin]
    cmd += ["-q", "-rN", "--tb=line"] + (["--collect-only"] if collect_only else [f"--junitxml={junit}"])
    cmd += [f"{TEST_FILE}::{test_id}" for test_id in select] if select is not None else [TEST_FILE]
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


def _start_group(stage: Path, out: Path, plugins: list[str], select: list[str] | None) -> list[dict]:
    """`_start` over `SHARDS` processes (round-robin slices of `select`); one process for the whole file when
    `select` is None or SHARDS is 1."""
    if select is not None and not select:
        return []
    if select is None or SHARDS <= 1:
        return [_start(stage, out, plugins, select=select)]
    slices = [select[i::SHARDS] for i in range(SHARDS)]
    return [_start(stage, out.with_name(f"{out.name}-{i}"), plugins, select=part) for i, part in enumerate(slices)
            if part]


def _finish_group(runs: list[dict]) -> dict:
    """`_finish` of every run of a group, merged: all outcomes, every tail, timed out if any was, the substitutions
    only if every run reported them."""
    done = [_finish(run) for run in runs]
    subs = [d["substitutions"] for d in done]
    return {"outcomes": {k: v for d in done for k, v in d["outcomes"].items()},
            "tail": "\n".join(d["tail"] for d in done)[-6000:], "timed_out": any(d["timed_out"] for d in done),
            "substitutions": subs[0] if subs and all(subs) else None}


# The runs of this session, once started: {"dir": their folder, "fused": ..., "stock_ids": ..., "stock": ...,
# "chain": the thread that starts stock, and what it found} (see start_runs).
_RUNS: dict = {}
_LOCK = threading.Lock()


def skip_reason() -> str | None:
    """Why this machine cannot run the comparison, or None."""
    if not (UPSTREAM / TEST_FILE).is_file():
        return (f"transformers' Qwen3.5 tests not found at {UPSTREAM} (the shared folder beside the repo, or "
                f"QWEN3_5_UPSTREAM_TESTS)")
    if importlib.util.find_spec("parameterized") is None:
        return "the upstream tests need `parameterized` (requirements.txt)"
    return None


def start_runs() -> None:
    """Start, in the background, once per session (nothing where they cannot run): the fused run of every test, and
    the collection of the stock run's test ids. Stock then runs only where the fused classes did not pass (see the
    test): whether stock passes a test the fused classes pass changes nothing, and stock's full run cost as much CPU
    as the fused one."""
    if _RUNS or skip_reason():
        return
    root = Path(tempfile.mkdtemp(prefix="qwen35-upstream-"))
    stage = _stage(root)
    common = [] if torch.cuda.is_available() else ["no_fla"]
    _RUNS.update(dir=root, stage=stage, common=common,
                 stock_ids=_start(stage, root / "stock-ids", common, collect_only=True))
    if SHARDS <= 1:  # sharded, the fused run waits for stock's ids (`_select_and_start_stock`)
        _RUNS["fused"] = [_start(stage, root / "fused", common + ["fused_substitute"])]
    # the stock run starts as soon as the fused run ends, not when the test is reached
    _RUNS["chain"] = threading.Thread(target=_start_stock_after_fused, daemon=True)
    _RUNS["chain"].start()


def _start_stock_after_fused() -> None:
    """Wait for the fused run and the stock collection; start stock on every test it has that the fused classes did
    not pass (failed, skipped, or missing from their run). Results go into `_RUNS` (an error too, for the test)."""
    try:
        _select_and_start_stock()
    except Exception as e:  # pragma: no cover - reported by the test
        _RUNS["chain_error"] = f"{type(e).__name__}: {e}"


def _select_and_start_stock() -> None:
    collected = _finish(_RUNS["stock_ids"])
    prefix = TEST_FILE + "::"
    stock_ids = [line[len(prefix):] for line in _RUNS["stock_ids"]["log"].read_text(errors="replace").splitlines()
                 if line.startswith(prefix)]
    with _LOCK:
        if "fused" not in _RUNS and not _RUNS.get("stopped"):  # sharded: the fused run starts on stock's ids
            _RUNS["fused"] = _start_group(_RUNS["stage"], _RUNS["dir"] / "fused",
                                          _RUNS["common"] + ["fused_substitute"], stock_ids)
    fused = _finish_group(_RUNS.get("fused", []))
    select = [t for t in stock_ids if fused["outcomes"].get(t, ("missing",))[0] != "passed"]
    with _LOCK:
        _RUNS.update(fused_result=fused, collected=collected, ids=stock_ids, select=select)
        if select and not _RUNS.get("stopped"):
            _RUNS["stock"] = _start_group(_RUNS["stage"], _RUNS["dir"] / "stock", _RUNS["common"], select)


def stop_runs() -> None:
    """End of session: stop runs still going (their test was not reached) and remove their folder."""
    with _LOCK:
        _RUNS["stopped"] = True  # the chain thread starts nothing more
    for key in ("stock_ids", "fused", "stock"):
        for run in (_RUNS[key] if isinstance(_RUNS.get(key), list) else [_RUNS[key]] if key in _RUNS else []):
            if run["proc"].poll() is None:
                run["proc"].kill()
                run["proc"].wait()
        if key == "fused" and "chain" in _RUNS:
            _RUNS["chain"].join(timeout=60)  # returns once the runs it waits for are gone
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
    cases = {**BY_DESIGN, **(BY_DESIGN_CUDA if torch.cuda.is_available() else {})}
    return next((reason for pattern, reason in cases.items() if fnmatch.fnmatchcase(test_id, pattern)), None)


@pytest.mark.slow
@pytest.mark.timeout(0)  # pytest.ini's per-test limit is off here: the runs it waits for are bounded by RUN_TIMEOUT_S
def test_fused_classes_pass_what_stock_passes():
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    start_runs()  # already running when conftest started them at the end of collection
    _RUNS["chain"].join()  # each run it waits for is bounded by RUN_TIMEOUT_S
    assert "chain_error" not in _RUNS, f"choosing the stock run's tests failed: {_RUNS['chain_error']}"
    fused, collected = _RUNS["fused_result"], _RUNS["collected"]
    stock_ids, select = _RUNS["ids"], _RUNS["select"]
    for name, run in (("fused", fused), ("stock collection", collected)):
        assert not run["timed_out"], f"the {name} run took over {RUN_TIMEOUT_S} s; its output ends:\n{run['tail']}"
    # A version whose stock classes collect none of the tests compares nothing: that fails (a run that cannot be
    # made is not a pass). `testing_bridge` supplies the helpers a newer transformers dropped.
    tail = collected["tail"]
    errors = [line for line in tail.splitlines() if line.startswith("E ")] or tail.splitlines()
    assert stock_ids, (f"stock transformers {transformers.__version__} collects none of the upstream tests here, so "
                       f"nothing is compared; its collection ends: {' '.join(errors[-3:])}")
    assert fused["substitutions"], f"fused_substitute did not run; the fused run's output ends:\n{fused['tail']}"
    if select:
        stock = _finish_group(_RUNS["stock"])
        assert not stock["timed_out"], f"the stock run took over {RUN_TIMEOUT_S} s; its output ends:\n{stock['tail']}"
    else:
        stock = {"outcomes": {}, "tail": ""}
    stock_passed = sorted(t for t, (outcome, _) in stock["outcomes"].items() if outcome == "passed")

    regressions, by_design = [], []
    for test_id in stock_passed:
        outcome, message = fused["outcomes"].get(test_id, ("missing", "not run (collection error?)"))
        if outcome != "passed":
            (regressions if _by_design(test_id) is None else by_design).append(f"{test_id}: {outcome}: {message}")
    counts = {name: {o: sum(v[0] == o for v in run["outcomes"].values()) for o in ("passed", "failed", "skipped")}
              for name, run in (("stock", stock), ("fused", fused))}
    # Shown with `-s` (the device run keeps it for the closing note); pytest captures it otherwise.
    print(f"\nupstream Qwen3.5 tests, transformers {transformers.__version__}, "
          f"{'cuda' if torch.cuda.is_available() else 'cpu'}: {len(stock_ids)} tests; fused {counts['fused']}; "
          f"stock on the {len(select)} the fused classes did not pass: {counts['stock']}; "
          f"stock-pass / fused-not-pass: {len(regressions)} regressions, {len(by_design)} by design")
    assert not regressions, (
        f"{len(regressions)} upstream tests pass with stock but not with the fused classes "
        f"(fused {counts['fused']}; stock on the {len(select)} tests fused did not pass: {counts['stock']}):\n"
        + "\n".join(regressions)
    )


def test_shards_deal_the_ids_and_merge_their_results(monkeypatch, tmp_path):
    """QWEN3_5_UPSTREAM_SHARDS (the GPU machine's setting; CI runs one process): the ids are dealt round-robin, one
    process a non-empty slice; the merged result holds every shard's outcomes, is timed out if any shard was, and
    has the substitutions only if every shard reported them. Runs faked: no subprocess."""
    module = sys.modules[__name__]
    started = []

    def fake_start(stage, out, plugins, select=None, collect_only=False):
        started.append((out.name, list(select)))
        return {"select": select, "name": out.name}

    def fake_finish(run):
        return {"outcomes": {t: ("passed", "") for t in run["select"]}, "tail": run["name"],
                "timed_out": run["name"] == "fused-1", "substitutions": None if run["name"] == "stock-0" else {"a": 1}}

    monkeypatch.setattr(module, "SHARDS", 3)
    monkeypatch.setattr(module, "_start", fake_start)
    monkeypatch.setattr(module, "_finish", fake_finish)
    merged = _finish_group(_start_group(tmp_path, tmp_path / "fused", ["fused_substitute"], ["a", "b", "c", "d"]))
    assert started == [("fused-0", ["a", "d"]), ("fused-1", ["b"]), ("fused-2", ["c"])]
    assert sorted(merged["outcomes"]) == ["a", "b", "c", "d"] and merged["timed_out"] and merged["substitutions"]
    started.clear()
    merged = _finish_group(_start_group(tmp_path, tmp_path / "stock", [], ["a", "b"]))
    assert started == [("stock-0", ["a"]), ("stock-1", ["b"])]
    assert not merged["timed_out"] and merged["substitutions"] is None  # stock-0 reported none
    assert _start_group(tmp_path, tmp_path / "stock", [], []) == [] and not started[2:]
