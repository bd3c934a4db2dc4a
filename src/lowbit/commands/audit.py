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


def run(args) -> int:
    from lowbit.device import resolve_device

    device = resolve_device(args.device).type  # no CUDA -> LowbitError; cpu runs the Triton interpreter
    if device == "cpu" and "lowbit.kernels.decode_attention" not in sys.modules and os.environ.get(
            "TRITON_INTERPRET") != "1":
        # Triton reads TRITON_INTERPRET when the kernels are defined (import time): run the CPU audit
        # in a child process that has it, rather than letting the kernels fail on CPU tensors.
        env = dict(os.environ, TRITON_INTERPRET="1")
        cmd = [sys.executable, "-m", "lowbit", "audit", "kernels", "--device", "cpu"]
        if args.json:
            cmd += ["--json", args.json]
        return subprocess.call(cmd, env=env)

    from lowbit.kernels.audit import audit, format_table

    rows = audit(device)
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "rows": [r.as_dict() for r in rows]}, f, indent=1)
    return 0 if all(r.ok for r in rows) else 1
