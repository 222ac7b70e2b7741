"""The no-cache forward captured in CUDA graphs (``_ForwardGraph``) on the GPU, against stock transformers.

Each bucket runs eagerly on its first call and is captured on its second; the checks use the third and later calls
(replays). Bounds as in ``test_model_cuda.py`` (issue 3): 2e-5 fp32, 1.5e-2 bf16.
"""

import pytest
import torch

from helpers import compat, graphs  # the repo modules these tests reach into
from helpers import cache_of, ieee_stock, modeling, new_weights, rel_err, stock_and_fused_lm

pytestmark = pytest.mark.cuda
BOUND = {torch.float32: 2e-5, torch.bfloat16: 1.5e-2}


def _pair(dtype):
    stock, fused = stock_and_fused_lm(dtype=torch.float32)
    if dtype == torch.float32:
        ieee_stock(stock)
    return stock.to("cuda", dtype), fused.to("cuda", dtype)


def _captured(model, ids, calls=3):
    """Call the no-cache forward `calls` times: the bucket runs eagerly, is captured on the second, replayed after."""
    with torch.inference_mode():
        for _ in range(calls):
            model(input_ids=ids, use_cache=False)


def _entry(model, batch, seq_len):
    for key, entry in model.model.runner.forward_graphs.items():  # (path, inputs_embeds, batch, length)
        if key[:2] == ("right", False) and key[2:] == (batch, graphs.forward_len_bucket(seq_len)):
            return entry
    raise AssertionError("no forward graph for this bucket")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("seq_len", [1, 7, 129, 2048], ids=lambda t: f"T{t}")
@pytest.mark.parametrize("batch", [1, 3], ids=lambda b: f"b{b}")
def test_replayed_forward_matches_stock(dtype, seq_len, batch):
    stock, fused = _pair(dtype)
    ids = torch.randint(3, 250, (batch, seq_len), device="cuda")
    with torch.inference_mode():
        ref = stock(input_ids=ids, use_cache=False).logits.float()
        for _ in range(2):
            fused(input_ids=ids, use_cache=False)
        entry = _entry(fused, batch, seq_len)
        assert entry.graph, "the bucket was not captured"
        outs = [fused(input_ids=ids, use_cache=False).logits.float() for _ in range(2)]
        other = torch.randint(3, 250, (batch, seq_len), device="cuda")  # new inputs through the same graph
        other_ref = stock(input_ids=other, use_cache=False).logits.float()
        other_out = fused(input_ids=other, use_cache=False).logits.float()
    for out in outs:
        assert torch.isfinite(out).all()
        assert rel_err(out, ref) <= BOUND[dtype]
    assert rel_err(other_out, other_ref) <= BOUND[dtype]


def test_replaced_and_updated_weights_are_read():
    stock, fused = _pair(torch.float32)
    ids = torch.randint(3, 250, (2, 33), device="cuda")
    _captured(fused, ids)
    # in place (same addresses: the graph reads the new values), then replaced (new addresses: captured again)
    with torch.no_grad():
        for p_stock, p_fused in zip(stock.parameters(), fused.parameters()):
            p_stock.mul_(1.01)
            p_fused.mul_(1.01)
    with torch.inference_mode():
        assert rel_err(fused(input_ids=ids, use_cache=False).logits, stock(input_ids=ids, use_cache=False).logits) <= 2e-5
    new = new_weights(stock)  # tied embeddings stay tied (one new tensor for both keys)
    stock.load_state_dict(new)
    fused.load_state_dict(new, assign=True)
    with torch.inference_mode():
        out = fused(input_ids=ids, use_cache=False).logits
        ref = stock(input_ids=ids, use_cache=False).logits
    assert _entry(fused, 2, 33).graph
    assert rel_err(out, ref) <= 2e-5


def test_graph_memory_is_freed_on_release_and_move():
    _, fused = _pair(torch.bfloat16)
    ids = torch.randint(3, 250, (1, 2048), device="cuda")
    _captured(fused, ids)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    held = torch.cuda.memory_reserved()  # weights + the graph's pool (the eager calls' blocks were just released)
    fused.set_fused_kernels(True)  # a switch refresh frees the graphs, weights stay on the GPU
    torch.cuda.empty_cache()
    assert not fused.model.runner.forward_graphs.entries
    assert torch.cuda.memory_reserved() < held
    with torch.inference_mode():
        for _ in range(2):
            fused(input_ids=ids, use_cache=False)
    assert fused.model.runner.forward_graphs.entries
    fused.to("cpu")
    assert not fused.model.runner.forward_graphs.entries


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("seq_len", [7, 129, 2048], ids=lambda t: f"T{t}")
@pytest.mark.parametrize("kind", ["cache", "cache-left", "no-cache-left"])
def test_masked_replay_matches_stock(dtype, seq_len, kind):
    """Padded batches and calls that return a cache replay the left-padded masked graph: logits on the real positions
    and the next token's logits through the returned cache (continued by stock) within bound."""
    stock, fused = _pair(dtype)
    batch = 3
    ids = torch.randint(3, 250, (batch, seq_len), device="cuda")
    kwargs = {}
    if "left" in kind:
        mask = torch.ones_like(ids)
        mask[1, : seq_len // 3] = 0
        mask[2, : seq_len // 2] = 0
        kwargs["attention_mask"] = mask
    if "no-cache" in kind:
        kwargs["use_cache"] = False
    valid = kwargs.get("attention_mask", torch.ones_like(ids)).bool()
    with torch.inference_mode():
        ref = stock(input_ids=ids, **kwargs)
        outs = [fused(input_ids=ids, **kwargs) for _ in range(3)]
        (entry,) = [e for k, e in fused.model.runner.forward_graphs.items() if k[0] != "right"]
        assert entry.graph, "the bucket was not captured"
        if "no-cache" not in kind:
            step_mask = None if "attention_mask" not in kwargs else torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            nxt = ids[:, -1:]
            want = stock(input_ids=nxt, attention_mask=step_mask, **{compat.GENERATE_CACHE_KW: cache_of(ref)}).logits
            got = stock(input_ids=nxt, attention_mask=step_mask, **{compat.GENERATE_CACHE_KW: cache_of(outs[-1])}).logits
            assert rel_err(got.float(), want.float()) <= BOUND[dtype]
    for out in outs[1:]:
        assert torch.isfinite(out.logits[valid]).all()
        assert rel_err(out.logits[valid].float(), ref.logits[valid].float()) <= BOUND[dtype]
