"""Shared parts of the server reliability tests (issue #22: test_fuzz, test_soak, test_capacity).

A real BackgroundServer on 127.0.0.1 port 0 over the tiny int4 runtime (page 1, small sink/ring, so
prompts of ~15+ tokens put tokens in the packed middle and a mix-up of caches would change the tokens),
plain-socket HTTP (http.client: a streamed request can be hung up after any event), the checks every
answer must pass (an OpenAI body, or an OpenAI error body), and the engine's idle state.

The numbers the tests measure go to results/reliability/serve_cpu.json through
scripts/serve_reliability.py (the tests themselves write nothing).
"""

from __future__ import annotations

import http.client
import json
import math
import time
from urllib.parse import urlparse

import pytest
import torch

from tests.serve.conftest import reference_greedy, tiny_runtime

KV = {"sink": 4, "recent": 8, "page": 1}
CHUNK = 7
MAX_CONTEXT = 96


def runtime():
    return tiny_runtime("int4", max_context=MAX_CONTEXT, **KV)


def start_server(rt, engine: str, **kw):
    """A BackgroundServer (its .engine) over rt with `engine` "single" | "batch"; start it with `with`."""
    from lowbit.serve.server import BackgroundServer, build

    kw.setdefault("max_active", 3)
    eng, app = build(rt, prefill_chunk=CHUNK, engine=engine, **kw)
    return BackgroundServer(eng, app)


def solo(rt, ids: list[int], max_tokens: int) -> str:
    """The greedy text of ids run alone (a fresh cache, the server's prefill chunking)."""
    return reference_greedy(rt, ids, max_tokens, chunk=CHUNK)[1]


def connect(url: str, timeout: float = 60) -> http.client.HTTPConnection:
    u = urlparse(url)
    return http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)


def post(url: str, path: str, body: bytes | dict, content_type: str = "application/json") -> tuple[int, bytes, dict]:
    """(status, raw body, headers) of one POST on a fresh connection."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    c = connect(url)
    try:
        c.request("POST", path, body=raw, headers={"content-type": content_type})
        r = c.getresponse()
        return r.status, r.read(), {k.lower(): v for k, v in r.getheaders()}
    finally:
        c.close()


def get_json(url: str, path: str) -> dict:
    c = connect(url)
    try:
        c.request("GET", path)
        return json.loads(c.getresponse().read())
    finally:
        c.close()


def stream(url: str, path: str, body: dict, hang_up_after: int | None = None) -> tuple[int, list, bool]:
    """POST a streamed request; (status, the parsed `data:` events, whether [DONE] came).
    hang_up_after=k: close the socket after k events (the client going away mid-stream).
    A non-200 answer returns ([its JSON body], False)."""
    c = connect(url)
    events: list = []
    done = False
    try:
        c.request("POST", path, body=json.dumps(body).encode(), headers={"content-type": "application/json"})
        r = c.getresponse()
        if r.status != 200:
            return r.status, [json.loads(r.read())], False
        assert r.getheader("content-type", "").startswith("text/event-stream"), r.getheaders()
        while hang_up_after is None or len(events) < hang_up_after:
            line = r.readline()
            if not line:
                break
            line = line.strip()
            if not line:
                continue
            assert line.startswith(b"data: "), line
            data = line[6:]
            if data == b"[DONE]":
                done = True
                break
            events.append(json.loads(data))
        return r.status, events, done
    finally:
        if c.sock is not None:
            c.sock.close()  # a hang-up: no more reads, the server sees the socket go
        c.close()


def is_openai_error(body) -> bool:
    """OpenAI's error body: {"error": {"message": str, "type": str, "param": str|None, "code": str|None}}."""
    if not isinstance(body, dict) or set(body) != {"error"} or not isinstance(body["error"], dict):
        return False
    e = body["error"]
    return (isinstance(e.get("message"), str) and e["message"] != "" and isinstance(e.get("type"), str)
            and set(e) == {"message", "type", "param", "code"}
            and all(e[k] is None or isinstance(e[k], str) for k in ("param", "code")))


def check_usage(u) -> None:
    assert isinstance(u, dict), u
    p, c, t = u["prompt_tokens"], u["completion_tokens"], u["total_tokens"]
    assert all(isinstance(x, int) for x in (p, c, t)) and p >= 1 and c >= 1 and t == p + c, u


def check_answer(kind: str, d: dict) -> str:
    """Asserts d is a valid non-streamed answer of `kind` ("completions" | "chat"); returns its text."""
    assert d["object"] == ("text_completion" if kind == "completions" else "chat.completion"), d
    assert isinstance(d["id"], str) and d["model"] == "tiny" and isinstance(d["created"], int), d
    (ch,) = d["choices"]
    assert ch["finish_reason"] in ("stop", "length"), ch
    check_usage(d["usage"])
    text = ch["text"] if kind == "completions" else ch["message"]["content"]
    assert isinstance(text, str), ch
    return text


def check_stream(kind: str, events: list, done: bool) -> str:
    """Asserts the events of a streamed answer are valid chunks (complete when done); returns the text."""
    obj = "text_completion" if kind == "completions" else "chat.completion.chunk"
    text, finish = [], None
    for ev in events:
        assert "error" not in ev, ev  # an error event mid-stream is a server failure
        assert ev["object"] == obj and ev["model"] == "tiny", ev
        if not ev["choices"]:  # the usage chunk
            check_usage(ev["usage"])
            continue
        (ch,) = ev["choices"]
        assert finish is None, "a chunk after the finish_reason"
        finish = ch["finish_reason"]
        piece = ch["text"] if kind == "completions" else ch["delta"].get("content")
        text.append(piece or "")
    if done:
        assert finish in ("stop", "length"), events[-2:]
    return "".join(text)


def idle(srv, timeout: float = 30.0) -> dict:
    """Waits until the engine holds nothing (no request active or queued; the single engine: no KV bytes or
    tokens; the batch engine: every slot free, nothing reserved); returns what was seen last."""
    eng = srv.engine
    deadline = time.time() + timeout
    while True:
        m = get_json(srv.url, "/metrics")
        state = {"active": m["kv"]["active_requests"], "queued": m["queue_depth"], "tokens": m["kv"]["tokens_held"]}
        if eng.path == "single":
            state["bytes"] = m["kv"]["bytes_held"]
            state["engine_active"] = len(eng._active) + eng._queue.qsize()
        else:
            state["busy_slots"] = sum(s is not None for s in eng._live) + int(eng.cache.lens.count_nonzero())
            state["reserved"] = eng._reserved
        if not any(state.values()) or time.time() > deadline:
            return state
        time.sleep(0.05)


def server_connections(srv) -> int:
    """TCP connections open on the server's port (this process holds both ends; count the server's)."""
    import psutil

    port = srv.sock.getsockname()[1]
    return sum(1 for c in psutil.Process().net_connections(kind="tcp")
               if c.laddr and c.laddr.port == port and c.status == psutil.CONN_ESTABLISHED)


def rss_mb() -> float:
    import gc

    import psutil

    gc.collect()
    return psutil.Process().memory_info().rss / 2**20


def percentile(xs: list[float], q: float) -> float:
    """The q-th percentile (0-100) of xs, nearest rank."""
    s = sorted(xs)
    k = max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))
    return s[k]


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Torch on one intra-op thread while a reliability module runs: on 2 shared cores, 2 threads per tiny
    forward spend most of their time waiting on each other (a 5-request solo reference: 15 s -> 0.6 s)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
