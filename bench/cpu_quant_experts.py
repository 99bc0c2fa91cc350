"""Quantized MoE experts on the CPU: MLX's `gather_qmm` against specpipe's
affine kernel (`models.cpu_kernel.affine_gather_product`, each expert row
used unpacked once per call).

One MoE layer's routed projections at a Qwen3-30B-A3B-like shape (hidden
2,048, expert width 768, top-8 of EXPERTS, default 64), MLX affine 4 bits in
groups of 64, float32 activations, as `SwitchGLU` calls them: gate (each
token's row against its top-k) and down (each pair's own row), for a decode
step (1 token) and a verify window (5 tokens), random routing. Median
microseconds; `mlx` is `mx.gather_qmm`, `kernel` the affine kernel on every
thread specpipe uses.

    python bench/cpu_quant_experts.py [--repeats 20] [--experts 64] [--bits 4]
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
from models.parallel import cpu_threads

HIDDEN, WIDTH, TOP_K, GROUP = 2048, 768, 8, 64


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    mx.random.seed(0)
    stacks = {
        "gate": mx.quantize(
            mx.random.normal((args.experts, WIDTH, HIDDEN)) * HIDDEN**-0.5,
            group_size=GROUP,
            bits=args.bits,
        ),
        "down": mx.quantize(
            mx.random.normal((args.experts, HIDDEN, WIDTH)) * WIDTH**-0.5,
            group_size=GROUP,
            bits=args.bits,
        ),
    }
    mx.eval(stacks)
    print(mx.__version__, mx.default_device(), f"{cpu_threads()} threads", flush=True)
    results = []
    for tokens in (1, 5):
        chosen = mx.argsort(mx.random.uniform(shape=(tokens, args.experts)), axis=-1)[
            :, :TOP_K
        ].astype(mx.int32)
        for name, (w, s, b) in stacks.items():
            inner = HIDDEN if name == "gate" else WIDTH
            shape = (
                (tokens, 1, 1, inner) if name == "gate" else (tokens, TOP_K, 1, inner)
            )
            x = mx.random.normal(shape)

            def mlx_product(
                x: mx.array = x, w: mx.array = w, s: mx.array = s, b: mx.array = b
            ) -> mx.array:
                return mx.gather_qmm(
                    x, w, s, b, rhs_indices=chosen, transpose=True,
                    group_size=GROUP, bits=args.bits,
                )  # fmt: skip

            def kernel_product(
                x: mx.array = x, w: mx.array = w, s: mx.array = s, b: mx.array = b
            ) -> mx.array:
                out = cpu_kernel.affine_gather_product(
                    x, w, s, b, chosen, args.bits, GROUP, cpu_threads()
                )
                assert out is not None
                return out

            row = {
                "projection": name,
                "tokens": tokens,
                "mlx_us": median_ms(mlx_product, args.repeats, warmup=2) * 1e3,
                "kernel_us": median_ms(kernel_product, args.repeats, warmup=2) * 1e3,
            }
            results.append(row)
            print(
                f"{name:4s} tokens {tokens}: gather_qmm {row['mlx_us']:8.0f} us  "
                f"kernel {row['kernel_us']:8.0f} us  "
                f"({row['mlx_us'] / row['kernel_us']:.1f}x)",
                flush=True,
            )
    if args.out:
        payload = {"machine": machine_info(), "args": vars(args), "results": results}
        args.out.write_text(json.dumps(payload, indent=1, default=str))


if __name__ == "__main__":
    main()
