"""Peers: HF QuantizedCache rows (run, accounting, cannot-run paths) and the dead-hook abort."""

import importlib.util

import pytest
import torch

from lowbit.core.errors import LowbitError
from lowbit.eval.harness import evaluate
from lowbit.eval.peers import Accounting, hf_quantized_entry, lowbit_entry, reference_entry, tensor_bits
from lowbit.kv.scheme import parse_kv_scheme
from lowbit.models.geometry import ModelGeometry


def test_quanto_peer_runs_and_its_bits_come_from_its_tensors(tiny_smollm, random_windows):
    model, config = tiny_smollm
    geo = ModelGeometry.from_config(config)
    windows = random_windows(99, 1, 77)
    _ref, q2, q4 = evaluate(model, windows, [reference_entry(), hf_quantized_entry("hf-quanto-int2", geo, 32),
                                            hf_quantized_entry("hf-quanto-int4", geo, 32)], chunk=19, progress=False)
    assert q2.ok and q4.ok
    # head_dim 64 -> q_group_size 64; codes + an fp32 scale and shift per 64 elements (the model is fp32),
    # plus a little packing padding of odd row counts
    assert q2.accounting.bits_per_elt == pytest.approx(2 + 64 / 64, abs=0.05)
    assert q4.accounting.bits_per_elt == pytest.approx(4 + 64 / 64, abs=0.05)
    assert q2.accounting.quantized_rows > 0 and q2.accounting.quantized_rows % (2 * 3 * 2) == 0
    assert q2.scores.mean_kl > q4.scores.mean_kl > 0
    assert q2.config["residual_length"] == 32 and q2.config["q_group_size"] == 64


@pytest.mark.skipif(importlib.util.find_spec("hqq") is None, reason="hqq not installed")
def test_hqq_peer_runs(tiny_smollm, random_windows):
    model, config = tiny_smollm
    geo = ModelGeometry.from_config(config)
    _ref, h2 = evaluate(model, random_windows(99, 1, 50), [reference_entry(), hf_quantized_entry("hf-hqq-int2", geo, 16)],
                       chunk=17, progress=False)
    assert h2.ok and h2.accounting.quantized_rows > 0 and h2.scores.mean_kl > 0


def test_quantized_cache_on_sliding_layers_cannot_run(tiny_gemma, random_windows):
    model, config = tiny_gemma
    geo = ModelGeometry.from_config(config)
    e = hf_quantized_entry("hf-quanto-int2", geo, 256)
    assert e.cannot_run and "sliding-window layers" in e.cannot_run
    ref, q = evaluate(model, random_windows(99, 1, 9), [reference_entry(), e], chunk=4, progress=False)
    assert ref.ok and not q.ok and q.scores.n == 0


def test_missing_backend_package_cannot_run(monkeypatch, tiny_smollm):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "hqq" else real(name, *a))
    e = hf_quantized_entry("hf-hqq-int4", ModelGeometry.from_config(tiny_smollm[1]), 256)
    assert e.cannot_run == "the hqq backend needs the package hqq, which is not installed"


def test_peer_failing_mid_run_becomes_a_row_not_a_crash(tiny_smollm, random_windows):
    model, config = tiny_smollm
    geo = ModelGeometry.from_config(config)
    bad = hf_quantized_entry("hf-quanto-int2", geo, 32)


    def make_broken(model):
        from transformers import DynamicCache

        c = DynamicCache(config=model.config)

        def update(*a, **k):
            raise RuntimeError("backend exploded\nsecond line")

        c.update = update
        return c

    bad.make_cache = make_broken
    int4 = lowbit_entry("int4", parse_kv_scheme("int4", sink=0, recent=16), geo)
    ref, b, q = evaluate(model, random_windows(99, 1, 40), [reference_entry(), bad, int4], chunk=16, progress=False)
    assert b.cannot_run == "RuntimeError: backend exploded"
    assert ref.ok and q.ok and q.scores.n == 39


def test_our_own_rows_raise_instead_of_hiding(tiny_smollm, random_windows):
    model, config = tiny_smollm
    geo = ModelGeometry.from_config(config)
    e = lowbit_entry("int4", parse_kv_scheme("int4", sink=0, recent=16), geo)

    def boom(model):
        raise RuntimeError("cache bug")

    e.make_cache = boom
    with pytest.raises(RuntimeError, match="cache bug"):
        evaluate(model, random_windows(99, 1, 20), [reference_entry(), e], chunk=8, progress=False)


def test_dead_hook_aborts(tiny_smollm, random_windows):
    """sink + recent >= the window: the scheme quantizes nothing, which must abort, not report bf16 as int2."""
    model, config = tiny_smollm
    geo = ModelGeometry.from_config(config)
    e = lowbit_entry("int2", parse_kv_scheme("int2", sink=32, recent=32), geo)
    with pytest.raises(LowbitError, match=r"int2 quantized 0 K/V rows .*never quantized a token"):
        evaluate(model, random_windows(99, 2, 60), [reference_entry(), e], chunk=16, progress=False)


def test_dead_hook_of_a_cache_off_the_write_path(tiny_smollm, random_windows):
    """A cache whose accounting says nothing was quantized (e.g. a hook that never fired) aborts too."""
    model, config = tiny_smollm
    geo = ModelGeometry.from_config(config)
    e = lowbit_entry("int4", parse_kv_scheme("int4", sink=0, recent=16), geo)
    e.account = lambda cache: Accounting()
    with pytest.raises(LowbitError, match="never quantized a token"):
        evaluate(model, random_windows(99, 1, 40), [reference_entry(), e], chunk=16, progress=False)


def test_tensor_bits_counts_inner_tensors():
    assert tensor_bits(torch.zeros(3, 5, dtype=torch.float16)) == 3 * 5 * 16
    assert tensor_bits((torch.zeros(4, dtype=torch.uint8), {"scale": torch.zeros(2), "n": 3})) == 4 * 8 + 2 * 32
    assert tensor_bits(None) == 0
