"""Parity of the own MLX llama / qwen2 / qwen3 models with HF transformers.

Tiny random configs (2 layers, hidden 64, 4 query / 2 key-value heads) run in
float32 on the CPU. Parameters are re-drawn after HF's init so biases and norm
weights are non-trivial (HF initialises biases to 0 and norms to 1, which
would leave those code paths untested). Configs reach our models the way real
folders do: `config.to_dict()` -> `normalize_hf_config` -> `DecoderArgs`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import torch
import transformers
from attrs import evolve
from returns.result import Failure, Success

from models.base import ModelOutput
from models.build import Model, build_model, load_weights, model_dtype, quantize_model
from models.cache import KVCache
from models.layers import flat_parameters
from schemas.converter import hf as hf_converter
from schemas.converter import structure
from schemas.errors import ConfigError, LoadError
from schemas.hf import (
    SUPPORTED_MODEL_TYPES,
    DecoderArgs,
    QuantizationConfig,
    normalize_hf_config,
)
from tests.models.hybrid_support import dequantized

TINY: dict[str, Any] = {
    "vocab_size": 160,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "attn_implementation": "eager",
}

HF_CLASSES: dict[str, tuple[type[Any], type[Any]]] = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
}

# name -> (model_type, config overrides); qwen3's head_dim differs from hidden / heads
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "llama-biases": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "qwen2": ("qwen2", {}),
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True}),
    "qwen3": ("qwen3", {"head_dim": 32}),
    "qwen3-tied": ("qwen3", {"head_dim": 32, "tie_word_embeddings": True}),
}
MODEL_TYPES = ["llama", "qwen2", "qwen3"]

F32_TOL = 1e-4


def make_hf(model_type: str, seed: int = 0, **overrides: Any) -> Any:
    config_cls, model_cls = HF_CLASSES[model_type]
    config = config_cls(**{**TINY, **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * noise)
            elif name.endswith(".bias"):
                param.copy_(0.1 * noise)
            else:
                param.copy_(0.15 * noise)
    return model


def make_hf_case(case: str, seed: int = 0) -> Any:
    model_type, overrides = CASES[case]
    return make_hf(model_type, seed, **overrides)


def args_of(raw: dict[str, Any]) -> DecoderArgs:
    result = structure(
        hf_converter, normalize_hf_config(raw), DecoderArgs, "test config"
    )
    assert isinstance(result, Success), result
    args: DecoderArgs = result.unwrap()
    return args


def hf_weights(hf: Any, dtype: mx.Dtype = mx.float32) -> dict[str, mx.array]:
    return {
        k: mx.array(v.detach().numpy()).astype(dtype)
        for k, v in hf.state_dict().items()
    }


def ours(
    hf: Any, raw: dict[str, Any] | None = None, dtype: mx.Dtype = mx.float32
) -> Model:
    args = args_of(raw if raw is not None else hf.config.to_dict())
    model = build_model(args).unwrap()
    loaded = load_weights(model, hf_weights(hf, dtype), args)
    assert loaded == Success(None), loaded
    return model


def hf_logits(hf: Any, ids: np.ndarray) -> np.ndarray:  # [B, L] -> [B, L, V]
    with torch.no_grad():
        logits: np.ndarray = hf(torch.tensor(ids)).logits.numpy()
    return logits


def forward(
    model: Model, ids: np.ndarray, cache: KVCache, offsets: Sequence[int]
) -> ModelOutput:
    return model(mx.array(ids, dtype=mx.int32), cache, offsets)


def as_np(x: mx.array) -> np.ndarray:
    return np.array(x.astype(mx.float32))


def max_diff(ours_: mx.array, theirs: np.ndarray) -> float:
    return float(np.abs(as_np(ours_) - theirs).max())


def token_ids(shape: tuple[int, ...], seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, TINY["vocab_size"], size=shape)


@pytest.mark.parametrize("case", CASES)
def test_prefill_matches_transformers(case: str) -> None:
    hf = make_hf_case(case)
    model = ours(hf)
    ids = token_ids((2, 11))
    with torch.no_grad():
        expected = hf(torch.tensor(ids), output_hidden_states=True)
    out = forward(model, ids, model.make_cache(2), [0, 0])
    assert out.logits.shape == (2, 11, TINY["vocab_size"])
    assert out.logits.dtype == mx.float32
    assert max_diff(out.logits, expected.logits.numpy()) < F32_TOL
    # `hidden` is the last block's output before the final norm; HF records
    # the last block's output normed.
    assert (
        max_diff(model.model.norm(out.hidden), expected.hidden_states[-1].numpy())
        < F32_TOL
    )
    assert max_diff(model.lm_head(out.hidden), expected.logits.numpy()) < F32_TOL


@pytest.mark.parametrize("case", MODEL_TYPES)
def test_decode_with_cache_matches_full_sequence(case: str) -> None:
    hf = make_hf_case(case)
    model = ours(hf)
    ids = token_ids((2, 12))
    expected = hf_logits(hf, ids)
    cache = model.make_cache(2)
    got = [forward(model, ids[:, :5], cache, [0, 0]).logits]
    got.append(forward(model, ids[:, 5:8], cache, [5, 5]).logits)
    got += [
        forward(model, ids[:, p : p + 1], cache, [p, p]).logits for p in range(8, 12)
    ]
    assert max_diff(mx.concatenate(got, axis=1), expected) < F32_TOL


@pytest.mark.parametrize("case", MODEL_TYPES)
def test_rows_at_different_offsets_match_rows_alone(case: str) -> None:
    hf = make_hf_case(case)
    model = ours(hf)
    lengths = (5, 8)
    rows = token_ids((2, 12), seed=3)
    # Right-padded prefill: row 0 writes junk keys at positions 5..7, which
    # its window then overwrites (rollback by overwriting).
    padded = np.where(
        np.arange(8)[None, :] < np.array(lengths)[:, None], rows[:, :8], 0
    )
    cache = model.make_cache(2)
    forward(model, padded, cache, [0, 0])
    window = np.stack([rows[b, n : n + 3] for b, n in enumerate(lengths)])
    batched_window = forward(model, window, cache, list(lengths)).logits
    step = np.stack([rows[b, n + 3 : n + 4] for b, n in enumerate(lengths)])
    batched_step = forward(model, step, cache, [n + 3 for n in lengths]).logits

    for b, n in enumerate(lengths):
        alone = model.make_cache(1)
        forward(model, rows[b : b + 1, :n], alone, [0])
        alone_window = forward(model, rows[b : b + 1, n : n + 3], alone, [n]).logits
        alone_step = forward(
            model, rows[b : b + 1, n + 3 : n + 4], alone, [n + 3]
        ).logits
        assert max_diff(batched_window[b], as_np(alone_window[0])) < 1e-5
        assert max_diff(batched_step[b], as_np(alone_step[0])) < 1e-5
        expected = hf_logits(hf, rows[b : b + 1, : n + 4])[0, n:]
        both = mx.concatenate([batched_window[b], batched_step[b]], axis=0)
        assert max_diff(both, expected) < F32_TOL


@pytest.mark.parametrize("case", ["llama", "qwen2-tied", "qwen3"])
def test_float16_model_tracks_float32(case: str) -> None:
    hf = make_hf_case(case)
    model = ours(hf, dtype=mx.float16)
    assert model_dtype(model) == mx.float16
    cache = model.make_cache(2)
    assert cache.dtype == mx.float16
    ids = token_ids((2, 10))
    prefill = forward(model, ids[:, :8], cache, [0, 0])
    steps = forward(model, ids[:, 8:], cache, [8, 8])
    assert prefill.logits.dtype == mx.float16
    assert prefill.hidden.dtype == mx.float16
    got = mx.concatenate([prefill.logits, steps.logits], axis=1)
    # measured 0.011-0.016 on logits of standard deviation 1.2
    assert max_diff(got, hf_logits(hf, ids)) < 5e-2


@pytest.mark.parametrize("case", ["llama", "qwen2-tied", "qwen3"])
def test_4bit_quantized_model_computes_its_dequantized_weights(case: str) -> None:
    model_type, overrides = CASES[case]
    # intermediate 96 is not a multiple of the group size: down_proj stays float
    hf = make_hf(model_type, **{**overrides, "intermediate_size": 96})
    model = ours(hf)
    ids = token_ids((2, 16))
    reference = as_np(forward(model, ids, model.make_cache(2), [0, 0]).logits)

    quantize_model(model, bits=4, group_size=64)
    assert model.args.quantization == QuantizationConfig(group_size=64, bits=4)
    mlp = model.model.layers[0].mlp
    assert isinstance(mlp.gate_proj, nn.QuantizedLinear)
    assert isinstance(mlp.down_proj, nn.Linear)
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)
    quantized = as_np(forward(model, ids, model.make_cache(2), [0, 0]).logits)

    # Exact check: the same as a float model holding the dequantized weights.
    saved = flat_parameters(model)
    assert "model.layers.0.mlp.down_proj.scales" not in saved
    float_args = evolve(model.args, quantization=None)
    simulated = build_model(float_args).unwrap()
    assert load_weights(simulated, dequantized(saved, 64), float_args) == Success(None)
    expected = forward(simulated, ids, simulated.make_cache(2), [0, 0]).logits
    assert max_diff(expected, quantized) < F32_TOL

    # Loose check against the float model. Tiny random networks amplify 4-bit
    # noise far more than trained ones: measured correlation 0.90-0.94.
    correlation = np.corrcoef(quantized.ravel(), reference.ravel())[0, 1]
    assert correlation > 0.85, correlation

    # The saved quantized checkpoint loads into a fresh model: `*.scales` mark
    # the quantized layers, the packed shapes give bits and group size.
    fresh = build_model(model.args).unwrap()
    assert load_weights(fresh, saved, model.args) == Success(None)
    reloaded = as_np(forward(fresh, ids, fresh.make_cache(2), [0, 0]).logits)
    np.testing.assert_array_equal(reloaded, quantized)


def test_8bit_quantized_checkpoint_loads_without_quantization_config() -> None:
    hf = make_hf("qwen2")
    model = ours(hf)
    quantize_model(model, bits=8, group_size=32)
    ids = token_ids((1, 6))
    expected = as_np(forward(model, ids, model.make_cache(1), [0]).logits)
    args = evolve(model.args, quantization=None)
    fresh = build_model(args).unwrap()
    assert load_weights(fresh, flat_parameters(model), args) == Success(None)
    q_proj = fresh.model.layers[1].self_attn.q_proj
    assert isinstance(q_proj, nn.QuantizedLinear)
    assert (q_proj.bits, q_proj.group_size) == (8, 32)
    got = as_np(forward(fresh, ids, fresh.make_cache(1), [0]).logits)
    np.testing.assert_array_equal(got, expected)
    float_logits = hf_logits(hf, ids)
    assert np.corrcoef(got.ravel(), float_logits.ravel())[0, 1] > 0.999
    assert (got.argmax(-1) == float_logits.argmax(-1)).mean() > 0.8


def test_rope_theta_from_rope_parameters_and_legacy_key() -> None:
    hf = make_hf(
        "llama", rope_parameters={"rope_theta": 500000.0, "rope_type": "default"}
    )
    raw = hf.config.to_dict()
    legacy = {k: v for k, v in raw.items() if k != "rope_parameters"}
    legacy["rope_theta"] = 500000.0
    assert args_of(raw) == args_of(legacy)
    assert args_of(legacy).rope.theta == 500000.0
    ids = token_ids((1, 24))
    expected = hf_logits(hf, ids)
    for config in (raw, legacy):
        model = ours(hf, config)
        assert (
            max_diff(forward(model, ids, model.make_cache(1), [0]).logits, expected)
            < F32_TOL
        )


@pytest.mark.parametrize(
    "rope_parameters",
    [
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        # original 16 puts head_dim 16's wavelengths in all three llama3 bands
        {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ],
    ids=["linear", "llama3"],
)
def test_scaled_rope_matches_transformers(rope_parameters: dict[str, Any]) -> None:
    hf = make_hf("llama", rope_parameters=rope_parameters)
    model = ours(hf)
    assert model.args.rope.rope_type == rope_parameters["rope_type"]
    ids = token_ids((2, 24))
    expected = hf_logits(hf, ids)
    cache = model.make_cache(2)
    prefill = forward(model, ids[:, :20], cache, [0, 0]).logits
    window = forward(model, ids[:, 20:], cache, [20, 20]).logits
    assert max_diff(mx.concatenate([prefill, window], axis=1), expected) < F32_TOL


def _interleave_rope_rows(w: mx.array, heads: int) -> mx.array:  # [O, I] -> [O, I]
    """llama.cpp's conversion permutation: each head's rotate-half pairs
    (i, i + D/2) become adjacent rows (2i, 2i + 1), for traditional RoPE."""
    out_dims, in_dims = w.shape
    half = out_dims // heads // 2
    return w.reshape(heads, 2, half, in_dims).swapaxes(1, 2).reshape(out_dims, in_dims)


def test_traditional_rope_with_gguf_permuted_weights() -> None:
    hf = make_hf("llama")
    raw = {**hf.config.to_dict(), "rope_traditional": True}
    args = args_of(raw)
    assert args.rope.traditional
    weights = hf_weights(hf)
    for i in range(args.num_hidden_layers):
        for proj, heads in (
            ("q_proj", args.num_attention_heads),
            ("k_proj", args.num_key_value_heads),
        ):
            name = f"model.layers.{i}.self_attn.{proj}.weight"
            weights[name] = _interleave_rope_rows(weights[name], heads)
    ids = token_ids((1, 12))
    expected = hf_logits(hf, ids)

    model = build_model(args).unwrap()
    assert load_weights(model, weights, args) == Success(None)
    assert (
        max_diff(forward(model, ids, model.make_cache(1), [0]).logits, expected)
        < F32_TOL
    )

    # The flag matters: the same permuted weights with rotate-half RoPE differ.
    plain_args = evolve(args, rope=evolve(args.rope, traditional=False))
    plain = build_model(plain_args).unwrap()
    assert load_weights(plain, weights, plain_args) == Success(None)
    assert (
        max_diff(forward(plain, ids, plain.make_cache(1), [0]).logits, expected) > 1e-2
    )


def test_sanitize_drops_rotary_buffers_and_the_tied_head() -> None:
    hf = make_hf("qwen2", tie_word_embeddings=True)
    args = args_of(hf.config.to_dict())
    weights = hf_weights(hf)
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = mx.ones((8,))
    model = build_model(args).unwrap()
    assert load_weights(model, weights, args) == Success(None)
    assert "lm_head.weight" not in flat_parameters(model)


def _load_error(weights: dict[str, mx.array], case: str = "llama") -> str:
    hf = make_hf_case(case)
    args = args_of(hf.config.to_dict())
    result = load_weights(build_model(args).unwrap(), weights, args)
    assert isinstance(result, Failure), result
    error = result.failure()
    assert isinstance(error, LoadError)
    return error.message


def test_missing_weight_is_a_load_error_naming_it() -> None:
    weights = hf_weights(make_hf("llama"))
    del weights["model.layers.1.mlp.up_proj.weight"]
    message = _load_error(weights)
    assert "missing" in message
    assert "model.layers.1.mlp.up_proj.weight" in message


def test_unexpected_weight_is_a_load_error_naming_it() -> None:
    weights = hf_weights(make_hf("llama"))
    weights["model.layers.0.self_attn.extra_proj.weight"] = mx.zeros((4, 4))
    message = _load_error(weights)
    assert "unexpected" in message
    assert "model.layers.0.self_attn.extra_proj.weight" in message


def test_wrong_shape_is_a_load_error_naming_it() -> None:
    weights = hf_weights(make_hf("qwen3", head_dim=32))
    weights["model.layers.0.self_attn.q_norm.weight"] = mx.ones((16,))
    message = _load_error(weights, "qwen3")
    assert "model.layers.0.self_attn.q_norm.weight (16,) (expected (32,))" in message


def test_inconsistent_quantized_shapes_are_a_load_error() -> None:
    hf = make_hf("llama")
    model = ours(hf)
    quantize_model(model, bits=4, group_size=64)
    weights = flat_parameters(model)
    weights["model.layers.0.mlp.up_proj.weight"] = mx.zeros((128, 7), dtype=mx.uint32)
    args = model.args
    result = load_weights(build_model(args).unwrap(), weights, args)
    assert isinstance(result, Failure)
    assert "model.layers.0.mlp.up_proj" in result.failure().message


def test_every_supported_model_type_builds_and_unknown_types_fail() -> None:
    base = args_of(make_hf("llama").config.to_dict())
    for model_type in SUPPORTED_MODEL_TYPES:
        assert isinstance(build_model(evolve(base, model_type=model_type)), Success)
    result = build_model(evolve(base, model_type="gpt2"))
    assert isinstance(result, Failure)
    error = result.failure()
    assert isinstance(error, ConfigError)
    assert "'gpt2'" in error.message
    assert all(t in error.message for t in SUPPORTED_MODEL_TYPES)
