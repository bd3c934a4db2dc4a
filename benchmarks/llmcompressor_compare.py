"""llm-compressor side by side with lowbit: quantize with llm-compressor, evaluate in lowbit's harness.

Two modes, two interpreters (llm-compressor pins its own transformers / compressed-tensors, so it
lives in its own venv; see scripts/llmcompressor_compare.sh):

    <llmc venv>/bin/python benchmarks/llmcompressor_compare.py quantize MODEL_DIR OUT_ROOT [--rows ...]
        one compressed-tensors checkpoint per row under OUT_ROOT/llmc-<row>; imports nothing of lowbit
    .venv/bin/python benchmarks/llmcompressor_compare.py eval OUT_ROOT
        WikiText-2 PPL of every OUT_ROOT/llmc-* through lowbit.weights.load_quantized and the same
        full-window harness as benchmarks/weights_ppl_table.py -> OUT_ROOT/llmc_results.jsonl

Calibration is the same 128 x 512 tokens of stdlib pydoc text as lowbit's (the text is rebuilt here
the way lowbit.calib.corpora.stdlib_text builds it: topics sorted, joined by blank lines).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROWS = ("w4a16-g64-rtn", "w8a8-rtn", "w8a8-sq-rtn", "w4a16-g64-gptq", "w8a8-gptq", "w8a8-sq-gptq")
SQ_ALPHA = 0.5  # SmoothQuantModifier smoothing_strength (its default mappings: the two norms -> q/k/v, gate/up)


def _weights_args(row: str) -> dict:
    if row.startswith("w4a16-g64"):
        return {"weights": {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 64,
                            "actorder": "static" if row.endswith("gptq") else None}}
    if row.startswith("w8a8"):
        return {"weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
                "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                                      "dynamic": True}}
    raise SystemExit(f"unknown row {row}")


def quantize(model_dir: str, out_root: str, rows, n: int, seq_len: int) -> None:
    from pydoc_data.topics import topics

    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    text = "\n\n".join(topics[k] for k in sorted(topics))
    ids = tok(text, add_special_tokens=False)["input_ids"][: n * seq_len]
    ds = Dataset.from_dict({"input_ids": [ids[i * seq_len:(i + 1) * seq_len] for i in range(n)],
                            "attention_mask": [[1] * seq_len for _ in range(n)]})
    for row in rows:
        out = Path(out_root) / f"llmc-{row}"
        if out.exists():
            continue
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        groups = {"group_0": {"targets": ["Linear"], **_weights_args(row)}}
        if row.endswith("gptq"):
            mod = GPTQModifier(config_groups=groups, ignore=["lm_head"], block_size=128, dampening_frac=0.01)
        else:
            mod = QuantizationModifier(config_groups=groups, ignore=["lm_head"])
        recipe = [mod]
        if "-sq-" in row:
            try:
                from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier
            except ImportError:
                from llmcompressor.modifiers.smoothquant import SmoothQuantModifier
            recipe = [SmoothQuantModifier(smoothing_strength=SQ_ALPHA), mod]
        calibrated = row.endswith("gptq") or "-sq-" in row
        t = time.perf_counter()
        oneshot(model=model, dataset=ds if calibrated else None, recipe=recipe, max_seq_length=seq_len,
                num_calibration_samples=n)
        secs = time.perf_counter() - t
        model.save_pretrained(out, save_compressed=True)
        tok.save_pretrained(out)
        (out / "llmc_info.json").write_text(json.dumps({"row": row, "quantize_s": round(secs, 1)}))
        print(f"{row}: {secs:.1f}s -> {out}", flush=True)


def evaluate(out_root: str, windows: int, seq_len: int) -> None:
    import torch

    from lowbit.calib.corpora import load_text, token_windows
    from lowbit.eval.perplexity import full_window_ppl
    from lowbit.weights.load import load_quantized

    res = Path(out_root) / "llmc_results.jsonl"
    done = {json.loads(x)["row"] for x in res.read_text().splitlines()} if res.exists() else set()
    for d in sorted(Path(out_root).glob("llmc-*")):
        info = json.loads((d / "llmc_info.json").read_text())
        if info["row"] in done:
            continue
        model, tok = load_quantized(d, dtype=torch.float32)
        w = token_windows(tok, load_text("wikitext2"), seq_len, windows)
        t = time.perf_counter()
        ppl = full_window_ppl(model, w)
        rec = {**info, "ppl": ppl, "eval_s": round(time.perf_counter() - t, 1)}
        with open(res, "a") as f:
            f.write(json.dumps(rec) + "\n")
        print(f"{info['row']:20s} PPL {ppl:.3f}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=("quantize", "eval"))
    ap.add_argument("paths", nargs="+", help="quantize: MODEL_DIR OUT_ROOT; eval: OUT_ROOT")
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--calib-seqs", type=int, default=128)
    ap.add_argument("--calib-seq-len", type=int, default=512)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    a = ap.parse_args()
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    if a.mode == "quantize":
        quantize(a.paths[0], a.paths[1], a.rows.split(","), a.calib_seqs, a.calib_seq_len)
    else:
        evaluate(a.paths[0], a.windows, a.seq_len)
    return 0


if __name__ == "__main__":
    sys.exit(main())
