"""The cache (lowbit.kv) sending decode steps to the fused kernel gives what its torch path gives."""

from __future__ import annotations

import pytest
import torch

from lowbit.kernels.attention.common import interpreted


@pytest.mark.slow  # ~50 s on 2 shared cores (a 420-token prefill, then the interpreter)
@pytest.mark.skipif(not interpreted(), reason="kernels imported without TRITON_INTERPRET=1")
def test_cache_decode_through_kernel_matches_torch_path():
    from lowbit.models.tiny import tiny_model
    from lowbit.runtime.cache import QuantizedKVCache

    model, cfg = tiny_model("smollm2-135m", num_layers=1, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (2, 420), generator=g)  # sink 64 + middle + recent 256
    steps = torch.randint(0, cfg.vocab_size, (2, 2), generator=g)
    logits, calls = {}, {}
    for backend in ("torch", "triton"):
        cache = QuantizedKVCache(model, "int2", decode_backend=backend)
        with torch.no_grad():
            model(input_ids=ids, past_key_values=cache, use_cache=True)
            out = [model(input_ids=steps[:, i:i + 1], past_key_values=cache, use_cache=True).logits[:, -1]
                   for i in range(steps.shape[1])]
        logits[backend] = torch.stack(out)
        calls[backend] = dict(cache.backend_calls)
    assert calls["triton"].get("triton", 0) == 2  # both decode steps went to the kernel
    rel = (logits["triton"] - logits["torch"]).norm() / logits["torch"].norm()
    assert rel < 1e-3, f"kernel vs torch decode path: rel {rel:.2e}"


@pytest.mark.skipif(not interpreted(), reason="kernels imported without TRITON_INTERPRET=1")
def test_scale_only_cache_decodes_through_kernel_like_torch_path():
    """Scale-only groups (zero "none", no zero buffer held): the plan routes decode to the kernel, which
    computes the zero from the scale, and gives what the torch path gives; k4v2 so both widths are read."""
    from lowbit.kv.plan import resolve
    from lowbit.kv.scheme import parse_kv_scheme
    from lowbit.models import ModelGeometry
    from lowbit.models.tiny import tiny_model
    from lowbit.runtime.cache import QuantizedKVCache

    model, cfg = tiny_model("smollm2-135m", num_layers=1, dtype=torch.float32)
    s = parse_kv_scheme("k4v2", zero="none", sink=2, recent=4, page=2)
    plan = resolve(s, ModelGeometry.from_config(cfg), decode_backend="triton")
    assert plan.layers[0].backends["decode"].name == "triton-decode"
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (3, 45), generator=g)
    steps = torch.randint(0, cfg.vocab_size, (3, 3), generator=g)
    logits, calls = {}, {}
    for backend in ("torch", "triton"):
        cache = QuantizedKVCache(model, s, decode_backend=backend)
        with torch.no_grad():
            model(input_ids=ids, past_key_values=cache, use_cache=True)
            out = [model(input_ids=steps[:, i:i + 1], past_key_values=cache, use_cache=True).logits[:, -1]
                   for i in range(steps.shape[1])]
        assert "zero" not in cache.layers[0].mid["k"]
        logits[backend] = torch.stack(out)
        calls[backend] = dict(cache.backend_calls)
    assert calls["triton"].get("triton", 0) == 3
    rel = (logits["triton"] - logits["torch"]).norm() / logits["torch"].norm()
    assert rel < 1e-3, f"kernel vs torch decode path: rel {rel:.2e}"
