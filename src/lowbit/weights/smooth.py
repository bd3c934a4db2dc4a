"""SmoothQuant (Xiao et al. 2022): move activation outliers into the weights before W8A8 quantization.

Per-token int8 activations lose the small channels of a token whose few outlier channels set its
scale. For a group of linears reading the same input X [tokens, d], per input channel j

    s_j = max|X_j| ** alpha / max over the readers' column j of |W_ij| ** (1 - alpha)

and X' = X / s, W' = W * s (columns): X' W'^T = X W^T exactly, but X' is flatter (easier per
token) and W' a little less flat (per output channel int8 weights barely notice). alpha = 0.5 is
the paper's default. Channels never active in calibration (max|X_j| = 0) or with all-zero weight
columns keep s_j = 1.

The division by s is folded into whatever writes X, so the checkpoint stays a plain model (no extra
op, no new tensor; compressed-tensors' int-quantized format and any loader take it as is):
    q/k/v inputs      input_layernorm weight /= s           (RMSNorm: y = w * x / rms(x))
    gate/up inputs    post_attention_layernorm weight /= s
    o_proj inputs     v_proj output rows /= s               (attention output is a per-head weighted
                                                             mean of V: linear in each V channel)
    down_proj inputs  up_proj output rows /= s              (silu(gate) * up is linear in each up channel)
With grouped-query attention one o_proj input channel (q head h, dim e) reads V channel
(kv head of h, e), so s is one value per V channel, shared by the q heads of that kv head.

alpha "auto": per mapping (each of the four above, in every layer) the alpha whose smoothed
linears, quantized as the scheme will quantize them (RTN weights on the stored grid, per-token int8
activations for a8 schemes), best reproduce the fp outputs on a sample of the calibration inputs
(sum of squared output errors over the readers); candidates 0.1 .. 0.9 and no smoothing at all,
so a mapping that smoothing would hurt is left alone. Chosen on calibration text only.

Only architectures with plain RMSNorm in front of the readers (lowbit.weights.arch, the ones the
rotation supports) are smoothed; others are refused with the reason.
"""

from __future__ import annotations

import collections
import contextlib

import torch
from torch import nn

from lowbit.core.errors import LowbitError
from lowbit.weights.arch import arch_of, decoder_layers, get_module
from lowbit.weights.gptq import rtn_quantize
from lowbit.weights.qlinear import quantize_activations_per_token

EPS = 1e-5
AUTO_ALPHAS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
AUTO_SAMPLE_TOKENS = 512  # calibration rows kept per mapping for the auto search


def _spec(model: nn.Module):
    mt, spec = arch_of(model)
    if spec is None or spec.rotation_refusal:
        why = spec.rotation_refusal if spec is not None else "its norms and module layout are not registered"
        raise LowbitError(f"--smooth is not supported on {mt}: {why}; quantize without --smooth")
    return spec


@torch.no_grad()
def input_absmax(model: nn.Module, linears: dict[str, nn.Linear], batches: list[torch.Tensor],
                 autocast=contextlib.nullcontext, keep: int = 0, samples: dict | None = None) -> dict[str, torch.Tensor]:
    """Per-input-channel max |x| (float32 [in]) each linear saw over the calibration batches (int64 [B, T]).

    keep > 0: also put into `samples[name]` float32 [<= keep, in] input rows, strided evenly over each batch.
    """
    amax: dict[str, torch.Tensor] = {}
    per_batch = -(-keep // max(len(batches), 1)) if keep else 0

    def hook(name):
        def pre(mod, args):
            x = args[0].detach()
            x2 = x.reshape(-1, x.shape[-1])  # [tokens, in]
            m = x2.abs().amax(0).float()  # [in]
            amax[name] = m if name not in amax else torch.maximum(amax[name], m)
            if per_batch and samples is not None:
                step = max(x2.shape[0] // per_batch, 1)
                samples.setdefault(name, []).append(x2[::step][:per_batch].float().clone())
        return pre

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in linears.items()]
    try:
        with autocast():
            for ids in batches:
                model(input_ids=ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    missing = [n for n in linears if n not in amax]
    if missing:
        raise LowbitError(f"smoothing calibration never reached {missing[0]}; is the model complete?")
    if samples is not None:
        for n in list(samples):
            if isinstance(samples[n], list):
                samples[n] = torch.cat(samples[n])[:keep]
    return amax


def quantized_output_error(x: torch.Tensor, weights: list[torch.Tensor], s: torch.Tensor, scheme) -> float:
    """Sum over the readers of ||Q(x / s) Q(W * s)^T - x W^T||^2: x float32 [n, in], W [out_k, in], s [in];
    Q as `scheme` quantizes (RTN weights on the stored grid; per-token int8 activations when a_bits == 8)."""
    s32 = s.float()
    xs = x / s32
    if scheme.a_bits == 8:
        xq, sx = quantize_activations_per_token(xs)
        xs = xq.float() * sx
    err = 0.0
    for w in weights:
        w32 = w.detach().float()
        g = scheme.group_for(w32.shape[1])
        wq = rtn_quantize(w32 * s32, scheme.w_bits, g, scheme.symmetric, clip_search=False).dequantize()
        err += float((xs @ wq.T - x @ w32.T).double().square().sum())
    return err


def _pick(alpha, make_s, x_amax, weights, sample, scheme):
    """(s_fold, s_in, alpha used or None for no smoothing). make_s(a) -> (s_fold, s_in): the scales folded
    into the writer and the same scales in the readers' input space."""
    if alpha != "auto":
        return (*make_s(alpha), alpha)
    ones = torch.ones_like(x_amax, dtype=torch.float64)
    best = (quantized_output_error(sample, weights, ones, scheme), None)
    for a in AUTO_ALPHAS:
        e = quantized_output_error(sample, weights, make_s(a)[1], scheme)
        if e < best[0]:
            best = (e, a)
    if best[1] is None:
        s_fold, _ = make_s(AUTO_ALPHAS[0])
        return torch.ones_like(s_fold), ones, None
    return (*make_s(best[1]), best[1])


def smoothing_scales(x_amax: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
    """s [in] (float64) from the input's per-channel max |x| [in] and the readers' weights [out_k, in]."""
    w_amax = torch.stack([w.detach().abs().amax(0).double() for w in weights]).amax(0)  # [in]
    xa = x_amax.double()
    s = xa.clamp(min=EPS) ** alpha / w_amax.clamp(min=EPS) ** (1 - alpha)
    dead = (xa <= 0) | (w_amax <= 0) | ~torch.isfinite(s)
    return torch.where(dead, torch.ones_like(s), s)


def _scale_cols(lin: nn.Linear, s: torch.Tensor) -> None:
    lin.weight.copy_((lin.weight.double() * s.unsqueeze(0)).to(lin.weight.dtype))


def _scale_rows_down(lin: nn.Linear, s: torch.Tensor) -> None:
    lin.weight.copy_((lin.weight.double() / s.unsqueeze(1)).to(lin.weight.dtype))
    if lin.bias is not None:
        lin.bias.copy_((lin.bias.double() / s).to(lin.bias.dtype))


@torch.no_grad()
def smooth_model(model: nn.Module, batches: list[torch.Tensor], alpha: float | str = 0.5,
                 autocast=contextlib.nullcontext, scheme=None) -> dict:
    """SmoothQuant the decoder layers in place (see module docstring). batches: int64 [B, T] token ids.

    alpha: migration strength in (0, 1), or "auto" (per-mapping search; needs `scheme`, the
    WeightScheme the model will be quantized with). Statistics come from one forward of the
    (unsmoothed) model over all batches; every layer's scales are then folded. Returns a
    description for the manifest recipe.
    """
    if alpha == "auto":
        if scheme is None:
            raise LowbitError("--smooth auto needs the weight scheme to score the candidate alphas")
    elif not (isinstance(alpha, (int, float)) and 0.0 < alpha < 1.0):
        raise LowbitError(f"--smooth {alpha}: the migration strength must be in (0, 1) or 'auto'; 0.5 is the usual value")
    spec = _spec(model)
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    hq = cfg.num_attention_heads
    hkv = getattr(cfg, "num_key_value_heads", None) or hq
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // hq
    layers = decoder_layers(model)
    up_name = spec.mlp_readers[-1]  # the up projection (gate's partner; silu(gate) * up)
    watch = {}
    for i, layer in enumerate(layers):
        watch[f"{i}.attn"] = get_module(layer, spec.attn_readers[0])
        watch[f"{i}.mlp"] = get_module(layer, spec.mlp_readers[0])
        watch[f"{i}.o"] = get_module(layer, spec.attn_writer)
        watch[f"{i}.down"] = get_module(layer, spec.mlp_writer)
    samples: dict = {}
    amax = input_absmax(model, watch, batches, autocast, keep=AUTO_SAMPLE_TOKENS if alpha == "auto" else 0,
                        samples=samples)
    ratio_before, ratio_after = [], []
    chosen: collections.Counter = collections.Counter()
    for i, layer in enumerate(layers):
        for key, norm_path, readers in ((f"{i}.attn", spec.attn_norm, spec.attn_readers),
                                        (f"{i}.mlp", spec.mlp_norm, spec.mlp_readers)):
            norm = get_module(layer, norm_path)
            ws = [get_module(layer, p).weight for p in readers]

            def make(a, key=key, ws=ws, norm=norm):
                s = smoothing_scales(amax[key], ws, a).to(norm.weight.device)
                return s, s

            s, _, used = _pick(alpha, make, amax[key], ws, samples.get(key), scheme)
            chosen[used] += 1
            norm.weight.copy_((norm.weight.double() / s).to(norm.weight.dtype))
            for w in ws:
                w.copy_((w.double() * s.unsqueeze(0)).to(w.dtype))
            _track(amax[key], s, ratio_before, ratio_after)
        # o_proj <- v_proj: o_proj input channel (h, e) reads V channel (h // (hq // hkv), e)
        v, o = get_module(layer, spec.v_proj), get_module(layer, spec.attn_writer)
        xo = amax[f"{i}.o"].reshape(hkv, hq // hkv, hd).amax(1)  # [hkv, hd]: max over the q heads sharing V
        wo = o.weight.detach().reshape(o.weight.shape[0], hkv, hq // hkv, hd).abs().amax(dim=(0, 2))  # [hkv, hd]

        def make_o(a, xo=xo, wo=wo, v=v):
            s_kv = smoothing_scales(xo.reshape(-1), [wo.reshape(1, -1)], a).to(v.weight.device)  # [hkv * hd]
            return s_kv, s_kv.reshape(hkv, 1, hd).expand(hkv, hq // hkv, hd).reshape(-1)  # [hq * hd]

        s_kv, s_o, used = _pick(alpha, make_o, amax[f"{i}.o"], [o.weight], samples.get(f"{i}.o"), scheme)
        chosen[used] += 1
        _scale_rows_down(v, s_kv)
        _scale_cols(o, s_o)
        _track(amax[f"{i}.o"], s_o, ratio_before, ratio_after)
        # down_proj <- up_proj
        up, down = get_module(layer, up_name), get_module(layer, spec.mlp_writer)

        def make_d(a, i=i, down=down, up=up):
            s = smoothing_scales(amax[f"{i}.down"], [down.weight], a).to(up.weight.device)
            return s, s

        s, _, used = _pick(alpha, make_d, amax[f"{i}.down"], [down.weight], samples.get(f"{i}.down"), scheme)
        chosen[used] += 1
        _scale_rows_down(up, s)
        _scale_cols(down, s)
        _track(amax[f"{i}.down"], s, ratio_before, ratio_after)
    return {
        "kind": "smoothquant", "alpha": alpha,
        # alpha -> number of mappings smoothed with it ("none": left unsmoothed by the auto search)
        "alphas_used": {("none" if a is None else str(a)): n for a, n in sorted(chosen.items(), key=lambda t: str(t[0]))},
        "targets": ["attn_norm->q/k/v", "mlp_norm->gate/up", "v_proj->o_proj", "up_proj->down_proj"],
        "calibration_tokens": int(sum(b.numel() for b in batches)),
        # mean over smoothed inputs of max|x| / median|x| channel maxima, before and after
        "act_outlier_ratio": [round(sum(ratio_before) / len(ratio_before), 2),
                              round(sum(ratio_after) / len(ratio_after), 2)],
    }


def _track(x_amax: torch.Tensor, s: torch.Tensor, before: list, after: list) -> None:
    a = x_amax.double().cpu()
    b = a / s.cpu()
    before.append(float(a.max() / a.median().clamp(min=EPS)))
    after.append(float(b.max() / b.median().clamp(min=EPS)))
