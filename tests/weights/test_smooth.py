import copy

import pytest
import torch

from lowbit.core.errors import LowbitError
from lowbit.models.tiny import tiny_model
from lowbit.weights.apply import quantize_model
from lowbit.weights.scheme import parse_weight_scheme
from lowbit.weights.smooth import input_absmax, smooth_model, smoothing_scales

from .helpers import small_model, token_ids


def _outlier_model(model_type="llama", **kw):
    """small_model with a few planted outlier channels in every norm (what SmoothQuant is for)."""
    m = small_model(model_type, **kw)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "layernorm" in n:
                p[[5, 41, 77]] *= 25.0
    return m


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
@torch.no_grad()
def test_smoothing_alone_keeps_logits(model_type):
    # 3 q heads sharing 1 kv head (GQA), qwen2's q/k/v biases: the folds must keep the function
    m = _outlier_model(model_type, heads=3, kv_heads=1)
    ids = token_ids(batch=3, seq=17, seed=4)
    ref32 = m(ids).logits
    ref16 = copy.deepcopy(m).to(torch.bfloat16)(ids).logits.float()
    w0 = m.model.layers[1].self_attn.q_proj.weight.clone()
    v0 = m.model.layers[1].self_attn.v_proj.weight.clone()
    info = smooth_model(m, [token_ids(batch=2, seq=19, seed=s) for s in (7, 8)], alpha=0.5)
    torch.testing.assert_close(m(ids).logits, ref32, atol=2e-4, rtol=2e-4)
    # bf16: the smoothed model run in bf16 is as close to the fp32 logits as the unsmoothed one in bf16
    # (bf16 rounding of the rescaled weights is the only difference), and picks the same tokens
    out16 = copy.deepcopy(m).to(torch.bfloat16)(ids).logits.float()
    bf16_noise = float((ref16 - ref32).abs().mean())
    assert float((out16 - ref32).abs().mean()) < 2.5 * bf16_noise
    assert (out16.argmax(-1) == ref16.argmax(-1)).float().mean() > 0.95
    # and it really moved something: readers' columns and v_proj's rows changed, outliers flattened
    assert not torch.allclose(m.model.layers[1].self_attn.q_proj.weight.float(), w0)
    assert not torch.allclose(m.model.layers[1].self_attn.v_proj.weight.float(), v0)
    before, after = info["act_outlier_ratio"]
    assert after < before
    assert info["alpha"] == 0.5 and info["calibration_tokens"] == 2 * 2 * 19


def test_smoothing_makes_w8a8_closer_on_outlier_activations():
    ids = token_ids(batch=2, seq=23, seed=1)
    calib = torch.cat([token_ids(batch=4, seq=23, seed=s) for s in (11, 12)])
    ref = _outlier_model()(ids).logits
    errs = {}
    for smooth in (None, 0.5):
        m = _outlier_model()
        quantize_model(m, parse_weight_scheme("w8a8"), method="rtn", calib=calib, smooth=smooth, clip_search=False)
        errs[smooth] = float((m(ids).logits - ref).pow(2).mean())
    assert errs[0.5] < 0.7 * errs[None], errs


def test_scales_formula_and_dead_channels():
    x = torch.tensor([4.0, 0.0, 1.0])
    w = torch.tensor([[1.0, 2.0, 0.0], [-0.25, 1.0, 0.0]])
    s = smoothing_scales(x, [w], alpha=0.5)
    assert s[0].item() == pytest.approx(2.0)  # sqrt(4) / sqrt(1)
    assert s[1].item() == 1.0 and s[2].item() == 1.0  # never active / all-zero column: untouched


def test_absmax_hooks_see_every_linear():
    m = small_model()
    lins = {"q": m.model.layers[0].self_attn.q_proj, "down": m.model.layers[1].mlp.down_proj}
    a = input_absmax(m, lins, [token_ids()])
    assert a["q"].shape == (96,) and a["down"].shape == (160,) and (a["q"] > 0).all()


def test_bad_alpha_and_gemma3_and_missing_calib_are_refused():
    m = small_model()
    with pytest.raises(LowbitError, match="migration strength"):
        smooth_model(m, [token_ids()], alpha=1.0)
    g, _ = tiny_model("gemma3-270m", num_layers=1, vocab_size=99)
    w0 = g.model.layers[0].input_layernorm.weight.clone()
    with pytest.raises(LowbitError, match="--smooth is not supported on gemma3"):
        smooth_model(g, [token_ids()], alpha=0.5)
    assert torch.equal(g.model.layers[0].input_layernorm.weight, w0)
    with pytest.raises(LowbitError, match="--smooth needs calibration"):
        quantize_model(small_model(), parse_weight_scheme("w8a8"), method="rtn", smooth=0.5)


@torch.no_grad()
def test_auto_alpha_keeps_logits_and_never_raises_the_calibration_error():
    # "auto" scores each mapping with the scheme's own quantizers: the chosen scales must not make
    # the quantized outputs on the calibration sample worse than no smoothing, and the fp model is unchanged
    from lowbit.weights.smooth import AUTO_ALPHAS, quantized_output_error

    scheme = parse_weight_scheme("w8a8")
    m = _outlier_model(heads=3, kv_heads=1)
    ids = token_ids(batch=2, seq=17, seed=5)
    ref = m(ids).logits
    calib = [token_ids(batch=2, seq=19, seed=s) for s in (7, 8)]
    attn = m.model.layers[0].self_attn
    x = {}
    input_absmax(m, {"q": attn.q_proj}, calib, keep=512, samples=x)  # all 76 rows, as the search sees them
    assert x["q"].shape == (76, 96)
    ws = [attn.q_proj.weight.clone(), attn.k_proj.weight.clone(), attn.v_proj.weight.clone()]
    norm0 = m.model.layers[0].input_layernorm.weight.clone()
    info = smooth_model(m, calib, alpha="auto", scheme=scheme)
    torch.testing.assert_close(m(ids).logits, ref, atol=2e-4, rtol=2e-4)
    assert sum(info["alphas_used"].values()) == 2 * 4  # 2 layers x 4 mappings
    assert set(info["alphas_used"]) <= {"none", *map(str, AUTO_ALPHAS)}
    assert info["alphas_used"].get("none", 0) < 8  # the planted outliers make smoothing worth it somewhere
    # layer 0's q/k/v mapping: the folded scales score no worse than no smoothing on that sample
    s = norm0.double() / m.model.layers[0].input_layernorm.weight.double()
    plain = quantized_output_error(x["q"], ws, torch.ones(96, dtype=torch.float64), scheme)
    assert quantized_output_error(x["q"], ws, s, scheme) <= plain * (1 + 1e-6)


def test_auto_alpha_needs_the_scheme():
    with pytest.raises(LowbitError, match="needs the weight scheme"):
        smooth_model(small_model(), [token_ids()], alpha="auto")
