"""The CUDA C++ stage 1 of the int2 decode attention (lowbit.kernels.decode_cuda) against the torch twin.

CPU: the .cu compiles with nvcc (one instance, when nvcc is here), the conditions under which the dispatch passes
it over, and that a named CUDA impl that cannot run is a one-line error, never a silent Triton run.
GPU (marked): odd shapes (length 1, 17, 999, ragged with an empty sequence, GQA 1 / 4 / 7, fp16 and bf16, scale-only
groups, sink / recent tiers or none) vs the twin and vs the Triton kernel, every (warps, min blocks) instance, the
launch record, and a CUDA graph replay.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _make import make_inputs, rel_l2

from lowbit.errors import LowbitError
from lowbit.kernels import decode_cuda as dc
from lowbit.kernels import weight_cuda as wc
from lowbit.kernels.decode_attention import KernelConfig, decode_attention, interpreted
from lowbit.kernels.reference import decode_attention_ref

TOL = 1e-3
gpu = pytest.mark.skipif(not torch.cuda.is_available() or interpreted(), reason="needs CUDA, TRITON_INTERPRET=0")


def test_cu_compiles_with_nvcc(tmp_path):
    """The .cu through nvcc for sm_90a (one (warps, min blocks) instance: every code path), with its entry points."""
    if wc.nvcc_missing():
        pytest.skip(f"no nvcc here: {wc.nvcc_missing()}")
    so = wc.build("sm_90a", cache_dir=tmp_path, defines=("LOWBIT_COMPILE_CHECK",), source=dc.SOURCE)
    assert so.is_file() and so.name.startswith("lowbit_decode_int2_sm_90a_") and not list(tmp_path.glob("*.tmp"))
    lib = dc._load(so)
    assert lib.lowbit_decode_int2_error_string(0) == b"no error"


def _kw(B=2, Hq=8, Hkv=2, T=40, **over):
    kw = make_inputs(B, Hq, Hkv, 128, T, kbits=2, vbits=2, sink=3, recent=5, dtype=torch.bfloat16, seed=T)
    kw.update(over)
    return kw


def _reason(kw, k_bits=2, v_bits=2, groups=(128, 128), dense=None):
    dense = tuple(t for t in (kw.get("sink_k"), kw.get("sink_v"), kw.get("recent_k"), kw.get("recent_v"))
                  if t is not None) if dense is None else dense
    return dc.why_not(kw["q"], kw["k_codes"], kw["k_scale"], kw["v_codes"], kw["v_scale"], k_bits, v_bits, *groups,
                      dense)


@pytest.mark.parametrize("change, match", [
    ({"k_bits": 4}, "int2 K and V, not k4v2"),
    ({"groups": (64, 128)}, "group 128"),
    ({"q": torch.zeros(2, 24, 128, dtype=torch.bfloat16)}, "at most 8 query heads"),
    ({"q": torch.zeros(2, 8, 128)}, "bf16/fp16 queries"),
    ({"dense": (torch.zeros(2, 2, 3, 128),)}, "dense tiers in torch.float32"),
    ({"dense": (torch.zeros(2, 2, 3, 128, dtype=torch.bfloat16), torch.zeros(2, 2, 3, 128, dtype=torch.float16))},
     "different dtypes"),
    ({}, "runs on CUDA tensors"),
])
def test_why_not_names_the_reason(change, match):
    kw = _kw()
    args = {"k_bits": 2, "v_bits": 2, "groups": (128, 128), "dense": None}
    for k, v in change.items():
        if k in args:
            args[k] = v
        else:
            kw[k] = v
    reason = _reason(kw, **args)
    assert reason is not None and match in reason


def test_unaligned_codes_are_passed_over():
    kw = _kw()
    buf = torch.zeros(kw["k_codes"].numel() + 4, dtype=torch.uint8)
    kw["k_codes"] = buf[4:].view(kw["k_codes"].shape)  # 4-byte aligned only
    assert "16-byte aligned" in _reason(kw)


@pytest.mark.skipif(not interpreted(), reason="kernels imported without TRITON_INTERPRET=1")
def test_named_cuda_impl_that_cannot_run_is_an_error_not_a_fallback():
    kw = _kw()
    with pytest.raises(LowbitError, match="impl 'cuda-w4-s3-mb3' cannot run this call: .*CUDA tensors.*impl='triton'"):
        decode_attention(**kw, config=KernelConfig(impl="cuda-w4-s3-mb3"))
    with pytest.raises(LowbitError, match="unknown decode kernel impl 'cuda-w3-s3-mb1'"):
        decode_attention(**kw, config=KernelConfig(impl="cuda-w3-s3-mb1"))


# (B, Hq, Hkv, T, sink, recent, mid_lens, dtype, scale_only)
GPU_CASES = [
    (1, 4, 1, 1, 0, 0, None, torch.bfloat16, False),  # one middle token, no dense tier
    (3, 32, 8, 999, 5, 17, [999, 0, 500], torch.bfloat16, False),  # ragged, an empty middle, GQA 4
    (2, 14, 2, 4000, 64, 256, [4000, 33], torch.float16, False),  # GQA 7, fp16 model
    (1, 8, 8, 17, 0, 3, None, torch.bfloat16, False),  # MHA, recent only
    (2, 32, 8, 3001, 64, 256, [3001, 1777], torch.bfloat16, True),  # scale-only groups
    (16, 32, 8, 32768, 64, 256, None, torch.bfloat16, False),  # the runtime's B16 L32k
    (1, 32, 8, 131072, 64, 256, None, torch.bfloat16, False),  # B1 L128k
]


def _scale_only(kw, seed):
    from lowbit.quant.affine import centre, quantize_centred
    from lowbit.quant.packing import pack

    for which in "kv":
        codes = kw[f"{which}_codes"]
        B, Hkv, T, _ = codes.shape
        x = torch.randn(B, Hkv, T, 128, generator=torch.Generator().manual_seed(seed + ord(which)))
        qz = quantize_centred(x, 2, 128, grid="std", scale_dtype=torch.float16)
        dev = codes.device
        kw.update({f"{which}_codes": pack(qz.codes, 2, "strided").to(dev), f"{which}_scale": qz.scale.to(dev),
                   f"{which}_zero": None, f"{which}_centre": centre(2)})
    return kw


def _gpu_inputs(case):
    B, Hq, Hkv, T, sink, rec, lens, dt, so = case
    kw = make_inputs(B, Hq, Hkv, 128, T, kbits=2, vbits=2, sink=sink, recent=rec, mid_lens=lens, dtype=dt,
                     device="cuda", seed=T + Hq)
    return _scale_only(kw, T) if so else kw


def _run(kw, impl):
    q = kw["q"]
    out = torch.full(q.shape, float("nan"), dtype=torch.float32, device=q.device)
    _, launch = decode_attention(**kw, config=KernelConfig(impl=impl), out=out, return_launch=True)
    return out, launch


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: f"B{c[0]}-Hq{c[1]}-Hkv{c[2]}-T{c[3]}-s{c[4]}r{c[5]}"
                         f"-{str(c[7])[6:]}{'-so' if c[8] else ''}")
def test_matches_twin_and_triton_gpu(case):
    kw = _gpu_inputs(case)
    out, launch = _run(kw, "cuda-w4-s3-mb3")
    assert launch.mode == "cuda" and launch.grid[2] == case[0]
    assert torch.isfinite(out).all(), "kernel wrote NaN/Inf or left outputs unwritten"
    ref = decode_attention_ref(**kw)
    assert rel_l2(out, ref) <= TOL
    tri, _ = _run(kw, "triton")
    assert rel_l2(out, tri) <= TOL


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("shape", dc.SHAPES, ids=lambda s: f"w{s[0]}-s{s[1]}-mb{s[2]}")
def test_every_instance_matches_twin_gpu(shape):
    kw = _gpu_inputs((5, 32, 8, 2999, 64, 256, [2999, 1, 0, 1500, 64], torch.bfloat16, False))
    out, launch = _run(kw, f"cuda-w{shape[0]}-s{shape[1]}-mb{shape[2]}")
    assert launch.blocks_per_sm >= 1
    assert torch.isfinite(out).all() and rel_l2(out, decode_attention_ref(**kw)) <= TOL


@pytest.mark.gpu
@gpu
def test_cuda_graph_replay_gpu():
    kw = _gpu_inputs((4, 32, 8, 1500, 64, 256, [1500, 7, 1000, 64], torch.bfloat16, False))
    cfg = KernelConfig(impl="cuda-w4-s3-mb3")
    eager = decode_attention(**kw, config=cfg)
    out = torch.empty_like(eager)
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        decode_attention(**kw, config=cfg, out=out)  # warm (builds, occupancy query) outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        decode_attention(**kw, config=cfg, out=out)
    out.zero_()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
