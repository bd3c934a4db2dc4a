"""lowbit.kernels.gemm.humming and its place in the dispatch / bench: the pure parts on CPU (the layout humming is
given against compressed-tensors' packing and against lowbit's dequantization, the refusals, the M buckets, the
dispatch's humming cells, the table built from a sweep, the one-line errors), the kernels themselves on a GPU with
humming-kernels installed (`-m gpu`)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from lowbit.core.errors import LowbitError
from lowbit.kernels.gemm import humming as hg
from lowbit.kernels.gemm import triton_gemm as wg
from lowbit.kernels.gemm.check import DEQUANT_TOL, tolerance
from lowbit.kernels.gemm.dispatch import M_INF, Cell, Dispatch, generic_cells, run_cell, table_cells
from lowbit.kernels.gemm.triton_gemm import random_weight

SCHEMES = ["w4a16-g128", "w4a16-g64-asym", "w4a16-g32", "w8a16", "w8a8", "w4a8"]


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_along_round_trips_and_is_compressed_tensors_order(bits):
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    g = torch.Generator().manual_seed(bits)
    u = torch.randint(0, 2**bits, (24, 64), generator=g)
    w = hg.pack_along(u, bits)
    assert w.dtype == torch.int32 and w.shape == (24, 64 * bits // 32)
    assert torch.equal(hg.unpack_along(w, bits, 64), u)
    q = (u - (1 << (bits - 1))).to(torch.int8)  # compressed-tensors packs signed codes with the 2**(b-1) offset
    assert torch.equal(pack_to_int32(q, bits), w)
    # along dim 0 (compressed-tensors' zero points): the same words, transposed
    assert torch.equal(pack_to_int32(q.t().contiguous(), bits, packed_dim=0), w.t())


@pytest.mark.parametrize("scheme", SCHEMES)
def test_humming_inputs_are_the_compressed_tensors_tensors(scheme):
    """humming's compressed-tensors schema passes `weight_packed` / `weight_zero_point` through unchanged
    (pack-quantized), so humming_inputs must equal what compressed-tensors packs from the same codes."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    pw = random_weight(scheme, 128, 256, "cpu", seed=3)
    t = hg.humming_inputs(pw, torch.bfloat16)
    q = (wg.unpack_int4_k(pw.qweight, pw.K).to(torch.int16) - 8).to(torch.int8) if pw.bits == 4 else pw.qweight
    assert torch.equal(t["weight"], pack_to_int32(q, pw.bits))
    assert t["weight_scale"].shape == (pw.N, pw.K // pw.group) and t["weight_scale"].dtype == torch.bfloat16
    if pw.zero is None:
        assert "zero_point" not in t
    else:  # compressed-tensors' weight_zero_point: the signed zero packed along the output dimension
        assert torch.equal(t["zero_point"], pack_to_int32(pw.zero.t().contiguous(), pw.bits, packed_dim=0))
    if pw.bits == 4:
        assert t["weight"] is pw.qweight  # no copy where the layouts agree


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_humming_formula_on_its_inputs_is_lowbits_weight(scheme, dtype):
    pw = random_weight(scheme, 192, 512, "cpu", seed=5)
    pw.bias = torch.randn(pw.N)
    t = hg.humming_inputs(pw, dtype)
    same_scales = dataclasses.replace(pw, scale=pw.scale.to(dtype))  # humming computes with scales in x's dtype
    assert torch.equal(hg.dequantize_reference(t, pw.bits, pw.N, pw.K), wg.dequantize(same_scales))
    assert torch.equal(t["bias"], pw.bias.to(dtype))
    # and the scale rounding alone is within the bound the audit holds humming to
    assert rel(wg.dequantize(same_scales), wg.dequantize(pw)) < DEQUANT_TOL


def test_schema_args_and_refusals():
    pw = random_weight("w4a16-g128", 256, 256, "cpu")
    assert hg.schema_args(pw) == {"weight": {"b_dtype": "uint4", "weight_scale_group_size": 128,
                                             "has_zero_point": False}, "input": {"a_dtype": "bfloat16"}}
    assert hg.schema_args(random_weight("w8a8", 128, 256, "cpu"))["input"] == {"a_dtype": "int8"}
    assert hg.schema_args(random_weight("w8a16", 128, 256, "cpu"))["weight"]["weight_scale_group_size"] == 0
    assert hg.why_not(pw) is None and hg.why_not(pw, torch.float16) is None
    assert "bf16/fp16" in hg.why_not(pw, torch.float32)
    assert "multiple of 256" in hg.why_not(random_weight("w4a16-g128", 33, 256, "cpu"))
    assert "K=192 is not a multiple of 128" in hg.why_not(random_weight("w8a8", 256, 192, "cpu"))
    assert "smallest" in hg.why_not(random_weight("w4a16-g8", 256, 256, "cpu"))
    assert "smallest" in hg.why_not(random_weight("w4a8-g16", 256, 256, "cpu"))


# (scheme, K, N): whether humming 0.1.10's SM90 heuristics give kernel configurations its checks accept for every M
# bucket (found by building them with its compiler stubbed out); why_not must refuse every shape that fails
SM90_SHAPES = [("w4a16-g128", 1152, 4608, True), ("w4a16-g128", 4608, 1152, False), ("w4a16-g128", 128, 128, False),
               ("w4a16-g128", 128, 768, True), ("w4a16-g128", 4096, 6144, True), ("w4a16-g128", 4096, 960, False),
               ("w8a16", 576, 576, False), ("w8a16", 576, 1536, True), ("w8a16", 1536, 576, False),
               ("w8a8", 576, 1536, False), ("w8a8", 1152, 4608, True), ("w8a8", 128, 768, True),
               ("w4a8", 1152, 1152, True), ("w4a8", 4608, 1152, True), ("w4a8", 128, 128, False),
               ("w4a8", 1536, 576, False), ("w4a16-g32", 576, 1536, True), ("w4a16-g32", 1152, 1152, False),
               ("w4a16-g128", 4096, 14336, True), ("w4a16-g128", 14336, 4096, True), ("w8a8", 4096, 1024, True)]


@pytest.mark.parametrize("scheme, K, N, ok", SM90_SHAPES)
def test_why_not_refuses_what_hummings_sm90_tiles_do_not_divide(scheme, K, N, ok):
    why = hg.why_not(random_weight(scheme, N, K, "cpu"))
    assert why is None if ok else why is not None, why


def test_buckets():
    assert hg.buckets([64, 1, 16, 16]) == [(0, 1, 1), (1, 16, 16), (16, 1 << 30, 64)]
    assert hg.buckets([7]) == [(0, 1 << 30, 7)]
    with pytest.raises(ValueError):
        hg.buckets([0])


def test_humming_missing_is_one_line_with_the_install_command(monkeypatch):
    monkeypatch.setattr(hg, "_missing", [])
    import builtins

    real = builtins.__import__

    def no_humming(name, *a, **k):
        if name == "humming" or name.startswith("humming."):
            raise ImportError("No module named 'humming'")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_humming)
    why = hg.humming_missing()
    assert why is not None and "\n" not in why and "pip install 'lowbit[humming]'" in why
    assert "humming-kernels==0.1.10" in why
    with pytest.raises(LowbitError, match="pip install"):
        hg.require_humming("x")


def _humming_first(kind="w4a16"):
    return Dispatch([Cell(kind, 1, 16, "humming")] + generic_cells(), "test", card="NVIDIA Test GPU")


def test_dispatch_passes_over_a_weight_humming_does_not_take_and_errors_when_humming_is_missing(monkeypatch):
    d = _humming_first()
    odd = random_weight("w4a16-g128", 33, 256, "cpu")  # N not a multiple of 64: the next cell takes it
    assert d.choose("w4a16", 1, odd).path == "triton"
    monkeypatch.setattr(hg, "humming_missing", lambda: f"humming-kernels is not importable here; install it: {hg.INSTALL}")
    ok = random_weight("w4a16-g128", 256, 256, "cpu")
    with pytest.raises(LowbitError, match=r"dispatches w4a16 M=1 to humming on cpu.*pip install") as e:
        d.choose("w4a16", 1, ok)
    assert "\n" not in str(e.value)
    assert d.choose("w4a16", 17, ok).path == "triton"  # other M ranges are not humming's


def test_no_kernel_error_names_the_scheme_and_the_card():
    d = Dispatch([c for c in generic_cells() if c.kind == "w8a8"], "only w8a8", card="NVIDIA Test GPU")
    with pytest.raises(LowbitError, match="no weight kernel for w4a8 at M=5 on NVIDIA Test GPU") as e:
        d.choose("w4a8", 5)
    assert "\n" not in str(e.value)
    assert d.without([]).card == "NVIDIA Test GPU"


def test_run_cell_routes_humming_cells_to_humming_gemm(monkeypatch):
    seen = []

    def fake(x, pw, out_dtype=None):
        seen.append((x.shape[0], pw.kind, out_dtype))
        return wg.linear_twin(x, pw, out_dtype)

    monkeypatch.setattr(hg, "linear", fake)
    pw = random_weight("w8a8", 128, 256, "cpu")
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    y = run_cell(Cell("w8a8", 1, M_INF, "humming"), x, pw, torch.float32)
    assert seen == [(3, "w8a8", torch.float32)] and y.dtype == torch.float32


def test_audit_bound_and_a_raising_humming_cell_fails_the_audit(monkeypatch):
    from lowbit.kernels.gemm.check import check_cell

    assert tolerance("humming") == DEQUANT_TOL
    pw = random_weight("w4a16-g128", 256, 256, "cpu")
    d = _humming_first()
    monkeypatch.setattr(hg, "humming_missing", lambda: None)

    def boom(x, pw, out_dtype=None):
        raise RuntimeError("humming kernel refused the shape")

    monkeypatch.setattr(hg, "linear", boom)
    assert check_cell(d, pw, 1, device="cpu") == (float("inf"), False, "humming")
    gone = d.without([("w4a16", 1, "humming")])
    assert gone.choose("w4a16", 1, pw).path == "triton" and "removed by the audit" in gone.source


def _row(scheme, shape, M, N, K, winner, kernel, ratio):
    return {"scheme": scheme, "shape": shape, "M": M, "N": N, "K": K, "winner": winner, "kernel": kernel,
            "ratio": ratio, "ms": 0.01, "bf16_ms": 0.01 * (ratio or 1), "candidates": {}}


def test_table_from_winners_round_trips_and_keeps_the_base_cells():
    from lowbit.tools.bench.gemm_candidates import build_table

    rows = [_row("w4a16-g128", "gate/up", 1, 14336, 4096, "humming", "humming", 2.3),
            _row("w4a16-g128", "gate/up", 16, 14336, 4096, "humming", "humming", 2.2),
            _row("w4a16-g128", "gate/up", 256, 14336, 4096, "table", "cuda:cuda-ws-rt1-w8-nb3-sk0-pdl", 1.0),
            _row("w4a16-g128", "gate/up", 4096, 14336, 4096, "dequant-cublas", "dequant-cublas", 0.97),
            _row("w4a16-g64-asym", "gate/up", 1, 14336, 4096, "table", "triton:bm16-bn64-bk128-sk1-w4-s3", 1.5),
            _row("w8a8", "down", 1, 4096, 14336, "dequant-cublas", "a16-xq:dequant-cublas", 0.6),
            _row("w8a16", "down", 1, 4096, 14336, None, None, None)]  # nothing passed: no cell
    res = {"env": {"gpu": "NVIDIA Test GPU", "capability": [9, 0], "candidates": ["table", "humming"]}, "rows": rows}
    base = Dispatch(generic_cells(), "generic")
    t = json.loads(json.dumps(build_table(res, base)))
    shaped = [c for c in t["cells"] if c.get("shape")]
    assert [(c["kind"], c["m_lo"], c["m_hi"], c["path"], c["config"]) for c in shaped] == [
        ("w4a16", 1, 16, "humming", None),  # M 1 and 16 merged
        ("w4a16", 17, 256, "cuda", "cuda-ws-rt1-w8-nb3-sk0-pdl"),
        ("w4a16", 257, None, "dequant-cublas", None),
        ("w8a8", 1, None, "a16-xq", "dequant-cublas")]
    d = Dispatch(table_cells(t), "t")
    assert d.choose("w4a16", 100).path == "triton"  # a shape-free query: the base cells
    pw = dataclasses.replace(random_weight("w4a16-g128", 256, 256, "cpu"), N=14336, K=4096)
    c = d.choose("w4a16", 300, pw)
    assert c.path == "dequant-cublas" and c.shape == (14336, 4096)
    assert [c.config.name for c in d.cells if c.shape and c.kind == "w4a16" and c.covers(200)] == ["cuda-ws-rt1-w8-nb3-sk0-pdl"]
    assert len(t["cells"]) == len(shaped) + len(generic_cells()) - 4  # the base, less its last-resort cells


def test_bench_cli_refuses_a_table_without_candidates_and_unknown_candidates(tmp_path):
    from lowbit.cli import build_parser
    from lowbit.commands import bench as cmd

    args = build_parser().parse_args(["bench", "gemm", "--table", str(tmp_path / "t.json")])
    with pytest.raises(LowbitError, match="--table is built from --candidates"):
        cmd.run(args)
    args = build_parser().parse_args(["bench", "gemm", "--candidates", "humming,marlin"])
    with pytest.raises(LowbitError, match="unknown candidate"):
        cmd.run(args)


# ---------------------------------------------------------------------------------------------------------------- GPU

gpu = pytest.mark.gpu
def _no_humming() -> bool:
    return not torch.cuda.is_available() or hg.humming_missing() is not None  # (imports humming only on a GPU)


needs_humming = pytest.mark.skipif(_no_humming(), reason="needs CUDA and humming-kernels")


@gpu
@needs_humming
@pytest.mark.parametrize("scheme", ["w4a16-g128", "w4a16-g64-asym", "w8a16", "w8a8", "w4a8"])
def test_gpu_humming_matches_twin(scheme):
    pw = random_weight(scheme, 1024, 4096, "cuda", seed=7)
    pw.bias = torch.randn(pw.N, device="cuda") * 0.1
    p = hg.plan(pw, torch.bfloat16, ms=(1, 16, 64, 256))
    for M in (1, 3, 16, 17, 99, 256, 999):
        x = torch.randn(M, pw.K, device="cuda", dtype=torch.bfloat16)
        y = hg.run(p, x, torch.float32)
        ref = wg.linear_twin(x, pw, torch.float32)
        assert torch.isfinite(y).all() and rel(y, ref) < DEQUANT_TOL, (scheme, M, rel(y, ref))


@gpu
@needs_humming
def test_gpu_humming_is_capturable_and_the_dispatch_cell_passes_the_audit():
    from lowbit.tools.audit.gemm import audit_weights

    pw = random_weight("w4a16-g128", 4096, 4096, "cuda", seed=1)
    x = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
    hg.linear(x, pw)  # plan + compile outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        yg = hg.linear(x, pw)
    x.copy_(torch.randn_like(x))
    g.replay()
    assert rel(yg.float(), wg.linear_twin(x, pw, torch.float32)) < DEQUANT_TOL
    d = Dispatch([Cell("w4a16", 1, M_INF, "humming"), Cell("w8a8", 1, M_INF, "humming")] + generic_cells(), "t",
                 card=torch.cuda.get_device_name())
    rows, _ = audit_weights("cuda", schemes=("w4a16-g128", "w8a8"), shapes=[("q/o", 4096, 4096)], ms=(1, 17, 300),
                            dispatch=d)
    assert rows and all(r.ok and r.kernel == "humming" for r in rows), rows


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU run of the sweep's logic (timing faked)")
def test_sweep_audits_each_candidate_reports_failures_and_picks_the_fastest_passing(monkeypatch):
    """The sweep's control flow on CPU: timings faked (humming 0.5, lowbit's cell 1.5, dequantize + cuBLAS 2.0,
    bf16 1.0), humming faked by the twin except a NaN at M=3 (the audit must drop it there)."""
    from lowbit.tools.bench import attention as kbench
    from lowbit.tools.bench import gemm_candidates as gc

    def fake_time(fns, reps=3, target_ms=10):
        fns[0]()
        cell = (fns[0].__defaults__ or (None,) * 3)[-1]
        return {"humming": 0.5, "triton": 1.5, "dequant-cublas": 2.0}.get(getattr(cell, "path", None), 1.0)

    def fake_humming(x, pw, out_dtype=None):
        y = wg.linear_twin(x, pw, out_dtype)
        return torch.full_like(y, float("nan")) if x.shape[0] == 3 else y

    monkeypatch.setattr(kbench, "graph_time_ms", fake_time)
    monkeypatch.setattr(hg, "humming_missing", lambda: None)
    monkeypatch.setattr(hg, "plan", lambda pw, dtype, ms, compile=True: object())
    monkeypatch.setattr(hg, "compile_plans", lambda plans, log=None: [])
    monkeypatch.setattr(hg, "plan_for", lambda pw, dtype, ms: None)
    monkeypatch.setattr(hg, "linear", fake_humming)
    seen, lines = [], []
    res = gc.sweep(("w8a16",), [("tiny", 128, 256)], (1, 3), dispatch=Dispatch(generic_cells(), "generic"),
                   log=lines.append, on_row=seen.append, device="cpu")
    rows = res["rows"]
    assert [r["M"] for r in rows] == [1, 3] and seen == rows and res["truncated"] == []
    assert rows[0]["winner"] == "humming" and rows[0]["ratio"] == 2.0
    bad = rows[1]["candidates"]["humming"]
    assert not bad["ok"] and "non-finite" in bad["error"] and bad["ms"] is None
    assert rows[1]["winner"] == "table" and rows[1]["kernel"].startswith("triton:")
    assert all(r["candidates"]["dequant-cublas"]["ok"] for r in rows)
    assert any("humming FAIL" in x and "M=3" in x for x in lines)
    t = gc.build_table(res, Dispatch(generic_cells(), "generic"))
    assert [(c["m_lo"], c["m_hi"], c["path"]) for c in t["cells"] if c.get("shape")] == [(1, 1, "humming"),
                                                                                          (2, None, "triton")]
    # humming missing: reported per row with the install command, the other candidates still run
    monkeypatch.setattr(hg, "humming_missing", lambda: f"humming-kernels is not importable here; install it: {hg.INSTALL}")
    res = gc.sweep(("w8a16",), [("tiny", 128, 256)], (1,), dispatch=Dispatch(generic_cells(), "generic"),
                   log=lines.append, device="cpu")
    assert "pip install" in res["rows"][0]["candidates"]["humming"]["error"] and res["rows"][0]["winner"] == "table"
    res = gc.sweep(("w8a16",), [("tiny", 128, 256)], (1,), dispatch=Dispatch(generic_cells(), "generic"),
                   log=lines.append, device="cpu", budget_s=-1)
    assert res["rows"] == [] and res["truncated"] == ["w8a16 tiny"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU run of the sweep's logic (timing faked)")
def test_sweep_reports_a_failed_humming_plan_in_each_row_without_retrying(monkeypatch):
    from lowbit.tools.bench import attention as kbench
    from lowbit.tools.bench import gemm_candidates as gc

    calls = []

    def failing_plan_for(pw, dtype, ms):
        calls.append(1)
        raise RuntimeError("launcher build failed: no g++")

    monkeypatch.setattr(kbench, "graph_time_ms", lambda fns, reps=3, target_ms=10: (fns[0](), 1.0)[1])
    monkeypatch.setattr(hg, "humming_missing", lambda: None)
    monkeypatch.setattr(hg, "plan", lambda pw, dtype, ms, compile=True: object())
    monkeypatch.setattr(hg, "compile_plans", lambda plans, log=None: [])
    monkeypatch.setattr(hg, "plan_for", failing_plan_for)
    res = gc.sweep(("w8a16",), [("tiny", 128, 256)], (1, 3), ("humming", "dequant-cublas"),
                   dispatch=Dispatch(generic_cells(), "generic"), log=lambda s: None, device="cpu")
    assert len(calls) == 1
    for r in res["rows"]:
        assert "launcher build failed" in r["candidates"]["humming"]["error"] and r["winner"] == "dequant-cublas"
