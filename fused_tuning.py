# Copyright 2026 The Qwen3.5 fused-kernels authors. Licensed under the Apache License, Version 2.0.
"""Kernel choices measured ahead of time on named cards, shipped with the model (`fused_tuned_choices.TUNED`,
written by `scripts/record_tuning.py`), so that a fresh machine's first call compiles one kernel per choice
instead of every candidate.

Why: on an empty Triton cache the first 4B `generate` took 48.2 s on the H200 without this table (12-15 s with
it; 2026-12-02 and 12-03, docs/BENCHMARKS.md "A fresh machine"): fla's autotuning compiled 34 configs of its chunked
DeltaNet kernels one after another (about 30 s; stock pays it too) and `small_linear` compiled 42 GEMV candidates to
time them. Both are choices a card makes the same way every time, so the card's choices travel with the code:

- `shipped_choices(device, candidates, pdl)`: the decode linears' choices (`fused_ops_gemv.small_linear`) for
  `device`'s card, in the per-card record's format, read after the card's own record and before timing;
- `seed_fla_autotuners(device)`: fla's autotuners get the card's recorded config for each recorded tuning key (a
  key they already hold is kept); a call with another key (other head counts, dtype) autotunes as before.

Only an entry for the same card name and compute capability is used; the fla part also needs the fla minor version
it was recorded with and stays off when the user turned fla's own config cache on (``FLA_CACHE_MODE``). Nothing
here changes a result beyond the choice of tile sizes a timing run would make (the same kernels run).
`USE_SHIPPED = False` turns the table off (`scripts/record_tuning.py` does, to time everything afresh).
"""

import importlib
import logging
import os

import torch

from .fused_tuned_choices import TUNED

USE_SHIPPED = True

logger = logging.getLogger(__name__)
_seeded: set = set()  # card names whose fla autotuners were seeded in this process


def card_entry(device: torch.device) -> dict | None:
    """`TUNED`'s entry for `device`'s card (same name and compute capability), or None."""
    if not USE_SHIPPED or device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    entry = TUNED.get(props.name)
    if entry is None or tuple(entry.get("capability", ())) != (props.major, props.minor):
        return None
    return entry


def shipped_choices(device: torch.device, candidates: str, pdl: bool) -> dict:
    """The decode linears' choices recorded for `device`'s card ({record key: choice as JSON}, the format of
    `fused_ops_gemv`'s per-card record), when they were timed over the same candidate list (`candidates`, its
    fingerprint) and PDL setting; else {}."""
    entry = card_entry(device)
    linears = (entry or {}).get("small_linear") or {}
    if linears.get("candidates") != candidates or linears.get("pdl") != pdl:
        return {}
    return linears.get("choices", {})


def _autotuner(name: str):
    """The Triton autotuner `module:attribute` names (through `triton.heuristics` wrappers), or None."""
    module, _, attr = name.partition(":")
    try:  # (in a try: transformers' import check of remote code skips it, so a machine without triton loads)
        from triton.runtime.autotuner import Autotuner

        obj = getattr(importlib.import_module(module), attr)
    except Exception:  # noqa: BLE001 - no triton, or a renamed fla kernel: it autotunes as usual
        return None
    for _ in range(4):
        if isinstance(obj, Autotuner):
            return obj
        obj = getattr(obj, "fn", None)
    return None


def _same_config(config, saved: dict) -> bool:
    return (config.kwargs == saved["kwargs"] and config.num_warps == saved["num_warps"]
            and config.num_stages == saved["num_stages"])


def fla_versions_match(recorded: str | None) -> bool:
    """Whether the installed fla has the major.minor version `recorded`."""
    try:
        import fla
    except Exception:  # noqa: BLE001 - no fla: nothing to seed
        return False
    return recorded is not None and fla.__version__.split(".")[:2] == recorded.split(".")[:2]


def seed_fla_autotuners(device: torch.device) -> int:
    """Once per process and card: put the card's recorded fla configs into fla's autotuners (see the module
    docstring). Returns how many tuning keys were seeded (0 when there is nothing to do)."""
    entry = card_entry(device)
    flas = (entry or {}).get("fla") or {}
    if not flas or entry["name"] in _seeded:
        return 0
    _seeded.add(entry["name"])
    if os.environ.get("FLA_CACHE_MODE", "disabled") != "disabled" or not fla_versions_match(flas.get("version")):
        return 0
    seeded = 0
    for name, rows in flas.get("kernels", {}).items():
        tuner = _autotuner(name)
        if tuner is None:
            continue
        for key, saved in rows:
            config = next((c for c in tuner.configs if _same_config(c, saved)), None)
            if config is not None and tuple(key) not in tuner.cache:
                tuner.cache[tuple(key)] = config
                seeded += 1
    if seeded:
        logger.info("Qwen3.5 fused kernels: fla's autotuning takes the configs measured on %s for %d tuning keys "
                    "(fused_tuned_choices.py; other shapes autotune as usual).", entry["name"], seeded)
    return seeded
