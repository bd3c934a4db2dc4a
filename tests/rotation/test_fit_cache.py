"""A fitted per-head RotationSet runs in the KV cache: exact at 16 bits, refused for another model."""

import pytest
import torch

from lowbit.calib.run import collect, write_calibration
from lowbit.calib.stats import load_calibration
from lowbit.core.errors import LowbitError
from lowbit.kv.plan import resolve
from lowbit.kv.scheme import parse_kv_scheme
from lowbit.models.geometry import ModelGeometry
from lowbit.models.tiny import tiny_model, tiny_tokenizer_free_inputs
from lowbit.rotation.fit_run import fit_and_save


def test_fitted_rotation_in_cache_exact_at_16_bits(tmp_path):
    from lowbit.eval.perplexity import forward_chunk
    from lowbit.runtime.cache import QuantizedKVCache

    model, cfg = tiny_model("smollm2-135m", num_layers=2, vocab_size=99)
    geo = ModelGeometry.from_config(cfg, name="smollm2-135m")
    col = collect(model, tiny_tokenizer_free_inputs(cfg, 2, 90), skip=8)
    write_calibration(col, tmp_path / "cal", geo, {"model": "smollm2-135m", "weights_sha256": "0" * 64},
                      tokens=180, seq_len=90)
    fit_and_save(load_calibration(tmp_path / "cal"), tmp_path / "rot", kind="per-head")
    ids = tiny_tokenizer_free_inputs(cfg, 1, 57, seed=9)
    with torch.no_grad():
        ref = model(ids, use_cache=False).logits
        scheme = parse_kv_scheme("k16v16", sink=16, recent=16, page=16, rotation=str(tmp_path / "rot"))
        cache = QuantizedKVCache(model, scheme, geometry=geo)
        out = torch.cat([forward_chunk(model, ids[:, a:a + 19], cache) for a in range(0, 57, 19)], dim=1)
    torch.testing.assert_close(out, ref, atol=2e-4, rtol=1e-4)
    # the same set is refused by gemma's geometry (another model)
    _, gcfg = tiny_model("gemma3-270m", num_layers=2, vocab_size=99)
    with pytest.raises(LowbitError, match="fitted for model 'smollm2-135m'"):
        resolve(parse_kv_scheme("int2", rotation=str(tmp_path / "rot")), ModelGeometry.from_config(gcfg, name="gemma3-270m"))
