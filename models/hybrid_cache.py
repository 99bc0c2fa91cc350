"""State of a hybrid model: position-indexed KV for its attention layers, and
per linear-attention layer a committed conv state and recurrent state.

Attention KV rolls back for free (see models/cache.py). Recurrent state cannot
be trimmed: it folds every processed token in. So a forward never touches the
committed conv / recurrent states; it returns a `HybridDelta` holding, per
linear layer, the states after each position of its window, and `commit(kept)`
adopts, per row, the one after the first kept[b] positions. Committing k
positions of a window therefore equals decoding those k tokens one by one.

Layouts (per linear layer):
- conv state `[B, K-1, C]`, model dtype: the last K-1 conv inputs (C = the
  q, k and v channels); the window's `[B, K-1+L, C]` concatenation of old state
  and inputs holds every per-position conv state as a slice.
- recurrent state `[B, Hv, Dk, Dv]`, float32: the gated delta rule's memory.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
from attrs import frozen

from models.cache import KVCache


class HybridCache:
    """Per-row state of a hybrid model; implements `models.base.ModelCache`.

    `kv` is indexed by attention-layer number (0 for the first attention
    layer). `conv` and `recurrent` are indexed by linear-layer number; their
    arrays are committed values, replaced (never written) by `adopt`.
    """

    def __init__(
        self,
        kv: KVCache,
        conv: Sequence[mx.array],  # per linear layer [B, K-1, C]
        recurrent: Sequence[mx.array],  # per linear layer [B, Hv, Dk, Dv] f32
    ) -> None:
        assert len(conv) == len(recurrent), "one conv and one recurrent state per layer"
        self.kv = kv
        self.conv: tuple[mx.array, ...] = tuple(conv)
        self.recurrent: tuple[mx.array, ...] = tuple(recurrent)

    @property
    def batch(self) -> int:
        return self.kv.batch

    def reserve(self, end: int) -> None:
        self.kv.reserve(end)

    def arrays(self) -> list[mx.array]:
        return [*self.kv.arrays(), *self.conv, *self.recurrent]

    # recurrent states fold in every position: no earlier state can be had
    truncatable = False

    def adopt(self, conv: Sequence[mx.array], recurrent: Sequence[mx.array]) -> None:
        """Replace the committed linear-layer states with new values."""
        assert len(conv) == len(self.conv) and len(recurrent) == len(self.recurrent)
        self.conv = tuple(conv)
        self.recurrent = tuple(recurrent)

    def take_rows(self, rows: Sequence[int], end: int | None = None) -> HybridCache:
        """A new cache holding the given rows, in that order (a copy); `end`
        as `KVCache.take_rows`'s (the recurrent states are whole either way)."""
        index = mx.array(list(rows), dtype=mx.int32)
        return HybridCache(
            self.kv.take_rows(rows, end),
            [mx.take(c, index, axis=0) for c in self.conv],
            [mx.take(r, index, axis=0) for r in self.recurrent],
        )

    @staticmethod
    def concat_rows(caches: Sequence[HybridCache]) -> HybridCache:
        """Stack the rows of several caches of one model into one (a copy)."""
        first = caches[0]
        return HybridCache(
            type(first.kv).concat_rows([c.kv for c in caches]),
            [
                mx.concatenate([c.conv[i] for c in caches])
                for i in range(len(first.conv))
            ],
            [
                mx.concatenate([c.recurrent[i] for c in caches])
                for i in range(len(first.recurrent))
            ],
        )


@frozen
class WindowStates:
    """One linear layer's states over a window of L positions."""

    # [old conv state, window inputs]: the conv state after p positions is
    # `conv_window[:, p : p + K - 1]`
    conv_window: mx.array  # [B, K-1+L, C]
    # per_position: the recurrent state after positions 1..L; else only the
    # state after all L positions (long prefill chunks)
    recurrent: tuple[mx.array, ...]  # each [B, Hv, Dk, Dv] f32
    per_position: bool
    # stacked: `recurrent` is one array [K, B, Hv, Dk, Dv] holding those K
    # states (the CUDA window kernel's output, models/gated_delta_cuda.py)
    stacked: bool = False


class HybridDelta:
    """The linear layers' states a window produced; implements
    `models.base.StateDelta`. Holds the committed states it started from, so
    `commit` can keep them for rows that keep 0 positions. Used once."""

    def __init__(
        self,
        cache: HybridCache,
        length: int,
        kernel: int,
        windows: Sequence[WindowStates],
    ) -> None:
        self.cache = cache
        self.length = length
        self.kernel = kernel
        self.before = cache.recurrent
        self.windows = tuple(windows)
        self._used = False

    def commit(self, kept: Sequence[int]) -> None:
        """Adopt, for row b, the states after its first `kept[b]` positions."""
        assert not self._used, "a delta commits once"
        assert self.cache.recurrent is self.before, "a delta commits onto its own start"
        assert len(kept) == self.cache.batch, "one kept count per row"
        assert all(0 <= k <= self.length for k in kept), "kept within the window"
        assert all(
            w.per_position or k in (0, self.length) for w in self.windows for k in kept
        ), "a window without per-position states commits all or nothing"
        self._used = True
        conv = [self._conv(w, kept) for w in self.windows]
        recurrent = [
            self._recurrent(w, before, kept)
            for w, before in zip(self.windows, self.before, strict=True)
        ]
        self.cache.adopt(conv, recurrent)

    def _conv(self, window: WindowStates, kept: Sequence[int]) -> mx.array:
        span = self.kernel - 1
        if all(k == kept[0] for k in kept):
            return window.conv_window[:, kept[0] : kept[0] + span]
        return mx.concatenate(
            [window.conv_window[b : b + 1, k : k + span] for b, k in enumerate(kept)]
        )

    def _recurrent(
        self,
        window: WindowStates,
        before: mx.array,  # [B, Hv, Dk, Dv]
        kept: Sequence[int],
    ) -> mx.array:  # [B, Hv, Dk, Dv]
        if window.stacked:
            return self._gathered(window, before, kept)
        if window.per_position:
            after = (before, *window.recurrent)  # after[k]: k positions in
        else:
            after = (before,) + (window.recurrent[-1],) * self.length
        if all(k == kept[0] for k in kept):
            return after[kept[0]]
        return mx.concatenate([after[k][b : b + 1] for b, k in enumerate(kept)])

    def _gathered(
        self,
        window: WindowStates,
        before: mx.array,  # [B, Hv, Dk, Dv]
        kept: Sequence[int],
    ) -> mx.array:  # [B, Hv, Dk, Dv]
        """The kept states out of a stacked window, gathered into an array of
        their own: a view would keep the whole window's states alive."""
        (states,) = window.recurrent  # [K, B, Hv, Dk, Dv]
        count, batch = states.shape[0], states.shape[1]
        if all(k == 0 for k in kept):
            return before
        index = [
            (min(k, count) - 1) * batch + b if k else b for b, k in enumerate(kept)
        ]
        flat = states.reshape(count * batch, *states.shape[2:])
        picked = mx.take(flat, mx.array(index, dtype=mx.int32), axis=0)
        if all(k > 0 for k in kept):
            return picked
        moved = mx.array([k > 0 for k in kept])[:, None, None, None]
        return mx.where(moved, picked, before)
