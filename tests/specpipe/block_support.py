"""Shared pieces of the block drafters' tests (test_dflash.py, test_dspark.py,
test_dspark_gemma4.py; their `tapped` target is conftest.py's): the target's
features of a prompt, feature rows right-padded, fresh row states, a draft's
context written in two chunks, and a target to bind a draft folder to
(spec_support.write_artifact writes one); and the checks a block drafter passes: its output is
plain decoding's, a prompt-cache resume drafts as a fresh run does, and (for
DSpark, on any target) a commit leaves the draft of a fresh open, an artifact
binds with its block width, and one that does not fit is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
from returns.result import Failure, Success
from spec_support import PROMPTS, PlainReference, run

from bindings.kinds import default_registry
from bindings.registry import DraftLoadRequest
from schemas.request import SamplingParams
from specpipe.draft import Drafter, Proposal
from specpipe.drafts.dspark import DSparkDrafter, DSparkRows
from specpipe.state import RowState


def features(model: Any, tokens: list[int]) -> mx.array:  # [1, n, taps x H]
    """The tapping `model`'s features of `tokens` processed from position 0."""
    out = model(mx.array([tokens]), model.make_cache(1), [0])
    assert out.features is not None
    return out.features


def padded(parts: list[mx.array]) -> mx.array:  # [B, T, F]
    """One-row feature arrays right-padded with zeros to the longest."""
    longest = max(p.shape[1] for p in parts)
    return mx.concatenate(
        [
            mx.concatenate([p, mx.zeros((1, longest - p.shape[1], p.shape[-1]))], 1)
            for p in parts
        ]
    )


def start_rows(prompts: list[list[int]], sampling: SamplingParams) -> list[RowState]:
    return [RowState.start(tuple(p), 32, sampling) for p in prompts]


def two_rows_in_context(
    target: Any, draft: Any
) -> tuple[list[list[int]], list[mx.array], Any]:
    """Two prompts (11 and 5 context positions before their pending
    tokens), the target's features of their context, and a fresh draft cache
    holding it, written in two chunks per row of different lengths (4 then
    7, 2 then 3)."""
    prompts = [list(range(3, 15)), [7, 8, 9, 10, 11, 12]]
    context = [features(target, p[:-1]) for p in prompts]
    cache = draft.make_cache(2)
    first = [4, 2]
    draft.write_context(
        padded([f[:, :n] for f, n in zip(context, first, strict=True)]),
        cache,
        [0, 0],
    )
    draft.write_context(
        padded([f[:, n:] for f, n in zip(context, first, strict=True)]),
        cache,
        first,
    )
    return prompts, context, cache


def check_greedy_drafts(
    drafter: Drafter,
    prompts: list[list[int]],
    context: list[mx.array],
    depths: Sequence[int],
    reference: Callable[[mx.array, int, int], list[int]],
) -> None:
    """At each of `depths`, `drafter` opened over the rows' `context`
    proposes (greedily) `reference(context[b], pending token, depth)` for
    each row b."""
    rows = start_rows(prompts, SamplingParams())
    for depth in depths:
        proposal = drafter.open(rows, padded(context)).propose(rows, depth)
        assert proposal.depth == depth and proposal.device is not None
        assert proposal.device.tolist() == [
            reference(context[b], p[-1], depth) for b, p in enumerate(prompts)
        ], depth


# --- checks ----------------------------------------------------------------------


def check_output_is_plain(
    target: Any,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    drafter: Drafter,
    depth: int,
    plain: PlainReference,
) -> None:
    """`drafter` drafting `depth` tokens a round leaves `plain`'s output, the
    draft running every round."""
    tokens, results = run(target, prompts, params, drafter, depth=depth)
    assert all(r.finish == "length" for r in results)
    # the draft ran every round (a failing draft is switched off, not raised)
    assert all(not r.metrics.draft_errors and r.metrics.drafted > 0 for r in results)
    assert tokens == plain(prompts, params)


def check_prompt_cache_resumes(
    target: Any,
    params: SamplingParams,
    drafter_of: Callable[[list[int]], Drafter],
    depth: int,
) -> None:
    """A conversation's next turn starts from the first turn's checkpoint
    (the draft's captured context and pending features) and decodes as a
    run without the cache does, its drafts accepted as without the cache.
    `drafter_of` makes the drafter from the next turn's whole plain output
    (prompt included)."""
    # imported here: test_prompt_cache imports test_dflash, which imports this
    from test_prompt_cache import NEW_TURN, generate

    from specpipe.prompt_cache import PromptCache

    prompt = list(PROMPTS[0])
    first, _ = generate(target, [prompt], params, None, 0, None)
    turn = prompt + first[0] + list(NEW_TURN)
    second, _ = generate(target, [turn], params, None, 0, None)
    drafter = drafter_of(turn + second[0])
    store = PromptCache(target)
    out, _ = generate(target, [prompt], params, drafter, depth, store)
    assert out == first
    again, results = generate(target, [turn], params, drafter, depth, store)
    fresh, fresh_results = generate(target, [turn], params, drafter, depth, None)
    assert results[0].cached_tokens > 0
    assert again == fresh == second
    # the restored draft state is the computed one: the same drafts accepted
    assert results[0].metrics.accepted > 0
    assert results[0].metrics.accepted_at == fresh_results[0].metrics.accepted_at


def check_a_commit_leaves_a_fresh_open(
    target: Any, drafter: DSparkDrafter, depth: int, block: int, mask: int, width: int
) -> None:
    """Rows of 11, 5 and 1 prompt tokens opened over the `target`'s features
    (`width` wide) of all but their pending tokens. After a round (drafted
    at `depth`: accepted 0, 2 and the whole `block`; or depth 0, a plain
    round, where the draft stores nothing) verified by the target and
    committed, the draft's context and drafts are those of a draft opened
    fresh over the committed tokens."""
    prompts = [list(range(3, 14)), [7, 8, 9, 10, 11], [42]]
    rows = start_rows(prompts, SamplingParams())
    hidden = padded(
        [
            features(target, p[:-1]) if len(p) > 1 else mx.zeros((1, 0, width))
            for p in prompts
        ]
    )
    state = drafter.open(rows, hidden)
    assert isinstance(state, DSparkRows)
    proposal = state.propose(rows, depth) if depth else Proposal.empty(len(rows))
    drafted = proposal.device.tolist() if proposal.device is not None else [[]] * 3
    windows = [[row.pending, *d] for row, d in zip(rows, drafted, strict=True)]
    target_cache = target.make_cache(len(prompts))
    longest = max(len(p) - 1 for p in prompts)
    target(
        mx.array([p[:-1] + [0] * (longest - len(p) + 1) for p in prompts]),
        target_cache,
        [0] * len(prompts),
    )
    verified = target(mx.array(windows), target_cache, [row.length for row in rows])
    accepted = [0, 2, block] if depth else [0, 0, 0]
    committed = state.prepare_commit(
        rows, proposal, [tuple(d) for d in drafted], accepted, verified
    ).commit()
    assert isinstance(committed, DSparkRows)
    after = [
        row.advanced((*d[:a], 1 + b))
        for b, (row, d, a) in enumerate(zip(rows, drafted, accepted, strict=True))
    ]
    fresh = drafter.open(
        after, padded([features(target, list(r.tokens)[:-1]) for r in after])
    )
    assert isinstance(fresh, DSparkRows)
    assert (
        committed._store_pending()
        == fresh._store_pending()
        == tuple(r.length for r in after)
    )
    ids = mx.array([[r.pending] + [mask] * (block - 1) for r in after])
    lengths = [r.length for r in after]
    x = committed.draft.embed(ids)  # type: ignore[attr-defined]
    one = committed.draft(x, committed.cache, lengths)
    two = fresh.draft(x, fresh.cache, lengths)
    assert mx.allclose(one, two, atol=2e-4, rtol=2e-4).item()
    ours, theirs = committed.propose(after, block), fresh.propose(after, block)
    assert ours.device is not None and theirs.device is not None
    assert ours.device.tolist() == theirs.device.tolist()


# --- binding ---------------------------------------------------------------------


def as_target(model: Any) -> Any:
    """`model` as the loaded target a draft binds to."""
    return SimpleNamespace(model=model, args=model.args, source="tiny")


def check_dspark_binds(
    folder: Path, target: Any, block: int, taps: tuple[int, ...], namespace: str
) -> DSparkDrafter:
    """`folder` is detected as a DSpark draft and binds to the untapped
    `target`, at its `block` width, tapping `taps`, under `namespace`.
    Returns the bound drafter."""
    registry = default_registry()
    assert registry.detect(folder) == Success("dspark")
    assert target.model.taps == ()
    loaded = registry.load(
        "dspark", DraftLoadRequest(target=target, source=str(folder))
    )
    assert isinstance(loaded, Success), loaded
    assert (loaded.unwrap().kind, loaded.unwrap().width) == ("dspark", block)
    assert target.model.taps == taps
    bound = loaded.unwrap().drafter
    assert isinstance(bound, DSparkDrafter) and bound.kind == "dspark"
    assert bound.namespace == namespace
    return bound


def check_dspark_refused(folder: Path, target: Any, message: str) -> None:
    """`folder`, detected as a DSpark draft, does not bind to `target`: the
    error says `message`, and nothing was tapped."""
    registry = default_registry()
    assert registry.detect(folder) == Success("dspark")
    loaded = registry.load(
        "dspark", DraftLoadRequest(target=target, source=str(folder))
    )
    assert isinstance(loaded, Failure)
    assert message in loaded.failure().message, loaded.failure().message
    assert target.model.taps == ()  # nothing bound, nothing tapped
