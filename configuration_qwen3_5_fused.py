"""Configuration for the fused Qwen3.5 remote-code model.

The classes subclass the stock transformers Qwen3.5 configs and keep their ``model_type`` values (``qwen3_5`` and
``qwen3_5_text``), so a checkpoint written with them still loads as a stock Qwen3.5 model (and in vLLM / SGLang)
when ``trust_remote_code`` is not given. They add two switches:

- ``fused_kernels`` (bool): run the fused inference kernels where they cover the call. Off by default in the
  class; the repo's ``config.json`` turns it on.
- ``cuda_graphs`` (bool): capture the fused single-token decode step and the no-cache forward (per length bucket)
  in CUDA graphs (used only when ``fused_kernels`` is on and the model runs on a GPU).

Both can be overridden without editing files: ``from_pretrained(repo, trust_remote_code=True, fused_kernels=False)``
or the environment variables ``QWEN3_5_FUSED_KERNELS`` / ``QWEN3_5_CUDA_GRAPHS`` (``0``/``1``), which win over the
config when set.
"""

import os

from transformers.models.qwen3_5.configuration_qwen3_5 import (
    Qwen3_5Config,
    Qwen3_5TextConfig,
    Qwen3_5VisionConfig,
)

FUSED_KERNELS_ENV = "QWEN3_5_FUSED_KERNELS"
CUDA_GRAPHS_ENV = "QWEN3_5_CUDA_GRAPHS"
SWITCHES = {"fused_kernels": FUSED_KERNELS_ENV, "cuda_graphs": CUDA_GRAPHS_ENV}
_ENV_TRUE = ("1", "true", "yes", "on")
_ENV_FALSE = ("0", "false", "no", "off")


# `auto_map` entries of a repo that ships this code, by checkpoint layout. Composite (vision-language) repos, the
# layout of real Qwen3.5 checkpoints, map AutoModelForCausalLM to a loader that builds the text-only causal LM, as
# stock transformers does for its own classes.
AUTO_MAP_TEXT = {
    "AutoConfig": "configuration_qwen3_5_fused.Qwen3_5FusedTextConfig",
    "AutoModel": "modeling_qwen3_5_fused.Qwen3_5FusedTextModel",
    "AutoModelForCausalLM": "modeling_qwen3_5_fused.Qwen3_5FusedForCausalLM",
}
AUTO_MAP_COMPOSITE = {
    "AutoConfig": "configuration_qwen3_5_fused.Qwen3_5FusedConfig",
    "AutoModel": "modeling_qwen3_5_fused.Qwen3_5FusedModel",
    "AutoModelForCausalLM": "modeling_qwen3_5_fused.Qwen3_5FusedForCausalLMLoader",
    "AutoModelForImageTextToText": "modeling_qwen3_5_fused.Qwen3_5FusedForConditionalGeneration",
}


def check_switch(name: str, value) -> bool:
    """Return ``value`` if it is a bool, else raise ``ValueError`` naming the switch, the value and what is allowed."""
    if isinstance(value, bool):
        return value
    raise ValueError(f"`{name}` must be True or False, got {value!r} ({type(value).__name__}).")


def env_switch(name: str) -> bool | None:
    """The value of the environment override for switch ``name``, or None when the variable is unset or empty."""
    var = SWITCHES[name]
    raw = os.environ.get(var, "").strip().lower()
    if not raw:
        return None
    if raw in _ENV_TRUE:
        return True
    if raw in _ENV_FALSE:
        return False
    raise ValueError(f"Environment variable {var}={os.environ[var]!r} is not understood; use 0 or 1.")


def resolve_switch(config, name: str) -> bool:
    """The effective value of a switch: the environment override when set, else the (validated) config value."""
    from_env = env_switch(name)
    if from_env is not None:
        return from_env
    return check_switch(name, getattr(config, name, False))


def _validate(config) -> None:
    for name in SWITCHES:
        check_switch(name, getattr(config, name))


class Qwen3_5FusedTextConfig(Qwen3_5TextConfig):
    """Stock ``Qwen3_5TextConfig`` plus the ``fused_kernels`` and ``cuda_graphs`` switches."""

    model_type = "qwen3_5_text"

    fused_kernels: bool = False
    cuda_graphs: bool = True

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        _validate(self)

    def validate(self):
        _validate(self)
        return super().validate() if hasattr(super(), "validate") else None


class Qwen3_5FusedConfig(Qwen3_5Config):
    """Stock composite ``Qwen3_5Config`` (vision tower + text backbone) plus the fused switches.

    The switches live on the composite config; the text backbone reads them from here (they are copied into
    ``text_config`` when the model is built).
    """

    model_type = "qwen3_5"
    # transformers >= 5.2x resolves sub-configs through `sub_configs_defaults`; older 5.x through `sub_configs`.
    if "sub_configs_defaults" in vars(Qwen3_5Config):
        sub_configs_defaults = {"vision_config": Qwen3_5VisionConfig, "text_config": Qwen3_5FusedTextConfig}
    else:
        sub_configs = {"vision_config": Qwen3_5VisionConfig, "text_config": Qwen3_5FusedTextConfig}

    fused_kernels: bool = False
    cuda_graphs: bool = True

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        _validate(self)


__all__ = ["Qwen3_5FusedConfig", "Qwen3_5FusedTextConfig", "AUTO_MAP_TEXT", "AUTO_MAP_COMPOSITE"]
