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

DFlash2 adds, per layer, grouped dynamic causal convolutions over the
block's positions around the attention and around the MLP (`DynamicConv`),
and a candidate selector that rescores each position's top-k logits against
the token drafted before it (`CandidateSelector`), the drafts chosen in order.

The context keys and values of a layer depend only on the target's features,
never on the block, so each position's are computed once, when it is
committed, and kept in the draft's own KV cache (`write_context`); a round's
block keys and values are never stored. References: z-lab/dflash
`dflash/model.py` (`DFlashDraftModel`, `Qwen3DFlashAttention`,
`DFlash2DraftModel`); vLLM's `dflash.py`.

A float checkpoint's big projections can be quantized at load (MLX affine,
groups of 64: `quantize_projections`); a DFlash2 draft's are, to 4 bits, by
default on a GPU (`default_bits`), as the reference engine loads them. The
draft only proposes, so this changes acceptance and speed, never the
output. A checkpoint that holds quantized layers loads them as they are.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, TypeVar

import mlx.core as mx
import mlx.nn as nn
from attrs import frozen
from returns.result import Failure, Result, Success

from models.base import rope_offset
from models.build import quantize_layers, quantized_layers, row_major
from models.cache import KVCache
from models.layers import (
    MLP,
    Attention,
    BlockSpec,
    PreNormLayer,
    decoder_cache,
    flat_parameters,
)
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
    # DFlash2: each layer's grouped dynamic causal convolutions around its
    # attention and its MLP (kernel size, channels per group), and the
    # candidate selector (codebook rank, candidates per position)
    conv: tuple[int, int] | None = None
    selector: tuple[int, int] | None = None

    @property
    def second(self) -> bool:
        """Whether this is a DFlash2 draft (convolutions and selector)."""
        return self.conv is not None

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
        extras = [value(k) for k in _SECOND]
        if any(e is not None for e in extras) and not all(
            isinstance(e, int) and e > 0 for e in extras
        ):
            return Failure(
                LoadError(
                    "a DFlash2 config needs positive integers "
                    + ", ".join(
                        f"{k}={v!r}" for k, v in zip(_SECOND, extras, strict=True)
                    )
                )
            )
        kernel, group, rank, top = extras
        hidden = config.get("hidden_size")
        if kernel is not None and isinstance(hidden, int) and hidden % group:
            return Failure(
                LoadError(
                    f"a DFlash2 conv_group_size ({group}) must divide hidden_size ({hidden})"
                )
            )
        try:
            scale = float(value("input_embedding_scale", 1.0))
            multiplier = float(value("output_multiplier", 1.0))
            cap = None if softcap is None or float(softcap) <= 0 else float(softcap)
        except (TypeError, ValueError):
            return Failure(
                LoadError(
                    "a DFlash config's input_embedding_scale, output_multiplier and "
                    "final_logit_softcapping must be numbers"
                )
            )
        return Success(
            cls(
                tuple(layers),
                block,
                mask,
                attention,
                scale,
                multiplier,
                cap,
                None if kernel is None else (kernel, group),
                None if rank is None else (rank, top),
            )
        )


_SECOND = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


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


class DynamicConv(nn.Module):
    """DFlash2's grouped dynamic causal convolution over a block's positions:
    out[t] = sum over o < K of (base[o] + dynamic[t, o]) * x[t - o] (0 before
    the block), one dynamic weight per group of channels, from a projection
    of the layer's normed input (`prepare`: the kernels of both the input's
    and the sublayer output's convolution)."""

    def __init__(self, hidden: int, kernel: int, group: int) -> None:
        super().__init__()
        self.kernel = kernel
        self.group = group
        self.groups = hidden // group
        self.base_kernel = mx.zeros((2, kernel, hidden))
        self.kernel_projection = Linear(hidden, 2 * kernel * self.groups, bias=False)

    def _convolve(self, x: mx.array, dynamic: mx.array, base: mx.array) -> mx.array:
        batch, length, hidden = x.shape  # dynamic [B, L, K, groups], base [K, H]
        blocks = x.reshape(batch, length, self.groups, self.group)
        out = mx.zeros_like(blocks)
        for offset in range(self.kernel):
            shifted = blocks
            if offset:
                pad = mx.zeros(
                    (batch, min(offset, length), self.groups, self.group), x.dtype
                )
                kept = blocks[:, : max(0, length - offset)]
                shifted = mx.concatenate([pad, kept], axis=1)
            weight = base[offset].reshape(1, 1, self.groups, self.group)
            out = out + weight * shifted + dynamic[:, :, offset, :, None] * shifted
        return out.reshape(batch, length, hidden)

    def prepare(self, x: mx.array) -> tuple[mx.array, mx.array]:
        batch, length, _ = x.shape
        dynamic = self.kernel_projection(x).reshape(
            batch, length, 2, self.kernel, self.groups
        )
        base = self.base_kernel.astype(x.dtype)
        return self._convolve(x, dynamic[:, :, 0], base[0]), dynamic[:, :, 1]

    def finish(self, x: mx.array, dynamic: mx.array) -> mx.array:
        return self._convolve(x, dynamic, self.base_kernel[1].astype(x.dtype))


class CandidateSelector(nn.Module):
    """DFlash2's selector: each draft position's top-k candidates rescored by
    a bilinear term of the previous drafted token and the candidate,
    conditioned on the position's hidden state, chosen in order (`scores`)."""

    def __init__(self, hidden: int, vocab: int, rank: int, top: int) -> None:
        super().__init__()
        self.top = top
        self.predecessor_codebook = nn.Embedding(vocab, rank)
        self.successor_codebook = nn.Embedding(vocab, rank)
        self.hidden_projection = Linear(hidden, rank, bias=False)

    def candidates(self, logits: mx.array) -> tuple[mx.array, mx.array]:
        """[B, D, k] candidate ids (the k best logits of each position, in
        no particular order) and their logits."""
        ids = mx.argpartition(-logits, self.top - 1, axis=-1)[..., : self.top]
        return ids, mx.take_along_axis(logits, ids, axis=-1)

    def scores(
        self,
        projected: mx.array,  # [B, r] the position's hidden_projection
        predecessor: mx.array,  # [B] the token drafted before the position
        ids: mx.array,  # [B, k] the position's candidates
        unary: mx.array,  # [B, k] their logits
    ) -> mx.array:  # [B, k]
        query = self.predecessor_codebook(predecessor) * projected  # [B, r]
        keys = self.successor_codebook(ids)  # [B, k, r]
        return unary + (keys @ query[:, :, None])[..., 0]


class ContextAttention(Protocol):
    def context(
        self, ctx: mx.array, rope_at: int | mx.array
    ) -> tuple[mx.array, mx.array]: ...


class DraftLayer(Protocol):
    """What a draft's layer offers `DFlashDraft` (`DFlashLayer`'s interface):
    its attention's context keys / values, and a forward of the block over
    the context's keys and values."""

    @property
    def self_attn(self) -> ContextAttention: ...

    def __call__(
        self,
        x: mx.array,  # [B, L, H]
        keys: mx.array,  # [B, Hkv, S, D]
        values: mx.array,  # [B, Hkv, S, D]
        rope_at: int | mx.array,
        mask: mx.array,  # [B, 1, L, S + L] bool
    ) -> mx.array: ...


class DFlashLayer(PreNormLayer):
    def __init__(
        self, args: DecoderArgs, layer: int, conv: tuple[int, int] | None = None
    ) -> None:
        super().__init__(args.hidden_size, args.rms_norm_eps)
        spec = BlockSpec(
            qkv_bias=args.attention_bias, o_bias=args.attention_bias, qk_norm=True
        )
        self.self_attn = DFlashAttention(args, layer, spec)
        self.mlp = MLP(args.hidden_size, args.intermediate_size, args.mlp_bias)
        self.convolved = conv is not None
        if conv is not None:
            self.attention_conv = DynamicConv(args.hidden_size, *conv)
            self.mlp_conv = DynamicConv(args.hidden_size, *conv)

    def __call__(
        self,
        x: mx.array,
        keys: mx.array,
        values: mx.array,
        rope_at: int | mx.array,
        mask: mx.array,
    ) -> mx.array:
        if not self.convolved:
            return self.residual(
                x,
                lambda n: self.self_attn.block(n, keys, values, rope_at, mask),
                self.mlp,
            )
        normed, after = self.attention_conv.prepare(self.input_layernorm(x))
        attended = self.self_attn.block(normed, keys, values, rope_at, mask)
        h = x + self.attention_conv.finish(attended, after)
        normed, after = self.mlp_conv.prepare(self.post_attention_layernorm(h))
        return h + self.mlp_conv.finish(self.mlp(normed), after)


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
        self.layers = [self.make_layer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(hidden, eps=args.rms_norm_eps)
        if settings.selector is not None:
            self.candidate_selector = CandidateSelector(
                hidden, args.vocab_size, *settings.selector
            )

    def make_layer(self, args: DecoderArgs, index: int) -> DraftLayer:
        """Draft layer `index` (a subclass's own: DSpark's Gemma-4 layers)."""
        return DFlashLayer(args, index, self.settings.conv)

    @property
    def family(self) -> str:
        """The drafter family these modules are (its prompt-cache namespace's
        first part)."""
        return "dflash2" if self.settings.second else "dflash"

    @property
    def quantized_bits(self) -> tuple[int, ...]:
        """The bit widths its quantized layers hold, ascending (none: float)."""
        return tuple(
            sorted(
                {
                    int(layer.bits)
                    for _, layer in self.named_modules()
                    if isinstance(layer, nn.QuantizedLinear | nn.QuantizedEmbedding)
                }
            )
        )

    def make_cache(self, batch: int) -> KVCache:
        """The context keys / values of every layer, per row."""
        return decoder_cache(self, self.args, len(self.layers), batch)

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


# A draft's projection bits at load (`--draft-bits`): MLX affine 4 or 8
# bits, or 16, float (the checkpoint's dtype, or the one asked for)
DRAFT_BITS = (4, 8, 16)
FLOAT_BITS = 16
QUANTIZED_GROUP_SIZE = 64
# The layers `quantize_projections` quantizes (by their last name): the
# attention and MLP projections of every layer and the context's `fc`, all
# but ~10 % of a DFlash2 draft's weights. Float stay the norms, the dynamic
# convolutions' base kernels and kernel projections (small, and their
# outputs are kernel weights that multiply the block's activations), the
# selector's hidden projection (rank-sized) and its codebooks (embeddings,
# whose rows rescore candidates whose logits are close by construction).
_QUANTIZED = frozenset(
    {"fc", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
)


def default_bits(settings: DFlashSettings, gpu: bool) -> int:
    """The bits a float checkpoint's projections load at unless asked: 4
    for a DFlash2 draft on a GPU (as the reference engine loads z-lab's:
    1.36 GB resident here for a 3.85 GB bf16 checkpoint), float on the CPU,
    where MLX's quantized products are the slow path (a 4-bit block forward
    of that draft took 67.6 s against 0.50 s in bf16 on the 2-core machine,
    bench/RESULTS.md); float for a DFlash (v1) draft, as before."""
    return 4 if settings.second and gpu else FLOAT_BITS


def bits_problem(bits: int) -> str | None:
    """Why `bits` is not a draft's projection bits, or None."""
    if bits in DRAFT_BITS:
        return None
    return (
        f"draft bits must be 4 or 8 (MLX affine quantization, groups of "
        f"{QUANTIZED_GROUP_SIZE}) or 16 (float, unquantized), got {bits}"
    )


def quantize_projections(draft: DFlashDraft, bits: int) -> DFlashDraft:
    """The draft, its float projections (`_QUANTIZED`, each whose input
    width is a multiple of the group size) quantized in place to `bits` (4
    or 8), MLX affine in groups of `QUANTIZED_GROUP_SIZE`."""
    quantize_layers(
        draft,
        bits,
        QUANTIZED_GROUP_SIZE,
        where=lambda path, _layer: path.rsplit(".", 1)[-1] in _QUANTIZED,
    )
    mx.eval(draft.parameters())
    return draft


def build_dflash(
    args: DecoderArgs,
    settings: DFlashSettings,
    weights: Mapping[str, mx.array],
    dtype: mx.Dtype | None = None,
    bits: int | None = None,
) -> Result[DFlashDraft, LoadError]:
    """The draft with its checkpoint's weights (all of them, no more; HF
    names, optionally under `model.`), float ones cast to `dtype` where
    given. Layers the checkpoint holds quantized (`.scales` beside a packed
    `.weight`) load quantized, bits and group size read from the packed
    shapes. `bits`: None loads the weights as they are; 4 or 8 quantizes a
    float checkpoint's projections (`quantize_projections`), 16 keeps them
    float; a quantized checkpoint's must already be `bits`."""
    if bits is not None and (problem := bits_problem(bits)) is not None:
        return Failure(LoadError(problem))
    draft = DFlashDraft(args, settings)
    names = {k.removeprefix("model."): v for k, v in weights.items()}
    for codebook in ("predecessor_codebook", "successor_codebook"):  # (DFlash2's
        bare = f"candidate_selector.{codebook}"  # checkpoints drop ".weight")
        if bare in names:
            names[bare + ".weight"] = names.pop(bare)
    held, problems = quantized_layers(draft, names)
    if problems:
        return Failure(LoadError("the DFlash weights' quantization: " + problems[0]))
    if held:
        found = sorted({int(s["bits"]) for s in held.values()})
        if bits is not None and found != [bits]:
            return Failure(
                LoadError(
                    f"the DFlash checkpoint holds layers quantized to "
                    f"{'/'.join(map(str, found))} bits, which load as they are; "
                    f"{bits} bits were asked for"
                )
            )
        nn.quantize(draft, class_predicate=lambda path, _m: held.get(path, False))
    loaded = load_exact(
        draft,
        names,
        "DFlash",
        "is this a DFlash (v1) checkpoint of this config?",
        dtype,
    )
    if bits is None or bits == FLOAT_BITS or held:
        return loaded
    return loaded.map(lambda module: quantize_projections(module, bits))


M = TypeVar("M", bound=nn.Module)


def load_exact(
    module: M,
    names: Mapping[str, mx.array],
    what: str,
    hint: str,
    dtype: mx.Dtype | None = None,
) -> Result[M, LoadError]:
    """`module` with exactly these weights (every parameter, no more, each of
    its shape; RoPE's stored inverse frequencies dropped), cast to `dtype`
    where given; `what` names the draft in errors, `hint` ends a mismatch's."""
    names = {k: v for k, v in names.items() if not k.endswith("rotary_emb.inv_freq")}
    expected = flat_parameters(module)
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
                f"the {what} weights do not match its config ("
                + "; ".join(parts)
                + f"): {hint}"
            )
        )
    wrong = [
        f"{k} {tuple(v.shape)} (config: {tuple(expected[k].shape)})"
        for k, v in names.items()
        if tuple(v.shape) != tuple(expected[k].shape)
    ]
    if wrong:
        return Failure(
            LoadError(f"{what} weights of the wrong shape: " + "; ".join(wrong[:4]))
        )
    if dtype is not None:  # (a quantized layer's packed weight stays as it is)
        names = {
            k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v
            for k, v in names.items()
        }
    module.load_weights(list(row_major(names).items()))
    mx.eval(module.parameters())
    return Success(module)
