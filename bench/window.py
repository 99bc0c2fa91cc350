"""Forward cost by window width: what one verify forward of W tokens costs,
in specpipe's model and in mlx-lm's, on the same folder.

Speculation wins only when a window of k+1 tokens costs well under k+1
single-token steps; this measures that ratio per device and dtype. Each
width: a prompt of `--context` tokens is prefilled once, then the window is
run `--repeats` times at the same position (the cache keeps its length:
specpipe's writes by position, mlx-lm's is trimmed back); the minimum ms is
kept (the machine may be shared: the minimum is the least disturbed). "build ms" is the Python time to build the
lazy graph of one forward (before `mx.eval`), which a pipelined loop can hide
under the previous step's compute and an unpipelined one cannot.

    python bench/window.py --models qwen2.5-coder-1.5b-instruct --dtypes bfloat16
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import models  # noqa: F401  before mlx: routes its BLAS (models/blas.py)

# isort: split

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS, machine_info, model_folder, table, write_json


def time_specpipe(
    model: Any, context: int, widths: list[int], repeats: int
) -> tuple[dict[int, float], dict[int, float]]:
    cache = model.make_cache(1)
    prompt = mx.array([[(7 * i + 3) % 1000 for i in range(context)]], dtype=mx.int32)
    cache.reserve(context + max(widths) + 1)
    model(prompt, cache, [0])
    mx.eval(cache.arrays())
    out: dict[int, float] = {}
    build: dict[int, float] = {}
    for w in widths:
        ids = mx.array([[(11 * i + 5) % 1000 for i in range(w)]], dtype=mx.int32)
        times, builds = [], []
        for r in range(repeats + 1):
            t0 = time.perf_counter()
            logits = model(ids, cache, [context]).logits
            t1 = time.perf_counter()
            mx.eval(logits)
            if r:
                times.append(1000.0 * (time.perf_counter() - t0))
                builds.append(1000.0 * (t1 - t0))
        out[w] = min(times)
        build[w] = min(builds)
    return out, build


def time_mlxlm(
    model: Any, context: int, widths: list[int], repeats: int
) -> tuple[dict[int, float], dict[int, float]]:
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    cache = make_prompt_cache(model)
    prompt = mx.array([[(7 * i + 3) % 1000 for i in range(context)]], dtype=mx.uint32)
    model(prompt, cache=cache)
    mx.eval([c.state for c in cache])
    out: dict[int, float] = {}
    build: dict[int, float] = {}
    for w in widths:
        ids = mx.array([[(11 * i + 5) % 1000 for i in range(w)]], dtype=mx.uint32)
        times, builds = [], []
        for r in range(repeats + 1):
            t0 = time.perf_counter()
            logits = model(ids, cache=cache)
            t1 = time.perf_counter()
            mx.eval(logits)
            if r:
                times.append(1000.0 * (time.perf_counter() - t0))
                builds.append(1000.0 * (t1 - t0))
            trim_prompt_cache(cache, w)
        out[w] = min(times)
        build[w] = min(builds)
    return out, build


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--dtypes", default="bfloat16")
    parser.add_argument("--widths", default="1,2,3,4,5,6,7")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(RESULTS / "window.json"))
    args = parser.parse_args()
    import mlx_lm

    import specpipe

    widths = [int(w) for w in args.widths.split(",")]
    machine = machine_info()
    results = []
    for ref in args.models.split(","):
        for dtype in args.dtypes.split(","):
            folder = model_folder(ref, dtype)
            ours = specpipe.load(str(folder), dtype=dtype).unwrap()
            sp, sp_build = time_specpipe(
                ours.target.model, args.context, widths, args.repeats
            )
            del ours
            gc.collect()
            mx.clear_cache()
            peer, _ = mlx_lm.load(str(folder))
            lm, lm_build = time_mlxlm(peer, args.context, widths, args.repeats)
            del peer
            gc.collect()
            mx.clear_cache()
            results.append(
                {
                    "model": ref,
                    "dtype": dtype,
                    "context": args.context,
                    "specpipe_ms": sp,
                    "mlx_lm_ms": lm,
                    "specpipe_build_ms": sp_build,
                    "mlx_lm_build_ms": lm_build,
                }
            )
            write_json(Path(args.out), {"machine": machine, "results": results})
            print(
                f"\n{Path(ref).name} [{dtype}] forward ms by window width (context {args.context}), {machine['device']}"
            )
            print(
                table(
                    [
                        "width",
                        "specpipe ms",
                        "x width 1",
                        "mlx-lm ms",
                        "x width 1",
                        "sp/lm time",
                        "specpipe build ms",
                        "mlx-lm build ms",
                    ],
                    [
                        [
                            w,
                            sp[w],
                            sp[w] / sp[widths[0]],
                            lm[w],
                            lm[w] / lm[widths[0]],
                            sp[w] / lm[w],
                            sp_build[w],
                            lm_build[w],
                        ]
                        for w in widths
                    ],
                )
            )


if __name__ == "__main__":
    main()
