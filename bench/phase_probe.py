"""Where a chained MTP draft step's time goes, by context and kernel switches
(CUDA GPU): the fused kernel's phase stamps (`FusedStep.stamp_table`) of the
second step of a two-step launch, as a round's chained steps run, for each
set of switches and each context, without the MLX reference steps that
bench/fused_probe.py runs (which take minutes at long contexts).

Per (set, context, head, sampling): the step's stretches per block as
`bench/fused_probe.py`'s `segments` ([min, median, max] us over the blocks,
median over the launches, then the block most often slowest), and `step`:
the median over launches of the draw's end (the last of `phases`), us
from the first block's start, and `phases`: bench/fused_probe.py's (per grid barrier,
then the draw's end). Switch sets are separated by semicolons, each as
bench/mtp.py's `--kernel-switches` (NAME on, -NAME off, NAME=VALUE), each
applied to the module's defaults.

    python bench/phase_probe.py --contexts 48,4096,32768 \
        --sets "none;ATT_UNROLL=8;ATT_GROUPED" --out bench/results/phase-probe.json
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import models  # before mlx: routes its BLAS (models/blas.py)

# isort: split
import mlx.core as mx

import models.mtp_cuda
from bench.common import machine_info
from bench.fused_probe import segments
from bench.mtp import SAMPLINGS, apply_switches
from bench.step_probe import probe_arguments, probe_head
from models.mtp_cuda import FusedStep, draw_params, fused_weights, phases_of


def main() -> None:
    parser = probe_arguments(__doc__, "qwen3-next", "1")
    parser.add_argument("--contexts", default="48,4096,32768")
    parser.add_argument("--sets", default="none", help="switch sets, ';' between sets")
    parser.add_argument("--samplings", default="greedy", help="of greedy, qwen")
    parser.add_argument("--heads", default="fr", help="of full, fr")
    parser.add_argument(
        "--launches", type=int, default=7, help="profiled launches per figure"
    )
    args = parser.parse_args()
    if mx.default_device() != mx.gpu:
        sys.exit(
            "phase_probe.py needs the CUDA backend (the fused kernel runs on a GPU only)"
        )
    # every set starts from the module's defaults
    defaults = {
        k: v
        for k, v in vars(models.mtp_cuda).items()
        if k.isupper() and type(v) in (bool, int)
    }
    config, hybrid, target, head, subset = probe_head(args)
    report: dict[str, Any] = {
        "machine": machine_info(),
        "shape": args.shape,
        "config": config,
        "vocab": args.vocab,
        "fr_size": args.fr_size,
        "runs": [],
    }
    rows = int(args.rows)
    for text in args.sets.split(";"):
        for name, value in defaults.items():
            setattr(models.mtp_cuda, name, value)
        apply_switches("" if text.strip() == "none" else text.strip())
        # (made per set, after its settings: FusedStep.make reads BLOCKS and
        # fused_weights the size limits, so a set that changes them applies)
        weights = fused_weights(target, head, 0)
        assert weights is not None, "this head is outside the fused kernel's scope"
        fused = {
            name: FusedStep.make(
                weights,
                target.head_weights().weight
                if name == "full"
                else subset.weights.weight,
                None if name == "full" else subset.ids,
            )
            for name in args.heads.split(",")
        }
        for context in (int(c) for c in args.contexts.split(",")):
            cache = head.make_cache(rows)
            cache.reserve(context + 8)
            keys = (mx.random.normal(cache.keys[0].shape) * 0.5).astype(
                cache.keys[0].dtype
            )
            values = (mx.random.normal(cache.values[0].shape) * 0.5).astype(keys.dtype)
            token = mx.random.randint(0, args.vocab, (rows, 1)).astype(mx.int32)
            normed = (mx.random.normal((rows, 1, hybrid.hidden_size)) * 0.5).astype(
                keys.dtype
            )
            zeros = mx.zeros((rows,), dtype=mx.int32)
            starts = mx.array([context - 3 * b for b in range(rows)], dtype=mx.int32)
            seeds = mx.arange(rows, dtype=mx.uint32) * 7 + 1
            steps = mx.arange(rows, dtype=mx.uint32) + 100
            mx.eval(keys, values, token, normed, zeros, starts, seeds, steps)
            for head_name, step in fused.items():
                assert step is not None
                for label in args.samplings.split(","):
                    params = SAMPLINGS[label]
                    top_k = 0 if params.greedy else params.top_k
                    dist = draw_params(
                        step.weights.eps, params.temperature, params.top_p, params.min_p
                    )
                    call = (
                        False,
                        params.greedy,
                        top_k,
                        dist,
                        token,
                        normed,
                        zeros,
                        starts,
                        keys,
                        values,
                        seeds,
                        steps,
                    )
                    step.stamp_table(*call, count=2)  # compiles; its pages settle
                    tables = [
                        step.stamp_table(*call, count=2) for _ in range(args.launches)
                    ]
                    phased = [phases_of(t, step.barriers) for t in tables]
                    run = {
                        "set": text.strip(),
                        "context": context,
                        "head": head_name,
                        "sampling": label,
                        # the draw's end, us from the first block's start
                        "step": round(statistics.median(p[-1][2] for p in phased), 2),
                        "segments": segments(tables, step.barriers),
                        # per grid barrier then the draw's end: (first arrival,
                        # last arrival, last departure) us, medians over launches
                        "phases": [
                            [
                                round(statistics.median(p[i][j] for p in phased), 2)
                                for j in range(3)
                            ]
                            for i in range(len(phased[0]))
                        ],
                        "barrier_failures": step.failures(),
                    }
                    report["runs"].append(run)
                    print(json.dumps(run), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
