# Copyright 2026 The Qwen3.5 fused-kernels authors. Licensed under the Apache License, Version 2.0.
"""The runtime the fused ops share: the optional-import gate, launch sizes, PDL, input checks, compiling on a thread
pool (`compile_in_parallel`), `@triton.jit` helpers.

The `fused_ops*` modules are the only files of the repo that import `triton` or `fla` (flash-linear-attention), and
they import both from here: the two imports sit in the one gate below and never raise. Where a package is missing,
`HAS_TRITON` / `HAS_FLA` are False, `triton` / `tl` / the fla functions are None, and the model falls back to the
stock transformers code (announced once by the model, never silently). transformers' remote-code import check reads
every file of a Hub repo, so nothing in these modules may fail at import time.

Shape alphabet: B batch, T tokens, H attention heads, KV key/value heads, D head dim, R rotary dim, N hidden size,
I intermediate size, HV linear-attention value heads, K / V linear key / value head dims.
Every op takes fp32 / bf16 / fp16, computes in fp32 and rounds to the input dtype exactly where stock rounds.

Also here: Triton's hash of its own install, computed on a thread from import (`warm_triton_key`), and the
graph-capture helpers `reset_rng_after_failed_capture` / `capture_error`, used by the GEMV's timing autotuner
(`fused_ops_gemv`) and by the model's CUDA-graph code (through the `fused_ops` facade).
"""

import contextlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

try:  # the one optional-import gate of the repo
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    HAS_TRITON = True
except Exception:  # pragma: no cover - depends on the environment
    triton = None
    tl = None
    libdevice = None
    HAS_TRITON = False

try:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk_gated_delta_rule
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_fused_recurrent_gated_delta_rule

    HAS_FLA = True
except Exception:  # pragma: no cover - depends on the environment
    fla_chunk_gated_delta_rule = fla_fused_recurrent_gated_delta_rule = None
    HAS_FLA = False


def kernels_available() -> str | None:
    """None when the fused kernels can run here, else the reason they cannot (for the model's one log line). The
    missing GPU comes first: on a CPU-only machine (the README's CPU setup has no fla) installing a package would not
    help, and the line should not suggest it."""
    if not torch.cuda.is_available():
        return "no CUDA device is available"
    if not HAS_TRITON:
        return "triton is not installed"
    if not HAS_FLA:
        return "flash-linear-attention (fla) is not installed"
    return None


_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Launch shapes. Not measured on an H200 yet; the reasoning: a tile of _TILE elements with 8 elements per thread
# gives every thread one 16-byte load of bf16, and we pack several rows (or heads) into one program only when that
# still leaves _MIN_PROGRAMS programs (4 per SM on the 132 SMs of an H200), so decode (T=1) and short prompts keep
# one row per program and spread over the SMs. Two tile sizes a kernel, not one per row count: the tile is a
# compile-time constant, and a size per row count compiled the kernel again at each new batch x prompt shape.
_TILE = 4096
_ELEMS_PER_THREAD = 8
_MIN_PROGRAMS = 4 * 132


def _num_warps(tile_elems: int) -> int:
    """Warps for a tile of `tile_elems` elements: about `_ELEMS_PER_THREAD` elements per thread, 1 to 16 warps."""
    return max(1, min(16, tile_elems // (32 * _ELEMS_PER_THREAD)))


def _units_per_program(n_units: int, unit_elems: int, cap: int = _TILE) -> int:
    """How many rows (or heads) of `unit_elems` elements one program takes: 1, or the full tile (the largest power of
    two that fills at most a `_TILE`-element tile and is at most `cap`) once `n_units` give `_MIN_PROGRAMS` programs
    of that size. Nothing in between, so a kernel compiles at most two tile sizes whatever the shapes it meets."""
    full = max(1, min(_TILE // unit_elems, cap))
    full = 1 << (full.bit_length() - 1)
    return full if n_units >= full * _MIN_PROGRAMS else 1


def compile_in_parallel(warmups) -> None:
    """Compile Triton kernels on a pool of threads, one a core: each of `warmups` is a warm-up launch (a callable
    that calls `kernel.warmup(...)`: it compiles, runs nothing), called here under Triton's asynchronous compile mode,
    which hands each compile to the pool and files the kernels when the last is done.

    Why: the first decode step compiles every GEMV candidate before timing it against cuBLAS (14 a kind of linear,
    42 at 4B). The compiler's LLVM and ptxas stages release the GIL: 14 sm_90 compiles took 11.0 s in one thread and
    6.0 s in two on a 2-core machine, and on the H200 (16 cores) the cold 4B first `generate` went from 58.4 to
    51.6 s.
    Where this Triton has no asynchronous mode, or a compile fails, the kernels compile one by one at their first
    real launch, as before (the launch raises as it always did)."""
    warmups = list(warmups)
    if not warmups or _AsyncCompileMode is None:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=max(1, min(len(warmups), cores))) as pool:
        with contextlib.suppress(Exception):  # a failed compile is redone (and raises) at its real launch
            with _AsyncCompileMode(pool):
                for warmup in warmups:
                    with contextlib.suppress(Exception):
                        warmup()


if HAS_TRITON:
    try:  # in Triton 3.6 through 3.9; where absent, `compile_in_parallel` leaves compiling to the launches
        from triton.runtime._async_compile import AsyncCompileMode as _AsyncCompileMode
    except Exception:  # pragma: no cover - depends on the Triton version
        _AsyncCompileMode = None
else:
    _AsyncCompileMode = None


def triton_cache_dir() -> str | None:
    """Triton's on-disk kernel cache (`triton.knobs.cache.dir`, which TRITON_CACHE_DIR sets), or None."""
    if not HAS_TRITON:
        return None
    return getattr(getattr(getattr(triton, "knobs", None), "cache", None), "dir", None) or None


def triton_cache_holds(kernel_name: str) -> bool | None:
    """Whether Triton's cache holds `kernel_name` compiled (Triton keeps `<hash>/<name>.json` beside the binary);
    None where there is no cache folder to look in."""
    root = triton_cache_dir()
    if root is None:
        return None
    try:
        return next(Path(root).glob(f"*/{kernel_name}.json"), None) is not None
    except OSError:
        return None


_triton_key_thread: threading.Thread | None = None


def warm_triton_key() -> threading.Thread | None:
    """Compute Triton's hash of its own install (`triton.runtime.cache.triton_key`: part of every kernel's cache key,
    computed once per process at its first kernel launch and kept) on a daemon thread, once per process; returns
    that thread, or None where this Triton has no such function (the first launch then computes it, as it always
    did). Started when this module is imported on a machine that can run the kernels (below).

    Why: the hash reads and hashes libtriton (hundreds of MB). It was 0.39 s of the 1.08 s by which the first 4B
    `generate` of a process with Triton's cache warm exceeded its repeat (cProfile, H200, 2026-12-02). Started at
    import, it runs while the model is built and its weights load; file reads and hashlib release the GIL. A launch
    that needs the key before the thread is done computes it itself (the function's cache holds no lock), which is
    what it did before."""
    global _triton_key_thread
    if _triton_key_thread is not None or not HAS_TRITON:
        return _triton_key_thread
    key = getattr(getattr(getattr(triton, "runtime", None), "cache", None), "triton_key", None)
    if not callable(key):
        return None

    def run():
        with contextlib.suppress(Exception):  # a failure here is met again, and raised, by the first launch
            key()

    _triton_key_thread = threading.Thread(target=run, name="qwen3_5-fused-triton-key", daemon=True)
    _triton_key_thread.start()
    return _triton_key_thread


with contextlib.suppress(Exception):  # nothing here may fail at import (see the module docstring)
    if kernels_available() is None:
        warm_triton_key()


def _device_guard(t: torch.Tensor):
    """Launch on `t`'s GPU even when another one is current (Triton launches on the current device)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


# Programmatic dependent launch (PDL, sm_90+). The decode step is ~300 small kernels per token, and each one
# otherwise starts only after the one before has drained: launch, ramp-up and tail are paid one after another.
# With PDL every kernel of ours is launched so that it may start while the one before finishes; it first signals
# that the next kernel may launch too (`gdc_launch_dependents`), then waits on the grid dependency (`gdc_wait`:
# every earlier kernel complete, its writes visible) before it reads or writes anything an earlier kernel touches;
# a GEMV of a large weight signals only after its weight loop instead (`_GEMV_LATE_TRIGGER_ELEMS`).
# The GEMV loads its first weight tile before the wait (no kernel writes the weights), so its reads overlap the
# kernel before it. Kernels that are not ours (cuBLAS, torch) are launched normally and wait as always. Set False
# to turn it off (an A/B switch for benchmarks; read at launch, so it takes effect at the next capture).
PDL_ENABLED = True
_pdl_capable: dict = {}


def _triton_has_pdl() -> bool:
    """This Triton has the grid dependency instructions and the `launch_pdl` launch option."""
    if not HAS_TRITON:
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions

        return hasattr(tl.extra.cuda, "gdc_wait") and "launch_pdl" in CUDAOptions.__dataclass_fields__
    except Exception:  # noqa: BLE001 - no NVIDIA backend: no PDL
        return False


_HAS_GDC = _triton_has_pdl()


def pdl_enabled(device: torch.device) -> bool:
    """Whether our kernels on `device` use programmatic dependent launch: `PDL_ENABLED`, a CUDA device of compute
    capability 9.0 or newer, and a Triton with grid dependency control. One decision point."""
    device = torch.device(device)
    if not (PDL_ENABLED and _HAS_GDC and device.type == "cuda"):
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _pdl_capable:
        _pdl_capable[index] = torch.cuda.get_device_capability(index) >= (9, 0)
    return _pdl_capable[index]


def _pdl_launch(pdl: bool) -> dict:
    """The launch option of a PDL kernel (none otherwise: the interpreter takes no launch options)."""
    return {"launch_pdl": True} if pdl else {}


def _dot_precision(dtype: torch.dtype) -> str:
    """`tl.dot`'s input precision: float32 as torch's matmuls run it (IEEE at the default "highest" precision,
    TF32 after `torch.set_float32_matmul_precision("high")`, as stock's `F.linear` then); others are exact inputs."""
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return "ieee"
    return "tf32"


def _dot_in_f32(x: torch.Tensor) -> bool:
    """Whether our `tl.dot` kernels cast their bf16 / fp16 tiles to float32 before `tl.dot`: only on CPU tensors,
    i.e. under the Triton interpreter, whose `tl.dot` multiplies bfloat16 operands' raw bits (triton 3.9: 2e10 off on
    a 16x16 product). Exact: a bf16 / fp16 product is exact in float32 and the GPU's dot accumulates in float32 too."""
    return not x.is_cuda


def _on_gpu(x: torch.Tensor) -> bool:
    """The `ON_GPU` constexpr of `_softplus` / `_exp_exact`: False on CPU tensors, i.e. under the Triton
    interpreter, which has no libdevice."""
    return x.is_cuda


def _check_triton(op: str) -> None:
    if not HAS_TRITON:
        raise RuntimeError(f"fused_ops.{op} needs triton, which is not installed; use {op}_ref instead.")


def _check_float(name: str, t: torch.Tensor) -> None:
    if t.dtype not in _DTYPES:
        raise ValueError(f"{name} must be float32, bfloat16 or float16, got {t.dtype}.")


def _check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"all tensors must be on one device, got {devices}.")


def _check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dim, got shape {tuple(t.shape)} strides {t.stride()}.")


def _batch_stride(t: torch.Tensor) -> int:
    """Stride of dim 0, or 0 where dim 0 has size 1 (broadcast over the batch)."""
    return 0 if t.shape[0] == 1 else t.stride(0)


def _as_rows(name: str, t: torch.Tensor) -> torch.Tensor:
    """`t` [..., N] as a [rows, N] view (any row stride), without a copy; ValueError where no such view exists."""
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        raise ValueError(
            f"{name} with shape {tuple(t.shape)} and strides {t.stride()} cannot be seen as [rows, {t.shape[-1]}] "
            "with one row stride; pass a tensor whose leading dims can be flattened without a copy."
        ) from None


if HAS_TRITON:

    @triton.jit
    def _round_to(x, DT: tl.constexpr):
        """`x` (float32) rounded to nearest-even in dtype DT, returned as float32. bfloat16 is rounded by hand because
        the Triton interpreter's float32 -> bfloat16 cast truncates; this keeps CPU (CI) and GPU results identical,
        and costs three integer ops on the GPU."""
        if DT == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            y = bits.to(tl.float32, bitcast=True)
        elif DT == tl.float16:
            y = x.to(tl.float16).to(tl.float32)
        else:
            y = x
        return y

    @triton.jit
    def _softplus(x, ON_GPU: tl.constexpr):
        """torch's `softplus(x)` (threshold 20) of fp32 `x`: `log1p(exp(x))`, and `x` itself above 20.

        Why not fla's `softplus` (`lg2.approx(1 + ex2.approx(x))` on NVIDIA): where exp(x) is far below 1 the sum
        keeps a few bits of it, so a strongly negative gate input (large `dt_bias`) gets a decay off by up to all of
        its own size; over hundreds of tokens an fp32 recurrent state drifted 3e-5 to 7e-5 from stock's (issue 43's
        search, H200). On the GPU: libdevice's `exp` and `log1p` (as torch's CUDA softplus). The Triton interpreter
        has no libdevice (its calls return None): there `log1p(e)` is Kahan's `log(u) * e / (u - 1)`, u = 1 + e, on
        numpy's exact `log`. ON_GPU: the tensors are CUDA tensors (`_on_gpu`)."""
        x_in = tl.minimum(x, 20.0)
        if ON_GPU:
            sp = libdevice.log1p(libdevice.exp(x_in))
        else:
            e = tl.exp(x_in)
            u = 1.0 + e
            sp = tl.where(u == 1.0, e, tl.log(u) * (e / tl.where(u == 1.0, 1.0, u - 1.0)))
        return tl.where(x > 20.0, x, sp)

    @triton.jit
    def _exp_exact(x, ON_GPU: tl.constexpr):
        """`exp(x)` of fp32 `x` as torch computes it: libdevice's `exp` on the GPU (`tl.exp` is `ex2.approx`, about
        2 ulp), numpy's under the interpreter."""
        if ON_GPU:
            y = libdevice.exp(x)
        else:
            y = tl.exp(x)
        return y

    @triton.jit
    def _pdl_wait(PDL: tl.constexpr):
        """With PDL: let the next kernel launch, then wait until every earlier kernel is done (see `pdl_enabled`)."""
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()



def reset_rng_after_failed_capture() -> None:
    """Give the current device's default CUDA generator a fresh state (same seed, same offset) after a failed graph
    capture.

    torch's `CUDAGraph.capture_end` raises on an invalidated capture before it takes the generators it registered
    out of capture mode, and every later random op on the device then fails ("Offset increment outside graph
    capture encountered unexpectedly"): `generate`'s sampling included. A cloned state is not in capture mode.
    Graphs captured before keep the old state and advance it on replay, not the new one (the graphs of this repo
    draw no random numbers)."""
    gen = torch.cuda.default_generators[torch.cuda.current_device()]
    gen.graphsafe_set_state(gen.clone_state())


def capture_error(err: BaseException) -> BaseException:
    """The error that failed a graph capture. Leaving `torch.cuda.graph` after an error in its body calls
    `capture_end`, which raises its own "operation failed due to a previous error during capture" over the first
    error: that one is in the chain's `__context__`."""
    seen = {id(err)}
    while err.__context__ is not None and id(err.__context__) not in seen:
        err = err.__context__
        seen.add(id(err))
    return err
