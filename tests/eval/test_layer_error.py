"""The per-layer error harness and full-window fake-quant perplexity, on tiny random models."""

import math

import pytest
import torch

from lowbit.calib.capture import capture_attention
from lowbit.eval.layer_error import (
    Harness,
    Variant,
    dequantized_kv,
    fake_quantize,
    layer_codec,
    measure_layers,
    tiered_attention,
)
from lowbit.kv.scheme import parse_kv_scheme
from lowbit.models.tiny import tiny_model, tiny_tokenizer_free_inputs
from lowbit.rotation.hadamard import hadamard


def _model(name="smollm2-135m", layers=2):
    m, cfg = tiny_model(name, num_layers=layers, vocab_size=99)
    return m, cfg


def test_exact_tiers_reproduce_sdpa():
    """With k_hat = k and v_hat = v the tiered attention is the model's own attention (logits unchanged)."""
    m, cfg = _model()
    ids = tiny_tokenizer_free_inputs(cfg, 1, 45)
    v16 = Variant("bf16", parse_kv_scheme("bf16", sink=16, recent=16, page=16))
    with torch.no_grad():
        ref = m(ids, use_cache=False).logits
        h = Harness([v16], "replace")
        with capture_attention(m, h):
            out = m(ids, use_cache=False).logits
    torch.testing.assert_close(out, ref, atol=2e-4, rtol=1e-4)


def test_middle_tier_is_quantized_only_between_sink_and_recent():
    g = torch.Generator().manual_seed(1)
    B, Hq, Hkv, T, D = 1, 3, 1, 11, 8
    q, k, v = (torch.randn(B, H, T, D, generator=g) for H in (Hq, Hkv, Hkv))
    kh, vh = k + 1.0, v * 0 + 5.0  # "quantized" versions that are easy to tell apart
    allowed = torch.ones(T, T, dtype=torch.bool).tril()[None, None]
    out = tiered_attention(q, k, v, kh, vh, allowed, 0.3, sink=2, recent=3)  # [B, T, Hq, D]
    t = 9  # query 9: keys 0,1 sink; 7,8,9 recent; 2..6 middle
    kk = torch.cat([k[0, 0, :2], kh[0, 0, 2:7], k[0, 0, 7:10]])
    vv = torch.cat([v[0, 0, :2], vh[0, 0, 2:7], v[0, 0, 7:10]])
    p = torch.softmax(q[0, :, t] @ kk.T * 0.3, -1)
    torch.testing.assert_close(out[0, t], p @ vv)
    # queries before sink + recent see no middle at all
    p4 = torch.softmax(q[0, :, 4] @ k[0, 0, :5].T * 0.3, -1)
    torch.testing.assert_close(out[0, 4], p4 @ v[0, 0, :5])


def test_channel_axis_groups_blocks_of_page_tokens():
    s = parse_kv_scheme("kivi2", sink=16, recent=32, page=16)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 16 + 3 * 16 + 5, 8, generator=g)
    x[..., 3] *= 100  # an outlier channel: per-channel scales keep the others fine
    y = fake_quantize(layer_codec(s.k, 8, 16), x, sink=16)
    assert torch.equal(y[:, :, :16], x[:, :, :16]) and torch.equal(y[:, :, -5:], x[:, :, -5:])
    blk = x[:, :, 16:32]  # one block: each channel min/max over its 16 tokens is exact at the extremes
    assert torch.allclose(y[:, :, 16:32].amax(2), blk.amax(2), atol=1e-2 * blk.abs().amax().item())
    err_other = (y - x)[..., [0, 1, 2, 4]].abs().max()
    assert err_other < 0.5 * (x[..., [0, 1, 2, 4]].abs().max())


def test_rotation_roundtrip_and_per_head():
    s = parse_kv_scheme("int4", sink=0, recent=0, page=16)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, 3, 20, 64, generator=g)
    R = torch.stack([hadamard(64), torch.eye(64), hadamard(64).flip(0)])
    var = Variant("x", s, rot={0: (R, R)})
    kh, _vh = dequantized_kv(k, k, var, 0)
    # head 1 uses the identity: same as no rotation
    kh0, _ = dequantized_kv(k, k, Variant("n", s), 0)
    torch.testing.assert_close(kh[:, 1], kh0[:, 1])
    assert (kh - k).abs().max() < 0.5 and not torch.allclose(kh[:, 0], kh0[:, 0])


def test_measure_orders_bits_and_replace_ppl_counts_rows():
    from lowbit.eval.layer_error import fake_quant_ppl
    from lowbit.eval.perplexity import full_window_ppl

    m, cfg = _model("gemma3-270m", 2)
    windows = tiny_tokenizer_free_inputs(cfg, 2, 80, seed=2)
    mk = lambda n: Variant(n, parse_kv_scheme(n, sink=16, recent=16, page=16))
    db = measure_layers(m, windows, [mk("int2"), mk("int4"), mk("int8")])
    for layer in (0, 1):
        assert db["int2"][layer] > db["int4"][layer] + 6 > db["int8"][layer] + 12
    ref = full_window_ppl(m, windows)
    p8, rows = fake_quant_ppl(m, windows, mk("int8"))
    p2, _ = fake_quant_ppl(m, windows, mk("int2"))
    assert rows == 2 * (80 - 32)
    assert abs(p8 / ref - 1) < 0.01 and abs(p2 / ref - 1) > abs(p8 / ref - 1)
    assert math.isfinite(p2)


def test_fitted_levels_and_table(tmp_path):
    from lowbit.calib.levels import fitted_levels
    from lowbit.calib.run import collect, write_calibration
    from lowbit.calib.stats import load_calibration
    from lowbit.eval.layer_error import format_table, heatmap
    from lowbit.models.geometry import ModelGeometry

    m, cfg = _model()
    col = collect(m, tiny_tokenizer_free_inputs(cfg, 2, 70), skip=6)
    write_calibration(col, tmp_path / "c", ModelGeometry.from_config(cfg, name="smollm2-135m"),
                      {"model": "smollm2-135m", "weights_sha256": "0" * 64}, tokens=140, seq_len=70)
    cal = load_calibration(tmp_path / "c")
    s = parse_kv_scheme("int2", lloyd_max=True, sink=16, recent=16, page=16)
    lv = fitted_levels(cal, {}, s)
    assert set(lv) == {0, 1} and lv[0][0].shape == (4,) and (lv[0][0].diff() > 0).all()
    db = {"none": {0: -10.0, 1: -12.5}, "hadamard": {0: -20.0, 1: -21.0}}
    t = format_table(db, {"none": 11.0, "hadamard": 10.1}, 10.0)
    assert "| 1 | -12.5 | -21.0 |" in t and "+10.00%" in t and "+1.00%" in t
    heatmap(db, tmp_path / "h.png", "t")
    assert (tmp_path / "h.png").stat().st_size > 1000


def test_centering_is_exact_for_attention():
    """Shifting every key by mu and every value by mu_v changes nothing in exact attention, and the
    harness adds the means back, so a centred bf16 variant reproduces the model."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, H, 40, 16, generator=g) for H in (4, 2, 2))
    k = k + 30 * torch.randn(1, 2, 1, 16, generator=g)  # a large per-channel key offset
    s = parse_kv_scheme("int2", sink=16, recent=16, page=16)
    mu = {0: (k.mean(dim=(0, 2)), v.mean(dim=(0, 2)))}
    allowed = torch.ones(40, 40, dtype=torch.bool).tril()[None, None]
    exact = tiered_attention(q, k, v, k, v, allowed, 0.25, 16, 16)
    errs = []
    for center in ({}, mu):
        kh, vh = dequantized_kv(k, v, Variant("x", s, center=center), 0)
        errs.append((tiered_attention(q, k, v, kh, vh, allowed, 0.25, 16, 16) - exact).pow(2).sum().item())
    assert errs[1] < 0.5 * errs[0]  # the offset no longer eats the 2-bit range


def test_layer_scheme_overrides_one_layer():
    """Mixed bits per layer: a layer given bf16 shows no error while the others keep int2's."""
    m, cfg = _model("smollm2-135m", 3)
    windows = tiny_tokenizer_free_inputs(cfg, 1, 70, seed=4)
    s = parse_kv_scheme("int2", sink=16, recent=16, page=16)
    mixed = Variant("mixed", s, layer_scheme={1: parse_kv_scheme("bf16", sink=16, recent=16, page=16)})
    db = measure_layers(m, windows, [Variant("int2", s), mixed])
    assert db["mixed"][1] == float("-inf") and db["int2"][1] > -60
    assert db["mixed"][0] == pytest.approx(db["int2"][0]) and db["mixed"][2] == pytest.approx(db["int2"][2])
