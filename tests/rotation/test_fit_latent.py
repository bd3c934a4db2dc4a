"""A per-layer rotation of DeepseekV3's MLA latent c_kv, fitted by calibration (covariance eigenvectors x Hadamard).

Tiny random DeepseekV3 from the shipped 'deepseek-v3' config (kv_lora_rank 512, qk_rope 64; dense MLPs so
the reference is not a random router's), cached as the latent. The calibration capture reports the latent
(lowbit.calib.mla: K = [c_kv | k_pe] one head, V = c_kv, the absorbed query), the fit gives V a 512 x 512
rotation (K: identity, it is rebuilt from V), the plan takes the set, and:
  - on the calibration data the fitted rotation's INT2 reconstruction error of c_kv (the plan's own V codec,
    group 128) is below Hadamard alone's, every layer (it could fail: a random model's latent is close to
    isotropic; layer 0 gains little);
  - at bf16 the cache with the fitted rotation gives transformers' logits (prefill + decode).
Bad input: a set fitted for another kv_lora_rank, a per-head set (plan and fit), each one line.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from lowbit.calib.run import collect, write_calibration
from lowbit.calib.stats import load_calibration
from lowbit.core.errors import LowbitError
from lowbit.kv.plan import resolve
from lowbit.kv.scheme import parse_kv_scheme
from lowbit.models.geometry import ModelGeometry
from lowbit.models.tiny import tiny_config, tiny_tokenizer_free_inputs
from lowbit.rotation.fit_run import fit_and_save
from lowbit.rotation.hadamard import hadamard
from lowbit.rotation.rotation_set import RotationSet
from lowbit.runtime.cache import QuantizedKVCache

from ..kv.helpers import reference, rel_err, run_chunks, scheme

SKIP = 4


@pytest.fixture(scope="module")
def model():
    cfg = tiny_config("deepseek-v3", vocab_size=99)
    cfg.first_k_dense_replace = 2
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        m = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    return m.float().eval()


@pytest.fixture(scope="module")
def geometry(model):
    g = ModelGeometry.from_config(model.config, name="tiny-deepseek-v3")
    assert {(x.storage, x.head_dim_k, x.head_dim_v, x.latent_dim) for x in g.layers} == {("mla-latent", 576, 512, 512)}
    return g


@pytest.fixture(scope="module")
def windows():
    return torch.randint(0, 99, (16, 64), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def fitted(model, geometry, windows, tmp_path_factory):
    """(calibration dir, rotation-set dir, collector) for the tiny model."""
    col = collect(model, windows, skip=SKIP, geometry=geometry)
    root = tmp_path_factory.mktemp("latent")
    calib_dir = root / "calib"
    write_calibration(col, calib_dir, geometry, {"model": geometry.name, "weights_sha256": None, "data": "random"},
                      tokens=windows.numel(), seq_len=windows.shape[1])
    rot_dir = root / "rot"
    fit_and_save(load_calibration(calib_dir), rot_dir, kind="per-layer")
    return calib_dir, rot_dir, col


@torch.no_grad()
def _latents(model, windows) -> dict[int, torch.Tensor]:
    """c_kv per layer [N, 512] at positions >= SKIP, from a hook on kv_a_layernorm (independent of the capture)."""
    got: dict[int, list] = {}
    hooks = [layer.self_attn.kv_a_layernorm.register_forward_hook(
        lambda mod, a, o, i=i: got.setdefault(i, []).append(o.detach()[0, SKIP:])) for i, layer in
        enumerate(model.model.layers)]
    try:
        for w in windows:
            model(w[None], use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return {i: torch.cat(v).float() for i, v in got.items()}


def _int2_error(codec, c, R) -> float:
    """Relative squared error of c [N, D] stored as the codec stores V (x = c R, quantized, unrotated)."""
    x = (c @ R)[None, None]
    back = codec.decode(codec.encode(x, torch.float32))[0, 0] @ R.T
    return float(((back - c) ** 2).sum() / (c ** 2).sum())


def test_the_capture_reports_the_latent(fitted, model, windows):
    _, _, col = fitted
    lat = _latents(model, windows)
    for i, st in col.layers.items():
        assert (st.num_kv_heads, st.head_dim_k, st.head_dim_v, st.num_q_heads) == (1, 576, 512, 4)
        assert st.count == windows.shape[0] * (windows.shape[1] - SKIP)
        vv = lat[i].double().T @ lat[i].double()  # sum c cᵀ of what the cache stores as V
        assert torch.allclose(st.t["vv"][0], vv, rtol=1e-4, atol=1e-3)
        # K's first 512 dims are the same latent (K = [c_kv | k_pe])
        assert torch.allclose(st.t["kk"][0, :512, :512], vv, rtol=1e-4, atol=1e-3)


def test_fitted_rotation_beats_hadamard_at_int2_on_calibration_data(fitted, model, geometry, windows):
    _, rot_dir, _ = fitted
    rs = RotationSet.load(rot_dir)
    plan = resolve(parse_kv_scheme("int2", rotation=str(rot_dir)), geometry)  # the plan accepts the set
    lat = _latents(model, windows)
    gains = []
    for lp in plan.layers:
        i = lp.geometry.index
        assert lp.rot_k is None and torch.equal(lp.rot_v, rs.v[i]) and lp.rotation.startswith("per-layer")
        assert torch.equal(rs.k[i], torch.eye(576))  # K is rebuilt from V: no rotation of its own
        assert lp.v.bits == 2 and lp.v.group == 128
        e_fit = _int2_error(lp.v, lat[i], rs.v[i])
        e_had = _int2_error(lp.v, lat[i], hadamard(512))
        gains.append(10 * math.log10(e_had / e_fit))
        print(f"layer {i}: INT2 c_kv rel sq error fitted {e_fit:.4f} vs Hadamard {e_had:.4f} "
              f"({gains[-1]:+.2f} dB)")
        assert e_fit < e_had
    assert max(gains) > 0.3  # a real gain somewhere, not only noise


def test_bf16_with_the_fitted_rotation_equals_transformers(fitted, model, geometry):
    _, rot_dir, _ = fitted
    chunks = [19] + [1] * 16
    ids = tiny_tokenizer_free_inputs(model.config, 2, sum(chunks), seed=3)
    ref = reference(model, ids, None, chunks)
    cache = QuantizedKVCache(model, scheme("bf16", rotation=str(rot_dir)), geometry=geometry)
    assert cache.plan.layers[0].rot_v is not None and cache.plan.layers[0].rot_v.shape == (512, 512)
    out = run_chunks(model, cache, ids, None, chunks)
    assert cache.layers[0].mid_len > 0  # the rotated middle tier was read
    assert rel_err(out, ref) < 1e-4


def _one_line(e) -> str:
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_a_set_for_another_kv_lora_rank_is_refused(geometry, tmp_path):
    other = RotationSet(model=geometry.name, k=tuple(torch.eye(320) for _ in range(2)),
                        v=tuple(hadamard(256) for _ in range(2)))
    other.save(tmp_path / "r256")
    with pytest.raises(LowbitError) as e:
        resolve(parse_kv_scheme("int2", rotation=str(tmp_path / "r256")), geometry)
    assert "kv_lora_rank 512" in _one_line(e) and "256 wide" in str(e.value)


def test_a_per_head_set_on_the_latent_is_refused(geometry, fitted, tmp_path):
    per_head = RotationSet(model=geometry.name, k=tuple(torch.eye(576)[None] for _ in range(2)),
                           v=tuple(hadamard(512)[None] for _ in range(2)))
    per_head.save(tmp_path / "ph")
    with pytest.raises(LowbitError) as e:
        resolve(parse_kv_scheme("int2", rotation=str(tmp_path / "ph")), geometry)
    assert "one head shared by all" in _one_line(e)
    calib_dir, _, _ = fitted
    with pytest.raises(LowbitError) as e:  # and fitting one is refused before any work
        fit_and_save(load_calibration(calib_dir), tmp_path / "ph2", kind="per-head")
    assert "MLA latent" in _one_line(e) and "--kind per-layer" in str(e.value)
    assert not (tmp_path / "ph2").exists()
