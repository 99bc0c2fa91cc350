"""GLM-4.5 / 4.6 / 4.7 MoE (`model_type` `glm4_moe`): an attention-only
decoder whose MLPs are, after the first `first_k_dense_replace` dense layers,
sigmoid-routed mixtures of experts with shared experts.

Notable:
- Attention: GQA with q/k/v biases per `attention_bias` (never on o_proj),
  an optional RMSNorm over each head of q and k (`use_qk_norm`) before RoPE,
  and RoPE on the first `rotary_dims = head_dim * partial_rotary_factor`
  dimensions of each head only, in the rotate-half (non-interleaved) layout
  over those dimensions; the rest pass through.
- Router (`mlp.gate`): scores = sigmoid(x @ weight.T), in float32. The
  choice adds `e_score_correction_bias`, keeps the `topk_group` groups (of
  `n_group`) whose two best corrected scores sum highest, then takes the
  `num_experts_per_tok` best corrected scores among them. The chosen
  experts' weights are the *uncorrected* scores, renormalised when
  `norm_topk_prob`, times `routed_scaling_factor`.
- The shared experts (one SwiGLU of width moe_intermediate_size *
  n_shared_experts) are added unconditionally.
- Ordinary RMSNorms (weights are scales, not offsets from 1).
- KV rolls back by position (models/cache.py): `padding_safe` is True.

Checkpoint names: experts as released checkpoints list them
(`mlp.experts.{e}.{gate,up,down}_proj.weight`), as transformers 5 stores them
(`mlp.experts.gate_up_proj` [E, 2I, H], gate rows first, and
`mlp.experts.down_proj` [E, H, I]), or MLX-stacked
(`mlp.switch_mlp.{gate,up,down}_proj.weight`, as mlx-lm converts them);
`sanitize` maps the first two onto the third. A checkpoint's MTP layers
(`model.layers.{num_hidden_layers + i}.*`: a decoder layer plus `eh_proj`,
`enorm`, `hnorm`, `shared_head.*`) are not part of this model; `split_mtp`
returns them apart.
Reference: transformers `models/glm4_moe/modeling_glm4_moe.py`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import mlx.core as mx
import mlx.nn as nn

from models.base import args_as, refuse
from models.layers import MLP, Attention, AttentionBlock, BlockSpec
from models.llama import Backbone, DecoderLM
from models.qwen3_next import SwitchGLU, stack_experts, take_expert
from schemas.hf import DecoderArgs
from schemas.hf_glm4_moe import Glm4MoeArgs, MoeArgs, layout_problem


class Router(nn.Module):
    """The sigmoid, group-limited top-k router (`mlp.gate`). Its weight is a
    plain array, not a Linear: it stays float when the model is quantized (as
    in mlx-lm's conversions) and computes in float32 (as transformers does).
    GLM-5 (models/glm_moe_dsa.py) routes the same way."""

    def __init__(self, args: MoeArgs) -> None:
        super().__init__()
        experts = args.n_routed_experts
        self.top_k = args.num_experts_per_tok
        self.groups = args.n_group
        self.kept_groups = args.topk_group
        self.norm_topk_prob = args.norm_topk_prob
        self.scaling = args.routed_scaling_factor
        scale = args.hidden_size**-0.5
        self.weight = mx.random.uniform(-scale, scale, (experts, args.hidden_size))
        self.e_score_correction_bias = mx.zeros((experts,))

    def __call__(
        self,
        x: mx.array,  # [N, H]
    ) -> tuple[mx.array, mx.array]:  # experts [N, k] int32, weights [N, k] float32
        logits = x.astype(mx.float32) @ self.weight.astype(mx.float32).T  # [N, E]
        scores = mx.sigmoid(logits)
        choice = scores + self.e_score_correction_bias.astype(mx.float32)
        if self.kept_groups < self.groups:  # else every group is kept
            tokens, experts = choice.shape
            grouped = choice.reshape(tokens, self.groups, experts // self.groups)
            group_scores = mx.topk(grouped, 2, axis=-1).sum(axis=-1)  # [N, G]
            dropped = mx.argpartition(
                group_scores, kth=self.groups - self.kept_groups - 1, axis=-1
            )[:, : self.groups - self.kept_groups]  # the lowest groups [N, G - kept]
            drop = (dropped[:, :, None] == mx.arange(self.groups)[None, None, :]).any(
                axis=1
            )  # [N, G]
            grouped = mx.where(drop[:, :, None], -mx.inf, grouped)
            choice = grouped.reshape(tokens, experts)
        k = self.top_k
        chosen = mx.argpartition(-choice, kth=k - 1, axis=-1)[:, :k]  # [N, k]
        weights = mx.take_along_axis(scores, chosen, axis=-1)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
        return chosen.astype(mx.int32), weights * self.scaling


class MoE(nn.Module):
    """Routed experts (stacked, `switch_mlp`) plus the shared experts (GLM-5's
    MoE block too)."""

    def __init__(self, args: MoeArgs) -> None:
        super().__init__()
        hidden, width = args.hidden_size, args.moe_intermediate_size
        self.gate = Router(args)
        self.switch_mlp = SwitchGLU(hidden, width, args.n_routed_experts)
        self.shared_experts: MLP | None = None
        if args.n_shared_experts:
            self.shared_experts = MLP(hidden, width * args.n_shared_experts, False)

    def __call__(self, x: mx.array) -> mx.array:  # [B, L, H] -> [B, L, H]
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])  # [N, H]
        experts, weights = self.gate(tokens)
        routed = self.switch_mlp(tokens, experts)  # [N, k, H]
        out = (routed * weights.astype(x.dtype)[..., None]).sum(axis=1)
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens)
        return out.reshape(shape)


def make_mlp(args: MoeArgs, layer: int) -> MoE | MLP:
    """Decoder layer `layer`'s MLP: MoE where `args.is_sparse(layer)` (for
    GLM-4.5: from `first_k_dense_replace` on; an MTP layer, at index
    num_hidden_layers or beyond, is MoE), else dense."""
    if args.is_sparse(layer):
        return MoE(args)
    return MLP(args.hidden_size, args.intermediate_size, False)


class DecoderLayer(AttentionBlock):
    """One GLM-4.5 decoder layer (also the MTP head's layer): attention into
    KV slot `kv_index` (default: `layer`), then the layer's MLP (dense or MoE
    per `layer`, see `make_mlp`)."""

    def __init__(
        self, args: Glm4MoeArgs, layer: int, kv_index: int | None = None
    ) -> None:
        super().__init__(args.hidden_size, args.rms_norm_eps)
        slot = layer if kv_index is None else kv_index
        # GQA with optional q/k biases and per-head q/k norm, RoPE on the
        # first `rotary_dims` of each head (models/layers.py)
        spec = BlockSpec(
            qkv_bias=args.attention_bias,
            qk_norm=args.use_qk_norm,
            rotary_fraction=args.partial_rotary_factor,
        )
        self.self_attn = Attention(args, slot, spec)
        self.mlp = make_mlp(args, layer)


class Glm4MoeModel(Backbone):
    """GLM-4.5's backbone: its decoder layers (dense first, MoE after)."""

    def __init__(self, args: Glm4MoeArgs) -> None:
        super().__init__(
            args, [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        )


class MoeLM(DecoderLM):
    """A GLM causal LM over `MoeArgs` (GLM-4.5 here, GLM-5 in
    models/glm_moe_dsa.py): its checkpoint's MTP layers are kept apart from
    its own weights."""

    # The protocol's type; always MoeArgs here (see `moe`).
    args: DecoderArgs

    @property
    def moe(self) -> MoeArgs:
        return args_as(self.args, MoeArgs, "a GLM MoE model")

    def sanitize(self, weights: Mapping[str, mx.array]) -> dict[str, mx.array]:
        """HF / MLX checkpoint names -> this model's parameter names (no MTP
        layers: see `split_mtp`)."""
        return self.split_mtp(weights)[0]

    def split_mtp(
        self, weights: Mapping[str, mx.array]
    ) -> tuple[dict[str, mx.array], dict[str, mx.array]]:
        """The target's sanitized weights, and the checkpoint's MTP layers'
        (`split_mtp`: layer num_hidden_layers's names without their prefix,
        experts stacked)."""
        return split_mtp(weights, self.moe)


class Model(MoeLM):
    """The causal LM: implements `models.base.CausalLM`."""

    def __init__(self, args: Glm4MoeArgs) -> None:
        refuse(layout_problem(args))
        super().__init__(args, Glm4MoeModel(args))

    @property
    def glm(self) -> Glm4MoeArgs:
        return args_as(self.args, Glm4MoeArgs, "glm4_moe")


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def split_mtp(
    weights: Mapping[str, mx.array], args: MoeArgs
) -> tuple[dict[str, mx.array], dict[str, mx.array]]:
    """Sanitized weights (`sanitize_weights`) of the target model, and of the
    checkpoint's MTP layers: those of `model.layers.{N}` (N =
    num_hidden_layers) with that prefix removed (`eh_proj.weight`,
    `enorm.weight`, `hnorm.weight`, `shared_head.norm.weight`,
    `shared_head.head.weight`, and a `DecoderLayer(args, N)`'s own names:
    `self_attn.*`, `mlp.gate.*`, `mlp.switch_mlp.*`, `mlp.shared_experts.*`,
    `input_layernorm.weight`, `post_attention_layernorm.weight`; whatever
    else layer N holds, e.g. `embed_tokens.weight`, likewise). Layers past N
    (a checkpoint with several MTP layers; no released GLM has one) keep
    their full names in the second dict. Empty when the checkpoint has none
    (an MLX conversion)."""
    named = sanitize_weights(weights, args.n_routed_experts)
    last = args.num_hidden_layers
    main: dict[str, mx.array] = {}
    mtp: dict[str, mx.array] = {}
    prefix = f"model.layers.{last}."
    for key, value in named.items():
        match = _LAYER.match(key)
        if match is None or int(match.group(1)) < last:
            main[key] = value
        elif key.startswith(prefix):
            mtp[key[len(prefix) :]] = value
        else:
            mtp[key] = value
    if args.tie_word_embeddings:
        # HF state dicts of tied models still list the shared tensor.
        main.pop("lm_head.weight", None)
    return main, mtp


def sanitize_weights(
    weights: Mapping[str, mx.array], experts: int
) -> dict[str, mx.array]:
    """HF -> MLX names for every `glm4_moe` weight (MTP layers included):
    rotary buffers dropped, experts stacked per projection under
    `mlp.switch_mlp`. MLX-stacked weights pass unchanged."""
    out = {k: v for k, v in weights.items() if not k.endswith("rotary_emb.inv_freq")}
    listed: dict[tuple[str, str], dict[int, mx.array]] = {}
    for key in list(out):
        take_expert(out, key, listed)
    stack_experts(out, listed, experts)
    return out
