"""QuaRot-style rotation folded into the weights (no runtime op; the checkpoint stays a plain model).

Residual stream: with Q [d, d] orthogonal (a normalized Hadamard matrix), every residual vector x
becomes x Q. RMSNorm commutes with Q only without its weight (rms(x Q) = rms(x)), so first
`fuse_norms` moves each norm weight into the linears that read the norm's output:
    W_reader <- W_reader diag(w_norm),  w_norm <- 1       (q/k/v after the attention norm,
                                                           gate/up after the MLP norm, lm_head
                                                           after the final norm)
then `rotate_residual`:
    embed rows   E <- E Q              (the stream starts rotated)
    readers      W <- W Q              (x Q (W Q)^T = x W^T)
    writers      W <- Q^T W, b <- b Q  (o_proj, down_proj write y Q; a VLM's vision merger output
                                        too: image embeddings enter the stream where tokens' rows would)
Value/output heads: per KV head, V rows are rotated by a Hadamard of head_dim Hh, and each query
head's o_proj input columns by the same Hh: attention mixes whole V vectors, so o = sum p v
becomes o Hh and o_proj undoes it (W_o[:, head] <- W_o[:, head] Hh).

Rotations spread outlier channels across all channels, so groups quantize with a smaller range.
A tied lm_head is untied first (after the final-norm fuse it differs from E Q).
All math in float64, written back in the weights' dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from lowbit.core.errors import LowbitError
from lowbit.rotation.fold import fold_value_rotation_
from lowbit.rotation.hadamard import hadamard, is_supported_order
from lowbit.weights.arch import ArchSpec, decoder_layers, get_module, rotation_spec


def _set(p: torch.Tensor, value: torch.Tensor) -> None:
    with torch.no_grad():
        p.copy_(value.to(p.dtype))


def untie_lm_head(model: nn.Module, spec: ArchSpec) -> None:
    """Give lm_head its own weight tensor and mark the config untied (so a checkpoint keeps both)."""
    emb = get_module(model, spec.embed)
    head = get_module(model, spec.lm_head)
    if head.weight is emb.weight or head.weight.data_ptr() == emb.weight.data_ptr():
        head.weight = nn.Parameter(emb.weight.detach().clone())
    model.config.tie_word_embeddings = False
    if hasattr(model.config, "get_text_config"):
        model.config.get_text_config().tie_word_embeddings = False


def _fuse(norm: nn.Module, readers: list[nn.Linear]) -> None:
    w = norm.weight.detach().double()  # [d]
    for lin in readers:
        _set(lin.weight, lin.weight.detach().double() * w.unsqueeze(0))
    _set(norm.weight, torch.ones_like(w))


def fuse_norms(model: nn.Module) -> None:
    """Fold every RMSNorm weight into the linears reading its output (see module docstring)."""
    spec = rotation_spec(model)
    untie_lm_head(model, spec)
    for layer in decoder_layers(model):
        _fuse(get_module(layer, spec.attn_norm), [get_module(layer, p) for p in spec.attn_readers])
        _fuse(get_module(layer, spec.mlp_norm), [get_module(layer, p) for p in spec.mlp_readers])
    _fuse(get_module(model, spec.final_norm), [get_module(model, spec.lm_head)])


def residual_rotation(d: int) -> torch.Tensor:
    """The residual rotation Q [d, d] (float64): normalized Hadamard, non-power-of-two orders included."""
    if not is_supported_order(d):
        raise LowbitError(f"no Hadamard matrix of order {d} (hidden size); quantize without --rotate")
    return hadamard(d, torch.float64)


def rotate_residual(model: nn.Module, Q: torch.Tensor) -> None:
    """Rotate the residual stream by Q [d, d] (norms must be fused first)."""
    spec = rotation_spec(model)
    emb = get_module(model, spec.embed)
    Q = Q.double().to(emb.weight.device)
    _set(emb.weight, emb.weight.detach().double() @ Q)
    readers, writers = [get_module(model, spec.lm_head)], []
    for layer in decoder_layers(model):
        for norm in (spec.attn_norm, spec.mlp_norm):
            if not torch.all(get_module(layer, norm).weight == 1):
                raise LowbitError("rotate_residual needs fused norms (weights 1); call fuse_norms first")
        readers += [get_module(layer, p) for p in (*spec.attn_readers, *spec.mlp_readers)]
        writers += [get_module(layer, spec.attn_writer), get_module(layer, spec.mlp_writer)]
    for lin in readers:
        _set(lin.weight, lin.weight.detach().double() @ Q)
    # a VLM's tower writes image embeddings into the stream in place of image tokens' embedding rows: rotated
    # like E (the tower itself stays unquantized; this folds Q into its last linear, exact up to rounding)
    writers += [get_module(model, p) for p in spec.vision_writers]
    for lin in writers:
        _set(lin.weight, Q.T @ lin.weight.detach().double())
        if lin.bias is not None:
            _set(lin.bias, lin.bias.detach().double() @ Q)


def rotate_value_heads(model: nn.Module) -> None:
    """Rotate each V head and the matching o_proj input columns by a Hadamard of head_dim."""
    spec = rotation_spec(model)
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config  # VLMs nest it
    hq = cfg.num_attention_heads
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // hq
    if not is_supported_order(hd):
        raise LowbitError(f"no Hadamard matrix of order {hd} (head_dim); quantize without --rotate")
    Hh = hadamard(hd, torch.float64).to(get_module(model, spec.embed).weight.device)
    for layer in decoder_layers(model):
        v = get_module(layer, spec.v_proj)  # weight [Hkv * hd, d]
        o = get_module(layer, spec.attn_writer)  # weight [d, Hq * hd]
        hkv = v.weight.shape[0] // hd
        fold_value_rotation_(v.weight.data, None if v.bias is None else v.bias.data, o.weight.data, Hh, hq // hkv,
                             dtype=torch.float64)


def rotate_model(model: nn.Module) -> dict:
    """fuse_norms + residual rotation + value-head rotation, in place. Returns a description
    for the manifest."""
    spec = rotation_spec(model)  # refuses unsupported architectures before touching anything
    d = get_module(model, spec.embed).weight.shape[1]
    Q = residual_rotation(d)
    fuse_norms(model)
    rotate_residual(model, Q)
    rotate_value_heads(model)
    return {"kind": "hadamard", "residual_dim": d, "value_heads": True, "norms_fused": True}
