"""The plugin's fused CPU decode kernel (csrc/paged_decode.cpp) against its torch twin (paged._attend_group):
same packed cells, block tables, dense tiers and own rows; odd sizes, GQA ratios, 2/4/8 bits, two groups
per head, sliding windows with poisoned freed blocks, softcap, many requests in one batch."""

from __future__ import annotations

import pytest
import torch

from lowbit.kv.scheme import parse_kv_scheme
from lowbit.vllm_plugin import cpu_kernel, paged
from lowbit.vllm_plugin.slot import SlotFormat

MOD, WHY = cpu_kernel.load()
pytestmark = pytest.mark.skipif(MOD is None, reason=f"{WHY}")


def _setup(name, D, group, Hkv, G, bs, lens, sink, recent, window, rotation, dtype, seed):
    from lowbit.rotation.hadamard import hadamard

    torch.manual_seed(seed)
    sch = parse_kv_scheme(name, sink=sink, recent=recent, page=1, group=group, rotation="none")
    fmt = SlotFormat(sch, D, D, dtype)
    rk = rv = hadamard(D) if rotation else None
    nbt = max(-(-n // bs) for n in lens) + 2
    nblocks = len(lens) * nbt + 3
    cache = torch.zeros(nblocks, Hkv, bs, fmt.slot_bytes, dtype=torch.uint8)
    perm = torch.randperm(nblocks)
    table = perm[: len(lens) * nbt].reshape(len(lens), nbt)
    arena = paged.TierArena(sink, recent, bs, dtype, window=window) if sink or recent else None
    seqs = []
    for r, n in enumerate(lens):  # history written in two chunks, then the step's own row
        k, v = torch.randn(n, Hkv, D).to(dtype), torch.randn(n, Hkv, D).to(dtype)
        for a, b in ((0, (n - 1) // 2), ((n - 1) // 2, n - 1), (n - 1, n)):
            if b <= a:
                continue
            pos = torch.arange(a, b)
            paged.write(cache, fmt, k[a:b], v[a:b], table[r][pos // bs] * bs + pos % bs, rk, rv, positions=pos,
                        row_seq_lens=torch.full((b - a,), b), arena=arena)
        seqs.append((k, v))
    if window:  # free (poison) what vLLM frees before the step: blocks wholly before the window
        for r, n in enumerate(lens):
            for i in range(max(0, n - 1 - window + 1) // bs):
                b = int(table[r, i])
                cache[b] = 0xFF
                if arena is not None and b in arena.k:
                    arena.k[b] = torch.full((Hkv, bs, D), float("nan"))
                    arena.v[b] = torch.full((Hkv, bs, D), float("nan"))
    q = torch.randn(len(lens), Hkv * G, D).to(dtype)
    newk = torch.stack([k[-1] for k, _ in seqs])
    newv = torch.stack([v[-1] for _, v in seqs])
    return fmt, cache, table, arena, q, newk, newv, rk, rv


@pytest.mark.parametrize("name,D,group,Hkv,G,bs,lens,sink,recent,window,rotation,softcap", [
    ("int4", 64, 64, 3, 3, 16, [1, 37, 99, 200], 0, 0, None, True, None),
    ("int2", 64, 64, 3, 3, 16, [5, 300, 129], 7, 21, None, True, None),
    ("int8", 64, 32, 1, 4, 8, [3, 77], 4, 9, None, False, None),  # two groups per head
    ("k4v2", 128, 64, 2, 1, 16, [17, 50, 2, 90, 133], 16, 32, None, True, 30.0),  # MHA, softcap
    ("int2", 256, 128, 1, 4, 16, [40, 230, 301], 5, 30, 48, False, None),  # gemma3-like: window, poison
    ("int4", 64, 64, 1, 9, 4, [1, 2, 3, 11, 23, 61, 97], 3, 5, 13, True, None),  # GQA 9, tiny blocks
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_decode_equals_torch_twin(name, D, group, Hkv, G, bs, lens, sink, recent, window, rotation, softcap,
                                        dtype):
    fmt, cache, table, arena, q, nk, nv, rk, rv = _setup(name, D, group, Hkv, G, bs, lens, sink, recent, window,
                                                         rotation, dtype, seed=len(lens) + D)
    kw = dict(block_table=table, seq_lens=torch.tensor(lens), query_start_loc=torch.arange(len(lens) + 1),
              scale=D ** -0.5, rot_k=rk, rot_v=rv, window=window, softcap=softcap, arena=arena, new_k=nk, new_v=nv,
              evict=False)
    want = paged.attend(q, cache, fmt, kernel="torch", chunk_tokens=64, **kw)
    memo: dict = {}
    got = paged.attend(q, cache, fmt, kernel="cpu-fused", memo=memo, **kw)
    assert not got.isnan().any(), "a freed block leaked into the fused kernel"
    torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-5)
    assert memo, "the step's index tensors were not memoised"
    again = paged.attend(q, cache, fmt, kernel="cpu-fused", memo=memo, **kw)  # a second layer, same step
    torch.testing.assert_close(again, want, rtol=2e-4, atol=2e-5)


def _kernel_calls(fn):
    """The arguments of every mod.paged_decode call fn() makes (the module swapped for a recording proxy)."""
    calls = []

    class Spy:
        def __getattr__(self, name):
            return getattr(MOD, name)

        def paged_decode(self, *a):
            calls.append(a)
            return MOD.paged_decode(*a)

    cpu_kernel._STATE["mod"] = Spy()
    try:
        fn()
    finally:
        cpu_kernel._STATE["mod"] = MOD
    return calls


@pytest.mark.skipif(not MOD.has_vector_path(), reason="this build has no AVX2 + FMA + F16C path")
@pytest.mark.parametrize("name,D,group,Hkv,G,lens,sink,recent,softcap,dtype,vector", [
    ("int4", 64, 64, 3, 3, [2050], 64, 256, None, torch.bfloat16, True),  # smollm2's step, several tiles
    ("int2", 64, 32, 2, 5, [1, 33, 70], 3, 5, 20.0, torch.float16, True),  # G 5 = a 4-head and a 1-head pass
    ("int8", 128, 64, 1, 9, [45, 97], 0, 0, None, torch.float32, True),  # no tiers, G 9 = 4 + 4 + 1
    ("k4v2", 64, 64, 2, 2, [31, 64], 2, 7, None, torch.bfloat16, True),
    ("int4", 48, 48, 2, 3, [29, 61], 4, 6, None, torch.bfloat16, True),  # 4-bit lanes of 24 dims
    ("int4", 40, 40, 2, 3, [29, 61], 4, 6, None, torch.bfloat16, False),  # lanes of 20 dims: scalar
    ("int2", 40, 40, 1, 2, [23], 2, 3, None, torch.float32, False),  # lanes of 10 dims: scalar
])
def test_vector_path_equals_the_scalar_loop(name, D, group, Hkv, G, lens, sink, recent, softcap, dtype, vector):
    """paged_decode's AVX2 path (every cell dequantized once for the G heads, 8 dims at a time, polynomial exp)
    against the scalar loop on the same arguments, and the layouts it leaves to the scalar loop."""
    fmt, cache, table, arena, q, nk, nv, rk, rv = _setup(name, D, group, Hkv, G, 16, lens, sink, recent, None, False,
                                                         dtype, seed=D + G)
    assert MOD.vector_layout(paged.kernel_meta(fmt)) is vector
    kw = dict(block_table=table, seq_lens=torch.tensor(lens), query_start_loc=torch.arange(len(lens) + 1),
              scale=D ** -0.5, softcap=softcap, arena=arena, new_k=nk, new_v=nv, evict=False)
    calls = _kernel_calls(lambda: paged.attend(q, cache, fmt, kernel="cpu-fused", memo={}, **kw))
    assert len(calls) == 1
    got, ref = MOD.paged_decode(*calls[0]), MOD.paged_decode_scalar(*calls[0])
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    if not vector:
        assert torch.equal(got, ref)  # the same loop
    torch.testing.assert_close(got.view(len(lens), Hkv * G, D),
                               paged.attend(q, cache, fmt, kernel="torch", **kw), rtol=2e-4, atol=2e-5)


def test_fused_decode_reads_dropped_dense_rows_from_their_codes():
    """Dense rows gone from the arena (a request left out of a step, a prefix-cache hit's shared rows: paged.
    _fill_missing) are read from their codes -- the attention of no exact tiers -- and counted; never raise."""
    fmt, cache, table, arena, q, nk, nv, rk, rv = _setup("int4", 64, 64, 1, 2, 8, [30], 4, 8, None, False,
                                                         torch.float32, 0)
    arena.retain(set())  # as if the request had not been scheduled and its dense rows were dropped
    kw = dict(block_table=table, seq_lens=torch.tensor([30]), query_start_loc=torch.arange(2), scale=0.1,
              new_k=nk, new_v=nv, kernel="cpu-fused")
    got = paged.attend(q, cache, fmt, arena=arena, **kw)
    assert arena.refilled == 4 + 7  # sink 0..3, recent 22..28 (29 is the step's own row)
    torch.testing.assert_close(got, paged.attend(q, cache, fmt, arena=None, **kw), rtol=2e-4, atol=2e-5)
    with pytest.raises(RuntimeError, match="dense copy of position 29"):  # a row of this very step: a bug
        paged._fill_missing(arena, cache, fmt, table[:, 3:4], torch.tensor([[5]]), torch.tensor([[29]]),
                            torch.ones(1, 1, dtype=torch.bool), torch.tensor([29]))


def test_prefill_chunks_and_dense_tensors_take_the_torch_path():
    """A 16-bit V (k4v16) cannot be read by the kernel: the same call gives the twin's result."""
    torch.manual_seed(2)
    fmt = SlotFormat(parse_kv_scheme("int4", sink=0, recent=0, page=1), 64, 64)
    assert paged.kernel_meta(fmt) is not None
    dense = SlotFormat(parse_kv_scheme("bf16", sink=0, recent=0, page=1), 64, 64)
    assert paged.kernel_meta(dense) is None
    cache = torch.zeros(6, 2, 8, dense.slot_bytes, dtype=torch.uint8)
    table = torch.tensor([[4, 1, 3]])
    k, v = torch.randn(19, 2, 64), torch.randn(19, 2, 64)
    pos = torch.arange(19)
    paged.write(cache, dense, k, v, table[0][pos // 8] * 8 + pos % 8)
    kw = dict(block_table=table, seq_lens=torch.tensor([19]), query_start_loc=torch.tensor([0, 3]), scale=0.125)
    q = torch.randn(3, 4, 64)
    torch.testing.assert_close(paged.attend(q, cache, dense, kernel="cpu-fused", **kw),
                               paged.attend(q, cache, dense, kernel="torch", **kw))


def test_rows_rotated_by_write_are_reused_by_attend():
    """write(rotated=d) hands back the rows it rotated; attend(new_kr=...) with them equals attend(new_k=...)."""
    from lowbit.rotation.hadamard import hadamard

    torch.manual_seed(5)
    fmt = SlotFormat(parse_kv_scheme("int4", sink=3, recent=6, page=1), 64, 64, torch.bfloat16)
    r = hadamard(64)
    cache = torch.zeros(8, 3, 4, fmt.slot_bytes, dtype=torch.uint8)
    arena = paged.TierArena(3, 6, 4, torch.bfloat16)
    table = torch.tensor([[5, 2, 7, 0, 1], [3, 6, 4, 0, 0]])
    lens = [17, 9]
    for row, n in zip(table, lens):  # histories
        pos = torch.arange(n - 1)
        paged.write(cache, fmt, torch.randn(n - 1, 3, 64).bfloat16(), torch.randn(n - 1, 3, 64).bfloat16(),
                    row[pos // 4] * 4 + pos % 4, r, r, positions=pos, row_seq_lens=torch.full((n - 1,), n), arena=arena)
    pos = torch.tensor([16, 8])
    k, v = torch.randn(2, 3, 64).bfloat16(), torch.randn(2, 3, 64).bfloat16()
    got: dict = {}
    paged.write(cache, fmt, k, v, table[torch.arange(2), pos // 4] * 4 + pos % 4, r, r, positions=pos,
                row_seq_lens=pos + 1, arena=arena, rotated=got)
    assert got["n"] == 2 and got["k"].dtype == torch.bfloat16
    q = torch.randn(2, 6, 64).bfloat16()
    kw = dict(block_table=table, seq_lens=torch.tensor(lens), query_start_loc=torch.arange(3), scale=0.125,
              rot_k=r, rot_v=r, arena=arena, kernel="cpu-fused", evict=False)
    torch.testing.assert_close(paged.attend(q, cache, fmt, new_kr=got["k"], new_vr=got["v"], **kw),
                               paged.attend(q, cache, fmt, new_k=k, new_v=v, **kw))
    pad: dict = {}
    paged.write(cache, fmt, k, v, torch.tensor([-1, 3]), r, r, positions=pos, row_seq_lens=pos + 1, arena=arena,
                rotated=pad)
    assert pad == {}  # a padding row: nothing handed back (attend rotates its own)


def _orthogonal(H, D, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(H, D, D, generator=g))[0].contiguous()  # [H, D, D] per KV head


@pytest.mark.parametrize("per_head", [False, True])
def test_kernel_rotates_q_and_unrotates_out_like_the_glue(per_head):
    """A decode-only batch runs q's rotation and the output's un-rotation inside the kernel; a mixed batch
    (decodes + a prefill chunk) rotates in torch and hands the kernel rotated queries. Both equal the torch
    twin, with one rotation for every head or one per KV head, and a request with no new token between."""
    from lowbit.rotation.hadamard import hadamard

    Hkv, G, D, bs = 3, 3, 64, 8
    fmt, cache, table, arena, q, nk, nv, _, _ = _setup("int4", D, 32, Hkv, G, bs, [41, 5, 77, 23], 4, 9, None,
                                                       False, torch.bfloat16, seed=11)
    rk = _orthogonal(Hkv, D, 1) if per_head else hadamard(D)
    rv = _orthogonal(Hkv, D, 2) if per_head else hadamard(D).flip(0).contiguous()
    lens = torch.tensor([41, 5, 77, 23])
    for qsl in ([0, 1, 2, 3, 4], [0, 1, 1, 2, 3]):  # all decode; request 1 with no new token
        n = qsl[-1]
        kw = dict(block_table=table, seq_lens=lens, query_start_loc=torch.tensor(qsl), scale=D ** -0.5, rot_k=rk,
                  rot_v=rv, arena=arena, new_k=nk[:n], new_v=nv[:n], evict=False)
        want = paged.attend(q[:n], cache, fmt, kernel="torch", **kw)
        got = paged.attend(q[:n], cache, fmt, kernel="cpu-fused", memo={}, **kw)
        torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-5)
    # mixed: 3 decodes and request 3's last 4 tokens as a chunk (its rows before are the history)
    qsl = torch.tensor([0, 1, 2, 3, 7])
    qm, km, vm = torch.randn(7, Hkv * G, D).bfloat16(), torch.randn(7, Hkv, D).bfloat16(), torch.randn(7, Hkv, D).bfloat16()
    kw = dict(block_table=table, seq_lens=torch.tensor([41, 5, 77, 27]), query_start_loc=qsl, scale=D ** -0.5,
              rot_k=rk, rot_v=rv, arena=arena, new_k=km, new_v=vm, evict=False)
    torch.testing.assert_close(paged.attend(qm, cache, fmt, kernel="cpu-fused", memo={}, **kw),
                               paged.attend(qm, cache, fmt, kernel="torch", **kw), rtol=2e-4, atol=2e-5)


def test_dense_rows_op_equals_the_torch_lookup():
    """mod.dense_rows (the decode step's arena rows in one op) == BlockPool.lookup + TierArena.missing."""
    g = torch.Generator().manual_seed(3)
    slot_map = torch.randint(-1, 9, (37,), generator=g)
    blk = torch.randint(0, 45, (5, 13), generator=g)  # ids beyond the map: absent
    off = torch.randint(0, 16, (5, 13), generator=g)
    valid = torch.rand(5, 13, generator=g) < 0.7
    rows, n_missing = MOD.dense_rows(slot_map, blk, off, valid, 16)
    pool = paged.BlockPool(torch.float32)
    pool.map = slot_map
    slots = pool.lookup(blk)
    assert torch.equal(rows, torch.where(valid & (slots >= 0), slots * 16 + off, -1))
    assert n_missing == int((valid & (slots < 0)).sum()) > 0


def test_write_with_the_steps_memo_equals_write_without():
    """The write indices built once per step (write(memo=...)) give every layer the bytes and dense rows a
    fresh build gives: two layers sharing one memo, a batch with a padding row and a prefill chunk whose rows
    the arena keeps only in part (sink, recent), then a decode step."""
    from lowbit.rotation.hadamard import hadamard

    torch.manual_seed(4)
    fmt = SlotFormat(parse_kv_scheme("int2", sink=3, recent=5, page=1), 64, 64, torch.bfloat16)
    r = hadamard(64)
    bs, H = 4, 3
    table = torch.tensor([[5, 2, 7, 0, 1], [3, 6, 4, 8, 9]])
    pos = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 0, 1, 2])
    req = torch.tensor([0] * 11 + [1] * 3)
    slots = table[req, pos // bs] * bs + pos % bs
    slots[12] = -1  # a padding row
    lens = torch.where(req == 0, 11, 3)
    steps = [(slots, pos, lens), (torch.tensor([table[0, 11 // bs] * bs + 11 % bs]), torch.tensor([11]),
                                  torch.tensor([12]))]
    caches = [torch.zeros(10, H, bs, fmt.slot_bytes, dtype=torch.uint8) for _ in range(4)]
    arenas = [paged.TierArena(3, 5, bs, torch.bfloat16) for _ in range(4)]
    for sm, p, ln in steps:
        memo: dict = {}
        for layer in range(2):
            k, v = torch.randn(len(sm), H, 64).bfloat16(), torch.randn(len(sm), H, 64).bfloat16()
            got, want = {}, {}
            a = paged.write(caches[layer], fmt, k, v, sm, r, r, positions=p, row_seq_lens=ln, arena=arenas[layer],
                            rotated=got, memo=memo)
            b = paged.write(caches[2 + layer], fmt, k, v, sm, r, r, positions=p, row_seq_lens=ln,
                            arena=arenas[2 + layer], rotated=want)
            assert a == b == int((sm >= 0).sum())
            assert got.keys() == want.keys() and all(torch.equal(got[x], want[x]) for x in got if x != "n")
        assert memo, "the write indices were not memoised"
    for layer in range(2):
        assert torch.equal(caches[layer], caches[2 + layer])
        x, y = arenas[layer], arenas[2 + layer]
        assert sorted(x.k) == sorted(y.k) == [2, 3, 5, 7]  # request 0: sink in 5, recent in 2, 7; request 1: 3
        for blk in x.k:
            assert torch.equal(x.k[blk], y.k[blk]) and torch.equal(x.v[blk], y.v[blk])


@pytest.mark.parametrize("name,D,group,H,kw", [
    ("int4", 64, 64, 3, {}),  # smollm2's default
    ("int4", 96, 32, 5, {"clip": ".96,.92"}),  # clipped, three groups per head
    ("int8", 128, 64, 1, {}),
    ("int3", 64, 16, 2, {}),  # 3-bit codes in 4-bit containers
    ("k4v2", 256, 128, 4, {"grid": "minmax", "clip": ".9"}),  # K and V with their own codecs
    ("int4", 64, 32, 3, {"symmetric": True}),
    ("int2", 64, 64, 2, {"grid": "minmax", "symmetric": True, "clip": ".94"}),
    ("int2", 64, 64, 3, {}),  # the int2 default: the std grid, K and V in one codec
    ("int3", 48, 16, 2, {"grid": "std"}),  # std grid, 3-bit codes, three groups per head
    ("k4v2", 128, 64, 2, {}),  # K min/max, V std (the k4v2 default)
    ("k2v4", 64, 32, 3, {}),  # K std, V min/max
])
@pytest.mark.parametrize("T", [1, 3, 16])
def test_fast_cell_encoder_writes_the_codecs_bytes(name, D, group, H, kw, T):
    """SlotFormat.encode_rotated's fast path (csrc/cell_encode.cpp, a decode step's <= FAST_ROWS rows) gives
    the bytes of TensorCodec.encode (fast=False) bit for bit: odd head counts and dims, clip ratios, symmetric
    grids, 3-bit codes, K/V with different codecs, padded cells, bf16 / fp32 inputs with outliers and values
    on fp16 rounding edges; the codec is not called. Rows it cannot mirror (a constant group, NaN) send the
    write to the codec -- still the codec's bytes."""
    from lowbit.quant import affine
    from lowbit.vllm_plugin import slot as slot_mod

    assert T <= slot_mod.FAST_ROWS
    enc, why = cpu_kernel.load_encoder()
    assert enc is not None, why
    sch = parse_kv_scheme(name, sink=0, recent=0, page=1, group=group, rotation="none", **kw)
    g = torch.Generator().manual_seed(T * 31 + D + H)
    for dtype, pad in ((torch.float32, 0), (torch.bfloat16, 12)):
        fmt = SlotFormat(sch, D, D, dtype)
        if pad:
            fmt = SlotFormat(sch, D, D, dtype, slot_bytes=fmt.slot_bytes + pad)
        assert fmt._encoder() is not None
        for trial in range(6):
            kr = torch.randn(1, H, T, D, generator=g) * torch.exp(torch.randn(1, H, T, 1, generator=g) * 1.5)
            vr = torch.randn(1, H, T, D, generator=g) * 0.01
            kr[..., 5] += 40.0  # an outlier per row
            if trial % 2:
                kr, vr = kr.to(dtype).float(), vr.to(dtype)  # rows as the model dtype carries them
            calls = []
            real, real_std = affine.quantize, affine.quantize_std

            def spy(*a, **k):
                calls.append(1)
                return real(*a, **k)

            def spy_std(*a, **k):
                calls.append(2)
                return real_std(*a, **k)

            affine.quantize, affine.quantize_std = spy, spy_std
            try:
                got = fmt.encode_rotated(kr, vr)
            finally:
                affine.quantize, affine.quantize_std = real, real_std
            want = fmt.encode_rotated(kr, vr, fast=False)
            assert got.dtype == torch.uint8 and got.shape == want.shape == (T, H, fmt.slot_bytes)
            assert torch.equal(got, want), (dtype, trial, (got != want).nonzero()[:5].tolist())
            # written straight into a cache of random bytes at scattered (block, offset): those cells, nothing else
            cache = torch.randint(0, 256, (5, H, 7, fmt.slot_bytes), dtype=torch.uint8, generator=g)
            flat = torch.randperm(35, generator=g)[:T]
            want_cache = cache.clone()
            want_cache[flat // 7, :, flat % 7, :] = want
            fmt.write_rotated(cache, flat // 7, flat % 7, kr, vr)
            assert torch.equal(cache, want_cache), (dtype, trial)
            assert calls == [], "the fast path did not serve a decode-sized write"
    # a constant group and a NaN row: the codec serves the write (its own bytes, whatever they are)
    fmt = SlotFormat(sch, D, D, torch.float32)
    kr, vr = torch.randn(1, H, T, D, generator=g), torch.randn(1, H, T, D, generator=g)
    kr[0, 0, 0, :group] = 0.25
    assert torch.equal(fmt.encode_rotated(kr, vr), fmt.encode_rotated(kr, vr, fast=False))
    cache = torch.randint(0, 256, (3, H, T, fmt.slot_bytes), dtype=torch.uint8, generator=g)
    fmt.write_rotated(cache, torch.ones(T, dtype=torch.long), torch.arange(T), kr, vr)  # declined: the codec writes
    assert torch.equal(cache[1].transpose(0, 1), fmt.encode_rotated(kr, vr, fast=False))
    vr[0, H - 1, T - 1, 1] = float("nan")
    kr[0, 0, 0, :group] = torch.randn(group, generator=g)
    assert torch.equal(fmt.encode_rotated(kr, vr), fmt.encode_rotated(kr, vr, fast=False))
