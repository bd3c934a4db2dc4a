"""Audit of the weight GEMMs: every dispatched (scheme, M, shape) cell against the torch twin.

    rows, dispatch = audit_weights("cuda")       # rows: one per (scheme, shape, M); dispatch: failures removed

A row passes when the output is finite and its relative L2 error against `linear_twin` (float32
output, so the kernel's own error is measured, not the bf16 rounding) is within TOL for the fused
kernels and DEQUANT_TOL where the weight is rounded to bf16 first (dequantize + cuBLAS, the tiled kernel's folded
instances: `tolerance`). A cell
whose row fails is removed from the dispatch table by this result (`Dispatch.without`), and the
failure names the shape: that is how a kernel that returns NaN on some GPU while the capability
query says yes is kept from serving.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from lowbit.errors import LowbitError

TOL = 1e-3
DEQUANT_TOL = 1e-2

# (name, K = in_features, N = out_features)
LLM_SHAPES = [("llama3-8b qkv/o", 4096, 4096), ("llama3-8b gate/up", 4096, 14336), ("llama3-8b down", 14336, 4096),
              ("llama3-8b k/v", 4096, 1024), ("llama3-8b qkv fused", 4096, 6144), ("llama3-8b gate|up fused", 4096, 28672),
              ("smollm2 q/o", 576, 576), ("smollm2 up", 576, 1536),
              ("smollm2 down", 1536, 576)]
DIT_SHAPES = [("dit qkv/o", 1152, 1152), ("dit mlp up", 1152, 4608), ("dit mlp down", 4608, 1152),
              # the trained artifacts/dit-digits32's own linears (K = in_features, N = out_features)
              ("dit-digits32 attn", 128, 128), ("dit-digits32 adaLN", 128, 768), ("dit-digits32 ff up", 128, 512),
              ("dit-digits32 ff down", 512, 128), ("dit-digits32 proj", 128, 256), ("dit-digits32 t-emb", 256, 128)]
LLM_MS = (1, 2, 3, 4, 7, 8, 16, 17, 32, 64, 128, 255, 256, 1024, 4096, 16384)
DIT_MS = (256, 1024, 4096, 16384)
SCHEMES = ("w4a16-g128", "w4a16-g64-asym", "w4a16-g32", "w8a16", "w8a8", "w4a8")
CPU_SHAPES = [("tiny", 128, 33), ("tiny wide", 256, 48)]
CPU_MS = (1, 3, 17)


@dataclass
class WeightAuditRow:
    scheme: str
    shape: str
    M: int
    N: int
    K: int
    kernel: str
    rel_l2: float
    finite: bool
    ok: bool
    seconds: float

    def as_dict(self) -> dict:
        return asdict(self)


def random_weight(scheme_name: str, N: int, K: int, device, seed: int = 0):
    """A PackedWeight of `scheme_name` with random codes, scales (and zero-points if asymmetric)."""
    from lowbit.kernels.weight_gemm import pack_weight
    from lowbit.weights.scheme import parse_weight_scheme

    sch = parse_weight_scheme(scheme_name)
    group = sch.group_for(K)
    g = torch.Generator(device=device).manual_seed(seed)
    kw = {"generator": g, "device": device}
    codes = torch.randint(0, 2 ** sch.w_bits, (N, K), dtype=torch.uint8, **kw)
    if sch.a_bits == 8 and sch.w_bits == 8:
        codes = codes.clamp_(1, 255)  # symmetric int8: q in [-127, 127]
    scale = (torch.rand(N, K // group, **kw) * 0.02 + 0.002).to(torch.bfloat16)
    zp = None if sch.symmetric else torch.randint(-4, 4, (N, K // group), dtype=torch.int8, **kw)
    return pack_weight(codes, scale, zp, bits=sch.w_bits, group=group, a_bits=sch.a_bits)


def cell_passes(rel: float, finite: bool, kernel: str) -> bool:
    """The audit's verdict on one cell (dequantize + cuBLAS rounds the weight to bf16 first: its own bound)."""
    return finite and rel <= tolerance(kernel)


def tolerance(kernel: str) -> float:
    """The audit's rel L2 bound for a kernel: DEQUANT_TOL where the weight is rounded to bf16 before the product
    (dequantize + cuBLAS, the tiled kernel's folded instances), TOL otherwise."""
    from lowbit.kernels.weight_tiled import rounds_weight_to_bf16

    # humming writes bf16/fp16 only and casts the scales to it (lowbit.kernels.humming_gemm): the same bound
    return DEQUANT_TOL if rounds_weight_to_bf16(kernel) or kernel.split(":")[0] == "humming" else TOL


def check_cell(dispatch, pw, M: int, *, device, seed: int = 0, dtype=torch.bfloat16) -> tuple[float, bool, str]:
    """(rel_l2, finite, kernel) of dispatch's cell for (pw.kind, M) against the twin on fresh inputs; a library
    kernel (humming) that raises -- fails to build, refuses the shape at run time -- counts as non-finite."""
    from lowbit.kernels import weight_gemm as wg
    from lowbit.kernels.weight_dispatch import run_cell

    cell = dispatch.choose(pw.kind, M, pw, dtype)  # the cell that runs this weight (CUDA cells have conditions)
    g = torch.Generator(device=device).manual_seed(1000 + seed)
    x = torch.randn(M, pw.K, generator=g, device=device).to(dtype)
    try:
        y = run_cell(cell, x, pw, torch.float32)
    except LowbitError:
        raise  # a configuration error (e.g. humming not installed): one line to the user, not a dropped cell
    except Exception:
        if cell.path != "humming":
            raise
        return float("inf"), False, cell.kernel
    ref = wg.linear_twin(x, pw, out_dtype=torch.float32)
    finite = bool(torch.isfinite(y).all())
    rel = float((y.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)) if finite else float("inf")
    return rel, finite, cell.kernel


def audit_weights(device: str = "cuda", *, schemes=SCHEMES, shapes=None, ms=None, dispatch=None, log=None):
    """(rows, dispatch with the failing cells removed). On CPU: small shapes through the interpreter."""
    from lowbit.kernels.weight_dispatch import Dispatch, generic_cells

    if dispatch is None:
        dispatch = Dispatch.for_device(device) if device == "cuda" else Dispatch(generic_cells(), "generic (cpu)")
    if shapes is None:
        cases = ([(s, LLM_MS) for s in LLM_SHAPES] + [(s, DIT_MS) for s in DIT_SHAPES]) if device == "cuda" else \
            [(s, CPU_MS) for s in CPU_SHAPES]
    else:
        cases = [(s, ms or (LLM_MS if device == "cuda" else CPU_MS)) for s in shapes]
    rows: list[WeightAuditRow] = []
    for scheme in schemes:
        for (shape, K, N), mlist in cases:
            try:
                pw = random_weight(scheme, N, K, device, seed=len(rows))
            except LowbitError:
                continue  # the scheme's group does not divide this K (e.g. g128 on smollm2's 576)
            for M in mlist:
                t = time.time()
                rel, finite, kernel = check_cell(dispatch, pw, M, device=device, seed=len(rows))
                rows.append(WeightAuditRow(scheme, shape, M, N, K, kernel, rel, finite,
                                           cell_passes(rel, finite, kernel), time.time() - t))
                if log and not rows[-1].ok:
                    log(f"FAIL {scheme} {shape} M={M} N={N} K={K} {kernel}: rel {rel:.3g} finite {finite}")
            del pw
    failed = sorted({(_kind(r.scheme), r.M, r.kernel) for r in rows if not r.ok})
    return rows, dispatch.without(failed)


def _kind(scheme: str) -> str:
    from lowbit.weights.scheme import parse_weight_scheme

    s = parse_weight_scheme(scheme)
    return f"w{s.w_bits}a{s.a_bits}"


def format_table(rows: list[WeightAuditRow], dispatch) -> str:
    bad = [r for r in rows if not r.ok]
    lines = [f"{len(rows) - len(bad)}/{len(rows)} weight-kernel cells ok (rel L2 <= {TOL:g} fused, "
             f"<= {DEQUANT_TOL:g} dequantize+cuBLAS; non-finite always fails)"]
    for r in bad:
        lines.append(f"FAIL {r.scheme:<15} {r.shape:<18} M={r.M:<6} N={r.N:<6} K={r.K:<6} {r.kernel}: "
                     f"rel {r.rel_l2:.3g}, finite {r.finite}")
    worst = max(rows, key=lambda r: r.rel_l2 if r.finite else float("inf"), default=None)
    if worst is not None:
        lines.append(f"worst: {worst.scheme} {worst.shape} M={worst.M} {worst.kernel} rel {worst.rel_l2:.3g}")
    lines.append(f"dispatch in force: {dispatch.source}")
    return "\n".join(lines)
