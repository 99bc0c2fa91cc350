"""The generation loop: the one module that synchronises with the device.

It composes the stages of a round, draft -> verify -> sample_window -> (one
host read) -> walk -> deliver -> commit, and drives rounds until every row
finishes. With `RoundOptions.draft_ahead` the next round's draft is launched
from device values just before the host read, so it runs during the walk and
commit. Plain decoding (no drafter) is the same forward and the same sampler
at window width 1, pipelined: the next step's graph is built from the device
token before the current one is read back.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Generator, Sequence
from functools import partial
from typing import Any, cast

import mlx.core as mx
from attrs import define, evolve, field, frozen

from models.base import CausalLM, ModelOutput
from schemas.request import SamplingParams
from specpipe.adaptive import AdaptivePolicy, ObservedCosts, RowAdaptation
from specpipe.draft import (
    BorrowsTargetCache,
    CapturesRows,
    Drafter,
    DraftRows,
    DraftsAhead,
    DraftState,
    Proposal,
    Resumes,
)
from specpipe.metrics import PhaseTimes, RowMetrics
from specpipe.output import Delivered, FinishReason, TokenSink, TopLogprobs, deliver
from specpipe.prefill import prefill_rows
from specpipe.prompt_cache import Checkpoint, Match, PromptCache
from specpipe.sample_window import sample_window
from specpipe.sampling import read_top_logprobs, token_scores
from specpipe.state import RowState
from specpipe.transaction import Prepared, apply_all, ready
from specpipe.verify import build_window, verify
from specpipe.walk import Acceptance, walk

_async_eval = cast(Callable[..., None], mx.async_eval)


def _ints(array: mx.array) -> list[int]:
    """The host read of an integer array (a synchronisation point)."""
    return cast(list[int], array.tolist())


def _floats(array: mx.array) -> list[float]:
    return cast(list[float], array.tolist())


@frozen
class RowRequest:
    prompt: tuple[int, ...]
    sampling: SamplingParams
    max_tokens: int
    sink: TokenSink
    logprobs: bool = False
    cancelled: Callable[[], bool] | None = None
    # the most likely tokens at each position to report (with logprobs)
    top_logprobs: int = 0
    # at most this many drafts a round for this row (None: the run's depth)
    max_drafts: int | None = None
    # told the row's result as soon as the row ends (with `arrivals`, long
    # before the run returns); what it raises is its own, the row has ended
    on_finish: Callable[[RowResult], None] | None = None


@frozen
class _Scores:
    """The log-probabilities the rows of a step asked for, on the device: the
    chosen tokens' `[N]` and, where a row asked for alternatives, the k most
    likely tokens' ids and log-probabilities `[N, k]` (k: the most any row
    asked for)."""

    chosen: mx.array
    top: tuple[mx.array, mx.array] | None

    @staticmethod
    def asked(
        logits: mx.array,  # [N, V]
        tokens: mx.array,  # [N] int32
        requests: Sequence[RowRequest],
    ) -> _Scores | None:
        """What `requests` (the batch's rows) asked for, or None."""
        if not any(r.logprobs or r.top_logprobs for r in requests):
            return None
        return _Scores(
            *token_scores(logits, tokens, max(r.top_logprobs for r in requests))
        )

    def arrays(self) -> list[mx.array]:
        return [self.chosen, *(self.top or ())]

    def take(self, index: mx.array) -> _Scores:
        """The scores of the positions at `index` `[M]`."""
        top = self.top
        return _Scores(
            self.chosen[index], None if top is None else (top[0][index], top[1][index])
        )

    def read(self) -> _ReadScores:
        """The host read (a synchronisation point)."""
        tops = read_top_logprobs(self.top) if self.top is not None else None
        return _ReadScores(_floats(self.chosen), tops)


@frozen
class _ReadScores:
    chosen: list[float]
    tops: list[TopLogprobs] | None

    def of_row(
        self, start: int, end: int, request: RowRequest
    ) -> tuple[list[float] | None, list[TopLogprobs] | None]:
        """Positions `start .. end - 1`'s, for a row that asked (else None)."""
        if not (request.logprobs or request.top_logprobs):
            return None, None
        tops = None
        if request.top_logprobs and self.tops is not None:
            tops = [t[: request.top_logprobs] for t in self.tops[start:end]]
        return self.chosen[start:end], tops


@define
class RowResult:
    finish: FinishReason
    metrics: RowMetrics
    prompt_seconds: float
    decode_seconds: float = 0.0
    error: str | None = None
    round_ms: list[float] = field(factory=list)
    phase_ms: PhaseTimes | None = None
    depths: dict[int, int] | None = None  # adaptive: choices per depth
    cached_tokens: int = 0  # prompt tokens restored from the prompt cache


@frozen
class RoundOptions:
    depth: int = 0  # the most drafts a row may be asked for in a round
    # Drafts stay on the device until the one host read of the round. Off by
    # default: on an H200 the host-first order measured 20 ms per two-model
    # round against 43 ms device-first (bench/results/probe-h200.json).
    device_round: bool = False
    phase_timing: bool = False
    adaptive: AdaptivePolicy | None = None  # per-row depth from measured costs
    # Drafters that can (`DraftsAhead`: the MTP head's one-layer rounds)
    # launch the next round's drafts before this round's host read, from
    # device arrays only: the launch runs behind the verify window while the
    # host walks and commits, and the next round adopts it when it asks for
    # the same depth of the same rows (else it is dropped, unread).
    draft_ahead: bool = False


@define
class _Batch:
    """The live rows of a run and the state of every participant."""

    model: CausalLM
    cache: Any  # the model's ModelCache
    rows: list[RowState]
    slots: list[int]  # request index of each live row
    draft: DraftRows | None
    eos: frozenset[int]
    draft_error: str | None = None

    def retire(self, keep: list[int]) -> None:
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in keep]
        self.slots = [self.slots[i] for i in keep]
        if keep:
            self.cache = self.cache.take_rows(keep)
            if self.draft is not None:
                try:
                    self.draft = self.draft.take_rows(keep)
                except Exception as exc:
                    self.disable_draft(exc)

    def disable_draft(self, exc: Exception) -> None:
        """A drafter that failed leaves the rows to plain decoding (the output
        is the same); the failure is reported in each row's metrics."""
        self.draft = None
        self.draft_error = f"drafter disabled after {type(exc).__name__}: {exc}"


def generate_rows(
    model: CausalLM,
    requests: Sequence[RowRequest],
    eos_ids: Sequence[int],
    drafter: Drafter | None = None,
    options: RoundOptions | None = None,
    arrivals: Callable[[], Sequence[RowRequest]] | None = None,
    prompt_cache: PromptCache | None = None,
) -> list[RowResult]:
    """Generate every request as one batch of rows; results in request order.

    `arrivals`, if given, is asked between rounds for requests to admit: they
    are prefilled and join the batch (continuous batching); their results
    follow the initial requests', in arrival order. The run ends when no row
    is live and `arrivals` has nothing more.

    `prompt_cache`, if given, starts each prompt from the longest checkpoint
    it begins with and keeps rows' states for later prompts
    (`specpipe.prompt_cache`)."""
    run = _Run(
        model, frozenset(eos_ids), drafter, options or RoundOptions(), prompt_cache
    )
    run.admit(requests)
    while True:
        if arrivals is not None:
            joining = arrivals()
            if joining:
                run.admit(joining)
        if not run.batch.rows:
            break
        run.step(bounded=arrivals is not None)
    return run.collect()


def generate_stepwise(
    model: CausalLM,
    requests: Sequence[RowRequest],
    eos_ids: Sequence[int],
    drafter: Drafter | None = None,
    options: RoundOptions | None = None,
    prompt_cache: PromptCache | None = None,
) -> Generator[None, None, list[RowResult]]:
    """`generate_rows` as a generator that yields after every round (or burst
    of plain steps), so a caller can hand out what the sinks received; its
    return value (StopIteration.value) is the results."""
    run = _Run(
        model, frozenset(eos_ids), drafter, options or RoundOptions(), prompt_cache
    )
    run.admit(requests)
    while run.batch.rows:
        run.step(bounded=True)
        yield
    return run.collect()


class _Run:
    """Everything one `generate_rows` call tracks, per request slot."""

    def __init__(
        self,
        model: CausalLM,
        eos: frozenset[int],
        drafter: Drafter | None,
        options: RoundOptions,
        prompt_cache: PromptCache | None = None,
    ) -> None:
        if prompt_cache is not None:
            prompt_cache.check_model(model)
        self.model = model
        self.prompt_cache = prompt_cache
        self.drafter = drafter if options.depth > 0 else None
        self.options = options
        self.batch = _Batch(model, None, [], [], None, eos)
        self.requests: list[RowRequest] = []
        self.metrics: list[RowMetrics] = []
        self.round_ms: list[list[float]] = []
        self.results: list[RowResult | None] = []
        self.prompt_seconds: list[float] = []
        self.decode_start: list[float] = []
        self.adapt: list[RowAdaptation] = []
        self.cached: list[int] = []  # per slot: prompt tokens restored
        self.costs = (
            ObservedCosts(options.adaptive.cost)
            if options.adaptive is not None and options.adaptive.observe_costs
            else None
        )
        self.phases = PhaseTimes() if options.phase_timing else None

    def admit(self, requests: Sequence[RowRequest]) -> None:
        """Prefill new requests and join them to the live batch."""
        start = time.perf_counter()
        first = len(self.requests)
        slots = list(range(first, first + len(requests)))
        self.requests.extend(requests)
        self.metrics.extend(RowMetrics() for _ in requests)
        self.round_ms.extend([] for _ in requests)
        self.results.extend(None for _ in requests)
        self.adapt.extend(RowAdaptation() for _ in requests)
        self.cached.extend(0 for _ in requests)
        rows = [RowState.start(r.prompt, r.max_tokens, r.sampling) for r in requests]
        # a drafter that failed once stays off for the rest of the run
        drafter = self.drafter if self.batch.draft_error is None else None
        matches = self.lookup(rows, drafter)
        try:
            wants_hidden = drafter is not None and drafter.needs_target_hidden
            cache, hidden = prefill_rows(
                self.model,
                rows,
                wants_hidden,
                [
                    (m.checkpoint.restored_target(), m.length) if m else None
                    for m in matches
                ],
            )
        except Exception as exc:
            elapsed = time.perf_counter() - start
            for slot in slots:
                self.prompt_seconds.append(elapsed)
                self.decode_start.append(time.perf_counter())
                self.finish(
                    slot, "failed", f"prefill failed: {type(exc).__name__}: {exc}"
                )
            return
        opened: DraftRows | None = None
        joined: DraftRows | None = None
        if drafter is not None:
            try:
                if isinstance(drafter, Resumes) and any(matches):
                    states = [m.draft if m else None for m in matches]
                    opened = drafter.resume(rows, hidden, states)
                else:
                    opened = drafter.open(rows, hidden)
                joined = opened
                if self.batch.draft is not None and self.batch.rows:
                    joined = self.batch.draft.join(opened)
            except Exception as exc:
                self.batch.disable_draft(exc)
                opened = joined = None
        self.keep_prompts(rows, matches, cache, opened)
        for slot, match in zip(slots, matches, strict=True):
            self.cached[slot] = match.length if match is not None else 0
        batch = self.batch
        if batch.rows:
            batch.cache = type(cache).concat_rows([batch.cache, cache])
        else:
            batch.cache = cache
        batch.rows = [*batch.rows, *rows]
        batch.slots = [*batch.slots, *slots]
        batch.draft = joined if batch.draft_error is None else None
        now = time.perf_counter()
        self.prompt_seconds.extend(now - start for _ in slots)
        self.decode_start.extend(now for _ in slots)

    def lookup(
        self, rows: Sequence[RowState], drafter: Drafter | None
    ) -> list[Match | None]:
        """Each new row's prompt-cache checkpoint (None: prefill it all)."""
        store = self.prompt_cache
        if store is None:
            return [None] * len(rows)
        namespace = drafter.namespace if isinstance(drafter, Resumes) else None
        needs_draft = drafter is not None and drafter.needs_target_hidden
        if needs_draft and namespace is None:
            # it reads the whole prompt's hidden states and cannot resume
            return [None] * len(rows)
        return [store.lookup(row.tokens, namespace, needs_draft) for row in rows]

    def keep_prompts(
        self,
        rows: Sequence[RowState],
        matches: Sequence[Match | None],
        cache: Any,
        draft: DraftRows | None,
    ) -> None:
        """Record the admission's lookups; keep the prompts' states it computed
        (`PromptCache.capture_prompts`)."""
        store = self.prompt_cache
        if store is None:
            return
        kept: list[Checkpoint] = []
        if store.capture_prompts:
            for b, (row, match) in enumerate(zip(rows, matches, strict=True)):
                length = match.length if match is not None else 0
                if 0 < length + 1 <= row.length:
                    kept.append(self.checkpoint(cache, draft, b, row.tokens[:-1]))
        apply_all(
            [
                partial(store.prepare_use, matches),
                *(partial(store.prepare_insert, c) for c in kept),
            ]
        )

    def keep_state(self, b: int, processed: tuple[int, ...]) -> None:
        """Keep live row b's state, its first `processed` tokens processed
        (a row that ended by a stop or its budget, before it leaves)."""
        store = self.prompt_cache
        if store is None or not processed:
            return
        checkpoint = self.checkpoint(self.batch.cache, self.batch.draft, b, processed)
        apply_all([lambda: store.prepare_insert(checkpoint)])

    @staticmethod
    def checkpoint(
        cache: Any, draft: DraftRows | None, b: int, processed: tuple[int, ...]
    ) -> Checkpoint:
        """Row b's target state and, where its draft rows capture states that
        account for the same tokens (or, for a drafter that does not read the
        target's hidden states, for no more), its draft state."""
        state: DraftState | None = None
        if isinstance(draft, CapturesRows):
            state = draft.capture(b)
            n = len(processed)
            fits = state.processed <= n and (
                state.processed == n or not draft.needs_target_hidden
            )
            state = state if fits else None
        return Checkpoint(processed, cache.take_rows([b], len(processed)), state)

    def finish(self, slot: int, reason: FinishReason, error: str | None = None) -> None:
        if self.batch.draft_error is not None:
            self.metrics[slot].draft_errors.append(self.batch.draft_error)
        result = RowResult(
            reason,
            self.metrics[slot],
            self.prompt_seconds[slot],
            time.perf_counter() - self.decode_start[slot],
            error,
            self.round_ms[slot],
            self.phases,
            dict(self.adapt[slot].depths)
            if self.options.adaptive is not None
            else None,
            cached_tokens=self.cached[slot],
        )
        self.results[slot] = result
        told = self.requests[slot].on_finish
        if told is not None:
            with contextlib.suppress(Exception):  # the row has ended as it has
                told(result)

    def fail_live(self, what: str, exc: Exception) -> None:
        message = f"{what} failed: {type(exc).__name__}: {exc}"
        for slot in self.batch.slots:
            self.finish(slot, "failed", message)
        self.batch.rows, self.batch.slots = [], []

    def step(self, bounded: bool) -> None:
        """One speculative round, or a burst of pipelined plain steps."""
        batch, options = self.batch, self.options
        adapt = self.adapt if options.adaptive is not None else None
        # A drafter that reads the target's hidden states must see every round.
        pipelined = not _needs_history(batch) and (
            batch.draft is None or not batch.draft.needs_target_hidden
        )
        costs = self.costs
        # Adaptive: plain decoding as it runs now is what every depth competes
        # with; time it (again when the batch size changes) once a row's
        # choice may hinge on it.
        measure_plain = (
            costs is not None
            and pipelined
            and batch.draft is not None
            and costs.plain_unmeasured(len(batch.rows))
            and _plain_decides(batch, options, adapt, costs)
        )
        if measure_plain:
            depths = [0] * len(batch.rows)
        else:
            rounds = costs.rounds(options.depth) if costs is not None else None
            timed = costs.measured() if costs is not None else None
            depths = _choose_depths(batch, options, adapt, rounds, timed, self.requests)
        if max(depths) == 0 and pipelined:
            # Plain decoding: no drafter, or every row gated off until its next
            # probe; bounded so that arrivals and probes get their turn.
            steps = None
            if measure_plain:
                steps = _MEASURE_PLAIN_STEPS
            elif batch.draft is not None and adapt is not None:
                # until the first gated row's next probe
                waits = [adapt[s].steps_to_probe() for s in batch.slots]
                steps = min((w for w in waits if w is not None), default=None)
            if bounded:
                steps = min(steps or _ADMIT_EVERY, _ADMIT_EVERY)
            before = {s: self.metrics[s].gated for s in batch.slots}
            live = len(batch.rows)
            t0 = time.perf_counter()
            try:
                _plain_pipelined(
                    batch,
                    self.requests,
                    self.metrics,
                    self.round_ms,
                    self.finish,
                    steps,
                    self.keep_state if self.prompt_cache is not None else None,
                )
            except Exception as exc:
                self.fail_live("target forward", exc)
                return
            if adapt is not None:
                taken = 0
                for slot, gated in before.items():
                    taken = max(taken, self.metrics[slot].gated - gated)
                    adapt[slot].decoded_plainly(self.metrics[slot].gated - gated)
                if self.costs is not None and taken:
                    ms = (time.perf_counter() - t0) * 1000.0 / taken
                    self.costs.observe(0, ms, live)
            return
        t0 = time.perf_counter()
        try:
            outcome = _speculative_round(
                batch, self.requests, depths, options, self.metrics, self.phases
            )
        except Exception as exc:
            self.fail_live("target forward", exc)
            return
        elapsed = (time.perf_counter() - t0) * 1000.0
        if self.costs is not None:
            # a round costs what its window was: the drafts offered (an n-gram
            # lookup may offer fewer than the depth asked for)
            offered = max((drafted for _, drafted, _ in outcome), default=0)
            self.costs.observe(offered, elapsed, len(batch.rows))
        keep: list[int] = []
        for i, (slot, (delivered, drafted, accepted)) in enumerate(
            zip(batch.slots, outcome, strict=True)
        ):
            self.round_ms[slot].append(elapsed)
            if options.adaptive is not None:
                self.adapt[slot].observe(drafted, accepted, options.adaptive)
                if depths[i] == 0:
                    self.adapt[slot].decoded_plainly(1)
            if delivered.finish is None:
                keep.append(i)
                continue
            if _keeps_state(delivered):
                # committed as it ended (`_commit`): all but its last token
                self.keep_state(i, batch.rows[i].tokens[:-1])
            self.finish(slot, delivered.finish, delivered.error)
        batch.retire(keep)

    def collect(self) -> list[RowResult]:
        done = [r for r in self.results if r is not None]  # (`finish` made each)
        assert len(done) == len(self.requests)
        return done


_ADMIT_EVERY = 8  # plain steps between looks for arrivals
_MEASURE_PLAIN_STEPS = 4  # adaptive: plain steps that time plain decoding in-run


def _choose_depths(
    batch: _Batch,
    options: RoundOptions,
    adapt: list[RowAdaptation] | None,
    rounds: tuple[float, ...] | None = None,
    timed: frozenset[int] | None = None,
    requests: Sequence[RowRequest] = (),
) -> list[int]:
    """Each live row's depth this round (0: plain), capped by its budget and
    by its request's `max_drafts`."""
    if batch.draft is None:
        return [0] * len(batch.rows)
    depths = []
    for row, slot in zip(batch.rows, batch.slots, strict=True):
        depth = options.depth
        if adapt is not None and options.adaptive is not None:
            depth = adapt[slot].choose(options.adaptive, options.depth, rounds, timed)
            adapt[slot].record(depth)
        # Drafts past a row's budget could never be published.
        depth = min(depth, row.remaining - 1)
        cap = requests[slot].max_drafts if requests else None
        if cap is not None:
            depth = min(depth, cap)
        depths.append(max(0, depth))
    return depths


def _plain_decides(
    batch: _Batch,
    options: RoundOptions,
    adapt: list[RowAdaptation] | None,
    costs: ObservedCosts,
) -> bool:
    """Whether some row's next choice may hinge on a plain step's cost."""
    policy = options.adaptive
    if adapt is None or policy is None:
        return True
    rounds = costs.rounds(options.depth)
    return any(adapt[slot].plain_decides(policy, rounds) for slot in batch.slots)


def _needs_history(batch: _Batch) -> bool:
    return any(row.sampling.needs_history for row in batch.rows)


def _speculative_round(
    batch: _Batch,
    requests: Sequence[RowRequest],
    depths: Sequence[int],
    options: RoundOptions,
    metrics: list[RowMetrics],
    phases: PhaseTimes | None,
) -> list[tuple[Delivered, int, int]]:
    """One round; per row (delivery, drafts offered, drafts accepted)."""
    rows = batch.rows
    mark = time.perf_counter()

    def lap() -> float:
        nonlocal mark
        now = time.perf_counter()
        elapsed, mark = (now - mark) * 1000.0, now
        return elapsed

    proposal = Proposal.empty(len(rows))
    depth = max(depths)
    if batch.draft is not None and depth > 0:
        try:
            proposal = (
                batch.draft.propose_over(batch.cache, rows, depth)
                if isinstance(batch.draft, BorrowsTargetCache)
                else batch.draft.propose(rows, depth)
            )
            if proposal.device is not None and (
                not options.device_round or phases is not None
            ):
                # read first (host-first order); the device drafts and the
                # drafter's note stay for the window and the next round
                read = _ints(proposal.device.reshape(-1))
                proposal = evolve(proposal, host=proposal.resolve(read))
        except Exception as exc:
            batch.disable_draft(exc)
            proposal = Proposal.empty(len(rows))
    if phases is not None:
        phases.draft += lap()
    window = build_window(rows, proposal)
    verified = verify(batch.model, batch.cache, window)
    if phases is not None:
        mx.eval(verified.logits)
        phases.verify += lap()
    samples = sample_window(verified.logits, window.ids, rows)  # [B, W]
    B, W = samples.shape
    reads: list[mx.array] = []
    unread = proposal.device is not None and proposal.host is None
    if unread:
        assert proposal.device is not None
        reads.append(proposal.device.reshape(-1).astype(mx.int32))
    reads.append(samples.reshape(-1))
    flat = mx.concatenate(reads) if len(reads) > 1 else reads[0]
    scores = _Scores.asked(
        verified.logits.reshape(B * W, -1),
        samples.reshape(-1),
        [requests[s] for s in batch.slots],
    )
    if isinstance(
        verified, ModelOutput
    ):  # the draws, for drafters that derive from them
        verified = evolve(verified, draws=samples)
    if options.draft_ahead:
        _launch_ahead(
            batch,
            proposal,
            depths,
            verified,
            [flat, *(scores.arrays() if scores else ())],
        )
    host = _ints(flat)
    scored = scores.read() if scores is not None else None
    drafted_flat = host[: len(host) - B * W]
    tokens = host[len(host) - B * W :]
    # A row asked for fewer drafts than the batch drafted uses their prefix.
    drafts = tuple(
        d[:limit]
        for d, limit in zip(
            proposal.resolve(drafted_flat if unread else None),
            depths,
            strict=True,
        )
    )
    if phases is not None:
        phases.sample += lap()
    acceptances: list[Acceptance] = []
    delivered: list[Delivered] = []
    for b, (row, slot) in enumerate(zip(rows, batch.slots, strict=True)):
        acc = walk(
            drafts[b],
            tokens[b * W : b * W + len(drafts[b]) + 1],
            row.remaining,
            batch.eos,
        )
        acceptances.append(acc)
        row_lps, row_tops = (
            scored.of_row(b * W, (b + 1) * W, requests[slot])
            if scored is not None
            else (None, None)
        )
        delivered.append(
            deliver(
                acc,
                requests[slot].sink,
                row_lps,
                requests[slot].cancelled,
                row_tops,
            )
        )
        metrics[slot].record(len(drafts[b]), acc.accepted, delivered[-1].published)
    ends = [
        tokens[b * W + min(len(acc.emitted), W - 1)]
        for b, acc in enumerate(acceptances)
    ]
    _commit(batch, proposal, drafts, acceptances, delivered, verified, ends)
    if phases is not None:
        phases.commit += lap()
    return [
        (d, len(drafted), acc.accepted)
        for d, drafted, acc in zip(delivered, drafts, acceptances, strict=True)
    ]


def _launch_ahead(
    batch: _Batch,
    proposal: Proposal,
    depths: Sequence[int],
    verified: Any,
    reads: Sequence[mx.array],
) -> None:
    """The next round's drafts launched now (`RoundOptions.draft_ahead`),
    where every row was offered every draft of a device proposal: the
    round's reads are queued first, so that the host read waits for them
    and not for the launch."""
    draft = batch.draft
    if (
        not isinstance(draft, DraftsAhead)
        or not isinstance(verified, ModelOutput)
        or proposal.device is None
        or any(d < proposal.depth for d in depths)
    ):
        return
    _async_eval(*reads)
    try:
        ahead = draft.launch_ahead(batch.rows, proposal, verified, proposal.depth)
    except Exception as exc:
        batch.disable_draft(exc)
        return
    if ahead is not None:
        batch.draft = ahead


def _commit(
    batch: _Batch,
    proposal: Proposal,
    drafts: tuple[tuple[int, ...], ...],
    acceptances: list[Acceptance],
    delivered: list[Delivered],
    verified: Any,
    ends: Sequence[int],
) -> None:
    """`ends[b]`: row b's sample after its emitted tokens (its end-of-sequence
    token where it saw one)."""
    rows = batch.rows
    # A row that ended by a stop or its budget commits as a continuing one
    # (its state may be kept for the prompt cache): the pending token and its
    # accepted drafts; after an end-of-sequence token, that token is its
    # pending one. A cancelled or failed row commits nothing.
    next_rows = [
        row.advanced(acc.emitted)
        if d.finish is None
        else _ended(row, acc, ends[b])
        if _keeps_state(d)
        else row
        for b, (row, acc, d) in enumerate(
            zip(rows, acceptances, delivered, strict=True)
        )
    ]
    accepted = [acc.accepted for acc in acceptances]

    delta = verified.delta
    kept = [
        acc.accepted + 1 if d.finish is None or _keeps_state(d) else 0
        for acc, d in zip(acceptances, delivered, strict=True)
    ]

    def target() -> Prepared[list[RowState]]:
        if delta is None:
            return ready(next_rows)

        def adopt() -> list[RowState]:
            delta.commit(kept)
            return next_rows

        return Prepared(adopt)

    preparers: list[Callable[[], Prepared[Any]]] = [target]
    draft = batch.draft
    if draft is not None:
        preparers.append(
            lambda: draft.prepare_commit(rows, proposal, drafts, accepted, verified)
        )
    try:
        committed = apply_all(preparers)
    except Exception as exc:
        batch.disable_draft(exc)
        committed = apply_all([target])
    batch.rows = committed[0]
    if len(committed) > 1:
        batch.draft = committed[1]


def _keeps_state(delivered: Delivered) -> bool:
    """Whether a row that ended this round may leave its state to the prompt
    cache: one that stopped or ran out of budget, never a cancelled or
    failed one."""
    return delivered.finish in ("stop", "length")


def _ended(row: RowState, acc: Acceptance, after: int) -> RowState:
    """A row that ended this round, as its committed state holds it: its
    emitted tokens, and after an end-of-sequence token that token, pending."""
    ended = row.advanced(acc.emitted)
    return evolve(ended, tokens=(*ended.tokens, after)) if acc.saw_eos else ended


def _plain_pipelined(
    batch: _Batch,
    requests: Sequence[RowRequest],
    metrics: list[RowMetrics],
    round_ms: list[list[float]],
    finish: Callable[[int, FinishReason, str | None], None],
    max_steps: int | None = None,
    keep_state: Callable[[int, tuple[int, ...]], None] | None = None,
) -> None:
    """Plain decoding; step k+1 is queued on the device before step k is read.
    With `max_steps`, stops after that many steps with no step left queued.
    `keep_state(b, processed)` is offered each row that ends by a stop or its
    budget, before it leaves."""

    # Per-step host work is what bounds decoding on a fast device: decide once.
    greedy = all(r.sampling.argmax_only for r in batch.rows)

    def step(
        ids: mx.array, rows: Sequence[RowState], ahead: int
    ) -> tuple[mx.array, _Scores | None]:
        out = batch.model(ids, batch.cache, [r.length + ahead for r in rows])
        if out.delta is not None:
            # plain decoding keeps its one position in every row
            out.delta.commit([1] * len(rows))
        logits = out.logits[:, -1, :]  # [B, V]
        if greedy:
            tokens = mx.argmax(logits, axis=-1).astype(mx.int32)
        else:
            ahead_rows = [evolve(r, step=r.step + ahead) for r in rows]
            tokens = sample_window(logits[:, None, :], ids, ahead_rows)[:, 0]
        return tokens, _Scores.asked(logits, tokens, [requests[s] for s in batch.slots])

    def launch(queued: tuple[mx.array, _Scores | None]) -> None:
        _async_eval(queued[0], *(queued[1].arrays() if queued[1] else ()))

    pending = mx.array([[r.pending] for r in batch.rows], dtype=mx.int32)
    first = step(pending, batch.rows, 0)
    launch(first)
    current: tuple[mx.array, _Scores | None] | None = first
    last = time.perf_counter()
    taken = 0
    while current is not None:
        taken += 1
        upcoming = None
        if max_steps is None or taken < max_steps:
            upcoming = step(current[0][:, None], batch.rows, 1)
            launch(upcoming)
        tokens = _ints(current[0])
        read = current[1].read() if current[1] is not None else None
        now = time.perf_counter()
        elapsed, last = (now - last) * 1000.0, now
        keep: list[int] = []
        advanced: list[RowState] = []
        for b, (row, slot) in enumerate(zip(batch.rows, batch.slots, strict=True)):
            acc = walk((), (tokens[b],), row.remaining, batch.eos)
            row_lp, row_top = (
                read.of_row(b, b + 1, requests[slot])
                if read is not None
                else (None, None)
            )
            d = deliver(
                acc, requests[slot].sink, row_lp, requests[slot].cancelled, row_top
            )
            metrics[slot].record(0, 0, d.published)
            if batch.draft is not None:
                metrics[slot].gated += 1
            round_ms[slot].append(elapsed)
            advanced.append(row.advanced(acc.emitted))
            if d.finish is None:
                keep.append(b)
                continue
            if keep_state is not None and _keeps_state(d):
                # the state holds the pending token, and the sampled one too
                # where the next step was queued (it processed it)
                queued = (tokens[b],) if upcoming is not None else ()
                keep_state(b, row.tokens + queued)
            finish(slot, d.finish, d.error)
        batch.rows = advanced
        if not keep:
            batch.rows, batch.slots = [], []
            return
        if upcoming is not None and len(keep) < len(tokens):
            index = mx.array(keep)
            upcoming = (
                upcoming[0][index],
                None if upcoming[1] is None else upcoming[1].take(index),
            )
        batch.retire(keep)
        current = upcoming
