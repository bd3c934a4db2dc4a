"""The read floor: how long one kernel takes to read N bytes once, the bound no weight GEMM can beat.

    s = read_words(words)                        words int32 [n] -> int32 [programs] (XOR of each program's words)
    ms, cfg = read_floor_ms(nbytes)               best time over READ_CONFIGS (CUDA graph, rotating buffers)

A weight-only GEMM at small M must at least read its packed weight once. Timed in the same harness as
`lowbit bench gemm` (kernels.bench.graph_time_ms: a CUDA graph of back-to-back calls over buffers that
cycle through >= 4x the L2), the fastest plain read of that many bytes is the best any such kernel can do
there, launch and ramp included. So bf16_ms / read_ms is the ceiling on a cell's ratio, and a target above
it cannot be met by a better kernel: it is measured, not assumed from the DRAM peak.

The kernel: each program XORs ITERS blocks of BLOCK int32 words (contiguous, so the loads vectorise) and
writes the result (so the reads cannot be dropped). Twin: `read_words_ref` (tests/kernels/test_read_floor.py,
odd sizes). It computes nothing lowbit serves, so it has no dispatch cell and no audit entry.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowbit.tools.bench.attention import graph_time_ms, n_buffers

# (BLOCK words, ITERS blocks per program, num_warps): the sweep a floor is the best of
READ_CONFIGS = ((1024, 1, 4), (2048, 1, 4), (4096, 1, 8), (2048, 4, 4), (4096, 4, 8), (8192, 2, 8), (4096, 16, 8))


@triton.jit
def _read_words(X, OUT, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], tl.int32)
    for i in range(ITERS):
        offs = (pid.to(tl.int64) * ITERS + i) * BLOCK + tl.arange(0, BLOCK)
        acc ^= tl.load(X + offs, mask=offs < n, other=0)
    tl.store(OUT + pid, tl.xor_sum(acc, 0))


def programs(n: int, block: int, iters: int) -> int:
    return triton.cdiv(n, block * iters)


def read_words(words: torch.Tensor, block: int = 2048, iters: int = 1, num_warps: int = 4,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """words int32 [n] (contiguous) -> int32 [programs(n, block, iters)]: the XOR of each program's `iters`
    consecutive blocks of `block` words."""
    n = words.numel()
    p = programs(n, block, iters)
    if out is None:
        out = torch.empty(p, dtype=torch.int32, device=words.device)
    _read_words[(p,)](words, out, n, BLOCK=block, ITERS=iters, num_warps=num_warps)
    return out


def read_words_ref(words: torch.Tensor, block: int = 2048, iters: int = 1) -> torch.Tensor:
    """The twin: the same per-program XORs in torch."""
    n = words.numel()
    span = block * iters
    p = programs(n, block, iters)
    x = torch.zeros(p * span, dtype=torch.int32)
    x[:n] = words.cpu()
    x = x.view(p, span)
    while x.shape[1] > 1:  # pairwise XOR down to one word per program
        h = x.shape[1] // 2
        x = x[:, :h] ^ x[:, h:2 * h] if x.shape[1] % 2 == 0 else torch.cat([x[:, :h] ^ x[:, h:2 * h], x[:, 2 * h:]], 1)
    return x[:, 0].contiguous()


def read_floor_ms(nbytes: int, device="cuda", configs=READ_CONFIGS) -> tuple[float, dict]:
    """The fastest time (ms) over `configs` to read `nbytes` (rounded up to whole int32 words) once, timed
    like the weight GEMMs; -> (ms, {"block", "iters", "num_warps"} of the best)."""
    n = -(-nbytes // 4)
    bufs = [torch.randint(-2**31, 2**31 - 1, (n,), dtype=torch.int32, device=device)
            for _ in range(n_buffers(4 * n, 24e9))]
    best = (float("inf"), {})
    for block, iters, warps in configs:
        outs = [torch.empty(programs(n, block, iters), dtype=torch.int32, device=device) for _ in bufs]
        ms = graph_time_ms([(lambda w=w, o=o, b=block, i=iters, nw=warps: read_words(w, b, i, nw, out=o))
                            for w, o in zip(bufs, outs)], reps=3, target_ms=10)
        if ms < best[0]:
            best = (ms, {"block": block, "iters": iters, "num_warps": warps})
    del bufs
    return best
