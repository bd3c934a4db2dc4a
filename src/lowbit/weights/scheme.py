"""WeightScheme: what a weight-quantization run stores, parsed from the CLI's scheme names.

Names (case-insensitive):
    w4a16-g128, w4a16-g64, w4a16-g32     4-bit weights, groups of G along in_features, symmetric
                                         (no zero-point; `-sym` is accepted and means the same)
    w4a16-g64-asym  (any -gN-asym)       the same, asymmetric (a zero-point per group)
    w8a16                                8-bit weights, one scale per output channel, symmetric
    w8a8                                 int8 per-channel weights + dynamic per-token int8 activations
    w4a8, w4a8-g64                       4-bit symmetric group weights (G 128 by default) + dynamic
                                         per-token int8 activations

Why W4 is symmetric unless `-asym` is asked: an asymmetric pack-quantized checkpoint (packed
`weight_zero_point`, the layout compressed-tensors' own compressor and llm-compressor write) does
not load in plain `AutoModelForCausalLM.from_pretrained` on transformers 5.24 (compressed-tensors
0.19 / 0.20): its loader expects the zero-point unpacked, reports MISMATCH and raises. It loads
there only with `quantization_config=CompressedTensorsConfig(dequantize=True)`; transformers 5.17
loads it plainly. tests/weights/test_plain_load.py pins that behaviour. Until it is fixed upstream
the default W4 name is the scheme every loader opens. (Before this change `w4a16-gN` meant the
asymmetric scheme: results recorded under that name are `w4a16-gN-asym` now.)

The scheme maps 1:1 onto a compressed-tensors QuantizationScheme (see `ct_scheme`), so what we
compute is exactly what a compressed-tensors loader (transformers, vLLM) reconstructs.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from lowbit.core.errors import LowbitError

SCHEME_VERSION = 1
KNOWN = ("w4a16-g128", "w4a16-g64", "w4a16-g64-asym", "w8a16", "w8a8", "w4a8")
_RE = re.compile(r"^w(?P<w>4|8)a(?P<a>16|8)(?:-g(?P<g>\d+))?(?P<sym>-sym|-asym)?$")


@dataclass(frozen=True)
class WeightScheme:
    """One weight-quantization recipe.

    name:       canonical name (what `parse_weight_scheme` was given, lower-cased, `-sym` dropped)
    w_bits:     4 or 8
    group:      group size along in_features, or None for one group per output channel
    symmetric:  True: x = q * scale, q signed; False: x = (q - zero_point) * scale
    a_bits:     16 (activations untouched) or 8 (dynamic per-token symmetric int8)
    version:    bumped when the meaning of a field changes
    """

    name: str
    w_bits: int
    group: int | None
    symmetric: bool
    a_bits: int = 16
    version: int = SCHEME_VERSION

    @property
    def ct_format(self) -> str:
        """compressed-tensors storage format. Weight-only schemes pack their codes into int32 words
        (`pack-quantized`); schemes with int8 activations (w8a8, w4a8) keep one int8 per weight
        (`int-quantized`): that is the format compressed-tensors itself infers for them (its
        loader in transformers expects it) and the int8 [out, in] layout vLLM's W8A8 / W4A8-int
        schemes read."""
        return "int-quantized" if self.a_bits == 8 else "pack-quantized"

    def group_for(self, in_features: int) -> int:
        """The group size used on a linear with `in_features` inputs; errors if it does not divide."""
        g = in_features if self.group is None else self.group
        if in_features % g != 0:
            divs = [d for d in (128, 64, 32, 16) if in_features % d == 0]
            hint = f"use -g{divs[0]}" if divs else "use a per-channel scheme (w8a16)"
            raise LowbitError(
                f"scheme {self.name}: group {g} does not divide in_features {in_features}; {hint}"
            )
        return g

    def to_dict(self) -> dict:
        return asdict(self)


def parse_weight_scheme(name: str) -> WeightScheme:
    """Parse a scheme name (see module docstring) into a WeightScheme, or raise LowbitError."""
    if not isinstance(name, str):
        raise LowbitError(f"weight scheme must be a string, got {type(name).__name__}")
    key = name.strip().lower()
    m = _RE.match(key)
    if m is None:
        raise LowbitError(f"unknown weight scheme {name!r}; use one of {', '.join(KNOWN)} (or w4a16-gN[-asym])")
    w, a = int(m["w"]), int(m["a"])
    g = int(m["g"]) if m["g"] else None
    asym = m["sym"] == "-asym"
    if m["sym"] == "-sym":
        key = key[: -len("-sym")]  # symmetric is the default: one name per scheme
    if g is not None and (g < 8 or g % 8):
        raise LowbitError(f"weight scheme {name!r}: group must be a multiple of 8 and >= 8, got {g}")
    if w == 8:
        # 8-bit weights are per output channel and symmetric (the compressed-tensors W8 presets)
        if g is not None or m["sym"]:
            raise LowbitError(f"weight scheme {name!r}: 8-bit weights are per-channel symmetric; use w8a16 or w8a8")
        return WeightScheme(key, 8, None, True, a)
    if a == 16:
        if g is None:
            raise LowbitError(f"weight scheme {name!r}: 4-bit weights need a group, e.g. w4a16-g128 or w4a16-g64")
        return WeightScheme(key, 4, g, not asym, 16)
    # w4a8: activations are int8 symmetric per token; weights symmetric so the int matmul needs no zero term
    if asym:
        raise LowbitError(f"weight scheme {name!r}: w4a8 weights are symmetric (the int8 matmul has no zero term); "
                          "drop -asym")
    return WeightScheme(key, 4, g or 128, True, 8)
