"""Paged attention over lowbit's packed cells in vLLM's block table (Triton), and its torch twin.

The cache is the CPU plugin's (paged.py / slot.py): uint8 [num_blocks, H_kv, block_size, slot_bytes],
token t of a request in block block_table[r, t // bs] at offset t % bs, one cell per (token, KV head):

    [ K codes D_k*cb/8 B | K scale fp16 | K zero fp16 | V codes | V scale | V zero | pad ]

(SlotFormat; codes in lowbit.quant.packing's "strided" layout: byte j holds dims j + i*S, S = D*cb/8,
x = code * scale + zero per group -- the dequant of lowbit.kv.codec.TensorCodec). Rows are rotated.

The exact tiers (a request's first `sink` and last `recent` positions) live in a dense pool beside
the cache, keyed by physical block: dmap int32 [num_blocks] -> a pool slot (-1: none), pool_k/pool_v
[S, bs, H_kv, D] in the model dtype, dvalid uint8 [S, bs] (the row was written). A tier row whose
block has no slot (or whose row was not written) is read from its codes (every row is also packed).

One kernel serves decode and prefill. A *tile* is up to BM query tokens of one request (decode: one);
a program takes one tile, one KV head, and either a range of BPS history blocks (split s < NSPLIT) or
the request's own new tokens (split NSPLIT: the chunk as it arrived, rotated, causal), and all G query
heads of that KV head at once (every code is dequantized once per GQA group). Each program writes its
partial output normalised by its own softmax sum and its log2-sum-exp; `merge` combines the splits,
an empty split (no valid key: lse -inf) gets weight 0, a row with no key at all gets zeros (never NaN).
No host synchronisation: grids come from host-known sizes (tiles, the block table's width), every
length is read on the device -- the launch can be captured in a CUDA graph.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


def _pow2(n: int) -> int:
    return 1 << max(0, int(n - 1).bit_length())


@triton.jit
def _f16_at(C16, idx, mask):
    """fp16 values stored at int16 index idx of the cache (a byte view's fields are 2-aligned)."""
    return tl.load(C16 + idx, mask=mask, other=0).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _deq(C8, C16, cell, mask, D: tl.constexpr, CB: tl.constexpr, GRP: tl.constexpr,
         C_OFF: tl.constexpr, S_OFF: tl.constexpr, Z_OFF: tl.constexpr):
    """cell [N] byte offsets of N cells -> x [N, D] float32 (codes * scale + zero). Each code byte and each
    scale / zero is loaded once: byte j of a cell holds dims j + i*S at bit i*CB ("strided" packing)."""
    S: tl.constexpr = D * CB // 8
    P: tl.constexpr = 8 // CB
    NG: tl.constexpr = D // GRP
    N: tl.constexpr = cell.shape[0]
    j = tl.arange(0, S)
    byte = tl.load(C8 + cell[:, None] + C_OFF + j[None, :], mask=mask[:, None], other=0).to(tl.int32)  # [N, S]
    sh = (tl.arange(0, P) * CB)[None, :, None]
    code = (byte[:, None, :] >> sh) & ((1 << CB) - 1)  # [N, P, S]: dim i*S + j
    code = tl.reshape(code, (N, NG, GRP)).to(tl.float32)
    gi = tl.arange(0, NG)
    sc = _f16_at(C16, (cell[:, None] + S_OFF) // 2 + gi[None, :], mask[:, None])  # [N, NG]
    ze = _f16_at(C16, (cell[:, None] + Z_OFF) // 2 + gi[None, :], mask[:, None])
    return tl.reshape(code * sc[:, :, None] + ze[:, :, None], (N, D))


@triton.jit
def _softcap(s, SOFTCAP: tl.constexpr, cap):
    if SOFTCAP:
        x = s / cap
        t = tl.exp2(-2.0 * 1.4426950408889634 * tl.abs(x))
        th = (1.0 - t) / (1.0 + t)
        s = cap * tl.where(x < 0, -th, th)
    return s


@triton.jit
def _online(s, v, m_i, l_i, acc):
    """One online-softmax step (base 2): scores s [M, N] (masked -inf), values v [N, D] float32."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v.to(tl.float16))
    return m_new, l_i, acc


@triton.jit
def _hist_block(jb, m_i, l_i, acc, q16, row_ok, r, seq, hist, pid_h, offs, dk, dv,
                C8, C16, TABLE, PK, PV, DMAP, DVALID, stride_tb, cap, SINK, RECENT,
                H: tl.constexpr, BS: tl.constexpr, SB: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                KCB: tl.constexpr, KG: tl.constexpr, KC_OFF: tl.constexpr, KS_OFF: tl.constexpr, KZ_OFF: tl.constexpr,
                VCB: tl.constexpr, VG: tl.constexpr, VC_OFF: tl.constexpr, VS_OFF: tl.constexpr, VZ_OFF: tl.constexpr,
                HAS_TIERS: tl.constexpr, SOFTCAP: tl.constexpr):
    """History block jb of request r: its packed cells (or dense tier rows) -> one online-softmax step."""
    blk = tl.load(TABLE + r * stride_tb + jb).to(tl.int64)
    pos = jb * BS + offs
    valid = pos < hist
    cell = ((blk * H + pid_h) * BS + offs) * SB
    k = _deq(C8, C16, cell, valid, DK, KCB, KG, KC_OFF, KS_OFF, KZ_OFF)
    v = _deq(C8, C16, cell, valid, DV, VCB, VG, VC_OFF, VS_OFF, VZ_OFF)
    if HAS_TIERS:
        dslot = tl.load(DMAP + blk)
        tier = (pos < SINK) | (pos >= seq - RECENT)
        has = tier & valid & (dslot >= 0)
        dsl = tl.maximum(dslot, 0).to(tl.int64)
        dv_ok = tl.load(DVALID + dsl * BS + offs, mask=has, other=0)
        use = has & (dv_ok != 0)
        prow = (dsl * BS + offs) * H + pid_h
        kd = tl.load(PK + prow[:, None] * DK + dk[None, :], mask=use[:, None], other=0.0).to(tl.float32)
        vd = tl.load(PV + prow[:, None] * DV + dv[None, :], mask=use[:, None], other=0.0).to(tl.float32)
        k = tl.where(use[:, None], kd, k)
        v = tl.where(use[:, None], vd, v)
    s = tl.dot(q16, tl.trans(k.to(tl.float16)))
    if SOFTCAP:
        s = _softcap(s, SOFTCAP, cap) * 1.4426950408889634
    s = tl.where(valid[None, :] & row_ok[:, None], s, float("-inf"))
    return _online(s, v, m_i, l_i, acc)


@triton.jit
def _own_block(c0, t_end, m_i, l_i, acc, q16, row_ok, tok, pid_h, offs, dk, dv, KN, VN,
               stride_knt, stride_knh, stride_vnt, stride_vnh, cap, SOFTCAP: tl.constexpr):
    """New tokens c0 .. c0 + BS - 1 of the request (as they arrived), causal -> one online-softmax step."""
    kt = c0 + offs
    ok = kt < t_end
    k = tl.load(KN + kt[:, None] * stride_knt + pid_h * stride_knh + dk[None, :], mask=ok[:, None],
                other=0.0).to(tl.float32)
    v = tl.load(VN + kt[:, None] * stride_vnt + pid_h * stride_vnh + dv[None, :], mask=ok[:, None],
                other=0.0).to(tl.float32)
    s = tl.dot(q16, tl.trans(k.to(tl.float16)))
    if SOFTCAP:
        s = _softcap(s, SOFTCAP, cap) * 1.4426950408889634
    s = tl.where(ok[None, :] & (kt[None, :] <= tok[:, None]) & row_ok[:, None], s, float("-inf"))
    return _online(s, v, m_i, l_i, acc)


@triton.jit
def _paged_attn_kernel(
        Q, KN, VN, C8, C16, TABLE, SEQ, QSL, TILE_REQ, TILE_T0,
        PK, PV, DMAP, DVALID, OUT, LSE,
        sm_scale, cap, SINK, RECENT, T_OUT,
        stride_qt, stride_qh, stride_knt, stride_knh, stride_vnt, stride_vnh, stride_tb,
        H: tl.constexpr, G: tl.constexpr, HP: tl.constexpr, BM: tl.constexpr, BS: tl.constexpr,
        SB: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
        KCB: tl.constexpr, KG: tl.constexpr, KC_OFF: tl.constexpr, KS_OFF: tl.constexpr, KZ_OFF: tl.constexpr,
        VCB: tl.constexpr, VG: tl.constexpr, VC_OFF: tl.constexpr, VS_OFF: tl.constexpr, VZ_OFF: tl.constexpr,
        BPS: tl.constexpr, NSPLIT: tl.constexpr, HAS_TIERS: tl.constexpr, SOFTCAP: tl.constexpr,
        INTERP: tl.constexpr):
    pid_s = tl.program_id(0)
    pid_h = tl.program_id(1)
    pid_t = tl.program_id(2)
    r = tl.load(TILE_REQ + pid_t)
    t0 = tl.load(TILE_T0 + pid_t)
    qs = tl.load(QSL + r)
    qe = tl.load(QSL + r + 1)
    seq = tl.load(SEQ + r)
    hist = seq - (qe - qs)  # keys stored before this step
    M: tl.constexpr = BM * HP
    m = tl.arange(0, M)
    tok = t0 + m // HP
    g = m % HP
    row_ok = (tok < qe) & (g < G) & (tok >= qs)
    qhead = pid_h * G + g
    dk = tl.arange(0, DK)
    dv = tl.arange(0, DV)
    q = tl.load(Q + tok[:, None] * stride_qt + qhead[:, None] * stride_qh + dk[None, :], mask=row_ok[:, None],
                other=0.0).to(tl.float32)
    if not SOFTCAP:
        q = q * (sm_scale * 1.4426950408889634)
    else:
        q = q * sm_scale
    q16 = q.to(tl.float16)
    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, DV], tl.float32)
    offs = tl.arange(0, BS)
    if pid_s < NSPLIT:
        nblk = (hist + BS - 1) // BS
        b_lo = pid_s * BPS
        b_hi = tl.minimum(b_lo + BPS, nblk)
        if INTERP:  # the interpreter cannot take device scalars as range() bounds (numpy 2)
            jb = b_lo
            while jb < b_hi:
                m_i, l_i, acc = _hist_block(jb, m_i, l_i, acc, q16, row_ok, r, seq, hist, pid_h, offs, dk, dv,
                                            C8, C16, TABLE, PK, PV, DMAP, DVALID, stride_tb, cap, SINK, RECENT,
                                            H, BS, SB, DK, DV, KCB, KG, KC_OFF, KS_OFF, KZ_OFF,
                                            VCB, VG, VC_OFF, VS_OFF, VZ_OFF, HAS_TIERS, SOFTCAP)
                jb += 1
        else:
            for jb in range(b_lo, b_hi):
                m_i, l_i, acc = _hist_block(jb, m_i, l_i, acc, q16, row_ok, r, seq, hist, pid_h, offs, dk, dv,
                                            C8, C16, TABLE, PK, PV, DMAP, DVALID, stride_tb, cap, SINK, RECENT,
                                            H, BS, SB, DK, DV, KCB, KG, KC_OFF, KS_OFF, KZ_OFF,
                                            VCB, VG, VC_OFF, VS_OFF, VZ_OFF, HAS_TIERS, SOFTCAP)
    else:
        # the request's own new tokens, as they arrived (rotated), causal: token j sees new tokens <= j
        t_end = tl.minimum(qe, t0 + BM)
        if INTERP:
            c0 = qs
            while c0 < t_end:
                m_i, l_i, acc = _own_block(c0, t_end, m_i, l_i, acc, q16, row_ok, tok, pid_h, offs, dk, dv, KN, VN,
                                           stride_knt, stride_knh, stride_vnt, stride_vnh, cap, SOFTCAP)
                c0 += BS
        else:
            for c0 in range(qs, t_end, BS):
                m_i, l_i, acc = _own_block(c0, t_end, m_i, l_i, acc, q16, row_ok, tok, pid_h, offs, dk, dv, KN, VN,
                                           stride_knt, stride_knh, stride_vnt, stride_vnh, cap, SOFTCAP)
    empty = l_i == 0.0
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    orow = (pid_s * T_OUT + pid_t * BM + m // HP) * (H * G) + qhead  # partials by tile row (T_OUT = tiles x BM)
    tl.store(OUT + orow[:, None] * DV + dv[None, :], o, mask=row_ok[:, None])
    tl.store(LSE + orow, lse, mask=row_ok)


@triton.jit
def _merge_kernel(OUT, LSE, DST, TILE_REQ, TILE_T0, QSL, T_OUT, HQ: tl.constexpr, DV: tl.constexpr,
                  NSP: tl.constexpr, NSP_P: tl.constexpr, BM: tl.constexpr):
    """dst[token, h] = sum_s w_s o_s / sum_s w_s, w_s = 2**(lse_s - max lse) over the splits of tile row i
    (token tile_t0 + i % BM of its tile's request; rows past the request's end are skipped); all splits
    empty -> 0 (never NaN)."""
    i = tl.program_id(0)
    h = tl.program_id(1)
    tile = i // BM
    r = tl.load(TILE_REQ + tile)
    t = tl.load(TILE_T0 + tile) + i % BM
    live = t < tl.load(QSL + r + 1)
    s = tl.arange(0, NSP_P)
    sok = (s < NSP) & live
    row = (s * T_OUT + i) * HQ + h
    lse = tl.load(LSE + row, mask=sok, other=float("-inf"))
    mx = tl.max(lse, 0)
    mx_safe = tl.where(mx == float("-inf"), 0.0, mx)
    w = tl.where(lse == float("-inf"), 0.0, tl.exp2(lse - mx_safe))
    den = tl.sum(w, 0)
    dv = tl.arange(0, DV)
    o = tl.load(OUT + row[:, None] * DV + dv[None, :], mask=sok[:, None] & (w > 0)[:, None], other=0.0)
    acc = tl.sum(o * w[:, None], 0)
    res = acc / tl.where(den > 0, den, 1.0)
    tl.store(DST + (t.to(tl.int64) * HQ + h) * DV + dv, res, mask=(dv < DV) & live)


def _interp() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def kernel_meta(fmt) -> dict:
    """The kernel's constexprs for a SlotFormat (lowbit.vllm_plugin.slot): field offsets, container bits, groups."""
    meta = {"SB": fmt.slot_bytes}
    for which, p in (("k", "K"), ("v", "V")):
        c = fmt.codecs[which]
        meta.update({f"{p}CB": c.cbits, f"{p}G": c.group, f"{p}C_OFF": fmt.field(which, "codes").offset,
                     f"{p}S_OFF": fmt.field(which, "scale").offset, f"{p}Z_OFF": fmt.field(which, "zero").offset})
    return meta


def empty_tiers(device) -> tuple:
    """(pool_k, pool_v, dmap, dvalid) placeholders for a layer without exact tiers."""
    z = torch.zeros(1, dtype=torch.float16, device=device)
    return z, z, torch.full((1,), -1, dtype=torch.int32, device=device), torch.zeros(1, dtype=torch.uint8, device=device)


def paged_attention(q, k_new, v_new, cache_u8, fmt, block_table, seq_lens, query_start_loc, tile_req, tile_t0,
                    *, bm: int, scale: float, sink: int = 0, recent: int = 0, tiers=None, softcap: float = 0.0,
                    blocks_per_split: int = 32, n_splits: int | None = None, out: torch.Tensor | None = None):
    """Attention of a batch's new queries over the paged packed cache and their own new tokens.

    q [T, Hq, D_k] rotated (any float dtype); k_new [T, H, D_k], v_new [T, H, D_v] the new tokens rotated
    (their own chunk: exact); cache_u8 [NB, H, bs, slot_bytes]; block_table int32 [R, MB]; seq_lens int32
    [R] (tokens held after this step); query_start_loc int32 [R + 1]; tile_req / tile_t0 int32 [n_tiles]
    (tile i = tokens tile_t0[i] .. + bm - 1 of request tile_req[i], cut at the request's end).
    tiers: (pool_k, pool_v, dmap, dvalid) or None. n_splits: history splits (default: the block table's
    width / blocks_per_split -- a static maximum: no host sync). Returns float32 [T, Hq, D_v] (rotated).
    """
    T, Hq, Dk = q.shape
    _, H, BS, _ = cache_u8.shape
    G = Hq // H
    Dv = fmt.codecs["v"].head_dim
    MB = block_table.shape[1]
    nsplit = n_splits if n_splits is not None else max(1, -(-MB // blocks_per_split))
    bps = max(1, -(-MB // nsplit)) if n_splits is not None else blocks_per_split
    HP = max(_pow2(G), -(-16 // bm))
    has_tiers = tiers is not None and (sink > 0 or recent > 0)
    pk, pv, dmap, dvalid = tiers if has_tiers else empty_tiers(q.device)
    n_tiles = tile_req.shape[0]
    NT = n_tiles * bm  # partial rows: one per tile row, not per batch token (a mixed batch's prefill is elsewhere)
    o_part = torch.empty(nsplit + 1, NT, Hq, Dv, dtype=torch.float32, device=q.device)
    lse = torch.empty(nsplit + 1, NT, Hq, dtype=torch.float32, device=q.device)
    if out is None:
        out = torch.zeros(T, Hq, Dv, dtype=torch.float32, device=q.device)
    if T == 0 or n_tiles == 0:
        return out
    lse.fill_(float("-inf"))  # o_part needs no fill: merge reads a split's output only where its weight > 0
    c16 = cache_u8.view(torch.int16)
    meta = kernel_meta(fmt)
    _paged_attn_kernel[(nsplit + 1, H, n_tiles)](
        q, k_new, v_new, cache_u8, c16, block_table, seq_lens, query_start_loc, tile_req, tile_t0,
        pk, pv, dmap, dvalid, o_part, lse,
        float(scale), float(softcap or 1.0), int(sink), int(recent), NT,
        q.stride(0), q.stride(1), k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        block_table.stride(0),
        H=H, G=G, HP=HP, BM=bm, BS=BS, DK=Dk, DV=Dv, BPS=bps, NSPLIT=nsplit, HAS_TIERS=has_tiers,
        SOFTCAP=bool(softcap), INTERP=_interp(), **meta)
    _merge_kernel[(NT, Hq)](o_part, lse, out, tile_req, tile_t0, query_start_loc, NT, HQ=Hq, DV=Dv, NSP=nsplit + 1,
                            NSP_P=_pow2(nsplit + 1), BM=bm)
    return out


@triton.jit
def _gather_kernel(C8, C16, TABLE, PK, PV, DMAP, DVALID, KO, VO, hist, seq, SINK, RECENT,
                   H: tl.constexpr, BS: tl.constexpr, SB: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                   KCB: tl.constexpr, KG: tl.constexpr, KC_OFF: tl.constexpr, KS_OFF: tl.constexpr,
                   KZ_OFF: tl.constexpr, VCB: tl.constexpr, VG: tl.constexpr, VC_OFF: tl.constexpr,
                   VS_OFF: tl.constexpr, VZ_OFF: tl.constexpr, HAS_TIERS: tl.constexpr):
    """One request's stored history as dense rotated rows: KO [hist, H, DK], VO [hist, H, DV] (the out dtype),
    block jb of its table per program, tier rows from the pool where held, else decoded from the codes."""
    jb = tl.program_id(0)
    h = tl.program_id(1)
    offs = tl.arange(0, BS)
    dk = tl.arange(0, DK)
    dv = tl.arange(0, DV)
    blk = tl.load(TABLE + jb).to(tl.int64)
    pos = jb * BS + offs
    valid = pos < hist
    cell = ((blk * H + h) * BS + offs) * SB
    k = _deq(C8, C16, cell, valid, DK, KCB, KG, KC_OFF, KS_OFF, KZ_OFF)
    v = _deq(C8, C16, cell, valid, DV, VCB, VG, VC_OFF, VS_OFF, VZ_OFF)
    if HAS_TIERS:
        dslot = tl.load(DMAP + blk)
        tier = (pos < SINK) | (pos >= seq - RECENT)
        has = tier & valid & (dslot >= 0)
        dsl = tl.maximum(dslot, 0).to(tl.int64)
        use = has & (tl.load(DVALID + dsl * BS + offs, mask=has, other=0) != 0)
        prow = (dsl * BS + offs) * H + h
        k = tl.where(use[:, None], tl.load(PK + prow[:, None] * DK + dk[None, :], mask=use[:, None],
                                           other=0.0).to(tl.float32), k)
        v = tl.where(use[:, None], tl.load(PV + prow[:, None] * DV + dv[None, :], mask=use[:, None],
                                           other=0.0).to(tl.float32), v)
    orow = pos.to(tl.int64) * H + h
    tl.store(KO + orow[:, None] * DK + dk[None, :], k.to(KO.dtype.element_ty), mask=valid[:, None])
    tl.store(VO + orow[:, None] * DV + dv[None, :], v.to(VO.dtype.element_ty), mask=valid[:, None])


def gather_history(cache_u8, fmt, table_row, hist: int, seq: int, *, sink: int = 0, recent: int = 0, tiers=None,
                   dtype=torch.float16):
    """A request's first `hist` stored rows, dense and rotated: (k [hist, H, D_k], v [hist, H, D_v]) in `dtype`.
    table_row: int32 [MB] (its block table row, on the device); seq: its length after this step (the tier rule)."""
    _, H, BS, _ = cache_u8.shape
    Dk, Dv = fmt.codecs["k"].head_dim, fmt.codecs["v"].head_dim
    ko = torch.empty(hist, H, Dk, dtype=dtype, device=cache_u8.device)
    vo = torch.empty(hist, H, Dv, dtype=dtype, device=cache_u8.device)
    if hist <= 0:
        return ko, vo
    has_tiers = tiers is not None and (sink > 0 or recent > 0)
    pk, pv, dmap, dvalid = tiers if has_tiers else empty_tiers(cache_u8.device)
    meta = kernel_meta(fmt)
    _gather_kernel[(-(-hist // BS), H)](cache_u8, cache_u8.view(torch.int16), table_row, pk, pv, dmap, dvalid, ko, vo,
                                        int(hist), int(seq), int(sink), int(recent), H=H, BS=BS, DK=Dk, DV=Dv,
                                        HAS_TIERS=has_tiers, **meta)
    return ko, vo


def prefill_attention_sdpa(q, k_new, v_new, cache_u8, fmt, table_row, hist: int, seq: int, *, scale: float,
                           sink: int = 0, recent: int = 0, tiers=None, softcap: float = 0.0) -> torch.Tensor:
    """One request's prefill chunk: q [lq, Hq, D] rotated over its stored history (gather_history) and its own new
    rows k_new / v_new [lq, H, D] (exact), causal (lower-right aligned), through torch SDPA (FlashAttention on a
    GPU). softcap needs the scores: the Triton kernel then. Returns float32 [lq, Hq, D_v]."""
    from torch.nn.attention.bias import causal_lower_right

    lq, Hq, _ = q.shape
    H = k_new.shape[1]
    dt = k_new.dtype if k_new.dtype in (torch.float16, torch.bfloat16) else torch.float16
    kh, vh = gather_history(cache_u8, fmt, table_row, hist, seq, sink=sink, recent=recent, tiers=tiers, dtype=dt)
    k = torch.cat([kh, k_new.to(dt)]).transpose(0, 1)  # [H, n, D]
    v = torch.cat([vh, v_new.to(dt)]).transpose(0, 1)
    G = Hq // H
    if G > 1:
        k, v = k.repeat_interleave(G, 0), v.repeat_interleave(G, 0)
    qq = q.to(dt).transpose(0, 1)  # [Hq, lq, D]
    o = torch.nn.functional.scaled_dot_product_attention(qq[None], k[None], v[None],
                                                         attn_mask=causal_lower_right(lq, k.shape[1]), scale=scale)
    return o[0].transpose(0, 1).float()


def tiles_for(query_start_loc_cpu, bm: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Host-side tile schedule (query_start_loc on the CPU: no device sync): (tile_req, tile_t0) int32."""
    import numpy as np

    qsl = np.asarray(query_start_loc_cpu, dtype=np.int64)
    lens = qsl[1:] - qsl[:-1]
    n = -(-lens // bm)
    req = np.repeat(np.arange(len(lens)), n)
    first = np.repeat(qsl[:-1], n) + bm * (np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n))
    return torch.from_numpy(req.astype(np.int32)), torch.from_numpy(first.astype(np.int32))


# ---------------------------------------------------------------------------------------------- twin
def paged_attention_ref(q, k_new, v_new, cache_u8, fmt, block_table, seq_lens, query_start_loc, *, scale: float,
                        sink: int = 0, recent: int = 0, tiers=None, softcap: float = 0.0) -> torch.Tensor:
    """Torch twin of paged_attention (a plain loop per request): the history read through
    SlotFormat.decode (TensorCodec.decode, lowbit's dequant) with tier rows from the pool, the own chunk
    as given, causal, softmax in float32. Returns float32 [T, Hq, D_v]."""
    T, Hq, Dk = q.shape
    _, H, BS, _ = cache_u8.shape
    G = Hq // H
    Dv = fmt.codecs["v"].head_dim
    out = torch.zeros(T, Hq, Dv, dtype=torch.float32)
    qsl = query_start_loc.cpu().long().tolist()
    lens = seq_lens.cpu().long().tolist()
    table = block_table.cpu().long()
    for r, n in enumerate(lens):
        q0, q1 = qsl[r], qsl[r + 1]
        if q1 <= q0:
            continue
        hist = n - (q1 - q0)
        pos = torch.arange(hist)
        blk = table[r, pos // BS] if hist else torch.zeros(0, dtype=torch.long)
        cells = cache_u8.cpu()[blk, :, pos % BS, :]  # [hist, H, SB]
        kh, vh = fmt.decode(cells.transpose(0, 1).contiguous(), torch.float32)  # [1, H, hist, D]
        kh, vh = kh[0], vh[0]
        if tiers is not None and (sink or recent) and hist:
            pk, pv, dmap, dvalid = (t.cpu() for t in tiers)
            slot = dmap.long()[blk]
            tier = (pos < sink) | (pos >= n - recent)
            use = tier & (slot >= 0)
            use &= dvalid[slot.clamp(min=0), pos % BS] != 0
            if bool(use.any()):
                i = torch.nonzero(use)[:, 0]
                kh[:, i] = pk[slot[i], pos[i] % BS].float().transpose(0, 1)
                vh[:, i] = pv[slot[i], pos[i] % BS].float().transpose(0, 1)
        kk = torch.cat([kh, k_new[q0:q1].float().cpu().transpose(0, 1)], dim=1)  # [H, hist + lq, D]
        vv = torch.cat([vh, v_new[q0:q1].float().cpu().transpose(0, 1)], dim=1)
        qq = q[q0:q1].float().cpu().view(q1 - q0, H, G, Dk).permute(1, 2, 0, 3)  # [H, G, lq, D]
        s = torch.einsum("hgqd,hkd->hgqk", qq, kk) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        kpos = torch.arange(hist + q1 - q0)
        qpos = hist + torch.arange(q1 - q0)
        s = s.masked_fill(kpos[None, :] > qpos[:, None], float("-inf"))
        p = torch.softmax(s, dim=-1)
        o = torch.einsum("hgqk,hkd->hgqd", p, vv)  # [H, G, lq, Dv]
        out[q0:q1] = o.permute(2, 0, 1, 3).reshape(q1 - q0, Hq, Dv)
    return out


def split_count(max_model_len: int, block_size: int, blocks_per_split: int = 32) -> int:
    return max(1, math.ceil(math.ceil(max_model_len / block_size) / blocks_per_split))
