"""A model dispatched over two GPUs with ``device_map`` (accelerate), fused kernels on (issue 7).

Run on a machine with two GPUs (the ``nvidia-h200-x2`` kind):
``python -m pytest -m cuda -q tests/model/test_multi_gpu.py``.
An 8-layer random model (two 3:1 groups) is saved, then loaded with its first half on ``cuda:0`` and the second
half, the final norm and the LM head on ``cuda:1``. Each layer runs its fused path on its own device; the fused
decode step follows the layers across devices without CUDA graphs (said once), and the forward is not captured.
The last test loads with ``device_map="auto"`` itself (the split accelerate infers; that it never cuts a decoder
layer is also checked on CPU in ``test_model.py``).
"""

import logging

import pytest
import torch

from helpers import decode, plan_mod  # the repo modules these tests reach into
from helpers import generate_fused, ieee_stock, modeling, rel_err, stock_and_fused_lm

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"),
]
LAYERS = 8


def _device_map():
    half = LAYERS // 2
    device_map = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.norm": 1, "lm_head": 1}
    device_map.update({f"model.layers.{i}": 0 if i < half else 1 for i in range(LAYERS)})
    return device_map


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    path = tmp_path_factory.mktemp("split")
    stock, _ = stock_and_fused_lm(seed=0, num_hidden_layers=LAYERS, tie_word_embeddings=False)
    stock.save_pretrained(path)
    split = modeling.Qwen3_5FusedForCausalLM.from_pretrained(
        path, device_map=_device_map(), dtype=torch.float32, fused_kernels=True
    ).eval()
    single = modeling.Qwen3_5FusedForCausalLM.from_pretrained(path, dtype=torch.float32, fused_kernels=True)
    return ieee_stock(stock.cuda().eval()), split, single.cuda().eval()


def test_layers_sit_on_both_gpus_and_run_fused(models):
    _, split, _ = models
    assert {str(d) for d in split.hf_device_map.values()} == {"0", "1"}
    layers = split.model.layers
    assert layers[0].mlp.gate_proj.weight.device == torch.device("cuda", 0)
    assert layers[-1].mlp.gate_proj.weight.device == torch.device("cuda", 1)
    assert all(v["path"] == "fused" for v in split.describe()["layers"].values())


@pytest.mark.parametrize("use_cache", [False, True])
def test_forward_matches_stock(models, use_cache):
    stock, split, _ = models
    ids = torch.randint(3, 250, (3, 129), device="cuda:0")
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    mask[2, :40] = 0
    with torch.inference_mode():
        ref = stock(input_ids=ids, attention_mask=mask, use_cache=use_cache).logits
        out = split(input_ids=ids, attention_mask=mask, use_cache=use_cache).logits
    valid = mask.bool()
    assert rel_err(out.to(ref.device)[valid], ref[valid]) <= 2e-5


def test_scoring_forward_is_not_captured_across_devices(models, caplog):
    stock, split, _ = models
    ids = torch.randint(3, 250, (2, 70), device="cuda:0")
    plan_mod._announced.clear()
    with torch.inference_mode(), caplog.at_level(logging.WARNING):
        ref = stock(input_ids=ids, use_cache=False).logits
        outs = [split(input_ids=ids, use_cache=False).logits for _ in range(3)]  # a bucket captures on call 2
    assert not split.model.runner.forward_graphs.entries
    assert any("split over several devices" in r.getMessage() for r in caplog.records)
    for out in outs:
        assert rel_err(out.to(ref.device), ref) <= 2e-5


def test_greedy_tokens_equal_single_gpu_and_stock(models, caplog):
    stock, split, single = models
    ids = torch.randint(3, 250, (2, 17), device="cuda:0")
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    plan_mod._announced.clear()
    kw = dict(attention_mask=mask, max_new_tokens=48, min_new_tokens=48, do_sample=False, pad_token_id=0,
              return_dict_in_generate=True, output_scores=True)
    with torch.inference_mode(), caplog.at_level(logging.WARNING):
        ref = stock.generate(ids, **kw)
        one = single.generate(ids, **kw)
        two = generate_fused(split, ids, **kw)
        again = split.generate(ids, **kw)
    cache = two.fused_cache
    assert isinstance(cache, decode.FusedDecodeCache)
    state = cache._state
    assert state.multi_device
    assert {str(t.device) for t in state.conv.values()} == {"cuda:0", "cuda:1"}
    assert torch.equal(two.sequences, one.sequences)
    assert torch.equal(two.sequences, ref.sequences)
    assert torch.equal(again.sequences, two.sequences)
    for a, b in zip(two.scores, ref.scores):
        finite = torch.isfinite(b)
        assert rel_err(a.to(b.device)[finite], b[finite]) <= 2e-5
    messages = [r.getMessage() for r in caplog.records if "decode step runs without CUDA graphs" in r.getMessage()]
    assert len(messages) == 1  # two split generate calls, said once


def test_device_map_auto_splits_at_whole_layers(tmp_path):
    """`device_map="auto"` itself (accelerate's inference, here with `max_memory` that fits ~55% of the model per GPU
    so both are used): no decoder layer is cut, every layer runs fused, greedy tokens equal stock's (fp32)."""
    stock, _ = stock_and_fused_lm(seed=1, num_hidden_layers=LAYERS, tie_word_embeddings=False)
    stock.save_pretrained(tmp_path)
    size = sum(p.numel() * p.element_size() for p in stock.parameters())
    auto = modeling.Qwen3_5FusedForCausalLM.from_pretrained(
        tmp_path, device_map="auto", max_memory={0: int(0.55 * size), 1: int(0.55 * size)}, dtype=torch.float32,
        fused_kernels=True,
    ).eval()
    assert {str(d) for d in auto.hf_device_map.values()} == {"0", "1"}
    assert not [k for k in auto.hf_device_map if ".layers." in k and k.split(".layers.")[1].count(".")]
    assert all(v["path"] == "fused" for v in auto.describe()["layers"].values())
    stock = ieee_stock(stock.cuda().eval())
    ids = torch.randint(3, 250, (2, 17), device="cuda:0")
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=24, min_new_tokens=24, do_sample=False,
              pad_token_id=0)
    with torch.inference_mode():
        assert torch.equal(auto.generate(ids, **kw), stock.generate(ids, **kw))
