"""How one weight GEMM cell is judged against the torch twin: the check prepare_cuda runs at load, and audits reuse.

    rel, finite, kernel = check_cell(dispatch, packed_weight, M, device="cuda")
    ok = cell_passes(rel, finite, kernel)

A cell passes when the output is finite and its relative L2 error against `linear_twin` (float32
output, so the kernel's own error is measured, not the bf16 rounding) is within TOL for the fused
kernels and DEQUANT_TOL where the weight is rounded to bf16 first (dequantize + cuBLAS, the tiled kernel's folded
instances: `tolerance`). A cell
that fails is removed from the dispatch table by this result (`Dispatch.without`), and the
failure names the shape: that is how a kernel that returns NaN on some GPU while the capability
query says yes is kept from serving.
"""

from __future__ import annotations

import torch

from lowbit.core.errors import LowbitError
from lowbit.kernels.gemm.tiled import rounds_weight_to_bf16

TOL = 1e-3
DEQUANT_TOL = 1e-2

# (name, K = in_features, N = out_features)
def cell_passes(rel: float, finite: bool, kernel: str) -> bool:
    """The audit's verdict on one cell (dequantize + cuBLAS rounds the weight to bf16 first: its own bound)."""
    return finite and rel <= tolerance(kernel)


def tolerance(kernel: str) -> float:
    """The audit's rel L2 bound for a kernel: DEQUANT_TOL where the weight is rounded to bf16 before the product
    (dequantize + cuBLAS, the tiled kernel's folded instances), TOL otherwise."""
    # humming writes bf16/fp16 only and casts the scales to it (lowbit.kernels.gemm.humming): the same bound
    return DEQUANT_TOL if rounds_weight_to_bf16(kernel) or kernel.split(":")[0] == "humming" else TOL


def check_cell(dispatch, pw, M: int, *, device, seed: int = 0, dtype=torch.bfloat16) -> tuple[float, bool, str]:
    """(rel_l2, finite, kernel) of dispatch's cell for (pw.kind, M) against the twin on fresh inputs; a library
    kernel (humming) that raises -- fails to build, refuses the shape at run time -- counts as non-finite."""
    from lowbit.kernels.gemm import triton_gemm as wg
    from lowbit.kernels.gemm.dispatch import run_cell

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


