"""`lowbit bench images`: the capacity matrix, batch x resolution x checkpoint, each cell gated.

    res = capacity_matrix("artifacts/dit-digits32", ["out/dit-w8a8"], batches=(1, 8, 32), sizes=(32, 64))

Per checkpoint (the unquantized --model first): one load (its wall time and peak memory recorded), then
per (size, batch) cell one timed generation of `batch` images (classes cycling through `classes`, seeds
0..batch-1, `steps` DDIM steps, classifier-free guidance, so the transformer sees 2 x batch images),
after one untimed warm-up call of the same shape. A cell records wall_s_per_image, peak_mb (CPU: process
RSS sampled during the call; CUDA: max_memory_allocated during the call), held_bytes (the
transformer's tensors in memory) and weight_bytes (its safetensors on disk), and its gate: the
structure metrics of lowbit.diffusion.gate on every image of the cell under the default thresholds,
plus PSNR against the unquantized model's images of the same cell (psnr_min) — so a cell that runs fast
but draws garbage says FAIL. At a size other than the training size the reference itself draws off its
training distribution; its own row shows what the gate makes of that (ref_gate), and a checkpoint's
cell counts only where its reference cell passes.
"""

from __future__ import annotations

import gc
import time
from pathlib import Path

import torch

from lowbit.core.errors import LowbitError
from lowbit.diffusion.evaluate import DTYPES, ImageEvalOptions, _env, _row_info, _weights, check_options
from lowbit.diffusion.gate import DEFAULTS, Thresholds, failures, image_metrics
from lowbit.diffusion.load import load_pipeline
from lowbit.diffusion.measure import PeakMemory


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def capacity_matrix(model: str, checkpoints: list[str], *, batches, sizes, classes=tuple(range(10)), steps=10,
                    guidance=2.0, device="cpu", dtype="fp32", thresholds: Thresholds = DEFAULTS,
                    log=print) -> dict:
    check_options(ImageEvalOptions(model=model, checkpoints=list(checkpoints), classes=tuple(classes), steps=steps,
                                   guidance=guidance, device=device, dtype=dtype, thresholds=thresholds))
    if not batches or min(batches) < 1 or not sizes:
        raise LowbitError("--batch and --resolution need positive values")
    ref_cells: dict[tuple[int, int], torch.Tensor] = {}
    rows = []
    for path in [model, *checkpoints]:
        is_ref = path == model
        gc.collect()
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
        t0 = time.perf_counter()
        with PeakMemory(device) as pm:
            pipe = load_pipeline(path, device=device, dtype=DTYPES[dtype])
        load_s = time.perf_counter() - t0
        patch = int(pipe.transformer.config.patch_size)
        bad = [s for s in sizes if s % patch]
        if bad:
            raise LowbitError(f"--resolution {bad[0]} is not a multiple of the DiT's patch size {patch}")
        disk, held = _weights(pipe, Path(path))
        info = {"checkpoint": str(path), **_row_info(Path(path)), "load_s": round(load_s, 3),
                "load_peak_mb": round(pm.peak_mb, 1), "weight_bytes": disk, "held_bytes": held,
                "backend": getattr(pipe, "lowbit_backend", None), "cells": []}
        for size in sizes:
            for b in batches:
                cls = [classes[i % len(classes)] for i in range(b)]
                seeds = list(range(b))
                pipe(cls[:1], seeds[:1], num_inference_steps=1, guidance_scale=guidance, size=size)  # warm-up
                gc.collect()
                with PeakMemory(device) as pm:
                    _sync(device)
                    t = time.perf_counter()
                    imgs = pipe(cls, seeds, num_inference_steps=steps, guidance_scale=guidance, size=size)
                    _sync(device)
                    wall = time.perf_counter() - t
                ref = ref_cells.get((size, b))
                ms = [image_metrics(imgs[i], patch, None if ref is None else ref[i]) for i in range(b)]
                nfail = sum(bool(failures(m, thresholds)) for m in ms)
                if is_ref:
                    ref_cells[(size, b)] = imgs
                cell = {"size": size, "batch": b, "wall_s": round(wall, 4), "wall_s_per_image": round(wall / b, 5),
                        "peak_mb": round(pm.peak_mb, 1), "memory_source": pm.source,
                        "gate": "FAIL" if nfail else "PASS", "failing_images": nfail,
                        "psnr_min": None if is_ref else round(min(m["psnr"] for m in ms), 3)
                        if all(m["finite"] for m in ms) else None}
                info["cells"].append(cell)
                log(f"{Path(path).name} {size}px batch {b}: {cell['wall_s_per_image']:.4f} s/image, peak "
                    f"{cell['peak_mb']} MB, gate {cell['gate']}")
        rows.append(info)
        del pipe
    ref_gate = {(c["size"], c["batch"]): c["gate"] for c in rows[0]["cells"]}
    for r in rows[1:]:
        for c in r["cells"]:
            c["ref_gate"] = ref_gate[(c["size"], c["batch"])]
            c["counts"] = c["gate"] == "PASS" and c["ref_gate"] == "PASS"
    return {"kind": "lowbit bench images", "model": model, "checkpoints": list(checkpoints), "batches": list(batches),
            "sizes": list(sizes), "steps": steps, "guidance": guidance, "device": device, "dtype": dtype,
            "thresholds": thresholds.to_dict(), "rows": rows, "env": _env()}
