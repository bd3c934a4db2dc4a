"""Quantize a model's linears in place: optional rotation and smoothing, then a method (lowbit.weights.methods).

    report = quantize_model(model, scheme, method="gptq", calib=ids, rotate=True)

Which linears: every nn.Linear whose name is not matched by `ignore` (default: lm_head). Names
match an ignore entry when equal to it or ending in "." + it, or by regex with a "re:" prefix
(compressed-tensors' convention). Each quantized linear is replaced by a QuantLinear, so later
layers of a sequential GPTQ run see the quantized earlier layers (activation quantization of
a8 schemes included). Any linear left neither quantized nor ignored is an error (`skipped` must
be 0), as is a group that does not divide a linear's in_features (checked before any work).

Smoothing (smooth=ALPHA, after the rotation when both are asked): SmoothQuant's per-channel
scales from one calibration forward, folded into the norms / v_proj / up_proj (see smooth.py),
before any linear is quantized; it needs calibration tokens whatever the method.

The method (rtn, gptq, signround, ...: one file each in weights/methods/, found by scanning that folder)
turns the target linears into QuantLinear modules; this module checks the inputs before any work
(calibration for methods that need it, linears outside the decoder layers for layerwise methods),
runs the pre-passes (rotation, smoothing) and, after the method, refuses skipped linears and runs
the optional scale tuning.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import re
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from lowbit.core.errors import LowbitError
from lowbit.weights import methods
from lowbit.weights.arch import decoder_layers, set_module
from lowbit.weights.gptq import QuantizedWeight
from lowbit.weights.hooks import calib_batches, layer_prefix
from lowbit.weights.qlinear import QuantLinear
from lowbit.weights.rotate import rotate_model
from lowbit.weights.scheme import WeightScheme
from lowbit.weights.signround import SignRoundConfig
from lowbit.weights.smooth import smooth_model
from lowbit.weights.tune_scales import ScaleTuneConfig, tune_scales

log = logging.getLogger("lowbit.weights")
DEFAULT_IGNORE = ("lm_head",)


@dataclass
class QuantizeReport:
    """What quantize_model did. counts() feeds the artifact manifest."""

    scheme: WeightScheme
    method: str
    layers: int
    quantized: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    rotation: dict | None = None
    smoothing: dict | None = None
    damp_raised: dict[str, float] = field(default_factory=dict)  # linear -> damp that factorised, if > asked
    proxy_loss: dict[str, float] = field(default_factory=dict)
    signround: dict[int, dict] = field(default_factory=dict)  # layer index -> tune_layer's stats
    scale_tuning: dict | None = None  # tune_scales' stats
    calib_tokens: int = 0
    seconds: float = 0.0

    def counts(self) -> dict:
        return {
            "layers": self.layers,
            "quantized_linears": len(self.quantized),
            "skipped_linears": len(self.skipped),
            "ignored_linears": len(self.ignored),
            "calibration_tokens": self.calib_tokens,
            "damp_raised": len(self.damp_raised),
        }


def is_ignored(name: str, ignore) -> bool:
    for pat in ignore:
        if pat.startswith("re:"):
            if re.match(pat[3:], name):
                return True
        elif name == pat or name.endswith("." + pat):
            return True
    return False


def target_linears(model: nn.Module, ignore=DEFAULT_IGNORE) -> tuple[dict[str, nn.Linear], list[str]]:
    """(name -> nn.Linear to quantize, ignored names)."""
    targets, ignored = {}, []
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            (ignored.append(name) if is_ignored(name, ignore) else targets.__setitem__(name, m))
    return targets, ignored


def _to_qlinear(lin: nn.Linear, qw: QuantizedWeight, scheme: WeightScheme, scale_dtype) -> QuantLinear:
    # built on CPU, moved to the linear's device (GPTQ on a GPU keeps the layer there)
    return QuantLinear.from_codes(qw.codes, qw.grid, scheme, lin.bias, scale_dtype=scale_dtype).to(lin.weight.device)


@torch.no_grad()
def quantize_model(
    model: nn.Module,
    scheme: WeightScheme,
    *,
    method: str = "gptq",
    calib: torch.Tensor | None = None,
    rotate: bool = False,
    ignore=DEFAULT_IGNORE,
    damp: float = 0.01,
    block: int = 128,
    act_order: bool = True,
    clip_search: bool = True,
    sequential: bool = True,
    batch_size: int = 8,
    scale_dtype: torch.dtype = torch.float32,
    calib_dtype: torch.dtype | None = None,
    weighted_clip: bool = False,
    smooth: float | str | None = None,
    signround: SignRoundConfig | None = None,
    tune: ScaleTuneConfig | None = None,
    progress: bool | None = False,
) -> QuantizeReport:
    """Quantize `model` in place (see module docstring). calib: int64 [n, T] token ids (GPTQ only).

    calib_dtype: run the calibration forwards under CPU autocast to this dtype (torch.bfloat16:
    several times faster matmuls on CPUs with bf16 units); the Hessians still accumulate in
    float32 from the float32 hidden states, and GPTQ works on the float32 weights. None: model dtype.
    smooth: SmoothQuant migration strength alpha in (0, 1), or "auto" (per-mapping search scored with
    this scheme's quantizers on calibration inputs); None: no smoothing. Needs calib.
    signround: SignRound's settings when method == "signround" (None: SignRoundConfig()).
    tune: after the method, tune every quantized group's scale end to end against the unquantized
    model's logits (tune_scales.py; a copy of the unquantized model is kept meanwhile). Needs calib.
    progress: a bar over decoder layers with ETA (lowbit.core.progress; None: when stderr is a terminal).
    """
    t0 = time.perf_counter()
    m = methods.get(method)
    if m.needs_calib and (calib is None or calib.numel() == 0):
        raise LowbitError(f"{method} needs calibration tokens (--calib); or use --method rtn")
    if signround is not None and method != "signround":
        raise LowbitError(f"SignRound settings were given but the method is {method}; use --method signround")
    if smooth is not None and (calib is None or calib.numel() == 0):
        raise LowbitError("--smooth needs calibration tokens (--calib) to measure the activations")
    if tune is not None and (calib is None or calib.numel() == 0):
        raise LowbitError("scale tuning (--tune-scales) needs calibration tokens (--calib) to compare the logits on")
    model.eval()
    targets, ignored = target_linears(model, ignore)
    if not targets:
        raise LowbitError("the model has no linear layers to quantize outside the ignore list")
    for name, lin in targets.items():  # fail before any work
        try:
            scheme.group_for(lin.in_features)
        except LowbitError as e:
            raise LowbitError(f"{name}: {e}") from None
    layers = decoder_layers(model)
    if m.layerwise:  # methods that see linears through the decoder layers only: refuse the rest up front
        prefixes = tuple(layer_prefix(model, layer) + "." for layer in layers)
        outside = sorted(n for n in targets if not n.startswith(prefixes))
        if outside:
            raise LowbitError(
                f"{len(outside)} linear(s) outside the decoder layers would be skipped by {method} (e.g. {outside[0]}); "
                "add them to the ignore list or use --method rtn"
            )
    report = QuantizeReport(scheme, method, len(layers), ignored=ignored)
    device = next(model.parameters()).device.type

    def autocast():
        return contextlib.nullcontext() if calib_dtype is None else torch.autocast(device, dtype=calib_dtype)

    teacher = copy.deepcopy(model) if tune is not None else None  # unquantized, before any rotation
    if rotate:
        report.rotation = rotate_model(model)
        targets, _ = target_linears(model, ignore)  # same modules; rotation replaced no module
    if smooth is not None:
        dev = next(model.parameters()).device
        report.smoothing = smooth_model(model, [b.to(dev) for b in calib_batches(calib, batch_size)], smooth, autocast,
                                         scheme=scheme)

    def done(name: str, lin: nn.Linear, qw: QuantizedWeight) -> None:
        set_module(model, name, _to_qlinear(lin, qw, scheme, scale_dtype))
        report.quantized.append(name)
        if qw.proxy_loss is not None:
            report.proxy_loss[name] = qw.proxy_loss
        if qw.damp is not None and qw.damp > damp * (1 + 1e-9):
            report.damp_raised[name] = qw.damp

    options = {"damp": damp, "block": block, "act_order": act_order, "clip_search": clip_search,
               "sequential": sequential, "weighted_clip": weighted_clip, "signround": signround, "t0": t0}
    m.run(methods.MethodJob(model, layers, targets, scheme, calib, batch_size, autocast, scale_dtype, done, report,
                            progress, options))
    # Anything left as a plain nn.Linear outside the ignore list was skipped: refuse.
    left, _ = target_linears(model, ignore)
    report.skipped = sorted(left)
    if report.skipped:
        raise LowbitError(
            f"{len(report.skipped)} linear(s) outside the ignore list were not quantized "
            f"(e.g. {report.skipped[0]}); add them to the ignore list or quantize them"
        )
    if tune is not None:
        tt = time.perf_counter()
        report.calib_tokens = int(calib.numel())
        report.scale_tuning = {"config": tune.to_dict(),
                               **tune_scales(model, teacher, calib, tune, autocast=autocast)}
        report.scale_tuning["seconds"] = round(time.perf_counter() - tt, 1)
        del teacher
        st = report.scale_tuning
        log.info("scale tuning: holdout KL %.4g -> %.4g (%s) in %.1fs", st["kl_holdout_before"],
                 st["kl_holdout_after"], "kept" if st["kept"] else "not lower: quantizer's scales kept", st["seconds"])
    report.seconds = time.perf_counter() - t0
    return report
