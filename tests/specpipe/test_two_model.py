"""Staged two-model drafting: prompt-lookup guesses checked by the draft's own
forwards give the plain chain's drafts in fewer forwards.

The lossless property (staged and unstaged, every sampling) is in
test_lossless.py; here: the proposals themselves, the forward count, the
draft's cache after a commit, and the policy's device default.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import pytest
from attrs import evolve
from mlx.utils import tree_flatten, tree_unflatten
from spec_support import VOCAB, cache_prefix, same_prefix

from models.base import CausalLM, ModelOutput
from models.build import build_model
from schemas.request import DraftPolicy, SamplingParams
from specpipe.draft import Proposal
from specpipe.draft_vocab import DraftVocabulary
from specpipe.drafts.two_model import LookupStaging, TwoModelDrafter, TwoModelRows
from specpipe.state import RowState


class CountingModel:
    """A model that counts its forwards (everything else is the model's)."""

    def __init__(self, model: CausalLM) -> None:
        self.model = model
        self.forwards = 0

    def __call__(self, *args: Any, **kwargs: Any) -> ModelOutput:
        self.forwards += 1
        return self.model(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


def successor(source: CausalLM) -> CausalLM:
    """A model of `source`'s shape that mostly writes token + 1: its layers
    add little to the residual (their output products scaled down) and its
    head scores token t' by the embedding of t' - 1."""
    model = build_model(source.args).unwrap()
    params = dict(tree_flatten(source.parameters()))
    embed = params["model.embed_tokens.weight"]
    for name in list(params):
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            params[name] = params[name] * 0.05
    params["lm_head.weight"] = 4.0 * mx.roll(embed, 1, axis=0)
    model.update(tree_unflatten(list(params.items())))
    mx.eval(model.parameters())
    return model


def _rows(sampling: SamplingParams) -> list[RowState]:
    # Each row's tokens hold a run its continuation repeats (token + 1 ...),
    # so prompt lookup guesses what the successor draft writes; the third
    # row's run stops short (a guess it rejects) and starts late.
    prompts = [
        [*range(10, 30), 3, 4, 10, 11],
        [50, 51, *range(40, 60), 7, 40],
        [*range(70, 74), 2, *range(75, 80), 6, 70],
    ]
    return [
        RowState(tuple(p), len(p) - 2, step, 64, sampling)
        for p, step in zip(prompts, (4, 0, 9), strict=True)
    ]


def _proposals(
    drafter: TwoModelDrafter, rows: Sequence[RowState], depth: int, staged: bool
) -> tuple[tuple[tuple[int, ...], ...], int, TwoModelRows]:
    counting = CountingModel(drafter.model)
    opened = drafter.open(rows)
    assert isinstance(opened, TwoModelRows)
    state = evolve(
        opened,
        model=counting,
        bucket=False,
        lookup=LookupStaging() if staged else None,
    )
    proposal = state.propose(rows, depth)
    read = (
        None
        if proposal.device is None
        else [int(t) for t in proposal.device.reshape(-1).tolist()]
    )
    return proposal.resolve(read), counting.forwards, state


@pytest.mark.parametrize(
    "sampling",
    [SamplingParams(), SamplingParams(temperature=1.0, top_p=0.9, top_k=40, seed=4)],
    ids=["greedy", "sampled"],
)
@pytest.mark.parametrize("vocab", [False, True], ids=["full", "fr-spec"])
def test_staged_proposals_equal_the_chain_in_fewer_forwards(
    target: CausalLM, sampling: SamplingParams, vocab: bool
) -> None:
    # a list without the ids past the rows' runs (and its own index order)
    listed = (
        DraftVocabulary.create(range(0, VOCAB - 12), VOCAB).unwrap() if vocab else None
    )
    drafter = TwoModelDrafter(successor(target), vocab=listed)
    rows = _rows(sampling)
    depth = 7
    chain, chain_forwards, _ = _proposals(drafter, rows, depth, staged=False)
    staged, staged_forwards, _ = _proposals(drafter, rows, depth, staged=True)
    assert staged == chain
    assert all(len(d) == depth for d in staged)
    assert chain_forwards == depth
    # the rows' runs are continued: guesses are confirmed, forwards saved
    assert staged_forwards < chain_forwards


def test_staged_commit_leaves_the_cache_of_decoding_the_kept_drafts(
    target: CausalLM,
) -> None:
    """After staging, the draft's cache holds, for each row, exactly the
    positions the commit keeps (guesses it rejected were written past them)."""
    rows = _rows(SamplingParams())
    drafter = TwoModelDrafter(successor(target))
    drafts, _, state = _proposals(drafter, rows, 7, staged=True)
    accepted = [7, 2, 0]
    committed = state.prepare_commit(
        rows,
        Proposal(7, host=drafts),
        drafts,
        accepted,
        ModelOutput(mx.zeros((1, 1, 1)), mx.zeros((1, 1, 1))),
    ).commit()
    assert isinstance(committed, TwoModelRows)
    # reference: a fresh draft state fed each row's kept tokens one pass
    kept_rows = [
        RowState(
            r.tokens + d[: min(a, 6)] + (0,),
            r.prompt_len,
            r.step,
            r.remaining,
            r.sampling,
        )
        for r, d, a in zip(rows, drafts, accepted, strict=True)
    ]
    fresh = drafter.open(kept_rows)
    assert isinstance(fresh, TwoModelRows)
    assert committed.lengths == fresh.lengths
    assert same_prefix(
        cache_prefix(committed.cache, committed.lengths),
        cache_prefix(fresh.cache, fresh.lengths),
    )


def test_staging_defaults_to_the_cpu_only() -> None:
    assert DraftPolicy().stages(on_gpu=False)
    assert not DraftPolicy().stages(on_gpu=True)
    assert DraftPolicy(staged=True).stages(on_gpu=True)
    assert not DraftPolicy(staged=False).stages(on_gpu=False)


def test_lookup_staging_guesses_follow_the_latest_match() -> None:
    staging = LookupStaging(min_n=1, max_n=3)
    assert staging.guesses([1, 2, 3, 4, 1, 2], 2) == (3, 4)
    assert staging.guesses([1, 2, 3], 2) == ()
    assert staging.guesses([1, 2, 1], 0) == ()
