"""Fit KV rotations from calibration statistics: covariance eigenvectors x normalized Hadamard (x bit reversal).

For a covariance C [D, D] (descending eigenpairs C = E diag(λ) Eᵀ) the fitted rotation is

    R = E @ H @ P        [D, D], orthogonal; stored K is k @ R (row vectors), q is rotated the same way

E decorrelates the channels (k @ E are principal coordinates, highest variance first), the
normalized Hadamard H then spreads every principal coordinate over all channels with equal weight
(|H_ij| = 1/sqrt(D)), so each stored channel carries the same variance and no channel outlier is
left for a min/max group to waste its range on. P, optional, permutes the columns by bit reversal
of the index, which interleaves the Hadamard's Sylvester blocks across groups smaller than D.
With mix="none" the rotation is E alone (principal components): the right basis when keys are
grouped per channel over tokens, where spreading outliers across channels is what hurts.

Kinds:
    hadamard   R = H for every layer (no calibration needed; format v1)
    per-layer  one R per layer from the covariance summed over the layer's KV heads (format v1, [D, D])
    per-head   one R per KV head (format v2, [H_kv, D, D])
An MLA latent layer (DeepseekV3 cached as c_kv + k_pe) is fitted per layer on the latent c_kv (V, 512 wide);
its K rotation is the identity (K is rebuilt from the stored V; its k_pe part is held dense).
Objectives: "kk" fits K to KᵀK and V to VᵀV; "qq" fits K to the query second moment of its group
(directions where the queries look are where a key error moves the logits) and V to the
attention-weighted VᵀV.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from lowbit.core.errors import LowbitError
from lowbit.core.progress import bar

if TYPE_CHECKING:
    import torch
# torch (and the Hadamard module) are imported inside the functions: `lowbit fit-rotations`' parser reads
# KINDS / OBJECTIVES / MIXES, and a mistyped flag must not wait for torch

KINDS = ("hadamard", "per-layer", "per-head")
OBJECTIVES = ("kk", "qq")
MIXES = ("hadamard", "none")
ORTHO_TOL = 1e-4


def bit_reversal_permutation(n: int) -> torch.Tensor:
    """perm [n] with perm[j] = j with its log2(n) index bits reversed. n must be a power of two."""
    import torch

    if n < 1 or n & (n - 1):
        raise LowbitError(f"bit reversal needs a power-of-two head_dim, got {n}: drop --bit-reversal")
    bits = n.bit_length() - 1
    idx = torch.arange(n)
    rev = torch.zeros(n, dtype=torch.long)
    for b in range(bits):
        rev |= ((idx >> b) & 1) << (bits - 1 - b)
    return rev


def eigvecs_descending(cov: torch.Tensor) -> torch.Tensor:
    """Eigenvectors of symmetric cov [..., D, D] as columns, by descending eigenvalue. float64 [..., D, D].

    Signs are fixed (largest-magnitude entry of each column positive) so the same statistics always
    give the same rotation bytes.
    """
    import torch

    c = cov.to(torch.float64)
    c = 0.5 * (c + c.transpose(-1, -2))
    _, vecs = torch.linalg.eigh(c)  # ascending
    vecs = vecs.flip(-1)
    pivot = vecs.abs().argmax(dim=-2, keepdim=True)  # [..., 1, D]
    sign = torch.gather(vecs, -2, pivot).sign()
    sign[sign == 0] = 1
    return vecs * sign


def rotation_from_cov(cov: torch.Tensor, *, mix: str = "hadamard", bit_reversal: bool = False) -> torch.Tensor:
    """R = E @ H @ P for cov [..., D, D] -> float64 [..., D, D] (see module docstring)."""
    import torch

    from lowbit.rotation.hadamard import hadamard

    if mix not in MIXES:
        raise LowbitError(f"unknown mix {mix!r}: use one of {MIXES}")
    D = cov.shape[-1]
    R = eigvecs_descending(cov)
    if mix == "hadamard":
        R = R @ hadamard(D, dtype=torch.float64)
    if bit_reversal:
        R = R[..., bit_reversal_permutation(D)]
    return R


def check_orthogonal(R: torch.Tensor, what: str, tol: float = ORTHO_TOL) -> None:
    """Raise unless R [..., D, D] is orthogonal to within tol (max |RᵀR - I|) and finite."""
    import torch

    if R.shape[-1] != R.shape[-2]:
        raise LowbitError(f"{what}: rotation must be square, got {tuple(R.shape)}")
    if not torch.isfinite(R).all():
        raise LowbitError(f"{what}: rotation has non-finite entries")
    R64 = R.to(torch.float64)
    eye = torch.eye(R.shape[-1], dtype=torch.float64)
    err = (R64.transpose(-1, -2) @ R64 - eye).abs().max().item()
    if err > tol:
        raise LowbitError(f"{what}: rotation is not orthogonal (max |RᵀR - I| = {err:.2e} > {tol:g})")


@dataclass
class FittedLayer:
    """One layer's rotations: k [D_k, D_k] or [H_kv, D_k, D_k]; v likewise with D_v."""

    index: int
    k: torch.Tensor
    v: torch.Tensor


def fit_layer(st, kind: str, objective: str = "kk", *, mix: str = "hadamard", bit_reversal: bool = False,
              center: bool = False, latent: bool = False) -> FittedLayer:
    """Fit one layer from its LayerStats `st`. Returns float32 rotations (v1 [D,D] or v2 [H,D,D]).

    center: fit K/V to their covariance about the calibration mean (objective kk), for caches that
    store mean-centred K/V.
    latent: the layer caches an MLA latent (statistics of K = [c_kv | k_pe], V = c_kv; lowbit.calib.mla):
    V's rotation is the latent's (fitted); K is rebuilt from V plus its dense k_pe and takes no rotation
    of its own, so K's is the identity. One latent head: a per-head kind is refused.
    """
    import torch

    try:
        if latent and kind == "per-head":
            raise LowbitError("it caches an MLA latent, one head shared by all query heads: a per-KV-head rotation "
                              "does not apply; use --kind per-layer (one rotation of the latent per layer)")
        fl = _fit_layer(st, kind, objective, mix=mix, bit_reversal=bit_reversal, center=center)
        if latent and kind == "per-layer":
            fl.k = torch.eye(st.head_dim_k)
        return fl
    except LowbitError as e:
        raise LowbitError(f"layer {st.index} (head_dim K {st.head_dim_k} / V {st.head_dim_v}): {e}") from None


def _fit_layer(st, kind: str, objective: str, *, mix: str, bit_reversal: bool, center: bool) -> FittedLayer:
    import torch

    from lowbit.rotation.hadamard import hadamard

    if kind not in KINDS:
        raise LowbitError(f"unknown rotation kind {kind!r}: use one of {KINDS}")
    if objective not in OBJECTIVES:
        raise LowbitError(f"unknown objective {objective!r}: use one of {OBJECTIVES}")
    if kind == "hadamard":
        rk = hadamard(st.head_dim_k, dtype=torch.float64)
        rv = hadamard(st.head_dim_v, dtype=torch.float64)
        if bit_reversal:
            rk = rk[:, bit_reversal_permutation(st.head_dim_k)]
            rv = rv[:, bit_reversal_permutation(st.head_dim_v)]
    else:
        ck = st.cov("kk", center) if objective == "kk" else st.cov("qq")  # [H, Dk, Dk]
        cv = st.cov("vv", center) if objective == "kk" else st.cov("pv")  # [H, Dv, Dv]
        if kind == "per-layer":
            ck, cv = ck.mean(0), cv.mean(0)
        rk = rotation_from_cov(ck, mix=mix, bit_reversal=bit_reversal)
        rv = rotation_from_cov(cv, mix=mix, bit_reversal=bit_reversal)
    fl = FittedLayer(st.index, rk.float().contiguous(), rv.float().contiguous())
    check_orthogonal(fl.k, f"layer {st.index} K")
    check_orthogonal(fl.v, f"layer {st.index} V")
    return fl


def fit_rotations(calib, kind: str, objective: str = "kk", *, mix: str = "hadamard", bit_reversal: bool = False,
                  center: bool = False, progress: bool | None = False) -> list[FittedLayer]:
    """Fit every layer of a loaded Calibration, in global layer order.
    progress: a bar over layers with ETA (lowbit.core.progress; None: when stderr is a terminal)."""
    latent = {d["index"] for d in calib.meta.get("geometry") or [] if d.get("storage") == "mla-latent"}
    out = []
    with bar(len(calib.layers), f"fit {kind}", "layer", progress) as pb:
        for i in sorted(calib.layers):
            out.append(fit_layer(calib.layers[i], kind, objective, mix=mix, bit_reversal=bit_reversal, center=center,
                                 latent=i in latent))
            pb.update(1)
    return out
