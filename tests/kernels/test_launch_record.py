"""decode_attention's launch record: returned to the caller (no module-global "last launch"), and the
interpreter/compiled mode read from the kernel objects at call time, never from an env var by lowbit."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _make import make_inputs

import lowbit.kernels.attention.tiers as da
from lowbit.kernels.attention import common
from lowbit.kernels.attention.common import interpreted
from lowbit.kernels.attention.tiers import KernelConfig, Launch, decode_attention

pytestmark = pytest.mark.skipif(not interpreted(), reason="kernels imported without TRITON_INTERPRET=1")


def test_each_call_returns_its_own_launch_record():
    cfg = KernelConfig(warp_tokens=16, num_warps=2, num_splits=3, dense_block=16)
    a_kw = make_inputs(2, 3, 1, 64, 99, kbits=4, vbits=4, dtype=torch.bfloat16, recent=5)
    b_kw = make_inputs(1, 4, 1, 64, 7, kbits=2, vbits=2, dtype=torch.bfloat16)
    out_a, la = decode_attention(**a_kw, config=cfg, return_launch=True)
    out_b, lb = decode_attention(**b_kw, config=cfg, return_launch=True)
    # 99 middle tokens in steps of 32 (16 tokens x 2 warps): 3 splits of 64 asked -> 2 splits of 64,
    # plus one split for the dense recent tier; 7 tokens -> 1 split, no dense tier
    assert isinstance(la, Launch) and (la.num_splits, la.grid, la.split_tokens) == (2, (3, 1, 2), 64)
    assert (lb.num_splits, lb.grid, lb.split_tokens) == (1, (1, 1, 1), 32)
    assert la.mode == lb.mode == "interpreter" and la.blocks_per_sm is None
    assert la.config.num_warps == 2 and la.config.warp_tokens == 16
    # the record belongs to its call: the second call did not touch the first's
    assert (la.num_splits, la.grid) == (2, (3, 1, 2))
    with pytest.raises(AttributeError):
        la.num_splits = 5
    # same output with and without the record
    torch.testing.assert_close(decode_attention(**a_kw, config=cfg), out_a, rtol=0, atol=0)
    assert out_b.shape == (1, 4, 64)


def test_no_module_global_launch_state():
    for name in ("LAST_LAUNCH", "_OCC", "_SMS"):
        assert not hasattr(da, name), name


def test_mode_comes_from_the_kernel_objects_not_the_environment(monkeypatch):
    from triton.runtime.interpreter import InterpretedFunction

    kw = make_inputs(1, 4, 1, 64, 9, dtype=torch.float32)
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # lowbit must not read it: the kernels stay what triton built
    assert interpreted() and isinstance(da._stage1, InterpretedFunction)
    assert decode_attention(**kw, return_launch=True)[1].mode == "interpreter"
    # what the check reads at call time (lowbit.kernels.attention.common.interpreted: the shared stage-2 kernel
    # object): kernel objects that are not interpreter functions refuse CPU tensors
    monkeypatch.setattr(common, "stage2", object())
    assert not interpreted()
    with pytest.raises(da.LowbitError, match="needs the Triton interpreter"):
        decode_attention(**kw)
