"""The continuous-batching engine behind `lowbit serve`: every live request decodes in one batched step.

One StaticKVCache (lowbit.runtime.static_cache) holds `slots` requests of up to `max_context` tokens
each; a request owns one slot from admission to its end. One worker thread loops:

    admit      waiting requests take the lowest free slots (FIFO), reset_slot first
    prefill    at most ONE chunk (<= prefill_chunk prompt tokens) of one request, the earliest admitted
               still in its prompt; its last chunk's logits give the request's first token
    decode     one batched step for every slot in decode phase: the step covers the prefix [0, n) with
               n = highest decoding slot + 1 (the captured bucket >= n on CUDA); slots of that prefix
               that are free or still in their prompt ride along inactive (their lens does not move)

so prompts are fed a chunk at a time between decode steps, and a long prompt does not stall the
tokens of the others. Requests join (admit) and leave (finish, cancel) between steps.

Path (`mode`): "graphs" replays lowbit.runtime.step.DecodeGraphs, captured at start on the empty
cache for buckets up to `slots` (CUDA only); "eager" runs the same step without a graph (CPU, CI).
Nothing falls back silently: graphs on CPU, a model family without a step, a scheme the static cache
cannot hold are LowbitErrors at start. Every result names its path (the "done" payload's `engine`).

Sampling is per request on the host (lowbit.serve.sampling: temperature, top_p, its own seeded
generator), on the step's logits row of that request; an all-greedy batch reads the step's argmax.

Decode ahead (`decode_ahead=True`, the default; `lowbit serve --no-decode-ahead` turns it off): while
the batch is steady (every row greedy, the same rows as the step before, no slot of the step's width still
in its prompt) the engine queues step k + 1 before it reads step k's tokens: the step's own argmax is the
next step's input (the captured step writes it into its ids; the eager step's argmax is passed on), so the
host's launch of the graph (~0.4 ms for a 32-layer 8B step on an H200, `lowbit bench decode`'s
host_launch_ms) and its per-token work overlap the GPU's step instead of following it. Tokens are the same:
a row that ends at step k (EOS, stop string, length) had step k + 1 run for it, whose token is dropped and
whose write lands inside the slot's capacity (prompt + max_tokens <= max_context) before the slot is reset.

Batch invariance (`batch_invariant=True`, `lowbit serve --batch-invariant`): every decode step runs the
full width (all `slots`, one captured graph) whatever the load, so the kernels a request's rows go
through never depend on how many other requests are live: a request's greedy tokens then equal its
tokens when served alone on the same engine, bit for bit. The default picks the smallest bucket that
covers the live slots (faster at low load); there a bf16 near-tie (logit margin of an ulp or two) can
flip between a batched run and a solo run, because cuBLAS and the attention kernel reduce in another
order at another batch size.

Admission: a request needs one free slot; prompt + max_tokens over max_context can never fit (400,
AdmissionError). When every slot is taken, `when_full` says what happens: "wait" (queue FIFO, the
wait is measured) or "reject" (AdmissionError 429 at submit, the HTTP side answers it).

Events flow back exactly as from lowbit.serve.engine.Engine: ("delta", str), then one of
("done", {finish_reason, usage, quantized_tokens, engine}) or ("error", message).
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time

import torch

from lowbit.core.errors import LowbitError
from lowbit.kv.plan import resolve as plan_resolve
from lowbit.runtime import fold as fold_mod
from lowbit.runtime.step import REGIONS, DecodeGraphs, ModelStep, eager_decode
from lowbit.serve.engine import DEFAULT_MAX_ACTIVE, DEFAULT_PREFILL_CHUNK, REPORT_EVERY_S, Request, Worker
from lowbit.serve.kvcache import served_scheme
from lowbit.serve.metrics import Metrics
from lowbit.serve.sampling import Detokenizer, make_generator, sample

log = logging.getLogger("lowbit.serve")

MODES = ("auto", "graphs", "eager")
WHEN_FULL = ("wait", "reject")


class AdmissionError(LowbitError):
    """A request the engine will not take: status 400 (can never fit) or 429 (full, policy reject)."""

    def __init__(self, message: str, status: int, code: str):
        super().__init__(message)
        self.status, self.code = status, code


def buckets_for(slots: int) -> tuple[int, ...]:
    """Captured batch sizes: powers of two below `slots`, and `slots` itself (the largest batch)."""
    out, b = [], 1
    while b < slots:
        out.append(b)
        b *= 2
    return tuple(out) + (slots,)


class _Slotted:
    """Worker-side state of one admitted request (Request stays the HTTP side's handle)."""

    __slots__ = ("detok", "fed", "generator", "held", "order", "req", "slot", "tok")

    def __init__(self, req: Request, slot: int, order: int, tokenizer):
        self.req, self.slot, self.order = req, slot, order
        self.fed = 0  # prompt tokens already in the slot
        self.held = 0  # tokens written in the slot (prompt, then one per decode step)
        self.tok: int | None = None  # the sampled token the next decode step feeds (None: in prefill)
        self.generator = make_generator(req.params.seed)
        self.detok = Detokenizer(tokenizer, req.params.stop)


class _Launched:
    """One decode step on the device whose tokens the host has not read yet.

    rows: the decoding requests it ran for (a row retired since is dropped when it is read); n: the live
    prefix it covers; width: the rows it ran (the captured bucket); greedy: every row greedy, so `tokens`
    [n] (the step's argmax: a pinned host copy on the captured path, `event` set when it has landed)
    is all the host reads; else `logits` [n, V] are sampled per row; active: the eager step's [width] mask."""

    __slots__ = ("active", "event", "greedy", "logits", "n", "rows", "t0", "tokens", "width")

    def __init__(self, rows, n, width, greedy, t0):
        self.rows, self.n, self.width, self.greedy, self.t0 = rows, n, width, greedy, t0
        self.tokens = self.event = self.logits = self.active = None


class BatchEngine(Worker):
    """Continuous batching over one StaticKVCache (module docstring). Start with start(); stop with stop().

    runtime: lowbit.serve.loader.Runtime. slots: concurrent requests (the cache's batch).
    mode: "auto" (graphs on CUDA, eager on CPU) | "graphs" | "eager". when_full: "wait" | "reject".
    decode_ahead: queue the next step before reading this one's tokens while the batch is steady (module
    docstring; on CPU it only changes the order of work).
    """

    def __init__(self, runtime, metrics: Metrics | None = None, *, slots: int = DEFAULT_MAX_ACTIVE,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK, mode: str = "auto", when_full: str = "wait",
                 batch_invariant: bool = False, compile: bool | str = False, decode_ahead: bool = True):
        from lowbit.runtime.cache import model_device
        from lowbit.runtime.static_cache import StaticKVCache
        if slots < 1:
            raise LowbitError(f"--max-active {slots}: need at least 1 slot")
        if prefill_chunk < 1:
            raise LowbitError(f"--prefill-chunk {prefill_chunk}: need at least 1")
        if mode not in MODES:
            raise LowbitError(f"decode path {mode!r} unknown; use one of {', '.join(MODES)}")
        if when_full not in WHEN_FULL:
            raise LowbitError(f"--when-full {when_full!r} unknown; use wait or reject")
        model = runtime.model
        device = torch.device(model_device(model))
        if mode == "auto":
            mode = "graphs" if device.type == "cuda" else "eager"
        if mode == "graphs" and device.type != "cuda":
            raise LowbitError(f"CUDA graph capture needs the model on CUDA, it is on {device.type}; "
                              "use the eager decode path (--decode-path eager) or load the model on a GPU")
        regions = {True: "whole", False: None}.get(compile, compile)  # --compile [whole|layers]
        if regions not in (None, *REGIONS):
            raise LowbitError(f"--compile {compile!r} unknown; use one of {', '.join(REGIONS)}")
        if regions and mode != "graphs":
            raise LowbitError("--compile compiles the captured decode step: it needs the graphs decode path on CUDA "
                              f"(this engine runs {mode}); drop --compile or serve on a GPU")
        # a family without a step path: the error names those that have one. On the captured path q/k/v and
        # gate/up run as one GEMM each (lowbit.runtime.fuse): the engine owns the model for its lifetime
        self.step = ModelStep(model, fuse=(mode == "graphs"))
        plan = plan_resolve(runtime.scheme, runtime.geometry, device=device.type)
        self.model, self.tokenizer, self.device, self.plan = model, runtime.tokenizer, device, plan
        self.scheme, self.geometry = plan.scheme, runtime.geometry
        self.max_context = int(runtime.max_context)
        try:
            self.cache = StaticKVCache(model, plan, slots=slots, max_context=self.max_context)
        except (torch.OutOfMemoryError, MemoryError, RuntimeError) as e:
            if isinstance(e, RuntimeError) and not isinstance(e, torch.OutOfMemoryError) and "alloc" not in str(e):
                raise
            raise LowbitError(f"the static KV cache for {slots} slots of {self.max_context} tokens does not fit in "
                              f"{device.type} memory; lower --max-active or --max-context") from None
        # eager on the CPU: decode only the rows held, not every row of max_context (lowbit.runtime.static_cache)
        self.cache.read_held_rows = mode == "eager" and device.type == "cpu"
        # on the captured path V's rotation is folded into v_proj / o_proj (lowbit.runtime.fold): two GEMMs fewer
        # per layer and step; for the engine's lifetime, as the fusion (once per model: a later engine over it takes that fold)
        self.folded = fold_mod.fold_value_rotation_once(model, self.cache, fold=(mode == "graphs"))
        self.cache_class = type(self.cache).__name__
        self.slots, self.prefill_chunk, self.mode, self.when_full = slots, prefill_chunk, mode, when_full
        self.eos = {int(t) for t in runtime.eos_token_ids}
        self.batch_invariant = bool(batch_invariant)
        buckets = (slots,) if self.batch_invariant else buckets_for(slots)  # invariant: one full-width graph
        self.graphs = (DecodeGraphs(self.step, self.cache, buckets, compile=bool(regions), regions=regions or "whole")
                       if mode == "graphs" else None)
        self.decode_ahead = bool(decode_ahead)
        self._ahead: _Launched | None = None  # a step queued before the previous step's tokens were read
        # when the host last finished work it counted (a step's read, a prefill chunk) or came back from waiting
        # for requests: a step queued ahead is counted from here, so its time never overlaps a chunk's or idle time
        self._t_mark = 0.0
        # the captured step's argmax lands in pinned host memory, two buffers taken in turn: a step queued ahead
        # copies into the one the host is not reading
        self._tokens_host = ([torch.empty(slots, dtype=torch.long, pin_memory=True) for _ in range(2)]
                             if mode == "graphs" else None)
        self._launches = 0
        self.path = f"batch-{mode}"
        self.info = {"engine": "batch", "path": mode, "slots": slots, "when_full": when_full,
                     "compiled": bool(regions), "compile_regions": regions,
                     "inductor_pdl": bool(self.graphs and self.graphs.inductor_pdl),
                     "fused_projections": self.step.fused.groups if self.step.fused else 0,
                     "folded_value_rotation": len(self.folded.layers) if self.folded else 0,
                     "batch_invariant": self.batch_invariant, "decode_ahead": self.decode_ahead,
                     "buckets": list(self.graphs.buckets) if self.graphs else None}
        if metrics is None:
            from types import SimpleNamespace

            served = served_scheme(SimpleNamespace(scheme=self.scheme, geometry=self.geometry,
                                                   cache_class=self.cache_class))
            if served["page"] != 1 and self.scheme.quantized:
                # report what the cache does: the static cache moves tokens to the packed tier one at a time
                log.info("the static cache moves tokens to the packed tier one at a time (page 1, not %s)",
                         served["page"])
            served["page"] = 1
            metrics = Metrics(served)
        self.metrics = metrics
        self.metrics.set_engine(self.info)
        self._bytes = self.cache.bytes_held()
        log.info("batching engine: %d slots x %d tokens, static KV cache %.1f MiB, decode path %s%s", slots,
                 self.max_context, self._bytes / 2**20, mode,
                 f" (buckets {self.graphs.buckets})" if self.graphs else "")
        # tier sizes (kind, S, R, C) per layer: what a slot of n tokens holds quantized
        self._tiers = [(layer.kind, layer.S, layer.R, layer.C) for layer in self.cache.layers]
        self._incoming: queue.Queue[Request] = queue.Queue()
        self._waiting: collections.deque[Request] = collections.deque()
        self._live: list[_Slotted | None] = [None] * slots
        self._lock = threading.Lock()
        self._reserved = 0  # requests submitted and not yet finished (admitted or waiting)
        self._order = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_report = 0.0

    # ------------------------------------------------------------- control
    THREAD_NAME = "lowbit-batch-engine"

    def submit(self, req: Request) -> Request:
        """Queue `req`; AdmissionError (400: can never fit; 429: full and when_full is reject)."""
        need = len(req.prompt_ids) + int(req.params.max_tokens)
        if need > self.max_context:
            raise AdmissionError(f"the request needs {need} tokens of KV ({len(req.prompt_ids)} prompt + "
                                 f"{req.params.max_tokens} max_tokens) but a slot holds {self.max_context}; "
                                 "shorten the prompt or lower max_tokens", 400, "context_length_exceeded")
        with self._lock:
            full = self._reserved >= self.slots
            if full and self.when_full == "reject":
                self.metrics.rejected()
                raise AdmissionError(f"all {self.slots} KV slots are busy and this server rejects when full; "
                                     "retry later", 429, "rate_limit_exceeded")
            self._reserved += 1
        req._t_submit = time.perf_counter()
        req._waited = full
        self._incoming.put(req)
        return req

    # -------------------------------------------------------------- worker
    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while not self._stop.is_set():
            busy = any(s is not None for s in self._live)
            self._take_incoming(block=not busy and not self._waiting)
            self._drop_cancelled()
            self._admit()
            if not any(s is not None for s in self._live):
                if self._ahead is not None:  # queued past the last live request's end: its tokens go to no one
                    cur, self._ahead = self._ahead, None
                    self._read(cur)
                self._report(force=True)
                continue
            try:
                self._prefill_one()
                self._decode()
            except Exception as e:  # a failed batched step fails the requests in it, not the server
                log.exception("batched step failed")
                self._ahead = None
                for s in list(self._live):
                    if s is not None:
                        self._retire(s, "error", f"generation failed: {type(e).__name__}: {e}")
            self._report()

    def _take_incoming(self, block: bool) -> None:
        try:
            req = self._incoming.get(timeout=0.05) if block else self._incoming.get_nowait()
        except queue.Empty:
            return
        finally:
            if block:
                self._t_mark = time.perf_counter()
        while True:
            self._waiting.append(req)
            try:
                req = self._incoming.get_nowait()
            except queue.Empty:
                return

    def _release(self) -> None:
        with self._lock:
            self._reserved -= 1

    def _drop_cancelled(self) -> None:
        for s in list(self._live):
            if s is not None and s.req.cancelled:
                self._retire(s, "cancelled")
        if any(r.cancelled for r in self._waiting):
            for r in [r for r in self._waiting if r.cancelled]:
                self._waiting.remove(r)
                self._release()
                self.metrics.finish("cancelled", 0)

    def _admit(self) -> None:
        while self._waiting:
            free = [i for i, s in enumerate(self._live) if s is None]
            if not free:
                return
            req = self._waiting.popleft()
            slot = free[0]  # lowest first: live requests stay in a short prefix of the slots
            self.cache.reset_slot(slot)
            if req._waited:
                self.metrics.waited(time.perf_counter() - req._t_submit)
            self._order += 1
            self._live[slot] = _Slotted(req, slot, self._order, self.tokenizer)

    # ------------------------------------------------------------- prefill
    def _prefill_one(self) -> None:
        todo = [s for s in self._live if s is not None and s.tok is None]
        if not todo:
            return
        s = min(todo, key=lambda x: x.order)  # the earliest admitted first: its first token comes soonest
        ids = s.req.prompt_ids
        a = s.fed
        c = min(self.prefill_chunk, len(ids) - a)
        t0 = time.perf_counter()
        try:
            x = torch.tensor([ids[a:a + c]], dtype=torch.long, device=self.device)
            pos = torch.arange(a, a + c, device=self.device)[None]
            self.cache.begin_prefill(s.slot, a, c)
            logits = self.step(x, pos, self.cache)[0]
        except Exception as e:
            log.exception("request %s failed in prefill", s.req.id)
            self._retire(s, "error", f"generation failed: {type(e).__name__}: {e}")
            return
        s.fed = s.held = a + c
        # lens follows the chunks: a decode step before the next chunk writes this slot's (inactive)
        # token at position `fed`, which the next chunk overwrites (see _guard)
        self.cache.lens[s.slot] = s.fed
        last = s.fed == len(ids)
        self._t_mark = time.perf_counter()
        self.metrics.step(self._t_mark - t0, int(last), c)  # the last chunk's logits give a token
        if last:
            self._emit_token(s, logits)

    # -------------------------------------------------------------- decode
    def _guard(self, n: int) -> list:
        """Save the ring rows that the step over slots [0, n) will clobber in slots still in their prompt.

        An inactive slot's token is written at position lens = fed like any other: sink, dense and
        sliding rows there are rewritten by the next chunk before anything reads them, but in a tiered
        layer the ring row of position fed still holds position fed - R, which the next chunk's first
        write encodes into the middle. Restoring it after the step keeps those codes right."""
        saved = []
        for s in self._live[:n]:
            if s is None or s.tok is not None or s.fed == 0:
                continue
            for layer, (kind, S, R, _C) in zip(self.cache.layers, self._tiers):
                if kind == "tiers" and s.fed >= S:
                    row = (s.fed - S) % R
                elif kind == "ring":
                    row = s.fed % R
                else:
                    continue
                saved.append((layer, s.slot, row, layer.ring_k[s.slot, :, row].clone(),
                              layer.ring_v[s.slot, :, row].clone()))
        return saved

    @staticmethod
    def _restore(saved: list) -> None:
        for layer, slot, row, k, v in saved:
            layer.ring_k[slot, :, row] = k
            layer.ring_v[slot, :, row] = v

    def _decode(self) -> None:
        """Read the step queued ahead, or launch one; while the batch stays steady, queue the next first."""
        rows = [s for s in self._live if s is not None and s.tok is not None]
        cur, self._ahead = self._ahead, None
        if cur is None:
            if not rows:
                return
            cur = self._launch(rows)
        elif rows != cur.rows:  # rows left or joined since it was queued: read it, launch afresh next round
            self._read(cur)
            return
        if self.decode_ahead and self._steady(cur):
            self._ahead = self._launch_again(cur)
        self._read(cur)

    def _steady(self, cur: _Launched) -> bool:
        """The next step may run on cur's own argmax: all greedy, and no slot of its width still in its prompt
        (whose ring rows the step would clobber: _guard)."""
        return cur.greedy and not any(s is not None and s.tok is None for s in self._live[:cur.width])

    def _launch(self, rows: list) -> _Launched:
        n = self.slots if self.batch_invariant else max(s.slot for s in rows) + 1
        width = self.graphs.bucket_for(n) if self.graphs is not None else n
        cur = _Launched(rows, n, width, all(s.req.params.temperature <= 0.0 for s in rows), time.perf_counter())
        ids = [0] * width
        active = [False] * width
        for s in rows:
            ids[s.slot], active[s.slot] = s.tok, True
        saved = self._guard(width)
        if self.graphs is not None:
            g = self.graphs
            g.ids[:width, 0].copy_(torch.tensor(ids, dtype=torch.long), non_blocking=False)
            g.active[:width].copy_(torch.tensor(active, dtype=torch.bool))
            self._run(cur)
        else:
            cur.active = torch.tensor(active, dtype=torch.bool, device=self.device)
            self._run(cur, torch.tensor(ids, dtype=torch.long, device=self.device)[:, None])
        self._restore(saved)
        return cur

    def _launch_again(self, cur: _Launched) -> _Launched:
        """The step after `cur` for the same rows, fed cur's argmax on the device (no host copy, no sync)."""
        nxt = _Launched(cur.rows, cur.n, cur.width, True, time.perf_counter())
        nxt.active = cur.active
        if self.graphs is not None:
            self._run(nxt)  # the captured step wrote cur's argmax into its ids (inactive rows keep theirs)
        else:
            self._run(nxt, cur.tokens[:, None])  # the eager step's width is its live prefix
        return nxt

    def _run(self, cur: _Launched, ids: torch.Tensor | None = None) -> None:
        """Queue the step; keep what the host will read of it (graphs: its argmax copied to pinned memory
        before any later step can overwrite ids; logits are read before the next launch, as non-greedy rows
        never run ahead)."""
        if self.graphs is not None:
            g = self.graphs
            g.replay(cur.n)
            self._launches += 1
            if cur.greedy and self._tokens_host is not None:
                buf = self._tokens_host[self._launches % 2][:cur.n]
                buf.copy_(g.ids[:cur.n, 0], non_blocking=True)
                cur.tokens, cur.event = buf, torch.cuda.Event()
                cur.event.record()
            elif cur.greedy:  # a stand-in for the captured step that runs on the CPU (tests)
                cur.tokens = g.ids[:cur.n, 0].clone()
            else:
                cur.logits = g.logits[:cur.n]
        else:
            logits = eager_decode(self.step, self.cache, ids, cur.active)[:cur.n]
            if cur.greedy:
                cur.tokens = logits.argmax(-1)
            else:
                cur.logits = logits

    def _read(self, cur: _Launched) -> None:
        """Hand cur's tokens to its rows that are still live (a row retired after its launch is dropped)."""
        if cur.greedy:
            if cur.event is not None:
                cur.event.synchronize()
            picks, host = cur.tokens.tolist(), None
        else:
            picks, host = None, cur.logits.float().cpu()
        now = time.perf_counter()
        live = [s for s in cur.rows if self._live[s.slot] is s]
        self.metrics.step(now - max(cur.t0, self._t_mark), len(live))
        self._t_mark = now
        for s in live:
            s.held += 1
            if picks is not None:
                self._finish_token(s, int(picks[s.slot]))
            else:
                self._emit_token(s, host[s.slot])

    # ------------------------------------------------------------- tokens
    def _emit_token(self, s: _Slotted, logits: torch.Tensor) -> None:
        p = s.req.params
        if p.temperature <= 0.0:
            tok = int(torch.argmax(logits))
        else:
            tok = sample(logits.float().cpu(), p.temperature, p.top_p, s.generator)
        self._finish_token(s, tok)

    def _finish_token(self, s: _Slotted, tok: int) -> None:
        """One new token of request s: stream it, or end the request (EOS, stop string, length)."""
        req, p = s.req, s.req.params
        req.completion_tokens += 1
        finish = None
        if tok in self.eos:
            finish = "stop"
        else:
            delta = s.detok.add(tok)
            if delta:
                req.emit("delta", delta)
            if s.detok.stopped:
                finish = "stop"
            elif req.completion_tokens >= p.max_tokens or len(req.prompt_ids) + req.completion_tokens >= self.max_context:
                finish = "length"
        if finish is None:
            s.tok = tok
            return
        rest = s.detok.flush() if not s.detok.stopped else ""
        if rest:
            req.emit("delta", rest)
        self._retire(s, finish)

    def _quantized(self, n: int) -> int:
        """Tokens a slot of n tokens holds in the packed middle (the most over layers)."""
        return max((max(0, min(n - S - R, C)) for kind, S, R, C in self._tiers if kind == "tiers"), default=0)

    def _retire(self, s: _Slotted, reason: str, message: str | None = None) -> None:
        if self._live[s.slot] is s:
            self._live[s.slot] = None
            # lens 0: while the slot is free, steps over the prefix write it at position 0, which the
            # next request's first chunk overwrites
            self.cache.reset_slot(s.slot)
        self._release()
        quantized = self._quantized(s.held) if self.scheme.quantized else 0
        self.metrics.finish(reason, quantized)
        req = s.req
        if reason == "error":
            req.emit("error", message)
        elif reason != "cancelled":
            n = len(req.prompt_ids)
            req.emit("done", {"finish_reason": reason, "quantized_tokens": quantized, "engine": self.path,
                              "usage": {"prompt_tokens": n, "completion_tokens": req.completion_tokens,
                                        "total_tokens": n + req.completion_tokens}})

    def _report(self, force: bool = False) -> None:
        now = time.perf_counter()
        if not force and now - self._last_report < REPORT_EVERY_S:
            return
        self._last_report = now
        live = [s for s in self._live if s is not None]
        quantized = sum(self._quantized(s.held) for s in live) if self.scheme.quantized else 0
        # the static cache's buffers are held whatever the load: bytes are its capacity
        self.metrics.set_kv(self._bytes, sum(s.held for s in live), quantized, len(live),
                            len(self._waiting) + self._incoming.qsize())
