import json

import pytest

from lowbit.core.errors import LowbitError
from lowbit.weights.scheme import parse_weight_scheme


@pytest.fixture(scope="module")
def checkpoints(tiny_dir, tmp_path_factory):
    from lowbit.diffusion.plant import plant_failure
    from lowbit.diffusion.quantize import quantize_pipeline

    d = tmp_path_factory.mktemp("ckpt")
    w8 = d / "w8a16"
    quantize_pipeline(tiny_dir, w8, component="transformer", scheme=parse_weight_scheme("w8a16"))
    nan = plant_failure(w8, d / "w8a16-nan", linear="transformer_blocks.1.attn1.to_q", kind="nan")
    zero = plant_failure(w8, d / "w8a16-zero", linear="proj_out_2", kind="zero")
    return w8, nan, zero


def test_planted_failures_fail_the_gate_and_are_not_averaged(tiny_dir, checkpoints, tmp_path):
    from lowbit.cli import main

    w8, nan, zero = checkpoints
    out = {k: tmp_path / f"r.{k}" for k in ("json", "md", "png", "summary")}
    rc = main(["eval", "images", "--model", str(tiny_dir), "--checkpoints", f"{w8},{nan},{zero}", "--classes", "0,3,5",
               "--seeds", "0-2", "--steps", "4", "--calibrate", "--json", str(out["json"]), "--markdown", str(out["md"]),
               "--plot", str(out["png"]), "--summary", str(out["summary"])])
    assert rc == 1  # some row failed
    res = json.loads(out["json"].read_text())
    rows = {r["checkpoint"].rsplit("/", 1)[-1]: r for r in res["rows"]}
    assert rows["tiny"]["gate"] == "PASS" and rows["w8a16"]["gate"] == "PASS"
    assert rows["w8a16"]["psnr_min"] > res["thresholds"]["psnr_min"]
    assert rows["w8a16-nan"]["gate"] == "FAIL" and rows["w8a16-nan"]["failing_images"] == 9
    assert rows["w8a16-nan"]["failures"][0]["why"] == ["non-finite pixels"]
    assert rows["w8a16-nan"]["psnr_mean"] is None  # a failed row's NaNs are not averaged into a number
    assert rows["w8a16-zero"]["gate"] == "FAIL"
    assert res["gate"] == "FAIL"
    s = json.loads(out["summary"].read_text())["rows"]
    assert [r["gate"] for r in s] == ["PASS", "PASS", "FAIL", "FAIL"]
    assert set(s[1]) >= {"scheme", "method", "psnr_mean", "psnr_min", "gate", "weight_bytes", "wall_s_per_image",
                         "peak_mb", "device"}
    assert s[1]["scheme"] == "w8a16" and s[1]["weight_bytes"] < s[0]["weight_bytes"]
    assert s[2]["planted"]["kind"] == "nan"
    assert out["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| w8a16-nan | w8a16 | rtn | FAIL | 9/9 |" in out["md"].read_text()


def test_bad_input_is_one_line_and_runs_nothing(tiny_dir, checkpoints, tmp_path, capsys):
    from lowbit.cli import main

    w8, _, _ = checkpoints
    base = ["eval", "images", "--model", str(tiny_dir), "--steps", "2", "--classes", "0", "--seeds", "0"]
    cases = [
        (["--checkpoints", str(tiny_dir)], "has no quantized component"),        # unquantized as a checkpoint
        (["--checkpoints", str(w8), "--psnr-min", "150"], "psnr_min = 150.0 dB is outside"),
        (["--checkpoints", str(w8), "--opaque-max", "1.2"], "opaque_max = 1.2 is outside [0, 1]"),
        (["--checkpoints", str(w8), "--classes", "12"], "class 12 is not one of the model's classes 0..9"),
    ]
    for extra, msg in cases:
        assert main(base + extra) == 2
        err = capsys.readouterr().err.strip()
        assert msg in err and len(err.splitlines()) == 1, err
    # a quantized pipeline whose manifest class is not native-packed
    import shutil

    from lowbit.artifacts import pin

    fake = tmp_path / "generic"
    shutil.copytree(w8, fake)
    (fake / "manifest.json").unlink()
    pin(fake, "diffusers-compressed-tensors", "generic")
    with pytest.raises(LowbitError, match="manifest class is 'generic', not 'native-packed'"):
        from lowbit.diffusion.evaluate import ImageEvalOptions, check_options

        check_options(ImageEvalOptions(model=str(tiny_dir), checkpoints=[str(fake)]))
    # an existing output is refused before any work
    j = tmp_path / "exists.json"
    j.write_text("{}")
    assert main(base + ["--checkpoints", str(w8), "--json", str(j)]) == 2
    assert "exists; pass --overwrite" in capsys.readouterr().err
    assert j.read_text() == "{}"
