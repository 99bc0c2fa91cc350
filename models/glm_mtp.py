"""GLM's native multi-token-prediction (MTP) heads: the
`num_nextn_predict_layers` layers (released checkpoints: one) a glm4_moe
(GLM-4.5) or glm_moe_dsa (GLM-5) checkpoint stores as
`model.layers.{num_hidden_layers + i}.*`.

    e   = enorm(embed(token)), zero at position 0
    x   = eh_proj([e, hnorm(hidden)])
    out = layer(x)                  a decoder layer of the target's kind (MoE)
                                    with its own KV cache
    logits = projection(shared_head.norm(out))

The layer is GLM-4.5's (models/glm4_moe.DecoderLayer: `GlmMtpHead`) or
GLM-5's (models/glm_moe_dsa.DecoderLayer: `GlmDsaMtpHead`); both heads wire
it alike, as vLLM's `glm4_moe_mtp.py` and `deepseek_mtp.py` (which GLM-5's
MTP layer, DeepSeek-V3's, runs under) do:
- the first draft step's `hidden` is the target's hidden after its final
  norm, as for Qwen's heads (`models/mtp.py`); a token at position p+1 pairs
  with the hidden of position p, at RoPE position p;
- the embedding of the pair at position 0 is zeroed;
- a chained step reads the layer's output `out` itself (not normed: vLLM
  feeds the MTP forward's return, `residual + hidden_states`, back), while
  the draw projects `shared_head.norm(out)`;
- the projection is the target's vocabulary head, as the name
  `shared_head` and DeepSeek-V3's MTP (which GLM's follows) share it. vLLM
  and SGLang load the checkpoint's `shared_head.head` into a head of the
  module's own; specpipe keeps the target's (and its FR-Spec rows), so a
  release whose copy differs from `lm_head` would draft a little
  differently here; never the output. Nor is an `embed_tokens` the layer
  may repeat kept (the target's is shared).
- SGLang carries the normed output to the next step; vLLM's form is taken.

GLM-5's layer is a full glm_moe_dsa decoder layer: multi-head latent
attention over the head's own latent cache (one "head" of kv_lora_rank +
qk_rope_head_dim per position, the indexer's key in the value buffer, as the
target's cache: `GlmDsaMtpHead.make_cache`), written by position so rejected
drafts roll back as the target's do, and the MoE block. Its DSA indexer is
its own: the layer's `self_attn.indexer.*` weights (GLM-5.2's checkpoint
index lists them for its MTP layer, 78; a layer without them is refused by
the strict load; `indexer_types` lists the target's layers only, so the MTP
layer is always "full"), scoring its own cached indexer keys, i.e. the keys
of the head's pairs at positions <= the query's, and attending to the best
`index_topk` of them (all, while there are no more). That is vLLM's handling
of DeepSeek-V3.2's and GLM-5's MTP layer: the MTP decoder layer gets an
`Indexer` of its own (weights under its prefix, an indexer key cache and
top-k buffer of its own), never the target's selection. Not taken:
`index_share_for_mtp_iteration` (GLM-5.2+ configs), with which serving
engines reuse a selection across MTP iterations instead of recomputing it;
each step here selects afresh, which can only change what is drafted, never
the output.

The heads are `MtpHead`s (models/mtp.py) whose layer is GLM's, so the MTP
drafter (specpipe/drafts/mtp.py) drives them unchanged (`forward_at`, the
compiled step's form, through the layers' `forward` with a scatter write);
their weights are renamed onto `MtpHead`'s (`eh_proj` -> `fc`, `enorm` /
`hnorm` -> `pre_fc_norm_embedding` / `pre_fc_norm_hidden`,
`shared_head.norm` -> `norm`, the decoder layer's -> `layers.0.*`). The
one-kernel CUDA step of models/mtp_cuda.py computes Qwen's layer only and is
not used for them.
References: https://github.com/vllm-project/vllm/blob/main/vllm/model_executor/models/glm4_moe_mtp.py,
https://github.com/vllm-project/vllm/blob/main/vllm/model_executor/models/deepseek_mtp.py
(its `is_v32` branch) and `Indexer` in deepseek_v2.py beside it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import mlx.core as mx
import mlx.nn as nn
from returns.result import Failure, Result

from models import glm_moe_dsa
from models.base import args_as
from models.cache import KVCache
from models.glm4_moe import DecoderLayer
from models.layers import model_dtype
from models.mtp import DeclaredQuantization, HeadLayer, MtpHead, load_head
from models.parallel import Linear
from schemas.errors import LoadError
from schemas.hf_glm4_moe import Glm4MoeArgs, MoeArgs
from schemas.hf_glm_moe_dsa import GlmMoeDsaArgs

# checkpoint name -> MtpHead parameter name (the decoder layer's go under
# `layers.0.`)
_RENAMED = {
    "eh_proj.": "fc.",
    "enorm.": "pre_fc_norm_embedding.",
    "hnorm.": "pre_fc_norm_hidden.",
    "shared_head.norm.": "norm.",
}
# what the layer repeats of its target (shared, not kept)
_SHARED = ("shared_head.head.", "embed_tokens.")
_OWN = ("fc.", "pre_fc_norm_embedding.", "pre_fc_norm_hidden.", "norm.", "layers.")


class GlmMtpHead(MtpHead):
    """GLM-4.5's MTP layers as an `MtpHead` (module doc)."""

    fused_kernel = False

    def __init__(self, args: Glm4MoeArgs) -> None:
        # layer i is checkpoint layer num_hidden_layers + i (a MoE layer),
        # its keys and values in slot i of the head's cache
        first = args.num_hidden_layers
        self._assemble(
            args,
            [
                DecoderLayer(args, first + i, i)
                for i in range(args.num_nextn_predict_layers)
            ],
        )

    def _assemble(self, args: MoeArgs, layers: list[HeadLayer]) -> None:
        """The head's modules around its decoder `layers`."""
        nn.Module.__init__(self)
        self.args = args
        hidden, eps = args.hidden_size, args.rms_norm_eps
        self.pre_fc_norm_embedding = nn.RMSNorm(hidden, eps=eps)  # enorm
        self.pre_fc_norm_hidden = nn.RMSNorm(hidden, eps=eps)  # hnorm
        self.fc = Linear(2 * hidden, hidden, bias=False)  # eh_proj
        self.layers = layers
        self.norm = nn.RMSNorm(hidden, eps=eps)  # shared_head.norm

    def carried(self, out: mx.array, normed: mx.array) -> mx.array:
        return out

    def __call__(
        self,
        token_embeds: mx.array,
        hidden: mx.array,
        cache: KVCache,
        offsets: Sequence[int],
        step: int = 0,
    ) -> mx.array:
        starts = mx.array(list(offsets), dtype=mx.int32)
        return super().__call__(
            _blank_first(token_embeds, starts), hidden, cache, offsets, step
        )

    def forward_at(
        self,
        token_embeds: mx.array,
        hidden: mx.array,
        keys: mx.array,
        values: mx.array,
        starts: mx.array,
        step: int = 0,
    ) -> tuple[mx.array, mx.array, mx.array]:
        return super().forward_at(
            _blank_first(token_embeds, starts), hidden, keys, values, starts, step
        )


class GlmDsaMtpHead(GlmMtpHead):
    """GLM-5's MTP layer as an `MtpHead`: a glm_moe_dsa decoder layer (latent
    attention with its own DSA indexer, MoE) over a latent cache of its own
    (module doc)."""

    def __init__(self, args: GlmMoeDsaArgs) -> None:
        # layer i is checkpoint layer num_hidden_layers + i: past the
        # target's `indexer_types` and `mlp_layer_types`, so "full" (its own
        # indexer) and MoE; its latents in slot i of the head's cache
        first = args.num_hidden_layers
        self._assemble(
            args,
            [
                glm_moe_dsa.DecoderLayer(args, first + i, i)
                for i in range(args.num_nextn_predict_layers)
            ],
        )

    @property
    def dsa(self) -> GlmMoeDsaArgs:
        return args_as(self.args, GlmMoeDsaArgs, "GLM-5's head")

    def make_cache(self, batch: int) -> KVCache:
        """The target's layout (`glm_moe_dsa.Model.make_cache`): one latent
        "head" per layer, keys [normed latent | rotated key], values the
        indexer's keys (zero-padded)."""
        return KVCache(
            len(self.layers), batch, 1, self.dsa.latent_dim, model_dtype(self)
        )


def _blank_first(token_embeds: mx.array, starts: mx.array) -> mx.array:
    """`token_embeds` [B, L, H] with the pair at position 0 zeroed (row b's
    pairs sit at starts[b] ..)."""
    length = token_embeds.shape[1]
    positions = starts[:, None] + mx.arange(length, dtype=mx.int32)  # [B, L]
    return mx.where((positions == 0)[..., None], 0.0, token_embeds).astype(
        token_embeds.dtype
    )


def head_weights(weights: Mapping[str, mx.array]) -> dict[str, mx.array]:
    """The MTP layer's weights (`models.glm4_moe.split_mtp`'s second dict,
    or a companion's, already named as the head's) under `GlmMtpHead`'s
    names; the target's repeated embedding and head dropped."""
    out: dict[str, mx.array] = {}
    for key, value in weights.items():
        if key.startswith(_SHARED):
            continue
        prefix = next((p for p in _RENAMED if key.startswith(p)), None)
        if prefix is not None:
            key = _RENAMED[prefix] + key[len(prefix) :]
        elif not key.startswith(_OWN):
            key = f"layers.0.{key}"
        out[key] = value
    return out


def build_glm_mtp(
    args: MoeArgs,
    weights: Mapping[str, mx.array],
    declared: DeclaredQuantization | None = None,
) -> Result[MtpHead, LoadError]:
    """A GLM MTP head of a GLM-4.5 or GLM-5 target's `args`, loaded strictly
    from its layer's weights (`head_weights`)."""
    if args.num_nextn_predict_layers != 1:
        return Failure(
            LoadError(
                f"the config declares {args.num_nextn_predict_layers} MTP layers; "
                "GLM heads of one layer are supported (every release has one)"
            )
        )
    head: GlmMtpHead
    if isinstance(args, GlmMoeDsaArgs):
        head = GlmDsaMtpHead(args)
    elif isinstance(args, Glm4MoeArgs):
        head = GlmMtpHead(args)
    else:
        return Failure(
            LoadError(
                f"a {args.model_type} model has no GLM MTP layer (glm4_moe and "
                "glm_moe_dsa models do)"
            )
        )
    return load_head(head, head_weights(weights), declared)
