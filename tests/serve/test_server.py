"""A real uvicorn on an ephemeral loopback port, driven by the official `openai` client:
completions, streamed chat, 8 concurrent clients each getting exactly its own answer, errors, port in use."""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.serve.conftest import reference_greedy, tiny_runtime

openai = pytest.importorskip("openai")

PROMPTS = [f"Request number {i}: {'abc' * i} tell me {i * 7}" for i in range(8)]


def _raw(url: str, data: bytes | None = None) -> tuple[int, dict]:
    """(status, JSON body) of a plain HTTP request (POST when data is given)."""
    import json
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def int4_server():
    from lowbit.serve.server import BackgroundServer, build

    rt = tiny_runtime("int4", sink=16, recent=16)
    engine, app = build(rt, max_active=3, prefill_chunk=16)  # 8 clients > 3 active: some wait in the queue
    with BackgroundServer(engine, app) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        yield rt, srv, client


def test_openai_client_completion_and_streamed_chat(int4_server):
    rt, srv, client = int4_server
    assert srv.url.startswith("http://127.0.0.1:")
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    ids = rt.tokenizer.encode(PROMPTS[3])
    _, ref = reference_greedy(rt, ids, 10, chunk=16)
    c = client.completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=10, temperature=0)
    assert c.choices[0].text == ref
    msgs = [{"role": "user", "content": "Say something"}]
    ids = rt.tokenizer.encode(rt.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False),
                              add_special_tokens=False)
    _, ref = reference_greedy(rt, ids, 12, chunk=16)
    stream = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, temperature=0, stream=True)
    pieces, finish = [], None
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    assert "".join(pieces) == ref
    assert finish in ("length", "stop")


def test_eight_concurrent_clients_each_get_their_own_answer(int4_server):
    rt, _srv, client = int4_server
    refs = [reference_greedy(rt, rt.tokenizer.encode(p), 12, chunk=16)[1] for p in PROMPTS]
    assert len(set(refs)) >= 6, "the test model answers most prompts alike; the test would not see a mix-up"

    def ask(i):
        if i % 2:
            r = client.completions.create(model="tiny", prompt=PROMPTS[i], max_tokens=12, temperature=0)
            return r.choices[0].text
        s = client.completions.create(model="tiny", prompt=PROMPTS[i], max_tokens=12, temperature=0, stream=True)
        return "".join(c.choices[0].text for c in s)

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(ask, range(8)))
    assert got == refs


def test_openai_client_errors_then_still_serving(int4_server):
    _rt, srv, client = int4_server
    with pytest.raises(openai.NotFoundError, match="not found"):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="tiny", prompt="x", max_tokens=-1)
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model="tiny", prompt="y" * 400, max_tokens=2)
    status, body = _raw(srv.url + "/v1/chat/completions", b"{not json")
    assert status == 400 and "JSON" in body["error"]["message"]
    assert client.completions.create(model="tiny", prompt="fine", max_tokens=3, temperature=0).usage.completion_tokens >= 1
    m = _raw(srv.url + "/metrics")[1]
    assert m["kv_scheme"]["name"] == "int4" and m["client_errors"] >= 4


def test_port_in_use_is_a_clear_error():
    from lowbit.cli import main
    from lowbit.core.errors import LowbitError
    from lowbit.serve.server import bind

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    port = holder.getsockname()[1]
    try:
        with pytest.raises(LowbitError, match=f"port {port} on 127.0.0.1 is already in use"):
            bind("127.0.0.1", port)
        # the CLI binds before loading the model, so this fails fast and with exit code 2
        assert main(["serve", "--model", "smollm2-135m", "--port", str(port)]) == 2
    finally:
        holder.close()
    with pytest.raises(LowbitError, match="not a TCP port"):
        bind("127.0.0.1", 70000)


def test_client_gone_mid_stream_frees_its_request(int4_server):
    """A streaming client that hangs up: the worker drops the request (and its cache) and goes on."""
    import http.client
    import json
    import time
    from urllib.parse import urlparse

    _rt, srv, client = int4_server
    u = urlparse(srv.url)
    before = _raw(srv.url + "/metrics")[1]["finished"]["cancelled"]
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps({"model": "tiny", "prompt": "go on and on", "max_tokens": 200,
                                                             "temperature": 0, "stream": True}),
                 headers={"content-type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: ")
    conn.sock.close()  # hang up after the first event
    conn.close()
    t0 = time.time()
    while _raw(srv.url + "/metrics")[1]["finished"]["cancelled"] == before:
        assert time.time() - t0 < 60, "the abandoned request was not dropped"
        time.sleep(0.2)
    # the worker counts the cancel when it retires the request and refreshes the gauges at the end of
    # that round: wait for the round to end, then the server must be idle -- nothing active, nothing
    # queued, no cache memory held -- and have counted exactly this one cancel
    deadline = time.time() + 30
    while True:
        m = _raw(srv.url + "/metrics")[1]
        idle = (m["kv"]["active_requests"], m["queue_depth"], m["kv"]["bytes_held"], m["kv"]["tokens_held"])
        if idle == (0, 0, 0, 0) or time.time() > deadline:
            break
        time.sleep(0.2)
    assert idle == (0, 0, 0, 0), f"after the cancel: active, queued, bytes, tokens = {idle}"
    assert m["finished"]["cancelled"] == before + 1
    assert client.completions.create(model="tiny", prompt="still here", max_tokens=2, temperature=0).choices
