"""vLLM's prefix cache and lowbit's exact recent tier: the scheduler side (imports vLLM only in patch()).

A prefix-cache hit hands a request the cached full blocks of its prompt's first P tokens and starts
it at P. lowbit keeps the last `recent` rows of a request exact (dense); for a hit those are rows
L - recent .. L - 1 of the request's L tokens after its first step, and the part of them below P was
stored by another request, which kept them dense only while they were in *its* recent window. So
vLLM's scheduler is made to leave the last `recent` tokens of every prompt out of the hit:

    hit <= num_tokens - recent   (then block-aligned down by vLLM, as always)

The request then computes every row its recent window holds and stores it dense itself, the sink
rows come from the shared first blocks (paged.TierArena.hold keeps them), and the middle rows'
codes from the shared blocks: exactly what a miss whose prefill had a chunk boundary at the hit
reads. Cost: up to recent + block_size - 1 prompt tokens recomputed per hit; nothing stored for
them. (Storing the boundary rows instead would mean a dense copy of every cached block: any block
can end a later hit, and recent >= block_size.)

How: vLLM 0.32 computes every hit through its KV cache coordinator's find_longest_cache_hit(
block_hashes, max_cache_hit_length) (and find_longest_cache_hit_per_group for KV connectors), with
max_cache_hit_length = num_tokens - 1. patch() wraps the Scheduler's __init__ so that, for a model
directory whose sidecar has a recent tier and with prefix caching on, those two methods of that
scheduler's coordinator get max_cache_hit_length - (recent - 1). Asking for a shorter hit is always
valid for vLLM (fewer cached tokens; the rest is computed). PATCHED says whether the wrap is in place
(True) or why not (a string); the backend refuses prefix caching with a recent tier without it.
"""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger("lowbit.vllm_plugin")
PATCHED: bool | str = "patch() not run in this process"
HIT_METHODS = ("find_longest_cache_hit", "find_longest_cache_hit_per_group")


def limit(max_cache_hit_length: int, recent: int) -> int:
    """vLLM's longest allowed hit (num_tokens - 1) -> lowbit's: num_tokens - recent (0 at least)."""
    return max(0, max_cache_hit_length - max(0, recent - 1))


def _limited(find, recent: int):
    def find_longest_cache_hit(block_hashes, max_cache_hit_length, *args, **kwargs):
        return find(block_hashes, limit(max_cache_hit_length, recent), *args, **kwargs)

    find_longest_cache_hit.lowbit_recent = recent
    return find_longest_cache_hit


def recent_of(model_dir: str) -> int:
    """The recent tier of a lowbit model directory's sidecar (0: none, or not a lowbit directory)."""
    from lowbit.vllm_plugin import sidecar

    p = Path(model_dir)
    if not sidecar.has_sidecar(p):
        return 0
    return int(sidecar.scheme_of(sidecar.read(p), p).recent)


def install(scheduler, vllm_config) -> int:
    """Hold back a hit's recent window in this scheduler (see the module docstring); returns the tokens
    held back (0: prefix caching off, no sidecar, or no recent tier -- nothing to do)."""
    from lowbit.core.errors import LowbitError

    cache = getattr(vllm_config, "cache_config", None)
    if not getattr(cache, "enable_prefix_caching", False):
        return 0
    recent = recent_of(str(vllm_config.model_config.model))
    if not recent:
        return 0
    coord = getattr(getattr(scheduler, "kv_cache_manager", None), "coordinator", None)
    if coord is None or not callable(getattr(coord, HIT_METHODS[0], None)):
        raise LowbitError("lowbit plugin: this vLLM's scheduler has no kv_cache_manager.coordinator."
                          f"{HIT_METHODS[0]} to hold back a prefix-cache hit's recent tier: start vLLM with "
                          "--no-enable-prefix-caching")
    for name in HIT_METHODS:
        f = getattr(coord, name, None)
        if callable(f) and getattr(f, "lowbit_recent", None) is None:
            setattr(coord, name, _limited(f, recent))  # on this instance only
    log.warning("lowbit plugin: %s", f"prefix caching: a hit leaves the prompt's last {recent} tokens (the exact "
                "recent tier) to be computed, so a hit reads what a miss chunked at the hit reads")
    return recent


def patch() -> None:
    """Wrap vLLM's Scheduler.__init__ (idempotent) so every scheduler runs install(). Never raises;
    PATCHED records the outcome."""
    global PATCHED
    try:
        from vllm.v1.core.sched import scheduler as sched

        cls = sched.Scheduler
        init = cls.__init__
        if getattr(init, "lowbit_wrapped", False):
            PATCHED = True
            return

        def __init__(self, vllm_config, *args, **kwargs):
            init(self, vllm_config, *args, **kwargs)
            install(self, vllm_config)

        __init__.lowbit_wrapped = True
        __init__.__wrapped__ = init
        cls.__init__ = __init__
        PATCHED = True
    except Exception as e:  # noqa: BLE001  (the backend refuses prefix caching with a recent tier then)
        PATCHED = f"{type(e).__name__}: {e}"
