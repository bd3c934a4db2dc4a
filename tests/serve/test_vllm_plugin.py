"""The vLLM entry point and the backend's process state, against fake `vllm` modules (vLLM is not
installed in the test venv): register() never raises and leaves an unsupported vLLM untouched;
the backend keeps no hidden "last model" and its tier arenas belong to the attention impls."""

from __future__ import annotations

import importlib
import logging
import sys
import types
from typing import Generic, TypeVar

import pytest
import torch

from lowbit.core.errors import LowbitError


def _module(monkeypatch, name: str, **attrs) -> types.ModuleType:
    m = types.ModuleType(name)
    for k, v in attrs.items():
        setattr(m, k, v)
    monkeypatch.setitem(sys.modules, name, m)
    return m


class _Platform:
    def __init__(self, device_name: str, cpu: bool):
        self.device_name, self._cpu = device_name, cpu

    def is_cpu(self) -> bool:
        return self._cpu


def fake_vllm(monkeypatch, *, version="0.32.0", device="cpu", cpu=True, registry=True):
    """sys.modules gets a minimal `vllm`; returns the list register_backend calls append to."""
    calls: list = []
    _module(monkeypatch, "vllm", __version__=version)
    _module(monkeypatch, "vllm.platforms", current_platform=_Platform(device, cpu))
    for name in ("vllm.v1", "vllm.v1.attention", "vllm.v1.attention.backends"):
        _module(monkeypatch, name)
    if registry:
        enum = types.SimpleNamespace(CPU_ATTN="CPU_ATTN", FLASH_ATTN="FLASH_ATTN")
        _module(monkeypatch, "vllm.v1.attention.backends.registry", AttentionBackendEnum=enum,
                register_backend=lambda e, path: calls.append((e, path)))
    else:
        monkeypatch.setitem(sys.modules, "vllm.v1.attention.backends.registry", None)  # import fails
    return calls


def _snapshot() -> dict:
    return {n: dict(vars(m)) for n, m in sys.modules.items() if n == "vllm" or n.startswith("vllm.") if m}


def _register(caplog):
    from lowbit.vllm_plugin import register

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="lowbit.vllm_plugin"):
        assert register() is None
    return [r for r in caplog.records if r.name == "lowbit.vllm_plugin"]


def test_cuda_platform_register_returns_and_changes_nothing(monkeypatch, caplog):
    calls = fake_vllm(monkeypatch, device="cuda", cpu=False)
    monkeypatch.delitem(sys.modules, "lowbit.vllm_plugin.backend", raising=False)
    before = _snapshot()
    recs = _register(caplog)
    assert calls == []  # no backend registered
    assert _snapshot() == before  # no vllm module gained, lost or changed an attribute
    assert "lowbit.vllm_plugin.backend" not in sys.modules  # the backend (which imports vLLM) never loaded
    assert len(recs) == 1 and recs[0].levelno == logging.WARNING
    msg = recs[0].getMessage()
    assert "\n" not in msg and "cuda platform is not supported" in msg and "lowbit serve" in msg
    assert _register(caplog) and calls == []  # a second call (another vLLM process) likewise


@pytest.mark.parametrize("version", ["0.33.0", "0.31.2", "1.32.0", "unknown"])
def test_unsupported_vllm_version_register_changes_nothing(monkeypatch, caplog, version):
    calls = fake_vllm(monkeypatch, version=version)
    before = _snapshot()
    recs = _register(caplog)
    assert calls == [] and _snapshot() == before
    assert len(recs) == 1 and f"vLLM {version} is not the 0.32.x series" in recs[0].getMessage()


def test_vllm_without_the_registry_or_a_platform_is_left_alone(monkeypatch, caplog):
    calls = fake_vllm(monkeypatch, registry=False)
    recs = _register(caplog)
    assert calls == [] and len(recs) == 1 and "left unchanged" in recs[0].getMessage()

    class Broken(_Platform):
        def is_cpu(self):
            raise RuntimeError("no platform detected")

    fake_vllm(monkeypatch)
    sys.modules["vllm.platforms"].current_platform = Broken("?", True)
    recs = _register(caplog)
    assert len(recs) == 1 and "RuntimeError: no platform detected" in recs[0].getMessage()


def test_supported_cpu_vllm_gets_the_backend(monkeypatch, caplog):
    from lowbit.vllm_plugin import BACKEND

    calls = fake_vllm(monkeypatch, version="0.32.1+cpu")
    recs = _register(caplog)
    assert calls == [("CPU_ATTN", BACKEND)] and len(recs) == 1 and recs[0].levelno == logging.INFO
    _register(caplog)
    assert calls == [("CPU_ATTN", BACKEND)] * 2  # idempotent: the same path again
    assert BACKEND == "lowbit.vllm_plugin.backend.LowbitCPUAttentionBackend"


def test_decide_names_every_case():
    from lowbit.vllm_plugin import decide

    assert decide("0.32.0", "cpu", True).install
    assert not decide("0.32.0", "cuda", False).install
    assert not decide("0.4.0", "cpu", True).install


# ------------------------------------------------------------------ backend, against fake vLLM classes
T = TypeVar("T")


class _Generic(Generic[T]):
    pass


class _Builder(Generic[T]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        self.kv_cache_spec, self.layer_names, self.vllm_config, self.device = (kv_cache_spec, layer_names,
                                                                              vllm_config, device)


class _CPUBackend:
    @classmethod
    def customize_spec(cls, spec):
        return spec

    @classmethod
    def supports_head_size(cls, head_size):
        return head_size in (64, 128)


@pytest.fixture
def backend(monkeypatch):
    """lowbit.vllm_plugin.backend imported against fake vLLM classes; `config` sets the config in force."""
    fake_vllm(monkeypatch)
    state = {"cfg": None}

    def get_current_vllm_config():
        if state["cfg"] is None:
            raise AssertionError("no vLLM config in force")
        return state["cfg"]

    _module(monkeypatch, "vllm.config", get_current_vllm_config=get_current_vllm_config)
    _module(monkeypatch, "vllm.v1.attention.backend", AttentionImpl=_Generic, AttentionMetadata=object,
            AttentionMetadataBuilder=_Builder, AttentionType=types.SimpleNamespace(DECODER="decoder"),
            CommonAttentionMetadata=object)
    _module(monkeypatch, "vllm.v1.attention.backends.cpu_attn", CPUAttentionBackend=_CPUBackend,
            CPUAttentionBackendImpl=type("CPUImpl", (), {}), CPUAttentionMetadataBuilder=type("CPUBuilder", (), {}))
    _module(monkeypatch, "vllm.v1.kv_cache_interface", AttentionSpec=object,
            KVCacheLayout=types.SimpleNamespace(LBHNC="LBHNC"))
    monkeypatch.delitem(sys.modules, "lowbit.vllm_plugin.backend", raising=False)
    mod = importlib.import_module("lowbit.vllm_plugin.backend")
    mod._load.cache_clear()
    yield mod, state
    mod._load.cache_clear()
    sys.modules.pop("lowbit.vllm_plugin.backend", None)


def _cfg(path, dtype=torch.float32):
    return types.SimpleNamespace(model_config=types.SimpleNamespace(model=str(path), dtype=dtype))


def test_current_model_never_falls_back_to_the_last_model(backend, tmp_path):
    mod, state = backend
    a, b = tmp_path / "a", tmp_path / "b"  # plain model directories: no lowbit sidecar
    a.mkdir()
    b.mkdir()
    resolved = mod.ResolvedModels()
    with pytest.raises(LowbitError, match="before any model was loaded"):
        mod.current_model(resolved)  # outside a config, nothing resolved: an error, not a guess
    state["cfg"] = _cfg(a)
    assert mod.current_model(resolved) is None  # no sidecar: stock vLLM
    state["cfg"] = None
    assert mod.current_model(resolved) is None  # outside a config: the one model of this process
    state["cfg"] = _cfg(b)
    assert mod.current_model(resolved) is None
    state["cfg"] = None
    with pytest.raises(LowbitError, match=r"several models .*a .*b .*one model per vLLM process"):
        mod.current_model(resolved)  # two models: which one is not guessed (the old code took the last)
    assert str(a) in str(resolved.models) and str(b) in str(resolved.models)


def test_no_sidecar_backend_is_vllms_own(backend, tmp_path):
    mod, state = backend
    state["cfg"] = _cfg(tmp_path)
    monkey_resolved = mod.ResolvedModels()
    mod.RESOLVED.models.clear()
    assert mod.current_model(monkey_resolved) is None
    B = mod.LowbitCPUAttentionBackend
    assert B.get_impl_cls().__name__ == "CPUImpl" and B.get_builder_cls().__name__ == "CPUBuilder"
    assert B.supports_head_size(64) and not B.supports_head_size(80)
    spec = object()
    assert B.customize_spec(spec) is spec
    for name in ("_ARENAS", "_active", "_WINDOWS_LOGGED", "_REUSE_SEEN"):
        assert not hasattr(mod, name), name


def test_builder_reads_the_arenas_its_layers_own(backend):
    """The builder finds each layer's arena through vLLM's layer table and drops the blocks no running
    request needs; two layer groups keep separate arenas (no process-wide arena table)."""
    from lowbit.vllm_plugin.paged import TierArena

    mod, _state = backend
    bs, H, D = 4, 1, 8

    def arena_with(blocks):
        a = TierArena(sink=2, recent=3, block_size=bs, dtype=torch.float32)
        for b in blocks:
            a.k[b], a.v[b] = torch.zeros(H, bs, D), torch.zeros(H, bs, D)
        return a

    a0, a1, other = arena_with([5, 6, 7, 9]), arena_with([5, 6, 7, 9]), arena_with([5, 6, 7, 9])
    ctx = {"model.layers.0.attn": types.SimpleNamespace(impl=types.SimpleNamespace(arena=a0)),
           "model.layers.1.attn": types.SimpleNamespace(impl=types.SimpleNamespace(arena=a1)),
           "model.layers.2.attn": types.SimpleNamespace(impl=types.SimpleNamespace(arena=other)),
           "model.layers.3.attn": types.SimpleNamespace(impl=types.SimpleNamespace(arena=None))}  # not written yet
    cfg = types.SimpleNamespace(compilation_config=types.SimpleNamespace(static_forward_context=ctx))
    builder = mod.LowbitMetadataBuilder(None, ["model.layers.0.attn", "model.layers.1.attn", "model.layers.3.attn"],
                                        cfg, "cpu")
    assert builder.arenas() == [a0, a1]
    # one running request of 11 tokens (1 new) in blocks 5, 6, 7: sink rows 0-1 (block 5) and recent
    # rows 8-10 (block 7) are dense; block 6 and block 9 (a finished request's) are not needed
    md = types.SimpleNamespace(block_table_tensor=torch.tensor([[5, 6, 7]]), seq_lens=torch.tensor([11]),
                               query_start_loc_cpu=torch.tensor([0, 1]), num_actual_tokens=1,
                               slot_mapping=torch.tensor([7 * bs + 2]))
    out = builder.build(0, md)
    assert sorted(a0.k) == sorted(a1.k) == [5, 7]
    assert sorted(other.k) == [5, 6, 7, 9]  # another group's arena is not this builder's
    assert out.num_actual_tokens == 1 and out.seq_lens.tolist() == [11]
