"""Projections of one input run as one product (q/k/v; gate/up).

A decoder layer multiplies its input by q, k and v (and the MLP's input by
gate and up): seven products per layer where four would do. On a GPU each
product is a kernel launch plus host work, and for a verify window of two
or more tokens a small-M GEMM is several times dearer than the single-token
matrix-vector kernel (bench/gemm_probe.py: the Qwen2.5-1.5B layer products
of a 5-token window 3.9-4.6 ms separate, 1.9 ms fused, on the H200); on the
CPU it is fewer, larger products to split over threads.

The checkpoint's layers stay as they are (names, per-layer quantization,
saving): `fuse_projections` concatenates each group's arrays into one
product and re-points every part's arrays at row ranges of it (views: no
second copy). A group fuses only when its parts agree (all float with one
dtype, or all quantized alike, biases alike). Each value is still one dot
product over the same inputs, so on the CPU the fused output equals the
separate ones bit for bit; on a GPU the library may pick another GEMM
algorithm for the wider product (last-bit differences, as between window
and single-token forwards). If anything replaces a part's arrays later
(`update`, `set_dtype`, quantizing), the group is stale and the layer runs
its parts separately again.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn
from attrs import frozen

from models.parallel import project

_ARRAYS = ("weight", "scales", "biases", "bias")


@frozen(eq=False)
class FusedProjection:
    """One product standing for `len(sizes)` projections of the same input."""

    arrays: dict[str, mx.array]  # weight / scales / biases / bias, rows concatenated
    installed: tuple[tuple[tuple[str, mx.array], ...], ...]  # per part, (name, view)
    sizes: tuple[int, ...]  # output rows per part
    group_size: int = 64
    bits: int = 0
    mode: str = "affine"

    def current(self, parts: Sequence[nn.Module]) -> bool:
        """Whether every part still holds the views it was given (checked on
        every call: plain loops, it is on the host's path each forward)."""
        for part, views in zip(parts, self.installed, strict=True):
            for name, view in views:
                if part.get(name) is not view:
                    return False
        return True

    def __call__(self, x: mx.array) -> mx.array:  # [..., I] -> [..., sum(sizes)]
        a = self.arrays
        return project(
            x,
            a["weight"],
            a.get("scales"),
            a.get("biases"),
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
            bias=a.get("bias"),
        )


def split_last(y: mx.array, sizes: Sequence[int]) -> list[mx.array]:
    """`y`'s last axis cut into consecutive pieces of `sizes` (views)."""
    out, start = [], 0
    for size in sizes:
        out.append(y[..., start : start + size])
        start += size
    return out


def _present(part: nn.Module) -> tuple[str, ...]:
    return tuple(n for n in _ARRAYS if n in part)


def _signature(part: nn.Module) -> tuple[object, ...] | None:
    if isinstance(part, nn.QuantizedLinear):
        return (
            "q",
            part.bits,
            part.group_size,
            part.mode,
            part["scales"].dtype,
            _present(part),
        )
    if isinstance(part, nn.Linear):
        return ("f", part["weight"].dtype, _present(part))
    return None


def fuse(parts: Sequence[nn.Module]) -> FusedProjection | None:
    """Fuse `parts` (projections of one input), or None when they differ in kind."""
    signatures = {_signature(p) for p in parts}
    if len(signatures) != 1 or None in signatures:
        return None
    if len({p["weight"].shape[1:] for p in parts}) != 1:
        return None
    names = _present(parts[0])
    arrays = {n: mx.concatenate([p[n] for p in parts], axis=0) for n in names}
    mx.eval(arrays)
    sizes = tuple(int(p["weight"].shape[0]) for p in parts)
    installed: list[tuple[tuple[str, mx.array], ...]] = []
    start = 0
    for part, size in zip(parts, sizes, strict=True):
        views = tuple(arrays[n][start : start + size] for n in names)
        mx.eval(views)
        for n, v in zip(names, views, strict=True):
            part[n] = v
        installed.append(tuple(zip(names, views, strict=True)))
        start += size
    first = parts[0]
    if isinstance(first, nn.QuantizedLinear):
        return FusedProjection(
            arrays, tuple(installed), sizes, first.group_size, first.bits, first.mode
        )
    return FusedProjection(arrays, tuple(installed), sizes)


def fused_or_none(
    fused: FusedProjection | None, parts: Sequence[nn.Module]
) -> FusedProjection | None:
    """`fused` while it still stands for `parts`."""
    return fused if fused is not None and fused.current(parts) else None


def fuse_projections(model: nn.Module) -> int:
    """Fuse every layer's projection groups (modules with `fuse_projections`);
    returns how many groups were fused."""
    count = 0
    for _, module in model.named_modules():
        method = getattr(module, "fuse_projections", None)
        if callable(method):
            count += int(method())
    return count
