"""A quick device check of the MTP kernel's whole-round launch (a first step
over a 2-position window, then chained steps, one launch: `FusedStep.launch`)
against `HeadStep.round`'s MLX steps, for one head (FR-Spec list or the full
projection) and one sampling: drafts equal, largest differences of the last
normed output and of the written keys / values, and median ms of the round
as the MLX steps, as one launch, and as the first step's launch plus one
launch of the chained steps. Smaller and faster than bench/fused_probe.py
(two kernel forms to compile), for a short device call.

    python bench/round_check.py --head fr --depth 3 --out bench/results/round-check.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import models  # before mlx: routes its BLAS (models/blas.py)

# isort: split
import mlx.core as mx

import models.mtp_cuda
from bench.common import machine_info, median_ms
from bench.fused_probe import float32_copy, launch_agreement
from bench.mtp import SAMPLINGS
from bench.step_probe import probe_arguments, probe_head
from models.mtp_cuda import FusedStep, fused_weights
from specpipe.draft_vocab import SubsetHead
from specpipe.drafts.mtp import HeadStep


def main() -> None:
    parser = probe_arguments(__doc__, "qwen3-next", "1")
    parser.add_argument("--head", choices=("fr", "full"), default="fr")
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--sampling", choices=sorted(SAMPLINGS), default="greedy")
    args = parser.parse_args()
    models.mtp_cuda.FUSED_ON_GPU = False  # the reference: the compiled MLX steps
    _config, hybrid, target, head, subset = probe_head(args)
    sub = subset if args.head == "fr" else None
    weights = fused_weights(target, head, 0)
    assert weights is not None, "this head is outside the fused kernel's scope"
    rows_w = target.head_weights().weight if sub is None else sub.weights.weight
    fused = FusedStep.make(weights, rows_w, None if sub is None else sub.ids)
    assert fused is not None, "no CUDA device"
    params = SAMPLINGS[args.sampling]
    reference = HeadStep(target, head, sub).round(params, args.depth)
    assert reference is not None
    # the same weights in float32 (the kernel sums in float32 from bf16
    # weights): a draft that differs from the bf16 steps' but not from these
    # is a near-tie the bf16 rounding moved
    target32, head32 = float32_copy(target), float32_copy(head)
    sub32 = (
        None
        if sub is None
        else SubsetHead(sub.ids, target32.head_weights().take(sub.ids))
    )
    step32 = HeadStep(target32, head32, sub32)
    exact = step32.round(params, args.depth)
    assert exact is not None
    top_k = 0 if params.greedy else params.top_k
    temperature = 0.0 if params.greedy else params.temperature
    whole = fused.launch(
        True, args.depth, temperature, params.top_p, params.min_p, top_k, kv_out=True
    )  # as HeadStep.round launches it
    first = fused.launch(True, 1, temperature, params.top_p, params.min_p, top_k)
    rest = fused.launch(
        False, args.depth - 1, temperature, params.top_p, params.min_p, top_k
    )
    report: dict[str, Any] = {
        "machine": machine_info(),
        "shape": args.shape,
        "head": args.head,
        "depth": args.depth,
        "sampling": args.sampling,
        "rows": [],
    }
    hidden_size = hybrid.hidden_size
    for rows in [int(r) for r in args.rows.split(",")]:
        cache = head.make_cache(rows)
        cache.reserve(args.context + 8 + args.depth)
        keys = (mx.random.normal(cache.keys[0].shape) * 0.5).astype(cache.keys[0].dtype)
        values = (mx.random.normal(cache.values[0].shape) * 0.5).astype(
            cache.values[0].dtype
        )
        ids = mx.random.randint(0, args.vocab, (rows, 2)).astype(mx.int32)
        raw = (mx.random.normal((rows, 2, hidden_size)) * 2.0).astype(keys.dtype)
        last = mx.ones((rows,), dtype=mx.int32)
        starts = mx.array([args.context - 3 * b for b in range(rows)], dtype=mx.int32)
        seeds = mx.arange(rows, dtype=mx.uint32) * 7 + 1
        steps = mx.arange(rows, dtype=mx.uint32) + 100
        inputs = (ids, raw, last, starts, keys, values, seeds, steps)
        mx.eval(*inputs)
        r_out, f_out = reference(*inputs), whole(*inputs)
        mx.eval(r_out, f_out)
        wide = [a.astype(mx.float32) for a in (raw, keys, values)]
        inputs32 = (ids, wide[0], last, starts, wide[1], wide[2], seeds, steps)
        # the first draft's two best logits (float32 steps): its margin
        _, normed32, _, _ = step32(True, 0, params)(*inputs32)
        best2 = mx.sort(step32.logits(normed32[:, 0]), axis=-1)[:, -2:]

        def two_launches() -> Any:
            token, normed, k, v = first(*inputs)
            at = starts + last + 1
            return rest(token[:, None], normed, at, at, k, v, seeds, steps + 1)[0]

        entry = {
            "rows": rows,
            "tokens_equal": f"{int(mx.sum(r_out[0] == f_out[0]).item())}/{rows * args.depth}",
            "ref_tokens": r_out[0].tolist(),
            "fused_tokens": f_out[0].tolist(),
            **{
                f"{what}_max_diff": float(
                    mx.max(mx.abs(r.astype(mx.float32) - f.astype(mx.float32)))
                )
                for what, r, f in zip(
                    ("normed", "keys", "values"), r_out[1:], f_out[1:], strict=True
                )
            },
            "mlx_ms": median_ms(lambda: reference(*inputs)[0], args.repeats),
            "one_launch_ms": median_ms(lambda: whole(*inputs)[0], args.repeats),
            "two_launches_ms": median_ms(two_launches, args.repeats),
            "vs_float32": launch_agreement(exact(*inputs32), f_out, rows * args.depth),
            "first_logit_gap": (best2[:, 1] - best2[:, 0]).tolist(),
            "barrier_failures": fused.failures(),
        }
        report["rows"].append(entry)
        print(json.dumps(entry), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
