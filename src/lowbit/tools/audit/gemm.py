"""Audit the weight GEMM kernels against their torch twin on this device: every dispatch cell over a shape sweep.

    rows = audit_weights("cuda")          # one WeightAuditRow per (scheme, shape, M): rel L2, finite, pass/fail
    print(format_table(rows, dispatch))

The per-cell judgement (tolerance per kernel, the twin, random packed weights) is the kernels' own
(lowbit.kernels.gemm.check), which the GPU load path also runs as its self-check; this module is the sweep
and the report `lowbit audit` prints.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from lowbit.core.errors import LowbitError
from lowbit.kernels.gemm.check import DEQUANT_TOL, TOL, cell_passes, check_cell
from lowbit.kernels.gemm.dispatch import Dispatch, generic_cells
from lowbit.kernels.gemm.triton_gemm import random_weight
from lowbit.weights.scheme import parse_weight_scheme

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


def audit_weights(device: str = "cuda", *, schemes=SCHEMES, shapes=None, ms=None, dispatch=None, log=None):
    """(rows, dispatch with the failing cells removed). On CPU: small shapes through the interpreter."""
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
