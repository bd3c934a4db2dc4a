"""Shutdown and disconnects: SIGTERM drains (503 / a final stream event, one line, no traceback), and a
client that leaves a non-streamed request stops its work within one decode step."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from tests.serve.conftest import tiny_runtime

pytest.importorskip("uvicorn")


def _slow(rt, seconds: float = 0.02):
    """Make every model step (a forward of the single engine, a batched step of the batch engine) take at
    least `seconds`, and count them in calls[0]: a pre-hook on the first decoder layer, which both run."""
    calls = [0]

    def hook(module, args):
        calls[0] += 1
        time.sleep(seconds)

    rt.model.model.layers[0].register_forward_pre_hook(hook)
    return calls


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _stream(url: str, body: dict, lines: list[str]) -> None:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        for raw in r:
            if raw.strip():
                lines.append(raw.decode().strip())


def _wait(cond, timeout=20.0):
    t0 = time.time()
    while not cond():
        if time.time() - t0 > timeout:
            raise AssertionError("timed out")
        time.sleep(0.01)


@pytest.mark.parametrize("engine_kind", ["single", "batch"])
def test_shutdown_ends_in_flight_requests_with_503_and_a_final_stream_event(engine_kind):
    # SIGTERM with a request in flight gave the client HTTP 500 and the log two tracebacks
    from lowbit.serve.server import BackgroundServer, build

    rt = tiny_runtime("int4", sink=16, recent=16, max_context=4096, eos=())
    calls = _slow(rt)
    engine, app = build(rt, max_active=4, prefill_chunk=64, engine=engine_kind)
    srv = BackgroundServer(engine, app, grace=0.5).start()
    body = {"model": "tiny", "prompt": "a long answer please", "max_tokens": 3000, "temperature": 0}
    got, lines = {}, []
    t1 = threading.Thread(target=lambda: got.update(plain=_post(srv.url, body)))
    t2 = threading.Thread(target=_stream, args=(srv.url, body, lines))
    t1.start()
    t2.start()
    _wait(lambda: len(lines) >= 2 and calls[0] >= 8)  # both are generating
    t0 = time.time()
    srv.stop()
    t1.join(10)
    t2.join(10)
    assert time.time() - t0 < 8  # the 0.5 s grace, then ended: not the 3000 tokens
    status, answer = got["plain"]
    assert status == 503 and answer["error"]["code"] == "server_shutting_down"
    assert "shutting down" in answer["error"]["message"]
    final = json.loads(lines[-2].removeprefix("data: "))
    assert final["error"]["code"] == "server_shutting_down" and lines[-1] == "data: [DONE]"
    assert srv.drained["finished"] == 0 and srv.drained["ended"] == 2


def test_shutdown_lets_a_short_request_finish_within_the_grace():
    from lowbit.serve.server import BackgroundServer, build

    rt = tiny_runtime("bf16", max_context=4096, eos=())
    calls = _slow(rt, 0.05)
    engine, app = build(rt, max_active=2, prefill_chunk=64)
    srv = BackgroundServer(engine, app, grace=30).start()
    got = {}
    t = threading.Thread(target=lambda: got.update(r=_post(srv.url, {"model": "tiny", "prompt": "hi",
                                                                      "max_tokens": 20, "temperature": 0})))
    t.start()
    _wait(lambda: calls[0] >= 2)
    srv.stop()
    t.join(10)
    status, answer = got["r"]
    assert status == 200 and answer["usage"]["completion_tokens"] == 20  # finished, not cut
    assert srv.drained["finished"] == 1 and srv.drained["ended"] == 0


@pytest.mark.parametrize("engine_kind", ["single", "batch"])
def test_client_disconnect_stops_a_non_streamed_request_within_one_step(engine_kind):
    # a non-streamed request kept decoding after its client had gone (one logged 200 after 711 s)
    from lowbit.serve.server import BackgroundServer, build

    rt = tiny_runtime("int4", sink=16, recent=16, max_context=4096, eos=())
    calls = _slow(rt)
    engine, app = build(rt, max_active=2, prefill_chunk=64, engine=engine_kind)
    with BackgroundServer(engine, app) as srv:
        at_cancel = []
        from lowbit.serve import engine as eng

        real_cancel = eng.Request.cancel

        def cancel(self):
            if not self.cancelled:
                at_cancel.append(calls[0])
            real_cancel(self)

        eng.Request.cancel = cancel
        try:
            host, port = srv.url.removeprefix("http://").split(":")
            body = json.dumps({"model": "tiny", "prompt": "go on", "max_tokens": 3000, "temperature": 0}).encode()
            s = socket.create_connection((host, int(port)))
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            _wait(lambda: calls[0] >= 10)  # decoding
            s.close()
            _wait(lambda: at_cancel, 10)
            _wait(lambda: engine.metrics.snapshot()["finished"].get("cancelled", 0) == 1, 10)
            assert calls[0] - at_cancel[0] <= 1  # at most the step already running when the client left
        finally:
            eng.Request.cancel = real_cancel


def test_sigterm_to_lowbit_serve_is_one_line_and_a_503(tmp_path):
    from lowbit.models.tiny import tiny_model
    from tests.serve.conftest import byte_tokenizer

    model, _ = tiny_model("smollm2-135m", vocab_size=259)
    model.config.max_position_embeddings = 8192  # room for a request that is still generating at the SIGTERM
    d = tmp_path / "tiny"
    model.save_pretrained(d)
    byte_tokenizer().save_pretrained(d)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.Popen([sys.executable, "-m", "lowbit", "serve", "--model", str(d), "--port", str(port),
                             "--shutdown-grace", "0", "--no-request-log"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait(lambda: _health(url) or proc.poll() is not None, 120)
        assert proc.poll() is None, proc.stderr.read()
        got = {}
        t = threading.Thread(target=lambda: got.update(r=_post(url, {"model": "tiny", "prompt": "x",
                                                                     "max_tokens": 8000, "temperature": 0})))
        t.start()
        _wait(lambda: _active(url) >= 1, 30)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
        t.join(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143
    assert out.startswith("lowbit serve: tiny (float32 on cpu) | KV ")  # the banner names the dtype it runs
    assert got["r"][0] == 503 and got["r"][1]["error"]["code"] == "server_shutting_down"
    # stderr: transformers' weight-loading bar at start, then the one line of the shutdown
    lines = [x for x in err.splitlines() if x.strip() and not x.startswith("Loading weights")]
    assert "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith("lowbit serve: stopped on SIGTERM: 0 in-flight request(s) finished and 1 ended")


def _health(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _active(url: str) -> int:
    with urllib.request.urlopen(url + "/metrics?format=json", timeout=5) as r:
        snap = json.loads(r.read())
    return int(snap.get("kv", {}).get("active_requests", 0) or snap.get("active_requests", 0) or 0)
