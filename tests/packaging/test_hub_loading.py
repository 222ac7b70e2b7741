"""Loading by repo id through an offline Hugging Face cache, as users do: the only way to catch a file the Hub
copy would miss or an import in the remote code that fails where an optional package is absent."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import AUTO_MAP_COMPOSITE, AUTO_MAP_TEXT, CODE_FILES, composite_kwargs, configuration, make_hub_snapshot, modeling, offline_env
from helpers import AUTO_MAP_MOE_COMPOSITE, AUTO_MAP_MOE_TEXT, moe_composite_kwargs, take_prestarted

REPO = Path(__file__).resolve().parents[2]
PROBE = Path(__file__).with_name("hub_load_probe.py")


def _write_repo(model, folder: Path, auto_map: dict) -> None:
    model.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = auto_map
    config["fused_kernels"] = True
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    for name in CODE_FILES:
        shutil.copy2(REPO / name, folder / name)


def _start_probe_many(tmp_path, pairs, hide=("fla",)):
    """Start loading each (repo id, Auto class) in `pairs` with and without remote code, in one fresh process on the
    offline cache under `tmp_path` (the modules in `hide` unimportable there). Returns (the process, a function that
    waits for it and returns its results in order and its stderr)."""
    env = offline_env(tmp_path / "hub", tmp_path / "modules", hide=hide)
    args = [x for pair in pairs for x in pair]
    proc = subprocess.Popen([sys.executable, str(PROBE), *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)

    def finish():
        out, err = proc.communicate(timeout=900)
        assert proc.returncode == 0, err[-4000:]
        lines = [l for l in out.splitlines() if l.startswith("RESULT ")]
        assert len(lines) == len(pairs), out[-2000:]
        return [json.loads(line[len("RESULT "):]) for line in lines], err

    return proc, finish


def _check(result, fused_class, stock_class):
    assert "error" not in result, result.get("error")
    fused, stock = result["True"], result["False"]
    assert fused["class"] == fused_class and stock["class"] == stock_class
    assert not fused["module"].startswith("transformers.models"), fused["module"]  # remote code really ran
    assert stock["module"].startswith("transformers.models.qwen3_5")
    for r in (fused, stock):
        assert not r["missing"] and not r["unexpected"] and not r["mismatched"], r
    assert fused["fused_kernels"] is True
    assert fused["logits"] == stock["logits"]  # CPU: the fused classes run stock's code, bit for bit


def _expert_layout(folder: Path) -> str:
    from safetensors.torch import load_file

    keys = load_file(str(folder / "model.safetensors")).keys()
    per_expert = any(".mlp.experts.0.gate_proj.weight" in k for k in keys)
    stacked = any(k.endswith(".mlp.experts.gate_up_proj") for k in keys)
    assert per_expert != stacked, "one layout per checkpoint"
    return "per-expert" if per_expert else "3d"


def _moe_repo(root: Path, composite: bool, layout: str) -> str:
    """An MoE repo in the offline cache under `root`, its weights in the Hub's per-expert layout (what a save writes,
    as real checkpoints) or in transformers' 3D layout; returns its id."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    if composite:
        model = modeling.Qwen3_5MoeFusedForConditionalGeneration(
            configuration.Qwen3_5MoeFusedConfig(**moe_composite_kwargs()))
    else:
        model = modeling.Qwen3_5MoeFusedForCausalLM(
            configuration.Qwen3_5MoeFusedTextConfig(**moe_composite_kwargs()["text_config"]))
    repo_id = f"test-org/tiny-qwen35-moe-{'composite' if composite else 'text'}-{layout}"
    src = root / "src" / repo_id.split("/")[1]
    _write_repo(model, src, AUTO_MAP_MOE_COMPOSITE if composite else AUTO_MAP_MOE_TEXT)
    if layout == "3d":  # the tensors as transformers holds them in memory (the embeddings are tied: no lm_head)
        state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
        save_file(state, str(src / "model.safetensors"), metadata={"format": "pt"})
    assert _expert_layout(src) == layout
    make_hub_snapshot(src, root / "hub", repo_id)
    return repo_id


TEXT_ID, COMPOSITE_ID, BROKEN_ID = "test-org/tiny-qwen35-text", "test-org/tiny-qwen35", "test-org/broken"
MOE_CASES = [(False, "AutoModelForCausalLM", "Qwen3_5MoeFusedForCausalLM", "Qwen3_5MoeForCausalLM"),
             (True, "AutoModelForCausalLM", "Qwen3_5MoeFusedForCausalLM", "Qwen3_5MoeForCausalLM"),
             (True, "AutoModelForImageTextToText", "Qwen3_5MoeFusedForConditionalGeneration",
              "Qwen3_5MoeForConditionalGeneration")]


def _start_offline_repos(root: Path):
    """The dense text and composite repos and the MoE repos (text and composite, both expert layouts) in one offline
    cache, each loaded by every Auto class its tests use, all in one fresh process (several repos' remote code side by
    side in one process, as a user who loads two of them has), where triton and fla cannot be imported (on CPU the
    fused classes run stock's code either way; the README's CPU setup, with triton, has its own test). Returns
    ({(repo id, Auto class): result}, stderr) through `_start_probe_many`'s (process, finish), built under `root`."""
    torch.manual_seed(0)
    text = modeling.Qwen3_5FusedForCausalLM(configuration.Qwen3_5FusedTextConfig(**composite_kwargs()["text_config"]))
    _write_repo(text, root / "src" / "text", AUTO_MAP_TEXT)
    make_hub_snapshot(root / "src" / "text", root / "hub", TEXT_ID)
    torch.manual_seed(0)
    composite = modeling.Qwen3_5FusedForConditionalGeneration(configuration.Qwen3_5FusedConfig(**composite_kwargs()))
    _write_repo(composite, root / "src" / "composite", AUTO_MAP_COMPOSITE)
    make_hub_snapshot(root / "src" / "composite", root / "hub", COMPOSITE_ID)
    pairs = [(TEXT_ID, "AutoModelForCausalLM"), (COMPOSITE_ID, "AutoModelForCausalLM"),
             (COMPOSITE_ID, "AutoModelForImageTextToText")]
    for layout in ("per-expert", "3d"):
        for composite_moe in (False, True):
            repo_id = _moe_repo(root, composite_moe, layout)
            pairs += [(repo_id, auto) for c, auto, _, _ in MOE_CASES if c == composite_moe]
    # the text repo without fused_ops.py, last: it must fail to load
    shutil.copytree(root / "src" / "text", root / "src" / "broken")
    (root / "src" / "broken" / "fused_ops.py").unlink()
    make_hub_snapshot(root / "src" / "broken", root / "hub", BROKEN_ID)
    pairs.append((BROKEN_ID, "AutoModelForCausalLM"))
    proc, finish = _start_probe_many(root, pairs, hide=("triton", "fla"))

    def results():
        found, stderr = finish()
        return dict(zip(pairs, found)), stderr

    return proc, results


@pytest.fixture(scope="module")
def offline_repos(tmp_path_factory):
    """`_start_offline_repos`'s results, from the process tests/conftest.py started when collection ended (`PRESTART`)
    or, where it did not, started now."""
    started = take_prestarted("offline_repos") or _start_offline_repos(tmp_path_factory.mktemp("offline-repos"))
    return started[1]()


def test_remote_code_imports_without_triton_and_fla(offline_repos):
    """transformers' remote-code import check reads every file; the code must import where triton / fla are absent
    (the offline repos' process has neither)."""
    result = offline_repos[0][(TEXT_ID, "AutoModelForCausalLM")]
    assert result["importable"] == {"triton": False, "fla": False}
    assert result["True"]["class"] == "Qwen3_5FusedForCausalLM"
    assert result["True"]["logits"] == result["False"]["logits"]
    # the reason a user reads: the missing GPU first where there is none (no package would help), else triton
    want = "triton is not installed" if torch.cuda.is_available() else "no CUDA device is available"
    assert want in result["True"]["describe"]["reason"]


def test_text_repo_by_id_offline(offline_repos):
    results, stderr = offline_repos
    _check(results[(TEXT_ID, "AutoModelForCausalLM")], "Qwen3_5FusedForCausalLM", "Qwen3_5ForCausalLM")
    assert "stock transformers code" in stderr  # the CPU fallback is announced


@pytest.mark.parametrize("auto_name,fused_class,stock_class", [
    ("AutoModelForCausalLM", "Qwen3_5FusedForCausalLM", "Qwen3_5ForCausalLM"),
    ("AutoModelForImageTextToText", "Qwen3_5FusedForConditionalGeneration", "Qwen3_5ForConditionalGeneration"),
], ids=["causal-lm", "image-text-to-text"])
def test_composite_repo_by_id_offline(offline_repos, auto_name, fused_class, stock_class):
    _check(offline_repos[0][(COMPOSITE_ID, auto_name)], fused_class, stock_class)


@pytest.mark.parametrize("layout", ["per-expert", "3d"])
@pytest.mark.parametrize("composite,auto_name,fused_class,stock_class", MOE_CASES,
                         ids=["text", "composite-causal-lm", "composite-image-text-to-text"])
def test_moe_repo_by_id_offline(offline_repos, layout, composite, auto_name, fused_class, stock_class):
    """An MoE repo by id, in the Hub's per-expert layout or transformers' 3D layout: the remote classes load both
    with no missing or unexpected key, as stock does, and give stock's logits (CPU: the stock path, bit for bit)."""
    repo_id = f"test-org/tiny-qwen35-moe-{'composite' if composite else 'text'}-{layout}"
    result = offline_repos[0][(repo_id, auto_name)]
    _check(result, fused_class, stock_class)
    assert result["True"]["describe"]["ops"] == "stock transformers forward"  # the MoE block, on CPU: stock


def test_missing_code_file_is_caught(offline_repos):
    """A snapshot without fused_ops.py (a file the relative imports need) must fail to load, proving the check
    above would catch a file the Hub copy left out."""
    result = offline_repos[0][(BROKEN_ID, "AutoModelForCausalLM")]
    # transformers resolves the relative import `from .fused_ops import ...` and fails to find the file offline
    assert "get_cached_module_file" in result.get("error", "") and "OSError" in result["error"], result


ROOT_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
              "chat_template.jinja", *CODE_FILES)
ROOT_PROBE = Path(__file__).with_name("root_repo_probe.py")


def _start_root_probe(tmp_path, loads):
    """Start `root_repo_probe.py` on each (target, Auto classes, windows) of `loads`, all in one fresh process on the
    offline cache under `tmp_path`. Returns (the process, a function that waits for it and returns, for each load,
    its results by Auto class)."""
    # a CPU user's install, as the README sets it up: no fla (offline_env hides it), no Triton interpreter
    env = {k: v for k, v in offline_env(tmp_path / "hub", tmp_path / "modules").items() if k != "TRITON_INTERPRET"}
    args = [x for target, autos, windows in loads for x in (target, ",".join(autos), str(windows))]
    proc = subprocess.Popen([sys.executable, str(ROOT_PROBE), *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)

    def finish():
        out, err = proc.communicate(timeout=900)
        assert proc.returncode == 0, err[-4000:]
        lines = [json.loads(l[len("RESULT "):]) for l in out.splitlines() if l.startswith("RESULT ")]
        assert len(lines) == sum(len(autos) for _, autos, _ in loads), out[-2000:]
        found = []
        for _, autos, _ in loads:
            found.append(dict(zip(autos, lines[: len(autos)])))
            lines = lines[len(autos):]
        return found

    return proc, finish


def _start_shipped(tmp: Path):
    """The repo root as a Hub repo: its files copied to a plain folder (as after `hf download --local-dir`) and to an
    offline Hub cache as `test-org/qwen35-fused-tiny`, loaded in one process: the folder by AutoModelForCausalLM
    (scoring the first 8 held-out windows) and AutoModelForImageTextToText, the repo id by AutoModelForCausalLM
    (the same 8 windows). Returns (the process, a function giving {"local-folder": {Auto class: result},
    "repo-id": {...}})."""
    target = tmp / "local"
    target.mkdir()
    for name in ROOT_FILES:
        shutil.copy2(REPO / name, target / name)
    make_hub_snapshot(REPO, tmp / "hub", "test-org/qwen35-fused-tiny", files=ROOT_FILES)
    proc, finish = _start_root_probe(tmp, [
        (str(target), ["AutoModelForCausalLM", "AutoModelForImageTextToText"], 8),
        ("test-org/qwen35-fused-tiny", ["AutoModelForCausalLM"], 8)])

    def results():
        local, by_id = finish()
        return {"local-folder": local, "repo-id": by_id}

    return proc, results


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    """`_start_shipped`'s results (prestarted by tests/conftest.py, or started now)."""
    started = take_prestarted("shipped") or _start_shipped(tmp_path_factory.mktemp("shipped"))
    return started[1]()


# Started by tests/conftest.py when collection ends, each in its own temporary folder, so that their processes run
# beside the rest of the suite instead of stalling it (the fixtures above take them over).
PRESTART = {"offline_repos": _start_offline_repos, "shipped": _start_shipped}


@pytest.mark.parametrize("via", ["repo-id", "local-folder"])
def test_shipped_model_loads_and_scores_the_same_by_id_and_from_a_folder(shipped, via):
    """The repo root is a Hub model repo. By id through the offline cache, with and without trust_remote_code, the
    first 8 held-out windows score exactly as from a plain local folder (the same files, the same code, one thread).
    From a local folder (as after `hf download --local-dir`) both load the same model: the fused NLL of those windows
    agrees with stock's, whose NLL over every window is the one recorded at training time
    (`test_heldout_nll_matches_report`)."""
    result = shipped[via]["AutoModelForCausalLM"]
    fused, stock = result["True"], result["False"]
    assert fused["class"] == "Qwen3_5FusedForCausalLM" and stock["class"] == "Qwen3_5ForCausalLM"
    for r in (fused, stock):
        assert not r["missing"] and not r["unexpected"], r
    if via == "local-folder":
        assert fused["nll"]["windows"] == stock["nll"]["windows"] >= 7
        assert abs(fused["nll"]["nll_per_token"] - stock["nll"]["nll_per_token"]) <= 1e-5 * stock["nll"]["nll_per_token"]
        return
    local = shipped["local-folder"]["AutoModelForCausalLM"]
    assert fused["nll"] == local["True"]["nll"]  # the same files, the same code, one thread: the same numbers
    assert stock["nll"] == local["False"]["nll"]
    assert fused["module"] != local["True"]["module"]  # each load ran its own copy of the remote code


def _requirement_names(path: Path) -> list[str]:
    lines = [l.split("#", 1)[0].split(";", 1)[0].strip() for l in path.read_text().splitlines()]
    return [l if l.startswith("-") else l.split(">")[0].split("=")[0].split("<")[0].strip() for l in lines if l]


def test_readme_cpu_setup_loads_the_model_as_stock_and_fused(shipped):
    """A CPU user following the README never hits a crash: its setup command installs requirements.txt, which leaves
    out flash-linear-attention (stock transformers sends CPU tensors into fla's kernels when it is installed), so the
    repo loaded without remote code, stock's own code untouched, generates; requirements-gpu.txt adds fla. The
    `shipped` process is that install (fla unimportable, no Triton interpreter) and generates with both loads."""
    readme = (REPO / "README.md").read_text()
    assert ".venv/bin/pip install -r requirements.txt\n" in readme and "requirements-gpu.txt" in readme
    assert "flash-linear-attention" not in _requirement_names(REPO / "requirements.txt")
    assert _requirement_names(REPO / "requirements-gpu.txt") == ["-r requirements.txt", "flash-linear-attention"]
    result = shipped["local-folder"]["AutoModelForCausalLM"]
    fused, stock = result["True"], result["False"]
    assert (fused["class"], stock["class"]) == ("Qwen3_5FusedForCausalLM", "Qwen3_5ForCausalLM")
    if not torch.cuda.is_available():  # the fused model's one line names the missing GPU, not the absent fla
        assert fused["reason"] == "no CUDA device is available", fused["reason"]
    assert fused["generated"] == stock["generated"]
    assert len(stock["generated"]) > 6


def test_shipped_model_loads_as_image_text_to_text_from_local_folder(shipped):
    result = shipped["local-folder"]["AutoModelForImageTextToText"]
    assert result["True"]["class"] == "Qwen3_5FusedForConditionalGeneration"
    assert result["False"]["class"] == "Qwen3_5ForConditionalGeneration"
    assert not result["True"]["missing"] and not result["True"]["unexpected"]


def test_every_code_file_starts_with_the_copyright_line():
    """Each file the Hub copies opens with the repo's copyright and license line (transformers' own
    `test_can_init_all_missing_weights` reads the year from the configuration file's first `# Copyright` line and
    skips models without one)."""
    import re

    for name in CODE_FILES:
        first = (REPO / name).read_text().splitlines()[0]
        assert re.fullmatch(r"# Copyright 20\d\d .*Apache License, Version 2\.0\.", first), f"{name}: {first!r}"
