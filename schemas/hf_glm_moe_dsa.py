"""Records for upstream `config.json` files of GLM-5 (`model_type`
`glm_moe_dsa`, transformers' `GlmMoeDsaForCausalLM`).

`GlmMoeDsaArgs` extends `MoeArgs` (schemas/hf_glm4_moe.py: the MoE settings
GLM-4.5 has too), and through it `DecoderArgs`, so every field the pipeline
reads on `args` means the same as for the dense decoders and the model
satisfies `models.base.CausalLM` unchanged. Its own fields are those of
multi-head latent attention (`q_lora_rank`, `kv_lora_rank`,
`qk_nope_head_dim`, `qk_rope_head_dim`, `v_head_dim`) and of the DSA
indexer (`index_topk`, `index_head_dim`, `index_n_heads`, and per layer
`indexer_types`). `num_key_value_heads` and `head_dim` are read but unused
(the attention's one latent "head" is the cache's, models/glm_moe_dsa.py).

The per-layer lists are derived as transformers derives them when a
config.json omits them: `indexer_types` from `index_topk_pattern` (a string
of F / S, or a list) or else the schedule `index_topk_freq` (default 1) /
`index_skip_topk_offset` (default 2): layer i is "full" when
max(i - offset + 1, 0) is a multiple of freq, else "shared" (the defaults
make every layer full); `mlp_layer_types` as `first_k_dense_replace` dense
layers, then sparse. Keys a config.json omits take transformers'
`GlmMoeDsaConfig` defaults (GLM-5's sizes; `rms_norm_eps` 1e-5).

What the model cannot run (`layout_problem`) is refused with the values, by
`glm_moe_dsa_args` (a `ConfigError`) and again by the model's constructor:
the MoE layouts `moe_problem` refuses; no query low-rank projection
(`q_lora_rank` null: the indexer reads its output); a RoPE width that is not
even or exceeds `index_head_dim`; an `index_head_dim` wider than the cache's
head (`kv_lora_rank + qk_rope_head_dim`, where the indexer's keys are
stored); per-layer lists of the wrong length or with unknown kinds; a first
layer that shares a selection no layer made; a RoPE type other than
"default" (transformers scales the softmax by yarn's mscale for the others;
not implemented).
Reference: transformers `models/glm_moe_dsa/configuration_glm_moe_dsa.py`.
"""

from __future__ import annotations

from typing import Any

from attrs import frozen
from returns.result import Result

from schemas.errors import ConfigError
from schemas.hf import normalize_hf_config
from schemas.hf_glm4_moe import MoeArgs, checked_args, moe_problem

GLM_MOE_DSA_MODEL_TYPES = ("glm_moe_dsa",)

FULL_INDEXER = "full"  # the layer runs its indexer
SHARED_INDEXER = "shared"  # the layer reuses the previous full layer's selection
INDEXER_KINDS = (FULL_INDEXER, SHARED_INDEXER)
MLP_KINDS = ("dense", "sparse")

# transformers' GlmMoeDsaConfig defaults for keys a config.json may omit
_DEFAULTS: dict[str, Any] = {
    "vocab_size": 154880,
    "hidden_size": 6144,
    "intermediate_size": 12288,
    "num_hidden_layers": 78,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "max_position_embeddings": 202752,
    "rms_norm_eps": 1e-5,
}


@frozen(kw_only=True)
class GlmMoeDsaArgs(MoeArgs):
    """GLM-5: multi-head latent attention with a DSA indexer choosing, per
    query, the `index_topk` positions it attends; the MLPs of `MoeArgs`
    (dense where `mlp_layer_types` says so, else the MoE block). The
    defaults are transformers' GlmMoeDsaConfig's."""

    # GlmMoeDsaConfig's values where they differ from MoeArgs' (GLM-4.5's)
    moe_intermediate_size: int = 2048
    n_routed_experts: int = 256
    routed_scaling_factor: float = 2.5
    first_k_dense_replace: int = 3
    # multi-head latent attention
    q_lora_rank: int = 2048
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 192
    qk_rope_head_dim: int = 64
    v_head_dim: int = 256
    # DSA indexer
    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 32
    # per layer "full" / "shared" (empty: every layer full)
    indexer_types: tuple[str, ...] = ()
    # per layer "dense" / "sparse" (empty: by first_k_dense_replace)
    mlp_layer_types: tuple[str, ...] = ()

    @property
    def qk_head_dim(self) -> int:
        """Per-head width of queries and keys: the unrotated and rotated parts."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """The cache's head width: the normed KV latent and the rotated key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def runs_indexer(self, layer: int) -> bool:
        """Whether layer `layer` selects its own positions ("full"), else
        reuses the previous full layer's selection ("shared")."""
        if layer >= len(self.indexer_types):
            return True
        return self.indexer_types[layer] == FULL_INDEXER

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer `layer` has a MoE block (else a dense MLP):
        per `mlp_layer_types`, by `first_k_dense_replace` past its end (an MTP
        layer's index, num_hidden_layers + i)."""
        if layer < len(self.mlp_layer_types):
            return self.mlp_layer_types[layer] == "sparse"
        return layer >= self.first_k_dense_replace


def layout_problem(args: GlmMoeDsaArgs) -> str | None:
    """What this model cannot run, said with the values and the key to fix
    (None: nothing)."""
    problem = moe_problem(args)
    if problem is not None:
        return problem
    if args.q_lora_rank < 1:
        return (
            f"q_lora_rank ({args.q_lora_rank}) must be a positive rank: the DSA "
            "indexer reads the queries' low-rank residual (a config without one, "
            "q_lora_rank null, is not supported)"
        )
    small = [
        f"{key} ({value})"
        for key, value, least in (
            ("kv_lora_rank", args.kv_lora_rank, 1),
            ("qk_nope_head_dim", args.qk_nope_head_dim, 0),
            ("v_head_dim", args.v_head_dim, 1),
            ("index_topk", args.index_topk, 1),
            ("index_head_dim", args.index_head_dim, 1),
            ("index_n_heads", args.index_n_heads, 1),
        )
        if value < least
    ]
    if small:
        return (
            f"{', '.join(small)}: too small (qk_nope_head_dim must be at least 0, "
            "the other sizes at least 1)"
        )
    rope = args.qk_rope_head_dim
    if rope < 2 or rope % 2 or rope > args.index_head_dim:
        return (
            f"qk_rope_head_dim ({rope}) must be an even number of at least 2 and "
            f"at most index_head_dim ({args.index_head_dim}): RoPE rotates that "
            "many dimensions of each query and key and of the indexer's"
        )
    if args.index_head_dim > args.latent_dim:
        return (
            f"index_head_dim ({args.index_head_dim}) must not exceed kv_lora_rank "
            f"+ qk_rope_head_dim ({args.latent_dim}): the indexer's keys are "
            "cached in the value buffer of the latent cache, one head that wide"
        )
    layers = args.num_hidden_layers
    for key, kinds, given in (
        ("indexer_types", INDEXER_KINDS, args.indexer_types),
        ("mlp_layer_types", MLP_KINDS, args.mlp_layer_types),
    ):
        unknown = sorted({kind for kind in given if kind not in kinds})
        if (given and len(given) != layers) or unknown:
            return (
                f"{key} must list one of {', '.join(map(repr, kinds))} per layer "
                f"({layers} layers); got {len(given)} entries"
                + (f", unknown {unknown}" if unknown else "")
            )
    if args.indexer_types and args.indexer_types[0] != FULL_INDEXER:
        return (
            f"indexer_types[0] is {args.indexer_types[0]!r}: the first layer must "
            "be 'full' (a shared layer reuses the selection of a full layer "
            "before it)"
        )
    if args.rope.rope_type != "default":
        return (
            f"rope_parameters rope_type {args.rope.rope_type!r} is not supported; "
            "only 'default' RoPE is implemented for glm_moe_dsa (transformers "
            "scales other types' softmax by yarn's mscale)"
        )
    return None


def _indexer_types(raw: dict[str, Any], layers: int) -> list[str]:
    """The per-layer indexer kinds as transformers derives them."""
    given = raw.get("indexer_types")
    if given is not None:
        return [str(kind) for kind in given]
    pattern = raw.get("index_topk_pattern")
    if isinstance(pattern, str):
        letters = {"F": FULL_INDEXER, "S": SHARED_INDEXER}
        return [letters.get(c, c) for c in pattern]
    if pattern is not None:
        return [str(kind) for kind in pattern]
    freq = max(int(raw.get("index_topk_freq", 1)), 1)
    offset = int(raw.get("index_skip_topk_offset", 2))
    return [
        FULL_INDEXER if max(i - offset + 1, 0) % freq == 0 else SHARED_INDEXER
        for i in range(layers)
    ]


def normalize_glm_moe_dsa_config(raw: dict[str, Any]) -> dict[str, Any]:
    """Fold the upstream key variants into the shape `GlmMoeDsaArgs` expects."""
    given = {k: v for k, v in raw.items() if v is not None}
    if "q_lora_rank" in raw and raw["q_lora_rank"] is None:
        given["q_lora_rank"] = 0  # no query projection: refused, not defaulted
    if "num_experts" in given:  # transformers' alias, which takes precedence
        given["n_routed_experts"] = given["num_experts"]
    cfg = normalize_hf_config({**_DEFAULTS, **given})
    layers = int(cfg["num_hidden_layers"])
    cfg["indexer_types"] = _indexer_types(given, layers)
    if "mlp_layer_types" not in given:
        dense = min(int(cfg.get("first_k_dense_replace", 3)), layers)
        cfg["mlp_layer_types"] = ["dense"] * dense + ["sparse"] * (layers - dense)
    return cfg


def glm_moe_dsa_args(
    raw: dict[str, Any], where: str
) -> Result[GlmMoeDsaArgs, ConfigError]:
    """An upstream config dict -> `GlmMoeDsaArgs`, or a `ConfigError` naming
    `where`, the problem and the key to fix."""
    return checked_args(
        raw,
        where,
        "GLM-5",
        GLM_MOE_DSA_MODEL_TYPES,
        normalize_glm_moe_dsa_config,
        GlmMoeDsaArgs,
        layout_problem,
    )
