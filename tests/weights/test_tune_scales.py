"""End-to-end scale tuning: the trainable twin is QuantLinear, tuning lowers the held-out KL, the
checkpoint stores what was trained, and a tuning that does not help is not kept."""

import json

import pytest
import torch

from lowbit.cli import main
from lowbit.core.errors import LowbitError
from lowbit.weights.apply import quantize_model
from lowbit.weights.export import save_compressed
from lowbit.weights.load import load_quantized
from lowbit.weights.qlinear import QuantLinear
from lowbit.weights.scheme import parse_weight_scheme
from lowbit.weights.tune_scales import ScaleTuneConfig, ScaleTunedLinear, token_kl, tune_scales

from .helpers import small_model, token_ids
from .test_cli import calib_file, model_dir  # noqa: F401 (fixtures)


def _quantized(scheme="w4a16-g32-asym", method="rtn", scale_dtype=torch.float32, seed=0):
    model = small_model(seed=seed)
    teacher = small_model(seed=seed)
    quantize_model(model, parse_weight_scheme(scheme), method=method, clip_search=False, scale_dtype=scale_dtype)
    return model, teacher


def _qlinears(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}


@pytest.mark.parametrize("scheme", ["w4a16-g32-asym", "w4a16-g32", "w8a16", "w8a8", "w4a8-g32"])
def test_untuned_twin_is_the_quantlinear(scheme):
    """r = 0: the trainable twin computes what QuantLinear computes (int8 activations included)."""
    model, _ = _quantized(scheme)
    q = model.model.layers[1].mlp.down_proj
    t = ScaleTunedLinear(q)
    x = torch.randn(3, 5, q.in_features)
    torch.testing.assert_close(t(x), q(x), rtol=1e-4, atol=1e-4)


def test_twin_trains_the_scale_the_checkpoint_stores():
    """The scale the forward uses is already rounded to the checkpoint's scale dtype; r moves it."""
    model, _ = _quantized(scale_dtype=torch.bfloat16)
    q = model.model.layers[0].self_attn.q_proj
    t = ScaleTunedLinear(q)
    with torch.no_grad():
        t.r.normal_(0, 0.01)
    s = t.scale()
    assert torch.equal(s, s.to(torch.bfloat16).float())  # representable in bf16
    assert not torch.equal(s, q.scale.float())
    y = t(torch.randn(2, q.in_features))
    y.sum().backward()
    assert t.r.grad is not None and t.r.grad.abs().sum() > 0


def test_token_kl_is_zero_for_equal_logits_and_positive_otherwise():
    a = torch.randn(2, 7, 11)
    assert float(token_kl(a, a)) == pytest.approx(0.0, abs=1e-6)
    assert float(token_kl(a + torch.randn_like(a), a)) > 0
    assert float(token_kl(a + 3.0, a)) == pytest.approx(0.0, abs=1e-5)  # softmax ignores a shift


@pytest.mark.parametrize("scheme", ["w4a16-g32-asym", "w4a8-g32"])
def test_tuning_lowers_the_holdout_kl_keeps_the_codes_and_the_model_measures_what_was_reported(scheme):
    model, teacher = _quantized(scheme)
    calib = token_ids(batch=64, seq=32, seed=5)  # enough tokens to generalise (8 x 16 overfits: see below)
    before = {n: (q.codes.clone(), q.zero_point.clone(), q.scale.clone()) for n, q in _qlinears(model).items()}
    st = tune_scales(model, teacher, calib, ScaleTuneConfig(steps=40, lr=0.005, batch=4))
    assert st["holdout_sequences"] == 8 and st["train_sequences"] == 56 and st["linears"] == 14
    assert st["kept"] and st["kl_holdout_after"] < 0.95 * st["kl_holdout_before"]
    assert st["train_loss_last"] < st["train_loss_first"]
    after = _qlinears(model)
    assert set(after) == set(before)  # the QuantLinears are back in place
    moved = 0
    for n, q in after.items():
        codes, zp, scale = before[n]
        assert torch.equal(q.codes, codes) and torch.equal(q.zero_point, zp)
        moved += int(not torch.equal(q.scale, scale))
    assert moved == 14
    assert not any(p.requires_grad is False for p in teacher.parameters())  # teacher untouched
    with torch.no_grad():  # the QuantLinear model gives the held-out KL the tuning reported
        kl = float(token_kl(model(calib[-8:]).logits, teacher(calib[-8:]).logits))
    assert kl == pytest.approx(st["kl_holdout_after"], rel=1e-3, abs=1e-7)


def test_a_tuning_that_raises_the_holdout_kl_is_not_kept():
    """8 x 16 random tokens: the training KL falls, the held-out one rises (overfitting): not kept."""
    model, teacher = _quantized()
    calib = token_ids(batch=9, seq=16, seed=5)
    scales = {n: q.scale.clone() for n, q in _qlinears(model).items()}
    st = tune_scales(model, teacher, calib, ScaleTuneConfig(steps=40, lr=0.02, batch=4))
    assert st["train_loss_last"] < 0.5 * st["train_loss_first"]
    assert st["kl_holdout_after"] > st["kl_holdout_before"] and not st["kept"]
    assert all(torch.equal(q.scale, scales[n]) for n, q in _qlinears(model).items())


def test_zero_steps_changes_nothing():
    model, teacher = _quantized()
    scales = {n: q.scale.clone() for n, q in _qlinears(model).items()}
    st = tune_scales(model, teacher, token_ids(batch=3, seq=8), ScaleTuneConfig(steps=0))
    assert not st["kept"] and st["kl_holdout_after"] == st["kl_holdout_before"] and st["train_loss_first"] is None
    assert all(torch.equal(q.scale, scales[n]) for n, q in _qlinears(model).items())


def test_quantize_model_with_tuning_exports_what_it_measured(tmp_path):
    """RTN + rotation + bf16 scales + tuning -> checkpoint -> reload: the same scales and codes."""
    calib = token_ids(batch=64, seq=32, seed=7)
    s = parse_weight_scheme("w4a16-g32-asym")
    m = small_model()
    rep = quantize_model(m, s, method="rtn", calib=calib, rotate=True, scale_dtype=torch.bfloat16, clip_search=False,
                         tune=ScaleTuneConfig(steps=40, lr=0.005, batch=4))
    st = rep.scale_tuning
    assert st["config"]["steps"] == 40 and st["kept"] and rep.calib_tokens == calib.numel()
    out = tmp_path / "ckpt"
    save_compressed(m, None, s, out, inputs={"model": "small"}, recipe={"method": "rtn"}, counts=rep.counts(),
                    ignore=["lm_head"], dtype=torch.bfloat16)
    qm, _ = load_quantized(out)
    mine, theirs = _qlinears(m), _qlinears(qm)
    assert set(mine) == set(theirs)
    for n, q in mine.items():  # the tuned bf16 scales are stored bit for bit, the codes unchanged
        r = theirs[n]
        assert q.scale.dtype == torch.bfloat16 and torch.equal(r.scale.to(torch.bfloat16), q.scale)
        assert torch.equal(r.codes, q.codes) and torch.equal(r.zero_point, q.zero_point)


def test_bad_settings_are_refused():
    s = parse_weight_scheme("w4a16-g32-asym")
    with pytest.raises(LowbitError, match="needs calibration tokens"):
        quantize_model(small_model(), s, method="rtn", tune=ScaleTuneConfig())
    model, teacher = _quantized()
    with pytest.raises(LowbitError, match="at least 2 calibration sequences"):
        tune_scales(model, teacher, token_ids(batch=1), ScaleTuneConfig())
    for kw, msg in (({"steps": -1}, "steps"), ({"lr": 0}, "lr"), ({"batch": 0}, "batch"), ({"holdout": 1.0}, "holdout")):
        with pytest.raises(LowbitError, match=msg):
            ScaleTuneConfig(**kw)
    with pytest.raises(LowbitError, match="no quantized linears"):
        tune_scales(small_model(), small_model(), token_ids(batch=2), ScaleTuneConfig())


def test_cli_tune_scales_records_its_settings_and_holdout_kl(tmp_path, model_dir, calib_file, capsys):  # noqa: F811
    out = tmp_path / "ckpt"
    rc = main(["quantize", "--model", str(model_dir), "--weights", "w4a16-g32-asym", "--method", "rtn",
               "--tune-scales", "6", "--tune-lr", "0.01", "--calib", str(calib_file), "--calib-tokens", "64",
               "--calib-seq-len", "16", "--out", str(out)])
    assert rc == 0 and "scale tuning" in capsys.readouterr().out
    man = json.loads((out / "manifest.json").read_text())
    st = man["recipe"]["scale_tuning"]
    assert st["config"]["steps"] == 6 and st["config"]["lr"] == 0.01
    assert st["holdout_sequences"] == 1 and "kl_holdout_after" in st
    assert man["inputs"]["calibration"]["sequences"] == 4
    load_quantized(out)


def test_cli_tune_lr_without_tuning_is_refused(tmp_path, model_dir, capsys):  # noqa: F811
    out = tmp_path / "ckpt"
    rc = main(["quantize", "--model", str(model_dir), "--weights", "w8a16", "--method", "rtn", "--tune-lr", "0.01",
               "--out", str(out)])
    assert rc == 2 and "--tune-scales" in capsys.readouterr().err and not out.exists()
