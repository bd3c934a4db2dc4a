"""GPTQ, sequential: per decoder layer, Hessians from calibration inputs, GPTQ each linear, then the next inputs.

For each decoder layer: (1) run the calibration batches through it with hooks collecting H per linear,
(2) GPTQ every linear of the layer (lowbit.weights.gptq), (3) run the batches through the now-quantized
layer to get the next layer's inputs. With sequential=False step (3) reuses the outputs of step (1)
(one pass per layer, later layers see unquantized inputs).
"""

from __future__ import annotations

import logging
import time

from lowbit.core.progress import bar as progress_bar
from lowbit.weights.gptq import gptq_quantize
from lowbit.weights.hooks import (
    HessianCollector,
    calib_batches,
    capture_layer_inputs,
    layer_prefix,
    run_layer,
)
from lowbit.weights.methods import Method, MethodJob, register

log = logging.getLogger("lowbit.weights")


def run(job: MethodJob) -> None:
    o = job.options
    model, layers, targets, scheme = job.model, job.layers, job.targets, job.scheme
    bits, sym = scheme.w_bits, scheme.symmetric
    sequential = o.get("sequential", True)
    batches = calib_batches(job.calib, job.batch_size)
    job.report.calib_tokens = int(job.calib.numel())
    t0 = o.get("t0", time.perf_counter())  # quantize_model's start: the elapsed time of the whole job
    # one bar over the whole job, opened before the first forward: capturing the decoder's inputs
    # (step 1) took ~30 s on a 2-core CPU with nothing on screen, then one step per layer
    pb = progress_bar(len(layers) + 1, "GPTQ", "step", job.progress)
    pb.set_postfix_str("capturing the decoder's inputs")
    if not pb.enabled:
        log.info("GPTQ: capturing the decoder's inputs on %d calibration sequences, then %d layers",
                 int(job.calib.shape[0]), len(layers))
    tc = time.perf_counter()
    with job.autocast():
        hidden, layer_kwargs = capture_layer_inputs(model, layers, batches)
    pb.update(1)
    if not pb.enabled:
        log.info("GPTQ: inputs captured in %.1fs", time.perf_counter() - tc)
    layer_index = {id(layer): i for i, layer in enumerate(layers)}
    t_layers = time.perf_counter()
    for i, layer in enumerate(layers):
        pb.set_postfix_str(f"layer {i + 1}/{len(layers)}")
        tl = time.perf_counter()
        prefix = layer_prefix(model, layer)
        mine = {n: m for n, m in targets.items() if n.startswith(prefix + ".")}
        outs = []
        with HessianCollector(mine) as hc, job.autocast():
            for h in hidden:
                hc.new_batch()
                out = run_layer(layer, h, layer_kwargs[i])
                if not sequential:
                    outs.append(out)
        for name, lin in mine.items():
            H = hc.hessian(name)
            g = scheme.group_for(lin.in_features)
            qw = gptq_quantize(
                lin.weight, H, bits, g, sym, block=o.get("block", 128), damp=o.get("damp", 0.01),
                act_order=o.get("act_order", True), clip_search=o.get("clip_search", True), name=name,
                scale_dtype=job.scale_dtype, weighted_clip=o.get("weighted_clip", False),
            )
            job.done(name, lin, qw)
        del hc
        if sequential:
            with job.autocast():
                outs = [run_layer(layer, h, layer_kwargs[i]) for h in hidden]
        hidden = outs
        pb.update(1)
        if not pb.enabled:  # the bar says it otherwise: the same elapsed and ETA, one line a layer
            k = layer_index[id(layer)] + 1
            spent = time.perf_counter() - t_layers
            log.info("layer %d/%d quantized in %.1fs (elapsed %.0fs, ETA %.0fs)", k, len(layers),
                     time.perf_counter() - tl, time.perf_counter() - t0, spent / k * (len(layers) - k))
    pb.close()


METHOD = register(Method("gptq", run, needs_calib=True, layerwise=True, module=__name__))
