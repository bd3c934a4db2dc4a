"""HessianCollector: mean x^T x per linear, shared by linears fed the same tensor; bf16 GEMM option."""

import pytest
import torch
from torch import nn

from lowbit.errors import LowbitError
from lowbit.weights.hooks import HessianCollector


class Two(nn.Module):
    def __init__(self, d=99):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(d, 7), nn.Linear(d, 5), nn.Linear(7, 3)

    def forward(self, x):
        return self.c(self.a(x)) + self.b(x).sum(-1, keepdim=True)


@pytest.mark.parametrize("gemm_dtype", [None, torch.bfloat16])
def test_mean_xtx_shared_and_bf16(gemm_dtype):
    torch.manual_seed(0)
    m = Two()
    xs = [torch.randn(3, 33, 99).bfloat16().float() for _ in range(2)]  # bf16-representable inputs
    with HessianCollector({"a": m.a, "b": m.b, "c": m.c}, gemm_dtype=gemm_dtype) as hc:
        for x in xs:
            hc.new_batch()
            m(x)
    X = torch.cat([x.reshape(-1, 99) for x in xs]).double()
    ref = (X.T @ X / X.shape[0]).float()
    tol = 1e-5 if gemm_dtype is None else 8e-3  # bf16 rounding of each batch's product
    assert torch.allclose(hc.hessian("a"), ref, rtol=tol, atol=tol * ref.abs().max().item())
    assert hc.hessian("b") is not None and torch.equal(hc.hessian("a"), hc.hessian("b"))  # one accumulator
    assert hc.tokens("c") == 2 * 3 * 33 and hc.hessian("c").shape == (7, 7)


def test_dead_hook_is_an_error():
    m = Two()
    with HessianCollector({"a": m.a}) as hc:
        pass
    with pytest.raises(LowbitError, match="never reached"):
        hc.hessian("a")
