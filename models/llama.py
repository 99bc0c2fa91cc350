"""Llama (SmolLM2, Llama 3.x): the base of the llama-family decoders.

Pre-norm blocks of grouped-query attention and a SwiGLU MLP. Optional biases
follow `attention_bias` (q/k/v/o) and `mlp_bias`. qwen2 and qwen3 reuse this
block, backbone and model with a different `BlockSpec`.
Reference: transformers `models/llama/modeling_llama.py`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import mlx.core as mx
import mlx.nn as nn

from models.base import ModelOutput, StackLayer, Tapping, run_stack
from models.cache import KVCache
from models.layers import (
    MLP,
    Attention,
    AttentionBlock,
    BlockSpec,
    HeadedLM,
    decoder_cache,
)
from models.parallel import Embedding
from schemas.hf import DecoderArgs


class TransformerBlock(AttentionBlock):
    def __init__(self, args: DecoderArgs, layer: int, spec: BlockSpec) -> None:
        super().__init__(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args, layer, spec)
        self.mlp = MLP(args.hidden_size, args.intermediate_size, spec.mlp_bias)


class Backbone(nn.Module):
    """Embedding, decoder layers and the final norm (applied by
    `DecoderLM.lm_head`): the llama family's, and GLM-4.5's with its own layers."""

    def __init__(self, args: DecoderArgs, layers: Sequence[StackLayer]) -> None:
        super().__init__()
        self.embed_tokens: nn.Embedding | nn.QuantizedEmbedding = Embedding(
            args.vocab_size, args.hidden_size
        )
        self.layers = list(layers)
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(
        self,
        ids: mx.array,  # [B, L] int32
        cache: KVCache,
        offsets: Sequence[int],
        taps: Sequence[int] = (),
        tapped: list[mx.array] | None = None,
    ) -> mx.array:  # [B, L, H], before the final norm
        """The last layer's output; the outputs of layers `taps` appended to
        `tapped` in that order (`models.base.run_stack`)."""
        return run_stack(
            self.embed_tokens, self.layers, ids, cache, offsets, taps, tapped
        )


class LlamaModel(Backbone):
    """The llama family's backbone: pre-norm blocks of a `BlockSpec`."""

    def __init__(self, args: DecoderArgs, spec: BlockSpec) -> None:
        super().__init__(
            args,
            [TransformerBlock(args, i, spec) for i in range(args.num_hidden_layers)],
        )


class DecoderLM(HeadedLM, Tapping):
    """A causal LM over a `Backbone` and a KV cache: implements
    `models.base.CausalLM` (a model class adds its backbone and `sanitize`)."""

    padding_safe = True
    model: Backbone

    def __init__(self, args: DecoderArgs, backbone: Backbone) -> None:
        super().__init__(args, backbone)

    def __call__(
        self,
        ids: mx.array,  # [B, L] int32
        cache: KVCache,
        offsets: Sequence[int],
        *,
        prefill: bool = False,  # attention rolls back by position: nothing to skip
    ) -> ModelOutput:
        tapped: list[mx.array] = []
        hidden = self.model(ids, cache, offsets, self.taps, tapped)
        return ModelOutput(
            logits=self.lm_head(hidden), hidden=hidden, features=self.features(tapped)
        )

    def make_cache(self, batch: int) -> KVCache:
        return decoder_cache(self, self.args, self.args.num_hidden_layers, batch)


class Model(DecoderLM):
    """Llama (and, by their `block_spec`, qwen2 and qwen3)."""

    def __init__(self, args: DecoderArgs) -> None:
        super().__init__(args, LlamaModel(args, self.block_spec(args)))

    @staticmethod
    def block_spec(args: DecoderArgs) -> BlockSpec:
        return BlockSpec(
            qkv_bias=args.attention_bias,
            o_bias=args.attention_bias,
            mlp_bias=args.mlp_bias,
        )

    def sanitize(self, weights: Mapping[str, mx.array]) -> dict[str, mx.array]:
        """HF / MLX checkpoint names -> this model's parameter names."""
        kept = {
            k: v for k, v in weights.items() if not k.endswith("rotary_emb.inv_freq")
        }
        if self.args.tie_word_embeddings:
            # HF state dicts of tied models still list the shared tensor.
            kept = {k: v for k, v in kept.items() if not k.startswith("lm_head.")}
        return kept
