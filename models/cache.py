"""Position-indexed key/value storage shared by the attention layers of a model.

The storage is an arena of per-layer buffers `[B, Hkv, C, D]`. What a row has
*committed* is not stored here: it is the row's length, a host integer the
pipeline keeps in its immutable row state. A forward writes the keys/values of
its window at positions `offsets[b] .. offsets[b] + L - 1`, all at or beyond the
row's committed length, so the committed prefix of every buffer is never
written while a round is prepared. That is what makes attention rollback free:
rejecting positions means keeping the old length; the next window overwrites
them. (Recurrent layers cannot do this; they carry per-position states.)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import mlx.core as mx

# Windows up to this long attend over the whole capacity on a GPU: verify
# windows, and a two-model draft's catch-up after up to 64 plain steps of a
# gated row (padded to a power of two, specpipe/drafts/two_model.py).
BUCKETED_WINDOW = 128


def on_gpu() -> bool:
    """Whether MLX runs on a GPU now (where window shapes are bucketed)."""
    return mx.default_device().type == mx.DeviceType.gpu


@functools.cache
def cuda_backend() -> bool:
    """Whether MLX runs with its CUDA backend (asked once: every linear layer
    of every forward checks)."""
    cuda = getattr(mx, "cuda", None)  # absent from builds without the backend
    return cuda is not None and bool(cuda.is_available())


_STEP = 256

# How an attention layer stores its window: the window's keys/values
# `[B, Hkv, L, D]` in, the keys/values its queries attend over `[B, Hkv, S, D]` out.
KVWrite = Callable[[mx.array, mx.array], tuple[mx.array, mx.array]]


class KVCache:
    """Per-layer key/value buffers for B rows; grows in steps of 256 positions."""

    def __init__(
        self,
        num_layers: int,
        batch: int,
        kv_heads: int,
        head_dim: int,
        dtype: mx.Dtype,
    ) -> None:
        self.num_layers = num_layers
        self.batch = batch
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.capacity = 0
        # MLX's CUDA attention kernel for a multi-token window is compiled per
        # key length: a verify window at a new position cost ~52 ms instead of
        # ~8 ms on an H200 (bench/attn_probe.py). On a GPU, short windows
        # therefore attend over the whole capacity (a multiple of 256) under
        # an explicit mask, so the key length changes only when the cache grows.
        self.bucket_windows = on_gpu()
        self.keys: list[mx.array] = []  # per layer [B, Hkv, C, D]
        self.values: list[mx.array] = []  # per layer [B, Hkv, C, D]

    def reserve(self, end: int) -> None:
        """Make room for positions `< end` in every layer (copies on growth)."""
        if end <= self.capacity:
            return
        new_capacity = ((end + _STEP - 1) // _STEP) * _STEP
        shape = (self.batch, self.kv_heads, new_capacity - self.capacity, self.head_dim)
        if not self.keys:
            self.keys = [mx.zeros(shape, self.dtype) for _ in range(self.num_layers)]
            self.values = [mx.zeros(shape, self.dtype) for _ in range(self.num_layers)]
        else:
            grow = mx.zeros(shape, self.dtype)
            self.keys = [mx.concatenate([k, grow], axis=2) for k in self.keys]
            self.values = [mx.concatenate([v, grow], axis=2) for v in self.values]
        self.capacity = new_capacity

    def key_span(self, offsets: Sequence[int], length: int) -> int:
        """How many key positions a window of `length` at `offsets` attends
        over: max(offsets) + length, or the whole capacity for a short window
        on a GPU (see `bucket_windows`); positions past a query's own are masked."""
        if self.bucket_windows and 1 < length <= BUCKETED_WINDOW:
            return self.capacity
        return max(offsets) + length

    def write(
        self,
        layer: int,
        keys: mx.array,  # [B, Hkv, L, D]
        values: mx.array,  # [B, Hkv, L, D]
        offsets: Sequence[int],
    ) -> tuple[mx.array, mx.array]:
        """Store a window at each row's offset; return keys/values `[B, Hkv, S, D]`
        with S = `key_span(offsets, L)`, the span the window's queries attend over."""
        length = keys.shape[2]
        assert max(offsets) + length <= self.capacity, "reserve() before write()"
        end = self.key_span(offsets, length)
        k_buf, v_buf = self.keys[layer], self.values[layer]
        if all(o == offsets[0] for o in offsets):
            start = offsets[0]
            k_buf[:, :, start : start + length, :] = keys
            v_buf[:, :, start : start + length, :] = values
        else:
            for row, start in enumerate(offsets):
                k_buf[row, :, start : start + length, :] = keys[row]
                v_buf[row, :, start : start + length, :] = values[row]
        return k_buf[:, :, :end, :], v_buf[:, :, :end, :]

    def writer(self, layer: int, offsets: Sequence[int]) -> KVWrite:
        """`write` for one layer's window at `offsets`, as an attention layer
        takes its store (`KVWrite`)."""
        return functools.partial(self.write, layer, offsets=offsets)

    def arrays(self) -> list[mx.array]:
        return [*self.keys, *self.values]

    # A row's state after its first n positions is this state with length n:
    # positions past a row's length are never attended (see module doc).
    truncatable = True

    def take_rows(self, rows: Sequence[int], end: int | None = None) -> KVCache:
        """A new cache holding the given rows, in that order (a copy); `end`:
        only positions `< end` are wanted (a checkpoint of rows that hold
        that many), so the copy keeps the capacity that holds them, not the
        whole arena's."""
        out = KVCache(
            self.num_layers, len(rows), self.kv_heads, self.head_dim, self.dtype
        )
        capacity = self.capacity
        if end is not None:
            capacity = min(capacity, max(_STEP, -(-end // _STEP) * _STEP))
        out.capacity = capacity
        if self.keys:
            index = mx.array(list(rows), dtype=mx.int32)
            # cut, then take: the copy is of the kept positions only (a cut
            # of the copy would be a view holding the whole arena's buffer)
            cut = (slice(None), slice(None), slice(0, capacity))
            out.keys = [mx.take(k[cut], index, axis=0) for k in self.keys]
            out.values = [mx.take(v[cut], index, axis=0) for v in self.values]
        return out

    @staticmethod
    def concat_rows(caches: Sequence[KVCache]) -> KVCache:
        """Stack the rows of several caches of one model into one (a copy)."""
        first = caches[0]
        capacity = max(c.capacity for c in caches)
        for c in caches:
            c.reserve(capacity)
        out = KVCache(
            first.num_layers,
            sum(c.batch for c in caches),
            first.kv_heads,
            first.head_dim,
            first.dtype,
        )
        out.reserve(capacity)
        if capacity:
            out.keys = [
                mx.concatenate([c.keys[i] for c in caches])
                for i in range(first.num_layers)
            ]
            out.values = [
                mx.concatenate([c.values[i] for c in caches])
                for i in range(first.num_layers)
            ]
        return out


def scatter_window(
    buffer: mx.array,  # [B, Hkv, C, D]
    window: mx.array,  # [B, Hkv, L, D]
    starts: mx.array,  # [B] int32
) -> mx.array:  # [B, Hkv, C, D]
    """`buffer` with row b's window written at positions `starts[b] ..
    starts[b] + L - 1` (a new array). The positions are device values, so a
    traced (compiled) forward stays valid whatever the rows' lengths."""
    length = window.shape[2]
    positions = starts[:, None] + mx.arange(length, dtype=mx.int32)  # [B, L]
    index = mx.broadcast_to(positions[:, None, :, None], window.shape)
    return mx.put_along_axis(buffer, index, window, axis=2)


def position_mask(
    starts: mx.array,  # [B] int32
    length: int,
    span: int,
) -> mx.array:  # [B, 1, L, S] bool
    """Query i of row b (at position starts[b] + i) sees keys j <= its position;
    the device-offset form of `models.base.attention_mask`."""
    query = mx.arange(length, dtype=mx.int32)[None, None, :, None]
    key = mx.arange(span, dtype=mx.int32)[None, None, None, :]
    return key <= starts[:, None, None, None] + query
