"""Short windows attending over the whole cache capacity (the GPU path of
KVCache.key_span) give the logits of the exact-span path."""

from __future__ import annotations

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
