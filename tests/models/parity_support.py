"""Shared checks of the attention-only models' tests against transformers
(tests/models/test_glm4_moe.py, test_glm_moe_dsa.py, test_gemma4.py): a
config the family's parser refuses, plain DecoderArgs its model refuses, a
prefill's logits, hidden states and head, rows decoding at their own offsets, a random model of a config for the
pipeline, and lossless ngram speculation on it.

`hf` is a transformers model and `model` ours loaded from its weights
(hybrid_support's `ours`); both run in float32 on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import mlx.core as mx
import numpy as np
import torch
from returns.result import Failure, Result

from models.base import ModelOutput
from models.build import build_model
from schemas.converter import hf as hf_converter
from schemas.converter import structure
from schemas.errors import ConfigError, LoadError
from schemas.hf import DecoderArgs
from schemas.request import SamplingParams
from specpipe.drafts.ngram import NgramDrafter
from specpipe.load import args_from_config
from specpipe.loop import RowResult
from tests.models.hybrid_support import as_np, forward, hf_logits
from tests.specpipe.spec_support import PROMPTS, run, scale_matrices

M = TypeVar("M")


def check_refused_config(
    parse: Callable[[dict[str, Any], str], Result[Any, Any]],
    raw: dict[str, Any],
    named: str,
) -> None:
    """`parse` (the family's) refuses `raw` with a ConfigError naming `named`
    after the file's name, and the loader with a LoadError of that message."""
    parsed = parse(raw, "cfg.json")
    assert isinstance(parsed, Failure), raw
    error = parsed.failure()
    assert isinstance(error, ConfigError)
    assert error.message.startswith("cfg.json: ") and named in error.message, error
    # through the loader, a LoadError with the same message
    loaded = args_from_config(raw, "cfg.json")
    assert isinstance(loaded, Failure) and isinstance(loaded.failure(), LoadError)
    assert loaded.failure().message == error.message


def check_needs_own_args(raw: dict[str, Any], named: str) -> None:
    """The family's `raw` config structured as plain DecoderArgs (not the
    family's args class, `named`) builds no model: the error names the class."""
    plain = structure(hf_converter, {**raw, "rope": {}}, DecoderArgs, "x").unwrap()
    built = build_model(plain)
    assert isinstance(built, Failure) and named in built.failure().message


def check_prefill(
    hf: Any, model: Any, ids: np.ndarray, vocab: int, tol: float
) -> tuple[Any, ModelOutput]:
    """One forward of `ids` [B, L] from an empty cache: float32 logits of
    [B, L, vocab], no delta (nothing to commit) and transformers' logits;
    `hidden` is the last layer's output before the final norm. Returns
    transformers' output (with its hidden states) and ours."""
    batch, length = ids.shape
    with torch.no_grad():
        expected = hf(torch.tensor(ids), output_hidden_states=True)
    out = model(mx.array(ids, dtype=mx.int32), model.make_cache(batch), [0] * batch)
    assert out.logits.shape == (batch, length, vocab) and out.logits.dtype == mx.float32
    assert out.delta is None
    assert np.abs(as_np(out.logits) - expected.logits.numpy()).max() < tol
    normed = as_np(model.final_norm(out.hidden))
    assert np.abs(normed - expected.hidden_states[-1].numpy()).max() < tol
    return expected, out


def check_head_weights(hf: Any, model: Any) -> None:
    """The head's matrix is transformers' (its embedding when tied)."""
    head = model.head_weights()
    expected_head = (
        hf.model.embed_tokens.weight
        if hf.config.tie_word_embeddings
        else hf.lm_head.weight
    )
    np.testing.assert_array_equal(as_np(head.weight), expected_head.detach().numpy())


def check_rows_at_different_offsets(
    hf: Any, model: Any, rows: np.ndarray, tol: float, row_tol: float
) -> None:
    """Three `rows` [3, >= 12] of lengths 5, 8 and 3 prefilled right-padded
    as one batch, then a 3-token window and one token at each row's offset:
    each row's logits are its own run alone (`row_tol`: the same math in
    other matmul shapes) and transformers' over its sequence (`tol`)."""
    lengths = (5, 8, 3)
    # right-padded prefill: the shorter rows write junk past their length,
    # which their windows then overwrite (rollback by overwriting)
    padded = np.where(
        np.arange(8)[None, :] < np.array(lengths)[:, None], rows[:, :8], 0
    )
    cache = model.make_cache(3)
    forward(model, padded, cache, [0, 0, 0])
    window = np.stack([rows[b, n : n + 3] for b, n in enumerate(lengths)])
    batched_window = forward(model, window, cache, list(lengths))
    step = np.stack([rows[b, n + 3 : n + 4] for b, n in enumerate(lengths)])
    batched_step = forward(model, step, cache, [n + 3 for n in lengths])
    for b, n in enumerate(lengths):
        alone = model.make_cache(1)
        forward(model, rows[b : b + 1, :n], alone, [0])
        alone_window = forward(model, rows[b : b + 1, n : n + 3], alone, [n])
        alone_step = forward(model, rows[b : b + 1, n + 3 : n + 4], alone, [n + 3])
        assert np.abs(batched_window[b] - alone_window[0]).max() < row_tol
        assert np.abs(batched_step[b] - alone_step[0]).max() < row_tol
        expected = hf_logits(hf, rows[b : b + 1, : n + 4])[0, n:]
        both = np.concatenate([batched_window[b], batched_step[b]], axis=0)
        assert np.abs(both - expected).max() < tol


# --- the pipeline on a random model ------------------------------------------


def scaled_model(args: Any, kind: type[M], seed: int = 1, gain: float = 2.5) -> M:
    """A `kind` of `args` with random weights (`mx.random.seed(seed)`), every
    matrix and stacked expert array scaled by `gain` (varied greedy output,
    peaked but not one-hot sampling), as tests/specpipe/spec_support.py's."""
    mx.random.seed(seed)
    model = build_model(args).unwrap()
    assert isinstance(model, kind)
    scale_matrices(model, gain, stacked=True)
    return model


def check_ngram_speculation(
    model: Any, batch: int, sampling: SamplingParams, max_tokens: int
) -> list[RowResult]:
    """Ngram drafts (depth 3) verified for the first `batch` of spec_support's
    prompts 0, 1 and 3 leave plain decoding's `max_tokens` tokens a row, and
    none of them failed. Returns the speculative run's results."""
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[3]][:batch]
    plain, _ = run(model, prompts, sampling, max_tokens=max_tokens)
    assert all(len(t) == max_tokens for t in plain)
    spec, results = run(
        model, prompts, sampling, NgramDrafter(), depth=3, max_tokens=max_tokens
    )
    assert spec == plain
    assert sum(r.metrics.drafted for r in results) > 0  # drafts were verified
    for r in results:
        assert r.metrics.draft_errors == []
    return results
