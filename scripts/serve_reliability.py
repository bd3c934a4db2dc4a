"""Runs the server reliability checks on CPU and writes what they measure.

    .venv/bin/python scripts/serve_reliability.py [--out results/reliability/serve_cpu.json]

The same code as tests/serve/test_fuzz.py, test_soak.py and test_capacity.py (their fuzz(), soak() and
exhaust()), with the same sizes: the fuzz cases and their outcome classes per engine, the soak's counts
(sent, answered, equal to solo, lost), latencies p50/p99 and process RSS before/after per engine, and the
capacity test's admitted/waited/refused counts per policy. Each check asserts as its test does: a run that
writes a file passed them. ~1 min on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "results/reliability/serve_cpu.json"))
    args = ap.parse_args(argv)

    import torch

    from tests.serve import reliability as rel
    from tests.serve import test_capacity as cap
    from tests.serve import test_fuzz as fz
    from tests.serve import test_soak as sk
    from tests.serve.conftest import tiny_runtime

    torch.set_num_threads(1)  # as the tests' one_torch_thread fixture
    rt = rel.runtime()
    out = {"what": "lowbit serve reliability on CPU (issue #22), tiny smollm2-geometry model, int4 KV page 1",
           "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "python": platform.python_version()}

    by_engine, outcomes = {}, Counter()
    for engine in ("single", "batch"):
        with rel.start_server(rt, engine) as srv:
            r = fz.fuzz(srv)
        by_engine[engine] = r
        outcomes.update(r["outcomes"])
    out["fuzz"] = {"cases": sum(outcomes.values()), "outcomes": dict(sorted(outcomes.items())),
                   "generated_per_engine": fz.MAX_EXAMPLES, "raw_cases_per_engine": [n for n, *_ in fz.raw_cases()],
                   "by_engine": by_engine}
    print("fuzz", json.dumps(out["fuzz"]["outcomes"]), flush=True)

    reqs = sk.plan()
    refs = [rel.solo(rt, p["ids"], p["max_tokens"]) for p in reqs]
    soak = {}
    for engine in ("single", "batch"):
        with rel.start_server(rt, engine, max_active=sk.MAX_ACTIVE) as srv:
            r = sk.soak(srv, refs, reqs)
        assert r["lost"] == 0 and not r["wrong"], r
        soak[engine] = {k: v for k, v in r.items() if k not in ("wrong", "lost_detail")}
        print("soak", engine, {k: soak[engine][k] for k in ("sent", "answered", "hung_up_by_client", "equal_to_solo",
                                                             "lost", "latency_p50_ms", "latency_p99_ms")}, flush=True)
    out["soak"] = {"N": sk.N, "C": sk.C, "seed": sk.SEED, "max_active": sk.MAX_ACTIVE, **soak}

    crt = tiny_runtime("int4", max_context=rel.MAX_CONTEXT, eos=(), **rel.KV)
    prompts = cap.make_prompts()
    crefs = [rel.solo(crt, p, cap.MAX_TOKENS) for p in prompts]
    capacity = {"slots": cap.SLOTS, "requests": cap.REQUESTS, "prompt_tokens": cap.PROMPT,
                "max_tokens": cap.MAX_TOKENS}
    for policy in ("wait", "reject"):
        with rel.start_server(crt, "batch", max_active=cap.SLOTS, when_full=policy) as srv:
            c = cap.exhaust(srv, prompts)
        c["equal_to_solo"] = sum(t == ref for t, ref in zip(c["texts"], crefs) if t is not None)
        assert c["equal_to_solo"] == cap.REQUESTS - c["refused"], c
        capacity[policy] = {k: v for k, v in c.items() if k not in ("texts", "slots", "requests")}
        print("capacity", policy, {k: c[k] for k in ("admitted", "waited", "refused", "wait_seconds_max")}, flush=True)
    out["capacity"] = capacity
    out["not_run"] = "the GPU soak (N=1000, C=32, 8B-geometry model) of issue #22"

    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2, default=str) + "\n")
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
