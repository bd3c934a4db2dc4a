"""`lowbit fit-rotations`: KV rotations (Hadamard, per-layer or per-KV-head fitted) from a calibration artifact."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from lowbit.errors import LowbitError

NAME = "fit-rotations"
HELP = "fit K/V rotations (covariance eigenvectors x Hadamard) per layer or per KV head from a calibration"


def add_arguments(p) -> None:
    from lowbit.rotation.fit import KINDS, MIXES, OBJECTIVES

    p.add_argument("--calib", required=True, help="calibration artifact directory (from `lowbit calibrate`)")
    p.add_argument("--kind", required=True, choices=KINDS, help="hadamard (v1), per-layer (v1 [D,D]) or per-head (v2 [H_kv,D,D])")
    p.add_argument("--objective", default="kk", choices=OBJECTIVES,
                   help="kk: K to KᵀK, V to VᵀV; qq: K to the group's QᵀQ, V to the attention-weighted VᵀV (default kk)")
    p.add_argument("--mix", default="hadamard",
                   help=f"after the eigenvectors, one of {MIXES} for both or K,V (e.g. none,hadamard): hadamard "
                        "spreads over channels (per-token groups), none keeps principal components (per-channel "
                        "key groups) (default hadamard)")
    p.add_argument("--bit-reversal", action="store_true", help="permute the rotated channels by bit reversal")
    p.add_argument("--center", action="store_true", help="fit to the covariance about the calibration mean (kk objective)")
    p.add_argument("--model", default=None, help="check the calibration was made on this model (name and weights sha256)")
    p.add_argument("--out", required=True, help="new rotation-set directory")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's choice; 1 is faster on a machine shared with other jobs)")


def check_model(calib, model: str) -> None:
    """Refuse a calibration made on another model (name, then weights sha256)."""
    from lowbit.models import load

    lm = load(model)
    if calib.model != lm.name or (calib.weights_sha256 and calib.weights_sha256 != lm.weights_sha256):
        raise LowbitError(
            f"calibration {calib.path} was made on model {calib.model!r} (weights sha256 {str(calib.weights_sha256)[:12]}), "
            f"not {lm.name!r} ({lm.weights_sha256[:12]}): calibrate this model first"
        )


def fit_and_save(calib, out: Path, *, kind: str, objective: str = "kk", mix: str = "hadamard",
                 bit_reversal: bool = False, center: bool = False) -> Path:
    """Fit every layer of `calib` and write a RotationSet artifact at `out` (nothing is left on error)."""
    from lowbit.artifacts import sha256_file
    from lowbit.rotation.fit import MIXES, fit_rotations
    from lowbit.rotation.rotation_set import RotationSet

    mixes = [m.strip() for m in mix.split(",")]
    if len(mixes) == 1:
        mixes *= 2
    if len(mixes) != 2 or any(m not in MIXES for m in mixes):
        raise LowbitError(f"--mix {mix!r}: give one of {MIXES} or two as K,V")
    fitted = fit_rotations(calib, kind, objective, mix=mixes[0], bit_reversal=bit_reversal, center=center)
    if mixes[1] != mixes[0]:
        fv = fit_rotations(calib, kind, objective, mix=mixes[1], bit_reversal=bit_reversal, center=center)
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


def run(args) -> int:
    if args.threads is not None:
        if args.threads < 1:
            raise LowbitError(f"--threads {args.threads}: give 1 or more")
        torch.set_num_threads(args.threads)
    from lowbit.calib.stats import load_calibration

    out = Path(args.out)
    if out.exists():
        raise LowbitError(f"{out} already exists; artifacts are never overwritten: choose a new --out")
    t0 = time.time()
    calib = load_calibration(args.calib)
    if args.model:
        check_model(calib, args.model)
    fit_and_save(calib, out, kind=args.kind, objective=args.objective, mix=args.mix, bit_reversal=args.bit_reversal,
                 center=args.center)
    print(f"{args.kind} rotations ({args.objective}, mix {args.mix}{', bit-reversal' if args.bit_reversal else ''}) "
          f"for {calib.model}, {len(calib.layers)} layers, {time.time() - t0:.1f} s -> {out}")
    return 0
