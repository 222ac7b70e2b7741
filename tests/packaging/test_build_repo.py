"""scripts/build_repo.py and scripts/push_to_hub.py on tiny checkpoints: the merge (fp32, cast once), the folder a
build writes, loading it by repo id through an offline Hub cache, verification, the push allowlist and its refusals,
and what an interrupted build leaves behind."""

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import composite_kwargs, make_hub_snapshot, moe_composite_kwargs, offline_env, stock_text_config
from scripts import build_repo, push_to_hub
from scripts.common import code_files

REPO = Path(__file__).resolve().parents[2]
PROBE = Path(__file__).with_name("hub_load_probe.py")
TEXT_TARGETS = ["q_proj", "v_proj", "in_proj_qkv", "in_proj_z", "out_proj", "gate_proj", "down_proj"]
LORA_R, LORA_ALPHA = 4, 8
FP32_KEY = "model.layers.0.linear_attn.A_log"  # stored in float32 by the text base
# One tiny PNG (1x1, grey) for the chart allowlist.
PNG = bytes.fromhex("89504e470d0a1a0a0000000d4948445200000001000000010800000000"
                    "3a7e9b550000000a49444154789c63680000008200817f0a2b6e0000000049454e44ae426082")
SPEED_TABLE = "| path | tokens/s |\n| --- | --- |\n| stock | 10 |\n| fused | 30 |\n"


# --------------------------------------------------------------------------------------------------------------------
# Tiny sources: a stock checkpoint, a tokenizer, a LoRA adapter with non-zero B
# --------------------------------------------------------------------------------------------------------------------


def _write_tokenizer(folder: Path, chat_template: bool) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, 250)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>", "pad_token": "<unk>"}))
    if chat_template:
        (folder / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}\n{% endfor %}")


def _make_adapter(model, folder: Path, seed: int) -> None:
    """A LoRA adapter whose B is random (PEFT initialises it to zero, which would make the merge a no-op)."""
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(model, LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, target_modules=TEXT_TARGETS))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    peft_model.save_pretrained(str(folder))


@pytest.fixture(scope="module")
def text_sources(tmp_path_factory):
    """A bf16 text-only base (with an `mtp.*` tensor as real Qwen3.5 checkpoints have, one tensor kept in float32, a
    tokenizer, a chat template and a license) and a LoRA adapter."""
    from transformers import Qwen3_5ForCausalLM

    root = tmp_path_factory.mktemp("text_sources")
    base, adapter = root / "base", root / "adapter"
    torch.manual_seed(0)
    Qwen3_5ForCausalLM(stock_text_config()).to(torch.bfloat16).save_pretrained(str(base))
    tensors = load_file(str(base / "model.safetensors"))
    tensors["mtp.fc.weight"] = torch.randn(64, 128).to(torch.bfloat16)
    tensors[FP32_KEY] = torch.randn(tensors[FP32_KEY].shape, dtype=torch.float32)  # not representable in bf16
    save_file(tensors, str(base / "model.safetensors"), metadata={"format": "pt"})
    _write_tokenizer(base, chat_template=True)
    (base / "README.md").write_text("---\nlicense: apache-2.0\n---\n# tiny base\n")
    _make_adapter(Qwen3_5ForCausalLM.from_pretrained(str(base), dtype=torch.float32), adapter, seed=1)
    return base, adapter


@pytest.fixture(scope="module")
def composite_sources(tmp_path_factory):
    """A float32 composite base (vision tower, no chat template) and an adapter trained on its text-only view
    (`AutoModelForCausalLM` of a composite repo gives `Qwen3_5ForCausalLM`, keys `model.layers.*`)."""
    from transformers import Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration

    root = tmp_path_factory.mktemp("composite_sources")
    base, adapter = root / "base", root / "adapter"
    torch.manual_seed(2)
    Qwen3_5ForConditionalGeneration(Qwen3_5Config(**composite_kwargs())).save_pretrained(str(base))
    _write_tokenizer(base, chat_template=False)
    _make_adapter(Qwen3_5ForCausalLM.from_pretrained(str(base), dtype=torch.float32), adapter, seed=3)
    return base, adapter


def _offline_hub(monkeypatch):
    """In-process offline mode for huggingface_hub (the subprocess tests use the environment instead)."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


@pytest.fixture(scope="module")
def text_build(text_sources, tmp_path_factory):
    """Built from Hub ids through an offline cache, default dtype (the base's: bf16), sharded, with tables + chart."""
    base, adapter = text_sources
    root = tmp_path_factory.mktemp("text_build")
    hub = root / "hub"
    make_hub_snapshot(base, hub, "test-org/tiny-base")
    make_hub_snapshot(adapter, hub, "test-org/tiny-lora")
    (root / "speed.md").write_text(SPEED_TABLE)
    (root / "speed.png").write_bytes(PNG)
    with pytest.MonkeyPatch.context() as mp:
        _offline_hub(mp)
        result = build_repo.build_repo(
            "test-org/tiny-base", root / "out" / "tiny-fused", "test-org/tiny-lora", cache_dir=str(hub),
            repo_id="test-org/tiny-fused", max_shard_size="200KB", speed_table=str(root / "speed.md"),
            chart=str(root / "speed.png"))
    return root / "out" / "tiny-fused", result


@pytest.fixture(scope="module")
def composite_build(composite_sources, tmp_path_factory):
    """Built through the CLI from local folders, default dtype (the base's: float32)."""
    base, adapter = composite_sources
    out = tmp_path_factory.mktemp("composite_build") / "tiny-vl-fused"
    rc = build_repo.main(["--base", str(base), "--adapter", str(adapter), "--out", str(out),
                          "--base-id", "test-org/tiny-vl", "--repo-id", "test-org/tiny-vl-fused"])
    assert rc == 0
    return out, json.loads((out / "verification.json").read_text())


# --------------------------------------------------------------------------------------------------------------------
# Merge reference, computed here from the files (not through PEFT)
# --------------------------------------------------------------------------------------------------------------------


def _checkpoint(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in build_repo._safetensors_files(folder):
        out.update(load_file(str(path)))
    return out


def _merge_reference(base: Path, adapter: Path, dtype, module_prefix: str = "", merge_dtype=torch.float32):
    """W + (alpha / r) * B @ A for each adapted module, computed in `merge_dtype` and cast to `dtype` (tensors the
    base keeps in float32 stay float32)."""
    scaling = LORA_ALPHA / LORA_R
    stored = _checkpoint(base)
    weights = {k: v.to(merge_dtype) for k, v in stored.items()}
    lora = load_file(str(adapter / "adapter_model.safetensors"))
    for key in lora:
        if key.endswith(".lora_A.weight"):
            module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            a, b = lora[key].to(merge_dtype), lora[key.replace("lora_A", "lora_B")].to(merge_dtype)
            target = module.replace("model.", "model." + module_prefix, 1) + ".weight"
            weights[target] = weights[target] + (b @ a) * scaling
    return {k: v.to(torch.float32 if stored[k].dtype == torch.float32 else dtype) for k, v in weights.items()}


# --------------------------------------------------------------------------------------------------------------------
# The built folders
# --------------------------------------------------------------------------------------------------------------------


def test_text_build_merges_in_fp32_and_casts_once(text_build, text_sources):
    out, result = text_build
    base, adapter = text_sources
    built = _checkpoint(out)
    reference = _merge_reference(base, adapter, torch.bfloat16)
    assert built.keys() == reference.keys()
    for key in reference:
        assert built[key].dtype == (torch.float32 if key == FP32_KEY else torch.bfloat16), key
        assert torch.equal(built[key], reference[key]), key  # bit for bit: one fp32 merge, one cast
    # A bf16 merge (what merging a bf16-loaded base does) rounds the update, then the sum: it lands elsewhere.
    bf16_merge = _merge_reference(base, adapter, torch.bfloat16, merge_dtype=torch.bfloat16)
    differing = sum(int((bf16_merge[k] != reference[k]).sum()) for k in reference)
    adapted = sum(reference[k].numel() for k in reference if any(f".{t}." in k for t in TEXT_TARGETS))
    assert 0 < differing < adapted, (differing, adapted)
    # the merge mattered: adapted weights moved away from the base
    base_weights = _checkpoint(base)
    assert not torch.equal(built["model.layers.0.linear_attn.in_proj_qkv.weight"],
                           base_weights["model.layers.0.linear_attn.in_proj_qkv.weight"])
    assert torch.equal(built["model.embed_tokens.weight"], base_weights["model.embed_tokens.weight"])


def test_text_build_folder(text_build, text_sources):
    out, result = text_build
    base, _ = text_sources
    files = {p.name for p in out.iterdir()}
    shards = {n for n in files if n.endswith(".safetensors")}
    assert len(shards) > 1 and "model.safetensors.index.json" in files  # max_shard_size was honoured
    assert files - shards == {*code_files(REPO), "config.json", "generation_config.json", "model.safetensors.index.json",
                              "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "README.md",
                              "verification.json", "speed.png"}
    for name in code_files(REPO):
        assert (out / name).read_bytes() == (REPO / name).read_bytes()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (out / name).read_bytes() == (base / name).read_bytes(), name
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_text" and config["architectures"] == ["Qwen3_5ForCausalLM"]
    assert config["auto_map"] == build_repo.LAYOUTS["text"].auto_map
    assert config["fused_kernels"] is True and config["cuda_graphs"] is True and config["dtype"] == "bfloat16"
    # the same tensor names and shapes as the stock checkpoint, the ignored-on-load `mtp.*` head included
    shapes = lambda folder: {k: s for k, (_, s) in build_repo.checkpoint_shapes(folder).items()}
    assert shapes(out) == shapes(base) and "mtp.fc.weight" in shapes(out)


def test_text_build_verification(text_build):
    out, result = text_build
    assert json.loads((out / "verification.json").read_text()) == result
    assert result["passed"] and result["failed"] == [] and result["dtype"] == "bfloat16"
    checks = result["checks"]
    assert checks["fused_load"]["class"] == "Qwen3_5FusedForCausalLM"
    assert not checks["fused_load"]["module"].startswith("transformers.")  # the remote code really ran
    assert checks["stock_load"]["class"] == "Qwen3_5ForCausalLM"
    assert checks["fused_vs_stock"]["rel_err"] == 0.0  # CPU: the fused classes run stock's code
    assert checks["greedy"]["fused"] == checks["greedy"]["stock"] and len(checks["greedy"]["fused"]) == 8
    ref = checks["vs_reference"]
    assert ref["reference"].startswith("base + adapter, unmerged")
    # bf16 storage error, bounded by the measured rounding estimate; far below what the adapter itself changes
    assert 0 < ref["rel_err"] <= ref["bound"] < ref["adapter_effect"]
    # Hub sources are recorded by id and commit, without the local cache path
    assert result["sources"]["base"].keys() == {"hub_id", "revision"}
    assert result["sources"]["base"]["hub_id"] == "test-org/tiny-base"
    assert len(result["sources"]["base"]["revision"]) == 40
    assert set(result["files"]) == set(push_to_hub.hashed_files(out))
    assert result["versions"]["transformers"] and result["versions"]["peft"]


def test_text_build_model_card(text_build):
    from huggingface_hub import metadata_load

    out, result = text_build
    meta = metadata_load(out / "README.md")
    assert meta["license"] == "apache-2.0"  # carried from the base's card
    assert meta["library_name"] == "transformers" and meta["pipeline_tag"] == "text-generation"
    assert meta["base_model"] == "test-org/tiny-base" and meta["base_model_relation"] == "finetune"
    assert {"custom_code", "qwen3_5"} <= set(meta["tags"])
    card = (out / "README.md").read_text()
    for needle in ('repo = "test-org/tiny-fused"', "trust_remote_code=True", "Without remote code",
                   "flash-linear-attention", "what PEFT's `merge_and_unload` computes), then cast once to bfloat16",
                   "test-org/tiny-lora@", SPEED_TABLE.strip(), "![speed chart](speed.png)",
                   f"{result['checks']['vs_reference']['rel_err']:.2e}"):
        assert needle in card, needle


def test_composite_build(composite_build, composite_sources, caplog):
    out, result = composite_build
    base, adapter = composite_sources
    assert result["passed"] and result["layout"] == "composite" and result["dtype"] == "float32"
    assert result["inputs"]["image"] is True  # the logits check ran the vision tower too
    checks = result["checks"]
    assert checks["fused_load"]["class"] == "Qwen3_5FusedForConditionalGeneration"
    assert checks["stock_load"]["class"] == "Qwen3_5ForConditionalGeneration"
    assert checks["vs_reference"]["bound"] == build_repo.FP32_MERGE_BOUND  # float32: the tight bound
    assert checks["vs_reference"]["rel_err"] <= 1e-5 < checks["vs_reference"]["adapter_effect"]
    # the text-only adapter landed on model.language_model.* (renamed), merged in fp32
    built, reference = _checkpoint(out), _merge_reference(base, adapter, torch.float32, "language_model.")
    assert built.keys() == reference.keys()
    for key in reference:
        assert torch.equal(built[key], reference[key]), key
    base_weights = _checkpoint(base)
    assert not torch.equal(built["model.language_model.layers.3.self_attn.q_proj.weight"],
                           base_weights["model.language_model.layers.3.self_attn.q_proj.weight"])
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen3_5" and config["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert config["auto_map"] == build_repo.LAYOUTS["composite"].auto_map
    assert config["fused_kernels"] is True and config["text_config"]["fused_kernels"] is True
    from huggingface_hub import metadata_load

    meta = metadata_load(out / "README.md")
    # no processor files: the repo cannot take images, so it is listed for text generation
    assert meta["pipeline_tag"] == "text-generation" and meta["base_model"] == "test-org/tiny-vl"
    assert "license" not in meta  # the base states none


# LoRA on the MoE model's attention, DeltaNet and shared-expert projections (the routed experts are 3D parameters,
# which a LoRA of nn.Linear modules does not reach; `gate_proj` / `down_proj` name only the shared expert's here).
MOE_TARGETS = ["q_proj", "v_proj", "in_proj_qkv", "out_proj", "gate_proj", "down_proj"]


@pytest.mark.parametrize("composite", [False, True], ids=["moe-text", "moe-composite"])
def test_moe_build(tmp_path, composite):
    """An MoE base in the Hub's per-expert layout with a LoRA merged in: the build copies the experts as they are,
    merges the adapter in fp32, and verifies (the fused MoE class by id with remote code, stock without)."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForCausalLM, Qwen3_5MoeForConditionalGeneration

    base, adapter, out = tmp_path / "base", tmp_path / "adapter", tmp_path / "out"
    torch.manual_seed(4)
    kwargs = moe_composite_kwargs()
    if composite:
        Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(**kwargs)).save_pretrained(str(base))
    else:
        from transformers import Qwen3_5MoeTextConfig

        Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**kwargs["text_config"])).save_pretrained(str(base))
    _write_tokenizer(base, chat_template=True)
    base_weights = _checkpoint(base)
    assert any(".mlp.experts.0.gate_proj.weight" in k for k in base_weights)  # the Hub's per-expert layout
    peft_model = get_peft_model(Qwen3_5MoeForCausalLM.from_pretrained(str(base), dtype=torch.float32),
                                LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, target_modules=MOE_TARGETS))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    peft_model.save_pretrained(str(adapter))
    assert any("shared_expert.gate_proj" in k for k in load_file(str(adapter / "adapter_model.safetensors")))
    rc = build_repo.main(["--base", str(base), "--adapter", str(adapter), "--out", str(out),
                          "--base-id", "test-org/tiny-moe", "--repo-id", "test-org/tiny-moe-fused"])
    assert rc == 0
    result = json.loads((out / "verification.json").read_text())
    layout = build_repo.LAYOUTS["moe-composite" if composite else "moe-text"]
    assert result["passed"] and result["layout"] == layout.name, result["failed"]
    checks = result["checks"]
    assert checks["fused_load"]["class"] == layout.fused_class and checks["stock_load"]["class"] == layout.stock_class
    assert checks["fused_load"]["paths"]["moe"].startswith("stock")  # CPU: the kernels are not verified here
    assert checks["vs_reference"]["rel_err"] <= 1e-5 < checks["vs_reference"]["adapter_effect"]
    built = _checkpoint(out)
    reference = _merge_reference(base, adapter, torch.float32, "language_model." if composite else "")
    assert built.keys() == reference.keys() == base_weights.keys()  # the experts stay per-expert
    for key in reference:
        assert torch.equal(built[key], reference[key]), key
    prefix = "model.language_model." if composite else "model."
    changed = prefix + "layers.0.mlp.shared_expert.gate_proj.weight"
    assert not torch.equal(built[changed], base_weights[changed])
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == layout.model_type and config["architectures"] == [layout.stock_class]
    assert config["auto_map"] == layout.auto_map and (out / "fused_moe.py").is_file()


# LoRA over the backbone and the MTP head: `fc` names only the head's input projection (`mtp.fc`).
MTP_TARGETS = ["q_proj", "v_proj", "gate_proj", "down_proj", "fc"]


def test_mtp_head_is_carried_and_its_lora_deltas_merged(tmp_path):
    """A composite base with an MTP head (``mtp.*``, its config naming it, as real Qwen3.5 checkpoints) and an
    adapter trained on the fused causal LM, which holds the head, so its LoRA reaches the head's projections too: the
    build merges the head's deltas in fp32 like the backbone's and copies the head's other tensors unchanged; the
    folder verifies (the fused class loads the head with no missing key, stock ignores it, and the logits check
    against base + adapter, on stock's classes, leaves the head's deltas out)."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from helpers import configuration, modeling

    base, adapter, out = tmp_path / "base", tmp_path / "adapter", tmp_path / "out"
    torch.manual_seed(6)
    kwargs = composite_kwargs(mtp_num_hidden_layers=1)
    Qwen3_5ForConditionalGeneration(Qwen3_5Config(**kwargs)).save_pretrained(str(base))
    head = modeling.Qwen3_5FusedForConditionalGeneration(configuration.Qwen3_5FusedConfig(**kwargs)).mtp
    tensors = load_file(str(base / "model.safetensors"))
    g = torch.Generator().manual_seed(7)
    tensors.update({"mtp." + k: torch.randn(v.shape, generator=g) * 0.05 for k, v in head.state_dict().items()})
    save_file(tensors, str(base / "model.safetensors"), metadata={"format": "pt"})
    _write_tokenizer(base, chat_template=True)
    trained_on = modeling.Qwen3_5FusedForCausalLMLoader.from_pretrained(
        str(base), config=configuration.Qwen3_5FusedConfig.from_pretrained(str(base)), dtype=torch.float32)
    assert trained_on.mtp is not None
    peft_model = get_peft_model(trained_on, LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, target_modules=MTP_TARGETS))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    peft_model.save_pretrained(str(adapter))
    head_modules = {k.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
                    for k in load_file(str(adapter / "adapter_model.safetensors")) if k.endswith(".lora_A.weight")
                    and k.startswith("base_model.model.mtp.")}
    assert head_modules == {"mtp.fc", "mtp.layers.0.self_attn.q_proj", "mtp.layers.0.self_attn.v_proj",
                            "mtp.layers.0.mlp.gate_proj", "mtp.layers.0.mlp.down_proj"}

    rc = build_repo.main(["--base", str(base), "--adapter", str(adapter), "--out", str(out),
                          "--base-id", "test-org/tiny-mtp", "--repo-id", "test-org/tiny-mtp-fused"])
    assert rc == 0
    result = json.loads((out / "verification.json").read_text())
    assert result["passed"], result["failed"]
    assert result["checks"]["keys_vs_base"]["passed"]  # every base tensor, the head's included, names and shapes
    built, base_weights = _checkpoint(out), _checkpoint(base)
    reference = _merge_reference(base, adapter, torch.float32, "language_model.")
    assert built.keys() == reference.keys() == base_weights.keys()
    for key in reference:
        assert torch.equal(built[key], reference[key]), key  # the head's deltas too: one fp32 merge
    for key in (k for k in base_weights if k.startswith("mtp.")):
        adapted = key.removesuffix(".weight") in head_modules
        assert torch.equal(built[key], base_weights[key]) != adapted, key  # the rest of the head: copied as it is
    assert json.loads((out / "config.json").read_text())["text_config"]["mtp_num_hidden_layers"] == 1


def test_missing_chat_template_warns(composite_sources, tmp_path, caplog):
    base, _ = composite_sources
    with caplog.at_level("WARNING", logger="build_repo"):
        copied = build_repo.copy_tokenizer(base, tmp_path)
    assert copied == ["tokenizer.json", "tokenizer_config.json"]
    assert "no chat template" in caplog.text


def test_layout_detection():
    assert build_repo.detect_layout({"model_type": "qwen3_5_text"}).stock_class == "Qwen3_5ForCausalLM"
    assert build_repo.detect_layout({"architectures": ["Qwen3_5ForConditionalGeneration"],
                                     "vision_config": {}}).name == "composite"
    assert build_repo.detect_layout({"model_type": "qwen3_5_moe_text"}).name == "moe-text"
    assert build_repo.detect_layout({"architectures": ["Qwen3_5MoeForConditionalGeneration"],
                                     "vision_config": {}}).name == "moe-composite"
    with pytest.raises(ValueError, match="without a vision_config"):
        build_repo.detect_layout({"model_type": "qwen3_5_moe"})
    with pytest.raises(ValueError, match="not a Qwen3.5 checkpoint"):
        build_repo.detect_layout({"model_type": "llama", "architectures": ["LlamaForCausalLM"]})


_EXAMPLE_MARK = "=== the card's example ==="


@pytest.fixture(scope="module")
def built_by_id(text_build, composite_build, tmp_path_factory):
    """One subprocess (imports are slow) on an offline cache holding both built repos: tests/packaging/hub_load_probe.py
    for each repo id, then the text repo's card example, its Python block copied as is, on CPU. Returns (the probe's
    results, the example's stdout)."""
    tmp = tmp_path_factory.mktemp("built_by_id")
    make_hub_snapshot(text_build[0], tmp / "hub", "test-org/tiny-fused")
    make_hub_snapshot(composite_build[0], tmp / "hub", "test-org/tiny-vl-fused")
    card = (text_build[0] / "README.md").read_text()
    example = card.split("```python\n", 1)[1].split("```", 1)[0]
    runs = [("test-org/tiny-fused", "AutoModelForCausalLM"),
            ("test-org/tiny-vl-fused", "AutoModelForImageTextToText"),
            ("test-org/tiny-vl-fused", "AutoModelForCausalLM")]
    code = ("import runpy, sys\n"
            f"for args in {runs!r}:\n"
            "    sys.argv = ['hub_load_probe.py', *args]\n"
            f"    runpy.run_path({str(PROBE)!r}, run_name='__main__')\n"
            f"print({_EXAMPLE_MARK!r}, flush=True)\n"
            f"exec(compile({example!r}, 'card-example', 'exec'), {{'__name__': '__main__'}})\n")
    env = offline_env(tmp / "hub", tmp / "modules")
    env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600, cwd=tmp)
    assert proc.returncode == 0, proc.stderr[-4000:]
    probe_out, example_out = proc.stdout.split(_EXAMPLE_MARK + "\n", 1)
    results = [json.loads(l[len("RESULT "):]) for l in probe_out.splitlines() if l.startswith("RESULT ")]
    return results, example_out


def test_built_repos_load_by_id_offline(built_by_id):
    """By repo id through the offline cache: trust_remote_code loads the fused class, without it the stock class; both
    without missing keys and with the same logits."""
    results, _ = built_by_id
    expected = [("Qwen3_5FusedForCausalLM", "Qwen3_5ForCausalLM"),
                ("Qwen3_5FusedForConditionalGeneration", "Qwen3_5ForConditionalGeneration"),
                ("Qwen3_5FusedForCausalLM", "Qwen3_5ForCausalLM")]  # a stock Qwen3_5ForCausalLM loads both
    assert len(results) == len(expected)
    for result, (fused_class, stock_class) in zip(results, expected):
        fused, stock = result["True"], result["False"]
        assert (fused["class"], stock["class"]) == (fused_class, stock_class)
        assert not fused["module"].startswith("transformers.") and stock["module"].startswith("transformers.")
        for r in (fused, stock):
            assert not r["missing"] and not r["unexpected"] and not r["mismatched"], r
        assert fused["fused_kernels"] is True
        assert fused["logits"] == stock["logits"]


# --------------------------------------------------------------------------------------------------------------------
# Push
# --------------------------------------------------------------------------------------------------------------------


class _RecordingApi:
    """Replaces HfApi's network methods; `allowed=False` fails the test on any call."""

    def __init__(self, monkeypatch, allowed=True):
        from huggingface_hub import HfApi

        self.calls = []
        for name in ("create_repo", "create_branch", "create_commit"):
            monkeypatch.setattr(HfApi, name, self._method(name, allowed))
        monkeypatch.setattr(HfApi, "list_repo_files", lambda api, repo_id, **kwargs: [])

    def _method(self, name, allowed):
        def call(api, **kwargs):
            assert allowed, f"HfApi.{name} was called"
            self.calls.append((name, kwargs))
            return type("CommitInfo", (), {"commit_url": "https://example.invalid/commit/1"})()
        return call


def _pushable_copy(text_build, tmp_path) -> Path:
    folder = tmp_path / "tiny-fused"
    shutil.copytree(text_build[0], folder)
    # things that must never be uploaded
    (folder / ".env").write_text("HF_TOKEN=hf_secret\n")
    (folder / "token").write_text("hf_secret\n")
    (folder / "notes.txt").write_text("scratch\n")
    (folder / "screenshot.png").write_bytes(PNG)
    (folder / ".cache").mkdir()
    (folder / ".cache" / "x.lock").write_text("")
    (folder / "__pycache__").mkdir()
    return folder


def test_push_uploads_exactly_the_allowlist(text_build, tmp_path, monkeypatch, capsys):
    folder = _pushable_copy(text_build, tmp_path)
    monkeypatch.setenv("HF_TOKEN", "hf_never_printed")
    api = _RecordingApi(monkeypatch)
    assert push_to_hub.main([str(folder), "test-org/tiny-fused", "--private", "--branch", "fused-v1",
                             "--allow-unverified-kernels"]) == 0
    names = [name for name, _ in api.calls]
    assert names == ["create_repo", "create_branch", "create_commit"]
    assert api.calls[0][1] == {"repo_id": "test-org/tiny-fused", "repo_type": "model", "private": True,
                               "exist_ok": True}
    assert api.calls[1][1]["branch"] == "fused-v1" and api.calls[1][1]["exist_ok"] is True
    commit = api.calls[2][1]
    assert commit["revision"] == "fused-v1"
    uploaded = {op.path_in_repo for op in commit["operations"]}
    assert uploaded == {p.name for p in text_build[0].iterdir()}  # everything built, chart included, nothing else
    result = text_build[1]
    ref = result["checks"]["vs_reference"]
    assert "verified" in commit["commit_message"] and f"{ref['rel_err']:.2e}" in commit["commit_message"]
    assert push_to_hub.summary_line(result) in commit["commit_description"]
    assert result["files"][sorted(n for n in uploaded if n.endswith(".safetensors"))[0]] in commit["commit_description"]
    out = capsys.readouterr().out
    for skipped in (".env (hidden)", "token (not in the allowlist)", "notes.txt (not in the allowlist)",
                    "screenshot.png (chart not shown in README.md)", ".cache (hidden)", "__pycache__ (folder)"):
        assert skipped in out, skipped
    assert "hf_never_printed" not in out and "hf_secret" not in out


def test_push_dry_run_calls_nothing(text_build, tmp_path, monkeypatch, capsys):
    folder = _pushable_copy(text_build, tmp_path)
    _RecordingApi(monkeypatch, allowed=False)
    assert push_to_hub.main([str(folder), "test-org/tiny-fused", "--dry-run", "--allow-unverified-kernels"]) == 0
    out = capsys.readouterr().out
    assert "create_repo(repo_id='test-org/tiny-fused', repo_type='model', private=False, exist_ok=True)" in out
    assert "create_branch" not in out
    for name in ("config.json", "model.safetensors.index.json", "README.md", "verification.json", "speed.png"):
        assert f"CommitOperationAdd(path_in_repo={name!r})" in out
    assert "CommitOperationAdd(path_in_repo='notes.txt')" not in out
    assert "dry run: nothing was sent" in out


def test_push_refuses_missing_stale_or_failed_verification(text_build, text_sources, tmp_path, monkeypatch):
    _RecordingApi(monkeypatch, allowed=False)
    monkeypatch.setenv("HF_TOKEN", "hf_test")
    base, _ = text_sources

    def refused(folder, match):
        with pytest.raises(push_to_hub.PushRefused, match=match):
            push_to_hub.push(folder, "test-org/x", allow_unverified_kernels=True)
        assert push_to_hub.main([str(folder), "test-org/x", "--allow-unverified-kernels"]) == 1

    missing = tmp_path / "missing"
    shutil.copytree(text_build[0], missing)
    (missing / "verification.json").unlink()
    refused(missing, "no verification.json")

    tampered = tmp_path / "tampered"
    shutil.copytree(text_build[0], tampered)
    shard = sorted(tampered.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-2] + b"\x00\x01")
    refused(tampered, "modified since verification")

    extra = tmp_path / "extra"
    shutil.copytree(text_build[0], extra)
    shutil.copy2(shard, extra / "model-99.safetensors")
    refused(extra, r"added \['model-99.safetensors'\]")

    # Re-verified against the base alone, the merged folder fails (the check has teeth), and cannot be pushed.
    failed = tmp_path / "failed"
    shutil.copytree(text_build[0], failed)
    result = build_repo.verify_repo(failed, build_repo.Source(str(base)), None)
    assert not result["passed"] and result["failed"] == ["vs_reference"]
    assert result["checks"]["vs_reference"]["rel_err"] > result["checks"]["vs_reference"]["bound"]
    refused(failed, "verification failed")


# --------------------------------------------------------------------------------------------------------------------
# Safety of the output folder
# --------------------------------------------------------------------------------------------------------------------


def _fail_on_second_shard(monkeypatch):
    """Make the shard writer raise (as Ctrl-C would) once the first shard of each build is on disk."""
    import safetensors.torch

    original, calls = safetensors.torch.save_file, []

    def save_then_interrupt(*args, **kwargs):
        calls.append(args[1])
        if len(calls) % 2 == 0:
            raise KeyboardInterrupt("interrupted mid-save")
        return original(*args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", save_then_interrupt)
    return calls


def test_interrupted_build_leaves_output_untouched(text_sources, tmp_path, monkeypatch):
    base, adapter = text_sources
    calls = _fail_on_second_shard(monkeypatch)
    out = tmp_path / "out" / "repo"
    with pytest.raises(KeyboardInterrupt):
        build_repo.build_repo(str(base), out, str(adapter), max_shard_size="200KB")
    assert len(calls) == 2  # it did stop mid-save, after one shard
    assert not out.exists() and list(out.parent.iterdir()) == []  # no output, no half-written temp folder

    out.mkdir()
    (out / "config.json").write_text("old")
    with pytest.raises(build_repo.BuildError, match="--force"):
        build_repo.build_repo(str(base), out, str(adapter))
    with pytest.raises(KeyboardInterrupt):
        build_repo.build_repo(str(base), out, str(adapter), max_shard_size="200KB", force=True)
    assert [p.name for p in out.parent.iterdir()] == ["repo"]
    assert [p.name for p in out.iterdir()] == ["config.json"] and (out / "config.json").read_text() == "old"


def test_failed_verification_keeps_the_old_output(text_sources, tmp_path, monkeypatch):
    """--force replaces the output only with a verified build; a failing one is kept aside as <out>.failed."""
    base, adapter = text_sources
    monkeypatch.setattr(build_repo, "ROUNDING_FACTOR", 0.0)  # the bf16 storage error now exceeds the bound
    out = tmp_path / "repo"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with pytest.raises(build_repo.VerificationFailed) as info:
        build_repo.build_repo(str(base), out, str(adapter), force=True)
    assert info.value.result["failed"] == ["vs_reference"]
    assert [p.name for p in out.iterdir()] == ["old.txt"]
    failed = tmp_path / "repo.failed"
    assert json.loads((failed / "verification.json").read_text())["passed"] is False
    assert sorted(p.name for p in tmp_path.iterdir()) == ["repo", "repo.failed"]
    with pytest.raises(push_to_hub.PushRefused, match="verification failed"):
        push_to_hub.push(failed, "test-org/x", dry_run=True, allow_unverified_kernels=True)


def test_built_config_is_the_stock_config_plus_ignored_keys(text_build, text_sources, composite_build,
                                                            composite_sources):
    """Issue 7: what vLLM / SGLang read is the stock checkpoint. The built config.json equals the base model's but
    for keys those engines ignore (the remote-code map and our two switches) and the dtype it was cast to; tensor
    names and shapes are checked equal to the base checkpoint in the tests above."""
    ours = {"auto_map", "fused_kernels", "cuda_graphs"}
    cast = {"dtype", "torch_dtype", "transformers_version"}

    def strip(config):
        return {k: strip(v) if isinstance(v, dict) else v for k, v in config.items() if k not in ours | cast}

    for (out, _), (base, _) in ((text_build, text_sources), (composite_build, composite_sources)):
        built = json.loads((out / "config.json").read_text())
        source = json.loads((base / "config.json").read_text())
        assert strip(built) == strip(source)
        assert ours <= set(built) and not ours & set(source)


# --------------------------------------------------------------------------------------------------------------------
# Issue 26: what the card says is what was built; user errors in one line; nothing left behind
# --------------------------------------------------------------------------------------------------------------------


def _dtypes(folder: Path) -> set[str]:
    return {d for d, _ in build_repo.checkpoint_shapes(folder).values()}


def test_requested_dtype_is_written_on_a_float32_base(composite_sources, tmp_path):
    """--dtype bfloat16 on a float32 base: every tensor is written bf16 (the old cast kept every base-F32 tensor
    F32, so nothing was cast), and the config says so."""
    base, adapter = composite_sources
    assert _dtypes(base) == {"F32"}
    folder = tmp_path / "bf16"
    folder.mkdir()
    build_repo.merge_to_folder(base, adapter, folder, torch.bfloat16)
    assert _dtypes(folder) == {"BF16"}
    build_repo.write_config(base, folder, build_repo.LAYOUTS["composite"], torch.bfloat16)
    config = json.loads((folder / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and config["text_config"].get("dtype", "bfloat16") == "bfloat16"
    reference = _merge_reference(base, adapter, torch.float32, "language_model.")  # fp32 merge, then one cast
    built = _checkpoint(folder)
    assert all(torch.equal(built[k], reference[k].to(torch.bfloat16)) for k in reference)


def test_merge_streams_tensor_by_tensor_and_equals_peft(text_sources, tmp_path, monkeypatch):
    """The merge never builds a model: it holds at most one shard plus one tensor (twice, in float32, while it is
    merged; here under half of this tiny model, whose embedding is a large share of it), and
    its tensors are bit for bit those of PEFT's own merge_and_unload, cast once."""
    from peft import PeftModel
    from transformers import Qwen3_5ForCausalLM

    base, adapter = text_sources
    monkeypatch.setattr(build_repo, "load_base", lambda *a, **k: pytest.fail("the merge loaded a model"))
    folder = tmp_path / "merged"
    folder.mkdir()
    stats = build_repo.merge_to_folder(base, adapter, folder, torch.bfloat16, max_shard_size="40KB")
    largest_fp32 = max(4 * math.prod(s) for _, s in build_repo.checkpoint_shapes(base).values())
    assert stats.tensors == len(build_repo.checkpoint_shapes(base))
    assert stats.peak_bytes <= 40_000 + 2 * largest_fp32 and stats.peak_bytes < stats.total_bytes / 2
    peft_merged = PeftModel.from_pretrained(Qwen3_5ForCausalLM.from_pretrained(str(base), dtype=torch.float32),
                                            str(adapter)).merge_and_unload().state_dict()
    built = _checkpoint(folder)
    for key, value in peft_merged.items():
        if key in built:
            assert torch.equal(built[key], value.to(built[key].dtype)), key


def _adapter_for(tmp_path, name: str, **config) -> Path:
    from transformers import Qwen3_5ForCausalLM

    folder = tmp_path / name
    _make_adapter(Qwen3_5ForCausalLM(stock_text_config(**config)), folder, seed=4)
    return folder


def test_adapter_mismatch_is_a_one_line_error(text_sources, tmp_path, capsys):
    """A wider adapter (PEFT: a 107-line size-mismatch traceback) and a deeper one (PEFT: "layer-0 keys absent")
    are refused from the headers, before any weight is read, in one line naming the module, the shapes and the fix."""
    base, _ = text_sources
    wider = _adapter_for(tmp_path, "wider", hidden_size=96)
    with pytest.raises(build_repo.BuildError, match=r"does not fit the base at model\..*lora_A is \[4, 96\].*pass the "
                       "base it was trained on"):
        build_repo.plan_merge(base, wider)
    deeper = _adapter_for(tmp_path, "deeper", num_hidden_layers=6)
    with pytest.raises(build_repo.BuildError, match=r"deeper model \(layers up to 5, the base has 4\)"):
        build_repo.plan_merge(base, deeper)
    capsys.readouterr()
    rc = build_repo.main(["--base", str(base), "--base-id", "org/b", "--adapter", str(wider), "--out",
                          str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("error: adapter") and "\n" not in err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.build-*"))


def test_cli_user_errors_come_before_the_heavy_imports(text_sources, tmp_path):
    """An existing --out and a local --base without --base-id: one line and exit 2, before torch is imported."""
    base, _ = text_sources
    out = tmp_path / "out"
    out.mkdir()
    (out / "x").write_text("")
    script = REPO / "scripts" / "build_repo.py"
    for args, needle in (([ "--base", "org/base", "--out", str(out)], "--force"),
                         (["--base", str(base), "--out", str(tmp_path / "new")], "--base-id")):
        code = ("import runpy, sys\n"
                f"sys.argv = ['build_repo.py', *{args!r}]\n"
                "try:\n"
                f"    runpy.run_path({str(script)!r}, run_name='__main__')\n"
                "except SystemExit as exc:\n"
                "    print('exit', exc.code, 'torch' in sys.modules)\n")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert proc.stdout.strip() == "exit 2 False", proc.stdout + proc.stderr
        assert proc.stderr.startswith("error: ") and needle in proc.stderr and proc.stderr.count("\n") == 1


def test_killed_builds_are_removed_by_the_next_run(tmp_path):
    """A build killed outright leaves its hidden folder (a whole unverified model); the next build of the same output
    removes the ones whose process is gone, and keeps a running build's."""
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    out = tmp_path / "repo"
    for name, pid in (("dead", done.stdout.strip()), ("live", str(os.getpid())), ("old", None)):
        work = tmp_path / f".repo.build-{name}"
        (work / "repo").mkdir(parents=True)
        (work / "repo" / "model.safetensors").write_bytes(b"0" * 64)
        if pid:
            (work / build_repo.BUILD_PID_FILE).write_text(pid + "\n")
    with pytest.raises(build_repo.BuildError, match="neither a folder nor a Hub repo id"):
        build_repo.build_repo(str(tmp_path / "no-such-base"), out)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".repo.build-live"]


def test_relative_base_is_recorded_by_name_and_hash(text_sources, composite_sources, composite_build, tmp_path,
                                                   monkeypatch, capfd):
    """`--base .` is recorded by the folder's own name, the Hub id it is a copy of and the sha256 of the sha256sum
    listing of its config and weights. A folder built before local paths were dropped (its verification.json names
    the source folders) still verifies from another folder, against those folders, and its new record names no path;
    a local verification logs no "new version downloaded" warning."""
    import hashlib

    base, _ = text_sources
    monkeypatch.chdir(base)
    source = build_repo.resolve_source(".", copy_of="org/base")
    listing = "".join(f"{hashlib.sha256((base / n).read_bytes()).hexdigest()}  {n}\n"
                      for n in ("config.json", "model.safetensors"))
    assert source.record() == {"kind": "local", "name": "base", "copy_of": "org/base",
                               "sha256": hashlib.sha256(listing.encode()).hexdigest()}
    vl_base, vl_adapter = composite_sources
    folder = tmp_path / "tiny-vl-fused"
    shutil.copytree(composite_build[0], folder)
    legacy = json.loads((folder / "verification.json").read_text())
    legacy["sources"] = {"base": {"path": str(vl_base)}, "adapter": {"path": str(vl_adapter)}}
    (folder / "verification.json").write_text(json.dumps(legacy))
    monkeypatch.chdir(tmp_path)
    capfd.readouterr()
    result = build_repo.verify_repo(folder, write=False)
    assert result["passed"], result["failed"]
    assert "kept_from" not in result["checks"]["vs_reference"]  # checked again, against the recorded folders
    assert result["sources"]["base"] == {"kind": "local", "name": "base", "copy_of": None,
                                         "sha256": build_repo.content_hash(vl_base)}
    assert str(vl_base.parent) not in json.dumps(result)
    assert "A new version of the following files was downloaded" not in capfd.readouterr().err
    message, description = push_to_hub.commit_text(folder, legacy)
    assert "base: local folder base" in description and str(vl_base) not in description


def test_cpu_build_says_the_kernels_were_not_verified(text_build):
    """Built without a GPU every layer ran the stock path: verification.json, the card (in words and in the table)
    and the summary say the fused kernels were not verified."""
    out, result = text_build
    assert result["device"] == "cpu" and result["fused_kernels_verified"] is False
    card = (out / "README.md").read_text()
    assert "The fused kernels were not verified for this checkpoint" in card
    assert "fused == stock: yes" not in card and "not verified: no layer ran fused" in card
    assert "fused kernels NOT verified" in push_to_hub.summary_line(result)


def test_card_has_what_a_user_needs(text_build, composite_build):
    from huggingface_hub import metadata_load

    for out, base_id in ((text_build[0], "test-org/tiny-base"), (composite_build[0], "test-org/tiny-vl")):
        card = (out / "README.md").read_text()
        assert metadata_load(out / "README.md")["base_model"] == base_id
        for section in ("## Usage", "What changed from the base", "## Intended use", "## Limitations",
                        "## Evaluation", "| check | result |"):
            assert section in card, (out.name, section)
        assert "<commit sha>" not in card and 'device_map="cuda"' not in card


def test_card_usage_example_runs_as_written_on_cpu(built_by_id):
    """The card's Python block, copied as is, run on CPU against the repo id (an offline Hub cache; `built_by_id`)."""
    _, example_out = built_by_id
    assert "'mlp'" in example_out  # model.describe()["layers"] was printed


# --------------------------------------------------------------------------------------------------------------------
# Issue 47: a build from local folders names no local path in its output
# --------------------------------------------------------------------------------------------------------------------


def _files_naming(folder: Path, roots) -> list[str]:
    """The files under ``folder`` whose bytes (text or not) hold any of the paths ``roots``."""
    needles = {str(r).encode() for r in roots}
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")
                  if p.is_file() and any(n in p.read_bytes() for n in needles))


@pytest.fixture(scope="module")
def local_build(text_sources, tmp_path_factory):
    """Built through the CLI as a new user would, from two local folders under one temporary folder: `--base .` run
    inside the base, an absolute `--adapter`, `--dtype bfloat16`. Returns (that temporary folder, the output)."""
    root = tmp_path_factory.mktemp("local_build")
    base, adapter = root / "sources" / "base", root / "sources" / "my-lora"
    shutil.copytree(text_sources[0], base)
    shutil.copytree(text_sources[1], adapter)
    out = root / "out" / "model"
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(base)
        rc = build_repo.main(["--base", ".", "--base-id", "example/tiny-base", "--adapter", str(adapter), "--out",
                              str(out), "--dtype", "bfloat16"])
    assert rc == 0
    return root, out


def test_local_build_names_no_local_path(local_build):
    """Issue 47: no file of the output (verification.json, the card, configs, code, weights) holds the temporary
    folder's path, as given or resolved; a local source is recorded by its folder name, the Hub id it is a copy of
    and a hash of its config and weights. What the push uploads (and its commit text) holds none either."""
    root, out = local_build
    assert _files_naming(out, {root, root.resolve()}) == []
    result = json.loads((out / "verification.json").read_text())
    assert result["passed"], result["failed"]
    base, adapter = root / "sources" / "base", root / "sources" / "my-lora"
    assert result["sources"] == {
        "base": {"kind": "local", "name": "base", "copy_of": "example/tiny-base",
                 "sha256": build_repo.content_hash(base)},
        "adapter": {"kind": "local", "name": "my-lora", "copy_of": None, "sha256": build_repo.content_hash(adapter)},
    }
    public = json.dumps(push_to_hub.public_verification(result))
    message, description = push_to_hub.commit_text(out, result)
    for text in (public, message, description):
        assert str(root) not in text and str(root.resolve()) not in text
    assert "base: local folder base (a copy of example/tiny-base, sha256 " in description


def test_verify_elsewhere_checks_the_sources(local_build, tmp_path, monkeypatch, capsys):
    """`--verify` of a folder built from local folders, run from another folder. Without sources it runs what the
    folder alone shows and keeps the checks against the sources from the build (the files they vouched for unchanged);
    given them (relative paths) it runs those again. A source other than the one built from (its hash differs) is a
    one-line error naming it and the fix, and so is a folder changed since, verified without its sources."""
    root, built = local_build
    base, adapter = root / "sources" / "base", root / "sources" / "my-lora"
    folder = tmp_path / "copy" / "model"
    shutil.copytree(built, folder)
    first = json.loads((folder / "verification.json").read_text())
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    capsys.readouterr()

    assert build_repo.main(["--verify", str(folder)]) == 0
    result = json.loads((folder / "verification.json").read_text())
    assert result["passed"] and result["sources"] == first["sources"]
    for name in ("vs_reference", "keys_vs_base"):
        assert result["checks"][name] == {**first["checks"][name], "kept_from": first["timestamp"]}

    relative = [os.path.relpath(p, elsewhere) for p in (folder, base, adapter)]
    assert build_repo.main(["--verify", relative[0], "--base", relative[1], "--adapter", relative[2]]) == 0
    result = json.loads((folder / "verification.json").read_text())
    assert result["passed"] and result["sources"] == first["sources"]  # copy_of kept from the build's record
    assert "kept_from" not in result["checks"]["vs_reference"]
    assert result["checks"]["vs_reference"]["rel_err"] == first["checks"]["vs_reference"]["rel_err"]
    assert _files_naming(folder, {tmp_path, tmp_path.resolve(), root, root.resolve()}) == []

    other = tmp_path / "other-lora"
    shutil.copytree(adapter, other)
    config = json.loads((other / "adapter_config.json").read_text())
    (other / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": 2 * LORA_ALPHA}))
    capsys.readouterr()
    assert build_repo.main(["--verify", str(folder), "--base", str(base), "--adapter", str(other)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the hashing bar
    assert err.startswith(f"error: --adapter {other.resolve()}: its config and weights")
    assert f"'my-lora', sha256 {first['sources']['adapter']['sha256'][:16]}" in err and "pass that folder" in err

    shard = folder / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-2] + b"\x00\x01")
    assert build_repo.main(["--verify", str(folder)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"error: {folder} was built from local folders ('base', 'my-lora')")
    assert err.endswith("pass --base (and --adapter) to check it against them")
