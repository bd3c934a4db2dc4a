"""Write benchmarks/results/reliability/kill_points.json: a real ArtifactWriter SIGKILLed at each point
of its write, what it left (before) and what the next write into the same parent left (after).

    .venv/bin/python scripts/reliability_kill_points.py [OUT]
"""

import sys
import tempfile
from pathlib import Path

from lowbit.artifacts.killpoints import kill_points, write_results

out = sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/reliability/kill_points.json"
with tempfile.TemporaryDirectory() as d:
    rows = kill_points(Path(d))
for r in rows:
    print(f"{r['point']:<17} output {r['output']:<8} before {r['before']} after {r['after']}")
print(f"wrote {write_results(rows, out)}")
