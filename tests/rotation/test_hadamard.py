import math

import pytest
import torch

from lowbit.core.errors import LowbitError
from lowbit.rotation.hadamard import SUPPORTED_M, factor_order, fwht, hadamard, is_supported_order

# Every base order times a few powers of two, plus the head dims met in practice.
ORDERS = sorted({m * 2**k for m in SUPPORTED_M for k in (0, 1, 3)} | {2, 4, 64, 128, 192, 256, 512, 576})


@pytest.mark.parametrize("n", ORDERS)
def test_orthogonal_with_entries_pm_inv_sqrt_n(n):
    H = hadamard(n)
    assert H.shape == (n, n) and H.dtype == torch.float32
    torch.testing.assert_close(H @ H.T, torch.eye(n), atol=1e-5, rtol=0)
    # Every entry is exactly +-1/sqrt(n): the scaled matrix is a +-1 matrix.
    S = H.double() * math.sqrt(n)
    assert torch.equal(S.abs().round(), torch.ones(n, n, dtype=torch.float64))
    assert (S.abs() - 1).abs().max() < 1e-6


@pytest.mark.parametrize("m", [m for m in SUPPORTED_M if m > 1])
def test_paley_blocks_are_not_sylvester_padding(m):
    # The base block is a genuine order-m Hadamard matrix: integer +-1 with H H^T = m I exactly.
    H = (hadamard(m, torch.float64) * math.sqrt(m)).round()
    assert torch.equal(H @ H.T, m * torch.eye(m, dtype=torch.float64))


def test_factor_order():
    assert factor_order(1) == (1, 0)
    assert factor_order(2) == (1, 1)
    assert factor_order(192) == (12, 4)
    assert factor_order(576) == (36, 4)
    assert factor_order(80) == (20, 2)
    assert factor_order(28 * 8) == (28, 3)


@pytest.mark.parametrize("n", [3, 5, 6, 10, 18, 52, 100, 120 * 3])
def test_unsupported_orders_raise_clear_error(n):
    assert not is_supported_order(n)
    with pytest.raises(LowbitError, match=rf"no Hadamard construction of order {n}\b.*m\*2\^k for m in"):
        hadamard(n)


@pytest.mark.parametrize("bad", [0, -4, 2.0, True, "64"])
def test_bad_order_types_raise(bad):
    with pytest.raises(LowbitError, match="positive integer"):
        hadamard(bad)


def test_dtype_device_and_cache_is_not_aliased():
    H = hadamard(12, dtype=torch.bfloat16, device="cpu")
    assert H.dtype == torch.bfloat16 and H.device.type == "cpu"
    H64 = hadamard(12, torch.float64)
    H64.zero_()  # callers may scribble on their copy without corrupting the cache
    torch.testing.assert_close(hadamard(12, torch.float64) @ hadamard(12, torch.float64).T,
                               torch.eye(12, dtype=torch.float64))
    with pytest.raises(LowbitError, match="floating dtype"):
        hadamard(4, dtype=torch.int32)


@pytest.mark.parametrize("lead", [(1,), (3,), (99,), (3, 1, 5)])
@pytest.mark.parametrize("n", [2**k for k in range(11)])
def test_fwht_equals_matmul(lead, n):
    g = torch.Generator().manual_seed(n * 7 + len(lead))
    x = torch.randn(*lead, n, generator=g, dtype=torch.float64)
    torch.testing.assert_close(fwht(x), x @ hadamard(n, torch.float64), atol=1e-12, rtol=1e-12)


def test_fwht_float32_non_contiguous_and_involution():
    x = torch.randn(64, 5).T  # [5, 64], last-dim stride 5
    y = fwht(x)
    torch.testing.assert_close(y, x @ hadamard(64), atol=1e-5, rtol=1e-5)
    # Sylvester's matrix is symmetric and orthogonal: applying it twice gives x back.
    torch.testing.assert_close(fwht(y), x, atol=1e-5, rtol=1e-5)
    assert x.shape == (5, 64)  # input untouched in shape


def test_fwht_bf16_returns_bf16_close_to_fp32():
    x = torch.randn(3, 128)
    y = fwht(x.bfloat16())
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), fwht(x), atol=3e-2, rtol=2e-2)


def test_fwht_preserves_norm_spreads_a_spike():
    x = torch.zeros(1, 256)
    x[0, 17] = 16.0
    y = fwht(x)
    assert torch.allclose(y.abs(), torch.full_like(y, 1.0))  # 16 / sqrt(256)
    torch.testing.assert_close(y.norm(), x.norm())


@pytest.mark.parametrize("n", [3, 12, 192])
def test_fwht_rejects_non_power_of_two(n):
    with pytest.raises(LowbitError, match="power-of-two"):
        fwht(torch.randn(2, n))


def test_fwht_rejects_integer_and_scalar():
    with pytest.raises(LowbitError, match="floating"):
        fwht(torch.ones(2, 4, dtype=torch.int64))
    with pytest.raises(LowbitError, match="at least one dim"):
        fwht(torch.tensor(1.0))
