"""Reports of an evaluation: the results list (JSON), a rich table, markdown, and a PNG of ΔPPL vs bits.

The JSON is the record: `protocol` (windows, tokens, chunk, scored positions), `model`, `data`,
`versions`, `full_window` (the bf16 chunked-vs-plain-forward check) and `results`, one entry per row:
    scheme, kind, status ("ok" or "cannot run: <reason>"), config, ppl, delta_ppl_pct,
    delta_ppl_se_pct (its standard error from per-token paired NLL differences; a lower bound), kl, top1,
    bits_per_elt (quantized tier; null when nothing is quantized), avg_bits_per_elt (all tiers),
    quantized_rows, seconds (wall), time_vs_bf16, cpu_seconds, cpu_vs_bf16, tokens_scored
Numbers are null where a row could not run; nothing is printed that was not measured.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import platform
from pathlib import Path

from lowbit.core.errors import LowbitError

SCHEMA_VERSION = 1
RESULT_KEYS = ("scheme", "kind", "status", "config", "ppl", "delta_ppl_pct", "delta_ppl_se_pct", "kl", "top1", "bits_per_elt",
               "avg_bits_per_elt", "quantized_rows", "seconds", "time_vs_bf16", "cpu_seconds", "cpu_vs_bf16",
               "tokens_scored", "backend")


def _finite(x) -> float | None:
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def result_rows(results) -> list[dict]:
    """EntryResults (lowbit.eval.harness) -> JSON-ready dicts with RESULT_KEYS."""
    ref_s = results[0].seconds if results else 0.0
    ref_c = results[0].cpu_seconds if results else 0.0
    rows = []
    for r in results:
        ok = r.ok
        a = r.accounting
        rows.append({
            "scheme": r.name,
            "kind": r.kind,
            "status": "ok" if ok else f"cannot run: {r.cannot_run}",
            "config": r.config,
            "ppl": _finite(r.scores.ppl) if ok else None,
            "delta_ppl_pct": _finite(r.delta_ppl_pct) if ok else None,
            "delta_ppl_se_pct": (_finite(r.scores.delta_ppl_se_pct()) if ok and r.kind != "reference" else None),
            "kl": _finite(r.scores.mean_kl) if ok else None,
            "top1": _finite(r.scores.top1_pct) if ok else None,
            "bits_per_elt": _finite(a.bits_per_elt) if ok else None,
            "avg_bits_per_elt": _finite(a.avg_bits_per_elt) if ok else None,
            "quantized_rows": int(a.quantized_rows) if ok else None,
            "seconds": round(r.seconds, 3) if ok else None,
            "time_vs_bf16": round(r.seconds / ref_s, 3) if ok and ref_s > 0 else None,
            "cpu_seconds": round(r.cpu_seconds, 3) if ok else None,
            "cpu_vs_bf16": round(r.cpu_seconds / ref_c, 3) if ok and ref_c > 0 else None,
            "tokens_scored": int(r.scores.n) if ok else None,
            "backend": r.backend if ok else None,
        })
    return rows


def _git_state() -> dict | None:
    """Commit of the lowbit source tree and whether src/lowbit differs from it (None outside a checkout)."""
    import subprocess

    root = Path(__file__).resolve().parents[3]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "src/lowbit"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": head, "src_modified": bool(dirty)}


def versions() -> dict:
    out = {"python": platform.python_version(), "lowbit_git": _git_state()}
    for dist in ("lowbit", "torch", "transformers", "optimum-quanto", "hqq"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


def build_report(*, protocol: dict, model: dict, data: dict, results, full_window: dict | None) -> dict:
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "lowbit.eval",
        "protocol": protocol,
        "model": model,
        "data": data,
        "versions": versions(),
        "full_window": full_window,
        "results": result_rows(results),
    }


def _atomic_write_text(p: Path, text: str) -> Path:
    """Write beside p, then rename over it: an interrupt leaves the old file or none, never half a file."""
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, p)
    finally:
        tmp.unlink(missing_ok=True)
    return p


def write_json(report: dict, path) -> Path:
    return _atomic_write_text(Path(path), json.dumps(report, indent=2) + "\n")


# ------------------------------------------------------------------ formatting
def _f(x, fmt: str, none: str = "-") -> str:
    return none if x is None else format(x, fmt)


def _cells(row: dict) -> list[str]:
    if row["status"] != "ok":
        return [row["scheme"], row["status"]] + [""] * (len(HEADERS) - 2)
    d = row["delta_ppl_pct"]
    return [
        row["scheme"],
        _f(row["bits_per_elt"], ".2f"),
        _f(row["avg_bits_per_elt"], ".2f"),
        _f(row["ppl"], ".3f" if row["ppl"] < 100 else ".1f"),
        "ref" if row["kind"] == "reference" else _f(d, "+.2f" if d is None or abs(d) < 100 else "+.0f"),
        _f(row["kl"], ".4f"),
        _f(row["top1"], ".1f"),
        f"{row['quantized_rows']:,}",
        _f(row["seconds"], ".1f"),
        _ratio(row["time_vs_bf16"]),
        _f(row.get("cpu_seconds"), ".1f"),
        _ratio(row.get("cpu_vs_bf16")),
    ]


def _ratio(x) -> str:
    return "-" if x is None else f"{x:.2f}x"


# bits q = bits/elt of the quantized tier; bits avg = over all tiers (sink + middle + recent)
HEADERS = ["scheme", "bits q", "bits avg", "PPL", "ΔPPL %", "KL", "top-1 %", "quant rows", "wall s", "wall/bf16",
           "cpu s", "cpu/bf16"]


def protocol_line(report: dict) -> str:
    p, m, d = report["protocol"], report["model"], report["data"]
    return (f"{m['name']} ({m.get('dtype')}) on {d['name']}: {p['windows']} windows x {p['seq_len']} tokens fed "
            f"{p['chunk']} at a time; scored: positions 0..L-2 predict tokens 1..L-1 "
            f"({p['scored_per_window']} per window, {p['tokens_scored']} in all)")


def full_window_line(report: dict) -> str | None:
    fw = report.get("full_window")
    if not fw:
        return None
    verdict = "ok" if fw["ok"] else "MISMATCH"
    return (f"bf16 through the cache {fw['chunked_ppl']:.4f} vs plain full-window forward {fw['ppl']:.4f}: "
            f"{fw['diff_pct']:+.3f}% ({verdict}, tolerance {fw['tolerance_pct']}%)")


# the columns kept on narrower terminals (the JSON and markdown always have all of them)
_NARROW = ("scheme", "bits q", "bits avg", "PPL", "ΔPPL %", "KL", "top-1 %", "wall/bf16")
_NARROWEST = ("scheme", "bits q", "PPL", "ΔPPL %", "KL", "top-1 %")


def print_table(report: dict, console=None) -> None:
    """The results as a rich table, with the protocol and the full-window check under it."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    cols = HEADERS if console.width >= 140 else _NARROW if console.width >= 100 else _NARROWEST
    keep = [HEADERS.index(h) for h in cols]
    table = Table(title=f"lowbit eval: {report['model']['name']}", title_justify="left", box=box.SIMPLE_HEAD,
                  caption="bits q: bits/elt of the quantized tier (codes + scale/zero); bits avg: over all tiers",
                  caption_justify="left")
    for i in keep:
        table.add_column(HEADERS[i], justify="left" if i == 0 else "right", no_wrap=True)
    skipped = []
    for row in report["results"]:
        if row["status"] != "ok":
            # the reason goes under the table: one narrow column would wrap it over many lines
            skipped.append(row)
            table.add_row(row["scheme"], "[yellow]cannot run[/yellow]", *[""] * (len(keep) - 2))
        else:
            cells = _cells(row)
            table.add_row(*[cells[i] for i in keep])
    console.print(table)
    for row in skipped:
        console.print(f"[yellow]{row['scheme']}: {row['status']}[/yellow]")
    console.print(protocol_line(report))
    for w in noise_warnings(report):
        console.print(f"[yellow]{w}[/yellow]")
    line = full_window_line(report)
    if line:
        console.print(line if report["full_window"]["ok"] else f"[bold red]{line}[/bold red]")


def to_markdown(report: dict) -> str:
    """A markdown page: protocol, versions, the table, the full-window check, row configs."""
    out = [f"# lowbit eval: {report['model']['name']}", "", protocol_line(report), ""]
    out += [f"> {w}\n" for w in noise_warnings(report)]
    v = report["versions"]
    git = v.get("lowbit_git")
    out.append("versions: " + ", ".join(f"{k} {val}" for k, val in v.items() if val and k != "lowbit_git")
               + (f", lowbit git {git['commit'][:12]}" + (" (src modified)" if git["src_modified"] else "")
                  if git else ""))
    out.append("")
    out.append("bits q: bits/elt of the quantized tier (codes + scale/zero); bits avg: over all tiers "
               "(sink and recent at the model dtype). KL(bf16 || row) per scored token; top-1 agreement with bf16.")
    out.append("")
    out.append("| " + " | ".join(HEADERS) + " |")
    out.append("|" + "|".join("---" if i == 0 else "---:" for i in range(len(HEADERS))) + "|")
    for row in report["results"]:
        if row["status"] != "ok":
            out.append(f"| {row['scheme']} | {row['status']} |" + " |" * (len(HEADERS) - 2))
        else:
            out.append("| " + " | ".join(_cells(row)) + " |")
    out.append("")
    line = full_window_line(report)
    if line:
        out += [line, ""]
    out.append("Rows:")
    for row in report["results"]:
        desc = row["config"].get("describe") or json.dumps(row["config"], sort_keys=True)
        out.append(f"- `{row['scheme']}`: {desc}")
    out.append("")
    return "\n".join(out)


def write_markdown(report: dict, path) -> Path:
    return _atomic_write_text(Path(path), to_markdown(report))


_KIND_COLORS = {"reference": "black", "lowbit": "tab:blue", "lowbit-peer": "tab:green", "hf-quantized": "tab:orange",
                "vllm-peer": "tab:purple"}
_KIND_LABELS = {"reference": "bf16 reference", "lowbit": "lowbit", "lowbit-peer": "KIVI-style (lowbit)",
                "hf-quantized": "HF QuantizedCache", "vllm-peer": "vLLM 0.26 KV dtype (fake-quant)"}


NOISE_SE = 2.0  # a |ΔPPL| under this many standard errors is called within noise


def noise_warnings(report: dict) -> list[str]:
    """One line per row whose ΔPPL is within NOISE_SE standard errors of 0 (too few tokens scored to
    tell it from the reference)."""
    out = []
    n = report["protocol"]["tokens_scored"]
    for row in report["results"]:
        d, se = row.get("delta_ppl_pct"), row.get("delta_ppl_se_pct")
        if row["status"] != "ok" or d is None or not se or abs(d) >= NOISE_SE * se:
            continue
        out.append(f"warning: {row['scheme']} ΔPPL {d:+.2f}% is within noise (standard error ±{se:.2f}% over {n} "
                   f"scored tokens, a lower bound: neighbouring tokens correlate); score more with --windows")
    return out


def _pct_ticks(lo: float, hi: float) -> list[float]:
    """ΔPPL tick values covering [lo, hi]: 0, 0.5, then 1-2-5 steps per decade (decades only when that
    would crowd the axis), up to the first step at or above hi (and likewise below lo)."""
    def side(x: float) -> list[float]:
        steps = [0.5] + [m * 10.0 ** e for e in range(7) for m in (1, 2, 5)]
        if x > 20:  # more than ~two decades: 1-2-5 labels would overlap
            steps = [0.5] + [10.0 ** e for e in range(7)]
        out = []
        for t in steps:
            out.append(t)
            if t >= x:
                break
        return out

    return sorted({0.0, *side(max(hi, 0.0)), *(-t for t in side(-min(lo, 0.0)) if lo < 0)})


def _pct_label(t: float) -> str:
    if t == 0:
        return "0"
    return f"{t:+,.0f}%" if abs(t) >= 1 else f"{t:+.1f}%"


def write_plot(report: dict, path) -> Path:
    """PNG of ΔPPL % (symlog) against bits/elt: filled marker = quantized tier, hollow = average over
    all tiers (sink and recent included), joined per scheme. The bf16 reference sits at (16, 0)."""
    p = Path(path)
    if p.suffix.lower() != ".png":
        raise LowbitError(f"--plot {p}: the plot is a PNG; give a path ending in .png")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=120)
    ys, xs = [], []
    for row in report["results"]:
        if row["status"] != "ok" or row["delta_ppl_pct"] is None:
            continue
        y = row["delta_ppl_pct"]
        xq, xa = row["bits_per_elt"], row["avg_bits_per_elt"]
        color = _KIND_COLORS.get(row["kind"], "tab:gray")
        if xq is None:
            xq = xa
        if xq is None:
            continue
        ax.plot([xq], [y], "o", color=color)
        if xa is not None and xa != xq:
            ax.plot([xa], [y], "o", mfc="none", color=color)
            ax.plot([xq, xa], [y, y], "-", lw=0.6, color=color, alpha=0.5)
        # labels right of the point, except near the right edge (the bf16 reference at 16), where they go left
        right_edge = xq >= 12
        ax.annotate(row["scheme"], (xq, y), textcoords="offset points", xytext=(-5 if right_edge else 5, 5),
                    ha="right" if right_edge else "left", fontsize=8)
        ys.append(y)
        xs += [v for v in (xq, xa) if v is not None]
    ax.set_yscale("symlog", linthresh=1.0)
    # percent tick labels (+1%, +10%, +100%) instead of symlog's 10^k, and ticks inside the linear part
    ticks = _pct_ticks(min(ys, default=0.0), max(ys, default=0.0))
    ax.set_yticks(ticks)
    ax.set_yticklabels([_pct_label(t) for t in ticks])
    ax.yaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    if xs:
        ax.set_xlim(max(0.0, min(xs) - 0.6), max(xs) + 0.6)
    ax.tick_params(labelsize=9)
    ax.axhline(0.0, color="grey", lw=0.5)
    ax.set_xlabel("bits per element (K and V, scale/zero included)", fontsize=10)
    ax.set_ylabel("ΔPPL vs bf16 (%, log scale above 1%)", fontsize=10)
    pr = report["protocol"]
    ax.set_title(f"{report['model']['name']} on {report['data']['name']}: {pr['windows']} x {pr['seq_len']} tokens, "
                 f"chunk {pr['chunk']}", fontsize=10)
    ax.grid(True, which="major", lw=0.3, alpha=0.5)
    from matplotlib.lines import Line2D

    kinds = {row["kind"] for row in report["results"] if row["status"] == "ok"}
    handles = [Line2D([], [], marker="o", ls="", color=c, label=_KIND_LABELS[k])
               for k, c in _KIND_COLORS.items() if k in kinds]
    handles += [Line2D([], [], marker="o", ls="", color="grey", label="quantized tier"),
                Line2D([], [], marker="o", ls="", color="grey", mfc="none", label="average over all tiers")]
    ax.legend(handles=handles, fontsize=8, loc="upper right")
    fig.tight_layout()
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.stem}.tmp-{os.getpid()}.png")  # atomic, as the text reports
    try:
        fig.savefig(tmp)
        os.replace(tmp, p)
    finally:
        tmp.unlink(missing_ok=True)
        plt.close(fig)
    return p
