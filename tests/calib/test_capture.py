"""Capture of post-RoPE Q/K/V and the sufficient statistics, on tiny random models."""

import json

import pytest
import torch

from lowbit.calib.capture import capture_attention
from lowbit.calib.run import check_tokens_arg, collect, min_tokens, write_calibration
from lowbit.calib.stats import STATS_FILE, StatsCollector, load_calibration
from lowbit.core.errors import LowbitError
from lowbit.models.geometry import ModelGeometry
from lowbit.models.tiny import tiny_model, tiny_tokenizer_free_inputs


def _tiny(name, layers=None):
    model, config = tiny_model(name, num_layers=layers, vocab_size=99)
    return model, ModelGeometry.from_config(config)


@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_capture_leaves_outputs_unchanged_and_restores_impl(name):
    model, _ = _tiny(name)
    ids = tiny_tokenizer_free_inputs(model.config, 1, 37)
    with torch.no_grad():
        ref = model(ids, use_cache=False).logits
        with capture_attention(model, StatsCollector(skip=3)):
            out = model(ids, use_cache=False).logits
    assert torch.allclose(out, ref, atol=1e-5)
    assert model.config._attn_implementation == "sdpa"


def test_captured_key_is_post_rope():
    """The captured key equals k_proj -> RoPE, not the raw projection (the cache quantizes post-RoPE keys)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model, _ = _tiny("smollm2-135m", 1)
    ids = tiny_tokenizer_free_inputs(model.config, 1, 11)
    got = {}

    def obs(module, q, k, v, mask, scaling, softcap):
        got["q"], got["k"] = q.clone(), k.clone()

    with torch.no_grad(), capture_attention(model, obs):
        model(ids, use_cache=False)
        h = model.model.layers[0].input_layernorm(model.model.embed_tokens(ids))
        attn = model.model.layers[0].self_attn
        k_raw = attn.k_proj(h).view(1, 11, -1, attn.head_dim).transpose(1, 2)
        q_raw = attn.q_proj(h).view(1, 11, -1, attn.head_dim).transpose(1, 2)
        cos, sin = model.model.rotary_emb(h, torch.arange(11)[None])
        q_rot, k_rot = apply_rotary_pos_emb(q_raw, k_raw, cos, sin)
    assert torch.allclose(got["k"], k_rot, atol=1e-5)
    assert torch.allclose(got["q"], q_rot, atol=1e-5)
    assert not torch.allclose(got["k"][:, :, 1:], k_raw[:, :, 1:], atol=1e-3)


def test_stats_match_direct_sums_gqa():
    """kk/qq/vv/min/max/pv equal sums computed directly from the captured tensors (GQA 9 q / 3 kv heads)."""
    model, _ = _tiny("smollm2-135m", 1)
    ids = tiny_tokenizer_free_inputs(model.config, 2, 23, seed=3)
    seen = {}

    def obs(module, q, k, v, mask, scaling, softcap):
        seen.update(q=q.double(), k=k.double(), v=v.double(), scale=scaling)

    col = StatsCollector(skip=5, sample_per_seq=3, query_stride=1)
    col4 = StatsCollector(skip=5, sample_per_seq=3, query_stride=4)
    with torch.no_grad():
        with capture_attention(model, col4):
            model(ids, use_cache=False)
        with capture_attention(model, obs):
            model(ids, use_cache=False)
        with capture_attention(model, col):
            model(ids, use_cache=False)
    st = col.layers[0]
    q, k, v = seen["q"], seen["k"], seen["v"]  # [2, 9, 23, 64], [2, 3, 23, 64]
    ks, vs = k[:, :, 5:], v[:, :, 5:]
    assert st.count == 2 * 18 and st.seen == 2 * 23
    torch.testing.assert_close(st.t["kk"], torch.einsum("bhtd,bhte->hde", ks, ks), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(st.t["vv"], torch.einsum("bhtd,bhte->hde", vs, vs), rtol=1e-5, atol=1e-5)
    # q heads 3h..3h+2 share kv head h
    qs = q[:, :, 5:].reshape(2, 3, 3, 18, 64)
    torch.testing.assert_close(st.t["qq"], torch.einsum("bhrtd,bhrte->hde", qs, qs), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(st.t["kmax"], ks.amax(dim=(0, 2)))
    torch.testing.assert_close(st.t["vmin"], vs.amin(dim=(0, 2)))
    # attention mass: causal softmax, summed over queries and the 3 q heads of each group
    s = torch.einsum("bqtd,bqsd->bqts", q, k.repeat_interleave(3, 1)) * seen["scale"]
    s = s.masked_fill(torch.ones(23, 23, dtype=torch.bool).triu(1), float("-inf"))
    mass = torch.softmax(s, -1).sum(2).reshape(2, 3, 3, 23).sum(2)[:, :, 5:]  # [2, 3, 18]
    torch.testing.assert_close(st.t["pw"], mass.sum(dim=(0, 2)), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(st.t["pv"], torch.einsum("bht,bhtd,bhte->hde", mass, vs, vs), rtol=1e-4, atol=1e-4)
    assert st.sample("k").shape == (2 * 3, 3, 64)
    # the 1-in-4 query subsample estimates the same mass (total within 10%), at a quarter of the cost
    assert col4.layers[0].t["pw"].sum().item() == pytest.approx(st.t["pw"].sum().item(), rel=0.1)


def test_sliding_window_mask_reaches_the_observer():
    """On gemma's sliding layers the observer's mask allows only keys inside the window (mass follows it)."""
    from lowbit.calib.capture import allowed_mask

    model, _config = tiny_model("gemma3-270m", num_layers=1, vocab_size=99)
    model.config.sliding_window = 4
    for layer in model.model.layers:
        layer.self_attn.sliding_window = 4
    ids = tiny_tokenizer_free_inputs(model.config, 1, 13)
    got = {}

    def obs(module, q, k, v, mask, scaling, softcap):
        got["allowed"] = allowed_mask(mask, 13, 13, q.device)

    with torch.no_grad(), capture_attention(model, obs):
        model(ids, use_cache=False)
    a = got["allowed"][0, 0]
    assert a[12, 9] and a[12, 12] and not a[12, 8] and not a[12, 0] and not a[3, 4]
    col = StatsCollector(skip=0, sample_per_seq=0)
    with torch.no_grad(), capture_attention(model, col):
        model(ids, use_cache=False)
    # every query hands out mass 1 per q head (4 q heads)
    assert col.layers[0].t["pw"].item() == pytest.approx(4 * 13, rel=1e-5)


def test_every_layer_must_see_the_tokens():
    model, _geo = _tiny("smollm2-135m", 3)
    windows = tiny_tokenizer_free_inputs(model.config, 2, 31)
    col = collect(model, windows, skip=4)
    assert all(col.layers[i].seen == 62 for i in range(3))
    with pytest.raises(LowbitError, match="expected 999 tokens"):
        col.check_tokens([0, 1, 2], 999)
    # a layer that never reached the capture (e.g. routed to another attention) is named
    del col.layers[1]
    with pytest.raises(LowbitError, match="layer 1: 0"):
        col.check_tokens([0, 1, 2], 62)


def test_too_few_tokens_and_short_text_refused():
    assert min_tokens([64], 1024, 64) == 1024  # 512 stats tokens needed, 960 per sequence
    assert min_tokens([256], 512, 64) == 5 * 512
    assert check_tokens_arg(96, 32) == 3
    with pytest.raises(LowbitError, match="multiple of --seq-len"):
        check_tokens_arg(65, 32)


def test_write_and_load_roundtrip_and_corruption(tmp_path):
    model, geo = _tiny("gemma3-270m", 2)
    windows = tiny_tokenizer_free_inputs(model.config, 3, 41)
    col = collect(model, windows, skip=7)
    inputs = {"model": "gemma3-270m", "weights_sha256": "ab" * 32, "data": "test"}
    counts = write_calibration(col, tmp_path / "cal", geo, inputs, tokens=123, seq_len=41)
    assert counts["stats_tokens_per_layer"] == 3 * 34
    cal = load_calibration(tmp_path / "cal")
    assert cal.model == "gemma3-270m" and sorted(cal.layers) == [0, 1]
    torch.testing.assert_close(cal.layers[1].t["kk"], col.layers[1].t["kk"])
    assert cal.layers[0].count == 3 * 34
    assert json.loads((tmp_path / "cal" / "calibration.json").read_text())["skip"] == 7
    # flip one byte: the manifest check refuses it
    p = tmp_path / "cal" / STATS_FILE
    b = bytearray(p.read_bytes())
    b[-1] ^= 1
    p.write_bytes(bytes(b))
    with pytest.raises(LowbitError, match="manifest"):
        load_calibration(tmp_path / "cal")
    # an existing directory is never overwritten; a failed write leaves nothing behind
    with pytest.raises(LowbitError, match="already exists"):
        write_calibration(col, tmp_path / "cal", geo, inputs, tokens=123, seq_len=41)
    del col.layers[0]
    with pytest.raises(LowbitError, match="bypassed"):
        write_calibration(col, tmp_path / "cal2", geo, inputs, tokens=123, seq_len=41)
    assert not (tmp_path / "cal2").exists()
