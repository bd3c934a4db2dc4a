"""Rotations in the cache (none / Hadamard / RotationSet v1 and v2, V folded) and RotationSet files."""

from dataclasses import replace

import pytest
import torch

from lowbit.core.errors import LowbitError
from lowbit.kv.plan import resolve
from lowbit.kv.rotations import fold_v_into_weights
from lowbit.models.geometry import ModelGeometry
from lowbit.models.tiny import tiny_tokenizer_free_inputs
from lowbit.rotation.rotation_set import RotationSet
from lowbit.runtime.cache import QuantizedKVCache

from .helpers import FAST, fast_model, reference, rel_err, run_chunks, scheme

CHUNKS = [21, 1, 1, 1, 4]


def random_orthogonal(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(*shape, generator=g, dtype=torch.float64))
    return q.float()


def make_set(geometry, per_head: bool, seed=0, model=None):
    k, v = [], []
    for g in geometry.layers:
        lead = (g.num_kv_heads,) if per_head else ()
        k.append(random_orthogonal(*lead, g.head_dim_k, g.head_dim_k, seed=seed + 2 * g.index))
        v.append(random_orthogonal(*lead, g.head_dim_v, g.head_dim_v, seed=seed + 2 * g.index + 1))
    return RotationSet(model=geometry.name if model is None else model, k=tuple(k), v=tuple(v))


@pytest.fixture(scope="module", params=list(FAST))
def model(request):
    m = fast_model(request.param)
    m.builtin_name = request.param
    return m


@pytest.fixture(scope="module")
def geometry(model):
    return ModelGeometry.from_config(model.config)


def _ids(model):
    return tiny_tokenizer_free_inputs(model.config, 2, sum(CHUNKS), seed=7)


@pytest.mark.parametrize("per_head", [False, True])
def test_rotation_is_invisible_without_quantization(model, geometry, tmp_path, per_head):
    """q R_k (k R_k)^T = q k^T and (p v R_v) R_v^T = p v: a 16-bit cache with any orthogonal
    rotation (per layer or per KV head) gives DynamicCache's logits; per head also proves each
    query head is rotated with its own KV head's R."""
    path = make_set(geometry, per_head).save(tmp_path / "rot")
    ids = _ids(model)
    ref = reference(model, ids, None, CHUNKS)
    for rot in ("hadamard", str(path)):
        cache = QuantizedKVCache(model, scheme("bf16", rotation=rot))
        out = run_chunks(model, cache, ids, None, CHUNKS)
        assert rel_err(out, ref) < 1e-4
        assert cache.layers[0].rot_k is not None


def test_hadamard_changes_int4_results(model):
    ids = _ids(model)
    ref = reference(model, ids, None, CHUNKS)
    a = run_chunks(model, QuantizedKVCache(model, scheme("int4", rotation="none")), ids, None, CHUNKS)
    b = run_chunks(model, QuantizedKVCache(model, scheme("int4", rotation="hadamard")), ids, None, CHUNKS)
    assert rel_err(a, b) > 1e-4  # the rotation is really applied before quantization
    assert rel_err(b, ref) < 0.5


def test_folded_v_rotation_matches_unfolded(model, geometry, tmp_path):
    """Folding a per-layer R_v into v_proj / o_proj and skipping the output un-rotation is the same model."""
    path = make_set(geometry, per_head=False).save(tmp_path / "rot1")
    ids = _ids(model)
    # 16-bit tiers: the comparison tests the fold itself (with int4, float rounding of the folded
    # weights flips a few borderline codes)
    base = replace(scheme("bf16"), rotation=str(path))
    ref = run_chunks(model, QuantizedKVCache(model, base), ids, None, CHUNKS)
    folded = fast_model(model.builtin_name)
    fs = replace(base, fold_v_rotation=True)
    with pytest.raises(LowbitError, match="was not folded"):
        QuantizedKVCache(folded, fs)
    fold_v_into_weights(folded, fs, geometry)
    out = run_chunks(folded, QuantizedKVCache(folded, fs), ids, None, CHUNKS)
    assert rel_err(out, ref) < 1e-4
    assert rel_err(out, reference(model, ids, None, CHUNKS)) < 1e-4
    with pytest.raises(LowbitError, match="already folded"):
        fold_v_into_weights(folded, fs, geometry)


def test_per_head_rotation_cannot_be_folded(geometry, tmp_path):
    path = make_set(geometry, per_head=True).save(tmp_path / "rot2")
    s = replace(scheme("int4"), rotation=str(path), fold_v_rotation=True)
    with pytest.raises(LowbitError, match="per KV head"):
        resolve(s, geometry)


# ------------------------------------------------------------------ RotationSet files
def test_rotation_set_round_trip(geometry, tmp_path):
    for per_head in (False, True):
        rs = make_set(geometry, per_head, seed=3)
        path = rs.save(tmp_path / f"rs{per_head}", inputs={"calibration": "unit test"})
        back = RotationSet.load(path)
        assert back.format_version == (2 if per_head else 1) and back.model == geometry.name
        for a, b in zip(rs.k + rs.v, back.k + back.v):
            assert torch.equal(a, b)
        back.validate_against(geometry)
        with pytest.raises(LowbitError, match="already exists"):
            rs.save(path)


def test_rotation_set_mismatches_are_refused(geometry, tmp_path):
    rs = make_set(geometry, per_head=True)
    other = ModelGeometry(name="other-model", model_type=geometry.model_type, layers=geometry.layers)
    with pytest.raises(LowbitError, match="fitted for model"):
        rs.validate_against(other)
    fewer = ModelGeometry(name=geometry.name, model_type=geometry.model_type, layers=geometry.layers[:1])
    with pytest.raises(LowbitError, match="layers but model"):
        rs.validate_against(fewer)
    g0 = geometry.layers[0]
    heads = [replace(g, num_kv_heads=g.num_kv_heads + 1, num_q_heads=g.num_q_heads * 2) for g in geometry.layers]
    with pytest.raises(LowbitError, match="KV-head rotations"):
        rs.validate_against(replace(geometry, layers=heads))
    dims = [replace(g, head_dim_k=g.head_dim_k * 2, head_dim_v=g.head_dim_v * 2) for g in geometry.layers]
    with pytest.raises(LowbitError, match="head_dim"):
        rs.validate_against(replace(geometry, layers=dims))
    # the scheme refuses it at construction of the cache, before any token
    path = rs.save(tmp_path / "rs")
    with pytest.raises(LowbitError, match="fitted for model"):
        resolve(replace(scheme("int4"), rotation=str(path)), other)
    assert g0.index == 0


def test_bad_rotation_files(geometry, tmp_path):
    rs = make_set(geometry, per_head=False)
    bad = RotationSet(model=rs.model, k=(rs.k[0] * 1.1,) + rs.k[1:], v=rs.v)
    with pytest.raises(LowbitError, match="not orthogonal"):
        bad.save(tmp_path / "bad")
    path = rs.save(tmp_path / "ok")
    f = path / "rotations.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 1
    f.chmod(0o644)
    f.write_bytes(bytes(data))
    with pytest.raises(LowbitError, match="does not match its manifest"):
        RotationSet.load(path)
    with pytest.raises(LowbitError, match="not found"):
        RotationSet.load(tmp_path / "missing")
    with pytest.raises(LowbitError, match="all be"):
        RotationSet(model="m", k=(torch.eye(4), torch.eye(4)[None]), v=(torch.eye(4), torch.eye(4)[None]))
