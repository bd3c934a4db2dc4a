"""Planted failures: a copy of a quantized pipeline with one linear broken, to prove the gate catches it.

    plant_failure("out/dit-w8a16", "out/dit-w8a16-nan", linear="transformer_blocks.1.attn1.to_q", kind="nan")

kind "nan": the linear's weights become NaN; "zero": they become 0. A quantized linear is broken through
its weight_scale (every dequantized weight is then NaN / 0, the shape a failed kernel produces); a linear
kept in full precision (e.g. the ignored proj_out_2) through its weight. The copy is a new native-packed
artifact whose manifest says what was planted (inputs.planted), so it can never pass for a real checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from lowbit.artifacts import ArtifactWriter, load_manifest
from lowbit.core.errors import LowbitError
from lowbit.diffusion.load import WEIGHTS_NAME, check_artifact

KINDS = ("nan", "zero")


def plant_failure(src, out, *, linear: str, kind: str = "nan", component: str = "transformer") -> Path:
    from safetensors.torch import load_file, save_file

    src, out = Path(src), Path(out)
    if kind not in KINDS:
        raise LowbitError(f"planted failure kind {kind!r}: use one of {', '.join(KINDS)}")
    if os.path.lexists(out):
        raise LowbitError(f"{out} already exists; choose a new directory")
    check_artifact(src, need_native=True)
    man = load_manifest(src)
    sd = load_file(str(src / component / WEIGHTS_NAME))
    key = f"{linear}.weight_scale" if f"{linear}.weight_scale" in sd else f"{linear}.weight"
    if key not in sd or not sd[key].is_floating_point():
        raise LowbitError(f"{src}/{component} has no linear {linear!r} (no {linear}.weight_scale or float .weight)")
    sd[key] = torch.full_like(sd[key], float("nan") if kind == "nan" else 0.0)
    inputs = {**man.inputs, "planted": {"source": str(src.resolve()), "linear": linear, "tensor": key, "kind": kind}}
    with ArtifactWriter(out, kind=man.kind, artifact_class="native-packed", inputs=inputs, recipe=man.recipe) as w:
        for p in sorted(src.iterdir()):
            if p.name == "manifest.json":
                continue
            (shutil.copytree if p.is_dir() else shutil.copy2)(p, w.path / p.name)
        save_file(sd, str(w.path / component / WEIGHTS_NAME), metadata={"format": "pt"})
        w.counts = {**man.counts, "planted": 1}
    json.loads((out / "manifest.json").read_text())  # written and readable
    return out
