"""Many requests at once (issue 46): stock ``generate`` and fused ``generate`` in padded static batches, against the
fused ``generate_batch`` (continuous batching), on one seeded workload, in one process.

    # the issue's workload at 4B (random weights at the real shape); stock on a subset of 64 requests
    python scripts/benchmark_batch.py --model 4b --requests 512 --stock-requests 64 --out out/batch
    # 9B, 35B-A3B
    python scripts/benchmark_batch.py --model 9b --requests 512 --stock-requests 64
    python scripts/benchmark_batch.py --model 35b-a3b --requests 512 --stock-requests 32
    # a model whose whole run outlasts one device call: (1) and (2) in one process, (3) in the next
    python scripts/benchmark_batch.py --model 35b-a3b --requests 512 --stock-requests 16 --static-only --out out/s
    python scripts/benchmark_batch.py --model 35b-a3b --requests 512 --stock-requests 16 --batch-only \\
        --static-from out/s/batch.json
    # CPU smoke run (what CI runs): tiny config, a few requests
    python scripts/benchmark_batch.py --device cpu --tiny --requests 8

The workload (``workload``): ``--requests`` prompts of random tokens, lengths uniform in ``--prompt-range`` (32-2048),
each with its own number of new tokens, uniform in ``--new-range`` (16-512), all seeded by ``--seed``; EOS off, so
every request generates exactly its count. Every request arrives at the start (an offline batch).

The three runs, each over the requests in their order:

1. stock ``generate`` (``fused_kernels`` off is not used: the stock class itself) in padded static batches of
   ``--batch`` (32): left-padded prompts, each batch run to its longest request's count;
2. the fused ``generate`` in the same static batches;
3. the fused ``generate_batch``: every request joins a free row when one frees up and leaves at its own count.

Warm-ups, off the clock: every model on the first 4 requests; before each ``generate_batch`` setting, a call that
runs the timed call's first shapes (``--warm buckets``, ``bucket_warmup``: every prompt-length bucket the workload
uses, its buffers' sizes, every row bucket; its wall time is reported: what a first call pays on top), or on the 4
requests only (``--warm few``: the timed run then pays the shapes the 4 did not reach). Stock's model is released
after run (1): ``generate_batch`` sizes its buffers from the free memory. The static runs capture theirs in their first batches: a padded batch of
32 prompts lands in the longest buckets.

Stock on 512 requests at 4B takes long: it runs the first ``--stock-requests`` of them, and the fused static batches
are also reported on that subset (the same batches), so the per-token and throughput ratios (1) / (2) compare the same
work. Reported per run: output tokens/s (the requests' own counts, not padding, over the wall time), time to first
token (TTFT: from the start of the run, all requests arriving then) and per-token latency (after the first token), p50
and p99. In static batches a request's TTFT is the time to its batch's start plus that batch's prefill (a 1-token
``generate`` of the batch, timed apart), and its per-token latency is the batch's decode time over its steps; with
``generate_batch`` both come from the per-token timestamps it records (host read times, one step late). On a GPU, the
captured decode step of ``generate_batch`` at each row bucket is timed against its floor: the bytes it must read
(the weights a step reads, with the experts a batch of rows picks in expectation for MoE; the keys / values at the
workload's mean context; the DeltaNet states read and written) over the device copy bandwidth measured in the run.
"""

import argparse
import contextlib
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from scripts import ab_decode  # noqa: E402
from scripts.benchmark_latency import build_pair, log, measure_ceilings, percentile, stock_cpu_guard  # noqa: E402
from scripts.common import import_module, write_report  # noqa: E402

MODELS = {"4b": "4B", "9b": "9B", "35b-a3b": "35B-A3B"}


def workload(n: int, prompt_range: tuple[int, int], new_range: tuple[int, int], vocab: int, seed: int = 0):
    """``n`` requests (prompt token ids, new tokens), lengths uniform in the ranges, tokens uniform in [3, vocab)."""
    rng = random.Random(seed)
    requests = []
    for _ in range(n):
        length = rng.randint(*prompt_range)
        requests.append(([rng.randrange(3, vocab) for _ in range(length)], rng.randint(*new_range)))
    return requests


def bucket_warmup(requests: list, rows: int) -> list:
    """Requests that run every first shape of the timed ``generate_batch`` call at ``rows`` rows, off the clock:

    - per prompt-length bucket of the fused prefill, its first ``CAPTURE_AFTER`` prompts (a bucket's graph is captured
      on its second prompt), 2 new tokens each, the longest prompt among them (the prefill state the timed run needs);
    - the request of the largest cache need (prompt + new), so the call sizes the same buffers as the timed one and
      the timed call reuses them, step graphs and all;
    - ``rows`` requests of a 32-token prompt with 2 .. rows + 1 new tokens: one leaves per step, so the step runs at
      every row bucket down to one row (each bucket's graph, and each row tier's linear-kernel timing, a first call's
      cost: the one-row tier's took tens of seconds inside a timed 4B run on an H100)."""
    graphs = import_module("fused_graphs")
    by_bucket = {}
    for prompt, _ in sorted(requests, key=lambda r: -len(r[0])):
        picked = by_bucket.setdefault(graphs.forward_len_bucket(len(prompt)), [])
        if len(picked) < graphs.CAPTURE_AFTER:
            picked.append((prompt, 2))
    warm = [r for picked in by_bucket.values() for r in picked]
    warm.append(max(requests, key=lambda r: len(r[0]) + r[1]))
    short = requests[0][0][:32]
    return warm + [(short, 2 + i) for i in range(rows)]


def group_warmups(requests: list, rows: int) -> list[tuple[int, list]]:
    """With groups at ``rows`` rows (``fused_batch.prefill_group``), the calls that capture the group prefill graphs a
    timed call uses, off the clock: for each group batch b (2, 4, ... up to it), ``CAPTURE_AFTER`` calls (a bucket's
    graph is captured on its second forward) of b prompts of each prompt-length bucket that has b, 2 new tokens
    each, run with ``PREFILL_GROUP`` = b so that each bucket's prompts form one group of b, and the request of the
    largest cache need (so that the call keeps the timed call's buffers). A bucket with fewer than b prompts never
    forms a group of b. Returns [(b, requests)], one entry a call."""
    batch_mod, graphs = import_module("fused_batch"), import_module("fused_graphs")
    largest = max(requests, key=lambda r: len(r[0]) + r[1])
    calls, b = [], 2
    while b <= batch_mod.prefill_group(rows):
        by_bucket = {}
        for prompt, _ in requests:
            by_bucket.setdefault(graphs.forward_len_bucket(len(prompt)), []).append((prompt, 2))
        group_set = [r for picked in by_bucket.values() if len(picked) >= b for r in picked[:b]] + [largest]
        calls += [(b, group_set)] * graphs.CAPTURE_AFTER
        b *= 2
    return calls


def warm_up(fused, requests: list, rows: int, device, chunk, warm: str, few: list) -> int:
    """A ``generate_batch`` setting's first shapes, off the clock (``--warm``): ``buckets``, every prompt bucket, row
    bucket and buffer size of the timed call (``bucket_warmup``, run with ``PREFILL_GROUP`` 1: the prompts alone,
    each bucket's batch-1 graph captured), then with ``PREFILL_GROUP`` > 1 the groups' graphs (``group_warmups``);
    ``few``, the requests ``few`` only. Returns the requests run."""
    batch_mod = import_module("fused_batch")
    if warm != "buckets":
        continuous(fused, few, rows, device, chunk)
        return len(few)
    warm_set = bucket_warmup(requests, rows)
    with ab_decode.constants([(batch_mod, "PREFILL_GROUP", 1)]):
        continuous(fused, warm_set, rows, device, chunk)
    count = len(warm_set)
    for b, group_set in group_warmups(requests, rows):
        with ab_decode.constants([(batch_mod, "PREFILL_GROUP", b)]):
            continuous(fused, group_set, rows, device, chunk)
        count += len(group_set)
    return count


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _padded(prompts: list, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids and mask [B, longest]."""
    longest = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), longest, dtype=torch.long)
    mask = torch.zeros(len(prompts), longest, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, longest - len(p) :] = torch.tensor(p)
        mask[i, longest - len(p) :] = 1
    return ids.to(device), mask.to(device)


def static_batches(model, requests: list, batch: int, device, progress: str) -> dict:
    """Run ``requests`` through ``model.generate`` in padded static batches of ``batch``; per request its TTFT and
    per-token latency (s), and the wall time."""
    ttft, per_token, batch_times = [], [], []
    for b in range(0, len(requests), batch):
        chunk = requests[b : b + batch]
        ids, mask = _padded([p for p, _ in chunk], device)
        new = max(n for _, n in chunk)
        kw = dict(attention_mask=mask, do_sample=False, pad_token_id=0, eos_token_id=None)
        at = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=1, **kw)
        sync(device)
        prefill = time.perf_counter() - at
        at = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=new, **kw)
        sync(device)
        took = time.perf_counter() - at
        step = max(0.0, took - prefill) / max(1, new - 1)
        for _ in chunk:  # the batch starts when the previous one has ended (the 1-token runs are not on the clock)
            ttft.append(sum(batch_times) + prefill)
            per_token.append(step)
        batch_times.append(took)
        log(f"{progress}: batch {b // batch + 1}/{-(-len(requests) // batch)}: {len(chunk)} requests, {new} steps, "
            f"{took:.2f} s")
    return {"wall_s": sum(batch_times), "ttft": ttft, "per_token": per_token, "batch_s": batch_times}


@contextlib.contextmanager
def time_parts(device):
    """Where a ``generate_batch`` run inside the block spends the GPU's time: CUDA events recorded around each of the
    scheduler's prompt prefills (``BatchEngine._start_group``, ``_chunk``) and decode steps (``_decode``), read after
    the run (no sync inside it). Yields a dict filled on exit: ``prefill_s``, ``decode_s`` (summed event spans),
    ``steps`` and ``mean_rows`` (the live requests a step ran), and ``prefill_by_batch``: per prefill batch (1: a
    prompt alone, ``_start``; b > 1: a group of b, ``_start_many``) its calls, prompt tokens, GPU seconds (events
    around each), us a prompt token, and how many of its prompt forwards replayed a captured graph or ran eagerly
    (``PrefillGraph.run``). GPU only: the dict stays empty elsewhere."""
    parts = {}
    if device.type != "cuda":
        yield parts
        return
    engine = import_module("fused_batch").BatchEngine
    prefill_graph = import_module("fused_graphs").PrefillGraph
    marks, rows = {"prefill": [], "decode": []}, []
    originals = {name: getattr(engine, name) for name in ("_start_group", "_chunk", "_decode")}
    singles = {name: getattr(engine, name) for name in ("_start", "_start_many")}
    graph_run = prefill_graph.run
    by_batch = {}  # batch -> {"calls", "prompt_tokens", "spans", "replayed", "eager"}

    def entry(batch):
        return by_batch.setdefault(batch, {"calls": 0, "prompt_tokens": 0, "spans": [], "replayed": 0, "eager": 0})

    def timed_prefill(name):
        fn = singles[name]

        def run(self, reqs, *args, **kwargs):
            group = reqs if isinstance(reqs, list) else [reqs]
            e = entry(len(group))
            e["calls"] += 1
            e["prompt_tokens"] += sum(len(r.prompt) for r in group)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                return fn(self, reqs, *args, **kwargs)
            finally:
                end.record()
                e["spans"].append((start, end))

        return run

    def counted_graph_run(self, text_model, cache, pool, capture, replay=True):
        entry(self.ids.shape[0])["replayed" if self.graph and replay else "eager"] += 1
        return graph_run(self, text_model, cache, pool, capture, replay)

    def wrap(name, part):
        fn = originals[name]

        def run(self, *args, **kwargs):
            if part == "decode":
                rows.append(len(self.live))
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                return fn(self, *args, **kwargs)
            finally:
                end.record()
                marks[part].append((start, end))

        return run

    for name, part in (("_start_group", "prefill"), ("_chunk", "prefill"), ("_decode", "decode")):
        setattr(engine, name, wrap(name, part))
    for name in singles:
        setattr(engine, name, timed_prefill(name))
    prefill_graph.run = counted_graph_run
    try:
        yield parts
    finally:
        for name, fn in {**originals, **singles}.items():
            setattr(engine, name, fn)
        prefill_graph.run = graph_run
    torch.cuda.synchronize(device)
    for part, spans in marks.items():
        parts[f"{part}_s"] = sum(a.elapsed_time(b) for a, b in spans) / 1e3
    parts["steps"], parts["mean_rows"] = len(rows), (statistics.fmean(rows) if rows else 0.0)
    parts["prefill_by_batch"] = {}
    for batch, e in sorted(by_batch.items()):
        gpu_s = sum(a.elapsed_time(b) for a, b in e.pop("spans")) / 1e3
        e.update(gpu_s=gpu_s, us_per_token=1e6 * gpu_s / max(1, e["prompt_tokens"]))
        parts["prefill_by_batch"][batch] = e


def continuous(model, requests: list, rows: int, device, prefill_chunk: int | None) -> dict:
    """Run ``requests`` through ``model.generate_batch``; per request its TTFT and per-token latency (s), and where
    the GPU's time went (``time_parts``)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    config = GenerationConfig(do_sample=False, pad_token_id=0, eos_token_id=None)
    cb = ContinuousBatchingConfig(max_requests_per_batch=rows, seed=0)
    sync(device)
    with time_parts(device) as parts:
        start = time.perf_counter()
        out = model.generate_batch([p for p, _ in requests], generation_config=config, continuous_batching_config=cb,
                                   max_new_tokens=[n for _, n in requests], record_timestamps=True,
                                   prefill_chunk=prefill_chunk)
        sync(device)
        wall = time.perf_counter() - start
    by_id, failed = {}, []
    for rid, got in out.items():
        if got.error is not None or not got.timestamps:
            failed.append(f"{rid}: {got.error}")
            continue
        times = got.timestamps
        by_id[rid] = (times[0] - start, (times[-1] - times[0]) / max(1, len(times) - 1))
    return {"wall_s": wall, "ttft": [t for t, _ in by_id.values()], "per_token": [s for _, s in by_id.values()],
            "by_id": by_id, "failed": failed, "tokens": sum(len(o.generated_tokens) for o in out.values()),
            "parts": parts}


def settings(args) -> list[tuple[int, int | None, bool]]:
    """The ``generate_batch`` settings to run: every ``--rows`` with every ``--prefill-chunk`` and every ``--ride``
    (riding only where prompts are chunked), fewest rows first."""
    return [(rows, chunk, ride) for rows in sorted(args.rows) for chunk in args.prefill_chunk
            for ride in (args.ride if chunk is not None else [False])]


def _chunks(text: str) -> list[int | None]:
    return [None if c.strip().lower() == "none" else int(c) for c in text.split(",")]


def stats(run: dict, tokens: int) -> dict:
    ms = [t * 1e3 for t in run["ttft"]]
    step = [t * 1e3 for t in run["per_token"]]
    return {"requests": len(ms), "tokens": tokens, "wall_s": run["wall_s"], "tokens_per_s": tokens / run["wall_s"],
            "ttft_ms_p50": percentile(ms, 0.5), "ttft_ms_p99": percentile(ms, 0.99),
            "per_token_ms_p50": percentile(step, 0.5), "per_token_ms_p99": percentile(step, 0.99)}


def step_bytes(model, rows: int, context: int) -> dict:
    """Bytes one decode step of ``rows`` rows at ``context`` keys a row must move: the weights it reads (for MoE the
    experts ``rows`` tokens pick in expectation, uniform routing), the keys / values, the DeltaNet states read and
    written."""
    budget = import_module("fused_batch_budget")
    text = model._text_model()
    weights = experts = 0
    for name, p in text.layers.named_parameters():
        if ".experts." in f".{name}":
            experts += p.nbytes
        else:
            weights += p.nbytes
    weights += text.norm.weight.nbytes + model.lm_head.weight.nbytes
    config = text.config
    if experts:
        E, k = config.num_experts, config.num_experts_per_tok
        experts = experts * (1 - (1 - k / E) ** rows)  # the expected fraction of experts some row picks
    per_token, per_row = budget.state_bytes(text)
    return {"weights": weights + experts, "kv": rows * context * per_token, "state": 2 * rows * per_row}


def _every_row_live(buffers, view, rows: int, context: int, repeats: int) -> int:
    """Set the ``rows``-row ``view`` up for timing its captured step: every row live over keys 0..slot (the run left
    them all free), the slot ``context`` or as near as ``repeats`` steps from it fit; returns the slot."""
    slot = min(context, buffers.max_len - repeats - 1)
    view.key_valid[:, :slot] = True
    if view.row_start is not None:
        view.row_start.zero_()
    buffers.set_live(rows)
    return slot


def time_decode_steps(model, context: int, copy_rate: float | None, repeats: int = 20) -> dict:
    """The captured decode step of ``generate_batch`` (the buffers its run left) at each row bucket it captured:
    median ms over ``repeats`` replays at slot ``context``, and its floor."""
    text = model._text_model()
    buffers = text.runner.batch
    if buffers is None:
        return {}
    head = import_module("fused_generate").graph_head(model, text, buffers.state)
    out = {}
    for rows, view in sorted(buffers.views.items()):
        if not view.graph:
            continue
        slot = _every_row_live(buffers, view, rows, context, repeats)
        times = []
        for _ in range(repeats):
            view.slot.fill_(slot)
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            view.decode(text, True, head)
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end))
        moved = step_bytes(model, rows, slot)
        ms = statistics.median(times)
        floor = sum(moved.values()) / copy_rate * 1e3 if copy_rate else float("nan")
        out[rows] = {"step_ms": ms, "floor_ms": floor, "over_floor": ms / floor, "bytes": moved,
                     "copy_bytes_per_s": copy_rate}
    return out


def profile_decode_steps(model, context: int, rows_list, repeats: int = 10, top: int = 14) -> dict:
    """The captured decode step at each of ``rows_list`` (row buckets the run captured) under the torch profiler, every
    row live over ``context`` keys from key 0 (as ``time_decode_steps``): per kernel its launches and GPU microseconds a
    step, largest first. With PDL on, a kernel's time includes its wait for the one before (the sum exceeds the
    step)."""
    from torch.profiler import ProfilerActivity, profile

    from scripts.benchmark_latency import kernel_times

    text = model._text_model()
    buffers = text.runner.batch
    head = import_module("fused_generate").graph_head(model, text, buffers.state)
    out = {}
    for rows in rows_list:
        view = buffers.views.get(rows)
        if view is None or not view.graph:
            log(f"profile steps: no captured step at {rows} rows (captured: {sorted(buffers.views)})")
            continue
        slot = _every_row_live(buffers, view, rows, context, repeats)
        view.slot.fill_(slot)
        view.decode(text, True, head)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(repeats):
                view.slot.fill_(slot)
                view.decode(text, True, head)
            torch.cuda.synchronize()
        kernels = sorted(kernel_times(prof).items(), key=lambda kv: -kv[1][1])
        total = sum(us for _, (_, us) in kernels)
        out[rows] = {"gpu_us_per_step": total / repeats,
                     "top": [(name[:100], count / repeats, us / repeats) for name, (count, us) in kernels[:top]]}
        log(f"profile step rows={rows} context={slot}: {total / repeats / 1e3:.3f} ms of kernel time a step")
        for name, count, us in out[rows]["top"]:
            print(f"    {us:9.1f} us  x{count:<5.1f} {name}")
    return out


def to_markdown(r: dict) -> str:
    static_note = (f"(theirs, and the ratios to them, are the report {r['static_from']}'s, of the same workload on "
                   "the same card)." if r.get("static_from") else "(the subset is only where its latencies are read).")
    lines = [f"# generate_batch benchmark: {r['model']} ({r['dtype']}, {r['device']})", "",
             f"{r['requests']} requests, prompts {r['prompt_range'][0]}-{r['prompt_range'][1]} tokens, "
             f"{r['new_range'][0]}-{r['new_range'][1]} new (seed {r['seed']}); static batches of {r['batch']}; "
             f"generate_batch: rows {r['rows']} x prefill_chunk {r['prefill_chunk']}, path: {r['batch_path']}.",
             f"Stock ran the first {r['stock_requests']} requests only (a subset): the rows marked 'subset' compare "
             "the same requests." if not r.get("batch_only") else "--batch-only: runs (1) and (2) did not run here "
             + static_note, "",
             "| run | requests | output tok/s | TTFT p50 / p99 ms | per-token p50 / p99 ms |", "|---|---|---|---|---|"]
    for name, s in r["runs"].items():
        lines.append(f"| {name} | {s['requests']} | {s['tokens_per_s']:.1f} | {s['ttft_ms_p50']:.1f} / "
                     f"{s['ttft_ms_p99']:.1f} | {s['per_token_ms_p50']:.2f} / {s['per_token_ms_p99']:.2f} |")
    lines += ["", "| ratio (output tok/s) | value | target |", "|---|---|---|"]
    for name, (value, target) in r["ratios"].items():
        lines.append(f"| {name} | {value:.2f}x | {target} |")
    if r.get("parts"):
        lines += ["", "Where generate_batch's time went (GPU time between CUDA events around the scheduler's prompt "
                  "prefills and decode steps; the rest: the host's choosing, reading and bookkeeping with the GPU "
                  "idle, and the first tokens):", "",
                  "| run | wall s | prefill s | decode s | rest s | decode steps | mean rows a step |",
                  "|---|---|---|---|---|---|---|"]
        for name, p in r["parts"].items():
            rest = p["wall_s"] - p["prefill_s"] - p["decode_s"]
            lines.append(f"| {name} | {p['wall_s']:.2f} | {p['prefill_s']:.2f} | {p['decode_s']:.2f} | {rest:.2f} | "
                         f"{p['steps']} | {p['mean_rows']:.1f} |")
        by_batch = [(name, b, e) for name, p in r["parts"].items() for b, e in p.get("prefill_by_batch", {}).items()]
        if by_batch:
            lines += ["", "Prompt prefills by batch (1: a prompt alone; b: a group of b prompts of one length bucket; "
                      "GPU time between events around each; forwards replayed from a captured graph or run eagerly):",
                      "", "| run | batch | calls | prompt tokens | GPU s | us a prompt token | replayed | eager |",
                      "|---|---|---|---|---|---|---|---|"]
            for name, b, e in by_batch:
                lines.append(f"| {name} | {b} | {e['calls']} | {e['prompt_tokens']} | {e['gpu_s']:.2f} | "
                             f"{e['us_per_token']:.1f} | {e['replayed']} | {e['eager']} |")
    if r.get("warmup_s"):
        lines += ["", f"Warm-up before each generate_batch setting (--warm {r.get('warm')}, off the clock): "
                  + "; ".join(f"{name}: {n} requests, {s:.2f} s" for name, (n, s) in r["warmup_s"].items())]
    if r["decode_steps"]:
        rate = next(iter(r["decode_steps"].values())).get("copy_bytes_per_s", r["copy_bytes_per_s"])
        measured = ", ".join(f"{x / 1e12:.2f}" for x in r.get("copy_rates_measured", []))
        lines += ["", f"Captured decode step of generate_batch at {r['context']} keys a row (copy rate "
                  f"{rate / 1e12:.2f} TB/s, the best copy measured before these steps; the run's copies: "
                  f"{measured} TB/s):", "",
                  "| rows | step ms | floor ms | x floor | ms / token |", "|---|---|---|---|---|"]
        for rows, s in r["decode_steps"].items():
            lines.append(f"| {rows} | {s['step_ms']:.3f} | {s['floor_ms']:.3f} | {s['over_floor']:.2f} | "
                         f"{s['step_ms'] / int(rows):.3f} |")
    if r["batch_path"] != "fused scheduler":
        lines += ["", "generate_batch did not take the fused scheduler here: its requests ran through generate one "
                  "after another, and their timestamps all read at the end (per-token latencies 0)."]
    if r["failed"]:
        lines += ["", f"Failed in generate_batch: {r['failed']}"]
    return "\n".join(lines) + "\n"


def run(args) -> dict:
    """The runs; the report is written after each, so a run cut short by a time limit keeps what it measured."""
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    moe = args.model == "35b-a3b"
    shape = ("tiny-moe" if moe else "tiny") if args.tiny else MODELS[args.model]
    prompt_range = args.prompt_range or ((4, 40) if args.tiny else (32, 2048))
    new_range = args.new_range or ((2, 12) if args.tiny else (16, 512))
    log(f"building stock and fused {shape} ({args.dtype}) on {device}")
    stock, fused = build_pair(shape, None, device, dtype, seed=args.seed, layers=args.layers)
    stock.to(device)
    fused.to(device)
    for model in (stock, fused):  # EOS off: every request generates exactly its count
        model.generation_config.eos_token_id = None
        model.config.eos_token_id = None
    vocab = stock.config.vocab_size
    requests = workload(args.requests, prompt_range, new_range, vocab, args.seed)
    subset = requests[: args.stock_requests]
    tokens = sum(n for _, n in requests)
    sub_tokens = sum(n for _, n in subset)
    batch_mod = import_module("fused_batch")
    blocker = batch_mod.batch_blocker(fused, fused.generation_config)
    results = {"model": shape, "dtype": args.dtype, "device": str(device), "requests": len(requests),
               "stock_requests": len(subset), "prompt_range": prompt_range, "new_range": new_range, "seed": args.seed,
               "batch": args.batch, "rows": args.rows, "prefill_chunk": args.prefill_chunk,
               "warm": args.warm,
               "batch_path": "fused scheduler" if blocker is None else f"generate per request ({blocker})",
               "runs": {}, "ratios": {}, "parts": {}, "decode_steps": {}, "failed": [], "batch_only": args.batch_only,
               "card": torch.cuda.get_device_name(device) if device.type == "cuda" else None}
    log(f"workload: {len(requests)} requests, {tokens} output tokens; stock on {len(subset)}")

    # warm-up: every path once on a few requests, so no run pays for compiling / capturing its first shapes
    warm = requests[: min(4, len(requests))]
    # stock has no graph or bucket to warm: a few short requests load its kernels (its 452-step warm-up took 51 s);
    # --batch-only never runs stock
    if not args.batch_only:
        static_batches(stock, [(p[:64], 4) for p, _ in warm], args.batch, device, "warm-up stock")
    static_batches(fused, warm, args.batch, device, "warm-up fused")

    if args.batch_only:
        stock_s, fused_s = _earlier_static_runs(args.static_from, results) if args.static_from else (None, None)
    else:
        stock_s, fused_s = _static_runs(args, results, stock, fused, requests, subset, tokens, sub_tokens, device)
    if args.static_only:
        return results
    stock = _free(stock, device)  # generate_batch sizes its buffers from the free memory: stock's is not the user's
    # each (rows, prefill_chunk) setting in turn, the most rows last: its buffers are the ones the steps are timed on;
    # with --variant, every setting under each variant's constants in turn, its steps timed (and profiled) on its own
    # buffers; the first variant's are the report's
    variants = parse_variants(args.variant)
    timed_steps = device.type == "cuda" and blocker is None
    if timed_steps:
        ceilings = measure_ceilings(device)
        context = round(statistics.fmean(len(p) + n / 2 for p, n in requests))
        results["context"], results["copy_bytes_per_s"] = context, ceilings["copy_bytes_per_s"]
    for vname, vsets in variants:
        tag = f" [{vname}]" if len(variants) > 1 else ""
        with ab_decode.constants(vsets):
            if len(variants) > 1:
                fused.set_fused_kernels(False).set_fused_kernels(True)  # new buffers and graphs under these values
            for rows, chunk, ride in settings(args):
                name = f"(3) fused generate_batch, {rows} rows, chunk {chunk}" + (", riding" if ride else "") + tag
                _batch_setting(args, results, name, fused, requests, subset, warm, rows, chunk, ride, fused_s,
                               stock_s, device)
            if timed_steps:
                # the floor's copy rate: the best of the run's measurements (one at the start, one before each
                # variant's steps), since a copy timed while the clocks are low reads slow and flatters the steps
                # (one H100 start measured 2.56 TB/s where others read 2.98 for the same step times)
                rates = results.setdefault("copy_rates_measured", [ceilings["copy_bytes_per_s"]])
                try:
                    rates.append(measure_ceilings(device)["copy_bytes_per_s"])
                except torch.OutOfMemoryError:  # the batch buffers left no 2 GiB: the start's figure stands
                    torch.cuda.empty_cache()
                results["copy_bytes_per_s"] = max(rates)
                with torch.inference_mode():
                    steps = time_decode_steps(fused, context, results["copy_bytes_per_s"])
                    profiles = profile_decode_steps(fused, context, args.profile_steps) if args.profile_steps else {}
                results.setdefault("decode_steps_by_variant", {})[vname] = {str(r): v for r, v in steps.items()}
                results.setdefault("step_profiles_by_variant", {})[vname] = {str(r): v for r, v in profiles.items()}
                log(f"captured step ms at {context} keys{tag}: "
                    + ", ".join(f"{r} rows {v['step_ms']:.3f}" for r, v in steps.items()))
        save(args, results)
    if timed_steps:
        results["decode_steps"] = results["decode_steps_by_variant"][variants[0][0]]
        results["step_profiles"] = results["step_profiles_by_variant"][variants[0][0]]
    return results


def _batch_setting(args, results, name, fused, requests, subset, warm, rows, chunk, ride, fused_s, stock_s,
                   device) -> None:
    """One ``generate_batch`` setting: its first shapes warmed off the clock, then the timed run, its stats and
    ratios into ``results`` (saved)."""
    batch_mod = import_module("fused_batch")
    log(name)
    batch_mod.MIXED_ON_GPU = ride  # read once per generate_batch call (BatchEngine.ride)
    # this setting's own first shapes, off the clock (the prompts' graphs stay for the run: kept across sizes)
    start = time.perf_counter()
    count = warm_up(fused, requests, rows, device, chunk, args.warm, warm)
    results.setdefault("warmup_s", {})[name] = (count, time.perf_counter() - start)
    batch_run = continuous(fused, requests, rows, device, chunk)
    results["runs"][name] = cont_s = stats(batch_run, batch_run["tokens"])
    if batch_run["parts"]:
        results["parts"][name] = {"wall_s": batch_run["wall_s"], **batch_run["parts"]}
    results["failed"] += [f"{name}: {f}" for f in batch_run["failed"]]
    # the subset's requests as they ran among all the others (throughput: the whole run's)
    sub = [batch_run["by_id"][f"req_{i}"] for i in range(len(subset)) if f"req_{i}" in batch_run["by_id"]]
    results["runs"][f"{name}, subset latencies"] = stats(
        {"wall_s": batch_run["wall_s"], "ttft": [t for t, _ in sub], "per_token": [s for _, s in sub]},
        batch_run["tokens"])
    if fused_s is not None:
        results["ratios"][f"{name} / (2) fused static"] = (cont_s["tokens_per_s"] / fused_s["tokens_per_s"],
                                                            ">= 3x at 4B")
        results["ratios"][f"{name} / (1) stock static (stock on its subset)"] = (
            cont_s["tokens_per_s"] / stock_s["tokens_per_s"], ">= 20x at 4B")
    save(args, results)


def parse_variants(specs: list[str] | None) -> list[tuple[str, list]]:
    """``--variant NAME:MODULE.CONSTANT=VALUE,...`` (as ``scripts/ab_decode.py`` takes them) -> [(name, [(module,
    constant, value), ...])]; none given: one variant, the shipped values."""
    if not specs:
        return [("shipped", [])]
    modules = ab_decode.variant_modules()
    return [ab_decode.parse_variant(spec, modules) for spec in specs]


def _free(model, device) -> None:
    """Release ``model``'s device memory (the caller drops its last reference with the returned None)."""
    model.to("meta")
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _static_runs(args, results, stock, fused, requests, subset, tokens, sub_tokens, device):
    """Runs (1) and (2) and their ratio into ``results`` (saved); returns their stats."""
    stock_run = static_batches(stock, subset, args.batch, device, "(1) stock static")
    results["runs"]["(1) stock static, subset"] = stock_s = stats(stock_run, sub_tokens)
    fused_run = static_batches(fused, requests, args.batch, device, "(2) fused static")
    results["runs"]["(2) fused static"] = fused_s = stats(fused_run, tokens)
    batches = -(-len(subset) // args.batch)
    sub_run = {"wall_s": sum(fused_run["batch_s"][:batches]), "ttft": fused_run["ttft"][: len(subset)],
               "per_token": fused_run["per_token"][: len(subset)]}
    results["runs"]["(2) fused static, subset"] = fused_sub = stats(sub_run, sub_tokens)
    results["ratios"] = {"(2) / (1) on the same subset": (fused_sub["tokens_per_s"] / stock_s["tokens_per_s"], "")}
    save(args, results)
    return stock_s, fused_s


# what makes two reports' runs comparable: the same workload, static batches, dtype and card
SAME_WORKLOAD = ("model", "dtype", "card", "requests", "stock_requests", "prompt_range", "new_range", "seed", "batch")


def _earlier_static_runs(path: Path, results: dict):
    """Runs (1) and (2) of an earlier ``--static-only`` (or cut-short) report at ``path`` into ``results``, for a
    ``--batch-only`` run's ratios: a model too slow for one device call runs them in one process and
    ``generate_batch`` in the next. Refuses a report of another workload, dtype or card. Returns their stats."""
    earlier = json.loads(Path(path).read_text())
    for key in SAME_WORKLOAD:
        mine, theirs = results[key], earlier.get(key)
        if (list(mine) if isinstance(mine, tuple) else mine) != theirs:
            raise SystemExit(f"--static-from {path}: its {key} is {theirs!r}, this run's {mine!r}; run the same "
                             "workload (--model, --requests, --stock-requests, ranges, --seed, --batch, --dtype) on "
                             "the same card")
    runs = earlier["runs"]
    if "(2) fused static" not in runs:
        raise SystemExit(f"--static-from {path}: it holds no run (2) (its runs: {sorted(runs)}); run it with "
                         "--static-only first")
    for name in ("(1) stock static, subset", "(2) fused static", "(2) fused static, subset"):
        results["runs"][name] = runs[name]
    results["ratios"] = {k: v for k, v in earlier["ratios"].items() if k.startswith("(2) / (1)")}
    results["static_from"] = str(path)
    return runs["(1) stock static, subset"], runs["(2) fused static"]


def save(args, results: dict) -> None:
    write_report(args.out, "batch", results, to_markdown(results))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="4b", choices=sorted(MODELS), help="the real shape, random weights")
    p.add_argument("--tiny", action="store_true", help="the tiny test config instead (tiny-moe with 35b-a3b)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--requests", type=int, default=512)
    p.add_argument("--stock-requests", type=int, default=64, help="stock runs this many of the requests (a subset)")
    p.add_argument("--batch", type=int, default=32, help="the static batch size of runs (1) and (2)")
    p.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[32],
                   help="comma list of generate_batch's rows (max_requests_per_batch), each run in turn")
    p.add_argument("--prefill-chunk", type=_chunks, default=[None],
                   help="comma list of generate_batch's prefill_chunk, 'none' for whole prompts (default: none)")
    p.add_argument("--ride", type=lambda s: [{"on": True, "off": False}[c.strip()] for c in s.split(",")],
                   default=None, help="comma list of on/off: on a GPU, prompt chunks ride on the decode step "
                   "(fused_batch.MIXED_ON_GPU) or run before it (default: as shipped, on; on CPU always on)")
    p.add_argument("--prompt-range", type=lambda s: tuple(int(x) for x in s.split(",")), default=None,
                   help="min,max prompt tokens (default 32,2048; tiny 4,40)")
    p.add_argument("--new-range", type=lambda s: tuple(int(x) for x in s.split(",")), default=None,
                   help="min,max new tokens (default 16,512; tiny 2,12)")
    p.add_argument("--layers", type=int, default=0, help="decoder layers (0: the shape's own)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warm", default="buckets", choices=["buckets", "few"],
                   help="before each generate_batch setting: a call that captures every prompt bucket the workload "
                        "uses (buckets), or one over its first 4 requests (few: the timed run captures the rest)")
    p.add_argument("--batch-only", action="store_true",
                   help="run (3) only (its ratios then need (1) and (2) from another run of the same workload: "
                        "--static-from)")
    p.add_argument("--static-only", action="store_true",
                   help="run (1) and (2) only: with --batch-only --static-from in a second process, a model whose "
                        "whole run outlasts one device call")
    p.add_argument("--static-from", type=Path, default=None,
                   help="with --batch-only: the batch.json of a --static-only run of the same workload on the same "
                        "card, whose (1) and (2) this run's ratios are taken against")
    p.add_argument("--variant", action="append", default=None,
                   help="NAME:MODULE.CONSTANT=VALUE,... as scripts/ab_decode.py takes it, repeatable: every "
                        "generate_batch setting runs under each variant's constants in turn, the model's graphs and "
                        "buffers dropped between them, and each variant's captured steps are timed (and profiled) "
                        "on its own buffers; the first is the baseline")
    p.add_argument("--profile-steps", type=lambda s: [int(x) for x in s.split(",") if x], default=[],
                   help="comma list of row buckets whose captured decode step to profile after the runs (GPU): the "
                        "kernels and their time a step")
    p.add_argument("--out", type=Path, default=Path("out/batch"))
    args = p.parse_args(argv)
    if args.static_only and args.batch_only:
        p.error("--static-only and --batch-only exclude each other: the first runs (1) and (2), the second (3)")
    if args.static_from is not None and not args.batch_only:
        p.error(f"--static-from {args.static_from} needs --batch-only: it supplies the (1) and (2) that run skips")
    if args.device == "cpu" and args.dtype == "bfloat16":
        args.dtype = "float32"
    args.stock_requests = min(args.stock_requests, args.requests)
    if args.ride is None:
        args.ride = [import_module("fused_batch").MIXED_ON_GPU]
    if not args.device.startswith("cuda"):
        args.ride = [True]  # off a GPU the chunks always ride (the CPU emulation's mixed step)
    with stock_cpu_guard(torch.device(args.device)):  # on CPU, stock (and the fused fallback) run torch code
        results = run(args)
    save(args, results)
    return results


if __name__ == "__main__":
    main()
