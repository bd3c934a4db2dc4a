"""`lowbit tune`: per-layer, per-tensor KV bits within a held-bits budget, chosen by measured loss.

    lowbit tune --model gemma3-270m --budget 2.5 --context 32768 --out gemma3-270m@2.5.toml
    lowbit eval --model gemma3-270m --kv int2,kivi2 --recipe gemma3-270m@2.5.toml

See lowbit.eval.tune for the method. The budget is in held bits (lowbit.kv.held): bits per element of
the quantized tier averaged over what each layer holds at --context (default 32k, or the model's
context if smaller). Calibration defaults to the stdlib corpus, never the evaluation text.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from lowbit.core.errors import LowbitError

NAME = "tune"
HELP = "choose per-layer K/V bits within a held-bits budget by measured loss; writes a recipe TOML"


def add_arguments(p) -> None:
    p.add_argument("--model", required=True, help="built-in name or a local HF directory")
    p.add_argument("--budget", required=True,
                   help="held bits per element of the quantized tier (e.g. 2.5), or a comma list (2.5,3): one "
                        "recipe per budget from one measurement")
    p.add_argument("--context", type=int, default=None,
                   help="context (tokens) the held bits are counted at (default 32768, or the model's if smaller)")
    p.add_argument("--out", default=None, help="recipe TOML to write (one budget; default OUT_DIR/MODEL@BUDGET.toml)")
    p.add_argument("--out-dir", default=".", help="directory for MODEL@BUDGET.toml recipes (default .)")
    p.add_argument("--data", default="stdlib", help="calibration text: stdlib (default) | PATH (not the eval text)")
    p.add_argument("--windows", type=int, default=2, help="calibration windows (default 2)")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per calibration window (default 1024)")
    p.add_argument("--rotations", default="hadamard",
                   help="comma list of scheme-wide rotation candidates: hadamard, none, RotationSet or "
                        "key-affine (python -m lowbit.calib.key_affine) dirs (default hadamard)")
    p.add_argument("--grids", default="std,lloyd-max",
                   help="2-bit grid candidates: std, lloyd-max, scale-only (the std grid without a stored zero: "
                        "int2 at head_dim 64 costs 2.25 b/elt instead of 2.5; best after a key shift), scale-only-mse (the same "
                        "storage, each group's step searched for the least squared error when written), "
                        "scale-only-mse-ue5m3 (that with one-byte scales: int2 at head_dim 64 costs 2.125 b/elt), vq "
                        "(VQ 2x16 keys / 4x256 values with one-byte row scales; needs --codebooks) (default std,lloyd-max)")
    p.add_argument("--codebooks", default=None, metavar="DIR",
                   help="VQ codebooks for the vq grid: a levels artifact from `lowbit calibrate --vq-for` an all-VQ "
                        "recipe (K vq 2x16, V vq 4x256 on every layer) with the one --rotations value tune is given")
    p.add_argument("--sink", type=int, default=None, help="sink tokens kept in the model dtype (default 64)")
    p.add_argument("--recent", type=int, default=None, help="recent tokens kept in the model dtype (default 256)")
    p.add_argument("--page", type=int, default=None, help="page (default 16)")
    p.add_argument("--cache-dir", default=None, help="cache root for built-in models (default ~/.cache/lowbit)")


def _geometry(model: str):
    from lowbit.models import ModelGeometry, model_name
    from lowbit.models.registry import BUILTINS

    if model in BUILTINS:
        cfg = BUILTINS[model].config_dict()
    else:
        p = Path(model).expanduser() / "config.json"
        if not p.is_file():
            raise LowbitError(f"--model {model}: not a built-in and no config.json there")
        cfg = json.loads(p.read_text())
    return ModelGeometry.from_config(cfg, name=model_name(model))


def check(args):
    """Everything that needs no model: (geometry, context, rotations, grids, out). Raises LowbitError."""
    from lowbit.eval.runner import model_context
    from lowbit.eval.tune import GRIDS, smallest_held
    from lowbit.kv.held import DEFAULT_CONTEXT
    from lowbit.kv.scheme import LevelsRef, RotationRef, parse_kv_scheme

    try:
        budgets = [float(b) for b in str(args.budget).split(",") if b.strip()]
    except ValueError:
        raise LowbitError(f"--budget {args.budget!r}: give bits per element, e.g. 2.5 or 2.5,3") from None
    if not budgets or not all(b > 0 for b in budgets):
        raise LowbitError(f"--budget must be positive numbers of bits per element, got {args.budget}")
    ctx = model_context(args.model)
    context = args.context if args.context is not None else min(DEFAULT_CONTEXT, ctx or DEFAULT_CONTEXT)
    if context < 1:
        raise LowbitError(f"--context must be >= 1 token, got {context}")
    if ctx is not None and context > ctx:
        raise LowbitError(f"--context {context} is longer than the context of {args.model} ({ctx} tokens); "
                          f"use --context {ctx} or less")
    if args.windows < 1:
        raise LowbitError(f"--windows must be >= 1, got {args.windows}")
    geometry = _geometry(args.model)
    grids = [g.strip() for g in args.grids.split(",") if g.strip()]
    bad = [g for g in grids if g not in GRIDS]
    if bad or not grids:
        raise LowbitError(f"--grids {args.grids}: use a comma list of {', '.join(GRIDS)}")
    rotations = []
    for r in [r.strip() for r in args.rotations.split(",") if r.strip()]:
        if r not in ("none", "hadamard") and not Path(r).is_dir():
            raise LowbitError(f"--rotations {r}: not none, hadamard or a RotationSet directory")
        rotations.append(r if r in ("none", "hadamard") else RotationRef(r))
    if not rotations:
        raise LowbitError("--rotations is empty; give hadamard, none or RotationSet dirs")
    tiers = {"sink": args.sink, "recent": args.recent, "page": args.page}
    s = parse_kv_scheme("int2", **tiers)
    s.validate(geometry)
    if args.seq_len < s.sink + s.recent + s.page:
        raise LowbitError(f"--seq-len {args.seq_len} is shorter than sink {s.sink} + recent {s.recent} + page "
                          f"{s.page}: no calibration query would see a quantized middle; use a longer --seq-len")
    if ctx is not None and args.seq_len > ctx:
        raise LowbitError(f"--seq-len {args.seq_len} is longer than the context of {args.model} ({ctx} tokens)")
    codebooks = None
    if "vq" in grids:
        if not args.codebooks:
            raise LowbitError("--grids vq needs --codebooks DIR: fit them with `lowbit calibrate --vq-for` an all-VQ "
                              "recipe with the same rotation")
        if len(rotations) != 1:
            raise LowbitError("--grids vq takes one --rotations value: its codebooks were fitted under one rotation")
        codebooks = LevelsRef(str(args.codebooks))
    elif args.codebooks:
        raise LowbitError("--codebooks is for --grids vq; add vq to --grids or drop --codebooks")
    floor = smallest_held(geometry, context, rotations, grids, codebooks=codebooks, **tiers)
    for b in budgets:
        if b < floor - 1e-9:
            raise LowbitError(f"--budget {b:g} is below the smallest recipe's held bits ({floor:.3f} b/elt at "
                              f"{context} tokens, every K and V at 2 bits); use --budget {floor:.3f} or more")
    if args.out and len(budgets) > 1:
        raise LowbitError("--out names one recipe but --budget gives several; use --out-dir")
    outs = [Path(args.out)] if args.out else [Path(args.out_dir) / f"{geometry.name}@{b:g}.toml" for b in budgets]
    for out in outs:
        if out.exists():
            raise LowbitError(f"{out} already exists; give a new --out (recipes are never overwritten)")
        if out.suffix != ".toml":
            raise LowbitError(f"--out {out}: the recipe is TOML; give a path ending in .toml")
    return geometry, context, rotations, grids, tiers, list(zip(budgets, outs)), codebooks


def run(args) -> int:
    from lowbit.calib.corpora import load_text, token_windows
    from lowbit.eval.tune import choose, measure, recipe_toml
    from lowbit.runtime.load import resolve

    _, context, rotations, grids, tiers, jobs, codebooks = check(args)
    text = load_text(args.data)
    lm = resolve(args.model, cache_dir=args.cache_dir)
    calib = token_windows(lm.tokenizer, text, args.seq_len, args.windows)
    info = {"data": str(args.data), "windows": args.windows, "seq_len": args.seq_len}
    m = measure(lm, calib, rotations=rotations, grids=grids, codebooks=codebooks, **tiers)
    cmd = "lowbit " + " ".join(sys.argv[1:]) if sys.argv and sys.argv[0].endswith("lowbit") else ""
    for budget, out in jobs:
        res = choose(lm, m, budget=budget, context=context, calib_info=info)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".{out.name}.tmp")
        tmp.write_text(recipe_toml(res, command=cmd, out=out), encoding="utf-8")
        tmp.replace(out)
        b = res.best
        print(f"budget {budget:g}: {res.held.line()}")
        print(f"chose rotation {b.rotation}, 2-bit grid {b.grid}; calibration PPL {b.ppl:.3f} vs exact "
              f"{res.ref_ppl:.3f} ({100 * (b.ppl / res.ref_ppl - 1):+.2f}%); layers above 2 bits: "
              + (", ".join(f"{i}=k{a[0]}v{a[1]}" for i, a in sorted(b.assign.items()) if a != (2, 2)) or "none"))
        print(f"-> {out} ({res.seconds:.0f} s)")
    return 0
