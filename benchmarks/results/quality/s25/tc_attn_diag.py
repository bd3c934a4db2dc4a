"""Diagnosis (s25): attention KL and output error of a key codec, per layer, on captured rows (sink rows exact).

    python tc_attn_diag.py --tc TC.pt --cap CAP.pt     (CAP: `TC_SKIP=0 tc_probe.py capture --keep-q --data TEXT`)
"""
import argparse
import importlib.util
from pathlib import Path

import torch

spec = importlib.util.spec_from_file_location("tc", Path(__file__).with_name("tc_probe.py"))
tc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tc)

ap = argparse.ArgumentParser()
ap.add_argument("--tc", required=True)
ap.add_argument("--cap", required=True)
ap.add_argument("--sink", type=int, default=64)
ap.add_argument("--layers", default="")
ap.add_argument("--recent", type=int, default=0, help="keys within this many positions of the query stay exact (the cache's recent tier)")
a = ap.parse_args()
from lowbit.kv.plan import resolve
from lowbit.models import resolve as resolve_model
from lowbit.recipe import kv_scheme_from_dict, load_recipe, read_recipe_file

res = torch.load(a.tc)["res"]
cap = torch.load(a.cap)
lm = resolve_model(cap["model"], dtype=torch.bfloat16)
plan2 = resolve(kv_scheme_from_dict({k: v for k, v in read_recipe_file(tc.RECIPE)["kv"].items() if k != "layer_bits"}), lm.geometry)
plan4 = resolve(load_recipe(tc.K4ALL), lm.geometry)
layers = [int(x) for x in a.layers.split(",")] if a.layers else sorted(cap["K"])
S0 = a.sink
sums = torch.zeros(3, 2)
for i in layers:
    K, V, Q = cap["K"][i][0].float(), cap["V"][i][0].float(), cap["Q"][i][0].float()  # [H,T,D], [Hq,T,D]
    H, T, D = K.shape
    G = Q.shape[0] // H
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    near = (torch.arange(T)[:, None] - torch.arange(T)[None, :]) < a.recent  # exact pairs (recent tier)
    row = []
    for name in ("tc", "int2", "int4"):
        kl = oe = 0.0
        for h in range(H):
            k = K[h]
            if name == "tc":
                kq = tc.decode_rows(tc.encode_rows(k[S0:], res["K"][i][h]), res["K"][i][h])
            else:
                c = (plan2 if name == "int2" else plan4).layers[i].k
                kq = c.decode(c.encode(k[S0:].to(torch.bfloat16)[None, None], torch.bfloat16))[0, 0]
            kh = torch.cat([k[:S0], kq])
            for g in range(G):
                q = Q[h * G + g]
                s = (q @ k.T) / D ** 0.5
                sh = torch.where(near, s, (q @ kh.T) / D ** 0.5)
                lp = s.masked_fill(~mask, -torch.inf).log_softmax(-1)
                lph = sh.masked_fill(~mask, -torch.inf).log_softmax(-1)
                p = lp.exp()
                kl += (p * (lp - lph)).nan_to_num().sum(-1)[S0 + a.recent:].mean().item()
                o, oh = p @ V[h], lph.exp() @ V[h]
                oe += ((o - oh).pow(2).sum(-1) / o.pow(2).sum(-1))[S0 + a.recent:].mean().item()
        row.append((kl / (H * G), oe / (H * G)))
    for j, r in enumerate(row):
        sums[j] += torch.tensor(r)
    print(f"layer {i:2d}  KL  tc {row[0][0]:.5f}  int2 {row[1][0]:.5f}  int4 {row[2][0]:.5f}   "
          f"out rel err  tc {row[0][1]:.5f}  int2 {row[1][1]:.5f}  int4 {row[2][1]:.5f}", flush=True)
n = len(layers)
print(f"mean  KL  tc {sums[0, 0] / n:.5f}  int2 {sums[1, 0] / n:.5f}  int4 {sums[2, 0] / n:.5f}   "
      f"out  tc {sums[0, 1] / n:.5f}  int2 {sums[1, 1] / n:.5f}  int4 {sums[2, 1] / n:.5f}")
