"""Fit s21's VQ (per-row scale + sub-vector codebooks, k-means per layer and KV head) on rows captured by
tc_probe.py (as the codec sees them: after the recipe's key affine and rotations; stdlib text), for any model.

    python vq_fit_capture.py --cap CAP.pt --tensor K --sub 2 --entries 16 --out CB.pt
Writes the blob s21/s24's probes read: {"sub", "entries", "codebooks": {layer: [H, E, sub]}, "table"}.
"""
import argparse
import importlib.util
import time
from pathlib import Path

import torch

spec = importlib.util.spec_from_file_location("vk", Path(__file__).parents[1] / "s21" / "vq_key_probe.py")
vk = importlib.util.module_from_spec(spec)
spec.loader.exec_module(vk)

ap = argparse.ArgumentParser()
ap.add_argument("--cap", required=True)
ap.add_argument("--tensor", choices=["K", "V"], required=True)
ap.add_argument("--sub", type=int, default=2)
ap.add_argument("--entries", type=int, default=16)
ap.add_argument("--iters", type=int, default=15)
ap.add_argument("--sample", type=int, default=131072)
ap.add_argument("--holdout", type=int, default=2)
ap.add_argument("--out", required=True)
a = ap.parse_args()
gen = torch.Generator().manual_seed(0)
t0 = time.time()
cap = torch.load(a.cap)
cbs, table = {}, []
for i in sorted(cap[a.tensor]):
    X = cap[a.tensor][i].float()  # [W, H, T, D]
    W, H, T, D = X.shape
    fit, held = X[: W - a.holdout], X[W - a.holdout:]
    cb_l, num = [], 0.0
    for h in range(H):
        x = fit[:, h].reshape(-1, D)
        u = (x / x.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-12)).reshape(-1, a.sub)
        if u.shape[0] > a.sample:
            u = u[torch.randperm(u.shape[0], generator=gen)[: a.sample]]
        cb = vk.kmeans(u, a.entries, a.iters, gen)
        cb_l.append(cb)
        xh = held[:, h].reshape(-1, D)
        idx, s = vk.vq_encode(xh, cb, a.sub)
        num += (xh - vk.vq_decode(idx, s, cb)).pow(2).sum().item()
    cbs[i] = torch.stack(cb_l)
    rel = num / held.pow(2).sum().item()
    table.append((i, rel))
    print(f"layer {i:2d} {a.tensor}: VQ{a.sub}x{a.entries} rel MSE (held-out stdlib) {rel:.4f}  ({time.time() - t0:.0f} s)", flush=True)
torch.save({"sub": a.sub, "entries": a.entries, "codebooks": cbs, "table": table}, a.out)
