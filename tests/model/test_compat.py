"""What the fused path relies on in the installed transformers is checked by behaviour, not by version or signature
(CPU): the stock cache it returns, the fallback when that check fails, and transformers' Hub kernels."""

import logging

import pytest
import torch
import transformers
from transformers.cache_utils import DynamicCache

from helpers import (
    assert_exact,
    compat,
    decode,
    emulate_fused_on_cpu,
    modeling,
    padded_batch,
    plan_mod,
    run_stock,
    stock_and_fused_lm,
)


def _fill_without_the_count(cache, layer_idx, conv, recurrent, kernel_size, tokens):
    """The fused path's returned-cache construction before transformers 5.25 support: stock's update calls only."""
    cache.update_conv_state(conv, layer_idx, conv_kernel_size=kernel_size)
    cache.update_recurrent_state(recurrent, layer_idx)


def _linear_layers_count_tokens() -> bool:
    """Whether this transformers' linear-attention cache layer keeps a token count of its own (5.25+)."""
    from transformers import Qwen3_5TextConfig

    cache = DynamicCache(config=Qwen3_5TextConfig(num_hidden_layers=1, layer_types=["linear_attention"]))
    return hasattr(cache.layers[0], "cumulative_length_linear")


def test_returned_cache_probe_passes_on_this_transformers():
    assert compat._probe_returned_cache() is None, transformers.__version__
    assert compat.returned_cache_reason() is None


def test_probe_catches_the_cache_that_forgot_the_token_count():
    """The construction the fused path used before 5.25 support returned a cache whose length read the conv window
    (4) instead of the prompt: the probe says so on a transformers whose linear layers count tokens, and passes it
    where they do not (there it was right)."""
    reason = compat._probe_returned_cache(_fill_without_the_count)
    if _linear_layers_count_tokens():
        assert reason is not None and "get_seq_length" in reason, reason
    else:
        assert reason is None, reason


def test_a_failed_probe_runs_stock_and_says_so_once(monkeypatch, caplog):
    """A transformers whose behaviour differs from what the fused path writes: the whole model runs stock's code
    (bit for bit), announced in one line, never the fused path."""
    emulate_fused_on_cpu(monkeypatch)
    monkeypatch.setattr(compat, "_returned_cache_reason", ["the probe's difference"])
    monkeypatch.setattr(plan_mod, "_announced", set())
    stock, fused = stock_and_fused_lm()
    assert fused.fused_plan.reason.endswith("is not supported by the fused path: the probe's difference")
    ids, mask = padded_batch(2, 9, "left")
    with caplog.at_level(logging.WARNING), torch.no_grad():
        got = [fused(input_ids=ids, attention_mask=mask).logits for _ in range(2)]
        want = run_stock(stock, input_ids=ids, attention_mask=mask).logits
    assert_exact("logits", got[0], want)
    said = [r.getMessage() for r in caplog.records if "the probe's difference" in r.getMessage()]
    assert len(said) == 1, said
    assert fused.describe()["plan"]["reason"] == fused.fused_plan.reason


def test_returned_cache_reads_like_stocks(monkeypatch):
    """A forward that returns a cache and one that continues it (the fused path, CPU emulation): the cache answers
    every length query as stock's does, its states are stock's, and the continued logits are stock's."""
    emulate_fused_on_cpu(monkeypatch)
    stock, fused = stock_and_fused_lm()
    ids, mask = padded_batch(2, 9, "left")
    with torch.no_grad():
        ref = run_stock(stock, input_ids=ids, attention_mask=mask, use_cache=True)
        out = fused(input_ids=ids, attention_mask=mask, use_cache=True)
        got_cache, want_cache = (getattr(o, compat.OUTPUT_CACHE_FIELD) for o in (out, ref))
        for idx in (None, *range(stock.config.num_hidden_layers)):
            assert compat._seq_length(got_cache, idx) == compat._seq_length(want_cache, idx), idx
        nxt = torch.full((2, 1), 7)
        mask2 = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
        kw = {"input_ids": nxt, "attention_mask": mask2}
        got = fused(**kw, **{compat.GENERATE_CACHE_KW: got_cache}).logits
        want = run_stock(stock, **kw, **{compat.GENERATE_CACHE_KW: want_cache}).logits
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_fused_decode_cache_answers_stocks_deltanet_questions():
    """Stock's DeltaNet forward (a layer kind falling back while the prefill writes into the fused cache) asks a
    5.25 cache whether it records history and how many states to keep, and counts single-token conv updates."""
    cache = decode.FusedDecodeCache.__new__(decode.FusedDecodeCache)
    assert cache.is_recording_past(0) is False
    assert cache.get_recurrent_states_to_keep(0) == 0
    assert cache.increase_count(0, 0) is None
    assert compat.is_recording_past(cache, 0) is False


def test_a_recording_cache_sends_the_deltanet_layer_to_stock(monkeypatch):
    """A cache that records every token's state (5.25 assisted decoding) gets stock's DeltaNet forward, which keeps
    that history; said once."""
    emulate_fused_on_cpu(monkeypatch)
    monkeypatch.setattr(plan_mod, "_announced", set())
    stock, fused = stock_and_fused_lm()
    calls = []

    class Recording(DynamicCache):
        def is_recording_past(self, layer_idx=None):
            calls.append(layer_idx)
            return True

    layer = fused.model.layers[0].linear_attn
    stock_forward = type(layer).__mro__[2].forward  # Qwen3_5GatedDeltaNet.forward
    seen = []
    monkeypatch.setattr(type(layer).__mro__[2], "forward", lambda self, *a, **k: seen.append(1) or stock_forward(
        self, *a, **k))
    x = torch.randn(1, 3, fused.config.hidden_size)
    with torch.no_grad():
        layer(x, **{compat.DELTANET_CACHE_KW: Recording(config=fused.config)})
    assert calls and seen
    assert any("records every token" in key for key in plan_mod.announced())


# -- transformers' Hub kernels ------------------------------------------------------------------------------------


@pytest.fixture
def saved_fused(tmp_path):
    _, fused = stock_and_fused_lm()
    fused.save_pretrained(tmp_path)
    return tmp_path


def _no_kernelize(monkeypatch):
    """Make transformers believe `kernels` is installed, with its `kernelize` failing the test if reached."""
    from transformers import modeling_utils

    def kernelize(*args, **kwargs):
        raise AssertionError("kernelize ran on a fused model")

    monkeypatch.setattr(modeling_utils, "kernelize", kernelize)
    monkeypatch.setattr(modeling_utils, "is_kernels_available", lambda *a, **k: True)


@pytest.mark.parametrize("requested", [None, True], ids=["default", "asked"])
def test_fused_load_does_not_kernelize(monkeypatch, caplog, saved_fused, requested):
    """5.25 turns Hub kernels on by default and raises without the `kernels` package; `kernelize` would swap the
    forward of the stock layer classes ours subclass. While fused, the load runs no `kernelize` (whether `kernels`
    is installed or not) and says so only when it was asked for."""
    monkeypatch.delenv("USE_HUB_KERNELS", raising=False)
    monkeypatch.setattr(plan_mod, "_announced", set())
    kwargs = {} if requested is None else {"use_kernels": requested}
    with caplog.at_level(logging.WARNING):
        modeling.Qwen3_5FusedForCausalLM.from_pretrained(saved_fused, **kwargs)  # `kernels` as installed, or not
        _no_kernelize(monkeypatch)
        model = modeling.Qwen3_5FusedForCausalLM.from_pretrained(saved_fused, **kwargs)  # `kernels` "installed"
    said = [r.getMessage() for r in caplog.records if "Hub kernels" in r.getMessage()]
    assert len(said) == (1 if requested else 0), said
    assert model.use_kernels is False and model.fused_plan.fused_kernels
    model.use_kernels = True  # asked after the load: refused the same way
    assert model.use_kernels is False and "hub-kernels" in plan_mod.announced()


def test_stock_path_load_keeps_stocks_hub_kernel_handling(saved_fused):
    """fused_kernels=False is the stock model: `use_kernels=True` goes to transformers, which answers it exactly as
    for its own classes (without the `kernels` package: refused; with USE_HUB_KERNELS=NO: loaded without them)."""
    from transformers import Qwen3_5ForCausalLM

    def outcome(cls, **kw):
        try:
            model = cls.from_pretrained(saved_fused, use_kernels=True, **kw)
        except Exception as err:  # noqa: BLE001
            return "raised", type(err), str(err)
        return "loaded", model.use_kernels

    assert outcome(modeling.Qwen3_5FusedForCausalLM, fused_kernels=False) == outcome(Qwen3_5ForCausalLM)
