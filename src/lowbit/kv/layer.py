"""One layer of the quantized KV cache: sink, packed middle, recent ring.

Slots. Every token the layer is fed gets the next slot (0, 1, 2, ...; a slot is a column of
the user's 2-D attention_mask, padding included). At any time the tiers hold contiguous slot
ranges, oldest first:

    sink    [0, sink_len)                           model dtype   first S slots
    middle  [mid_lo, mid_lo + mid_len)              packed        whole pages only
    recent  [n - ring_len, n)                       model dtype   last R .. R + page - 1 slots

Tokens enter through `_ingest` (rotation by R_k / R_v, once), fill the sink, then the ring.
The queries of a chunk attend to the history as stored plus their own chunk as it arrived
(see `blocks`): a prompt's own tokens are exact for its prefill, later chunks and every decode
step read them as stored. This is how serving sees a prompt, and with one-token steps it is
exactly the tiers.
When the ring holds at least R + page tokens, its oldest whole pages are encoded by the
layer's TensorCodec -- the one quantizer -- in one call and appended to the middle.
Full layers keep everything. Sliding layers (window W) evict, before each new chunk, every
slot a query of that chunk can no longer see (< n - (W - 1)): the sink once all of it is out,
whole pages from the front of the middle, then ring rows. A chunk of c queries thus sees its
W - 1 predecessors plus itself, as HF's sliding layers do.

Shared K/V layers (geometry.shares_kv: an MLA latent, or Gemma-4's K = V full layers) store V once
(the latent c_kv / the shared normalised projection, through V's codec) and only K's own part apart
(k_pe / the RoPE'd dims, dense in the model dtype); every block handed to the attention gets its K
rebuilt as K[own] = stored part, K[rest] = V[rest] (un-rotated) x `k_scale_v` (Gemma-4's k_norm
weight; MLA: 1), which is exact: transformers computes K's rest as V x weight (K = V) or as the
latent itself (MLA absorbed).

Middle storage (the layout the fused decode kernel reads, see TierView): per tensor a dict of
preallocated buffers, rows [mid_off, mid_off + mid_len) live. Capacity grows by doubling (and
sliding layers compact to the front before growing), so a decode step usually writes into
existing memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import CacheLayerMixin

from lowbit.core.errors import LowbitError
from lowbit.kv.codec import TensorCodec
from lowbit.kv.key_affine import map_keys
from lowbit.kv.rotations import rotate, unrotate

_MIN_MID_ROWS = 256


@dataclass
class TierView:
    """Read-only view of one layer's tiers for an attention backend (torch twin or fused kernel).

    sink_k/v [B, Hkv, Ns, D] at slots [0, Ns); ring_k/v [B, Hkv, Nr, D] at slots [n - Nr, n);
    middle rows [mid_lo, mid_lo + mid_len): mid_k / mid_v dicts of codec fields (see
    lowbit.kv.codec: codes uint8 [B, Hkv, T, D*cbits/8] "strided", scale/zero fp16
    [B, Hkv, T, D/group] (axis token) or [B, Hkv, T/page, D] (axis channel); or dense [B, Hkv, T, D]
    when bits == 16). k_codec / v_codec carry bits, group, axis, Lloyd-Max levels.
    rot_k / rot_v: None, [D, D] or [Hkv, D, D] (the backend rotates q by rot_k and the output by
    rot_v^T). window: sliding window or None. n: slots seen.
    """

    sink_k: torch.Tensor
    sink_v: torch.Tensor
    mid_k: dict
    mid_v: dict
    mid_lo: int
    mid_len: int
    ring_k: torch.Tensor
    ring_v: torch.Tensor
    n: int
    window: int | None
    k_codec: TensorCodec
    v_codec: TensorCodec
    rot_k: torch.Tensor | None
    rot_v: torch.Tensor | None


class QuantizedKVLayer(CacheLayerMixin):
    """Tiered K/V storage of one decoder layer (a transformers CacheLayerMixin)."""

    is_compileable = False
    is_croppable = False

    def __init__(self, plan, *, chunk_tokens: int = 1024):
        """plan: the layer's lowbit.kv.plan.LayerPlan (codecs, rotations, tiers; nothing is re-resolved)."""
        super().__init__()
        self.plan = plan
        self.geometry = geometry = plan.geometry
        self.layer_idx = geometry.index
        self.scheme = plan.scheme
        self.is_sliding = geometry.attention == "sliding"
        self.window = plan.window
        self.S, self.R, self.page = plan.sink, plan.recent, plan.page
        self.k_codec: TensorCodec = plan.k
        self.v_codec: TensorCodec = plan.v
        self.rot_k, self.rot_v = plan.rot_k, plan.rot_v
        self.k_affine = getattr(plan, "k_affine", None)  # keys (k - shift) / scale before R_k (lowbit.kv.key_affine)
        self._channel_grouped = any(c.quantized and c.tq.axis == "channel" for c in (self.k_codec, self.v_codec))
        self.shared = bool(getattr(geometry, "shares_kv", False))
        if self.shared:
            own = geometry.k_own_dims()
            self.k_own = torch.tensor(own, dtype=torch.long)
            self.k_rest = torch.tensor([d for d in range(geometry.head_dim_k) if d not in set(own)], dtype=torch.long)
        # K = V layers: K[rest] = V[rest] * k_scale_v (the model's k_norm weight, set by lowbit.runtime.families)
        self.k_scale_v: torch.Tensor | None = None
        # stream the middle in blocks of whole pages
        self.chunk_tokens = max(self.page, int(chunk_tokens) // self.page * self.page)
        self._clear()

    def _clear(self) -> None:
        self.is_initialized = False
        self.n = 0  # slots seen
        self.sink_len = 0
        self.mid_off = self.mid_len = self.mid_cap = 0
        self.mid_lo = 0
        self.ring_len = 0
        self.sink: dict[str, torch.Tensor] = {}
        self.ring: dict[str, torch.Tensor] = {}
        self.mid: dict[str, dict[str, torch.Tensor]] = {"k": {}, "v": {}}
        self.quantized_rows_total = 0  # token x kv-head rows ever encoded into the middle, K + V
        self.chunk: tuple | None = None  # (k, v, first slot) of the chunk just stored, for its attention
        self.keys = self.values = None

    # ---------------------------------------------------------------- init
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, H, _, Dk = key_states.shape
        Dv = value_states.shape[-1]
        g = self.geometry
        if H != g.num_kv_heads or Dk != g.head_dim_k or Dv != g.head_dim_v:
            raise LowbitError(
                f"layer {self.layer_idx}: got K/V with {H} heads, head_dim {Dk}/{Dv}, but the cache was built for "
                f"{g.num_kv_heads} KV heads, head_dim {g.head_dim_k}/{g.head_dim_v}; build it for this model"
            )
        if self.shared and g.k_eq_v and self.k_scale_v is None:
            raise LowbitError(
                f"layer {self.layer_idx} stores K = V once and rebuilds K with the model's k_norm weight: build the "
                "cache with the model (QuantizedKVCache(model, ...)), not its config"
            )
        self.device, self.dtype, self.B = key_states.device, key_states.dtype, B
        kw = {"device": self.device, "dtype": self.dtype}
        if self.shared:
            Dk = len(self.k_own)
            self.k_own, self.k_rest = self.k_own.to(self.device), self.k_rest.to(self.device)
        self.sink = {"k": torch.zeros(B, H, self.S, Dk, **kw), "v": torch.zeros(B, H, self.S, Dv, **kw)}
        rcap = self.R + self.page
        self.ring = {"k": torch.zeros(B, H, rcap, Dk, **kw), "v": torch.zeros(B, H, rcap, Dv, **kw)}
        if self.rot_k is not None:
            self.rot_k = self.rot_k.to(self.device, torch.float32)
        if self.rot_v is not None:
            self.rot_v = self.rot_v.to(self.device, torch.float32)
        self.is_initialized = True

    # ---------------------------------------------------------------- write
    def _ingest(self, key_states, value_states):
        """Map (key affine) and rotate incoming K/V once (every tier stores them so) and cast to the model dtype."""
        k = rotate(map_keys(key_states, self.k_affine), self.rot_k).to(self.dtype)
        v = rotate(value_states, self.rot_v).to(self.dtype)
        if self.shared:
            k = k.index_select(-1, self.k_own)  # K's own part; the rest is rebuilt from V
        return k, v

    def full_k(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """K of a block [B, H, n, head_dim_k] from what a tier holds: itself, or (shared layers) its own part
        k [.., len(own)] and V [.., head_dim_v] as stored (un-rotated here: K's rest is elementwise in V)."""
        if not self.shared:
            return k

        vu = unrotate(v.float(), self.rot_v).float()
        rest = vu.index_select(-1, self.k_rest)
        if self.k_scale_v is not None:
            rest = rest * self.k_scale_v.to(rest.device, torch.float32).index_select(-1, self.k_rest)
        out = vu.new_empty(*vu.shape[:-1], self.geometry.head_dim_k)
        out[..., self.k_rest] = rest
        out[..., self.k_own] = k.float()
        return out

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Store a chunk [B, Hkv, c, D]; returns (key_states, value_states) unchanged: the lowbit
        attention reads the tiers (the cache posts the hand-off)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[0] != self.B:
            raise LowbitError(
                f"layer {self.layer_idx}: batch size changed from {self.B} to {key_states.shape[0]}; use a new cache"
            )
        if self.window is not None:
            self._evict_before(self.n - (self.window - 1))
        k, v = self._ingest(key_states, value_states)
        c = k.shape[-2]
        self.chunk = (k, v, self.n)
        i = 0
        if self.n < self.S:  # the first S slots go to the sink
            i = min(self.S - self.n, c)
            self.sink["k"][:, :, self.n : self.n + i] = k[:, :, :i]
            self.sink["v"][:, :, self.n : self.n + i] = v[:, :, :i]
            self.sink_len = self.n + i
        self.n += c
        if i < c:
            self._ring_append(k[:, :, i:], v[:, :, i:])
        self._flush()
        return key_states, value_states

    def _ring_append(self, k, v) -> None:
        c = k.shape[-2]
        need = self.ring_len + c
        if need > self.ring["k"].shape[-2]:
            cap = max(need, 2 * self.ring["k"].shape[-2])
            for t in ("k", "v"):
                old = self.ring[t]
                new = old.new_zeros(*old.shape[:2], cap, old.shape[-1])
                new[:, :, : self.ring_len] = old[:, :, : self.ring_len]
                self.ring[t] = new
        self.ring["k"][:, :, self.ring_len : need] = k
        self.ring["v"][:, :, self.ring_len : need] = v
        self.ring_len = need

    def _ring_drop_front(self, r: int) -> None:
        if r <= 0:
            return
        keep = self.ring_len - r
        for t in ("k", "v"):
            buf = self.ring[t]
            buf[:, :, :keep] = buf[:, :, r : self.ring_len].clone()
        self.ring_len = keep

    def _flush(self) -> None:
        """Move the ring's oldest whole pages to the middle while >= R tokens would stay."""
        pages = (self.ring_len - self.R) // self.page
        if pages <= 0:
            return
        rows = pages * self.page
        enc_k = self.k_codec.encode(self.ring["k"][:, :, :rows], self.dtype)
        enc_v = self.v_codec.encode(self.ring["v"][:, :, :rows], self.dtype)
        self._mid_append(enc_k, enc_v, rows)
        self._ring_drop_front(rows)

    # ---------------------------------------------------------------- middle
    def _field_rows(self, codec: TensorCodec, name: str, rows: int) -> int:
        return rows // codec.rows_per_entry(name)

    def _alloc_mid(self, cap: int) -> None:
        B, H = self.B, self.geometry.num_kv_heads
        for t, codec in (("k", self.k_codec), ("v", self.v_codec)):
            bufs = {}
            for name, width in codec.fields().items():
                dtype = codec.field_dtype(name, self.dtype)
                fr = self._field_rows(codec, name, cap)
                new = torch.zeros(B, H, fr, width, device=self.device, dtype=dtype)
                old = self.mid[t].get(name)
                if old is not None:  # live rows move to the front of the new buffer
                    a = self._field_rows(codec, name, self.mid_off)
                    b = self._field_rows(codec, name, self.mid_off + self.mid_len)
                    new[:, :, : b - a] = old[:, :, a:b]
                bufs[name] = new
            self.mid[t] = bufs
        self.mid_cap, self.mid_off = cap, 0

    def _compact_mid(self) -> None:
        for t, codec in (("k", self.k_codec), ("v", self.v_codec)):
            for name, buf in self.mid[t].items():
                a = self._field_rows(codec, name, self.mid_off)
                b = self._field_rows(codec, name, self.mid_off + self.mid_len)
                buf[:, :, : b - a] = buf[:, :, a:b].clone()
        self.mid_off = 0

    def _mid_append(self, enc_k: dict, enc_v: dict, rows: int) -> None:
        end = self.mid_off + self.mid_len + rows
        if end > self.mid_cap:
            if self.mid_off and self.mid_len + rows <= self.mid_cap:
                self._compact_mid()
            else:
                cap = max(self.mid_len + rows, 2 * self.mid_cap, _MIN_MID_ROWS)
                self._alloc_mid(-(-cap // self.page) * self.page)
        at = self.mid_off + self.mid_len
        for t, codec, enc in (("k", self.k_codec, enc_k), ("v", self.v_codec, enc_v)):
            for name, val in enc.items():
                a = self._field_rows(codec, name, at)
                self.mid[t][name][:, :, a : a + val.shape[-2]] = val
            if codec.quantized:
                self.quantized_rows_total += self.B * self.geometry.num_kv_heads * rows
        if self.mid_len == 0:
            self.mid_lo = self.n - self.ring_len  # the ring's first slot is the middle's next
        self.mid_len += rows

    def _mid_fields(self, t: str, start: int, stop: int) -> dict[str, torch.Tensor]:
        """Live middle rows [start, stop) (relative to mid_lo) of tensor t as codec fields (views)."""
        codec = self.k_codec if t == "k" else self.v_codec
        out = {}
        for name, buf in self.mid[t].items():
            a = self._field_rows(codec, name, self.mid_off + start)
            b = self._field_rows(codec, name, self.mid_off + stop)
            out[name] = buf[:, :, a:b]
        return out

    # ---------------------------------------------------------------- sliding
    def _evict_before(self, e: int) -> None:
        """Drop what no future query can see: slots < e (sink whole, middle in pages, then ring)."""
        if e <= 0:
            return
        if self.sink_len and self.n >= self.S and e >= self.sink_len:
            self.sink_len = 0
        if self.mid_len:
            pages = min(self.mid_len, max(0, e - self.mid_lo)) // self.page
            if pages:
                rows = pages * self.page
                self.mid_off += rows
                self.mid_len -= rows
                self.mid_lo += rows
                if self.mid_len == 0:
                    self.mid_off = 0
        if self.mid_len == 0 and self.ring_len:
            ring_lo = self.n - self.ring_len
            self._ring_drop_front(min(self.ring_len, e - ring_lo))
            self.mid_lo = self.n - self.ring_len

    # ---------------------------------------------------------------- read
    def view(self) -> TierView:
        return TierView(
            sink_k=self.sink["k"][:, :, : self.sink_len],
            sink_v=self.sink["v"][:, :, : self.sink_len],
            mid_k=self._mid_fields("k", 0, self.mid_len) if self.mid_len else {},
            mid_v=self._mid_fields("v", 0, self.mid_len) if self.mid_len else {},
            mid_lo=self.mid_lo,
            mid_len=self.mid_len,
            ring_k=self.ring["k"][:, :, : self.ring_len],
            ring_v=self.ring["v"][:, :, : self.ring_len],
            n=self.n,
            window=self.window,
            k_codec=self.k_codec,
            v_codec=self.v_codec,
            rot_k=self.rot_k,
            rot_v=self.rot_v,
        )

    def blocks(self, min_slot: int = 0):
        """Yield (k, v, first slot) blocks for the attention of the chunk just stored.

        History before the chunk comes from the tiers as stored -- sink, the middle decoded
        chunk_tokens rows at a time, recent -- and the chunk itself comes as it arrived (rotated,
        model dtype): its queries attend to their own chunk exactly, later chunks and decode steps
        see it as stored (quantized once it reaches the middle). With one-token decode steps this
        is exactly what the tiers hold. Middle blocks entirely below `min_slot` (outside every
        query's window) are skipped.
        """
        if self.chunk is None:
            raise LowbitError(f"layer {self.layer_idx}: attention without a stored chunk (call update first)")
        ck, cv, lo = self.chunk
        for k, v, at in self._stored_blocks(ck, cv, lo, min_slot):
            yield self.full_k(k, v), v, at

    def _stored_blocks(self, ck, cv, lo, min_slot):
        ns = min(self.sink_len, lo)
        if ns and ns > min_slot:
            yield self.sink["k"][:, :, :ns], self.sink["v"][:, :, :ns], 0
        n_mid = max(0, min(self.mid_len, lo - self.mid_lo))
        for start in range(0, n_mid, self.chunk_tokens):
            stop = min(start + self.chunk_tokens, n_mid)
            if self.mid_lo + stop <= min_slot:
                continue
            if stop % self.page and self._channel_grouped:
                stop_fields = -(-stop // self.page) * self.page  # channel groups: decode whole pages
                k = self.k_codec.decode(self._mid_fields("k", start, stop_fields))[:, :, : stop - start]
                v = self.v_codec.decode(self._mid_fields("v", start, stop_fields))[:, :, : stop - start]
            else:
                k = self.k_codec.decode(self._mid_fields("k", start, stop))
                v = self.v_codec.decode(self._mid_fields("v", start, stop))
            yield k, v, self.mid_lo + start
        ring_lo = self.n - self.ring_len
        nr = max(0, min(self.ring_len, lo - ring_lo))
        if nr:
            yield self.ring["k"][:, :, :nr], self.ring["v"][:, :, :nr], ring_lo
        yield ck, cv, lo

    def middle_dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole middle tier decoded (float32 [B, Hkv, T, D] each): for tests and analysis only."""
        if not self.mid_len:
            z = torch.zeros(self.B, self.geometry.num_kv_heads, 0, self.geometry.head_dim_k, device=self.device)
            return z, z[..., : self.geometry.head_dim_v]
        return (
            self.k_codec.decode(self._mid_fields("k", 0, self.mid_len)),
            self.v_codec.decode(self._mid_fields("v", 0, self.mid_len)),
        )

    # ---------------------------------------------------------------- HF API
    def get_seq_length(self) -> int:
        return self.n

    def get_max_length(self) -> int:
        return -1

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # Only used when a model builds HF masks for this cache (the lowbit attention builds its own).
        if self.window is not None and self.n >= self.window:
            return self.window - 1 + query_length, self.n - self.window + 1
        return self.n + query_length, 0

    def reset(self) -> None:
        self._clear()

    def crop(self, tokens_to_remove: int) -> None:
        raise LowbitError("the lowbit KV cache cannot be cropped (quantized pages are not reversible)")

    def offload(self):
        raise LowbitError("the lowbit KV cache does not support offloading")

    def prefetch(self):
        pass

    def _map_batch(self, fn) -> None:
        if not self.is_initialized:
            return
        self.sink = {t: fn(x) for t, x in self.sink.items()}
        self.ring = {t: fn(x) for t, x in self.ring.items()}
        self.mid = {t: {name: fn(x) for name, x in d.items()} for t, d in self.mid.items()}
        self.B = self.sink["k"].shape[0]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(lambda x: x.index_select(0, beam_idx.to(x.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda x: x.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda x: x[indices])
