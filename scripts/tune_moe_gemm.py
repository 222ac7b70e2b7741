"""Tile candidates of the MoE experts' kernels, timed at a real MoE shape on one GPU: the prefill grouped GEMMs
(`fused_ops_moe_gemm._GATE_UP_TILES`, `_DOWN_TILES`) and the decode GEMVs (`fused_ops_moe._DECODE_GATE_UP`,
`_DECODE_DOWN`, `_DECODE_DOWN_ONE_TOKEN`), against the floors and stock's `grouped_mm` experts on the same routing.

    python scripts/tune_moe_gemm.py --tokens 2048 --decode-tokens 1,8 --out out/tune_moe
    # CPU smoke run (Triton interpreter; the times mean nothing)
    python scripts/tune_moe_gemm.py --shape tiny --device cpu --tokens 40 --decode-tokens 1 --repeats 1

Each prefill candidate varies one GEMM's tiles (the other keeps its default) and times all of `moe_experts` at T
tokens routed by the block's random router (CUDA events, median of --repeats); each decode candidate sets both GEMVs
and times `moe_experts` with the shared expert as a slot replayed from a CUDA graph (as the decode step runs it: no
host launch time), L2 flushed before each replay (a decode step meets the weights cold). On the H200 these decode
rows ranked the tiles unlike the decode step's own profile (`benchmark_moe_model.py --profile`), which chose them. Floors: the read of the experts the
tokens pick (and the shared expert at decode) at the measured copy rate; at prefill also the routed FLOPs at the
measured bf16 GEMM rate. The constants in the kernel modules cite
this script's run; it prints a table and writes `tune_moe.json` / `.md` to --out.
"""

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from scripts.benchmark_moe import SHAPES, Timer, build_block, ceilings, graphed, with_impl  # noqa: E402
from scripts.common import import_module, write_report  # noqa: E402

# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)
GATE_UP_CANDIDATES = [(64, 128, 64, 4, 3), (64, 64, 64, 4, 4), (64, 64, 128, 4, 3), (64, 64, 64, 4, 5),
                      (32, 64, 64, 4, 4), (64, 32, 128, 4, 4), (128, 64, 64, 8, 4), (64, 64, 64, 8, 4),
                      (32, 128, 64, 4, 4), (64, 64, 32, 4, 6)]
DOWN_CANDIDATES = [(64, 128, 64, 4, 3), (64, 64, 64, 4, 4), (64, 128, 64, 4, 4), (32, 128, 64, 4, 3),
                   (128, 128, 64, 8, 3), (64, 64, 128, 4, 3), (128, 256, 64, 8, 3), (64, 128, 32, 4, 5)]
# ((BLOCK_N, BLOCK_K, warps, unroll) gate|up, (BLOCK_N, BLOCK_K, warps, unroll) down)
DECODE_CANDIDATES = [((4, 512, 4, 1), (4, 256, 4, 1)), ((16, 256, 4, 1), (4, 256, 4, 1)),
                     ((16, 256, 4, 2), (4, 256, 4, 2)), ((8, 512, 4, 2), (4, 256, 4, 1)),
                     ((8, 256, 4, 1), (4, 256, 4, 1)), ((2, 1024, 4, 1), (4, 256, 4, 1)),
                     ((4, 1024, 8, 1), (4, 256, 4, 1)), ((8, 512, 8, 1), (4, 256, 4, 1)),
                     ((16, 256, 4, 1), (2, 512, 4, 1)), ((16, 256, 4, 1), (8, 128, 4, 2)),
                     ((16, 256, 4, 1), (4, 512, 8, 1)), ((16, 256, 4, 1), (2, 256, 2, 2)),
                     ((16, 256, 4, 1), (8, 256, 8, 1))]


def routing(block, T: int, device, dtype):
    torch.manual_seed(T)
    x = torch.randn(T, block.gate.hidden_dim, device=device, dtype=dtype)
    with torch.no_grad():
        _, weights, ids = block.gate(x)
    return x, weights, ids


def tune_prefill(block, T: int, repeats: int, ceil: dict, device, dtype) -> dict:
    gemm = import_module("fused_ops_moe_gemm")
    x, weights, ids = routing(block, T, device, dtype)
    gu, dn = block.experts.gate_up_proj.detach(), block.experts.down_proj.detach()
    timer = Timer(device)
    E, I, H = dn.shape[0], dn.shape[2], dn.shape[1]
    hit = len(torch.unique(ids))
    size = gu.element_size()
    floors = {"read_ms": 1e3 * hit * 3 * I * H * size / ceil["copy_bytes_per_s"],
              "flop_ms": 1e3 * 2 * ids.numel() * 3 * I * H / ceil["bf16_flops_per_s"]}
    rows = []
    default = (gemm._GATE_UP_TILES, gemm._DOWN_TILES)
    cands = [("gate_up", c, (c, default[1])) for c in GATE_UP_CANDIDATES]
    cands += [("down", c, (default[0], c)) for c in DOWN_CANDIDATES]
    ref = gemm.moe_experts_prefill(x, gu, dn, weights, ids)
    for which, tile, tiles in cands:
        try:
            call = lambda: gemm.moe_experts_prefill(x, gu, dn, weights, ids, tiles=tiles)  # noqa: E731
            y = call().double()
            diff = ((y - ref.double()).norm() / ref.double().norm()).item()  # another K split sums in another order
            ms = statistics.median(timer(call) for _ in range(repeats))
            rows.append({"gemm": which, "tile": tile, "ms": ms, "rel_diff_vs_default": diff})
        except Exception as err:  # noqa: BLE001 - a candidate that does not compile is reported
            rows.append({"gemm": which, "tile": tile, "error": f"{type(err).__name__}: {err}"[:200]})
        print(f"T={T} {rows[-1]}", flush=True)
    stock = {}
    for impl in ("grouped_mm",):
        try:
            call = with_impl(block, impl, lambda: block.experts(x, ids, weights))
            call()
            stock[impl] = statistics.median(timer(call) for _ in range(repeats))
        except Exception as err:  # noqa: BLE001
            stock[impl] = f"{type(err).__name__}: {err}"[:200]
    return {"experts_hit": hit, "floors": floors, "candidates": rows, "stock": stock}


def tune_decode(block, T: int, repeats: int, ceil: dict, device, dtype) -> dict:
    moe = import_module("fused_ops_moe")
    x, weights, ids = routing(block, T, device, dtype)
    gu, dn = block.experts.gate_up_proj.detach(), block.experts.down_proj.detach()
    se = block.shared_expert
    shared_w = (torch.cat([se.gate_proj.weight, se.up_proj.weight]).detach(), se.down_proj.weight.detach())
    sg = torch.randn(T, 1, device=device, dtype=dtype)
    timer = Timer(device, flush=True)
    E, I, H = dn.shape[0], dn.shape[2], dn.shape[1]
    size = gu.element_size()
    read = (len(torch.unique(ids)) + 1) * 3 * I * H * size
    rows = []
    saved = (moe._DECODE_GATE_UP, moe._DECODE_DOWN, moe._DECODE_DOWN_ONE_TOKEN)
    try:
        for cand in DECODE_CANDIDATES:
            moe._DECODE_GATE_UP, moe._DECODE_DOWN = cand
            moe._DECODE_DOWN_ONE_TOKEN = cand[1]
            try:
                call = lambda _=None: moe.moe_experts(x, gu, dn, weights, ids, shared_gate=sg,  # noqa: E731
                                                      shared_experts=shared_w)
                call = graphed(call, None) if device.type == "cuda" else call
                ms = statistics.median(timer(call) for _ in range(repeats))
                rows.append({"tile": cand, "ms": ms})
            except Exception as err:  # noqa: BLE001
                rows.append({"tile": cand, "error": f"{type(err).__name__}: {err}"[:200]})
            print(f"decode T={T} {rows[-1]}", flush=True)
    finally:
        moe._DECODE_GATE_UP, moe._DECODE_DOWN, moe._DECODE_DOWN_ONE_TOKEN = saved
    return {"floor_ms": 1e3 * read / ceil["copy_bytes_per_s"], "candidates": rows}


def table(results: dict) -> str:
    lines = ["| T | kernel | tile | ms | x floor |", "|---|---|---|---|---|"]
    for T, r in results["prefill"].items():
        f = r["floors"]
        floor = max(f["read_ms"], f["flop_ms"])
        lines.append(f"| {T} | floor | read {f['read_ms']:.3f} / flops {f['flop_ms']:.3f} | | |")
        for impl, ms in r["stock"].items():
            lines.append(f"| {T} | stock {impl} (experts) | | {ms if isinstance(ms, str) else f'{ms:.3f}'} | |")
        for row in r["candidates"]:
            ms = row.get("ms")
            lines.append(f"| {T} | {row['gemm']} | {row['tile']} | "
                         + (f"{ms:.3f} | {ms / floor:.2f}x |" if ms is not None else f"{row['error'][:60]} | |"))
    for T, r in results["decode"].items():
        lines.append(f"| {T} | decode floor | | {r['floor_ms']:.4f} | |")
        for row in r["candidates"]:
            ms = row.get("ms")
            cells = f"{ms:.4f} | {ms / r['floor_ms']:.2f}x |" if ms is not None else f"{row['error'][:60]} | |"
            lines.append(f"| {T} | decode GEMVs | {row['tile']} | " + cells)
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="35B-A3B", choices=sorted(SHAPES))
    p.add_argument("--tokens", default="2048", help="prefill token counts (T > 16)")
    p.add_argument("--decode-tokens", default="1,8", help="decode token counts (T <= 16)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default="out/tune_moe")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    block = build_block(args.shape, dtype, device)
    ceil = ceilings(device)
    results = {"ceilings": ceil, "prefill": {}, "decode": {}}
    for T in (int(t) for t in args.tokens.split(",") if t):
        results["prefill"][str(T)] = tune_prefill(block, T, args.repeats, ceil, device, dtype)
    for T in (int(t) for t in args.decode_tokens.split(",") if t):
        results["decode"][str(T)] = tune_decode(block, T, args.repeats, ceil, device, dtype)
    write_report(Path(args.out), "tune_moe", results, table(results))
    print(table(results))
    return results


if __name__ == "__main__":
    main()
