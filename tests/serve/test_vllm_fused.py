"""The plugin's fused CPU decode kernel (csrc/paged_decode.cpp) against its torch twin (paged._attend_group):
same packed cells, block tables, dense tiers and own rows; odd sizes, GQA ratios, 2/4/8 bits, two groups
per head, sliding windows with poisoned freed blocks, softcap, many requests in one batch."""

from __future__ import annotations

import pytest
import torch

from lowbit.recipe import parse_kv_scheme
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
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
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
