"""Fused split-K decode attention for the geometries the 64/128/256 kernel does not take (Triton).

Two cache layouts, one kernel (`_geo_stage1`), the merge of lowbit.kernels.attention.tiers (`stage2`):

* **Separate K and V** of any head dims (`decode_attention_geo`): K192/V128 (Kimi-K2 / DeepSeek-V3 as
  expanded MHA), head_dim 512 (Gemma-4 full layers as plain GQA), ... Same tiers and arguments as
  decode_attention; decode_attention hands such shapes here.
* **Shared K/V** (`decode_attention_latent`): the stored tensor is BOTH the value and the key's main
  part, plus a small dense key part of its own. MLA latent (DeepSeek-V3 absorbed): value = c_kv [512],
  key = [c_kv | k_pe 64]; Gemma-4 K = V full layers: value = V [512], key = K's RoPE dims (own, dense)
  and unrotate(V)[rest] * k_norm weight. Both reduce to
      score_t = q_lat . x_t + q_pe . pe_t ,   out = sum_t p_t x_t        (x_t = the stored tensor)
  where the caller folds everything elementwise or orthogonal into q_lat (lowbit.backends.triton_decode.run_shared:
  q_lat = rotate(q[rest] * k_scale, R_v), q_pe = q[own]), and unrotates the output as for any layer.

Tiers (B sequences, Hkv KV heads, q head h reads KV head h // G):
  middle  codes uint8 [B, Hkv, T, D*bits/8] in the `strided` layout (lowbit.quant.packing: byte j holds
          dims j + i*S, S = D*bits/8, at bit offset i*bits), scale/zero fp16 [B, Hkv, T, D/group],
          x = codes * scale + zero; valid slots [0, mid_lens[b]). Shared layout: pe [B, Hkv, T, DR] dense.
  sink / recent  dense, model dtype: K [B, Hkv, N, Dk] (separate) or pe [B, Hkv, N, DR] (shared),
          V [B, Hkv, N, Dv]; valid slots [0, *valid_lens[b]).

How a middle tile of BT tokens is read (2-D tiles, one MMA per segment; no batched dots). A packed
row of S = D*bits/8 bytes holds, at bit offset i*bits of byte j, dim j + i*S (the `strided` layout):
position i is the contiguous dims [i*S, (i+1)*S). A row is cut into segments of W = gcd(S, group)
dims (at most 128): segment j is bytes (j*W) % S .. + W at position (j*W) // S, inside one scale
group. Latent / 512 at 2 bits, group 128: 4 segments of 128 (one per position, one load of the row's
128 bytes); K192 at 2 bits, group 64: 12 of 16; V128: 4 of 32.
  scores  s [BT, heads] = sum_g scale_tg * sum_{j in g} codes_j [BT, W] @ q_j [W, heads] + zero_tg * sum(q_g)
          (+ pe [BT, DR] @ q_pe): tokens are the MMA's M, heads its N (padded to 8). Codes become fp16
          with one AND per two codes (a masked word IS two fp16 subnormals, code * 2**(shift-24)); the
          powers of two go into q (exact) and into the scale.
  values  O_j^T [W, heads] += codes_j^T [W, BT] @ (p * scale_g) [BT, heads]: the codes re-read
          token-minor and paired by one byte-permute per two words (the PV MMA wants two tokens per
          register), a fresh product per tile folded in by one FMA. The zero terms and the softmax sum
          are one small MMA of zeros^T (+ a row of ones) [16, BT] with p split hi + lo (`zero_mma`).
  q       in registers, or re-read from L1 each tile when DK x heads would not fit (`q_loop`).
Heads: a program takes BH query heads of one KV head (up to 16 by default: MLA's 128 heads are 8
programs per tile, neighbours in launch order, the tile read from L2 by all but the first).

Splits (flash-decoding): grid (Hkv * head blocks, middle splits + 1 dense split, B); the head blocks
of one tile are neighbours in launch order (they read it from L2); stage 2 merges the splits by
log-sum-exp (empty splits carry -inf; a sequence with no token gets zeros).

`dense_mid=True` (shared layout only) reads a dense model-dtype middle [B, Hkv, T, D] instead of
codes: the bf16 latent baseline of the benchmark, same kernel, one bf16 MMA per product.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from lowbit.core.errors import LowbitError
from lowbit.kernels.attention import latent_cuda
from lowbit.kernels.attention.common import (
    LOG2E,
    check_mode,
    check_packed_tier,
    cuda_index,
    device_info,
    halves,
    pair_byte,
    pow2,
    stage2,
    tier_heads,
    valid_lens,
)
from lowbit.kv.capabilities import geo_tiling_reason


@triton.jit
def _dot2(a, x, EXACT_F32: tl.constexpr):
    """a [M, K] (model dtype, exact) @ x [K, N] fp32 -> fp32: x split hi + lo in a's dtype (two MMAs,
    ~fp32 products); EXACT_F32 (fp32 tiers, or the interpreter whose bf16 dot is wrong): tf32x3."""
    if EXACT_F32:
        r = tl.dot(a.to(tl.float32), x, input_precision="tf32x3")
    else:
        hi = x.to(a.dtype)
        r = tl.dot(a, (x - hi.to(tl.float32)).to(a.dtype), tl.dot(a, hi))
    return r


@triton.jit
def _geo_dense_block(Kp, Vp, Pp, skt, svt, spt, t0, n, q_t, qp_t, m_i, l_v, o_t,
                     BT: tl.constexpr, DK: tl.constexpr, DKP: tl.constexpr, DV: tl.constexpr, DR: tl.constexpr,
                     SHARED: tl.constexpr, HAS_PE: tl.constexpr, EXACT_F32: tl.constexpr):
    """Rows [t0, t0+BT) of one dense tier: K main [n, DK] (V itself when SHARED), pe [n, DR], V [n, DV].
    q_t [DKP, HP], qp_t [DR, HP] fp32 (times sm_scale*log2 e); o_t [DV, HP]; l_v [BT, HP] deferred sums."""
    t = t0 + tl.arange(0, BT)
    valid = t < n
    dk = tl.arange(0, DKP)
    dv = tl.arange(0, DV)
    if SHARED:
        k = tl.load(Vp + t[:, None] * svt + dk[None, :], mask=valid[:, None] & (dk < DK)[None, :], other=0.0)
    else:
        k = tl.load(Kp + t[:, None] * skt + dk[None, :], mask=valid[:, None] & (dk < DK)[None, :], other=0.0)
    s = _dot2(k, q_t, EXACT_F32)  # [BT, HP]
    if HAS_PE:
        dr = tl.arange(0, DR)
        pe = tl.load(Pp + t[:, None] * spt + dr[None, :], mask=valid[:, None], other=0.0)
        s += _dot2(pe, qp_t, EXACT_F32)
    s = tl.where(valid[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 0))  # finite: the block has >= 1 valid token
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[None, :])
    l_v = l_v * alpha[None, :] + p
    vt = tl.load(Vp + t[None, :] * svt + dv[:, None], mask=valid[None, :], other=0.0)  # [DV, BT]
    o_t = _dot2(vt, p, EXACT_F32) + o_t * alpha[None, :]
    return m_new, l_v, o_t


@triton.jit
def _geo_dense_tier(Kp, Vp, Pp, skt, svt, spt, n, ITERS: tl.constexpr, q_t, qp_t, m_i, l_v, o_t,
                    BT: tl.constexpr, DK: tl.constexpr, DKP: tl.constexpr, DV: tl.constexpr, DR: tl.constexpr,
                    SHARED: tl.constexpr, HAS_PE: tl.constexpr, EXACT_F32: tl.constexpr, INTERP: tl.constexpr):
    """Online softmax over a dense tier's valid rows [0, n) (ITERS: the interpreter's trip count)."""
    if INTERP:
        for it in range(ITERS):  # the interpreter takes no run-time range bound (see decode_attention)
            if it * BT < n:
                m_i, l_v, o_t = _geo_dense_block(Kp, Vp, Pp, skt, svt, spt, it * BT, n, q_t, qp_t, m_i, l_v, o_t,
                                                 BT, DK, DKP, DV, DR, SHARED, HAS_PE, EXACT_F32)
    else:
        # not software-pipelined: the dense tiers are short, and staging [BT, 512] K and V tiles would
        # cost the shared memory (hence the occupancy) of every program of the kernel, middle ones too
        for t0 in tl.range(0, n, BT, num_stages=1):
            m_i, l_v, o_t = _geo_dense_block(Kp, Vp, Pp, skt, svt, spt, t0, n, q_t, qp_t, m_i, l_v, o_t,
                                             BT, DK, DKP, DV, DR, SHARED, HAS_PE, EXACT_F32)
    return m_i, l_v, o_t



# ----------------------------------------------------------------------------------------------
# Middle-tier helpers: segments of one packed row (see the module docstring)
# ----------------------------------------------------------------------------------------------
@triton.jit
def _seg_cols(U: tl.constexpr):
    """Dim offset (inside its segment) of each column of _codes_k [.., 4U]: column 4u + j holds byte
    (0, 2, 1, 3)[j] of word u (bits 0 and 1 of the column index swapped)."""
    c = tl.arange(0, 4 * U)
    return (c & ~3) + ((c & 1) << 1) + ((c >> 1) & 1)


@triton.jit
def _seg_rows(U: tl.constexpr):
    """Dim offset (inside its segment) of each row of _codes_v [4U, ..]: row c*U + u is byte c of word u."""
    r = tl.arange(0, 4 * U)
    return 4 * (r % U) + r // U


@triton.jit
def _codes_k(w, SH: tl.constexpr, BITS: tl.constexpr):
    """Words [BT, U] int32 (token-major) -> fp16 [BT, 4U]: the codes at bit offset SH of every byte,
    value code * 2**(SH - 24), columns in _seg_cols order. One AND per two codes: a word ANDed with a
    mask that keeps one code in each 16-bit half IS two fp16 subnormals (bytes 0 and 2; the word
    shifted by 8 gives bytes 1 and 3): no convert, subtract or multiply per element."""
    M: tl.constexpr = (((1 << BITS) - 1) << SH) * 0x10001
    el, eh = halves(w & M)  # bytes 0, 2
    ol, oh = halves((w >> 8) & M)  # bytes 1, 3
    x = tl.join(tl.join(el, ol), tl.join(eh, oh))  # [BT, U, 2, 2] -> column 4u + 2*h + eo
    return tl.reshape(x, (w.shape[0], w.shape[1] * 4))


@triton.jit
def _token_pairs(wt, USE_PRMT: tl.constexpr):
    """Words token-minor [U, BT] -> int32 [4, U, BT/2]: element (c, u, k) holds byte c of word u of
    token 2k in its low half and of token 2k+1 in its high half (the pairs the PV MMA's A operand
    wants in one register). Built by broadcasting over c (one byte-permute per two words)."""
    U: tl.constexpr = wt.shape[0]
    BT: tl.constexpr = wt.shape[1]
    a, b = tl.split(tl.reshape(wt, (U, BT // 2, 2)))  # even, odd tokens [U, BT/2]
    shape: tl.constexpr = (4, U, BT // 2)
    c = tl.broadcast_to(tl.arange(0, 4)[:, None, None], shape)
    return pair_byte(tl.broadcast_to(a[None, :, :], shape), tl.broadcast_to(b[None, :, :], shape), c, USE_PRMT)


@triton.jit
def _codes_v(x, SH: tl.constexpr, BITS: tl.constexpr):
    """_token_pairs [4, U, BT/2] -> fp16 codes^T [4U, BT] at bit offset SH, value code * 2**(SH - 24);
    rows in _seg_rows order, columns = tokens."""
    M: tl.constexpr = (((1 << BITS) - 1) << SH) * 0x10001
    lo, hi = halves(x & M)
    return tl.reshape(tl.join(lo, hi), (4 * x.shape[1], 2 * x.shape[2]))


@triton.jit
def _seg_dims(j: tl.constexpr, W: tl.constexpr, DENSE: tl.constexpr, ROWS: tl.constexpr):
    """Dims of segment j's columns (K side, _codes_k order) or rows (V side, _codes_v order)."""
    if DENSE:
        d = tl.arange(0, W)
    elif ROWS:
        d = _seg_rows(W // 4)
    else:
        d = _seg_cols(W // 4)
    return j * W + d


@triton.jit
def _q_seg(q_base, hvalid, j: tl.constexpr, W: tl.constexpr, NR: tl.constexpr, BITS: tl.constexpr,
           DENSE: tl.constexpr, DT: tl.constexpr):
    """q of K segment j -> ([W, HP] in DT, fp32 [W, HP]): columns in _codes_k order, times
    2**-(bit offset of the segment's codes) (exact in fp16; the 2**24 goes on the scale)."""
    d = _seg_dims(j, W, DENSE, False)
    qf = tl.load(q_base[None, :] + d[:, None], mask=hvalid[None, :], other=0.0).to(tl.float32)
    if DENSE:
        qs = qf
    else:
        qs = qf * (1.0 / (1 << ((j // NR) * BITS)))
    return qs.to(DT), qf


@triton.jit
def _geo_mid_tile(t0, end, kw_base, vw_base, pe_base, spt, KS, KZ, ks_base, VS, VZ, vs_base,
                  q_base, qp_base, hvalid, qk, qsum, qp, qk_scale, m_i, l_v, o, lz,
                  BT: tl.constexpr, HP: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr,
                  SK: tl.constexpr, SV: tl.constexpr, WK: tl.constexpr, NRK: tl.constexpr, GK: tl.constexpr,
                  NGK: tl.constexpr, WV: tl.constexpr, NRV: tl.constexpr, GV: tl.constexpr, NGV: tl.constexpr,
                  DV: tl.constexpr, DR: tl.constexpr, SHARED: tl.constexpr, HAS_PE: tl.constexpr,
                  DENSE_MID: tl.constexpr, Q_LOOP: tl.constexpr, USE_PRMT: tl.constexpr, INTERP: tl.constexpr,
                  ZMMA: tl.constexpr):
    """One tile of BT middle tokens from t0: scores, online softmax, values. o: tuple of the V
    segments' accumulators [WV, HP] fp32; lz: tuple per V group of deferred p * zero sums [BT, HP];
    l_v [BT, HP] deferred softmax sums; qk / qp: tuples of q segments (or None-likes when Q_LOOP)."""
    tok = t0 + tl.arange(0, BT)
    valid = tok < end
    SEG_K: tl.constexpr = GK // WK  # segments per K group
    SEG_V: tl.constexpr = GV // WV
    QT: tl.constexpr = q_base.dtype.element_ty if DENSE_MID else tl.float16
    # ---------------- scores [BT, HP] ----------------
    s = tl.zeros([BT, HP], tl.float32)
    xs = ()
    if DENSE_MID:
        for j in tl.static_range(NGK * SEG_K):
            x = tl.load(vw_base + tok[:, None] * DV + (j * WK + tl.arange(0, WK))[None, :], mask=valid[:, None],
                        other=0.0)
            xs = xs + (x,)
            if Q_LOOP:
                qj, _ = _q_seg(q_base, hvalid, j, WK, NRK, KBITS, True, QT)
            else:
                qj = qk[j]
            if INTERP:  # the interpreter's tl.dot is wrong on bf16 operands
                s += tl.dot(x.to(tl.float32), qj.to(tl.float32))
            else:
                s = tl.dot(x, qj, s)
    else:
        ws = ()
        for r in tl.static_range(NRK):  # the row's byte ranges, each shared by the 8/KBITS positions
            ws = ws + (tl.load(kw_base + tok[:, None] * (SK // 4) + (r * (WK // 4) + tl.arange(0, WK // 4))[None, :],
                               mask=valid[:, None], other=0),)
        # (loop indices are used inline: a name assigned from them would stop being a constexpr)
        for j in tl.static_range(NGK * SEG_K):  # segment j of group j // SEG_K
            if j % SEG_K == 0:
                a = tl.zeros([BT, HP], tl.float32)
            x = _codes_k(ws[j % NRK], (j // NRK) * KBITS, KBITS)  # [BT, WK]
            if Q_LOOP:
                qj, _ = _q_seg(q_base, hvalid, j, WK, NRK, KBITS, False, QT)
            else:
                qj = qk[j]
            a = tl.dot(x, qj, a)  # (q . codes) * 2**-24 over the group's segments
            if j % SEG_K == SEG_K - 1:
                ks = tl.load(KS + ks_base + tok * NGK + j // SEG_K, mask=valid, other=0.0).to(tl.float32)
                kz = tl.load(KZ + ks_base + tok * NGK + j // SEG_K, mask=valid, other=0.0).to(tl.float32)
                s += (ks * 16777216.0)[:, None] * a + kz[:, None] * qsum[j // SEG_K][None, :]
    if HAS_PE:
        pe = tl.load(pe_base + tok[:, None] * spt + tl.arange(0, DR)[None, :], mask=valid[:, None], other=0.0)
        if Q_LOOP:
            qpj = tl.load(qp_base[None, :] + tl.arange(0, DR)[:, None], mask=hvalid[None, :], other=0.0)
        else:
            qpj = qp
        if INTERP:
            s += tl.dot(pe.to(tl.float32), qpj.to(tl.float32))
        else:
            s = tl.dot(pe, qpj, s)
    # ---------------- online softmax (row sums deferred) ----------------
    s = tl.where(valid[:, None], s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 0))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a split may have no valid token yet
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[None, :])  # [BT, HP]
    if ZMMA:
        # l_v is [16, HP]: row g < NGV the sum of p * zero of V group g, row NGV (0 dense) the sum of p,
        # as one small MMA of the zeros^T (+ a row of ones) with p split hi + lo (~fp32): no [BT, HP]
        # deferred sums to hold and rescale per group
        zr = tl.arange(0, 16)
        NZ: tl.constexpr = 0 if DENSE_MID else NGV
        if DENSE_MID:
            zt = tl.where((zr == NZ)[:, None] & valid[None, :], 1.0, 0.0).to(tl.float16)
        else:
            if SHARED:
                zt = tl.load(KZ + ks_base + tok[None, :] * NGK + zr[:, None], mask=(zr < NGV)[:, None] & valid[None, :],
                             other=0.0)
            else:
                zt = tl.load(VZ + vs_base + tok[None, :] * NGV + zr[:, None], mask=(zr < NGV)[:, None] & valid[None, :],
                             other=0.0)
            zt = tl.where((zr == NZ)[:, None] & valid[None, :], 1.0, zt.to(tl.float32)).to(tl.float16)  # [16, BT]
        p_hi = p.to(tl.float16)
        p_lo = (p - p_hi.to(tl.float32)).to(tl.float16)
        l_v = tl.fma(l_v, alpha[None, :], tl.dot(zt, p_lo, tl.dot(zt, p_hi)))
    else:
        l_v = l_v * alpha[None, :] + p
    # ---------------- values: O^T [dims, heads] += X^T [dims, tokens] @ (p * scale) [tokens, heads] ----------------
    o_new = ()
    lz_new = ()
    if DENSE_MID:
        if INTERP:
            pv = p
        else:
            pv = p.to(QT)
        for j in tl.static_range(NGV * SEG_V):
            xt = tl.trans(xs[j])  # [WV, BT]: the tile already loaded for the scores
            if INTERP:
                xt = xt.to(tl.float32)
            o_new = o_new + (tl.dot(xt, pv, o[j] * alpha[None, :]),)
        lz_new = lz
    else:
        xp = ()
        for r in tl.static_range(NRV):
            wt = tl.load(vw_base + tok[None, :] * (SV // 4) + (r * (WV // 4) + tl.arange(0, WV // 4))[:, None],
                         mask=valid[None, :], other=0)  # [WV/4, BT] token-minor
            xp = xp + (_token_pairs(wt, USE_PRMT),)
        for j in tl.static_range(NGV * SEG_V):  # segment j of group j // SEG_V
            if j % SEG_V == 0:
                if SHARED:
                    # the latent's scale/zero: the same loads as the scores' (CSE'd by the compiler)
                    vs = tl.load(KS + ks_base + tok * NGK + j // SEG_V, mask=valid, other=0.0).to(tl.float32)
                    vz = tl.load(KZ + ks_base + tok * NGK + j // SEG_V, mask=valid, other=0.0).to(tl.float32)
                else:
                    vs = tl.load(VS + vs_base + tok * NGV + j // SEG_V, mask=valid, other=0.0).to(tl.float32)
                    vz = tl.load(VZ + vs_base + tok * NGV + j // SEG_V, mask=valid, other=0.0).to(tl.float32)
                if ZMMA:
                    lz_new = lz
                ps = (p * vs[:, None]).to(tl.float16)
                if not ZMMA:
                    lz_new = lz_new + (lz[j // SEG_V] * alpha[None, :] + p * vz[:, None],)
            vt = _codes_v(xp[j % NRV], (j // NRV) * VBITS, VBITS)  # [WV, BT]
            # the tile's product from zero, folded in by one FMA: the MMA's truncating accumulator
            # then sums only BT tokens (see decode_attention's PV_FRESH)
            o_new = o_new + (tl.fma(o[j], alpha[None, :], tl.dot(vt, ps)),)
    return m_new, l_v, o_new, lz_new


@triton.jit(do_not_specialize=["split_tokens", "NSM", "NSPLIT", "SPLIT0"])
def _geo_stage1(
    Q, sqb, sqh, QP, sqpb, sqph,
    KW, skb, skh, KS, KZ, sksb, sksh,
    VW, svb, svh, VS, VZ, svsb, svsh,
    MP, smpb, smph, smpt, MID_LEN,
    SK_K, SK_V, SK_P, sskb, sskh, sskt, ssvb, ssvh, ssvt, sspb, ssph, sspt, SINK_LEN,
    RK_K, RK_V, RK_P, srkb, srkh, srkt, srvb, srvh, srvt, srpb, srph, srpt, REC_LEN,
    OP, LSE,
    qk_scale, split_tokens, NSM, NSPLIT, SPLIT0,
    G: tl.constexpr, BH: tl.constexpr, NHB: tl.constexpr, HP: tl.constexpr,
    DK: tl.constexpr, DKP: tl.constexpr, DV: tl.constexpr, DR: tl.constexpr,
    KBITS: tl.constexpr, VBITS: tl.constexpr, GK: tl.constexpr, GV: tl.constexpr,
    WK: tl.constexpr, WV: tl.constexpr, SHARED: tl.constexpr, HAS_PE: tl.constexpr, DENSE_MID: tl.constexpr,
    Q_LOOP: tl.constexpr, USE_PRMT: tl.constexpr, ZMMA: tl.constexpr,
    BT: tl.constexpr, BTD: tl.constexpr, HAS_SINK: tl.constexpr, HAS_REC: tl.constexpr, INTERP: tl.constexpr,
    MID_ITERS: tl.constexpr, SINK_ITERS: tl.constexpr, REC_ITERS: tl.constexpr,
):
    hb_kv = tl.program_id(0)
    split = tl.program_id(1) + SPLIT0  # SPLIT0 = NSM: only the dense split (the CUDA kernel ran the middle)
    b = tl.program_id(2)
    kvh = hb_kv // NHB
    hl = (hb_kv % NHB) * BH + tl.arange(0, HP)  # q heads of this program inside the KV head's group
    hvalid = (tl.arange(0, HP) < BH) & (hl < G)
    head = kvh * G + hl
    q_base = Q + b.to(tl.int64) * sqb + head * sqh  # [HP]
    qp_base = QP + b.to(tl.int64) * sqpb + head * sqph
    o_rows = (b.to(tl.int64) * (G * (tl.num_programs(0) // NHB)) + head) * NSPLIT + split  # [HP]

    if split < NSM:
        SK: tl.constexpr = DK * KBITS // 8 if not DENSE_MID else DK
        SV: tl.constexpr = DV * VBITS // 8 if not DENSE_MID else DV
        NRK: tl.constexpr = SK // WK if not DENSE_MID else 1  # byte ranges of a row
        NRV: tl.constexpr = SV // WV if not DENSE_MID else 1
        NGK: tl.constexpr = DK // GK
        NGV: tl.constexpr = DV // GV
        SEG_K: tl.constexpr = GK // WK
        QT: tl.constexpr = Q.dtype.element_ty if DENSE_MID else tl.float16
        L = tl.load(MID_LEN + b)
        start = split * split_tokens
        end = tl.minimum(start + split_tokens, L)
        # q segments (registers, unless Q_LOOP re-reads them from L1 every tile) and q's sum per K group
        qk = ()
        qsum = ()
        for j in tl.static_range(NGK * SEG_K):
            if j % SEG_K == 0:
                acc = tl.zeros([HP], tl.float32)
            qj, qf = _q_seg(q_base, hvalid, j, WK, NRK, KBITS, DENSE_MID, QT)
            acc += tl.sum(qf, 0)
            if not Q_LOOP:
                qk = qk + (qj,)
            if j % SEG_K == SEG_K - 1:
                qsum = qsum + (acc,)
        if HAS_PE and not Q_LOOP:
            qp = tl.load(qp_base[None, :] + tl.arange(0, DR)[:, None], mask=hvalid[None, :], other=0.0)
        else:
            qp = tl.zeros([DR, HP], tl.float32)
        m_i = tl.full([HP], float("-inf"), tl.float32)
        if ZMMA:
            l_v = tl.zeros([16, HP], tl.float32)
        else:
            l_v = tl.zeros([BT, HP], tl.float32)
        o = ()
        for j in tl.static_range(DV // WV):
            o = o + (tl.zeros([WV, HP], tl.float32),)
        lz = ()
        if not ZMMA:
            for g in tl.static_range(NGV):
                lz = lz + (tl.zeros([BT, HP], tl.float32),)
        kw_base = KW + b.to(tl.int64) * skb + kvh.to(tl.int64) * skh
        vw_base = VW + b.to(tl.int64) * svb + kvh.to(tl.int64) * svh
        ks_base = b.to(tl.int64) * sksb + kvh.to(tl.int64) * sksh
        vs_base = b.to(tl.int64) * svsb + kvh.to(tl.int64) * svsh
        pe_base = MP + b.to(tl.int64) * smpb + kvh.to(tl.int64) * smph
        if INTERP:
            for it in range(MID_ITERS):  # the interpreter takes no run-time range bound (see decode_attention)
                t0 = start + it * BT
                if t0 < end:
                    m_i, l_v, o, lz = _geo_mid_tile(
                        t0, end, kw_base, vw_base, pe_base, smpt, KS, KZ, ks_base, VS, VZ, vs_base,
                        q_base, qp_base, hvalid, qk, qsum, qp, qk_scale, m_i, l_v, o, lz,
                        BT, HP, KBITS, VBITS, SK, SV, WK, NRK, GK, NGK, WV, NRV, GV, NGV, DV, DR,
                        SHARED, HAS_PE, DENSE_MID, Q_LOOP, USE_PRMT, INTERP, ZMMA)
        else:
            for t0 in range(start, end, BT):
                m_i, l_v, o, lz = _geo_mid_tile(
                    t0, end, kw_base, vw_base, pe_base, smpt, KS, KZ, ks_base, VS, VZ, vs_base,
                    q_base, qp_base, hvalid, qk, qsum, qp, qk_scale, m_i, l_v, o, lz,
                    BT, HP, KBITS, VBITS, SK, SV, WK, NRK, GK, NGK, WV, NRV, GV, NGV, DV, DR,
                    SHARED, HAS_PE, DENSE_MID, Q_LOOP, USE_PRMT, INTERP, ZMMA)
        zr = tl.arange(0, 16)
        if ZMMA:
            l_i = tl.sum(tl.where((zr == (0 if DENSE_MID else NGV))[:, None], l_v, 0.0), 0)
        else:
            l_i = tl.sum(l_v, 0)
        inv_l = tl.where(l_i > 0, 1.0 / l_i, 0.0)
        lse = tl.where(l_i > 0, m_i + tl.log2(l_i), float("-inf"))
        tl.store(LSE + o_rows, lse, mask=hvalid)
        SEG_V: tl.constexpr = GV // WV
        for j in tl.static_range(NGV * SEG_V):
            if DENSE_MID:
                res = o[j] * inv_l[None, :]
            else:
                if j % SEG_V == 0:
                    if ZMMA:
                        z = tl.sum(tl.where((zr == j // SEG_V)[:, None], l_v, 0.0), 0) * inv_l
                    else:
                        z = tl.sum(lz[j // SEG_V], 0) * inv_l
                # 2**(24 - bit offset) undoes the subnormal scale of the segment's codes
                res = o[j] * (inv_l * (1 << (24 - (j // NRV) * VBITS)))[None, :] + z[None, :]
            dv = _seg_dims(j, WV, DENSE_MID, True)
            tl.store(OP + o_rows[None, :] * DV + dv[:, None], res, mask=hvalid[None, :])
    else:
        # ---------------- dense tiers (sink, recent) in the last split ----------------
        DT: tl.constexpr = SK_V.dtype.element_ty
        EXACT_F32: tl.constexpr = (DT == tl.float32) or INTERP
        dk = tl.arange(0, DKP)
        q_t = tl.load(q_base[None, :] + dk[:, None], mask=(dk < DK)[:, None] & hvalid[None, :],
                      other=0.0).to(tl.float32) * qk_scale  # [DKP, HP]
        if HAS_PE:
            qp_t = tl.load(qp_base[None, :] + tl.arange(0, DR)[:, None], mask=hvalid[None, :],
                           other=0.0).to(tl.float32) * qk_scale
        else:
            qp_t = tl.zeros([DR, HP], tl.float32)
        m_d = tl.full([HP], float("-inf"), tl.float32)
        l_d = tl.zeros([BTD, HP], tl.float32)
        o_t = tl.zeros([DV, HP], tl.float32)
        if HAS_SINK:
            n = tl.load(SINK_LEN + b)
            m_d, l_d, o_t = _geo_dense_tier(
                SK_K + b.to(tl.int64) * sskb + kvh.to(tl.int64) * sskh,
                SK_V + b.to(tl.int64) * ssvb + kvh.to(tl.int64) * ssvh,
                SK_P + b.to(tl.int64) * sspb + kvh.to(tl.int64) * ssph,
                sskt, ssvt, sspt, n, SINK_ITERS, q_t, qp_t, m_d, l_d, o_t,
                BTD, DK, DKP, DV, DR, SHARED, HAS_PE, EXACT_F32, INTERP)
        if HAS_REC:
            n = tl.load(REC_LEN + b)
            m_d, l_d, o_t = _geo_dense_tier(
                RK_K + b.to(tl.int64) * srkb + kvh.to(tl.int64) * srkh,
                RK_V + b.to(tl.int64) * srvb + kvh.to(tl.int64) * srvh,
                RK_P + b.to(tl.int64) * srpb + kvh.to(tl.int64) * srph,
                srkt, srvt, srpt, n, REC_ITERS, q_t, qp_t, m_d, l_d, o_t,
                BTD, DK, DKP, DV, DR, SHARED, HAS_PE, EXACT_F32, INTERP)
        l_i = tl.sum(l_d, 0)
        inv_l = tl.where(l_i > 0, 1.0 / l_i, 0.0)
        lse = tl.where(l_i > 0, m_d + tl.log2(l_i), float("-inf"))
        tl.store(LSE + o_rows, lse, mask=hvalid)
        dvd = tl.arange(0, DV)  # (a name of its own: both branches of `if split < NSM` must agree on types)
        tl.store(OP + o_rows[None, :] * DV + dvd[:, None], o_t * inv_l[None, :], mask=hvalid[None, :])




# ----------------------------------------------------------------------------------------------
# Python wrappers
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GeoConfig:
    """Launch choices of the geometry kernel; None = chosen from the shape (`resolve`).

    block_t: middle tokens per tile; heads: query heads per program (of one KV head); num_splits:
    middle splits per (sequence, KV head); q_loop: re-read q's segments from L1 every tile instead of
    holding them in registers (wide keys x many heads: 576 x 16 fp16 is 144 registers a thread);
    waves: programs per SM the split pick aims at; dense_block: tokens per step on the dense tiers;
    num_warps / num_stages: Triton's. impl: "triton" or "cuda" (None: `default_impl` picks): the packed int2
    MLA latent's middle through lowbit.kernels.attention.latent_cuda (16-head blocks of num_warps = 4 or 8 warps, 16
    tokens a warp; block_t / heads / q_loop / zero_mma then apply to the dense tiers' Triton split only); a
    call the CUDA kernel cannot take is refused with the reason."""

    block_t: int | None = None
    heads: int | None = None
    num_splits: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    dense_block: int | None = None
    q_loop: bool | None = None
    waves: int | None = None
    zero_mma: bool | None = None
    impl: str | None = None

    def resolve(self, G: int, DV: int, DK: int | None = None, shared: bool = False, pairs: int | None = None,
                dense_mid: bool = False) -> GeoConfig:
        """Fill the None fields from the shape (G query heads per KV head, value width DV, key width DK
        incl. a dense key part). From the H200 sweep (python -m lowbit.tools.bench.geometry --sweep, L32k):
        narrow values (K192/V128, G = 1): 128-token tiles, one warp (B16 1.66 ms vs 1.89 for 64 x 1
        and 2.85 for 64 x 4); the MLA latent with > 16 heads: 32 heads a program, 32-token tiles
        (B16 int2 1.18 ms vs 1.61 for 16 heads x 64); otherwise (16 heads x 512, Gemma-4 K = V) 16
        heads, 64 tokens, 4 warps. q_loop when q's segments (DK x heads fp16) would hold more than 32
        registers a thread; zero_mma on (neutral to +10%).
        pairs (B x Hkv) and dense_mid (the bf16 latent path): the MLA latent with few sequences has few programs
        per split, and other tiles win (`few_pairs`)."""
        if self.impl not in (None, "triton", "cuda"):
            raise LowbitError(f"GeoConfig.impl must be 'triton' or 'cuda', got {self.impl!r}")
        if self.impl == "cuda":
            # the CUDA latent middle (H200, L32k, git history: `benchmarks/results/geometry/decode_attention_latent_s22_call6_*`): 8 warps,
            # one whole wave of 2 blocks a SM (tp8 B16 0.114 ms, B1 0.030; 128 heads B1 0.069); with many 128-head
            # blocks the 3-blocks-a-SM instance (4 warps, 2 stages; 128 heads B16 0.649 vs 0.664 for 4 warps at 2
            # a SM and 0.704 for 8). The dense tiers' Triton split resolves as below
            many = G > 16 and (pairs or 0) >= 16
            tr = replace(self, impl=None, num_warps=None, num_stages=None, waves=None).resolve(
                G, DV, DK, shared, pairs, dense_mid)
            if self.num_warps is None and self.num_stages is None and many:
                warps, stages, waves = 4, 2, 3
            else:
                warps = self.num_warps or 8
                stages, waves = self.num_stages or (3 if warps == 4 else 2), 2
            return replace(tr, impl="cuda", num_warps=warps, num_stages=stages, waves=self.waves or waves)
        few = few_pairs(G, DV, shared, pairs, dense_mid)
        if few:
            return replace(self, **{k: v for k, v in few.items() if getattr(self, k) is None}).resolve(G, DV, DK, shared)
        DK = DK or DV
        wide = shared and G > 16
        heads = self.heads or min(pow2(G), 32 if wide else 16)
        hp = max(8, pow2(heads))
        narrow = DV <= 128 and hp <= 8
        warps = self.num_warps or (1 if narrow else 4)
        q_loop = self.q_loop if self.q_loop is not None else DK * hp * 2 / 32 > 128
        bt = self.block_t or (128 if narrow else 32 if wide else 64)
        dbt = self.dense_block or (16 if DV >= 512 else 32)
        return GeoConfig(block_t=bt, heads=heads, num_splits=self.num_splits, num_warps=warps,
                         num_stages=self.num_stages or 2, dense_block=dbt, q_loop=bool(q_loop),
                         waves=self.waves or 4, zero_mma=True if self.zero_mma is None else bool(self.zero_mma),
                         impl=self.impl or "triton")


def few_pairs(G: int, DV: int, shared: bool, pairs: int | None, dense_mid: bool) -> dict:
    """Launch fields for the MLA latent (shared, DV >= 512) with few (sequence, KV head) pairs, measured on an H200
    at L32k (git history: `benchmarks/results/geometry/geo_sweep_latent_by_batch_s17_NVIDIA_H200.json`, eight configs per cell; ms, the
    choice vs the shape default): tp8 (16 heads) B1 int2 64-token tiles, 8 heads a program, q in registers 0.031 vs
    0.033, bf16 128 x 8 heads x 8 warps 0.042 vs 0.108; 128 heads B1 int2 128 x 16 x 8 warps 0.130 vs 0.135, B4
    int2 64 x 16 x 4 warps 0.347 vs 0.529. At B4 (tp8) and B16 the shape defaults were best. B2-B3 (128 heads) take
    B4's choice by interpolation, not measurement; B5-B15 keep the defaults ({})."""
    if not shared or DV < 512 or pairs is None:
        return {}
    if G <= 16:
        if pairs != 1:
            return {}
        return (dict(heads=8, q_loop=False, block_t=128, num_warps=8) if dense_mid
                else dict(heads=8, q_loop=False, block_t=64, num_warps=4))
    if dense_mid:
        return {}
    if pairs == 1:
        return dict(heads=16, block_t=128, num_warps=8)
    if 2 <= pairs <= 4:
        return dict(heads=16, block_t=64, num_warps=4)
    return {}


@dataclass(frozen=True)
class GeoLaunch:
    """What one call launched: splits, grid, middle tokens per split, resolved config, mode."""

    num_splits: int
    grid: tuple[int, int, int]
    split_tokens: int
    config: GeoConfig
    mode: str


def chunk_width(S: int, group: int) -> int:
    """Dims per register chunk: gcd(packed row bytes S, group) (a chunk lies in one byte range and group)."""
    return math.gcd(S, group)


def tiling_reason(bits: int, head_dim: int, group: int) -> str | None:
    """Why this kernel has no tiling for `bits`-bit codes of `head_dim` in groups of `group` (None: it
    has). The rule lives once, in lowbit.kv.capabilities.geo_tiling_reason (which the plan asks)."""

    return geo_tiling_reason(bits, head_dim, group)


def _codes(codes, scale, zero, bits, B, Hkv, D, device, what):
    """Check one packed middle tensor (the layout rule is decode_attention's); returns its group."""
    ng = check_packed_tier(codes, scale, zero, bits, B, Hkv, D, device, what)
    if (D * bits // 8) % 4:  # this kernel reads the codes as int32 words
        raise LowbitError(f"{what} codes: rows of {D * bits // 8} bytes; this kernel reads 4-byte words")
    if ng <= 0 or D % ng:
        raise LowbitError(f"{what}: {ng} groups do not divide head_dim {D}")
    r = tiling_reason(bits, D, D // ng)
    if r:
        raise LowbitError(f"{what}: {r}")
    return D // ng


def _dense(t, B, Hkv, D, device, what):
    if t.dim() != 4 or t.shape[0] != B or t.shape[1] != Hkv or t.shape[3] != D:
        raise LowbitError(f"{what} must be [B={B}, Hkv={Hkv}, N, {D}], got {tuple(t.shape)}")
    if t.stride(-1) != 1:
        raise LowbitError(f"{what} needs a contiguous last dim; call .contiguous()")
    if t.device != device:
        raise LowbitError(f"{what} is on {t.device}, q on {device}: put the tiers on one device")
    return t


def seg_width(S: int, group: int) -> int:
    """Dims per segment of a packed row: gcd(row bytes S, group), at most 128 (a segment lies in one
    byte range of the row and in one scale group; its codes are one [BT, W] MMA operand)."""
    return min(math.gcd(S, group), 128)


def pick_splits(B: int, programs: int, T: int, BT: int, sms: int, waves: int, part_bytes: int,
                mid_bytes: int, whole: bool = False) -> int:
    """Middle splits per (sequence, KV head): enough programs for `waves` per SM (flash-decoding),
    at least 2 tiles of BT tokens a split, and -- past one wave -- the partial outputs the splits
    write (part_bytes each, read again by stage 2) under half the middle's own bytes. whole: at most
    waves x sms programs (the CUDA latent kernel's `waves` is its resident blocks a SM: one block past them
    would run alone in a second round)."""
    if T <= 0:
        return 1
    most = max(1, math.ceil(T / (2 * BT)))
    want = max(1, (waves * sms // max(1, programs)) if whole else math.ceil(waves * sms / max(1, programs)))
    one_wave = max(1, math.ceil(sms / max(1, programs)))
    by_bytes = max(one_wave, int(0.5 * mid_bytes / max(1, part_bytes)))
    return int(max(1, min(want, most, by_bytes)))


def default_impl(q, qp, vmid, mid_pe, bits, shared, dense_mid) -> str:
    """The middle's kernel when the caller names none: "cuda" for a packed MLA latent the CUDA kernel takes
    (lowbit.kernels.attention.latent_cuda.why_not is None: int2 512 + 64, bf16, 16-head blocks, nvcc and sm_80+), else
    "triton". On the H200 it was faster in every measured cell (tp8 B16 L32k 0.115 vs 0.204 ms, 128 heads B16
    0.712 vs 1.183, B1 0.069 vs 0.132; tp8 B1 0.030 vs 0.031: git history: `benchmarks/results/geometry/decode_attention_latent_cuda_s22_*`).
    The choice is the launch's (GeoLaunch.config.impl)."""
    if not shared or dense_mid or vmid is None or q.device.type != "cuda":
        return "triton"

    return "cuda" if latent_cuda.why_not(q, qp, *vmid, mid_pe, bits) is None else "triton"


def _run(q, qp, kmid, vmid, mid_pe, mid_lens, k_bits, v_bits, sm_scale, sink, recent, *, shared, dense_mid,
         DK, DV, DR, Hkv, config, out, return_launch):
    """Common launch: kmid/vmid (codes, scale, zero) or None; sink/recent (k, v, pe, lens) or None."""
    B, Hq, _ = q.shape
    dev = q.device
    base = config or GeoConfig()
    picked = base.impl is None  # default_impl checks the call's tensors once (the decode step's path)
    if picked:
        base = replace(base, impl=default_impl(q, qp, vmid, mid_pe, v_bits, shared, dense_mid))
    cfg = base.resolve(Hq // Hkv, DV, DK + DR, shared, pairs=B * Hkv, dense_mid=dense_mid)
    BT, BTD = int(cfg.block_t), int(cfg.dense_block)
    for name, v in (("block_t", BT), ("dense_block", BTD)):
        if v < 16 or v & (v - 1):
            raise LowbitError(f"{name} must be a power of two >= 16, got {v}")
    G = Hq // Hkv
    BH = min(int(cfg.heads), G) if cfg.heads else G
    BH = pow2(BH) if BH < G else BH
    NHB = -(-G // BH)
    HP = max(8, pow2(BH))
    has_mid = vmid is not None
    f16 = torch.zeros(1, dtype=torch.float16, device=dev)
    if has_mid:
        vc, vs, vz = vmid
        T = vc.shape[2]
        if dense_mid:
            GK = GV = DV
            WK = WV = min(DV, 128)
            kc, ks, kz, vs, vz = vc, f16, f16, f16, f16
        else:
            GV = _codes(vc, vs, vz, v_bits, B, Hkv, DV, dev, "V middle" if not shared else "middle")
            WV = seg_width(DV * v_bits // 8, GV)
            if shared:
                kc, ks, kz, GK, WK = vc, vs, vz, GV, WV
            else:
                kc, ks, kz = kmid
                GK = _codes(kc, ks, kz, k_bits, B, Hkv, DK, dev, "K middle")
                if kc.shape[2] != T:
                    raise LowbitError("K and V middle tiers must have the same number of slots T")
                WK = seg_width(DK * k_bits // 8, GK)
        mid_lens = valid_lens(T if mid_lens is None else mid_lens, B, dev, "mid_lens")
        if mid_pe is not None:
            _dense(mid_pe, B, Hkv, DR, dev, "middle pe")
            if mid_pe.shape[2] != T:
                raise LowbitError("the middle pe must have the middle's T slots")
    else:
        T, GK, GV, WK, WV = 0, 16, 16, 16, 16
        kc = vc = torch.zeros(1, dtype=torch.int32, device=dev)
        ks = kz = vs = vz = f16
        mid_lens = torch.zeros(B, dtype=torch.int32, device=dev)
    if DR and mid_pe is None:
        mid_pe = q.new_zeros(1, 1, 1, DR)
    if has_mid and not dense_mid:  # the kernel reads codes as int32 words
        kc, vc = kc.view(torch.int32), vc.view(torch.int32)

    def tier(tr, what):
        if tr is None:
            return None
        k, v, pe, n = tr
        _dense(v, B, Hkv, DV, dev, f"{what} V")
        if not shared:
            _dense(k, B, Hkv, DK, dev, f"{what} K")
        elif DR:
            _dense(pe, B, Hkv, DR, dev, f"{what} pe")
            if pe.shape[2] != v.shape[2]:
                raise LowbitError(f"{what} pe and V must have the same slots")
        if not shared and k.shape[2] != v.shape[2]:
            raise LowbitError(f"{what} K and V must have the same slots")
        lens = valid_lens(v.shape[2] if n is None else n, B, dev, f"{what} lens")
        k = v if shared else k
        pe = pe if (shared and DR) else v
        return k, v, pe, lens

    st, rt = tier(sink, "sink"), tier(recent, "recent")
    has_sink, has_rec = st is not None, rt is not None
    ph = q[:, None]
    st = st or (ph, ph, ph, mid_lens)
    rt = rt or (ph, ph, ph, mid_lens)
    qp = qp if qp is not None else q
    mp = mid_pe if mid_pe is not None else q[:, None]
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(DK + DR)
    interp = dev.type != "cuda"
    if out is None:
        out = torch.empty((B, Hq, DV), dtype=q.dtype, device=dev)
    elif out.shape != (B, Hq, DV) or out.stride(-1) != 1:
        raise LowbitError(f"out must be [B, Hq, Dv] = {(B, Hq, DV)} with a contiguous last dim")

    cuda_mid = cfg.impl == "cuda"
    if cuda_mid:
        if picked:  # the tensors passed default_impl's check: only the resolved instance is left to check
            why = latent_cuda.instance_reason(int(cfg.num_warps), cfg.num_stages)
        elif not shared or dense_mid:
            why = "the CUDA kernel runs a packed shared (latent) middle"
        else:
            why = latent_cuda.why_not(q, qp, vmid[0] if has_mid else None, *(vmid[1:] if has_mid else (None, None)),
                                      mid_pe, v_bits, int(cfg.num_warps), cfg.num_stages)
        if why:
            raise LowbitError(f"GeoConfig(impl='cuda'): {why}; pass impl='triton' (or leave it unset)")
    if has_mid:
        # the CUDA middle: 16-head blocks, 16-token tiles a warp (its split count from the same rule)
        BTM, programs = ((latent_cuda.tile_tokens(int(cfg.num_warps)), B * Hkv * (G // latent_cuda.HEADS)) if cuda_mid
                         else (BT, B * Hkv * NHB))
        nsm = cfg.num_splits
        if not nsm:
            sms = 8 if interp else device_info(cuda_index(dev)).sms
            if dense_mid:
                row = Hkv * (DV + DR) * q.element_size()
            else:
                row = Hkv * (DV * v_bits // 8 + 4 * (DV // GV) + 2 * DR)
                if not shared:
                    row += Hkv * (DK * k_bits // 8 + 4 * (DK // GK))
            nsm = pick_splits(B, programs, T, BTM, sms, int(cfg.waves), Hq * DV * 8, row * T, whole=cuda_mid)
        nsm = max(1, int(nsm))
        split_tokens = max(BTM, math.ceil(max(T, 1) / nsm / BTM) * BTM)
        nsm = max(1, math.ceil(max(T, 1) / split_tokens))
    else:
        nsm, split_tokens = 0, BT
    nsplit = nsm + (1 if (has_sink or has_rec) else 0)
    part = torch.empty((B, Hq, nsplit, DV), dtype=torch.float32, device=dev)
    lse = torch.empty((B, Hq, nsplit), dtype=torch.float32, device=dev)
    grid = (Hkv * NHB, nsplit, B)

    def st2(t):
        return (t.stride(0), t.stride(1)) if t.dim() == 4 else (0, 0)

    def st3(t):
        return (t.stride(0), t.stride(1), t.stride(2)) if t.dim() == 4 else (0, 0, 0)

    split0 = 0
    if cuda_mid:
        if has_mid:
            latent_cuda.stage1(q, qp, vmid[0], vmid[1], vmid[2], mid_pe, mid_lens, part, lse,
                               float(sm_scale) * LOG2E, split_tokens, nsm, int(cfg.num_warps), cfg.num_stages)
        split0 = nsm  # the Triton kernel below runs the dense tiers' split only
        grid = (grid[0], nsplit - nsm, B)
    if grid[1] > 0:
        _triton_stage1(grid, q, qp, kc, ks, kz, vc, vs, vz, mp, mid_lens, st, rt, part, lse, sm_scale, split_tokens,
                       nsm, nsplit, split0, st2, st3, G=G, BH=BH, NHB=NHB, HP=HP, DK=DK, DV=DV, DR=DR,
                       k_bits=k_bits, v_bits=v_bits, GK=GK, GV=GV, WK=WK, WV=WV, shared=shared, dense_mid=dense_mid,
                       cfg=cfg, interp=interp, BT=BT, BTD=BTD, has_sink=has_sink, has_rec=has_rec)
    ch = min(32, max(16, pow2(nsplit)))
    stage2[(B, Hq)](part, lse, out, out.stride(0), out.stride(1), nsplit, NCH=triton.cdiv(nsplit, ch), CH=ch,
                     DV=DV, num_warps=4)
    launch = GeoLaunch(num_splits=nsm, grid=grid, split_tokens=split_tokens, config=cfg,
                       mode="interpreter" if interp else "compiled")
    return (out, launch) if return_launch else out


def _triton_stage1(grid, q, qp, kc, ks, kz, vc, vs, vz, mp, mid_lens, st, rt, part, lse, sm_scale, split_tokens,
                   nsm, nsplit, split0, st2, st3, *, G, BH, NHB, HP, DK, DV, DR, k_bits, v_bits, GK, GV, WK, WV,
                   shared, dense_mid, cfg, interp, BT, BTD, has_sink, has_rec):
    sk, sv, sp, sl = st
    rk, rv, rp, rl = rt
    _geo_stage1[grid](
        q, q.stride(0), q.stride(1), qp, qp.stride(0), qp.stride(1),
        kc, *st2(kc), ks, kz, *st2(ks),
        vc, *st2(vc), vs, vz, *st2(vs),
        mp, *st3(mp), mid_lens,
        sk, sv, sp, *st3(sk), *st3(sv), *st3(sp), sl,
        rk, rv, rp, *st3(rk), *st3(rv), *st3(rp), rl,
        part, lse, float(sm_scale) * LOG2E, int(split_tokens), nsm, nsplit, split0,
        G=G, BH=BH, NHB=NHB, HP=HP, DK=DK, DKP=pow2(DK), DV=DV, DR=max(DR, 16),
        KBITS=k_bits, VBITS=v_bits, GK=GK, GV=GV, WK=WK, WV=WV, SHARED=shared, HAS_PE=bool(DR),
        DENSE_MID=dense_mid, Q_LOOP=bool(cfg.q_loop), USE_PRMT=not interp, ZMMA=bool(cfg.zero_mma),
        BT=BT, BTD=BTD, HAS_SINK=has_sink, HAS_REC=has_rec, INTERP=interp,
        MID_ITERS=(split_tokens // BT) if interp else 0,
        SINK_ITERS=triton.cdiv(sk.shape[2], BTD) if interp else 0,
        REC_ITERS=triton.cdiv(rk.shape[2], BTD) if interp else 0,
        num_warps=int(cfg.num_warps), num_stages=int(cfg.num_stages),
    )


def _check_q(q, what="q"):
    if q.dim() != 3:
        raise LowbitError(f"{what} must be [B, Hq, D], got {tuple(q.shape)}")
    if q.stride(-1) != 1:
        raise LowbitError(f"{what} needs a contiguous last dim; call .contiguous()")


def decode_attention_geo(
    q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, mid_lens=None, *,
    k_bits: int = 2, v_bits: int = 2, sm_scale: float | None = None,
    sink_k=None, sink_v=None, sink_lens=None, recent_k=None, recent_v=None, recent_lens=None,
    config: GeoConfig | None = None, out=None, return_launch: bool = False,
):
    """decode_attention for separate K and V of any head dims (K192/V128, 512, ...): same arguments.

    q        [B, Hq, Dk] (bf16/fp16; fp32 is rounded to fp16 for the packed tier); Hq = G * Hkv.
    k_codes  uint8 [B, Hkv, T, Dk*k_bits/8] strided; k_scale/k_zero fp16 [B, Hkv, T, Dk/group].
    v_codes  uint8 [B, Hkv, T, Dv*v_bits/8]; v_scale/v_zero fp16 [B, Hkv, T, Dv/group]. Dv a power of two.
    mid_lens int32 [B] or int; sink_k/recent_k [B, Hkv, N, Dk], sink_v/recent_v [B, Hkv, N, Dv].
    Returns [B, Hq, Dv] in q's dtype (or into `out`); with return_launch, (out, GeoLaunch).
    """
    check_mode(q.device)
    _check_q(q)
    _, Hq, DK = q.shape
    has_mid, Hkv, DV = tier_heads(Hq, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, v_bits,
                                  sink_k, sink_v, recent_k, recent_v)
    if DK % 16 or DK > 1024 or DV < 16 or DV & (DV - 1) or DV > 1024:
        raise LowbitError(f"head_dim K {DK} / V {DV}: the geometry kernel takes K a multiple of 16 and V a power "
                          "of two, both <= 1024")
    for k, v, what in ((sink_k, sink_v, "sink"), (recent_k, recent_v, "recent")):
        if (k is None) != (v is None):
            raise LowbitError(f"{what}: pass both its K and V tensors or neither")
    sink = (sink_k, sink_v, None, sink_lens) if sink_k is not None else None
    recent = (recent_k, recent_v, None, recent_lens) if recent_k is not None else None
    return _run(q, None, (k_codes, k_scale, k_zero) if has_mid else None, (v_codes, v_scale, v_zero) if has_mid else None,
                None, mid_lens, k_bits, v_bits, sm_scale, sink, recent, shared=False, dense_mid=False,
                DK=DK, DV=DV, DR=0, Hkv=Hkv, config=config, out=out, return_launch=return_launch)


def decode_attention_latent(
    q_lat, q_pe, codes, scale, zero, pe, mid_lens=None, *,
    bits: int = 2, sm_scale: float | None = None,
    sink_v=None, sink_pe=None, sink_lens=None, recent_v=None, recent_pe=None, recent_lens=None,
    dense_mid: bool = False, config: GeoConfig | None = None, out=None, return_launch: bool = False,
):
    """Decode attention over a shared K/V tensor x (MLA latent c_kv, or Gemma-4's K = V) plus a dense key part.

    score_t = (q_lat . x_t + q_pe . pe_t) * sm_scale,  out = softmax(score) @ x   (per q head).
    q_lat    [B, Hq, D] (bf16/fp16): the query against x (MLA: q_nope absorbed by W_uk; rotated by
             x's rotation when it has one).  q_pe [B, Hq, DR] or None (no dense key part).
    codes    uint8 [B, Hkv, T, D*bits/8] strided, scale/zero fp16 [B, Hkv, T, D/group]: x of the middle;
             with dense_mid, `codes` is x itself in the model dtype [B, Hkv, T, D] (scale/zero None).
    pe       [B, Hkv, T, DR] model dtype: the middle's dense key part (None when q_pe is None).
    sink_v / recent_v [B, Hkv, N, D], sink_pe / recent_pe [B, Hkv, N, DR]: the dense tiers.
    mid_lens / sink_lens / recent_lens int32 [B] or int (default: every slot).
    sm_scale default 1/sqrt(D + DR). D a power of two; DR a power of two >= 16 (64: MLA; 128: Gemma-4).
    Returns [B, Hq, D] in q_lat's dtype (or into `out`); with return_launch, (out, GeoLaunch).
    """
    check_mode(q_lat.device)
    _check_q(q_lat, "q_lat")
    B, Hq, D = q_lat.shape
    DR = 0
    if q_pe is not None:
        _check_q(q_pe, "q_pe")
        if q_pe.shape[:2] != (B, Hq):
            raise LowbitError(f"q_pe must be [B={B}, Hq={Hq}, DR], got {tuple(q_pe.shape)}")
        DR = q_pe.shape[2]
        if DR < 16 or DR & (DR - 1):
            raise LowbitError(f"the dense key part has {DR} dims; the kernel takes a power of two >= 16")
    if D < 16 or D & (D - 1) or D > 1024:
        raise LowbitError(f"shared K/V width {D}: the kernel takes a power of two in [16, 1024]")
    has_mid = codes is not None
    if has_mid:
        Hkv = codes.shape[1]
        if dense_mid:
            _dense(codes, B, Hkv, D, q_lat.device, "dense middle")
            if codes.shape[2] > 1 and codes.stride(2) != D:
                raise LowbitError("dense middle rows must be contiguous [T, D] per head")
        elif scale is None or zero is None:
            raise LowbitError("middle tier: pass codes, scale and zero together")
        if DR and pe is None:
            raise LowbitError("q_pe given but no middle pe: pass the middle's dense key part")
    else:
        ref = sink_v if sink_v is not None else recent_v
        if ref is None:
            raise LowbitError("no tier given: pass the middle tier and/or a dense tier")
        Hkv = ref.shape[1]
    if Hkv == 0 or Hq % Hkv:
        raise LowbitError(f"Hq={Hq} is not a multiple of Hkv={Hkv}")
    for v, p, what in ((sink_v, sink_pe, "sink"), (recent_v, recent_pe, "recent")):
        if v is not None and DR and p is None:
            raise LowbitError(f"{what}: pass its pe with its V (q_pe is given)")
    sink = (None, sink_v, sink_pe, sink_lens) if sink_v is not None else None
    recent = (None, recent_v, recent_pe, recent_lens) if recent_v is not None else None
    return _run(q_lat, q_pe, None, (codes, scale, zero) if has_mid else None, pe if DR else None, mid_lens,
                bits, bits, sm_scale, sink, recent, shared=True, dense_mid=dense_mid, DK=D, DV=D, DR=DR,
                Hkv=Hkv, config=config, out=out, return_launch=return_launch)
