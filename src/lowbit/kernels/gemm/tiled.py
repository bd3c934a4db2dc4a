"""CUDA C++ 4-bit weight-only GEMM tiled over weight rows and activation rows (kernels/gemm/cuda/weight_tiled.cu), for the
M range between the decode GEMVs (weight_cuda, M <= 16) and dequantize + cuBLAS: batched decode and prefill chunks.

    y = linear(x, pw, TiledConfig(WN=4, WM=2, RT=2, MTW=4))     x [M, K] bf16 -> y [M, N]
    why_not(pw, x_dtype, M, config)                             None if the kernel takes this call, else the reason

A block of WN x WM warps owns BN = 16 * WN * RT weight rows x BM = 8 * WM * MTW activation rows and streams K in
stages of 128 through a cp.async ring of STAGES in shared memory (x permuted into mma-fragment order once per stage
by the threads that copied it); K is split across SPLITK blocks (0: as many as
fill one wave of resident blocks), reduced by the last block of a tile. It reads lowbit's PackedWeight as it is
(int32 words [N, K/8], scale [G, N] bf16/fp16, zero int8 [G, N]): no repack, the same tensors as every other path.
Built and cached by lowbit.kernels.nvcc (its own library beside weight_small_m's). On sm_90a the wgmma instances
(TiledConfig(..., fold=True, wg=k), k wgmma groups in flight) run the same product with a warpgroup per 64 weight
rows and x read by the tensor cores from shared memory (NOTES round 22: correct, not yet faster, so not in the
dispatch table).
"""

from __future__ import annotations

import ctypes
import math
import re
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from lowbit.core.errors import LowbitError
from lowbit.kernels import nvcc
from lowbit.kernels.gemm.cuda_gemm import _KIND, _counter_buffer, kernel_input

SOURCE = Path(__file__).with_name("cuda") / "weight_tiled.cu"
# (WN, WM, RT, MTW, STAGES): the instances in the library (by_tile in the .cu), exact and folded
TILES = {(8, 1, 1, 4, 3), (4, 2, 2, 4, 3), (4, 2, 1, 4, 3)}
TILES_FOLD = {(8, 1, 1, 4, 3), (4, 2, 2, 4, 3), (8, 1, 1, 8, 3), (4, 1, 2, 8, 3), (4, 2, 2, 8, 2)}
# the wgmma instances (sm_90a; always folded): WN = 4 warps a warpgroup, RT m64 tiles a warpgroup, MTW = BM / 8, and
# the wgmma groups left in flight behind each step (TiledConfig.wg)
TILES_WG = {(8, 1, 2, 16, 4, 1), (8, 1, 1, 16, 4, 1), (8, 1, 2, 8, 4, 1), (16, 1, 1, 8, 4, 1),
            (16, 1, 1, 8, 4, 3), (8, 1, 1, 16, 4, 3), (8, 1, 2, 8, 4, 3)}
KS = 128  # k per pipeline stage
SMEM_PER_SM = 227 * 1024  # usable shared memory per SM (H100/H200); the occupancy query is the device's answer
_lock = threading.Lock()
_libs: dict[str, ctypes.CDLL] = {}
_devices: dict[int, tuple[ctypes.CDLL, int]] = {}


@dataclass(frozen=True)
class TiledConfig:
    """A block of WN x WM warps, each RT 16-row weight tiles x MTW 8-row activation tiles; STAGES-deep ring; K split
    across SPLITK blocks (0: automatic). pdl: launched as a programmatic dependent (sm_90+)."""

    WN: int = 4
    WM: int = 2
    RT: int = 2
    MTW: int = 4
    STAGES: int = 3
    SPLITK: int = 0
    pdl: bool = True
    L2P: int = 256  # L2 prefetch size of the weight copies (0, 128, 256 bytes)
    # the A fragment rounded to bf16((q - z) * scale) and accumulated straight into the output (name suffix -bw):
    # the numerics of dequantize + cuBLAS (the weight rounded to bf16 once), so its audit bound is theirs
    fold: bool = False
    # Hopper wgmma (name suffix -wg, -wg<k>): each warpgroup multiplies 64 * RT weight rows by all BM activation rows
    # per instruction, x read by the tensor cores from shared memory, k (1 for -wg) wgmma groups left in flight
    # behind each step; 0: the mma.sync kernel. Needs fold and sm_90
    wg: int = 0

    @property
    def BN(self) -> int:
        return 16 * self.WN * self.RT

    @property
    def BM(self) -> int:
        return 8 * self.WM * self.MTW

    @property
    def warps(self) -> int:
        return self.WN * self.WM

    @property
    def name(self) -> str:
        return (f"cuda-tl-wn{self.WN}-wm{self.WM}-rt{self.RT}-mt{self.MTW}-s{self.STAGES}-sk{self.SPLITK}"
                + ("" if self.L2P == 256 else f"-l2p{self.L2P}") + ("-bw" if self.fold else "")
                + ("" if not self.wg else "-wg" if self.wg == 1 else f"-wg{self.wg}") + ("-pdl" if self.pdl else ""))

    @classmethod
    def from_name(cls, name: str) -> TiledConfig:
        m = re.fullmatch(r"cuda-tl-wn(\d+)-wm(\d+)-rt(\d+)-mt(\d+)-s(\d+)-sk(\d+)(?:-l2p(\d+))?(-bw)?(-wg(\d*))?(-pdl)?",
                         name)
        if m is None:
            raise ValueError(f"not a TiledConfig name: {name!r}")
        return cls(*(int(m[i]) for i in range(1, 7)), pdl=m[11] is not None, L2P=int(m[7] or 256),
                   fold=m[8] is not None, wg=0 if m[9] is None else int(m[10] or 1))


def rounds_weight_to_bf16(kernel: str) -> bool:
    """Whether a kernel (a dispatch cell's or an exploration candidate's name) multiplies the weight rounded to bf16,
    as dequantize + cuBLAS does: its error against the fp32 twin is that rounding's (~1e-3 rel L2), not summation
    order's, so the audit holds it to the dequantize bound."""
    return "dequant-cublas" in kernel or (kernel.split(":")[-1].startswith("cuda-tl-") and "-bw" in kernel)


def words_per_lane(group: int) -> int | None:
    """LW of the .cu: a chunk of 32 * LW k must lie in one group (4: group a multiple of 128; 2: group 64)."""
    return 4 if group % 128 == 0 else (2 if group == 64 else None)


def why_not(pw, x_dtype=torch.bfloat16, M: int | None = None, config: TiledConfig | None = None) -> str | None:
    """None when the tiled kernel runs this weight (and input dtype / M / config), else why not (the dispatch falls
    through to the next cell)."""
    cfg = config or TiledConfig()
    if cfg.L2P not in (0, 128, 256):
        return f"{cfg.name}: the L2 prefetch size is 0, 128 or 256 bytes"
    if cfg.wg and not cfg.fold:
        return f"{cfg.name}: the wgmma instances multiply the folded weight (bf16((q - z) * scale)): add -bw"
    tiles = TILES_WG if cfg.wg else TILES_FOLD if cfg.fold else TILES
    key = (cfg.WN, cfg.WM, cfg.RT, cfg.MTW, cfg.STAGES) + ((cfg.wg,) if cfg.wg else ())
    if key not in tiles:
        return (f"no tiled-kernel instance for {cfg.name} (instances (WN, WM, RT, MTW, STAGES"
                f"{', groups in flight) wgmma' if cfg.wg else ') folded' if cfg.fold else ')'}: {sorted(tiles)})")
    if pw.bits != 4 or pw.a_bits != 16:
        return f"the tiled CUDA kernel is 4-bit weight-only (A16), not {pw.kind}"
    if x_dtype != torch.bfloat16:
        return f"the tiled CUDA kernel takes bf16 activations, got {x_dtype}"
    if M is not None and M < 1:
        return f"M must be >= 1, got {M}"
    if pw.K % KS or pw.N % 16:
        return f"the tiled CUDA kernel needs K % {KS} == 0 and N % 16 == 0, got N={pw.N} K={pw.K}"
    if words_per_lane(pw.group) is None:
        return f"the tiled CUDA kernel takes groups of 64 or a multiple of 128, got {pw.group}"
    if pw.scale.dtype not in ((torch.bfloat16,) if cfg.fold else (torch.bfloat16, torch.float16)) or (
            pw.bias is not None and pw.bias.dtype not in _KIND):
        return (f"the tiled CUDA kernel takes {'bf16' if cfg.fold else 'bf16/fp16'} scales"
                f"{' when folded' if cfg.fold else ''}, got {pw.scale.dtype}")
    ts = [pw.qweight, pw.scale] + ([pw.zero] if pw.zero is not None else [])
    if not all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in ts):
        return "the packed weight (codes, scales, zero-points) is not contiguous / 16-byte aligned"
    return None


def smem_bytes(cfg: TiledConfig, lw: int, zp: bool) -> int:
    """Dynamic shared memory of one block (the .cu's lowbit_wq_tiled_smem): the ring, and (mma.sync instances) two
    permuted x buffers; a wgmma stage holds the scales and zero-points of two 64-k chunks."""
    if cfg.wg:
        return cfg.STAGES * (cfg.BN * 64 + cfg.BM * 256 + 4 * cfg.BN + (2 * cfg.BN if zp else 0))
    cps = KS // (32 * lw)
    return cfg.STAGES * (cfg.BN * 64 + cfg.BM * 256 + cps * cfg.BN * 2 + (cps * cfg.BN if zp else 0)) + 2 * cfg.BM * 256


@dataclass(frozen=True)
class Plan:
    lw: int
    stages_per_split: int
    splitk: int
    tiles: int  # row blocks x activation blocks
    smem: int


def plan(pw, M: int, cfg: TiledConfig, sms: int) -> Plan:
    """The K split of one call: without SPLITK, as many splits as keep tiles x splits within one wave of resident
    blocks (at most 2 a SM, by registers; fewer where the ring's shared memory does not fit two), no empty split."""
    lw = words_per_lane(pw.group)
    smem = smem_bytes(cfg, lw, pw.zero is not None)
    # registers: every mma.sync instance is compiled for 16 warps a SM (128 registers a thread), the wgmma ones for one
    # block a SM (up to 204 registers a thread)
    per_sm = 1 if cfg.wg else max(1, min(16 // cfg.warps, SMEM_PER_SM // smem))
    tiles = math.ceil(pw.N / cfg.BN) * math.ceil(M / cfg.BM)
    stages = pw.K // KS
    sk = cfg.SPLITK or max(1, per_sm * sms // tiles)
    sk = max(1, min(sk, stages, 64))
    sps = math.ceil(stages / sk)
    return Plan(lw, sps, math.ceil(stages / sps), tiles, smem)


def build(arch: str, *, cache_dir: Path | None = None, defines: tuple[str, ...] = ()) -> Path:
    return nvcc.build(SOURCE, arch, cache_dir=cache_dir, defines=defines)


def cache_path(arch: str, *, cache_dir: Path | None = None, defines: tuple[str, ...] = ()) -> Path:
    return nvcc.cache_path(SOURCE, arch, cache_dir=cache_dir, defines=defines)


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    P, I, L = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
    lib.lowbit_wq_tiled.argtypes = [P, L, P, P, I, P, P, I, P, L, I, P, P] + [I] * 16 + [ctypes.c_ulonglong,
                                                                                      ctypes.POINTER(I)]
    lib.lowbit_wq_tiled.restype = I
    lib.lowbit_wq_tiled_smem.argtypes = [I] * 8
    lib.lowbit_wq_tiled_smem.restype = I
    lib.lowbit_wq_tiled_error.argtypes = [I]
    lib.lowbit_wq_tiled_error.restype = ctypes.c_char_p
    return lib


def _device(dev: torch.device) -> tuple[ctypes.CDLL, int]:
    """(library, SM count) of a CUDA device, looked up once."""
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    got = _devices.get(idx)
    if got is None:
        arch = nvcc.arch_for(torch.cuda.get_device_capability(idx))
        with _lock:
            if arch not in _libs:
                _libs[arch] = _load(build(arch))
        got = _devices[idx] = (_libs[arch], torch.cuda.get_device_properties(idx).multi_processor_count)
    return got


def occupancy(pw, M: int, cfg: TiledConfig, device) -> int:
    """Blocks per SM the device gives this call's launch (registers and shared memory; nothing runs)."""
    lib, sms = _device(torch.device(device))
    pl = plan(pw, M, cfg, sms)
    out = ctypes.c_int(0)
    rc = lib.lowbit_wq_tiled(None, 0, None, None, _KIND[pw.scale.dtype], None if pw.zero is None else 1, None, 0,
                             None, 0, 0, None, None, M, pw.N, pw.K, pw.group, pl.lw, cfg.WN, cfg.WM, cfg.RT, cfg.MTW,
                             cfg.STAGES, int(cfg.fold), int(cfg.wg), pl.stages_per_split, pl.splitk, int(cfg.pdl),
                             cfg.L2P, 0,
                             ctypes.byref(out))
    if rc != 0:
        raise LowbitError(f"occupancy query for {cfg.name} failed: {lib.lowbit_wq_tiled_error(rc).decode()}")
    return out.value


def linear(x: torch.Tensor, pw, config: TiledConfig | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [M, K] bf16 -> y [M, N] in out_dtype (default x's) on the current stream."""
    cfg = config or TiledConfig()
    M, K = x.shape
    x = kernel_input(x, pw, why_not(pw, x.dtype, M, cfg))
    out_dtype = out_dtype or x.dtype
    dev = x.device
    lib, sms = _device(dev)
    pl = plan(pw, M, cfg, sms)
    y = torch.empty(M, pw.N, dtype=out_dtype, device=dev)
    stream = torch.cuda.current_stream(dev).cuda_stream
    ws = cnt = None
    if pl.splitk > 1:
        ws = torch.empty(pl.splitk * M * pw.N, dtype=torch.float32, device=dev)
        cnt = _counter_buffer(dev, stream, pl.tiles)
    rc = lib.lowbit_wq_tiled(x.data_ptr(), x.stride(0), pw.qweight.data_ptr(), pw.scale.data_ptr(),
                             _KIND[pw.scale.dtype], None if pw.zero is None else pw.zero.data_ptr(),
                             None if pw.bias is None else pw.bias.data_ptr(),
                             _KIND[pw.bias.dtype] if pw.bias is not None else 0, y.data_ptr(), y.stride(0),
                             _KIND[out_dtype], None if ws is None else ws.data_ptr(),
                             None if cnt is None else cnt.data_ptr(), M, pw.N, K, pw.group, pl.lw, cfg.WN, cfg.WM,
                             cfg.RT, cfg.MTW, cfg.STAGES, int(cfg.fold), int(cfg.wg), pl.stages_per_split, pl.splitk,
                             int(cfg.pdl), cfg.L2P, stream, None)
    if rc != 0:
        msg = lib.lowbit_wq_tiled_error(rc).decode()
        raise LowbitError(f"CUDA weight kernel {cfg.name} failed at M={M} N={pw.N} K={K}: {msg}")
    return y
