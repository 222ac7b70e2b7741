"""Speculative decoding with the MTP head against the non-speculative fused decode, at a controlled acceptance rate.

    # real shapes with random weights (the model and its MTP head), k = 1..3, acceptance 0.5 / 0.7 / 0.9
    python scripts/benchmark_speculative.py --shapes 0.8B,4B,9B,27B,35B-A3B --dtype bfloat16 --out out/spec
    # CPU smoke run (what CI runs): tiny config, the fused path as the tests' CPU emulation
    python scripts/benchmark_speculative.py --device cpu --tiny --new-tokens 6 --repeats 1

Random weights draft nothing the model would say, so the acceptance is set instead: the non-speculative greedy run
gives the model's own tokens, and in the speculative run each draft of the head is replaced, after the head has run
and before the verify pass (``fused_speculative.override_drafts``), by the model's own token at that position with
probability ``a``, else by another token. The work of a round is unchanged (the head runs in full, the verify pass
over k + 1 tokens costs the same whatever they are); only which tokens are accepted is set. In fp32 greedy speculative output
equals the non-speculative one (a difference raises), so the replaced drafts are accepted exactly as a head that
drafts right with probability ``a`` would be. In bf16 / fp16 the verify pass sums each linear over k + 1 rows where a
step sums one, and a random model's near-ties can then part the two runs (an H200 4B bf16 run did); past the parting
the reference tokens are no longer the model's, so the realized acceptance falls below the set one. Both are
reported, with the first parting (new tokens).

Reports, per shape, for the non-speculative fused decode and for each (k, a): ms per emitted token, (time of N new
tokens - time of 1) / (N - 1), median of --repeats; the realized acceptance (accepted / drafted); tokens per verify
round; and the single-token weight-read floor (the bytes a decode step reads / the device's copy bandwidth, measured
now; GPU only). Writes ``speculative.json`` / ``speculative.md`` to --out.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from scripts import benchmark_latency  # noqa: E402
from scripts.common import REAL_MOE_SHAPES, REAL_SHAPES, import_module, write_report  # noqa: E402


def build_model(shape: str, device, dtype, layers: int = 0):
    """The fused causal LM of ``shape`` with random weights and a one-layer MTP head (``mtp_num_hidden_layers=1``,
    as the real checkpoints), built in ``dtype`` on ``device``."""
    kwargs, _, fused_cls, fused_config = benchmark_latency._classes(shape, layers)
    config = fused_config(**kwargs, fused_kernels=True, mtp_num_hidden_layers=1)
    torch.manual_seed(0)
    with torch.device(device):
        return fused_cls._from_config(config, dtype=dtype).eval()


def oracle(reference: torch.Tensor, rate: float, vocab: int, seed: int = 0):
    """A draft override: each draft becomes the model's own token at its position (from ``reference``, the
    non-speculative greedy sequence) with probability ``rate``, else a different token."""
    g = torch.Generator().manual_seed(seed)

    def override(drafts, input_ids):
        cur = input_ids.shape[1]
        want = reference[:, cur : cur + drafts.shape[1]].to(drafts.device)
        right = (torch.rand(want.shape[1], generator=g) < rate).to(drafts.device)
        out = drafts.clone()
        out[:, : want.shape[1]] = torch.where(right, want, (want + 1) % vocab)
        return out

    return override


def timed_generate(model, ids, n: int, k: int, device) -> tuple[float, torch.Tensor]:
    """(ms, sequence) of a greedy ``generate`` of exactly ``n`` new tokens with ``k`` drafts a round."""
    timer = benchmark_latency.Timer(device)
    out = {}

    def run():
        out["ids"] = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                    min_new_tokens=n, do_sample=False, pad_token_id=0, mtp_speculative_tokens=k)

    with torch.inference_mode():
        ms = timer(run)
    return ms, out["ids"]


def per_token_ms(model, ids, new_tokens: int, k: int, device, repeats: int) -> list[float]:
    """(time of ``new_tokens`` - time of 1) / (``new_tokens`` - 1), ``repeats`` times, after one warm-up pair."""
    timed_generate(model, ids, 1, k, device)
    timed_generate(model, ids, new_tokens, k, device)
    values = []
    for _ in range(repeats):
        one, _ = timed_generate(model, ids, 1, k, device)
        many, _ = timed_generate(model, ids, new_tokens, k, device)
        values.append((many - one) / (new_tokens - 1))
    return values


def run_shape(shape: str, args, device, dtype, ceilings: dict) -> dict:
    spec = import_module("fused_speculative")
    model = build_model(shape, device, dtype, args.layers)
    counts = benchmark_latency.param_counts(model)
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (1, args.prompt_len), generator=torch.Generator().manual_seed(0)).to(device)
    _, reference = timed_generate(model, ids, args.new_tokens, 0, device)
    reference = reference.cpu()
    plain = per_token_ms(model, ids, args.new_tokens, 0, device, args.repeats)
    row = {"params": counts, "plain": {"ms_per_token": statistics.median(plain), "runs": plain}, "speculative": {}}
    bandwidth = ceilings.get("copy_bytes_per_s")
    # the MTP head is read too in a speculative round, but the floor is the plain single-token step's
    row["floor_ms"] = counts["read_bytes"] / bandwidth * 1e3 if bandwidth else None
    for k in args.k:
        for rate in args.acceptance:
            with spec.override_drafts(oracle(reference, rate, vocab)), spec.record_rounds() as rounds:
                values = per_token_ms(model, ids, args.new_tokens, k, device, args.repeats)
                rounds.clear()
                _, out = timed_generate(model, ids, args.new_tokens, k, device)
            parted = (out.cpu() != reference).flatten().nonzero()
            parting = int(parted[0]) - args.prompt_len if len(parted) else None
            if parting is not None and dtype == torch.float32:
                raise RuntimeError(f"{shape} k={k} a={rate}: fp32 speculative greedy tokens differ from "
                                   f"non-speculative at new token {parting}")
            drafted, accepted = sum(d for d, _ in rounds), sum(n for _, n in rounds)
            row["speculative"][f"k{k}-a{rate}"] = {
                "k": k, "acceptance_set": rate, "ms_per_token": statistics.median(values), "runs": values,
                "acceptance": accepted / drafted if drafted else None,
                "tokens_per_round": (args.new_tokens - 1) / len(rounds) if rounds else None,
                "first_parting": parting,
            }
            benchmark_latency.log(f"{shape} k={k} a={rate}: {statistics.median(values):.3f} ms/token "
                                  f"(plain {row['plain']['ms_per_token']:.3f})")
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def to_markdown(results: dict) -> str:
    lines = ["| model | k | a set | a realized | parts at | tokens / round | ms / token | plain ms / token | speed-up | "
             "floor ms | / floor |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for shape, row in results["models"].items():
        plain, floor = row["plain"]["ms_per_token"], row["floor_ms"]
        lines.append(f"| {shape} | 0 | - | - | - | 1 | {plain:.3f} | {plain:.3f} | 1.00x | "
                     + (f"{floor:.3f} | {plain / floor:.2f}x |" if floor else "- | - |"))
        for r in row["speculative"].values():
            realized = f"{r['acceptance']:.2f}" if r["acceptance"] is not None else "-"
            per_round = f"{r['tokens_per_round']:.2f}" if r["tokens_per_round"] is not None else "-"
            parts = "-" if r.get("first_parting") is None else str(r["first_parting"])
            lines.append(f"| {shape} | {r['k']} | {r['acceptance_set']} | {realized} | {parts} | {per_round} | "
                         f"{r['ms_per_token']:.3f} | {plain:.3f} | {plain / r['ms_per_token']:.2f}x | "
                         + (f"{floor:.3f} | {r['ms_per_token'] / floor:.2f}x |" if floor else "- | - |"))
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="0.8B,4B,9B,27B,35B-A3B",
                   help=f"comma list of {', '.join([*REAL_SHAPES, *REAL_MOE_SHAPES])}")
    p.add_argument("--tiny", action="store_true", help="the tiny test config instead of --shapes (CPU smoke runs)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--k", default="1,2,3", help="comma list of drafted tokens a round")
    p.add_argument("--acceptance", default="0.5,0.7,0.9", help="comma list of per-draft acceptance rates to set")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--layers", type=int, default=0, help="decoder layers (0: the shape's own)")
    p.add_argument("--out", default="out/speculative")
    args = p.parse_args(argv)
    args.k = [int(v) for v in args.k.split(",") if v]
    args.acceptance = [float(v) for v in args.acceptance.split(",") if v]
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if device.type == "cpu":
        # the fused path on CPU is the tests' emulation (every kernel's torch reference): a smoke run, no measurement
        import_module("fused_plan").EMULATE_ON_CPU = True
    shapes = ["tiny"] if args.tiny else [s for s in args.shapes.split(",") if s]
    ceilings = benchmark_latency.measure_ceilings(device)
    results = {"meta": {"command": "python scripts/benchmark_speculative.py " + " ".join(sys.argv[1:] if argv is None
                                                                                          else argv),
                        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                        "dtype": args.dtype, "time": time.strftime("%Y-%m-%d %H:%M:%S"), "ceilings": ceilings},
               "models": {}}
    for shape in shapes:
        benchmark_latency.log(f"{shape}: building")
        results["models"][shape] = run_shape(shape, args, device, dtype, ceilings)
    write_report(Path(args.out), "speculative", results, to_markdown(results))
    return results


if __name__ == "__main__":
    main()
