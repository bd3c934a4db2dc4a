"""The repository's results policy (docs/RESULTS_POLICY.md), checked on the tracked tree.

A result file's name says what was measured, never when: no run tags in tracked file names under results/
and scripts/; scripts/ stays a handful of tools; the README is the manual (<= 350 lines, no run, issue or
round references); every results/ path cited in README.md and RESULTS.md exists; the tracked tree stays
small enough for a device call to carry. Skipped outside a git checkout.
"""

from __future__ import annotations

import glob
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Run tags: session numbers (_s19, _s27c), device calls (call2), rounds, the quality series (q18, q18c).
RUN_TAG = re.compile(r"_s\d+|call\d|(?<![a-z])round|q18", re.IGNORECASE)
# The same in prose: "s19", "s27c", "issue 18", "issue #22", "round 16", "call 2", "q18d".
README_REF = re.compile(
    r"\bs\d{1,3}[a-z]?\b|\bissues?\s*#?\d+|#\d+\b|\bround\s*\d+|\bcall\s*\d+|\bq18[a-z]?\b",
    re.IGNORECASE,
)
# A results/ path as text cites it: not a suffix of another path (benchmarks/results/, lowbit-results/).
CITED = re.compile(r"(?<![\w/.-])results/[\w.@{},*/-]+")

MAX_SCRIPTS = 15
MAX_README_LINES = 350
MAX_TREE_BYTES = 15 * 1024 * 1024


def _tracked() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    files = [f for f in out.stdout.decode().split("\0") if f]
    if not files:
        pytest.skip("not a git checkout (nothing tracked)")
    return files


def _expand(path: str) -> list[str]:
    """One cited path -> the paths it names: {a,b} alternatives expanded, trailing punctuation dropped."""
    path = path.rstrip(".,;:)")
    m = re.search(r"\{([^{}]*)\}", path)
    if m:
        return [q for alt in m.group(1).split(",") for q in _expand(path[: m.start()] + alt + path[m.end():])]
    return [path]


def test_no_run_tags_in_result_and_script_names():
    bad = [f for f in _tracked() if f.startswith(("results/", "scripts/")) and RUN_TAG.search(f)]
    assert not bad, f"file names under results/ or scripts/ carry run tags (name what was measured): {bad}"


def test_scripts_is_a_handful():
    scripts = [f for f in _tracked() if f.startswith("scripts/")]
    assert len(scripts) <= MAX_SCRIPTS, f"scripts/ holds {len(scripts)} files (at most {MAX_SCRIPTS}): {scripts}"


def test_readme_is_the_manual():
    _tracked()
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md is {len(lines)} lines (at most {MAX_README_LINES})"
    refs = [(n, m.group(0)) for n, line in enumerate(lines, 1) for m in README_REF.finditer(line)]
    assert not refs, f"README.md cites runs, issues or rounds (line, text): {refs}"


@pytest.mark.parametrize("doc", ["README.md", "RESULTS.md"])
def test_cited_result_paths_exist(doc):
    _tracked()
    text = (ROOT / doc).read_text(encoding="utf-8")
    cited = {p for m in CITED.finditer(text) for p in _expand(m.group(0))}
    missing = sorted(p for p in cited if not (glob.glob(str(ROOT / p)) if "*" in p else (ROOT / p).exists()))
    assert not missing, f"{doc} cites result paths that do not exist: {missing}"


def test_tracked_tree_is_small():
    files = _tracked()
    total = sum((ROOT / f).stat().st_size for f in files if (ROOT / f).is_file())
    assert total <= MAX_TREE_BYTES, f"tracked tree is {total / 2**20:.1f} MiB (at most {MAX_TREE_BYTES / 2**20:.0f} MiB)"


def test_policy_patterns():
    """The patterns refuse what they are for and pass the names they must not catch."""
    for tagged in ("results/runtime/decode_e2e_B1_whole_s19_NVIDIA_H200.json", "scripts/gpu_s22_call3.sh",
                   "results/quality/q18d/x.json", "results/kernels/round5.json"):
        assert RUN_TAG.search(tagged), tagged
    for clean in ("results/serve/vllm_cpu_throughput_smollm2-135m.json", "scripts/serve_soak_gpu.py",
                  "results/runtime/decode_e2e_B16_one_graph_NVIDIA_H200.json", "results/images/grid.png"):
        assert not RUN_TAG.search(clean), clean
    for ref in ("the s19 run", "s27c", "issue 18", "issue #22", "round 16", "call 2", "q18d"):
        assert README_REF.search(ref), ref
    for prose in ("around the loop", "sm_90", "lowbit serve", "int2 at 2.25 b/elt", "H200", "w4a16-g64"):
        assert not README_REF.search(prose), prose
    assert _expand("results/eval/x.{json,md},") == ["results/eval/x.json", "results/eval/x.md"]
    assert [m.group(0) for m in CITED.finditer("`./lowbit-results/` and benchmarks/results/a and results/b.json")] \
        == ["results/b.json"]
