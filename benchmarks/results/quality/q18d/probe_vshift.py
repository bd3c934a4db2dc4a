"""Probe: V shift (calibration per-channel mean of V per KV head) subtracted at ingest, added after attention."""
import sys, torch
import lowbit.models
from lowbit.calib.corpora import load_text, token_windows
from lowbit.calib.capture import capture_attention
from lowbit.kv import layer as L, cache as C

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
