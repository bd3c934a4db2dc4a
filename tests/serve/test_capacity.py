"""Capacity exhaustion (issue #22): more concurrent long requests than the batching engine's KV slots hold.

SLOTS long requests take the slots; the REQUESTS - SLOTS sent while they run find every slot taken. With
--when-full wait they queue and are answered once a slot frees (each with its solo text); with reject they
get a 429 OpenAI error (Retry-After) at once. A request that can never fit a slot is a 400, whatever the
policy. Never a crash: the engine lives on, /health is 200, a later request is answered; the metrics' admission
block counts exactly the waits (and how long) and the refusals the clients saw.
"""

from __future__ import annotations

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.serve import reliability as rel
from tests.serve.conftest import tiny_runtime
from tests.serve.reliability import one_torch_thread  # noqa: F401 (autouse)

SLOTS, REQUESTS = 2, 7
PROMPT, MAX_TOKENS = 36, 32  # 68 of a slot's 96 tokens: long requests, each holding its slot 32+ steps


@pytest.fixture(scope="module")
def rt():
    # no EOS: every request runs its full max_tokens, so the first SLOTS still hold their slots when the rest come
    return tiny_runtime("int4", max_context=rel.MAX_CONTEXT, eos=(), **rel.KV)


def make_prompts(seed: int = 7) -> list[list[int]]:
    r = random.Random(seed)
    return [[r.randrange(3, 259) for _ in range(PROMPT)] for _ in range(REQUESTS)]


@pytest.fixture(scope="module")
def prompts():
    return make_prompts()


@pytest.fixture(scope="module")
def refs(rt, prompts):
    return [rel.solo(rt, p, MAX_TOKENS) for p in prompts]


def exhaust(srv, prompts: list[list[int]]) -> dict:
    """Sends SLOTS requests, and once they hold the slots the rest, all at once; the counts seen by the clients,
    the texts answered (None where refused) and the server's admission metrics."""
    eng = srv.engine

    def ask(ids):
        t0 = time.perf_counter()
        status, raw, headers = rel.post(srv.url, "/v1/completions", {"model": "tiny", "prompt": ids,
                                                                     "max_tokens": MAX_TOKENS, "temperature": 0})
        return status, json.loads(raw), headers, time.perf_counter() - t0

    with ThreadPoolExecutor(REQUESTS) as pool:
        first = [pool.submit(ask, p) for p in prompts[:SLOTS]]
        t0 = time.time()
        while eng._reserved < SLOTS:  # both submitted to the engine: the slots are taken
            assert time.time() - t0 < 30
            time.sleep(0.005)
        rest = [pool.submit(ask, p) for p in prompts[SLOTS:]]
        got = [f.result() for f in first + rest]
    texts, refused = [], 0
    for status, body, headers, _s in got:
        if status == 200:
            texts.append(rel.check_answer("completions", body))
        else:
            assert status == 429 and rel.is_openai_error(body), (status, body)
            assert body["error"]["code"] == "rate_limit_exceeded" and headers.get("retry-after") == "1"
            texts.append(None)
            refused += 1
    # one that can never fit a slot (60 + 50 > 96): a 400 naming the context, never an allocation
    status, raw, _ = rel.post(srv.url, "/v1/completions", {"model": "tiny", "prompt": [9] * 60, "max_tokens": 50})
    never = json.loads(raw)
    assert status == 400 and never["error"]["code"] == "context_length_exceeded", never
    state = rel.idle(srv)
    m = rel.get_json(srv.url, "/metrics")
    a = m["admission"]
    return {"policy": eng.when_full, "slots": SLOTS, "requests": REQUESTS, "texts": texts, "idle_after": state,
            "admitted": REQUESTS - refused - a["waited_total"], "waited": a["waited_total"], "refused": refused,
            "metrics_rejected": a["rejected_total"], "wait_seconds_total": a["wait_seconds_total"],
            "wait_seconds_max": a["wait_seconds_max"], "latency_max_s": round(max(g[3] for g in got), 3),
            "health": rel.get_json(srv.url, "/health")["status"], "finished": m["finished"]}


@pytest.mark.parametrize("policy", ["wait", "reject"])
def test_more_long_requests_than_slots(rt, prompts, refs, policy):
    with rel.start_server(rt, "batch", max_active=SLOTS, when_full=policy) as srv:
        r = exhaust(srv, prompts)
        later = rel.post(srv.url, "/v1/completions", {"model": "tiny", "prompt": prompts[-1], "max_tokens": MAX_TOKENS,
                                                      "temperature": 0})
        assert srv.engine.alive and r["health"] == "ok"
    assert later[0] == 200 and json.loads(later[1])["choices"][0]["text"] == refs[-1]  # the server serves on
    assert not any(r["idle_after"].values()), r["idle_after"]
    assert r["finished"]["error"] == 0
    answered = [(t, ref) for t, ref in zip(r["texts"], refs) if t is not None]
    assert all(t == ref for t, ref in answered)  # waiting (or a neighbour's refusal) changed no answer
    assert r["admitted"] == SLOTS
    if policy == "wait":
        assert r["refused"] == 0 and r["metrics_rejected"] == 0 and len(answered) == REQUESTS
        assert r["waited"] == REQUESTS - SLOTS  # every late request found the slots full, and is counted
        assert 0 < r["wait_seconds_max"] <= r["wait_seconds_total"] < r["latency_max_s"] * (REQUESTS - SLOTS)
    else:
        assert r["waited"] == 0 and r["wait_seconds_total"] == 0
        assert r["refused"] == r["metrics_rejected"] == REQUESTS - SLOTS and len(answered) == SLOTS
