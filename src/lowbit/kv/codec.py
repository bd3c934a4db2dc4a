"""The middle-tier codec of one tensor (K or V) of one layer: the ONE quantizer of the KV cache.

Every row that enters a middle tier -- whether it arrives in a prefill, a decode step, a page
flush or on a sliding layer -- goes through `TensorCodec.encode` (quantize -> pack); every row
read back goes through `TensorCodec.decode`. Rotation happens before, once, when a token enters
the cache (QuantizedKVLayer._ingest), so every tier holds rotated K/V.

Stored fields (what `encode` returns, per middle row block; T rows, D = head_dim):
    bits < 16, axis "token":   codes uint8 [B, H, T, D * cbits // 8]  (lowbit.quant.packing "strided")
                               scale, zero fp16 [B, H, T, D // group]
    bits < 16, axis "channel": codes as above; scale, zero fp16 [B, H, T // page, D]
                               (each channel over a block of `page` tokens: KIVI keys)
    bits < 16, zero "none":    codes as above; scale fp16 [B, H, T, D // group] only (no zero field:
                               zero = -mid * scale, mid = (2**bits - 1) / 2, lowbit.quant.affine.centre)
                               scale_format "ue5m3": scale uint8 [B, H, T, D // group], one-byte codes
                               (lowbit.quant.scale_format) of the steps the encoder rounded to that grid
    vq "SUBxE" (2 bits):       codes uint8 [B, H, T, D * 2 // 8]: D/SUB codeword indices (E 16: 4-bit, strided
                               packing; E 256: one byte each), scale [B, H, T, 1] (fp16, or uint8 ue5m3)
                               x_hat = scale * codebook[h][idx] (lowbit.quant.vq; codebook [H, E, SUB] per layer)
    residual "sign" | "qjl":   + rbits uint8 [B, H, T, D // 8] (sign bits, 1-bit strided packing) and rgain [B, H, T, 1]
                               (fp16, or uint8 ue5m3): x_hat = base + (rgain * (2 rbits - 1)) @ S (lowbit.quant.residual),
                               the signs of the base's own error, coded from the base's stored fields
    bits == 16:                dense [B, H, T, D] in the model dtype (no quantization)
cbits is the container width: 3-bit codes are packed as 4-bit. Dequantization is always
    x_hat = codes * scale + zero                    (uniform grid, lowbit.quant.affine; min/max or std placed;
                                                     grid "mse": the std step searched per group at encode)
    x_hat = levels[codes] * scale + zero            (Lloyd-Max: scale = std, zero = mean)
"""

from __future__ import annotations

import torch

from lowbit.core.errors import LowbitError
from lowbit.kv.scheme import TensorQuant
from lowbit.quant import affine, gaussian, lloyd_max, packing
from lowbit.quant import residual as resm
from lowbit.quant import scale_format as sf
from lowbit.quant import vq as vqm

SCALE_DTYPE = torch.float16
LAYOUT = "strided"


class TensorCodec:
    """Quantize/pack and unpack/dequantize middle rows of one tensor (K or V) of one layer.

    tq: the TensorQuant; head_dim: D; page: tokens per channel block (axis "channel").
    levels: the fitted codebook of this layer's tensor: Lloyd-Max levels float32 [2**bits] (default: the
    TensorQuant's own `levels`, else Gaussian-optimal), or for a VQ tensor its codebooks [H_kv, E, SUB]
    (required: fitted by `lowbit calibrate --vq-for`); ignored otherwise.
    """

    def __init__(self, tq: TensorQuant, head_dim: int, page: int, levels: torch.Tensor | None = None):
        self.tq = tq
        self.head_dim = int(head_dim)
        self.page = int(page)
        self.bits = tq.bits
        self.cbits = tq.container_bits
        self.group = tq.group_for(head_dim, page)
        self.levels: torch.Tensor | None = None
        self.stores_zero = tq.stores_zero  # False: scale-only groups (zero = -centre * scale)
        self.scale_format = tq.scale_format  # "ue5m3": one-byte scale codes (scale-only groups only)
        self.centre = affine.centre(tq.bits) if tq.quantized else 0.0
        self.unit_step: float | None = None  # the std grid's step per unit std, resolved once
        if tq.quantized and tq.grid in ("std", "mse") and not tq.lloyd_max:
            self.unit_step = gaussian.gaussian_uniform_step(tq.bits)
        if tq.quantized and tq.axis == "token" and head_dim % self.group:
            raise LowbitError(f"group {self.group} does not divide head_dim {head_dim}; pick a divisor")
        if tq.lloyd_max:
            self.set_levels(levels if levels is not None else tq.levels)
        self.vq: tuple[int, int] | None = vqm.parse(tq.vq) if tq.quantized and tq.vq else None
        self.residual: str | None = tq.residual if tq.quantized else None
        if self.residual is not None:
            resm.basis(head_dim)  # a head_dim the sign bits cannot pack is refused here, before any row
        if self.vq is not None:
            self.set_codebook(levels)

    @property
    def quantized(self) -> bool:
        return self.tq.quantized

    def set_levels(self, levels: torch.Tensor | None) -> None:
        """Lloyd-Max levels for this tensor of this layer (None = Gaussian-optimal for the bits)."""
        if levels is None:
            levels = gaussian.gaussian_levels(self.bits)
        levels = torch.as_tensor(levels, dtype=torch.float32).flatten()
        if levels.numel() != 1 << self.bits:
            raise LowbitError(f"Lloyd-Max levels for {self.bits} bits need {1 << self.bits} values, got {levels.numel()}")
        self.levels = levels

    def set_codebook(self, cb) -> None:
        """The VQ codebooks of this layer's tensor, [H_kv, E, SUB] (held in fp16, what is counted)."""
        sub, entries = self.vq
        if cb is None:
            raise LowbitError(f"a VQ {sub}x{entries} tensor needs fitted codebooks: fit them with `lowbit calibrate "
                              "--vq-for RECIPE` and name them in the recipe's `levels`")
        cb = torch.as_tensor(cb)
        if cb.dim() != 3 or cb.shape[1:] != (entries, sub):
            raise LowbitError(f"VQ codebooks must be [H_kv, {entries}, {sub}] for vq {sub}x{entries}, got "
                              f"{list(cb.shape)}; fit codebooks for this spec")
        if self.head_dim % sub:
            raise LowbitError(f"VQ sub-vectors of {sub} dims do not divide head_dim {self.head_dim}")
        self.levels = cb.to(torch.float16)
        self._on_device: dict = {}

    def codebook_on(self, device) -> torch.Tensor:
        """The VQ codebooks [H_kv, E, SUB] fp16 on `device`, copied once per device (a captured step never
        copies from the host)."""
        key = str(torch.device(device))
        if key not in self._on_device:
            self._on_device[key] = self.levels.to(device)
        return self._on_device[key]

    # The fields `encode` returns and their per-row widths (for allocation by the layer).
    def fields(self) -> dict[str, int]:
        """{name: last-dim width} of the stored tensors; scale rows are per page for axis 'channel'."""
        D = self.head_dim
        if not self.quantized:
            return {"dense": D}
        if self.tq.axis == "channel":
            return {"codes": D * self.cbits // 8, "scale": D, "zero": D}
        res = {"rbits": D // 8, "rgain": 1} if self.residual else {}
        if not self.stores_zero:
            return {"codes": D * self.cbits // 8, "scale": D // self.group} | res
        return {"codes": D * self.cbits // 8, "scale": D // self.group, "zero": D // self.group} | res

    def field_dtype(self, name: str, dense_dtype: torch.dtype) -> torch.dtype:
        """The dtype every holder of field `name` allocates (the layer, the static cache, the vLLM slot)."""
        if name in ("codes", "rbits") or (name in ("scale", "rgain") and self.scale_format == "ue5m3"):
            return torch.uint8
        return dense_dtype if name == "dense" else SCALE_DTYPE

    def field_bits(self, name: str, dense_bits: int = 16) -> int:
        """Bits one entry of field `name` costs (what the held-bits accounting counts)."""
        if name == "dense":
            return dense_bits
        return 8 if self.field_dtype(name, SCALE_DTYPE) == torch.uint8 else 16

    def rows_per_entry(self, name: str) -> int:
        """Middle rows (tokens) covered by one row of field `name` (page for channel-axis scales)."""
        return self.page if (self.quantized and self.tq.axis == "channel" and name != "codes") else 1

    # ------------------------------------------------------------- encode
    def encode(self, x: torch.Tensor, dense_dtype: torch.dtype, *, checks: bool = True) -> dict[str, torch.Tensor]:
        """x [B, H, T, D] (already rotated) -> stored fields (see module docstring).

        For axis 'channel', T must be a multiple of the page (the layer flushes whole pages).
        checks=False: no host-synchronising input checks (a captured GPU step; same arithmetic).
        """
        out = self._encode_base(x, dense_dtype, checks)
        if self.residual is not None:  # the sign of what the stored base misses, from its stored fields
            r = x.float() - self._decode_base(out)
            rb, g = resm.encode(r, self.residual, self.scale_format)
            out["rbits"] = rb
            out["rgain"] = sf.encode(g) if self.scale_format == "ue5m3" else g.to(SCALE_DTYPE)
        return out

    def _encode_base(self, x: torch.Tensor, dense_dtype: torch.dtype, checks: bool) -> dict[str, torch.Tensor]:
        if not self.quantized:
            return {"dense": x.to(dense_dtype)}
        B, H, T, D = x.shape
        tq = self.tq
        if self.vq is not None:
            cb = self.codebook_on(x.device)
            if cb.shape[0] != H:
                raise LowbitError(f"VQ codebooks hold {cb.shape[0]} KV heads but the rows have {H}; fit them for this model")
            idx, scale = vqm.encode(x, cb, self.scale_format)
            packed = vqm.pack_idx(idx, self.vq[1], checks=checks)
            return {"codes": packed, "scale": sf.encode(scale) if self.scale_format == "ue5m3" else scale.half()}
        if tq.axis == "channel":
            if T % self.page:
                raise LowbitError(f"channel-grouped rows come in pages of {self.page}, got {T}")
            # [B,H,T,D] -> [B,H,T/page,D,page]: groups run over the page's tokens, one per channel
            xt = x.reshape(B, H, T // self.page, self.page, D).transpose(-1, -2)
            codes, scale, zero = self._quantize_last(xt, self.page, checks)  # codes [B,H,T/p,D,p]; scale [B,H,T/p,D,1]
            codes = codes.transpose(-1, -2).reshape(B, H, T, D)
            scale, zero = scale.squeeze(-1), zero.squeeze(-1)  # [B,H,T/p,D]
        else:
            codes, scale, zero = self._quantize_last(x, self.group, checks)  # [B,H,T,D], [B,H,T,D/g]
        packed = codes if self.cbits == 8 else packing.pack(codes, self.cbits, LAYOUT, checks=checks)
        if self.scale_format == "ue5m3":  # exact: the encoder's scales are UE5M3 values already
            return {"codes": packed, "scale": sf.encode(scale)}
        if not self.stores_zero:
            return {"codes": packed, "scale": scale}
        return {"codes": packed, "scale": scale, "zero": zero}

    def _quantize_last(self, x: torch.Tensor, group: int, checks: bool = True):
        """Quantize along the last dim in groups; returns codes uint8, scale/zero SCALE_DTYPE [..., n/group]."""
        tq = self.tq
        if tq.lloyd_max:
            q = lloyd_max.encode(x, self.levels.to(x.device), group, stat_dtype=SCALE_DTYPE)
            return q.codes, q.std, q.mean
        if not self.stores_zero:  # scale-only: the grid centred on 0
            q = affine.quantize_centred(x, tq.bits, group, grid="absmax" if tq.grid == "minmax" else "std",
                                        clip_ratio=tq.clip, checks=checks, unit_step=self.unit_step,
                                        scale_dtype=torch.float32 if self.scale_format == "ue5m3" else SCALE_DTYPE,
                                        scale_format=self.scale_format,
                                        search=affine.MSE_STEPS if tq.grid == "mse" else ())
        elif tq.grid == "std":
            q = affine.quantize_std(x, tq.bits, group, scale_dtype=SCALE_DTYPE, checks=checks, unit_step=self.unit_step)
        else:
            q = affine.quantize(
                x, tq.bits, group, symmetric=tq.symmetric, clip_ratio=tq.clip, scale_dtype=SCALE_DTYPE, checks=checks
            )
        return q.codes, q.scale, q.zero

    # ------------------------------------------------------------- decode
    def decode(self, fields: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Stored fields of T rows -> x_hat [B, H, T, D] in `dtype` (math in float32)."""
        x = self._decode_base(fields)
        if self.residual is not None:
            g = sf.decode(fields["rgain"]) if self.scale_format == "ue5m3" else fields["rgain"].float()
            x = x + resm.decode(fields["rbits"], g)
        return x.to(dtype)

    def _decode_base(self, fields: dict[str, torch.Tensor]) -> torch.Tensor:
        """The base quantizer's reconstruction, float32 [B, H, T, D] (dense rows as they are stored)."""
        dtype = torch.float32
        if not self.quantized:
            return fields["dense"].to(dtype)
        codes = fields["codes"]
        if self.vq is not None:
            s = sf.decode(fields["scale"]) if self.scale_format == "ue5m3" else fields["scale"].float()
            return vqm.decode(vqm.unpack_idx(codes, self.vq[1]), s, self.codebook_on(codes.device)).to(dtype)
        c = codes if self.cbits == 8 else packing.unpack(codes, self.cbits, LAYOUT)  # [B,H,T,D]
        B, H, T, D = c.shape
        vals = self.levels.to(c.device)[c.long()] if self.tq.lloyd_max else c.float()
        scale = sf.decode(fields["scale"]) if self.scale_format == "ue5m3" else fields["scale"].float()
        zero = fields["zero"].float() if self.stores_zero else scale * -self.centre
        if self.tq.axis == "channel":
            P = self.page
            v = vals.reshape(B, H, T // P, P, D)
            x = v * scale.unsqueeze(-2) + zero.unsqueeze(-2)  # scale [B,H,T/P,1,D]
        else:
            g = self.group
            v = vals.reshape(B, H, T, D // g, g)
            x = v * scale.unsqueeze(-1) + zero.unsqueeze(-1)
        return x.reshape(B, H, T, D).to(dtype)

