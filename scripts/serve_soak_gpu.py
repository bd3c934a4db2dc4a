"""GPU serving soak: N requests at C concurrent streams through the in-process BatchEngine.

    python scripts/serve_soak_gpu.py --out results/reliability/serve_gpu_soak_NVIDIA_H200.json
        defaults: --geometry llama3-8b --device cuda --kv int2 -n 1000 -c 32 --budget-s 450
    CPU smoke (tests/serve/test_soak_gpu_script.py): --geometry tiny-llama --device cpu -n 12 -c 4

What it does, in one process (no HTTP, no fastapi: the engine `lowbit serve --engine batch` runs):
  1. a random-weight model of the geometry (lowbit.tools.bench.runtime.build_model), a word tokenizer, a
     BatchEngine with C slots (CUDA graphs on CUDA, eager on CPU), wrapped so that every token it makes is
     recorded with its time and the step's top-2 logits (the margin top1 - top2, float32 logits);
  2. the soak: N requests (fixed seed) with log-uniform prompt lengths in [--min-prompt, --max-prompt] and
     uniform output lengths in [--min-out, --max-out], greedy, at most C in flight (the next one is sent when
     one ends); a --hangup fraction of them hang up (request.cancel(), what the HTTP side does when a client
     goes away) after a fixed-seed number of streamed deltas (0: right after sending);
  3. the solo check: answered requests run again alone on the same engine (batch 1), in a fixed-seed order,
     all of them if they fit in --solo-budget-s, else the prefix that fits (the report says which);
     each output is compared with its soak output token for token. A mismatch is recorded with the first
     differing position, both tokens and both runs' top-2 logits there: batch vs solo on the GPU can
     legitimately differ through bf16 rounding at different batch sizes, which shows as a near-tie (each
     run's second choice is the other's token, margin small);
  4. the counts (sent, answered, hung up, errors, lost = sent and never ended), the engine's own finish
     counts, latency / TTFT / inter-token latency p50/p99 of the answered, GPU memory before/after, and
     what the engine holds after (live slots, reserved, queued, non-zero slot lengths: all must be 0).

Budget (--budget-s, from the start of the script): sending stops at --send-frac of it (default 50%; the
report says how many were sent), stragglers are waited for until --send-frac + 10%, the solo check ends by the budget minus min(10 s, 10%).
The JSON is written to --out also when something fails (with the error), so one device call always brings
numbers back. Times: latency = submit to "done"; TTFT = submit to the first token; ITL = between consecutive
tokens of a request, stamped on the engine's worker thread when each token is made (in-process: no network).
On the H200 at ~9 ms per batch-1 step the solo check costs ~0.3 s per request (prefill + up to 64 steps), so
~700 of ~900 answered fit in the default 240 s: a fixed-seed sample, said so in `solo.mode` / `solo.how`.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import sys
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
try:
    import lowbit  # noqa: F401
except ImportError:  # a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT / "src"))


def plan(n: int, seed: int, prompt: tuple[int, int], out: tuple[int, int], hangup: float, vocab: int) -> list[dict]:
    """N request specs: {id, ids, max_tokens, hang_after (None: stays; k: hangs up after k deltas)}."""
    g = random.Random(seed)
    lo, hi = math.log(prompt[0]), math.log(prompt[1])
    reqs = []
    for i in range(n):
        L = min(prompt[1], max(prompt[0], round(math.exp(g.uniform(lo, hi)))))
        m = g.randint(*out)
        hang = g.randint(0, m - 1) if g.random() < hangup else None
        reqs.append({"id": f"r{i}", "ids": [g.randrange(vocab) for _ in range(L)], "max_tokens": m,
                     "hang_after": hang})
    return reqs


def _top2(logits):
    """logits [n, V] -> per row (top1 id, top1 logit, top2 id, top2 logit), on the host."""
    v, i = logits.float().topk(2, dim=-1)
    return [(a, x, b, y) for (a, b), (x, y) in zip(i.cpu().tolist(), v.cpu().tolist())]


def tracing_engine(runtime, **kw):
    """A BatchEngine that records, per request id, every token it makes: (token, time, top1 id, top1 logit,
    top2 id, top2 logit) in `engine.trace[id]` (recorded before the token is streamed, so complete at "done")."""
    from lowbit.serve.batch_engine import BatchEngine

    class TracingEngine(BatchEngine):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.trace: dict[str, list] = {}
            self._row = None  # top-2 of the logits _emit_token is handed (a prefill's last chunk)
            self._top = None  # top-2 per slot of the decode step whose tokens are being read
            self._tops: dict[int, list] = {}  # id(launched step) -> its top-2 per slot, taken when it ran
            if self.graphs is None:
                step = self.step

                def traced_step(*a, **k):
                    out = step(*a, **k)
                    if out.dim() == 2:
                        self._top = _top2(out)
                    return out

                self.step = traced_step

        def _run(self, cur, ids=None):
            # taken right after the step runs: with decode-ahead the next step runs before this one is read
            super()._run(cur, ids)
            self._tops[id(cur)] = _top2(self.graphs.logits[:cur.n]) if self.graphs is not None else self._top

        def _read(self, cur):
            self._top = self._tops.pop(id(cur))
            super()._read(cur)

        def _emit_token(self, s, logits):
            self._row = _top2(logits[None])[0]
            try:
                super()._emit_token(s, logits)
            finally:
                self._row = None

        def _finish_token(self, s, tok):
            top = self._row if self._row is not None else self._top[s.slot]
            self.trace.setdefault(s.req.id, []).append((int(tok), time.perf_counter(), *top))
            super()._finish_token(s, tok)

    return TracingEngine(runtime, **kw)


def pct(xs, q):
    xs = sorted(xs)
    return 1e3 * xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


def memory(device) -> dict:
    import torch

    out = {}
    if device.type == "cuda":
        torch.cuda.synchronize()
        out.update(gpu_allocated_mib=torch.cuda.memory_allocated() / 2**20,
                   gpu_reserved_mib=torch.cuda.memory_reserved() / 2**20,
                   gpu_max_allocated_mib=torch.cuda.max_memory_allocated() / 2**20)
    try:
        with open("/proc/self/statm") as f:
            out["rss_mib"] = int(f.read().split()[1]) * 4096 / 2**20
    except OSError:
        pass
    return out


def held(engine) -> dict:
    """What the engine holds (all 0 when idle)."""
    return {"live_slots": sum(s is not None for s in engine._live), "reserved": engine._reserved,
            "waiting": len(engine._waiting) + engine._incoming.qsize(),
            "nonzero_slot_lens": int((engine.cache.lens != 0).sum())}


def wait_idle(engine, deadline: float) -> bool:
    """Until the engine holds nothing (host-side state first: the device's lens only once that is clear)."""
    while time.perf_counter() < deadline:
        host = (any(s is not None for s in engine._live) or engine._reserved or engine._waiting
                or engine._incoming.qsize())
        if not host and not any(held(engine).values()):
            return True
        time.sleep(0.01)
    return False


def held_ids(engine) -> set[str]:
    """Ids of the requests the engine holds now (live in a slot, waiting, or not yet taken in)."""
    live = {s.req.id for s in list(engine._live) if s is not None}
    return live | {r.id for r in list(engine._waiting)} | {r.id for r in list(engine._incoming.queue)}


def soak(engine, reqs, C: int, send_deadline: float, drain_deadline: float) -> dict:
    """Send reqs with at most C in flight until send_deadline; wait for stragglers until drain_deadline.

    A request still unended at drain_deadline is "lost" if the engine no longer holds it (it was dropped
    without a done/error), else "cut_at_deadline": the client gives up on it (cancel, as a timeout would),
    which only says the budget was too short for the load."""
    from lowbit.serve.engine import GenParams, Request

    sem = threading.Semaphore(C)
    lock = threading.Lock()
    st: dict[str, dict] = {}

    def close(rid, how, payload=None):
        with lock:
            s = st[rid]
            if s["end"] is not None:
                return
            s["end"], s["t_end"], s["payload"] = how, time.perf_counter(), payload
        sem.release()

    def make_emit(spec):
        rid = spec["id"]

        def emit(kind, payload):
            s = st[rid]
            if kind == "delta":
                s["deltas"] += 1
                if spec["hang_after"] is not None and s["deltas"] >= spec["hang_after"] and s["end"] is None:
                    s["req"].cancel()
                    close(rid, "hung_up")
            elif kind == "done":
                close(rid, "answered", payload)
            elif kind == "error":
                close(rid, "error", payload)
        return emit

    sent, stopped_early = 0, False
    for spec in reqs:
        got = False
        while not got and time.perf_counter() <= send_deadline:
            got = sem.acquire(timeout=0.2)  # a stream free: send the next request
        if not got:
            stopped_early = True
            break
        req = Request(prompt_ids=spec["ids"], params=GenParams(max_tokens=spec["max_tokens"], temperature=0.0),
                      emit=make_emit(spec), id=spec["id"])
        st[spec["id"]] = {"req": req, "t_submit": time.perf_counter(), "end": None, "t_end": None, "deltas": 0,
                          "payload": None}
        engine.submit(req)
        sent += 1
        if spec["hang_after"] == 0:  # hangs up before anything comes back (queued or in its prompt)
            req.cancel()
            close(spec["id"], "hung_up")
    while time.perf_counter() < drain_deadline:
        with lock:
            if all(s["end"] is not None for s in st.values()):
                break
        time.sleep(0.01)
    late = [rid for rid, s in st.items() if s["end"] is None]
    if late:
        holding = held_ids(engine)
        for rid in late:
            if rid in holding:
                st[rid]["req"].cancel()
                close(rid, "cut_at_deadline")
    return {"sent": sent, "stopped_sending_early": stopped_early, "state": st}


def solo(engine, spec, timeout: float) -> list | None:
    """spec run alone on the engine (nothing else in flight): its trace, or None if it did not end in time."""
    from lowbit.serve.engine import GenParams, Request

    done = threading.Event()
    rid = "solo-" + spec["id"]
    ended = {}

    def emit(kind, payload):
        if kind in ("done", "error"):
            ended["kind"] = kind
            done.set()

    engine.submit(Request(prompt_ids=spec["ids"], params=GenParams(max_tokens=spec["max_tokens"], temperature=0.0),
                          emit=emit, id=rid))
    if not done.wait(timeout) or ended.get("kind") != "done":
        return None
    return engine.trace.pop(rid, [])


def compare(rid: str, batch: list, alone: list) -> dict | None:
    """None when the token lists are equal; else the first differing position and both runs' top-2 there."""
    a, b = [t[0] for t in batch], [t[0] for t in alone]
    if a == b:
        return None
    j = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    out = {"id": rid, "position": j, "batch_len": len(a), "solo_len": len(b)}
    for name, tr in (("batch", batch), ("solo", alone)):
        if j < len(tr):
            tok, _, i1, v1, i2, v2 = tr[j]
            out[name] = {"token": tok, "top1": [i1, v1], "top2": [i2, v2], "margin": v1 - v2}
    if "batch" in out and "solo" in out:
        # a near-tie flipped: each run's second choice is the other's pick
        out["swap"] = out["batch"]["top2"][0] == out["solo"]["token"] and out["solo"]["top2"][0] == out["batch"]["token"]
    return out


def run(args, rep: dict) -> dict:
    """Fills `rep` as it goes (what main writes, also after a failure)."""
    import torch

    from lowbit.models.geometry import ModelGeometry
    from lowbit.kv.scheme import parse_kv_scheme
    from lowbit.models.random import GEOMETRIES, word_tokenizer as _word_tokenizer, build_model
    from lowbit.serve.loader import Runtime

    t0 = time.perf_counter()
    budget_end = t0 + args.budget_s
    rep.update({"what": "GPU serving soak (issue #22): in-process BatchEngine, random-weight model, greedy",
                "args": vars(args), "date": time.strftime("%Y-%m-%d %H:%M:%S"), "python": platform.python_version(),
                "torch": torch.__version__})
    import transformers

    rep["transformers"] = transformers.__version__
    device = torch.device(args.device)
    if device.type == "cuda":
        rep["gpu"] = torch.cuda.get_device_name()
    if device.type == "cpu":
        torch.set_num_threads(args.threads)  # main() restores the caller's count
    model, cfg = build_model(args.geometry, args.device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    max_context = args.max_prompt + args.max_out + 16
    rt = Runtime(model=model, tokenizer=_word_tokenizer(cfg.vocab_size),
                 geometry=ModelGeometry.from_config(cfg, name=args.geometry), name=args.geometry,
                 scheme=parse_kv_scheme(args.kv), weights=None, max_context=max_context, eos_token_ids=[])
    engine = tracing_engine(rt, slots=args.concurrency, prefill_chunk=args.prefill_chunk,
                            when_full="wait", batch_invariant=args.batch_invariant)
    engine.start()
    try:
        rep["engine"] = {"path": engine.path, "slots": engine.slots, "max_context": max_context,
                         "kv": args.kv, "scheme": engine.scheme.describe(), "info": engine.info,
                         "kv_cache_mib": engine._bytes / 2**20, "layers": cfg.num_hidden_layers,
                         "geometry": GEOMETRIES[args.geometry]}
        rep["startup_s"] = time.perf_counter() - t0
        reqs = plan(args.n, args.seed, (args.min_prompt, args.max_prompt), (args.min_out, args.max_out), args.hangup,
                    cfg.vocab_size)
        rep["plan"] = {"n": len(reqs), "prompt_tokens_total": sum(len(r["ids"]) for r in reqs),
                       "max_tokens_total": sum(r["max_tokens"] for r in reqs),
                       "hang_ups_planned": sum(r["hang_after"] is not None for r in reqs)}
        print(f"engine {engine.path}, {args.concurrency} slots, startup {rep['startup_s']:.1f} s; "
              f"{len(reqs)} requests planned", flush=True)
        # warm-up (not counted): the longest prompt once, so first-use allocations (prefill workspaces, cuBLAS
        # handles) are in memory_before and the soak's before/after compares like with like
        warm = solo(engine, {"id": "warmup", "ids": reqs[0]["ids"][:1] * args.max_prompt, "max_tokens": 2},
                    timeout=120)
        if warm is None:
            raise RuntimeError("the warm-up request did not finish in 120 s")
        wait_idle(engine, time.perf_counter() + 10)
        fin0 = engine.metrics.snapshot()["finished"]
        rep["memory_before"] = memory(device)

        t_soak = time.perf_counter()
        res = soak(engine, reqs, args.concurrency, send_deadline=t0 + args.send_frac * args.budget_s,
                   drain_deadline=t0 + (args.send_frac + 0.1) * args.budget_s)
        idle = wait_idle(engine, time.perf_counter() + 10)
        rep["soak_s"] = time.perf_counter() - t_soak
        rep["memory_after_soak"] = memory(device)
        rep["held_after_soak"] = held(engine)
        st = res["state"]
        by = {k: [rid for rid, s in st.items() if s["end"] == k]
              for k in ("answered", "hung_up", "error", "cut_at_deadline")}
        lost = [rid for rid, s in st.items() if s["end"] is None]
        specs = {r["id"]: r for r in reqs}
        short = [rid for rid in by["answered"]
                 if len(engine.trace.get(rid, [])) != specs[rid]["max_tokens"]]  # greedy, no EOS: all max_tokens
        lat = [st[r]["t_end"] - st[r]["t_submit"] for r in by["answered"]]
        ttft = [engine.trace[r][0][1] - st[r]["t_submit"] for r in by["answered"] if engine.trace.get(r)]
        itl = [b[1] - a[1] for r in by["answered"] for a, b in zip(engine.trace[r], engine.trace[r][1:])]
        fin = {k: v - fin0.get(k, 0) for k, v in engine.metrics.snapshot()["finished"].items()}  # the soak's own
        rep["soak"] = {
            "sent": res["sent"], "answered": len(by["answered"]), "hung_up": len(by["hung_up"]),
            "errors": len(by["error"]), "lost": len(lost), "lost_ids": lost[:20],
            "cut_at_deadline": len(by["cut_at_deadline"]),  # still running at the drain deadline: cancelled
            "error_messages": sorted({str(st[r]["payload"]) for r in by["error"]})[:5],
            "answered_short": len(short), "stopped_sending_early": res["stopped_sending_early"],
            "engine_idle_after": idle, "engine_finished": fin,
            "engine_unaccounted": res["sent"] - sum(fin.values()),
            "tokens_out": sum(len(engine.trace.get(r, [])) for r in st),
            # tokens the answered requests held in the packed (quantized) tier at their end: the int tiers were used
            "quantized_tokens_answered": sum(int(st[r]["payload"].get("quantized_tokens", 0)) for r in by["answered"]),
            "latency_p50_ms": pct(lat, 0.5), "latency_p99_ms": pct(lat, 0.99),
            "ttft_p50_ms": pct(ttft, 0.5), "ttft_p99_ms": pct(ttft, 0.99),
            "itl_p50_ms": pct(itl, 0.5), "itl_p99_ms": pct(itl, 0.99), "itl_samples": len(itl)}
        s = rep["soak"]
        print(f"soak {rep['soak_s']:.1f} s: sent {s['sent']} answered {s['answered']} hung up {s['hung_up']} "
              f"errors {s['errors']} lost {s['lost']} cut at deadline {s['cut_at_deadline']}; latency p50/p99 {s['latency_p50_ms']}/{s['latency_p99_ms']} ms, "
              f"ITL p50/p99 {s['itl_p50_ms']}/{s['itl_p99_ms']} ms; held {rep['held_after_soak']}", flush=True)

        # the solo check: answered requests alone, fixed-seed order, until the solo budget is spent
        order = sorted(by["answered"], key=lambda r: int(r[1:]))
        random.Random(args.seed + 1).shuffle(order)
        t_solo = time.perf_counter()
        solo_end = min(t_solo + args.solo_budget_s, budget_end - min(10.0, 0.1 * args.budget_s))
        checked, equal, mismatches, failed = 0, 0, [], []
        alone_ok = idle  # a solo run is alone only on an idle engine
        for rid in order if alone_ok else []:
            if time.perf_counter() > solo_end:
                break
            alone = solo(engine, specs[rid], timeout=max(5.0, solo_end - time.perf_counter() + 30))
            if alone is None:
                failed.append(rid)
                continue
            checked += 1
            d = compare(rid, engine.trace[rid], alone)
            if d is None:
                equal += 1
            else:
                mismatches.append(d)
        idle2 = wait_idle(engine, time.perf_counter() + 10)
        margins = [m["solo"]["margin"] for m in mismatches if "solo" in m]
        rep["solo"] = {
            "mode": "skipped" if not alone_ok else "all" if checked == len(order) else "sample",
            "how": ("not run: the engine was not idle after the soak, so nothing would run alone" if not alone_ok
                    else "every answered request" if checked == len(order) else
                    f"the first {checked} of the answered requests in a fixed-seed order (seed {args.seed + 1}): "
                    f"the solo budget ({args.solo_budget_s:g} s, ending by the --budget-s) ran out"),
            "answered": len(order), "checked": checked, "equal": equal, "mismatched": len(mismatches),
            "solo_failed": failed[:20], "swaps": sum(bool(m.get("swap")) for m in mismatches),
            "mismatch_solo_margin_max": max(margins) if margins else None,
            "mismatch_solo_margin_p50": sorted(margins)[len(margins) // 2] if margins else None,
            "mismatches": mismatches[:100], "solo_s": time.perf_counter() - t_solo,
            "per_request_s": (time.perf_counter() - t_solo) / checked if checked else None}
        rep["memory_after"] = memory(device)
        rep["held_after"] = held(engine)
        rep["engine_idle_after_solo"] = idle2
        s = rep["solo"]
        print(f"solo ({s['mode']}): checked {s['checked']} of {s['answered']}, equal {s['equal']}, mismatched "
              f"{s['mismatched']} (swaps {s['swaps']}, solo margin max {s['mismatch_solo_margin_max']}) in "
              f"{s['solo_s']:.1f} s; held after {rep['held_after']}", flush=True)
    finally:
        engine.stop()
    rep["total_s"] = time.perf_counter() - t0
    s = rep["soak"]
    rep["ok"] = (s["lost"] == 0 and s["errors"] == 0 and s["answered_short"] == 0 and s["engine_unaccounted"] == 0
                 and s["engine_idle_after"] and not any(rep["held_after"].values())
                 and rep["solo"]["mode"] != "skipped" and not rep["solo"]["solo_failed"])
    return rep


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON report path")
    ap.add_argument("--geometry", default="llama3-8b", help="lowbit.tools.bench.runtime.GEOMETRIES (tiny-llama for CPU)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--kv", default="int2", help="KV scheme name (bf16, int4, int2, ...)")
    ap.add_argument("-n", type=int, default=1000, help="requests")
    ap.add_argument("-c", "--concurrency", type=int, default=32, help="streams in flight = engine slots")
    ap.add_argument("--min-prompt", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=2048)
    ap.add_argument("--min-out", type=int, default=4)
    ap.add_argument("--max-out", type=int, default=64)
    ap.add_argument("--hangup", type=float, default=0.1, help="fraction of requests whose client hangs up")
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--seed", type=int, default=22)
    ap.add_argument("--budget-s", type=float, default=450.0,
                    help="wall seconds from start: sending stops at 50%%, the solo check ends min(10 s, 10%%) before it")
    ap.add_argument("--send-frac", type=float, default=0.5, help="fraction of --budget-s after which sending stops")
    ap.add_argument("--batch-invariant", action="store_true",
                    help="the engine runs every step at full width (BatchEngine batch_invariant): solo == batched bit for bit")
    ap.add_argument("--solo-budget-s", type=float, default=240.0, help="most seconds the solo check may take")
    ap.add_argument("--threads", type=int, default=1, help="torch threads on CPU")
    args = ap.parse_args(argv)
    import torch

    rep = {"args": vars(args)}
    threads = torch.get_num_threads()
    try:
        run(args, rep)
    except BaseException as e:  # still bring the numbers back from a one-shot device call, then fail
        rep["error"] = f"{type(e).__name__}: {e}"
        rep["traceback"] = traceback.format_exc()
        raise
    finally:
        torch.set_num_threads(threads)
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(rep, indent=1, default=str) + "\n")
        print(f"wrote {out} (ok {rep.get('ok')})", flush=True)
    return 0 if rep["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
