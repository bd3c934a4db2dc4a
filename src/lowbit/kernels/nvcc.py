"""Build and cache lowbit's CUDA C++ libraries (kernels/*/cuda/*.cu) with nvcc; one home for every CUDA source.

    path = build(source, "sm_90a")       compiled now unless the cache has it
    cache_path(source, "sm_90a")         where that library lives (placeable from another machine)

The libraries need no torch C++ headers: `extern "C"` launchers take raw device pointers and the caller's stream,
and Python calls them through ctypes (so a call is capturable in a CUDA graph). Build cache: ~/.cache/lowbit/cuda
(or the temp dir when home is not writable), one file per sha256 of (source, `nvcc --version`, arch, flags),
named lowbit_<source stem>_<arch>_<key>.so; a build writes a temporary name and renames it, so processes building
at once never read a half-written library.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from lowbit.core.errors import LowbitError

NVCC: str | None = None  # None: `nvcc` on PATH, else /usr/local/cuda/bin/nvcc (tests point it elsewhere)
FLAGS = ("-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC")


def find_nvcc() -> str:
    """The nvcc to build with, or a one-line LowbitError."""
    cand = NVCC or shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    if not (os.path.isfile(cand) and os.access(cand, os.X_OK)):
        raise LowbitError(f"nvcc not found ({cand}): lowbit's CUDA kernels are built at first use; install the CUDA "
                          "toolkit (nvcc) or use the Triton kernels (they need no nvcc)")
    return cand


_nvcc_state: list = []


def nvcc_missing() -> str | None:
    """None when nvcc is there to build the kernels, else the one-line reason (checked once per process; the
    dispatch then passes over the CUDA kernels instead of failing every call)."""
    if not _nvcc_state:
        try:
            find_nvcc()
            _nvcc_state.append(None)
        except LowbitError as e:
            _nvcc_state.append(str(e))
    return _nvcc_state[0]


def arch_for(cap: tuple[int, int]) -> str:
    """nvcc's -arch for a compute capability (sm_90a on Hopper)."""
    return f"sm_{cap[0]}{cap[1]}" + ("a" if tuple(cap) == (9, 0) else "")


def _cache_dir() -> Path:
    for d in (Path.home() / ".cache" / "lowbit" / "cuda", Path(tempfile.gettempdir()) / f"lowbit-cuda-{os.getuid()}"):
        try:
            d.mkdir(parents=True, exist_ok=True)
            if os.access(d, os.W_OK):
                return d
        except OSError:
            continue
    raise LowbitError("no writable cache directory for lowbit's CUDA kernels (tried ~/.cache/lowbit and the temp "
                      "dir): make one of them writable")


def flags(arch: str, defines: tuple[str, ...] = ()) -> tuple[str, ...]:
    return (*FLAGS, f"-gencode=arch=compute_{arch[3:]},code={arch}", *(f"-D{d}" for d in defines))


def cache_path(source: Path, arch: str, *, cache_dir: Path | None = None, defines: tuple[str, ...] = ()) -> Path:
    """Where build() keeps `source`'s library for `arch`: named by the sha256 of (source, `nvcc --version`, flags),
    so a library built elsewhere with the same nvcc release and flags can be placed there."""
    nvcc = find_nvcc()
    try:
        ver = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60, check=False).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise LowbitError(f"{nvcc} --version failed ({type(e).__name__}): check the CUDA toolkit install") from e
    key = hashlib.sha256(Path(source).read_bytes() + ver.encode() + " ".join(flags(arch, defines)).encode())
    return Path(cache_dir or _cache_dir()) / f"lowbit_{Path(source).stem}_{arch}_{key.hexdigest()[:20]}.so"


def build(source: Path, arch: str, *, cache_dir: Path | None = None, defines: tuple[str, ...] = ()) -> Path:
    """`source`'s shared library for `arch`, compiled now unless the cache has it. `defines` (-D...) are for
    compile-only tests."""
    nvcc = find_nvcc()
    out = cache_path(source, arch, cache_dir=cache_dir, defines=defines)
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)  # a new cache directory (else nvcc's link step fails obscurely)
    tmp = out.with_name(f"{out.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        r = subprocess.run([nvcc, *flags(arch, defines), "-o", str(tmp), str(source)], capture_output=True, text=True,
                           timeout=900, check=False)
        if r.returncode != 0:
            first = next((ln for ln in r.stderr.splitlines() if "error" in ln), r.stderr.strip()[:200])
            raise LowbitError(f"nvcc failed to build {Path(source).name} for {arch}: {first.strip()} (see `nvcc "
                              "--version`; the kernels need CUDA >= 12 and sm_80+)")
        os.replace(tmp, out)  # atomic: another process sees the old state or the whole file
    finally:
        if tmp.exists():
            tmp.unlink()
    return out
