"""torch's own int4 weight-only GEMM (tinygemm: torch._weight_int4pack_mm, what torchao's int4 weight-only
runs) beside lowbit's W4A16 g128 dispatch and cuBLAS bf16, on the Llama-3-8B decode shapes (one device call).

    python3 benchmarks/tinygemm_probe.py OUT.json

Why: use a library kernel where it beats lowbit's own; tinygemm ships inside torch (no
wheel to carry). Its layout is its own (repacked once at load by torch._convert_weight_to_int4pack) and its
zero point is a float per group: w = (q - 8) * scale + zero -- checked here against a float reference for
both readings of the formula, so a wrong reading shows as a large error, not as a fast number.
Timing: kernels.bench.graph_time_ms (a CUDA graph cycling over weight copies larger than L2).
"""
from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F

from lowbit.tools.bench.attention import graph_time_ms, n_buffers
from lowbit.kernels.gemm.triton_gemm import random_weight
from lowbit.kernels.gemm.dispatch import Dispatch

SHAPES = [("q/k/v fused", 4096, 6144), ("o", 4096, 4096), ("gate/up fused", 4096, 28672), ("down", 14336, 4096),
          ("k/v", 4096, 1024), ("gate/up", 4096, 14336)]
GROUP = 128


def tinygemm_weight(N: int, K: int, seed: int, inner_k_tiles: int = 8):
    g = torch.Generator(device="cuda").manual_seed(seed)
    codes = torch.randint(0, 16, (N, K), dtype=torch.int32, device="cuda", generator=g)
    scale = (torch.rand(K // GROUP, N, device="cuda", generator=g) * 0.02 + 0.002).to(torch.bfloat16)
    zero = (torch.randn(K // GROUP, N, device="cuda", generator=g) * 0.01).to(torch.bfloat16)
    u8 = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8)  # [N, K/2]: two codes per byte, high nibble first
    packed = torch._convert_weight_to_int4pack(u8, inner_k_tiles)
    sz = torch.stack([scale, zero], -1).contiguous()  # [K/g, N, 2]
    return codes, scale, zero, packed, sz


def rel(y, ref):
    return float((y.double() - ref).norm() / ref.norm())


def main(out_path: str) -> None:
    table = Dispatch.for_device("cuda")
    rows = []
    for name, K, N in SHAPES:
        codes, scale, zero, packed, sz = tinygemm_weight(N, K, 0)
        x0 = torch.randn(3, K, device="cuda", dtype=torch.bfloat16)
        s = scale.float().repeat_interleave(GROUP, 0).t()  # [N, K]
        z = zero.float().repeat_interleave(GROUP, 0).t()
        y = torch._weight_int4pack_mm(x0, packed, GROUP, sz)
        readings = {"(q-8)*s+z": rel(y, x0.double() @ ((codes - 8) * s + z).double().t()),
                    "q*s+z": rel(y, x0.double() @ (codes * s + z).double().t())}
        del codes, s, z
        nb = n_buffers(packed.numel() * packed.element_size(), 20e9)
        tg = [tinygemm_weight(N, K, i)[3:] for i in range(nb)]
        pw = [random_weight("w4a16-g128", N, K, "cuda", seed=i) for i in range(nb)]
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(n_buffers(N * K * 2, 24e9))]
        for M in (1, 2, 4, 8, 16, 32, 64):
            xs = [torch.randn(M, K, device="cuda", dtype=torch.bfloat16) for _ in range(max(nb, len(ws)))]
            n = len(xs)
            bf16 = graph_time_ms([(lambda w=ws[i % len(ws)], x=xs[i]: F.linear(x, w)) for i in range(n)], reps=3,
                                 target_ms=10)
            tiny = graph_time_ms([(lambda t=tg[i % nb], x=xs[i]: torch._weight_int4pack_mm(x, t[0], GROUP, t[1]))
                                  for i in range(n)], reps=3, target_ms=10)
            cell = table.choose("w4a16", M, pw[0], torch.bfloat16)
            low = graph_time_ms([(lambda p=pw[i % nb], x=xs[i]: table.linear(x, p)) for i in range(n)], reps=3,
                                target_ms=10)
            r = {"shape": name, "M": M, "K": K, "N": N, "bf16_ms": bf16, "tinygemm_ms": tiny, "lowbit_ms": low,
                 "lowbit_cell": f"{cell.path}:{cell.kernel}", "tinygemm_ratio": bf16 / tiny, "lowbit_ratio": bf16 / low,
                 "tinygemm_tbs": (N * K / 2 + 2 * 2 * N * K / GROUP) / tiny / 1e9, "tinygemm_rel_l2": readings}
            rows.append(r)
            print(f"{name:<14} M={M:<3} bf16 {bf16 * 1e3:6.1f} us  tinygemm {tiny * 1e3:6.1f} us x{bf16 / tiny:4.2f}  "
                  f"lowbit {low * 1e3:6.1f} us x{bf16 / low:4.2f} ({cell.path})  rel {readings}", flush=True)
        del tg, pw, ws
        torch.cuda.empty_cache()
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "group": GROUP, "inner_k_tiles": 8}
    with open(out_path, "x") as f:
        json.dump({"env": env, "rows": rows}, f, indent=1)
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main(sys.argv[1])
