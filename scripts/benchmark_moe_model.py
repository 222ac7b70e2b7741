"""The whole Qwen3.5-MoE text model, fused against stock, in one process on ONE model (the 35B-A3B shape is ~70 GB
in bf16: a second copy does not fit an H200), switched between paths.

    # the 35B-A3B text shape on a GPU (random weights, bf16)
    python scripts/benchmark_moe_model.py --shape 35B-A3B --out out/moe_model
    # CPU smoke run (the fused classes run stock's code on CPU; the times mean nothing)
    python scripts/benchmark_moe_model.py --shape tiny --device cpu --batches 1,2 --prefill 16 --new-tokens 3

Variants, on the same weights: `fused` (fused kernels and CUDA graphs), `fused-eager` (`cuda_graphs` off), and
`stock-<impl>` (`set_fused_kernels(False)`: stock transformers' code, with `experts_implementation` = `eager` and each
of `grouped_mm`, `batched_mm` this transformers registers). Each variant: decode ms/token through `generate` at each
--batches size ((time of --new-tokens tokens - time of 1) / (--new-tokens - 1), median of --repeats, after two warm
calls), and a no-cache forward of --prefill tokens (last-token logits; CUDA-event median of --repeats after three warm
calls). A variant that fails (out of memory: stock `batched_mm` copies each token's expert weights) is recorded with
its error, and the run goes on.

Floors, from ceilings measured in the same run (`benchmark_latency.measure_ceilings`): decode at batch B = bytes a
step must read / copy rate, where the bytes are every weight outside the routed experts and the embedding table (one
row of it is read), the LM head, and per MoE layer the experts the B tokens pick (their union, counted from the router
on B random tokens; k per layer at B = 1); prefill = the larger of (2 x active parameters x T + the LM head once +
the causal attention FLOPs) / bf16 GEMM rate, the active parameters being the same weights with k experts per token
(the DeltaNet rule's FLOPs, linear in T, are left out), and the bytes of the weights its T tokens pick (at T=2048
nearly every expert) / copy rate. Writes `moe_model.json` / `.md` to --out.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from scripts.benchmark_latency import (  # noqa: E402
    Timer, attention_flops, generate_tokens, kernel_times, log, measure_ceilings, per_token_kernels, stock_cpu_guard,
    target_cells,
)
from scripts.common import (  # noqa: E402
    REAL_MOE_SHAPES, import_module, import_repo, moe_text_kwargs, tiny_moe_text_kwargs, write_report,
)

STOCK_IMPLS = ("eager", "grouped_mm", "batched_mm")


def moe_kwargs(shape: str) -> dict:
    if shape == "tiny":
        return tiny_moe_text_kwargs("E8-top2")
    if shape not in REAL_MOE_SHAPES:
        raise SystemExit(f"unknown --shape {shape!r}; choose tiny or one of {sorted(REAL_MOE_SHAPES)}")
    return moe_text_kwargs(shape)


def build(shape: str, device: torch.device, dtype: torch.dtype, seed: int = 0, layers: int = 0):
    """The fused MoE causal LM at `shape`, random weights, built in `dtype` directly on `device`; `layers` > 0 keeps
    only that many decoder layers (profiles: every layer of a kind runs the same kernels)."""
    configuration, modeling, _ = import_repo()
    kwargs = moe_kwargs(shape)
    if layers:
        kwargs["num_hidden_layers"] = layers
    config = configuration.Qwen3_5MoeFusedTextConfig(**kwargs, fused_kernels=True)
    torch.manual_seed(seed)
    with torch.device(device):
        model = modeling.Qwen3_5MoeFusedForCausalLM._from_config(config, dtype=dtype)
    return model.eval()


def weight_bytes(model) -> dict:
    """{"body": bytes of the weights outside the routed experts, the embedding table and the LM head; "head": the LM
    head's; "expert": one expert's (gate, up and down)}."""
    config = model.config
    body = sum(p.numel() * p.element_size() for name, p in model.named_parameters()
               if ".mlp.experts." not in name and "embed_tokens" not in name and not name.startswith("lm_head"))
    head = model.lm_head.weight
    return {"body": body, "head": head.numel() * head.element_size(),
            "expert": 3 * config.moe_intermediate_size * config.hidden_size * head.element_size()}


def experts_hit(model, batch: int, device) -> float:
    """Mean over MoE layers of how many distinct experts `batch` random tokens pick (the router's top-k)."""
    ids = torch.randint(3, model.config.vocab_size, (batch, 1), device=device)
    with torch.inference_mode(), stock_cpu_guard(device):
        out = model(input_ids=ids, use_cache=False, output_router_logits=True, logits_to_keep=1)
    k = model.config.num_experts_per_tok
    counts = [len(torch.unique(logits.float().topk(k, dim=-1).indices)) for logits in out.router_logits]
    return statistics.fmean(counts)


def decode_ms(model, batch: int, new_tokens: int, repeats: int, device, prompt_len: int = 32) -> float:
    ids = torch.randint(3, model.config.vocab_size, (batch, prompt_len), device=device)

    def run(n):
        generate_tokens(model, ids, n, device)

    for _ in range(2):
        run(4)
    per_token = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run(1)
        t1 = time.perf_counter()
        run(new_tokens)
        t2 = time.perf_counter()
        per_token.append(((t2 - t1) - (t1 - t0)) / (new_tokens - 1) * 1e3)
    return statistics.median(per_token)


def prefill_ms(model, T: int, repeats: int, device) -> float:
    ids = torch.randint(3, model.config.vocab_size, (1, T), device=device)
    timer = Timer(device)

    def run():
        with torch.inference_mode(), stock_cpu_guard(device):
            model(input_ids=ids, use_cache=False, logits_to_keep=1)

    for _ in range(3):
        run()
    return statistics.median(timer(run) for _ in range(repeats))


def profile_kernels(model, batches, new_tokens: int, prefill: int, device, rows: int = 30) -> dict:
    """The fused path's kernels under the torch profiler, with programmatic dependent launch off (so a kernel's time
    is its own, not its wait for the one before; the graphs are captured here, PDL-less): per decode token at each
    batch (a `new_tokens` generate minus a 1-token one, graphs on: CUPTI records a replayed graph's kernels one by
    one) and for one no-cache prefill of `prefill` tokens. Prints the top kernels of each and returns them."""
    from torch.profiler import ProfilerActivity, profile

    runtime = import_module("fused_ops_runtime")
    saved, runtime.PDL_ENABLED = runtime.PDL_ENABLED, False
    out = {}
    try:
        set_variant(model, "fused")
        for b in batches:
            ids = torch.randint(3, model.config.vocab_size, (b, 32), device=device)
            for _ in range(2):
                generate_tokens(model, ids, 4, device)
            stats = {}
            for n in (1, new_tokens):
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    generate_tokens(model, ids, n, device)
                    torch.cuda.synchronize()
                stats[n] = kernel_times(prof)
            per = per_token_kernels(stats[1], stats[new_tokens], new_tokens - 1)
            total = sum(us for _, us in per.values())
            out[f"decode_b{b}"] = {"gpu_us_per_token": total, "kernels_per_token": sum(c for c, _ in per.values()),
                                   "top": sorted(((k[:100], round(c, 2), round(us, 2)) for k, (c, us) in per.items()),
                                                 key=lambda r: -r[2])[:rows]}
        ids = torch.randint(3, model.config.vocab_size, (1, prefill), device=device)
        for _ in range(3):
            with torch.inference_mode():
                model(input_ids=ids, use_cache=False, logits_to_keep=1)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            with torch.inference_mode():
                model(input_ids=ids, use_cache=False, logits_to_keep=1)
            torch.cuda.synchronize()
        per = kernel_times(prof)
        out[f"prefill_T{prefill}"] = {"gpu_us": sum(us for _, us in per.values()),
                                      "kernels": sum(c for c, _ in per.values()),
                                      "top": sorted(((k[:100], c, round(us, 1)) for k, (c, us) in per.items()),
                                                    key=lambda r: -r[2])[:rows]}
    finally:
        runtime.PDL_ENABLED = saved
    for name, r in out.items():
        total = r.get("gpu_us_per_token", r.get("gpu_us"))
        log(f"profile {name}: {total / 1e3:.3f} ms GPU, {r.get('kernels_per_token', r.get('kernels'))} kernels")
        for key, count, us in r["top"]:
            print(f"    {us:10.1f} us  x{count:<7} {key}", flush=True)
    return out


def set_variant(model, name: str) -> None:
    if name.startswith("stock-"):
        model.set_fused_kernels(False)
        impl = name[len("stock-"):]
        if hasattr(model, "set_experts_implementation"):
            model.set_experts_implementation(impl)
        else:
            model.config._experts_implementation = impl
    else:
        model.set_fused_kernels(True)
        model.set_cuda_graphs(name == "fused")


def stock_impls() -> list[str]:
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
        registered = set(ALL_EXPERTS_FUNCTIONS.valid_keys()) | {"eager"}
    except Exception:  # an older transformers without the registry: stock's loop only
        registered = {"eager"}
    return [impl for impl in STOCK_IMPLS if impl in registered]


def json_table(profile: dict) -> str:
    lines = []
    for name, r in profile.items():
        lines += [f"## {name}", "", "| us | launches | kernel |", "|---|---|---|"]
        lines += [f"| {us} | {count} | `{key}` |" for key, count, us in r["top"]] + [""]
    return "\n".join(lines)


# The MoE issue's targets at the 35B-A3B shape (issue 25): (what, figure, limit, at least?)
MOE_TARGETS = (
    ("batch-1 decode within 1.6x its floor", "decode/floor:1", 1.6, False),
    ("batch-1 decode at least 20x stock's fastest experts implementation", "decode/stock:1", 20.0, True),
    ("batch-8 decode within 2x its floor", "decode/floor:8", 2.0, False),
    ("prefill within 2x the active-FLOP floor", "prefill/flops", 2.0, False),
)


def _moe_reading(results: dict, figure: str) -> float | None:
    """The fused variant's figure for a `MOE_TARGETS` entry, or None where the run lacks a row (or a row failed)."""
    fused, floors = results["variants"].get("fused", {}), results.get("floors") or {}
    kind, _, b = figure.partition(":")
    if kind == "prefill/flops":
        v = fused.get("prefill_ms")
        return v / floors["prefill_matmul_ms"] if isinstance(v, float) and floors else None
    v = fused.get("decode_ms", {}).get(b)
    if not isinstance(v, float):
        return None
    if kind == "decode/floor":
        return v / floors["decode_ms"][b] if b in floors.get("decode_ms", {}) else None
    stock = [r["decode_ms"].get(b) for name, r in results["variants"].items() if name.startswith("stock-")]
    stock = [x for x in stock if isinstance(x, float)]
    return min(stock) / v if stock else None


def moe_targets_markdown(results: dict) -> list[str]:
    """`MOE_TARGETS` against this run (35B-A3B runs only: the targets are that shape's), met or missed by how much."""
    if results["meta"]["shape"] != "35B-A3B":
        return []
    rows = []
    for what, figure, limit, at_least in MOE_TARGETS:
        v = _moe_reading(results, figure)
        if v is not None:
            rows.append(f"| {what} | {target_cells(v, limit, at_least)} |")
    return ["", "Against the MoE issue's targets:", "", "| target | measured | target | |", "|---|---|---|---|",
            *rows] if rows else []


def table(results: dict) -> str:
    meta, floors = results["meta"], results["floors"]
    batches = [str(b) for b in meta["batches"]]
    lines = [f"Run: {meta['date']}, {meta['device']}, torch {meta['torch']}, transformers {meta['transformers']}, "
             f"{meta['shape']} ({meta['dtype']})", f"Command: `{meta['command']}`", "",
             "| variant | " + " | ".join(f"decode b{b} ms/token" for b in batches) + f" | prefill T={meta['prefill']} ms |",
             "|---|" + "---|" * (len(batches) + 1)]
    for name, r in results["variants"].items():
        cells = []
        for b in batches:
            v = r["decode_ms"].get(b)
            cells.append(f"{v:.3f}" if isinstance(v, float) else str(v))
        v = r.get("prefill_ms")
        cells.append(f"{v:.2f}" if isinstance(v, float) else str(v))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if floors:
        lines.append("| floor | " + " | ".join(f"{floors['decode_ms'][b]:.3f}" for b in batches)
                     + f" | {floors['prefill_ms']:.2f} |")
        fused = results["variants"].get("fused", {})
        if fused:
            lines.append("| fused / floor | " + " | ".join(
                f"{fused['decode_ms'][b] / floors['decode_ms'][b]:.2f}x" if isinstance(fused["decode_ms"].get(b), float)
                else "-" for b in batches) + (f" | {fused['prefill_ms'] / floors['prefill_ms']:.2f}x |"
                                              if isinstance(fused.get("prefill_ms"), float) else " | - |"))
    if floors:
        lines += ["", f"Prefill floor: the larger of the active-FLOP floor ({floors['prefill_matmul_ms']:.2f} ms) and "
                  f"the read of the weights its tokens pick ({floors['prefill_read_ms']:.2f} ms)."]
    lines += ["", "Experts hit per MoE layer (mean): " + ", ".join(f"batch {b}: {results['experts_hit'][b]:.1f}"
                                                                  for b in batches)
              + f", prefill of {meta['prefill']} tokens: {results['experts_hit']['prefill']:.1f}"]
    lines += moe_targets_markdown(results)
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="35B-A3B", help="35B-A3B, or tiny (CPU smoke run)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--batches", default="1,8", help="decode batch sizes")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prefill", type=int, default=2048, help="tokens of the no-cache forward")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--variants", default="", help="comma list (default: fused, fused-eager, stock-<each impl>)")
    p.add_argument("--layers", type=int, default=0, help="keep only this many decoder layers (with --profile)")
    p.add_argument("--profile", action="store_true",
                   help="only profile the fused path's kernels (decode at --batches, prefill), PDL off")
    p.add_argument("--out", default="out/moe_model")
    args = p.parse_args(argv)
    import transformers

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    batches = [int(b) for b in args.batches.split(",") if b]
    variants = args.variants.split(",") if args.variants else ["fused", "fused-eager"] + [
        f"stock-{impl}" for impl in stock_impls()]
    log(f"building {args.shape} ({args.dtype}, {device})")
    model = build(args.shape, device, dtype, layers=args.layers)
    if args.profile:
        results = {"profile": profile_kernels(model, batches, args.new_tokens, args.prefill, device)}
        write_report(Path(args.out), "moe_profile", results, json_table(results["profile"]))
        return results
    ceil = measure_ceilings(device)
    results = {"meta": {"date": time.strftime("%Y-%m-%d %H:%M"), "shape": args.shape, "dtype": args.dtype,
                        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                        "torch": torch.__version__, "transformers": transformers.__version__, "batches": batches,
                        "prefill": args.prefill, "ceilings": ceil,
                        "command": "python scripts/benchmark_moe_model.py " + " ".join(
                            argv if argv is not None else sys.argv[1:])},
               "experts_hit": {str(b): experts_hit(model, b, device) for b in batches}, "variants": {}}
    results["experts_hit"]["prefill"] = experts_hit(model, args.prefill, device)
    sizes, cfg = weight_bytes(model), model.config
    elem = model.lm_head.weight.element_size()
    experts_per_token = cfg.num_experts_per_tok * sizes["expert"] * cfg.num_hidden_layers
    results["weights"] = dict(sizes, read_per_token_at_batch_1=sizes["body"] + sizes["head"] + experts_per_token)
    results["floors"] = {
        # a decode step reads the body, the head and, per MoE layer, each expert its rows picked
        "decode_ms": {str(b): (sizes["body"] + sizes["head"] + results["experts_hit"][str(b)] * sizes["expert"]
                               * cfg.num_hidden_layers) / ceil["copy_bytes_per_s"] * 1e3 for b in batches},
        # each prompt token: the body and its k experts; the head for the last token only (logits_to_keep=1)
        "prefill_matmul_ms": (2 * (sizes["body"] + experts_per_token) / elem * args.prefill + 2 * sizes["head"] / elem
                              + attention_flops(cfg, args.prefill)) / ceil["bf16_flops_per_s"] * 1e3,
        # ... and reads the body, the head and every expert its tokens pick (at T=2048 nearly all of them)
        "prefill_read_ms": (sizes["body"] + sizes["head"] + results["experts_hit"]["prefill"] * sizes["expert"]
                            * cfg.num_hidden_layers) / ceil["copy_bytes_per_s"] * 1e3,
    } if ceil else {}
    if ceil:  # the prefill floor: the larger of the two
        results["floors"]["prefill_ms"] = max(results["floors"]["prefill_matmul_ms"], results["floors"]["prefill_read_ms"])
    for name in variants:
        set_variant(model, name)
        row = {"decode_ms": {}}
        for b in batches:
            try:
                row["decode_ms"][str(b)] = decode_ms(model, b, args.new_tokens, args.repeats, device)
            except (torch.cuda.OutOfMemoryError, RuntimeError) as e:
                row["decode_ms"][str(b)] = f"failed: {str(e).splitlines()[0][:120]}"
            log(f"{name} decode batch {b}: {row['decode_ms'][str(b)]}")
        try:
            row["prefill_ms"] = prefill_ms(model, args.prefill, args.repeats, device)
        except (torch.cuda.OutOfMemoryError, RuntimeError) as e:
            row["prefill_ms"] = f"failed: {str(e).splitlines()[0][:120]}"
        log(f"{name} prefill T={args.prefill}: {row['prefill_ms']}")
        results["variants"][name] = row
        if device.type == "cuda":
            torch.cuda.empty_cache()
    write_report(Path(args.out), "moe_model", results, table(results))
    return results


if __name__ == "__main__":
    main()
