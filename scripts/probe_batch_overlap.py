"""How much a prompt's captured prefill and ``generate_batch``'s captured decode step overlap on two CUDA streams
(issue 46: the measurement that decides whether prompts are prefilled on a side stream while the rows decode).

    python scripts/probe_batch_overlap.py --model 4b --rows 256 --prompt 1024

A ``generate_batch`` call at ``--rows`` rows (prompts of ``--prompt`` tokens, a few new tokens each) captures the
decode step at that row bucket and the prompt graph of that length bucket; then, with CUDA events:

- ``step``: the decode step replayed alone, ms a step (median of ``--repeats``);
- ``prefill``: the prompt's prefill (its graph replay, the LM head on its last token) alone, ms a prompt;
- ``serial``: ``--repeats`` steps and as many prompts one after the other on one stream, total ms;
- ``overlap``: the steps on the current stream, the prompts on a second one, both queued before either ends, total
  ms (from the first launch to both streams' end), with the decode stream at normal and at high priority.

``saved`` = 1 - overlap / serial: the share of the serial time two streams take off. The step runs every row live
over the keys up to the slot the warm-up left (about the prompt length); the state the replays write is discarded.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from scripts.benchmark_latency import build_one, log  # noqa: E402
from scripts.common import import_module  # noqa: E402

MODELS = {"0.8b": "0.8B", "4b": "4B", "9b": "9B", "35b-a3b": "35B-A3B"}


def timed(fn, streams) -> float:
    """ms from before ``fn`` queues its work to the end of every stream in ``streams``."""
    torch.cuda.synchronize()
    begin = torch.cuda.Event(enable_timing=True)
    begin.record()
    for s in streams:
        s.wait_event(begin)
    fn()
    ends = []
    for s in streams:
        e = torch.cuda.Event(enable_timing=True)
        e.record(s)
        ends.append(e)
    torch.cuda.synchronize()
    return max(begin.elapsed_time(e) for e in ends)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="4b")
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("probe_batch_overlap.py needs a CUDA GPU (it times two CUDA streams): run it on a GPU machine")
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    dev = torch.device("cuda")
    model = build_one(MODELS[args.model], None, dev, torch.bfloat16, fused=True)
    text = model._text_model()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 1000, (args.prompt,), generator=g).tolist() for _ in range(args.rows)]
    config = GenerationConfig(do_sample=False, pad_token_id=0, eos_token_id=None, max_new_tokens=6)
    cb = ContinuousBatchingConfig(max_requests_per_batch=args.rows, seed=0)
    for call in range(2):  # the first call captures, the second replays
        start = time.perf_counter()
        model.generate_batch(prompts, generation_config=config, continuous_batching_config=cb)
        log(f"generate_batch call {call + 1}: {time.perf_counter() - start:.1f} s")
    buffers = text.runner.batch
    view = buffers.view(args.rows)
    assert view.graph, f"the {args.rows}-row step was not captured"
    fd = import_module("fused_decode")
    head = import_module("fused_generate").graph_head(model, text, buffers.state)
    layer_types = text.config.layer_types[: text.config.num_hidden_layers]
    ids = torch.tensor(prompts[0], device=dev)[None]
    slot = int(view.slot.item())
    view.key_valid[:, : slot + 1] = True  # every row live over the whole span (the calls left them all free)
    if view.row_start is not None:
        view.row_start.zero_()
    buffers.set_live(args.rows)

    def step():
        view.slot.fill_(slot)
        view.decode(text, True, head)

    def prefill():
        cache = fd.FusedDecodeCache(buffers.prefill, layer_types, text.plan.graphs, budget=args.prompt + 1)
        out = text.runner.run_on_cache(text, cache, input_ids=ids)
        model.lm_head(out.last_hidden_state[:, -1:])

    n = args.repeats
    with torch.inference_mode():
        step(), prefill()
        step_ms = statistics.median(timed(step, [torch.cuda.current_stream()]) for _ in range(n))
        prefill_ms = statistics.median(timed(prefill, [torch.cuda.current_stream()]) for _ in range(n))

        def serial():
            for _ in range(n):
                step()
                prefill()

        results = {"step_ms": step_ms, "prefill_ms": prefill_ms,
                   "serial_ms": statistics.median(timed(serial, [torch.cuda.current_stream()]) for _ in range(3))}
        for name, priority in (("overlap_ms", 0), ("overlap_high_priority_ms", -1)):
            main_stream = torch.cuda.Stream(priority=priority)
            side = torch.cuda.Stream(priority=0)

            def both():  # interleaved as the host would queue them: a prompt, a step, ...
                for _ in range(n):
                    with torch.cuda.stream(side):
                        prefill()
                    with torch.cuda.stream(main_stream):
                        step()

            main_stream.wait_stream(torch.cuda.current_stream())
            both()  # warm the streams (cuBLAS handles / workspaces per stream)
            torch.cuda.synchronize()
            results[name] = statistics.median(timed(both, [main_stream, side]) for _ in range(3))
    for key in ("overlap_ms", "overlap_high_priority_ms"):
        results[key.replace("_ms", "_saved")] = 1 - results[key] / results["serial_ms"]
    log(f"probe_batch_overlap {args.model} rows {args.rows} prompt {args.prompt} x{n}: "
        + ", ".join(f"{k} {v:.3f}" for k, v in results.items()))
    return results


if __name__ == "__main__":
    main()
