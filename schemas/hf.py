"""Records for upstream (Hugging Face) `config.json` files of decoder models.

Parsed leniently: unknown keys are ignored, since upstream configs carry many
keys we do not use. RoPE settings are read from both the legacy top-level keys
(`rope_theta`, `rope_scaling`) and the transformers 5.x form
(`rope_parameters: {rope_theta, rope_type, ...}`): a loader that reads only one
form silently runs with a default base.
"""

from __future__ import annotations

from typing import Any

from attrs import field, frozen

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")


@frozen
class QuantizationConfig:
    """MLX affine quantization of linear and embedding weights."""

    group_size: int = 64
    bits: int = 4


@frozen
class RopeConfig:
    theta: float = 10000.0
    traditional: bool = False
    # "default", "linear" or "llama3"
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@frozen(kw_only=True)
class DecoderArgs:
    """One record for the llama / qwen2 / qwen3 decoder family.

    The three differ in defaults (qwen2 has q/k/v biases) and in one layer
    (qwen3 normalises q and k per head); the model files read what they need.
    """

    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    head_dim: int | None = None
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    rope: RopeConfig = field(factory=RopeConfig)
    quantization: QuantizationConfig | None = None
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads


def normalize_hf_config(raw: dict[str, Any]) -> dict[str, Any]:
    """Fold the upstream key variants into the shape `DecoderArgs` expects
    (ValueError naming a key whose value cannot be read)."""
    cfg = dict(raw)
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    if not isinstance(params, dict):
        params = {}
    if not isinstance(scaling, dict):
        scaling = {}
    merged = {**scaling, **params}
    theta = merged.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
    try:
        if isinstance(theta, bool):
            raise TypeError
        theta = float(theta)
    except (TypeError, ValueError):
        raise ValueError(f"rope_theta must be a number, got {theta!r}") from None
    rope: dict[str, Any] = {
        "theta": theta,
        "traditional": bool(cfg.get("rope_traditional", False)),
        "rope_type": str(rope_type),
    }
    for key in (
        "factor",
        "low_freq_factor",
        "high_freq_factor",
        "original_max_position_embeddings",
    ):
        if key in merged and merged[key] is not None:
            rope[key] = merged[key]
    cfg["rope"] = rope
    if cfg.get("model_type") == "qwen2" and "attention_bias" not in cfg:
        cfg["attention_bias"] = True
    eos = cfg.get("eos_token_id")
    if eos is None:
        cfg["eos_token_id"] = ()
    elif isinstance(eos, int):
        cfg["eos_token_id"] = (eos,)
    else:
        cfg["eos_token_id"] = tuple(int(e) for e in eos)
    quant = cfg.get("quantization")
    if quant is None and isinstance(cfg.get("quantization_config"), dict):
        qc = cfg["quantization_config"]
        if "bits" in qc and "group_size" in qc:
            quant = qc
    cfg["quantization"] = (
        {"group_size": int(quant["group_size"]), "bits": int(quant["bits"])}
        if isinstance(quant, dict)
        else None
    )
    return cfg
