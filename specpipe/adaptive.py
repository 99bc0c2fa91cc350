"""Adaptive drafting: each round, each row drafts as deep as pays off here.

A row's drafts are accepted position by position: with one probability
alpha (estimated from the row's own history) a window of depth d publishes
on average

    E(d) = 1 + alpha + alpha^2 + ... + alpha^d        tokens;

by default each position i has its own probability p_i of being kept once
the drafts before it were (`AdaptivePolicy.positional`), and
E(d) = 1 + p_1 + p_1 p_2 + ... + p_1 ... p_d,

and costs the target's forward over d + 1 positions plus d draft steps, both
measured on this machine (`CostModel`, see specpipe/calibrate.py). The row's
depth maximises E(d) / cost(d). When no depth beats plain decoding (depth 0),
the row is *gated*: it decodes plainly and re-probes with one cheap draft
after `probe_every` plain steps (the wait doubling after each probe that
stays gated), so a prompt that turns back into code regains speculation. Depth never changes the output: every published token is the
target's own sample.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections import Counter
from collections.abc import Sequence

from attrs import define, field, frozen


@frozen
class CostModel:
    """Milliseconds on this machine. `verify_ms[w - 1]`: one target forward over a
    window of width w; `draft_ms`: one draft step; `draft_fixed_ms`: per round;
    `plain_ms`: a plain decode step, pipelined as the loop runs it."""

    verify_ms: tuple[float, ...]
    draft_ms: float = 0.0
    draft_fixed_ms: float = 0.0
    # a plain step as the decode loop runs it (pipelined); 0: verify_ms[0]
    plain_ms: float = 0.0
    # a draft model's extra cost per token it catches up on (a gated row's
    # draft reads the tokens decoded plainly before it can draft again)
    catch_up_ms: float = 0.0

    def verify(self, width: int) -> float:
        if width <= len(self.verify_ms):
            return self.verify_ms[width - 1]
        if len(self.verify_ms) == 1:
            return self.verify_ms[0]
        slope = self.verify_ms[-1] - self.verify_ms[-2]
        return self.verify_ms[-1] + slope * (width - len(self.verify_ms))

    def round_ms(self, depth: int) -> float:
        if depth == 0:
            return self.plain_ms or self.verify(1)
        return self.verify(depth + 1) + depth * self.draft_ms + self.draft_fixed_ms

    def rounds(self, max_depth: int) -> tuple[float, ...]:
        """`round_ms(d)` for d = 0..max_depth."""
        return tuple(self.round_ms(d) for d in range(max_depth + 1))


def expected_tokens(alpha: float, depth: int) -> float:
    return sum(alpha**i for i in range(depth + 1))


def geometric(alpha: float, max_depth: int) -> tuple[float, ...]:
    """`E(d)` for d = 0..max_depth when every draft is kept with probability alpha."""
    return tuple(expected_tokens(alpha, d) for d in range(max_depth + 1))


def best_depth(alpha: float, cost: CostModel, max_depth: int) -> tuple[int, float]:
    """The depth with the highest expected tokens per ms, and its speedup over
    plain decoding (1.0 for depth 0). Ties go to the shallower depth."""
    return best_of(alpha, cost.rounds(max_depth))


def best_of(alpha: float, rounds: tuple[float, ...]) -> tuple[int, float]:
    """`best_depth` over explicit round costs: `rounds[d]` ms for depth d."""
    return best_for(geometric(alpha, len(rounds) - 1), rounds)


@functools.lru_cache(maxsize=4096)
def best_for(
    expected: tuple[float, ...], rounds: tuple[float, ...]
) -> tuple[int, float]:
    """The best depth for `expected[d]` tokens per round of `rounds[d]` ms,
    and its speedup over plain decoding (depth 0)."""
    plain = 1.0 / rounds[0]
    best, best_rate = 0, plain
    for depth in range(1, len(rounds)):
        rate = expected[depth] / rounds[depth]
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = depth, rate
    return best, best_rate / plain


@define
class ObservedCosts:
    """What rounds cost in this run, by depth (0: one plain step): the median
    of the last `window` rounds of each depth the batch ran, at the current
    batch size. The calibration is the prior; a depth the run has measured
    uses its measurement, and one it has not uses the prior scaled by the
    median ratio measured/prior of the drafting depths it has (a machine
    busier or idler than at calibration scales every depth alike). On an H200 the
    calibrated forward of a window missed what a round adds per drafted
    position (sampling and reading the window, the walk, the commit): an
    8-deep n-gram round cost 10.4 ms where the calibration said 8.2, and a
    fixed calibration chose it over a 2-deep round that cost 7.9 ms. The loop
    times a few plain steps first (`plain_unmeasured`), so every depth is
    weighed against plain decoding as it runs now, not as calibrated."""

    prior: CostModel
    window: int = 8
    batch: int = 0
    seen: dict[int, list[float]] = field(factory=dict)

    def observe(self, depth: int, ms: float, batch: int) -> None:
        if batch != self.batch:  # costs depend on the batch size
            self.seen.clear()
            self.batch = batch
        times = self.seen.setdefault(depth, [])
        times.append(ms)
        del times[: -self.window]

    def plain_unmeasured(self, batch: int) -> bool:
        """No plain step timed yet at this batch size."""
        return batch != self.batch or 0 not in self.seen

    def measured(self) -> frozenset[int]:
        """The depths this run has timed at the current batch size."""
        return frozenset(self.seen)

    def rounds(self, max_depth: int) -> tuple[float, ...]:
        prior = self.prior.rounds(max_depth)
        measured = {
            d: statistics.median(t) for d, t in self.seen.items() if d <= max_depth
        }
        ratios = [measured[d] / prior[d] for d in measured if d > 0]
        scale = statistics.median(ratios) if ratios else 1.0
        return tuple(
            measured[d] if d in measured else prior[d] * scale
            for d in range(max_depth + 1)
        )


@frozen
class AdaptivePolicy:
    cost: CostModel
    prior_alpha: float = 0.5
    prior_weight: float = 2.0  # pseudo-observations behind the prior
    decay: float = 0.9  # per round: older evidence fades so a row can change regime
    probe_every: int = 8  # plain steps before a gated row's first re-probe
    max_probe_every: int = 64  # the wait doubles after each probe that stays gated
    # a gated row's probes may cost at most this share of the time it decodes
    # plainly: the gate's loss against plain decoding is bounded by it
    probe_share: float = 0.02
    probe_depth: int = 1  # drafts per probe
    # measure rounds as they run and let the measurements replace the
    # calibration (`ObservedCosts`); off: the calibration alone decides
    observe_costs: bool = True
    # try, once, a depth the run has not timed whose predicted rate is within
    # this share of the best depth's: the calibration behind an untimed depth
    # may be off (a noisy pass), and only a timed round corrects it
    explore: float = 0.15
    # The loop times plain decoding in-run (a few plain steps) only once a
    # row's predicted gain over it falls below this: where drafting clearly
    # wins, a plain step's exact cost cannot change the choice, and timing
    # it cost 4 of 64 tokens at plain speed (bench/RESULTS.md).
    plain_margin: float = 1.25
    # Acceptance by window position: each position's chance of being kept,
    # given that those before it were, estimated on its own (shrunk toward
    # the position before, the first toward `prior_alpha`). Code
    # accepts in bursts (a round that keeps its first drafts tends to keep
    # the rest), which one shared rate underrates for deep windows: at k=6 it
    # predicted 5.0 tokens a round where code published 5.8. Off: one rate.
    positional: bool = True
    # The gate closes only when no depth would win even with each position's
    # rate this many standard errors above its estimate: a row's first
    # rejections (a chat row keeps ~70 % of first drafts) must not gate it
    # for the rest of its reply, as a CPU two-model row rarely re-probes.
    gate_optimism: float = 1.5


@define
class RowAdaptation:
    """One row's acceptance estimate and gate.

    A gated row decodes plainly and probes with one draft after `interval`
    plain steps. A probe is not free (a draft model first catches up on the
    tokens it skipped, and the window is wider than a plain step), so each
    probe that leaves the row gated doubles the wait, up to
    `max_probe_every`: a row that never agrees pays a vanishing share of
    probes, while one that turns predictable again is found within the wait.
    The first choice of a fresh row probes at once when it would gate: the
    draft has just read the prompt, so that probe costs no catch-up, and it
    drafts as deep as the depth that would win at full acceptance (one probe
    of one draft moves the estimate little: a 0.5 prior behind two
    pseudo-observations becomes 0.67 after one acceptance, still gated on a
    CPU where a 1-deep round must publish 1.7 tokens to pay). When the
    cost model says no depth wins even if every draft is accepted (a draft
    nearly as slow as the target, or windows far dearer than plain steps, as
    on an overhead-bound GPU), the row never drafts at all."""

    accepted: float = 0.0
    trials: float = 0.0
    waited: int = 0  # plain steps since the row last drafted
    interval: int = 0  # plain steps to wait before the next probe (0: not gated)
    fresh: bool = True  # no choice made yet
    next_probe: int | None = 0  # gated: plain steps before the next probe (None: never)
    depths: Counter[int] = field(factory=Counter)
    # per window position (0: the first draft), decayed kept / offered counts
    # of rounds whose drafts reached it
    kept_at: list[float] = field(factory=list)
    reached: list[float] = field(factory=list)

    def alpha(self, policy: AdaptivePolicy) -> float:
        num = self.accepted + policy.prior_alpha * policy.prior_weight
        return num / (self.trials + policy.prior_weight)

    def expected(
        self, policy: AdaptivePolicy, max_depth: int, optimism: float = 0.0
    ) -> tuple[float, ...]:
        """`E(d)`, tokens a round of depth d publishes, for d = 0..max_depth;
        with `optimism` z, each position's rate is read z standard errors
        above its estimate (positional model only)."""
        if not policy.positional:
            return geometric(self.alpha(policy), max_depth)
        # The first position starts from the policy's prior, not the row's
        # pooled rate: that rate holds the same evidence, and counting it
        # twice gated a chat row after two rejected probes (bench/RESULTS.md).
        out, reach, prior = [1.0], 1.0, policy.prior_alpha
        for i in range(max_depth):
            kept = self.kept_at[i] if i < len(self.kept_at) else 0.0
            seen = self.reached[i] if i < len(self.reached) else 0.0
            weight = seen + policy.prior_weight
            prior = (kept + policy.prior_weight * prior) / weight
            error = math.sqrt(prior * (1.0 - prior) / weight)
            reach *= min(1.0, prior + optimism * error)
            out.append(out[-1] + reach)
        return tuple(out)

    def choose(
        self,
        policy: AdaptivePolicy,
        max_depth: int,
        rounds: tuple[float, ...] | None = None,
        timed: frozenset[int] | None = None,
    ) -> int:
        """This round's depth. `rounds`: ms per round by depth (default: the
        policy's calibration; the loop passes `ObservedCosts.rounds`);
        `timed`: the depths those costs have measured (None: explore nothing)."""
        fresh, self.fresh = self.fresh, False
        if max_depth == 0:
            return 0
        if rounds is None:
            rounds = policy.cost.rounds(max_depth)
        # even a draft that is always accepted loses to plain decoding on this
        # machine: never probe
        if best_of(1.0, rounds)[0] == 0:
            self.next_probe = None
            return 0
        expected = self.expected(policy, len(rounds) - 1)
        depth, _gain = best_for(expected, rounds)
        if depth > 0:
            self.interval = 0
            if timed is not None and policy.explore > 0:
                return untimed_near_best(expected, rounds, depth, timed, policy.explore)
            return depth
        if fresh:
            # the one probe with no catch-up: as deep as the depth that would
            # win were every draft accepted, so one round gives the estimate
            # up to that many observations instead of one
            return max(self._probe(policy), best_of(1.0, rounds)[0])
        if policy.gate_optimism > 0:
            # gate only once the evidence says so: a depth that wins with
            # each rate `gate_optimism` standard errors up keeps the row on
            hopeful = self.expected(policy, len(rounds) - 1, policy.gate_optimism)
            depth = best_for(hopeful, rounds)[0]
            if depth > 0:
                return depth
        if self.interval == 0:  # the gate closes: wait before probing
            self.interval, self.waited = policy.probe_every, 0
        self.next_probe = self._probe_wait(policy, rounds)
        if self.next_probe is not None and self.waited >= self.next_probe:
            return self._probe(policy)
        return 0

    def plain_decides(self, policy: AdaptivePolicy, rounds: tuple[float, ...]) -> bool:
        """Whether this row's choice may hinge on what a plain step costs: it
        has evidence (a row that has not drafted yet drafts first) and its
        best depth's predicted gain over plain decoding is under
        `policy.plain_margin`."""
        if self.trials == 0:
            return False
        return (
            best_for(self.expected(policy, len(rounds) - 1), rounds)[1]
            < policy.plain_margin
        )

    def _probe_wait(
        self, policy: AdaptivePolicy, rounds: tuple[float, ...]
    ) -> int | None:
        """Plain steps after the last probe before the next may run: at least
        `interval`, and until the probe's extra cost over plain decoding (a
        1-deep round, plus the draft's catch-up on every token decoded since,
        less the tokens it is expected to publish) fits in `probe_share` of
        the plain steps' time. None: it never fits (a catch-up dearer per
        token than the share, as for a 0.5B draft on a 2-core CPU)."""
        plain = rounds[0]
        excess = rounds[1] - self.expected(policy, 1)[1] * plain
        per_step = policy.probe_share * plain - policy.cost.catch_up_ms
        if excess <= 0:
            return self.interval
        if per_step <= 0:
            return None
        return max(self.interval, math.ceil(excess / per_step))

    def _probe(self, policy: AdaptivePolicy) -> int:
        if self.interval == 0:
            self.interval = policy.probe_every
        else:
            self.interval = min(2 * self.interval, policy.max_probe_every)
        self.waited = 0
        return policy.probe_depth  # a cheap draft or two refreshes the estimate

    def steps_to_probe(self) -> int | None:
        """Plain steps this gated row can take before its next probe (None:
        it never probes)."""
        if self.next_probe is None:
            return None
        return max(1, self.next_probe - self.waited)

    def decoded_plainly(self, steps: int) -> None:
        self.waited += steps

    def observe(self, drafted: int, accepted: int, policy: AdaptivePolicy) -> None:
        """A round that offered `drafted` drafts, of which the first `accepted`
        matched: `accepted` successes, plus one failure if the walk met a mismatch."""
        if drafted == 0:
            return  # a gated row keeps its evidence until the next probe
        self.accepted *= policy.decay
        self.trials *= policy.decay
        self.accepted += accepted
        self.trials += accepted + (1 if accepted < drafted else 0)
        reached = min(accepted + 1, drafted)  # positions this round's walk read
        grow = reached - len(self.reached)
        if grow > 0:
            self.kept_at.extend([0.0] * grow)
            self.reached.extend([0.0] * grow)
        for i in range(len(self.reached)):
            self.kept_at[i] *= policy.decay
            self.reached[i] *= policy.decay
            if i < reached:
                self.reached[i] += 1.0
                self.kept_at[i] += 1.0 if i < accepted else 0.0

    def record(self, depth: int) -> None:
        self.depths[depth] += 1


def untimed_near_best(
    expected: tuple[float, ...],
    rounds: tuple[float, ...],
    best: int,
    timed: frozenset[int],
    share: float,
) -> int:
    """`best`, or the untimed drafting depth with the highest predicted rate
    if that rate is within `share` of `best`'s (the deeper on a tie);
    `expected[d]`: tokens a round of depth d publishes."""
    rate = [expected[d] / rounds[d] for d in range(len(rounds))]
    near = [
        d
        for d in range(1, len(rounds))
        if d not in timed and rate[d] >= (1.0 - share) * rate[best]
    ]
    if best not in timed or not near:
        return best
    return max(near, key=lambda d: (rate[d], d))


def round_depth(depths: Sequence[int]) -> int:
    """The batch drafts as deep as its deepest row; shallower rows use a prefix."""
    return max(depths, default=0)
