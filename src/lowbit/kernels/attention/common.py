"""What the decode attention kernels share (kernels/attention/tiers.py, geometry.py, vq.py): one home each.

    register tricks     halves / pair_byte (codes to fp16 by bit tricks), ue5m3 (one-byte scales)
    dense tiers         dense_split (sink + recent of one KV head inside a stage-1 program), check_dense
    the merge           stage2 (log-sum-exp over the splits; empty splits weigh 0, never NaN)
    argument checks     lens, tier_heads, check_packed_tier, check_mode (interpreter vs compiled)
    the device          cuda_index, device_info (SM count, resident programs per compiled variant)

A kernel module imports these; none of the kernel modules imports another's private helpers.
"""

from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl

from lowbit.core.errors import LowbitError

LOG2E = 1.4426950408889634

LOG2E = 1.4426950408889634


@triton.jit
def halves(x):
    """int32 -> (low half, high half) reinterpreted as fp16 (free: the halves of one register)."""
    lo = x.to(tl.int16).to(tl.float16, bitcast=True)
    hi = (x >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    return lo, hi


@triton.jit
def pair_byte(a, b, c, USE_PRMT: tl.constexpr):
    """Byte c of a into bits 0-7 and byte c of b into bits 16-23 (bits 8-15, 24-31: don't care).

    a, b, c int32 of one shape; c in 0..3 (a tensor: different registers take different bytes)."""
    if USE_PRMT:
        # prmt selector nibbles (result byte 3..0) = (4+c, 4+c, c, c): one instruction
        r = tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, 0x4400 + c * 0x1111],
                                      dtype=tl.int32, is_pure=True, pack=1)
    else:
        r = ((a >> (8 * c)) & 0xFF) | (((b >> (8 * c)) & 0xFF) << 16)
    return r


@triton.jit
def _split_lo(x, DT: tl.constexpr):
    """fp32 x -> (hi, lo) in DT with hi + lo = x to ~2**-16 (two MMAs instead of one fp32 one)."""
    hi = x.to(DT)
    return hi, (x - hi.to(tl.float32)).to(DT)


@triton.jit
def _dense_block(Kp, Vp, skt, svt, t0, n, q_hi, q_lo, m_i, l_v, o_t,
                 BT: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, EXACT_F32: tl.constexpr):
    """One block of a dense tier (rows [t0, t0+BT) of [n, D] at Kp/Vp, token strides skt/svt).

    K and V are exact in their dtype; q (and p) are split hi + lo in it, so two bf16/fp16 MMAs give
    ~fp32 products. fp32 tiers (EXACT_F32) use tf32x3 instead."""
    dk = tl.arange(0, D)
    dv = tl.arange(0, DV)
    t = t0 + tl.arange(0, BT)
    valid = t < n
    k = tl.load(Kp + t[:, None] * skt + dk[None, :], mask=valid[:, None], other=0.0)
    if EXACT_F32:
        s = tl.dot(k.to(tl.float32), q_hi, input_precision="tf32x3")  # [BT, HP]
    else:
        s = tl.dot(k, q_hi) + tl.dot(k, q_lo)
    s = tl.where(valid[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 0))  # finite: the block has >= 1 valid token
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[None, :])
    l_v = l_v * alpha[None, :] + p
    vt = tl.load(Vp + t[None, :] * svt + dv[:, None], mask=valid[None, :], other=0.0)  # [DV, BT]
    if EXACT_F32:
        o_t = tl.dot(vt.to(tl.float32), p, o_t * alpha[None, :], input_precision="tf32x3")  # [DV, HP]
    else:
        p_hi, p_lo = _split_lo(p, vt.dtype)
        o_t = tl.dot(vt, p_lo, tl.dot(vt, p_hi, o_t * alpha[None, :]))
    return m_new, l_v, o_t


@triton.jit
def _dense_tier(Kp, Vp, skt, svt, n, ITERS: tl.constexpr, q_t, m_i, l_v, o_t,
                BT: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, INTERP: tl.constexpr):
    """Online softmax over a dense tier's valid rows [0, n). q_t [D, HP] fp32 (times sm_scale*log2 e),
    o_t [DV, HP] fp32, l_v [BT, HP] deferred row sums. ITERS: blocks in the tier's slots (interpreter).
    """
    DT: tl.constexpr = Kp.dtype.element_ty
    # fp32 tiers: tf32x3. The interpreter too: its tl.dot is wrong on bf16 operands (triton 3.6).
    EXACT_F32: tl.constexpr = (DT == tl.float32) or INTERP
    if EXACT_F32:
        q_hi = q_t
        q_lo = q_t
    else:
        q_hi, q_lo = _split_lo(q_t, DT)
    if INTERP:
        # The interpreter (numpy >= 2.5) cannot take a run-time scalar as a range bound: it runs a
        # compile-time trip count with a guard. The GPU loops over exactly the valid blocks.
        for it in range(ITERS):
            if it * BT < n:
                m_i, l_v, o_t = _dense_block(Kp, Vp, skt, svt, it * BT, n, q_hi, q_lo, m_i, l_v, o_t,
                                             BT, D, DV, EXACT_F32)
    else:
        for t0 in range(0, n, BT):
            m_i, l_v, o_t = _dense_block(Kp, Vp, skt, svt, t0, n, q_hi, q_lo, m_i, l_v, o_t, BT, D, DV, EXACT_F32)
    return m_i, l_v, o_t


@triton.jit
def ue5m3(u):
    """uint8 UE5M3 scale codes (lowbit.quant.scale_format) -> fp32, exactly: E = u >> 3, M = u & 7;
    E > 0 is the fp32 with exponent field E + 112 and top mantissa bits M; E = 0 is M * 2**-17."""
    u32 = u.to(tl.int32)
    e = u32 >> 3
    m = u32 & 7
    normal = (((e + 112) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    return tl.where(e > 0, normal, m.to(tl.float32) * 7.62939453125e-06)


@triton.jit
def dense_split(q_t, b, kvh, SKK, SKV, sskb, sskh, sskt, ssvb, ssvh, ssvt, SINK_LEN,
                 RKK, RKV, srkb, srkh, srkt, srvb, srvh, srvt, REC_LEN, OP, LSE, o_rows, hvalid,
                 HP: tl.constexpr, BTD: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, HAS_SINK: tl.constexpr,
                 HAS_REC: tl.constexpr, INTERP: tl.constexpr, SINK_ITERS: tl.constexpr, REC_ITERS: tl.constexpr):
    """The split that reads the dense tiers (sink, recent) of one (sequence, KV head): q_t [D, HP] fp32 (times
    sm_scale * log2 e) -> its normalised partial output and lse at rows o_rows [HP] of OP / LSE. Shared by the
    fused decode kernels (this one and lowbit.kernels.attention.vq)."""
    m_d = tl.full([HP], float("-inf"), tl.float32)
    l_d = tl.zeros([BTD, HP], tl.float32)
    o_t = tl.zeros([DV, HP], tl.float32)
    if HAS_SINK:
        n = tl.load(SINK_LEN + b)
        m_d, l_d, o_t = _dense_tier(
            SKK + b.to(tl.int64) * sskb + kvh.to(tl.int64) * sskh,
            SKV + b.to(tl.int64) * ssvb + kvh.to(tl.int64) * ssvh,
            sskt, ssvt, n, SINK_ITERS, q_t, m_d, l_d, o_t, BTD, D, DV, INTERP)
    if HAS_REC:
        n = tl.load(REC_LEN + b)
        m_d, l_d, o_t = _dense_tier(
            RKK + b.to(tl.int64) * srkb + kvh.to(tl.int64) * srkh,
            RKV + b.to(tl.int64) * srvb + kvh.to(tl.int64) * srvh,
            srkt, srvt, n, REC_ITERS, q_t, m_d, l_d, o_t, BTD, D, DV, INTERP)
    l_i = tl.sum(l_d, 0)
    inv_l = tl.where(l_i > 0, 1.0 / l_i, 0.0)
    lse = tl.where(l_i > 0, m_d + tl.log2(l_i), float("-inf"))
    tl.store(LSE + o_rows, lse, mask=hvalid)
    dv = tl.arange(0, DV)
    tl.store(OP + o_rows[None, :] * DV + dv[:, None], o_t * inv_l[None, :], mask=hvalid[None, :])


@triton.jit
def stage2(OP, LSE, OUT, sob, soh, NSPLIT, NCH: tl.constexpr, CH: tl.constexpr, DV: tl.constexpr):
    """Merge the NSPLIT partial outputs of one (sequence, q head) by log-sum-exp, CH at a time
    (online: running max and rescale). Empty splits carry lse = -inf and get weight 0; if every
    split is empty the output is 0, never NaN."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    row = b * tl.num_programs(1) + h
    d = tl.arange(0, DV)
    m = float("-inf")
    den = 0.0
    num = tl.zeros([DV], tl.float32)
    for c in tl.static_range(NCH):  # unrolled: every chunk's loads can be in flight at once
        s = c * CH + tl.arange(0, CH)
        sv = s < NSPLIT
        lse = tl.load(LSE + row * NSPLIT + s, mask=sv, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(lse, 0))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        scale = tl.exp2(m - m_use)  # 0 while nothing was seen
        w = tl.exp2(lse - m_use)
        o = tl.load(OP + (row * NSPLIT + s)[:, None] * DV + d[None, :], mask=sv[:, None], other=0.0)
        den = den * scale + tl.sum(w, 0)
        num = num * scale + tl.sum(o * w[:, None], 0)
        m = m_new
    out = tl.where(den > 0, num / tl.maximum(den, 1e-30), 0.0)
    tl.store(OUT + b.to(tl.int64) * sob + h * soh + d, out.to(OUT.dtype.element_ty))


def pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


class DeviceInfo:
    """Facts about one CUDA device that hold for the life of the process: its SM count and, per
    compiled stage-1 variant, the programs resident per SM. One object per device index
    (`device_info`); caches of facts about the hardware, never of a call's choices."""

    def __init__(self, index: int):
        self.index = int(index)
        self.sms = int(torch.cuda.get_device_properties(self.index).multi_processor_count)
        self._occupancy: dict = {}  # compiled-kernel key -> resident programs per SM (None: probe failed)

    def blocks_per_sm(self, consts: dict, probe_args, probe) -> int | None:
        """Resident programs per SM of one compiled variant; `probe(device, consts, probe_args)` measures it
        once (the kernel module's own occupancy probe)."""
        key = (tuple(sorted(consts.items())), tuple(
            (a.dtype, a.data_ptr() % 16) if isinstance(a, torch.Tensor) else None for a in probe_args(None, None)[:40]))
        if key not in self._occupancy:
            self._occupancy[key] = probe(torch.device("cuda", self.index), consts, probe_args)
        return self._occupancy[key]


def cuda_index(dev: torch.device) -> int:
    """The explicit index of a CUDA device ("cuda" alone means the current device at call time)."""
    return dev.index if dev.index is not None else torch.cuda.current_device()


@cache
def device_info(index: int) -> DeviceInfo:
    """The DeviceInfo of CUDA device `index` (one per device, keyed by its explicit index)."""
    return DeviceInfo(index)


def valid_lens(x, batch: int, device, what: str) -> torch.Tensor:
    if isinstance(x, int):
        return torch.full((batch,), x, dtype=torch.int32, device=device)
    if not isinstance(x, torch.Tensor) or x.shape != (batch,):
        raise LowbitError(f"{what} must be an int or an int tensor of shape [{batch}]")
    return x.to(device=device, dtype=torch.int32)


def check_dense(k, v, lens, B, Hkv, D, DV, device, what):
    if k is None and v is None:
        return None, None, None
    if k is None or v is None:
        raise LowbitError(f"{what}: pass both its K and V tensors or neither")
    if k.dim() != 4 or k.shape[0] != B or k.shape[1] != Hkv or k.shape[3] != D:
        raise LowbitError(f"{what} K must be [B={B}, Hkv={Hkv}, N, D={D}], got {tuple(k.shape)}")
    if v.dim() != 4 or v.shape[:3] != k.shape[:3] or v.shape[3] != DV:
        raise LowbitError(f"{what} V must be [B, Hkv, N, Dv={DV}] like its K, got {tuple(v.shape)}")
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise LowbitError(f"{what} K/V need a contiguous last dim; call .contiguous()")
    if k.device != device or v.device != device:
        raise LowbitError(f"{what} is on {k.device}, q on {device}: put the tiers on one device")
    if lens is None:
        lens = k.shape[2]
    return k, v, valid_lens(lens, B, device, f"{what} lens")


def tier_heads(Hq, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, v_bits, sink_k, sink_v, recent_k, recent_v):
    """(has_mid, Hkv, DV) of the tiers passed to a fused decode kernel: the middle tier whole or not at all,
    at least one tier, and Hq a multiple of Hkv (both kernels' wrappers ask this first)."""
    has_mid = k_codes is not None
    if has_mid:
        if any(t is None for t in (k_scale, k_zero, v_codes, v_scale, v_zero)):
            raise LowbitError("middle tier: pass k_codes, k_scale, k_zero, v_codes, v_scale, v_zero together")
        Hkv = k_codes.shape[1]
        DV = v_codes.shape[3] * 8 // v_bits
    else:
        ref = sink_k if sink_k is not None else recent_k
        if ref is None:
            raise LowbitError("no tier given: pass the middle tier and/or a dense tier")
        Hkv = ref.shape[1]
        DV = (sink_v if sink_v is not None else recent_v).shape[3]
    if Hkv == 0 or Hq % Hkv:
        raise LowbitError(f"Hq={Hq} is not a multiple of Hkv={Hkv}")
    return has_mid, Hkv, DV


def check_packed_tier(codes, scale, zero, bits, B, Hkv, D, device, what, one_byte_scales: bool = False) -> int:
    """The packed middle tier's layout, as both fused kernels read it: codes uint8 [B, Hkv, T, D*bits/8]
    with each (sequence, head)'s rows back to back and 4-byte aligned, scale/zero float16 [B, Hkv, T, G]
    sharing strides, all on q's device. one_byte_scales (the head_dim 64/128/256 kernel): scale may also
    be uint8 UE5M3 codes of scale-only groups (zero is then the scale itself, see centred_zero).
    Returns G (groups per head); each kernel checks its own tiling."""
    if codes.dtype != torch.uint8 or codes.dim() != 4:
        raise LowbitError(f"{what} codes must be uint8 [B, Hkv, T, D*bits/8], got {codes.dtype} {tuple(codes.shape)}")
    S = D * bits // 8
    if codes.shape[0] != B or codes.shape[1] != Hkv or codes.shape[3] != S:
        raise LowbitError(f"{what} codes must be [B={B}, Hkv={Hkv}, T, {S}], got {tuple(codes.shape)}")
    if codes.stride(3) != 1 or (codes.shape[2] > 1 and codes.stride(2) != S) or any(
            s % 4 for s in codes.stride()[:2]) or codes.storage_offset() % 4:
        raise LowbitError(f"{what} codes: each (sequence, KV head) must hold its T rows of {S} bytes "
                          "back to back, 4-byte aligned (slice a [B, Hkv, Tmax, S] buffer along T only)")
    if codes.shape[2] * S >= 2**31:
        raise LowbitError(f"{what} codes: {codes.shape[2]} slots x {S} bytes exceed the kernel's 32-bit offsets")
    if scale.shape != zero.shape or scale.dim() != 4 or scale.shape[:3] != codes.shape[:3]:
        raise LowbitError(f"{what} scale/zero must be [B, Hkv, T, D/group] like the codes, got {tuple(scale.shape)}")
    if scale.dtype == torch.uint8:
        if not one_byte_scales:
            raise LowbitError(f"{what}: one-byte (ue5m3) scales are read by the head_dim 64/128/256 kernel only; "
                              "store fp16 scales (scale_format 'fp16') or use the torch path")
        if zero is not scale:
            raise LowbitError(f"{what}: one-byte (ue5m3) scales are for scale-only groups; pass no zero tensor, "
                              "and the centre code")
    elif scale.dtype != torch.float16 or zero.dtype != torch.float16:
        raise LowbitError(f"{what} scale/zero must be float16 (the cache layout), or uint8 ue5m3 scale codes of "
                          f"scale-only groups; got {scale.dtype}/{zero.dtype}")
    ng = scale.shape[3]
    if scale.stride() != zero.stride() or scale.stride(3) != 1 or (scale.shape[2] > 1 and scale.stride(2) != ng):
        raise LowbitError(f"{what} scale and zero must share strides with contiguous [T, D/group] rows per head")
    for t in (codes, scale, zero):
        if t.device != device:
            raise LowbitError(f"{what} is on {t.device}, q on {device}: put the cache on one device")
    return ng


def interpreted() -> bool:
    """True if the kernels are Triton-interpreter functions (CPU tensors only), read from the kernel
    objects at each call.

    Why not a lowbit switch: in triton 3.6 `@triton.jit` itself picks, when this module is imported,
    an interpreter function or a compiled one (from TRITON_INTERPRET, which triton reads, not lowbit).
    lowbit reads no environment variable and keeps no mode flag of its own: it asks the kernel
    objects what they are, every call (`check_mode`), and refuses tensors on a device those objects
    cannot run on instead of switching silently. Rebuilding the kernels in the other mode at call
    time would need a second copy of every @triton.jit helper, for a mode a process never mixes."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(stage2, InterpretedFunction)  # every @triton.jit of a process is built the same way


def check_mode(dev: torch.device) -> None:
    """Refuse tensors on a device the kernels, as triton built them, cannot run on (see `interpreted`)."""
    if dev.type == "cuda" and interpreted():
        raise LowbitError("this process imported lowbit.kernels under TRITON_INTERPRET=1 (the CPU "
                          "interpreter); run GPU work in a process without it")
    if dev.type != "cuda" and not interpreted():
        raise LowbitError(f"decode_attention on {dev.type} tensors needs the Triton interpreter: set "
                          "TRITON_INTERPRET=1 before lowbit.kernels is imported, or use CUDA tensors")
