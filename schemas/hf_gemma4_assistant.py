"""The config of Gemma-4's assistant drafter (`model_type`
`gemma4_assistant`, transformers' `Gemma4AssistantConfig`) and of Gemma-4
Unified's (`gemma4_unified_assistant`, `Gemma4UnifiedAssistantConfig`; the
same model over a `gemma4_unified_text` stack).

Its top-level keys: the target's hidden size it was trained with
(`backbone_hidden_size`; default 1536, the unified one's 3840), and the
centroid-restricted head (`use_ordered_embeddings`, `num_centroids`,
`centroid_intermediate_top_k`). Its decoder is a Gemma-4 text stack
(`text_config`, read by `schemas.hf_gemma4.gemma4_text_args`; without a
`model_type` of its own, `gemma4_text`, or `gemma4_unified_text` for the
unified assistant) whose layers are all kv-shared: where the nested config
names fewer shared layers (0, as transformers' default), every layer is
made shared, as transformers does. It has no per-layer embeddings and no
MoE block (transformers' `validate_architecture`; a unified stack has
neither), and a `gemma4_assistant`'s MLPs are not double-wide (the same
check; the unified assistant's config has no such check).

Reference: transformers `models/gemma4_assistant/configuration_gemma4_assistant.py`,
`models/gemma4_unified_assistant/configuration_gemma4_unified_assistant.py`.
"""

from __future__ import annotations

from typing import Any

from attrs import frozen
from returns.result import Failure, Result, Success

from schemas.errors import ConfigError
from schemas.hf_gemma4 import (
    GEMMA4_TEXT,
    GEMMA4_UNIFIED_TEXT,
    Gemma4Args,
    gemma4_text_args,
)

GEMMA4_ASSISTANT = "gemma4_assistant"
GEMMA4_UNIFIED_ASSISTANT = "gemma4_unified_assistant"
ASSISTANT_MODEL_TYPES = (GEMMA4_ASSISTANT, GEMMA4_UNIFIED_ASSISTANT)
# per assistant model_type: its nested text config's default model_type and
# its default backbone_hidden_size (transformers')
_DEFAULTS: dict[str, tuple[str, int]] = {
    GEMMA4_ASSISTANT: (GEMMA4_TEXT, 1536),
    GEMMA4_UNIFIED_ASSISTANT: (GEMMA4_UNIFIED_TEXT, 3840),
}


@frozen(kw_only=True)
class AssistantArgs:
    """An assistant draft's settings; `text` its decoder's."""

    model_type: str
    text: Gemma4Args
    backbone_hidden_size: int
    use_ordered_embeddings: bool = False
    num_centroids: int = 2048
    centroid_intermediate_top_k: int = 32
    tie_word_embeddings: bool = True

    @property
    def vocab_size(self) -> int:
        return self.text.vocab_size


def _positive(raw: dict[str, Any], key: str, default: int | None) -> int | str:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return f"{key} ({value!r}) must be a positive integer"
    return value


def assistant_args(
    raw: dict[str, Any], where: str
) -> Result[AssistantArgs, ConfigError]:
    """An assistant's config.json -> `AssistantArgs`, or a `ConfigError`
    naming `where`, the problem and the key to fix."""
    model_type = raw.get("model_type")
    if model_type not in ASSISTANT_MODEL_TYPES:
        return Failure(
            ConfigError(
                f"{where}: model_type {model_type!r} is not an assistant draft's; "
                f"supported: {', '.join(ASSISTANT_MODEL_TYPES)}"
            )
        )
    if raw.get("quantization_config") is not None:
        return Failure(
            ConfigError(
                f"{where}: quantization_config is not supported for an assistant "
                "draft; use its bfloat16 checkpoint"
            )
        )
    text = raw.get("text_config")
    if not isinstance(text, dict):
        return Failure(ConfigError(f"{where}: text_config (a dict) is missing"))
    text_type, backbone_default = _DEFAULTS[str(model_type)]
    text = dict(text)
    text.setdefault("model_type", text_type)
    layers = text.get("num_hidden_layers")
    if isinstance(layers, int) and not text.get("num_kv_shared_layers"):
        text["num_kv_shared_layers"] = layers  # transformers' __post_init__
    text.setdefault("hidden_size_per_layer_input", 0)
    tied = raw.get("tie_word_embeddings", True)
    text["tie_word_embeddings"] = tied
    problems: list[str] = []
    backbone = _positive(raw, "backbone_hidden_size", backbone_default)
    centroids = _positive(raw, "num_centroids", 2048)
    top_k = _positive(raw, "centroid_intermediate_top_k", 32)
    problems.extend(p for p in (backbone, centroids, top_k) if isinstance(p, str))
    ordered = raw.get("use_ordered_embeddings", False)
    if not isinstance(ordered, bool):
        problems.append(f"use_ordered_embeddings ({ordered!r}) must be true or false")
    if not isinstance(tied, bool):
        problems.append(f"tie_word_embeddings ({tied!r}) must be true or false")
    if problems:
        return Failure(ConfigError(f"{where}: " + "; ".join(problems)))
    assert isinstance(backbone, int) and isinstance(centroids, int)
    assert isinstance(top_k, int)

    def fits(args: Gemma4Args) -> Result[AssistantArgs, ConfigError]:
        bad = _text_problems(args)
        if model_type == GEMMA4_ASSISTANT and args.use_double_wide_mlp:
            bad.append("text_config.use_double_wide_mlp must be false")
        if ordered:
            if args.vocab_size % centroids:
                bad.append(
                    f"num_centroids ({centroids}) must divide text_config.vocab_size "
                    f"({args.vocab_size})"
                )
            if top_k > centroids:
                bad.append(
                    f"centroid_intermediate_top_k ({top_k}) must be at most "
                    f"num_centroids ({centroids})"
                )
        if bad:
            return Failure(ConfigError(f"{where}: " + "; ".join(bad)))
        return Success(
            AssistantArgs(
                model_type=str(model_type),
                text=args,
                backbone_hidden_size=backbone,
                use_ordered_embeddings=bool(ordered),
                num_centroids=centroids,
                centroid_intermediate_top_k=top_k,
                tie_word_embeddings=bool(tied),
            )
        )

    return gemma4_text_args(text, f"{where} text_config").bind(fits)


def _text_problems(args: Gemma4Args) -> list[str]:
    """What an assistant's decoder may not have (transformers'
    `Gemma4AssistantConfig.validate_architecture`)."""
    problems = []
    if args.num_kv_shared_layers != args.num_hidden_layers:
        problems.append(
            f"text_config.num_kv_shared_layers ({args.num_kv_shared_layers}) must be "
            f"num_hidden_layers ({args.num_hidden_layers}): an assistant's layers all "
            "read the target's keys and values"
        )
    if args.hidden_size_per_layer_input:
        problems.append("text_config.hidden_size_per_layer_input must be 0")
    if args.enable_moe_block:
        problems.append("text_config.enable_moe_block must be false")
    return problems
