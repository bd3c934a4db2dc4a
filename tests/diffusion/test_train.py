import pytest

from lowbit.core.errors import LowbitError

pytest.importorskip("sklearn")


def test_digits_rgba():
    from lowbit.diffusion.data import digits_rgba

    x, y = digits_rgba(16)
    assert x.shape == (1797, 4, 16, 16) and y.shape == (1797,) and set(y.tolist()) == set(range(10))
    assert 0 <= float(x.min()) and float(x.max()) <= 1
    opaque = (x[:, 3] > 0.5).float().mean((1, 2))
    assert 0.1 < float(opaque.mean()) < 0.6  # ink on a transparent field
    with pytest.raises(LowbitError, match="multiple of 8"):
        digits_rgba(12)


def test_training_is_deterministic_and_writes_the_manifest(tmp_path):
    from lowbit.artifacts import load_manifest, verify
    from lowbit.diffusion.load import load_pipeline
    from lowbit.diffusion.train import TrainConfig, train

    cfg = TrainConfig(size=16, patch=4, hidden=64, heads=2, layers=1, steps=3, batch=5, warmup=2, sample_steps=2)
    shas = []
    for name in ("a", "b"):
        train(cfg, tmp_path / name, progress=False)
        m = load_manifest(tmp_path / name)
        shas.append({f.path: f.sha256 for f in m.files}["transformer/diffusion_pytorch_model.safetensors"])
        assert m.counts["steps"] == 3 and m.recipe["train"]["seed"] == 0
        assert set(m.inputs["training"]) == {"commit", "dirty"} and len(m.inputs["data"]["sha256"]) == 64
        assert all(s.status == "OK" for s in verify(tmp_path / name))
    assert shas[0] == shas[1]
    assert (tmp_path / "a" / "samples.png").read_bytes()[:4] == b"\x89PNG"
    pipe = load_pipeline(tmp_path / "a")
    assert pipe([1], [0], num_inference_steps=2).shape == (1, 4, 16, 16)
    with pytest.raises(LowbitError, match="already exists"):
        train(cfg, tmp_path / "a")
    with pytest.raises(LowbitError, match="multiple of 64"):
        train(TrainConfig(hidden=96, heads=3), tmp_path / "c")
