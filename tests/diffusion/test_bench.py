import json

from lowbit.weights.scheme import parse_weight_scheme


def test_bench_images_capacity_matrix(tiny_dir, tmp_path, capsys):
    from lowbit.cli import main
    from lowbit.diffusion.quantize import quantize_pipeline

    q = tmp_path / "w4"
    quantize_pipeline(tiny_dir, q, component="transformer", scheme=parse_weight_scheme("w4a16-g64"))
    out = tmp_path / "cap.json"
    args = ["bench", "images", "--model", str(tiny_dir), "--checkpoints", str(q), "--batch", "1,3",
            "--resolution", "16,32", "--steps", "2", "--out", str(out)]
    assert main(args) == 0
    res = json.loads(out.read_text())
    assert [r["scheme"] for r in res["rows"]] == ["fp32", "w4a16-g64"]
    ref, w4 = res["rows"]
    assert [(c["size"], c["batch"]) for c in w4["cells"]] == [(16, 1), (16, 3), (32, 1), (32, 3)]
    for c in w4["cells"]:
        assert c["wall_s_per_image"] > 0 and c["peak_mb"] > 0 and c["gate"] in ("PASS", "FAIL")
        assert c["ref_gate"] in ("PASS", "FAIL") and isinstance(c["psnr_min"], float)
    assert w4["weight_bytes"] < ref["weight_bytes"] and w4["backend"] == "torch-twin (cpu)"
    # results are never overwritten; a resolution the patch does not divide is refused
    assert main(args) == 2
    assert "never overwritten" in capsys.readouterr().err
    assert main(args[:-1] + [str(tmp_path / "b.json")] + ["--resolution", "18"]) == 2
    assert "not a multiple of the DiT's patch size 4" in capsys.readouterr().err
    assert not (tmp_path / "b.json").exists()
