"""Session fixtures shared by the pipeline tests (helpers: `spec_support`)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
from spec_support import VOCAB, PlainReference, tiny_model

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


@pytest.fixture(scope="module")
def tapped() -> CausalLM:
    """The session target's weights (seed 1) in a model of its own, tapping
    layers 0 and 1 for the block drafters' tests (the session target stays
    untapped)."""
    model = tiny_model(1)
    model.tap((0, 1))  # type: ignore[attr-defined]
    return model


@pytest.fixture(scope="module")
def hybrid() -> CausalLM:
    """test_mtp.py's Qwen3-Next target (linear and full attention layers,
    MoE) over spec_support's vocabulary, tapping a linear layer's output and
    a full attention layer's (the block drafters' hybrid target; a module
    that needs another defines its own)."""
    from mlx.utils import tree_flatten, tree_unflatten
    from test_mtp import CONFIG

    from models.build import build_model
    from schemas.hf_hybrid import hybrid_args

    mx.random.seed(0)
    config = {**CONFIG, "vocab_size": VOCAB}
    model: Any = build_model(hybrid_args(config, "hybrid").unwrap()).unwrap()
    model.update(
        tree_unflatten(
            [
                (k, v * 2.5 if v.ndim >= 2 else v)
                for k, v in tree_flatten(model.parameters())
            ]
        )
    )
    mx.eval(model.parameters())
    model.tap((0, 3))  # type: ignore[attr-defined]
    return model
