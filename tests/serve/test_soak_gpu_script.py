"""scripts/serve_soak_gpu.py (the GPU soak of issue #22) end to end on CPU with the tiny-llama geometry:
its counts add up, nothing is lost or held after, every answer equals its solo run, the int2 tier was used,
the budget guard stops sending and says so, and a mismatch is reported with its position and margins."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def soak_script():
    spec = importlib.util.spec_from_file_location("serve_soak_gpu", ROOT / "scripts/serve_soak_gpu.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(mod, tmp_path, *extra) -> tuple[int, dict]:
    out = tmp_path / "soak.json"
    rc = mod.main(["--out", str(out), "--geometry", "tiny-llama", "--device", "cpu", *map(str, extra)])
    return rc, json.loads(out.read_text())


def test_cpu_soak_end_to_end(soak_script, tmp_path):
    # prompts 290..420 tokens: past sink 64 + recent 256, so the int2 middle holds tokens
    rc, rep = _run(soak_script, tmp_path, "-n", 13, "-c", 3, "--min-prompt", 290, "--max-prompt", 420,
                   "--max-out", 9, "--hangup", 0.35, "--budget-s", 300)
    assert rc == 0 and rep["ok"], rep.get("traceback") or rep
    s = rep["soak"]
    assert s["sent"] == 13 and not s["stopped_sending_early"]
    assert s["answered"] + s["hung_up"] == 13 and s["errors"] == 0 and s["lost"] == 0
    assert s["hung_up"] == rep["plan"]["hang_ups_planned"] >= 2  # every planned hang-up happened
    assert sum(s["engine_finished"].values()) == 13 and s["engine_unaccounted"] == 0
    assert s["engine_finished"]["cancelled"] >= 1 and s["answered_short"] == 0
    assert s["quantized_tokens_answered"] > 0
    assert s["latency_p50_ms"] <= s["latency_p99_ms"] and s["itl_p50_ms"] > 0 and s["itl_samples"] > 0
    assert rep["held_after_soak"] == rep["held_after"] == {"live_slots": 0, "reserved": 0, "waiting": 0,
                                                            "nonzero_slot_lens": 0}
    solo = rep["solo"]
    assert solo["mode"] == "all" and solo["checked"] == solo["answered"] == s["answered"]
    assert solo["equal"] == solo["checked"] and solo["mismatches"] == []  # fp32 CPU: batch = alone exactly
    assert rep["memory_before"]["rss_mib"] > 0 and rep["engine"]["path"] == "batch-eager"


@pytest.mark.slow
def test_budget_guard_stops_sending_and_reports(soak_script, tmp_path):
    # far more requests than 20 s allow: sending stops at 10 s, the solo check samples, all within the budget
    rc, rep = _run(soak_script, tmp_path, "-n", 5000, "-c", 2, "--max-prompt", 64, "--max-out", 8, "--budget-s", 20)
    assert rc == 0 and rep["ok"], rep.get("traceback") or rep
    s = rep["soak"]
    assert s["stopped_sending_early"] and 0 < s["sent"] < 5000 and s["lost"] == 0 and s["engine_unaccounted"] == 0
    assert rep["solo"]["mode"] == "sample" and 0 < rep["solo"]["checked"] < rep["solo"]["answered"]
    assert "fixed-seed order" in rep["solo"]["how"] and rep["solo"]["equal"] == rep["solo"]["checked"]
    assert rep["total_s"] < 20 + 5 and not any(rep["held_after"].values())


def test_a_mismatch_is_reported_with_position_and_both_margins(soak_script):
    # (token, time, top1 id, top1, top2 id, top2): the runs agree on 2 tokens, then a near-tie flips
    batch = [(5, 0, 5, 1.0, 7, 0.5), (6, 0, 6, 2.0, 1, 1.0), (7, 0, 7, 0.30, 9, 0.29), (3, 0, 3, 1.0, 2, 0.0)]
    alone = [(5, 0, 5, 1.0, 7, 0.5), (6, 0, 6, 2.0, 1, 1.0), (9, 0, 9, 0.31, 7, 0.30), (4, 0, 4, 1.0, 2, 0.0)]
    d = soak_script.compare("r3", batch, alone)
    assert d["position"] == 2 and d["batch"]["token"] == 7 and d["solo"]["token"] == 9 and d["swap"] is True
    assert d["batch"]["margin"] == pytest.approx(0.01) and d["solo"]["margin"] == pytest.approx(0.01)
    assert soak_script.compare("r3", batch, batch) is None
    short = soak_script.compare("r4", batch, batch[:3])  # a prefix: the first missing position
    assert short["position"] == 3 and "solo" not in short and "swap" not in short


def test_a_failure_still_writes_the_report(soak_script, tmp_path):
    from lowbit.core.errors import LowbitError

    out = tmp_path / "soak.json"
    with pytest.raises(LowbitError, match="unknown geometry"):
        soak_script.main(["--out", str(out), "--geometry", "nope", "--device", "cpu"])
    rep = json.loads(out.read_text())
    assert "unknown geometry" in rep["error"] and "Traceback" in rep["traceback"] and rep["args"]["geometry"] == "nope"
