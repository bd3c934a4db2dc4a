"""`lowbit generate`: greedy continuation of a prompt through the quantized KV cache.

    lowbit generate --model smollm2-135m --kv int2 --prompt-file wiki.txt --max-new-tokens 12
    lowbit generate --model gemma3-270m --recipe kv.toml --prompt "The capital of France is"

Prints the continuation, then one line of memory accounting measured from the cache's tensors
(tokens, quantized tokens and rows, middle-tier bits per element, bytes per tier).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from lowbit.errors import LowbitError
from lowbit.kv.cli_args import add_kv_arguments, scheme_from_args

NAME = "generate"
HELP = "greedy generation with a quantized KV cache; prints the continuation and a memory summary"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def add_arguments(parser) -> None:
    parser.add_argument("--model", required=True, help="built-in name (smollm2-135m, gemma3-270m) or a local HF directory")
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", help="UTF-8 file holding the prompt")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate (default 32)")
    add_kv_arguments(parser)
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPES), help="model dtype (default fp32)")
    parser.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    parser.add_argument("--decode-backend", default="auto", choices=("auto", "torch", "triton"),
                        help="decode attention: fused kernel on CUDA when it can (auto), torch only, or kernel only")
    parser.add_argument("--cache-dir", default=None, help="cache root for built-in models (default ~/.cache/lowbit)")


def read_prompt(args) -> str:
    if args.prompt is not None:
        text = args.prompt
    else:
        p = Path(args.prompt_file)
        if not p.is_file():
            raise LowbitError(f"prompt file {p} not found")
        text = p.read_text(encoding="utf-8")
    if not text.strip():
        raise LowbitError("the prompt is empty; pass some text")
    return text


def generate(lm, scheme, prompt: str, max_new_tokens: int, *, decode_backend: str = "auto"):
    """Greedy-generate through a fresh QuantizedKVCache. Returns (new token ids [N], cache)."""
    from lowbit.kv import QuantizedKVCache
    from lowbit.kv.cache import cache_kwargs

    if lm.tokenizer is None:
        raise LowbitError(f"model {lm.name} has no tokenizer; generate needs one")
    model = lm.model
    cache = QuantizedKVCache(model, scheme, geometry=lm.geometry, decode_backend=decode_backend)
    dev = next(model.parameters()).device
    enc = lm.tokenizer(prompt, return_tensors="pt").to(dev)
    pad = lm.tokenizer.pad_token_id if lm.tokenizer.pad_token_id is not None else lm.tokenizer.eos_token_id
    with torch.no_grad():
        out = model.generate(
            **enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad,
            **cache_kwargs(model, cache),
        )
    return out[0, enc["input_ids"].shape[1]:], cache


def run(args) -> int:
    from lowbit.models import load

    if args.max_new_tokens < 1:
        raise LowbitError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    scheme = scheme_from_args(args)  # bad flags fail before the model loads
    prompt = read_prompt(args)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    lm = load(args.model, cache_dir=args.cache_dir, dtype=DTYPES[args.dtype], device=device)
    scheme.validate(lm.geometry)
    new, cache = generate(lm, scheme, prompt, args.max_new_tokens, decode_backend=args.decode_backend)
    print(f"# {scheme.describe()}", file=sys.stderr)
    print(lm.tokenizer.decode(new, skip_special_tokens=True))
    print(cache.summary())
    return 0
