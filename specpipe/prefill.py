"""Prefill: process every row's tokens but the pending one into a model's state."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from models.base import CausalLM
from specpipe.state import RowState

PREFILL_CHUNK = 512


def prefill_rows(model: CausalLM, rows: Sequence[RowState]) -> Any:
    """A new cache for `rows` with every row prefilled. Graphs that cannot take
    right padding (recurrent layers) prefill row by row and stack the rows."""
    if model.padding_safe or len(rows) == 1:
        cache = model.make_cache(len(rows))
        prefill(model, cache, rows)
        return cache
    singles = []
    for row in rows:
        single = model.make_cache(1)
        prefill(model, single, [row])
        singles.append(single)
    return type(singles[0]).concat_rows(singles)


def prefill(model: CausalLM, cache: Any, rows: Sequence[RowState]) -> None:
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
        out = model(ids, cache, [start] * len(rows))
        if out.delta is not None:
            out.delta.commit(
                [min(PREFILL_CHUNK, max(row.length - start, 0)) for row in rows]
            )
        mx.eval(cache.arrays())
