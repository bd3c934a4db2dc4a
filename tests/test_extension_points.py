"""Each extension axis is one folder that a registry scans: a toy of each kind is found with no other edit.

    decode backend   a module in lowbit/backends/              -> lowbit.backends.all_backends()
    weight method    a module in lowbit/weights/methods/       -> lowbit.weights.methods, quantize_model(method=...)
    model family     a module in lowbit/models/families/       -> lowbit.models.families (step kind, ArchSpec, configs)
    subcommand       a module in lowbit/commands/              -> lowbit.commands.discover()

Each test drops a toy module into a temporary directory appended to the package's search path (what a
new file in that folder is), asks the registry, and removes both again.
"""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

from lowbit import backends
from lowbit.weights import methods
from tests.weights.helpers import small_model


@pytest.fixture
def package_dir(tmp_path):
    """Append tmp_path to a package's __path__ (a new file in its folder) and undo it afterwards."""
    added = []

    def add(pkg, name: str, source: str):
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        pkg.__path__.append(str(tmp_path))
        added.append((pkg, f"{pkg.__name__}.{name}"))

    yield add
    for pkg, mod in added:
        pkg.__path__.remove(str(tmp_path))
        sys.modules.pop(mod, None)


def test_a_new_file_in_backends_is_a_new_decode_backend(package_dir):
    package_dir(backends, "toy_decode", '''
        from lowbit.backends import Backend, register

        def supports(layer, step, device):
            return None if device == "cpu" else "the toy runs on CPU only"

        def run(layer, qg, scaling):
            return qg * 0

        BACKEND = register(Backend("toy-decode", ("decode",), supports, run, module=__name__))
    ''')
    try:
        found = backends.all_backends()
        assert "toy-decode" in found and "torch-stream" in found and "triton-decode" in found
        toy = backends.get("toy-decode")
        assert toy.why_not(None, "decode", "cpu") is None
        assert toy.why_not(None, "decode", "cuda") == "the toy runs on CPU only"
        assert toy.why_not(None, "prefill", "cpu").startswith("toy-decode does not run prefill steps")
    finally:
        backends._REGISTRY.pop("toy-decode", None)


def test_a_new_file_in_weights_methods_is_a_new_quantize_method(package_dir):
    package_dir(methods, "toy_sign", '''
        """Toy method: round to nearest without the clip search."""
        from lowbit.weights.gptq import rtn_quantize
        from lowbit.weights.methods import Method, register

        def run(job):
            for name, lin in job.targets.items():
                g = job.scheme.group_for(lin.in_features)
                job.done(name, lin, rtn_quantize(lin.weight, job.scheme.w_bits, g, job.scheme.symmetric,
                                                 clip_search=False, scale_dtype=job.scale_dtype))

        METHOD = register(Method("toy-rtn", run, needs_calib=False, layerwise=False, module=__name__))
    ''')
    from lowbit.weights.apply import quantize_model
    from lowbit.weights.qlinear import QuantLinear
    from lowbit.weights.scheme import parse_weight_scheme

    try:
        assert "toy-rtn" in methods.names() and {"rtn", "gptq", "signround"} <= set(methods.names())
        model = small_model(layers=1)
        rep = quantize_model(model, parse_weight_scheme("w8a16"), method="toy-rtn")
        assert rep.method == "toy-rtn" and len(rep.quantized) == 7  # q k v o gate up down
        assert sum(isinstance(m, QuantLinear) for m in model.modules()) == 7
        ids = torch.tensor([[3, 5, 7, 11]])
        assert torch.isfinite(model(ids).logits).all()
    finally:
        methods._REGISTRY.pop("toy-rtn", None)


def test_a_new_file_in_models_families_is_a_new_model_family(package_dir):
    from lowbit.models import families

    package_dir(families, "toy_family", '''
        from lowbit.models.families import ArchSpec, Family, register

        FAMILY = register(Family("toy", ("toy_lm",), step="shared", arch=ArchSpec(layers="backbone.blocks"),
                                 module=__name__))
    ''')
    try:
        fam = families.for_model_type("toy_lm")
        assert fam is not None and fam.name == "toy" and fam.step == "shared"
        assert families.by_model_type("step")["toy_lm"] == "shared"
        assert families.by_model_type("arch")["toy_lm"].layers == "backbone.blocks"
        assert families.for_model_type("qwen2").name == "llama"  # the shipped ones are still there
        with pytest.raises(Exception, match="both claim"):
            families.register(families.Family("toy2", ("toy_lm",)))
    finally:
        families._REGISTRY.pop("toy", None)


def test_unknown_methods_and_backends_are_refused_naming_the_known_ones():
    from lowbit.core.errors import LowbitError

    with pytest.raises(LowbitError, match="unknown method 'nope'; use one of gptq, rtn, signround"):
        methods.get("nope")
    with pytest.raises(LowbitError, match="KV backend 'nope' unknown; known: "):
        backends.get("nope")


def test_a_new_file_in_commands_is_a_new_subcommand(tmp_path, monkeypatch):
    from lowbit import commands

    (tmp_path / "toy.py").write_text('NAME = "toy"\nHELP = "a toy command"\n\n\ndef add_arguments(p):\n    pass\n\n\n'
                                     'def run(args):\n    return 0\n')
    monkeypatch.setattr(commands, "__path__", [*commands.__path__, str(tmp_path)])
    # discover() reads NAME and HELP from each module's source; it looks in the package's first folder for
    # the file, so a second folder is read through the import fallback
    found = commands.discover()
    assert found["toy"] == ("toy", "a toy command")
    sys.modules.pop("lowbit.commands.toy", None)
