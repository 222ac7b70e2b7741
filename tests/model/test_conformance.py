"""Same behaviour as stock where a user can see it: outputs asked for, saved folders, threads, pipeline, generation
defaults (CPU)."""

import contextlib
import json
import logging
import sys
import threading

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer, pipeline

from helpers import (
    CODE_FILES,
    REPO,
    compat,
    composite_kwargs,
    configuration,
    emulate_fused_on_cpu,
    generate_stock,
    modeling,
    padded_batch,
    rel_err,
    run_stock,
    stock_and_fused_lm,
)


@pytest.mark.parametrize("emulated", [False, True], ids=["stock-path", "fused-path"])
def test_hidden_states_and_attentions_as_stock(monkeypatch, emulated):
    """`output_hidden_states` / `output_attentions` give stock's tuples (the fused layers' own hidden states on the
    fused path), with eager attention so that attention weights exist."""
    if emulated:
        emulate_fused_on_cpu(monkeypatch)
    stock, fused = stock_and_fused_lm()
    for model in (stock, fused):
        model.config._attn_implementation = "eager"
    ids, mask = padded_batch(2, 9, "left")
    kw = dict(input_ids=ids, attention_mask=mask, output_hidden_states=True, output_attentions=True)
    with torch.no_grad():
        ref, out = run_stock(stock, **kw), fused(**kw)
    assert len(out.hidden_states) == len(ref.hidden_states) == stock.config.num_hidden_layers + 1
    assert len(out.attentions) == len(ref.attentions) == stock.config.layer_types.count("full_attention")
    bound = 1e-5 if emulated else 0.0  # the stock path is stock's code: bit-identical
    for got, want in zip(out.hidden_states + out.attentions, ref.hidden_states + ref.attentions):
        assert got.shape == want.shape and rel_err(got, want) <= bound


def test_forward_keeps_stocks_signature():
    import inspect

    from transformers import Qwen3_5TextModel

    params = list(inspect.signature(modeling.Qwen3_5FusedTextModel.forward).parameters)
    assert params == list(inspect.signature(Qwen3_5TextModel.forward).parameters)
    assert params[1] == "input_ids"


def _folder_is_published(path, stock_arch, auto_map):
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == [stock_arch]
    assert all(config["auto_map"][k] == v for k, v in auto_map.items())
    assert config["fused_kernels"] is True and config["cuda_graphs"] is True
    assert set(CODE_FILES) <= {p.name for p in path.iterdir()}
    if (path / "generation_config.json").exists():  # models that generate
        assert "max_new_tokens" not in json.loads((path / "generation_config.json").read_text())


@pytest.mark.parametrize("entry", ["causal-lm", "text-model", "composite-model", "composite-lm"])
def test_save_pretrained_reloads_fused_with_remote_code_and_stock_without(tmp_path, entry):
    """A folder saved from any entry class: stock `architectures`, the full `auto_map`, the switches and every code
    file; `trust_remote_code=True` loads our class from the folder's own code, without it stock's class."""
    torch.manual_seed(0)
    if entry.startswith("composite"):
        config = configuration.Qwen3_5FusedConfig(**composite_kwargs(), fused_kernels=True)
        composite_model = entry == "composite-model"
        cls = modeling.Qwen3_5FusedModel if composite_model else modeling.Qwen3_5FusedForConditionalGeneration
        auto = AutoModel if entry == "composite-model" else AutoModelForImageTextToText
        arch = "Qwen3_5Model" if entry == "composite-model" else "Qwen3_5ForConditionalGeneration"
        auto_map = configuration.AUTO_MAP_COMPOSITE
    else:
        config = configuration.Qwen3_5FusedTextConfig(**composite_kwargs()["text_config"], fused_kernels=True)
        cls = modeling.Qwen3_5FusedTextModel if entry == "text-model" else modeling.Qwen3_5FusedForCausalLM
        auto = AutoModel if entry == "text-model" else AutoModelForCausalLM
        arch = "Qwen3_5TextModel" if entry == "text-model" else "Qwen3_5ForCausalLM"
        auto_map = configuration.AUTO_MAP_TEXT
    model = cls(config)
    model.save_pretrained(tmp_path)
    _folder_is_published(tmp_path, arch, auto_map)
    fused = auto.from_pretrained(tmp_path, trust_remote_code=True)
    assert type(fused).__name__ == cls.__name__ and type(fused).__module__.startswith("transformers_modules")
    stock = auto.from_pretrained(tmp_path)
    assert type(stock).__name__ == arch and type(stock).__module__.startswith("transformers.models.qwen3_5")


@pytest.mark.parametrize("layout", ["text", "composite"])
def test_sequence_classification_head_saves_and_reloads_like_stock(tmp_path, layout):
    """`AutoModelForSequenceClassification` over a fused config: stock's head on the fused backbone; saved, it
    reloads as ours with remote code and as stock's class without (stock `architectures`), with the same logits."""
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    if layout == "composite":
        config = configuration.Qwen3_5FusedConfig(**composite_kwargs(), num_labels=3)
        ours, stock_name = modeling.Qwen3_5FusedForSequenceClassification, "Qwen3_5ForSequenceClassification"
    else:
        config = configuration.Qwen3_5FusedTextConfig(**composite_kwargs()["text_config"], num_labels=3)
        ours, stock_name = modeling.Qwen3_5FusedTextForSequenceClassification, "Qwen3_5TextForSequenceClassification"
    model = AutoModelForSequenceClassification.from_config(config).eval()
    assert type(model) is ours
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == [stock_name]
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    again = AutoModelForSequenceClassification.from_pretrained(tmp_path, trust_remote_code=True).eval()
    stock = AutoModelForSequenceClassification.from_pretrained(tmp_path).eval()
    assert type(again).__name__ == ours.__name__ and type(stock).__name__ == stock_name
    with torch.no_grad():
        want = run_stock(stock, input_ids=ids).logits
        assert want.shape == (1, 3)
        assert rel_err(again(input_ids=ids).logits, want) <= 1e-5
        assert rel_err(model(input_ids=ids).logits, want) <= 1e-5


def test_resave_of_the_repo_loaded_by_auto_class_stays_fused(tmp_path):
    """The issue's case: `AutoModelForCausalLM.from_pretrained(repo, trust_remote_code=True)` of a composite repo
    (the loader builds the text causal LM), saved and reloaded, is fused again, and stock without remote code."""
    model = AutoModelForCausalLM.from_pretrained(REPO, trust_remote_code=True)
    model.save_pretrained(tmp_path)
    _folder_is_published(tmp_path, "Qwen3_5ForCausalLM", configuration.AUTO_MAP_TEXT)
    again = AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True)
    assert type(again).__name__ == "Qwen3_5FusedForCausalLM" and again.describe()["fused_kernels"] is True
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path)).__name__ == "Qwen3_5ForCausalLM"


@pytest.mark.parametrize("emulated", [False, True], ids=["stock-path", "fused-path"])
def test_threads_share_one_model(monkeypatch, emulated):
    """Several threads calling `generate` and forwards on one model each get their single-threaded result, with no
    error: on the stock CPU path (whose fla routing was swapped in and out per call) and on the fused path (its
    shared decode buffers and bucketed forwards, serialised per model)."""
    if emulated:
        emulate_fused_on_cpu(monkeypatch)
    _, fused = stock_and_fused_lm(seed=2)
    prompts = [padded_batch(2, 5 + i, "left", seed=i) for i in range(4)]
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        want = [fused.generate(input_ids=ids, attention_mask=mask, **kw) for ids, mask in prompts]
        want_logits = [fused(input_ids=ids, use_cache=False).logits for ids, _ in prompts]
    results, errors = {}, []

    def work(i):
        try:
            with torch.no_grad():
                ids, mask = prompts[i % 4]
                for _ in range(3):
                    results.setdefault(i, []).append((fused.generate(input_ids=ids, attention_mask=mask, **kw),
                                                      fused(input_ids=ids, use_cache=False).logits))
        except Exception as err:  # noqa: BLE001 - any error in a thread fails the test
            errors.append(repr(err))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i, runs in results.items():
        for tokens, logits in runs:
            assert torch.equal(tokens, want[i % 4]) and torch.equal(logits, want_logits[i % 4])


def _pipeline_warnings(caplog, tok, context=contextlib.nullcontext, **load_kw):
    """The warnings (messages) that loading the repo and one `pipeline("text-generation")` call log, with
    transformers' once-only warnings and the fused code's announcements re-armed and its logs propagated to pytest's handler (off by default, so
    without this the test would see nothing when run alone)."""
    logging.Logger.warning_once.cache_clear()
    for name, module in list(sys.modules.items()):  # our once-only lines too, in every copy of the code (remote too)
        if name.endswith(".fused_plan") and hasattr(module, "_announced"):
            module._announced.clear()
    root = logging.getLogger("transformers")
    propagated, root.propagate = root.propagate, True
    try:
        caplog.clear()
        with caplog.at_level(logging.WARNING), context():
            model = AutoModelForCausalLM.from_pretrained(REPO, **load_kw)
            text = pipeline("text-generation", model=model, tokenizer=tok)("def f(x):", max_new_tokens=4)
    finally:
        root.propagate = propagated
    assert text[0]["generated_text"].startswith("def f(x):")
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_pipeline_and_loading_say_nothing_alarming(caplog):
    """`pipeline("text-generation")` over the repo loaded with remote code logs what stock logs for the same call
    (whatever this transformers version warns about the pipeline itself) plus at most the one fallback line (here:
    CPU), and never a "not supported" list."""
    tok = AutoTokenizer.from_pretrained(REPO)
    stock = _pipeline_warnings(caplog, tok, compat.torch_reference_kernels)  # stock on CPU beside fla: see run_stock
    fused = _pipeline_warnings(caplog, tok, trust_remote_code=True)
    assert not [m for m in fused if "not supported" in m], fused
    extra = [m for m in fused if m not in stock]
    assert len(extra) == 1 and extra[0].startswith("Qwen3.5 fused kernels:") and len(extra[0]) < 300, extra


def test_generation_defaults_do_not_override_the_caller():
    """The shipped generation config sets no `max_new_tokens`, so a caller's `max_length` (lm-evaluation-harness
    passes one) is what generate uses."""
    assert "max_new_tokens" not in json.loads((REPO / "generation_config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(REPO, trust_remote_code=True)
    stock = AutoModelForCausalLM.from_pretrained(REPO)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        out = model.generate(ids, max_length=9, do_sample=False)
        ref = generate_stock(stock, ids, max_length=9, do_sample=False)
    assert out.shape[1] == 9 and torch.equal(out, ref)

