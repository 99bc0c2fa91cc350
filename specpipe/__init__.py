"""specpipe: lossless speculative decoding for MLX.

Vocabulary (used everywhere, and only these words):

- row: one request inside a batch; rows advance together, each with its own state.
- pending token: the last sampled, not yet processed token of a row.
- round: one draft/verify/commit cycle. depth: draft tokens asked per row.
- window: [pending, d1..dk], the ids the target verifies, shape [B, k+1].
- step key: the random key of (seed, step); step = index of the generated token.
- accepted: drafts equal to the target's own sample at that position.
- correction: the target's sample at the first mismatch; bonus: its sample
  after a fully accepted window.
- prepared change: a value with commit() and dispose(), used exactly once.
- checkpoint: a row's state captured for the prompt cache, under a draft namespace.
- tap layers: target layers whose hidden states a drafter reads.
- companion: a drafter artifact bundled beside a target (e.g. mtp/).

The stages of a round are draft -> verify -> sample_window -> walk -> commit
(one module each); `loop` composes them and is the only module that reads
values back from the device.
"""

from models.blas import route_blas
from specpipe.api import (
    Arrival,
    Conversation,
    GenerationResult,
    GenerationStats,
    Pipeline,
    load,
)
from specpipe.prompt_cache import PromptCache

route_blas()  # models/__init__ routed it before specpipe.api imported mlx

__all__ = [
    "Arrival",
    "Conversation",
    "GenerationResult",
    "GenerationStats",
    "Pipeline",
    "PromptCache",
    "load",
]
