"""Self-speculative ``generate`` (``fused_speculative``: the MTP head drafts, one fused verify pass checks), on CPU.

- greedy: the tokens of the non-speculative fused loop and of stock, and the returned cache equal to the
  non-speculative one, for dense and MoE models, k = 1..3, drafts all right, all wrong or mixed (partial rollbacks),
  a stop (EOS, a custom criterion) inside a round, ``max_new_tokens`` not a multiple of k + 1, a streamer;
- the head's own cache holds the true pairs only: each round's first draft equals the head run afresh over the
  sequence so far;
- sampling: the acceptance rule on synthetic distributions (a chi-square bound a broken rule fails by far), and the
  shipped model's speculative samples against its non-speculative ones;
- the switch (config field, generation config field, per-call argument, default off on CPU, no head, batch > 1) and
  what ``describe()`` and the log say;
- the shipped checkpoint: greedy equality on held-out prompts, and its head's drafts accepted at the trained rate.
"""

import contextlib
import math
from pathlib import Path

import pytest
import torch
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from helpers import (  # noqa: F401 - fused_on_cpu: the fixture
    assert_caches_close,
    cache_of,
    configuration,
    cpu_emulated,
    fused_on_cpu,
    generate_stock,
    import_module,
    modeling,
    needs_interpreter,
    run_stock,
)
from scripts.common import tiny_moe_text_kwargs, tiny_text_kwargs

spec = import_module("fused_speculative")
plan_mod = import_module("fused_plan")
REPO = Path(__file__).resolve().parents[2]
# The verify pass sums each linear over k + 1 rows, one row at a time without drafts: fp32 rounding order only.
CACHE_BOUND = 1e-4


def _pair(moe: bool = False, seed: int = 0, head: bool = True):
    """A stock causal LM and a fused one with the same random weights (matrices at std 0.15, so greedy tokens vary),
    the fused one with a random MTP head."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3_5TextConfig

    kwargs = tiny_moe_text_kwargs(experts_implementation="eager") if moe else tiny_text_kwargs()
    stock_cls, stock_config = (Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig) if moe else (Qwen3_5ForCausalLM,
                                                                                         Qwen3_5TextConfig)
    fused_cls, fused_config = ((modeling.Qwen3_5MoeFusedForCausalLM, configuration.Qwen3_5MoeFusedTextConfig) if moe
                               else (modeling.Qwen3_5FusedForCausalLM, configuration.Qwen3_5FusedTextConfig))
    torch.manual_seed(seed)
    stock = stock_cls(stock_config(**kwargs)).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in stock.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.15)
    fused = fused_cls(fused_config(**kwargs, fused_kernels=True, mtp_num_hidden_layers=1 if head else 0)).eval()
    missing, unexpected = fused.load_state_dict(stock.state_dict(), strict=False)
    assert all(k.startswith("mtp.") for k in missing) and not unexpected
    if head:
        with torch.no_grad():
            for p in fused.mtp.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return stock, fused


def _prompt(length: int = 9, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 250, (1, length), generator=torch.Generator().manual_seed(seed))


def _oracle(reference: torch.Tensor, hit: float, seed: int = 0, vocab: int = 256):
    """A draft override: each draft replaced by the reference's token at its position with probability ``hit``, else
    by a token that differs from it (beyond the reference's end the head's drafts stay)."""
    g = torch.Generator().manual_seed(seed)

    def override(drafts, input_ids):
        cur = input_ids.shape[1]
        want = reference[:, cur : cur + drafts.shape[1]]
        right = torch.rand(want.shape[1], generator=g) < hit
        out = drafts.clone()
        out[:, : want.shape[1]] = torch.where(right, want, (want + 1) % vocab)
        return out

    return override


def _first_divergence(a: torch.Tensor, b: torch.Tensor) -> int:
    n = min(a.shape[-1], b.shape[-1])
    diff = (a[..., :n] != b[..., :n]).flatten().nonzero()
    return int(diff[0]) if len(diff) else n


GREEDY = dict(do_sample=False, return_dict_in_generate=True)


# -- greedy: the same tokens and cache --------------------------------------------------------------------------------


@cpu_emulated
@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("moe, static_moe", [(False, False), (True, False), (True, True)],
                         ids=["dense", "moe", "moe-static-drafts"])
def test_greedy_tokens_and_cache_equal_non_speculative_and_stock(moe, static_moe, k, monkeypatch):
    """23 new tokens (not a multiple of k + 1): the head's own drafts (random: mostly rejected) and drafts half right
    (partial acceptances, so rollbacks to every prefix) give the non-speculative tokens, which are stock's, and the
    same returned cache; the MoE head drafting with stock's layer and on the static drafter (``STATIC_MOE_DRAFTS``)."""
    monkeypatch.setattr(import_module("fused_mtp_decode"), "STATIC_MOE_DRAFTS", static_moe)
    stock, fused = _pair(moe)
    ids = _prompt()
    with torch.no_grad():
        plain = fused.generate(ids, max_new_tokens=23, mtp_speculative_tokens=0, **GREEDY)
        assert torch.equal(plain.sequences, generate_stock(stock, ids, max_new_tokens=23, do_sample=False))
        for hit in (None, 0.5):
            drafts = spec.override_drafts(_oracle(plain.sequences, hit, k)) if hit else contextlib.nullcontext()
            with spec.record_rounds() as rounds, drafts:
                out = fused.generate(ids, max_new_tokens=23, mtp_speculative_tokens=k, **GREEDY)
            assert torch.equal(out.sequences, plain.sequences), hit
            assert rounds and max(d for d, _ in rounds) == min(k, 22)
            if hit:  # rounds with none, all and (k > 1) some drafts accepted
                assert any(n == 0 for _, n in rounds) and any(n == d for d, n in rounds), rounds
                assert k == 1 or any(0 < n < d for d, n in rounds), rounds
            got, want = cache_of(out), cache_of(plain)
            assert got.get_seq_length() == want.get_seq_length() == plain.sequences.shape[1] - 1
            assert_caches_close(got, want, fused.config.layer_types, CACHE_BOUND)
    states = fused._text_model().runner.decode_states.values()
    assert any(state.mtp_drafter is not None for state in states) == (not moe or static_moe)


@cpu_emulated
def test_composite_model_greedy_equal():
    """The composite (vision-language) class, as real checkpoints load: its text-only generate passes the prompt to
    the backbone as embeddings with mRoPE positions; drafts half right give the non-speculative tokens."""
    from helpers import composite_kwargs

    config = configuration.Qwen3_5FusedConfig(**composite_kwargs(mtp_num_hidden_layers=1), fused_kernels=True)
    torch.manual_seed(0)
    model = modeling.Qwen3_5FusedForConditionalGeneration(config).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1 and not name.startswith("model.visual"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.15)
    ids = _prompt(seed=9)
    kwargs = dict(max_new_tokens=17, do_sample=False, eos_token_id=None)
    with torch.no_grad():
        plain = model.generate(ids, mtp_speculative_tokens=0, **kwargs)
        for k in (1, 3):
            with spec.record_rounds() as rounds, spec.override_drafts(_oracle(plain, 0.5, k)):
                out = model.generate(ids, mtp_speculative_tokens=k, **kwargs)
            assert torch.equal(out, plain) and any(n for _, n in rounds), k


@cpu_emulated
@pytest.mark.parametrize("k", [1, 3])
def test_acceptance_bookkeeping(k):
    """Drafts that are the model's own greedy tokens are all accepted (a round emits k + 1 tokens); drafts that
    differ are all rejected (a round emits the model's one token). The tokens are the same either way."""
    _, fused = _pair(seed=3)
    ids = _prompt(seed=3)
    new = 14
    with torch.no_grad():
        plain = fused.generate(ids, max_new_tokens=new, mtp_speculative_tokens=0, eos_token_id=None, **GREEDY)
        assert plain.sequences.shape[1] == ids.shape[1] + new
        for hit in (1.0, 0.0):
            with spec.record_rounds() as rounds, spec.override_drafts(_oracle(plain.sequences, hit)):
                out = fused.generate(ids, max_new_tokens=new, mtp_speculative_tokens=k, eos_token_id=None, **GREEDY)
            assert torch.equal(out.sequences, plain.sequences)
            if hit:
                assert all(n == d for d, n in rounds) and len(rounds) == math.ceil((new - 1) / (k + 1)), rounds
            else:
                assert all(n == 0 for _, n in rounds) and len(rounds) == new - 1, rounds


@cpu_emulated
@pytest.mark.parametrize("take", ["all", "none", "one"])
def test_forced_acceptance_keeps_the_state_of_the_emitted_tokens(take):
    """The benchmark's ``force_acceptance`` (drafts kept whatever the model says): each round emits the kept drafts
    and the model's argmax after them, and the returned cache is stock's over the emitted sequence (so a forced
    round does a real round's work and leaves a consistent state)."""
    stock, fused = _pair(seed=5)
    ids = _prompt(seed=5)
    keep = {"all": lambda n, k: k, "none": lambda n, k: 0, "one": lambda n, k: min(1, k)}[take]
    with torch.no_grad():
        with spec.force_acceptance(keep), spec.record_rounds() as rounds:
            out = fused.generate(ids, max_new_tokens=11, mtp_speculative_tokens=2, eos_token_id=None, **GREEDY)
        assert rounds and all(n == keep(0, d) for d, n in rounds), rounds
        seq = out.sequences
        assert seq.shape[1] == ids.shape[1] + 11
        ref = run_stock(stock, seq[:, :-1], use_cache=True)
        assert int(ref.logits[0, -1].argmax()) == int(seq[0, -1])  # the last token: the model's own after the rest
        got = cache_of(out)
        assert got.get_seq_length() == seq.shape[1] - 1
        assert_caches_close(got, ref.past_key_values, fused.config.layer_types, CACHE_BOUND)


@cpu_emulated
@pytest.mark.parametrize("new", [1, 2, 3, 5, 6])
def test_max_new_tokens_is_never_passed(new):
    """k = 3 with every draft right: a round drafts at most what is left minus one, so exactly ``new`` tokens, the
    non-speculative ones, whatever ``new`` is against k + 1."""
    _, fused = _pair(seed=10)
    ids = _prompt(seed=10)
    with torch.no_grad():
        plain = fused.generate(ids, max_new_tokens=new, mtp_speculative_tokens=0, eos_token_id=None, **GREEDY)
        with spec.record_rounds() as rounds, spec.override_drafts(_oracle(plain.sequences, 1.0)):
            out = fused.generate(ids, max_new_tokens=new, mtp_speculative_tokens=3, eos_token_id=None, **GREEDY)
    assert out.sequences.shape[1] == ids.shape[1] + new and torch.equal(out.sequences, plain.sequences)
    assert sum(n + 1 for _, n in rounds) == new - 1 and all(d <= 3 for d, _ in rounds)
    assert cache_of(out).get_seq_length() == cache_of(plain).get_seq_length()


@cpu_emulated
def test_prefix_dependent_processors_see_each_positions_prefix():
    """Repetition penalty and no-repeat n-grams read the tokens before each position: the verify positions are
    processed with their own prefix (drafts included), so the greedy tokens stay the non-speculative ones."""
    _, fused = _pair(seed=11)
    ids = _prompt(seed=11)
    kwargs = dict(max_new_tokens=20, repetition_penalty=1.5, no_repeat_ngram_size=2, eos_token_id=None, **GREEDY)
    with torch.no_grad():
        plain = fused.generate(ids, mtp_speculative_tokens=0, **kwargs)
        with spec.record_rounds() as rounds, spec.override_drafts(_oracle(plain.sequences, 0.7)):
            out = fused.generate(ids, mtp_speculative_tokens=3, **kwargs)
    assert torch.equal(out.sequences, plain.sequences) and any(n > 1 for _, n in rounds)


class _StopAtLength(StoppingCriteria):
    def __init__(self, length: int):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


class _Recorder(BaseStreamer):
    def __init__(self):
        self.puts, self.ended = [], False

    def put(self, value):
        self.puts.append(value.tolist())

    def end(self):
        self.ended = True


@cpu_emulated
@pytest.mark.parametrize("stop", ["eos", "criterion"])
def test_a_stop_inside_a_round_ends_as_without_drafts(stop):
    """With every draft right (k = 3: rounds of 4 tokens), a stop on the 2nd token of a round: nothing after it is
    emitted, streamed or left in the cache, as without drafts."""
    _, fused = _pair(seed=1)
    ids = _prompt(seed=1)
    with torch.no_grad():
        reference = fused.generate(ids, max_new_tokens=30, mtp_speculative_tokens=0, eos_token_id=None, **GREEDY)
    generated = reference.sequences[0, ids.shape[1]:].tolist()
    # the stop on the 6th new token: the prompt's round gives token 1, rounds of 4 give 2-5 and 6-9
    at = 5
    kwargs = dict(max_new_tokens=30, **GREEDY)
    if stop == "eos":
        assert generated[at] not in generated[:at]
        kwargs["eos_token_id"] = generated[at]
    else:
        kwargs.update(eos_token_id=None, stopping_criteria=StoppingCriteriaList([_StopAtLength(ids.shape[1] + at + 1)]))
    runs = {}
    with torch.no_grad():
        for k in (0, 3):
            streamer = _Recorder()
            with spec.override_drafts(_oracle(reference.sequences, 1.0)):
                runs[k] = fused.generate(ids, mtp_speculative_tokens=k, streamer=streamer, **kwargs), streamer
    (plain, plain_stream), (out, out_stream) = runs[0], runs[3]
    assert plain.sequences.shape[1] == ids.shape[1] + at + 1
    assert torch.equal(out.sequences, plain.sequences)
    assert out_stream.puts == plain_stream.puts and out_stream.ended
    assert cache_of(out).get_seq_length() == cache_of(plain).get_seq_length() == plain.sequences.shape[1] - 1
    assert_caches_close(cache_of(out), cache_of(plain), fused.config.layer_types, CACHE_BOUND)


@cpu_emulated
def test_scores_and_logits_match_non_speculative():
    """``output_scores`` / ``output_logits``: one entry per emitted token, the non-speculative ones."""
    _, fused = _pair(seed=2)
    ids = _prompt(seed=2)
    kwargs = dict(max_new_tokens=10, output_scores=True, output_logits=True, **GREEDY)
    with torch.no_grad():
        plain = fused.generate(ids, mtp_speculative_tokens=0, **kwargs)
        with spec.override_drafts(_oracle(plain.sequences, 0.5)):
            out = fused.generate(ids, mtp_speculative_tokens=2, **kwargs)
    assert len(out.scores) == len(plain.scores) == len(out.logits) == plain.sequences.shape[1] - ids.shape[1]
    for got, want in zip(out.scores + out.logits, plain.scores + plain.logits):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # fp32 rounding order, as CACHE_BOUND


@cpu_emulated
def test_the_heads_cache_holds_the_true_pairs_only():
    """Each round's first draft equals the head run afresh (no cache) over the sequence so far, its hidden states
    from the model's forward: what the head's cache holds after crops and confirmations is exactly the true pairs."""
    _, fused = _pair(seed=4)
    ids = _prompt(seed=4)
    seen = []

    def keep(drafts, input_ids):
        seen.append((input_ids.clone(), drafts.clone()))
        return drafts

    with torch.no_grad():
        plain = fused.generate(ids, max_new_tokens=16, mtp_speculative_tokens=0, eos_token_id=None, **GREEDY)
        mixed = _oracle(plain.sequences, 0.6, seed=1)
        with spec.override_drafts(lambda d, i: mixed(keep(d, i), i)):
            fused.generate(ids, max_new_tokens=16, mtp_speculative_tokens=2, eos_token_id=None, **GREEDY)
        assert len(seen) > 3
        for input_ids, drafts in seen:
            hidden = fused.model.stock_forward(input_ids=input_ids[:, :-1]).last_hidden_state
            logits, _ = fused.mtp_draft(hidden, input_ids[:, 1:])
            assert int(logits[0, -1].argmax()) == int(drafts[0, 0])


@cpu_emulated
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe-static-drafts"])
def test_the_static_drafter_is_the_stock_head(moe, monkeypatch):
    """``fused_mtp_decode.MTPDecodeState`` (the head on fixed buffers with the fused decode ops, what the draft graphs
    replay) against the stock head run afresh over the whole sequence, fp32: the prompt's pairs fed through the stock
    head and copied in, then 1-3 pairs a call, each call also drafting 3 chained tokens whose cache rows the next
    call overwrites. Each call's draft logits are the stock head's (1e-4) at the last fed row and, for the chained
    drafts, over the sequence extended by them; the draft hidden states of fed rows agree to 1e-5. The MoE head's
    sparse block runs on it with ``STATIC_MOE_DRAFTS`` (on as shipped, set here). In a speculative generate the dense
    head drafts on it; the MoE head with the switch off drafts with stock's layer, said once and in describe()."""
    mtp_decode = import_module("fused_mtp_decode")
    monkeypatch.setattr(mtp_decode, "STATIC_MOE_DRAFTS", True)
    _, fused = _pair(moe=moe, seed=5)
    ids = _prompt(length=24, seed=5)
    embed, head = fused.get_input_embeddings(), fused.lm_head
    with torch.no_grad():
        hidden = fused.model.stock_forward(input_ids=ids[:, :-1]).last_hidden_state  # [1, 23, H]
        tokens = ids[:, 1:]
        reference = fused.mtp(hidden, tokens, embed)  # [1, 23, H], no cache
        assert mtp_decode.static_draft_blocker(fused) is None
        drafter = mtp_decode.MTPDecodeState(fused, max_len=64, max_rows=4)
        logits, draft = drafter.prefill(fused, hidden[:, :8], tokens[:, :8])
        torch.testing.assert_close(draft[0], reference[0, 7], atol=1e-5, rtol=1e-5)
        assert int(logits.argmax()) == int(head(reference[0, 7]).argmax())
        at, sizes = 8, [1, 3, 2, 1, 3, 2, 3]
        for size in sizes:
            got_logits = []
            drafts = drafter.draft(fused, hidden[:, at : at + size], tokens[:, at : at + size], 3,
                                   lambda lg, j: got_logits.append(lg[0]) or lg.argmax(dim=-1), prompt=False)
            at += size
            assert drafter.count == at
            # the chained drafts: the stock head over the true pairs, then its own draft hidden state and draft
            h, t = hidden[:, :at], tokens[:, :at]
            for j in range(3):
                out = fused.mtp(h, t, embed)
                torch.testing.assert_close(got_logits[j], head(out[0, -1]), atol=1e-4, rtol=1e-4)
                assert int(drafts[j]) == int(head(out[0, -1]).argmax()), (size, j)
                h, t = torch.cat([h, out[:, -1:]], dim=1), torch.cat([t, drafts[j].view(1, 1)], dim=1)
        drafter.set_count(at)
        rows = drafter.rows(fused, hidden[0, at - 2 : at], tokens[0, at - 2 : at], -2)  # the last two fed again
        torch.testing.assert_close(rows, reference[0, at - 2 : at], atol=1e-5, rtol=1e-5)
    assert drafter.moe == moe

    monkeypatch.setattr(mtp_decode, "STATIC_MOE_DRAFTS", False)
    for moe, expect in ((False, True), (True, False)):
        _, model = _pair(moe=moe, seed=6)
        with torch.no_grad():
            model.generate(_prompt(seed=6), max_new_tokens=6, mtp_speculative_tokens=2, **GREEDY)
        states = model._text_model().runner.decode_states.values()
        assert any(state.mtp_drafter is not None for state in states) == expect, moe
        drafting = model.describe()["mtp"]["speculative"]["drafting"]
        assert drafting.startswith("the head's layer with the decode step's kernels") == expect, drafting
    assert any(key.startswith("mtp/eager-draft/the head's layer has a mixture-of-experts MLP")
               for key in plan_mod.announced())


@cpu_emulated
def test_the_drafts_follow_the_heads_weights_and_saves_keep_them(tmp_path):
    """After a speculative generate has packed the head for its drafter: an in-place update of a head weight (as
    ``load_state_dict`` without ``assign`` makes) and a replaced one both reach the next call's drafts (each round's
    first draft is the head's afresh, as above); a save writes the head's current weights under its own keys."""
    from safetensors.torch import load_file

    _, fused = _pair(seed=7)
    ids = _prompt(seed=7)

    def first_drafts_are_the_heads():
        seen = []
        with torch.no_grad(), spec.override_drafts(lambda d, i: seen.append((i.clone(), d.clone())) or d):
            fused.generate(ids, max_new_tokens=10, mtp_speculative_tokens=2, eos_token_id=None, **GREEDY)
        assert len(seen) > 2
        for input_ids, drafts in seen:
            with torch.no_grad():
                hidden = fused.model.stock_forward(input_ids=input_ids[:, :-1]).last_hidden_state
                logits, _ = fused.mtp_draft(hidden, input_ids[:, 1:])
            if int(logits[0, -1].argmax()) != int(drafts[0, 0]):
                return False
        return True

    assert first_drafts_are_the_heads()
    attn, mlp = fused.mtp.layers[0].self_attn, fused.mtp.layers[0].mlp
    g = torch.Generator().manual_seed(8)
    state = {name: torch.randn(p.shape, generator=g) * 0.3 for name, p in fused.mtp.named_parameters()
             if name.endswith(("q_proj.weight", "k_proj.weight", "up_proj.weight"))}
    fused.mtp.load_state_dict(state, strict=False)  # in place: the parameters keep their storage
    assert first_drafts_are_the_heads()
    mlp.gate_proj.weight = torch.nn.Parameter(mlp.gate_proj.weight * -2.0)  # replaced
    attn.v_proj.weight.data.mul_(3.0)
    assert first_drafts_are_the_heads()
    fused.save_pretrained(tmp_path)
    saved = load_file(str(tmp_path / "model.safetensors"))
    for name, p in fused.mtp.named_parameters():
        assert torch.equal(saved["mtp." + name], p.detach()), name


@cpu_emulated
@needs_interpreter
def test_the_verify_pass_on_its_few_token_kernels(monkeypatch):
    """The verify pass's DeltaNet part on its Triton kernels (``causal_conv1d_steps``, ``gated_delta_rule_steps``,
    run by the interpreter; every other op on its reference) as the model wires them (views of the packed
    projection, the saved states the rollback reads): the tokens and the returned cache of the all-reference run,
    with drafts half right (partial rollbacks)."""
    fused_ops = import_module("fused_ops")
    _, fused = _pair(seed=4)
    ids = _prompt(seed=4)
    with torch.no_grad():
        plain = fused.generate(ids, max_new_tokens=12, mtp_speculative_tokens=0, **GREEDY)
        runs = []
        for kernels in (False, True):
            if kernels:
                ops = fused.fused_plan.ops
                for name in ("causal_conv1d_steps", "gated_delta_rule_steps"):
                    monkeypatch.setattr(ops, name, getattr(fused_ops, name))
            with spec.override_drafts(_oracle(plain.sequences, 0.5, seed=1)), spec.record_rounds() as rounds:
                runs.append(fused.generate(ids, max_new_tokens=12, mtp_speculative_tokens=3, **GREEDY))
            assert any(0 < n < d for d, n in rounds), rounds
    assert torch.equal(runs[1].sequences, runs[0].sequences) and torch.equal(runs[0].sequences, plain.sequences)
    assert_caches_close(cache_of(runs[1]), cache_of(runs[0]), fused.config.layer_types, CACHE_BOUND)


@cpu_emulated
@needs_interpreter
def test_the_verify_pass_runs_its_attention_at_once(monkeypatch):
    """``VERIFY_ATTENTION_AT_ONCE``: each attention layer of the verify pass preps the T tokens' keys into the cache at
    slot .. slot + T - 1 in one ``attn_prep`` and attends for the T tokens in one ``decode_attention`` (T rows over
    the one cache row, each through its own causal marks). On the references and then on the Triton kernels (the
    interpreter; every other op on its reference), with drafts half right (partial rollbacks): the tokens and the
    returned cache of the token-by-token pass, which are the non-speculative ones; the path is taken."""
    fused_ops, decode_mod = import_module("fused_ops"), import_module("fused_decode")
    _, fused = _pair(seed=5)
    ids = _prompt(seed=5)
    taken = []
    at_once = decode_mod.DecodeState._attention_verify_at_once

    def counting(self, *args):
        taken.append(args[3])  # T
        return at_once(self, *args)

    monkeypatch.setattr(decode_mod.DecodeState, "_attention_verify_at_once", counting)
    with torch.no_grad():
        plain = fused.generate(ids, max_new_tokens=12, mtp_speculative_tokens=0, **GREEDY)
        runs = []
        for setting in ("per-token", "at-once", "at-once-kernels"):
            monkeypatch.setattr(decode_mod, "VERIFY_ATTENTION_AT_ONCE", setting != "per-token")
            if setting == "at-once-kernels":
                ops = fused.fused_plan.ops
                for name in ("attn_prep", "decode_attention"):
                    monkeypatch.setattr(ops, name, getattr(fused_ops, name))
            taken.clear()
            with spec.override_drafts(_oracle(plain.sequences, 0.5, seed=2)), spec.record_rounds() as rounds:
                runs.append(fused.generate(ids, max_new_tokens=12, mtp_speculative_tokens=3, **GREEDY))
            assert any(0 < n < d for d, n in rounds), rounds
            assert bool(taken) == (setting != "per-token") and all(t > 1 for t in taken), (setting, taken)
            assert not taken or 4 in taken, taken
    for run in runs:
        assert torch.equal(run.sequences, plain.sequences)
    for run in runs[1:]:
        assert_caches_close(cache_of(run), cache_of(runs[0]), fused.config.layer_types, CACHE_BOUND)


@cpu_emulated
def test_rounds_run_on_the_device_when_the_host_needs_nothing_else(monkeypatch):
    """Greedy drafting without logits processors, stopped by EOS / ``max_new_tokens`` only, no scores asked: every
    round after the prompt's runs on the device (``MTPDecodeState.round_tail``: acceptance, rollback, the head's
    pairs and next drafts, one host read). A custom stopping criterion, a logits processor or scores keep the rounds
    on the host. The tokens are the non-speculative ones either way."""
    mtp_decode = import_module("fused_mtp_decode")
    calls = []
    tail = mtp_decode.MTPDecodeState.round_tail
    monkeypatch.setattr(mtp_decode.MTPDecodeState, "round_tail", lambda self, *a: calls.append(1) or tail(self, *a))
    _, fused = _pair(seed=9)
    ids = _prompt(seed=9)
    with torch.no_grad():
        plain = fused.generate(ids, max_new_tokens=20, mtp_speculative_tokens=0, **GREEDY)
        mixed = _oracle(plain.sequences, 0.5, seed=3)
        cases = {"device": {}, "criterion": {"stopping_criteria": StoppingCriteriaList([_StopAtLength(10**6)])},
                 "processor": {"repetition_penalty": 1.0 + 1e-9}, "scores": {"output_scores": True}}
        for name, extra in cases.items():
            calls.clear()
            with spec.override_drafts(mixed), spec.record_rounds() as rounds:
                out = fused.generate(ids, max_new_tokens=20, mtp_speculative_tokens=2, **GREEDY, **extra)
            assert torch.equal(out.sequences, plain.sequences), name
            if name == "device":
                assert len(calls) == len(rounds) - sum(1 for d, _ in rounds if d < 2) > 3, (calls, rounds)
                assert any(0 < n < 2 for _, n in rounds), rounds  # partial rollbacks on the device
            else:
                assert not calls, name


# -- sampling: the model's distribution -----------------------------------------------------------------------------


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's goodness-of-fit p-value of ``counts`` [V] against ``probs`` [V] (cells with expectation < 5 pooled)."""
    n = counts.sum()
    expected = probs * n
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]]) if small.any() else counts
    exp = torch.cat([expected[~small], expected[small].sum()[None]]) if small.any() else expected
    keep = exp > 0
    chi2 = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), chi2.double() / 2))


def _broken_accept(p_scores, drafts, q, do_sample):
    """The rule with its ratio inverted (min(1, q / p)): a plausible bug the test must catch."""
    p = torch.softmax(p_scores, dim=-1)
    if p.shape[1] == 1:  # no drafts
        return 0, torch.multinomial(p[:, 0], 1).squeeze(1)
    p_d = p[:, :-1].gather(-1, drafts[..., None]).squeeze(-1)
    q_d = q.gather(-1, drafts[..., None]).squeeze(-1)
    kept = torch.rand_like(p_d) * p_d < q_d
    n = int(kept.long().cumprod(dim=1).sum(dim=1).min())
    dist = p[:, n]
    if n < p.shape[1] - 1:
        dist = (dist - q[:, n]).clamp(min=0)
    return n, torch.multinomial(dist / dist.sum(-1, keepdim=True), 1).squeeze(1)


def _emitted_distribution(rule, samples: int = 6000, seed: int = 0):
    """The first two emitted tokens of ``rule`` over ``samples`` rounds of 2 drafts, on fixed synthetic p_0, p_1, p_2
    and draft distributions q_1, q_2 over 6 tokens (q far from p). Returns counts [2, 6] and the p's [2, 6]."""
    g = torch.Generator().manual_seed(seed)
    V = 6
    p_scores = torch.randn(1, 3, V, generator=g) * 1.5
    q = torch.softmax(torch.randn(1, 2, V, generator=g) * 1.5, dim=-1)
    p = torch.softmax(p_scores, dim=-1)
    counts = torch.zeros(2, V)
    torch.manual_seed(seed)
    for _ in range(samples):
        drafts = torch.stack([torch.multinomial(q[:, j], 1).squeeze(1) for j in range(2)], dim=1)
        n, last = rule(p_scores, drafts, q, True)
        tokens = torch.cat([drafts[:, :n], last[:, None]], dim=1)[0]
        counts[0, tokens[0]] += 1
        if len(tokens) > 1:
            counts[1, tokens[1]] += 1
    return counts, p[0, :2]


def test_speculative_sampling_rule_emits_the_models_distribution():
    """Token 1 of a round is distributed as p_0, token 2 (when token 1 was an accepted draft) as p_1: chi-square
    p-values above 1e-4 (a correct rule fails this 1 time in 10,000), while the rule with min(1, q / p) fails it by
    orders of magnitude (p-value below 1e-12)."""
    counts, p = _emitted_distribution(spec.accept)
    for i in range(2):
        assert _chi2_pvalue(counts[i], p[i]) > 1e-4, (i, counts[i], p[i])
    broken, p = _emitted_distribution(_broken_accept)
    assert min(_chi2_pvalue(broken[i], p[i]) for i in range(2)) < 1e-12


def test_greedy_rule():
    p_scores = torch.tensor([[[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]]])
    assert [(n, int(t)) for n, t in [spec.accept(p_scores, torch.tensor([[1, 0]]), None, False)]] == [(2, 2)]
    assert [(n, int(t)) for n, t in [spec.accept(p_scores, torch.tensor([[1, 2]]), None, False)]] == [(1, 0)]
    assert [(n, int(t)) for n, t in [spec.accept(p_scores, torch.tensor([[0, 0]]), None, False)]] == [(0, 1)]


# -- the switch -------------------------------------------------------------------------------------------------------


@cpu_emulated
def test_the_switch():
    """Default on CPU: off. The config field sets k (0: off); a generation-config field and the per-call argument
    override it, the argument first; a bad value is refused; describe() and one log line say what runs."""
    _, fused = _pair(seed=5)
    ids = _prompt(seed=5)
    kwargs = dict(max_new_tokens=6, do_sample=False)

    def drafted(**call):
        with spec.record_rounds() as rounds, torch.no_grad():
            fused.generate(ids, **kwargs, **call)
        return max((d for d, _ in rounds), default=0)

    assert fused.speculative_tokens() == 0 and drafted() == 0
    assert fused.describe()["mtp"]["speculative"]["tokens"] == 0
    assert "the default" in fused.describe()["mtp"]["speculative"]["reason"]
    assert drafted(mtp_speculative_tokens=2) == 2
    assert "mtp/speculative/2" in plan_mod.announced()
    fused.config.mtp_speculative_tokens = 3
    assert drafted() == 3 and fused.describe()["mtp"]["speculative"]["tokens"] == 3
    assert drafted(mtp_speculative_tokens=1) == 1 and drafted(mtp_speculative_tokens=0) == 0
    assert drafted(generation_config=GenerationConfig(**kwargs, mtp_speculative_tokens=2)) == 2
    fused.config.mtp_speculative_tokens = 0
    assert drafted() == 0 and fused.describe()["mtp"]["speculative"]["reason"].startswith("mtp_speculative_tokens")
    with pytest.raises(ValueError, match="mtp_speculative_tokens"):
        fused.generate(ids, mtp_speculative_tokens=-1, **kwargs)


@cpu_emulated
def test_no_head_no_speculation():
    """A model without a head (mtp_num_hidden_layers 0, or a checkpoint without mtp.*) never drafts, whatever k."""
    _, fused = _pair(seed=6, head=False)
    ids = _prompt(seed=6)
    assert fused.mtp is None and fused.describe()["mtp"] is None
    with spec.record_rounds() as rounds, torch.no_grad():
        out = fused.generate(ids, max_new_tokens=5, do_sample=False, mtp_speculative_tokens=2)
    assert not rounds and out.shape[1] == ids.shape[1] + 5


@cpu_emulated
def test_batch_of_two_decodes_without_drafts_said_once():
    """Batch > 1: the non-speculative fused loop, the same tokens, one log line."""
    _, fused = _pair(seed=7)
    ids = torch.cat([_prompt(seed=7), _prompt(seed=8)])
    with torch.no_grad():
        plain = fused.generate(ids, max_new_tokens=6, do_sample=False, mtp_speculative_tokens=0)
        with spec.record_rounds() as rounds:
            out = fused.generate(ids, max_new_tokens=6, do_sample=False, mtp_speculative_tokens=2)
    assert not rounds and torch.equal(out, plain)
    assert any(key.startswith("mtp/speculative-off/the batch has 2 rows") for key in plan_mod.announced())


@cpu_emulated
@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampling"])
def test_a_call_whose_drafts_miss_hands_over_to_plain_decode(sample):
    """A random head's drafts miss: after ``PROBE_ROUNDS`` rounds of one token each (less than a round costs), the
    call decodes on without drafts, said once. Greedy: the tokens, scores and returned cache are the non-speculative
    ones. Sampling: as many tokens and scores, and a cache that holds them (the draws differ from a plain call's: the
    rounds drew from the generator in another order). Under a benchmark's or a test's hook the call speculates to its
    end."""
    _, fused = _pair(seed=11)
    ids = _prompt(seed=11)
    new = 20
    kwargs = dict(max_new_tokens=new, eos_token_id=None, output_scores=True, **GREEDY)
    if sample:
        kwargs.update(do_sample=True, top_k=4)
    with torch.no_grad():
        torch.manual_seed(0)
        plain = fused.generate(ids, mtp_speculative_tokens=0, **kwargs)
        torch.manual_seed(0)
        with spec.record_rounds() as rounds:
            out = fused.generate(ids, mtp_speculative_tokens=2, **kwargs)
        assert len(rounds) == spec.PROBE_ROUNDS and sum(n for _, n in rounds) == 0, rounds
        assert any(key.startswith("mtp/gave-up/2") for key in plan_mod.announced())
        assert out.sequences.shape == plain.sequences.shape and len(out.scores) == new
        got = cache_of(out)
        assert got.get_seq_length() == out.sequences.shape[1] - 1
        if not sample:
            assert torch.equal(out.sequences, plain.sequences)
            assert_caches_close(got, cache_of(plain), fused.config.layer_types, CACHE_BOUND)
            for a, b in zip(out.scores, plain.scores):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        with spec.override_drafts(_oracle(plain.sequences, 0.0)), spec.record_rounds() as rounds:
            fused.generate(ids, mtp_speculative_tokens=2, **kwargs)
        assert len(rounds) > spec.PROBE_ROUNDS, rounds



@cpu_emulated
def test_each_head_is_charged_its_own_cost(monkeypatch):
    """A head that drafts with stock's layer, eagerly, costs more than a round can emit (35B-A3B's figures): its call
    hands over after ``PROBE_ROUNDS`` rounds even when every draft is right, where a dense head's round of k + 1
    tokens on the static drafter pays. A MoE head on the static drafter sits between (its verify pass reads the
    experts of every token): a round of one draft never pays, a round of 2 or more whose drafts are all right does.
    ``speculative_sample`` charges each head its own: the dense head static, the MoE head static with
    ``STATIC_MOE_DRAFTS`` on (as shipped) and eager with it off."""
    for k in (1, 2, 3, 5):
        for eager, moe, gives_up in ((False, False, False), (True, False, True), (True, True, True),
                                     (False, True, k == 1)):
            governor = spec.Governor(k, active=True, eager=eager, moe=moe)
            assert [governor.gives_up(k + 1) for _ in range(spec.PROBE_ROUNDS)][-1] == gives_up, (k, eager, moe)
    assert spec.round_cost(5, eager=False) == pytest.approx(spec.ROUND_COST_STEPS[3] + 2 * 0.3)
    assert spec.round_cost(5, eager=False, moe=True) == pytest.approx(spec.MOE_ROUND_COST_STEPS[3] + 2 * 0.7)
    built = []
    governor_cls = spec.Governor

    def spy(k, active, eager=False, moe=False):
        built.append((eager, moe))
        return governor_cls(k, active, eager, moe)

    monkeypatch.setattr(spec, "Governor", spy)
    mtp_decode = import_module("fused_mtp_decode")
    assert mtp_decode.STATIC_MOE_DRAFTS is True  # as shipped
    for moe, static_moe, expect in ((False, True, (False, False)), (True, True, (False, True)),
                                    (True, False, (True, False))):
        monkeypatch.setattr(mtp_decode, "STATIC_MOE_DRAFTS", static_moe)
        _, model = _pair(moe=moe, seed=6)
        with torch.no_grad():
            model.generate(_prompt(seed=6), max_new_tokens=6, mtp_speculative_tokens=2, **GREEDY)
        assert built[-1] == expect, (moe, static_moe, built)

# -- the shipped checkpoint -------------------------------------------------------------------------------------------


@pytest.fixture
def shipped(fused_on_cpu):
    from transformers import AutoTokenizer

    config = configuration.Qwen3_5FusedConfig.from_pretrained(str(REPO))
    model = modeling.Qwen3_5FusedForCausalLMLoader.from_pretrained(str(REPO), config=config, dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(str(REPO))


def _heldout_prompts(tokenizer, count: int = 3, length: int = 24) -> list[torch.Tensor]:
    text = (REPO / "data" / "heldout.txt").read_text(encoding="utf-8")
    ids = tokenizer(text[:20000], return_tensors="pt").input_ids
    step = ids.shape[1] // count
    return [ids[:, i * step : i * step + length] for i in range(count)]


def test_shipped_checkpoint_greedy_equal_and_drafts_accepted(shipped):
    """Held-out prompts, 40 new tokens, k = 1..3: the non-speculative fused tokens, which are stock's; the trained
    head's drafts accepted at a rate near the trained one (training_report.json: 60.6% at T=0, first draft)."""
    from transformers import AutoModelForCausalLM

    model, tokenizer = shipped
    stock = AutoModelForCausalLM.from_pretrained(str(REPO), dtype=torch.float32)
    accepted = drafted = 0
    with torch.no_grad():
        for ids in _heldout_prompts(tokenizer):
            plain = model.generate(ids, max_new_tokens=40, do_sample=False, mtp_speculative_tokens=0)
            assert torch.equal(plain, generate_stock(stock, ids, max_new_tokens=40, do_sample=False))
            for k in (1, 2, 3):
                with spec.record_rounds() as rounds:
                    out = model.generate(ids, max_new_tokens=40, do_sample=False, mtp_speculative_tokens=k)
                assert torch.equal(out, plain), k
                if k == 1:
                    accepted += sum(n for _, n in rounds)
                    drafted += sum(d for d, _ in rounds)
    assert 0.35 < accepted / drafted, (accepted, drafted)


def _check_pipelined_stops(model, ids, monkeypatch) -> None:
    """Greedy rounds on the device are pipelined (the next round's verify pass queued before a round is read): with
    the trained head (rounds of several tokens) and EOS set to each new token in turn, the sequence and the returned
    cache are those of the non-speculative call with that EOS, whether the stop falls inside a round or on its last
    token, both undone after the next round has run (``rollback(..., overrun=True)``)."""
    decode = import_module("fused_decode")
    undone, queued = [], []
    rollback, verify = decode.DecodeState.rollback, spec.verify_logits

    def spy_rollback(self, verified, keep, first_slot, overrun=False):
        if overrun:
            undone.append((keep, verified.hidden.shape[1]))
        return rollback(self, verified, keep, first_slot, overrun)

    def spy_verify(*args, ahead=0, **kwargs):
        if ahead:
            queued.append(ahead)
        return verify(*args, ahead=ahead, **kwargs)

    monkeypatch.setattr(decode.DecodeState, "rollback", spy_rollback)
    monkeypatch.setattr(spec, "verify_logits", spy_verify)
    monkeypatch.setattr(spec, "PROBE_ROUNDS", 10**6)  # every round speculative, whatever the head's acceptance
    with torch.no_grad():
        free = model.generate(ids, max_new_tokens=24, mtp_speculative_tokens=0, eos_token_id=None, **GREEDY)
        new = free.sequences[0, ids.shape[1]:].tolist()
        stops = [at for at in range(1, len(new)) if new[at] not in new[:at]]
        for k in (2, 3):
            for at in stops:
                kwargs = dict(max_new_tokens=24, eos_token_id=new[at], **GREEDY)
                plain = model.generate(ids, mtp_speculative_tokens=0, **kwargs)
                out = model.generate(ids, mtp_speculative_tokens=k, **kwargs)
                assert plain.sequences.shape[1] == ids.shape[1] + at + 1
                assert torch.equal(out.sequences, plain.sequences), (k, at)
                assert cache_of(out).get_seq_length() == plain.sequences.shape[1] - 1
                assert_caches_close(cache_of(out), cache_of(plain), model.config.get_text_config().layer_types,
                                    CACHE_BOUND)
    assert queued, "no round was pipelined"
    assert any(keep < T - 1 for keep, T in undone), undone  # a stop inside a round, after the next one ran
    assert any(keep == T - 1 for keep, T in undone), undone  # a stop on a round's last token, the same


def test_pipelined_rounds_stop_anywhere_in_a_round(shipped, monkeypatch):
    """``_check_pipelined_stops`` on the CPU emulation."""
    model, tokenizer = shipped
    _check_pipelined_stops(model, _heldout_prompts(tokenizer, count=1)[0], monkeypatch)


def _sampling_pvalue(model, ids, runs: int = 400) -> float:
    """Sampling (top_k=3, temperature 1.5), 4 new tokens: the joint distribution of new tokens 2-3 (drafted by the
    head with k = 2 and verified) from ``runs`` speculative runs against ``runs`` non-speculative ones, one seed each;
    returns the two-sample chi-square p-value. Asserts that the head's drafts were both accepted and rejected (both
    paths of the rule taken)."""
    kwargs = dict(max_new_tokens=4, do_sample=True, top_k=3, temperature=1.5)
    samples = {}
    with torch.no_grad():
        for k in (0, 2):
            with spec.record_rounds() as rounds:
                outs = []
                for seed in range(runs):
                    torch.manual_seed(10_000 * k + seed)
                    outs.append(tuple(model.generate(ids, mtp_speculative_tokens=k, **kwargs)[0, -3:-1].tolist()))
            samples[k] = outs
            if k:
                assert 0 < sum(n for _, n in rounds) < sum(d for d, _ in rounds)
    cells = sorted(set(samples[0]) | set(samples[2]))
    a = torch.tensor([samples[0].count(c) for c in cells], dtype=torch.float64)
    b = torch.tensor([samples[2].count(c) for c in cells], dtype=torch.float64)
    pooled = (a + b) / (2 * runs)
    # two samples of equal size: chi2 = sum (a - b)^2 / (a + b), df = cells - 1 (cells pooled below 5 expected)
    small = pooled * runs < 5
    if small.any():
        a = torch.cat([a[~small], a[small].sum()[None]])
        b = torch.cat([b[~small], b[small].sum()[None]])
    chi2 = ((a - b) ** 2 / (a + b)).sum()
    pvalue = float(torch.special.gammaincc(torch.tensor((len(a) - 1) / 2, dtype=torch.float64), chi2 / 2))
    print("sampling p-value", pvalue, "cells", len(a))
    return pvalue


@pytest.mark.slow
def test_shipped_checkpoint_sampling_distribution(shipped):
    """The speculative samples of the shipped model (``_sampling_pvalue``: 400 runs each way) cannot be told from its
    non-speculative ones: a two-sample chi-square p-value above 1e-4."""
    model, tokenizer = shipped
    ids = _heldout_prompts(tokenizer, count=1)[0]
    assert _sampling_pvalue(model, ids) > 1e-4


# -- on the GPU (run with `python -m pytest -m cuda`) ------------------------------------------------------------------


def _shipped_on_gpu(dtype):
    config = configuration.Qwen3_5FusedConfig.from_pretrained(str(REPO))
    model = modeling.Qwen3_5FusedForCausalLMLoader.from_pretrained(str(REPO), config=config, dtype=dtype)
    return model.to("cuda").eval()


@pytest.mark.cuda
def test_gpu_greedy_fp32_equal_non_speculative():
    """The real kernels (verify pass included) in fp32: speculative greedy tokens equal the non-speculative ones."""
    from transformers import AutoTokenizer

    model = _shipped_on_gpu(torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(REPO))
    with torch.no_grad():
        for ids in _heldout_prompts(tokenizer):
            ids = ids.cuda()
            plain = model.generate(ids, max_new_tokens=64, do_sample=False, mtp_speculative_tokens=0)
            for k in (1, 2, 3):
                assert torch.equal(model.generate(ids, max_new_tokens=64, do_sample=False, mtp_speculative_tokens=k),
                                   plain), k


@pytest.mark.cuda
def test_gpu_pipelined_rounds_stop_anywhere_in_a_round(monkeypatch):
    """``_check_pipelined_stops`` in fp32 on the GPU, where the verify passes and the tails replay their graphs (two
    buffer sets a length) and the round's results come back through pinned memory."""
    from transformers import AutoTokenizer

    model = _shipped_on_gpu(torch.float32)
    ids = _heldout_prompts(AutoTokenizer.from_pretrained(str(REPO)), count=1)[0].cuda()
    _check_pipelined_stops(model, ids, monkeypatch)
    states = model._text_model().runner.decode_states.values()
    assert all(any(state.verify_graphs.get((4, b)) for state in states) for b in (0, 1))
    assert any(state.mtp_drafter is not None and any(state.mtp_drafter.tails.values()) for state in states)


@pytest.mark.cuda
def test_gpu_sampling_distribution():
    """The sampling test on the H200, fp32, with the real kernels and graphs (the verify pass's, the decode step's;
    sampled drafts run the head eagerly): 400 speculative runs (k = 2) against 400 non-speculative ones of the
    shipped model, a two-sample chi-square p-value above 1e-4."""
    from transformers import AutoTokenizer

    model = _shipped_on_gpu(torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(REPO))
    ids = _heldout_prompts(tokenizer, count=1)[0].cuda()
    assert _sampling_pvalue(model, ids) > 1e-4


@pytest.mark.cuda
def test_gpu_greedy_bf16_diverges_no_earlier_than_non_speculative():
    """bf16, 12 held-out prompts: against the fp32 non-speculative tokens, the speculative bf16 tokens (k = 2) part
    no earlier on average than the non-speculative bf16 ones, up to the spread of that average. The verify pass sums
    each linear over k + 1 rows where a step sums one, so a prompt's first parting moves either way (one H200 run: the
    54th new token against none in 64 on one prompt); a verify pass that computed wrong values would part within a
    few tokens everywhere."""
    from transformers import AutoTokenizer

    reference_model = _shipped_on_gpu(torch.float32)
    model = _shipped_on_gpu(torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(str(REPO))
    new, spec_at, plain_at = 64, [], []
    with torch.no_grad():
        for ids in _heldout_prompts(tokenizer, count=12):
            ids = ids.cuda()
            reference = reference_model.generate(ids, max_new_tokens=new, do_sample=False, mtp_speculative_tokens=0)
            plain = model.generate(ids, max_new_tokens=new, do_sample=False, mtp_speculative_tokens=0)
            out = model.generate(ids, max_new_tokens=new, do_sample=False, mtp_speculative_tokens=2)
            plain_at.append(_first_divergence(plain, reference) - ids.shape[1])
            spec_at.append(_first_divergence(out, reference) - ids.shape[1])
    mean = lambda v: sum(v) / len(v)  # noqa: E731
    spread = (sum((a - b) ** 2 for a, b in zip(spec_at, plain_at)) / len(spec_at)) ** 0.5 / len(spec_at) ** 0.5
    print("first parting (new tokens), speculative:", spec_at, "non-speculative:", plain_at)
    assert mean(spec_at) >= mean(plain_at) - 2 * spread - 1, (spec_at, plain_at)


@pytest.mark.cuda
@pytest.mark.parametrize("moe, static_moe, at_once", [(False, False, False), (True, False, False), (True, True, False),
                                                      (False, False, True)],
                         ids=["dense", "moe", "moe-static-drafts", "dense-attention-at-once"])
def test_gpu_verify_graphs_give_the_non_speculative_tokens_and_cache(moe, static_moe, at_once, monkeypatch):
    """fp32, a random model and head on the GPU, drafts half right (rollbacks to every prefix), each round's drafts a
    new tensor: the verify pass runs from its CUDA graph per length (captured on that length's second pass, replayed
    after), the static drafter's rounds (the dense head's; the MoE head's with ``STATIC_MOE_DRAFTS``) from their tail
    graph per length (which must read the drafts it is given, not those at the address it was captured with), and
    the tokens and the returned cache are the non-speculative ones; after a weight is replaced, the next call
    captures again and follows the new weights (a stale graph would still read the old ones). Also with the verify
    pass's attention run once for its tokens (``VERIFY_ATTENTION_AT_ONCE``)."""
    monkeypatch.setattr(import_module("fused_mtp_decode"), "STATIC_MOE_DRAFTS", static_moe)
    monkeypatch.setattr(import_module("fused_decode"), "VERIFY_ATTENTION_AT_ONCE", at_once)
    _, fused = _pair(moe)
    fused = fused.cuda()
    ids = _prompt().cuda()
    with torch.no_grad():
        for change in (False, True):
            if change:
                mlp = fused.model.layers[0].mlp
                proj = mlp.down_proj if hasattr(mlp, "down_proj") else mlp.shared_expert.down_proj
                proj.weight = torch.nn.Parameter(proj.weight * -1.5)
            plain = fused.generate(ids, max_new_tokens=30, mtp_speculative_tokens=0, **GREEDY)
            for k in (1, 3):
                for _ in range(2):  # the second call replays graphs captured by the first
                    oracle, made = _oracle(plain.sequences.cpu(), 0.5, k), []

                    def override(drafts, input_ids):  # every round's drafts at a new address (all kept alive)
                        made.append(oracle(drafts, input_ids))
                        return made[-1]

                    with spec.record_rounds() as rounds, spec.override_drafts(override):
                        out = fused.generate(ids, max_new_tokens=30, mtp_speculative_tokens=k, **GREEDY)
                    assert torch.equal(out.sequences, plain.sequences), (change, k)
                    assert any(0 < n for _, n in rounds) and any(n < d for d, n in rounds), rounds
                    states = fused._text_model().runner.decode_states.values()
                    assert any(state.verify_graphs.get((k + 1, b)) for state in states for b in (0, 1)), k
                    # the static drafter's rounds run on the device, from a tail graph per length; the MoE head's
                    # without it on the host, drafting eagerly
                    drafters = [state.mtp_drafter for state in states if state.mtp_drafter is not None]
                    assert any(any(d.tails.values()) for d in drafters) == (not moe or static_moe), k
                    assert_caches_close(cache_of(out), cache_of(plain), fused.config.layer_types, CACHE_BOUND)
