"""The gated delta rule over a verify window: specpipe's per-position
recurrence (`models.gated_delta.gated_delta_rule`, one compiled step per
position, every position's state kept) against MLX's fused
`mx.fast.gated_delta_update` (outputs and the final state in one call; with a
per-row `mask` of the first kept positions it gives the state after that
prefix, which is how a commit could replay a window instead of keeping every
position's state).

Times (median of `--repeats`, ms, each evaluated alone) per (rows, window):
`per_position` (outputs + L states), `fused` (outputs + final state),
`replay` (the masked call a commit would run: the state after a per-row
prefix), and on a CUDA GPU `kernel` (specpipe's own window kernel,
models/gated_delta_cuda.py, outputs + L states) and `kernel_runtime_dims`
(the same kernel reading rows and window length at run time). Checks the fused outputs and states against the per-position
recurrence on this device (max abs difference, float32), the kernel's too.

    python bench/gdn_probe.py --out bench/results/gdn-probe.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import models  # noqa: F401  before mlx: routes its BLAS (models/blas.py)

# isort: split

import mlx.core as mx

from bench.common import machine_info, median_ms
from models.gated_delta import gated_delta_rule
from models.gated_delta_cuda import window_recurrence

SHAPES = {"qwen3-next": (16, 32, 128, 128), "qwen3.5-27b": (16, 48, 128, 128)}


def case(shape: str, rows: int, length: int, repeats: int) -> dict[str, Any]:
    hk, hv, dk, dv = SHAPES[shape]
    r = hv // hk
    key = mx.random.key(rows * 100 + length)
    ks = mx.random.split(key, 6)
    q = mx.random.normal((rows, length, hk, dk), key=ks[0])
    k = mx.random.normal((rows, length, hk, dk), key=ks[1])
    q = q * mx.rsqrt((q * q).sum(-1, keepdims=True) + 1e-6) * dk**-0.5
    k = k * mx.rsqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    v = mx.random.normal((rows, length, hv, dv), key=ks[2])
    g = -mx.random.uniform(shape=(rows, length, hv), key=ks[3])
    beta = mx.sigmoid(mx.random.normal((rows, length, hv), key=ks[4]))
    state = mx.random.normal((rows, hv, dk, dv), key=ks[5]) * 0.1
    kept = mx.array([(b % length) + 1 for b in range(rows)], dtype=mx.int32)
    mask = mx.arange(length)[None, :] < kept[:, None]
    mx.eval(q, k, v, g, beta, state, mask)
    qr, kr = mx.repeat(q, r, axis=2), mx.repeat(k, r, axis=2)
    decay = mx.exp(g)
    flipped = state.swapaxes(-1, -2)  # MLX's layout [B, Hv, Dv, Dk]
    mx.eval(qr, kr, decay, flipped)

    def ours() -> Any:
        out, states = gated_delta_rule(qr, kr, v, g, beta, state, True)
        return [out, *states]

    def fused() -> Any:
        return mx.fast.gated_delta_update(q, k, v, decay, beta, flipped)

    def replay() -> Any:
        return mx.fast.gated_delta_update(q, k, v, decay, beta, flipped, mask)[1]

    def kernel(runtime_dims: bool = False) -> Any:
        out, states = window_recurrence(q, k, v, decay, beta, state, True, runtime_dims)
        return [out, *(states[t] for t in range(length))]

    ref = ours()
    got = fused()
    extra: dict[str, Any] = {}
    if mx.cuda.is_available():
        for label, dims in (("kernel", False), ("kernel_runtime_dims", True)):
            try:
                mine = kernel(dims)
                extra[f"{label}_ms"] = median_ms(lambda d=dims: kernel(d), repeats)
                extra[f"{label}_out_diff"] = mx.abs(mine[0] - ref[0]).max().item()
                extra[f"{label}_state_diff"] = max(
                    mx.abs(a - b).max().item()
                    for a, b in zip(mine[1:], ref[1:], strict=True)
                )
            except Exception as exc:  # recorded: the run goes on
                extra[f"{label}_error"] = f"{type(exc).__name__}: {exc}"
        try:  # the final-state form (prefill windows of < 64 tokens)
            out, final = window_recurrence(q, k, v, decay, beta, state, False)
            extra["kernel_final_out_diff"] = mx.abs(out - ref[0]).max().item()
            extra["kernel_final_state_diff"] = mx.abs(final[0] - ref[-1]).max().item()
        except Exception as exc:  # recorded: the run goes on
            extra["kernel_final_error"] = f"{type(exc).__name__}: {exc}"
    prefix = replay().swapaxes(-1, -2)
    expected = mx.stack([ref[1 + int(n) - 1][b] for b, n in enumerate(kept.tolist())])
    return {
        "shape": shape,
        "rows": rows,
        "window": length,
        "per_position_ms": median_ms(ours, repeats),
        "fused_ms": median_ms(fused, repeats),
        "replay_ms": median_ms(replay, repeats),
        "out_diff": mx.abs(got[0] - ref[0]).max().item(),
        "state_diff": mx.abs(got[1].swapaxes(-1, -2) - ref[-1]).max().item(),
        "replay_diff": mx.abs(prefix - expected).max().item(),
        **extra,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="qwen3-next,qwen3.5-27b")
    parser.add_argument("--rows", default="1,32")
    parser.add_argument("--windows", default="1,2,4,8")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    report: dict[str, Any] = {"machine": machine_info(), "cases": []}
    for shape in args.shapes.split(","):
        for rows in [int(x) for x in args.rows.split(",")]:
            for length in [int(x) for x in args.windows.split(",")]:
                entry = case(shape, rows, length, args.repeats)
                report["cases"].append(entry)
                print(json.dumps(entry), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
