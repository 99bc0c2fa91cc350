"""Round order, host-first (drafts read back before the verify graph is built;
the default since commit 5acca65) vs device-first (one read per round), for
two-model rounds of the real 1.5B + 0.5B pair in bf16, code prompt, k=4,
32 tokens, in the order A B B A after a warm-up of each (options: another
pair, width, length, output file; e.g. the H200's random pair).

    python bench/round_order.py
    python bench/round_order.py --target /tmp/rand/qwen2.5-1.5b-bf16 --draft /tmp/rand/qwen2.5-0.5b-bf16 \
        --widths 2,4 --tokens 128 --out round-order-h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import PROMPTS, RESULTS, machine_info, model_folder, specpipe_run


def main() -> None:
    from attrs import evolve

    import specpipe

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--target", help="default: the Qwen2.5-Coder 1.5B fixture in bf16"
    )
    parser.add_argument(
        "--draft", help="default: the Qwen2.5-Coder 0.5B fixture in bf16"
    )
    parser.add_argument("--widths", default="4")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--out", default=str(RESULTS / "round-order-cpu.json"))
    args = parser.parse_args()
    args.target = args.target or str(
        model_folder("qwen2.5-coder-1.5b-instruct", "bfloat16")
    )
    args.draft = args.draft or str(
        model_folder("qwen2.5-coder-0.5b-instruct", "bfloat16")
    )
    pipeline = specpipe.load(
        args.target,
        draft=args.draft,
        num_draft_tokens=4,
        dtype="bfloat16",
        adaptive=False,
    ).unwrap()
    ids = list(pipeline.encode(*PROMPTS["code"]).unwrap())
    out = {"machine": machine_info(), "runs": []}
    for width in [int(w) for w in args.widths.split(",")]:
        sized = evolve(pipeline, draft=evolve(pipeline.draft, width=width))
        host = evolve(sized, device_round=False)
        device = evolve(sized, device_round=True)
        specpipe_run(host, ids, 4, "two-model")
        specpipe_run(device, ids, 4, "two-model")
        for name, pipe in [
            ("host-first", host),
            ("device-first", device),
            ("device-first", device),
            ("host-first", host),
        ]:
            run = specpipe_run(pipe, ids, args.tokens, "two-model")
            out["runs"].append({"order": name, "width": width, **run.summary()})
            print(
                f"k={width} {name}: {run.decode_tps:.3f} tok/s  {run.ms_per_round:.1f} ms/round  "
                f"tokens/round {run.acceptance_length:.2f}  cpu/wall {run.cpu_s / run.wall_s:.2f}",
                flush=True,
            )
    path = Path(args.out)
    (
        path if path.is_absolute() or path.parent != Path(".") else RESULTS / path
    ).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
