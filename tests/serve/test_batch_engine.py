"""The continuous-batching engine on CPU (eager path) over the tiny model: concurrent greedy requests each get
exactly the tokens they get alone (at equal prefill chunking), requests join and leave mid-run, a cancel frees
its slot, admission waits or answers 429, a request over a slot's capacity gets 400, and the path is named."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from lowbit.core.errors import LowbitError
from lowbit.serve.engine import GenParams, Request
from tests.serve.conftest import reference_greedy, tiny_runtime

# int4 at page 1 (the static cache's granularity) with a small sink/ring, so prompts of ~40+ tokens put
# tokens in the packed middle: the reference QuantizedKVCache then holds the same codes
KV = {"sink": 4, "recent": 8, "page": 1}
CHUNK = 7


@pytest.fixture(scope="module")
def rt():
    return tiny_runtime("int4", max_context=96, **KV)


class Collect:
    """An emit callback that records the events of one request; .wait() until it ends."""

    def __init__(self, on_delta=None):
        self.events, self.ended, self.on_delta = [], threading.Event(), on_delta

    def __call__(self, kind, payload):
        self.events.append((kind, payload))
        if kind == "delta" and self.on_delta:
            self.on_delta(self)
        if kind != "delta":
            self.ended.set()

    def wait(self, timeout=60):
        assert self.ended.wait(timeout), "the request did not finish"
        return self

    @property
    def text(self):
        return "".join(p for k, p in self.events if k == "delta")

    @property
    def done(self):
        assert self.events[-1][0] == "done", self.events[-1]
        return self.events[-1][1]


def _engine(rt, **kw):
    from lowbit.serve.batch_engine import BatchEngine

    kw.setdefault("slots", 3)
    kw.setdefault("prefill_chunk", CHUNK)
    return BatchEngine(rt, **kw)


def _submit(engine, rt, prompt, max_tokens, **params):
    c = Collect(params.pop("on_delta", None))
    ids = rt.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
    req = engine.submit(Request(prompt_ids=ids, params=GenParams(max_tokens=max_tokens, **{"temperature": 0.0, **params}),
                                emit=c))
    return c, req


PROMPTS = ["a", "The quick brown fox jumps over the lazy dog", "12345 " * 9, "Zebra? " * 4, "xy" * 31]
MAX_TOKENS = [9, 5, 12, 1, 7]


def test_concurrent_greedy_requests_each_get_their_own_tokens(rt):
    refs = [reference_greedy(rt, rt.tokenizer.encode(p), m, chunk=CHUNK)[1] for p, m in zip(PROMPTS, MAX_TOKENS)]
    assert len(set(refs)) == len(refs), "the test model answers prompts alike; a mix-up would not show"
    engine = _engine(rt)  # 5 requests, 3 slots: two wait, then take the slots others leave
    engine.start()
    try:
        got = [_submit(engine, rt, p, m) for p, m in zip(PROMPTS, MAX_TOKENS)]
        for (c, _), ref, p, m in zip(got, refs, PROMPTS, MAX_TOKENS):
            c.wait()
            assert c.text == ref
            assert c.done["engine"] == "batch-eager"
            n = len(rt.tokenizer.encode(p))
            assert c.done["usage"]["prompt_tokens"] == n and c.done["usage"]["completion_tokens"] <= m
        # the 62-token prompt held 61 + 6 tokens at its end: 67 - sink 4 - ring 8 in the packed middle
        assert got[4][0].done["quantized_tokens"] == len(rt.tokenizer.encode(PROMPTS[4])) + 6 - 12
        snap = engine.metrics.snapshot()
        assert snap["tokens"]["generated_total"] == sum(c.done["usage"]["completion_tokens"] for c, _ in got)
        assert snap["tokens"]["prompt_total"] == sum(c.done["usage"]["prompt_tokens"] for c, _ in got)
        assert snap["admission"]["waited_total"] >= 2 and snap["admission"]["wait_seconds_max"] > 0
        assert snap["admission"]["slots"] == 3 and snap["engine"]["path"] == "eager"
    finally:
        engine.stop()
    assert engine.cache.lens.tolist() == [0, 0, 0]  # every slot freed


def test_a_late_long_request_joins_a_low_slot_while_others_decode(rt):
    """A short request in slot 0 ends, a long one decodes in slot 1; a late 60-token prompt takes slot 0 and is
    prefilled chunk by chunk between decode steps of slot 1 (whose steps ride over the prefilling slot)."""
    late = "late comer " * 6
    ref_long = reference_greedy(rt, rt.tokenizer.encode(PROMPTS[2]), 30, chunk=CHUNK)[1]
    ref_late = reference_greedy(rt, rt.tokenizer.encode(late), 6, chunk=CHUNK)[1]
    engine = _engine(rt, slots=2)
    engine.start()
    try:
        short, _ = _submit(engine, rt, "hi", 2)
        joined = {}

        def join_once(c):  # on the long request's 5th token: the short one has left slot 0
            if len(c.events) == 5 and "c" not in joined:
                joined["c"] = _submit(engine, rt, late, 6)[0]

        long_, _ = _submit(engine, rt, PROMPTS[2], 30, on_delta=join_once)
        short.wait()
        long_.wait()
        joined["c"].wait()
        assert long_.text == ref_long
        assert joined["c"].text == ref_late
        assert short.done["usage"]["completion_tokens"] == 2
    finally:
        engine.stop()


def test_cancel_frees_the_slot_for_a_waiting_request(rt):
    engine = _engine(rt, slots=1)
    engine.start()
    try:
        a, ra = _submit(engine, rt, "cancel me please", 60)
        b, _ = _submit(engine, rt, PROMPTS[1], 5)  # waits: the one slot is taken
        t0 = time.time()
        while len(a.events) < 2:
            assert time.time() - t0 < 30
            time.sleep(0.01)
        ra.cancel()
        b.wait()
        assert b.text == reference_greedy(rt, rt.tokenizer.encode(PROMPTS[1]), 5, chunk=CHUNK)[1]
        assert not a.ended.is_set()  # a cancelled request gets no done event
        snap = engine.metrics.snapshot()
        assert snap["finished"]["cancelled"] == 1 and snap["admission"]["waited_total"] == 1
    finally:
        engine.stop()


def test_sampling_is_per_request_and_seeded(rt):
    """A sampled request with a seed draws the same tokens alone and beside greedy neighbours."""
    engine = _engine(rt)
    engine.start()
    try:
        alone, _ = _submit(engine, rt, PROMPTS[1], 8, temperature=1.3, top_p=0.9, seed=7)
        alone.wait()
        g1, _ = _submit(engine, rt, PROMPTS[2], 8)
        mixed, _ = _submit(engine, rt, PROMPTS[1], 8, temperature=1.3, top_p=0.9, seed=7)
        g2, _ = _submit(engine, rt, PROMPTS[3], 8)
        for c in (g1, mixed, g2):
            c.wait()
        assert mixed.text == alone.text
        assert g1.text == reference_greedy(rt, rt.tokenizer.encode(PROMPTS[2]), 8, chunk=CHUNK)[1]
        other, _ = _submit(engine, rt, PROMPTS[1], 8, temperature=1.3, top_p=0.9, seed=8)
        assert other.wait().text != alone.text
    finally:
        engine.stop()


def test_bad_input_is_named(rt):
    from lowbit.serve.batch_engine import AdmissionError, BatchEngine, buckets_for

    with pytest.raises(LowbitError, match="CUDA graph capture needs the model on CUDA"):
        BatchEngine(rt, slots=2, mode="graphs")
    with pytest.raises(LowbitError, match="decode path 'fast' unknown"):
        BatchEngine(rt, slots=2, mode="fast")
    with pytest.raises(LowbitError, match="--when-full 'drop' unknown"):
        BatchEngine(rt, slots=2, when_full="drop")
    engine = _engine(rt, slots=1)
    with pytest.raises(AdmissionError, match="needs 101 tokens of KV .* a slot holds 96") as e:
        _submit(engine, rt, [5] * 91, 10)
    assert e.value.status == 400
    assert buckets_for(1) == (1,) and buckets_for(6) == (1, 2, 4, 6) and buckets_for(8) == (1, 2, 4, 8)


def test_a_family_without_a_step_names_the_ones_that_have_one(rt):
    from lowbit.serve.batch_engine import BatchEngine

    model = rt.model
    old = model.config.model_type
    try:
        model.config.model_type = "gpt2"
        with pytest.raises(LowbitError, match="model type 'gpt2' has no runtime step; families with one: .*llama"):
            BatchEngine(rt, slots=1)
    finally:
        model.config.model_type = old


def _raw(url: str, body: dict | None = None) -> tuple[int, dict, dict]:
    """(status, JSON body, headers) of a plain HTTP request (POST when body is given)."""
    import json
    import urllib.error
    import urllib.request

    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


class Gate:
    """Holds the only slot: a request whose first event blocks the worker until open()."""

    def __init__(self, engine):
        self.gate, self.seen, self.ended = threading.Event(), threading.Event(), threading.Event()
        self.req = engine.submit(Request(prompt_ids=[40, 41, 42], params=GenParams(max_tokens=20, temperature=0.0),
                                         emit=self))

    def __call__(self, kind, payload):
        self.seen.set()
        if kind != "delta":
            self.ended.set()
        self.gate.wait(30)

    def open(self):
        """Let the worker go on; returns once the gate request has ended (its slot is free)."""
        self.gate.set()
        assert self.ended.wait(30)


@pytest.fixture(scope="module")
def http(rt):
    """Factory of started BackgroundServers over the batching engine (stopped at the end)."""
    from lowbit.serve.server import BackgroundServer, build

    servers = []

    def make(**kw):
        engine, app = build(rt, prefill_chunk=CHUNK, engine="batch", **kw)
        srv = BackgroundServer(engine, app).start()
        servers.append(srv)
        return engine, srv.url

    yield make
    for srv in servers:
        srv.stop()


def test_http_reject_when_full_is_429(rt, http):
    engine, url = http(max_active=1, when_full="reject")
    card = _raw(url + "/v1/models")[1]["data"][0]["lowbit"]
    assert card["engine"]["engine"] == "batch" and card["engine"]["path"] == "eager"
    assert card["kv_scheme"]["cache"] == "StaticKVCache" and card["kv_scheme"]["page"] == 1
    gate = Gate(engine)
    try:
        status, body, headers = _raw(url + "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2})
        assert status == 429
        err = body["error"]
        assert err["code"] == "rate_limit_exceeded" and err["type"] == "requests"
        assert "all 1 KV slots are busy" in err["message"] and headers.get("retry-after") == "1"
    finally:
        gate.open()
    status, body, _ = _raw(url + "/v1/completions", {"model": "tiny", "prompt": [7] * 90, "max_tokens": 7})
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"
    status, d, _ = _raw(url + "/v1/completions", {"model": "tiny", "prompt": "now free", "max_tokens": 3,
                                                  "temperature": 0})
    assert status == 200 and d["lowbit"]["engine"] == "batch-eager"
    m = _raw(url + "/metrics")[1]
    assert m["admission"]["rejected_total"] == 1 and m["engine"]["when_full"] == "reject"
    assert m["admission"]["waited_total"] == 0 and m["client_errors"] >= 2
    text = _raw_text(url + "/metrics?format=prometheus")
    assert 'lowbit_engine_info{engine="batch",path="eager"} 1' in text
    assert "lowbit_requests_rejected_total 1" in text and "lowbit_slots 1" in text


def _raw_text(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=60) as r:
        return r.read().decode()


def test_http_wait_when_full_queues_then_answers(rt, http):
    from concurrent.futures import ThreadPoolExecutor

    engine, url = http(max_active=1, when_full="wait")
    prompts = PROMPTS[1:3]
    refs = [reference_greedy(rt, rt.tokenizer.encode(p), 6, chunk=CHUNK)[1] for p in prompts]

    def ask(p):
        status, d, _ = _raw(url + "/v1/completions", {"model": "tiny", "prompt": p, "max_tokens": 6, "temperature": 0})
        assert status == 200, d
        return d["choices"][0]["text"]

    gate = Gate(engine)
    assert gate.seen.wait(30)  # the worker is inside the gate request: the slot is taken
    with ThreadPoolExecutor(2) as pool:
        futs = [pool.submit(ask, p) for p in prompts]
        t0 = time.time()
        while engine._reserved < 3:  # both HTTP requests submitted (and waiting)
            assert time.time() - t0 < 30
            time.sleep(0.01)
        gate.open()
        got = [f.result() for f in futs]
    assert got == refs
    m = _raw(url + "/metrics")[1]
    assert m["admission"]["waited_total"] == 2 and m["admission"]["wait_seconds_max"] > 0
    assert m["admission"]["wait_seconds_total"] >= m["admission"]["wait_seconds_max"]
    assert m["kv"]["bytes_held"] == engine.cache.bytes_held() > 0
    text = _raw_text(url + "/metrics?format=prometheus")
    assert "lowbit_requests_waited_total 2" in text and "lowbit_request_wait_seconds_max " in text


def test_build_picks_the_engine(rt):
    from lowbit.serve.server import build

    engine, _ = build(rt, max_active=2)  # CPU: the per-request engine unless asked
    assert engine.path == "single" and engine.metrics.snapshot()["engine"]["engine"] == "single"
    with pytest.raises(LowbitError, match="--decode-path graphs needs the batching engine"):
        build(rt, engine="single", decode_path="graphs")
    with pytest.raises(LowbitError, match="CUDA graph capture needs the model on CUDA"):
        build(rt, engine="batch", decode_path="graphs")
    with pytest.raises(LowbitError, match="--engine 'turbo' unknown"):
        build(rt, engine="turbo")


def test_events_equal_the_single_engines(rt):
    """EOS, stop strings and max_tokens end requests as in the per-request engine: the same deltas, the same
    done payloads (but the engine named), for requests run concurrently in both."""
    from lowbit.serve.server import build

    bf = tiny_runtime("bf16", max_context=96)
    toks = [reference_greedy(bf, bf.tokenizer.encode(p), 12)[0] for p in PROMPTS[1:4]]
    eos_rt = tiny_runtime("bf16", max_context=96, eos=(2, toks[0][4]))  # request 0 ends on its 5th token
    text1 = reference_greedy(bf, bf.tokenizer.encode(PROMPTS[2]), 12)[1]
    stop = text1[5:7]  # request 1 ends at a stop string in the middle of its text
    assert len(stop) == 2 and text1.find(stop) == 5
    asks = [(PROMPTS[1], 12, {}), (PROMPTS[2], 12, {"stop": [stop, "never"]}), (PROMPTS[3], 3, {})]
    runs = {}
    for kind in ("single", "batch"):
        engine, _ = build(eos_rt, max_active=2, prefill_chunk=5, engine=kind)
        engine.start()
        try:
            cs = [_submit(engine, eos_rt, p, m, **kw)[0] for p, m, kw in asks]
            runs[kind] = [c.wait().events for c in cs]
        finally:
            engine.stop()
    single, batch = runs["single"], runs["batch"]
    assert [e[-1][1]["engine"] for e in batch] == ["batch-eager"] * 3
    for s, b in zip(single, batch):
        assert b[:-1] == s[:-1]
        assert {**b[-1][1], "engine": "single"} == s[-1][1]
    assert [e[-1][1]["finish_reason"] for e in batch] == ["stop", "stop", "length"]
    assert batch[0][-1][1]["usage"]["completion_tokens"] == 5
    assert "".join(p for k, p in batch[1] if k == "delta") == text1[:5]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the captured path needs CUDA")
def test_graphs_path_gives_the_eager_paths_tokens_on_cuda():
    """On a GPU: the engine captured at start (buckets up to its slots) streams the same greedy tokens as the
    same engine stepping eagerly, with requests joining and leaving; steps queued ahead (pinned token copies and
    events) give the tokens of the same engine without; every engine names its path."""
    from lowbit.serve.batch_engine import BatchEngine

    g_rt = tiny_runtime("int4", max_context=96, **KV)
    g_rt.model.to("cuda")
    texts = {}
    # (1) graphs vs eager at the same widths (buckets 1, 2, 3 = the live prefix); (2) decode-ahead vs not, both
    # batch-invariant: a step queued ahead keeps the width of the step before (where a row just ended), so only at
    # one fixed width do the two run the same GEMM shapes (cuBLAS's result can change with M, and this random
    # model's near-ties then flip: PROMPTS[1] does between widths on the H200)
    for mode, ahead, inv in (("eager", False, False), ("graphs", False, False), ("graphs", True, True),
                             ("graphs", False, True)):
        engine = BatchEngine(g_rt, slots=3, prefill_chunk=CHUNK, mode=mode, decode_ahead=ahead, batch_invariant=inv)
        assert engine.info["buckets"] == (([3] if inv else [1, 2, 3]) if mode == "graphs" else None)
        assert engine.info["decode_ahead"] is ahead
        spy = _AheadSpy(engine)
        engine.start()
        try:
            cs = [_submit(engine, g_rt, p, m)[0] for p, m in zip(PROMPTS, MAX_TOKENS)]
            texts[mode, ahead, inv] = [c.wait().text for c in cs]
            assert {c.done["engine"] for c in cs} == {f"batch-{mode}"}
        finally:
            engine.stop()
        assert (spy.ahead > 0) is engine.info["decode_ahead"]
    assert texts["graphs", False, False] == texts["eager", False, False]
    assert texts["graphs", True, True] == texts["graphs", False, True]


class EagerGraphs:
    """DecodeGraphs' interface run eagerly on CPU: the engine's host side of the captured path (ids and
    active written for the whole bucket, the step's argmax read back from ids) without a GPU."""

    def __init__(self, step, cache, buckets):
        self.step, self.cache, self.buckets = step, cache, sorted(buckets)
        B = self.buckets[-1]
        self.ids = torch.zeros(B, 1, dtype=torch.long)
        self.active = torch.zeros(B, dtype=torch.bool)
        self.logits = None
        self.widths = []

    def bucket_for(self, batch):
        return next(b for b in self.buckets if b >= batch)

    def replay(self, batch):
        from lowbit.runtime.step import eager_decode

        b = self.bucket_for(batch)
        self.widths.append((batch, b))
        lg = eager_decode(self.step, self.cache, self.ids[:b], self.active[:b])
        self.logits = torch.cat([lg, torch.zeros(self.buckets[-1] - b, lg.shape[-1])])
        self.ids[:b, 0] = torch.where(self.active[:b], lg.argmax(-1), self.ids[:b, 0])
        return b


def test_the_captured_paths_host_side_on_cpu(rt):
    """With a bucket wider than the live prefix (buckets 1 and 3 over 3 slots), padding rows ride along
    inactive; greedy and sampled rows come out as on the eager path."""
    engine = _engine(rt, slots=3)
    engine.graphs = EagerGraphs(engine.step, engine.cache, (1, 3))
    refs = [reference_greedy(rt, rt.tokenizer.encode(p), m, chunk=CHUNK)[1] for p, m in zip(PROMPTS, MAX_TOKENS)]
    engine.start()
    try:
        cs = [_submit(engine, rt, p, m)[0] for p, m in zip(PROMPTS, MAX_TOKENS)]
        assert [c.wait().text for c in cs] == refs
        sampled, _ = _submit(engine, rt, PROMPTS[1], 8, temperature=1.3, top_p=0.9, seed=7)
        greedy, _ = _submit(engine, rt, PROMPTS[2], 8)
        sampled.wait(), greedy.wait()
    finally:
        engine.stop()
    assert (2, 3) in engine.graphs.widths and (1, 1) in engine.graphs.widths
    assert greedy.text == reference_greedy(rt, rt.tokenizer.encode(PROMPTS[2]), 8, chunk=CHUNK)[1]
    eager = _engine(rt, slots=3)
    eager.start()
    try:
        alone, _ = _submit(eager, rt, PROMPTS[1], 8, temperature=1.3, top_p=0.9, seed=7)
        assert alone.wait().text == sampled.text
    finally:
        eager.stop()


@pytest.mark.parametrize("invariant", [False, True])
def test_batch_invariant_runs_every_step_at_full_width(rt, monkeypatch, invariant):
    # batch_invariant: the step's width (and so every kernel's shape) never depends on the load; the
    # default shrinks the step to the live prefix. Tokens equal the single-request reference either way.
    import lowbit.serve.batch_engine as be

    widths = []
    real = be.eager_decode

    def spy(step, cache, ids, active):
        widths.append(int(ids.shape[0]))
        return real(step, cache, ids, active)

    monkeypatch.setattr(be, "eager_decode", spy)
    ref = reference_greedy(rt, rt.tokenizer.encode(PROMPTS[1]), 6, chunk=CHUNK)[1]
    engine = _engine(rt, batch_invariant=invariant)
    assert engine.info["batch_invariant"] is invariant
    engine.start()
    try:
        c, _ = _submit(engine, rt, PROMPTS[1], 6)
        assert c.wait().text == ref
    finally:
        engine.stop()
    assert widths and set(widths) == ({3} if invariant else {1})


def test_batch_invariant_needs_the_batching_engine(rt):
    from lowbit.serve.server import build

    with pytest.raises(LowbitError, match="--batch-invariant needs the batching engine"):
        build(rt, engine="single", batch_invariant=True)


def test_compile_needs_the_captured_path_on_cuda(rt):
    from lowbit.serve.server import build

    with pytest.raises(LowbitError, match="--compile needs the batching engine"):
        build(rt, engine="single", compile=True)
    with pytest.raises(LowbitError, match="--compile compiles the captured decode step: it needs the graphs"):
        build(rt, engine="batch", decode_path="eager", compile=True)
    with pytest.raises(LowbitError, match="--compile compiles the captured decode step: it needs the graphs"):
        build(rt, engine="batch", decode_path="eager", compile="layers")
    with pytest.raises(LowbitError, match="--compile 'all' unknown; use one of whole, layers"):
        build(rt, engine="batch", decode_path="eager", compile="all")
    engine, _ = build(rt, engine="batch", decode_path="eager")
    assert engine.info["compiled"] is False and engine.info["fused_projections"] == 0  # eager on CPU: unfused
    assert engine.info["compile_regions"] is None


def test_serve_compile_flag_parses_to_regions():
    """`--compile` alone is the one-graph compile, `--compile layers` the per-layer regions; others are refused."""
    import argparse

    from lowbit.commands import serve as cmd

    p = argparse.ArgumentParser()
    cmd.add_arguments(p)
    assert p.parse_args(["m", "--compile"]).compile == "whole"
    assert p.parse_args(["m", "--compile", "layers"]).compile == "layers"
    assert p.parse_args(["m"]).compile is None
    with pytest.raises(SystemExit):
        p.parse_args(["m", "--compile", "all"])


class _AheadSpy:
    """Counts the engine's steps queued ahead and the rows whose ahead token was dropped (retired since)."""

    def __init__(self, engine):
        self.ahead = self.dropped = 0
        launch_again, read = engine._launch_again, engine._read

        def spy_launch_again(cur):
            self.ahead += 1
            return launch_again(cur)

        def spy_read(cur):
            self.dropped += sum(engine._live[s.slot] is not s for s in cur.rows)
            return read(cur)

        engine._launch_again, engine._read = spy_launch_again, spy_read


@pytest.mark.parametrize("ahead", [True, False])
@pytest.mark.parametrize("path", ["eager", "captured-host"])
def test_decode_ahead_gives_the_same_tokens(rt, path, ahead):
    """With steps queued ahead (each fed the step before's argmax on the device) and without, requests that join,
    end mid-run (their ahead token dropped) and wait for slots get the single-request reference's tokens; the
    slots all end free. captured-host: the captured path's host side (EagerGraphs, buckets 1 and 3)."""
    refs = [reference_greedy(rt, rt.tokenizer.encode(p), m, chunk=CHUNK)[1] for p, m in zip(PROMPTS, MAX_TOKENS)]
    engine = _engine(rt, decode_ahead=ahead)
    if path == "captured-host":
        engine.graphs = EagerGraphs(engine.step, engine.cache, (1, 3))
    assert engine.info["decode_ahead"] is ahead
    spy = _AheadSpy(engine)
    # all submitted before the worker starts: its schedule (and so whether a row ends with a step queued past its
    # end) does not depend on this thread's timing
    cs = [_submit(engine, rt, p, m)[0] for p, m in zip(PROMPTS, MAX_TOKENS)]
    engine.start()
    try:
        assert [c.wait().text for c in cs] == refs
        snap = engine.metrics.snapshot()
        assert snap["tokens"]["generated_total"] == sum(c.done["usage"]["completion_tokens"] for c in cs)
        t0 = time.time()  # the last row's "done" went out before the worker read the step queued past its end
        while engine._ahead is not None and time.time() - t0 < 30:
            time.sleep(0.01)
    finally:
        engine.stop()
    # with it: it ran ahead, and rows ended with a step queued past their end; without: never
    assert ((spy.ahead > 0 and spy.dropped > 0) if ahead else (spy.ahead == 0 and spy.dropped == 0)), (spy.ahead, spy.dropped)
    assert engine.cache.lens.tolist() == [0, 0, 0]


def test_decode_ahead_with_a_late_prompt_and_a_cancel(rt):
    """A prompt fed chunk by chunk beside a decoding request stops the run-ahead (its ring rows need the
    guard) and the decode row keeps its reference tokens; a cancel while a step is queued frees the slot."""
    late = "late comer " * 6
    ref_long = reference_greedy(rt, rt.tokenizer.encode(PROMPTS[2]), 30, chunk=CHUNK)[1]
    ref_late = reference_greedy(rt, rt.tokenizer.encode(late), 6, chunk=CHUNK)[1]
    engine = _engine(rt, slots=2, decode_ahead=True)
    spy = _AheadSpy(engine)
    engine.start()
    try:
        joined = {}

        def join_once(c):
            if len(c.events) == 5 and "c" not in joined:
                joined["c"] = _submit(engine, rt, late, 6)[0]

        long_, _ = _submit(engine, rt, PROMPTS[2], 30, on_delta=join_once)
        assert long_.wait().text == ref_long
        assert joined["c"].wait().text == ref_late
        a, ra = _submit(engine, rt, "cancel me please", 60)
        t0 = time.time()
        while len(a.events) < 3:
            assert time.time() - t0 < 30
            time.sleep(0.01)
        ra.cancel()
        b, _ = _submit(engine, rt, PROMPTS[1], 5)
        assert b.wait().text == reference_greedy(rt, rt.tokenizer.encode(PROMPTS[1]), 5, chunk=CHUNK)[1]
        assert engine.metrics.snapshot()["finished"]["cancelled"] == 1
    finally:
        engine.stop()
    assert spy.ahead > 0
    assert engine.cache.lens.tolist() == [0, 0]


def test_sampled_requests_never_run_ahead(rt):
    """A sampled row needs the step's logits on the host before the next step: no step is queued ahead, and
    the seeded draws equal those of an engine without decode-ahead."""
    texts = []
    for ahead in (True, False):
        engine = _engine(rt, decode_ahead=ahead)
        spy = _AheadSpy(engine)
        engine.start()
        try:
            c, _ = _submit(engine, rt, PROMPTS[1], 8, temperature=1.3, top_p=0.9, seed=7)
            texts.append(c.wait().text)
        finally:
            engine.stop()
        assert spy.ahead == 0
    assert texts[0] == texts[1]


def test_decode_ahead_default_flag_and_the_single_engine(rt):
    """Decode-ahead is the batching engine's default (its captured-path token test passed on an H200 in s21);
    --no-decode-ahead turns it off; the single engine has no such mode and refuses it when asked by name."""
    import argparse

    from lowbit.commands import serve as cmd
    from lowbit.serve.server import build

    assert _engine(rt).info["decode_ahead"] is True
    assert _engine(rt, decode_ahead=False).info["decode_ahead"] is False
    p = argparse.ArgumentParser()
    cmd.add_arguments(p)
    assert p.parse_args(["m"]).decode_ahead is None
    assert p.parse_args(["m", "--decode-ahead"]).decode_ahead is True
    assert p.parse_args(["m", "--no-decode-ahead"]).decode_ahead is False
    engine, _ = build(rt, engine="batch", max_active=2)
    assert engine.info["decode_ahead"] is True
    engine, _ = build(rt, engine="batch", max_active=2, decode_ahead=False)
    assert engine.info["decode_ahead"] is False
    build(rt, engine="single")  # None: nothing to turn on
    with pytest.raises(LowbitError, match="--decode-ahead is a mode of the batching engine; use --engine batch"):
        build(rt, engine="single", decode_ahead=True)


def _logits_of(engine, rid):
    """Wrap engine.step: {(phase, position): logits row} of request `rid` (prefill chunks' last rows and its
    decode rows; not the inactive rows a step writes while it is in its prompt)."""
    got, real = {}, engine.step

    def step(ids, pos, cache, **kw):
        out = real(ids, pos, cache, **kw)
        if cache._mode[0] == "prefill":
            s = engine._live[cache._mode[1]]
            if s.req.id == rid:
                got["prefill", int(pos[0, -1])] = out[0].clone()
        else:
            for s in engine._live[:ids.shape[0]]:
                if s is not None and s.req.id == rid and s.tok is not None:
                    got["decode", int(pos[s.slot, 0])] = out[s.slot].clone()
        return out

    engine.step = step
    return got


def _schedule(engine, rt, gaps, with_a=True):
    """Drive the engine's steps from this thread: request "A" decodes, then "B" (62 tokens: 9 chunks, 49 of them
    reaching the packed middle) is fed with gaps(i) decode steps of A before its chunk i. -> B's logits."""
    got = _logits_of(engine, "B")
    if with_a:
        _submit(engine, rt, "a", 40)[1].id = "A"
        engine._take_incoming(False), engine._admit()
        engine._prefill_one()
        engine._decode()
    b, rb = _submit(engine, rt, PROMPTS[4], 7)
    rb.id = "B"
    engine._take_incoming(False), engine._admit()
    i = 0
    while any(s is not None for s in engine._live):
        sb = next((s for s in engine._live if s is not None and s.req.id == "B"), None)
        if sb is not None and sb.tok is None:
            for _ in range(gaps(i)):
                engine._decode()
            engine._prefill_one()
            i += 1
        engine._decode()
    return got, b.text


def test_batch_invariant_logits_do_not_depend_on_the_interleaving(rt):
    """Batch-invariant (every step at full width): a prompt fed chunk by chunk between 0, 1, 2 or a varying
    number of decode steps of another request, with or without decode-ahead, gets bit for bit the logits it
    gets alone (the inactive writes at its position `fed` are undone by _guard / rewritten by the next chunk)."""
    import random

    alone, text = _schedule(_engine(rt, batch_invariant=True, decode_ahead=False), rt, lambda i: 0, with_a=False)
    assert len(alone) == 9 + 6
    r = random.Random(0)
    for ahead, gaps in ((False, lambda i: 0), (False, lambda i: 2), (True, lambda i: 1),
                        (True, lambda i: r.randint(0, 3))):
        got, t = _schedule(_engine(rt, batch_invariant=True, decode_ahead=ahead), rt, gaps)
        # decode-ahead: one step more ran for B past its end (position 68), its token dropped
        assert t == text and set(got) - set(alone) == ({("decode", 68)} if ahead else set()) and alone.keys() <= got.keys()
        assert all(torch.equal(got[k], alone[k]) for k in alone), ahead


def test_engines_over_one_model_fold_its_value_rotation_once(monkeypatch):
    """A captured-path engine folds V's rotation into the model's weights for good; a later engine over the same
    model (captured: the GPU test's four engines share one) takes that fold instead of rotating V again (twice R
    is the identity for the Hadamard rotation: V went into the packed middle unrotated and tokens differed).
    On CPU the captured engines' fold is forced onto eager engines: every engine gives bit for bit the same logits."""
    import lowbit.runtime.fold as fo

    frt = tiny_runtime("int4", max_context=96, **KV)  # its weights are folded here: not the module's runtime
    v = frt.model.model.layers[0].self_attn.v_proj.weight
    real = fo.fold_value_rotation_once
    monkeypatch.setattr(fo, "fold_value_rotation_once", lambda model, cache, fold: real(model, cache, fold=True))
    runs = []
    for k in range(3):
        if k == 2:
            monkeypatch.setattr(fo, "fold_value_rotation_once", real)  # a plain eager engine over the folded model
        engine = _engine(frt, batch_invariant=True)
        assert all(layer.rot_v is None for layer in engine.cache.layers)
        assert engine.info["folded_value_rotation"] == (2 if k < 2 else 0)
        runs.append(_schedule(engine, frt, lambda i: 0, with_a=False))
        if k == 0:
            folded = v.detach().clone()
    assert torch.equal(v, folded)  # folded once
    for got, text in runs[1:]:
        assert text == runs[0][1] and got.keys() == runs[0][0].keys()
        assert all(torch.equal(got[k], runs[0][0][k]) for k in got)


def test_the_eager_cpu_step_decodes_only_the_rows_held(monkeypatch):
    # the CPU step decoded every middle row of max_context each step (the fixed shape CUDA graphs need):
    # `serve --engine batch` ran ~10-20x slower than --engine single on smollm2-135m int2
    from lowbit.kv.codec import TensorCodec

    big = tiny_runtime("int4", max_context=2048, **KV)
    rows = []
    real = TensorCodec.decode

    def spy(self, fields, *a, **kw):
        rows.append(max(x.shape[2] for x in fields.values() if x.dim() >= 3))
        return real(self, fields, *a, **kw)

    monkeypatch.setattr(TensorCodec, "decode", spy)
    engine = _engine(big, slots=2)
    engine.start()
    try:
        c, _ = _submit(engine, big, PROMPTS[1], 6)
        c.wait()
    finally:
        engine.stop()
    n = len(big.tokenizer.encode(PROMPTS[1])) + 6
    assert rows and max(rows) <= n  # not the 2048 - 12 rows of the slot's capacity
    _, ref = reference_greedy(big, big.tokenizer.encode(PROMPTS[1]), 6, chunk=CHUNK)
    assert c.text == ref  # the same tokens as the eager QuantizedKVCache
