"""Qwen2.5-VL: `lowbit quantize --weights w4a8 --rotate` of the decoder only, end to end on a saved tiny model.

The tiny model is built from the shipped qwen2.5-vl-7b config (lowbit.models.families: head_dim 128, 7:1
GQA, M-RoPE [16, 24, 24], the real vision patch geometry; sizes shrunk) and saved with save_pretrained, so
the directory `lowbit quantize` reads is what a downloaded checkpoint would be. Checked:
  - the manifest's counts: 2 decoder layers, 14 quantized linears, 0 skipped outside the declared ignore list,
    the vision tower (12 linears) listed as kept unquantized by design; no quantized tensor outside the
    decoder, every quantized tensor from the one quantizer (QuantLinear.from_codes -> export.ct_tensors);
  - the checkpoint reloads in plain transformers (compressed-tensors) with no load-report entry, and through
    lowbit's loader (QuantLinear modules); the dequantized weights are the same bit for bit;
  - greedy generation with an image through lowbit's cache (KV8 + Hadamard) gives the same free-running
    tokens on both, W4A16 and W4A8. For W4A8 the logits are equal bit for bit: lowbit's activation quantizer
    is compressed-tensors' (amax / 127.5 in x's dtype, round half to even: weights/act_quant.py) and
    QuantLinear's torch forward is the reload's fake-quantized linear. (With an int8 GEMM instead the codes
    agree but the sums round differently; on this model that flipped step 2, lead 0.0009 vs a 0.011 logit
    difference.)
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors import safe_open

from lowbit.cli import main
from lowbit.models.tiny import tiny_model, tiny_tokenizer
from lowbit.runtime.cache import QuantizedKVCache, cache_kwargs
from lowbit.weights.qlinear import QuantLinear

FAMILY = "qwen2.5-vl-7b"
NEW = 24


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    m, _ = tiny_model(FAMILY, seed=0)
    d = tmp_path_factory.mktemp("vl") / "tiny-qwen2.5-vl"
    m.save_pretrained(d)
    tiny_tokenizer().save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def calib_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("txt") / "calib.txt"
    p.write_text("the cat sat on the mat . a dog ran and the cat sat , " * 40, encoding="utf-8")
    return p


def _quantize(vl_dir, calib_file, out, scheme, monkeypatch=None):
    args = ["quantize", "--model", str(vl_dir), "--weights", scheme, "--rotate", "--calib", str(calib_file),
            "--calib-tokens", "96", "--calib-seq-len", "16", "--no-progress", "--out", str(out)]
    assert main(args) == 0
    return out


@pytest.fixture(scope="module")
def calls():
    return {"from_codes": [], "ct_tensors": []}


@pytest.fixture(scope="module")
def w4a8(vl_dir, calib_file, tmp_path_factory, calls):
    """The W4A8 checkpoint, with the quantizer's and the exporter's calls recorded."""
    from lowbit.weights import export, qlinear

    mp = pytest.MonkeyPatch()
    real_from_codes, real_ct = qlinear.QuantLinear.from_codes.__func__, export.ct_tensors

    def from_codes(cls, *a, **k):
        calls["from_codes"].append(1)
        return real_from_codes(cls, *a, **k)

    def ct_tensors(m, prefix, dtype):
        calls["ct_tensors"].append(prefix)
        return real_ct(m, prefix, dtype)

    mp.setattr(qlinear.QuantLinear, "from_codes", classmethod(from_codes))
    mp.setattr(export, "ct_tensors", ct_tensors)
    try:
        return _quantize(vl_dir, calib_file, tmp_path_factory.mktemp("q") / "w4a8", "w4a8")
    finally:
        mp.undo()


def _inputs(seed=0):
    """A prompt with one 4x6-patch image (6 tokens after the 2x2 merge) in the real layout."""
    from lowbit.models.families import tiny_overrides

    o = tiny_overrides(FAMILY)
    g = torch.Generator().manual_seed(seed)
    grid = torch.tensor([[1, 4, 6]])
    pix = torch.randn(int(grid.prod()), 3 * 2 * 14 * 14, generator=g)
    text = torch.randint(10, 90, (13,), generator=g).tolist()
    ids = torch.tensor([[5, 6, o["vision_start_token_id"]] + [o["image_token_id"]] * 6 + [o["vision_end_token_id"]]
                        + text])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pix, "image_grid_thw": grid}


def _kv8():
    from dataclasses import replace

    from lowbit.kv.scheme import parse_kv_scheme

    s = parse_kv_scheme("int8", rotation="hadamard")
    return replace(s, sink=2, recent=4, page=2)  # small tiers: the image tokens are quantized in the middle


@torch.no_grad()
def _generate(model, force=None):
    """Greedy through a KV8 + Hadamard lowbit cache -> (new tokens, raw logits per step [NEW, vocab], cache).
    force: token ids to feed instead of the model's own choice (teacher forcing)."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class Force(LogitsProcessor):
        def __init__(self):
            self.step = 0

        def __call__(self, input_ids, scores):
            out = torch.full_like(scores, float("-inf"))
            out[:, force[self.step]] = 0.0
            self.step += 1
            return out

    cache = QuantizedKVCache(model, _kv8())
    kw = dict(max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True, output_logits=True)
    if force is not None:
        kw["logits_processor"] = LogitsProcessorList([Force()])
    inp = _inputs()
    o = model.generate(**inp, **kw, **cache_kwargs(model, cache))
    return o.sequences[0, inp["input_ids"].shape[1]:].tolist(), torch.cat(o.logits).float(), cache


class _Report(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _plain_load(path):
    """transformers' own from_pretrained (compressed-tensors decompresses); no load-report entry allowed."""
    from transformers import AutoModelForImageTextToText
    from transformers.utils import logging as hf_logging

    rep = _Report()
    lib = hf_logging.get_logger("transformers")
    lib.addHandler(rep)
    try:
        model, info = AutoModelForImageTextToText.from_pretrained(path, output_loading_info=True)
    finally:
        lib.removeHandler(rep)
    text = "\n".join(rep.lines)
    assert "MISMATCH" not in text and "LOAD REPORT" not in text, text[-2000:]
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    model.eval()
    with torch.no_grad():
        model(input_ids=torch.tensor([[5, 6, 7]]))  # compressed-tensors decompresses on the first forward
    return model


def test_manifest_counts_and_the_vision_tower_kept_by_design(w4a8, calls):
    man = json.loads((w4a8 / "manifest.json").read_text())
    c = man["counts"]
    assert c["layers"] == 2 and c["quantized_linears"] == 14 and c["skipped_linears"] == 0 and c["skipped"] == 0
    assert c["ignore"] == ["lm_head", r"re:^model\.visual\."] == man["recipe"]["ignore"]
    kept = c["kept_unquantized"]["model.visual"]
    assert kept["what"] == "vision tower" and kept["linears"] == 12 and kept["ignored_by"] == [r"re:^model\.visual\."]
    assert c["ignored_linears"] == 13 and set(c["ignored"]) - {"lm_head"} == {
        f"model.visual.blocks.{i}.{n}" for i in range(2)
        for n in ("attn.qkv", "attn.proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    } | {"model.visual.merger.mlp.0", "model.visual.merger.mlp.2"}
    assert man["recipe"]["rotation"]["kind"] == "hadamard"
    qc = json.loads((w4a8 / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["ignore"] == c["ignore"]
    with safe_open(str(w4a8 / "model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
        prefixes = sorted(k[: -len(".weight_scale")] for k in keys if k.endswith(".weight_scale"))
        tower = {k: f.get_tensor(k).dtype for k in keys if k.startswith("model.visual.")}
    # every quantized tensor is a decoder linear, written once by the one quantizer -> exporter path
    assert len(prefixes) == 14 and all(p.startswith("model.language_model.layers.") for p in prefixes)
    assert sorted(calls["ct_tensors"]) == prefixes and len(calls["from_codes"]) == 14
    assert tower and all(dt == torch.float32 for dt in tower.values())  # the tower as written: unquantized floats
    assert not any(k.startswith("model.visual.") and k.endswith(("weight_scale", "weight_packed")) for k in keys)


def test_reloads_in_transformers_and_lowbit_with_the_same_weights(w4a8):
    from lowbit.runtime.load import resolve

    ours = resolve(w4a8).model
    assert type(ours).__name__ == "Qwen2_5_VLForConditionalGeneration"
    q = {n: m for n, m in ours.named_modules() if isinstance(m, QuantLinear)}
    assert len(q) == 14 and not any(n.startswith("model.visual") for n in q)
    hf = _plain_load(w4a8)
    assert not any(isinstance(m, QuantLinear) for m in hf.modules())
    for n, m in q.items():
        assert torch.equal(m.dequantized_weight().float(), hf.get_submodule(n).weight.float()), n
    for n in ("model.visual.merger.mlp.2", "model.visual.blocks.1.attn.qkv", "lm_head"):
        assert torch.equal(ours.get_submodule(n).weight, hf.get_submodule(n).weight), n


def test_w4a8_greedy_with_an_image_through_kv8_equals_transformers_reload(w4a8):
    from lowbit.runtime.load import resolve

    ours = resolve(w4a8).model
    hf = _plain_load(w4a8)
    want, lo, cache = _generate(ours)
    assert cache.quantized_rows_total() > 0  # the KV8 tiers held quantized rows (the image's among them)
    got, lh, _ = _generate(hf)  # transformers' reload, free running
    top = lo.topk(2, dim=-1).values
    print(f"w4a8 vs transformers: max logit diff {float((lo - lh).abs().max()):.4g}, "
          f"smallest top-1 lead {float((top[:, 0] - top[:, 1]).min()):.4g}")
    assert got == want and len(set(want)) > 1  # free-running greedy, not a constant sequence
    assert torch.equal(lo, lh)  # every step's logits, bit for bit


def test_w4a16_free_greedy_with_an_image_through_kv8_is_equal(vl_dir, calib_file, tmp_path):
    from lowbit.runtime.load import resolve

    out = _quantize(vl_dir, calib_file, tmp_path / "w4a16", "w4a16-g128")
    ours, hf = resolve(out).model, _plain_load(out)
    a, la, _ = _generate(ours)
    b, lb, _ = _generate(hf)
    assert a == b
    assert float((la - lb).abs().max()) < 1e-3 * float(la.abs().max())


def test_vision_tower_must_stay_in_the_ignore_list(vl_dir, calib_file, tmp_path, capsys):
    out = tmp_path / "bad"
    rc = main(["quantize", "--model", str(vl_dir), "--weights", "w4a8", "--method", "rtn", "--ignore", "lm_head",
               "--out", str(out)])
    last = capsys.readouterr().err.strip().splitlines()[-1]  # (model loading prints progress before it)
    assert rc == 2 and last.startswith("error: ") and "vision tower" in last and r"re:^model\.visual\." in last
    assert not out.exists()


def test_rotation_folds_into_the_vision_merger_so_images_stay_exact():
    """--rotate rotates the residual stream; image embeddings enter it from the tower's merger, so the merger's
    last linear is rotated like E. Without that (the spec minus vision_writers) the image rows are wrong."""
    import copy
    import dataclasses

    from lowbit.weights import arch
    from lowbit.weights.rotate import rotate_model

    m, _ = tiny_model(FAMILY, seed=1)
    inp = _inputs(seed=3)
    with torch.no_grad():
        ref = m(**inp).logits
        r = copy.deepcopy(m)
        rotate_model(r)
        rel = float((r(**inp).logits - ref).norm() / ref.norm())
        text_only = {"input_ids": torch.tensor([[5, 6, 7, 8, 9, 10, 11]])}
        spec = arch.ARCHS["qwen2_5_vl"]
        try:
            arch.ARCHS["qwen2_5_vl"] = dataclasses.replace(spec, vision_writers=())
            w = copy.deepcopy(m)
            rotate_model(w)
        finally:
            arch.ARCHS["qwen2_5_vl"] = spec
        rel_wrong = float((w(**inp).logits - ref).norm() / ref.norm())
        rel_text = float((w(**text_only).logits - m(**text_only).logits).norm() / m(**text_only).logits.norm())
    assert rel < 1e-5
    assert rel_text < 1e-5 and rel_wrong > 1e-2  # text alone never meets the tower; the image rows do



def test_bf16_checkpoint_keeps_the_tower_in_bf16(vl_dir, tmp_path):
    out = tmp_path / "bf16"
    assert main(["quantize", "--model", str(vl_dir), "--scheme", "w4a8", "--method", "rtn", "--dtype", "bf16",
                 "--no-progress", "--out", str(out)]) == 0
    kept = json.loads((out / "manifest.json").read_text())["counts"]["kept_unquantized"]["model.visual"]
    assert kept["dtype"] == "bf16" and kept["linears"] == 12
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        tower = {f.get_tensor(k).dtype for k in f.keys() if k.startswith("model.visual.")}
    assert tower == {torch.bfloat16}
