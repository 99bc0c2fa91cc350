"""Continuous batching: rows join a live batch between rounds and leave when
done; every row's output still equals its plain decoding alone."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from spec_support import CollectSink, run, tiny_model
from test_mtp import PROMPTS as MTP_PROMPTS
from test_mtp import random_head
from test_mtp import target as mtp_target  # noqa: F401  (pytest fixture)

from schemas.request import SamplingParams
from specpipe.drafts.mtp import MtpDrafter
from specpipe.drafts.ngram import NgramDrafter
from specpipe.drafts.two_model import TwoModelDrafter
from specpipe.loop import RoundOptions, RowRequest, generate_rows

SAMPLING = SamplingParams(temperature=0.8, top_k=40, seed=6)


def staged(
    model: Any,
    prompts: Sequence[tuple[int, ...]],
    drafter: Any,
    depth: int,
    budgets: Sequence[int],
) -> tuple[list[list[int]], list[str]]:
    """The first prompt starts alone; each later one arrives one round later."""
    sinks = [CollectSink() for _ in prompts]
    requests = [
        RowRequest(p, SAMPLING, n, sink)
        for p, n, sink in zip(prompts, budgets, sinks, strict=True)
    ]
    queue = list(requests[1:])

    def arrivals() -> list[RowRequest]:
        return [queue.pop(0)] if queue else []

    results = generate_rows(
        model, requests[:1], (), drafter, RoundOptions(depth=depth), arrivals
    )
    return [s.tokens for s in sinks], [r.finish for r in results]


@pytest.mark.parametrize("kind", ["none", "ngram", "two-model"])
def test_rows_join_and_leave(kind: str) -> None:
    target = tiny_model(0)
    drafter = {
        "none": None,
        "ngram": NgramDrafter(1, 3),
        "two-model": TwoModelDrafter(tiny_model(1)),
    }[kind]
    prompts = [(1, 2, 3, 4, 1, 2), (9, 10, 11, 9), (42,), (5,) * 9]
    budgets = [6, 20, 12, 16]  # the first row leaves before the last arrives
    tokens, finishes = staged(target, prompts, drafter, 3, budgets)
    for prompt, n, got in zip(prompts, budgets, tokens, strict=True):
        alone, _ = run(target, [prompt], SAMPLING, max_tokens=n)
        assert got == alone[0]
    assert finishes == ["length"] * 4


def test_mtp_rows_join(mtp_target: Any) -> None:  # noqa: F811
    drafter = MtpDrafter(mtp_target, random_head(3))
    budgets = [5, 14, 10, 12]
    tokens, _ = staged(mtp_target, MTP_PROMPTS, drafter, 2, budgets)
    for prompt, n, got in zip(MTP_PROMPTS, budgets, tokens, strict=True):
        alone, _ = run(mtp_target, [prompt], SAMPLING, max_tokens=n)
        assert got == alone[0]
