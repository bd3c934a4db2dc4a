"""`lowbit audit kernels`: every Triton kernel against its torch twin on the current device."""

from __future__ import annotations

import json
import os
import subprocess
import sys

NAME = "audit"
HELP = "audit kernels against their torch twins on this device (rel error, NaN/Inf); exit 1 on any failure"


def add_arguments(parser) -> None:
    parser.add_argument("what", choices=["kernels"], help="what to audit")
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                        help="cuda: full shapes; cpu: small shapes through the Triton interpreter (default: cuda if present)")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    parser.add_argument("--kernel", choices=["all", "decode_attention", "decode_geometry", "decode_vq", "vllm_cpu"],
                        default="all",
                        help="which decode-attention sweep: the 64/128/256 kernel, the geometry kernel (MLA latent, "
                             "Gemma-4 K = V, K192/V128, head_dim 512), the VQ-row kernel, the vLLM plugin's C++ CPU kernels (paged "
                             "decode, cell encoder), or all (default; the plugin's only with --device cpu)")
    parser.add_argument("--weights", action="store_true",
                        help="audit the weight GEMMs (W4A16/W8A16/W8A8/W4A8, every dispatched (scheme, M) cell on "
                             "LLM and DiT shapes) instead of the decode-attention kernel")


def run(args) -> int:
    from lowbit.core.device import resolve_device

    device = resolve_device(args.device).type  # no CUDA -> LowbitError; cpu runs the Triton interpreter
    if device == "cpu" and not ({"lowbit.kernels.attention.tiers", "lowbit.kernels.gemm.triton_gemm"} & set(sys.modules)) and os.environ.get(
            "TRITON_INTERPRET") != "1":
        # Triton reads TRITON_INTERPRET when the kernels are defined (import time): run the CPU audit
        # in a child process that has it, rather than letting the kernels fail on CPU tensors.
        env = dict(os.environ, TRITON_INTERPRET="1")
        cmd = [sys.executable, "-m", "lowbit", "audit", "kernels", "--device", "cpu"]
        if args.json:
            cmd += ["--json", args.json]
        if args.weights:
            cmd += ["--weights"]
        if getattr(args, "kernel", "all") != "all":
            cmd += ["--kernel", args.kernel]
        return subprocess.call(cmd, env=env)

    if args.weights:
        from lowbit.tools.audit.gemm import audit_weights
        from lowbit.tools.audit.gemm import format_table as weight_table

        rows, dispatch = audit_weights(device, log=print)
        print(weight_table(rows, dispatch))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": device, "rows": [r.as_dict() for r in rows],
                           "dispatch_after_audit": dispatch.table()}, f, indent=1)
        return 0 if all(r.ok for r in rows) else 1

    from lowbit.tools.audit.attention import audit, format_table

    which = getattr(args, "kernel", "all")
    rows = audit(device, kernels=("decode_attention", "decode_geometry", "decode_vq")
                 + (("vllm_cpu",) if device == "cpu" else ())
                 if which == "all" else (which,))
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "rows": [r.as_dict() for r in rows]}, f, indent=1)
    return 0 if all(r.ok for r in rows) else 1
