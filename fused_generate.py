# Copyright 2026 The Qwen3.5 fused-kernels authors. Licensed under the Apache License, Version 2.0.
"""The fused ``generate`` loop: stock ``_sample``'s token rule over a :class:`FusedDecodeCache`, with the model call
reduced to one replayed step plus the LM head, and the all-rows-stopped check read from the host in batches.

Same outputs as stock ``_sample`` (sequences, scores, logits, streamer calls): logits processors, stopping criteria
(stock's max-length one decided on the host) and the padding of finished rows run as there, every step.
"""

import torch
import torch.nn.functional as F
from torch import nn

from .fused_compat import (
    GENERATE_OUTPUT_CACHE_FIELD,
    GenerateDecoderOnlyOutput,
    MaxLengthCriteria,
    pad_token_tensor,
    run_prefill,
)
from .fused_decode import DecodeState, FusedDecodeCache

# The host's all-rows-stopped check (EOS) reads the per-step flags in batches of this many steps, and reads a batch
# only once the next one is queued: it then waits on a copy the GPU made a batch earlier, while the GPU still has a
# batch of steps queued, so the check never leaves the GPU idle (reading each batch as soon as it was queued left the
# GPU idle while the host queued the next step: 0.004-0.022 ms per token at batch 1 on the H200). A finished batch
# runs at most 2 * STOP_CHECK_EVERY - 1 extra steps, which are cut from the output, so the result is stock's.
STOP_CHECK_EVERY = 8


class StopFlags:
    """Which rows of ``_fused_sample`` are still running after each step, read by the host a batch of steps at a time.

    ``add`` takes step ``steps``'s ``unfinished`` [B] bool (a new tensor each step: it is kept, not copied); every
    ``every`` steps the batch is reduced to one "any row running" flag per step in two launches, copied to the host
    without blocking it (pinned memory and an event on CUDA), and the batch before it is read (``lag=1``), or this
    batch at once (``lag=0``: a streamer waits for every token anyway). ``add(final=True)`` reads everything still
    pending. Returns the first step after which every row had stopped (the step stock stops after), or None."""

    def __init__(self, every: int, lag: int):
        self.every, self.lag = every, lag
        self.rows, self.queue = [], []  # queue: (host flags, event or None, steps of its first flag - 1)
        self.first = 0  # steps before self.rows[0]

    def add(self, unfinished: torch.Tensor, steps: int, final: bool = False) -> int | None:
        self.rows.append(unfinished)
        if not final and steps % self.every:
            return None
        flags = torch.stack(self.rows).any(dim=1)  # [steps of the batch]: some row still running
        if flags.is_cuda:
            host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
            host.copy_(flags, non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(flags.device))
        else:
            host, event = flags, None
        self.queue.append((host, event, self.first))
        self.rows, self.first = [], steps
        while self.queue and (final or len(self.queue) > self.lag):
            host, event, first = self.queue.pop(0)
            if event is not None:
                event.synchronize()
            running = host.tolist()
            if not all(running):
                return first + running.index(False) + 1
        return None


def step_logits(model, ops, hidden: torch.Tensor) -> torch.Tensor:
    """The LM head on a decode step's final-norm hidden state [B, 1, hidden] -> logits [B, 1, vocab]: through
    ``small_linear`` (cuBLAS or our GEMV, timed per shape; the GEMV read the 4B head at 281 us against cuBLAS's 306
    in a graph on the H200) when the head is a plain bias-free ``nn.Linear`` in the hidden state's dtype and device;
    any other head (a PEFT wrapper, a bias, a dispatched module) runs as it is."""
    head = model.lm_head
    weight = getattr(head, "weight", None)
    plain = type(head) is nn.Linear and head.bias is None
    if plain and weight.dtype == hidden.dtype and weight.device == hidden.device:
        B = hidden.shape[0]
        return ops.small_linear(hidden.view(B, -1), weight).view(B, 1, -1)
    return head(hidden)


def graph_head(model, text_model, state: DecodeState) -> nn.Linear | None:
    """The LM head when the decode step can run it itself: a plain bias-free ``nn.Linear`` in the step's dtype, on the
    device the step ends on (the final norm's). Anything else (a PEFT wrapper, a bias, a dispatched module) runs after
    the step, as it is (``step_logits``)."""
    head = model.lm_head
    weight = getattr(head, "weight", None)
    if type(head) is not nn.Linear or head.bias is not None or weight.dtype != state.dtype:
        return None
    return head if weight.device == text_model.norm.weight.device else None


def stop_rows(criteria: list, input_ids: torch.Tensor, scores) -> torch.Tensor | None:
    """Stock ``StoppingCriteriaList.__call__`` (the OR of every criterion) without stock's ``MaxLengthCriteria``,
    whose verdict the loop takes on the host (``at_max``): its all-rows tensor and the OR with it were two launches a
    step and a third for the list's starting ``False``. The criterion still runs where it would warn (a length past
    the model's ``max_position_embeddings``). None when no other criterion is given."""
    done = None
    for c in criteria:
        if type(c) is MaxLengthCriteria:
            limit = c.max_position_embeddings
            if limit is not None and input_ids.shape[1] > limit:
                c(input_ids, scores)  # its one-time warning
            continue
        verdict = c(input_ids, scores)
        done = verdict if done is None else done | verdict
    return done


def fused_sample(model, text_model, runner, cache: FusedDecodeCache, input_ids, logits_processor, stopping_criteria,
                 generation_config, streamer, model_kwargs):
    """Greedy / multinomial decoding on ``cache`` (see the module docstring); returns what stock ``_sample``
    returns."""
    ret = generation_config.return_dict_in_generate
    scores = () if ret and generation_config.output_scores else None
    raw_logits = () if ret and generation_config.output_logits else None
    outputs = run_prefill(model, input_ids, generation_config, model_kwargs)
    logits = outputs.logits[:, -1]
    del outputs
    return decode_loop(model, text_model, runner, cache, input_ids, logits, logits_processor, stopping_criteria,
                       generation_config, streamer, scores, raw_logits)


def decode_loop(model, text_model, runner, cache: FusedDecodeCache, input_ids, logits, logits_processor,
                stopping_criteria, generation_config, streamer, scores, raw_logits):
    """The loop of :func:`fused_sample` from ``logits`` [B, vocab], the next token's, with the cache holding the
    state after ``input_ids`` (the prompt's prefill, or a speculative call handing over mid-way, whose ``scores`` /
    ``raw_logits`` tuples, or None, it continues); returns what stock ``_sample`` returns."""
    pad = pad_token_tensor(generation_config)
    if pad is not None:
        pad = pad.to(input_ids.device)
    ret = generation_config.return_dict_in_generate
    keep_logits = scores is not None or raw_logits is not None
    # Stock turns each step's logits into float32 for the processors, the sampling and the outputs. A greedy step
    # that nothing else reads takes its argmax in the model's dtype: the same token (the conversion is exact and
    # keeps the order, NaN included), one launch less.
    to_float = keep_logits or generation_config.do_sample or len(logits_processor) > 0
    has_eos = any(hasattr(c, "eos_token_id") for c in stopping_criteria)
    max_length = getattr(stopping_criteria, "max_length", None)
    # A streamer waits for every token anyway; a returned cache must hold exactly the steps stock's holds (a batched
    # check would have run the state up to 2 * STOP_CHECK_EVERY - 1 steps past the stop): both check every step.
    early_stops = any(type(c) is not MaxLengthCriteria for c in stopping_criteria)  # EOS, stop strings, custom
    exact_stop = streamer is not None or (ret and early_stops)
    check_every = 1 if exact_stop else STOP_CHECK_EVERY
    unfinished = torch.ones(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    logits = logits.to(copy=True, dtype=torch.float32 if to_float else logits.dtype, device=input_ids.device)
    prompt_len = input_ids.shape[1]  # the loop's own start: its stop checks count from here
    stops = StopFlags(check_every, lag=0 if exact_stop else 1)
    stop_at = None
    while True:
        next_scores = logits_processor(input_ids, logits)
        if scores is not None:
            scores += (next_scores,)
        if raw_logits is not None:
            raw_logits += (logits,)
        if generation_config.do_sample:
            next_tokens = torch.multinomial(F.softmax(next_scores, dim=-1), num_samples=1).squeeze(1)
        else:
            next_tokens = torch.argmax(next_scores, dim=-1)
        if has_eos:  # stock's `next * unfinished + pad * (1 - unfinished)`, in one launch instead of four
            next_tokens = torch.where(unfinished, next_tokens, pad)
        input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
        done = stop_rows(stopping_criteria, input_ids, scores)
        if done is not None:
            unfinished = unfinished & ~done.bool()
        if streamer is not None:
            streamer.put(next_tokens.cpu())
        at_max = max_length is not None and input_ids.shape[1] >= max_length
        stop_at = stops.add(unfinished, input_ids.shape[1] - prompt_len, final=at_max)
        if stop_at is not None or at_max:
            break
        logits = next_logits(model, text_model, runner, cache, next_tokens).to(device=input_ids.device)
        if keep_logits:  # kept past the next step, which overwrites the graph's output buffer: a copy
            logits = logits.to(dtype=torch.float32, copy=True)
        elif to_float:
            logits = logits.float()

    if stop_at is not None and stop_at < input_ids.shape[1] - prompt_len:
        extra = input_ids.shape[1] - prompt_len - stop_at
        input_ids = input_ids[:, :-extra]
        scores = scores[:-extra] if scores is not None else None
        raw_logits = raw_logits[:-extra] if raw_logits is not None else None
        cache._overrun = True
    return finish_generate(input_ids, scores, raw_logits, cache, streamer, ret)


def finish_generate(input_ids, scores, raw_logits, cache, streamer, ret: bool):
    """The end of a fused decode loop: the streamer ended, and the sequences, or (``ret``: a dict output was asked
    for) transformers' output with the scores / logits and the fused cache. The model's generate() hands the caller
    stock's DynamicCache, copied out of this one (`with_stock_cache`)."""
    if streamer is not None:
        streamer.end()
    if not ret:
        return input_ids
    return GenerateDecoderOnlyOutput(
        sequences=input_ids, scores=scores, logits=raw_logits, attentions=None, hidden_states=None,
        **{GENERATE_OUTPUT_CACHE_FIELD: cache},
    )


def with_stock_cache(output, text_model):
    """``generate``'s output with a fused decode cache it carries (the fused loop's, or stock ``_sample``'s under
    ``synced_gpus``) replaced by stock's ``DynamicCache`` copied out of it (``FusedDecodeCache.to_stock``): what stock's
    generate returns, valid after the model's buffers serve a later call."""
    cache = getattr(output, GENERATE_OUTPUT_CACHE_FIELD, None)
    if isinstance(cache, FusedDecodeCache):
        output[GENERATE_OUTPUT_CACHE_FIELD] = cache.to_stock(text_model)
    return output


def next_logits(model, text_model, runner, cache: FusedDecodeCache, tokens: torch.Tensor) -> torch.Tensor:
    """The logits [B, vocab] of the step for ``tokens`` [B] (the tokens just chosen) in the model's dtype, as
    stock's ``outputs.logits[:, -1]``; the LM head runs inside the step when ``graph_head`` allows. With CUDA graphs
    the result is the graph's output buffer, which the next step overwrites."""
    head = graph_head(model, text_model, cache._state)
    out = runner.next_token(text_model, cache, tokens, head)
    return out if head is not None else step_logits(model, runner.plan.ops, out)[:, -1]
