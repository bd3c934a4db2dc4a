"""A few launches of the fused kernel at one shape (library defaults), for Nsight Compute.

    ncu -k regex:_stage1 --launch-skip 3 --launch-count 1 python3 benchmarks/ncu_case.py B L BITS ['{"num_warps": 1}']
"""

import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "0")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import json

import torch

from lowbit.tools.bench import attention as bench
from lowbit.kernels.attention.tiers import KernelConfig

B, L, bits = (int(x) for x in sys.argv[1:4])
fields = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
Hq, Hkv, D, group = bench.GEOMETRIES["llama3-8b"]
fns, keep = bench.kernel_case(B, Hq, Hkv, D, L, bits, bits, group, 2, KernelConfig(**fields))
for i in range(6):
    fns[i % 2]()
torch.cuda.synchronize()
print("ok")
