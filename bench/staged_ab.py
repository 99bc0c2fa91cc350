"""Staged against unstaged two-model drafting, interleaved and repeated.

Staging (DraftPolicy.staged, specpipe/drafts/two_model.py) proposes the same
drafts as the plain draft chain in fewer draft forwards; whether that is
faster depends on how much a wider draft forward costs over a one-token one.
On a shared machine one run of each is within the noise, so this alternates
the two, `--repeats` times per prompt and width, and reports the median
tokens per second, the draft forwards per round (counted, deterministic) and
whether every output equals plain decoding (greedy).

    python bench/staged_ab.py --prompts code,chat,edit --widths 4,6,8 --repeats 3 \\
        --draft-vocab bench/results/draft_vocab_stdlib_32k.json \\
        --out bench/results/staged-ab-cpu.json

`--draft-dtype bfloat16` runs the draft on the bf16 CPU kernel
(models/cpu_kernel.py); `--plain-each-repeat` decodes plainly again in every
repeat, so the speedups divide by the median of interleaved plain runs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    PROMPTS,
    RESULTS,
    machine_info,
    model_folder,
    specpipe_run,
    write_json,
)


class CountingModel:
    """The draft model, counting its forwards (no synchronisation added)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.forwards = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.forwards += 1
        return self.model(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompts", default="code,chat,edit")
    parser.add_argument("--widths", default="4,6,8")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--plain-each-repeat",
        action="store_true",
        help="decode plainly again in every repeat (interleaved); speedups "
        "then divide by the median of all plain runs",
    )
    parser.add_argument("--draft-vocab", help="an FR-Spec list for the draft")
    parser.add_argument(
        "--draft-dtype", default=None, help="the draft's dtype (default: --dtype)"
    )
    parser.add_argument("--out", default=str(RESULTS / "staged-ab.json"))
    args = parser.parse_args()

    from attrs import evolve

    import specpipe
    from bindings.registry import DraftLoadRequest
    from schemas.request import DraftPolicy

    target_folder = model_folder(args.target, args.dtype)
    draft_dtype = args.draft_dtype or args.dtype
    draft_folder = model_folder(args.draft, draft_dtype)
    base = specpipe.load(str(target_folder), dtype=args.dtype).unwrap()
    drafts: dict[str, Any] = {}
    counters: dict[str, CountingModel] = {}
    for name, staged in (("staged", True), ("unstaged", False)):
        loaded = base.registry.load(
            "two-model",
            DraftLoadRequest(
                target=base.target,
                source=str(draft_folder),
                width=1,
                draft_vocab=args.draft_vocab,
                dtype=draft_dtype,
                policy=DraftPolicy(staged=staged),
            ),
        ).unwrap()
        counters[name] = CountingModel(loaded.drafter.model)
        drafter = evolve(loaded.drafter, model=counters[name])
        drafts[name] = evolve(loaded, drafter=drafter)
    warm = list(base.encode("def f(x):", False).unwrap())
    specpipe_run(base, warm, 4, "plain")
    for name in drafts:
        specpipe_run(evolve(base, draft=evolve(drafts[name], width=4)), warm, 4, name)

    payload: dict[str, Any] = {
        "machine": machine_info(),
        "target": str(target_folder),
        "draft": str(draft_folder),
        "dtype": args.dtype,
        "draft_dtype": draft_dtype,
        "max_tokens": args.tokens,
        "draft_vocab": args.draft_vocab,
        "repeats": args.repeats,
        "prompts": {},
    }
    for prompt in args.prompts.split(","):
        text, chat = PROMPTS[prompt]
        ids = list(base.encode(text, chat).unwrap())
        reference = specpipe_run(base, ids, args.tokens, "plain")
        plain_tps = [reference.decode_tps]
        block: dict[str, Any] = {"plain_tps": reference.decode_tps, "widths": {}}
        payload["prompts"][prompt] = block
        for k in [int(w) for w in args.widths.split(",")]:
            seen: dict[str, dict[str, Any]] = {
                n: {"tps": [], "forwards": []} for n in drafts
            }
            for _ in range(args.repeats):
                if args.plain_each_repeat:
                    again = specpipe_run(base, ids, args.tokens, "plain")
                    assert again.tokens == reference.tokens
                    plain_tps.append(again.decode_tps)
                for name, draft in drafts.items():
                    counters[name].forwards = 0
                    run = specpipe_run(
                        evolve(base, draft=evolve(draft, width=k)),
                        ids,
                        args.tokens,
                        name,
                    )
                    assert run.tokens == reference.tokens, (
                        f"{prompt} k={k} {name}: differs from plain"
                    )
                    seen[name]["tps"].append(run.decode_tps)
                    seen[name]["forwards"].append(
                        counters[name].forwards - 1
                    )  # minus the prompt
                    seen[name]["rounds"] = run.rounds
                    seen[name]["tokens_per_round"] = run.acceptance_length
            plain_median = statistics.median(plain_tps)
            block["plain_tps_all"] = plain_tps
            block["plain_tps_median"] = plain_median
            entry = {
                name: {
                    "tps": s["tps"],
                    "median_tps": statistics.median(s["tps"]),
                    "speedup": statistics.median(s["tps"]) / plain_median,
                    "draft_forwards_per_round": statistics.median(s["forwards"])
                    / s["rounds"],
                    "tokens_per_round": s["tokens_per_round"],
                }
                for name, s in seen.items()
            }
            entry["staged_over_unstaged"] = (
                entry["staged"]["median_tps"] / entry["unstaged"]["median_tps"]
            )
            block["widths"][str(k)] = entry
            write_json(Path(args.out), payload)
            print(
                f"{prompt:5s} k={k:2d}: plain {plain_median:.3f} tok/s  staged {entry['staged']['median_tps']:.3f} tok/s "
                f"(x{entry['staged']['speedup']:.2f}, {entry['staged']['draft_forwards_per_round']:.2f} fwd/round)  "
                f"unstaged {entry['unstaged']['median_tps']:.3f} "
                f"(x{entry['unstaged']['speedup']:.2f}, {entry['unstaged']['draft_forwards_per_round']:.2f})  "
                f"staged/unstaged {entry['staged_over_unstaged']:.3f}  "
                f"{entry['staged']['tokens_per_round']:.2f} tokens/round",
                flush=True,
            )


if __name__ == "__main__":
    main()
