"""Quantized keys and values (`--kv-bits`): the target cache's bytes and the
decode speed at a long prompt, specpipe (plain and prompt lookup) and mlx-lm
(`generate_step(..., kv_bits=)`) in the same run, float and 8 and 4 bits.

Cache bytes: the buffers of one row's cache holding the prompt and the
output (specpipe's arena, in steps of 256 positions). Speed: decode tokens a
second, specpipe's own figure and mlx-lm's (N - 1 over first to last token),
greedy; the ratio is specpipe's to mlx-lm's at the same bits.

    python bench/kv_bits.py --model smollm2-135m-instruct --prompt-tokens 1500
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import models  # noqa: F401  before mlx: routes its BLAS (models/blas.py)

# isort: split
import mlx.core as mx

from bench.common import (
    greedy_sampler,
    machine_info,
    mlxlm_load,
    model_folder,
    specpipe_run,
    table,
    write_json,
)

TEXT = (
    "def merge_sort(items):\n    if len(items) <= 1:\n        return items\n"
    "    middle = len(items) // 2\n    left = merge_sort(items[:middle])\n"
    "    right = merge_sort(items[middle:])\n    return merge(left, right)\n\n"
)


def mlxlm_tps(model: Any, ids: list[int], tokens: int, bits: int | None) -> float:
    from mlx_lm.generate import generate_step

    stamps: list[float] = []
    options: dict[str, Any] = {}
    if bits is not None:
        options = {"kv_bits": bits, "kv_group_size": 64, "quantized_kv_start": 0}
    gen = generate_step(
        mx.array(ids, dtype=mx.uint32),
        model,
        max_tokens=tokens,
        sampler=greedy_sampler,
        **options,
    )
    for _ in gen:
        stamps.append(time.perf_counter())
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompt-tokens", type=int, default=1500)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default="bench/results/kv-bits-cpu.json")
    args = parser.parse_args()

    import specpipe

    folder = model_folder(args.model, args.dtype)
    rows: list[dict[str, Any]] = []
    peer = None
    for bits in (None, 8, 4):
        plain = specpipe.load(str(folder), kv_bits=bits, adaptive=False).unwrap()
        lookup = specpipe.load(
            str(folder), kv_bits=bits, draft="ngram", adaptive=False
        ).unwrap()
        if peer is None:
            peer = mlxlm_load(folder, share_from=plain.target.model)
        tok = plain.target.tokenizer
        ids = tok.encode(TEXT * 200)[: args.prompt_tokens]
        cache = plain.target.model.make_cache(1)
        cache.reserve(len(ids) + args.max_tokens)
        cache_bytes = sum(a.nbytes for a in cache.arrays())
        figures: dict[str, list[float]] = {"plain": [], "ngram": [], "mlx-lm": []}
        for _ in range(args.repeats):
            figures["plain"].append(
                specpipe_run(plain, ids, args.max_tokens, "plain").decode_tps
            )
            figures["ngram"].append(
                specpipe_run(lookup, ids, args.max_tokens, "ngram").decode_tps
            )
            figures["mlx-lm"].append(mlxlm_tps(peer, ids, args.max_tokens, bits))
        best = {k: max(v) for k, v in figures.items()}
        rows.append(
            {
                "kv_bits": bits or "float",
                "cache_mb": cache_bytes / 1e6,
                "specpipe_plain_tps": best["plain"],
                "specpipe_ngram_tps": best["ngram"],
                "mlxlm_tps": best["mlx-lm"],
                "plain_vs_mlxlm": best["plain"] / best["mlx-lm"],
                "ngram_vs_mlxlm": best["ngram"] / best["mlx-lm"],
                "runs": figures,
            }
        )
        print(rows[-1], file=sys.stderr, flush=True)
    print(
        table(
            [
                "kv bits",
                "cache MB",
                "plain tok/s",
                "ngram tok/s",
                "mlx-lm tok/s",
                "plain/mlx-lm",
                "ngram/mlx-lm",
            ],
            [
                [
                    r["kv_bits"],
                    f"{r['cache_mb']:.1f}",
                    f"{r['specpipe_plain_tps']:.1f}",
                    f"{r['specpipe_ngram_tps']:.1f}",
                    f"{r['mlxlm_tps']:.1f}",
                    f"{r['plain_vs_mlxlm']:.2f}",
                    f"{r['ngram_vs_mlxlm']:.2f}",
                ]
                for r in rows
            ],
        )
    )
    write_json(
        Path(args.out),
        {"machine": machine_info(), "args": vars(args), "rows": rows},
    )


if __name__ == "__main__":
    main()
