# Copyright 2026 The Qwen3.5 fused-kernels authors. Licensed under the Apache License, Version 2.0.
"""Self-speculative ``generate``: the MTP head (``fused_mtp``) drafts k tokens, the fused model verifies them in one
pass over k + 1 tokens, and the longest accepted prefix plus the model's own next token are emitted.

One round, with ``x`` the last chosen token (not yet fed to the backbone)::

    d_1 .. d_k = MTP chain from (h, x)           # the head's own draft hidden state + drafted token feed the next draft
    h_0 .. h_k, p_0 .. p_k = verify([x, d_1 .. d_k])   # DecodeState.verify: one pass, per-token states kept aside
    n = accepted drafts                          # greedy: d_i == argmax p_{i-1}; sampling: r < min(1, p(d) / q(d))
    emit d_1 .. d_n, then argmax / a sample of p_n (sampling, after a rejection: of norm(max(p_n - q_{n+1}, 0)))
    roll the backbone back to after x, d_1 .. d_n (DecodeState.rollback: saved states copied back)

The sampling rule is the standard one (Leviathan et al. 2023; transformers' ``_speculative_sampling``), so every
emitted token is distributed as the model's own ``p`` after the logits processors; greedy emits exactly the tokens
of the non-speculative loop.

State rollback: the verify pass keeps the DeltaNet conv and recurrent state after each of its first k tokens (k + 1
copies of a few MB at most, for k <= 3); a partial acceptance copies the one it needs back, and the K/V written for
rejected tokens are masked and overwritten later. Nothing is recomputed, where a snapshot-and-replay rollback would
run the accepted tokens a second time.

The head's cache holds only positions whose inputs are true: the backbone's hidden state at t and the emitted token
t + 1. Each round first feeds it the pairs the last round confirmed (after the prompt: the whole prompt), whose last
row gives the first draft; the chained steps' entries are cropped off (a ``DynamicCache``) or overwritten by the
next round's pairs (the static drafter, ``fused_mtp_decode``).

Rounds on the device: for greedy decoding without logits processors, stopped by EOS and ``max_new_tokens`` only,
with no scores asked, each round after the prompt's is the verify pass (its graph) then one tail on the device
(``MTPDecodeState.round_tail``, a graph per length): acceptance, the next token, the rollback to after it, the head
fed the confirmed pairs and k new drafts, written where the next verify pass reads them. The rounds are pipelined:
round r + 1's verify pass is queued (into the other of two verify buffer sets) before round r's results are read
through pinned memory, so the GPU runs it while the host checks round r's tokens for EOS and the length; a stop found
in round r rolls the backbone back from the states round r's pass kept, undoing round r + 1. Near ``max_length``,
and with a draft override, a round is read before the next is queued. Anything else runs the round on the host
(below).

Stopping criteria, EOS, ``max_new_tokens`` (a round drafts at most what is left minus one), streamers, scores and
the returned cache are as in ``fused_generate.fused_sample``: the tokens of a round are checked one by one (one
host read per round) and nothing after a stop is emitted, streamed or left in the cache.
"""

import contextlib
import contextvars

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import DynamicCache
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

from .fused_compat import run_prefill
from .fused_decode import FusedDecodeCache
from .fused_generate import decode_loop, finish_generate, next_logits, stop_rows
from .fused_mtp_decode import MTPDecodeState, static_draft_blocker
from .fused_plan import announce

SPECULATIVE_TOKENS_FIELD = "mtp_speculative_tokens"  # the config / generation-config field and generate() argument
# Drafted tokens a round when neither the call nor the config says, on a GPU (0 on CPU, where the fused path is only
# the tests' emulation). 0: speculation is opt-in until the H200 measures it faster for the call shape (the verify
# pass runs from a CUDA graph per length, the head eagerly); then 2, as vLLM's and SGLang's Qwen3-Next / Qwen3.5 MTP
# examples set num_speculative_tokens.
DEFAULT_SPECULATIVE_TOKENS = 0
# What a round costs in plain decode steps when it emits one token (acceptance 0), by drafts a round: a call whose
# rounds emit fewer tokens than that on average after PROBE_ROUNDS rounds hands over to plain fused decode for the
# rest of it (said once). 4B on the H200, pipelined greedy rounds on the device (BENCHMARKS, "Speculative decoding"):
# 1.71, 1.83, 2.10 plain steps at k = 1, 2, 3; 9B and 27B cost less (1.2-1.8), 0.8B more (2.7-3.5: it never gains).
# Past k = 3: what the last draft added, for each further draft.
ROUND_COST_STEPS = {1: 1.7, 2: 1.8, 3: 2.1}
# The same for a head that drafts with stock's layer, eagerly (one the static drafter cannot run, or the MoE head
# with ``fused_mtp_decode.STATIC_MOE_DRAFTS`` off):
# 35B-A3B on the H200, 4.19, 4.48, 6.88 plain steps at k = 1, 2, 3, more than a round of k drafts can emit (k + 1), so
# such a call decodes on without drafts after its probe rounds (it was slower than plain decode at every acceptance).
EAGER_ROUND_COST_STEPS = {1: 4.2, 2: 4.5, 3: 6.9}
# The same for the MoE head on the static drafter (``fused_mtp_decode.STATIC_MOE_DRAFTS``): a verify pass over k + 1
# tokens reads the experts each of them picks, up to k + 1 times a plain step's, so its rounds cost more than a dense
# model's. 35B-A3B on an H100, a round's time at acceptance 0.8 (the higher of 0.8 and 1.0) over the plain step
# (2.830 ms): 2.31 / 2.85 / 3.56 plain steps at k = 1, 2, 3. A round of one draft never pays (it emits at most 2).
MOE_ROUND_COST_STEPS = {1: 2.3, 2: 2.9, 3: 3.6}
PROBE_ROUNDS = 4
# `generate(..., mtp_speculative_tokens=k)` for the call in progress (None: not given): the model's generate takes the
# argument (stock's model-kwargs check would refuse it) and its `_sample` hook reads it.
CALL_SPECULATIVE_TOKENS: contextvars.ContextVar = contextvars.ContextVar("qwen3_5_mtp_tokens", default=None)


def check_speculative_tokens(value, where: str) -> int | None:
    """``value`` as the number of drafted tokens (None: unset); ``ValueError`` naming ``where`` unless an int >= 0."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{SPECULATIVE_TOKENS_FIELD} ({where}) must be an int >= 0 (0 turns speculative decoding "
                         f"off), got {value!r}")
    return value


def speculative_tokens(model, generation_config=None) -> int:
    """How many tokens ``model``'s MTP head drafts a round in a fused ``generate`` (0: off), first of: the call's
    ``mtp_speculative_tokens=`` argument, the field of that name on ``generation_config``, on the model's config (or
    its text config); else ``DEFAULT_SPECULATIVE_TOKENS`` on a GPU and 0 on CPU. 0 without an MTP head."""
    if getattr(model, "mtp", None) is None:
        return 0
    config = model.config
    for value, where in ((CALL_SPECULATIVE_TOKENS.get(), "generate() argument"),
                         (getattr(generation_config, SPECULATIVE_TOKENS_FIELD, None), "generation config"),
                         (getattr(config, SPECULATIVE_TOKENS_FIELD, None), "config"),
                         (getattr(config.get_text_config(), SPECULATIVE_TOKENS_FIELD, None), "text config")):
        value = check_speculative_tokens(value, where)
        if value is not None:
            return value
    return DEFAULT_SPECULATIVE_TOKENS if model.fused_plan.device.type == "cuda" else 0


def describe_speculative(model) -> dict:
    """``describe()["mtp"]["speculative"]``: the drafts a round, what runs (and how the head drafts), when it falls
    back, and why it is off."""
    k = speculative_tokens(model)
    plan = model.fused_plan
    off = (f"{SPECULATIVE_TOKENS_FIELD} is 0 (the default: opt-in; a round pays only where the checkpoint's drafts "
           "are accepted often enough)")
    reason = plan.decode_reason if plan.decode_reason is not None else None if k else off
    blocker = static_draft_blocker(model)
    return {
        "tokens": k if reason is None else 0,
        "drafting": ("the head's layer with the decode step's kernels over K/V buffers of its own; greedy drafts "
                     "without logits processors from a CUDA graph per (pairs fed, drafts) with cuda_graphs on, the "
                     "rest eagerly" if blocker is None else f"stock's layer, eagerly, because {blocker}"),
        "path": ("generate() drafts k tokens a round with the head (chained on its own hidden state), verifies them in "
                 "one fused pass over k + 1 tokens (each linear once over the rows, the DeltaNet / attention steps "
                 "token by token, the state after each token kept for the rollback; one CUDA graph per k + 1 with "
                 "cuda_graphs on) and emits the accepted prefix "
                 "plus the model's next token; greedy: the non-speculative tokens, sampling: standard speculative "
                 f"sampling; a call whose first {PROBE_ROUNDS} rounds (and later) emit fewer tokens a round than a "
                 "round costs in plain steps decodes on without drafts" if reason is None else "off"),
        "falls_back": "batch > 1, a padded prompt, inputs_embeds, a model split over devices (non-speculative fused "
                      "decode, said once)",
        "reason": reason,
    }


def speculation_blocker(cache: FusedDecodeCache, input_ids, model_kwargs) -> str | None:
    """None when a fused ``generate`` on ``cache`` can decode speculatively, else why not."""
    if cache._state.batch != 1:
        return f"the batch has {cache._state.batch} rows (speculative decoding runs one row)"
    if cache._state.multi_device:
        return "the model is split over several devices"
    if model_kwargs.get("inputs_embeds") is not None or input_ids.shape[1] == 0:
        return "the prompt came as inputs_embeds (the MTP head needs its tokens)"
    mask = model_kwargs.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        return "the prompt is padded"
    return None


# A benchmark's hook on the drafts: fn(drafts [B, k], input_ids) -> drafts, applied after the head has drafted and
# before the verify step (so the work done is the same), to set the acceptance rate (scripts/benchmark_speculative.py).
_DRAFT_OVERRIDE: contextvars.ContextVar = contextvars.ContextVar("qwen3_5_draft_override", default=None)


# A benchmark's hook on the acceptance: fn(accepted n, drafted k) -> n' in 0..k, applied after the verify pass and
# before the emitted tokens are chosen (the work of the round is unchanged; the round emits n' drafts and the model's
# own token after them, and the state rolls back to there), to set the acceptance rate where the model's tokens
# cannot be known before its verify pass (a random model in bf16 parts from its own non-speculative run at near-ties).
_ACCEPT_OVERRIDE: contextvars.ContextVar = contextvars.ContextVar("qwen3_5_accept_override", default=None)


# Where the speculative loop reports each round's (drafted, accepted) counts, when a caller listens (tests, the
# benchmark): a list, appended to on the host (the counts are read there anyway).
_ROUNDS: contextvars.ContextVar = contextvars.ContextVar("qwen3_5_speculative_rounds", default=None)


@contextlib.contextmanager
def record_rounds():
    """Inside the block, the list of ``(drafted, accepted)`` per verify round of the speculative ``generate`` calls
    made in it (the prompt's round not counted)."""
    rounds = []
    token = _ROUNDS.set(rounds)
    try:
        yield rounds
    finally:
        _ROUNDS.reset(token)


@contextlib.contextmanager
def force_acceptance(fn):
    """Inside the block, greedy speculative rounds accept ``fn(n, k)`` of their k drafts (n: what the rule accepted;
    None for a round on the device, where ``fn`` is asked before the round runs), then emit the model's argmax after
    them: the round's work is a real round's, its tokens are not the model's."""
    token = _ACCEPT_OVERRIDE.set(fn)
    try:
        yield
    finally:
        _ACCEPT_OVERRIDE.reset(token)


@contextlib.contextmanager
def override_drafts(fn):
    """Inside the block, the speculative loop's drafts go through ``fn(drafts, input_ids)`` before verification."""
    token = _DRAFT_OVERRIDE.set(fn)
    try:
        yield
    finally:
        _DRAFT_OVERRIDE.reset(token)


def verify_logits(model, text_model, cache: FusedDecodeCache, tokens: torch.Tensor, buffers: int = 0,
                  ahead: int = 0):
    """The verify pass over ``tokens`` [B, T] on ``cache``: ``(logits [B, T, vocab] in the model's dtype, the
    ``Verified`` record)``, from the state's CUDA graph for (T, ``buffers``) when the cache runs graphs
    (``DecodeState.verify_graphed``: both live in the graph's memory until the next replay of that key). ``ahead``:
    tokens a round not yet read may still add before this pass (a pipelined round), counted in the room check. The
    LM head runs over the T rows through ``small_linear`` when it is a plain bias-free ``nn.Linear`` in the hidden
    state's dtype (as ``fused_generate.step_logits``), else as it is."""
    st = cache._buffers()
    if cache._seq_len + cache._pad + ahead + tokens.shape[1] > st.max_len:
        raise ValueError(f"The fused decode cache holds {st.max_len} tokens; a verify step of {tokens.shape[1]} "
                         f"after {cache._seq_len + cache._pad + ahead} does not fit.")
    head = model.lm_head

    def run(step_tokens):
        verified = st.verify(text_model, step_tokens)
        hidden = verified.hidden
        weight = getattr(head, "weight", None)
        if (type(head) is nn.Linear and head.bias is None and weight.dtype == hidden.dtype
                and weight.device == hidden.device):
            B, T = step_tokens.shape
            return st.ops.small_linear(hidden.reshape(B * T, -1), weight).view(B, T, -1), verified
        return head(hidden), verified

    return st.verify_graphed(text_model, tokens.to(st.device), run, head, cache._use_graph, buffers)


def read_later(packed: torch.Tensor, copies: dict, key):
    """Start copying ``packed`` (a round's int64 results) to the host without waiting: on CUDA into a pinned buffer
    of ``copies`` (one per ``key``, reused) with an event behind it. Returns the function that waits for that copy
    only (not for work queued after it) and gives the values as a list."""
    if packed.device.type != "cuda":
        values = packed.clone()  # `packed` may be a graph's output, which the next replay overwrites
        return values.tolist
    host = copies.get(key)
    if host is None or host.shape != packed.shape:
        host = copies[key] = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
    host.copy_(packed, non_blocking=True)
    event = torch.cuda.Event()
    event.record()

    def read():
        event.synchronize()
        return host.tolist()

    return read


def drafter_for(model, st, k: int):
    """The static drafter (``fused_mtp_decode.MTPDecodeState``) of decode state ``st`` for k drafts a round: kept on
    ``st`` across calls, made again for another length or a larger k, weights checked once per call. None when
    ``static_draft_blocker`` says the head cannot run on it (the eager stock head drafts then, said once)."""
    reason = static_draft_blocker(model)
    if reason is not None:
        announce(f"mtp/eager-draft/{reason}", f"Qwen3.5 fused: the MTP head drafts with stock's layer, eagerly, "
                 f"because {reason}.")
        return None
    drafter = st.mtp_drafter
    max_len = st.max_len + 2 * (k + 1)  # the head holds at most the backbone's tokens, plus a round's chained rows
    if drafter is None or drafter.max_len < max_len or drafter.max_rows < k + 1:
        st.mtp_drafter = drafter = MTPDecodeState(model, max_len, k + 1)
    drafter.refresh(model)
    return drafter


def _draft(model, drafter, mtp_cache: DynamicCache, pending_hidden, pending_tokens, k: int, input_ids,
           logits_processor, do_sample: bool, prompt: bool, use_graph: bool):
    """k chained drafts from the head: ``(drafts [B, k], q [B, k, vocab] float32 or None)``, q the distributions
    the drafts were sampled from (sampling only). ``prompt``: the pending pairs are the whole prompt's. With
    ``drafter`` (the static drafter), greedy drafting without processors after the prompt replays its graph;
    without, the stock head runs on ``mtp_cache``, which ends holding the pending (true) pairs only."""
    qs = []

    def choose(logits, j):  # logits [B, vocab] of draft j
        ids = torch.cat([input_ids, *(d[:, None] for d in drafted)], dim=-1)
        scores = logits_processor(ids, logits.float())
        if do_sample:
            q = F.softmax(scores, dim=-1)
            qs.append(q)
            token = torch.multinomial(q, num_samples=1).squeeze(1)
        else:
            token = torch.argmax(scores, dim=-1)
        drafted.append(token)
        return token

    drafted = []
    if drafter is not None:
        if not prompt and not do_sample and len(logits_processor) == 0:
            return drafter.draft_greedy(model, pending_hidden[0], pending_tokens[0], k, use_graph)[None], None
        drafter.draft(model, pending_hidden, pending_tokens, k, choose, prompt)
    else:
        layers = len(model.mtp.layers)
        logits, draft_hidden = model.mtp_draft(pending_hidden, pending_tokens, cache=mtp_cache)
        kept = [layer.get_seq_length() for layer in mtp_cache.layers]  # true pairs; chained entries go after drafting
        logits, draft_hidden = logits[:, -1], draft_hidden[:, -1:]
        for j in range(k):
            if j:
                logits, draft_hidden = model.mtp_draft(draft_hidden, drafted[-1][:, None], cache=mtp_cache,
                                                       layer=j % layers)
                logits = logits[:, -1]
            choose(logits, j)
        for i, layer in enumerate(mtp_cache.layers):
            extra = layer.get_seq_length() - (kept[i] if i < len(kept) else 0)
            if extra > 0:
                layer.crop(-extra)
    return torch.stack(drafted, dim=1), (torch.stack(qs, dim=1) if do_sample else None)


def device_round_stops(stopping_criteria, max_length) -> frozenset | None:
    """The EOS ids when every stopping criterion can be decided on the host from the round's read tokens (stock's
    ``MaxLengthCriteria`` within the model's positions, ``EosTokenCriteria``), which a round on the device needs;
    None otherwise (a custom criterion runs on the sequence: the rounds run on the host)."""
    eos = set()
    for c in stopping_criteria:
        if type(c) is MaxLengthCriteria:
            limit = c.max_position_embeddings
            if limit is not None and max_length is not None and max_length > limit:
                return None  # its one-time warning is the host loop's
        elif type(c) is EosTokenCriteria:
            eos.update(int(t) for t in c.eos_token_id.flatten().tolist())
        else:
            return None
    return frozenset(eos)


def accept(p_scores: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor | None, do_sample: bool):
    """The speculative acceptance rule for one row. ``p_scores`` [B, T, vocab] float32: the model's processed scores
    at the T verified positions; ``drafts`` [B, T - 1]; ``q`` [B, T - 1, vocab] the draft distributions (sampling).
    Returns ``(accepted drafts n (host int), the next token [B])``: greedy, n leading drafts equal the model's
    argmax and the next token is the argmax after them; sampling, draft i is kept with probability
    min(1, p(d_i) / q(d_i)), and the next token is sampled from norm(max(p - q, 0)) at the first rejection, from p
    after all k were kept."""
    T = p_scores.shape[1]
    if not do_sample:
        targets = torch.argmax(p_scores, dim=-1)  # [B, T]
        n = int((drafts == targets[:, :-1]).long().cumprod(dim=1).sum(dim=1).min()) if T > 1 else 0
        return n, targets[:, n]
    p = F.softmax(p_scores, dim=-1)  # [B, T, vocab]
    n = 0
    if T > 1:
        p_d = p[:, :-1].gather(-1, drafts[..., None]).squeeze(-1)  # [B, T - 1]
        q_d = q.gather(-1, drafts[..., None]).squeeze(-1)
        kept = torch.rand_like(p_d) * q_d < p_d  # r < p / q, without dividing (q_d > 0: d was drawn from q)
        n = int(kept.long().cumprod(dim=1).sum(dim=1).min())
    dist = p[:, n]
    if n < T - 1:
        residual = (dist - q[:, n]).clamp(min=0)
        total = residual.sum(dim=-1, keepdim=True)
        # total is 0 only where p == q, which no rejection can come from; kept as p against rounding
        dist = torch.where(total > 0, residual / total.clamp(min=torch.finfo(total.dtype).tiny), dist)
    return n, torch.multinomial(dist, num_samples=1).squeeze(1)


def round_cost(k: int, eager: bool, moe: bool = False) -> float:
    """What a round of ``k`` drafts costs in plain decode steps: ``ROUND_COST_STEPS``; ``EAGER_ROUND_COST_STEPS`` for
    a head that drafts eagerly with stock's layer; ``MOE_ROUND_COST_STEPS`` for a MoE head on the static drafter
    (``moe``); past the table, its last step."""
    table = EAGER_ROUND_COST_STEPS if eager else MOE_ROUND_COST_STEPS if moe else ROUND_COST_STEPS
    last = max(table)
    if k <= last:
        return table[k]
    return table[last] + (table[last] - table[last - 1]) * (k - last)


class Governor:
    """Whether a call's speculation pays: after ``PROBE_ROUNDS`` rounds, the mean tokens a round emitted against what
    a round costs in plain steps (:func:`round_cost`; ``eager``: the head drafts with stock's layer; ``moe``: a MoE
    head on the static drafter). Host ints only (the round's n is read anyway)."""

    def __init__(self, k: int, active: bool, eager: bool = False, moe: bool = False):
        self.k, self.active = k, active
        self.cost = round_cost(k, eager, moe)
        self.rounds = self.tokens = 0

    def gives_up(self, tokens: int) -> bool:
        """Count a round of ``tokens`` emitted; True when speculation should stop for the rest of the call."""
        self.rounds += 1
        self.tokens += tokens
        if not self.active or self.rounds < PROBE_ROUNDS or self.tokens >= self.cost * self.rounds:
            return False
        announce(f"mtp/gave-up/{self.k}", f"Qwen3.5 fused: speculative decoding stopped for the rest of a generate() "
                 f"call: its rounds of {self.k} draft(s) emitted {self.tokens / self.rounds:.2f} tokens on average "
                 f"over {self.rounds}, less than the {self.cost:.1f} plain steps a round costs; plain fused decode "
                 f"goes on (said once).")
        return True


def _hand_over(model, text_model, cache, input_ids, logits_processor, stopping_criteria, generation_config, streamer,
               scores, raw_logits):
    """Plain fused decode for the rest of the call: the last emitted token fed (the rounds leave the backbone before
    it), then ``fused_generate.decode_loop``."""
    logits = next_logits(model, text_model, text_model.runner, cache, input_ids[:, -1])
    return decode_loop(model, text_model, text_model.runner, cache, input_ids, logits, logits_processor,
                       stopping_criteria, generation_config, streamer, scores, raw_logits)


def speculative_sample(model, text_model, cache: FusedDecodeCache, k: int, input_ids, logits_processor,
                       stopping_criteria, generation_config, streamer, model_kwargs):
    """``fused_generate.fused_sample`` with k drafted tokens a round (see the module docstring), for one row;
    returns what stock ``_sample`` returns."""
    ret = generation_config.return_dict_in_generate
    scores = () if ret and generation_config.output_scores else None
    raw_logits = () if ret and generation_config.output_logits else None
    do_sample = generation_config.do_sample
    max_length = getattr(stopping_criteria, "max_length", None)
    override, forced, rounds = _DRAFT_OVERRIDE.get(), _ACCEPT_OVERRIDE.get(), _ROUNDS.get()
    if forced is not None and do_sample:
        raise ValueError("force_acceptance applies to greedy decoding only")
    st = cache._state

    prompt = {}

    def keep_hidden(module, args, out):  # returns None: the output goes on unchanged
        prompt.setdefault("hidden", out.last_hidden_state)

    hook = text_model.register_forward_hook(keep_hidden)
    try:
        outputs = run_prefill(model, input_ids, generation_config, model_kwargs)
    finally:
        hook.remove()
    p_logits = outputs.logits[:, -1:].to(device=input_ids.device)  # [B, 1, vocab]
    del outputs
    hidden = prompt["hidden"]  # [B, P, hidden]: the prompt's final-norm hidden states
    known_next = input_ids[:, 1:]  # the token after each row of `hidden` but the last
    mtp_cache = DynamicCache()
    drafter = drafter_for(model, st, k)
    eos = device_round_stops(stopping_criteria, max_length)
    device_rounds = (drafter is not None and not do_sample and len(logits_processor) == 0 and scores is None
                     and raw_logits is None and eos is not None)
    if device_rounds:
        drafter.forced.fill_(-1)  # the rule's acceptance unless a benchmark sets it (each round, below)
    drafts = input_ids[:, :0]
    # a benchmark's or a test's hook sets what the rounds do: the call speculates to its end then
    governor = Governor(k, active=forced is None and override is None, eager=drafter is None,
                        moe=drafter is not None and drafter.moe)
    q, verified, first_slot, buffers = None, None, 0, 0  # buffers: the verify buffer set `verified` lives in
    while True:
        cur = input_ids.shape[1]
        if device_rounds and verified is not None and drafts.shape[1] == k:
            # the whole round on the device (acceptance, rollback, the head's pairs and next drafts), one host read
            graph = st.verify_graphs.get((k + 1, buffers))
            if forced is not None:
                drafter.forced.fill_(forced(None, k))
            packed, following = drafter.tail(model, st, verified, p_logits, drafts, cache._use_graph,
                                             graphed=bool(graph) and graph.out[1] is verified)
            read = read_later(packed, drafter.host_copies, buffers)
            # The next round's verify pass goes in before this round is read (its input never left the device), into
            # the other buffer set, when it fits whatever this round emits: the GPU runs it while the host reads and
            # checks this round. A stop found in this round undoes it from this round's saved states.
            ahead = (override is None and (max_length is None or max_length - (cur + k + 1) - 1 >= k)
                     and cache._seq_len + cache._pad + 2 * (k + 1) <= st.max_len)
            if ahead:
                next_out = verify_logits(model, text_model, cache, following, buffers=1 - buffers, ahead=k + 1)
            values = read()
            n = values[0]
            emitted, stopped = 0, False
            for token in values[1 : n + 2]:  # nothing after a stop is emitted
                emitted += 1
                if token in eos or (max_length is not None and cur + emitted >= max_length):
                    stopped = True
                    break
            tokens = torch.tensor([values[1 : 1 + emitted]], dtype=input_ids.dtype, device=input_ids.device)
            input_ids = torch.cat([input_ids, tokens], dim=-1)
            if streamer is not None:
                for j in range(emitted):
                    streamer.put(tokens[:, j].cpu())
            if rounds is not None:
                rounds.append((k, n))
            if emitted < n + 1 or (stopped and ahead):  # back to after the emitted tokens but the last
                st.rollback(verified, emitted - 1, first_slot, overrun=ahead)
            cache._seq_len += emitted
            drafter.count += n + 1
            left = None if max_length is None else max_length - input_ids.shape[1]
            if stopped or left == 0:
                break
            if governor.gives_up(n + 1):
                if ahead:  # undo the round queued ahead: the backbone back to after this round's tokens but the last
                    st.rollback(verified, n, first_slot, overrun=True)
                return _hand_over(model, text_model, cache, input_ids, logits_processor, stopping_criteria,
                                  generation_config, streamer, scores, raw_logits)
            if ahead or left is None or left - 1 >= k:
                drafts = following[:, 1:]
                first_slot = cache._seq_len + cache._pad
                buffers = 1 - buffers
                if ahead:
                    p_logits, verified = next_out
                else:
                    if override is not None:
                        drafts = override(drafts.clone(), input_ids)
                    p_logits, verified = verify_logits(model, text_model, cache,
                                                       torch.cat([input_ids[:, -1:], drafts], dim=-1),
                                                       buffers=buffers)
                hidden = verified.hidden
                continue
            # near max_length the rounds draft fewer tokens, eagerly: the head's pairs are fed again there
            drafter.count -= n + 1
            known_next = input_ids[:, :0]
        else:
            ids = torch.cat([input_ids, drafts], dim=-1)
            p_scores = torch.stack([logits_processor(ids[:, : cur + i], p_logits[:, i].to(torch.float32, copy=True))
                                    for i in range(p_logits.shape[1])], dim=1)
            n, last = accept(p_scores, drafts, q, do_sample)
            if forced is not None and drafts.shape[1]:
                n = forced(n, drafts.shape[1])
                last = torch.argmax(p_scores[:, n], dim=-1)
            tokens = torch.cat([drafts[:, :n], last[:, None]], dim=-1)  # [B, n + 1]
            # the tokens one by one through the stopping criteria, read once: nothing after a stop is emitted
            running, seq = [], input_ids
            for j in range(n + 1):
                seq = torch.cat([seq, tokens[:, j : j + 1]], dim=-1)
                done = stop_rows(stopping_criteria, seq, scores)
                running.append(torch.ones_like(last, dtype=torch.bool) if done is None else ~done.bool())
            running = torch.stack(running).all(dim=1).tolist()
            emitted = running.index(False) + 1 if False in running else n + 1
            input_ids = seq[:, : cur + emitted]
            if scores is not None:
                scores += tuple(p_scores[:, :emitted].unbind(1))
            if raw_logits is not None:
                raw_logits += tuple(p_logits[:, :emitted].to(torch.float32, copy=True).unbind(1))  # graph memory
            if streamer is not None:
                for j in range(emitted):
                    streamer.put(tokens[:, j].cpu())
            if verified is not None and rounds is not None:
                rounds.append((drafts.shape[1], n))
            if verified is not None:  # the backbone ends after the emitted tokens but the last, as without drafts
                st.rollback(verified, emitted - 1, first_slot)
                cache._seq_len += emitted
            left = None if max_length is None else max_length - input_ids.shape[1]
            if False in running or left == 0:
                break
            if verified is not None and drafts.shape[1] and governor.gives_up(n + 1):
                return _hand_over(model, text_model, cache, input_ids, logits_processor, stopping_criteria,
                                  generation_config, streamer, scores, raw_logits)
        # the head's next pairs: the verified rows the emitted tokens follow (after the prompt: all of it)
        pending_hidden = hidden[:, : hidden.shape[1] - p_logits.shape[1] + emitted]
        pending_tokens = torch.cat([known_next, tokens[:, :emitted]], dim=-1)
        drafts_k = k if left is None else min(k, left - 1)
        if drafts_k:
            drafts, q = _draft(model, drafter, mtp_cache, pending_hidden, pending_tokens, drafts_k, input_ids,
                               logits_processor, do_sample, prompt=verified is None, use_graph=cache._use_graph)
            if override is not None:
                drafts = override(drafts, input_ids)
        else:
            drafts, q = input_ids[:, :0], None
        first_slot, buffers = cache._seq_len + cache._pad, 0
        p_logits, verified = verify_logits(model, text_model, cache, torch.cat([input_ids[:, -1:], drafts], dim=-1))
        hidden, known_next = verified.hidden, input_ids[:, :0]

    return finish_generate(input_ids, scores, raw_logits, cache, streamer, ret)
