"""Torch twins of the Triton kernels: the same op, computed plainly in float32.

`decode_attention_ref` takes exactly the arguments of lowbit.kernels.attention.tiers.decode_attention
(minus launch config), unpacks the middle tier with lowbit.quant.packing.unpack (the one home of the
layout), dequantizes x = codes * scale + zero, concatenates the valid slots of every tier and runs a
float32 softmax attention per sequence. Kept deliberately simple: it is what the kernel is judged by.
"""

from __future__ import annotations

import math

import torch

from lowbit.quant import residual, scale_format, vq
from lowbit.quant.packing import unpack

LAYOUT = "strided"  # the middle-tier packing layout the kernel reads (docs/CONTRACTS.md)


def dequantize_tier(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int,
                    centre: float | None = None) -> torch.Tensor:
    """uint8 [..., D*bits/8] + fp16 [..., D/group] -> float32 [..., D]. zero None: scale-only groups,
    x = (codes - centre) * scale; their scale may be uint8 UE5M3 codes (lowbit.quant.scale_format)."""
    c = unpack(codes, bits, LAYOUT).float()  # [..., D]
    ng = scale.shape[-1]
    D = c.shape[-1]
    c = c.reshape(*c.shape[:-1], ng, D // ng)
    s = scale_format.decode(scale) if scale.dtype == torch.uint8 else scale.float()
    z = zero.float() if zero is not None else s * -float(centre)
    x = c * s[..., None] + z[..., None]
    return x.reshape(*x.shape[:-2], D)


def _lens(x, B, N, device):
    if x is None:
        x = N
    if isinstance(x, int):
        return [x] * B
    return [int(v) for v in x.to("cpu")]


def decode_attention_ref(
    q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, mid_lens=None, *,
    k_bits=2, v_bits=2, sm_scale=None, sink_k=None, sink_v=None, sink_lens=None,
    recent_k=None, recent_v=None, recent_lens=None, k_centre=None, v_centre=None,
) -> torch.Tensor:
    """Same signature and semantics as decode_attention; returns float32 [B, Hq, Dv]."""
    mid = None
    if k_codes is not None:
        mid = (dequantize_tier(k_codes, k_scale, k_zero, k_bits, k_centre),
               dequantize_tier(v_codes, v_scale, v_zero, v_bits, v_centre))
    return _attend(q, mid, mid_lens, sm_scale, sink_k, sink_v, sink_lens, recent_k, recent_v, recent_lens)


def dequantize_mid(m) -> torch.Tensor:
    """A lowbit.kernels.attention.vq.MidTensor -> float32 [B, Hkv, T, D]: VQ rows through lowbit.quant.vq,
    scalar scale-only groups through dequantize_tier, plus a 1-bit residual through lowbit.quant.residual."""
    if m.codebook is None:
        x = dequantize_tier(m.codes, m.scale, None, m.bits, m.centre)
    else:
        s = scale_format.decode(m.scale) if m.scale.dtype == torch.uint8 else m.scale.float()
        x = vq.decode(vq.unpack_idx(m.codes, m.vq[1]), s, m.codebook)
    if m.rbits is not None:
        g = scale_format.decode(m.rgain) if m.rgain.dtype == torch.uint8 else m.rgain.float()
        x = x + residual.decode(m.rbits, g)
    return x


def decode_attention_vq_ref(q, k_mid, v_mid, mid_lens=None, *, sm_scale=None, sink_k=None, sink_v=None,
                            sink_lens=None, recent_k=None, recent_v=None, recent_lens=None) -> torch.Tensor:
    """Twin of lowbit.kernels.attention.vq.decode_attention_vq (same arguments); float32 [B, Hq, Dv]."""
    mid = None if k_mid is None else (dequantize_mid(k_mid), dequantize_mid(v_mid))
    return _attend(q, mid, mid_lens, sm_scale, sink_k, sink_v, sink_lens, recent_k, recent_v, recent_lens)


def _attend(q, mid, mid_lens, sm_scale, sink_k, sink_v, sink_lens, recent_k, recent_v, recent_lens):
    """float32 softmax attention of q [B, Hq, D] over the valid rows of each tier (mid: dequantized (k, v))."""
    B, Hq, D = q.shape
    tiers = []  # (k [B, Hkv, N, D] f32, v [B, Hkv, N, Dv] f32, lens list)
    if mid is not None:
        tiers.append((mid[0], mid[1], _lens(mid_lens, B, mid[0].shape[2], q.device)))
    for k, v, n in ((sink_k, sink_v, sink_lens), (recent_k, recent_v, recent_lens)):
        if k is not None:
            tiers.append((k.float(), v.float(), _lens(n, B, k.shape[2], q.device)))
    Hkv = tiers[0][0].shape[1]
    Dv = tiers[0][1].shape[3]
    G = Hq // Hkv
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(D)
    out = torch.zeros(B, Hq, Dv, dtype=torch.float32, device=q.device)
    for b in range(B):
        ks = [k[b, :, : n[b]] for k, _, n in tiers]
        vs = [v[b, :, : n[b]] for _, v, n in tiers]
        K = torch.cat(ks, dim=1)  # [Hkv, N, D]
        V = torch.cat(vs, dim=1)
        if K.shape[1] == 0:
            continue  # no valid token: zeros (what the kernel returns)
        qb = q[b].float().reshape(Hkv, G, D)
        s = torch.einsum("hgd,hnd->hgn", qb, K) * scale
        p = torch.softmax(s, dim=-1)
        out[b] = torch.einsum("hgn,hnd->hgd", p, V).reshape(Hq, Dv)
    return out


def decode_attention_latent_ref(
    q_lat, q_pe, codes, scale, zero, pe, mid_lens=None, *, bits=2, sm_scale=None,
    sink_v=None, sink_pe=None, sink_lens=None, recent_v=None, recent_pe=None, recent_lens=None, dense_mid=False,
) -> torch.Tensor:
    """Twin of lowbit.kernels.attention.geometry.decode_attention_latent; float32 [B, Hq, D].

    Written as the attention it stands for: K_t = [x_t | pe_t], V_t = x_t, q = [q_lat | q_pe], the middle's
    x dequantized (or dense with dense_mid), every tier's valid slots concatenated, float32 softmax."""
    B, Hq, D = q_lat.shape
    has_pe = q_pe is not None

    def key(x, p):
        return torch.cat([x, p.float()], -1) if has_pe else x

    tiers = []
    if codes is not None:
        x = codes.float() if dense_mid else dequantize_tier(codes, scale, zero, bits)
        tiers.append((key(x, pe), x, _lens(mid_lens, B, codes.shape[2], q_lat.device)))
    for v, p, n in ((sink_v, sink_pe, sink_lens), (recent_v, recent_pe, recent_lens)):
        if v is not None:
            tiers.append((key(v.float(), p), v.float(), _lens(n, B, v.shape[2], q_lat.device)))
    q = torch.cat([q_lat.float(), q_pe.float()], -1) if has_pe else q_lat.float()
    Hkv = tiers[0][0].shape[1]
    G = Hq // Hkv
    scale_ = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    out = torch.zeros(B, Hq, D, dtype=torch.float32, device=q_lat.device)
    for b in range(B):
        K = torch.cat([k[b, :, : n[b]] for k, _, n in tiers], dim=1)  # [Hkv, N, D + DR]
        V = torch.cat([v[b, :, : n[b]] for _, v, n in tiers], dim=1)
        if K.shape[1] == 0:
            continue
        s = torch.einsum("hgd,hnd->hgn", q[b].reshape(Hkv, G, -1), K) * scale_
        out[b] = torch.einsum("hgn,hnd->hgd", torch.softmax(s, -1), V).reshape(Hq, D)
    return out
