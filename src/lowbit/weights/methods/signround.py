"""SignRound, sequential: per decoder layer, tune the rounding on (quantized-model inputs -> unquantized outputs).

The tuning of one layer is lowbit.weights.signround.tune_layer; this file runs it layer after layer.
"""

from __future__ import annotations

import logging
import time

import torch

from lowbit.core.errors import LowbitError
from lowbit.core.progress import bar as progress_bar
from lowbit.weights.hooks import calib_batches, capture_layer_inputs, layer_prefix, run_layer
from lowbit.weights.methods import Method, MethodJob, register
from lowbit.weights.signround import SignRoundConfig, tune_layer

log = logging.getLogger("lowbit.weights")


def run(job: MethodJob) -> None:
    cfg = job.options.get("signround") or SignRoundConfig()
    model, layers, targets, calib, report = job.model, job.layers, job.targets, job.calib, job.report
    with progress_bar(len(layers), "SignRound", "layer", job.progress) as pb:
        # minibatches have the calibration batch shape: the recorded layer kwargs (masks, position
        # embeddings) are for that shape
        batches = calib_batches(calib, cfg.batch or job.batch_size)
        bs = batches[0].shape[0]
        if cfg.batch and bs != cfg.batch:
            raise LowbitError(f"SignRound batch {cfg.batch} does not divide the {calib.shape[0]} calibration sequences")
        report.calib_tokens = int(calib.numel())
        with job.autocast():
            hidden, layer_kwargs = capture_layer_inputs(model, layers, batches)
        x_fp = torch.cat(hidden)  # [n, T, d] the unquantized model's hidden states
        x_q = x_fp.clone()  # the quantized model's
        del hidden
        for i, layer in enumerate(layers):
            tl = time.perf_counter()
            prefix = layer_prefix(model, layer)
            mine = {n: m for n, m in targets.items() if n.startswith(prefix + ".")}
            with job.autocast():
                y_fp = torch.cat([run_layer(layer, x_fp[j:j + bs], layer_kwargs[i]) for j in range(0, len(x_fp), bs)])
            result, stats = tune_layer(layer, mine, x_q, y_fp, layer_kwargs[i], job.scheme, cfg, batch=bs,
                                       autocast=job.autocast, scale_dtype=job.scale_dtype)
            for name, qw in result.items():
                job.done(name, mine[name], qw)
            report.signround[i] = stats
            with job.autocast():
                x_q = torch.cat([run_layer(layer, x_q[j:j + bs], layer_kwargs[i]) for j in range(0, len(x_q), bs)])
            x_fp = y_fp
            if pb is not None and pb.enabled:
                pb.update(1)
                pb.set_postfix_str(f"loss {stats['loss_rtn']:.3g} -> {stats['loss_best']:.3g}")
                continue
            log.info("layer %d/%d signround in %.1fs: loss %.3g -> %.3g (step %d)", i + 1, len(layers),
                     time.perf_counter() - tl, stats["loss_rtn"], stats["loss_best"], stats["best_step"])


METHOD = register(Method("signround", run, needs_calib=True, layerwise=True, module=__name__))
