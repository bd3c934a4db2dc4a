"""Resolving --kv / --peers / --recipe into rows, before any model work."""

import pytest

from lowbit.core.errors import LowbitError
from lowbit.eval.plan import plan_peers, plan_schemes


def test_reference_first_flags_apply_to_names_and_rotation_suffix_overrides():
    rows = plan_schemes("int4, int2@hadamard,k4v2", {"sink": 32, "recent": 96, "rotation": "none"})
    assert [r.label for r in rows] == ["bf16", "int4", "int2@hadamard", "k4v2"]
    assert rows[0].scheme is None
    assert all(r.scheme.sink == 32 and r.scheme.recent == 96 for r in rows[1:])
    assert rows[1].scheme.rotation == "none" and rows[2].scheme.rotation == "hadamard"
    assert (rows[3].scheme.k.bits, rows[3].scheme.v.bits) == (4, 2)


def test_listed_bf16_is_the_reference_not_a_second_row():
    assert [r.label for r in plan_schemes("int8,bf16")] == ["bf16", "int8"]


def test_recipe_file_is_a_row_named_by_its_stem(tmp_path):
    p = tmp_path / "k4v2-clip.toml"
    p.write_text('scheme = "k4v2"\nclip = [1.0, 0.92]\nsink = 0\n')
    rows = plan_schemes("int2", recipe=str(p))
    assert [r.label for r in rows] == ["bf16", "int2", "k4v2-clip"]
    assert rows[2].scheme.v.clip == 0.92 and rows[2].scheme.sink == 0
    rows = plan_schemes(f"{p}")
    assert rows[1].label == "k4v2-clip"
    with pytest.raises(LowbitError, match="recipe file not found"):
        plan_schemes(str(tmp_path / "missing.json"))


def test_kivi_rows_keep_their_recipe():
    (_, kivi) = plan_schemes("kivi2")
    s = kivi.scheme
    assert (s.sink, s.recent, s.k.axis, s.v.axis, s.v.group) == (0, 128, "channel", "token", 32)


def test_peers():
    assert plan_peers("hf-quanto-int2, kivi4") == ["hf-quanto-int2", "kivi4"]
    assert plan_peers(None) == []
    with pytest.raises(LowbitError, match="--peers lists kivi2 more than once"):
        plan_peers("kivi2,kivi2")
