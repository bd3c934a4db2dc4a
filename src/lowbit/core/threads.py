"""The one CPU thread policy of every `lowbit` command: 1 torch thread unless --threads says otherwise.

Why 1: lowbit's CPU work is small matmuls (a 135M model, batch 1, 128-token chunks), where extra
intra-op threads buy little and, on a machine whose cores other jobs also use, cost a lot: torch's
default (one thread per core) made a 1 x 1024 `lowbit eval` of smollm2-135m take 10-35 s on a
shared 2-core machine instead of 1.5 s with 1 thread, and the demo ran 12 minutes with 2 threads
vs 3 with 1. On a machine of your own with many cores, `--threads N` (or `--threads all`, torch's
own default of one thread per core) is faster for GPTQ, calibration and serving.

    lowbit --threads 4 eval ...      # global flag, before the command
    lowbit eval --threads 4 ...      # the same flag after the command (it wins if both are given)

cli.main applies the policy once, before any command runs (lowbit.core.threads.apply); commands read
the effective count from args.threads. GPU work is not affected (it sets CPU threads only).
"""

from __future__ import annotations

import argparse

DEFAULT_THREADS = 1
ALL = "all"  # torch's own default: one intra-op thread per physical core

HELP = (f"torch CPU threads (default {DEFAULT_THREADS}: fastest on a shared or small CPU; "
        f"N, or '{ALL}' for torch's one per core on a machine of your own)")


_torch_default: int | None = None


def parse_threads(text: str) -> int | str:
    """argparse type of --threads: a positive int, or 'all'."""
    if text.strip().lower() == ALL:
        return ALL
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a thread count; give 1 or more, or '{ALL}'") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n}: give 1 or more threads, or '{ALL}'")
    return n


def resolve(*given: int | str | None) -> int | str:
    """The first of `given` that is not None (command flag first, then the global one), else the default."""
    return next((g for g in given if g is not None), DEFAULT_THREADS)


def apply(threads: int | str) -> int:
    """Set torch's intra-op thread count (imports torch); returns the count now in effect."""
    global _torch_default
    import torch

    if _torch_default is None:  # before we ever set it: torch's own choice, what 'all' restores
        _torch_default = torch.get_num_threads()
    n = _torch_default if threads == ALL else threads
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"threads must be a positive int or {ALL!r}, got {threads!r}")
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return torch.get_num_threads()
