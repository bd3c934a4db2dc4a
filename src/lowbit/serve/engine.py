"""The generation engine behind `lowbit serve`: one worker thread, requests interleaved token by token.

Scheduling (no batching across requests): requests wait in a FIFO queue; the worker admits up
to `max_active` of them and then runs rounds, each giving every active request one step -- a
prefill chunk of at most `prefill_chunk` prompt tokens, or one decode token. So a long
request does not hold up short ones for its whole length, and tokens stream to every client as
they are made. Every request owns its own KV cache (CacheFactory.new()) and its own sampling
generator; nothing is shared between requests but the model weights, which are read only.
The worker is the only thread that runs the model (CPU torch is not re-entrant across models
here, and two cores gain nothing from parallel forwards).

Events flow back through the request's `emit(kind, payload)` callback, called on the worker
thread: ("delta", str), then exactly one of ("done", {finish_reason, usage}) or
("error", message). HTTP handlers turn them into responses (see app.py).
"""

from __future__ import annotations

import inspect
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from lowbit.serve.kvcache import CacheFactory, cache_stats
from lowbit.serve.metrics import Metrics
from lowbit.serve.sampling import Detokenizer, make_generator, sample

log = logging.getLogger("lowbit.serve")

DEFAULT_MAX_ACTIVE = 16
DEFAULT_PREFILL_CHUNK = 256
REPORT_EVERY_S = 0.5


@dataclass
class GenParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None


@dataclass
class Request:
    prompt_ids: list[int]
    params: GenParams
    emit: Callable[[str, object], None]
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    cancelled: bool = False
    # worker-side state
    cache: object = None
    fed: int = 0  # prompt tokens already in the cache
    next_logits: torch.Tensor | None = None
    generator: torch.Generator | None = None
    detok: Detokenizer | None = None
    completion_tokens: int = 0

    def cancel(self) -> None:
        """Called from the HTTP side when the client goes away; the worker drops the request."""
        self.cancelled = True


class Worker:
    """The one-worker-thread lifecycle both engines share: start() runs self._loop on a daemon thread
    named THREAD_NAME until stop() sets self._stop (the loop checks it between rounds)."""

    THREAD_NAME = "lowbit-engine"
    _stop: threading.Event
    _thread: threading.Thread | None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name=self.THREAD_NAME, daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()


class Engine(Worker):
    """Runs `model` for queued requests. Start with start(); stop with stop()."""

    path = "single"  # named in every result (the "done" payload's `engine`) and in /metrics

    def __init__(self, model, tokenizer, factory: CacheFactory, metrics: Metrics, *, max_context: int,
                 eos_token_ids: list[int], max_active: int = DEFAULT_MAX_ACTIVE,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK):
        self.model = model
        self.tokenizer = tokenizer
        self.factory = factory
        self.metrics = metrics
        self.max_context = int(max_context)
        self.eos = {int(t) for t in eos_token_ids}
        self.max_active = int(max_active)
        self.prefill_chunk = int(prefill_chunk)
        self._queue: queue.Queue[Request] = queue.Queue()
        self._active: list[Request] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_report = 0.0
        # transformers 5.24 names the cache argument `cache`; 5.17 `past_key_values`
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.info = {"engine": "single", "path": "eager"}
        metrics.set_engine(self.info)

    @property
    def scheme(self):
        return self.factory.scheme

    @property
    def cache_class(self) -> str:
        return self.factory.cache_class

    # ------------------------------------------------------------- control
    def submit(self, req: Request) -> Request:
        self._queue.put(req)
        return req

    # -------------------------------------------------------------- worker
    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while not self._stop.is_set():
            self._admit()
            if not self._active:
                continue
            for req in list(self._active):
                if req.cancelled:
                    self._retire(req, "cancelled")
                    continue
                try:
                    self._step(req)
                except Exception as e:  # one bad request must not take the server down
                    log.exception("request %s failed", req.id)
                    self._retire(req, "error", f"generation failed: {type(e).__name__}: {e}")
            self._report(force=not self._active)

    def _admit(self) -> None:
        block = not self._active
        while len(self._active) < self.max_active:
            try:
                req = self._queue.get(timeout=0.05) if block else self._queue.get_nowait()
            except queue.Empty:
                return
            block = False
            if req.cancelled:  # its client went away while it waited: counted like the batching engine does
                self.metrics.finish("cancelled", 0)
                continue
            req.cache = self.factory.new()
            req.generator = make_generator(req.params.seed)
            req.detok = Detokenizer(self.tokenizer, req.params.stop)
            self._active.append(req)

    def _forward(self, req: Request, ids: list[int]) -> torch.Tensor:
        """Feed ids through the model into req.cache; returns the logits of the last position [V]."""
        x = torch.tensor([ids], dtype=torch.long)
        with torch.inference_mode():
            out = self.model(input_ids=x, use_cache=True, logits_to_keep=1, **{self._cache_kw: req.cache})
        return out.logits[0, -1]

    def _step(self, req: Request) -> None:
        t0 = time.perf_counter()
        n_prompt = len(req.prompt_ids)
        if req.fed < n_prompt:  # prefill, one chunk per round
            chunk = req.prompt_ids[req.fed:req.fed + self.prefill_chunk]
            logits = self._forward(req, chunk)
            req.fed += len(chunk)
            if req.fed < n_prompt:
                self.metrics.step(time.perf_counter() - t0, 0, len(chunk))
                return
            req.next_logits = logits
            self.metrics.step(time.perf_counter() - t0, 0, len(chunk))
            t0 = time.perf_counter()
        p = req.params
        tok = sample(req.next_logits, p.temperature, p.top_p, req.generator)
        req.completion_tokens += 1
        finish = None
        if tok in self.eos:
            finish = "stop"
        else:
            delta = req.detok.add(tok)
            if delta:
                req.emit("delta", delta)
            if req.detok.stopped:
                finish = "stop"
            elif req.completion_tokens >= p.max_tokens or n_prompt + req.completion_tokens >= self.max_context:
                finish = "length"
        if finish is None:
            req.next_logits = self._forward(req, [tok])
        self.metrics.step(time.perf_counter() - t0, 1)
        if finish is not None:
            rest = req.detok.flush() if not req.detok.stopped else ""
            if rest:
                req.emit("delta", rest)
            self._retire(req, finish)

    def _retire(self, req: Request, reason: str, message: str | None = None) -> None:
        if req in self._active:
            self._active.remove(req)
        quantized = cache_stats(req.cache).quantized_tokens if req.cache is not None else 0
        req.cache = None  # free the KV memory now
        req.next_logits = None
        self.metrics.finish(reason, quantized)
        if reason == "error":
            req.emit("error", message)
        elif reason != "cancelled":
            n = len(req.prompt_ids)
            req.emit("done", {"finish_reason": reason, "quantized_tokens": quantized, "engine": self.path,
                              "usage": {"prompt_tokens": n, "completion_tokens": req.completion_tokens,
                                        "total_tokens": n + req.completion_tokens}})

    def _report(self, force: bool = False) -> None:
        """Refresh the KV gauges in the metrics. Measuring walks every cache's tensors, so at
        most every REPORT_EVERY_S while busy (and always when the last request leaves)."""
        now = time.perf_counter()
        if not force and now - self._last_report < REPORT_EVERY_S:
            return
        self._last_report = now
        stats = [cache_stats(r.cache) for r in self._active if r.cache is not None]
        self.metrics.set_kv(sum(s.bytes_held for s in stats), sum(s.tokens for s in stats),
                            sum(s.quantized_tokens for s in stats), len(self._active), self._queue.qsize())
