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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
from attrs import evolve, field, frozen

from models.base import ModelOutput
from models.cache import KVCache
from models.mtp import MtpHead
from models.vocab_head import HeadWeights
from schemas.request import DraftPolicy, SamplingParams
from specpipe.draft import DraftRows, Proposal
from specpipe.draft_vocab import DraftVocabulary
from specpipe.sample_window import sample_window
from specpipe.state import RowState
from specpipe.transaction import Prepared


@frozen
class MtpRows:
    target: Any  # models.qwen3_next.Model: embed, final_norm, project shared
    head: MtpHead
    cache: KVCache  # the head's KV: position p holds the pair (t[p+1], h[p])
    lengths: tuple[int, ...]  # per row, pairs committed with true hidden states
    tail: mx.array  # [B, T, H] target hidden states not yet paired, right-padded
    tail_lengths: tuple[int, ...]  # per row; lengths[b] + tail_lengths[b] == row.length
    policy: DraftPolicy
    vocab_ids: mx.array | None = None  # [N] FR-Spec ids, ascending
    vocab_head: HeadWeights | None = None  # the projection's rows at vocab_ids
    needs_target_hidden: bool = field(default=True, init=False)

    def propose(self, rows: Sequence[RowState], depth: int) -> Proposal:
        if min(self.tail_lengths) == 0:
            return Proposal.empty(len(rows))  # a one-token prompt: no hidden yet
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
        params = [self.policy.draft_params(row.sampling) for row in rows]
        drafted = [self._draw(out, rows, params, 0)]
        for i in range(1, depth):
            embeds = self.target.embed(drafted[-1][:, None])
            offsets = [row.length + i - 1 for row in rows]
            out = self.head(embeds, self.head.normed(out), self.cache, offsets, step=i)
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
        normed = self.head.normed(out)
        if self.vocab_head is None or self.vocab_ids is None:
            logits = self.target.project(normed)
            return sample_window(logits, None, shifted, params)[:, 0]
        index = sample_window(self.vocab_head.project(normed), None, shifted, params)
        return mx.take(self.vocab_ids, index[:, 0])

    def prepare_commit(
        self,
        rows: Sequence[RowState],
        proposal: Proposal,
        drafts: Sequence[tuple[int, ...]],
        accepted: Sequence[int],
        verified: ModelOutput,
    ) -> Prepared[DraftRows]:
        kept = tuple(1 + a for a in accepted)  # the pending token and accepted drafts
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
            lambda: evolve(self, lengths=lengths, tail=tail, tail_lengths=kept)
        )

    def join(self, other: DraftRows) -> DraftRows:
        assert isinstance(other, MtpRows)
        counts = self.tail_lengths + other.tail_lengths
        width = max(max(counts, default=0), 1)
        tails = [
            mx.pad(t, [(0, 0), (0, width - t.shape[1]), (0, 0)])
            if t.shape[1] < width
            else t[:, :width]
            for t in (self.tail, other.tail.astype(self.tail.dtype))
        ]
        return evolve(
            self,
            cache=KVCache.concat_rows([self.cache, other.cache]),
            lengths=self.lengths + other.lengths,
            tail=mx.concatenate(tails, axis=0),
            tail_lengths=counts,
        )

    def take_rows(self, keep: Sequence[int]) -> DraftRows:
        index = mx.array(list(keep), dtype=mx.int32)
        return evolve(
            self,
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

    def open(
        self, rows: Sequence[RowState], hidden: mx.array | None = None
    ) -> DraftRows:
        assert hidden is not None, (
            "the MTP head reads the target's prompt hidden states"
        )
        ids = head = None
        if self.vocab is not None:
            ids = self.vocab.array()
            head = self.target.head_weights().take(ids)
        return MtpRows(
            self.target,
            self.head,
            self.head.make_cache(len(rows)),
            tuple(0 for _ in rows),
            hidden,
            tuple(row.length for row in rows),
            self.policy,
            ids,
            head,
        )

    @property
    def calibration_key(self) -> str:
        """What sets a draft step's cost apart in the calibration cache."""
        if self.vocab is None:
            return self.kind
        return f"{self.kind}/vocab={self.vocab.size}"

    def calibration_step(
        self, context: mx.array, hidden: mx.array
    ) -> Callable[[], mx.array]:
        """One chained draft step, as a round pays for each drafted token
        (`specpipe.calibrate.DraftStep`): the head first reads the context's
        pairs, then each call runs its forward over one (token, hidden) pair
        and draws greedily through the shared projection (its FR-Spec rows
        when a draft vocabulary is set)."""
        length = int(context.shape[1])
        cache = self.head.make_cache(1)
        out = self.head(
            self.target.embed(context[:, 1:]),
            self.target.final_norm(hidden[:, :-1]),
            cache,
            [0],
        )
        normed = self.head.normed(out[:, -1:])
        mx.eval(normed, cache.arrays())
        token = context[:, -1:]
        ids = rows = None
        if self.vocab is not None:
            ids = self.vocab.array()
            rows = self.target.head_weights().take(ids)
            mx.eval(ids, rows.weight, rows.scales, rows.biases)

        def step() -> mx.array:  # [1, 1] int32
            out = self.head(
                self.target.embed(token), normed, cache, [length - 1], step=1
            )
            last = self.head.normed(out)
            if ids is None or rows is None:
                return mx.argmax(self.target.project(last), axis=-1)
            return mx.take(ids, mx.argmax(rows.project(last), axis=-1))

        return step
