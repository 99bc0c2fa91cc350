"""A DFlash2 draft's resident bytes and forward time at each `--draft-bits`
setting (16: bf16, 8, 4), random weights of a released drafter's shape.

The shape is the one a 3.85 GB bf16 DFlash2 checkpoint has (the reference
engine's figure for z-lab's Qwen3.5-27B-class drafters): five Qwen3 layers of
hidden 5120 (32 query heads and 8 KV heads of 128, MLP 17408) reading five
target layers, convolutions of kernel 2 over groups of 16 channels, a
selector of rank 256 over a 248,320-token vocabulary: 1.924e9 parameters,
3.85e9 bytes in bf16. The loader's path is `models.dflash.build_dflash` (the
weights as a dict, as `bindings.kinds` passes them after reading the
safetensors).

Time: one draft forward of a block of 8 (`block_size`) after `--context`
positions were stored, median of `--repeats` (the weights' values do not
change it; acceptance is not measured here).

    python bench/dflash2_bits.py --bits 16 4 8 --repeats 3 --out bench/results/dflash2-bits-cpu.json
    python bench/dflash2_bits.py --dtype float32 --bits 16 4 --repeats 3 --out bench/results/dflash2-bits-cpu-f32.json
    python bench/dflash2_bits.py --product --out bench/results/dflash2-bits-cpu-product.json

`--product` times one MLP up projection alone (17408 x 5120, 8 rows) in
float and at 4 bits, through specpipe's layers and through MLX's
`quantized_matmul` unsplit, in bf16 and float32.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import models  # noqa: F401  before mlx: routes its BLAS (models/blas.py)

# isort: split

import mlx.core as mx
from mlx.utils import tree_flatten

from bench.common import median_ms
from models.dflash import DFlashDraft, DFlashSettings, build_dflash
from schemas.converter import hf, structure
from schemas.hf import DecoderArgs, normalize_hf_config

CONFIG: dict[str, Any] = {
    "architectures": ["DFlash2DraftModel"],
    "model_type": "qwen3",
    "hidden_size": 5120,
    "num_hidden_layers": 5,
    "intermediate_size": 17408,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 248320,
    "rope_theta": 10000000.0,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 262144,
    "dflash_config": {
        "target_layer_ids": [5, 19, 33, 47, 61],
        "block_size": 8,
        "mask_token_id": 248070,
        "conv_kernel_size": 2,
        "conv_group_size": 16,
        "selector_rank": 256,
        "selector_top_k": 16,
    },
}


def random_weights(args: DecoderArgs, settings: DFlashSettings) -> dict[str, mx.array]:
    """bf16 weights of the draft's names and shapes (a lazy module's
    shapes; values drawn one tensor at a time)."""
    shapes = {
        k: v.shape for k, v in tree_flatten(DFlashDraft(args, settings).parameters())
    }
    weights = {}
    for name, shape in shapes.items():
        value = (0.02 * mx.random.normal(shape)).astype(mx.bfloat16)
        mx.eval(value)
        weights[name] = value
    return weights


def resident(draft: DFlashDraft) -> int:
    return sum(v.nbytes for _, v in tree_flatten(draft.parameters()))


def forward_ms(
    draft: DFlashDraft, context: int, repeats: int, dtype: mx.Dtype
) -> list[float]:
    hidden = draft.args.hidden_size
    taps = len(draft.settings.target_layers)
    features = (0.5 * mx.random.normal((1, context, taps * hidden))).astype(dtype)
    cache = draft.make_cache(1)
    draft.write_context(features, cache, [0])
    mx.eval(cache.arrays())
    x = (0.02 * mx.random.normal((1, draft.settings.block_size, hidden))).astype(dtype)
    mx.eval(draft(x, cache, [context]))  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(draft(x, cache, [context]))
        times.append((time.perf_counter() - start) * 1e3)
    return times


def product_ms(repeats: int) -> list[dict[str, Any]]:
    from models.parallel import Linear

    rows = []
    for dtype in (mx.bfloat16, mx.float32):
        layer = Linear(5120, 17408, bias=False)
        layer.weight = (0.02 * layer.weight).astype(dtype)
        quantized = layer.to_quantized(group_size=64, bits=4)
        mx.eval(layer.parameters(), quantized.parameters())
        x = mx.random.normal((1, 8, 5120)).astype(dtype)
        q = quantized.parameters()

        def unsplit() -> mx.array:
            return mx.quantized_matmul(
                x, q["weight"], q["scales"], q["biases"], True, 64, 4
            )

        rows.append(
            {
                "dtype": str(dtype),
                "float_ms": median_ms(lambda: layer(x), repeats, warmup=1),
                "q4_ms": median_ms(lambda: quantized(x), repeats, warmup=1),
                "q4_unsplit_ms": median_ms(unsplit, repeats, warmup=1),
            }
        )
        print(rows[-1])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bits", type=int, nargs="+", default=[16, 8, 4])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument(
        "--dtype",
        choices=["bfloat16", "float32"],
        default="bfloat16",
        help="the target's dtype, which the draft loads in (the checkpoint is bf16)",
    )
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--product", action="store_true", help="time one projection only"
    )
    opts = parser.parse_args()
    if opts.product:
        products = product_ms(opts.repeats)
        if opts.out:
            Path(opts.out).write_text(
                json.dumps(
                    {
                        "date": time.strftime("%Y-%m-%d"),
                        "device": str(mx.default_device()),
                        "mlx": mx.__version__,
                        "repeats": opts.repeats,
                        "rows": products,
                    },
                    indent=2,
                )
            )
        return
    args = structure(hf, normalize_hf_config(CONFIG), DecoderArgs, "bench").unwrap()
    settings = DFlashSettings.of(CONFIG).unwrap()
    mx.random.seed(0)
    dtype = getattr(mx, opts.dtype)
    weights = random_weights(args, settings)
    checkpoint = sum(v.nbytes for v in weights.values())
    params = sum(v.size for v in weights.values())
    print(f"checkpoint: {params:,} parameters, {checkpoint:,} bytes (bf16)")
    rows = []
    for bits in opts.bits:
        start = time.perf_counter()
        draft = build_dflash(args, settings, weights, dtype, bits).unwrap()
        load_s = time.perf_counter() - start
        size = resident(draft)
        times = forward_ms(draft, opts.context, opts.repeats, dtype)
        row = {
            "bits": bits,
            "dtype": opts.dtype,
            "resident_bytes": size,
            "ratio": size / checkpoint,
            "quantize_s": load_s,
            "forward_ms": times,
            "forward_ms_median": statistics.median(times),
        }
        rows.append(row)
        print(
            f"{opts.dtype}, bits {bits:2d}: {size:,} bytes "
            f"({size / checkpoint:.3f} of the bf16 checkpoint), "
            f"built in {load_s:.1f} s, block forward {row['forward_ms_median']:.0f} ms "
            f"(median of {opts.repeats}, context {opts.context})"
        )
        del draft
    if opts.out:
        Path(opts.out).write_text(
            json.dumps(
                {
                    "date": time.strftime("%Y-%m-%d"),
                    "config": CONFIG,
                    "checkpoint_bytes": checkpoint,
                    "parameters": params,
                    "device": str(mx.default_device()),
                    "mlx": mx.__version__,
                    "rows": rows,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
