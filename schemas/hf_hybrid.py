"""Records for upstream `config.json` files of hybrid (attention + linear
recurrent) decoders: Qwen3-Next (`model_type` `qwen3_next`), Qwen3.5 dense
(`qwen3_5_text`, and `qwen3_5`, the multimodal wrapper whose text settings
live under `text_config`) and Qwen3.5 MoE (`qwen3_5_moe_text`, and its
wrapper `qwen3_5_moe`).

`HybridArgs` extends `DecoderArgs`, so every field the pipeline reads on
`args` (model_type, hidden_size, vocab_size, num_hidden_layers,
max_position_embeddings, eos/bos ids, tie_word_embeddings, quantization) means
the same as for the dense decoders, and the model satisfies
`models.base.CausalLM` unchanged. RoPE is read from both `rope_theta` /
`rope_scaling` and `rope_parameters` (through `normalize_hf_config`); the
partial rotary factor from `rope_parameters` or the top level.

Qwen3.5 dense parses to the same record with `num_experts` 0 (every layer a
dense MLP of `intermediate_size`; its config defines no MoE keys) and
`mtp_num_hidden_layers` read as `num_nextn_predict_layers`. Its multimodal
RoPE (`mrope_section`) is the plain RoPE for text, where the temporal, height
and width positions are all the token's position.

Qwen3.5 MoE parses like Qwen3.5 dense but keeps its experts: every layer is a
sparse MoE block (shared expert included). Its config defines neither
`intermediate_size` (no dense MLP: read as 0 when absent) nor
`mlp_only_layers`, `decoder_sparse_step` or `norm_topk_prob`: transformers
deletes those keys and its router always renormalises the top-k weights, so
they are fixed here to every layer sparse, renormalised, whatever a
config.json says. `num_experts` and `num_experts_per_tok` default to
transformers' Qwen3_5MoeTextConfig values (256, 8), not Qwen3-Next's.
References: transformers `models/qwen3_next/configuration_qwen3_next.py`,
`models/qwen3_5/configuration_qwen3_5.py`,
`models/qwen3_5_moe/configuration_qwen3_5_moe.py`.
"""

from __future__ import annotations

from typing import Any

from attrs import field, frozen
from returns.result import Failure, Result

from schemas.converter import hf, structure
from schemas.errors import ConfigError
from schemas.hf import DecoderArgs, normalize_hf_config

# the multimodal wrapper (`Qwen3_5ForConditionalGeneration`) and the text model
QWEN3_5_MODEL_TYPES = ("qwen3_5", "qwen3_5_text")
# the same pair for Qwen3.5 MoE (`Qwen3_5MoeForConditionalGeneration`)
QWEN3_5_MOE_MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")
HYBRID_MODEL_TYPES = ("qwen3_next", *QWEN3_5_MODEL_TYPES, *QWEN3_5_MOE_MODEL_TYPES)

LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"
LAYER_KINDS = (LINEAR_ATTENTION, FULL_ATTENTION)

# transformers' Qwen3NextConfig defaults for keys a config.json may omit
_DEFAULTS: dict[str, Any] = {
    "head_dim": 256,
    "partial_rotary_factor": 0.25,
    "full_attention_interval": 4,
}
# transformers' Qwen3_5MoeTextConfig defaults where they differ from the above
_QWEN3_5_MOE_DEFAULTS: dict[str, Any] = {
    "num_experts": 256,
    "num_experts_per_tok": 8,
}


def _check_layer_kinds(
    _instance: object, _attribute: object, value: tuple[str, ...]
) -> None:
    unknown = sorted({kind for kind in value if kind not in LAYER_KINDS})
    if unknown:
        raise ValueError(
            f"layer_types: unknown kinds {unknown}; expected {', '.join(LAYER_KINDS)}"
        )


@frozen(kw_only=True)
class HybridArgs(DecoderArgs):
    """Qwen3-Next / Qwen3.5 / Qwen3.5 MoE: gated full-attention layers
    interleaved with GatedDeltaNet linear-attention layers, each followed by a
    sparse MoE block (shared expert included) or a dense MLP (every layer when
    num_experts is 0, as for Qwen3.5 dense)."""

    # one kind per layer: "linear_attention" or "full_attention"
    layer_types: tuple[str, ...] = field(validator=_check_layer_kinds)
    # fraction of head_dim that RoPE rotates (the rest passes through)
    partial_rotary_factor: float = 0.25
    # the defaults below are transformers' Qwen3NextConfig's
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    num_experts: int = 512
    num_experts_per_tok: int = 10
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # MTP layers a checkpoint may carry (`mtp.layers.{i}`); vLLM's default is 1
    num_nextn_predict_layers: int = 1

    def __attrs_post_init__(self) -> None:
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries for "
                f"{self.num_hidden_layers} layers"
            )
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                "linear_num_value_heads must be a multiple of linear_num_key_heads"
            )

    @property
    def rotary_dims(self) -> int:
        return int(self.dim_per_head * self.partial_rotary_factor)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(
            i for i, kind in enumerate(self.layer_types) if kind == FULL_ATTENTION
        )

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(
            i for i, kind in enumerate(self.layer_types) if kind == LINEAR_ATTENTION
        )

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer `layer` has a MoE block (else a dense MLP)."""
        return (
            layer not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer + 1) % self.decoder_sparse_step == 0
        )


def text_settings(raw: dict[str, Any]) -> dict[str, Any]:
    """A multimodal wrapper config (`text_config` inside) as one flat dict of
    the text decoder's settings; other configs unchanged.

    The wrapper's own keys fill what `text_config` omits or leaves null (eos
    ids, an MLX `quantization`), except `tie_word_embeddings`, where the wrapper's value
    wins: it is the one transformers ties the wrapper's `lm_head` by. The
    wrapper's `model_type` is kept. `vision_config` is dropped."""
    text = raw.get("text_config")
    if not isinstance(text, dict):
        return raw
    outer = {k: v for k, v in raw.items() if k not in ("text_config", "vision_config")}
    given = {k: v for k, v in text.items() if v is not None}  # None: not set there
    flat = {**outer, **given, "model_type": raw.get("model_type")}
    if "tie_word_embeddings" in raw:
        flat["tie_word_embeddings"] = raw["tie_word_embeddings"]
    return flat


def normalize_hybrid_config(raw: dict[str, Any]) -> dict[str, Any]:
    """Fold the upstream key variants into the shape `HybridArgs` expects."""
    raw = text_settings(raw)
    cfg = normalize_hf_config(raw)
    if raw.get("model_type") in QWEN3_5_MODEL_TYPES:
        _qwen3_5_settings(raw, cfg)
    elif raw.get("model_type") in QWEN3_5_MOE_MODEL_TYPES:
        _qwen3_5_moe_settings(raw, cfg)
    params = raw.get("rope_parameters")
    params = params if isinstance(params, dict) else {}
    factor = params.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    cfg["partial_rotary_factor"] = float(
        factor if factor is not None else _DEFAULTS["partial_rotary_factor"]
    )
    if cfg.get("head_dim") is None:
        cfg["head_dim"] = _DEFAULTS["head_dim"]
    layers = cfg.get("num_hidden_layers")
    if cfg.get("layer_types") is None and isinstance(layers, int):
        interval = (
            cfg.get("full_attention_interval") or _DEFAULTS["full_attention_interval"]
        )
        cfg["layer_types"] = [
            FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION
            for i in range(layers)
        ]
    if cfg.get("mlp_only_layers") is None:
        cfg["mlp_only_layers"] = []
    return cfg


def _qwen3_5_settings(raw: dict[str, Any], cfg: dict[str, Any]) -> None:
    """Qwen3.5 dense: no experts, plus what every Qwen3.5 shares."""
    cfg["num_experts"] = 0
    cfg["mlp_only_layers"] = []
    _qwen3_5_family_settings(raw, cfg)


def _qwen3_5_moe_settings(raw: dict[str, Any], cfg: dict[str, Any]) -> None:
    """Qwen3.5 MoE: every layer sparse with renormalised top-k (the keys that
    could say otherwise do not exist for it), no dense MLP unless a config
    names one, plus what every Qwen3.5 shares."""
    for key, value in _QWEN3_5_MOE_DEFAULTS.items():
        if cfg.get(key) is None:
            cfg[key] = value
    cfg["mlp_only_layers"] = []
    cfg["decoder_sparse_step"] = 1
    cfg["norm_topk_prob"] = True
    if cfg.get("intermediate_size") is None:
        cfg["intermediate_size"] = 0
    _qwen3_5_family_settings(raw, cfg)


def _qwen3_5_family_settings(raw: dict[str, Any], cfg: dict[str, Any]) -> None:
    """Every Qwen3.5: the MTP layer count under its own key, and the
    multimodal RoPE taken as the plain RoPE (text positions)."""
    mtp_layers = raw.get("mtp_num_hidden_layers")
    if "num_nextn_predict_layers" not in raw and isinstance(mtp_layers, int):
        cfg["num_nextn_predict_layers"] = mtp_layers
    if cfg["rope"].get("rope_type") == "mrope":  # the older `rope_scaling` form
        cfg["rope"]["rope_type"] = "default"


def hybrid_args(raw: dict[str, Any], where: str) -> Result[HybridArgs, ConfigError]:
    """An upstream config dict -> `HybridArgs`, or a `ConfigError` naming `where`."""
    model_type = raw.get("model_type")
    if model_type not in HYBRID_MODEL_TYPES:
        return Failure(
            ConfigError(
                f"{where}: model_type {model_type!r} is not a hybrid model; "
                f"supported: {', '.join(HYBRID_MODEL_TYPES)}"
            )
        )
    cfg = normalize_hybrid_config(raw)
    problem = _layout_problem(cfg)
    if problem is not None:
        return Failure(ConfigError(f"{where}: {problem}"))
    return structure(hf, cfg, HybridArgs, where)


def _layout_problem(cfg: dict[str, Any]) -> str | None:
    """What `HybridArgs`' own checks would refuse, said with the values (cattrs
    reports a refusal by `__init__` only as "invalid value")."""
    kinds = cfg.get("layer_types")
    layers = cfg.get("num_hidden_layers")
    if isinstance(kinds, list | tuple):
        unknown = sorted({str(k) for k in kinds if k not in LAYER_KINDS})
        if unknown:
            return f"layer_types: unknown kinds {unknown}; expected {', '.join(LAYER_KINDS)}"
        if isinstance(layers, int) and len(kinds) != layers:
            return f"layer_types has {len(kinds)} entries for {layers} layers"
    key_heads = cfg.get("linear_num_key_heads", 16)
    value_heads = cfg.get("linear_num_value_heads", 32)
    if (
        isinstance(key_heads, int)
        and isinstance(value_heads, int)
        and (key_heads <= 0 or value_heads % key_heads)
    ):
        return (
            f"linear_num_value_heads ({value_heads}) must be a multiple of "
            f"linear_num_key_heads ({key_heads})"
        )
    return None
