import logging

import pytest
import torch

from lowbit.core.errors import LowbitError
from lowbit.weights.gptq import gptq_quantize, inverse_hessian_chol, rtn_quantize


def _problem(out=24, n=96, tokens=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(out, n, generator=g) * 0.05
    mix = torch.randn(n, n, generator=g) * 0.3 + torch.eye(n)  # correlated inputs
    scale = torch.rand(n, generator=g) * 3 + 0.1  # uneven channel energy (act-order matters)
    X = (torch.randn(tokens, n, generator=g) @ mix) * scale
    return W, X, X.T @ X / tokens


@pytest.mark.parametrize("sym", [False, True])
def test_gptq_beats_rtn_on_its_hessian(sym):
    W, X, H = _problem()
    r = rtn_quantize(W, 4, 32, sym, H=H)
    q = gptq_quantize(W, H, 4, 32, sym, block=16)
    assert q.proxy_loss < 0.8 * r.proxy_loss
    # the proxy is the real output error on the calibration inputs
    out_err = ((X @ (q.dequantize() - W).T) ** 2).sum() / X.shape[0] / W.shape[0]
    assert abs(float(out_err) - q.proxy_loss) < 1e-3 * q.proxy_loss + 1e-9
    assert q.codes.dtype == torch.uint8 and int(q.codes.max()) <= 15


def test_gptq_with_diagonal_hessian_is_rtn_on_the_same_grid():
    # no correlation between inputs: nothing to compensate, every column rounds to nearest
    W, _, _ = _problem(out=5, n=64)
    H = torch.diag(torch.rand(64) + 0.5)
    q = gptq_quantize(W, H, 4, 32, False, block=7)
    r = rtn_quantize(W, 4, 32, False)
    assert torch.equal(q.codes, r.codes)


def test_static_act_order_keeps_groups_contiguous_and_codes_in_original_order():
    W, _, H = _problem(out=9, n=64, seed=1)
    a = gptq_quantize(W, H, 4, 32, False, act_order=True)
    b = gptq_quantize(W, H, 4, 32, False, act_order=False)
    # same static grid either way (fitted on W before any update, original order)
    assert torch.equal(a.grid.scale, b.grid.scale) and torch.equal(a.grid.zero_point, b.grid.zero_point)
    assert a.grid.scale.shape == (9, 2)
    assert not torch.equal(a.codes, b.codes)
    # act-order codes line up with the original columns: they reconstruct W better than shuffled
    err = lambda q: float(((q.dequantize() - W) ** 2).sum())
    assert err(a) < 4 * err(b)


def test_per_channel_8bit():
    W, _, H = _problem(out=11, n=99)
    q = gptq_quantize(W, H, 8, 99, True)
    r = rtn_quantize(W, 8, 99, True, H=H)
    assert q.grid.scale.shape == (11, 1) and q.proxy_loss < r.proxy_loss


def test_dead_inputs_do_not_break_factorisation():
    W, _, H = _problem(out=4, n=64)
    H[:, 3] = 0
    H[3, :] = 0
    q = gptq_quantize(W, H, 4, 32, False)
    assert torch.isfinite(q.dequantize()).all()


def test_damp_retries_are_logged_then_the_layer_is_named(caplog):
    H = torch.eye(64)
    H[0, 1] = H[1, 0] = 0.9999999  # nearly singular: the first damp may or may not do
    H2 = torch.tensor([[1.0, 5.0], [5.0, 1.0]])  # indefinite: no damp up to 100x fixes it
    with caplog.at_level(logging.WARNING, logger="lowbit.weights.gptq"), pytest.raises(
        LowbitError, match=r"model\.layers\.3\.mlp\.down_proj.*not positive definite"
    ):
        inverse_hessian_chol(H2, 0.01, name="model.layers.3.mlp.down_proj")
    assert sum("retrying" in r.message for r in caplog.records) == 4
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lowbit.weights.gptq"):
        U, used = inverse_hessian_chol(H, 0.01, name="x")
    # eigenvalues of H are ~1e-7, 1 (x62) and ~2, mean diag 1: the asked 1% factorises at once, so
    # nothing is retried, and the factor is of the DAMPED matrix: U upper with U^T U = (H + 0.01 I)^-1,
    # whose norm the damp caps at 1/0.01 (the undamped inverse would reach ~1e7)
    assert used == pytest.approx(0.01) and not caplog.records
    assert torch.equal(U, torch.triu(U))
    Hd = H.double() + used * torch.eye(64, dtype=torch.float64)
    Hinv = U.double().T @ U.double()
    torch.testing.assert_close(Hinv @ Hd, torch.eye(64, dtype=torch.float64), atol=1e-4, rtol=0)
    assert torch.linalg.matrix_norm(Hinv, ord=2) <= 1 / used * 1.001


def test_damp_ladder_stops_at_the_first_damp_that_makes_h_definite(caplog):
    # H = Q diag(lam) Q^T with one eigenvalue -0.02 and mean diag m = (62 + 0.5 - 0.02) / 64 ~ 0.976:
    # damp 1% adds 0.0098 (still indefinite), the next rung 10**0.5 % adds 0.031 (definite) -> used
    n = 64
    Q, _ = torch.linalg.qr(torch.randn(n, n, generator=torch.Generator().manual_seed(3), dtype=torch.float64))
    lam = torch.ones(n, dtype=torch.float64)
    lam[0], lam[1] = -0.02, 0.5
    H = (Q * lam) @ Q.T
    m = float(torch.diagonal(H).mean())
    with caplog.at_level(logging.WARNING, logger="lowbit.weights.gptq"):
        U, used = inverse_hessian_chol(H.float(), 0.01, name="q_proj")
    assert used == pytest.approx(0.01 * 10**0.5)
    assert [("retrying" in r.message, "needed damp" in r.message) for r in caplog.records] == [(True, False),
                                                                                               (False, True)]
    Hd = H.float().double() + used * m * torch.eye(n, dtype=torch.float64)
    torch.testing.assert_close(U.double().T @ U.double() @ Hd, torch.eye(n, dtype=torch.float64), atol=1e-4, rtol=0)


def test_bad_shapes_are_errors():
    W, _, H = _problem(out=4, n=64)
    with pytest.raises(LowbitError, match="does not match in_features"):
        gptq_quantize(W, H[:32, :32], 4, 32, False, name="l")
    with pytest.raises(LowbitError, match="group 48 does not divide"):
        gptq_quantize(W, H, 4, 48, False, name="l")
