"""Tensor parallelism: which KV heads a rank holds, and the rank's slice of every per-KV-head tensor.

Under vLLM's tensor parallelism each rank computes attention for a contiguous block of KV heads (the
rule of vLLM's QKVParallelLinear): with H KV heads and P ranks,

    H >= P (H % P == 0):  rank r holds heads [r * H/P, (r + 1) * H/P)
    H <  P (P % H == 0):  every head is replicated on P/H ranks; rank r holds head r // (P/H)

A lowbit export carries one sidecar and one set of per-KV-head tensors (rotations [H, D, D], key-affine
scale/shift [H, D]) for the whole model: each rank slices what it needs at load, so there is no per-rank
export step. Everything here is pure torch on plain tensors; nothing imports vLLM.

    heads = kv_heads_for_rank(num_kv_heads=8, tp_size=4, rank=1)      # range(2, 4)
    rs_r = slice_rotation_set(rotation_set, geometry, tp_size=4, rank=1)
"""

from __future__ import annotations

from dataclasses import replace

import torch

from lowbit.core.errors import LowbitError


def kv_heads_for_rank(num_kv_heads: int, tp_size: int, rank: int) -> range:
    """The KV heads (indices into the layer's H KV heads) that `rank` of `tp_size` holds."""
    if tp_size < 1 or not 0 <= rank < tp_size:
        raise LowbitError(f"rank {rank} is outside tensor-parallel size {tp_size}")
    h = num_kv_heads
    if h >= tp_size:
        if h % tp_size:
            raise LowbitError(f"{h} KV heads do not split over tensor-parallel size {tp_size}: use a size that "
                              f"divides {h}")
        n = h // tp_size
        return range(rank * n, (rank + 1) * n)
    if tp_size % h:
        raise LowbitError(f"{h} KV heads cannot be replicated evenly over tensor-parallel size {tp_size}: use a "
                          f"multiple of {h}")
    head = rank // (tp_size // h)
    return range(head, head + 1)


def slice_heads(t: torch.Tensor, num_kv_heads: int, tp_size: int, rank: int) -> torch.Tensor:
    """t [H, ...] (one entry per KV head) -> [H_rank, ...], the heads `rank` holds."""
    if t.dim() == 0 or t.shape[0] != num_kv_heads:
        raise LowbitError(f"a per-KV-head tensor of shape {list(t.shape)} does not have the layer's {num_kv_heads} "
                          "KV heads first; the export does not match this model: export again")
    r = kv_heads_for_rank(num_kv_heads, tp_size, rank)
    return t[r.start:r.stop].contiguous()


def slice_rotation_set(rs, geometry, tp_size: int, rank: int):
    """A RotationSet for `rank`: per-KV-head rotations [H, D, D] sliced to the rank's heads; per-layer
    rotations [D, D] unchanged."""
    if not rs.per_head:
        return rs
    ks, vs = [], []
    for g, rk, rv in zip(geometry.layers, rs.k, rs.v):
        ks.append(slice_heads(rk, g.num_kv_heads, tp_size, rank))
        vs.append(slice_heads(rv, g.num_kv_heads, tp_size, rank))
    return replace(rs, k=tuple(ks), v=tuple(vs))


def slice_key_affine(maps: dict, geometry, tp_size: int, rank: int) -> dict:
    """{layer: KeyAffine(scale, shift [H, D])} -> the rank's [H_rank, D] maps."""
    from lowbit.kv.key_affine import KeyAffine

    by_index = {g.index: g for g in geometry.layers}
    return {i: KeyAffine(slice_heads(ka.scale, by_index[i].num_kv_heads, tp_size, rank),
                         slice_heads(ka.shift, by_index[i].num_kv_heads, tp_size, rank))
            for i, ka in maps.items()}


def slice_geometry(geometry, tp_size: int, rank: int):
    """The rank's view of a ModelGeometry: query and KV heads per layer divided as vLLM divides them."""
    layers = []
    for g in geometry.layers:
        if g.num_q_heads % tp_size:
            raise LowbitError(f"layer {g.index}: {g.num_q_heads} query heads do not split over tensor-parallel "
                              f"size {tp_size}")
        kv = len(kv_heads_for_rank(g.num_kv_heads, tp_size, rank))
        layers.append(replace(g, num_q_heads=g.num_q_heads // tp_size, num_kv_heads=kv))
    return replace(geometry, layers=tuple(layers) if isinstance(geometry.layers, tuple) else layers)


def reassemble(parts: list[torch.Tensor], num_kv_heads: int, tp_size: int) -> torch.Tensor:
    """Inverse of slicing over all ranks: the rank slices [H_rank, ...] in rank order -> [H, ...] (a replicated
    head is taken once, from the first rank that holds it). Used to check that slicing loses nothing."""
    out: dict[int, torch.Tensor] = {}
    for rank, p in enumerate(parts):
        for j, h in enumerate(kv_heads_for_rank(num_kv_heads, tp_size, rank)):
            out.setdefault(h, p[j])
    if sorted(out) != list(range(num_kv_heads)):
        raise LowbitError(f"rank slices cover KV heads {sorted(out)}, not all {num_kv_heads}")
    return torch.stack([out[h] for h in range(num_kv_heads)])
