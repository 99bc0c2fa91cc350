"""Token sampling on device, keyed by (seed, step).

Every draw is an inverse-CDF draw in token-id order from ONE uniform that is a
pure function of (seed, step), where step is the index of the generated token:

    u = hash(seed, step) in (0, 1);  token = min{ i : cdf(i) >= u * cdf(V-1) }

so the target at a window position, plain decoding at the same step, and a
draft predicting that position all read the same point of their own CDFs. The
draft and the target then agree far more often than independent draws would
(a coupled draw), and the target's token at a step never depends on what was
drafted: speculation cannot change the output.

The uniform comes from an integer hash evaluated on device (Wellons'
"lowbias32" finaliser, https://nullprogram.com/blog/2018/07/31/), so one call
draws for every row and window position at once, each with its own key.
Filters apply in the order logit bias, repetition, presence and frequency
penalties, temperature, top-k, top-p, min-p; tokens they remove get zero mass.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import cast

import mlx.core as mx

from models.cache import on_gpu
from schemas.request import SamplingParams
from specpipe.output import TopLogprobs

# Whether a GPU draws through `compiled_draw` (benchmarks turn it off to compare).
COMPILE_ON_GPU = True
# Top-k over a row longer than this many ids runs in two stages on a GPU
# (benchmarks set it past any vocabulary to compare with one partition of the
# whole row). It covers FR-Spec lists of 32k ids: their draw inside a compiled
# MTP step on an H200, 128 rows, 0.92 -> 0.80 ms; 1 and 32 rows unchanged
# (bench/step_probe.py, bench/RESULTS.md).
TWO_STAGE_TOP_K_FROM = 16384
_TOP_K_BLOCK = 1024

_M1 = 0x7FEB352D
_M2 = 0x846CA68B


def _mix(x: mx.array) -> mx.array:  # uint32, any shape
    x = x ^ (x >> 16)
    x = x * mx.array(_M1, dtype=mx.uint32)
    x = x ^ (x >> 15)
    x = x * mx.array(_M2, dtype=mx.uint32)
    return x ^ (x >> 16)


def step_uniforms(seeds: mx.array, steps: mx.array) -> mx.array:
    """Uniforms in (0, 1) for keys (seed, step): `[N]` uint32 each -> `[N]` f32."""
    h = _mix(_mix(seeds ^ mx.array(0x9E3779B9, dtype=mx.uint32)) + steps)
    h = _mix(h ^ mx.array(0x85EBCA6B, dtype=mx.uint32))
    return ((h >> 8).astype(mx.float32) + 0.5) * (1.0 / (1 << 24))


def key_arrays(seeds: Sequence[int], steps: Sequence[int]) -> tuple[mx.array, mx.array]:
    return mx.array(list(seeds), dtype=mx.uint32), mx.array(
        list(steps), dtype=mx.uint32
    )


def apply_repetition_penalty(
    logits: mx.array,  # [N, V] f32
    history: mx.array,  # [N, C] int32
    penalty: float,
) -> mx.array:
    picked = mx.take_along_axis(logits, history, axis=-1)
    picked = mx.where(picked > 0, picked / penalty, picked * penalty)
    return mx.put_along_axis(logits, history, picked, axis=-1)


def apply_penalties(
    logits: mx.array,  # [N, V] f32
    history: mx.array,  # [N, C] int32, oldest first; -1: no token (a short context)
    params: SamplingParams,
) -> mx.array:
    """`logits` with the penalties of `params` that are on (repetition,
    presence, frequency, in that order), each over its own context: the last
    `*_context` entries of `history`. Its newest entry must be a token."""
    n, width = history.shape
    real = history >= 0
    # a missing entry reads the newest token (whose penalty it then repeats,
    # a no-op) and counts nothing
    ids = mx.where(real, history, history[:, -1:])
    out = logits
    for kind, penalty, context in params.history_windows:
        span = min(width, context)
        window = ids[:, width - span :]
        if kind == "repetition":
            out = apply_repetition_penalty(out, window, penalty)
            continue
        weights = real[:, width - span :].astype(out.dtype)
        rows = mx.broadcast_to(mx.arange(n)[:, None], window.shape)
        counts = mx.zeros_like(out).at[rows, window].add(weights)
        amount = counts if kind == "frequency" else (counts > 0).astype(out.dtype)
        out = out - penalty * amount
    return out


def filtered_probs(logits: mx.array, params: SamplingParams) -> mx.array:
    """`[N, V]` logits (f32, already penalised) -> `[N, V]` unnormalised
    probabilities with the top-k / top-p / min-p filters applied.

    With top-k on, top-p reads only the k kept probabilities (one partition of
    the vocabulary instead of a partition and a full sort): every other
    probability is zero, so the k largest, in descending order, are the
    prefix of the full sorted row and give the same cutoff."""
    scaled = logits * (1.0 / params.temperature)
    vocab = scaled.shape[-1]
    top: mx.array | None = None  # [N, k] ids of the k largest scores
    if 0 < params.top_k < vocab:
        top = top_k_ids(scaled, params.top_k)
        kth = mx.min(mx.take_along_axis(scaled, top, axis=-1), axis=-1, keepdims=True)
        scaled = mx.where(scaled < kth, -mx.inf, scaled)
    probs = mx.softmax(scaled, axis=-1)
    if params.top_p < 1.0:
        candidates = probs if top is None else mx.take_along_axis(probs, top, axis=-1)
        ordered = -mx.sort(-candidates, axis=-1)
        before = mx.cumsum(ordered, axis=-1) - ordered
        # The smallest kept probability: tokens whose preceding mass is < top_p.
        kept = mx.where(before < params.top_p, ordered, mx.inf)
        cutoff = mx.min(kept, axis=-1, keepdims=True)
        probs = mx.where(probs < cutoff, 0.0, probs)
    if params.min_p > 0.0:
        top_prob = mx.max(probs, axis=-1, keepdims=True)
        probs = mx.where(probs < params.min_p * top_prob, 0.0, probs)
    return probs


def top_k_ids(scores: mx.array, k: int) -> mx.array:
    """`[N, V]` scores -> `[N, k]` ids of the k largest scores (in no order;
    among ties at the k-th value, any). On a GPU, where a partition is a sort,
    a long row goes through `blockwise_top_k`; on the CPU (a linear-time
    partition, measured faster whole) through one partition."""
    vocab = scores.shape[-1]
    if on_gpu() and vocab > max(TWO_STAGE_TOP_K_FROM, 4 * k):
        return blockwise_top_k(scores, k)
    return mx.argpartition(-scores, k - 1, axis=-1)[:, :k]


def blockwise_top_k(scores: mx.array, k: int, block: int = _TOP_K_BLOCK) -> mx.array:
    """`top_k_ids` in two stages: the k largest of each block of `block` ids,
    then the k largest of those candidates. The k largest of the row are among
    its blocks' k largest, so the k-th largest value and the multiset of the k
    values (all the filters read) are those one partition of the whole row
    gives."""
    n, vocab = scores.shape
    blocks = -(-vocab // block)
    padded = scores
    if blocks * block != vocab:
        pad = mx.full((n, blocks * block - vocab), -mx.inf, dtype=scores.dtype)
        padded = mx.concatenate([scores, pad], axis=-1)
    width = min(k, block)
    tiled = padded.reshape(n, blocks, block)
    local = mx.argpartition(-tiled, width - 1, axis=-1)[:, :, :width]
    ids = (local + (mx.arange(blocks) * block)[None, :, None]).reshape(n, -1)
    values = mx.take_along_axis(padded, ids, axis=-1)  # [N, blocks * width]
    best = mx.argpartition(-values, k - 1, axis=-1)[:, :k]
    return mx.take_along_axis(ids, best, axis=-1)


def read_top_logprobs(top: tuple[mx.array, mx.array]) -> list[TopLogprobs]:
    """`top_logprobs`'s arrays read to the host (a synchronisation point):
    a row's alternatives each, as (id, logprob) pairs."""
    ids = cast(list[list[int]], top[0].tolist())
    values = cast(list[list[float]], top[1].tolist())
    return [tuple(zip(i, v, strict=True)) for i, v in zip(ids, values, strict=True)]


def inverse_cdf(probs: mx.array, uniforms: mx.array) -> mx.array:
    """`[N, V]` non-negative mass, `[N]` uniforms -> `[N]` int32 token ids."""
    cdf = mx.cumsum(probs, axis=-1)
    target = uniforms[:, None] * cdf[:, -1:]
    index = mx.sum(cdf < target, axis=-1).astype(mx.int32)
    return mx.minimum(index, probs.shape[-1] - 1)


def sample(
    logits: mx.array,  # [N, V]
    params: SamplingParams,
    seeds: mx.array,  # [N] uint32
    steps: mx.array,  # [N] uint32
    history: mx.array | None = None,  # [N, C] int32 (`apply_penalties`), for penalties
) -> mx.array:
    """One token per row, `[N]` int32, from `[N, V]` logits."""
    scores = logits.astype(mx.float32)
    if params.logit_bias:
        ids, values = zip(*params.logit_bias, strict=True)
        scores = scores.at[:, mx.array(ids, dtype=mx.int32)].add(
            mx.array(values, dtype=mx.float32)
        )
    if params.needs_history:
        assert history is not None, "a penalty needs the token history"
        scores = apply_penalties(scores, history, params)
    filters = draw_filters(params)  # the bias and penalties are in `scores` now
    if not params.greedy and COMPILE_ON_GPU and on_gpu():
        return compiled_draw(filters)(scores, seeds, steps)
    return draw(scores, filters, seeds, steps)


def draw(
    logits: mx.array,  # [N, V]
    params: SamplingParams,
    seeds: mx.array,  # [N] uint32
    steps: mx.array,  # [N] uint32
) -> mx.array:  # [N] int32
    """`sample` without a token history and without `compiled_draw`: the draw
    a function that is itself compiled traces (specpipe/drafts/mtp.py)."""
    assert not (params.needs_history or params.logit_bias), "penalties need `sample`"
    scores = logits.astype(mx.float32)
    if params.greedy:
        return mx.argmax(scores, axis=-1).astype(mx.int32)
    return _draw(scores, seeds, steps, params)


def _draw(
    scores: mx.array, seeds: mx.array, steps: mx.array, params: SamplingParams
) -> mx.array:
    return inverse_cdf(filtered_probs(scores, params), step_uniforms(seeds, steps))


def draw_filters(params: SamplingParams) -> SamplingParams:
    """What the draw depends on (the seed travels in `seeds`)."""
    return SamplingParams(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        min_p=params.min_p,
    )


@functools.lru_cache(maxsize=64)
def compiled_draw(
    params: SamplingParams,
) -> Callable[[mx.array, mx.array, mx.array], mx.array]:
    """The filtered inverse-CDF draw for `params` as one compiled function
    (used on a GPU): the element-wise passes over the vocabulary fuse into
    fewer kernels. On an H200 a draw of Qwen's sampling over a 151,936-id row
    took 0.79 ms eagerly and 0.43 ms compiled, over a 32,768-id FR-Spec list
    0.54 / 0.27 ms (bench/sampling_probe.py), with the same tokens; the CPU,
    where kernels launch for free, keeps the eager draw."""
    return mx.compile(lambda scores, seeds, steps: _draw(scores, seeds, steps, params))


def token_logprobs(
    logits: mx.array,  # [N, V]
    tokens: mx.array,  # [N] int32
) -> mx.array:
    """The model's own log-probability of each chosen token, `[N]` f32."""
    return token_scores(logits, tokens, 0)[0]


def top_logprobs(
    logits: mx.array,  # [N, V]
    k: int,
) -> tuple[mx.array, mx.array]:
    """The k most likely tokens of each row by the model's own distribution:
    ids `[N, k]` int32 and their log-probabilities `[N, k]` f32, most likely
    first (equal values in any order, as `top_k_ids` takes them)."""
    scores = logits.astype(mx.float32)
    return _top(scores, mx.logsumexp(scores, axis=-1, keepdims=True), k)


def token_scores(
    logits: mx.array,  # [N, V]
    tokens: mx.array,  # [N] int32
    k: int,
) -> tuple[mx.array, tuple[mx.array, mx.array] | None]:
    """`token_logprobs` and, with k > 0, `top_logprobs`, from one
    normalisation of the row (the same values each gives alone)."""
    scores = logits.astype(mx.float32)
    norm = mx.logsumexp(scores, axis=-1, keepdims=True)  # [N, 1]
    chosen = mx.take_along_axis(scores, tokens[:, None], axis=-1) - norm
    return chosen[:, 0], _top(scores, norm, k) if k else None


def _top(scores: mx.array, norm: mx.array, k: int) -> tuple[mx.array, mx.array]:
    if k < scores.shape[-1]:
        ids = top_k_ids(scores, k)
    else:
        ids = mx.broadcast_to(mx.arange(scores.shape[-1], dtype=mx.int32), scores.shape)
    values = mx.take_along_axis(scores, ids, axis=-1)
    order = mx.argsort(-values, axis=-1)
    ids = mx.take_along_axis(ids, order, axis=-1).astype(mx.int32)
    return ids, mx.take_along_axis(values, order, axis=-1) - norm
