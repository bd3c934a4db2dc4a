"""One table of lowbit's KV recipes against the KV dtypes a vLLM user can pick: engines.json + engines.md.

    python benchmarks/engines_table.py --model smollm2-135m --ppl A.json B.json [--ruler R.json] \
        --command "lowbit eval ..." --command "lowbit eval ..." \
        --out results/quality/engines.json

--ppl: `lowbit eval` JSON reports of one model on the same windows (each has its own bf16 row; rows
are taken from the first report that has them, and every report's bf16 PPL must agree). --ruler:
`lowbit eval --task ruler` reports (tasks_rel_bf16 per row). Held bits per row, at 32k and at the
evaluated context: lowbit rows from lowbit.kv.held (the quantized tier; `bits_held_all` adds the
model-dtype sink/recent tiers at 16 bits), vLLM rows from lowbit.eval.peers_vllm.held_bits (the
quantized layers; `bits_held_all` adds TurboQuant's bf16 boundary layers).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SCHEMA = ("model", "recipe", "bits_held", "bits_held_eval_ctx", "bits_held_all", "delta_ppl_pct", "delta_ppl_se",
          "kl", "top1", "needle_rel_bf16", "tasks_rel_bf16")


def lowbit_held(label: str, config: dict, geometry, context: int, chunk: int) -> tuple[float, float]:
    from lowbit.kv.held import held_bits
    from lowbit.kv.plan import resolve
    from lowbit.kv.scheme import kv_scheme_from_dict

    scheme = kv_scheme_from_dict({k: v for k, v in config.items() if k not in ("cache", "describe")})
    h = held_bits(resolve(scheme, geometry), context, chunk=chunk)
    mid_bits = sum(lh.bits_k + lh.bits_v for lh in h.layers)
    mid_elts = sum(lh.elements_k + lh.elements_v for lh in h.layers)
    dense = sum(lh.dense_elements for lh in h.layers)
    return h.bits, (mid_bits + 16 * dense) / (mid_elts + dense)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--ppl", nargs="+", required=True)
    ap.add_argument("--ruler", nargs="*", default=[])
    ap.add_argument("--needle", nargs="*", default=[], help="`lowbit eval --task needle` reports (needle_rel_bf16)")
    ap.add_argument("--command", action="append", default=[], help="the commands that made the inputs (recorded)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--note", action="append", default=[], help="a caveat printed under the table (recorded)")
    a = ap.parse_args(argv)

    import lowbit.models
    from lowbit.eval.peers_vllm import held_bits as vllm_held
    from lowbit.models.geometry import ModelGeometry

    reports = [json.loads(Path(p).read_text()) | {"_file": p} for p in a.ppl]
    cfg_path = Path(reports[0]["model"]["path"]) / "config.json"
    geometry = ModelGeometry.from_config(json.loads(cfg_path.read_text()), name=lowbit.models.model_name(a.model))
    ref_ppls = {r["results"][0]["ppl"] for r in reports}
    if max(ref_ppls) - min(ref_ppls) > 1e-6 * max(ref_ppls):
        raise SystemExit(f"the reports' bf16 PPLs differ ({sorted(ref_ppls)}): not the same windows")
    protos = {(r["protocol"]["windows"], r["protocol"]["seq_len"], r["protocol"]["chunk"]) for r in reports}
    if len(protos) != 1:
        raise SystemExit(f"the reports ran different protocols: {protos}")
    (windows, seq_len, chunk), = protos
    ruler = {}
    for p in a.ruler:
        rr = json.loads(Path(p).read_text())
        for row in rr["results"]:
            ses = [c["se"] for t in row["cells"].values() for c in t.values()]
            se = None if any(x is None for x in ses) else sum(x * x for x in ses) ** 0.5 / len(ses)
            ruler.setdefault(row["scheme"], {"rel": row["tasks_rel_bf16"], "mean": row["mean"], "se": se, "file": p,
                                             "cells": row["cells"]})
    needle = {}
    for p in a.needle:
        for row in json.loads(Path(p).read_text())["results"]:
            needle.setdefault(row["scheme"], {"rel": row["needle_rel_bf16"], "accuracy": row["accuracy"]})
    rows, seen = [], set()
    for rep in reports:
        for r in rep["results"]:
            if r["scheme"] in seen or r["status"] != "ok":
                continue
            seen.add(r["scheme"])
            if r["kind"] == "reference":
                b32 = bctx = ball = 16.0
            elif r["kind"] == "vllm-peer":
                h = vllm_held(r["scheme"], geometry)
                b32 = bctx = h["bits_quantized"]
                ball = h["bits_held"]
            else:
                b32, ball = lowbit_held(r["scheme"], r["config"], geometry, a.context, chunk)
                bctx, _ = lowbit_held(r["scheme"], r["config"], geometry, seq_len, chunk)
            ru = ruler.get(r["scheme"])
            rows.append({"model": a.model, "recipe": r["scheme"], "kind": r["kind"],
                         "bits_held": round(b32, 3), "bits_held_eval_ctx": round(bctx, 3),
                         "bits_held_all": round(ball, 3),
                         "delta_ppl_pct": r["delta_ppl_pct"], "delta_ppl_se": r.get("delta_ppl_se_pct"),
                         "kl": r["kl"], "top1": r["top1"],
                         "needle_rel_bf16": needle[r["scheme"]]["rel"] if r["scheme"] in needle else None,
                         "needle_accuracy": needle[r["scheme"]]["accuracy"] if r["scheme"] in needle else None,
                         "tasks_rel_bf16": None if ru is None else ru["rel"],
                         "tasks_mean": None if ru is None else ru["mean"],
                         "tasks_mean_se": None if ru is None else ru["se"],
                         "tasks_cells": None if ru is None else ru["cells"],
                         "from": rep["_file"]})
    env = {"model": reports[0]["model"]["name"], "dtype": reports[0]["model"]["dtype"],
           "data": reports[0]["data"], "windows": windows, "seq_len": seq_len, "chunk": chunk,
           "bits_held_context": a.context, "versions": reports[0]["versions"],
           "git_commits": sorted({json.dumps(r["versions"].get("lowbit_git")) for r in reports}),
           "commands": a.command, "inputs": a.ppl + a.ruler + a.needle, "notes": a.note,
           "vllm_peers": "fake-quant with vLLM 0.26.0's store/read arithmetic (lowbit.eval.peers_vllm); "
                         "bits from vLLM's storage layout",
           "ruler": {p: json.loads(Path(p).read_text())["protocol"] for p in a.ruler}}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"env": env, "rows": rows}, indent=2) + "\n")
    md = [f"# KV recipes vs vLLM 0.26's KV dtypes: {env['model']} ({env['dtype']})", "",
          (f"WikiText-2, {windows} x {seq_len} tokens fed {chunk} at a time; ΔPPL / KL / top-1 against bf16 on the "
          f"same windows. Held bits: the quantized tier at {a.context} tokens (lowbit.kv.held; vLLM: its storage "
          "per element, scales and norms counted, the same at every length); `all` adds the model-dtype tiers "
          "(lowbit's sink + recent, TurboQuant's 4 boundary layers) at 16 bits. A ΔPPL within two standard "
          "errors of another is a tie. vLLM rows are fake-quant ports of vLLM 0.26.0's kernels (bit-exact "
          "against them where they run on a CPU; see lowbit.eval.peers_vllm)."), "",
          ("| recipe | held b/elt @32k | @eval ctx | all tiers | ΔPPL % | ± SE | KL | top-1 % | needle rel. bf16 "
           "| tasks mean ± SE | tasks rel. bf16 |"),
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def f(x, fmt):
        return "-" if x is None else format(x, fmt)

    for r in rows:
        md.append(f"| {r['recipe']} | {f(r['bits_held'], '.2f')} | {f(r['bits_held_eval_ctx'], '.2f')} | "
                  f"{f(r['bits_held_all'], '.2f')} | {f(r['delta_ppl_pct'], '+.2f')} | {f(r['delta_ppl_se'], '.2f')} | "
                  f"{f(r['kl'], '.4f')} | {f(r['top1'], '.1f')} | {f(r['needle_rel_bf16'], '.2f')} | "
                  f"{f(r['tasks_mean'], '.1f')} ± {f(r['tasks_mean_se'], '.1f')} | {f(r['tasks_rel_bf16'], '.2f')} |")
    md += [""] + [f"Note: {n}" for n in a.note]
    md += ["", "Commands:", ""] + [f"    {c}" for c in a.command] + [""]
    md.append(f"Versions: {json.dumps(env['versions'])}")
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print(f"wrote {out} and {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
