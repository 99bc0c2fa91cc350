"""Prefill: process every row's tokens but the pending one into a model's state."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from models.base import CausalLM
from specpipe.state import RowState

PREFILL_CHUNK = 512


def prefill_rows(
    model: CausalLM, rows: Sequence[RowState], keep_hidden: bool = False
) -> tuple[Any, mx.array | None]:
    """A new cache for `rows` with every row prefilled, and (with `keep_hidden`)
    the last layer's hidden states `[B, L, H]` of the processed tokens, right-
    padded (a model that taps layers for its draft: their features instead,
    `ModelOutput.features`). Graphs that cannot take right padding (recurrent layers) prefill
    row by row and stack the rows."""
    if model.padding_safe or len(rows) == 1:
        cache = model.make_cache(len(rows))
        return cache, prefill(model, cache, rows, keep_hidden)
    singles = []
    hiddens = []
    for row in rows:
        single = model.make_cache(1)
        hiddens.append(prefill(model, single, [row], keep_hidden))
        singles.append(single)
    cache = type(singles[0]).concat_rows(singles)
    if not keep_hidden:
        return cache, None
    longest = max(row.length for row in rows)
    padded = []
    for row, hidden in zip(rows, hiddens, strict=True):
        assert hidden is not None
        if row.length < longest:
            pad = mx.zeros((1, longest - row.length, hidden.shape[-1]), hidden.dtype)
            hidden = mx.concatenate([hidden, pad], axis=1)
        padded.append(hidden)
    return cache, mx.concatenate(padded, axis=0)


def prefill(
    model: CausalLM, cache: Any, rows: Sequence[RowState], keep_hidden: bool = False
) -> mx.array | None:
    """Process every row's tokens but the pending one, right-padded and chunked.

    Only the caches (and, if kept, the hidden states) are evaluated: the
    prompt's logits are never computed."""
    lengths = [row.length for row in rows]
    longest = max(lengths)
    hidden: list[mx.array] = []
    if longest == 0:
        width = model.args.hidden_size * max(1, len(getattr(model, "taps", ())))
        return mx.zeros((len(rows), 0, width)) if keep_hidden else None
    grid = [list(row.tokens[:-1]) + [0] * (longest - row.length) for row in rows]
    cache.reserve(longest)
    for start in range(0, longest, PREFILL_CHUNK):
        ids = mx.array([g[start : start + PREFILL_CHUNK] for g in grid], dtype=mx.int32)
        out = model(ids, cache, [start] * len(rows), prefill=True)
        if out.delta is not None:
            out.delta.commit(
                [min(PREFILL_CHUNK, max(row.length - start, 0)) for row in rows]
            )
        if keep_hidden:
            hidden.append(out.features if out.features is not None else out.hidden)
        mx.eval(cache.arrays(), hidden)
    return mx.concatenate(hidden, axis=1) if keep_hidden else None
