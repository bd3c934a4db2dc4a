"""Held bits: the budget's unit. Bits per element of the quantized (middle) tier, averaged over the
elements each layer actually holds at a context of N tokens.

    from lowbit.kv.held import held_bits
    h = held_bits(plan, 32768)        # a lowbit.kv.plan.Plan (or held_bits(scheme, geometry=g, context=N))
    h.bits, h.k_bits, h.v_bits        # e.g. 2.41, 2.25, 2.57
    h.dense                           # the model-dtype sink + recent tiers, reported beside (not inside)
    held_bits_of_cache(cache)         # the same average over what a live QuantizedKVCache holds now

Why "held": a layer's weight in the average is the number of middle elements it holds at N, so
gemma3's full-attention layers, which hold ~97% of the middle at 32k (its sliding layers keep at most
their 512-token window), weigh 97%; a plain mean over layers would let cheap sliding layers hide them.

What one middle element costs (per layer, per tensor, from the layer's TensorCodec: the fields the
cache allocates): codes (container bits: 3-bit codes sit in 4-bit containers) + fp16 scale and zero
(the scale alone for scale-only groups, TensorQuant zero "none") per group (token axis: per `group` channels of a token; channel axis: per channel over a page) +
Lloyd-Max codebooks (2**bits float32 per layer and tensor) or VQ codebooks ([H_kv, E, SUB] fp16 per layer
and tensor) amortised over that layer's elements.
A middle stored unquantized (bits 16, e.g. a layer_bits "bf16" override) counts at `dense_bits`.

Tier lengths at N come from `tier_tokens`, the integer twin of lowbit.kv.layer.QuantizedKVLayer's
update / flush / evict arithmetic (sink fills first, the ring flushes whole pages to the middle once
it holds recent + page, sliding layers evict whole pages from the front); tests check it against a
real cache fed the same chunks. This module is the one place held bits are computed: `lowbit tune`'s
budget, `lowbit eval`'s bits_held and results/quality/summary.json all call it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from lowbit.core.errors import LowbitError

DEFAULT_CONTEXT = 32768
CODEBOOK_VALUE_BITS = 32  # Lloyd-Max levels are float32


@lru_cache(maxsize=256)
def tier_tokens(context: int, sink: int, recent: int, page: int, window: int | None,
                chunk: int = 1) -> tuple[int, int, int]:
    """(sink, middle, recent) tokens one layer holds after `context` tokens fed `chunk` at a time.

    Mirrors QuantizedKVLayer.update: before a chunk a sliding layer (window W) evicts slots
    < n - (W - 1) (the sink once all of it is out, whole pages of the middle, then ring rows); the
    first `sink` slots go to the sink, the rest to the ring; the ring's oldest whole pages move to the
    middle while at least `recent` tokens stay.
    """
    if context < 0 or chunk < 1:
        raise ValueError(f"tier_tokens: context {context} must be >= 0 and chunk {chunk} >= 1")
    n = sink_len = mid_lo = mid_len = ring_len = 0
    fed = 0
    while fed < context:
        c = min(chunk, context - fed)
        if window is not None:
            e = n - (window - 1)
            if e > 0:
                if sink_len and n >= sink and e >= sink_len:
                    sink_len = 0
                if mid_len:
                    rows = min(mid_len, max(0, e - mid_lo)) // page * page
                    mid_len -= rows
                    mid_lo += rows
                if mid_len == 0 and ring_len:
                    drop = min(ring_len, e - (n - ring_len))
                    if drop > 0:
                        ring_len -= drop
                    mid_lo = n - ring_len
        i = 0
        if n < sink:
            i = min(sink - n, c)
            sink_len = n + i
        n += c
        ring_len += c - i
        pages = (ring_len - recent) // page
        if pages > 0:
            rows = pages * page
            if mid_len == 0:
                mid_lo = n - ring_len
            mid_len += rows
            ring_len -= rows
        fed += c
    return sink_len, mid_len, ring_len


def codec_bits_per_token(codec, dense_bits: int = 16) -> float:
    """Bits one middle token costs per KV head in this codec (codes + scale/zero), from its fields:
    what QuantizedKVLayer._alloc_mid allocates (uint8 codes, fp16 or one-byte scales, fp16 zeros;
    channel-axis scale rows cover a page of tokens)."""
    total = 0.0
    for name, width in codec.fields().items():
        total += width * codec.field_bits(name, dense_bits) / codec.rows_per_entry(name)
    return total


@dataclass
class LayerHeld:
    """One layer at the context: tokens per tier (per sequence), middle elements and bits of K and V."""

    index: int
    attention: str
    window: int | None
    tokens: dict  # {"sink", "middle", "recent"}
    elements_k: int
    elements_v: int
    bits_k: float  # total bits of the K middle (codes + scale/zero + codebook)
    bits_v: float
    codebook_bits: float = 0.0  # the part of bits_k + bits_v that is Lloyd-Max levels
    dense_elements: int = 0  # K + V elements of the sink and recent tiers (model dtype, beside the middle)


@dataclass
class HeldBits:
    """Held bits at `context` (see the module docstring). bits / k_bits / v_bits: None when no layer
    holds a middle token at this context (everything sits in the dense sink + recent tiers)."""

    context: int
    chunk: int
    layers: list = field(default_factory=list)
    dense_bits: int = 16
    source: str = "plan"  # "plan" (tier_tokens at the context) | "cache" (a live cache's tensors)

    def _sum(self, attr: str) -> float:
        return float(sum(getattr(lh, attr) for lh in self.layers))

    @property
    def k_bits(self) -> float | None:
        e = self._sum("elements_k")
        return self._sum("bits_k") / e if e else None

    @property
    def v_bits(self) -> float | None:
        e = self._sum("elements_v")
        return self._sum("bits_v") / e if e else None

    @property
    def bits(self) -> float | None:
        e = self._sum("elements_k") + self._sum("elements_v")
        return (self._sum("bits_k") + self._sum("bits_v")) / e if e else None

    def weights(self) -> dict[int, float]:
        """layer -> its share of the middle elements (sums to 1; what each layer weighs in `bits`)."""
        tot = self._sum("elements_k") + self._sum("elements_v")
        return {lh.index: (lh.elements_k + lh.elements_v) / tot if tot else 0.0 for lh in self.layers}

    def dense(self) -> dict:
        """The sink and recent tiers (model dtype), beside the quantized tier: tokens summed over
        layers, their share of every element held, and bits per element over all tiers."""
        d_el = sum(lh.dense_elements for lh in self.layers)
        m_el = self._sum("elements_k") + self._sum("elements_v")
        all_bits = self._sum("bits_k") + self._sum("bits_v") + d_el * self.dense_bits
        return {"sink_tokens": sum(lh.tokens["sink"] for lh in self.layers),
                "recent_tokens": sum(lh.tokens["recent"] for lh in self.layers),
                "middle_tokens": sum(lh.tokens["middle"] for lh in self.layers),
                "dense_share": d_el / (d_el + m_el) if d_el + m_el else None,
                "avg_bits_all_tiers": all_bits / (d_el + m_el) if d_el + m_el else None,
                "dense_bits": self.dense_bits}

    def to_dict(self) -> dict:
        w = self.weights()
        return {"context": self.context, "chunk": self.chunk, "source": self.source,
                "bits": self.bits, "k_bits": self.k_bits, "v_bits": self.v_bits,
                "codebook_bits": self._sum("codebook_bits"), "dense": self.dense(),
                "layers": [{"layer": lh.index, "attention": lh.attention, "window": lh.window, "tokens": lh.tokens,
                            "k_bits": lh.bits_k / lh.elements_k if lh.elements_k else None,
                            "v_bits": lh.bits_v / lh.elements_v if lh.elements_v else None,
                            "weight": w[lh.index]} for lh in self.layers]}

    def line(self) -> str:
        """One line for tables and logs."""
        b = self.bits
        if b is None:
            return f"held bits at {self.context} tokens: nothing quantized (all in sink + recent)"
        d = self.dense()
        return (f"held {b:.3f} b/elt at {self.context} tokens (K {self.k_bits:.3f}, V {self.v_bits:.3f}); "
                f"beside it the {self.dense_bits}-bit sink + recent tiers: {100 * d['dense_share']:.1f}% of elements "
                f"(all tiers {d['avg_bits_all_tiers']:.2f} b/elt)")


def _layer(index, attention, window, heads, dk, dv, toks, k_codec, v_codec, dense_bits, batch=1,
           bytes_kv=None) -> LayerHeld:
    """The one averaging rule: elements and bits of one layer's middle (bytes_kv: measured (K, V) bytes
    of a live cache; else the codec's per-token cost times the tokens)."""
    mid = toks["middle"]
    ek, ev = batch * heads * mid * dk, batch * heads * mid * dv
    if bytes_kv is None:
        bk = batch * heads * mid * codec_bits_per_token(k_codec, dense_bits)
        bv = batch * heads * mid * codec_bits_per_token(v_codec, dense_bits)
    else:
        bk, bv = 8.0 * bytes_kv[0], 8.0 * bytes_kv[1]
    def codebook(c, e: int) -> float:  # fitted codebooks of this layer's tensor, counted where it holds rows
        if not (e and c.quantized):
            return 0.0
        if c.vq is not None:  # VQ codebooks [H_kv, E, SUB], held in fp16
            return float(16 * c.levels.numel())
        return float(CODEBOOK_VALUE_BITS * (1 << c.bits)) if c.tq.lloyd_max else 0.0

    cbk, cbv = codebook(k_codec, ek), codebook(v_codec, ev)
    lh = LayerHeld(index, attention, window, dict(toks), ek, ev, bk + cbk, bv + cbv, cbk + cbv)
    lh.dense_elements = batch * heads * (toks["sink"] + toks["recent"]) * (dk + dv)
    return lh


def held_bits(plan_or_scheme, context: int | None = None, *, geometry=None, chunk: int = 1,
              dense_bits: int = 16) -> HeldBits:
    """Held bits of a resolved Plan (or a KVScheme + geometry, resolved here) at `context` tokens
    (default DEFAULT_CONTEXT) fed `chunk` at a time (1: a decode-built context; 128: lowbit eval's)."""
    plan = plan_or_scheme
    if not hasattr(plan, "layers") or not hasattr(plan, "geometry"):
        if geometry is None:
            raise LowbitError("held_bits of a scheme needs the model geometry; pass geometry=")
        from lowbit.kv.plan import resolve

        plan = resolve(plan_or_scheme, geometry)
    n = DEFAULT_CONTEXT if context is None else int(context)
    if n < 1:
        raise LowbitError(f"context must be >= 1 token, got {n}")
    out = HeldBits(context=n, chunk=int(chunk), dense_bits=dense_bits)
    for lp in plan.layers:
        g = lp.geometry
        s, m, r = tier_tokens(n, lp.sink, lp.recent, lp.page, lp.window, int(chunk))
        out.layers.append(_layer(g.index, g.attention, lp.window, g.num_kv_heads, g.head_dim_k, g.head_dim_v,
                                 {"sink": s, "middle": m, "recent": r}, lp.k, lp.v, dense_bits))
    return out


def held_bits_of_cache(cache) -> HeldBits:
    """Held bits of what a live QuantizedKVCache holds now, from its measured tensors (memory())."""
    mem = cache.memory()
    layers = list(cache.layers)
    n = max((layer.n for layer in layers), default=0)
    dense_bits = 16
    for layer in layers:
        if layer.is_initialized:
            dense_bits = 8 * layer.sink["k"].element_size()
            break
    out = HeldBits(context=n, chunk=0, dense_bits=dense_bits, source="cache")
    for lm, layer in zip(mem.layers, layers):
        g = layer.geometry
        out.layers.append(_layer(g.index, g.attention, layer.window, g.num_kv_heads, g.head_dim_k, g.head_dim_v,
                                 dict(lm.tokens), layer.k_codec, layer.v_codec, dense_bits, batch=max(1, mem.batch),
                                 bytes_kv=(lm.bytes["middle_k"], lm.bytes["middle_v"])))
    return out
