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


# x86 (avx512_bf16: AVX512 bf16 dot products; amx_bf16: AMX tiles) and Arm (bf16) flags that mean
# the CPU multiplies bf16 natively. Without them oneDNN emulates bf16 through fp32 conversions:
# `lowbit eval` of smollm2-135m ran 5.7x slower in bf16 than in fp32 on an AVX2-only CPU, while on an
# AMX CPU bf16 ran 2x faster than fp32.
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")
CPUINFO = "/proc/cpuinfo"


def cpu_native_bf16(cpuinfo: str | None = None) -> tuple[bool, str]:
    """(does this CPU run bf16 natively, how that was decided), from the CPU flags the kernel reports in
    /proc/cpuinfo (`flags` on x86, `Features` on Arm). `cpuinfo`: that file's text (tests pass their own).
    Where the file cannot be read (not Linux) the answer is False: fp32 is never the slow choice."""
    if cpuinfo is None:
        try:
            with open(CPUINFO, encoding="utf-8", errors="replace") as f:
                cpuinfo = f.read()
        except OSError:
            return False, f"{CPUINFO} unreadable, so no native bf16 assumed"
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, val = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            flags.update(val.split())
    have = [f for f in NATIVE_BF16_FLAGS if f in flags]
    if have:
        return True, f"CPU flags {'+'.join(have)} in {CPUINFO}"
    return False, f"no {'/'.join(NATIVE_BF16_FLAGS)} flag in {CPUINFO}"


def default_dtype(device: str, cpuinfo: str | None = None) -> tuple[str, str]:
    """(dtype name, why) that `--dtype auto` means on `device` ('cpu' | 'cuda'): bf16 on CUDA and on a
    CPU with native bf16, else fp32. The one place every command's dtype default is decided."""
    if device == "cuda":
        return "bf16", "CUDA"
    native, how = cpu_native_bf16(cpuinfo)
    return ("bf16", f"CPU with native bf16: {how}") if native else ("fp32", f"CPU without native bf16: {how}")
