"""Probe: metadata variants for int2 at group 64 on smollm2-135m (stdlib text), attention-output error per layer."""
import math

import torch

torch.set_num_threads(1)
from lowbit.calib.capture import capture_attention
from lowbit.calib.corpora import load_text, token_windows
from lowbit.models import resolve
from lowbit.quant.lloyd_max import gaussian_uniform_step
from lowbit.rotation.hadamard import hadamard

lm = resolve('smollm2-135m')
tok = lm.tokenizer
W = token_windows(tok, load_text('stdlib'), 1024, 3)
caps = {}
class Obs:
    def __init__(self, slot): self.slot = slot
    def __call__(self, module, query, key, value, attention_mask, scaling, softcap=None):
        caps.setdefault(self.slot, {})[int(module.layer_idx)] = (query[0].float(), key[0].float(), value[0].float())
for j in range(3):
    with torch.no_grad(), capture_attention(lm.model, Obs(j)):
        lm.model(W[j][None], use_cache=False, logits_to_keep=1)
D = 64; H = hadamard(D)
U = gaussian_uniform_step(2)
S = 64

def q_std(x):  # [.., D] group = D
    m = x.mean(-1, keepdim=True); s = x.std(-1, correction=0, keepdim=True) * U
    s = s.half().float(); z = (m - 1.5 * s).half().float()
    c = ((x - z) / s).round().clamp(0, 3); return c * s + z
def q_sym(x):
    s = (x.pow(2).mean(-1, keepdim=True).sqrt() * U).half().float()
    c = (x / s + 1.5).round().clamp(0, 3); return (c - 1.5) * s
def q_sym_opt(x):  # scale searched per row (MSE) over a few multiples
    base = x.pow(2).mean(-1, keepdim=True).sqrt() * U
    best = None; bx = None
    for f in (0.8, 0.9, 1.0, 1.1, 1.2):
        s = (base * f).half().float(); c = (x / s + 1.5).round().clamp(0, 3); xh = (c - 1.5) * s
        e = (xh - x).pow(2).sum(-1, keepdim=True)
        if best is None: best, bx = e, xh
        else:
            m = e < best; best = torch.where(m, e, best); bx = torch.where(m, xh, bx)
    return bx
def q_fp8(x, frac=16):  # std grid, scale fp8 e4m3 (with a per-tensor pow2 exponent bias), zero int8 in steps of scale/frac
    m = x.mean(-1, keepdim=True); s = x.std(-1, correction=0, keepdim=True) * U
    e = torch.floor(torch.log2(s.max())) - 7
    s8 = (s / 2**e).to(torch.float8_e4m3fn).float() * 2**e
    zc = ((m - 1.5 * s8) / s8 * frac).round().clamp(-128, 127)
    z = zc * s8 / frac
    c = ((x - z) / s8).round().clamp(0, 3); return c * s8 + z

def attn(q, k, v, G):  # q [Hq,T,D], k/v [Hkv,T,D]
    k = k.repeat_interleave(G, 0); v = v.repeat_interleave(G, 0)
    T = q.shape[1]
    sc = q @ k.transpose(-1, -2) / math.sqrt(D)
    sc = sc.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float('-inf'))
    return sc.softmax(-1) @ v

variants = {'std': q_std, 'sym': q_sym, 'symopt': q_sym_opt, 'fp8z16': q_fp8}
tot = {}
for li in sorted(caps[0]):
    q0, k0, v0 = caps[0][li]; mu_k = (k0[:, S:] @ H).mean(1, keepdim=True); mu_v = (v0[:, S:] @ H).mean(1, keepdim=True)
    row = []
    for j in (1, 2):
        q, k, v = caps[j][li]
        G = q.shape[0] // k.shape[0]
        kr, vr, qr = k @ H, v @ H, q @ H
        ref = attn(qr, kr, vr, G)
        nref = ref[:, S:].pow(2).sum()
        for name, f in list(variants.items()) + [('sym-mu', q_sym), ('symopt-mu', q_sym_opt), ('std-mu', q_std)]:
            for t in 'KV':
                x = kr if t == 'K' else vr
                mu = (mu_k if t == 'K' else mu_v) if name.endswith('-mu') else 0.0
                xq = x.clone(); xq[:, S:] = f(x[:, S:] - mu) + mu
                out = attn(qr, xq, vr, G) if t == 'K' else attn(qr, kr, xq, G)
                e = float((out[:, S:] - ref[:, S:]).pow(2).sum() / nref)
                tot.setdefault((name, t), []).append(e)
    print(li, ' '.join(f"{n}{t}={10*math.log10(sum(tot[(n,t)][-2:])/2):.1f}" for (n, t) in tot), flush=True)
print('SUM over layers (relative error energy, mean of 2 windows):')
for (n, t), v in tot.items():
    print(f"{n:10s} {t} {sum(v)/2:.4f}")
