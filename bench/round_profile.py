"""Where a two-model round's time goes, against a plain step, on this machine.

Runs plain decoding and two-model drafting at one width over one prompt,
with the loop's phase timing on (draft / verify / sample / commit, each phase
synchronised), and times every draft forward on its own (the draft model is
wrapped to evaluate each forward's hidden states as it returns). Reports ms
per round by phase, draft forwards per round and ms per forward, and how a
round compares with the same number of plain steps, so the cost outside the
forwards (sampling, the walk, commits, host reads) shows.

    python bench/round_profile.py --prompt code --width 6 \\
        --draft-vocab bench/results/draft_vocab_stdlib_32k.json \\
        --out bench/results/round-profile-cpu.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import PROMPTS, machine_info, model_folder, specpipe_run, write_json


class TimedModel:
    """The draft model; each forward is evaluated and timed as it returns."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.times: list[tuple[int, float]] = []  # (window width, ms)

    def __call__(self, ids: Any, *args: Any, **kwargs: Any) -> Any:
        import mlx.core as mx

        t0 = time.perf_counter()
        out = self.model(ids, *args, **kwargs)
        mx.eval(out.hidden)
        self.times.append((int(ids.shape[1]), (time.perf_counter() - t0) * 1000.0))
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt", default="code")
    parser.add_argument("--width", type=int, default=6)
    parser.add_argument("--staged", choices=("on", "off"), default="on")
    parser.add_argument(
        "--draft-dtype", default=None, help="the draft's dtype (default: --dtype)"
    )
    parser.add_argument("--draft-vocab", help="an FR-Spec list for the draft")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    from attrs import evolve

    import specpipe
    from bindings.registry import DraftLoadRequest
    from schemas.request import DraftPolicy, GenerationLimits, SamplingParams

    target_folder = model_folder(args.target, args.dtype)
    draft_folder = model_folder(args.draft, args.draft_dtype or args.dtype)
    base = specpipe.load(str(target_folder), dtype=args.dtype).unwrap()
    loaded = base.registry.load(
        "two-model",
        DraftLoadRequest(
            target=base.target,
            source=str(draft_folder),
            width=args.width,
            draft_vocab=args.draft_vocab,
            dtype=args.draft_dtype or args.dtype,
            policy=DraftPolicy(staged=args.staged == "on"),
        ),
    ).unwrap()
    timed = TimedModel(loaded.drafter.model)
    draft = evolve(loaded, drafter=evolve(loaded.drafter, model=timed))
    spec = evolve(base, draft=draft, adaptive=None, phase_timing=True)
    text, chat = PROMPTS[args.prompt]
    ids = list(base.encode(text, chat).unwrap())
    specpipe_run(base, ids, 4, "warm-up plain")
    specpipe_run(spec, ids, 4, "warm-up spec")

    plain = specpipe_run(base, ids, args.tokens, "plain")
    timed.times.clear()
    result = spec.generate(
        ids, SamplingParams(), GenerationLimits(max_tokens=args.tokens)
    ).unwrap()
    run = result.stats
    assert list(result.tokens) == plain.tokens, (
        "two-model output differs from plain decoding"
    )
    rounds = run.rounds
    phases = dict(run.phase_ms)
    plain_ms = 1000.0 / plain.decode_tps
    by_width: dict[int, list[float]] = {}
    for width, ms in timed.times:
        by_width.setdefault(width, []).append(ms)
    report: dict[str, Any] = {
        "machine": machine_info(),
        "args": vars(args) | {"out": str(args.out)},
        "plain_ms_per_token": plain_ms,
        "rounds": rounds,
        "tokens_per_round": len(result.tokens) / rounds,
        "ms_per_round": run.ms_per_round,
        "phase_ms_per_round": {k: v / rounds for k, v in phases.items()},
        "draft_forwards_per_round": len(timed.times) / rounds,
        "draft_forward_ms_by_width": {
            w: {"count": len(t), "median": statistics.median(t)}
            for w, t in sorted(by_width.items())
        },
        "draft_forward_ms_per_round": sum(ms for _, ms in timed.times) / rounds,
        "round_in_plain_steps": run.ms_per_round / plain_ms,
        "speedup": run.tokens_per_second / plain.decode_tps,
    }
    for key, value in report.items():
        if key not in ("machine", "args"):
            print(f"{key}: {value}")
    write_json(args.out, report)


if __name__ == "__main__":
    main()
