"""`lowbit generate`: greedy continuation of a prompt through the quantized KV cache.

    lowbit generate --model smollm2-135m --kv int2 --prompt-file wiki.txt --max-new-tokens 12
    lowbit generate --model gemma3-270m --recipe kv.toml --prompt "The capital of France is"

Prints the continuation, then one line of memory accounting measured from the cache's tensors
(tokens, quantized tokens and rows, middle-tier bits per element, bytes per tier).
"""

from __future__ import annotations

import sys

from lowbit.commands._kv_flags import add_kv_arguments, scheme_from_args
from lowbit.core.device import resolve_device
from lowbit.core.errors import LowbitError
from lowbit.core.flags import torch_dtype
from lowbit.runtime.generate import generate, read_prompt

NAME = "generate"
HELP = "greedy generation with a quantized KV cache; prints the continuation and a memory summary"


def add_arguments(parser) -> None:
    parser.add_argument("--model", required=True, help="built-in name (smollm2-135m, gemma3-270m) or a local HF directory")
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", help="UTF-8 file holding the prompt")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate (default 32)")
    add_kv_arguments(parser)
    from lowbit.core.flags import add_dtype

    add_dtype(parser, default="fp32", help="model dtype")
    parser.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    parser.add_argument("--decode-backend", default="auto", choices=("auto", "torch", "triton"),
                        help="decode attention: fused kernel on CUDA when it can (auto), torch only, or kernel only")
    parser.add_argument("--cache-dir", default=None, help="cache root for built-in models (default ~/.cache/lowbit)")


def run(args) -> int:
    from lowbit.runtime.load import resolve

    if args.max_new_tokens < 1:
        raise LowbitError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    scheme = scheme_from_args(args)  # bad flags fail before the model loads
    prompt = read_prompt(args.prompt, args.prompt_file)
    device = resolve_device(args.device)  # before loading: no CUDA -> one-line error, not an AssertionError
    lm = resolve(args.model, cache_dir=args.cache_dir, dtype=torch_dtype(args.dtype), device=device)
    scheme.validate(lm.geometry)
    new, cache = generate(lm, scheme, prompt, args.max_new_tokens, decode_backend=args.decode_backend)
    print(f"# {scheme.describe()}", file=sys.stderr)
    print(lm.tokenizer.decode(new, skip_special_tokens=True))
    print(cache.summary())
    return 0
