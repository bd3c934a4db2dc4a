"""The packed per-token slot the vLLM plugin stores in vLLM's paged KV cache (pure torch, no vLLM).

vLLM gives every (block, KV head, token-in-block) a cell of `slot_bytes` bytes (the plugin sets
that size through the backend's KV spec, `state_content_bytes`). One cell holds one token of one
KV head, K then V, each as the fields lowbit's one KV quantizer (lowbit.kv.codec.TensorCodec,
which runs lowbit.quant.affine.quantize then lowbit.quant.packing.pack) produces for one row:

    [ K codes  D_k*cb/8 B | K scale fp16 D_k/g*2 B | K zero fp16 D_k/g*2 B
    | V codes  D_v*cb/8 B | V scale ... | V zero ... | pad to a multiple of 4 ]

(cb = container bits: 2, 4 or 8; a 16-bit tensor stores its dense row in the model dtype). The
pad keeps the cell a whole number of fp32 / bf16 elements, the dtype vLLM views the cache in.
Rows are rotated (k R_k, v R_v) before they are quantized, so the cache holds rotated K/V.

Example, smollm2-135m (head_dim 64, group 64), per token per KV head:
    bf16 auto: 256 B;  int8: 2*(64+4) = 136 B;  int4: 2*(32+4) = 72 B;  int2: 2*(16+4) = 40 B.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lowbit.core.errors import LowbitError

SLOT_ALIGN = 4
# A write of at most this many rows (a decode step: one per request) is encoded by csrc/cell_encode.cpp,
# the codec's own arithmetic in one op (bit-identical bytes: tests/serve/test_vllm_fused.py); longer writes
# (prefill chunks) run TensorCodec.encode itself.
FAST_ROWS = 16


def _dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass
class _Field:
    tensor: str  # "k" | "v"
    name: str  # codes | scale | zero | dense
    width: int  # elements per row
    dtype: torch.dtype
    offset: int  # bytes into the slot

    @property
    def nbytes(self) -> int:
        return self.width * _dtype_bytes(self.dtype)


# ------------------------------------------------------------------ capability rules (the "vllm-slot" backend)
def scheme_reason(scheme) -> str | None:
    """Model-wide rules: why the plugin cannot serve `scheme` at all (None: it can)."""
    if scheme.fold_v_rotation:
        return "fold_v_rotation (V rotation folded into the weights) is not supported by the vLLM plugin; drop it"
    return None  # per-layer bits: every layer's cell is padded to the widest one (layer_formats)


def codecs_reason(k_codec, v_codec) -> str | None:
    """Per-layer rules: the plugin stores per-token groups on a uniform grid (or 16-bit rows)."""
    for which, c in (("K", k_codec), ("V", v_codec)):
        if c.quantized and c.tq.axis != "token":
            return f"{which} is grouped per channel (KIVI); the vLLM plugin supports per-token groups only"
        if c.tq.lloyd_max:
            return f"{which} uses Lloyd-Max levels; the vLLM plugin supports uniform grids only"
        if c.quantized and c.tq.vq is not None:
            return f"{which} is vector-quantized (vq {c.tq.vq}); the vLLM plugin supports uniform grids only"
        if c.quantized and c.tq.residual is not None:
            return f"{which} has a 1-bit {c.tq.residual} residual; the vLLM plugin supports uniform grids only"
        if c.quantized and not c.stores_zero:
            return f"{which} has scale-only groups (zero 'none'); the vLLM plugin's cells hold a zero per group"
    return None


def _supports(layer, step: str, device: str) -> str | None:
    if device != "cpu":
        return f"device {device} (the vLLM plugin runs on vLLM's CPU platform only)"
    return scheme_reason(layer.scheme) or codecs_reason(layer.k, layer.v)


def _register_backend():
    from lowbit.backends import Backend, register

    return register(Backend("vllm-slot", ("paged",), _supports, None, module=__name__))


BACKEND = _register_backend()


def layer_formats(plan, dense_dtype: torch.dtype) -> list[SlotFormat]:
    """One SlotFormat per layer of a resolved lowbit.kv.plan.Plan, each from the layer's own scheme (its
    layer_bits applied), padded to the widest cell among layers with the same head dims: vLLM gives
    every layer of a KV cache group one cell size. The padding is real memory: vLLM's capacity counts
    the padded cell; `content_bytes` is what a layer's codes use."""
    natural = [SlotFormat(lp.scheme, lp.geometry.head_dim_k, lp.geometry.head_dim_v, dense_dtype)
               for lp in plan.layers]
    widest: dict = {}
    for lp, f in zip(plan.layers, natural):
        d = (lp.geometry.head_dim_k, lp.geometry.head_dim_v)
        widest[d] = max(widest.get(d, 0), f.slot_bytes)
    return [f if f.slot_bytes == widest[(lp.geometry.head_dim_k, lp.geometry.head_dim_v)] else
            SlotFormat(lp.scheme, lp.geometry.head_dim_k, lp.geometry.head_dim_v, dense_dtype,
                       slot_bytes=widest[(lp.geometry.head_dim_k, lp.geometry.head_dim_v)])
            for lp, f in zip(plan.layers, natural)]


def check_budget(kv_bytes: int | None, scheme, geometry, formats: list) -> None:
    """Refuse a vLLM KV budget (--kv-cache-memory-bytes) that cannot hold one request's sink + recent
    tokens in packed cells (formats: the per-layer SlotFormats): such a server could admit nothing
    whose exact tiers the plugin keeps."""
    tiers = scheme.sink + scheme.recent
    if not kv_bytes or not tiers:
        return
    per_token = sum(g.num_kv_heads * f.slot_bytes for g, f in zip(geometry.layers, formats))
    need = tiers * per_token
    if kv_bytes < need:
        raise LowbitError(f"--kv-cache-memory-bytes {kv_bytes} cannot hold one request's sink + recent "
                          f"({scheme.sink} + {scheme.recent} tokens x {per_token} B = {need} B of packed cells): "
                          f"give vLLM at least {need} bytes, or export with a smaller --sink / --recent")


class SlotFormat:
    """Byte layout of one (token, KV head) cell for one layer, and its encode/decode.

    scheme: lowbit.kv.scheme.KVScheme (per-token groups, uniform grid); head_dim_k / head_dim_v: the
    layer's dims; dense_dtype: how a 16-bit (unquantized) tensor is stored.
    """

    def __init__(self, scheme, head_dim_k: int, head_dim_v: int, dense_dtype: torch.dtype = torch.float16,
                 slot_bytes: int | None = None):
        from lowbit.kv.codec import TensorCodec

        self.scheme = scheme
        self.codecs = {"k": TensorCodec(scheme.k, head_dim_k, scheme.page),
                       "v": TensorCodec(scheme.v, head_dim_v, scheme.page)}
        reason = scheme_reason(scheme) or codecs_reason(self.codecs["k"], self.codecs["v"])
        if reason:
            raise LowbitError(f"the vLLM plugin cannot store this scheme: {reason}")
        self.dense_dtype = dense_dtype
        self.fields: list[_Field] = []
        off = 0
        for which in ("k", "v"):
            c = self.codecs[which]
            for name, width in c.fields().items():
                dt = c.field_dtype(name, dense_dtype)
                f = _Field(which, name, width, dt, off)
                self.fields.append(f)
                off += f.nbytes
        self.content_bytes = off
        self.slot_bytes = -(-off // SLOT_ALIGN) * SLOT_ALIGN
        if slot_bytes is not None:  # padded to a wider layer's cell (per-layer bits share one vLLM cell size)
            if slot_bytes < self.slot_bytes or slot_bytes % SLOT_ALIGN:
                raise LowbitError(f"internal: a {self.slot_bytes} B slot cannot be padded to {slot_bytes} B")
            self.slot_bytes = int(slot_bytes)

    def describe(self) -> str:
        parts = [f"{f.tensor}.{f.name} {f.nbytes} B" for f in self.fields]
        return f"{self.slot_bytes} B/token/KV head ({', '.join(parts)}, pad {self.slot_bytes - self.content_bytes})"

    # ------------------------------------------------------------- write
    def encode(self, k: torch.Tensor, v: torch.Tensor, rot_k=None, rot_v=None) -> torch.Tensor:
        """k [T, H, D_k], v [T, H, D_v] (model dtype, post-RoPE) -> slots uint8 [T, H, slot_bytes].

        rotate (per layer [D, D] or per KV head [H, D, D]) -> TensorCodec.encode (quantize -> pack).
        """
        from lowbit.kv.rotations import rotate

        kr = rotate(k.transpose(0, 1).unsqueeze(0), rot_k)  # [1, H, T, D]
        vr = rotate(v.transpose(0, 1).unsqueeze(0), rot_v)
        return self.encode_rotated(kr, vr)

    def encode_rotated(self, kr: torch.Tensor, vr: torch.Tensor, fast: bool = True) -> torch.Tensor:
        """kr [1, H, T, D_k], vr [1, H, T, D_v], already rotated -> slots uint8 [T, H, slot_bytes]
        (TensorCodec.encode: quantize -> pack; the one quantizer).

        fast (T <= FAST_ROWS, min/max and std grids): the same bytes from csrc/cell_encode.cpp in one op -- the
        codec's float32 steps in order, no fast-math; a row it cannot mirror (non-finite, a constant group)
        sends the whole write to the codec. fast=False: always the codec.

        When K and V share a codec (same TensorQuant and head_dim: int8 / int4 / int2 defaults) they are
        quantized in one call over [1, 2H, T, D] -- the same per-row arithmetic, half the op launches of
        a decode step. The finiteness checks (host syncs) are skipped as in lowbit's captured GPU step."""
        _, H, T, _ = kr.shape
        if T <= FAST_ROWS and fast:
            enc = self._encoder()
            if enc is not None and enc[3]:  # the std grid: torch's group stats, then the C++ encoder
                cells, ok = enc[0].encode_cells_std(kr, vr, *self._std_stats(kr, vr, enc[3]), enc[1], enc[2],
                                                    self.slot_bytes)
                if ok:
                    return cells
            elif enc is not None:
                cells, ok = enc[0].encode_cells(kr, vr, enc[1], enc[2], self.slot_bytes)
                if ok:  # else a non-finite value or a constant group: the codec below
                    return cells
        ck, cv = self.codecs["k"], self.codecs["v"]
        if ck.tq == cv.tq and ck.head_dim == cv.head_dim:
            both = ck.encode(torch.cat([kr, vr], dim=1), self.dense_dtype, checks=False)
            if self._shared_cells(both):
                # one cell per (K or V head, token): codes | scale | zero, K's heads then V's: [2H, T, w];
                # the slot is K's w bytes then V's -> one cat and one copy instead of a copy per field
                w = self.content_bytes // 2
                cells = torch.cat([both["codes"][0], both["scale"][0].view(torch.uint8),
                                   both["zero"][0].view(torch.uint8)], dim=-1)
                cells = cells.view(2, H, T, w).permute(2, 1, 0, 3).reshape(T, H, 2 * w)
                if self.slot_bytes > self.content_bytes:
                    cells = torch.nn.functional.pad(cells, (0, self.slot_bytes - self.content_bytes))
                return cells
            enc = {"k": {n: t[:, :H] for n, t in both.items()}, "v": {n: t[:, H:] for n, t in both.items()}}
        else:
            enc = {"k": ck.encode(kr, self.dense_dtype, checks=False), "v": cv.encode(vr, self.dense_dtype, checks=False)}
        parts = []
        for f in self.fields:  # in slot order
            t = enc[f.tensor][f.name][0]
            if t.dtype != f.dtype:
                t = t.to(f.dtype)
            parts.append(t.contiguous().view(torch.uint8))  # [H, T, nbytes]
        if self.slot_bytes > self.content_bytes:
            parts.append(torch.zeros(H, T, self.slot_bytes - self.content_bytes, dtype=torch.uint8, device=kr.device))
        return torch.cat(parts, dim=-1).transpose(0, 1)  # [T, H, slot_bytes]

    def write_rotated(self, cache_u8: torch.Tensor, blk: torch.Tensor, off: torch.Tensor, kr: torch.Tensor,
                      vr: torch.Tensor) -> None:
        """cache_u8[blk[t], :, off[t], :] = encode_rotated(kr, vr)[t] (kr [1, H, T, D_k], vr [1, H, T, D_v];
        cache uint8 [NB, H, bs, slot_bytes]). A decode-sized write on the C++ encoder writes the cells into the
        cache itself (no cells tensor, no index_put); else, or when it declines, the codec's cells are stored."""
        T = kr.shape[2]
        if T <= FAST_ROWS and cache_u8.is_contiguous() and cache_u8.device.type == "cpu":
            enc = self._encoder()
            if enc is not None:
                ks, vs = self._std_stats(kr, vr, enc[3]) if enc[3] else (self._no_stats, self._no_stats)
                if enc[0].write_cells(kr, vr, ks, vs, enc[1], enc[2], cache_u8, blk, off):
                    return
        cache_u8[blk, :, off, :] = self.encode_rotated(kr, vr, fast=False)  # advanced indices first: [T, H, C]

    _no_stats = torch.zeros(0, dtype=torch.float32)

    def _encoder(self):
        """(module, meta int64 [16], mul float64 [4], the std-grid tensors ("k", "v" or neither)) for
        csrc/cell_encode.cpp, or None: a 16-bit tensor, KIVI, Lloyd-Max, or no compiler. Resolved once per format."""
        if getattr(self, "_enc", False) is not False:
            return self._enc
        self._enc = None
        meta, mul = [], []
        for which in ("k", "v"):
            c = self.codecs[which]
            tq = c.tq
            std = tq.grid == "std"
            if (not c.quantized or tq.axis != "token" or tq.lloyd_max or tq.grid not in ("minmax", "std")
                    or c.bits not in ((2, 3, 4) if std else (2, 3, 4, 8)) or c.cbits not in (2, 4, 8)
                    or (std and c.unit_step is None) or self.field(which, "scale").dtype != torch.float16):
                return None
            meta += [c.bits, c.cbits, c.group, c.head_dim, 2 if std else int(bool(tq.symmetric)),
                     self.field(which, "codes").offset, self.field(which, "scale").offset,
                     self.field(which, "zero").offset]
            r = float(tq.clip)
            # affine.quantize's scalars; the std grid: affine.quantize_std's unit step
            mul += [1.0, float(c.unit_step)] if std else [r if tq.symmetric else 0.5 * r, 2.0 / ((1 << c.bits) - 1)]
        from lowbit.vllm_plugin import cpu_kernel

        mod, _ = cpu_kernel.load_encoder()
        if mod is not None:
            self._enc = (mod, torch.tensor(meta, dtype=torch.long), torch.tensor(mul, dtype=torch.float64),
                         tuple(w for w, m in zip("kv", meta[4::8]) if m == 2))
        return self._enc

    def _std_stats(self, kr: torch.Tensor, vr: torch.Tensor, which: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """The std grid's (mean, population std) per group, float32 [2, 1, H, T, groups] for K and V (empty for a
        min/max tensor): the very reductions affine.quantize_std runs, on the tensor TensorCodec.encode would get
        (K and V concatenated when they share a codec), so the C++ encoder's bytes stay the codec's."""
        ck, cv = self.codecs["k"], self.codecs["v"]
        H = kr.shape[1]
        none = torch.zeros(0, dtype=torch.float32, device=kr.device)

        def stats(x, c):
            xg = x.float().reshape(*x.shape[:-1], c.head_dim // c.group, c.group)
            return torch.stack([xg.mean(dim=-1), xg.std(dim=-1, correction=0)])  # [2, 1, H', T, G]

        if ck.tq == cv.tq and ck.head_dim == cv.head_dim:  # encode_rotated's one codec call over [1, 2H, T, D]
            st = stats(torch.cat([kr, vr], dim=1), ck)
            return st[:, :, :H].contiguous(), st[:, :, H:].contiguous()
        return (stats(kr, ck) if "k" in which else none), (stats(vr, cv) if "v" in which else none)

    def _shared_cells(self, both: dict) -> bool:
        """K and V quantized by one codec call (`both`: codes uint8, scale / zero fp16 [1, 2H, T, .]) and the
        slot is [k codes, k scale, k zero, v codes, v scale, v zero] in that order: encode_rotated may lay the
        cells out with one cat (the same bytes as the per-field loop; tests/serve/test_vllm_paged.py)."""
        if getattr(self, "_cell_order", None) is None:  # the slot's field order, checked once
            names = [(f.tensor, f.name, f.dtype) for f in self.fields]
            self._cell_order = names == [(t, n, torch.uint8 if n == "codes" else torch.float16) for t in ("k", "v")
                                         for n in ("codes", "scale", "zero")]
        return (self._cell_order and len(both) == 3 and both["codes"].dtype == torch.uint8
                and both["scale"].dtype == both["zero"].dtype == torch.float16
                and both["scale"].stride(-1) == 1 and both["zero"].stride(-1) == 1)

    def field(self, tensor: str, name: str) -> _Field:
        """The field `name` (codes | scale | zero | dense) of tensor "k" or "v"."""
        for f in self.fields:
            if f.tensor == tensor and f.name == name:
                return f
        raise KeyError(f"{tensor}.{name}")

    def read_field(self, cells: torch.Tensor, tensor: str, name: str) -> torch.Tensor:
        """cells uint8 [..., slot_bytes] -> field [..., width] in its stored dtype (codes stay packed)."""
        f = self.field(tensor, name)
        raw = cells[..., f.offset:f.offset + f.nbytes]
        if f.dtype == torch.uint8:
            return raw
        return raw.contiguous().view(f.dtype)

    # -------------------------------------------------------------- read
    def decode(self, slots: torch.Tensor, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """slots uint8 [H, N, slot_bytes] -> (k [1, H, N, D_k], v [1, H, N, D_v]) rotated, in `dtype`."""
        H, N, _ = slots.shape
        got = {"k": {}, "v": {}}
        for f in self.fields:
            raw = slots[:, :, f.offset:f.offset + f.nbytes].contiguous()
            got[f.tensor][f.name] = raw.view(f.dtype).reshape(1, H, N, f.width)
        return self.codecs["k"].decode(got["k"], dtype), self.codecs["v"].decode(got["v"], dtype)
