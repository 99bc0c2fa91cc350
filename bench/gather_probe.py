"""The routed experts' gathered products on the device, checked against each
(token, expert) pair computed alone.

1. MLX's `gather_mm` with `sorted_indices=True` (the experts' rows read once
   per expert) for an lhs of shape [N, 1, I] made two ways: by reshape and by
   inserting the unit axis as a view (`x[:, None, :]`). On MLX 0.32's CUDA
   backend the view form gives wrong products (relative error ~1, not
   rounding); the reshape form is right.
2. `SwitchGLU` (models/qwen3_next.py) with its pairs grouped by expert
   (from `SwitchGLU.SORT_MIN` pairs on) and ungrouped, for N tokens of a
   Qwen3-Next-shaped MoE (64 experts, top-10), float32 and bf16.

Errors are the largest absolute difference over the reference's largest
magnitude; a correct product shows rounding only (~1e-7 float32, ~1e-3 with
TF32 or bf16).

    python bench/gather_probe.py --out bench/results/gather-probe.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import models  # noqa: F401  before mlx: routes its BLAS (models/blas.py)

# isort: split
import mlx.core as mx

from bench.common import machine_info
from models.qwen3_next import SwitchGLU


def relative(got: mx.array, want: mx.array) -> float:
    return float((mx.abs(got - want).max() / mx.abs(want).max()).item())


def raw_forms(
    pairs: int = 90, experts: int = 64, inputs: int = 2048, outputs: int = 512
) -> dict[str, float]:
    """`gather_mm` with sorted indices, the lhs's unit axis by reshape or by view."""
    mx.random.seed(0)
    w = mx.random.normal((experts, outputs, inputs)) / inputs**0.5
    x = mx.random.normal((pairs, inputs))
    idx = mx.sort(mx.random.randint(0, experts, (pairs,)).astype(mx.int32))
    want = x.reshape(pairs, 1, inputs) @ mx.take(w, idx, axis=0).swapaxes(-1, -2)
    forms = {"reshape": x.reshape(pairs, 1, inputs), "view": x[:, None, :]}
    return {
        name: relative(
            mx.gather_mm(lhs, w.swapaxes(-1, -2), rhs_indices=idx, sorted_indices=True),
            want,
        )
        for name, lhs in forms.items()
    }


def switch_forms(tokens: int, dtype: mx.Dtype, glu: SwitchGLU) -> dict[str, float]:
    """`SwitchGLU` grouped and ungrouped against each token alone."""
    x = mx.random.normal((tokens, 2048)).astype(dtype)
    experts = mx.argsort(mx.random.uniform(shape=(tokens, 64)), axis=-1)[:, :10].astype(
        mx.int32
    )
    alone = mx.concatenate(
        [glu(x[i : i + 1], experts[i : i + 1]) for i in range(tokens)]
    ).astype(mx.float32)
    out = {}
    for name, threshold in (("grouped", 1), ("ungrouped", 1 << 30)):
        SwitchGLU.SORT_MIN = threshold
        out[name] = relative(glu(x, experts).astype(mx.float32), alone)
    SwitchGLU.SORT_MIN = 64
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", default="1,3,6,7,9,16,48")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    report: dict[str, Any] = {
        "machine": machine_info(),
        "device": str(mx.default_device()),
        "MLX_ENABLE_TF32": os.environ.get("MLX_ENABLE_TF32"),
        "gather_mm_sorted": raw_forms(),
        "switch_glu": [],
    }
    print("GATHER gather_mm sorted, lhs by", report["gather_mm_sorted"], flush=True)
    mx.random.seed(0)
    glu = SwitchGLU(2048, 512, 64)
    for dtype in (mx.float32, mx.bfloat16):
        glu.set_dtype(dtype)
        for tokens in (int(t) for t in args.tokens.split(",")):
            entry = {
                "dtype": str(dtype),
                "tokens": tokens,
                **switch_forms(tokens, dtype, glu),
            }
            report["switch_glu"].append(entry)
            print("GATHER", entry, flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
