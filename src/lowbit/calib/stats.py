"""Sufficient statistics of post-RoPE Q/K/V per attention layer and per KV head.

What we keep (float64 sums, so 32k+ tokens add up exactly enough for an eigendecomposition):

    kk [Hkv, Dk, Dk]   sum_t k_t k_tᵀ                      (key second moment)
    qq [Hkv, Dk, Dk]   sum_t sum_{q heads g of the group} q_gt q_gtᵀ   (query-weighted key metric:
                       the logit error of a key error e is q·e, so E[(q·e)²] = eᵀ (qq/n) e)
    vv [Hkv, Dv, Dv]   sum_t v_t v_tᵀ
    pv [Hkv, Dv, Dv]   sum_t w_t v_t v_tᵀ with w_t the attention mass token t receives, summed over
                       all queries and the q heads of the group (an output error is sum_t p_t e_t)
    pw [Hkv]           sum_t w_t
    ksum/vsum [Hkv, D] sum_t k_t (means, for centred covariances)
    kmin/kmax/kabsmax, vmin/vmax/vabsmax [Hkv, D]   per-channel ranges
    k_sample/v_sample [N, Hkv, D]  a small evenly spaced sample of tokens (Lloyd-Max level fitting)

Statistics cover positions >= `skip` of each sequence (default 64 = the cache's sink: those tokens
are never quantized, and the attention-sink token's outlier key would dominate kk). `seen` counts
every query position that reached the layer; the calibrate command checks it equals the tokens fed.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from lowbit.artifacts import OK, load_manifest, verify
from lowbit.calib.capture import allowed_mask
from lowbit.core.errors import LowbitError

STATS_FILE = "stats.safetensors"
META_FILE = "calibration.json"
STAT_NAMES = ("kk", "qq", "vv", "pv", "pw", "ksum", "vsum", "kmin", "kmax", "kabsmax", "vmin", "vmax", "vabsmax")


@dataclass
class LayerStats:
    """Running sums for one attention layer (see module docstring for each tensor's meaning)."""

    index: int
    num_kv_heads: int
    head_dim_k: int
    head_dim_v: int
    num_q_heads: int
    count: int = 0  # tokens accumulated into the sums (positions >= skip)
    seen: int = 0  # query positions that reached this layer
    t: dict[str, torch.Tensor] = field(default_factory=dict)
    k_sample: list[torch.Tensor] = field(default_factory=list)
    v_sample: list[torch.Tensor] = field(default_factory=list)

    def __post_init__(self):
        H, Dk, Dv = self.num_kv_heads, self.head_dim_k, self.head_dim_v
        f64 = torch.float64
        if not self.t:
            self.t = {
                "kk": torch.zeros(H, Dk, Dk, dtype=f64),
                "qq": torch.zeros(H, Dk, Dk, dtype=f64),
                "vv": torch.zeros(H, Dv, Dv, dtype=f64),
                "pv": torch.zeros(H, Dv, Dv, dtype=f64),
                "pw": torch.zeros(H, dtype=f64),
                "ksum": torch.zeros(H, Dk, dtype=f64),
                "vsum": torch.zeros(H, Dv, dtype=f64),
                "kmin": torch.full((H, Dk), math.inf, dtype=f64),
                "kmax": torch.full((H, Dk), -math.inf, dtype=f64),
                "kabsmax": torch.zeros(H, Dk, dtype=f64),
                "vmin": torch.full((H, Dv), math.inf, dtype=f64),
                "vmax": torch.full((H, Dv), -math.inf, dtype=f64),
                "vabsmax": torch.zeros(H, Dv, dtype=f64),
            }

    # --- derived views -------------------------------------------------------------------------
    def mean(self, which: str) -> torch.Tensor:
        """Per-channel mean [Hkv, D] of 'k' or 'v' over the accumulated tokens."""
        if self.count == 0:
            raise LowbitError(f"layer {self.index}: no calibration tokens were accumulated")
        return self.t[f"{which}sum"] / self.count

    def cov(self, name: str, center: bool = False) -> torch.Tensor:
        """Normalized second moment [Hkv, D, D]: kk/count, qq/(count*group), vv/count, pv/pw.

        center: for kk / vv, the covariance about the mean (kk/count - mu muᵀ) instead.
        """
        if self.count == 0:
            raise LowbitError(f"layer {self.index}: no calibration tokens were accumulated")
        if name == "kk" or name == "vv":
            m = self.t[name] / self.count
            if center:
                mu = self.mean(name[0])
                m = m - mu[:, :, None] * mu[:, None, :]
            return m
        if name == "qq":
            return self.t["qq"] / (self.count * (self.num_q_heads // self.num_kv_heads))
        if name == "pv":
            return self.t["pv"] / self.t["pw"].clamp_min(1e-30)[:, None, None]
        raise LowbitError(f"unknown statistic {name!r}: use kk, qq, vv or pv")

    def sample(self, which: str) -> torch.Tensor:
        """The kept token sample [N, Hkv, D] (float32) of 'k' or 'v'."""
        rows = self.k_sample if which == "k" else self.v_sample
        if isinstance(rows, torch.Tensor):  # loaded from disk
            return rows
        if not rows:
            return torch.zeros(0, self.num_kv_heads, self.head_dim_k if which == "k" else self.head_dim_v)
        return torch.cat(rows, dim=0)


class StatsCollector:
    """An observer for `capture_attention` that accumulates LayerStats for every layer.

    skip:            positions < skip of each sequence are left out of the sums (the cache's sink)
    sample_per_seq:  tokens per sequence kept in the per-layer sample (evenly spaced after skip)
    score_weighted:  also accumulate pv/pw (costs one extra attention pass per layer)
    query_chunk:     query rows per chunk when computing attention mass (bounds memory)
    query_stride:    attention mass is estimated from every query_stride-th query
    """

    def __init__(self, skip: int = 64, sample_per_seq: int = 16, score_weighted: bool = True, query_chunk: int = 256,
                 query_stride: int = 4):
        self.skip = int(skip)
        self.sample_per_seq = int(sample_per_seq)
        self.score_weighted = bool(score_weighted)
        self.query_chunk = int(query_chunk)
        self.query_stride = max(1, int(query_stride))
        self.layers: dict[int, LayerStats] = {}
        self.dtypes: set[torch.dtype] = set()

    @torch.no_grad()
    def __call__(self, module, query, key, value, attention_mask, scaling, softcap=None) -> None:
        # query [B, Hq, T, Dk]; key [B, Hkv, S, Dk]; value [B, Hkv, S, Dv]
        B, Hq, T, Dk = query.shape
        Hkv, S, Dv = key.shape[1], key.shape[2], value.shape[-1]
        if S != T:
            raise LowbitError("calibration must run without a KV cache (use_cache=False): got q_len != kv_len")
        idx = int(module.layer_idx)
        self.dtypes.add(key.dtype)
        st = self.layers.get(idx)
        if st is None:
            st = self.layers[idx] = LayerStats(idx, Hkv, Dk, Dv, Hq)
        st.seen += B * T
        if T <= self.skip:
            return
        rep = Hq // Hkv
        f64 = torch.float64
        n = T - self.skip
        # [Hkv, B*T', D] float32 rows; second moments by one bmm per statistic, accumulated in float64
        # (float32 products of ~1k rows are exact to ~1e-6 relative; no [T, D, D] intermediates)
        k = key[:, :, self.skip :].float().transpose(0, 1).reshape(Hkv, B * n, Dk)
        v = value[:, :, self.skip :].float().transpose(0, 1).reshape(Hkv, B * n, Dv)
        q = query[:, :, self.skip :].float().reshape(B, Hkv, rep, n, Dk).transpose(0, 1).reshape(Hkv, B * rep * n, Dk)
        s = st.t
        s["kk"] += (k.transpose(1, 2) @ k).to(f64)
        s["vv"] += (v.transpose(1, 2) @ v).to(f64)
        s["qq"] += (q.transpose(1, 2) @ q).to(f64)
        s["ksum"] += k.sum(dim=1, dtype=f64)
        s["vsum"] += v.sum(dim=1, dtype=f64)
        s["kmin"] = torch.minimum(s["kmin"], k.amin(dim=1).to(f64))
        s["kmax"] = torch.maximum(s["kmax"], k.amax(dim=1).to(f64))
        s["kabsmax"] = torch.maximum(s["kabsmax"], k.abs().amax(dim=1).to(f64))
        s["vmin"] = torch.minimum(s["vmin"], v.amin(dim=1).to(f64))
        s["vmax"] = torch.maximum(s["vmax"], v.amax(dim=1).to(f64))
        s["vabsmax"] = torch.maximum(s["vabsmax"], v.abs().amax(dim=1).to(f64))
        st.count += B * n
        if self.score_weighted:
            w = self._attention_mass(query, key, attention_mask, scaling, softcap)[:, :, self.skip :]  # [B,Hkv,T']
            w = w.transpose(0, 1).reshape(Hkv, B * n, 1)
            s["pv"] += ((v * w).transpose(1, 2) @ v).to(f64)
            s["pw"] += w.sum(dim=(1, 2), dtype=f64)
        if self.sample_per_seq > 0:
            m = min(self.sample_per_seq, n)
            pos = torch.linspace(0, n - 1, m).round().long()
            # [B*m, Hkv, D]
            st.k_sample.append(key[:, :, self.skip :][:, :, pos].permute(0, 2, 1, 3).reshape(-1, Hkv, Dk).float().clone())
            st.v_sample.append(value[:, :, self.skip :][:, :, pos].permute(0, 2, 1, 3).reshape(-1, Hkv, Dv).float().clone())

    def _attention_mass(self, query, key, attention_mask, scaling, softcap) -> torch.Tensor:
        """Attention probability each key receives, summed over queries and the q heads of its group.

        Returns float32 [B, Hkv, S]. Estimated from every `query_stride`-th query (scaled back up):
        the mass is a sum over ~T queries, so a 1-in-4 subsample estimates it well at a quarter of
        the cost of a second attention pass. Computed in query chunks: memory O(chunk * S).
        """
        B, Hq, T, D = query.shape
        Hkv, S = key.shape[1], key.shape[2]
        rep = Hq // Hkv
        stride = self.query_stride if T >= 4 * self.query_stride else 1
        qi = torch.arange(T - 1, -1, -stride).flip(0)  # always includes the last query
        allowed = allowed_mask(attention_mask, T, S, query.device)[..., qi, :]  # [B|1, 1|Hq, n, S]
        qs = query[:, :, qi].float().reshape(B, Hkv, rep * len(qi), D)
        kt = key.float().transpose(-1, -2)  # [B, Hkv, D, S]
        mass = torch.zeros(B, Hkv, S)
        c = max(1, self.query_chunk // rep)
        for a in range(0, len(qi), c):
            b = min(len(qi), a + c)
            qc = qs.reshape(B, Hkv, rep, len(qi), D)[:, :, :, a:b].reshape(B, Hkv, rep * (b - a), D)
            sc = (qc @ kt) * scaling  # [B, Hkv, rep*c, S]
            if softcap is not None:
                sc = torch.tanh(sc / softcap) * softcap
            al = allowed[..., a:b, :]
            if al.shape[1] == 1:
                al = al.expand(al.shape[0], 1, b - a, S).repeat(1, 1, rep, 1)  # [B|1, 1, rep*c, S]
            else:
                al = al.reshape(al.shape[0], Hkv, rep * (b - a), S)
            sc.masked_fill_(~al, float("-inf"))
            p = torch.softmax(sc, dim=-1).nan_to_num_(0.0)  # fully masked rows (padding) give 0
            mass += p.sum(dim=2)
        return mass * (T / len(qi))

    # --- persistence -------------------------------------------------------------------------
    def check_tokens(self, expected_layers: list[int], tokens: int) -> None:
        """Loud failure unless every expected layer saw exactly `tokens` query positions."""
        bad = []
        for i in expected_layers:
            seen = self.layers[i].seen if i in self.layers else 0
            if seen != tokens:
                bad.append(f"layer {i}: {seen}")
        if bad:
            raise LowbitError(
                f"calibration capture incomplete: expected {tokens} tokens in every attention layer, got "
                + ", ".join(bad[:6])
                + (" ..." if len(bad) > 6 else "")
                + " (a layer not routed through the capture attention? check the model's attention implementation)"
            )

    def save(self, out_dir: Path, meta: dict) -> None:
        """Write stats.safetensors (float64 sums + float16 samples) and calibration.json into out_dir."""
        tensors: dict[str, torch.Tensor] = {}
        layers_meta = []
        for i in sorted(self.layers):
            st = self.layers[i]
            for name in STAT_NAMES:
                tensors[f"layers.{i}.{name}"] = st.t[name].contiguous()
            tensors[f"layers.{i}.k_sample"] = st.sample("k").to(torch.float16).contiguous()
            tensors[f"layers.{i}.v_sample"] = st.sample("v").to(torch.float16).contiguous()
            layers_meta.append(
                {
                    "index": i,
                    "num_q_heads": st.num_q_heads,
                    "num_kv_heads": st.num_kv_heads,
                    "head_dim_k": st.head_dim_k,
                    "head_dim_v": st.head_dim_v,
                    "count": st.count,
                    "seen": st.seen,
                }
            )
        save_file(tensors, str(Path(out_dir) / STATS_FILE))
        doc = dict(meta)
        doc.update({"skip": self.skip, "score_weighted": self.score_weighted, "layers": layers_meta})
        (Path(out_dir) / META_FILE).write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")


@dataclass
class Calibration:
    """A loaded calibration artifact: per-layer statistics plus its metadata (model, data, tokens)."""

    path: Path
    meta: dict
    layers: dict[int, LayerStats]

    @property
    def model(self) -> str:
        return self.meta.get("model", "?")

    @property
    def weights_sha256(self) -> str | None:
        return self.meta.get("weights_sha256")


def load_calibration(path: str | Path, *, verify: bool = True) -> Calibration:
    """Load a calibration artifact written by `lowbit calibrate` (checks its manifest when verify)."""
    path = Path(path)
    if not (path / META_FILE).is_file() or not (path / STATS_FILE).is_file():
        raise LowbitError(f"{path} is not a calibration artifact (no {META_FILE}/{STATS_FILE}): run `lowbit calibrate`")
    if verify:
        verify_artifact(path, kind="calibration")
    meta = json.loads((path / META_FILE).read_text())
    tensors = load_file(str(path / STATS_FILE))
    layers = {}
    for lm in meta["layers"]:
        i = lm["index"]
        st = LayerStats(
            i, lm["num_kv_heads"], lm["head_dim_k"], lm["head_dim_v"], lm["num_q_heads"], lm["count"], lm["seen"],
            t={n: tensors[f"layers.{i}.{n}"] for n in STAT_NAMES},
        )
        st.k_sample = tensors[f"layers.{i}.k_sample"].float()
        st.v_sample = tensors[f"layers.{i}.v_sample"].float()
        layers[i] = st
    return Calibration(path, meta, layers)


def verify_artifact(path: Path, kind: str) -> None:
    """Every file listed in the manifest must match its sha256; the artifact must be of `kind`."""
    man = load_manifest(path)
    if man.kind != kind:
        raise LowbitError(f"{path} is a {man.kind!r} artifact, not {kind!r}")
    bad = [(p, s) for p, s in verify(path) if s != OK]
    if bad:
        raise LowbitError(f"{path} failed its manifest check ({bad[0][0]}: {bad[0][1]}): the artifact is corrupted, recreate it")
