"""The verify stage: the window `[pending, d1..dk]` of every row, right-padded
to a rectangle, through one target forward at each row's processed length.

Padding repeats the pending token; causal attention keeps it from touching
real positions, the walk never reads past a row's own drafts, and the commit
keeps only the accepted prefix, so padded positions are scratch.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
from attrs import frozen

from models.base import CausalLM, ModelOutput
from models.cache import KVCache
from specpipe.draft import Proposal
from specpipe.state import RowState


@frozen
class Window:
    ids: mx.array  # [B, W] int32
    offsets: tuple[int, ...]  # per row, the position of its pending token

    @property
    def width(self) -> int:
        return int(self.ids.shape[1])


def build_window(rows: Sequence[RowState], proposal: Proposal) -> Window:
    offsets = tuple(row.length for row in rows)
    pending = [row.pending for row in rows]
    if proposal.device is not None:
        head = mx.array(pending, dtype=mx.int32)[:, None]
        ids = mx.concatenate([head, proposal.device.astype(mx.int32)], axis=1)
        return Window(ids, offsets)
    assert proposal.host is not None
    width = 1 + max((len(d) for d in proposal.host), default=0)
    grid = [
        [p, *d, *([p] * (width - 1 - len(d)))]
        for p, d in zip(pending, proposal.host, strict=True)
    ]
    return Window(mx.array(grid, dtype=mx.int32), offsets)


def verify(model: CausalLM, cache: KVCache, window: Window) -> ModelOutput:
    return model(window.ids, cache, window.offsets)
