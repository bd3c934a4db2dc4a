"""Weight-quantization quality table on a real model: WikiText-2 PPL of each scheme x method x rotation.

Protocol (the one DESIGN.md's llm-compressor numbers use): WikiText-2 test, N windows x L tokens,
full-window teacher forcing (lowbit.eval.perplexity.full_window_ppl); calibration on stdlib pydoc
text, 128 x 512 tokens. Every quantized row goes through the exported checkpoint: quantize ->
save_compressed -> load_quantized -> PPL, so the number belongs to the files on disk.

    .venv/bin/python benchmarks/weights_ppl_table.py --out runs/weights-table \\
        --configs w4a16-g64-asym:rtn,w4a16-g64-asym:gptq,w4a16-g64-asym:rtn:rotate,w4a16-g64-asym:gptq:rotate

Config flags after SCHEME:METHOD: rotate, noclip, wclip, noseq, noact, damp=X, smooth=ALPHA|auto
(SmoothQuant before quantizing; calibrated on the same calibration tokens), tune=STEPS and tlr=X
(end-to-end scale tuning after the method, lowbit.weights.tune_scales); METHOD signround takes
iters=N and lr=X.
--device cuda runs calibration, GPTQ and the evaluation on a GPU (export and reload stay on CPU);
--save-tokens / --tokens carry the exact token ids (eval windows + calibration) to another host,
whose Python stdlib (the calibration text) may differ.

Writes OUT/results.jsonl (one line per row, appended as each finishes) and OUT/table.md; each
checkpoint goes to OUT/ckpt-<row>/ (delete them after if space matters).
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import shutil
import time
import traceback
from pathlib import Path

import torch

from lowbit.calib.corpora import load_text, token_windows
from lowbit.eval.perplexity import full_window_ppl
from lowbit.models import load
from lowbit.weights.apply import quantize_model
from lowbit.weights.scheme import parse_weight_scheme
from lowbit.weights.signround import SignRoundConfig
from lowbit.weights.tune_scales import ScaleTuneConfig, tune_scales

ALL = ",".join(f"{s}:{m}{r}" for s in ("w4a16-g64-asym", "w8a16", "w8a8", "w4a8-g64")
               for r in ("", ":rotate") for m in ("rtn", "gptq"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out", required=True)
    ap.add_argument("--configs", default=ALL, help="comma list of SCHEME:METHOD[:rotate]")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--data", default="wikitext2")
    ap.add_argument("--calib", default="stdlib")
    ap.add_argument("--calib-seqs", type=int, default=128)
    ap.add_argument("--calib-seq-len", type=int, default=512)
    ap.add_argument("--calib-dtype", choices=("float32", "bfloat16"), default="bfloat16")
    ap.add_argument("--damp", type=float, default=0.01)
    ap.add_argument("--keep-checkpoints", action="store_true")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--skip-fp32", action="store_true", help="take the fp32 PPL from results.jsonl or --base-ppl")
    ap.add_argument("--base-ppl", type=float, default=None)
    ap.add_argument("--device", default="cpu", help="cpu | cuda: where calibration, GPTQ and evaluation run")
    ap.add_argument("--save-tokens", default=None, help="write the eval windows and calibration ids here and exit")
    ap.add_argument("--tokens", default=None, help="read the eval windows and calibration ids from --save-tokens' file")
    ap.add_argument("--keep-going", action="store_true", help="log a failing row and go on with the next")
    ap.add_argument("--in-memory", action="store_true",
                    help="evaluate the quantized model in memory instead of the exported+reloaded checkpoint")
    ap.add_argument("--host", default=None, help="label recorded in each row (which machine measured it)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    logging.basicConfig(level=logging.WARNING)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    res_path = out / "results.jsonl"

    lm = load(a.model, dtype=torch.float32)
    tok = lm.tokenizer
    if a.tokens:
        saved = torch.load(a.tokens)
        windows, calib = saved["windows"], saved["calib"]
    else:
        windows = token_windows(tok, load_text(a.data), a.seq_len, a.windows)
        calib = token_windows(tok, load_text(a.calib), a.calib_seq_len, a.calib_seqs)
    if a.save_tokens:
        torch.save({"windows": windows, "calib": calib, "weights_sha256": lm.weights_sha256}, a.save_tokens)
        print(f"saved {tuple(windows.shape)} eval + {tuple(calib.shape)} calibration ids -> {a.save_tokens}")
        return
    dev = torch.device(a.device)
    windows, calib = windows.to(dev), calib.to(dev)
    lm.model.to(dev)
    done = {json.loads(x)["row"]: json.loads(x) for x in res_path.read_text().splitlines()} if res_path.exists() else {}
    if "fp32" not in done and a.base_ppl is not None:
        done["fp32"] = {"ppl": a.base_ppl}
    if "fp32" not in done:
        t = time.perf_counter()
        ppl = full_window_ppl(lm.model, windows)
        _append(res_path, {"row": "fp32", "ppl": ppl, "eval_s": round(time.perf_counter() - t, 1), "host": a.host,
                           "device": a.device, "weights_sha256": lm.weights_sha256})
        done["fp32"] = {"ppl": ppl}
    base = done["fp32"]["ppl"]
    print(f"fp32 PPL {base:.3f}", flush=True)

    cd = torch.bfloat16 if a.calib_dtype == "bfloat16" else None
    for cfg in a.configs.split(","):
        parts = cfg.split(":")
        scheme, method, flags = parse_weight_scheme(parts[0]), parts[1], parts[2:]
        rotate = "rotate" in flags
        opts = {"clip_search": "noclip" not in flags, "weighted_clip": "wclip" in flags,
                "sequential": "noseq" not in flags, "damp": a.damp, "act_order": "noact" not in flags}
        for f in flags:
            if f.startswith("damp="):
                opts["damp"] = float(f[5:])
            if f.startswith("smooth="):
                opts["smooth"] = "auto" if f[7:] == "auto" else float(f[7:])
        tn = {k: float(f.split("=")[1]) for f in flags for k in ("tune", "tlr") if f.startswith(k + "=")}
        if "tune" in tn:
            opts["tune"] = ScaleTuneConfig(steps=int(tn["tune"]), **({"lr": tn["tlr"]} if "tlr" in tn else {}))
        if method == "signround":
            sr = {k: float(f.split("=")[1]) for f in flags for k in ("iters", "lr") if f.startswith(k + "=")}
            opts["signround"] = SignRoundConfig(iters=int(sr.get("iters", 200)), lr=sr.get("lr"))
        row = "-".join([scheme.name, method] + [f.replace("rotate", "rot") for f in flags])
        if row in done:
            continue
        try:
            _run_row(a, lm, tok, windows, calib, dev, cd, out, res_path, base, scheme, method, flags, rotate, opts, row)
        except Exception:
            if not a.keep_going:
                raise
            traceback.print_exc()
            print(f"{row}: FAILED (see above); going on", flush=True)
    _table(res_path, out / "table.md", base)


_BASE: dict = {}  # the last tuned row's base: {key: (quantized model before tuning, report, seconds)}


def _run_row(a, lm, tok, windows, calib, dev, cd, out, res_path, base, scheme, method, flags, rotate, opts, row):
    """Quantize one row, export + reload (unless --in-memory), evaluate, append its record.

    Rows that differ only in their scale tuning settings (tune=, tlr=) share one quantization: the
    base model is kept in memory and each row tunes a copy of it against the unquantized model.
    """
    from lowbit.weights.export import save_compressed  # (compressed-tensors: not needed --in-memory)
    from lowbit.weights.load import load_quantized
    t = time.perf_counter()
    use_calib = method != "rtn" or "smooth" in opts or "tune" in opts
    tune = opts.pop("tune", None)
    if tune is None:
        model = copy.deepcopy(lm.model)
        rep = quantize_model(model, scheme, method=method, calib=calib if use_calib else None, rotate=rotate,
                             calib_dtype=cd, **opts)
    else:
        key = "-".join([scheme.name, method] + [f for f in flags if not f.startswith(("tune=", "tlr="))])
        if key not in _BASE:
            _BASE.clear()
            m0 = copy.deepcopy(lm.model)
            r0 = quantize_model(m0, scheme, method=method, calib=calib if use_calib else None, rotate=rotate,
                                calib_dtype=cd, **opts)
            _BASE[key] = (m0, r0, time.perf_counter() - t)
            t = time.perf_counter()
        m0, r0, base_s = _BASE[key]
        model, rep = copy.deepcopy(m0), copy.deepcopy(r0)
        ac = (lambda: torch.autocast(dev.type, dtype=cd)) if cd is not None else None
        rep.scale_tuning = {"config": tune.to_dict(), **tune_scales(model, lm.model, calib, tune, autocast=ac)}
        rep.scale_tuning["seconds"] = round(time.perf_counter() - t, 1)
        rep.calib_tokens = int(calib.numel())
        t -= base_s  # quantize_s: the base quantization + this tuning
    q_s = time.perf_counter() - t
    ck = out / f"ckpt-{row}"
    if a.in_memory:
        qm, ck = model, None
    else:
        model.to("cpu")
        save_compressed(model, tok, scheme, ck, inputs={"model": lm.name, "weights_sha256": lm.weights_sha256},
                        recipe={"scheme": scheme.to_dict(), "method": method, "rotation": rep.rotation,
                                "smoothing": rep.smoothing, "scale_tuning": rep.scale_tuning},
                        counts=rep.counts(), ignore=["lm_head"])
        del model
        qm, _ = load_quantized(ck)
        qm.to(dev)
    t = time.perf_counter()
    ppl = full_window_ppl(qm, windows)
    r = {"row": row, "scheme": scheme.name, "method": method, "rotate": rotate, "flags": flags, "ppl": ppl,
         "threads": torch.get_num_threads(), "host": a.host, "device": a.device, "smoothing": rep.smoothing,
         "delta_pct": 100 * (ppl / base - 1), "quantize_s": round(q_s, 1), "eval_s": round(time.perf_counter() - t, 1),
         "counts": rep.counts(), "damp_raised": rep.damp_raised,
         "signround": None if method != "signround" else {"config": opts["signround"].to_dict(), "layers": rep.signround},
         "scale_tuning": rep.scale_tuning,
         "ckpt_bytes": None if ck is None else sum(f.stat().st_size for f in ck.glob("*.safetensors")),
         "evaluated": "in-memory" if ck is None else "exported checkpoint"}
    _append(res_path, r)
    del qm
    st = rep.scale_tuning
    kl = "" if st is None else f"  holdout KL {st['kl_holdout_before']:.4f} -> {st['kl_holdout_after']:.4f}"
    print(f"{row:28s} PPL {ppl:8.3f}  {r['delta_pct']:+7.2f}%  quantize {q_s:6.1f}s{kl}", flush=True)
    if ck is not None and not a.keep_checkpoints:
        _remove(ck)


def _remove(d: Path) -> None:
    """Delete a checkpoint dir (artifacts are written read-only)."""
    for p in [d, *d.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    shutil.rmtree(d)


def _append(path: Path, rec: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")


def _table(res_path: Path, md: Path, base: float) -> None:
    rows = [json.loads(x) for x in res_path.read_text().splitlines()]
    lines = [f"fp32 PPL {base:.3f}", "", "| scheme | method | rotation | options | PPL | ΔPPL | quantize s (threads) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["row"] == "fp32":
            continue
        opts = " ".join(f for f in r.get("flags", []) if f != "rotate") or "-"
        lines.append(f"| {r['scheme']} | {r['method']} | {'hadamard' if r['rotate'] else 'none'} | {opts} | {r['ppl']:.3f} | "
                     f"{r['delta_pct']:+.2f}% | {r['quantize_s']} ({r.get('threads', '?')}) |")
    md.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
