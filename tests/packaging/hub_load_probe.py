"""Run in a subprocess with HF_HUB_OFFLINE=1 and a prepared cache: load each repo id with and without
trust_remote_code and print one JSON line per pair, in order, with what came back (one process for several repos: a
fresh interpreter costs more than the loads); a load that raises gives {"error": its traceback}. Usage:
hub_load_probe.py REPO_ID AUTO_CLASS [REPO_ID AUTO_CLASS ...]"""

import json
import sys
import traceback
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from scripts.common import import_module  # noqa: E402


def stock_cpu_forward(model, ids):
    """Stock Qwen3.5 + fla crashes on CPU tensors; route its DeltaNet helpers to torch for the reference."""
    with import_module("fused_compat").torch_reference_kernels():
        return model(input_ids=ids).logits


def _importable(name: str) -> bool:
    try:
        __import__(name)
        return True
    except ImportError:
        return False


# what this process could import (a test hides triton and fla, as on a machine without them)
IMPORTABLE = {name: _importable(name) for name in ("triton", "fla")}


def probe(repo_id: str, auto_name: str) -> dict:
    auto = getattr(transformers, auto_name)
    result = {}
    ids = torch.tensor([[5, 17, 42, 9, 77, 3, 11]])
    for trust in (True, False):
        model, info = auto.from_pretrained(repo_id, trust_remote_code=trust, output_loading_info=True,
                                           dtype=torch.float32)
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=ids).logits if trust else stock_cpu_forward(model, ids)
        result[str(trust)] = {
            "class": type(model).__name__,
            "module": type(model).__module__,
            "missing": sorted(info["missing_keys"]),
            "unexpected": sorted(info["unexpected_keys"]),
            "mismatched": [list(map(str, m)) for m in info.get("mismatched_keys", [])],
            "fused_kernels": getattr(model.config, "fused_kernels", None),
            "logits": logits[0, -1, :16].tolist(),
            # the feed-forward kind: "mlp" (dense) or "moe"
            "describe": (next(v for k, v in model.describe()["layers"].items() if k in ("mlp", "moe"))
                         if trust else None),
        }
    result["importable"] = IMPORTABLE
    return result


for repo_id, auto_name in zip(sys.argv[1::2], sys.argv[2::2]):
    try:
        result = probe(repo_id, auto_name)
    except Exception:  # a repo that must fail to load (a test's broken copy): its traceback is its result
        result = {"error": traceback.format_exc()}
    print("RESULT " + json.dumps(result), flush=True)
