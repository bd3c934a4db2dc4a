"""Progress bars with ETA for the long jobs: GPTQ layers, calibration sequences, rotation fits."""

import logging
import random
import types

import pytest

from lowbit.core.progress import NoBar, bar


def test_bar_off_is_a_no_op_and_on_is_tqdm(capsys):
    assert isinstance(bar(5, "x", "it", False), NoBar)
    assert isinstance(bar(0, "x", "it", True), NoBar)
    b = bar(3, "job", "step", True)
    for _ in range(3):
        b.update(1)
    b.close()
    err = capsys.readouterr().err
    assert "job" in err and "3/3" in err and "<" in err  # tqdm's elapsed<remaining (the ETA)


def test_gptq_shows_layers_or_logs_them(capsys, caplog):
    from lowbit.weights.apply import quantize_model
    from lowbit.weights.scheme import parse_weight_scheme
    from tests.weights.helpers import small_model, token_ids

    calib = token_ids(batch=3, seq=16, seed=1)
    quantize_model(small_model(), parse_weight_scheme("w8a16"), method="gptq", calib=calib, progress=True)
    err = capsys.readouterr().err
    # one bar over the whole job: capturing the inputs is its first step (it was silent), then the 2 layers
    assert "GPTQ" in err and "3/3" in err and "capturing the decoder's inputs" in err and "layer 2/2" in err
    with caplog.at_level(logging.INFO, logger="lowbit.weights"):
        quantize_model(small_model(), parse_weight_scheme("w8a16"), method="gptq", calib=calib, progress=False)
    assert "GPTQ" not in capsys.readouterr().err
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs[0] == "GPTQ: capturing the decoder's inputs on 3 calibration sequences, then 2 layers"
    assert [m[:17] for m in msgs if "quantized in" in m] == ["layer 1/2 quantiz", "layer 2/2 quantiz"]
    assert all("elapsed" in m and "ETA" in m for m in msgs if "quantized in" in m)


@pytest.fixture(scope="module")
def tiny_loaded():
    from lowbit.models.geometry import ModelGeometry
    from lowbit.models.tiny import tiny_model, tiny_tokenizer

    model, cfg = tiny_model("smollm2-135m", num_layers=2, vocab_size=32, seed=0)
    return types.SimpleNamespace(model=model, tokenizer=tiny_tokenizer(), name="smollm2-135m",
                                 weights_sha256="0" * 64, geometry=ModelGeometry.from_config(cfg, name="smollm2-135m"))


def test_calibrate_and_fit_rotations_bars(tiny_loaded, tmp_path, capsys):
    from lowbit.calib.run import calibrate
    from lowbit.calib.stats import load_calibration
    from lowbit.models.tiny import TINY_WORDS
    from lowbit.rotation.fit_run import fit_and_save

    rng = random.Random(0)
    text = " ".join(rng.choice(TINY_WORDS) for _ in range(1500))
    # 8 x head_dim 64 = 512 statistics tokens per layer, 120 per 128-token sequence after skip 8: 5 sequences
    calibrate(tiny_loaded, "words", text, tmp_path / "cal", tokens=640, seq_len=128, skip=8, progress=True)
    err = capsys.readouterr().err
    assert "calibrate" in err and "5/5" in err
    fit_and_save(load_calibration(tmp_path / "cal"), tmp_path / "rot", kind="per-head", progress=True)
    err = capsys.readouterr().err
    assert "fit per-head" in err and "2/2" in err
