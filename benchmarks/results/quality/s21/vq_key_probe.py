"""Probe (s21, issue 18): would vector-quantized KEYS close smollm2-135m@2.5's quality gap, at the same held bits?

Two modes:

  python vq_key_probe.py fit --sub 4 --entries 256 --out CB.pt [--windows 16] [--holdout 2] [--iters 15]
      Captures the post-RoPE keys of smollm2-135m (bf16) on lowbit's stdlib calibration text (pydoc topics, not
      WikiText) through lowbit.calib.capture, rotates them by the shipped recipe's R_k (Hadamard) and casts them to
      bf16 (what QuantizedKVLayer._ingest hands the codec), drops each window's first 64 positions (the sink, never
      quantized), fits one codebook per (layer, KV head) by k-means on the row-RMS-normalised rows cut into
      `sub`-dim sub-vectors, and prints/saves per layer the relative key MSE (sum (k - k_hat)^2 / sum k^2) on held-out
      windows for: the shipped scalar codec at int2 (scale-only, grid mse, group 64), at int4, and the VQ.

  VQ_CB=CB.pt VQ_SCOPE=k2|all python vq_key_probe.py eval ...   (arguments as `lowbit eval`)
      Runs `lowbit eval` with QuantizedKVLayer.__init__ wrapped: for every layer whose K codec is quantized at 2 bits
      (VQ_SCOPE=k2; or also 4 bits with VQ_SCOPE=all) the K codec is replaced by a VQCodec that stores, per key row
      (token x KV head, 64 dims), `64/sub` code indices (log2(entries) bits each, packed into uint8 "codes", 16 bytes
      for both 4x256 and 2x16) and one fp16 scale (least-squares scale of the row onto its code vector). Its fields
      are {"codes": 16, "scale": 1}: 2.25 b/elt, the same as the int2 scale-only codec it replaces; the eval's bits
      column is computed from the cache layers' codecs, so it counts the VQ rows as 2.25 (VQ_SCOPE=all: 2.25 overall).
      V codecs, sink and recent tiers are untouched.
"""
from __future__ import annotations

import math
import os
import sys
import time

import torch

RECIPE = "src/lowbit/recipes/smollm2-135m@2.5.toml"
K4ALL = "benchmarks/results/quality/s20/smollm2-135m-k4all.toml"
SKIP = 64


# ----------------------------------------------------------------------------- VQ maths
def vq_assign(u: torch.Tensor, cb: torch.Tensor, chunk: int = 65536) -> torch.Tensor:
    """u [N, d], cb [E, d] -> nearest index [N] (long)."""
    cn = (cb * cb).sum(-1)
    out = torch.empty(u.shape[0], dtype=torch.long)
    for a in range(0, u.shape[0], chunk):
        x = u[a:a + chunk]
        d = cn[None, :] - 2 * x @ cb.T
        out[a:a + chunk] = d.argmin(-1)
    return out


def kmeans(u: torch.Tensor, E: int, iters: int, gen: torch.Generator) -> torch.Tensor:
    """Lloyd k-means on u [N, d] -> codebook [E, d] (random-sample init, empty clusters re-seeded)."""
    N, d = u.shape
    cb = u[torch.randperm(N, generator=gen)[:E]].clone()
    for _ in range(iters):
        idx = vq_assign(u, cb)
        sums = torch.zeros(E, d).index_add_(0, idx, u)
        cnt = torch.bincount(idx, minlength=E).float()
        live = cnt > 0
        cb[live] = sums[live] / cnt[live, None]
        dead = int((~live).sum())
        if dead:
            cb[~live] = u[torch.randint(0, N, (dead,), generator=gen)]
    return cb


def vq_encode(x: torch.Tensor, cb: torch.Tensor, sub: int):
    """x [..., D] float32 rows, cb [E, sub] -> (idx [..., D/sub] long, scale [..., 1] fp16)."""
    D = x.shape[-1]
    rms = x.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-12)
    u = (x / rms).reshape(-1, sub)
    idx = vq_assign(u, cb).reshape(*x.shape[:-1], D // sub)
    c = cb[idx].reshape(x.shape)
    s = (x * c).sum(-1, keepdim=True) / (c * c).sum(-1, keepdim=True).clamp_min(1e-12)
    return idx, s.to(torch.float16)


def vq_decode(idx: torch.Tensor, scale: torch.Tensor, cb: torch.Tensor) -> torch.Tensor:
    c = cb[idx].reshape(*idx.shape[:-1], -1)
    return c * scale.float()


def pack_idx(idx: torch.Tensor, ebits: int) -> torch.Tensor:
    if ebits == 8:
        return idx.to(torch.uint8)
    assert ebits == 4
    i = idx.to(torch.uint8)
    return (i[..., 0::2] << 4) | i[..., 1::2]


def unpack_idx(codes: torch.Tensor, ebits: int) -> torch.Tensor:
    if ebits == 8:
        return codes.long()
    hi, lo = (codes >> 4).long(), (codes & 15).long()
    return torch.stack([hi, lo], -1).reshape(*codes.shape[:-1], -1)


# ----------------------------------------------------------------------------- fit
def fit(argv):
    import argparse

    from lowbit.calib.capture import capture_attention
    from lowbit.calib.corpora import stdlib_text, token_windows
    from lowbit.kv.plan import resolve
    from lowbit.models import resolve as resolve_model
    from lowbit.recipe import kv_scheme_from_dict, load_recipe, read_recipe_file

    ap = argparse.ArgumentParser()
    ap.add_argument("--sub", type=int, default=4)
    ap.add_argument("--entries", type=int, default=256)
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--holdout", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--sample", type=int, default=131072, help="sub-vectors per k-means fit (random sample)")
    ap.add_argument("--keys", default=None, help="cache the captured rotated keys here (reuse if present)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    t0 = time.time()
    lm = resolve_model("smollm2-135m", dtype=torch.bfloat16)
    geo = lm.geometry
    plan2 = resolve(kv_scheme_from_dict({k: v for k, v in read_recipe_file(RECIPE)["kv"].items() if k != "layer_bits"}), geo)
    plan4 = resolve(load_recipe(K4ALL), geo)
    if a.keys and os.path.exists(a.keys):
        keys = torch.load(a.keys)
    else:
        text = stdlib_text()
        wins = token_windows(lm.tokenizer, text, a.seq_len, a.windows)
        keys: dict[int, list] = {}

        def obs(module, q, k, v, mask, scaling, softcap):
            i = module.layer_idx
            kr = torch.matmul(k.float(), plan2.layers[i].rot_k).to(torch.bfloat16)  # as _ingest: rotate, model dtype
            keys.setdefault(i, []).append(kr[0, :, SKIP:].clone())  # [H, T-64, D]

        with torch.no_grad(), capture_attention(lm.model, obs):
            for w in wins:
                lm.model(w[None], use_cache=False, logits_to_keep=1)
        keys = {i: torch.stack(v) for i, v in keys.items()}  # [W, H, T', D] bf16
        if a.keys:
            torch.save(keys, a.keys)
    print(f"# captured keys: {len(keys)} layers, {tuple(keys[0].shape)} per layer (windows, heads, rows, D); "
          f"{time.time() - t0:.0f} s", flush=True)
    E, sub = a.entries, a.sub
    ebits = int(math.log2(E))
    assert (1 << ebits) == E and 64 // sub * ebits == 128, "probe is for 2 b/elt codes (16 bytes a row)"
    cbs, table = {}, []
    for i in sorted(keys):
        K = keys[i].float()  # [W, H, T', D]
        W, H, T, D = K.shape
        fitk, held = K[: W - a.holdout], K[W - a.holdout:]
        cb_l = []
        num_vq = 0.0
        for h in range(H):
            x = fitk[:, h].reshape(-1, D)
            rms = x.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-12)
            u = (x / rms).reshape(-1, sub)
            if u.shape[0] > a.sample:
                u = u[torch.randperm(u.shape[0], generator=gen)[: a.sample]]
            cb = kmeans(u, E, a.iters, gen)
            cb_l.append(cb)
            xh = held[:, h].reshape(-1, D)
            idx, s = vq_encode(xh, cb, sub)
            num_vq += (xh - vq_decode(idx, s, cb)).pow(2).sum().item()
        cbs[i] = torch.stack(cb_l)  # [H, E, sub]
        den = held.pow(2).sum().item()
        xb = held.permute(1, 0, 2, 3).reshape(1, H, -1, D).to(torch.bfloat16)  # [1, H, rows, D] as the cache holds
        r2 = (plan2.layers[i].k.decode(plan2.layers[i].k.encode(xb, torch.bfloat16)) - xb.float()).pow(2).sum().item()
        r4 = (plan4.layers[i].k.decode(plan4.layers[i].k.encode(xb, torch.bfloat16)) - xb.float()).pow(2).sum().item()
        table.append((i, r2 / den, r4 / den, num_vq / den))
        print(f"layer {i:2d}: rel MSE int2 {r2 / den:.4f}  int4 {r4 / den:.5f}  VQ{sub}x{E} {num_vq / den:.4f}  "
              f"({time.time() - t0:.0f} s)", flush=True)
    med = lambda c: sorted(r[c] for r in table)[len(table) // 2]  # noqa: E731
    mean = lambda c: sum(r[c] for r in table) / len(table)  # noqa: E731
    print(f"median over layers: int2 {med(1):.4f}  int4 {med(2):.5f}  VQ {med(3):.4f}")
    print(f"mean over layers:   int2 {mean(1):.4f}  int4 {mean(2):.5f}  VQ {mean(3):.4f}")
    print(f"held-out rows per layer: {a.holdout} windows x {H} heads x {T}; fit rows per (layer, head): "
          f"{(W - a.holdout) * T} (k-means on <= {a.sample} sub-vectors, {a.iters} iterations)")
    torch.save({"sub": sub, "entries": E, "codebooks": cbs, "table": table}, a.out)


# ----------------------------------------------------------------------------- eval patch
def patched_eval(argv):
    from lowbit.kv import layer as L
    from lowbit.kv.codec import TensorCodec

    blob = torch.load(os.environ["VQ_CB"])
    scope = os.environ.get("VQ_SCOPE", "k2")
    sub, E, cbs = blob["sub"], blob["entries"], blob["codebooks"]
    ebits = int(math.log2(E))
    replaced = []

    class VQCodec(TensorCodec):
        def __init__(self, orig, cb):  # noqa: D401 - copy the original's attributes, override the storage
            self.__dict__.update(orig.__dict__)
            self.cb = cb.float()  # [H, E, sub]

        def fields(self):
            return {"codes": self.head_dim // sub * ebits // 8, "scale": 1}

        def rows_per_entry(self, name):
            return 1

        def encode(self, x, dense_dtype, *, checks=True):
            B, H, T, D = x.shape
            codes, scales = [], []
            for h in range(H):
                idx, s = vq_encode(x[:, h].float(), self.cb[h], sub)  # [B, T, D/sub], [B, T, 1]
                codes.append(pack_idx(idx, ebits))
                scales.append(s)
            return {"codes": torch.stack(codes, 1), "scale": torch.stack(scales, 1)}

        def decode(self, fields, dtype=torch.float32):
            codes, scale = fields["codes"], fields["scale"]
            H = codes.shape[1]
            out = [vq_decode(unpack_idx(codes[:, h], ebits), scale[:, h], self.cb[h]) for h in range(H)]
            return torch.stack(out, 1).to(dtype)

    orig_init = L.QuantizedKVLayer.__init__

    def init(self, plan, **kw):
        orig_init(self, plan, **kw)
        c = self.k_codec
        if c.quantized and (c.bits == 2 or (scope == "all" and c.bits == 4)):
            self.k_codec = VQCodec(c, cbs[self.layer_idx])
            replaced.append((self.layer_idx, c.bits))

    L.QuantizedKVLayer.__init__ = init
    from lowbit.cli import main

    rc = main(argv)
    seen = sorted(set(replaced))
    print(f"# VQ probe ({sub}-dim x {E}, scope {scope}): K codec replaced on {len(seen)} layers: {seen}", file=sys.stderr)
    return rc


if __name__ == "__main__":
    if sys.argv[1] == "fit":
        fit(sys.argv[2:])
    else:
        sys.exit(patched_eval(sys.argv[1:]))
