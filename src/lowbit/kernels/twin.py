"""How a kernel is judged against its torch twin: the tolerance and one row of the judgement.

Every kernel (Triton, CUDA C++, the vLLM plugin's C++ CPU kernels) has a twin computed plainly in
float32; an audit runs both on the same inputs and records one AuditRow per case. Shared by the
audits of every kernel family (lowbit.tools.audit, lowbit.vllm_plugin.kernel_audit).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

TOL = 1e-3  # relative L2 error, kernel (fp32 output) vs float32 twin


@dataclass
class AuditRow:
    kernel: str
    case: str
    rel_l2: float
    max_rel: float
    finite: bool
    ok: bool
    seconds: float

    def as_dict(self) -> dict:
        return asdict(self)
