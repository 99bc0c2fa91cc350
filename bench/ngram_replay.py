"""Prompt lookup replayed offline over a recorded greedy decode.

For greedy decoding, whether a draft is accepted depends only on the
target's own output: the target keeps the longest prefix of the drafts that
equals what it writes next. So a plain decode recorded by `speculative.py`
(its `reference` run) tells, without running any model, how many tokens per
round prompt lookup would publish at each width, with and without the copy
cursor (specpipe/drafts/ngram.py). It is exact for the lookup itself (the
same `NgramRows` code runs), and counts rounds, not seconds: multiply by the
measured cost of a window to get time.

    python bench/ngram_replay.py --json bench/results/speculative-cpu-openblas.json --prompts edit,code,chat
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from models.tokenizer import Tokenizer
from schemas.request import SamplingParams
from specpipe.drafts.ngram import NO_CURSOR, NgramRows
from specpipe.state import RowState

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import recorded_decode


def replay(
    prompt: list[int],
    output: list[int],
    width: int,
    cursor: bool,
    min_n: int,
    max_n: int,
) -> dict[str, float]:
    """Rounds and tokens per round of lookup drafting `width` deep over `output`."""
    row = RowState.start(tuple(prompt), len(output), SamplingParams())
    state = NgramRows(min_n, max_n, (NO_CURSOR,), (0,))
    done = rounds = drafted = accepted = 0
    while done < len(output):
        proposal = state.propose([row], width)
        drafts = (proposal.host or ((),))[0][: len(output) - done - 1]
        kept = 0
        while kept < len(drafts) and drafts[kept] == output[done + kept]:
            kept += 1
        emitted = tuple(output[done : done + kept + 1])
        if cursor:
            state = state.prepare_commit(  # type: ignore[assignment]
                [row],
                proposal,
                (drafts,),
                [kept],
                None,  # type: ignore[arg-type]
            ).commit()
        row = row.advanced(emitted)
        done += len(emitted)
        rounds += 1
        drafted += len(drafts)
        accepted += kept
    return {
        "rounds": rounds,
        "tokens_per_round": len(output) / rounds,
        "drafted": drafted,
        "accepted": accepted,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--json", type=Path, required=True, help="a speculative.py result file"
    )
    parser.add_argument("--prompts", default="edit,code,chat")
    parser.add_argument("--widths", default="2,4,6,8,10,12")
    parser.add_argument(
        "--ngram-min", type=int, default=2, help="as the ngram kind's default"
    )
    parser.add_argument("--ngram-max", type=int, default=4)
    parser.add_argument(
        "--tokenizer", type=Path, help="the target folder, if not the recorded one"
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    data = json.loads(args.json.read_text())
    tokenizer = Tokenizer.from_folder(args.tokenizer or Path(data["target"])).unwrap()
    report: dict[str, Any] = {"source": str(args.json), "prompts": {}}
    for name in args.prompts.split(","):
        prompt, output = recorded_decode(tokenizer, data, name)
        rows = []
        for width in [int(w) for w in args.widths.split(",")]:
            for cursor in (False, True):
                result = replay(
                    prompt, output, width, cursor, args.ngram_min, args.ngram_max
                )
                rows.append({"width": width, "cursor": cursor, **result})
                print(
                    f"{name:5s} k={width:2d} {'cursor' if cursor else 'plain '}: "
                    f"{result['tokens_per_round']:.2f} tokens/round "
                    f"({result['rounds']} rounds, {result['accepted']}/{result['drafted']} accepted)"
                )
        report["prompts"][name] = {"output_tokens": len(output), "replay": rows}
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
