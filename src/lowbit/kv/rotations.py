"""The rotations the KV cache applies: rotate, un-rotate, fold a scheme's V rotation into weights (the arithmetic:
lowbit.rotation.fold; lowbit.kv.plan resolves the rotations).

Stored K is k @ R_k and stored V is v @ R_v in every tier; queries are rotated by the same R_k
(q R_k (k R_k)^T = q k^T for orthogonal R_k) and the attention output is multiplied by R_v^T.
R is [D, D] (one per layer) or [H_kv, D, D] (one per KV head, applied to that head's rows and to
the query heads that read it).
"""

from __future__ import annotations

import torch

from lowbit.core.errors import LowbitError
from lowbit.kv.plan import load_rotations
from lowbit.rotation.fold import fold_value_rotation_


def rotate(x: torch.Tensor, r: torch.Tensor | None) -> torch.Tensor:
    """x [B, H, T, D] @ r ([D, D], or [H, D, D] per head), computed in float32; r None = identity."""
    if r is None:
        return x
    r = r.to(device=x.device, dtype=torch.float32)
    if r.dim() == 3:
        if r.shape[0] != x.shape[1]:
            raise LowbitError(f"per-head rotation has {r.shape[0]} heads but the tensor has {x.shape[1]}")
        return torch.matmul(x.float(), r.unsqueeze(0))  # [B,H,T,D] @ [1,H,D,D]
    return torch.matmul(x.float(), r)


def unrotate(x: torch.Tensor, r: torch.Tensor | None) -> torch.Tensor:
    """x [B, H, T, D] @ r^T (inverse of `rotate` for orthogonal r)."""
    if r is None:
        return x
    return rotate(x, r.transpose(-1, -2))


def _attention_modules(model) -> dict[int, torch.nn.Module]:
    mods = {}
    for m in model.modules():
        if hasattr(m, "layer_idx") and hasattr(m, "v_proj") and hasattr(m, "o_proj"):
            mods[int(m.layer_idx)] = m
    return mods


@torch.no_grad()
def fold_v_into_weights(model, scheme, geometry) -> None:
    """Fold each layer's R_v into v_proj (V comes out as v @ R_v) and o_proj (takes o @ R_v back).

    Only a single rotation per layer can be folded; the model is marked so a cache with
    fold_v_rotation can check it was done (and done for this rotation). Runs once per model.
    """
    if not scheme.fold_v_rotation:
        raise LowbitError("fold_v_into_weights needs a scheme with fold_v_rotation set")
    marker = getattr(model, "_lowbit_v_folded", None)
    if marker is not None:
        raise LowbitError(f"V rotation {marker!r} is already folded into this model's weights; load a fresh model")

    full = load_rotations(scheme.rotation, geometry).per_layer
    mods = _attention_modules(model)
    for g in geometry.layers:
        rv = full[g.index][1]
        if rv is None:
            continue
        if rv.dim() != 2:
            raise LowbitError("a per-KV-head V rotation cannot be folded into the weights; use a per-layer rotation")
        m = mods.get(g.index)
        if m is None:
            raise LowbitError(f"layer {g.index}: no attention module with v_proj/o_proj found to fold V's rotation into")
        if hasattr(m, "v_norm"):
            raise LowbitError(f"layer {g.index} normalises V after v_proj; its V rotation cannot be folded into weights")
        fold_value_rotation_(m.v_proj.weight, m.v_proj.bias, m.o_proj.weight, rv, g.num_q_heads // g.num_kv_heads)
    model._lowbit_v_folded = rotation_key(scheme.rotation)


def rotation_key(rotation) -> str:
    """What identifies a scheme's rotation for the folded-weights marker: 'hadamard' or the set's path
    (pinned or not: the plan pins a RotationRef after the weights may have been folded)."""
    return rotation if isinstance(rotation, str) else rotation.path
