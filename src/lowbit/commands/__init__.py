"""The `lowbit` subcommands: one module each, listed here so `lowbit --help` imports none of them.

Each module exposes NAME: str, HELP: str, add_arguments(parser), run(args) -> int | None.
COMMANDS repeats NAME -> (module, HELP) so the top-level help costs no import of torch or
transformers (importing every module took ~5 s); a module is imported only when its command is
parsed (`lowbit eval ...`, `lowbit eval --help`). tests/test_cli.py checks this table against the
modules, so a new command that is not listed here (or a HELP that drifts) fails a test.
"""

from __future__ import annotations

import importlib

# name -> (module under lowbit.commands, one-line help); sorted by name, as `lowbit --help` lists them
COMMANDS: dict[str, tuple[str, str]] = {
    "audit": ("audit", (
        'audit kernels against their torch twins on this device (rel error, NaN/Inf); exit 1 on any '
        'failure'
    )),
    "bench": ("bench", (
        'GPU benchmarks: `bench decode-attention` times int2/int4/int8 decode attention vs bf16 SDPA '
        'flash'
    )),
    "calibrate": ("calibrate", (
        'capture post-RoPE Q/K/V statistics (KᵀK, VᵀV, QᵀQ per KV head) over N tokens into a calibration '
        'artifact'
    )),
    "demo": ("demo", (
        'eval bf16 vs lowbit int4/int2 (Hadamard) vs HF quanto KV on smollm2-135m: table + plot in '
        'minutes'
    )),
    "eval": ("eval", (
        'perplexity, KL and top-1 of KV-cache schemes and peers on the same windows (table, JSON, '
        'markdown, PNG)'
    )),
    "export": ("export", (
        'write a model directory for another engine: --for vllm (config, tokenizer, weights, KV sidecar, '
        'manifest)'
    )),
    "fit-rotations": ("fit_rotations", (
        'fit K/V rotations (covariance eigenvectors x Hadamard) per layer or per KV head from a '
        'calibration'
    )),
    "generate": ("generate", (
        'greedy generation with a quantized KV cache; prints the continuation and a memory summary'
    )),
    "layer-error": ("layer_error", (
        'per-layer attention-output error (dB) of each rotation (none, hadamard, fitted dirs) on held-out'
        ' text'
    )),
    "models": ("models", (
        'list the built-in models: installed, cached, layers, heads, head_dim, attention pattern'
    )),
    "pin": ("pin", (
        'record every file of DIR (bytes + sha256) in DIR/manifest.json; refuses if already pinned'
    )),
    "plan": ("plan", (
        'resolve a KV recipe for a model and print per layer: window, K/V bits and grid, rotation, decode '
        'backend and why'
    )),
    "quantize": ("quantize", (
        "quantize a model's linear weights (GPTQ, RTN or SignRound, optionally end-to-end scale tuning) "
        'and write a compressed-tensors checkpoint'
    )),
    "serve": ("serve", (
        'OpenAI-compatible server (/v1/completions, /v1/chat/completions, SSE streaming, /health, '
        "/metrics) on the transformers runtime with lowbit's KV cache"
    )),
    "validate": ("validate", (
        'validate an artifact in stages (1 CPU checks, 2 kernel audit, 3 load+decode smoke, 4 PPL/KL vs the '
        'unquantized model); stops at the first failure; exit 1 if one fails'
    )),
    "verify": ("verify", (
        'check every file of an artifact against its manifest (OK/FAILED/MISSING/UNLISTED); exit 1 on any'
        ' problem'
    )),
}

# commands that never import torch: the thread policy leaves torch unimported for them (~2 s saved)
TORCH_FREE = frozenset({"pin", "verify"})


def load(name: str):
    """The module of command `name` (imported now: this is where torch/transformers get imported)."""
    return importlib.import_module(f"lowbit.commands.{COMMANDS[name][0]}")
