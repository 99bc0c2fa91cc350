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
from attrs import frozen

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


def _rounded(end: int) -> int:
    """The capacity that holds positions `< end`: a multiple of `_STEP`."""
    return -(-end // _STEP) * _STEP


def _store(buffer: mx.array, window: mx.array, offsets: Sequence[int]) -> None:
    """Write `window` `[B, ..., L, X]` into `buffer` `[B, ..., C, X]` at each
    row's offset along the position axis (in place)."""
    length = window.shape[2]
    if all(o == offsets[0] for o in offsets):
        start = offsets[0]
        buffer[:, :, start : start + length, :] = window
        return
    for row, start in enumerate(offsets):
        buffer[row, :, start : start + length, :] = window[row]


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
        new_capacity = _rounded(end)
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
        _store(k_buf, keys, offsets)
        _store(v_buf, values, offsets)
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

    def kept_capacity(self, end: int | None) -> int:
        """The capacity a copy of positions `< end` keeps (None: all of it)."""
        if end is None:
            return self.capacity
        return min(self.capacity, max(_STEP, _rounded(end)))

    def take_rows(self, rows: Sequence[int], end: int | None = None) -> KVCache:
        """A new cache holding the given rows, in that order (a copy); `end`:
        only positions `< end` are wanted (a checkpoint of rows that hold
        that many), so the copy keeps the capacity that holds them, not the
        whole arena's."""
        out = KVCache(
            self.num_layers, len(rows), self.kv_heads, self.head_dim, self.dtype
        )
        capacity = self.kept_capacity(end)
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


@frozen
class KVQuantization:
    """Keys and values stored quantized (`--kv-bits`): `bits` per value in
    groups of `group_size` along the head dimension, each group with its own
    scale and bias (MLX's affine quantization)."""

    bits: int = 8
    group_size: int = 64


class QuantizedKVCache(KVCache):
    """`KVCache` whose buffers hold each position's keys and values quantized
    (`KVQuantization`): about 8.5 or 4.5 bits a value instead of 16. A window
    is quantized as it is written; the span its queries attend over is
    dequantized for the attention, so every attention layer reads it as it
    reads a `KVCache`.

    A position's quantized values depend on that position alone (its groups
    lie along the head dimension), so a verify window stores what plain
    decoding stores one position at a time: speculation stays lossless with
    it (against plain decoding with the same cache)."""

    def __init__(
        self,
        num_layers: int,
        batch: int,
        kv_heads: int,
        head_dim: int,
        dtype: mx.Dtype,
        quantization: KVQuantization,
    ) -> None:
        if head_dim % quantization.group_size:
            raise ValueError(
                f"a head of {head_dim} values cannot be quantized in groups of "
                f"{quantization.group_size}; give a group size that divides it"
            )
        super().__init__(num_layers, batch, kv_heads, head_dim, dtype)
        self.quantization = quantization
        # per layer: (packed uint32, scales, biases), each [B, Hkv, C, ...]
        self.key_parts: list[tuple[mx.array, mx.array, mx.array]] = []
        self.value_parts: list[tuple[mx.array, mx.array, mx.array]] = []

    def _empty(self, positions: int) -> tuple[mx.array, mx.array, mx.array]:
        q = self.quantization
        lead = (self.batch, self.kv_heads, positions)
        return (
            mx.zeros((*lead, self.head_dim * q.bits // 32), mx.uint32),
            mx.zeros((*lead, self.head_dim // q.group_size), self.dtype),
            mx.zeros((*lead, self.head_dim // q.group_size), self.dtype),
        )

    def reserve(self, end: int) -> None:
        if end <= self.capacity:
            return
        new_capacity = _rounded(end)
        grow = new_capacity - self.capacity

        def grown(
            parts: tuple[mx.array, mx.array, mx.array],
        ) -> tuple[mx.array, mx.array, mx.array]:
            more = self._empty(grow)
            a, b, c = (
                mx.concatenate([p, m], axis=2) for p, m in zip(parts, more, strict=True)
            )
            return a, b, c

        if not self.key_parts:
            self.key_parts = [self._empty(grow) for _ in range(self.num_layers)]
            self.value_parts = [self._empty(grow) for _ in range(self.num_layers)]
        else:
            self.key_parts = [grown(p) for p in self.key_parts]
            self.value_parts = [grown(p) for p in self.value_parts]
        self.capacity = new_capacity

    def read(self, layer: int, end: int) -> tuple[mx.array, mx.array]:
        """Layer `layer`'s keys and values of positions `< end`, dequantized
        `[B, Hkv, end, D]`."""
        return (
            self._dequantized(self.key_parts[layer], end),
            self._dequantized(self.value_parts[layer], end),
        )

    def _dequantized(
        self, parts: tuple[mx.array, mx.array, mx.array], end: int
    ) -> mx.array:
        q = self.quantization
        packed, scales, biases = (p[:, :, :end, :] for p in parts)
        return mx.dequantize(
            packed, scales, biases, group_size=q.group_size, bits=q.bits
        ).astype(self.dtype)

    def write(
        self,
        layer: int,
        keys: mx.array,  # [B, Hkv, L, D]
        values: mx.array,  # [B, Hkv, L, D]
        offsets: Sequence[int],
    ) -> tuple[mx.array, mx.array]:
        length = keys.shape[2]
        assert max(offsets) + length <= self.capacity, "reserve() before write()"
        end = self.key_span(offsets, length)
        q = self.quantization
        for parts, window in ((self.key_parts, keys), (self.value_parts, values)):
            quantized = mx.quantize(window, group_size=q.group_size, bits=q.bits)
            for buffer, piece in zip(parts[layer], quantized, strict=True):
                _store(buffer, piece, offsets)
        return self.read(layer, end)

    def arrays(self) -> list[mx.array]:
        return [a for parts in (*self.key_parts, *self.value_parts) for a in parts]

    def _like(self, batch: int) -> QuantizedKVCache:
        return QuantizedKVCache(
            self.num_layers,
            batch,
            self.kv_heads,
            self.head_dim,
            self.dtype,
            self.quantization,
        )

    def take_rows(self, rows: Sequence[int], end: int | None = None) -> KVCache:
        out = self._like(len(rows))
        capacity = self.kept_capacity(end)
        out.capacity = capacity
        if self.key_parts:
            index = mx.array(list(rows), dtype=mx.int32)

            def taken(
                parts: tuple[mx.array, mx.array, mx.array],
            ) -> tuple[mx.array, mx.array, mx.array]:
                a, b, c = (mx.take(p[:, :, :capacity], index, axis=0) for p in parts)
                return a, b, c

            out.key_parts = [taken(p) for p in self.key_parts]
            out.value_parts = [taken(p) for p in self.value_parts]
        return out

    @staticmethod
    def concat_rows(caches: Sequence[KVCache]) -> KVCache:
        quantized = [c for c in caches if isinstance(c, QuantizedKVCache)]
        assert len(quantized) == len(caches), "rows of one model's caches"
        first = quantized[0]
        capacity = max(c.capacity for c in quantized)
        for c in quantized:
            c.reserve(capacity)
        out = first._like(sum(c.batch for c in quantized))
        out.capacity = capacity
        if capacity:

            def joined(layer: int, side: str) -> tuple[mx.array, mx.array, mx.array]:
                parts = [getattr(c, side)[layer] for c in quantized]
                a, b, c = (mx.concatenate([p[i] for p in parts]) for i in range(3))
                return a, b, c

            out.key_parts = [joined(i, "key_parts") for i in range(first.num_layers)]
            out.value_parts = [
                joined(i, "value_parts") for i in range(first.num_layers)
            ]
        return out


def kv_quantization(model: object) -> KVQuantization | None:
    """How `model` stores its keys and values (`--kv-bits`, set by the
    loader as its `kv_quantization` attribute); None: at its own dtype."""
    value = getattr(model, "kv_quantization", None)
    return value if isinstance(value, KVQuantization) else None


def kv_cache(
    num_layers: int,
    batch: int,
    kv_heads: int,
    head_dim: int,
    dtype: mx.Dtype,
    quantization: KVQuantization | None,
) -> KVCache:
    """A `KVCache`, or a `QuantizedKVCache` where `quantization` is given."""
    if quantization is None:
        return KVCache(num_layers, batch, kv_heads, head_dim, dtype)
    return QuantizedKVCache(num_layers, batch, kv_heads, head_dim, dtype, quantization)
