"""host_ints: a step's small host-made int arrays, separate or as views of one."""

from __future__ import annotations

import mlx.core as mx
import pytest

import models.host_arrays as host_arrays
from models.host_arrays import host_ints

COLUMNS = (
    ([[5, 6], [7, 8], [9, 10]], mx.int32),
    ([1, 0, 1], mx.int32),
    ([40, 41, 42], mx.int32),
    ([0, 2**32 - 1, 12345], mx.uint32),
    ([3, 4, 5], mx.uint32),
)


@pytest.mark.parametrize("packs", [False, True])
def test_host_ints_equal_separate_arrays(
    monkeypatch: pytest.MonkeyPatch, packs: bool
) -> None:
    monkeypatch.setattr(host_arrays, "cuda_backend", lambda: packs)
    made = host_ints(*COLUMNS)
    for array, (values, dtype) in zip(made, COLUMNS, strict=True):
        assert array.dtype == dtype
        assert array.tolist() == values
    # a kernel reads each as its own contiguous array
    assert (made[0] * 2).tolist() == [[10, 12], [14, 16], [18, 20]]


def test_host_ints_keep_pooled_arrays_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    # one row: every array fits MLX's 8-byte pool, so none is a view
    monkeypatch.setattr(host_arrays, "cuda_backend", lambda: True)
    ids, last = host_ints(([[5, 6]], mx.int32), ([1], mx.int32))
    assert ids.tolist() == [[5, 6]] and last.tolist() == [1]


def test_host_ints_refuse_other_dtypes_and_ragged_rows() -> None:
    with pytest.raises(ValueError, match="int32 or uint32"):
        host_ints(([1, 2], mx.float32))
    with pytest.raises(ValueError, match="ragged"):
        host_ints(([[1, 2], [3]], mx.int32))
