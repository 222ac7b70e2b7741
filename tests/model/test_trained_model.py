"""The embedded default checkpoint at the repo root, loaded with STOCK transformers (no remote code), on CPU.

- held-out NLL / top-1 accuracy recomputed with ``scripts/train_tiny_model.py:heldout_nll`` match
  ``training_report.json``;
- the tokenizer round-trips text and renders the ChatML template;
- the checkpoint has exactly the stock composite Qwen3.5 layout (``model.language_model.*`` + ``model.visual.*``),
  plus the multi-token-prediction head beside it (``mtp.*``, which stock ignores at load; ``test_mtp.py``).

On CPU the stock linear-attention layers would dispatch to flash-linear-attention's Triton kernels when ``fla`` is
installed; the forward passes here run inside ``torch_linear_attention()``, which swaps in transformers' torch code.
"""

import importlib.util
import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from helpers import compat  # the module that routes stock's DeltaNet helpers

REPO = Path(__file__).resolve().parents[2]
REPORT = REPO / "training_report.json"
HELDOUT = REPO / "data" / "heldout.txt"


def _load_train_module():
    # by path: scripts/ is not a package
    spec = importlib.util.spec_from_file_location("train_tiny_model", REPO / "scripts" / "train_tiny_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tiny = _load_train_module()


@pytest.fixture(scope="module")
def report():
    return json.loads(REPORT.read_text())


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(REPO))


@pytest.fixture(scope="module")
def config_json():
    return json.loads((REPO / "config.json").read_text())


def test_heldout_nll_matches_report(report, tokenizer):
    from transformers import AutoModelForCausalLM, Qwen3_5ForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(REPO), dtype=torch.float32)
    assert type(model) is Qwen3_5ForCausalLM  # stock class, not the fused remote code
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as when the value was recorded; also faster than 2 threads on a busy 2-core box
    try:
        with tiny.torch_linear_attention():
            result = tiny.heldout_nll(model, tokenizer, HELDOUT.read_text(encoding="utf-8"), window=256)
    finally:
        torch.set_num_threads(threads)
    recorded = report["heldout"]
    assert result["tokens_scored"] == recorded["tokens_scored"]
    assert result["windows"] == recorded["windows"]
    assert result["nll_per_token"] == pytest.approx(recorded["nll_per_token"], rel=1e-4)
    assert result["top1_accuracy"] == pytest.approx(recorded["top1_accuracy"], abs=2.0 / result["tokens_scored"])


def test_torch_linear_attention_restores_originals():
    from transformers.models.qwen3_5 import modeling_qwen3_5 as mod

    names = [n for n in compat._STOCK_KERNEL_FNS if hasattr(mod, n)]  # this transformers' helpers of that list
    assert names
    before = {n: getattr(mod, n) for n in names}
    with tiny.torch_linear_attention():
        for name in names:
            assert not hasattr(getattr(mod, name), "__wrapped__")
    assert {n: getattr(mod, n) for n in names} == before


def test_tokenizer_round_trip(tokenizer):
    from tokenizers import Tokenizer

    assert len(tokenizer) == 4096
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.pad_token == "<|endoftext|>"
    raw = Tokenizer.from_file(str(REPO / "tokenizer.json"))
    for text in [
        "Return a new list containing all items from the iterable in ascending order.",
        "x = {'a': [1, 2.5e-3]}\n\tdef f(*args, **kwargs):  # tabs, digits 0123456789",
        "Unicode: na\u00efve caf\u00e9 \u2014 \u4f60\u597d \U0001f600",
        "",
    ]:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert ids == raw.encode(text, add_special_tokens=False).ids
        assert tokenizer.decode(ids) == text
    for token in tiny.SPECIAL_TOKENS:
        ids = tokenizer(token, add_special_tokens=False)["input_ids"]
        assert ids == [tokenizer.convert_tokens_to_ids(token)], token
        assert tokenizer.convert_ids_to_tokens(ids) == [token]


def test_chat_template(tokenizer):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]},
        {"role": "assistant", "content": "A cat."},
        {"role": "user", "content": "Thanks."},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is this?<|im_end|>\n"
        "<|im_start|>assistant\nA cat.<|im_end|>\n"
        "<|im_start|>user\nThanks.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert tokenizer.decode(ids) == text


def test_config_is_stock_composite_with_fused_switches(config_json, tokenizer):
    from transformers import AutoConfig, Qwen3_5Config

    cfg = config_json
    assert cfg["model_type"] == "qwen3_5"
    assert cfg["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert cfg["fused_kernels"] is True and cfg["cuda_graphs"] is True
    assert cfg["text_config"]["fused_kernels"] is True and cfg["text_config"]["cuda_graphs"] is True
    assert cfg["auto_map"] == tiny._repo_modules()[0].AUTO_MAP_COMPOSITE
    for key, token in [
        ("image_token_id", "<|image_pad|>"),
        ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"),
        ("vision_end_token_id", "<|vision_end|>"),
    ]:
        assert cfg[key] == tokenizer.convert_tokens_to_ids(token), key

    config = AutoConfig.from_pretrained(str(REPO))  # no trust_remote_code: the stock class
    assert type(config) is Qwen3_5Config
    text = config.text_config
    assert text.layer_types == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + [
        "full_attention"
    ]
    assert text.head_dim % 16 == 0
    rope = text.rope_parameters
    rotary_dim = int(text.head_dim * rope["partial_rotary_factor"])
    assert rope["partial_rotary_factor"] == 0.25 and rope["mrope_interleaved"] is True
    assert sum(rope["mrope_section"]) == rotary_dim // 2
    assert rope["rope_theta"] == 1e7
    assert text.linear_num_value_heads == 2 * text.linear_num_key_heads
    assert text.tie_word_embeddings is True and config.tie_word_embeddings is True
    assert config.vision_config.out_hidden_size == text.hidden_size


def test_checkpoint_keys_are_stock_composite_layout():
    from safetensors import safe_open
    from transformers import AutoConfig, Qwen3_5ForConditionalGeneration

    with safe_open(str(REPO / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        dtypes = {f.get_slice(k).get_dtype() for k in keys}
    assert dtypes == {"F32"}
    prefixes = ("model.language_model.", "model.visual.", "mtp.")
    assert all(k.startswith(prefixes) for k in keys), sorted(k for k in keys if not k.startswith(prefixes))
    assert not any("fused" in k for k in keys)
    assert any(k.startswith("model.visual.") for k in keys)

    config = AutoConfig.from_pretrained(str(REPO))
    with torch.device("meta"):
        stock = Qwen3_5ForConditionalGeneration(config)
    expected = set(stock.state_dict()) - {"lm_head.weight"}  # tied to model.language_model.embed_tokens
    assert {k for k in keys if not k.startswith("mtp.")} == expected
    assert any(k.startswith("mtp.") for k in keys)
