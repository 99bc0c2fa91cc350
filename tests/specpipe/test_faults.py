"""Fault injection: a failing drafter, a failing or stopping consumer, a
cancelled row, a failing target. Output that reaches a consumer is always what
plain decoding would have produced; a fault ends only what it must."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import pytest
from spec_support import PROMPTS, CollectSink, PlainReference, perturbed, run

from models.base import CausalLM, ModelOutput
from models.cache import KVCache
from schemas.request import SamplingParams
from specpipe.draft import Drafter, DraftRows, Proposal
from specpipe.drafts.ngram import NgramDrafter
from specpipe.drafts.two_model import TwoModelDrafter
from specpipe.output import TopLogprobs, deliver
from specpipe.state import RowState
from specpipe.transaction import Prepared
from specpipe.walk import Acceptance

MAX_TOKENS = 16
SAMPLING = SamplingParams(temperature=0.7, top_p=0.9, seed=17)
PENALTY = SamplingParams(temperature=0.7, repetition_penalty=1.2, seed=17)


class DrafterFault(RuntimeError):
    pass


class FaultyRows:
    """Wraps a drafter's rows; raises from `method` on its `at`-th call (1-based)."""

    needs_target_hidden = False

    def __init__(
        self, inner: DraftRows, method: str, at: int, calls: dict[str, int]
    ) -> None:
        self.inner = inner
        self.method = method
        self.at = at
        self.calls = calls

    def _tick(self, method: str) -> None:
        self.calls[method] = self.calls.get(method, 0) + 1
        if method == self.method and self.calls[method] == self.at:
            raise DrafterFault(f"{method} broke")

    def propose(self, rows: Sequence[RowState], depth: int) -> Proposal:
        self._tick("propose")
        return self.inner.propose(rows, depth)

    def prepare_commit(
        self,
        rows: Sequence[RowState],
        proposal: Proposal,
        drafts: Sequence[tuple[int, ...]],
        accepted: Sequence[int],
        verified: ModelOutput,
    ) -> Prepared[DraftRows]:
        self._tick("prepare_commit")
        inner = self.inner.prepare_commit(rows, proposal, drafts, accepted, verified)
        return Prepared(
            lambda: FaultyRows(inner.commit(), self.method, self.at, self.calls),
            inner.dispose,
        )

    def take_rows(self, keep: Sequence[int]) -> DraftRows:
        self._tick("take_rows")
        return FaultyRows(self.inner.take_rows(keep), self.method, self.at, self.calls)

    def join(self, other: DraftRows) -> DraftRows:
        assert isinstance(other, FaultyRows)
        return FaultyRows(
            self.inner.join(other.inner), self.method, self.at, self.calls
        )


class FaultyDrafter:
    needs_target_hidden = False
    kind = "faulty"

    def __init__(self, inner: Drafter, method: str, at: int) -> None:
        self.inner = inner
        self.method = method
        self.at = at
        self.calls: dict[str, int] = {}

    def open(
        self, rows: Sequence[RowState], hidden: mx.array | None = None
    ) -> DraftRows:
        if self.method == "open":
            raise DrafterFault("open broke")
        return FaultyRows(self.inner.open(rows), self.method, self.at, self.calls)


@pytest.fixture(scope="module")
def near_draft(target: CausalLM) -> CausalLM:
    return perturbed(target, seed=7, scale=0.3)


@pytest.mark.parametrize("method", ["propose", "prepare_commit"])
@pytest.mark.parametrize("device_round", [True, False])
@pytest.mark.parametrize(
    "params", [SAMPLING, PENALTY], ids=["pipelined-after", "host-after"]
)
def test_a_failing_drafter_is_disabled_and_output_equals_plain(
    target: CausalLM,
    near_draft: CausalLM,
    plain: PlainReference,
    method: str,
    device_round: bool,
    params: SamplingParams,
) -> None:
    drafter = FaultyDrafter(TwoModelDrafter(near_draft), method, at=2)
    tokens, results = run(
        target, PROMPTS, params, drafter, 3, MAX_TOKENS, device_round=device_round
    )
    assert tokens == plain(PROMPTS, params, MAX_TOKENS)
    assert [r.finish for r in results] == ["length"] * 4
    assert drafter.calls[method] == 2  # never asked again once disabled
    for r in results:
        assert len(r.metrics.draft_errors) == 1
        assert "DrafterFault" in r.metrics.draft_errors[0]
        assert f"{method} broke" in r.metrics.draft_errors[0]
    # drafts stood only in the rounds before the fault (3 per row per round)
    assert all(
        r.metrics.drafted == 3 * (2 if method == "prepare_commit" else 1)
        for r in results
    )


def test_a_drafter_failing_to_open_is_disabled_and_output_equals_plain(
    target: CausalLM, near_draft: CausalLM, plain: PlainReference
) -> None:
    drafter = FaultyDrafter(TwoModelDrafter(near_draft), "open", at=1)
    tokens, results = run(target, PROMPTS, SAMPLING, drafter, 3, MAX_TOKENS)
    assert tokens == plain(PROMPTS, SAMPLING, MAX_TOKENS)
    for r in results:
        assert r.finish == "length"
        assert len(r.metrics.draft_errors) == 1
        assert "open broke" in r.metrics.draft_errors[0]


def test_a_drafter_failing_to_drop_retired_rows_is_disabled(
    target: CausalLM, near_draft: CausalLM, plain: PlainReference
) -> None:
    """Row 0 has a budget of 2 and retires early; the drafter's `take_rows`
    then raises. The other rows must still finish with the plain output."""
    expected = plain(PROMPTS, SAMPLING, MAX_TOKENS)
    drafter = FaultyDrafter(TwoModelDrafter(near_draft), "take_rows", at=1)
    sinks = [StoppingSink(at=2), CollectSink(), CollectSink(), CollectSink()]
    tokens, results = run(
        target, PROMPTS, SAMPLING, drafter, 3, MAX_TOKENS, sinks=sinks
    )
    assert tokens == [expected[0][:2], *expected[1:]]
    assert [r.finish for r in results] == ["stop", "length", "length", "length"]
    assert drafter.calls["take_rows"] == 1
    assert all("take_rows broke" in r.metrics.draft_errors[0] for r in results[1:])


def test_a_drafter_failing_on_its_first_proposal_still_decodes(
    target: CausalLM, plain: PlainReference
) -> None:
    drafter = FaultyDrafter(NgramDrafter(1, 3), "propose", at=1)
    tokens, results = run(target, PROMPTS, SAMPLING, drafter, 3, MAX_TOKENS)
    assert tokens == plain(PROMPTS, SAMPLING, MAX_TOKENS)
    assert all(
        r.metrics.drafted == 0 and len(r.metrics.draft_errors) == 1 for r in results
    )


class RaisingSink(CollectSink):
    def __init__(self, at: int) -> None:
        super().__init__()
        self.at = at

    def push(self, token: int, logprob: float | None, top: TopLogprobs = ()) -> bool:
        if len(self.tokens) + 1 == self.at:
            raise OSError("consumer went away")
        return super().push(token, logprob, top)


class StoppingSink(CollectSink):
    def __init__(self, at: int) -> None:
        super().__init__()
        self.at = at

    def push(self, token: int, logprob: float | None, top: TopLogprobs = ()) -> bool:
        super().push(token, logprob, top)
        return len(self.tokens) < self.at


DRAFTERS = ["plain", "self", "two-model-near", "ngram"]


def _drafter(name: str, target: CausalLM, near: CausalLM) -> tuple[Drafter | None, int]:
    if name == "plain":
        return None, 0
    if name == "self":
        return TwoModelDrafter(target), 7  # bursts of 8 accepted tokens
    if name == "two-model-near":
        return TwoModelDrafter(near), 3
    return NgramDrafter(1, 3), 3


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_a_raising_consumer_fails_only_its_row(
    target: CausalLM, near_draft: CausalLM, plain: PlainReference, drafter: str
) -> None:
    expected = plain(PROMPTS, SAMPLING, MAX_TOKENS)
    sinks = [CollectSink(), RaisingSink(at=5), CollectSink(), CollectSink()]
    d, depth = _drafter(drafter, target, near_draft)
    tokens, results = run(target, PROMPTS, SAMPLING, d, depth, MAX_TOKENS, sinks=sinks)
    assert results[1].finish == "failed"
    assert results[1].error is not None
    assert "OSError" in results[1].error and "consumer went away" in results[1].error
    assert tokens[1] == expected[1][:4]
    assert results[1].metrics.generated == 4
    for b in (0, 2, 3):
        assert tokens[b] == expected[b]
        assert results[b].finish == "length"
        assert results[b].error is None


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_a_consumer_returning_false_stops_its_row_exactly_there(
    target: CausalLM, near_draft: CausalLM, plain: PlainReference, drafter: str
) -> None:
    expected = plain(PROMPTS, SAMPLING, MAX_TOKENS)
    sinks = [CollectSink(), CollectSink(), StoppingSink(at=3), CollectSink()]
    d, depth = _drafter(drafter, target, near_draft)
    tokens, results = run(target, PROMPTS, SAMPLING, d, depth, MAX_TOKENS, sinks=sinks)
    assert tokens[2] == expected[2][:3]
    assert results[2].finish == "stop"
    assert results[2].metrics.generated == 3
    for b in (0, 1, 3):
        assert tokens[b] == expected[b]
        assert results[b].finish == "length"


def test_a_stop_inside_an_accepted_burst(
    target: CausalLM, plain: PlainReference
) -> None:
    """The target drafting for itself publishes 8 tokens a round; a consumer
    that stops at the 3rd sees no more, though 5 more were verified."""
    expected = plain(PROMPTS, SAMPLING, MAX_TOKENS)
    sinks = [StoppingSink(at=3) for _ in PROMPTS]
    tokens, results = run(
        target, PROMPTS, SAMPLING, TwoModelDrafter(target), 7, MAX_TOKENS, sinks=sinks
    )
    assert tokens == [e[:3] for e in expected]
    assert all(r.finish == "stop" and r.metrics.rounds == 1 for r in results)
    assert all(r.metrics.accepted == 7 for r in results)


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_a_cancelled_row_stops_before_its_next_token(
    target: CausalLM, near_draft: CausalLM, plain: PlainReference, drafter: str
) -> None:
    expected = plain(PROMPTS, SAMPLING, MAX_TOKENS)
    sinks = [CollectSink() for _ in PROMPTS]
    asked: list[int] = []

    def cancelled() -> bool:
        asked.append(len(sinks[3].tokens))
        return len(sinks[3].tokens) >= 6

    d, depth = _drafter(drafter, target, near_draft)
    tokens, results = run(
        target,
        PROMPTS,
        SAMPLING,
        d,
        depth,
        MAX_TOKENS,
        sinks=sinks,
        cancelled=[None, None, None, cancelled],
    )
    assert tokens[3] == expected[3][:6]
    assert results[3].finish == "cancelled"
    assert max(asked) == 6
    for b in range(3):
        assert tokens[b] == expected[b]
        assert results[b].finish == "length"


class TargetFault(RuntimeError):
    pass


class FailingModel:
    """The target, whose forward raises from its `at`-th call (prefill is call 1)."""

    def __init__(self, inner: CausalLM, at: int) -> None:
        self.inner = inner
        self.at = at
        self.calls = 0

    def __call__(
        self, ids: mx.array, cache: KVCache, offsets: Sequence[int], **kw: Any
    ) -> ModelOutput:
        self.calls += 1
        if self.calls >= self.at:
            raise TargetFault("device lost")
        return self.inner(ids, cache, offsets, **kw)

    def __getattr__(self, name: str) -> Any:
        # everything but the forward (make_cache, padding_safe, ...) is the target's
        return getattr(self.inner, name)


@pytest.mark.parametrize(
    ("drafter", "params", "device_round", "at"),
    [
        # two rounds of 8 tokens: fail the second
        pytest.param("self", SAMPLING, True, 3, id="self-draft-round"),
        pytest.param("two-model-near", SAMPLING, False, 4, id="two-model-round"),
        pytest.param("ngram", SAMPLING, True, 4, id="ngram-round"),
        pytest.param("plain", PENALTY, True, 4, id="plain-through-round-penalty"),
        pytest.param("plain", SAMPLING, False, 4, id="plain-through-round-host-first"),
        # the pipelined plain loop: the default way to decode without a drafter
        pytest.param("plain", SAMPLING, True, 4, id="plain-pipelined-decode"),
        # the prompt's forward (prefill) fails
        pytest.param("plain", SAMPLING, True, 1, id="plain-prefill"),
        pytest.param("two-model-near", SAMPLING, True, 1, id="two-model-prefill"),
    ],
)
def test_a_failing_target_fails_every_row_with_a_message(
    target: CausalLM,
    near_draft: CausalLM,
    plain: PlainReference,
    drafter: str,
    params: SamplingParams,
    device_round: bool,
    at: int,
) -> None:
    expected = plain(PROMPTS, params, MAX_TOKENS)
    model: Any = FailingModel(target, at=at)
    d, depth = _drafter(drafter, target, near_draft)
    tokens, results = run(
        model, PROMPTS, params, d, depth, MAX_TOKENS, device_round=device_round
    )
    assert model.calls >= at
    for t, e, r in zip(tokens, expected, results, strict=True):
        assert r.finish == "failed"
        assert r.error is not None
        assert "TargetFault" in r.error and "device lost" in r.error
        assert t == e[: len(t)]  # what was published before the fault is plain output
    assert any(tokens) == (at > 1)


# --- deliver, directly -----------------------------------------------------------


def test_deliver_reports_the_tokens_published_before_a_failure() -> None:
    sink = RaisingSink(at=3)
    acc = Acceptance((5, 6, 7), (5, 6, 7, 8), 3, "continue")
    d = deliver(acc, sink, [-0.1, -0.2, -0.3, -0.4])
    assert (d.published, d.finish) == (2, "failed")
    assert d.error == "OSError: consumer went away"
    assert sink.tokens == [5, 6] and sink.logprobs == [-0.1, -0.2]


def test_deliver_passes_the_walks_finish_when_the_consumer_takes_everything() -> None:
    for finish, expected in (
        ("continue", None),
        ("stop", "stop"),
        ("length", "length"),
    ):
        sink = CollectSink()
        d = deliver(Acceptance((), (4, 5), 0, finish), sink, None)  # type: ignore[arg-type]
        assert (d.published, d.finish, sink.tokens) == (2, expected, [4, 5])
        assert sink.logprobs == [None, None]


def test_deliver_checks_cancellation_before_every_token() -> None:
    sink = CollectSink()
    d = deliver(
        Acceptance((), (4, 5, 6), 0, "continue"),
        sink,
        None,
        lambda: len(sink.tokens) == 2,
    )
    assert (d.published, d.finish, sink.tokens) == (2, "cancelled", [4, 5])
