"""The MLX kernels a hybrid MoE model's prefill goes through, checked on the
default device against the same computation written out (or against the
CPU): where does a GPU prefill go wrong?

Checks (each prints one line per case and a summary of the bad ones):
- `sdpa`: `mx.fast.scaled_dot_product_attention`, causal and boolean masks,
  by query length, head size and dtype.
- `conv`: the GatedDeltaNet short conv (`mx.conv1d`, depthwise).
- `experts`: `SwitchGLU` (models/qwen3_next.py) with its (token, expert)
  pairs grouped by expert (sorted `gather_mm`) against ungrouped, and the
  raw sorted `gather_mm` with a stacked expert weight and with one half of a
  fused `[E, 2I, H]` weight (a strided view, as a sanitizer's split leaves it).
- `hybrid`: a tiny random Qwen3-Next's prefill logits (the test suite's
  config, HF transformers as reference) on the GPU and the CPU (needs torch
  and transformers).

On an H100 (mlx-cuda 0.32.4, thirty-third session) `hybrid` was wrong from
position 0 for 63+ token prompts until the loader copied every weight
row-major (`models.build.row_major`; the sanitizer's halves of a fused
`gate_up_proj` are strided views); `sdpa`, `conv` and the grouped experts
with stacked weights were right (bench/RESULTS.md). Run with
MLX_ENABLE_TF32=0 on a GPU.

    python bench/gpu_kernels.py [--checks sdpa,conv,experts,hybrid]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import mlx.core as mx

LENGTHS = (1, 6, 8, 9, 16, 32, 33, 48, 63, 64, 70)


def _report(rows: list[tuple[str, float, bool]]) -> int:
    for label, error, ok in rows:
        print(f"{label}: {error:.2e}{'' if ok else '  BAD'}", flush=True)
    bad = [label for label, _, ok in rows if not ok]
    print(f"-- {len(bad)} bad of {len(rows)}" + (f": {bad[:6]}" if bad else ""))
    return len(bad)


def _gap(got: mx.array, want: mx.array) -> float:
    """Largest error over the reference's largest magnitude (infinite where
    the device refused the computation)."""
    try:
        got32, want32 = got.astype(mx.float32), want.astype(mx.float32)
        return float((mx.abs(got32 - want32).max() / mx.abs(want32).max()).item())
    except RuntimeError as refused:
        print("refused:", str(refused)[:120])
        return float("inf")


def _tolerance(dtype: mx.Dtype) -> float:
    return 1e-5 if dtype == mx.float32 else 2e-2


def check_sdpa() -> int:
    rows = []
    for dim, dtype in ((16, mx.float32), (128, mx.float32), (128, mx.bfloat16)):
        for length in LENGTHS:
            for extra in (0, 8):  # keys past the window: a boolean mask
                mx.random.seed(length)
                span = length + extra
                q = mx.random.normal((1, 4, length, dim)).astype(dtype)
                k = mx.random.normal((1, 2, span, dim)).astype(dtype)
                v = mx.random.normal((1, 2, span, dim)).astype(dtype)
                seen = mx.arange(span)[None, :] <= mx.arange(length)[:, None] + extra
                scale = dim**-0.5
                got = mx.fast.scaled_dot_product_attention(
                    q, k, v, scale=scale, mask="causal" if extra == 0 else seen
                )
                k32 = mx.repeat(k.astype(mx.float32), 2, axis=1)
                v32 = mx.repeat(v.astype(mx.float32), 2, axis=1)
                scores = (q.astype(mx.float32) @ k32.swapaxes(-1, -2)) * scale
                want = mx.softmax(mx.where(seen, scores, -mx.inf), axis=-1) @ v32
                error = _gap(got, want)
                rows.append(
                    (
                        f"sdpa d{dim} {dtype} L{length} {'bool' if extra else 'causal'}",
                        error,
                        error <= _tolerance(dtype),
                    )
                )
    return _report(rows)


def check_conv() -> int:
    rows = []
    width = 4
    for channels, dtype in ((64, mx.float32), (8192, mx.float32), (8192, mx.bfloat16)):
        for length in LENGTHS:
            mx.random.seed(length)
            window = mx.random.normal((1, width - 1 + length, channels)).astype(dtype)
            weight = mx.random.normal((channels, width, 1)).astype(dtype)
            got = mx.conv1d(window, weight, groups=channels)
            x32, w32 = window.astype(mx.float32), weight[:, :, 0].astype(mx.float32)
            want = sum(
                (x32[:, j : j + length, :] * w32[:, j] for j in range(width)),
                mx.zeros((1, length, channels)),
            )
            error = _gap(got, want)
            rows.append(
                (
                    f"conv C{channels} {dtype} L{length}",
                    error,
                    error <= _tolerance(dtype),
                )
            )
    return _report(rows)


def check_experts() -> int:
    from models.qwen3_next import SwitchGLU

    rows = []
    for hidden, inner, experts, top_k in ((64, 32, 4, 2), (2048, 512, 64, 10)):
        for dtype in (mx.float32, mx.bfloat16):
            mx.random.seed(0)
            glu = SwitchGLU(hidden, inner, experts)
            glu.set_dtype(dtype)
            fused = mx.random.normal((experts, 2 * inner, hidden)).astype(dtype)
            halves = {
                "stacked": mx.contiguous(fused[:, :inner]),
                "sliced": fused[:, :inner],
            }
            for tokens in (6, 40, 63, 128):
                x = mx.random.normal((tokens, hidden)).astype(dtype)
                scores = mx.random.uniform(shape=(tokens, experts))
                idx = mx.argsort(scores, axis=-1)[:, :top_k].astype(mx.int32)
                label = f"{hidden}/{experts}x{top_k} {dtype} N{tokens}"
                grouped = glu(x, idx)
                saved, SwitchGLU.SORT_MIN = SwitchGLU.SORT_MIN, 10**9
                plain = glu(x, idx)
                SwitchGLU.SORT_MIN = saved
                error = _gap(grouped, plain)
                rows.append(
                    (f"SwitchGLU grouped {label}", error, error <= _tolerance(dtype))
                )
                flat = idx.reshape(-1)
                order = mx.argsort(flat)
                lhs = x[order // top_k].reshape(-1, 1, hidden)
                if dtype != mx.float32 and not mx.is_available(mx.gpu):
                    continue  # MLX's CPU gather_mm computes float32 only
                for form, weight in halves.items():
                    rhs = weight.swapaxes(-1, -2)
                    got = mx.gather_mm(
                        lhs, rhs, rhs_indices=flat[order], sorted_indices=True
                    )
                    want = lhs.astype(mx.float32) @ mx.take(
                        halves["stacked"].astype(mx.float32), flat[order], axis=0
                    ).swapaxes(-1, -2)
                    error = _gap(got, want)
                    rows.append(
                        (
                            f"gather_mm sorted {form} {label}",
                            error,
                            error <= _tolerance(dtype),
                        )
                    )
    return _report(rows)


def check_hybrid() -> int:
    import numpy as np

    from tests.models import hybrid_support as support
    from tests.models.test_qwen3_next import make_hf, ours

    hf = make_hf()
    ids = support.token_ids((1, 70), seed=2)
    reference = support.hf_logits(hf, ids)[0]
    devices = [mx.gpu, mx.cpu] if mx.is_available(mx.gpu) else [mx.cpu]
    rows = []
    for device in devices:
        mx.set_default_device(device)
        model = ours(hf)
        for prompt in (6, 32, 63, 70):
            head = support.step(model, model.make_cache(1), ids[:, :prompt], [0])[0]
            error = float(np.abs(head - reference[:prompt]).max())
            rows.append((f"hybrid {device} prompt {prompt}", error, error < 1e-4))
    return _report(rows)


CHECKS: dict[str, Callable[[], int]] = {
    "sdpa": check_sdpa,
    "conv": check_conv,
    "experts": check_experts,
    "hybrid": check_hybrid,
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checks", default=",".join(CHECKS))
    args = parser.parse_args()
    print(mx.__version__, mx.default_device(), flush=True)
    bad = sum(CHECKS[name]() for name in args.checks.split(","))
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
