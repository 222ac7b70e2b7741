"""Configs: switches, validation, overrides (kwarg and environment), model types, bad checkpoints."""

import json

import pytest

from helpers import composite_kwargs, configuration, fused_text_config, modeling, stock_and_fused_lm
from scripts.common import tiny_text_kwargs


def test_defaults_and_stock_model_types():
    text = configuration.Qwen3_5FusedTextConfig(**tiny_text_kwargs())
    assert text.fused_kernels is None and text.cuda_graphs is True  # None: unset (off unless the environment says 1)
    assert text.model_type == "qwen3_5_text"
    comp = configuration.Qwen3_5FusedConfig(**composite_kwargs())
    assert comp.model_type == "qwen3_5" and comp.fused_kernels is None
    assert isinstance(comp.text_config, configuration.Qwen3_5FusedTextConfig)
    d = comp.to_dict()
    assert d["model_type"] == "qwen3_5" and d["text_config"]["model_type"] == "qwen3_5_text"


@pytest.mark.parametrize("bad", ["yes", "true", 1, 0, 1.0, [True]], ids=repr)
@pytest.mark.parametrize("name", ["fused_kernels", "cuda_graphs"])
def test_invalid_switch_values_name_the_value(name, bad):
    with pytest.raises(ValueError) as err:
        configuration.Qwen3_5FusedTextConfig(**tiny_text_kwargs(), **{name: bad})
    assert name in str(err.value) and repr(bad) in str(err.value) and "True, False or None" in str(err.value)
    with pytest.raises(ValueError, match=name):
        configuration.Qwen3_5FusedConfig(**composite_kwargs(), **{name: bad})


def test_invalid_value_set_after_init_is_caught_at_model_build():
    config = fused_text_config()
    config.fused_kernels = "fast"
    with pytest.raises(ValueError, match="'fast'"):
        modeling.Qwen3_5FusedForCausalLM(config)


# The one precedence rule: an explicit False (config, caller or environment) wins; then an explicit True from either;
# then the default (fused_kernels off, cuda_graphs on). Rows: (config value, environment value, effective).
PRECEDENCE = [
    (None, "", False), (None, "1", True), (None, "0", False),
    (True, "", True), (True, "1", True), (True, "0", False),
    (False, "", False), (False, "1", False), (False, "0", False),
]


@pytest.mark.parametrize("config_value,raw,want", PRECEDENCE, ids=lambda v: repr(v))
def test_switch_precedence_fused_kernels(monkeypatch, config_value, raw, want):
    monkeypatch.setenv("QWEN3_5_FUSED_KERNELS", raw)
    model = modeling.Qwen3_5FusedForCausalLM(configuration.Qwen3_5FusedTextConfig(
        **tiny_text_kwargs(), fused_kernels=config_value))
    assert model.fused_plan.fused_kernels is want
    assert model.describe()["fused_kernels"] is want


@pytest.mark.parametrize("config_value,raw,want", [
    (True, "", True), (True, "0", False), (False, "1", False), (False, "", False), (True, "yes", True),
], ids=repr)
def test_switch_precedence_cuda_graphs(monkeypatch, config_value, raw, want):
    monkeypatch.setenv("QWEN3_5_CUDA_GRAPHS", raw)
    model = modeling.Qwen3_5FusedForCausalLM(fused_text_config(cuda_graphs=config_value))
    assert model.fused_plan.cuda_graphs is want


def test_explicit_false_from_the_caller_beats_the_environment(monkeypatch, tmp_path):
    _, fused = stock_and_fused_lm(fused_kernels=True)
    fused.save_pretrained(tmp_path)
    monkeypatch.setenv("QWEN3_5_FUSED_KERNELS", "1")
    off = modeling.Qwen3_5FusedForCausalLM.from_pretrained(tmp_path, fused_kernels=False)
    assert off.fused_plan.fused_kernels is False
    on = modeling.Qwen3_5FusedForCausalLM.from_pretrained(tmp_path)
    assert on.fused_plan.fused_kernels is True
    assert on.set_fused_kernels(False).fused_plan.fused_kernels is False


def test_switches_are_read_once_and_set_by_method():
    """The plan is resolved when the model is built, moved or switched, not per call: editing the config later does
    nothing until a switch method (which also validates) is called."""
    model = modeling.Qwen3_5FusedForCausalLM(fused_text_config())
    model.config.cuda_graphs = False
    assert model.fused_plan.cuda_graphs is True
    assert model.set_cuda_graphs(False).fused_plan.cuda_graphs is False and model.config.cuda_graphs is False
    with pytest.raises(ValueError, match="cuda_graphs"):
        model.set_cuda_graphs("off")


@pytest.mark.parametrize("var", ["QWEN3_5_FUSED_KERNELS", "QWEN3_5_CUDA_GRAPHS"])
def test_environment_values_are_validated_at_load(monkeypatch, tmp_path, var):
    _, fused = stock_and_fused_lm(fused_kernels=True)
    fused.save_pretrained(tmp_path)
    monkeypatch.setenv(var, "maybe")
    with pytest.raises(ValueError, match=f"{var}='maybe'.*1 or 0"):
        stock_and_fused_lm()
    with pytest.raises(ValueError, match=f"{var}='maybe'"):
        modeling.Qwen3_5FusedForCausalLM.from_pretrained(tmp_path)


def test_from_pretrained_kwarg_override(tmp_path):
    _, fused = stock_and_fused_lm(fused_kernels=True)
    fused.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["fused_kernels"] is True  # the file is not edited
    off = modeling.Qwen3_5FusedForCausalLM.from_pretrained(tmp_path, fused_kernels=False)
    assert off.config.fused_kernels is False and not off.fused_plan.fused_kernels
    assert json.loads((tmp_path / "config.json").read_text())["fused_kernels"] is True
    with pytest.raises(ValueError, match="fused_kernels"):
        modeling.Qwen3_5FusedForCausalLM.from_pretrained(tmp_path, fused_kernels="no")


def test_composite_switch_reaches_text_backbone():
    config = configuration.Qwen3_5FusedConfig(**composite_kwargs(), fused_kernels=True)
    config.text_config.fused_kernels = False  # the composite switch is the one that counts
    model = modeling.Qwen3_5FusedForConditionalGeneration(config)
    assert model.model.language_model.layers[0].mlp.plan.fused_kernels is True
    model.set_fused_kernels(False)
    assert model.config.text_config.fused_kernels is False
    assert model.model.language_model.layers[0].mlp.plan.fused_kernels is False


def test_other_model_type_is_refused(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="model_type='llama'"):
        modeling.Qwen3_5FusedForCausalLM.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="model_type='llama'"):
        modeling.Qwen3_5FusedForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1))


def test_wrong_config_type_for_model_is_refused():
    with pytest.raises((ValueError, TypeError, AttributeError)):
        modeling.Qwen3_5FusedForCausalLM({"model_type": "qwen3_5_text"})
