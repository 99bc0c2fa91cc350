"""The one-kernel MTP draft step (models/mtp_cuda.py) against the compiled MLX
step (specpipe.drafts.mtp.HeadStep) on a CUDA GPU: agreement and time.

Builds `bench/mtp.py`'s head shapes (random weights, a one-layer target) and,
per row count, sampling (greedy, Qwen's) and head (full vocabulary, a 32k
FR-Spec list):

- agreement of one chained step and one first step (a 2-position window,
  the target's final norm applied) with the MLX step, and with the MLX step
  on float32 copies of the weights (`*_vs_float32`: what the kernel should
  match up to summation order and the bf16 rounding of its outputs): drafted
  tokens equal, the largest difference of the normed output and of the
  window's keys / values, and for tokens that differ, the reference's logit
  gap between the two tokens (a near-tie, if small);
- the same for three chained steps in one launch of the kernel (`chain3`;
  `chain3_kv_out`: the kernel writing whole KV buffers, as a round does)
  against three MLX steps, and for a whole round in one launch (`round3`: a
  2-position first step and two chained steps) against `HeadStep.round`'s
  MLX steps;
- time: one chained step, a depth-3 chain (a first step of one position
  and two chained steps, evaluated once; the kernel's two chained steps in
  one launch), and ten chained steps per step (`chain10`: MLX steps, kernel
  steps, and `chain10_launch`: the ten in one launch), and the round in one
  launch (`round_fused`: the 2-position first step and two chained steps),
  median of `--repeats`;
- the blocks' start spread, then the kernel's phases (fc, q/k/v,
  attention, o_proj, the MLP's two or three phases, the projection, the
  draw): for each barrier closing one,
  microseconds from the first block's start to the first block's arrival,
  the last block's arrival and the last block's departure (the draw: its
  end), median of 7 profiled launches, and each launch's last-arriving
  block per phase;
- the grid barriers that gave up (must be 0).

    python bench/fused_probe.py --shape qwen3-next --rows 1,4,8 --out bench/results/fused-probe.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import models  # before mlx: routes its BLAS (models/blas.py)

# isort: split
import mlx.core as mx
from mlx.utils import tree_map

import models.mtp_cuda
from bench.common import machine_info, median_ms, split_ms
from bench.mtp import SAMPLINGS
from bench.step_probe import probe_arguments, probe_head
from models.fuse import fuse_projections
from models.mtp_cuda import FusedStep, draw_params, fused_weights, phases_of
from specpipe.draft_vocab import SubsetHead
from specpipe.drafts.mtp import HeadStep


def float32_copy(model: Any) -> Any:
    """`model` with its (fused) weights in float32: a new module of the same
    class and arguments, the parameters cast, the projections fused again."""
    copy = type(model)(model.args)
    copy.update(tree_map(lambda a: a.astype(mx.float32), model.parameters()))
    fuse_projections(copy)
    mx.eval(copy.parameters())
    return copy


def launch_agreement(reference: Any, fused: Any, count: int) -> dict[str, Any]:
    """Drafts [B, n] equal of `count`, and the largest differences of the
    normed output and the written keys / values, of two (tokens, normed,
    keys, values) results."""
    mx.eval(reference, fused)
    return {
        "tokens_equal": f"{int(mx.sum(reference[0] == fused[0]).item())}/{count}",
        "ref_tokens": reference[0].tolist(),
        "fused_tokens": fused[0].tolist(),
        **{
            f"{what}_max_diff": float(
                mx.max(mx.abs(r.astype(mx.float32) - f.astype(mx.float32)))
            )
            for what, r, f in zip(
                ("normed", "keys", "values"), reference[1:], fused[1:], strict=True
            )
        },
    }


# A MoE step's stretches per block, between its stamps (FusedStep.stamp_table:
# 0 start, 1 + 2k / 2 + 2k arrival at / departure from barrier k, then the
# draw's end (17 with eight barriers), 24 + m the inner points: 24-31 where
# the products start, 32 / 33 attention's query normed / its angles
# computed, 34 / 35 the router's logits read (their max and sum) / the
# experts chosen), for a step whose router has its own phase (eight
# barriers: past FOLD_ROUTER's 127 experts)
_SEGMENTS = [
    ("fc_stage", 0, 24),
    ("fc_product", 24, 1),
    ("qkv_stage", 2, 25),
    ("qkv_product", 25, 3),
    ("attn_query", 4, 26),
    ("attn_q_norm", 4, 32),
    ("attn_q_angles", 32, 33),
    ("attn_q_rotate", 33, 26),
    ("attn_positions", 26, 27),
    ("attn_partial", 27, 5),
    ("o_combine", 6, 28),
    ("o_product", 28, 7),
    ("router", 8, 9),
    ("experts_topk", 10, 29),
    ("topk_logits", 10, 34),
    ("topk_choice", 34, 35),
    ("topk_after", 35, 29),
    ("experts_product", 29, 11),
    ("down_stage", 12, 30),
    ("down_product", 30, 13),
    ("head_stage", 14, 31),
    ("head_product", 31, 15),
    ("draw", 16, 17),
]


def _folded(stamp: int) -> int:
    """A stamp's index in a folded router's step: no router phase, so the
    barriers after it (stamps 9-17) come one barrier (two stamps) earlier."""
    return stamp - 2 if 9 <= stamp <= 17 else stamp


# a folded router's step (seven barriers: the router's sums in o_proj's phase)
_FOLDED = [
    (name, _folded(a), _folded(b)) for name, a, b in _SEGMENTS if name != "router"
]


def segments(
    tables: list[list[list[float]]], barriers: int = 8
) -> dict[str, list[float]]:
    """Per stretch of a MoE step of `barriers` grid barriers (7: its router
    folded), over the blocks, its [min, median, max] microseconds, each the
    median over the profiled launches, and (last) the block most often
    slowest. A block counts for a stretch only where both its stamps lie in
    the step (a block without an item of a phase, e.g. attention's splits
    past a short context's, leaves that phase's inner stamps unwritten);
    a stretch no block stamped is left out."""
    out: dict[str, list[float]] = {}
    end = 1 + 2 * barriers  # the draw's end
    for name, a, b in _FOLDED if barriers == 7 else _SEGMENTS:
        runs = [
            {
                blk: row[b] - row[a]
                for blk, row in enumerate(table)
                if 0.0 <= row[a] <= row[end] and 0.0 <= row[b] <= row[end]
            }
            for table in tables
        ]
        runs = [r for r in runs if r]
        if not runs:
            continue
        stats = [
            [min(r.values()), statistics.median(r.values()), max(r.values())]
            for r in runs
        ]
        slowest = statistics.mode(max(r, key=r.__getitem__) for r in runs)
        out[name] = [round(statistics.median(x[i] for x in stats), 2) for i in range(3)]
        out[name].append(float(slowest))
    return out


# The kernel's switches the probe sets: --flag on, --no-flag off.
_SWITCHES = [
    ("pair-rows", "PAIR_ROWS", "two rows per warp at once in one-input products"),
    ("prefetch", "PREFETCH_L2", "L2 bulk prefetch hints in the kernel"),
    (
        "evict-all",
        "EVICT_ALL",
        "L2 evict-first loads of every weight row (code stays in L2)",
    ),
    ("fast-sincos", "FAST_SINCOS", "diagnostic: RoPE angles by __sincosf"),
    ("fold-router", "FOLD_ROUTER", "the MoE router folded into o_proj's phase"),
    (
        "draw-heads",
        "DRAW_HEADS",
        "a sampled draw merges the blocks' best few candidates first",
    ),
    (
        "tight-draw",
        "TIGHT_DRAW",
        "a sampled step's sorts and draw in compact (rolled) loops",
    ),
    ("tree-merge", "TREE_MERGE", "a sampled step's warps' runs merged pairwise"),
    (
        "acq-rel-barrier",
        "ACQ_REL_BARRIER",
        "the grid barrier by release / acquire operations",
    ),
    (
        "att-spread",
        "ATT_SPREAD",
        "a warp's cached positions at once NWARP apart, not adjacent",
    ),
    (
        "att-pipe",
        "ATT_PIPE",
        "attention's next cached positions loaded during the current ones",
    ),
    (
        "att-grouped",
        "ATT_GROUPED",
        "attention per kv head, its keys and values staged in shared memory",
    ),
    (
        "bf16-shifts",
        "BF16_SHIFTS",
        "bfloat16 to float by a shift or mask of its 32-bit word",
    ),
    (
        "redux-topk",
        "REDUX_TOPK",
        "the router's top-k in rounds of two warp reductions",
    ),
    (
        "shared-cdf",
        "SHARED_CDF",
        "a sampled draw's inverse CDF read from shared memory",
    ),
    (
        "draw-runs",
        "DRAW_RUNS",
        "a sampled draw's head runs sorted interleaved, first stages skipped",
    ),
]


def main() -> None:
    parser = probe_arguments(__doc__, "qwen3-next", "1,4,8")
    for flag, name, text in _SWITCHES:
        parser.add_argument(
            f"--{flag}",
            action=argparse.BooleanOptionalAction,
            default=None,
            help=f"{text} (models.mtp_cuda.{name}; default: the module's)",
        )
    parser.add_argument(
        "--narrow-loads",
        action="store_true",
        help="8 loads per lane in flight in every product (models.mtp_cuda.WIDE_LOADS off)",
    )
    parser.add_argument(
        "--draw-heads-k",
        type=int,
        default=None,
        help="candidates per block the draw merges first (models.mtp_cuda.DRAW_HEADS_K)",
    )
    parser.add_argument(
        "--att-unroll",
        type=int,
        default=None,
        help="attention's cache positions per warp at once (models.mtp_cuda.ATT_UNROLL)",
    )
    parser.add_argument(
        "--copy-unroll",
        type=int,
        default=None,
        help="a whole round's KV copy, vectors per thread at once (models.mtp_cuda.COPY_UNROLL)",
    )
    parser.add_argument(
        "--att-share",
        type=int,
        default=None,
        help="attention's least positions per split, 0: always the most splits (models.mtp_cuda.ATT_SHARE)",
    )
    parser.add_argument("--samplings", default="greedy,qwen", help="of greedy, qwen")
    parser.add_argument(
        "--agree-only",
        action="store_true",
        help="the drafts' agreement only (no timing, no profiled launches)",
    )
    args = parser.parse_args()
    for flag, name, _ in _SWITCHES:  # a switch not given keeps the module's setting
        if getattr(args, flag.replace("-", "_")) is not None:
            setattr(models.mtp_cuda, name, getattr(args, flag.replace("-", "_")))
    if args.draw_heads_k is not None:
        models.mtp_cuda.DRAW_HEADS_K = args.draw_heads_k
    if args.att_unroll is not None:
        models.mtp_cuda.ATT_UNROLL = args.att_unroll
    if args.copy_unroll is not None:
        models.mtp_cuda.COPY_UNROLL = args.copy_unroll
    if args.att_share is not None:
        models.mtp_cuda.ATT_SHARE = args.att_share
    if args.narrow_loads:
        models.mtp_cuda.WIDE_LOADS = False

    # the reference is the compiled MLX step: HeadStep must not route to the kernel
    models.mtp_cuda.FUSED_ON_GPU = False
    config, hybrid, target, head, subset = probe_head(args)
    weights = fused_weights(target, head, 0)
    assert weights is not None, "this head is outside the fused kernel's scope"
    heads: dict[str, tuple[HeadStep, FusedStep]] = {}
    # the same weights in float32: the kernel computes in float32 from bf16
    # weights, so against this reference only summation order and the bf16
    # rounding of its outputs (and of the window's keys / values) remain
    target32, head32 = (float32_copy(m) for m in (target, head))
    subset32 = SubsetHead(subset.ids, target32.head_weights().take(subset.ids))
    exact: dict[str, HeadStep] = {}
    for name, sub in (("full", None), ("fr", subset)):
        rows_w = target.head_weights().weight if sub is None else sub.weights.weight
        fused = FusedStep.make(weights, rows_w, None if sub is None else sub.ids)
        assert fused is not None
        heads[name] = (HeadStep(target, head, sub), fused)
        exact[name] = HeadStep(target32, head32, None if sub is None else subset32)
    report: dict[str, Any] = {
        "machine": machine_info(),
        "shape": args.shape,
        "config": config,
        "vocab": args.vocab,
        "fr_size": args.fr_size,
        # the kernel's switches as run (every flag's, then the two without one)
        **{
            flag.replace("-", "_"): getattr(models.mtp_cuda, name)
            for flag, name, _ in _SWITCHES
        },
        "wide_loads": models.mtp_cuda.WIDE_LOADS,
        "draw_heads_k": models.mtp_cuda.DRAW_HEADS_K,
        "att_unroll": models.mtp_cuda.ATT_UNROLL,
        "copy_unroll": models.mtp_cuda.COPY_UNROLL,
        "att_share": models.mtp_cuda.ATT_SHARE,
        "context": args.context,
        "rows": [],
    }
    hidden_size = hybrid.hidden_size

    def measure(rows: int) -> dict[str, Any]:
        cache = head.make_cache(rows)
        cache.reserve(args.context + 8)
        keys = (mx.random.normal(cache.keys[0].shape) * 0.5).astype(cache.keys[0].dtype)
        values = (mx.random.normal(cache.values[0].shape) * 0.5).astype(
            cache.values[0].dtype
        )
        token = mx.random.randint(0, args.vocab, (rows, 1)).astype(mx.int32)
        normed = (mx.random.normal((rows, 1, hidden_size)) * 0.5).astype(keys.dtype)
        window_ids = mx.random.randint(0, args.vocab, (rows, 2)).astype(mx.int32)
        raw = (mx.random.normal((rows, 2, hidden_size)) * 2.0).astype(keys.dtype)
        zeros = mx.zeros((rows,), dtype=mx.int32)
        ones = mx.ones((rows,), dtype=mx.int32)
        starts = mx.array([args.context - 3 * b for b in range(rows)], dtype=mx.int32)
        seeds = mx.arange(rows, dtype=mx.uint32) * 7 + 1
        steps = mx.arange(rows, dtype=mx.uint32) + 100
        mx.eval(
            keys,
            values,
            token,
            normed,
            window_ids,
            raw,
            zeros,
            ones,
            starts,
            seeds,
            steps,
        )
        entry: dict[str, Any] = {"rows": rows}
        for name, (step, fused) in heads.items():
            for label in args.samplings.split(","):
                params = SAMPLINGS[label]
                top_k = 0 if params.greedy else params.top_k
                key = f"{name}_{label}"

                def ref(first: bool, n: int = 1) -> Any:
                    if first:
                        return step(True, 0, params)(
                            window_ids, raw, ones, starts, keys, values, seeds, steps
                        )
                    return step(False, 0, params)(
                        token, normed, zeros, starts, keys, values, seeds, steps
                    )

                def fused_step(first: bool) -> Any:
                    return fused.step(
                        first,
                        params.temperature if not params.greedy else 0.0,
                        params.top_p,
                        params.min_p,
                        top_k,
                    )

                def fast(first: bool) -> Any:
                    if first:
                        return fused_step(True)(
                            window_ids, raw, ones, starts, keys, values, seeds, steps
                        )
                    return fused_step(False)(
                        token, normed, zeros, starts, keys, values, seeds, steps
                    )

                if not fused.fits(rows, 2, params.greedy, top_k):
                    entry[f"agree_{key}"] = "outside the fused kernel's scope"
                    continue

                def ref32(first: bool) -> Any:
                    f32 = [a.astype(mx.float32) for a in (raw, normed, keys, values)]
                    if first:
                        return exact[name](True, 0, params)(
                            window_ids,
                            f32[0],
                            ones,
                            starts,
                            f32[2],
                            f32[3],
                            seeds,
                            steps,
                        )
                    return exact[name](False, 0, params)(
                        token, f32[1], zeros, starts, f32[2], f32[3], seeds, steps
                    )

                agree: dict[str, Any] = {}
                for first, reference, label32 in (
                    (False, ref, "chained"),
                    (True, ref, "first"),
                    (False, ref32, "chained_vs_float32"),
                    (True, ref32, "first_vs_float32"),
                ):
                    r_tok, r_norm, r_k, r_v = reference(first)
                    f_tok, f_norm, f_k, f_v = fast(first)
                    mx.eval(r_tok, r_norm, r_k, r_v, f_tok, f_norm, f_k, f_v)
                    same = (r_tok == f_tok).tolist()
                    gaps = []
                    for b, ok in enumerate(same):
                        if not ok:  # the reference's logits of the two tokens
                            logits = (
                                target32.project(r_norm[b, 0].astype(mx.float32)[None])[
                                    0
                                ]
                                if step.subset is None
                                else None
                            )
                            if logits is not None:
                                gaps.append(float(logits[r_tok[b]] - logits[f_tok[b]]))
                    agree[label32] = {
                        "tokens_equal": f"{sum(same)}/{rows}",
                        "ref_tokens": r_tok.tolist(),
                        "fused_tokens": f_tok.tolist(),
                        "logit_gaps": gaps,
                        "normed_max_diff": float(
                            mx.max(
                                mx.abs(
                                    r_norm.astype(mx.float32)
                                    - f_norm.astype(mx.float32)
                                )
                            )
                        ),
                        "normed_max": float(mx.max(mx.abs(r_norm.astype(mx.float32)))),
                        "keys_max_diff": float(
                            mx.max(
                                mx.abs(r_k.astype(mx.float32) - f_k.astype(mx.float32))
                            )
                        ),
                        "values_max_diff": float(
                            mx.max(
                                mx.abs(r_v.astype(mx.float32) - f_v.astype(mx.float32))
                            )
                        ),
                    }

                # three chained steps: one launch of the kernel's chain vs three MLX steps
                def ref_chain(head_step: HeadStep, cast: Any) -> Any:
                    t, n, k, v = token[:, 0], cast(normed), cast(keys), cast(values)
                    drafted = []
                    for i in range(3):
                        t, n, k, v = head_step(False, 0, params)(
                            t[:, None], n, zeros, starts + i, k, v, seeds, steps + i
                        )
                        drafted.append(t)
                    return mx.stack(drafted, axis=1), n, k, v

                def fused_chain(count: int) -> Any:
                    return fused.chain(
                        count,
                        params.temperature if not params.greedy else 0.0,
                        params.top_p,
                        params.min_p,
                        top_k,
                    )

                f_out = fused_chain(3)(
                    token, normed, zeros, starts, keys, values, seeds, steps
                )
                for label3, r_out in (
                    ("chain3", ref_chain(step, lambda a: a)),
                    (
                        "chain3_vs_float32",
                        ref_chain(exact[name], lambda a: a.astype(mx.float32)),
                    ),
                ):
                    agree[label3] = launch_agreement(r_out, f_out, rows * 3)
                # the same chain with the kernel writing whole KV buffers (as a
                # whole round does) instead of the window to scatter
                f_kv = fused.launch(
                    False,
                    3,
                    params.temperature if not params.greedy else 0.0,
                    params.top_p,
                    params.min_p,
                    top_k,
                    kv_out=True,
                )(token, normed, zeros, starts, keys, values, seeds, steps)
                agree["chain3_kv_out"] = launch_agreement(
                    ref_chain(step, lambda a: a), f_kv, rows * 3
                )

                # a whole round in one launch: the first step (2-position
                # window, last = 1) and two chained steps, vs HeadStep.round's
                # MLX steps (FUSED_ON_GPU is off here)
                def fused_round() -> Any:
                    return fused.launch(
                        True,
                        3,
                        params.temperature if not params.greedy else 0.0,
                        params.top_p,
                        params.min_p,
                        top_k,
                        kv_out=True,
                    )

                f_out = fused_round()(
                    window_ids, raw, ones, starts, keys, values, seeds, steps
                )
                for label3, head_step, f32 in (
                    ("round3", step, False),
                    ("round3_vs_float32", exact[name], True),
                ):
                    whole = head_step.round(params, 3)
                    assert whole is not None
                    cast_in = (lambda a: a.astype(mx.float32)) if f32 else (lambda a: a)
                    r_out = whole(
                        window_ids,
                        cast_in(raw),
                        ones,
                        starts,
                        cast_in(keys),
                        cast_in(values),
                        seeds,
                        steps,
                    )
                    agree[label3] = launch_agreement(r_out, f_out, rows * 3)
                entry[f"agree_{key}"] = agree
                if args.agree_only:
                    continue

                def chain(fn: Any) -> Any:
                    t, n, k, v = fn(True)
                    if fn is fast:  # the two chained steps in one launch
                        return fused_chain(2)(
                            t[:, None], n, zeros, starts + 2, k, v, seeds, steps
                        )[0]
                    for _ in range(2):
                        if fn is fast:
                            t, n, k, v = fused_step(False)(
                                t[:, None], n, zeros, starts + 2, k, v, seeds, steps
                            )
                        else:
                            t, n, k, v = step(False, 0, params)(
                                t[:, None], n, zeros, starts + 2, k, v, seeds, steps
                            )
                    return t

                def chain10(fn: Any) -> Any:  # ten chained steps, evaluated once
                    t, n, k, v = token[:, 0], normed, keys, values
                    for i in range(10):
                        t, n, k, v = fn(False)(
                            t[:, None], n, zeros, starts + i, k, v, seeds, steps
                        )
                    return t

                entry[f"chain10_mlx_{key}"] = (
                    median_ms(
                        lambda: chain10(lambda first: step(first, 0, params)),
                        args.repeats,
                    )
                    / 10
                )
                entry[f"chain10_fused_{key}"] = (
                    median_ms(lambda: chain10(fused_step), args.repeats) / 10
                )
                entry[f"chain10_launch_{key}"] = (
                    median_ms(
                        lambda: fused_chain(10)(
                            token, normed, zeros, starts, keys, values, seeds, steps
                        )[0],
                        args.repeats,
                    )
                    / 10
                )
                dist = draw_params(
                    fused.weights.eps, params.temperature, params.top_p, params.min_p
                )
                tables = [
                    fused.stamp_table(
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
                    for _ in range(7)
                ]
                stamps = [phases_of(t, fused.barriers) for t in tables]
                if not fused.weights.shape.dense:
                    entry[f"segments_{key}"] = segments(tables, fused.barriers)
                    # the second step of a two-step launch (its code run once
                    # already on every multiprocessor, as a round's chained steps)
                    entry[f"segments_second_{key}"] = segments(
                        [
                            fused.stamp_table(
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
                                count=2,
                            )
                            for _ in range(7)
                        ],
                        fused.barriers,
                    )
                entry[f"phases_{key}"] = [
                    [statistics.median(run[i][j] for run in stamps) for j in range(3)]
                    for i in range(len(stamps[0]))
                ]
                # per phase, the last-arriving block of each profiled launch
                entry[f"slowest_blocks_{key}"] = [
                    [run[i][3] for run in stamps] for i in range(len(stamps[0]))
                ]
                entry[f"split_mlx_{key}"] = split_ms(
                    lambda: ref(False)[0], args.repeats
                )
                entry[f"split_fused_{key}"] = split_ms(
                    lambda: fast(False)[0], args.repeats
                )
                entry[f"step_mlx_{key}"] = median_ms(
                    lambda: ref(False)[0], args.repeats
                )
                entry[f"step_fused_{key}"] = median_ms(
                    lambda: fast(False)[0], args.repeats
                )
                entry[f"chain_mlx_{key}"] = median_ms(lambda: chain(ref), args.repeats)
                entry[f"chain_fused_{key}"] = median_ms(
                    lambda: chain(fast), args.repeats
                )
                entry[f"round_fused_{key}"] = median_ms(
                    lambda: fused_round()(
                        window_ids, raw, ones, starts, keys, values, seeds, steps
                    )[0],
                    args.repeats,
                )
                print(f"rows {rows} {key}: done", flush=True)
        for kind in ("step", "chain", "chain10", "round"):
            for impl in ("mlx", "fused", "launch"):
                for label in ("greedy", "qwen"):
                    full = entry.get(f"{kind}_{impl}_full_{label}")
                    fr = entry.get(f"{kind}_{impl}_fr_{label}")
                    if full and fr:
                        entry[f"cut_{kind}_{impl}_{label}"] = round(full / fr, 3)
        entry["barrier_failures"] = {n: f.failures() for n, (_, f) in heads.items()}
        return entry

    for rows in [int(r) for r in args.rows.split(",")]:
        entry = measure(rows)
        report["rows"].append(entry)
        print(
            json.dumps({k: v for k, v in entry.items() if not k.startswith("agree")}),
            flush=True,
        )
        for k, v in entry.items():
            if k.startswith("agree"):
                print(k, json.dumps(v), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
