"""VQ codebooks fitted on calibration rows as the cache sees them (key-mapped, rotated, in the model dtype).

    rows = collect(model, windows, sample_per_seq=VQ_SAMPLE_PER_SEQ, score_weighted=False).layers
    cbs = fit_codebooks(rows, scheme, rotations, dtype)     # layer -> {"k": [H, E, SUB] | None, "v": ...}
    lowbit.kv.plan.save_levels(dir, cbs, model=...)          # the recipe names it in `levels` (LevelsRef)

`lowbit calibrate --vq-for RECIPE` runs this: the recipe's VQ tensors (TensorQuant.vq, per layer after its
layer_bits) get one codebook per KV head, fitted by k-means (lowbit.quant.vq.kmeans) on the RMS-normalised
sub-vectors of that head's rows: exactly what TensorCodec.encode assigns at write time.
"""

from __future__ import annotations

import torch

from lowbit.core.errors import LowbitError
from lowbit.kv.key_affine import map_keys
from lowbit.kv.rotations import rotate
from lowbit.quant import vq as vqm

VQ_SAMPLE_PER_SEQ = 256  # rows kept per sequence and layer (after the sink positions) to fit codebooks on
MAX_SUBVECTORS = 262144  # per head: a random subset beyond this (k-means cost, not quality, bounds it)


def vq_tensors(scheme, geometry) -> list[tuple[int, str, str]]:
    """[(layer, "k" | "v", spec)] of every vector-quantized tensor of `scheme` on `geometry`."""
    out = []
    for g in geometry.layers:
        ls = scheme.for_layer(g.index)
        for which, tq in (("k", ls.k), ("v", ls.v)):
            if tq.quantized and tq.vq is not None:
                out.append((g.index, which, tq.vq))
    return out


def fit_codebooks(layers: dict, scheme, rotations, geometry, dtype: torch.dtype, *, iters: int = 20,
                  seed: int = 0) -> dict:
    """layers: {layer: stats with .sample("k"|"v") -> float [N, H, D] post-RoPE rows} (lowbit.calib.stats).
    rotations: lowbit.kv.plan.load_rotations(scheme.rotation, geometry). Returns {layer: {"k": cb, "v": cb}}
    with cb float32 [H, E, SUB] for the VQ tensors and None for the others."""
    todo = vq_tensors(scheme, geometry)
    if not todo:
        raise LowbitError("the recipe has no vector-quantized tensor (set vq = \"2x16\" on K or V) to fit codebooks for")
    g = torch.Generator().manual_seed(seed)
    out: dict = {}
    for i, which, spec in todo:
        sub, entries = vqm.parse(spec)
        st = layers.get(i)
        if st is None:
            raise LowbitError(f"layer {i}: no calibration rows were captured")
        x = st.sample(which).permute(1, 0, 2)[None]  # [1, H, N, D]
        rk, rv = rotations.per_layer[i]
        if which == "k":
            ka = rotations.key_affine[i] if rotations.key_affine else None
            x = rotate(map_keys(x, ka), rk)
        else:
            x = rotate(x, rv)
        u = vqm.normalised_subvectors(x.to(dtype), sub)[0]  # [H, N, D/sub, sub]
        cbs = []
        for h in range(u.shape[0]):
            uh = u[h].reshape(-1, sub)
            if uh.shape[0] > MAX_SUBVECTORS:
                uh = uh[torch.randperm(uh.shape[0], generator=g)[:MAX_SUBVECTORS]]
            cbs.append(vqm.kmeans(uh, entries, iters=iters, seed=seed + 1000 * i + h))
        out.setdefault(i, {"k": None, "v": None})[which] = torch.stack(cbs)
    return out
