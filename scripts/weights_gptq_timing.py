"""Time GPTQ (calibration passes + per-linear GPTQ) on a model's real geometry with N torch threads.

    taskset -c 0,1 python scripts/weights_gptq_timing.py --threads 2            # random weights, smollm2 geometry
    python scripts/weights_gptq_timing.py --model smollm2-135m --threads 2      # the real weights

GPTQ's cost depends on the shapes (layers, hidden, intermediate), the calibration token count and
the threads, not on the weight values, so the random-weight model of the same geometry
(lowbit.models.tiny with every layer) times the same work when the real weights cannot be had.
Prints one JSON line: seconds, threads, layers, tokens, scheme, calib dtype.
"""

from __future__ import annotations

import argparse
import json
import logging
import time

import torch

from lowbit.weights.apply import quantize_model
from lowbit.weights.scheme import parse_weight_scheme


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="built-in name or HF dir (default: random weights, --geometry)")
    ap.add_argument("--geometry", default="smollm2-135m")
    ap.add_argument("--weights", default="w4a16-g64")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calib-seqs", type=int, default=128)
    ap.add_argument("--calib-seq-len", type=int, default=512)
    ap.add_argument("--calib-dtype", choices=("float32", "bfloat16"), default="bfloat16")
    ap.add_argument("--rotate", action="store_true")
    ap.add_argument("--verbose", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    logging.basicConfig(level=logging.INFO if a.verbose else logging.WARNING)
    if a.model:
        from lowbit.models import load

        model = load(a.model).model
        source = a.model
    else:
        from lowbit.models.registry import get_builtin
        from lowbit.models.tiny import tiny_model

        n_layers = get_builtin(a.geometry).config_dict()["num_hidden_layers"]
        model, _ = tiny_model(a.geometry, num_layers=n_layers)
        source = f"random weights, {a.geometry} geometry"
    g = torch.Generator().manual_seed(0)
    calib = torch.randint(0, model.config.vocab_size, (a.calib_seqs, a.calib_seq_len), generator=g)
    cd = torch.bfloat16 if a.calib_dtype == "bfloat16" else None
    t = time.perf_counter()
    rep = quantize_model(model, parse_weight_scheme(a.weights), method="gptq", calib=calib, rotate=a.rotate,
                         calib_dtype=cd)
    secs = time.perf_counter() - t
    print(json.dumps({"seconds": round(secs, 1), "threads": torch.get_num_threads(), "layers": rep.layers,
                      "linears": len(rep.quantized), "tokens": int(calib.numel()), "scheme": a.weights,
                      "calib_dtype": a.calib_dtype, "rotate": a.rotate, "source": source,
                      "torch": torch.__version__}))


if __name__ == "__main__":
    main()
