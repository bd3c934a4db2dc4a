"""Issue 16 item 6 on CPU: `lowbit serve --model random:GEOMETRY` and the streaming load test around it.

scripts/serve_load_gpu.sh runs end to end with the tiny-llama geometry (eager batch engine, int2 with the
packed middle in use), so the one device call is unlikely to fail on a typo; scripts/serve_load.py's
target ratio against a `lowbit bench decode` row; the random model's runtime (word tokenizer, no EOS)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from lowbit.core.errors import LowbitError

ROOT = Path(__file__).resolve().parents[2]


def _client():
    spec = importlib.util.spec_from_file_location("serve_load", ROOT / "scripts" / "serve_load.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_random_runtime_has_word_tokens_and_no_eos():
    from lowbit.serve.loader import load_runtime

    rt = load_runtime("random:tiny-llama", max_context=99)
    assert rt.eos_token_ids == [] and rt.max_context == 99 and rt.name == "random:tiny-llama"
    assert rt.tokenizer.encode("t5 t999 t17") == [5, 999, 17]  # one word, one token: prompts of N words are N
    assert rt.tokenizer.decode([3, 41]) == "t3 t41"
    assert rt.model.config.num_hidden_layers == 2 and str(next(rt.model.parameters()).device) == "cpu"
    assert rt.scheme.name == "bf16" and rt.geometry.name == "random-tiny-llama"


def test_random_runtime_refuses_bad_input():
    from lowbit.serve.loader import load_runtime

    with pytest.raises(LowbitError, match="unknown geometry 'llama9'.*random:llama3-8b"):
        load_runtime("random:llama9")
    with pytest.raises(LowbitError, match="--weights cannot be combined"):
        load_runtime("random:tiny-llama", weights="/tmp")
    with pytest.raises(LowbitError, match="exceeds the model's 32768 positions"):
        load_runtime("random:tiny-llama", max_context=32769)


def test_serve_device_flag_is_checked(capsys):
    from lowbit.cli import main

    rc = main(["serve", "--model", "random:tiny-llama", "--device", "tpu", "--port", "0"])
    assert rc != 0
    assert "--device 'tpu'" in capsys.readouterr().err


def test_target_ratio_against_the_bench_row(tmp_path):
    from lowbit.kv.scheme import parse_kv_scheme
    from lowbit.serve.loader import load_runtime
    from lowbit.serve.server import BackgroundServer, build

    sl = _client()
    rt = load_runtime("random:tiny-llama", kv=parse_kv_scheme("int2"), max_context=64)
    engine, app = build(rt, max_active=3, prefill_chunk=64, engine="batch")  # one chunk a prompt
    bench = tmp_path / "bench.json"
    # a fitting B=3 row of another path first: lowbit-int2 is the one taken
    bench.write_text(json.dumps({"env": {"gpu": "Fake GPU/9"}, "rows": [
        {"path": "lowbit-bf16", "B": 3, "L": 21, "fits": True, "tok_s": 1.0, "ms_per_step": 3000.0},
        {"path": "lowbit-int2", "B": 3, "L": 21, "fits": True, "tok_s": 1e6, "ms_per_step": 0.003},
        {"path": "lowbit-int2", "B": 1, "L": 21, "fits": True, "tok_s": 5.0, "ms_per_step": 200.0}]}))
    with BackgroundServer(engine, app) as srv:
        rc = sl.main(["--url", srv.url, "--concurrency", "3,1", "--prompt-tokens", "21", "--max-tokens", "5",
                      "--bench-json", str(bench), "--out-dir", str(tmp_path)])
    assert rc == 0
    d = json.loads((tmp_path / "serve_load_Fake_GPU_9.json").read_text())
    assert [lv["concurrency"] for lv in d["levels"]] == [3, 1]
    for lv in d["levels"]:
        assert lv["ok"] == lv["requests"] == lv["concurrency"] and lv["errors"] == 0
        assert lv["prompt_tokens"] == [21] and lv["completion_tokens"] == 5 * lv["concurrency"]
        assert lv["one_chunk_per_token"] and lv["finish_reasons"] == ["length"]
        assert lv["ttft_ms"]["p50"] <= lv["ttft_ms"]["p99"] <= lv["ttft_ms"]["max"]
        assert lv["aggregate_decode_tok_s"] > 0 and lv["itl_ms"]["p50"] > 0
        assert 0 < lv["server_busy_s"] and 0 < lv["server_busy_fraction"] < 1.05
    t = d["target"]
    assert t["level"] == 3 and t["bench_tok_s"] == 1e6 and d["decode_benchmark"]["path"] == "lowbit-int2"
    assert t["ratio"] == round(d["levels"][0]["aggregate_decode_tok_s"] / 1e6, 4) and t["met"] is False
    # the server saw the warm-up and both levels
    assert d["levels"][-1]["server_metrics"]["requests"]["completions"] == 1 + 3 + 1


@pytest.mark.slow  # three processes (bench, server, client) import torch / openai: 20-50 s on 2 shared cores
def test_gpu_script_end_to_end_on_cpu(tmp_path):
    out = tmp_path / "out"
    # 330-token prompts: past sink 64 + recent 256, so the int2 middle holds tokens
    p = subprocess.run(["bash", str(ROOT / "scripts" / "serve_load_gpu.sh"), str(out), "--geometry", "tiny-llama",
                        "--device", "cpu", "--levels", "1,3", "--prompt", "330", "--max-tokens", "6",
                        "--python", sys.executable], check=False, capture_output=True, text=True, timeout=240,
                       cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "server stopped" in p.stdout
    d = json.loads((out / "serve_load_cpu.json").read_text())
    assert [lv["ok"] for lv in d["levels"]] == [1, 3] and all(lv["one_chunk_per_token"] for lv in d["levels"])
    assert d["levels"][1]["prompt_tokens"] == [330] and d["params"]["max_tokens"] == 6
    assert d["server"]["card"]["lowbit"]["engine"]["path"] == "eager"
    assert d["server"]["card"]["lowbit"]["kv_scheme"]["name"] == "int2"
    assert d["server"]["card"]["max_model_len"] == 330 + 6 + 16
    assert "--max-active 3" in d["server"]["command"]
    metrics = d["levels"][1]["server_metrics"]
    assert metrics["kv"]["quantized_tokens_total_finished"] > 0
    # on CPU the bench step only proves its command line parses: bench decode refuses without CUDA
    assert "needs a CUDA GPU" in (out / "bench.log").read_text()
    assert d["target"]["ratio"] is None and "was not written" in d["target"]["note"]
    # the server is gone: nothing listens on its port any more
    import urllib.request

    with pytest.raises(OSError):
        urllib.request.urlopen(d["server"]["url"] + "/health", timeout=2)
