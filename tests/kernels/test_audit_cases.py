"""The decode-attention audit's cases: scale-only groups are audited like stored zeros (CPU: the interpreter)."""

from __future__ import annotations

import pytest
import torch

from lowbit.kernels.attention.common import interpreted
from lowbit.tools.audit.attention import audit, make_case, sweep


def test_sweeps_cover_scale_only_groups():
    for device in ("cpu", "cuda"):
        assert any(kw.get("zero") == "none" for _, kw in sweep(device)), device


def test_scale_only_case_stores_no_zero():
    kw = make_case(2, 3, 1, 64, 19, 2, 4, zero="none")
    assert kw["k_zero"] is None and kw["v_zero"] is None
    assert kw["k_centre"] == 1.5 and kw["v_centre"] == 7.5
    assert kw["k_scale"].dtype == torch.float16 and kw["k_scale"].shape == (2, 1, 19, 1)


@pytest.mark.skipif(not interpreted(), reason="kernels imported without TRITON_INTERPRET=1")
def test_audit_passes_a_scale_only_case_and_the_kernel_reads_the_centre():
    from lowbit.kernels.attention.reference import decode_attention_ref
    from lowbit.kernels.attention.tiers import KernelConfig, decode_attention
    from lowbit.tools.audit.attention import TOL

    case = dict(B=3, Hq=9, Hkv=3, D=64, T=99, kbits=2, vbits=2, zero="none", ragged=True)
    (row,) = audit("cpu", cases=[("scale-only", case)], kernels=("decode_attention",))
    assert row.ok and row.finite, row
    # a kernel that ignored the centre would pass the twin only by luck: half a step off must show
    kw = make_case(**case)
    ref = decode_attention_ref(**kw)
    cfg = KernelConfig(warp_tokens=16, num_warps=2, num_splits=3, dense_block=16)
    off = decode_attention(**{**kw, "v_centre": kw["v_centre"] + 0.5}, config=cfg).float()
    assert float((off - ref).norm() / ref.norm()) > 10 * TOL
