"""The multi-token-prediction head (``fused_mtp``, checkpoint keys ``mtp.*``), on CPU.

- its math equals stock's own layers (a one-layer stock text model holding the head's layer and norm), bit for bit,
  and its cached draft steps equal one forward;
- the public classes (dense and MoE; the causal LM, the composite model and the composite repo's causal-LM entry)
  load it from a checkpoint that has it and save it back under the same keys, bit for bit, in both MoE expert layouts
  the real checkpoints use; stock loads those saves without remote code, ignoring it;
- a checkpoint without it (a fine-tune saved by stock, whose config still names one) loads as before: no head, the
  same loading info and log;
- the shipped model's head: its files, its acceptance as ``training_report.json`` records it (re-measured on the
  held-out slice the report records for the tests), and ``generate`` unchanged by it.
"""

import importlib.util
import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from helpers import (
    assert_close,
    assert_exact,
    composite_kwargs,
    configuration,
    import_module,
    modeling,
    moe_composite_kwargs,
    run_stock,
)
from scripts.common import tiny_moe_text_kwargs, tiny_text_kwargs

fused_mtp = import_module("fused_mtp")
REPO = Path(__file__).resolve().parents[2]
EAGER = {"experts_implementation": "eager"}  # stock's CPU default (grouped_mm) rounds with the weights' layout


def _text_kwargs(moe: bool, **overrides) -> dict:
    return tiny_moe_text_kwargs(**overrides) if moe else tiny_text_kwargs(**overrides)


def _randomize(module: torch.nn.Module, seed: int) -> None:
    """Every parameter random (the (1 + w) norms too, so a weight that were ignored would show)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)


# -- the head's layout and math ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_head_keys_are_the_real_checkpoints(moe):
    """``mtp.fc`` [H, 2H], the two input norms and ``mtp.norm`` [H], and one decoder layer with exactly the keys and
    shapes of one of the backbone's full-attention layers (its MLP, or the MoE block with 3D experts)."""
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5MoeTextModel, Qwen3_5TextConfig, Qwen3_5TextModel

    config = (Qwen3_5MoeTextConfig if moe else Qwen3_5TextConfig)(**_text_kwargs(moe), mtp_num_hidden_layers=1)
    config._attn_implementation = "sdpa"  # what a model built from it resolves
    head = fused_mtp.Qwen3_5MultiTokenPredictor(config)
    shapes = {k: tuple(v.shape) for k, v in head.state_dict().items()}
    h = config.hidden_size
    with torch.device("meta"):
        backbone = (Qwen3_5MoeTextModel if moe else Qwen3_5TextModel)(config)
    full = config.layer_types.index("full_attention")
    layer = {k.removeprefix(f"layers.{full}."): tuple(v.shape) for k, v in backbone.state_dict().items()
             if k.startswith(f"layers.{full}.")}
    assert {k.removeprefix("layers.0."): s for k, s in shapes.items() if k.startswith("layers.0.")} == layer
    assert {k: s for k, s in shapes.items() if not k.startswith("layers.")} == {
        "fc.weight": (h, 2 * h), "pre_fc_norm_embedding.weight": (h,), "pre_fc_norm_hidden.weight": (h,),
        "norm.weight": (h,)}
    assert ("mlp.experts.gate_up_proj" in layer) == moe


def _head_and_reference(moe: bool, seed: int = 0):
    """A random head and, from stock's classes, a one-layer text model holding the head's layer and final norm."""
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5MoeTextModel, Qwen3_5TextConfig, Qwen3_5TextModel

    config_cls = Qwen3_5MoeTextConfig if moe else Qwen3_5TextConfig
    config = config_cls(**_text_kwargs(moe), mtp_num_hidden_layers=1, **(EAGER if moe else {}))
    config._attn_implementation = "sdpa"  # what a model built from it resolves (the reference's does)
    head = fused_mtp.Qwen3_5MultiTokenPredictor(config).eval()
    _randomize(head, seed)
    ref_config = config_cls(**_text_kwargs(moe, num_hidden_layers=1, layer_types=["full_attention"]),
                            **(EAGER if moe else {}))
    reference = (Qwen3_5MoeTextModel if moe else Qwen3_5TextModel)(ref_config).eval()
    reference.layers[0].load_state_dict(head.layers[0].state_dict())
    reference.norm.load_state_dict(head.norm.state_dict())
    embed = torch.nn.Embedding(config.vocab_size, config.hidden_size)
    _randomize(embed, seed + 1)
    return config, head, reference, embed


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("batch,seq_len,padding", [(1, 1, False), (2, 7, False), (3, 9, True)],
                         ids=["T1", "T7", "T9-left-padded"])
def test_head_equals_stock_layers(moe, batch, seq_len, padding):
    """``norm(layer(fc(concat(norm_e(embed(ids)), norm_h(hidden)))))``: the two input norms and ``fc`` as stock's
    RMSNorm and a plain matmul, the layer and ``mtp.norm`` as a stock text model of that one full-attention layer
    (its rotary embedding, causal / padding mask, decoder layer, final norm). The same stock code: bit for bit."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

    config, head, reference, embed = _head_and_reference(moe)
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(batch, seq_len, config.hidden_size, generator=g)
    ids = torch.randint(3, config.vocab_size, (batch, seq_len), generator=g)
    mask = None
    if padding:
        mask = torch.ones(batch, seq_len, dtype=torch.long)
        mask[1, :3] = 0
        mask[2, :5] = 0
    norms = []
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden"):
        norm = Qwen3_5RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        norm.load_state_dict(getattr(head, name).state_dict())
        norms.append(norm)
    with torch.no_grad():
        x = torch.cat([norms[0](embed(ids)), norms[1](hidden)], dim=-1) @ head.fc.weight.T
        want = reference(inputs_embeds=x, attention_mask=mask).last_hidden_state
        got = head(hidden, ids, embed, attention_mask=mask)
    assert_exact("draft hidden", got, want)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_cached_draft_steps_equal_one_forward(moe):
    """A prefix, then one position at a time through the head's own cache (as a draft chain runs it), gives what one
    forward over every position gives; ``draft_logits`` is the shared LM head over the draft."""
    from transformers.cache_utils import DynamicCache

    config, head, _, embed = _head_and_reference(moe, seed=5)
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(2, 11, config.hidden_size, generator=g)
    ids = torch.randint(3, config.vocab_size, (2, 11), generator=g)
    lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)
    with torch.no_grad():
        full = head(hidden, ids, embed)
        cache = DynamicCache()
        parts = [head(hidden[:, :6], ids[:, :6], embed, cache=cache)]
        parts += [head(hidden[:, t:t + 1], ids[:, t:t + 1], embed, cache=cache) for t in range(6, 11)]
        logits, draft = head.draft_logits(hidden, ids, embed, lm_head)
    assert cache.get_seq_length() == 11
    assert_close("cached steps", torch.cat(parts, dim=1), full, 1e-6)  # fp32: SDPA over other lengths
    assert_exact("draft", draft, full)
    assert_exact("logits", logits, lm_head(full))


# -- the public classes: built, loaded, saved --------------------------------------------------------------------------


def _config(moe: bool, composite: bool, mtp: int | None = 1):
    extra = {} if mtp is None else {"mtp_num_hidden_layers": mtp}
    if composite:
        kwargs = moe_composite_kwargs(**extra) if moe else composite_kwargs(**extra)
        return (configuration.Qwen3_5MoeFusedConfig if moe else configuration.Qwen3_5FusedConfig)(
            **kwargs, **(EAGER if moe else {}))
    return (configuration.Qwen3_5MoeFusedTextConfig if moe else configuration.Qwen3_5FusedTextConfig)(
        **_text_kwargs(moe), **extra, **(EAGER if moe else {}))


def _class(moe: bool, name: str):
    return getattr(modeling, name.replace("Qwen3_5Fused", "Qwen3_5MoeFused") if moe else name)


def _mtp_tensors(folder: Path) -> dict:
    return {k: v for k, v in load_file(str(folder / "model.safetensors")).items() if k.startswith("mtp.")}


def test_the_config_decides_whether_a_model_is_built_with_a_head():
    """Built from a config (training from scratch): a head when ``mtp_num_hidden_layers >= 1``, none without (the
    state dict is stock's then); ``describe()`` says which; ``mtp_draft`` refuses a model without one."""
    without = modeling.Qwen3_5FusedForCausalLM(_config(False, False, mtp=None))
    with_head = modeling.Qwen3_5FusedForCausalLM(_config(False, False))
    assert without.mtp is None and without.describe()["mtp"] is None
    assert not any(k.startswith("mtp.") for k in without.state_dict())
    assert with_head.describe()["mtp"]["layers"] == 1
    assert {k for k in with_head.state_dict() if not k.startswith("mtp.")} == set(without.state_dict())
    with pytest.raises(ValueError, match="attention implementation is unset"):
        fused_mtp.Qwen3_5MultiTokenPredictor(_config(False, False))  # a fresh config, no model resolved it
    with pytest.raises(ValueError, match="no MTP head"):
        without.mtp_draft(torch.zeros(1, 2, 64), torch.zeros(1, 2, dtype=torch.long))
    composite = modeling.Qwen3_5MoeFusedForConditionalGeneration(_config(True, True))
    assert composite.mtp is not None and composite.mtp.layers[0].mlp.experts.gate_up_proj.std() > 0  # initialised


def test_the_head_follows_the_models_attention_implementation():
    """The head's layer reads the model's own config: ``set_attn_implementation`` reaches it."""
    model = modeling.Qwen3_5FusedForCausalLM(_config(False, False))
    assert model.mtp.layers[0].self_attn.config is model.config
    model.set_attn_implementation("eager")
    assert model.mtp.layers[0].self_attn.config._attn_implementation == "eager"


def _write_3d_head(folder: Path, model) -> None:
    """``folder``'s checkpoint with the head's experts as 3D tensors (``mtp.layers.0.mlp.experts.gate_up_proj``)."""
    tensors = {k: v for k, v in load_file(str(folder / "model.safetensors")).items() if not k.startswith("mtp.")}
    tensors.update({"mtp." + k: v.contiguous() for k, v in model.mtp.state_dict().items()})
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


LOAD_CASES = [
    (False, "Qwen3_5FusedForCausalLM", False, None),
    (False, "Qwen3_5FusedForConditionalGeneration", True, None),
    (False, "Qwen3_5FusedForCausalLMLoader", True, None),
    (True, "Qwen3_5FusedForCausalLM", False, "per-expert"),
    (True, "Qwen3_5FusedForCausalLM", False, "3d"),
    (True, "Qwen3_5FusedForConditionalGeneration", True, "per-expert"),
    (True, "Qwen3_5FusedForConditionalGeneration", True, "3d"),
    (True, "Qwen3_5FusedForCausalLMLoader", True, "3d"),
]


@pytest.mark.parametrize("moe,name,composite,layout", LOAD_CASES, ids=[
    "dense-causal-lm", "dense-image-text-to-text", "dense-causal-lm-from-composite", "moe-causal-lm-per-expert",
    "moe-causal-lm-3d", "moe-image-text-to-text-per-expert", "moe-image-text-to-text-3d",
    "moe-causal-lm-from-composite-3d"])
def test_head_loads_and_saves_bit_exact(tmp_path, moe, name, composite, layout):
    """A checkpoint with the head loads into the fused class with no missing or unexpected key, the head's tensors
    exactly the checkpoint's; the fused save writes them back under the same keys, bit for bit (a MoE head's experts
    per expert or as 3D tensors, as the checkpoint had them: Qwen3.5-35B-A3B ships the first, Qwen3.6-35B-A3B the
    second); stock loads that save without remote code, ignoring the head, with no missing or unexpected key."""
    import transformers

    torch.manual_seed(0)
    build = _class(moe, "Qwen3_5FusedForConditionalGeneration" if composite else "Qwen3_5FusedForCausalLM")
    source = build(_config(moe, composite)).eval()
    src = tmp_path / "src"
    source.save_pretrained(src)
    if layout == "3d":
        _write_3d_head(src, source)
    written = _mtp_tensors(src)
    assert any(".experts.0." in k for k in written) == (layout == "per-expert")

    loader = _class(moe, name)
    model, info = loader.from_pretrained(src, config=_config(moe, composite), output_loading_info=True,
                                         **(EAGER if moe else {}))
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert model.mtp is not None
    for key, value in source.mtp.state_dict().items():
        assert_exact(key, model.mtp.state_dict()[key], value)

    out = tmp_path / "out"
    model.save_pretrained(out)
    saved = _mtp_tensors(out)
    assert saved.keys() == written.keys()
    for key in written:
        assert_exact(key, saved[key], written[key])

    stock_class = getattr(transformers, type(model).__name__.replace("Fused", "").replace("Loader", ""))
    stock, info = stock_class.from_pretrained(out, output_loading_info=True, **(EAGER if moe else {}))
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ours = {k: v for k, v in model.state_dict().items() if not k.startswith("mtp.")}
    assert stock.state_dict().keys() == ours.keys()
    ids = torch.tensor([[5, 17, 42, 9, 77, 3]])
    with torch.no_grad():
        assert torch.equal(run_stock(stock, input_ids=ids).logits, model(input_ids=ids).logits)


@pytest.mark.parametrize("moe,composite", [(False, False), (False, True), (True, False)],
                         ids=["dense-causal-lm", "dense-image-text-to-text", "moe-causal-lm"])
def test_checkpoint_without_the_head_loads_as_before(tmp_path, caplog, moe, composite):
    """A checkpoint whose config names a head but holds no ``mtp.*`` tensor (a fine-tune saved by stock, which drops
    the head at load): no head, and the load is the one of the same checkpoint with the config field removed: the same
    (clean) loading info, the same log, the same weights."""
    import transformers

    torch.manual_seed(1)
    family = "Qwen3_5Moe" if moe else "Qwen3_5"
    if composite:
        kwargs = (moe_composite_kwargs if moe else composite_kwargs)(mtp_num_hidden_layers=1)
        stock = getattr(transformers, family + "ForConditionalGeneration")(getattr(transformers, family + "Config")(
            **kwargs, **(EAGER if moe else {})))
    else:
        stock = getattr(transformers, family + "ForCausalLM")(getattr(transformers, family + "TextConfig")(
            **_text_kwargs(moe), mtp_num_hidden_layers=1, **(EAGER if moe else {})))
    named, plain = tmp_path / "named", tmp_path / "plain"
    stock.save_pretrained(named)
    stock.save_pretrained(plain)
    cfg = json.loads((plain / "config.json").read_text())
    (cfg.get("text_config") or cfg).pop("mtp_num_hidden_layers")
    (plain / "config.json").write_text(json.dumps(cfg))
    assert "mtp_num_hidden_layers" in (named / "config.json").read_text()
    assert not any(k.startswith("mtp.") for k in load_file(str(named / "model.safetensors")))

    fused_class = _class(moe, "Qwen3_5FusedForConditionalGeneration" if composite else "Qwen3_5FusedForCausalLM")
    loads = {}
    for folder in (named, plain):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            model, info = fused_class.from_pretrained(folder, output_loading_info=True, **(EAGER if moe else {}))
        loads[folder.name] = (model, info, [r.getMessage() for r in caplog.records])
    (model, info, log), (plain_model, plain_info, plain_log) = loads["named"], loads["plain"]
    assert model.mtp is None and plain_model.mtp is None
    assert info == plain_info and not info["missing_keys"] and not info["unexpected_keys"], info
    assert log == plain_log
    assert model.state_dict().keys() == plain_model.state_dict().keys()


def test_an_adapter_loaded_into_the_model_keeps_its_head(tmp_path):
    """transformers' ``load_adapter`` reads the adapter's tensors through the same load hook, without a head tensor:
    the head, matched to the base checkpoint when the model was loaded, stays, and takes the adapter's LoRA where it
    reaches it."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(2)
    source = modeling.Qwen3_5FusedForCausalLM(_config(False, False)).eval()
    source.save_pretrained(tmp_path / "base")
    get_peft_model(source, LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(str(tmp_path / "adapter"))
    model = modeling.Qwen3_5FusedForCausalLM.from_pretrained(tmp_path / "base")
    model.load_adapter(str(tmp_path / "adapter"))
    assert model.mtp is not None and hasattr(model.mtp.layers[0].self_attn.q_proj, "lora_A")


def test_a_transformers_with_another_load_hook_loads_no_head(tmp_path, monkeypatch, caplog):
    """Where transformers' load hook differs (``LOAD_HOOK_REASON``), a load cannot match the head to the checkpoint:
    it builds none, says why once, and the checkpoint loads as stock loads it (the head's tensors ignored)."""
    torch.manual_seed(3)
    modeling.Qwen3_5FusedForCausalLM(_config(False, False)).save_pretrained(tmp_path)
    monkeypatch.setattr(modeling, "LOAD_HOOK_REASON", "its load hook takes other arguments")
    monkeypatch.setattr(import_module("fused_plan"), "_announced", set())
    with caplog.at_level(logging.WARNING):
        model, info = modeling.Qwen3_5FusedForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert model.mtp is None and not info["missing_keys"] and not info["unexpected_keys"], info
    assert "(mtp.*) is not loaded" in caplog.text and "its load hook takes other arguments" in caplog.text


def test_a_dropped_head_leaves_the_device_map():
    """The head dropped before a load takes its entries out of the load's device map (``from_pretrained``
    dispatches with that dict)."""
    compat = import_module("fused_compat")
    load_config = type("LoadConfig", (), {"device_map": {"model": 0, "mtp.fc": 0, "mtp.layers.0": 1, "mtpx": 0,
                                                          "lm_head": 0}})()
    compat.forget_device_map_entries(load_config, "mtp")
    assert load_config.device_map == {"model": 0, "mtpx": 0, "lm_head": 0}


# -- the shipped model's head -----------------------------------------------------------------------------------------


def _train_module():
    spec = importlib.util.spec_from_file_location("train_mtp_head", REPO / "scripts" / "train_mtp_head.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def trainer():
    return _train_module()


@pytest.fixture(scope="module")
def shipped(trainer):
    from transformers import AutoTokenizer

    with trainer.torch_linear_attention():
        model = trainer.load_model(REPO, with_head_config=False)
    return model, AutoTokenizer.from_pretrained(str(REPO))


def test_shipped_files_hold_the_head(shipped):
    """``config.json`` names one MTP layer in its text config; ``model.safetensors`` holds the head's ``mtp.*`` keys,
    fp32, beside the unchanged stock composite layout (``test_trained_model.py``), and the fused causal LM loads it."""
    config = json.loads((REPO / "config.json").read_text())
    assert config["text_config"]["mtp_num_hidden_layers"] == 1 and "mtp_num_hidden_layers" not in config
    with safe_open(str(REPO / "model.safetensors"), framework="pt") as f:
        head = {k: f.get_slice(k).get_dtype() for k in f.keys() if k.startswith("mtp.")}
    model, _ = shipped
    expected = {"mtp." + k for k in model.mtp.state_dict()}
    assert set(head) == expected and set(head.values()) == {"F32"}
    report = json.loads((REPO / "training_report.json").read_text())["mtp"]
    assert report["keys"] == len(expected) and not report["training"]["stopped_by_time_limit"]


def test_shipped_acceptance_matches_report(trainer, shipped):
    """The acceptance ``training_report.json`` records for its check slice (the first held-out windows), measured
    again with the recorded procedure (``mtp_acceptance``), on one thread as recorded: the same numbers, up to fp32
    summation order (a near-tie flipping one argmax moves a temperature-0 rate by 1 / positions)."""
    model, tokenizer = shipped
    recorded = json.loads((REPO / "training_report.json").read_text())["mtp"]["acceptance"]
    check = recorded["check"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with trainer.torch_linear_attention():
            got = trainer.mtp_acceptance(model, tokenizer, (REPO / "data" / "heldout.txt").read_text(encoding="utf-8"),
                                         window=recorded["window"], chain_every=check["chain"]["every"],
                                         max_windows=check["max_windows"])
    finally:
        torch.set_num_threads(threads)
    assert got["positions"] == check["positions"] and got["chain"]["positions"] == check["chain"]["positions"]
    assert got["temperature_0"] == pytest.approx(check["temperature_0"], abs=1.5 / got["positions"])
    assert got["temperature_1"] == pytest.approx(check["temperature_1"], rel=1e-5)
    assert got["head_nll_next_next_token"] == pytest.approx(check["head_nll_next_next_token"], rel=1e-5)
    n = got["chain"]["positions"]
    assert got["chain"]["temperature_0"] == pytest.approx(check["chain"]["temperature_0"], abs=1.5 / n)
    # sampled drafts: a flipped sample changes one position's product (at most 1 / positions of the mean)
    assert got["chain"]["temperature_1"] == pytest.approx(check["chain"]["temperature_1"], abs=1.0 / n)
    # the full measurement is what the README quotes: a head that drafts well enough to be worth a verify step
    assert 0.3 < recorded["temperature_0"] < 1 and recorded["temperature_1"] > recorded["chain"]["temperature_1"][1]


def test_shipped_head_leaves_generate_unchanged(shipped):
    """``scripts/generate.py``'s call on the shipped repo gives the same tokens with the head loaded as without it
    (the repo's config without ``mtp_num_hidden_layers``: the files before the head was added), and stock's."""
    from transformers import AutoModelForCausalLM

    generate = importlib.util.spec_from_file_location("generate_script", REPO / "scripts" / "generate.py")
    script = importlib.util.module_from_spec(generate)
    generate.loader.exec_module(script)
    model, tokenizer = shipped
    config = configuration.Qwen3_5FusedConfig.from_pretrained(str(REPO))
    config.text_config.mtp_num_hidden_layers = 0
    plain = modeling.Qwen3_5FusedForCausalLMLoader.from_pretrained(str(REPO), config=config, dtype=torch.float32)
    assert model.mtp is not None and plain.mtp is None
    stock = AutoModelForCausalLM.from_pretrained(str(REPO), dtype=torch.float32)
    with compat_routing():
        runs = [script.generate(tokenizer, m, script.DEFAULT_PROMPT, 40, chat=False)["completion"]
                for m in (model, plain, stock)]
    assert runs[0] == runs[1] == runs[2]


def compat_routing():
    """Stock's DeltaNet helpers in plain torch (stock on CPU with fla installed would call fla's kernels)."""
    return import_module("fused_compat").torch_reference_kernels()
