"""CUDA stage 1 of the MLA latent decode kernel over an int2 middle (kernels/attention/cuda/latent_int2.cu), via ctypes.

    why_not(q_lat, q_pe, codes, scale, zero, pe, bits)   None if this kernel takes the call, else the reason
    stage1(q_lat, q_pe, codes, scale, zero, pe, mid_lens, part, lse, qk_scale, split_tokens, nsm)

It writes the middle's splits [0, nsm) of decode_geometry's partial buffers (part fp32 [B, Hq, nsplit, 512], lse
fp32 [B, Hq, nsplit]); the dense tiers' split and the merge stay with the Triton kernels, so a call through
decode_attention_latent(config=GeoConfig(impl="cuda")) returns what the Triton path returns (same twin:
lowbit.kernels.attention.reference.decode_attention_latent_ref). One block: 16 query heads of one KV head x one split, 4 warps,
16 * warps tokens a tile (`tile_tokens`); instances (warps, ring stages): (4, 3) ~79 KB of shared memory, 2 blocks a
SM; (8, 2) ~106 KB, 2 blocks a SM, registers capped at 128 a thread; (4, 2) ~63 KB, 3 blocks a SM, 168 registers, the
values accumulated straight into O (the others fold a fresh product per tile).

Takes: DeepSeek-V3's latent geometry (c_kv 512 at 2 bits in groups of 128 in the `strided` layout, k_pe 64),
bf16 q_lat / q_pe / pe, fp16 scale / zero, query heads per KV head a multiple of 16, 16-byte aligned rows.
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import torch

from lowbit.core.errors import LowbitError
from lowbit.kernels import nvcc

SOURCE = Path(__file__).with_name("cuda") / "latent_int2.cu"
HEADS = 16  # query heads per block (the MMA's M)
INSTANCES = ((4, 3), (4, 2), (8, 2))  # the library's (warps, stages): 2, 3 and 2 blocks a SM


def default_stages(warps: int) -> int:
    """The ring depth of the `warps` instance when the caller names none (3 for 4 warps, 2 for 8)."""
    return 3 if warps == 4 else 2
BLOCKS_PER_SM = 2  # resident blocks per SM (__launch_bounds__ and ~80 KB of shared memory each)
_lock = threading.Lock()
_libs: dict[str, ctypes.CDLL] = {}


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    P, I, L = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
    lib.lowbit_latent_int2_stage1.argtypes = [P, L, L, P, L, L, P, L, L, P, P, L, L, P, L, L, L, P, P, P,
                                              ctypes.c_float, I, I, I, I, I, I, I, I, ctypes.c_ulonglong]
    lib.lowbit_latent_int2_stage1.restype = I
    lib.lowbit_latent_int2_smem.argtypes = [I, I]
    lib.lowbit_latent_int2_smem.restype = I
    lib.lowbit_latent_cuda_error_string.argtypes = [I]
    lib.lowbit_latent_cuda_error_string.restype = ctypes.c_char_p
    return lib


def library(device) -> ctypes.CDLL:
    """The loaded library for this CUDA device's architecture (built on first use, ~3 s)."""
    idx = torch.device(device).index
    idx = torch.cuda.current_device() if idx is None else idx
    arch = nvcc.arch_for(torch.cuda.get_device_capability(idx))
    lib = _libs.get(arch)
    if lib is None:
        with _lock:
            if arch not in _libs:
                _libs[arch] = _load(nvcc.build(SOURCE, arch))
            lib = _libs[arch]
    return lib


def _aligned(t: torch.Tensor, *dims: int) -> bool:
    """16-byte aligned base and strides (in bytes) along `dims` (size-1 dims are free)."""
    es = t.element_size()
    return t.data_ptr() % 16 == 0 and all(t.shape[d] == 1 or (t.stride(d) * es) % 16 == 0 for d in dims)


def tile_tokens(warps: int) -> int:
    """Middle tokens per tile of the `warps` instance (16 a warp): split_tokens must be a multiple."""
    return 16 * warps


def instance_reason(warps: int, stages: int | None = None) -> str | None:
    """None when the library has the (warps, stages) instance (stages None: `default_stages`), else why not."""
    stages = default_stages(warps) if stages is None else stages
    if (warps, stages) not in INSTANCES:
        return (f"the CUDA latent kernel has (warps, stages) instances {', '.join(map(str, INSTANCES))}, not "
                f"({warps}, {stages})")
    return None


def why_not(q_lat, q_pe, codes, scale, zero, pe, bits: int, warps: int = 4, stages: int | None = None) -> str | None:
    """None when this kernel runs the call (shapes already checked by decode_attention_latent), else why not."""
    if q_lat.device.type != "cuda":
        return f"the CUDA latent kernel needs a CUDA device (q_lat is on {q_lat.device})"
    cap = torch.cuda.get_device_capability(q_lat.device)
    if cap < (8, 0):
        return f"the CUDA latent kernel needs sm_80+ (mma.sync bf16), this device is sm_{cap[0]}{cap[1]}"
    if nvcc.nvcc_missing():
        return nvcc.nvcc_missing()
    if codes is None:
        return "no middle tier: the CUDA kernel runs the packed middle only"
    why = instance_reason(warps, stages)
    if why:
        return why
    _, Hq, D = q_lat.shape
    if bits != 2 or D != 512 or codes.shape[-1] != 128 or scale is None or scale.shape[-1] != 4:
        return (f"the CUDA latent kernel takes a 512-wide latent at 2 bits in groups of 128 (got {D} wide, {bits} "
                f"bits, {None if scale is None else scale.shape[-1]} groups)")
    if q_pe is None or q_pe.shape[-1] != 64 or pe is None:
        return "the CUDA latent kernel takes a 64-dim dense key part (k_pe)"
    if q_lat.dtype != torch.bfloat16 or q_pe.dtype != torch.bfloat16 or pe.dtype != torch.bfloat16:
        return f"the CUDA latent kernel takes bf16 q and pe (got {q_lat.dtype}, {pe.dtype})"
    if zero is None:
        return "the CUDA latent kernel takes groups with zero-points (scale-only groups: the Triton kernel)"
    if scale.dtype != torch.float16 or zero.dtype != torch.float16:
        return "the CUDA latent kernel takes fp16 scale / zero"
    Hkv = codes.shape[1]
    if (Hq // Hkv) % HEADS:
        return f"the CUDA latent kernel takes query heads per KV head in multiples of {HEADS} (got {Hq // Hkv})"
    if not (_aligned(q_lat, 0, 1) and _aligned(q_pe, 0, 1) and _aligned(codes, 0, 1, 2) and _aligned(pe, 0, 1, 2)):
        return "the CUDA latent kernel reads 16-byte aligned rows (q, codes and pe bases and strides)"
    if scale.data_ptr() % 8 or zero.data_ptr() % 8:
        return "the CUDA latent kernel reads 8-byte aligned scale / zero rows"
    if codes.stride(2) != 128 or codes.stride(3) != 1 or scale.stride(2) != 4 or zero.stride() != scale.stride():
        return "the CUDA latent kernel takes contiguous [T, 128] codes and [T, 4] scale / zero rows per head"
    return None


def stage1(q_lat, q_pe, codes, scale, zero, pe, mid_lens, part, lse, qk_scale: float, split_tokens: int, nsm: int,
           warps: int = 4, stages: int | None = None):
    """Launch the middle splits [0, nsm) on the current stream (why_not(...) must be None).

    q_lat [B, Hq, 512] / q_pe [B, Hq, 64] bf16; codes uint8 [B, Hkv, T, 128]; scale / zero fp16 [B, Hkv, T, 4];
    pe bf16 [B, Hkv, T, 64]; mid_lens int32 [B]; part fp32 [B, Hq, nsplit, 512]; lse fp32 [B, Hq, nsplit];
    qk_scale = sm_scale * log2(e); split_tokens a multiple of tile_tokens(warps)."""
    if split_tokens % tile_tokens(warps):
        raise LowbitError(f"split_tokens {split_tokens} is not a multiple of the CUDA kernel's "
                          f"{tile_tokens(warps)}-token tile")
    B, Hq, _ = q_lat.shape
    Hkv = codes.shape[1]
    nsplit = part.shape[2]
    lib = library(q_lat.device)
    rc = lib.lowbit_latent_int2_stage1(
        q_lat.data_ptr(), q_lat.stride(0), q_lat.stride(1), q_pe.data_ptr(), q_pe.stride(0), q_pe.stride(1),
        codes.data_ptr(), codes.stride(0), codes.stride(1), scale.data_ptr(), zero.data_ptr(),
        scale.stride(0), scale.stride(1), pe.data_ptr(), pe.stride(0), pe.stride(1), pe.stride(2),
        mid_lens.data_ptr(), part.data_ptr(), lse.data_ptr(), float(qk_scale), int(split_tokens), int(nsm),
        int(nsplit), B, Hkv, Hq // Hkv, int(warps), default_stages(warps) if stages is None else int(stages),
        torch.cuda.current_stream(q_lat.device).cuda_stream)
    if rc:
        raise LowbitError(f"the CUDA latent kernel failed to launch: {lib.lowbit_latent_cuda_error_string(rc).decode()}")
