"""The rollback tests every hybrid model's test module runs (tests/models/
test_qwen3_next.py, test_qwen3_5.py, test_qwen3_5_moe.py): committing k
positions of a verify window equals decoding those k tokens one by one, and
rows keeping different counts each equal the row run alone.

A module imports the two tests and the `prefilled` fixture (`prefilled_cache`)
by name, so pytest collects them there; they run on that module's own
module-scoped `pair` fixture (its HF model and ours). The checks themselves
are hybrid_support's.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from models.hybrid_cache import HybridCache
from models.qwen3_next import Model
from tests.models.hybrid_support import (
    VOCAB,
    check_commit_k_of_a_window,
    check_rows_keeping_different_counts,
    prefilled,
)


@pytest.fixture(scope="module", name="prefilled")
def prefilled_cache(pair: tuple[Any, Model]) -> tuple[HybridCache, int]:
    """Module-scoped: one 7-token prefill serves every hypothesis example."""
    return prefilled(pair[1])


@settings(
    max_examples=10,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    kept=st.integers(0, 4),
    window=st.lists(st.integers(0, VOCAB - 1), min_size=4, max_size=4),
    further=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=3),
)
def test_committing_k_of_a_window_equals_decoding_k_tokens(
    pair: tuple[Any, Model],
    prefilled: tuple[HybridCache, int],
    kept: int,
    window: list[int],
    further: list[int],
) -> None:
    base, length = prefilled
    check_commit_k_of_a_window(pair[1], base, length, kept, window, further)


def test_rows_keeping_different_counts_equal_each_row_alone(
    pair: tuple[Any, Model],
) -> None:
    check_rows_keeping_different_counts(pair[1])
