"""Server counters: requests, tokens, throughput, and the KV memory actually held.

One Metrics object is shared by the HTTP handlers (request counts, errors) and the engine's
worker thread (tokens, KV bytes). All updates take a lock; `snapshot()` returns plain JSON.
KV bytes and quantized tokens are measured by the engine from the caches it holds (see
lowbit.serve.kvcache.cache_stats), never derived from the scheme's nominal bits.
"""

from __future__ import annotations

import threading
import time
from collections import deque

# Throughput is reported over this trailing window (seconds) and over the server's lifetime.
RATE_WINDOW_S = 30.0


class Metrics:
    def __init__(self, scheme: dict):
        self._lock = threading.Lock()
        self.started = time.time()
        self.scheme = scheme  # what the engine actually serves (see engine.served_scheme)
        self.requests = {"completions": 0, "chat": 0}
        self.finished = {"stop": 0, "length": 0, "cancelled": 0, "error": 0}
        self.client_errors = 0
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.busy_s = 0.0  # worker time spent in forward passes
        self.kv = {"bytes_held": 0, "tokens_held": 0, "quantized_tokens_held": 0, "active_requests": 0}
        self.quantized_tokens_total = 0  # over finished requests: tokens held quantized at their end
        self.peak_kv_bytes = 0
        self.queue_depth = 0
        self._events: deque[tuple[float, int]] = deque()  # (time, tokens generated in a step)
        # which engine and decode path serve (set by the engine); admission: waits and rejections
        self.engine = {"engine": "single", "path": "eager"}
        self.waited_total = 0
        self.wait_s_total = 0.0
        self.wait_s_max = 0.0
        self.rejected_total = 0

    # ------------------------------------------------------------ HTTP side
    def request(self, kind: str) -> None:
        with self._lock:
            self.requests[kind] += 1

    def client_error(self) -> None:
        with self._lock:
            self.client_errors += 1

    # ---------------------------------------------------------- engine side
    def step(self, seconds: float, new_tokens: int, prompt_tokens: int = 0) -> None:
        now = time.time()
        with self._lock:
            self.busy_s += seconds
            self.generated_tokens += new_tokens
            self.prompt_tokens += prompt_tokens
            if new_tokens:
                self._events.append((now, new_tokens))
            while self._events and self._events[0][0] < now - RATE_WINDOW_S:
                self._events.popleft()

    def set_engine(self, info: dict) -> None:
        with self._lock:
            self.engine = dict(info)

    def waited(self, seconds: float) -> None:
        """A request that found every slot taken was admitted after `seconds` in the queue."""
        with self._lock:
            self.waited_total += 1
            self.wait_s_total += seconds
            self.wait_s_max = max(self.wait_s_max, seconds)

    def rejected(self) -> None:
        with self._lock:
            self.rejected_total += 1

    def finish(self, reason: str, quantized_tokens: int) -> None:
        with self._lock:
            self.finished[reason] = self.finished.get(reason, 0) + 1
            self.quantized_tokens_total += quantized_tokens

    def set_kv(self, bytes_held: int, tokens_held: int, quantized_tokens_held: int, active: int, queued: int) -> None:
        with self._lock:
            self.kv = {"bytes_held": bytes_held, "tokens_held": tokens_held,
                       "quantized_tokens_held": quantized_tokens_held, "active_requests": active}
            self.peak_kv_bytes = max(self.peak_kv_bytes, bytes_held)
            self.queue_depth = queued

    # ------------------------------------------------------------ reporting
    def snapshot(self) -> dict:
        now = time.time()
        with self._lock:
            recent = [n for t, n in self._events if t >= now - RATE_WINDOW_S]
            window = min(RATE_WINDOW_S, now - self.started)
            return {
                "uptime_s": round(now - self.started, 3),
                "kv_scheme": self.scheme,
                "requests": dict(self.requests),
                "finished": dict(self.finished),
                "client_errors": self.client_errors,
                "queue_depth": self.queue_depth,
                "tokens": {
                    "prompt_total": self.prompt_tokens,
                    "generated_total": self.generated_tokens,
                    # generated tokens per second of worker compute time (prefill included)
                    "per_s_busy": round(self.generated_tokens / self.busy_s, 3) if self.busy_s else 0.0,
                    f"per_s_last_{int(RATE_WINDOW_S)}s": round(sum(recent) / window, 3) if window > 0 else 0.0,
                },
                "kv": {**self.kv, "peak_bytes_held": self.peak_kv_bytes,
                       "quantized_tokens_total_finished": self.quantized_tokens_total},
                "engine": dict(self.engine),
                "admission": {"waited_total": self.waited_total, "wait_seconds_total": round(self.wait_s_total, 6),
                              "wait_seconds_max": round(self.wait_s_max, 6), "rejected_total": self.rejected_total,
                              "slots": self.engine.get("slots"), "slots_active": self.kv["active_requests"]},
            }

    def prometheus(self) -> str:
        """The same numbers in Prometheus text exposition format 0.0.4 (GET /metrics with an Accept header
        naming text/plain or openmetrics, as Prometheus scrapers send, or GET /metrics?format=prometheus).
        Every sample has # HELP and # TYPE lines; *_total are counters, the rest gauges."""
        s = self.snapshot()
        sch = s["kv_scheme"]
        kv, tok = s["kv"], s["tokens"]
        samples = [  # (name, type, help, [(labels, value)])
            ("lowbit_kv_scheme_info", "gauge", "the KV scheme served (always 1)",
             [({"scheme": sch.get("name", "?"), "cache": sch.get("cache", "?")}, 1)]),
            ("lowbit_engine_info", "gauge", "the engine and decode path serving (always 1)",
             [({"engine": s["engine"].get("engine", "?"), "path": s["engine"].get("path", "?")}, 1)]),
            ("lowbit_uptime_seconds", "gauge", "seconds since the server started", [({}, s["uptime_s"])]),
            ("lowbit_kv_bytes_held", "gauge", "KV cache bytes held now, measured from the tensors",
             [({}, kv["bytes_held"])]),
            ("lowbit_kv_peak_bytes_held", "gauge", "largest KV bytes held so far", [({}, kv["peak_bytes_held"])]),
            ("lowbit_kv_tokens_held", "gauge", "tokens held in the KV caches now", [({}, kv["tokens_held"])]),
            ("lowbit_kv_quantized_tokens_held", "gauge", "of those, tokens held quantized",
             [({}, kv["quantized_tokens_held"])]),
            ("lowbit_kv_quantized_tokens_finished_total", "counter",
             "tokens held quantized at the end of finished requests", [({}, kv["quantized_tokens_total_finished"])]),
            ("lowbit_active_requests", "gauge", "requests being generated", [({}, kv["active_requests"])]),
            ("lowbit_queue_depth", "gauge", "requests waiting for a slot", [({}, s["queue_depth"])]),
            ("lowbit_slots", "gauge", "KV slots of the batching engine (0: one cache per request)",
             [({}, s["admission"]["slots"] or 0)]),
            ("lowbit_requests_waited_total", "counter", "requests that found every slot taken and waited",
             [({}, s["admission"]["waited_total"])]),
            ("lowbit_request_wait_seconds_total", "counter", "seconds requests waited for a slot, summed",
             [({}, s["admission"]["wait_seconds_total"])]),
            ("lowbit_request_wait_seconds_max", "gauge", "longest wait for a slot so far",
             [({}, s["admission"]["wait_seconds_max"])]),
            ("lowbit_requests_rejected_total", "counter", "requests refused with 429 because every slot was taken",
             [({}, s["admission"]["rejected_total"])]),
            ("lowbit_prompt_tokens_total", "counter", "prompt tokens prefilled", [({}, tok["prompt_total"])]),
            ("lowbit_generated_tokens_total", "counter", "tokens generated", [({}, tok["generated_total"])]),
            ("lowbit_generated_tokens_per_second_busy", "gauge", "generated tokens per second of worker compute",
             [({}, tok["per_s_busy"])]),
            ("lowbit_client_errors_total", "counter", "requests answered with a 4xx error",
             [({}, s["client_errors"])]),
            ("lowbit_requests_total", "counter", "requests received, by endpoint",
             [({"endpoint": k}, v) for k, v in s["requests"].items()]),
            ("lowbit_finished_total", "counter", "requests finished, by reason",
             [({"reason": k}, v) for k, v in s["finished"].items()]),
        ]
        lines = []
        for name, kind, help_, values in samples:
            lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
            for labels, v in values:
                lab = ",".join(f'{k}="{_escape(str(x))}"' for k, x in labels.items())
                lines.append(f"{name}{{{lab}}} {v}" if lab else f"{name} {v}")
        return "\n".join(lines) + "\n"


PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def wants_prometheus(accept: str | None) -> bool:
    """True when an Accept header asks for Prometheus text (text/plain or openmetrics) rather than JSON.
    `*/*` alone (curl, browsers' fetch) gets JSON, the default."""
    a = (accept or "").lower()
    if "application/json" in a:
        return False
    return "text/plain" in a or "openmetrics" in a


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
