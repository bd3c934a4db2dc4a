"""Compile the packed-latent decode kernel (lowbit.kernels.decode_latent._lat_stage1) for sm_90 on a machine
without a GPU: registers / spills / shared memory, and whether the products became warpgroup MMAs.

    .venv/bin/python benchmarks/compile_latent_sm90.py --cfg heads=16,block_t=64,num_warps=4 [--hq 16]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import lowbit.kernels.decode_latent as dl

sys.path.insert(0, os.path.dirname(__file__))
from compile_sm90 import _DT, _Capture  # noqa: E402


def compile_cfg(hq: int, heads: int, block_t: int, num_warps: int, num_stages: int, out_dir: str, reload: int = 1, pv_acc: int = 0):
    B, T, D, DR = 1, 256, 512, 64
    q = torch.zeros(B, hq, D, dtype=torch.bfloat16)
    qp = torch.zeros(B, hq, DR, dtype=torch.bfloat16)
    c = torch.zeros(B, 1, T, 32, dtype=torch.int32)
    s = torch.zeros(B, 1, T, 4, dtype=torch.float16)
    pe = torch.zeros(B, 1, T, DR, dtype=torch.bfloat16)
    part = torch.zeros(B, hq, 8, D)
    lse = torch.zeros(B, hq, 8)
    cap = _Capture(dl._lat_stage1)
    orig, dl._lat_stage1 = dl._lat_stage1, cap
    try:
        dl.latent_middle(q, qp, c, s, s, pe, torch.zeros(B, dtype=torch.int32), bits=2, sm_scale=0.1, heads=heads,
                         block_t=block_t, num_warps=num_warps, num_splits=4, part=part, lse=lse, out_split0=0,
                         num_stages=num_stages, reload=bool(reload), pv_acc=bool(pv_acc))
    finally:
        dl._lat_stage1 = orig
    _grid, args, ckw = cap.calls[0]
    fn = dl._lat_stage1
    opts = {k: ckw.pop(k) for k in ("num_warps", "num_stages")}
    ckw.update(INTERP=False, MID_ITERS=0)
    sig, attrs = {}, {}
    for i, (n, a) in enumerate(zip(fn.arg_names, list(args) + [None] * (len(fn.arg_names) - len(args)))):
        if n in ckw:
            sig[n] = "constexpr"
        elif isinstance(a, torch.Tensor):
            sig[n] = _DT[a.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(a, float):
            sig[n] = "fp32"
        else:
            sig[n] = "i32"
            if a % 16 == 0 and a != 0 and n not in ("split_tokens", "NSPLIT", "OUT_SPLIT0"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    comp = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=ckw, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=opts)
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, f"lat_hq{hq}_h{heads}_bt{block_t}_w{num_warps}_s{num_stages}_r{reload}_a{pv_acc}")
    with open(base + ".ptx", "w") as f:
        f.write(comp.asm["ptx"])
    with open(base + ".ttgir", "w") as f:
        f.write(comp.asm["ttgir"])
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    pv = subprocess.run([os.path.join(bin_dir, "ptxas"), "-arch=sm_90a", "-v", base + ".ptx", "-o", "/dev/null"],
                        capture_output=True, text=True, check=False).stderr
    ptx = comp.asm["ptx"]
    return dict(regs=re.findall(r"Used (\d+) registers", pv), spill=re.findall(r"(\d+) bytes spill stores", pv),
                shared=comp.metadata.shared, wgmma=ptx.count("wgmma.mma_async"), mma=ptx.count("mma.sync"),
                ptx=base + ".ptx")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", action="append", default=[], help="heads=16,block_t=64,num_warps=4[,num_stages=2]")
    ap.add_argument("--hq", type=int, default=16)
    ap.add_argument("--out", default="/tmp/lowbit_latent_sm90")
    a = ap.parse_args(argv)
    for c in a.cfg or ["heads=16,block_t=64,num_warps=4"]:
        kw = dict(num_stages=2) | {k: int(v) for k, v in (x.split("=") for x in c.split(","))}
        try:
            r = compile_cfg(a.hq, out_dir=a.out, **kw)
            print(f"hq{a.hq} {c}: {r}", flush=True)
        except Exception as e:  # noqa: BLE001
            while (e.__cause__ or e.__context__) is not None:
                e = e.__cause__ or e.__context__
            print(f"hq{a.hq} {c}: FAILED {type(e).__name__}: {str(e)[:600]}", flush=True)


if __name__ == "__main__":
    main()
