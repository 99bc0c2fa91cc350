"""Where one MTP draft step's time goes on the current device.

Builds the head of `bench/mtp.py`'s shapes (random weights, a one-layer
target: a draft step reads only the target's embedding, final norm and
vocabulary projection) and times, per row count, each as one compiled
function evaluated alone (median of `--repeats` after a warm-up):

- `layer`: the head's forward for one (token, hidden) pair per row and its norm,
- `head_{full,fr}`: the vocabulary projection and a greedy argmax,
- `draw_{full,fr}`: the projection and Qwen's sampled draw (T 0.7, top-k 20, top-p 0.8),
  and `draw_fr_blockwise` with the list's top-k in two stages as well,
- `step_{full,fr}_{greedy,qwen}`: a whole chained step (`specpipe.drafts.mtp.HeadStep`),
  split into building the graph (`build`), encoding it (`mx.async_eval`,
  `encode`) and waiting for the device (`wait`).

Run it under different `MLX_MAX_OPS_PER_BUFFER` values (how many kernels MLX's
CUDA backend puts in one CUDA graph, default 20) to see what launching costs.

    python bench/step_probe.py --shape qwen3.5-27b --rows 1,32,128 --out bench/results/step-probe.json
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

from bench.common import machine_info, median_ms, split_ms
from bench.mtp import SAMPLINGS, SHAPES
from models.build import build_model
from models.fuse import fuse_projections
from models.mtp import MtpHead
from schemas.hf_hybrid import hybrid_args
from specpipe import sampling
from specpipe.draft_vocab import DraftVocabulary, SubsetHead
from specpipe.drafts.mtp import HeadStep


def probe_arguments(doc: str | None, shape: str, rows: str) -> argparse.ArgumentParser:
    """The MTP step probes' common options (this one's and bench/fused_probe.py's)."""
    parser = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default=shape)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--fr-size", type=int, default=32768)
    parser.add_argument("--rows", default=rows)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", type=Path, required=True)
    return parser


def probe_head(
    args: argparse.Namespace,
) -> tuple[dict[str, Any], Any, Any, MtpHead, SubsetHead]:
    """(config, hybrid args, one-layer target, head, FR-Spec subset) of
    `args.shape` / `experts` / `vocab` / `fr_size` / `dtype`, random weights,
    projections fused as the loader fuses them."""
    config = SHAPES[args.shape](1, args.experts, 2048, args.vocab)
    hybrid = hybrid_args(config, "probe").unwrap()
    mx.random.seed(0)
    target = build_model(hybrid).unwrap()
    target.set_dtype(getattr(mx, args.dtype))
    head = MtpHead(hybrid)
    head.set_dtype(getattr(mx, args.dtype))
    fuse_projections(target)
    fuse_projections(head)
    mx.eval(target.parameters(), head.parameters())
    ids = sorted(
        mx.random.permutation(args.vocab, key=mx.random.key(2))[: args.fr_size].tolist()
    )
    subset = SubsetHead.of(target, DraftVocabulary.create(ids, args.vocab).unwrap())
    return config, hybrid, target, head, subset


def main() -> None:
    parser = probe_arguments(__doc__, "qwen3.5-27b", "1,32,128")
    args = parser.parse_args()

    config, hybrid, target, head, subset = probe_head(args)
    steps_of = {
        "full": HeadStep(target, head, None),
        "fr": HeadStep(target, head, subset),
    }
    report: dict[str, Any] = {
        "machine": machine_info(),
        "shape": args.shape,
        "config": config,
        "vocab": args.vocab,
        "fr_size": args.fr_size,
        "max_ops_per_buffer": os.environ.get("MLX_MAX_OPS_PER_BUFFER", "default (20)"),
        "rows": [],
    }
    hidden_size = hybrid.hidden_size
    greedy, qwen = SAMPLINGS["greedy"], SAMPLINGS["qwen"]

    def measure(rows: int) -> dict[str, Any]:
        cache = head.make_cache(rows)
        cache.reserve(args.context + 8)
        keys, values = cache.keys[0], cache.values[0]
        token = mx.zeros((rows, 1), dtype=mx.int32)
        normed = (mx.random.normal((rows, 1, hidden_size)) * 0.5).astype(
            head.fc.weight.dtype
        )
        first = mx.zeros((rows,), dtype=mx.int32)
        starts = mx.full((rows,), args.context, dtype=mx.int32)
        seeds = mx.zeros((rows,), dtype=mx.uint32)
        steps = mx.arange(rows, dtype=mx.uint32)
        flat = normed[:, 0]
        mx.eval(keys, values, token, normed, first, starts, seeds, steps, flat)

        layer = mx.compile(
            lambda t, h, k, v, s: head.normed(
                head.forward_at(target.embed(t), h, k, v, s, 1)[0]
            )
        )
        entry: dict[str, Any] = {"rows": rows}
        entry["layer"] = median_ms(
            lambda: layer(token, normed, keys, values, starts), args.repeats
        )
        for name, step in steps_of.items():
            argmax = mx.compile(lambda x, step=step: step.draw(x, greedy, seeds, steps))
            sampled = mx.compile(lambda x, step=step: step.draw(x, qwen, seeds, steps))
            entry[f"head_{name}"] = median_ms(
                lambda argmax=argmax: argmax(flat), args.repeats
            )
            entry[f"draw_{name}"] = median_ms(
                lambda sampled=sampled: sampled(flat), args.repeats
            )
            if (
                name == "fr"
            ):  # top-k in two stages over the list too (specpipe.sampling.top_k_ids)
                saved, sampling.TWO_STAGE_TOP_K_FROM = (
                    sampling.TWO_STAGE_TOP_K_FROM,
                    8192,
                )
                blockwise = mx.compile(
                    lambda x, step=step: step.draw(x, qwen, seeds, steps)
                )
                entry["draw_fr_blockwise"] = median_ms(
                    lambda b=blockwise: b(flat), args.repeats
                )
                sampling.TWO_STAGE_TOP_K_FROM = saved
            for label, params in (("greedy", greedy), ("qwen", qwen)):
                fn = step(False, 1, params)

                def call(fn: Any = fn) -> Any:
                    return fn(token, normed, first, starts, keys, values, seeds, steps)[
                        0
                    ]

                entry[f"step_{name}_{label}"] = median_ms(call, args.repeats)
                entry[f"split_{name}_{label}"] = split_ms(call, args.repeats)
        return entry

    for rows in [int(r) for r in args.rows.split(",")]:
        entry = measure(rows)
        report["rows"].append(entry)
        print(json.dumps(entry), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
