"""Split-K decode attention over a packed shared latent (MLA c_kv, Gemma-4 K = V): one dequantization
per tile, used by both products (Triton).

The geometry kernel (lowbit.kernels.decode_geometry) reads a latent tile twice: token-major for the
scores and token-minor, byte-paired, for the values, and holds q's segments in registers of every
warp. At 16 heads x 576 dims that is 255 registers a thread and ~500 B of spills (sm_90 compile,
benchmarks/compile_geo_sm90.py), and int2 ran no faster than its bf16 twin. Here a tile's codes are
turned into fp16 once, x_g [BT, W] per group g (W = 128 dims at bit offset g*bits of every byte of
the `strided` row), and both products read them:

    scores  s [BT, HP]   = sum_g scale_g * (x_g @ q_g) + zero_g * sum(q_g) + pe @ q_pe
    values  O_g^T [W, HP] += x_g^T @ (p * scale_g)          (a fresh product per tile, folded by one FMA)
    zeros   Z [16, HP]    += [zero_0..zero_3 | 1]^T @ p      (hi + lo halves of p: ~fp32; row 4: sum of p)

x_g holds code * 2**(g*bits - 24) (a masked word IS two fp16 subnormals, lowbit.kernels.decode_geometry
._codes_k); the powers of two go into q (exact) and into the output scale. With >= 4 warps and >= 64
tokens a tile both products qualify for Hopper's warpgroup MMA, whose B operand (q; p) is read from
shared memory instead of being copied into every warp's registers.

Tiers: the middle only (the packed c_kv [B, Hkv, T, D*bits/8], scale/zero fp16 [B, Hkv, T, D/128],
pe [B, Hkv, T, DR]); decode_attention_latent keeps the dense sink/recent tiers and the merge. Shapes:
D = 512 (4 groups of 128 at 2 bits, the only layout this kernel takes), DR a power of two >= 16.
"""

from __future__ import annotations

import triton
import triton.language as tl

from lowbit.kernels.decode_geometry import _codes_k, _q_seg, _seg_dims


@triton.jit
def _columns4(a):
    """[BT, 4] -> its four columns [BT]."""
    ev, od = tl.split(tl.reshape(a, (a.shape[0], 2, 2)))  # ev[t, i] = a[t, 2i], od[t, i] = a[t, 2i + 1]
    c0, c2 = tl.split(ev)
    c1, c3 = tl.split(od)
    return c0, c1, c2, c3


@triton.jit
def _lat_stage1(
    Q, sqb, sqh, QP, sqpb, sqph,
    KW, skb, skh, KS, KZ, sksb, sksh,
    MP, smpb, smph, smpt, MID_LEN,
    OP, LSE,
    qk_scale, split_tokens, NSPLIT, OUT_SPLIT0,
    G: tl.constexpr, BH: tl.constexpr, NHB: tl.constexpr, HP: tl.constexpr,
    D: tl.constexpr, DR: tl.constexpr, BITS: tl.constexpr, GRP: tl.constexpr,
    BT: tl.constexpr, RELOAD: tl.constexpr, PV_ACC: tl.constexpr, INTERP: tl.constexpr, MID_ITERS: tl.constexpr,
):
    """Grid (Hkv * NHB head blocks, middle splits, B). Writes split OUT_SPLIT0 + split of every head's
    partial output OP [B*Hq, NSPLIT, D] (normalised) and its log2-sum-exp LSE [B*Hq, NSPLIT]."""
    hb_kv = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2)
    kvh = hb_kv // NHB
    hl = (hb_kv % NHB) * BH + tl.arange(0, HP)
    hvalid = (tl.arange(0, HP) < BH) & (hl < G)
    head = kvh * G + hl
    q_base = Q + b.to(tl.int64) * sqb + head * sqh
    qp_base = QP + b.to(tl.int64) * sqpb + head * sqph
    o_rows = (b.to(tl.int64) * (G * (tl.num_programs(0) // NHB)) + head) * NSPLIT + OUT_SPLIT0 + split

    S: tl.constexpr = D * BITS // 8  # bytes a row
    W: tl.constexpr = S  # dims a group = a segment (D = 512 at 2 bits, group 128: S = W = 128)
    NG: tl.constexpr = D // GRP
    # q per group (fp16, columns in _codes_k order, times 2**-(g*bits)) and its sum
    q0, f0 = _q_seg(q_base, hvalid, 0, W, 1, BITS, False, tl.float16)
    q1, f1 = _q_seg(q_base, hvalid, 1, W, 1, BITS, False, tl.float16)
    q2, f2 = _q_seg(q_base, hvalid, 2, W, 1, BITS, False, tl.float16)
    q3, f3 = _q_seg(q_base, hvalid, 3, W, 1, BITS, False, tl.float16)
    qs0, qs1, qs2, qs3 = tl.sum(f0, 0), tl.sum(f1, 0), tl.sum(f2, 0), tl.sum(f3, 0)
    qp = tl.load(qp_base[None, :] + tl.arange(0, DR)[:, None], mask=hvalid[None, :], other=0.0)  # [DR, HP]

    L = tl.load(MID_LEN + b)
    start = split * split_tokens
    end = tl.minimum(start + split_tokens, L)
    kw_base = KW + b.to(tl.int64) * skb + kvh.to(tl.int64) * skh
    ks_base = KS + b.to(tl.int64) * sksb + kvh.to(tl.int64) * sksh
    kz_base = KZ + b.to(tl.int64) * sksb + kvh.to(tl.int64) * sksh
    pe_base = MP + b.to(tl.int64) * smpb + kvh.to(tl.int64) * smph

    m_i = tl.full([HP], float("-inf"), tl.float32)
    z_acc = tl.zeros([16, HP], tl.float32)
    o0 = tl.zeros([W, HP], tl.float32)
    o1 = tl.zeros([W, HP], tl.float32)
    o2 = tl.zeros([W, HP], tl.float32)
    o3 = tl.zeros([W, HP], tl.float32)
    zr = tl.arange(0, 16)
    n_it = tl.cdiv(tl.maximum(end - start, 0), BT)
    for it in range(MID_ITERS if INTERP else n_it):
        tok = start + it * BT + tl.arange(0, BT)
        valid = tok < end
        w = tl.load(kw_base + tok[:, None] * (S // 4) + tl.arange(0, S // 4)[None, :], mask=valid[:, None], other=0,
                    eviction_policy="evict_last")
        sc = tl.load(ks_base + tok[:, None] * NG + tl.arange(0, NG)[None, :], mask=valid[:, None], other=0.0)
        ze = tl.load(kz_base + tok[:, None] * NG + tl.arange(0, NG)[None, :], mask=valid[:, None], other=0.0)
        pe = tl.load(pe_base + tok[:, None] * smpt + tl.arange(0, DR)[None, :], mask=valid[:, None], other=0.0)
        x0 = _codes_k(w, 0 * BITS, BITS)
        x1 = _codes_k(w, 1 * BITS, BITS)
        x2 = _codes_k(w, 2 * BITS, BITS)
        x3 = _codes_k(w, 3 * BITS, BITS)
        sc0, sc1, sc2, sc3 = _columns4(sc.to(tl.float32))  # [BT] each
        z0, z1, z2, z3 = _columns4(ze.to(tl.float32))
        # ---- scores [BT, HP] ----
        if INTERP:
            s = tl.dot(pe.to(tl.float32), qp.to(tl.float32))
        else:
            s = tl.dot(pe, qp)
        s += (sc0 * 16777216.0)[:, None] * tl.dot(x0, q0)
        s += (sc1 * 16777216.0)[:, None] * tl.dot(x1, q1)
        s += (sc2 * 16777216.0)[:, None] * tl.dot(x2, q2)
        s += (sc3 * 16777216.0)[:, None] * tl.dot(x3, q3)
        s += (z0[:, None] * qs0[None, :] + z1[:, None] * qs1[None, :]) + (z2[:, None] * qs2[None, :]
                                                                        + z3[:, None] * qs3[None, :])
        s = tl.where(valid[:, None], s * qk_scale, float("-inf"))
        # ---- online softmax ----
        m_new = tl.maximum(m_i, tl.max(s, 0))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[None, :])
        m_i = m_new
        # ---- zero terms and the softmax sum: one small MMA (p split hi + lo) ----
        zt = tl.load(kz_base + tok[None, :] * NG + zr[:, None], mask=(zr < NG)[:, None] & valid[None, :], other=0.0)
        zt = tl.where((zr == NG)[:, None] & valid[None, :], 1.0, zt.to(tl.float32)).to(tl.float16)  # [16, BT]
        p_hi = p.to(tl.float16)
        p_lo = (p - p_hi.to(tl.float32)).to(tl.float16)
        z_acc = tl.fma(z_acc, alpha[None, :], tl.dot(zt, p_lo, tl.dot(zt, p_hi)))
        # ---- values: x_g again, transposed ----
        if RELOAD:
            # the words re-read (from L1) and re-masked, so that no x_g is live across the softmax
            w2 = tl.load(kw_base + tok[:, None] * (S // 4) + tl.arange(0, S // 4)[None, :], mask=valid[:, None],
                         other=0, eviction_policy="evict_first")
            x0 = _codes_k(w2, 0 * BITS, BITS)
            x1 = _codes_k(w2, 1 * BITS, BITS)
            x2 = _codes_k(w2, 2 * BITS, BITS)
            x3 = _codes_k(w2, 3 * BITS, BITS)
        if PV_ACC:  # accumulate in the MMA (its operands need not outlive it)
            o0 = tl.dot(tl.trans(x0), (p * sc0[:, None]).to(tl.float16), o0 * alpha[None, :])
            o1 = tl.dot(tl.trans(x1), (p * sc1[:, None]).to(tl.float16), o1 * alpha[None, :])
            o2 = tl.dot(tl.trans(x2), (p * sc2[:, None]).to(tl.float16), o2 * alpha[None, :])
            o3 = tl.dot(tl.trans(x3), (p * sc3[:, None]).to(tl.float16), o3 * alpha[None, :])
        else:  # a fresh product per tile, folded by one FMA (the MMA's truncating adds sum BT tokens only)
            o0 = tl.fma(o0, alpha[None, :], tl.dot(tl.trans(x0), (p * sc0[:, None]).to(tl.float16)))
            o1 = tl.fma(o1, alpha[None, :], tl.dot(tl.trans(x1), (p * sc1[:, None]).to(tl.float16)))
            o2 = tl.fma(o2, alpha[None, :], tl.dot(tl.trans(x2), (p * sc2[:, None]).to(tl.float16)))
            o3 = tl.fma(o3, alpha[None, :], tl.dot(tl.trans(x3), (p * sc3[:, None]).to(tl.float16)))

    l_i = tl.sum(tl.where((zr == NG)[:, None], z_acc, 0.0), 0)
    inv_l = tl.where(l_i > 0, 1.0 / l_i, 0.0)
    lse = tl.where(l_i > 0, m_i + tl.log2(l_i), float("-inf"))
    tl.store(LSE + o_rows, lse, mask=hvalid)
    for j in tl.static_range(4):
        if j == 0:
            o = o0
        elif j == 1:
            o = o1
        elif j == 2:
            o = o2
        else:
            o = o3
        z = tl.sum(tl.where((zr == j)[:, None], z_acc, 0.0), 0) * inv_l
        res = o * (inv_l * (1 << (24 - j * BITS)))[None, :] + z[None, :]
        dv = _seg_dims(j, W, False, False)
        tl.store(OP + o_rows[None, :] * D + dv[:, None], res, mask=hvalid[None, :])


def latent_middle(q_lat, q_pe, codes, scale, zero, pe, mid_lens, *, bits: int, sm_scale: float, heads: int,
                  block_t: int, num_warps: int, num_splits: int, part, lse, out_split0: int, num_stages: int = 2, reload: bool = True,
                  pv_acc: bool = False):
    """Launch _lat_stage1 over the middle tier into part [B, Hq, NSPLIT, D] / lse [B, Hq, NSPLIT] at splits
    [out_split0, out_split0 + num_splits). q_lat [B, Hq, D], q_pe [B, Hq, DR], codes int32 view
    [B, Hkv, T, D*bits/32], scale/zero fp16 [B, Hkv, T, D/128], pe [B, Hkv, T, DR], mid_lens int32 [B].
    Returns the middle tokens a split covers."""
    B, Hq, D = q_lat.shape
    Hkv, T = codes.shape[1], codes.shape[2]
    DR = q_pe.shape[2]
    G = Hq // Hkv
    BH = min(heads, G)
    NHB = -(-G // BH)
    HP = max(16, triton.next_power_of_2(BH))
    split_tokens = max(block_t, -(-max(T, 1) // num_splits // block_t) * block_t)
    nsm = max(1, -(-max(T, 1) // split_tokens))
    interp = q_lat.device.type != "cuda"
    _lat_stage1[(Hkv * NHB, nsm, B)](
        q_lat, q_lat.stride(0), q_lat.stride(1), q_pe, q_pe.stride(0), q_pe.stride(1),
        codes, codes.stride(0), codes.stride(1), scale, zero, scale.stride(0), scale.stride(1),
        pe, pe.stride(0), pe.stride(1), pe.stride(2), mid_lens,
        part, lse, float(sm_scale) * 1.4426950408889634, int(split_tokens), part.shape[2], int(out_split0),
        G=G, BH=BH, NHB=NHB, HP=HP, D=D, DR=DR, BITS=bits, GRP=128, BT=block_t, RELOAD=reload, PV_ACC=pv_acc, INTERP=interp,
        MID_ITERS=(split_tokens // block_t) if interp else 0, num_warps=num_warps, num_stages=num_stages)
    return nsm, split_tokens
