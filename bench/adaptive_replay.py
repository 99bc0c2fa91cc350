"""Adaptive drafting replayed offline over recorded greedy decodes.

For greedy decoding the target keeps the longest prefix of a window's drafts
that equals its own output, and a draft model's greedy draft for a position
whose prefix the target wrote is the draft's prediction over that prefix. So
one forward of the draft model over prompt + recorded output (teacher
forcing) tells how many drafts any round would keep, at any depth, from any
position: the run of consecutive positions where the draft predicts the
target's token. With the cost of a round at each depth (as a run measured
them, `--costs`), this replays fixed widths and the adaptive chooser of
`specpipe.adaptive` round by round in milliseconds instead of minutes, to
compare chooser settings on the same acceptance pattern.

What it leaves out: a staged draft's forward count varies with its guesses
(the measured cost per depth stands for it), and the loop's scheduling of
plain bursts is reduced to its decisions (time plain first when it decides,
plain steps up to the next probe when gated). Window-vs-token rounding of
the draft may flip a near-tied prediction; a replay's fixed-width tokens per
round is printed next to the recorded run's to show the agreement.

    python bench/adaptive_replay.py --json bench/results/adaptive-cpu-staged.json \\
        --draft-vocab bench/results/draft_vocab_stdlib_32k.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from attrs import evolve

from specpipe.adaptive import AdaptivePolicy, CostModel, ObservedCosts, RowAdaptation

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import recorded_decode

PLAIN_TIMING_STEPS = 4  # as specpipe/loop.py


def kept_runs(
    draft: Any, subset: Any, prompt: Sequence[int], output: Sequence[int]
) -> list[int]:
    """`runs[i]`: how many drafts in a row, starting at output[i], the draft
    predicts right when fed the target's own tokens."""
    import mlx.core as mx  # after `specpipe` (imported above) routed the BLAS

    ids = mx.array([list(prompt) + list(output)], dtype=mx.int32)
    out = draft(ids, draft.make_cache(1), [0])
    hidden = out.hidden[:, len(prompt) - 1 : -1]
    if subset is None:
        predicted = mx.argmax(draft.lm_head(hidden), axis=-1)
    else:
        predicted = mx.take(
            subset.ids, mx.argmax(subset.project(draft.final_norm(hidden)), axis=-1)
        )
    hits = [int(p) == t for p, t in zip(predicted[0].tolist(), output, strict=True)]
    runs = [0] * (len(output) + 1)
    for i in range(len(output) - 1, -1, -1):
        runs[i] = runs[i + 1] + 1 if hits[i] else 0
    return runs[:-1]


def replay_fixed(
    runs: Sequence[int], width: int, rounds_ms: Sequence[float]
) -> dict[str, float]:
    done = rounds = 0
    ms = 0.0
    n = len(runs)
    while done < n:
        depth = min(width, n - done - 1)
        kept = min(runs[done], depth)
        done += kept + 1
        ms += rounds_ms[depth] if depth else rounds_ms[0]
        rounds += 1
    return {"ms": ms, "rounds": rounds, "tokens_per_round": n / rounds}


def replay_adaptive(
    runs: Sequence[int],
    policy: AdaptivePolicy,
    max_depth: int,
    rounds_ms: Sequence[float],
) -> dict[str, Any]:
    """The row's choices with in-run costs equal to `rounds_ms` (one row)."""
    n = len(runs)
    row = RowAdaptation()
    costs = ObservedCosts(policy.cost)
    done = 0
    ms = 0.0
    depths: Counter[int] = Counter()

    def plain(steps: int) -> None:
        nonlocal done, ms
        for _ in range(steps):
            costs.observe(0, rounds_ms[0], 1)
        row.decoded_plainly(steps)
        done += steps
        ms += steps * rounds_ms[0]
        depths[0] += steps

    while done < n:
        cap = min(max_depth, n - done - 1)
        if costs.plain_unmeasured(1) and row.plain_decides(
            policy, costs.rounds(max_depth)
        ):
            plain(min(PLAIN_TIMING_STEPS, n - done))
            continue
        depth = min(
            row.choose(policy, max_depth, costs.rounds(max_depth), costs.measured()),
            cap,
        )
        if depth == 0:
            wait = row.steps_to_probe()
            plain(min(wait if wait is not None else n, n - done))
            continue
        kept = min(runs[done], depth)
        costs.observe(depth, rounds_ms[depth], 1)
        row.observe(depth, kept, policy)
        done += kept + 1
        ms += rounds_ms[depth]
        depths[depth] += 1
    return {"ms": ms, "depths": dict(sorted(depths.items()))}


def measured_rounds(block: dict[str, Any], max_depth: int) -> list[float]:
    """ms per round by depth from a recorded run's fixed widths (plain at 0),
    linear between measured widths, extended by the last slope."""
    known = {0: block["plain"]["specpipe"]["ms_per_round"]}
    for r in block["runs"]:
        if r["library"] == "specpipe" and r["method"] == "fixed":
            known[r["width"]] = r["ms_per_round"]
    xs = sorted(known)
    out = []
    for d in range(max_depth + 1):
        if d in known:
            out.append(known[d])
            continue
        lo = max((x for x in xs if x < d), default=xs[0])
        hi = min((x for x in xs if x > d), default=None)
        if hi is None:  # past the widest: the last slope
            a, b = xs[-2], xs[-1]
            out.append(known[b] + (known[b] - known[a]) / (b - a) * (d - b))
        else:
            out.append(known[lo] + (known[hi] - known[lo]) * (d - lo) / (hi - lo))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--json", type=Path, required=True, help="an adaptive.py result file"
    )
    parser.add_argument("--prompts", default="code,chat,prose")
    parser.add_argument("--draft-vocab", help="the FR-Spec list the run's draft used")
    parser.add_argument("--max-depth", type=int, default=6)
    parser.add_argument("--widths", default="1,2,3,4,5,6")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="an AdaptivePolicy field for a variant (repeatable; each --set is one variant)",
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    import specpipe
    from models.tokenizer import Tokenizer
    from specpipe.draft_vocab import DraftVocabulary, SubsetHead

    data = json.loads(args.json.read_text())
    tokenizer = Tokenizer.from_folder(Path(data["target"])).unwrap()
    draft = specpipe.load(data["draft"], dtype=data["dtype"]).unwrap().target.model
    subset = None
    if args.draft_vocab:
        vocab = DraftVocabulary.read(
            Path(args.draft_vocab), draft.args.vocab_size
        ).unwrap()
        subset = SubsetHead.of(draft, vocab)
    prior = CostModel(
        **{
            k: tuple(v) if isinstance(v, list) else v
            for k, v in data["cost_model"].items()
        }
    )
    base = AdaptivePolicy(
        prior,
        **{
            k: v
            for k, v in data.get("policy", {}).items()
            if k in AdaptivePolicy.__attrs_attrs__.__dict__ and k != "cost"
        },
    )
    variants: dict[str, AdaptivePolicy] = {"defaults": base}
    for spec in args.set:
        changes: dict[str, Any] = {}
        for part in spec.split(","):
            key, value = part.split("=")
            current = getattr(base, key)
            if isinstance(current, bool):
                changes[key] = value.lower() in ("1", "true", "yes", "on")
            else:
                changes[key] = type(current)(
                    float(value) if isinstance(current, float) else value
                )
        variants[spec] = evolve(base, **changes)
    widths = [int(w) for w in args.widths.split(",")]
    report: dict[str, Any] = {"source": str(args.json), "prompts": {}}
    for name in args.prompts.split(","):
        prompt, output = recorded_decode(tokenizer, data, name)
        block = data["prompts"][name]
        runs = kept_runs(draft, subset, prompt, output)
        rounds_ms = measured_rounds(block, args.max_depth)
        plain_ms = len(output) * rounds_ms[0]
        recorded = {
            r["width"]: r["acceptance_length"]
            for r in block["runs"]
            if r["library"] == "specpipe" and r["method"] == "fixed"
        }
        entry: dict[str, Any] = {"rounds_ms": rounds_ms, "fixed": {}, "adaptive": {}}
        print(f"\n{name}: round ms by depth {[round(x) for x in rounds_ms]}")
        for w in widths:
            f = replay_fixed(runs, w, rounds_ms)
            entry["fixed"][w] = {**f, "speedup": plain_ms / f["ms"]}
            rec = recorded.get(w)
            print(
                f"  fixed k={w}: x{plain_ms / f['ms']:.2f}  {f['tokens_per_round']:.2f} tokens/round"
                + (f" (recorded {rec:.2f})" if rec else "")
            )
        best = max(e["speedup"] for e in entry["fixed"].values())
        for label, policy in variants.items():
            a = replay_adaptive(runs, policy, args.max_depth, rounds_ms)
            gain = plain_ms / a["ms"]
            entry["adaptive"][label] = {
                **a,
                "speedup": gain,
                "of_best_fixed": gain / best,
            }
            print(
                f"  adaptive [{label}]: x{gain:.2f} ({gain / best:.1%} of best fixed) depths {a['depths']}"
            )
        report["prompts"][name] = entry
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
