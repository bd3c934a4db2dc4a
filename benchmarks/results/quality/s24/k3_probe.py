"""Probe (s24, issue 18): would 3-bit codes *packed at 3 bits* let `lowbit tune` reach +2% WikiText PPL at 2.5 held
b/elt on smollm2-135m / gemma3-270m?

Today 3-bit codes live in 4-bit containers (lowbit.recipe: "int3 costs what int4 costs"), so tune's knapsack offers
each tensor 2, 4 or 8 bits. With packed 3-bit codes a tensor could take +1 bit instead of +2, and the budget would
spread over twice as many sensitive tensors. Nothing under src/ is changed; this runs tune's own pieces
(lowbit.eval.tune.measure / allocate / fake-quant PPL) with bits (2, 3, 4, 8) and the 3-bit cost counted as the
packed codes (the container's cost less one bit per element; scales as stored):

    python k3_probe.py --model smollm2-135m --budget 2.5 --context 8192 --windows 2 --seq-len 2048 --out R.toml

R.toml is a recipe `lowbit eval --recipe R.toml` runs through the real cache (3-bit codes in 4-bit containers: the
values a packed codec would decode to; eval's bits column counts the containers, this probe prints the packed held
bits). Calibration: lowbit's stdlib corpus (never the evaluation text).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from lowbit.calib.corpora import load_text, token_windows
from lowbit.eval import tune as T
from lowbit.kv.held import held_bits
from lowbit.kv.plan import load_rotations
from lowbit.models import resolve


def packed_held(scheme, geometry, context: int) -> float:
    """Held b/elt with every 3-bit tensor counted at packed 3-bit codes (container bits less one per element)."""
    h = held_bits(scheme, context, geometry=geometry)
    total = sum(lh.elements_k + lh.elements_v for lh in h.layers)
    bits = 0.0
    for lh in h.layers:
        kb, vb = scheme.for_layer(lh.index).k.bits, scheme.for_layer(lh.index).v.bits
        bits += lh.bits_k - (lh.elements_k if kb == 3 else 0) + lh.bits_v - (lh.elements_v if vb == 3 else 0)
    return bits / total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--budget", type=float, required=True)
    ap.add_argument("--context", type=int, required=True)
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--rotation", default="hadamard")
    ap.add_argument("--grid", default="scale-only")
    ap.add_argument("--bits", default="2,3,4,8")
    ap.add_argument("--data", default="stdlib")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    out = Path(a.out)
    if out.exists():
        raise SystemExit(f"{out} exists")
    torch.set_num_threads(a.threads)
    T.BITS = tuple(int(b) for b in a.bits.split(","))
    t0 = time.time()
    lm = resolve(a.model)
    calib = token_windows(lm.tokenizer, load_text(a.data), a.seq_len, a.windows)
    m = T.measure(lm, calib, rotations=(a.rotation,), grids=(a.grid,))
    geometry = lm.geometry
    layers = [g.index for g in geometry.layers]
    rl = T._rot_label(a.rotation)
    rot, ka = T._rotation_maps(load_rotations(a.rotation, geometry), geometry)
    base = T.base_scheme(a.rotation, a.grid)
    elems, cost = T._cost_table(base, geometry, a.context)
    for i in layers:  # 3-bit codes packed at 3 bits
        if (i, 3) in cost:
            ck, cv = cost[(i, 3)]
            cost[(i, 3)] = (ck - 1.0, cv - 1.0)
    e = {(i, t, b): m.err[(rl, T.family(a.grid, b), i, t, b)] for i in layers for t in (0, 1) for b in T.BITS}
    assign, pred, held = T.allocate(e, elems, cost, a.budget, layers)
    scheme = T.with_layer_bits(base, assign)
    ph = packed_held(scheme, geometry, a.context)
    ppl = T._ppl(lm, m, scheme, rot, ka)
    base_ppl = T._ppl(lm, m, base, rot, ka)
    over = {i: f"k{kb}v{vb}" for i, (kb, vb) in sorted(assign.items()) if (kb, vb) != (2, 2)}
    print(f"bits {T.BITS}: held (packed 3-bit) {ph:.4f} b/elt at {a.context} (allocate's {held:.4f}); calib PPL "
          f"{ppl:.3f} vs exact {m.ref_ppl:.3f} ({100 * (ppl / m.ref_ppl - 1):+.2f}%; all-2-bit "
          f"{100 * (base_ppl / m.ref_ppl - 1):+.2f}%); {len(over)} layers above 2 bits: {over}  [{time.time() - t0:.0f} s]")
    lines = [f"# k3_probe (s24): {a.model}, budget {a.budget} held b/elt at {a.context} tokens with 3-bit codes counted "
             f"packed ({ph:.4f}); calib {a.data} {a.windows} x {a.seq_len}, PPL {100 * (ppl / m.ref_ppl - 1):+.2f}%",
             "", "[kv]", 'scheme = "int2"', f'rotation = "{a.rotation}"', f"sink = {base.sink}", f"recent = {base.recent}",
             f"page = {base.page}", 'zero = "none"' if a.grid.startswith("scale-only") else "",
             'grid = "mse"' if a.grid == "scale-only-mse" else "", "", "[kv.layer_bits]"]
    lines += [f'"{i}" = "{s}"' for i, s in over.items()]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(x for x in lines if x is not None) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
