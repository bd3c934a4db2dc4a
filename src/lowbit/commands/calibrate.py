"""`lowbit calibrate`: post-RoPE Q/K/V sufficient statistics per layer and KV head -> a calibration artifact."""

from __future__ import annotations

from pathlib import Path

from lowbit.calib.run import DEFAULT_SEQ_LEN, DEFAULT_SKIP, DEFAULT_TOKENS, calibrate
from lowbit.core.errors import LowbitError

NAME = "calibrate"
# the library: lowbit.calib.run (collect, calibrate, write_calibration, min_tokens, check_tokens_arg)
HELP = "capture post-RoPE Q/K/V statistics (KᵀK, VᵀV, QᵀQ per KV head) over N tokens into a calibration artifact"


def add_arguments(p) -> None:
    p.add_argument("--model", required=True, help="built-in name (smollm2-135m, gemma3-270m) or a local HF dir")
    p.add_argument("--data", default="stdlib", help="stdlib | wikitext2 | PATH to a text file (default stdlib)")
    p.add_argument("--tokens", type=int, default=DEFAULT_TOKENS, help=f"tokens to feed (default {DEFAULT_TOKENS})")
    p.add_argument("--seq-len", type=int, default=DEFAULT_SEQ_LEN, help=f"tokens per sequence (default {DEFAULT_SEQ_LEN})")
    p.add_argument("--skip", type=int, default=DEFAULT_SKIP, help="leading positions per sequence left out of the "
                   f"statistics: the cache's sink, never quantized (default {DEFAULT_SKIP})")
    from lowbit.core.flags import add_dtype

    add_dtype(p, default="bf16", help="model dtype while capturing (the serving dtype; statistics are summed in float64)")
    p.add_argument("--no-score-weighted", action="store_true", help="skip the attention-weighted V covariance (faster)")
    p.add_argument("--vq-for", default=None, metavar="RECIPE",
                   help="instead of the statistics: fit the VQ codebooks of RECIPE's vector-quantized tensors (vq = "
                        "\"2x16\") on the rows the cache would store, and write them as the levels artifact the "
                        "recipe names")
    p.add_argument("--out", required=True, help="new artifact directory")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (a line per eighth of the sequences instead; also when stderr is not a terminal)")
    # --threads: the global thread policy (lowbit.core.threads), added to every command by lowbit.cli


def run(args) -> int:
    if args.threads is not None:
        if args.threads < 1:
            raise LowbitError(f"--threads {args.threads}: give 1 or more")
        import torch

        torch.set_num_threads(args.threads)
    from lowbit.calib.corpora import load_text
    from lowbit.runtime.load import resolve

    out = Path(args.out)
    if out.exists():
        raise LowbitError(f"{out} already exists; artifacts are never overwritten: choose a new --out")
    from lowbit.core.flags import torch_dtype

    scheme = None
    if args.vq_for:
        from lowbit.kv.scheme import load_recipe

        scheme = load_recipe(args.vq_for)  # a bad recipe fails before any model work
        if not (scheme.k.quantized and scheme.k.vq) and not (scheme.v.quantized and scheme.v.vq):
            raise LowbitError(f"--vq-for {args.vq_for}: the recipe has no vector-quantized tensor; set vq = \"2x16\" "
                              "(or 4x256) on its k or v table")
    loaded = resolve(args.model, dtype=torch_dtype(args.dtype))
    text = load_text(args.data)
    if scheme is not None:
        from lowbit.calib.run import calibrate_vq

        c = calibrate_vq(loaded, args.data, text, out, scheme, str(args.vq_for), tokens=args.tokens,
                         seq_len=args.seq_len, skip=args.skip, progress=False if args.no_progress else None)
        print(f"VQ codebooks of {c['tensors']} tensors of {loaded.name} fitted on {args.data} ({c['tokens']} tokens, "
              f"{c['seconds']} s) -> {out}\nname them in the recipe's [kv]: levels = {{ path = \"{out}\", "
              f"sha256 = \"{c['sha256']}\" }}")
        return 0
    counts = calibrate(loaded, args.data, text, out, tokens=args.tokens, seq_len=args.seq_len, skip=args.skip,
                       score_weighted=not args.no_score_weighted, progress=False if args.no_progress else None)
    print(f"calibration of {loaded.name} on {args.data}: {counts['tokens']} tokens in {counts['sequences']} sequences, "
          f"{counts['layers']} layers, {counts['seconds']} s -> {out}")
    return 0
