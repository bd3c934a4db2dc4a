"""Write a quantized model as a compressed-tensors checkpoint (the format llm-compressor writes and
vLLM / transformers read), inside a lowbit artifact (manifest.json with sha256 of every file).

Directory:
    config.json            the model config + `quantization_config` (compressed-tensors schema, built
                           with compressed_tensors.quantization.QuantizationConfig)
    model.safetensors      per quantized linear PREFIX (see below); every other tensor as is; its header
                           metadata carries MARKER_KEY = ARTIFACT_KIND, so a copy that lost manifest.json is
                           still known as lowbit's (load_quantized refuses it instead of trusting it unverified)
    tokenizer files, generation_config.json
    manifest.json          lowbit: inputs, recipe, versions, files + sha256, counts

Per quantized linear, with q = signed codes (c - 2**(b-1)) and G = in // group:
  pack-quantized (w4a16, w8a16):
    PREFIX.weight_packed      int32 [out, ceil(in*b/32)]  compressed_tensors pack_to_int32(q, b)
    PREFIX.weight_scale       [out, G]                     (G = 1 for per-channel)
    PREFIX.weight_shape       int64 [2] = (out, in)
    PREFIX.weight_zero_point  int32 [ceil(out*b/32), G]    pack_to_int32(zp, b, packed_dim=0); asymmetric only
  int-quantized (w8a8, w4a8: int8 activations):
    PREFIX.weight             int8 [out, in] = q   (w4a8: values in [-8, 7])
    PREFIX.weight_scale       [out, G]             (w8a8: G = 1)
Reconstruction (compressed-tensors' dequantize): w = (q - zero_point) * scale.

These are bit for bit the tensors compressed-tensors' own compressors (PackedQuantizationCompressor,
NaiveQuantizationCompressor: what llm-compressor saves through) write for the same scale, zero-point
and weight; tests/weights/test_plain_load.py pins that, so the format cannot drift unnoticed.
Asymmetric W4 (`-asym`) is written the upstream way too, yet plain transformers 5.24 does not open it
(see lowbit.weights.scheme): save_compressed logs how to load it.
"""

from __future__ import annotations

import copy
import json
import logging

import torch
from safetensors.torch import save_file
from torch import nn

from lowbit.artifacts import ArtifactWriter
from lowbit.weights.qlinear import QuantLinear
from lowbit.weights.scheme import WeightScheme

log = logging.getLogger("lowbit.weights")

ARTIFACT_KIND = "weights-compressed-tensors"
# How plain transformers (5.24) opens an asymmetric W4 checkpoint; its plain load raises (zero-point MISMATCH).
ASYM_LOAD_RECIPE = ("AutoModelForCausalLM.from_pretrained(dir, quantization_config="
                    "CompressedTensorsConfig(dequantize=True))")
WEIGHTS_FILE = "model.safetensors"
# In the safetensors header metadata (not config.json: transformers' save_pretrained of a model loaded from here
# would carry a config key into a directory lowbit never wrote; it writes a fresh safetensors header).
MARKER_KEY = "lowbit_artifact"


def ct_quantization_config(scheme: WeightScheme, ignore: list[str]) -> dict:
    """quantization_config for config.json, built with compressed-tensors' own config classes."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    if scheme.group is None:
        wargs = QuantizationArgs(num_bits=scheme.w_bits, type="int", symmetric=scheme.symmetric,
                                 strategy="channel", dynamic=False)
    else:
        wargs = QuantizationArgs(num_bits=scheme.w_bits, type="int", symmetric=scheme.symmetric,
                                 strategy="group", group_size=scheme.group, dynamic=False)
    iargs = None
    if scheme.a_bits == 8:
        iargs = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)
    qs = QuantizationScheme(targets=["Linear"], weights=wargs, input_activations=iargs)
    qc = QuantizationConfig(
        config_groups={"group_0": qs}, format=scheme.ct_format, quantization_status="compressed",
        ignore=list(ignore),
    )
    return qc.to_dict()


def ct_tensors(m: QuantLinear, prefix: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The compressed-tensors tensors of one QuantLinear (see module docstring)."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    b = m.bits
    q = m.signed_codes()  # int8 [out, in]
    out = {f"{prefix}.weight_scale": m.scale.to(dtype).contiguous()}
    if m.scheme.ct_format == "int-quantized":
        out[f"{prefix}.weight"] = q.contiguous()
    else:
        out[f"{prefix}.weight_packed"] = pack_to_int32(q, b)
        out[f"{prefix}.weight_shape"] = torch.tensor([m.out_features, m.in_features], dtype=torch.int64)
        if not m.scheme.symmetric:
            out[f"{prefix}.weight_zero_point"] = pack_to_int32(m.zero_point.to(torch.int8), b, packed_dim=0).contiguous()
    if m.bias is not None:
        out[f"{prefix}.bias"] = m.bias.to(dtype).contiguous()
    return out


def checkpoint_state(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor the checkpoint stores: compressed-tensors tensors for QuantLinear modules,
    the rest of the parameters and persistent buffers as they are (floats cast to dtype).
    A tied lm_head (same tensor as the embeddings) is stored once, as HF does."""
    sd: dict[str, torch.Tensor] = {}
    seen: dict[int, str] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, QuantLinear):
            sd.update(ct_tensors(mod, name, dtype))
            continue
        if any(isinstance(p, QuantLinear) for p in _parents(model, name)):
            continue
        persistent = {k for k in mod._buffers if k not in mod._non_persistent_buffers_set}
        items = list(mod._parameters.items()) + [(k, v) for k, v in mod._buffers.items() if k in persistent]
        for k, t in items:
            if t is None:
                continue
            key = f"{name}.{k}" if name else k
            if id(t) in seen:  # tied: keep the first name only
                continue
            seen[id(t)] = key
            t = t.detach()
            sd[key] = (t.to(dtype) if t.is_floating_point() else t).contiguous().clone()
    return sd


def _parents(model: nn.Module, name: str):
    parts = name.split(".") if name else []
    m = model
    for p in parts[:-1]:
        m = getattr(m, p)
        yield m


def save_compressed(
    model: nn.Module,
    tokenizer,
    scheme: WeightScheme,
    out_dir,
    *,
    inputs: dict,
    recipe: dict,
    counts: dict,
    ignore: list[str],
    dtype: torch.dtype = torch.float32,
):
    """Write the checkpoint atomically into the new directory out_dir (refused if it exists).
    Returns the written Manifest."""
    with ArtifactWriter(out_dir, kind=ARTIFACT_KIND, artifact_class="native-packed", inputs=inputs,
                        recipe=recipe) as w:
        cfg = copy.deepcopy(model.config)
        cfg.architectures = [type(model).__name__]
        cfg.dtype = dtype
        cfg.quantization_config = ct_quantization_config(scheme, ignore)
        cfg.save_pretrained(w.path)
        _check_config(w.path / "config.json")
        gen = getattr(model, "generation_config", None)
        if gen is not None:
            gen.save_pretrained(w.path)
        save_file(checkpoint_state(model, dtype), str(w.path / WEIGHTS_FILE), metadata={"format": "pt", MARKER_KEY: ARTIFACT_KIND})
        if tokenizer is not None:
            tokenizer.save_pretrained(w.path)
        w.counts = dict(counts)
    if not scheme.symmetric:
        log.warning("%s is asymmetric: lowbit, vLLM and transformers 5.17 load it as is; transformers 5.24 needs %s",
                    scheme.name, ASYM_LOAD_RECIPE)
    return w.manifest


def _check_config(path) -> None:
    d = json.loads(path.read_text())
    qc = d.get("quantization_config")
    if not isinstance(qc, dict) or qc.get("quant_method") != "compressed-tensors":
        raise RuntimeError("config.json lost its compressed-tensors quantization_config")  # a bug, not user input
