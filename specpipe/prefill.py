"""Prefill: process every row's tokens but the pending one into a model's state."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from models.base import CausalLM
from specpipe.state import RowState

PREFILL_CHUNK = 512


def prefill_rows(
    model: CausalLM,
    rows: Sequence[RowState],
    keep_hidden: bool = False,
    restored: Sequence[tuple[Any, int] | None] | None = None,
) -> tuple[Any, mx.array | None]:
    """A new cache for `rows` with every row prefilled, and (with `keep_hidden`)
    the last layer's hidden states `[B, L, H]` of the processed tokens, right-
    padded (a model that taps layers for its draft: their features instead,
    `ModelOutput.features`). Graphs that cannot take right padding (recurrent layers) prefill
    row by row and stack the rows.

    `restored[b]`, where given, is a one-row cache holding row b's first
    `begin` tokens already (a prompt-cache checkpoint's copy) and that
    `begin`: the row prefills from there, and its hidden states start there."""
    resumed = restored is not None and any(r is not None for r in restored)
    if not resumed and (model.padding_safe or len(rows) == 1):
        cache = model.make_cache(len(rows))
        return cache, prefill(model, cache, rows, keep_hidden)
    starts = list(restored) if restored is not None else [None] * len(rows)
    singles = []
    hiddens = []
    for row, start in zip(rows, starts, strict=True):
        single, begin = start if start is not None else (model.make_cache(1), 0)
        hiddens.append(prefill(model, single, [row], keep_hidden, begin))
        singles.append(single)
    cache = type(singles[0]).concat_rows(singles)
    if not keep_hidden:
        return cache, None
    kept = [h for h in hiddens if h is not None]
    longest = max(int(h.shape[1]) for h in kept)
    # a row with nothing left to prefill returns an empty float32 array
    dtype = next((h.dtype for h in kept if h.shape[1]), kept[0].dtype)
    padded = []
    for hidden in kept:
        if hidden.shape[1] < longest:
            pad = mx.zeros((1, longest - hidden.shape[1], hidden.shape[-1]), dtype)
            hidden = mx.concatenate([hidden.astype(dtype), pad], axis=1)
        padded.append(hidden)
    return cache, mx.concatenate(padded, axis=0)


def prefill(
    model: CausalLM,
    cache: Any,
    rows: Sequence[RowState],
    keep_hidden: bool = False,
    begin: int = 0,
) -> mx.array | None:
    """Process every row's tokens but the pending one, right-padded and chunked;
    from position `begin` on, where `cache` already holds the rows' first
    `begin` tokens (a prompt-cache checkpoint), and then the hidden states
    returned are those of positions `begin ..` only.

    Only the caches (and, if kept, the hidden states) are evaluated: the
    prompt's logits are never computed."""
    lengths = [row.length for row in rows]
    longest = max(lengths)
    assert all(begin <= n for n in lengths), "a row ends before `begin`"
    hidden: list[mx.array] = []
    if longest == begin:
        width = model.args.hidden_size * max(1, len(getattr(model, "taps", ())))
        return mx.zeros((len(rows), 0, width)) if keep_hidden else None
    grid = [list(row.tokens[begin:-1]) + [0] * (longest - row.length) for row in rows]
    cache.reserve(longest)
    for start in range(0, longest - begin, PREFILL_CHUNK):
        ids = mx.array([g[start : start + PREFILL_CHUNK] for g in grid], dtype=mx.int32)
        out = model(ids, cache, [begin + start] * len(rows), prefill=True)
        if out.delta is not None:
            out.delta.commit(
                [min(PREFILL_CHUNK, max(n - begin - start, 0)) for n in lengths]
            )
        if keep_hidden:
            hidden.append(out.features if out.features is not None else out.hidden)
        mx.eval(cache.arrays(), hidden)
    return mx.concatenate(hidden, axis=1) if keep_hidden else None
