"""Where an MTP round's draft time goes beyond its kernel: `propose` against
the same launch on inputs already on the device.

On the H200 a one-launch round of the fused MTP step costs ~0.38 ms more
than its chained steps (bench/RESULTS.md, tenth session), while one probe
launch evaluated alone costs ~0.08 ms more. This times, per head (full and
an FR-Spec list) and depth, in alternation, the median ms and the build /
encode / wait split of:

- `floor`: `x + 1` of a one-element array made from a host list, evaluated
  (the backend's own round trip);
- `resident`: `HeadStep.round` on the round's inputs made once and kept;
- `fresh`: the same on inputs made from host lists each call, as `propose`
  makes them (`MtpRows.round_arrays`);
- `propose`: `MtpRows.propose`.

Run it twice to compare the backend's CUDA graphs with direct launches:

    python bench/round_parts.py --out bench/results/round-parts-h200.json
    MLX_USE_CUDA_GRAPHS=0 python bench/round_parts.py --out bench/results/round-parts-nographs-h200.json
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import models  # noqa: F401  before mlx: routes its BLAS (models/blas.py)

# isort: split
import mlx.core as mx

from bench.common import machine_info, split_ms, write_json
from bench.mtp import (
    SAMPLINGS,
    SHAPES,
    bench_prompt,
    fr_list,
    opened_rows,
    random_target_and_head,
)
from schemas.request import DraftPolicy
from specpipe.drafts.mtp import MtpDrafter
from specpipe.sampling import draw_filters


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    mx.eval(fn())
    return (time.perf_counter() - start) * 1000.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-next")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--fr-size", type=int, default=32768)
    parser.add_argument("--depths", default="1,3")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument(
        "--rows",
        type=int,
        default=1,
        help="rows drafted at once (host-made inputs of more "
        "than 8 bytes, 3 rows on, are not in MLX's pool of host-mapped scalars)",
    )
    parser.add_argument("--sampling", choices=sorted(SAMPLINGS), default="greedy")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    _, model, head = random_target_and_head(
        args.shape, args.layers, args.experts, 2048, args.vocab, mx.bfloat16
    )
    prompt = bench_prompt(args.vocab)
    vocab = fr_list(args.vocab, args.fr_size)
    sampling = SAMPLINGS[args.sampling]
    depths = [int(d) for d in args.depths.split(",")]
    heads = {"full": None, f"fr{args.fr_size}": vocab}

    cases: dict[tuple[str, str, int], Callable[[], Any]] = {}
    for name, listed in heads.items():
        drafter = MtpDrafter(model, head, DraftPolicy(compiled=True), vocab=listed)
        opened, rows = opened_rows(
            drafter, model, prompt, max(depths), sampling, args.rows
        )
        params = [opened.policy.draft_params(row.sampling) for row in rows]
        filters = draw_filters(params[0])
        for depth in depths:
            whole = opened.step.round(filters, depth)
            assert whole is not None, "a one-layer head drafts whole rounds"
            kept = opened.round_arrays(rows, depth, params)
            mx.eval(kept)

            def fresh(
                o: Any = opened,
                r: Any = rows,
                d: int = depth,
                w: Any = whole,
                p: Any = params,
            ) -> Any:
                return w(*o.round_arrays(r, d, p))[0]

            def propose(o: Any = opened, r: Any = rows, d: int = depth) -> Any:
                return o.propose(r, d).device

            cases[("resident", name, depth)] = lambda w=whole, k=kept: w(*k)[0]
            cases[("fresh", name, depth)] = fresh
            cases[("propose", name, depth)] = propose
    counter = iter(range(1 << 30))
    cases[("floor", "-", 0)] = lambda: mx.array([next(counter)], dtype=mx.int32) + 1

    for fn in cases.values():  # traces, compiles, first launches
        for _ in range(3):
            mx.eval(fn())
    order = random.Random(0)
    times: dict[tuple[str, str, int], list[float]] = {key: [] for key in cases}
    keys = list(cases)
    for _ in range(args.repeats):
        order.shuffle(keys)
        for key in keys:
            times[key].append(timed(cases[key]))
    report: dict[str, Any] = {
        "machine": machine_info(),
        "cuda_graphs": os.environ.get("MLX_USE_CUDA_GRAPHS", "1"),
        "shape": args.shape,
        "vocab": args.vocab,
        "fr_size": args.fr_size,
        "sampling": args.sampling,
        "repeats": args.repeats,
        "rows": args.rows,
        "cases": [
            {
                "case": case,
                "head": name,
                "depth": depth,
                "ms": statistics.median(times[(case, name, depth)]),
                "quartiles": statistics.quantiles(times[(case, name, depth)], n=4),
                "split_ms": split_ms(cases[(case, name, depth)], args.repeats),
            }
            for case, name, depth in cases
        ],
    }
    for entry in report["cases"]:
        print(
            "PARTS",
            entry["case"],
            entry["head"],
            entry["depth"],
            round(entry["ms"], 4),
            {k: round(v, 4) for k, v in entry["split_ms"].items()},
            flush=True,
        )
    write_json(args.out, report)


if __name__ == "__main__":
    main()
