"""Probe: a V shift -- the calibration per-channel mean of V per KV head (stdlib,
2 x 1024) subtracted at ingest and added back after attention (exact for attention: the weights sum to 1) -- run
through `lowbit eval` by patching the eager cache (QuantizedKVLayer._ingest / QuantizedKVCache.attend).

    PYTHONPATH=src python benchmarks/quality_vshift_probe.py smollm2-135m eval --model smollm2-135m \
        --recipe smollm2-135m@2.5 --windows 4 --seq-len 2048 --chunk 128 --no-full-window --threads 2 --json OUT.json

Result (git history: benchmarks/results/quality/ppl_smollm2-135m_vshift_probe_s17.json): +4.89% against +4.07% without the shift
(same recipe, protocol and bf16 PPL 24.528): the shift hurts, so it was not built into the codec."""
import sys

import torch

import lowbit.models
from lowbit.calib.capture import capture_attention
from lowbit.calib.corpora import load_text, token_windows
from lowbit.runtime import cache as C
from lowbit.kv import layer as L

model = sys.argv[1]; argv = sys.argv[2:]
torch.set_num_threads(2)
lm = lowbit.models.resolve(model, dtype=torch.float32)
win = token_windows(lm.tokenizer, load_text("stdlib"), 1024, 2)
sv, n = {}, {}
def obs(module, q, k, v, mask, scaling, softcap=None):
    i = int(module.layer_idx); x = v[:, :, 64:].double()
    sv[i] = sv.get(i, 0) + x.sum((0, 2)); n[i] = n.get(i, 0) + x.shape[0] * x.shape[2]
    e = x.pow(2).mean((0,2)).sum(-1); m = (x.mean((0,2))**2).sum(-1)
    print(f"layer {i}: mean energy share {float((m/e).mean()):.3f}", file=sys.stderr)
with torch.no_grad(), capture_attention(lm.model, obs):
    for w in win: lm.model(w[None], use_cache=False, logits_to_keep=1)
SH = {i: (sv[i] / n[i]).float() for i in sv}  # [Hkv, Dv]
del lm
orig_ingest, orig_attend = L.QuantizedKVLayer._ingest, C.QuantizedKVCache.attend
def ingest(self, k, v):
    s = SH[self.layer_idx].to(v.device)[None, :, None, :]
    return orig_ingest(self, k, (v.float() - s))
def attend(self, li, query, mask, **kw):
    out = orig_attend(self, li, query, mask, **kw)  # [B, Lq, Hq, Dv]
    s = SH[li].to(out.device); G = out.shape[2] // s.shape[0]
    return (out.float() + s.repeat_interleave(G, 0)[None, None]).to(out.dtype)
L.QuantizedKVLayer._ingest = ingest; C.QuantizedKVCache.attend = attend
from lowbit.cli import main

sys.exit(main(argv))
