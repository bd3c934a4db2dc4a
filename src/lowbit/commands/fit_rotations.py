"""`lowbit fit-rotations`: KV rotations (Hadamard, per-layer or per-KV-head fitted) from a calibration artifact."""

from __future__ import annotations

import time
from pathlib import Path

from lowbit.core.errors import LowbitError
from lowbit.rotation.fit_run import check_model, fit_and_save

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
    p.add_argument("--no-progress", action="store_true", help="no progress bar (none either when stderr is not a terminal)")
    # --threads: the global thread policy (lowbit.core.threads), added to every command by lowbit.cli


def run(args) -> int:
    if args.threads is not None:
        if args.threads < 1:
            raise LowbitError(f"--threads {args.threads}: give 1 or more")
        import torch

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
                 center=args.center, progress=False if args.no_progress else None)
    print(f"{args.kind} rotations ({args.objective}, mix {args.mix}{', bit-reversal' if args.bit_reversal else ''}) "
          f"for {calib.model}, {len(calib.layers)} layers, {time.time() - t0:.1f} s -> {out}")
    return 0
