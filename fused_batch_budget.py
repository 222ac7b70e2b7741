# Copyright 2026 The Qwen3.5 fused-kernels authors. Licensed under the Apache License, Version 2.0.
"""How big ``generate_batch``'s buffers are (``fused_batch``): rows, cache tokens a row and prefill tokens from the
requests and the caller's budget (``continuous_batching_config``'s ``num_blocks`` x ``page_size``, or on CUDA a
fraction of the free memory), and their allocation, halving the rows when they do not fit."""

import torch

from .fused_batch_state import group_len_for, prefill_len_for
from .fused_decode import decode_len_bucket
from .fused_plan import announce

# Rows of the running batch when the caller sets none (``max_requests_per_batch``); at most the number of requests.
DEFAULT_ROWS = 32
# The cache holds twice the longest request (prompt + new tokens), in multiples of this: the live span then moves
# left at most once every half cache of steps, and each move copies at most half a cache a row (one key and value
# a row and step, amortized), however the requests come and go.
CACHE_ROUND = 256
# Fraction of the free GPU memory the buffers may take when the caller sets no budget (transformers' own default is
# 0.8-0.9 of the free memory for its paged cache; the step's and the prefill's activations need the rest).
DEFAULT_MEMORY_FRACTION = 0.8


def block_tokens(cb_config) -> int:
    """The tokens one cache block of ``cb_config`` holds: transformers 5.24 calls it ``page_size``, 5.17
    ``block_size`` (both default 256)."""
    return getattr(cb_config, "page_size", None) or getattr(cb_config, "block_size", None) or 256


def state_bytes(text_model) -> tuple[int, int]:
    """(bytes of one cache token of one row over every attention layer, bytes of one row's DeltaNet states)."""
    config = text_model.config
    itemsize = text_model.embed_tokens.weight.element_size()
    per_token = per_row = 0
    for layer in text_model.layers[: config.num_hidden_layers]:
        if layer.block_type == "linear_attention":
            m = layer.linear_attn
            per_row += m.conv_dim * m.conv_kernel_size * itemsize + m.num_v_heads * m.head_k_dim * m.head_v_dim * 4
        else:
            per_token += 2 * config.num_key_value_heads * layer.self_attn.head_dim * itemsize
    return per_token, per_row


def _device_free(device: torch.device) -> int | None:
    """The device's free bytes once the allocator's unused cached blocks are released; None off CUDA."""
    if device.type != "cuda":
        return None
    with torch.cuda.device(device):
        torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)[0]


def free_bytes(text_model) -> int | None:
    """The bytes a ``generate_batch`` call's buffers may come from, on CUDA (None elsewhere): the device's free
    memory and the buffers the runner holds from an earlier call, which the new ones replace or are. Without the
    held buffers, a call after one at other sizes saw its budget less the earlier buffers (measured on an H100 at 4B:
    128 rows of 2,944 tokens, then a call at 256 rows got 1,216 tokens a row and the call after it none, so every
    request failed)."""
    free = _device_free(text_model.plan.device)
    if free is None:
        return None
    held = text_model.runner.batch
    return free + (held.nbytes() if held is not None else 0)


def prefill_rows(group: int) -> int:
    """Rows of the prefill states at most: the batch-1 state and a group state of each batch 2, 4, ... up to
    ``group`` (``fused_batch.prefill_group``)."""
    return sum(1 << i for i in range(max(1, group).bit_length()))


def size_buffers(text_model, need: int, count: int, longest_prompt: int, cb_config,
                 group_for=lambda rows: 1) -> tuple[int, int, int]:
    """(rows, cache tokens a row, prefill tokens) for ``count`` requests of at most ``need`` cache tokens each (prompt
    + new - 1) under the caller's budget, with prefill states for groups of up to ``group_for(rows)`` prompts:

    - rows: ``max_requests_per_batch``, else min(count, ``DEFAULT_ROWS``); more requests wait for a free row;
    - cache: twice the longest request, in multiples of ``CACHE_ROUND``, at least ``MIN_DECODE_LEN``;
    - a token budget ``num_blocks`` x ``page_size`` caps rows x cache: first the cache's headroom, down to the longest
      request, then the rows, even those the caller set (``max_requests_per_batch`` is a maximum, as in
      transformers, whose paged cache gives a long request more blocks while others wait); on CUDA without it,
      ``max_memory_percent`` (else ``DEFAULT_MEMORY_FRACTION``) of the free memory caps the buffers' bytes the same
      way. Every request that fits the budget alone runs, the others wait (at 9B on an H100, 256 rows asked of a
      budget of 473k tokens gave rows of 1,792 tokens when the caller's rows stood, and 125 of 512 requests failed).
      Only a request longer than the whole budget fails, alone, with an error naming it (said once when the budget
      cuts the sizes);
    - buffers an earlier call left, sized from the free memory for the same asked rows, are kept when they hold this
      call's longest request and prompt, unless their rows yielded to a request at least twice as long as this
      call's (fresh sizes would then give more rows): the free memory a later call sees is less the graphs captured
      since, and new sizes would drop those graphs (over one 9B benchmark's calls on an H100 the budget read 667k,
      645k, 473k and 542k tokens, and the timed call ran 36 of its prompt forwards eagerly)."""
    set_rows = getattr(cb_config, "max_requests_per_batch", None)
    rows = asked_rows(cb_config, count)
    fit = -(-need // 64) * 64  # the longest request, in the cache's multiples of 64
    max_len = max(decode_len_bucket(1), -(-2 * need // CACHE_ROUND) * CACHE_ROUND)
    prefill_len = prefill_len_for(longest_prompt)
    blocks = getattr(cb_config, "num_blocks", None)
    per_token, per_row = state_bytes(text_model)
    free = None if blocks else free_bytes(text_model)
    if blocks:
        tokens = blocks * block_tokens(cb_config)
    elif free is not None:
        held = text_model.runner.batch
        if (held is not None and held.sized_for == sized_for(cb_config, count) and held.prefill_len >= prefill_len
                and fit <= held.max_len and (held.rows == rows or held.max_len < 2 * fit)):
            return held.rows, held.max_len, prefill_len
        fraction = getattr(cb_config, "max_memory_percent", None) or DEFAULT_MEMORY_FRACTION
        # the batch-1 state, and the group states (a group never outnumbers the rows or the requests:
        # ``BatchEngine._partners``), each row of those at most a group's longest prompt (``group_len_for``)
        group_rows = prefill_rows(min(group_for(rows), rows, count)) - 1
        prefill_bytes = (prefill_len * per_token + per_row
                         + group_rows * (group_len_for(prefill_len) * per_token + per_row))
        tokens = max(0, int(fraction * free) - prefill_bytes - rows * per_row) // max(1, per_token)
    else:
        return rows, max_len, prefill_len
    if rows * max_len > tokens:
        asked = rows
        max_len = max(fit, tokens // rows)
        if rows * max_len > tokens:
            rows = max(1, tokens // max_len)
        max_len = min(max_len, max(64, tokens // rows // 64 * 64))
        why = (f" (of max_requests_per_batch={asked}, so that a row holds the longest request, {need} tokens; a larger "
               "max_memory_percent or num_blocks gives more)" if set_rows and rows < asked else "")
        announce(f"batch-budget/{rows}/{max_len}",
                 f"Qwen3.5 fused kernels: generate_batch runs {rows} requests at a time{why} with {max_len} cache "
                 f"tokens each, the budget of {tokens} tokens; the others wait for a free row.")
    return rows, max_len, prefill_len


def asked_rows(cb_config, count: int) -> int:
    """The rows a call asks for: ``max_requests_per_batch``, else min(count, ``DEFAULT_ROWS``)."""
    return getattr(cb_config, "max_requests_per_batch", None) or max(1, min(count, DEFAULT_ROWS))


def sized_for(cb_config, count: int) -> tuple:
    """What a call's buffers are sized from besides its requests: (its asked rows, its token budget, its memory
    fraction); equal keys let a later call keep the buffers (``size_buffers``)."""
    blocks = getattr(cb_config, "num_blocks", None)
    return (asked_rows(cb_config, count), blocks and blocks * block_tokens(cb_config),
            getattr(cb_config, "max_memory_percent", None))


def allocate(text_model, rows: int, max_len: int, prefill_len: int, key: tuple | None = None):
    """The runner's batch buffers, halving the rows on an out-of-memory error (the requests beyond them wait);
    a one-line error when even one row does not fit (nothing has run yet). ``key``: the call's ``sized_for``, kept
    on the buffers for ``size_buffers``' reuse."""
    runner = text_model.runner
    while True:
        try:
            buffers = runner.batch_state(text_model, rows, max_len, prefill_len)
            buffers.sized_for = key
            return buffers
        except torch.OutOfMemoryError:
            runner.drop_batch_state()
            torch.cuda.empty_cache()
            if rows == 1:
                raise RuntimeError(
                    f"generate_batch: one row of {max_len} cache tokens does not fit in GPU memory; pass a "
                    "continuous_batching_config with a smaller num_blocks or max_memory_percent, or shorter requests."
                ) from None
            rows //= 2
            announce(f"batch-oom/{rows}", f"Qwen3.5 fused kernels: generate_batch's buffers did not fit in GPU "
                     f"memory; running {rows} requests at a time.")
