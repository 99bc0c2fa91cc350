"""Prompt lookup with a copy cursor (specpipe/drafts/ngram.py).

Token ids are small integers; 900+ are filler that matches nothing.
"""

from __future__ import annotations

import pytest

from schemas.request import SamplingParams
from specpipe.drafts.ngram import (
    CURSOR_MISSES,
    CURSOR_REACH,
    NO_CURSOR,
    NgramDrafter,
    NgramRows,
    lookup,
    moved_cursor,
)
from specpipe.state import RowState

FILLER = [900 + i for i in range(CURSOR_REACH + 8)]
FILLER2 = [800 + i for i in range(CURSOR_REACH + 8)]


def _row(tokens: list[int]) -> RowState:
    return RowState.start(tuple(tokens), 64, SamplingParams())


def test_without_a_cursor_the_latest_match_of_the_longest_suffix_drafts() -> None:
    tokens = [1, 2, 3, 7, 2, 3, 8, 5, 3, 9, 2, 3]
    # the 2-gram [2, 3] last occurred before 8
    assert lookup(tokens, 3, 1, 4) == ((8, 5, 3), 6)
    # only 1-grams allowed: the latest [3] precedes 9
    assert lookup(tokens, 2, 1, 1) == ((9, 2), 9)
    assert lookup([4, 5, 6], 3, 1, 4) == ((), NO_CURSOR)
    assert lookup(tokens, 0, 1, 4) == ((), NO_CURSOR)


def test_a_match_near_the_cursor_outranks_the_latest_one() -> None:
    # `=` (20) recurs; the copy was at the first line, whose `=` precedes 31
    source = [10, 20, 31, 32, 11, 20, 41, 42, 12, 20, 51, 52]
    tokens = [*source, *FILLER, 10, 20]
    assert lookup(tokens, 2, 1, 1)[0] == (51, 52)  # plain: the latest `=`
    assert lookup(tokens, 2, 1, 1, cursor=2) == ((31, 32), 2)


def test_a_far_two_token_match_outranks_the_bare_cursor_guess() -> None:
    tokens = [5, 6, 7, 8, *FILLER, 70, 71, 72, *FILLER2, 70, 71]
    cursor = 1  # near nothing that matches
    assert lookup(tokens, 1, 1, 4, cursor) == ((72,), 4 + len(FILLER) + 2)
    # a single far token does not: the cursor's continuation drafts
    single = [5, 6, 7, 8, *FILLER, 70, 73, *FILLER2, 70]
    assert lookup(single, 2, 1, 4, cursor) == ((6, 7), 1)


@pytest.mark.parametrize(
    ("state", "round_", "after"),
    [
        # (cursor, misses), (origin, drafted, accepted) -> (cursor, misses)
        ((NO_CURSOR, 0), (10, 4, 2), (13, 0)),  # kept 2: the correction replaced 12
        ((NO_CURSOR, 0), (10, 4, 4), (15, 0)),  # all kept: the bonus replaced 14
        ((NO_CURSOR, 0), (10, 4, 0), (NO_CURSOR, 0)),  # no copy under way
        ((NO_CURSOR, 0), (NO_CURSOR, 0, 0), (NO_CURSOR, 0)),
        ((20, 0), (20, 3, 0), (21, 1)),  # a miss steps over one source token
        ((20, 1), (NO_CURSOR, 0, 0), (21, 2)),  # nothing drafted: the same
        ((20, CURSOR_MISSES - 1), (20, 3, 0), (NO_CURSOR, 0)),  # too many misses
        ((20, 2), (30, 3, 1), (32, 0)),  # a kept draft re-anchors
    ],
)
def test_the_cursor_moves_with_what_was_kept(
    state: tuple[int, int], round_: tuple[int, int, int], after: tuple[int, int]
) -> None:
    assert moved_cursor(*state, *round_) == after


def test_an_edit_copies_past_a_renamed_token() -> None:
    # prompt: an instruction naming the new token 99 ("rename 13 to 99"), far
    # filler, then the source [10..17]; the reply copies it with 13 -> 99
    instruction = [1, 13, 2, 99, 3, 4]
    source = [10, 11, 12, 13, 14, 15, 16, 17]
    prompt = [*instruction, *FILLER, *source, 5, 10]
    drafter = NgramDrafter(1, 4)
    rows = [_row(prompt)]
    state = drafter.open(rows)
    assert isinstance(state, NgramRows)

    first = state.propose(rows, 4)
    assert first.host == ((11, 12, 13, 14),)
    # the target keeps 11, 12 and corrects 13 to 99
    state = state.prepare_commit(rows, first, first.host, [2], None).commit()  # type: ignore[arg-type]
    rows = [rows[0].advanced((11, 12, 99))]

    second = state.propose(rows, 4)
    assert second.host == ((14, 15, 16, 17),)  # the source after 13
    # plain lookup drafts the instruction's continuation of 99 instead
    assert lookup(rows[0].tokens, 4, 1, 4)[0] == (3, 4, *FILLER[:2])


def test_rows_keep_their_cursors_through_take_and_join() -> None:
    a = NgramRows(1, 4, (3, NO_CURSOR, 9), (0, 0, 2))
    b = NgramRows(1, 4, (5,), (1,))
    taken = a.take_rows([2, 0])
    assert isinstance(taken, NgramRows)
    assert (taken.cursors, taken.misses) == ((9, 3), (2, 0))
    joined = taken.join(b)
    assert isinstance(joined, NgramRows)
    assert (joined.cursors, joined.misses) == ((9, 3, 5), (2, 0, 1))
