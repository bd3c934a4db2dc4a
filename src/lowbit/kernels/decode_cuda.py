"""CUDA C++ stage 1 of the fused decode attention for int2 K and V at head_dim 128 (kernels/cuda/decode_int2.cu).

    why_not(q, k_codes, ..., k_bits, v_bits, k_group, v_group)   None if the CUDA stage 1 takes this call, else why
    stage1(q, ..., part, lse, split_tokens, nsm, config)            launches it (the caller runs Triton's stage 2)
    occupancy(device, config, has_zero, dense_bf16)                 blocks resident per SM (for the split count)

It reads the same tensors as the Triton kernel (lowbit.kernels.decode_attention: packed "strided" int2 codes, one
fp16 scale and zero per token row, or scale-only with the centre code; dense sink / recent tiers in bf16 or fp16)
and writes the same split rows [B, Hq, nsplit, 128] / log2-sum-exp [B, Hq, nsplit], so the Triton stage 2 merges
them. The math is the Triton kernel's (its torch twin, lowbit.kernels.reference, is the reference of both); the
layout of the work is in the .cu's header. Built once per (source, nvcc, arch) by lowbit.kernels.weight_cuda.build
and called through ctypes with raw pointers on the current stream, so it is captured in CUDA graphs.
"""

from __future__ import annotations

import ctypes
import re
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from lowbit.errors import LowbitError
from lowbit.kernels import weight_cuda as wc

SOURCE = Path(__file__).with_name("cuda") / "decode_int2.cu"
SHAPES = ((2, 4, 1), (4, 2, 1), (4, 3, 1), (4, 4, 1), (4, 3, 3), (4, 4, 3), (4, 3, 4), (8, 2, 2))  # (warps, stages,
# min blocks per SM) instances in the library
_lock = threading.Lock()
_libs: dict[str, ctypes.CDLL] = {}


@dataclass(frozen=True)
class CudaDecodeConfig:
    """warps per block, stages (32-token blocks of a warp's shared-memory ring, stages - 1 in flight ahead of the
    math), and the blocks per SM its registers must allow (1: no cap; a cap can spill)."""

    warps: int = 4
    stages: int = 3
    min_blocks: int = 3

    @property
    def name(self) -> str:
        return f"cuda-w{self.warps}-s{self.stages}-mb{self.min_blocks}"

    @classmethod
    def from_name(cls, name: str) -> CudaDecodeConfig | None:
        """The config of a name like "cuda-w4-s3-mb3", None if the name is not of that form or not an instance."""
        m = re.fullmatch(r"cuda-w(\d+)-s(\d+)-mb(\d+)", name)
        if m is None or (int(m[1]), int(m[2]), int(m[3])) not in SHAPES:
            return None
        return cls(int(m[1]), int(m[2]), int(m[3]))


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    P, L, I, F = ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int, ctypes.c_float
    lib.lowbit_decode_int2.argtypes = [
        P, L, L, I,  # q, sqb, sqh, q_bf16
        P, L, L, P, P, L, L,  # kc, skb, skh, ks, kz, sksb, sksh
        P, L, L, P, P, L, L,  # vc, svb, svh, vs, vz, svsb, svsh
        P,  # mid_len
        P, P, L, L, L, L, L, L, P,  # sink k/v + strides + len
        P, P, L, L, L, L, L, L, P,  # recent
        I, P, P,  # dense_bf16, op, lse
        F, F, F, I, I, I, I, I, I, I, I, I,  # qk_scale, kctr, vctr, split_tokens, nsm, nsplit, G, hkv, B, nw, ns, minb
        ctypes.c_ulonglong]
    lib.lowbit_decode_int2.restype = I
    lib.lowbit_decode_int2_occupancy.argtypes = [I, I, I, I, I]
    lib.lowbit_decode_int2_occupancy.restype = I
    lib.lowbit_decode_int2_error_string.argtypes = [I]
    lib.lowbit_decode_int2_error_string.restype = ctypes.c_char_p
    return lib


def library(device) -> ctypes.CDLL:
    """The loaded library for this CUDA device's architecture (built with nvcc on first use)."""
    dev = torch.device(device)
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    arch = wc.arch_for(torch.cuda.get_device_capability(idx))
    with _lock:
        if arch not in _libs:
            _libs[arch] = _load(wc.build(arch, source=SOURCE))
        return _libs[arch]


def why_not(q: torch.Tensor, k_codes, k_scale, v_codes, v_scale, k_bits: int, v_bits: int, k_group: int, v_group: int,
            dense: tuple[torch.Tensor, ...] = ()) -> str | None:
    """None when the CUDA stage 1 runs this call (the middle tier's tensors as decode_attention checked them),
    else the reason the dispatch passes it over."""
    if k_codes is None:
        return "no packed middle tier (the Triton kernel takes dense-only calls)"
    if (k_bits, v_bits) != (2, 2):
        return f"the CUDA decode kernel is int2 K and V, not k{k_bits}v{v_bits}"
    if q.shape[-1] != 128 or v_codes.shape[-1] * 4 != 128:
        return f"the CUDA decode kernel is head_dim 128, not {q.shape[-1]}"
    if (k_group, v_group) != (128, 128):
        return f"the CUDA decode kernel takes one scale per token row (group 128), not {k_group}/{v_group}"
    G = q.shape[1] // k_codes.shape[1]
    if G > 8:
        return f"the CUDA decode kernel takes at most 8 query heads per KV head, not {G}"
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"the CUDA decode kernel takes bf16/fp16 queries, not {q.dtype}"
    for t in (k_codes, v_codes):
        if t.data_ptr() % 16 or any(s % 16 for s in t.stride()[:2]):
            return "packed codes not 16-byte aligned per (sequence, head)"
        if (t.shape[0] - 1) * t.stride(0) + (t.shape[1] - 1) * t.stride(1) + t.shape[2] * 32 >= 2**31:
            return "packed tier over 2 GiB (the kernel's offsets are 32-bit)"
    for t in (k_scale, v_scale):
        if t.data_ptr() % 16 or any(s % 8 for s in t.stride()[:2]):
            return "scales not 16-byte aligned per (sequence, head)"
        if (t.shape[0] - 1) * t.stride(0) + (t.shape[1] - 1) * t.stride(1) + t.shape[2] >= 2**31:
            return "scale tier over 2**31 elements (the kernel's offsets are 32-bit)"
    for t in dense:
        if t.dtype not in (torch.bfloat16, torch.float16):
            return f"dense tiers in {t.dtype} (the CUDA kernel reads bf16/fp16)"
        if t.data_ptr() % 16 or any(s % 8 for s in t.stride()[:3]):
            return "dense tier rows not 16-byte aligned"
    if len({t.dtype for t in dense}) > 1:
        return "sink and recent tiers in different dtypes"
    if q.device.type != "cuda":
        return "the CUDA decode kernel runs on CUDA tensors"
    if torch.cuda.get_device_capability(q.device) < (8, 0):
        return "the CUDA decode kernel needs sm_80+ (mma.sync bf16/fp16, movmatrix)"
    if wc.nvcc_missing():
        return wc.nvcc_missing()
    return None


def occupancy(device, config: CudaDecodeConfig, has_zero: bool, dense_bf16: bool) -> int:
    """Blocks of this stage-1 instance resident per SM on `device`."""
    n = library(device).lowbit_decode_int2_occupancy(config.warps, config.stages, config.min_blocks, int(has_zero),
                                                     int(dense_bf16))
    if n <= 0:
        raise LowbitError(f"no CUDA decode instance {config.name} (have {SHAPES})" if n == -1 else
                          f"occupancy query for {config.name} failed: "
                          f"{library(device).lowbit_decode_int2_error_string(-n).decode()}")
    return n


def stage1(q, kw, k_scale, k_zero, vw, v_scale, v_zero, mid_lens, sink, recent, part, lse, *, sm_scale_log2e: float,
           k_centre: float, v_centre: float, split_tokens: int, nsm: int, config: CudaDecodeConfig) -> None:
    """Launch stage 1: grid (nsm + dense?, Hkv, B). q [B, Hq, 128]; kw/vw uint8 codes [B, Hkv, T, 32]; scales fp16
    [B, Hkv, T, 1]; k_zero/v_zero or None (scale-only: zero = -centre * scale); sink / recent: (k, v, lens) or None;
    part [B, Hq, nsplit, 128] fp32, lse [B, Hq, nsplit] fp32 with nsplit = nsm + dense."""
    B, Hq, _ = q.shape
    Hkv = kw.shape[1]
    nsplit = part.shape[2]
    dense = [t for t in (sink, recent) if t is not None]
    lib = library(q.device)

    def tier(t):
        if t is None:
            return (None, None, 0, 0, 0, 0, 0, 0, None)
        k, v, n = t
        return (k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1),
                v.stride(2), n.data_ptr())

    dense_bf16 = int(bool(dense) and dense[0][0].dtype == torch.bfloat16)
    stream = torch.cuda.current_stream(q.device).cuda_stream
    rc = lib.lowbit_decode_int2(
        q.data_ptr(), q.stride(0), q.stride(1), int(q.dtype == torch.bfloat16),
        kw.data_ptr(), kw.stride(0), kw.stride(1), k_scale.data_ptr(), None if k_zero is None else k_zero.data_ptr(),
        k_scale.stride(0), k_scale.stride(1),
        vw.data_ptr(), vw.stride(0), vw.stride(1), v_scale.data_ptr(), None if v_zero is None else v_zero.data_ptr(),
        v_scale.stride(0), v_scale.stride(1),
        mid_lens.data_ptr(), *tier(sink), *tier(recent), dense_bf16, part.data_ptr(), lse.data_ptr(),
        float(sm_scale_log2e), float(k_centre), float(v_centre), int(split_tokens), int(nsm), int(nsplit), Hq // Hkv,
        Hkv, B, config.warps, config.stages, config.min_blocks, stream)
    if rc != 0:
        msg = f"no instance {config.name} (have {SHAPES})" if rc == -1 else lib.lowbit_decode_int2_error_string(rc).decode()
        raise LowbitError(f"CUDA decode kernel {config.name} failed to launch at B={B} Hq={Hq}: {msg}")
