"""Probe (s24, issue 18): would vector-quantized VALUES take V int2's ~1.9 points off smollm2-135m, at the same bits?

s21's probe (../s21/vq_key_probe.py, whose VQ maths this imports) put better 2-bit key codes at no gain; s20 and s24
put V int2's share at ~1.9 of the 2 points allowed, whatever its group size. This is the same VQ for V: per value
row (token x KV head, 64 dims, after the cache's R_v, in bf16 as the codec sees it) one fp16 scale + 64/sub indices
into a per-(layer, KV head) codebook fitted by k-means on lowbit's stdlib corpus (not WikiText); 4 x 256 or 2 x 16
are 16 bytes of codes + 2 of scale = 2.25 b/elt, the int2 scale-only codec it replaces.

    python vq_value_probe.py fit --sub 4 --entries 256 --windows 16 --holdout 2 --out CB.pt [--values V.pt]
    VQ_CB=CB.pt python vq_value_probe.py eval ...   (arguments as `lowbit eval`; every 2-bit V codec replaced)
"""
from __future__ import annotations

import importlib.util
import math
import os
import sys
import time
from pathlib import Path

import torch

_spec = importlib.util.spec_from_file_location("vq_key_probe", Path(__file__).parents[1] / "s21" / "vq_key_probe.py")
vk = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(vk)
K4ALL = "benchmarks/results/quality/s20/smollm2-135m-k4all.toml"  # V int2 scale-only mse, K int4: V's codec here


def fit(argv):
    import argparse

    from lowbit.calib.capture import capture_attention
    from lowbit.calib.corpora import stdlib_text, token_windows
    from lowbit.kv.plan import resolve
    from lowbit.models import resolve as resolve_model
    from lowbit.recipe import load_recipe

    ap = argparse.ArgumentParser()
    ap.add_argument("--sub", type=int, default=4)
    ap.add_argument("--entries", type=int, default=256)
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--holdout", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--sample", type=int, default=131072)
    ap.add_argument("--values", default=None, help="cache the captured rotated values here (reuse if present)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    t0 = time.time()
    lm = resolve_model("smollm2-135m", dtype=torch.bfloat16)
    plan = resolve(load_recipe(K4ALL), lm.geometry)
    if a.values and os.path.exists(a.values):
        vals = torch.load(a.values)
    else:
        wins = token_windows(lm.tokenizer, stdlib_text(), a.seq_len, a.windows)
        vals: dict[int, list] = {}

        def obs(module, q, k, v, mask, scaling, softcap):
            i = module.layer_idx
            vr = torch.matmul(v.float(), plan.layers[i].rot_v).to(torch.bfloat16)  # as _ingest: rotate, model dtype
            vals.setdefault(i, []).append(vr[0, :, vk.SKIP:].clone())  # [H, T-64, D]

        with torch.no_grad(), capture_attention(lm.model, obs):
            for w in wins:
                lm.model(w[None], use_cache=False, logits_to_keep=1)
        vals = {i: torch.stack(v) for i, v in vals.items()}
        if a.values:
            torch.save(vals, a.values)
    print(f"# captured values: {len(vals)} layers, {tuple(vals[0].shape)} per layer; {time.time() - t0:.0f} s", flush=True)
    E, sub = a.entries, a.sub
    ebits = int(math.log2(E))
    assert (1 << ebits) == E and 64 // sub * ebits == 128, "probe is for 2 b/elt codes (16 bytes a row)"
    cbs, table = {}, []
    for i in sorted(vals):
        V = vals[i].float()
        W, H, T, D = V.shape
        fitv, held = V[: W - a.holdout], V[W - a.holdout:]
        cb_l, num = [], 0.0
        for h in range(H):
            x = fitv[:, h].reshape(-1, D)
            u = (x / x.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-12)).reshape(-1, sub)
            if u.shape[0] > a.sample:
                u = u[torch.randperm(u.shape[0], generator=gen)[: a.sample]]
            cb = vk.kmeans(u, E, a.iters, gen)
            cb_l.append(cb)
            xh = held[:, h].reshape(-1, D)
            idx, s = vk.vq_encode(xh, cb, sub)
            num += (xh - vk.vq_decode(idx, s, cb)).pow(2).sum().item()
        cbs[i] = torch.stack(cb_l)
        den = held.pow(2).sum().item()
        xb = held.permute(1, 0, 2, 3).reshape(1, H, -1, D).to(torch.bfloat16)
        c = plan.layers[i].v
        r2 = (c.decode(c.encode(xb, torch.bfloat16)) - xb.float()).pow(2).sum().item()
        table.append((i, r2 / den, num / den))
        print(f"layer {i:2d}: rel MSE V int2 {r2 / den:.4f}  VQ{sub}x{E} {num / den:.4f}  ({time.time() - t0:.0f} s)", flush=True)
    med = lambda c: sorted(r[c] for r in table)[len(table) // 2]  # noqa: E731
    print(f"median over layers: V int2 {med(1):.4f}  VQ {med(2):.4f}")
    torch.save({"sub": sub, "entries": E, "codebooks": cbs, "table": table}, a.out)


def patched_eval(argv):
    from lowbit.kv import layer as L

    blob = torch.load(os.environ["VQ_CB"])
    sub, E, cbs = blob["sub"], blob["entries"], blob["codebooks"]
    ebits = int(math.log2(E))
    replaced = []
    orig_init = L.QuantizedKVLayer.__init__

    def init(self, plan, **kw):
        orig_init(self, plan, **kw)
        c = self.v_codec
        if c.quantized and c.bits == 2:
            self.v_codec = make_vq_codec(c, cbs[self.layer_idx], sub, ebits)
            replaced.append(self.layer_idx)

    L.QuantizedKVLayer.__init__ = init
    from lowbit.cli import main

    rc = main(argv)
    print(f"# VQ probe ({sub}-dim x {E}): V codec replaced on {len(set(replaced))} layers: {sorted(set(replaced))}",
          file=sys.stderr)
    return rc


def make_vq_codec(orig, cb, sub: int, ebits: int):
    """A TensorCodec with the VQ storage (the s21 probe's, for a V codec)."""
    from lowbit.kv.codec import TensorCodec

    class VQCodec(TensorCodec):
        def __init__(self):
            self.__dict__.update(orig.__dict__)
            self.cb = cb.float()

        def fields(self):
            return {"codes": self.head_dim // sub * ebits // 8, "scale": 1}

        def rows_per_entry(self, name):
            return 1

        def encode(self, x, dense_dtype, *, checks=True):
            codes, scales = [], []
            for h in range(x.shape[1]):
                idx, s = vk.vq_encode(x[:, h].float(), self.cb[h], sub)
                codes.append(vk.pack_idx(idx, ebits))
                scales.append(s)
            return {"codes": torch.stack(codes, 1), "scale": torch.stack(scales, 1)}

        def decode(self, fields, dtype=torch.float32):
            codes, scale = fields["codes"], fields["scale"]
            out = [vk.vq_decode(vk.unpack_idx(codes[:, h], ebits), scale[:, h], self.cb[h]) for h in range(codes.shape[1])]
            return torch.stack(out, 1).to(dtype)

    return VQCodec()


if __name__ == "__main__":
    if sys.argv[1] == "fit":
        fit(sys.argv[2:])
    else:
        sys.exit(patched_eval(sys.argv[1:]))
