"""Lloyd-Max levels fitted on a calibration sample as the cache sees it (rotated, centred, per group).

    levels = fitted_levels(calib, rotations, scheme)        # layer -> (levels_k | None, levels_v | None)
    lowbit.kv.plan.save_levels(dir, {i: {"k": lk, "v": lv}}, model=...)   # a LevelsRef for a KVScheme
"""

from __future__ import annotations

from lowbit.kv.rotations import rotate
from lowbit.quant.lloyd_max import fit_levels


def fitted_levels(calib, rot: dict, scheme, center: dict | None = None) -> dict:
    """layer -> (levels_k, levels_v): codebooks fitted on `calib` (lowbit.calib.stats.Calibration) after
    the layer's rotation (rot: layer -> (R_k, R_v)) and optional centring, grouped as the scheme's codec
    groups (per token: group channels; per channel: page-token blocks). None where a tensor is not
    Lloyd-Max."""
    out = {}
    for i, st in calib.layers.items():
        rk, rv = rot.get(i, (None, None))
        mk, mv = (center or {}).get(i, (None, None))
        pair = []
        for which, tq, R, mu in (("k", scheme.k, rk, mk), ("v", scheme.v, rv, mv)):
            if not tq.lloyd_max:
                pair.append(None)
                continue
            x = st.sample(which).permute(1, 0, 2)[None]  # [1, H, N, D]
            if mu is not None:
                x = x - mu.float()[None, :, None, :]
            x = rotate(x, R)
            if tq.axis == "channel":
                n = x.shape[2] // scheme.page * scheme.page
                x = x[:, :, :n].reshape(1, x.shape[1], -1, scheme.page, x.shape[-1]).transpose(-1, -2)
                pair.append(fit_levels(x, tq.bits, group=scheme.page))
            else:
                pair.append(fit_levels(x, tq.bits, group=tq.group_for(x.shape[-1], scheme.page)))
        out[i] = tuple(pair)
    return out
