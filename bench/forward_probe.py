"""One model forward per dtype / quantization, on the current device.

Times a forward of `--width` tokens after a 16-token context (min and median
of `--repeats`), the model loaded as float32, bfloat16, or float32 then
quantized by `models.build.quantize_model` (q8 / q4, group 64) and its
projections fused as `specpipe.load` does. The hidden states only: the
vocabulary projection is not evaluated.

    python bench/forward_probe.py --model qwen2.5-coder-0.5b-instruct --variants f32,bf16,q8,q4
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import model_folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--variants", default="f32,bf16,q8,q4")
    parser.add_argument("--widths", default="1,4")
    parser.add_argument("--repeats", type=int, default=6)
    args = parser.parse_args()

    import mlx.core as mx

    import specpipe
    from models.build import quantize_model
    from models.fuse import fuse_projections

    for variant in args.variants.split(","):
        dtype = "bfloat16" if variant == "bf16" else "float32"
        model = (
            specpipe.load(str(model_folder(args.model, dtype)), dtype=dtype)
            .unwrap()
            .target.model
        )
        if variant.startswith("q"):
            quantize_model(model, int(variant[1:]), 64)
            fuse_projections(model)
            mx.eval(model.parameters())
        cache = model.make_cache(1)
        mx.eval(model(mx.array([[100] * 16], dtype=mx.int32), cache, [0]).hidden)
        for width in [int(w) for w in args.widths.split(",")]:
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                mx.eval(
                    model(mx.array([[5] * width], dtype=mx.int32), cache, [16]).hidden
                )
                times.append((time.perf_counter() - t0) * 1000.0)
            print(
                f"{variant:5s} width {width}: min {min(times):.1f} ms, median {statistics.median(times):.1f} ms",
                flush=True,
            )


if __name__ == "__main__":
    main()
