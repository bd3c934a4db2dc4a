"""Teacher-forced scoring: chunked through a cache (as in serving) and the plain full-window reference.

Scored positions (the protocol every number here follows): a window holds L tokens t_0..t_{L-1};
the logits at position i predict t_{i+1}, so positions 0..L-2 are scored against targets
t_1..t_{L-1}: L-1 predictions per window. t_0 has no context and is never a target.

Memory: a window's full logits are L x V floats (2048 x 262144 x 4 B = 2.1 GB for Gemma 3), so
nothing here ever holds them: the chunked path scores C x V logits at a time, and the full-window
reference runs the decoder once and applies the LM head in slices.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass

import torch

# Logit post-processing that only the built-in architectures' heads do (Gemma's softcap). A model whose
# config names another logit transform takes the plain forward in `full_window_logprob_slices`.
_UNKNOWN_LOGIT_TRANSFORMS = ("logit_scale", "logits_scaling", "output_multiplier_scale")


def cache_kwarg(model) -> str:
    """Name of the cache argument of `model.forward`: `cache` (transformers 5.24) or
    `past_key_values` (5.17)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def forward_chunk(model, ids: torch.Tensor, cache) -> torch.Tensor:
    """Logits [B, C, V] (float32) of `ids` [B, C] appended to `cache` (positions continue from it)."""
    out = model(input_ids=ids, use_cache=True, **{cache_kwarg(model): cache})
    return out.logits.float()


@dataclass
class Scores:
    """Running sums over scored tokens for one scheme (float64 so 16k tokens add up exactly enough).

    nll:  sum of -log p(target)
    kl:   sum over tokens of KL(ref || this) = sum_v p_ref (log p_ref - log p_this)
    top1: count of tokens whose argmax equals the reference's argmax
    n:    tokens scored
    dnll, dnll2: sums of d and d^2, d = this row's -log p(target) minus the reference's on the same
          token (0 for the reference itself): the paired spread behind delta_ppl_se_pct
    """

    nll: float = 0.0
    kl: float = 0.0
    top1: int = 0
    n: int = 0
    dnll: float = 0.0
    dnll2: float = 0.0

    @property
    def ppl(self) -> float:
        return math.exp(self.nll / self.n) if self.n else float("nan")

    @property
    def mean_kl(self) -> float:
        return self.kl / self.n if self.n else float("nan")

    @property
    def top1_pct(self) -> float:
        return 100.0 * self.top1 / self.n if self.n else float("nan")

    def delta_ppl_se_pct(self) -> float | None:
        """Standard error of this row's ΔPPL % against the reference, from the per-token paired NLL
        differences: ΔPPL % = 100 (exp(mean d) - 1), so SE = 100 exp(mean d) sd(d) / sqrt(n). Tokens of
        one window are correlated, so this is a lower bound on the true noise. None below 2 tokens."""
        if self.n < 2:
            return None
        mean = self.dnll / self.n
        var = max(0.0, (self.dnll2 - self.n * mean * mean) / (self.n - 1))
        return 100.0 * math.exp(mean) * math.sqrt(var / self.n)

    def add(self, logp: torch.Tensor, targets: torch.Tensor, ref_logp: torch.Tensor | None = None,
            ref_p: torch.Tensor | None = None, ref_top: torch.Tensor | None = None) -> None:
        """Add T scored tokens. logp, ref_logp: [T, V] float32 log-probs; targets: [T] int64.
        With ref_logp None (the reference itself) KL is 0 and top-1 agreement is 100% by definition.
        ref_p = ref_logp.exp() and ref_top = ref_logp.argmax(-1) may be passed in, computed once per chunk
        for all rows (T x V is 33M floats per 128-token chunk of a 262k vocabulary)."""
        t = int(targets.shape[0])
        if t == 0:
            return
        nll = -logp.gather(1, targets[:, None])[:, 0]  # [T]
        self.nll += float(nll.sum(dtype=torch.float64))
        if ref_logp is None:
            self.top1 += t
        else:
            d = (nll - -ref_logp.gather(1, targets[:, None])[:, 0]).double()  # [T] paired NLL difference
            self.dnll += float(d.sum())
            self.dnll2 += float((d * d).sum())
            # KL(ref || this): the reference's probabilities weight the log ratio
            ref_p = ref_logp.exp() if ref_p is None else ref_p
            ref_top = ref_logp.argmax(-1) if ref_top is None else ref_top
            # the direct form: each term is small, so float32 products summed per token stay accurate
            self.kl += float((ref_p * (ref_logp - logp)).sum(-1).sum(dtype=torch.float64))
            self.top1 += int((logp.argmax(-1) == ref_top).sum())
        self.n += t


def chunk_targets(window: torch.Tensor, start: int, end: int) -> tuple[int, torch.Tensor]:
    """For the chunk of positions [start, end) of `window` [L]: (number of scored positions, targets).
    Position i is scored when i + 1 < L, its target is window[i + 1]."""
    L = int(window.shape[0])
    stop = min(end, L - 1)
    n = max(0, stop - start)
    return n, window[start + 1 : start + 1 + n]


def _text_config(model):
    cfg = model.config
    return cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg


@torch.no_grad()
def full_window_logprob_slices(model, window: torch.Tensor, slice_len: int = 256):
    """Yield (start, logp [n, V] float32) for slices of the window's scored positions, from ONE plain
    forward of the whole window (no cache, causal mask over the whole window).

    For the usual decoder + LM head models (Llama, Gemma 3, ...) the decoder runs once and the head is
    applied per slice (Gemma's final logit softcap included), so L x V logits are never held; a model
    whose config names another logit transform falls back to model(window).logits.
    """
    ids = window[None, :]  # [1, L]
    L = int(window.shape[0])
    cfg = _text_config(model)
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    head = model.get_output_embeddings()
    plain = decoder is None or head is None or any(getattr(cfg, a, None) not in (None, 1, 1.0)
                                                   for a in _UNKNOWN_LOGIT_TRANSFORMS)
    if plain:
        logits = model(input_ids=ids, use_cache=False).logits[0].float()  # [L, V]
        for s in range(0, L - 1, slice_len):
            e = min(s + slice_len, L - 1)
            yield s, torch.log_softmax(logits[s:e], dim=-1)
        return
    hidden = decoder(input_ids=ids, use_cache=False).last_hidden_state[0]  # [L, H]
    softcap = getattr(cfg, "final_logit_softcapping", None)
    for s in range(0, L - 1, slice_len):
        e = min(s + slice_len, L - 1)
        logits = head(hidden[s:e]).float()  # [n, V]
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        yield s, torch.log_softmax(logits, dim=-1)


@torch.no_grad()
def full_window_ppl(model, windows: torch.Tensor) -> float:
    """Reference perplexity: a plain forward of each window [N, L] (no cache), positions 0..L-2 scored
    against t_1..t_{L-1}. The chunked-through-cache bf16 run must match this (to 0.5%)."""
    scores = Scores()
    for w in windows:
        for s, logp in full_window_logprob_slices(model, w):
            n = logp.shape[0]
            scores.add(logp, w[s + 1 : s + 1 + n])
    return scores.ppl
