"""Calibration plumbing: decoder-layer inputs, and per-linear Hessians H = X^T X / n from hooks.

Kept apart from the GPTQ math (gptq.py), which only ever sees a weight and a Hessian.

`capture_layer_inputs` runs the model up to the first decoder layer for each calibration batch
and records that layer's input hidden states; the keyword arguments each layer receives
(position embeddings, masks -- functions of the batch shape only, not of its content) are recorded
once per layer from one full forward of the first batch, so architectures whose layers differ
(Gemma3's sliding / full layers) get their own.

`HessianCollector` hooks the linears of one layer: every forward adds x^T x of the input rows
(x: [tokens, in], float32). Linears fed the very same tensor (q/k/v, gate/up) share one
accumulator, so each distinct input is multiplied once.
"""

from __future__ import annotations

import torch
from torch import nn

from lowbit.core.errors import LowbitError


class _Stop(Exception):
    pass


def first_output(out):
    """A module's main output: the first element when it returns a tuple."""
    return out[0] if isinstance(out, (tuple, list)) else out


@torch.no_grad()
def capture_layer_inputs(
    model: nn.Module, layers: nn.ModuleList, batches: list[torch.Tensor]
) -> tuple[list[torch.Tensor], list[dict]]:
    """Inputs of layers[0] per batch and the kwargs of every layer.

    batches: list of int64 [B, T], all the same shape. Returns (hidden [B, T, d] per batch,
    kwargs per layer index).
    """
    if len({tuple(b.shape) for b in batches}) != 1:
        raise LowbitError("calibration batches must all have the same shape")
    layer_kwargs: list[dict | None] = [None] * len(layers)
    hidden: list[torch.Tensor] = []
    stop_at_first = [False]

    def make_pre(i):
        def pre(mod, args, kwargs):
            if layer_kwargs[i] is None:
                layer_kwargs[i] = {k: v for k, v in kwargs.items() if k != "hidden_states"}
            if i == 0:
                hs = args[0] if args else kwargs["hidden_states"]
                hidden.append(hs.detach())
                if stop_at_first[0]:
                    raise _Stop
        return pre

    def after_last(mod, args, out):
        raise _Stop  # nothing after the decoder layers (final norm, LM head) is needed

    handles = [layer.register_forward_pre_hook(make_pre(i), with_kwargs=True) for i, layer in enumerate(layers)]
    handles.append(layers[-1].register_forward_hook(after_last))
    try:
        for j, ids in enumerate(batches):
            stop_at_first[0] = j > 0  # the first batch runs through every layer to record kwargs
            try:
                model(input_ids=ids, use_cache=False)
            except _Stop:
                pass
    finally:
        for h in handles:
            h.remove()
    if any(k is None for k in layer_kwargs):
        raise LowbitError("calibration forward did not reach every decoder layer; is the model complete?")
    for kw in layer_kwargs:
        kw.pop("past_key_values", None)
        kw.pop("cache", None)
        kw["use_cache"] = False
    return hidden, layer_kwargs


@torch.no_grad()
def run_layer(layer: nn.Module, hidden: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """One decoder layer on hidden [B, T, d] -> [B, T, d]."""
    return first_output(layer(hidden, **kwargs))


class HessianCollector:
    """Accumulate H = sum x^T x and token counts for the given linears (name -> module) while hooked.

    Use as a context manager; afterwards `hessian(name)` gives float32 [in, in] = mean x^T x.
    """

    def __init__(self, linears: dict[str, nn.Linear]):
        self.linears = linears
        self.owner: dict[str, str] = {}  # name -> name of the accumulator it shares
        self.sums: dict[str, torch.Tensor] = {}
        self.counts: dict[str, int] = {}
        self._handles = []
        self._recent: list[tuple[torch.Tensor, str]] = []  # inputs seen in the current batch

    def new_batch(self) -> None:
        """Forget the inputs of the previous batch (they are only compared by identity)."""
        self._recent = []

    def _hook(self, name: str):
        def pre(mod, args):
            x = args[0]
            for t, owner in self._recent:
                if t is x:  # same tensor object as an earlier linear's input in this batch
                    self.owner.setdefault(name, owner)
                    return
            self._recent.append((x, name))  # holding x keeps its memory from being reused
            self.owner.setdefault(name, name)
            x2 = x.detach().reshape(-1, x.shape[-1]).float()  # [tokens, in]
            if name not in self.sums:
                self.sums[name] = torch.zeros(x2.shape[1], x2.shape[1], dtype=torch.float32, device=x2.device)
                self.counts[name] = 0
            self.sums[name].addmm_(x2.T, x2)
            self.counts[name] += x2.shape[0]
        return pre

    def __enter__(self):
        for name, lin in self.linears.items():
            self._handles.append(lin.register_forward_pre_hook(self._hook(name)))
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles = []
        self._recent = []
        return False

    def hessian(self, name: str) -> torch.Tensor:
        """Mean x^T x (float32 [in, in]) of the inputs `name` saw; LowbitError if it saw none."""
        owner = self.owner.get(name)
        if owner is None or self.counts.get(owner, 0) == 0:
            raise LowbitError(f"calibration never reached linear {name}: its input hook saw no tokens (the model's "
                              "forward skips it); check the model's forward")
        return self.sums[owner] / self.counts[owner]

    def tokens(self, name: str) -> int:
        return self.counts.get(self.owner.get(name, name), 0)


def calib_batches(calib: torch.Tensor, batch_size: int) -> list[torch.Tensor]:
    """Calibration ids [n, T] cut into equal-shape batches of at most batch_size sequences."""
    n = calib.shape[0]
    bs = max(d for d in range(1, min(batch_size, n) + 1) if n % d == 0)  # equal-shape batches
    return list(calib.split(bs))


def layer_prefix(model: nn.Module, layer: nn.Module) -> str:
    """The dotted name of `layer` inside `model`."""
    for name, m in model.named_modules():
        if m is layer:
            return name
    raise LowbitError("decoder layer not found in the model")
