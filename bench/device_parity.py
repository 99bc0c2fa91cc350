"""The models on the GPU against the same weights on the CPU, float32.

The CPU paths are what the tests pin (parity with transformers, commit
properties, lossless decoding); a fault of a GPU-only path (a kernel, a
bucketed window, a backend operation; bench/gather_probe.py found one) shows
here as logits that differ by more than rounding. For each family, random
float32 weights (seed 0) decode three rows of different prompt lengths:
prefill, then a verify window of W positions, and again from a fresh prefill
the same W tokens one step at a time. Printed per family: the largest
difference of the GPU's logits from the CPU's (over the logits' largest
magnitude) for the window and for the steps, how many positions' best token
agree, and the GPU window against the GPU steps.

Run it with `MLX_ENABLE_TF32=0` (MLX's TF32 float32 products are ~1e-3 off
by design; README "Exactness"):

    MLX_ENABLE_TF32=0 python bench/device_parity.py --out bench/results/device-parity.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import models  # noqa: F401  before mlx: routes its BLAS (models/blas.py)

# isort: split

import mlx.core as mx
import numpy as np
from mlx.utils import tree_map

from bench.common import machine_info
from bench.mtp import qwen3_5_27b_shape, qwen3_next_shape
from bench.random_weights import SHAPES as DENSE_SHAPES
from models.build import build_model
from models.fuse import fuse_projections
from schemas.request import SamplingParams
from specpipe.load import args_from_config
from specpipe.prefill import prefill_rows
from specpipe.state import RowState


def families(layers: int, vocab: int) -> dict[str, dict[str, Any]]:
    return {
        "qwen2.5-0.5b": {
            **DENSE_SHAPES["qwen2.5-0.5b"],
            "num_hidden_layers": layers,
            "vocab_size": vocab,
        },
        "qwen3-next": qwen3_next_shape(layers, 64, 2048, vocab),
        "qwen3.5-27b": qwen3_5_27b_shape(layers, 0, 0, vocab),
    }


def decode(
    model: Any, prompts: list[tuple[int, ...]], tokens: mx.array, stepwise: bool
) -> mx.array:
    """Logits [B, W, V] of `tokens` [B, W] after each row's prompt: one window,
    or W single steps (each committed)."""
    rows = [RowState.start(p, 16, SamplingParams()) for p in prompts]
    cache, _ = prefill_rows(model, rows)
    lengths = [row.length for row in rows]
    if not stepwise:
        return model(tokens, cache, lengths).logits.astype(mx.float32)
    out = []
    for i in range(tokens.shape[1]):
        verified = model(tokens[:, i : i + 1], cache, [n + i for n in lengths])
        if verified.delta is not None:
            verified.delta.commit([1] * len(prompts))
        out.append(verified.logits.astype(mx.float32))
        mx.eval(out[-1])
    return mx.concatenate(out, axis=1)


def compare(got: mx.array, want: mx.array) -> dict[str, Any]:
    scale = mx.abs(want).max().item()
    return {
        "max_rel_diff": mx.abs(got - want).max().item() / scale,
        "argmax_agree": int((mx.argmax(got, -1) == mx.argmax(want, -1)).sum().item()),
        "positions": int(got.shape[0] * got.shape[1]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--families", default="qwen2.5-0.5b,qwen3-next,qwen3.5-27b")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--window", type=int, default=4)
    parser.add_argument(
        "--lengths", default="20,17,12", help="the rows' prompt lengths"
    )
    parser.add_argument(
        "--devices", default="gpu,cpu", help="the device checked, then the reference"
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="a config value of every family (e.g. tie_word_embeddings=false)",
    )
    parser.add_argument(
        "--fresh-reference",
        action="store_true",
        help="the reference pass on copies of the weights made on its device",
    )
    parser.add_argument(
        "--split-threads",
        type=int,
        default=None,
        help="split the CPU products over N streams even with MLX's CUDA backend "
        "(which models/parallel.py refuses: reproduces its failures)",
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    checked, reference = (getattr(mx, d) for d in args.devices.split(","))
    if args.split_threads is not None:
        import models.parallel

        models.parallel._cuda_backend = lambda: False  # type: ignore[assignment]
        models.parallel.set_cpu_threads(args.split_threads)
    mx.random.seed(1)
    lengths = [int(n) for n in args.lengths.split(",")]
    prompts = [tuple(mx.random.randint(0, args.vocab, (n,)).tolist()) for n in lengths]
    tokens = mx.random.randint(0, args.vocab, (len(prompts), args.window)).astype(
        mx.int32
    )
    report: dict[str, Any] = {
        "machine": machine_info(),
        "MLX_ENABLE_TF32": os.environ.get("MLX_ENABLE_TF32"),
        "args": {k: str(v) for k, v in vars(args).items()},
        "families": {},
    }
    shapes = families(args.layers, args.vocab)
    for name in args.families.split(","):
        config = {
            **shapes[name],
            **{k: json.loads(v) for k, v in (a.split("=", 1) for a in args.set)},
        }
        mx.set_default_device(checked)
        mx.random.seed(0)
        model: Any = build_model(args_from_config(config, name).unwrap()).unwrap()
        model.update(tree_map(lambda p: p.astype(mx.float32) if mx.issubdtype(p.dtype, mx.floating) else p,
                              model.parameters()))  # fmt: skip
        mx.eval(model.parameters())
        fuse_projections(model)
        print(f"stage {name} built", flush=True)
        logits = {}
        for device in (checked, reference):
            mx.set_default_device(device)
            if device == reference and args.fresh_reference:
                model.update(
                    tree_map(
                        lambda p: mx.array(np.array(p, copy=True)), model.parameters()
                    )
                )
                mx.eval(model.parameters())
            for stepwise in (False, True):
                start = time.perf_counter()
                logits[(str(device), stepwise)] = decode(
                    model, prompts, tokens, stepwise
                )
                mx.eval(logits[(str(device), stepwise)])
                print(f"stage {name} {device} {'steps' if stepwise else 'window'} "
                      f"{time.perf_counter() - start:.1f} s", flush=True)  # fmt: skip
        mx.set_default_device(checked)
        c, r = str(checked), str(reference)
        entry = {
            "window": compare(logits[(c, False)], logits[(r, False)]),
            "steps": compare(logits[(c, True)], logits[(r, True)]),
            "window_vs_steps": compare(logits[(c, False)], logits[(c, True)]),
        }
        report["families"][name] = entry
        print("PARITY", name, json.dumps(entry), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
