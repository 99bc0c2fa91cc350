"""Two-model drafting: a second, smaller model with the target's tokenizer.

The draft keeps its own KV state and, per row, how many of the row's tokens it
has processed. Each round it first feeds the tokens it has not seen yet (the
pending token, plus the last accepted draft after a fully accepted window),
then drafts `depth` tokens autoregressively, all as one lazy device graph.
Each draft is sampled with the step key of the target position it predicts,
so the draft and the target read the same point of their CDFs. With a draft
vocabulary (FR-Spec) the draft projects onto the listed rows only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from attrs import Factory, evolve, field, frozen

from models.base import CausalLM, ModelOutput
from models.cache import on_gpu
from models.vocab_head import HeadWeights
from schemas.request import DraftPolicy, SamplingParams
from specpipe.draft import DraftRows, Proposal
from specpipe.draft_vocab import DraftVocabulary
from specpipe.prefill import prefill_rows
from specpipe.sample_window import sample_window
from specpipe.state import RowState
from specpipe.transaction import Prepared, ready


@frozen
class SubsetHead:
    """A draft head over the listed ids only (FR-Spec)."""

    ids: mx.array  # [N] int32, ascending
    weights: HeadWeights  # the head's rows at `ids`

    @classmethod
    def of(cls, model: CausalLM, vocab: DraftVocabulary) -> SubsetHead:
        ids = vocab.array()
        weights = model.head_weights().take(ids)
        # gathered now, not inside a draft step (a 30k-row gather from a
        # 150k-row head takes as long as a few draft steps)
        mx.eval(ids, weights.weight, weights.scales, weights.biases)
        return cls(ids, weights)

    def logits(self, model: CausalLM, hidden: mx.array) -> mx.array:
        """`[..., H]` hidden -> `[..., N]` logits over the listed ids."""
        return self.weights.project(model.final_norm(hidden))


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

    def propose(self, rows: Sequence[RowState], depth: int) -> Proposal:
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

    def _draw(
        self,
        hidden: mx.array,  # [B, 1, H]
        rows: Sequence[RowState],
        params: Sequence[SamplingParams],
        ahead: int,
    ) -> mx.array:  # [B] int32 token ids
        shifted = [evolve(row, step=row.step + ahead) for row in rows]
        if self.vocab is None:
            logits = self.model.lm_head(hidden)  # [B, 1, V]
            return sample_window(logits, None, shifted, params)[:, 0]
        subset = self.vocab.logits(self.model, hidden)  # [B, 1, N]
        index = sample_window(subset, None, shifted, params)[:, 0]
        return mx.take(self.vocab.ids, index)

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

    def open(
        self, rows: Sequence[RowState], hidden: mx.array | None = None
    ) -> DraftRows:
        cache, _ = prefill_rows(self.model, rows)
        bucket = on_gpu() if self.bucket_catch_up is None else self.bucket_catch_up
        return TwoModelRows(
            self.model,
            cache,
            tuple(row.length for row in rows),
            self.policy,
            self.subset,
            bucket,
        )
