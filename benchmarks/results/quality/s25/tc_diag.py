"""Diagnosis (s25): the TC codec's and int2's errors on rows of another text (weighted by the fit's metric, and plain).

    python tc_diag.py --tc TC.pt --cap CAP.pt     (CAP captured by `tc_probe.py capture` on the other text)
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
ap.add_argument("--wcap", required=True, help="the capture the TC was fitted on (its metric)")
a = ap.parse_args()
from lowbit.kv.plan import resolve
from lowbit.models import resolve as resolve_model
from lowbit.recipe import kv_scheme_from_dict, read_recipe_file

res = torch.load(a.tc)["res"]
cap = torch.load(a.cap)
wcap = torch.load(a.wcap)
lm = resolve_model(cap["model"], dtype=torch.bfloat16)
plan2 = resolve(kv_scheme_from_dict({k: v for k, v in read_recipe_file(tc.RECIPE)["kv"].items() if k != "layer_bits"}), lm.geometry)
tot = {}
for i in sorted(cap["K"]):
    out = [i]
    for t in ("K", "V"):
        X = cap[t][i].float()
        Wn, H, T, D = X.shape
        Wt = wcap["SQ"][i] if t == "K" else wcap["WO"][i]
        acc = torch.zeros(6)
        for h in range(H):
            x = X[:, h].reshape(-1, D)
            hd = res[t][i][h]
            e = x - tc.decode_rows(tc.encode_rows(x, hd), hd)
            c = plan2.layers[i].k if t == "K" else plan2.layers[i].v
            e2 = c.decode(c.encode(x.to(torch.bfloat16)[None, None], torch.bfloat16))[0, 0] - x
            xc = x - x.mean(0)
            W = Wt[h]

            def q(u, W=W):
                return torch.einsum("nd,de,ne->", u, W, u).item()

            acc += torch.tensor([q(e), q(e2), q(xc), e.pow(2).sum().item(), e2.pow(2).sum().item(), xc.pow(2).sum().item()])
        out += [acc[0] / acc[2], acc[1] / acc[2], acc[3] / acc[5], acc[4] / acc[5]]
        tot.setdefault(t, []).append(acc)
    print(f"layer {i:2d}  K weighted TC {out[1]:.4f} int2 {out[2]:.4f} | plain TC {out[3]:.4f} int2 {out[4]:.4f}   "
          f"V weighted TC {out[5]:.4f} int2 {out[6]:.4f} | plain TC {out[7]:.4f} int2 {out[8]:.4f}")
for t, v in tot.items():
    s = torch.stack(v).sum(0)
    print(f"{t} all layers: weighted TC {s[0] / s[2]:.4f} int2 {s[1] / s[2]:.4f} | plain TC {s[3] / s[5]:.4f} int2 {s[4] / s[5]:.4f}")
