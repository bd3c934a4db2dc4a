"""DeepseekV3 (MLA) through the lowbit cache, expanded (K 192 / V 128 per head) and latent (c_kv + k_pe).

Tiny random model from the real config (lowbit.models.families: kv_lora_rank 512, qk_rope 64,
qk_nope 128, v_head 128; 4 heads, 2 layers). The reference is transformers' own DeepseekV3 forward
with DynamicCache (5.24 caches the latent and expands it; 5.17 caches expanded K/V): same logits.
The int8 runs use dense MLPs (first_k_dense_replace=2): MoE top-k routing of a random model flips
experts on tiny perturbations, which would measure the router, not the cache.
"""

import pytest
import torch

from lowbit.core.errors import LowbitError
from lowbit.kv.codec import TensorCodec
from lowbit.models.families import family_geometry
from lowbit.models.geometry import ModelGeometry
from lowbit.models.tiny import tiny_tokenizer_free_inputs
from lowbit.runtime.cache import QuantizedKVCache

from .helpers import make_model, reference, rel_err, run_chunks, scheme

TOL = 1e-4
DECODE = [19] + [1] * 32  # prefill past sink + recent + pages, then 32 decode steps
CHUNKED = [7, 1, 12, 3, 1, 9] + [1] * 6


@pytest.fixture(scope="module")
def moe_model():
    return make_model("deepseek-v3")


@pytest.fixture(scope="module")
def dense_model():
    return make_model("deepseek-v3", first_k_dense_replace=2, seed=1)


def _geom(model, mla):
    return ModelGeometry.from_config(model.config, mla=mla)


@pytest.mark.parametrize("mla", ["expanded", "latent"])
@pytest.mark.parametrize("chunks", [DECODE, CHUNKED], ids=["prefill+32-decode", "chunked"])
def test_bf16_equals_transformers(moe_model, mla, chunks):
    ids = tiny_tokenizer_free_inputs(moe_model.config, 2, sum(chunks), seed=3)
    ref = reference(moe_model, ids, None, chunks)
    cache = QuantizedKVCache(moe_model, scheme("bf16"), geometry=_geom(moe_model, mla))
    out = run_chunks(moe_model, cache, ids, None, chunks)
    assert rel_err(out, ref) < TOL
    layer = cache.layers[0]
    assert layer.mid_len > 0 and cache.backend_calls["torch"] > 0  # the middle tier was read in decode
    want = (1, 512) if mla == "latent" else (4, 128)
    assert (layer.ring["v"].shape[1], layer.ring["v"].shape[-1]) == want
    # latent: only k_pe (64) is held for K; expanded: the whole 192-wide key per head
    assert layer.ring["k"].shape[-1] == (64 if mla == "latent" else 192)


@pytest.mark.parametrize("mla", ["expanded", "latent"])
def test_int8_within_half_a_percent(dense_model, mla):
    ids = tiny_tokenizer_free_inputs(dense_model.config, 2, sum(DECODE), seed=4)
    ref = reference(dense_model, ids, None, DECODE)
    cache = QuantizedKVCache(dense_model, scheme("int8"), geometry=_geom(dense_model, mla))
    out = run_chunks(dense_model, cache, ids, None, DECODE)
    assert cache.quantized_rows_total() > 0
    err = float((out - ref).norm() / ref.norm())
    assert 0 < err < 0.005


def test_int2_hadamard_192_decodes_close(dense_model):
    """Expanded K 192 at INT2 with Hadamard of order 192 and group 64: it runs the decode path and stays sane."""
    ids = tiny_tokenizer_free_inputs(dense_model.config, 1, sum(DECODE), seed=5)
    ref = reference(dense_model, ids, None, DECODE)
    cache = QuantizedKVCache(dense_model, scheme("int2", rotation="hadamard"), geometry=_geom(dense_model, "expanded"))
    out = run_chunks(dense_model, cache, ids, None, DECODE)
    lp = cache.plan.layers[0]
    assert lp.k.group == 64 and lp.rot_k.shape == (192, 192) and lp.rot_v.shape == (128, 128)
    err = float((out - ref).norm() / ref.norm())
    assert 0 < err < 0.5


@pytest.mark.parametrize("mla", ["expanded", "latent"])
def test_every_middle_row_went_through_the_quantizer(dense_model, mla, monkeypatch):
    sentinel = 7.0
    orig = TensorCodec.encode

    def poisoned(self, x, dense_dtype):
        return orig(self, torch.full_like(x, sentinel), dense_dtype)

    monkeypatch.setattr(TensorCodec, "encode", poisoned)
    cache = QuantizedKVCache(dense_model, scheme("int4", rotation="hadamard", sink=2, recent=4, page=2),
                             geometry=_geom(dense_model, mla))
    ids = tiny_tokenizer_free_inputs(dense_model.config, 2, 25, seed=6)
    run_chunks(dense_model, cache, ids, None, [13] + [1] * 6 + [6])
    for layer in cache.layers:
        k, v = layer.middle_dequantized()
        assert layer.mid_len > 0
        assert torch.all(k == sentinel) and torch.all(v == sentinel)
        assert not torch.any(layer.ring["v"][:, :, : layer.ring_len] == sentinel)


def test_latent_bytes_per_token_full_size():
    """DeepSeek-V3 full-size geometry, one layer fed random latents: bytes/token of the middle tier as held."""
    g = family_geometry("deepseek-v3")
    assert (g.layers[0].head_dim_k, g.layers[0].head_dim_v, g.layers[0].num_kv_heads) == (576, 512, 1)
    per_token = {}
    for name in ("bf16", "int2"):
        cache = QuantizedKVCache(_config_of("deepseek-v3"), scheme(name, sink=0, recent=16, page=16), geometry=g)
        layer = cache.layers[0]
        T = 64 + 16
        k = torch.randn(1, 1, T, 576, dtype=torch.bfloat16)
        layer.update(k, k[..., :512].clone())
        rep = cache.memory().layers[0]
        per_token[name] = (rep.bytes["middle_k"] + rep.bytes["middle_v"]) / layer.mid_len
    assert per_token["bf16"] == 1152  # (512 + 64) x 2
    assert per_token["int2"] == 128 + 16 + 128  # codes 512 x 2 bit, fp16 scale+zero x 4 groups, k_pe bf16
    assert per_token["int2"] <= 300


def test_expanded_bytes_per_token_full_size():
    g = family_geometry("kimi-k2", mla="expanded")
    cache = QuantizedKVCache(_config_of("kimi-k2"), scheme("int2", sink=0, recent=16, page=16), geometry=g)
    layer = cache.layers[0]
    T = 48
    layer.update(torch.randn(1, 64, T, 192, dtype=torch.bfloat16), torch.randn(1, 64, T, 128, dtype=torch.bfloat16))
    rep = cache.memory().layers[0]
    b = (rep.bytes["middle_k"] + rep.bytes["middle_v"]) / layer.mid_len
    assert b == 64 * ((48 + 3 * 4) + (32 + 4))  # per head: K codes 48 B + 3 groups of 64; V 32 B + 1 group
    assert rep.bf16_bytes_per_token == 64 * (192 + 128) * 2


def _config_of(name):
    from transformers import AutoConfig

    from lowbit.models.families import family_config_dict

    d = family_config_dict(name)
    return AutoConfig.for_model(d.pop("model_type"), **d)


# ------------------------------------------------------------------ bad input
def test_latent_needs_one_scheme_for_k_and_v(moe_model):
    with pytest.raises(LowbitError, match="stores K and V once"):
        QuantizedKVCache(moe_model, scheme("k4v2"), geometry=_geom(moe_model, "latent"))
    QuantizedKVCache(moe_model, scheme("k4v2"), geometry=_geom(moe_model, "expanded"))  # expanded: fine


def test_latent_rotation_checks(moe_model, tmp_path):
    from lowbit.rotation.rotation_set import RotationSet

    g = _geom(moe_model, "latent")
    eye = torch.eye(576)

    def save(k, v, name, model="deepseek_v3"):
        k, v = [t.clone() for t in k], [t.clone() for t in v]  # safetensors refuses shared storage
        return RotationSet(model=model, k=k, v=v).save(tmp_path / name, inputs={"test": True})

    per_head = save([eye[None]] * 2, [torch.eye(512)[None]] * 2, "perhead")
    with pytest.raises(LowbitError, match="one head shared by all 4 query heads"):
        QuantizedKVCache(moe_model, scheme("int4", rotation=str(per_head)), geometry=g)
    other = save([torch.eye(320)] * 2, [torch.eye(256)] * 2, "rank256")
    with pytest.raises(LowbitError, match="kv_lora_rank 512"):
        QuantizedKVCache(moe_model, scheme("int4", rotation=str(other)), geometry=g)


# ------------------------------------------------------------------ K 192: packing and rotation
@pytest.mark.parametrize("bits", [2, 4])
def test_strided_layout_of_192_bit_for_bit(bits):
    """Byte j of a 192-wide row holds dims j, j + S, j + 2S, ... (S = 192 / codes per byte): 2 bits -> j, j+48,
    j+96, j+144 (not 256's j, j+64, ...); the codec's packed middle rows are exactly that."""
    from lowbit.quant import packing

    P = 8 // bits
    S = 192 // P
    codes = torch.randint(0, 1 << bits, (3, 5, 192), generator=torch.Generator().manual_seed(bits), dtype=torch.uint8)
    packed = packing.pack(codes, bits, "strided")
    assert packed.shape == (3, 5, S)
    want = torch.zeros(3, 5, S, dtype=torch.int32)
    for j in range(S):
        for i in range(P):
            want[..., j] |= codes[..., j + i * S].int() << (i * bits)
    assert torch.equal(packed.int(), want)
    assert torch.equal(packing.unpack(packed, bits, "strided"), codes)


def test_hadamard_192_is_orthogonal_and_used():
    from lowbit.rotation.hadamard import hadamard, is_supported_order

    assert is_supported_order(192)
    h = hadamard(192)
    torch.testing.assert_close(h @ h.T, torch.eye(192), atol=1e-5, rtol=0)
