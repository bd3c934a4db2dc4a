"""`lowbit eval` end to end: check the input, load, cut windows, run every row, write the reports.

Order matters: everything a user can get wrong (scheme or peer names, data path, window vs model
context, corpus length, output paths) is checked before the model is loaded or run.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from lowbit.core.errors import LowbitError
from lowbit.core.flags import torch_dtype
from lowbit.eval import report as rep
from lowbit.eval.peers import hf_quantized_entry, lowbit_entry, reference_entry
from lowbit.eval.plan import plan_peers, plan_schemes
from lowbit.kv.scheme import DEFAULT_RECENT, parse_kv_scheme
from lowbit.models import load_tokenizer, model_name
from lowbit.models.registry import BUILTINS

DEFAULT_SEQ_LEN = 2048
DEFAULT_CHUNK = 128
DEFAULT_WINDOWS = 4
FULL_WINDOW_TOLERANCE_PCT = 0.5
# names only (torch is imported where it runs: `lowbit eval`'s parser reads this module's defaults)
DTYPES = ("bf16", "fp32", "fp16")
SCORED_POSITIONS = "positions 0..L-2 of each window predict tokens 1..L-1 (L-1 per window; token 0 is never a target)"


@dataclass
class EvalOptions:
    """Everything `lowbit eval` takes. kv_flags go to parse_kv_scheme for every --kv name."""

    model: str
    kv: str = "bf16"
    peers: str | None = None
    data: str = "wikitext2"
    seq_len: int | None = None
    chunk: int = DEFAULT_CHUNK
    windows: int = DEFAULT_WINDOWS
    weights: str | None = None
    dtype: str = "bf16"
    cache_dir: str | None = None
    json_out: str | None = None
    markdown_out: str | None = None
    plot_out: str | None = None
    full_window: bool = True
    progress: bool = True
    threads: int | None = None
    kv_flags: dict = field(default_factory=dict)
    recipe: str | None = None
    overwrite: bool = False  # replace existing --json/--markdown/--plot files (else refused before loading)
    warmup: bool = False  # run every row untimed over the start of window 0 first (the demo: see warm_up)


def model_context(model: str) -> int | None:
    """max_position_embeddings of a built-in (from its stored config) or a local HF dir, else None."""
    if model in BUILTINS:
        cfg = BUILTINS[model].config_dict()
    else:
        p = Path(model).expanduser() / "config.json"
        if not p.is_file():
            return None
        cfg = json.loads(p.read_text())
    cfg = cfg.get("text_config", cfg) or cfg
    n = cfg.get("max_position_embeddings")
    return int(n) if isinstance(n, int) and n > 0 else None


def check_options(o: EvalOptions):
    """Validate everything that needs no model; returns (schemes, peers, seq_len). Raises LowbitError."""
    if o.dtype not in DTYPES:
        raise LowbitError(f"--dtype {o.dtype!r} unknown; use one of {', '.join(DTYPES)}")
    if o.windows < 1:
        raise LowbitError(f"--windows must be >= 1, got {o.windows}")
    if o.chunk < 1:
        raise LowbitError(f"--chunk must be >= 1, got {o.chunk}")
    if o.threads is not None and o.threads < 1:
        raise LowbitError(f"--threads must be >= 1, got {o.threads}")
    schemes = plan_schemes(o.kv, o.kv_flags, recipe=o.recipe, model=o.model)
    peers = plan_peers(o.peers)
    clash = sorted({s.label for s in schemes} & set(peers))
    if clash:
        raise LowbitError(f"{', '.join(clash)} is given both in --kv and --peers; list it once")
    ctx = model_context(o.model)
    if o.seq_len is None:
        seq_len = DEFAULT_SEQ_LEN if ctx is None else min(DEFAULT_SEQ_LEN, ctx)
    else:
        seq_len = int(o.seq_len)
        if seq_len < 2:
            raise LowbitError(f"--seq-len must be >= 2 (one token of context and one target), got {seq_len}")
        if ctx is not None and seq_len > ctx:
            raise LowbitError(f"--seq-len {seq_len} is longer than the context of {o.model} ({ctx} tokens); "
                              f"use --seq-len {ctx} or less (default {min(DEFAULT_SEQ_LEN, ctx)})")
    check_quantizes(schemes, peers, seq_len, ctx, o.model)
    if str(o.data) not in ("stdlib", "wikitext2") and not Path(o.data).is_file():
        raise LowbitError(f"--data {o.data}: no such file; use wikitext2, stdlib or the path of a UTF-8 text file")
    if o.weights is not None and not Path(o.weights).is_dir():
        raise LowbitError(f"--weights {o.weights}: no such directory; pass a compressed-tensors checkpoint directory")
    if o.plot_out is not None and Path(o.plot_out).suffix.lower() != ".png":
        raise LowbitError(f"--plot {o.plot_out}: the plot is a PNG; give a path ending in .png")
    for what, p in (("--json", o.json_out), ("--markdown", o.markdown_out), ("--plot", o.plot_out)):
        if p is not None and Path(p).is_dir():
            raise LowbitError(f"{what} {p} is a directory; give a file path")
        # like artifacts, a report is never overwritten silently: refused here, before any work
        if p is not None and Path(p).exists() and not o.overwrite:
            raise LowbitError(f"{what} {p} already exists; give a new path, delete it, or pass --overwrite")
    return schemes, peers, seq_len


def check_quantizes(schemes, peers, seq_len: int, ctx: int | None, model: str) -> None:
    """Refuse, before loading anything, a window too short for a quantizing row to quantize any token:
    its sink + recent tiers (model dtype) would hold the whole window and the row would measure bf16."""
    rows = [(s.label, s.scheme, False) for s in schemes if s.scheme is not None]
    rows += [(p, parse_kv_scheme(p), True) for p in peers if not p.startswith(("hf-", "vllm-"))]
    for label, sch, fixed in rows:
        # tokens leave the recent ring for the quantized middle a page at a time, once it holds recent + page
        need = sch.sink + sch.recent + sch.page
        if not sch.quantized or seq_len >= need:
            continue
        lower = (f"leave out the peer {label} (its recipe is fixed)" if fixed else
                 f"lower --sink / --recent (e.g. --sink {sch.page} --recent {_fit_recent(seq_len, sch)})")
        fix = (f"{model}'s context is {ctx} tokens, so {lower}" if ctx is not None and need > ctx else
               f"use --seq-len {need} or more, or {lower}")
        raise LowbitError(f"--seq-len {seq_len} is shorter than {label}'s sink {sch.sink} + recent {sch.recent} + "
                          f"one page of {sch.page} = {need} tokens, so it would quantize nothing (the whole window "
                          f"stays in the model dtype): {fix}")


def _fit_recent(seq_len: int, sch) -> int:
    """A recent size (multiple of the page) that leaves about half of a seq_len window to the quantized middle."""
    return max(sch.page, (seq_len // 2 - sch.page) // sch.page * sch.page)


def _bytes_bound_check(text: str, seq_len: int, windows: int) -> None:
    """Cheap early refusal: a byte-level tokenizer makes at most one token per UTF-8 byte."""
    n_bytes = len(text.encode("utf-8"))
    if n_bytes < seq_len * windows:
        raise LowbitError(f"corpus has {n_bytes} bytes, fewer than the {windows} x {seq_len} tokens asked; "
                          "use fewer/shorter windows or a longer text")


def _load_model(o: EvalOptions, lm=None):
    """(model, tokenizer, geometry, info dict). `lm`: an already loaded LoadedModel (else resolved here).

    --weights DIR evaluates a compressed-tensors checkpoint instead, which lowbit.runtime.load.resolve loads
    through lowbit.weights.load_quantized (QuantLinear modules, no decompression); its tokenizer comes
    from the checkpoint, else from --model, whose own weights are then not loaded. The geometry is
    named after --model, so RotationSets fitted for that model apply to its quantized weights.
    """
    from lowbit.runtime.load import resolve
    dtype = torch_dtype(o.dtype)
    if o.weights is not None:
        q = resolve(o.weights, cache_dir=o.cache_dir, dtype=dtype)
        if q.provenance.get("source") != "quantized-checkpoint":
            raise LowbitError(f"--weights {o.weights}: its config.json has no quantization_config; "
                              "pass a checkpoint written by `lowbit quantize`")
        tok = q.tokenizer
        if tok is None:
            tok = lm.tokenizer if lm is not None else load_tokenizer(o.model, o.cache_dir)
        if tok is None:
            tok = resolve(o.model, cache_dir=o.cache_dir, dtype=dtype).tokenizer
        geometry = replace(q.geometry, name=lm.name if lm is not None else model_name(o.model))
        p = q.provenance
        info = {"name": f"{o.model} + {Path(o.weights).name}", "weights_sha256": p["weights_files"], "dtype": o.dtype,
                "path": p["path"], "geometry": geometry.summary(),
                "weights": {"dir": p["path"], "manifest": p["manifest"]}, "provenance": p}
        return q.model, tok, geometry, info
    if lm is None:
        lm = resolve(o.model, cache_dir=o.cache_dir, dtype=dtype)
    elif lm.model.dtype != dtype:
        raise LowbitError(f"the loaded model is {lm.model.dtype}, not the {o.dtype} asked; load it with that dtype")
    info = {"name": lm.name, "weights_sha256": lm.weights_sha256, "dtype": o.dtype, "path": str(lm.path),
            "geometry": lm.geometry.summary(), "weights": None, "provenance": lm.provenance}
    return lm.model, lm.tokenizer, lm.geometry, info


def warm_up(model, windows, entries, chunk: int) -> int:
    """Run every entry, untimed and unscored, over the start of window 0: long enough that its first
    page is quantized (sink + recent + page, plus a chunk), so one-off costs (imports, first kernel
    launches, a peer's lazy setup, the first quantization) are not charged to one row's seconds.
    A peer that fails here is left to fail again, and be recorded, in the timed run. Returns tokens fed."""
    import torch

    from lowbit.eval.harness import use_attention
    from lowbit.eval.perplexity import forward_chunk

    def first_quantized(c: dict) -> int:  # lowbit rows: sink + recent + page; HF peers: residual_length + 1
        return sum(int(c.get(k) or 0) for k in ("sink", "recent", "page")) + int(c.get("residual_length") or 0)

    need = max((first_quantized(e.config) for e in entries), default=0)
    n = min(int(windows.shape[1]), need + chunk)
    own = model.config._attn_implementation
    try:
        with torch.no_grad():
            for e in entries:
                if e.cannot_run:
                    continue
                use_attention(model, e.attention or own)
                try:
                    cache = e.make_cache(model)
                    for s in range(0, n, chunk):
                        forward_chunk(model, windows[0, s:min(s + chunk, n)][None, :], cache)
                except Exception:
                    if e.kind != "hf-quantized":
                        raise
                del cache
    finally:
        use_attention(model, own)
    return n


def build_entries(schemes, peers, geometry, recent: int):
    """Entries in table order: reference, --kv schemes, then peers. Each lowbit scheme is validated
    against the geometry here (before any forward)."""
    entries = []
    for s in schemes:
        entries.append(reference_entry() if s.scheme is None else lowbit_entry(s.label, s.scheme, geometry))
    for p in peers:
        if p.startswith("hf-"):
            entries.append(hf_quantized_entry(p, geometry, recent))
        elif p.startswith("vllm-"):  # vLLM 0.26's KV dtypes, fake-quant (lowbit.eval.peers_vllm)
            from lowbit.eval.peers_vllm import vllm_entry

            entries.append(vllm_entry(p, geometry))
        else:  # kivi2 / kivi4: fixed lowbit recipes, the shared flags do not apply
            entries.append(lowbit_entry(p, parse_kv_scheme(p), geometry, kind="lowbit-peer"))
    return entries


def _console():
    """A rich console; when stdout is not a terminal (logs, CI) wide enough for the whole table."""
    from rich.console import Console

    c = Console()
    return c if c.is_terminal else Console(width=160)


def run_eval(o: EvalOptions, console=None, loaded=None) -> dict:
    """Run an evaluation and write the requested outputs; returns the report dict.
    loaded: a lowbit.models.LoadedModel of o.model already in memory (the demo), else it is loaded here."""
    import torch

    from lowbit.calib.corpora import load_text, token_windows
    from lowbit.eval.harness import evaluate
    from lowbit.eval.perplexity import full_window_ppl
    console = console or _console()
    schemes, peers, seq_len = check_options(o)
    if o.threads is not None:
        torch.set_num_threads(o.threads)
    text = load_text(o.data)
    _bytes_bound_check(text, seq_len, o.windows)
    tok = loaded.tokenizer if loaded is not None else load_tokenizer(o.model, o.cache_dir)
    windows = token_windows(tok, text, seq_len, o.windows) if tok is not None else None

    t0 = time.perf_counter()
    model, tokenizer, geometry, model_info = _load_model(o, loaded)
    if loaded is None:
        console.print(f"loaded {model_info['name']} ({o.dtype}) in {time.perf_counter() - t0:.1f} s")
    if windows is None:
        if tokenizer is None:
            raise LowbitError(f"{o.model} has no tokenizer; add tokenizer files to the model directory")
        windows = token_windows(tokenizer, text, seq_len, o.windows)
    recent = next((s.scheme.recent for s in schemes if s.scheme is not None), None)
    if recent is None:
        recent = o.kv_flags.get("recent") or DEFAULT_RECENT
    entries = build_entries(schemes, peers, geometry, recent)

    warmed = warm_up(model, windows, entries, o.chunk) if o.warmup else 0
    results = evaluate(model, windows, entries, chunk=o.chunk, progress=o.progress)
    full = None
    if o.full_window:
        fw = full_window_ppl(model, windows)
        chunked = results[0].scores.ppl
        diff = 100.0 * (chunked / fw - 1.0)
        full = {"ppl": fw, "chunked_ppl": chunked, "diff_pct": diff, "tolerance_pct": FULL_WINDOW_TOLERANCE_PCT,
                "ok": abs(diff) <= FULL_WINDOW_TOLERANCE_PCT}
    protocol = {
        "windows": int(windows.shape[0]), "seq_len": int(windows.shape[1]), "chunk": o.chunk,
        "scored_positions": SCORED_POSITIONS, "scored_per_window": int(windows.shape[1]) - 1,
        "tokens_scored": int(windows.shape[0]) * (int(windows.shape[1]) - 1),
        "windows_from": "the first N non-overlapping windows of the corpus tokenized as a whole, no special tokens",
        "reference": "bf16 = transformers DynamicCache fed the same chunks; KL(ref || row) and top-1 against it",
        "seconds": "wall time of each row's own forward calls (cache work included, scoring excluded); "
                   "cpu_seconds: process CPU time of the same calls",
        "threads": torch.get_num_threads(),
        "warmup_tokens": warmed,  # tokens of window 0 each row ran untimed before the timed run (0: none)
    }
    data = {"name": str(o.data), "chars": len(text)}
    report = rep.build_report(protocol=protocol, model=model_info, data=data, results=results, full_window=full)
    rep.print_table(report, console)
    for path, write in ((o.json_out, rep.write_json), (o.markdown_out, rep.write_markdown),
                        (o.plot_out, rep.write_plot)):
        if path:
            verb = "replaced" if Path(path).exists() else "wrote"  # exists only under --overwrite
            console.print(f"{verb} {write(report, path)}")
    return report
