# usage: PYTHONPATH=src python benchmarks/ruler_relabel_vllm_bits.py IN.json OUT.json (also writes OUT.md)
"""Ruler reports written before commit 'needle/ruler: a vLLM peer's held bits are those of its quantized
layers' carry a vLLM row's all-layer bits; rewrite that one field to the quantized-layer convention."""
import json
import sys
from pathlib import Path

from lowbit.eval.peers_vllm import held_bits
from lowbit.eval.ruler_task import ruler_markdown
from lowbit.models.geometry import ModelGeometry

src, dst = Path(sys.argv[1]), Path(sys.argv[2])
r = json.loads(src.read_text())
geo = ModelGeometry.from_config(json.loads((Path(r["model"]["path"]) / "config.json").read_text()))
for row in r["results"]:
    if row["kind"] == "vllm-peer":
        q = held_bits(row["scheme"], geo)["bits_quantized"]
        row["bits_held"] = {k: q for k in row["bits_held"]}
r["protocol"]["note"] = "vLLM rows' bits_held rewritten to their quantized layers' bits (scripts relabel, no rerun)"
dst.write_text(json.dumps(r, indent=1) + "\n")
dst.with_suffix(".md").write_text(ruler_markdown(r))
