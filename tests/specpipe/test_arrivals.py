"""Continuous batching: rows join a live batch between rounds and leave when
done; every row's output still equals its plain decoding alone."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from spec_support import CollectSink, run, tiny_model
from test_dflash import dflash2_config, dflash_config, random_draft
from test_mtp import PROMPTS as MTP_PROMPTS
from test_mtp import random_head
from test_mtp import target as mtp_target  # noqa: F401  (pytest fixture)

from schemas.request import SamplingParams
from specpipe.drafts.dflash import DFlashDrafter
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
) -> tuple[list[list[int]], list[Any]]:
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
    return [s.tokens for s in sinks], list(results)


@pytest.mark.parametrize("kind", ["none", "ngram", "two-model", "dflash", "dflash2"])
def test_rows_join_and_leave(kind: str) -> None:
    target = tiny_model(0)
    if kind.startswith("dflash"):
        target.tap((0, 1))  # type: ignore[attr-defined]
    drafter = {
        "none": lambda: None,
        "ngram": lambda: NgramDrafter(1, 3),
        "two-model": lambda: TwoModelDrafter(tiny_model(1)),
        # (the rows' draft caches joined and taken as rows arrive and leave)
        "dflash": lambda: DFlashDrafter(target, random_draft(dflash_config())),
        "dflash2": lambda: DFlashDrafter(target, random_draft(dflash2_config())),
    }[kind]()
    prompts = [(1, 2, 3, 4, 1, 2), (9, 10, 11, 9), (42,), (5,) * 9]
    budgets = [6, 20, 12, 16]  # the first row leaves before the last arrives
    tokens, results = staged(target, prompts, drafter, 3, budgets)
    for prompt, n, got in zip(prompts, budgets, tokens, strict=True):
        alone, _ = run(target, [prompt], SAMPLING, max_tokens=n)
        assert got == alone[0]
    assert [r.finish for r in results] == ["length"] * 4
    # a draft that failed would be switched off, its rows decoded plainly
    assert all(not r.metrics.draft_errors for r in results)
    if kind not in ("none", "ngram"):  # (prompt lookup may find nothing to copy)
        assert all(r.metrics.drafted > 0 for r in results)


def test_mtp_rows_join(mtp_target: Any) -> None:  # noqa: F811
    drafter = MtpDrafter(mtp_target, random_head(3))
    budgets = [5, 14, 10, 12]
    tokens, _ = staged(mtp_target, MTP_PROMPTS, drafter, 2, budgets)
    for prompt, n, got in zip(MTP_PROMPTS, budgets, tokens, strict=True):
        alone, _ = run(mtp_target, [prompt], SAMPLING, max_tokens=n)
        assert got == alone[0]
