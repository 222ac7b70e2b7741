"""Subprocess probe for the shipped model: load REPO_OR_PATH with AUTO_CLASS, with and without trust_remote_code,
and print the classes and the held-out NLL of both (the recorded evaluation procedure). Usage:
root_repo_probe.py REPO_OR_PATH AUTO_CLASS[,AUTO_CLASS...] WINDOWS [REPO_OR_PATH AUTO_CLASS[,...] WINDOWS ...]

One RESULT line per (target, Auto class), in order (one process for all: a fresh interpreter costs more than the
loads).

WINDOWS: score only the first WINDOWS held-out windows (a quicker check that both load the same model; the recorded
NLL is over all of them); `FUSED,STOCK` gives each load its own, `all` meaning every window."""

import importlib.util
import json
import sys
from pathlib import Path

import torch
import transformers

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("train_tiny_model", REPO / "scripts" / "train_tiny_model.py")
tiny = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tiny)

full = (REPO / "data" / "heldout.txt").read_text()
README_PROMPT = "def add(a, b):"


def heldout_text(tokenizer, n: str) -> str:
    if n == "all":
        return full
    # the windows are cut from the token stream: keep the text of the first n
    return tokenizer.decode(tokenizer(full, add_special_tokens=False)["input_ids"][: int(n) * 256])


def probe(target: str, auto_names: list[str], window_spec: list[str]) -> None:
    # trust_remote_code -> "all" or a count of windows
    windows = dict(zip((True, False), window_spec * 2 if len(window_spec) == 1 else window_spec))
    tokenizer = transformers.AutoTokenizer.from_pretrained(target)
    for auto_name in auto_names:
        auto = getattr(transformers, auto_name)
        result = {}
        for trust in (True, False):
            model, info = auto.from_pretrained(target, trust_remote_code=trust, dtype=torch.float32,
                                               output_loading_info=True)
            model.eval()
            with tiny.torch_linear_attention():
                nll = (tiny.heldout_nll(model, tokenizer, heldout_text(tokenizer, windows[trust]))
                       if auto_name == "AutoModelForCausalLM" else None)
            result[str(trust)] = {"class": type(model).__name__, "module": type(model).__module__,
                                  "missing": sorted(info["missing_keys"]),
                                  "unexpected": sorted(info["unexpected_keys"]),
                                  "nll": nll, "fused_kernels": getattr(model.config, "fused_kernels", None)}
            if auto_name == "AutoModelForCausalLM":  # the README's CPU user: plain generate, nothing wrapped
                ids = tokenizer(README_PROMPT, return_tensors="pt")
                with torch.no_grad():
                    out = model.generate(**ids, max_new_tokens=6, do_sample=False)
                result[str(trust)]["generated"] = out[0].tolist()
                if trust:
                    result[str(trust)]["reason"] = model.describe()["layers"]["linear_attention"]["reason"]
        print("RESULT " + json.dumps(result), flush=True)


torch.set_num_threads(1)
args = sys.argv[1:]
if not args or len(args) % 3:
    sys.exit("usage: root_repo_probe.py REPO_OR_PATH AUTO_CLASS[,AUTO_CLASS...] WINDOWS [...]")
for target, autos, window_spec in zip(args[0::3], args[1::3], args[2::3]):
    probe(target, autos.split(","), window_spec.split(","))
