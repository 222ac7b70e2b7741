"""Speculative decoding with the MTP head against the non-speculative fused decode, at a controlled acceptance rate.

    # real shapes with random weights (the model and its MTP head), k = 1..3, acceptance 0 / 0.6 / 0.8 / 0.9 / 1
    python scripts/benchmark_speculative.py --shapes 0.8B,4B,9B,27B,35B-A3B --dtype bfloat16 --out out/spec
    # CPU smoke run (what CI runs): tiny config, the fused path as the tests' CPU emulation
    python scripts/benchmark_speculative.py --device cpu --tiny --new-tokens 6 --repeats 1
    # a checkpoint with a trained head (the shipped one: --checkpoint .): its own drafts on held-out text, no set rate
    python scripts/benchmark_speculative.py --checkpoint . --dtype float32 --prompts 8
    # the MoE head drafting with stock's layer, eagerly (fused_mtp_decode.STATIC_MOE_DRAFTS, on as shipped) for the run
    python scripts/benchmark_speculative.py --shapes 35B-A3B --set fused_mtp_decode.STATIC_MOE_DRAFTS=False
    # an A/B in one process: each (k, a) under each variant's constants in turn, graphs captured afresh
    python scripts/benchmark_speculative.py --shapes 4B --k 3 --acceptance 0,0.8 \
        --variant base: --variant at-once:fused_decode.VERIFY_ATTENTION_AT_ONCE=True

Random weights draft nothing the model would say, so the acceptance is set instead: each round, after the head has
drafted and the model has verified, ``fused_speculative.force_acceptance`` makes the round accept the first n of its k
drafts, n the leading successes of k draws that each succeed with probability ``a``, and emit the model's own token
after them; the state rolls back to there as in any round. The work of a round is a real round's (the head runs in
full, the verify pass over k + 1 tokens costs the same whatever they are, the rollback copies the same states); the
tokens are not the model's. The tokens cannot be set before the verify pass instead (drafts replaced by the model's
own greedy continuation): in bf16 a random 4B model parts from its own non-speculative run at a near-tie within a few
tokens (an H200 run: at the 4th new token for every k and a), after which such drafts are no longer its tokens and
the realized acceptance was 0.02-0.05 for a set 0.8-1.0. That speculative greedy decoding gives the model's tokens is
the tests' business (tests/model/test_speculative.py).

Reports, per shape, for the non-speculative fused decode and for each (k, a): ms per emitted token, (time of N new
tokens - time of 1) / (N - 1), median of --repeats; the realized acceptance (accepted / drafted); tokens per verify
round; and the single-token weight-read floor (the bytes a decode step reads / the device's copy bandwidth, measured
now; GPU only; for MoE the active weights: the experts one token picks). Writes ``speculative.json`` /
``speculative.md`` to --out.
"""

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from scripts import ab_decode, benchmark_latency  # noqa: E402
from scripts.common import REAL_MOE_SHAPES, REAL_SHAPES, import_module, write_report  # noqa: E402


def build_model(shape: str, device, dtype, layers: int = 0):
    """The fused causal LM of ``shape`` with random weights and a one-layer MTP head (``mtp_num_hidden_layers=1``,
    as the real checkpoints), built in ``dtype`` on ``device``."""
    kwargs, _, fused_cls, fused_config = benchmark_latency._classes(shape, layers)
    config = fused_config(**kwargs, fused_kernels=True, mtp_num_hidden_layers=1)
    torch.manual_seed(0)
    with torch.device(device):
        return fused_cls._from_config(config, dtype=dtype).eval()


def step_read_bytes(model, counts: dict) -> float:
    """The bytes a single-token decode step reads of the backbone's weights (``param_counts``' ``read_bytes`` less
    the MTP head's): for a MoE model only the experts one token picks, k of E in each layer (its active-weight
    floor: 5.89 GB of 69.3 at 35B-A3B)."""
    head = sum(p.nbytes for p in model.mtp.parameters()) if model.mtp is not None else 0
    experts = sum(p.nbytes for name, p in model.named_parameters()
                  if ".experts." in f".{name}" and not name.startswith("mtp."))
    config = model.config.get_text_config()
    unpicked = 1 - config.num_experts_per_tok / config.num_experts if experts else 0
    return counts["read_bytes"] - head - experts * unpicked


def forced(rate: float, seed: int = 0):
    """An acceptance override: n = the leading successes of k draws that each succeed with probability ``rate``."""
    g = torch.Generator().manual_seed(seed)

    def accept(n, k):
        hits = (torch.rand(k, generator=g) < rate).tolist()
        return hits.index(False) if False in hits else k

    return accept


def timed_generate(model, ids, n: int, k: int, device) -> tuple[float, torch.Tensor]:
    """(ms, sequence) of a greedy ``generate`` of exactly ``n`` new tokens with ``k`` drafts a round: no EOS, where
    ``min_new_tokens`` would add a logits processor (which keeps speculative rounds on the host, and is not what a
    plain ``generate`` runs)."""
    timer = benchmark_latency.Timer(device)
    out = {}

    def run():
        out["ids"] = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                    eos_token_id=None, do_sample=False, pad_token_id=0, mtp_speculative_tokens=k)

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


def phase_ms(model, ids, n: int, k: int, device, rate: float) -> dict:
    """Where a round's time goes: one more ``generate`` of ``n`` tokens with the head's drafting on the host path
    (``fused_speculative._draft``), the verify pass (``verify_logits``, its graph replay and LM head) and a device
    round's tail (``MTPDecodeState.tail``: acceptance, rollback, the head's pairs and drafts) each timed between
    device syncs; the rest (the host's acceptance and stop checks, rollback, the loop) is the round's time less
    those. Per round, in ms; the syncs add a little to each part, and they serialize the pipelined rounds (the next
    round's verify pass queued before a round is read), so the parts add up to more than a round takes."""
    spec = import_module("fused_speculative")
    mtp_decode = import_module("fused_mtp_decode")
    spent = {"draft": 0.0, "verify": 0.0, "tail": 0.0}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def timed(name, fn):
        def run(*args, **kwargs):
            sync()
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            sync()
            spent[name] += (time.perf_counter() - start) * 1e3
            return out
        return run

    draft, verify, tail = spec._draft, spec.verify_logits, mtp_decode.MTPDecodeState.tail
    spec._draft, spec.verify_logits = timed("draft", draft), timed("verify", verify)
    mtp_decode.MTPDecodeState.tail = timed("tail", tail)
    try:
        with spec.force_acceptance(forced(rate, seed=1)), spec.record_rounds() as rounds:
            sync()
            start = time.perf_counter()
            timed_generate(model, ids, n, k, device)
            total = (time.perf_counter() - start) * 1e3
    finally:
        spec._draft, spec.verify_logits, mtp_decode.MTPDecodeState.tail = draft, verify, tail
    count = max(len(rounds), 1)
    return {"rounds": len(rounds), "draft_ms": spent["draft"] / count, "verify_ms": spent["verify"] / count,
            "tail_ms": spent["tail"] / count, "rest_ms": (total - sum(spent.values())) / count}


def run_shape(shape: str, args, device, dtype, ceilings: dict) -> dict:
    spec = import_module("fused_speculative")
    model = build_model(shape, device, dtype, args.layers)
    counts = benchmark_latency.param_counts(model)
    ids = torch.randint(3, model.config.vocab_size, (1, args.prompt_len), generator=torch.Generator().manual_seed(0)).to(device)
    plain = per_token_ms(model, ids, args.new_tokens, 0, device, args.repeats)
    row = {"params": counts, "plain": {"ms_per_token": statistics.median(plain), "runs": plain}, "speculative": {}}
    bandwidth = ceilings.get("copy_bytes_per_s")
    # the MTP head is read too in a speculative round, but the floor is the plain single-token step's
    row["floor_ms"] = step_read_bytes(model, counts) / bandwidth * 1e3 if bandwidth else None
    variants = args.variants or [("", [])]
    for k in args.k:
        for rate in args.acceptance:
            for vname, vsets in variants:  # interleaved per (k, a): a drift of the card hits every variant alike
                with ab_decode.constants(vsets):
                    if vsets:  # the graphs (verify, drafts, tails) captured afresh under this variant's values
                        model.set_fused_kernels(False).set_fused_kernels(True)
                    with spec.force_acceptance(forced(rate)), spec.record_rounds() as rounds:
                        values = per_token_ms(model, ids, args.new_tokens, k, device, args.repeats)
                        rounds.clear()
                        timed_generate(model, ids, args.new_tokens, k, device)
                    drafted, accepted = sum(d for d, _ in rounds), sum(n for _, n in rounds)
                    row["speculative"][(f"{vname}/" if vname else "") + f"k{k}-a{rate}"] = {
                        "variant": vname, "k": k, "acceptance_set": rate, "ms_per_token": statistics.median(values),
                        "runs": values, "acceptance": accepted / drafted if drafted else None,
                        "tokens_per_round": (args.new_tokens - 1) / len(rounds) if rounds else None,
                        "per_round": phase_ms(model, ids, args.new_tokens, k, device, rate),
                    }
                benchmark_latency.log(f"{shape} {vname + ' ' if vname else ''}k={k} a={rate}: "
                                      f"{statistics.median(values):.3f} ms/token "
                                      f"(plain {row['plain']['ms_per_token']:.3f})")
    del model
    gc.collect()  # its reference cycles too, before the next shape is built (27B after 35B-A3B ran out of memory)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def load_checkpoint(path: str, device, dtype):
    """The fused causal LM of the checkpoint at ``path`` with its MTP head, through the repo's own classes (the ones
    ``trust_remote_code`` runs), in ``dtype`` on ``device``, and its tokenizer."""
    from transformers import AutoTokenizer

    configuration, modeling = import_module("configuration_qwen3_5_fused"), import_module("modeling_qwen3_5_fused")
    config = configuration.Qwen3_5FusedConfig.from_pretrained(path)
    model = modeling.Qwen3_5FusedForCausalLMLoader.from_pretrained(path, config=config, dtype=dtype)
    if getattr(model, "mtp", None) is None:
        raise SystemExit(f"--checkpoint {path}: the checkpoint has no MTP head (mtp.* weights); nothing to draft with")
    return model.to(device).eval(), AutoTokenizer.from_pretrained(path)


def heldout_prompts(path: str, tokenizer, count: int, length: int) -> list[torch.Tensor]:
    """``count`` prompts of ``length`` tokens spread over ``<path>/data/heldout.txt`` (text the model was not trained
    on)."""
    source = Path(path) / "data" / "heldout.txt"
    if not source.is_file():
        raise SystemExit(f"--checkpoint {path}: no held-out text at {source}; prompts are drawn from it")
    ids = tokenizer(source.read_text(encoding="utf-8")[:200_000], return_tensors="pt").input_ids
    step = (ids.shape[1] - length) // max(count, 1)
    return [ids[:, i * step : i * step + length] for i in range(count)]


def run_checkpoint(path: str, args, device, dtype) -> dict:
    """A trained head's own drafts (no set rate) on held-out prompts: per k, ms per emitted token (median over the
    prompts of ``per_token_ms``), tokens per second, the realized acceptance (accepted / drafted over a call per
    prompt), and whether the call speculated to its end; "as a user gets it" lets the call hand over to plain
    decode when its rounds do not pay (``fused_speculative.Governor``), "speculating throughout" does not."""
    spec = import_module("fused_speculative")
    model, tokenizer = load_checkpoint(path, device, dtype)
    prompts = [p.to(device) for p in heldout_prompts(path, tokenizer, args.prompts, args.prompt_len)]
    rows = {}
    for k in [0] + args.k:
        for governed in ((True,) if k == 0 else (True, False)):
            saved = spec.PROBE_ROUNDS
            if not governed:
                spec.PROBE_ROUNDS = 10**9
            try:
                values, drafted, accepted, rounds_seen, handed_over = [], 0, 0, 0, 0
                for ids in prompts:
                    values.append(statistics.median(per_token_ms(model, ids, args.new_tokens, k, device,
                                                                 args.repeats)))
                    if k:
                        with spec.record_rounds() as rounds:
                            timed_generate(model, ids, args.new_tokens, k, device)
                        drafted += sum(d for d, _ in rounds)
                        accepted += sum(n for _, n in rounds)
                        rounds_seen += len(rounds)
                        # the tokens after the prompt's: all from rounds unless the call handed over to plain decode
                        handed_over += sum(n + 1 for _, n in rounds) < args.new_tokens - 1
            finally:
                spec.PROBE_ROUNDS = saved
            ms = statistics.median(values)
            name = "plain" if k == 0 else f"k{k}-{'user' if governed else 'throughout'}"
            rows[name] = {"k": k, "governed": governed, "ms_per_token": ms, "tokens_per_s": 1e3 / ms,
                          "per_prompt_ms": values, "acceptance": accepted / drafted if drafted else None,
                          "rounds": rounds_seen, "drafted": drafted, "handed_over": handed_over,
                          "tokens_per_round": (accepted + rounds_seen) / rounds_seen if rounds_seen else None}
            benchmark_latency.log(f"checkpoint {name}: {ms:.3f} ms/token")
    return rows


def checkpoint_markdown(results: dict) -> str:
    rows = results["checkpoint"]
    plain = rows["plain"]["ms_per_token"]
    count = len(rows["plain"]["per_prompt_ms"])
    lines = ["| k | run | a realized (drafted) | tokens / round | calls handed over | ms / token | tokens / s | "
             "vs plain |", "|---|---|---|---|---|---|---|---|"]
    for row in rows.values():
        run = "plain" if row["k"] == 0 else ("as a user gets it" if row["governed"] else "speculating throughout")
        acc = f"{row['acceptance']:.3f} ({row['drafted']})" if row["acceptance"] is not None else "-"
        per_round = f"{row['tokens_per_round']:.2f}" if row["tokens_per_round"] else "-"
        handed = f"{row['handed_over']} of {count}" if row["k"] else "-"
        lines.append(f"| {row['k']} | {run} | {acc} | {per_round} | {handed} | {row['ms_per_token']:.3f} | "
                     f"{row['tokens_per_s']:.0f} | {plain / row['ms_per_token']:.2f}x |")
    return "\n".join(lines) + "\n"


def to_markdown(results: dict) -> str:
    lines = ["| model | k | a set | a realized | tokens / round | ms / token | plain ms / token | speed-up | "
             "floor ms | / floor | round: draft / verify / tail / rest ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for shape, row in results["models"].items():
        plain, floor = row["plain"]["ms_per_token"], row["floor_ms"]
        lines.append(f"| {shape} | 0 | - | - | 1 | {plain:.3f} | {plain:.3f} | 1.00x | "
                     + (f"{floor:.3f} | {plain / floor:.2f}x |" if floor else "- | - |") + " - |")
        for r in row["speculative"].values():
            realized = f"{r['acceptance']:.2f}" if r["acceptance"] is not None else "-"
            per_round = f"{r['tokens_per_round']:.2f}" if r["tokens_per_round"] is not None else "-"
            k = f"{r['k']} ({r['variant']})" if r.get("variant") else r["k"]
            lines.append(f"| {shape} | {k} | {r['acceptance_set']} | {realized} | {per_round} | "
                         f"{r['ms_per_token']:.3f} | {plain:.3f} | {plain / r['ms_per_token']:.2f}x | "
                         + (f"{floor:.3f} | {r['ms_per_token'] / floor:.2f}x |" if floor else "- | - |")
                         + " {draft_ms:.2f} / {verify_ms:.2f} / {tail_ms:.2f} / {rest_ms:.2f} |".format(
                             **r["per_round"]))
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="0.8B,4B,9B,27B,35B-A3B",
                   help=f"comma list of {', '.join([*REAL_SHAPES, *REAL_MOE_SHAPES])}")
    p.add_argument("--tiny", action="store_true", help="the tiny test config instead of --shapes (CPU smoke runs)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--k", default="1,2,3", help="comma list of drafted tokens a round")
    p.add_argument("--acceptance", default="0,0.6,0.8,0.9,1.0", help="comma list of per-draft acceptance rates to set")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--layers", type=int, default=0, help="decoder layers (0: the shape's own)")
    p.add_argument("--out", default="out/speculative")
    p.add_argument("--checkpoint", default=None,
                   help="a checkpoint folder with a trained MTP head: its own drafts on held-out prompts instead of "
                        "--shapes and --acceptance")
    p.add_argument("--prompts", type=int, default=8, help="with --checkpoint: held-out prompts")
    p.add_argument("--variant", action="append", default=None, metavar="NAME:MODULE.CONSTANT=VALUE,...",
                   help="run every (k, a) again under these repo constants, in the same process, the variants "
                        "interleaved per (k, a) and the graphs captured afresh for each (as scripts/ab_decode.py "
                        "takes them; 'base:' for the shipped values); repeatable")
    p.add_argument("--set", action="append", default=[], metavar="MODULE.CONSTANT=VALUE",
                   help="a repo constant for the whole run, as scripts/ab_decode.py's variants take them (e.g. "
                        "fused_mtp_decode.STATIC_MOE_DRAFTS=False), restored afterwards; repeatable")
    args = p.parse_args(argv)
    modules = ab_decode.variant_modules() if args.variant else None
    args.variants = [ab_decode.parse_variant(spec, modules) for spec in args.variant] if args.variant else None
    settings = []
    if args.set:
        settings = ab_decode.parse_variant("set:" + ",".join(args.set), ab_decode.variant_modules())[1]
    with ab_decode.constants(settings):
        return _main(args, argv)


def _main(args, argv):
    args.k = [int(v) for v in args.k.split(",") if v]
    args.acceptance = [float(v) for v in args.acceptance.split(",") if v]
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if device.type == "cpu":
        # the fused path on CPU is the tests' emulation (every kernel's torch reference): a smoke run, no measurement
        import_module("fused_plan").EMULATE_ON_CPU = True
    shapes = ["tiny"] if args.tiny else [s for s in args.shapes.split(",") if s]
    if args.checkpoint is not None:
        results = {"meta": {"command": "python scripts/benchmark_speculative.py " + " ".join(
                                sys.argv[1:] if argv is None else argv),
                            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                            "dtype": args.dtype, "time": time.strftime("%Y-%m-%d %H:%M:%S")},
                   "checkpoint": run_checkpoint(args.checkpoint, args, device, dtype)}
        write_report(Path(args.out), "speculative_checkpoint", results, checkpoint_markdown(results))
        return results
    ceilings = benchmark_latency.measure_ceilings(device)
    results = {"meta": {"command": "python scripts/benchmark_speculative.py " + " ".join(sys.argv[1:] if argv is None
                                                                                          else argv),
                        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                        "dtype": args.dtype, "time": time.strftime("%Y-%m-%d %H:%M:%S"), "ceilings": ceilings},
               "models": {}}
    for shape in shapes:
        benchmark_latency.log(f"{shape}: building")
        results["models"][shape] = run_shape(shape, args, device, dtype, ceilings)
        # after each shape: a run cut short by a time limit keeps the shapes it measured
        write_report(Path(args.out), "speculative", results, to_markdown(results))
    return results


if __name__ == "__main__":
    main()
