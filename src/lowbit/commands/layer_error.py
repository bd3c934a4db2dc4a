"""`lowbit layer-error`: per-layer attention-output error (dB) of rotation kinds vs the exact cache, table + heatmap."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from lowbit.core.errors import LowbitError

NAME = "layer-error"
HELP = "per-layer attention-output error (dB) of each rotation (none, hadamard, fitted dirs) on held-out text"


def add_arguments(p) -> None:
    p.add_argument("--model", required=True, help="built-in name (smollm2-135m, gemma3-270m) or a local HF directory")
    p.add_argument("--kv", default="int2", help="KV scheme: int2, int4, k4v2, kivi2, ... (default int2)")
    p.add_argument("--rotations", default="none,hadamard", help="comma list of none | hadamard | rotation-set dirs")
    p.add_argument("--data", default="wikitext2", help="held-out text: wikitext2 | stdlib | PATH (default wikitext2)")
    p.add_argument("--windows", type=int, default=2, help="consecutive windows of --data to measure on (default 2)")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per window (default 1024)")
    p.add_argument("--group", type=int, default=None,
                   help="channels per scale/zero group (token axis; default 128 or head_dim if smaller), or tokens "
                        "per key block (channel axis, KIVI)")
    p.add_argument("--sink", type=int, default=None,
                   help="first tokens kept in the model dtype, never quantized (default 64; a multiple of --page)")
    p.add_argument("--recent", type=int, default=None,
                   help="last tokens kept in the model dtype (default 256; a multiple of --page); --seq-len must "
                        "exceed sink + recent for anything to be quantized")
    p.add_argument("--page", type=int, default=None,
                   help="tokens moved from the recent ring to the quantized middle at a time (default 16)")
    p.add_argument("--clip", default=None,
                   help="clip ratio of the quantization range, one for both or K,V (e.g. 0.96,0.92; default 1)")
    p.add_argument("--k-axis", choices=("token", "channel"), default=None,
                   help="group keys per token or per channel over page-token blocks (KIVI)")
    p.add_argument("--lloyd-max", action="store_true", help="Lloyd-Max levels (Gaussian-optimal unless --levels-from)")
    p.add_argument("--levels-from", default=None, help="calibration dir: fit Lloyd-Max levels per layer on its sample")
    p.add_argument("--ppl", action="store_true", help="also the full-window fake-quant perplexity of every variant "
                   "(errors compounding through the layers) and of the exact model")
    p.add_argument("--out", default=None, help="new directory for table.md, layer_error.json, heatmap.png")


def build_scheme(args):
    from lowbit.kv.scheme import parse_kv_scheme

    s = parse_kv_scheme(args.kv, group=args.group, sink=args.sink, recent=args.recent, clip=args.clip,
                        lloyd_max=args.lloyd_max, page=args.page)
    if args.k_axis == "channel" and s.k.axis != "channel":
        s = replace(s, k=replace(s.k, axis="channel", group=None))
    elif args.k_axis == "token" and s.k.axis != "token":
        s = replace(s, k=replace(s.k, axis="token", group=args.group))
    return s


def _variant_rotations(spec: str, geometry) -> tuple[str, dict]:
    """(name, layer -> (R_k, R_v)) for 'none' | 'hadamard' | a RotationSet dir, resolved by the plan's loader."""
    from lowbit.kv.plan import load_rotations
    from lowbit.kv.scheme import RotationRef

    rot = spec if spec in ("none", "hadamard") else RotationRef(spec)
    r = load_rotations(rot, geometry)
    name = spec if spec in ("none", "hadamard") else Path(spec).name
    return name, {g.index: r.per_layer[g.index] for g in geometry.layers}


def run(args) -> int:
    from lowbit.calib.corpora import load_text, token_windows
    from lowbit.calib.levels import fitted_levels
    from lowbit.eval.layer_error import Variant, fake_quant_ppl, format_table, heatmap, measure_layers
    from lowbit.eval.perplexity import full_window_ppl
    from lowbit.runtime.load import resolve

    out = Path(args.out) if args.out else None
    if out is not None and out.exists():
        raise LowbitError(f"{out} already exists; choose a new --out")
    scheme = build_scheme(args)
    lm = resolve(args.model)
    scheme.validate(lm.geometry)
    if args.seq_len <= scheme.sink + scheme.recent:
        raise LowbitError(f"--seq-len {args.seq_len} leaves no quantized middle after sink {scheme.sink} + "
                          f"recent {scheme.recent}; use a longer window")
    calib = None
    if args.levels_from:
        from lowbit.calib.stats import load_calibration

        calib = load_calibration(args.levels_from)
        if calib.model != lm.name:
            raise LowbitError(f"--levels-from {args.levels_from} is a calibration of {calib.model!r}, not {lm.name!r}")
        if not args.lloyd_max:
            raise LowbitError("--levels-from fits Lloyd-Max levels: add --lloyd-max")
    variants = []
    for spec in [s.strip() for s in args.rotations.split(",") if s.strip()]:
        name, rot = _variant_rotations(spec, lm.geometry)
        levels = fitted_levels(calib, rot, scheme) if calib is not None else {}
        variants.append(Variant(name, scheme, rot, levels))
    windows = token_windows(lm.tokenizer, load_text(args.data), args.seq_len, args.windows)
    db = measure_layers(lm.model, windows, variants)
    ppl, ref = None, None
    if args.ppl:
        ref = full_window_ppl(lm.model, windows)
        ppl = {v.name: fake_quant_ppl(lm.model, windows, v)[0] for v in variants}
    title = f"{lm.name} {scheme.describe().rsplit(' | ', 1)[0]} | {args.data} {args.windows}x{args.seq_len}"
    table = format_table(db, ppl, ref)
    print(title)
    print(table)
    if ref:
        print(f"exact full-window PPL {ref:.3f}")
    if out is not None:
        from lowbit.artifacts import ArtifactWriter

        inputs = {"model": lm.name, "weights_sha256": lm.weights_sha256, "data": args.data,
                  "rotations": args.rotations, "levels_from": args.levels_from}
        recipe = {"kv": scheme.to_dict(), "windows": args.windows, "seq_len": args.seq_len}
        with ArtifactWriter(out, kind="layer-error", artifact_class="fake-quant-eval", inputs=inputs, recipe=recipe) as w:
            (w.path / "table.md").write_text(f"{title}\n\n{table}\n")
            doc = {"title": title, "db": {n: {str(i): v for i, v in d.items()} for n, d in db.items()},
                   "ppl": ppl, "ref_ppl": ref}
            (w.path / "layer_error.json").write_text(json.dumps(doc, indent=2) + "\n")
            heatmap(db, w.path / "heatmap.png", title)
            w.counts = {"layers": lm.geometry.num_layers, "variants": len(variants)}
        print(f"-> {out}")
    return 0
