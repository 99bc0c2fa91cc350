"""Products on several CPU streams of arrays that the GPU computed (MLX CUDA).

`models/parallel.py` splits a CPU product by output rows over one new CPU
stream per thread. On an H200 (mlx-cuda 0.32.4), decoding a Qwen2.5-shaped
model on the GPU and then the same weights on the CPU in one process
(`bench/device_parity.py --split-threads 16`) crashed, hung or gave wrong
logits; it ran right without the split, with the CPU first, or with the
weights copied into CPU-made arrays first. This probe tries the same with
MLX alone, one variant per child process (a crash ends only its child): the
weight, bias and input made on the GPU (or the CPU), then `x @ w.T` or
`addmm(bias, x, w.T)` split over N CPU streams and concatenated, against the
same product on the CPU unsplit, computed before the split ones or
(`-first`) after them, so that the split products are the CPU's first use
of the GPU's arrays (as in a model's first CPU forward; a `-first` variant
makes new arrays every repeat).

    python bench/cpu_streams_probe.py --out bench/results/cpu-streams-probe.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

VARIANTS = {
    # name: (where the arrays are made, product, streams, whether the split
    # products are the CPU's first use of the arrays)
    "gpu-matmul-split": ("gpu", "matmul", 16, False),
    "gpu-addmm-split": ("gpu", "addmm", 16, False),
    "gpu-addmm-one": ("gpu", "addmm", 1, False),
    "gpu-addmm-split2": ("gpu", "addmm", 2, False),
    "cpu-addmm-split": ("cpu", "addmm", 16, False),
    "gpu-copied-addmm-split": ("gpu-copied", "addmm", 16, False),
    "gpu-matmul-split-first": ("gpu", "matmul", 16, True),
    "gpu-addmm-split-first": ("gpu", "addmm", 16, True),
    "gpu-addmm-one-first": ("gpu", "addmm", 1, True),
    "cpu-addmm-split-first": ("cpu", "addmm", 16, True),
}


def child(
    made: str, op: str, streams: int, first: bool, repeats: int
) -> dict[str, Any]:
    import mlx.core as mx

    def make(seed: int) -> tuple[mx.array, mx.array, mx.array]:
        mx.set_default_device(mx.cpu if made == "cpu" else mx.gpu)
        mx.random.seed(seed)
        arrays = (
            mx.random.normal((4864, 896)),
            mx.random.normal((4864,)),
            mx.random.normal((3, 7, 896)),
        )
        mx.eval(*arrays)
        mx.set_default_device(mx.cpu)
        if made == "gpu-copied":  # fresh CPU-made copies of the GPU's arrays
            arrays = tuple(mx.array(a.tolist()) for a in arrays)  # type: ignore[assignment]
            mx.eval(*arrays)
        return arrays

    def product(
        w: mx.array, bias: mx.array, x: mx.array, rows: slice, stream: Any
    ) -> mx.array:
        if op == "addmm":
            return mx.addmm(bias[rows], x, w[rows].T, stream=stream)
        return mx.matmul(x, w[rows].T, stream=stream)

    pool = [mx.new_stream(mx.cpu) for _ in range(streams)]
    worst = 0.0
    w, bias, x = make(0)
    want = None if first else product(w, bias, x, slice(None), mx.cpu)
    for repeat in range(repeats):
        if first:  # new arrays, their first CPU use the split products
            w, bias, x = make(repeat)
        step = -(-w.shape[0] // streams)
        rows = [
            slice(i * step, min((i + 1) * step, w.shape[0])) for i in range(streams)
        ]
        got = mx.concatenate(
            [product(w, bias, x, r, s) for r, s in zip(rows, pool, strict=True)],
            axis=-1,
        )
        mx.eval(got)
        if first:  # the unsplit product after the split ones
            want = product(w, bias, x, slice(None), mx.cpu)
        assert want is not None
        worst = max(worst, mx.abs(got - want).max().item())
    return {"max_abs_diff": worst, "repeats": repeats}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=60)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*VARIANTS[args.child], args.repeats)), flush=True)
        return
    report: dict[str, Any] = {}
    for name in args.variants.split(","):
        command = [sys.executable, "-X", "faulthandler", __file__, "--child", name,
                   "--repeats", str(args.repeats)]  # fmt: skip
        try:
            done = subprocess.run(
                command, capture_output=True, text=True, timeout=args.timeout
            )
            result: dict[str, Any] = {
                "returncode": done.returncode,
                "stderr": done.stderr[-600:],
            }
            if done.returncode == 0:
                result.update(json.loads(done.stdout.strip().splitlines()[-1]))
        except subprocess.TimeoutExpired:
            result = {"returncode": None, "hung": f"no answer in {args.timeout} s"}
        report[name] = result
        print("STREAMS", name, json.dumps(result)[:400], flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
