"""`lowbit bench gemm`: the weight GEMMs against cuBLAS bf16, the audit's sweep, one run.

Every row times, in the same process and the same way (kernels.bench.graph_time_ms: a CUDA graph of
back-to-back calls cycling through enough weight/input sets that a cycle is >= 4x the L2), the bf16
F.linear and the cell the dispatch table picks (choosing cells is benchmarks/gemm_explore.py's job).
Row: {"scheme", "shape", "M", "N", "K", "ms", "bf16_ms", "ratio" (bf16_ms / ms), "kernel", "tbs"
(weight + activation + output bytes / ms, A16) or "tops" (A8, activation quantization included),
"bf16_tbs"}; with read_floor, also "read_ms" (the fastest single read of the packed weight's bytes,
lowbit.tools.bench.read_floor, timed the same way), "ceiling" (bf16_ms / read_ms: the best ratio any kernel that
reads the weight once could reach in this harness) and "bf16_read_ms" (the same read of the bf16 weight).
"""

from __future__ import annotations

import platform
import time

import torch

from lowbit.core.errors import LowbitError
from lowbit.kernels.gemm.dispatch import Dispatch, run_cell
from lowbit.kernels.gemm.triton_gemm import random_weight
from lowbit.tools.audit.gemm import DIT_MS, DIT_SHAPES, LLM_MS, LLM_SHAPES, SCHEMES
from lowbit.tools.bench.attention import graph_time_ms, n_buffers
from lowbit.tools.bench.read_floor import read_floor_ms

BENCH_SCHEMES = ("w4a16-g128", "w8a16", "w8a8", "w4a16-g64-asym", "w4a8")
SECONDARY_SHAPES = ("llama3-8b gate/up", "llama3-8b down")


def bench_shape(scheme, shape, K, N, ms, dispatch, *, log=print, t0=0.0, read_floor: bool = False) -> list[dict]:
    """Rows for every M in `ms` on one (scheme, shape); weight sets made once, inputs per M."""
    import torch.nn.functional as F

    pw0 = random_weight(scheme, N, K, "cuda")
    floor = {}
    if read_floor:
        read_ms, cfg = read_floor_ms(pw0.nbytes())
        floor = {"read_ms": read_ms, "read_config": cfg, "bf16_read_ms": read_floor_ms(N * K * 2)[0]}
    n = n_buffers(pw0.nbytes(), 24e9)
    pws = [pw0] + [random_weight(scheme, N, K, "cuda", seed=i) for i in range(1, n)]
    nb = n_buffers(N * K * 2, 24e9)
    ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(nb)]
    a8 = pw0.a_bits == 8
    rows = []
    for M in ms:
        nx = max(len(pws), len(ws))
        xs = [torch.randn(M, K, device="cuda", dtype=torch.bfloat16) for _ in range(nx)]

        cell = dispatch.choose(pw0.kind, M, pw0)
        bf16_ms = graph_time_ms([(lambda w=ws[i % len(ws)], x=xs[i]: F.linear(x, w)) for i in range(nx)],
                                reps=3, target_ms=10)
        ms_ = graph_time_ms([(lambda p=pws[i % len(pws)], x=xs[i], c=cell: run_cell(c, x, p)) for i in range(nx)],
                            reps=3, target_ms=10)
        row = {"scheme": scheme, "shape": shape, "M": M, "N": N, "K": K, "ms": ms_, "bf16_ms": bf16_ms,
               "ratio": bf16_ms / ms_, "kernel": cell.kernel}
        if a8:
            row["tops"] = 2 * M * N * K / (ms_ * 1e-3) / 1e12
        else:
            row["tbs"] = (pw0.nbytes() + M * K * 2 + M * N * 2) / (ms_ * 1e-3) / 1e12
        row["bf16_tbs"] = (N * K * 2 + M * K * 2 + M * N * 2) / (bf16_ms * 1e-3) / 1e12
        if floor:
            row.update(floor, ceiling=bf16_ms / floor["read_ms"])
        rows.append(row)
        ceil = f"  read {floor['read_ms'] * 1e3:6.1f} us (ceiling x{row['ceiling']:.2f})" if floor else ""
        log(f"{scheme:<15} {shape:<18} M={M:<6} {ms_ * 1e3:8.1f} us  bf16 {bf16_ms * 1e3:8.1f} us  "
            f"x{row['ratio']:.2f}  {cell.kernel}{ceil}  [{time.time() - t0:.0f}s]")
        del xs
    del ws, pws
    torch.cuda.empty_cache()
    return rows


def check_selection(schemes, ms, shapes) -> None:
    """A one-line LowbitError for a scheme, M or shape name the sweep does not have (before any GPU work)."""
    bad = [x for x in schemes if x not in SCHEMES]
    if bad:
        raise LowbitError(f"bench gemm: unknown scheme(s) {', '.join(bad)}; use some of {', '.join(SCHEMES)}")
    if ms is not None and (bad := [m for m in ms if m not in set(LLM_MS) | set(DIT_MS)]):
        raise LowbitError(f"bench gemm: M {bad} is not in the sweep; use some of {sorted(set(LLM_MS) | set(DIT_MS))}")
    names = [n for n, _, _ in LLM_SHAPES + DIT_SHAPES]
    if shapes is not None and (bad := [x for x in shapes if x not in names]):
        raise LowbitError(f"bench gemm: unknown shape(s) {bad}; use names from: {'; '.join(names)}")


def run(schemes=BENCH_SCHEMES, *, dit: bool = True, log=print, ms=None, shapes=None, read_floor: bool = False) -> dict:
    """The sweep; ms / shapes (names) narrow it (default: the audit's); read_floor adds the read-floor columns."""
    import triton

    dispatch = Dispatch.for_device("cuda")
    rows = []
    t0 = time.time()
    for scheme in schemes:
        main = scheme in ("w4a16-g128", "w8a16", "w8a8")
        cases = [(s, LLM_MS) for s in LLM_SHAPES] + ([(s, DIT_MS) for s in DIT_SHAPES] if dit else [])
        if not main:  # the secondary schemes on the two big LLM shapes only
            cases = [(s, LLM_MS) for s in LLM_SHAPES if s[0] in SECONDARY_SHAPES]
        for (shape, K, N), sweep in cases:
            if K % 128 and scheme.endswith("g128") or (scheme == "w4a8" and K % 128):
                continue
            if shapes is not None and shape not in shapes:
                continue
            sweep = tuple(m for m in sweep if ms is None or m in ms)
            if sweep:
                rows += bench_shape(scheme, shape, K, N, sweep, dispatch, log=log, t0=t0, read_floor=read_floor)
    return {"env": {"gpu": torch.cuda.get_device_name(0), "capability": list(torch.cuda.get_device_capability(0)),
                    "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
                    "dispatch": dispatch.source, "timing": "CUDA graph of calls cycling >= 4x L2 of weight sets; "
                                                          "median of 3 replays",
                    "read_floor": "lowbit.tools.bench.read_floor: best of READ_CONFIGS" if read_floor else None},
            "dispatch_table": dispatch.table(), "rows": rows}
