"""MTP drafting on a hybrid (Qwen3-Next-shaped) target with random weights:
plain decode vs `mtp` rounds, and the draft's cost per round with and
without an FR-Spec draft vocabulary.

Random weights make acceptance meaningless (a random head rarely agrees with
a random target), so this measures cost: ms per plain token, ms per MTP round
at each depth, and ms of the draft chain alone (full head vs an N-id list).
Outputs are still checked: every MTP run must equal plain decoding.

    python bench/mtp.py --layers 12 --experts 64 --out bench/results/mtp-cpu.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import models  # noqa: F401  before mlx: routes its BLAS (models/blas.py)

# isort: split

import mlx.core as mx
from attrs import evolve

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import machine_info, split_ms
from models.build import build_model, quantize_model
from models.fuse import fuse_projections
from models.mtp import MtpHead
from schemas.hf_hybrid import hybrid_args
from schemas.request import DraftPolicy, SamplingParams
from specpipe.draft_vocab import DraftVocabulary
from specpipe.drafts.mtp import MtpDrafter
from specpipe.loop import RoundOptions, RowRequest, generate_rows
from specpipe.output import TopLogprobs
from specpipe.precision import prefer_exact_float32
from specpipe.prefill import prefill_rows
from specpipe.state import RowState


def qwen3_next_shape(
    layers: int, experts: int, hidden: int, vocab: int
) -> dict[str, Any]:
    """Qwen3-Next-80B-A3B per-layer shapes (3 linear : 1 full attention),
    with `layers` layers and `experts` routed experts (top-10 active, so the
    per-token expert compute is the real one)."""
    return {
        "model_type": "qwen3_next",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": 5120,
        "num_hidden_layers": layers,
        "full_attention_interval": 4,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "num_experts": experts,
        "num_experts_per_tok": min(10, experts),
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "partial_rotary_factor": 0.25,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
    }


def qwen3_5_27b_shape(
    layers: int, experts: int, hidden: int, vocab: int
) -> dict[str, Any]:
    """Qwen3.5-27B (dense hybrid: 3 linear : 1 full attention, gated
    attention, one dense MTP layer), with `layers` target layers; `experts`
    and `hidden` are ignored (the real hidden size is 5120)."""
    del experts, hidden
    return {
        "model_type": "qwen3_5_text",
        "vocab_size": vocab,
        "hidden_size": 5120,
        "intermediate_size": 17408,
        "num_hidden_layers": layers,
        "full_attention_interval": 4,
        "num_attention_heads": 24,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 48,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "attn_output_gate": True,
        "mtp_num_hidden_layers": 1,
        "partial_rotary_factor": 0.25,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
    }


SHAPES = {"qwen3-next": qwen3_next_shape, "qwen3.5-27b": qwen3_5_27b_shape}


def random_target_and_head(
    shape: str,
    layers: int,
    experts: int,
    hidden: int,
    vocab: int,
    dtype: mx.Dtype,
    quantize: int = 0,
    fuse: bool = True,
) -> tuple[dict[str, Any], Any, MtpHead]:
    """A random hybrid target of `shape` and its MTP head (seed 0), in
    `dtype`, the target quantized to `quantize` bits if asked, q/k/v and
    gate/up fused as specpipe.load and build_mtp do unless `fuse` is off."""
    config = SHAPES[shape](layers, experts, hidden, vocab)
    hybrid = hybrid_args(config, "bench").unwrap()
    mx.random.seed(0)
    model = build_model(hybrid).unwrap()
    model.set_dtype(dtype)
    if quantize:
        quantize_model(model, quantize, 64)
    mx.eval(model.parameters())
    head = MtpHead(hybrid)
    head.set_dtype(dtype)
    mx.eval(head.parameters())
    if fuse:
        fuse_projections(model)
        fuse_projections(head)
    return config, model, head


def bench_prompt(vocab: int) -> tuple[int, ...]:
    """The MTP benchmarks' 48-token random prompt."""
    return tuple(
        int(t)
        for t in mx.random.randint(0, vocab, (48,), key=mx.random.key(1)).tolist()
    )


def fr_list(vocab: int, size: int) -> DraftVocabulary:
    """The MTP benchmarks' FR-Spec list: `size` random ids of `vocab`."""
    ids = sorted(mx.random.permutation(vocab, key=mx.random.key(2))[:size].tolist())
    return DraftVocabulary.create(ids, vocab).unwrap()


class Sink:
    def __init__(self) -> None:
        self.tokens: list[int] = []

    def push(self, token: int, logprob: float | None, top: TopLogprobs = ()) -> bool:
        self.tokens.append(token)
        return True


SAMPLINGS = {
    "greedy": SamplingParams(),
    # Qwen's recommended sampling for its instruct models: the draft samples
    # with the same filters (coupled draw), so top-k/top-p run over its vocabulary
    "qwen": SamplingParams(temperature=0.7, top_p=0.8, top_k=20, seed=0),
}


def generate(
    model: Any,
    prompt: tuple[int, ...],
    n: int,
    drafter: Any,
    depth: int,
    sampling: SamplingParams = SAMPLINGS["greedy"],
) -> tuple[list[int], Any, float]:
    """One row: its tokens, its result and the run's seconds."""
    tokens, results, seconds = generate_rows_of(
        model, [prompt], n, drafter, depth, sampling
    )
    return tokens[0], results[0], seconds


def generate_rows_of(
    model: Any,
    prompts: list[tuple[int, ...]],
    n: int,
    drafter: Any,
    depth: int,
    sampling: SamplingParams,
    ahead: bool = False,
) -> tuple[list[list[int]], list[Any], float]:
    """Every prompt as one batch of rows: each row's tokens and result, and
    the run's seconds."""
    sinks = [Sink() for _ in prompts]
    start = time.perf_counter()
    results = generate_rows(
        model,
        [
            RowRequest(p, sampling, n, sink)
            for p, sink in zip(prompts, sinks, strict=True)
        ],
        (),
        drafter,
        RoundOptions(depth=depth, draft_ahead=ahead),
    )
    mx.synchronize()
    return [sink.tokens for sink in sinks], results, time.perf_counter() - start


def write_report(report: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))


def ahead_pairs(
    model: Any,
    prompt: tuple[int, ...],
    n: int,
    drafter: Any,
    depth: int,
    sampling: SamplingParams,
    repeats: int,
    rows: int = 1,
) -> dict[str, Any]:
    """MTP decoding of `rows` rows (row b's prompt rotated by b) with the next
    round's drafts launched before the host read (`RoundOptions.draft_ahead`)
    and without, in alternation: the median ms per round of each (over every
    round of every run but its first), whether their tokens are the same, and
    whether they are plain decoding's."""
    prompts = [prompt[b:] + prompt[:b] for b in range(rows)]
    plain, _, _ = generate_rows_of(model, prompts, n, None, 0, sampling)
    rounds: dict[bool, list[float]] = {False: [], True: []}
    outputs: dict[bool, list[list[int]]] = {}
    generate_rows_of(model, prompts, 4, drafter, depth, sampling, True)  # warm-up
    for _ in range(repeats):
        for ahead in (False, True):
            tokens, results, _ = generate_rows_of(
                model, prompts, n, drafter, depth, sampling, ahead
            )
            rounds[ahead].extend(
                results[0].round_ms[1:]
            )  # (the first: the prompt's tail)
            outputs.setdefault(ahead, tokens)
            if outputs[ahead] != tokens:
                outputs[ahead] = []  # not reproducible run to run
    off, on = statistics.median(rounds[False]), statistics.median(rounds[True])
    return {"depth": depth, "rows": rows, "off_ms_per_round": off, "ahead_ms_per_round": on,
            "cut": off / on, "rounds": len(rounds[True]),
            "same_tokens": outputs[False] == outputs[True] != [],
            "ahead_equals_plain": outputs[True] == plain,
            "off_equals_plain": outputs[False] == plain,
            "first_difference": {name: [_first_difference(a, b) for a, b in zip(got, plain, strict=True)]
                                 for name, got in (("off", outputs[False]), ("ahead", outputs[True]))
                                 if got}}  # fmt: skip


def _first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two token lists differ (None: equal)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                None if len(a) == len(b) else min(len(a), len(b)))  # fmt: skip


def opened_rows(
    drafter: Any,
    model: Any,
    prompt: tuple[int, ...],
    depth: int,
    sampling: Any,
    batch: int,
    craft: bool = False,
) -> tuple[Any, list[Any]]:
    """`batch` rows (row b's prompt rotated by b) after a prefill and two real
    rounds: the prompt's (its long tail drafts op by op), then one through
    the fused kernel, which leaves the rows a device chain: later proposals
    derive their inputs on the device (`MtpRows.chain`, where the kernel
    takes the round), as in steady-state decoding. The draws are the target's greedy ones; `craft`: row b's first
    draws are set to its drafts instead (a row accepts all its drafts; rows
    1, 0, 1, ...), to check the device's derivation with."""
    rows = [RowState.start(prompt[b:] + prompt[:b], 64, sampling) for b in range(batch)]
    cache, hidden = prefill_rows(model, rows, keep_hidden=True)
    opened = drafter.open(rows, hidden)
    for round_ in range(2):
        proposal = opened.propose(rows, depth)
        assert proposal.device is not None
        pending = mx.array([[row.pending] for row in rows], dtype=mx.int32)
        window = mx.concatenate([pending, proposal.device], axis=1)
        verified = model(window, cache, [row.length for row in rows])
        draws = mx.argmax(verified.logits, axis=-1).astype(mx.int32)
        drafts = [tuple(r) for r in proposal.device.tolist()]
        if craft and round_ == 1:
            # one row: every draft accepted; more: 1, 0, 1, ... (tails of 2
            # positions at most, in the kernel's 8 window positions)
            k = [depth] if batch == 1 else [(b + 1) % 2 for b in range(batch)]
            keep = mx.array(
                [[i < k[b] for i in range(depth + 1)] for b in range(batch)]
            )
            padded = mx.pad(proposal.device, [(0, 0), (0, 1)])
            draws = mx.where(keep, padded, draws)
        host = draws.tolist()
        accepted = []
        for d, t in zip(drafts, host, strict=True):
            a = 0
            while a < len(d) and d[a] == t[a]:
                a += 1
            accepted.append(a)
        opened = opened.prepare_commit(
            rows, proposal, drafts, accepted, evolve(verified, draws=draws)
        ).commit()
        if verified.delta is not None:
            verified.delta.commit([a + 1 for a in accepted])
        rows = [
            row.advanced(tuple(t[: a + 1]))
            for row, t, a in zip(rows, host, accepted, strict=True)
        ]
    return opened, rows


def propose_ms(opened: Any, rows: list[RowState], depth: int) -> float:
    """ms of one `propose` plus the evaluation of its tokens (the head's KV
    writes are scratch: the rows' state does not move)."""
    start = time.perf_counter()
    proposal = opened.propose(rows, depth)
    assert proposal.device is not None
    mx.eval(proposal.device)
    return (time.perf_counter() - start) * 1000.0


def draft_chain_ms(
    drafter: MtpDrafter,
    model: Any,
    prompt: tuple[int, ...],
    depth: int,
    repeats: int,
    sampling: SamplingParams = SAMPLINGS["greedy"],
    batch: int = 1,
) -> float:
    """The draft chain alone for `batch` rows (`opened_rows`), median ms of
    `propose` + evaluation over `repeats` after one untimed."""
    opened, rows = opened_rows(drafter, model, prompt, depth, sampling, batch)
    propose_ms(opened, rows, depth)
    return statistics.median(propose_ms(opened, rows, depth) for _ in range(repeats))


def interleaved_cuts(
    drafters: dict[str, MtpDrafter],
    model: Any,
    prompt: tuple[int, ...],
    depths: list[int],
    repeats: int,
    sampling: SamplingParams,
    batch: int,
) -> list[dict[str, Any]]:
    """The draft chains of `drafters` ("full" and an FR-Spec one) timed in
    alternation, each repeat every depth and both drafters in a shuffled
    order, so that drifts of the machine (clocks, other load) fall on both
    alike: per depth the median ms of each, the cut (ratio of the medians)
    and the median of the per-repeat ratios."""
    opened = {
        n: opened_rows(d, model, prompt, max(depths), sampling, batch)
        for n, d in drafters.items()
    }
    for (o, rows), depth in ((o, d) for o in opened.values() for d in depths):
        propose_ms(o, rows, depth)  # compiles and first launches
        propose_ms(o, rows, depth)
    order = random.Random(0)
    times: dict[tuple[str, int], list[float]] = {
        (n, d): [] for n in drafters for d in depths
    }
    for _ in range(repeats):
        for depth in depths:
            names = list(drafters)
            order.shuffle(names)
            for name in names:
                times[(name, depth)].append(propose_ms(*opened[name], depth))
    fr = next(n for n in drafters if n != "full")
    # where a round's draft time goes: building its graph (Python), encoding
    # it for the device, waiting for the device
    splits = {
        (n, d): split_ms(lambda o=opened[n], d=d: o[0].propose(o[1], d).device, repeats)
        for n in drafters
        for d in depths
    }
    return [
        {
            "depth": depth,
            "rows": batch,
            "repeats": repeats,
            "full_ms": statistics.median(times[("full", depth)]),
            "fr_ms": statistics.median(times[(fr, depth)]),
            "cut": statistics.median(times[("full", depth)])
            / statistics.median(times[(fr, depth)]),
            "paired_cut_median": statistics.median(
                a / b
                for a, b in zip(times[("full", depth)], times[(fr, depth)], strict=True)
            ),
            "full_ms_quartiles": statistics.quantiles(times[("full", depth)], n=4),
            "fr_ms_quartiles": statistics.quantiles(times[(fr, depth)], n=4),
            "full_split_ms": splits[("full", depth)],
            "fr_split_ms": splits[(fr, depth)],
        }
        for depth in depths
    ]


def round_fit(entries: list[dict[str, Any]]) -> dict[str, float]:
    """Least-squares lines ms = fixed + depth * step through the full and FR
    heads' median draft ms at each depth (`interleaved_cuts` entries), the
    cut of their per-step slopes, and the depth from which the lines' ratio
    is 2x or more (inf where the per-step cut is 2x or less)."""
    depths = [e["depth"] for e in entries]
    fit = {}
    for head in ("full", "fr"):
        slope, fixed = statistics.linear_regression(
            depths, [e[f"{head}_ms"] for e in entries]
        )
        fit[f"{head}_step_ms"], fit[f"{head}_fixed_ms"] = slope, fixed
    fit["step_cut"] = fit["full_step_ms"] / fit["fr_step_ms"]
    # full(d) >= 2 fr(d)  <=>  d (s_full - 2 s_fr) >= 2 F_fr - F_full
    gain = fit["full_step_ms"] - 2 * fit["fr_step_ms"]
    need = 2 * fit["fr_fixed_ms"] - fit["full_fixed_ms"]
    fit["depth_for_2x"] = need / gain if gain > 0 else float("inf")
    return fit


def chain_or_error(*args: Any) -> float | str:
    """`draft_chain_ms`, or the error it raised (recorded; the run goes on)."""
    try:
        return draft_chain_ms(*args)
    except Exception as exc:  # recorded; the run goes on
        return f"{type(exc).__name__}: {exc}"


def set_switches(args: argparse.Namespace) -> None:
    """models.mtp_cuda's switches as --whole-round / --kernel-switches ask."""
    import models.mtp_cuda

    if args.whole_round:
        models.mtp_cuda.WHOLE_ROUND = True
    apply_switches(args.kernel_switches)


def switches_parser(doc: str | None) -> argparse.ArgumentParser:
    """A script's parser (its docstring as the description) with
    `--switches`, the comma-separated kernel switches `apply_switches` takes."""
    parser = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--switches", default="", help="comma-separated NAME (on) / -NAME (off)"
    )
    return parser


def apply_switches(text: str) -> None:
    """models.mtp_cuda's switches from comma-separated NAME (on) / -NAME (off),
    and its integer settings from NAME=VALUE (BLOCKS=132, DRAW_HEADS_K=2)."""
    import models.mtp_cuda

    for switch in filter(None, text.split(",")):
        name, _, value = switch.partition("=")
        if value:
            current = getattr(models.mtp_cuda, name, None)
            assert type(current) is int, f"no integer setting {name}"
            setattr(models.mtp_cuda, name, int(value))
            continue
        name = switch.lstrip("-")
        assert isinstance(getattr(models.mtp_cuda, name, None), bool), (
            f"no switch {name}"
        )
        setattr(models.mtp_cuda, name, not switch.startswith("-"))


def main() -> None:
    # float32 outputs are checked against plain decoding: full-float32 products
    # unless the environment chose (README "Exactness", specpipe/precision.py)
    prefer_exact_float32()
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default="qwen3-next",
        help="qwen3-next: 64-expert MoE layers and MTP layer; qwen3.5-27b: "
        "Qwen3.5-27B's dense layers and MTP layer (hidden 5120)",
    )
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument(
        "--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"]
    )
    parser.add_argument(
        "--quantize", type=int, default=0, help="4 or 8 to quantize the target"
    )
    parser.add_argument("--depths", default="1,2,3")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--fr-size", type=int, default=32768)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--sampling", choices=sorted(SAMPLINGS), default="greedy")
    parser.add_argument(
        "--no-fuse",
        action="store_true",
        help="keep q/k/v and gate/up as separate products (as before models/fuse.py)",
    )
    parser.add_argument(
        "--rows",
        default="1",
        help="batch sizes for the draft-chain timing, e.g. 1,8,32",
    )
    parser.add_argument(
        "--eager-sampling",
        action="store_true",
        help="sample without compiling the draw (specpipe.sampling.COMPILE_ON_GPU)",
    )
    parser.add_argument(
        "--top-k-stages",
        choices=("auto", "one"),
        default="auto",
        help="one: top-k by one partition of the whole row (before blockwise "
        "top-k; specpipe.sampling.top_k_ids)",
    )
    parser.add_argument(
        "--steps",
        default="eager,compiled",
        help="draft step modes to compare: eager (op by op), compiled "
        "(specpipe.drafts.mtp.HeadStep's MLX step) and/or fused (the "
        "one-kernel step of models/mtp_cuda.py where in scope, the CUDA default)",
    )
    parser.add_argument(
        "--whole-round",
        action="store_true",
        help="fused steps: a round's first and chained steps in one launch "
        "(models.mtp_cuda.WHOLE_ROUND, now the default; -WHOLE_ROUND in "
        "--kernel-switches turns it off)",
    )
    parser.add_argument(
        "--kernel-switches",
        default="",
        help="comma-separated models.mtp_cuda switches to turn on (NAME) or "
        "off (-NAME), e.g. PAIR_ROWS,-ATT_PIPE",
    )
    parser.add_argument(
        "--interleave",
        action="store_true",
        help="time only the draft chains, the full and the FR-Spec head in "
        "alternation (`interleaved_cuts`), per --steps mode and --rows",
    )
    parser.add_argument(
        "--no-generate",
        action="store_true",
        help="time the draft chains only (skip the MTP generations)",
    )
    parser.add_argument(
        "--no-window-kernel",
        action="store_true",
        help="run the hybrid layers' recurrence as MLX operations on a GPU "
        "(models.gated_delta.WINDOW_KERNEL_ON_GPU)",
    )
    parser.add_argument(
        "--draft-ahead",
        action="store_true",
        help="only MTP rounds with the next round's drafts launched before the host "
        "read and without, in alternation (RoundOptions.draft_ahead), at each "
        "of --rows",
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.top_k_stages == "one":
        import specpipe.sampling

        specpipe.sampling.TWO_STAGE_TOP_K_FROM = 1 << 30
    if args.no_window_kernel:
        import models.gated_delta

        models.gated_delta.WINDOW_KERNEL_ON_GPU = False
    if args.eager_sampling:
        import specpipe.sampling

        specpipe.sampling.COMPILE_ON_GPU = False

    config, model, head = random_target_and_head(
        args.shape,
        args.layers,
        args.experts,
        args.hidden,
        args.vocab,
        getattr(mx, args.dtype),
        args.quantize,
        fuse=not args.no_fuse,
    )
    prompt = bench_prompt(args.vocab)

    sampling = SAMPLINGS[args.sampling]
    generate(model, prompt, 4, None, 0, sampling)  # warm-up
    plain, plain_result, _ = generate(model, prompt, args.tokens, None, 0, sampling)
    report: dict[str, Any] = {
        "machine": machine_info(),
        "config": config,
        "dtype": args.dtype,
        "quantize": args.quantize,
        "sampling": args.sampling,
        "fused_projections": not args.no_fuse,
        "compiled_sampling": not args.eager_sampling,
        "window_kernel": not args.no_window_kernel,
        "top_k_stages": args.top_k_stages,
        "plain": {
            "tokens": len(plain),
            "decode_tps": len(plain) / plain_result.decode_seconds,
            "ms_per_token": 1000.0 * plain_result.decode_seconds / len(plain),
        },
        "mtp": [],
        "draft_chain": [],
    }
    vocab = fr_list(args.vocab, args.fr_size)
    modes = args.steps.split(",")
    report["steps"] = modes
    if args.draft_ahead:
        import models.mtp_cuda

        report["ahead"] = []
        for mode in modes:
            models.mtp_cuda.FUSED_ON_GPU = mode == "fused"
            set_switches(args)
            for name, listed in (("full", None), (f"fr{args.fr_size}", vocab)):
                drafter = MtpDrafter(
                    model, head, DraftPolicy(compiled=mode != "eager"), vocab=listed
                )
                for depth in [int(d) for d in args.depths.split(",")]:
                    for batch in [int(b) for b in args.rows.split(",")]:
                        entry = ahead_pairs(model, prompt, args.tokens, drafter, depth, sampling,
                                            args.repeats, batch)  # fmt: skip
                        report["ahead"].append({"steps": mode, "vocab": name, **entry})
                        print("AHEAD", json.dumps(report["ahead"][-1]), flush=True)
        write_report(report, args.out)
        return
    if args.interleave:
        import models.mtp_cuda

        report["interleaved"] = []
        for mode in modes:
            models.mtp_cuda.FUSED_ON_GPU = mode == "fused"
            set_switches(args)
            drafters = {
                name: MtpDrafter(
                    model, head, DraftPolicy(compiled=mode != "eager"), vocab=listed
                )
                for name, listed in (("full", None), (f"fr{args.fr_size}", vocab))
            }
            for batch in [int(b) for b in args.rows.split(",")]:
                for entry in interleaved_cuts(
                    drafters,
                    model,
                    prompt,
                    [int(d) for d in args.depths.split(",")],
                    args.repeats,
                    sampling,
                    batch,
                ):
                    report["interleaved"].append({"steps": mode, **entry})
                    print(
                        "INTERLEAVED", json.dumps(report["interleaved"][-1]), flush=True
                    )
                entries = [
                    e
                    for e in report["interleaved"]
                    if e["steps"] == mode and e["rows"] == batch
                ]
                if len(entries) > 1:
                    report.setdefault("interleaved_fits", []).append(
                        {"steps": mode, "rows": batch, **round_fit(entries)}
                    )
                    print("FIT", json.dumps(report["interleaved_fits"][-1]), flush=True)
        write_report(report, args.out)
        return
    for depth, (name, listed), mode in (
        (d, v, m)
        for d in [int(d) for d in args.depths.split(",")]
        for v in (("full", None), (f"fr{args.fr_size}", vocab))
        for m in modes
    ):
        import models.mtp_cuda

        models.mtp_cuda.FUSED_ON_GPU = mode == "fused"
        set_switches(args)
        drafter = MtpDrafter(
            model, head, DraftPolicy(compiled=mode != "eager"), vocab=listed
        )
        if not args.no_generate:
            tokens, result, _ = generate(
                model, prompt, args.tokens, drafter, depth, sampling
            )
            # bf16 on a GPU: a window's logits may differ from single-token
            # logits in the last bits, which flips near-tied argmaxes of random
            # weights; recorded, not hidden (see DESIGN, losslessness caveat)
            first_diff = next(
                (
                    i
                    for i, (a, b) in enumerate(zip(tokens, plain, strict=True))
                    if a != b
                ),
                None,
            )
            m = result.metrics
            report["mtp"].append(
                {
                    "depth": depth,
                    "vocab": name,
                    "steps": mode,
                    "rounds": m.rounds,
                    "acceptance_length": m.acceptance_length,
                    "ms_per_round": statistics.median(result.round_ms),
                    "decode_tps": len(tokens) / result.decode_seconds,
                    "identical_to_plain": first_diff is None,
                    "first_difference": first_diff,
                }
            )
        for batch in [int(b) for b in args.rows.split(",")]:
            report["draft_chain"].append(
                {
                    "depth": depth,
                    "vocab": name,
                    "steps": mode,
                    "rows": batch,
                    "ms": chain_or_error(
                        drafter, model, prompt, depth, args.repeats, sampling, batch
                    ),
                }
            )
        if not args.no_generate:
            print(json.dumps(report["mtp"][-1]), flush=True)
        for entry in report["draft_chain"][-len(args.rows.split(",")) :]:
            print(json.dumps(entry), flush=True)
    # the FR-Spec cut of the draft chain per step mode, depth and batch
    chains = {
        (e["steps"], e["depth"], e["rows"], e["vocab"]): e["ms"]
        for e in report["draft_chain"]
        if isinstance(e["ms"], float)
    }
    report["cuts"] = [
        {
            "steps": st,
            "depth": d,
            "rows": r,
            "full_ms": full,
            "fr_ms": chains[(st, d, r, f"fr{args.fr_size}")],
            "cut": full / chains[(st, d, r, f"fr{args.fr_size}")],
        }
        for (st, d, r, v), full in chains.items()
        if v == "full" and (st, d, r, f"fr{args.fr_size}") in chains
    ]
    for cut in report["cuts"]:
        print("CUT", json.dumps(cut), flush=True)
    write_report(report, args.out)
    print(json.dumps(report["plain"]))


if __name__ == "__main__":
    main()
