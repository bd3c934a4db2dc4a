"""Probe (s25, issue 18): transform coding of K and V -- a loss-weighted KLT with bits allocated per dimension.

Why: today's 2-bit codecs spend the same bits on every dimension of a Hadamard-rotated row. The rotation makes the
dimensions equal in variance, which suits a per-row scale but throws away the transform-coding gain: when a few
directions carry most of the energy that matters, giving them more bits (and the rest fewer, or none) wins
(reverse water-filling). What "matters" is not the row's own energy:
  keys:   a key error e moves the score by q . e, so the loss is e^T Sigma_q e (Sigma_q: second moment of the
          queries of the KV head's query heads, post-RoPE, rotated as the cache rotates them);
  values: an error e in a value row reaches the residual stream as W_o,h e (summed over the KV head's query heads),
          so the loss is e^T (sum_h W_o,h^T W_o,h) e.
Per (layer, KV head): A = W^(1/2) (regularised), U = eigenvectors of A Sigma_x A, z = (x - m) A U has uncorrelated
dimensions whose squared error is the loss. Each dimension gets b_i bits (0-6) from a greedy allocation over the
layer's heads and dimensions, and a 1-D Lloyd-Max codebook fitted on the calibration rows. No per-row scale.
Decode: x^ = z^ U^T A^-1 + m. Servable shape: scores = (q A^-1 U) . z^ + q . m (the query transformed once per
step, q . m the same for every key), outputs = (sum a z^) U^T A^-1 + m (the transform after the weighted sum, foldable
into W_o): a decode kernel reads per-dimension codebook entries, as a rotation-set kernel reads rotated codes.

    python tc_probe.py capture --windows 8 --out CAP.pt            (stdlib text; post-RoPE K/V rotated as the cache does)
    python tc_probe.py fit --cap CAP.pt --kbits 2.5 --vbits 2.5 --out TC.pt [--kw q|none] [--vw wo|none]
    TC=TC.pt [TC_ONLY=K|V] python tc_probe.py eval <lowbit eval arguments>   (every quantized K/V codec replaced)
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

RECIPE = "src/lowbit/recipes/smollm2-135m@2.5.toml"
K4ALL = "benchmarks/results/quality/s20/smollm2-135m-k4all.toml"
SKIP = int(os.environ.get("TC_SKIP", "64"))  # diagnosis captures keep the sink rows (0)
MAXB = 6


# ----------------------------------------------------------------------------- maths
def lloyd_1d(z: torch.Tensor, L: int, iters: int = 30, w: torch.Tensor | None = None) -> torch.Tensor:
    """z [D, N] float32 (w [N] row weights) -> sorted levels [D, L] (per-row 1-D Lloyd-Max, quantile init)."""
    D = z.shape[0]
    ones = torch.ones_like(z) if w is None else w.expand_as(z).contiguous()
    if L == 1:
        return (z * ones).sum(1, keepdim=True) / ones.sum(1, keepdim=True)
    qs = torch.linspace(0.5 / L, 1 - 0.5 / L, L)
    lv = torch.quantile(z, qs, dim=1).T.contiguous()
    for _ in range(iters):
        idx = torch.searchsorted(((lv[:, 1:] + lv[:, :-1]) / 2).contiguous(), z.contiguous())
        s = torch.zeros(D, L).scatter_add_(1, idx, z * ones)
        c = torch.zeros(D, L).scatter_add_(1, idx, ones)
        lv = torch.where(c > 0, s / c.clamp_min(1), lv).sort(1).values.contiguous()
    return lv


def quantize_1d(z: torch.Tensor, lv: torch.Tensor) -> torch.Tensor:
    """z [D, N], levels [D, L] -> z^ [D, N]."""
    if lv.shape[1] == 1:
        return lv.expand_as(z)
    idx = torch.searchsorted(((lv[:, 1:] + lv[:, :-1]) / 2).contiguous(), z.contiguous())
    return torch.gather(lv, 1, idx)


def sqrt_pair(W: torch.Tensor, eps: float):
    """W [D, D] PSD -> (W^1/2, W^-1/2) with eigenvalues floored at eps * mean."""
    w, P = torch.linalg.eigh(W.double())
    w = w.clamp_min(0) + eps * w.clamp_min(0).mean()
    return ((P * w.sqrt()) @ P.T).float(), ((P / w.sqrt()) @ P.T).float()


def allocate(dist: torch.Tensor, total: int) -> torch.Tensor:
    """dist [n, MAXB+1] (distortion of each dimension at 0..MAXB bits) -> bits [n] summing to `total` (greedy)."""
    n = dist.shape[0]
    b = torch.zeros(n, dtype=torch.long)
    gain = dist[:, 0] - dist[:, 1]
    for _ in range(total):
        j = int(gain.argmax())
        b[j] += 1
        gain[j] = dist[j, b[j]] - dist[j, b[j] + 1] if b[j] < MAXB else -1.0
    return b


# ----------------------------------------------------------------------------- capture
def capture(argv):
    import argparse

    from lowbit.calib.capture import attention_layers, capture_attention
    from lowbit.calib.corpora import stdlib_text, token_windows
    from lowbit.kv.plan import resolve
    from lowbit.models import resolve as resolve_model
    from lowbit.recipe import load_recipe

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--recipe", default=RECIPE)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--keep-q", action="store_true", help="keep the rotated queries too (diagnosis)")
    ap.add_argument("--data", default=None, help="text file (diagnosis only: fits use the stdlib corpus)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    t0 = time.time()
    lm = resolve_model(a.model, dtype=torch.bfloat16)
    plan = resolve(load_recipe(a.recipe), lm.geometry)
    wins = token_windows(lm.tokenizer, Path(a.data).read_text() if a.data else stdlib_text(), a.seq_len, a.windows)
    K, V, SQ, Q, M1, M2 = {}, {}, {}, {}, {}, {}

    from lowbit.kv.key_affine import map_keys, map_queries

    def rot(x, r):
        return x.float() if r is None else torch.matmul(x.float(), r)

    def obs(module, q, k, v, mask, scaling, softcap):
        i = module.layer_idx
        pl = plan.layers[i]
        ka = getattr(pl, "k_affine", None)  # the key affine map, as _ingest applies it before R_k
        kr = rot(map_keys(k, ka), pl.rot_k).to(torch.bfloat16)[0, :, SKIP:]  # [H, T', D], as _ingest holds it
        vr = rot(v, pl.rot_v).to(torch.bfloat16)[0, :, SKIP:]
        H, Hq = k.shape[1], q.shape[1]
        qm = map_queries(q.reshape(1, H, -1, q.shape[-1]), ka)  # [1, H, G*T, D]
        qr = rot(qm, pl.rot_k).reshape(1, Hq, -1, q.shape[-1])[0, :, SKIP:]  # [Hq, T', D]
        qg = qr.reshape(H, Hq // H, -1, qr.shape[-1]).flatten(1, 2)  # [H, G*T', D]
        SQ[i] = SQ.get(i, 0) + torch.einsum("htd,hte->hde", qg, qg) / qg.shape[1]
        # attention each key row receives (sum over the group's queries of p, and of p^2), post-sink rows
        T = q.shape[2]
        sc = torch.matmul(q[0].float(), k[0].float().repeat_interleave(Hq // H, 0).transpose(-1, -2)) * scaling
        if pl.window is not None:
            sc = sc.masked_fill(torch.ones(T, T, dtype=torch.bool).tril(-pl.window), -torch.inf)
        p = sc.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), -torch.inf).softmax(-1)  # [Hq, T, T]
        M1.setdefault(i, []).append(p.sum(1).reshape(H, Hq // H, T).sum(1)[:, SKIP:].clone())
        M2.setdefault(i, []).append(p.pow(2).sum(1).reshape(H, Hq // H, T).sum(1)[:, SKIP:].clone())
        K.setdefault(i, []).append(kr.clone())
        if a.keep_q:
            Q.setdefault(i, []).append(qr.to(torch.bfloat16).clone())
        V.setdefault(i, []).append(vr.clone())

    with torch.no_grad(), capture_attention(lm.model, obs):
        for w in wins:
            lm.model(w[None], use_cache=False, logits_to_keep=1)
    WO = {}
    for m in attention_layers(lm.model):
        i = m.layer_idx
        W = m.o_proj.weight.detach().float()  # [hidden, Hq*D]
        H, D = K[i][0].shape[0], K[i][0].shape[-1]
        Hq = W.shape[1] // D
        Wh = W.reshape(W.shape[0], Hq, D).permute(1, 0, 2)  # [Hq, hidden, D]
        r = plan.layers[i].rot_v
        if r is not None:
            Wh = Wh @ r
        G = torch.einsum("hnd,hne->hde", Wh, Wh)  # [Hq, D, D]
        WO[i] = G.reshape(H, Hq // H, D, D).sum(1)
    out = {"K": {i: torch.stack(x) for i, x in K.items()}, "V": {i: torch.stack(x) for i, x in V.items()},
           "SQ": {i: s / a.windows for i, s in SQ.items()}, "WO": WO,
           "Q": {i: torch.stack(x) for i, x in Q.items()},
           "M1": {i: torch.stack(x) for i, x in M1.items()}, "M2": {i: torch.stack(x) for i, x in M2.items()}, "model": a.model, "recipe": a.recipe}
    torch.save(out, a.out)
    print(f"# captured {len(K)} layers, K {tuple(out['K'][0].shape)}; {time.time() - t0:.0f} s", flush=True)


# ----------------------------------------------------------------------------- fit
def fit(argv):
    import argparse

    from lowbit.kv.plan import resolve
    from lowbit.models import resolve as resolve_model
    from lowbit.recipe import kv_scheme_from_dict, load_recipe, read_recipe_file

    ap = argparse.ArgumentParser()
    ap.add_argument("--cap", required=True)
    ap.add_argument("--kbits", type=float, default=2.5, help="code bits per element, keys (every layer)")
    ap.add_argument("--vbits", type=float, default=2.5)
    ap.add_argument("--kbits-layers", default="", help="per-layer overrides 'i:bits,...' for keys")
    ap.add_argument("--vbits-layers", default="")
    ap.add_argument("--kw", default="q", choices=["q", "none"])
    ap.add_argument("--vw", default="wo", choices=["wo", "none"])
    ap.add_argument("--eps", type=float, default=1e-2)
    ap.add_argument("--importance", type=float, default=0.0,
                    help="weight calibration rows by (attention mass)^this: keys by the mass (sum p), values by sum p^2")
    ap.add_argument("--gain", action="store_true", help="a per-row fp16 gain (RMS of z); codebooks fit on z / gain; "
                    "the bits above are code bits (add 16 / D per element for the gain)")
    ap.add_argument("--holdout", type=int, default=2)
    ap.add_argument("--sample", type=int, default=65536)
    ap.add_argument("--tensors", default="KV", help="fit K, V or both")
    ap.add_argument("--layers", default="", help="fit only these layers (comma list); the rest keep the recipe's codecs")
    ap.add_argument("--recipe", default=None, help="the int2 / int4 comparison codecs' recipe (default: smollm2's)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    t0 = time.time()
    gen = torch.Generator().manual_seed(0)
    cap = torch.load(a.cap)
    lm = resolve_model(cap["model"], dtype=torch.bfloat16)
    geo = lm.geometry
    rec = a.recipe or RECIPE
    if a.recipe is None:  # smollm2: int2 everywhere, and int4 keys everywhere
        plan2 = resolve(kv_scheme_from_dict({k: v for k, v in read_recipe_file(rec)["kv"].items() if k != "layer_bits"}), geo)
        plan4 = resolve(load_recipe(K4ALL), geo)
    else:  # the recipe's own per-layer codecs in both comparison columns
        plan2 = plan4 = resolve(load_recipe(rec), geo)
    over = {t: {int(p.split(":")[0]): float(p.split(":")[1]) for p in s.split(",") if p}
            for t, s in (("K", a.kbits_layers), ("V", a.vbits_layers))}
    res, rows = {"K": {}, "V": {}}, []
    only = {int(x) for x in a.layers.split(",") if x}
    for i in sorted(cap["K"]):
        if only and i not in only:
            continue
        row = [i]
        for t in ("K", "V"):
            if t not in a.tensors:
                row += [0.0] * 5
                continue
            X = cap[t][i].float()  # [Wn, H, T', D]
            Wn, H, _, D = X.shape
            fx, hx = X[: Wn - a.holdout], X[Wn - a.holdout:]
            if t == "K":
                Wt = cap["SQ"][i] if a.kw == "q" else torch.eye(D).expand(H, D, D)
            else:
                Wt = cap["WO"][i] if a.vw == "wo" else torch.eye(D).expand(H, D, D)
            bits = over[t].get(i, a.kbits if t == "K" else a.vbits)
            heads, dists = [], []
            for h in range(H):
                x = fx[:, h].reshape(-1, D)
                if a.importance:
                    wr = cap["M1" if t == "K" else "M2"][i][: Wn - a.holdout, h].reshape(-1).float().pow(a.importance)
                    wr = wr / wr.mean()
                else:
                    wr = torch.ones(x.shape[0])
                m = (x * wr[:, None]).sum(0) / wr.sum()
                A, Ai = sqrt_pair(Wt[h], a.eps)
                y = (x - m) @ A
                _, U = torch.linalg.eigh(((y * wr[:, None]).T @ y / wr.sum()).double())
                U = U.flip(1).float()
                z = (y @ U).T.contiguous()  # [D, N]
                if a.gain:
                    z = z / z.pow(2).mean(0, keepdim=True).sqrt().clamp_min(1e-12)
                if z.shape[1] > a.sample:
                    sel = torch.randperm(z.shape[1], generator=gen)[: a.sample]
                    z, wr = z[:, sel].contiguous(), wr[sel]
                lvs = [lloyd_1d(z, 1 << b, w=wr) for b in range(MAXB + 1)]
                dist = torch.stack([((quantize_1d(z, lv) - z).pow(2) * wr).mean(1) for lv in lvs], 1)  # [D, MAXB+1]
                heads.append({"m": m, "A": A, "Ai": Ai, "U": U, "levels": lvs, "gain": a.gain})
                dists.append(dist)
            b = allocate(torch.cat(dists), round(bits * D * H)).reshape(H, D)
            num = den = num2 = num4 = 0.0
            cb_bits = 0
            for h in range(H):
                hd = heads[h]
                hd["bits"] = b[h]
                hd["lv"] = [hd["levels"][int(bb)][d] for d, bb in enumerate(b[h])]
                cb_bits += sum(16 << int(bb) for bb in b[h])
                x = hx[:, h].reshape(-1, D)
                xr = decode_rows(encode_rows(x, hd), hd)
                Wm = Wt[h]
                e = x - xr
                xc = x - x.mean(0)
                num += torch.einsum("nd,de,ne->", e, Wm, e).item()
                den += torch.einsum("nd,de,ne->", xc, Wm, xc).item()
                xb = x.to(torch.bfloat16)[None, None]
                for pl, acc in ((plan2, 2), (plan4, 4)):
                    c = pl.layers[i].k if t == "K" else pl.layers[i].v
                    e2 = c.decode(c.encode(xb, torch.bfloat16))[0, 0] - x
                    v = torch.einsum("nd,de,ne->", e2, Wm, e2).item()
                    if acc == 2:
                        num2 += v
                    else:
                        num4 += v
                del hd["levels"]
            res[t][i] = heads
            row += [num2 / den, num4 / den, num / den, b.float().mean().item(), cb_bits]
            print(f"layer {i:2d} {t}: weighted rel err int2 {num2 / den:.4f}  int4 {num4 / den:.5f}  "
                  f"TC@{b.float().mean():.3f} {num / den:.4f}  bits/dim {b.sum(0).tolist()}  ({time.time() - t0:.0f} s)",
                  flush=True)
        rows.append(row)
    for t, o in (("K", 1), ("V", 6)):
        med = lambda c: sorted(r[c] for r in rows)[len(rows) // 2]
        print(f"{t} median over layers: int2 {med(o):.4f}  int4 {med(o + 1):.5f}  TC {med(o + 2):.4f}")
    torch.save({"res": res, "rows": rows, "args": vars(a)}, a.out)


def encode_rows(x: torch.Tensor, hd) -> torch.Tensor:
    """x [N, D] -> z^ [N, D] (the decoded codebook entries; codes are their indices)."""
    z = ((x - hd["m"]) @ hd["A"] @ hd["U"]).T.contiguous()
    g = z.pow(2).mean(0, keepdim=True).sqrt().clamp_min(1e-12) if hd.get("gain") else None
    if g is not None:
        z = z / g
    out = torch.empty_like(z)
    for d, lv in enumerate(hd["lv"]):
        out[d] = quantize_1d(z[d:d + 1], lv[None])[0]
    if g is not None:  # least-squares gain for the chosen codes, stored fp16
        g = g * (z * out).sum(0, keepdim=True) / out.pow(2).sum(0, keepdim=True).clamp_min(1e-12)
        out = out * g.half().float()
    return out.T


def decode_rows(zq: torch.Tensor, hd) -> torch.Tensor:
    return zq @ hd["U"].T @ hd["Ai"] + hd["m"]


# ----------------------------------------------------------------------------- eval
def patched_eval(argv):
    from lowbit.kv import layer as L

    blob = torch.load(os.environ["TC"])
    res = blob["res"]
    replaced = []
    orig_init = L.QuantizedKVLayer.__init__

    def init(self, plan, **kw):
        orig_init(self, plan, **kw)
        i = self.layer_idx
        for t, name in (("K", "k_codec"), ("V", "v_codec")):
            if t not in os.environ.get("TC_ONLY", "KV"):
                continue
            c = getattr(self, name)
            if c.quantized and i in res[t]:
                setattr(self, name, make_tc_codec(c, res[t][i]))
                replaced.append((t, i))

    L.QuantizedKVLayer.__init__ = init
    from lowbit.cli import main

    rc = main(argv)
    print(f"# TC probe: codecs replaced {len(set(replaced))}", file=sys.stderr)
    return rc


def make_tc_codec(orig, heads):
    """A TensorCodec that stores the decoded rows (fake-quant: storage is a probe's, bits are computed)."""
    from lowbit.kv.codec import TensorCodec

    class TCCodec(TensorCodec):
        def __init__(self):
            self.__dict__.update(orig.__dict__)

        def fields(self):
            return {"dense": self.head_dim}

        def rows_per_entry(self, name):
            return 1

        def encode(self, x, dense_dtype, *, checks=True):
            B, H, T, D = x.shape
            out = torch.empty(B, H, T, D, dtype=torch.float32)
            for h in range(H):
                xs = x[:, h].reshape(-1, D).float()
                out[:, h] = decode_rows(encode_rows(xs, heads[h]), heads[h]).reshape(B, T, D)
            return {"dense": out.to(dense_dtype)}

        def decode(self, fields, dtype=torch.float32):
            return fields["dense"].to(dtype)

    return TCCodec()


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "capture":
        capture(sys.argv[2:])
    elif cmd == "fit":
        fit(sys.argv[2:])
    else:
        sys.exit(patched_eval(sys.argv[1:]))
