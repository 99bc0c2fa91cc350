"""Records for upstream `config.json` files of GLM-4.5 / 4.6 / 4.7 MoE decoders
(`model_type` `glm4_moe`, transformers' `Glm4MoeForCausalLM`).

`Glm4MoeArgs` extends `DecoderArgs`, so every field the pipeline reads on
`args` means the same as for the dense decoders and the model satisfies
`models.base.CausalLM` unchanged; its MoE settings (`MoeArgs`, checked by
`moe_problem`) are GLM-5's too (schemas/hf_glm_moe_dsa.py). RoPE is read
from both `rope_theta` / `rope_scaling` and `rope_parameters` (through
`normalize_hf_config`); the partial rotary factor from `rope_parameters` or the top level (transformers'
default for this model type: 0.5). Keys a config.json omits take
transformers' `Glm4MoeConfig` defaults (`rms_norm_eps` 1e-5, not the
dense decoders' 1e-6).

What the model cannot run (`layout_problem`) is refused with the values, by
`glm4_moe_args` (a `ConfigError`) and again by the model's constructor
(which `build_model` reports as a `ConfigError`, for args made in code): an
activation other than SiLU, expert counts and groups that the group-limited
router cannot split (`n_routed_experts` a multiple of `n_group`, at least
two experts per group, `topk_group` groups holding `num_experts_per_tok`
experts), a rotary width that is not an even number of dimensions.
Reference: transformers `models/glm4_moe/configuration_glm4_moe.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from attrs import frozen
from returns.result import Failure, Result, Success

from schemas.converter import hf, structure
from schemas.errors import ConfigError
from schemas.hf import DecoderArgs, normalize_hf_config

GLM4_MOE_MODEL_TYPES = ("glm4_moe",)

# transformers' Glm4MoeConfig defaults for keys a config.json may omit
_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151552,
    "hidden_size": 4096,
    "intermediate_size": 10944,
    "num_hidden_layers": 46,
    "num_attention_heads": 96,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "partial_rotary_factor": 0.5,
}


@frozen(kw_only=True)
class MoeArgs(DecoderArgs):
    """The DeepSeek-V3-style MoE settings GLM-4.5 (`Glm4MoeArgs`) and GLM-5
    (`schemas.hf_glm_moe_dsa.GlmMoeDsaArgs`) share: the first
    `first_k_dense_replace` layers with a dense SwiGLU MLP of
    `intermediate_size`, the rest with a sigmoid-routed, group-limited MoE
    block plus `n_shared_experts` shared experts (models/glm4_moe.py's
    `MoE`). The defaults are transformers' Glm4MoeConfig's."""

    hidden_act: str = "silu"
    moe_intermediate_size: int = 1408
    n_routed_experts: int = 128
    num_experts_per_tok: int = 8
    n_shared_experts: int = 1
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    first_k_dense_replace: int = 1
    norm_topk_prob: bool = True
    # MTP layers a checkpoint carries as `model.layers.{num_hidden_layers + i}`
    num_nextn_predict_layers: int = 1

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer `layer` (an MTP layer's index too, which is
        `num_hidden_layers + i`) has a MoE block (else a dense MLP)."""
        return layer >= self.first_k_dense_replace


@frozen(kw_only=True)
class Glm4MoeArgs(MoeArgs):
    """GLM-4.5 MoE: GQA attention (q/k/v biases per `attention_bias`, optional
    per-head q/k RMSNorm, RoPE on the first `rotary_dims` of each head) and
    the MLPs of `MoeArgs`. The defaults are transformers' Glm4MoeConfig's."""

    # fraction of head_dim that RoPE rotates (the rest passes through)
    partial_rotary_factor: float = 0.5
    use_qk_norm: bool = False

    @property
    def rotary_dims(self) -> int:
        return int(self.dim_per_head * self.partial_rotary_factor)


def moe_problem(args: MoeArgs) -> str | None:
    """What the MLPs of `MoeArgs` (models/glm4_moe.py's `MoE` and its router)
    cannot run, said with the values and the key to fix (None: nothing)."""
    experts, groups = args.n_routed_experts, args.n_group
    top_k, kept = args.num_experts_per_tok, args.topk_group
    if args.hidden_act != "silu":
        return (
            f"hidden_act {args.hidden_act!r} is not supported; the MLPs are "
            "SwiGLU (hidden_act 'silu')"
        )
    if experts < 2 or not 1 <= top_k <= experts:
        return (
            f"num_experts_per_tok ({top_k}) must be between 1 and n_routed_experts "
            f"({experts}), and n_routed_experts at least 2"
        )
    if groups < 1 or experts % groups or experts // groups < 2:
        return (
            f"n_routed_experts ({experts}) must split into n_group ({groups}) "
            "groups of at least 2 experts each (the router scores a group by "
            "its top 2)"
        )
    if not 1 <= kept <= groups or kept * (experts // groups) < top_k:
        return (
            f"topk_group ({kept}) must be between 1 and n_group ({groups}), and "
            f"its groups must hold num_experts_per_tok ({top_k}) experts "
            f"({experts // groups} per group)"
        )
    if args.n_shared_experts < 0 or args.first_k_dense_replace < 0:
        return (
            f"n_shared_experts ({args.n_shared_experts}) and first_k_dense_replace "
            f"({args.first_k_dense_replace}) must not be negative"
        )
    return None


def layout_problem(args: Glm4MoeArgs) -> str | None:
    """What this model cannot run, said with the values and the key to fix
    (None: nothing)."""
    problem = moe_problem(args)
    if problem is not None:
        return problem
    rotary = args.rotary_dims
    if not 0 < args.partial_rotary_factor <= 1 or rotary < 2 or rotary % 2:
        return (
            f"partial_rotary_factor {args.partial_rotary_factor} of head_dim "
            f"{args.dim_per_head} gives {rotary} rotary dimensions; it must give "
            "an even number of at least 2, at most head_dim"
        )
    return None


def normalize_glm4_moe_config(raw: dict[str, Any]) -> dict[str, Any]:
    """Fold the upstream key variants into the shape `Glm4MoeArgs` expects."""
    given = {k: v for k, v in raw.items() if v is not None}
    cfg = normalize_hf_config({**_DEFAULTS, **given})
    params = raw.get("rope_parameters")
    params = params if isinstance(params, dict) else {}
    factor = params.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    cfg["partial_rotary_factor"] = float(
        factor if factor is not None else _DEFAULTS["partial_rotary_factor"]
    )
    # transformers' alias (`attribute_map`) for the MTP layer count
    if "num_nextn_predict_layers" not in given and "num_mtp_layers" in given:
        cfg["num_nextn_predict_layers"] = given["num_mtp_layers"]
    return cfg


A = TypeVar("A", bound=MoeArgs)


def checked_args(
    raw: dict[str, Any],
    where: str,
    family: str,
    model_types: tuple[str, ...],
    normalized: Callable[[dict[str, Any]], dict[str, Any]],
    cls: type[A],
    problem: Callable[[A], str | None],
) -> Result[A, ConfigError]:
    """A GLM config dict of one of `model_types` (a `family` model) ->
    `cls` by `normalized`, or a `ConfigError` naming `where`, the problem and
    the key to fix: another model type, a non-MLX quantization, a field that
    does not parse, or what `problem` says the model cannot run."""
    unsupported = upstream_problem(raw, where, family, model_types)
    if unsupported is not None:
        return Failure(unsupported)

    def runnable(args: A) -> Result[A, ConfigError]:
        found = problem(args)
        if found is not None:
            return Failure(ConfigError(f"{where}: {found}"))
        return Success(args)

    return structure(hf, normalized(raw), cls, where).bind(runnable)


def glm4_moe_args(raw: dict[str, Any], where: str) -> Result[Glm4MoeArgs, ConfigError]:
    """An upstream config dict -> `Glm4MoeArgs`, or a `ConfigError` naming
    `where`, the problem and the key to fix."""
    return checked_args(
        raw,
        where,
        "GLM-4.5 MoE",
        GLM4_MOE_MODEL_TYPES,
        normalize_glm4_moe_config,
        Glm4MoeArgs,
        layout_problem,
    )


def upstream_problem(
    raw: dict[str, Any],
    where: str,
    family: str,
    model_types: tuple[str, ...],
    settings: dict[str, Any] | None = None,
) -> ConfigError | None:
    """What keeps an upstream config from being read as a `family` model:
    another model type, or a quantization that is not MLX affine (looked up
    in `settings`, the model's own settings where a wrapper nests them)."""
    model_type = raw.get("model_type")
    if model_type not in model_types:
        return ConfigError(
            f"{where}: model_type {model_type!r} is not a {family} model; "
            f"supported: {', '.join(model_types)}"
        )
    foreign = foreign_quantization(raw if settings is None else settings)
    if foreign is not None:
        return ConfigError(
            f"{where}: quantization_config quant_method {foreign!r} is not "
            "supported; use the bfloat16 checkpoint or an MLX (affine) "
            "conversion of it"
        )
    return None


def foreign_quantization(raw: dict[str, Any]) -> str | None:
    """The `quant_method` of a `quantization_config` that is not MLX affine
    (e.g. the FP8 releases' "fp8": scales named `weight_scale_inv`), else None.
    MLX conversions say `bits` and `group_size` instead."""
    if isinstance(raw.get("quantization"), dict):
        return None
    config = raw.get("quantization_config")
    if not isinstance(config, dict) or ("bits" in config and "group_size" in config):
        return None
    method = config.get("quant_method")
    return str(method) if method is not None else None
