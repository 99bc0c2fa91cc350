"""The accept walk: which window samples a row publishes this round.

At window position i the target sampled t_i with the step key of its own
position. The draft d_i is *accepted* when d_i == t_i: the target would have
produced that very token, so the walk moves on. At the first mismatch t_i is
the *correction*; after a fully accepted window t_k is the *bonus*. Either
way it is published and becomes the row's pending token. The walk also stops
at an end-of-sequence token (not published), when the budget runs out, or
when a grammar says the output is complete.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

from attrs import frozen

Finish = Literal["continue", "stop", "length"]


@frozen
class Acceptance:
    drafts: tuple[int, ...]
    emitted: tuple[int, ...]  # published tokens, in order (EOS excluded)
    accepted: int  # drafts equal to the target's sample that the walk passed
    finish: Finish
    saw_eos: bool = False


def walk(
    drafts: Sequence[int],
    samples: Sequence[int],  # the target's tokens at window positions 0..len(drafts)
    remaining: int,
    eos_ids: frozenset[int],
    grammar_done: Callable[[tuple[int, ...]], bool] | None = None,
) -> Acceptance:
    assert remaining > 0 and len(samples) > len(drafts)
    emitted: list[int] = []
    accepted = 0
    finish: Finish = "continue"
    saw_eos = False
    for position in range(len(drafts) + 1):
        token = samples[position]
        if token in eos_ids:
            finish, saw_eos = "stop", True
            break
        emitted.append(token)
        if grammar_done is not None and grammar_done(tuple(emitted)):
            finish = "stop"
            break
        if len(emitted) >= remaining:
            finish = "length"
            break
        if position < len(drafts) and drafts[position] == token:
            accepted += 1
            continue
        break
    return Acceptance(tuple(drafts), tuple(emitted), accepted, finish, saw_eos)
