"""Memory accounting of a QuantizedKVCache, measured from the tensors it actually holds.

"Live" bytes are the bytes of the live slices of each tier's buffers (what the history
needs); "allocated" bytes include the spare capacity of the preallocated buffers. Bits per
element of the middle tier = 8 * live middle bytes (codes + scale + zero) / stored elements,
so scale/zero overhead is counted, as are 4-bit containers of 3-bit codes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MiB = float(1 << 20)


@dataclass
class LayerMemory:
    index: int
    attention: str
    tokens: dict  # {"sink", "middle", "recent"} tokens per sequence
    bytes: dict  # {"sink", "middle_k", "middle_v", "recent"} live bytes (whole batch)
    allocated: int  # bytes of every buffer, spare capacity included
    elements_k: int  # middle K elements stored (B * Hkv * T * Dk)
    elements_v: int
    quantized_rows: int  # middle rows held now (token x kv-head, K + V, quantized tensors only)
    bf16_bytes_per_token: int  # what one token of this layer costs in 16-bit K + V
    dense_bytes_per_token: int = 0  # ... in the model dtype (what a DynamicCache would hold)


@dataclass
class MemoryReport:
    layers: list[LayerMemory] = field(default_factory=list)
    batch: int = 0

    def total(self, tier: str) -> int:
        if tier == "middle":
            return sum(lm.bytes["middle_k"] + lm.bytes["middle_v"] for lm in self.layers)
        return sum(lm.bytes[tier] for lm in self.layers)

    @property
    def live_bytes(self) -> int:
        return self.total("sink") + self.total("middle") + self.total("recent")

    @property
    def allocated_bytes(self) -> int:
        return sum(lm.allocated for lm in self.layers)

    def middle_bits_per_element(self) -> tuple[float | None, float | None]:
        """(K, V) bits per element of the middle tier, over all layers (None when it is empty)."""
        ek = sum(lm.elements_k for lm in self.layers)
        ev = sum(lm.elements_v for lm in self.layers)
        bk = sum(lm.bytes["middle_k"] for lm in self.layers)
        bv = sum(lm.bytes["middle_v"] for lm in self.layers)
        return (8 * bk / ek if ek else None, 8 * bv / ev if ev else None)

    @property
    def token_layers(self) -> int:
        """Sum over layers of tokens held per sequence."""
        return sum(sum(lm.tokens.values()) for lm in self.layers)

    def bytes_per_token_per_layer(self) -> float:
        """Live bytes / (batch * tokens held summed over layers)."""
        return self.live_bytes / (self.batch * self.token_layers) if self.token_layers else 0.0

    def bf16_bytes_per_token_per_layer(self) -> float:
        n = self.token_layers
        return sum(lm.bf16_bytes_per_token * sum(lm.tokens.values()) for lm in self.layers) / n if n else 0.0

    def dense_bytes_per_token_per_layer(self) -> float:
        n = self.token_layers
        return sum(lm.dense_bytes_per_token * sum(lm.tokens.values()) for lm in self.layers) / n if n else 0.0

    def quantized_rows(self) -> int:
        return sum(lm.quantized_rows for lm in self.layers)

    def quantized_tokens(self) -> int:
        """Quantized tokens held per sequence in the middle tier of the full-attention layers (max over
        them; sliding layers if there are none). 0 when the middle is stored unquantized."""
        def q(lm):
            return lm.tokens["middle"] if lm.quantized_rows else 0

        full = [q(lm) for lm in self.layers if lm.attention == "full"]
        pool = full or [q(lm) for lm in self.layers]
        return max(pool) if pool else 0

    def to_dict(self) -> dict:
        bk, bv = self.middle_bits_per_element()
        return {
            "batch": self.batch,
            "live_bytes": self.live_bytes,
            "allocated_bytes": self.allocated_bytes,
            "bytes": {t: self.total(t) for t in ("sink", "middle", "recent")},
            "middle_bits_per_element": {"k": bk, "v": bv},
            "bytes_per_token_per_layer": self.bytes_per_token_per_layer(),
            "bf16_bytes_per_token_per_layer": self.bf16_bytes_per_token_per_layer(),
            "dense_bytes_per_token_per_layer": self.dense_bytes_per_token_per_layer(),
            "quantized_rows": self.quantized_rows(),
            "quantized_tokens": self.quantized_tokens(),
            "layers": [lm.__dict__ for lm in self.layers],
        }

    def summary(self, cache) -> str:
        """One line of numbers; preceded by a line saying so when a quantizing scheme quantized nothing."""
        note = nothing_quantized_note(cache)
        return f"{note}\n{self._numbers(cache)}" if note else self._numbers(cache)

    def _numbers(self, cache) -> str:
        bk, bv = self.middle_bits_per_element()
        n = max((layer.n for layer in cache.layers), default=0)
        quantizes = any(layer.k_codec.quantized or layer.v_codec.quantized for layer in cache.layers)
        held = str(getattr(cache.layers[0], "dtype", "")).replace("torch.", "") or "the model dtype"
        if bk is None:
            bits = "middle empty"
        elif not quantizes:
            # `--kv bf16` means "not quantized": the tiers keep the model dtype, so an fp32 model holds 32
            # bits/elt, which read "32.00 bits/elt (2.000 of bf16)" as if bf16 had cost 32 bits
            bits = f"middle not quantized: K/V held in the model dtype {held} ({bk:.0f} / {bv:.0f} bits/elt)"
        else:
            bits = f"middle K {bk:.2f} / V {bv:.2f} bits/elt ({bk / 16:.3f} / {bv / 16:.3f} of bf16)"
        bpt, ref = self.bytes_per_token_per_layer(), self.dense_bytes_per_token_per_layer()
        ratio = f", {ref / bpt:.2f}x smaller" if bpt else ""
        dense = str(getattr(cache.layers[0], "dtype", "")).replace("torch.", "") or "dense"
        backend = "+".join(f"{k} {v}" for k, v in sorted(cache.backend_calls.items())) or "none yet"
        return (
            f"kv {cache.scheme.name}: {n} tokens, {self.quantized_tokens()} quantized per full layer, "
            f"{cache.quantized_rows_total()} K+V rows quantized | {bits} | held {self.live_bytes / MiB:.2f} MiB "
            f"(sink {self.total('sink') / MiB:.2f}, middle {self.total('middle') / MiB:.2f}, "
            f"recent {self.total('recent') / MiB:.2f}) | {bpt:.1f} B/token/layer vs {ref:.1f} {dense} dense{ratio} | "
            f"attention calls: {backend}"
        )


def nothing_quantized_note(cache) -> str | None:
    """One line when the scheme quantizes but no row reached the middle tier (every token still sits
    in the model-dtype sink + recent tiers, so the cache is as large as a dense one), else None."""
    quantizes = any(layer.k_codec.quantized or layer.v_codec.quantized for layer in cache.layers)
    n = max((layer.n for layer in cache.layers), default=0)
    if not quantizes or n == 0 or cache.quantized_rows_total():
        return None
    s = cache.scheme
    dtype = str(getattr(cache.layers[0], "dtype", "")).replace("torch.", "") or "the model dtype"
    # tokens leave the recent ring a page at a time, once it holds recent + page tokens
    start = s.sink + s.recent + s.page
    return (f"note: nothing quantized: all {n} tokens sit in the sink ({s.sink}) and recent ({s.recent}) tiers, kept "
            f"in {dtype}; quantizing starts at {start} tokens (sink + recent + one page of {s.page}): use a longer "
            f"input, or lower --sink / --recent (multiples of --page) to quantize shorter contexts")


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def measure(cache) -> MemoryReport:
    rep = MemoryReport()
    for layer in cache.layers:
        g = layer.geometry
        H = g.num_kv_heads
        # stored widths: a shared K/V layer (MLA latent, K = V) holds V plus only K's own RoPE part
        dk = len(g.k_own_dims()) if getattr(g, "shares_kv", False) else g.head_dim_k
        bf16_tok = 2 * H * (dk + g.head_dim_v)
        if not layer.is_initialized:
            rep.layers.append(
                LayerMemory(g.index, g.attention, {"sink": 0, "middle": 0, "recent": 0},
                            {"sink": 0, "middle_k": 0, "middle_v": 0, "recent": 0}, 0, 0, 0, 0, bf16_tok)
            )
            continue
        rep.batch = layer.B
        v = layer.view()
        mk = sum(_nbytes(t) for t in v.mid_k.values())
        mv = sum(_nbytes(t) for t in v.mid_v.values())
        alloc = sum(_nbytes(t) for t in layer.sink.values()) + sum(_nbytes(t) for t in layer.ring.values())
        alloc += sum(_nbytes(t) for d in layer.mid.values() for t in d.values())
        rows = layer.B * H * layer.mid_len
        qrows = rows * (int(layer.k_codec.quantized) + int(layer.v_codec.quantized))
        rep.layers.append(
            LayerMemory(
                index=g.index,
                attention=g.attention,
                tokens={"sink": layer.sink_len, "middle": layer.mid_len, "recent": layer.ring_len},
                bytes={
                    "sink": _nbytes(v.sink_k) + _nbytes(v.sink_v),
                    "middle_k": mk,
                    "middle_v": mv,
                    "recent": _nbytes(v.ring_k) + _nbytes(v.ring_v),
                },
                allocated=alloc,
                elements_k=rows * dk,
                elements_v=rows * g.head_dim_v,
                quantized_rows=qrows,
                bf16_bytes_per_token=bf16_tok,
                dense_bytes_per_token=bf16_tok * layer.sink["k"].element_size() // 2,
            )
        )
    return rep
