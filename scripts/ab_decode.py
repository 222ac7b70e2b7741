"""A/B of decode-step settings in one process: the fused model's decode speed and greedy tokens under each variant.

    # the rule step's value columns per program, 32 (main) against 16, at 4B and 0.8B, batch 1 and 8
    python scripts/ab_decode.py --shapes 4B,0.8B --batches 1,8 \\
        --variant base: --variant bv16:fused_ops_deltanet._GDR_BLOCK_V=16
    # the MoE model's decode GEMV tiles (35B-A3B: the pair shares its experts, ~73 GB on one H200)
    python scripts/ab_decode.py --shapes 35B-A3B --batches 1,8 --new-tokens 32 \\
        --variant base: --variant gu16:"fused_ops_moe._DECODE_GATE_UP=(16, 256, 4, 1)"
    # CPU smoke run (what the tests run): the fused classes run stock's code there, so every variant is the same
    python scripts/ab_decode.py --shapes tiny --device cpu --dtype float32 --new-tokens 3 --repeats 1 \\
        --variant a: --variant b:fused_ops_attention._DA_MIN_SPLIT=32

A variant is `NAME:` followed by a comma list of `MODULE.CONSTANT=VALUE`. MODULE is the repo file that
reads the constant, by name (`fused_generate.STOP_CHECK_EVERY`, `fused_ops_runtime.PDL_ENABLED`,
`fused_ops_gemv._GEMV_LATE_TRIGGER_ELEMS`, `fused_ops_deltanet._GDR_BLOCK_V`, ...; not the `fused_ops` facade);
VALUE is a Python literal (a tuple or set literal too: commas inside it do not split). The first variant
is the baseline. Only the fused model is built, once per shape, with random weights. Each variant sets its constants
and drops the model's graphs (`set_fused_kernels(False)` then `(True)`), then two 4-token `generate` calls warm and
capture. `small_linear`'s per-shape choices stay, so the variants differ only in what they set. Repeats are
interleaved (A B C A B C ...), so a drift of the card spreads over every variant. ms per token =
(t(1 + N new tokens) - t(1)) / N, as in `benchmark_latency.py`. For each variant the script prints the median, min and max over repeats,
the change against the baseline, and the first position where its greedy tokens leave the baseline's. Every constant
is restored afterwards. Writes `ab.json` and `ab.md` to --out.

This is the method of the A/B figures in docs/DESIGN.md. Stock is not run: for the ratio to stock and to the
weight-read floor, run `benchmark_latency.py`.
"""

import argparse
import ast
import contextlib
import json
import re
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from scripts.benchmark_latency import build_pair, log, stock_cpu_guard  # noqa: E402
from scripts.common import code_files, import_module, write_report  # noqa: E402


def variant_modules() -> dict:
    """The modules a variant may name: every code file of the repo by its name, imported once through the repo
    package, except the `fused_ops` facade (a constant set there would be read by nobody)."""
    names = [name.removesuffix(".py") for name in code_files()]
    return {name: import_module(name) for name in names if name != "fused_ops"}


def parse_variant(spec: str, modules: dict) -> tuple[str, list]:
    """`NAME:MODULE.CONSTANT=VALUE,...` -> (NAME, [(module, constant, value), ...]); an unknown module or constant,
    or a value that is not a Python literal, is an error that names it."""
    name, sep, body = spec.partition(":")
    if not sep or not name:
        raise ValueError(f"a variant is NAME:MODULE.CONSTANT=VALUE,... (NAME: alone for none), got {spec!r}.")
    settings = []
    # items split only at a comma followed by the next MODULE.CONSTANT=, so a value may be a tuple or set literal
    for item in filter(None, (s.strip() for s in re.split(r",(?=\s*\w+\.\w+\s*=)", body))):
        target, eq, text = item.partition("=")
        mod_name, dot, const = target.partition(".")
        if not eq or not dot:
            raise ValueError(f"variant {name!r}: expected MODULE.CONSTANT=VALUE, got {item!r}.")
        if mod_name not in modules:
            raise ValueError(f"variant {name!r}: module {mod_name!r} is not one of {sorted(modules)}.")
        module = modules[mod_name]
        if not hasattr(module, const):
            raise ValueError(f"variant {name!r}: {mod_name} has no constant {const!r}.")
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            raise ValueError(f"variant {name!r}: the value of {target} must be a Python literal, "
                             f"got {text!r}.") from None
        settings.append((module, const, value))
    return name, settings


@contextlib.contextmanager
def constants(settings: list):
    """Each (module, constant, value) of ``settings`` (a parsed variant's) set for the block, the values it had before
    put back afterwards, also when the block raises."""
    saved = [(module, const, getattr(module, const)) for module, const, _ in settings]
    try:
        for module, const, value in settings:
            setattr(module, const, value)
        yield
    finally:
        for module, const, value in reversed(saved):
            setattr(module, const, value)


def first_divergence(tokens: torch.Tensor, base: torch.Tensor) -> int | None:
    """The first new-token position where any row differs from the baseline's tokens; None when none does."""
    differ = (tokens != base).any(0)
    return int(differ.nonzero()[0]) if differ.any() else None


def ab_shape(model, variants: list, batches: list[int], prompt_len: int, new_tokens: int, repeats: int, device) -> dict:
    """For each batch: every variant's ms per token (median / min / max over the repeats, interleaved) and its
    first divergence from the first variant's greedy tokens."""
    vocab = model.config.vocab_size
    results = {}
    try:
        for batch in batches:
            ids = torch.randint(3, vocab, (batch, prompt_len), device=device)
            mask = torch.ones_like(ids)

            def run(n):
                with torch.inference_mode(), stock_cpu_guard(device):
                    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                         do_sample=False, pad_token_id=0)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                return out[:, prompt_len:]

            times = {name: [] for name, _ in variants}
            tokens = {}
            for _ in range(max(1, repeats)):
                for name, settings in variants:
                    with constants(settings):  # each variant from the shipped values
                        model.set_fused_kernels(False).set_fused_kernels(True)  # new graphs under these settings
                        run(4)
                        run(4)
                        t0 = time.perf_counter()
                        run(1)
                        t1 = time.perf_counter()
                        tokens[name] = run(new_tokens + 1)
                        t2 = time.perf_counter()
                    times[name].append(((t2 - t1) - (t1 - t0)) / new_tokens * 1e3)
            base_name = variants[0][0]
            base = statistics.median(times[base_name])
            results[str(batch)] = {
                name: {"ms_per_token": statistics.median(t), "min": min(t), "max": max(t),
                       "delta_ms": statistics.median(t) - base,
                       "first_divergence": first_divergence(tokens[name], tokens[base_name])}
                for name, t in times.items()
            }
            for name, r in results[str(batch)].items():
                div = "identical" if r["first_divergence"] is None else f"differ from {r['first_divergence']}"
                log(f"batch {batch} {name}: {r['ms_per_token']:.4f} ms/token ({r['min']:.4f} to {r['max']:.4f}), "
                    f"{r['delta_ms']:+.4f} vs {base_name}, tokens {div}")
    finally:
        model.set_fused_kernels(False).set_fused_kernels(True)  # graphs under the shipped values again
    return results


def to_markdown(results: dict) -> str:
    lines = ["| model | batch | variant | ms/token (min-max) | vs first | tokens vs first |",
             "|---|---|---|---|---|---|"]
    for shape, by_batch in results["models"].items():
        for batch, by_variant in by_batch.items():
            for name, r in by_variant.items():
                div = "identical" if r["first_divergence"] is None else f"from position {r['first_divergence']}"
                lines.append(f"| {shape} | {batch} | {name} | {r['ms_per_token']:.4f} ({r['min']:.4f}-{r['max']:.4f}) "
                             f"| {r['delta_ms']:+.4f} | {div} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="4B,0.8B",
                   help="comma list of real shapes (0.8B, 4B, 9B, 27B; the MoE 35B-A3B) or 'tiny' / 'tiny-moe'")
    p.add_argument("--batches", default="1")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="timed generate pairs per variant (median)")
    p.add_argument("--variant", action="append", required=True,
                   help="NAME:MODULE.CONSTANT=VALUE,... (repeatable; the first is the baseline)")
    p.add_argument("--out", default="out/ab")
    args = p.parse_args(argv)
    if args.new_tokens < 1:
        raise ValueError(f"--new-tokens must be at least 1, got {args.new_tokens}.")

    modules = variant_modules()
    variants = [parse_variant(v, modules) for v in args.variant]
    names = [name for name, _ in variants]
    if len(set(names)) != len(names):
        raise ValueError(f"variant names must differ, got {names}.")
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    batches = [int(b) for b in args.batches.split(",") if b]
    command = "python scripts/ab_decode.py " + " ".join(argv if argv is not None else sys.argv[1:])
    results = {"meta": {"date": time.strftime("%Y-%m-%d %H:%M"), "torch": torch.__version__,
                        "device_name": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                        "dtype": args.dtype, "variants": args.variant, "command": command},
               "models": {}}
    out = Path(args.out)
    for shape in args.shapes.split(","):
        log(f"building {shape} ({args.dtype}, {device})")
        stock, model = build_pair(shape, None, device, dtype)
        del stock
        results["models"][shape] = ab_shape(model, variants, batches, args.prompt_len, args.new_tokens, args.repeats,
                                            device)
        out.mkdir(parents=True, exist_ok=True)
        (out / "ab.json").write_text(json.dumps(results, indent=2))  # after each shape: a cut-off run keeps it
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    write_report(out, "ab", results, to_markdown(results))
    return results


if __name__ == "__main__":
    main()
