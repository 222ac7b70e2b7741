"""Qwen3.5-MoE's sparse block, ours against stock: `fused_ops.moe_route` + `fused_ops.moe_experts` against stock
`Qwen3_5MoeSparseMoeBlock` under each of its experts implementations, on the same weights, in one process.

    # the 35B-A3B shape on a GPU (hidden 2048, 256 experts, top-8, expert and shared intermediate 512, bf16)
    python scripts/benchmark_moe.py --shape 35B-A3B --tokens 1,8,2048 --out out/moe
    # CPU smoke run (Triton interpreter; the times mean nothing)
    python scripts/benchmark_moe.py --shape tiny --device cpu --tokens 1,8,40 --repeats 2

Variants, each timed on the same x [T, H]:
- `fused`: the block as the fused model can run it: one GEMM for the router and the shared expert's gate (packed),
  `moe_route`, the shared expert (packed gate|up GEMM, `fused_ops.swiglu`, down GEMM), `moe_experts`; at decode
  sizes (`fused_ops.moe_shared_in_slots`) the shared expert as a slot of `moe_experts`' GEMVs instead; eager.
- `fused-graph`: the same replayed from a CUDA graph (how the fused model runs a decode step; GPU only).
- `stock-<impl>`: `Qwen3_5MoeSparseMoeBlock.forward` with `config._experts_implementation = impl`, for `eager` and
  each of `grouped_mm`, `batched_mm` that this transformers registers; eager (stock's `eager` syncs the host).
- `experts-ours` / `experts-stock-<impl>`: the routed experts alone (`moe_experts` without the shared expert,
  `Qwen3_5MoeExperts.forward`), on the same routing.

Each time: CUDA events around the call, with L2 flushed before each (a 256 MB write), as a decode step meets the
layer's weights; median and p90 over --repeats. The floors, from ceilings measured in the same run (device copy
rate, bf16 GEMM rate on 8192^3): decode (T <= 16) = bytes of the weights the call must read (router + shared gate,
the union of the experts the T tokens picked, the shared expert) / copy rate; prefill = active FLOPs
(2 T (E H + H + k 3 I H + 3 I_s H)) / GEMM rate. The experts-only rows use the experts' part of each.
Writes `moe.json` and `moe.md` to --out.
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from scripts.common import import_module, write_report  # noqa: E402

SHAPES = {
    "35B-A3B": dict(hidden_size=2048, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                    shared_expert_intermediate_size=512),
    "tiny": dict(hidden_size=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                 shared_expert_intermediate_size=48),
}
STOCK_IMPLS = ("eager", "grouped_mm", "batched_mm")
_FLUSH_BYTES = 256 << 20  # > 5x the H200's 50 MB L2
# stock `batched_mm` copies each (token, slot)'s expert weights out first: 6.3 MB a pair at 35B-A3B in bf16, so
# 100 GB at T=2048; past this many bytes it is reported as skipped instead of run out of memory
_BATCHED_MM_MAX_BYTES = 16 << 30


def build_block(shape: str, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """Stock `Qwen3_5MoeSparseMoeBlock` at `shape` with random weights (each matrix ~ N(0, 1/fan_in))."""
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

    cfg = Qwen3_5MoeTextConfig(**SHAPES[shape])
    cfg._experts_implementation = "eager"
    torch.manual_seed(seed)
    with torch.device(device):
        block = Qwen3_5MoeSparseMoeBlock(cfg).to(dtype)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, p.shape[-1] ** -0.5)
    return block.eval()


def stock_impls() -> list[str]:
    """The experts implementations of `STOCK_IMPLS` that this transformers registers (`eager` always)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    return [impl for impl in STOCK_IMPLS if impl == "eager" or impl in ALL_EXPERTS_FUNCTIONS]


def fused_block(block, fused_ops):
    """x [T, H] -> y [T, H]: the block through our ops, on `block`'s weights (packed copies where packed)."""
    E, k = block.gate.num_experts, block.gate.top_k
    router = torch.cat([block.gate.weight, block.shared_expert_gate.weight]).detach()  # [E + 1, H]
    se = block.shared_expert
    shared_gate_up = torch.cat([se.gate_proj.weight, se.up_proj.weight]).detach()  # [2 I_s, H]
    shared_down = se.down_proj.weight.detach()
    gate_up, down = block.experts.gate_up_proj.detach(), block.experts.down_proj.detach()

    def forward(x):
        logits_gate = F.linear(x, router)  # [T, E + 1]: router logits | shared expert's gate logit
        weights, ids = fused_ops.moe_route(logits_gate[:, :E], k)
        if fused_ops.moe_shared_in_slots(x.shape[0], down.shape[2], shared_down.shape[1]):  # as the fused block
            return fused_ops.moe_experts(x, gate_up, down, weights, ids, shared_gate=logits_gate[:, E:],
                                         shared_experts=(shared_gate_up, shared_down))
        shared = F.linear(fused_ops.swiglu(F.linear(x, shared_gate_up)), shared_down)
        return fused_ops.moe_experts(x, gate_up, down, weights, ids, shared, logits_gate[:, E:])

    return forward


def ceilings(device: torch.device) -> dict:
    """Copy rate (bytes read + written per s) and bf16 GEMM rate (FLOP/s), measured now (small sizes on CPU)."""
    timer = Timer(device)
    big = device.type == "cuda"
    src = torch.randn((1 << 29) if big else (1 << 22), device=device, dtype=torch.bfloat16)  # 1 GiB / 8 MiB
    dst = torch.empty_like(src)
    copy_ms = statistics.median(timer(lambda: dst.copy_(src)) for _ in range(20 if big else 3))
    n = 8192 if big else 256
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    a @ b
    gemm_ms = statistics.median(timer(lambda: a @ b) for _ in range(10 if big else 3))
    return {"copy_bytes_per_s": 2 * src.nbytes / (copy_ms * 1e-3), "bf16_flops_per_s": 2 * n**3 / (gemm_ms * 1e-3)}


class Timer:
    """Milliseconds of one call: CUDA events on a GPU (after an L2 flush when `flush`), perf_counter on CPU."""

    def __init__(self, device: torch.device, flush: bool = False):
        self.cuda = device.type == "cuda"
        self.scratch = torch.empty(_FLUSH_BYTES, dtype=torch.uint8, device=device) if flush and self.cuda else None

    def __call__(self, fn) -> float:
        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        if self.scratch is not None:
            self.scratch.fill_(1)  # evicts the weights from L2: a decode step meets each layer's weights cold
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)


def stats(times: list[float]) -> dict:
    times = sorted(times)
    return {"median_ms": statistics.median(times), "p90_ms": times[min(len(times) - 1, int(0.9 * len(times)))],
            "n": len(times)}


def floors(block, ids: torch.Tensor, T: int, dtype: torch.dtype, ceil: dict) -> dict:
    """(block floor, experts-only floor) in ms for T tokens routed to `ids`: the weight read at decode (T <= 16),
    the active FLOPs at prefill."""
    cfg = block.experts.config
    E, H, I, I_s, k = (cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                       cfg.shared_expert_intermediate_size, cfg.num_experts_per_tok)
    if T <= import_module("fused_ops_moe")._DECODE_MAX_T:
        size = torch.finfo(dtype).bits // 8
        experts = len(torch.unique(ids)) * 3 * I * H * size
        block_bytes = experts + ((E + 1) * H + 3 * I_s * H) * size
        rate = ceil["copy_bytes_per_s"]  # bytes read + written a second, as benchmark_latency's weight-read floor
        return {"kind": "weight read", "block_ms": 1e3 * block_bytes / rate, "experts_ms": 1e3 * experts / rate,
                "block_bytes": block_bytes}
    experts = 2 * T * k * 3 * I * H
    block_flops = experts + 2 * T * ((E + 1) * H + 3 * I_s * H)
    rate = ceil["bf16_flops_per_s"]
    return {"kind": "active flops", "block_ms": 1e3 * block_flops / rate, "experts_ms": 1e3 * experts / rate,
            "block_flops": block_flops}


def graphed(fn, x):
    """`fn(x)` captured in a CUDA graph; returns the replay (a no-argument callable)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(x)
    return graph.replay


def bench_tokens(block, T: int, dtype, device, repeats: int, ceil: dict, fused_ops) -> dict:
    """Every variant at T tokens: {variant: stats}, the floors, and ours' distance from stock."""
    H = block.gate.hidden_dim
    torch.manual_seed(T)
    x = torch.randn(T, H, device=device, dtype=dtype)
    timer = Timer(device, flush=True)
    ours = fused_block(block, fused_ops)
    with torch.no_grad():
        _, weights, ids = block.gate(x)
        calls = {"fused": lambda: ours(x)}
        if device.type == "cuda":
            calls["fused-graph"] = graphed(ours, x)
        gate_up, down = block.experts.gate_up_proj, block.experts.down_proj
        calls["experts-ours"] = lambda: fused_ops.moe_experts(x, gate_up, down, weights, ids)
        out = {"times": {}, "errors": {}}
        for impl in stock_impls():
            gathered = ids.numel() * (gate_up[0].nbytes + down[0].nbytes)
            if impl == "batched_mm" and gathered > _BATCHED_MM_MAX_BYTES:
                for name in (f"stock-{impl}", f"experts-stock-{impl}"):
                    out["errors"][name] = f"skipped: it would gather {gathered / 1e9:.0f} GB of expert weights"
                continue
            calls[f"stock-{impl}"] = with_impl(block, impl, lambda: block(x[None]))
            calls[f"experts-stock-{impl}"] = with_impl(block, impl, lambda: block.experts(x, ids, weights))
        for name, call in calls.items():
            try:
                call()  # compiles / warms up
                out["times"][name] = stats([timer(call) for _ in range(repeats)])
            except Exception as err:  # noqa: BLE001 - a variant this machine cannot run is reported, not fatal
                out["errors"][name] = f"{type(err).__name__}: {err}"[:300]
        set_impl(block, "eager")
        y_stock = block(x[None])[0]
        out["rel_err_vs_stock_eager"] = ((ours(x).double() - y_stock.double()).norm()
                                         / y_stock.double().norm()).item()
    out["floor"] = floors(block, ids, T, dtype, ceil)
    return out


def set_impl(block, impl: str) -> None:
    """Stock's experts read `config._experts_implementation` on every call."""
    block.experts.config._experts_implementation = impl


def with_impl(block, impl: str, fn):
    """`fn` run with the block's experts implementation set to `impl`."""
    def call():
        set_impl(block, impl)
        return fn()

    return call


def table(results: dict) -> str:
    lines = ["| T | variant | median ms | p90 ms | x floor |", "|---|---|---|---|---|"]
    for T, r in results["tokens"].items():
        f = r["floor"]
        lines.append(f"| {T} | floor ({f['kind']}) | block {f['block_ms']:.4f} / experts {f['experts_ms']:.4f} | "
                     f"fused vs stock: rel_err {r['rel_err_vs_stock_eager']:.2g} | |")
        for name, s in r["times"].items():
            floor = f["experts_ms"] if name.startswith("experts") else f["block_ms"]
            lines.append(f"| {T} | {name} | {s['median_ms']:.4f} | {s['p90_ms']:.4f} | {s['median_ms'] / floor:.2f} |")
        for name, err in r["errors"].items():
            lines.append(f"| {T} | {name} | failed: {err[:80]} | | |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="35B-A3B", choices=sorted(SHAPES))
    p.add_argument("--tokens", default="1,8,2048", help="comma list of token counts T (decode: T <= 16)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--device", default="cuda")
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--out", default="out/moe")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":  # our kernels run on CPU tensors only under the Triton interpreter
        os.environ.setdefault("TRITON_INTERPRET", "1")
    elif not torch.cuda.is_available():
        raise SystemExit("benchmark_moe.py: no CUDA device; pass --device cpu for a smoke run.")
    fused_ops = import_module("fused_ops")
    if not fused_ops.HAS_TRITON:
        raise SystemExit("benchmark_moe.py needs triton for the fused ops.")
    dtype = getattr(torch, args.dtype)
    block = build_block(args.shape, dtype, device)
    ceil = ceilings(device)
    results = {"meta": {"command": "python scripts/benchmark_moe.py " + " ".join(argv if argv is not None
                                                                                 else sys.argv[1:]),
                        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                        "torch": torch.__version__, "shape": SHAPES[args.shape], "dtype": args.dtype,
                        "ceilings": ceil, "stock_impls": stock_impls()},
               "tokens": {}}
    for T in (int(t) for t in args.tokens.split(",")):
        print(f"[{time.strftime('%H:%M:%S')}] T={T}", flush=True)
        results["tokens"][str(T)] = bench_tokens(block, T, dtype, device, args.repeats, ceil, fused_ops)
    write_report(Path(args.out), "moe", results, table(results))
    return results


if __name__ == "__main__":
    main()
