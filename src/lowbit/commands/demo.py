"""`lowbit demo`: what low-bit KV costs on a real model, measured, in a few minutes on a laptop CPU.

Runs `lowbit eval` on smollm2-135m (default) with text that ships with Python (--data stdlib, so
nothing else is needed): the bf16 DynamicCache reference, lowbit int4 and int2 (Hadamard rotation,
sink 64, recent 256), and transformers' QuantizedCache with quanto int2/int4 as peers, on 2 windows
fed through each cache 128 tokens at a time. Prints the table, writes JSON, markdown and the plot
of ΔPPL vs bits/elt into --out, then shows the model's greedy continuation of a short prompt.
"""

from __future__ import annotations

import time
from pathlib import Path

from lowbit.core.errors import LowbitError
from lowbit.models.registry import BUILTINS

NAME = "demo"
HELP = "eval bf16 vs lowbit int4/int2 (Hadamard) vs HF quanto KV on smollm2-135m: table + plot in minutes"

DEMO_KV = "bf16,int4@hadamard,int2@hadamard"
DEMO_PEERS = "hf-quanto-int2,hf-quanto-int4"


def add_arguments(parser) -> None:
    parser.add_argument("--model", default="smollm2-135m",
                        help=f"built-in name ({', '.join(BUILTINS)}) or a local Hugging Face directory")
    parser.add_argument("--cache-dir", default=None, help="cache root for built-ins (default ~/.cache/lowbit)")
    parser.add_argument("--out", default="lowbit-demo", help="folder for demo.json, demo.md, demo.png (default lowbit-demo)")
    parser.add_argument("--windows", type=int, default=2, help="windows to score (default 2)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per window (default 2048, capped by context)")
    parser.add_argument("--data", default="stdlib", help="stdlib (default) | wikitext2 | PATH")
    # --threads: the global thread policy (lowbit.core.threads), added to every command by lowbit.cli
    parser.add_argument("--max-new-tokens", type=int, default=20, help="tokens of the greedy continuation (default 20)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    from lowbit.core.flags import AUTO, add_dtype

    add_dtype(parser, default=AUTO, help="model dtype (the demo runs on the CPU)")


def run(args) -> int:
    from lowbit.core.flags import resolve_dtype, torch_dtype
    from lowbit.eval.runner import EvalOptions, check_options, run_eval
    from lowbit.models.load import is_cached
    from lowbit.runtime.generate import PROMPT, greedy_continuation
    from lowbit.runtime.load import resolve

    if args.max_new_tokens < 1:
        raise LowbitError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    # the demo took 17 minutes in bf16 on a CPU without native bf16 (5.7x slower than fp32 there)
    dtype, why = resolve_dtype(args.dtype, "cpu")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise LowbitError(f"--out {out} is a file; give a folder")
    opts = EvalOptions(
        model=args.model, kv=DEMO_KV, peers=DEMO_PEERS, data=args.data, seq_len=args.seq_len, windows=args.windows,
        dtype=dtype, cache_dir=args.cache_dir, json_out=str(out / "demo.json"), markdown_out=str(out / "demo.md"),
        plot_out=str(out / "demo.png"), progress=not args.no_progress, threads=args.threads,
        overwrite=True,  # --out is the demo's own folder: a rerun replaces its files and says "replaced"
        warmup=True,  # every row runs once untimed first: a one-off stall (a peer's lazy import) is nobody's time
        kv_flags={"rotation": None},
    )
    check_options(opts)  # bad input before loading anything
    if args.model in BUILTINS and not is_cached(args.model, args.cache_dir):
        print(f"{args.model}: first load converts the GGUF into the cache (about a minute)", flush=True)
    t_start = time.perf_counter()
    lm = resolve(args.model, cache_dir=args.cache_dir, dtype=torch_dtype(dtype))
    print(f"loaded {lm.name} ({dtype}: {why}) in {time.perf_counter() - t_start:.1f} s from {lm.path}")
    print(f"weights sha256 {lm.weights_sha256}")
    print(lm.geometry.summary())
    for line in lm.geometry.layer_lines():
        print(f"  {line}")
    print(f"evaluating KV caches {DEMO_KV} and peers {DEMO_PEERS} on {args.windows} windows of {args.data} "
          f"(each fed 128 tokens at a time; KL and top-1 against the unquantized cache, {dtype})", flush=True)
    run_eval(opts, loaded=lm)
    t0 = time.perf_counter()
    text = greedy_continuation(lm, PROMPT, args.max_new_tokens)
    dt = time.perf_counter() - t0
    print(f"prompt: {PROMPT!r}")
    print(f"greedy ({args.max_new_tokens} tokens, {dt:.1f} s): {text!r}")
    print(f"demo done in {time.perf_counter() - t_start:.0f} s")
    return 0
