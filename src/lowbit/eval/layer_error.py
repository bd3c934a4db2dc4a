"""Per-layer attention-output error of KV quantization variants, and full-window fake-quant perplexity.

The harness runs the model once per window through a capturing attention function. In every
layer it has the exact post-RoPE q, k, v and builds, for each variant (a KVScheme + rotations +
optional Lloyd-Max levels), what the quantized cache would hold:

    k_hat = Q(k @ R_k) @ R_kᵀ        v_hat = Q(v @ R_v) @ R_vᵀ        (per KV head when R is [H, D, D])

and the attention each query would compute from the tiers of its own history (full-window
teacher forcing: query t sees the sink tokens j < sink and its recent tokens t - j < recent exact,
every other key/value of its history quantized):

    s_tj = q_t · (k_hat_j if middle(t, j) else k_j) * scaling
    o_t  = sum_j p_tj (v_hat_j if middle(t, j) else v_j)

mode "measure": the model continues on exact attention (each layer's error is its own, not the
    sum of earlier layers'); per layer and variant we accumulate ‖o_hat - o‖² and ‖o‖² over the
    queries that see a quantized middle (t >= sink + recent) and report 10 log10 of their ratio (dB).
mode "replace": the model runs on the quantized attention of one variant, so errors compound as in
    serving; the perplexity of that run is the fast full-window fake-quant number (the protocol of
    DESIGN.md's tables). The cache's chunked evaluation (`lowbit eval`) is the serving-exact one.

Quantizer: the cache's own codec (lowbit.kv.codec.TensorCodec: encode -> decode, the same code every
write path of the cache uses) and rotations (lowbit.kv.rotations; resolved by lowbit.kv.plan), so the
dB tables that choose per-layer bits measure the code that serves. Keys grouped per token (groups of
`group` channels) or per channel over blocks of `page` tokens starting at the sink (KIVI).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from lowbit.backends import Backend, register
from lowbit.calib.capture import allowed_mask, capture_attention
from lowbit.core.errors import LowbitError
from lowbit.eval.perplexity import full_window_ppl
from lowbit.kv.codec import TensorCodec
from lowbit.kv.key_affine import map_keys, unmap_keys
from lowbit.kv.rotations import rotate, unrotate


@dataclass
class Variant:
    """One way to hold the KV cache.

    scheme: lowbit.kv.scheme.KVScheme (bits, axis, group, clip, lloyd_max, sink, recent, page)
    rot:    layer -> (R_k, R_v), each None, [D, D] or [H_kv, D, D]
    levels: layer -> (levels_k, levels_v) fitted Lloyd-Max codebooks (None: Gaussian-optimal)
    clip:   layer -> (clip_k, clip_v) per-layer clip ratios overriding the scheme's
    center: layer -> (mu_k, mu_v) [H_kv, D] calibration means subtracted before quantizing. Exact
            for attention: every key shifted by mu_k shifts all logits of a query by q·mu_k (softmax
            is unchanged), and o = sum_j p_j (v_j - mu_v) + mu_v since the p_j sum to 1; so a cache
            storing centred K/V in every tier computes what this harness computes.
    """

    name: str
    scheme: object
    rot: dict = field(default_factory=dict)
    levels: dict = field(default_factory=dict)
    clip: dict = field(default_factory=dict)
    center: dict = field(default_factory=dict)
    layer_scheme: dict = field(default_factory=dict)  # layer -> KVScheme overriding `scheme` (mixed bits per layer)
    key_affine: dict = field(default_factory=dict)  # layer -> lowbit.kv.key_affine.KeyAffine (keys mapped before R_k)

    def scheme_for(self, layer: int):
        return self.layer_scheme.get(layer, self.scheme)


def layer_codec(tq, head_dim: int, page: int, *, levels: torch.Tensor | None = None,
                clip: float | None = None) -> TensorCodec:
    """The cache's codec (lowbit.kv.codec.TensorCodec, the one quantizer) for one tensor of one layer,
    with a variant's per-layer clip ratio (a clipped range is a min/max grid) or fitted levels."""
    if clip is not None and tq.quantized and not tq.lloyd_max:
        tq = replace(tq, grid="minmax", clip=float(clip))
    return TensorCodec(tq, head_dim, page, levels)


def fake_quantize(codec: TensorCodec, x: torch.Tensor, *, sink: int) -> torch.Tensor:
    """x [B, H, T, D] (already rotated) -> what the cache's middle tier returns for it, float32:
    codec.decode(codec.encode(x)). Token axis: every row. Channel axis: blocks of `page` tokens
    counted from `sink`; the sink rows and a trailing partial block come back exact (they never
    leave the sink / recent tiers)."""
    x = x.float()
    if not codec.quantized:
        return x
    if codec.tq.axis == "token":
        return codec.decode(codec.encode(x, torch.float32))
    page = codec.page
    n = max(0, (x.shape[2] - sink) // page)
    if n == 0:
        return x
    out = x.clone()
    blk = x[:, :, sink : sink + n * page]
    out[:, :, sink : sink + n * page] = codec.decode(codec.encode(blk, torch.float32))
    return out


def dequantized_kv(k, v, variant: Variant, layer: int):
    """(k_hat, v_hat) [B, H, T, D] float32 for this variant at this layer (see module docstring)."""
    s = variant.scheme_for(layer)
    rk, rv = variant.rot.get(layer, (None, None))
    lk, lv = variant.levels.get(layer, (None, None))
    ck, cv = variant.clip.get(layer, (None, None))
    mk, mv = variant.center.get(layer, (None, None))
    k, v = k.float(), v.float()
    if mk is not None:
        k = k - mk.float()[None, :, None, :]
    if mv is not None:
        v = v - mv.float()[None, :, None, :]
    kc = layer_codec(s.k, k.shape[-1], s.page, levels=lk, clip=ck)
    vc = layer_codec(s.v, v.shape[-1], s.page, levels=lv, clip=cv)

    ka = variant.key_affine.get(layer)  # exact for attention: q . k_hat differs from the cache's by q . shift only
    kh = unmap_keys(unrotate(fake_quantize(kc, rotate(map_keys(k, ka), rk), sink=s.sink), rk), ka)
    vh = unrotate(fake_quantize(vc, rotate(v, rv), sink=s.sink), rv)
    if mk is not None:
        kh = kh + mk.float()[None, :, None, :]
    if mv is not None:
        vh = vh + mv.float()[None, :, None, :]
    return kh, vh


def tiered_attention(q, k, v, kh, vh, allowed, scaling: float, sink: int, recent: int, softcap=None,
                     query_chunk: int = 512) -> torch.Tensor:
    """Attention where key j of query t is quantized iff j >= sink and t - j >= recent.

    q [B, Hq, T, D]; k, kh [B, Hkv, S, D]; v, vh [B, Hkv, S, Dv]; allowed bool [B|1, 1|Hq, T, S].
    Returns float32 [B, T, Hq, Dv] (the layout attention functions return).
    """
    B, Hq, T, _ = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    rep = Hq // Hkv
    qf = q.float()
    kk, kq = k.float().repeat_interleave(rep, 1), kh.repeat_interleave(rep, 1)
    vv, vq = v.float().repeat_interleave(rep, 1), vh.repeat_interleave(rep, 1)
    out = torch.empty(B, Hq, T, vv.shape[-1])
    kpos = torch.arange(S)
    for a in range(0, T, query_chunk):
        b = min(T, a + query_chunk)
        tpos = torch.arange(a, b) + (S - T)
        mid = (kpos[None, :] >= sink) & (tpos[:, None] - kpos[None, :] >= recent)  # [c, S]
        qc = qf[:, :, a:b]
        s = torch.where(mid, qc @ kq.transpose(-1, -2), qc @ kk.transpose(-1, -2)) * scaling
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        s = s.masked_fill(~allowed[..., a:b, :], float("-inf"))
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)
        pm = p * mid
        out[:, :, a:b] = pm @ vq + (p - pm) @ vv
    return out.transpose(1, 2)


class Harness:
    """Attention observer for `capture_attention`: measures every variant, or replaces the output with one."""

    def __init__(self, variants: list[Variant], mode: str = "measure"):
        if mode not in ("measure", "replace"):
            raise LowbitError(f"unknown harness mode {mode!r}")
        if mode == "replace" and len(variants) != 1:
            raise LowbitError("replace mode runs exactly one variant")
        self.variants = variants
        self.mode = mode
        self.err: dict[tuple[str, int], float] = {}
        self.ref: dict[tuple[str, int], float] = {}
        self.rows: dict[int, int] = {}

    @torch.no_grad()
    def __call__(self, module, query, key, value, attention_mask, scaling, softcap=None):
        layer = int(module.layer_idx)
        T, S = query.shape[2], key.shape[2]
        allowed = allowed_mask(attention_mask, T, S, query.device)
        exact = None
        for var in self.variants:
            sch = var.scheme_for(layer)
            kh, vh = dequantized_kv(key, value, var, layer)
            o = tiered_attention(query, key, value, kh, vh, allowed, scaling, sch.sink, sch.recent, softcap)
            if self.mode == "replace":
                self.rows[layer] = self.rows.get(layer, 0) + _middle_rows(T, S, sch.sink, sch.recent) * key.shape[0]
                return o.to(query.dtype)
            if exact is None:
                ek, ev = key.float(), value.float()
                exact = tiered_attention(query, key, value, ek, ev, allowed, scaling, sch.sink, sch.recent, softcap)
            first = sch.sink + sch.recent - (S - T)  # queries from here on see a quantized middle
            if first >= T:
                continue
            d = (o - exact)[:, max(first, 0):].double()
            r = exact[:, max(first, 0):].double()
            key_ = (var.name, layer)
            self.err[key_] = self.err.get(key_, 0.0) + float(d.pow(2).sum())
            self.ref[key_] = self.ref.get(key_, 0.0) + float(r.pow(2).sum())
        return None

    def db(self) -> dict[str, dict[int, float]]:
        """variant -> layer -> 10 log10(‖err‖² / ‖ref‖²) (dB; lower is better, -inf for no error)."""
        out: dict[str, dict[int, float]] = {}
        for (name, layer), e in sorted(self.err.items(), key=lambda kv: (kv[0][0], kv[0][1])):
            r = self.ref[(name, layer)]
            out.setdefault(name, {})[layer] = 10 * math.log10(e / r) if e > 0 and r > 0 else float("-inf")
        return out


def _middle_rows(T: int, S: int, sink: int, recent: int) -> int:
    """How many (query, key) rows of one sequence read the quantized middle: tokens that would sit in it."""
    return max(0, S - sink - recent)


@torch.no_grad()
def measure_layers(model, windows: torch.Tensor, variants: list[Variant]) -> dict[str, dict[int, float]]:
    """Per-layer attention-output error (dB) of each variant over windows [N, L] of held-out text."""
    h = Harness(variants, "measure")
    with capture_attention(model, h):
        for w in windows:
            model(w[None], use_cache=False, logits_to_keep=1)
    res = h.db()
    if not res:
        raise LowbitError("no query saw a quantized middle: windows must be longer than sink + recent")
    return res


@torch.no_grad()
def fake_quant_ppl(model, windows: torch.Tensor, variant: Variant) -> tuple[float, int]:
    """Full-window perplexity with every layer's attention replaced by the variant's tiered attention.

    Returns (ppl, quantized rows per layer summed over windows); raises if no row was quantized.
    """
    h = Harness([variant], "replace")
    with capture_attention(model, h):
        ppl = full_window_ppl(model, windows)
    rows = min(h.rows.values()) if h.rows else 0
    if variant.scheme.quantized and rows == 0:
        raise LowbitError("the fake-quant run quantized zero rows (windows shorter than sink + recent?)")
    return ppl, rows


def format_table(db: dict[str, dict[int, float]], ppl: dict[str, float] | None = None, ref_ppl: float | None = None) -> str:
    """Markdown table: one row per layer, one column per variant (dB), then the mean, and with `ppl`
    the fake-quant perplexity (and its change vs `ref_ppl`) of each variant."""
    names = list(db)
    layers = sorted({i for d in db.values() for i in d})
    lines = ["| layer | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for i in layers:
        lines.append(f"| {i} | " + " | ".join(f"{db[n].get(i, float('nan')):.1f}" for n in names) + " |")
    lines.append("| mean | " + " | ".join(f"{sum(db[n].values()) / len(db[n]):.1f}" for n in names) + " |")
    if ppl:
        lines.append("| PPL | " + " | ".join(f"{ppl[n]:.3f}" for n in names) + " |")
        if ref_ppl:
            lines.append("| ΔPPL | " + " | ".join(f"{100 * (ppl[n] / ref_ppl - 1):+.2f}%" for n in names) + " |")
    return "\n".join(lines)


def heatmap(db: dict[str, dict[int, float]], path, title: str) -> None:
    """PNG at `path`: variants x layers, each cell its error in dB (lower is better)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(db)
    layers = sorted({i for d in db.values() for i in d})
    m = torch.tensor([[db[n].get(i, float("nan")) for i in layers] for n in names])
    fig, ax = plt.subplots(figsize=(max(6, 0.32 * len(layers) + 2), 0.6 * len(names) + 1.6))
    im = ax.imshow(m.numpy(), aspect="auto", cmap="viridis_r")
    ax.set_yticks(range(len(names)), names)
    ax.set_xticks(range(len(layers)), [str(i) for i in layers], fontsize=7)
    ax.set_xlabel("layer")
    ax.set_title(title, fontsize=9)
    for r in range(len(names)):
        for c in range(len(layers)):
            v = m[r, c].item()
            if math.isfinite(v):
                ax.text(c, r, f"{v:.0f}", ha="center", va="center", fontsize=6, color="w")
    fig.colorbar(im, ax=ax, label="attention-output error (dB)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------ backend
def _fake_quant_supports(layer, step: str, device: str) -> str | None:
    return None  # encode -> decode through the layer's own codec: every scheme the cache can hold


def _register_backend():
    return register(Backend("fake-quant", ("fake-quant",), _fake_quant_supports, dequantized_kv, module=__name__))


BACKEND = _register_backend()
