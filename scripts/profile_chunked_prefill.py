"""Where a prompt chunk's time goes: ``generate_batch``'s ``prefill_chunk`` path, the fused forward over a stock
``DynamicCache`` a chunk at a time (what a riding chunk runs too), against the same prompt in one eager forward.

    # 4B at the real shape (random weights), a 2,048-token prompt in chunks of 512 and whole, then a profile
    python scripts/profile_chunked_prefill.py --model 4b --prompt 2048 --chunks 512,2048 --profile --out out/chunks
    # CPU smoke run (what CI runs): the tiny config
    python scripts/profile_chunked_prefill.py --device cpu --tiny --prompt 40 --chunks 16 --profile

For each chunk size C: the prompt's chunks of C tokens run in turn over one cache, each timed three ways (GPU time
between CUDA events, the host's time to queue it, the wall time to its end); the first pass warms (compiles,
autotunes) and is reported apart, then the median over ``--repeats`` passes per chunk position. ``C >= prompt`` is the
whole prompt in one eager forward (no graph). With ``--profile``, one more pass at the first chunk size under
``torch.profiler``: the operators by device time and by host time. Writes ``chunks.json`` / ``chunks.md`` to --out.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from scripts.benchmark_latency import build_one  # noqa: E402
from scripts.common import import_module, write_report  # noqa: E402

MODELS = {"4b": "4B", "9b": "9B", "0.8b": "0.8B", "35b-a3b": "35B-A3B"}


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def one_pass(text_model, ids: torch.Tensor, chunk: int, device) -> list[dict]:
    """``ids`` [1, P] through ``text_model`` ``chunk`` tokens at a time over one fresh ``DynamicCache``: per chunk its
    tokens, GPU ms (CUDA events; NaN off a GPU), host ms to queue it, wall ms to its end."""
    from transformers.cache_utils import DynamicCache

    cache_kw = import_module("fused_batch").GENERATE_CACHE_KW
    cache = DynamicCache(config=text_model.config)
    out = []
    for start in range(0, ids.shape[1], chunk):
        piece = ids[:, start : start + chunk]
        sync(device)
        begin = time.perf_counter()
        if device.type == "cuda":
            events = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            events[0].record()
        text_model(input_ids=piece, use_cache=True, **{cache_kw: cache})
        if device.type == "cuda":
            events[1].record()
        queued = time.perf_counter()
        sync(device)
        end = time.perf_counter()
        gpu = events[0].elapsed_time(events[1]) if device.type == "cuda" else float("nan")
        out.append({"tokens": piece.shape[1], "gpu_ms": gpu, "host_ms": (queued - begin) * 1e3,
                    "wall_ms": (end - begin) * 1e3})
    return out


def median_passes(passes: list[list[dict]]) -> list[dict]:
    """Per chunk position, the median of each time over the passes."""
    return [{"tokens": rows[0]["tokens"], **{k: statistics.median(r[k] for r in rows)
                                             for k in ("gpu_ms", "host_ms", "wall_ms")}}
            for rows in zip(*passes)]


def to_markdown(r: dict) -> str:
    lines = [f"# Prompt chunks over a stock cache: {r['model']} ({r['dtype']}, {r['device']})", "",
             f"A {r['prompt']}-token prompt, median of {r['repeats']} passes after a warm-up pass.", "",
             "| chunk | chunk # | tokens | GPU ms | host ms to queue | wall ms | GPU us / token | first pass wall ms |",
             "|---|---|---|---|---|---|---|---|"]
    for chunk, rows in r["chunks"].items():
        for i, (row, first) in enumerate(zip(rows["median"], rows["first"])):
            lines.append(f"| {chunk} | {i} | {row['tokens']} | {row['gpu_ms']:.2f} | {row['host_ms']:.2f} | "
                         f"{row['wall_ms']:.2f} | {row['gpu_ms'] * 1e3 / row['tokens']:.1f} | {first['wall_ms']:.1f} |")
    for title in ("by_device_time", "by_host_time"):
        if r.get(title):
            lines += ["", f"Profile, one pass at chunk {r['profiled_chunk']}, operators {title.replace('_', ' ')}:",
                      "", "```", r[title], "```"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="4b", choices=sorted(MODELS), help="the real shape, random weights")
    p.add_argument("--tiny", action="store_true", help="the tiny test config instead (tiny-moe with 35b-a3b)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--prompt", type=int, default=2048, help="prompt tokens")
    p.add_argument("--chunks", type=lambda s: [int(c) for c in s.split(",")], default=[512, 2048],
                   help="comma list of chunk sizes (>= --prompt: the whole prompt at once)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--profile", action="store_true", help="one more pass at the first chunk size under the profiler")
    p.add_argument("--rows", type=int, default=25, help="operators a profile table shows")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("out/chunks"))
    args = p.parse_args(argv)
    if args.device == "cpu" and args.dtype == "bfloat16":
        args.dtype = "float32"
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    moe = args.model == "35b-a3b"
    shape = ("tiny-moe" if moe else "tiny") if args.tiny else MODELS[args.model]
    model = build_one(shape, None, device, dtype, fused=True, seed=args.seed)
    text_model = model._text_model()
    g = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(3, text_model.config.vocab_size, (1, args.prompt), generator=g).to(device)
    results = {"model": shape, "dtype": args.dtype, "device": str(device), "prompt": args.prompt,
               "repeats": args.repeats, "chunks": {}}
    with torch.inference_mode():
        for chunk in args.chunks:
            first = one_pass(text_model, ids, chunk, device)
            passes = [one_pass(text_model, ids, chunk, device) for _ in range(args.repeats)]
            results["chunks"][str(chunk)] = {"first": first, "median": median_passes(passes)}
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
            with profile(activities=activities) as prof:
                one_pass(text_model, ids, args.chunks[0], device)
            table = prof.key_averages()
            results["profiled_chunk"] = args.chunks[0]
            if device.type == "cuda":
                results["by_device_time"] = table.table(sort_by="device_time_total", row_limit=args.rows,
                                                        max_name_column_width=60)
            results["by_host_time"] = table.table(sort_by="cpu_time_total", row_limit=args.rows,
                                                  max_name_column_width=60)
    write_report(args.out, "chunks", results, to_markdown(results))
    return results


if __name__ == "__main__":
    main()
