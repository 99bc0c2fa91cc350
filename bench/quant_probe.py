"""Where does the default device's quantized product differ from the product
with the dequantized weight?

Three products per case: MLX's own (`mx.quantized_matmul`, weights
transposed, as `nn.QuantizedLinear` calls it), specpipe's (`models.parallel
.project`, which regroups single-group weights on a GPU) and MLX's gathered
expert product (`mx.gather_qmm`, as the MoE layers call it, two of four
experts per row). Sweeps bits, group size, the inner width K and the row
count; prints every case and a summary of the wrong ones. Run with
MLX_ENABLE_TF32=0 on a GPU so that the float32 reference is exact to
rounding (mlx-cuda 0.32.4 on an H100: MLX's own product is wrong for 2+
rows where K is one group of 64 or 128; bench/RESULTS.md).

    python bench/quant_probe.py [--dtype float32|bfloat16] [--quick] [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from models.parallel import project

EXPERTS, TOP_K = 4, 2


def _gap(got: mx.array, want: mx.array, tol: float) -> tuple[float, bool]:
    """Largest error against the float32 reference, and whether it is within
    `tol` of the reference's scale; a product the device refuses to run (MLX
    raises at evaluation) counts as wrong, with an infinite gap."""
    try:
        gap = mx.abs(got.astype(mx.float32) - want).max().item()
    except RuntimeError as refused:
        print("refused:", str(refused)[:160], flush=True)
        return float("inf"), False
    scale = mx.abs(want).max().item()
    return gap, gap == gap and gap <= tol * max(scale, 1.0)


def sweep(dtype: mx.Dtype, quick: bool) -> list[dict[str, Any]]:
    cases: list[dict[str, Any]] = []
    mx.random.seed(0)
    tol = 1e-4 if dtype == mx.float32 else 2e-2
    ks = (64, 128, 896) if quick else (32, 64, 96, 128, 192, 256, 384, 512, 896)
    n = 128
    for bits in (4, 5, 8):  # 5: a GGUF's Q5_* blocks kept (models/gguf_quant.py)
        for group in (32, 64, 128):
            for k in ks:
                if k % group:
                    continue
                w = mx.random.normal((EXPERTS, n, k))
                wq, scales, biases = mx.quantize(w, group, bits)
                deq = mx.dequantize(wq, scales, biases, group, bits)
                for rows in (1, 2, 16) if quick else (1, 2, 3, 4, 5, 8, 16, 33, 64):
                    x = mx.random.normal((rows, k)).astype(dtype)
                    want = x.astype(mx.float32) @ deq[0].T
                    mlx = mx.quantized_matmul(
                        x, wq[0], scales[0], biases[0], True, group, bits
                    )
                    ours = project(
                        x, wq[0], scales[0], biases[0], group_size=group, bits=bits
                    )
                    experts = mx.random.randint(0, EXPERTS, (rows, TOP_K))
                    gathered = mx.gather_qmm(
                        x[:, None, None, :],
                        wq,
                        scales,
                        biases,
                        rhs_indices=experts,
                        transpose=True,
                        group_size=group,
                        bits=bits,
                    )  # [rows, k, 1, n]
                    gathered_want = x.astype(mx.float32)[:, None, None, :] @ mx.take(
                        deq, experts, axis=0
                    ).swapaxes(-1, -2)
                    case: dict[str, Any] = {
                        "bits": bits,
                        "group": group,
                        "k": k,
                        "rows": rows,
                    }
                    for name, got, ref in (
                        ("mlx", mlx, want),
                        ("specpipe", ours, want),
                        ("gather", gathered, gathered_want),
                    ):
                        case[f"{name}_gap"], case[f"{name}_ok"] = _gap(got, ref, tol)
                    print(
                        bits,
                        group,
                        k,
                        rows,
                        *(
                            f"{p}:{'ok' if case[p + '_ok'] else 'WRONG'}"
                            for p in ("mlx", "specpipe", "gather")
                        ),
                        flush=True,
                    )
                    cases.append(case)
    return cases


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument(
        "--quick", action="store_true", help="three widths, three row counts"
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    dtype = getattr(mx, args.dtype)
    print(mx.__version__, mx.default_device(), args.dtype)
    cases = sweep(dtype, args.quick)
    for product in ("mlx", "specpipe", "gather"):
        bad = [c for c in cases if not c[f"{product}_ok"]]
        shapes = sorted({(c["group"], c["k"]) for c in bad})
        print(
            f"{product}: {len(bad)} wrong of {len(cases)}; (group, K) {shapes}; "
            f"rows {sorted({c['rows'] for c in bad})}"
        )
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "device": str(mx.default_device()),
                    "dtype": args.dtype,
                    "mlx": mx.__version__,
                    "cases": cases,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
