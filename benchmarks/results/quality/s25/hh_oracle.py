"""Diagnosis (s25): attention KL (far pairs, sink exact) of the shipped smollm2-135m@2.5 keys, and with the top-f rows by
received far attention (an oracle: not known at write time) or by qbar . k (hh_probe's write-time rule) kept exact.

    python hh_oracle.py --cap CAP.pt --hh HH.pt    (CAP: `TC_SKIP=0 tc_probe.py capture --keep-q --data TEXT`)
"""
import argparse

import torch

ap = argparse.ArgumentParser()
ap.add_argument("--cap", required=True)
ap.add_argument("--hh", required=True)
ap.add_argument("--frac", type=float, default=0.01)
ap.add_argument("--recent", type=int, default=256)
ap.add_argument("--sink", type=int, default=64)
a = ap.parse_args()
from lowbit.kv.plan import resolve
from lowbit.models import resolve as resolve_model
from lowbit.recipe import load_recipe

cap = torch.load(a.cap)
hh = torch.load(a.hh)["layers"]
lm = resolve_model(cap["model"], dtype=torch.bfloat16)
plan = resolve(load_recipe("src/lowbit/recipes/smollm2-135m@2.5.toml"), lm.geometry)
S0, R = a.sink, a.recent
tot = torch.zeros(3)
for i in sorted(cap["K"]):
    K, Q = cap["K"][i][0].float(), cap["Q"][i][0].float()
    H, T, D = K.shape
    G = Q.shape[0] // H
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    far = (torch.arange(T)[:, None] - torch.arange(T)[None, :]) >= R
    c = plan.layers[i].k
    res = torch.zeros(3)
    for h in range(H):
        k = K[h]
        kq = torch.cat([k[:S0], c.decode(c.encode(k[S0:].to(torch.bfloat16)[None, None], torch.bfloat16))[0, 0]])
        ps = []
        for g in range(G):
            s = (Q[h * G + g] @ k.T) / D ** 0.5
            ps.append((s, s.masked_fill(~causal, -torch.inf).softmax(-1)))
        mass = sum((p * far).sum(0) for _, p in ps)  # far attention each row receives
        mass[:S0] = -1
        n = max(1, int(a.frac * (T - S0)))
        oracle = torch.zeros(T, dtype=torch.bool)
        oracle[mass.topk(n).indices] = True
        sq = k @ hh[i]["qbar"][h]
        rule = sq > hh[i]["thr"][h]
        rule[:S0] = False
        for j, keep in enumerate((torch.zeros(T, dtype=torch.bool), oracle, rule)):
            kk = torch.where(keep[:, None], k, kq)
            for (s, p), g in zip(ps, range(G)):
                sh = torch.where(far, (Q[h * G + g] @ kk.T) / D ** 0.5, s)
                lp = s.masked_fill(~causal, -torch.inf).log_softmax(-1)
                lph = sh.masked_fill(~causal, -torch.inf).log_softmax(-1)
                res[j] += (lp.exp() * (lp - lph)).nan_to_num().sum(-1)[S0 + R:].mean().item() / (H * G)
    tot += res
    print(f"layer {i:2d}  KL shipped {res[0]:.5f}  oracle top-{a.frac:g} exact {res[1]:.5f}  qbar rule {res[2]:.5f}", flush=True)
n = len(cap["K"])
print(f"mean  KL shipped {tot[0] / n:.5f}  oracle {tot[1] / n:.5f}  qbar rule {tot[2] / n:.5f}")
