"""The geometry decode kernel at odd sizes, under every launch config its resolver or the benchmark sweep picks.

CPU: the Triton interpreter (tests/conftest.py), one batch of four sequences holding 1, 3, 17 and 99 middle
tokens (plus an empty dense tier or two), heads 1 / 3 / 16, K192/V128, head_dim 512 GQA, the MLA latent
(512 + 64) and Gemma-4's K = V (512 + 128). Under the interpreter a config differs only in its tile
(block_t), heads per program and where q lives (q_loop); warps / stages / waves are the GPU's, so the
sweep's configs are deduplicated on those three fields. GPU (marked): the same odd cases compiled, the default and
every bench candidate config.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _make import make_inputs, rel_l2
from test_decode_geometry import latent_inputs

from lowbit.kernels.attention.common import interpreted
from lowbit.kernels.attention.geometry import GeoConfig, decode_attention_geo, decode_attention_latent
from lowbit.kernels.attention.reference import decode_attention_latent_ref, decode_attention_ref
from lowbit.tools.bench import geometry as geo_bench

TOL = 1e-3
cpu_only = pytest.mark.skipif(not interpreted(), reason="kernels imported without TRITON_INTERPRET=1")
on_gpu = pytest.mark.skipif(not torch.cuda.is_available() or interpreted(), reason="needs CUDA, TRITON_INTERPRET=0")
LENS = [1, 3, 17, 99]  # middle tokens of the four sequences (T = 99 slots)

# name: (kind, Hq, Hkv, Dk, Dv, DR, group, bench geometry whose sweep configs apply)
SHAPES = {
    "k192v128-mha": ("mha", 2, 2, 192, 128, 0, 64, "kimi-k192v128"),  # G = 1 (Kimi's expanded MHA)
    "k192v128-gqa3": ("mha", 3, 1, 192, 128, 0, 64, "kimi-k192v128"),
    "d512-gqa3": ("mha", 3, 1, 512, 512, 0, 128, "gemma4-full512"),
    "latent-h1": ("latent", 1, 1, 512, 512, 64, 128, "deepseek-v3-latent-tp8"),
    "latent-h3": ("latent", 3, 1, 512, 512, 64, 128, "deepseek-v3-latent"),
    "latent-h16": ("latent", 16, 1, 512, 512, 64, 128, "deepseek-v3-latent"),
    "gemma-kv-h3": ("latent", 3, 1, 512, 512, 128, 128, "gemma4-full512"),
}


def _inputs(name, bits=2, device="cpu", seed=0, dense_mid=False):
    kind, Hq, Hkv, Dk, Dv, DR, grp, _ = SHAPES[name]
    if kind == "latent":
        return "latent", latent_inputs(4, Hq, Hkv, Dv, DR, 99, bits=bits, group=grp, sink=2, recent=3, mid_lens=LENS,
                                       sink_lens=[2, 0, 1, 2], recent_lens=[0, 3, 1, 2], device=device, seed=seed,
                                       dense_mid=dense_mid)
    return "mha", make_inputs(4, Hq, Hkv, Dk, 99, kbits=bits, vbits=bits, group=grp, Dv=Dv, sink=2, recent=3,
                              mid_lens=LENS, sink_lens=[2, 0, 1, 2], recent_lens=[0, 3, 1, 2], dtype=torch.bfloat16,
                              device=device, seed=seed)


def _check(name, cfg, bits=2, device="cpu", dense_mid=False):
    kind, kw = _inputs(name, bits, device, seed=bits + len(name), dense_mid=dense_mid)
    Dv = SHAPES[name][4]
    q = kw["q_lat"] if kind == "latent" else kw["q"]
    out = torch.full((q.shape[0], q.shape[1], Dv), float("nan"), dtype=torch.float32, device=device)
    if kind == "latent":
        _, launch = decode_attention_latent(**kw, config=cfg, out=out, return_launch=True)
        ref = decode_attention_latent_ref(**kw)
    else:
        _, launch = decode_attention_geo(**kw, config=cfg, out=out, return_launch=True)
        ref = decode_attention_ref(**kw)
    assert torch.isfinite(out).all(), "kernel wrote NaN/Inf or left outputs unwritten"
    err = rel_l2(out, ref)
    assert err <= TOL, f"{name} {cfg}: rel L2 {err:.2e} > {TOL}"
    return launch


def _interp_configs(geometry):
    """The sweep's configs that differ under the interpreter (block_t, heads, q_loop once resolved for
    the bench geometry), with small splits."""
    geo = geo_bench.GEOMETRIES[geometry]
    seen, out = set(), []
    for c in [GeoConfig(), *geo_bench.candidates(geo), *geo_bench.sweep_candidates(geo)]:
        r = c.resolve(geo["Hq"] // geo["Hkv"], geo["Dv"], geo["Dk"] + geo["DR"], geo["kind"] == "latent")
        key = (r.block_t, r.heads, r.q_loop)
        if key not in seen:
            seen.add(key)
            out.append(GeoConfig(block_t=c.block_t, heads=c.heads, q_loop=c.q_loop, num_splits=2, dense_block=16))
    return out


@cpu_only
@pytest.mark.parametrize("name", list(SHAPES))
def test_resolved_config_at_odd_sizes(name):
    """The resolver's own choice (block_t, heads, q_loop from the shape), split count picked by the wrapper."""
    launch = _check(name, GeoConfig())
    assert launch.num_splits >= 1 and launch.split_tokens % launch.config.block_t == 0


@cpu_only
@pytest.mark.parametrize("name, cfg", [(n, c) for n in ("k192v128-mha", "latent-h3", "gemma-kv-h3")
                                       for c in _interp_configs(SHAPES[n][7])],
                         ids=lambda x: x if isinstance(x, str) else f"bt{x.block_t}-h{x.heads}-q{x.q_loop}")
def test_sweep_configs_at_odd_sizes(name, cfg):
    _check(name, cfg)


@cpu_only
@pytest.mark.parametrize("name, bits", [("k192v128-gqa3", 4), ("latent-h3", 4), ("d512-gqa3", 4)])
def test_four_bit_segments_at_odd_sizes(name, bits):
    # 4-bit rows: K192 -> 6 segments of 32 dims, V128 -> 2 of 64, the latent -> 2 positions x 2 byte ranges
    _check(name, GeoConfig(block_t=32, num_splits=3, dense_block=16), bits=bits)


@cpu_only
def test_dense_middle_baseline_at_odd_sizes():
    _check("latent-h3", GeoConfig(block_t=32, num_splits=2, dense_block=16), dense_mid=True)


@cpu_only
def test_split_pick_fills_the_gpu_and_caps_partials():
    from lowbit.kernels.attention.geometry import pick_splits

    # Kimi B16: 1024 programs already fill 132 SMs x 4: one split; B1: 64 programs -> 9 splits
    assert pick_splits(16, 1024, 32768, 64, 132, 4, 64 * 128 * 8, 10**9) == 1
    assert pick_splits(1, 64, 32768, 64, 132, 4, 64 * 128 * 8, 10**9) == 9
    # the latent at B1 with 128 heads: partial outputs (0.5 MB a split) cap the count near one wave
    assert pick_splits(1, 8, 32768, 64, 132, 4, 128 * 512 * 8, 8912896) == 17
    assert pick_splits(1, 1, 40, 64, 132, 4, 8, 10**9) == 1  # fewer tokens than two tiles: one split


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("name", list(SHAPES))
def test_odd_sizes_bench_configs_gpu(name):
    # the resolved default and the bench's candidates compiled (the sweep's wider grid: its own run checks
    # nothing, so the CPU tests above cover its distinct tiles)
    geo = geo_bench.GEOMETRIES[SHAPES[name][7]]
    for cfg in [GeoConfig(), *geo_bench.candidates(geo)]:
        if cfg.impl == "cuda" and SHAPES[name][1] % 16:
            continue  # the CUDA middle takes 16-head blocks only (its own tests: test_latent_cuda.py)
        try:
            _check(name, cfg, device="cuda")
        except Exception as e:  # a config past the shared memory of the device is the sweep's to report
            if "OutOfResources" not in type(e).__name__:
                raise
