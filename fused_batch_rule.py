# Copyright 2026 The Qwen3.5 fused-kernels authors. Licensed under the Apache License, Version 2.0.
"""``generate_batch``'s token rule: how each request's next token is chosen from its row of the step's logits, as
stock ``generate`` chooses it (its logits processors, the argmax or a draw from the request's own generator), and the
sampling settings a streaming request may carry of its own. Used by the scheduler (``fused_batch``) and the manager
(``fused_batch_manager``).
"""

import copy

import torch
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    InfNanRemoveLogitsProcessor,
    LogitNormalization,
    MinPLogitsWarper,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from .fused_compat import logits_processors


# Logits processors that read only the scores, not the sequence: one call over all rows gives each row its own result.
_SCORE_ONLY = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper, TypicalLogitsWarper,
               EpsilonLogitsWarper, EtaLogitsWarper, LogitNormalization, InfNanRemoveLogitsProcessor,
               SuppressTokensLogitsProcessor)


def device_tokens(tokens: list[int], device: torch.device) -> torch.Tensor:
    """``tokens`` as an int64 tensor on ``device``, without waiting for the GPU: staged through pinned memory and
    copied on the stream (``torch.tensor(..., device="cuda")`` waits for everything queued before it)."""
    host = torch.tensor(tokens, dtype=torch.long)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def make_generator(device: torch.device, seed: int) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


# Sampling settings a request of the streaming manager may set for itself (``add_request(..., temperature=...)``, as
# transformers' manager takes them and ``transformers serve`` sends them), with their types.
SAMPLING_KEYS = {"temperature": float, "top_k": int, "top_p": float}


def sampling_settings(kwargs: dict) -> tuple:
    """A request's own sampling settings from ``kwargs`` (names of ``SAMPLING_KEYS``, values None ignored) as sorted
    (name, value) pairs; a value of another type or out of range is refused in one line naming it."""
    settings = {}
    for name, value in kwargs.items():
        if value is None:
            continue
        kind = SAMPLING_KEYS[name]
        if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
            raise TypeError(f"{name} must be {kind.__name__}, got {value!r} ({type(value).__name__}).")
        value = kind(value)
        if (name == "temperature" and not value > 0) or (name == "top_k" and value < 1) or (
                name == "top_p" and not 0 < value <= 1):
            bound = {"temperature": "> 0", "top_k": ">= 1", "top_p": "in (0, 1]"}[name]
            raise ValueError(f"{name} must be {bound}, got {value!r}; leave it out for the generation config's.")
        settings[name] = value
    return tuple(sorted(settings.items()))


def request_config(config, settings: tuple):
    """``config`` with a request's own ``settings`` (``sampling_settings``): top_k = 1 decodes greedily (the argmax,
    whatever the other settings), any other setting samples with it over the config's remaining values. ``config``
    itself when there are none."""
    if not settings:
        return config
    config = copy.deepcopy(config)
    values = dict(settings)
    if values.get("top_k") == 1:
        config.do_sample = False
        for name in SAMPLING_KEYS:  # unused when greedy: unset, so that building the processors warns of nothing
            setattr(config, name, None)
        return config
    config.do_sample = True
    for name, value in values.items():
        setattr(config, name, value)
    return config


class _Rule:
    """One generation config's token rule: its processors (``shared`` over all its rows when they read only the
    scores; else built per request, ``per_request``) and whether it samples."""

    def __init__(self, model, config, device: torch.device, prompt: list[int]):
        self.config = config
        self.sample = bool(config.do_sample)
        # which processors run does not depend on the prompt (only their arguments do): one prompt tells
        procs = logits_processors(model, config, device_tokens(prompt, device)[None])
        self.per_request = not all(isinstance(p, _SCORE_ONLY) for p in procs)  # some read the sequence
        self.shared = procs if len(procs) and not self.per_request else None  # or one list serves every row


class TokenRule:
    """Stock ``generate``'s token rule, per request: the logits processors ``generation_config`` asks for (built for
    the request's own prompt, as ``generate`` builds them), then the argmax, or with ``do_sample`` a draw from the
    request's own seeded ``torch.Generator`` (so its tokens do not depend on the requests beside it); with
    ``logprobs`` the log of the chosen token's probability after the processors (transformers' ``return_logprobs``).

    Processors that read only the scores (temperature, top-k / top-p, ...) run once over all rows; a list with one that
    reads the sequence (repetition penalty, ``min_new_tokens``, ...) runs per request on its own sequence. A request
    with its own sampling settings (``Request.settings``) follows the rule of its config (``request_config``); rows
    of different rules are chosen a group at a time."""

    def __init__(self, model, generation_config, device: torch.device, logprobs: bool, prompt: list[int]):
        self.model, self.config, self.device = model, generation_config, device
        self.logprobs = logprobs
        self._prompt = prompt
        self.default = _Rule(model, generation_config, device, prompt)
        self.rules = {(): self.default}  # settings -> _Rule
        self.mixed = False  # a request has had a rule of its own: rows may follow different rules

    @property
    def per_request(self) -> bool:
        """Whether a processor reads each row's sequence (requests' own settings change only score-only ones)."""
        return self.default.per_request

    def prepare(self, request) -> None:
        """Give ``request`` (a ``fused_batch.Request``) its rule, its processors (when they read its sequence) and its
        generator (when sampling)."""
        rule = self.rules.get(request.settings)
        if rule is None:
            rule = self.rules[request.settings] = _Rule(self.model, request_config(self.config, request.settings),
                                                        self.device, self._prompt)
        self.mixed |= rule is not self.default
        request.rule = rule
        if rule.per_request:
            request.processors = logits_processors(self.model, rule.config, request.prompt_ids[None])
        if rule.sample:
            request.generator = make_generator(self.device, request.seed)

    def choose(self, logits: torch.Tensor, requests: list, sequence) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The next token of each of the k ``requests`` from ``logits`` [>= k, vocab] (row i is request i), and their
        log-probabilities (or None): tokens [k] int64, logprobs [k] float32. ``sequence(i)`` is request i's sequence
        so far [1, T] (what its processors read)."""
        k = len(requests)
        logits = logits[:k]
        if not self.mixed:
            return self._choose(self.default, logits, requests, sequence)
        groups: dict = {}
        for i, r in enumerate(requests):
            groups.setdefault(id(r.rule), (r.rule, []))[1].append(i)
        if len(groups) == 1:
            return self._choose(requests[0].rule, logits, requests, sequence)
        tokens = torch.empty(k, dtype=torch.long, device=logits.device)
        logprobs = torch.empty(k, dtype=torch.float32, device=logits.device) if self.logprobs else None
        for rule, rows in groups.values():
            index = device_tokens(rows, logits.device)
            got, got_logprobs = self._choose(rule, logits.index_select(0, index), [requests[i] for i in rows],
                                             lambda j, rows=rows: sequence(rows[j]))
            tokens.index_copy_(0, index, got)
            if logprobs is not None:
                logprobs.index_copy_(0, index, got_logprobs)
        return tokens, logprobs

    def _choose(self, rule: _Rule, logits: torch.Tensor, requests: list, sequence):
        """:meth:`choose` for rows that all follow ``rule``."""
        k = len(requests)
        if not (rule.sample or self.logprobs or rule.shared is not None or rule.per_request):
            return logits.argmax(dim=-1), None  # the same token as in float32: the conversion keeps the order
        scores = logits.float()
        if rule.shared is not None:
            scores = rule.shared(scores.new_zeros(k, 1, dtype=torch.long), scores)  # they read only the scores
        if rule.per_request:
            scores = torch.cat([r.processors(sequence(i), scores[i : i + 1]) if r.processors is not None
                                else scores[i : i + 1] for i, r in enumerate(requests)])
        probs = torch.softmax(scores, dim=-1) if rule.sample or self.logprobs else None
        if rule.sample:
            tokens = torch.cat([torch.multinomial(probs[i], 1, generator=r.generator) for i, r in enumerate(requests)])
        else:
            tokens = scores.argmax(dim=-1)
        logprobs = probs.gather(1, tokens[:, None]).squeeze(1).log() if self.logprobs else None
        return tokens, logprobs
