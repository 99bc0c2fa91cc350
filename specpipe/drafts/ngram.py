"""Prompt-lookup drafting (model-free n-gram matching over the row's own tokens),
with a copy cursor per row.

The last n tokens of the row (n from `max_n` down to `min_n`) are searched for
an earlier occurrence in the prompt and the generated text; the tokens that
followed it are the drafts. Code edits and quoting reuse long spans of the
input, which this drafts for free.

An edit copies its source with changes: a renamed identifier, a changed
argument. Plain lookup loses the source at each change (the new tokens occur
nowhere, or somewhere else: in the instruction that names them), so it drafts
nothing, or the wrong span, until the suffix is again a long-enough n-gram of
the source. The copy cursor keeps the place instead: once a copied draft is
accepted, the row remembers where in its tokens the copy continues (the index
just past what was kept). When the target's correction replaces a source
token, the cursor steps over that token (a substitution, the common case of
an edit), and the next round:

1. takes the n-gram match whose continuation lies nearest the cursor (within
   `CURSOR_REACH` tokens) over the latest one (one-token suffixes such as
   ` =` recur on every line; the one near the cursor is the one being copied);
2. with no match near it, drafts straight from the cursor (the substitution
   guess), unless a match of two or more tokens lies elsewhere;
3. after `CURSOR_MISSES` rounds in a row that keep nothing from the cursor's
   region, drops it and drafts as plain lookup does (the latest match of the
   longest suffix).

Drafts never change the output (the target verifies every one); the cursor
only decides which span is offered.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
from attrs import evolve, frozen

from models.base import ModelOutput
from specpipe.draft import DraftRows, DraftState, Proposal
from specpipe.state import RowState
from specpipe.transaction import Prepared, ready

CURSOR_REACH = 32  # how far from the cursor a match may continue to count as "near"
CURSOR_MISSES = 3  # rounds without a kept draft before the cursor is dropped
NO_CURSOR = -1
NAMESPACE = "ngram"  # its checkpoints' (nothing is kept: see `NgramRows.capture`)


def lookup(
    tokens: Sequence[int],
    depth: int,
    min_n: int,
    max_n: int,
    cursor: int = NO_CURSOR,
) -> tuple[tuple[int, ...], int]:
    """`(drafts, origin)`: up to `depth` drafts and the index in `tokens` of the
    first (NO_CURSOR when there are none). See the module doc for the order."""
    size = len(tokens)
    if depth < 1 or size < 2:
        return (), NO_CURSOR
    latest, latest_n = NO_CURSOR, 0  # plain lookup's choice and its n
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = list(tokens[size - n :])
        first = suffix[0]
        near, near_distance = NO_CURSOR, CURSOR_REACH + 1
        for i in range(size - n - 1, -1, -1):  # latest start first
            if tokens[i] != first or list(tokens[i : i + n]) != suffix:
                continue
            start = i + n
            if latest == NO_CURSOR:
                latest, latest_n = start, n
            if cursor == NO_CURSOR:
                break
            distance = abs(start - cursor)
            if distance < near_distance:
                near, near_distance = start, distance
        if near != NO_CURSOR:
            return tuple(tokens[near : near + depth]), near
        if latest != NO_CURSOR and cursor == NO_CURSOR:
            break
    # A far match of two or more tokens outranks the bare cursor guess; a
    # single far token (a renamed identifier seen before) does not.
    if NO_CURSOR < cursor < size and latest_n < 2:
        return tuple(tokens[cursor : cursor + depth]), cursor
    if latest != NO_CURSOR:
        return tuple(tokens[latest : latest + depth]), latest
    return (), NO_CURSOR


def moved_cursor(
    cursor: int, misses: int, origin: int, drafted: int, accepted: int
) -> tuple[int, int]:
    """A row's `(cursor, misses)` after a round that drafted `drafted` tokens
    copied from `origin` (NO_CURSOR: none) and kept `accepted` of them."""
    if origin != NO_CURSOR and accepted > 0:
        # Kept a copy: the emitted correction or bonus takes the place of the
        # source token after the kept ones, and the copy goes on after it.
        return origin + accepted + 1, 0
    if cursor == NO_CURSOR or misses + 1 >= CURSOR_MISSES:
        return NO_CURSOR, 0
    # Nothing kept: one token was emitted; assume it replaced one source token.
    step_from = origin if origin != NO_CURSOR else cursor
    return step_from + 1, misses + 1


@frozen
class NgramRows:
    needs_target_hidden = False
    min_n: int
    max_n: int
    cursors: tuple[int, ...]  # per row, where its copy continues (NO_CURSOR: none)
    misses: tuple[int, ...]  # per row, rounds in a row without a kept draft

    def propose(self, rows: Sequence[RowState], depth: int) -> Proposal:
        found = [
            lookup(row.tokens, min(depth, row.remaining - 1), self.min_n, self.max_n, c)
            if row.remaining > 1
            else ((), NO_CURSOR)
            for row, c in zip(rows, self.cursors, strict=True)
        ]
        return Proposal(
            depth,
            host=tuple(drafts for drafts, _ in found),
            origins=tuple(origin for _, origin in found),
        )

    def prepare_commit(
        self,
        rows: Sequence[RowState],
        proposal: Proposal,
        drafts: Sequence[tuple[int, ...]],
        accepted: Sequence[int],
        verified: ModelOutput,
    ) -> Prepared[DraftRows]:
        origins = proposal.origins or tuple(NO_CURSOR for _ in rows)
        moved = [
            moved_cursor(c, m, o if d else NO_CURSOR, len(d), a)
            for c, m, o, d, a in zip(
                self.cursors, self.misses, origins, drafts, accepted, strict=True
            )
        ]
        return ready(
            evolve(
                self,
                cursors=tuple(c for c, _ in moved),
                misses=tuple(m for _, m in moved),
            )
        )

    def take_rows(self, keep: Sequence[int]) -> DraftRows:
        return evolve(
            self,
            cursors=tuple(self.cursors[i] for i in keep),
            misses=tuple(self.misses[i] for i in keep),
        )

    def capture(self, row: int) -> DraftState:
        # nothing to keep: a lookup reads the row's tokens, and a resumed row
        # starts its copy afresh
        return DraftState(NAMESPACE, 0)

    def join(self, other: DraftRows) -> DraftRows:
        assert isinstance(other, NgramRows)
        return evolve(
            self,
            cursors=self.cursors + other.cursors,
            misses=self.misses + other.misses,
        )


@frozen
class NgramDrafter:
    needs_target_hidden = False
    min_n: int = 1
    max_n: int = 4
    kind: str = "ngram"

    @property
    def namespace(self) -> str:
        return NAMESPACE

    def resume(
        self,
        rows: Sequence[RowState],
        hidden: mx.array | None,
        states: Sequence[DraftState | None],
    ) -> DraftRows:
        return self.open(rows, hidden)

    def open(
        self, rows: Sequence[RowState], hidden: mx.array | None = None
    ) -> DraftRows:
        return NgramRows(
            self.min_n,
            self.max_n,
            tuple(NO_CURSOR for _ in rows),
            tuple(0 for _ in rows),
        )
