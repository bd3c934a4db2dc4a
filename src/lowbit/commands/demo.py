"""`lowbit demo`: load a model, print its geometry and one greedy continuation of a fixed prompt.

(Initial version; the evaluation work will grow it into a quantized-vs-bf16 demo.)
"""

from __future__ import annotations

import time

import torch

from lowbit.errors import LowbitError
from lowbit.models.load import is_cached, load
from lowbit.models.registry import BUILTINS

NAME = "demo"
HELP = "load a model (default smollm2-135m), print its geometry and a greedy continuation"

PROMPT = "The capital of France is"


def add_arguments(parser) -> None:
    parser.add_argument("--model", default="smollm2-135m",
                        help=f"built-in name ({', '.join(BUILTINS)}) or a local Hugging Face directory")
    parser.add_argument("--cache-dir", default=None, help="cache root for built-ins (default ~/.cache/lowbit)")
    parser.add_argument("--max-new-tokens", type=int, default=20, help="tokens to generate (default 20)")


def greedy_continuation(lm, prompt: str, max_new_tokens: int) -> str:
    """Greedy-decode `max_new_tokens` after `prompt`; returns only the new text."""
    if lm.tokenizer is None:
        raise LowbitError(f"{lm.name} has no tokenizer files: add them to the model directory")
    enc = lm.tokenizer(prompt, return_tensors="pt").to(lm.model.device)
    pad = lm.tokenizer.pad_token_id
    with torch.no_grad():
        out = lm.model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                pad_token_id=lm.tokenizer.eos_token_id if pad is None else pad)
    return lm.tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)


def run(args) -> int:
    if args.max_new_tokens < 1:
        raise LowbitError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.model in BUILTINS and not is_cached(args.model, args.cache_dir):
        print(f"{args.model}: first load converts the GGUF into the cache (about a minute)", flush=True)
    t0 = time.perf_counter()
    lm = load(args.model, cache_dir=args.cache_dir)
    print(f"loaded {lm.name} in {time.perf_counter() - t0:.1f} s from {lm.path}")
    print(f"weights sha256 {lm.weights_sha256}")
    print(lm.geometry.summary())
    for line in lm.geometry.layer_lines():
        print(f"  {line}")
    t0 = time.perf_counter()
    text = greedy_continuation(lm, PROMPT, args.max_new_tokens)
    dt = time.perf_counter() - t0
    print(f"prompt: {PROMPT!r}")
    print(f"greedy ({args.max_new_tokens} tokens, {dt:.1f} s): {text!r}")
    return 0
