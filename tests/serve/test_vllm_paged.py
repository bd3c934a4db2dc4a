"""The vLLM plugin's math without vLLM: packed slots in a paged cache with shuffled block tables give
the attention of the quantized history (rotation, GQA, several requests, prefill + decode mixed)."""

from __future__ import annotations

import pytest
import torch

from lowbit.kv.scheme import parse_kv_scheme
from lowbit.vllm_plugin import paged
from lowbit.vllm_plugin.slot import SlotFormat


@pytest.mark.parametrize("name,bytes_", [("int2", 40), ("int4", 72), ("int8", 136), ("k4v2", 56)])
def test_slot_sizes_smollm2_geometry(name, bytes_):
    fmt = SlotFormat(parse_kv_scheme(name, sink=0, recent=0, page=1), 64, 64)
    assert fmt.slot_bytes == bytes_  # bf16 'auto' is 256 B: int2 holds 6.4x the tokens


def test_slot_roundtrip_is_the_codec():
    from lowbit.kv.codec import TensorCodec

    s = parse_kv_scheme("k4v2", sink=0, recent=0, page=1, clip=".96,.92")
    fmt = SlotFormat(s, 64, 64)
    k, v = torch.randn(7, 3, 64), torch.randn(7, 3, 64)
    kd, vd = fmt.decode(fmt.encode(k, v).transpose(0, 1))
    for x, xd, tq in ((k, kd, s.k), (v, vd, s.v)):
        c = TensorCodec(tq, 64, 1)
        ref = c.decode(c.encode(x.transpose(0, 1)[None], torch.float16))
        assert torch.equal(xd, ref)
        assert (xd - x.transpose(0, 1)[None]).abs().mean() > 1e-3  # really quantized


def test_writes_go_through_the_one_quantizer(monkeypatch):
    from lowbit.quant import affine

    calls = []
    real = affine.quantize

    def spy(x, bits, group, **kw):
        calls.append((tuple(x.shape), bits, group))
        return real(x, bits, group, **kw)

    monkeypatch.setattr(affine, "quantize", spy)
    from lowbit.vllm_plugin.slot import FAST_ROWS

    fmt = SlotFormat(parse_kv_scheme("int2", sink=0, recent=0, page=1, grid="minmax"), 64, 64)
    cache = torch.zeros(4, 3, 16, fmt.slot_bytes, dtype=torch.uint8)
    slots = torch.tensor([0, 1, -1, 17, 33] + list(range(40, 40 + FAST_ROWS)))  # a prefill-sized write
    n = paged.write(cache, fmt, torch.randn(len(slots), 3, 64), torch.randn(len(slots), 3, 64), slots)
    # K and V share the codec: one call over [1, 2H, T, D] (K's 3 heads then V's), every row through it
    assert n == 4 + FAST_ROWS and calls == [((1, 6, 4 + FAST_ROWS, 64), 2, 64)]
    assert cache[0, :, 0].any() and cache[1, :, 1].any() and cache[2, :, 1].any() and not cache[0, :, 2].any()
    # a decode-sized write: csrc/cell_encode.cpp, the codec's bytes bit for bit (test_vllm_fused.py), or the
    # codec itself where that encoder is not built
    calls.clear()
    k, v = torch.randn(3, 3, 64), torch.randn(3, 3, 64)
    assert paged.write(cache, fmt, k, v, torch.tensor([2, -1, 20])) == 2
    want = fmt.encode_rotated(k[[0, 2]].transpose(0, 1)[None], v[[0, 2]].transpose(0, 1)[None], fast=False)
    assert torch.equal(cache[0, :, 2], want[0]) and torch.equal(cache[1, :, 4], want[1])


def _reference(q, k, v, fmt, rk, rv, scale, window=None):
    """Dense attention of q [lq, Hq, D] over the quantized, rotated k/v [N, Hkv, D] (causal at the end)."""
    from lowbit.kv.rotations import rotate, unrotate

    kd, vd = fmt.decode(fmt.encode(k, v, rk, rv).transpose(0, 1))  # [1, Hkv, N, D]
    lq, Hq, D = q.shape
    Hkv, N = kd.shape[1], kd.shape[2]
    G = Hq // Hkv
    qr = rotate(q.permute(1, 0, 2).reshape(Hkv, G, lq, D).reshape(1, Hkv, G * lq, D), rk).reshape(Hkv, G, lq, D)
    s = torch.einsum("hgqd,hnd->hgqn", qr, kd[0]) * scale
    qpos = torch.arange(N - lq, N)[:, None]
    kpos = torch.arange(N)[None, :]
    ok = kpos <= qpos
    if window is not None:
        ok = ok & (kpos > qpos - window)
    s = s.masked_fill(~ok, float("-inf"))
    o = torch.einsum("hgqn,hnd->hgqd", torch.softmax(s, -1), vd[0])  # rotated
    o = unrotate(o.reshape(1, Hkv, G * lq, -1), rv).reshape(Hkv, G, lq, -1)
    return o.permute(2, 0, 1, 3).reshape(lq, Hq, -1)


@pytest.mark.parametrize("rotation,window", [("none", None), ("hadamard", None), ("hadamard", 5)])
def test_paged_attention_equals_dense_attention_over_the_codes(rotation, window):
    from lowbit.rotation.hadamard import hadamard

    torch.manual_seed(0)
    Hkv, G, D, bs = 3, 3, 64, 16
    fmt = SlotFormat(parse_kv_scheme("k4v2", sink=0, recent=0, page=1), D, D)
    rk = rv = hadamard(D) if rotation == "hadamard" else None
    cache = torch.zeros(20, Hkv, bs, fmt.slot_bytes, dtype=torch.uint8)
    free = torch.randperm(20).tolist()  # blocks handed out in a scrambled order
    lens, q_lens = [37, 1, 99 - 60], [37, 1, 3]  # a prefill, a 1-token request, a 3-token continuation
    seqs, tables = [], []
    for n in lens:
        nb = -(-n // bs)
        tables.append([free.pop() for _ in range(nb)] + [0] * (7 - nb))
        seqs.append((torch.randn(n, Hkv, D), torch.randn(n, Hkv, D)))
    table = torch.tensor(tables)
    # history before this step, then this step's new tokens, written through the plugin path
    for (k, v), row, n, lq in zip(seqs, tables, lens, q_lens):
        pos = torch.arange(n)
        slots = torch.tensor(row)[pos // bs] * bs + pos % bs
        paged.write(cache, fmt, k[: n - lq], v[: n - lq], slots[: n - lq], rk, rv)
        paged.write(cache, fmt, k[n - lq:], v[n - lq:], slots[n - lq:], rk, rv)
    q = torch.randn(sum(q_lens), Hkv * G, D)
    qsl = torch.tensor([0, 37, 38, 41])
    out = paged.attend(q, cache, fmt, block_table=table, seq_lens=torch.tensor(lens), query_start_loc=qsl,
                       scale=D ** -0.5, rot_k=rk, rot_v=rv, window=window, chunk_tokens=16)
    for r, ((k, v), lq) in enumerate(zip(seqs, q_lens)):
        ref = _reference(q[qsl[r]:qsl[r + 1]], k, v, fmt, rk, rv, D ** -0.5, window)
        torch.testing.assert_close(out[qsl[r]:qsl[r + 1]], ref, rtol=1e-4, atol=1e-5)


def test_plugin_pins_the_vllm_series():
    from lowbit.core.errors import LowbitError
    from lowbit.vllm_plugin import VLLM_SERIES, check_vllm_version

    check_vllm_version(VLLM_SERIES + ".0")
    check_vllm_version(VLLM_SERIES + ".1+cpu")
    for other in ("0.33.0", "0.31.2", "1.32.0"):
        with pytest.raises(LowbitError, match=f"targets vLLM {VLLM_SERIES}.x .* but vLLM {other} is installed"):
            check_vllm_version(other)


def test_entry_point_is_declared():
    import tomllib
    from pathlib import Path

    d = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    assert d["project"]["entry-points"]["vllm.general_plugins"] == {"lowbit": "lowbit.vllm_plugin:register"}


class PagedEmulation:
    """The plugin's write + attend driven by a transformers model instead of vLLM: each layer's new
    K/V go through paged.write into a paged cache (scrambled blocks), attention through paged.attend.
    Same model numerics as lowbit's runtime, so the two must agree."""

    def __init__(self, model, scheme, geometry, block_size=16, num_blocks=64):
        from transformers import AttentionInterface

        from lowbit.kv.plan import resolve
        from lowbit.vllm_plugin import cpu_kernel
        from lowbit.vllm_plugin.slot import layer_formats

        g = geometry.layers[0]
        plan = resolve(scheme, geometry)
        self.fmts = layer_formats(plan, torch.float32)  # each layer's own bits, one (padded) cell size
        self.rots = [(lp.rot_k, lp.rot_v) for lp in plan.layers]
        self.affines = [lp.k_affine for lp in plan.layers]  # as the backend takes them (LowbitModel.key_affines)
        self.caches = [torch.zeros(num_blocks, g.num_kv_heads, block_size, f.slot_bytes, dtype=torch.uint8)
                       for f in self.fmts]
        self.kernel = "cpu-fused" if cpu_kernel.load()[0] is not None else "torch"  # what the backend runs
        self.table = torch.randperm(num_blocks)[None]
        self.bs = block_size
        self.arenas = [paged.TierArena(scheme.sink, scheme.recent, block_size, torch.float32)
                       if scheme.sink or scheme.recent else None for _ in geometry.layers]
        self.pos = 0
        AttentionInterface.register("lowbit_paged_emulation", self._attention)
        self.model = model

    def _attention(self, module, query, key, value, attention_mask, scaling=None, **kw):
        i = module.layer_idx
        L = query.shape[2]
        pos = torch.arange(self.pos, self.pos + L)
        slots = self.table[0][pos // self.bs] * self.bs + pos % self.bs
        rk, rv = self.rots[i]
        seq_lens, qsl = torch.tensor([self.pos + L]), torch.tensor([0, L])
        positions, row_lens = paged.token_positions(qsl, seq_lens, L)
        assert torch.equal(positions, pos)
        paged.write(self.caches[i], self.fmts[i], key[0].transpose(0, 1), value[0].transpose(0, 1), slots, rk, rv,
                    positions=positions, row_seq_lens=row_lens, arena=self.arenas[i], k_affine=self.affines[i])
        out = paged.attend(query[0].transpose(0, 1), self.caches[i], self.fmts[i], block_table=self.table,
                           seq_lens=seq_lens, query_start_loc=qsl, scale=scaling, rot_k=rk, rot_v=rv,
                           window=kw.get("sliding_window"), arena=self.arenas[i], chunk_tokens=32,
                           new_k=key[0].transpose(0, 1), new_v=value[0].transpose(0, 1), kernel=self.kernel,
                           k_affine=self.affines[i])
        return out[None].to(query.dtype), None

    @torch.no_grad()
    def logits(self, ids: list[int]) -> torch.Tensor:
        prev = self.model.config._attn_implementation
        self.model.set_attn_implementation("lowbit_paged_emulation")
        try:
            x = torch.tensor([ids])
            out = self.model(input_ids=x, position_ids=torch.arange(self.pos, self.pos + len(ids))[None], use_cache=False)
        finally:
            self.model.set_attn_implementation(prev)
        self.pos += len(ids)
        return out.logits[0, -1]


@pytest.mark.parametrize("name,rotation,sink,recent,layer_bits",
                         [("int4", "none", 0, 0, None), ("k4v2", "hadamard", 0, 0, None),
                          ("int2", "hadamard", 19, 0, None), ("int2", "hadamard", 5, 21, None),
                          ("int2", "hadamard", 5, 21, "0=int8;1=int4")])
def test_plugin_math_equals_lowbit_runtime_on_a_model(name, rotation, sink, recent, layer_bits):
    """Greedy tokens and logits of the plugin path == lowbit's own cache with the same sink / recent and
    page 1 (a sink of 19 spans two 16-token blocks; recent 21 slides over block edges while decoding);
    per-layer bits: each layer through its own codec in a cell padded to the widest (int8) one."""
    from lowbit.serve.kvcache import CacheFactory
    from tests.serve.conftest import tiny_runtime

    rt = tiny_runtime(name, sink=sink, recent=recent, page=1, rotation=rotation, layer_bits=layer_bits)
    emu = PagedEmulation(rt.model, rt.scheme, rt.geometry)
    if layer_bits:
        assert [f.codecs["k"].bits for f in emu.fmts][:2] == [8, 4] and len({f.slot_bytes for f in emu.fmts}) == 1
    cache = CacheFactory(rt.model, rt.scheme, rt.geometry).new()
    ids = rt.tokenizer.encode("Paged caches hold packed slots; does the math agree?")
    with torch.no_grad():
        want = rt.model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True).logits[0, -1]
        got = emu.logits(ids)
        for _ in range(12):
            torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
            t = int(torch.argmax(want))
            assert int(torch.argmax(got)) == t
            want = rt.model(input_ids=torch.tensor([[t]]), cache=cache, use_cache=True).logits[0, -1]
            got = emu.logits([t])


def test_token_positions_of_a_mixed_batch():
    # requests: 5 new of 5 (prefill), 1 new of 40 (decode), 3 new of 12 (continuation); 2 padding slots
    pos, lens = paged.token_positions(torch.tensor([0, 5, 6, 9]), torch.tensor([5, 40, 12]), 11)
    assert pos.tolist() == [0, 1, 2, 3, 4, 39, 9, 10, 11, -1, -1]
    assert lens.tolist() == [5] * 5 + [40] + [12] * 3 + [0, 0]


def test_sink_rows_are_read_dense():
    """With a sink, attention over the first rows uses their exact values, not their codes."""
    torch.manual_seed(1)
    fmt = SlotFormat(parse_kv_scheme("int2", sink=16, recent=0, page=1), 64, 64)
    cache = torch.zeros(4, 3, 16, fmt.slot_bytes, dtype=torch.uint8)
    arena = paged.TierArena(16, 0, 16, torch.float32)
    k, v = torch.randn(20, 3, 64), torch.randn(20, 3, 64)
    table = torch.tensor([[2, 0]])
    pos = torch.arange(20)
    paged.write(cache, fmt, k, v, table[0][pos // 16] * 16 + pos % 16, positions=pos,
                row_seq_lens=torch.full((20,), 20), arena=arena)
    blocks = list(paged._blocks(cache, fmt, table[0], 20, 1024, arena))
    (kd, vd, _lo), = blocks
    assert torch.equal(kd[0, :, :16], k[:16].transpose(0, 1)) and torch.equal(vd[0, :, :16], v[:16].transpose(0, 1))
    assert not torch.allclose(kd[0, :, 16:], k[16:].transpose(0, 1), atol=1e-2)  # the rest are int2 codes


def test_recent_window_slides_and_old_blocks_are_evicted():
    fmt = SlotFormat(parse_kv_scheme("int2", sink=0, recent=20, page=1), 64, 64)
    cache = torch.zeros(8, 1, 16, fmt.slot_bytes, dtype=torch.uint8)
    arena = paged.TierArena(0, 20, 16, torch.float32)
    table = torch.tensor([[5, 1, 7, 3]])
    k, v = torch.randn(60, 1, 64), torch.randn(60, 1, 64)
    q = torch.randn(1, 1, 64)
    for n in (1, 30, 45, 60):  # grow the request step by step; the window covers [n - 20, n)
        done = sum(1 for b in arena.k)  # noqa: F841 (documents that the arena changes)
        prev = 0 if n == 1 else {30: 1, 45: 30, 60: 45}[n]
        pos = torch.arange(prev, n)
        paged.write(cache, fmt, k[prev:n], v[prev:n], table[0][pos // 16] * 16 + pos % 16, positions=pos,
                    row_seq_lens=torch.full((n - prev,), n), arena=arena)
        paged.attend(q, cache, fmt, block_table=table, seq_lens=torch.tensor([n]), query_start_loc=torch.tensor([0, 1]),
                     scale=0.125, arena=arena)
        need = arena.needed_blocks(table[0], n)
        assert set(arena.k) == need  # evicted down to the window's blocks
        kd, _, _ = next(paged._blocks(cache, fmt, table[0], n, 1024, arena))
        lo = max(0, n - 20)
        assert torch.equal(kd[0, 0, lo:n], k[lo:n, 0])  # window rows exact
    arena.retain(set())
    assert not arena.k


def test_a_kv_budget_below_one_requests_tiers_is_one_line():
    from lowbit.core.errors import LowbitError
    from lowbit.kv.plan import resolve
    from lowbit.models.geometry import ModelGeometry
    from lowbit.models.tiny import tiny_config
    from lowbit.vllm_plugin.slot import check_budget, layer_formats

    geometry = ModelGeometry.from_config(tiny_config("smollm2-135m"), name="tiny")
    scheme = parse_kv_scheme("int4", sink=7, recent=9, page=1)
    fmts = layer_formats(resolve(scheme, geometry), torch.bfloat16)
    need = 16 * sum(g.num_kv_heads * f.slot_bytes for g, f in zip(geometry.layers, fmts))
    check_budget(need, scheme, geometry, fmts)  # exactly one request's tiers: fine
    check_budget(None, scheme, geometry, fmts)  # vLLM sizing the cache itself: nothing to check
    with pytest.raises(LowbitError, match=f"cannot hold one request's sink \\+ recent .*at least {need} bytes") as e:
        check_budget(need - 1, scheme, geometry, fmts)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("sink,recent", [(0, 0), (5, 21)])
def test_plugin_serves_a_key_affine_recipe_as_lowbit_does(tmp_path, sink, recent):
    """A key-affine int2 recipe (lowbit tune's kind): the plugin's write + attend, with the layer's map, give
    lowbit's own cache's logits and greedy tokens (keys stored mapped in every tier, queries scaled; the
    fused C++ decode takes the scaled queries); the same cells read without the query map do not."""
    from lowbit.calib import key_affine as kfit
    from lowbit.kv import key_affine as kam
    from lowbit.kv.scheme import RotationRef
    from lowbit.models.tiny import tiny_tokenizer_free_inputs
    from lowbit.serve.kvcache import CacheFactory
    from tests.serve.conftest import tiny_runtime

    rt0 = tiny_runtime("bf16")
    maps = kfit.fit(rt0.model, tiny_tokenizer_free_inputs(rt0.model.config, 2, 70, seed=11), skip=4)
    d = kam.save(tmp_path / "ka", maps, model="tiny")
    assert any(float((m.scale - 1).abs().max()) > 0.05 for m in maps.values())  # a map that changes the stored keys
    rt = tiny_runtime("int2", sink=sink, recent=recent, page=1, rotation=RotationRef(str(d)))
    emu = PagedEmulation(rt.model, rt.scheme, rt.geometry)
    assert all(a is not None for a in emu.affines)
    cache = CacheFactory(rt.model, rt.scheme, rt.geometry).new()
    ids = rt.tokenizer.encode("Keys mapped before the rotation; queries scaled to match.")
    with torch.no_grad():
        want = rt.model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True).logits[0, -1]
        got = emu.logits(ids)
        for _ in range(10):
            torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
            t = int(torch.argmax(want))
            assert int(torch.argmax(got)) == t
            want = rt.model(input_ids=torch.tensor([[t]]), cache=cache, use_cache=True).logits[0, -1]
            got = emu.logits([t])
        # the stored cells are mapped: reading them with plain queries (no map) moves the logits
        emu.affines = [None] * len(emu.affines)
        off = emu.logits([t])
    assert float((off - want).abs().max()) > 1e-2
