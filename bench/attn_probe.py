"""Does a verify window's cost depend on whether its key length is new?
Times a W-token forward at a fixed offset (same shapes every call) and at a
growing offset (new key length every call), as speculative rounds do."""

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import models  # noqa: F401  before mlx: routes its BLAS (models/blas.py)

# isort: split

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from specpipe.load import load

model = load(sys.argv[1]).unwrap().model
for width in (1, 2, 3, 5):
    cache = model.make_cache(1)
    ctx = mx.random.randint(0, 1000, (1, 256)).astype(mx.int32)
    model(ctx, cache, [0])
    mx.eval(cache.arrays())
    ids = ctx[:, :width]
    fixed, growing = [], []
    for _ in range(30):
        t = time.perf_counter()
        mx.eval(model(ids, cache, [128]).logits)
        fixed.append((time.perf_counter() - t) * 1000)
    for i in range(30):
        t = time.perf_counter()
        mx.eval(model(ids, cache, [130 + i]).logits)
        growing.append((time.perf_counter() - t) * 1000)
    print(
        f"width {width}: fixed offset {statistics.median(fixed[5:]):.2f} ms, "
        f"growing offset {statistics.median(growing):.2f} ms (max {max(growing):.1f})",
        flush=True,
    )

# The same with an explicit boolean mask instead of MLX's "causal" string.


def explicit_mask(offsets, length):  # type: ignore[no-untyped-def]
    if length == 1 and all(o == offsets[0] for o in offsets):
        return None
    span = max(offsets) + length
    starts = mx.array(list(offsets), dtype=mx.int32)[:, None, None, None]
    query = mx.arange(length, dtype=mx.int32)[None, None, :, None]
    key = mx.arange(span, dtype=mx.int32)[None, None, None, :]
    return key <= starts + query


import models.llama as llama  # noqa: E402

llama.attention_mask = explicit_mask
for width in (2, 3, 5):
    cache = model.make_cache(1)
    ctx = mx.random.randint(0, 1000, (1, 256)).astype(mx.int32)
    model(ctx, cache, [0])
    mx.eval(cache.arrays())
    ids = ctx[:, :width]
    growing = []
    for _ in range(30):
        t = time.perf_counter()
        mx.eval(model(ids, cache, [170 + i]).logits)
        growing.append((time.perf_counter() - t) * 1000)
    print(
        f"explicit mask, width {width}: growing offset {statistics.median(growing):.2f} ms (max {max(growing):.1f})",
        flush=True,
    )

# Keys over the whole (bucketed) cache capacity, masked past each query's
# position: the attention kernel then sees a key length that changes only
# when the cache grows.
from models.cache import KVCache  # noqa: E402

plain_write = KVCache.write


def bucketed_write(self, layer, keys, values, offsets):  # type: ignore[no-untyped-def]
    k, v = plain_write(self, layer, keys, values, offsets)
    if keys.shape[2] == 1:
        return k, v
    return self.keys[layer], self.values[layer]


def bucketed_mask(offsets, length):  # type: ignore[no-untyped-def]
    if length == 1:
        return None
    span = BUCKET[0]
    starts = mx.array(list(offsets), dtype=mx.int32)[:, None, None, None]
    query = mx.arange(length, dtype=mx.int32)[None, None, :, None]
    key = mx.arange(span, dtype=mx.int32)[None, None, None, :]
    return key <= starts + query


BUCKET = [0]
KVCache.write = bucketed_write
llama.attention_mask = bucketed_mask
for width in (2, 3, 5):
    cache = model.make_cache(1)
    cache.reserve(300)
    BUCKET[0] = cache.capacity
    ctx = mx.random.randint(0, 1000, (1, 256)).astype(mx.int32)
    model(ctx, cache, [0])
    mx.eval(cache.arrays())
    ids = ctx[:, :width]
    growing = []
    for _ in range(30):
        t = time.perf_counter()
        mx.eval(model(ids, cache, [200 + i]).logits)
        growing.append((time.perf_counter() - t) * 1000)
    print(
        f"bucketed keys, width {width}: growing offset {statistics.median(growing):.2f} ms (max {max(growing):.1f})",
        flush=True,
    )
