"""The KV-cache flags every command shares (`generate`, `eval`, `serve`), and the scheme they make.

    from lowbit.commands._kv_flags import add_kv_arguments, scheme_from_args
    add_kv_arguments(parser)                 # --kv SCHEME + --group --sink --recent --page --clip
                                             # --lloyd-max --rotation --layer-bits | --recipe FILE
    scheme = scheme_from_args(args)          # a lowbit.kv.scheme.KVScheme (not yet validated)
    scheme = scheme_or_none(args)            # None when no --kv / --recipe and no scheme flag (serve: the
                                             # artifact's scheme); a scheme flag alone is refused
"""

from __future__ import annotations

from lowbit.core.errors import LowbitError
from lowbit.kv.scheme import SCHEME_NAMES, KVScheme, load_recipe, parse_kv_scheme

# every scheme flag add_kv_arguments adds besides --kv / --recipe / --lloyd-max (the one list)
_FLAGS = ("group", "sink", "recent", "page", "clip", "rotation", "layer_bits", "grid", "zero", "scale_format", "vq",
          "residual")


def add_kv_arguments(parser, *, kv_default: str | None = None) -> None:
    """Add --kv and the scheme flags (in a 'KV cache' group). kv_default None: --kv or --recipe is needed."""
    g = parser.add_argument_group("KV cache")
    g.add_argument("--kv", default=kv_default, metavar="SCHEME",
                   help=f"KV scheme: {', '.join(SCHEME_NAMES)}" + (f" (default {kv_default})" if kv_default else ""))
    g.add_argument("--group", type=int, default=None,
                   help="channels per quantization group (default 128, or head_dim when smaller)")
    g.add_argument("--sink", type=int, default=None, help="first tokens kept unquantized (default 64)")
    g.add_argument("--recent", type=int, default=None, help="last tokens kept unquantized (default 256)")
    g.add_argument("--page", type=int, default=None, help="tokens moved from the recent ring to the middle at once (default 16)")
    g.add_argument("--clip", default=None, metavar="K,V", help="clip ratio, one value or K,V (e.g. 0.96,0.92)")
    g.add_argument("--grid", default=None, choices=("minmax", "std", "mse"),
                   help="uniform grid range: each group's min/max (minmax) or the Gaussian-optimal step from its mean/std "
                        "(std; the default for 2-bit per-token tensors without --clip/--lloyd-max), or with --zero none the std "
                        "step searched per group for the least squared error when written (mse)")
    g.add_argument("--zero", default=None, metavar="group|none",
                   help="per-group zero storage, one value or K,V: group (an fp16 zero beside each scale, default) or "
                        "none (scale only, the grid centred on 0: int2 at group 64 costs 2.25 b/elt, not 2.5)")
    g.add_argument("--scale-format", default=None, metavar="fp16|ue5m3",
                   help="how scale-only groups (--zero none) store their step, one value or K,V: fp16 (default) or ue5m3 "
                        "(one byte, 3 mantissa bits: int2 at group 64 costs 2.125 b/elt, not 2.25)")
    g.add_argument("--vq", default=None, metavar="SPEC[,SPEC]",
                   help="vector-quantized rows, one spec or K,V (none for one side): 2x16 or 4x256 (2 bits per element, "
                        "with --zero none); their codebooks come from a recipe's levels (lowbit calibrate --vq-for)")
    g.add_argument("--residual", default=None, metavar="KIND[,KIND]",
                   help="a 1-bit residual on scale-only codes, one kind or K,V (none for one side): sign (least-squares "
                        "gain) or qjl (unbiased scores); 1 + scale bits / head_dim more per element (TurboQuant's 1-bit "
                        "stage); per layer: r (sign) or q (qjl) after a width in --layer-bits, e.g. '3,7=k2rv2'")
    g.add_argument("--lloyd-max", action="store_true", help="Lloyd-Max levels (Gaussian) instead of a uniform grid")
    g.add_argument("--rotation", default=None, metavar="none|hadamard|PATH",
                   help="rotate K and V: none, hadamard, or a RotationSet directory "
                        "(default: hadamard when K or V has <= 4 bits, except kivi*; none otherwise)")
    g.add_argument("--layer-bits", default=None, metavar="LAYERS=BITS[;...]",
                   help="per-layer bits overriding the scheme's, e.g. '7,18,20,23=int4' or '5,11,17=int8;13=k4v2'")
    g.add_argument("--recipe", default=None, metavar="FILE", help="KV recipe file (JSON or TOML) instead of the flags")
    parser.set_defaults(_kv_default=kv_default)


def scheme_from_args(args, name: str | None = None) -> KVScheme:
    """KVScheme from parsed args; `name` overrides args.kv (for commands that take a list of schemes)."""
    name = name if name is not None else getattr(args, "kv", None)
    recipe = getattr(args, "recipe", None)
    flags = {f: getattr(args, f, None) for f in _FLAGS}
    lloyd = bool(getattr(args, "lloyd_max", False))
    if recipe:
        given = [f"--{f.replace('_', '-')}" for f, v in flags.items() if v is not None] + (["--lloyd-max"] if lloyd else [])
        if given or (name is not None and name != getattr(args, "_kv_default", None)):
            extra = ", ".join(given + (["--kv"] if name is not None else []))
            raise LowbitError(f"--recipe holds the whole KV scheme; drop {extra} or drop --recipe")
        return load_recipe(recipe)
    if name is None:
        raise LowbitError(f"give a KV scheme with --kv ({', '.join(SCHEME_NAMES)}) or a --recipe file")
    return parse_kv_scheme(name, lloyd_max=lloyd, **flags)


def flags_given(args) -> list[str]:
    """The scheme flags given on the command line, as typed (e.g. ['--vq', '--group'])."""
    given = [f"--{f.replace('_', '-')}" for f in _FLAGS if getattr(args, f, None) is not None]
    return given + (["--lloyd-max"] if getattr(args, "lloyd_max", False) else [])


def scheme_or_none(args) -> KVScheme | None:
    """scheme_from_args, or None when neither --kv nor --recipe was given; a scheme flag without either is
    refused in one line instead of being ignored (e.g. `--vq needs --kv SCHEME`)."""
    if getattr(args, "kv", None) is None and getattr(args, "recipe", None) is None:
        given = flags_given(args)
        if given:
            raise LowbitError(f"{given[0]} needs --kv SCHEME (or a --recipe file)")
        return None
    return scheme_from_args(args)
