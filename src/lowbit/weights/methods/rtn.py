"""RTN: round each group to its nearest grid level (optionally after an MSE clip search); no calibration."""

from __future__ import annotations

from lowbit.weights.gptq import rtn_quantize
from lowbit.weights.methods import Method, MethodJob, register


def run(job: MethodJob) -> None:
    bits, sym = job.scheme.w_bits, job.scheme.symmetric
    for name, lin in job.targets.items():
        g = job.scheme.group_for(lin.in_features)
        job.done(name, lin, rtn_quantize(lin.weight, bits, g, sym, clip_search=job.options.get("clip_search", True),
                                         scale_dtype=job.scale_dtype))


METHOD = register(Method("rtn", run, needs_calib=False, layerwise=False, module=__name__))
