"""`lowbit bench decode-attention`: the fused decode kernel against bf16 SDPA (flash) on the GPU."""

from __future__ import annotations

import json
import os

NAME = "bench"
HELP = "GPU benchmarks: `bench decode-attention` times int2/int4/int8 decode attention vs bf16 SDPA flash"


def _ints(s: str) -> tuple[int, ...]:
    out = []
    for part in s.split(","):
        part = part.strip().lower()
        mult = 1024 if part.endswith("k") else 1
        out.append(int(part.rstrip("k")) * mult)
    return tuple(out)


def add_arguments(parser) -> None:
    parser.add_argument("what", choices=["decode-attention"], help="which benchmark")
    parser.add_argument("--batch", default="1,16,64", help="batch sizes (default 1,16,64)")
    parser.add_argument("--length", default="4k,32k,128k", help="context lengths (default 4k,32k,128k)")
    parser.add_argument("--geometry", default="llama3-8b,gemma3-1b",
                        help="llama3-8b (Hq 32 / Hkv 8 / D 128), gemma3-1b (Hq 4 / Hkv 1 / D 256)")
    parser.add_argument("--bits", default="2,4,8", help="K=V bit widths to time (default 2,4,8)")
    parser.add_argument("--mem-cap-gb", type=float, default=60.0, help="skip shapes whose bf16 KV exceeds this")
    parser.add_argument("--out", metavar="JSON", help="write results here (default benchmarks/results/decode_attention_<gpu>.json)")


def run(args) -> int:
    import torch

    from lowbit.errors import LowbitError

    if not torch.cuda.is_available():
        raise LowbitError("bench decode-attention needs a CUDA GPU (it times kernels against SDPA flash)")
    from lowbit.kernels import bench

    geos = tuple(g.strip() for g in args.geometry.split(","))
    bad = [g for g in geos if g not in bench.GEOMETRIES]
    if bad:
        raise LowbitError(f"unknown geometry {bad}; use {sorted(bench.GEOMETRIES)}")
    bits = tuple((b, b) for b in _ints(args.bits))
    res = bench.run(_ints(args.batch), _ints(args.length), geos, bits, mem_cap_gb=args.mem_cap_gb)
    path = args.out or os.path.join(
        "benchmarks", "results", f"decode_attention_{res['env'].get('gpu', 'gpu').replace(' ', '_')}.json")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {path}")
    return 0
