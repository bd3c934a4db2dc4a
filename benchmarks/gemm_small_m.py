"""`lowbit bench gemm`'s rows for the decode sizes only (M <= 64, the LLM shapes, W4A16 g128 and W8A16), in its
JSON schema: the cells a change of the small-M CUDA kernel touches, re-timed in one device call when the full
sweep (M to 16384, DiT shapes, five schemes) does not fit in it.

    python3 benchmarks/gemm_small_m.py OUT.json
"""
from __future__ import annotations

import json
import sys
import time

import torch

from lowbit.kernels.gemm.dispatch import Dispatch
from lowbit.tools.audit.gemm import LLM_SHAPES
from lowbit.tools.bench import gemm as wb

MS = (1, 2, 3, 4, 7, 8, 16, 17, 32, 64)


def main(out: str) -> None:
    import triton

    dispatch = Dispatch.for_device("cuda")
    rows, t0 = [], time.time()
    try:
        for scheme in ("w4a16-g128", "w8a16"):
            for shape, K, N in LLM_SHAPES:
                if K % 128 and scheme.endswith("g128"):
                    continue
                rows += wb.bench_shape(scheme, shape, K, N, MS, dispatch, t0=t0)
    finally:
        env = {"gpu": torch.cuda.get_device_name(0), "capability": list(torch.cuda.get_device_capability(0)),
               "torch": torch.__version__, "triton": triton.__version__, "dispatch": dispatch.source,
               "timing": "CUDA graph of calls cycling >= 4x L2 of weight sets; median of 3 replays",
               "sweep": f"M {list(MS)}, LLM shapes, w4a16-g128 and w8a16 (benchmarks/gemm_small_m.py)"}
        with open(out, "x") as f:
            json.dump({"env": env, "dispatch_table": dispatch.table(), "rows": rows}, f, indent=1)
        print(f"wrote {out} ({len(rows)} rows)")


if __name__ == "__main__":
    main(sys.argv[1])
