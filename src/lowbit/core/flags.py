"""Flag spellings every command shares: one dtype vocabulary, and old spellings kept for one release.

    add_dtype(parser, default="fp32")     # --dtype bf16 | fp16 | fp32 (bfloat16 / float16 / float32 warn)
    add_dtype(parser, default=AUTO)       # + auto: what the device runs fast (lowbit.core.device.default_dtype)
    name, why = resolve_dtype(args.dtype, device)   # 'auto' -> 'bf16' | 'fp32' and why; print both
    torch_dtype(name)                     # -> torch.bfloat16 ...
    parser.add_argument("--old", action=deprecated("--new"), dest="new")   # works, prints one warning line

Importing this module imports no torch (the CLI builds every parser without it).
"""

from __future__ import annotations

import argparse
import sys

from lowbit.core.device import default_dtype
from lowbit.core.errors import LowbitError

DTYPE_NAMES = ("bf16", "fp16", "fp32")
AUTO = "auto"
AUTO_HELP = "auto: bf16 on CUDA and on CPUs with native bf16 (avx512_bf16 / amx_bf16), else fp32"
# spellings accepted for one release, each with a deprecation line
_OLD_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}


def warn_deprecated(old: str, new: str) -> None:
    print(f"warning: {old} is deprecated and will be removed in the next release; use {new}", file=sys.stderr)


def dtype_name(value: str) -> str:
    """argparse type for --dtype: 'bf16' | 'fp16' | 'fp32'; the torch spellings work with a warning."""
    v = str(value).strip().lower()
    if v in DTYPE_NAMES or v == AUTO:
        return v
    if v in _OLD_DTYPES:
        warn_deprecated(f"--dtype {value}", f"--dtype {_OLD_DTYPES[v]}")
        return _OLD_DTYPES[v]
    raise argparse.ArgumentTypeError(f"{value!r} is not a dtype; use one of {', '.join(DTYPE_NAMES)}")


def add_dtype(parser, *, default: str, help: str) -> None:
    names = (*DTYPE_NAMES, AUTO) if default == AUTO else DTYPE_NAMES
    extra = f"; {AUTO_HELP}" if default == AUTO else ""
    parser.add_argument("--dtype", type=dtype_name, default=default, metavar="|".join(names),
                        help=f"{help} (default {default}{extra})")


def resolve_dtype(name: str, device) -> tuple[str, str]:
    """(dtype name, how it was chosen) for --dtype `name` on `device` (a torch.device or 'cpu'/'cuda'):
    'auto' asks lowbit.core.device.default_dtype (fp32 on a CPU without native bf16), anything else is kept."""
    if name != AUTO:
        return _OLD_DTYPES.get(name, name), "--dtype"

    return default_dtype(getattr(device, "type", None) or str(device).split(":")[0])


def torch_dtype(name: str):
    """'bf16' -> torch.bfloat16 (and the old spellings)."""
    import torch

    key = _OLD_DTYPES.get(name, name)
    table = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    if key not in table:
        raise LowbitError(f"dtype {name!r} unknown; use one of {', '.join(DTYPE_NAMES)}")
    return table[key]


def deprecated(new: str):
    """An argparse action for an old option string that stores into the new one's dest, with a warning."""

    class _Deprecated(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            warn_deprecated(option_string or self.dest, new)
            setattr(namespace, self.dest, values)

    return _Deprecated
