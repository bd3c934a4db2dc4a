"""The "triton-decode" KV backend: a decode step of a QuantizedKVLayer through lowbit's fused split-K kernels.

What the kernels can take is lowbit.kv.capabilities (the plan chose this backend for a layer from it);
this module registers the backend with those rules and runs the step: `run` (the word-trick kernel, or
the geometry kernel for other head dims), `run_vq` (VQ rows / 1-bit residual), `run_shared` (the latent
form for shared K/V layers). Importing it does not import Triton; `run*` import their kernel.
"""

from __future__ import annotations

import torch

from lowbit.backends import Backend, register
from lowbit.kv.capabilities import NAME, reads_with_decode_vq, supports
from lowbit.kv.rotations import rotate


def run(layer, qg: torch.Tensor, scaling: float) -> torch.Tensor:
    """Decode attention of one new token over a QuantizedKVLayer's tiers through the fused kernel.

    qg [B, Hkv, G, 1, D] rotated queries. Returns [B, Hkv, G, 1, Dv] float32.
    """
    from lowbit.kernels.attention.tiers import decode_attention

    if layer.shared:
        return run_shared(layer, qg, scaling)
    if reads_with_decode_vq(layer):
        return run_vq(layer, qg, scaling)
    view = layer.view()
    B, Hkv, G, _, D = qg.shape
    q = qg.reshape(B, Hkv * G, D).to(layer.dtype).contiguous()
    # The kernel has no window mask: hand it only the slots the query sees (>= n - window).
    # Every tier is a contiguous slot range, so that is a slice of each (row views, no copy).
    lo = view.n - layer.window if layer.window is not None else 0
    ring_lo = view.n - view.ring_k.shape[-2]
    s0, m0, r0 = max(0, lo), max(0, lo - view.mid_lo), max(0, lo - ring_lo)
    dense = {}
    if view.sink_k.shape[-2] > s0:
        dense.update(sink_k=view.sink_k[:, :, s0:], sink_v=view.sink_v[:, :, s0:])
    if view.ring_k.shape[-2] > r0:
        dense.update(recent_k=view.ring_k[:, :, r0:], recent_v=view.ring_v[:, :, r0:])
    mid = (None,) * 6
    if view.mid_len > m0:
        mk, mv = view.mid_k, view.mid_v
        # scale-only groups (zero "none") pass no zero: the kernel computes -centre * scale
        mid = tuple(f[name][:, :, m0:] if name in f else None for f in (mk, mv) for name in ("codes", "scale", "zero"))
    centres = {f"{t}_centre": c.centre for t, c in (("k", layer.k_codec), ("v", layer.v_codec)) if not c.stores_zero}
    out = decode_attention(
        q, *mid, k_bits=layer.k_codec.cbits, v_bits=layer.v_codec.cbits, sm_scale=scaling, **dense, **centres
    )  # [B, Hq, Dv]
    return out.float().reshape(B, Hkv, G, 1, -1)


def run_vq(layer, qg: torch.Tensor, scaling: float) -> torch.Tensor:
    """Decode step of a layer with VQ rows or a 1-bit residual through lowbit.kernels.attention.vq (a scalar tensor too).
    qg [B, Hkv, G, 1, D] rotated queries -> [B, Hkv, G, 1, Dv] float32."""
    from lowbit.kernels.attention.vq import MidTensor, decode_attention_vq

    view = layer.view()
    B, Hkv, G, _, D = qg.shape
    q = qg.reshape(B, Hkv * G, D).to(layer.dtype).contiguous()
    s0, m0, r0 = _window_slices(layer, view)
    dense = {}
    if view.sink_k.shape[-2] > s0:
        dense.update(sink_k=view.sink_k[:, :, s0:], sink_v=view.sink_v[:, :, s0:])
    if view.ring_k.shape[-2] > r0:
        dense.update(recent_k=view.ring_k[:, :, r0:], recent_v=view.ring_v[:, :, r0:])
    mids = (None, None)
    if view.mid_len > m0:
        mids = tuple(MidTensor(f["codes"][:, :, m0:], f["scale"][:, :, m0:], c.cbits,
                               c.codebook_on(q.device) if c.vq is not None else None, c.centre,
                               f["rbits"][:, :, m0:] if c.residual else None, f["rgain"][:, :, m0:] if c.residual else None)
                     for f, c in ((view.mid_k, layer.k_codec), (view.mid_v, layer.v_codec)))
    out = decode_attention_vq(q, *mids, sm_scale=scaling, **dense)  # [B, Hq, Dv]
    return out.float().reshape(B, Hkv, G, 1, -1)


BACKEND = register(Backend(NAME, ("decode",), supports, run, module=__name__))


def _window_slices(layer, view):
    """Slot offsets (sink, middle, ring) of the first slot the new query sees (the kernel has no window mask)."""
    lo = view.n - layer.window if layer.window is not None else 0
    ring_lo = view.n - view.ring_k.shape[-2]
    return max(0, lo), max(0, lo - view.mid_lo), max(0, lo - ring_lo)


def run_shared(layer, qg: torch.Tensor, scaling: float) -> torch.Tensor:
    """Decode step of a shared K/V layer (MLA latent, Gemma-4 K = V) through the latent kernel.

    qg [B, Hkv, G, 1, Dk] (K's basis: shared layers have no K rotation). K_t = [own: stored | rest:
    unrotate(V_t)[rest] * k_scale], so q . K_t = q[own] . k_own_t + rotate(q[rest] * k_scale, R_v) . V_t:
    the kernel gets q_lat = that rotated query (V's width) and q_pe = q[own]; its output is in V's
    rotated basis, which the cache takes back as for every layer. Returns [B, Hkv, G, 1, Dv] float32."""
    from lowbit.kernels.attention.geometry import decode_attention_latent
    view = layer.view()
    B, Hkv, G, _, D = qg.shape
    Dv = layer.geometry.head_dim_v
    q = qg.reshape(B, Hkv, G, D).float()
    rest, own = layer.k_rest, layer.k_own
    ql = q.new_zeros(B, Hkv, G, Dv)
    qr = q.index_select(-1, rest)
    if layer.k_scale_v is not None:
        qr = qr * layer.k_scale_v.to(qr.device, torch.float32).index_select(-1, rest)
    ql[..., rest] = qr  # K's rest dim d is V's dim d (layer.full_k)
    ql = rotate(ql, view.rot_v)  # [B, Hkv, G, Dv] @ R_v: the basis V is stored in
    q_lat = ql.reshape(B, Hkv * G, Dv).to(layer.dtype).contiguous()
    q_pe = q.index_select(-1, own).reshape(B, Hkv * G, -1).to(layer.dtype).contiguous() if len(own) else None
    s0, m0, r0 = _window_slices(layer, view)
    dense = {}
    if view.sink_v.shape[-2] > s0:
        dense.update(sink_v=view.sink_v[:, :, s0:], sink_pe=view.sink_k[:, :, s0:] if q_pe is not None else None)
    if view.ring_v.shape[-2] > r0:
        dense.update(recent_v=view.ring_v[:, :, r0:], recent_pe=view.ring_k[:, :, r0:] if q_pe is not None else None)
    codes = scale = zero = pe = None
    if view.mid_len > m0:
        mv = view.mid_v
        codes, scale, zero = (mv[n][:, :, m0:] for n in ("codes", "scale", "zero"))
        pe = view.mid_k["dense"][:, :, m0:] if q_pe is not None else None
    out = decode_attention_latent(q_lat, q_pe, codes, scale, zero, pe, bits=layer.v_codec.cbits,
                                  sm_scale=scaling, **dense)  # [B, Hq, Dv]
    return out.float().reshape(B, Hkv, G, 1, Dv)
