"""The fused decode kernel behind the cache's hook, on CPU through the Triton interpreter.

decode_backend="triton" insists on the kernel for every one-token step (it raises if a layer
cannot be taken), so this also proves the sliding layer's out-of-window rows are sliced away
rather than refused. On CUDA, tests/kv/test_gpu.py runs the same comparison natively.
"""

import pytest

from lowbit.core.errors import LowbitError
from lowbit.models.tiny import tiny_tokenizer_free_inputs
from lowbit.runtime.cache import QuantizedKVCache

from .helpers import fast_model, rel_err, run_chunks, scheme


@pytest.fixture(scope="module")
def gemma():
    return fast_model("gemma3-270m")  # sliding (window 11) + full layer, head_dim 256, group 128 = D/2


def test_kernel_decode_matches_torch_path(gemma):
    ids = tiny_tokenizer_free_inputs(gemma.config, 2, 26, seed=4)
    chunks = [20] + [1] * 6
    s = scheme("k4v2", sink=2, recent=4, page=2)
    a = run_chunks(gemma, QuantizedKVCache(gemma, s, decode_backend="torch"), ids, None, chunks)
    cache = QuantizedKVCache(gemma, s, decode_backend="triton")
    b = run_chunks(gemma, cache, ids, None, chunks)
    assert cache.backend_calls["triton"] == 6 * 2 and cache.backend_calls["torch"] == 2  # prefill stays torch
    assert rel_err(b, a) < 5e-3  # the kernel dequantizes in fp16


def test_strict_kernel_backend_refuses_what_it_cannot_take(gemma):
    ids = tiny_tokenizer_free_inputs(gemma.config, 1, 22, seed=5)
    # the plan refuses it when the cache is built, before any token (the reason names the rule)
    with pytest.raises(LowbitError, match="Lloyd-Max"):
        cache = QuantizedKVCache(gemma, scheme("int4", sink=2, recent=4, page=2, lloyd_max=True), decode_backend="triton")
        run_chunks(gemma, cache, ids, None, [21, 1])
    auto = QuantizedKVCache(gemma, scheme("int4", lloyd_max=True), decode_backend="auto")
    run_chunks(gemma, auto, ids, None, [21, 1])  # CPU + auto: the torch path, no complaint
    assert auto.backend_calls["torch"] == 4 and not auto.backend_calls["triton"]
