"""The OpenAI-compatible app over a tiny random model: results equal the model's own greedy tokens,
streaming equals non-streaming, parameters are honoured, bad requests get 4xx and the server goes on."""

from __future__ import annotations

import json

import pytest

from tests.serve.conftest import reference_greedy, tiny_runtime

PROMPT = "The quick brown fox jumps over the lazy dog, 17 times; é!"


def _complete(client, **body):
    body = {"model": "tiny", **body}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _sse(resp) -> list:
    """Events of an SSE response: JSON bodies, then the literal '[DONE]'."""
    out = []
    for line in resp.text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
        else:
            assert line == "", f"unexpected SSE line {line!r}"
    return out


def test_models_reports_the_scheme_served(bf16_server):
    _rt, _engine, client = bf16_server
    d = client.get("/v1/models").json()
    assert [m["id"] for m in d["data"]] == ["tiny"]
    card = d["data"][0]
    assert card["max_model_len"] == 256
    assert card["lowbit"]["kv_scheme"]["name"] == "bf16"
    assert card["lowbit"]["kv_scheme"]["quantized"] is False
    assert client.get("/v1/models/tiny").json()["id"] == "tiny"
    assert client.get("/v1/models/nope").status_code == 404
    assert client.get("/health").json()["status"] == "ok"


def test_completion_equals_the_models_greedy_tokens(bf16_server):
    rt, _engine, client = bf16_server
    ids = rt.tokenizer.encode(PROMPT)
    ref_ids, ref_text = reference_greedy(rt, ids, 13)
    d = _complete(client, prompt=PROMPT, max_tokens=13, temperature=0)
    assert d["object"] == "text_completion"
    assert d["choices"][0]["text"] == ref_text
    assert d["usage"] == {"prompt_tokens": len(ids), "completion_tokens": len(ref_ids) + (len(ref_ids) < 13),
                          "total_tokens": len(ids) + len(ref_ids) + (len(ref_ids) < 13)}
    assert d["choices"][0]["finish_reason"] == ("length" if len(ref_ids) == 13 else "stop")
    assert d["system_fingerprint"].endswith("kv-bf16")
    # token ids as the prompt give the same answer
    d2 = _complete(client, prompt=ids, max_tokens=13, temperature=0)
    assert d2["choices"][0]["text"] == ref_text


def test_streaming_equals_non_streaming(bf16_server):
    _rt, _engine, client = bf16_server
    full = _complete(client, prompt=PROMPT, max_tokens=9, temperature=0)
    with client.stream("POST", "/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 9,
                                                        "temperature": 0, "stream": True,
                                                        "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        r.read()
        events = _sse(r)
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"] == full["usage"]
    chunks = events[:-2]
    assert chunks[-1]["choices"][0]["finish_reason"] == full["choices"][0]["finish_reason"]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert "".join(c["choices"][0]["text"] for c in chunks) == full["choices"][0]["text"]


def test_chat_uses_the_template_and_streams(bf16_server):
    rt, _engine, client = bf16_server
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    text = rt.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    ids = rt.tokenizer.encode(text, add_special_tokens=False)
    _, ref_text = reference_greedy(rt, ids, 11)
    r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": msgs, "max_tokens": 11,
                                                  "temperature": 0})
    d = r.json()
    assert d["object"] == "chat.completion"
    assert d["choices"][0]["message"] == {"role": "assistant", "content": ref_text}
    assert d["usage"]["prompt_tokens"] == len(ids)
    r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": msgs, "max_tokens": 11,
                                                  "temperature": 0, "stream": True})
    events = _sse(r)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[-1] == "[DONE]"
    assert all(e["object"] == "chat.completion.chunk" for e in events[:-1])
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1]) == ref_text


def test_stop_strings_cut_before_the_stop(bf16_server):
    _rt, _engine, client = bf16_server
    full = _complete(client, prompt=PROMPT, max_tokens=20, temperature=0)["choices"][0]["text"]
    assert len(full) >= 6
    stop = full[3:5]  # a 2-character stop that first occurs at or before offset 3
    cut = full.find(stop)
    d = _complete(client, prompt=PROMPT, max_tokens=20, temperature=0, stop=[stop, "\x00never"])
    assert d["choices"][0]["text"] == full[:cut]
    assert d["choices"][0]["finish_reason"] == "stop"
    # the same through the stream: the held-back text never leaks the stop string
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 20, "temperature": 0,
                                             "stop": stop, "stream": True})
    assert "".join(e["choices"][0]["text"] for e in _sse(r)[:-1]) == full[:cut]


def test_seed_makes_sampling_repeatable(bf16_server):
    _rt, _engine, client = bf16_server
    a = _complete(client, prompt=PROMPT, max_tokens=12, temperature=1.3, seed=5)["choices"][0]["text"]
    b = _complete(client, prompt=PROMPT, max_tokens=12, temperature=1.3, seed=5)["choices"][0]["text"]
    others = {_complete(client, prompt=PROMPT, max_tokens=12, temperature=1.3, seed=s)["choices"][0]["text"]
              for s in (6, 7, 8)}
    assert a == b
    assert others - {a}, "three other seeds all sampled the same text as seed 5"
    # top_p this small keeps only the most likely token: sampling becomes greedy
    greedy = _complete(client, prompt=PROMPT, max_tokens=12, temperature=0)["choices"][0]["text"]
    assert _complete(client, prompt=PROMPT, max_tokens=12, temperature=1.0, top_p=1e-6, seed=3)["choices"][0]["text"] == greedy


@pytest.mark.parametrize(
    "body,status,needle",
    [
        ({"model": "other", "prompt": "x"}, 404, "not found"),
        ({"model": "tiny", "prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
        ({"model": "tiny", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": "tiny", "prompt": "x" * 300}, 400, "context is 256 tokens"),
        ({"model": "tiny", "prompt": "x" * 250, "max_tokens": 7}, 400, "context is 256 tokens"),
        ({"model": "tiny", "prompt": ""}, 400, "empty"),
        ({"model": "tiny", "prompt": [5, 999]}, 400, "outside the vocabulary"),
        ({"model": "tiny", "prompt": ["a", "b"]}, 400, "one prompt per request"),
        ({"model": "tiny", "prompt": "x", "n": 2}, 400, "n > 1"),
        ({"model": "tiny", "prompt": "x", "temperature": -1}, 400, "temperature"),
        ({"model": "tiny", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "at most 4"),
        ({"prompt": "x"}, 400, "model"),
    ],
)
def test_bad_completion_requests_get_4xx(bf16_server, body, status, needle):
    _rt, _engine, client = bf16_server
    r = client.post("/v1/completions", json=body)
    assert r.status_code == status, r.text
    msg = r.json()["error"]["message"]
    assert needle in msg, msg


def test_malformed_json_and_bad_chat_then_still_serving(bf16_server):
    _rt, engine, client = bf16_server
    before = engine.metrics.snapshot()["client_errors"]
    r = client.post("/v1/completions", content=b'{"model": "tiny", "prompt": ', headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": []})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]})
    assert r.status_code == 400
    r = client.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 300,
                                                  "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert engine.metrics.snapshot()["client_errors"] == before + 4
    # and the server keeps serving
    assert _complete(client, prompt="ok", max_tokens=2, temperature=0)["usage"]["prompt_tokens"] == 2


def test_metrics_count_tokens(bf16_server):
    _rt, _engine, client = bf16_server
    before = client.get("/metrics").json()
    d = _complete(client, prompt=PROMPT, max_tokens=5, temperature=0)
    after = client.get("/metrics").json()
    n = d["usage"]["completion_tokens"]
    assert after["tokens"]["generated_total"] - before["tokens"]["generated_total"] == n
    assert after["tokens"]["prompt_total"] - before["tokens"]["prompt_total"] == d["usage"]["prompt_tokens"]
    assert after["requests"]["completions"] == before["requests"]["completions"] + 1
    assert after["tokens"]["per_s_busy"] > 0
    assert after["kv_scheme"]["name"] == "bf16"
    assert after["kv"]["peak_bytes_held"] > 0
    text = client.get("/metrics", params={"format": "prometheus"}).text
    assert 'lowbit_kv_scheme_info{scheme="bf16"' in text and "lowbit_generated_tokens_total" in text


def test_int2_server_really_quantizes():
    """int2 with sink 16 / recent 32: a 90-token prompt leaves >= 32 tokens in the packed middle tier,
    the answer equals the int2 cache's own greedy tokens, and /v1/models + /metrics say int2."""
    from fastapi.testclient import TestClient

    from lowbit.serve.server import build

    rt = tiny_runtime("int2", sink=16, recent=32)
    engine, app = build(rt, max_active=2, prefill_chunk=32)
    prompt = (PROMPT + " ") * 2  # ~118 byte tokens
    ids = rt.tokenizer.encode(prompt)
    _ref_ids, ref_text = reference_greedy(rt, ids, 8, chunk=32)
    engine.start()
    try:
        with TestClient(app) as client:
            card = client.get("/v1/models").json()["data"][0]["lowbit"]["kv_scheme"]
            assert card["name"] == "int2" and card["quantized"] and card["k_bits"] == 2 and card["v_bits"] == 2
            assert card["cache"] == "QuantizedKVCache"
            d = _complete(client, prompt=prompt, max_tokens=8, temperature=0)
            assert d["choices"][0]["text"] == ref_text
            q = d["lowbit"]["quantized_tokens"]
            assert q >= len(ids) - 16 - 32 - 16 and q % 16 == 0, q
            m = client.get("/metrics").json()
            assert m["kv_scheme"]["name"] == "int2"
            assert m["kv"]["quantized_tokens_total_finished"] == q
    finally:
        engine.stop()
