"""Open a model ready to run: lowbit.models.resolve, plus compressed-tensors checkpoints on their kernels.

    lm = resolve("smollm2-135m")             # a built-in, a local HF dir, or a `lowbit quantize` checkpoint
    lm = resolve(ckpt_dir, device="cuda")    # QuantLinear modules, packed for the GPU weight kernels

lowbit.models.load.resolve knows built-ins and plain directories (models sit below weights and kernels);
this one hands it the opener of quantized checkpoints: lowbit.weights.load.load_quantized (QuantLinear
modules, manifest verified) and, on CUDA, lowbit.kernels.gemm.prepare.prepare_cuda (weights stay packed
and run through the weight kernels, the dispatch resolved once here). Everything that serves, evaluates
or generates from a user's model directory opens it here.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from lowbit.models.load import LoadedModel, finish
from lowbit.models.load import resolve as resolve_plain
from lowbit.weights.load import load_quantized


def resolve(name_or_dir: str | os.PathLike, **kw) -> LoadedModel:
    """lowbit.models.load.resolve (same arguments), compressed-tensors checkpoints included."""
    return resolve_plain(name_or_dir, open_quantized=_open_quantized, **kw)


def _open_quantized(path: Path, name: str, prov: dict, dtype, attn_implementation: str, device) -> LoadedModel:
    """A compressed-tensors checkpoint through lowbit's loader (QuantLinear modules, manifest verified)."""
    model, tok = load_quantized(path, dtype=dtype)
    if attn_implementation != "sdpa":
        model.set_attn_implementation(attn_implementation)
    loaded = finish(model, tok, path, name, prov, device)
    if device is not None and torch.device(device).type == "cuda":
        from lowbit.kernels.gemm.prepare import prepare_cuda  # Triton: only on CUDA, an optional dependency

        # weights stay packed on the GPU and run through the weight kernels (dispatch resolved once here)
        rep = prepare_cuda(loaded.model)
        loaded.provenance["weight_kernels"] = {k: rep[k] for k in ("dispatch", "removed", "modules", "packed_bytes",
                                                                   "bf16_bytes")}
    return loaded
