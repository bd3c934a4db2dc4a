"""The evaluation loop: every entry over the same windows, fed through its cache C tokens at a time.

Entries run in lockstep, chunk by chunk: for each window, each entry gets a fresh cache; for each
chunk the reference (bf16 DynamicCache) runs first and its log-probs [C, V] score every other
entry's log-probs of the same chunk (KL(ref || entry), top-1 agreement). So only one chunk of
reference log-probs is ever held (128 x 262144 floats for Gemma, not 2048 x 262144), and nothing is
recomputed. An entry's `seconds` is the wall time of its own forward calls (cache updates and
quantization included; scoring, which is the same for all, excluded); `cpu_seconds` is the process
CPU time of the same calls, which a machine shared with other jobs distorts less than wall time.

A quantized entry that has quantized zero rows after the first window aborts the run (dead hook:
a cache that is not on the model's write path would otherwise report bf16 numbers as low-bit).
A peer that fails (construction or forward) becomes `cannot run: <reason>`; our own entries raise.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from lowbit.backends.torch_stream import register
from lowbit.core.errors import LowbitError
from lowbit.eval.peers import Accounting, Entry
from lowbit.eval.perplexity import Scores, chunk_targets, forward_chunk


@dataclass
class EntryResult:
    """Everything measured for one entry (one table row)."""

    name: str
    kind: str
    config: dict
    scores: Scores = field(default_factory=Scores)
    accounting: Accounting = field(default_factory=Accounting)
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    backend: dict = field(default_factory=dict)
    cannot_run: str | None = None
    ref_ppl: float | None = None

    @property
    def ok(self) -> bool:
        return self.cannot_run is None

    @property
    def delta_ppl_pct(self) -> float | None:
        if not self.ok or not self.ref_ppl:
            return None
        return 100.0 * (self.scores.ppl / self.ref_ppl - 1.0)


def _peer_failure(e: Exception) -> str:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {msg}"[:300]


@torch.no_grad()
def evaluate(model, windows: torch.Tensor, entries: list[Entry], *, chunk: int = 128,
             progress: bool = True) -> list[EntryResult]:
    """Run `entries` (the first must be the reference) over `windows` [N, L] in chunks of `chunk`.

    Returns one EntryResult per entry, in order. Raises LowbitError on a dead hook.
    """
    if not entries or entries[0].kind != "reference":
        raise ValueError("evaluate: the first entry must be the reference")
    if windows.dim() != 2 or windows.shape[1] < 2:
        raise LowbitError(f"evaluation windows must be [N, L] with L >= 2, got {tuple(windows.shape)}")
    if chunk < 1:
        raise LowbitError(f"--chunk must be >= 1, got {chunk}")
    results = [EntryResult(e.name, e.kind, dict(e.config), cannot_run=e.cannot_run) for e in entries]
    live = [i for i, r in enumerate(results) if r.ok]
    own_attention = model.config._attn_implementation

    n_win, L = int(windows.shape[0]), int(windows.shape[1])
    n_chunks = (L + chunk - 1) // chunk
    bar = _progress(n_win * n_chunks, progress)
    try:
        for w_idx in range(n_win):
            window = windows[w_idx]
            caches = {}
            for i in list(live):
                e = entries[i]
                try:
                    caches[i] = e.make_cache(model)
                except Exception as ex:
                    if e.kind != "hf-quantized":
                        raise
                    results[i].cannot_run = _peer_failure(ex)
                    live.remove(i)
            for s in range(0, L, chunk):
                ids = window[s : s + chunk][None, :]  # [1, C]
                n, targets = chunk_targets(window, s, s + chunk)
                ref_logp = ref_p = ref_top = None
                for i in list(live):
                    e, r = entries[i], results[i]
                    use_attention(model, e.attention or own_attention)
                    t0, c0 = time.perf_counter(), time.process_time()
                    try:
                        logits = forward_chunk(model, ids, caches[i])  # [1, C, V]
                    except Exception as ex:
                        if e.kind != "hf-quantized":
                            raise
                        r.cannot_run = _peer_failure(ex)
                        live.remove(i)
                        caches.pop(i, None)
                        continue
                    r.seconds += time.perf_counter() - t0
                    r.cpu_seconds += time.process_time() - c0
                    logp = torch.log_softmax(logits[0, :n], dim=-1)  # [n, V]
                    del logits
                    if e.kind == "reference":
                        r.scores.add(logp, targets)
                        ref_logp, ref_p, ref_top = logp, logp.exp(), logp.argmax(-1)
                    else:
                        r.scores.add(logp, targets, ref_logp, ref_p, ref_top)
                del ref_logp, ref_p, ref_top
                bar.update(1)
            for i in list(live):
                results[i].accounting += entries[i].account(caches[i])
                _note_backend(results[i], caches[i], entries[i].attention or own_attention)
            del caches
            if w_idx == 0:
                _dead_hook_check(entries, results, live)
    finally:
        bar.close()
        use_attention(model, own_attention)
    ref_ppl = results[0].scores.ppl
    for r in results:
        r.ref_ppl = ref_ppl
    return results


def _note_backend(r: EntryResult, cache, attention: str) -> None:
    """What produced the row: the attention implementation, the cache class, and for a lowbit cache its
    own count of attention calls per backend (torch / triton) and any fallback notes."""
    b = r.backend
    b.setdefault("attention", attention)
    b.setdefault("cache", type(cache).__name__)
    calls = getattr(cache, "backend_calls", None)
    if calls:
        for k, v in calls.items():
            b.setdefault("calls", {})[k] = b.get("calls", {}).get(k, 0) + int(v)
    for note in getattr(cache, "backend_notes", None) or []:
        if note not in b.setdefault("notes", []):
            b["notes"].append(note)


def use_attention(model, name: str) -> None:
    """Switch the model's attention implementation (a config field read at every forward; ~0.1 ms)."""
    if model.config._attn_implementation != name:
        if name == "lowbit":
            register()
        model.set_attn_implementation(name)


def _dead_hook_check(entries: list[Entry], results: list[EntryResult], live: list[int]) -> None:
    for i in list(live):
        if entries[i].quantizes and results[i].accounting.quantized_rows == 0:
            if entries[i].kind == "hf-quantized":  # a peer's problem is its row, not the run's
                results[i].cannot_run = "quantized 0 K/V rows in the first window"
                live.remove(i)
                continue
            raise LowbitError(
                f"scheme {entries[i].name} quantized 0 K/V rows in the first window: its cache never quantized a "
                "token (the window fits in sink + recent, or the model wrote K/V around the cache); lengthen "
                "--seq-len past sink + recent + page, or lower --sink / --recent"
            )


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, enabled: bool):
    if not enabled:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="eval (window x chunk)", unit="chunk", leave=False)
