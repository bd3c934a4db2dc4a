"""Compile the decode-attention kernel for sm_90 on a machine without a GPU, and report what the
compiler made of it: registers, spills, shared memory, layout conversions through shared memory
inside the loop, and an instruction histogram of the SASS. Costs no device time.

    .venv/bin/python benchmarks/compile_sm90.py --bits 2 --d 128 --g 4 [--block-t 64 --warps 4]
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import lowbit.kernels.attention.tiers as da

_DT = {torch.int32: "*i32", torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float32: "*fp32",
       torch.uint8: "*u8"}


class _Capture:
    def __init__(self, fn):
        self.fn = fn
        self.calls = []

    def __getitem__(self, grid):
        def run(*args, **kw):
            self.calls.append((grid, args, kw))
        return run


def compile_stage1(kw, config, out_dir, tag):
    """Run the wrapper with a capturing launcher, then compile the captured stage-1 launch for sm_90."""
    cap1, cap2 = _Capture(da._stage1), _Capture(da._stage2)
    orig = da._stage1, da._stage2, da.check_mode
    da._stage1, da._stage2, da.check_mode = cap1, cap2, lambda dev: None
    try:
        da.decode_attention(**kw, config=config)
    finally:
        da._stage1, da._stage2, da.check_mode = orig
    _grid, args, ckw = cap1.calls[0]
    fn = orig[0]
    names = fn.arg_names
    opts = {k: ckw.pop(k) for k in ("num_warps", "num_stages")}
    if os.environ.get("MAXNREG"):  # tool-only knob for this script
        opts["maxnreg"] = int(os.environ["MAXNREG"])
    ckw["USE_PRMT"] = True  # what a CUDA launch passes
    ckw["SZ_DIRECT"] = bool(config.sz_direct)  # the wrapper turns it off for CPU tensors
    ckw["INTERP"] = False
    ckw["MID_ITERS"] = ckw["SINK_ITERS"] = ckw["REC_ITERS"] = 0
    sig, attrs = {}, {}
    for i, (n, a) in enumerate(zip(names, list(args) + [None] * (len(names) - len(args)))):
        if n in ckw:
            sig[n] = "constexpr"
            continue
        if isinstance(a, torch.Tensor):
            sig[n] = _DT[a.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(a, float):
            sig[n] = "fp32"
        else:
            sig[n] = "i32"
            if a % 16 == 0 and a != 0 and n not in os.environ.get("NOSPEC", "").split(","):
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=sig, constexprs=ckw, attrs=attrs)
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, tag)
    for ext in ("ttgir", "ptx"):
        with open(f"{base}.{ext}", "w") as f:
            f.write(c.asm[ext])
    with open(f"{base}.cubin", "wb") as f:
        f.write(c.asm["cubin"])
    return c, base


def sass_report(base):
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    sass = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "-sass", base + ".cubin"],
                          capture_output=True, text=True, check=True).stdout
    with open(base + ".sass", "w") as f:
        f.write(sass)
    ops = collections.Counter()
    for line in sass.splitlines():
        m = re.match(r"\s+/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
        if m:
            ops[m.group(2)] += 1
    return ops


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--bits", type=int, default=2)
    ap.add_argument("--vbits", type=int, default=None)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--g", type=int, default=4)
    ap.add_argument("--group", type=int, default=None)
    ap.add_argument("--warp-tokens", type=int, default=16)
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--dense", action="store_true", help="add sink/recent tiers")
    ap.add_argument("--out", default="/tmp/lowbit_sm90")
    ap.add_argument("--cfg", default="", help="extra KernelConfig fields, e.g. v_center=0,pv_fresh=1")
    a = ap.parse_args(argv)
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "kernels"))
    from _make import make_inputs

    kw = make_inputs(1, a.g, 1, a.d, 256, kbits=a.bits, vbits=a.vbits or a.bits, group=a.group,
                     dtype=torch.bfloat16, sink=64 if a.dense else 0, recent=64 if a.dense else 0)
    extra = {k: bool(int(v)) for k, v in (kv.split("=") for kv in a.cfg.split(",") if kv)}
    cfg = da.KernelConfig(warp_tokens=a.warp_tokens, num_warps=a.warps, num_stages=a.stages, num_splits=2, **extra)
    tag = f"k{a.bits}v{a.vbits or a.bits}_d{a.d}_g{a.g}_btw{a.warp_tokens}_w{a.warps}_s{a.stages}"
    tag += "".join(f"_{k}{int(v)}" for k, v in extra.items())
    c, base = compile_stage1(kw, cfg, a.out, tag)
    with open(base + ".ttgir") as f:
        ttgir = f.read()
    loop = ttgir[ttgir.find("scf.for"):]
    ops = sass_report(base)
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    pv = subprocess.run([os.path.join(bin_dir, "ptxas"), "-arch=sm_90a", "-v", base + ".ptx", "-o", "/dev/null"],
                        capture_output=True, text=True, check=False).stderr
    regs = re.findall(r"Used (\d+) registers", pv)
    spill = re.findall(r"(\d+) bytes spill stores", pv)
    print(f"{tag}: regs={regs} spill_stores={spill} shared={c.metadata.shared}B")
    print(f"  ttgir: convert_layout={ttgir.count('ttg.convert_layout')} local_alloc(in/after loop)="
          f"{loop.count('ttg.local_alloc')} local_load={loop.count('ttg.local_load')}")
    print("  sass:", " ".join(f"{k}={v}" for k, v in ops.most_common(24)))
    print("  files:", base + ".{ttgir,ptx,sass}")


if __name__ == "__main__":
    main()
