"""The draft stage: what a drafter offers the round, and the protocol it keeps.

A drafter proposes 0..depth tokens per row, either as host lists (model-free
drafters such as prompt lookup) or left on the device as `[B, depth]` ids (a
draft model), so the round can build the verify graph before anything is read
back. After the walk, the drafter turns each row's accepted count into a
prepared change of its own state.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import mlx.core as mx
from attrs import frozen

from models.base import ModelOutput
from specpipe.state import RowState
from specpipe.transaction import Prepared


@frozen
class Proposal:
    depth: int
    host: tuple[tuple[int, ...], ...] | None = None  # per row, 0..depth ids
    # [B, depth] int32; with `host` too once the round read it first (then
    # `host` is its copy, and the round does not read it again)
    device: mx.array | None = None
    # A copying drafter's note to itself: per row, the index in the row's
    # tokens its host drafts were copied from (-1: none). Not read by the round.
    origins: tuple[int, ...] | None = None
    # A drafter's device-side note to its own `prepare_commit` (the MTP
    # kernel's launch inputs, which the next round derives from). Not read by
    # the round.
    state: mx.array | None = None

    @classmethod
    def empty(cls, rows: int) -> Proposal:
        return cls(0, host=tuple(() for _ in range(rows)))

    def resolve(self, read: Sequence[int] | None) -> tuple[tuple[int, ...], ...]:
        """Host drafts per row; `read` is the host copy of `device`, row-major."""
        if self.host is not None:
            return self.host
        assert read is not None and self.device is not None
        rows = self.device.shape[0]
        d = self.depth
        return tuple(tuple(read[r * d : (r + 1) * d]) for r in range(rows))


class DraftRows(Protocol):
    """A drafter's state for the rows of one batch, between rounds.

    `prepare_commit` is called after every round, also one the drafter was
    not asked to draft for (`proposal.depth == 0`)."""

    @property
    def needs_target_hidden(self) -> bool:
        """Whether the drafter reads the target's hidden states (then every
        round goes through it, plain ones included)."""
        ...

    def propose(self, rows: Sequence[RowState], depth: int) -> Proposal: ...

    def prepare_commit(
        self,
        rows: Sequence[RowState],
        proposal: Proposal,
        drafts: Sequence[tuple[int, ...]],
        accepted: Sequence[int],
        verified: ModelOutput,
    ) -> Prepared[DraftRows]:
        """The state after each row kept `accepted[b]` of its drafts."""
        ...

    def take_rows(self, keep: Sequence[int]) -> DraftRows: ...

    def join(self, other: DraftRows) -> DraftRows:
        """These rows followed by `other`'s (opened by the same drafter)."""
        ...


@runtime_checkable
class DraftsAhead(Protocol):
    """Draft rows that can launch the next round's drafts before this round's
    host read (`RoundOptions.draft_ahead`): from device arrays only, so the
    launch is queued behind the verify window and runs while the host walks
    and commits this round."""

    def launch_ahead(
        self,
        rows: Sequence[RowState],
        proposal: Proposal,
        verified: ModelOutput,
        depth: int,
    ) -> DraftRows | None:
        """These rows holding the next round's `depth` drafts, launched from
        this round's `proposal` and `verified` (its draws set), before the
        walk. Commit this round through the returned rows' `prepare_commit`;
        their next `propose` of `depth` drafts for the same rows returns the
        launched ones. None where it cannot launch so."""
        ...


@runtime_checkable
class BorrowsTargetCache(Protocol):
    """Draft rows that read the target's own cache when they draft (a
    KV-borrowing drafter: the Gemma-4 assistant attends over the target's
    stored keys and values instead of keeping its own). The round hands them
    the target's cache as it stands before the verify window: positions
    `< row.length` of every row hold the row's committed context; positions
    past them may hold a rejected round's and must be masked."""

    def propose_over(
        self, cache: Any, rows: Sequence[RowState], depth: int
    ) -> Proposal: ...


class Drafter(Protocol):
    """A loaded draft provider: opens row state for a batch of prompts."""

    @property
    def kind(self) -> str: ...

    @property
    def needs_target_hidden(self) -> bool: ...

    def open(self, rows: Sequence[RowState], hidden: mx.array | None) -> DraftRows:
        """Row state for a batch; `hidden` `[B, L, H]` is the target's last-layer
        output over each row's processed prompt when `needs_target_hidden`."""
        ...


@frozen
class DraftState:
    """One row's draft state, captured for the prompt cache
    (`specpipe.prompt_cache`) under its drafter's `namespace`: what the
    drafter holds after the row's first `processed` tokens. Drafters extend
    it with what they keep (`arrays`: its device arrays, for sizing)."""

    namespace: str
    processed: int

    def arrays(self) -> tuple[mx.array, ...]:
        return ()

    def at(self, n: int) -> DraftState | None:
        """A state to resume a row whose first `n` tokens are this state's
        row's (a checkpoint cut back to a shared prefix), or None where this
        state cannot say. One that accounts for fewer tokens is one (the
        drafter catches up, if it can: a drafter that reads the target's
        hidden states is offered only states of exactly `n`)."""
        return self if self.processed <= n else None


@runtime_checkable
class CapturesRows(Protocol):
    """Draft rows that can capture one row's state for a checkpoint."""

    def capture(self, row: int) -> DraftState:
        """Row `row`'s state as it stands (a copy: later rounds leave it be)."""
        ...


@runtime_checkable
class Resumes(Protocol):
    """A drafter that opens rows from captured states (prompt-cache hits).

    `namespace` names the state layout and what it was computed with: a
    state is only offered back to a drafter of the same namespace."""

    @property
    def namespace(self) -> str: ...

    def resume(
        self,
        rows: Sequence[RowState],
        hidden: mx.array | None,
        states: Sequence[DraftState | None],
    ) -> DraftRows:
        """Rows whose draft state starts from `states[b]` (None: from
        nothing, as `open`). `hidden` `[B, L, H]`, when the drafter reads the
        target's hidden states, covers row b's positions from
        `states[b].processed` (0 without a state) to `row.length - 1`,
        right-padded; a drafter that reads them is offered only states whose
        `processed` is where the target's restored state ends."""
        ...
