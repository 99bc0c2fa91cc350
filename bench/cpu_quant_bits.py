"""MLX's quantized product by bit width on the default device: is a GGUF's
Q5 block (kept at 5 bits, models/gguf_quant.py) better stored at 8?

Every Q5_0 / Q5_1 / Q5_K value is an integer 0..31 with a per-group scale
and offset, so it is exactly an 8-bit affine value too (the same scale and
bias, the high bits zero): only speed and memory differ. This times
`mx.quantized_matmul` (groups of 32, float32 activations) at 4, 5 and 8 bits
and the float32 product, for the projections of Qwen2.5-Coder 0.5B and
1.5B, at 1 row (a decode step) and 5 rows (a verify window).

    python bench/cpu_quant_bits.py [--repeats 30] [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import models  # noqa: F401  before mlx: routes its BLAS (models/blas.py)

# isort: split
import mlx.core as mx

from bench.common import machine_info

# (name, inputs, outputs): q/k/v/o and the MLP of each model (o = q's shape)
SHAPES = (
    ("0.5b q", 896, 896),
    ("0.5b kv", 896, 128),
    ("0.5b gate/up", 896, 4864),
    ("0.5b down", 4864, 896),
    ("1.5b q", 1536, 1536),
    ("1.5b kv", 1536, 256),
    ("1.5b gate/up", 1536, 8960),
    ("1.5b down", 8960, 1536),
)
GROUP = 32


def _time(fn: object, repeats: int) -> float:
    """Median microseconds of `fn()` evaluated, after two warm-up calls."""
    assert callable(fn)
    for _ in range(2):
        mx.eval(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(fn())
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--rows", default="1,5")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    results = []
    print(mx.__version__, mx.default_device(), flush=True)
    for name, inputs, outputs in SHAPES:
        mx.random.seed(0)
        weight = mx.random.normal((outputs, inputs)) * inputs**-0.5
        packed = {
            bits: mx.quantize(weight, group_size=GROUP, bits=bits) for bits in (4, 5, 8)
        }
        mx.eval(weight, packed)
        for rows in (int(r) for r in args.rows.split(",")):
            x = mx.random.normal((rows, inputs))
            row = {"shape": name, "rows": rows}
            row["float32_us"] = _time(lambda: x @ weight.T, args.repeats)
            for bits, (w, s, b) in packed.items():
                row[f"q{bits}_us"] = _time(
                    lambda w=w, s=s, b=b, bits=bits: mx.quantized_matmul(
                        x, w, s, b, transpose=True, group_size=GROUP, bits=bits
                    ),
                    args.repeats,
                )
            results.append(row)
            print(
                f"{name:14s} rows {rows}: float32 {row['float32_us']:8.0f} us  "
                + "  ".join(f"q{b} {row[f'q{b}_us']:8.0f}" for b in (4, 5, 8))
                + f"  q5/q8 {row['q5_us'] / row['q8_us']:.2f}",
                flush=True,
            )
    if args.out:
        args.out.write_text(
            json.dumps({"machine": machine_info(), "results": results}, indent=1)
        )


if __name__ == "__main__":
    main()
