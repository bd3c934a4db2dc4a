"""Quantize one component (the DiT) of a diffusers pipeline directory into a compressed-tensors checkpoint.

    result = quantize_pipeline("artifacts/dit-digits32", "out/dit-w8a8", component="transformer",
                               scheme=parse_weight_scheme("w8a8"), method="gptq")

Output: a new diffusers directory (a native-packed lowbit artifact):
    model_index.json, scheduler/...   copied byte for byte from the source (listed in the manifest,
                                      sha256 equal to the source's: inputs.copied)
    transformer/config.json           the source config + compressed-tensors `quantization_config`
    transformer/diffusion_pytorch_model.safetensors
                                      (header metadata lowbit_artifact = diffusers-compressed-tensors, so a copy
                                      that lost manifest.json is refused by the loader, not trusted unverified)
                                      per quantized linear the compressed-tensors tensors
                                      (lowbit.weights.export.checkpoint_state: packed int32 for w4a16 /
                                      w8a16, int8 for w8a8), every other tensor as is
    manifest.json                     inputs (source dir, its manifest's transformer sha256, calibration),
                                      recipe (scheme, method, ignore), counts (quantized / skipped / ignored
                                      linears, calibration rows, bytes)
Files of the source that are not pipeline components (samples.png, its manifest) are not copied.

Which linears: every nn.Linear of the component not matched by `ignore` (lowbit.weights.apply's rules:
a name, a ".name" suffix, or "re:REGEX"). Default ignore: proj_out_2, the final projection from the
hidden width to pixels (what DiT quantizers usually keep; pass ignore=[] to quantize it too). The
patch embedding is a Conv2d and the class / timestep tables are embeddings: not linears, kept as is,
and counted in the manifest (non_linear_params). A group that does not divide a linear's in_features
is refused before any work, naming the linear.

Methods: rtn (round to nearest on the per-group grid) or gptq. GPTQ's calibration is the DiT's own
linear inputs while the unquantized pipeline samples: `calib_classes` x `calib_seeds` (seeds disjoint
from the evaluation's 0..N) over `calib_steps` DDIM steps, both halves of classifier-free guidance;
every linear's H = X^T X / n over all those calls (not sequential: every H is the unquantized model's).
The adaLN and timestep linears see one row per image per step, so their H has rank <= rows; GPTQ's
dampening covers that, and the count of rows per linear is recorded.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lowbit.artifacts import ArtifactWriter, load_manifest, sha256_file
from lowbit.core.errors import LowbitError
from lowbit.diffusion.load import WEIGHTS_NAME, check_artifact, load_pipeline, pipeline_components
from lowbit.weights.apply import target_linears
from lowbit.weights.arch import set_module
from lowbit.weights.gptq import gptq_quantize, rtn_quantize
from lowbit.weights.hooks import HessianCollector
from lowbit.weights.qlinear import QuantLinear
from lowbit.weights.scheme import WeightScheme

DEFAULT_IGNORE = ("proj_out_2",)
ARTIFACT_KIND = "diffusers-compressed-tensors"
METHODS = ("rtn", "gptq")


@dataclass(frozen=True)
class CalibSpec:
    """GPTQ calibration: images of every class in `classes` x `seeds`, sampled over `steps` DDIM steps."""

    classes: tuple[int, ...] = tuple(range(10))
    seeds: tuple[int, ...] = (1000, 1001, 1002, 1003)
    steps: int = 50
    guidance: float = 2.0

    def to_dict(self) -> dict:
        return {"classes": list(self.classes), "seeds": list(self.seeds), "steps": self.steps,
                "guidance": self.guidance}


@dataclass
class DiTQuantReport:
    quantized: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    calib_rows: dict[str, int] = field(default_factory=dict)
    damp_raised: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0


def _targets(model, ignore):
    return target_linears(model, tuple(ignore))


@torch.no_grad()
def collect_hessians(pipe, targets: dict, calib: CalibSpec) -> tuple[dict, dict]:
    """(name -> H float32 [in, in], name -> rows seen) from the pipeline sampling calib's images."""
    tr = pipe.transformer
    hc = HessianCollector(targets)
    orig = tr.forward

    def forward(*a, **kw):  # each transformer call is one "batch": inputs shared only within a call
        hc.new_batch()
        return orig(*a, **kw)

    classes = [c for c in calib.classes for _ in calib.seeds]
    seeds = [s for _ in calib.classes for s in calib.seeds]
    tr.forward = forward
    try:
        with hc:
            pipe(classes, seeds, num_inference_steps=calib.steps, guidance_scale=calib.guidance)
    finally:
        del tr.forward  # back to the class's forward
    return {n: hc.hessian(n) for n in targets}, {n: hc.tokens(n) for n in targets}


@torch.no_grad()
def quantize_transformer(pipe, scheme: WeightScheme, *, method: str = "rtn", ignore=DEFAULT_IGNORE,
                         calib: CalibSpec | None = None, damp: float = 0.01, block: int = 128,
                         act_order: bool = True, clip_search: bool = False,
                         scale_dtype: torch.dtype = torch.float32) -> DiTQuantReport:
    """Replace the pipeline's transformer linears by QuantLinear modules in place (see module docstring)."""
    t0 = time.perf_counter()
    if method not in METHODS:
        raise LowbitError(f"unknown method {method!r} for a diffusion transformer; use one of {', '.join(METHODS)}")
    tr = pipe.transformer.eval()
    targets, ignored = _targets(tr, ignore)
    if not targets:
        raise LowbitError("the transformer has no linear layers to quantize outside the ignore list")
    for name, lin in targets.items():  # fail before any work
        try:
            scheme.group_for(lin.in_features)
        except LowbitError as e:
            raise LowbitError(f"{name}: {e}") from None
    rep = DiTQuantReport(ignored=ignored)
    H, rows = ({}, {})
    if method == "gptq":
        H, rows = collect_hessians(pipe, targets, calib or CalibSpec())
        rep.calib_rows = rows
    bits, sym = scheme.w_bits, scheme.symmetric
    for name, lin in targets.items():
        g = scheme.group_for(lin.in_features)
        if method == "rtn":
            qw = rtn_quantize(lin.weight, bits, g, sym, clip_search=clip_search, scale_dtype=scale_dtype)
        else:
            qw = gptq_quantize(lin.weight, H.pop(name), bits, g, sym, block=block, damp=damp, act_order=act_order,
                               clip_search=clip_search, name=name, scale_dtype=scale_dtype)
            if qw.damp is not None and qw.damp > damp * (1 + 1e-9):
                rep.damp_raised[name] = qw.damp
        q = QuantLinear.from_codes(qw.codes, qw.grid, scheme, lin.bias, scale_dtype=scale_dtype)
        set_module(tr, name, q.to(lin.weight.device))
        rep.quantized.append(name)
    left, _ = _targets(tr, ignore)
    rep.skipped = sorted(left)
    if rep.skipped:
        raise LowbitError(f"{len(rep.skipped)} linear(s) outside the ignore list were not quantized "
                          f"(e.g. {rep.skipped[0]}); add them to the ignore list")
    rep.seconds = time.perf_counter() - t0
    return rep


def _source_sha(src: Path, rel: str) -> str | None:
    if not (src / "manifest.json").is_file():
        return None
    for f in load_manifest(src).files:
        if f.path == rel:
            return f.sha256
    return None


def quantize_pipeline(src, out, *, component: str, scheme: WeightScheme, method: str = "rtn",
                      ignore=DEFAULT_IGNORE, calib: CalibSpec | None = None, damp: float = 0.01,
                      block: int = 128, act_order: bool = True, clip_search: bool = False,
                      dtype: torch.dtype = torch.float32) -> dict:
    """Write `out` (new) from the pipeline directory `src` with `component` quantized. Returns the manifest dict."""
    from lowbit.weights.export import checkpoint_state, ct_quantization_config

    src, out = Path(src), Path(out)
    if os.path.lexists(out):
        raise LowbitError(f"{out} already exists; checkpoints are never overwritten: choose a new --out")
    comps = pipeline_components(src)
    if component not in comps:
        raise LowbitError(f"{src} has no component {component!r}; its components are {', '.join(sorted(comps))}")
    if component != "transformer":
        raise LowbitError(f"component {component!r}: lowbit quantizes the pipeline's DiT (--component transformer)")
    if (src / component / "config.json").is_file() and json.loads(
            (src / component / "config.json").read_text()).get("quantization_config"):
        raise LowbitError(f"{src}/{component} is already quantized; quantize the unquantized pipeline")
    if method not in METHODS:
        raise LowbitError(f"unknown method {method!r} for a diffusion transformer; use one of {', '.join(METHODS)}")
    check_artifact(src, need_native=False)
    pipe = load_pipeline(src)
    tr = pipe.transformer
    linears_total = sum(isinstance(m, torch.nn.Linear) for m in tr.modules())
    non_linear = sum(p.numel() for n, p in tr.named_parameters()
                     if not isinstance(tr.get_submodule(n.rpartition(".")[0]), torch.nn.Linear))
    cal = (calib or CalibSpec()) if method == "gptq" else None
    rep = quantize_transformer(pipe, scheme, method=method, ignore=ignore, calib=cal, damp=damp, block=block,
                               act_order=act_order, clip_search=clip_search, scale_dtype=dtype)
    copied = [c for c in comps if c != component]
    src_weights = src / component / WEIGHTS_NAME
    inputs = {
        "pipeline": str(src.resolve()),
        "component": component,
        "source_weights_sha256": _source_sha(src, f"{component}/{WEIGHTS_NAME}") or (
            sha256_file(src_weights) if src_weights.is_file() else None),
        "copied": {f"{c}/{p.name}": sha256_file(p) for c in copied for p in sorted((src / c).rglob("*")) if p.is_file()}
        | {"model_index.json": sha256_file(src / "model_index.json")},
        "calibration": None if cal is None else cal.to_dict(),
    }
    recipe = {"scheme": scheme.to_dict(), "method": method, "ignore": list(ignore), "format": scheme.ct_format,
              "clip_search": clip_search, "dtype": str(dtype).removeprefix("torch."),
              "gptq": None if method != "gptq" else {"damp": damp, "block": block,
                                                     "act_order": "static" if act_order else None,
                                                     "sequential": False}}
    counts = {"linears": linears_total, "quantized_linears": len(rep.quantized), "skipped_linears": len(rep.skipped),
              "ignored_linears": len(rep.ignored), "ignored": rep.ignored, "non_linear_params": non_linear,
              "calibration_rows_min": min(rep.calib_rows.values()) if rep.calib_rows else 0,
              "damp_raised": len(rep.damp_raised), "quantize_seconds": round(rep.seconds, 1),
              "source_weight_bytes": src_weights.stat().st_size if src_weights.is_file() else None}
    with ArtifactWriter(out, kind=ARTIFACT_KIND, artifact_class="native-packed", inputs=inputs, recipe=recipe) as w:
        shutil.copy2(src / "model_index.json", w.path / "model_index.json")
        for c in copied:
            shutil.copytree(src / c, w.path / c)
        cdir = w.path / component
        cdir.mkdir()
        cfg = json.loads((src / component / "config.json").read_text())  # the source config, as written
        cfg["quantization_config"] = ct_quantization_config(scheme, list(ignore))
        (cdir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        from safetensors.torch import save_file

        from lowbit.weights.export import MARKER_KEY

        # lowbit's mark in the header: a copy that lost manifest.json is still known as lowbit's (load refuses it)
        save_file(checkpoint_state(tr, dtype), str(cdir / WEIGHTS_NAME), metadata={"format": "pt", MARKER_KEY: ARTIFACT_KIND})
        counts["weight_bytes"] = (cdir / WEIGHTS_NAME).stat().st_size
        w.counts = counts
    return w.manifest.to_dict()
