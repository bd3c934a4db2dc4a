"""Place the CUDA weight libraries built on the CPU host (carried in .gpu/cuda with its nvcc --version) into this
machine's build cache, when the device's nvcc is the same release: the device call then skips the builds (~2 min for
the small-M library).

    python3 scripts/place_cuda_lib.py        (from the repo root, PYTHONPATH=src)
"""
import re
import shutil
import subprocess
from pathlib import Path

from lowbit.kernels.gemm import cuda_gemm as weight_cuda
from lowbit.kernels.gemm import tiled as weight_tiled

dev = subprocess.run([weight_cuda.find_nvcc(), "--version"], capture_output=True, text=True, check=False).stdout
loc = Path(".gpu/cuda/nvcc_version.txt").read_text()


def release(text: str) -> str:
    return re.search(r"release [0-9.]+", text)[0]


for mod in (weight_cuda, weight_tiled):
    dst = mod.cache_path("sm_90a")
    prefix = dst.name.rsplit("_", 1)[0]  # lowbit_<source stem>_sm_90a
    src = next(iter(sorted(Path(".gpu/cuda").glob(prefix + "_*.so"))), None)
    if src is None:
        print(f"{prefix}: none carried")
        continue
    print(f"{prefix}: device nvcc {release(dev)} | host nvcc {release(loc)} | key match: {dst.name == src.name}")
    if release(dev) == release(loc) and not dst.exists():
        shutil.copy(src, dst)
        print("placed", dst.name)
