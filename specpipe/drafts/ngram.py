"""Prompt-lookup drafting (model-free n-gram matching over the row's own tokens).

The last n tokens of the row (n from `max_n` down to `min_n`) are searched for
their latest earlier occurrence in the prompt and the generated text; the
tokens that followed it are the drafts. Code edits and quoting reuse long
spans of the input, which this drafts for free.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
from attrs import frozen

from models.base import ModelOutput
from specpipe.draft import DraftRows, Proposal
from specpipe.state import RowState
from specpipe.transaction import Prepared, ready


def lookup(
    tokens: Sequence[int], depth: int, min_n: int, max_n: int
) -> tuple[int, ...]:
    """The continuation of the latest earlier match of the longest suffix n-gram."""
    size = len(tokens)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = list(tokens[size - n :])
        first = suffix[0]
        # latest start i < size - n with tokens[i:i+n] == suffix
        for i in range(size - n - 1, -1, -1):
            if tokens[i] == first and list(tokens[i : i + n]) == suffix:
                follow = tokens[i + n : i + n + depth]
                if follow:
                    return tuple(follow)
                break
    return ()


@frozen
class NgramRows:
    needs_target_hidden = False
    min_n: int
    max_n: int

    def propose(self, rows: Sequence[RowState], depth: int) -> Proposal:
        drafts = tuple(
            lookup(row.tokens, min(depth, row.remaining - 1), self.min_n, self.max_n)
            if row.remaining > 1
            else ()
            for row in rows
        )
        return Proposal(depth, host=drafts)

    def prepare_commit(
        self,
        rows: Sequence[RowState],
        proposal: Proposal,
        drafts: Sequence[tuple[int, ...]],
        accepted: Sequence[int],
        verified: ModelOutput,
    ) -> Prepared[DraftRows]:
        return ready(self)

    def take_rows(self, keep: Sequence[int]) -> DraftRows:
        return self

    def join(self, other: DraftRows) -> DraftRows:
        return self


@frozen
class NgramDrafter:
    needs_target_hidden = False
    min_n: int = 1
    max_n: int = 4
    kind: str = "ngram"

    def open(
        self, rows: Sequence[RowState], hidden: mx.array | None = None
    ) -> DraftRows:
        return NgramRows(self.min_n, self.max_n)
