"""Float32 products on a GPU: MLX's TF32 default and byte-identical output.

MLX's CUDA backend runs a float32 matrix product of more than one row as a
TF32 tensor-core product (about 1e-3 relative error) unless `MLX_ENABLE_TF32`
is 0 when its first product runs (MLX reads it once); a product of one row
stays in full float32. A verify window's products then round far from a
plain step's, so a near-tied token can come out differently from plain
decoding (H200: a row of a 2048 x 8192 product differs from the same row
alone by ~1e-3 with TF32, ~1e-6 without; bench/window_precision.py,
bench/RESULTS.md). bfloat16 weights are unaffected by the setting (their
products accumulate in float32 either way; a window still rounds its outputs
unlike a step on a GPU, see README "Exactness").

The `specpipe` command turns TF32 off unless the environment sets
`MLX_ENABLE_TF32`; a program that loads float32 weights on a GPU with it on
(MLX's default) gets a one-line notice from `specpipe.api.load`.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Protocol

import mlx.core as mx
from mlx.utils import tree_flatten

ENV = "MLX_ENABLE_TF32"

_noticed = False


def prefer_exact_float32() -> None:
    """Full-float32 products for this process unless its environment chose
    (call before MLX's first product: MLX reads the variable once)."""
    os.environ.setdefault(ENV, "0")


def tf32_on() -> bool:
    """Whether MLX runs float32 products of several rows as TF32 here (its
    default; off only where the variable parses as the integer 0)."""
    try:
        return int(os.environ.get(ENV, "1").strip()) != 0
    except ValueError:
        return True


class _Weighted(Protocol):
    """A model's weights (an `nn.Module`, or a `CausalLM`)."""

    def parameters(self) -> dict[str, Any]: ...


def float32_products(model: _Weighted) -> bool:
    """Whether the model holds a float32 weight matrix."""
    leaves = tree_flatten(model.parameters())
    return any(
        isinstance(leaf, tuple)
        and isinstance(leaf[1], mx.array)
        and leaf[1].dtype == mx.float32
        and leaf[1].ndim >= 2
        for leaf in leaves
    )


def tf32_notice(model: _Weighted) -> str | None:
    """The line to show when this model's float32 products will run as TF32
    on the GPU (None when they will not)."""
    if mx.default_device().type != mx.DeviceType.gpu or not tf32_on():
        return None
    if not float32_products(model):
        return None
    return (
        f"specpipe: float32 products on this GPU run as TF32 ({ENV} is not 0): a "
        "verify window rounds unlike a single step, so output may differ from plain "
        f"decoding at near-tied tokens; set {ENV}=0 before the first product for "
        "byte-identical float32 output"
    )


def notice_tf32(model: _Weighted) -> None:
    """Print `tf32_notice` once per process."""
    global _noticed
    line = tf32_notice(model)
    if line is not None and not _noticed:
        _noticed = True
        print(line, file=sys.stderr)
