"""Markdown tables from the search results (ppl_*.jsonl, screen_*.jsonl) in this folder."""

import json
import sys
from pathlib import Path

HERE = Path(__file__).parent


def rows(path):
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def main():
    out = ["## Full protocol (WikiText-2 test, 4 windows x 2048, bf16, full-window fake-quant)\n",
           "| model | recipe | K b/elt | V b/elt | bf16 PPL | PPL | ΔPPL |", "|---|---|---|---|---|---|---|"]
    for model in ("smollm2-135m", "gemma3-270m"):
        for r in rows(HERE / f"ppl_full_{model}.jsonl"):
            out.append(f"| {model} | `{r['variant']}` | {r['bits_k']:.2f} | {r['bits_v']:.2f} | {r['ref_ppl']:.3f} | "
                       f"{r['ppl']:.3f} | {r['delta_pct']:+.2f}% |")
    out.append("\n## Search protocol (2 windows x 1024)\n")
    for model in ("smollm2-135m", "gemma3-270m"):
        recs = {}
        for r in rows(HERE / f"ppl_{model}.jsonl"):
            recs[r["variant"]] = r  # last one wins
        if not recs:
            continue
        ref = next(iter(recs.values()))["ref_ppl"]
        out.append(f"### {model}: ΔPPL vs bf16 (WikiText-2 test, 2 windows x 1024, full-window fake-quant, "
                   f"bf16 PPL {ref:.3f}; sink 64, recent 256, group 128 or head_dim; rotations fitted on stdlib)\n")
        out.append("| rotation | INT4 | INT4 + Lloyd-Max | INT2 | INT2 + Lloyd-Max |")
        out.append("|---|---|---|---|---|")
        for rot in ("none", "hadamard", "per-layer", "per-head"):
            cells = []
            for kv, lm in (("int4", ""), ("int4", ",lm=gauss"), ("int2", ""), ("int2", ",lm=gauss")):
                r = recs.get(f"kv={kv},rot={rot}{lm}")
                cells.append(f"{r['delta_pct']:+.2f}%" if r else "—")
            out.append(f"| {rot} | " + " | ".join(cells) + " |")
        bits = {kv: next((r for v, r in recs.items() if v.startswith(f"kv={kv},")), None) for kv in ("int4", "int2")}
        out.append("\nbits/elt (K = V, fp16 scale+zero or mean+std per group): "
                   + ", ".join(f"{k.upper()} {r['bits_k']:.2f}" for k, r in bits.items() if r) + "\n")
        others = [r for v, r in recs.items() if not any(v == f"kv={kv},rot={rot}{lm}" for kv in ("int4", "int2")
                  for rot in ("none", "hadamard", "per-layer", "per-head") for lm in ("", ",lm=gauss"))]
        if others:
            out.append("| other recipe | K b/elt | V b/elt | ΔPPL |")
            out.append("|---|---|---|---|")
            for r in others:
                out.append(f"| `{r['variant']}` | {r['bits_k']:.2f} | {r['bits_v']:.2f} | {r['delta_pct']:+.2f}% |")
            out.append("")
        scr = rows(HERE / f"screen_{model}.jsonl")
        if scr:
            out.append("Screen (mean per-layer attention-output error, 1 window x 1024, lower is better):\n")
            out.append("| variant | K b/elt | V b/elt | mean dB | worst layer dB |")
            out.append("|---|---|---|---|---|")
            for r in scr:
                out.append(f"| `{r['variant']}` | {r['bits_k']:.2f} | {r['bits_v']:.2f} | {r['mean_db']:.2f} | {r['max_db']:.2f} |")
            out.append("")
    text = "\n".join(out) + "\n"
    (HERE / "TABLES.md").write_text(text)
    sys.stdout.write(text)


if __name__ == "__main__":
    main()
