"""Recipes: frozen, versioned descriptions of how to quantize (KV cache here; weights alongside).

KV part
-------
`KVScheme` says how a `lowbit.runtime.cache.QuantizedKVCache` holds K and V:

    sink    first S tokens of every layer, model dtype (attention sinks stay exact)
    middle  everything between sink and recent, packed codes + fp16 scale/zero per group
    recent  the last R tokens (and up to page-1 more), model dtype
    page    tokens leave the recent ring for the middle `page` at a time, so the quantizer runs
            on a page of rows at once; sink and recent must be multiples of it.

K and V each carry a `TensorQuant`: bits (2/3/4/8, or 16 = stored unquantized), symmetric,
clip ratio, Lloyd-Max levels instead of a uniform grid, grouping axis and group size.
  axis "token":   groups of `group` consecutive channels of one token (default group 128, or
                  head_dim when smaller) -> scale/zero [B, Hkv, T, D // group].
  axis "channel": KIVI-style keys: each channel grouped over a block of `page` tokens ->
                  scale/zero [B, Hkv, T // page, D]; its group must equal the page.
3-bit codes live in 4-bit containers (packing is 2/4/8 only), so int3 costs what int4 costs;
bits_per_element says so.

Defaults: sink 64, recent 256, group 128 (head_dim if smaller) as the design fixes them, and
page 16: small enough that at most 15 extra tokens sit in high precision, large enough that the
quantizer (and a KIVI channel block) works on 16 rows at a time instead of one per decode step.

`parse_kv_scheme(name, ...)` turns the CLI's scheme strings (bf16, int8, int4, int3, int2, kXvY,
kivi2, kivi4) plus flags into a KVScheme; `load_recipe(path)` reads the same fields from JSON or
TOML. Errors that need no model are raised at construction; `validate(geometry)` checks the
rest (group vs head_dim, attention types, rotation shapes) before any token is cached.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, replace
from itertools import pairwise
from pathlib import Path
from typing import Any

from lowbit.core.errors import LowbitError
from lowbit.recipes import looks_like_name, read_recipe_file, shipped_path

KV_SCHEME_VERSION = 1
KV_BITS = (2, 3, 4, 8, 16)
LLOYD_MAX_BITS = (2, 3, 4)
AXES = ("token", "channel")
GRIDS = ("minmax", "std", "mse")  # where a uniform grid's range comes from (see TensorQuant)
ZEROS = ("group", "none")  # whether a per-group zero is stored (see TensorQuant.zero)
DEFAULT_SINK = 64
DEFAULT_RECENT = 256
DEFAULT_GROUP = 128
DEFAULT_PAGE = 16
# What every fp16 scale and zero costs in the middle tier (scale_format "ue5m3": 8 bits, see TensorQuant).
SCALE_BITS = 16
SCALE_FORMATS = ("fp16", "ue5m3")
SUPPORTED_ATTENTION = ("full", "sliding")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


_SHA_RE = re.compile(r"^[0-9a-f]{64}$")


def _check_ref(kind: str, path, sha256) -> None:
    if not isinstance(path, str) or not path:
        raise LowbitError(f"{kind} path must be a non-empty string, got {path!r}")
    if sha256 is not None and (not isinstance(sha256, str) or not _SHA_RE.match(sha256)):
        raise LowbitError(f"{kind} sha256 {sha256!r} is not 64 lowercase hex digits; copy it from the artifact's manifest")


@dataclass(frozen=True)
class RotationRef:
    """A fitted RotationSet directory, pinned by the sha256 of its rotations file (None: not pinned
    yet; `lowbit.kv.plan.resolve` opens the file once, checks it and pins it in the plan's scheme)."""

    path: str
    sha256: str | None = None

    def __post_init__(self):
        _check_ref("rotation", self.path, self.sha256)

    def __str__(self) -> str:
        return self.path + (f" (sha256 {self.sha256[:12]})" if self.sha256 else "")


@dataclass(frozen=True)
class LevelsRef:
    """A per-layer Lloyd-Max levels artifact (`lowbit.kv.plan.save_levels`), pinned by the sha256 of
    its levels file like RotationRef. Layers / tensors it lacks use the scheme's own levels."""

    path: str
    sha256: str | None = None

    def __post_init__(self):
        _check_ref("levels", self.path, self.sha256)

    def __str__(self) -> str:
        return self.path + (f" (sha256 {self.sha256[:12]})" if self.sha256 else "")


@dataclass(frozen=True)
class TensorQuant:
    """How one of K / V is stored in the middle tier.

    bits: 2, 3, 4, 8, or 16 (unquantized, kept in the model dtype: the exactness setting).
    group: token axis: channels per group (None = DEFAULT_GROUP, or head_dim when smaller; 64 for 192);
           channel axis: tokens per block, must equal the scheme's page (None = page).
    clip: range ratio in (0, 1] (see lowbit.quant.affine); lloyd_max: non-uniform levels
          with mean/std per group in place of zero/scale; `levels` (2**bits ascending values in
          units of the group's std) names them, None = Gaussian-optimal for the bits.
    grid: "minmax" (a uniform grid over each group's [min, max], shrunk by clip) or "std" (a
          uniform grid at the Gaussian-optimal step from each group's mean and std,
          lowbit.quant.affine.quantize_std; 2-4 bits). Both store scale/zero and dequantize as
          codes * scale + zero, so the fused kernel reads either. "mse" (scale-only groups, 2-4 bits):
          the std grid with each group's step searched over multiples of it (lowbit.quant.affine.MSE_STEPS)
          for the least squared error at write time; stored and read exactly as "std" (the encoder alone
          differs, so every reader of "std" scale-only groups, the fused kernel included, reads it).
    zero: "group" (an fp16 zero per group beside the scale: bits + 32/group per element) or "none"
          (scale only, the grid centred on 0: x_hat = (codes - mid) * scale, mid = (2**bits - 1) / 2;
          bits + 16/group, i.e. int2 at group 64 costs 2.25 b/elt instead of 2.5). With "none" the std
          grid takes its step from each group's RMS about 0 (not its mean/std), the min/max grid must
          be symmetric; per-token groups only, no Lloyd-Max. A per-channel offset (keys' channel means)
          is removed before it by a key affine with a shift (lowbit.kv.key_affine, exact for attention).
    scale_format: "fp16" (the default) or "ue5m3": scale-only groups (zero "none") stored as one-byte
          unsigned floats, 3 mantissa bits (lowbit.quant.scale_format): int2 at group 64 holds 2.125
          b/elt instead of 2.25. The encoder rounds each step to that grid and codes against it; the torch
          decode and the fused decode kernel read it; readers that do not (the geometry kernels, the vLLM
          plugin) refuse it by name.
    vq: None, or "SUBxENTRIES" (e.g. "2x16", "4x256"): vector-quantized rows (lowbit.quant.vq): each row's
          RMS-normalised SUB-dim sub-vectors store the index of their nearest codeword in a per-(layer, KV head)
          codebook fitted by `lowbit calibrate --vq-for RECIPE` (named by the scheme's `levels` artifact, the
          one home of fitted codebooks), plus one scale per row (scale_format). bits must equal
          log2(ENTRIES) / SUB; scale-only (zero "none"), per-token; the grid is not used.
    residual: None, "sign" or "qjl": one more bit per element, the sign of the base's error in a seeded random
          basis with one gain per row in scale_format (lowbit.quant.residual; TurboQuant's 1-bit stage): "sign"
          the least-squares gain, "qjl" the gain that makes q . x_hat unbiased. Costs 1 + scale bits / head_dim
          per element on top of the base; scale-only per-token bases (scalar or VQ), which lowbit.kernels.attention.vq
          reads. A layer override names it after the width, "r" for sign and "q" for qjl ("k2rv2": K int2 + sign).
    """

    bits: int = 16
    symmetric: bool = False
    clip: float = 1.0
    lloyd_max: bool = False
    axis: str = "token"
    group: int | None = None
    grid: str = "minmax"
    levels: tuple | None = None
    zero: str = "group"
    scale_format: str = "fp16"
    vq: str | None = None
    residual: str | None = None

    def __post_init__(self):
        if self.vq is not None and self.grid == "minmax":
            object.__setattr__(self, "grid", "std")  # VQ rows use no grid; the scale-only storage family's default
        if not _is_int(self.bits) or self.bits not in KV_BITS:
            raise LowbitError(f"KV bits {self.bits!r} unsupported; use one of {KV_BITS} (16 = unquantized)")
        if self.axis not in AXES:
            raise LowbitError(f"KV grouping axis {self.axis!r} unknown; use 'token' or 'channel'")
        try:
            clip = float(self.clip)
        except (TypeError, ValueError):
            raise LowbitError(f"clip ratio {self.clip!r} is not a number; use a value in (0, 1]") from None
        if not 0.0 < clip <= 1.0:
            raise LowbitError(f"clip ratio {self.clip!r} is outside (0, 1]; use 1.0 for no clipping")
        object.__setattr__(self, "clip", clip)
        if self.group is not None and (not _is_int(self.group) or self.group <= 0):
            raise LowbitError(f"group must be a positive integer, got {self.group!r}")
        if self.lloyd_max and self.bits not in LLOYD_MAX_BITS:
            raise LowbitError(f"Lloyd-Max levels need bits in {LLOYD_MAX_BITS}, got {self.bits}; drop --lloyd-max")
        if self.lloyd_max and self.clip != 1.0:
            raise LowbitError("Lloyd-Max levels already bound the range (their end levels); drop the clip ratio")
        if self.lloyd_max and self.symmetric:
            raise LowbitError("Lloyd-Max levels are symmetric around each group's mean already; drop 'symmetric'")
        if self.levels is not None:
            if not self.lloyd_max:
                raise LowbitError("levels are given but lloyd_max is off; set lloyd_max = true or drop the levels")
            try:
                lv = tuple(float(x) for x in self.levels)
            except (TypeError, ValueError):
                raise LowbitError(f"Lloyd-Max levels must be a list of numbers, got {self.levels!r}") from None
            if len(lv) != 1 << self.bits:
                raise LowbitError(
                    f"{len(lv)} Lloyd-Max levels given for {self.bits}-bit codes, which need {1 << self.bits}; "
                    "fit levels for this bit width"
                )
            if any(b <= a for a, b in pairwise(lv)):
                raise LowbitError("Lloyd-Max levels must be strictly ascending; refit them")
            object.__setattr__(self, "levels", lv)
        if self.grid not in GRIDS:
            raise LowbitError(f"grid {self.grid!r} unknown; use 'minmax' (range from min/max), 'std' (from mean/std) "
                              "or 'mse' (scale-only: the std step searched per group)")
        if self.grid == "mse" and self.quantized and self.zero != "none":
            raise LowbitError("grid 'mse' searches the scale of scale-only groups; set zero 'none' or use grid 'std'")
        if self.grid in ("std", "mse"):
            if self.quantized and self.bits not in LLOYD_MAX_BITS:
                raise LowbitError(f"the {self.grid} grid is for {LLOYD_MAX_BITS} bits, got {self.bits}; use grid 'minmax'")
            if self.lloyd_max:
                raise LowbitError(f"grid {self.grid!r} is a uniform grid; Lloyd-Max levels replace it: pick one")
            if self.clip != 1.0 or self.symmetric:
                raise LowbitError(f"grid {self.grid!r} sets its range from the group's std; drop the clip ratio and 'symmetric'")
        if self.zero not in ZEROS:
            raise LowbitError(f"zero {self.zero!r} unknown; use 'group' (an fp16 zero per group) or 'none' (scale only)")
        if self.zero == "none" and self.quantized:
            if self.axis != "token":
                raise LowbitError("zero 'none' (scale-only groups) is for per-token groups; use zero 'group' per channel")
            if self.lloyd_max:
                raise LowbitError("Lloyd-Max levels store each group's mean; use zero 'group' with them")
            if self.grid == "minmax" and not self.symmetric:
                raise LowbitError("zero 'none' centres the grid on 0; use grid 'std' or a symmetric min/max grid")
        if self.scale_format not in SCALE_FORMATS:
            raise LowbitError(f"scale_format {self.scale_format!r} unknown; use one of {', '.join(SCALE_FORMATS)}")
        if self.scale_format != "fp16" and not (self.quantized and self.zero == "none"):
            raise LowbitError(f"scale_format {self.scale_format!r} stores the positive step of scale-only groups; "
                              "set zero 'none' on a quantized tensor, or use scale_format 'fp16'")
        if self.vq is not None:
            from lowbit.quant import vq as vqm

            sub, entries = vqm.parse(self.vq)
            object.__setattr__(self, "vq", f"{sub}x{entries}")
            if not self.quantized or vqm.bits_per_element(sub, entries) != self.bits:
                raise LowbitError(f"VQ {self.vq} stores {vqm.bits_per_element(sub, entries):g} bits per element, but the "
                                  f"tensor is at {self.bits} bits; pick a VQ spec of those bits (2x16 or 4x256 at 2)")
            if self.zero != "none" or self.axis != "token" or self.lloyd_max or self.group is not None:
                raise LowbitError("VQ rows keep one scale per row and no zero: set zero 'none', per-token axis, no "
                                  "Lloyd-Max and no group")
        if self.residual is not None:
            from lowbit.quant import residual as resm

            object.__setattr__(self, "residual", resm.check_kind(self.residual))
            if not self.quantized or self.zero != "none" or self.axis != "token":
                raise LowbitError("a 1-bit residual refines scale-only per-token codes (zero 'none', token axis, or "
                                  "VQ rows); set zero 'none' on a quantized per-token tensor, or drop the residual")

    @property
    def quantized(self) -> bool:
        return self.bits < 16

    @property
    def container_bits(self) -> int:
        """Bits each code occupies once packed (3-bit codes use 4-bit containers)."""
        return 4 if self.bits == 3 else self.bits

    def group_for(self, head_dim: int, page: int) -> int:
        """The group this tensor uses at `head_dim` (token axis) or over a page (channel axis)."""
        if self.axis == "channel":
            return page if self.group is None else self.group
        if self.vq is not None:
            return head_dim  # one scale per row
        if self.group is not None:
            return self.group
        if head_dim <= DEFAULT_GROUP or head_dim % DEFAULT_GROUP == 0:
            return min(DEFAULT_GROUP, head_dim)
        # a wide head 128 does not divide (K 192 of expanded MLA): the largest of 64, 32, 16 that does
        return next((g for g in (64, 32, 16) if head_dim % g == 0), DEFAULT_GROUP)

    @property
    def stores_zero(self) -> bool:
        """Whether the middle tier holds a zero per group beside the scale (zero 'group')."""
        return self.quantized and self.zero == "group"

    def bits_per_element(self, head_dim: int, page: int = DEFAULT_PAGE) -> float:
        """Middle-tier bits per stored element, codes plus the fp16 scale (and zero) per group."""
        if not self.quantized:
            return 16.0
        from lowbit.quant.scale_format import bits_of

        scale_bits = bits_of(self.scale_format)  # a stored zero only exists with fp16 scales
        res = (1 + scale_bits / head_dim) if self.residual else 0.0  # sign bits + one gain per row
        return self.container_bits + (2 if self.stores_zero else 1) * scale_bits / self.group_for(head_dim, page) + res

    def describe(self) -> str:
        if not self.quantized:
            return "16-bit"
        res = f" + 1-bit {self.residual} residual" if self.residual else ""
        if self.vq is not None:
            return f"int{self.bits} vq {self.vq} per-token, one {self.scale_format} scale per row{res}"
        parts = [f"int{self.bits}"]
        if self.bits == 3:
            parts[0] += "(in 4-bit containers)"
        if self.axis == "channel":
            parts.append("per-channel over page-token blocks")
        else:
            parts += ["per-token", f"g{self.group}" if self.group is not None else "g<=128"]
        parts.append(("lloyd-max" + (" fitted" if self.levels else "")) if self.lloyd_max else ("std-grid" if self.grid == "std" else "mse-grid" if self.grid == "mse" else ("sym" if self.symmetric else "asym")))
        if self.clip != 1.0:
            parts.append(f"clip {self.clip:g}")
        if self.zero == "none":
            parts.append("scale-only")
        if self.scale_format != "fp16":
            parts.append(f"{self.scale_format} scales")
        return " ".join(parts) + res


@dataclass(frozen=True)
class KVScheme:
    """How the KV cache holds every layer. Frozen and versioned: it goes into manifests as is.

    rotation: "none", "hadamard" (per layer, hadamard(head_dim)) or a RotationRef to a fitted
    RotationSet directory (per layer [D, D] or per KV head [H_kv, D, D]); a plain path string is
    taken as an unpinned RotationRef. levels: a LevelsRef to per-layer fitted Lloyd-Max levels.
    This is data only: nothing here opens a file. `lowbit.kv.plan.resolve` opens, checks and pins.
    fold_v_rotation: R_v is folded into v_proj / o_proj weights (V arrives already rotated and the
    output needs no un-rotation); valid only for one rotation per layer.
    """

    name: str = "bf16"
    k: TensorQuant = field(default_factory=TensorQuant)
    v: TensorQuant = field(default_factory=TensorQuant)
    sink: int = DEFAULT_SINK
    recent: int = DEFAULT_RECENT
    page: int = DEFAULT_PAGE
    rotation: str | RotationRef = "none"
    fold_v_rotation: bool = False
    layer_bits: tuple = ()
    levels: LevelsRef | None = None
    version: int = KV_SCHEME_VERSION

    def __post_init__(self):
        object.__setattr__(self, "layer_bits", parse_layer_bits(self.layer_bits))
        if self.version != KV_SCHEME_VERSION:
            raise LowbitError(
                f"KV scheme version {self.version!r} is not supported by this lowbit (it reads {KV_SCHEME_VERSION})"
            )
        for which in ("k", "v"):
            if not isinstance(getattr(self, which), TensorQuant):
                raise LowbitError(f"KVScheme.{which} must be a TensorQuant, got {type(getattr(self, which)).__name__}")
        if not _is_int(self.page) or self.page <= 0:
            raise LowbitError(f"page must be a positive integer, got {self.page!r}")
        for what in ("sink", "recent"):
            n = getattr(self, what)
            if not _is_int(n) or n < 0:
                raise LowbitError(f"{what} must be a non-negative integer, got {n!r}")
            if n % self.page:
                lo, hi = n // self.page * self.page, -(-n // self.page) * self.page
                # below one page the multiple under n is 0 (no tokens in that tier), which is allowed
                raise LowbitError(
                    f"{what} {n} is not a multiple of the page ({self.page}); use {lo}{' (none)' if lo == 0 else ''} "
                    f"or {hi}, or change the page"
                )
        for which, t in (("K", self.k), ("V", self.v)):
            if t.axis == "channel" and t.group is not None and t.group != self.page:
                raise LowbitError(
                    f"{which} is grouped per channel over blocks of the page ({self.page} tokens) but its group "
                    f"is {t.group}; set the group to {self.page} or the page to {t.group}"
                )
        rot = self.rotation
        if isinstance(rot, dict):  # the to_dict form
            rot = RotationRef(**rot)
        if isinstance(rot, str) and rot and rot not in ("none", "hadamard"):
            rot = RotationRef(rot)
        if not (isinstance(rot, RotationRef) or rot in ("none", "hadamard")):
            raise LowbitError(f"rotation must be 'none', 'hadamard' or a RotationSet path, got {self.rotation!r}")
        object.__setattr__(self, "rotation", rot)
        lv = self.levels
        if isinstance(lv, dict):
            lv = LevelsRef(**lv)
        elif isinstance(lv, str):
            lv = LevelsRef(lv)
        if lv is not None and not isinstance(lv, LevelsRef):
            raise LowbitError(f"levels must be a levels artifact path, got {self.levels!r}")
        if lv is not None and not (self.k.lloyd_max or self.v.lloyd_max or self.k.vq or self.v.vq):
            raise LowbitError("a levels file is given but neither K nor V uses Lloyd-Max levels or VQ codebooks; "
                              "add --lloyd-max or a vq spec")
        object.__setattr__(self, "levels", lv)
        if self.fold_v_rotation and self.rotation == "none":
            raise LowbitError("fold_v_rotation needs a rotation to fold; set rotation or drop fold_v_rotation")

    # ----------------------------------------------------------------- derived
    @property
    def quantized(self) -> bool:
        return self.k.quantized or self.v.quantized

    def for_layer(self, index: int) -> KVScheme:
        """The scheme layer `index` uses: this one with its layer_bits override applied (if any)."""
        over = dict(self.layer_bits).get(index)
        if over is None:
            return replace(self, layer_bits=()) if self.layer_bits else self
        kb, vb = scheme_bits(over)
        k, v = (_with_residual(_with_bits(t, b), r) for t, b, r in zip((self.k, self.v), (kb, vb), layer_residuals(over)))
        fitted = any(t.lloyd_max or (t.quantized and t.vq) for t in (k, v))  # the levels file has nothing here
        return replace(self, k=k, v=v, layer_bits=(), levels=self.levels if fitted else None)

    def bits_per_element(self, head_dim: int) -> tuple[float, float]:
        """(K, V) middle-tier bits per element at this head_dim for layers without an override,
        fp16 scale + zero per group included (per-layer overrides: `for_layer(i).bits_per_element`)."""
        return self.k.bits_per_element(head_dim, self.page), self.v.bits_per_element(head_dim, self.page)

    def describe(self) -> str:
        """One line, e.g. 'int2: K int2 per-token g<=128 asym, V ... | sink 64, recent 256, page 16 | rotation none'."""
        kv = f"K,V {self.k.describe()}" if self.k == self.v else f"K {self.k.describe()}, V {self.v.describe()}"
        rot = f"rotation {self.rotation}" + (" (V folded into weights)" if self.fold_v_rotation else "")
        if self.levels is not None:
            rot += f" | levels {self.levels}"
        lay = f" | layers {format_layer_bits(self.layer_bits)}" if self.layer_bits else ""
        return f"{self.name}: {kv} | sink {self.sink}, recent {self.recent}, page {self.page} | {rot}{lay}"

    def to_dict(self) -> dict:
        """JSON-ready form (manifests); `kv_scheme_from_dict` reads it back."""
        return asdict(self)

    # ------------------------------------------------------------- validation
    def validate(self, geometry) -> KVScheme:
        """Check this scheme against a model's geometry (lowbit.models.ModelGeometry); returns self.

        Raises LowbitError for an unsupported attention type (named), a group that does not
        divide a head_dim, or a head_dim the packing cannot split. Pure: it opens no file. The
        rotation and levels files are checked by `lowbit.kv.plan.resolve`, which calls this first.
        """
        layers = list(getattr(geometry, "layers", []))
        if not layers:
            raise LowbitError("the model geometry has no layers; cannot build a KV cache for it")
        ids = {g.index for g in layers}
        missing = [i for i, _ in self.layer_bits if i not in ids]
        if missing:
            raise LowbitError(
                f"layer_bits names layer(s) {', '.join(map(str, missing))} but the model has layers "
                f"{min(ids)}..{max(ids)}; fix the per-layer bits"
            )
        for g in layers:
            self.for_layer(g.index)._validate_layer(g)
        return self

    def _validate_layer(self, g) -> None:
        if g.attention not in SUPPORTED_ATTENTION:
            raise LowbitError(
                f"layer {g.index}: attention type {g.attention!r} is not supported by the KV cache "
                f"(supported: {', '.join(SUPPORTED_ATTENTION)})"
            )
        storage = getattr(g, "storage", "mha")
        if storage not in ("mha", "mla-latent") or (storage == "mla-latent" and not getattr(g, "latent_dim", None)):
            raise LowbitError(
                f"layer {g.index}: KV storage {storage!r} is not supported by the KV cache (mha, or mla-latent with "
                "latent_dim and rope_dim from an MLA config)"
            )
        shared = storage == "mla-latent" or getattr(g, "k_eq_v", False)
        if shared and self.k != self.v:
            what = "the MLA latent is both K and V" if storage == "mla-latent" else "K = V (attention_k_eq_v)"
            raise LowbitError(
                f"layer {g.index} stores K and V once ({what}) but the scheme gives K {self.k.describe()} and V "
                f"{self.v.describe()}; use one scheme for both (e.g. int4, not k4v2) or --layer-bits {g.index}=int4"
            )
        for which, t, d in (("K", self.k, g.head_dim_k), ("V", self.v, g.head_dim_v)):
            if shared and which == "K":
                continue  # K is rebuilt from the stored V (its own RoPE part is held dense)
            if not t.quantized:
                continue
            if t.axis == "token":
                grp = t.group_for(d, self.page)
                if d % grp:
                    divs = [x for x in (128, 64, 32, 16) if d % x == 0]
                    hint = f"; use --group {divs[0]}" if divs else ""
                    raise LowbitError(f"{which} group {grp} does not divide head_dim {d} of layer {g.index}{hint}")
            per_byte = 8 // t.container_bits
            if d % per_byte:
                raise LowbitError(
                    f"layer {g.index}: {which} head_dim {d} is not a multiple of {per_byte} "
                    f"({t.container_bits}-bit codes per byte); use 8 or 16 bits for this model"
                )

# ---------------------------------------------------------------- parsing
_KV_RE = re.compile(r"^k(\d+)v(\d+)$")
_BITS_NAMES = {"bf16": 16, "int8": 8, "int4": 4, "int3": 3, "int2": 2}
SCHEME_NAMES = ("bf16", "int8", "int4", "int3", "int2", "kXvY (e.g. k4v2)", "kivi2", "kivi4")


_LAYER_RE = re.compile(r"^k(\d+)([rq]?)v(\d+)([rq]?)$")
_RESIDUAL_MARK = {"": None, "r": "sign", "q": "qjl"}


def layer_residuals(name: str) -> tuple[str | None, str | None]:
    """The 1-bit residual a per-layer bits name puts on K / V: an "r" after a width is "sign", a "q" is "qjl"
    ("k2rv2" -> ("sign", None)); plain names none."""
    m = _LAYER_RE.match(str(name).strip().lower())
    return (_RESIDUAL_MARK[m.group(2)], _RESIDUAL_MARK[m.group(4)]) if m else (None, None)


def scheme_bits(name: str) -> tuple[int, int]:
    """(K bits, V bits) of a plain bits name: bf16 | int8 | int4 | int3 | int2 | kXvY (a per-layer name may
    carry "r" or "q" after a width, "k2rv2": that tensor with a 1-bit residual, `layer_residuals`)."""
    key = str(name).strip().lower()
    if m := _LAYER_RE.match(key):
        key = f"k{m.group(1)}v{m.group(3)}"
    if key in _BITS_NAMES:
        return _BITS_NAMES[key], _BITS_NAMES[key]
    if m := _KV_RE.match(key):
        kb, vb = int(m.group(1)), int(m.group(2))
        if kb in KV_BITS and vb in KV_BITS:
            return kb, vb
    raise LowbitError(
        f"per-layer bits {name!r} unknown; use bf16, int8, int4, int3, int2 or kXvY with X, Y in {KV_BITS}"
    )


def _with_residual(t: TensorQuant, kind: str | None) -> TensorQuant:
    """A per-layer override states its tensors' residual: the kind its name marks, or none."""
    if kind == t.residual:
        return t
    try:
        return replace(t, residual=kind)
    except LowbitError as e:
        raise LowbitError(f"per-layer residual: {e}") from None


def _with_bits(t: TensorQuant, bits: int) -> TensorQuant:
    """`t` at other bits for a per-layer override: the grid that width gets by default (std at
    2 bits per token, min/max otherwise), keeping the axis and group. Lloyd-Max levels and clip
    ratios are not carried to another width: measured on the built-in models, both help at 2 bits
    and hurt at 4 (results/rotations/TABLES.md)."""
    if bits == t.bits:
        return t
    if bits == 16:
        return TensorQuant()
    if t.vq is not None:  # another width is a scalar grid: the scale-only std grid (the VQ's storage family)
        t = replace(t, vq=None)
    group = t.group if t.quantized else None
    if t.zero == "none" and t.quantized:  # scale-only storage at every width: std grid (2-4 bits), symmetric at 8
        if bits == 8:
            return TensorQuant(bits=8, symmetric=True, axis=t.axis, group=group, zero="none",
                               scale_format=t.scale_format)
        return TensorQuant(bits=bits, axis=t.axis, group=group, grid="mse" if t.grid == "mse" else "std", zero="none",
                           scale_format=t.scale_format)
    grid = "std" if bits == 2 and t.axis == "token" else "minmax"
    return TensorQuant(bits=bits, axis=t.axis, group=group, grid=grid)


def parse_layer_bits(value) -> tuple[tuple[int, str], ...]:
    """Per-layer bits -> ((layer, bits name), ...) sorted by layer.

    Accepts "7,18,20=int4;5=int8" (the CLI form), {"7": "int4", 5: "int8"} (JSON/TOML tables),
    [[7, "int4"], ...] (the to_dict form) or () / None / "" for none. A layer named twice is an error.
    """
    if value is None or value == "" or value == ():
        return ()
    pairs: list[tuple[Any, Any]] = []
    if isinstance(value, str):
        for part in value.split(";"):
            part = part.strip()
            if not part:
                continue
            if "=" not in part:
                raise LowbitError(f"per-layer bits {part!r}: write LAYERS=BITS, e.g. '7,18=int4;5=int8'")
            lays, bits = part.split("=", 1)
            pairs += [(x.strip(), bits.strip()) for x in lays.split(",") if x.strip()]
    elif isinstance(value, dict):
        pairs = list(value.items())
    elif isinstance(value, (list, tuple)):
        for item in value:
            if not isinstance(item, (list, tuple)) or len(item) != 2:
                raise LowbitError(f"per-layer bits entry {item!r}: give [layer, bits], e.g. [7, \"int4\"]")
            pairs.append((item[0], item[1]))
    else:
        raise LowbitError(f"per-layer bits must be a string, table or list of [layer, bits], got {value!r}")
    out: dict[int, str] = {}
    for lay, bits in pairs:
        try:
            idx = int(lay)
        except (TypeError, ValueError):
            raise LowbitError(f"per-layer bits: layer {lay!r} is not an integer layer index") from None
        if idx < 0:
            raise LowbitError(f"per-layer bits: layer {idx} is negative; layers count from 0")
        if idx in out:
            raise LowbitError(f"per-layer bits: layer {idx} is given twice")
        scheme_bits(bits)  # validates the name
        out[idx] = str(bits).strip().lower()
    return tuple(sorted(out.items()))


def format_layer_bits(layer_bits) -> str:
    """((7, 'int4'), (18, 'int4'), (5, 'int8')) -> '5=int8;7,18=int4' (parse_layer_bits reads it back)."""
    by: dict[str, list[int]] = {}
    for i, b in layer_bits:
        by.setdefault(b, []).append(i)
    return ";".join(f"{','.join(map(str, sorted(v)))}={b}" for b, v in sorted(by.items(), key=lambda kv: min(kv[1])))


def _pair(value, what: str) -> tuple[Any, Any]:
    """A per-K/V value given once (both) or as (K, V) / 'K,V'."""
    if isinstance(value, str):
        parts = [p.strip() for p in value.split(",")]
        if len(parts) == 1:
            return parts[0], parts[0]
        if len(parts) == 2:
            return parts[0], parts[1]
        raise LowbitError(f"{what} {value!r}: give one value or two as K,V")
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise LowbitError(f"{what} {value!r}: give one value or two as (K, V)")
        return value[0], value[1]
    return value, value


def _float_pair(value, what: str) -> tuple[float, float]:
    a, b = _pair(value, what)
    try:
        return float(a), float(b)
    except (TypeError, ValueError):
        raise LowbitError(f"{what} {value!r} is not a number or a K,V pair of numbers") from None


def parse_kv_scheme(
    name: str,
    group: int | None = None,
    sink: int | None = None,
    recent: int | None = None,
    clip=None,
    lloyd_max: bool = False,
    rotation: str | None = None,
    *,
    page: int | None = None,
    symmetric: bool = False,
    fold_v_rotation: bool = False,
    layer_bits=None,
    grid: str | None = None,
    levels=None,
    zero=None,
    scale_format=None,
    vq=None,
    residual=None,
) -> KVScheme:
    """Scheme string + flags -> KVScheme.

    name: bf16 | int8 | int4 | int3 | int2 | kXvY (X, Y in 2/3/4/8/16) | kivi2 | kivi4.
    kivi*: keys per channel over 32-token blocks, values per token in groups of 32, recent 128,
    sink 0, page 32 (KIVI's recipe). clip: one ratio for both or (K, V) / "K,V".
    Flags given override the scheme's defaults; None keeps them. layer_bits: per-layer bits
    overrides ("7,18=int4;5=int8", see parse_layer_bits). grid: "minmax" | "std" for the
    quantized tensors (see TensorQuant). rotation: "none" | "hadamard" | a RotationSet path or
    RotationRef; levels: a per-layer levels artifact path or LevelsRef (with lloyd_max).
    zero: "group" | "none" (scale-only groups, see TensorQuant.zero), one for both or "K,V".
    scale_format: "fp16" | "ue5m3" (one-byte scales of scale-only groups), one for both or "K,V".
    vq: None | "SUBxENTRIES" (vector-quantized rows, TensorQuant.vq; "none" for one side), one or "K,V".
    residual: None | "sign" | "qjl" (a 1-bit residual, TensorQuant.residual; "none" for one side), one or "K,V".

    Defaults (what `--kv int2` means without flags) are the best data-free recipe measured on the
    built-in models: rotation "hadamard" whenever K or V is stored at 4 bits or fewer (plain int4
    on gemma3-270m is +37.9% PPL, Hadamard +1.6%; "none" for 8/16 bits and for the KIVI recipes,
    whose per-channel keys a rotation would smear), and the std-placed grid for 2-bit per-token
    tensors (smollm2-135m int2: the min/max grid loses the answer of a 600-token recall prompt,
    the std grid keeps it). A clip ratio, 'symmetric' or Lloyd-Max asks for the min/max or
    Lloyd-Max grid instead. Pass rotation="none" / grid="minmax" for the plain recipe.
    """
    if not isinstance(name, str):
        raise LowbitError(f"KV scheme must be a string, got {name!r}")
    key = name.strip().lower()
    k_axis = "token"
    defaults = {"sink": DEFAULT_SINK, "recent": DEFAULT_RECENT, "page": DEFAULT_PAGE}
    k_group = v_group = group
    if key in _BITS_NAMES:
        kb = vb = _BITS_NAMES[key]
    elif m := _KV_RE.match(key):
        kb, vb = int(m.group(1)), int(m.group(2))
        for b in (kb, vb):
            if b not in KV_BITS:
                raise LowbitError(f"KV scheme {name!r}: {b} bits unsupported; K and V bits must be in {KV_BITS}")
    elif key in ("kivi2", "kivi4"):
        kb = vb = int(key[-1])
        k_axis = "channel"
        defaults = {"sink": 0, "recent": 128, "page": 32}
        k_group = None  # the page
        v_group = 32 if group is None else group
    else:
        raise LowbitError(f"unknown KV scheme {name!r}; use one of {', '.join(SCHEME_NAMES)}")
    kc, vc = _float_pair(1.0 if clip is None else clip, "clip")
    kz, vz = _pair("group" if zero is None else zero, "zero")
    ksf, vsf = (str(f).strip().lower() for f in _pair("fp16" if scale_format is None else scale_format, "scale_format"))
    kvq, vvq = (None if f is None or str(f).strip().lower() == "none" else str(f).strip().lower()
                for f in _pair(vq, "vq"))
    kres, vres = (None if f is None or str(f).strip().lower() == "none" else str(f).strip().lower()
                  for f in _pair(residual, "residual"))
    if k_axis == "channel" and group is not None and page is None:
        # --group on a KIVI scheme sets the key block: the block is the page.
        defaults["page"] = group
    def default_grid(bits: int, clip_ratio: float, axis: str, zero_: str) -> str:
        plain = k_axis == "token" and not (lloyd_max or symmetric or clip_ratio != 1.0)
        # 2-bit per-token groups take the std grid; scale-only groups (zero 'none') take it at 2-4 bits too
        return "std" if plain and (bits == 2 or (str(zero_).strip().lower() == "none" and bits <= 4)) else "minmax"

    try:
        gk = default_grid(kb, kc, k_axis, kz) if grid is None else (str(grid) if kb < 16 else "minmax")
        gv = default_grid(vb, vc, "token", vz) if grid is None else (str(grid) if vb < 16 else "minmax")
        kq = TensorQuant(bits=kb, symmetric=symmetric, clip=kc, lloyd_max=bool(lloyd_max) and kb < 16,
                         axis=k_axis, group=k_group if kb < 16 else None, grid=gk,
                         zero=str(kz).strip().lower() if kb < 16 else "group",
                         scale_format=ksf if kb < 16 else "fp16", vq=kvq if kb < 16 else None,
                         residual=kres if kb < 16 else None)
        vq = TensorQuant(bits=vb, symmetric=symmetric, clip=vc, lloyd_max=bool(lloyd_max) and vb < 16,
                         group=v_group if vb < 16 else None, grid=gv,
                         zero=str(vz).strip().lower() if vb < 16 else "group",
                         scale_format=vsf if vb < 16 else "fp16", vq=vvq if vb < 16 else None,
                         residual=vres if vb < 16 else None)
    except LowbitError as e:
        raise LowbitError(f"KV scheme {name!r}: {e}") from None
    if lloyd_max and not (kq.lloyd_max or vq.lloyd_max):
        raise LowbitError(f"--lloyd-max needs a quantized scheme; {name!r} stores K and V unquantized")
    return KVScheme(
        name=key,
        k=kq,
        v=vq,
        sink=defaults["sink"] if sink is None else sink,
        recent=defaults["recent"] if recent is None else recent,
        page=defaults["page"] if page is None else page,
        rotation=(("hadamard" if min(kb, vb) <= 4 and k_axis == "token" else "none") if rotation is None
                  else rotation if isinstance(rotation, RotationRef) else str(rotation)),
        fold_v_rotation=bool(fold_v_rotation),
        layer_bits=parse_layer_bits(layer_bits),
        levels=levels,
    )


# ---------------------------------------------------------------- files
_TENSOR_FIELDS = {"bits", "symmetric", "clip", "lloyd_max", "axis", "group", "grid", "levels", "zero", "scale_format",
                  "vq", "residual"}
_FILE_FIELDS = {"scheme", "group", "sink", "recent", "page", "clip", "lloyd_max", "rotation", "symmetric",
                "fold_v_rotation", "layer_bits", "grid", "k", "v", "version", "name", "levels", "zero",
                "scale_format", "vq", "residual"}


def _ref_from_field(value, cls, what: str, base_dir: Path | None):
    """A rotation / levels field of a recipe file: a path string or a {path, sha256} table; relative
    paths are taken relative to the recipe file's directory."""
    if value is None or value in ("none", "hadamard") and cls is RotationRef:
        return value
    if isinstance(value, str):
        value = {"path": value}
    if not isinstance(value, dict) or set(value) - {"path", "sha256"} or "path" not in value:
        raise LowbitError(f"KV recipe {what} must be a path or a table {{path, sha256}}, got {value!r}")
    path = value["path"]
    if isinstance(path, str) and base_dir is not None and not Path(path).is_absolute():
        path = str((Path(base_dir) / path).resolve())
    return cls(path=path, sha256=value.get("sha256"))


def kv_scheme_from_dict(d: dict, base_dir: Path | None = None) -> KVScheme:
    """KVScheme from recipe fields.

    Either the CLI's fields (scheme = "int2", group, sink, recent, page, clip = [K, V],
    lloyd_max, rotation, symmetric, fold_v_rotation) with optional per-tensor tables
    `k = {bits, symmetric, clip, lloyd_max, axis, group}` / `v = {...}` overriding them, and
    `layer_bits = {"7" = "int4", ...}` (or "7,18=int4;5=int8") for per-layer bits, or the
    `to_dict()` form. A relative rotation path is taken relative to `base_dir`.
    """
    if not isinstance(d, dict):
        raise LowbitError(f"KV recipe must be a table/object, got {type(d).__name__}")
    unknown = sorted(set(d) - _FILE_FIELDS)
    if unknown:
        raise LowbitError(f"KV recipe has unknown field(s) {', '.join(unknown)}; allowed: {', '.join(sorted(_FILE_FIELDS))}")
    scheme_name = d.get("scheme", d.get("name"))
    if scheme_name is None:
        raise LowbitError("KV recipe needs a 'scheme' (e.g. scheme = \"int4\")")
    rotation = _ref_from_field(d.get("rotation"), RotationRef, "rotation", base_dir)
    levels = _ref_from_field(d.get("levels"), LevelsRef, "levels", base_dir)
    s = parse_kv_scheme(
        str(scheme_name),
        group=d.get("group") if not isinstance(d.get("k"), dict) else None,
        sink=d.get("sink"),
        recent=d.get("recent"),
        clip=d.get("clip"),
        lloyd_max=bool(d.get("lloyd_max", False)) and not isinstance(d.get("k"), dict),
        rotation=rotation,
        page=d.get("page"),
        symmetric=bool(d.get("symmetric", False)) and not isinstance(d.get("k"), dict),
        fold_v_rotation=bool(d.get("fold_v_rotation", False)),
        layer_bits=d.get("layer_bits"),
        grid=d.get("grid") if not isinstance(d.get("k"), dict) else None,
        zero=d.get("zero") if not isinstance(d.get("k"), dict) else None,
        scale_format=d.get("scale_format") if not isinstance(d.get("k"), dict) else None,
        vq=d.get("vq") if not isinstance(d.get("k"), dict) else None,
        residual=d.get("residual") if not isinstance(d.get("k"), dict) else None,
    )
    if "group" in d and isinstance(d.get("k"), dict):
        s = replace(s, k=replace(s.k, group=d["group"]) if s.k.quantized else s.k,
                    v=replace(s.v, group=d["group"]) if s.v.quantized else s.v)
    for which in ("k", "v"):
        t = d.get(which)
        if t is None:
            continue
        if not isinstance(t, dict):
            raise LowbitError(f"KV recipe field {which!r} must be a table of {sorted(_TENSOR_FIELDS)}")
        bad = sorted(set(t) - _TENSOR_FIELDS)
        if bad:
            raise LowbitError(f"KV recipe {which}: unknown field(s) {', '.join(bad)}; allowed: {', '.join(sorted(_TENSOR_FIELDS))}")
        s = replace(s, **{which: replace(getattr(s, which), **t)})
    if levels is not None:
        s = replace(s, levels=levels)
    if "version" in d and d["version"] != KV_SCHEME_VERSION:
        raise LowbitError(f"KV recipe version {d['version']!r} is not supported (this lowbit reads {KV_SCHEME_VERSION})")
    return s


def load_recipe(path) -> KVScheme:
    """KV scheme from a JSON or TOML recipe file: its [kv] table, or the top level without one.
    `path` may also name a recipe shipped in the package, MODEL@BUDGET (lowbit.recipes, sha256-pinned)."""
    if looks_like_name(path):
        path = shipped_path(str(path))
    d = read_recipe_file(path)
    if not isinstance(d, dict):
        raise LowbitError(f"recipe {path}: expected a table/object at the top level")
    # A [kv] table when the file also holds other parts (weights); else the top level itself.
    kv = d["kv"] if "kv" in d else {k: v for k, v in d.items() if k != "weights"}
    try:
        return kv_scheme_from_dict(kv, base_dir=Path(path).parent)
    except LowbitError as e:
        raise LowbitError(f"recipe {path}: {e}") from None
