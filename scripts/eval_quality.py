"""Fidelity of the fused path: fused vs stock transformers on the same inputs and weights.

    # the small trained model shipped in this repo (held-out text in data/heldout.txt)
    python scripts/eval_quality.py --model . --dtype bfloat16 --out out/quality
    # random real-shape models; 35B-A3B is the MoE model (the pair shares its experts: ~73 GB on one H200)
    python scripts/eval_quality.py --shapes 0.8B,4B,35B-A3B --dtype bfloat16 --out out/quality
    # each bf16 path against the fp32 answer (8 of the MoE model's 40 layers: its fp32 copy must fit beside the pair)
    python scripts/eval_quality.py --shapes 35B-A3B --layers 8 --fp32-reference --max-windows 4 --new-tokens 64
    # CPU smoke run (CI): the fused classes fall back to stock there, so every number must show exact agreement
    python scripts/eval_quality.py --model . --device cpu --dtype float32 --max-windows 2 --new-tokens 8

Reports per model: relative logit error ||fused - stock|| / ||stock||, top-1 agreement of next-token predictions,
NLL per token of held-out text under each path (trained model only: random weights have no meaningful NLL), and
for greedy generation the first position where the two outputs diverge (None when they never do). With
`--fp32-reference`, also each path's relative logit error and top-1 agreement against the fp32 answer: stock's IEEE
torch code on the same (rounded) weights, its experts run by the `eager` loop. That is the fair yardstick for 16-bit
runs of random MoE weights, where a rounding that flips one of a token's picked experts moves its logits in either
path (stock's own `grouped_mm` and `eager` experts disagree as much). Writes `quality.json` and `quality.md` to --out.
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from scripts.benchmark_latency import build_pair, log, stock_cpu_guard  # noqa: E402
from scripts.common import import_module, write_report  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def windows(ids: torch.Tensor, size: int, limit: int | None) -> list[torch.Tensor]:
    out = [ids[i : i + size] for i in range(0, ids.numel() - 1, size) if ids[i : i + size].numel() > 1]
    return out[:limit] if limit else out


def compare_logits(models: dict, batches: list[torch.Tensor], device, keep: list | None = None) -> dict:
    """Relative logit error, top-1 agreement and NLL per token (first token of each window not scored); appends each
    window's {path: float32 logits on the CPU} to `keep` when given."""
    num, den, agree, total = 0.0, 0.0, 0, 0
    nll = {name: 0.0 for name in models}
    for ids in batches:
        ids = ids.to(device)[None]
        with torch.inference_mode(), stock_cpu_guard(device):
            logits = {name: m(input_ids=ids).logits.float()[0] for name, m in models.items()}
        if keep is not None:
            keep.append({name: lg.cpu() for name, lg in logits.items()})
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


def against_fp32(stock, batches: list[torch.Tensor], kept: list, device) -> dict:
    """{path: {"rel_logit_err", "top1_agreement"}} of the `kept` logits against the fp32 answer on `batches`. Casts
    `stock` to float32 in place (call it last: the model is the reference afterwards)."""
    stock.float()
    if getattr(stock.config, "num_experts", None):  # a MoE model: the plain loop over the experts hit
        if hasattr(stock, "set_experts_implementation"):
            stock.set_experts_implementation("eager")
        else:  # a transformers without the setter reads the config's field
            stock.config._experts_implementation = "eager"
    num, den, agree, total = {}, 0.0, {}, 0
    with torch.inference_mode(), import_module("fused_compat").torch_reference_kernels():
        for ids, logits in zip(batches, kept):
            want = stock(input_ids=ids.to(device)[None]).logits.float()[0].cpu().double()
            den += want.norm().item() ** 2
            total += want.shape[0]
            for path, got in logits.items():
                num[path] = num.get(path, 0.0) + (got.double() - want).norm().item() ** 2
                agree[path] = agree.get(path, 0) + (got.argmax(-1) == want.argmax(-1)).sum().item()
    return {path: {"rel_logit_err": (num[path] / den) ** 0.5, "top1_agreement": agree[path] / total} for path in num}


def evaluate(name, stock, fused, device, text_ids, max_windows, window, new_tokens, seed=0,
             fp32_reference: bool = False) -> dict:
    """The comparisons of the module docstring for one (stock, fused) pair; with `fp32_reference`, `stock` ends cast
    to float32 (see `against_fp32`)."""
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
    kept = [] if fp32_reference else None
    r.update(compare_logits(models, batches, device, kept))
    r["greedy"] = greedy_divergence(models, prompt, new_tokens, device)
    if text_ids is None:
        r["nll_per_token"] = None  # random weights: no meaningful NLL
    log(f"{name}: rel err {r['rel_logit_err']:.2e}, top-1 agreement {r['top1_agreement']:.4f}, "
        f"first greedy divergence {r['greedy']['first_divergence']}")
    r["vs_fp32"] = against_fp32(stock, batches, kept, device) if fp32_reference else None
    if r["vs_fp32"]:
        v = r["vs_fp32"]
        log(f"{name} against fp32: rel err stock {v['stock']['rel_logit_err']:.2e} / fused "
            f"{v['fused']['rel_logit_err']:.2e}, top-1 stock {v['stock']['top1_agreement']:.4f} / fused "
            f"{v['fused']['top1_agreement']:.4f}")
    return r


def _fp32_cells(v: dict | None) -> str:
    if not v:
        return " - | - |"
    return (f" {v['stock']['rel_logit_err']:.2e} / {v['fused']['rel_logit_err']:.2e} | "
            f"{v['stock']['top1_agreement']:.4f} / {v['fused']['top1_agreement']:.4f} |")


def to_markdown(results: dict) -> str:
    m = results["meta"]
    lines = [f"Run: {m['date']}, {m['device_name']}, torch {m['torch']}, transformers {m['transformers']}, dtype {m['dtype']}",
             f"Command: `{m['command']}`", "",
             "| model | positions | rel. logit error | top-1 agreement | NLL stock | NLL fused | greedy: first divergence / new tokens "
             "| vs fp32: rel. error stock / fused | vs fp32: top-1 stock / fused |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results["models"]:
        nll = r["nll_per_token"]
        g = r["greedy"]
        lines.append(f"| {r['model']} | {r['positions']} | {r['rel_logit_err']:.2e} | {r['top1_agreement']:.4f} | "
                     + (f"{nll['stock']:.4f} | {nll['fused']:.4f} |" if nll else "- | - |")
                     + f" {g['first_divergence'] if g['first_divergence'] is not None else 'none'} / {g['new_tokens']} |"
                     + _fp32_cells(r.get("vs_fp32")))
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
    p.add_argument("--layers", type=int, default=0,
                   help="random --shapes: keep only this many decoder layers (0: the shape's own depth)")
    p.add_argument("--fp32-reference", action="store_true",
                   help="also compare each path with the fp32 answer (stock's IEEE torch code, same weights); needs "
                        "room for an fp32 copy of the model")
    p.add_argument("--out", default="out/quality")
    args = p.parse_args(argv)
    if not args.model and not args.shapes:
        p.error("give --model and/or --shapes")
    if 0 < args.layers < 4:  # stock's cache needs an attention layer: the 4th of every 4
        p.error(f"--layers {args.layers} leaves no full-attention layer (every 4th layer is one); give 4 or more")

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
                                          args.window, args.new_tokens, fp32_reference=args.fp32_reference))
        del stock, fused
    for shape in (args.shapes.split(",") if args.shapes else []):
        stock, fused = build_pair(shape, None, device, dtype, layers=args.layers)
        name = f"random {shape}" + (f", {args.layers} layers" if args.layers else "")
        results["models"].append(evaluate(name, stock, fused, device, None, args.max_windows or 4, args.window,
                                          args.new_tokens, fp32_reference=args.fp32_reference))
        del stock, fused
        if device.type == "cuda":
            torch.cuda.empty_cache()
    write_report(Path(args.out), "quality", results, to_markdown(results))
    return results


if __name__ == "__main__":
    main()
