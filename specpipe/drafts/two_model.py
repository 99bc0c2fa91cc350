"""Two-model drafting: a second, smaller model with the target's tokenizer.

The draft keeps its own KV state and, per row, how many of the row's tokens it
has processed. Each round it first feeds the tokens it has not seen yet (the
pending token, plus the last accepted draft after a fully accepted window),
then drafts `depth` tokens autoregressively, all as one lazy device graph.
Each draft is sampled with the step key of the target position it predicts,
so the draft and the target read the same point of their CDFs. With a draft
vocabulary (FR-Spec) the draft projects onto the listed rows only.

Staged drafting (`DraftPolicy.staged`, on by default on a CPU; a draft of the
draft, as in staged speculative decoding): a draft forward costs its weight
bytes whether it reads one token or a few, so each draft forward also reads
the tokens prompt lookup guesses will follow (n-grams of the row's tokens and the drafts so far) and
samples the draft at every position. The guesses the draft's own samples
confirm are drafts it would have written one forward at a time, at the same
step keys over the same context, so the proposal is the one of the plain
chain (up to a window's rounding, which only drafts see) in fewer forwards.
Each forward is read back to check the guesses: one host read per forward,
cheap on a CPU, where draft forwards cost their bytes; on a GPU the plain
chain is one lazy graph per round, which staging would break up.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import mlx.core as mx
from attrs import Factory, evolve, field, frozen

from models.base import CausalLM, ModelOutput
from models.cache import on_gpu
from models.vocab_head import HeadWeights
from schemas.request import DraftPolicy, SamplingParams
from specpipe.draft import DraftRows, DraftState, Proposal
from specpipe.draft_vocab import DraftVocabulary, SubsetHead
from specpipe.drafts.ngram import lookup as ngram_lookup
from specpipe.prefill import prefill_rows
from specpipe.sample_window import sample_window
from specpipe.state import RowState
from specpipe.transaction import Prepared, ready


@frozen
class LookupStaging:
    """Prompt-lookup guesses a draft forward checks (see the module doc)."""

    min_n: int = 1
    max_n: int = 4

    def guesses(self, tokens: Sequence[int], count: int) -> tuple[int, ...]:
        if count < 1:
            return ()
        return ngram_lookup(tokens, count, self.min_n, self.max_n)[0]


@frozen
class TwoModelState(DraftState):
    """A row's draft cache (one row), its first `processed` tokens in."""

    cache: Any

    def arrays(self) -> tuple[mx.array, ...]:
        return tuple(self.cache.arrays())

    def at(self, n: int) -> DraftState | None:
        if n >= self.processed:
            return self
        return evolve(self, processed=n) if self.cache.truncatable else None


def namespace_of(model: CausalLM) -> str:
    """A draft model's checkpoint namespace: its architecture's shape (a
    state computed by another draft model of the same shape would only offer
    other drafts, never change the output)."""
    a = model.args
    return (
        f"two-model/{a.model_type}/h{a.hidden_size}/l{a.num_hidden_layers}"
        f"/v{a.vocab_size}"
    )


@frozen
class TwoModelRows:
    needs_target_hidden = False
    model: CausalLM
    cache: Any  # the draft model's ModelCache
    lengths: tuple[int, ...]  # per row, tokens the draft has processed
    policy: DraftPolicy
    vocab: SubsetHead | None = None
    # The draft's first forward of a round reads every token it has not seen
    # (one in steady state; more after plain steps of a gated row or a long
    # accepted window). On a GPU, MLX compiles a window's kernels per shape (a
    # new one cost ~50 ms on an H200, bench/RESULTS.md), so that width is
    # rounded up to a power of two there: a handful of shapes for any run. The
    # padding positions lie past every row's tokens, are never attended by
    # its real positions (causal mask), and are overwritten by the draft steps
    # that follow and by later rounds.
    bucket: bool = field(factory=on_gpu)
    lookup: LookupStaging | None = None

    def propose(self, rows: Sequence[RowState], depth: int) -> Proposal:
        if self.lookup is not None and depth > 1:
            return self._propose_staged(rows, depth, self.lookup)
        tails = [row.tokens[n:] for row, n in zip(rows, self.lengths, strict=True)]
        width = max(len(t) for t in tails)
        if self.bucket and width > 1:
            width = 1 << (width - 1).bit_length()
        grid = [list(t) + [t[-1]] * (width - len(t)) for t in tails]
        ids = mx.array(grid, dtype=mx.int32)
        params = [self.policy.draft_params(row.sampling) for row in rows]
        out = self.model(ids, self.cache, list(self.lengths))
        last = mx.array([len(t) - 1 for t in tails], dtype=mx.int32)[:, None, None]
        hidden = mx.take_along_axis(out.hidden, last, axis=1)  # [B, 1, H]
        drafted = [self._draw(hidden, rows, params, 0)]
        offsets = [n + len(t) for n, t in zip(self.lengths, tails, strict=True)]
        for i in range(1, depth):
            out = self.model(
                drafted[-1][:, None], self.cache, [o + i - 1 for o in offsets]
            )
            drafted.append(self._draw(out.hidden, rows, params, i))
        return Proposal(depth, device=mx.stack(drafted, axis=1))

    def _propose_staged(
        self, rows: Sequence[RowState], depth: int, staging: LookupStaging
    ) -> Proposal:
        params = [self.policy.draft_params(row.sampling) for row in rows]
        drafted: list[list[int]] = [[] for _ in rows]
        fed = list(self.lengths)  # per row, positions in the draft's cache
        # per row, the tokens to feed before guessing: first the unseen tail
        # (through the pending token), then the last draft of each forward
        feeds = [
            list(row.tokens[n:]) for row, n in zip(rows, self.lengths, strict=True)
        ]
        while any(len(d) < depth for d in drafted):
            guesses = [
                staging.guesses([*row.tokens, *d], depth - len(d) - 1)
                if len(d) < depth
                else ()
                for row, d in zip(rows, drafted, strict=True)
            ]
            inputs = [f + list(g) for f, g in zip(feeds, guesses, strict=True)]
            width = max(len(i) for i in inputs)
            grid = [i + [i[-1]] * (width - len(i)) for i in inputs]
            out = self.model(mx.array(grid, dtype=mx.int32), self.cache, fed)
            # sample where each row's feed ends and after each of its guesses
            span = max(len(g) for g in guesses) + 1
            index = [
                [min(len(f) - 1 + j, len(i) - 1) for j in range(span)]
                for f, i in zip(feeds, inputs, strict=True)
            ]
            hidden = mx.take_along_axis(
                out.hidden, mx.array(index, dtype=mx.int32)[:, :, None], axis=1
            )
            ahead = [
                evolve(row, step=row.step + len(d))
                for row, d in zip(rows, drafted, strict=True)
            ]
            sampled = cast(
                list[list[int]], self._draw_window(hidden, ahead, params).tolist()
            )
            for b, (f, g) in enumerate(zip(feeds, guesses, strict=True)):
                if len(drafted[b]) >= depth:
                    continue
                kept = 0  # guesses the draft's own samples confirm
                while kept < len(g) and sampled[b][kept] == g[kept]:
                    kept += 1
                drafted[b].extend(sampled[b][: kept + 1])
                fed[b] += len(f) + kept
                feeds[b] = [drafted[b][-1]]
        return Proposal(depth, host=tuple(tuple(d) for d in drafted))

    def _draw_window(
        self,
        hidden: mx.array,  # [B, W, H]
        rows: Sequence[RowState],
        params: Sequence[SamplingParams],
    ) -> mx.array:  # [B, W] int32 token ids
        if self.vocab is None:
            return sample_window(self.model.lm_head(hidden), None, rows, params)
        logits = self.vocab.project(self.model.final_norm(hidden))
        index = sample_window(logits, None, rows, params)
        return mx.take(self.vocab.ids, index)

    def _draw(
        self,
        hidden: mx.array,  # [B, 1, H]
        rows: Sequence[RowState],
        params: Sequence[SamplingParams],
        ahead: int,
    ) -> mx.array:  # [B] int32 token ids
        shifted = [evolve(row, step=row.step + ahead) for row in rows]
        return self._draw_window(hidden, shifted, params)[:, 0]

    def prepare_commit(
        self,
        rows: Sequence[RowState],
        proposal: Proposal,
        drafts: Sequence[tuple[int, ...]],
        accepted: Sequence[int],
        verified: ModelOutput,
    ) -> Prepared[DraftRows]:
        # The draft fed each row's tail through its pending token (row.length + 1
        # tokens), then drafts d1..d(depth-1); it keeps those that were accepted.
        if proposal.depth == 0:
            return ready(self)  # not asked this round: its tail just grew
        processed_drafts = proposal.depth - 1
        lengths = tuple(
            row.length + 1 + min(a, processed_drafts)
            for row, a in zip(rows, accepted, strict=True)
        )
        return Prepared(lambda: evolve(self, lengths=lengths))

    def capture(self, row: int) -> DraftState:
        return TwoModelState(
            namespace_of(self.model),
            self.lengths[row],
            self.cache.take_rows([row], self.lengths[row]),
        )

    def join(self, other: DraftRows) -> DraftRows:
        assert isinstance(other, TwoModelRows)
        return evolve(
            self,
            cache=type(self.cache).concat_rows([self.cache, other.cache]),
            lengths=self.lengths + other.lengths,
        )

    def take_rows(self, keep: Sequence[int]) -> DraftRows:
        return evolve(
            self,
            cache=self.cache.take_rows(keep),
            lengths=tuple(self.lengths[i] for i in keep),
        )


@frozen
class TwoModelDrafter:
    needs_target_hidden = False
    model: CausalLM
    policy: DraftPolicy = field(factory=DraftPolicy)
    vocab: DraftVocabulary | None = None
    kind: str = "two-model"
    bucket_catch_up: bool | None = None  # None: on a GPU (see TwoModelRows.bucket)
    # the FR-Spec rows of the head, gathered once when the drafter is made
    subset: SubsetHead | None = field(
        init=False,
        eq=False,
        repr=False,
        default=Factory(
            lambda self: SubsetHead.of(self.model, self.vocab) if self.vocab else None,
            takes_self=True,
        ),
    )

    @property
    def calibration_key(self) -> str:
        """What sets a draft step's cost apart in the calibration cache."""
        if self.vocab is None:
            return self.kind
        return f"{self.kind}/vocab={self.vocab.size}"

    def calibration_head(self) -> HeadWeights | None:
        """The head rows a draft step projects onto (its FR-Spec list), if not all."""
        return self.subset.weights if self.subset is not None else None

    @property
    def namespace(self) -> str:
        return namespace_of(self.model)

    def open(
        self, rows: Sequence[RowState], hidden: mx.array | None = None
    ) -> DraftRows:
        return self.resume(rows, hidden, [None] * len(rows))

    def resume(
        self,
        rows: Sequence[RowState],
        hidden: mx.array | None,
        states: Sequence[DraftState | None],
    ) -> DraftRows:
        """Rows whose draft cache starts from `states[b]`'s (a copy) and
        prefills the rest of the row's tokens."""
        restored = [
            (state.cache.take_rows([0]), state.processed)
            if isinstance(state, TwoModelState)
            else None
            for state in states
        ]
        cache, _ = prefill_rows(self.model, rows, restored=restored)
        gpu = on_gpu()
        bucket = gpu if self.bucket_catch_up is None else self.bucket_catch_up
        return TwoModelRows(
            self.model,
            cache,
            tuple(row.length for row in rows),
            self.policy,
            self.subset,
            bucket,
            LookupStaging() if self.policy.stages(gpu) else None,
        )
