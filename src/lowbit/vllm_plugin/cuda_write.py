"""The CUDA backend's write path: one fused Triton kernel per layer-step that rotates, quantizes, packs
and stores the step's new tokens into their cells (and their exact-tier rows into the dense pool).

The arithmetic is lowbit's one quantizer, TensorCodec.encode (lowbit.kv.codec -> lowbit.quant.affine ->
lowbit.quant.packing "strided"), per (token, KV head) row, in float32 and in the same order:

    min/max grid:  center = (lo + hi) * 0.5, half = (hi - lo) * (0.5 * clip)     (symmetric: 0, amax * clip)
                   step = half * (2 / qmax)
    std grid:      center = mean, step = std (population) * unit_step
    _lay_grid:     scale = step > 0 ? step : 1, rounded UP to fp16; zero = center - scale * qmax / 2 (step > 0,
                   else center), rounded to fp16; codes = round_half_even((x - zero) / scale) clamped to [0, qmax]
    pack:          byte j = sum_i code[j + i*S] << (i * cb), S = D * cb / 8

Tested code-for-code against TensorCodec.encode (through SlotFormat.encode_rotated, what the CPU plugin
stores) on pre-rotated rows with the min/max grid; the std grid's mean/std and an in-kernel rotation sum
in another order than torch's, so there a code may differ by one step at an exact rounding tie (the test
bounds how often). Cells and dense rows are written at slot_mapping (negative = padding, skipped).
Nothing here synchronises with the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowbit.core.errors import LowbitError

GRID_MINMAX, GRID_SYMMETRIC, GRID_STD = 0, 1, 2


@triton.jit
def _rint(y):
    """Round half to even (torch.round), exact for |y| < 2**23."""
    f = tl.floor(y)
    d = y - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
    return tl.where(d > 0.5, f + 1.0, tl.where(d < 0.5, f, tl.where(odd, f + 1.0, f)))


@triton.jit
def _round_up_f16(x):
    """fp32 x > 0 -> the smallest fp16 >= x (affine._round_up), as float32."""
    r = x.to(tl.float16)
    up = (r.to(tl.int16, bitcast=True) + 1).to(tl.float16, bitcast=True)
    return tl.where(r.to(tl.float32) < x, up, r).to(tl.float32)


@triton.jit
def _rotated(X, R, row, h, D: tl.constexpr, ROT: tl.constexpr, ROT_PER_HEAD: tl.constexpr, RC: tl.constexpr):
    """Row `row` of X [., D] as float32, times R ([D, D], or [H, D, D] per head) when ROT."""
    d = tl.arange(0, D)
    if ROT:
        acc = tl.zeros([D], tl.float32)
        rbase = R + (h * D * D if ROT_PER_HEAD else 0)
        for i0 in tl.static_range(0, D, RC):
            i = i0 + tl.arange(0, RC)
            x = tl.load(X + row + i).to(tl.float32)
            rr = tl.load(rbase + i[:, None] * D + d[None, :])
            acc += tl.sum(x[:, None] * rr, 0)
        return acc
    else:
        return tl.load(X + row + d).to(tl.float32)


@triton.jit
def _quant_store(x, C8, C16, cell, D: tl.constexpr, BITS: tl.constexpr, CB: tl.constexpr, GRP: tl.constexpr,
                 GRID: tl.constexpr, C_OFF: tl.constexpr, S_OFF: tl.constexpr, Z_OFF: tl.constexpr, mul0, mul1):
    """Quantize x [D] (float32, rotated) in groups of GRP and store codes / scale / zero into the cell."""
    NG: tl.constexpr = D // GRP
    QMAX: tl.constexpr = (1 << BITS) - 1
    xg = tl.reshape(x, (NG, GRP))
    if GRID == 2:  # std grid: mean and population std, step = std * unit_step (mul1)
        mean = tl.sum(xg, 1) / GRP
        dev = xg - mean[:, None]
        std = tl.sqrt(tl.sum(dev * dev, 1) / GRP)
        center = mean
        step = std * mul1
    elif GRID == 1:  # symmetric min/max
        center = tl.zeros([NG], tl.float32)
        half = tl.max(tl.abs(xg), 1) * mul0
        step = half * mul1
    else:
        lo = tl.min(xg, 1)
        hi = tl.max(xg, 1)
        center = (lo + hi) * 0.5
        half = (hi - lo) * mul0
        step = half * mul1
    live = step > 0
    scale = _round_up_f16(tl.where(live, step, 1.0))
    zero = tl.where(live, center - scale * (QMAX * 0.5), center)
    z16 = zero.to(tl.float16)
    zero = z16.to(tl.float32)
    codes = _rint(tl.math.div_rn(xg - zero[:, None], scale[:, None]))
    codes = tl.minimum(tl.maximum(codes, 0.0), QMAX * 1.0).to(tl.int32)
    S: tl.constexpr = D * CB // 8
    P: tl.constexpr = 8 // CB
    c2 = tl.reshape(codes, (P, S))  # dim i*S + j -> [i, j]
    sh = (tl.arange(0, P) * CB)[:, None]
    packed = tl.sum(c2 << sh, 0)  # [S]: disjoint bits, the sum is an OR
    tl.store(C8 + cell + C_OFF + tl.arange(0, S), packed.to(tl.uint8))
    gi = tl.arange(0, NG)
    tl.store(C16 + (cell + S_OFF) // 2 + gi, scale.to(tl.float16).to(tl.int16, bitcast=True))
    tl.store(C16 + (cell + Z_OFF) // 2 + gi, z16.to(tl.int16, bitcast=True))


@triton.jit
def _write_kernel(K, V, RK, RV, SLOT, POS, RSEQ, C8, C16, PK, PV, DMAP, DVALID, KR_OUT, VR_OUT,
                  k_mul0, k_mul1, v_mul0, v_mul1, SINK, RECENT,
                  stride_kt, stride_kh, stride_vt, stride_vh,
                  H: tl.constexpr, BS: tl.constexpr, SB: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                  KBITS: tl.constexpr, KCB: tl.constexpr, KG: tl.constexpr, KGRID: tl.constexpr,
                  KC_OFF: tl.constexpr, KS_OFF: tl.constexpr, KZ_OFF: tl.constexpr,
                  VBITS: tl.constexpr, VCB: tl.constexpr, VG: tl.constexpr, VGRID: tl.constexpr,
                  VC_OFF: tl.constexpr, VS_OFF: tl.constexpr, VZ_OFF: tl.constexpr,
                  ROT_K: tl.constexpr, ROT_V: tl.constexpr, RK_PER_HEAD: tl.constexpr, RV_PER_HEAD: tl.constexpr,
                  HAS_TIERS: tl.constexpr, OUT_ROWS: tl.constexpr, RC: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(SLOT + t).to(tl.int64)
    kr = _rotated(K, RK, t * stride_kt + h * stride_kh, h, DK, ROT_K, RK_PER_HEAD, RC)
    vr = _rotated(V, RV, t * stride_vt + h * stride_vh, h, DV, ROT_V, RV_PER_HEAD, RC)
    dk = tl.arange(0, DK)
    dv = tl.arange(0, DV)
    if OUT_ROWS:  # the rotated rows in the model dtype: the attention's own-chunk keys / values
        tl.store(KR_OUT + (t * H + h) * DK + dk, kr.to(KR_OUT.dtype.element_ty))
        tl.store(VR_OUT + (t * H + h) * DV + dv, vr.to(VR_OUT.dtype.element_ty))
    if slot >= 0:
        blk = slot // BS
        off = slot % BS
        cell = ((blk * H + h) * BS + off) * SB
        _quant_store(kr, C8, C16, cell, DK, KBITS, KCB, KG, KGRID, KC_OFF, KS_OFF, KZ_OFF, k_mul0, k_mul1)
        _quant_store(vr, C8, C16, cell, DV, VBITS, VCB, VG, VGRID, VC_OFF, VS_OFF, VZ_OFF, v_mul0, v_mul1)
        if HAS_TIERS:
            pos = tl.load(POS + t)
            rseq = tl.load(RSEQ + t)
            tier = (pos >= 0) & ((pos < SINK) | (pos >= rseq - RECENT))
            dslot = tl.load(DMAP + blk).to(tl.int64)
            if tier & (dslot >= 0):
                prow = (dslot * BS + off) * H + h
                tl.store(PK + prow * DK + dk, kr.to(PK.dtype.element_ty))
                tl.store(PV + prow * DV + dv, vr.to(PV.dtype.element_ty))
                tl.store(DVALID + dslot * BS + off, 1)


def quant_params(codec) -> tuple[int, float, float]:
    """(GRID, mul0, mul1) of a TensorCodec: the scalars affine.quantize / quantize_std multiply by."""
    tq = codec.tq
    if not codec.quantized or tq.axis != "token" or tq.lloyd_max or tq.vq or tq.residual or not codec.stores_zero \
            or codec.scale_format != "fp16":
        raise LowbitError(f"internal: codec {tq.describe()} is not one the CUDA write kernel takes")
    qmax = (1 << codec.bits) - 1
    if tq.grid == "std":
        return GRID_STD, 1.0, float(codec.unit_step)
    if tq.grid != "minmax":
        raise LowbitError(f"internal: grid {tq.grid} is not one the CUDA write kernel takes")
    r = float(tq.clip)
    if tq.symmetric:
        return GRID_SYMMETRIC, r, 2.0 / qmax
    return GRID_MINMAX, 0.5 * r, 2.0 / qmax


def write_params(fmt) -> dict:
    """The write kernel's constexprs and scalars for a SlotFormat."""
    p = {"SB": fmt.slot_bytes}
    for which, P in (("k", "K"), ("v", "V")):
        c = fmt.codecs[which]
        grid, m0, m1 = quant_params(c)
        p.update({f"{P}BITS": c.bits, f"{P}CB": c.cbits, f"{P}G": c.group, f"{P}GRID": grid,
                  f"{P}C_OFF": fmt.field(which, "codes").offset, f"{P}S_OFF": fmt.field(which, "scale").offset,
                  f"{P}Z_OFF": fmt.field(which, "zero").offset, f"_{which}_mul": (m0, m1)})
    return p


def write(cache_u8, fmt, key, value, slot_mapping, rot_k=None, rot_v=None, *, positions=None, row_seq=None,
          sink: int = 0, recent: int = 0, tiers=None, rows_out: tuple | None = None) -> None:
    """Store the step's new tokens: key [T, H, D_k], value [T, H, D_v] (model dtype, unrotated) -> their cells
    at slot_mapping [T] (block * bs + offset; < 0 skipped) of cache_u8 [NB, H, bs, slot_bytes].

    rot_k / rot_v: [D, D] or [H, D, D] float32 on the device (None: no rotation, the rows are rotated already).
    tiers (pool_k, pool_v, dmap, dvalid) with positions [T] / row_seq [T] (token position, its request's
    length after the step; position < 0 = padding): a token at position < sink or >= row_seq - recent is also
    stored dense (rotated, pool dtype) where its block has a pool slot. rows_out (kr [T, H, D_k], vr): receive
    the rotated rows in their dtype."""
    T, H, Dk = key.shape
    Dv = value.shape[2]
    BS = cache_u8.shape[2]
    if T == 0:
        return
    p = write_params(fmt)
    km, vm = p.pop("_k_mul"), p.pop("_v_mul")
    dev = key.device
    has_tiers = tiers is not None and (sink > 0 or recent > 0)
    if has_tiers:
        pk, pv, dmap, dvalid = tiers
    else:
        pk = pv = torch.zeros(1, dtype=key.dtype, device=dev)
        dmap = torch.zeros(1, dtype=torch.int32, device=dev)
        dvalid = torch.zeros(1, dtype=torch.uint8, device=dev)
        positions = row_seq = torch.zeros(1, dtype=torch.int32, device=dev)
    dummy = torch.zeros(1, dtype=torch.float32, device=dev)
    if rot_k is not None and (rot_k.dtype != torch.float32 or not rot_k.is_contiguous()):
        rot_k = rot_k.float().contiguous()  # the backend passes these prepared once (no copy per step)
    if rot_v is not None and (rot_v.dtype != torch.float32 or not rot_v.is_contiguous()):
        rot_v = rot_v.float().contiguous()
    kro, vro = rows_out if rows_out is not None else (key, value)
    rc = min(32, Dk, Dv)
    _write_kernel[(T, H)](
        key, value, dummy if rot_k is None else rot_k, dummy if rot_v is None else rot_v,
        slot_mapping, positions, row_seq, cache_u8, cache_u8.view(torch.int16), pk, pv, dmap, dvalid, kro, vro,
        float(km[0]), float(km[1]), float(vm[0]), float(vm[1]), int(sink), int(recent),
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        H=H, BS=BS, DK=Dk, DV=Dv, ROT_K=rot_k is not None, ROT_V=rot_v is not None,
        RK_PER_HEAD=rot_k is not None and rot_k.dim() == 3, RV_PER_HEAD=rot_v is not None and rot_v.dim() == 3,
        HAS_TIERS=has_tiers, OUT_ROWS=rows_out is not None, RC=rc, **p)
