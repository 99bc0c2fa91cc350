"""GLM-4.5's native multi-token-prediction (MTP) head: the
`num_nextn_predict_layers` layers (released checkpoints: one) a glm4_moe
checkpoint stores as `model.layers.{num_hidden_layers + i}.*`.

    e   = enorm(embed(token)), zero at position 0
    x   = eh_proj([e, hnorm(hidden)])
    out = layer(x)                  a GLM decoder layer (MoE) with its own
                                    KV cache (models/glm4_moe.DecoderLayer)
    logits = projection(shared_head.norm(out))

As vLLM's `glm4_moe_mtp.py` runs it (the reference serving implementation):
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

The head is an `MtpHead` (models/mtp.py) whose layer is GLM's, so the MTP
drafter (specpipe/drafts/mtp.py) drives it unchanged; its weights are renamed
onto `MtpHead`'s (`eh_proj` -> `fc`, `enorm` / `hnorm` ->
`pre_fc_norm_embedding` / `pre_fc_norm_hidden`, `shared_head.norm` ->
`norm`, the decoder layer's -> `layers.0.*`). The one-kernel CUDA step of
models/mtp_cuda.py computes Qwen's layer only and is not used for it.
Reference: https://github.com/vllm-project/vllm/blob/main/vllm/model_executor/models/glm4_moe_mtp.py
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import mlx.core as mx
import mlx.nn as nn
from returns.result import Failure, Result

from models.cache import KVCache
from models.glm4_moe import DecoderLayer
from models.mtp import DeclaredQuantization, MtpHead, load_head
from models.parallel import Linear
from schemas.errors import LoadError
from schemas.hf_glm4_moe import Glm4MoeArgs

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
        nn.Module.__init__(self)
        self.args = args
        hidden, eps = args.hidden_size, args.rms_norm_eps
        self.pre_fc_norm_embedding = nn.RMSNorm(hidden, eps=eps)  # enorm
        self.pre_fc_norm_hidden = nn.RMSNorm(hidden, eps=eps)  # hnorm
        self.fc = Linear(2 * hidden, hidden, bias=False)  # eh_proj
        # layer i is checkpoint layer num_hidden_layers + i (a MoE layer),
        # its keys and values in slot i of the head's cache
        first = args.num_hidden_layers
        self.layers = [
            DecoderLayer(args, first + i, i)
            for i in range(args.num_nextn_predict_layers)
        ]
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
    args: Glm4MoeArgs,
    weights: Mapping[str, mx.array],
    declared: DeclaredQuantization | None = None,
) -> Result[MtpHead, LoadError]:
    """A GLM MTP head loaded strictly from its layer's weights (`head_weights`)."""
    if args.num_nextn_predict_layers != 1:
        return Failure(
            LoadError(
                f"the config declares {args.num_nextn_predict_layers} MTP layers; "
                "GLM heads of one layer are supported (every release has one)"
            )
        )
    return load_head(GlmMtpHead(args), head_weights(weights), declared)
