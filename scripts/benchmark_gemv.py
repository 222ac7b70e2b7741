"""The decode step's linears, one by one: cuBLAS against each `fused_ops_gemv.gemv` config (1-16 rows) and each
`fused_ops_gemv.skinny_gemm` config (2-32 rows, 16-bit), timed as the step meets them, and what
`fused_ops_gemv.small_linear` picks for each shape in this process.

    python scripts/benchmark_gemv.py --shapes 0.8B,4B,9B --rows 1,8 --out out/gemv

Each candidate is timed by `fused_ops_gemv._time_in_graph_ms`, the method `small_linear` chooses by, but over more
copies of the weight (together over 400 MB, where `small_linear` holds at most 64 MB of copies): captured in a CUDA
graph that calls it on each copy in turn, twice over, and replayed; the median time per call includes the gap between
launches inside a graph, and programmatic dependent launch's overlap, as in the step.
Prints, per shape and row count, every candidate's microseconds and the bandwidth of the best against the copy
floor (bytes / 4.2 TB/s, the H200's measured copy rate), and `small_linear`'s choice, so a mismatch between the
choice and the graph-timed best shows. Writes `gemv.json` to --out. Needs a CUDA GPU.
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from scripts.common import import_module, real_text_kwargs  # noqa: E402

COPY_TB_S = 4.2  # the H200's device copy rate measured by benchmark_latency.py (4.17-4.22 TB/s in its runs)
# The configs of fused_ops_gemv._GEMV_CONFIGS plus the others of the first sweep and small tiles whose accumulator
# fits at 8 rows, and every config with its tile loop unrolled 2 and 4 times, so a sweep can show a better one.
_OTHERS = ((4, 1024, 4, False), (16, 256, 8, False), (4, 2048, 8, False), (8, 1024, 8, False),
           (1, 256, 4, False), (2, 256, 4, False), (4, 128, 4, False), (1, 512, 4, False), (2, 512, 8, False),
           (4, 256, 8, False))


# `skinny_gemm` configs beyond `fused_ops_gemv._SKINNY_CONFIGS`: other tiles and pipeline depths.
_SKINNY_OTHERS = ((16, 128, 4, 6), (16, 1024, 4, 2), (32, 512, 4, 3), (16, 256, 2, 4), (64, 128, 4, 6))


def skinny_configs(fused_ops_gemv) -> tuple:
    return tuple(dict.fromkeys((*fused_ops_gemv._SKINNY_CONFIGS,
                                *(fused_ops_gemv.SkinnyConfig(*c) for c in _SKINNY_OTHERS))))


def extra_configs(fused_ops_gemv) -> tuple:
    base = [fused_ops_gemv.GemvConfig(*c) for c in (*fused_ops_gemv._GEMV_CONFIGS, *_OTHERS)]
    return tuple(c._replace(unroll=u) for u in (1, 2, 4) for c in base)


def decode_linears(size: str) -> dict:
    """name -> (N, K, gate_up) of each distinct linear in a decode step of the real `size` shape."""
    c = real_text_kwargs(size)
    hidden, inter = c["hidden_size"], c["intermediate_size"]
    key_dim = c["linear_num_key_heads"] * c["linear_key_head_dim"]
    value_dim = c["linear_num_value_heads"] * c["linear_value_head_dim"]
    heads, kv_heads, head_dim = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    return {
        "deltanet_in": (2 * key_dim + 2 * value_dim + 2 * c["linear_num_value_heads"], hidden, False),
        "deltanet_out": (hidden, value_dim, False),
        "attn_in": (2 * heads * head_dim + 2 * kv_heads * head_dim, hidden, False),
        "attn_out": (hidden, heads * head_dim, False),
        "gate_up": (2 * inter, hidden, True),
        "down": (hidden, inter, False),
        "lm_head": (c["vocab_size"], hidden, False),
    }


def sweep(fused_ops_gemv, sizes, rows, dtype, kernels=("gemv", "skinny")) -> dict:
    configs = tuple(dict.fromkeys(fused_ops_gemv._GEMV_CONFIGS + extra_configs(fused_ops_gemv)))
    skinny = skinny_configs(fused_ops_gemv) if dtype != torch.float32 else ()
    fused_ops_gemv.RECORD_CHOICES = False  # small_linear's pick is timed here, not read from an earlier process
    results = {}
    for size in sizes:
        for name, (N, K, gate_up) in decode_linears(size).items():
            nbytes = N * K * torch.finfo(dtype).bits // 8
            copies = max(2, min(16, int(400e6 // nbytes) + 1))
            weights = [torch.randn(N, K, device="cuda", dtype=dtype) / K**0.5 for _ in range(copies)]
            for M in rows:
                x = torch.randn(M, K, device="cuda", dtype=dtype)
                row = {"cublas": 1e3 * fused_ops_gemv._time_in_graph_ms(
                    lambda w: fused_ops_gemv._run_small_linear(x, w, gate_up, "cublas"), weights)}
                for config in configs if "gemv" in kernels and M <= fused_ops_gemv._GEMV_MAX_M else ():
                    row[str(config)] = 1e3 * fused_ops_gemv._time_in_graph_ms(
                        lambda w, c=config: fused_ops_gemv.gemv(x, w, gate_up, c), weights)
                for config in skinny if "skinny" in kernels and M <= fused_ops_gemv._SKINNY_MAX_M else ():
                    row[str(config)] = 1e3 * fused_ops_gemv._time_in_graph_ms(
                        lambda w, c=config: fused_ops_gemv.skinny_gemm(x, w, gate_up, c), weights)
                fused_ops_gemv._small_linear_choice.clear()
                fused_ops_gemv.small_linear(x, weights[0], gate_up)
                (choice,) = fused_ops_gemv._small_linear_choice.values()
                best = min(row, key=row.get)
                entry = {"N": N, "K": K, "gate_up": gate_up, "M": M, "mb": nbytes / 1e6,
                         "floor_us": nbytes / (COPY_TB_S * 1e6), "us": row, "best": best,
                         "best_tb_s": nbytes / row[best] / 1e6, "small_linear_choice": str(choice),
                         "choice_us": row.get(str(choice))}
                results[f"{size}/{name}/M{M}"] = entry
                print(f"{size:>4} {name:<12} {N:>6}x{K:<6} M={M:<2} floor {entry['floor_us']:7.1f} us | cuBLAS "
                      f"{row['cublas']:7.1f} | best {best} {row[best]:7.1f} us ({entry['best_tb_s']:.2f} TB/s) | "
                      f"small_linear picks {choice} ({entry['choice_us'] or float('nan'):.1f} us)", flush=True)
            del weights
            torch.cuda.empty_cache()
    return results


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="0.8B,4B,9B")
    p.add_argument("--rows", default="1,8", help="comma list of decode batch sizes (rows of x)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--kernels", default="gemv,skinny", help="comma list of the kernels timed against cuBLAS")
    p.add_argument("--out", default="out/gemv")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmark_gemv.py times CUDA kernels inside CUDA graphs: it needs a CUDA GPU.")
    reason = import_module("fused_ops").kernels_available()
    if reason is not None:
        raise SystemExit(f"the fused kernels cannot run here: {reason}.")
    results = sweep(import_module("fused_ops_gemv"), args.shapes.split(","), [int(r) for r in args.rows.split(",")],
                    getattr(torch, args.dtype), tuple(args.kernels.split(",")))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"command": "python scripts/benchmark_gemv.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    (out / "gemv.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    return results


if __name__ == "__main__":
    main()
