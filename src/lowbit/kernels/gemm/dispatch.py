"""Which weight GEMM runs a (kind, M) cell on this device: a table of cells, trimmed by the audit.

    d = Dispatch.for_device(device)            # the table for this device's compute capability
    d = d.without(failed_cells)                # the audit's failures removed (see weight_audit)
    y = d.linear(x2d, pw)                      # x [M, K] -> [M, N]

A cell is (kind, M range, capability[, weight shape]) -> path + launch config; a cell with a shape (N, K) is
tuned for that one weight shape (measured there against the bucket's cell) and matches only it. Paths:
    gemv            lowbit.kernels.gemm.triton_gemm.gemv with the cell's GemvConfig (A16, M <= BM: no tensor cores)
    triton          lowbit.kernels.gemm.triton_gemm.linear with the cell's GemmConfig
    dequant-cublas  dequantize the weight (Triton) then cuBLAS (A16 only; wins where the GEMM is
                    compute-bound, since the fused kernel's dequantization then costs tensor-core time)
    cuda            lowbit.kernels.gemm.cuda_gemm.linear with the cell's CudaConfig (A16 bf16, M <= 64: the
                    CUDA C++ tensor-core kernel built with nvcc), or lowbit.kernels.gemm.tiled.linear with a
                    TiledConfig (4-bit A16, any M: weight rows x activation rows tiles, names cuda-tl-*); a
                    weight or input it does not take (or no nvcc on the machine) falls through to the next
                    cell that covers M
    a16-xq          A8 weights: the activations quantized per token (weight_gemm.quantize_rows, the A8
                    kernels' row quantizer, tested equal to weights.act_quant's codes), their int8 codes
                    (integers, exact in bf16) through the A16 path of the cell's ViaA16 for the same weight
                    bits with an fp32 output, then the per-token scale and the bias: the twin's
                    (x_q * s_x) @ W^T reordered as s_x * (x_q @ W^T). It wins at small M where the int8
                    kernel's tiles are mostly empty (W4A8 everywhere on the H200)
    humming         lowbit.kernels.gemm.humming.linear: humming-kernels (an extra: `lowbit[humming]`), the weight
                    repacked once into its layout (the plan kept on the PackedWeight), its kernel per M bucket by
                    its own heuristics; a weight it does not take (lowbit.kernels.gemm.humming.why_not) falls through to the next
                    cell that covers M; humming not installed on a GPU whose table names it is an error with the
                    install command (never a silent fallback)
A table written by `lowbit bench gemm --candidates ... --table` for one card (tables/<card name>.json, e.g.
NVIDIA_H100_80GB_HBM3.json: shape cells chosen by measured time among humming, lowbit's kernels and dequantize +
cuBLAS, then the capability's cells) is preferred to the capability's table.
The cells for a capability with a table in tables/ (sm90.json: the H200) are the winners of the
committed explorations (benchmarks/build_weight_table.py over the explorations in git history, benchmarks/results/weights/gemm_explore_*);
other devices get the generic cells. A kind with no cell
left on a device is an error naming what exists, never a silent run on the twin.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from lowbit.core.errors import LowbitError
from lowbit.kernels.gemm import cuda_gemm as weight_cuda
from lowbit.kernels.gemm import humming as humming_gemm
from lowbit.kernels.gemm import tiled as weight_tiled
from lowbit.kernels.gemm import triton_gemm as wg
from lowbit.kernels.gemm.cuda_gemm import CudaConfig
from lowbit.kernels.gemm.tiled import TiledConfig
from lowbit.kernels.gemm.triton_gemm import GemmConfig, GemvConfig, PackedWeight, quantize_rows, tma_why_not

KINDS = ("w4a16", "w8a16", "w8a8", "w4a8")
M_INF = 1 << 62


@dataclass(frozen=True)
class Cell:
    """kind, covering m_lo <= M <= m_hi (and only weights of `shape` (N, K) when set), runs `path` with `config`
    (None for dequant-cublas)."""

    kind: str
    m_lo: int
    m_hi: int
    path: str
    config: GemmConfig | GemvConfig | CudaConfig | TiledConfig | None = None
    shape: tuple[int, int] | None = None

    @property
    def kernel(self) -> str:
        return self.path if self.config is None else f"{self.path}:{self.config.name}"

    def covers(self, M: int) -> bool:
        return self.m_lo <= M <= self.m_hi


@dataclass(frozen=True)
class ViaA16:
    """The A16 path (and its config) an A8 weight's "a16-xq" cell runs its activation codes through."""

    path: str
    config: GemmConfig | GemvConfig | CudaConfig | TiledConfig | None = None

    @property
    def name(self) -> str:
        return self.path if self.config is None else f"{self.path}:{self.config.name}"

    def cell(self, bits: int) -> Cell:
        """The A16 cell (any M) this runs for a weight of `bits`."""
        return Cell(f"w{bits}a16", 1, M_INF, self.path, self.config)

    @classmethod
    def from_name(cls, name: str) -> ViaA16:
        path, _, cfg = name.partition(":")
        if path not in ("triton", "gemv", "cuda", "dequant-cublas"):
            raise ValueError(f"not an A16 path for a16-xq: {name!r}")
        return cls(path, config_from_name(path, cfg or None))


def _a16(small, mid, big, m_big_cublas):
    return [("triton", 1, 16, small), ("triton", 17, 128, mid), ("triton", 129, m_big_cublas - 1, big),
            ("dequant-cublas", m_big_cublas, M_INF, None)]


_GENERIC_SMALL = GemmConfig(BM=16, BN=32, BK=128, SPLIT_K=1, num_warps=4, num_stages=4)
_GENERIC_MID = GemmConfig(BM=64, BN=64, BK=64, num_warps=4, num_stages=4)
_GENERIC_BIG = GemmConfig(BM=128, BN=128, BK=64, num_warps=8, num_stages=4)
_GENERIC_A8_BIG = GemmConfig(BM=128, BN=128, BK=128, num_warps=8, num_stages=3)


def generic_cells() -> list[Cell]:
    """Cells for any CUDA device (no measurement behind the M boundaries beyond the H200's)."""
    cells = []
    for kind in ("w4a16", "w8a16"):
        cells += [Cell(kind, lo, hi, p, c) for p, lo, hi, c in _a16(_GENERIC_SMALL, _GENERIC_MID, _GENERIC_BIG, 1025)]
    for kind in ("w8a8", "w4a8"):
        cells += [Cell(kind, 1, 16, "triton", _GENERIC_SMALL), Cell(kind, 17, 128, "triton", _GENERIC_MID),
                  Cell(kind, 129, M_INF, "triton", _GENERIC_A8_BIG)]
    return cells + last_resort()


def last_resort() -> list[Cell]:
    """Matched only where the audit removed an earlier cell: A16 falls back to dequantize + cuBLAS, A8 to its
    activation codes through dequantize + cuBLAS (a16-xq)."""
    return ([Cell(k, 1, M_INF, "dequant-cublas") for k in ("w4a16", "w8a16")]
            + [Cell(k, 1, M_INF, "a16-xq", ViaA16("dequant-cublas")) for k in ("w8a8", "w4a8")])


def config_from_name(path: str, name: str | None):
    if path == "dequant-cublas" or name is None:
        return None
    if path == "cuda":
        return TiledConfig.from_name(name) if name.startswith("cuda-tl-") else CudaConfig.from_name(name)
    if path == "a16-xq":
        return ViaA16.from_name(name)
    return GemvConfig.from_name(name) if path == "gemv" else GemmConfig.from_name(name)


def card_table_name(gpu: str) -> str:
    """The file name of one card's table: 'NVIDIA H100 80GB HBM3' -> 'NVIDIA_H100_80GB_HBM3.json'."""
    import re

    return (re.sub(r"[^A-Za-z0-9._-]+", "_", gpu.strip()) or "gpu") + ".json"


def measured_cells(cap: tuple[int, int], gpu: str | None = None) -> tuple[list[Cell], str] | None:
    """The cells measured on this card (tables/<card>.json, written by `lowbit bench gemm --table`) or on a
    device of this capability (tables/sm<maj><min>.json, written by benchmarks/build_weight_table.py from
    committed explorations), or None."""
    import json
    from pathlib import Path

    d = Path(__file__).with_name("tables")
    f = d / card_table_name(gpu) if gpu else None
    if f is None or not f.is_file():
        f = d / f"sm{cap[0]}{cap[1]}.json"
    if not f.is_file():
        return None
    d = json.loads(f.read_text())
    return table_cells(d) + last_resort(), f"measured sm_{cap[0]}{cap[1]} ({d.get('gpu', '?')}, {f.name})"


def table_cells(d: dict) -> list[Cell]:
    """The cells of a table file's JSON (without the last resort)."""
    return [Cell(c["kind"], c["m_lo"], M_INF if c["m_hi"] is None else c["m_hi"], c["path"],
                 config_from_name(c["path"], c.get("config")), tuple(c["shape"]) if c.get("shape") else None)
            for c in d["cells"]]


def run_cell(cell: Cell, x: torch.Tensor, pw: PackedWeight, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [M, K] -> [M, N] through one cell's path (out_dtype: the audit asks for float32)."""
    if cell.path == "dequant-cublas":
        y = wg.linear_dequant_cublas(x, pw)
        return y if out_dtype is None else y.to(out_dtype)
    if cell.path == "a16-xq":
        return linear_via_a16(x, pw, cell.config, out_dtype)
    if cell.path == "humming":
        return humming_gemm.linear(x, pw, out_dtype)
    if cell.path == "gemv":
        return wg.gemv(x, pw, cell.config, out_dtype)
    if cell.path == "cuda":
        kernel = weight_tiled if isinstance(cell.config, TiledConfig) else weight_cuda
        return kernel.linear(x, pw, cell.config, out_dtype)
    return wg.linear(x, pw, cell.config, out_dtype)


def as_a16(pw: PackedWeight) -> PackedWeight:
    """The same packed codes and scales read as an A16 weight without bias (a view: no copy)."""
    return replace(pw, a_bits=16, bias=None)


def linear_via_a16(x: torch.Tensor, pw: PackedWeight, via: ViaA16, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """A8 weight, x [M, K] float -> [M, N]: x_q, s_x = the per-token activation quantizer's codes and scale;
    y = s_x * (x_q @ W^T) + bias, x_q @ W^T through the A16 path `via` in fp32."""
    if pw.a_bits != 8:
        raise ValueError(f"a16-xq runs A8 weights, got {pw.kind}")
    # codes [M, K] bf16, s_x [M] float32: one Triton launch, nothing made on the host (capturable)
    xq, sx = quantize_rows(x, torch.bfloat16)
    y = run_cell(via.cell(pw.bits), xq, as_a16(pw), torch.float32)
    y = y.mul_(sx[:, None]) if pw.bias is None else torch.addcmul(pw.bias.float(), y, sx[:, None])
    return y.to(out_dtype or x.dtype)


def takes(cell: Cell, pw: PackedWeight, x_dtype, M: int) -> bool:
    """Whether the cell's path runs this weight: only the CUDA kernel has conditions beyond (kind, M)."""
    if cell.path == "a16-xq":
        return takes(cell.config.cell(pw.bits), as_a16(pw), torch.bfloat16, M)
    if cell.path == "humming":
        if humming_gemm.why_not(pw, x_dtype) is not None:
            return False
        humming_gemm.require_humming(f"the weight table dispatches {pw.kind} M={M} to humming on "
                                     f"{_card(pw.qweight.device)}")
        return True
    if cell.path == "triton" and getattr(cell.config, "tma", False):
        return tma_why_not(pw, cell.config) is None
    if cell.path != "cuda":
        return True
    kernel = weight_tiled if isinstance(cell.config, TiledConfig) else weight_cuda
    return kernel.why_not(pw, x_dtype, M, cell.config) is None and weight_cuda.nvcc_missing() is None


def _card(device) -> str:
    dev = torch.device(device)
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else str(dev)


class Dispatch:
    """The cells in force on one device; `choose(kind, M)` is the first cell that covers M."""

    def __init__(self, cells: list[Cell], source: str, card: str = "this device"):
        self.cells = list(cells)
        self.source = source
        self.card = card

    @classmethod
    def for_device(cls, device) -> Dispatch:
        dev = torch.device(device)
        if dev.type != "cuda":
            raise LowbitError(f"the weight kernels run on CUDA; {dev} runs QuantLinear's torch forward")
        cap = torch.cuda.get_device_capability(dev)
        card = torch.cuda.get_device_name(dev)
        got = measured_cells(cap, card)
        if got is not None:
            return cls(*got, card=card)
        return cls(generic_cells(), f"generic (sm_{cap[0]}{cap[1]} has no measured table)", card=card)

    def without(self, failed: list[tuple[str, int, str]]) -> Dispatch:
        """A copy without the cells that failed: (kind, M, kernel) is the cell of `kind` covering M that
        ran `kernel` (the audit's verdict); the next cell covering M (the last resort) takes over."""
        bad = [c for c in self.cells if any(c.kind == k and c.covers(m) and c.kernel == n for k, m, n in failed)]
        return Dispatch([c for c in self.cells if c not in bad], self.source + (f", {len(bad)} cell(s) removed by "
                                                                                 "the audit" if bad else ""), self.card)

    def choose(self, kind: str, M: int, pw: PackedWeight | None = None, x_dtype=torch.bfloat16) -> Cell:
        """The first cell of `kind` covering M; with `pw`, a shape cell of pw's (N, K) first, and cells whose path
        cannot take this weight / input dtype (the CUDA kernel's conditions) passed over; without, the shape-free
        cells only."""
        for c in self.cells:
            if c.shape is not None and (pw is None or c.shape != (pw.N, pw.K)):
                continue
            if c.kind == kind and c.covers(M) and (pw is None or takes(c, pw, x_dtype, M)):
                return c
        have = sorted({c.kind for c in self.cells})
        raise LowbitError(f"no weight kernel for {kind} at M={M} on {self.card} ({self.source}); kernels exist for "
                          f"{', '.join(have) or 'nothing'}: run `lowbit audit kernels --weights` to see what failed")

    def linear(self, x: torch.Tensor, pw: PackedWeight) -> torch.Tensor:
        """x [M, K] -> [M, N] through the chosen cell."""
        return run_cell(self.choose(pw.kind, x.shape[0], pw, x.dtype), x, pw)

    def table(self) -> list[dict]:
        return [{"kind": c.kind, "m_lo": c.m_lo, "m_hi": None if c.m_hi >= M_INF else c.m_hi, "path": c.path,
                 "config": None if c.config is None else c.config.name, "kernel": c.kernel,
                 **({"shape": list(c.shape)} if c.shape else {})} for c in self.cells]
