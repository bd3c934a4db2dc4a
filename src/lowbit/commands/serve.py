"""`lowbit serve --model MODEL_OR_ARTIFACT`: an OpenAI-compatible HTTP server with lowbit's KV cache (and weights)."""

from __future__ import annotations

import argparse
import sys

from lowbit.core.errors import LowbitError
from lowbit.core.flags import add_dtype, torch_dtype, warn_deprecated

NAME = "serve"
HELP = ("OpenAI-compatible server (/v1/completions, /v1/chat/completions, SSE streaming, /health, /metrics) "
        "on the transformers runtime with lowbit's KV cache")


def add_kv_flags(p) -> None:
    """The KV scheme flags every command shares (lowbit.commands._kv_flags); --kv defaults to the artifact's scheme."""
    from lowbit.commands._kv_flags import add_kv_arguments

    add_kv_arguments(p, kv_default=None)  # None: the artifact's sidecar scheme, else bf16


def kv_scheme_from_args(args):
    """KVScheme from the shared flags (lowbit.commands._kv_flags), or None when neither --kv nor --recipe was given."""
    from lowbit.commands._kv_flags import scheme_or_none

    return scheme_or_none(args)


def add_arguments(p) -> None:
    p.add_argument("--model", default=None, metavar="MODEL_OR_ARTIFACT",
                   help="built-in name (smollm2-135m, gemma3-270m), HF model dir, a `lowbit quantize` checkpoint, "
                        "a `lowbit export` directory, or random:GEOMETRY (random weights of a `lowbit bench decode` "
                        "geometry, e.g. random:llama3-8b, word tokenizer, no EOS: for load tests); required")
    p.add_argument("--device", default="cpu",
                   help="where the model runs: cpu (default) | cuda | cuda:N | auto (cuda when available)")
    p.add_argument("model_positional", nargs="?", default=None, help=argparse.SUPPRESS)  # the old spelling
    add_kv_flags(p)
    p.add_argument("--weights", default=None, metavar="DIR",
                   help="compressed-tensors checkpoint from `lowbit quantize` to serve instead of the model's weights")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1, loopback only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0 = any free port)")
    p.add_argument("--served-model-name", default=None, help="model id clients send (default: the model's name)")
    p.add_argument("--max-context", type=int, default=None,
                   help="tokens per request, prompt + completion (default: the model's max positions)")
    p.add_argument("--max-active", type=int, default=16,
                   help="requests generated concurrently (interleaved token by token); the rest wait (default 16)")
    p.add_argument("--prefill-chunk", type=int, default=256,
                   help="prompt tokens fed per scheduling round, so long prompts do not stall others (default 256)")
    p.add_argument("--engine", default="auto", choices=("auto", "batch", "single"),
                   help="batch: continuous batching over one static KV cache of --max-active slots; single: one "
                        "cache and forward per request; auto (default): batch on CUDA, single on CPU")
    p.add_argument("--decode-path", default="auto", choices=("auto", "graphs", "eager"),
                   help="batch engine's decode step: graphs (CUDA graphs captured at start, CUDA only), eager, "
                        "or auto (default: graphs on CUDA, eager on CPU)")
    p.add_argument("--when-full", default="wait", choices=("wait", "reject"),
                   help="batch engine, every slot taken: wait for one (default) or answer 429 at once")
    p.add_argument("--batch-invariant", action="store_true",
                   help="batch engine: run every decode step at the full --max-active width, so a request's greedy "
                        "tokens equal its tokens served alone (bit for bit); slower at low load")
    p.add_argument("--decode-ahead", action=argparse.BooleanOptionalAction, default=None,
                   help="batch engine (default on): queue the next decode step before reading this one's tokens while "
                        "every live request is greedy and none joins or leaves, so the host's graph launch and token "
                        "handling overlap the GPU's step (Llama-3-8B int2 on an H200, 32 streams: 3,341 vs 2,761 "
                        "decode tok/s); --no-decode-ahead reads each step's tokens before launching the next")
    p.add_argument("--compile", nargs="?", const="whole", default=None, choices=("whole", "layers"),
                   help="batch engine on CUDA: torch.compile (Inductor) the decode step before capturing each bucket "
                        "(fewer, fused kernels per step). whole (what --compile alone means): one graph, the faster "
                        "step, ~2 min a bucket at start on an 8B model; layers: one compiled decoder layer for every "
                        "layer, 22-84 s a bucket, a slower step (Llama-3-8B int2 on an H200: B1 5.8 vs 5.3 ms, "
                        "B16 9.8 vs 9.2 ms)")
    add_dtype(p, default="fp32", help="model dtype (fp32 is fastest on most CPUs)")
    # --threads: the global thread policy (lowbit.core.threads), added to every command by lowbit.cli
    p.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"),
                   help="level of lowbit's and uvicorn's logs (default warning; debug adds uvicorn's access log)")
    p.add_argument("--shutdown-grace", type=float, default=5.0, metavar="S",
                   help="on SIGTERM / Ctrl-C: stop accepting, give in-flight requests S seconds to finish, then end "
                        "the rest (503, or a final error event on a stream) (default 5)")
    p.add_argument("--no-request-log", action="store_true",
                   help="do not log one line per /v1 request on stderr (method, path, status, tokens, seconds)")


SERVE_EXTRA = ("fastapi", "uvicorn")  # what the HTTP server imports, from the `serve` extra


def require_serve_extra() -> None:
    """Refuse, in one line, to start without the `serve` extra (instead of a ModuleNotFoundError traceback)."""
    import importlib

    missing = []
    for name in SERVE_EXTRA:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise LowbitError(f"`lowbit serve` needs {' and '.join(missing)} (the serve extra), not installed here: "
                          "pip install 'lowbit[serve]'")


def model_from_args(args) -> str:
    """--model, or the old positional spelling (one release, with a warning); one of them is required."""
    pos = getattr(args, "model_positional", None)
    if pos is not None:
        if args.model is not None:
            raise LowbitError(f"give the model once: --model {args.model} (drop the positional {pos})")
        warn_deprecated("`lowbit serve MODEL` (positional)", "`lowbit serve --model MODEL`")
        args.model = pos
    if args.model is None:
        raise LowbitError("--model is required: a built-in name, a model directory, a checkpoint or an export")
    return args.model


def run(args) -> int:
    import logging

    model_from_args(args)
    require_serve_extra()  # before the model loads: a missing package fails in a second
    import torch

    from lowbit.serve.loader import load_runtime
    from lowbit.serve.server import bind, build, serve_forever, url_of

    logging.basicConfig(level=getattr(logging, args.log_level.upper()), format="%(levelname)s %(name)s: %(message)s")
    if not args.no_request_log:
        from lowbit.serve.app import enable_request_log

        enable_request_log()
    # bind first: a port in use fails in a second, not after loading the model
    sock = bind(args.host, args.port)
    if args.shutdown_grace < 0:
        sock.close()
        raise LowbitError(f"--shutdown-grace {args.shutdown_grace}: give 0 or more seconds")
    if args.threads is not None:
        if args.threads < 1:
            sock.close()
            raise LowbitError(f"--threads {args.threads}: need at least 1")
        torch.set_num_threads(args.threads)
    try:
        from lowbit.core.device import resolve_device

        device = resolve_device(args.device)
        scheme = kv_scheme_from_args(args)
        rt = load_runtime(args.model, kv=scheme, weights=args.weights, dtype=torch_dtype(args.dtype),
                          max_context=args.max_context, name=args.served_model_name, device=device)
        engine, app = build(rt, max_active=args.max_active, prefill_chunk=args.prefill_chunk, engine=args.engine,
                            decode_path=args.decode_path, when_full=args.when_full,
                            batch_invariant=args.batch_invariant, compile=args.compile or False,
                            decode_ahead=args.decode_ahead)
    except BaseException:
        sock.close()
        raise
    s = engine.scheme
    dtype = str(next(rt.model.parameters()).dtype).replace("torch.", "")  # every result names the dtype it ran
    print(f"lowbit serve: {rt.name} ({dtype} on {device.type}) | KV {s.describe()} | cache {engine.cache_class} | "
          f"engine {engine.path} | "
          f"context {rt.max_context} | weights {'quantized: ' + rt.weights['path'] if rt.weights else 'model'}",
          flush=True)
    print(f"listening on {url_of(sock)} (OpenAI base_url {url_of(sock)}/v1)", flush=True)
    from lowbit.cli import EXIT_SIGINT, EXIT_SIGTERM, Terminated

    drained: dict = {}
    try:
        serve_forever(engine, app, sock, log_level=args.log_level, grace=args.shutdown_grace, report=drained)
    except KeyboardInterrupt as e:  # uvicorn re-raises the signal once it has drained and stopped
        how = "SIGTERM" if isinstance(e, Terminated) else "Ctrl-C"
        print(f"lowbit serve: stopped on {how}: {drained.get('finished', 0)} in-flight request(s) finished and "
              f"{drained.get('ended', 0)} ended (503 / final stream event) within the {args.shutdown_grace:g} s grace "
              f"({drained.get('seconds', 0.0):.1f} s)", file=sys.stderr, flush=True)
        return EXIT_SIGTERM if how == "SIGTERM" else EXIT_SIGINT
    return 0
