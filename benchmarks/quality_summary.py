"""Collect measured `lowbit eval` runs (PPL and --task needle JSONs) into results/quality/summary.json.

    python benchmarks/quality_summary.py results/quality/*.json
    python benchmarks/quality_summary.py --update NEW.json ...   # these runs' rows replace the same (model, recipe)
                                                                 # rows of the committed summary; others are kept

Rows: {"model", "recipe", "bits_held", "context", "delta_ppl_pct", "needle_rel_bf16", "data"}, one per
(model, recipe) seen in a PPL run; needle_rel_bf16 from a needle run of the same model and recipe name,
else null. bits_held: lowbit.kv.held (the one home of held bits) at the PPL run's context and chunk,
checked against the bits the run measured from the cache's tensors (codebooks aside). Nothing here
is estimated: a number is copied from a run's JSON or computed from the recipe it ran.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "results" / "quality" / "summary.json"


def _held(model: str, row: dict, context: int, chunk: int):
    from lowbit.kv.held import held_bits
    from lowbit.models import ModelGeometry
    from lowbit.models.registry import BUILTINS
    from lowbit.kv.scheme import kv_scheme_from_dict

    if row["kind"] in ("reference", "hf-quantized"):  # bf16; HF peers: only their measured bits exist
        return None if row["kind"] == "reference" else row.get("bits_per_elt")
    cfg = BUILTINS[model].config_dict()
    geo = ModelGeometry.from_config(cfg, name=model)
    conf = {k: v for k, v in row["config"].items() if k not in ("cache", "describe")}
    scheme = kv_scheme_from_dict(conf)
    h = held_bits(scheme, context, geometry=geo, chunk=chunk)
    measured = row.get("bits_per_elt")
    if measured is not None and h.bits is not None:
        cb = h._sum("codebook_bits") / (h._sum("elements_k") + h._sum("elements_v"))
        assert abs(h.bits - cb - measured) < 1e-3, (model, row["scheme"], h.bits, measured)
    return h.bits


def main(paths: list[str]) -> int:
    from lowbit.recipes import index

    update = paths[:1] == ["--update"]
    if update:
        paths = paths[1:]

    ppl, needle = [], {}
    for p in paths:
        d = json.loads(Path(p).read_text())
        if d.get("kind") == "lowbit.eval":
            ppl.append((p, d))
        elif d.get("kind") == "lowbit.eval.needle":
            for r in d["results"]:
                needle[(d["model"]["name"], r["scheme"])] = (r["needle_rel_bf16"], d["protocol"], p)
    rows = []
    seen = set()
    for p, d in ppl:
        model, pr = d["model"]["name"], d["protocol"]
        for r in d["results"]:
            if r["status"] != "ok" or (model, r["scheme"]) in seen:
                continue
            seen.add((model, r["scheme"]))
            n = needle.get((model, r["scheme"]))
            data = (f"wikitext2 test, {pr['windows']} x {pr['seq_len']} tokens, chunk {pr['chunk']}, through the "
                    f"real cache ({Path(p).name})")
            if n:
                data += (f"; needle: PG essays, lengths {n[1]['lengths']}, depths {len(n[1]['depths'])}, "
                         f"{n[1]['trials']} trial(s), chunk {n[1]['chunk']} ({Path(n[2]).name})")
            row = {"model": model, "recipe": r["scheme"], "bits_held": _held(model, r, pr["seq_len"], pr["chunk"]),
                   "context": pr["seq_len"], "delta_ppl_pct": r["delta_ppl_pct"],
                   "needle_rel_bf16": n[0] if n else None, "data": data}
            shipped = index().get(r["scheme"])
            if shipped:  # a `lowbit tune` recipe: its budget is held bits at its own context, beside this run's
                row.update({"budget": shipped["budget"], "budget_context": shipped["context"],
                            "bits_held_at_budget_context": shipped["held_bits"]})
            rows.append(row)
    if update:  # a re-run of a recipe (say a re-shipped one) replaces its row where it stood
        new = {(r["model"], r["recipe"]): r for r in rows}
        old = json.loads(OUT.read_text())["rows"]
        rows = [new.pop((r["model"], r["recipe"]), r) for r in old] + list(new.values())
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    print(f"wrote {OUT} ({len(rows)} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
