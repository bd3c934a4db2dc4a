"""Synthetic decode step of a random-weight Llama-3-8B-geometry model, CUDA-graph captured.

Per layer: RMSNorm, fused QKV projection, attention of the new token over L cached tokens, O
projection, RMSNorm, SwiGLU MLP; then the final norm and the LM head. Attention is either bf16
SDPA (flash, enable_gqa) over a bf16 KV of L tokens, or the fused kernel over the tiered int2 cache
(sink 64 + recent 256 in bf16, the rest packed 2-bit with fp16 scale/zero per 128). Not included,
on either side: RoPE and the write of the new token into the cache (a few microseconds per layer).
Weights are random bf16: the timing does not depend on their values.
"""

from __future__ import annotations

import math

import torch

LLAMA3_8B = {"layers": 32, "d_model": 4096, "Hq": 32, "Hkv": 8, "D": 128, "ffn": 14336, "vocab": 128256}


def _rms(x, w):
    return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype) * w


class SyntheticLlama:
    def __init__(self, B, L, mode, geo=LLAMA3_8B, sink=64, recent=256, group=128, bits=2, seed=0):
        from lowbit.kernels.decode_attention import KernelConfig

        self.B, self.L, self.mode, self.geo = B, L, mode, geo
        g = torch.Generator(device="cuda").manual_seed(seed)
        dev, bf = "cuda", torch.bfloat16
        d, Hq, Hkv, D, F = geo["d_model"], geo["Hq"], geo["Hkv"], geo["D"], geo["ffn"]

        def w(*shape):
            return (torch.randn(*shape, device=dev, dtype=bf, generator=g) / math.sqrt(shape[0]))

        self.layers = []
        kv_bytes = 0
        for _ in range(geo["layers"]):
            lw = {"n1": torch.ones(d, device=dev, dtype=bf), "n2": torch.ones(d, device=dev, dtype=bf),
                      "qkv": w(d, (Hq + 2 * Hkv) * D), "o": w(Hq * D, d), "gu": w(d, 2 * F), "dn": w(F, d)}
            if mode == "bf16":
                lw["k"] = torch.randn(B, Hkv, L, D, device=dev, dtype=bf, generator=g)
                lw["v"] = torch.randn(B, Hkv, L, D, device=dev, dtype=bf, generator=g)
                kv_bytes += lw["k"].nbytes + lw["v"].nbytes
            else:
                T = L - sink - recent
                S = D * bits // 8
                for n in ("k", "v"):
                    lw[n + "c"] = torch.randint(0, 256, (B, Hkv, T, S), device=dev, dtype=torch.uint8, generator=g)
                    lw[n + "s"] = (torch.rand(B, Hkv, T, D // group, device=dev, generator=g) * 0.1 + 0.01).half()
                    lw[n + "z"] = (-torch.rand(B, Hkv, T, D // group, device=dev, generator=g)).half()
                    lw[n + "sink"] = torch.randn(B, Hkv, sink, D, device=dev, dtype=bf, generator=g)
                    lw[n + "rec"] = torch.randn(B, Hkv, recent, D, device=dev, dtype=bf, generator=g)
                    kv_bytes += sum(lw[n + x].nbytes for x in ("c", "s", "z", "sink", "rec"))
            self.layers.append(lw)
        self.kv_bytes = kv_bytes
        self.kv_bytes_per_token = kv_bytes / (B * L)
        self.norm = torch.ones(d, device=dev, dtype=bf)
        self.head = w(d, geo["vocab"])
        self.x = torch.randn(B, d, device=dev, dtype=bf, generator=g)
        self.cfg = KernelConfig()
        self.bits = bits

    def step(self):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention as sdpa

        from lowbit.kernels.decode_attention import decode_attention

        geo, B = self.geo, self.B
        Hq, D = geo["Hq"], geo["D"]
        x = self.x
        for lw in self.layers:
            h = _rms(x, lw["n1"])
            qkv = h @ lw["qkv"]
            q = qkv[:, : Hq * D].reshape(B, Hq, D)
            if self.mode == "bf16":
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    a = sdpa(q[:, :, None], lw["k"], lw["v"], enable_gqa=True)[:, :, 0]
            else:
                a = decode_attention(q.contiguous(), lw["kc"], lw["ks"], lw["kz"], lw["vc"], lw["vs"], lw["vz"],
                                     k_bits=self.bits, v_bits=self.bits, sink_k=lw["ksink"], sink_v=lw["vsink"],
                                     recent_k=lw["krec"], recent_v=lw["vrec"], config=self.cfg)
            x = x + a.reshape(B, Hq * D) @ lw["o"]
            h = _rms(x, lw["n2"])
            gt, up = (h @ lw["gu"]).chunk(2, dim=-1)
            x = x + (torch.nn.functional.silu(gt) * up) @ lw["dn"]
        return _rms(x, self.norm) @ self.head

    def time_ms(self, reps=5, inner=5):
        for _ in range(2):
            self.step()
        torch.cuda.synchronize()
        stream = torch.cuda.Stream()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            self.step()
            torch.cuda.synchronize()
            with torch.cuda.graph(g, stream=stream):
                for _ in range(inner):
                    self.step()
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ts = []
        for _ in range(reps):
            s.record()
            g.replay()
            e.record()
            torch.cuda.synchronize()
            ts.append(s.elapsed_time(e) / inner)
        ts.sort()
        return ts[len(ts) // 2]


def capacity(budget_bytes=100e9, geo=LLAMA3_8B, sink=64, recent=256, group=128, bits=2):
    """Largest batch x context that fits `budget_bytes` of KV, from bytes per token (all layers)."""
    per_layer_heads = geo["layers"] * geo["Hkv"]
    bf16_tok = per_layer_heads * geo["D"] * 2 * 2
    packed_tok = per_layer_heads * 2 * (geo["D"] * bits // 8 + 4 * (geo["D"] // group))
    dense_seq = (sink + recent) * bf16_tok  # the bf16 tiers of one sequence (tokens there, not packed)
    out = {"bf16_bytes_per_token": bf16_tok, "int_bytes_per_token_middle": packed_tok,
           "int_dense_tier_bytes_per_sequence": dense_seq, "budget_bytes": budget_bytes, "bits": bits}
    rows = []
    for L in (4096, 32768, 131072):
        bf_b = int(budget_bytes // (bf16_tok * L))
        per_seq = dense_seq + packed_tok * max(0, L - sink - recent)
        q_b = int(budget_bytes // per_seq)
        rows.append({"context": L, "bf16_max_batch": bf_b, "int_max_batch": q_b,
                     "bf16_tokens": bf_b * L, "int_tokens": q_b * L})
    out["rows"] = rows
    out["bf16_max_tokens"] = int(budget_bytes // bf16_tok)
    return out
