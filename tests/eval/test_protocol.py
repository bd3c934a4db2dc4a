"""The protocol: scored positions, KL/top-1 arithmetic, chunked-through-cache == full-window PPL."""

import math

import pytest
import torch

from lowbit.eval.harness import evaluate
from lowbit.eval.peers import Entry, dynamic_cache_accounting, lowbit_entry, reference_entry
from lowbit.eval.perplexity import Scores, chunk_targets, full_window_ppl
from lowbit.kv.scheme import parse_kv_scheme
from lowbit.models.geometry import ModelGeometry


def test_chunk_targets_score_positions_0_to_L_minus_2():
    w = torch.arange(10, 17)  # L = 7
    n, t = chunk_targets(w, 0, 3)
    assert n == 3 and t.tolist() == [11, 12, 13]
    n, t = chunk_targets(w, 3, 6)
    assert n == 3 and t.tolist() == [14, 15, 16]
    n, t = chunk_targets(w, 6, 9)  # the last position has no target
    assert n == 0 and t.numel() == 0
    total = sum(chunk_targets(w, s, s + 3)[0] for s in range(0, 7, 3))
    assert total == 6  # L - 1


def test_scores_against_itself_is_kl_0_top1_100():
    g = torch.Generator().manual_seed(0)
    logp = torch.log_softmax(torch.randn(5, 11, generator=g), -1)
    t = torch.tensor([0, 3, 10, 7, 1])
    s = Scores()
    s.add(logp, t, ref_logp=logp)
    assert s.n == 5 and s.top1 == 5 and s.mean_kl == 0.0
    assert math.isclose(s.ppl, math.exp(-logp[torch.arange(5), t].mean().item()), rel_tol=1e-6)


def test_scores_kl_matches_definition_and_top1_counts_disagreement():
    g = torch.Generator().manual_seed(1)
    ref = torch.log_softmax(torch.randn(3, 7, generator=g), -1)
    other = torch.log_softmax(torch.randn(3, 7, generator=g), -1)
    s = Scores()
    s.add(other, torch.tensor([1, 2, 3]), ref_logp=ref)
    want = sum((ref[i].exp() * (ref[i] - other[i])).sum().item() for i in range(3)) / 3
    assert s.mean_kl == pytest.approx(want, rel=1e-5) and s.mean_kl > 0
    assert s.top1 == int((ref.argmax(-1) == other.argmax(-1)).sum())


@pytest.mark.parametrize("chunk", [1, 13, 128])
def test_bf16_through_cache_matches_full_window_smollm(tiny_smollm, chunk, random_windows):
    model, _ = tiny_smollm
    windows = random_windows(99, 1 if chunk == 1 else 2, 41 if chunk == 1 else 203)
    res = evaluate(model, windows, [reference_entry()], chunk=chunk, progress=False)
    ref = res[0]
    assert ref.scores.n == windows.shape[0] * (windows.shape[1] - 1)
    assert ref.scores.ppl == pytest.approx(full_window_ppl(model, windows), rel=1e-4)
    assert ref.scores.mean_kl == 0.0 and ref.scores.top1_pct == 100.0


def test_bf16_through_cache_matches_full_window_gemma_past_the_sliding_window(tiny_gemma, random_windows):
    model, config = tiny_gemma
    assert config.sliding_window < 600  # the chunked run must cross the window of the sliding layers
    windows = random_windows(99, 1, 601)
    res = evaluate(model, windows, [reference_entry()], chunk=128, progress=False)
    assert res[0].scores.ppl == pytest.approx(full_window_ppl(model, windows), rel=1e-4)


def test_lowbit_bf16_rows_equal_reference_and_int_rows_cost_quality(tiny_smollm, random_windows):
    model, config = tiny_smollm
    geo = ModelGeometry.from_config(config)
    windows = random_windows(99, 1, 100)
    entries = [reference_entry(),
               lowbit_entry("k16v16", parse_kv_scheme("k16v16", sink=16, recent=32), geo),
               lowbit_entry("int2", parse_kv_scheme("int2", sink=16, recent=32), geo)]
    ref, exact, int2 = evaluate(model, windows, entries, chunk=33, progress=False)
    assert exact.scores.mean_kl < 1e-6 and exact.scores.top1_pct > 99.0
    assert exact.accounting.quantized_rows == 0 and exact.accounting.bits_per_elt is None
    assert exact.scores.ppl == pytest.approx(ref.scores.ppl, rel=1e-4)
    assert int2.scores.mean_kl > 1e-4
    # 2 layers x 3 kv heads x (K + V) x tokens in the middle (100 - 16 sink - >=32 recent, whole pages)
    assert int2.accounting.quantized_rows > 0 and int2.accounting.quantized_rows % (2 * 3 * 2) == 0
    assert 2.0 < int2.accounting.bits_per_elt < 3.0  # codes + fp16 scale/zero per 64 channels: 2.5
    dense_bits = 8 * torch.finfo(model.dtype).bits // 8  # sink/recent and the reference hold the model dtype
    assert int2.accounting.bits_per_elt < int2.accounting.avg_bits_per_elt < dense_bits
    assert ref.accounting.avg_bits_per_elt == dense_bits and ref.accounting.bits_per_elt is None


def test_reference_must_come_first(tiny_smollm, random_windows):
    model, _ = tiny_smollm
    e = Entry("x", "lowbit", None, dynamic_cache_accounting, quantizes=False)
    with pytest.raises(ValueError, match="reference"):
        evaluate(model, random_windows(99, 1, 9), [e], chunk=4, progress=False)
