"""The V rotation of the runtime cache folded into the weights that make and read V.

    handle = fold_value_rotation(model, cache)   # in place: v_proj rows, o_proj columns; the cache's rot_v dropped
    ...                                          # two small GEMMs fewer per layer in every step
    handle.undo()                                # original weights and rotations back (undoable=True)

The fold's arithmetic is lowbit.rotation.fold (the one V fold); this module finds the runtime cache's
rotations and the model's projections (fused q/k/v included) and keeps what undo needs.

Why: the runtime cache stores V rotated (v @ R, R orthogonal: [D, D], or per KV head [H, D, D]) and
un-rotates the attention output (out @ R^T) before o_proj. At decode both are GEMMs of a few rows
(B x H and B x Hq rows of D), each one more kernel and launch gap in the captured step. V has no RoPE
and no norm between v_proj and the cache, and the output goes straight into o_proj, so both maps fold
into the weights, as QuaRot folds its rotations:
    v_proj rows of KV head h      W_h [D, K]        -> R_h^T W_h      (bias b_h -> b_h R_h)
    o_proj columns of q head j    W_o[:, j] [N, D]  -> W_o[:, j] R_h  (h = j // G, the head it reads)
The cache then stores what v_proj gives (the rotated V, through the same quantizer) and returns the
output in the rotated basis, which the folded o_proj reads: the same attention in exact arithmetic, one
rounding of the folded weights to the model dtype apart. K's rotation is not folded: keys are rotated
after RoPE, which does not commute with it.

Folded: layers whose v_proj and o_proj are plain nn.Linear (or v_proj a part of a fused q/k/v GEMM,
lowbit.runtime.fuse) and whose attention has no v_norm; others keep the cache's rotation and are named
in `skipped`. Quantized linears are skipped: fold before quantizing.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from lowbit.core.errors import LowbitError
from lowbit.rotation.fold import fold_value_rotation_
from lowbit.runtime.fuse import FusedHead, FusedTail


@dataclass
class FoldedValueRotation:
    """What fold_value_rotation did: `layers` folded, `skipped` ("layer i: why")."""

    layers: list[int] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    _undo: list = field(default_factory=list, repr=False)  # (cache layer, rot_v, [(param, original on CPU)])

    def undo(self) -> None:
        """Put the original weights (exact copies) and the cache layers' rotations back."""
        if self.layers and not self._undo:
            raise LowbitError("this fold was made with undoable=False: its original weights were not kept")
        with torch.no_grad():
            for layer, rot_v, saved in reversed(self._undo):
                for p, orig in saved:
                    p.copy_(orig.to(p.device))
                layer.rot_v = rot_v
        self._undo.clear()
        self.layers.clear()


def _value_weight(attn):
    """(weight [Hkv*D, K], bias [Hkv*D] or None) of attn's v projection as views that write through, or a
    reason string."""
    v = getattr(attn, "v_proj", None)
    if type(v) is nn.Linear:
        return v.weight, v.bias
    if isinstance(v, FusedTail):
        head = getattr(attn, "q_proj", None)
        if isinstance(head, FusedHead) and type(head.linear) is nn.Linear:
            a = sum(head.sizes[:v.index])
            n = head.sizes[v.index]
            b = head.linear.bias
            return head.linear.weight[a:a + n], (None if b is None else b[a:a + n])
    return f"v_proj is {type(v).__name__}, not a plain or fused nn.Linear (fold before quantizing)"


def _fold_layer(attn, layer, rot: torch.Tensor, G: int):
    """Fold rot (layer's V rotation, [D, D] or [H, D, D]) into attn's v_proj / o_proj in place; returns the
    touched parameters with their original values, or a reason."""
    if getattr(attn, "v_norm", None) is not None:
        return "a norm on V between v_proj and the cache"
    got = _value_weight(attn)
    if isinstance(got, str):
        return got
    wv, bv = got
    o = getattr(attn, "o_proj", None)
    if type(o) is not nn.Linear:
        return f"o_proj is {type(o).__name__}, not a plain nn.Linear (fold before quantizing)"
    H, D = layer.H, rot.shape[-1]
    if wv.shape[0] != H * D or o.weight.shape[1] != H * G * D:
        return f"projection shapes {tuple(wv.shape)} / {tuple(o.weight.shape)} do not match {H} KV heads x {D}"
    saved = [(wv, wv.detach().cpu().clone()), (o.weight, o.weight.detach().cpu().clone())]
    if bv is not None:
        saved.append((bv, bv.detach().cpu().clone()))
    fold_value_rotation_(wv, bv, o.weight, rot, G)
    return saved


def fold_value_rotation(model, cache, *, undoable: bool = True) -> FoldedValueRotation:
    """Fold every runtime-cache layer's V rotation into `model`'s weights in place (module docstring).

    model: the transformers causal LM the cache serves; cache: lowbit.runtime.static_cache.StaticKVCache.
    undoable: keep exact copies of the touched weights on the CPU for undo() (a serving engine that owns
    the model passes False)."""
    inner = getattr(model, "model", model)
    inner = getattr(inner, "language_model", inner)
    layers = getattr(inner, "layers", None)
    if layers is None or len(layers) != len(cache.layers):
        raise LowbitError(f"{type(model).__name__}: expected .model.layers with the cache's {len(cache.layers)} layers")
    cfg = getattr(inner, "config", None) or model.config
    handle = FoldedValueRotation()
    for i, (dec, layer) in enumerate(zip(layers, cache.layers)):
        if layer.rot_v is None:
            continue
        attn = getattr(dec, "self_attn", None)
        G = int(cfg.num_attention_heads) // layer.H
        # the rotation as the cache holds it (in the model dtype): the fold is the product the cache computes
        got = "no self_attn module" if attn is None else _fold_layer(attn, layer, layer.rot_v, G)
        if isinstance(got, str):
            handle.skipped.append(f"layer {i}: {got}")
            continue
        if undoable:
            handle._undo.append((layer, layer.rot_v, got))
        layer.rot_v = None
        handle.layers.append(i)
    return handle


_FOLDED = "_lowbit_folded_rot_v"  # model attribute: {layer index: the V rotation folded into its weights}


def fold_value_rotation_once(model, cache, *, fold: bool) -> FoldedValueRotation | None:
    """For serving engines that own `model` (undoable=False): fold the cache's V rotations into it once per model
    (fold: a captured-path engine), or take a fold an earlier engine left in it, dropping those layers' rot_v
    from this cache, whose V then arrives rotated. A fold of another rotation is refused.

    Why: the fold stays in the weights after its engine. Folding again for the next engine's fresh cache rotated
    V once more (twice a Hadamard-type rotation is the identity, so the packed middle quantized V unrotated), as
    did an eager engine's cache over a folded model: two engines over one model quantized V in different bases
    and their tokens differed (s21: the batching engine's GPU test, its 3rd and 4th engines)."""
    prior = getattr(model, _FOLDED, None)
    if prior is None:
        if not fold:
            return None
        rots = {i: layer.rot_v for i, layer in enumerate(cache.layers) if layer.rot_v is not None}
        handle = fold_value_rotation(model, cache, undoable=False)
        setattr(model, _FOLDED, {i: rots[i] for i in handle.layers})
        return handle
    for i, rot in prior.items():
        layer = cache.layers[i]
        if layer.rot_v is None or not torch.equal(layer.rot_v, rot.to(layer.rot_v.device, layer.rot_v.dtype)):
            raise LowbitError(f"layer {i}: the model's weights carry another engine's V rotation, not this KV "
                              "scheme's; load the model again for this engine")
        layer.rot_v = None
    return FoldedValueRotation(layers=sorted(prior)) if fold else None
