"""Fitted rotations: eigenvectors x Hadamard (x bit reversal), per layer and per KV head, saved as a RotationSet."""

import pytest
import torch

from lowbit.calib.run import collect, write_calibration
from lowbit.calib.stats import LayerStats, load_calibration
from lowbit.core.errors import LowbitError
from lowbit.models.geometry import ModelGeometry
from lowbit.models.tiny import tiny_model, tiny_tokenizer_free_inputs
from lowbit.rotation.fit import (
    bit_reversal_permutation,
    check_orthogonal,
    eigvecs_descending,
    fit_layer,
    rotation_from_cov,
)
from lowbit.rotation.fit_run import fit_and_save
from lowbit.rotation.hadamard import hadamard
from lowbit.rotation.rotation_set import RotationSet


def _cov(d, seed=0, heads=None):
    g = torch.Generator().manual_seed(seed)
    shape = (heads, 3 * d, d) if heads else (3 * d, d)
    x = torch.randn(*shape, generator=g, dtype=torch.float64) * torch.linspace(0.1, 5, d, dtype=torch.float64)
    return x.transpose(-1, -2) @ x


def test_bit_reversal():
    assert bit_reversal_permutation(8).tolist() == [0, 4, 2, 6, 1, 5, 3, 7]
    assert bit_reversal_permutation(1).tolist() == [0]
    with pytest.raises(LowbitError, match="power-of-two head_dim, got 12"):
        bit_reversal_permutation(12)


@pytest.mark.parametrize("d", [4, 12, 64])
def test_rotation_is_eigvecs_times_hadamard(d):
    c = _cov(d)
    E = eigvecs_descending(c)
    lam = torch.diagonal(E.T @ c @ E)
    assert (lam[:-1] >= lam[1:] - 1e-9).all()  # descending
    torch.testing.assert_close(E.T @ c @ E, torch.diag(lam), atol=1e-8 * lam[0].item(), rtol=0)
    R = rotation_from_cov(c)
    torch.testing.assert_close(R, E @ hadamard(d, dtype=torch.float64))
    check_orthogonal(R, "test")
    # after E @ H every rotated channel carries the same variance (trace / d)
    var = torch.diagonal(R.T @ c @ R)
    torch.testing.assert_close(var, torch.full((d,), torch.trace(c).item() / d, dtype=torch.float64), rtol=1e-8, atol=0)
    # mix none = principal components; bit reversal permutes the columns
    torch.testing.assert_close(rotation_from_cov(c, mix="none"), E)
    if d & (d - 1) == 0:
        Rb = rotation_from_cov(c, bit_reversal=True)
        torch.testing.assert_close(Rb, R[:, bit_reversal_permutation(d)])


def test_deterministic_signs():
    c = _cov(16, seed=4)
    assert torch.equal(eigvecs_descending(c), eigvecs_descending(c.clone()))
    E = eigvecs_descending(c)
    assert (E.gather(0, E.abs().argmax(0, keepdim=True)) > 0).all()


def test_non_orthogonal_refused():
    R = torch.eye(5)
    R[0, 1] = 0.1
    with pytest.raises(LowbitError, match="not orthogonal"):
        check_orthogonal(R, "x")
    with pytest.raises(LowbitError, match="non-finite"):
        check_orthogonal(torch.full((3, 3), float("nan")), "x")


def _stats(h, d, n=3, seed=0):
    st = LayerStats(7, h, d, d, h * n, count=100, seen=100)
    st.t["kk"] = _cov(d, seed, h) * 100
    st.t["vv"] = _cov(d, seed + 1, h) * 100
    st.t["qq"] = _cov(d, seed + 2, h) * 100 * n
    st.t["pv"] = _cov(d, seed + 3, h) * 7
    st.t["pw"] = torch.full((h,), 7.0, dtype=torch.float64)
    return st


def test_fit_layer_kinds_and_objectives():
    st = _stats(3, 16)
    ph = fit_layer(st, "per-head")
    assert ph.k.shape == (3, 16, 16) and ph.v.shape == (3, 16, 16)
    for h in range(3):  # head h's rotation diagonalizes head h's covariance before the Hadamard
        Hm = hadamard(16, dtype=torch.float64)
        E = ph.k[h].double() @ Hm.T
        off = E.T @ st.cov("kk")[h] @ E
        assert (off - torch.diag(torch.diagonal(off))).abs().max() < 1e-4 * off.abs().max()
    assert not torch.allclose(ph.k[0], ph.k[1])
    pl = fit_layer(st, "per-layer")
    assert pl.k.shape == (16, 16)
    torch.testing.assert_close(pl.k.double(), rotation_from_cov(st.cov("kk").mean(0)), atol=1e-6, rtol=0)
    qq = fit_layer(st, "per-head", "qq")
    torch.testing.assert_close(qq.k.double(), rotation_from_cov(st.cov("qq")), atol=1e-6, rtol=0)
    torch.testing.assert_close(qq.v.double(), rotation_from_cov(st.cov("pv")), atol=1e-6, rtol=0)
    hd = fit_layer(st, "hadamard")
    torch.testing.assert_close(hd.k, hadamard(16))


def test_head_dim_without_hadamard_is_named():
    st = _stats(1, 10)
    with pytest.raises(LowbitError, match=r"layer 7 \(head_dim K 10.*no Hadamard construction of order 10"):
        fit_layer(st, "per-head")
    assert fit_layer(st, "per-head", mix="none").k.shape == (1, 10, 10)


@pytest.fixture(scope="module")
def calibs(tmp_path_factory):
    """Tiny calibrations of both built-in geometries (gemma: MQA, head_dim 256, sliding layers)."""
    root = tmp_path_factory.mktemp("cal")
    out = {}
    for name, layers in (("smollm2-135m", 2), ("gemma3-270m", 2)):
        model, config = tiny_model(name, num_layers=layers, vocab_size=99)
        geo = ModelGeometry.from_config(config, name=name)
        col = collect(model, tiny_tokenizer_free_inputs(config, 3, 97), skip=5)
        write_calibration(col, root / name, geo, {"model": name, "weights_sha256": "0" * 64, "data": "rand"},
                          tokens=3 * 97, seq_len=97)
        out[name] = (load_calibration(root / name), geo)
    return out


@pytest.mark.parametrize("kind", ["hadamard", "per-layer", "per-head"])
def test_fit_and_save_loads_as_rotation_set(calibs, tmp_path, kind):
    cal, geo = calibs["gemma3-270m"]
    fit_and_save(cal, tmp_path / "rot", kind=kind, bit_reversal=True)
    rs = RotationSet.load(tmp_path / "rot")
    rs.validate_against(geo)
    assert rs.per_head == (kind == "per-head")
    assert rs.k[0].shape[-1] == 256
    from lowbit.artifacts import load_manifest, sha256_file

    man = load_manifest(tmp_path / "rot")
    assert man.inputs["calibration_sha256"] == sha256_file(cal.path / "manifest.json")
    assert man.inputs["model"] == "gemma3-270m"


def test_rotation_for_one_model_refused_by_the_other(calibs, tmp_path):
    cal, _ = calibs["smollm2-135m"]
    _, gemma_geo = calibs["gemma3-270m"]
    fit_and_save(cal, tmp_path / "rot", kind="per-head")
    rs = RotationSet.load(tmp_path / "rot")
    with pytest.raises(LowbitError, match="fitted for model 'smollm2-135m'"):
        rs.validate_against(gemma_geo)


def test_corrupted_rotation_file_refused(calibs, tmp_path):
    cal, _ = calibs["smollm2-135m"]
    fit_and_save(cal, tmp_path / "rot", kind="per-layer")
    p = tmp_path / "rot" / "rotations.safetensors"
    b = bytearray(p.read_bytes())
    b[-3] ^= 0x40
    p.write_bytes(bytes(b))
    with pytest.raises(LowbitError, match="manifest"):
        RotationSet.load(tmp_path / "rot")


def test_failed_fit_leaves_no_artifact(calibs, tmp_path):
    cal, _ = calibs["smollm2-135m"]
    with pytest.raises(LowbitError, match="unknown objective"):
        fit_and_save(cal, tmp_path / "rot", kind="per-head", objective="bad")
    assert not (tmp_path / "rot").exists()


def test_centered_fit_uses_covariance_about_the_mean():
    st = _stats(2, 8)
    st.t["ksum"] = torch.randn(2, 8, dtype=torch.float64) * 100  # count 100 -> mean ~ N(0, 1)
    mu = st.mean("k")
    c = st.cov("kk", center=True)
    torch.testing.assert_close(c, st.cov("kk") - mu[:, :, None] * mu[:, None, :])
    fl = fit_layer(st, "per-head", center=True)
    torch.testing.assert_close(fl.k.double(), rotation_from_cov(c), atol=1e-6, rtol=0)
    assert not torch.allclose(fl.k, fit_layer(st, "per-head").k, atol=1e-3)
