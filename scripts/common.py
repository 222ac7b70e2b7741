"""Helpers shared by the scripts and the tests: import the repo's remote-code files as a package, tiny configs,
random real-shape configs, and stock/fused model pairs that share weights.

The repo's code files use relative imports (that is what makes the Hub copy them), so outside of
`from_pretrained(..., trust_remote_code=True)` they are imported as the package `qwen3_5_fused_repo`, whose path is
the repo root.
"""

import importlib
import json
import re
import sys
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "qwen3_5_fused_repo"

# Real Qwen3.5 text shapes (all: head_dim 256, linear key/value head dim 128, conv 4, vocab 248320,
# partial_rotary_factor 0.25, rope_theta 1e7, mrope_section [11, 11, 10], interleaved, 3 linear : 1 full).
REAL_SHAPES = {
    "0.8B": dict(hidden_size=1024, num_hidden_layers=24, intermediate_size=3584, num_attention_heads=8,
                 num_key_value_heads=2, linear_num_key_heads=16, linear_num_value_heads=16, tie_word_embeddings=True),
    "4B": dict(hidden_size=2560, num_hidden_layers=32, intermediate_size=9216, num_attention_heads=16,
               num_key_value_heads=4, linear_num_key_heads=16, linear_num_value_heads=32, tie_word_embeddings=True),
    "9B": dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=12288, num_attention_heads=16,
               num_key_value_heads=4, linear_num_key_heads=16, linear_num_value_heads=32, tie_word_embeddings=False),
    "27B": dict(hidden_size=5120, num_hidden_layers=64, intermediate_size=17408, num_attention_heads=24,
                num_key_value_heads=4, linear_num_key_heads=16, linear_num_value_heads=48, tie_word_embeddings=False),
}
# Qwen3.5-35B-A3B (also Qwen3.6-35B-A3B): the MoE text model's shape (with REAL_COMMON)
REAL_MOE_SHAPES = {
    "35B-A3B": dict(hidden_size=2048, num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2,
                    linear_num_key_heads=16, linear_num_value_heads=32, num_experts=256, num_experts_per_tok=8,
                    moe_intermediate_size=512, shared_expert_intermediate_size=512, tie_word_embeddings=False),
}
REAL_COMMON = dict(
    vocab_size=248320, head_dim=256, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
    rms_norm_eps=1e-6, max_position_embeddings=32768,
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                     "mrope_section": [11, 11, 10], "mrope_interleaved": True},
)


# The two files config.json's auto_map names; everything else the Hub needs is what they import relatively.
ENTRY_FILES = ("configuration_qwen3_5_fused.py", "modeling_qwen3_5_fused.py")
# transformers' `get_relative_imports`: `import .x` and `from .x import y` (`from . import x` is not followed).
_RELATIVE_IMPORT = re.compile(r"^\s*import\s+\.(\S+)\s*$|^\s*from\s+\.(\S+)\s+import", re.MULTILINE)


def code_files(repo_dir=REPO, entries=ENTRY_FILES) -> list[str]:
    """The top-level ``*.py`` files a Hub repo needs: ``entries`` and every file they reach through relative imports,
    recursively, found as transformers' ``get_relative_import_files`` finds them (so a split of a module into more
    files needs no list to be updated). Raises ``FileNotFoundError`` naming the importer when a file is missing."""
    repo_dir = Path(repo_dir)
    found, todo = [], [(name, None) for name in entries]
    while todo:
        name, importer = todo.pop(0)
        if name in found:
            continue
        path = repo_dir / name
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing" + (f" (imported by {importer})" if importer else ""))
        found.append(name)
        for match in _RELATIVE_IMPORT.finditer(path.read_text(encoding="utf-8")):
            todo.append((f"{match[1] or match[2]}.py", name))
    return sorted(found)


def import_module(name: str) -> types.ModuleType:
    """One of the repo's code files as a module of the package: `import_module("fused_ops_gemv")` is
    `qwen3_5_fused_repo.fused_ops_gemv`. The one way in for tests and scripts, so each file is imported once (one copy
    of its constants and caches)."""
    if PACKAGE not in sys.modules:
        pkg = types.ModuleType(PACKAGE)
        pkg.__path__ = [str(REPO)]
        sys.modules[PACKAGE] = pkg
    return importlib.import_module(f"{PACKAGE}.{name}")


def import_repo():
    """Import the repo's code files as a package; returns (configuration, modeling, fused_ops) modules."""
    return tuple(import_module(name) for name in ("configuration_qwen3_5_fused", "modeling_qwen3_5_fused", "fused_ops"))


def tiny_text_kwargs(**overrides) -> dict:
    """A 4-layer Qwen3.5 text config (3 linear : 1 full) small enough for CPU tests, with real head ratios."""
    kwargs = dict(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_conv_kernel_dim=4, max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                         "mrope_section": [2, 1, 1], "mrope_interleaved": True},
        tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    kwargs.update(overrides)
    return kwargs


# Tiny MoE shapes for the CPU tests: 8 experts top-2, 64 top-8 (Qwen3.5-35B-A3B's 256 top-8, scaled down), and an odd
# hidden size.
TINY_MOE = {
    "E8-top2": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48),
    "E64-top8": dict(num_experts=64, num_experts_per_tok=8, moe_intermediate_size=16,
                     shared_expert_intermediate_size=32),
    "H67": dict(hidden_size=67, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
                shared_expert_intermediate_size=40),
}


def tiny_moe_text_kwargs(shape: str = "E8-top2", **overrides) -> dict:
    """``tiny_text_kwargs`` as a Qwen3.5 MoE text config (``qwen3_5_moe_text``) of one of the ``TINY_MOE`` shapes."""
    kwargs = tiny_text_kwargs(**TINY_MOE[shape])
    kwargs.pop("intermediate_size")  # the MoE config has experts (moe_intermediate_size) and a shared expert instead
    kwargs.update(overrides)
    return kwargs


def is_moe_shape(shape: str | None) -> bool:
    """Whether `shape` names a MoE text model: a `REAL_MOE_SHAPES` key or "tiny-moe" (`TINY_MOE["E8-top2"]`)."""
    return shape in REAL_MOE_SHAPES or shape == "tiny-moe"


def moe_text_kwargs(shape: str, **overrides) -> dict:
    """The `qwen3_5_moe_text` config kwargs of a MoE shape (`is_moe_shape`)."""
    if shape == "tiny-moe":
        return tiny_moe_text_kwargs("E8-top2", **overrides)
    if shape not in REAL_MOE_SHAPES:
        raise ValueError(f"unknown MoE shape {shape!r}; choose tiny-moe or one of {sorted(REAL_MOE_SHAPES)}")
    return {**REAL_COMMON, **REAL_MOE_SHAPES[shape], **overrides}


def tiny_vision_kwargs(out_hidden_size: int) -> dict:
    return dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=out_hidden_size,
                patch_size=4, num_position_embeddings=16, spatial_merge_size=2, temporal_patch_size=2)


def real_text_kwargs(size: str, **overrides) -> dict:
    if size not in REAL_SHAPES:
        raise ValueError(f"unknown size {size!r}; choose one of {sorted(REAL_SHAPES)}")
    kwargs = dict(REAL_COMMON, **REAL_SHAPES[size])
    kwargs.update(overrides)
    return kwargs


def write_report(out: Path, stem: str, results: dict, md: str) -> None:
    """Write `results` as `<stem>.json` and the Markdown table `md` as `<stem>.md` under `out` (created), and print
    the table."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(results, indent=2))
    (out / f"{stem}.md").write_text(md)
    print(md)
