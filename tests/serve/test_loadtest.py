"""scripts/loadtest.py against a tiny in-process server: bounded, loopback only, JSON with the levels."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tests.serve.conftest import tiny_runtime

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "loadtest.py"


def _loadtest():
    spec = importlib.util.spec_from_file_location("loadtest", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_loadtest_records_levels(tmp_path):
    from lowbit.serve.server import BackgroundServer, build

    lt = _loadtest()
    engine, app = build(tiny_runtime("bf16"), max_active=2, prefill_chunk=64)
    out = tmp_path / "r.json"
    with BackgroundServer(engine, app) as srv:
        rc = lt.main(["--url", srv.url, "--concurrency", "1,3", "--min-requests", "2", "--max-tokens", "3",
                      "--prompt-chars", "30", "--out", str(out)])
    assert rc == 0
    d = json.loads(out.read_text())
    assert [lv["concurrency"] for lv in d["levels"]] == [1, 3]
    for lv in d["levels"]:
        assert lv["ok"] == lv["requests"] == max(2, lv["concurrency"]) and lv["errors"] == 0
        assert lv["requests_per_s"] > 0 and lv["latency_s"]["p50"] <= lv["latency_s"]["p95"] <= lv["latency_s"]["max"]
    assert d["levels"][-1]["server_metrics"]["requests"]["completions"] == 1 + 2 + 3  # warm-up + both levels
    assert d["server"]["card"]["lowbit"]["kv_scheme"]["name"] == "bf16"


def test_loadtest_refuses_non_loopback():
    lt = _loadtest()
    with pytest.raises(SystemExit, match="not a loopback address"):
        lt._loopback("http://10.1.2.3:8000")
    assert lt._loopback("http://127.0.0.5:1") and lt._loopback("http://[::1]:80")
