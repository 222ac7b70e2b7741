"""What a prompt token costs when several prompts are prefilled in one forward (issue 46: the measurement that decides
whether ``generate_batch`` prefills the prompts that join at one step together instead of one at a time).

    python scripts/probe_prefill_batch.py --model 4b --lengths 128,512,1024,2048 --batches 1,2,4,8

For each prompt length L and batch B: the fused model's ``generate`` of B unpadded random prompts of L tokens and one
new token (the prefill forward, replayed from its captured graph once warm, and the LM head on the last tokens), timed
with CUDA events over ``--repeats`` calls after ``--warmup`` calls; prints ms a call, us a prompt token and the ratio
of B=1's us a token to this B's (above 1: batching the prompts saves that factor of their time).
"""

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from scripts.benchmark_latency import build_one, log  # noqa: E402

MODELS = {"0.8b": "0.8B", "4b": "4B", "9b": "9B", "35b-a3b": "35B-A3B"}


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="4b")
    p.add_argument("--lengths", type=ints, default=[128, 512, 1024, 2048])
    p.add_argument("--batches", type=ints, default=[1, 2, 4, 8])
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("probe_prefill_batch.py needs a CUDA GPU (it times captured prefills): run it on a GPU machine")
    model = build_one(MODELS[args.model], None, "cuda", torch.bfloat16, fused=True)
    vocab = model.config.vocab_size
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = {}
    for L in args.lengths:
        base = None
        for B in args.batches:
            ids = torch.randint(0, vocab, (B, L), device="cuda", generator=gen)
            mask = torch.ones_like(ids)

            def call():
                return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=1, do_sample=False,
                                      pad_token_id=0)

            for _ in range(args.warmup):
                call()
            times = []
            for _ in range(args.repeats):
                torch.cuda.synchronize()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                call()
                b.record()
                torch.cuda.synchronize()
                times.append(a.elapsed_time(b))
            ms = statistics.median(times)
            us_token = 1000 * ms / (B * L)
            base = us_token if base is None else base
            results[(L, B)] = us_token
            log(f"L={L:5d} B={B:2d}: {ms:8.2f} ms a call (min {min(times):.2f}, max {max(times):.2f}), "
                f"{us_token:6.2f} us a prompt token, {base / us_token:4.2f}x the first batch's rate")
    return results


if __name__ == "__main__":
    main()
