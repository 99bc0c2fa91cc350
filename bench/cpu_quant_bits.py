"""Quantized products on the CPU by bit width: MLX's own against specpipe's
affine kernel (models/kernels/affine_matmul.c) and the float32 product.

Times, for the projections of Qwen2.5-Coder 0.5B and 1.5B at 1 row (a
decode step) and 5 rows (a verify window), groups of 32, float32
activations: `mx.quantized_matmul` at each of --bits (one thread), the
kernel on one thread (`k<bits>_us`) and as `models.parallel.project` runs
it (every thread specpipe uses, `p<bits>_us`), and `x @ w.T` in float32 (as
MLX computes it, no split).

    python bench/cpu_quant_bits.py [--repeats 30] [--bits 4,5,8] [--models 0.5b,1.5b]
        [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import models  # noqa: F401  before mlx: routes its BLAS (models/blas.py)

# isort: split
import mlx.core as mx

from bench.common import machine_info, median_ms
from models import cpu_kernel
from models.parallel import project

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
    return median_ms(fn, repeats, warmup=2) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--rows", default="1,5")
    parser.add_argument("--bits", default="4,5,8", help="widths, e.g. 2,3,4,5,6,8")
    parser.add_argument("--models", default="0.5b,1.5b")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    results = []
    print(mx.__version__, mx.default_device(), flush=True)
    widths = [int(b) for b in args.bits.split(",")]
    chosen = args.models.split(",")
    for name, inputs, outputs in SHAPES:
        if name.split()[0] not in chosen:
            continue
        mx.random.seed(0)
        weight = mx.random.normal((outputs, inputs)) * inputs**-0.5
        packed = {
            bits: mx.quantize(weight, group_size=GROUP, bits=bits) for bits in widths
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
                row[f"k{bits}_us"] = _time(
                    lambda w=w, s=s, b=b, bits=bits: cpu_kernel.affine_product(
                        x, w, s, b, bits, GROUP, 1
                    ),
                    args.repeats,
                )
                row[f"p{bits}_us"] = _time(
                    lambda w=w, s=s, b=b, bits=bits: project(
                        x, w, s, b, group_size=GROUP, bits=bits
                    ),
                    args.repeats,
                )
            results.append(row)
            print(
                f"{name:14s} rows {rows}: float32 {row['float32_us']:7.0f} us  "
                + "  ".join(
                    f"{b}-bit mlx {row[f'q{b}_us']:6.0f} kernel {row[f'k{b}_us']:6.0f} "
                    f"project {row[f'p{b}_us']:6.0f}"
                    for b in widths
                ),
                flush=True,
            )
    if args.out:
        args.out.write_text(
            json.dumps({"machine": machine_info(), "results": results}, indent=1)
        )


if __name__ == "__main__":
    main()
