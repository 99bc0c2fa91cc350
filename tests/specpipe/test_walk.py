"""Table-driven cases of the accept walk, plus its invariants on random windows."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specpipe.walk import Acceptance, walk

EOS = frozenset({2})
NO_EOS: frozenset[int] = frozenset()

# (drafts, samples, remaining, eos) -> (emitted, accepted, finish, saw_eos)
CASES = {
    "all accepted + bonus": (
        ((5, 6, 7), (5, 6, 7, 8), 10, NO_EOS),
        ((5, 6, 7, 8), 3, "continue", False),
    ),
    "first mismatch is the correction": (
        ((5, 6, 7), (5, 9, 7, 8), 10, NO_EOS),
        ((5, 9), 1, "continue", False),
    ),
    "mismatch at the first draft": (
        ((5, 6), (4, 6, 7), 10, NO_EOS),
        ((4,), 0, "continue", False),
    ),
    "samples after the correction are never read": (
        ((5, 6, 7), (5, 9, 2, 2), 10, EOS),
        ((5, 9), 1, "continue", False),
    ),
    "EOS inside the window is not published": (
        ((5, 6, 7), (5, 6, 2, 8), 10, EOS),
        ((5, 6), 2, "stop", True),
    ),
    "EOS as the first sample": (
        ((5, 6, 7), (2, 6, 7, 8), 10, EOS),
        ((), 0, "stop", True),
    ),
    "EOS as the bonus": (
        ((5, 6), (5, 6, 2), 10, EOS),
        ((5, 6), 2, "stop", True),
    ),
    "EOS drafted and sampled stops there": (
        ((5, 2, 7), (5, 2, 7, 8), 10, EOS),
        ((5,), 1, "stop", True),
    ),
    "any of several EOS ids": (
        ((5, 6, 7), (5, 6, 3, 8), 10, frozenset({2, 3})),
        ((5, 6), 2, "stop", True),
    ),
    "EOS as the correction": (
        ((5, 6, 7), (5, 2, 7, 8), 10, EOS),
        ((5,), 1, "stop", True),
    ),
    "budget ends inside the window": (
        ((5, 6, 7), (5, 6, 7, 8), 2, NO_EOS),
        ((5, 6), 1, "length", False),
    ),
    "budget of one token": (
        ((5, 6, 7), (5, 6, 7, 8), 1, NO_EOS),
        ((5,), 0, "length", False),
    ),
    "budget ends exactly at the bonus": (
        ((5, 6, 7), (5, 6, 7, 8), 4, NO_EOS),
        ((5, 6, 7, 8), 3, "length", False),
    ),
    "budget ends at the correction": (
        ((5, 6, 7), (5, 9, 7, 8), 2, NO_EOS),
        ((5, 9), 1, "length", False),
    ),
    "EOS wins over a budget that ends at it": (
        ((5, 6), (5, 2, 7), 2, EOS),
        ((5,), 1, "stop", True),
    ),
    "empty proposal publishes the target's token": (
        ((), (9,), 10, NO_EOS),
        ((9,), 0, "continue", False),
    ),
    "empty proposal at the last budgeted token": (
        ((), (9,), 1, NO_EOS),
        ((9,), 0, "length", False),
    ),
    "empty proposal sampling EOS": (
        ((), (2,), 10, EOS),
        ((), 0, "stop", True),
    ),
    "padded samples past the drafts are ignored": (
        ((5,), (5, 6, 7, 8), 10, NO_EOS),
        ((5, 6), 1, "continue", False),
    ),
}


@pytest.mark.parametrize(("given_", "expected"), list(CASES.values()), ids=list(CASES))
def test_walk_cases(
    given_: tuple[tuple[int, ...], tuple[int, ...], int, frozenset[int]],
    expected: tuple[tuple[int, ...], int, str, bool],
) -> None:
    drafts, samples, remaining, eos = given_
    emitted, accepted, finish, saw_eos = expected
    acc = walk(drafts, samples, remaining, eos)
    assert acc == Acceptance(drafts, emitted, accepted, finish, saw_eos)  # type: ignore[arg-type]


def test_grammar_done_stops_after_the_completing_token() -> None:
    seen: list[tuple[int, ...]] = []

    def done(emitted: tuple[int, ...]) -> bool:
        seen.append(emitted)
        return emitted[-1] == 6

    acc = walk((5, 6, 7), (5, 6, 7, 8), 10, NO_EOS, done)
    assert acc.emitted == (5, 6)
    assert acc.finish == "stop"
    assert not acc.saw_eos
    assert acc.accepted == 1
    # the hook sees every published prefix, in order, and nothing after done
    assert seen == [(5,), (5, 6)]


def test_grammar_done_wins_over_the_budget_on_the_same_token() -> None:
    acc = walk((5, 6), (5, 6, 7), 2, NO_EOS, lambda e: len(e) == 2)
    assert (acc.emitted, acc.finish) == ((5, 6), "stop")


def test_grammar_is_not_asked_about_eos() -> None:
    seen: list[tuple[int, ...]] = []

    def done(emitted: tuple[int, ...]) -> bool:
        seen.append(emitted)
        return False

    acc = walk((5, 6), (5, 2, 7), 10, EOS, done)
    assert (acc.emitted, acc.finish, acc.saw_eos) == ((5,), "stop", True)
    assert seen == [(5,)]


def test_grammar_never_done_leaves_the_walk_unchanged() -> None:
    never: Callable[[tuple[int, ...]], bool] = lambda e: False  # noqa: E731
    for (drafts, samples, remaining, eos), _ in CASES.values():
        assert walk(drafts, samples, remaining, eos, never) == walk(
            drafts, samples, remaining, eos
        )


def test_walk_refuses_a_spent_budget_or_a_short_window() -> None:
    with pytest.raises(AssertionError):
        walk((5,), (5, 6), 0, NO_EOS)
    with pytest.raises(AssertionError):
        walk((5, 6), (5, 6), 10, NO_EOS)


@settings(max_examples=300, deadline=None, database=None)
@given(
    data=st.data(),
    depth=st.integers(0, 8),
    remaining=st.integers(1, 12),
    eos=st.frozensets(st.integers(0, 5), max_size=2),
)
def test_walk_invariants(
    data: st.DataObject, depth: int, remaining: int, eos: frozenset[int]
) -> None:
    tokens = st.integers(0, 5)  # a tiny alphabet: many accepts, many EOS hits
    drafts = tuple(data.draw(st.lists(tokens, min_size=depth, max_size=depth)))
    samples = tuple(data.draw(st.lists(tokens, min_size=depth + 1, max_size=depth + 1)))
    acc = walk(drafts, samples, remaining, eos)
    n = len(acc.emitted)
    # published tokens are the target's own samples, a prefix of the window
    assert acc.emitted == samples[:n]
    # accepted drafts are exactly those equal to the target's sample
    assert drafts[: acc.accepted] == samples[: acc.accepted]
    assert acc.accepted <= n <= acc.accepted + 1
    assert n <= remaining
    assert not (set(acc.emitted) & eos)
    if acc.saw_eos:
        assert acc.finish == "stop"
        assert samples[n] in eos
    elif acc.finish == "length":
        assert n == remaining
    elif acc.finish == "continue":
        assert n == acc.accepted + 1
        # the walk ended at a correction or at the bonus
        assert (
            acc.accepted == len(drafts) or drafts[acc.accepted] != samples[acc.accepted]
        )
    else:
        raise AssertionError(acc)
