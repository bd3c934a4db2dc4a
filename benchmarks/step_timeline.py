"""Where a captured decode step's wall time goes beyond its kernels' own time: one `lowbit bench decode` row run
with the profiler's kernel timeline kept (kernels per step, the step's span on the GPU, the idle time between
consecutive kernels, and the kernels the longest idle gaps come before).

    python3 benchmarks/step_timeline.py OUT.json [--path lowbit-w4a16-int2[,PATH...]] [--batch 1] [--length 32k]
                                         [--compile whole|layers|off] [--inductor-pdl auto|on|off]

--inductor-pdl: the compiled step with or without Inductor's programmatic-dependent-launch codegen (compile_decode's
inductor_pdl; auto, the default, is the runtime's: on where torch has it; see benchmarks/NOTES.md, rounds 9-10).

It wraps lowbit.tools.bench.runtime's profiler call (the same replays `gpu_ms_per_step` comes from) and adds a
"timeline" field to each row; the rest of the JSON is bench decode's.
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch

from lowbit.tools.bench import runtime as rb


def timeline(fn, n: int = 3, top: int = 0):
    """bench's (busy, top kernels), plus rb.LAST_TIMELINE: per-step kernel count, span and idle gaps."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    kern = sorted((e for e in prof.events() if e.device_time_total > 0 and e.time_range.end > e.time_range.start),
                  key=lambda e: e.time_range.start)
    busy = sum(e.time_range.end - e.time_range.start for e in kern) / n / 1e3
    span = (kern[-1].time_range.end - kern[0].time_range.start) / n / 1e3 if kern else None
    gaps = [(b.time_range.start - a.time_range.end, b.name[:70]) for a, b in itertools.pairwise(kern)]
    per = len(kern) // n
    step_gaps = [g for g in gaps if g[0] < 200]  # between replays the host's event / loop time: not the step's
    rb.LAST_TIMELINE = {
        "kernels_per_step": per, "busy_ms_per_step": busy, "span_ms_per_step": span,
        "idle_ms_per_step": sum(max(g, 0.0) for g, _ in step_gaps) / n / 1e3,
        "median_gap_us": sorted(g for g, _ in step_gaps)[len(step_gaps) // 2] if step_gaps else None,
        "largest_gaps_us_before": [[round(g, 2), name] for g, name in sorted(step_gaps, reverse=True)[:12]],
        # the second replay's kernels in start order: [name, start us from the replay's first kernel, duration us]
        # (with PDL a kernel's duration includes its wait for the one before, so durations overlap)
        "one_step": [[e.name[:70], round(e.time_range.start - kern[per].time_range.start, 2),
                      round(e.time_range.end - e.time_range.start, 2)] for e in kern[per:2 * per]] if n > 1 else []}
    ev = prof.key_averages()
    rows = sorted(((e.key[:80], e.self_device_time_total / n / 1e3, e.count / n) for e in ev
                   if e.self_device_time_total > 0), key=lambda r: -r[1])
    return busy, [[k, round(ms, 4), c] for k, ms, c in rows[:top]]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--path", default="lowbit-w4a16-int2")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--length", default="32k")
    ap.add_argument("--compile", choices=rb.COMPILE_MODES, default="whole")
    ap.add_argument("--inductor-pdl", choices=("auto", "on", "off"), default="auto")
    a = ap.parse_args()
    L = int(a.length[:-1]) * 1024 if a.length.endswith("k") else int(a.length)
    rb.LAST_TIMELINE = None
    orig = rb._time_lowbit_row

    def with_timeline(*args, **kw):
        row = orig(*args, **kw)
        row["timeline"] = rb.LAST_TIMELINE
        return row

    rb._gpu_busy, rb._time_lowbit_row = timeline, with_timeline
    res = rb.run("llama3-8b", [a.batch], [L], a.path.split(","), steps=10, inductor_pdl={"auto": None, "on": True, "off": False}[a.inductor_pdl],
                 compile=a.compile)
    for r in res["rows"]:
        t = r.get("timeline") or {}
        print(f"{r['path']} B{r['B']}: {r['ms_per_step']:.3f} ms/step, kernels/step {t.get('kernels_per_step')}, "
              f"busy {t.get('busy_ms_per_step'):.3f} ms, span {t.get('span_ms_per_step'):.3f} ms, idle between kernels "
              f"{t.get('idle_ms_per_step'):.3f} ms (median gap {t.get('median_gap_us')} us)")
        for g, name in t.get("largest_gaps_us_before", []):
            print(f"    {g:8.2f} us before {name}")
    with open(a.out, "x") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
