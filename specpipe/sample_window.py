"""The sample-window stage: the target's own token at every window position.

Position i of row b is sampled exactly as plain decoding samples generated
token `step_b + i`: same step key (seed_b, step_b + i), same filters, and a
token history made of the row's context and the window's inputs up to i. A
draft accepted before i equals the target's own sample, so that history is
the one plain decoding would have. Nothing here reads a value back.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from schemas.request import SamplingParams
from specpipe.sampling import key_arrays, sample
from specpipe.state import RowState


def window_history(
    rows: Sequence[RowState],
    ids: mx.array,  # [B, W]
    context: int,
) -> mx.array:
    """`[B * W, C]`: for position i of row b, the last C tokens up to window[i],
    oldest first; -1 where the row has fewer (`apply_penalties`)."""
    width = ids.shape[1]
    before = []
    for row in rows:
        tail = list(row.tokens[:-1][-context:])
        before.append([-1] * (context - len(tail)) + tail)
    seq = mx.concatenate([mx.array(before, dtype=mx.int32), ids], axis=1)  # [B, C+W]
    index = mx.arange(width)[:, None] + mx.arange(1, context + 1)[None, :]  # [W, C]
    gathered = mx.take(seq, index.reshape(-1), axis=1)  # [B, W*C]
    return gathered.reshape(len(rows) * width, context)


def sample_window(
    logits: mx.array,  # [B, W, V]
    ids: mx.array | None,  # [B, W], needed only for a penalty
    rows: Sequence[RowState],
    sampling: Sequence[SamplingParams] | None = None,
) -> mx.array:
    """The target's tokens `[B, W]` int32; `sampling` overrides each row's params."""
    B, W, V = logits.shape
    params = list(sampling) if sampling is not None else [row.sampling for row in rows]
    if all(p.argmax_only for p in params):
        # no randomness, nothing added: one argmax for every row and position
        return mx.argmax(logits, axis=-1).astype(mx.int32)
    groups: dict[SamplingParams, list[int]] = {}
    for b, p in enumerate(params):
        groups.setdefault(p, []).append(b)
    parts: list[mx.array] = []
    order: list[int] = []
    for p, members in groups.items():
        chosen = [rows[b] for b in members]
        picked = logits if len(members) == B else logits[mx.array(members)]
        flat = picked.reshape(len(members) * W, V)
        seeds, steps = key_arrays(
            [p.seed for _ in chosen for _ in range(W)],
            [row.step + i for row in chosen for i in range(W)],
        )
        history = None
        if p.needs_history:
            assert ids is not None, "a penalty needs the window's ids"
            sub_ids = ids if len(members) == B else ids[mx.array(members)]
            history = window_history(chosen, sub_ids, p.history_context)
        parts.append(sample(flat, p, seeds, steps, history).reshape(len(members), W))
        order.extend(members)
    if len(parts) == 1:
        return parts[0]
    stacked = mx.concatenate(parts, axis=0)
    inverse = [order.index(b) for b in range(B)]
    return stacked[mx.array(inverse)]
