"""Side-by-side latency benchmark: stock transformers Qwen3.5 and the fused classes, in one process, interleaved.

    # real shapes with random weights (the GPU numbers in docs/BENCHMARKS.md)
    python scripts/benchmark_latency.py --shapes 0.8B,4B,9B --dtype bfloat16 --out out/bench
    # a named model (folder or Hub id), e.g. the small model shipped in this repo
    python scripts/benchmark_latency.py --model . --dtype float32
    # CPU smoke run (what CI runs): tiny config, few repeats
    python scripts/benchmark_latency.py --shapes tiny --device cpu --lengths 8,16 --requests 4 --new-tokens 4
    # the stalls and long prompts (issue targets: new shapes, cold start, 32k / 128k context)
    python scripts/benchmark_latency.py --shapes 4B --lengths '' --requests 0 --decode-batches 1,8,32 \
        --new-shapes 2x32,4x1152,8x32 --cold-start stock,fused --long-context 32768,131072

Measures, for each model: forward latency without cache at fixed lengths (median, p90; CUDA events on GPU), a
request set with a realistic spread of lengths (median, mean, p90, p95, and requests over 2,048 tokens apart),
decode ms/token (median of --decode-repeats) and tokens/s through plain `generate()` at batch 1 and 8, and peak memory
of a forward. Optional runs: `--new-shapes` (the first call at a new batch or prompt length in a warm process),
`--cold-start` (the first `generate` in fresh processes with an empty, then a warm Triton cache), `--long-context`
(prefill time, its peak memory and decode ms/token at long contexts). On a GPU it also measures, in the same run,
the two ceilings (device copy bandwidth, bf16 GEMM rate) and reports each time against its floor: the weight-read
floor for decode (the weight bytes a step reads / copy bandwidth) and for forwards the larger of the matmul floor
(2 x parameters x tokens / GEMM rate) and the weight-read floor. Writes `results.json`, `results.md` and
`latency.png` to --out.
"""

import argparse
import contextlib
import gc
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from scripts.common import (  # noqa: E402
    import_module, import_repo, is_moe_shape, moe_text_kwargs, real_text_kwargs, tiny_text_kwargs, write_report,
)


def stock_cpu_guard(device):
    """Stock Qwen3.5 + fla sends CPU tensors to fla's Triton kernels (a crash); on CPU route them to torch."""
    if device.type != "cpu":
        return contextlib.nullcontext()
    return import_module("fused_compat").torch_reference_kernels()


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------------------- timing


class Timer:
    """Times a callable: CUDA events on GPU, perf_counter on CPU. Returns milliseconds."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3


def percentile(values, q: float) -> float:
    values = sorted(values)
    if not values:
        return float("nan")
    k = (len(values) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def summary(values) -> dict:
    return {"median": statistics.median(values), "mean": statistics.fmean(values), "p90": percentile(values, 0.9),
            "p95": percentile(values, 0.95), "n": len(values)}


def measure_ceilings(device: torch.device) -> dict:
    """Device copy bandwidth (bytes read + written) and bf16 GEMM rate on random data, measured now."""
    if device.type != "cuda":
        return {}
    timer = Timer(device)
    src = torch.randn(1024 * 1024 * 1024 // 2, device=device, dtype=torch.bfloat16)  # 1 GiB
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    copy_ms = statistics.median(timer(lambda: dst.copy_(src)) for _ in range(20))
    bandwidth = 2 * src.numel() * src.element_size() / (copy_ms * 1e-3)
    del src, dst
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    gemm_ms = statistics.median(timer(lambda: a @ b) for _ in range(10))
    del a, b
    torch.cuda.empty_cache()
    return {"copy_bytes_per_s": bandwidth, "bf16_flops_per_s": 2 * n**3 / (gemm_ms * 1e-3)}


# ---------------------------------------------------------------------------------------------------------- models


def build_pair(shape: str | None, model_id: str | None, device, dtype, seed: int = 0, layers: int = 0):
    """(stock, fused) models with identical weights. Random weights for `shape` (only `layers` decoder layers when
    > 0), else loaded from `model_id`."""
    stock = build_one(shape, model_id, device, dtype, fused=False, seed=seed, layers=layers)
    if model_id is not None:
        return stock, build_one(shape, model_id, device, dtype, fused=True)
    kwargs, _, fused_cls, fused_config = _classes(shape, layers)
    # Build the fused model on the meta device and hand it the stock model's tensors (no second copy is
    # allocated and then freed), then pack: packing copies each projection group once into its packed matrix. (A MoE
    # model's experts are not packed: the pair shares them, so 35B-A3B's pair fits one H200.)
    with torch.device("meta"):
        fused = fused_cls(fused_config(**kwargs, fused_kernels=True))
    fused.load_state_dict(stock.state_dict(), assign=True)
    fused.to(dtype).eval()
    # Non-persistent buffers (the rotary inv_freq) are not in the state dict: stock's, as stock holds them (float32
    # in a bf16 model), handed over after the cast above, which would round them to `dtype` (and move the rotary
    # angles: 4e-3 in bf16 cos / sin)
    for name, buf in stock.named_buffers():
        owner, _, attr = name.rpartition(".")
        setattr(fused.get_submodule(owner), attr, buf)
    fused._refresh_fused()
    return stock, fused


def build_one(shape: str | None, model_id: str | None, device, dtype, fused: bool, seed: int = 0, layers: int = 0):
    """The stock or the fused model alone, as a user builds it (loaded from `model_id`, or random weights at `shape`
    built in `dtype` on `device`, `layers` decoder layers when > 0): what a cold start pays for, without the other
    model of `build_pair`."""
    from transformers import AutoModelForCausalLM

    if model_id is not None:
        extra = {"trust_remote_code": True, "fused_kernels": True} if fused else {}
        return AutoModelForCausalLM.from_pretrained(model_id, dtype=dtype, **extra).to(device).eval()
    kwargs, (stock_cls, stock_config), fused_cls, fused_config = _classes(shape, layers)
    config = fused_config(**kwargs, fused_kernels=True) if fused else stock_config(**kwargs)
    torch.manual_seed(seed)
    # Built directly in the target dtype on the target device: 27B in bf16 is 54 GB; built in fp32 first it would
    # need 108 GB plus the cast's copy, more than one H200 holds.
    with torch.device(device):
        return (fused_cls if fused else stock_cls)._from_config(config, dtype=dtype).eval()


def _classes(shape: str, layers: int = 0):
    """(config kwargs, (stock class, stock config class), fused class, fused config class) of a random-weight
    `shape`: "tiny", a `REAL_SHAPES` size, or a MoE shape (`scripts.common.is_moe_shape`: "tiny-moe", "35B-A3B");
    with `layers` > 0, that many decoder layers."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3_5TextConfig

    configuration, modeling, _ = import_repo()
    depth = {"num_hidden_layers": layers} if layers > 0 else {}
    if is_moe_shape(shape):
        return (moe_text_kwargs(shape, **depth), (Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig),
                modeling.Qwen3_5MoeFusedForCausalLM, configuration.Qwen3_5MoeFusedTextConfig)
    kwargs = tiny_text_kwargs(**depth) if shape == "tiny" else real_text_kwargs(shape, **depth)
    return (kwargs, (Qwen3_5ForCausalLM, Qwen3_5TextConfig), modeling.Qwen3_5FusedForCausalLM,
            configuration.Qwen3_5FusedTextConfig)


def gpu_device_map(model, n: int) -> dict:
    """A device_map over GPUs 0..n-1: the decoder layers in n equal runs, the embeddings on GPU 0, the final norm on
    the last GPU, the LM head with the embeddings when they are tied, else on the last GPU."""
    layers = len(model.model.layers)
    device_map = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.norm": n - 1,
                  "lm_head": 0 if model.config.tie_word_embeddings else n - 1}
    device_map.update({f"model.layers.{i}": i * n // layers for i in range(layers)})
    return device_map


def split_over_gpus(model, n: int):
    """Dispatch `model` over n GPUs with accelerate, as `from_pretrained(device_map=...)` does."""
    from accelerate import dispatch_model

    return dispatch_model(model, device_map=gpu_device_map(model, n))


def param_counts(model) -> dict:
    """Parameter counts and bytes, each tensor counted once by its memory (tied or shared weights are one).
    `read_bytes`: what one forward or decode step reads of them: all but an untied input embedding table, of which a
    step gathers only its tokens' rows (9B: 2 GB of 17.9 not read; a tied table is read whole, as the LM head)."""
    unique = {p.data_ptr(): p for p in model.parameters()}.values()
    embed = model.get_input_embeddings().weight
    total = sum(p.numel() for p in unique)
    tied = model.lm_head.weight.data_ptr() == embed.data_ptr()
    head = model.lm_head.weight.numel()
    body = total - embed.numel() - (0 if tied else head)
    nbytes = sum(p.numel() * p.element_size() for p in unique)
    read = nbytes - (0 if tied else embed.numel() * embed.element_size())
    return {"total": total, "body": body, "lm_head": head, "tied": tied, "weight_bytes": nbytes, "read_bytes": read}


# ---------------------------------------------------------------------------------------------------------- runs


def forward_variants(models: dict) -> list:
    """(name, model, cuda_graphs) for the forward runs: stock, the fused kernels run eagerly, and the fused forward
    replayed from its CUDA graphs (the fused model's `cuda_graphs` switch is set per variant with `set_cuda_graphs`, so one model serves both)."""
    variants = [("stock", models["stock"], None)]
    if "fused" in models:
        variants += [("fused-eager", models["fused"], False), ("fused", models["fused"], True)]
    return variants


@contextlib.contextmanager
def graphs_switch(model, graphs):
    if graphs is None:
        yield
        return
    saved = model.config.cuda_graphs
    model.set_cuda_graphs(graphs)
    try:
        yield
    finally:
        model.set_cuda_graphs(saved)


def scoring_forward(model, graphs, ids, device):
    """One no-cache forward with last-token logits (what a scoring / classification call does)."""
    with torch.inference_mode(), stock_cpu_guard(device), graphs_switch(model, graphs):
        return model(input_ids=ids, use_cache=False, logits_to_keep=1)


def plain_forward(model, graphs, ids, mask, device):
    """`model(**tokenizer(...))` as users call it: a padding mask, the config's `use_cache=True` (a cache returned)."""
    with torch.inference_mode(), stock_cpu_guard(device), graphs_switch(model, graphs):
        return model(input_ids=ids, attention_mask=mask, logits_to_keep=1)


def plain_forward_latency(models: dict, lengths, batch, repeats, device, vocab, timer) -> dict:  # noqa: PLR0913
    """Median latency of `plain_forward` on a left-padded batch (the last row a quarter padding), per length: the
    fused model's masked, left-padded graph path that also returns the cache."""
    variants = forward_variants(models)
    out = {name: {} for name, _, _ in variants}
    for T in lengths:
        ids = torch.randint(0, vocab, (batch, T), device=device)
        mask = torch.ones_like(ids)
        mask[-1, : T // 4] = 0
        for name, model, graphs in variants:
            for _ in range(3):
                plain_forward(model, graphs, ids, mask, device)
        times = {name: [] for name, _, _ in variants}
        for _ in range(repeats):
            for name, model, graphs in variants:
                times[name].append(timer(lambda: plain_forward(model, graphs, ids, mask, device)))
        for name in times:
            out[name][T] = summary(times[name])
        log(f"plain forward (padded, cache) batch={batch} T={T}: "
            + ", ".join(f"{n} {out[n][T]['median']:.2f} ms" for n in times))
    return out


def forward_latency(models: dict, lengths, batch, repeats, device, vocab, timer) -> dict:  # noqa: PLR0913
    """Median forward latency per length; each variant is called 3 times first (the fused forward's bucket is
    captured on its second call), then the variants are timed interleaved, so drift hits all alike."""
    variants = forward_variants(models)
    out = {name: {} for name, _, _ in variants}
    for T in lengths:
        ids = torch.randint(0, vocab, (batch, T), device=device)
        for name, model, graphs in variants:
            for _ in range(3):
                scoring_forward(model, graphs, ids, device)
        times = {name: [] for name, _, _ in variants}
        for _ in range(repeats):
            for name, model, graphs in variants:
                times[name].append(timer(lambda: scoring_forward(model, graphs, ids, device)))
        for name in times:
            out[name][T] = summary(times[name])
        log(f"forward T={T}: " + ", ".join(f"{n} {out[n][T]['median']:.2f} ms" for n in times))
    return out


def request_lengths(n: int, max_len: int, seed: int = 0) -> list[int]:
    """A request set with a realistic spread: log-normal lengths (median ~300 tokens), a tail past 2,048."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.exp(torch.randn(n, generator=g) * 1.1 + math.log(300))
    return [int(min(max_len, max(8, round(x)))) for x in raw.tolist()]


def request_set(models: dict, lengths, device, vocab, timer) -> dict:
    """Each request is timed once per variant after two untimed calls at its length (steady state: the fused
    forward's length bucket captured, stock's allocator warm). The padding to the bucket is inside the timing."""
    variants = forward_variants(models)
    times = {name: [] for name, _, _ in variants}
    for i, T in enumerate(lengths):
        ids = torch.randint(0, vocab, (1, T), device=device)
        for name, model, graphs in variants:
            for _ in range(2):
                scoring_forward(model, graphs, ids, device)
            times[name].append(timer(lambda: scoring_forward(model, graphs, ids, device)))
        if (i + 1) % 10 == 0 or i + 1 == len(lengths):
            log(f"requests {i + 1}/{len(lengths)}")
    out = {}
    for name in times:
        long = [t for t, T in zip(times[name], lengths) if T > 2048]
        out[name] = {"all": summary(times[name]), "over_2048": summary(long) if long else None}
    return out


def generate_tokens(model, ids, n: int, device) -> None:
    """`generate` exactly `n` new tokens greedily after the prompt `ids` [B, T] (no padding: an all-ones mask), the
    stock model on CPU routed around fla (`stock_cpu_guard`), and wait for the GPU: what every timing here times."""
    with torch.inference_mode(), stock_cpu_guard(device):
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, pad_token_id=0)
    if device.type == "cuda":
        torch.cuda.synchronize()


def decode_speed(models: dict, batch: int, prompt_len: int, new_tokens: int, device, vocab, repeats: int = 3,
                 pdl_ab: bool = False) -> dict:
    """ms per generated token through plain generate(): (time for N new tokens - time for 1) / (N - 1), measured
    `repeats` times per variant; `ms_per_token` is the median, `ms_per_token_stats` has median / mean / p90 / p95
    and `ms_per_token_range` the fastest and slowest repeat.

    The fused model runs twice: with its CUDA graphs ("fused") and with the same fused step run eagerly
    ("fused-eager", `cuda_graphs` off), so the graphs' share of the gain is measured too. Also records the peak
    memory of the N-token call and the fused decode cache's preallocated bytes. With `pdl_ab` (and a GPU whose
    kernels use programmatic dependent launch) a third fused run, "fused-no-pdl", captures its graphs with PDL off:
    PDL's share of the gain, measured in the same process."""
    ids = torch.randint(3, vocab, (batch, prompt_len), device=device)
    variants = [("stock", models["stock"], None)]
    fused_ops_runtime = import_module("fused_ops_runtime")  # PDL_ENABLED is read there
    if "fused" in models:
        variants += [("fused-eager", models["fused"], False), ("fused", models["fused"], True)]
        if pdl_ab and fused_ops_runtime.pdl_enabled(device):
            variants.append(("fused-no-pdl", models["fused"], True))
    out = {}
    for name, model, graphs in variants:
        if graphs is not None:
            saved = model.config.cuda_graphs
            model.set_cuda_graphs(graphs)
        if name == "fused-no-pdl":  # new graphs, captured with PDL off (a launch option, read at capture)
            fused_ops_runtime.PDL_ENABLED = False
            model.set_fused_kernels(False).set_fused_kernels(True)

        def run(n):
            generate_tokens(model, ids, n, device)

        warm_ms = []
        for _ in range(2):  # warm: autotune, the decode step's graph (first call), the prompt's graph (second call)
            t0 = time.perf_counter()
            run(4)
            warm_ms.append((time.perf_counter() - t0) * 1e3)
        per_tokens, firsts = [], []
        for rep in range(max(1, repeats)):
            t0 = time.perf_counter()
            run(1)
            t1 = time.perf_counter()
            if device.type == "cuda" and rep == 0:
                torch.cuda.reset_peak_memory_stats(device)
            run(new_tokens)
            t2 = time.perf_counter()
            if device.type == "cuda" and rep == 0:
                peak = torch.cuda.max_memory_allocated(device)
            per_tokens.append(((t2 - t1) - (t1 - t0)) / (new_tokens - 1) * 1e3)
            firsts.append((t1 - t0) * 1e3)
        per_token = statistics.median(per_tokens)
        # first_token_ms: a whole generate call for one new token (prompt forward + LM head + generate's set-up)
        out[name] = {"ms_per_token": per_token, "tokens_per_s": batch * 1e3 / per_token,
                     "ms_per_token_stats": summary(per_tokens), "ms_per_token_range": [min(per_tokens), max(per_tokens)],
                     "first_token_ms": statistics.median(firsts),
                     # the first two 4-token calls of this variant in the process: what a first `generate` pays for
                     # compiling, autotuning, small_linear's timing and the captures (compiled kernels may come from
                     # Triton's on-disk cache, and an earlier variant or batch may have compiled some already)
                     "warmup_calls_ms": warm_ms}
        if device.type == "cuda":
            out[name]["peak_bytes"] = peak
        if graphs is not None:
            model.set_cuda_graphs(saved)
            decode = model.describe()["decode"]
            out[name]["cache_bytes"] = max((b["cache_bytes"] for b in decode["buckets"] if b["batch"] == batch),
                                           default=0)
            # which decode-step linears run on our GEMV and which on cuBLAS (timed per shape on this card)
            linears = {k: v for k, v in decode.get("linears", {}).items() if k.startswith(f"{batch}x")}
            if linears:
                out[name]["linears"] = linears
                ours = sum(v != "cublas" for v in linears.values())
                log(f"decode batch={batch} {name}: our kernel (GEMV / skinny GEMM) chosen for {ours} of "
                    f"{len(linears)} linear shapes")
        if name == "fused-no-pdl":  # back to the default for what runs next
            fused_ops_runtime.PDL_ENABLED = True
            model.set_fused_kernels(False).set_fused_kernels(True)
        log(f"decode batch={batch} {name}: {per_token:.3f} ms/token (median of {len(per_tokens)}; "
            f"{min(per_tokens):.3f} to {max(per_tokens):.3f}), first token {out[name]['first_token_ms']:.2f} ms, "
            f"warm-up calls {warm_ms[0]:.0f} / {warm_ms[1]:.0f} ms")
    return out


class CompileLog:
    """Counts the Triton compiles inside a `with` block (Triton's JIT hooks): per kernel name, how many and the
    wall-clock seconds from the compile's start to its end (a binary Triton found in its on-disk cache counts too,
    in milliseconds). Without triton, or with another hook installed, it records nothing."""

    def __init__(self):
        self.by_kernel: dict = {}
        self._start: dict = {}
        self._runtime = None

    def __enter__(self):
        try:
            import triton

            runtime = triton.knobs.runtime
        except (ImportError, AttributeError):
            return self
        if runtime.jit_cache_hook is None and runtime.jit_post_compile_hook is None:
            self._runtime = runtime
            runtime.jit_cache_hook, runtime.jit_post_compile_hook = self._before, self._after
        return self

    def __exit__(self, *exc):
        if self._runtime is not None:
            self._runtime.jit_cache_hook = self._runtime.jit_post_compile_hook = None
        return False

    def _before(self, *, key, fn, **_):
        self._start[(fn.name, str(key))] = time.perf_counter()
        return False  # compile as usual

    def _after(self, *, key, fn, **_):
        t0 = self._start.pop((fn.name, str(key)), None)
        n, s = self.by_kernel.get(fn.name, (0, 0.0))
        self.by_kernel[fn.name] = (n + 1, s + (time.perf_counter() - t0 if t0 is not None else 0.0))

    def summary(self) -> dict:
        return {"compiles": sum(n for n, _ in self.by_kernel.values()),
                "compile_s": sum(s for _, s in self.by_kernel.values()),
                "by_kernel": {k: {"n": n, "s": round(s, 3)} for k, (n, s) in sorted(self.by_kernel.items())}}


def new_shape_calls(models: dict, shapes, new_tokens: int, device, vocab, profile_dir: Path | None = None) -> dict:
    """The stall at a new shape: for each `(batch, prompt_len)` in `shapes`, in order, in this process (after the
    other measurements, so every other shape is warm), the first `generate` of `new_tokens` tokens and then the same
    call again, wall-clock seconds. `stall_s` is first - repeat: what a user waits extra the first time they use that
    batch size or prompt length. With `profile_dir` the fused model's first calls run under cProfile (the top 25
    functions by cumulative time go to `first_call_{batch}x{len}.txt`)."""
    import cProfile
    import io
    import pstats

    out = {}
    for batch, prompt_len in shapes:
        ids = torch.randint(3, vocab, (batch, prompt_len), device=device)
        row = {}
        for name, model in models.items():
            def run():
                generate_tokens(model, ids, new_tokens, device)

            times, compiles = [], {}
            for call in range(2):
                prof = cProfile.Profile() if profile_dir is not None and call == 0 and name == "fused" else None
                with CompileLog() as clog:
                    t0 = time.perf_counter()
                    if prof is not None:
                        prof.runcall(run)
                    else:
                        run()
                    times.append(time.perf_counter() - t0)
                if call == 0:
                    compiles = clog.summary()
                if prof is not None:
                    text = io.StringIO()
                    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(25)
                    profile_dir.mkdir(parents=True, exist_ok=True)
                    (profile_dir / f"first_call_{batch}x{prompt_len}.txt").write_text(text.getvalue())
            row[name] = {"first_s": times[0], "repeat_s": times[1], "stall_s": times[0] - times[1], **compiles}
            log(f"new shape batch={batch} prompt={prompt_len} {name}: first {times[0]:.2f} s, repeat "
                f"{times[1]:.2f} s, stall {times[0] - times[1]:.2f} s; first call: {compiles.get('compiles', 0)} "
                f"Triton compiles, {compiles.get('compile_s', 0.0):.2f} s")
            if compiles.get("by_kernel"):
                log("  compiles by kernel: " + ", ".join(f"{k} {v['n']} ({v['s']:.2f} s)"
                                                        for k, v in compiles["by_kernel"].items()))
        out[f"{batch}x{prompt_len}"] = row
    return out


def context_bytes(config, context: int, dtype) -> int:
    """Bytes a decode step reads besides the weights at `context` tokens, batch 1: the full-attention layers' K and V
    (in `dtype`) and each Gated DeltaNet layer's recurrent state (fp32) and conv window (in `dtype`)."""
    elem = torch.empty((), dtype=dtype).element_size()
    kinds = list(config.layer_types)
    kv = kinds.count("full_attention") * 2 * context * config.num_key_value_heads * config.head_dim * elem
    state = config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim * 4
    conv_dim = 2 * config.linear_num_key_heads * config.linear_key_head_dim + \
        config.linear_num_value_heads * config.linear_value_head_dim
    conv = conv_dim * config.linear_conv_kernel_dim * elem
    return kv + kinds.count("linear_attention") * (state + conv)


def attention_flops(config, T: int) -> float:
    """FLOPs of the causal full-attention products (QK^T and PV, half the T x T square each) of a T-token prompt. The
    Gated DeltaNet rule's FLOPs grow linearly with T and are left out (at 4B about 3 MFLOP a token a layer, against
    8 GFLOP a token for the projections)."""
    kinds = list(config.layer_types)
    return kinds.count("full_attention") * 2.0 * T * T * config.num_attention_heads * config.head_dim


def long_context(models: dict, lengths, new_tokens: int, device, vocab, ceil: dict, counts: dict,  # noqa: PLR0913
                 dtype, repeats: int = 1) -> dict:
    """Long prompts, batch 1, per variant (stock, fused) and prompt length L, `repeats` timed pairs after the first
    call (medians; one pair's host hiccup of 30 ms moves a 64-token reading by 0.5 ms a token):

    - `first_call_s`: the first `generate` of `new_tokens` tokens at L (the decode cache bucket's first use, the
      eager prompt past the buckets, kernels first seen at this length) and `first_call_extra_s`, what it took beyond
      the timed repeat of the same call: the stall a user sees at a new context length;
    - `prefill_ms`: then a `generate` of one new token (the prompt's forward, the LM head, generate's set-up);
      `prefill_peak_bytes`: what the first such call allocated on top of the resident models (GPU);
    - `decode_ms_per_token` at context L: (time of `new_tokens` tokens - time of 1) / (`new_tokens` - 1), both timed
      after the first call, so no first-use cost lands in the decode figure; `decode_ms_range`: the fastest and
      slowest repeat;
    - floors (GPU): prefill = (2 x body parameters x L + the causal attention FLOPs) / measured GEMM rate; decode =
      (weights read + K/V at L + DeltaNet states) bytes / measured copy bandwidth.

    A variant that runs out of GPU memory at L is recorded as `{"oom": message}` and the run goes on."""
    config = models["stock"].config
    out = {}
    for L in lengths:
        ids = torch.randint(3, vocab, (1, L), device=device)
        row = {}
        if ceil:
            row["floor"] = {
                "prefill_ms": (2 * counts["body"] * L + 2 * counts["lm_head"] + attention_flops(config, L))
                / ceil["bf16_flops_per_s"] * 1e3,
                "decode_ms": (counts["read_bytes"] + context_bytes(config, L, dtype))
                / ceil["copy_bytes_per_s"] * 1e3,
                "context_bytes": context_bytes(config, L, dtype)}
        for name, model in models.items():
            def run(n):
                generate_tokens(model, ids, n, device)

            try:
                t_first = time.perf_counter()
                run(new_tokens)  # this length's first call, timed apart (see the docstring)
                t_first = time.perf_counter() - t_first
                prefills, per_tokens, calls, peak = [], [], [], None
                for i in range(max(1, repeats)):
                    if i == 0 and device.type == "cuda":
                        torch.cuda.reset_peak_memory_stats(device)
                        base = torch.cuda.memory_allocated(device)
                    t0 = time.perf_counter()
                    run(1)
                    t1 = time.perf_counter()
                    if i == 0 and device.type == "cuda":
                        peak = torch.cuda.max_memory_allocated(device) - base
                    run(new_tokens)
                    t2 = time.perf_counter()
                    prefills.append((t1 - t0) * 1e3)
                    per_tokens.append(((t2 - t1) - (t1 - t0)) / (new_tokens - 1) * 1e3)
                    calls.append(t2 - t1)
            except torch.cuda.OutOfMemoryError as e:
                row[name] = {"oom": str(e).splitlines()[0][:200]}
                log(f"long context L={L} {name}: out of memory")
                torch.cuda.empty_cache()
                continue
            per_token, prefill = statistics.median(per_tokens), statistics.median(prefills)
            row[name] = {"prefill_ms": prefill, "decode_ms_per_token": per_token,
                         "decode_ms_range": [min(per_tokens), max(per_tokens)], "prefill_peak_bytes": peak,
                         "first_call_s": t_first, "first_call_extra_s": t_first - statistics.median(calls)}
            log(f"long context L={L} {name}: prefill {prefill:.1f} ms, decode {per_token:.3f} ms/token"
                + (f" (median of {len(per_tokens)}; {min(per_tokens):.3f} to {max(per_tokens):.3f})"
                   if len(per_tokens) > 1 else "")
                + (f", prefill peak +{peak / 2**30:.2f} GiB" if peak is not None else "")
                + f", first call {t_first:.2f} s ({row[name]['first_call_extra_s']:+.2f} s on the repeat)")
        out[str(L)] = row
    return out


def cold_start(target: dict, variants, prompt_len: int, new_tokens: int) -> dict:
    """The first `generate` on a fresh machine: each variant in fresh subprocesses (`--cold-child`), first with an
    empty Triton cache directory (TRITON_CACHE_DIR; it also holds the fused GEMV choice record), then again on the
    cache the first process filled ("warm": a later process on the same machine). Each child builds its model alone
    (`build_one`, timed apart) and times its first and second `generate` of `new_tokens` tokens at batch 1. Variant
    "fused-untuned" is the fused model with the choices shipped per card off (`fused_tuning.USE_SHIPPED`): every
    GEMV candidate and fla config compiled and timed, as on a card the table does not name."""
    import os
    import subprocess
    import tempfile

    out = {}
    for variant in variants:
        with tempfile.TemporaryDirectory(prefix="qwen35-cold-") as tmp:
            env = dict(os.environ, TRITON_CACHE_DIR=str(Path(tmp) / "triton"))
            row = {}
            for phase in ("cold", "warm"):
                cmd = [sys.executable, str(Path(__file__).resolve()), "--cold-child", variant,
                       "--prompt-len", str(prompt_len), "--new-tokens", str(new_tokens), *target["argv"]]
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
                lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
                if proc.returncode or not lines:
                    raise RuntimeError(f"cold-start child {variant} ({phase}) failed:\n{proc.stderr[-3000:]}")
                row[phase] = json.loads(lines[-1][len("RESULT "):])
                r = row[phase]
                log(f"cold start {target['name']} {variant} ({phase} Triton cache): build {r['build_s']:.1f} s, first "
                    f"generate {r['first_s']:.2f} s, second {r['repeat_s']:.2f} s; {r.get('compiles', 0)} Triton "
                    f"compiles, {r.get('compile_s', 0.0):.1f} s")
                top = sorted(r.get("by_kernel", {}).items(), key=lambda kv: -kv[1]["s"])[:12]
                if top:
                    log("  slowest compiles by kernel: " + ", ".join(f"{k} {v['n']} ({v['s']:.1f} s)" for k, v in top))
            out[variant] = row
    return out


def cold_child(args) -> None:
    """One cold-start measurement (see `cold_start`), in this fresh process; prints `RESULT {json}`."""
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if args.cold_child == "fused-untuned":
        import_module("fused_tuning").USE_SHIPPED = False
    t0 = time.perf_counter()
    model = build_one(None if args.model else args.shapes, args.model, device, dtype, args.cold_child != "stock")
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    build_s = time.perf_counter() - t0
    ids = torch.randint(3, model.config.vocab_size, (1, args.prompt_len), device=device)
    times = []
    with CompileLog() as clog:
        for _ in range(2):
            t0 = time.perf_counter()
            generate_tokens(model, ids, args.new_tokens, device)
            times.append(time.perf_counter() - t0)
    print("RESULT " + json.dumps({"build_s": build_s, "first_s": times[0], "repeat_s": times[1], **clog.summary()}),
          flush=True)


def profile_forward(models: dict, T: int, device, vocab, rows: int = 12) -> dict:
    """One forward at T tokens under the torch profiler: kernel count, summed GPU time and the top kernels, and on the
    host side the ops with the most self CPU time (where host-bound wall time goes) and any device syncs."""
    from torch.profiler import ProfilerActivity, profile

    ids = torch.randint(0, vocab, (1, T), device=device)
    out = {}
    for name, model, graphs in forward_variants(models):
        for _ in range(3):
            scoring_forward(model, graphs, ids, device)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            scoring_forward(model, graphs, ids, device)
            torch.cuda.synchronize()
        averages = prof.key_averages()
        gpu = [e for e in averages if e.device_type.name == "CUDA"]
        cpu = [e for e in averages if e.device_type.name == "CPU"]
        total_us = sum(e.self_device_time_total for e in gpu)
        launches = sum(e.count for e in gpu)
        top = sorted(gpu, key=lambda e: -e.self_device_time_total)[:rows]
        top_cpu = sorted(cpu, key=lambda e: -e.self_cpu_time_total)[:rows]
        syncs = sum(e.count for e in cpu if "synchronize" in e.key.lower() or e.key in ("aten::item", "aten::_local_scalar_dense"))
        out[name] = {"kernels": launches, "gpu_ms": total_us / 1e3, "host_syncs": syncs,
                     "top": [(e.key[:90], e.count, round(e.self_device_time_total / 1e3, 3)) for e in top],
                     "top_cpu": [(e.key[:90], e.count, round(e.self_cpu_time_total / 1e3, 3)) for e in top_cpu]}
        log(f"profile T={T} {name}: {launches} kernels, {total_us / 1e3:.2f} ms GPU, {syncs} host syncs")
        for key, count, ms in out[name]["top"]:
            print(f"    gpu {ms:8.3f} ms  x{count:<5d} {key}")
        for key, count, ms in out[name]["top_cpu"]:
            print(f"    cpu {ms:8.3f} ms  x{count:<5d} {key}")
    return out


def kernel_times(prof) -> dict:
    """{kernel name: (launches, summed GPU microseconds)} of a torch profiler run."""
    return {e.key: (e.count, e.self_device_time_total) for e in prof.key_averages() if e.device_type.name == "CUDA"}


def per_token_kernels(short: dict, long: dict, tokens: int) -> dict:
    """Per generated token, per kernel name: {name: (launches, GPU us)} from `kernel_times` of a 1-token and a
    `tokens + 1`-token call of the same generate, so the prompt's kernels cancel; only kernels the longer call
    launches more often, largest time first."""
    rows = {}
    for name, (count, us) in long.items():
        c0, us0 = short.get(name, (0, 0.0))
        if count > c0:
            rows[name] = ((count - c0) / tokens, (us - us0) / tokens)
    return dict(sorted(rows.items(), key=lambda kv: -kv[1][1]))


PROFILE_VARIANTS = ("stock", "fused-eager", "fused")  # --profile-decode's: stock, fused without and with graphs


def profile_decode(models: dict, batch: int, prompt_len: int, new_tokens: int, device, vocab, rows: int = 12,
                   pdl: bool = True, variants=PROFILE_VARIANTS) -> dict:  # noqa: PLR0913
    """Per generated token under the torch profiler, for each decode variant named in `variants` (of
    `PROFILE_VARIANTS`: stock, fused without and with CUDA graphs): kernels and summed GPU time per token, and the kernels that take the most of it, each as the profile of
    a `new_tokens` call minus that of a 1-token call (`per_token_kernels`: the prefill cancels). Kernels replayed from
    a CUDA graph are recorded individually by CUPTI. With programmatic dependent launch on (`fused_ops.pdl_enabled`),
    a kernel's recorded time includes its wait for the one before, so the sum exceeds the token's time; `pdl=False`
    (`--profile-no-pdl`) re-captures the fused graphs with PDL off for per-kernel times, and restores it after."""
    from torch.profiler import ProfilerActivity, profile

    fused_ops_runtime = import_module("fused_ops_runtime")  # PDL_ENABLED is read there
    ids = torch.randint(3, vocab, (batch, prompt_len), device=device)
    runs = {"stock": (models["stock"], None), "fused-eager": (models["fused"], False), "fused": (models["fused"], True)}
    out = {}
    for name in variants:
        model, graphs = runs[name]
        if graphs is not None:
            saved = model.config.cuda_graphs
            model.set_cuda_graphs(graphs)
            if not pdl:  # new graphs, captured with PDL off (a launch option, read at capture)
                saved_pdl, fused_ops_runtime.PDL_ENABLED = fused_ops_runtime.PDL_ENABLED, False
                model.set_fused_kernels(False).set_fused_kernels(True)
        stats = {}
        for n in (1, new_tokens):
            with torch.inference_mode():
                model.generate(input_ids=ids, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    model.generate(input_ids=ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
                    torch.cuda.synchronize()
            stats[n] = kernel_times(prof)
        if graphs is not None:
            model.set_cuda_graphs(saved)
            if not pdl:
                fused_ops_runtime.PDL_ENABLED = saved_pdl
                model.set_fused_kernels(False).set_fused_kernels(True)
        kernels = per_token_kernels(stats[1], stats[new_tokens], new_tokens - 1)
        out[name] = {"kernels_per_token": sum(c for c, _ in kernels.values()),
                     "gpu_ms_per_token": sum(us for _, us in kernels.values()) / 1e3, "pdl": pdl,
                     "top": [(k[:90], round(c, 2), round(us / 1e3, 4)) for k, (c, us) in list(kernels.items())[:rows]]}
        log(f"profile decode batch={batch} {name}{'' if pdl else ' (PDL off)'}: "
            f"{out[name]['kernels_per_token']:.0f} kernels, {out[name]['gpu_ms_per_token']:.3f} ms GPU per token")
        for key, count, ms in out[name]["top"]:
            print(f"    gpu {ms * 1e3:8.1f} us  x{count:<6.1f} {key}")
    return out


def peak_memory(models: dict, T: int, device, vocab) -> dict:
    """Each variant's peak = its own weights + the most its no-cache forward allocates on top, over the calls that
    capture (fused + graphs: its graphs are freed first, so the eager call, the warm call and the capture are all
    inside the window) and a replay. Both models are resident."""
    if device.type != "cuda":
        return {}
    ids = torch.randint(0, vocab, (1, T), device=device)
    out = {}
    for name, model, graphs in forward_variants(models):
        if graphs:
            model.set_fused_kernels(True)  # frees the forward graphs captured by the latency runs
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        for _ in range(3 if graphs else 1):
            scoring_forward(model, graphs, ids, device)
        torch.cuda.synchronize()
        activations = torch.cuda.max_memory_allocated() - base
        out[name] = {"peak_bytes": param_counts(model)["weight_bytes"] + activations, "activation_bytes": activations}
    return out


# ---------------------------------------------------------------------------------------------------------- report


def to_markdown(results: dict) -> str:
    lines = [f"Run: {results['meta']['date']}, {results['meta']['device_name']}, torch {results['meta']['torch']}, "
             f"transformers {results['meta']['transformers']}, fla {results['meta']['fla']}, dtype {results['meta']['dtype']}"
             + (f", {results['meta']['gpus']} GPUs (device_map; peak memory is GPU 0's)" if results['meta'].get('gpus', 1) > 1 else ""),
             f"Command: `{results['meta']['command']}`", ""]
    ceil = results.get("ceilings") or {}
    if ceil:
        lines += [f"Measured ceilings: copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 GEMM "
                  f"{ceil['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s", ""]
    lines += ["Forward, no cache, batch 1, last-token logits (medians):", "",
              "| model | T | stock ms | fused eager ms | fused + graphs ms | speed-up | floor ms (matmul, or weight read "
              "where larger) | fused / floor |",
              "|---|---|---|---|---|---|---|---|"]
    for name, r in results["models"].items():
        for T, s in r["forward"]["stock"].items():
            f = r["forward"]["fused"][T]
            e = r["forward"].get("fused-eager", {}).get(T)
            floor = r["floors"]["forward_ms"].get(str(T)) if r["floors"] else None
            lines.append(f"| {name} | {T} | {s['median']:.2f} | {'-' if e is None else format(e['median'], '.2f')} | "
                         f"{f['median']:.2f} | {s['median'] / f['median']:.2f}x | "
                         + (f"{floor:.2f} | {f['median'] / floor:.2f}x |" if floor else "- | - |"))
    fmt = lambda a: " / ".join(f"{a[k]:.2f}" for k in ("median", "mean", "p90", "p95"))  # noqa: E731
    rows = [(name, r["requests"]) for name, r in results["models"].items() if r.get("requests")]
    if rows:
        lines += ["", "Request set (median / mean / p90 / p95 ms; > 2048 tokens: median):", "",
                  "| model | requests | stock | fused eager | fused + graphs | speed-up (median) | > 2048 tokens stock / fused |",
                  "|---|---|---|---|---|---|---|"]
    for name, q in rows:
        s, f, e = q["stock"], q["fused"], q.get("fused-eager")
        long = f"{s['over_2048']['median']:.1f} / {f['over_2048']['median']:.1f}" if s["over_2048"] else "-"
        lines.append(f"| {name} | {s['all']['n']} | {fmt(s['all'])} | {fmt(e['all']) if e else '-'} | {fmt(f['all'])} | "
                     f"{s['all']['median'] / f['all']['median']:.2f}x | {long} |")
    lines += ["", "Decode through `generate()` (ms/token: median of the repeats; fused + graphs range: fastest to "
              "slowest repeat):", "",
              "| model | batch | stock ms/token | fused eager ms/token | fused + graphs ms/token | fused + graphs range | "
              "speed-up | fused tokens/s | weight-read floor ms | fused / floor | peak GiB stock / fused (cache) | "
              "first token ms stock / fused |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results["models"].items():
        for batch, d in r.get("decode", {}).items():
            floor = r["floors"].get("decode_ms") if r["floors"] else None
            s, f = d["stock"]["ms_per_token"], d["fused"]["ms_per_token"]
            e = d.get("fused-eager", {}).get("ms_per_token")
            peak = "-"
            if "peak_bytes" in d["stock"]:
                peak = (f"{d['stock']['peak_bytes'] / 2**30:.2f} / {d['fused']['peak_bytes'] / 2**30:.2f} "
                        f"({d['fused'].get('cache_bytes', 0) / 2**30:.3f})")
            span = d["fused"].get("ms_per_token_range")
            span = f"{span[0]:.3f} to {span[1]:.3f}" if span else "-"
            lines.append(f"| {name} | {batch} | {s:.2f} | {'-' if e is None else f'{e:.2f}'} | {f:.3f} | {span} | "
                         f"{s / f:.1f}x | "
                         f"{d['fused']['tokens_per_s']:.0f} | "
                         + (f"{floor:.3f} | {f / floor:.2f}x |" if floor else "- | - |") + f" {peak} | "
                         + (f"{d['stock']['first_token_ms']:.1f} / {d['fused']['first_token_ms']:.1f} |"
                            if "first_token_ms" in d["fused"] else "- |"))
    ab = [(name, b, d) for name, r in results["models"].items() for b, d in r.get("decode", {}).items()
          if "fused-no-pdl" in d]
    if ab:
        lines += ["", "Programmatic dependent launch (`--pdl-ab`), fused + graphs, median ms/token with PDL / without:", ""]
        lines += [f"- {name} batch {b}: {d['fused']['ms_per_token']:.3f} / {d['fused-no-pdl']['ms_per_token']:.3f} "
                  f"({d['fused-no-pdl']['ms_per_token'] / d['fused']['ms_per_token']:.3f}x)" for name, b, d in ab]
    rows = [(name, r["plain_forward"]) for name, r in results["models"].items() if r.get("plain_forward")]
    if rows:
        lines += ["", "Forward as `model(**inputs)`: a left-padded batch, the config's use_cache=True (a cache returned), "
                  "median ms:", "", "| model | T | stock | fused eager | fused + graphs | speed-up |", "|---|---|---|---|---|---|"]
    for name, d in rows:
        for T, st in d["stock"].items():
            e, f = d["fused-eager"][T]["median"], d["fused"][T]["median"]
            lines.append(f"| {name} | {T} | {st['median']:.2f} | {e:.2f} | {f:.2f} | {st['median'] / f:.2f}x |")
    mem = [(n, r["memory"]) for n, r in results["models"].items() if r.get("memory")]
    if mem:
        lines += ["", "| model | peak memory stock GiB | fused eager GiB | fused + graphs GiB | fused + graphs / stock |",
                  "|---|---|---|---|---|"]
        for name, m in mem:
            s, f = m["stock"]["peak_bytes"], m["fused"]["peak_bytes"]
            e = m.get("fused-eager", {}).get("peak_bytes")
            lines.append(f"| {name} | {s / 2**30:.3f} | {'-' if e is None else f'{e / 2**30:.3f}'} | {f / 2**30:.3f} | "
                         f"{f / s:.3f} |")
    lines += _stall_markdown(results)
    lines += targets_markdown(results)
    return "\n".join(lines) + "\n"


# The latency issue's targets (issue 24), each read from this run's own rows of a named shape: (what, shape, key, limit,
# how the figure is read). Kinds: "decode/floor" (fused + graphs over the weight-read floor at batch `key`),
# "forward/floor" (fused + graphs over the forward floor at length `key`), "forward/stock" (stock over fused + graphs,
# a minimum), "stall" (the fused first call at a new shape over its repeat, seconds, every --new-shapes row), "cold"
# (the first fused generate on an empty Triton cache, seconds), "warm" (the first fused generate on a warm cache over
# its repeat, seconds), "long/floor" (fused decode at a `key`-token context over its floor).
ISSUE_TARGETS = (
    ("batch-8 decode within 1.25x the weight-read floor", "4B", "8", 1.25, "decode/floor"),
    ("batch-8 decode within 1.25x the weight-read floor", "9B", "8", 1.25, "decode/floor"),
    ("batch-8 decode within 2x the weight-read floor", "0.8B", "8", 2.0, "decode/floor"),
    ("batch-1 decode within 1.5x the weight-read floor", "0.8B", "1", 1.5, "decode/floor"),
    ("forward T=2048 within 1.35x its floor", "4B", "2048", 1.35, "forward/floor"),
    ("forward T=128 within 1.6x its floor", "4B", "128", 1.6, "forward/floor"),
    ("forward T=2048 at least 2x stock", "9B", "2048", 2.0, "forward/stock"),
    ("a new shape at most 2 s over its repeat", "0.8B", None, 2.0, "stall"),
    ("a new shape at most 2 s over its repeat", "4B", None, 2.0, "stall"),
    ("a new shape at most 2 s over its repeat", "9B", None, 2.0, "stall"),
    ("cold machine: first generate within 15 s", "4B", None, 15.0, "cold"),
    ("warm Triton cache: first generate within 1 s of a repeat", "4B", None, 1.0, "warm"),
    ("decode at a 32k context within 1.4x its floor", "4B", "32768", 1.4, "long/floor"),
    ("decode at a 32k context within 1.4x its floor", "9B", "32768", 1.4, "long/floor"),
)


def _target_readings(r: dict, key, kind: str) -> list[tuple[str, float]]:
    """(label, value) of each row of model results `r` that a target of `kind` reads ([] where the run has none)."""
    floors = r.get("floors") or {}
    if kind == "decode/floor":
        d = r.get("decode", {}).get(key)
        return [(f"batch {key}", d["fused"]["ms_per_token"] / floors["decode_ms"])] if d and floors else []
    if kind in ("forward/floor", "forward/stock"):
        f = r.get("forward", {}).get("fused", {}).get(key)
        if f is None:
            return []
        if kind == "forward/stock":
            return [(f"T={key}", r["forward"]["stock"][key]["median"] / f["median"])]
        floor = floors.get("forward_ms", {}).get(key)
        return [(f"T={key}", f["median"] / floor)] if floor else []
    if kind == "stall":
        return [(shape, d["fused"]["stall_s"]) for shape, d in r.get("new_shapes", {}).items()]
    if kind in ("cold", "warm"):
        row = r.get("cold_start", {}).get("fused")
        if row is None:
            return []
        return [("cold", row["cold"]["first_s"])] if kind == "cold" else \
            [("warm", row["warm"]["first_s"] - row["warm"]["repeat_s"])]
    d = r.get("long_context", {}).get(key)  # long/floor
    if not d or "oom" in d["fused"] or not d.get("floor"):
        return []
    return [(f"{key} tokens", d["fused"]["decode_ms_per_token"] / d["floor"]["decode_ms"])]


def target_cells(value: float, limit: float, at_least: bool, unit: str = "x") -> str:
    """`measured | target | verdict` cells of a targets table: met, or missed and by how much."""
    met = value >= limit if at_least else value <= limit
    verdict = "met" if met else f"missed (by {abs(value - limit):.2f}{unit})"
    return f"{value:.2f}{unit} | {'at least' if at_least else 'at most'} {limit:g}{unit} | {verdict}"


def targets_markdown(results: dict) -> list[str]:
    """The issue's targets (`ISSUE_TARGETS`) that this run measured, each row met or missed and by how much."""
    rows = []
    for what, shape, key, limit, kind in ISSUE_TARGETS:
        r = results["models"].get(shape)
        if r is None:
            continue
        unit = " s" if kind in ("stall", "cold", "warm") else "x"
        for label, value in _target_readings(r, key, kind):
            rows.append(f"| {what} | {shape} | {label} | {target_cells(value, limit, kind == 'forward/stock', unit)} |")
    if not rows:
        return []
    return ["", "Against the latency issue's targets (this run's rows):", "",
            "| target | model | row | measured | target | |", "|---|---|---|---|---|---|", *rows]


def _stall_markdown(results: dict) -> list[str]:
    """The new-shape, cold-start and long-context tables (each only when its run was asked for)."""
    lines = []
    rows = [(n, shape, d) for n, r in results["models"].items() for shape, d in r.get("new_shapes", {}).items()]
    if rows:
        lines += ["", "First `generate` (32 new tokens) at a new batch x prompt length in a warm process, seconds:", "",
                  "| model | batch x prompt | stock first / repeat | fused first / repeat | fused stall (first - repeat) | "
                  "Triton compiles in the first call, stock / fused (s) |",
                  "|---|---|---|---|---|---|"]
        for name, shape, d in rows:
            st, f = d["stock"], d["fused"]
            comp = lambda x: f"{x.get('compiles', 0)} ({x.get('compile_s', 0.0):.1f})"  # noqa: E731
            lines.append(f"| {name} | {shape} | {st['first_s']:.2f} / {st['repeat_s']:.2f} | {f['first_s']:.2f} / "
                         f"{f['repeat_s']:.2f} | {f['stall_s']:.2f} | {comp(st)} / {comp(f)} |")
    rows = [(n, r["cold_start"]) for n, r in results["models"].items() if r.get("cold_start")]
    if rows:
        lines += ["", "Fresh process, batch 1, 32 new tokens, seconds (cold: empty Triton cache; warm: the cache the "
                  "cold process left):", "",
                  "| model | variant | build | cold first / second generate | warm first / second generate |",
                  "|---|---|---|---|---|"]
        for name, d in rows:
            for variant, row in d.items():
                c, w = row["cold"], row["warm"]
                lines.append(f"| {name} | {variant} | {c['build_s']:.1f} | {c['first_s']:.2f} / {c['repeat_s']:.2f} | "
                             f"{w['first_s']:.2f} / {w['repeat_s']:.2f} |")
    rows = [(n, L, d) for n, r in results["models"].items() for L, d in r.get("long_context", {}).items()]
    if rows:
        lines += ["", "Long prompts, batch 1 (prefill: a 1-token generate; peak: allocated on top of the resident "
                  "models; decode at that context; medians of the repeats, all timed after a first call at that "
                  "length, whose extra time is the stall column):", "",
                  "| model | prompt | stock prefill ms | fused prefill ms | prefill floor ms | fused / floor | "
                  "peak GiB stock / fused | stock decode ms/token | fused decode ms/token | decode floor ms | "
                  "fused / floor | first-call stall s stock / fused |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        cell = lambda d, k, f="{:.1f}": "OOM" if "oom" in d else f.format(d[k])  # noqa: E731
        for name, L, d in rows:
            st, f, floor = d["stock"], d["fused"], d.get("floor")
            gib = lambda x: "OOM" if "oom" in x else ("-" if x["prefill_peak_bytes"] is None  # noqa: E731
                                                      else f"{x['prefill_peak_bytes'] / 2**30:.2f}")
            ratio = lambda k, fk: "-" if not floor or "oom" in f else f"{f[k] / floor[fk]:.2f}x"  # noqa: E731
            lines.append(f"| {name} | {L} | {cell(st, 'prefill_ms')} | {cell(f, 'prefill_ms')} | "
                         + (f"{floor['prefill_ms']:.1f}" if floor else "-") + f" | {ratio('prefill_ms', 'prefill_ms')} | "
                         f"{gib(st)} / {gib(f)} | {cell(st, 'decode_ms_per_token', '{:.3f}')} | "
                         f"{cell(f, 'decode_ms_per_token', '{:.3f}')} | "
                         + (f"{floor['decode_ms']:.3f}" if floor else "-")
                         + f" | {ratio('decode_ms_per_token', 'decode_ms')} | "
                         f"{cell(st, 'first_call_extra_s', '{:.2f}')} / {cell(f, 'first_call_extra_s', '{:.2f}')} |")
    return lines


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, (name, r) in enumerate(results["models"].items()):
        Ts = sorted(int(t) for t in r["forward"]["stock"])
        for kind, style in (("stock", "--"), ("fused-eager", ":"), ("fused", "-")):
            if kind in r["forward"]:
                label = f"{name} {'fused + graphs' if kind == 'fused' else kind}"
                ax.plot(Ts, [r["forward"][kind][str(T)]["median"] for T in Ts], style, marker="o", color=f"C{i}",
                        label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens (batch 1, no cache)")
    ax.set_ylabel("forward latency, median ms")
    ax.set_title(f"Qwen3.5 forward: stock vs fused ({results['meta']['device_name']})")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_decode(results: dict, path: Path) -> bool:
    """Decode ms per token (log scale) per model and batch: stock, fused without graphs, fused + CUDA graphs, and the
    weight-read floor. Returns False (and writes nothing) when the results have no decode rows."""
    rows = [(f"{name}\nbatch {b}", d, (r.get("floors") or {}).get("decode_ms"))
            for name, r in results["models"].items() for b, d in r.get("decode", {}).items()]
    if not rows:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    kinds = [("stock", "C7"), ("fused-eager", "C1"), ("fused", "C0")]
    width = 0.8 / len(kinds)
    for k, (kind, color) in enumerate(kinds):
        xs = [i + (k - 1) * width for i, (_, d, _) in enumerate(rows) if kind in d]
        ys = [d[kind]["ms_per_token"] for _, d, _ in rows if kind in d]
        label = {"fused-eager": "fused, no graphs", "fused": "fused + CUDA graphs"}.get(kind, kind)
        ax.bar(xs, ys, width, color=color, label=label)
    for i, (_, _, floor) in enumerate(rows):
        if floor:
            ax.hlines(floor, i - 0.45, i + 0.45, colors="k", linestyles=":", label="weight-read floor" if i == 0 else None)
    ax.set_xticks(range(len(rows)), [label for label, _, _ in rows], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("ms per generated token")
    ax.set_title(f"Qwen3.5 generate(): stock vs fused ({results['meta']['device_name']})")
    ax.grid(True, axis="y", alpha=0.3)
    low, high = ax.get_ylim()
    ax.set_ylim(low, high * 8)  # room for the legend above the bars
    ax.legend(fontsize=7, ncol=4, loc="upper center")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="0.8B,4B", help="comma list of real shapes (0.8B,4B,9B,27B) or 'tiny'")
    p.add_argument("--model", default=None, help="folder or Hub id instead of --shapes")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--lengths", default="128,512,2048", help="forward lengths; '' runs decode only")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--requests", type=int, default=60, help="size of the request set (0: skip)")
    p.add_argument("--max-request-len", type=int, default=4096)
    p.add_argument("--decode-batches", default="1,8")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--decode-repeats", type=int, default=3,
                   help="timed generate pairs per decode variant and per long context (median)")
    p.add_argument("--pdl-ab", action="store_true",
                   help="also time the fused decode with programmatic dependent launch off (GPUs that have it)")
    p.add_argument("--profile", default="", help="comma list of lengths to profile (GPU): kernel counts, top kernels")
    p.add_argument("--profile-decode", default="", help="comma list of batch sizes whose decode step to profile (GPU)")
    p.add_argument("--profile-no-pdl", action="store_true",
                   help="--profile-decode with programmatic dependent launch off (each kernel's own time)")
    p.add_argument("--profile-variants", default=",".join(PROFILE_VARIANTS),
                   help="comma list of the decode variants --profile-decode profiles (stock's step, launch-bound, "
                        "takes most of the time)")
    p.add_argument("--plain-batch", type=int, default=4,
                   help="batch of the padded forward that returns a cache (model(**inputs)); 0: skip")
    p.add_argument("--new-shapes", default="",
                   help="comma list of BATCHxPROMPT_LEN (e.g. 2x32,4x1152): first vs repeat generate at each, after "
                        "the other runs (the new-shape stall)")
    p.add_argument("--long-context", default="",
                   help="comma list of prompt lengths (e.g. 32768,131072): prefill time, its peak memory and decode "
                        "ms/token at that context, stock and fused, against their floors")
    p.add_argument("--cold-start", default="",
                   help="comma list of variants (stock,fused,fused-untuned: the shipped per-card choices off): first "
                        "generate in fresh processes with an empty, then "
                        "a warm Triton cache")
    p.add_argument("--cold-child", default=None, choices=["stock", "fused", "fused-untuned"],
                   help=argparse.SUPPRESS)
    p.add_argument("--gpus", type=int, default=1, help="dispatch both models over this many GPUs (device_map)")
    p.add_argument("--out", default="out/bench")
    args = p.parse_args(argv)
    if args.cold_child:
        return cold_child(args)
    profile_variants = [v for v in args.profile_variants.split(",") if v]
    unknown = sorted(set(profile_variants) - set(PROFILE_VARIANTS))
    if unknown or not profile_variants:
        p.error(f"--profile-variants {args.profile_variants!r}: choose from {','.join(PROFILE_VARIANTS)}")

    import transformers

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    try:
        import fla
        fla_version = fla.__version__
    except Exception:
        fla_version = "-"
    results = {"meta": {"date": time.strftime("%Y-%m-%d %H:%M"), "device_name": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                        "torch": torch.__version__, "transformers": transformers.__version__, "fla": fla_version,
                        "dtype": args.dtype, "gpus": args.gpus, "command": "python scripts/benchmark_latency.py " + " ".join(argv if argv is not None else sys.argv[1:])},
               "ceilings": measure_ceilings(device), "models": {}}
    if results["ceilings"]:
        log(f"ceilings: copy {results['ceilings']['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
            f"GEMM {results['ceilings']['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s")
    timer = Timer(device)
    lengths = [int(x) for x in args.lengths.split(",") if x]
    targets = [("model", None)] if args.model else [(s, s) for s in args.shapes.split(",")]
    out = Path(args.out)
    for name, shape in targets:
        log(f"building {name if shape else args.model} ({args.dtype}, {device})")
        stock, fused = build_pair(shape, args.model, device, dtype)
        if args.gpus > 1:
            stock, fused = split_over_gpus(stock, args.gpus), split_over_gpus(fused, args.gpus)
            log(f"dispatched over {args.gpus} GPUs: {sorted(set(str(d) for d in fused.hf_device_map.values()))}")
        models = {"stock": stock, "fused": fused}
        vocab = stock.config.vocab_size
        counts = param_counts(stock)
        r = {"params": counts, "describe": fused.describe()["layers"]}
        r["forward"] = {k: {str(T): v for T, v in d.items()} for k, d in
                        forward_latency(models, lengths, 1, args.repeats, device, vocab, timer).items()}
        if args.plain_batch:
            r["plain_forward"] = {k: {str(T): v for T, v in d.items()} for k, d in plain_forward_latency(
                models, lengths, args.plain_batch, args.repeats, device, vocab, timer).items()}
        if args.requests:
            r["requests"] = request_set(models, request_lengths(args.requests, args.max_request_len), device, vocab, timer)
        r["decode"] = {b: decode_speed(models, int(b), args.prompt_len, args.new_tokens, device, vocab,
                                       args.decode_repeats, args.pdl_ab)
                       for b in args.decode_batches.split(",") if b}
        if args.new_shapes:
            shapes = [tuple(int(v) for v in s.split("x")) for s in args.new_shapes.split(",")]
            r["new_shapes"] = new_shape_calls(models, shapes, 32, device, vocab, out / f"profile_{name}")
        if lengths:  # --lengths '' skips the forward runs (decode only)
            r["memory"] = peak_memory(models, max(lengths), device, vocab)
        if args.long_context:
            r["long_context"] = long_context(models, [int(x) for x in args.long_context.split(",")], args.new_tokens,
                                             device, vocab, results["ceilings"], counts, dtype, args.decode_repeats)
        if args.profile and device.type == "cuda":
            r["profile"] = {T: profile_forward(models, int(T), device, vocab) for T in args.profile.split(",")}
        if args.profile_decode and device.type == "cuda":
            r["profile_decode"] = {b: profile_decode(models, int(b), args.prompt_len, args.new_tokens, device, vocab,
                                                     rows=22, pdl=not args.profile_no_pdl, variants=profile_variants)
                                   for b in args.profile_decode.split(",")}
        ceil = results["ceilings"]
        if ceil:
            read_ms = counts["read_bytes"] / ceil["copy_bytes_per_s"] * 1e3
            matmul_ms = {str(T): 2 * (counts["body"] * T + counts["lm_head"]) / ceil["bf16_flops_per_s"] * 1e3
                         for T in lengths}
            # a forward both multiplies and reads every weight once: its floor is the larger of the two (at 4B the
            # read wins below ~220 tokens)
            r["floors"] = {"forward_ms": {T: max(m, read_ms) for T, m in matmul_ms.items()},
                           "forward_matmul_ms": matmul_ms, "decode_ms": read_ms}
        else:
            r["floors"] = {}
        results["models"][name] = r
        if args.cold_start:  # after this model is freed: the children need the memory
            del stock, fused, models
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            child_argv = (["--model", args.model] if args.model else ["--shapes", shape]) + [
                "--device", args.device, "--dtype", args.dtype]
            r["cold_start"] = cold_start({"name": name, "argv": child_argv}, args.cold_start.split(","),
                                         args.prompt_len, 32)
            stock = fused = models = None
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(results, indent=2))  # after each model: a cut-off run keeps it
        del stock, fused, models
        gc.collect()  # the pair's reference cycles (graphs, hooks) too: the next model's peaks count only its own memory
        if device.type == "cuda":
            torch.cuda.empty_cache()
    write_report(out, "results", results, to_markdown(results))
    plot(results, out / "latency.png")
    plot_decode(results, out / "decode.png")
    return results


if __name__ == "__main__":
    main()
