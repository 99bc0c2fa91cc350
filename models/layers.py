"""Layers shared by the llama-family decoders (llama, qwen2, qwen3; glm4_moe's attention).

The three families differ only in which projections carry a bias and in
whether q and k are RMS-normalised per head before RoPE (qwen3). `BlockSpec`
states those choices as data, so a model file declares its differences
instead of repeating the layers. `AttentionBlock` (attention, then an MLP) is
GLM-4.5's and Qwen3-Next's attention layer too; `HeadedLM`
(embedding and vocabulary head), `add_lm_head` and `decoder_cache` are what
their causal LMs share.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import mlx.core as mx
import mlx.nn as nn
from attrs import evolve, frozen
from mlx.utils import tree_flatten

from models.base import Mask, RoPE
from models.cache import KVCache, KVWrite, kv_cache, kv_quantization
from models.fuse import FusedProjection, fuse, fused_or_none
from models.parallel import Linear
from models.vocab_head import HeadWeights, softcapped
from schemas.hf import DecoderArgs


@frozen
class BlockSpec:
    """The optional parameters of one decoder block."""

    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    # RMSNorm over head_dim on q and k, before RoPE (qwen3)
    qk_norm: bool = False
    # RoPE on the first head_dim * rotary_fraction dims of each head, the
    # rest passed through (glm4_moe's partial_rotary_factor)
    rotary_fraction: float = 1.0


class PreNormLayer(nn.Module):
    """A pre-norm decoder layer's two RMS norms and its residual form: the
    mixer (attention or a recurrent one) reads `input_layernorm(x)`, the MLP
    `post_attention_layernorm(h)`, and each adds its output back. A family's
    layer calls this `__init__` and adds its mixer and MLP; the names are the
    checkpoints' (`input_layernorm.weight`, `post_attention_layernorm.weight`)."""

    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(hidden, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(hidden, eps=eps)

    def residual(
        self,
        x: mx.array,  # [B, L, H]
        mix: Callable[[mx.array], mx.array],  # the normed input -> the mixer's output
        mlp: Callable[[mx.array], mx.array],
    ) -> mx.array:  # [B, L, H]
        h = x + mix(self.input_layernorm(x))
        return h + mlp(self.post_attention_layernorm(h))


class WindowAttention(Protocol):
    """An attention an `AttentionBlock` holds: its slot in the KV cache, and
    its forward with the window's keys/values stored by `write`."""

    kv_index: int

    def attend(
        self, x: mx.array, write: KVWrite, mask: Mask, rope_at: int | mx.array
    ) -> mx.array: ...  # [B, L, H] -> [B, L, H]


class AttentionBlock(PreNormLayer):
    """A pre-norm decoder layer of an attention `self_attn` then an `mlp`
    (llama's block, GLM-4.5's layer, Qwen3-Next's full-attention layer): a
    family's `__init__` sets the two."""

    self_attn: WindowAttention
    mlp: Callable[[mx.array], mx.array]

    def __call__(
        self,
        x: mx.array,  # [B, L, H]
        cache: KVCache,
        offsets: Sequence[int],
        mask: Mask,  # None, "causal" or [B, 1, L, S]
        rope_at: int | mx.array,  # scalar or [B]
    ) -> mx.array:  # [B, L, H]
        return self.forward(
            x, cache.writer(self.self_attn.kv_index, offsets), mask, rope_at
        )

    def forward(
        self, x: mx.array, write: KVWrite, mask: Mask, rope_at: int | mx.array
    ) -> mx.array:  # [B, L, H] -> [B, L, H]
        """The layer with its keys/values stored by `write` (the cache's write
        in `__call__`; a scatter at device-valued positions in an MTP head's
        compiled step)."""
        return self.residual(
            x, lambda n: self.self_attn.attend(n, write, mask, rope_at), self.mlp
        )


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int, bias: bool) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, bias=bias)
        self.up_proj = Linear(hidden, intermediate, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)
        self.intermediate = intermediate
        self._gate_up: FusedProjection | None = None

    def fuse_projections(self) -> bool:
        """Run gate and up as one product from now on (models/fuse.py)."""
        self._gate_up = fuse((self.gate_proj, self.up_proj))
        return self._gate_up is not None

    def __call__(self, x: mx.array) -> mx.array:  # [B, L, H] -> [B, L, H]
        fused = fused_or_none(self._gate_up, (self.gate_proj, self.up_proj))
        if fused is None:
            return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))
        both = fused(x)
        n = self.intermediate
        return self.down_proj(nn.silu(both[..., :n]) * both[..., n:])


class Attention(nn.Module):
    """Grouped-query attention over the shared KV cache.

    Keys and values of the window are written at each row's offset; the
    queries then attend to the row's span `[0, max(offsets) + L)` under the
    mask from `models.base.attention_mask` (positions a row has not reached
    hold stale values and are masked out).
    """

    def __init__(self, args: DecoderArgs, layer: int, spec: BlockSpec) -> None:
        super().__init__()
        self.kv_index = layer  # this layer's slot in the KV cache
        self.heads = args.num_attention_heads
        self.kv_heads = args.num_key_value_heads
        self.head_dim = args.dim_per_head
        self.scale = self.head_dim**-0.5
        hidden = args.hidden_size
        self.q_proj = Linear(hidden, self.heads * self.head_dim, bias=spec.qkv_bias)
        self.k_proj = Linear(hidden, self.kv_heads * self.head_dim, bias=spec.qkv_bias)
        self.v_proj = Linear(hidden, self.kv_heads * self.head_dim, bias=spec.qkv_bias)
        self.o_proj = Linear(self.heads * self.head_dim, hidden, bias=spec.o_bias)
        self.q_norm: nn.RMSNorm | None = None
        self.k_norm: nn.RMSNorm | None = None
        if spec.qk_norm:
            self.q_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
            self.k_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
        # mx.fast.rope rotates the first `dims` of the last axis (rotate-half
        # pairs i, i + dims/2) and passes the rest through, as transformers does
        self.rope = RoPE(int(self.head_dim * spec.rotary_fraction), args.rope)
        self._qkv: FusedProjection | None = None

    def fuse_projections(self) -> bool:
        """Run q, k and v as one product from now on (models/fuse.py)."""
        self._qkv = fuse((self.q_proj, self.k_proj, self.v_proj))
        return self._qkv is not None

    def _project_qkv(
        self, x: mx.array
    ) -> tuple[mx.array, mx.array, mx.array]:  # [B, L, H] -> [B, L, heads, D] x3
        batch, length, _ = x.shape
        parts = (self.q_proj, self.k_proj, self.v_proj)
        fused = fused_or_none(self._qkv, parts)
        if fused is None:
            return (
                self.q_proj(x).reshape(batch, length, self.heads, self.head_dim),
                self.k_proj(x).reshape(batch, length, self.kv_heads, self.head_dim),
                self.v_proj(x).reshape(batch, length, self.kv_heads, self.head_dim),
            )
        heads, kv = self.heads, self.kv_heads
        qkv = fused(x).reshape(batch, length, heads + 2 * kv, self.head_dim)
        return qkv[:, :, :heads], qkv[:, :, heads : heads + kv], qkv[:, :, heads + kv :]

    def __call__(
        self,
        x: mx.array,  # [B, L, H]
        cache: KVCache,
        offsets: Sequence[int],
        mask: Mask,  # None, "causal" or [B, 1, L, S]
        rope_at: int | mx.array,  # scalar or [B]
    ) -> mx.array:  # [B, L, H]
        return self.attend(x, cache.writer(self.kv_index, offsets), mask, rope_at)

    def attend(
        self,
        x: mx.array,  # [B, L, H]
        write: KVWrite,  # stores the window's keys/values (KVCache.write, scatter_window)
        mask: Mask,
        rope_at: int | mx.array,
    ) -> mx.array:  # [B, L, H]
        """The attention with the window's keys and values stored by `write`
        (the cache's in `__call__`; a scatter at device-valued positions in
        an MTP head's compiled step)."""
        batch, length, _ = x.shape
        q, k, v = self._project_qkv(x)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q = self.rope(q.transpose(0, 2, 1, 3), rope_at)  # [B, Hq, L, D]
        k = self.rope(k.transpose(0, 2, 1, 3), rope_at)  # [B, Hkv, L, D]
        keys, values = write(k, v.transpose(0, 2, 1, 3))
        out = mx.fast.scaled_dot_product_attention(
            q, keys, values, scale=self.scale, mask=mask
        )  # [B, Hq, L, D]
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(batch, length, -1))


def add_lm_head(lm: nn.Module, args: DecoderArgs) -> None:
    """Gives `lm` its own vocabulary projection (`lm_head.weight`) unless
    `args` ties it to the embedding."""
    if not args.tie_word_embeddings:
        # `lm_head` is also the name of the protocol method, so the
        # projection lives only under the module's dict key; that key is
        # what parameter names use, so `lm_head.weight` loads unchanged.
        lm["lm_head"] = Linear(args.hidden_size, args.vocab_size, bias=False)


class HeadedBackbone(Protocol):
    """What `HeadedLM` reads of its backbone (read-only: a backbone's own
    norm class will do)."""

    @property
    def embed_tokens(self) -> nn.Embedding | nn.QuantizedEmbedding: ...

    @property
    def norm(self) -> Callable[[mx.array], mx.array]: ...


class HeadedLM(nn.Module):
    """A causal LM's token embedding and vocabulary head over its backbone
    (`model`: `embed_tokens`, the final `norm`) and `args` (tied or own
    `lm_head`): llama's family, Qwen3-Next's and Gemma-4's share them. A
    subclass narrows `model` to its backbone's class, which it calls, and
    may scale its embedding (`embed`) and cap its logits (`logit_softcap`)."""

    args: DecoderArgs
    model: HeadedBackbone

    def __init__(self, args: DecoderArgs, backbone: HeadedBackbone) -> None:
        super().__init__()
        self.args = args
        self.model = backbone
        add_lm_head(self, args)

    def embed(self, ids: mx.array) -> mx.array:  # [B, L] -> [B, L, H]
        return self.model.embed_tokens(ids)

    def lm_head(self, hidden: mx.array) -> mx.array:  # [..., H] -> [..., V]
        return self.project(self.final_norm(hidden))

    def final_norm(self, hidden: mx.array) -> mx.array:  # [..., H] -> [..., H]
        return self.model.norm(hidden)

    @property
    def logit_softcap(self) -> float | None:
        """The cap `project` puts on the logits (cap * tanh(logits / cap)):
        none unless the architecture has one."""
        return None

    def project(self, normed: mx.array) -> mx.array:  # [..., H] -> [..., V]
        """The vocabulary projection alone (an MTP head brings its own
        norm), its logits capped where the model caps them."""
        if self.args.tie_word_embeddings:
            logits = self.model.embed_tokens.as_linear(normed)
        else:
            projection: nn.Linear | nn.QuantizedLinear = self["lm_head"]
            logits = projection(normed)
        cap = self.logit_softcap
        return logits if cap is None else softcapped(logits, cap)

    def head_weights(self) -> HeadWeights:
        """The vocabulary projection (the embedding when tied) as arrays, with
        the logit cap, which `HeadWeights.project` applies."""
        module = (
            self.model.embed_tokens
            if self.args.tie_word_embeddings
            else self["lm_head"]
        )
        return evolve(HeadWeights.of(module), softcap=self.logit_softcap)


def decoder_cache(
    module: nn.Module, args: DecoderArgs, layers: int, batch: int
) -> KVCache:
    """An empty KV cache of `layers` slots for `batch` rows: `args`' KV heads
    and head width, in the dtype `module` computes in; quantized where the
    module was given a `kv_quantization` (`--kv-bits`)."""
    return kv_cache(
        layers,
        batch,
        args.num_key_value_heads,
        args.dim_per_head,
        model_dtype(module),
        kv_quantization(module),
    )


def flat_parameters(module: nn.Module) -> dict[str, mx.array]:
    """Parameters by dotted name, as in safetensors files (`model.norm.weight`)."""
    flat: dict[str, mx.array] = {}
    tree_flatten(module.parameters(), destination=flat)
    return flat


def model_dtype(module: nn.Module) -> mx.Dtype:
    """The floating dtype the module computes in (quantized layers: their scales')."""
    for value in flat_parameters(module).values():
        if mx.issubdtype(value.dtype, mx.floating):
            return value.dtype
    return mx.float32
