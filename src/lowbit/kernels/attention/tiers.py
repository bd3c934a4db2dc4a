"""Fused split-K decode attention over the tiered KV cache (Triton), and its Python wrapper.

One new query token per sequence attends to three tiers of one layer:
  sink   (dense, model dtype)  [B, Hkv, Ns, D]  valid slots [0, sink_lens[b])
  middle (packed codes)        k_codes uint8 [B, Hkv, T, D*kbits/8] in the `strided` layout of
                               lowbit.quant.packing, k_scale/k_zero fp16 [B, Hkv, T, D/group];
                               same for V; x = codes * scale + zero; valid slots [0, mid_lens[b])
  recent (dense, model dtype)  [B, Hkv, Nr, D]  valid slots [0, recent_lens[b])
Order inside a tier does not matter (attention is a sum over tokens), so a ring buffer whose valid
slots are a prefix -- or all slots -- works as is; a sliding-window layer passes its window.

Structure (flash-decoding):
  stage 1  grid (n_mid_splits + dense?, Hkv, B). A program takes one KV head of one sequence and a
           range of middle tokens (or, the last split, both dense tiers) and all G = Hq/Hkv query
           heads of that KV head, so every code is read and dequantized once per group. It writes
           the split's output normalised by its own softmax sum, and its log2-sum-exp.
  stage 2  grid (B, Hq): merges the splits by log-sum-exp. Empty splits (no valid token) carry
           lse = -inf and weight 0; a sequence with no token at all gets zeros, never NaN.

Why it is fast (the arithmetic is in docs/DESIGN_NOTES.md):
- KV tokens are the M dimension of the QK dot ([BT tokens, D] x [D, HP heads]), so the G heads of a
  KV head are padded only to HP = max(8, pow2(G)) (the n8 of mma.m16n8k16), not to 16 rows.
- Dequant is one AND per two codes: a 32-bit word of packed codes ANDed with a mask that keeps one
  code in each 16-bit half IS two fp16 numbers -- subnormals equal to code * 2**(shift-24). The
  powers of two (2**-24 and the code's bit position) are folded into q (QK) or into the per-dim
  factor applied once after the loop (PV), so no per-element convert, subtract or multiply.
  The per-token scale/zero are factored out of the dots: q.k_t = s_t * (q . c_t) + z_t * sum(q).
- For PV the MMA wants pairs of tokens per 32-bit register: one byte-permute per two words puts
  byte b of token t and of token t+1 into the two halves, then one AND per position as above;
  one sub.f16x2 centres the codes (code - 2**(bits-1)) so the fp32 MMA sum does not grow large
  and cancel against the zero term (that cancellation cost 1.7e-3 of accuracy at 128k tokens).
- Each warp keeps its own softmax state over its own tokens (a batched tl.dot whose batch is the
  warp), so the loop has no cross-warp reduction; warps merge once at the end of the program.
Measured on an H200 (docs/DESIGN_NOTES.md): int2 4.1x / int4 3.5x SDPA flash at B16 L32k,
int2 3.3x at B1 L128k; latency-bound on each warp's dependency chains at 8-12 resident warps per SM
(ncu: "wait" stalls lead, DRAM at ~50%), not bandwidth-bound. Capture decode in a CUDA graph: a Python call of the
wrapper costs ~0.1 ms of host time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lowbit.core.errors import LowbitError
from lowbit.kernels.attention.common import (
    LOG2E,
    check_dense,
    check_mode,
    check_packed_tier,
    cuda_index,
    dense_split,
    device_info,
    halves,
    pair_byte,
    pow2,
    stage2,
    tier_heads,
    ue5m3,
    valid_lens,
)
from lowbit.kernels.attention.geometry import GeoConfig, decode_attention_geo


# ----------------------------------------------------------------------------------------------
# Dequant helpers (register bit tricks). Tensors carry a leading warp dim NW: every warp runs its
# own slice of tokens with its own softmax state (batched tl.dot), so the loop needs no barrier.
# ----------------------------------------------------------------------------------------------
@triton.jit
def _k_chunk(e, o, SH: tl.constexpr, BITS: tl.constexpr):
    """Words e [NW, BTW, WU] (o = e >> 8) -> fp16 [NW, BTW, 4*WU]: the codes at bit offset SH of
    every byte, value code * 2**(SH-24). Column 4w + j holds byte (0, 2, 1, 3)[j] of word w, so
    each pair of neighbouring columns is the two halves of ONE register (what the MMA wants)."""
    M: tl.constexpr = (((1 << BITS) - 1) << SH) * 0x10001
    el, eh = halves(e & M)  # bytes 0, 2
    ol, oh = halves(o & M)  # bytes 1, 3
    x = tl.join(tl.join(el, ol), tl.join(eh, oh))  # [NW, BTW, WU, 2(eo), 2(h)] -> j = 2*eo + h
    return tl.reshape(x, (x.shape[0], x.shape[1], x.shape[2] * 4))


@triton.jit
def _k_group(w, BITS: tl.constexpr, I0: tl.constexpr, NP: tl.constexpr):
    """K words [NW, BTW, WU] -> fp16 [NW, BTW, NP*4*WU]: positions I0..I0+NP-1, chunk-major."""
    o = w >> 8
    c0 = _k_chunk(w, o, BITS * I0, BITS)
    if NP == 1:
        k = c0
    elif NP == 2:
        c1 = _k_chunk(w, o, BITS * (I0 + 1), BITS)
        j = tl.join(c0, c1)  # [NW, BTW, U, 2(i)]
        k = tl.reshape(tl.permute(j, (0, 1, 3, 2)), (j.shape[0], j.shape[1], j.shape[2] * 2))
    else:
        c1 = _k_chunk(w, o, BITS * (I0 + 1), BITS)
        c2 = _k_chunk(w, o, BITS * (I0 + 2), BITS)
        c3 = _k_chunk(w, o, BITS * (I0 + 3), BITS)
        j = tl.join(tl.join(c0, c1), tl.join(c2, c3))  # [NW, BTW, U, 2(i_lo), 2(i_hi)]
        k = tl.reshape(tl.permute(j, (0, 1, 4, 3, 2)), (j.shape[0], j.shape[1], j.shape[2] * 4))
    return k


@triton.jit
def _k_dims(GK: tl.constexpr, SK: tl.constexpr, g: tl.constexpr):
    """Dim of each column of _k_group for group g: swap bits 0 and 1 (byte order 0, 2, 1, 3)."""
    k = tl.arange(0, GK)
    return g * GK + (k & ~3) + ((k & 1) << 1) + ((k >> 1) & 1)


@triton.jit
def _v_group(wt, WU: tl.constexpr, BTW: tl.constexpr, BITS: tl.constexpr, I0: tl.constexpr,
             NP: tl.constexpr, USE_PRMT: tl.constexpr, CENTER: tl.constexpr):
    """V words, token-minor [NW, WU, BTW] -> fp16 V^T [NW, 4*NP*WU, BTW]; row r = (byte c,
    position i, word w) = (c*NP + i)*WU + w holds dim i*S + 4w + c of the group; column = token.
    Built by broadcasting over (c, i), not by joins, so c and i may sit in any register/warp."""
    NW: tl.constexpr = wt.shape[0]
    a, b = tl.split(tl.reshape(wt, (NW, WU, BTW // 2, 2)))  # even, odd tokens: [NW, WU, BTW/2]
    shape: tl.constexpr = (NW, 4, WU, BTW // 2)
    c = tl.arange(0, 4)[None, :, None, None]
    x = pair_byte(tl.broadcast_to(a[:, None, :, :], shape), tl.broadcast_to(b[:, None, :, :], shape),
                   tl.broadcast_to(c, shape), USE_PRMT)  # [NW, 4, WU, BTW/2]
    i = I0 + tl.arange(0, NP)
    m = (((1 << BITS) - 1) << (BITS * i)) * 0x10001  # [NP]
    y = x[:, :, None, :, :] & m[None, None, :, None, None]  # [NW, 4, NP, WU, BTW/2]
    if CENTER:
        # code - 2**(BITS-1) (exact: small multiples of the subnormal step): the MMA then sums
        # values of both signs, not a large positive total that cancels against the zero term.
        mid = ((1 << (BITS - 1 + BITS * i)) * 0x10001)[None, None, :, None, None]  # fp16x2 bit pattern
        if USE_PRMT:
            y = tl.inline_asm_elementwise("sub.f16x2 $0, $1, $2;", "=r,r,r", [y, tl.broadcast_to(mid, y.shape)],
                                          dtype=tl.int32, is_pure=True, pack=1)
            lo, hi = halves(y)
        else:
            lo, hi = halves(y)
            mh, _ = halves(tl.broadcast_to(mid, y.shape))
            lo = lo - mh
            hi = hi - mh
    else:
        lo, hi = halves(y)
    return tl.reshape(tl.join(lo, hi), (NW, 4 * NP * WU, BTW))


@triton.jit
def _v_rows(GV: tl.constexpr, WU: tl.constexpr, NP: tl.constexpr, SB: tl.constexpr):
    """For the rows of _v_group: (dim offset inside the group, code position i)."""
    r = tl.arange(0, GV)
    c = r // (NP * WU)
    i = (r // WU) % NP
    w = r % WU
    return i * SB + 4 * w + c, i


# ----------------------------------------------------------------------------------------------
# Stage 1
# ----------------------------------------------------------------------------------------------
@triton.jit
def _load_sz(SC, ZE, base, t0, end, g: tl.constexpr, NG: tl.constexpr, NW: tl.constexpr, BTW: tl.constexpr,
             DIRECT: tl.constexpr = False, ZC: tl.constexpr = 0.0, SF: tl.constexpr = 0):
    """fp16 scale/zero of group g for the block at t0 -> fp32 [NW, BTW] (0 past `end`).

    ZC != 0: scale-only groups (no zero stored, the grid centred on 0): zero = -ZC * scale, ZE unread.
    SF 1: the scales are one-byte UE5M3 codes (scale-only groups only): a byte load, decoded by ue5m3
    (DIRECT then clamps the index the same way, through a plain tl.load).

    DIRECT (GPU only, needs end >= 1 slot): one inline-asm load per element with the token index
    clamped into [0, end) instead of a masked tl.load. Triton treats an inline-asm op as cheap to
    rematerialise, so the load is emitted in the layout its user (the MMA result) wants, not in a
    blocked layout followed by a round trip through shared memory and a CTA barrier. Values past
    `end` are finite duplicates; their tokens are masked out of the softmax."""
    tok = t0 + tl.arange(0, NW)[:, None] * BTW + tl.arange(0, BTW)[None, :]
    if SF == 1:
        if DIRECT:
            tc = tl.maximum(tl.minimum(tok, end - 1), 0)
            sc = ue5m3(tl.load(SC + base + tc * NG + g))
        else:
            sc = ue5m3(tl.load(SC + base + tok * NG + g, mask=tok < end, other=0))
        ze = sc * (-ZC)
    elif DIRECT:
        tc = tl.maximum(tl.minimum(tok, end - 1), 0)
        sc = tl.inline_asm_elementwise("ld.global.nc.b16 $0, [$1];", "=h,l", [SC + base + tc * NG + g],
                                       dtype=tl.float16, is_pure=True, pack=1).to(tl.float32)
        if ZC == 0.0:
            ze = tl.inline_asm_elementwise("ld.global.nc.b16 $0, [$1];", "=h,l", [ZE + base + tc * NG + g],
                                           dtype=tl.float16, is_pure=True, pack=1).to(tl.float32)
        else:
            ze = sc * (-ZC)
    else:
        valid = tok < end
        sc = tl.load(SC + base + tok * NG + g, mask=valid, other=0.0).to(tl.float32)
        if ZC == 0.0:
            ze = tl.load(ZE + base + tok * NG + g, mask=valid, other=0.0).to(tl.float32)
        else:
            ze = sc * (-ZC)
    return sc, ze


@triton.jit
def _pv(vt, pv, P_HILO: tl.constexpr):
    """V'^T [NW, GV, BTW] fp16 @ (p * v_scale) [NW, BTW, HP] fp32 -> [NW, GV, HP] fp32. The fp32
    operand is rounded to fp16 (2**-12 relative), or split hi + lo (two MMAs, ~2**-22)."""
    ph = pv.to(tl.float16)
    r = tl.dot(vt, ph)
    if P_HILO:
        r = tl.dot(vt, (pv - ph.to(tl.float32)).to(tl.float16), r)
    return r


@triton.jit
def _mid_block(t0, end, kw_base, vw_base, qk0, qk1, ql0, ql1, c20, c21, ks_mul,
               ks0, kz0, ks1, kz1, vs0, vz0, vs1, vz1,
               m_i, l_v, o0, o1, lz0, lz1,
               NW: tl.constexpr, BTW: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr,
               SK: tl.constexpr, SV: tl.constexpr, GK: tl.constexpr, GV: tl.constexpr,
               NGK: tl.constexpr, NGV: tl.constexpr, NPK: tl.constexpr, NPV: tl.constexpr,
               WK: tl.constexpr, WV: tl.constexpr, USE_PRMT: tl.constexpr, Q_LO: tl.constexpr,
               P_HILO: tl.constexpr, V_CENTER: tl.constexpr, PV_FRESH: tl.constexpr, MASK: tl.constexpr):
    """One block of NW*BTW middle-tier tokens from t0 (warp w takes [t0 + w*BTW, +BTW)): scores,
    per-warp online softmax, value accumulation. MASK: the block may reach past `end` (the tail);
    full blocks skip every bound check. Scales/zeros come in (prefetched). Returns the updated
    (m_i, l_v, o0, o1, lz0, lz1)."""
    tok = t0 + tl.arange(0, NW)[:, None] * BTW + tl.arange(0, BTW)[None, :]  # [NW, BTW]
    valid = tok < end
    # ---- scores [NW, BTW, HP]: rows of packed codes are contiguous (token stride SK bytes) ----
    koff = tok[:, :, None] * (SK // 4) + tl.arange(0, WK)[None, None, :]
    if MASK:
        w_k0 = tl.load(kw_base + koff, mask=valid[:, :, None], other=0)
    else:
        w_k0 = tl.load(kw_base + koff)
    kk0 = _k_group(w_k0, KBITS, 0, NPK)
    a0 = tl.dot(kk0, qk0)
    if Q_LO:  # fp32 q: its fp16 rounding error goes through a second MMA
        a0 = tl.dot(kk0, ql0, a0)
    s = (ks0 * ks_mul)[:, :, None] * a0 + kz0[:, :, None] * c20[None, None, :]
    if NGK == 2:
        if SK <= GK:
            w_k1 = w_k0
        else:
            if MASK:
                w_k1 = tl.load(kw_base + koff + WK, mask=valid[:, :, None], other=0)
            else:
                w_k1 = tl.load(kw_base + koff + WK)
        kk1 = _k_group(w_k1, KBITS, NPK if SK <= GK else 0, NPK)
        a1 = tl.dot(kk1, qk1)
        if Q_LO:
            a1 = tl.dot(kk1, ql1, a1)
        s += (ks1 * ks_mul)[:, :, None] * a1 + kz1[:, :, None] * c21[None, None, :]
    if MASK:
        s = tl.where(valid[:, :, None], s, float("-inf"))
    # ---- online softmax per warp; row sums deferred to the end (no per-block reduction) ----
    m_new = tl.maximum(m_i, tl.max(s, 1))  # [NW, HP]
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a warp may have no valid token yet
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None, :])
    l_v = l_v * alpha[:, None, :] + p
    # ---- values: O^T[dims, heads] += V'^T[dims, tokens] @ (p * v_scale)[tokens, heads] ----
    voff = tok[:, None, :] * (SV // 4) + tl.arange(0, WV)[None, :, None]  # [NW, WV, BTW]
    if MASK:
        w_v0 = tl.load(vw_base + voff, mask=valid[:, None, :], other=0)
    else:
        w_v0 = tl.load(vw_base + voff)
    vt0 = _v_group(w_v0, WV, BTW, VBITS, 0, NPV, USE_PRMT, V_CENTER)
    # The block's product starts from zero and is folded in with one FMA: the MMA accumulates
    # only BTW tokens, so its truncating fp32 adds do not pile up over a long split.
    if PV_FRESH:
        # fma, not `o * alpha + dot`: Triton folds the latter into the MMA accumulator, whose
        # truncating adds of small products onto the large running sum cost accuracy at long
        # contexts; a product from zero per block, added with one round-to-nearest FFMA, does not.
        o0 = tl.fma(o0, alpha[:, None, :], _pv(vt0, p * vs0[:, :, None], P_HILO))
    else:
        o0 = o0 * alpha[:, None, :] + _pv(vt0, p * vs0[:, :, None], P_HILO)
    if V_CENTER:  # the value at code 2**(BITS-1): what the centred codes are measured from
        vz0 = vz0 + vs0 * (1 << (VBITS - 1))
    lz0 = lz0 * alpha[:, None, :] + p * vz0[:, :, None]
    if NGV == 2:
        if SV <= GV:
            w_v1 = w_v0
        else:
            if MASK:
                w_v1 = tl.load(vw_base + voff + WV, mask=valid[:, None, :], other=0)
            else:
                w_v1 = tl.load(vw_base + voff + WV)
        vt1 = _v_group(w_v1, WV, BTW, VBITS, NPV if SV <= GV else 0, NPV, USE_PRMT, V_CENTER)
        if PV_FRESH:
            o1 = tl.fma(o1, alpha[:, None, :], _pv(vt1, p * vs1[:, :, None], P_HILO))
        else:
            o1 = o1 * alpha[:, None, :] + _pv(vt1, p * vs1[:, :, None], P_HILO)
        if V_CENTER:
            vz1 = vz1 + vs1 * (1 << (VBITS - 1))
        lz1 = lz1 * alpha[:, None, :] + p * vz1[:, :, None]
    return m_new, l_v, o0, o1, lz0, lz1


# The split arguments are not specialised (divisibility, == 1): the occupancy probe (DeviceInfo.blocks_per_sm)
# compiles with placeholder values and must get the very kernel the launch uses (same SASS loop).
@triton.jit(do_not_specialize=["split_tokens", "NSM", "NSPLIT"])
def _stage1(
    Q, sqb, sqh,
    KW, skb, skh, KS, KZ, sksb, sksh,
    VW, svb, svh, VS, VZ, svsb, svsh,
    MID_LEN,
    SKK, SKV, sskb, sskh, sskt, ssvb, ssvh, ssvt, SINK_LEN,
    RKK, RKV, srkb, srkh, srkt, srvb, srvh, srvt, REC_LEN,
    OP, LSE,
    qk_scale, split_tokens, NSM, NSPLIT,
    G: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    KBITS: tl.constexpr, VBITS: tl.constexpr, GK: tl.constexpr, GV: tl.constexpr,
    NW: tl.constexpr, BTW: tl.constexpr, BTD: tl.constexpr, HAS_SINK: tl.constexpr, HAS_REC: tl.constexpr,
    USE_PRMT: tl.constexpr, INTERP: tl.constexpr, Q_LO: tl.constexpr, P_HILO: tl.constexpr,
    V_CENTER: tl.constexpr, PV_FRESH: tl.constexpr, SZ_DIRECT: tl.constexpr,
    MID_ITERS: tl.constexpr, SINK_ITERS: tl.constexpr, REC_ITERS: tl.constexpr,
    KZC: tl.constexpr = 0.0, VZC: tl.constexpr = 0.0, KSF: tl.constexpr = 0, VSF: tl.constexpr = 0,
):
    split = tl.program_id(0)
    kvh = tl.program_id(1)
    b = tl.program_id(2)
    hq = tl.arange(0, HP)
    hvalid = hq < G
    head = kvh * G + hq  # q heads of this KV head (never crosses into the next group)
    q_base = Q + b.to(tl.int64) * sqb + head * sqh  # [HP] pointers
    o_rows = (b.to(tl.int64) * (G * tl.num_programs(1)) + head) * NSPLIT + split  # [HP] -> row of OP/LSE

    if split < NSM:
        # ---------------- packed middle tier ----------------
        SK: tl.constexpr = D * KBITS // 8  # bytes per token row
        SV: tl.constexpr = DV * VBITS // 8
        NGK: tl.constexpr = D // GK
        NGV: tl.constexpr = DV // GV
        # K group g = positions [g*NPK, (g+1)*NPK) of the row (S <= group), or word range g (S > group)
        NPK: tl.constexpr = GK // SK if SK <= GK else 1
        WK: tl.constexpr = (SK if SK <= GK else GK) // 4  # noqa: FURB136 (constexpr arithmetic)
        NPV: tl.constexpr = GV // SV if SV <= GV else 1
        WV: tl.constexpr = (SV if SV <= GV else GV) // 4  # noqa: FURB136
        BT: tl.constexpr = NW * BTW

        L = tl.load(MID_LEN + b)
        start = split * split_tokens
        end = tl.minimum(start + split_tokens, L)

        # q^T per K group, rows in _k_group's column order, times 2**-(bit offset of that dim's code)
        # (exact in fp16), and sum_d q_d for the zero term; sm_scale*log2(e) applied in fp32.
        dk0 = _k_dims(GK, SK, 0)
        q0 = tl.load(q_base[None, :] + dk0[:, None], mask=hvalid[None, :], other=0.0).to(tl.float32)
        qs0 = q0 * tl.exp2(-((dk0 // SK) * KBITS).to(tl.float32))[:, None]
        qk0 = qs0.to(tl.float16)
        ql0 = tl.broadcast_to((qs0 - qk0.to(tl.float32)).to(tl.float16)[None, :, :], (NW, GK, HP))
        qk0 = tl.broadcast_to(qk0[None, :, :], (NW, GK, HP))
        c20 = tl.sum(q0, 0) * qk_scale  # [HP]
        if NGK == 2:
            dk1 = _k_dims(GK, SK, 1)
            q1 = tl.load(q_base[None, :] + dk1[:, None], mask=hvalid[None, :], other=0.0).to(tl.float32)
            qs1 = q1 * tl.exp2(-((dk1 // SK) * KBITS).to(tl.float32))[:, None]
            qk1 = qs1.to(tl.float16)
            ql1 = tl.broadcast_to((qs1 - qk1.to(tl.float32)).to(tl.float16)[None, :, :], (NW, GK, HP))
            qk1 = tl.broadcast_to(qk1[None, :, :], (NW, GK, HP))
            c21 = tl.sum(q1, 0) * qk_scale
        else:
            qk1 = qk0  # placeholders (one K group)
            ql1 = ql0
            c21 = c20
        ks_mul = qk_scale * 16777216.0  # 2**24 undoes the subnormal scale of the codes

        m_i = tl.full([NW, HP], float("-inf"), tl.float32)
        l_v = tl.zeros([NW, BTW, HP], tl.float32)
        o0 = tl.zeros([NW, GV, HP], tl.float32)
        o1 = tl.zeros([NW, GV, HP], tl.float32)
        lz0 = tl.zeros([NW, BTW, HP], tl.float32)
        lz1 = tl.zeros([NW, BTW, HP], tl.float32)

        # 64-bit base of this (sequence, KV head); 32-bit offsets inside it (checked by the wrapper)
        kw_base = KW + b.to(tl.int64) * skb + kvh.to(tl.int64) * skh
        vw_base = VW + b.to(tl.int64) * svb + kvh.to(tl.int64) * svh
        ks_base = b.to(tl.int64) * sksb + kvh.to(tl.int64) * sksh
        vs_base = b.to(tl.int64) * svsb + kvh.to(tl.int64) * svsh
        if INTERP:
            for it in range(MID_ITERS):  # constexpr trip count: see _dense_tier
                t0 = start + it * BT
                if t0 < end:
                    ks0, kz0 = _load_sz(KS, KZ, ks_base, t0, end, 0, NGK, NW, BTW, ZC=KZC, SF=KSF)
                    vs0, vz0 = _load_sz(VS, VZ, vs_base, t0, end, 0, NGV, NW, BTW, ZC=VZC, SF=VSF)
                    ks1, kz1 = _load_sz(KS, KZ, ks_base, t0, end, NGK - 1, NGK, NW, BTW, ZC=KZC, SF=KSF)
                    vs1, vz1 = _load_sz(VS, VZ, vs_base, t0, end, NGV - 1, NGV, NW, BTW, ZC=VZC, SF=VSF)
                    m_i, l_v, o0, o1, lz0, lz1 = _mid_block(
                        t0, end, kw_base, vw_base, qk0, qk1, ql0, ql1, c20, c21, ks_mul,
                        ks0, kz0, ks1, kz1, vs0, vz0, vs1, vz1, m_i, l_v, o0, o1, lz0, lz1,
                        NW, BTW, KBITS, VBITS, SK, SV, GK, GV, NGK, NGV, NPK, NPV, WK, WV, USE_PRMT, Q_LO, P_HILO, V_CENTER, PV_FRESH, True)
        else:
            # scales/zeros are 2-byte loads the pipeliner does not stage: prefetch one block ahead
            ks0, kz0 = _load_sz(KS, KZ, ks_base, start, end, 0, NGK, NW, BTW, SZ_DIRECT, ZC=KZC, SF=KSF)
            vs0, vz0 = _load_sz(VS, VZ, vs_base, start, end, 0, NGV, NW, BTW, SZ_DIRECT, ZC=VZC, SF=VSF)
            if NGK == 2:
                ks1, kz1 = _load_sz(KS, KZ, ks_base, start, end, 1, NGK, NW, BTW, SZ_DIRECT, ZC=KZC, SF=KSF)
            else:
                ks1, kz1 = ks0, kz0
            if NGV == 2:
                vs1, vz1 = _load_sz(VS, VZ, vs_base, start, end, 1, NGV, NW, BTW, SZ_DIRECT, ZC=VZC, SF=VSF)
            else:
                vs1, vz1 = vs0, vz0
            # full blocks without bound checks, then one masked tail block
            full_end = start + (tl.maximum(end - start, 0) // BT) * BT
            for t0 in range(start, full_end, BT):
                nks0, nkz0 = _load_sz(KS, KZ, ks_base, t0 + BT, end, 0, NGK, NW, BTW, SZ_DIRECT, ZC=KZC, SF=KSF)
                nvs0, nvz0 = _load_sz(VS, VZ, vs_base, t0 + BT, end, 0, NGV, NW, BTW, SZ_DIRECT, ZC=VZC, SF=VSF)
                if NGK == 2:
                    nks1, nkz1 = _load_sz(KS, KZ, ks_base, t0 + BT, end, 1, NGK, NW, BTW, SZ_DIRECT, ZC=KZC, SF=KSF)
                else:
                    nks1, nkz1 = nks0, nkz0
                if NGV == 2:
                    nvs1, nvz1 = _load_sz(VS, VZ, vs_base, t0 + BT, end, 1, NGV, NW, BTW, SZ_DIRECT, ZC=VZC, SF=VSF)
                else:
                    nvs1, nvz1 = nvs0, nvz0
                m_i, l_v, o0, o1, lz0, lz1 = _mid_block(
                    t0, end, kw_base, vw_base, qk0, qk1, ql0, ql1, c20, c21, ks_mul,
                    ks0, kz0, ks1, kz1, vs0, vz0, vs1, vz1, m_i, l_v, o0, o1, lz0, lz1,
                    NW, BTW, KBITS, VBITS, SK, SV, GK, GV, NGK, NGV, NPK, NPV, WK, WV, USE_PRMT, Q_LO, P_HILO,
                    V_CENTER, PV_FRESH, False)
                ks0, kz0, ks1, kz1 = nks0, nkz0, nks1, nkz1
                vs0, vz0, vs1, vz1 = nvs0, nvz0, nvs1, nvz1
            if full_end < end:
                m_i, l_v, o0, o1, lz0, lz1 = _mid_block(
                    full_end, end, kw_base, vw_base, qk0, qk1, ql0, ql1, c20, c21, ks_mul,
                    ks0, kz0, ks1, kz1, vs0, vz0, vs1, vz1, m_i, l_v, o0, o1, lz0, lz1,
                    NW, BTW, KBITS, VBITS, SK, SV, GK, GV, NGK, NGV, NPK, NPV, WK, WV, USE_PRMT, Q_LO, P_HILO,
                    V_CENTER, PV_FRESH, True)

        # ---- merge the warps (once per program) ----
        mx = tl.max(m_i, 0)  # [HP]
        mx = tl.where(mx == float("-inf"), 0.0, mx)
        f = tl.exp2(m_i - mx[None, :])  # [NW, HP]; 0 for a warp that saw no token
        l_i = tl.sum(tl.sum(l_v, 1) * f, 0)
        inv_l = tl.where(l_i > 0, 1.0 / l_i, 0.0)
        lse = tl.where(l_i > 0, mx + tl.log2(l_i), float("-inf"))
        tl.store(LSE + o_rows, lse, mask=hvalid)
        # rows of o0/o1 -> dims, and the 2**(24 - bit offset) that undoes the subnormal code scale
        SBV: tl.constexpr = SV if SV <= GV else 0
        dr, ir = _v_rows(GV, WV, NPV, SBV)
        z0 = tl.sum(tl.sum(lz0, 1) * f, 0) * inv_l
        f0 = tl.exp2((24 - ir * VBITS).to(tl.float32))
        out0 = tl.sum(o0 * f[:, None, :], 0) * f0[:, None] * inv_l[None, :] + z0[None, :]
        tl.store(OP + o_rows[None, :] * DV + dr[:, None], out0, mask=hvalid[None, :])
        if NGV == 2:
            i1 = ir + NPV if SV <= GV else ir
            z1 = tl.sum(tl.sum(lz1, 1) * f, 0) * inv_l
            f1 = tl.exp2((24 - i1 * VBITS).to(tl.float32))
            out1 = tl.sum(o1 * f[:, None, :], 0) * f1[:, None] * inv_l[None, :] + z1[None, :]
            tl.store(OP + o_rows[None, :] * DV + (GV + dr)[:, None], out1, mask=hvalid[None, :])
    else:
        # ---------------- dense tiers (sink, recent) in the last split ----------------
        dd = tl.arange(0, D)
        q_t = tl.load(q_base[None, :] + dd[:, None], mask=hvalid[None, :], other=0.0).to(tl.float32) * qk_scale
        dense_split(q_t, b, kvh, SKK, SKV, sskb, sskh, sskt, ssvb, ssvh, ssvt, SINK_LEN,
                     RKK, RKV, srkb, srkh, srkt, srvb, srvh, srvt, REC_LEN, OP, LSE, o_rows, hvalid,
                     HP, BTD, D, DV, HAS_SINK, HAS_REC, INTERP, SINK_ITERS, REC_ITERS)


# ----------------------------------------------------------------------------------------------
# Stage 2: log-sum-exp merge of the splits
# ----------------------------------------------------------------------------------------------
# ----------------------------------------------------------------------------------------------
# Python wrapper
# ----------------------------------------------------------------------------------------------
# Launch defaults per regime, measured on an H200 (docs/DESIGN_NOTES.md, results/kernels/).
DEFAULTS = {
    # many pairs (>= 64, B8+ at 8 KV heads), head_dim <= 128, codes of <= 4 bits: two-warp programs of 32
    # tokens per warp, registers capped at 168, the split count picked with the dense-tier programs counted
    # in the waves. Measured inside the runtime's cache with the sink 64 + recent 256 dense tiers
    # (benchmarks/kernel_in_step_probe.py --sweep, H200 2026-12-01, L32k int2): B16 11 splits 0.137 ms vs
    # 0.191 ms for the earlier one-warp x 64-token programs (run 6; 6 splits), B64 0.493 vs 0.786 ms. int8
    # and head_dim 256 spill far more with the register cap (B64 gemma int4 2.0 vs 0.77 ms): they keep "many".
    "many_lowbit": {"num_warps": 2, "warp_tokens": 32, "num_stages": 3, "maxnreg": 168, "dense_in_waves": True},
    "many": {"num_warps": 4, "warp_tokens": 32, "num_stages": 4, "maxnreg": None},
    # few pairs (B1-B4 at 8 KV heads): two-warp programs of 32 tokens per warp. Inside the runtime's cache
    # (sink 64 + recent 256, int2, H200, kernel_in_step_probe.py --sweep, 2026-12-01) at B1: L4k 10.6 vs
    # 13.7 us for one warp x 64 tokens, L32k 17.0 vs 17.1, L128k 42.0 vs 48.5 (the split pick's own counts)
    "few": {"num_warps": 2, "warp_tokens": 32, "num_stages": 3, "maxnreg": None},
    "wide": {"num_warps": 1, "warp_tokens": 32, "num_stages": 3, "maxnreg": None},
}


@dataclass(frozen=True)
class KernelConfig:
    """Launch choices; None = chosen from the shape (see `resolve`, measured on an H200).

    warp_tokens: middle-tier tokens each warp takes per loop step (a step is num_warps *
    warp_tokens tokens); num_splits: middle-tier splits per (sequence, KV head); num_warps /
    num_stages / maxnreg: Triton's; dense_block: tokens per step on the dense tiers.
    Precision of the PV product (docs/DESIGN_NOTES.md): v_center subtracts the mid code so the MMA
    does not accumulate a large positive sum that later cancels against the zero term (needed for
    1e-3 at 128k tokens); p_hilo splits the operand p * v_scale into two fp16 parts."""

    warp_tokens: int | None = None
    num_splits: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    dense_block: int = 32
    maxnreg: int | None = None
    p_hilo: bool = False
    v_center: bool = True
    pv_fresh: bool = False
    sz_direct: bool = False
    dense_in_waves: bool | None = None  # count the dense-tier programs in the split pick (pick_num_splits)

    def resolve(self, batch: int, kv_heads: int, head_dim: int, bits: int = 8) -> KernelConfig:
        """Fill the None fields from DEFAULTS: "many" (sequence, KV head) pairs (>= 64, e.g. B16 with
        8 KV heads; "many_lowbit" when head_dim <= 128 and `bits`, the wider of K/V, <= 4), "few"
        (long contexts of few sequences: more, smaller programs), "wide" (few pairs, head_dim 256)."""
        regime = "many" if batch * kv_heads >= 64 else ("wide" if head_dim > 128 else "few")
        if regime == "many" and head_dim <= 128 and bits <= 4:
            regime = "many_lowbit"
        d = DEFAULTS[regime]
        return KernelConfig(warp_tokens=self.warp_tokens or d["warp_tokens"], num_splits=self.num_splits,
                            num_warps=self.num_warps or d["num_warps"], num_stages=self.num_stages or d["num_stages"],
                            dense_block=self.dense_block, maxnreg=self.maxnreg or d["maxnreg"], p_hilo=self.p_hilo,
                            v_center=self.v_center, pv_fresh=self.pv_fresh,
                            sz_direct=self.sz_direct,
                            dense_in_waves=(d.get("dense_in_waves", False) if self.dense_in_waves is None
                                            else self.dense_in_waves))

    @property
    def block_t(self) -> int:
        return (self.warp_tokens or 32) * (self.num_warps or 4)


_PROGRAMS_PER_SM = {1: 8, 2: 6, 4: 5, 8: 3}  # fallback when occupancy is unknown (docs/DESIGN_NOTES.md)


@dataclass(frozen=True)
class Launch:
    """What one decode_attention call launched (`return_launch=True` returns it with the output):
    middle-tier splits per (sequence, KV head), the stage-1 grid (splits + dense?, Hkv, B), middle
    tokens per split, the resolved launch config, resident programs per SM used to pick the splits
    (None: the fixed rule, or splits given), and the mode: "interpreter" (CPU tensors through
    Triton's interpreter) or "compiled" (CUDA)."""

    num_splits: int
    grid: tuple[int, int, int]
    split_tokens: int
    config: KernelConfig
    blocks_per_sm: int | None
    mode: str


def pick_num_splits(batch: int, kv_heads: int, max_tokens: int, block_t: int, sms: int = 132,
                    num_warps: int = 4, blocks_per_sm: int | None = None, dense_programs: int = 0) -> int:
    """Splits per (sequence, KV head), at most 256 and at least 8 blocks of tokens each.

    At least 8 blocks: inside the runtime step at B1 L32k int2 (sink 64 + recent 256; H200,
    benchmarks/kernel_in_step_probe.py --sweep, 2026-12-01) 64 splits of 8 blocks ran 17.1 us against
    20.0 us for the 128 splits of 4 blocks the waves rule picks (both fit one wave: more, shorter programs
    only add merge work and program starts).

    With `blocks_per_sm` (programs of this kernel resident per SM, from its registers and shared
    memory): the split count that minimises waves x program length, so the programs fill the
    resident slots in nearly whole waves -- measured on an H200 (run 5): B16 L32k int2 3 splits (384 programs in
    396 slots) 0.129 ms vs 4 splits (1.3 waves) 0.156 and 6 (1.94 waves) 0.136; B1 L128k 132 splits
    (1 wave) 0.042 ms vs 176 (1.3 waves) 0.058 and 264 (2 waves) 0.055. Without: a fixed number of
    programs per SM by warps per program (run 2).

    dense_programs: programs per pair beside the splits (the dense-tier program: 1 when the call has a
    sink or recent tier). They take resident slots too: inside the runtime step (B16 L32k int2, sink 64 +
    recent 256) 6 splits + the dense program (896 programs in 792 slots) ran 190 us against 122 us for
    the same 6 splits without the dense tiers, the middle programs left for a second wave waiting on dense
    programs slowed by the loaded memory system (benchmarks/kernel_in_step_probe.py, H200 2026-12-01)."""
    if max_tokens <= 0:
        return 1
    pairs = max(1, batch * kv_heads)
    most = int(max(1, min(256, math.ceil(max_tokens / (8 * block_t)))))
    if not blocks_per_sm:
        want = max(1, math.ceil(_PROGRAMS_PER_SM.get(num_warps, 4) * sms / pairs))
        return int(min(want, most))
    # time ~ waves x (blocks per split + a fixed cost per program of ~4 blocks: pipeline fill, q
    # load, epilogue); fewest splits on a tie (less to merge)
    cap = sms * blocks_per_sm
    blocks = math.ceil(max_tokens / block_t)
    best, best_t = 1, float("inf")
    for s in range(1, most + 1):
        t = math.ceil((s + dense_programs) * pairs / cap) * (math.ceil(blocks / s) + 4)
        if t < best_t:
            best, best_t = s, t
    return best


def _probe_blocks_per_sm(dev: torch.device, consts: dict, probe_args) -> int | None:
    """Programs of the stage-1 kernel resident per SM, from the compiled kernel's registers (per
    sub-partition: 16384 registers, allocated per warp in units of 8 per thread) and shared memory.
    Compiles (or finds) the kernel with placeholder split arguments; None if that fails.
    Cached per device and kernel variant by DeviceInfo.blocks_per_sm."""
    try:
        part = torch.empty(16, dtype=torch.float32, device=dev)
        k = _stage1.warmup(*probe_args(part, part), grid=(1, 1, 1), MID_ITERS=0, **consts)
        k = k.result() if hasattr(k, "result") else k
        k._init_handles()
        regs = max(1, int(k.n_regs))
        nw = int(consts["num_warps"])
        per_sub = 16384 // (32 * ((regs + 7) // 8 * 8))  # warps per scheduler by registers
        by_regs = (4 * per_sub) // nw if nw <= 4 else per_sub // ((nw + 3) // 4)
        smem = int(k.metadata.shared) + 1024
        by_smem = (228 * 1024) // smem
        occ = int(max(1, min(32, 64 // nw, by_regs, by_smem)))
    except Exception as e:  # noqa: BLE001  (a heuristic: fall back to the fixed programs per SM)
        import logging

        logging.getLogger(__name__).info("decode_attention: occupancy probe failed (%r); fixed split rule", e)
        occ = None
    return occ


def centred_zero(scale, zero, centre, what: str):
    """(the zero pointer to pass, ZC): (zero, 0.0) for stored zeros; (scale, centre) for scale-only groups,
    whose zero = -centre * scale is computed in the kernel (the scale tensor only fills the unread slot)."""
    if zero is None:
        if centre is None or not float(centre) > 0:
            raise LowbitError(f"{what}: no zero given; pass the zero tensor, or the centre code (e.g. 1.5 at 2 bits) "
                              "for scale-only groups")
        return scale, float(centre)
    if centre is not None:
        raise LowbitError(f"{what}: give a zero tensor or a centre (scale-only groups), not both")
    return zero, 0.0


def _check_codes(codes, scale, zero, bits, B, Hkv, D, device, what):
    if bits not in (2, 4, 8):
        raise LowbitError(f"{what}: {bits}-bit codes are not supported by the kernel; use 2, 4 or 8")
    ng = check_packed_tier(codes, scale, zero, bits, B, Hkv, D, device, what, one_byte_scales=True)
    S = D * bits // 8
    if ng not in (1, 2) or D % ng:
        raise LowbitError(f"{what}: {ng} groups per head; the kernel takes group = D or D/2 (D={D})")
    grp = D // ng
    if grp < 16 or grp & (grp - 1) or (S % grp and grp % S) or min(S, grp) < 16:
        raise LowbitError(f"{what}: group {grp} with D={D} at {bits} bits is not a supported tiling")
    return grp


def decode_attention(
    q: torch.Tensor,
    k_codes: torch.Tensor | None,
    k_scale: torch.Tensor | None,
    k_zero: torch.Tensor | None,
    v_codes: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    v_zero: torch.Tensor | None,
    mid_lens: torch.Tensor | int | None = None,
    *,
    k_bits: int = 2,
    v_bits: int = 2,
    sm_scale: float | None = None,
    sink_k: torch.Tensor | None = None,
    sink_v: torch.Tensor | None = None,
    sink_lens: torch.Tensor | int | None = None,
    recent_k: torch.Tensor | None = None,
    recent_v: torch.Tensor | None = None,
    recent_lens: torch.Tensor | int | None = None,
    config: KernelConfig | None = None,
    out: torch.Tensor | None = None,
    return_launch: bool = False,
    k_centre: float | None = None,
    v_centre: float | None = None,
) -> torch.Tensor | tuple[torch.Tensor, Launch]:
    """Attention of one query token per sequence over the sink / packed middle / recent tiers.

    q        [B, Hq, D] (bf16/fp16/fp32); Hq = G * Hkv, q head h reads KV head h // G.
    k_codes  uint8 [B, Hkv, T, D*k_bits/8], strided packing (lowbit.quant.packing); any strides
             with a contiguous, 4-byte-aligned last dim (a preallocated cache view works).
    k_scale, k_zero  fp16 [B, Hkv, T, D/group], group in {D, D/2}; x = codes * scale + zero.
    v_codes, v_scale, v_zero  likewise with Dv and v_bits (k4v2 is fine).
    k_centre / v_centre  scale-only groups (lowbit.kv.codec, zero "none"): pass k_zero=None and the centre
             code mid = (2**bits - 1) / 2; the kernel reads no zero and uses zero = -mid * scale.
             Their scale may be uint8 [B, Hkv, T, D/group]: one-byte UE5M3 codes (scale_format "ue5m3",
             lowbit.quant.scale_format), decoded exactly in the kernel.
    mid_lens int32 [B] (or int): valid middle slots [0, mid_lens[b]). Pass k_codes=None for no middle.
    sink_k/sink_v, recent_k/recent_v  [B, Hkv, N, D] / [B, Hkv, N, Dv] dense tiers (any float dtype),
             valid slots [0, *valid_lens[b]) (default: all N).
    sm_scale softmax scale (default 1/sqrt(D)).
    Returns [B, Hq, Dv] in q's dtype (or writes into `out`). A sequence with no valid token gets 0;
    with return_launch, (out, Launch): what this call launched (the caller owns the record).
    CPU tensors run through the Triton interpreter (TRITON_INTERPRET=1 must be set before import);
    see `interpreted`.
    """
    cfg = config or KernelConfig()
    check_mode(q.device)
    if q.dim() != 3:
        raise LowbitError(f"q must be [B, Hq, D], got {tuple(q.shape)}")
    if q.stride(-1) != 1:
        raise LowbitError("q needs a contiguous last dim; call .contiguous()")
    B, Hq, D = q.shape
    dev = q.device
    kzc = vzc = 0.0
    ksf = vsf = 0  # 1: uint8 UE5M3 scale codes (lowbit.quant.scale_format)
    if k_codes is not None:  # scale-only groups: the scale stands in for the zero pointer (never read)
        k_zero, kzc = centred_zero(k_scale, k_zero, k_centre, "K middle")
        v_zero, vzc = centred_zero(v_scale, v_zero, v_centre, "V middle")
        ksf, vsf = int(k_scale.dtype == torch.uint8), int(v_scale.dtype == torch.uint8)
    has_mid, Hkv, DV = tier_heads(Hq, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, v_bits,
                                  sink_k, sink_v, recent_k, recent_v)
    if (kzc or vzc) and (D not in (64, 128, 256) or DV not in (64, 128, 256)):
        raise LowbitError(f"scale-only middle groups (k_centre/v_centre) are read by the head_dim 64/128/256 "
                          f"kernel only, not at D={D}/Dv={DV}; store a zero per group or use the torch path")
    if D not in (64, 128, 256) or DV not in (64, 128, 256):
        # other head dims (K192/V128, 512, ...): the chunked geometry kernel, same tiers and arguments
        return decode_attention_geo(
            q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, mid_lens, k_bits=k_bits, v_bits=v_bits,
            sm_scale=sm_scale, sink_k=sink_k, sink_v=sink_v, sink_lens=sink_lens, recent_k=recent_k,
            recent_v=recent_v, recent_lens=recent_lens, config=config if isinstance(config, GeoConfig) else None,
            out=out, return_launch=return_launch)
    G = Hq // Hkv
    HP = max(8, pow2(G))
    cfg = cfg.resolve(B, Hkv, D, max(k_bits, v_bits) if has_mid else 8)
    BTW, NW, BTD = int(cfg.warp_tokens), int(cfg.num_warps), int(cfg.dense_block)
    for name, v in (("warp_tokens", BTW), ("num_warps", NW), ("dense_block", BTD)):
        if v < 1 or v & (v - 1) or (name != "num_warps" and v < 16):
            raise LowbitError(f"{name} must be a power of two{' >= 16' if name != 'num_warps' else ''}, got {v}")
    BT = BTW * NW

    if has_mid:
        GK = _check_codes(k_codes, k_scale, k_zero, k_bits, B, Hkv, D, dev, "K middle")
        GV = _check_codes(v_codes, v_scale, v_zero, v_bits, B, Hkv, DV, dev, "V middle")
        if v_codes.shape[2] != k_codes.shape[2]:
            raise LowbitError("K and V middle tiers must have the same number of slots T")
        T = k_codes.shape[2]
        mid_lens = valid_lens(T if mid_lens is None else mid_lens, B, dev, "mid_lens")
        kw = k_codes.view(torch.int32)
        vw = v_codes.view(torch.int32)
    else:
        # no middle tier: the middle path is compiled against typed dummies and never runs (NSM=0)
        GK, GV, T = D, DV, 0
        kw = vw = torch.zeros(1, dtype=torch.int32, device=dev)
        k_scale = k_zero = v_scale = v_zero = torch.zeros(1, dtype=torch.float16, device=dev)
        mid_lens = torch.zeros(B, dtype=torch.int32, device=dev)
    sk, sv, sl = check_dense(sink_k, sink_v, sink_lens, B, Hkv, D, DV, dev, "sink")
    rk, rv, rl = check_dense(recent_k, recent_v, recent_lens, B, Hkv, D, DV, dev, "recent")
    has_sink, has_rec = sk is not None, rk is not None
    dummy_len = mid_lens
    sk, sv, sl = (sk, sv, sl) if has_sink else (q[:, None], q[:, None], dummy_len)
    rk, rv, rl = (rk, rv, rl) if has_rec else (q[:, None], q[:, None], dummy_len)

    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(D)
    interp = dev.type != "cuda"  # CPU tensors: the Triton interpreter
    if out is None:
        out = torch.empty((B, Hq, DV), dtype=q.dtype, device=dev)
    elif out.shape != (B, Hq, DV) or out.stride(-1) != 1:
        raise LowbitError(f"out must be [B, Hq, Dv] = {(B, Hq, DV)} with a contiguous last dim")

    if has_mid:
        ms = (k_scale.stride(0), k_scale.stride(1))
        vms = (v_scale.stride(0), v_scale.stride(1))
        kws = (kw.stride(0), kw.stride(1))
        vws = (vw.stride(0), vw.stride(1))
    else:
        ms = vms = kws = vws = (0, 0)

    def args(part, lse, split_tokens, nsm, nsplit):
        return (q, q.stride(0), q.stride(1),
                kw, *kws, k_scale, k_zero, *ms,
                vw, *vws, v_scale, v_zero, *vms,
                mid_lens,
                sk, sv, sk.stride(0), sk.stride(1), sk.stride(2), sv.stride(0), sv.stride(1), sv.stride(2), sl,
                rk, rv, rk.stride(0), rk.stride(1), rk.stride(2), rv.stride(0), rv.stride(1), rv.stride(2), rl,
                part, lse,
                float(sm_scale) * LOG2E, int(split_tokens), nsm, nsplit)

    consts = dict(
        G=G, HP=HP, D=D, DV=DV,
        KBITS=k_bits, VBITS=v_bits, GK=GK, GV=GV, NW=NW, BTW=BTW, BTD=BTD,
        HAS_SINK=has_sink, HAS_REC=has_rec,
        USE_PRMT=(dev.type == "cuda"), INTERP=interp, Q_LO=(q.dtype == torch.float32), P_HILO=cfg.p_hilo,
        V_CENTER=cfg.v_center, PV_FRESH=cfg.pv_fresh,
        SZ_DIRECT=bool(cfg.sz_direct and has_mid and dev.type == "cuda" and T > 0),
        KZC=float(kzc), VZC=float(vzc), KSF=int(ksf), VSF=int(vsf),
        SINK_ITERS=triton.cdiv(sk.shape[2], BTD) if interp else 0,
        REC_ITERS=triton.cdiv(rk.shape[2], BTD) if interp else 0,
        num_warps=NW, num_stages=cfg.num_stages, **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}),
    )
    per_sm = None
    if has_mid:
        nsm = cfg.num_splits
        if not nsm:
            info = None if interp else device_info(cuda_index(dev))
            per_sm = None if interp else info.blocks_per_sm(consts, lambda p, l: args(p, l, BT, 2, 3),
                                                             _probe_blocks_per_sm)
            nsm = pick_num_splits(B, Hkv, T, BT, 8 if interp else info.sms, NW, blocks_per_sm=per_sm,
                                  dense_programs=int(bool(cfg.dense_in_waves) and (has_sink or has_rec)))
        nsm = max(1, int(nsm))
        split_tokens = max(BT, math.ceil(max(T, 1) / nsm / BT) * BT)
        nsm = max(1, math.ceil(max(T, 1) / split_tokens))
    else:
        nsm, split_tokens = 0, BT
    nsplit = nsm + (1 if (has_sink or has_rec) else 0)
    launch = Launch(num_splits=nsm, grid=(nsplit, Hkv, B), split_tokens=split_tokens, config=cfg,
                    blocks_per_sm=per_sm, mode="interpreter" if interp else "compiled")
    part = torch.empty((B, Hq, nsplit, DV), dtype=torch.float32, device=dev)
    lse = torch.empty((B, Hq, nsplit), dtype=torch.float32, device=dev)
    _stage1[(nsplit, Hkv, B)](*args(part, lse, split_tokens, nsm, nsplit),
                              MID_ITERS=(split_tokens // BT) if interp else 0, **consts)
    ch = min(32, max(16, pow2(nsplit)))
    stage2[(B, Hq)](part, lse, out, out.stride(0), out.stride(1), nsplit, NCH=triton.cdiv(nsplit, ch), CH=ch,
                     DV=DV, num_warps=4)
    return (out, launch) if return_launch else out


