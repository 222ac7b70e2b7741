"""Fidelity of the fused path: fused vs stock transformers on the same inputs and weights.

    # the small trained model shipped in this repo (held-out text in data/heldout.txt)
    python scripts/eval_quality.py --model . --dtype bfloat16 --out out/quality
    # random real-shape models; 35B-A3B is the MoE model (the pair shares its experts: ~73 GB on one H200)
    python scripts/eval_quality.py --shapes 0.8B,4B,35B-A3B --dtype bfloat16 --out out/quality
    # CPU smoke run (CI): the fused classes fall back to stock there, so every number must show exact agreement
    python scripts/eval_quality.py --model . --device cpu --dtype float32 --max-windows 2 --new-tokens 8

Reports per model: relative logit error ||fused - stock|| / ||stock||, top-1 agreement of next-token predictions,
NLL per token of held-out text under each path (trained model only: random weights have no meaningful NLL), and
for greedy generation the first position where the two outputs diverge (None when they never do). Writes
`quality.json` and `quality.md` to --out.
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from scripts.benchmark_latency import build_pair, log, stock_cpu_guard  # noqa: E402
from scripts.common import write_report  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def windows(ids: torch.Tensor, size: int, limit: int | None) -> list[torch.Tensor]:
    out = [ids[i : i + size] for i in range(0, ids.numel() - 1, size) if ids[i : i + size].numel() > 1]
    return out[:limit] if limit else out


def compare_logits(models: dict, batches: list[torch.Tensor], device) -> dict:
    """Relative logit error, top-1 agreement and NLL per token (first token of each window not scored)."""
    num, den, agree, total = 0.0, 0.0, 0, 0
    nll = {name: 0.0 for name in models}
    for ids in batches:
        ids = ids.to(device)[None]
        with torch.inference_mode(), stock_cpu_guard(device):
            logits = {name: m(input_ids=ids).logits.float()[0] for name, m in models.items()}
        s, f = logits["stock"], logits["fused"]
        num += (f.double() - s.double()).norm().item() ** 2
        den += s.double().norm().item() ** 2
        agree += (f.argmax(-1) == s.argmax(-1)).sum().item()
        total += s.shape[0]
        for name, lg in logits.items():
            nll[name] += torch.nn.functional.cross_entropy(lg[:-1], ids[0, 1:], reduction="sum").item()
    scored = sum(b.numel() - 1 for b in batches)
    return {"rel_logit_err": (num / den) ** 0.5, "top1_agreement": agree / total, "positions": total,
            "nll_per_token": {name: v / scored for name, v in nll.items()}}


def greedy_divergence(models: dict, prompt: torch.Tensor, new_tokens: int, device) -> dict:
    outs = {}
    for name, m in models.items():
        with torch.inference_mode(), stock_cpu_guard(device):
            outs[name] = m.generate(input_ids=prompt.to(device)[None], max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                    do_sample=False, pad_token_id=0)[0, prompt.numel():].cpu()
    diff = (outs["stock"] != outs["fused"]).nonzero()
    return {"new_tokens": new_tokens, "first_divergence": int(diff[0]) if diff.numel() else None,
            "stock": outs["stock"].tolist(), "fused": outs["fused"].tolist()}


def evaluate(name, stock, fused, device, text_ids, max_windows, window, new_tokens, seed=0) -> dict:
    models = {"stock": stock, "fused": fused}
    if text_ids is not None:
        batches = windows(text_ids, window, max_windows)
        prompt = text_ids[:32]
    else:
        g = torch.Generator().manual_seed(seed)
        vocab = stock.config.vocab_size
        batches = [torch.randint(0, vocab, (window,), generator=g) for _ in range(max_windows or 4)]
        prompt = batches[0][:32]
    r = {"model": name, "path": fused.describe()["layers"]}
    r.update(compare_logits(models, batches, device))
    r["greedy"] = greedy_divergence(models, prompt, new_tokens, device)
    if text_ids is None:
        r["nll_per_token"] = None  # random weights: no meaningful NLL
    log(f"{name}: rel err {r['rel_logit_err']:.2e}, top-1 agreement {r['top1_agreement']:.4f}, "
        f"first greedy divergence {r['greedy']['first_divergence']}")
    return r


def to_markdown(results: dict) -> str:
    m = results["meta"]
    lines = [f"Run: {m['date']}, {m['device_name']}, torch {m['torch']}, transformers {m['transformers']}, dtype {m['dtype']}",
             f"Command: `{m['command']}`", "",
             "| model | positions | rel. logit error | top-1 agreement | NLL stock | NLL fused | greedy: first divergence / new tokens |",
             "|---|---|---|---|---|---|---|"]
    for r in results["models"]:
        nll = r["nll_per_token"]
        g = r["greedy"]
        lines.append(f"| {r['model']} | {r['positions']} | {r['rel_logit_err']:.2e} | {r['top1_agreement']:.4f} | "
                     + (f"{nll['stock']:.4f} | {nll['fused']:.4f} |" if nll else "- | - |")
                     + f" {g['first_divergence'] if g['first_divergence'] is not None else 'none'} / {g['new_tokens']} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="folder or Hub id (e.g. '.' for the shipped model)")
    p.add_argument("--shapes", default=None,
                   help="comma list of shapes with random weights: 0.8B, 4B, 9B, 27B, 35B-A3B (MoE), tiny, tiny-moe")
    p.add_argument("--text", default=str(REPO / "data" / "heldout.txt"), help="held-out text (for --model)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--max-windows", type=int, default=0, help="0: all windows of the text")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--out", default="out/quality")
    args = p.parse_args(argv)
    if not args.model and not args.shapes:
        p.error("give --model and/or --shapes")

    import transformers

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    results = {"meta": {"date": time.strftime("%Y-%m-%d %H:%M"), "torch": torch.__version__,
                        "transformers": transformers.__version__, "dtype": args.dtype,
                        "device_name": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                        "command": "python scripts/eval_quality.py " + " ".join(argv if argv is not None else sys.argv[1:])},
               "models": []}
    if args.model:
        from transformers import AutoTokenizer

        stock, fused = build_pair(None, args.model, device, dtype)
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        text_ids = torch.tensor(tokenizer(Path(args.text).read_text())["input_ids"])
        results["models"].append(evaluate(args.model, stock, fused, device, text_ids, args.max_windows or None,
                                          args.window, args.new_tokens))
        del stock, fused
    for shape in (args.shapes.split(",") if args.shapes else []):
        stock, fused = build_pair(shape, None, device, dtype)
        results["models"].append(evaluate(f"random {shape}", stock, fused, device, None, args.max_windows or 4,
                                          args.window, args.new_tokens))
        del stock, fused
        if device.type == "cuda":
            torch.cuda.empty_cache()
    write_report(Path(args.out), "quality", results, to_markdown(results))
    return results


if __name__ == "__main__":
    main()
