"""Fused projections (models/fuse.py): q/k/v and gate/up as one product each.

On the CPU a fused product's values are the separate products' values bit for
bit, so a fused model's logits must equal the unfused model's exactly; the
parts keep their names and values (views of the fused arrays: saving and
loading see no difference); anything that replaces a part's arrays turns the
group stale and the layer back to separate products.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

import models.parallel as parallel
from models.build import Model, build_model, quantize_model
from models.fuse import fuse, fuse_projections
from tests.models.decoder_support import tiny_args

CASES: dict[str, dict[str, Any]] = {
    "qwen2": {"model_type": "qwen2"},  # q/k/v biases
    "llama-mlp-bias": {"model_type": "llama", "mlp_bias": True},
    "qwen3": {"model_type": "qwen3", "head_dim": 32},  # q/k norms on the fused views
}


def _model(case: str, dtype: mx.Dtype = mx.float32, seed: int = 3) -> Model:
    mx.random.seed(seed)
    model = build_model(tiny_args(**CASES[case])).unwrap()
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


IDS = mx.array([[5, 17, 99, 3, 250, 42, 8], [1, 2, 3, 4, 5, 6, 7]], dtype=mx.int32)


def _logits(model: Model) -> np.ndarray:
    """A 5-token prefill, then a 2-token window, for two rows."""
    cache = model.make_cache(2)
    cache.reserve(16)
    first = model(IDS[:, :5], cache, [0, 0]).logits
    rest = model(IDS[:, 5:], cache, [5, 5]).logits
    return np.array(mx.concatenate([first, rest], axis=1).astype(mx.float32))


def _flat(model: Model) -> dict[str, np.ndarray]:
    return {
        k: np.array(v.astype(mx.float32)) for k, v in tree_flatten(model.parameters())
    }


@pytest.fixture(autouse=True, params=[1, 2], ids=["one-thread", "split"])
def threads(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Every case with products whole and split over two CPU threads."""
    monkeypatch.setattr(parallel, "MIN_SPLIT_WEIGHTS", 0)
    parallel.set_cpu_threads(request.param)
    yield
    parallel.set_cpu_threads(None)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_fused_model_equals_unfused_bit_for_bit(case: str, dtype: mx.Dtype) -> None:
    model = _model(case, dtype)
    before, params = _logits(model), _flat(model)
    assert fuse_projections(model) == 2 * 2  # q/k/v and gate/up in each of 2 layers
    assert model.model.layers[0].self_attn._qkv is not None
    np.testing.assert_array_equal(_logits(model), before)
    # the parts keep their names and values (what saving writes)
    after = _flat(model)
    assert after.keys() == params.keys()
    for name, value in params.items():
        np.testing.assert_array_equal(after[name], value)


def test_parts_are_views_of_the_fused_arrays() -> None:
    model = _model("qwen2")
    fuse_projections(model)
    attn = model.model.layers[0].self_attn
    fused = attn._qkv
    assert fused is not None
    assert fused.sizes == (4 * 16, 2 * 16, 2 * 16)
    assert fused.arrays["weight"].shape == (128, 64)
    assert fused.arrays["bias"].shape == (128,)
    np.testing.assert_array_equal(
        np.array(fused.arrays["weight"][64:96]), np.array(attn.k_proj.weight)
    )
    assert fused.current((attn.q_proj, attn.k_proj, attn.v_proj))


def test_replacing_a_part_makes_the_group_stale() -> None:
    model = _model("qwen2")
    fuse_projections(model)
    attn = model.model.layers[1].self_attn
    attn.v_proj.weight = attn.v_proj.weight * 2.0
    assert not attn._qkv.current((attn.q_proj, attn.k_proj, attn.v_proj))
    changed = _logits(model)
    # a model that never fused, with the same change, computes the same
    fresh = _model("qwen2")
    fresh.model.layers[1].self_attn.v_proj.weight = (
        fresh.model.layers[1].self_attn.v_proj.weight * 2.0
    )
    np.testing.assert_array_equal(changed, _logits(fresh))
    # set_dtype replaces every array: every group is stale, output = unfused bf16
    model = _model("qwen3")
    fuse_projections(model)
    model.set_dtype(mx.bfloat16)
    reference = _model("qwen3", mx.bfloat16)
    np.testing.assert_array_equal(_logits(model), _logits(reference))


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_groups_fuse_and_match(bits: int) -> None:
    model = _model("qwen2")
    quantize_model(model, bits, 32)
    mx.eval(model.parameters())
    before = _logits(model)
    assert fuse_projections(model) == 4
    fused = model.model.layers[0].mlp._gate_up
    assert fused is not None and fused.bits == bits and fused.group_size == 32
    np.testing.assert_array_equal(_logits(model), before)


def test_parts_that_differ_do_not_fuse() -> None:
    model = _model("qwen2")
    attn = model.model.layers[0].self_attn
    attn.v_proj = attn.v_proj.to_quantized(
        group_size=32, bits=8
    )  # v quantized, q/k float
    assert fuse((attn.q_proj, attn.k_proj, attn.v_proj)) is None
    assert not attn.fuse_projections()
    mixed_bits = (
        model.model.layers[1].mlp.gate_proj.to_quantized(group_size=32, bits=4),
        model.model.layers[1].mlp.up_proj.to_quantized(group_size=32, bits=8),
    )
    assert fuse(mixed_bits) is None
    assert fuse((nn.Linear(64, 8), nn.Linear(32, 8))) is None  # different inputs


def test_load_fuses_and_generation_is_unchanged(tmp_path: Path) -> None:
    import specpipe
    from schemas.request import GenerationLimits
    from tests.cli.conftest import write_tiny_model

    pipeline = specpipe.load(str(write_tiny_model(tmp_path / "tiny"))).unwrap()
    layer = pipeline.target.model.model.layers[0]
    assert layer.self_attn._qkv is not None and layer.mlp._gate_up is not None
    fused_text = pipeline.generate(
        "def fibonacci(n):", limits=GenerationLimits(max_tokens=12)
    ).unwrap()
    for lay in pipeline.target.model.model.layers:  # back to separate products
        lay.self_attn._qkv = None
        lay.mlp._gate_up = None
    plain_text = pipeline.generate(
        "def fibonacci(n):", limits=GenerationLimits(max_tokens=12)
    ).unwrap()
    assert fused_text.tokens == plain_text.tokens
