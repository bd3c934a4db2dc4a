"""SignRound: the fake-quant twin matches the shared encoder, tuning lowers the layer loss, plumbing."""

import json

import pytest
import torch
from torch import nn

from lowbit.cli import main
from lowbit.core.errors import LowbitError
from lowbit.weights.apply import quantize_model, target_linears
from lowbit.weights.export import save_compressed
from lowbit.weights.gptq import rtn_quantize
from lowbit.weights.hooks import capture_layer_inputs, run_layer
from lowbit.weights.load import load_quantized
from lowbit.weights.qlinear import QuantLinear, quantize_activations_per_token
from lowbit.weights.scheme import parse_weight_scheme
from lowbit.weights.signround import SignRoundConfig, TunedLinear, fake_quantize_activations, tune_layer

from .helpers import small_model, token_ids
from .test_cli import calib_file, model_dir  # noqa: F401 (fixtures)


def _linear(out=7, n=96, seed=0, bias=False):
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(n, out, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(out, n, generator=g) * 0.05)
        lin.weight[0, :32] = 0.0  # an all-zero group
        lin.weight[1, 32:64] = torch.rand(32, generator=g)  # an all-positive group
    return lin


@pytest.mark.parametrize("scheme", ["w4a16-g32-asym", "w4a16-g32", "w8a16", "w4a8-g32"])
def test_untrained_tuned_linear_is_plain_rtn(scheme):
    """v = 0, a = b = 1: the codes and grid are exactly RTN's (no clip search)."""
    s = parse_weight_scheme(scheme)
    lin = _linear()
    t = TunedLinear(lin, s)
    qw = t.finalize()
    ref = rtn_quantize(lin.weight, s.w_bits, s.group_for(96), s.symmetric, clip_search=False)
    assert torch.equal(qw.codes, ref.codes)
    assert torch.equal(qw.grid.zero_point, ref.grid.zero_point) and torch.allclose(qw.grid.scale, ref.grid.scale)
    torch.testing.assert_close(t.weight_hat(), ref.dequantize(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("scheme", ["w4a16-g32-asym", "w4a16-g32", "w8a8"])
def test_fake_quant_twin_matches_the_shared_encoder_after_tuning_moves(scheme):
    """After arbitrary v, a, b: weight_hat (what training sees) == finalize's dequantized codes (what is stored)."""
    s = parse_weight_scheme(scheme)
    lin = _linear(out=11, seed=1)
    t = TunedLinear(lin, s)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        t.v.copy_(torch.rand(t.v.shape, generator=g) - 0.5)
        t.a.copy_(0.5 + 0.5 * torch.rand(t.a.shape, generator=g))
        t.b.copy_(0.5 + 0.5 * torch.rand(t.b.shape, generator=g))
    qw = t.finalize()
    w_stored = qw.dequantize()
    w_train = t.weight_hat().detach()
    step = qw.grid.scale.repeat_interleave(qw.grid.group, dim=1)
    off = ((w_stored - w_train).abs() > 1e-5 * step.clamp_min(1e-3))
    assert off.float().mean() < 2e-3  # only float ties at a rounding boundary may differ, by one step
    assert ((w_stored - w_train).abs() <= step * 1.0001 + 1e-6).all()
    # and the stored codes are the QuantLinear's weight
    ql = QuantLinear.from_codes(qw.codes, qw.grid, s)
    torch.testing.assert_close(ql.dequantized_weight(), w_stored, rtol=0, atol=1e-6)


def test_fake_quantized_activations_equal_quantlinears_rounding_with_identity_gradient():
    x = torch.randn(5, 3, 96, requires_grad=True)
    y = fake_quantize_activations(x)
    xq, sx = quantize_activations_per_token(x.detach().reshape(-1, 96))
    torch.testing.assert_close(y.detach().reshape(-1, 96), xq.float() * sx)
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


def test_signed_step_moves_by_lr_and_clamps():
    t = TunedLinear(_linear(), parse_weight_scheme("w4a16-g32-asym"))
    t.v.grad = torch.ones_like(t.v)
    t.a.grad = -torch.ones_like(t.a)  # a would grow past 1: clamped
    t.b.grad = torch.ones_like(t.b)
    t.signed_step(0.1)
    assert torch.allclose(t.v, torch.full_like(t.v, -0.1)) and torch.equal(t.a, torch.ones_like(t.a))
    assert torch.allclose(t.b, torch.full_like(t.b, 0.9)) and t.v.grad is None
    for _ in range(10):
        t.v.grad = torch.ones_like(t.v)
        t.signed_step(0.1)
    assert torch.allclose(t.v, torch.full_like(t.v, -0.5))


def _layer_setup(scheme_name="w4a16-g32-asym"):
    model = small_model()
    ids = token_ids(batch=8, seq=16, seed=3)
    batches = list(ids.split(4))
    hidden, kw = capture_layer_inputs(model, model.model.layers, batches)
    x = torch.cat(hidden)
    layer = model.model.layers[0]
    y = torch.cat([run_layer(layer, h, kw[0]) for h in hidden])
    lins, _ = target_linears(model)
    mine = {n: m for n, m in lins.items() if n.startswith("model.layers.0.")}
    return layer, mine, x, y, kw[0], parse_weight_scheme(scheme_name)


@pytest.mark.parametrize("scheme", ["w4a16-g32-asym", "w4a8-g32"])
def test_tuning_lowers_the_layer_output_error_and_leaves_the_layer_as_it_was(scheme):
    layer, mine, x, y, kw, s = _layer_setup(scheme)
    before = {n: m.weight.clone() for n, m in mine.items()}
    res, st = tune_layer(layer, mine, x, y, kw, s, SignRoundConfig(iters=60, eval_every=20), batch=4)
    assert set(res) == set(mine)
    assert st["loss_best"] < 0.8 * st["loss_rtn"] and st["best_step"] > 0
    for n, m in mine.items():  # the original linears are back, untouched
        assert layer.get_submodule(n.removeprefix("model.layers.0.")) is m and torch.equal(m.weight, before[n])
        assert all(p.requires_grad for p in m.parameters())
    if s.a_bits == 16:  # the stored codes reproduce the tuned loss (same grid as the training twin)
        with torch.no_grad():
            for n, qw in res.items():
                mine[n].weight.copy_(QuantLinear.from_codes(qw.codes, qw.grid, s).dequantized_weight())
        out = torch.cat([run_layer(layer, x[i:i + 4], kw) for i in range(0, 8, 4)])
        assert float((out - y).pow(2).mean()) == pytest.approx(st["loss_best"], rel=0.05)


def test_zero_iters_is_rtn_and_keeps_the_rtn_loss():
    layer, mine, x, y, kw, s = _layer_setup()
    res, st = tune_layer(layer, mine, x, y, kw, s, SignRoundConfig(iters=0), batch=4)
    assert st["loss_best"] == st["loss_rtn"] and st["best_step"] == 0
    for n, qw in res.items():
        ref = rtn_quantize(mine[n].weight, 4, 32, False, clip_search=False)
        assert torch.equal(qw.codes, ref.codes)


def test_quantize_model_signround_beats_rtn_on_calibration_text_and_exports(tmp_path):
    calib = token_ids(batch=8, seq=16, seed=4)
    s = parse_weight_scheme("w4a16-g32-asym")
    ref = small_model()
    with torch.no_grad():
        base = ref(calib).logits
    errs = {}
    for method in ("rtn", "signround"):
        m = small_model()
        kw = {"signround": SignRoundConfig(iters=40, eval_every=20)} if method == "signround" else {}
        rep = quantize_model(m, s, method=method, calib=calib if method != "rtn" else None, clip_search=False,
                             batch_size=4, **kw)
        assert rep.counts()["quantized_linears"] == 14 and rep.counts()["skipped_linears"] == 0
        with torch.no_grad():
            errs[method] = float((m(calib).logits - base).pow(2).mean())
        if method == "signround":
            assert set(rep.signround) == {0, 1} and rep.calib_tokens == calib.numel()
            out = tmp_path / "ckpt"
            save_compressed(m, None, s, out, inputs={"model": "small"}, recipe={"method": "signround"},
                            counts=rep.counts(), ignore=["lm_head"])
            qm, _ = load_quantized(out)
            with torch.no_grad():
                torch.testing.assert_close(qm(calib).logits, m(calib).logits, rtol=1e-4, atol=1e-4)
    assert errs["signround"] < errs["rtn"]


def test_signround_needs_calibration_and_settings_need_the_method():
    s = parse_weight_scheme("w4a16-g32-asym")
    with pytest.raises(LowbitError, match="signround needs calibration"):
        quantize_model(small_model(), s, method="signround")
    with pytest.raises(LowbitError, match="method is gptq"):
        quantize_model(small_model(), s, method="gptq", calib=token_ids(), signround=SignRoundConfig())
    with pytest.raises(LowbitError, match="iters must be >= 0"):
        SignRoundConfig(iters=-1)
    with pytest.raises(LowbitError, match="unknown method"):
        quantize_model(small_model(), s, method="awq")


def test_cli_signround_writes_its_settings_and_per_layer_losses(tmp_path, model_dir, calib_file, capsys):  # noqa: F811
    out = tmp_path / "ckpt"
    rc = main(["quantize", "--model", str(model_dir), "--weights", "w4a16-g32-asym", "--method", "signround",
               "--iters", "8", "--calib", str(calib_file), "--calib-tokens", "64", "--calib-seq-len", "16",
               "--calib-dtype", "bfloat16",  # explicit: the default follows the CPU (tests/weights/test_cli.py)
               "--out", str(out)])
    assert rc == 0 and "14 linears quantized" in capsys.readouterr().out
    man = json.loads((out / "manifest.json").read_text())
    sr = man["recipe"]["signround"]
    assert sr["iters"] == 8 and sr["step_size"] == pytest.approx(1 / 8) and set(sr["layers"]) == {"0", "1"}
    assert all(v["loss_best"] <= v["loss_rtn"] for v in sr["layers"].values())
    assert man["recipe"]["calib_dtype"] == "bfloat16"
    load_quantized(out)


def test_cli_iters_without_signround_is_refused(tmp_path, model_dir, capsys):  # noqa: F811
    out = tmp_path / "ckpt"
    rc = main(["quantize", "--model", str(model_dir), "--weights", "w8a16", "--method", "rtn", "--iters", "5",
               "--out", str(out)])
    assert rc == 2 and "add --method signround" in capsys.readouterr().err and not out.exists()
