"""Fit a calibration artifact's K/V rotations and write them as a RotationSet artifact.

    check_model(load_calibration(dir), "smollm2-135m")   # refuses another model's calibration
    fit_and_save(calib, Path("rot"), kind="per-head", objective="qq", mix="none,hadamard")

The math is lowbit.rotation.fit (fit_rotations); this is the step `lowbit fit-rotations` runs:
K and V mixes, the layer check, and the artifact with its inputs (calibration sha256, data).
"""

from __future__ import annotations

from pathlib import Path

import lowbit.models
from lowbit.artifacts import sha256_file
from lowbit.core.errors import LowbitError
from lowbit.rotation.fit import MIXES, fit_rotations


def check_model(calib, model: str) -> None:
    """Refuse a calibration made on another model (name, then weights sha256)."""
    lm = lowbit.models.resolve(model)
    if calib.model != lm.name or (calib.weights_sha256 and calib.weights_sha256 != lm.weights_sha256):
        raise LowbitError(
            f"calibration {calib.path} was made on model {calib.model!r} (weights sha256 {str(calib.weights_sha256)[:12]}), "
            f"not {lm.name!r} ({lm.weights_sha256[:12]}): calibrate this model first"
        )


def fit_and_save(calib, out: Path, *, kind: str, objective: str = "kk", mix: str = "hadamard",
                 bit_reversal: bool = False, center: bool = False, progress: bool | None = False) -> Path:
    """Fit every layer of `calib` and write a RotationSet artifact at `out` (nothing is left on error).
    progress: a bar over layers with ETA (None: when stderr is a terminal)."""
    from lowbit.rotation.rotation_set import RotationSet

    mixes = [m.strip() for m in mix.split(",")]
    if len(mixes) == 1:
        mixes *= 2
    if len(mixes) != 2 or any(m not in MIXES for m in mixes):
        raise LowbitError(f"--mix {mix!r}: give one of {MIXES} or two as K,V")
    fitted = fit_rotations(calib, kind, objective, mix=mixes[0], bit_reversal=bit_reversal, center=center,
                           progress=progress)
    if mixes[1] != mixes[0]:
        fv = fit_rotations(calib, kind, objective, mix=mixes[1], bit_reversal=bit_reversal, center=center,
                           progress=progress)
        for f, g in zip(fitted, fv):
            f.v = g.v
    idx = [f.index for f in fitted]
    if idx != list(range(len(idx))):
        raise LowbitError(f"calibration {calib.path} covers layers {idx[:5]}..., not 0..{len(idx) - 1}: recalibrate")
    if kind == "per-head":
        fk, fv = [f.k if f.k.dim() == 3 else f.k[None] for f in fitted], [f.v if f.v.dim() == 3 else f.v[None] for f in fitted]
    else:
        fk, fv = [f.k for f in fitted], [f.v for f in fitted]
    rs = RotationSet(model=calib.model, k=tuple(fk), v=tuple(fv))
    inputs = {
        "weights_sha256": calib.weights_sha256,
        "calibration_sha256": sha256_file(Path(calib.path) / "manifest.json"),
        "calibration_data": calib.meta.get("data"),
        "calibration_tokens": calib.meta.get("tokens"),
    }
    counts = {"kind": kind, "objective": objective, "mix": mix, "bit_reversal": bit_reversal, "center": center}
    return rs.save(out, inputs=inputs, counts=counts)
