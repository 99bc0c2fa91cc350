"""Where a kernel's warps stall, from Nsight Compute's PC sampling: the share
of every stall reason over all samples, and the instructions holding the most
samples (`bash bench/h200_run.sh pcsamp` writes the source page as CSV; the
reduced copies in bench/results/pcsamp-*.csv keep the sampled rows).

    python3 bench/pcsamp_summary.py bench/results/pcsamp-greedy-rev15-h200.csv --top 10
"""

from __future__ import annotations

import argparse
import csv
import re
from pathlib import Path

SAMPLES = "Warp Stall Sampling (All Samples)"


def number(text: str) -> float:
    text = text.replace(",", "")
    return float(text) if re.fullmatch(r"[0-9.]+", text) else 0.0


def rows_of(path: Path) -> tuple[list[str], list[list[str]]]:
    """The header and the instruction rows (ncu's export has the kernel's
    name on a line before the header; the reduced copies do not)."""
    rows = list(csv.reader(path.open()))
    at = next(i for i, row in enumerate(rows) if SAMPLES in row)
    return rows[at], [row for row in rows[at + 1 :] if len(row) >= len(rows[at]) - 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("csv", type=Path)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    header, rows = rows_of(args.csv)
    at = {name: i for i, name in enumerate(header)}
    reasons = [n for n in header if n.startswith("stall_") and "Not Issued" not in n]
    total = sum(number(row[at[SAMPLES]]) for row in rows) or 1.0
    shares = {r: sum(number(row[at[r]]) for row in rows) / total for r in reasons}
    print(f"{len(rows)} instructions, {total:.0f} samples")
    print(
        "  ".join(
            f"{r[6:]} {100 * s:.1f}%"
            for r, s in sorted(shares.items(), key=lambda x: -x[1])
            if s >= 0.005
        )
    )
    for row in sorted(rows, key=lambda row: -number(row[at[SAMPLES]]))[: args.top]:
        worst = max(reasons, key=lambda r: number(row[at[r]]))
        print(
            f"{row[at['Address']]:>16s} {100 * number(row[at[SAMPLES]]) / total:5.2f}%  {worst[6:]:<10s} {row[at['Source']].strip()}"
        )


if __name__ == "__main__":
    main()
