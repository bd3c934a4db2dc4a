"""`lowbit validate ARTIFACT`: stages 1-4 (CPU checks, kernel audit, smoke, accuracy), stopping at the first failure.

The stages, what each checks per artifact kind and the report live in lowbit.tools.validate;
this module only parses the flags. Prints a table; `--json OUT` also writes the report (with its
provenance) to a new file. Exit 0: every asked stage passed; 1: a stage failed (the table and the
report say which); 2: bad input (no manifest, an existing --json path, ...), nothing written.
"""

from __future__ import annotations

NAME = "validate"
HELP = ("validate an artifact in stages (1 CPU checks, 2 kernel audit, 3 load+decode smoke, 4 PPL/KL vs the "
        "unquantized model); stops at the first failure; exit 1 if one fails")


def add_arguments(p) -> None:
    from lowbit.tools.validate import DEFAULT_MAX_KL, DEFAULT_MAX_PPL_INCREASE, DEFAULT_ROTATION_KV

    p.add_argument("artifact", metavar="ARTIFACT",
                   help="artifact directory: `lowbit export --for vllm` output, a `lowbit quantize` checkpoint, "
                        "a rotation set, or a DiT checkpoint (`quantize --component`; stage 1 only)")
    p.add_argument("--model", default=None, metavar="M",
                   help="rotation sets: the model (built-in name or HF dir) they were fitted for, when the "
                        "manifest's name does not resolve here")
    p.add_argument("--base", default=None, metavar="DIR",
                   help="quantized weights: the unquantized base model (default: the one the manifest names)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="where stages 2-4 run (default: cuda when present, else cpu: the kernel audit then runs "
                        "in the Triton interpreter)")
    p.add_argument("--stages", default="1,2,3,4", help="stages to run, e.g. 1,2 (stage 1 always; default 1,2,3,4)")
    p.add_argument("--json", default=None, metavar="OUT",
                   help="also write the report as JSON to OUT (a new file; default: print the table only)")
    p.add_argument("--kv", default=None, metavar="SCHEME",
                   help=f"rotation sets: the KV scheme run with the rotations in stages 2-4 (default {DEFAULT_ROTATION_KV})")
    p.add_argument("--max-ppl-increase", type=float, default=DEFAULT_MAX_PPL_INCREASE, metavar="PCT",
                   help=f"stage 4 fails above this PPL increase in percent (default {DEFAULT_MAX_PPL_INCREASE:g}: "
                        "catches a broken artifact; set your quality bar)")
    p.add_argument("--max-kl", type=float, default=DEFAULT_MAX_KL, metavar="NATS",
                   help=f"stage 4 fails above this mean KL per token (default {DEFAULT_MAX_KL:g})")


def run(args) -> int:
    from lowbit.core.device import resolve_device
    from lowbit.tools.validate import Options, format_report, parse_stages, validate, write_report

    device = resolve_device(args.device).type  # None -> cuda if present; cuda without CUDA -> one line
    opts = Options(artifact=args.artifact, model=args.model, base=args.base, device=device,
                   stages=parse_stages(args.stages), kv=args.kv, max_ppl_increase=args.max_ppl_increase,
                   max_kl=args.max_kl, json=args.json)
    report = validate(opts)
    print(format_report(report))
    if args.json:
        write_report(report, args.json)
        print(f"wrote {args.json}")
    return 0 if report["ok"] else 1
