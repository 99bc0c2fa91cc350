"""Plain greedy decoding: specpipe vs mlx-lm on the same converted folder.

For each model and dtype both libraries load the SAME HF-layout MLX folder
(written by `specpipe convert --dtype`), decode the same prompt ids greedily
for the same number of tokens, one warm-up run each (excluded), then N
repeats in alternating order (specpipe first on even repeats, mlx-lm first on
odd ones). Reports median decode tok/s, median wall time, and the ratio
specpipe / mlx-lm; checks that the two token streams are identical.

    python bench/plain.py --models smollm2-135m-instruct,qwen2.5-coder-0.5b-instruct \
        --dtypes float32,bfloat16 --tokens 64 --repeats 5
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import models  # noqa: F401  before mlx: routes its BLAS (models/blas.py)

# isort: split

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    PROMPTS,
    RESULTS,
    first_difference,
    machine_info,
    median,
    mlxlm_plain,
    model_folder,
    specpipe_run,
    stored_dtype,
    table,
    write_json,
)


def bench_one(
    ref: str, dtype: str, prompt_name: str, tokens: int, repeats: int
) -> dict[str, Any]:
    import mlx_lm

    import specpipe

    folder = model_folder(ref, dtype)
    stored = stored_dtype(folder)
    print(
        f"== {ref} [{dtype}] folder {folder} (stored {stored})",
        file=sys.stderr,
        flush=True,
    )
    pipeline = specpipe.load(str(folder), dtype=dtype).unwrap()
    peer, _peer_tok = mlx_lm.load(str(folder))
    text, chat = PROMPTS[prompt_name]
    ids = list(pipeline.encode(text, chat).unwrap())
    eos = frozenset(pipeline.target.tokenizer.eos_token_ids)

    # warm-up (excluded): compiles nothing in MLX, but faults the weights in
    # and sizes the allocator's cache
    specpipe_run(pipeline, ids, min(tokens, 8), "plain")
    mlxlm_plain(peer, ids, min(tokens, 8), eos)

    ours: list[Any] = []
    theirs: list[Any] = []
    for r in range(repeats):
        order = ("specpipe", "mlx-lm") if r % 2 == 0 else ("mlx-lm", "specpipe")
        for lib in order:
            if lib == "specpipe":
                ours.append(specpipe_run(pipeline, ids, tokens, "plain"))
            else:
                theirs.append(mlxlm_plain(peer, ids, tokens, eos))
        print(
            f"  repeat {r}: specpipe {ours[-1].decode_tps:.2f} tok/s, mlx-lm {theirs[-1].decode_tps:.2f} tok/s",
            file=sys.stderr,
            flush=True,
        )

    # identical streams: across the two libraries, and across repeats
    diff = first_difference(ours[0].tokens, theirs[0].tokens)
    stable_ours = all(o.tokens == ours[0].tokens for o in ours)
    stable_theirs = all(t.tokens == theirs[0].tokens for t in theirs)
    detail = None
    if diff is not None:
        detok = pipeline.target.tokenizer
        detail = {
            "first_difference": diff,
            "specpipe_from_there": ours[0].tokens[diff : diff + 8],
            "mlx_lm_from_there": theirs[0].tokens[diff : diff + 8],
            "common_text": detok.decode(ours[0].tokens[:diff]),
        }
    sp_tps = median([o.decode_tps for o in ours])
    lm_tps = median([t.decode_tps for t in theirs])
    sp_wall = median([o.wall_s for o in ours])
    lm_wall = median([t.wall_s for t in theirs])
    out = {
        "model": ref,
        "dtype": dtype,
        "folder": str(folder),
        "stored_dtype": stored,
        "prompt": prompt_name,
        "prompt_tokens": len(ids),
        "max_tokens": tokens,
        "generated": len(ours[0].tokens),
        "repeats": repeats,
        "specpipe_decode_tps": sp_tps,
        "mlx_lm_decode_tps": lm_tps,
        "ratio_decode": sp_tps / lm_tps if lm_tps else None,
        "specpipe_wall_s": sp_wall,
        "mlx_lm_wall_s": lm_wall,
        "ratio_wall_speed": lm_wall / sp_wall if sp_wall else None,
        # contention-robust figures: the best repeat, and tokens per second of
        # process CPU time over the whole call (MLX decodes on one thread)
        "specpipe_best_decode_tps": max(o.decode_tps for o in ours),
        "mlx_lm_best_decode_tps": max(t.decode_tps for t in theirs),
        "specpipe_cpu_tps": median([len(o.tokens) / o.cpu_s for o in ours]),
        "mlx_lm_cpu_tps": median([len(t.tokens) / t.cpu_s for t in theirs]),
        "load_avg": median([o.load for o in ours + theirs]),
        "specpipe_ms_per_token": median([o.ms_per_round for o in ours]),
        "mlx_lm_ms_per_token": median([t.ms_per_round for t in theirs]),
        "identical": diff is None,
        "difference": detail,
        "deterministic_specpipe": stable_ours,
        "deterministic_mlx_lm": stable_theirs,
        "runs": {
            "specpipe": [o.summary() for o in ours],
            "mlx-lm": [t.summary() for t in theirs],
        },
    }
    del pipeline, peer
    gc.collect()
    mx.clear_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models", default="smollm2-135m-instruct,qwen2.5-coder-0.5b-instruct"
    )
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--prompt", default="code", choices=sorted(PROMPTS))
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(RESULTS / "plain.json"))
    parser.add_argument(
        "--no-assert", action="store_true", help="report differences without failing"
    )
    args = parser.parse_args()

    machine = machine_info()
    results = []
    for ref in args.models.split(","):
        for dtype in args.dtypes.split(","):
            results.append(
                bench_one(ref, dtype, args.prompt, args.tokens, args.repeats)
            )
            write_json(Path(args.out), {"machine": machine, "results": results})

    for r in results:
        r["ratio_best"] = r["specpipe_best_decode_tps"] / r["mlx_lm_best_decode_tps"]
        r["ratio_cpu"] = r["specpipe_cpu_tps"] / r["mlx_lm_cpu_tps"]
    write_json(Path(args.out), {"machine": machine, "results": results})
    rows = [
        [
            Path(r["model"]).name,
            r["dtype"],
            r["generated"],
            r["specpipe_decode_tps"],
            r["mlx_lm_decode_tps"],
            r["ratio_decode"],
            r["ratio_best"],
            r["ratio_cpu"],
            r["ratio_wall_speed"],
            r["load_avg"],
            "yes" if r["identical"] else f"NO @{r['difference']['first_difference']}",
        ]
        for r in results
    ]
    print(
        f"\nplain greedy decode, prompt '{args.prompt}', median of {args.repeats}, {machine['device']} ({machine['cpu']})"
    )
    print(
        table(
            [
                "model",
                "dtype",
                "tokens",
                "specpipe tok/s",
                "mlx-lm tok/s",
                "ratio (median)",
                "ratio (best)",
                "ratio (CPU time)",
                "ratio (wall)",
                "load",
                "identical",
            ],
            rows,
        )
    )
    bad = [r for r in results if not r["identical"]]
    for r in bad:
        print(f"DIFFERENCE {r['model']} [{r['dtype']}]: {r['difference']}")
    if bad and not args.no_assert:
        raise SystemExit("token streams differ (see above)")


if __name__ == "__main__":
    main()
