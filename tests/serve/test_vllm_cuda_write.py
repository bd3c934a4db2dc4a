"""The CUDA backend's fused write kernel against TensorCodec.encode (SlotFormat.encode_rotated), under
TRITON_INTERPRET=1, at odd token / head counts: code-for-code on the min/max grid (pre-rotated rows),
within a rounding tie on the std grid and with the rotation inside the kernel; the dense tier rows."""

from __future__ import annotations

import pytest
import torch

from lowbit.kernels.attention.common import interpreted
from lowbit.kv.scheme import parse_kv_scheme
from lowbit.vllm_plugin.cuda_write import write
from lowbit.vllm_plugin.slot import SlotFormat

cpu_only = pytest.mark.skipif(not interpreted(), reason="kernels imported without TRITON_INTERPRET=1")
BS = 16


def _setup(fmt, T, H, NB, seed):
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(NB * BS, generator=g)[:T]
    slots[1] = -1  # a padding row
    cache = torch.zeros(NB, H, BS, fmt.slot_bytes, dtype=torch.uint8)
    return g, slots, cache


def _expected(fmt, cache_shape, kr, vr, slots):
    """What the CPU plugin stores: SlotFormat.encode_rotated (TensorCodec.encode) at the slots."""
    cells = fmt.encode_rotated(kr.transpose(0, 1).unsqueeze(0), vr.transpose(0, 1).unsqueeze(0), fast=False)
    exp = torch.zeros(cache_shape, dtype=torch.uint8)
    ok = slots >= 0
    s = slots[ok]
    exp[s // BS, :, s % BS, :] = cells[ok]
    return exp


SCHEMES = [  # (scheme, kwargs, D)
    ("int4", {"grid": "minmax"}, 64),
    ("int2", {"grid": "minmax"}, 32),
    ("k4v2", {"grid": "minmax", "clip": ".96,.92"}, 64),
    ("int4", {"symmetric": True}, 32),
    ("int8", {}, 32),
    ("int4", {"grid": "minmax", "group": 16}, 64),
]


@cpu_only
@pytest.mark.parametrize("scheme,kw,D", SCHEMES, ids=[f"{s}-{i}" for i, (s, _, _) in enumerate(SCHEMES)])
def test_write_code_for_code_minmax(scheme, kw, D):
    fmt = SlotFormat(parse_kv_scheme(scheme, sink=0, recent=0, page=1, **kw), D, D)
    T, H, NB = 7, 3, 5
    g, slots, cache = _setup(fmt, T, H, NB, seed=D + T)
    kr = torch.randn(T, H, D, generator=g) * 3
    vr = torch.randn(T, H, D, generator=g)
    kr[2, 1, :8] = 0.5  # a group with repeated values; constant rows below
    vr[3, 0] = 1.25
    write(cache, fmt, kr, vr, slots)
    exp = _expected(fmt, cache.shape, kr, vr, slots)
    assert torch.equal(cache, exp), f"{int((cache != exp).sum())} bytes differ"


def _decoded_diff(fmt, cache, exp):
    """Max |difference| of the decoded rows (a byte that differs: a code one step off at a rounding tie)."""
    def dec(c):
        return fmt.decode(c.permute(1, 0, 2, 3).reshape(c.shape[1], -1, c.shape[3]).contiguous())

    (kd, vd), (ke, ve) = dec(cache), dec(exp)
    return (kd - ke).abs().max().item(), (vd - ve).abs().max().item()


@cpu_only
@pytest.mark.parametrize("scheme,D", [("int2", 64), ("int4", 32)])
def test_write_std_grid_and_rotation(scheme, D):
    fmt = SlotFormat(parse_kv_scheme(scheme, sink=0, recent=0, page=1, grid="std" if scheme == "int2" else None),
                     D, D)
    T, H, NB = 9, 3, 4
    g, slots, cache = _setup(fmt, T, H, NB, seed=D)
    k = torch.randn(T, H, D, generator=g).half()
    v = torch.randn(T, H, D, generator=g).half()
    rk = torch.linalg.qr(torch.randn(D, D, generator=g))[0]
    rv = torch.linalg.qr(torch.randn(H, D, D, generator=g))[0]  # per head
    kro = torch.empty(T, H, D, dtype=torch.float16)
    vro = torch.empty(T, H, D, dtype=torch.float16)
    write(cache, fmt, k, v, slots, rk, rv, rows_out=(kro, vro))
    kr = (k.float().transpose(0, 1) @ rk).transpose(0, 1)
    vr = (v.float().transpose(0, 1) @ rv).transpose(0, 1)
    assert (kro.float() - kr).abs().max() < 1e-2 and (vro.float() - vr).abs().max() < 1e-2
    exp = _expected(fmt, cache.shape, kr, vr, slots)
    same = (cache == exp).float().mean().item()
    assert same > 0.97, f"only {same:.3f} of the bytes agree"
    # where a byte differs, the decoded rows differ by at most one grid step of that group
    kd, vd = _decoded_diff(fmt, cache, exp)
    assert kd < 1.5 and vd < 1.5


@cpu_only
def test_write_dense_tiers():
    D, H, T, NB = 32, 2, 6, 4
    fmt = SlotFormat(parse_kv_scheme("int4", sink=2, recent=3, page=1, grid="minmax"), D, D)
    g, slots, cache = _setup(fmt, T, H, NB, seed=1)
    slots = torch.tensor([0 * BS + 0, 0 * BS + 1, 2 * BS + 5, 1 * BS + 3, 3 * BS + 9, 3 * BS + 10])
    pos = torch.tensor([0, 1, 9, 4, 6, 7], dtype=torch.int32)  # one request of 8 tokens + padding... positions
    rseq = torch.full((T,), 8, dtype=torch.int32)
    dmap = torch.tensor([0, -1, 1, 2], dtype=torch.int32)  # block 1 has no pool slot
    pk = torch.zeros(3, BS, H, D, dtype=torch.float16)
    pv = torch.zeros(3, BS, H, D, dtype=torch.float16)
    dvalid = torch.zeros(3, BS, dtype=torch.uint8)
    k = torch.randn(T, H, D, generator=g).half()
    v = torch.randn(T, H, D, generator=g).half()
    write(cache, fmt, k, v, slots, positions=pos, row_seq=rseq, sink=2, recent=3, tiers=(pk, pv, dmap, dvalid))
    # dense: positions 0, 1 (sink, block 0 -> slot 0), 9 and 6, 7 (recent >= 5; blocks 2 -> slot 1, 3 -> slot 2)
    want = {(0, 0): 0, (0, 1): 1, (1, 5): 2, (2, 9): 4, (2, 10): 5}
    assert int(dvalid.sum()) == len(want)
    for (s, off), t in want.items():
        assert dvalid[s, off] == 1
        assert torch.equal(pk[s, off], k[t]) and torch.equal(pv[s, off], v[t])
    exp = _expected(fmt, cache.shape, k.float(), v.float(), slots)
    assert torch.equal(cache, exp)
