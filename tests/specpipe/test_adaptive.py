"""Adaptive drafting: the depth chooser, the gate, and losslessness with it on."""

from __future__ import annotations

import itertools
import math
import statistics
from pathlib import Path

import pytest
from attrs import evolve

from schemas.request import GenerationLimits, SamplingParams
from specpipe.adaptive import (
    AdaptivePolicy,
    CostModel,
    ObservedCosts,
    RowAdaptation,
    best_depth,
    best_of,
    expected_tokens,
    geometric,
)
from specpipe.api import load
from tests.cli.conftest import write_tiny_model

GPU_LIKE = CostModel(
    verify_ms=(10.0, 10.2, 10.4, 10.6, 10.8, 11.0, 11.2, 11.4), draft_ms=1.0
)
# the shape measured for Qwen2.5-Coder 1.5B bf16 on a 2-core CPU (window of 3, 5, 7:
# 1.7x, 2.3x, 3.1x a single step) with a 0.5B draft at a third of a step
CPU_LIKE = CostModel(verify_ms=(10.0, 13.5, 17.0, 20.0, 23.0, 27.0, 31.0), draft_ms=3.3)
FREE_DRAFT_LINEAR = CostModel(verify_ms=(10.0, 20.0, 30.0, 40.0))


def row_with(accepted: int, trials: int) -> RowAdaptation:
    """A row that kept `accepted` of `trials` one-draft rounds (undecayed)."""
    row = RowAdaptation(fresh=False)
    builder = AdaptivePolicy(CPU_LIKE, decay=1.0)
    for i in range(trials):
        row.observe(1, 1 if i < accepted else 0, builder)
    return row


def brute_force(alpha: float, cost: CostModel, max_depth: int) -> int:
    rates = [expected_tokens(alpha, d) / cost.round_ms(d) for d in range(max_depth + 1)]
    return max(range(max_depth + 1), key=lambda d: (rates[d], -d))


@pytest.mark.parametrize(
    ("alpha", "cost", "max_depth", "expected"),
    [
        (0.9, GPU_LIKE, 7, 7),  # verify nearly free, drafts cheap: as deep as allowed
        (0.0, GPU_LIKE, 7, 0),  # nothing is ever accepted: plain
        (0.5, GPU_LIKE, 7, 2),
        (0.9, CPU_LIKE, 6, 3),
        (0.8, CPU_LIKE, 6, 1),
        (0.6, CPU_LIKE, 6, 0),  # a window costs more than it publishes
        (0.99, FREE_DRAFT_LINEAR, 3, 0),  # cost grows as fast as tokens can: never wins
    ],
)
def test_chooser_picks_the_analytic_best(
    alpha: float, cost: CostModel, max_depth: int, expected: int
) -> None:
    depth, gain = best_depth(alpha, cost, max_depth)
    assert depth == expected == brute_force(alpha, cost, max_depth)
    assert (gain > 1.0) == (depth > 0)


def test_expected_tokens_geometric() -> None:
    assert expected_tokens(0.5, 0) == 1.0
    assert expected_tokens(0.5, 3) == pytest.approx(1.875)
    assert expected_tokens(1.0, 4) == 5.0


def test_cost_model_extrapolates_linearly() -> None:
    assert CPU_LIKE.verify(9) == pytest.approx(31.0 + 2 * 4.0)
    assert CostModel((5.0,)).verify(9) == 5.0


def _gated_choices(row: RowAdaptation, policy: AdaptivePolicy, n: int) -> list[int]:
    """n choices of a row whose every probe is rejected, one plain step per 0."""
    choices = []
    for _ in range(n):
        depth = row.choose(policy, 4)
        choices.append(depth)
        if depth == 0:
            row.decoded_plainly(1)
        else:
            row.observe(depth, 0, policy)
    return choices


def test_gate_closes_and_probes_with_backoff() -> None:
    # probe_share 1: the cost budget never binds here (tested below)
    policy = AdaptivePolicy(
        CPU_LIKE, probe_every=4, max_probe_every=16, probe_share=1.0
    )
    row = RowAdaptation()
    for _ in range(6):  # every draft rejected: the estimate drops, the gate closes
        row.observe(2, 0, policy)
    choices = _gated_choices(row, policy, 60)
    probes = [i for i, depth in enumerate(choices) if depth]
    # a fresh row probes at once (its draft has just read the prompt), then
    # the wait doubles after each probe that stays gated, up to the cap
    assert probes[0] == 0
    gaps = [b - a - 1 for a, b in itertools.pairwise(probes)]
    assert gaps == [4, 8, 16, 16]
    for _ in range(20):  # the row turns predictable: speculation comes back
        row.observe(4, 4, policy)
    assert row.choose(policy, 4) >= 3
    assert row.interval == 0  # the backoff is reset
    for _ in range(30):  # and unpredictable again: the gate closes, waits, probes
        row.observe(4, 0, policy)
    again = _gated_choices(row, policy, 10)
    assert again[:5] == [
        0,
        0,
        0,
        0,
        1,
    ]  # 4 plain steps (the closing one first), a probe


def test_a_fresh_row_probes_as_deep_as_full_acceptance_would_pay() -> None:
    """The first probe costs no catch-up: it drafts as deep as the best depth
    at alpha = 1, so one round can show a predictable row (here 4 of 4
    accepted opens the gate, where one accepted draft would not)."""
    policy = AdaptivePolicy(CPU_LIKE)
    rounds = policy.cost.rounds(4)
    deepest = best_of(1.0, rounds)[0]
    row = RowAdaptation()
    assert best_of(row.alpha(policy), rounds)[0] == 0  # the prior alone gates
    first = row.choose(policy, 4)
    assert first == deepest > policy.probe_depth
    one = RowAdaptation(fresh=False)
    one.observe(1, 1, policy)  # what a 1-deep probe could show at best
    assert best_of(one.alpha(policy), rounds)[0] == 0
    row.observe(first, first, policy)
    assert row.choose(policy, 4) > 0


def test_probe_steps_bound_plain_bursts() -> None:
    policy = AdaptivePolicy(CPU_LIKE, probe_every=4, probe_share=1.0)
    row = row_with(0, 20)
    assert row.choose(policy, 4) == 0
    assert row.steps_to_probe() == 4
    row.decoded_plainly(3)
    assert row.steps_to_probe() == 1
    row.decoded_plainly(1)
    assert row.choose(policy, 4) == 1


def test_estimate_tracks_acceptance() -> None:
    policy = AdaptivePolicy(GPU_LIKE, prior_weight=0.0, decay=1.0)
    row = RowAdaptation()
    row.observe(4, 4, policy)  # 4 successes, no failure
    row.observe(4, 1, policy)  # 1 success, 1 failure
    assert row.alpha(policy) == pytest.approx(5 / 6)


@pytest.mark.parametrize("cost", [GPU_LIKE, CPU_LIKE])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_adaptive_output_equals_plain(
    tmp_path: Path, cost: CostModel, temperature: float
) -> None:
    target = write_tiny_model(tmp_path / "target")
    draft = write_tiny_model(tmp_path / "draft", seed=5)
    prompts = ["def fibonacci(n):", "Hello world", "for i in range(10):\n"]
    sampling = SamplingParams(temperature=temperature, top_k=50, seed=2)
    limits = GenerationLimits(max_tokens=48)
    plain = (
        load(str(target)).unwrap().generate_batch(prompts, sampling, limits).unwrap()
    )
    for spec in (str(target), str(draft), "ngram"):
        pipeline = load(
            str(target), draft=spec, num_draft_tokens=4, adaptive=cost
        ).unwrap()
        results = pipeline.generate_batch(prompts, sampling, limits).unwrap()
        assert [r.tokens for r in results] == [r.tokens for r in plain]
        assert all(sum(n for _, n in r.stats.depths) > 0 for r in results)


def test_plain_step_cost_is_the_pipelined_one() -> None:
    cost = CostModel(verify_ms=(10.0, 11.0, 12.0), draft_ms=1.0, plain_ms=7.0)
    assert cost.round_ms(0) == 7.0
    assert cost.round_ms(2) == 12.0 + 2 * 1.0
    assert CostModel(verify_ms=(10.0,)).round_ms(0) == 10.0  # not measured: a lone step
    # a pipelined plain step that cheap makes a 2-token window at 14 ms lose
    # even at full acceptance: 2 tokens / 14 ms < 1 token / 7 ms
    assert best_depth(1.0, CostModel((10.0, 14.0), plain_ms=7.0), 1)[0] == 0


def test_a_draft_that_cannot_win_is_never_tried() -> None:
    # overhead-bound GPU: a 2-wide window costs 3 plain steps, a draft step
    # almost one; even full acceptance loses, so the row never probes
    cost = CostModel(verify_ms=(5.0, 12.0, 12.0, 12.0), draft_ms=3.6, plain_ms=4.0)
    policy = AdaptivePolicy(cost, probe_every=2)
    row = RowAdaptation()
    choices = []
    for _ in range(50):
        choices.append(row.choose(policy, 3))
        row.decoded_plainly(1)
    assert choices == [0] * 50
    assert row.steps_to_probe() is None


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_gated_rows_catch_up_through_padded_windows_losslessly(
    tmp_path: Path, temperature: float
) -> None:
    """A gated two-model row's draft catches up on 9, 17, ... tokens at each
    probe; with GPU bucketing (forced here on the CPU) that window is padded
    to 16, 32, ...: the padding must change nothing."""
    from attrs import evolve

    target = write_tiny_model(tmp_path / "target")
    draft = write_tiny_model(tmp_path / "draft", seed=5)  # disagrees: the gate closes
    prompts = ["def fibonacci(n):", "Hello world"]
    sampling = SamplingParams(temperature=temperature, top_k=50, seed=2)
    limits = GenerationLimits(max_tokens=96)
    plain = (
        load(str(target)).unwrap().generate_batch(prompts, sampling, limits).unwrap()
    )
    pipeline = load(
        str(target), draft=str(draft), num_draft_tokens=4, adaptive=CPU_LIKE
    ).unwrap()
    assert pipeline.draft is not None and pipeline.adaptive is not None
    # the synthetic costs decide (measured ones of a tiny model would not gate)
    pipeline = evolve(pipeline, adaptive=evolve(pipeline.adaptive, observe_costs=False))
    for bucket in (False, True):
        drafter = evolve(pipeline.draft.drafter, bucket_catch_up=bucket)  # type: ignore[misc]
        padded = evolve(pipeline, draft=evolve(pipeline.draft, drafter=drafter))
        results = padded.generate_batch(prompts, sampling, limits).unwrap()
        assert [r.tokens for r in results] == [r.tokens for r in plain]
        for r in results:
            depths = dict(r.stats.depths)
            assert depths.get(0, 0) > 0 and depths.get(1, 0) >= 2  # gated, probed again


def test_observed_costs_replace_and_rescale_the_calibration() -> None:
    prior = CostModel(
        verify_ms=(10.0, 10.0, 10.0, 10.0, 10.0), draft_ms=0.0, plain_ms=5.0
    )
    costs = ObservedCosts(prior, window=3)
    assert costs.rounds(4) == (5.0, 10.0, 10.0, 10.0, 10.0)  # nothing seen: the prior
    for ms in (20.0, 14.0, 16.0, 400.0, 16.0):  # depth 2; an outlier in the window
        costs.observe(2, ms, batch=1)
    # depth 2 measured (median of the last 3: 16, 400, 16), other depths scaled by 1.6
    assert costs.rounds(4) == pytest.approx((8.0, 16.0, 16.0, 16.0, 16.0))
    costs.observe(0, 4.0, batch=1)
    costs.observe(4, 30.0, batch=1)
    rounds = costs.rounds(4)
    assert rounds[0] == 4.0 and rounds[2] == 16.0 and rounds[4] == 30.0
    assert rounds[1] == pytest.approx(10.0 * statistics.median([1.6, 3.0]))
    costs.observe(1, 9.0, batch=2)  # another batch size: start over
    assert costs.rounds(2) == pytest.approx((4.5, 9.0, 10.0 * 0.9))


def test_a_row_follows_measured_round_costs() -> None:
    # calibrated: deep n-gram windows look free; measured: each drafted
    # position costs ~0.4 ms more (the H200 case), so a row whose drafts stop
    # agreeing after ~1 position does best at a shallow depth
    prior = CostModel(verify_ms=(5.0, *([8.0] * 8)), plain_ms=5.0)
    policy = AdaptivePolicy(prior)
    row = row_with(9, 19)  # alpha ~0.5
    assert row.choose(policy, 8) == 8  # the calibration alone: deepest
    measured = tuple([5.0] + [7.5 + 0.4 * d for d in range(1, 9)])
    assert row.choose(policy, 8, measured) <= 3


def test_plain_decoding_is_timed_first_at_each_batch_size() -> None:
    costs = ObservedCosts(GPU_LIKE)
    assert costs.plain_unmeasured(2)
    costs.observe(3, 12.0, batch=2)
    assert costs.plain_unmeasured(2)
    costs.observe(0, 5.0, batch=2)
    assert not costs.plain_unmeasured(2)
    assert costs.plain_unmeasured(1)  # a row left: its costs start over


# drafting barely pays even at full acceptance: 5 tokens for 4.6 plain steps
MARGINAL = CostModel(verify_ms=(10.0, 18.0, 26.0, 34.0, 42.0), draft_ms=1.0)
# windows as cheap as a plain step: ~5x at full acceptance, whatever the scale
# the tiny model's measured rounds put on every depth
WINNING = CostModel(verify_ms=(10.0,) * 5, draft_ms=0.1)


@pytest.mark.parametrize(
    ("cost", "timed"), [(WINNING, False), (MARGINAL, True)], ids=["wins", "marginal"]
)
def test_a_run_times_plain_steps_only_when_they_decide(
    tmp_path: Path, cost: CostModel, timed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The run's own round timings would replace the cost model (the tiny
    # target drafting for itself makes every draft cost a step, and a busy
    # machine's timings move the predicted gain across the margin): keep the
    # given costs, so the choice to time plain steps depends on them alone.
    monkeypatch.setattr(ObservedCosts, "observe", lambda *_args, **_kw: None)
    target = write_tiny_model(tmp_path / "target")
    limits = GenerationLimits(max_tokens=24)
    prompts = ["def fibonacci(n):", "Hello world"]
    plain = load(str(target)).unwrap().generate_batch(prompts, SamplingParams(), limits)
    # the target drafting for itself: every draft is accepted
    pipeline = load(str(target), draft=str(target), num_draft_tokens=4, adaptive=cost)
    results = (
        pipeline.unwrap().generate_batch(prompts, SamplingParams(), limits).unwrap()
    )
    assert [r.tokens for r in results] == [r.tokens for r in plain.unwrap()]
    for r in results:
        assert sum(n for _, n in r.stats.depths) > 0  # it drafted
        # plain steps were timed only where drafting's predicted gain is marginal
        assert (r.stats.gated_share > 0) == timed


def test_plain_cost_decides_only_with_evidence_and_a_small_gain() -> None:
    cost = CostModel(verify_ms=(10.0, 11.0, 12.0, 13.0, 14.0, 15.0, 16.0), draft_ms=1.0)
    policy = AdaptivePolicy(cost)
    rounds = cost.rounds(6)
    assert not RowAdaptation().plain_decides(policy, rounds)  # drafts first
    sure = row_with(18, 19)
    assert best_of(sure.alpha(policy), rounds)[1] >= policy.plain_margin
    assert not sure.plain_decides(policy, rounds)
    doubtful = row_with(2, 10)
    assert best_of(doubtful.alpha(policy), rounds)[1] < policy.plain_margin
    assert doubtful.plain_decides(policy, rounds)


@pytest.mark.parametrize(
    ("catch_up_ms", "share", "wait"),
    [
        # a probe costs 16.8 ms (a 1-deep round) and publishes ~1 token of a
        # 10 ms plain step: 6.8 ms extra (alpha ~0 after rejections)
        (0.0, 0.02, 34),  # 6.8 / (0.02 * 10) plain steps
        (0.0, 0.10, 7),  # ceil(6.8 / 1.0)
        (0.5, 0.10, 14),  # 6.8 / (1.0 - 0.5): each waited step adds catch-up
        (0.2, 0.02, None),  # catch-up dearer per token than the share: never
    ],
)
def test_probes_spend_at_most_their_share_of_plain_time(
    catch_up_ms: float, share: float, wait: int | None
) -> None:
    cost = evolve(CPU_LIKE, catch_up_ms=catch_up_ms)
    policy = AdaptivePolicy(cost, probe_every=4, probe_share=share)
    row = row_with(0, 200)
    assert row.choose(policy, 4) == 0  # the gate closes
    alpha = row.alpha(policy)
    expected = (
        None
        if wait is None
        else max(
            4, math.ceil((16.8 - (1 + alpha) * 10.0) / (share * 10.0 - catch_up_ms))
        )
    )
    assert expected == wait or wait is None
    assert row.steps_to_probe() == wait
    if wait is None:
        return
    row.decoded_plainly(wait - 1)
    assert row.choose(policy, 4) == 0
    row.decoded_plainly(1)
    assert row.choose(policy, 4) == 1


@pytest.mark.parametrize(
    ("timed", "share", "expected"),
    [
        (frozenset({0, 3}), 0.15, 4),  # 2, 4, 5, 6 are within 15 %: the best of them
        (frozenset({0, 3}), 0.02, 3),  # none within 2 %
        (frozenset({0, 3, 4}), 0.15, 2),  # then the next-best untimed
        (frozenset({0, 2, 3, 4, 5, 6}), 0.15, 3),  # every candidate timed
        (frozenset({0}), 0.15, 3),  # the best itself is timed first
    ],
)
def test_an_untimed_depth_near_the_best_is_tried(
    timed: frozenset[int], share: float, expected: int
) -> None:
    from specpipe.adaptive import untimed_near_best

    # the CPU calibration of 2026-12-01 (windows of 6-7 read high)
    rounds = (546.0, 781.0, 917.0, 1118.0, 1373.0, 1761.0, 1939.0)
    alpha = 0.91
    best, _ = best_of(alpha, rounds)
    assert best == 3
    rates = [expected_tokens(alpha, d) / rounds[d] for d in range(7)]
    assert 0.85 < rates[6] / rates[3] < 0.95 and rates[4] > rates[6]
    assert (
        untimed_near_best(geometric(alpha, 6), rounds, best, timed, share) == expected
    )


def test_a_row_explores_untimed_depths_then_follows_the_timed_costs() -> None:
    policy = AdaptivePolicy(
        CostModel(verify_ms=(10.0,)), prior_alpha=0.91, prior_weight=1e6
    )
    row = RowAdaptation(fresh=False)
    prior = (546.0, 781.0, 917.0, 1118.0, 1373.0, 1761.0, 1939.0)
    timed: dict[int, float] = {0: 546.0, 3: 1118.0}
    chosen = []
    for _ in range(6):
        rounds = tuple(timed.get(d, prior[d]) for d in range(7))
        depth = row.choose(policy, 6, rounds, frozenset(timed))
        chosen.append(depth)
        # the run times the round: deep windows cost what the fixed runs measured
        timed[depth] = {4: 1346.0, 5: 1600.0, 6: 1706.0}.get(depth, rounds[depth])
    # each near-best untimed depth once, best predicted first; timed, depth 6
    # turns out best (5.37 tokens in 1706 ms), and the row stays there
    assert chosen == [4, 2, 6, 5, 6, 6]


@pytest.mark.parametrize("kept", [(0, 0), (1, 0, 1), (1, 1, 1, 0)])
def test_positional_acceptance_of_one_deep_rounds_is_the_shared_rate(
    kept: tuple[int, ...],
) -> None:
    """Rounds of one draft inform only the first position: there the two
    estimates are the same number (each piece of evidence counted once)."""
    policy = AdaptivePolicy(CPU_LIKE)
    row = RowAdaptation(fresh=False)
    for k in kept:
        row.observe(1, k, policy)
    positional = row.expected(policy, 1)[1]
    assert positional == pytest.approx(
        row.expected(evolve(policy, positional=False), 1)[1]
    )
    assert positional == pytest.approx(1.0 + row.alpha(policy))


@pytest.mark.parametrize(
    ("pattern", "truth"),
    [
        # bursts: a round misses its first draft or keeps all six
        ((0, 6), [1.0 + 0.5 * d for d in range(7)]),
        # a phrase of four the draft always gets, then a miss
        ((4,), [1.0 + min(d, 4) for d in range(7)]),
    ],
    ids=["bursts", "phrase"],
)
def test_positional_acceptance_is_closer_to_the_observed_pattern(
    pattern: tuple[int, ...], truth: list[float]
) -> None:
    """Windows of six, kept as `pattern` repeats: the tokens a round of depth
    d publishes on average is `truth[d]`. One shared rate misses it both ways
    (over for bursts, under for a fixed phrase); per position it is near."""
    cost = CostModel(verify_ms=(10.0, 11.0, 12.0, 13.0, 14.0, 15.0, 16.0), draft_ms=2.0)
    positional = AdaptivePolicy(cost, decay=1.0)
    shared = evolve(positional, positional=False)
    row = RowAdaptation(fresh=False)
    for _ in range(6):
        for kept in pattern:
            row.observe(6, kept, positional)
    deep = row.expected(positional, 6)
    flat = row.expected(shared, 6)
    for d in range(1, 7):
        assert abs(deep[d] - truth[d]) < abs(flat[d] - truth[d])
    if pattern == (4,):
        # depth 4 is best (a fifth draft is never kept); the shared rate,
        # underrating the phrase, stops short of it
        assert row.choose(positional, 6, cost.rounds(6)) == 4
        assert row.choose(shared, 6, cost.rounds(6)) < 4


def test_the_gate_waits_for_evidence_before_closing() -> None:
    """A 1-deep round costs 1.4 plain steps here, so drafting needs a first
    draft kept more than 40 % of the time. One rejection is not evidence of
    that; eight are."""
    cost = CostModel(verify_ms=(10.0, 13.0, 16.0), draft_ms=1.0)
    hopeful = AdaptivePolicy(cost)
    strict = evolve(hopeful, gate_optimism=0.0)
    once = row_with(0, 1)
    assert once.expected(hopeful, 2)[1] < 1.4  # the estimate alone would gate
    assert once.choose(strict, 2) == 0
    assert row_with(0, 1).choose(hopeful, 2) > 0
    assert row_with(0, 8).choose(hopeful, 2) == 0


def test_load_drafts_adaptively_by_default(tmp_path: Path) -> None:
    target = write_tiny_model(tmp_path / "target")
    assert load(str(target)).unwrap().adaptive is None  # no draft, nothing to adapt
    default = load(str(target), draft="ngram", num_draft_tokens=4).unwrap()
    assert default.adaptive is not None
    assert default.adaptive.cost.verify_ms  # a calibration of this machine
    assert len(default.adaptive.cost.verify_ms) >= 5  # windows up to 1 + 4 drafts
    fixed = load(
        str(target), draft="ngram", num_draft_tokens=4, adaptive=False
    ).unwrap()
    assert fixed.adaptive is None
