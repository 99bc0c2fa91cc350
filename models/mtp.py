"""The Qwen3-Next multi-token-prediction (MTP) head: a one-layer drafter the
checkpoints carry under `mtp.*`.

    x   = fc([pre_fc_norm_embedding(embed(token)), pre_fc_norm_hidden(hidden)])
    out = layer(x)                      a full-attention decoder layer of the
                                        target's kind, with its own KV cache
    logits = target projection(norm(out))

Which norm applies where (following vLLM's `qwen3_next_mtp.py`, the reference
serving implementation, and SGLang's, which agrees):
- `hidden` for the first draft step is the target's hidden AFTER the target's
  final norm (`Model.final_norm(ModelOutput.hidden)`): vLLM's target forward
  returns post-norm hidden states and feeds those to the MTP module.
- the head's own norm `mtp.norm` replaces the target's final norm: logits are
  the target's vocabulary projection (`Model.project`, shared, no norm) of
  `norm(out)`, and the next chained draft step reads `norm(out)` as its hidden.
- the embedding is the target's (`Model.embed`), shared.
A token at position p+1 is paired with the hidden of position p; the pair sits
at RoPE position p (vLLM passes the target's positions), so `offsets` are the
hidden's positions.

Weights: `split_mtp` in models/qwen3_next.py returns them with `mtp.` removed
and HF conventions converted (zero-centred norms +1, experts stacked).
Reference: https://github.com/vllm-project/vllm/blob/main/vllm/model_executor/models/qwen3_next_mtp.py
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten
from returns.result import Failure, Result, Success

from models.base import attention_mask, rope_offset
from models.cache import KVCache
from models.layers import flat_parameters, model_dtype
from models.qwen3_next import AttentionLayer
from schemas.errors import LoadError
from schemas.hf_hybrid import HybridArgs


class SharedProjection(Protocol):
    """What the head borrows from its target: the vocabulary projection."""

    def project(self, normed: mx.array) -> mx.array: ...


class MtpHead(nn.Module):
    """`num_nextn_predict_layers` MTP layers (released checkpoints: one); draft
    step s uses layer s mod that count, as vLLM does."""

    def __init__(self, args: HybridArgs) -> None:
        super().__init__()
        self.args = args
        hidden, eps = args.hidden_size, args.rms_norm_eps
        self.pre_fc_norm_embedding = nn.RMSNorm(hidden, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(hidden, eps=eps)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        # vLLM numbers the MTP layers from 0 for the dense-vs-MoE choice too.
        self.layers = [
            AttentionLayer(args, i, i) for i in range(args.num_nextn_predict_layers)
        ]
        self.norm = nn.RMSNorm(hidden, eps=eps)

    def __call__(
        self,
        token_embeds: mx.array,  # [B, L, H], target.embed(tokens at p+1)
        hidden: mx.array,  # [B, L, H], post-norm hidden at p (see module doc)
        cache: KVCache,
        offsets: Sequence[int],  # per row, the position of hidden[:, 0]
        step: int = 0,
    ) -> mx.array:  # [B, L, H], before `norm`
        batch, length, _ = token_embeds.shape
        assert hidden.shape == token_embeds.shape, "one hidden per token"
        assert len(offsets) == batch, "one offset per row"
        cache.reserve(max(offsets) + length)
        x = self.fc(
            mx.concatenate(
                [
                    self.pre_fc_norm_embedding(token_embeds),
                    self.pre_fc_norm_hidden(hidden),
                ],
                axis=-1,
            )
        )
        layer = self.layers[step % len(self.layers)]
        return layer(
            x,
            cache,
            offsets,
            attention_mask(offsets, length, cache.key_span(offsets, length)),
            rope_offset(offsets),
        )

    def normed(self, out: mx.array) -> mx.array:  # [..., H] -> [..., H]
        """`mtp.norm(out)`: what the projection and the next step read."""
        return self.norm(out)

    def logits(self, out: mx.array, target: SharedProjection) -> mx.array:
        """[..., H] head output -> [..., V] through the target's projection."""
        return target.project(self.normed(out))

    def make_cache(self, batch: int) -> KVCache:
        return KVCache(
            len(self.layers),
            batch,
            self.args.num_key_value_heads,
            self.args.dim_per_head,
            model_dtype(self),
        )


def build_mtp(
    args: HybridArgs, weights: Mapping[str, mx.array]
) -> Result[MtpHead, LoadError]:
    """An MTP head loaded strictly from `split_mtp`'s second dict: the names
    and shapes must equal the head's parameters."""
    head = MtpHead(args)
    expected = flat_parameters(head)
    missing = sorted(expected.keys() - weights.keys())
    unexpected = sorted(weights.keys() - expected.keys())
    mismatched = sorted(
        k
        for k in expected.keys() & weights.keys()
        if weights[k].shape != expected[k].shape
    )
    if missing or unexpected or mismatched:
        listed = [
            f"{what}: {', '.join(names[:5])}" + (" ..." if len(names) > 5 else "")
            for what, names in (
                ("missing", missing),
                ("unexpected", unexpected),
                ("wrong shape", mismatched),
            )
            if names
        ]
        return Failure(
            LoadError("the MTP weights do not match this config: " + "; ".join(listed))
        )
    head.update(tree_unflatten(list(weights.items())))
    return Success(head)
