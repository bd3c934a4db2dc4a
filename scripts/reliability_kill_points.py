"""Write results/reliability/kill_points.json: a real ArtifactWriter SIGKILLed at each point
of its write, what it left (before) and what the next write into the same parent left (after); and
file_kill_points.json: the same for the single-file writes (`lowbit pin`, `lowbit validate --json`),
the next run being the same command again.

    .venv/bin/python scripts/reliability_kill_points.py [OUT_DIR]
"""

import json
import sys
import tempfile
from pathlib import Path

from lowbit.tools.killpoints import file_kill_points, kill_points, write_results

out = Path(sys.argv[1] if len(sys.argv) > 1 else "results/reliability")
with tempfile.TemporaryDirectory() as d:
    rows = kill_points(Path(d) / "dirs")
    files = file_kill_points(Path(d) / "files")
for r in rows:
    print(f"{r['point']:<17} output {r['output']:<8} before {r['before']} after {r['after']}")
for r in files:
    print(f"{r['command']:<14} {r['point']:<16} output {r['output']:<8} left {len(r['before'])} -> staging after "
          f"{r['staging_left_after']} next run rc {r['next_run_rc']}")
print(f"wrote {write_results(rows, out / 'kill_points.json')}")
p = out / "file_kill_points.json"
p.write_text(json.dumps({"file_kill_points": files}, indent=1) + "\n")
print(f"wrote {p}")
