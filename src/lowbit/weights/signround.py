"""SignRound: tune each weight's rounding and each group's range on a decoder layer's output.

Cheng et al. 2023, "Optimize Weight Rounding via Signed Gradient Descent for the Quantization of
LLMs" (the method behind Intel's AutoRound), written here from the paper's description.

For one decoder layer, every linear W [out, in] (G = in // group groups) gets trainable
    v      [out, in]  rounding offset in [-0.5, 0.5]               (0: round to nearest)
    a, b   [out, G]   factors in [MIN_RANGE, 1] on each group's min and max   (1: plain min/max)
and the layer runs with its weights fake-quantized on the integer grid compressed-tensors stores:

    lo' = min(a * lo, 0),  hi' = max(b * hi, 0)          (symmetric: amax' = b * max|w|)
    s = (hi' - lo') / qmax,  z = clamp(round(-lo' / s), 0, qmax),  zero = -z * s
    W_hat = clamp(round((W - zero) / s + v), 0, qmax) * s + zero

round() passes its gradient straight through. The loss is the mean squared difference between the
layer's output on its quantized-model inputs and the unquantized layer's output on its
unquantized-model inputs, so each layer also corrects the drift the layers before it left. Each
step runs a random minibatch of calibration sequences and moves every parameter by
lr_t * sign(grad), lr_t decaying linearly from lr to 0 over `iters` steps. The loss over the whole
calibration set is measured before the first step (that is plain min/max RTN: v = 0, a = b = 1)
and every `eval_every` steps; the parameters with the lowest one are kept, so the result never
scores worse than RTN on the calibration set.

The result goes through the same grid and encoder as RTN and GPTQ: grid.grid_for_range(a*lo, b*hi)
lays out the integer grid, and grid.quantize_on(W + v * s) gives the codes (round((W - zero) / s + v)
on that grid). Schemes with int8 activations fake-quantize each linear's input per token (symmetric int8,
as QuantLinear does) inside the loop too, so the weights learn to absorb that error as well.
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.nn import functional as F

from lowbit.core.errors import LowbitError
from lowbit.weights.arch import set_module
from lowbit.weights.gptq import QuantizedWeight
from lowbit.weights.grid import grid_for_range, group_range, quantize_on
from lowbit.weights.hooks import first_output
from lowbit.weights.qlinear import quantize_activations_per_token
from lowbit.weights.scheme import WeightScheme

MIN_RANGE = 0.5  # smallest factor on a group's min / max (halving the range is already far past useful)
SIGNROUND_VERSION = 1


@dataclass(frozen=True)
class SignRoundConfig:
    """iters: signed-gradient steps per decoder layer; lr: step size at the start (None: 1 / iters,
    so v can cross at most about half a step); batch: sequences per step (None: the calibration
    batch size); eval_every: steps between full-calibration losses; seed: minibatch order."""

    iters: int = 200
    lr: float | None = None
    batch: int | None = None
    eval_every: int = 50
    seed: int = 0
    version: int = SIGNROUND_VERSION

    def __post_init__(self):
        if self.iters < 0:
            raise LowbitError(f"SignRound iters must be >= 0, got {self.iters}")
        if self.lr is not None and not self.lr > 0:
            raise LowbitError(f"SignRound lr must be > 0, got {self.lr}")
        if self.eval_every < 1:
            raise LowbitError(f"SignRound eval_every must be >= 1, got {self.eval_every}")

    @property
    def step_size(self) -> float:
        return self.lr if self.lr is not None else 1.0 / max(self.iters, 1)

    def to_dict(self) -> dict:
        return asdict(self)


def _round_ste(x: torch.Tensor) -> torch.Tensor:
    """round(x) forward, identity gradient."""
    return x + (torch.round(x) - x).detach()


def fake_quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """Per-token symmetric int8 fake quantization of x [..., in] (QuantLinear's a8 rounding), STE gradient."""
    xq, s = quantize_activations_per_token(x.detach().reshape(-1, x.shape[-1]))  # int8 [M, in], [M, 1]
    x_hat = (xq.float() * s).reshape(x.shape).to(x.dtype)
    return x + (x_hat - x).detach()


class TunedLinear(nn.Module):
    """A linear whose weight is fake-quantized with trainable rounding (v) and range (a, b).

    W is the frozen float32 weight [out, in]; see the module docstring for the formula.
    """

    def __init__(self, lin: nn.Linear, scheme: WeightScheme, scale_dtype: torch.dtype = torch.float32):
        super().__init__()
        W = lin.weight.detach().float()
        n = W.shape[1]
        self.bits, self.group, self.symmetric = scheme.w_bits, scheme.group_for(n), scheme.symmetric
        self.act_int8 = scheme.a_bits == 8
        self.scale_dtype = scale_dtype
        self.register_buffer("W", W.clone())
        lo, hi = group_range(W, self.group)  # [out, G]
        self.register_buffer("lo", lo)
        self.register_buffer("hi", hi)
        self.bias = None if lin.bias is None else lin.bias.detach()
        self.v = nn.Parameter(torch.zeros_like(W))
        self.a = nn.Parameter(torch.ones_like(lo))
        self.b = nn.Parameter(torch.ones_like(lo))

    def _scale_zero(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Differentiable (s, zero) [out, G] of the integer grid, laid out as grid.grid_for_range does
        (affine's centred layout, then the zero snapped to an integer number of steps): x = c * s + zero."""
        qmax = (1 << self.bits) - 1
        if self.symmetric:
            amax = torch.maximum(self.lo.abs(), self.hi.abs()) * self.b
            s = amax * (2.0 / qmax)  # affine's float order, so untrained codes equal RTN's bit for bit
            s = torch.where(s > 0, s, torch.ones_like(s))
            return s, -float(1 << (self.bits - 1)) * s
        lo = torch.clamp(self.a * self.lo, max=0.0)
        hi = torch.clamp(self.b * self.hi, min=0.0)
        s = ((hi - lo) * 0.5) * (2.0 / qmax)
        s = torch.where(s > 0, s, torch.ones_like(s))
        zero = (lo + hi) * 0.5 - s * (qmax * 0.5)
        z = torch.clamp(_round_ste(-zero / s), 0, qmax)  # unsigned zero index = compressed-tensors' zp + 2**(b-1)
        return s, -z * s

    def weight_hat(self) -> torch.Tensor:
        """float32 [out, in]: the fake-quantized weight at the current v, a, b (grid.encode/decode's formulas)."""
        out, n = self.W.shape
        G, g = n // self.group, self.group
        s, zero = self._scale_zero()
        s3, z3 = s.unsqueeze(-1), zero.unsqueeze(-1)  # [out, G, 1]
        w3 = self.W.reshape(out, G, g)
        v3 = self.v.reshape(out, G, g)
        c = torch.clamp(_round_ste((w3 - z3) / s3 + v3), 0, (1 << self.bits) - 1)
        return (c * s3 + z3).reshape(out, n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.act_int8:
            x = fake_quantize_activations(x)
        return F.linear(x, self.weight_hat(), self.bias)

    @torch.no_grad()
    def signed_step(self, lr: float) -> None:
        """p -= lr * sign(grad) for v, a, b; clamp to their ranges; clear the gradients."""
        for p, lo, hi in ((self.v, -0.5, 0.5), (self.a, MIN_RANGE, 1.0), (self.b, MIN_RANGE, 1.0)):
            if p.grad is not None:
                p.sub_(lr * torch.sign(p.grad)).clamp_(lo, hi)
                p.grad = None

    def state(self) -> tuple[torch.Tensor, ...]:
        return tuple(p.detach().clone() for p in (self.v, self.a, self.b))

    @torch.no_grad()
    def load(self, st: tuple[torch.Tensor, ...]) -> None:
        for p, t in zip((self.v, self.a, self.b), st):
            p.copy_(t)

    @torch.no_grad()
    def finalize(self) -> QuantizedWeight:
        """Codes and grid through the shared quantizer: grid_for_range(a*lo, b*hi), codes of W + v*s."""
        a = self.b if self.symmetric else self.a  # symmetric grids scale max|w| by b alone
        grid = grid_for_range(a * self.lo, self.b * self.hi, self.bits, self.group, self.symmetric, self.scale_dtype)
        s = grid.scale.repeat_interleave(self.group, dim=1)  # [out, in]
        codes = quantize_on(self.W + self.v * s, grid)
        return QuantizedWeight(codes, grid, "signround")


@torch.no_grad()
def tune_layer(
    layer: nn.Module,
    linears: dict[str, nn.Linear],
    inputs: torch.Tensor,
    targets: torch.Tensor,
    layer_kwargs: dict,
    scheme: WeightScheme,
    cfg: SignRoundConfig,
    *,
    batch: int,
    autocast=None,
    scale_dtype: torch.dtype = torch.float32,
) -> tuple[dict[str, QuantizedWeight], dict]:
    """SignRound on one decoder layer (see module docstring).

    layer: the decoder layer holding `linears` (name -> nn.Linear, left in place on return);
    inputs: [n, T, d] hidden states the quantized model feeds this layer; targets: [n, T, d] the
    unquantized layer's outputs on the unquantized model's hidden states; layer_kwargs: what the layer
    is called with for `batch` sequences (n must be a multiple of `batch`); autocast: a callable
    giving a context manager for the forwards (None: none).
    Returns (name -> QuantizedWeight, stats {loss_rtn, loss_best, best_step}).
    """
    ac = autocast or contextlib.nullcontext
    n = inputs.shape[0]
    if n % batch:
        raise LowbitError(f"SignRound: {n} calibration sequences do not split into batches of {batch}")
    tuned = {name: TunedLinear(lin, scheme, scale_dtype).to(lin.weight.device) for name, lin in linears.items()}
    frozen = [(p, p.requires_grad) for p in layer.parameters()]
    for p, _ in frozen:
        p.requires_grad_(False)
    path = {id(m): p for p, m in layer.named_modules()}  # module -> its path inside the layer
    missing = [name for name, lin in linears.items() if id(lin) not in path]
    if missing:
        raise LowbitError(f"SignRound: {missing[0]} is not inside the decoder layer it was given with")
    swapped: list[str] = []

    def full_loss() -> float:
        tot = 0.0
        with ac():
            for i in range(0, n, batch):
                out = first_output(layer(inputs[i:i + batch], **layer_kwargs))
                tot += float((out.float() - targets[i:i + batch].float()).pow(2).mean())
        return tot / (n // batch)

    try:
        for name, lin in linears.items():
            set_module(layer, path[id(lin)], tuned[name])
            swapped.append(name)
        gen = torch.Generator().manual_seed(cfg.seed)
        loss_rtn = best = full_loss()
        best_step, best_state = 0, {k: t.state() for k, t in tuned.items()}
        lr = cfg.step_size
        for step in range(cfg.iters):
            idx = torch.randperm(n, generator=gen)[:batch].to(inputs.device)
            with torch.enable_grad(), ac():
                out = first_output(layer(inputs[idx], **layer_kwargs))
                loss = (out.float() - targets[idx].float()).pow(2).mean()
            loss.backward()
            lr_t = lr * (1.0 - step / cfg.iters)
            for t in tuned.values():
                t.signed_step(lr_t)
            if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.iters:
                cur = full_loss()
                if cur < best:
                    best, best_step, best_state = cur, step + 1, {k: t.state() for k, t in tuned.items()}
        for k, t in tuned.items():
            t.load(best_state[k])
        result = {name: t.finalize() for name, t in tuned.items()}
    finally:
        for name in swapped:
            set_module(layer, path[id(linears[name])], linears[name])
        for p, rg in frozen:
            p.requires_grad_(rg)
    return result, {"loss_rtn": loss_rtn, "loss_best": best, "best_step": best_step}
