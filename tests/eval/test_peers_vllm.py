"""vLLM 0.26 KV-dtype peers: the ports against vLLM's own code, the cache's read paths, the rows.

tests/eval/fixtures/vllm026_reference.pt.gz holds vLLM 0.26.0's outputs on fixed bf16 K/V
([40 tokens, 3 heads, D] for D = 64 and 128), made by benchmarks/vllm_reference.py: vLLM's Triton store
kernels (triton_turboquant_store, _reshape_cache_per_token_head, _reshape_cache_int4_kernel via
reshape_and_cache_int4) and its dequant kernel (_tq_full_dequant_kv) run as written in Triton's CPU
interpreter; its Python helpers (get_centroids, _build_hadamard, single_rht's CPU butterfly,
get_boundary_skip_layers) run as they are.
"""

import gzip
import io
from pathlib import Path

import pytest
import torch

from lowbit.eval import peers_vllm as P
from lowbit.eval.harness import evaluate
from lowbit.eval.peers import PEERS, reference_entry
from lowbit.models.geometry import ModelGeometry
from lowbit.models.tiny import tiny_model

REF = Path(__file__).parent / "fixtures" / "vllm026_reference.pt.gz"  # gzipped: torch.save pads every tensor


@pytest.fixture(scope="module")
def ref():
    return torch.load(io.BytesIO(gzip.decompress(REF.read_bytes())))


def test_centroids_hadamard_and_skip_layers_equal_vllms(ref):
    for key, c in ref["centroids"].items():  # centroids.py: get_centroids(d, bits)
        d, b = map(int, key.split("_"))
        assert torch.equal(P.tq_centroids(d, b), c), key
    assert torch.equal(P.tq_hadamard(64), ref["hadamard_64"])  # turboquant_attn.py: _build_hadamard
    for n, skip in ref["skip_layers"].items():  # TurboQuantConfig.get_boundary_skip_layers
        assert P.tq_skip_layers(n) == [int(i) for i in skip]


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("preset", list(P.TQ_PRESETS))
def test_turboquant_store_and_dequant_bit_exact(ref, d, preset):
    case = ref[f"d{d}"]
    r, t = case[preset], P.TQ_PRESETS[preset]
    cfg = P.TQConfig.from_cache_dtype(preset, d)
    assert (cfg.slot_size_aligned, cfg.key_packed_size, cfg.value_packed_size) == (
        r["slot_size_aligned"], r["key_packed_size"], r["value_packed_size"])
    # values: _store_quantized_value, read back by _tq_full_dequant_kv (fp16 out)
    assert torch.equal(P.tq_values(case["v"], t["value_quant_bits"]).half(), r["v_dequant"])
    if t["key_quant_bits"] == 8:
        # fp8 keys: the interpreter's fp8 cast is not the hardware's (see test_fp8_cast_is_the_hardware_cast);
        # where it rounds regularly (no tie, no carry into the next binade) it must agree
        mine = P.fp8_e4m3(case["k"]).half()
        theirs = r["k_dequant"]
        regular = (mine - theirs).abs() <= (case["k"].float() - mine.float()).abs()
        assert regular.float().mean() > 0.9
        assert torch.equal(mine[regular & (mine == theirs)], theirs[regular & (mine == theirs)])
    else:  # MSE keys in the rotated basis, norm correction, fp16 norm (_tq_fused_store_mse + dequant)
        idx, n16 = P.tq_key_codes(case["k"], t["key_quant_bits"])
        k_rot = P.tq_keys_rotated(idx, n16, t["key_quant_bits"], t["norm_correction"])
        assert torch.equal(k_rot.half(), r["k_dequant"])


@pytest.mark.parametrize("d", [64, 128])
def test_int8_per_token_head_codes_and_scales_bit_exact(ref, d):
    case = ref[f"d{d}"]
    for name in ("k", "v"):
        codes, scale = P.int8_per_token_head_codes(case[name])
        assert torch.equal(codes, case["int8"][f"{name}_codes"])
        assert torch.equal(scale, case["int8"][f"{name}_scale"])


@pytest.mark.parametrize("d", [64, 128])
def test_int4_per_token_head_rht_codes_and_packed_scales_bit_exact(ref, d):
    case, r = ref[f"d{d}"], ref[f"d{d}"]["int4"]
    assert torch.equal(P.rht_signs(d), r["signs"])
    assert torch.equal(P.single_rht(r["rht_in"], hadacore=False), r["rht_out"])
    assert torch.equal(P.single_rht(r["rht_in"], inverse=True, hadacore=False), r["rht_inv_out"])
    for name in ("k", "v"):  # reshape_and_cache_int4 on the CPU: tier-3 butterfly RHT, then the kernel
        x = case[name]
        c = P.int4_per_token_head_codes(P.single_rht(x.float(), hadacore=False).to(x.dtype))
        packed = (c.codes[..., 0::2] & 0xF) | ((c.codes[..., 1::2] & 0xF) << 4)
        assert torch.equal(packed, r[f"{name}_packed"])
        assert torch.equal(c.scale_packed.view(torch.int32), r[f"{name}_scale"].view(torch.int32))


def test_fp8_cast_is_the_hardware_cast():
    """vLLM's own oracle for the SM89+ fp8 store (tests/kernels/attention/test_fp8e4nv_conversion.py,
    _saturating_fp8_ref and its cases): round to nearest even, saturate at +-448, and a direct fp32 cast
    (37.98868179321289 -> byte 0x61, 91.80638885498047 -> 0x6B). Triton's interpreter emulates this cast
    inexactly (ties away from zero, a lost carry: 1.953125 -> 1.0, 800 -> 416), so fp8 is checked here."""
    x = torch.tensor([37.98868179321289, 91.80638885498047, 449.0, -1e4, float("inf"), 0.65625, 1.953125, 2.0**-12])
    out = P.fp8_e4m3(x)
    as_bytes = out.to(torch.float8_e4m3fn).view(torch.uint8)
    assert as_bytes[0].item() == 0x61 and as_bytes[1].item() == 0x6B
    assert out[2].item() == 448.0 and out[3].item() == -448.0 and out[4].item() == 448.0
    assert out[5].item() == 0.625  # tie between 0.625 and 0.6875: even mantissa
    assert out[6].item() == 2.0  # carry into the next binade
    assert P.fp8_per_tensor(torch.tensor([800.0]), 0.05).item() == pytest.approx(448.0 * 0.05)


def test_int4_dequant_in_the_original_basis_is_attention_equivalent():
    """unified_attention_int4 scores q_rot . k_rot_hat / D and un-rotates its output / D: the same as
    attending to single_rht(k_rot_hat, inverse) / D in the original basis."""
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(5, 64, generator=g), torch.randn(7, 64, generator=g)
    k_rot = P.single_rht(k, hadacore=False)
    deq_rot = P.int4_dequant_rotated(P.int4_per_token_head_codes(k_rot))
    scores_vllm = P.single_rht(q, hadacore=False) @ deq_rot.T / 64
    scores_port = q @ P.int4_per_token_head(k, hadacore=False).T
    assert torch.allclose(scores_vllm, scores_port, atol=1e-5)


def test_bits_per_element_from_storage():
    assert P.bits_per_element("vllm-fp8", 64, 64) == 8.0
    assert P.bits_per_element("vllm-int8-pth", 64, 64) == 8.5  # + an fp32 scale per 64
    assert P.bits_per_element("vllm-int4-pth", 64, 64) == 4.5
    # TurboQuant slots at D=64: k8v4 64 + 36 = 100 B, 4bit 34 + 36 = 70, k3v4 26 + 36 = 62, 3bit 26 + 28 = 54
    assert P.bits_per_element("vllm-tq-k8v4", 64, 64) == 100 * 8 / 128
    assert P.bits_per_element("vllm-tq-4bit-nc", 64, 64) == 70 * 8 / 128
    assert P.bits_per_element("vllm-tq-k3v4-nc", 64, 64) == 62 * 8 / 128
    assert P.bits_per_element("vllm-tq-3bit-nc", 64, 64) == 54 * 8 / 128


@pytest.fixture(scope="module")
def six_layer():
    model, config = tiny_model("smollm2-135m", num_layers=6, vocab_size=99, seed=0)
    return model, config


def test_every_peer_is_listed_and_runs(six_layer, random_windows):
    model, config = six_layer
    geo = ModelGeometry.from_config(config)
    assert all(p in PEERS for p in P.VLLM_PEERS)
    entries = [reference_entry()] + [P.vllm_entry(p, geo) for p in P.VLLM_PEERS]
    res = evaluate(model, random_windows(99, 2, 60), entries, chunk=16, progress=False)
    _ref, rows = res[0], {r.name: r for r in res[1:]}
    for name, r in rows.items():
        assert r.ok, (name, r.cannot_run)
        assert r.accounting.quantized_rows > 0
        assert r.scores.mean_kl >= 0
    # TurboQuant: layers 0, 1, 4, 5 stay dense, so 2 of 6 layers are quantized
    tq = rows["vllm-tq-3bit-nc"]
    assert tq.config["skip_layers"] == [0, 1, 4, 5]
    assert tq.accounting.bits_per_elt == pytest.approx(54 * 8 / 128)
    assert tq.accounting.avg_bits_per_elt == pytest.approx((2 * 54 * 8 / 128 + 4 * 32) / 6)  # fp32 model
    assert rows["vllm-int8-pth"].scores.mean_kl < rows["vllm-int4-pth"].scores.mean_kl
    assert rows["vllm-tq-4bit-nc"].scores.mean_kl < rows["vllm-tq-3bit-nc"].scores.mean_kl


def test_read_paths(six_layer):
    """fp8/int8/int4: every read is the stored (quantized) K/V; TurboQuant: a first chunk reads its raw
    K/V, a later chunk of <= 128 tokens reads quantized, a later chunk of > 128 reads its own raw."""
    model, config = six_layer
    geo = ModelGeometry.from_config(config)
    g = torch.Generator().manual_seed(0)

    def kv(t):
        return torch.randn(1, 3, t, 64, generator=g), torch.randn(1, 3, t, 64, generator=g)

    for name in ("vllm-int8-pth", "vllm-tq-4bit-nc"):
        e = P.vllm_entry(name, geo)
        cache = e.make_cache(model)
        k1, v1 = kv(10)
        K, _ = cache.update(k1, v1, 2)
        if name.startswith("vllm-tq"):
            assert torch.equal(K, k1)  # first chunk: raw
        else:
            assert torch.equal(K, P.int8_per_token_head(k1))
        k2, _v2 = kv(5)
        K, _ = cache.update(k2, _v2, 2)
        assert K.shape[-2] == 15 and not torch.equal(K[..., 10:, :], k2)  # <= 128: quantized
        k3, v3 = kv(130)
        K, _ = cache.update(k3, v3, 2)
        if name.startswith("vllm-tq"):
            assert torch.equal(K[..., 15:, :], k3)  # > 128 continuation: own tokens raw
        K, _ = cache.update(*kv(4), 0)  # a TurboQuant skip layer (0) is plain bf16 storage
        if name.startswith("vllm-tq"):
            assert cache.quantized_rows == 2 * 3 * (10 + 5 + 130)


def test_calibrated_fp8_scales_fixed_after_the_first_forward(six_layer):
    _model, config = six_layer
    geo = ModelGeometry.from_config(config)
    peer = P.VllmPeer("vllm-fp8-calibrated", geo)
    k, v = torch.randn(1, 3, 8, 64) * 3, torch.randn(1, 3, 8, 64)
    peer.fake_quant(1, k, v)
    assert peer.scales[1] == pytest.approx((k.abs().max().item() / 200, v.abs().max().item() / 100))
    peer.fake_quant(1, k * 10, v * 10)
    assert peer.scales[1] == pytest.approx((k.abs().max().item() / 200, v.abs().max().item() / 100))


def _with_head_dim(geo, d):
    from dataclasses import replace

    return replace(geo, layers=[replace(g, head_dim_k=d, head_dim_v=d) for g in geo.layers])


def test_cannot_run_rules(tiny_gemma, tiny_smollm):
    gem = ModelGeometry.from_config(tiny_gemma[1])
    small = ModelGeometry.from_config(tiny_smollm[1])
    assert "sliding" in P.cannot_run("vllm-tq-4bit-nc", gem)
    assert P.cannot_run("vllm-int8-pth", gem) is None  # Triton attention handles sliding windows
    assert "no layer left" in P.cannot_run("vllm-tq-k8v4", small)  # 2 layers, both boundary layers
    odd = _with_head_dim(small, 96)
    assert "power-of-two" in P.cannot_run("vllm-int4-pth", odd)
    odd6 = _with_head_dim(ModelGeometry.from_config(tiny_model("smollm2-135m", num_layers=6, vocab_size=99)[1]), 96)
    assert "power-of-two" in P.cannot_run("vllm-tq-3bit-nc", odd6)
    assert P.cannot_run("vllm-tq-k8v4", odd6) is None  # fp8 keys need no rotation
    e = P.vllm_entry("vllm-tq-4bit-nc", gem)
    assert e.cannot_run and e.make_cache is None


def test_unknown_peer_lists_the_peers():
    from lowbit.core.errors import LowbitError
    from lowbit.eval.plan import plan_peers

    with pytest.raises(LowbitError, match="vllm-tq-3bit-nc"):
        plan_peers("vllm-int2")
    assert plan_peers("vllm-fp8,vllm-tq-k8v4") == ["vllm-fp8", "vllm-tq-k8v4"]


def test_needle_task_runs_a_vllm_peer_with_its_storage_bits(tiny_dir, tmp_path, capsys):
    """`lowbit eval --task needle --peers vllm-...`: the peer's cache quantizes the prompt, its held bits
    come from vLLM's storage; a TurboQuant peer on a 2-layer model (both boundary layers) is refused, named."""
    import json

    from lowbit.cli import main

    hay = tmp_path / "hay.txt"
    hay.write_text(" ".join(["The cat sat on the mat.", "A dog ran to the cat."] * 60), encoding="utf-8")
    out = tmp_path / "n.json"
    argv = ["eval", "--task", "needle", "--model", str(tiny_dir), "--dtype", "fp32", "--lengths", "200",
            "--depths", "50", "--chunk", "64", "--haystack", str(hay), "--no-progress"]
    assert main([*argv, "--peers", "vllm-int8-pth", "--json", str(out)]) == 0, capsys.readouterr().err
    res = {r["scheme"]: r for r in json.loads(out.read_text())["results"]}
    assert res["vllm-int8-pth"]["kind"] == "vllm-peer" and res["vllm-int8-pth"]["quantized_rows"] > 0
    assert res["vllm-int8-pth"]["bits_held"]["200"] == 8.5
    assert main([*argv, "--peers", "vllm-tq-4bit-nc"]) != 0
    assert "no layer left to quantize" in capsys.readouterr().err
