"""Key affine (lowbit.kv.key_affine) and per-layer bits on Qwen2's geometry (14 q / 2 kv heads, head_dim 64,
k_proj bias), with a tiny random Qwen2 whose k_proj bias is made large like the real model's."""

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from lowbit.calib import key_affine as kfit
from lowbit.core.errors import LowbitError
from lowbit.kv import key_affine as kam
from lowbit.kv.plan import resolve
from lowbit.kv.scheme import RotationRef
from lowbit.models.geometry import ModelGeometry
from lowbit.models.tiny import tiny_tokenizer_free_inputs
from lowbit.runtime.cache import QuantizedKVCache

from .helpers import reference, rel_err, run_chunks, scheme


def _qwen2(num_layers=2, bias=40.0, seed=0):
    cfg = Qwen2Config(vocab_size=99, hidden_size=128, intermediate_size=96, num_hidden_layers=num_layers,
                      num_attention_heads=14, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
                      rope_theta=1e6, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        m = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").float().eval()
        with torch.no_grad():
            for layer in m.model.layers:
                b = layer.self_attn.k_proj.bias.view(2, 64)
                b.normal_(0, 0.05)
                b[:, [28, 29, 30, 31, 60, 61, 62, 63]] += bias * torch.randn(2, 8)  # slow RoPE pairs: an offset
                layer.self_attn.q_proj.weight.mul_(3.0)  # queries that read the offset channels
    return m


@pytest.fixture(scope="module")
def qwen():
    return _qwen2()


def _affine_dir(tmp_path, model, name="ka", **kw):
    g = ModelGeometry.from_config(model.config, name="tiny-qwen2")
    windows = tiny_tokenizer_free_inputs(model.config, 2, 70, seed=11)  # calibration ids, not the test's
    maps = kfit.fit(model, windows, skip=4, **kw)
    return kam.save(tmp_path / name, maps, model="tiny-qwen2"), g, maps


def test_per_layer_bits_hold_what_the_uniform_recipe_of_their_bits_holds(qwen):
    """The edge-int4 recipe on this geometry: fed identical K/V, each layer of a mixed recipe stores
    bit for bit what the uniform recipe of its bits stores (codes, scale, zero; Hadamard rotation)."""
    cfg = qwen.config
    mixed = QuantizedKVCache(cfg, scheme("int2", layer_bits="0=int4"))
    u2, u4 = QuantizedKVCache(cfg, scheme("int2")), QuantizedKVCache(cfg, scheme("int2", layer_bits="0,1=int4"))
    g = torch.Generator().manual_seed(3)
    for _ in range(3):  # chunks of 9: the middle fills page by page
        k = torch.randn(1, 2, 9, 64, generator=g) * 3 + 20 * torch.randn(1, 2, 1, 64, generator=g)
        v = torch.randn(1, 2, 9, 64, generator=g)
        for c in (mixed, u2, u4):
            for i in range(2):
                c.layers[i].update(k, v)
    assert mixed.layers[0].mid_len > 0
    for i, want in ((0, u4), (1, u2)):
        got, ref = mixed.layers[i], want.layers[i]
        assert got.k_codec.bits == ref.k_codec.bits and got.k_codec.tq == ref.k_codec.tq
        for t in ("k", "v"):
            for f in ("codes", "scale", "zero"):
                assert torch.equal(got._mid_fields(t, 0, got.mid_len)[f], ref._mid_fields(t, 0, ref.mid_len)[f])
    assert mixed.layers[0].k_codec.bits == 4 and mixed.layers[1].k_codec.bits == 2


def test_key_affine_is_exact_without_quantization(qwen, tmp_path):
    d, g, maps = _affine_dir(tmp_path, qwen)
    s = scheme("k16v16", rotation=RotationRef(str(d)))
    ids = tiny_tokenizer_free_inputs(qwen.config, 2, 31, seed=5)
    chunks = [17, 1, 13]
    ref = reference(qwen, ids, None, chunks)
    cache = QuantizedKVCache(qwen, s, geometry=g)
    assert cache.layers[0].k_affine is not None and float(maps[0].shift.abs().max()) > 1.0
    out = run_chunks(qwen, cache, ids, None, chunks)
    assert rel_err(out, ref) < 1e-4  # the shift moves every logit of a query by q . shift: softmax unchanged


def test_fitted_scale_is_equal_on_rope_pairs_and_pinned(qwen, tmp_path):
    d, g, maps = _affine_dir(tmp_path, qwen)
    for ka in maps.values():
        assert torch.equal(ka.scale[:, :32], ka.scale[:, 32:])
        assert ka.scale.log().mean(-1).abs().max() < 1e-5  # geometric mean 1 per KV head
    plan = resolve(scheme("int2", rotation=RotationRef(str(d))), g)
    assert plan.rotation_sha256 and plan.scheme.rotation.sha256 == plan.rotation_sha256
    assert "key-affine" in plan.layer(0).rotation and plan.layer(0).rot_k is not None  # Hadamard base kept
    assert torch.equal(plan.layer(1).k_affine.shift, maps[1].shift)
    with pytest.raises(LowbitError, match="pins"):
        resolve(scheme("int2", rotation=RotationRef(str(d), "0" * 64)), g)
    with pytest.raises(LowbitError, match="fitted for model"):
        resolve(scheme("int2", rotation=RotationRef(str(d))), ModelGeometry.from_config(qwen.config, name="other"))


def test_key_affine_cuts_int2_loss_on_biased_keys(qwen, tmp_path):
    d, g, _ = _affine_dir(tmp_path, qwen)
    ids = tiny_tokenizer_free_inputs(qwen.config, 1, 60, seed=7)
    chunks = [20, 20, 20]
    ref = torch.log_softmax(reference(qwen, ids, None, chunks), -1)

    def kl(s):
        lp = torch.log_softmax(run_chunks(qwen, QuantizedKVCache(qwen, s, geometry=g), ids, None, chunks), -1)
        return float((ref.exp() * (ref - lp)).sum(-1)[:, 20:].mean())

    plain, fitted = kl(scheme("int2")), kl(scheme("int2", rotation=RotationRef(str(d))))
    print(f"KL int2 {plain:.4f}, int2 + key affine {fitted:.4f}")
    assert fitted < 0.5 * plain, (plain, fitted)


def test_kernel_decode_reads_the_mapped_keys(qwen, tmp_path):
    """The fused decode kernel (Triton interpreter on CPU) on a key-affine plan == the torch path."""
    pytest.importorskip("triton")
    d, g, _ = _affine_dir(tmp_path, qwen)
    s = scheme("int2", rotation=RotationRef(str(d)), sink=2, recent=4, page=2)
    ids = tiny_tokenizer_free_inputs(qwen.config, 1, 24, seed=8)
    chunks = [20] + [1] * 4
    a = run_chunks(qwen, QuantizedKVCache(qwen, s, geometry=g, decode_backend="torch"), ids, None, chunks)
    cache = QuantizedKVCache(qwen, s, geometry=g, decode_backend="triton")
    b = run_chunks(qwen, cache, ids, None, chunks)
    assert cache.backend_calls["triton"] == 4 * 2
    assert rel_err(b, a) < 5e-3


def test_every_path_maps_and_soft_capping_refuses(qwen, tmp_path):
    from lowbit.runtime.static_cache import static_reason

    d, g, _ = _affine_dir(tmp_path, qwen)
    plan = resolve(scheme("int2", rotation=RotationRef(str(d))), g)
    assert static_reason(plan.layer(0)) is None  # the static runtime maps keys and queries (next test)
    import lowbit.vllm_plugin.slot  # noqa: F401 (registers the vllm-slot backend)
    from lowbit import backends

    # the vLLM plugin maps them too (tests/serve/test_vllm_paged.py::test_plugin_serves_a_key_affine_recipe...)
    assert backends.get("vllm-slot").why_not(plan.layer(0), "paged", "cpu") is None
    capped = _qwen2(num_layers=2)
    capped.config.attn_logit_softcapping = 30.0
    with pytest.raises(LowbitError, match="soft-caps"):
        QuantizedKVCache(capped, plan=plan)
    from lowbit.runtime.static_cache import StaticKVCache

    with pytest.raises(LowbitError, match="soft-caps"):
        StaticKVCache(capped, plan, slots=1, max_context=32)
    with pytest.raises(LowbitError, match="alpha"):
        kfit.fit(qwen, tiny_tokenizer_free_inputs(qwen.config, 1, 70), alpha=2.0)


def test_static_runtime_maps_keys_and_queries_as_the_eager_cache(qwen, tmp_path):
    """The static runtime with a key-affine int2 recipe (chunked prefill, then batched decode steps of two
    slots) gives the eager QuantizedKVCache's logits (the same codes: page 1); without the map it does not."""
    from lowbit.runtime.static_cache import StaticKVCache
    from lowbit.runtime.step import ModelStep, eager_decode, prefill

    d, g, _ = _affine_dir(tmp_path, qwen)
    plans = {ka: resolve(scheme("int2", sink=4, recent=8, page=1, **({"rotation": RotationRef(str(d))} if ka else {})), g)
             for ka in (True, False)}
    ids = tiny_tokenizer_free_inputs(qwen.config, 2, 40, seed=7)
    P, steps = 30, 10

    def static(plan):
        st = StaticKVCache(qwen, plan, slots=2, max_context=64)
        step = ModelStep(qwen)
        outs = [[prefill(step, st, b, ids[b, :P], chunk=13)] for b in range(2)]
        for t in range(steps):
            lg = eager_decode(step, st, ids[:, P + t:P + t + 1], torch.ones(2, dtype=torch.bool))
            for b in range(2):
                outs[b].append(lg[b])
        assert st.layers[0].k_affine is not None or plan is plans[False]
        return torch.stack([torch.stack(o) for o in outs])

    ref = torch.stack([run_chunks(qwen, QuantizedKVCache.from_plan(qwen, plans[True]), ids[b:b + 1], None,
                                  [13, 13, 4] + [1] * steps)[0, P - 1:] for b in range(2)])
    got = static(plans[True])
    assert rel_err(got, ref) < 1e-4
    assert rel_err(static(plans[False]), ref) > 10 * rel_err(got, ref) + 1e-3  # the map matters on these keys


def test_layer_error_harness_measures_the_mapped_keys(qwen, tmp_path):
    """The layer-error harness (what tune measures) quantizes keys through the same map as the cache."""
    from lowbit.eval.layer_error import Variant, measure_layers
    from lowbit.rotation.hadamard import hadamard

    _, _g, maps = _affine_dir(tmp_path, qwen)
    s = scheme("int2")
    rot = {i: (hadamard(64), hadamard(64)) for i in range(2)}
    ids = tiny_tokenizer_free_inputs(qwen.config, 1, 40, seed=9)
    db = measure_layers(qwen, ids, [Variant("plain", s, rot), Variant("ka", s, rot, key_affine=maps)])
    for i in range(2):
        assert db["ka"][i] < db["plain"][i] - 3.0, db  # at least 3 dB less attention-output error per layer


def test_select_keeps_only_layers_the_map_helps(qwen):
    g = ModelGeometry.from_config(qwen.config, name="tiny-qwen2")
    windows = tiny_tokenizer_free_inputs(qwen.config, 1, 70, seed=11)
    maps = kfit.fit(qwen, windows, skip=4)
    bad = kam.KeyAffine(torch.full_like(maps[1].scale, 1.0).index_fill_(-1, torch.tensor([0, 32]), 1e-3),
                        torch.zeros_like(maps[1].shift))  # crushes one pair's scale: a map that hurts
    kept, ev = kfit.select(qwen, windows, {0: maps[0], 1: bad}, g, scheme=scheme("int2"))  # small tiers
    assert set(kept) == {0} and ev[1][1] > ev[1][0] and ev[0][1] < ev[0][0]


def _fitted_dir(tmp_path, model, name="kaf"):
    g = ModelGeometry.from_config(model.config, name="tiny-qwen2")
    windows = tiny_tokenizer_free_inputs(model.config, 2, 70, seed=11)
    maps = kfit.fit(model, windows, skip=4)
    rots = kfit.fit_base(model, windows, maps, g, skip=4)
    return kam.save(tmp_path / name, maps, model="tiny-qwen2", base="fitted", rotations=rots), g, maps, rots, windows


def test_fitted_base_is_the_mapped_keys_eigenbasis_and_exact(qwen, tmp_path):
    """base "fitted": R = E H per layer, E the eigenvectors of the mapped keys' (and the values') second moment
    summed over KV heads; the plan takes the stored matrices, pinned by the file's sha256; with 16-bit tiers the
    cache gives DynamicCache's logits (the map and an orthogonal R are exact for attention)."""
    from lowbit.rotation.hadamard import hadamard

    d, g, maps, rots, windows = _fitted_dir(tmp_path, qwen)
    st = kfit.MappedMoments(maps, skip=4)
    from lowbit.calib.capture import capture_attention

    with torch.no_grad(), capture_attention(qwen, st):
        for w in windows:
            qwen(w[None], use_cache=False, logits_to_keep=1)
    H = hadamard(64, dtype=torch.float64)
    for i, (rk, rv) in rots.items():
        for r, m in ((rk, st.kk[i] / st.n[i]), (rv, st.vv[i] / st.n[i])):
            E = r.double() @ H.T  # undo the Hadamard mix: the eigenvectors, descending
            lam = torch.linalg.eigvalsh(m).flip(0)
            assert torch.allclose(m @ E, E * lam, atol=1e-4 * float(lam[0])), i
        assert not torch.allclose(rk, hadamard(64), atol=1e-3)  # not the plain Hadamard
    plan = resolve(scheme("int2", rotation=RotationRef(str(d))), g)
    assert plan.layer(0).rotation.startswith("fitted ") and "key-affine" in plan.layer(0).rotation
    assert torch.equal(plan.layer(1).rot_k, rots[1][0]) and torch.equal(plan.layer(1).rot_v, rots[1][1])
    s = scheme("k16v16", rotation=RotationRef(str(d)))
    ids = tiny_tokenizer_free_inputs(qwen.config, 2, 31, seed=5)
    chunks = [17, 1, 13]
    out = run_chunks(qwen, QuantizedKVCache(qwen, s, geometry=g), ids, None, chunks)
    assert rel_err(out, reference(qwen, ids, None, chunks)) < 1e-4


def test_fitted_base_bad_files_are_refused_by_name(qwen, tmp_path):
    _d, g, maps, rots, _ = _fitted_dir(tmp_path, qwen)
    with pytest.raises(LowbitError, match="stores its rotations"):
        kam.save(tmp_path / "x1", maps, model="tiny-qwen2", base="fitted")
    with pytest.raises(LowbitError, match="stores its rotations"):
        kam.save(tmp_path / "x2", maps, model="tiny-qwen2", rotations=rots)
    partial = kam.save(tmp_path / "x3", maps, model="tiny-qwen2", base="fitted", rotations={0: rots[0]})
    with pytest.raises(LowbitError, match=r"no rotation for layers \[1\]"):
        resolve(scheme("int2", rotation=RotationRef(str(partial))), g)
    skew = {i: (r[0] * 1.1, r[1]) for i, r in rots.items()}
    bad = kam.save(tmp_path / "x4", maps, model="tiny-qwen2", base="fitted", rotations=skew)
    with pytest.raises(LowbitError) as e:
        resolve(scheme("int2", rotation=RotationRef(str(bad))), g)
    assert "orthogonal" in str(e.value) and "refit" in str(e.value) and "\n" not in str(e.value)
    wide = {i: (torch.eye(128), r[1]) for i, r in rots.items()}
    other = kam.save(tmp_path / "x5", maps, model="tiny-qwen2", base="fitted", rotations=wide)
    with pytest.raises(LowbitError, match=r"\[64, 64\]: fitted for another model"):
        resolve(scheme("int2", rotation=RotationRef(str(other))), g)
