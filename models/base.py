"""What every model module shares: the forward's output record, the model
protocol the pipeline binds to, attention masks for per-row offsets, RoPE.

A forward takes ids `[B, L]` and each row's start position (`offsets`, host
ints). Rows may sit at different positions (rows accept different numbers of
drafts); the mask and RoPE then take per-row offsets. When every row starts at
the same position the fast paths apply: no mask for one token, MLX's causal
mask for a window.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, TypeVar, cast

import mlx.core as mx
import mlx.nn as nn
from attrs import frozen

from models.vocab_head import HeadWeights
from schemas.hf import DecoderArgs, RopeConfig

# the float dtypes a checkpoint's weights come in, by config.json's
# `torch_dtype` name (and `--dtype`'s)
FLOAT_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


class StateDelta(Protocol):
    """States a window produced for layers that cannot roll back by position
    (recurrent layers): one per window position, none of them adopted yet."""

    def commit(self, kept: Sequence[int]) -> None:
        """Adopt, for row b, the state after its first `kept[b]` window
        positions (0 keeps the state from before the window)."""
        ...


@frozen
class ModelOutput:
    logits: mx.array  # [B, L, V]
    hidden: mx.array  # [B, L, H], the last layer's output before the final norm
    # None for attention-only graphs: their KV needs no commit (see models/cache.py)
    delta: StateDelta | None = None
    # [B, L] the tokens a speculative round drew from `logits` (set by the
    # round, not the model): drafters that derive their next inputs on the
    # device read them
    draws: mx.array | None = None
    # [B, L, n * H]: the outputs of the layers the model taps (`taps`, set by
    # a draft binding that reads them: DFlash), concatenated in tap order;
    # None where it taps none
    features: mx.array | None = None


class ModelCache(Protocol):
    """A model's per-row state storage (KV arena, recurrent states, ...)."""

    def reserve(self, end: int) -> None: ...

    def arrays(self) -> list[mx.array]: ...

    def take_rows(self, rows: Sequence[int], end: int | None = None) -> ModelCache:
        """A copy holding the given rows, in that order; `end`: only their
        first `end` positions are wanted (storage past them may be left out)."""
        ...

    @property
    def truncatable(self) -> bool:
        """Whether a row's state after its first n positions is this one cut
        to n (attention only), so a prompt-cache checkpoint serves prompts
        that share only a prefix of its tokens."""
        ...


class Tapping:
    """A model whose forwards can also return some layers' outputs
    (`ModelOutput.features`), as a draft binding that reads them asks
    (`tap`): DFlash drafts read the target's hidden states of several layers."""

    args: DecoderArgs

    @property
    def taps(self) -> tuple[int, ...]:
        """The layers whose outputs a forward returns as `ModelOutput.features`."""
        return cast(tuple[int, ...], self.__dict__.get("_taps", ()))

    def tap(self, layers: Sequence[int]) -> None:
        """Return the outputs of `layers` (indices into the decoder layers)
        with every forward from now on (() for none)."""
        n = self.args.num_hidden_layers
        bad = [i for i in layers if not 0 <= i < n]
        if bad:
            raise ValueError(f"layers {bad} are not among the model's {n} layers")
        # an instance attribute, not a module child: no parameter of the model
        object.__setattr__(self, "_taps", tuple(layers))

    def tap_also(self, layers: Sequence[int]) -> None:
        """Tap `layers` as well as the layers tapped already (their order
        kept, new ones after them): every draft bound to this model reads
        its own layers' columns of the features (`tapped_columns`)."""
        self.tap(tuple(dict.fromkeys((*self.taps, *layers))))

    @staticmethod
    def features(outputs: Sequence[mx.array]) -> mx.array | None:
        """The tapped layers' outputs as one array [B, L, n * H] (None: none)."""
        return mx.concatenate(list(outputs), axis=-1) if outputs else None


def tapped_columns(
    taps: Sequence[int], layers: Sequence[int], features: mx.array
) -> mx.array:
    """The outputs of `layers` (in their order) from a forward's `features`,
    which hold the outputs of `taps` (the model's, in its order) side by side.
    Raises ValueError naming the layers the model does not tap."""
    taps, layers = tuple(taps), tuple(layers)
    if taps == layers:
        return features
    missing = [layer for layer in layers if layer not in taps]
    if missing or not taps or features.shape[-1] % len(taps):
        raise ValueError(
            f"the draft reads layers {missing or list(layers)}, which the target's "
            f"forward does not return (it taps {list(taps)}; its taps were changed "
            "after binding)"
        )
    width = features.shape[-1] // len(taps)
    at = [taps.index(layer) for layer in layers]
    return mx.concatenate([features[..., i * width : (i + 1) * width] for i in at], -1)


class CausalLM(Protocol):
    """The graph a pipeline drives. Implemented by every module in `models/`.

    `padding_safe` says whether rows of different lengths may be prefilled
    right-padded in one batch (attention: padded positions are overwritten
    later; recurrent layers would fold the padding into their state).
    """

    args: DecoderArgs
    padding_safe: bool

    def __call__(
        self,
        ids: mx.array,
        cache: Any,
        offsets: Sequence[int],
        *,
        prefill: bool = False,
    ) -> ModelOutput:
        """The window `ids` at each row's offset. `prefill`: every row keeps
        the whole window (a prefill chunk), so recurrent layers need only the
        state after its last position, not one per position (a verify
        window's commit may keep any prefix)."""
        ...

    def make_cache(self, batch: int) -> Any: ...

    def parameters(self) -> dict[str, Any]:
        """Its weights as a tree (every model is an `nn.Module`)."""
        ...

    def embed(self, ids: mx.array) -> mx.array: ...

    def lm_head(self, hidden: mx.array) -> mx.array:
        """Final norm + vocabulary projection: `[..., H]` -> `[..., V]`."""
        ...

    def final_norm(self, hidden: mx.array) -> mx.array: ...

    def head_weights(self) -> HeadWeights:
        """The vocabulary projection as arrays (for subset heads, FR-Spec)."""
        ...


Mask = mx.array | str | None


_Args = TypeVar("_Args", bound=DecoderArgs)


def args_as(args: DecoderArgs, kind: type[_Args], model: str) -> _Args:
    """A model's `args` (the protocol's type) as the record `kind` it is built
    on; `model` names it in the assertion."""
    assert isinstance(args, kind), f"{model} runs on {kind.__name__}"
    return args


def refuse(problem: str | None) -> None:
    """Raises `ValueError(problem)` where a config has one (its layout
    checker's: what the model cannot run, said with the values)."""
    if problem is not None:
        raise ValueError(problem)


def attention_mask(
    offsets: Sequence[int], length: int, span: int | None = None
) -> Mask:
    """The mask for a window of `length` queries at per-row `offsets`.

    Query i of row b sits at position offsets[b] + i and may see keys
    j <= offsets[b] + i. Returns None (one query per row, equal offsets),
    "causal" (equal offsets), or a boolean `[B, 1, L, S]` array; S is `span`
    when the keys extend past max(offsets) + length (see KVCache.key_span).
    """
    first = offsets[0]
    natural = max(offsets) + length
    if (span is None or span == natural) and all(o == first for o in offsets):
        return None if length == 1 else "causal"
    span = natural if span is None else span
    starts = mx.array(list(offsets), dtype=mx.int32)[:, None, None, None]
    query = mx.arange(length, dtype=mx.int32)[None, None, :, None]
    key = mx.arange(span, dtype=mx.int32)[None, None, None, :]
    return key <= starts + query


def rope_offset(offsets: Sequence[int]) -> int | mx.array:
    first = offsets[0]
    if all(o == first for o in offsets):
        return first
    return mx.array(list(offsets), dtype=mx.int32)


class RoPE(nn.Module):
    """Rotary embedding with default / linear / llama3 frequency schedules."""

    def __init__(self, dims: int, config: RopeConfig) -> None:
        super().__init__()
        self.dims = dims
        self.traditional = config.traditional
        self.base: float | None = config.theta
        self.scale = 1.0
        self._freqs: mx.array | None = None
        if config.rope_type == "linear":
            self.scale = 1.0 / config.factor
        elif config.rope_type == "llama3":
            self._freqs = _llama3_freqs(dims, config)
            self.base = None
        elif config.rope_type not in ("default",):
            raise ValueError(f"unsupported rope_type {config.rope_type!r}")

    def __call__(self, x: mx.array, offset: int | mx.array) -> mx.array:
        return mx.fast.rope(
            x,
            self.dims,
            traditional=self.traditional,
            base=self.base,
            scale=self.scale,
            offset=offset,
            freqs=self._freqs,
        )


def _llama3_freqs(dims: int, config: RopeConfig) -> mx.array:
    # https://github.com/meta-llama/llama-models (apply_scaling): wavelengths
    # longer than low_freq_wavelen are divided by `factor`, shorter than
    # high_freq_wavelen kept, and the band between interpolated smoothly.
    freqs = config.theta ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)
    old = config.original_max_position_embeddings
    low_wavelen = old / config.low_freq_factor
    high_wavelen = old / config.high_freq_factor
    wavelens = 2 * mx.pi * freqs
    freqs = mx.where(wavelens > low_wavelen, freqs * config.factor, freqs)
    is_medium = (wavelens > high_wavelen) & (wavelens < low_wavelen)
    smooth = (old / wavelens - config.low_freq_factor) / (
        config.high_freq_factor - config.low_freq_factor
    )
    smoothed = freqs / ((1 - smooth) / config.factor + smooth)
    return mx.where(is_medium, smoothed, freqs)


class StackLayer(Protocol):
    """A decoder layer as `run_stack` calls it."""

    def __call__(
        self,
        x: mx.array,
        cache: Any,
        offsets: Sequence[int],
        mask: Any,
        rope_at: int | mx.array,
    ) -> mx.array: ...


def run_stack(
    embed_tokens: Any,
    layers: Sequence[StackLayer],
    ids: mx.array,  # [B, L] int32
    cache: Any,  # a KVCache
    offsets: Sequence[int],
    taps: Sequence[int] = (),
    tapped: list[mx.array] | None = None,
) -> mx.array:  # [B, L, H], before the final norm
    """An attention-only decoder's layers over a window at each row's offset:
    the last layer's output; the outputs of layers `taps` appended to
    `tapped` in that order."""
    batch, length = ids.shape
    assert len(offsets) == batch, "one offset per row"
    cache.reserve(max(offsets) + length)
    mask = attention_mask(offsets, length, cache.key_span(offsets, length))
    rope_at = rope_offset(offsets)
    h: mx.array = embed_tokens(ids)
    outputs: dict[int, mx.array] = {}
    for i, layer in enumerate(layers):
        h = layer(h, cache, offsets, mask, rope_at)
        if i in taps:
            outputs[i] = h
    if tapped is not None:
        tapped.extend(outputs[i] for i in taps)
    return h
