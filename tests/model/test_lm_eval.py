"""lm-evaluation-harness (`HFLM`, what most users score a checkpoint with) on the shipped model, remote code against
stock: loglikelihoods and `generate_until` continuations, on CPU (stock's torch code on both sides, so equal) and on a
GPU in fp32 (the fused path against stock's own torch code, within the model bound).

The README's "Evaluation" section gives the `lm_eval` command these calls stand for.
"""

import contextlib
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from helpers import REPO, compat

lm_eval_hf = pytest.importorskip("lm_eval.models.huggingface", reason="needs lm-eval (requirements.txt installs it)")
from lm_eval.api.instance import Instance  # noqa: E402

# Pairs (context, continuation) of different lengths, so a batch is padded; a continuation the tiny model predicts
# well and ones it does not.
LOGLIKELIHOOD = [
    ("The quick brown fox", " jumps over the lazy dog"),
    ("def add(a, b):", "\n    return a + b"),
    ("Hello", ", world"),
    ("import numpy as np\nx = np.", "zeros(3)"),
]
# max_gen_toks below the shipped generation config's old max_new_tokens (64): what the caller asks is what runs
GENERATE = [("Once upon a time", {"until": ["\n\n"], "max_gen_toks": 12, "do_sample": False}),
            ("def f(x):", {"until": ["<|im_end|>"], "max_gen_toks": 7, "do_sample": False})]


def _requests(kind, arguments):
    return [Instance(request_type=kind, doc={}, arguments=args, idx=i) for i, args in enumerate(arguments)]


def _score(device, trust_remote_code):
    """Loglikelihoods, greedy flags and continuations of the requests above, through HFLM in fp32 on `device`."""
    lm = lm_eval_hf.HFLM(pretrained=str(REPO), trust_remote_code=trust_remote_code, device=device, batch_size=2,
                         dtype="float32")
    assert ("Fused" in type(lm.model).__name__) == trust_remote_code, type(lm.model)
    # stock beside fla: its DeltaNet helpers run stock's plain-torch code (helpers.run_stock says why); on the GPU this
    # is the fp32 reference (helpers.ieee_stock)
    with compat.torch_reference_kernels() if not trust_remote_code else contextlib.nullcontext():
        ll = lm.loglikelihood(_requests("loglikelihood", LOGLIKELIHOOD))
        text = lm.generate_until(_requests("generate_until", GENERATE))
    tokens = [len(lm.tok_encode(t)) for t in text]
    return torch.tensor([x for x, _ in ll], dtype=torch.float64), [g for _, g in ll], text, tokens


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_hflm_scores_like_stock(device):
    fused_ll, fused_greedy, fused_text, fused_tokens = _score(device, trust_remote_code=True)
    stock_ll, stock_greedy, stock_text, stock_tokens = _score(device, trust_remote_code=False)
    assert torch.isfinite(fused_ll).all()
    if device == "cpu":  # the fused classes fall back to stock's code on CPU: the same numbers
        torch.testing.assert_close(fused_ll, stock_ll, rtol=0, atol=0)
    else:  # the fp32 bound for a summed log-probability against stock's own torch code
        assert (fused_ll - stock_ll).abs().max().item() <= 1e-4, (fused_ll, stock_ll)
    assert fused_greedy == stock_greedy
    assert fused_text == stock_text
    # the caller's max_gen_toks bounds the continuation (the shipped generation config sets no max_new_tokens)
    for tokens, (_, kwargs) in zip(fused_tokens, GENERATE):
        assert tokens <= kwargs["max_gen_toks"], (tokens, kwargs)
