"""Peak memory of a block of work: process RSS on the CPU (sampled by a thread), CUDA allocator peak on a GPU.

    with PeakMemory(device) as pm:
        ...
    pm.peak_mb, pm.start_mb      # MiB; on CUDA torch.cuda.max_memory_allocated since the block began

RSS is read from /proc/self/statm every `interval` seconds (and once at the end), so a peak shorter than
the interval can be missed; it is the whole process (Python, torch, every model still held), which is what
a CPU deployment pays. Where /proc is missing, resource.getrusage's lifetime maximum is reported instead
(and `source` says so).
"""

from __future__ import annotations

import os
import resource
import threading

import torch

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_mb() -> float | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE / 2**20
    except (OSError, ValueError, IndexError):
        return None


class PeakMemory:
    def __init__(self, device="cpu", interval: float = 0.005):
        self.device = torch.device(device)
        self.interval = interval
        self.peak_mb = self.start_mb = 0.0
        self.source = ""
        self._stop = threading.Event()
        self._thread = None

    def _poll(self):
        while not self._stop.wait(self.interval):
            r = rss_mb()
            if r is not None and r > self.peak_mb:
                self.peak_mb = r

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start_mb = torch.cuda.memory_allocated(self.device) / 2**20
            self.source = "cuda max_memory_allocated"
            return self
        r = rss_mb()
        if r is None:
            self.source = "getrusage ru_maxrss (process lifetime)"
            return self
        self.start_mb = self.peak_mb = r
        self.source = "rss (/proc/self/statm, sampled)"
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_mb = torch.cuda.max_memory_allocated(self.device) / 2**20
            return False
        if self._thread is None:
            self.peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            return False
        self._stop.set()
        self._thread.join()
        r = rss_mb()
        if r is not None:
            self.peak_mb = max(self.peak_mb, r)
        return False
