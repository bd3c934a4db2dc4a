"""A few launches of one packed-latent decode kernel at tp8 / 128-head shapes, for Nsight Compute.

    ncu -k regex:'_geo_stage1|_lat_stage1' --launch-skip 2 --launch-count 1 \
        python3 benchmarks/latent_ncu_case.py geo|new B HQ ['{"heads": 16, "block_t": 64, "num_warps": 4}']
"""

import json
import math
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "0")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from latent_proto_bench import new_fn, splits_for  # noqa: E402
from lowbit.kernels.decode_geometry import decode_attention_latent  # noqa: E402
from lowbit.kernels.geo_bench import _rand_packed  # noqa: E402

which, B, Hq = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
cfg = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
D, DR, L = 512, 64, 32768
g = torch.Generator(device="cuda").manual_seed(0)
q = torch.randn(B, Hq, D, device="cuda", dtype=torch.bfloat16, generator=g)
qp = torch.randn(B, Hq, DR, device="cuda", dtype=torch.bfloat16, generator=g)
out = torch.empty(B, Hq, D, device="cuda", dtype=torch.bfloat16)
c, s, z = _rand_packed(B, 1, L, D, 2, 128, g, "cuda")
pe = torch.randn(B, 1, L, DR, device="cuda", dtype=torch.bfloat16, generator=g)
lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
if which == "geo":
    f = lambda: decode_attention_latent(q, qp, c, s, z, pe, bits=2, out=out)  # noqa: E731
else:
    cfg = dict(cfg, num_splits=splits_for(B, Hq, cfg["heads"], L, cfg["block_t"], waves=cfg.get("waves", 2)))
    f = new_fn(q, qp, {"c": c, "s": s, "z": z, "pe": pe}, lens, 1 / math.sqrt(D + DR), cfg, out)
for _ in range(4):
    f()
torch.cuda.synchronize()
print("ok")
