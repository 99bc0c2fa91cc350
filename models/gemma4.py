"""Gemma-4's text model (`model_type` `gemma4_text`, and the multimodal
`gemma4` run as its text part); also Gemma-4 Unified's (`gemma4_unified_text`,
and the multimodal `gemma4_unified` run as its text part), whose decoder is
this one without per-layer embeddings and without the MoE block (its
layers, norms, RoPE, embedding scale, attention and kv sharing are
transformers' Gemma-4 ones; schemas/hf_gemma4.py reads its other defaults);
and Gemma-3's (`gemma3_text`, the multimodal `gemma3` as its text part):
this decoder with Gemma-3's softmax scale (query_pre_attn_scalar^-0.5 for
Gemma-4's 1), no value norm, RMSNorms of x / rms(x) * (1 + weight)
(`OffsetRMSNorm`), no `layer_scalar`, "default" RoPE on both layer types
("linear" where a larger model's config asks it), no per-layer embeddings,
MoE block or kv sharing (reference: transformers
`models/gemma3/modeling_gemma3.py`).

Notable:
- Two layer types (`layer_types`): "sliding_attention" layers see the keys
  at positions q - sliding_window < k <= q, "full_attention" layers all
  k <= q. Each type has its own head width (full: `global_head_dim`), KV
  head count (full with `attention_k_eq_v`: `num_global_key_value_heads`)
  and RoPE. So the cache (`Gemma4Cache`) holds one KV arena per type. Sliding
  layers keep every position too (no rotating buffer): rollback stays by
  position, and the window is a mask over the keys, which a forward first
  cuts to start at the earliest position any of its queries sees (on a
  GPU, a multiple of `SLIDING_ALIGN`, so bucketed key lengths stay few).
- Attention: q, k normed per head by RMSNorm (Gemma-4's RMSNorm multiplies
  by `weight`, not 1 + weight), values by an RMSNorm without weight; RoPE
  on q and k; softmax scale 1. A full layer with `attention_k_eq_v` has no
  v_proj: its values are k_proj's output, v-normed, not roped.
- RoPE "default" (sliding): every rotate-half pair (i, i + D/2) at
  theta^(-2i/D). "proportional" (full): the first
  int(partial_rotary_factor * D // 2) pairs at theta^(-2i/D) / factor (the
  exponent over the whole D, not over the rotated width), the other pairs
  with frequency 0 (unrotated) -- not RoPE over the first dimensions.
- KV sharing: the last `num_kv_shared_layers` layers have no k/v
  projections and no cache slots; they attend over the keys/values the last
  non-shared layer of their type stored in this forward (transformers'
  kv_sharing_modes "store" / "reuse"). With `use_double_wide_mlp` their MLP
  is twice as wide.
- A layer: h = x + post_attention_norm(attn(input_norm(x))); then
  h + post_feedforward_norm(mlp(pre_feedforward_norm(h)) [+ MoE]); then the
  per-layer embedding's residual; the whole output times `layer_scalar` (a
  per-layer value the checkpoint stores). MLPs are GeGLU (tanh GELU).
- MoE (`enable_moe_block`): beside the dense MLP, post_feedforward_norm_1(
  mlp) + post_feedforward_norm_2(experts(pre_feedforward_norm_2(h))), routed
  from h: softmax(proj(rmsnorm(h) * scale / sqrt(H))) in float32, top-k,
  renormalised, times `per_expert_scale`.
- Per-layer embeddings (PLE, `hidden_size_per_layer_input` P > 0): per
  layer and token, (norm(per_layer_model_projection(e) / sqrt(H)) +
  embed_tokens_per_layer(id) * sqrt(P)) / sqrt(2), with e the scaled
  embedding; a layer adds post_per_layer_input_norm(per_layer_projection(
  gelu(per_layer_input_gate(h)) * its input)).
- The embedding is scaled by sqrt(H), the scale rounded to the weights'
  dtype first (as transformers does); the logits are capped at
  `final_logit_softcapping` (c * tanh(z / c)) when set, in `lm_head` and in
  `head_weights()`'s projection (models/vocab_head.py), so FR-Spec subset
  heads and drafts that project through the target's head see the capped
  logits the target samples from.

Checkpoint names are transformers' (`model.layers.N.self_attn.q_proj`, ...,
`model.embed_tokens_per_layer`, `lm_head`). `sanitize` also reads the
multimodal layout (`model.language_model.*`; MLX conversions'
`language_model.model.*`, `language_model.lm_head.*`), drops the vision and
audio towers and their embedders (Unified has no towers: its encoder-free
`embed_vision` -- patch norms, a dense patch projection, a 2-D position
table, `multimodal_embedder` -- and `embed_audio` are dropped as the
embedders are), drops k/v projections and norms a
checkpoint lists for kv-shared layers, and splits transformers' stacked
experts (`experts.gate_up_proj` [E, 2I, H], gate rows first;
`experts.down_proj` [E, H, I]) into `experts.switch_glu.{gate,up,down}_proj`
(mlx-lm's names, so its conversions load unchanged).

For a KV-borrowing draft (Gemma-4's assistant, whose decoder layers are
all kv-shared and read the target's stored keys/values): `DecoderLayer.run`
(a layer around any attention), `Attention.queries` / `Attention.output`,
`Model.shared_kv`, `Model.embed`, `Model.final_norm`, and
`schemas.hf_gemma4.gemma4_text_args` for its nested text config.
Reference: transformers `models/gemma4/modeling_gemma4.py`,
`models/gemma4_unified/modeling_gemma4_unified.py`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from functools import partial

import mlx.core as mx
import mlx.nn as nn
from attrs import frozen

from models.base import (
    Mask,
    ModelOutput,
    Tapping,
    args_as,
    attention_mask,
    refuse,
    rope_offset,
)
from models.cache import KVCache
from models.fuse import FusedProjection, fuse, fused_or_none
from models.layers import HeadedLM, model_dtype
from models.parallel import Embedding, Linear
from models.qwen3_next import SwitchGLU
from schemas.hf_gemma4 import (
    FULL_ATTENTION,
    LAYER_TYPES,
    SLIDING_ATTENTION,
    Gemma4Args,
    LayerRope,
    target_problem,
)

KV = tuple[mx.array, mx.array]  # keys, values [B, Hkv, S, D]

# A sliding layer's keys start at a multiple of this on a GPU (bucketed
# windows attend over the whole capacity, a multiple of 256: the cut keeps
# their key lengths multiples of 256 too, so the attention kernel compiled
# per key length is reused).
SLIDING_ALIGN = 256


class RMSNorm(nn.RMSNorm):
    """Gemma-4's RMSNorm: x / rms(x) * weight (the weight itself, not
    Gemma 1-3's 1 + weight), which is MLX's; its own name so the Gemma-4
    layers say which norm they use."""


class OffsetRMSNorm(nn.Module):
    """Gemma-3's RMSNorm: x / rms(x) * (1 + weight), the checkpoint's weight
    as stored (zeros: the identity scale)."""

    def __init__(self, dims: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = mx.zeros((dims,))

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, 1.0 + self.weight, self.eps)


Norm = RMSNorm | OffsetRMSNorm


def norm_of(args: Gemma4Args) -> type[RMSNorm] | type[OffsetRMSNorm]:
    """The RMSNorm class of a model: Gemma-4's, or Gemma-3's offset one."""
    return OffsetRMSNorm if args.norm_offset else RMSNorm


class LayerRoPE(nn.Module):
    """One layer type's RoPE over heads of `dims` (rotate-half layout)."""

    def __init__(self, dims: int, rope: LayerRope) -> None:
        super().__init__()
        self.dims = dims
        self._base: float | None = rope.theta
        self._freqs: mx.array | None = None
        self._scale = 1.0
        if rope.rope_type == "linear":  # positions divided by the factor
            self._scale = 1.0 / rope.factor
        elif rope.rope_type == "proportional":
            # mx.fast.rope takes periods (position / period is the angle);
            # an infinite period leaves its pair unrotated
            pairs = dims // 2
            rotated = int(rope.partial_rotary_factor * dims // 2)
            exponent = mx.arange(0, 2 * pairs, 2, dtype=mx.float32) / dims
            periods = rope.factor * rope.theta**exponent
            keep = mx.arange(pairs) < rotated
            self._freqs = mx.where(keep, periods, mx.inf)
            self._base = None
        elif rope.rope_type != "default":
            raise ValueError(f"unsupported rope_type {rope.rope_type!r}")

    def __call__(self, x: mx.array, offset: int | mx.array) -> mx.array:
        return mx.fast.rope(
            x,
            self.dims,
            traditional=False,
            base=self._base,
            scale=self._scale,
            offset=offset,
            freqs=self._freqs,
        )


@frozen
class TypeView:
    """What one layer type's attention reads in a forward: keys from
    position `start` of the span, under `mask` (relative to `start`)."""

    mask: Mask  # None, "causal" or [B, 1, L, S - start] bool
    start: int


class Window:
    """One forward's positions and, per layer type, its view of the keys;
    `stored` the keys/values the last non-shared layer of each type wrote
    in this forward (what the kv-shared layers after it attend over)."""

    def __init__(
        self, offsets: Sequence[int], length: int, span: int, sliding_window: int
    ) -> None:
        self.offsets = tuple(offsets)
        self.rope_at = rope_offset(offsets)
        # lazy arrays: a type no layer has costs nothing
        self.views = {
            FULL_ATTENTION: TypeView(attention_mask(offsets, length, span), 0),
            SLIDING_ATTENTION: sliding_view(offsets, length, span, sliding_window),
        }
        self.stored: dict[str, KV] = {}


def sliding_view(
    offsets: Sequence[int], length: int, span: int, window: int
) -> TypeView:
    """Row b's query i (at offsets[b] + i) sees keys k with
    offsets[b] + i - window < k <= offsets[b] + i, of a span of `span` keys
    (past max(offsets) + length on a GPU's bucketed windows). The keys are
    cut to start at the earliest one any query sees, rounded down to a
    multiple of SLIDING_ALIGN when the span is bucketed."""
    natural = max(offsets) + length
    if natural <= window:  # no query reaches past its window
        return TypeView(attention_mask(offsets, length, span), 0)
    earliest = max(0, min(offsets) - window + 1)
    start = earliest if span == natural else earliest - earliest % SLIDING_ALIGN
    if length == 1 and span == natural and all(o == offsets[0] for o in offsets):
        return TypeView(None, start)  # the cut keys are exactly the window
    first = mx.array(list(offsets), dtype=mx.int32)[:, None, None, None]
    query = first + mx.arange(length, dtype=mx.int32)[None, None, :, None]
    key = start + mx.arange(span - start, dtype=mx.int32)[None, None, None, :]
    return TypeView((key <= query) & (key > query - window), start)


class Gemma4Cache:
    """Gemma-4's KV storage: one `KVCache` arena per layer type (each type's
    heads have their own [Hkv, D]); arena slot `args.slot(layer)` of the
    layer's type per non-shared layer. Implements `models.base.ModelCache`;
    every arena grows in step, so all share one capacity and key span."""

    def __init__(self, arenas: Mapping[str, KVCache]) -> None:
        assert arenas, "at least one arena"
        self.arenas = dict(arenas)

    @property
    def _first(self) -> KVCache:
        return next(iter(self.arenas.values()))

    @property
    def batch(self) -> int:
        return self._first.batch

    @property
    def capacity(self) -> int:
        return self._first.capacity

    @property
    def bucket_windows(self) -> bool:
        return self._first.bucket_windows

    @bucket_windows.setter
    def bucket_windows(self, value: bool) -> None:
        for arena in self.arenas.values():
            arena.bucket_windows = value

    def reserve(self, end: int) -> None:
        for arena in self.arenas.values():
            arena.reserve(end)

    def key_span(self, offsets: Sequence[int], length: int) -> int:
        return self._first.key_span(offsets, length)

    def write(
        self,
        layer_type: str,
        slot: int,
        keys: mx.array,  # [B, Hkv, L, D]
        values: mx.array,  # [B, Hkv, L, D]
        offsets: Sequence[int],
    ) -> KV:  # [B, Hkv, S, D] x2, S = key_span(offsets, L)
        return self.arenas[layer_type].write(slot, keys, values, offsets)

    def arrays(self) -> list[mx.array]:
        return [a for arena in self.arenas.values() for a in arena.arrays()]

    # attention only: a row's state after n positions is this one cut to n
    truncatable = True

    def take_rows(self, rows: Sequence[int], end: int | None = None) -> Gemma4Cache:
        """A copy holding the given rows, in that order (`KVCache.take_rows`)."""
        return Gemma4Cache(
            {kind: arena.take_rows(rows, end) for kind, arena in self.arenas.items()}
        )

    @staticmethod
    def concat_rows(caches: Sequence[Gemma4Cache]) -> Gemma4Cache:
        """Stack the rows of several caches of one model into one (a copy)."""
        kinds = caches[0].arenas.keys()
        return Gemma4Cache(
            {
                kind: KVCache.concat_rows([c.arenas[kind] for c in caches])
                for kind in kinds
            }
        )


def scaled_embedding(embedded: mx.array) -> mx.array:  # [..., H]
    """A token embedding times sqrt(H), the scale rounded to its dtype."""
    return embedded * mx.array(math.sqrt(embedded.shape[-1]), dtype=embedded.dtype)


def _v_norm(x: mx.array, eps: float) -> mx.array:
    """RMSNorm without a weight (the values')."""
    return mx.fast.rms_norm(x, None, eps)


class Attention(nn.Module):
    """Gemma-4 attention of one layer (see the module doc); a kv-shared
    layer has only q_proj, q_norm and o_proj."""

    def __init__(self, args: Gemma4Args, layer: int) -> None:
        super().__init__()
        kind = args.layer_types[layer]
        self.layer_type = kind
        self.heads = args.num_attention_heads
        self.head_dim = args.head_dim_of(kind)
        self.kv_heads = args.kv_heads_of(kind)
        self.kv_shared = args.is_kv_shared(layer)
        self.slot = args.slot(layer)  # in its type's arena (non-shared layers)
        self.keys_are_values = args.keys_are_values(kind)
        self.eps = args.rms_norm_eps
        hidden, bias = args.hidden_size, args.attention_bias
        width, kv_width = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.scale = args.attention_scale
        self.value_norm = args.value_norm
        norm = norm_of(args)
        self.q_proj = Linear(hidden, width, bias=bias)
        self.q_norm = norm(self.head_dim, eps=self.eps)
        self.k_proj: nn.Linear | None = None
        self.v_proj: nn.Linear | None = None
        self.k_norm: Norm | None = None
        if not self.kv_shared:
            self.k_proj = Linear(hidden, kv_width, bias=bias)
            if not self.keys_are_values:
                self.v_proj = Linear(hidden, kv_width, bias=bias)
            self.k_norm = norm(self.head_dim, eps=self.eps)
        self.o_proj = Linear(width, hidden, bias=bias)
        self.rope = LayerRoPE(self.head_dim, args.rope_of(kind))
        self._qkv: FusedProjection | None = None

    def _parts(self) -> tuple[nn.Module, ...]:
        return tuple(
            p for p in (self.q_proj, self.k_proj, self.v_proj) if p is not None
        )

    def fuse_projections(self) -> bool:
        """Run q, k (and v) as one product from now on (models/fuse.py)."""
        if self.kv_shared:
            return False
        self._qkv = fuse(self._parts())
        return self._qkv is not None

    def queries(
        self,
        x: mx.array,  # [B, L, H], input-normed
        rope_at: int | mx.array,  # scalar or [B]
    ) -> mx.array:  # [B, Hq, L, D]
        """q_proj, q_norm, RoPE."""
        return self._rotated_queries(self.q_proj(x), rope_at)

    def _rotated_queries(self, q: mx.array, rope_at: int | mx.array) -> mx.array:
        batch, length, _ = q.shape
        q = self.q_norm(q.reshape(batch, length, self.heads, self.head_dim))
        return self.rope(q.transpose(0, 2, 1, 3), rope_at)

    def output(self, attended: mx.array) -> mx.array:  # [B, Hq, L, D] -> [B, L, H]
        batch, _, length, _ = attended.shape
        return self.o_proj(attended.transpose(0, 2, 1, 3).reshape(batch, length, -1))

    def _project(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """Raw q [B, L, Hq*D], k and v [B, L, Hkv*D] (v is k without v_proj)."""
        assert self.k_proj is not None, "a kv-shared layer projects no keys"
        fused = fused_or_none(self._qkv, self._parts())
        if fused is None:
            q, k = self.q_proj(x), self.k_proj(x)
            v = k if self.v_proj is None else self.v_proj(x)
            return q, k, v
        both = fused(x)
        width, kv_width = self.heads * self.head_dim, self.kv_heads * self.head_dim
        q, k = both[..., :width], both[..., width : width + kv_width]
        v = k if self.v_proj is None else both[..., width + kv_width :]
        return q, k, v

    def keys_values(
        self,
        k: mx.array,  # [B, L, Hkv*D] raw (k_proj's)
        v: mx.array,  # [B, L, Hkv*D] raw (v_proj's, or k_proj's)
        rope_at: int | mx.array,  # scalar or [B]
    ) -> KV:  # [B, Hkv, L, D] x2
        """Keys k_normed and roped; values v-normed (no weight), not roped."""
        assert self.k_norm is not None, "a kv-shared layer projects no keys"
        batch, length, _ = k.shape
        shape = (batch, length, self.kv_heads, self.head_dim)
        keys = self.rope(self.k_norm(k.reshape(shape)).transpose(0, 2, 1, 3), rope_at)
        values = v.reshape(shape)
        if self.value_norm:
            values = _v_norm(values, self.eps)
        return keys, values.transpose(0, 2, 1, 3)

    def attend(
        self,
        queries: mx.array,  # [B, Hq, L, D]
        keys: mx.array,  # [B, Hkv, S, D]
        values: mx.array,  # [B, Hkv, S, D]
        mask: Mask,
    ) -> mx.array:  # [B, L, H]
        """output(softmax(q k^T * scale) v) under `mask` (scale 1 for
        Gemma-4, query_pre_attn_scalar^-0.5 for Gemma-3)."""
        out = mx.fast.scaled_dot_product_attention(
            queries, keys, values, scale=self.scale, mask=mask
        )
        return self.output(out)

    def __call__(
        self,
        x: mx.array,  # [B, L, H], input-normed
        cache: Gemma4Cache,
        window: Window,
    ) -> mx.array:  # [B, L, H], before post_attention_layernorm
        """The target's attention: a non-shared layer stores its window's
        keys/values in its arena slot and attends over its type's view of
        them; a kv-shared layer attends over what the last non-shared layer
        of its type stored in this forward."""
        view = window.views[self.layer_type]
        if self.kv_shared:
            stored = window.stored.get(self.layer_type)
            if stored is None:
                raise ValueError(
                    f"a kv-shared {self.layer_type} layer runs before any layer "
                    "of its type stored keys and values in this forward"
                )
            queries = self.queries(x, window.rope_at)
            return self.attend(queries, *stored, view.mask)
        q, k, v = self._project(x)
        queries = self._rotated_queries(q, window.rope_at)
        keys, values = self.keys_values(k, v, window.rope_at)
        keys, values = cache.write(
            self.layer_type, self.slot, keys, values, window.offsets
        )
        if view.start:
            keys, values = keys[:, :, view.start :], values[:, :, view.start :]
        window.stored[self.layer_type] = (keys, values)
        return self.attend(queries, keys, values, view.mask)


class MLP(nn.Module):
    """GeGLU: down(gelu_tanh(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, bias=False)
        self.up_proj = Linear(hidden, intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)
        self.intermediate = intermediate
        self._gate_up: FusedProjection | None = None

    def fuse_projections(self) -> bool:
        """Run gate and up as one product from now on (models/fuse.py)."""
        self._gate_up = fuse((self.gate_proj, self.up_proj))
        return self._gate_up is not None

    def __call__(self, x: mx.array) -> mx.array:  # [..., H] -> [..., H]
        fused = fused_or_none(self._gate_up, (self.gate_proj, self.up_proj))
        if fused is None:
            return self.down_proj(nn.gelu_approx(self.gate_proj(x)) * self.up_proj(x))
        both = fused(x)
        n = self.intermediate
        return self.down_proj(nn.gelu_approx(both[..., :n]) * both[..., n:])


class Router(nn.Module):
    """The MoE block's router (`router.proj`, `router.scale`,
    `router.per_expert_scale`); routes in float32 as transformers does."""

    def __init__(self, args: Gemma4Args) -> None:
        super().__init__()
        self.top_k = args.top_k_experts
        self.eps = args.rms_norm_eps
        self.root = args.hidden_size**-0.5
        self.proj = Linear(args.hidden_size, args.num_experts, bias=False)
        self.scale = mx.ones((args.hidden_size,))
        self.per_expert_scale = mx.ones((args.num_experts,))

    def __call__(
        self,
        x: mx.array,  # [N, H]
    ) -> tuple[mx.array, mx.array]:  # experts [N, k] int32, weights [N, k] float32
        normed = mx.fast.rms_norm(x, None, self.eps) * self.scale * self.root
        probs = mx.softmax(self.proj(normed).astype(mx.float32), axis=-1)  # [N, E]
        k = self.top_k
        chosen = mx.argpartition(-probs, kth=k - 1, axis=-1)[:, :k]  # [N, k]
        weights = mx.take_along_axis(probs, chosen, axis=-1)
        weights = weights / weights.sum(axis=-1, keepdims=True)
        scale = self.per_expert_scale.astype(mx.float32)[chosen]
        return chosen.astype(mx.int32), weights * scale


class Experts(nn.Module):
    """The routed experts, stacked (`experts.switch_glu.*`), GeGLU each."""

    def __init__(self, args: Gemma4Args) -> None:
        super().__init__()
        self.switch_glu = SwitchGLU(
            args.hidden_size,
            args.moe_intermediate_size,
            args.num_experts,
            activation=nn.gelu_approx,
        )

    def __call__(
        self,
        x: mx.array,  # [N, H]
        experts: mx.array,  # [N, k] int32
        weights: mx.array,  # [N, k] float32
    ) -> mx.array:  # [N, H]
        routed = self.switch_glu(x, experts)  # [N, k, H]
        return (routed * weights.astype(x.dtype)[..., None]).sum(axis=1)


# an attention as `DecoderLayer.run` takes it: the input-normed hidden
# [B, L, H] -> the attention output [B, L, H] (before post_attention_layernorm)
Attend = Callable[[mx.array], mx.array]


class DecoderLayer(nn.Module):
    """One Gemma-4 decoder layer (see the module doc). Buildable from args
    whose every layer is kv-shared (an assistant draft's); `attention`
    builds its attention (a subclass of `Attention`: a DSpark draft's)."""

    def __init__(
        self,
        args: Gemma4Args,
        layer: int,
        attention: Callable[[Gemma4Args, int], Attention] = Attention,
    ) -> None:
        super().__init__()
        hidden, eps = args.hidden_size, args.rms_norm_eps
        self.self_attn = attention(args, layer)
        wide = 2 if args.use_double_wide_mlp and args.is_kv_shared(layer) else 1
        self.mlp = MLP(hidden, args.intermediate_size * wide)
        norm = norm_of(args)
        self.input_layernorm = norm(hidden, eps=eps)
        self.post_attention_layernorm = norm(hidden, eps=eps)
        self.pre_feedforward_layernorm = norm(hidden, eps=eps)
        self.post_feedforward_layernorm = norm(hidden, eps=eps)
        if args.layer_scalar:
            self.layer_scalar = mx.ones((1,))
        self.router: Router | None = None
        self.experts: Experts | None = None
        self.pre_feedforward_layernorm_2: RMSNorm | None = None
        self.post_feedforward_layernorm_1: RMSNorm | None = None
        self.post_feedforward_layernorm_2: RMSNorm | None = None
        if args.enable_moe_block:
            self.router = Router(args)
            self.experts = Experts(args)
            self.pre_feedforward_layernorm_2 = RMSNorm(hidden, eps=eps)
            self.post_feedforward_layernorm_1 = RMSNorm(hidden, eps=eps)
            self.post_feedforward_layernorm_2 = RMSNorm(hidden, eps=eps)
        per_layer = args.hidden_size_per_layer_input
        self.per_layer_input_gate: nn.Linear | None = None
        self.per_layer_projection: nn.Linear | None = None
        self.post_per_layer_input_norm: RMSNorm | None = None
        if per_layer:
            self.per_layer_input_gate = Linear(hidden, per_layer, bias=False)
            self.per_layer_projection = Linear(per_layer, hidden, bias=False)
            self.post_per_layer_input_norm = RMSNorm(hidden, eps=eps)

    def run(
        self,
        x: mx.array,  # [B, L, H]
        attend: Attend,
        per_layer_input: mx.array | None,  # [B, L, P], None: the layer has no PLE
    ) -> mx.array:  # [B, L, H]
        """The layer around `attend` (the input-normed hidden -> the
        attention output): norms, residuals, MLP (+ MoE), the per-layer
        embedding's residual, `layer_scalar`."""
        h = x + self.post_attention_layernorm(attend(self.input_layernorm(x)))
        out = self.mlp(self.pre_feedforward_layernorm(h))
        if self.router is not None:
            assert self.experts is not None
            assert self.pre_feedforward_layernorm_2 is not None
            assert self.post_feedforward_layernorm_1 is not None
            assert self.post_feedforward_layernorm_2 is not None
            tokens = h.reshape(-1, h.shape[-1])  # [N, H]
            experts, weights = self.router(tokens)
            routed = self.experts(
                self.pre_feedforward_layernorm_2(tokens), experts, weights
            )
            out = self.post_feedforward_layernorm_1(
                out
            ) + self.post_feedforward_layernorm_2(routed.reshape(h.shape))
        h = h + self.post_feedforward_layernorm(out)
        if self.per_layer_input_gate is not None:
            assert self.per_layer_projection is not None
            assert self.post_per_layer_input_norm is not None
            if per_layer_input is None:
                raise ValueError("this layer has per-layer embeddings: pass its input")
            gate = nn.gelu_approx(self.per_layer_input_gate(h)) * per_layer_input
            h = h + self.post_per_layer_input_norm(self.per_layer_projection(gate))
        elif per_layer_input is not None:
            raise ValueError("this layer has no per-layer embeddings (PLE)")
        return h * self.layer_scalar if "layer_scalar" in self else h


class Gemma4TextModel(nn.Module):
    """The embeddings (token and per-layer), decoder layers and final norm."""

    def __init__(self, args: Gemma4Args) -> None:
        super().__init__()
        hidden, eps = args.hidden_size, args.rms_norm_eps
        self.embed_tokens: nn.Embedding | nn.QuantizedEmbedding = Embedding(
            args.vocab_size, hidden
        )
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = norm_of(args)(hidden, eps=eps)
        self.layer_count = args.num_hidden_layers
        self.per_layer = args.hidden_size_per_layer_input
        self.embed_tokens_per_layer: nn.Embedding | nn.QuantizedEmbedding | None = None
        self.per_layer_model_projection: nn.Linear | None = None
        self.per_layer_projection_norm: RMSNorm | None = None
        if self.per_layer:
            packed = args.num_hidden_layers * self.per_layer
            self.embed_tokens_per_layer = Embedding(
                args.vocab_size_per_layer_input, packed
            )
            self.per_layer_model_projection = Linear(hidden, packed, bias=False)
            self.per_layer_projection_norm = RMSNorm(self.per_layer, eps=eps)

    def embed(self, ids: mx.array) -> mx.array:  # [B, L] -> [B, L, H]
        return scaled_embedding(self.embed_tokens(ids))

    def per_layer_inputs(
        self,
        ids: mx.array,  # [B, L]
        embedded: mx.array,  # [B, L, H], the scaled embedding
    ) -> mx.array | None:  # [B, L, layers, P]; None without PLE
        if self.embed_tokens_per_layer is None:
            return None
        assert self.per_layer_model_projection is not None
        assert self.per_layer_projection_norm is not None
        batch, length = ids.shape
        shape = (batch, length, self.layer_count, self.per_layer)
        tokens = self.embed_tokens_per_layer(ids)
        tokens = tokens * mx.array(math.sqrt(self.per_layer), dtype=tokens.dtype)
        projected = self.per_layer_model_projection(embedded)
        projected = projected * float(embedded.shape[-1]) ** -0.5
        projected = self.per_layer_projection_norm(projected.reshape(shape))
        combined: mx.array = (projected + tokens.reshape(shape)) * 2.0**-0.5
        return combined


class Model(HeadedLM, Tapping):
    """The causal LM: implements `models.base.CausalLM` (its `args` the
    protocol's type, always a Gemma4Args here: see `gemma`)."""

    padding_safe = True  # attention only: padded positions are overwritten later
    model: Gemma4TextModel

    def __init__(self, args: Gemma4Args) -> None:
        refuse(target_problem(args))
        super().__init__(args, Gemma4TextModel(args))

    @property
    def gemma(self) -> Gemma4Args:
        return args_as(self.args, Gemma4Args, "gemma4")

    def __call__(
        self,
        ids: mx.array,  # [B, L] int32
        cache: Gemma4Cache,
        offsets: Sequence[int],
        *,
        prefill: bool = False,  # attention rolls back by position: nothing to skip
    ) -> ModelOutput:
        batch, length = ids.shape
        assert len(offsets) == batch, "one offset per row"
        cache.reserve(max(offsets) + length)
        span = cache.key_span(offsets, length)
        window = Window(offsets, length, span, self.gemma.sliding_window)
        h = self.embed(ids)
        per_layer = self.model.per_layer_inputs(ids, h)
        taps = self.taps
        outputs: dict[int, mx.array] = {}
        for i, layer in enumerate(self.model.layers):
            attend = partial(layer.self_attn, cache=cache, window=window)
            h = layer.run(h, attend, None if per_layer is None else per_layer[:, :, i])
            if i in taps:
                outputs[i] = h
        return ModelOutput(
            logits=self.lm_head(h),
            hidden=h,
            features=self.features([outputs[i] for i in taps]),
        )

    def make_cache(self, batch: int) -> Gemma4Cache:
        args, dtype = self.gemma, model_dtype(self)
        return Gemma4Cache(
            {
                kind: KVCache(
                    args.stored_layers(kind),
                    batch,
                    args.kv_heads_of(kind),
                    args.head_dim_of(kind),
                    dtype,
                )
                for kind in LAYER_TYPES
                if args.stored_layers(kind)
            }
        )

    def shared_kv(self, cache: Gemma4Cache, layer_type: str) -> KV:
        """The stored keys/values `[B, Hkv, C, D]` (the whole arena capacity
        C) of the layer whose keys/values a kv-shared layer of `layer_type`
        reads: the last non-shared layer of that type (the last layer of
        that type when no layer is shared)."""
        producer = self.gemma.producer(layer_type)
        if producer is None:
            raise ValueError(
                f"no layer of type {layer_type!r} stores keys and values "
                f"(layer_types: {sorted(set(self.gemma.layer_types))})"
            )
        arena = cache.arenas[layer_type]
        if not arena.keys:
            raise ValueError("the cache holds no positions yet (run a forward first)")
        slot = self.gemma.slot(producer)
        return arena.keys[slot], arena.values[slot]

    def embed(self, ids: mx.array) -> mx.array:  # [B, L] -> [B, L, H]
        """The token embedding times sqrt(H) (what the first layer reads)."""
        return self.model.embed(ids)

    @property
    def logit_softcap(self) -> float | None:
        return self.gemma.final_logit_softcapping

    def sanitize(self, weights: Mapping[str, mx.array]) -> dict[str, mx.array]:
        """HF (text or multimodal) / MLX checkpoint names -> this model's."""
        return sanitize_weights(weights, self.gemma)


_TOWERS = (
    "vision_tower.",
    "audio_tower.",
    "embed_vision.",
    "embed_audio.",
    "multi_modal_projector.",  # Gemma-3's
)
_SHARED_SKIPPED = re.compile(
    r"^model\.layers\.(\d+)\.self_attn\.(k_proj|v_proj|k_norm|v_norm)\."
)


def text_name(key: str) -> str | None:
    """A checkpoint name in the text model's layout (`model.*`, `lm_head.*`),
    or None for the multimodal towers and their embedders."""
    for prefix, becomes in (
        ("model.language_model.", "model."),
        ("language_model.model.", "model."),
        ("language_model.lm_head.", "lm_head."),
    ):
        if key.startswith(prefix):
            return becomes + key[len(prefix) :]
    bare = key.removeprefix("model.")
    if bare.startswith(_TOWERS):
        return None
    return key


# transformers' stacked experts (`experts.gate_up_proj` [E, 2I, H],
# `experts.down_proj` [E, H, I]); a kept GGUF's with their quantized parts
_STACKED = re.compile(
    r"\.experts\.(gate_up_proj|down_proj)(\.weight|\.scales|\.biases)?$"
)


def sanitize_weights(
    weights: Mapping[str, mx.array], args: Gemma4Args
) -> dict[str, mx.array]:
    """Every Gemma-4 layout's names -> `Model`'s (see the module doc)."""
    out: dict[str, mx.array] = {}
    for key, value in weights.items():
        name = text_name(key)
        if name is None or ".rotary_emb." in name:
            continue
        shared = _SHARED_SKIPPED.match(name)
        if shared is not None and args.is_kv_shared(int(shared.group(1))):
            continue  # a kv-shared layer reads another layer's keys/values
        stacked = _STACKED.search(name)
        if stacked is None:
            out[name] = value
            continue
        # (a kept GGUF's experts come as `.weight`, `.scales`, `.biases`,
        # each split the same way: quantization runs along each row)
        stem = name[: stacked.start()] + ".experts.switch_glu."
        part = stacked.group(2) or ".weight"
        if stacked.group(1) == "down_proj":
            out[f"{stem}down_proj{part}"] = value
        else:
            half = value.shape[1] // 2
            out[f"{stem}gate_proj{part}"] = value[:, :half]
            out[f"{stem}up_proj{part}"] = value[:, half:]
    if args.tie_word_embeddings:
        # HF state dicts of tied models still list the shared tensor
        out.pop("lm_head.weight", None)
    return out
