"""Where a sampled draft step's time goes over a full and a listed vocabulary.

Times, per row count, on the current device: the head projection alone
(`[B, H] x [V, H]^T`, bf16) over the full vocabulary and over an FR-Spec list
of `--fr-size` rows, then Qwen's sampling (temperature 0.7, top-k 20, top-p
0.8: `specpipe.sampling.sample`) over each, eagerly and under `mx.compile`
(which fuses the element-wise passes into fewer kernels). Each figure is the
median of `--repeats` timed evaluations after a warm-up.

    python bench/sampling_probe.py --rows 1,32,128 --out bench/results/sampling-probe.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import machine_info, write_json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,32,128")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--fr-size", type=int, default=32768)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    import mlx.core as mx

    from schemas.request import SamplingParams
    from specpipe import sampling
    from specpipe.sampling import sample

    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.8, seed=1)
    mx.random.seed(0)
    head = (mx.random.normal((args.vocab, args.hidden)) * 0.02).astype(mx.bfloat16)
    listed = head[: args.fr_size]
    mx.eval(head, listed)

    def timed(fn: Any, *inputs: mx.array) -> float:
        for _ in range(3):
            mx.eval(fn(*inputs))
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            mx.eval(fn(*inputs))
            times.append((time.perf_counter() - t0) * 1000.0)
        return statistics.median(times)

    def project(weights: mx.array) -> Any:
        return lambda x: x @ weights.T

    def sampler(x: mx.array, seeds: mx.array, steps: mx.array) -> mx.array:
        return sample(x, params, seeds, steps)

    compiled = mx.compile(sampler)
    report: dict[str, Any] = {
        "machine": machine_info(),
        "args": vars(args) | {"out": str(args.out)},
        "rows": [],
    }
    for rows in [int(r) for r in args.rows.split(",")]:
        x = mx.random.normal((rows, args.hidden)).astype(mx.bfloat16)
        seeds = mx.zeros((rows,), dtype=mx.uint32)
        steps = mx.arange(rows).astype(mx.uint32)
        entry: dict[str, Any] = {"rows": rows}
        for name, weights in (("full", head), ("fr", listed)):
            logits = (x @ weights.T).astype(mx.float32)
            mx.eval(logits)
            entry[f"{name}_head_ms"] = timed(project(weights), x)
            entry[f"{name}_sample_ms"] = timed(sampler, logits, seeds, steps)
            entry[f"{name}_sample_compiled_ms"] = timed(compiled, logits, seeds, steps)
            same = mx.array_equal(
                sampler(logits, seeds, steps), compiled(logits, seeds, steps)
            )
            entry[f"{name}_compiled_equal"] = bool(same.item())
            entry[f"{name}_head_and_sample_ms"] = timed(
                lambda v, w=weights: sampler(
                    (v @ w.T).astype(mx.float32), seeds, steps
                ),
                x,
            )
            # top-k by one partition of the row vs blockwise (specpipe.sampling.top_k_ids)
            drawn = {}
            for stages, threshold in (("one", 1 << 30), ("blockwise", 0)):
                sampling.TWO_STAGE_TOP_K_FROM = threshold
                sampling.compiled_draw.cache_clear()
                entry[f"{name}_sample_topk_{stages}_ms"] = timed(
                    sampler, logits, seeds, steps
                )
                drawn[stages] = sampler(logits, seeds, steps)
            entry[f"{name}_topk_stages_equal"] = bool(
                mx.array_equal(drawn["one"], drawn["blockwise"]).item()
            )
        report["rows"].append(entry)
        print(
            {k: round(v, 3) if isinstance(v, float) else v for k, v in entry.items()},
            flush=True,
        )
        write_json(args.out, report)


if __name__ == "__main__":
    main()
