"""`lowbit audit kernels --kernel vllm_cpu`: the plugin's C++ CPU kernels against their twins -- every case
passes as built, and a kernel that is off by a little (an output 0.5% high, one flipped code bit) fails."""

from __future__ import annotations

import pytest

from lowbit.vllm_plugin import cpu_kernel
from lowbit.vllm_plugin.kernel_audit import DECODE_CASES, ENCODE_CASES, audit_plugin

MOD, WHY = cpu_kernel.load()
ENC, EWHY = cpu_kernel.load_encoder()
pytestmark = pytest.mark.skipif(MOD is None or ENC is None, reason=f"{WHY or EWHY}")


def test_every_case_passes_as_built():
    rows = audit_plugin()
    assert [r.kernel for r in rows] == ["vllm paged_decode"] * len(DECODE_CASES) + ["vllm encode_cells"] * len(ENCODE_CASES)
    assert all(r.ok and r.finite for r in rows), [r.case for r in rows if not r.ok]
    assert all(r.rel_l2 == 0.0 for r in rows if r.kernel == "vllm encode_cells")
    assert any("(scalar)" in r.case for r in rows) and any("(vector)" in r.case for r in rows)


class _Off:
    """A module proxy whose paged_decode output is 0.5% high and whose encoders flip one code bit."""

    def __init__(self, mod):
        self.mod = mod

    def __getattr__(self, name):
        return getattr(self.mod, name)

    def paged_decode(self, *a):
        return self.mod.paged_decode(*a) * 1.005

    def encode_cells(self, kr, vr, meta, mul, slot_bytes):
        return self._flip(*self.mod.encode_cells(kr, vr, meta, mul, slot_bytes))

    def encode_cells_std(self, *a):
        return self._flip(*self.mod.encode_cells_std(*a))

    @staticmethod
    def _flip(cells, ok):
        cells = cells.clone()
        cells[0, 0, 0] ^= 1
        return cells, ok


def test_a_kernel_slightly_off_fails():
    from lowbit.vllm_plugin import slot

    saved = cpu_kernel._STATE["mod"], cpu_kernel._ENC["mod"]
    cpu_kernel._STATE["mod"], cpu_kernel._ENC["mod"] = _Off(MOD), _Off(ENC)
    real = slot.SlotFormat._encoder

    def enc(self):  # the formats the audit builds resolve their encoder through the proxy
        e = real(self)
        return None if e is None else (cpu_kernel._ENC["mod"],) + tuple(e[1:])

    slot.SlotFormat._encoder = enc
    try:
        rows = audit_plugin()
    finally:
        cpu_kernel._STATE["mod"], cpu_kernel._ENC["mod"] = saved
        slot.SlotFormat._encoder = real
    dec = [r for r in rows if r.kernel == "vllm paged_decode"]
    assert dec and not any(r.ok for r in dec)
    assert all(4e-3 < r.rel_l2 < 6e-3 for r in dec)
    cells = [r for r in rows if r.kernel == "vllm encode_cells"]
    assert cells and not any(r.ok for r in cells) and all(r.max_rel == pytest.approx(1 / 255) for r in cells)
