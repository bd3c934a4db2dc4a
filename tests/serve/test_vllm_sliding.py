"""The vLLM plugin on sliding-window layers, without vLLM (paged.py is plain torch).

vLLM frees a request's blocks once every token in them is out of the window of its next query
(`num_computed_tokens - W + 1`), and may give them to another request at once. These tests free
blocks the same way and then poison them -- NaN bytes in the packed cache, NaN rows in the dense
arena (another request's rows) -- so any read of a freed block turns the output into NaN, and
check that what is attended equals the window semantics of lowbit's own runtime (kv/layer.py).
"""

from __future__ import annotations

import pytest
import torch

from lowbit.kv.scheme import parse_kv_scheme
from lowbit.vllm_plugin import paged
from lowbit.vllm_plugin.slot import SlotFormat


def _poison_freed(cache: torch.Tensor, arena, table_row: torch.Tensor, q0: int, window: int, bs: int,
                  d: int = 64) -> set[int]:
    """vLLM's SlidingWindowManager before a step whose first query is at q0: blocks whose tokens all lie
    before q0 - window + 1 are freed; here they are scribbled over as if another request got them."""
    freed = {int(table_row[i]) for i in range(max(0, q0 - window + 1) // bs)}
    for b in freed:
        cache[b] = 0xFF  # fp16 0xFFFF is NaN: a decoded row of this block is NaN
        if arena is not None:
            arena.k[b] = torch.full((cache.shape[1], bs, d), float("nan"))
            arena.v[b] = torch.full((cache.shape[1], bs, d), float("nan"))
    return freed


def _reference(q, k, v, fmt, scale, window, sink, recent, seq_len):
    """Dense attention of the last q [lq, Hq, D] over k/v [N, Hkv, D] as the tiers hold them: rows
    < sink or >= seq_len - recent exact, the rest through the codec; causal + window mask."""
    kd, vd = fmt.decode(fmt.encode(k, v).transpose(0, 1))  # [1, Hkv, N, D]
    N = k.shape[0]
    lq = q.shape[0]
    exact = torch.zeros(N, dtype=torch.bool)
    exact[:sink] = True
    if recent:
        exact[max(sink, seq_len - recent):] = True
    exact[N - lq:] = True  # the step's own chunk is attended as it arrived
    kd[0, :, exact] = k[exact].transpose(0, 1)
    vd[0, :, exact] = v[exact].transpose(0, 1)
    Hq, D = q.shape[1], q.shape[2]
    Hkv = kd.shape[1]
    G = Hq // Hkv
    qr = q.permute(1, 0, 2).reshape(Hkv, G, lq, D)
    s = torch.einsum("hgqd,hnd->hgqn", qr, kd[0]) * scale
    qpos = torch.arange(N - lq, N)[:, None]
    kpos = torch.arange(N)[None, :]
    s = s.masked_fill(~((kpos <= qpos) & (kpos > qpos - window)), float("-inf"))
    o = torch.einsum("hgqn,hnd->hgqd", torch.softmax(s, -1), vd[0])
    return o.permute(2, 0, 1, 3).reshape(lq, Hq, -1)


@pytest.mark.parametrize("window,sink,recent,steps", [
    (11, 0, 0, [23, 1, 1, 7, 1]),  # no tiers; prefill past the window, then decode / a chunk
    (11, 3, 5, [9, 1, 1, 1, 5, 1, 13, 1]),  # sink leaves the window; recent slides inside it
    (13, 6, 20, [30, 1, 3, 1]),  # recent longer than the window: only its visible part is read
    (5, 2, 3, [1] * 17),  # one token at a time from the start
])
def test_sliding_attention_reads_only_the_window(window, sink, recent, steps):
    torch.manual_seed(window + sink)
    bs, Hkv, G, D = 4, 1, 3, 64
    fmt = SlotFormat(parse_kv_scheme("int2", sink=sink, recent=recent, page=1, rotation="none"), D, D)
    total = sum(steps)
    nb = -(-total // bs)
    cache = torch.zeros(nb + 5, Hkv, bs, fmt.slot_bytes, dtype=torch.uint8)
    table = torch.randperm(nb + 5)[:nb][None]
    arena = paged.TierArena(sink, recent, bs, torch.float32, window=window) if sink or recent else None
    k, v = torch.randn(total, Hkv, D), torch.randn(total, Hkv, D)
    n = 0
    poisoned: set[int] = set()
    for lq in steps:
        poisoned |= _poison_freed(cache, arena, table[0], n, window, bs)
        pos = torch.arange(n, n + lq)
        slots = table[0][pos // bs] * bs + pos % bs
        seq = n + lq
        paged.write(cache, fmt, k[n:seq], v[n:seq], slots, positions=pos, row_seq_lens=torch.full((lq,), seq),
                    arena=arena)
        q = torch.randn(lq, Hkv * G, D)
        out = paged.attend(q, cache, fmt, block_table=table, seq_lens=torch.tensor([seq]),
                           query_start_loc=torch.tensor([0, lq]), scale=D ** -0.5, window=window, arena=arena,
                           new_k=k[n:seq], new_v=v[n:seq], chunk_tokens=8)
        assert not out.isnan().any(), "a freed block was read"
        want = _reference(q, k[:seq], v[:seq], fmt, D ** -0.5, window, sink, recent, seq)
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
        n = seq
        if arena is not None:
            vis = paged.visible_from(n, window)
            mine = {int(table[0][j // bs]) for j in range(vis, n)}  # blocks the next query can read
            # what the arena keeps for this request: only dense rows the next query can see
            assert {b for b in arena.k if b in mine} == arena.needed_blocks(table[0], n, vis)
            # the freed blocks (now another request's) were never evicted by this request
            assert poisoned <= set(arena.k)
    assert poisoned, "the steps never left the window: the test does not exercise freeing"


def test_sink_of_a_sliding_layer_is_exact_only_inside_the_window():
    """lowbit's runtime keeps the sink of a sliding layer while any of it is in the window; here its
    rows are read dense while visible and the arena drops them once the next query cannot see them."""
    bs, D, W = 4, 64, 10
    fmt = SlotFormat(parse_kv_scheme("int2", sink=4, recent=0, page=1), D, D)
    cache = torch.zeros(8, 1, bs, fmt.slot_bytes, dtype=torch.uint8)
    arena = paged.TierArena(4, 0, bs, torch.float32, window=W)
    table = torch.tensor([[6, 2, 5, 0, 3, 1]])
    k, v = torch.randn(20, 1, D), torch.randn(20, 1, D)
    for n in range(1, 15):
        pos = torch.tensor([n - 1])
        paged.write(cache, fmt, k[n - 1:n], v[n - 1:n], table[0][pos // bs] * bs + pos % bs, positions=pos,
                    row_seq_lens=torch.tensor([n]), arena=arena)
        if n - 1 < W:  # the sink block is still in reach: its rows come back exact
            (kd, _, lo), *_ = paged._blocks(cache, fmt, table[0], n, 1024, arena, start=paged.visible_from(n - 1, W))
            assert lo == 0 and torch.equal(kd[0, 0, :min(4, n)], k[:min(4, n), 0])
        paged.attend(torch.randn(1, 1, D), cache, fmt, block_table=table, seq_lens=torch.tensor([n]),
                     query_start_loc=torch.tensor([0, 1]), scale=0.1, window=W, arena=arena,
                     new_k=k[n - 1:n], new_v=v[n - 1:n])
        # the next query (at n) sees [n - W + 1, n]: the sink block (positions 0-3) stays while 3 is in it
        assert (6 in arena.k) == (n - W + 1 <= 3)


def test_arena_window_must_match_the_attention():
    fmt = SlotFormat(parse_kv_scheme("int4", sink=2, recent=0, page=1), 64, 64)
    cache = torch.zeros(2, 1, 4, fmt.slot_bytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match="window 7"):
        paged.attend(torch.randn(1, 1, 64), cache, fmt, block_table=torch.tensor([[0, 1]]), seq_lens=torch.tensor([1]),
                     query_start_loc=torch.tensor([0, 1]), scale=0.1, window=None,
                     arena=paged.TierArena(2, 0, 4, torch.float32, window=7))


class _SlidingEmulation:
    """paged.write + paged.attend driven by a tiny gemma3 (5 sliding + 1 full layers) in place of
    vLLM, each layer with its own paged cache, arena (with the layer's window) and freeing."""

    def __init__(self, model, scheme, geometry, block_size=4, num_blocks=64):
        from transformers import AttentionInterface

        from lowbit.kv.plan import resolve

        g = geometry.layers[0]
        self.fmt = SlotFormat(scheme, g.head_dim_k, g.head_dim_v, torch.float32)
        self.rots = [(lp.rot_k, lp.rot_v) for lp in resolve(scheme, geometry).layers]
        self.windows = [lg.window if lg.attention == "sliding" else None for lg in geometry.layers]
        self.caches = [torch.zeros(num_blocks, g.num_kv_heads, block_size, self.fmt.slot_bytes, dtype=torch.uint8)
                       for _ in geometry.layers]
        self.table = torch.randperm(num_blocks)[None]
        self.bs = block_size
        self.arenas = [paged.TierArena(scheme.sink, scheme.recent, block_size, torch.float32, window=w)
                       if scheme.sink or scheme.recent else None for w in self.windows]
        self.pos = 0
        self.freed = 0
        self.name = f"lowbit_sliding_emulation_{id(self)}"
        AttentionInterface.register(self.name, self._attention)
        self.model = model

    def _attention(self, module, query, key, value, attention_mask, scaling=None, **kw):
        i = module.layer_idx
        w = self.windows[i]
        assert kw.get("sliding_window") == w  # the model's own window reaches the attention
        L = query.shape[2]
        if w is not None:
            self.freed += len(_poison_freed(self.caches[i], self.arenas[i], self.table[0], self.pos, w, self.bs,
                                                   self.fmt.codecs["k"].head_dim))
        pos = torch.arange(self.pos, self.pos + L)
        slots = self.table[0][pos // self.bs] * self.bs + pos % self.bs
        rk, rv = self.rots[i]
        seq_lens, qsl = torch.tensor([self.pos + L]), torch.tensor([0, L])
        positions, row_lens = paged.token_positions(qsl, seq_lens, L)
        k, v = key[0].transpose(0, 1), value[0].transpose(0, 1)
        paged.write(self.caches[i], self.fmt, k, v, slots, rk, rv, positions=positions, row_seq_lens=row_lens,
                    arena=self.arenas[i])
        out = paged.attend(query[0].transpose(0, 1), self.caches[i], self.fmt, block_table=self.table,
                           seq_lens=seq_lens, query_start_loc=qsl, scale=scaling, rot_k=rk, rot_v=rv, window=w,
                           softcap=kw.get("softcap"), arena=self.arenas[i], chunk_tokens=8, new_k=k, new_v=v)
        return out[None].to(query.dtype), None

    @torch.no_grad()
    def logits(self, ids: list[int]) -> torch.Tensor:
        prev = self.model.config._attn_implementation
        self.model.set_attn_implementation(self.name)
        try:
            out = self.model(input_ids=torch.tensor([ids]),
                             position_ids=torch.arange(self.pos, self.pos + len(ids))[None], use_cache=False)
        finally:
            self.model.set_attn_implementation(prev)
        self.pos += len(ids)
        return out.logits[0, -1]


@pytest.mark.parametrize("name,rotation,sink,recent,chunk", [
    ("int4", "none", 0, 0, 1000),
    ("int2", "hadamard", 5, 7, 1000),
    ("int2", "hadamard", 3, 30, 9),  # chunked prefill, recent longer than the window
])
def test_plugin_equals_lowbit_runtime_on_tiny_gemma3(name, rotation, sink, recent, chunk):
    """A tiny gemma3 with window 13: a 41-token prompt (fed in `chunk`s) then 10 greedy steps give the
    same logits through the plugin path (freed blocks poisoned) as through lowbit's QuantizedKVCache."""
    from transformers import AutoModelForCausalLM

    from lowbit.models.geometry import ModelGeometry
    from lowbit.models.tiny import tiny_config
    from lowbit.serve.kvcache import CacheFactory

    cfg = tiny_config("gemma3-270m", vocab_size=101)
    cfg.sliding_window = 13
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    geometry = ModelGeometry.from_config(cfg, name="tiny-gemma3")
    assert [g.window for g in geometry.layers if g.attention == "sliding"] == [13] * 5
    scheme = parse_kv_scheme(name, sink=sink, recent=recent, page=1, rotation=rotation)
    emu = _SlidingEmulation(model, scheme, geometry)
    cache = CacheFactory(model, scheme, geometry).new()
    ids = torch.randint(4, 101, (41,), generator=torch.Generator().manual_seed(7)).tolist()
    with torch.no_grad():
        for c in range(0, len(ids), chunk):
            want = model(input_ids=torch.tensor([ids[c:c + chunk]]), cache=cache, use_cache=True).logits[0, -1]
            got = emu.logits(ids[c:c + chunk])
        for _ in range(10):
            torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
            t = int(torch.argmax(want))
            assert int(torch.argmax(got)) == t
            want = model(input_ids=torch.tensor([[t]]), cache=cache, use_cache=True).logits[0, -1]
            got = emu.logits([t])
    assert emu.freed > 0  # blocks did leave the window and were poisoned
