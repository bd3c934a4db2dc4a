"""CUDA C++ weight-only GEMM for small M (decode, 1 <= M <= 64): built once with nvcc, called via ctypes.

    y = linear(x, pw, CudaConfig(RT=2, warps=4))    x [M, K] bf16 -> y [M, N] (bf16 / fp16 / fp32 out)
    y = linear(x, pw, CudaConfig(2, 4, NB=3))       the warp-split kernel (4-bit, M <= 16)
    y = linear(x, pw, CudaConfig(2, 4, NB=3, pdl=True))   launched as a programmatic dependent (sm_90+)
    why_not(pw, x, M, config)                       None if the kernel takes this (weight, input), else the reason

Two kernels: the x-staging one (NB = 0; 4/8-bit, M <= 64: x staged in shared memory in mma-fragment order) and the
warp-split one (NB > 0; 4-bit, M <= 16, two activation tiles above 8: a block's warps split K, each lane's x from L1, a ring of NB chunks per
warp, the offset out of the inner loop). pdl: the kernel prefetches its first weight lines into L2, then waits for
the previous kernel (griddepcontrol) before it reads x or writes anything; launched with programmatic stream
serialization, so its launch overlaps the previous kernel's tail.

The kernel (kernels/gemm/cuda/weight_small_m.cu) reads lowbit's PackedWeight as it is (pw.layout: 4-bit
compressed-tensors int32 words [N, K/8], 8-bit int8 [N, K], scale [G, N], zero int8 [G, N]): no repack, so
the Triton and dequantize + cuBLAS cells for larger M read the same tensors. It needs no torch C++
headers: nvcc builds a shared library with `extern "C"` launchers taking raw device pointers and the
caller's stream (torch.cuda.current_stream().cuda_stream), so a call is capturable in a CUDA graph.

Build and cache: lowbit.kernels.nvcc (shared with the other CUDA sources).

Launch geometry (CudaConfig), x-staging kernel: a block of `warps` warps, each warp RT tiles of 16 weight rows (RT 4
only for M <= 16); K split across SPLITK blocks (0: as many as keep the grid within `waves` (2) x the SMs). A block
stages x, 16 * MT bytes per k (MT = 1, 2, 4, 8 for M <= 8, 16, 32, 64), in windows of its K range of as many
chunks as SMEM_CAP holds; up to M 16 the split is raised until the whole range is one window. A K chunk is
4 lanes x LW words, LW in {4, 2, 1} the largest with chunk | group and chunk | K, so every chunk has one
scale (4-bit: chunk 32 * LW, so g128 / g64 / g32 get LW 4 / 2 / 1; 8-bit: chunk 16 * LW). Warp-split kernel: a
block of `warps` warps on 16 * RT rows, its K range split across them chunk by chunk (plan_warp_split).
"""

from __future__ import annotations

import ctypes
import math
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from lowbit.core.errors import LowbitError
from lowbit.kernels import nvcc
from lowbit.kernels.nvcc import arch_for, find_nvcc, nvcc_missing  # noqa: F401  (re-exported: callers ask here)

SOURCE = Path(__file__).with_name("cuda") / "weight_small_m.cu"
SMEM_CAP = 96 * 1024  # dynamic shared memory per block we allow (two blocks per SM on an H100/H200)
M_MAX = 64
_KIND = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
_lock = threading.Lock()
_libs: dict[str, ctypes.CDLL] = {}
_counters: dict[tuple, torch.Tensor] = {}


@dataclass(frozen=True)
class CudaConfig:
    """Launch geometry of a CUDA small-M kernel: RT 16-row tiles per warp, `warps` per block, SPLITK K-splits
    across blocks (0: automatic, enough blocks for `waves` x the SM count). NB > 0 picks the warp-split kernel
    (4-bit, M <= 8: the block's warps split K, a ring of NB chunks per warp), 0 the x-staging one."""

    RT: int = 2
    warps: int = 4
    SPLITK: int = 0
    waves: int = 2
    NB: int = 0
    pdl: bool = False  # launched as a programmatic dependent: prologue overlaps the previous kernel's tail
    # warp-split only: the instance's launch bound in threads per block. 512 (the default) caps a thread at 128
    # registers, where the RT 2 and M > 8 instances spill (ptxas); 256 (at most 8 warps) allows 255
    bound: int = 512

    @classmethod
    def from_name(cls, name: str) -> CudaConfig:
        import re

        pdl = name.endswith("-pdl")
        base = name[:-4] if pdl else name
        m = re.fullmatch(r"cuda-rt(\d+)-w(\d+)-sk(\d+)(?:-wv(\d+))?", base)
        if m is not None:
            return cls(int(m[1]), int(m[2]), int(m[3]), int(m[4] or 2), pdl=pdl)
        m = re.fullmatch(r"cuda-ws-rt(\d+)-w(\d+)-nb(\d+)-sk(\d+)(?:-wv(\d+))?(?:-lb(\d+))?", base)
        if m is None:
            raise ValueError(f"not a CudaConfig name: {name!r}")
        return cls(int(m[1]), int(m[2]), int(m[4]), int(m[5] or 2), int(m[3]), pdl, int(m[6] or 512))

    @property
    def name(self) -> str:
        wv = ("" if self.waves == 2 else f"-wv{self.waves}")
        pdl = "-pdl" if self.pdl else ""
        if self.NB:
            lb = "" if self.bound == 512 else f"-lb{self.bound}"
            return f"cuda-ws-rt{self.RT}-w{self.warps}-nb{self.NB}-sk{self.SPLITK}{wv}{lb}{pdl}"
        wv += pdl
        return f"cuda-rt{self.RT}-w{self.warps}-sk{self.SPLITK}{wv}"


def build(arch: str, *, cache_dir: Path | None = None, defines: tuple[str, ...] = ()) -> Path:
    """This library for `arch` (lowbit.kernels.nvcc.build). `defines` are for the compile-only test
    (LOWBIT_COMPILE_CHECK: a few template instances)."""
    return nvcc.build(SOURCE, arch, cache_dir=cache_dir, defines=defines)


def cache_path(arch: str, *, cache_dir: Path | None = None, defines: tuple[str, ...] = ()) -> Path:
    return nvcc.cache_path(SOURCE, arch, cache_dir=cache_dir, defines=defines)


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    P, I, L = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
    lib.lowbit_wq_small_m.argtypes = [P, L, P, P, I, P, P, I, P, L, I, P, P, I, I, I, I, I, I, I, I, I, I, I, I,
                                      ctypes.c_ulonglong]
    lib.lowbit_wq_small_m.restype = I
    lib.lowbit_wq_warp_split.argtypes = [P, L, P, P, I, P, P, I, P, L, I, P, P, I, I, I, I, I, I, I, I, I, I, I, I,
                                         ctypes.c_ulonglong, ctypes.POINTER(I)]
    lib.lowbit_wq_warp_split.restype = I
    lib.lowbit_wq_warp_split_smem.argtypes = [I, I, I]
    lib.lowbit_wq_warp_split_smem.restype = I
    lib.lowbit_wq_small_m_smem.argtypes = [I, I, I, I]
    lib.lowbit_wq_small_m_smem.restype = I
    lib.lowbit_cuda_error_string.argtypes = [I]
    lib.lowbit_cuda_error_string.restype = ctypes.c_char_p
    return lib


_devices: dict[int, tuple[ctypes.CDLL, int]] = {}


def library(device) -> ctypes.CDLL:
    """The loaded library for this CUDA device's architecture (built on first use)."""
    return _device(torch.device(device))[0]


def _device(dev: torch.device) -> tuple[ctypes.CDLL, int]:
    """(library, SM count) of a CUDA device, looked up once (the call path stays a few dict lookups)."""
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    got = _devices.get(idx)
    if got is None:
        arch = arch_for(torch.cuda.get_device_capability(idx))
        with _lock:
            if arch not in _libs:
                _libs[arch] = _load(build(arch))
        got = _devices[idx] = (_libs[arch], torch.cuda.get_device_properties(idx).multi_processor_count)
    return got


def words_per_lane(bits: int, K: int, group: int) -> int | None:
    """LW: the largest of 4, 2, 1 whose K chunk (4 lanes x LW words) divides both K and the group."""
    kpw = 8 if bits == 4 else 4
    for lw in (4, 2, 1):
        ck = 4 * lw * kpw
        if K % ck == 0 and group % ck == 0:
            return lw
    return None


WARP_SPLIT_M_MAX = 16
WARP_SPLIT_SHAPES = {(1, 3), (1, 4), (1, 6), (2, 3), (2, 4)}  # (RT, NB) instances in the library, M <= 8
WARP_SPLIT_SHAPES_MT2 = {(1, 3), (1, 4), (2, 3)}  # and for 9 <= M <= 16 (two activation tiles)
WARP_SPLIT_SHAPES_MT2_LB256 = {(4, 2)}  # 9 <= M <= 16 under launch bound 256 only (~250 registers)


def why_not(pw, x_dtype=torch.bfloat16, M: int | None = None, config: CudaConfig | None = None) -> str | None:
    """None when the kernel (config's: the warp-split one if config.NB) runs this weight (and input dtype / M),
    else why not (the dispatch falls through)."""
    if config is not None and config.NB:
        if pw.bits != 4:
            return f"the warp-split CUDA kernel is 4-bit only, not {pw.kind}"
        if M is not None and M > WARP_SPLIT_M_MAX:
            return f"the warp-split CUDA kernel covers 1 <= M <= {WARP_SPLIT_M_MAX}, got M={M}"
        shapes = WARP_SPLIT_SHAPES_MT2 if M is not None and M > 8 else WARP_SPLIT_SHAPES
        if M is not None and M > 8 and config.bound == 256:
            shapes = shapes | WARP_SPLIT_SHAPES_MT2_LB256
        if (config.RT, config.NB) not in shapes or config.warps not in (4, 8, 16):
            return f"no warp-split instance for {config.name}" + (f" at M={M}" if M is not None and M > 8 else "")
        if config.bound not in (256, 512) or config.warps * 32 > config.bound:
            return f"no warp-split instance for {config.name}: launch bound 512, or 256 for at most 8 warps"
    elif config is not None and config.bound != 512:
        return f"{config.name}: a launch bound is an option of the warp-split kernel (NB > 0)"
    if pw.a_bits != 16 or pw.bits not in (4, 8):
        return f"the CUDA small-M kernel is weight-only A16 with 4- or 8-bit weights, not {pw.kind}"
    if x_dtype != torch.bfloat16:
        return f"the CUDA small-M kernel takes bf16 activations, got {x_dtype}"
    if M is not None and not 1 <= M <= M_MAX:
        return f"the CUDA small-M kernel covers 1 <= M <= {M_MAX}, got M={M}"
    if words_per_lane(pw.bits, pw.K, pw.group) is None:
        return f"K={pw.K} / group {pw.group} is not a multiple of {32 if pw.bits == 4 else 16}"
    if pw.scale.dtype not in _KIND or (pw.bias is not None and pw.bias.dtype not in _KIND):
        return f"scale/bias dtype {pw.scale.dtype} is not bf16/fp16/fp32"
    if not (pw.qweight.is_contiguous() and pw.qweight.data_ptr() % 16 == 0 and pw.scale.is_contiguous()
            and (pw.zero is None or pw.zero.is_contiguous())):
        return "the packed weight is not contiguous / 16-byte aligned"
    return None


@dataclass(frozen=True)
class Plan:
    lw: int
    chunks_per_split: int
    xs_chunks: int  # chunks of x per shared-memory window
    splitk: int
    row_blocks: int
    smem: int


def activation_tiles(M: int) -> int:
    """MT: 8-row activation tiles per mma A fragment (the .cu's mt_for)."""
    return 1 if M <= 8 else 2 if M <= 16 else 4 if M <= 32 else 8


def plan(pw, M: int, cfg: CudaConfig, sms: int) -> Plan:
    """K chunks per block and the K split for one call (the numbers the .cu launcher takes)."""
    lw = words_per_lane(pw.bits, pw.K, pw.group)
    ck = 4 * lw * (8 if pw.bits == 4 else 4)
    nch = pw.K // ck
    per_chunk = lw * (2 if pw.bits == 4 else 1) * activation_tiles(M) * 32 * 8  # smem bytes per chunk
    row_blocks = math.ceil(pw.N / (16 * cfg.RT * cfg.warps))
    # auto: as many splits as keep the grid within `waves` blocks per SM (floor: a partial second wave of a few
    # blocks costs nearly a whole block time; ncu measured it on 280 blocks for 264 slots)
    sk = cfg.SPLITK or cfg.waves * sms // row_blocks
    # up to M 16 the split also makes the whole K range of x fit (one window): the plans the H200 table's
    # cells were measured with; above 16 the fragments are 4-8x larger and x is staged in windows instead
    sk_min = math.ceil(nch * per_chunk / SMEM_CAP) if M <= 16 else 1
    sk = max(1, min(nch, max(sk, sk_min), 64))
    cps = math.ceil(nch / sk)
    sk = math.ceil(nch / cps)  # no empty split
    xs = min(cps, SMEM_CAP // per_chunk)
    return Plan(lw, cps, xs, sk, row_blocks, xs * per_chunk)


def warp_split_smem(cfg: CudaConfig, M: int = 1) -> int:
    """Shared memory of one warp-split block (the .cu's warp_split_smem): the warps' fp32 partials
    [warps][16 RT][8 MT], MT = 2 above M 8."""
    return cfg.warps * cfg.RT * 16 * 8 * (2 if M > 8 else 1) * 4


def plan_warp_split(pw, M: int, cfg: CudaConfig, sms: int) -> Plan:
    """The warp-split kernel's K split across blocks: none while the row blocks alone make `waves` x SMs blocks,
    else as many splits as do, keeping at least one chunk per warp in every split."""
    lw = words_per_lane(pw.bits, pw.K, pw.group)
    nch = pw.K // (32 * lw)
    row_blocks = math.ceil(pw.N / (16 * cfg.RT))
    sk = cfg.SPLITK or max(1, cfg.waves * sms // row_blocks)
    sk = max(1, min(sk, nch // cfg.warps or 1, 64))
    cps = math.ceil(nch / sk)
    sk = math.ceil(nch / cps)
    return Plan(lw, cps, 0, sk, row_blocks, warp_split_smem(cfg, M))


def warp_split_occupancy(pw, M: int, cfg: CudaConfig, device) -> int:
    """Blocks per SM the warp-split kernel gets for this call's launch (registers and shared memory; nothing runs)."""
    lib, sms = _device(torch.device(device))
    pl = plan_warp_split(pw, M, cfg, sms)
    out = ctypes.c_int(0)
    rc = lib.lowbit_wq_warp_split(None, 0, None, None, 0, None if pw.zero is None else 1, None, 0, None, 0, 0, None,
                                  None, M, pw.N, pw.K, pw.group, pl.lw, cfg.RT, cfg.NB, cfg.warps, cfg.bound,
                                  pl.chunks_per_split, pl.splitk, int(cfg.pdl), 0, ctypes.byref(out))
    if rc != 0:
        raise LowbitError(f"occupancy query for {cfg.name} failed: {lib.lowbit_cuda_error_string(rc).decode()}")
    return out.value


def _counter_buffer(device, stream: int, n: int) -> torch.Tensor:
    """Zeroed int32 counters, one per row block, kept per (device, stream): the kernel's last block of a row
    block resets its counter, so they are zero between launches on one stream."""
    key = (str(device), stream)
    buf = _counters.get(key)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
        _counters[key] = buf
    return buf


def kernel_input(x: torch.Tensor, pw, reason: str | None) -> torch.Tensor:
    """The checks every CUDA weight kernel's linear makes before it launches (x's K, the kernel's own why_not
    `reason`, one CUDA device), and x as the kernels read it: rows 16-byte aligned, unit stride."""
    if x.shape[1] != pw.K:
        raise ValueError(f"x has K={x.shape[1]}, the weight K={pw.K}")
    if reason:
        raise ValueError(reason)
    if not (x.is_cuda and pw.qweight.device == x.device):
        raise ValueError(f"the CUDA kernel needs x and the weight on one CUDA device, got {x.device} / {pw.qweight.device}")
    if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
        x = x.contiguous()
    return x


def linear(x: torch.Tensor, pw, config: CudaConfig | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [M, K] bf16 (1 <= M <= 64) -> y [M, N] in out_dtype (default x's) on the current stream."""
    cfg = config or CudaConfig()
    M, K = x.shape
    x = kernel_input(x, pw, why_not(pw, x.dtype, M, cfg))
    out_dtype = out_dtype or x.dtype
    dev = x.device
    lib, sms = _device(dev)
    pl = plan_warp_split(pw, M, cfg, sms) if cfg.NB else plan(pw, M, cfg, sms)
    y = torch.empty(M, pw.N, dtype=out_dtype, device=dev)
    stream = torch.cuda.current_stream(dev).cuda_stream
    ws = cnt = None
    if pl.splitk > 1:
        ws = torch.empty(pl.splitk * M * pw.N, dtype=torch.float32, device=dev)
        cnt = _counter_buffer(dev, stream, pl.row_blocks)
    args = (x.data_ptr(), x.stride(0), pw.qweight.data_ptr(), pw.scale.data_ptr(), _KIND[pw.scale.dtype],
            None if pw.zero is None else pw.zero.data_ptr(), None if pw.bias is None else pw.bias.data_ptr(),
            _KIND[pw.bias.dtype] if pw.bias is not None else 0, y.data_ptr(), y.stride(0), _KIND[out_dtype],
            None if ws is None else ws.data_ptr(), None if cnt is None else cnt.data_ptr(), M, pw.N, K, pw.group)
    if cfg.NB:
        rc = lib.lowbit_wq_warp_split(*args, pl.lw, cfg.RT, cfg.NB, cfg.warps, cfg.bound, pl.chunks_per_split,
                                      pl.splitk, int(cfg.pdl), stream, None)
    else:
        rc = lib.lowbit_wq_small_m(*args, pw.bits, pl.lw, cfg.RT, cfg.warps, pl.chunks_per_split, pl.xs_chunks,
                                   pl.splitk, int(cfg.pdl), stream)
    if rc != 0:
        msg = lib.lowbit_cuda_error_string(rc).decode()
        raise LowbitError(f"CUDA weight kernel {cfg.name} failed at M={M} N={pw.N} K={K}: {msg}")
    return y
