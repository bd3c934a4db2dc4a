"""What lowbit's fused decode kernels can take: the one capability table of the "triton-decode" backend.

Rules over a LayerPlan's codecs and geometry, and over one call; nothing here imports a kernel or
Triton. It sits in kv (below the kernels) so that lowbit.kv.plan chooses a layer's decode backend from
it without importing a kernel, the kernels check their own arguments against the same rules
(lowbit.kernels.attention.geometry asks geo_tiling_reason), and lowbit.backends.triton_decode runs what
the plan chose.

Two kernels (lowbit.kernels.attention.tiers, lowbit.kernels.attention.geometry), and the VQ kernel:
    head_dim in KERNEL_HEAD_DIMS (64/128/256): the word-trick kernel, group = D or D/2 (tiling_reason);
    other head dims (K192/V128, 512, ...): the chunked geometry kernel (geo_tiling_reason: chunks of
        gcd(packed row bytes, group) >= 16 dims, V a power of two);
    shared K/V layers (mla-latent, Gemma-4 K = V): the geometry kernel's latent form (shared_reason):
        V quantized (the stored latent / V), K's own dims dense with a power-of-two width >= 16;
    VQ rows or a 1-bit residual: lowbit.kernels.attention.vq (reads_with_decode_vq).
Static rules (per layer, checked when the plan is resolved: `supports`):
    K and V both quantized (shared layers: V), per-token groups, uniform grid (no Lloyd-Max levels),
    container bits in KERNEL_BITS, a tiling one of the kernels has, recent > 0 (the new token must
    sit in a dense tier).
Per-call rules (checked each step, `call_reason`): the new token in the ring, no padding mask, no
logit soft-capping.
"""

from __future__ import annotations

import math

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


def geo_tiling_reason(bits: int, head_dim: int, group: int, *, value: bool = False) -> str | None:
    """Why the geometry kernel (lowbit.kernels.attention.geometry) has no tiling for `bits`-bit codes of
    `head_dim` in groups of `group` (None: it has). A packed row of S = head_dim*bits/8 bytes is cut into
    chunks of W = gcd(S, group) dims (one byte range, one group); W must be >= 16 (the MMA's K), the group
    a power of two dividing head_dim; `value` rows are also accumulated whole: a power of two <= 1024."""


    if bits not in KERNEL_BITS:
        return f"{bits}-bit codes (the kernel takes {', '.join(map(str, KERNEL_BITS))}-bit containers)"
    if head_dim % 16 or head_dim > 1024:
        return f"head_dim {head_dim} (the geometry kernel takes multiples of 16 up to 1024)"
    if value and head_dim & (head_dim - 1):
        return f"V head_dim {head_dim} (the geometry kernel takes a power of two for V)"
    if group <= 0 or group & (group - 1) or head_dim % group:
        return f"group {group} at head_dim {head_dim} (the geometry kernel takes a power of two dividing it)"
    w = math.gcd(head_dim * bits // 8, group)
    if w < 16:
        return f"group {group} with D={head_dim} at {bits} bits (register chunks of {w} dims; the kernel needs >= 16)"
    return None


def _vq_reason(which: str, codec) -> str | None:
    """Why lowbit.kernels.attention.vq cannot read tensor `which` of a layer with VQ rows (None: it can)."""
    D = codec.head_dim
    if D < 16 or D & (D - 1):
        return f"{which} head_dim {D} (the VQ decode kernel takes power-of-two head dims >= 16)"
    if codec.vq is not None:
        n = D // codec.vq[0]
        return None if n >= 2 and not n & (n - 1) else f"{which}: {n} VQ indices per row (the kernel takes a power of two)"
    if codec.stores_zero or codec.cbits not in (2, 4, 8) or (D // codec.group) & (D // codec.group - 1):
        return (f"{which} beside VQ rows or a residual must be scale-only 2/4/8-bit groups of a power-of-two count "
                "(the VQ decode kernel's scalar path)")
    return None


def codec_reason(which: str, codec, vq_layer: bool = False) -> str | None:
    """Why the kernel cannot read tensor `which` ("K"/"V") stored by `codec` (a lowbit.kv.codec.TensorCodec).
    vq_layer: the other tensor of the layer is VQ or has a residual, so lowbit.kernels.attention.vq reads this one too."""
    if not codec.quantized:
        return f"{which} is stored at 16 bits (the kernel reads packed codes)"
    if codec.tq.axis != "token":
        return f"{which} is grouped per channel (the kernel takes per-token groups)"
    if codec.tq.lloyd_max:
        return f"{which} uses Lloyd-Max levels (the kernel takes the affine grid)"
    if codec.tq.vq is not None or codec.tq.residual is not None or vq_layer:
        return _vq_reason(which, codec)
    if not codec.stores_zero and codec.head_dim not in KERNEL_HEAD_DIMS:
        return (f"{which} has scale-only groups at head_dim {codec.head_dim} (only the head_dim "
                f"{'/'.join(map(str, KERNEL_HEAD_DIMS))} kernel computes the zero from the scale)")
    if codec.head_dim in KERNEL_HEAD_DIMS:
        r = tiling_reason(codec.cbits, codec.head_dim, codec.group)
    else:
        r = geo_tiling_reason(codec.cbits, codec.head_dim, codec.group, value=which == "V")
    return f"{which}: {r}" if r else None


def shared_reason(layer) -> str | None:
    """Why the latent form of the geometry kernel cannot take a shared K/V layer (None: it can):
    V (the stored latent / V) is read as packed codes, K's own dims (k_pe, the RoPE'd dims) densely."""
    r = codec_reason("V", layer.v)
    if r:
        return r
    if not layer.v.stores_zero:
        return "V has scale-only groups (the latent kernel reads a stored zero)"
    if layer.v.head_dim & (layer.v.head_dim - 1) or layer.v.head_dim < 16:
        return f"shared K/V width {layer.v.head_dim} (the latent kernel takes a power of two)"
    own = len(layer.geometry.k_own_dims())
    if own and (own < 16 or own & (own - 1)):
        return f"K's own part has {own} dims (the latent kernel takes a power of two >= 16, or none)"
    if layer.k.quantized:
        return "K's own part is quantized (the latent kernel reads it dense)"
    return None


def supports(layer, step: str, device: str) -> str | None:
    """Static rules for one lowbit.kv.plan.LayerPlan (see the module docstring)."""
    g = getattr(layer, "geometry", None)
    if getattr(g, "shares_kv", False):
        r = shared_reason(layer)
        if r:
            return r
    else:
        vq_layer = reads_with_decode_vq(layer)
        for which, c in (("K", layer.k), ("V", layer.v)):
            r = codec_reason(which, c, vq_layer)
            if r:
                return r
    if layer.recent == 0:
        return "recent 0 (the new token is flushed straight into the middle; the kernel reads it from a dense tier)"
    if device not in ("cuda", "cpu"):
        return f"device {device} (the kernel runs on CUDA, or on CPU in the Triton interpreter)"
    return None


def reads_with_decode_vq(layer) -> bool:
    """Whether K or V of the layer (a LayerPlan or QuantizedKVLayer: .k/.v or .k_codec/.v_codec) holds VQ rows
    or a 1-bit residual: lowbit.kernels.attention.vq reads those, decode_attention does not."""
    cs = (getattr(layer, "k_codec", None) or layer.k, getattr(layer, "v_codec", None) or layer.v)
    return any(c.quantized and (c.vq is not None or c.residual is not None) for c in cs)


def kernel_name(layer) -> str:
    """Which fused kernel runs a layer the backend takes (for the plan table)."""
    if reads_with_decode_vq(layer):
        return "decode_vq (VQ rows / 1-bit residual)"
    g = getattr(layer, "geometry", None)
    if getattr(g, "shares_kv", False):
        what = "MLA latent" if g.storage == "mla-latent" else "K = V"
        return (f"decode_geometry latent form, {what}: {layer.v.head_dim} packed for K and V + "
                f"{len(g.k_own_dims())} dense K dims")
    if layer.k.head_dim in KERNEL_HEAD_DIMS and layer.v.head_dim in KERNEL_HEAD_DIMS:
        return "decode_attention"
    return f"decode_geometry, K {layer.k.head_dim} / V {layer.v.head_dim}"


def call_reason(layer, keep, softcap) -> str | None:
    """Per-step rules: why this particular call of a QuantizedKVLayer cannot go to the kernel (None: it can)."""
    if layer.ring_len == 0:
        return "the new token is not in the recent ring (it went to the sink or straight to the middle)"
    if softcap:
        return "attention logit soft-capping"
    if keep is not None:
        return "padding mask (the kernel takes prefix-valid tiers)"
    return None
