"""What a new user hits first in `lowbit eval`: windows too short to quantize, reports that already
exist, a --seq-len past the context, a ΔPPL within noise, the plot's axis labels."""

import json
import math

import pytest
import torch

from lowbit.core.errors import LowbitError
from lowbit.eval import report as rep
from lowbit.eval.perplexity import Scores
from lowbit.eval.runner import EvalOptions, check_options


def _opts(model, corpus, **kw):
    return EvalOptions(model=str(model), data=str(corpus), **kw)


def test_window_shorter_than_sink_recent_page_refused(tiny_dir, corpus):
    with pytest.raises(LowbitError) as e:
        check_options(_opts(tiny_dir, corpus, kv="bf16,int4", seq_len=200))
    msg = str(e.value)
    assert "--seq-len 200 is shorter than int4's sink 64 + recent 256 + one page of 16 = 336 tokens" in msg
    assert "quantize nothing" in msg and "use --seq-len 336 or more" in msg and "\n" not in msg
    check_options(_opts(tiny_dir, corpus, kv="bf16,int4", seq_len=336))  # one page leaves the ring: accepted
    check_options(_opts(tiny_dir, corpus, kv="bf16,k16v16", seq_len=30))  # nothing to quantize: no check


def test_kivi_peer_checked_too(tiny_dir, corpus):
    with pytest.raises(LowbitError, match="shorter than kivi2's .* or leave out the peer kivi2"):
        check_options(_opts(tiny_dir, corpus, peers="kivi2", seq_len=40))


@pytest.fixture
def short_context(tiny_dir, tmp_path):
    """A model directory whose config allows 256 positions (check_options reads only config.json)."""
    cfg = json.loads((tiny_dir / "config.json").read_text())
    cfg["max_position_embeddings"] = 256
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_advice_fits_the_context(short_context, corpus):
    with pytest.raises(LowbitError) as e:
        check_options(_opts(short_context, corpus, kv="int2", seq_len=200))
    msg = str(e.value)
    assert "context is 256 tokens, so lower --sink / --recent (e.g. --sink 16 --recent 80)" in msg
    assert "--seq-len 336" not in msg  # longer than the model allows: not advised
    # the advice works
    check_options(_opts(short_context, corpus, kv="int2", seq_len=200, kv_flags={"sink": 16, "recent": 80}))
    with pytest.raises(LowbitError, match=r"longer than the context of .* \(256 tokens\); use --seq-len 256 or less"):
        check_options(_opts(short_context, corpus, seq_len=300))


@pytest.mark.parametrize("flag", ["json_out", "markdown_out", "plot_out"])
def test_existing_report_refused_unless_overwrite(flag, tiny_dir, corpus, tmp_path):
    p = tmp_path / ("r.png" if flag == "plot_out" else "r.out")
    p.write_text("old")
    with pytest.raises(LowbitError, match=f"{p} already exists; give a new path, delete it, or pass --overwrite"):
        check_options(_opts(tiny_dir, corpus, seq_len=64, **{flag: str(p)}))
    check_options(_opts(tiny_dir, corpus, seq_len=64, overwrite=True, **{flag: str(p)}))


def test_cli_refuses_existing_json_before_loading(tiny_dir, corpus, tmp_path, capsys, monkeypatch):
    import lowbit.models
    import lowbit.runtime.load
    from lowbit.cli import main

    monkeypatch.setattr(lowbit.models, "resolve", lambda *a, **k: (_ for _ in ()).throw(AssertionError("loaded")))

    monkeypatch.setattr(lowbit.runtime.load, "resolve", lambda *a, **k: (_ for _ in ()).throw(AssertionError("loaded")))
    out = tmp_path / "r.json"
    out.write_text("{}")
    assert main(["eval", "--model", str(tiny_dir), "--data", str(corpus), "--seq-len", "64", "--json", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err and out.read_text() == "{}"


def test_delta_ppl_standard_error_is_the_paired_one():
    torch.manual_seed(0)
    T, V = 99, 7
    ref = torch.randn(T, V).log_softmax(-1)
    row = (ref + 0.3 * torch.randn(T, V)).log_softmax(-1)
    tgt = torch.randint(0, V, (T,))
    s = Scores()
    s.add(row[:50], tgt[:50], ref[:50])
    s.add(row[50:], tgt[50:], ref[50:])  # sums over chunks
    d = (-row.gather(1, tgt[:, None]) + ref.gather(1, tgt[:, None]))[:, 0].double()
    want = 100 * math.exp(d.mean()) * d.std().item() / math.sqrt(T)
    assert s.delta_ppl_se_pct() == pytest.approx(want, rel=1e-6)
    same = Scores()
    same.add(ref, tgt, ref)
    assert same.delta_ppl_se_pct() == 0.0


def _report(rows, tokens=399):
    return {"protocol": {"tokens_scored": tokens, "windows": 1, "seq_len": 400, "chunk": 128},
            "model": {"name": "m"}, "data": {"name": "d"},
            "results": [{"scheme": n, "kind": k, "status": "ok", "delta_ppl_pct": dp, "delta_ppl_se_pct": se,
                         "bits_per_elt": b, "avg_bits_per_elt": b} for n, k, dp, se, b in rows]}


def test_noise_warning_names_the_standard_error():
    r = _report([("bf16", "reference", 0.0, None, None), ("int8", "lowbit", 0.03, 0.02, 8.5),
                 ("int2", "lowbit", 36.0, 0.5, 2.5), ("int4", "lowbit", -0.05, 0.02, 4.5)])
    w = rep.noise_warnings(r)
    assert len(w) == 1  # int2 is far outside; int4 is 2.5 standard errors below 0
    assert w[0].startswith("warning: int8 ΔPPL +0.03% is within noise (standard error ±0.02% over 399 scored")


def test_plot_ticks_are_percent_labels(tmp_path):
    assert rep._pct_ticks(0.0, 180.0) == [0.0, 0.5, 1.0, 10.0, 100.0, 1000.0]
    assert rep._pct_ticks(-0.2, 3.0) == [-0.5, 0.0, 0.5, 1.0, 2.0, 5.0]
    assert [rep._pct_label(t) for t in (0.0, 0.5, 10.0, 1000.0, -0.5)] == ["0", "+0.5%", "+10%", "+1,000%", "-0.5%"]
    p = rep.write_plot(_report([("bf16", "reference", 0.0, None, None), ("int2", "lowbit", 36.0, 0.5, 2.5)]),
                       tmp_path / "p.png")
    assert p.stat().st_size > 1000


def test_warm_up_is_untimed_and_changes_no_score(tiny_dir, corpus):
    from rich.console import Console

    from lowbit.eval.runner import run_eval

    kw = {"kv": "bf16,int4", "peers": "kivi2", "seq_len": 240, "windows": 1, "chunk": 40, "dtype": "fp32",
          "progress": False, "full_window": False, "kv_flags": {"sink": 16, "recent": 32}}
    quiet = Console(quiet=True)
    cold = run_eval(_opts(tiny_dir, corpus, **kw), console=quiet)
    warm = run_eval(_opts(tiny_dir, corpus, warmup=True, **kw), console=quiet)
    assert cold["protocol"]["warmup_tokens"] == 0
    # kivi2 quantizes from sink 0 + recent 128 + page 32 = 160 tokens, plus one chunk of 40
    assert warm["protocol"]["warmup_tokens"] == 200
    for a, b in zip(cold["results"], warm["results"], strict=True):
        assert (a["scheme"], a["ppl"], a["quantized_rows"]) == (b["scheme"], b["ppl"], b["quantized_rows"])
