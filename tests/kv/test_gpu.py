"""The cache on CUDA: exactness against DynamicCache, and the fused decode kernel behind the hook."""

import pytest
import torch

from lowbit.models.tiny import tiny_tokenizer_free_inputs
from lowbit.runtime.cache import QuantizedKVCache

from .helpers import FAST, fast_model, reference, rel_err, run_chunks, scheme


def _skip_reason() -> str | None:
    """Why this module cannot run here, or None. Under TRITON_INTERPRET=1 (what tests/conftest.py sets for
    CPU runs) the kernels are interpreted and refuse CUDA tensors, so the fused path could not be tested."""
    if not torch.cuda.is_available():
        return "needs CUDA"
    try:
        from lowbit.kernels.attention.common import interpreted
    except ImportError as e:
        return f"needs triton for the fused decode kernel ({e})"
    if interpreted():
        return "kernels imported under TRITON_INTERPRET=1 (CPU interpreter); run with TRITON_INTERPRET=0 on CUDA"
    return None


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))]


@pytest.fixture(scope="module", params=list(FAST))
def model(request):
    return fast_model(request.param).cuda()


def test_bf16_tiers_exact_on_cuda(model):
    ids = tiny_tokenizer_free_inputs(model.config, 3, 41, seed=1).cuda()
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    chunks = [25, 1, 1, 1, 13]
    ref = reference(model, ids, mask, chunks)
    out = run_chunks(model, QuantizedKVCache(model, scheme("bf16")), ids, mask, chunks)
    assert rel_err(out, ref, mask) < 1e-4


@pytest.mark.parametrize("name", ["int4", "int2", "k4v2", "int8"])
def test_fused_decode_kernel_matches_torch_path(model, name):
    """decode_backend auto takes the kernel on CUDA for one-token steps; logits match the torch twin."""
    ids = tiny_tokenizer_free_inputs(model.config, 2, 60, seed=2).cuda()
    chunks = [40] + [1] * 20
    s = scheme(name, sink=4, recent=8, page=4)
    a_cache = QuantizedKVCache(model, s, decode_backend="torch")
    a = run_chunks(model, a_cache, ids, None, chunks)
    b_cache = QuantizedKVCache(model, s, decode_backend="auto")
    b = run_chunks(model, b_cache, ids, None, chunks)
    print(name, dict(b_cache.backend_calls), b_cache.backend_notes[:2], f"rel {rel_err(b, a):.2e}")
    assert b_cache.backend_calls["triton"] > 0
    assert rel_err(b, a) < 5e-3  # the kernel dequantizes in fp16 (2.0e-3 seen for k4v2 on an H200)


def test_per_layer_bits_on_cuda_take_the_kernel(model):
    """Layers of different bits each reach the kernel with their own codec (std grid at 2 bits, min/max at 4)."""
    ids = tiny_tokenizer_free_inputs(model.config, 2, 50, seed=3).cuda()
    chunks = [36] + [1] * 14
    s = scheme("int2", sink=4, recent=8, page=4, layer_bits="0=int4")
    a = run_chunks(model, QuantizedKVCache(model, s, decode_backend="torch"), ids, None, chunks)
    cache = QuantizedKVCache(model, s, decode_backend="auto")
    b = run_chunks(model, cache, ids, None, chunks)
    assert [lay.k_codec.bits for lay in cache.layers][:1] == [4] and cache.layers[-1].k_codec.bits == 2
    assert cache.backend_calls["triton"] == 14 * len(cache.layers)
    assert rel_err(b, a) < 5e-3
