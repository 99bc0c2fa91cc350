"""Short windows attending over the whole cache capacity (the GPU path of
KVCache.key_span) give the logits of the exact-span path."""

from __future__ import annotations

import gc

import mlx.core as mx
import numpy as np
import pytest

from models.build import build_model
from schemas.converter import hf, structure
from schemas.hf import DecoderArgs, normalize_hf_config

CONFIG = {
    "model_type": "qwen2",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 97,
    "max_position_embeddings": 1024,
}


@pytest.mark.parametrize("offsets", [(40, 40), (40, 33)])
@pytest.mark.parametrize("width", [2, 5])
def test_bucketed_window_logits_match(offsets: tuple[int, int], width: int) -> None:
    args = structure(hf, normalize_hf_config(CONFIG), DecoderArgs, "t").unwrap()
    mx.random.seed(0)
    model = build_model(args).unwrap()
    ctx = mx.random.randint(0, 97, (2, 40)).astype(mx.int32)
    window = mx.random.randint(0, 97, (2, width)).astype(mx.int32)
    outs = []
    for bucketed in (False, True):
        cache = model.make_cache(2)
        cache.bucket_windows = bucketed
        model(ctx, cache, [0, 0])
        mx.eval(cache.arrays())
        outs.append(np.array(model(window, cache, list(offsets)).logits))
        assert cache.key_span(offsets, width) == (
            cache.capacity if bucketed else max(offsets) + width
        )
    assert np.max(np.abs(outs[0] - outs[1])) < 1e-5


def test_a_row_copy_cut_at_its_length_decodes_as_the_whole_arena() -> None:
    """KVCache.take_rows(rows, end) keeps the capacity that holds `end`
    positions (a checkpoint's copy), and decoding on from it gives the
    logits that decoding on from the whole arena gives."""
    args = structure(hf, normalize_hf_config(CONFIG), DecoderArgs, "t").unwrap()
    mx.random.seed(1)
    model = build_model(args).unwrap()
    cache = model.make_cache(2)
    cache.reserve(700)  # an arena grown well past the rows' lengths
    ctx = mx.random.randint(0, 97, (2, 300)).astype(mx.int32)
    model(ctx, cache, [0, 0])
    whole, cut = cache.take_rows([1]), cache.take_rows([1], 300)
    assert (whole.capacity, cut.capacity) == (768, 512)
    assert cut.keys[0].shape[2] == 512 and cut.values[1].shape[2] == 512
    assert cache.take_rows([1], 0).capacity == 256  # never below one step
    assert cache.take_rows([1], 5000).capacity == 768  # never above the arena
    nxt = mx.random.randint(0, 97, (1, 3)).astype(mx.int32)
    logits = [np.array(model(nxt, c, [300]).logits) for c in (whole, cut)]
    assert np.max(np.abs(logits[0] - logits[1])) < 1e-5


def test_a_row_copy_cut_at_its_length_holds_only_its_positions() -> None:
    """The cut copy's memory is its own positions', not a view of the arena."""
    args = structure(hf, normalize_hf_config(CONFIG), DecoderArgs, "t").unwrap()
    model = build_model(args).unwrap()
    cache = model.make_cache(1)
    cache.reserve(40_000)  # 2 layers x (keys, values) x 40,192 positions x 32 dims
    mx.eval(cache.arrays())
    arena = sum(int(a.nbytes) for a in cache.arrays())
    gc.collect()
    before = mx.get_active_memory()
    cut = cache.take_rows([0], 300)
    mx.eval(cut.arrays())
    held = mx.get_active_memory() - before
    kept = sum(int(a.nbytes) for a in cut.arrays())
    assert kept * 50 < arena
    assert held <= 2 * kept  # not the arena's buffer behind a view
