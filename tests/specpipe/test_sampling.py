"""Sampling: request validation, the keyed uniforms, the filters, the inverse
CDF draw and its distribution, greedy, the penalties, window sampling."""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from returns.result import Failure, Success

from schemas.request import SamplingParams
from specpipe import sampling
from specpipe.sample_window import sample_window
from specpipe.sampling import (
    apply_penalties,
    apply_repetition_penalty,
    blockwise_top_k,
    filtered_probs,
    inverse_cdf,
    key_arrays,
    sample,
    step_uniforms,
    token_logprobs,
    top_logprobs,
)
from specpipe.state import RowState

# --- SamplingParams.create ------------------------------------------------------

REJECTED = [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": math.inf}, "temperature"),
    ({"top_p": 0.0}, "top-p"),
    ({"top_p": -0.5}, "top-p"),
    ({"top_p": 1.01}, "top-p"),
    ({"top_p": math.nan}, "top-p"),
    ({"top_k": -1}, "top-k"),
    ({"min_p": -0.01}, "min-p"),
    ({"min_p": 1.0}, "min-p"),
    ({"min_p": math.nan}, "min-p"),
    ({"repetition_penalty": 0.0}, "repetition penalty"),
    ({"repetition_penalty": -1.2}, "repetition penalty"),
    ({"repetition_penalty": math.nan}, "repetition penalty"),
    ({"repetition_penalty": math.inf}, "repetition penalty"),
    ({"repetition_context": 0}, "repetition context"),
    ({"presence_penalty": math.nan}, "presence penalty"),
    ({"frequency_penalty": -math.inf}, "frequency penalty"),
    ({"presence_context": 0}, "presence context"),
    ({"frequency_context": -3}, "frequency context"),
    ({"logit_bias": ((-4, 1.0),)}, "logit bias token ids"),
    ({"seed": -1}, "seed"),
    ({"seed": 2**32}, "seed"),
]


@pytest.mark.parametrize(
    ("kwargs", "named"), REJECTED, ids=[f"{k}" for k, _ in REJECTED]
)
def test_create_rejects_invalid_values_naming_the_parameter(
    kwargs: dict[str, Any], named: str
) -> None:
    result = SamplingParams.create(**kwargs)
    assert isinstance(result, Failure)
    message = result.failure().message
    assert named in message
    assert str(next(iter(kwargs.values()))) in message  # the offending value is shown
    assert "; " not in message  # one problem, one message


def test_create_reports_every_problem_at_once() -> None:
    result = SamplingParams.create(temperature=-1, top_p=2.0, top_k=-3)
    assert isinstance(result, Failure)
    message = result.failure().message
    assert all(name in message for name in ("temperature", "top-p", "top-k"))


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0},
        {"temperature": 2.5, "top_p": 1e-6, "top_k": 1, "min_p": 0.999},
        {"repetition_penalty": 0.5, "repetition_context": 1, "seed": 2**32 - 1},
        {"presence_penalty": -2.0, "frequency_penalty": 2.0, "frequency_context": 1},
    ],
)
def test_create_accepts_boundary_values(kwargs: dict[str, Any]) -> None:
    result = SamplingParams.create(**kwargs)
    assert isinstance(result, Success)
    params = result.unwrap()
    for k, v in kwargs.items():
        assert getattr(params, k) == v


# --- step uniforms ------------------------------------------------------------------


def _uniforms(seeds: list[int], steps: list[int]) -> np.ndarray:
    return np.array(step_uniforms(*key_arrays(seeds, steps)))


def test_step_uniforms_are_open_interval_deterministic_and_per_key() -> None:
    steps = list(range(50_000))
    u = _uniforms([7] * len(steps), steps)
    assert u.dtype == np.float32
    assert (u > 0).all() and (u < 1).all()
    assert np.array_equal(u, _uniforms([7] * len(steps), steps))
    # a key's uniform does not depend on what else is drawn with it
    for i in (0, 1, 4321, 49_999):
        assert _uniforms([7], [i])[0] == u[i]
    # extreme keys stay inside (0, 1)
    edge = _uniforms([0, 2**32 - 1, 0, 2**32 - 1], [0, 0, 2**32 - 1, 2**32 - 1])
    assert (edge > 0).all() and (edge < 1).all()
    # different seeds give different streams
    other = _uniforms([8] * len(steps), steps)
    assert np.mean(other == u) < 0.001


def _chi_square(counts: np.ndarray, expected: np.ndarray) -> float:
    return float(np.sum((counts - expected) ** 2 / expected))


@pytest.mark.parametrize("axis", ["steps", "seeds"])
def test_step_uniforms_are_roughly_uniform(axis: str) -> None:
    n, bins = 100_000, 20
    if axis == "steps":
        u = _uniforms([12345] * n, list(range(n)))
    else:
        u = _uniforms(list(range(n)), [3] * n)
    counts = np.histogram(u, bins=bins, range=(0.0, 1.0))[0]
    # chi-square with 19 degrees of freedom: 43.8 is its 0.1% tail
    assert _chi_square(counts, np.full(bins, n / bins)) < 43.8
    assert abs(u.mean() - 0.5) < 0.005
    assert abs(u.var() - 1 / 12) < 0.002
    # consecutive keys are uncorrelated
    assert abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < 0.02
    # a Kolmogorov-Smirnov distance well inside the 1% band (1.63 / sqrt(n))
    ordered = np.sort(u)
    ks = np.max(np.abs(ordered - (np.arange(1, n + 1) - 0.5) / n))
    assert ks < 1.63 / math.sqrt(n)


# --- the draw's distribution -----------------------------------------------------

LOGITS = np.array(
    [2.0, 1.2, 0.3, -0.5, 1.7, 0.0, -1.3, 0.9, 0.6, -0.2, 1.1, -2.0], dtype=np.float32
)


def _draw(
    logits: np.ndarray, params: SamplingParams, n: int, seed: int = 99
) -> np.ndarray:
    flat = mx.array(np.tile(logits, (n, 1)))
    seeds, steps = key_arrays([seed] * n, list(range(n)))
    return np.array(sample(flat, params, seeds, steps))


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def _assert_frequencies(tokens: np.ndarray, probs: np.ndarray) -> None:
    n = len(tokens)
    counts = np.bincount(tokens, minlength=len(probs))
    support = probs > 0
    # never a token outside the support
    assert counts[~support].sum() == 0
    # chi-square over the support: bound at the 0.1% tail (df <= 11: 31.3)
    df = int(support.sum()) - 1
    bound = {1: 10.8, 2: 13.8, 3: 16.3, 4: 18.5, 5: 20.5, 6: 22.5, 7: 24.3, 8: 26.1,
             9: 27.9, 10: 29.6, 11: 31.3}[df]  # fmt: skip
    assert _chi_square(counts[support], n * probs[support]) < bound


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_sampled_frequencies_match_the_tempered_softmax(temperature: float) -> None:
    params = SamplingParams(temperature=temperature, seed=99)
    tokens = _draw(LOGITS, params, 20_000)
    _assert_frequencies(tokens, _softmax(LOGITS.astype(np.float64) / temperature))


def test_sampled_frequencies_with_filters_match_the_renormalised_distribution() -> None:
    params = SamplingParams(temperature=0.8, top_k=8, top_p=0.9, min_p=0.05, seed=99)
    expected = _reference_filter(LOGITS, params)
    assert 2 <= (expected > 0).sum() < 8  # every filter matters here
    tokens = _draw(LOGITS, params, 20_000)
    _assert_frequencies(tokens, expected / expected.sum())


# --- filters ------------------------------------------------------------------------


def _reference_filter(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """The documented order in float64: temperature, top-k, top-p, min-p."""
    x = logits.astype(np.float64) / p.temperature
    if 0 < p.top_k < len(x):
        kth = np.sort(x)[-p.top_k]
        x = np.where(x < kth, -np.inf, x)
    probs = _softmax(x)
    if p.top_p < 1.0:
        order = np.argsort(-probs)
        before = np.cumsum(probs[order]) - probs[order]
        keep = np.zeros(len(x), dtype=bool)
        keep[order[before < p.top_p]] = True
        probs = np.where(keep, probs, 0.0)
    if p.min_p > 0.0:
        probs = np.where(probs < p.min_p * probs.max(), 0.0, probs)
    return probs


def _kept(logits: np.ndarray, params: SamplingParams) -> set[int]:
    probs = np.array(filtered_probs(mx.array(logits[None, :]), params))[0]
    return set(np.flatnonzero(probs > 0).tolist())


# LOGITS ranked: 0 (2.0), 4 (1.7), 1 (1.2), 10 (1.1), 7 (0.9), 8 (0.6), 2 (0.3), ...
FILTER_CASES = [
    (SamplingParams(temperature=1.0, top_k=1), {0}),
    (SamplingParams(temperature=1.0, top_k=3), {0, 4, 1}),
    (SamplingParams(temperature=0.3, top_k=5), {0, 4, 1, 10, 7}),
    (SamplingParams(temperature=1.0, top_k=12), set(range(12))),  # k = V: off
    (SamplingParams(temperature=1.0, top_k=50), set(range(12))),  # k > V: off
    (SamplingParams(temperature=1.0, top_p=0.01), {0}),  # the top token always stays
    (SamplingParams(temperature=1.0, top_p=0.99), set(range(12)) - {11}),  # p11 = 0.005
    (SamplingParams(temperature=1.0, top_p=0.999), set(range(12))),
    (
        SamplingParams(temperature=1.0, min_p=0.5),
        {0, 4},
    ),  # e^1.7/e^2 = 0.74, e^1.2/e^2 = 0.45
    (SamplingParams(temperature=1.0, min_p=0.4), {0, 4, 1, 10}),  # e^-0.9 = 0.407
    (
        SamplingParams(temperature=2.0, min_p=0.4),
        {0, 4, 1, 10, 7, 8, 2},
    ),  # x >= 2 + 2 ln 0.4
    (SamplingParams(temperature=1.0, top_k=3, min_p=0.5), {0, 4}),
]


@pytest.mark.parametrize(("params", "kept"), FILTER_CASES)
def test_filters_remove_exactly_the_expected_tokens(
    params: SamplingParams, kept: set[int]
) -> None:
    assert _kept(LOGITS, params) == kept
    assert set(np.flatnonzero(_reference_filter(LOGITS, params)).tolist()) == kept


def test_top_p_keeps_the_smallest_prefix_reaching_the_mass() -> None:
    probs = _softmax(LOGITS.astype(np.float64))
    order = np.argsort(-probs)
    cumulative = np.cumsum(probs[order])
    for size in range(1, len(order)):
        # a top-p strictly between the mass of the first size-1 tokens and of
        # the first size tokens keeps exactly the first size tokens
        below = cumulative[size - 2] if size > 1 else 0.0
        top_p = float((below + cumulative[size - 1]) / 2)
        expected = set(order[:size].tolist())
        assert (
            _kept(LOGITS, SamplingParams(temperature=1.0, top_p=top_p)) == expected
        ), size


def test_filtered_probabilities_match_the_reference_on_random_logits() -> None:
    rng = np.random.default_rng(0)
    for case in range(60):
        logits = rng.normal(0, 2, size=40).astype(np.float32)
        params = SamplingParams(
            temperature=float(rng.uniform(0.3, 1.5)),
            top_k=int(rng.integers(0, 40)),
            top_p=float(rng.uniform(0.3, 1.0)) if case % 2 else 1.0,
            min_p=float(rng.uniform(0.0, 0.3)) if case % 3 else 0.0,
        )
        got = np.array(filtered_probs(mx.array(logits[None, :]), params))[0]
        ref = _reference_filter(logits, params)
        assert set(np.flatnonzero(got).tolist()) == set(np.flatnonzero(ref).tolist()), (
            case
        )
        np.testing.assert_allclose(got / got.sum(), ref / ref.sum(), atol=1e-5)


def _full_sort_filter(logits: mx.array, params: SamplingParams) -> mx.array:
    """The filters as first written: top-p over the fully sorted vocabulary."""
    scaled = logits * (1.0 / params.temperature)
    if 0 < params.top_k < scaled.shape[-1]:
        kth = mx.min(mx.topk(scaled, params.top_k, axis=-1), axis=-1, keepdims=True)
        scaled = mx.where(scaled < kth, -mx.inf, scaled)
    probs = mx.softmax(scaled, axis=-1)
    ordered = -mx.sort(-probs, axis=-1)
    before = mx.cumsum(ordered, axis=-1) - ordered
    kept = mx.where(before < params.top_p, ordered, mx.inf)
    return mx.where(probs < mx.min(kept, axis=-1, keepdims=True), 0.0, probs)


@pytest.mark.parametrize("ties", [False, True])
def test_top_p_after_top_k_reads_only_the_k_kept_and_is_bit_identical(
    ties: bool,
) -> None:
    rng = np.random.default_rng(3)
    for case in range(80):
        logits = rng.normal(0, 2, size=(3, 300)).astype(np.float32)
        if ties:  # many equal scores, at and around the k-th
            logits = np.round(logits * 2) / 2
        params = SamplingParams(
            temperature=float(rng.uniform(0.3, 1.5)),
            top_k=int(rng.integers(1, 60)),
            top_p=float(rng.uniform(0.05, 1.0)),
        )
        got = np.array(filtered_probs(mx.array(logits), params))
        want = np.array(_full_sort_filter(mx.array(logits), params))
        assert np.array_equal(got, want), (case, params)


# --- inverse CDF ----------------------------------------------------------------------


def test_inverse_cdf_picks_the_first_token_whose_cdf_reaches_u() -> None:
    probs = mx.array([[0.1, 0.0, 0.2, 0.3, 0.0, 0.4]])
    cases = {0.05: 0, 0.1: 0, 0.1001: 2, 0.3: 2, 0.31: 3, 0.6: 3, 0.61: 5, 0.99999: 5}
    for u, token in cases.items():
        assert inverse_cdf(probs, mx.array([u])).item() == token, u
    # unnormalised mass: u scales to the total
    assert inverse_cdf(probs * 7.0, mx.array([0.31])).item() == 3
    # a zero-mass token is never drawn
    u = mx.array(np.linspace(1e-6, 1 - 1e-6, 5001, dtype=np.float32))
    drawn = set(np.array(inverse_cdf(mx.broadcast_to(probs, (5001, 6)), u)).tolist())
    assert drawn == {0, 2, 3, 5}


@pytest.mark.parametrize("seed", range(6))
def test_inverse_cdf_over_a_subset_equals_the_full_vocabulary(seed: int) -> None:
    """Zero mass outside a subset S: drawing over S (then mapping back to ids)
    reads the same CDF point as drawing over the whole vocabulary."""
    rng = np.random.default_rng(seed)
    vocab, size, n = 1000, 64, 4000
    subset = np.sort(rng.choice(vocab, size=size, replace=False))
    mass = rng.gamma(0.5, size=size).astype(np.float32)
    full = np.zeros(vocab, dtype=np.float32)
    full[subset] = mass
    u = step_uniforms(*key_arrays([seed] * n, list(range(n))))
    over_full = np.array(inverse_cdf(mx.broadcast_to(mx.array(full), (n, vocab)), u))
    over_subset = np.array(inverse_cdf(mx.broadcast_to(mx.array(mass), (n, size)), u))
    assert np.array_equal(over_full, subset[over_subset])


# --- greedy and the repetition penalty ------------------------------------------------


def test_greedy_is_argmax_whatever_the_key() -> None:
    rng = np.random.default_rng(3)
    logits = mx.array(rng.normal(0, 3, size=(200, 97)).astype(np.float32))
    expected = np.argmax(np.array(logits), axis=-1)
    greedy = SamplingParams()
    for seed in (0, 1, 2**32 - 1):
        seeds, steps = key_arrays([seed] * 200, list(range(200)))
        got = np.array(sample(logits, greedy, seeds, steps))
        assert np.array_equal(got, expected)
    # filters do not change a greedy pick
    filtered = SamplingParams(top_k=3, top_p=0.5, min_p=0.2)
    seeds, steps = key_arrays([0] * 200, list(range(200)))
    assert np.array_equal(np.array(sample(logits, filtered, seeds, steps)), expected)


def test_a_low_temperature_draw_is_the_argmax() -> None:
    rng = np.random.default_rng(4)
    logits = rng.normal(0, 1, size=(2000, 50)).astype(np.float32)
    top2 = np.sort(logits, axis=-1)[:, -2:]
    logits = logits[top2[:, 1] - top2[:, 0] > 0.05][:500]  # no near-ties: e^-50 odds
    assert len(logits) == 500
    seeds, steps = key_arrays([5] * 500, list(range(500)))
    cold = np.array(
        sample(mx.array(logits), SamplingParams(temperature=1e-3), seeds, steps)
    )
    assert np.array_equal(cold, np.argmax(logits, axis=-1))


def test_repetition_penalty_scales_only_tokens_in_the_history_once() -> None:
    logits = mx.array([[2.0, -1.0, 0.5, -3.0, 4.0]])
    history = mx.array([[0, 1, 1, 1]], dtype=mx.int32)  # repeats are penalised once
    out = np.array(apply_repetition_penalty(logits, history, 2.0))[0]
    np.testing.assert_allclose(out, [1.0, -2.0, 0.5, -3.0, 4.0])
    # greedy with a penalty: argmax of the penalised scores
    strong = mx.array([[3.0, 2.9, -1.0]])
    hist = mx.array([[0]], dtype=mx.int32)
    seeds, steps = key_arrays([0], [0])
    params = SamplingParams(repetition_penalty=1.5)
    assert sample(strong, params, seeds, steps, hist).item() == 1
    assert sample(strong, SamplingParams(), seeds, steps).item() == 0


@settings(max_examples=60, deadline=None)
@given(
    history=st.lists(st.integers(0, 9), min_size=1, max_size=30),
    repetition=st.sampled_from([1.0, 1.4, 0.7]),
    presence=st.sampled_from([0.0, 0.8, -0.5]),
    frequency=st.sampled_from([0.0, 0.4, 1.5]),
    contexts=st.tuples(*[st.integers(1, 24)] * 3),
    seed=st.integers(0, 2**16),
)
def test_penalties_equal_mlx_lm_s_logits_processors(
    history: list[int],
    repetition: float,
    presence: float,
    frequency: float,
    contexts: tuple[int, int, int],
    seed: int,
) -> None:
    """The repetition, presence and frequency penalties, each over its own
    context, give the logits mlx-lm's processors give for the same token
    list; a history shorter than the contexts is padded with -1, as the
    window's history of a short prompt is."""
    from mlx_lm.sample_utils import make_logits_processors

    params = SamplingParams(
        repetition_penalty=repetition,
        repetition_context=contexts[0],
        presence_penalty=presence,
        presence_context=contexts[1],
        frequency_penalty=frequency,
        frequency_context=contexts[2],
    )
    values = np.random.default_rng(seed).normal(0, 2, size=(1, 12)).astype(np.float32)
    logits = mx.array(values)
    reference = mx.array(values)  # its own array: processors assign in place
    for processor in make_logits_processors(
        repetition_penalty=repetition if repetition != 1.0 else None,
        repetition_context_size=contexts[0],
        presence_penalty=presence or None,
        presence_context_size=contexts[1],
        frequency_penalty=frequency or None,
        frequency_context_size=contexts[2],
    ):
        reference = processor(mx.array(history), reference)
    if not params.needs_history:  # every penalty off: mlx-lm changes nothing either
        assert np.array_equal(np.array(reference), np.array(logits))
        return
    width = params.history_context
    padded = ([-1] * width + history)[-width:]
    got = apply_penalties(logits, mx.array([padded], dtype=mx.int32), params)
    np.testing.assert_allclose(np.array(got), np.array(reference), atol=1e-5)


@pytest.mark.parametrize("k", [1, 4, 30])
def test_top_logprobs_are_the_k_largest_log_softmax_values_in_order(k: int) -> None:
    rng = np.random.default_rng(8)
    logits = rng.normal(0, 2, size=(6, 30)).astype(np.float32)
    ids, values = top_logprobs(mx.array(logits), k)
    x = logits.astype(np.float64)
    ref = x - np.log(np.exp(x).sum(axis=-1, keepdims=True))
    want = np.argsort(-ref, axis=-1)[:, :k]
    np.testing.assert_array_equal(np.array(ids), want)
    np.testing.assert_allclose(
        np.array(values), np.take_along_axis(ref, want, axis=-1), atol=1e-5
    )


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_logit_bias_is_added_before_the_draw(temperature: float) -> None:
    """`logit_bias` draws from the logits with the values added, greedy or
    sampled; -100 bans a token, a large value forces one."""
    rng = np.random.default_rng(9)
    values = rng.normal(0, 1, size=(64, 12)).astype(np.float32)
    seeds, steps = key_arrays([3] * 64, list(range(64)))
    bias = ((2, 1.5), (5, -100.0), (7, -0.5))
    added = values.copy()
    for i, v in bias:
        added[:, i] += v
    biased = SamplingParams(temperature=temperature, logit_bias=bias, seed=3)
    plain = SamplingParams(temperature=temperature, seed=3)
    got = np.array(sample(mx.array(values), biased, seeds, steps))
    want = np.array(sample(mx.array(added), plain, seeds, steps))
    np.testing.assert_array_equal(got, want)
    assert 5 not in got
    forced = SamplingParams(temperature=temperature, logit_bias=((11, 100.0),))
    assert set(np.array(sample(mx.array(values), forced, seeds, steps))) == {11}


def test_logit_bias_entries_read_openai_s_object() -> None:
    from schemas.request import logit_bias_entries

    assert logit_bias_entries({"7": -100, "2": 1.5}).unwrap() == ((7, -100.0), (2, 1.5))
    for bad, named in [
        ([1, 2], "must be an object"),
        ({"a": 1}, "keys must be token ids"),
        ({"3": "x"}, "for token 3 must be a number"),
        ({"3": True}, "for token 3 must be a number"),
    ]:
        assert named in logit_bias_entries(bad).failure().message
    params = SamplingParams.create(logit_bias=((7, -1.0), (2, 1.0))).unwrap()
    assert params.logit_bias == ((2, 1.0), (7, -1.0))  # in id order: one record
    twice = SamplingParams.create(logit_bias=((2, 1.0), (2, 3.0)))
    assert "names a token id twice" in twice.failure().message


def test_token_logprobs_are_log_softmax() -> None:
    rng = np.random.default_rng(5)
    logits = rng.normal(0, 2, size=(8, 30)).astype(np.float32)
    tokens = rng.integers(0, 30, size=8)
    got = np.array(token_logprobs(mx.array(logits), mx.array(tokens.astype(np.int32))))
    x = logits.astype(np.float64)
    ref = x[np.arange(8), tokens] - np.log(np.exp(x).sum(axis=-1))
    np.testing.assert_allclose(got, ref, atol=1e-5)


# --- sample_window: each position as plain decoding at its own step ------------------


def test_window_position_i_is_sampled_with_step_key_step_plus_i() -> None:
    rng = np.random.default_rng(6)
    B, W, V = 3, 5, 40
    logits = mx.array(rng.normal(0, 1.5, size=(B, W, V)).astype(np.float32))
    params = [
        SamplingParams(temperature=1.0, seed=1),
        SamplingParams(temperature=0.7, top_k=10, seed=2),
        SamplingParams(),
    ]
    rows = [RowState.start((1, 2, 3), 50, p) for p in params]
    rows = [
        r.advanced(tuple(range(10 + 3 * b))) for b, r in enumerate(rows)
    ]  # steps 10, 13, 16
    window = np.array(sample_window(logits, None, rows))
    for b, row in enumerate(rows):
        for i in range(W):
            seeds, steps = key_arrays([params[b].seed], [row.step + i])
            alone = sample(logits[b, i][None, :], params[b], seeds, steps).item()
            assert window[b, i] == alone, (b, i)


def test_window_history_matches_plain_decoding_history() -> None:
    """With a repetition penalty, position i sees the row's tokens and the
    window's inputs up to i: the history plain decoding has at that step."""
    rng = np.random.default_rng(7)
    V, C = 20, 4
    params = SamplingParams(
        temperature=0.9, repetition_penalty=3.0, repetition_context=C, seed=9
    )
    row = RowState.start((3, 4, 5, 6, 7), 50, params)  # pending 7
    ids = [7, 8, 9, 3]  # window [pending, d1, d2, d3]
    logits = rng.normal(0, 1, size=(1, 4, V)).astype(np.float32)
    window = np.array(
        sample_window(mx.array(logits), mx.array([ids], dtype=mx.int32), [row])
    )
    tokens = list(row.tokens)
    for i in range(4):
        history = (tokens + ids[1 : i + 1])[-C:]
        seeds, steps = key_arrays([9], [row.step + i])
        alone = sample(
            mx.array(logits[:, i]),
            params,
            seeds,
            steps,
            mx.array([history], dtype=mx.int32),
        ).item()
        assert window[0, i] == alone, i


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7, top_k=20, top_p=0.8),
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=1.3, top_k=5),
        SamplingParams(temperature=0.8, min_p=0.05),
        SamplingParams(temperature=1.0),
    ],
    ids=["qwen", "top-p", "top-k", "min-p", "plain"],
)
def test_the_compiled_draw_gives_the_eager_draw_s_tokens(
    params: SamplingParams,
) -> None:
    """A GPU samples through `compiled_draw`; run here on the CPU, it must
    pick exactly the tokens of the eager draw (for every row and key)."""
    from specpipe.sampling import _draw, compiled_draw

    mx.random.seed(3)
    scores = mx.random.normal((64, 4096)) * 3.0
    seeds = mx.full((64,), 17, dtype=mx.uint32)
    steps = mx.arange(64).astype(mx.uint32)
    eager = _draw(scores, seeds, steps, params)
    compiled = compiled_draw(params)(scores, seeds, steps)
    assert compiled.tolist() == eager.tolist()
    assert len(set(eager.tolist())) > 8  # the keys do spread the draws


# --- blockwise top-k (the GPU's path for long rows) -----------------------------------


@pytest.mark.parametrize(
    ("vocab", "k", "block"), [(5000, 20, 512), (4096, 7, 1024), (300, 20, 16)]
)
def test_blockwise_top_k_keeps_what_one_partition_keeps(
    vocab: int, k: int, block: int
) -> None:
    rng = np.random.default_rng(vocab + k)
    scores = rng.normal(size=(3, vocab)).astype(np.float32)
    # ties across blocks at the k-th value, and a row of mostly equal scores
    scores[1, rng.choice(vocab, 2 * k, replace=False)] = np.sort(scores[1])[-k]
    scores[2] = np.round(scores[2])
    x = mx.array(scores)
    got = np.array(blockwise_top_k(x, k, block))
    want = np.array(mx.argpartition(-x, k - 1, axis=-1)[:, :k])
    for row in range(3):
        assert len(set(got[row].tolist())) == k  # k distinct ids
        assert np.array_equal(
            np.sort(scores[row, got[row]]), np.sort(scores[row, want[row]])
        )


def test_filters_over_blockwise_top_k_equal_one_partition(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rng = np.random.default_rng(3)
    logits = mx.array(rng.normal(size=(4, 40_000)).astype(np.float32) * 3.0)
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.8, seed=1)
    whole = filtered_probs(logits, params)
    monkeypatch.setattr(sampling, "on_gpu", lambda: True)  # take the GPU's path here
    blockwise = filtered_probs(logits, params)
    assert mx.array_equal(whole, blockwise).item()
