"""`lowbit quantize`: GPTQ / RTN / SignRound weight quantization -> a compressed-tensors checkpoint (lowbit artifact).

    lowbit quantize --model smollm2-135m --scheme w4a16-g64 --method gptq --rotate \\
        --calib stdlib --calib-tokens 65536 --out out/smollm2-w4a16-g64
    lowbit quantize --model smollm2-135m --scheme w8a8 --method gptq --smooth 0.5 --out out/smollm2-w8a8-sq
    lowbit quantize --model smollm2-135m --scheme w4a16-g32-asym --method signround --rotate --tune-scales 300 \\
        --device cuda --out out/smollm2-w4a16-g32-sr-tuned     # the best W4A16 measured (+8.95% PPL, H200)
    lowbit quantize --model smollm2-135m --scheme w8a8 --method rtn --rotate --smooth 0.5 --tune-scales 300 \\
        --out out/smollm2-w8a8-tuned                           # the best W8A8 measured (+0.23% PPL, H200)
"""

from __future__ import annotations

import argparse
import logging
import os
import time

from lowbit.core.errors import LowbitError
from lowbit.core.flags import add_dtype, deprecated, torch_dtype

NAME = "quantize"
HELP = ("quantize a model's linear weights (GPTQ, RTN or SignRound, optionally end-to-end scale tuning) and write a "
        "compressed-tensors checkpoint")

DEFAULT_CALIB_TOKENS = 128 * 512
DEFAULT_SEQ_LEN = 512


def add_arguments(p) -> None:
    p.add_argument("--model", required=True, help="built-in name (smollm2-135m, gemma3-270m) or a local HF dir; "
                                                  "or a diffusers pipeline directory with --component")
    p.add_argument("--component", default=None,
                   help="diffusers pipelines: the component to quantize (transformer: the DiT; RTN or GPTQ "
                        "calibrated on its own linear inputs while sampling); the rest is copied unchanged")
    p.add_argument("--scheme", default=None,
                   help="weight scheme: w4a16-g128 | w4a16-g64 | w4a16-g64-asym | w8a16 | w8a8 | w4a8 "
                        "(| w4a8-g64, w4a16-gN[-asym]); required")
    p.add_argument("--weights", dest="scheme", action=deprecated("--scheme"), help=argparse.SUPPRESS)
    p.add_argument("--method", choices=("gptq", "rtn", "signround"), default="gptq",
                   help="GPTQ (default), round-to-nearest, or SignRound (each layer's rounding and group ranges "
                        "tuned by signed gradient descent on its output; the most accurate, and the slowest: "
                        "~1 min per decoder layer on 2 CPU cores at 200 iters, seconds on a GPU)")
    p.add_argument("--iters", type=int, default=None, help="SignRound steps per decoder layer (default 200)")
    p.add_argument("--lr", type=float, default=None, help="SignRound step size at the start (default 1 / iters)")
    p.add_argument("--tune-scales", type=int, default=None, metavar="STEPS",
                   help="after the method, tune every group's scale end to end for STEPS Adam steps so the "
                        "quantized model's next-token distribution matches the unquantized one's on the calibration "
                        "text (KL; codes unchanged; 1/8 of the sequences held out, the tuning kept only if their KL "
                        "drops). 300: what the published rows used; ~6 s per step on 2 CPU cores for smollm2-135m, ~0.15 s "
                        "on an H200")
    p.add_argument("--tune-lr", type=float, default=None, help="scale tuning's Adam step size (default 1e-3)")
    p.add_argument("--device", default="cpu",
                   help="where calibration and the quantizer run: cpu (default) | cuda; the checkpoint is "
                        "written from the CPU")
    p.add_argument("--rotate", action="store_true",
                   help="fold a Hadamard rotation of the residual stream and V/O heads into the weights first")
    p.add_argument("--smooth", type=_alpha, default=None, metavar="ALPHA|auto",
                   help="SmoothQuant with migration strength ALPHA in (0, 1) (0.5 usual), or 'auto' (per layer and "
                        "mapping, the alpha whose quantized outputs best match on calibration inputs), before "
                        "quantizing; folded into the norms / v_proj / up_proj so the checkpoint stays plain (for "
                        "w8a8 / w4a8); calibrates on --calib whatever the method")
    p.add_argument("--calib", default="stdlib", help="GPTQ calibration text: stdlib (default) | wikitext2 | PATH")
    p.add_argument("--calib-tokens", type=int, default=DEFAULT_CALIB_TOKENS,
                   help=f"calibration tokens, a multiple of --calib-seq-len (default {DEFAULT_CALIB_TOKENS})")
    p.add_argument("--calib-seq-len", type=int, default=DEFAULT_SEQ_LEN, help=f"tokens per sequence (default {DEFAULT_SEQ_LEN})")
    p.add_argument("--calib-dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                   help="dtype of the calibration forwards (autocast bfloat16, or float32). Default auto: bfloat16 "
                        "on CUDA and on CPUs with native bf16 (avx512_bf16 / amx_bf16; what the published rows used), "
                        "float32 on other CPUs, where bf16 autocast ran GPTQ of smollm2-135m at ~2 min a layer. "
                        "Hessians and weights stay float32")
    p.add_argument("--damp", type=float, default=0.01, help="GPTQ dampening, fraction of mean diag(H) (default 0.01)")
    p.add_argument("--block", type=int, default=128, help="GPTQ block size (default 128)")
    p.add_argument("--no-act-order", action="store_true", help="visit columns in order instead of by diag(H)")
    p.add_argument("--clip-search", action="store_true",
                   help="per-group MSE clip search for the grids (off by default: on smollm2-135m, whose weights "
                        "were already 4-bit, it raised W4A16-g64 RTN from +30.7%% to +44.5%% PPL)")
    p.add_argument("--no-sequential", action="store_true",
                   help="calibrate every layer on unquantized inputs (one pass per layer instead of two)")
    p.add_argument("--ignore", action="append", default=None,
                   help="linear names (or re:REGEX) kept in full precision (default: lm_head; a DiT: proj_out_2; 'none': quantize every linear); repeatable")
    add_dtype(p, default="fp32", help="dtype of the checkpoint's float tensors")
    p.add_argument("--out", required=True, help="new output directory (never overwritten)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (one log line per decoder layer instead; also when stderr is not a terminal)")


def _device(name: str):
    from lowbit.core.device import resolve_device

    return resolve_device(name)


def _alpha(text: str):
    """--smooth's value: 'auto' or a float (range checked in run, to give lowbit's one-line error)."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return float(text)
    except ValueError:
        import argparse

        raise argparse.ArgumentTypeError(f"expected a number in (0, 1) or 'auto', got {text!r}") from None


def run(args) -> int:
    from lowbit.calib.corpora import load_text, token_windows
    from lowbit.runtime.load import resolve
    from lowbit.weights.apply import is_ignored, quantize_model
    from lowbit.weights.arch import default_ignore, vision_tower
    from lowbit.weights.export import save_compressed
    from lowbit.weights.scheme import parse_weight_scheme

    if args.scheme is None:
        raise LowbitError("--scheme is required: the weight scheme to write, e.g. --scheme w4a16-g128")
    scheme = parse_weight_scheme(args.scheme)
    if os.path.lexists(args.out):
        raise LowbitError(f"{args.out} already exists; checkpoints are never overwritten: choose a new --out")
    if args.smooth not in (None, "auto") and not (0 < args.smooth < 1):
        raise LowbitError(f"--smooth {args.smooth}: the migration strength must be in (0, 1); 0.5 is the usual value")
    if not (0 < args.damp < 10):
        raise LowbitError(f"--damp {args.damp} is outside (0, 10); the usual value is 0.01")
    if args.block < 1:
        raise LowbitError(f"--block must be >= 1, got {args.block}")
    if args.method != "signround" and (args.iters is not None or args.lr is not None):
        raise LowbitError(f"--iters / --lr are SignRound settings; add --method signround (got --method {args.method})")
    if args.tune_scales is None and args.tune_lr is not None:
        raise LowbitError("--tune-lr is a scale tuning setting; add --tune-scales STEPS")
    tune = None
    if args.tune_scales is not None:
        from lowbit.weights.tune_scales import ScaleTuneConfig

        tune = ScaleTuneConfig(steps=args.tune_scales, **({} if args.tune_lr is None else {"lr": args.tune_lr}))
    signround = None
    if args.method == "signround":
        from lowbit.weights.signround import SignRoundConfig

        signround = SignRoundConfig(iters=200 if args.iters is None else args.iters, lr=args.lr)
    if args.component is not None or os.path.isfile(os.path.join(args.model, "model_index.json")):
        return _run_diffusers(args, scheme)
    import torch

    device = _device(args.device)
    dtype = torch_dtype(args.dtype)
    calib_dtype, calib_why = args.calib_dtype, "--calib-dtype"
    if calib_dtype == "auto":
        from lowbit.core.device import default_dtype

        name, calib_why = default_dtype(device.type)
        calib_dtype = {"bf16": "bfloat16", "fp32": "float32"}[name]
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    t0 = time.perf_counter()
    lm = resolve(args.model, dtype=torch.float32)
    if lm.provenance.get("source") == "quantized-checkpoint":
        raise LowbitError(f"--model {args.model} is already a quantized checkpoint; quantize the unquantized model")
    tower = vision_tower(lm.model)  # a VLM: its decoder is quantized, its vision tower kept unquantized by design
    ignore = list(args.ignore) if args.ignore else default_ignore(lm.model)
    if tower is not None and not all(is_ignored(n, ignore) for n in _linears(lm.model, tower)):
        raise LowbitError(f"--ignore {' '.join(ignore)} leaves {tower} (the vision tower) to be quantized; lowbit "
                          f"quantizes a VLM's decoder only: add --ignore '{default_ignore(lm.model)[-1]}' or drop --ignore")
    calib, calib_info = None, None
    if args.method != "rtn" or args.smooth is not None or tune is not None:
        if args.calib_seq_len < 1 or args.calib_tokens < 1 or args.calib_tokens % args.calib_seq_len:
            raise LowbitError(f"--calib-tokens {args.calib_tokens} is not a positive multiple of --calib-seq-len "
                              f"{args.calib_seq_len}")
        n = args.calib_tokens // args.calib_seq_len
        # said before tokenizing and the first forward: GPTQ was silent for its first ~30 s
        print(f"calibrating in {calib_dtype} ({calib_why}) on {device.type}: {n} x {args.calib_seq_len} tokens of "
              f"{args.calib}", flush=True)
        calib = token_windows(lm.tokenizer, load_text(args.calib), args.calib_seq_len, n)
        calib_info = {"corpus": str(args.calib), "sequences": n, "seq_len": args.calib_seq_len,
                      "tokens": int(calib.numel())}
    lm.model.to(device)
    report = quantize_model(
        lm.model, scheme, method=args.method, calib=None if calib is None else calib.to(device), rotate=args.rotate,
        ignore=ignore, damp=args.damp, block=args.block, act_order=not args.no_act_order,
        clip_search=args.clip_search, sequential=not args.no_sequential, scale_dtype=dtype, smooth=args.smooth,
        signround=signround, tune=tune, calib_dtype=torch.bfloat16 if calib_dtype == "bfloat16" else None,
        progress=False if args.no_progress else None,  # None: a bar with ETA when stderr is a terminal
    )
    lm.model.to("cpu")
    recipe = {
        "scheme": scheme.to_dict(), "method": args.method, "rotation": report.rotation,
        "smoothing": report.smoothing, "ignore": ignore,
        "gptq": None if args.method != "gptq" else {
            "damp": args.damp, "block": args.block, "act_order": "static" if not args.no_act_order else None,
            "sequential": not args.no_sequential,
        },
        "signround": None if signround is None else {
            **signround.to_dict(), "step_size": signround.step_size,
            "layers": {str(i): st for i, st in report.signround.items()},
        },
        "scale_tuning": report.scale_tuning,
        "clip_search": args.clip_search, "dtype": args.dtype, "calib_dtype": calib_dtype,
        "format": scheme.ct_format,
    }
    inputs = {"model": lm.name, "weights_sha256": lm.weights_sha256, "calibration": calib_info}
    counts = report.counts()
    counts.update(quantized_modules=counts["quantized_linears"], skipped=counts["skipped_linears"],
                  quantize_seconds=round(report.seconds, 1), ignore=ignore, ignored=sorted(report.ignored))
    if tower is not None:
        tower_linears = _linears(lm.model, tower)
        counts["kept_unquantized"] = {tower: {
            "what": "vision tower", "linears": len(tower_linears),
            "ignored_by": [p for p in ignore if any(is_ignored(n, [p]) for n in tower_linears)],
            "dtype": args.dtype, "why": "by design: lowbit quantizes the decoder only (W4A8 / KV8 serve the "
                                        "decoder); the tower's weights are written unquantized"}}
    save_compressed(lm.model, lm.tokenizer, scheme, args.out, inputs=inputs, recipe=recipe, counts=counts,
                    ignore=ignore, dtype=dtype)
    raised = f", damp raised on {len(report.damp_raised)}" if report.damp_raised else ""
    st = report.scale_tuning
    if st is not None:
        raised += (f"; scale tuning: holdout KL {st['kl_holdout_before']:.4g} -> {st['kl_holdout_after']:.4g}"
                   f"{'' if st['kept'] else ' (not lower: not kept)'}")
    kept = "" if tower is None else f" (vision tower {tower}: {counts['kept_unquantized'][tower]['linears']} kept)"
    print(f"{lm.name} {scheme.name} {args.method}{' +rotate' if args.rotate else ''}"
          f"{f' +smooth {args.smooth}' if args.smooth is not None else ''}: {counts['layers']} layers, "
          f"{counts['quantized_linears']} linears quantized, {counts['ignored_linears']} ignored{kept}, "
          f"0 skipped{raised}; {'calibrated in ' + calib_dtype + '; ' if calib is not None else ''}"
          f"quantize {report.seconds:.1f}s, total {time.perf_counter() - t0:.1f}s -> {args.out}")
    return 0


def _linears(model, prefix: str) -> list[str]:
    """Names of the nn.Linear modules under `prefix` (a dotted module path)."""
    import torch

    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.startswith(prefix + ".")]


def _run_diffusers(args, scheme) -> int:
    """`--model DIFFUSERS_DIR --component transformer`: lowbit.diffusion.quantize.quantize_pipeline."""
    from lowbit.diffusion.quantize import DEFAULT_IGNORE, quantize_pipeline

    if args.component is None:
        raise LowbitError(f"{args.model} is a diffusers pipeline: name the component to quantize, e.g. "
                          "--component transformer")
    if args.method not in ("rtn", "gptq"):
        raise LowbitError(f"--method {args.method}: diffusion transformers take --method rtn or gptq")
    if args.rotate or args.smooth is not None or args.tune_scales is not None:
        raise LowbitError("--rotate / --smooth / --tune-scales are causal-LM options; a DiT takes --method rtn|gptq")
    if args.device != "cpu":
        raise LowbitError("diffusion transformers are quantized on the CPU (--device cpu); they are small")
    ignore = [] if args.ignore == ["none"] else (list(args.ignore) if args.ignore else list(DEFAULT_IGNORE))
    t0 = time.perf_counter()
    m = quantize_pipeline(args.model, args.out, component=args.component, scheme=scheme, method=args.method,
                          ignore=ignore, damp=args.damp, block=args.block, act_order=not args.no_act_order,
                          clip_search=args.clip_search, dtype=torch_dtype(args.dtype))
    c = m["counts"]
    print(f"{args.model} {args.component} {scheme.name} {args.method}: {c['quantized_linears']} of {c['linears']} "
          f"linears quantized, {c['ignored_linears']} ignored ({', '.join(c['ignored']) or 'none'}), "
          f"{c['skipped_linears']} skipped; weights {c['source_weight_bytes']} -> {c['weight_bytes']} bytes; "
          f"{time.perf_counter() - t0:.1f}s -> {args.out}")
    return 0
