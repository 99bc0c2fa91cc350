"""Scoring a text: each token's log-probability given the tokens before it.

What evaluation harnesses ask of a completion endpoint with `echo` (the
log-likelihood of a continuation, and whether it is the greedy one): one
forward over the tokens in chunks, the target's own distribution at each
position, no sampling. The first token has no prefix and so no score.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import mlx.core as mx
from attrs import frozen

from models.base import CausalLM
from specpipe.output import TopLogprobs
from specpipe.sampling import read_top_logprobs, token_scores

# Positions a forward scores at once: its logits are [chunk, V] float32
# (about 155 MB for a 151,936-id vocabulary).
SCORE_CHUNK = 256


@frozen
class TokenScores:
    """`logprobs[i]`: token i's log-probability given tokens `< i` (None for
    the first); `top[i]`: the likeliest tokens at position i, (id, logprob),
    likeliest first (empty for the first, and where none were asked for)."""

    tokens: tuple[int, ...]
    logprobs: tuple[float | None, ...]
    top: tuple[TopLogprobs, ...]


def score_tokens(
    model: CausalLM, tokens: Sequence[int], top: int = 0, chunk: int = SCORE_CHUNK
) -> TokenScores:
    """Score `tokens` (at least one) with `model` from an empty state; `top`
    alternatives a position."""
    ids = list(tokens)
    cache = model.make_cache(1)
    cache.reserve(len(ids))
    logprobs: list[float | None] = [None]
    tops: list[TopLogprobs] = [()]
    for start in range(0, len(ids) - 1, chunk):
        window = ids[start : start + chunk]
        following = ids[start + 1 : start + 1 + chunk]
        out = model(mx.array([window], dtype=mx.int32), cache, [start], prefill=True)
        if out.delta is not None:
            out.delta.commit([len(window)])
        logits = out.logits[0, : len(following)]
        chosen, best = token_scores(logits, mx.array(following, dtype=mx.int32), top)
        mx.eval(cache.arrays(), chosen, *(best or ()))
        logprobs.extend(cast(list[float], chosen.tolist()))
        tops.extend(read_top_logprobs(best) if best else [() for _ in following])
    return TokenScores(tuple(ids), tuple(logprobs), tuple(tops))
