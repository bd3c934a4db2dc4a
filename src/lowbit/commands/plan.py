"""`lowbit plan`: resolve a KV recipe against a model's geometry and print the per-layer plan.

Reads only the model's config (a built-in's stored config, or DIR/config.json): no weights load.
"""

from __future__ import annotations

import json
import sys

NAME = "plan"
HELP = "resolve a KV recipe for a model and print per layer: window, K/V bits and grid, rotation, decode backend and why"


def add_arguments(p) -> None:
    from lowbit.commands._kv_flags import add_kv_arguments

    p.add_argument("--model", required=True, help="built-in name or Hugging Face model directory (only its config is read)")
    add_kv_arguments(p)
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="the device the cache will run on (decides the decode backend); default auto: this "
                        "machine's (cuda when a GPU is present, else cpu); name cuda to plan for a GPU elsewhere")
    p.add_argument("--decode-backend", default="auto", choices=("auto", "torch", "triton"),
                   help="decode backend to plan for (default auto: the fused kernel where it takes the layer)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON instead of a table")


def run(args) -> int:
    from lowbit.commands._kv_flags import scheme_from_args
    from lowbit.kv.plan import resolve
    from lowbit.models.geometry import geometry_of

    scheme = scheme_from_args(args)
    geometry = geometry_of(args.model)
    device = args.device
    if device == "auto":  # the device present: planning for cuda on a CPU-only machine misled (issue 51)
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
        why = "a CUDA device is present" if device == "cuda" else "no CUDA device here; --device cuda plans for a GPU"
        print(f"note: planned for {device} (--device auto: {why})", file=sys.stderr)
    plan = resolve(scheme, geometry, device=device, decode_backend=args.decode_backend)
    if args.json:
        json.dump(plan.to_dict(), sys.stdout, indent=2)
        print()
    else:
        print(plan.table())
    if not scheme.quantized:
        print("note: nothing is quantized: K and V stay in the model dtype (16 bits/elt in bf16, 32 in fp32)", file=sys.stderr)
    return 0



