import pytest
import torch
from torch import nn

from lowbit.core.errors import LowbitError
from lowbit.weights.apply import quantize_model, target_linears
from lowbit.weights.qlinear import QuantLinear
from lowbit.weights.scheme import parse_weight_scheme

from .helpers import small_model, token_ids


def _logit_err(m, ids, ref):
    return float(((m(ids).logits - ref) ** 2).mean() / (ref**2).mean())


def test_gptq_sequential_quantizes_every_linear_and_beats_rtn_on_calibration_text():
    calib = token_ids(batch=8, seq=32, seed=5)
    base = small_model()
    ref = base(calib).logits
    errs = {}
    for method in ("rtn", "gptq"):
        m = small_model()
        rep = quantize_model(m, parse_weight_scheme("w4a16-g32-asym"), method=method, calib=calib, batch_size=3)
        c = rep.counts()
        assert c["layers"] == 2 and c["quantized_linears"] == 14 and c["skipped_linears"] == 0
        assert c["ignored_linears"] == 1 and rep.ignored == ["lm_head"]
        assert isinstance(m.model.layers[1].mlp.down_proj, QuantLinear)
        assert isinstance(m.lm_head, nn.Linear) and not isinstance(m.lm_head, QuantLinear)
        errs[method] = _logit_err(m, calib, ref)
        if method == "gptq":
            assert c["calibration_tokens"] == 8 * 32 and len(rep.proxy_loss) == 14
    assert errs["gptq"] < errs["rtn"]


@pytest.mark.parametrize("scheme", ["w8a8", "w4a8-g32", "w8a16"])
def test_rotated_gptq_runs_for_every_scheme(scheme):
    calib = token_ids(batch=4, seq=24, seed=6)
    m = small_model()
    ref = m(calib).logits
    rep = quantize_model(m, parse_weight_scheme(scheme), method="gptq", calib=calib, rotate=True)
    assert rep.rotation["kind"] == "hadamard" and rep.counts()["quantized_linears"] == 14
    assert _logit_err(m, calib, ref) < 0.05


def test_group_not_dividing_is_refused_before_any_work():
    m = small_model()  # hidden 96: group 64 does not divide it
    w0 = m.model.layers[0].self_attn.q_proj.weight.clone()
    with pytest.raises(LowbitError, match="q_proj: scheme w4a16-g64: group 64 does not divide in_features 96"):
        quantize_model(m, parse_weight_scheme("w4a16-g64"), method="rtn")
    assert torch.equal(m.model.layers[0].self_attn.q_proj.weight, w0)


def test_linear_outside_layers_would_be_skipped_error():
    m = small_model()
    m.extra_proj = nn.Linear(96, 96)
    with pytest.raises(LowbitError, match="extra_proj"):
        quantize_model(m, parse_weight_scheme("w4a16-g32-asym"), method="gptq", calib=token_ids(batch=2, seq=8))
    # ignoring it by name (or regex) is fine; rtn quantizes it
    rep = quantize_model(m, parse_weight_scheme("w4a16-g32-asym"), method="rtn", ignore=["lm_head", "re:extra.*"])
    assert "extra_proj" in rep.ignored


def test_gptq_needs_calibration():
    with pytest.raises(LowbitError, match="calibration"):
        quantize_model(small_model(), parse_weight_scheme("w8a16"), method="gptq", calib=None)


def test_target_linears_ignore_rules():
    m = small_model()
    t, ign = target_linears(m, ["lm_head", "re:.*layers\\.1\\.mlp\\..*"])
    assert len(t) == 7 + 4 and min(ign) == "lm_head" and len(ign) == 4
