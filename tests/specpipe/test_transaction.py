"""Prepared changes and all-or-nothing commits; prepare-then-dispose changes
nothing; rollback-then-regenerate matches a fresh run."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from spec_support import PROMPTS, cache_prefix, perturbed, same_prefix

from models.base import CausalLM
from models.cache import KVCache
from schemas.request import DraftPolicy, SamplingParams
from specpipe.draft import Proposal
from specpipe.drafts.two_model import TwoModelDrafter, TwoModelRows
from specpipe.prefill import prefill
from specpipe.sample_window import sample_window
from specpipe.state import RowState
from specpipe.transaction import Prepared, SpentChange, apply_all, ready
from specpipe.verify import build_window, verify
from specpipe.walk import walk

# --- Prepared -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ("commit", "commit"),
        ("commit", "dispose"),
        ("dispose", "commit"),
        ("dispose", "dispose"),
    ],
)
def test_a_prepared_change_is_used_exactly_once(first: str, second: str) -> None:
    released: list[int] = []
    change: Prepared[int] = Prepared(lambda: 7, lambda: released.append(1))
    assert not change.spent
    result = getattr(change, first)()
    assert change.spent
    with pytest.raises(SpentChange):
        getattr(change, second)()
    # the failed second use ran nothing
    assert released == ([1] if first == "dispose" else [])
    if first == "commit":
        assert result == 7


def test_commit_returns_the_next_state_and_releases_nothing() -> None:
    released: list[str] = []
    change = Prepared(lambda: "next", lambda: released.append("x"))
    assert change.commit() == "next"
    assert released == []


def test_ready_commits_to_its_value() -> None:
    value = object()
    assert ready(value).commit() is value
    spent = ready(value)
    spent.dispose()
    with pytest.raises(SpentChange):
        spent.commit()


# --- apply_all ------------------------------------------------------------------


class Participant:
    """Records every prepare / commit / dispose into a shared log."""

    def __init__(self, name: str, log: list[str], fail: bool = False) -> None:
        self.name = name
        self.log = log
        self.fail = fail

    def prepare(self) -> Prepared[str]:
        self.log.append(f"prepare {self.name}")
        if self.fail:
            raise RuntimeError(f"{self.name} cannot prepare")

        def commit() -> str:
            self.log.append(f"commit {self.name}")
            return f"{self.name}'"

        return Prepared(commit, lambda: self.log.append(f"dispose {self.name}"))


def test_apply_all_commits_only_after_every_participant_prepared() -> None:
    log: list[str] = []
    parts = [Participant(n, log) for n in "abc"]
    assert apply_all([p.prepare for p in parts]) == ["a'", "b'", "c'"]
    assert log == [
        "prepare a",
        "prepare b",
        "prepare c",
        "commit a",
        "commit b",
        "commit c",
    ]


def test_a_failing_preparer_disposes_the_prepared_and_commits_nothing() -> None:
    log: list[str] = []
    parts = [
        Participant("a", log),
        Participant("b", log),
        Participant("c", log, fail=True),
        Participant("d", log),
    ]
    with pytest.raises(RuntimeError, match="c cannot prepare"):
        apply_all([p.prepare for p in parts])
    assert log == ["prepare a", "prepare b", "prepare c", "dispose a", "dispose b"]
    assert not any(entry.startswith("commit") for entry in log)


def test_a_failing_first_preparer_touches_no_one() -> None:
    log: list[str] = []
    parts = [Participant("a", log, fail=True), Participant("b", log)]
    with pytest.raises(RuntimeError):
        apply_all([p.prepare for p in parts])
    assert log == ["prepare a"]


def test_apply_all_of_nothing_is_nothing() -> None:
    assert apply_all([]) == []


# --- prepare-then-dispose on real state ---------------------------------------

SAMPLING = SamplingParams(temperature=0.8, top_k=30, seed=21)
DEPTH = 4


def _start(prompts: Sequence[tuple[int, ...]] = PROMPTS) -> list[RowState]:
    return [RowState.start(p, 32, SAMPLING) for p in prompts]


def _drafts(proposal: Proposal) -> tuple[tuple[int, ...], ...]:
    """Host drafts per row: staged proposals (the CPU default) are read back
    already, a chain's are left on the device."""
    read = None if proposal.device is None else proposal.device.reshape(-1).tolist()
    return proposal.resolve(read)


def _round(
    target: CausalLM, cache: KVCache, draft: TwoModelRows, rows: Sequence[RowState]
) -> tuple[Any, ...]:
    """One round up to the commit: proposal, verify output, drafts, accepted."""
    proposal = draft.propose(rows, DEPTH)
    window = build_window(rows, proposal)
    verified = verify(target, cache, window)
    samples = sample_window(verified.logits, window.ids, rows)
    mx.eval(samples, verified.logits)
    drafts = _drafts(proposal)
    tokens = samples.tolist()
    accs = [
        walk(d, t[: len(d) + 1], row.remaining, frozenset())
        for d, t, row in zip(drafts, tokens, rows, strict=True)
    ]
    return proposal, verified, drafts, accs, np.array(verified.logits)


@pytest.fixture(scope="module")
def near_draft(target: CausalLM) -> CausalLM:
    return perturbed(target, seed=7, scale=0.3)


def test_prepare_then_dispose_leaves_draft_and_target_state_bit_identical(
    target: CausalLM, near_draft: CausalLM
) -> None:
    rows = _start()
    cache = target.make_cache(len(rows))
    prefill(target, cache, rows)
    draft = TwoModelDrafter(near_draft).open(rows)
    assert isinstance(draft, TwoModelRows)
    lengths = [row.length for row in rows]
    target_before = cache_prefix(cache, lengths)
    draft_before = cache_prefix(draft.cache, draft.lengths)
    draft_lengths = draft.lengths
    whole_before = [np.array(a) for a in cache.arrays()]

    proposal, verified, drafts, accs, _ = _round(target, cache, draft, rows)
    change = draft.prepare_commit(
        rows, proposal, drafts, [a.accepted for a in accs], verified
    )
    change.dispose()

    assert change.spent
    assert draft.lengths == draft_lengths
    assert same_prefix(cache_prefix(cache, lengths), target_before)
    assert same_prefix(cache_prefix(draft.cache, draft.lengths), draft_before)
    # not vacuous: the round did write the target's cache past the committed prefix
    assert not all(
        np.array_equal(np.array(a), b)
        for a, b in zip(cache.arrays(), whole_before, strict=True)
    )


def test_a_failing_participant_leaves_the_drafter_uncommitted(
    target: CausalLM, near_draft: CausalLM
) -> None:
    rows = _start()
    cache = target.make_cache(len(rows))
    prefill(target, cache, rows)
    draft = TwoModelDrafter(near_draft).open(rows)
    assert isinstance(draft, TwoModelRows)
    proposal, verified, drafts, accs, _ = _round(target, cache, draft, rows)
    staged: list[Prepared[Any]] = []

    def draft_change() -> Prepared[Any]:
        staged.append(
            draft.prepare_commit(
                rows, proposal, drafts, [a.accepted for a in accs], verified
            )
        )
        return staged[-1]

    def broken() -> Prepared[Any]:
        raise ValueError("participant failed")

    preparers: list[Callable[[], Prepared[Any]]] = [
        lambda: ready(rows),
        draft_change,
        broken,
    ]
    with pytest.raises(ValueError):
        apply_all(preparers)
    assert staged and staged[0].spent
    with pytest.raises(SpentChange):
        staged[0].commit()


def test_rollback_then_regenerate_matches_a_fresh_round(
    target: CausalLM, near_draft: CausalLM
) -> None:
    rows = _start()
    cache = target.make_cache(len(rows))
    prefill(target, cache, rows)
    draft = TwoModelDrafter(near_draft).open(rows)
    assert isinstance(draft, TwoModelRows)
    first = _round(target, cache, draft, rows)
    draft.prepare_commit(
        rows, first[0], first[2], [a.accepted for a in first[3]], first[1]
    ).dispose()
    again = _round(target, cache, draft, rows)

    fresh_cache = target.make_cache(len(rows))
    prefill(target, fresh_cache, rows)
    fresh_draft = TwoModelDrafter(near_draft).open(rows)
    assert isinstance(fresh_draft, TwoModelRows)
    fresh = _round(target, fresh_cache, fresh_draft, rows)

    assert again[2] == first[2] == fresh[2]  # the same drafts
    assert [a.emitted for a in again[3]] == [a.emitted for a in fresh[3]]
    assert np.array_equal(again[4], fresh[4])  # bit-identical verify logits
    assert np.array_equal(first[4], fresh[4])


def test_a_garbage_window_rolled_back_leaves_the_next_verify_bit_identical(
    target: CausalLM,
) -> None:
    from specpipe.draft import Proposal

    rows = _start()
    cache = target.make_cache(len(rows))
    prefill(target, cache, rows)
    garbage = Proposal(5, host=((90, 91, 92, 93, 94), (1,), (), (7, 7, 7)))
    verify(target, cache, build_window(rows, garbage))
    real = Proposal(2, host=((3, 4), (5, 6), (7, 8), (9, 10)))
    after = np.array(verify(target, cache, build_window(rows, real)).logits)

    fresh = target.make_cache(len(rows))
    prefill(target, fresh, rows)
    expected = np.array(verify(target, fresh, build_window(rows, real)).logits)
    assert np.array_equal(after, expected)


@pytest.mark.parametrize("staged", [True, False], ids=["staged", "chain"])
def test_committing_a_partly_accepted_round_equals_a_fresh_drafter(
    target: CausalLM, near_draft: CausalLM, staged: bool
) -> None:
    """The two-model drafter's bookkeeping: after committing each row's accepted
    count, its next proposal equals that of a drafter opened on the advanced rows."""
    rows = _start()
    cache = target.make_cache(len(rows))
    prefill(target, cache, rows)
    draft = TwoModelDrafter(near_draft, DraftPolicy(staged=staged)).open(rows)
    assert isinstance(draft, TwoModelRows)
    accepted_seen: set[int] = set()
    for _ in range(4):
        proposal, verified, drafts, accs, _ = _round(target, cache, draft, rows)
        accepted = [a.accepted for a in accs]
        accepted_seen.update(accepted)
        committed = draft.prepare_commit(
            rows, proposal, drafts, accepted, verified
        ).commit()
        assert isinstance(committed, TwoModelRows)
        draft = committed
        rows = [row.advanced(a.emitted) for row, a in zip(rows, accs, strict=True)]
        for row, n in zip(rows, draft.lengths, strict=True):
            assert row.length - 1 <= n <= row.length
        reopened = TwoModelDrafter(near_draft, DraftPolicy(staged=staged)).open(rows)
        assert _drafts(draft.propose(rows, DEPTH)) == _drafts(
            reopened.propose(rows, DEPTH)
        )
    # the rounds exercised partial acceptance, not only all-or-nothing
    assert accepted_seen & set(range(1, DEPTH))


def test_committing_a_window_equals_decoding_it_token_by_token(
    target: CausalLM,
) -> None:
    rows = _start()
    window_tokens = [
        (11, 12, 13, 14),
        (21, 22, 23, 24),
        (31, 32, 33, 34),
        (41, 42, 43, 44),
    ]
    # one verify window over [pending, t1..t4], then keep it all
    cache = target.make_cache(len(rows))
    prefill(target, cache, rows)
    from specpipe.draft import Proposal

    verify(target, cache, build_window(rows, Proposal(4, host=tuple(window_tokens))))
    # the same tokens one forward at a time
    stepped = target.make_cache(len(rows))
    prefill(target, stepped, rows)
    ids = [[row.pending, *t] for row, t in zip(rows, window_tokens, strict=True)]
    for i in range(5):
        target(
            mx.array([[r[i]] for r in ids], dtype=mx.int32),
            stepped,
            [row.length + i for row in rows],
        )
    lengths = [row.length + 5 for row in rows]
    for a, b in zip(
        cache_prefix(cache, lengths), cache_prefix(stepped, lengths), strict=True
    ):
        for x, y in zip(a, b, strict=True):
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)
    # and the next token's logits agree
    nxt = mx.array([[1], [2], [3], [4]], dtype=mx.int32)
    la = target(nxt, cache, lengths).logits
    lb = target(nxt, stepped, lengths).logits
    np.testing.assert_allclose(np.array(la), np.array(lb), rtol=1e-4, atol=1e-4)
    assert mx.array_equal(mx.argmax(la, axis=-1), mx.argmax(lb, axis=-1))
