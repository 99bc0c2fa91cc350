"""Adaptive drafting vs plain decoding (or a fixed draft width, `--against K`),
as interleaved pairs: does a gated row cost anything over plain decoding, and
does an adaptive row keep up with a fixed width?

Where no depth can win (a draft step as dear as a target step, as with random
weights on the H200), adaptive drafting should be plain decoding. On a busy
shared machine a run of configurations in a fixed order mixes the machine's
slow spells into the comparison; here each pair runs plain and adaptive back
to back, in a random order per pair, and the figure is the median of the
per-pair ratios (plus best-of-N and medians of both sides).

    python bench/gate_ab.py --target T --draft D --pairs 15 --out bench/results/gate-ab.json
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import models  # noqa: F401  before mlx: routes its BLAS (models/blas.py)

# isort: split
from bench.common import PROMPTS, machine_info, model_folder, specpipe_run, write_json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompts", default="code,chat,prose")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--max-depth", type=int, default=6)
    parser.add_argument("--pairs", type=int, default=15)
    parser.add_argument(
        "--against",
        type=int,
        default=0,
        help="the baseline: 0 plain decoding, K a fixed draft width K",
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    from attrs import evolve

    import specpipe

    target = model_folder(args.target, args.dtype)
    draft = (
        args.draft
        if args.draft == "ngram"
        else str(model_folder(args.draft, args.dtype))
    )
    adaptive = specpipe.load(
        str(target),
        draft=draft,
        num_draft_tokens=args.max_depth,
        dtype=args.dtype,
        adaptive=True,
    ).unwrap()
    assert adaptive.adaptive is not None
    plain = evolve(adaptive, draft=None, adaptive=None)
    baseline = plain
    if args.against > 0:
        baseline = specpipe.load(
            str(target),
            draft=draft,
            num_draft_tokens=args.against,
            dtype=args.dtype,
            adaptive=False,
        ).unwrap()
    base = "plain" if args.against == 0 else f"fixed k={args.against}"
    pipes = {base: baseline, "adaptive": adaptive}
    started = time.perf_counter()
    rng = random.Random(0)
    payload: dict[str, Any] = {
        "machine": machine_info(),
        "target": str(target),
        "draft": draft,
        "tokens": args.tokens,
        "pairs": args.pairs,
        "against": base,
        "cost_model": str(adaptive.adaptive.cost),
        "prompts": {},
    }
    for prompt in args.prompts.split(","):
        text, chat = PROMPTS[prompt]
        ids = list(plain.encode(text, chat).unwrap())
        for name, pipe in pipes.items():  # warm-up
            specpipe_run(pipe, ids, 8, name)
        tps: dict[str, list[float]] = {base: [], "adaptive": []}
        ratios = []
        same = True
        reference: list[int] | None = None
        depths: dict[str, int] = {}
        for _ in range(args.pairs):
            order = [base, "adaptive"]
            rng.shuffle(order)
            got = {}
            for name in order:
                run = specpipe_run(pipes[name], ids, args.tokens, name)
                got[name] = run.decode_tps
                tps[name].append(run.decode_tps)
                if reference is None and name == base:
                    reference = run.tokens
                if reference is not None and run.tokens != reference:
                    same = False
                for d, n in run.extra.get("depths", {}).items():
                    depths[d] = depths.get(d, 0) + n
            ratios.append(got["adaptive"] / got[base])
        entry = {
            "baseline_tps": tps[base],
            "adaptive_tps": tps["adaptive"],
            "pair_ratios": ratios,
            "median_pair_ratio": statistics.median(ratios),
            "best_ratio": max(tps["adaptive"]) / max(tps[base]),
            "median_ratio": statistics.median(tps["adaptive"])
            / statistics.median(tps[base]),
            "adaptive_depths": depths,
            "outputs_equal": same,
        }
        payload["prompts"][prompt] = entry
        print(
            f"{prompt:5s} adaptive/{base}: median pair ratio {entry['median_pair_ratio']:.3f}, "
            f"best {entry['best_ratio']:.3f}, medians {entry['median_ratio']:.3f} "
            f"({base} median {statistics.median(tps[base]):.0f} tok/s), depths {depths}, "
            f"outputs equal: {same}",
            flush=True,
        )
        write_json(args.out, payload)
    payload["elapsed_s"] = time.perf_counter() - started
    write_json(args.out, payload)


if __name__ == "__main__":
    main()
