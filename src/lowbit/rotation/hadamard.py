"""Normalized Hadamard matrices and the fast Walsh-Hadamard transform.

A Hadamard matrix H of order n has entries +-1 and H @ H.T = n * I. We return the normalized
form H / sqrt(n), an orthogonal matrix with entries +-1/sqrt(n), so rotating KV vectors with it
spreads channel outliers without changing dot products.

Orders supported: n = m * 2**k with m in SUPPORTED_M = (1, 12, 20, 28, 36, 44, 60).
  - m = 1: Sylvester, H_{2n} = [[H, H], [H, -H]].
  - m = q + 1 with q prime, q = 3 (mod 4) (12, 20, 44, 60 from q = 11, 19, 43, 59): Paley I.
  - m = 2 * (q + 1) with q prime, q = 1 (mod 4) (28, 36 from q = 13, 17): Paley II.
  The order-m block is then Kronecker-multiplied with the Sylvester matrix of order 2**k:
  H_n = kron(H_{2**k}, H_m), so x @ H_n is an fwht over the 2**k axis followed by a small
  m x m matmul (see `hadamard` docstring for the index layout).
Head dims met in practice: 64, 128, 256 (Sylvester), 192 = 12 * 16, 576 = 36 * 16.

Every entry is computed here (quadratic residues included); nothing is typed in.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from lowbit.core.errors import LowbitError

# Base orders with a construction in this file; every supported order is m * 2**k for one of them.
SUPPORTED_M = (1, 12, 20, 28, 36, 44, 60)


def _is_prime(q: int) -> bool:
    if q < 2:
        return False
    return all(q % d for d in range(2, math.isqrt(q) + 1))


def _quadratic_character(q: int) -> torch.Tensor:
    """Legendre symbol chi(a) for a = 0..q-1 over GF(q), q prime: 0, +1 (residue), -1 (non-residue).

    Returns int64 [q].
    """
    chi = torch.full((q,), -1, dtype=torch.int64)
    residues = sorted({(x * x) % q for x in range(1, q)})
    chi[residues] = 1
    chi[0] = 0
    return chi


def _jacobsthal(q: int) -> torch.Tensor:
    """Jacobsthal matrix Q[i, j] = chi(j - i) over GF(q). int64 [q, q].

    Q @ Q.T = q I - J and Q @ 1 = 0; Q is antisymmetric when q = 3 (mod 4), symmetric when q = 1 (mod 4).
    """
    idx = torch.arange(q)
    return _quadratic_character(q)[(idx[None, :] - idx[:, None]) % q]


def _paley1(q: int) -> torch.Tensor:
    """Paley I, q prime = 3 (mod 4): H = I + S with S = [[0, 1^T], [-1, Q]] skew. int64 [q+1, q+1]."""
    S = torch.zeros(q + 1, q + 1, dtype=torch.int64)
    S[0, 1:] = 1
    S[1:, 0] = -1
    S[1:, 1:] = _jacobsthal(q)
    # S is skew with S S^T = q I, so (I + S)(I + S)^T = (q + 1) I.
    return torch.eye(q + 1, dtype=torch.int64) + S


def _paley2(q: int) -> torch.Tensor:
    """Paley II, q prime = 1 (mod 4): from the symmetric conference matrix C = [[0, 1^T], [1, Q]].

    H = kron(C, [[1, 1], [1, -1]]) + kron(I, [[1, -1], [-1, -1]]). int64 [2(q+1), 2(q+1)].
    """
    C = torch.zeros(q + 1, q + 1, dtype=torch.int64)
    C[0, 1:] = 1
    C[1:, 0] = 1
    C[1:, 1:] = _jacobsthal(q)
    # C has a zero diagonal and +-1 elsewhere, so exactly one of the two terms is non-zero per 2x2 block.
    A = torch.tensor([[1, 1], [1, -1]], dtype=torch.int64)
    B = torch.tensor([[1, -1], [-1, -1]], dtype=torch.int64)
    return torch.kron(C, A) + torch.kron(torch.eye(q + 1, dtype=torch.int64), B)


def _base(m: int) -> torch.Tensor:
    """Unnormalized +-1 Hadamard matrix of base order m in SUPPORTED_M. int64 [m, m]."""
    if m == 1:
        return torch.ones(1, 1, dtype=torch.int64)
    q = m - 1
    if _is_prime(q) and q % 4 == 3:
        return _paley1(q)
    q = m // 2 - 1
    if m % 2 == 0 and _is_prime(q) and q % 4 == 1:
        return _paley2(q)
    raise AssertionError(f"no Paley construction for base order {m}")  # tests cover every SUPPORTED_M


def _sylvester(k: int) -> torch.Tensor:
    """Unnormalized Sylvester matrix of order 2**k: H[i, j] = (-1)**popcount(i & j). int64 [2**k, 2**k]."""
    H = torch.ones(1, 1, dtype=torch.int64)
    H2 = torch.tensor([[1, 1], [1, -1]], dtype=torch.int64)
    for _ in range(k):
        H = torch.kron(H2, H)
    return H


def factor_order(n: int) -> tuple[int, int]:
    """Split n into (m, k) with n = m * 2**k and m in SUPPORTED_M, or raise LowbitError.

    The odd parts of SUPPORTED_M (1, 3, 5, 7, 9, 11, 15) are distinct, so the split is unique.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise LowbitError(f"Hadamard order must be a positive integer, got {n!r}")
    for m in SUPPORTED_M:
        if n % m == 0:
            r = n // m
            if r & (r - 1) == 0:
                return m, r.bit_length() - 1
    raise LowbitError(
        f"no Hadamard construction of order {n}: supported orders are m*2^k for m in {SUPPORTED_M} "
        f"(e.g. 64, 128, 192, 256, 576); pick a head_dim/group of such a size or use rotation 'none'"
    )


def is_supported_order(n: int) -> bool:
    """True when `hadamard(n)` has a construction."""
    try:
        factor_order(n)
    except LowbitError:
        return False
    return True


@lru_cache(maxsize=32)  # bounded: an order-16384 matrix in float64 is 2 GiB
def _normalized_cpu64(n: int) -> torch.Tensor:
    """Cached normalized matrix, float64 on CPU [n, n]. Never handed out directly (callers get a copy)."""
    m, k = factor_order(n)
    H = torch.kron(_sylvester(k), _base(m)).to(torch.float64)
    return H / math.sqrt(n)


def hadamard(n: int, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> torch.Tensor:
    """Normalized Hadamard matrix of order n: [n, n], entries +-1/sqrt(n), H @ H.T = I.

    n = m * 2**k with m in SUPPORTED_M, else LowbitError. Layout: H = kron(H_{2**k}, H_m) / sqrt(n),
    so for x [..., n] viewed as [..., 2**k, m], x @ H == fwht over the 2**k axis then @ H_m/sqrt(m).
    For m == 1 this is exactly the Sylvester matrix that `fwht` applies. Built once per n (float64,
    cached), returned as a fresh tensor in `dtype` on `device` so callers may modify it.
    """
    if not (dtype.is_floating_point or dtype.is_complex):
        raise LowbitError(f"hadamard() needs a floating dtype (entries are +-1/sqrt(n)), got {dtype}")
    return _normalized_cpu64(n).to(dtype=dtype, device=device, copy=True)


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Fast normalized Walsh-Hadamard transform along the last dim: x [..., D] -> x @ hadamard(D) [..., D].

    D must be a power of two (1 allowed). O(D log D) per row instead of O(D^2). Half-precision
    inputs are transformed in float32 and returned in their own dtype (log2(D) rounding steps
    in bf16 would cost more error than the one final rounding).
    """
    if not x.dtype.is_floating_point:
        raise LowbitError(f"fwht() needs a floating tensor, got {x.dtype}")
    if x.dim() == 0:
        raise LowbitError("fwht() needs a tensor with at least one dim (the one to transform)")
    n = x.shape[-1]
    if n < 1 or n & (n - 1):
        raise LowbitError(
            f"fwht() needs a power-of-two last dim, got {n}; use x @ hadamard({n}) for other supported orders"
        )
    work_dtype = torch.float32 if x.element_size() < 4 else x.dtype
    y = x.reshape(-1, n).to(work_dtype).contiguous()  # [rows, n]
    rows = y.shape[0]
    h = 1
    while h < n:
        # Butterfly on index bit log2(h): element (block, s, r) with s in {0, 1} pairs with its partner.
        y = y.view(rows, n // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    y = y.reshape(x.shape) * (1.0 / math.sqrt(n))
    return y.to(x.dtype)

