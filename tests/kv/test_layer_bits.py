"""Per-layer bits (KVScheme.layer_bits) and the std-placed grid, in the cache."""

import pytest
import torch

from lowbit.core.errors import LowbitError
from lowbit.kv.codec import TensorCodec
from lowbit.models.tiny import tiny_tokenizer_free_inputs
from lowbit.quant import affine
from lowbit.runtime.cache import QuantizedKVCache

from .helpers import fast_model, make_model, reference, rel_err, run_chunks, scheme


@pytest.fixture(scope="module")
def llama3():
    return make_model("smollm2-135m", num_layers=3)


def _ids(model, B, L, seed=0):
    return tiny_tokenizer_free_inputs(model.config, B, L, seed=seed)


def test_each_layer_holds_its_own_bits(llama3):
    s = scheme("int2", layer_bits="1=int8;2=bf16")
    cache = QuantizedKVCache(llama3, s)
    run_chunks(llama3, cache, _ids(llama3, 2, 41), None, [33] + [1] * 8)
    per = {lm.index: lm for lm in cache.memory().layers}
    bpe = {i: 8 * (m.bytes["middle_k"] + m.bytes["middle_v"]) / (m.elements_k + m.elements_v) for i, m in per.items()}
    assert bpe[0] == pytest.approx(2.5) and bpe[1] == pytest.approx(8.5)  # head_dim 64: 2 x 16 / 64 on top
    assert bpe[2] == pytest.approx(8 * llama3.dtype.itemsize)  # stored dense in the model dtype
    assert per[0].quantized_rows > 0 and per[1].quantized_rows > 0 and per[2].quantized_rows == 0
    assert [lay.k_codec.bits for lay in cache.layers] == [2, 8, 16]
    assert "layers 1=int8;2=bf16" in cache.scheme.describe()
    # the whole-cache bits per element are the element-weighted mean over layers
    bk, _ = cache.memory().middle_bits_per_element()
    assert bpe[0] < bk < bpe[2]


def test_override_to_bf16_on_every_layer_is_exact(llama3):
    ids = _ids(llama3, 1, 30)
    chunks = [22] + [1] * 8
    ref = reference(llama3, ids, None, chunks)
    out = run_chunks(llama3, QuantizedKVCache(llama3, scheme("int2", layer_bits="0,1,2=bf16")), ids, None, chunks)
    assert rel_err(out, ref) < 1e-4
    out2 = run_chunks(llama3, QuantizedKVCache(llama3, scheme("int2", layer_bits="0,2=bf16")), ids, None, chunks)
    assert rel_err(out2, ref) > 1e-4  # layer 1 really quantized


def test_an_override_takes_its_widths_default_grid(llama3):
    s = scheme("k2v4", lloyd_max=True, layer_bits="1=int4;2=int8")
    cache = QuantizedKVCache(llama3, s)
    assert [lay.k_codec.tq.lloyd_max for lay in cache.layers] == [True, False, False]
    assert cache.layers[1].v_codec.tq.lloyd_max  # V kept its 4 bits, so it keeps its Lloyd-Max levels
    assert [lay.k_codec.tq.grid for lay in cache.layers] == ["minmax"] * 3


def test_layer_out_of_range_is_refused_at_construction(llama3):
    with pytest.raises(LowbitError, match=r"layer\(s\) 3 .* layers 0\.\.2"):
        QuantizedKVCache(llama3, scheme("int2", layer_bits="3=int4"))


def test_std_grid_is_affine_and_beats_minmax_at_2_bits():
    x = torch.randn(2, 3, 33, 64, generator=torch.Generator().manual_seed(1))
    std = TensorCodec(scheme("int2").k, 64, 4)
    mm = TensorCodec(scheme("int2", grid="minmax").k, 64, 4)
    assert std.tq.grid == "std" and mm.tq.grid == "minmax"
    f = std.encode(x, torch.float32)
    # the stored fields decode with the one affine formula (what the fused kernel implements)
    q = affine.AffineQuantized(
        _unpacked(f["codes"]), f["scale"], f["zero"], 2, 64, False
    )
    assert torch.allclose(affine.dequantize(q), std.decode(f), atol=1e-6)
    e_std = (std.decode(f) - x).pow(2).mean()
    e_mm = (mm.decode(mm.encode(x, torch.float32)) - x).pow(2).mean()
    assert e_std < 0.8 * e_mm


def _unpacked(codes):
    from lowbit.quant import packing

    return packing.unpack(codes, 2, "strided")


def test_std_grid_goes_to_the_fused_kernel():
    gemma = fast_model("gemma3-270m")
    cache = QuantizedKVCache(gemma, scheme("int2", sink=2, recent=4, page=2), decode_backend="torch")
    run_chunks(gemma, cache, _ids(gemma, 1, 20), None, [18, 1, 1])
    from lowbit import backends

    kernel = backends.get("triton-decode")
    assert all(kernel.why_not(lay.plan, "decode", "cuda") is None for lay in cache.layers)
