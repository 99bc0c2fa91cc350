"""Prefill: process every row's tokens but the pending one into a model's state."""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from models.base import CausalLM
from models.cache import KVCache
from specpipe.state import RowState

PREFILL_CHUNK = 512


def prefill(model: CausalLM, cache: KVCache, rows: Sequence[RowState]) -> None:
    """Process every row's tokens but the pending one, right-padded and chunked.

    Only the caches are evaluated: the prompt's logits are never computed."""
    lengths = [row.length for row in rows]
    longest = max(lengths)
    if longest == 0:
        return
    grid = [list(row.tokens[:-1]) + [0] * (longest - row.length) for row in rows]
    cache.reserve(longest)
    for start in range(0, longest, PREFILL_CHUNK):
        ids = mx.array([g[start : start + PREFILL_CHUNK] for g in grid], dtype=mx.int32)
        model(ids, cache, [start] * len(rows))
        mx.eval(cache.arrays())
