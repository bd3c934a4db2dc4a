"""`lowbit bench`: where results go (./lowbit-results/ of the working directory, never the source tree),
never overwriting a file, and one-line errors without a GPU. The timing itself needs CUDA; here
`lowbit.tools.bench.attention.run` is replaced by a recorder so the command's path logic runs on CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import lowbit
from lowbit.cli import build_parser, main
from lowbit.commands import bench as cmd
from lowbit.core.errors import LowbitError
from lowbit.tools.bench import attention as kbench

SRC = Path(lowbit.__file__).resolve().parent.parent  # .../src


@pytest.mark.parametrize("gpu, name", [
    ("NVIDIA H200", "decode_attention_NVIDIA_H200.json"),
    ("NVIDIA GeForce RTX 4090 (x/y)", "decode_attention_NVIDIA_GeForce_RTX_4090_x_y_.json"),
    ("  ", "decode_attention_gpu.json"),
])
def test_default_out_is_under_cwd_lowbit_results(tmp_path, gpu, name):
    p = cmd.default_out("decode-attention", gpu, cwd=tmp_path)
    assert p == tmp_path / "lowbit-results" / name
    assert SRC not in p.parents


def test_default_out_follows_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert build_parser().parse_args(["bench", "decode-attention"]).out is None
    p = cmd.resolve_out(None, "decode-attention", "NVIDIA H200")
    assert p == tmp_path / "lowbit-results" / "decode_attention_NVIDIA_H200.json"
    # a relative --out is relative to the working directory too
    assert cmd.resolve_out("a/b.json", "decode-attention", "x") == tmp_path / "a" / "b.json"


def test_resolve_out_refuses_an_existing_file(tmp_path):
    f = tmp_path / "r.json"
    f.write_text("{}")
    with pytest.raises(LowbitError, match="never overwritten"):
        cmd.resolve_out(str(f), "decode-attention", "x")
    (tmp_path / "lowbit-results").mkdir()
    (tmp_path / "lowbit-results" / "decode_attention_G.json").write_text("{}")
    with pytest.raises(LowbitError, match="exists"):
        cmd.resolve_out(None, "decode-attention", "G", cwd=tmp_path)


def test_write_new_never_overwrites_and_leaves_no_temporary(tmp_path):
    p = tmp_path / "deep" / "er" / "out.json"
    cmd.write_new(p, {"rows": [1, 3, 99]})
    assert json.loads(p.read_text()) == {"rows": [1, 3, 99]}
    with pytest.raises(LowbitError, match="never overwritten"):
        cmd.write_new(p, {"rows": []})
    assert json.loads(p.read_text()) == {"rows": [1, 3, 99]}
    assert sorted(x.name for x in p.parent.iterdir()) == ["out.json"]


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_no_gpu_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "decode-attention"]) == 2
    assert "needs a CUDA GPU" in _one_line_error(capsys)
    assert not (tmp_path / "lowbit-results").exists()


def test_existing_out_is_refused_before_anything_runs(tmp_path, monkeypatch, capsys):
    f = tmp_path / "old.json"
    f.write_text('{"keep": 1}')
    monkeypatch.setattr(kbench, "run", lambda *a, **k: pytest.fail("benchmark ran"))
    assert main(["bench", "decode-attention", "--out", str(f)]) == 2
    assert "never overwritten" in _one_line_error(capsys)
    assert f.read_text() == '{"keep": 1}'


@pytest.fixture
def fake_gpu(monkeypatch):
    """CUDA 'available', and the benchmark replaced by a recorder of its arguments."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H200")

    def run(batches, lengths, geos, bits, mem_cap_gb):
        calls.append((batches, lengths, geos, bits, mem_cap_gb))
        return {"env": {"gpu": "NVIDIA H200"}, "rows": [{"B": batches[0]}]}

    monkeypatch.setattr(kbench, "run", run)
    return calls


def test_run_writes_the_default_path_once(tmp_path, monkeypatch, capsys, fake_gpu):
    monkeypatch.chdir(tmp_path)
    argv = ["bench", "decode-attention", "--batch", "3", "--length", "1,4k", "--geometry", "gemma3-1b",
            "--bits", "2"]
    assert main(argv) == 0
    out = tmp_path / "lowbit-results" / "decode_attention_NVIDIA_H200.json"
    assert json.loads(out.read_text())["rows"] == [{"B": 3}]
    assert fake_gpu == [((3,), (1, 4096), ("gemma3-1b",), ((2, 2),), 60.0)]
    assert f"wrote {out}" in capsys.readouterr().out
    # the second run is refused before it spends GPU time, and the first result is kept
    assert main(argv) == 2
    assert "never overwritten" in _one_line_error(capsys)
    assert len(fake_gpu) == 1
    # a new --out is the way to run again
    assert main(argv + ["--out", "again.json"]) == 0
    assert (tmp_path / "again.json").exists() and len(fake_gpu) == 2


@pytest.mark.parametrize("flag, value, match", [
    ("--batch", "1,x", "not a count"),
    ("--length", "4q", "not a count"),
    ("--geometry", "llama9", "unknown geometry"),
])
def test_bad_arguments_are_one_line_errors(tmp_path, monkeypatch, capsys, fake_gpu, flag, value, match):
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "decode-attention", flag, value]) == 2
    assert match in _one_line_error(capsys)
    assert fake_gpu == [] and not (tmp_path / "lowbit-results").exists()


def test_bits_specs_scale_only_rows_and_bytes():
    assert cmd._bit_specs("2,2so,4so,8") == ((2, 2), (2, 2, "so"), (4, 4, "so"), (8, 8))
    for bad in ("8so", "3", "2,x", " , "):
        with pytest.raises(LowbitError, match="--bits"):
            cmd._bit_specs(bad)
    assert [kbench.bits_tag(s) for s in cmd._bit_specs("2,2so")] == ["k2v2", "k2v2so"]
    assert cmd._bit_specs("2s8,4s8") == ((2, 2, "s8"), (4, 4, "s8"))
    assert kbench.bits_tag((2, 2, "s8")) == "k2v2s8"
    assert cmd._bit_specs("2vq") == ((2, 2, "vq"),) and kbench.bits_tag((2, 2, "vq")) == "k2v2vq"
    with pytest.raises(LowbitError, match="2vq"):
        cmd._bit_specs("4vq")
    assert cmd._bit_specs("2rs") == ((2, 2, "rs"),) and kbench.bits_tag((2, 2, "rs")) == "k2v2rs"
    with pytest.raises(LowbitError, match="2rs"):
        cmd._bit_specs("4rs")
    # one-byte scales: a group of 64 at head_dim 128 costs 1 byte, not 2 (and no zero)
    assert kbench.packed_bytes(1, 1, 1, 128, 2, 64, True, one_byte=True) == 2 * (32 + 2)
    assert kbench.packed_bytes(1, 1, 1, 128, 2, 64, True) == 2 * (32 + 4)
    # scale-only groups hold one fp16 per group (no zero): smollm2's D 64 int2 is 16 + 2 bytes a tensor per token
    assert kbench.packed_bytes(1, 3, 10, 64, 2, 64, scale_only=True) == 2 * 3 * 10 * (16 + 2)
    assert kbench.packed_bytes(1, 3, 10, 64, 2, 64) == 2 * 3 * 10 * (16 + 4)
    row = {"geometry": "g", "B": 1, "L": 8, "sdpa_ms": 1.0, "sdpa_tbs": 1.0,
           "k2v2so_ms": 0.5, "k2v2so_ratio": 2.0, "k2v2so_tbs": 0.1}
    assert "k2v2so 0.500 ms x2.00" in kbench.format_row(row, cmd._bit_specs("2,2so"))


def test_scale_only_rows_on_geometry_kernel_geometries_are_refused_before_any_timing(tmp_path, monkeypatch, capsys,
                                                                                      fake_gpu):
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "decode-attention", "--geometry", "llama3-8b,kimi-k192v128", "--bits", "2,2so"]) == 2
    assert "scale-only" in _one_line_error(capsys)
    assert fake_gpu == [] and not (tmp_path / "lowbit-results").exists()


@pytest.mark.parametrize("flags, match", [
    (["--schemes", "w4a16-g128,w5a16"], "unknown scheme"),
    (["--m", "1,5"], "not in the sweep"),
    (["--shapes", "llama3-8b gate/up;llama9 up"], "unknown shape"),
])
def test_bench_gemm_selection_errors_before_any_gpu_work(capsys, flags, match):
    assert main(["bench", "gemm", *flags]) != 0
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_bench_gemm_selection_passes_through(monkeypatch, tmp_path):
    from lowbit.tools.bench import gemm as weight_bench

    seen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "G")
    monkeypatch.setattr(weight_bench, "run", lambda **kw: seen.append(kw) or {"rows": []})
    out = tmp_path / "g.json"
    assert main(["bench", "gemm", "--schemes", "w8a16", "--m", "1,16", "--shapes", "llama3-8b down",
                 "--read-floor", "--out", str(out)]) == 0
    assert seen == [{"schemes": ("w8a16",), "ms": (1, 16), "shapes": ("llama3-8b down",), "read_floor": True}]
    assert json.loads(out.read_text()) == {"rows": []}
