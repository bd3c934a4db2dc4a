"""Place the small-M CUDA weight library built on the CPU host (carried in .gpu/cuda with its nvcc --version) into
this machine's build cache, when the device's nvcc is the same release: the device call then skips the ~2 min build.

    python3 scripts/place_cuda_lib.py        (from the repo root, PYTHONPATH=src)
"""
import re
import shutil
import subprocess
from pathlib import Path

from lowbit.kernels import weight_cuda as wc

dev = subprocess.run([wc.find_nvcc(), "--version"], capture_output=True, text=True, check=False).stdout
loc = Path(".gpu/cuda/nvcc_version.txt").read_text()


def release(text: str) -> str:
    return re.search(r"release [0-9.]+", text)[0]


dst, src = wc.cache_path("sm_90a"), next(Path(".gpu/cuda").glob("*.so"))
print("device nvcc:", release(dev), "| host nvcc:", release(loc), "| key match:", dst.name == src.name)
if release(dev) == release(loc) and not dst.exists():
    shutil.copy(src, dst)
    print("placed", dst.name)
