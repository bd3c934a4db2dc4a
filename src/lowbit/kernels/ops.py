"""The runtime's kernels as torch custom ops: one opaque node each in a torch.compile'd decode step.

    decode_attention_tiers(q, <packed middle>, mid_lens, <sink>, <recent>, k_bits, v_bits, sm_scale,
                           k_centre, v_centre)
        the fused decode kernel (lowbit.kernels.attention.tiers) over sink / packed middle / recent
    decode_attention_vq_tiers(q, <VQ middle + codebooks>, mid_lens, <sink>, <recent>, ..., <residuals>)
        the same for a layer with VQ rows or a 1-bit residual (lowbit.kernels.attention.vq)
    packed_linear(x, key)
        a QuantLinear's CUDA weight kernels (lowbit.weights.qlinear), the module found by `key`
        (register_packed_linears gives every packed QuantLinear of a model its key)

Why ops: both Python wrappers pick a launch configuration on the host (device properties, the
dispatch table by M) and launch Triton or ctypes CUDA kernels; dynamo would trace (and break on)
that host logic. As custom ops they are single graph nodes, captured in a CUDA graph like any other
kernel (neither makes a host sync). Used by GenerateCache under transformers' compile and by
DecodeGraphs(compile=True).
"""

# no `from __future__ import annotations`: torch.library.custom_op reads the op's annotations as types
from typing import Optional

import torch

from lowbit.core.errors import LowbitError
from lowbit.weights.qlinear import QuantLinear


# ------------------------------------------------------------------ the fused decode kernel
@torch.library.custom_op("lowbit::decode_attention_tiers", mutates_args=())
def decode_attention_op(q: torch.Tensor, k_codes: torch.Tensor, k_scale: torch.Tensor,
                        k_zero: Optional[torch.Tensor],  # noqa: UP045
                        v_codes: torch.Tensor, v_scale: torch.Tensor,
                        v_zero: Optional[torch.Tensor],  # noqa: UP045
                        mid_lens: torch.Tensor,
                        sink_k: Optional[torch.Tensor], sink_v: Optional[torch.Tensor],  # noqa: UP045
                        sink_lens: Optional[torch.Tensor],  # noqa: UP045 (typing.Optional: older torch schemas)
                        recent_k: torch.Tensor, recent_v: torch.Tensor, recent_lens: torch.Tensor,
                        k_bits: int, v_bits: int, sm_scale: float,
                        k_centre: float, v_centre: float) -> torch.Tensor:
    """q [B, Hq, D] over sink / packed middle / recent -> [B, Hq, Dv] (lowbit.kernels.attention.tiers).
    An empty middle (k_codes with 0 rows) is no middle tier. Scale-only groups (zero 'none'): k_zero None
    and k_centre the centre code (likewise V); with a stored zero the centre is 0.0."""
    from lowbit.kernels.attention.tiers import decode_attention

    has_mid = k_codes.shape[2] > 0
    mid = (k_codes, k_scale, k_zero, v_codes, v_scale, v_zero) if has_mid else (None,) * 6
    dense = {"recent_k": recent_k, "recent_v": recent_v, "recent_lens": recent_lens}
    if sink_k is not None:
        dense.update(sink_k=sink_k, sink_v=sink_v, sink_lens=sink_lens)
    centres = {"k_centre": k_centre if has_mid and k_zero is None else None,
               "v_centre": v_centre if has_mid and v_zero is None else None}
    return decode_attention(q, *mid, mid_lens=mid_lens if has_mid else None, k_bits=k_bits, v_bits=v_bits,
                            sm_scale=sm_scale, **centres, **dense)


@decode_attention_op.register_fake
def _(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, mid_lens, sink_k, sink_v, sink_lens,
      recent_k, recent_v, recent_lens, k_bits, v_bits, sm_scale, k_centre, v_centre):
    return q.new_empty(q.shape[0], q.shape[1], recent_v.shape[-1])


@torch.library.custom_op("lowbit::decode_attention_vq_tiers", mutates_args=())
def decode_attention_vq_op(q: torch.Tensor, k_codes: torch.Tensor, k_scale: torch.Tensor,
                           k_codebook: Optional[torch.Tensor],  # noqa: UP045
                           v_codes: torch.Tensor, v_scale: torch.Tensor,
                           v_codebook: Optional[torch.Tensor],  # noqa: UP045
                           mid_lens: torch.Tensor,
                           sink_k: Optional[torch.Tensor], sink_v: Optional[torch.Tensor],  # noqa: UP045
                           sink_lens: Optional[torch.Tensor],  # noqa: UP045
                           recent_k: torch.Tensor, recent_v: torch.Tensor, recent_lens: torch.Tensor,
                           k_bits: int, v_bits: int, sm_scale: float,
                           k_centre: float, v_centre: float,
                           k_rbits: Optional[torch.Tensor] = None, k_rgain: Optional[torch.Tensor] = None,  # noqa: UP045
                           v_rbits: Optional[torch.Tensor] = None, v_rgain: Optional[torch.Tensor] = None,  # noqa: UP045
                           ) -> torch.Tensor:
    """q [B, Hq, D] over sink / VQ middle / recent -> [B, Hq, Dv] (lowbit.kernels.attention.vq): a tensor with a
    codebook is VQ rows, one without is scale-only scalar groups with its centre code; rbits / rgain: its 1-bit
    residual (lowbit.quant.residual), if any."""
    from lowbit.kernels.attention.vq import MidTensor, decode_attention_vq

    has_mid = k_codes.shape[2] > 0
    mids = (MidTensor(k_codes, k_scale, k_bits, k_codebook, k_centre, k_rbits, k_rgain),
            MidTensor(v_codes, v_scale, v_bits, v_codebook, v_centre, v_rbits, v_rgain)) if has_mid else (None, None)
    dense = {"recent_k": recent_k, "recent_v": recent_v, "recent_lens": recent_lens}
    if sink_k is not None:
        dense.update(sink_k=sink_k, sink_v=sink_v, sink_lens=sink_lens)
    return decode_attention_vq(q, *mids, mid_lens=mid_lens if has_mid else None, sm_scale=sm_scale, **dense)


@decode_attention_vq_op.register_fake
def _(q, k_codes, k_scale, k_codebook, v_codes, v_scale, v_codebook, mid_lens, sink_k, sink_v, sink_lens,
      recent_k, recent_v, recent_lens, k_bits, v_bits, sm_scale, k_centre, v_centre, k_rbits=None, k_rgain=None,
      v_rbits=None, v_rgain=None):
    return q.new_empty(q.shape[0], q.shape[1], recent_v.shape[-1])


# ------------------------------------------------------------------ packed weight linears
# key -> QuantLinear. The op reads the module's packed tensors (fixed addresses, read-only) instead of
# taking them as arguments: the dispatch picks its kernel from Python fields of PackedWeight.
_PACKED: dict = {}


def register_packed_linears(model) -> int:
    """Give every QuantLinear of `model` that holds CUDA-packed weights a key for packed_linear (its
    forward calls the op when traced by torch.compile); returns how many have one."""
    n = 0
    for m in model.modules():
        if isinstance(m, QuantLinear) and m.packed is not None:
            if getattr(m, "_lowbit_op_key", None) is None:
                m._lowbit_op_key = len(_PACKED)
                _PACKED[m._lowbit_op_key] = m
            n += 1
    return n


@torch.library.custom_op("lowbit::packed_linear", mutates_args=())
def packed_linear_op(x: torch.Tensor, key: int) -> torch.Tensor:
    """x [M, K] -> [M, N] through the registered QuantLinear's packed weight (its dispatch or the twin)."""
    from lowbit.kernels.gemm import triton_gemm as weight_gemm

    m = _PACKED[key]
    return weight_gemm.linear_twin(x, m.packed) if m.dispatch == "twin" else m.dispatch.linear(x, m.packed)


@packed_linear_op.register_fake
def _(x, key):
    return x.new_empty(x.shape[0], _PACKED[key].out_features)


def traced_packed_linear(module, x2: torch.Tensor) -> torch.Tensor:
    """What QuantLinear.forward runs for packed weights inside a torch.compile trace: x2 [M, K] -> [M, N]."""
    key = getattr(module, "_lowbit_op_key", None)
    if key is None:
        raise LowbitError("a packed QuantLinear was traced by torch.compile without a kernel op key; call "
                          "lowbit.kernels.ops.register_packed_linears(model) before compiling")
    return packed_linear_op(x2.contiguous(), key)  # the kernels take rows contiguous
