"""The prompt cache: rows' states kept after a run, to start later prompts from.

A *checkpoint* is one row's state after its first `tokens` were processed:
the target's cache (one row: attention keys/values and, in a hybrid model,
its recurrent states) and, under the drafter's namespace, the draft's own
(`specpipe.draft.DraftState`). A later prompt that begins with those tokens
starts from the checkpoint and prefills only the rest.

A checkpoint serves a prompt that begins with all of its tokens (leaving at
least the prompt's last token, which becomes the row's pending token). Where
the target is attention only, it also serves a prompt that shares only a
prefix with it: keys and values past a row's length are never read, so the
state of the first n tokens is the checkpoint's cut to n (the draft's state
is cut with it where the drafter can: `DraftState.at`). A recurrent state
folds in every token it has seen and cannot be cut back.

What is kept:
- after a prompt's prefill (`capture_prompts`): the prompt's state, so the
  same prompt, or one extending it, skips its prefill;
- when a row ends by a stop (end-of-sequence token, stop string) or its
  token budget: everything the row processed, its end-of-sequence token
  included, so the next turn of a conversation (that turn's prompt extends
  this one's prompt and output) prefills only its new tokens.
  Cancelled and failed rows are never kept.

Output is unchanged by the cache: a restored state equals the one a prefill of
the same tokens would compute, up to the batching of floating-point sums (the
same difference as between a batch and a single row), and the draft state
only changes which drafts are offered, never which tokens are published.

A cache's checkpoints can be written to a file and read into another
process's cache (`specpipe.prompt_cache_file`).

Changes to the store are prepared changes (`specpipe.transaction`): a run
prepares its uses and inserts and commits them only after the admission or
the row they belong to succeeded. Checkpoints are evaluated when captured and
copied when restored: a run never writes into one.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from attrs import define, field, frozen

from specpipe.draft import DraftState
from specpipe.transaction import Prepared

DEFAULT_MAX_BYTES = 2 << 30
DEFAULT_MAX_ENTRIES = 64


@frozen
class Checkpoint:
    tokens: tuple[int, ...]  # the processed tokens the states account for
    target: Any  # the target's ModelCache, one row
    draft: DraftState | None = None

    @property
    def nbytes(self) -> int:
        arrays = [*self.target.arrays(), *self._draft_arrays()]
        return sum(int(a.nbytes) for a in arrays)

    def _draft_arrays(self) -> tuple[mx.array, ...]:
        return self.draft.arrays() if self.draft is not None else ()

    def evaluate(self) -> None:
        """Compute its arrays now (they stop holding the buffers they came from)."""
        mx.eval(*self.target.arrays(), *self._draft_arrays())

    def restored_target(self) -> Any:
        """A copy of the target's state to run on (the checkpoint stays as it is)."""
        return self.target.take_rows([0])


def _shared(tokens: tuple[int, ...], other: tuple[int, ...]) -> int:
    """How many first tokens the two have in common."""
    n = min(len(tokens), len(other))
    if tokens[:n] == other[:n]:
        return n
    return next(i for i in range(n) if tokens[i] != other[i])


@frozen
class Match:
    """A lookup's answer: the checkpoint a prompt starts from."""

    checkpoint: Checkpoint
    # the draft state to resume from: None where there is none under the
    # drafter's namespace (the drafter then opens the row from nothing)
    draft: DraftState | None
    length: int  # the checkpoint's first tokens the prompt begins with


@define
class CacheStats:
    lookups: int = 0
    hits: int = 0
    reused_tokens: int = 0  # prompt tokens not prefilled thanks to a hit
    inserted: int = 0
    evicted: int = 0


# a checkpoint's key: its tokens and its draft state's namespace ("" for none)
_Key = tuple[tuple[int, ...], str]


@define
class PromptCache:
    """Checkpoints of one target, most recently used last, within a byte budget.

    Bound to the target model it was made for (`model`): a lookup for
    another model is refused, as its states would not mean anything there."""

    model: Any = field(repr=False)
    max_bytes: int = DEFAULT_MAX_BYTES
    max_entries: int = DEFAULT_MAX_ENTRIES
    capture_prompts: bool = True
    stats: CacheStats = field(factory=CacheStats)
    _entries: OrderedDict[_Key, Checkpoint] = field(
        factory=OrderedDict, init=False, repr=False
    )
    _sizes: dict[_Key, int] = field(
        factory=dict, init=False, repr=False
    )  # each entry's bytes, measured once when it is inserted

    def __attrs_post_init__(self) -> None:
        if self.max_bytes <= 0 or self.max_entries <= 0:
            raise ValueError(
                "a prompt cache needs a positive byte budget and entry count "
                f"(got {self.max_bytes} bytes, {self.max_entries} entries)"
            )

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return sum(self._sizes.values())

    def check_model(self, model: Any) -> None:
        if model is not self.model:
            raise ValueError(
                "this prompt cache holds another model's states; make one for "
                "this model (PromptCache(model))"
            )

    def lookup(
        self,
        prompt: Sequence[int],
        namespace: str | None,
        needs_draft: bool,
    ) -> Match | None:
        """The checkpoint that serves most of `prompt`, leaving at least its
        last token: one whose tokens all begin it, or, where the target's
        state can be cut back (attention only), one sharing a prefix with it.
        `namespace`: the drafter's (None: no drafter, or one that cannot
        resume), whose state a match carries where the checkpoint has one
        (cut back with it); `needs_draft`: only checkpoints with that state
        will do (a drafter that reads the target's hidden states cannot start
        without it). A lookup changes nothing: `prepare_use` records the hit."""
        best: Match | None = None
        processed = tuple(prompt[:-1])
        for (tokens, _), checkpoint in self._entries.items():
            n = _shared(tokens, processed)
            if n < len(tokens) and not checkpoint.target.truncatable:
                n = 0
            if n == 0 or (best is not None and n <= best.length):
                continue
            draft = checkpoint.draft
            usable = (
                draft.at(n)
                if draft is not None
                and namespace is not None
                and draft.namespace == namespace
                else None
            )
            if needs_draft and (usable is None or usable.processed != n):
                continue
            best = Match(checkpoint, usable, n)
        return best

    def prepare_use(self, matches: Sequence[Match | None]) -> Prepared[None]:
        """Record a run's lookups (and mark the checkpoints they hit as used
        last) when committed."""

        def apply() -> None:
            self.stats.lookups += len(matches)
            for match in matches:
                if match is None:
                    continue
                self.stats.hits += 1
                self.stats.reused_tokens += match.length
                key = self._key(match.checkpoint)
                if key in self._entries:
                    self._entries.move_to_end(key)

        return Prepared(apply)

    def prepare_insert(self, checkpoint: Checkpoint) -> Prepared[None]:
        """Keep `checkpoint` (replacing one of the same tokens and namespace),
        evicting the least recently used beyond the budget, when committed. A
        checkpoint larger than the whole budget is not kept."""
        checkpoint.evaluate()
        size = checkpoint.nbytes

        def apply() -> None:
            if size > self.max_bytes:
                return
            key = self._key(checkpoint)
            evicted = self._admit(self._order(), key, size)
            self._entries.pop(key, None)
            self._entries[key] = checkpoint
            self._sizes[key] = size
            for dropped in evicted:
                del self._entries[dropped], self._sizes[dropped]
            self.stats.inserted += 1
            self.stats.evicted += len(evicted)

        return Prepared(apply)

    def surviving(self, incoming: Sequence[Checkpoint]) -> list[Checkpoint]:
        """The checkpoints of `incoming` that inserting them all, in order,
        would leave kept: the inserts' evictions played on sizes alone, so
        checkpoints read lazily (a file's) are read only where kept.
        Inserting only these keeps at least what inserting all would when
        `incoming`'s tokens are distinct (a file's) or the cache is empty (a
        merge's); otherwise an arrival replaced by a later one may have made
        room by replacing one of the cache's own first."""
        order = self._order()
        owner: dict[_Key, Checkpoint] = {}  # the checkpoint last given each key
        for checkpoint in incoming:
            size = checkpoint.nbytes
            if size > self.max_bytes:
                continue
            key = self._key(checkpoint)
            owner[key] = checkpoint
            self._admit(order, key, size)
        return [
            c
            for c in incoming
            if self._key(c) in order and owner.get(self._key(c)) is c
        ]

    def _order(self) -> OrderedDict[_Key, int]:
        """The entries' sizes, least recently used first."""
        return OrderedDict((key, self._sizes[key]) for key in self._entries)

    def _admit(self, order: OrderedDict[_Key, int], key: _Key, size: int) -> list[_Key]:
        """`key` (`size` bytes) made the most recently used of `order`, then
        the least recently used evicted while past the byte budget or the
        entry count: the keys evicted (an insert's, or one played by
        `surviving`)."""
        order.pop(key, None)
        order[key] = size
        total = sum(order.values())
        evicted: list[_Key] = []
        while total > self.max_bytes or len(order) > self.max_entries:
            dropped, dropped_size = order.popitem(last=False)
            total -= dropped_size
            evicted.append(dropped)
        return evicted

    def clear(self) -> None:
        self._entries.clear()
        self._sizes.clear()

    def checkpoints(self) -> list[Checkpoint]:
        """The checkpoints kept, least recently used first."""
        return list(self._entries.values())

    @staticmethod
    def _key(checkpoint: Checkpoint) -> _Key:
        draft = checkpoint.draft
        return checkpoint.tokens, draft.namespace if draft is not None else ""
