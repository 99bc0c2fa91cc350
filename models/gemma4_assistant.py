"""Gemma-4's assistant drafter (`gemma4_assistant`, transformers'
`Gemma4AssistantForCausalLM`; Gemma-4 Unified's `gemma4_unified_assistant`,
`Gemma4UnifiedAssistantForCausalLM`, is the same model over a unified text
stack): a few Gemma-4 decoder layers that keep no
keys or values of their own. Every layer is "KV-shared": its queries attend
over the keys and values the *target* stored in its last non-shared layer
of the same type (models/gemma4.py, `Model.shared_kv`).

Input per step: [the target's scaled embedding of the last token | a hidden
state of the target's width] (`2 * backbone_hidden_size`), projected to the
assistant's width (`pre_projection`); the layers run at one fixed position;
the final norm's output gives the logits and, through `post_projection`,
the next step's hidden state (back at the target's width).

The logits come from the assistant's own head (tied to its embedding
table), or with `use_ordered_embeddings` from a centroid-restricted head:
the hidden state scores `num_centroids` clusters of an ordering of the
vocabulary, the top `centroid_intermediate_top_k` clusters' tokens get
their head logits, and every other token the smallest of those minus one.
transformers takes that minimum over the whole batch; here it is taken per
row and position, so a row's drafts do not depend on the other rows'.

Reference: transformers `models/gemma4_assistant/modeling_gemma4_assistant.py`
and `generation/candidate_generator.py` (the drafting loop).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial

import mlx.core as mx
import mlx.nn as nn

from models.gemma4 import Attention, Gemma4TextModel
from models.parallel import Linear, dequantized, other_groups
from models.vocab_head import HeadWeights
from schemas.hf_gemma4_assistant import AssistantArgs

KV = tuple[mx.array, mx.array]


class CentroidHead(nn.Module):
    """The head restricted to the top-k clusters of the vocabulary's ordering
    (transformers' `Gemma4AssistantMaskedEmbedder`)."""

    def __init__(self, hidden: int, vocab: int, centroids: int, top_k: int) -> None:
        super().__init__()
        self.centroids = Linear(hidden, centroids, bias=False)
        # the vocabulary ordered by cluster: row c of the [centroids, vocab /
        # centroids] view lists cluster c's token ids
        self.token_ordering = mx.zeros((vocab,), dtype=mx.int32)
        self.top_k = top_k
        self.per_cluster = vocab // centroids

    def __call__(
        self, hidden: mx.array, head: HeadWeights
    ) -> mx.array:  # [B, L, H] -> [B, L, V]
        batch, length, width = hidden.shape
        scores = self.centroids(hidden)  # [B, L, C]
        top = mx.argpartition(-scores, self.top_k - 1, axis=-1)[..., : self.top_k]
        table = self.token_ordering.reshape(-1, self.per_cluster)
        ids = table[top].reshape(batch, length, -1)  # [B, L, K] token ids
        rows = _head_rows(head, ids.reshape(-1)).reshape(batch, length, -1, width)
        picked = (hidden[:, :, None, :] @ rows.swapaxes(-1, -2))[:, :, 0]  # [B, L, K]
        fill = mx.min(picked, axis=-1, keepdims=True) - 1.0
        vocab = int(self.token_ordering.shape[0])
        out = mx.broadcast_to(fill, (batch, length, vocab))
        return mx.put_along_axis(out, ids, picked, axis=-1)


def _head_rows(head: HeadWeights, ids: mx.array) -> mx.array:  # [N] -> [N, H]
    """Rows `ids` of the head as floats (dequantized where quantized)."""
    taken = head.take(ids)
    if taken.bits == 0:
        return taken.weight
    assert taken.scales is not None
    if other_groups(taken.group_size):  # a GGUF's K groups of 16
        assert taken.biases is not None
        return dequantized(
            taken.weight, taken.scales, taken.biases, taken.group_size, taken.bits
        )
    return mx.dequantize(
        taken.weight,
        taken.scales,
        taken.biases,
        group_size=taken.group_size,
        bits=taken.bits,
    )


def _borrowed(
    attention: Attention,
    keys: mx.array,  # [B, Hkv, C, D] the target's
    values: mx.array,
    mask: mx.array,  # [B, 1, L or 1, C] bool
    rope_at: int | mx.array,
    normed: mx.array,  # [B, L, H] the layer's input-normed hidden
) -> mx.array:  # [B, L, H]
    """A kv-shared layer's attention over the target's keys and values."""
    return attention.attend(attention.queries(normed, rope_at), keys, values, mask)


class Assistant(nn.Module):
    """A Gemma-4 assistant draft (implements
    `specpipe.drafts.assistant.BorrowingDraft`)."""

    def __init__(self, args: AssistantArgs) -> None:
        super().__init__()
        self.args = args
        text = args.text
        # its decoder: layers and final norm; the embedding table is only its
        # tied head (no per-layer embeddings: schemas/hf_gemma4_assistant.py)
        self.model = Gemma4TextModel(args.text)
        self.pre_projection = Linear(
            2 * args.backbone_hidden_size, text.hidden_size, bias=False
        )
        self.post_projection = Linear(
            text.hidden_size, args.backbone_hidden_size, bias=False
        )
        if not args.tie_word_embeddings:
            self["lm_head"] = Linear(text.hidden_size, text.vocab_size, bias=False)
        self.masked_embedding: CentroidHead | None = None
        if args.use_ordered_embeddings:
            self.masked_embedding = CentroidHead(
                text.hidden_size,
                text.vocab_size,
                args.num_centroids,
                args.centroid_intermediate_top_k,
            )

    @property
    def layer_types(self) -> tuple[str, ...]:
        return tuple(self.args.text.layer_types)

    @property
    def sliding_window(self) -> int:
        return self.args.text.sliding_window

    def head_weights(self) -> HeadWeights:
        if self.args.tie_word_embeddings:
            return HeadWeights.of(self.model.embed_tokens)
        return HeadWeights.of(self["lm_head"])

    def __call__(
        self,
        x: mx.array,  # [B, L, 2 * backbone hidden]
        kv: Mapping[str, KV],  # per layer type: the target's [B, Hkv, C, D]
        masks: Mapping[str, mx.array],  # per layer type [B, 1, L or 1, C] bool
        rope_at: int | mx.array,
    ) -> tuple[mx.array, mx.array]:  # logits [B, L, V], next hidden [B, L, Hb]
        h = self.pre_projection(x)
        for layer in self.model.layers:
            attention: Attention = layer.self_attn
            kind = attention.layer_type
            keys, values = kv[kind]
            attend = partial(_borrowed, attention, keys, values, masks[kind], rope_at)
            h = layer.run(h, attend, None)
        normed = self.model.norm(h)
        head = self.head_weights()
        if self.masked_embedding is not None:
            logits = self.masked_embedding(normed, head)
        else:
            logits = head.project(normed)
        return logits, self.post_projection(normed)

    def sanitize(self, weights: Mapping[str, mx.array]) -> dict[str, mx.array]:
        """HF checkpoint names -> this model's parameter names: the tied head's
        copy dropped, the vocabulary ordering as int32."""
        kept = dict(weights)
        if self.args.tie_word_embeddings:
            kept.pop("lm_head.weight", None)
        ordering = "masked_embedding.token_ordering"
        if ordering in kept:
            kept[ordering] = kept[ordering].astype(mx.int32)
        return kept
