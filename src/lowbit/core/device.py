"""The one parser of every command's `--device`: cpu | cuda | cuda:N | auto, checked before any work.

Without it `--device cuda` on a machine with no GPU (or a CPU-only torch) surfaced as torch's
`AssertionError: Torch not compiled with CUDA enabled` from deep inside model loading.
"""

from __future__ import annotations

from lowbit.core.errors import LowbitError

NO_CUDA = "CUDA is not available on this machine; use --device cpu"


def resolve_device(name: str | None, *, flag: str = "--device"):
    """torch.device for `name`; None or 'auto' -> cuda when available, else cpu. Raises LowbitError."""
    import torch

    if name is None or str(name).strip().lower() == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(str(name).strip())
    except RuntimeError:
        raise LowbitError(f"{flag} {name!r} is not a device; use cpu or cuda") from None
    if dev.type not in ("cpu", "cuda"):
        raise LowbitError(f"{flag} {name!r}: only cpu and cuda are supported")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise LowbitError(f"{flag} {name}: {NO_CUDA}")
        n = torch.cuda.device_count()
        if dev.index is not None and dev.index >= n:
            raise LowbitError(f"{flag} {name}: this machine has {n} CUDA device(s) (cuda:0..cuda:{n - 1})")
    return dev
