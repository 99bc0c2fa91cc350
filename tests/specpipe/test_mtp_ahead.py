"""Drafts launched ahead (`RoundOptions.draft_ahead`): the MTP head's next
round launched before this round's host read, from device arrays only (the
verify window's draws, this round's drafts and launch state), then adopted
by the next round. Output stays that of plain decoding; the launched drafts
are the ones the round would have drafted (the same acceptances); a launch
the next round cannot use (rows leaving or joining, another depth, rows
not offered every draft) is dropped. Run here on the CPU through the
compiled MLX steps (`HeadStep.ahead`'s fallback; on a CUDA GPU the fused
kernel's derived round, checked by bench/mtp.py --draft-ahead)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
from attrs import evolve
from spec_support import CollectSink, run
from test_mtp import PROMPTS, SAMPLINGS, copy_head, random_head
from test_mtp import target as mtp_target  # noqa: F401  (pytest fixture)
from test_mtp_compiled import repeating_target

from models.base import ModelOutput
from schemas.request import DraftPolicy, SamplingParams
from specpipe.draft import DraftsAhead, Proposal
from specpipe.drafts.mtp import MtpDrafter, MtpRows
from specpipe.loop import RoundOptions, RowRequest, generate_rows
from specpipe.prefill import prefill_rows
from specpipe.state import RowState


def counting(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts of the rounds that adopted a launch ahead and of launches."""
    counts = {"adopted": 0, "launched": 0}
    propose, launch = MtpRows.propose, MtpRows.launch_ahead

    def proposing(self: MtpRows, rows: Any, depth: int) -> Proposal:
        out = propose(self, rows, depth)
        counts["adopted"] += self.ahead is not None and out.device is self.ahead.tokens
        return out

    def launching(self: MtpRows, *args: Any) -> Any:
        out = launch(self, *args)
        counts["launched"] += out is not None
        return out

    monkeypatch.setattr(MtpRows, "propose", proposing)
    monkeypatch.setattr(MtpRows, "launch_ahead", launching)
    return counts


@pytest.mark.parametrize("sampling", SAMPLINGS[:2], ids=["greedy", "t0.7-filters"])
@pytest.mark.parametrize("prompts", [PROMPTS[:1], PROMPTS[:3]], ids=["B1", "B3"])
@pytest.mark.parametrize(
    "device_round", [True, False], ids=["device-first", "host-first"]
)
def test_drafts_launched_ahead_keep_the_output_and_the_drafts(
    monkeypatch: pytest.MonkeyPatch,
    mtp_target: Any,  # noqa: F811
    sampling: SamplingParams,
    prompts: Any,
    device_round: bool,
) -> None:
    drafter = MtpDrafter(mtp_target, copy_head(mtp_target), DraftPolicy(compiled=True))
    plain, _ = run(mtp_target, prompts, sampling, max_tokens=14)
    usual, usual_results = run(mtp_target, prompts, sampling, drafter, 3, max_tokens=14,
                               device_round=device_round)  # fmt: skip
    counts = counting(monkeypatch)
    ahead, results = run(mtp_target, prompts, sampling, drafter, 3, max_tokens=14,
                         device_round=device_round, draft_ahead=True)  # fmt: skip
    assert ahead == plain == usual
    assert counts["adopted"] >= 3
    assert counts["adopted"] <= counts["launched"]
    for r, u in zip(results, usual_results, strict=True):
        assert r.metrics.draft_errors == []
        # the launched drafts are the ones the round would have drafted
        assert (r.metrics.drafted_at, r.metrics.accepted_at) == (
            u.metrics.drafted_at,
            u.metrics.accepted_at,
        )


def test_long_acceptances_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every draft accepted: the launch's tail is the whole window."""
    repeating = repeating_target()
    prompts = [(3, 3, 3, 3), (7, 1, 7, 5, 5)]
    plain, _ = run(repeating, prompts, SamplingParams(), max_tokens=24)
    drafter = MtpDrafter(repeating, copy_head(repeating), DraftPolicy(compiled=True))
    counts = counting(monkeypatch)
    spec, results = run(repeating, prompts, SamplingParams(), drafter, 3, max_tokens=24,
                        draft_ahead=True)  # fmt: skip
    assert spec == plain
    assert counts["adopted"] >= 3
    for r in results:
        assert r.metrics.accepted == r.metrics.drafted > 0, r.metrics


def test_rows_finishing_apart_and_joining_drop_the_launch(
    monkeypatch: pytest.MonkeyPatch,
    mtp_target: Any,  # noqa: F811
) -> None:
    """Rows with different budgets leave the batch in different rounds and a
    row joins between rounds: the launch made for the old rows is dropped."""
    sampling = SamplingParams()
    budgets = [5, 9, 14]
    plain = [
        run(mtp_target, [p], sampling, max_tokens=n)[0][0]
        for p, n in zip(PROMPTS[:3], budgets, strict=True)
    ]
    late = run(mtp_target, [PROMPTS[3]], sampling, max_tokens=8)[0][0]
    drafter = MtpDrafter(mtp_target, random_head(3), DraftPolicy(compiled=True))
    counts = counting(monkeypatch)
    sinks = [CollectSink() for _ in range(4)]
    requests = [
        RowRequest(tuple(p), sampling, n, sink)
        for p, n, sink in zip(PROMPTS[:3], budgets, sinks[:3], strict=True)
    ]
    pending = [RowRequest(tuple(PROMPTS[3]), sampling, 8, sinks[3])]
    calls = {"n": 0}

    def arrivals() -> list[RowRequest]:
        calls["n"] += 1
        if calls["n"] == 2 and pending:
            return [pending.pop()]
        return []

    results = generate_rows(mtp_target, requests, (), drafter,
                            RoundOptions(depth=2, draft_ahead=True), arrivals)  # fmt: skip
    assert [list(s.tokens) for s in sinks] == [*plain, late]
    assert all(r.metrics.draft_errors == [] for r in results)
    assert counts["launched"] > counts["adopted"] >= 1


def test_a_launch_is_kept_for_its_own_round_only(mtp_target: Any) -> None:  # noqa: F811
    """`prepare_commit` keeps the launch for the round it follows, with its
    chain; another proposal's commit, or one without every draft offered,
    drops it; another depth is not adopted; rows leaving or joining drop it."""
    drafter = MtpDrafter(mtp_target, random_head(1), DraftPolicy(compiled=True))
    states = [RowState.start((5 + b, 6, 7), 32, SamplingParams()) for b in range(2)]
    cache, hidden = prefill_rows(mtp_target, states, keep_hidden=True)
    opened = drafter.open(states, hidden)
    assert isinstance(opened, MtpRows) and isinstance(opened, DraftsAhead)
    proposal = opened.propose(states, 2)
    assert proposal.device is not None and proposal.state is not None
    window = mx.concatenate(
        [mx.array([[s.pending] for s in states], dtype=mx.int32), proposal.device],
        axis=1,
    )
    verified = mtp_target(window, cache, [s.length for s in states])
    draws = mx.argmax(verified.logits, axis=-1).astype(mx.int32)
    verified = evolve(verified, draws=draws)
    launched = opened.launch_ahead(states, proposal, verified, 2)
    assert isinstance(launched, MtpRows) and launched.ahead is not None
    drafted = [tuple(r) for r in proposal.device.tolist()]
    kept = launched.prepare_commit(states, proposal, drafted, [0, 0], verified).commit()
    assert isinstance(kept, MtpRows) and kept.ahead is launched.ahead
    # another round's proposal, or rows offered fewer drafts: dropped
    other = Proposal(2, device=proposal.device, state=proposal.state)
    dropped = launched.prepare_commit(states, other, drafted, [0, 0], verified).commit()
    assert isinstance(dropped, MtpRows) and dropped.ahead is None
    short = launched.prepare_commit(states, proposal, [drafted[0], drafted[1][:1]], [0, 0],
                                    verified).commit()  # fmt: skip
    assert isinstance(short, MtpRows) and short.ahead is None
    # rows leaving or joining drop it
    assert (
        isinstance(kept.take_rows([1]), MtpRows) and kept.take_rows([1]).ahead is None
    )
    joined = kept.join(opened)
    assert isinstance(joined, MtpRows) and joined.ahead is None
    # adopted at its depth only: the tokens are the launch's
    moved = [
        s.advanced((int(t),)) for s, t in zip(states, draws[:, 0].tolist(), strict=True)
    ]
    assert kept.ahead is not None
    assert kept.propose(moved, 2).device is kept.ahead.tokens
    assert kept.propose(moved, 1).device is not kept.ahead.tokens
    # no draws, or the eager path: nothing launched
    bare = ModelOutput(verified.logits, verified.hidden)
    assert opened.launch_ahead(states, proposal, bare, 2) is None
    assert (
        evolve(opened, compiled=False).launch_ahead(states, proposal, verified, 2)
        is None
    )
