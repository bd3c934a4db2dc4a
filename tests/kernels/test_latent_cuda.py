"""The CUDA int2 MLA latent middle (lowbit.kernels.attention.latent_cuda) against its twin and the Triton path.

CPU: the refusals (a one-line reason, no silent fallback) and, where nvcc is installed, the .cu through nvcc with
its host entry point. GPU (marked): odd token counts (1, 3, 17, 63, 64, 65, 99, 999), tile and split edges,
ragged and empty sequences, 16 / 32 / 128 query heads, two KV heads, dense tiers beside the CUDA middle, a pe view
with a wide row stride, and a CUDA-graph replay.
"""

from __future__ import annotations

import ctypes
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _make import rel_l2
from test_decode_geometry import latent_inputs

from lowbit.core.errors import LowbitError
from lowbit.kernels import nvcc
from lowbit.kernels.attention import latent_cuda
from lowbit.kernels.attention.common import interpreted
from lowbit.kernels.attention.geometry import GeoConfig, decode_attention_latent
from lowbit.kernels.attention.reference import decode_attention_latent_ref

TOL = 1e-3
on_gpu = pytest.mark.skipif(not torch.cuda.is_available() or interpreted(), reason="needs CUDA, TRITON_INTERPRET=0")


def _kw(B, Hq, T, lens, *, Hkv=1, sink=0, recent=0, device="cpu", seed=0, bits=2, DR=64):
    kw = latent_inputs(B, Hq, Hkv, 512, DR, T, bits=bits, group=128, sink=sink, recent=recent, mid_lens=lens,
                       sink_lens=[min(sink, i % (sink + 1)) for i in range(B)] if sink else None,
                       recent_lens=[(i * 7) % (recent + 1) for i in range(B)] if recent else None,
                       device=device, seed=seed)
    return kw


def test_impl_cuda_is_refused_on_cpu_with_one_line():
    kw = _kw(1, 16, 17, [17])
    with pytest.raises(LowbitError) as e:
        decode_attention_latent(**kw, config=GeoConfig(impl="cuda"))
    msg = str(e.value)
    assert "\n" not in msg and "impl='cuda'" in msg and "CUDA device" in msg and "impl='triton'" in msg


def test_unknown_impl_is_refused():
    kw = _kw(1, 16, 17, [17])
    with pytest.raises(LowbitError, match="GeoConfig.impl must be 'triton' or 'cuda'"):
        decode_attention_latent(**kw, config=GeoConfig(impl="cutlass"))


def test_why_not_names_the_shape_it_does_not_take(monkeypatch):
    # past the device check (faked), each refusal names what the kernel takes
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(nvcc, "nvcc_missing", lambda: None)

    class Dev:
        type = "cuda"

    def why(kw, bits=2):
        q = kw["q_lat"]
        q_dev = type("Q", (), {"device": Dev(), "shape": q.shape, "dtype": q.dtype})()
        return latent_cuda.why_not(q_dev, kw["q_pe"], kw["codes"], kw["scale"], kw["zero"], kw["pe"], bits)

    assert "multiples of 16" in why(_kw(1, 3, 17, [17]))
    assert "2 bits" in why(_kw(1, 16, 17, [17], bits=4), bits=4)
    assert "64-dim dense key part" in why(_kw(1, 16, 17, [17], DR=128))
    kw = _kw(1, 16, 17, [17])
    kw["q_lat"] = kw["q_lat"].half()
    assert "bf16 q" in why(kw)


def test_cu_compiles_with_nvcc(tmp_path):
    if nvcc.nvcc_missing():
        pytest.skip(f"no nvcc here: {nvcc.nvcc_missing()}")
    so = nvcc.build(latent_cuda.SOURCE, "sm_90a", cache_dir=tmp_path)
    assert so.name.startswith("lowbit_latent_int2_sm_90a_") and not list(tmp_path.glob("*.tmp"))
    lib = latent_cuda._load(so)
    # ring of 3 stages (codes 8 KB + pe 8 KB + scale / zero 1 KB) + q fragments 18 KB + p fragments 8 KB + sums
    small = 36 * 32 * 16 + 4 * 4 * 32 * 16 + 4 * 16 * 4 * 3 + 4 * 4 * 16 * 4  # q, p fragments and the sums (4 warps)
    assert lib.lowbit_latent_int2_smem(4, 3) == 3 * 17408 + small
    assert lib.lowbit_latent_int2_smem(4, 2) == 2 * 17408 + small
    assert lib.lowbit_latent_int2_smem(8, 2) == 2 * 34816 + 36 * 32 * 16 + 4 * 8 * 32 * 16 + 256 + 2 * 512 + 8 * 4 * 16 * 4
    assert lib.lowbit_latent_int2_smem(8, 3) == -1
    assert b"(warps, stages) must be" in lib.lowbit_latent_cuda_error_string(-1)
    assert isinstance(lib, ctypes.CDLL)


# ---------------------------------------------------------------------------------------------- GPU
def _check(kw, cfg=None, tol=TOL):
    q = kw["q_lat"]
    out = torch.full(q.shape, float("nan"), dtype=torch.float32, device=q.device)
    _, launch = decode_attention_latent(**kw, config=cfg or GeoConfig(impl="cuda"), out=out, return_launch=True)
    ref = decode_attention_latent_ref(**kw)
    assert torch.isfinite(out).all(), "NaN/Inf or an unwritten output"
    err = rel_l2(out, ref)
    assert err <= tol, f"rel L2 {err:.2e} > {tol} ({launch})"
    return out, launch


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("warps, stages", [(4, 3), (4, 2), (8, 2)])
@pytest.mark.parametrize("Hq, Hkv, lens, splits", [
    (16, 1, [1, 3, 17, 99], None),
    (16, 1, [63, 64, 65, 999], 3),
    (32, 1, [999, 0, 130, 257], 2),
    (32, 2, [5, 128, 129, 700], None),
    (128, 1, [999, 1, 64, 300], 4),
])
def test_odd_sizes_against_twin(Hq, Hkv, lens, splits, warps, stages):
    kw = _kw(len(lens), Hq, max(lens) + 5, lens, Hkv=Hkv, device="cuda", seed=Hq + len(lens))
    _, launch = _check(kw, GeoConfig(impl="cuda", num_splits=splits, num_warps=warps, num_stages=stages))
    assert launch.config.impl == "cuda" and launch.split_tokens % latent_cuda.tile_tokens(warps) == 0


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("warps, stages", [(4, 3), (4, 2), (8, 2)])
def test_dense_tiers_beside_the_cuda_middle_match_triton(warps, stages):
    kw = _kw(4, 16, 300, [1, 17, 299, 0], sink=4, recent=9, device="cuda", seed=3)
    out_c, _ = _check(kw, GeoConfig(impl="cuda", num_warps=warps, num_stages=stages))
    out_t, _ = _check(kw, GeoConfig(impl="triton"))
    assert rel_l2(out_c, out_t) <= TOL


@pytest.mark.gpu
@on_gpu
def test_pe_view_with_a_wide_row_stride():
    kw = _kw(2, 16, 200, [200, 77], device="cuda", seed=5)
    wide = torch.zeros(2, 1, 200, 64 + 512, dtype=torch.bfloat16, device="cuda")
    wide[..., 512:] = kw["pe"]
    kw["pe"] = wide[..., 512:]  # row stride 576 elements (the [c_kv | k_pe] cache row of DeepSeek)
    _check(kw)


@pytest.mark.gpu
@on_gpu
def test_graph_replay_reads_new_inputs():
    kw = _kw(3, 16, 500, [500, 250, 3], device="cuda", seed=7)
    out = torch.empty(3, 16, 512, dtype=torch.float32, device="cuda")
    cfg = GeoConfig(impl="cuda")
    decode_attention_latent(**kw, config=cfg, out=out)  # builds and loads the library before capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        decode_attention_latent(**kw, config=cfg, out=out)
    kw2 = _kw(3, 16, 500, [500, 250, 3], device="cuda", seed=8)
    for k in ("q_lat", "q_pe", "codes", "scale", "zero", "pe"):
        kw[k].copy_(kw2[k])
    g.replay()
    torch.cuda.synchronize()
    assert rel_l2(out, decode_attention_latent_ref(**kw2)) <= TOL


def test_default_impl_picks_triton_off_the_cuda_kernel_shapes():
    from lowbit.kernels.attention.geometry import default_impl

    kw = _kw(1, 16, 17, [17])
    mid = (kw["codes"], kw["scale"], kw["zero"])
    # CPU, a dense (bf16) middle, separate K/V, no middle: the Triton kernel
    assert default_impl(kw["q_lat"], kw["q_pe"], mid, kw["pe"], 2, True, False) == "triton"
    assert default_impl(kw["q_lat"], kw["q_pe"], mid, kw["pe"], 2, True, True) == "triton"
    assert default_impl(kw["q_lat"], kw["q_pe"], mid, kw["pe"], 2, False, False) == "triton"
    assert default_impl(kw["q_lat"], kw["q_pe"], None, None, 2, True, False) == "triton"


def test_cuda_config_resolves_its_own_warps_and_waves():
    # 8 warps and one wave of 2 blocks a SM, but 4 warps with many 128-head blocks; a caller's fields win
    r = GeoConfig(impl="cuda").resolve(16, 512, 576, True, pairs=16)
    assert (r.impl, r.num_warps, r.waves, r.num_stages) == ("cuda", 8, 2, 2)
    assert GeoConfig(impl="cuda", num_warps=4).resolve(16, 512, 576, True, pairs=16).num_stages == 3
    r = GeoConfig(impl="cuda").resolve(128, 512, 576, True, pairs=16)
    assert (r.num_warps, r.num_stages, r.waves) == (4, 2, 3)
    assert GeoConfig(impl="cuda").resolve(128, 512, 576, True, pairs=1).num_warps == 8
    assert GeoConfig(impl="cuda", num_warps=4, waves=3).resolve(16, 512, 576, True, pairs=16).waves == 3
    assert GeoConfig().resolve(16, 512, 576, True, pairs=16).impl == "triton"


def test_whole_waves_split_pick_never_spills_one_block_into_a_second_round():
    from lowbit.kernels.attention.geometry import pick_splits

    # tp8 B16 at 3 blocks a SM: ceil would give 25 splits (400 blocks on 396 slots); whole waves give 24
    assert pick_splits(16, 16, 32768, 64, 132, 3, 16 * 512 * 8, 10**9) == 25
    assert pick_splits(16, 16, 32768, 64, 132, 3, 16 * 512 * 8, 10**9, whole=True) == 24
    assert pick_splits(16, 128, 32768, 64, 132, 2, 128 * 512 * 8, 10**10, whole=True) == 2


def test_instance_reason_names_the_instances():
    assert latent_cuda.instance_reason(8) is None and latent_cuda.instance_reason(4, 2) is None
    msg = latent_cuda.instance_reason(8, 3)
    assert "(4, 3), (4, 2), (8, 2)" in msg and "(8, 3)" in msg
