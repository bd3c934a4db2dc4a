"""Probe (s25, issue 18): s20's fp8 scales and s21's VQ 2x16 keys (and s24's VQ values) together, on smollm2-135m.

The recipe s20/smollm2-135m-k4x11@2.5.toml (K int4 on 11 layers, int2 elsewhere, V int2) with every scalar codec's
scales rounded to e4m3 (s20/fp8_scale_probe.py's encoder patch), and its 19 int2 key layers replaced by s21's VQ
2x16 codec (s21/vq_key_probe.py) whose per-row scale is rounded to e4m3 the same way. Held bits with 1-byte scales:
int2 and VQ 2x16 rows 2.125, int4 rows 4.125 b/elt -> (11 * 4.125 + 19 * 2.125) / 30 / 2 + 2.125 / 2 = 2.4917 at the
middle tier, plus the fp16 codebooks amortised at 8k: 2.492 with VQ keys, 2.508 with VQ 4x256 values too (storage in
the probe is unchanged: fake quant of the scales).

    VQ_CB=benchmarks/results/quality/s21/vq_cb_2x16.pt [VQ_V_CB=benchmarks/results/quality/s24/vq_v_cb_4x256.pt] \
        python fp8_vq_probe.py eval <lowbit eval arguments>
VQ_V_CB adds s24's VQ 4x256 values (16 bytes of codes + the scale, rounded to e4m3: 2.125 b/elt, int2's bits here).
"""
import importlib.util
import os
import sys
from pathlib import Path

import torch

HERE = Path(__file__).parent


def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


fp8 = load("fp8_scale_probe", HERE.parent / "s20" / "fp8_scale_probe.py")  # s20's encoder patch
fp8.A.quantize_centred = fp8.fp8_scaled

vk = load("vq_key_probe", HERE.parent / "s21" / "vq_key_probe.py")
_vq_encode = vk.vq_encode


def vq_encode_fp8(x, cb, sub):
    idx, s = _vq_encode(x, cb, sub)
    s = s.float()
    amax = s.abs().amax()
    m = torch.exp2(torch.floor(torch.log2(amax / 256))) if amax > 0 else torch.tensor(1.0)
    return idx, ((s / m).to(torch.float8_e4m3fn).float() * m).to(torch.float16)


vk.vq_encode = vq_encode_fp8
if os.environ.get("VQ_V_CB"):  # also s24's VQ values (its codec, every 2-bit V), scales rounded to e4m3 as well
    from lowbit.kv import layer as L

    vv = load("vq_value_probe", HERE.parent / "s24" / "vq_value_probe.py")
    vv.vk.vq_encode = vq_encode_fp8
    blob = torch.load(os.environ["VQ_V_CB"])
    ebits = blob["entries"].bit_length() - 1
    base_init = L.QuantizedKVLayer.__init__

    def init(self, plan, **kw):
        base_init(self, plan, **kw)
        c = self.v_codec
        if c.quantized and c.bits == 2:
            self.v_codec = vv.make_vq_codec(c, blob["codebooks"][self.layer_idx], blob["sub"], ebits)

    L.QuantizedKVLayer.__init__ = init
sys.exit(vk.patched_eval(sys.argv[1:]))
