"""Fused decode attention vs its torch twin.

CPU: the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1 before triton is imported),
small heads so the whole file stays under ~60 s on 2 cores. GPU (marked): full shapes.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _make import make_inputs, rel_l2

from lowbit.core.errors import LowbitError
from lowbit.kernels.attention.common import interpreted
from lowbit.kernels.attention.reference import decode_attention_ref
from lowbit.kernels.attention.tiers import KernelConfig, decode_attention

TOL = 1e-3
# tests/conftest.py sets TRITON_INTERPRET=1 unless the environment says otherwise; GPU runs use
# TRITON_INTERPRET=0 (the kernels then run on CUDA tensors only).
cpu_only = pytest.mark.skipif(not interpreted(), reason="kernels imported without TRITON_INTERPRET=1")
SMALL = KernelConfig(warp_tokens=16, num_warps=2, num_splits=3, dense_block=16)


def _run(kw, cfg=SMALL, device="cpu"):
    """Kernel into a NaN-poisoned fp32 buffer (so unwritten outputs show), and the twin."""
    q = kw["q"]
    Dv = kw["v_codes"].shape[3] * 8 // kw["v_bits"] if kw.get("v_codes") is not None else (
        kw.get("sink_v") if kw.get("sink_v") is not None else kw["recent_v"]).shape[3]
    out = torch.full((q.shape[0], q.shape[1], Dv), float("nan"), dtype=torch.float32, device=device)
    decode_attention(**kw, config=cfg, out=out)
    return out, decode_attention_ref(**kw)


def _check(out, ref):
    assert torch.isfinite(out).all(), "kernel wrote NaN/Inf or left outputs unwritten"
    err = rel_l2(out, ref)
    assert err <= TOL, f"rel L2 error {err:.2e} > {TOL}"
    return err


CASES = [
    # (B, Hq, Hkv, D, T, kbits, vbits, group, sink, recent, mid_lens, dtype)
    (1, 4, 1, 64, 1, 2, 2, None, 0, 0, None, torch.bfloat16),  # length 1
    (2, 3, 1, 64, 7, 4, 4, None, 0, 0, [7, 5], torch.bfloat16),  # length 7, GQA 3
    (5, 8, 2, 64, 129, 2, 2, None, 0, 0, [129, 1, 64, 0, 100], torch.bfloat16),  # GQA 4, ragged, empty seq
    (1, 8, 1, 64, 1000, 2, 2, None, 0, 0, None, torch.bfloat16),  # length 1000, GQA 8
    (2, 2, 2, 64, 129, 8, 8, None, 3, 5, [50, 129], torch.float16),  # MHA (GQA 1), int8, all tiers
    (1, 9, 1, 64, 40, 4, 2, None, 4, 6, None, torch.bfloat16),  # GQA 9 (HP 16), k4v2
    (2, 6, 2, 128, 70, 2, 4, 64, 0, 7, [70, 33], torch.bfloat16),  # D 128, two groups per head
    (1, 4, 1, 64, 33, 8, 4, 32, 2, 0, None, torch.float32),  # fp32 model: q split hi/lo, S > group
]


@cpu_only
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}-Hq{c[1]}-Hkv{c[2]}-D{c[3]}-T{c[4]}-k{c[5]}v{c[6]}")
def test_matches_twin_interpreter(case):
    B, Hq, Hkv, D, T, kb, vb, grp, sink, rec, lens, dt = case
    kw = make_inputs(B, Hq, Hkv, D, T, kbits=kb, vbits=vb, group=grp, sink=sink, recent=rec,
                     mid_lens=lens, dtype=dt, seed=T + Hq)
    out, ref = _run(kw)
    _check(out, ref)


@cpu_only
@pytest.mark.parametrize("variant", [{"v_center": False, "pv_fresh": True}, {"v_center": True, "pv_fresh": True}],
                         ids=["fresh", "fresh-centred"])
def test_pv_variants_compute_the_same_function(variant):
    # The PV precision knobs (benchmarks/NOTES.md round 4) change only rounding, never the result:
    # two groups per head (o1 path), ragged lengths with an empty sequence, both dense tiers.
    kw = make_inputs(3, 8, 2, 128, 99, kbits=2, vbits=4, group=64, sink=3, recent=5, mid_lens=[99, 0, 17],
                     dtype=torch.bfloat16, seed=3)
    out, ref = _run(kw, KernelConfig(warp_tokens=16, num_warps=2, num_splits=3, dense_block=16, **variant))
    _check(out, ref)


@cpu_only
def test_dense_tiers_only_and_ragged_dense_lengths():
    kw = make_inputs(3, 4, 2, 64, 0, sink=4, recent=19, sink_lens=[4, 0, 2], recent_lens=[19, 7, 0],
                     dtype=torch.bfloat16, mid=False, seed=3)
    out, ref = _run(kw)
    _check(out, ref)


@cpu_only
def test_empty_dense_tier_and_more_splits_than_blocks():
    # recent tier present but empty for every sequence; 7 splits over 40 tokens leave splits empty
    kw = make_inputs(2, 4, 1, 64, 40, sink=0, recent=8, recent_lens=[0, 0], mid_lens=[40, 9],
                     dtype=torch.bfloat16, seed=4)
    cfg = KernelConfig(warp_tokens=16, num_warps=1, num_splits=7, dense_block=16)
    out, ref = _run(kw, cfg)
    _check(out, ref)


@cpu_only
def test_merge_of_many_splits_in_chunks():
    # 44 splits: the merge runs over them 32 at a time with a running max
    kw = make_inputs(2, 4, 1, 64, 700, mid_lens=[700, 3], dtype=torch.bfloat16, seed=11)
    cfg = KernelConfig(warp_tokens=16, num_warps=1, num_splits=64, dense_block=16)
    out, ref = _run(kw, cfg)
    _check(out, ref)


@cpu_only
def test_sequence_with_no_token_gets_zeros_not_nan():
    kw = make_inputs(2, 4, 1, 64, 16, sink=2, recent=3, mid_lens=[0, 16], sink_lens=[0, 2],
                     recent_lens=[0, 3], dtype=torch.bfloat16, seed=5)
    out, ref = _run(kw)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    _check(out[1:], ref[1:])


@cpu_only
def test_gqa_heads_read_their_own_kv_head():
    # make KV head 1 different from head 0 only in V: a head-mapping bug shows as a large error
    kw = make_inputs(1, 6, 2, 64, 48, dtype=torch.bfloat16, seed=6)
    kw["v_zero"][:, 1] += 5.0
    out, ref = _run(kw)
    _check(out, ref)
    assert (out[0, 3:] - out[0, :3]).abs().mean() > 1.0  # heads 3-5 see the shifted values


@cpu_only
def test_output_dtype_and_default_out():
    kw = make_inputs(1, 4, 1, 64, 20, dtype=torch.bfloat16, seed=7)
    out = decode_attention(**kw, config=SMALL)
    assert out.dtype == torch.bfloat16 and out.shape == (1, 4, 64)
    ref = decode_attention_ref(**kw)
    assert rel_l2(out.float(), ref) < 8e-3  # bf16 output rounding


@cpu_only
@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda kw: kw.update(k_bits=3), "3-bit codes"),
        (lambda kw: kw.update(k_scale=kw["k_scale"].float()), "float16"),
        (lambda kw: kw.update(k_codes=kw["k_codes"][:, :, ::2]), "back to back"),
        (lambda kw: kw.update(q=kw["q"][:, :3]), "multiple"),
        (lambda kw: kw.update(mid_lens=torch.zeros(5, dtype=torch.int32)), "shape"),
        (lambda kw: kw.update(v_codes=kw["v_codes"][:, :, :5], v_scale=kw["v_scale"][:, :, :5],
                              v_zero=kw["v_zero"][:, :, :5]), "same number of slots"),
    ],
)
def test_bad_input_raises(mutate, match):
    kw = make_inputs(1, 4, 2, 64, 16, dtype=torch.bfloat16, seed=8)
    mutate(kw)
    with pytest.raises(LowbitError, match=match):
        decode_attention(**kw, config=SMALL)


@cpu_only
def test_unsupported_head_dim_and_group_raise():
    kw = make_inputs(1, 2, 1, 96, 8, dtype=torch.bfloat16, seed=9)
    with pytest.raises(LowbitError, match="head_dim"):
        decode_attention(**kw, config=SMALL)
    kw = make_inputs(1, 2, 1, 64, 8, group=16, dtype=torch.bfloat16, seed=9)
    with pytest.raises(LowbitError, match="group"):
        decode_attention(**kw, config=SMALL)


# ------------------------------------------------------------------------------------------ GPU
GPU_CASES = [
    # (B, Hq, Hkv, D, T, kbits, vbits, group, lens)
    (16, 32, 8, 128, 4096, 2, 2, None, "ragged"),
    (3, 32, 8, 128, 32768, 4, 4, None, None),
    (2, 32, 8, 128, 4000, 8, 8, None, "ragged"),
    (5, 4, 1, 256, 3000, 2, 2, 128, "ragged"),
    (1, 24, 8, 128, 1000, 4, 2, None, None),
    (17, 9, 1, 64, 129, 2, 2, None, "ragged"),
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or interpreted(), reason="needs CUDA, TRITON_INTERPRET=0")
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: f"B{c[0]}-Hq{c[1]}-Hkv{c[2]}-D{c[3]}-T{c[4]}-k{c[5]}v{c[6]}")
def test_matches_twin_gpu(case):
    B, Hq, Hkv, D, T, kb, vb, grp, lens = case
    g = torch.Generator().manual_seed(T)
    mid_lens = torch.randint(0, T + 1, (B,), generator=g).tolist() if lens == "ragged" else None
    kw = make_inputs(B, Hq, Hkv, D, T, kbits=kb, vbits=vb, group=grp, sink=64, recent=256,
                     mid_lens=mid_lens, dtype=torch.bfloat16, device="cuda", seed=T)
    out, ref = _run(kw, KernelConfig(), device="cuda")
    _check(out, ref)


def test_split_count_fills_whole_waves():
    from lowbit.kernels.attention.tiers import pick_num_splits

    # B16 x 8 KV heads, 3 programs per SM resident on 132 SMs: 3 splits (384 of 396 slots, one wave),
    # not 4 (1.3 waves); 6 would also be 97% full but takes twice the programs
    assert pick_num_splits(16, 8, 32768, 128, 132, 4, blocks_per_sm=3) == 3
    # B1 x 8 heads, 8 one-warp programs per SM: one wave (128 splits of 16 blocks; 132 would also
    # need 16 blocks each), not two waves of half-length programs
    assert pick_num_splits(1, 8, 131072, 64, 132, 1, blocks_per_sm=8) == 128
    # few tokens: every split keeps >= 8 blocks, so fewer splits than slots allow
    assert pick_num_splits(1, 8, 1000, 64, 132, 1, blocks_per_sm=8) == 2
    assert pick_num_splits(1, 8, 32768, 64, 132, 1, blocks_per_sm=8) == 64
    # more pairs than slots: 3 splits = 1536 programs in 3.88 waves, not 1 split in 1.29 waves
    assert pick_num_splits(64, 8, 32768, 128, 132, 4, blocks_per_sm=3) == 3
    assert pick_num_splits(3, 1, 0, 128, 132, 4, blocks_per_sm=3) == 1
    # the dense-tier program of each pair takes a slot too: B16 x 8 heads, 6 resident per SM (792 slots),
    # 64-token blocks: 6 splits fill 768 slots alone, with the dense programs 896 > 792 (1.13 waves), so
    # 11 splits (1,536 programs, 1.94 waves of half-length programs)
    assert pick_num_splits(16, 8, 32512, 64, 132, 1, blocks_per_sm=6) == 6
    assert pick_num_splits(16, 8, 32512, 64, 132, 1, blocks_per_sm=6, dense_programs=1) == 11
    # occupancy unknown (interpreter): the fixed programs-per-SM rule
    assert pick_num_splits(16, 8, 32768, 128, 132, 4) == 6


def _scale_only(kw, which, seed):
    """Replace tier `which` ("k"/"v") of make_inputs' kwargs by scale-only groups (lowbit.kv.codec zero
    "none"): codes + fp16 scale from the one centred quantizer, no zero tensor, the centre code passed."""
    from lowbit.quant.affine import centre, quantize_centred
    from lowbit.quant.packing import pack

    codes = kw[f"{which}_codes"]
    B, Hkv, T, S = codes.shape
    bits = kw[f"{which}_bits"]
    D = S * 8 // bits
    group = D // kw[f"{which}_scale"].shape[-1]
    x = torch.randn(B, Hkv, T, D, generator=torch.Generator().manual_seed(seed))
    q = quantize_centred(x, bits, group, grid="std" if bits <= 4 else "absmax", scale_dtype=torch.float16)
    kw.update({f"{which}_codes": pack(q.codes, bits, "strided") if bits < 8 else q.codes,
               f"{which}_scale": q.scale, f"{which}_zero": None, f"{which}_centre": centre(bits)})
    return kw


SCALE_ONLY_CASES = [
    # (B, Hq, Hkv, D, T, kbits, vbits, group, sink, recent, mid_lens, which)
    (1, 3, 1, 64, 37, 2, 2, None, 0, 5, None, "kv"),  # smollm2's geometry: D 64, group 64, GQA 3
    (3, 9, 3, 64, 99, 2, 4, None, 2, 3, [99, 0, 41], "k"),  # K scale-only, V with a zero; empty sequence
    (2, 4, 2, 128, 70, 4, 2, 64, 0, 7, [70, 33], "v"),  # two groups per head, V scale-only
    (1, 2, 1, 64, 20, 8, 8, 32, 1, 1, None, "kv"),  # int8 symmetric, S > group
]


@cpu_only
@pytest.mark.parametrize("case", SCALE_ONLY_CASES, ids=lambda c: f"B{c[0]}-D{c[3]}-T{c[4]}-k{c[5]}v{c[6]}-{c[11]}")
def test_scale_only_groups_match_twin(case):
    """Scale-only groups: the kernel computes zero = -centre * scale (reads no zero) and matches the twin."""
    B, Hq, Hkv, D, T, kb, vb, grp, sink, rec, lens, which = case
    kw = make_inputs(B, Hq, Hkv, D, T, kbits=kb, vbits=vb, group=grp, sink=sink, recent=rec, mid_lens=lens,
                     dtype=torch.bfloat16, seed=T)
    for t in which:
        _scale_only(kw, t, seed=T + ord(t))
    out, ref = _run(kw)
    _check(out, ref)
    # the twin of the same fields with the zero materialised: the same function
    for t in which:
        kw[f"{t}_zero"] = kw[f"{t}_scale"].float().mul(-kw.pop(f"{t}_centre")).half()
    _check(out, decode_attention_ref(**kw))


@cpu_only
def test_scale_only_needs_a_centre_and_refuses_both():
    kw = make_inputs(1, 2, 1, 64, 5, dtype=torch.bfloat16)
    z = kw.pop("k_zero")
    with pytest.raises(LowbitError, match="centre"):
        decode_attention(**kw, k_zero=None, config=SMALL)
    with pytest.raises(LowbitError, match="not both"):
        decode_attention(**kw, k_zero=z, k_centre=1.5, config=SMALL)
