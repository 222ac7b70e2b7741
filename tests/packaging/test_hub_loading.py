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
from helpers import AUTO_MAP_MOE_COMPOSITE, AUTO_MAP_MOE_TEXT, moe_composite_kwargs

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


def _probe(tmp_path, repo_id, auto_name, extra_env=None):
    env = offline_env(tmp_path / "hub", tmp_path / "modules")
    env.update(extra_env or {})
    proc = subprocess.run([sys.executable, str(PROBE), repo_id, auto_name], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):]), proc.stderr


def _check(result, fused_class, stock_class):
    fused, stock = result["True"], result["False"]
    assert fused["class"] == fused_class and stock["class"] == stock_class
    assert not fused["module"].startswith("transformers.models"), fused["module"]  # remote code really ran
    assert stock["module"].startswith("transformers.models.qwen3_5")
    for r in (fused, stock):
        assert not r["missing"] and not r["unexpected"] and not r["mismatched"], r
    assert fused["fused_kernels"] is True
    assert fused["logits"] == stock["logits"]  # CPU: the fused classes run stock's code, bit for bit


def test_text_repo_by_id_offline(tmp_path):
    torch.manual_seed(0)
    model = modeling.Qwen3_5FusedForCausalLM(configuration.Qwen3_5FusedTextConfig(**composite_kwargs()["text_config"]))
    _write_repo(model, tmp_path / "src", AUTO_MAP_TEXT)
    make_hub_snapshot(tmp_path / "src", tmp_path / "hub", "test-org/tiny-qwen35-text")
    result, stderr = _probe(tmp_path, "test-org/tiny-qwen35-text", "AutoModelForCausalLM")
    _check(result, "Qwen3_5FusedForCausalLM", "Qwen3_5ForCausalLM")
    assert "stock transformers code" in stderr  # the CPU fallback is announced


@pytest.mark.parametrize("auto_name,fused_class,stock_class", [
    ("AutoModelForCausalLM", "Qwen3_5FusedForCausalLM", "Qwen3_5ForCausalLM"),
    ("AutoModelForImageTextToText", "Qwen3_5FusedForConditionalGeneration", "Qwen3_5ForConditionalGeneration"),
], ids=["causal-lm", "image-text-to-text"])
def test_composite_repo_by_id_offline(tmp_path, auto_name, fused_class, stock_class):
    torch.manual_seed(0)
    model = modeling.Qwen3_5FusedForConditionalGeneration(configuration.Qwen3_5FusedConfig(**composite_kwargs()))
    _write_repo(model, tmp_path / "src", AUTO_MAP_COMPOSITE)
    make_hub_snapshot(tmp_path / "src", tmp_path / "hub", "test-org/tiny-qwen35")
    result, _ = _probe(tmp_path, "test-org/tiny-qwen35", auto_name)
    _check(result, fused_class, stock_class)


def _expert_layout(folder: Path) -> str:
    from safetensors.torch import load_file

    keys = load_file(str(folder / "model.safetensors")).keys()
    per_expert = any(".mlp.experts.0.gate_proj.weight" in k for k in keys)
    stacked = any(k.endswith(".mlp.experts.gate_up_proj") for k in keys)
    assert per_expert != stacked, "one layout per checkpoint"
    return "per-expert" if per_expert else "3d"


@pytest.mark.parametrize("layout", ["per-expert", "3d"])
@pytest.mark.parametrize("composite,auto_name,fused_class,stock_class", [
    (False, "AutoModelForCausalLM", "Qwen3_5MoeFusedForCausalLM", "Qwen3_5MoeForCausalLM"),
    (True, "AutoModelForCausalLM", "Qwen3_5MoeFusedForCausalLM", "Qwen3_5MoeForCausalLM"),
    (True, "AutoModelForImageTextToText", "Qwen3_5MoeFusedForConditionalGeneration",
     "Qwen3_5MoeForConditionalGeneration"),
], ids=["text", "composite-causal-lm", "composite-image-text-to-text"])
def test_moe_repo_by_id_offline(tmp_path, layout, composite, auto_name, fused_class, stock_class):
    """An MoE repo by id, its weights in the Hub's per-expert layout (what a save writes, as real checkpoints) or in
    transformers' 3D layout: the remote classes load both with no missing or unexpected key, as stock does, and give
    stock's logits (CPU: the stock path, bit for bit)."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    if composite:
        model = modeling.Qwen3_5MoeFusedForConditionalGeneration(
            configuration.Qwen3_5MoeFusedConfig(**moe_composite_kwargs()))
    else:
        model = modeling.Qwen3_5MoeFusedForCausalLM(
            configuration.Qwen3_5MoeFusedTextConfig(**moe_composite_kwargs()["text_config"]))
    src = tmp_path / "src"
    _write_repo(model, src, AUTO_MAP_MOE_COMPOSITE if composite else AUTO_MAP_MOE_TEXT)
    if layout == "3d":  # the tensors as transformers holds them in memory (the embeddings are tied: no lm_head)
        state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
        save_file(state, str(src / "model.safetensors"), metadata={"format": "pt"})
    assert _expert_layout(src) == layout
    make_hub_snapshot(src, tmp_path / "hub", "test-org/tiny-qwen35-moe")
    result, _ = _probe(tmp_path, "test-org/tiny-qwen35-moe", auto_name)
    _check(result, fused_class, stock_class)
    assert result["True"]["describe"]["ops"] == "stock transformers forward"  # the MoE block, on CPU: stock


def test_missing_code_file_is_caught(tmp_path):
    """A snapshot without fused_ops.py (a file the relative imports need) must fail to load, proving the check
    above would catch a file the Hub copy left out."""
    torch.manual_seed(0)
    model = modeling.Qwen3_5FusedForCausalLM(configuration.Qwen3_5FusedTextConfig(**composite_kwargs()["text_config"]))
    _write_repo(model, tmp_path / "src", AUTO_MAP_TEXT)
    (tmp_path / "src" / "fused_ops.py").unlink()
    make_hub_snapshot(tmp_path / "src", tmp_path / "hub", "test-org/broken")
    env = offline_env(tmp_path / "hub", tmp_path / "modules")
    proc = subprocess.run([sys.executable, str(PROBE), "test-org/broken", "AutoModelForCausalLM"], env=env,
                          capture_output=True, text=True, timeout=600)
    # transformers resolves the relative import `from .fused_ops import ...` and fails to find the file offline
    assert proc.returncode != 0
    assert "get_cached_module_file" in proc.stderr and "OSError" in proc.stderr, proc.stderr[-2000:]


def test_remote_code_imports_without_triton_and_fla(tmp_path):
    """transformers' remote-code import check reads every file; the code must import where triton / fla are absent."""
    torch.manual_seed(0)
    model = modeling.Qwen3_5FusedForCausalLM(configuration.Qwen3_5FusedTextConfig(**composite_kwargs()["text_config"]))
    _write_repo(model, tmp_path / "src", AUTO_MAP_TEXT)
    make_hub_snapshot(tmp_path / "src", tmp_path / "hub", "test-org/no-triton")
    shim = tmp_path / "shim"
    shim.mkdir()
    # A sitecustomize that hides triton and fla, as on a machine without them.
    (shim / "sitecustomize.py").write_text("import sys\nfor m in ('triton', 'fla'):\n    sys.modules[m] = None\n")
    env = {"PYTHONPATH": str(shim)}
    result, stderr = _probe(tmp_path, "test-org/no-triton", "AutoModelForCausalLM", extra_env=env)
    assert result["True"]["class"] == "Qwen3_5FusedForCausalLM"
    assert result["True"]["logits"] == result["False"]["logits"]
    assert "triton is not installed" in result["True"]["describe"]["reason"]


ROOT_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
              "chat_template.jinja", *CODE_FILES)
ROOT_PROBE = Path(__file__).with_name("root_repo_probe.py")


def _root_probe(tmp_path, target, auto_name, windows=None):
    env = offline_env(tmp_path / "hub", tmp_path / "modules")
    extra = [] if windows is None else [str(windows)]
    proc = subprocess.run([sys.executable, str(ROOT_PROBE), target, auto_name, *extra], env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads([l for l in proc.stdout.splitlines() if l.startswith("RESULT ")][-1][len("RESULT "):])


@pytest.mark.parametrize("via", ["repo-id", "local-folder"])
def test_shipped_model_loads_and_reproduces_recorded_nll(tmp_path, via):
    """The repo root is a Hub model repo: by id through the offline cache, with and without trust_remote_code, the
    held-out NLL is the one recorded at training time; from a plain local folder (as after `hf download
    --local-dir`) both load the same model (the NLL of the first 8 windows agrees; the full NLL is the repo-id
    case's, which loads the same files)."""
    recorded = json.loads((REPO / "training_report.json").read_text())
    if via == "repo-id":
        make_hub_snapshot(REPO, tmp_path / "hub", "test-org/qwen35-fused-tiny", files=ROOT_FILES)
        target = "test-org/qwen35-fused-tiny"
    else:
        target = str(tmp_path / "local")
        Path(target).mkdir()
        for name in ROOT_FILES:
            shutil.copy2(REPO / name, Path(target) / name)
    result = _root_probe(tmp_path, target, "AutoModelForCausalLM", windows=None if via == "repo-id" else 8)
    fused, stock = result["True"], result["False"]
    assert fused["class"] == "Qwen3_5FusedForCausalLM" and stock["class"] == "Qwen3_5ForCausalLM"
    for r in (fused, stock):
        assert not r["missing"] and not r["unexpected"], r
    if via == "local-folder":
        assert fused["nll"]["windows"] == stock["nll"]["windows"] >= 7
        assert abs(fused["nll"]["nll_per_token"] - stock["nll"]["nll_per_token"]) <= 1e-5 * stock["nll"]["nll_per_token"]
        return
    want = recorded["heldout"]["nll_per_token"]
    assert abs(fused["nll"]["nll_per_token"] - want) <= 1e-4 * want
    assert abs(stock["nll"]["nll_per_token"] - want) <= 1e-4 * want


def test_shipped_model_loads_as_image_text_to_text_from_local_folder(tmp_path):
    target = tmp_path / "local"
    target.mkdir()
    for name in ROOT_FILES:
        shutil.copy2(REPO / name, target / name)
    result = _root_probe(tmp_path, str(target), "AutoModelForImageTextToText")
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
