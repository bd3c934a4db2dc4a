import dataclasses

import pytest

from lowbit.core.errors import LowbitError
from lowbit.weights.scheme import KNOWN, WeightScheme, parse_weight_scheme


@pytest.mark.parametrize(
    "name, canon, bits, group, sym, a_bits, fmt",
    [
        ("w4a16-g128", "w4a16-g128", 4, 128, True, 16, "pack-quantized"),  # W4 is symmetric unless -asym is asked
        ("w4a16-g64", "w4a16-g64", 4, 64, True, 16, "pack-quantized"),
        ("W4A16-G64-SYM", "w4a16-g64", 4, 64, True, 16, "pack-quantized"),  # -sym: the same scheme, one name
        ("w4a16-g64-asym", "w4a16-g64-asym", 4, 64, False, 16, "pack-quantized"),
        ("w4a16-g24-ASYM", "w4a16-g24-asym", 4, 24, False, 16, "pack-quantized"),
        ("w8a16", "w8a16", 8, None, True, 16, "pack-quantized"),
        ("w8a8", "w8a8", 8, None, True, 8, "int-quantized"),
        ("w4a8", "w4a8", 4, 128, True, 8, "int-quantized"),
        ("w4a8-g64", "w4a8-g64", 4, 64, True, 8, "int-quantized"),
        ("w4a16-g32", "w4a16-g32", 4, 32, True, 16, "pack-quantized"),
    ],
)
def test_parse(name, canon, bits, group, sym, a_bits, fmt):
    s = parse_weight_scheme(name)
    assert (s.w_bits, s.group, s.symmetric, s.a_bits, s.ct_format) == (bits, group, sym, a_bits, fmt)
    assert s.version == 1 and s.name == canon
    assert parse_weight_scheme(s.name) == s  # the canonical name parses back to the same scheme


def test_all_documented_names_parse_and_scheme_is_frozen():
    for n in KNOWN:
        parse_weight_scheme(n)
    s = parse_weight_scheme("w8a8")
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.w_bits = 4
    assert isinstance(s, WeightScheme) and s.to_dict()["version"] == 1


@pytest.mark.parametrize("bad", ["w3a16-g64", "w4a16", "w8a16-g64", "w8a8-sym", "w8a16-asym", "w4a8-asym",
                                 "w4a16-g64-sym-asym", "int4", "", "w4a16-g7", "w4a16-g0"])
def test_unknown_scheme_is_a_clear_error(bad):
    with pytest.raises(LowbitError, match="scheme"):
        parse_weight_scheme(bad)


def test_group_must_divide_in_features():
    s = parse_weight_scheme("w4a16-g128")
    assert s.group_for(1536) == 128
    with pytest.raises(LowbitError, match="group 128 does not divide in_features 576; use -g64"):
        s.group_for(576)
    assert parse_weight_scheme("w8a16").group_for(99) == 99  # per channel: one group per row
