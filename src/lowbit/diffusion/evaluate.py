"""`lowbit eval images`: the unquantized DiT and each quantized checkpoint over fixed classes x seeds, gated.

    res = evaluate_images(ImageEvalOptions(model="artifacts/dit-digits32", checkpoints=["out/dit-w8a8"]))

For every image (class c, seed s): the structure metrics of lowbit.diffusion.gate and the PSNR against
the unquantized image of the same (c, s). A checkpoint's row is PASS only if every one of its images
passes; a FAIL row keeps its numbers in the JSON but they do not count (the summary marks it, nothing is
averaged across rows). The reference row is gated too (without PSNR).

Speed and memory, per row: wall_s_per_image = generation wall time / images (load excluded, one batch of
every image unless `batch` is set, classifier-free guidance doubling the transformer batch); peak_mb =
PeakMemory (CPU RSS or CUDA allocator peak) over the row's load + generation, with the previous row's
pipeline dropped first; weight_bytes = the transformer's safetensors on disk; held_bytes = the bytes of
the transformer's tensors in memory (QuantLinear's torch twin keeps one uint8 code per weight, so a
4-bit checkpoint holds more than it stores).

Outputs (each refused before any work if it exists, unless overwrite; written only after everything
ran): JSON (options, thresholds, calibration, per image metrics, rows), markdown, a PNG grid (rows =
reference + checkpoints, columns = classes x seeds), and optionally the summary JSON
`{"rows": [{scheme, method, psnr_mean, psnr_min, gate, weight_bytes, wall_s_per_image, peak_mb, device}]}`.
"""

from __future__ import annotations

import gc
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lowbit.artifacts import load_manifest
from lowbit.core.device import resolve_device
from lowbit.core.errors import LowbitError
from lowbit.diffusion.gate import DEFAULTS, Thresholds, calibrate, failures, image_metrics, seed_band
from lowbit.diffusion.grid import save_grid
from lowbit.diffusion.load import check_artifact, load_pipeline, pipeline_components, quantized_components
from lowbit.diffusion.measure import PeakMemory

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class ImageEvalOptions:
    model: str
    checkpoints: list[str] = field(default_factory=list)
    classes: tuple[int, ...] = tuple(range(8))
    seeds: tuple[int, ...] = (0, 1, 2, 3)
    steps: int = 25
    guidance: float = 2.0
    thresholds: Thresholds = DEFAULTS
    calibrate: bool = False
    device: str = "cpu"
    dtype: str = "fp32"  # fp32 | bf16 | fp16: the DiT's float tensors and activations
    batch: int | None = None
    json_out: str | None = None
    markdown_out: str | None = None
    plot_out: str | None = None
    summary_out: str | None = None
    overwrite: bool = False
    overrides: dict = field(default_factory=dict)  # thresholds given explicitly (they win over --calibrate)


def _outputs(o: ImageEvalOptions) -> list[Path]:
    return [Path(p) for p in (o.json_out, o.markdown_out, o.plot_out, o.summary_out) if p]


def check_options(o: ImageEvalOptions) -> None:
    """Every bad input as one LowbitError, before any model is loaded."""
    o.thresholds.check()
    if not o.classes or not o.seeds:
        raise LowbitError("--classes and --seeds must name at least one class and one seed")
    if o.steps < 1 or o.steps > 1000:
        raise LowbitError(f"--steps {o.steps} must be in [1, 1000]")
    if o.dtype not in DTYPES:
        raise LowbitError(f"image dtype {o.dtype!r}: use one of {', '.join(DTYPES)}")
    if o.batch is not None and o.batch < 1:
        raise LowbitError(f"--batch {o.batch} must be >= 1")

    resolve_device(o.device)
    ref = Path(o.model)
    pipeline_components(ref)
    n_cls = json.loads((ref / "transformer" / "config.json").read_text()).get("num_embeds_ada_norm") \
        if (ref / "transformer" / "config.json").is_file() else None
    bad = [c for c in o.classes if c < 0 or (n_cls is not None and c >= n_cls)]
    if bad:
        raise LowbitError(f"class {bad[0]} is not one of the model's classes 0..{(n_cls or 1) - 1}")
    if quantized_components(ref):
        raise LowbitError(f"--model {ref} is a quantized pipeline; pass the unquantized one (the reference)")
    check_artifact(ref, need_native=False)
    seen = set()
    for c in o.checkpoints:
        p = Path(c)
        comps = pipeline_components(p)
        if not quantized_components(p):
            raise LowbitError(f"checkpoint {p} has no quantized component ({', '.join(sorted(comps))}): pass "
                              "directories written by `lowbit quantize --component transformer`")
        check_artifact(p, need_native=True)
        if p.resolve() in seen:
            raise LowbitError(f"checkpoint {p} is given twice")
        seen.add(p.resolve())
    for path in _outputs(o):
        if path.exists() and not o.overwrite:
            raise LowbitError(f"{path} exists; pass --overwrite to replace it (nothing was run)")
        if path.is_dir():
            raise LowbitError(f"{path} is a directory; name a file")


def _row_info(path: Path) -> dict:
    if not (path / "manifest.json").is_file():
        return {"scheme": "fp32", "method": "none"}
    m = load_manifest(path)
    r = m.recipe
    if "scheme" not in r:
        return {"scheme": "fp32", "method": "none"}
    return {"scheme": r["scheme"]["name"], "method": r.get("method"), "planted": m.inputs.get("planted")}


def _weights(pipe, path: Path) -> tuple[int, int]:
    tr = pipe.transformer
    held = sum(t.numel() * t.element_size() for t in list(tr.parameters()) + list(tr.buffers()))
    disk = sum(f.stat().st_size for f in (path / "transformer").glob("*.safetensors"))
    return disk, held


def generate(pipe, classes, seeds, *, steps, guidance, batch=None, device="cpu") -> tuple[torch.Tensor, float]:
    """(images float32 [N, 4, S, S], wall seconds) in batches of `batch` (None: all at once)."""
    n = len(classes)
    b = batch or n
    out = []
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(0, n, b):
        out.append(pipe(classes[i:i + b], seeds[i:i + b], num_inference_steps=steps, guidance_scale=guidance))
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    return torch.cat(out), time.perf_counter() - t0


def _run_row(path: Path, o: ImageEvalOptions, classes, seeds):
    gc.collect()
    with PeakMemory(o.device) as pm:
        pipe = load_pipeline(path, device=o.device, dtype=DTYPES[o.dtype])
        imgs, wall = generate(pipe, classes, seeds, steps=o.steps, guidance=o.guidance, batch=o.batch,
                              device=o.device)
    disk, held = _weights(pipe, path)
    tile = int(pipe.transformer.config.patch_size)
    backend = getattr(pipe, "lowbit_backend", None)
    del pipe
    return imgs, {"backend": backend, "wall_s": round(wall, 3), "wall_s_per_image": round(wall / len(classes), 4),
                  "peak_mb": round(pm.peak_mb, 1), "start_mb": round(pm.start_mb, 1), "memory_source": pm.source,
                  "weight_bytes": disk, "held_bytes": held}, tile


def _finite_or_none(x):
    return None if x is None or not math.isfinite(x) else round(x, 3)


def evaluate_images(o: ImageEvalOptions, *, log=print) -> dict:
    """Run the evaluation (module docstring); returns the JSON report (also written where asked)."""
    check_options(o)
    classes = [c for c in o.classes for _ in o.seeds]
    seeds = [s for _ in o.classes for s in o.seeds]
    ref_imgs, ref_perf, tile = _run_row(Path(o.model), o, classes, seeds)
    ref_m = [image_metrics(ref_imgs[i], tile) for i in range(len(classes))]
    band = seed_band(ref_imgs, classes)
    cal_th, cal_info = calibrate(ref_m, band)
    th = cal_th.replace(**o.overrides) if o.calibrate else o.thresholds
    log(f"reference {o.model}: {len(classes)} images, {ref_perf['wall_s_per_image']:.3f} s/image; seed-to-seed "
        f"PSNR band {min(band):.2f}..{max(band):.2f} dB" if band else f"reference {o.model}: {len(classes)} images")
    rows, grid_rows, labels = [], [ref_imgs], ["fp32 (ref)"]

    def row(path, info, imgs, perf, metrics):
        bad = [{"class": classes[i], "seed": seeds[i], "why": failures(m, th)} for i, m in enumerate(metrics)
               if failures(m, th)]
        ps = [m["psnr"] for m in metrics if m.get("psnr") is not None]
        fin = [p for p in ps if math.isfinite(p)]
        r = {"checkpoint": str(path), **info, "gate": "FAIL" if bad else "PASS", "images": len(metrics),
             "failing_images": len(bad), "failures": bad,
             "psnr_mean": (_finite_or_none(sum(fin) / len(fin)) if fin and len(fin) == len(ps) else None),
             "psnr_min": (_finite_or_none(min(fin)) if fin and len(fin) == len(ps) else None),
             **perf, "device": o.device, "metrics": metrics}
        rows.append(r)
        return r

    row(Path(o.model), {"scheme": "fp32", "method": "none"}, ref_imgs, ref_perf, ref_m)
    for c in o.checkpoints:
        p = Path(c)
        imgs, perf, _ = _run_row(p, o, classes, seeds)
        ms = [image_metrics(imgs[i], tile, ref_imgs[i]) for i in range(len(classes))]
        r = row(p, _row_info(p), imgs, perf, ms)
        grid_rows.append(torch.nan_to_num(imgs, nan=0.0))
        labels.append(f"{r['scheme']} {r['method']}" + (f" planted {r['planted']['kind']}" if r.get("planted") else ""))
        log(f"{p}: {r['gate']} ({r['failing_images']}/{r['images']} failing), PSNR mean "
            f"{r['psnr_mean']} min {r['psnr_min']} dB, {perf['wall_s_per_image']:.3f} s/image, "
            f"peak {perf['peak_mb']} MB")
    res = {"options": {"model": o.model, "checkpoints": list(o.checkpoints), "classes": list(o.classes),
                       "seeds": list(o.seeds), "steps": o.steps, "guidance": o.guidance, "batch": o.batch,
                       "device": o.device, "dtype": o.dtype, "tile": tile, "calibrated_in_run": o.calibrate},
           "thresholds": th.to_dict(), "calibration": {"thresholds": cal_th.to_dict(), **cal_info},
           "gate": "FAIL" if any(r["gate"] == "FAIL" for r in rows) else "PASS", "rows": rows,
           "env": _env()}
    _write_outputs(o, res, grid_rows, labels)
    return res


def _env() -> dict:
    import platform

    import diffusers

    return {"torch": torch.__version__, "diffusers": diffusers.__version__, "threads": torch.get_num_threads(),
            "cpu": platform.processor() or platform.machine(),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def summary(res: dict) -> dict:
    """The summary JSON's rows (see module docstring)."""
    keys = ("scheme", "method", "psnr_mean", "psnr_min", "gate", "weight_bytes", "wall_s_per_image", "peak_mb",
            "device")
    out = []
    for r in res["rows"]:
        d = {k: r.get(k) for k in keys}
        d["checkpoint"] = Path(r["checkpoint"]).name
        if r.get("planted"):
            d["planted"] = r["planted"]
        out.append(d)
    return {"rows": out}


def markdown(res: dict) -> str:
    o = res["options"]
    lines = [f"# lowbit eval images: {o['model']}", "",
             (f"{len(o['classes'])} classes x {len(o['seeds'])} seeds, {o['steps']} DDIM steps, guidance "
             f"{o['guidance']}, device {o['device']}; run gate **{res['gate']}**"), "",
             ("| checkpoint | scheme | method | gate | failing | PSNR mean | PSNR min | weight bytes | held bytes "
             "| s/image | peak MB |"), "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {Path(r['checkpoint']).name} | {r['scheme']} | {r['method']} | {r['gate']} | "
                     f"{r['failing_images']}/{r['images']} | {r['psnr_mean']} | {r['psnr_min']} | {r['weight_bytes']} | "
                     f"{r['held_bytes']} | {r['wall_s_per_image']} | {r['peak_mb']} |")
    th, cal = res["thresholds"], res["calibration"]
    lines += ["", "Thresholds: " + ", ".join(f"{k} {v:.4g}" for k, v in th.items()),
              "", f"Calibration on the reference ({cal['rule']}): " + ", ".join(
                  f"{k} {v['min']:.4g}..{v['max']:.4g}" for k, v in cal.items()
                  if isinstance(v, dict) and "min" in v and k != "thresholds")]
    for r in res["rows"]:
        for f in r["failures"][:5]:
            lines.append(f"- FAIL {Path(r['checkpoint']).name} class {f['class']} seed {f['seed']}: "
                         f"{'; '.join(f['why'])}")
        if len(r["failures"]) > 5:
            lines.append(f"- ... and {len(r['failures']) - 5} more failing images of {Path(r['checkpoint']).name}")
    return "\n".join(lines) + "\n"


def _atomic_write(path: Path, write) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _write_outputs(o: ImageEvalOptions, res: dict, grid_rows, labels) -> None:
    def js(obj):
        return json.dumps(obj, indent=1, allow_nan=False, default=str)

    text = js(_nan_to_none(res))
    if o.json_out:
        _atomic_write(Path(o.json_out), lambda p: p.write_text(text))
    if o.markdown_out:
        _atomic_write(Path(o.markdown_out), lambda p: p.write_text(markdown(res)))
    if o.plot_out:
        _atomic_write(Path(o.plot_out), lambda p: save_grid(grid_rows, p, labels=labels))
    if o.summary_out:
        _atomic_write(Path(o.summary_out), lambda p: p.write_text(js(_nan_to_none(summary(res)))))


def _nan_to_none(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _nan_to_none(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_nan_to_none(v) for v in x]
    return x
