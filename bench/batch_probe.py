"""Which decoding of a batch of rows departs from each row decoded alone.

bench/mtp.py found, on the H200 in float32, three MTP rows decoded as one
batch differing from the same three rows decoded plainly as one batch (two
rows: equal). This decodes each row of a random hybrid target (the MTP
benchmark's shape) four ways: plainly alone (the reference), plainly as one
batch, by MTP rounds alone and by MTP rounds as one batch; prints each way's
first differing position per row, then the first token's logits as a one-row
step, a batched step and a batched verify window compute them (largest
difference to the one-row step's, each row's best two logits' gap).

    MLX_ENABLE_TF32=0 python bench/batch_probe.py --rows 3 --out bench/results/batch-probe.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import models  # noqa: F401  before mlx: routes its BLAS (models/blas.py)

# isort: split
import mlx.core as mx

from bench.common import machine_info
from bench.mtp import (
    SAMPLINGS,
    _first_difference,
    bench_prompt,
    generate_rows_of,
    random_target_and_head,
)
from schemas.request import DraftPolicy
from specpipe.drafts.mtp import MtpDrafter
from specpipe.prefill import prefill_rows
from specpipe.state import RowState


def first_logits(model: Any, prompts: list[tuple[int, ...]], width: int) -> mx.array:
    """Each row's first generated token's logits [B, V]: the rows prefilled
    together, then a window of `width` positions (the pending token, then
    `width - 1` arbitrary ids) through the target."""
    rows = [RowState.start(p, 8, SAMPLINGS["greedy"]) for p in prompts]
    cache, _ = prefill_rows(model, rows)
    pending = [[row.pending] + [7 * (i + 1) for i in range(width - 1)] for row in rows]
    out = model(mx.array(pending, dtype=mx.int32), cache, [row.length for row in rows])
    logits = out.logits[:, 0, :].astype(mx.float32)
    mx.eval(logits)
    return logits


def gaps(logits: mx.array) -> list[float]:
    """Each row's best logit minus its second best."""
    top = mx.sort(logits, axis=-1)[:, -2:]
    return [float(x) for x in (top[:, 1] - top[:, 0]).tolist()]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument(
        "--no-group",
        action="store_true",
        help="the routed experts' pairs never grouped by expert (SwitchGLU.SORT_MIN)",
    )
    parser.add_argument(
        "--no-window-kernel",
        action="store_true",
        help="the recurrent layers' windows as MLX operations",
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.no_group:
        from models.qwen3_next import SwitchGLU

        SwitchGLU.SORT_MIN = 1 << 30
    if args.no_window_kernel:
        import models.gated_delta

        models.gated_delta.WINDOW_KERNEL_ON_GPU = False
    _, model, head = random_target_and_head(
        "qwen3-next",
        args.layers,
        args.experts,
        2048,
        args.vocab,
        getattr(mx, args.dtype),
    )
    prompt = bench_prompt(args.vocab)
    prompts = [prompt[b:] + prompt[:b] for b in range(args.rows)]
    greedy = SAMPLINGS["greedy"]
    drafter = MtpDrafter(model, head, DraftPolicy(compiled=True))
    n, depth = args.tokens, args.depth
    alone = [generate_rows_of(model, [p], n, None, 0, greedy)[0][0] for p in prompts]
    ways = {
        "plain_batch": generate_rows_of(model, prompts, n, None, 0, greedy)[0],
        "mtp_alone": [
            generate_rows_of(model, [p], n, drafter, depth, greedy)[0][0]
            for p in prompts
        ],
        "mtp_batch": generate_rows_of(model, prompts, n, drafter, depth, greedy)[0],
    }
    report: dict[str, Any] = {
        "machine": machine_info(),
        "MLX_ENABLE_TF32": os.environ.get("MLX_ENABLE_TF32"),
        "args": {k: str(v) for k, v in vars(args).items()},
        "alone": alone,
        "first_difference": {},
    }
    for name, got in ways.items():
        report["first_difference"][name] = [
            _first_difference(a, b) for a, b in zip(got, alone, strict=True)
        ]
        report[name] = got
        print("BATCH", name, report["first_difference"][name], flush=True)
    single = mx.concatenate([first_logits(model, [p], 1) for p in prompts], axis=0)
    report["logits"] = {
        "alone_step_gap": gaps(single),
        "alone_step_argmax": mx.argmax(single, -1).tolist(),
    }
    for name, width in (
        ("batch_step", 1),
        ("batch_window", depth + 1),
        ("alone_window", 0),
    ):
        if width == 0:
            got = mx.concatenate(
                [first_logits(model, [p], depth + 1) for p in prompts], axis=0
            )
        else:
            got = first_logits(model, prompts, width)
        diff = mx.abs(got - single).max(axis=-1).tolist()
        report["logits"][name] = {
            "max_abs_diff": diff,
            "argmax": mx.argmax(got, -1).tolist(),
        }
        print("LOGITS", name, "max|diff|", [f"{d:.3g}" for d in diff], "argmax", report["logits"][name]["argmax"],
              "alone", report["logits"]["alone_step_argmax"], "gap", [f"{g:.3g}" for g in report["logits"]["alone_step_gap"]],
              flush=True)  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
