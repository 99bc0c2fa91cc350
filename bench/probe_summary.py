"""One line per figure of a probe's JSON, short enough for a device call's
output: bench/fused_probe.py --agree-only's drafts (each launch form's
tokens equal, and the largest normed gap) and bench/phase_probe.py's step
and stretches (median over the blocks, us).

    python bench/probe_summary.py fused-probe.json phase-probe.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def agree_lines(report: dict[str, Any]) -> list[str]:
    lines = []
    for entry in report["rows"]:
        for key, forms in entry.items():
            if not key.startswith("agree"):
                continue
            cells = [
                f"{form} {f['tokens_equal']} (normed {f.get('normed_max_diff')})"
                for form, f in forms.items()
                if isinstance(f, dict) and "tokens_equal" in f
            ]
            lines.append(f"rows {entry['rows']} {key}: " + "; ".join(cells))
    return lines


def phase_lines(report: dict[str, Any]) -> list[str]:
    lines = []
    for run in report["runs"]:
        parts = " ".join(f"{k}={v[1]}" for k, v in run["segments"].items())
        lines.append(
            f"{run.get('set')} ctx {run.get('context')} {run.get('head')} "
            f"{run.get('sampling')}: step {run.get('step')} | {parts}"
        )
    return lines


def main() -> None:
    for name in sys.argv[1:]:
        path = Path(name)
        if not path.exists():
            print(f"{name}: missing")
            continue
        report = json.loads(path.read_text())
        lines = agree_lines(report) if "rows" in report else phase_lines(report)
        print(f"== {name}")
        print("\n".join(lines))


if __name__ == "__main__":
    main()
