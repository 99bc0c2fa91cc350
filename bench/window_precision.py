"""Whether a weight product's row depends on how many rows it is computed with.

Speculative decoding keeps plain decoding's tokens byte for byte only where a
verify window's product of M rows gives each row the bits a one-row step
gives it. This checks that for the products the models run (`x[M, K] @ W.T`)
on the current device, per dtype and window size M: the first row of the
M-row product against the same row computed alone (bit-equal or the largest
difference), and each against a float64 product on the host (the largest
relative error, over the output's scale).

MLX's CUDA backend runs float32 products of more than one row through cuBLAS
with TF32 tensor ops unless `MLX_ENABLE_TF32=0` is set before its first
product (MLX's default is on); a one-row product takes a matrix-vector kernel
in full float32. Run once with each setting:

    MLX_ENABLE_TF32=0 python bench/window_precision.py --out bench/results/window-precision-tf32off.json
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
import numpy as np

from bench.common import machine_info

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16}


def probe(dtype: mx.Dtype, rows: int, k: int, n: int, seed: int) -> dict[str, Any]:
    """One window size: row 0 of the `rows`-row product against row 0 alone."""
    mx.random.seed(seed)
    x = mx.random.normal((rows, k)).astype(dtype)
    w = (mx.random.normal((n, k)) / k**0.5).astype(dtype)
    window = x @ w.T
    single = x[:1] @ w.T
    mx.eval(window, single)
    reference = (
        np.asarray(x.astype(mx.float32), dtype=np.float64)
        @ np.asarray(w.astype(mx.float32), dtype=np.float64).T
    )
    scale = float(np.abs(reference).max())
    first = np.asarray(window[:1].astype(mx.float32), dtype=np.float64)
    alone = np.asarray(single.astype(mx.float32), dtype=np.float64)
    whole = np.asarray(window.astype(mx.float32), dtype=np.float64)
    return {
        "rows": rows,
        "row0_bit_equal_to_one_row": bool(np.array_equal(first, alone)),
        "row0_max_abs_diff_to_one_row": float(np.abs(first - alone).max()),
        "window_max_rel_error_vs_f64": float(np.abs(whole - reference).max()) / scale,
        "one_row_max_rel_error_vs_f64": float(np.abs(alone - reference[:1]).max())
        / scale,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", default="1,2,3,4,8,9,16", help="window sizes M")
    parser.add_argument(
        "--k", type=int, default=2048, help="inputs per row (the hidden size)"
    )
    parser.add_argument(
        "--n", type=int, default=8192, help="outputs (a q/k/v-sized product)"
    )
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    results = []
    for name in args.dtypes.split(","):
        for rows in (int(r) for r in args.rows.split(",")):
            entry = {
                "dtype": name,
                **probe(DTYPES[name], rows, args.k, args.n, args.seed),
            }
            results.append(entry)
            print(
                f"PRECISION {name:8s} M={rows:2d} row0==alone {entry['row0_bit_equal_to_one_row']!s:5s} "
                f"|diff| {entry['row0_max_abs_diff_to_one_row']:.3g} "
                f"rel.err window {entry['window_max_rel_error_vs_f64']:.3g} "
                f"alone {entry['one_row_max_rel_error_vs_f64']:.3g}",
                flush=True,
            )
    report = {
        "machine": machine_info(),
        "device": str(mx.default_device()),
        "MLX_ENABLE_TF32": os.environ.get("MLX_ENABLE_TF32"),
        "k": args.k,
        "n": args.n,
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
