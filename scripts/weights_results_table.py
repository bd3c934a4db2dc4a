"""Render the weight-quantization rows of several hosts side by side (markdown), from the
results files scripts/weights_ppl_table.py writes.

    .venv/bin/python scripts/weights_results_table.py \\
        cpu=benchmarks/results/weights/smollm2-135m-cpu.jsonl h200=benchmarks/results/weights/smollm2-135m-h200.jsonl

One line per row name (SCHEME-METHOD[-rot][-noclip][-smooth=A]); per host PPL and ΔPPL against that
host's own fp32 PPL; '-' where a host did not measure the row.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(argv: list[str]) -> None:
    hosts = [a.split("=", 1) for a in argv]
    data = {}
    order: list[str] = []
    for label, path in hosts:
        rows = {}
        for line in Path(path).read_text().splitlines():
            r = json.loads(line)
            rows[r["row"]] = r
            if r["row"] != "fp32" and r["row"] not in order:
                order.append(r["row"])
        data[label] = rows
    head = "| scheme | method | rotation | options | " + " | ".join(f"{h} PPL | {h} ΔPPL" for h, _ in hosts) + " |"
    print(" ".join(f"fp32 PPL ({h}) {data[h]['fp32']['ppl']:.3f};" for h, _ in hosts))
    print()
    print(head)
    print("|" + "---|" * (4 + 2 * len(hosts)))
    for name in sorted(order, key=lambda n: (_first(data, n)["scheme"], _first(data, n)["method"], n)):
        r0 = _first(data, name)
        opts = " ".join(f for f in r0.get("flags", []) if f != "rotate") or "-"
        cells = []
        for h, _ in hosts:
            r = data[h].get(name)
            cells += ["-", "-"] if r is None else [f"{r['ppl']:.3f}", f"{r['delta_pct']:+.2f}%"]
        print(f"| {r0['scheme']} | {r0['method']} | {'hadamard' if r0['rotate'] else 'none'} | {opts} | "
              + " | ".join(cells) + " |")


def _first(data: dict, name: str) -> dict:
    return next(rows[name] for rows in data.values() if name in rows)


if __name__ == "__main__":
    main(sys.argv[1:])
