"""Recipe search with the full-window fake-quant harness (lowbit.eval.layer_error).

    python benchmarks/results/rotations/search.py --model smollm2-135m --calib CAL --rot per-head=DIR ... \
        --windows 2 --seq-len 1024 --out results.jsonl \
        --v "kv=int2,rot=hadamard" --v "kv=kivi2,sink=64,recent=256,page=32,rot=pca-head,lm=fit" ...

Each --v is comma-separated key=value: kv (scheme), rot (none | hadamard | a name given with --rot),
group, sink, recent, page, clip (K:V), kaxis (token|channel), lm (gauss|fit), sym (1), grid (minmax|std;
default: lowbit's default for the scheme), hi (per-layer bits: 7:18@int4+5:11@int8).
One line of JSON per variant is appended to --out: ppl, Δ%, bits/elt (K, V) at the model's head_dim.
"""

import argparse
import json
import time
from dataclasses import replace

import torch

from lowbit.calib.corpora import load_text, token_windows
from lowbit.calib.levels import fitted_levels
from lowbit.commands.layer_error import _variant_rotations as rotations_for
from lowbit.eval.layer_error import Variant, fake_quant_ppl
from lowbit.eval.perplexity import full_window_ppl
from lowbit.models import load
from lowbit.kv.scheme import parse_kv_scheme, parse_layer_bits


def parse_variant(spec: str, rots: dict, geo, calib):
    kv = dict(p.split("=", 1) for p in spec.split(",") if p)
    clip = tuple(float(x) for x in kv["clip"].split(":")) if "clip" in kv else None
    if clip and len(clip) == 1:
        clip = clip * 2
    lm = kv.get("lm")
    s = parse_kv_scheme(kv.get("kv", "int2"), group=int(kv["group"]) if "group" in kv else None,
                        sink=int(kv["sink"]) if "sink" in kv else None,
                        recent=int(kv["recent"]) if "recent" in kv else None,
                        page=int(kv["page"]) if "page" in kv else None,
                        clip=clip, lloyd_max=bool(lm), symmetric=kv.get("sym") == "1",
                        grid=kv.get("grid"))
    if kv.get("kaxis") == "channel" and s.k.axis != "channel":
        s = replace(s, k=replace(s.k, axis="channel", group=None))
    if "vgroup" in kv:
        s = replace(s, v=replace(s.v, group=int(kv["vgroup"])))
    if "kgroup" in kv:
        s = replace(s, k=replace(s.k, group=int(kv["kgroup"])))
    if kv.get("lmk") == "0":
        s = replace(s, k=replace(s.k, lloyd_max=False))
    if kv.get("lmv") == "0":
        s = replace(s, v=replace(s.v, lloyd_max=False))
    rname = kv.get("rot", "none")
    rot = rots[rname] if rname in rots else rotations_for(rname, geo)[1]
    krot = kv.get("krot")  # separate K rotation (V keeps rot)
    if krot:
        kr = rots[krot] if krot in rots else rotations_for(krot, geo)[1]
        rot = {i: (kr.get(i, (None, None))[0], rot.get(i, (None, None))[1]) for i in range(geo.num_layers)}
    center = {}
    if kv.get("center"):  # k, v or kv: subtract the calibration mean (exact for attention)
        c = kv["center"]
        center = {i: (st.mean("k") if "k" in c else None, st.mean("v") if "v" in c else None)
                  for i, st in calib.layers.items()}
    levels = fitted_levels(calib, rot, s, center) if lm == "fit" else {}
    layer_scheme = {}
    if "hi" in kv:  # hi=7:18:20:23@int4[+5:11@int8] -> per-layer bits, as KVScheme.layer_bits serves them
        spec_lb = ";".join(part.split("@")[0].replace(":", ",") + "=" + part.split("@")[1]
                           for part in kv["hi"].split("+"))
        s_lb = replace(s, layer_bits=parse_layer_bits(spec_lb))
        layer_scheme = {i: s_lb.for_layer(i) for i, _ in s_lb.layer_bits}
    return Variant(spec, s, rot, levels, center=center, layer_scheme=layer_scheme)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--calib", default=None)
    ap.add_argument("--rot", action="append", default=[], help="NAME=DIR")
    ap.add_argument("--data", default="wikitext2")
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--v", action="append", default=[])
    ap.add_argument("--out", required=True)
    ap.add_argument("--screen", action="store_true", help="per-layer dB of all variants in one pass (no PPL)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    lm = load(a.model, dtype=getattr(torch, a.dtype))
    geo = lm.geometry
    calib = None
    if a.calib:
        from lowbit.calib.stats import load_calibration

        calib = load_calibration(a.calib)
    rots = {}
    for r in a.rot:
        name, path = r.split("=", 1)
        rots[name] = rotations_for(path, geo)[1]
    windows = token_windows(lm.tokenizer, load_text(a.data), a.seq_len, a.windows)
    if a.screen:
        from lowbit.eval.layer_error import measure_layers

        t0 = time.time()
        vs = [parse_variant(spec, rots, geo, calib) for spec in a.v]
        db = measure_layers(lm.model, windows, vs)
        d = geo.layers[0].head_dim_k
        for v in vs:
            vals = list(db[v.name].values())
            bk, bv = v.scheme.bits_per_element(d)
            rec = {"model": a.model, "variant": v.name, "mean_db": sum(vals) / len(vals), "max_db": max(vals),
                   "db": db[v.name], "bits_k": bk, "bits_v": bv, "windows": a.windows, "seq_len": a.seq_len}
            print(f"{rec['mean_db']:7.2f} dB (worst {rec['max_db']:6.2f})  K{bk:.2f}/V{bv:.2f}  {v.name}", flush=True)
            with open(a.out, "a") as f:
                f.write(json.dumps(rec) + "\n")
        print(f"({time.time() - t0:.0f}s)")
        return
    t0 = time.time()
    ref = full_window_ppl(lm.model, windows)
    print(f"ref {ref:.4f} ({time.time() - t0:.0f}s)", flush=True)
    d = geo.layers[0].head_dim_k
    for spec in a.v:
        t0 = time.time()
        var = parse_variant(spec, rots, geo, calib)
        ppl, rows = fake_quant_ppl(lm.model, windows, var)
        bk, bv = var.scheme.bits_per_element(d)
        if var.layer_scheme:  # average over layers
            per = [var.scheme_for(i).bits_per_element(d) for i in range(geo.num_layers)]
            bk, bv = sum(p[0] for p in per) / len(per), sum(p[1] for p in per) / len(per)
        rec = {"model": a.model, "data": a.data, "windows": a.windows, "seq_len": a.seq_len, "dtype": a.dtype,
               "variant": spec, "ref_ppl": ref, "ppl": ppl, "delta_pct": 100 * (ppl / ref - 1),
               "bits_k": bk, "bits_v": bv, "bits_avg": (bk + bv) / 2, "rows": rows,
               "scheme": var.scheme.describe()}
        print(f"{rec['delta_pct']:+8.2f}%  {ppl:.4f}  K{bk:.2f}/V{bv:.2f}  {spec}  ({time.time() - t0:.0f}s)", flush=True)
        with open(a.out, "a") as f:
            f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
