"""Place the CUDA libraries built on the CPU host (carried in .gpu/cuda with its nvcc --version: the small-M weight
kernel and the int2 decode kernel) into this machine's build cache, when the device's nvcc is the same release: the
device call then skips the build (~2 min for the weight kernel).

    python3 scripts/place_cuda_lib.py        (from the repo root, PYTHONPATH=src)
"""
import re
import shutil
import subprocess
from pathlib import Path

from lowbit.kernels import decode_cuda as dc
from lowbit.kernels import weight_cuda as wc

dev = subprocess.run([wc.find_nvcc(), "--version"], capture_output=True, text=True, check=False).stdout
loc = Path(".gpu/cuda/nvcc_version.txt").read_text()


def release(text: str) -> str:
    return re.search(r"release [0-9.]+", text)[0]


for source in (wc.SOURCE, dc.SOURCE):
    dst = wc.cache_path("sm_90a", source=source)
    src = Path(".gpu/cuda") / dst.name
    print(f"{source.name}: device nvcc {release(dev)} | host nvcc {release(loc)} | carried with this key: {src.exists()}")
    if release(dev) == release(loc) and src.exists() and not dst.exists():
        shutil.copy(src, dst)
        print("placed", dst.name)
