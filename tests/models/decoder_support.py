"""Tiny llama-family configs for model tests that need no reference model,
and any family's config parsed as a real one is (`parsed_args`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from returns.result import Result, Success

from schemas.converter import hf as hf_converter
from schemas.converter import structure
from schemas.hf import DecoderArgs, normalize_hf_config

A = TypeVar("A")


def tiny_args(**overrides: Any) -> DecoderArgs:
    """2 layers, hidden 64, 4 query / 2 key-value heads, vocabulary 300
    (qwen2 unless `model_type` is given), parsed as a real config is."""
    raw = {
        "model_type": "qwen2",
        "vocab_size": 300,
        "hidden_size": 64,
        "intermediate_size": 160,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        **overrides,
    }
    result = structure(
        hf_converter, normalize_hf_config(raw), DecoderArgs, "test config"
    )
    assert isinstance(result, Success), result
    args: DecoderArgs = result.unwrap()
    return args


def parsed_args(
    parse: Callable[[dict[str, Any], str], Result[A, Any]],
    raw: dict[str, Any],
    source: str = "test config",
) -> A:
    """`raw` parsed by a family's parser (`glm4_moe_args`, `gemma4_args`,
    ...) as a folder's config.json named `source` is; it must parse."""
    parsed = parse(raw, source)
    assert isinstance(parsed, Success), parsed
    args: A = parsed.unwrap()
    return args
