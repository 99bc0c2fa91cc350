"""DFlash: a block drafter conditioned on the target's hidden states (z-lab).

A DFlash draft is a few decoder layers of the target's family (Qwen3 layers:
q/k RMS norms, SwiGLU) that draft a whole block in one forward:

    block  = [pending token, mask, mask, ...]     at positions p .. p + L - 1
    x      = embed(block) * input_embedding_scale (the target's embedding)
    ctx    = hidden_norm(fc(concat(target layer outputs at `target_layer_ids`)))
                                                   for every position < p
    layer: queries from x; keys / values from [ctx, x]
           (k_norm(k_proj(.)), RoPE at the positions; v_proj(.)),
           not causal (the whole block sees itself), a sliding window where
           the config sets one
    drafts = target projection(norm(x)) at block positions 1 .. L - 1
             (times `output_multiplier`, soft-capped where set)

The context keys and values of a layer depend only on the target's features,
never on the block, so each position's are computed once, when it is
committed, and kept in the draft's own KV cache (`write_context`); a round's
block keys and values are never stored. References: z-lab/dflash
`dflash/model.py` (`DFlashDraftModel`, `Qwen3DFlashAttention`); vLLM's
`dflash.py`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from attrs import frozen
from returns.result import Failure, Result, Success

from models.base import rope_offset
from models.cache import KVCache
from models.layers import MLP, Attention, BlockSpec, flat_parameters, model_dtype
from models.parallel import Linear
from models.vocab_head import HeadWeights
from schemas.errors import LoadError
from schemas.hf import DecoderArgs


@frozen
class DFlashSettings:
    """What a DFlash config adds to its decoder layers' (`dflash_config`,
    with top-level keys as fallbacks, as the reference reads them)."""

    target_layers: tuple[int, ...]
    block_size: int
    mask_token: int
    # per draft layer: whether its block is causal, and its sliding window
    # over positions (None: all)
    attention: tuple[tuple[bool, int | None], ...]
    embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    softcap: float | None = None

    @classmethod
    def of(cls, config: Mapping[str, Any]) -> Result[DFlashSettings, LoadError]:
        nested = config.get("dflash_config")
        inner: Mapping[str, Any] = nested if isinstance(nested, Mapping) else {}

        def value(name: str, default: Any = None) -> Any:
            return inner.get(name, config.get(name, default))

        layers = value("target_layer_ids")
        targets = config.get("num_target_layers")
        if layers is None and isinstance(targets, int) and targets > 0:
            layers = default_target_layers(
                targets, int(config.get("num_hidden_layers", 1))
            )
        if not (
            isinstance(layers, list)
            and layers
            and all(isinstance(i, int) and i >= 0 for i in layers)
        ):
            return Failure(
                LoadError(
                    "a DFlash config needs dflash_config.target_layer_ids, a list of "
                    "target layer indices (or num_target_layers, to space them "
                    f"evenly); got {layers!r}"
                )
            )
        mask = value("mask_token_id")
        if not isinstance(mask, int) or mask < 0:
            return Failure(
                LoadError(
                    "a DFlash config needs dflash_config.mask_token_id, the id of the "
                    f"token its blocks are filled with; got {mask!r}"
                )
            )
        block = value("block_size", 16)
        if not isinstance(block, int) or block < 2:
            return Failure(
                LoadError(f"a DFlash block_size must be an integer >= 2, got {block!r}")
            )
        # Qwen3's config rules: a window only with use_sliding_window, layer
        # types from max_window_layers where the config lists none; a sliding
        # layer is causal unless is_causal says otherwise
        count = int(config.get("num_hidden_layers", 1))
        window = (
            config.get("sliding_window") if config.get("use_sliding_window") else None
        )
        if window is not None and (not isinstance(window, int) or window < 1):
            return Failure(
                LoadError(
                    f"a DFlash sliding_window must be a positive integer, got {window!r}"
                )
            )
        kinds = config.get("layer_types")
        if not isinstance(kinds, list) or not kinds:
            start = int(config.get("max_window_layers", count))
            kinds = [
                "sliding_attention"
                if window is not None and i >= start
                else "full_attention"
                for i in range(count)
            ]
        unknown = sorted(
            {str(k) for k in kinds} - {"full_attention", "sliding_attention"}
        )
        if unknown or len(kinds) != count:
            return Failure(
                LoadError(
                    f"DFlash layer_types must name {count} layers, each full_attention "
                    f"or sliding_attention; got {kinds!r}"
                )
            )
        causal = config.get("is_causal")
        attention = tuple(
            (
                kind == "sliding_attention" if causal is None else bool(causal),
                window if kind == "sliding_attention" else None,
            )
            for kind in kinds
        )
        softcap = value("final_logit_softcapping")
        return Success(
            cls(
                tuple(layers),
                block,
                mask,
                attention,
                float(value("input_embedding_scale", 1.0)),
                float(value("output_multiplier", 1.0)),
                float(softcap) if softcap is not None and float(softcap) > 0 else None,
            )
        )


def default_target_layers(target_layers: int, draft_layers: int) -> list[int]:
    """The target layers a DFlash config that names none reads (the
    reference's convention): the middle one for a one-layer draft, else one
    per draft layer spread evenly from layer 1 to layer n - 3."""
    if draft_layers == 1:
        return [target_layers // 2]
    first, last = 1, target_layers - 3
    return [
        round(first + i * (last - first) / (draft_layers - 1))
        for i in range(draft_layers)
    ]


class DFlashAttention(Attention):
    """Queries from the block; keys and values from the cached context and
    the block (`Attention`'s projections, norms and RoPE)."""

    def context(
        self,
        ctx: mx.array,  # [B, N, H] the projected target features
        rope_at: int | mx.array,
    ) -> tuple[mx.array, mx.array]:  # keys, values [B, Hkv, N, D]
        batch, length, _ = ctx.shape
        k = self.k_proj(ctx).reshape(batch, length, self.kv_heads, self.head_dim)
        v = self.v_proj(ctx).reshape(batch, length, self.kv_heads, self.head_dim)
        if self.k_norm is not None:
            k = self.k_norm(k)
        k = self.rope(k.transpose(0, 2, 1, 3), rope_at)
        return k, v.transpose(0, 2, 1, 3)

    def block(
        self,
        x: mx.array,  # [B, L, H]
        keys: mx.array,  # [B, Hkv, S, D] the context's
        values: mx.array,  # [B, Hkv, S, D]
        rope_at: int | mx.array,
        mask: mx.array,  # [B, 1, L, S + L] bool
    ) -> mx.array:  # [B, L, H]
        batch, length, _ = x.shape
        q, k, v = self._project_qkv(x)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q = self.rope(q.transpose(0, 2, 1, 3), rope_at)
        k = self.rope(k.transpose(0, 2, 1, 3), rope_at)
        all_keys = mx.concatenate([keys, k], axis=2)
        all_values = mx.concatenate([values, v.transpose(0, 2, 1, 3)], axis=2)
        out = mx.fast.scaled_dot_product_attention(
            q, all_keys, all_values, scale=self.scale, mask=mask
        )
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(batch, length, -1))


class DFlashLayer(nn.Module):
    def __init__(self, args: DecoderArgs, layer: int) -> None:
        super().__init__()
        spec = BlockSpec(
            qkv_bias=args.attention_bias, o_bias=args.attention_bias, qk_norm=True
        )
        self.self_attn = DFlashAttention(args, layer, spec)
        self.mlp = MLP(args.hidden_size, args.intermediate_size, args.mlp_bias)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(
            args.hidden_size, eps=args.rms_norm_eps
        )

    def __call__(
        self,
        x: mx.array,
        keys: mx.array,
        values: mx.array,
        rope_at: int | mx.array,
        mask: mx.array,
    ) -> mx.array:
        h = x + self.self_attn.block(
            self.input_layernorm(x), keys, values, rope_at, mask
        )
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDraft(nn.Module):
    """The draft's modules, named as its checkpoints name them (`fc`,
    `hidden_norm`, `layers.*`, `norm`); the embedding and the vocabulary
    projection are the target's."""

    def __init__(self, args: DecoderArgs, settings: DFlashSettings) -> None:
        super().__init__()
        self.args = args
        self.settings = settings
        hidden = args.hidden_size
        self.fc = Linear(len(settings.target_layers) * hidden, hidden, bias=False)
        self.hidden_norm = nn.RMSNorm(hidden, eps=args.rms_norm_eps)
        self.layers = [DFlashLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(hidden, eps=args.rms_norm_eps)

    def make_cache(self, batch: int) -> KVCache:
        """The context keys / values of every layer, per row."""
        return KVCache(
            len(self.layers),
            batch,
            self.args.num_key_value_heads,
            self.args.dim_per_head,
            model_dtype(self),
        )

    def write_context(
        self,
        features: mx.array,  # [B, N, n_taps * H] the target's, right-padded
        cache: KVCache,
        offsets: Sequence[int],  # row b's first position
    ) -> None:
        """Store the context keys and values of positions offsets[b] ..
        offsets[b] + N - 1 (a padded row's extra positions lie past its
        context and are masked out until overwritten)."""
        length = features.shape[1]
        if length == 0:
            return
        ctx = self.hidden_norm(self.fc(features))
        rope_at = rope_offset(offsets)
        cache.reserve(max(offsets) + length)
        for i, layer in enumerate(self.layers):
            keys, values = layer.self_attn.context(ctx, rope_at)
            cache.write(i, keys, values, offsets)

    def block_mask(
        self,
        starts: Sequence[int],
        length: int,
        span: int,
        causal: bool,
        window: int | None,
    ) -> mx.array:
        """[B, 1, L, span + L] bool: block query i of row b (at position
        starts[b] + i) sees the row's context positions j < starts[b] and the
        block (all of it, or up to itself when causal), within the window."""
        start = mx.array(list(starts), dtype=mx.int32)[:, None, None, None]
        query = start + mx.arange(length, dtype=mx.int32)[None, None, :, None]
        context = mx.arange(span, dtype=mx.int32)[None, None, None, :]
        sees_context = context < start
        block = start + mx.arange(length, dtype=mx.int32)[None, None, None, :]
        sees_block = mx.broadcast_to(
            block <= query if causal else mx.array(True),
            (len(starts), 1, length, length),
        )
        if window is not None:
            sees_context = sees_context & (query - context < window)
            sees_block = sees_block & (mx.abs(query - block) < window)
        sees_context = mx.broadcast_to(sees_context, (len(starts), 1, length, span))
        return mx.concatenate([sees_context, sees_block], axis=-1)

    def __call__(
        self,
        x: mx.array,  # [B, L, H] the block's embeddings
        cache: KVCache,
        starts: Sequence[int],  # row b's block sits at starts[b] .. + L - 1
    ) -> mx.array:  # [B, L, H] after the draft's norm
        length = x.shape[1]
        cache.reserve(max(starts))
        # on a GPU the context's keys span the whole capacity (a multiple of
        # 256) under the mask: MLX compiles its attention per key length, so
        # a length that grows every round would compile every round
        span = cache.capacity if cache.bucket_windows else max(starts)
        masks = {
            kind: self.block_mask(starts, length, span, *kind)
            for kind in set(self.settings.attention)
        }
        rope_at = rope_offset(starts)
        h = x
        for i, layer in enumerate(self.layers):
            mask = masks[self.settings.attention[i]]
            keys = cache.keys[i][:, :, :span] if span else _empty(cache)
            values = cache.values[i][:, :, :span] if span else _empty(cache)
            h = layer(h, keys, values, rope_at, mask)
        return self.norm(h)

    def logits(self, normed: mx.array, head: HeadWeights) -> mx.array:
        """The target's projection of the draft's output, scaled and capped
        as the config says."""
        out = head.project(normed)
        if self.settings.output_multiplier != 1.0:
            out = out * self.settings.output_multiplier
        cap = self.settings.softcap
        if cap is not None:
            out = mx.tanh(out / cap) * cap
        return out


def _empty(cache: KVCache) -> mx.array:
    return mx.zeros((cache.batch, cache.kv_heads, 0, cache.head_dim), cache.dtype)


def build_dflash(
    args: DecoderArgs,
    settings: DFlashSettings,
    weights: Mapping[str, mx.array],
    dtype: mx.Dtype | None = None,
) -> Result[DFlashDraft, LoadError]:
    """The draft with its checkpoint's weights (all of them, no more; HF
    names, optionally under `model.`), cast to `dtype` where given."""
    draft = DFlashDraft(args, settings)
    names = {k.removeprefix("model."): v for k, v in weights.items()}
    names = {k: v for k, v in names.items() if not k.endswith("rotary_emb.inv_freq")}
    expected = flat_parameters(draft)
    missing = sorted(set(expected) - set(names))
    unexpected = sorted(set(names) - set(expected))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {missing[:6]}")
        if unexpected:
            parts.append(f"unexpected {unexpected[:6]}")
        return Failure(
            LoadError(
                "the DFlash weights do not match its config ("
                + "; ".join(parts)
                + "): is this a DFlash (v1) checkpoint of this config?"
            )
        )
    wrong = [
        f"{k} {tuple(v.shape)} (config: {tuple(expected[k].shape)})"
        for k, v in names.items()
        if tuple(v.shape) != tuple(expected[k].shape)
    ]
    if wrong:
        return Failure(
            LoadError("DFlash weights of the wrong shape: " + "; ".join(wrong[:4]))
        )
    if dtype is not None:
        names = {k: v.astype(dtype) for k, v in names.items()}
    draft.load_weights(list(names.items()))
    mx.eval(draft.parameters())
    return Success(draft)
