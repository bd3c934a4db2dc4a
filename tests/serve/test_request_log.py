"""`lowbit serve` logs one line per /v1 request; /metrics speaks Prometheus text to scrapers."""

from __future__ import annotations

import io
import logging
import re

import pytest

from lowbit.serve.app import enable_request_log, request_log


@pytest.fixture
def log_lines():
    buf = io.StringIO()
    handlers, level, prop = list(request_log.handlers), request_log.level, request_log.propagate
    enable_request_log(buf)
    yield lambda: buf.getvalue().splitlines()
    request_log.handlers[:] = handlers
    request_log.setLevel(level)
    request_log.propagate = prop


def test_one_line_per_request(bf16_server, log_lines):
    _rt, _engine, client = bf16_server
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "abc", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200
    with client.stream("POST", "/v1/chat/completions", json={"model": "tiny", "stream": True, "max_tokens": 2,
                                                             "messages": [{"role": "user", "content": "hi"}]}) as s:
        s.read()
    assert client.post("/v1/completions", json={"model": "nope", "prompt": "x"}).status_code == 404
    client.get("/v1/models")
    client.get("/metrics")  # not logged
    client.get("/health")  # not logged
    lines = log_lines()
    assert len(lines) == 4, lines
    rid = r.json()["id"]
    u = r.json()["usage"]
    assert re.search(rf"POST /v1/completions 200 \| {rid} \| {u['prompt_tokens']} prompt \+ "
                     rf"{u['completion_tokens']} completion tokens \(\w+\), 0 quantized \| \d+\.\d\d s$", lines[0])
    assert re.search(r"POST /v1/chat/completions 200 \| chatcmpl-\S+ \| \d+ prompt \+ \d+ completion tokens .* s stream$",
                     lines[1])
    assert "POST /v1/completions 404" in lines[2] and "model 'nope' not found" in lines[2]
    assert "GET /v1/models 200" in lines[3]


def test_no_log_lines_unless_enabled(bf16_server, caplog):
    _rt, _engine, client = bf16_server
    with caplog.at_level(logging.WARNING):
        client.post("/v1/completions", json={"model": "tiny", "prompt": "abc", "max_tokens": 1})
    assert not [r for r in caplog.records if r.name == "lowbit.serve.requests"]


@pytest.mark.parametrize("accept,prom", [
    ("application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5,*/*;q=0.1", True),  # Prometheus
    ("text/plain", True), ("*/*", False), (None, False), ("application/json", False),
])
def test_metrics_content_negotiation(bf16_server, accept, prom):
    _rt, _engine, client = bf16_server
    r = client.get("/metrics", headers={"accept": accept} if accept else {})
    assert r.status_code == 200
    if prom:
        assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
        assert "# TYPE lowbit_generated_tokens_total counter" in r.text
    else:
        assert r.json()["model"] == "tiny"
    # ?format wins over the header
    assert client.get("/metrics", params={"format": "json"}, headers={"accept": "text/plain"}).json()["model"] == "tiny"


def test_prometheus_text_is_well_formed(bf16_server):
    _rt, _engine, client = bf16_server
    text = client.get("/metrics", params={"format": "prometheus"}).text
    sample = re.compile(r'^[a-z_]+(\{[a-z_]+="[^"]*"(,[a-z_]+="[^"]*")*\})? -?[0-9.e+-]+$')
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            assert kind in ("counter", "gauge")
            assert (kind == "counter") == name.endswith("_total")
            names.add(name)
        elif not line.startswith("# HELP "):
            assert sample.match(line), line
            assert line.split("{")[0].split()[0] in names  # TYPE comes before its samples
    assert 'lowbit_kv_scheme_info{scheme="bf16",cache=' in text
