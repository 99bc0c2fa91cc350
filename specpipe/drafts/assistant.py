"""KV-borrowing drafting: a small "assistant" model that keeps no cache of
its own and attends over the target's (Gemma-4's `*_assistant` drafters,
models/gemma4_assistant.py).

A row's pending token sits at position p = row.length; the target's cache
holds the keys and values of positions < p. Each draft step feeds the
assistant one vector, [target embedding of the last token | a hidden
state], at the constant position p: the first step's hidden state is the
target's own (its final-normed output at position p - 1, the one that
produced the pending token), each later step's the assistant's projected
output of the step before. Its layers' queries attend over the keys and
values the target stored in the last non-shared layer of each layer type
(`models.gemma4.Model.shared_kv`): all positions < p for full-attention
layers, the last `sliding_window + 1` of them for sliding ones
(transformers' bidirectional window, |distance| <= window). Step i's draft
is drawn with the step key of the target's window position i, so the draft
and the target read the same point of their CDFs.

So the only state a row keeps between rounds is one vector: the target's
normed hidden state at p - 1, taken from the verify window at the row's
accepted length (the position whose sample became the new pending token).
Nothing is written anywhere while drafting, so a rejected round needs no
undo.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import mlx.core as mx
from attrs import evolve, field, frozen

from models.base import CausalLM, ModelOutput, rope_offset
from schemas.request import DraftPolicy, SamplingParams
from specpipe.draft import DraftRows, DraftState, Proposal
from specpipe.sample_window import sample_window
from specpipe.state import RowState
from specpipe.transaction import Prepared

KV = tuple[mx.array, mx.array]  # keys, values [B, Hkv, C, D]


class LendingTarget(CausalLM, Protocol):
    """A target a KV-borrowing draft reads the stored keys/values of
    (models/gemma4.py)."""

    def shared_kv(self, cache: Any, layer_type: str) -> KV: ...


class BorrowingDraft(Protocol):
    """The assistant model as the drafter drives it (models/gemma4_assistant.py)."""

    @property
    def layer_types(self) -> tuple[str, ...]:
        """The layer types whose target keys/values its layers read."""
        ...

    @property
    def sliding_window(self) -> int: ...

    def __call__(
        self,
        x: mx.array,  # [B, L, 2 * target hidden]
        kv: Mapping[str, KV],
        masks: Mapping[str, mx.array],  # per layer type [B, 1, 1, C] bool
        rope_at: int | mx.array,
    ) -> tuple[mx.array, mx.array]:
        """Logits [B, L, V] and the projected hidden state [B, L, target hidden]."""
        ...


def borrowed_masks(
    positions: Sequence[int],  # per row: the pending token's position p
    span: int,  # the key buffers' length
    layer_types: Sequence[str],
    sliding_window: int,
) -> dict[str, mx.array]:
    """Per layer type, which key positions row b's query at p may see
    `[B, 1, 1, span]`: all j < p (full attention), or p - window - 1 <= j < p
    (sliding attention)."""
    p = mx.array(list(positions), dtype=mx.int32)[:, None, None, None]
    key = mx.arange(span, dtype=mx.int32)[None, None, None, :]
    below = key < p
    masks: dict[str, mx.array] = {}
    for kind in set(layer_types):
        if kind == "sliding_attention":
            masks[kind] = below & (key >= p - sliding_window - 1)
        else:
            masks[kind] = below
    return masks


@frozen
class AssistantState(DraftState):
    """A row's assistant state: the target's normed hidden state at position
    `processed - 1` (`[H]`)."""

    hidden: mx.array

    def arrays(self) -> tuple[mx.array, ...]:
        return (self.hidden,)

    def at(self, n: int) -> DraftState | None:
        # the hidden state of an earlier position is not kept: only this one
        # (a resume with more tokens takes the target's hidden states of them)
        return self if self.processed <= n else None


def namespace_of(target_hidden: int) -> str:
    """The state is the target's own normed hidden state: any assistant of
    one target reads the same one."""
    return f"assistant/target-h{target_hidden}"


@frozen
class AssistantRows:
    needs_target_hidden = True
    target: LendingTarget
    draft: BorrowingDraft
    policy: DraftPolicy
    hidden: mx.array  # [B, 1, H] per row: the target's normed output at p - 1
    lengths: tuple[int, ...]  # per row: the positions the hidden state follows

    def propose(self, rows: Sequence[RowState], depth: int) -> Proposal:
        raise RuntimeError(
            "an assistant draft reads the target's cache: the round calls "
            "propose_over(cache, rows, depth)"
        )

    def propose_over(
        self, cache: Any, rows: Sequence[RowState], depth: int
    ) -> Proposal:
        if depth < 1:
            return Proposal.empty(len(rows))
        positions = tuple(row.length for row in rows)
        assert positions == self.lengths, f"draft rows {self.lengths} != {positions}"
        kinds = self.draft.layer_types
        kv = {kind: self.target.shared_kv(cache, kind) for kind in set(kinds)}
        span = int(next(iter(kv.values()))[0].shape[2])
        masks = borrowed_masks(positions, span, kinds, self.draft.sliding_window)
        rope_at = rope_offset(positions)
        params = [self.policy.draft_params(row.sampling) for row in rows]
        token = mx.array([[row.pending] for row in rows], dtype=mx.int32)
        hidden = self.hidden
        drafted = []
        for i in range(depth):
            x = mx.concatenate([self.target.embed(token), hidden], axis=-1)
            logits, hidden = self.draft(x, kv, masks, rope_at)
            ahead = [evolve(row, step=row.step + i) for row in rows]
            token = sample_window(logits, None, ahead, params)  # [B, 1]
            drafted.append(token)
        return Proposal(depth, device=mx.concatenate(drafted, axis=1))

    def prepare_commit(
        self,
        rows: Sequence[RowState],
        proposal: Proposal,
        drafts: Sequence[tuple[int, ...]],
        accepted: Sequence[int],
        verified: ModelOutput,
    ) -> Prepared[DraftRows]:
        # window position a's output produced the row's new pending token
        index = mx.array(list(accepted), dtype=mx.int32)[:, None, None]
        last = mx.take_along_axis(verified.hidden, index, axis=1)  # [B, 1, H]
        hidden = self.target.final_norm(last).astype(self.hidden.dtype)
        lengths = tuple(
            row.length + a + 1 for row, a in zip(rows, accepted, strict=True)
        )
        return Prepared(lambda: evolve(self, hidden=hidden, lengths=lengths))

    def capture(self, row: int) -> DraftState:
        return AssistantState(
            namespace_of(int(self.hidden.shape[-1])),
            self.lengths[row],
            self.hidden[row, 0],
        )

    def take_rows(self, keep: Sequence[int]) -> DraftRows:
        index = mx.array(list(keep), dtype=mx.int32)
        return evolve(
            self,
            hidden=mx.take(self.hidden, index, axis=0),
            lengths=tuple(self.lengths[i] for i in keep),
        )

    def join(self, other: DraftRows) -> DraftRows:
        assert isinstance(other, AssistantRows)
        return evolve(
            self,
            hidden=mx.concatenate(
                [self.hidden, other.hidden.astype(self.hidden.dtype)]
            ),
            lengths=self.lengths + other.lengths,
        )


@frozen
class AssistantDrafter:
    """A loaded assistant draft bound to its Gemma-4 target."""

    needs_target_hidden = True
    target: LendingTarget
    draft: BorrowingDraft
    hidden_size: int  # the target's
    policy: DraftPolicy = field(factory=DraftPolicy)
    kind: str = "assistant"

    @property
    def namespace(self) -> str:
        return namespace_of(self.hidden_size)

    def open(self, rows: Sequence[RowState], hidden: mx.array | None) -> DraftRows:
        """`hidden`: the target's last-layer outputs over each row's
        processed prompt (right-padded)."""
        return self.resume(rows, hidden, [None] * len(rows))

    def resume(
        self,
        rows: Sequence[RowState],
        hidden: mx.array | None,
        states: Sequence[DraftState | None],
    ) -> DraftRows:
        """Per row, the target's normed output at the last processed
        position: from `hidden` (covering positions from `states[b].processed`
        on) where it holds that position, else the state's."""
        assert hidden is not None, "an assistant draft needs the target's hidden states"
        vectors = []
        for b, (row, state) in enumerate(zip(rows, states, strict=True)):
            start = state.processed if isinstance(state, AssistantState) else 0
            if row.length > start:
                vectors.append(
                    self.target.final_norm(hidden[b, row.length - start - 1])
                )
            elif isinstance(state, AssistantState):
                vectors.append(state.hidden)
            else:
                raise ValueError("an assistant draft needs at least one prompt token")
        dtype = vectors[0].dtype
        return AssistantRows(
            self.target,
            self.draft,
            self.policy,
            mx.stack([v.astype(dtype) for v in vectors])[:, None, :],
            tuple(row.length for row in rows),
        )

    @property
    def calibration_key(self) -> str:
        return self.kind

    def calibration_round(
        self, context: mx.array, hidden: mx.array
    ) -> Callable[[int], mx.array]:
        """A draft round of any depth as decoding runs it
        (`specpipe.calibrate.DraftRound`), over the target's cache of the
        context less its last token; greedy."""
        ids: list[int] = context.reshape(-1).tolist()  # type: ignore[assignment]
        rows = [RowState.start(tuple(ids), 64, SamplingParams())]
        cache = self.target.make_cache(1)
        out = self.target(context[:, :-1], cache, [0], prefill=True)
        opened = self.open(rows, out.hidden)
        assert isinstance(opened, AssistantRows)

        def run(depth: int) -> mx.array:  # [1, depth] int32
            drafted = opened.propose_over(cache, rows, depth)
            assert drafted.device is not None
            return drafted.device

        return run
