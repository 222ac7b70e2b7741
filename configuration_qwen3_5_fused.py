# Copyright 2026 The Qwen3.5 fused-kernels authors. Licensed under the Apache License, Version 2.0.
"""Configuration for the fused Qwen3.5 remote-code model.

The classes subclass the stock transformers Qwen3.5 configs (dense and MoE) and keep their ``model_type`` values
(``qwen3_5``, ``qwen3_5_text``, ``qwen3_5_moe``, ``qwen3_5_moe_text``), so a checkpoint written with them still loads as
a stock Qwen3.5 model (and in vLLM / SGLang) when ``trust_remote_code`` is not given. They add two switches:

- ``fused_kernels`` (bool, or None for "not set"): run the fused inference kernels where they cover the call. Unset
  in the class (stock behaviour); the repo's ``config.json`` turns it on.
- ``cuda_graphs`` (bool, default True): capture the fused decode step, the prompt and the no-cache forward (per
  length bucket) in CUDA graphs (used only when the fused kernels run on a GPU).

Precedence, one rule for both: **an explicit False wins**, from the config (``config.json``, ``from_pretrained(...,
fused_kernels=False)``, ``set_fused_kernels(False)``) or from the environment (``QWEN3_5_FUSED_KERNELS=0`` /
``QWEN3_5_CUDA_GRAPHS=0``). Otherwise an explicit True from either turns the switch on, and an unset switch keeps
its default. The environment variables accept 1/0, true/false, yes/no, on/off (or empty: unset); anything else is
refused when the model is built. :func:`resolve_switches` is the only place the environment is read.
"""

import os
import re

from transformers.models.qwen3_5.configuration_qwen3_5 import (
    Qwen3_5Config,
    Qwen3_5TextConfig,
    Qwen3_5VisionConfig,
)
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import (
    Qwen3_5MoeConfig,
    Qwen3_5MoeTextConfig,
    Qwen3_5MoeVisionConfig,
)

FUSED_KERNELS_ENV = "QWEN3_5_FUSED_KERNELS"
CUDA_GRAPHS_ENV = "QWEN3_5_CUDA_GRAPHS"
SWITCHES = {"fused_kernels": FUSED_KERNELS_ENV, "cuda_graphs": CUDA_GRAPHS_ENV}
_ENV_TRUE = ("1", "true", "yes", "on")
_ENV_FALSE = ("0", "false", "no", "off")
DEFAULTS = {"fused_kernels": False, "cuda_graphs": True}


# `auto_map` entries of a repo that ships this code, by checkpoint layout. Composite (vision-language) repos, the
# layout of real Qwen3.5 checkpoints, map AutoModelForCausalLM to a loader that builds the text-only causal LM, as
# stock transformers does for its own classes.
AUTO_MAP_TEXT = {
    "AutoConfig": "configuration_qwen3_5_fused.Qwen3_5FusedTextConfig",
    "AutoModel": "modeling_qwen3_5_fused.Qwen3_5FusedTextModel",
    "AutoModelForCausalLM": "modeling_qwen3_5_fused.Qwen3_5FusedForCausalLM",
    "AutoModelForSequenceClassification": "modeling_qwen3_5_fused.Qwen3_5FusedTextForSequenceClassification",
}
AUTO_MAP_COMPOSITE = {
    "AutoConfig": "configuration_qwen3_5_fused.Qwen3_5FusedConfig",
    "AutoModel": "modeling_qwen3_5_fused.Qwen3_5FusedModel",
    "AutoModelForCausalLM": "modeling_qwen3_5_fused.Qwen3_5FusedForCausalLMLoader",
    "AutoModelForImageTextToText": "modeling_qwen3_5_fused.Qwen3_5FusedForConditionalGeneration",
    "AutoModelForSequenceClassification": "modeling_qwen3_5_fused.Qwen3_5FusedForSequenceClassification",
}
# The same for the MoE models (Qwen3.5-35B-A3B, ...).
AUTO_MAP_MOE_TEXT = {
    "AutoConfig": "configuration_qwen3_5_fused.Qwen3_5MoeFusedTextConfig",
    "AutoModel": "modeling_qwen3_5_fused.Qwen3_5MoeFusedTextModel",
    "AutoModelForCausalLM": "modeling_qwen3_5_fused.Qwen3_5MoeFusedForCausalLM",
}
AUTO_MAP_MOE_COMPOSITE = {
    "AutoConfig": "configuration_qwen3_5_fused.Qwen3_5MoeFusedConfig",
    "AutoModel": "modeling_qwen3_5_fused.Qwen3_5MoeFusedModel",
    "AutoModelForCausalLM": "modeling_qwen3_5_fused.Qwen3_5MoeFusedForCausalLMLoader",
    "AutoModelForImageTextToText": "modeling_qwen3_5_fused.Qwen3_5MoeFusedForConditionalGeneration",
}


def check_switch(name: str, value, allow_unset: bool = False) -> bool | None:
    """Return ``value`` if it is a bool (or None with ``allow_unset``), else raise ``ValueError`` naming the switch,
    the value and what is allowed."""
    if isinstance(value, bool) or (allow_unset and value is None):
        return value
    allowed = "True, False or None (unset)" if allow_unset else "True or False"
    raise ValueError(f"`{name}` must be {allowed}, got {value!r} ({type(value).__name__}).")


def env_switch(name: str) -> bool | None:
    """The value of the environment override for switch ``name``, or None when the variable is unset or empty;
    ``ValueError`` naming the variable, its value and the accepted values otherwise."""
    var = SWITCHES[name]
    raw = os.environ.get(var, "").strip().lower()
    if not raw:
        return None
    if raw in _ENV_TRUE:
        return True
    if raw in _ENV_FALSE:
        return False
    raise ValueError(
        f"Environment variable {var}={os.environ[var]!r} is not understood; set it to 1 or 0 (or unset it)."
    )


def resolve_switch(config, name: str) -> bool:
    """The effective value of a switch (see the module docstring): an explicit False from the config or the
    environment wins, then an explicit True from either, then the default (``fused_kernels`` off, ``cuda_graphs``
    on)."""
    from_config = check_switch(name, getattr(config, name, None), allow_unset=True)
    from_env = env_switch(name)
    if False in (from_config, from_env):
        return False
    if True in (from_config, from_env):
        return True
    return DEFAULTS[name]


def resolve_switches(config) -> dict[str, bool]:
    """Both switches, resolved (validates both environment variables)."""
    return {name: resolve_switch(config, name) for name in SWITCHES}


def stock_architectures(names) -> list[str] | None:
    """The stock class names for ``architectures`` (``Qwen3_5FusedForCausalLM`` -> ``Qwen3_5ForCausalLM``,
    ``Qwen3_5MoeFusedForConditionalGeneration`` -> ``Qwen3_5MoeForConditionalGeneration``, ...): a saved repo names the
    classes stock transformers, vLLM and SGLang know; ``auto_map`` names ours."""
    if names is None:
        return None
    return [re.sub(r"^(Qwen3_5(?:Moe)?)Fused", r"\1", name).removesuffix("Loader") for name in names]


class _FusedConfigMixin:
    """What every fused config adds to its stock class: the switches validated when built, and a save that writes
    stock ``architectures`` and this repo's ``auto_map`` (``_fused_auto_map``; entries for other Auto classes the user
    added are kept). The switch fields themselves are declared on each config class (transformers' config dataclass
    reads fields from the config classes, not from a mixin)."""

    _auto_class = "AutoConfig"  # saving copies this file (and what it imports) next to config.json
    _fused_auto_map = {}  # auto_map entries a save writes (each config class names its own)

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        _validate(self)

    def save_pretrained(self, save_directory, *args, **kwargs):
        self.architectures = stock_architectures(getattr(self, "architectures", None))
        self.auto_map = {**(getattr(self, "auto_map", None) or {}), **self._fused_auto_map}
        return super().save_pretrained(save_directory, *args, **kwargs)


def _validate(config) -> None:
    for name in SWITCHES:
        check_switch(name, getattr(config, name), allow_unset=True)


class _FusedTextConfigMixin(_FusedConfigMixin):
    def validate(self):
        _validate(self)
        return super().validate() if hasattr(super(), "validate") else None


class Qwen3_5FusedTextConfig(_FusedTextConfigMixin, Qwen3_5TextConfig):
    """Stock ``Qwen3_5TextConfig`` plus the ``fused_kernels`` and ``cuda_graphs`` switches."""

    model_type = "qwen3_5_text"
    _fused_auto_map = AUTO_MAP_TEXT

    fused_kernels: bool | None = None
    cuda_graphs: bool | None = True


class Qwen3_5FusedConfig(_FusedConfigMixin, Qwen3_5Config):
    """Stock composite ``Qwen3_5Config`` (vision tower + text backbone) plus the fused switches.

    The switches live on the composite config; the text backbone reads them from here (they are copied into
    ``text_config`` when the model is built).
    """

    model_type = "qwen3_5"
    _fused_auto_map = AUTO_MAP_COMPOSITE
    # transformers >= 5.2x resolves sub-configs through `sub_configs_defaults`; older 5.x through `sub_configs`.
    if "sub_configs_defaults" in vars(Qwen3_5Config):
        sub_configs_defaults = {"vision_config": Qwen3_5VisionConfig, "text_config": Qwen3_5FusedTextConfig}
    else:
        sub_configs = {"vision_config": Qwen3_5VisionConfig, "text_config": Qwen3_5FusedTextConfig}

    fused_kernels: bool | None = None
    cuda_graphs: bool | None = True


class Qwen3_5MoeFusedTextConfig(_FusedTextConfigMixin, Qwen3_5MoeTextConfig):
    """Stock ``Qwen3_5MoeTextConfig`` (the MoE text backbone) plus the ``fused_kernels`` and ``cuda_graphs``
    switches."""

    model_type = "qwen3_5_moe_text"
    _fused_auto_map = AUTO_MAP_MOE_TEXT

    fused_kernels: bool | None = None
    cuda_graphs: bool | None = True


class Qwen3_5MoeFusedConfig(_FusedConfigMixin, Qwen3_5MoeConfig):
    """Stock composite ``Qwen3_5MoeConfig`` plus the fused switches (copied into ``text_config`` when the model is
    built, as for the dense composite)."""

    model_type = "qwen3_5_moe"
    _fused_auto_map = AUTO_MAP_MOE_COMPOSITE
    if "sub_configs_defaults" in vars(Qwen3_5MoeConfig):  # as the dense composite above
        sub_configs_defaults = {"vision_config": Qwen3_5MoeVisionConfig, "text_config": Qwen3_5MoeFusedTextConfig}
    else:
        sub_configs = {"vision_config": Qwen3_5MoeVisionConfig, "text_config": Qwen3_5MoeFusedTextConfig}

    fused_kernels: bool | None = None
    cuda_graphs: bool | None = True


__all__ = [
    "Qwen3_5FusedConfig", "Qwen3_5FusedTextConfig", "Qwen3_5MoeFusedConfig", "Qwen3_5MoeFusedTextConfig",
    "AUTO_MAP_TEXT", "AUTO_MAP_COMPOSITE", "AUTO_MAP_MOE_TEXT", "AUTO_MAP_MOE_COMPOSITE",
]
