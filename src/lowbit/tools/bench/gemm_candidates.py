"""`lowbit bench gemm --candidates`: every candidate kernel of each (scheme, shape, M) cell audited against the torch
twin, then timed inside a CUDA graph beside cuBLAS bf16 measured in the same run; the fastest passing candidate wins
the cell, and `build_table` turns the winners into a dispatch table for this card (kernels/gemm/tables/<card>.json).

    res = sweep(("w4a16-g128", "w8a16"), ["llama3-8b gate/up"], (1, 16, 64), ("table", "humming", "dequant-cublas"))
    table = build_table(res, Dispatch.for_device("cuda"))

Candidates (names):
    table           the cell lowbit's dispatch table picks today (lowbit's hand-written kernels, or whatever the
                    committed table says, dequantize + cuBLAS included)
    humming         humming-kernels (lowbit.kernels.gemm.humming): one plan per weight set; a scheme's kernels (all
                    its shapes at the sweep's Ms) compiled in parallel threads before its first row (compile_plans);
                    timed inside the graph like the others (eagerly it costs ~50 us of host time per call)
    dequant-cublas  dequantize + cuBLAS (A8 weights: their activation codes through it, a16-xq:dequant-cublas)

Audit: a candidate runs once on fresh inputs at the row's M and its rel L2 against weight_gemm.linear_twin (fp32
output) must be finite and within weight_audit.tolerance(kernel); one that fails, or raises, is reported in the row
and neither timed nor eligible. Timing: kernels.bench.graph_time_ms (a graph of back-to-back calls cycling through
enough weight/input sets that a cycle is >= 4x the L2), the same call for every candidate and for bf16 F.linear.

Row: {"scheme", "shape", "M", "N", "K", "bf16_ms", "candidates": {name: {"kernel", "ok", "rel_l2", "ms", "ratio"
(bf16_ms / ms), "error"}}, "kernel", "ms", "ratio" (the winner's; None when nothing passed)}.
"""

from __future__ import annotations

import time

import torch

from lowbit.core.errors import LowbitError
from lowbit.kernels.gemm import humming as hg
from lowbit.kernels.gemm.check import tolerance
from lowbit.tools.bench import attention as kbench
from lowbit.tools.bench.attention import n_buffers
from lowbit.weights.scheme import parse_weight_scheme

CANDIDATES = ("table", "humming", "dequant-cublas")
# the scheme whose rows make a kind's table cells (w4a16-g64-asym etc. are timed but do not set w4a16's cells)
TABLE_SCHEMES = {"w4a16": "w4a16-g128", "w8a16": "w8a16", "w8a8": "w8a8", "w4a8": "w4a8"}


def check_candidates(names) -> tuple[str, ...]:
    names = tuple(CANDIDATES if names in (None, "all") else names)
    bad = [n for n in names if n not in CANDIDATES]
    if bad or not names:
        raise LowbitError(f"bench gemm: unknown candidate(s) {bad or names}; use some of {', '.join(CANDIDATES)} or all")
    return names


def candidate_cell(name: str, pw, M: int, dispatch):
    """The dispatch Cell a candidate runs for this weight and M (None: the candidate has none for it)."""
    from lowbit.kernels.gemm.dispatch import M_INF, Cell, ViaA16

    if name == "table":
        return dispatch.choose(pw.kind, M, pw)
    if name == "humming":
        return Cell(pw.kind, 1, M_INF, "humming")
    if name == "dequant-cublas":
        return (Cell(pw.kind, 1, M_INF, "dequant-cublas") if pw.a_bits == 16
                else Cell(pw.kind, 1, M_INF, "a16-xq", ViaA16("dequant-cublas")))
    raise ValueError(name)


def audit_cell(cell, pw, M: int, seed: int = 0, device="cuda") -> tuple[float, bool, str | None]:
    """(rel_l2, finite, error) of one cell against the twin at M on fresh inputs (any exception is the error)."""
    from lowbit.kernels.gemm import triton_gemm as wg
    from lowbit.kernels.gemm.dispatch import run_cell

    try:
        g = torch.Generator(device=device).manual_seed(1000 + seed)
        x = torch.randn(M, pw.K, generator=g, device=device).to(torch.bfloat16)
        y = run_cell(cell, x, pw, torch.float32)
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()
        ref = wg.linear_twin(x, pw, out_dtype=torch.float32)
        finite = bool(torch.isfinite(y).all())
        rel = float((y.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)) if finite else float("inf")
        return rel, finite, None
    except Exception as e:  # noqa: BLE001 -- reported in the row, the candidate is not eligible
        return float("inf"), False, _one_line(e)


def _one_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0][:300] if msg else ''}"


def _humming_precompile(cases, ms, log, device="cuda") -> None:
    """Compile humming's kernels for these (scheme, shape, K, N) at the sweep's Ms, in parallel threads, before any
    of them is timed (failures are logged; the rows then report them per candidate)."""
    from lowbit.kernels.gemm.triton_gemm import random_weight

    t0 = time.time()
    plans = []
    for scheme, _shape, K, N in cases:
        try:
            pw = random_weight(scheme, N, K, device)
            if hg.why_not(pw) is None:
                plans.append(hg.plan(pw, torch.bfloat16, ms, compile=False))
        except Exception as e:  # noqa: BLE001 -- the rows will report the failure per candidate
            log(f"humming: plan for {scheme} N={N} K={K} failed: {_one_line(e)}")
    for err in hg.compile_plans(plans, log=log):
        log(f"humming: {err}")
    log(f"humming: kernels for {', '.join(sorted({c[0] for c in cases}))} ready in {time.time() - t0:.0f}s")
    del plans
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def sweep(schemes, shapes=None, ms=None, candidates=CANDIDATES, *, dispatch=None, log=print, budget_s: float | None = None,
          on_row=None, device="cuda") -> dict:
    """Rows for every (scheme, shape, M) of the selection (shapes: the audit's names or (name, K, N); default the
    Llama-3-8B q/o, gate/up and down), each candidate audited and timed. budget_s: no new (scheme, shape) starts
    after that many seconds (the result says truncated). on_row(row) sees each row as it is made. device: cuda (a
    CPU run is for tests of this function's logic, with the timing replaced)."""
    import platform

    import torch.nn.functional as F

    from lowbit.kernels.gemm.dispatch import Dispatch, run_cell
    from lowbit.kernels.gemm.triton_gemm import random_weight
    from lowbit.tools.audit.gemm import LLM_SHAPES

    t0 = time.time()
    cuda = torch.device(device).type == "cuda"
    dispatch = dispatch or Dispatch.for_device(device)
    candidates = check_candidates(candidates)
    shapes = shapes or ("llama3-8b qkv/o", "llama3-8b gate/up", "llama3-8b down")
    ms = tuple(ms or (1, 16, 64, 256, 4096))
    by_name = {n: (K, N) for n, K, N in LLM_SHAPES}
    cases = [(s, *(sh if isinstance(sh, tuple) else (sh, *by_name[sh]))) for s in schemes for sh in shapes]
    humming_why = hg.humming_missing() if "humming" in candidates else None
    if humming_why is not None:
        log(f"humming: {humming_why}")
    rows, truncated, compiled = [], [], set()
    for scheme, shape, K, N in cases:
        if budget_s is not None and time.time() - t0 > budget_s:
            truncated.append(f"{scheme} {shape}")
            log(f"budget {budget_s:.0f}s reached: {scheme} {shape} not measured")
            continue
        if "humming" in candidates and humming_why is None and scheme not in compiled:
            compiled.add(scheme)  # one scheme's kernels at a time: the first rows come early, a cut-short run compiles
            _humming_precompile([c for c in cases if c[0] == scheme], ms, log, device)  # nothing it won't time
        try:
            pw0 = random_weight(scheme, N, K, device)
        except Exception as e:  # noqa: BLE001 -- the group does not divide K, etc.
            log(f"{scheme} {shape}: no weight ({_one_line(e)})")
            continue
        n = n_buffers(pw0.nbytes(), 24e9)
        pws = [pw0] + [random_weight(scheme, N, K, device, seed=i) for i in range(1, n)]
        ws = [torch.randn(N, K, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(n_buffers(N * K * 2, 24e9))]
        case_err = None  # humming's failure to plan this weight: reported in each row, not retried per row
        if "humming" in candidates and humming_why is None and hg.why_not(pw0) is None:
            try:
                for p in pws:
                    hg.plan_for(p, torch.bfloat16, ms)  # repack once per weight set (kernels already compiled)
            except Exception as e:  # noqa: BLE001
                case_err = f"humming plan: {_one_line(e)}"
                log(f"humming: plan for {scheme} {shape} failed: {case_err}")
        for M in ms:
            nx, nw, npw = max(len(pws), len(ws)), len(ws), len(pws)
            xs = [torch.randn(M, K, device=device, dtype=torch.bfloat16) for _ in range(nx)]
            row = {"scheme": scheme, "shape": shape, "M": M, "N": N, "K": K, "candidates": {}}
            try:
                row["bf16_ms"] = kbench.graph_time_ms([(lambda w=ws[i % nw], x=xs[i]: F.linear(x, w))
                                                       for i in range(nx)], reps=3, target_ms=10)
            except Exception as e:  # noqa: BLE001
                row["bf16_ms"], row["bf16_error"] = None, _one_line(e)
            for name in candidates:
                c = {"kernel": None, "ok": False, "rel_l2": None, "ms": None, "ratio": None, "error": None}
                row["candidates"][name] = c
                if name == "humming" and (humming_why or case_err):
                    c["kernel"], c["error"] = "humming", humming_why or case_err
                    continue
                try:
                    cell = candidate_cell(name, pw0, M, dispatch)
                except Exception as e:  # noqa: BLE001 -- e.g. no table cell for the kind
                    c["error"] = _one_line(e)
                    continue
                c["kernel"] = cell.kernel
                same = [v for v in row["candidates"].values() if v is not c and v["kernel"] == cell.kernel]
                if same:  # the table's cell is this same kernel: one audit and one timing
                    c.update({k: same[0][k] for k in ("ok", "rel_l2", "ms", "ratio", "error")})
                    continue
                if name == "humming" and (why := hg.why_not(pw0)) is not None:
                    c["error"] = f"humming does not take this weight: {why}"
                    continue
                rel, finite, err = audit_cell(cell, pw0, M, seed=M, device=device)
                c["rel_l2"] = rel if finite else None
                c["ok"] = err is None and finite and rel <= tolerance(cell.kernel)
                if not c["ok"]:
                    c["error"] = err or f"audit: rel L2 {rel:.3g} > {tolerance(cell.kernel):g}" + (
                        "" if finite else " (non-finite)")
                    continue
                try:
                    c["ms"] = kbench.graph_time_ms([(lambda p=pws[i % npw], x=xs[i], cl=cell: run_cell(cl, x, p))
                                                    for i in range(nx)], reps=3, target_ms=10)
                    c["ratio"] = row["bf16_ms"] / c["ms"] if row["bf16_ms"] else None
                except Exception as e:  # noqa: BLE001 -- e.g. not capturable: reported, not eligible
                    c["ok"], c["error"] = False, f"timing: {_one_line(e)}"
                    if cuda:
                        torch.cuda.synchronize()
            timed = [(v["ms"], k) for k, v in row["candidates"].items() if v["ok"] and v["ms"] is not None]
            best = min(timed)[1] if timed else None
            bc = row["candidates"].get(best, {})
            row.update(winner=best, kernel=bc.get("kernel"), ms=bc.get("ms"), ratio=bc.get("ratio"))
            rows.append(row)
            if on_row:
                on_row(row)
            log(_format_row(row, t0))
            del xs
        del ws, pws, pw0
        if cuda:
            torch.cuda.empty_cache()
    return {"env": {"gpu": torch.cuda.get_device_name(0) if cuda else str(device),
                    "capability": list(torch.cuda.get_device_capability(0)) if cuda else None,
                    "torch": torch.__version__, "python": platform.python_version(), "humming": _humming_version(),
                    "dispatch": dispatch.source, "candidates": list(candidates),
                    "timing": "CUDA graph of calls cycling >= 4x L2 of weight sets; median of 3 replays; bf16 "
                              "F.linear timed the same way in the same run"},
            "truncated": truncated, "seconds": time.time() - t0, "rows": rows}


def _humming_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("humming-kernels")
    except Exception:  # noqa: BLE001
        return None


def _format_row(row: dict, t0: float) -> str:
    parts = []
    for name, c in row["candidates"].items():
        if c["ok"]:
            parts.append(f"{name} {c['ms'] * 1e3:.1f}us x{c['ratio']:.2f}" if c["ratio"] else f"{name} {c['ms'] * 1e3:.1f}us")
        else:
            parts.append(f"{name} FAIL ({(c['error'] or '')[:80]})")
    bf = f"bf16 {row['bf16_ms'] * 1e3:.1f}us" if row.get("bf16_ms") else "bf16 ?"
    return (f"{row['scheme']:<11} {row['shape']:<18} M={row['M']:<5} {bf} | " + " | ".join(parts)
            + f"  -> {row['winner'] or 'NONE'}  [{time.time() - t0:.0f}s]")


def build_table(res: dict, base) -> dict:
    """A dispatch table for this card (kernels/gemm/tables/<card>.json format) from a sweep's winners: per (kind, shape) a
    shape cell per measured M, covering the Ms above the previous measured one (the first from 1, the last to any
    larger M), neighbours with the same winner merged; then `base`'s cells (a Dispatch: what this card ran before),
    which keep every shape and M the sweep did not measure. Only TABLE_SCHEMES' rows make cells."""
    from lowbit.kernels.gemm.dispatch import last_resort

    cells = []
    groups: dict[tuple, list] = {}
    for r in res["rows"]:
        kind = _kind(r["scheme"])
        if TABLE_SCHEMES.get(kind) == r["scheme"] and r.get("kernel"):
            groups.setdefault((kind, r["N"], r["K"]), []).append(r)
    for (kind, N, K), rs in groups.items():
        rs = sorted(rs, key=lambda r: r["M"])
        lo = 1
        for i, r in enumerate(rs):
            hi = None if i == len(rs) - 1 else r["M"]
            path, _, cfg = r["kernel"].partition(":")
            cell = {"kind": kind, "m_lo": lo, "m_hi": hi, "path": path, "config": cfg or None, "shape": [N, K],
                    "measured_at": [r["M"]], "ratio": r["ratio"]}
            prev = cells[-1] if cells else None
            if prev and prev["kind"] == kind and prev["shape"] == [N, K] and (prev["path"], prev["config"]) == (
                    path, cell["config"]):
                prev["m_hi"], prev["measured_at"] = hi, prev["measured_at"] + [r["M"]]
                prev["ratio"] = min(prev["ratio"], r["ratio"]) if prev["ratio"] and r["ratio"] else None
            else:
                cells.append(cell)
            lo = r["M"] + 1
    resort = {(c.kind, c.m_lo, c.m_hi, c.path, c.kernel) for c in last_resort()}
    base_cells = [c for c in base.table() if (c["kind"], c["m_lo"], c["m_hi"] or (1 << 62), c["path"], c["kernel"])
                  not in resort]
    for c in base_cells:
        c.pop("kernel", None)
    return {"gpu": res["env"]["gpu"], "capability": res["env"]["capability"],
            "built_from": ["lowbit bench gemm --candidates " + ",".join(res["env"]["candidates"])],
            "base": base.source, "note": "shape cells: the fastest candidate that passed the audit at each measured M "
                                         "(ratio: the lowest bf16_ms / ms among the Ms a cell was measured at); the "
                                         "Ms between two measured ones take the upper one's winner; then the base "
                                         "table's cells", "cells": cells + base_cells}


def _kind(scheme: str) -> str:
    s = parse_weight_scheme(scheme)
    return f"w{s.w_bits}a{s.a_bits}"


def bench_cli(schemes, ms, shapes, candidates, out_path, table_path, budget_s, write_new, log=print) -> int:
    """`lowbit bench gemm --candidates ...`: the sweep to out_path (rows also streamed, one JSON line each, to
    out_path + '.rows.jsonl' as they are made, so a run cut short leaves what it measured), and with table_path the
    table built from the winners."""
    import json

    from lowbit.kernels.gemm.dispatch import Dispatch, card_table_name

    rows_path = out_path.with_name(out_path.name + ".rows.jsonl")
    rows_path.parent.mkdir(parents=True, exist_ok=True)
    base = Dispatch.for_device("cuda")
    with open(rows_path, "x") as f:
        def on_row(r):
            f.write(json.dumps(r) + "\n")
            f.flush()

        res = sweep(schemes, shapes, ms, candidates, dispatch=base, log=log, budget_s=budget_s, on_row=on_row)
    write_new(out_path, res)
    log(f"wrote {out_path}")
    if table_path is not None:
        table = build_table(res, base)
        write_new(table_path, table)
        log(f"wrote {table_path} ({len(table['cells'])} cells; to use it, copy it to "
            f"src/lowbit/kernels/gemm/tables/{card_table_name(res['env']['gpu'])})")
    failed = [(r["scheme"], r["shape"], r["M"]) for r in res["rows"] if r["winner"] is None]
    for s, sh, m in failed:
        log(f"no candidate passed: {s} {sh} M={m}")
    return 0
