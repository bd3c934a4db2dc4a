"""Launches of a CUDA weight kernel (small-M: cuda-*; tiled: cuda-tl-*) for Nsight Compute to read (one device call).

    ncu --clock-control none -k regex:wq_small_m --launch-skip 2 --launch-count 1 \
        python3 benchmarks/weight_ncu_probe.py SCHEME N K M CONFIG

Three launches of one (scheme, N, K, M, config) on random packed weights (kernels.gemm.triton_gemm.random_weight);
skip two, profile the third, so the library build and the first-launch attribute set stay out of the profile.
"""
from __future__ import annotations

import sys

import torch

from lowbit.kernels.gemm import cuda_gemm as wc
from lowbit.kernels.gemm import tiled as wt
from lowbit.kernels.gemm.triton_gemm import random_weight


def main(scheme: str, N: int, K: int, M: int, config: str) -> None:
    pw = random_weight(scheme, N, K, "cuda", seed=0)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    mod = wt if config.startswith("cuda-tl-") else wc
    cfg = (wt.TiledConfig if mod is wt else wc.CudaConfig).from_name(config)
    pl = mod.plan(pw, M, cfg, torch.cuda.get_device_properties(0).multi_processor_count)
    for _ in range(3):
        mod.linear(x, pw, cfg)
    torch.cuda.synchronize()
    print(f"{scheme} N={N} K={K} M={M} {config}: {pl}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
