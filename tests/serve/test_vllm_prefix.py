"""Prefix caching with exact tiers, without vLLM: several requests share one paged cache (a scrambled
block pool), a later request starts with an earlier one's first blocks as vLLM's prefix cache hands
them out, the metadata builder's once-per-step retain runs as in the backend, and the hit must give
the same logits and greedy tokens as a miss whose prefill had a chunk boundary at the hit."""

from __future__ import annotations

import pytest
import torch

from lowbit.vllm_plugin import paged, prefix


class PrefixEmulation:
    """The plugin's write + attend for several requests over one block pool, driven by a transformers model:
    each request has its own block table; `hit` starts a request on another's first blocks (what vLLM's
    prefix cache does); every step runs paged.retain_step over the step's running request first (the
    backend's metadata builder), so a finished request's blocks are dropped unless held."""

    def __init__(self, rt, block_size: int = 16, num_blocks: int = 40, hold_prefix: bool = True, seed: int = 0):
        from transformers import AttentionInterface

        from lowbit.kv.plan import resolve
        from lowbit.vllm_plugin import cpu_kernel
        from lowbit.vllm_plugin.slot import layer_formats

        g = rt.geometry.layers[0]
        plan = resolve(rt.scheme, rt.geometry)
        self.windows = [lg.window if lg.attention == "sliding" else None for lg in rt.geometry.layers]
        self.fmts = layer_formats(plan, torch.float32)
        self.rots = [(lp.rot_k, lp.rot_v) for lp in plan.layers]
        gen = torch.Generator().manual_seed(seed)
        # vLLM does not zero its cache: unwritten cells hold whatever was there
        self.caches = [torch.randint(0, 256, (num_blocks, g.num_kv_heads, block_size, f.slot_bytes),
                                     dtype=torch.uint8, generator=gen) for f in self.fmts]
        self.kernel = "cpu-fused" if cpu_kernel.load()[0] is not None else "torch"
        self.free = torch.randperm(num_blocks, generator=gen).tolist()
        self.bs = block_size
        s = rt.scheme
        self.arenas = [paged.TierArena(s.sink, s.recent, block_size, torch.float32, window=w, hold_prefix=hold_prefix)
                       for w in self.windows]
        self.model = rt.model
        self.cur = None
        AttentionInterface.register("lowbit_prefix_emulation", self._attention)

    def request(self, hit_blocks: list[int] = ()) -> dict:
        """A new request; hit_blocks: cached full blocks of its prompt's start (a prefix-cache hit)."""
        return {"table": list(hit_blocks), "pos": len(hit_blocks) * self.bs}

    def finish(self, req: dict, keep: int = 0) -> None:
        """The request ends: its blocks go back to the free list (the first `keep` stay cached for hits)."""
        self.free = req["table"][keep:] + self.free  # reused first, as vLLM's LRU free queue would

    def _table(self, req) -> torch.Tensor:
        return torch.tensor(req["table"] + [0] * (64 - len(req["table"])))[None]

    def _attention(self, module, query, key, value, attention_mask, scaling=None, **kw):
        i, req = module.layer_idx, self.cur
        L = query.shape[2]
        pos = torch.arange(req["pos"], req["pos"] + L)
        table = self._table(req)
        slots = table[0][pos // self.bs] * self.bs + pos % self.bs
        rk, rv = self.rots[i]
        seq_lens, qsl = torch.tensor([req["pos"] + L]), torch.tensor([0, L])
        positions, row_lens = paged.token_positions(qsl, seq_lens, L)
        paged.write(self.caches[i], self.fmts[i], key[0].transpose(0, 1), value[0].transpose(0, 1), slots, rk, rv,
                    positions=positions, row_seq_lens=row_lens, arena=self.arenas[i])
        out = paged.attend(query[0].transpose(0, 1), self.caches[i], self.fmts[i], block_table=table,
                           seq_lens=seq_lens, query_start_loc=qsl, scale=scaling, rot_k=rk, rot_v=rv,
                           window=self.windows[i], softcap=kw.get("softcap"), arena=self.arenas[i], chunk_tokens=32, new_k=key[0].transpose(0, 1),
                           new_v=value[0].transpose(0, 1), kernel=self.kernel, evict=False)
        return out[None].to(query.dtype), None

    @torch.no_grad()
    def step(self, req: dict, ids: list[int]) -> torch.Tensor:
        """Compute `ids` for the request (one step: a prefill chunk or one decode token) -> last logits."""
        n = req["pos"] + len(ids)
        while len(req["table"]) * self.bs < n:
            req["table"].append(self.free.pop(0))
        paged.retain_step(self.arenas, self._table(req), [n], [len(ids)])  # the builder, before the layers
        self.cur = req
        prev = self.model.config._attn_implementation
        self.model.set_attn_implementation("lowbit_prefix_emulation")
        try:
            out = self.model(input_ids=torch.tensor([ids]), position_ids=torch.arange(req["pos"], n)[None],
                             use_cache=False)
        finally:
            self.model.set_attn_implementation(prev)
        req["pos"] = n
        return out.logits[0, -1]

    def greedy(self, req: dict, logits: torch.Tensor, n: int) -> tuple[list[int], list[torch.Tensor]]:
        toks, seen = [], [logits]
        for _ in range(n):
            toks.append(int(torch.argmax(seen[-1])))
            seen.append(self.step(req, [toks[-1]]))
        return toks, seen


def _prompts(rt, shared: int, len_b: int, len_a: int = 120) -> tuple[list[int], list[int]]:
    text = "Shared system prompts are cached once and reused by every later request that starts with them. " * 3
    a = rt.tokenizer.encode(text)[:len_a]
    tail = rt.tokenizer.encode("A different question follows the shared part, and it is long enough here. " * 2)
    b = a[:shared] + tail[: len_b - shared]
    assert len(a) == len_a and len(b) == len_b and a[shared] != b[shared]
    return a, b


def _hit_len(shared: int, len_b: int, recent: int, bs: int) -> tuple[int, int]:
    """(vLLM's hit without lowbit: the shared full blocks, at most len_b - 1 tokens; the hit with the recent
    window held back: prefix.limit, block-aligned down as vLLM does)."""
    plain = min(shared, len_b - 1) // bs * bs
    return plain, min(plain, prefix.limit(len_b - 1, recent) // bs * bs)


CASES = [  # name, sink, recent, layer_bits, shared prefix, len(B)
    ("inside-recent", 5, 21, None, 80, 90),  # the shared part ends inside B's last 21 tokens: the hit is cut
    ("past-recent", 19, 21, None, 60, 100),  # ends before them: the whole shared part hits (sink spans 2 blocks)
    ("per-layer-bits", 5, 21, "0=int8;1=int4", 80, 93),
]


@pytest.mark.parametrize("name,sink,recent,layer_bits,shared,len_b", CASES, ids=[c[0] for c in CASES])
def test_a_prefix_hit_gives_the_tokens_of_a_miss(name, sink, recent, layer_bits, shared, len_b):
    from tests.serve.conftest import tiny_runtime

    rt = tiny_runtime("int2", sink=sink, recent=recent, page=1, rotation="hadamard", layer_bits=layer_bits)
    bs = 16
    a, b = _prompts(rt, shared, len_b)
    plain, hit = _hit_len(shared, len_b, recent, bs)
    assert hit > 0 and (hit == plain if name == "past-recent" else hit < plain)

    emu = PrefixEmulation(rt, bs)
    r1 = emu.request()
    emu.greedy(r1, emu.step(r1, a), 4)  # request A: one-chunk prefill, then 4 decode steps
    emu.finish(r1, keep=hit // bs)
    first = r1["table"][: hit // bs]
    other = emu.request()  # another request runs meanwhile and reuses A's freed blocks
    emu.step(other, a[::-1][:40])
    emu.finish(other)
    assert set(first[: -(-sink // bs)]) <= emu.arenas[0].held.keys()  # A's sink blocks outlive A
    r2 = emu.request(first)  # the hit: B starts on A's first blocks, at `hit`
    hit_toks, hit_logits = emu.greedy(r2, emu.step(r2, b[hit:]), 10)
    assert r2["table"][: hit // bs] == first and all(x.refilled == 0 for x in emu.arenas)

    miss = PrefixEmulation(rt, bs, seed=1)  # a fresh cache: B alone, its prefill with a chunk boundary at `hit`
    m = miss.request()
    miss.step(m, b[:hit])
    miss_toks, miss_logits = miss.greedy(m, miss.step(m, b[hit:]), 10)
    assert hit_toks == miss_toks
    for x, y in zip(hit_logits, miss_logits):
        torch.testing.assert_close(x, y, rtol=1e-3, atol=1e-3)
    if len_b - hit <= hit:  # that miss is lowbit's own runtime prefilling in chunks of `hit`
        from tests.serve.conftest import reference_greedy

        assert reference_greedy(rt, b, 10, chunk=hit)[0][: len(hit_toks)] == hit_toks


@pytest.mark.parametrize("hold", ["off", "cap-1"])
def test_a_hit_without_its_held_sink_rows_reads_them_from_codes(hold):
    """The control: with the arena dropping a finished request's blocks (no hold), or holding only the latest
    prompt start (hold_cap 1, and another request started since), the hit's sink rows are gone: they are
    decoded from their codes (exactly the `sink` rows, counted), not read from whatever the pool holds."""
    from tests.serve.conftest import tiny_runtime

    sink = 5
    rt = tiny_runtime("int2", sink=sink, recent=21, page=1, rotation="hadamard")
    a, b = _prompts(rt, 60, 100)
    emu = PrefixEmulation(rt, 16, hold_prefix=hold != "off")
    for x in emu.arenas:
        x.hold_cap = 1 if hold == "cap-1" else None
    r1 = emu.request()
    emu.step(r1, a)
    emu.finish(r1, keep=3)
    emu.step(emu.request(), a[::-1][:9])  # a step without A: its blocks are not live
    assert (r1["table"][0] in emu.arenas[0].held) is False
    r2 = emu.request(r1["table"][:3])
    emu.step(r2, b[48:])
    assert [x.refilled for x in emu.arenas] == [sink] * len(emu.arenas)


def test_a_hit_whose_first_chunk_is_cut_reads_the_shared_window_from_codes():
    """When the step budget gives the hit's first chunk fewer than `recent` tokens, the window reaches back into
    the shared blocks: exactly rows [max(sink, hit + c - recent), hit) are decoded from their codes (counted)."""
    from tests.serve.conftest import tiny_runtime

    sink, recent, c = 5, 21, 7
    rt = tiny_runtime("int2", sink=sink, recent=recent, page=1, rotation="hadamard")
    a, b = _prompts(rt, 60, 100)
    emu = PrefixEmulation(rt, 16)
    r1 = emu.request()
    emu.step(r1, a)
    emu.finish(r1, keep=3)
    r2 = emu.request(r1["table"][:3])
    emu.step(r2, b[48:48 + c])
    assert [x.refilled for x in emu.arenas] == [48 - max(sink, 48 + c - recent)] * len(emu.arenas)
    logits = emu.step(r2, b[48 + c:])
    assert torch.isfinite(logits).all() and emu.arenas[0].refilled == 48 - (48 + c - recent)


def test_a_prefix_hit_on_sliding_window_layers_gives_the_tokens_of_a_miss():
    """A tiny gemma3 (5 sliding layers, window 13, + 1 full layer), blocks of 4, sink 3 / recent 7: the shared
    part ends inside B's recent window, so the hit is cut; on the sliding layers the hit reads only its window
    of the shared blocks. Same logits and greedy tokens as the miss chunked at the hit."""
    from types import SimpleNamespace as NS

    from transformers import AutoModelForCausalLM

    from lowbit.kv.scheme import parse_kv_scheme
    from lowbit.models.geometry import ModelGeometry
    from lowbit.models.tiny import tiny_config

    cfg = tiny_config("gemma3-270m", vocab_size=101)
    cfg.sliding_window = 13
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    rt = NS(model=model, geometry=ModelGeometry.from_config(cfg, name="tiny-gemma3"),
            scheme=parse_kv_scheme("int2", sink=3, recent=7, page=1, rotation="hadamard"))
    bs, shared, len_b = 4, 46, 50
    gen = torch.Generator().manual_seed(7)
    a = torch.randint(4, 101, (60,), generator=gen).tolist()
    b = a[:shared] + [(x % 90) + 5 for x in a[shared:len_b]]
    b[shared] = 4 if a[shared] != 4 else 5
    plain, hit = _hit_len(shared, len_b, 7, bs)
    assert 13 < hit < plain  # past the window: the sliding layers read only part of the shared blocks

    emu = PrefixEmulation(rt, bs, num_blocks=64)
    r1 = emu.request()
    emu.greedy(r1, emu.step(r1, a), 3)
    emu.finish(r1, keep=hit // bs)
    emu.step(emu.request(), a[::-1][:9])
    r2 = emu.request(r1["table"][: hit // bs])
    hit_toks, hit_logits = emu.greedy(r2, emu.step(r2, b[hit:]), 8)
    assert all(x.refilled == 0 for x in emu.arenas)
    miss = PrefixEmulation(rt, bs, num_blocks=64, seed=1)
    m = miss.request()
    miss.step(m, b[:hit])
    miss_toks, miss_logits = miss.greedy(m, miss.step(m, b[hit:]), 8)
    assert hit_toks == miss_toks
    for x, y in zip(hit_logits, miss_logits):
        torch.testing.assert_close(x, y, rtol=1e-3, atol=1e-3)


def test_scheduler_holds_back_the_recent_window(tmp_path):
    """prefix.install on a scheduler-shaped object: a lowbit directory with a recent tier gets its hits cut to
    num_tokens - recent; prefix caching off, or a plain directory, leaves the scheduler alone."""
    from types import SimpleNamespace as NS

    from lowbit.cli import main
    from tests.serve.conftest import tiny_runtime

    rt = tiny_runtime("bf16")
    plain = tmp_path / "tiny"
    rt.model.save_pretrained(plain)
    rt.tokenizer.save_pretrained(plain)
    exp = tmp_path / "tiny-int4"
    assert main(["export", "--for", "vllm", "--model", str(plain), "--kv", "int4", "--sink", "16", "--recent", "32",
                 "--out", str(exp)]) == 0

    def scheduler():
        coord = NS(find_longest_cache_hit=lambda hashes, max_len: ("blocks", max_len, 0))
        return NS(kv_cache_manager=NS(coordinator=coord))

    def config(d, on=True):
        return NS(cache_config=NS(enable_prefix_caching=on), model_config=NS(model=str(d)))

    s = scheduler()
    assert prefix.install(s, config(exp)) == 32
    assert s.kv_cache_manager.coordinator.find_longest_cache_hit([], 899) == ("blocks", 899 - 31, 0)
    assert s.kv_cache_manager.coordinator.find_longest_cache_hit([], 20) == ("blocks", 0, 0)
    assert prefix.install(s, config(exp)) == 32  # installing twice does not cut twice
    assert s.kv_cache_manager.coordinator.find_longest_cache_hit([], 899) == ("blocks", 868, 0)
    for d, on in ((exp, False), (plain, True)):
        s = scheduler()
        assert prefix.install(s, config(d, on)) == 0
        assert s.kv_cache_manager.coordinator.find_longest_cache_hit([], 899) == ("blocks", 899, 0)
    from lowbit.core.errors import LowbitError

    with pytest.raises(LowbitError, match="no kv_cache_manager.coordinator.find_longest_cache_hit"):
        prefix.install(NS(kv_cache_manager=NS()), config(exp))
