# Copyright 2026 The Qwen3.5 fused-kernels authors. Licensed under the Apache License, Version 2.0.
"""pytest plugin (`-p fused_substitute`): runs transformers' own Qwen3.5 tests with the fused classes in place of the
stock ones.

Loaded before the upstream test module is imported, it:

- sets the names that module imports from `transformers` to the fused classes (`Qwen3_5ForCausalLM` ->
  `Qwen3_5FusedForCausalLM`, `Qwen3_5TextModel` -> `Qwen3_5FusedTextModel`, `Qwen3_5Model` -> `Qwen3_5FusedModel`,
  `Qwen3_5ForConditionalGeneration` -> `Qwen3_5FusedForConditionalGeneration`) and the two config names to subclasses
  of the fused configs whose only change is the default `fused_kernels=True`. The sequence / token classification
  heads have no fused counterpart and stay stock.
- with QWEN3_5_SUBSTITUTE_EMULATE=1, runs the fused path's control flow on CPU (see below);
- registers the fused model classes with the Auto classes under the fused config classes, as
  `from_pretrained(..., trust_remote_code=True)` does with a repo's `auto_map` (`AutoModelForCausalLM.register(
  type(config), model_class, exist_ok=True)`), and the configs with `AutoConfig` under their `model_type`: a fused
  model saved by a test and loaded back through `AutoConfig` / `AutoModel*` gets the fused classes, as a saved
  remote-code checkpoint does when loaded with `trust_remote_code=True`.

The repo's code is imported the way the repo's tests import it (`scripts/common.py: import_repo()`), and only by
its public class names. When `QWEN3_5_SUBSTITUTE_REPORT` names a file, the substitutions are written to it as JSON,
so the harness can check that they took effect.
"""

import importlib.util
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
REPORT_ENV = "QWEN3_5_SUBSTITUTE_REPORT"
# QWEN3_5_SUBSTITUTE_EMULATE=1 (the harness sets it without a GPU): on CPU, run the fused control flow with the
# kernels' torch references (the tests' CPU emulation, `fused_plan.EMULATE_ON_CPU`) instead of the stock fallback, as
# the fused path runs on a GPU.
EMULATE_ENV = "QWEN3_5_SUBSTITUTE_EMULATE"

# name imported from `transformers` -> the fused class that replaces it
MODEL_NAMES = {
    "Qwen3_5TextModel": "Qwen3_5FusedTextModel",
    "Qwen3_5ForCausalLM": "Qwen3_5FusedForCausalLM",
    "Qwen3_5Model": "Qwen3_5FusedModel",
    "Qwen3_5ForConditionalGeneration": "Qwen3_5FusedForConditionalGeneration",
}
CONFIG_NAMES = {"Qwen3_5TextConfig": "Qwen3_5FusedTextConfig", "Qwen3_5Config": "Qwen3_5FusedConfig"}
# Auto class -> (composite model class, text-only model class) registered for it; the composite repo's `auto_map`
# (configuration_qwen3_5_fused.AUTO_MAP_COMPOSITE) and the text-only one (AUTO_MAP_TEXT).
AUTO_MODELS = {
    "AutoModel": ("Qwen3_5FusedModel", "Qwen3_5FusedTextModel"),
    "AutoModelForCausalLM": ("Qwen3_5FusedForCausalLMLoader", "Qwen3_5FusedForCausalLM"),
    "AutoModelForImageTextToText": ("Qwen3_5FusedForConditionalGeneration", None),
    "AutoModelForSequenceClassification": ("Qwen3_5FusedForSequenceClassification",
                                           "Qwen3_5FusedTextForSequenceClassification"),
}


def _repo_classes() -> dict:
    """The public classes of the repo's code modules, by name, imported with `scripts/common.py: import_repo()`."""
    spec = importlib.util.spec_from_file_location("qwen3_5_fused_scripts_common", REPO / "scripts" / "common.py")
    common = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(common)
    classes = {}
    for module in common.import_repo():
        for name in getattr(module, "__all__", ()):
            classes.setdefault(name, getattr(module, name))
    return classes


def _fused_on_configs(classes: dict) -> tuple[type, type]:
    """Subclasses of the fused configs that default to `fused_kernels=True`, keeping the fused class names."""
    base_text, base_composite = classes["Qwen3_5FusedTextConfig"], classes["Qwen3_5FusedConfig"]
    text = type(base_text.__name__, (base_text,), {
        "__module__": __name__, "__annotations__": {"fused_kernels": bool}, "fused_kernels": True,
    })
    # transformers >= 5.2x resolves sub-configs through `sub_configs_defaults`; older 5.x through `sub_configs`.
    key = "sub_configs_defaults" if "sub_configs_defaults" in vars(base_composite) else "sub_configs"
    namespace = {"__module__": __name__, "__annotations__": {"fused_kernels": bool}, "fused_kernels": True,
                 key: {**vars(base_composite)[key], "text_config": text}}
    composite = type(base_composite.__name__, (base_composite,), namespace)
    return text, composite


def _install(replacements: dict) -> None:
    """Make `from transformers import NAME` return `replacements[NAME]`.

    Setting the attribute on `sys.modules["transformers"]` is not enough: transformers' lazy top-level module gets
    replaced by a fresh one whenever something runs `direct_transformers_import` on the package (importing fla does,
    and so does the upstream `tests/test_pipeline_mixin.py`, which `causal_lm_tester.py` imports before the Qwen3.5
    test module imports its classes). A fresh lazy module resolves each name once, through its class's
    `__getattr__`, so the replacements are answered there too."""
    lazy_module = type(sys.modules["transformers"])
    resolve = lazy_module.__getattr__

    def __getattr__(self, name):
        if self.__name__ == "transformers" and name in replacements:
            return replacements[name]
        return resolve(self, name)

    lazy_module.__getattr__ = __getattr__
    for name, value in replacements.items():
        setattr(sys.modules["transformers"], name, value)


def substitute() -> dict:
    """Put the fused classes in place of the stock ones and register them with the Auto classes; returns
    {transformers name: qualified name of what now stands there}."""
    import transformers

    classes = _repo_classes()
    if os.environ.get(EMULATE_ENV) == "1":
        package = classes["Qwen3_5FusedTextModel"].__module__.rpartition(".")[0]
        importlib.import_module(f"{package}.fused_plan").EMULATE_ON_CPU = True
    text_config, composite_config = _fused_on_configs(classes)
    replacements = {"Qwen3_5TextConfig": text_config, "Qwen3_5Config": composite_config}
    replacements.update({name: classes[fused] for name, fused in MODEL_NAMES.items()})
    # The upstream tester infers the classes it is not given by name from the base class's name, looking them up in
    # `transformers` (`Qwen3_5FusedTextModel` -> `transformers.Qwen3_5FusedTextConfig`): the fused names answer too.
    replacements.update({text_config.__name__: text_config, composite_config.__name__: composite_config})
    replacements.update({fused: classes[fused] for fused in MODEL_NAMES.values()})
    _install(replacements)
    done = {name: f"{cls.__module__}.{cls.__qualname__}" for name, cls in replacements.items()}

    for config in (text_config, composite_config):
        transformers.AutoConfig.register(config.model_type, config, exist_ok=True)
    for auto_name, (composite_model, text_model) in AUTO_MODELS.items():
        auto = getattr(transformers, auto_name)
        for config_classes, model in (
            ((classes["Qwen3_5FusedConfig"], composite_config), composite_model),
            ((classes["Qwen3_5FusedTextConfig"], text_config), text_model),
        ):
            if model is not None:
                for config in config_classes:
                    auto.register(config, classes[model], exist_ok=True)
                done[f"{auto_name}[{config_classes[0].__name__}]"] = model
    return done


def pytest_configure(config):
    done = substitute()
    report = os.environ.get(REPORT_ENV)
    if report:
        Path(report).write_text(json.dumps(done, indent=1))
