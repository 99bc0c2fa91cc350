"""DFlash drafting: a whole block of drafts from one forward of a small
draft model that reads the target's hidden states (models/dflash.py).

Per row the draft keeps the context keys and values of the positions it has
seen in its own KV cache, and the target's features (the tapped layers'
outputs, `ModelOutput.features`) of the positions committed since, which it
stores at the start of its next proposal. A proposal of `depth` drafts is
one forward over the block [pending token, mask x depth] at the pending
token's position; block position i + 1's output is the draft for the
target's position length + i + 1, drawn with that position's step key, so
the draft and the target read the same point of their CDFs.

The commit keeps the features of the positions the round committed (the
pending token and the accepted drafts: the verify window's first
accepted + 1 positions). Nothing a round writes into the draft's cache lies
below a row's committed context, so a rejected round needs no undo.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import mlx.core as mx
from attrs import evolve, field, frozen

from models.base import CausalLM, ModelOutput, tapped_columns
from models.cache import KVCache
from models.dflash import DFlashDraft
from models.vocab_head import HeadWeights
from schemas.request import DraftPolicy, SamplingParams
from specpipe.draft import DraftRows, DraftState, Proposal
from specpipe.draft_vocab import SubsetHead
from specpipe.sample_window import sample_window
from specpipe.state import RowState
from specpipe.transaction import Prepared


@frozen
class DFlashState(DraftState):
    """A row's DFlash state: the draft's cache (one row) of its first
    `cached` positions' context, and the target's features of the positions
    after them (`processed - cached`), not yet stored."""

    cache: KVCache
    cached: int
    pending: mx.array  # [processed - cached, n_taps * H]

    def arrays(self) -> tuple[mx.array, ...]:
        return (*self.cache.arrays(), self.pending)

    def at(self, n: int) -> DraftState | None:
        """Cut back to `n` tokens: a position's context keys and values
        depend on its own features alone, so the first n of them are the
        state of n positions."""
        if n >= self.processed:
            return self if n == self.processed else None
        cached = min(self.cached, n)
        return evolve(
            self, processed=n, cached=cached, pending=self.pending[: n - cached]
        )


def namespace_of(draft: DFlashDraft) -> str:
    """A DFlash draft's checkpoint namespace: its shape and the target
    layers it reads."""
    a, settings = draft.args, draft.settings
    taps = "-".join(str(t) for t in settings.target_layers)
    return f"{draft.family}/l{a.num_hidden_layers}/h{a.hidden_size}/taps{taps}"


@frozen
class DFlashRows:
    needs_target_hidden = True
    target: CausalLM
    draft: DFlashDraft
    # the projection the drafts are drawn over: the target's head, or its
    # FR-Spec rows (`ids`: the token id of each row; None: row = token id)
    head: HeadWeights
    policy: DraftPolicy
    cache: KVCache
    cached: tuple[int, ...]  # per row: positions whose context the cache holds
    # per row: [n, n_taps * H] the target's features of positions cached ..
    # cached + n - 1, not yet stored
    pending: tuple[mx.array, ...]
    ids: mx.array | None = None

    def _store_pending(self) -> tuple[int, ...]:
        """Store every row's pending features; the rows' context lengths."""
        longest = max(int(p.shape[0]) for p in self.pending)
        if longest:
            width = self.pending[0].shape[-1]
            padded = [
                p
                if p.shape[0] == longest
                else mx.concatenate(
                    [p, mx.zeros((longest - p.shape[0], width), p.dtype)]
                )
                for p in self.pending
            ]
            self.draft.write_context(mx.stack(padded), self.cache, self.cached)
        return tuple(
            c + int(p.shape[0]) for c, p in zip(self.cached, self.pending, strict=True)
        )

    def propose(self, rows: Sequence[RowState], depth: int) -> Proposal:
        if depth < 1:
            return Proposal.empty(len(rows))
        starts = self._store_pending()
        lengths = tuple(row.length for row in rows)
        assert starts == lengths, f"draft context {starts} != rows {lengths}"
        mask = self.draft.settings.mask_token
        ids = mx.array([[row.pending] + [mask] * depth for row in rows], dtype=mx.int32)
        x = self.target.embed(ids)
        scale = self.draft.settings.embedding_scale
        if scale != 1.0:
            x = x * scale
        normed = self.draft(x, self.cache, starts)[:, 1:]
        logits = self.draft.logits(normed, self.head)
        params = [self.policy.draft_params(row.sampling) for row in rows]
        if self.draft.settings.selector is not None:
            drafted = self._select(normed, logits, ids[:, 0], rows, params)
        else:
            drafted = sample_window(logits, None, rows, params)
            if self.ids is not None:  # FR-Spec: row index -> token id
                drafted = mx.take(self.ids, drafted)
        return Proposal(depth, device=drafted)

    def _select(
        self,
        normed: mx.array,  # [B, D, H] the draft's outputs at the draft positions
        logits: mx.array,  # [B, D, V]
        first: mx.array,  # [B] the block's first token (the pending one)
        rows: Sequence[RowState],
        params: Sequence[SamplingParams],
    ) -> mx.array:  # [B, D] int32
        """DFlash2: position by position, the candidates rescored against the
        token drafted before (`CandidateSelector`), then drawn with the
        position's step key over a vocabulary-wide vector that holds the
        scores at the candidates' ids (-inf elsewhere): the draw is coupled
        with the target's as a plain draft's is."""
        selector = self.draft.candidate_selector
        ids, unary = selector.candidates(logits)
        if self.ids is not None:  # FR-Spec: candidates' row indices -> token ids
            ids = mx.take(self.ids, ids)
        projected = selector.hidden_projection(normed)
        batch, depth = logits.shape[:2]
        vocab = self.draft.args.vocab_size  # (the target's: checked at binding)
        predecessor = first
        drafted = []
        for i in range(depth):
            scores = selector.scores(
                projected[:, i], predecessor, ids[:, i], unary[:, i]
            )
            spread = mx.put_along_axis(
                mx.full((batch, vocab), -mx.inf, dtype=mx.float32),
                ids[:, i],
                scores.astype(mx.float32),
                axis=-1,
            )
            ahead = [evolve(row, step=row.step + i) for row in rows]
            predecessor = sample_window(spread[:, None], None, ahead, params)[:, 0]
            drafted.append(predecessor)
        return mx.stack(drafted, axis=1)

    def prepare_commit(
        self,
        rows: Sequence[RowState],
        proposal: Proposal,
        drafts: Sequence[tuple[int, ...]],
        accepted: Sequence[int],
        verified: ModelOutput,
    ) -> Prepared[DraftRows]:
        if verified.features is None:
            raise RuntimeError(
                "a DFlash draft reads the target's tapped layers, and the target's "
                "forward returned none (its taps were cleared after binding)"
            )
        features = own_features(self.target, self.draft, verified.features)
        # the round's proposal stored the pending features (`propose`)
        stored = proposal.depth > 0
        cached = tuple(row.length for row in rows) if stored else self.cached
        pending = tuple(
            features[b, : a + 1]
            if stored
            else mx.concatenate([self.pending[b], features[b, : a + 1]])
            for b, a in enumerate(accepted)
        )
        return Prepared(lambda: evolve(self, cached=cached, pending=pending))

    def capture(self, row: int) -> DraftState:
        pending = self.pending[row]
        return DFlashState(
            namespace_of(self.draft),
            self.cached[row] + int(pending.shape[0]),
            self.cache.take_rows([row], self.cached[row]),
            self.cached[row],
            pending,
        )

    def take_rows(self, keep: Sequence[int]) -> DraftRows:
        return evolve(
            self,
            cache=self.cache.take_rows(keep),
            cached=tuple(self.cached[i] for i in keep),
            pending=tuple(self.pending[i] for i in keep),
        )

    def join(self, other: DraftRows) -> DraftRows:
        assert isinstance(other, DFlashRows)
        return evolve(
            self,
            cache=KVCache.concat_rows([self.cache, other.cache]),
            cached=self.cached + other.cached,
            pending=self.pending + other.pending,
        )


def own_features(target: CausalLM, draft: DFlashDraft, features: mx.array) -> mx.array:
    """The draft's layers' columns of the target's features (the target may
    tap other drafts' layers too: `Tapping.tap_also`)."""
    taps = getattr(target, "taps", ())
    try:
        return tapped_columns(taps, draft.settings.target_layers, features)
    except ValueError as exc:
        raise RuntimeError(f"a DFlash draft's features: {exc}") from None


@frozen
class DFlashDrafter:
    """A loaded DFlash draft bound to its target (whose forward taps the
    draft's `target_layer_ids`: `models.llama.Model.tap`)."""

    needs_target_hidden = True
    target: CausalLM
    draft: DFlashDraft
    policy: DraftPolicy = field(factory=DraftPolicy)
    kind: str = "dflash"
    # FR-Spec: the drafts drawn over these rows of the target's head only
    subset: SubsetHead | None = None

    def calibration_head(self) -> HeadWeights | None:
        """The head rows a draft projects onto (its FR-Spec list), if not all."""
        return self.subset.weights if self.subset is not None else None

    @property
    def calibration_key(self) -> str:
        """What sets a draft round's cost apart in the calibration cache: its
        kind, its quantized layers' bits and its FR-Spec list's size."""
        key = self.kind
        bits = self.draft.quantized_bits
        if bits:
            key += f"/bits={'+'.join(str(b) for b in bits)}"
        if self.subset is not None:
            key += f"/vocab={int(self.subset.ids.shape[0])}"
        return key

    def calibration_round(
        self, context: mx.array, hidden: mx.array
    ) -> Callable[[int], mx.array]:
        """A draft round of any depth as decoding runs it
        (`specpipe.calibrate.DraftRound`): rows opened on the context (its
        features from the target's own forward: `hidden` is the last layer's
        only) with all but one position stored, so each call stores one
        committed position and drafts one block; greedy. Its cache writes are
        scratch: every call drafts from the same state."""
        ids: list[int] = context.reshape(-1).tolist()  # type: ignore[assignment]
        rows = [RowState.start(tuple(ids), 64, SamplingParams())]
        out = self.target(context[:, :-1], self.target.make_cache(1), [0])
        assert out.features is not None, "the target taps no layers"
        opened = self.open(rows, out.features)
        assert isinstance(opened, DFlashRows)
        length = rows[0].length
        features = own_features(self.target, self.draft, out.features)
        opened.draft.write_context(
            features[:, : length - 1], opened.cache, opened.cached
        )
        ready_rows = evolve(
            opened, cached=(length - 1,), pending=(features[0, length - 1 :],)
        )

        def run(depth: int) -> mx.array:  # [1, depth] int32
            drafted = ready_rows.propose(rows, depth)
            assert drafted.device is not None
            return drafted.device

        return run

    @property
    def namespace(self) -> str:
        return namespace_of(self.draft)

    def open(self, rows: Sequence[RowState], hidden: mx.array | None) -> DraftRows:
        """`hidden`: the target's features over each row's processed prompt
        (right-padded), as prefill returns them for a tapping target."""
        return self.resume(rows, hidden, [None] * len(rows))

    def resume(
        self,
        rows: Sequence[RowState],
        hidden: mx.array | None,
        states: Sequence[DraftState | None],
    ) -> DraftRows:
        """Per row, the draft's cache and unstored features from `states[b]`
        (a copy), followed by `hidden`'s."""
        assert hidden is not None, "a DFlash draft needs the prompt's features"
        hidden = own_features(self.target, self.draft, hidden)
        width = len(self.draft.settings.target_layers) * self.draft.args.hidden_size
        if hidden.shape[-1] != width:
            raise RuntimeError(
                f"the target returned features of width {hidden.shape[-1]}, the "
                f"DFlash draft reads {width} (its taps were changed after binding)"
            )
        caches = []
        cached = []
        pending = []
        for b, (row, state) in enumerate(zip(rows, states, strict=True)):
            if isinstance(state, DFlashState):
                caches.append(state.cache.take_rows([0]))
                cached.append(state.cached)
                fresh = hidden[b, : row.length - state.processed]
                pending.append(
                    mx.concatenate([state.pending, fresh.astype(state.pending.dtype)])
                )
            else:
                caches.append(self.draft.make_cache(1))
                cached.append(0)
                pending.append(hidden[b, : row.length])
        return self.rows_of(
            caches[0] if len(caches) == 1 else KVCache.concat_rows(caches),
            tuple(cached),
            tuple(pending),
        )

    def rows_of(
        self, cache: KVCache, cached: tuple[int, ...], pending: tuple[mx.array, ...]
    ) -> DFlashRows:
        """Rows over this context (`DFlashRows`' fields)."""
        subset = self.subset
        return DFlashRows(
            self.target,
            self.draft,
            self.target.head_weights() if subset is None else subset.weights,
            self.policy,
            cache,
            cached,
            pending,
            None if subset is None else subset.ids,
        )
