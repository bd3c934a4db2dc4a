"""HessianCollector: mean x^T x per linear, shared by linears fed the same tensor."""

import pytest
import torch
from torch import nn

from lowbit.core.errors import LowbitError
from lowbit.weights.hooks import HessianCollector


class Two(nn.Module):
    def __init__(self, d=99):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(d, 7), nn.Linear(d, 5), nn.Linear(7, 3)

    def forward(self, x):
        return self.c(self.a(x)) + self.b(x).sum(-1, keepdim=True)


def test_mean_xtx_shared_by_linears_fed_the_same_tensor():
    torch.manual_seed(0)
    m = Two()
    xs = [torch.randn(3, 33, 99) for _ in range(2)]
    with HessianCollector({"a": m.a, "b": m.b, "c": m.c}) as hc:
        for x in xs:
            hc.new_batch()
            m(x)
    X = torch.cat([x.reshape(-1, 99) for x in xs]).double()
    ref = (X.T @ X / X.shape[0]).float()
    tol = 1e-5
    assert torch.allclose(hc.hessian("a"), ref, rtol=tol, atol=tol * ref.abs().max().item())
    assert hc.hessian("b") is not None and torch.equal(hc.hessian("a"), hc.hessian("b"))  # one accumulator
    assert hc.tokens("c") == 2 * 3 * 33 and hc.hessian("c").shape == (7, 7)


def test_dead_hook_is_an_error():
    m = Two()
    with HessianCollector({"a": m.a}) as hc:
        pass
    with pytest.raises(LowbitError, match="never reached"):
        hc.hessian("a")
