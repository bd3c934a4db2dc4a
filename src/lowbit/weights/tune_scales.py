"""End-to-end scale tuning: fit the quantized model's group scales to the unquantized model's logits.

Once RTN, GPTQ or SignRound has fixed the integer codes, each group's float scale is the one number
of the stored format that is still free (the zero-point is an integer and stays). Following the
second phase of EfficientQAT (Chen et al. 2024, "E2E-QP": train only the quantization step sizes end
to end, codes frozen), written here from the paper's description, every QuantLinear's scale
[out, G] becomes

    s = s0 * (1 + r),   r [out, G] trainable, 0 at the start (the quantizer's own scale)
    w = (q - zero_point) * s                      (the codes never move)

and r is fitted with Adam (cosine decay from lr to 0) to minimise the KL divergence from the
unquantized model's next-token distribution to the quantized model's, averaged over every token of
the calibration sequences. The product of the per-layer methods is thus corrected for what they
cannot see: how the errors of all layers add up at the output. The relative parametrisation makes
one learning rate fit scales of any magnitude. Training sees the scale rounded to the checkpoint's
scale dtype (straight-through), and int8-activation schemes fake-quantize each linear's input per
token as QuantLinear does, so what is trained is what is stored and served.

Fewer ways to fool yourself: the last 1/8 of the calibration sequences (at least one) are held out
and never trained on; the KL on them is measured before and after, and the tuned scales are kept
only if it went down (otherwise the quantizer's scales stay, and the stats say so).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.nn import functional as F

from lowbit.core.errors import LowbitError
from lowbit.weights.arch import set_module
from lowbit.weights.qlinear import QuantLinear
from lowbit.weights.signround import fake_quantize_activations

SCALE_TUNE_VERSION = 1
MIN_FACTOR = 0.05  # 1 + r is kept above this, so a scale never reaches 0 or flips sign


@dataclass(frozen=True)
class ScaleTuneConfig:
    """steps: Adam steps over the whole model; lr: Adam's step size on r at the start (cosine to 0);
    batch: calibration sequences per step; holdout: fraction of the calibration sequences held out
    (at least one) to check the tuning generalises; seed: minibatch order."""

    steps: int = 300
    lr: float = 1e-3
    batch: int = 4
    holdout: float = 0.125
    seed: int = 0
    version: int = SCALE_TUNE_VERSION

    def __post_init__(self):
        if self.steps < 0:
            raise LowbitError(f"scale tuning steps must be >= 0, got {self.steps}")
        if not self.lr > 0:
            raise LowbitError(f"scale tuning lr must be > 0, got {self.lr}")
        if self.batch < 1:
            raise LowbitError(f"scale tuning batch must be >= 1, got {self.batch}")
        if not 0 < self.holdout < 1:
            raise LowbitError(f"scale tuning holdout must be in (0, 1), got {self.holdout}")

    def to_dict(self) -> dict:
        return asdict(self)


def _through_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x rounded to dtype and back to float32 forward, identity gradient."""
    return x + (x.to(dtype).float() - x).detach()


class ScaleTunedLinear(nn.Module):
    """A QuantLinear's frozen integer weight with a trainable relative scale correction r [out, G]."""

    def __init__(self, q: QuantLinear):
        super().__init__()
        self.group, self.scale_dtype, self.act_int8 = q.group, q.scale.dtype, q.scheme.a_bits == 8
        self.register_buffer("iw", q.int_weight().float())  # [out, in] (q - zero_point)
        self.register_buffer("s0", q.scale.float().clone())  # [out, G]
        self.bias = None if q.bias is None else q.bias.detach().float()
        self.r = nn.Parameter(torch.zeros_like(self.s0))

    def scale(self) -> torch.Tensor:
        """float32 [out, G]: s0 * (1 + r) as the checkpoint will store it (rounded to its scale dtype)."""
        return _through_dtype(self.s0 * (1.0 + self.r), self.scale_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [..., in] -> [..., out]
        if self.act_int8:
            x = fake_quantize_activations(x)
        w = self.iw * self.scale().repeat_interleave(self.group, dim=1)  # [out, in]
        return F.linear(x, w.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    @torch.no_grad()
    def clamp_(self) -> None:
        self.r.clamp_(min=MIN_FACTOR - 1.0)


def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, use_cache=False).logits.float()  # [B, T, V]


def token_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of KL(teacher || student), logits [..., V] -> scalar."""
    lt = F.log_softmax(teacher_logits.float(), dim=-1)
    ls = F.log_softmax(student_logits.float(), dim=-1)
    return (lt.exp() * (lt - ls)).sum(-1).mean()


def tune_scales(
    model: nn.Module, teacher: nn.Module, calib: torch.Tensor, cfg: ScaleTuneConfig, *, autocast=None
) -> dict:
    """Tune every QuantLinear's scale in `model` in place (see the module docstring).

    model: holds QuantLinear modules (after quantize_model's method); teacher: the same model
    unquantized (any function-preserving form, e.g. before the rotation), same device; calib:
    int64 [n, T] token ids, n >= 2; autocast: a callable giving a context manager for the forwards.
    Returns stats: {kl_holdout_before, kl_holdout_after, kept, train_loss_first, train_loss_last,
    train_sequences, holdout_sequences, linears}.
    """
    ac = autocast or contextlib.nullcontext
    n = calib.shape[0]
    if n < 2:
        raise LowbitError(f"scale tuning needs at least 2 calibration sequences (one is held out), got {n}")
    n_hold = min(n - 1, max(1, round(n * cfg.holdout)))  # at least one held out, one trained on
    train, hold = calib[: n - n_hold], calib[n - n_hold:]
    qlinears = {name: m for name, m in model.named_modules() if isinstance(m, QuantLinear)}
    if not qlinears:
        raise LowbitError("scale tuning: the model has no quantized linears")
    tuned = {name: ScaleTunedLinear(q).to(q.scale.device) for name, q in qlinears.items()}
    frozen = [(p, p.requires_grad) for p in model.parameters()]
    teacher.eval()

    @torch.no_grad()
    def holdout_kl() -> float:
        tot = 0.0
        for i in range(0, len(hold), cfg.batch):
            ids = hold[i:i + cfg.batch]
            with ac():
                tot += float(token_kl(_logits(model, ids), _logits(teacher, ids))) * len(ids)
        return tot / len(hold)

    swapped: list[str] = []
    losses: list[float] = []
    try:
        for p, _ in frozen:
            p.requires_grad_(False)
        for name, t in tuned.items():
            set_module(model, name, t)
            swapped.append(name)
        before = holdout_kl()
        params = [t.r for t in tuned.values()]
        opt = torch.optim.Adam(params, lr=cfg.lr)
        gen = torch.Generator().manual_seed(cfg.seed)
        bs = min(cfg.batch, len(train))
        for step in range(cfg.steps):
            idx = torch.randperm(len(train), generator=gen)[:bs].to(train.device)
            ids = train[idx]
            with torch.no_grad(), ac():
                t_logits = _logits(teacher, ids)
            with torch.enable_grad(), ac():
                loss = token_kl(_logits(model, ids), t_logits)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            for g in opt.param_groups:
                g["lr"] = cfg.lr * 0.5 * (1.0 + math.cos(math.pi * step / cfg.steps))
            opt.step()
            for t in tuned.values():
                t.clamp_()
            losses.append(float(loss.detach()))
        after = holdout_kl() if cfg.steps else before
        kept = after < before
        with torch.no_grad():
            for name, t in tuned.items():
                if kept:
                    qlinears[name].scale.copy_(t.scale().to(qlinears[name].scale.dtype))
    finally:
        for name in swapped:
            set_module(model, name, qlinears[name])
        for p, rg in frozen:
            p.requires_grad_(rg)
    k = min(10, len(losses))
    return {
        "kl_holdout_before": before, "kl_holdout_after": after, "kept": kept,
        "train_loss_first": sum(losses[:k]) / k if k else None,
        "train_loss_last": sum(losses[-k:]) / k if k else None,
        "train_sequences": len(train), "holdout_sequences": len(hold), "linears": len(tuned),
    }
