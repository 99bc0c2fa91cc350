"""DSpark drafting: a whole block of drafts from one forward of DeepSeek's
block drafter (models/dspark.py), then its Markov head, slot by slot.

The context bookkeeping is DFlash's (specpipe/drafts/dflash.py: the draft's
KV cache of the committed positions' context, the features committed since
stored at the next proposal, the prompt cache's states), and so are the
rows' commits. A proposal differs: the block is [pending token, mask x
(L - 1)] at the pending token's position n, embedded with the draft's own
embedding (`DSparkDraft.embed`), L = max(block_size, depth) (the block the
draft was trained on, however few drafts are asked for), and slot k's output
is the draft for position n + k + 1, k = 0 .. depth - 1. Each draft is drawn
with that position's step key (row.step + k, as DFlash's and the target's
draws), from the slot's logits (capped, for a Gemma-4 draft) plus the Markov
head's bias for the token drawn before it (the pending token for slot 0), so
the draws run in order. Qwen3 and Gemma-4 drafts run alike.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
from attrs import evolve, frozen

from models.cache import KVCache
from models.dspark import DSparkDraft
from models.vocab_head import HeadWeights
from schemas.request import SamplingParams
from specpipe.draft import Proposal
from specpipe.drafts.dflash import DFlashDrafter, DFlashRows
from specpipe.sample_window import sample_window
from specpipe.state import RowState


@frozen
class DSparkRows(DFlashRows):
    """DFlash's rows with DSpark's proposal (`head`: the draft's own
    `lm_head`; no draft vocabulary)."""

    def propose(self, rows: Sequence[RowState], depth: int) -> Proposal:
        if depth < 1:
            return Proposal.empty(len(rows))
        draft = self.draft
        assert isinstance(draft, DSparkDraft)
        starts = self._store_pending()
        lengths = tuple(row.length for row in rows)
        assert starts == lengths, f"draft context {starts} != rows {lengths}"
        mask = draft.settings.mask_token
        length = max(draft.settings.block_size, depth)
        ids = mx.array(
            [[row.pending] + [mask] * (length - 1) for row in rows], dtype=mx.int32
        )
        normed = draft(draft.embed(ids), self.cache, starts)[:, :depth]
        logits = draft.logits(normed, self.head)
        params = [self.policy.draft_params(row.sampling) for row in rows]
        if draft.markov is None:
            drafted = sample_window(logits, None, rows, params)
        else:
            drafted = self._markov(draft, normed, logits, ids[:, 0], rows, params)
        return Proposal(depth, device=drafted)

    @staticmethod
    def _markov(
        draft: DSparkDraft,
        normed: mx.array,  # [B, D, H] the draft's outputs at the draft slots
        logits: mx.array,  # [B, D, V] the lm_head's
        first: mx.array,  # [B] the pending token
        rows: Sequence[RowState],
        params: Sequence[SamplingParams],
    ) -> mx.array:  # [B, D] int32
        """Slot by slot: the Markov head's bias for the token drawn before
        (`MarkovHead.step`) added to the slot's logits, then the draw with
        the slot's step key."""
        head = draft.markov
        assert head is not None
        previous, state = first, None
        drafted = []
        for k in range(logits.shape[1]):
            bias, state = head.step(previous, normed[:, k], state)
            ahead = [evolve(row, step=row.step + k) for row in rows]
            step = (logits[:, k] + bias.astype(logits.dtype))[:, None]
            previous = sample_window(step, None, ahead, params)[:, 0]
            drafted.append(previous)
        return mx.stack(drafted, axis=1)


@frozen
class DSparkDrafter(DFlashDrafter):
    """A loaded DSpark draft bound to its target (whose forward taps the
    draft's `target_layer_ids`). Its drafts are drawn over its own head."""

    kind: str = "dspark"

    def rows_of(
        self, cache: KVCache, cached: tuple[int, ...], pending: tuple[mx.array, ...]
    ) -> DFlashRows:
        assert isinstance(self.draft, DSparkDraft)
        assert self.subset is None, "a DSpark draft projects through its own head"
        return DSparkRows(
            self.target,
            self.draft,
            HeadWeights.of(self.draft.lm_head),
            self.policy,
            cache,
            cached,
            pending,
        )
