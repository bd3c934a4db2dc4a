"""A/B the plugin's fused decode kernel (csrc/paged_decode.cpp) against another build of it on the same inputs:
the kernel calls of one decode step at a `--context`-token history (captured from the step the layer-step bench
runs), timed alternately, A then B, round after round, in one process (the 2 shared cores drift; adjacent
calls see the same load).

    .venv/bin/python scripts/vllm_kernel_ab.py --export /tmp/i21/exp/smollm2-int4-default \\
        --old /tmp/s9/old_paged_decode.cpp [--rounds 30] [--scalar]

A = this tree's `paged_decode` (cpu_kernel.load()); B = `--old` built as its own extension, or with --scalar
this build's `paged_decode_scalar`. Prints p10 / p50 ms per kernel call (one layer) for each, their ratio, and
the max |A - B| over the captured calls.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--export", required=True)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--old", default="", help="another paged_decode.cpp to build and compare against")
    ap.add_argument("--scalar", action="store_true", help="B = this build's scalar loop")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from lowbit.vllm_plugin import cpu_kernel

    mod, why = cpu_kernel.load()
    if mod is None:
        raise SystemExit(why)
    if args.scalar:
        other = mod.paged_decode_scalar
    elif args.old:
        from torch.utils.cpp_extension import load as build

        src = Path(args.old)
        tag = hashlib.sha256(src.read_bytes()).hexdigest()[:10]
        old = build(name=f"lowbit_paged_decode_ab_{tag}", sources=[str(src)],
                    extra_cflags=["-O3", "-march=native", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
                                  "-fno-trapping-math"])
        other = old.paged_decode
    else:
        raise SystemExit("--old PATH or --scalar")

    calls = []

    class Spy:  # records each paged_decode call's arguments, passes everything through
        def __getattr__(self, name):
            return getattr(mod, name)

        def paged_decode(self, *a):
            calls.append(a)
            return mod.paged_decode(*a)

    spec = importlib.util.spec_from_file_location("step_bench", Path(__file__).with_name("vllm_plugin_step_bench.py"))
    sb = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sb)
    cpu_kernel._STATE["mod"] = Spy()
    try:
        sys.argv = [sys.argv[0], "--export", args.export, "--context", str(args.context), "--layers", str(args.layers),
                    "--steps", "1"]
        sb.main()
    finally:
        cpu_kernel._STATE["mod"] = mod
    calls = calls[-args.layers:]  # the last step's layers
    diff = max(float((mod.paged_decode(*a) - other(*a)).abs().max()) for a in calls)
    ta, tb = [], []
    for _ in range(args.rounds):
        for fn, ts in ((mod.paged_decode, ta), (other, tb)):
            for a in calls:
                t0 = time.perf_counter()
                fn(*a)
                ts.append(time.perf_counter() - t0)

    def ms(xs, p):
        xs = sorted(xs)
        return round(1e3 * xs[min(len(xs) - 1, int(p * len(xs)))], 4)

    res = {"context": args.context, "calls_per_round": len(calls), "rounds": args.rounds,
           "b": "scalar" if args.scalar else args.old,
           "a_ms": {"p10": ms(ta, 0.1), "p50": ms(ta, 0.5)}, "b_ms": {"p10": ms(tb, 0.1), "p50": ms(tb, 0.5)},
           "b_over_a_p50": round(ms(tb, 0.5) / ms(ta, 0.5), 3), "b_over_a_p10": round(ms(tb, 0.1) / ms(ta, 0.1), 3),
           "max_abs_diff": diff}
    print(json.dumps(res))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
