"""Markdown tables from the benchmark JSON files (for bench/RESULTS.md).

python bench/report.py bench/results/plain-cpu-*.json bench/results/speculative-cpu.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import field_column, runs_table, table


def machine_line(m: dict[str, Any]) -> str:
    where = m.get("gpu") or f"{m['cpu']}, {m['cores']} cores"
    return (
        f"{m['date']}; {m['device']} ({where}); mlx {m['mlx']}, mlx-lm {m['mlx-lm']}"
        + (f", mlx-cuda {m['mlx-cuda']}" if m.get("mlx-cuda") else "")
        + (f"; library sha256 {m['library_sha256']}" if m.get("library_sha256") else "")
        + f"\n`{m['command']}`"
    )


def plain(d: dict[str, Any]) -> str:
    rows = [
        [
            Path(r["model"]).name,
            r["dtype"],
            r["prompt_tokens"],
            r["generated"],
            r["repeats"],
            r["specpipe_decode_tps"],
            r["mlx_lm_decode_tps"],
            r["ratio_decode"],
            r.get("ratio_best", 0.0),
            r.get("ratio_cpu", 0.0),
            r["ratio_wall_speed"],
            r["specpipe_ms_per_token"],
            r["mlx_lm_ms_per_token"],
            r["load_avg"],
            "yes" if r["identical"] else f"NO @{r['difference']['first_difference']}",
        ]
        for r in d["results"]
    ]
    return table(
        [
            "model",
            "dtype",
            "prompt tok",
            "tokens",
            "repeats",
            "specpipe tok/s",
            "mlx-lm tok/s",
            "ratio sp/lm (median)",
            "ratio (best)",
            "ratio (CPU time)",
            "ratio (wall)",
            "specpipe ms/tok",
            "mlx-lm ms/tok",
            "load avg",
            "identical",
        ],
        rows,
    )


SPECULATIVE_COLUMNS = [
    # (files from before the CPU-time speedup was recorded: 0)
    ("speedup (CPU time)", lambda r: r.get("cpu_speedup", 0.0)),
    field_column("tokens/round", "acceptance_length"),
    field_column("ms/round", "ms_per_round"),
    field_column("rounds", "rounds"),
    field_column("cpu/wall", "cpu_per_wall"),
]


def speculative(d: dict[str, Any]) -> str:
    return "\n".join(
        f"\nprompt `{prompt}` ({block['prompt_tokens']} prompt tokens)\n\n"
        + runs_table(block["runs"], SPECULATIVE_COLUMNS)
        for prompt, block in d["prompts"].items()
    )


def window(d: dict[str, Any]) -> str:
    out = []
    for r in d["results"]:
        sp, lm = r["specpipe_ms"], r["mlx_lm_ms"]
        spb, lmb = r.get("specpipe_build_ms", {}), r.get("mlx_lm_build_ms", {})
        widths = list(sp)
        first = widths[0]
        out.append(
            f"\n{Path(r['model']).name} [{r['dtype']}], context {r['context']}\n"
        )
        out.append(
            table(
                [
                    "width",
                    "specpipe ms",
                    "x width 1",
                    "mlx-lm ms",
                    "x width 1",
                    "specpipe build ms",
                    "mlx-lm build ms",
                ],
                [
                    [
                        w,
                        sp[w],
                        sp[w] / sp[first],
                        lm[w],
                        lm[w] / lm[first],
                        spb.get(w, 0.0),
                        lmb.get(w, 0.0),
                    ]
                    for w in widths
                ],
            )
        )
    return "\n".join(out)


def main() -> None:
    for name in sys.argv[1:]:
        d = json.loads(Path(name).read_text())
        print(f"\n### {Path(name).name}\n\n{machine_line(d['machine'])}\n")
        if "prompts" in d:
            print(speculative(d))
        elif d["results"] and "specpipe_ms" in d["results"][0]:
            print(window(d))
        else:
            print(plain(d))


if __name__ == "__main__":
    main()
