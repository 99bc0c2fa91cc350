"""Committing a window whose states come stacked in one array (the CUDA
window kernel's output, models/gated_delta_cuda.py) adopts exactly the
states a window of separate per-position arrays adopts, for every pattern of
kept counts."""

from __future__ import annotations

import mlx.core as mx
import pytest

from models.cache import KVCache
from models.hybrid_cache import HybridCache, HybridDelta, WindowStates

B, L, HV, DK, DV, KERNEL, CHANNELS = 3, 4, 2, 3, 5, 4, 6


def committed(stacked: bool, per_position: bool, kept: list[int]) -> HybridCache:
    mx.random.seed(0)
    before = mx.random.normal((B, HV, DK, DV))
    count = L if per_position else 1
    states = [mx.random.normal((B, HV, DK, DV)) for _ in range(count)]
    conv_window = mx.random.normal((B, KERNEL - 1 + L, CHANNELS))
    cache = HybridCache(
        KVCache(1, B, 1, 4, mx.float32), [conv_window[:, : KERNEL - 1]], [before]
    )
    recurrent = (mx.stack(states),) if stacked else tuple(states)
    window = WindowStates(conv_window, recurrent, per_position, stacked=stacked)
    HybridDelta(cache, L, KERNEL, [window]).commit(kept)
    return cache


@pytest.mark.parametrize(
    "kept", [[0, 0, 0], [4, 4, 4], [2, 2, 2], [1, 3, 4], [0, 2, 4], [3, 0, 0]]
)
def test_stacked_states_commit_as_separate_ones(kept: list[int]) -> None:
    separate = committed(False, True, kept)
    stacked = committed(True, True, kept)
    assert mx.array_equal(stacked.recurrent[0], separate.recurrent[0])
    assert mx.array_equal(stacked.conv[0], separate.conv[0])


@pytest.mark.parametrize("kept", [[0, 0, 0], [4, 4, 4], [4, 0, 4]])
def test_a_stacked_final_state_commits_all_or_nothing(kept: list[int]) -> None:
    separate = committed(False, False, kept)
    stacked = committed(True, False, kept)
    assert mx.array_equal(stacked.recurrent[0], separate.recurrent[0])
    with pytest.raises(AssertionError, match="all or nothing"):
        committed(True, False, [2, 4, 4])
