"""Session fixtures shared by the pipeline tests (helpers: `spec_support`)."""

from __future__ import annotations

import pytest
from spec_support import PlainReference, tiny_model

from models.base import CausalLM


@pytest.fixture(scope="session")
def target() -> CausalLM:
    """The target every test decodes with (seed 1)."""
    return tiny_model(1)


@pytest.fixture(scope="session")
def draft_model() -> CausalLM:
    """A different random model of the same shape, used as a two-model draft."""
    return tiny_model(2)


@pytest.fixture(scope="session")
def plain(target: CausalLM) -> PlainReference:
    return PlainReference(target)
