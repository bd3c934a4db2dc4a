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
            }

    def prometheus(self) -> str:
        """The same numbers in Prometheus text format (GET /metrics?format=prometheus)."""
        s = self.snapshot()
        name = s["kv_scheme"].get("name", "?")
        lines = [
            f'lowbit_kv_scheme_info{{scheme="{name}",cache="{s["kv_scheme"].get("cache", "?")}"}} 1',
            f"lowbit_kv_bytes_held {s['kv']['bytes_held']}",
            f"lowbit_kv_peak_bytes_held {s['kv']['peak_bytes_held']}",
            f"lowbit_kv_tokens_held {s['kv']['tokens_held']}",
            f"lowbit_kv_quantized_tokens_held {s['kv']['quantized_tokens_held']}",
            f"lowbit_kv_quantized_tokens_finished_total {s['kv']['quantized_tokens_total_finished']}",
            f"lowbit_active_requests {s['kv']['active_requests']}",
            f"lowbit_queue_depth {s['queue_depth']}",
            f"lowbit_prompt_tokens_total {s['tokens']['prompt_total']}",
            f"lowbit_generated_tokens_total {s['tokens']['generated_total']}",
            f"lowbit_generated_tokens_per_second_busy {s['tokens']['per_s_busy']}",
            f"lowbit_client_errors_total {s['client_errors']}",
        ]
        lines += [f'lowbit_requests_total{{endpoint="{k}"}} {v}' for k, v in s["requests"].items()]
        lines += [f'lowbit_finished_total{{reason="{k}"}} {v}' for k, v in s["finished"].items()]
        return "\n".join(lines) + "\n"
