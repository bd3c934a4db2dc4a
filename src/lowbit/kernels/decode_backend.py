"""The "triton-decode" KV backend: what the fused split-K decode kernel can take, and its call from the cache.

Every capability rule of the kernel lives here once (the kernel's own argument checks, the plan, the
export and the cache ask these functions). This module does not import Triton: a plan can be resolved
and printed on a machine without it; `run` imports the kernel.

Static rules (per layer, checked when the plan is resolved):
    K and V both quantized, per-token groups, uniform grid (no Lloyd-Max levels),
    container bits in KERNEL_BITS, head_dim in KERNEL_HEAD_DIMS, group = D or D/2 with a tiling the
    kernel has (tiling_reason), recent > 0 (the new token must sit in a dense tier).
Per-call rules (checked each step, `call_reason`): the new token in the ring, no padding mask, no
logit soft-capping.
"""

from __future__ import annotations

import torch

from lowbit.kv.backends import Backend, register

NAME = "triton-decode"
KERNEL_BITS = (2, 4, 8)
KERNEL_HEAD_DIMS = (64, 128, 256)


def tiling_reason(bits: int, head_dim: int, group: int) -> str | None:
    """Why the kernel has no tiling for `bits`-bit codes of `head_dim` in groups of `group` (None: it has).

    Bytes per row S = head_dim * bits / 8; the kernel walks a row in whole groups, so the group is D or
    D/2, a power of two >= 16, and S and the group divide one another with both >= 16."""
    if bits not in KERNEL_BITS:
        return f"{bits}-bit codes (the kernel takes {', '.join(map(str, KERNEL_BITS))}-bit containers)"
    if head_dim not in KERNEL_HEAD_DIMS:
        return f"head_dim {head_dim} (the kernel takes {', '.join(map(str, KERNEL_HEAD_DIMS))})"
    if group <= 0 or head_dim % group or head_dim // group not in (1, 2):
        return f"group {group} at head_dim {head_dim} (the kernel takes group = D or D/2)"
    S = head_dim * bits // 8
    if group < 16 or group & (group - 1) or (S % group and group % S) or min(S, group) < 16:
        return f"group {group} with D={head_dim} at {bits} bits (no kernel tiling for it)"
    return None


def codec_reason(which: str, codec) -> str | None:
    """Why the kernel cannot read tensor `which` ("K"/"V") stored by `codec` (a lowbit.kv.codec.TensorCodec)."""
    if not codec.quantized:
        return f"{which} is stored at 16 bits (the kernel reads packed codes)"
    if codec.tq.axis != "token":
        return f"{which} is grouped per channel (the kernel takes per-token groups)"
    if codec.tq.lloyd_max:
        return f"{which} uses Lloyd-Max levels (the kernel takes the affine grid)"
    r = tiling_reason(codec.cbits, codec.head_dim, codec.group)
    return f"{which}: {r}" if r else None


def supports(layer, step: str, device: str) -> str | None:
    """Static rules for one lowbit.kv.plan.LayerPlan (see the module docstring)."""
    g = getattr(layer, "geometry", None)
    if getattr(g, "shares_kv", False):
        return ("K is rebuilt from the stored latent / V (mla-latent or K = V): the torch path reads it "
                "(no fused kernel for shared K/V yet)")
    for which, c in (("K", layer.k), ("V", layer.v)):
        r = codec_reason(which, c)
        if r:
            return r
    if layer.recent == 0:
        return "recent 0 (the new token is flushed straight into the middle; the kernel reads it from a dense tier)"
    if device not in ("cuda", "cpu"):
        return f"device {device} (the kernel runs on CUDA, or on CPU in the Triton interpreter)"
    return None


def call_reason(layer, keep, softcap) -> str | None:
    """Per-step rules: why this particular call of a QuantizedKVLayer cannot go to the kernel (None: it can)."""
    if layer.ring_len == 0:
        return "the new token is not in the recent ring (it went to the sink or straight to the middle)"
    if softcap:
        return "attention logit soft-capping"
    if keep is not None:
        return "padding mask (the kernel takes prefix-valid tiers)"
    return None


def run(layer, qg: torch.Tensor, scaling: float) -> torch.Tensor:
    """Decode attention of one new token over a QuantizedKVLayer's tiers through the fused kernel.

    qg [B, Hkv, G, 1, D] rotated queries. Returns [B, Hkv, G, 1, Dv] float32.
    """
    from lowbit.kernels.decode_attention import decode_attention

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
        mid = tuple(f[name][:, :, m0:] for f in (mk, mv) for name in ("codes", "scale", "zero"))
    out = decode_attention(
        q, *mid, k_bits=layer.k_codec.cbits, v_bits=layer.v_codec.cbits, sm_scale=scaling, **dense
    )  # [B, Hq, Dv]
    return out.float().reshape(B, Hkv, G, 1, -1)


BACKEND = register(Backend(NAME, ("decode",), supports, run, module=__name__))
