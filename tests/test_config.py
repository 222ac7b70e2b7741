"""Configs: switches, validation, overrides (kwarg and environment), model types, bad checkpoints."""

import json

import pytest
import torch

from helpers import composite_kwargs, configuration, fused_text_config, modeling, stock_and_fused_lm
from scripts.common import tiny_text_kwargs


def test_defaults_and_stock_model_types():
    text = configuration.Qwen3_5FusedTextConfig(**tiny_text_kwargs())
    assert text.fused_kernels is False and text.cuda_graphs is True
    assert text.model_type == "qwen3_5_text"
    comp = configuration.Qwen3_5FusedConfig(**composite_kwargs())
    assert comp.model_type == "qwen3_5" and comp.fused_kernels is False
    assert isinstance(comp.text_config, configuration.Qwen3_5FusedTextConfig)
    d = comp.to_dict()
    assert d["model_type"] == "qwen3_5" and d["text_config"]["model_type"] == "qwen3_5_text"


@pytest.mark.parametrize("bad", ["yes", "true", 1, 0, None, 1.0, [True]], ids=repr)
@pytest.mark.parametrize("name", ["fused_kernels", "cuda_graphs"])
def test_invalid_switch_values_name_the_value(name, bad):
    with pytest.raises(ValueError) as err:
        configuration.Qwen3_5FusedTextConfig(**tiny_text_kwargs(), **{name: bad})
    assert name in str(err.value) and repr(bad) in str(err.value) and "True or False" in str(err.value)
    with pytest.raises(ValueError, match=name):
        configuration.Qwen3_5FusedConfig(**composite_kwargs(), **{name: bad})


def test_invalid_value_set_after_init_is_caught_at_model_build():
    config = fused_text_config()
    config.fused_kernels = "fast"
    with pytest.raises(ValueError, match="'fast'"):
        modeling.Qwen3_5FusedForCausalLM(config)


@pytest.mark.parametrize("raw,expected", [("0", False), ("1", True), ("false", False), ("ON", True), ("", None)])
def test_environment_override(monkeypatch, raw, expected):
    monkeypatch.setenv("QWEN3_5_FUSED_KERNELS", raw)
    _, fused = stock_and_fused_lm(fused_kernels=True)
    want = True if expected is None else expected
    assert fused.model.layers[0].mlp._fused_enabled is want
    assert fused.describe()["fused_kernels"] is want


def test_environment_override_rejects_garbage(monkeypatch):
    monkeypatch.setenv("QWEN3_5_FUSED_KERNELS", "maybe")
    with pytest.raises(ValueError, match="QWEN3_5_FUSED_KERNELS='maybe'"):
        stock_and_fused_lm()


def test_from_pretrained_kwarg_override(tmp_path):
    _, fused = stock_and_fused_lm(fused_kernels=True)
    fused.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["fused_kernels"] is True  # the file is not edited
    off = modeling.Qwen3_5FusedForCausalLM.from_pretrained(tmp_path, fused_kernels=False)
    assert off.config.fused_kernels is False and not off.model.layers[0].mlp._fused_enabled
    assert json.loads((tmp_path / "config.json").read_text())["fused_kernels"] is True
    with pytest.raises(ValueError, match="fused_kernels"):
        modeling.Qwen3_5FusedForCausalLM.from_pretrained(tmp_path, fused_kernels="no")


def test_composite_switch_reaches_text_backbone():
    config = configuration.Qwen3_5FusedConfig(**composite_kwargs(), fused_kernels=True)
    config.text_config.fused_kernels = False  # the composite switch is the one that counts
    model = modeling.Qwen3_5FusedForConditionalGeneration(config)
    assert model.model.language_model.layers[0].mlp._fused_enabled is True
    model.set_fused_kernels(False)
    assert model.config.text_config.fused_kernels is False
    assert model.model.language_model.layers[0].mlp._fused_enabled is False


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
