"""Small integer arrays made from host values, for one step of a model.

MLX's CUDA backend keeps an array made from host values in managed memory.
An array of at most 8 bytes comes from a pool the GPU reads in place; a
larger one moves to the GPU when a kernel first touches it: a page fault per
array and per step (~50 us each on the H200, whose host is across PCIe:
`bench/round_parts.py --rows 3` against `--rows 2`, bench/RESULTS.md).
`host_ints` makes a step's arrays with one such fault at most: each its own
array while at most one of them is larger than 8 bytes, else views of one
array (one allocation, one fault).
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from models.cache import cuda_backend

# MLX's CUDA allocator serves allocations of at most this many bytes from its
# pool of host memory the GPU reads in place (`small_block_size`)
POOLED_BYTES = 8

Ints = Sequence[int] | Sequence[Sequence[int]]


def _shape(values: Ints) -> tuple[int, ...]:
    if values and not isinstance(values[0], int):
        rows = [len(v) for v in values]  # type: ignore[arg-type]
        if len(set(rows)) != 1:
            raise ValueError(f"host_ints: ragged rows {rows}")
        return (len(values), rows[0])
    return (len(values),)


def _flat(values: Ints) -> list[int]:
    if values and not isinstance(values[0], int):
        return [v for row in values for v in row]  # type: ignore[union-attr]
    return list(values)  # type: ignore[arg-type]


def host_ints(*arrays: tuple[Ints, mx.Dtype]) -> tuple[mx.array, ...]:
    """One array per (values, dtype) (values a list, or a list of equal-length
    lists; dtype int32 or uint32), as separate arrays, or, on the CUDA
    backend when two or more are larger than MLX's pooled size, as views of
    one uint32 array."""
    for _, dtype in arrays:
        if dtype not in (mx.int32, mx.uint32):
            raise ValueError(f"host_ints: int32 or uint32 arrays, not {dtype}")
    shapes = [_shape(values) for values, _ in arrays]
    large = sum(4 * _size(shape) > POOLED_BYTES for shape in shapes)
    if large < 2 or not cuda_backend():
        return tuple(mx.array(list(values), dtype=dtype) for values, dtype in arrays)
    flat = [v & 0xFFFFFFFF for values, _ in arrays for v in _flat(values)]
    packed = mx.array(flat, dtype=mx.uint32)
    out = []
    start = 0
    for shape, (_, dtype) in zip(shapes, arrays, strict=True):
        size = _size(shape)
        piece = packed[start : start + size].reshape(shape)
        out.append(piece if dtype == mx.uint32 else piece.view(mx.int32))
        start += size
    return tuple(out)


def _size(shape: tuple[int, ...]) -> int:
    size = 1
    for n in shape:
        size *= n
    return size
