"""The one V fold: a rotation of V folded into the weights that make V (v_proj) and read the attention output (o_proj).

    fold_value_rotation_(wv, bv, wo, rot, group)   # in place

V has no RoPE and no norm between v_proj and the cache, and the attention output goes straight into
o_proj, so storing V as v @ R and un-rotating the output (out @ R^T) is the same as folding R into both:
    v_proj rows of KV head h      W_h [D, K]        -> R_h^T W_h      (bias b_h -> b_h R_h)
    o_proj columns of q head j    W_o[:, j] [N, D]  -> W_o[:, j] R_h  (h = j // group, the KV head it reads)
R is [D, D] (one per layer) or [H, D, D] (one per KV head), orthogonal. Three callers hand it their weights:
lowbit.kv.rotations.fold_v_into_weights (a scheme's single per-layer rotation, once per model),
lowbit.runtime.fold (the runtime cache's rotations, undoable, fused q/k/v included) and
lowbit.weights.rotate (QuaRot's Hadamard per V head before weight quantization). K's rotation is never
folded: keys are rotated after RoPE, which does not commute with it.
"""

from __future__ import annotations

import torch

from lowbit.core.errors import LowbitError


@torch.no_grad()
def fold_value_rotation_(wv: torch.Tensor, bv: torch.Tensor | None, wo: torch.Tensor, rot: torch.Tensor, group: int,
                         *, dtype: torch.dtype = torch.float32) -> None:
    """Fold `rot` into v_proj's weight wv [H*D, K] (and bias bv [H*D]) and o_proj's weight wo [N, H*group*D], in
    place (views that write through are fine), computing in `dtype` and storing in each tensor's own dtype."""
    D = rot.shape[-1]
    H = wv.shape[0] // D
    if wv.shape[0] != H * D or wo.shape[1] != H * group * D or (rot.dim() == 3 and rot.shape[0] != H):
        raise LowbitError(f"projection shapes {tuple(wv.shape)} / {tuple(wo.shape)} do not match rotation "
                          f"{tuple(rot.shape)} with {group} query heads per KV head")
    r = rot.to(wv.device, dtype)
    r = r.expand(H, D, D) if r.dim() == 2 else r  # [H, D, D]
    w = wv.to(dtype).reshape(H, D, -1)  # [H, D, K]
    wv.copy_(torch.matmul(r.transpose(1, 2), w).reshape(wv.shape).to(wv.dtype))
    if bv is not None:
        bv.copy_(torch.matmul(bv.to(dtype).reshape(H, 1, D), r).reshape(bv.shape).to(bv.dtype))
    o = wo.to(dtype).reshape(wo.shape[0], H, group, D)  # q head j = h * group + g reads KV head h
    wo.copy_(torch.einsum("nhgd,hde->nhge", o, r).reshape(wo.shape).to(wo.dtype))
