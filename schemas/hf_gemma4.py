"""Records for upstream `config.json` files of Gemma-4: the text model
(`model_type` `gemma4_text`, transformers' `Gemma4ForCausalLM`) and the
multimodal wrapper (`gemma4`, `Gemma4ForConditionalGeneration`), whose text
settings live under `text_config` and which runs here as its text model;
and Gemma-4 "Unified" (`gemma4_unified_text`, `Gemma4UnifiedForCausalLM`;
the multimodal `gemma4_unified`, `Gemma4UnifiedForConditionalGeneration`),
the same decoder without per-layer embeddings and without the MoE block.

`Gemma4Args` extends `DecoderArgs`, so every field the pipeline reads on
`args` means the same as for the dense decoders; `head_dim` and
`num_key_value_heads` are the sliding-window layers' and `rope` their RoPE
(the full-attention layers' own are `global_head_dim`,
`num_global_key_value_heads` and `full_rope`; `head_dim_of` / `kv_heads_of`
/ `rope_of` answer per layer type).

How the keys are read (transformers' `Gemma4TextConfig` semantics):
- `layer_types` (default: every sixth layer full, the rest sliding); the last
  layer is made "full_attention" whatever the list says, as transformers does.
- `rope_parameters` is keyed by layer type (`{"sliding_attention": {...},
  "full_attention": {...}}`); when absent, transformers' defaults (sliding:
  "default", theta 1e4; full: "proportional", partial_rotary_factor 0.25,
  theta 1e6). Only "default" and "proportional" are implemented.
- The full layers' head width and KV heads: `per_layer_config` when the
  config has that key (transformers' own serialisation: overrides of
  `head_dim` / `num_key_value_heads` per layer index, which must agree
  across the layers of a type); else `global_head_dim` (default 512), and
  `num_global_key_value_heads` where `attention_k_eq_v` is set.
- `hidden_size_per_layer_input` null or 0: no per-layer embeddings (absent:
  transformers' default 256). `final_logit_softcapping` null: none.
- The wrapper's `tie_word_embeddings`, `eos_token_id`, `bos_token_id` and
  MLX `quantization` win over (or fill) its `text_config`'s.
- Unified (transformers' `Gemma4UnifiedTextConfig`): other defaults
  (`sliding_window` 1024, `max_position_embeddings` 262144,
  `use_bidirectional_attention` "vision": image tokens attend both ways
  among themselves, text tokens causally, so text decodes as a causal LM);
  the per-layer-embedding and MoE keys are not part of the model (its
  config class drops them, its model has neither), so a unified config's
  `hidden_size_per_layer_input`, `enable_moe_block`, ... are ignored, as
  transformers ignores them.

Two readers: `gemma4_text_args` parses a text config as a Gemma-4 decoder
stack (what `DecoderLayer`s need), also one whose every layer is kv-shared
(the text config of a KV-borrowing assistant draft, whose layers read a
target's keys and values; transformers 5.23's `kv_sharing_modes` raises on
it); `gemma4_args` reads a target's config.json and also refuses a stack in
which a kv-shared layer has no earlier layer of its type to read from
(`target_problem`).
Reference: transformers `models/gemma4/configuration_gemma4.py`,
`models/gemma4_unified/configuration_gemma4_unified.py`,
`modeling_rope_utils.py` (`_compute_proportional_rope_parameters`).
"""

from __future__ import annotations

from typing import Any, TypeGuard

from attrs import field, frozen
from returns.result import Failure, Result, Success

from schemas.converter import hf, structure
from schemas.errors import ConfigError
from schemas.hf import DecoderArgs, normalize_hf_config
from schemas.hf_glm4_moe import upstream_problem

GEMMA4_TEXT = "gemma4_text"
GEMMA4_MULTIMODAL = "gemma4"
GEMMA4_UNIFIED_TEXT = "gemma4_unified_text"
GEMMA4_UNIFIED = "gemma4_unified"
# Gemma-3's text model runs on the same decoder (no args class of its own:
# the Gemma4Args switches `_gemma3_settings` sets)
GEMMA3_TEXT = "gemma3_text"
GEMMA3_MULTIMODAL = "gemma3"
GEMMA3_MODEL_TYPES = (GEMMA3_TEXT, GEMMA3_MULTIMODAL)
GEMMA4_MODEL_TYPES = (
    GEMMA4_TEXT,
    GEMMA4_MULTIMODAL,
    GEMMA4_UNIFIED_TEXT,
    GEMMA4_UNIFIED,
    *GEMMA3_MODEL_TYPES,
)
UNIFIED_MODEL_TYPES = (GEMMA4_UNIFIED_TEXT, GEMMA4_UNIFIED)
# a multimodal wrapper's model_type -> its text model's, and transformers'
# class of that text model (what `convert` writes for the text part)
TEXT_MODELS: dict[str, tuple[str, str]] = {
    GEMMA4_MULTIMODAL: (GEMMA4_TEXT, "Gemma4ForCausalLM"),
    GEMMA4_UNIFIED: (GEMMA4_UNIFIED_TEXT, "Gemma4UnifiedForCausalLM"),
    GEMMA3_MULTIMODAL: (GEMMA3_TEXT, "Gemma3ForCausalLM"),
}

SLIDING_ATTENTION = "sliding_attention"
FULL_ATTENTION = "full_attention"
LAYER_TYPES = (SLIDING_ATTENTION, FULL_ATTENTION)

ROPE_TYPES = ("default", "proportional", "linear")
# transformers' per-type defaults when a config has no `rope_parameters`
_DEFAULT_ROPE: dict[str, dict[str, Any]] = {
    SLIDING_ATTENTION: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL_ATTENTION: {
        "rope_type": "proportional",
        "partial_rotary_factor": 0.25,
        "rope_theta": 1_000_000.0,
    },
}

# transformers' Gemma4TextConfig defaults for keys a config.json may omit
_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_144,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 30,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "eos_token_id": 1,
    "bos_token_id": 2,
    "tie_word_embeddings": True,
}
# where Gemma4UnifiedTextConfig's defaults differ from Gemma4TextConfig's
_UNIFIED_DEFAULTS: dict[str, Any] = {
    "sliding_window": 1024,
    "max_position_embeddings": 262_144,
    "use_bidirectional_attention": "vision",
}
# the Gemma-4 keys a unified model does not have (no PLE, no MoE block)
_NOT_UNIFIED: dict[str, Any] = {
    "hidden_size_per_layer_input": 0,
    "vocab_size_per_layer_input": 0,
    "enable_moe_block": False,
    "num_experts": 0,
    "top_k_experts": 0,
    "moe_intermediate_size": 0,
}
# keys whose null means "none" (not "the default")
_NULLABLE = (
    "final_logit_softcapping",
    "num_global_key_value_heads",
    "use_bidirectional_attention",
)
# transformers' Gemma3TextConfig defaults where they differ from Gemma-4's
_GEMMA3_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208,
    "num_hidden_layers": 26,
    "sliding_window": 4096,
    "query_pre_attn_scalar": 256,
}
# the per-layer overrides (`per_layer_config`) this model reads
_OVERRIDES = ("head_dim", "num_key_value_heads")
_SLIDING_PATTERN = 6  # transformers' default: five sliding layers, then a full one


@frozen
class LayerRope:
    """One layer type's RoPE. "default": every pair of the head rotates,
    frequencies theta^(-2i/D) (`partial_rotary_factor` unused, as in
    transformers). "proportional": the first `partial_rotary_factor * D / 2`
    rotate-half pairs (i, i + D/2) rotate at theta^(-2i/D) / factor, the
    rest not at all (frequency 0). "linear" (Gemma-3's full layers in its
    larger models): "default" at positions divided by `factor`."""

    rope_type: str = "default"
    theta: float = 10_000.0
    partial_rotary_factor: float = 1.0
    factor: float = 1.0


@frozen(kw_only=True)
class Gemma4Args(DecoderArgs):
    """Gemma-4's text decoder. The defaults are transformers' Gemma4TextConfig's."""

    tie_word_embeddings: bool = True
    hidden_activation: str = "gelu_pytorch_tanh"
    sliding_window: int = 512
    layer_types: tuple[str, ...] = ()
    # the full-attention layers' head width and (None: num_key_value_heads) KV heads
    global_head_dim: int = 512
    num_global_key_value_heads: int | None = None
    # full layers: values are the keys' projection (no v_proj), v-normed, not roped
    attention_k_eq_v: bool = False
    # the last this many layers read the keys/values of the last earlier
    # layer of their type (no k/v projections, no cache slots)
    num_kv_shared_layers: int = 0
    use_double_wide_mlp: bool = False  # kv-shared layers' MLP twice as wide
    # per-layer embeddings (PLE): 0 for none
    hidden_size_per_layer_input: int = 256
    vocab_size_per_layer_input: int = 262_144
    # a MoE block beside each layer's dense MLP
    enable_moe_block: bool = False
    num_experts: int = 0
    top_k_experts: int = 0
    moe_intermediate_size: int = 0
    final_logit_softcapping: float | None = None
    use_bidirectional_attention: str | None = None
    sliding_rope: LayerRope = field(factory=LayerRope)
    full_rope: LayerRope = field(
        factory=lambda: LayerRope("proportional", 1_000_000.0, 0.25)
    )
    # Gemma-3's text model (`gemma3_text`) on this decoder: softmax scale
    # query_pre_attn_scalar^-0.5 (Gemma-4: 1), no value norm, RMSNorms of
    # x / rms(x) * (1 + weight), no per-layer `layer_scalar`
    attention_scale: float = 1.0
    value_norm: bool = True
    norm_offset: bool = False
    layer_scalar: bool = True

    @property
    def first_kv_shared(self) -> int:
        """The first layer that reads an earlier layer's keys/values."""
        return self.num_hidden_layers - self.num_kv_shared_layers

    def is_kv_shared(self, layer: int) -> bool:
        return layer >= self.first_kv_shared

    def head_dim_of(self, layer_type: str) -> int:
        if layer_type == FULL_ATTENTION:
            return self.global_head_dim
        return self.dim_per_head

    def kv_heads_of(self, layer_type: str) -> int:
        if layer_type == FULL_ATTENTION and self.num_global_key_value_heads is not None:
            return self.num_global_key_value_heads
        return self.num_key_value_heads

    def rope_of(self, layer_type: str) -> LayerRope:
        return self.full_rope if layer_type == FULL_ATTENTION else self.sliding_rope

    def keys_are_values(self, layer_type: str) -> bool:
        """Whether this type's layers take values from the key projection."""
        return self.attention_k_eq_v and layer_type == FULL_ATTENTION

    def producer(self, layer_type: str) -> int | None:
        """The layer whose stored keys/values the kv-shared layers of
        `layer_type` read: the last non-shared layer of that type; when no
        layer is shared, the last layer of that type (what a KV-borrowing
        draft reads). None: no such layer."""
        found = [
            i for i in range(self.first_kv_shared) if self.layer_types[i] == layer_type
        ]
        return found[-1] if found else None

    def slot(self, layer: int) -> int:
        """A non-shared layer's index among the stored layers of its type
        (its arena slot in models/gemma4.py's cache)."""
        kind = self.layer_types[layer]
        return sum(1 for i in range(layer) if self.layer_types[i] == kind)

    def stored_layers(self, layer_type: str) -> int:
        """How many non-shared layers of `layer_type` store keys/values."""
        return sum(
            1 for i in range(self.first_kv_shared) if self.layer_types[i] == layer_type
        )


def is_gemma4(args: DecoderArgs) -> TypeGuard[Gemma4Args]:
    """Whether `args` are a Gemma-4 (or Unified) decoder's, not Gemma-3's on
    the same decoder: what Gemma-4's own drafters (the KV-borrowing
    assistant, DeepSpec's Gemma-4 DSpark) were trained against."""
    return isinstance(args, Gemma4Args) and args.model_type not in GEMMA3_MODEL_TYPES


def layout_problem(args: Gemma4Args) -> str | None:
    """What a stack of Gemma-4 decoder layers cannot be built from, said with
    the values and the key to fix (None: nothing)."""
    layers = args.num_hidden_layers
    unknown = sorted({kind for kind in args.layer_types if kind not in LAYER_TYPES})
    if len(args.layer_types) != layers or unknown:
        return (
            f"layer_types must list one of {', '.join(map(repr, LAYER_TYPES))} per "
            f"layer ({layers} layers); got {len(args.layer_types)} entries"
            + (f", unknown {unknown}" if unknown else "")
        )
    if args.hidden_activation != "gelu_pytorch_tanh":
        return (
            f"hidden_activation {args.hidden_activation!r} is not supported; "
            "Gemma-4's MLPs are GeGLU with 'gelu_pytorch_tanh'"
        )
    if args.use_bidirectional_attention == "all":
        return (
            "use_bidirectional_attention 'all' makes every token attend both ways: "
            "not a causal language model, cannot decode"
        )
    small = [
        f"{key} ({value})"
        for key, value in (
            ("hidden_size", args.hidden_size),
            ("num_attention_heads", args.num_attention_heads),
            ("num_key_value_heads", args.num_key_value_heads),
            ("sliding_window", args.sliding_window),
            ("intermediate_size", args.intermediate_size),
        )
        if value < 1
    ]
    if small:
        return f"{', '.join(small)}: must be at least 1"
    for kind in sorted(set(args.layer_types)):
        dim, kv = args.head_dim_of(kind), args.kv_heads_of(kind)
        dim_key = "global_head_dim" if kind == FULL_ATTENTION else "head_dim"
        kv_key = (
            "num_global_key_value_heads"
            if kind == FULL_ATTENTION and args.num_global_key_value_heads is not None
            else "num_key_value_heads"
        )
        if dim < 2 or dim % 2:
            return f"{dim_key} ({dim}) of the {kind} layers must be even (RoPE pairs)"
        if kv < 1 or args.num_attention_heads % kv:
            return (
                f"{kv_key} ({kv}) of the {kind} layers must divide "
                f"num_attention_heads ({args.num_attention_heads})"
            )
        rope = args.rope_of(kind)
        if rope.rope_type not in ROPE_TYPES:
            return (
                f"rope_parameters[{kind!r}] rope_type {rope.rope_type!r} is not "
                f"supported; supported: {', '.join(ROPE_TYPES)}"
            )
        if not 0.0 <= rope.partial_rotary_factor <= 1.0 or rope.factor <= 0:
            return (
                f"rope_parameters[{kind!r}]: partial_rotary_factor "
                f"({rope.partial_rotary_factor}) must be within [0, 1] and factor "
                f"({rope.factor}) positive"
            )
    if not 0 <= args.num_kv_shared_layers <= layers:
        return (
            f"num_kv_shared_layers ({args.num_kv_shared_layers}) must be between 0 "
            f"and num_hidden_layers ({layers})"
        )
    if args.hidden_size_per_layer_input < 0 or (
        args.hidden_size_per_layer_input and args.vocab_size_per_layer_input < 1
    ):
        return (
            f"hidden_size_per_layer_input ({args.hidden_size_per_layer_input}) must "
            "be 0 (no per-layer embeddings) or positive with a positive "
            f"vocab_size_per_layer_input ({args.vocab_size_per_layer_input})"
        )
    if args.enable_moe_block and not (
        args.num_experts >= 1
        and 1 <= args.top_k_experts <= args.num_experts
        and args.moe_intermediate_size >= 1
    ):
        return (
            f"enable_moe_block needs num_experts ({args.num_experts}) >= 1, "
            f"top_k_experts ({args.top_k_experts}) between 1 and num_experts, and "
            f"moe_intermediate_size ({args.moe_intermediate_size}) >= 1"
        )
    softcap = args.final_logit_softcapping
    if softcap is not None and not softcap > 0:
        return f"final_logit_softcapping ({softcap}) must be positive or null"
    return None


def target_problem(args: Gemma4Args) -> str | None:
    """What a standalone target cannot run: `layout_problem`'s, and kv-shared
    layers with no earlier layer of their type to read keys/values from."""
    problem = layout_problem(args)
    if problem is not None:
        return problem
    shared = args.num_kv_shared_layers
    if shared == args.num_hidden_layers:
        return (
            f"num_kv_shared_layers ({shared}) equals num_hidden_layers: no layer "
            "computes keys and values of its own. That is a KV-borrowing draft's "
            "text config (a Gemma-4 assistant), not a model that runs alone"
        )
    if shared:
        producing = set(args.layer_types[: args.first_kv_shared])
        orphans = sorted(set(args.layer_types) - producing)
        if orphans:
            return (
                f"num_kv_shared_layers ({shared}): the kv-shared layers of type "
                f"{orphans} have no earlier non-shared layer of that type to read "
                "keys and values from (layer_types)"
            )
    return None


def _layer_types(given: dict[str, Any], layers: int) -> list[str]:
    kinds = given.get("layer_types")
    if kinds is None:
        kinds = [
            SLIDING_ATTENTION if (i + 1) % _SLIDING_PATTERN else FULL_ATTENTION
            for i in range(layers)
        ]
    kinds = [str(kind) for kind in kinds]
    if kinds and len(kinds) == layers:
        kinds[-1] = FULL_ATTENTION  # as transformers forces it
    return kinds


def _ropes(given: dict[str, Any], kinds: list[str]) -> dict[str, Any] | str:
    """`sliding_rope` / `full_rope` from `rope_parameters`, or a problem."""
    params = given.get("rope_parameters")
    if params is None:
        params = _DEFAULT_ROPE
    if not isinstance(params, dict) or any(k not in LAYER_TYPES for k in params):
        return (
            "rope_parameters must be keyed by layer type "
            f"({', '.join(map(repr, LAYER_TYPES))}), each a dict of rope_type, "
            f"rope_theta, ...; got {params!r}"
        )
    out: dict[str, Any] = {}
    for kind, name in (
        (SLIDING_ATTENTION, "sliding_rope"),
        (FULL_ATTENTION, "full_rope"),
    ):
        entry = params.get(kind)
        if entry is None:
            if kind in kinds:
                return f"rope_parameters has no entry for the {kind!r} layers"
            entry = _DEFAULT_ROPE[kind]
        if not isinstance(entry, dict):
            return f"rope_parameters[{kind!r}] must be a dict, got {entry!r}"
        defaults = _DEFAULT_ROPE[kind]
        out[name] = {
            "rope_type": entry.get("rope_type", entry.get("type", "default")),
            "theta": entry.get("rope_theta", defaults["rope_theta"]),
            "partial_rotary_factor": entry.get("partial_rotary_factor", 1.0),
            "factor": entry.get("factor", 1.0),
        }
    return out


def _per_layer_heads(
    given: dict[str, Any], kinds: list[str], cfg: dict[str, Any]
) -> str | None:
    """The full layers' head width / KV heads into `cfg` (and the sliding
    layers', if `per_layer_config` overrides them); or a problem."""
    if "per_layer_config" not in given:
        cfg["global_head_dim"] = given.get("global_head_dim", 512)
        kv = given.get("num_global_key_value_heads")
        # as transformers: the global KV heads apply only with attention_k_eq_v
        cfg["num_global_key_value_heads"] = (
            kv if given.get("attention_k_eq_v", False) else None
        )
        return None
    overrides = given.get("per_layer_config") or {}
    head_dim, kv_heads = cfg["head_dim"], cfg["num_key_value_heads"]
    if not isinstance(overrides, dict):
        return (
            f"per_layer_config must map layer indices to overrides, got {overrides!r}"
        )
    by_layer: dict[int, dict[str, Any]] = {}
    for key, value in overrides.items():
        try:
            index = int(key)
        except (TypeError, ValueError):
            return f"per_layer_config: key {key!r} is not a layer index"
        if not 0 <= index < len(kinds) or not isinstance(value, dict):
            return (
                f"per_layer_config[{key!r}]: not a layer index below "
                f"{len(kinds)} with a dict of overrides"
            )
        extra = sorted(set(value) - set(_OVERRIDES))
        if extra:
            return (
                f"per_layer_config[{key!r}] overrides {extra}; only "
                f"{', '.join(_OVERRIDES)} may differ per layer here"
            )
        by_layer[index] = value
    for kind in sorted(set(kinds)):
        seen = {
            tuple(sorted(by_layer.get(i, {}).items()))
            for i, k in enumerate(kinds)
            if k == kind
        }
        if len(seen) > 1:
            return (
                f"per_layer_config: the {kind} layers' overrides differ "
                f"({sorted(seen)}); every layer of a type must have the same"
            )
        override = dict(next(iter(seen)))
        dim = override.get("head_dim", head_dim)
        kv = override.get("num_key_value_heads", kv_heads)
        if kind == FULL_ATTENTION:
            cfg["global_head_dim"] = dim
            cfg["num_global_key_value_heads"] = kv
        else:
            cfg["head_dim"], cfg["num_key_value_heads"] = dim, kv
    cfg.setdefault("global_head_dim", head_dim)  # no full layer
    return None


def text_part(raw: dict[str, Any]) -> dict[str, Any]:
    """A config dict's text settings: a multimodal wrapper's (`gemma4`,
    `gemma4_unified`) `text_config` with the wrapper's
    `tie_word_embeddings`, token ids and MLX quantization, under the
    wrapper's `model_type`; any other dict as is."""
    wrapper = raw.get("model_type")
    if wrapper not in TEXT_MODELS:
        return raw
    text = raw.get("text_config")
    flat = dict(text) if isinstance(text, dict) else {}
    for key in ("quantization", "quantization_config", "eos_token_id", "bos_token_id"):
        if raw.get(key) is not None:
            flat[key] = raw[key]
    flat["tie_word_embeddings"] = raw.get("tie_word_embeddings", True)
    flat["model_type"] = wrapper
    return flat


def normalize_gemma4_config(raw: dict[str, Any]) -> dict[str, Any] | str:
    """A text config dict in the shape `Gemma4Args` expects, or a problem."""
    given = {k: v for k, v in raw.items() if v is not None or k in _NULLABLE}
    if "hidden_size_per_layer_input" in raw and not raw["hidden_size_per_layer_input"]:
        given["hidden_size_per_layer_input"] = 0
    given.setdefault("model_type", GEMMA4_TEXT)
    defaults = _DEFAULTS
    if given["model_type"] in UNIFIED_MODEL_TYPES:
        defaults = {**_DEFAULTS, **_UNIFIED_DEFAULTS}
        given = {**given, **_NOT_UNIFIED}  # as transformers, whatever the keys say
    if given["model_type"] in GEMMA3_MODEL_TYPES:
        problem = _gemma3_problem(given)
        if problem is not None:
            return problem
        defaults = {**_DEFAULTS, **_GEMMA3_DEFAULTS}
        given = {**defaults, **given, **_gemma3_settings({**defaults, **given})}
    cfg = normalize_hf_config({**defaults, **given})
    layers = cfg["num_hidden_layers"]
    if not isinstance(layers, int) or layers < 1:
        return f"num_hidden_layers ({layers!r}) must be a positive integer"
    kinds = _layer_types(given, layers)
    cfg["layer_types"] = kinds
    ropes = _ropes(given, kinds)
    if isinstance(ropes, str):
        return ropes
    cfg.update(ropes)
    sliding = ropes["sliding_rope"]
    cfg["rope"] = {"theta": sliding["theta"], "rope_type": "default"}
    problem = _per_layer_heads(given, kinds, cfg)
    if problem is not None:
        return problem
    for key in ("num_experts", "top_k_experts", "moe_intermediate_size"):
        cfg[key] = given.get(key) or 0
    return cfg


def _gemma3_problem(given: dict[str, Any]) -> str | None:
    """What of a `gemma3_text` config this decoder does not implement."""
    if given.get("attn_logit_softcapping") is not None:
        return (
            f"attn_logit_softcapping ({given['attn_logit_softcapping']}) is not "
            "supported (Gemma-2's attention softcapping; Gemma-3 sets it null)"
        )
    if given.get("use_bidirectional_attention"):
        return (
            "use_bidirectional_attention makes every token attend both ways: "
            "not a causal language model, cannot decode"
        )
    return None


def _gemma3_settings(given: dict[str, Any]) -> dict[str, Any]:
    """A `gemma3_text` config as this decoder's keys: Gemma-3's RoPE
    defaults and scale, its full layers as wide as its sliding ones, and no
    per-layer embeddings, MoE block, kv sharing or value norm."""
    ropes = given.get("rope_parameters")
    if ropes is None:  # transformers 4.x keys (mlx-community's configs)
        full = given.get("rope_scaling") or {"rope_type": "default"}
        ropes = {
            SLIDING_ATTENTION: {
                "rope_type": "default",
                "rope_theta": given.get("rope_local_base_freq", 10_000.0),
            },
            FULL_ATTENTION: {
                **full,
                "rope_theta": given.get("rope_theta", 1_000_000.0),
            },
        }
    return {
        **_NOT_UNIFIED,
        "rope_parameters": ropes,
        "global_head_dim": given["head_dim"],
        "num_global_key_value_heads": None,
        "attention_k_eq_v": False,
        "num_kv_shared_layers": 0,
        "use_double_wide_mlp": False,
        "attention_scale": float(given["query_pre_attn_scalar"]) ** -0.5,
        "value_norm": False,
        "norm_offset": True,
        "layer_scalar": False,
    }


def gemma4_text_args(
    raw: dict[str, Any], where: str
) -> Result[Gemma4Args, ConfigError]:
    """A Gemma-4 text config dict (a `gemma4_text` or `gemma4_unified_text`
    config.json, or the `text_config` a wrapper or an assistant draft nests;
    its `model_type` picks the defaults) -> `Gemma4Args`, or
    a `ConfigError` naming `where`, the problem and the key to fix. Every
    layer may be kv-shared (an assistant's stack, which reads a target's
    keys and values); `gemma4_args` is the target's reader."""
    cfg = normalize_gemma4_config(raw)
    if isinstance(cfg, str):
        return Failure(ConfigError(f"{where}: {cfg}"))

    def buildable(args: Gemma4Args) -> Result[Gemma4Args, ConfigError]:
        problem = layout_problem(args)
        if problem is not None:
            return Failure(ConfigError(f"{where}: {problem}"))
        return Success(args)

    return structure(hf, cfg, Gemma4Args, where).bind(buildable)


def gemma4_args(raw: dict[str, Any], where: str) -> Result[Gemma4Args, ConfigError]:
    """A target's config.json (`gemma4_text`, `gemma4_unified_text`, or the
    `gemma4` / `gemma4_unified` wrapper, run as its text model) ->
    `Gemma4Args`, or a `ConfigError` naming `where`, the problem and the key
    to fix (`target_problem` included)."""
    flat = text_part(raw)
    unsupported = upstream_problem(raw, where, "Gemma-4", GEMMA4_MODEL_TYPES, flat)
    if unsupported is not None:
        return Failure(unsupported)

    def runnable(args: Gemma4Args) -> Result[Gemma4Args, ConfigError]:
        problem = target_problem(args)
        if problem is not None:
            return Failure(ConfigError(f"{where}: {problem}"))
        return Success(args)

    return gemma4_text_args(flat, where).bind(runnable)
