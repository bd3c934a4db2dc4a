"""Compile the geometry decode kernel (lowbit.kernels.attention.geometry._geo_stage1) for sm_90 on a machine
without a GPU and report registers / spills / shared memory per launch config. Costs no device time.

    .venv/bin/python benchmarks/compile_geo_sm90.py            # every bench geometry x its candidates
    .venv/bin/python benchmarks/compile_geo_sm90.py --only kimi-k192v128
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

import lowbit.kernels.attention.geometry as dg
from lowbit.tools.bench import geometry as geo_bench

sys.path.insert(0, os.path.dirname(__file__))
from compile_sm90 import _DT, _Capture  # noqa: E402


def capture(call):
    """Run a wrapper call with capturing launchers; returns the stage-1 (grid, args, kwargs)."""
    cap1, cap2 = _Capture(dg._geo_stage1), _Capture(dg._stage2)
    orig = dg._geo_stage1, dg._stage2, dg.check_mode
    dg._geo_stage1, dg._stage2, dg.check_mode = cap1, cap2, lambda dev: None
    try:
        call()
    finally:
        dg._geo_stage1, dg._stage2, dg.check_mode = orig
    return cap1.calls[0]


def compile_launch(launch, out_dir, tag):
    _grid, args, ckw = launch
    fn = dg._geo_stage1
    names = fn.arg_names
    opts = {k: ckw.pop(k) for k in ("num_warps", "num_stages")}
    ckw.update(INTERP=False, MID_ITERS=0, SINK_ITERS=0, REC_ITERS=0)
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
            if a % 16 == 0 and a != 0 and n not in ("split_tokens", "NSM", "NSPLIT"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=sig, constexprs=ckw, attrs=attrs)
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, tag)
    with open(base + ".ptx", "w") as f:
        f.write(c.asm["ptx"])
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    pv = subprocess.run([os.path.join(bin_dir, "ptxas"), "-arch=sm_90a", "-v", base + ".ptx", "-o", "/dev/null"],
                        capture_output=True, text=True, check=False).stderr
    regs = re.findall(r"Used (\d+) registers", pv)
    spill = re.findall(r"(\d+) bytes spill stores", pv)
    return regs, spill, c.metadata.shared


def calls(name, geo, cfg, bits, dense_mid=False, tiers=False):
    L, B = 256, 1
    if tiers:  # the audit's inputs, with sink 64 / recent 256 dense tiers (the dense split's code too)
        from lowbit.tools.audit.attention import _make_geo_case, make_latent_case

        if geo["kind"] == "latent":
            kw = make_latent_case(B, geo["Hq"], geo["Dv"], geo["DR"], L, bits, sink=64, recent=256, dense_mid=dense_mid)
            return lambda: dg.decode_attention_latent(**kw, config=cfg)
        kw = _make_geo_case(B, geo["Hq"], geo["Hkv"], geo["Dk"], geo["Dv"], L, bits, bits, group=geo["gk"], sink=64,
                            recent=256)
        return lambda: dg.decode_attention_geo(**kw, config=cfg)
    if geo["kind"] == "latent":
        fns, _ = geo_bench.latent_fns(geo, B, L, bits, 1, cfg, dense_mid=dense_mid, dev="cpu")
    else:
        fns, _ = geo_bench.mha_fns(geo, B, L, bits, 1, cfg, dev="cpu")
    return fns[0]


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default=None)
    ap.add_argument("--out", default="/tmp/lowbit_geo_sm90")
    ap.add_argument("--cfg", action="append", default=[],
                    help="GeoConfig fields instead of the bench candidates, e.g. block_t=16,heads=16,num_warps=4")
    ap.add_argument("--bits", default="2,4,16", help="variants: 2, 4 (packed), 16 (dense bf16 middle, latent)")
    ap.add_argument("--tiers", action="store_true", help="with sink/recent dense tiers (the dense split compiled)")
    a = ap.parse_args(argv)
    want = {int(b) for b in a.bits.split(",")}
    for name, geo in geo_bench.GEOMETRIES.items():
        if a.only and name not in a.only.split(","):
            continue
        variants = [(b, False) for b in (2, 4) if b in want]
        if name.startswith("deepseek") and 16 in want:
            variants.append((16, True))
        cfgs = [dg.GeoConfig(**{k: int(v) for k, v in (kv.split("=") for kv in c.split(","))}) for c in a.cfg]
        for bits, dm in variants:
            for cfg in cfgs or geo_bench.candidates(geo):
                tag = (f"{name}_{'bf16' if dm else f'int{bits}'}_{cfg.block_t}_{cfg.heads}_{cfg.num_warps}"
                       + ("_tiers" if a.tiers else ""))
                try:
                    launch = capture(calls(name, geo, cfg, bits, dm, a.tiers))
                    regs, spill, shared = compile_launch(launch, a.out, tag)
                    print(f"{tag}: regs={regs} spill_stores={spill} shared={shared}B", flush=True)
                except Exception as e:  # noqa: BLE001
                    while (e.__cause__ or e.__context__) is not None:  # the innermost error says what broke
                        e = e.__cause__ or e.__context__
                    print(f"{tag}: FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)


if __name__ == "__main__":
    main()
