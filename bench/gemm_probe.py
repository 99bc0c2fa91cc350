"""Small-window weight products on the device: how a product of M rows
(a verify window of M tokens) costs against a single row, per formulation.

A verify window of 2-17 tokens costs the 1.5B target 1.6-2.3x a single-token
step on the H200 (window-h200.json) while its weights are read once either
way, so the cost is not bandwidth. This times, for the Qwen2.5-1.5B layer
shapes (all 28 layers' products chained, one evaluation, so per-evaluation
sync is amortised):

- `matmul`: `x[M, K] @ W.T` (what the models do);
- `rows`: `x[M, 1, K] @ W.T`, M single-row products batched (MLX's batched
  matrix-vector path when it has one);
- `split`: M separate `x[i:i+1] @ W.T` products, concatenated.

    python bench/gemm_probe.py --out bench/results/gemm-probe.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import models  # noqa: F401  before mlx: routes its BLAS (models/blas.py)

# isort: split

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import machine_info

# Qwen2.5-1.5B: (out, in) of q, k, v, o, gate, up, down
SHAPES = [
    (1536, 1536),
    (256, 1536),
    (256, 1536),
    (1536, 1536),
    (8960, 1536),
    (8960, 1536),
    (1536, 8960),
]
# the same products with q/k/v and gate/up fused into one product each
FUSED = [(2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960)]
LAYERS = 28


def chain(weights: list[mx.array], x: dict[int, mx.array], form: str) -> list[mx.array]:
    outs = []
    for w in weights:
        a = x[w.shape[1]]
        if form == "matmul":
            outs.append(a @ w.T)
        elif form == "rows":
            outs.append((a[:, None, :] @ w.T)[:, 0, :])
        else:
            outs.append(
                mx.concatenate([a[i : i + 1] @ w.T for i in range(a.shape[0])], axis=0)
            )
    return outs


def timed(fn: Callable[[], list[mx.array]], repeats: int) -> float:
    times = []
    for i in range(repeats + 2):
        start = time.perf_counter()
        mx.eval(fn())
        if i >= 2:
            times.append((time.perf_counter() - start) * 1000.0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,2,3,4,5,8,16")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument(
        "--fused", action="store_true", help="q/k/v and gate/up as one product each"
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    mx.random.seed(0)
    weights = [
        (mx.random.normal((o, i)) * 0.02).astype(mx.bfloat16)
        for _ in range(LAYERS)
        for o, i in (FUSED if args.fused else SHAPES)
    ]
    head = (mx.random.normal((151936, 1536)) * 0.02).astype(mx.bfloat16)
    mx.eval(weights, head)
    report: dict[str, object] = {
        "machine": machine_info(),
        "shapes": FUSED if args.fused else SHAPES,
        "layers": LAYERS,
        "results": [],
    }
    results: list[dict[str, object]] = []
    for m in [int(r) for r in args.rows.split(",")]:
        x = {k: mx.random.normal((m, k)).astype(mx.bfloat16) for k in (1536, 8960)}
        mx.eval(x)
        row: dict[str, object] = {"rows": m}
        for form in ("matmul", "rows", "split"):
            if form == "split" and m > 8:
                continue
            row[f"{form}_layers_ms"] = timed(
                lambda form=form: chain(weights, x, form), args.repeats
            )
            row[f"{form}_head_ms"] = timed(
                lambda form=form: chain([head], x, form), args.repeats
            )
        # attention of the window over a 512-key cache (12 query / 2 kv heads,
        # head_dim 128): fused kernel with an explicit additive mask, as
        # short GPU windows run it, 28 layers chained
        q = mx.random.normal((1, 12, m, 128)).astype(mx.bfloat16)
        k = mx.random.normal((1, 2, 512, 128)).astype(mx.bfloat16)
        v = mx.random.normal((1, 2, 512, 128)).astype(mx.bfloat16)
        mask = mx.zeros((1, 1, m, 512), dtype=mx.bfloat16)
        mx.eval(q, k, v, mask)
        row["sdpa_mask_layers_ms"] = timed(
            lambda: [
                mx.fast.scaled_dot_product_attention(q, k, v, scale=0.088, mask=mask)
                for _ in range(LAYERS)
            ],
            args.repeats,
        )
        row["sdpa_nomask_layers_ms"] = timed(
            lambda: [
                mx.fast.scaled_dot_product_attention(q, k, v, scale=0.088)
                for _ in range(LAYERS)
            ],
            args.repeats,
        )
        results.append(row)
        print(json.dumps(row), flush=True)
    report["results"] = results
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
