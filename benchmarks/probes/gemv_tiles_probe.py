"""The Triton A16 GEMV (lowbit.kernels.gemm.triton_gemm.gemv) over tile shapes at M = 1, beside cuBLAS bf16, the dispatched
cell and the read floor (lowbit.tools.bench.read_floor), on the Llama-3-8B shapes; the best config per (scheme, shape) is
checked against the twin. One device call (s27):

    python3 benchmarks/probes/gemv_tiles_probe.py OUT.json

Question: does a GEMV whose programs each read one large tile at once (like the read floor's 8 KB programs) close
the gap between the dispatched M=1 cells (W8A16 at 49-61% of the read floor, W4A16 at 43-56%) and cuBLAS (87-90%)?
"""
from __future__ import annotations

import itertools
import json
import sys
import time

import torch
import torch.nn.functional as F

from lowbit.kernels.gemm import triton_gemm as wg
from lowbit.tools.bench.attention import graph_time_ms, n_buffers
from lowbit.tools.bench.read_floor import read_floor_ms
from lowbit.kernels.gemm.triton_gemm import random_weight
from lowbit.kernels.gemm.dispatch import Dispatch, run_cell

SHAPES = [("llama3-8b gate/up", 4096, 14336), ("llama3-8b down", 14336, 4096), ("llama3-8b qkv/o", 4096, 4096)]
GRID = {"w8a16": dict(BN=(1, 2, 4, 8, 16), GPT=(1, 4, 16), w=(4, 8), s=(1, 3)),
        "w4a16-g128": dict(BN=(4, 8, 16, 32), GPT=(1, 4, 8), w=(4, 8), s=(1, 3))}


def main(out: str) -> None:
    disp = Dispatch.for_device("cuda")
    rows, t0 = [], time.time()
    for scheme, (name, K, N) in itertools.product(GRID, SHAPES):
        pw0 = random_weight(scheme, N, K, "cuda")
        pws = [pw0] + [random_weight(scheme, N, K, "cuda", seed=i) for i in range(1, n_buffers(pw0.nbytes(), 24e9))]
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(n_buffers(N * K * 2, 24e9))]
        nx = max(len(pws), len(ws))
        xs = [torch.randn(1, K, device="cuda", dtype=torch.bfloat16) for _ in range(nx)]
        bf16 = graph_time_ms([(lambda w=ws[i % len(ws)], x=xs[i]: F.linear(x, w)) for i in range(nx)], reps=3, target_ms=10)
        cell = disp.choose(pw0.kind, 1, pw0)
        tab = graph_time_ms([(lambda p=pws[i % len(pws)], x=xs[i], c=cell: run_cell(c, x, p)) for i in range(nx)],
                            reps=3, target_ms=10)
        floor = read_floor_ms(pw0.nbytes())[0]
        g = GRID[scheme]
        best = (float("inf"), None)
        for bn, gpt, w, s in itertools.product(g["BN"], g["GPT"], g["w"], g["s"]):
            cfg = wg.GemvConfig(BM=1, BN=bn, GPT=gpt, num_warps=w, num_stages=s)
            try:
                ms = graph_time_ms([(lambda p=pws[i % len(pws)], x=xs[i], c=cfg: wg.gemv(x, p, c)) for i in range(nx)],
                                   reps=3, target_ms=5)
            except Exception as e:  # a config Triton cannot compile (registers, shared memory): recorded, not fatal
                rows.append({"scheme": scheme, "shape": name, "config": cfg.name, "error": str(e)[:200]})
                continue
            rows.append({"scheme": scheme, "shape": name, "N": N, "K": K, "config": cfg.name, "ms": ms,
                         "bf16_ms": bf16, "ratio": bf16 / ms, "read_ms": floor, "of_floor": floor / ms})
            if ms < best[0]:
                best = (ms, cfg)
        ms, cfg = best
        x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
        ref = wg.linear_twin(x, pw0, torch.float32)
        rel = float((wg.gemv(x, pw0, cfg, torch.float32) - ref).norm() / ref.norm())
        summ = {"scheme": scheme, "shape": name, "best": cfg.name, "best_ms": ms, "best_ratio": bf16 / ms,
                "best_of_floor": floor / ms, "best_rel_l2": rel, "table_kernel": cell.kernel, "table_ms": tab,
                "table_ratio": bf16 / tab, "bf16_ms": bf16, "read_ms": floor, "ceiling": bf16 / floor}
        rows.append(summ)
        print(f"{scheme:<11} {name:<18} bf16 {bf16 * 1e3:6.1f} us | table {tab * 1e3:6.1f} x{bf16 / tab:.2f} "
              f"({cell.kernel}) | best gemv {ms * 1e3:6.1f} x{bf16 / ms:.2f} {cfg.name} rel {rel:.1e} | "
              f"floor {floor * 1e3:5.1f} (x{bf16 / floor:.2f}) [{time.time() - t0:.0f}s]", flush=True)
        del pws, ws, xs
        torch.cuda.empty_cache()
    env = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
    with open(out, "x") as f:
        json.dump({"env": env, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
