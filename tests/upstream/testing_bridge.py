# Copyright 2026 The Qwen3.5 fused-kernels authors. Licensed under the Apache License, Version 2.0.
"""pytest plugin (`-p testing_bridge`) for both upstream runs: what the assembled upstream tests (transformers
v5.24.0's `tests/test_modeling_common.py` and helpers) import and the installed packages no longer provide, so that
the file collects on every version the suite supports (transformers 5.17 to 5.25+, huggingface_hub 1.x and 2.x).
A name the installed version defines is left as it is; each stand-in below does what the upstream tests use it for.
"""

import contextlib
import importlib.util
import sys

# huggingface_hub 2.x moved from httpx to its fork httpx2 (and re-exports it as `huggingface_hub.utils.httpx`);
# the upstream test helpers import `httpx` itself (tests/utils/test_configuration_utils.py), which is then absent.
if importlib.util.find_spec("httpx") is None:
    from huggingface_hub.utils import httpx as _hub_http

    sys.modules["httpx"] = _hub_http

import transformers.testing_utils as _tu  # noqa: E402 - after the httpx alias


def _unavailable(name: str):
    def call(*args, **kwargs):
        raise NotImplementedError(f"{name} is not in this transformers (the upstream tests are 5.24's)")

    return call


def _module_unless_present(name: str, **attrs) -> None:
    """``name`` importable: the installed one when it exists, else a module holding ``attrs``."""
    import types

    try:
        present = importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        present = False
    if not present:
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        sys.modules[name] = module


# Modules of transformers 5.24 the upstream helpers import at module level, which 5.17 lays out otherwise:
# the FSDP mixin's checkpoint helpers (its tests skip Qwen3.5), and the parameter-plan lookup of the tensor-parallel
# checks (5.17: `distributed.tensor_parallel._get_parameter_tp_plan`, the same function under another name).
_module_unless_present(
    "transformers.distributed.checkpoint",
    **{fn: _unavailable(f"transformers.distributed.checkpoint.{fn}")
       for fn in ("load_optimizer_distributed", "save_optimizer_distributed")},
)
try:
    from transformers.distributed.tensor_parallel import _get_parameter_tp_plan as _parameter_plan
except ImportError:
    _parameter_plan = _unavailable("transformers.distributed.parallel_utils._get_parameter_plan")
_module_unless_present("transformers.distributed.parallel_utils", _get_parameter_plan=_parameter_plan)


def require_flex_attention(test_case):
    """Skip the test unless torch has FlexAttention (5.24's decorator; 5.17 lacks it)."""
    import unittest

    from transformers.utils import is_torch_flex_attn_available

    return unittest.skipUnless(is_torch_flex_attn_available(), "test requires FlexAttention")(test_case)

_UNSET = object()


@contextlib.contextmanager
def preserve_module_forwards(model):
    """Undo what `kernelize` does inside the block: it routes a module (or a function-holding module listed in its
    `_kernel_funcs`) to a Hub kernel through an instance attribute `forward`; on exit each of them gets back the
    instance `forward` it had (usually none). Removed from `transformers.testing_utils` in 5.25."""
    targets = []
    for module in model.modules():
        targets.append(module)
        targets.extend(getattr(module, "_kernel_funcs", {}).values())
    saved = [(m, m.__dict__.get("forward", _UNSET)) for m in targets if hasattr(m, "__dict__")]
    try:
        yield
    finally:
        for m, forward in saved:
            if forward is _UNSET:
                m.__dict__.pop("forward", None)
            else:
                m.__dict__["forward"] = forward


# Devices locked to the process that opens them, which the tensor-parallel and FSDP mixins skip subprocess tests on
# (added in 5.24; those mixins skip Qwen3.5 anyway).
SINGLE_PROCESS_DEVICES = {"tpu"}

for _name, _value in {"preserve_module_forwards": preserve_module_forwards,
                      "SINGLE_PROCESS_DEVICES": SINGLE_PROCESS_DEVICES,
                      "require_flex_attention": require_flex_attention}.items():
    if not hasattr(_tu, _name):
        setattr(_tu, _name, _value)
