"""Exactness of the V-shift probe's patch: a bf16 QuantizedKVCache with the shift gives the logits it gives without."""
import torch, lowbit.models
from lowbit.kv import layer as L, cache as C, QuantizedKVCache
from lowbit.recipe import parse_kv_scheme
torch.set_num_threads(1)
lm = lowbit.models.resolve("smollm2-135m", dtype=torch.float32)
g = torch.Generator().manual_seed(0)
SH = {i: torch.randn(lm.geometry.layers[i].num_kv_heads, lm.geometry.layers[i].head_dim_v, generator=g) * 3 for i in range(lm.geometry.num_layers)}
ids = torch.randint(0, 4000, (1, 200), generator=g)
def run():
    cache = QuantizedKVCache(lm.model, parse_kv_scheme("bf16", sink=16, recent=32, page=16))
    outs = []
    for a in range(0, 200, 50):
        outs.append(lm.model(ids[:, a:a+50], past_key_values=cache, use_cache=True).logits)
    return torch.cat(outs, 1)
ref = run()
oi, oa = L.QuantizedKVLayer._ingest, C.QuantizedKVCache.attend
def ingest(self, k, v): return oi(self, k, v.float() - SH[self.layer_idx][None, :, None, :])
def attend(self, li, q, m, **kw):
    out = oa(self, li, q, m, **kw); s = SH[li]; G = out.shape[2] // s.shape[0]
    return (out.float() + s.repeat_interleave(G, 0)[None, None]).to(out.dtype)
L.QuantizedKVLayer._ingest, C.QuantizedKVCache.attend = ingest, attend
got = run()
print("max |dlogit|", float((got - ref).abs().max()), "ref scale", float(ref.abs().max()))
