"""Fused decode attention over a middle tier whose K and/or V rows are vector-quantized (lowbit.quant.vq).

    out = decode_attention_vq(q, k_mid, v_mid, mid_lens, sink_k=..., recent_k=..., sm_scale=...)   # [B, Hq, Dv]

q        [B, Hq, D] (bf16/fp16/fp32), Hq = G * Hkv; q head h reads KV head h // G.
k_mid / v_mid  MidTensor (one per tensor): the middle tier as the cache stores it (lowbit.kv.codec),
         either VQ rows  (codes uint8 [B, Hkv, T, D * bits / 8]: D / SUB indices, 4-bit "strided" packing for 16
                          entries, bytes for 256; scale [B, Hkv, T, 1]; codebook [Hkv, E, SUB] fp16)
         or scale-only scalar groups (codes [B, Hkv, T, D * bits / 8] strided packing at 2/4/8 bits; scale
                          [B, Hkv, T, D / group]; x = (code - centre) * scale), as the shipped recipes' int4 keys.
         A scale is fp16, or uint8 ue5m3 codes (lowbit.quant.scale_format). Each (sequence, head) holds its T rows
         back to back; slots [0, mid_lens[b]) are valid. Either kind may carry a 1-bit residual
         (lowbit.quant.residual): rbits uint8 [B, Hkv, T, D / 8] and rgain [B, Hkv, T, 1] (fp16 or ue5m3).
sink_k/sink_v/recent_k/recent_v  dense tiers [B, Hkv, N, D] in the model dtype with lens, as decode_attention's.

The math, per (sequence, KV head, split of the middle): a block of BT rows is decoded in registers
(K_t = s_t * codebook[idx_t], or (c - centre) * s), scored against the group's queries with one MMA,
and folded into an online softmax; V likewise into the output. A residual on K adds its sign bits times the gain
scored against q @ S.T (one more MMA); on V, p times the signed gains is summed in S's basis (a second output,
merged by the same log-sum-exp weights) and rotated back by S once after the merge. The dense tiers run in one more split
through decode_attention's own dense-tier code, and decode_attention's stage 2 merges the splits by
log-sum-exp. Twin: lowbit.kernels.attention.reference.decode_attention_vq_ref (dequantize with lowbit.quant, then a
float32 softmax attention). Shapes at odd sizes are tested against it (tests/kernels/test_decode_vq.py) and
it has an audit entry (lowbit.tools.audit.attention, kernel "decode_vq").

This is the first servable form of VQ rows: correct on the interpreter and meant for the GPU, not yet
tuned there (one MMA per block, codebook gathers through L1).
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
    dense_split,
    pow2,
    stage2,
    ue5m3,
    valid_lens,
)
from lowbit.quant.residual import basis

BT = 32  # middle rows per block
BTD = 32  # dense rows per block


@dataclass(frozen=True)
class MidTensor:
    """One tensor (K or V) of the packed middle tier, as lowbit.kv.codec stores it.

    codes uint8 [B, Hkv, T, D * bits // 8]; scale fp16 or uint8 (ue5m3) [B, Hkv, T, NG];
    VQ: codebook [Hkv, E, SUB] (bits = log2(E) / SUB, NG = 1); scalar: bits 2/4/8, centre = (2**bits - 1) / 2.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    bits: int
    codebook: torch.Tensor | None = None
    centre: float = 0.0
    rbits: torch.Tensor | None = None  # 1-bit residual (lowbit.quant.residual): sign bits uint8 [B, Hkv, T, D // 8]
    rgain: torch.Tensor | None = None  # its gain per row, fp16 or uint8 ue5m3 [B, Hkv, T, 1]

    @property
    def vq(self) -> tuple[int, int] | None:
        if self.codebook is None:
            return None
        return int(self.codebook.shape[2]), int(self.codebook.shape[1])


@triton.jit
def _mid_tile(C, S, CB, base_c, base_s, t, valid, RB: tl.constexpr, NG: tl.constexpr, D: tl.constexpr,
              VQ: tl.constexpr, SUB: tl.constexpr, E: tl.constexpr, BITS: tl.constexpr, SF: tl.constexpr,
              ZC: tl.constexpr):
    """Rows t [BT] of one middle tensor -> float32 [BT, D] (0 where not valid).

    VQ: index j = d // SUB of the row (4-bit strided: byte j % (NIDX/2), nibble j // (NIDX/2); 256 entries:
    byte j), value codebook[idx * SUB + d % SUB] * scale. Scalar: code of dim d in byte d % (D/P) at bit
    (d // (D/P)) * BITS, value (code - ZC) * scale of its group."""
    d = tl.arange(0, D)
    if VQ:
        j = d // SUB
        if E == 256:
            byte = j
            shift = j * 0
        else:
            SB: tl.constexpr = D // SUB // 2
            byte = j % SB
            shift = (j // SB) * 4
        raw = tl.load(C + base_c + t[:, None] * RB + byte[None, :], mask=valid[:, None], other=0).to(tl.int32)
        idx = (raw >> shift[None, :]) & (E - 1)
        val = tl.load(CB + idx * SUB + (d % SUB)[None, :]).to(tl.float32)
        if SF == 1:
            sc = ue5m3(tl.load(S + base_s + t, mask=valid, other=0))
        else:
            sc = tl.load(S + base_s + t, mask=valid, other=0.0).to(tl.float32)
        return val * sc[:, None]
    else:
        P: tl.constexpr = 8 // BITS
        SB2: tl.constexpr = D // P
        raw = tl.load(C + base_c + t[:, None] * RB + (d % SB2)[None, :], mask=valid[:, None], other=0).to(tl.int32)
        code = (raw >> ((d // SB2) * BITS)[None, :]) & ((1 << BITS) - 1)
        GS: tl.constexpr = D // NG
        sp = S + base_s + t[:, None] * NG + (d // GS)[None, :]
        if SF == 1:
            sc = ue5m3(tl.load(sp, mask=valid[:, None], other=0))
        else:
            sc = tl.load(sp, mask=valid[:, None], other=0.0).to(tl.float32)
        return (code.to(tl.float32) - ZC) * sc


@triton.jit
def _sign_tile(R, RG, base_r, base_g, t, valid, D: tl.constexpr, RSF: tl.constexpr):
    """The 1-bit residual of rows t [BT] -> float32 [BT, D] in its basis S: gain * (2 bit - 1), bit of dim d in
    byte d % (D / 8) at bit d // (D / 8) (strided 1-bit packing); 0 where not valid."""
    d = tl.arange(0, D)
    SB: tl.constexpr = D // 8
    raw = tl.load(R + base_r + t[:, None] * SB + (d % SB)[None, :], mask=valid[:, None], other=0).to(tl.int32)
    sgn = ((raw >> (d // SB)[None, :]) & 1).to(tl.float32) * 2.0 - 1.0
    if RSF == 1:
        g = ue5m3(tl.load(RG + base_g + t, mask=valid, other=0))
    else:
        g = tl.load(RG + base_g + t, mask=valid, other=0.0).to(tl.float32)
    return sgn * g[:, None]


@triton.jit
def _vq_block(t0, end, q_t, q2_t, m_i, l_i, o, o2,
              KC, KS, KCB, kc_base, ks_base, VC, VS, VCB, vc_base, vs_base,
              KR, KRG, kr_base, krg_base, VR, VRG, vr_base, vrg_base,
              D: tl.constexpr, DV: tl.constexpr, BLOCK: tl.constexpr,
              K_RB: tl.constexpr, K_NG: tl.constexpr, K_VQ: tl.constexpr, K_SUB: tl.constexpr, K_E: tl.constexpr,
              K_BITS: tl.constexpr, K_SF: tl.constexpr, K_ZC: tl.constexpr, K_RES: tl.constexpr, K_RSF: tl.constexpr,
              V_RB: tl.constexpr, V_NG: tl.constexpr, V_VQ: tl.constexpr, V_SUB: tl.constexpr, V_E: tl.constexpr,
              V_BITS: tl.constexpr, V_SF: tl.constexpr, V_ZC: tl.constexpr, V_RES: tl.constexpr, V_RSF: tl.constexpr):
    """One block of middle rows [t0, t0 + BLOCK) folded into (m_i [HP], l_i [HP], o [HP, DV], o2 [HP, DV]: the
    values' residual part, in its basis S)."""
    t = t0 + tl.arange(0, BLOCK)
    valid = t < end
    k = _mid_tile(KC, KS, KCB, kc_base, ks_base, t, valid, K_RB, K_NG, D, K_VQ, K_SUB, K_E, K_BITS, K_SF, K_ZC)
    s = tl.dot(k, q_t, input_precision="tf32x3")  # [BLOCK, HP], already times sm_scale * log2(e)
    if K_RES:  # q . (g s @ S) = (q @ S.T) . (g s)
        kr = _sign_tile(KR, KRG, kr_base, krg_base, t, valid, D, K_RSF)
        s = tl.dot(kr, q2_t, s, input_precision="tf32x3")
    s = tl.where(valid[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 0))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[None, :])  # [BLOCK, HP]
    v = _mid_tile(VC, VS, VCB, vc_base, vs_base, t, valid, V_RB, V_NG, DV, V_VQ, V_SUB, V_E, V_BITS, V_SF, V_ZC)
    o = tl.dot(tl.trans(p), v, o * alpha[:, None], input_precision="tf32x3")  # [HP, DV]
    if V_RES:  # sum_t p_t g_t s_t, rotated back by S once after the merge
        vr = _sign_tile(VR, VRG, vr_base, vrg_base, t, valid, DV, V_RSF)
        o2 = tl.dot(tl.trans(p), vr, o2 * alpha[:, None], input_precision="tf32x3")
    return m_new, l_i * alpha + tl.sum(p, 0), o, o2


@triton.jit(do_not_specialize=["split_tokens", "NSM", "NSPLIT"])
def _vq_stage1(
    Q, sqb, sqh, Q2,
    KC, skb, skh, KS, sksb, sksh, KCB,
    VC, svb, svh, VS, svsb, svsh, VCB,
    KR, skrb, skrh, KRG, skgb, skgh, VR, svrb, svrh, VRG, svgb, svgh,
    MID_LEN,
    SKK, SKV, sskb, sskh, sskt, ssvb, ssvh, ssvt, SINK_LEN,
    RKK, RKV, srkb, srkh, srkt, srvb, srvh, srvt, REC_LEN,
    OP, OP2, LSE,
    qk_scale, split_tokens, NSM, NSPLIT,
    G: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    K_RB: tl.constexpr, K_NG: tl.constexpr, K_VQ: tl.constexpr, K_SUB: tl.constexpr, K_E: tl.constexpr,
    K_BITS: tl.constexpr, K_SF: tl.constexpr, K_ZC: tl.constexpr, K_RES: tl.constexpr, K_RSF: tl.constexpr,
    V_RB: tl.constexpr, V_NG: tl.constexpr, V_VQ: tl.constexpr, V_SUB: tl.constexpr, V_E: tl.constexpr,
    V_BITS: tl.constexpr, V_SF: tl.constexpr, V_ZC: tl.constexpr, V_RES: tl.constexpr, V_RSF: tl.constexpr,
    BLOCK: tl.constexpr, BTD_: tl.constexpr, HAS_SINK: tl.constexpr, HAS_REC: tl.constexpr, INTERP: tl.constexpr,
    MID_ITERS: tl.constexpr, SINK_ITERS: tl.constexpr, REC_ITERS: tl.constexpr,
):
    split = tl.program_id(0)
    kvh = tl.program_id(1)
    b = tl.program_id(2)
    hq = tl.arange(0, HP)
    hvalid = hq < G
    head = kvh * G + hq
    q_base = Q + b.to(tl.int64) * sqb + head * sqh  # [HP]
    o_rows = (b.to(tl.int64) * (G * tl.num_programs(1)) + head) * NSPLIT + split
    dd = tl.arange(0, D)
    q_t = tl.load(q_base[None, :] + dd[:, None], mask=hvalid[None, :], other=0.0).to(tl.float32) * qk_scale
    if K_RES:  # the query in the residual's basis, q @ S.T: float32 [B, Hq, D] contiguous
        q2_base = Q2 + (b.to(tl.int64) * (G * tl.num_programs(1)) + head) * D
        q2_t = tl.load(q2_base[None, :] + dd[:, None], mask=hvalid[None, :], other=0.0) * qk_scale
    else:
        q2_t = q_t
    if split < NSM:
        L = tl.load(MID_LEN + b)
        start = split * split_tokens
        end = tl.minimum(start + split_tokens, L)
        kc_base = b.to(tl.int64) * skb + kvh.to(tl.int64) * skh
        vc_base = b.to(tl.int64) * svb + kvh.to(tl.int64) * svh
        ks_base = b.to(tl.int64) * sksb + kvh.to(tl.int64) * sksh
        vs_base = b.to(tl.int64) * svsb + kvh.to(tl.int64) * svsh
        kcb = KCB + kvh * (K_E * K_SUB)
        vcb = VCB + kvh * (V_E * V_SUB)
        kr_base = b.to(tl.int64) * skrb + kvh.to(tl.int64) * skrh
        krg_base = b.to(tl.int64) * skgb + kvh.to(tl.int64) * skgh
        vr_base = b.to(tl.int64) * svrb + kvh.to(tl.int64) * svrh
        vrg_base = b.to(tl.int64) * svgb + kvh.to(tl.int64) * svgh
        m_i = tl.full([HP], float("-inf"), tl.float32)
        l_i = tl.zeros([HP], tl.float32)
        o = tl.zeros([HP, DV], tl.float32)
        o2 = tl.zeros([HP, DV], tl.float32)
        if INTERP:  # a compile-time trip count with a guard (see decode_attention._dense_tier)
            for it in range(MID_ITERS):
                t0 = start + it * BLOCK
                if t0 < end:
                    m_i, l_i, o, o2 = _vq_block(t0, end, q_t, q2_t, m_i, l_i, o, o2, KC, KS, kcb, kc_base, ks_base,
                                                VC, VS, vcb, vc_base, vs_base,
                                                KR, KRG, kr_base, krg_base, VR, VRG, vr_base, vrg_base, D, DV, BLOCK,
                                                K_RB, K_NG, K_VQ, K_SUB, K_E, K_BITS, K_SF, K_ZC, K_RES, K_RSF,
                                                V_RB, V_NG, V_VQ, V_SUB, V_E, V_BITS, V_SF, V_ZC, V_RES, V_RSF)
        else:
            for t0 in range(start, end, BLOCK):
                m_i, l_i, o, o2 = _vq_block(t0, end, q_t, q2_t, m_i, l_i, o, o2, KC, KS, kcb, kc_base, ks_base,
                                            VC, VS, vcb, vc_base, vs_base,
                                            KR, KRG, kr_base, krg_base, VR, VRG, vr_base, vrg_base, D, DV, BLOCK,
                                            K_RB, K_NG, K_VQ, K_SUB, K_E, K_BITS, K_SF, K_ZC, K_RES, K_RSF,
                                            V_RB, V_NG, V_VQ, V_SUB, V_E, V_BITS, V_SF, V_ZC, V_RES, V_RSF)
        inv_l = tl.where(l_i > 0, 1.0 / l_i, 0.0)
        lse = tl.where(l_i > 0, m_i + tl.log2(l_i), float("-inf"))
        tl.store(LSE + o_rows, lse, mask=hvalid)
        dv = tl.arange(0, DV)
        tl.store(OP + o_rows[:, None] * DV + dv[None, :], o * inv_l[:, None], mask=hvalid[:, None])
        if V_RES:  # the dense split's rows of OP2 stay zero (allocated so)
            tl.store(OP2 + o_rows[:, None] * DV + dv[None, :], o2 * inv_l[:, None], mask=hvalid[:, None])
    else:  # the dense tiers (sink, recent) in the last split: decode_attention's own split
        dense_split(q_t, b, kvh, SKK, SKV, sskb, sskh, sskt, ssvb, ssvh, ssvt, SINK_LEN,
                     RKK, RKV, srkb, srkh, srkt, srvb, srvh, srvt, REC_LEN, OP, LSE, o_rows, hvalid,
                     HP, BTD_, D, DV, HAS_SINK, HAS_REC, INTERP, SINK_ITERS, REC_ITERS)


def _check_mid(m: MidTensor, B: int, Hkv: int, D: int, device, what: str) -> dict:
    """Validate one middle tensor; -> the kernel's constexprs for it."""
    if not isinstance(m, MidTensor):
        raise LowbitError(f"{what}: pass a lowbit.kernels.attention.vq.MidTensor")
    c, s = m.codes, m.scale
    if c.dtype != torch.uint8 or c.dim() != 4 or c.shape[0] != B or c.shape[1] != Hkv:
        raise LowbitError(f"{what} codes must be uint8 [B={B}, Hkv={Hkv}, T, bytes], got {c.dtype} {tuple(c.shape)}")
    rb = D * m.bits // 8
    if c.shape[3] != rb or c.stride(3) != 1 or (c.shape[2] > 1 and c.stride(2) != rb):
        raise LowbitError(f"{what} codes: each (sequence, head) must hold its T rows of {rb} bytes back to back")
    if s.dtype not in (torch.float16, torch.uint8) or s.dim() != 4 or s.shape[:3] != c.shape[:3]:
        raise LowbitError(f"{what} scale must be fp16 or uint8 (ue5m3) [B, Hkv, T, groups], got {s.dtype} {tuple(s.shape)}")
    ng = s.shape[3]
    if s.stride(3) != 1 or (s.shape[2] > 1 and s.stride(2) != ng):
        raise LowbitError(f"{what} scale: contiguous [T, groups] rows per (sequence, head)")
    for t in (c, s) + tuple(x for x in (m.codebook, m.rbits, m.rgain) if x is not None):
        if t.device != device:
            raise LowbitError(f"{what} is on {t.device}, q on {device}: put the cache on one device")
    res = _check_residual(m, c, D, what)
    if m.codebook is not None:
        cb = m.codebook
        if cb.dim() != 3 or cb.shape[0] != Hkv or cb.shape[1] not in (16, 256) or D % cb.shape[2]:
            raise LowbitError(f"{what} codebook must be [Hkv={Hkv}, 16 | 256, SUB dividing {D}], got {tuple(cb.shape)}")
        sub, e = int(cb.shape[2]), int(cb.shape[1])
        if m.bits * sub != int(math.log2(e)) or ng != 1:
            raise LowbitError(f"{what}: VQ {sub}x{e} stores {math.log2(e) / sub:g} bits per element and one scale per "
                              f"row, got bits {m.bits} and {ng} scales")
        if (D // sub) & (D // sub - 1) or (e == 16 and D // sub < 2):
            raise LowbitError(f"{what}: {D // sub} indices per row; the kernel takes a power of two")
        return {"RB": rb, "NG": 1, "VQ": True, "SUB": sub, "E": e, "BITS": m.bits, "SF": int(s.dtype == torch.uint8),
                "ZC": 0.0} | res
    if m.bits not in (2, 4, 8) or D % ng or (D // ng) & (D // ng - 1):
        raise LowbitError(f"{what}: scalar codes at {m.bits} bits in {ng} groups of D={D} are not supported "
                          "(2/4/8 bits, power-of-two groups)")
    return {"RB": rb, "NG": ng, "VQ": False, "SUB": 1, "E": 16, "BITS": m.bits, "SF": int(s.dtype == torch.uint8),
            "ZC": float(m.centre)} | res


def _check_residual(m: MidTensor, c: torch.Tensor, D: int, what: str) -> dict:
    """Validate a tensor's 1-bit residual (both fields or neither); -> {"RES", "RSF"}."""
    if (m.rbits is None) != (m.rgain is None):
        raise LowbitError(f"{what}: a residual needs both rbits and rgain (or neither)")
    if m.rbits is None:
        return {"RES": False, "RSF": 0}
    rb, rg = m.rbits, m.rgain
    if rb.dtype != torch.uint8 or rb.shape != (*c.shape[:3], D // 8) or rb.stride(3) != 1 or \
            (rb.shape[2] > 1 and rb.stride(2) != D // 8):
        raise LowbitError(f"{what} rbits must be uint8 [B, Hkv, T, {D // 8}] rows back to back, got {rb.dtype} "
                          f"{tuple(rb.shape)}")
    if rg.dtype not in (torch.float16, torch.uint8) or rg.shape != (*c.shape[:3], 1) or \
            (rg.shape[2] > 1 and rg.stride(2) != 1):
        raise LowbitError(f"{what} rgain must be fp16 or uint8 (ue5m3) [B, Hkv, T, 1], got {rg.dtype} {tuple(rg.shape)}")
    return {"RES": True, "RSF": int(rg.dtype == torch.uint8)}


def decode_attention_vq(q: torch.Tensor, k_mid: MidTensor | None, v_mid: MidTensor | None,
                        mid_lens: torch.Tensor | int | None = None, *, sm_scale: float | None = None,
                        sink_k=None, sink_v=None, sink_lens=None, recent_k=None, recent_v=None, recent_lens=None,
                        num_splits: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one query per sequence over the sink / VQ middle / recent tiers -> [B, Hq, Dv] in q's dtype.

    k_mid / v_mid: MidTensor or both None (no middle); at least one of them VQ is the point, but scalar
    scale-only tensors are read too (a layer with int4 keys and VQ values). See the module docstring."""
    check_mode(q.device)
    if q.dim() != 3 or q.stride(-1) != 1:
        raise LowbitError(f"q must be [B, Hq, D] with a contiguous last dim, got {tuple(q.shape)}")
    B, Hq, D = q.shape
    dev = q.device
    if (k_mid is None) != (v_mid is None):
        raise LowbitError("middle tier: pass k_mid and v_mid together (or neither)")
    dense_v = sink_v if sink_v is not None else recent_v
    if k_mid is not None:
        Hkv, DV = k_mid.codes.shape[1], v_mid.codes.shape[3] * 8 // v_mid.bits
    elif dense_v is not None:
        Hkv, DV = dense_v.shape[1], dense_v.shape[3]
    else:
        raise LowbitError("no tier given: pass a middle tier, a sink or a recent tier")
    for name, n in (("D", D), ("Dv", DV)):
        if n < 16 or n & (n - 1):
            raise LowbitError(f"{name} {n}: the VQ decode kernel takes power-of-two head dims >= 16")
    if Hq % Hkv:
        raise LowbitError(f"{Hq} query heads do not split into {Hkv} KV heads")
    G = Hq // Hkv
    HP = max(16, pow2(G))
    if k_mid is not None:
        kc = _check_mid(k_mid, B, Hkv, D, dev, "K middle")
        vc = _check_mid(v_mid, B, Hkv, DV, dev, "V middle")
        T = k_mid.codes.shape[2]
        if v_mid.codes.shape[2] != T:
            raise LowbitError("K and V middle tiers must have the same number of slots T")
        mid_lens = valid_lens(T if mid_lens is None else mid_lens, B, dev, "mid_lens")
        kcb = k_mid.codebook if k_mid.codebook is not None else k_mid.scale
        vcb = v_mid.codebook if v_mid.codebook is not None else v_mid.scale
        kt, vt = (k_mid.codes, k_mid.scale), (v_mid.codes, v_mid.scale)
    else:
        dummy = torch.zeros(1, 1, 1, 1, dtype=torch.uint8, device=dev)
        kc = vc = {"RB": 1, "NG": 1, "VQ": False, "SUB": 1, "E": 16, "BITS": 8, "SF": 1, "ZC": 0.0, "RES": False,
                   "RSF": 0}
        T, kcb, vcb, kt, vt = 0, dummy, dummy, (dummy, dummy), (dummy, dummy)
        mid_lens = torch.zeros(B, dtype=torch.int32, device=dev)
    sk, sv, sl = check_dense(sink_k, sink_v, sink_lens, B, Hkv, D, DV, dev, "sink")
    rk, rv, rl = check_dense(recent_k, recent_v, recent_lens, B, Hkv, D, DV, dev, "recent")
    has_sink, has_rec = sk is not None, rk is not None
    sk, sv, sl = (sk, sv, sl) if has_sink else (q[:, None], q[:, None], mid_lens)
    rk, rv, rl = (rk, rv, rl) if has_rec else (q[:, None], q[:, None], mid_lens)
    interp = dev.type != "cuda"
    if num_splits is None:
        sms = 8 if interp else torch.cuda.get_device_properties(dev).multi_processor_count
        num_splits = max(1, min(triton.cdiv(max(T, 1), BT), triton.cdiv(2 * sms, B * Hkv)))
    split_tokens = max(BT, triton.cdiv(triton.cdiv(max(T, 1), int(num_splits)), BT) * BT)
    nsm = triton.cdiv(max(T, 1), split_tokens) if k_mid is not None else 0
    nsplit = nsm + 1
    part = torch.empty(B * Hq * nsplit, DV, dtype=torch.float32, device=dev)
    lse = torch.empty(B * Hq * nsplit, dtype=torch.float32, device=dev)
    if out is None:
        out = torch.empty(B, Hq, DV, dtype=q.dtype, device=dev)
    elif out.shape != (B, Hq, DV) or out.stride(-1) != 1:
        raise LowbitError(f"out must be [B, Hq, Dv] = {(B, Hq, DV)} with a contiguous last dim")
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(D)
    consts = {f"K_{k}": v for k, v in kc.items()} | {f"V_{k}": v for k, v in vc.items()}

    # residuals: K's scores read q @ S.T; V's part is summed in S's basis (OP2) and rotated back after the merge
    q2 = (q.float() @ basis(D, dev).T).contiguous() if kc["RES"] else q
    part2 = torch.zeros(B * Hq * nsplit, DV, dtype=torch.float32, device=dev) if vc["RES"] else part
    kr = (k_mid.rbits, k_mid.rgain) if kc["RES"] else (kt[0], kt[1])
    vr = (v_mid.rbits, v_mid.rgain) if vc["RES"] else (vt[0], vt[1])
    _vq_stage1[(nsplit, Hkv, B)](
        q, q.stride(0), q.stride(1), q2,
        kt[0], kt[0].stride(0), kt[0].stride(1), kt[1], kt[1].stride(0), kt[1].stride(1), kcb,
        vt[0], vt[0].stride(0), vt[0].stride(1), vt[1], vt[1].stride(0), vt[1].stride(1), vcb,
        kr[0], kr[0].stride(0), kr[0].stride(1), kr[1], kr[1].stride(0), kr[1].stride(1),
        vr[0], vr[0].stride(0), vr[0].stride(1), vr[1], vr[1].stride(0), vr[1].stride(1),
        mid_lens,
        sk, sv, sk.stride(0), sk.stride(1), sk.stride(2), sv.stride(0), sv.stride(1), sv.stride(2), sl,
        rk, rv, rk.stride(0), rk.stride(1), rk.stride(2), rv.stride(0), rv.stride(1), rv.stride(2), rl,
        part, part2, lse, float(sm_scale) * LOG2E, int(split_tokens), nsm, nsplit,
        G=G, HP=HP, D=D, DV=DV, **consts, BLOCK=BT, BTD_=BTD, HAS_SINK=has_sink, HAS_REC=has_rec, INTERP=interp,
        MID_ITERS=(split_tokens // BT) if interp else 0,
        SINK_ITERS=triton.cdiv(sk.shape[2], BTD) if interp else 0,
        REC_ITERS=triton.cdiv(rk.shape[2], BTD) if interp else 0,
        num_warps=4,
    )
    ch = min(32, max(16, pow2(nsplit)))
    if not vc["RES"]:
        stage2[(B, Hq)](part, lse, out, out.stride(0), out.stride(1), nsplit, NCH=triton.cdiv(nsplit, ch), CH=ch,
                         DV=DV, num_warps=4)
        return out
    merged = torch.empty(2, B, Hq, DV, dtype=torch.float32, device=dev)
    for i, pp in enumerate((part, part2)):  # the same log-sum-exp weights merge both
        stage2[(B, Hq)](pp, lse, merged[i], merged.stride(1), merged.stride(2), nsplit, NCH=triton.cdiv(nsplit, ch),
                         CH=ch, DV=DV, num_warps=4)
    out.copy_(torch.addmm(merged[0].reshape(B * Hq, DV), merged[1].reshape(B * Hq, DV), basis(DV, dev)).view(B, Hq, DV))
    return out
