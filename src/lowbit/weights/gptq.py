"""GPTQ and RTN as pure functions of one weight matrix (and its input Hessian). No model code here.

GPTQ (Frantar et al. 2022) quantizes the columns of W [out, in] one at a time and spreads each
column's rounding error over the columns not yet quantized, weighted by the inverse Hessian of the
layer's inputs, H = X^T X / n (X: [n tokens, in]). Choices made here:

- block 128: errors are pushed inside a block column by column, then onto the rest in one matmul.
- dampening: H += damp * mean(diag(H)) * I with damp = 1%; if a Cholesky factorisation fails the
  damp is raised (x ~3 per retry, each retry logged); after the last retry a LowbitError names
  the layer.
- static act-order: columns are visited in order of decreasing diag(H) (the most used inputs
  first, while most columns are still free to absorb error), but each group's scale/zero-point is
  fitted up front on the original W in the original column order, so the checkpoint needs no
  g_idx: groups stay contiguous runs of `group` inputs.
- the grid per group comes from `grid.fit_grid`: asymmetric (or symmetric) with a per-group MSE
  clip search, on the integer grid compressed-tensors stores.

Dead inputs (diag(H) == 0: never active in calibration) get H[i, i] = 1 so the factorisation
exists; their weights are quantized like the rest, not zeroed (they may be active off-domain).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from lowbit.core.errors import LowbitError
from lowbit.weights.grid import Grid, decode, dequantize_on, encode, fit_grid, quantize_on

log = logging.getLogger("lowbit.weights.gptq")

DAMP_RETRIES = 4  # damp, 3x, 10x, 30x, 100x of the asked fraction


@dataclass(frozen=True)
class QuantizedWeight:
    """codes uint8 [out, in] on `grid`; x_hat = codes * scale + zero per group (see grid.py).

    method: "gptq" | "rtn"; damp: the dampening fraction that factorised (None for rtn);
    proxy_loss: tr((W - W_hat) H (W - W_hat)^T) / out when H is known (output MSE per row), else None.
    """

    codes: torch.Tensor
    grid: Grid
    method: str
    damp: float | None = None
    proxy_loss: float | None = None

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in]."""
        return dequantize_on(self.codes, self.grid)


def _proxy_loss(W: torch.Tensor, W_hat: torch.Tensor, H: torch.Tensor | None) -> float | None:
    if H is None:
        return None
    D = (W.float() - W_hat).double()  # [out, in]
    return float(((D @ H.double()) * D).sum() / W.shape[0])


def rtn_quantize(
    W: torch.Tensor,
    bits: int,
    group: int,
    symmetric: bool,
    *,
    clip_search: bool = True,
    H: torch.Tensor | None = None,
    scale_dtype: torch.dtype = torch.float32,
) -> QuantizedWeight:
    """Round-to-nearest on the MSE-clipped per-group grid. W [out, in]; H (optional) only for the loss."""
    g = fit_grid(W, bits, group, symmetric, clip_search=clip_search, scale_dtype=scale_dtype)
    codes = quantize_on(W, g)
    return QuantizedWeight(codes, g, "rtn", None, _proxy_loss(W, dequantize_on(codes, g), H))


def inverse_hessian_chol(H: torch.Tensor, damp: float, *, name: str = "?", retries: int = DAMP_RETRIES):
    """Upper Cholesky factor U of (H + d*mean(diag H)*I)^-1 (float64 math, float32 result), i.e.
    Hinv = U^T U. Tries damp, then larger damps (logged); raises LowbitError naming `name` if all fail.

    Returns (U [in, in], damp_used).
    """
    n = H.shape[0]
    H = H.double().clone()
    diag = torch.diagonal(H)
    dead = diag <= 0
    if dead.any():
        diag[dead] = 1.0
    mean_diag = float(diag.mean())
    if not math.isfinite(mean_diag):
        raise LowbitError(f"GPTQ on {name}: the Hessian has inf/NaN entries; check the calibration inputs")
    eye = torch.eye(n, dtype=torch.float64, device=H.device)
    tried = []
    for k in range(retries + 1):
        d = damp * (10 ** (k / 2))  # 1x, 3.2x, 10x, 32x, 100x
        tried.append(d)
        # Upper U with (H + dI)^-1 = U^T U from ONE Cholesky: with P the order reversal,
        # P (H + dI) P = L L^T  =>  H + dI = V V^T, V = P L P upper  =>  U = V^-1 = P L^-1 P.
        L, info = torch.linalg.cholesky_ex((H + d * mean_diag * eye).flip(0, 1))
        if int(info) == 0:
            Linv = torch.linalg.solve_triangular(L, eye, upper=False)
            U = Linv.flip(0, 1)
            if torch.isfinite(U).all():
                if k:
                    log.warning("GPTQ %s: Cholesky needed damp %.3g (asked %.3g)", name, d, damp)
                return U.float(), d
        if k < retries:
            log.warning("GPTQ %s: Cholesky failed at damp %.3g of mean diag; retrying with more", name, d)
    raise LowbitError(
        f"GPTQ on {name}: Hessian not positive definite even with damp {', '.join(f'{t:.3g}' for t in tried)}; "
        "use more calibration tokens, a larger --damp, or --method rtn"
    )


def gptq_quantize(
    W: torch.Tensor,
    H: torch.Tensor,
    bits: int,
    group: int,
    symmetric: bool,
    *,
    block: int = 128,
    damp: float = 0.01,
    act_order: bool = True,
    clip_search: bool = True,
    name: str = "?",
    scale_dtype: torch.dtype = torch.float32,
    weighted_clip: bool = False,
) -> QuantizedWeight:
    """GPTQ of W [out, in] given H [in, in] (mean of x^T x over calibration tokens).

    weighted_clip: score the clip search by diag(H)-weighted error (inputs that carry more energy
    count more) instead of plain weight MSE.
    Returns codes uint8 [out, in] in the ORIGINAL column order on a grid of contiguous groups.
    """
    out, n = W.shape
    if H.shape != (n, n):
        raise LowbitError(f"GPTQ on {name}: Hessian shape {tuple(H.shape)} does not match in_features {n}")
    if n % group:
        raise LowbitError(f"GPTQ on {name}: group {group} does not divide in_features {n}")
    W0 = W.detach().float()
    # Static groups: every group's grid fitted once on the original weights, original order.
    cw = torch.diagonal(H).float().clamp(min=0) if weighted_clip else None
    g = fit_grid(W0, bits, group, symmetric, clip_search=clip_search, scale_dtype=scale_dtype, col_weight=cw)
    scale_c = g.scale.repeat_interleave(group, dim=1)  # [out, n] per column
    zero_c = g.zero.repeat_interleave(group, dim=1)

    perm = torch.argsort(torch.diagonal(H), descending=True, stable=True) if act_order else torch.arange(n, device=H.device)
    Wp = W0[:, perm].clone()  # [out, n], columns in visiting order
    Sp, Zp = scale_c[:, perm], zero_c[:, perm]
    U, used = inverse_hessian_chol(H[perm][:, perm], damp, name=name)  # [n, n] upper

    # Transposed layout: row j of WT is column j of W, so every per-column step reads and updates
    # contiguous rows (and the rank-1 update is one BLAS ger call).
    WT = Wp.T.contiguous()  # [n, out]
    ST, ZT = Sp.T.contiguous(), Zp.T.contiguous()
    QT = torch.empty(n, out, dtype=torch.uint8, device=W.device)
    for i1 in range(0, n, block):
        i2 = min(i1 + block, n)
        W1 = WT[i1:i2].clone()  # [b, out]
        E1 = torch.empty_like(W1)
        U1 = U[i1:i2, i1:i2]
        for i in range(i2 - i1):
            w, s, z = W1[i], ST[i1 + i], ZT[i1 + i]
            q = encode(w, s, z, bits)
            err = (w - decode(q, s, z)) / U1[i, i]
            QT[i1 + i] = q
            E1[i] = err
            if i + 1 < i2 - i1:
                W1[i + 1:].addr_(U1[i, i + 1:], err, alpha=-1.0)  # later columns absorb the error
        if i2 < n:
            WT[i2:].addmm_(U[i1:i2, i2:].T, E1, alpha=-1.0)  # and the columns after the block
    Qp = QT.T

    codes = torch.empty_like(Qp)
    codes[:, perm] = Qp
    return QuantizedWeight(codes, g, "gptq", used, _proxy_loss(W0, dequantize_on(codes, g), H))
