"""Random tiered KV inputs for the decode-attention kernel tests (built through lowbit.quant)."""

from __future__ import annotations

import torch

from lowbit.quant.affine import quantize
from lowbit.quant.packing import pack


def packed_tier(x: torch.Tensor, bits: int, group: int):
    """x [B, Hkv, T, D] float -> (codes uint8 strided, scale fp16, zero fp16) via the one quantizer."""
    qz = quantize(x, bits, group, scale_dtype=torch.float16)
    return pack(qz.codes, bits, "strided"), qz.scale, qz.zero


def make_inputs(B, Hq, Hkv, D, T, *, kbits=2, vbits=2, group=None, Dv=None, sink=0, recent=0,
                mid_lens=None, sink_lens=None, recent_lens=None, dtype=torch.float32, device="cpu",
                seed=0, mid=True):
    """Keyword dict for decode_attention / decode_attention_ref. Lens default to full tiers."""
    g = torch.Generator().manual_seed(seed)
    Dv = Dv or D
    group = group or D

    def rnd(*shape):
        return torch.randn(*shape, generator=g)

    kw = {"q": (rnd(B, Hq, D)).to(dtype).to(device), "k_bits": kbits, "v_bits": vbits}
    if mid:
        # a per-channel offset makes keys look like real ones (outlier channels) and zero != 0
        kx = rnd(B, Hkv, T, D) + 2.0 * rnd(1, Hkv, 1, D)
        vx = rnd(B, Hkv, T, Dv)
        kc, ks, kz = packed_tier(kx, kbits, group)
        vc, vs, vz = packed_tier(vx, vbits, min(group, Dv))
        kw.update(k_codes=kc.to(device), k_scale=ks.to(device), k_zero=kz.to(device),
                  v_codes=vc.to(device), v_scale=vs.to(device), v_zero=vz.to(device))
        kw["mid_lens"] = (torch.tensor(mid_lens, dtype=torch.int32) if mid_lens is not None
                          else torch.full((B,), T, dtype=torch.int32)).to(device)
    else:
        kw.update(k_codes=None, k_scale=None, k_zero=None, v_codes=None, v_scale=None, v_zero=None)
    if sink:
        kw["sink_k"] = rnd(B, Hkv, sink, D).to(dtype).to(device)
        kw["sink_v"] = rnd(B, Hkv, sink, Dv).to(dtype).to(device)
        if sink_lens is not None:
            kw["sink_lens"] = torch.tensor(sink_lens, dtype=torch.int32).to(device)
    if recent:
        kw["recent_k"] = rnd(B, Hkv, recent, D).to(dtype).to(device)
        kw["recent_v"] = rnd(B, Hkv, recent, Dv).to(dtype).to(device)
        if recent_lens is not None:
            kw["recent_lens"] = torch.tensor(recent_lens, dtype=torch.int32).to(device)
    return kw


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))
