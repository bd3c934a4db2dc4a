"""`lowbit generate`: continuation of a prompt through the quantized KV cache (greedy unless --temperature).

    lowbit generate --model smollm2-135m --kv int2 --prompt-file wiki.txt --max-new-tokens 12
    lowbit generate --model gemma3-270m --recipe kv.toml --prompt "The capital of France is"
    lowbit generate --model smollm2-135m --kv int4 --prompt "Once" --temperature 0.8 --top-p 0.95 --seed 7

Prints the continuation, then one line of memory accounting measured from the cache's tensors
(tokens, quantized tokens and rows, middle-tier bits per element, bytes per tier), and on stderr
the scheme, the dtype it ran (and why), time to first token and decode tokens/s.

Only flags are parsed here; torch and the model code are imported in run(), so a mistyped flag or
--help answers at once.
"""

from __future__ import annotations

import sys

from lowbit.core.errors import LowbitError

NAME = "generate"
HELP = "generation with a quantized KV cache (greedy by default); prints the continuation, a memory summary and speed"


def add_arguments(parser) -> None:
    from lowbit.commands._kv_flags import add_kv_arguments
    from lowbit.core.flags import AUTO, add_dtype

    parser.add_argument("--model", required=True, help="built-in name (smollm2-135m, gemma3-270m) or a local HF directory")
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", help="UTF-8 file holding the prompt")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate (default 32)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sampling temperature; 0 (default) is greedy decoding")
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="nucleus sampling: keep the smallest set of tokens whose probability reaches P "
                             "(default 1.0: all; needs --temperature > 0)")
    parser.add_argument("--seed", type=int, default=None,
                        help="sampling seed (default: a random one, printed so the run can be repeated)")
    add_kv_arguments(parser)
    add_dtype(parser, default=AUTO, help="model dtype")
    parser.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    parser.add_argument("--decode-backend", default="auto", choices=("auto", "torch", "triton"),
                        help="decode attention: fused kernel on CUDA when it can (auto), torch only, or kernel only")
    parser.add_argument("--cache-dir", default=None, help="cache root for built-in models (default ~/.cache/lowbit)")


def run(args) -> int:
    from lowbit.commands._kv_flags import scheme_from_args
    from lowbit.core.device import resolve_device
    from lowbit.core.flags import resolve_dtype, torch_dtype
    from lowbit.runtime.generate import check_sampling, generate, read_prompt
    from lowbit.runtime.load import resolve

    if args.max_new_tokens < 1:
        raise LowbitError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    check_sampling(args.temperature, args.top_p)
    if args.seed is not None and args.temperature == 0:
        raise LowbitError("--seed only matters when sampling: add --temperature T (T > 0) or drop --seed")
    scheme = scheme_from_args(args)  # bad flags fail before the model loads
    prompt = read_prompt(args.prompt, args.prompt_file)
    device = resolve_device(args.device)  # before loading: no CUDA -> one-line error, not an AssertionError
    dtype, why = resolve_dtype(args.dtype, device)
    lm = resolve(args.model, cache_dir=args.cache_dir, dtype=torch_dtype(dtype), device=device)
    scheme.validate(lm.geometry)
    t: dict = {}
    new, cache = generate(lm, scheme, prompt, args.max_new_tokens, decode_backend=args.decode_backend,
                          temperature=args.temperature, top_p=args.top_p, seed=args.seed, timing=t)
    print(f"# {scheme.describe()}", file=sys.stderr)
    print(lm.tokenizer.decode(new, skip_special_tokens=True))
    print(cache.summary())
    mode = (f"sampled (temperature {args.temperature:g}, top-p {args.top_p:g}, seed {t['seed']})"
            if t.get("seed") is not None else "greedy")
    tps = f"{t['decode_tokens_per_s']:.1f} tokens/s" if t.get("decode_tokens_per_s") else "n/a (one token)"
    print(f"# {lm.name} {dtype} ({why}) on {device.type}, {mode}: {t['prompt_tokens']} prompt tokens, "
          f"{t['new_tokens']} new; time to first token {t['ttft_s']:.2f} s, decode {tps}, total {t['total_s']:.2f} s",
          file=sys.stderr)
    return 0
