"""Probe (s25, issue 18): keep the middle tier's heavy-hitter rows exact -- how much of int2's loss sits on them?

Far attention (past the bf16 recent tier) is concentrated: a few rows beyond the sink (delimiters, secondary sinks)
take much of it, and an error on them does not average out over many attended rows. The probe picks, at write time,
the rows a typical query would score highest: s = qbar . k (qbar: the calibration mean of the KV head's group queries,
rotated as the cache rotates them), and keeps K and V of the rows above the calibration (1 - f) quantile of s exact.
Cost if stored in bf16 beside the codes: f * (16 - bits) b/elt (reported, not in the eval's "bits q" column: fake quant).

    python hh_probe.py fit --frac 0.01 --out HH.pt            (stdlib text, 4 x 2048; not WikiText)
    HH=HH.pt python hh_probe.py eval <lowbit eval arguments>
"""
from __future__ import annotations

import os
import sys

import torch

RECIPE = "src/lowbit/recipes/smollm2-135m@2.5.toml"
SKIP = 64


def fit(argv):
    import argparse

    from lowbit.calib.capture import capture_attention
    from lowbit.calib.corpora import stdlib_text, token_windows
    from lowbit.kv.plan import resolve
    from lowbit.models import resolve as resolve_model
    from lowbit.recipe import load_recipe

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--recipe", default=RECIPE)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--frac", type=float, default=0.01)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    lm = resolve_model(a.model, dtype=torch.bfloat16)
    plan = resolve(load_recipe(a.recipe), lm.geometry)
    wins = token_windows(lm.tokenizer, stdlib_text(), a.seq_len, a.windows)
    QS, KS = {}, {}

    def obs(module, q, k, v, mask, scaling, softcap):
        i = module.layer_idx
        r = plan.layers[i].rot_k
        qr = (q.float() if r is None else q.float() @ r)[0, :, SKIP:]
        kr = (k.float() if r is None else k.float() @ r)[0, :, SKIP:]
        H = kr.shape[0]
        QS[i] = QS.get(i, 0) + qr.reshape(H, -1, qr.shape[-1]).mean(1) / a.windows  # [H, D]
        KS.setdefault(i, []).append(kr)

    with torch.no_grad(), capture_attention(lm.model, obs):
        for w in wins:
            lm.model(w[None], use_cache=False, logits_to_keep=1)
    out = {}
    for i, qbar in QS.items():
        K = torch.cat(KS[i], 1)  # [H, N, D]
        s = torch.einsum("hnd,hd->hn", K, qbar)
        out[i] = {"qbar": qbar, "thr": torch.quantile(s, 1 - a.frac, dim=1)}
    torch.save({"frac": a.frac, "layers": out}, a.out)
    print(f"# fitted qbar and the {1 - a.frac:.3f} quantile of qbar . k for {len(out)} layers")


def patched_eval(argv):
    from lowbit.kv import layer as L

    blob = torch.load(os.environ["HH"])
    fl = blob["layers"]
    stats = {"rows": 0, "kept": 0}
    orig_init = L.QuantizedKVLayer.__init__

    def init(self, plan, **kw):
        orig_init(self, plan, **kw)
        i = self.layer_idx
        if i in fl and self.k_codec.quantized and self.v_codec.quantized:
            shared = {}
            self.k_codec = wrap(self.k_codec, shared, fl[i], "k", stats)
            self.v_codec = wrap(self.v_codec, shared, fl[i], "v", stats)

    L.QuantizedKVLayer.__init__ = init
    from lowbit.cli import main

    rc = main(argv)
    print(f"# HH probe: {stats['kept']} of {stats['rows']} middle rows kept exact "
          f"({stats['kept'] / max(stats['rows'], 1):.4f})", file=sys.stderr)
    return rc


def wrap(orig, shared, f, which, stats):
    from lowbit.kv.codec import TensorCodec

    class HHCodec(TensorCodec):
        def __init__(self):
            self.__dict__.update(orig.__dict__)

        def fields(self):
            return {"dense": self.head_dim}

        def rows_per_entry(self, name):
            return 1

        def encode(self, x, dense_dtype, *, checks=True):
            if which == "k":  # the layer encodes K then V of the same rows (layer._flush)
                s = torch.einsum("bhtd,hd->bht", x.float(), f["qbar"].to(x.device))
                shared["mask"] = s > f["thr"].to(x.device)[None, :, None]
                stats["rows"] += shared["mask"].numel()
                stats["kept"] += int(shared["mask"].sum())
            xq = orig.decode(orig.encode(x, dense_dtype, checks=checks), torch.float32)
            out = torch.where(shared["mask"][..., None], x.float(), xq)
            return {"dense": out.to(dense_dtype)}

        def decode(self, fields, dtype=torch.float32):
            return fields["dense"].to(dtype)

    return HHCodec()


if __name__ == "__main__":
    if sys.argv[1] == "fit":
        fit(sys.argv[2:])
    else:
        sys.exit(patched_eval(sys.argv[1:]))
