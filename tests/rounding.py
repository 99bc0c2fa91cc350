"""How far two computations of the same math may differ on the device the
suite runs on.

On the CPU, a window's products and single-token ones are bit-identical
(specpipe routes them through one reference BLAS: tests/conftest.py), so the
tests bound them tightly, often at zero. MLX's GPU kernels pick a tiling per
shape, so the same sums round differently there. Measured on an H100
(mlx-cuda 0.32.4, TF32 off, thirty-third session): 1.2e-5 between fused and
separate projections of the tiny hybrid models, 2.4e-5 between a committed
window and one-by-one decoding, 5.3e-5 in the chunked recurrence's
strong-decay stress. `same_math` keeps the CPU's bound and gives a GPU the
rounding allowance below.
"""

from __future__ import annotations

import mlx.core as mx

GPU_ROUNDING = 1e-4


def on_gpu() -> bool:
    return bool(mx.default_device().type == mx.DeviceType.gpu)


def same_math(cpu_bound: float) -> float:
    """The bound for two computations of the same math: `cpu_bound` on the
    CPU, at least `GPU_ROUNDING` on a GPU."""
    return max(cpu_bound, GPU_ROUNDING) if on_gpu() else cpu_bound
