"""Small helpers shared by the test modules (no fixtures: plain functions)."""

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scripts.benchmark_latency import CompileLog
from scripts.common import (
    code_files,
    import_module,
    import_repo,
    tiny_moe_text_kwargs,
    tiny_text_kwargs,
    tiny_vision_kwargs,
)

configuration, modeling, fused_ops = import_repo()
compat = import_module("fused_compat")
plan_mod = import_module("fused_plan")
layers = import_module("fused_layers")
graphs = import_module("fused_graphs")
decode = import_module("fused_decode")
runner_mod = import_module("fused_runner")
OPS_MODULES = [import_module(f"fused_ops_{name}")
               for name in ("norm", "attention", "deltanet", "deltanet_prefill", "gemv", "moe", "moe_gemm")]
generate_mod = import_module("fused_generate")
REPO = Path(__file__).resolve().parents[1]


# The dtypes every kernel test runs, with their test ids; CPU kernel tests need the Triton interpreter.
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["fp32", "bf16", "fp16"]
INTERPRETER_REASON = "CPU tensors need the Triton interpreter (TRITON_INTERPRET=1)"
needs_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason=INTERPRETER_REASON)


# Every relative-error bound of the suite (`rel_err(got, want) <= bound`), with its reason. A bound is never loosened
# without saying why here; test modules alias their entry (`BOUND = BOUNDS["kernel"]`). Pure copies are checked exactly
# (`assert_exact`), not with a bound.
BOUNDS = {
    # One kernel against stock / its `_ref` (tests/ops: fused_ops, decode_ops, deltanet_prefill_ops).
    "kernel": {
        torch.float32: 1e-6,  # another summation order, approximate exp / rsqrt / division on the GPU: a few fp32 ulps
        torch.bfloat16: 1e-2,  # rounds where stock rounds; an fp32 wobble may flip one rounding: <= 1 ulp = 2^-7
        torch.float16: 1e-3,  # as bf16: one flipped rounding is at most 1 ulp = 2^-10 of an element
    },
    # `decode_attention` against SDPA + gate (tests/ops/test_decode_attention.py).
    "decode_attention": {
        torch.float32: 1e-5,  # IEEE dots, online softmax over splits sums in another order than SDPA (measured 3e-7)
        torch.bfloat16: 1e-2,  # probabilities rounded to the cache dtype before the second dot (measured 2.8e-3)
        torch.float16: 2e-3,  # as bf16, output rounded before the gate; a few ulps (measured 4.3e-4)
    },
    # Whole model (logits, cache states) on the GPU against stock on the same weights (issue 3; tests/model).
    "model": {
        torch.float32: 2e-5,  # fp32 ulps accumulated over 4 layers; stock runs its IEEE torch DeltaNet (`ieee_stock`)
        torch.bfloat16: 1.5e-2,  # bf16 keeps 8 mantissa bits; fused rounds once where stock rounds after each op
        torch.float16: 1.5e-2,  # as bf16 (the same rounding points, accumulated over 4 layers)
    },
    # `moe_experts` (tests/ops/test_moe_ops.py) against stock's MoE block on the same routing, and against float64.
    "moe_experts": {
        torch.float32: 2e-5,  # fp32 dots in another order over H and I, weighted sum in another order (measured ~1e-7)
        torch.bfloat16: 1e-2,  # both ~3e-3 from float64 (stock rounds every product and add), in different places
        torch.float16: 2e-3,  # as bf16 with 3 more mantissa bits
    },
    # CPU emulation of the fused path (fp32 references): SDPA over a padded / preallocated length sums its masked tail
    # in another order.
    "cpu_emulation": 1e-5,
}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (the one error measure of the suite)."""
    a64, b64 = a.detach().double().cpu(), b.detach().double().cpu()
    return ((a64 - b64).norm() / b64.norm().clamp_min(1e-300)).item()


def assert_close(name: str, got: torch.Tensor, want: torch.Tensor, bound) -> None:
    """Same shape and dtype, no NaN (an element never written), and `rel_err(got, want) <= bound`; `bound` is a number
    or a {dtype: bound} table (a `BOUNDS` entry), looked up with `want`'s dtype."""
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert got.dtype == want.dtype, f"{name}: dtype {got.dtype} != {want.dtype}"
    assert not got.isnan().any(), f"{name}: NaN in the output (an element was never written?)"
    if isinstance(bound, dict):
        bound = bound[want.dtype]
    err = rel_err(got, want)
    assert err <= bound, f"{name}: rel_err {err:.3g} > {bound:g} ({want.dtype})"


def assert_exact(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit-exact (pure copies): same shape, dtype and values."""
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert got.dtype == want.dtype, f"{name}: dtype {got.dtype} != {want.dtype}"
    assert torch.equal(got, want), f"{name}: not bit-exact, max abs diff {(got.double() - want.double()).abs().max()}"


class TritonCompiles(CompileLog):
    """The benchmark's `CompileLog` (Triton's JIT hooks) restricted to this repo's kernels: `self.ours` = {kernel name:
    compiles inside the `with` block}. A compile is what a new shape costs the user at its first call; a kernel that
    Triton takes from its in-memory cache does not count. Fails, rather than counting nothing, where another hook is
    installed."""

    def __enter__(self):
        super().__enter__()
        assert self._runtime is not None, "no Triton JIT hooks here, or another hook is installed"
        return self

    @property
    def ours(self) -> dict[str, int]:
        import triton

        names = {name for module in OPS_MODULES for name, value in vars(module).items()
                 if isinstance(value, triton.runtime.JITFunction)}
        return {name: n for name, (n, _) in self.by_kernel.items() if name in names}


# The kernels as they will be compiled on the H200 (sm_90): every pointer 16-byte aligned and every stride but the
# unit ones divisible by 16, as Triton's launcher specialises them for the real shapes. The calls to `compile_` follow.
_SM90_PRELUDE = r"""
import sys
sys.modules["fla"] = None  # not needed here; saves fla's ~10 s import
sys.path.insert(0, sys.argv[1])
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from scripts.common import import_module
(fused_ops_runtime, fused_ops_norm, fused_ops_attention, fused_ops_deltanet, fused_ops_deltanet_prefill,
 fused_ops_gemv) = (import_module(f"fused_ops_{name}")
                    for name in ("runtime", "norm", "attention", "deltanet", "deltanet_prefill", "gemv"))

def compile_(fn, types, constexprs, num_warps, num_stages=None):
    # kernels with a PDL switch compile as the H200 launches them: with programmatic dependent launch
    pdl = "PDL" in fn.arg_names and fused_ops_runtime._HAS_GDC
    if "PDL" in fn.arg_names:
        constexprs = {"PDL": pdl, **constexprs}
    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if n not in constexprs and (signature[n].startswith("*") or n.startswith("stride"))}
    src = ASTSource(fn, signature, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": num_warps, **({"launch_pdl": True} if pdl else {}),
               **({"num_stages": num_stages} if num_stages else {})}
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 64), options=options)
    assert kernel.asm["cubin"], fn.__name__
    assert not pdl or "griddepcontrol.wait" in kernel.asm["ptx"], fn.__name__ + ": no grid dependency wait"
    print(fn.__name__, "ok")
    return kernel
"""


_SM90_GROUP = r"""
print("GROUP {index}", flush=True)
try:
    exec({calls!r})
except BaseException:
    import traceback
    print("GROUP-FAILED", traceback.format_exc().replace("\n", " | "), flush=True)
"""
# The one background compile process of this session (`start_compiles_for_sm90`): {"proc", "calls": [source, ...]}
_SM90_BACKGROUND: dict = {}


def _sm90_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silences triton 3.9's notice; fusion is every version's default
    return env


def start_compiles_for_sm90(calls: list[str]) -> None:
    """Start, in one background process, the sm_90 compiles of every `calls` source the session's tests will ask
    `compile_for_sm90` for (tests/conftest.py calls this when collection ends): one interpreter instead of one a
    test, and the compiles overlap with the rest of the suite instead of stalling it."""
    import importlib.util

    if _SM90_BACKGROUND or not calls or importlib.util.find_spec("triton.backends.nvidia") is None:
        return
    source = _SM90_PRELUDE + "".join(_SM90_GROUP.format(index=i, calls=c) for i, c in enumerate(calls))
    proc = subprocess.Popen([sys.executable, "-c", source, str(REPO)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=_sm90_env())
    _SM90_BACKGROUND.update(proc=proc, calls=list(calls), out=None)


def stop_compiles_for_sm90() -> None:
    if _SM90_BACKGROUND and _SM90_BACKGROUND["proc"].poll() is None:
        _SM90_BACKGROUND["proc"].kill()
        _SM90_BACKGROUND["proc"].wait()
    _SM90_BACKGROUND.clear()


def _background_sm90(calls: str) -> int | None:
    """How many kernels of `calls` the background process compiled (the test fails on its error); None when that
    process was not asked for them."""
    if not _SM90_BACKGROUND or calls not in _SM90_BACKGROUND["calls"]:
        return None
    if _SM90_BACKGROUND["out"] is None:
        out, err = _SM90_BACKGROUND["proc"].communicate(timeout=900)
        _SM90_BACKGROUND["out"] = (out, err, _SM90_BACKGROUND["proc"].returncode)
    out, err, code = _SM90_BACKGROUND["out"]
    assert code == 0, err[-4000:]
    index = _SM90_BACKGROUND["calls"].index(calls)
    section = out.split(f"GROUP {index}\n", 1)[1].split("\nGROUP ", 1)[0]
    assert "GROUP-FAILED" not in section, section[-4000:]
    return section.count(" ok")


def compile_for_sm90(calls: str) -> int:
    """Compile kernels for sm_90 without a GPU (Triton's bundled ptxas), in a subprocess without TRITON_INTERPRET:
    the interpreter runs kernels that the GPU compiler may reject. `calls` is Python source calling
    `compile_(kernel, arg types, constexprs, num_warps[, num_stages])`; returns how many compiled (the test fails on any error).
    Where the session started them in the background (`start_compiles_for_sm90`), this reads that process's result."""
    pytest.importorskip("triton.backends.nvidia")
    done = _background_sm90(calls)
    if done is not None:
        return done
    proc = subprocess.run([sys.executable, "-c", _SM90_PRELUDE + calls, str(REPO)], capture_output=True, text=True,
                          timeout=300, env=_sm90_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout.count(" ok")


# Subprocess work that a test module starts when collection ends (its `PRESTART`: {fixture name: start(folder) ->
# (process, finish)}), so that it runs beside the rest of the suite; the fixture takes it over (`take_prestarted`).
_PRESTARTED: dict = {}  # fixture name -> (process, finish, folder)


def prestart(name: str, start) -> None:
    """Run `start` in a fresh temporary folder now (the RNG state kept as it was), keeping its (process, finish)."""
    import tempfile

    if name in _PRESTARTED:
        return
    folder = Path(tempfile.mkdtemp(prefix=f"qwen35-{name}-"))
    with torch.random.fork_rng():
        proc, finish = start(folder)
    _PRESTARTED[name] = (proc, finish, folder)


def take_prestarted(name: str):
    """The (process, finish) that `prestart` started for the fixture `name`, or None."""
    entry = _PRESTARTED.get(name)
    return entry[:2] if entry else None


def stop_prestarted() -> None:
    """At the session's end: kill what is still running and remove the folders."""
    import shutil

    for proc, _, folder in _PRESTARTED.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(folder, ignore_errors=True)
    _PRESTARTED.clear()


def stock_text_config(**overrides):
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(**tiny_text_kwargs(**overrides))


def fused_text_config(fused_kernels=True, **overrides):
    return configuration.Qwen3_5FusedTextConfig(**tiny_text_kwargs(**overrides), fused_kernels=fused_kernels)


def composite_kwargs(**text_overrides):
    text = tiny_text_kwargs(**text_overrides)
    return dict(text_config=text, vision_config=tiny_vision_kwargs(text["hidden_size"]),
                image_token_id=250, video_token_id=251, vision_start_token_id=252, vision_end_token_id=253,
                tie_word_embeddings=True)


def stock_and_fused_lm(seed=0, fused_kernels=True, dtype=torch.float32, **overrides):
    """A stock Qwen3_5ForCausalLM and a fused one holding the same random weights, both in eval mode."""
    from transformers import Qwen3_5ForCausalLM

    torch.manual_seed(seed)
    stock = Qwen3_5ForCausalLM(stock_text_config(**overrides)).to(dtype).eval()
    fused = modeling.Qwen3_5FusedForCausalLM(fused_text_config(fused_kernels, **overrides)).to(dtype).eval()
    missing, unexpected = fused.load_state_dict(stock.state_dict(), strict=True)
    assert not missing and not unexpected
    return stock, fused


def moe_composite_kwargs(shape: str = "E8-top2", **text_overrides):
    """``composite_kwargs`` for a Qwen3.5 MoE composite config (``qwen3_5_moe``)."""
    kwargs = composite_kwargs()
    kwargs["text_config"] = tiny_moe_text_kwargs(shape, **text_overrides)
    kwargs["vision_config"] = tiny_vision_kwargs(kwargs["text_config"]["hidden_size"])
    return kwargs


def stock_and_fused_moe_lm(shape="E8-top2", seed=0, fused_kernels=True, dtype=torch.float32, **overrides):
    """A stock Qwen3_5MoeForCausalLM and a fused one holding the same random weights, both in eval mode.

    Both run stock's eager experts loop where the stock path runs (``experts_implementation="eager"``): the loop
    ``moe_experts_ref`` reproduces, and the one stock runs on CPU for every shape (its default there, ``grouped_mm``,
    refuses hidden sizes whose rows are not a multiple of 16 bytes, such as 67)."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    torch.manual_seed(seed)
    kwargs = tiny_moe_text_kwargs(shape, **overrides)
    kwargs.setdefault("experts_implementation", "eager")
    stock = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**kwargs)).to(dtype).eval()
    fused = modeling.Qwen3_5MoeFusedForCausalLM(
        configuration.Qwen3_5MoeFusedTextConfig(**kwargs, fused_kernels=fused_kernels)).to(dtype).eval()
    missing, unexpected = fused.load_state_dict(stock.state_dict(), strict=True)
    assert not missing and not unexpected
    return stock, fused


def assert_initialized_like_stock(stock, fused):
    """`fused` and `stock`, each built from a config (random init), have the same parameters and stock's init: the
    same ones constant (norms, biases: equal values), every other one random with stock's spread (compared where
    there are enough samples for it; A_log has one per head)."""
    stock_params, fused_params = dict(stock.named_parameters()), dict(fused.named_parameters())
    assert stock_params.keys() == fused_params.keys()
    for name, p in stock_params.items():
        q = fused_params[name]
        if p.numel() == 1 or p.std() == 0:
            assert torch.equal(q, p), name  # a constant init (ones, zeros, a fixed value)
        else:
            assert q.std() > 0, name
            assert p.numel() < 256 or abs(q.std().item() / p.std().item() - 1) < 0.25, (name, q.std(), p.std())


@contextlib.contextmanager
def exact_sdpa():
    """SDPA through PyTorch's math backend inside the block (on a GPU; nothing changes on CPU). The memory-efficient
    backend, which a masked fp32 call takes on CUDA, returns wrong values for the stride-0 keys / values that stock's
    `repeat_kv` makes of a single key/value head at key lengths 1 mod 32 (pytorch/pytorch#191937; fused_layers'
    `_repeated_single_kv_head`): stock's own attention is then not the reference."""
    if not torch.cuda.is_available():
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.MATH]):
        yield


def ieee_stock(model):
    """`model`, a stock Qwen3.5, made to run stock's own torch DeltaNet code and its attention through SDPA's math
    backend (`exact_sdpa`): the fp32 reference of the CUDA tests.

    With fla installed, stock transformers runs fla's chunked delta rule, whose dots are TF32 even on fp32 inputs:
    8.7e-4 (relative logit error) from stock's torch rule on a 4-layer random model (H200, 2026-11-30), 40x the fp32
    bound. The fused path keeps fp32 IEEE (`fused_ops.prefill_rule_kernel`), so fp32 is compared with the IEEE stock
    code; bf16 / fp16 are compared with stock as it runs (through fla). Returns `model`.
    """
    forward = model.forward

    def ieee_forward(*args, **kwargs):
        with compat.torch_reference_kernels(), exact_sdpa():
            return forward(*args, **kwargs)

    model.forward = ieee_forward
    return model


def cuda_pair(dtype=torch.float32, ieee=True, **overrides):
    """`stock_and_fused_lm` built in fp32, then moved to the GPU in `dtype`; in fp32 (with `ieee`) stock runs its IEEE
    torch DeltaNet code (`ieee_stock`), the reference of the GPU tests."""
    stock, fused = stock_and_fused_lm(dtype=torch.float32, **overrides)
    if dtype == torch.float32 and ieee:
        ieee_stock(stock)
    return stock.to("cuda", dtype), fused.to("cuda", dtype)


def storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def run_stock(model, *args, **kwargs):
    """Call a stock transformers model on CPU. With fla installed, stock Qwen3.5 sends CPU tensors into fla's Triton
    kernels and crashes; the reference runs its plain-torch functions instead (the same routing the fused classes do
    for their fallback)."""
    with compat.torch_reference_kernels():
        return model(*args, **kwargs)


def cache_of(generate_output):
    """The cache a `generate(..., return_dict_in_generate=True)` output carries (field `cache` from transformers
    5.2x, `past_key_values` before)."""
    return getattr(generate_output, "cache", None) or getattr(generate_output, "past_key_values", None)


def assert_caches_close(got, want, layer_types, bound) -> None:
    """Two stock `DynamicCache`s hold the same state: each attention layer's keys / values, each linear-attention
    layer's conv and recurrent state (shapes equal, values within `bound`; the recurrent state compared in float32,
    the dtype fla returns it in)."""
    assert type(got) is type(want), (type(got), type(want))
    for i, layer_type in enumerate(layer_types):
        g, w = got.layers[i], want.layers[i]
        pairs = ([("conv", g.conv_states[0], w.conv_states[0]), ("recurrent", g.recurrent_states[0].float(),
                                                                 w.recurrent_states[0].float())]
                 if layer_type == "linear_attention" else [("keys", g.keys, w.keys), ("values", g.values, w.values)])
        for name, x, y in pairs:
            assert x.shape == y.shape, (i, name, x.shape, y.shape)
            assert rel_err(x, y) <= bound, (i, name, rel_err(x, y))


@contextlib.contextmanager
def decode_caches(model):
    """Inside the block, the list of `FusedDecodeCache`s the `generate()` calls on `model` decode on, in order (none:
    the stock decode ran). A fused `generate` returns stock's `DynamicCache`, copied out of its fused cache; the tests
    that look at the fused one take it from here."""
    made = []
    if not hasattr(model, "_text_model"):  # a stock model
        yield made
        return
    runner = model._text_model().runner
    new_cache = runner.new_cache

    def recording(*args, **kwargs):
        made.append(new_cache(*args, **kwargs))
        return made[-1]

    runner.new_cache = recording
    try:
        yield made
    finally:
        del runner.new_cache


def generate_fused(model, *args, **kwargs):
    """`model.generate(...)` (with `return_dict_in_generate=True`), its output carrying `fused_cache`: the
    `FusedDecodeCache` the call decoded on, or None where the stock decode ran."""
    with decode_caches(model) as made:
        out = model.generate(*args, **kwargs)
    out.fused_cache = made[-1] if made else None
    return out


def generate_stock(model, *args, **kwargs):
    with compat.torch_reference_kernels():
        return model.generate(*args, **kwargs)


def padded_batch(batch: int, seq_len: int, padding: str | None, vocab: int = 256, seed: int = 0):
    """Random ids [B, T] and a 0/1 attention mask with `padding` ('left', 'right' or None) on all but row 0."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, seq_len), generator=g)
    mask = torch.ones(batch, seq_len, dtype=torch.long)
    if padding is not None and seq_len > 1:
        for row in range(1, batch):
            pad = min(seq_len - 1, 1 + row * max(1, seq_len // 4))
            if padding == "left":
                mask[row, :pad] = 0
                ids[row, :pad] = 0
            else:
                mask[row, seq_len - pad :] = 0
                ids[row, seq_len - pad :] = 0
    return ids, mask


CODE_FILES = tuple(code_files())  # the remote code: the entry files and what they import
AUTO_MAP_TEXT = configuration.AUTO_MAP_TEXT
AUTO_MAP_COMPOSITE = configuration.AUTO_MAP_COMPOSITE
AUTO_MAP_MOE_TEXT = configuration.AUTO_MAP_MOE_TEXT
AUTO_MAP_MOE_COMPOSITE = configuration.AUTO_MAP_MOE_COMPOSITE


def make_hub_snapshot(src_dir, cache_dir, repo_id: str, files=None) -> str:
    """Lay `src_dir`'s files out as the Hugging Face cache does for a downloaded repo:
    `<cache>/models--org--name/snapshots/<sha>/...` plus `refs/main`. Returns the snapshot path."""
    import hashlib
    import shutil
    from pathlib import Path

    src_dir, cache_dir = Path(src_dir), Path(cache_dir)
    names = sorted(p.name for p in src_dir.iterdir() if p.is_file()) if files is None else list(files)
    sha = hashlib.sha1("\n".join(names).encode() + repo_id.encode()).hexdigest()
    repo_dir = cache_dir / ("models--" + repo_id.replace("/", "--"))
    snap = repo_dir / "snapshots" / sha
    snap.mkdir(parents=True, exist_ok=True)
    for name in names:
        shutil.copy2(src_dir / name, snap / name)
    (repo_dir / "refs").mkdir(exist_ok=True)
    (repo_dir / "refs" / "main").write_text(sha)
    return str(snap)


def hidden_modules_env(env: dict, shim_dir, hide) -> dict:
    """`env` with a `sitecustomize` on PYTHONPATH (ahead of what was there) that makes the modules in `hide`
    unimportable in the subprocess, as on a machine without them."""
    shim_dir = Path(shim_dir)
    shim_dir.mkdir(parents=True, exist_ok=True)
    (shim_dir / "sitecustomize.py").write_text(f"import sys\nfor m in {tuple(hide)!r}:\n    sys.modules[m] = None\n")
    env = dict(env)
    env["PYTHONPATH"] = os.pathsep.join([str(shim_dir)] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def offline_env(cache_dir, modules_dir, hide=("fla",)) -> dict:
    """Environment for a subprocess that may only read the given Hub cache (no network), on a CPU user's install:
    the modules in `hide` are unimportable there. By default fla: the README's CPU setup (requirements.txt) has none,
    the fused classes' routing around an installed fla is tested in the main process, and not importing it saves
    ~5 s a process."""
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HUB_CACHE=str(cache_dir),
               HF_HOME=str(cache_dir), HF_MODULES_CACHE=str(modules_dir), HF_HUB_DISABLE_TELEMETRY="1")
    env.pop("HF_TOKEN", None)
    return hidden_modules_env(env, Path(modules_dir).parent / "hidden-modules", hide) if hide else env


# --------------------------------------------------------------------------------------------------------------------
# CPU emulation of the fused path: the fused control flow (packed GEMMs, the fused prefill, the decode cache and its
# step, generate plumbing) with every kernel swapped for its plain-torch reference, so CI exercises it without a GPU.
# The kernels themselves are tested against the same references (interpreter on CPU, CUDA on the device).
# --------------------------------------------------------------------------------------------------------------------


def emulate_fused_on_cpu(monkeypatch):
    """Let the fused path run on CPU tensors with torch references for every kernel (build models after this: the
    plan is resolved when a model is built, moved or put in eval mode)."""
    monkeypatch.setattr(plan_mod, "EMULATE_ON_CPU", True)


def new_weights(model, seed=5):
    """A fresh random state dict for `model`; keys sharing one tensor (tied embeddings) get one new tensor."""
    torch.manual_seed(seed)
    fresh, new = {}, {}
    for key, value in model.state_dict().items():
        if value.data_ptr() not in fresh:
            fresh[value.data_ptr()] = torch.randn_like(value) * 0.02 if value.dim() > 1 else value.clone()
        new[key] = fresh[value.data_ptr()]
    return new


@pytest.fixture
def fused_on_cpu(monkeypatch):
    """The fused path on CPU (kernels swapped for their references) with a fresh fallback log, for one test. Test
    modules import it and mark the tests that run this way `@cpu_emulated`."""
    emulate_fused_on_cpu(monkeypatch)
    plan_mod._announced.clear()
    yield
    plan_mod._announced.clear()


# Marks a test (or class) to run with the fixture above; its module must import `fused_on_cpu` too.
cpu_emulated = pytest.mark.usefixtures("fused_on_cpu")
