# Copyright 2026 The Qwen3.5 fused-kernels authors. Licensed under the Apache License, Version 2.0.
"""Streaming continuous batching: :class:`FusedBatchManager`, transformers' ``ContinuousBatchingManager`` request API
over the fused scheduler (``fused_batch.BatchEngine``), run by a background thread.

transformers' own manager cannot drive Qwen3.5: its paged cache has no linear-attention layer type (the DeltaNet
layers keep a conv and a recurrent state per request, not pages of keys). ``model.init_continuous_batching()``
returns this manager instead, with the methods of transformers' (``start``, ``add_request(s)``, ``get_result``,
``request_id_iter``, ``cancel_request``, ``stop``, ``is_running``, ``destroy``, ``warmup``), so transformers' own
``continuous_batching_context_manager`` runs it as it is::

    with model.continuous_batching_context_manager(generation_config=config) as manager:
        rid = manager.add_request(prompt_ids, max_new_tokens=64, streaming=True)
        for output in manager.request_id_iter(rid):   # a GenerationOutput after each token, the last one finished
            print(output.generated_tokens)

The buffers are sized once, at ``start``: at most ``max_requests_per_batch`` rows (else
``fused_batch_budget.DEFAULT_ROWS``) and a cache of ``num_blocks`` x ``page_size`` tokens over them (else
``DEFAULT_CACHE_TOKENS`` a row, within ``max_memory_percent`` of the free GPU memory, fewer rows where it holds
fewer); a request longer than a row fails alone, with an error naming the budget. The thread holds the model's
lock for one scheduler step at a time, so ``generate`` and forwards from other threads run between steps.
"""

import queue
import threading

import torch
from transformers.utils import logging

from .fused_batch import Request, base_seed, build_engine, eos_tokens, new_tokens
from .fused_batch_budget import block_tokens
from .fused_batch_rule import SAMPLING_KEYS, sampling_settings
from .fused_compat import RequestStatus, complete_generation_config
from .fused_plan import announce

logger = logging.get_logger(__name__)

# Cache tokens (prompt + new) a row holds when the caller sets no token budget (``num_blocks``): the manager does not
# know its requests in advance.
DEFAULT_CACHE_TOKENS = 4096
# How long the idle thread sleeps between checks for new requests or a stop (it is woken at once by either).
IDLE_WAIT_S = 0.05


class _ThreadStatus:
    """What ``transformers serve`` reads of transformers' manager's ``background_thread_status``: ``fatal_error``,
    the error that ended the thread (None while it serves)."""

    def __init__(self, manager: "FusedBatchManager"):
        self._manager = manager

    @property
    def fatal_error(self) -> Exception | None:
        return self._manager.fatal_error


class _RequestKeys:
    """What ``transformers serve`` reads of transformers' manager's ``logit_processor``: the per-request sampling
    arguments ``add_request`` takes, with their types (``supported_keys``), and those it ignores (none)."""

    supported_keys = dict(SAMPLING_KEYS)
    ignored_keys: set = set()


class FusedBatchManager:
    """Continuous batching with streaming for the fused classes (see the module docstring)."""

    def __init__(self, model, generation_config=None, continuous_batching_config=None,
                 prefill_chunk: int | None = None):
        self.model = model
        self.prefill_chunk = prefill_chunk  # as generate_batch's: longer prompts prefilled in chunks between steps
        self._given_config = generation_config
        self.generation_config = complete_generation_config(model, generation_config)
        self.continuous_batching_config = continuous_batching_config
        self.output_queue: queue.Queue = queue.Queue()
        self.warmed_up = True  # nothing to warm: each graph is captured on its bucket's second step
        self.fatal_error: Exception | None = None
        self._inputs: queue.Queue = queue.Queue()
        self._cancels: queue.Queue = queue.Queue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._hard_stop = False
        self._thread: threading.Thread | None = None
        self._counter = 0
        self._counter_lock = threading.Lock()
        self._seed = base_seed(continuous_batching_config)
        self._eos = eos_tokens(model, self.generation_config)
        # transformers' manager attributes that `transformers serve` reads: the thread's fatal error, the per-request
        # sampling arguments, and its batch processor (None: serve's status line then shows no requests or cache use)
        self.background_thread_status = _ThreadStatus(self)
        self.logit_processor = _RequestKeys()
        self.batch_processor = None

    # -- lifecycle ---------------------------------------------------------------------------------------------------

    def warmup(self) -> None:
        """Nothing to do: each decode bucket's graph is captured on its second step, each prompt bucket's on its
        second prompt (transformers' context manager calls this)."""

    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Start the background thread (a no-op, said once, when it runs already)."""
        if self.is_running():
            logger.warning("Manager thread is already running.")
            return
        self._stop.clear()
        self._hard_stop = False
        self._thread = threading.Thread(target=self._run, name="qwen3_5-fused-batching", daemon=True)
        self._thread.start()

    def stop(self, block: bool = True, timeout: float | None = None, keep_for_next_session: bool = False,
             hard_stop: bool = False) -> None:
        """Stop the thread once every request it holds has finished (``hard_stop``: at once, the unfinished ones
        failed); with ``block``, wait for it (at most ``timeout`` seconds). ``keep_for_next_session`` changes nothing:
        the buffers and graphs stay with the model."""
        self._hard_stop = hard_stop
        self._stop.set()
        self._wake.set()
        if block:
            self.join(timeout)

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning(f"Generation thread did not exit after join timeout ({timeout}).")
            else:
                self._thread = None

    def destroy(self) -> None:
        if self.is_running():
            self.stop(block=True)

    # -- requests ----------------------------------------------------------------------------------------------------

    def add_request(self, input_ids, request_id: str | None = None, max_new_tokens: int | None = None,
                    streaming: bool = False, record_timestamps: bool = False, eos_token_id=None,
                    **logit_processor_kwargs) -> str:
        """Queue a prompt (a list of token ids); returns its id (``req_<n>`` unless given). With ``streaming`` its
        output comes after every token it is given, else once, finished. ``temperature``, ``top_k``, ``top_p``: the
        request's own sampling (``fused_batch.request_config``: top_k = 1 is greedy), as ``transformers serve`` sends
        them; other logits-processor arguments are ignored (said once), the generation config's apply."""
        own = {name: value for name, value in logit_processor_kwargs.items() if name in SAMPLING_KEYS}
        other = sorted(set(logit_processor_kwargs) - set(own))
        if other:
            announce("batch-manager/processor-kwargs", "Qwen3.5 fused kernels: the batch manager takes temperature, "
                     "top_k and top_p per request; the generation config's other logits processors apply to every "
                     f"request, and the per-request arguments {other} are ignored.")
        settings = sampling_settings(own)
        with self._counter_lock:
            index = self._counter
            self._counter += 1
        request_id = f"req_{index}" if request_id is None else request_id
        prompt = [int(t) for t in input_ids]
        if not prompt:
            raise ValueError("add_request needs at least one prompt token.")
        eos = self._eos if eos_token_id is None else eos_tokens(self.model, self.generation_config, eos_token_id)
        req = Request(request_id, prompt, new_tokens(self.generation_config, prompt, max_new_tokens), eos,
                      self._seed + index, record_timestamps, streaming, settings=settings)
        self._inputs.put(req)
        self._wake.set()
        return request_id

    def add_requests(self, inputs, max_new_tokens: int | None = None, streaming: bool = False,
                     record_timestamps: bool = False, **logit_processor_kwargs) -> list[str]:
        return [self.add_request(ids, max_new_tokens=max_new_tokens, streaming=streaming,
                                 record_timestamps=record_timestamps, **logit_processor_kwargs) for ids in inputs]

    def cancel_request(self, request_id: str) -> None:
        """End a request wherever it is; its output (status FAILED, error ``"cancelled"``, the tokens so far) is
        delivered."""
        self._cancels.put(request_id)
        self._wake.set()

    def get_result(self, request_id: str | None = None, timeout: float | None = None):
        """The next output (of ``request_id``, when given: another request's is put back), or None after
        ``timeout`` seconds. When the thread has ended and nothing is left, None after ``timeout`` (at once when
        ``timeout`` is None): a loop that polls a stopped manager (``transformers serve``'s output thread, which ends
        only on a fatal error) waits between its calls instead of spinning on a core."""
        if self.output_queue.empty() and not self.is_running():
            if timeout is None:
                return None
        try:
            result = self.output_queue.get(timeout=timeout)
        except queue.Empty:
            return None
        if request_id is not None and result.request_id != request_id:
            self.output_queue.put(result)
            return None
        return result

    def __iter__(self):
        while self.is_running() or not self.output_queue.empty():
            result = self.get_result(timeout=0.1)
            if result is not None:
                yield result

    def request_id_iter(self, request_id: str):
        """The outputs of one request as they come, up to its finished one."""
        while self.is_running() or not self.output_queue.empty():
            result = self.get_result(request_id=request_id, timeout=0.1)
            if result is not None:
                yield result
                if result.is_finished():
                    return

    # -- the thread --------------------------------------------------------------------------------------------------

    def _engine(self):
        cb = self.continuous_batching_config
        rows = getattr(cb, "max_requests_per_batch", None)
        blocks = getattr(cb, "num_blocks", None)
        need = DEFAULT_CACHE_TOKENS // 2  # the cache is sized at twice the longest request
        if blocks and rows:
            need = max(1, blocks * block_tokens(cb) // rows // 2)
        # the prompts are not known in advance: the prefill state is sized for the longest request the rows are, once
        # (grown per longer prompt, it would free and recapture every prompt graph each time: ~150 ms a bucket at 4B)
        return build_engine(self.model, self.generation_config, cb, need, rows or 1 << 30, need, stream=True,
                            given_config=self._given_config, prefill_chunk=self.prefill_chunk)

    def _deliver(self, engine) -> None:
        done = set()
        for req in engine.finished:
            done.add(req.request_id)
            self.output_queue.put(req.output())
        for req in dict.fromkeys(engine.updated):  # once a step each, in order
            if req.streaming and req.request_id not in done and not req.done:
                self.output_queue.put(req.output())
        engine.finished.clear()
        engine.updated.clear()

    def _take(self, engine) -> None:
        while not self._inputs.empty():
            engine.add(self._inputs.get_nowait())
        while not self._cancels.empty():
            engine.cancel(self._cancels.get_nowait())

    def _run(self) -> None:
        device = self.model._text_model().plan.device
        if device.type == "cuda":
            torch.cuda.set_device(device)
        lock = self.model._text_model().runner.lock
        engine = None
        try:
            with torch.inference_mode():
                with lock:
                    engine = self._engine()
                while True:
                    self._take(engine)
                    if self._hard_stop:
                        engine.fail_all("the manager was stopped")
                    if not engine.busy:
                        self._deliver(engine)
                        if self._stop.is_set():
                            return
                        self._wake.wait(IDLE_WAIT_S)
                        self._wake.clear()
                        continue
                    with lock:
                        try:
                            engine.step()
                        except Exception as err:  # noqa: BLE001 - fail what runs, keep serving
                            logger.error(f"Continuous batching step failed ({type(err).__name__}: {err})",
                                         exc_info=True)
                            engine.fail_all(f"{type(err).__name__}: {err}")
                    self._deliver(engine)
        except Exception as err:  # noqa: BLE001 - the buffers could not be built: every request fails with it
            self.fatal_error = err
            logger.error(f"Continuous batching manager failed ({type(err).__name__}: {err})", exc_info=True)
            error = f"{type(err).__name__}: {err}"
            while not self._inputs.empty():
                req = self._inputs.get_nowait()
                req.end(RequestStatus.FAILED, error)
                self.output_queue.put(req.output())
            if engine is not None:
                engine.fail_all(error)
                self._deliver(engine)


def init_continuous_batching(model, generation_config=None, continuous_batching_config=None, **kwargs):
    """The manager ``model.init_continuous_batching`` returns; ``prefill_chunk`` (an extension of this repo) as
    ``generate_batch``'s; transformers' other keywords (``workload_hints``) change nothing: the sizes come from the
    continuous-batching config (module docstring)."""
    return FusedBatchManager(model, generation_config, continuous_batching_config, kwargs.get("prefill_chunk"))
