"""Native MTP drafting: the target checkpoint's own multi-token-prediction head.

The head pairs the token at position p + 1 with the target's hidden state at
p and predicts the token at p + 2; its single decoder layer keeps its own KV
state, where position p holds the pair (t[p+1], h[p]). Each round:

1. The pairs the head has not seen yet are consumed in one window: the tokens
   the target accepted last round (and the pending token) with the TRUE
   target hidden states the verify forward produced for them. The last
   output drafts d1 (pending token t[n], hidden h[n-1]).
2. Each further draft chains on the head's own output: (d[i], norm(out[i])).
   Those KV entries are scratch (written past the committed length); the next
   round rewrites the accepted ones from true hidden states, so the head's
   context is always the target's own.

Drafts are sampled with the step key of the position they predict (coupled
draw); with a draft vocabulary (FR-Spec) the head projects onto the listed
rows of the target's vocabulary projection only.

On a GPU each step runs as one compiled function (`HeadStep`): the head's
forward at device-valued positions over its whole KV buffers (written by a
scatter, read under a position mask), the norm, the projection and the draw.
A draft step is dozens of small kernels whose host cost, not their bytes,
bounds it at one row (bench/step_probe.py); traced once, a step is replayed
without rebuilding its graph op by op, and its element-wise passes fuse
(draft chains 7-22 % faster on an H200, bench/RESULTS.md). Tails are
padded to a power of two (the padded pairs write scratch KV past the row's
length, which later steps overwrite and no real query sees), so a handful
of traces serve every round; longer tails (a prompt's first round), rows
with different draw filters, and the CPU take the eager path. On a CUDA
GPU, steps within its scope run as one CUDA kernel instead, a one-layer
head's whole round (its first step and chained steps, the KV writes
included) as one launch (`HeadStep.fused_step`, `HeadStep.round`,
models/mtp_cuda.py; `models.mtp_cuda.FUSED_ON_GPU` off keeps the compiled
steps, `WHOLE_ROUND` off launches the first step apart). A round that
follows a whole-round launch in which every row was offered every draft
derives its inputs on the device (`MtpRows.chain`, `HeadStep.derived`):
from the last round's verify draws, drafts and launch state, so the launch
reads no array made from host values (bench/draft_device.py: 17 us less per
one-row launch, ~220 us less at three rows on an H200). Reading nothing from
the host, that launch can be queued before the last round's host read
(`RoundOptions.draft_ahead`, `MtpRows.launch_ahead`): it then runs while the
host walks and commits, and the next round adopts its drafts.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any, cast

import mlx.core as mx
from attrs import Factory, evolve, field, frozen

from models import cpu_kernel, mtp_cuda
from models.base import ModelOutput
from models.cache import KVCache, cuda_backend, on_gpu
from models.mtp import MtpHead
from models.mtp_cuda import FusedStep
from schemas.request import DraftPolicy, SamplingParams
from specpipe.draft import DraftRows, DraftState, Proposal
from specpipe.draft_vocab import DraftVocabulary, SubsetHead
from specpipe.sample_window import sample_window
from specpipe.sampling import draw, draw_filters
from specpipe.state import RowState
from specpipe.transaction import Prepared

_async_eval = cast(Callable[..., None], mx.async_eval)

# The longest tail a compiled step pairs (padded up to a power of two).
COMPILED_TAIL_MAX = 16

# (ids [B, L], hidden [B, L, H], last [B], starts [B], keys, values, seeds [B],
#  steps [B]) -> (tokens [B], normed [B, 1, H], keys, values)
StepFn = Callable[..., tuple[mx.array, mx.array, mx.array, mx.array]]


@frozen(eq=False)
class HeadStep:
    """The head's draft step as compiled functions, one per (first step,
    layer, draw filters). A step pairs `ids` with `hidden` at per-row
    `starts` (the first step of a round pairs the tail: raw target hidden
    states, normed by the target's final norm, and keeps position `last[b]`'s
    output; a chained step pairs one draft with the previous step's `normed`),
    and draws from it with step keys (seeds, steps). The traces capture the
    head's and projection's weights: they must not change after the drafter
    is made (they do not after load)."""

    target: Any  # models.qwen3_next.Model
    head: MtpHead
    subset: SubsetHead | None
    traced: dict[tuple[bool, int, SamplingParams], StepFn] = field(
        factory=dict, init=False
    )
    fused: dict[int, FusedStep | None] = field(factory=dict, init=False)
    rounds: dict[tuple[int, SamplingParams], StepFn] = field(factory=dict, init=False)
    derivations: dict[tuple[int, SamplingParams], DerivedRound | None] = field(
        factory=dict, init=False
    )

    def __call__(self, first: bool, layer: int, filters: SamplingParams) -> StepFn:
        key = (first, layer % len(self.head.layers), filters)
        step = self.traced.get(key)
        if step is None:

            def run(
                ids: mx.array,
                hidden: mx.array,
                last: mx.array,
                starts: mx.array,
                keys: mx.array,
                values: mx.array,
                seeds: mx.array,
                steps: mx.array,
            ) -> tuple[mx.array, mx.array, mx.array, mx.array]:
                if first:
                    hidden = self.target.final_norm(hidden)
                out, keys, values = self.head.forward_at(
                    self.target.embed(ids), hidden, keys, values, starts, key[1]
                )
                if first:  # a chained step reads one position: `last` unread
                    out = mx.take_along_axis(out, last[:, None, None], axis=1)
                normed = self.head.normed(out)  # [B, 1, H]
                return (
                    self.draw(normed[:, 0], filters, seeds, steps),
                    self.head.carried(out, normed),
                    keys,
                    values,
                )

            step = cast(StepFn, mx.compile(run))
            fused = self.fused_step(key[1])
            if fused is not None and fused.supports(filters.temperature, filters.top_k):
                step = _through_kernel(fused, first, filters, step)
            self.traced[key] = step
        return step

    def fused_step(self, layer: int) -> FusedStep | None:
        """The one-kernel step of a layer (models/mtp_cuda.py) on a CUDA GPU,
        or None (another device, `FUSED_ON_GPU` off, or out of its scope)."""
        if layer not in self.fused:
            subset = self.subset
            self.fused[layer] = (
                FusedStep.for_head(
                    self.target,
                    self.head,
                    layer,
                    None if subset is None else (subset.ids, subset.weights),
                )
                if mtp_cuda.FUSED_ON_GPU and on_gpu() and cuda_backend()
                else None
            )
        return self.fused[layer]

    def chain(
        self,
        cache: KVCache,
        layer: int,
        filters: SamplingParams,
        token: mx.array,  # [B] int32, the previous step's draft
        normed: mx.array,  # [B, 1, H], the previous step's normed output
        starts: mx.array,  # [B] int32, the first step's position
        seeds: mx.array,  # [B] uint32
        steps: mx.array,  # [B] uint32, the first step's key
        count: int,
    ) -> tuple[mx.array, mx.array]:  # drafts [B, count], the last normed output
        """`count` chained steps from `layer` on: step i is `chained` with
        layer + i at `starts + i` with key `steps + i` (a multi-layer head's
        round; a one-layer head's rounds run `round`, its chained steps in
        one launch where the fused kernel takes them)."""
        drafted = []
        for i in range(count):
            token, normed = self.chained(
                cache, layer + i, filters, token, normed, starts + i, seeds, steps + i
            )
            drafted.append(token)
        return mx.stack(drafted, axis=1), normed

    def _chain(self, count: int, filters: SamplingParams) -> StepFn:
        """A one-layer head's `count` chained steps in HeadStep's step
        signature (tokens [B, count]): the fused chain where it takes them,
        else `count` compiled steps."""
        single = self(False, 0, filters)

        def steps_one_by_one(
            *arrays: mx.array,
        ) -> tuple[mx.array, mx.array, mx.array, mx.array]:
            ids, normed, last, starts, keys, values, seeds, steps = arrays
            drafted = []
            for i in range(count):
                token, normed, keys, values = single(
                    ids, normed, last, starts + i, keys, values, seeds, steps + i
                )
                drafted.append(token)
                ids = token[:, None]
            return mx.stack(drafted, axis=1), normed, keys, values

        fused = self.fused_step(0)
        if fused is None or not fused.supports(filters.temperature, filters.top_k):
            return steps_one_by_one
        return _through_kernel(fused, False, filters, steps_one_by_one, count)

    def round(self, filters: SamplingParams, depth: int) -> StepFn | None:
        """A one-layer head's whole draft chain of `depth` steps (the first
        step over the tail's window, then depth - 1 chained steps from the
        row's length on) in HeadStep's step signature, tokens [B, depth]:
        one kernel launch where the fused kernel takes it, else the first
        step and `chain`'s steps; None for a multi-layer head."""
        if len(self.head.layers) != 1:
            return None
        key = (depth, filters)
        run = self.rounds.get(key)
        if run is None:
            first = self(True, 0, filters)
            rest = self._chain(depth - 1, filters) if depth > 1 else None

            def first_then_chain(
                *arrays: mx.array,
            ) -> tuple[mx.array, mx.array, mx.array, mx.array]:
                last, starts, seeds, steps = (arrays[i] for i in (2, 3, 6, 7))
                token, normed, keys, values = first(*arrays)
                if rest is None:
                    return token[:, None], normed, keys, values
                length = starts + last + 1  # the row's: its chained steps' start
                tokens, normed, keys, values = rest(
                    token[:, None],
                    normed,
                    length,
                    length,
                    keys,
                    values,
                    seeds,
                    steps + 1,
                )
                return (
                    mx.concatenate([token[:, None], tokens], axis=1),
                    normed,
                    keys,
                    values,
                )

            fused = self.fused_step(0) if mtp_cuda.WHOLE_ROUND else None
            run = first_then_chain
            if fused is not None and fused.supports(filters.temperature, filters.top_k):
                run = _through_kernel(
                    fused, True, filters, first_then_chain, depth, kv_out=True
                )
            self.rounds[key] = run
        return run

    def derived(self, filters: SamplingParams, depth: int) -> DerivedRound | None:
        """A one-layer head's whole round as one kernel launch that derives
        its per-row inputs from the last round's on the device
        (`FusedStep.derived_round`): (samples, drafts, prev, hidden, keys,
        values) -> (tokens [B, depth], keys, values, state), or None from the
        call where the kernel does not take the round's shape. None here where
        rounds are not one launch (a multi-layer head, no kernel, a draw out
        of its scope, `WHOLE_ROUND` or `DERIVED_INPUTS` off) or the kernel's
        first launch has not been checked sound."""
        key = (depth, filters)
        if key not in self.derivations:
            fused = self.fused_step(0)
            run: DerivedRound | None = None
            if (
                len(self.head.layers) == 1
                and mtp_cuda.WHOLE_ROUND
                and mtp_cuda.DERIVED_INPUTS
                and fused is not None
                and fused.supports(filters.temperature, filters.top_k)
            ):
                run = _derived_launch(fused, filters, depth)
            self.derivations[key] = run
        run = self.derivations[key]
        fused = self.fused.get(0)
        if run is None or fused is None or fused.checked != [True]:
            return None
        return run

    def ahead(self, filters: SamplingParams, depth: int) -> DerivedRound | None:
        """A one-layer head's whole round that derives its per-row inputs from
        the last round's device arrays, for a round launched before the last
        one's host read (`MtpRows.launch_ahead`): the kernel's launch
        (`derived`) where it takes the shape, else the round's compiled steps
        (`round`) fed by `mtp_cuda.derive_inputs` in MLX operations. None for
        a multi-layer head."""
        whole = self.round(filters, depth)
        if whole is None:
            return None
        kernel = self.derived(filters, depth)

        def run(
            *chain: mx.array,
        ) -> tuple[mx.array, mx.array, mx.array, mx.array] | None:
            # (samples, drafts, prev, hidden, keys, values), as DerivedRound
            if kernel is not None:
                out = kernel(*chain)
                if out is not None:
                    return out
            samples, drafts, prev, hidden, keys, values = chain
            ids, last, starts, seeds, steps = mtp_cuda.derive_inputs(
                samples, drafts, prev, hidden.shape[1]
            )
            tokens, _, keys, values = whole(
                ids, hidden, last, starts, keys, values, seeds, steps
            )
            return tokens, keys, values, mtp_cuda.state_of(last, starts, seeds, steps)

        return run

    def draw(
        self,
        normed: mx.array,  # [B, H]
        params: SamplingParams,
        seeds: mx.array,  # [B] uint32
        steps: mx.array,  # [B] uint32
    ) -> mx.array:  # [B] int32 token ids
        return self.token_ids(draw(self.logits(normed), params, seeds, steps))

    def logits(self, normed: mx.array) -> mx.array:  # [..., H] -> [..., V or N]
        """The shared projection of `normed`, onto the FR-Spec rows when listed."""
        if self.subset is None:
            full: mx.array = self.target.project(normed)
            return full
        return self.subset.project(normed)

    def token_ids(self, index: mx.array) -> mx.array:  # int32, any shape
        """Token ids of indices into `logits`' last axis."""
        return index if self.subset is None else mx.take(self.subset.ids, index)

    def chained(
        self,
        cache: KVCache,
        layer: int,
        filters: SamplingParams,
        token: mx.array,  # [B] int32, the previous step's draft
        normed: mx.array,  # [B, 1, H], the previous step's normed output
        starts: mx.array,  # [B] int32, the position the pair sits at
        seeds: mx.array,  # [B] uint32
        steps: mx.array,  # [B] uint32
    ) -> tuple[mx.array, mx.array]:  # the step's draft [B] and normed output
        """One chained step (`layer` mod the head's layers), its KV written
        into `cache`."""
        index = layer % len(self.head.layers)
        token, normed, cache.keys[index], cache.values[index] = self(
            False, index, filters
        )(
            token[:, None],
            normed,
            starts,  # the `last` slot, which a chained step does not read
            starts,
            cache.keys[index],
            cache.values[index],
            seeds,
            steps,
        )
        return token, normed


# (samples, drafts, prev, hidden, keys, values) -> (tokens, keys, values,
#  state), or None where the kernel does not take the shape
DerivedRound = Callable[..., tuple[mx.array, mx.array, mx.array, mx.array] | None]


def _derived_launch(
    fused: FusedStep, filters: SamplingParams, depth: int
) -> DerivedRound:
    greedy = filters.greedy
    top_k = 0 if greedy else filters.top_k
    dist = mtp_cuda.draw_params(
        fused.weights.eps, filters.temperature, filters.top_p, filters.min_p
    )

    def run(
        samples: mx.array,
        drafts: mx.array,
        prev: mx.array,
        hidden: mx.array,
        keys: mx.array,
        values: mx.array,
    ) -> tuple[mx.array, mx.array, mx.array, mx.array] | None:
        if not fused.fits(hidden.shape[0], hidden.shape[1], greedy, top_k):
            return None
        return fused.derived_round(
            greedy, top_k, dist, samples, drafts, prev, hidden, keys, values, depth
        )

    return run


def _through_kernel(
    fused: FusedStep,
    first: bool,
    filters: SamplingParams,
    compiled: StepFn,
    count: int = 1,
    kv_out: bool = False,
) -> StepFn:
    """`compiled`, with the steps whose shape the kernel takes run by it
    (`count` > 1: a first or chained step and count - 1 chained steps in one
    launch, `FusedStep.launch`; `kv_out`: the kernel writes new whole KV
    buffers itself instead of the two scatters). The first kernel
    launch is evaluated and its grid barriers checked: if any gave up (its
    blocks could not all be resident on this device), the kernel is not
    used again and a warning says so (each such launch would wait 0.2 s per
    barrier and draft garbage)."""
    top_k = 0 if filters.greedy else filters.top_k
    kernel = fused.launch(
        first, count, filters.temperature, filters.top_p, filters.min_p, top_k, kv_out
    )
    checked = fused.checked  # [sound] once the kernel's first launch was checked

    def run(*args: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        rows, length = args[0].shape
        if (not checked or checked[0]) and fused.fits(
            rows, length, filters.greedy, top_k
        ):
            out = kernel(*args)
            if not checked:
                mx.eval(out)
                checked.append(fused.failures() == 0)
                if not checked[0]:
                    warnings.warn(
                        "the fused MTP step's grid barriers timed out on this device; "
                        "drafting with the compiled MLX step instead",
                        RuntimeWarning,
                        stacklevel=2,
                    )
                    return compiled(*args)
            return out
        return compiled(*args)

    return run


@frozen(eq=False)
class DeviceChain:
    """What a round leaves on the device for the next one's launch to derive
    its per-row inputs from (`models.mtp_cuda.derive_inputs`)."""

    samples: mx.array  # [B, W] the verify window's draws
    drafts: mx.array  # [B, W - 1] the round's drafts
    prev: mx.array  # [B, 4] uint32: the round's launch inputs (`mtp_cuda.state_of`)


@frozen(eq=False)
class AheadRound:
    """A round's drafts launched before the last round's host read
    (`MtpRows.launch_ahead`), adopted by the next `propose` that asks for
    the same depth of the same rows."""

    after: Proposal  # the round it follows (its proposal, by identity)
    depth: int
    tokens: mx.array  # [B, depth]
    keys: mx.array  # the head's buffers after the launch
    values: mx.array
    state: mx.array  # [B, 4] uint32: the launch's inputs (`mtp_cuda.state_of`)


@frozen
class MtpState(DraftState):
    """A row's MTP state: the head's cache (one row) of its first `length`
    pairs, and the target's hidden states not yet paired (`processed -
    length` of them)."""

    cache: KVCache
    length: int
    tail: mx.array  # [processed - length, H]

    def arrays(self) -> tuple[mx.array, ...]:
        return (*self.cache.arrays(), self.tail)

    def at(self, n: int) -> DraftState | None:
        # the head's pair at position p holds h[p] and t[p + 1]: a cut would
        # need a hidden state the pairs do not keep
        return self if n == self.processed else None


def namespace_of(head: MtpHead) -> str:
    """An MTP head's checkpoint namespace (the head belongs to the target
    the prompt cache is bound to; its shape tells companions apart)."""
    cache = head.make_cache(1)
    shape = f"l{cache.num_layers}/kv{cache.kv_heads}x{cache.head_dim}"
    return f"mtp/{type(head).__name__}/{shape}"


@frozen
class MtpRows:
    target: Any  # models.qwen3_next.Model: embed, final_norm, project shared
    head: MtpHead
    cache: KVCache  # the head's KV: position p holds the pair (t[p+1], h[p])
    lengths: tuple[int, ...]  # per row, pairs committed with true hidden states
    tail: mx.array  # [B, T, H] target hidden states not yet paired, right-padded
    tail_lengths: tuple[int, ...]  # per row; lengths[b] + tail_lengths[b] == row.length
    policy: DraftPolicy
    step: HeadStep
    compiled: bool  # whether rounds draft through `step` where they can
    # What the next round's launch derives its inputs from on the device
    # (`HeadStep.derived`), where the last round leaves them: None after a
    # round some row did not take every draft of, after rows joined or left,
    # and where the launch was not the kernel's whole round.
    chain: DeviceChain | None = None
    # The next round's drafts, launched before the last round's host read
    # (`launch_ahead`); kept by `prepare_commit` only for the round it follows.
    ahead: AheadRound | None = None
    needs_target_hidden: bool = field(default=True, init=False)

    def propose(self, rows: Sequence[RowState], depth: int) -> Proposal:
        if min(self.tail_lengths) == 0:
            return Proposal.empty(len(rows))  # a one-token prompt: no hidden yet
        ahead = self.ahead
        if ahead is not None and self.chain is not None and ahead.depth == depth:
            # launched before the last round's host read, from the same chain
            self.cache.keys[0], self.cache.values[0] = ahead.keys, ahead.values
            return Proposal(depth, device=ahead.tokens, state=ahead.state)
        params = [self.policy.draft_params(row.sampling) for row in rows]
        filters = {draw_filters(p) for p in params}
        if (
            self.compiled
            and len(filters) == 1
            and max(self.tail_lengths) <= COMPILED_TAIL_MAX
        ):
            return self._propose_compiled(rows, depth, params, filters.pop())
        width = max(self.tail_lengths)
        grid = []
        for row, start, count in zip(
            rows, self.lengths, self.tail_lengths, strict=True
        ):
            paired = list(row.tokens[start + 1 : start + 1 + count])
            grid.append(paired + [row.pending] * (width - count))
        ids = mx.array(grid, dtype=mx.int32)
        hidden = self.target.final_norm(self.tail[:, :width])
        out = self.head(self.target.embed(ids), hidden, self.cache, list(self.lengths))
        last = mx.array([c - 1 for c in self.tail_lengths], dtype=mx.int32)
        out = mx.take_along_axis(out, last[:, None, None], axis=1)  # [B, 1, H]
        drafted = [self._draw(out, rows, params, 0)]
        for i in range(1, depth):
            embeds = self.target.embed(drafted[-1][:, None])
            offsets = [row.length + i - 1 for row in rows]
            carried = self.head.carried(out, self.head.normed(out))
            out = self.head(embeds, carried, self.cache, offsets, step=i)
            drafted.append(self._draw(out, rows, params, i))
        return Proposal(depth, device=mx.stack(drafted, axis=1))

    def _draw(
        self,
        out: mx.array,  # [B, 1, H] head output
        rows: Sequence[RowState],
        params: Sequence[SamplingParams],
        ahead: int,
    ) -> mx.array:  # [B] int32 token ids
        shifted = [evolve(row, step=row.step + ahead) for row in rows]
        logits = self.step.logits(self.head.normed(out))
        return self.step.token_ids(sample_window(logits, None, shifted, params)[:, 0])

    def _propose_compiled(
        self,
        rows: Sequence[RowState],
        depth: int,
        params: Sequence[SamplingParams],
        filters: SamplingParams,
    ) -> Proposal:
        """`propose` through `HeadStep`: the same pairs, positions and keys
        (derived on the device from the last round's where it can)."""
        cache = self.cache
        whole = self.step.round(filters, depth)
        chain = self.chain
        derived = None if chain is None else self.step.derived(filters, depth)
        if chain is not None and derived is not None:
            out = derived(chain.samples, chain.drafts, chain.prev, self._tail(depth),
                          cache.keys[0], cache.values[0])  # fmt: skip
            if out is not None:
                tokens, cache.keys[0], cache.values[0], derived_state = out
                return Proposal(depth, device=tokens, state=derived_state)
        arrays = self.round_arrays(rows, depth, params)
        if whole is not None:
            tokens, _, cache.keys[0], cache.values[0] = whole(*arrays)
            state = (
                mtp_cuda.state_of(arrays[2], arrays[3], arrays[6], arrays[7])
                if mtp_cuda.DERIVED_INPUTS
                else None
            )
            return Proposal(depth, device=tokens, state=state)
        token, normed, cache.keys[0], cache.values[0] = self.step(True, 0, filters)(
            *arrays
        )
        if depth == 1:
            return Proposal(depth, device=token[:, None])
        lengths = mx.array([row.length for row in rows], dtype=mx.int32)
        seeds, steps = arrays[6], arrays[7]
        chained, _ = self.step.chain(
            cache, 1, filters, token, normed, lengths, seeds, steps + 1, depth - 1
        )
        return Proposal(depth, device=mx.concatenate([token[:, None], chained], axis=1))

    def round_arrays(
        self,
        rows: Sequence[RowState],
        depth: int,
        params: Sequence[SamplingParams],
    ) -> tuple[mx.array, ...]:
        """A round's first step in HeadStep's step signature (ids, hidden,
        last, starts, keys, values, seeds, steps): the tail's pairs padded to
        a power of two, the head's buffers with room for the round's slots."""
        tail = self._tail(depth)
        width = tail.shape[1]
        grid = [
            [*row.tokens[start + 1 : start + 1 + n], *[row.pending] * (width - n)]
            for row, start, n in zip(rows, self.lengths, self.tail_lengths, strict=True)
        ]
        cache = self.cache
        return (
            mx.array(grid, dtype=mx.int32),
            tail,
            mx.array([n - 1 for n in self.tail_lengths], dtype=mx.int32),
            mx.array(self.lengths, dtype=mx.int32),
            cache.keys[0],
            cache.values[0],
            mx.array([p.seed for p in params], dtype=mx.uint32),
            mx.array([row.step for row in rows], dtype=mx.uint32),
        )

    def _tail(self, depth: int) -> mx.array:
        """The round's tail of target hidden states, padded to a power of two
        positions; the head's buffers given room for the round's slots (the
        window's, then the chained steps': one launch writes them all from
        the head's lengths on)."""
        return self._with_room(self.tail, max(self.tail_lengths), self.lengths, depth)

    def _with_room(
        self, tail: mx.array, count: int, lengths: Sequence[int], depth: int
    ) -> mx.array:
        """`tail`'s first `count` positions padded to a power of two; the
        head's buffers given room for a round of `depth` steps from `lengths`
        (its committed pairs per row) on."""
        width = 1 << (count - 1).bit_length()
        tail = tail[:, :width]
        if tail.shape[1] < width:
            tail = mx.pad(tail, [(0, 0), (0, width - tail.shape[1]), (0, 0)])
        self.cache.reserve(max(lengths) + width + depth - 1)
        return tail

    def launch_ahead(
        self,
        rows: Sequence[RowState],
        proposal: Proposal,
        verified: ModelOutput,
        depth: int,
    ) -> DraftRows | None:
        """These rows with the next round's `depth` drafts launched (queued
        for evaluation) now, before this round's host read
        (`specpipe.draft.DraftsAhead`): from the device chain `prepare_commit`
        will leave when every row is offered every draft, over the verify
        window's whole tail (padded to a power of two: the positions past a
        row's accepted ones are scratch, as in any padded tail). None where the round cannot be launched so: no chain to
        derive from, rows with different draw filters, a multi-layer head or
        the eager path."""
        if (
            not self.compiled
            or depth < 1
            or proposal.state is None
            or proposal.device is None
            or verified.draws is None
            or verified.hidden is None
        ):
            return None
        params = [self.policy.draft_params(row.sampling) for row in rows]
        filters = {draw_filters(p) for p in params}
        if len(filters) != 1:
            return None
        run = self.step.ahead(filters.pop(), depth)
        if run is None:
            return None
        # the whole window; the next round's committed pairs are the rows' lengths
        tail = self._with_room(verified.hidden, int(verified.hidden.shape[1]),
                               [row.length for row in rows], depth)  # fmt: skip
        out = run(verified.draws, proposal.device, proposal.state, tail,
                  self.cache.keys[0], self.cache.values[0])  # fmt: skip
        if out is None:
            return None
        tokens, keys, values, state = out
        _async_eval(tokens, keys, values, state)  # queued now, behind the verify window
        return evolve(
            self, ahead=AheadRound(proposal, depth, tokens, keys, values, state)
        )

    def prepare_commit(
        self,
        rows: Sequence[RowState],
        proposal: Proposal,
        drafts: Sequence[tuple[int, ...]],
        accepted: Sequence[int],
        verified: ModelOutput,
    ) -> Prepared[DraftRows]:
        kept = tuple(1 + a for a in accepted)  # the pending token and accepted drafts
        chain = None
        if (
            proposal.state is not None
            and proposal.device is not None
            and verified.draws is not None
            and all(len(d) == proposal.depth for d in drafts)
        ):
            # every row was offered every draft: its accepted count is its
            # drafts' agreement with the draws, which the device can count
            chain = DeviceChain(verified.draws, proposal.device, proposal.state)
        # a launch ahead is the next round's only when it derived from this
        # round's chain
        ahead = (
            self.ahead
            if chain is not None
            and self.ahead is not None
            and self.ahead.after is proposal
            else None
        )
        if proposal.depth > 0:
            # The tail was paired this round: the verify hidden states of the
            # kept positions are the next tail.
            lengths = tuple(row.length for row in rows)
            tail = verified.hidden
        else:
            lengths = self.lengths
            tail = _append_rows(self.tail, self.tail_lengths, verified.hidden, kept)
            kept = tuple(c + k for c, k in zip(self.tail_lengths, kept, strict=True))
        return Prepared(
            lambda: evolve(
                self,
                lengths=lengths,
                tail=tail,
                tail_lengths=kept,
                chain=chain,
                ahead=ahead,
            )
        )

    def join(self, other: DraftRows) -> DraftRows:
        assert isinstance(other, MtpRows)
        return self.joined([other])

    def joined(self, others: Sequence[MtpRows]) -> MtpRows:
        """These rows followed by those of `others`, in order, in one copy
        (joining them one group at a time would copy the first rows again
        at every join)."""
        parts = [self, *others]
        counts = tuple(n for part in parts for n in part.tail_lengths)
        width = max(max(counts, default=0), 1)
        tails = [
            mx.pad(t, [(0, 0), (0, width - t.shape[1]), (0, 0)])
            if t.shape[1] < width
            else t[:, :width]
            for t in (part.tail.astype(self.tail.dtype) for part in parts)
        ]
        return evolve(
            self,
            chain=None,
            ahead=None,
            cache=KVCache.concat_rows([part.cache for part in parts]),
            lengths=tuple(n for part in parts for n in part.lengths),
            tail=mx.concatenate(tails, axis=0),
            tail_lengths=counts,
        )

    def capture(self, row: int) -> DraftState:
        return MtpState(
            namespace_of(self.head),
            self.lengths[row] + self.tail_lengths[row],
            self.cache.take_rows([row], self.lengths[row]),
            self.lengths[row],
            self.tail[row, : self.tail_lengths[row]],
        )

    def take_rows(self, keep: Sequence[int]) -> DraftRows:
        index = mx.array(list(keep), dtype=mx.int32)
        return evolve(
            self,
            chain=None,
            ahead=None,
            cache=self.cache.take_rows(keep),
            lengths=tuple(self.lengths[i] for i in keep),
            tail=mx.take(self.tail, index, axis=0),
            tail_lengths=tuple(self.tail_lengths[i] for i in keep),
        )


def _append_rows(
    tail: mx.array,  # [B, T, H]
    counts: Sequence[int],
    new: mx.array,  # [B, W, H]
    kept: Sequence[int],
) -> mx.array:
    """Per row, its `counts[b]` tail states followed by `kept[b]` new ones, right-padded."""
    rows = [
        mx.concatenate(
            [tail[b : b + 1, :c], new[b : b + 1, :k].astype(tail.dtype)], axis=1
        )
        for b, (c, k) in enumerate(zip(counts, kept, strict=True))
    ]
    width = max(r.shape[1] for r in rows)
    padded = [
        mx.pad(r, [(0, 0), (0, width - r.shape[1]), (0, 0)])
        if r.shape[1] < width
        else r
        for r in rows
    ]
    return mx.concatenate(padded, axis=0)


@frozen
class MtpDrafter:
    target: Any  # models.qwen3_next.Model
    head: MtpHead
    policy: DraftPolicy = field(factory=DraftPolicy)
    vocab: DraftVocabulary | None = None
    kind: str = "mtp"
    needs_target_hidden: bool = field(default=True, init=False)
    # the FR-Spec rows gathered once, and the compiled steps' traces
    step: HeadStep = field(
        init=False,
        eq=False,
        repr=False,
        default=Factory(
            lambda self: HeadStep(
                self.target,
                self.head,
                SubsetHead.of(self.target, self.vocab) if self.vocab else None,
            ),
            takes_self=True,
        ),
    )

    @property
    def namespace(self) -> str:
        return namespace_of(self.head)

    def resume(
        self,
        rows: Sequence[RowState],
        hidden: mx.array | None,
        states: Sequence[DraftState | None],
    ) -> DraftRows:
        """Per row, the head's cache and unpaired hidden states from
        `states[b]` (a copy), followed by `hidden`'s."""
        assert hidden is not None, (
            "the MTP head reads the target's prompt hidden states"
        )
        opened: list[MtpRows] = []
        for b, (row, state) in enumerate(zip(rows, states, strict=True)):
            if not isinstance(state, MtpState):
                opened.append(self.open([row], hidden[b : b + 1, : row.length]))
                continue
            fresh = hidden[b, : row.length - state.processed].astype(state.tail.dtype)
            tail = mx.concatenate([state.tail, fresh])
            opened.append(
                MtpRows(
                    self.target,
                    self.head,
                    state.cache.take_rows([0]),
                    (state.length,),
                    tail[None],
                    (int(tail.shape[0]),),
                    self.policy,
                    self.step,
                    self.compiles(),
                )
            )
        return opened[0].joined(opened[1:])

    def open(self, rows: Sequence[RowState], hidden: mx.array | None = None) -> MtpRows:
        assert hidden is not None, (
            "the MTP head reads the target's prompt hidden states"
        )
        return MtpRows(
            self.target,
            self.head,
            self.head.make_cache(len(rows)),
            tuple(0 for _ in rows),
            hidden,
            tuple(row.length for row in rows),
            self.policy,
            self.step,
            self.compiles(),
        )

    def compiles(self) -> bool:
        """Whether draft steps run compiled here (`DraftPolicy.compiles`). On
        the CPU a bf16 or quantized head multiplies in specpipe's eager
        kernels (models/cpu_kernel.py), which a trace cannot hold: it stays
        eager."""
        gpu = on_gpu()
        if not self.policy.compiles(gpu):
            return False
        if gpu:
            return True
        head = self.target.head_weights()
        return not (
            cpu_kernel.routes(head.weight, head.bits, head.group_size)
            or cpu_kernel.takes(self.head)
        )

    @property
    def calibration_key(self) -> str:
        """What sets a draft step's cost apart in the calibration cache."""
        if self.vocab is None:
            return self.kind
        return f"{self.kind}/vocab={self.vocab.size}"

    def calibration_round(
        self, context: mx.array, hidden: mx.array
    ) -> Callable[[int], mx.array]:
        """A draft round of any depth as decoding runs it
        (`specpipe.calibrate.DraftRound`): rows opened on the context (all
        but its last token processed, `hidden` their target states) and
        one round committed with nothing accepted, so each call proposes
        from a one-token tail; greedy. Its KV writes are scratch: every
        call drafts from the same state."""
        greedy = SamplingParams()
        ids: list[int] = context.reshape(-1).tolist()  # type: ignore[assignment]
        rows = [RowState.start(tuple(ids), 64, greedy)]
        opened: DraftRows = self.open(rows, hidden[:, :-1])
        proposal = opened.propose(rows, 1)
        pending = hidden[:, -1:]  # stands in for the verify window's hidden state
        opened = opened.prepare_commit(
            rows, proposal, [()], [0], ModelOutput(pending, pending)
        ).commit()
        rows = [row.advanced((ids[0],)) for row in rows]

        def run(depth: int) -> mx.array:  # [1, depth] int32
            drafted = opened.propose(rows, depth)
            assert drafted.device is not None
            return drafted.device

        return run

    def calibration_step(
        self, context: mx.array, hidden: mx.array
    ) -> Callable[[], mx.array]:
        """One chained draft step, as a round pays for each drafted token
        (`specpipe.calibrate.DraftStep`): the head first reads the context's
        pairs, then each call runs its forward over one (token, hidden) pair
        and draws greedily through the shared projection (its FR-Spec rows
        when a draft vocabulary is set), compiled where rounds compile."""
        length = int(context.shape[1])
        cache = self.head.make_cache(1)
        out = self.head(
            self.target.embed(context[:, 1:]),
            self.target.final_norm(hidden[:, :-1]),
            cache,
            [0],
        )
        normed = self.head.carried(out[:, -1:], self.head.normed(out[:, -1:]))
        mx.eval(normed, cache.arrays())
        token = context[:, -1:]
        greedy = SamplingParams()
        keys = mx.zeros((1,), dtype=mx.uint32)  # greedy: the step key is not read
        compiled = self.compiles()
        starts = mx.array([length - 1], dtype=mx.int32)

        def step() -> mx.array:  # [1, 1] int32
            if compiled:
                drafted, _ = self.step.chained(
                    cache, 1, greedy, token[:, 0], normed, starts, keys, keys
                )
                return drafted[:, None]
            out = self.head(
                self.target.embed(token), normed, cache, [length - 1], step=1
            )
            last = self.head.normed(out)[:, 0]
            return self.step.draw(last, greedy, keys, keys)[:, None]

        return step
