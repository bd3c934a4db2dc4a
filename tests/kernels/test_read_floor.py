"""The read-floor kernel (lowbit.tools.bench.read_floor) against its torch twin at odd sizes (Triton interpreter on
CPU): every word is read once, by exactly one program, and a dropped tail would change a sum."""

from __future__ import annotations

import pytest
import torch

from lowbit.kernels.attention.common import interpreted
from lowbit.tools.bench.read_floor import READ_CONFIGS, programs, read_words, read_words_ref

pytestmark = pytest.mark.skipif(not interpreted(), reason="kernels imported for CUDA (TRITON_INTERPRET=0)")


@pytest.mark.parametrize("n", [1, 3, 17, 99, 999, 5000])
@pytest.mark.parametrize("block,iters", [(16, 1), (32, 4), (64, 3)])
def test_read_words_matches_twin(n, block, iters):
    g = torch.Generator().manual_seed(n)
    w = torch.randint(-2**31, 2**31 - 1, (n,), dtype=torch.int32, generator=g)
    got = read_words(w, block, iters, num_warps=1)
    assert got.shape == (programs(n, block, iters),)
    assert torch.equal(got, read_words_ref(w, block, iters))
    w2 = w.clone()
    w2[-1] += 1  # the last word is read: its program's sum moves
    assert not torch.equal(read_words(w2, block, iters, num_warps=1), got)


def test_configs_are_powers_of_two():
    for block, iters, warps in READ_CONFIGS:
        assert block & (block - 1) == 0 and iters >= 1 and warps in (1, 2, 4, 8, 16)
