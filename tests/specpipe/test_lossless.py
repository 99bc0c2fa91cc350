"""The central property: speculative output == plain output, token for token.

Every drafter (prompt lookup, a second random model, a noisy copy of the
target, the target itself, a hostile drafter proposing random ids, an oracle
that proposes the true continuation with random corruption), at B=1 and B=4
with rows of different prompt lengths, greedy and seeded sampling (top-k,
top-p, min-p, a repetition penalty), the device-first and host-first round,
and depths 1, 3 and 7.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from spec_support import (
    PROMPTS,
    VOCAB,
    CollectSink,
    HostileDrafter,
    OracleDrafter,
    PlainReference,
    perturbed,
    run,
)

from models.base import CausalLM
from schemas.request import DraftPolicy, SamplingParams
from specpipe.draft import Drafter
from specpipe.draft_vocab import DraftVocabulary
from specpipe.drafts.ngram import NgramDrafter
from specpipe.drafts.two_model import TwoModelDrafter
from specpipe.loop import RoundOptions, RowRequest, generate_rows
from specpipe.sampling import key_arrays, sample

MAX_TOKENS = 16

SAMPLINGS: dict[str, SamplingParams] = {
    "greedy": SamplingParams(),
    "t0.7-topp-topk": SamplingParams(temperature=0.7, top_p=0.9, top_k=20, seed=3),
    "t1.0-topp-topk": SamplingParams(temperature=1.0, top_p=0.8, top_k=40, seed=11),
    "t1.0-minp": SamplingParams(temperature=1.0, min_p=0.05, seed=7),
    "t0.8-penalty": SamplingParams(temperature=0.8, repetition_penalty=1.3, seed=5),
    "greedy-penalty": SamplingParams(repetition_penalty=1.5, repetition_context=8),
    "t0.9-presence-frequency": SamplingParams(
        temperature=0.9,
        presence_penalty=0.8,
        frequency_penalty=0.6,
        frequency_context=12,
        seed=13,
    ),
    "greedy-bias": SamplingParams(logit_bias=((1, 2.0), (5, -100.0), (40, 3.0))),
}

DRAFTERS = (
    "ngram",
    "two-model",
    "two-model-unstaged",
    "two-model-near",
    "self",
    "hostile",
    "hostile-count",
    "oracle",
)
DEPTHS = (1, 3, 7)

_near_cache: dict[int, CausalLM] = {}


def make_drafter(
    name: str,
    target: CausalLM,
    draft_model: CausalLM,
    truth: Callable[[], dict[tuple[int, ...], list[int]]],
    seed: int = 0,
) -> Drafter:
    if name == "ngram":
        return NgramDrafter(1, 3)
    if name == "two-model":  # staged on the CPU (DraftPolicy.staged default)
        return TwoModelDrafter(draft_model)
    if name == "two-model-unstaged":
        return TwoModelDrafter(draft_model, DraftPolicy(staged=False))
    if name == "two-model-near":
        return TwoModelDrafter(_near(target))
    if name == "self":
        return TwoModelDrafter(target)
    if name == "hostile":
        return HostileDrafter(seed)
    if name == "hostile-count":
        return HostileDrafter(seed, random_count=True)
    if name == "oracle":
        return OracleDrafter(truth(), seed)
    raise AssertionError(name)


CASES = [
    pytest.param(d, s, DEPTHS[(i + j) % 3], (i + j) % 2 == 0, id=f"{d}-{s}")
    for i, d in enumerate(DRAFTERS)
    for j, s in enumerate(SAMPLINGS)
]


def test_the_case_matrix_covers_every_depth_and_round_mode_per_drafter() -> None:
    for d in DRAFTERS:
        seen = {(c.values[2], c.values[3]) for c in CASES if c.values[0] == d}
        assert {depth for depth, _ in seen} == set(DEPTHS)
        assert {device for _, device in seen} == {True, False}


@pytest.mark.parametrize(("drafter", "sampling", "depth", "device_round"), CASES)
def test_speculative_equals_plain(
    target: CausalLM,
    draft_model: CausalLM,
    plain: PlainReference,
    drafter: str,
    sampling: str,
    depth: int,
    device_round: bool,
) -> None:
    params = SAMPLINGS[sampling]
    expected = plain(PROMPTS, params, MAX_TOKENS)
    assert all(len(t) == MAX_TOKENS for t in expected)

    def truth() -> dict[tuple[int, ...], list[int]]:
        return dict(zip(PROMPTS, expected, strict=True))

    d = make_drafter(drafter, target, draft_model, truth)
    tokens, results = run(
        target, PROMPTS, params, d, depth, MAX_TOKENS, device_round=device_round
    )
    assert tokens == expected
    assert [r.finish for r in results] == ["length"] * 4
    assert sum(r.metrics.drafted for r in results) > 0  # drafts were verified
    for r in results:
        assert r.metrics.draft_errors == []
        assert r.metrics.generated == MAX_TOKENS
        assert r.metrics.accepted <= r.metrics.drafted
        # every round publishes accepted + 1 tokens, except where the budget cuts it
        assert r.metrics.generated <= r.metrics.accepted + r.metrics.rounds
    if drafter == "self" and not (params.needs_history or params.logit_bias):
        # the target drafting for itself (drafts are drawn without penalties
        # and bias): every draft accepted, bonus every round
        for r in results:
            assert r.metrics.accepted == r.metrics.drafted > 0
            assert r.metrics.rounds == -(-MAX_TOKENS // (depth + 1))

    # B=1: one row alone, the prompt chosen by the case
    b = (DRAFTERS.index(drafter) + list(SAMPLINGS).index(sampling)) % len(PROMPTS)
    one = make_drafter(drafter, target, draft_model, truth, seed=1)
    alone, (result,) = run(
        target, [PROMPTS[b]], params, one, depth, MAX_TOKENS, device_round=device_round
    )
    assert alone == [expected[b]]
    assert result.finish == "length"


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_speculative_equals_plain_with_eos_inside_the_output(
    target: CausalLM, draft_model: CausalLM, plain: PlainReference, drafter: str
) -> None:
    params = SAMPLINGS["t0.7-topp-topk"]
    free = plain(PROMPTS, params, MAX_TOKENS)
    # an end-of-sequence id the target samples mid-way in row 0
    eos = free[0][MAX_TOKENS // 2]
    expected = plain(PROMPTS, params, MAX_TOKENS, eos=[eos])
    assert expected[0] == free[0][: free[0].index(eos)]
    d = make_drafter(
        drafter, target, draft_model, lambda: dict(zip(PROMPTS, free, strict=True))
    )
    tokens, results = run(target, PROMPTS, params, d, 3, MAX_TOKENS, eos=[eos])
    assert tokens == expected
    for t, r in zip(tokens, results, strict=True):
        assert eos not in t
        assert r.finish == ("stop" if len(t) < MAX_TOKENS else "length")
    assert results[0].finish == "stop"


@pytest.mark.parametrize(
    "drafter", ["ngram", "two-model-near", "self", "hostile-count"]
)
@pytest.mark.parametrize("device_round", [True, False])
def test_rows_with_different_sampling_in_one_batch(
    target: CausalLM,
    draft_model: CausalLM,
    plain: PlainReference,
    drafter: str,
    device_round: bool,
) -> None:
    params = [
        SAMPLINGS["greedy"],
        SAMPLINGS["t0.7-topp-topk"],
        SamplingParams(temperature=1.0, top_k=10, frequency_penalty=1.1, seed=99),
        SAMPLINGS["t0.8-penalty"],
    ]
    expected = plain(PROMPTS, params, MAX_TOKENS)
    for b, p in enumerate(params):  # each row as plain decoding alone would produce it
        assert expected[b] == plain([PROMPTS[b]], p, MAX_TOKENS)[0]
    d = make_drafter(drafter, target, draft_model, lambda: {})
    tokens, _ = run(
        target, PROMPTS, params, d, 3, MAX_TOKENS, device_round=device_round
    )
    assert tokens == expected


@pytest.mark.parametrize("drafter", ["two-model-near", "self", "oracle"])
def test_logprobs_match_plain(
    target: CausalLM, draft_model: CausalLM, plain: PlainReference, drafter: str
) -> None:
    params = SAMPLINGS["t1.0-topp-topk"]
    expected = plain(PROMPTS, params, MAX_TOKENS)
    ref = _logprobs(target, params, None, 0)
    d = make_drafter(
        drafter, target, draft_model, lambda: dict(zip(PROMPTS, expected, strict=True))
    )
    spec = _logprobs(target, params, d, 3)
    for a, b in zip(spec, ref, strict=True):
        assert len(a) == len(b) == MAX_TOKENS
        assert all(x is not None and x <= 0.0 for x in a)
        assert a == pytest.approx(b, abs=1e-4)


@pytest.mark.parametrize("draft_ahead", [False, True])
def test_top_logprobs_match_plain_per_row(
    target: CausalLM,
    draft_model: CausalLM,
    plain: PlainReference,
    draft_ahead: bool,
) -> None:
    """Rows asking for different numbers of alternatives (none, 1, 3, 5) in
    one batch: each row's report equals plain decoding's, its first
    alternative is the most likely token, and the chosen token's
    log-probability is among them where it is the argmax (greedy)."""
    params = SAMPLINGS["greedy"]
    expected = plain(PROMPTS, params, MAX_TOKENS)
    ks = [0, 1, 3, 5]

    def report(drafter: Drafter | None, depth: int) -> list[CollectSink]:
        sinks = [CollectSink() for _ in PROMPTS]
        tokens, _ = run(
            target,
            PROMPTS,
            params,
            drafter,
            depth,
            MAX_TOKENS,
            sinks=sinks,
            top_logprobs=ks,
            draft_ahead=draft_ahead,
        )
        assert tokens == expected
        return sinks

    ref = report(None, 0)
    d = make_drafter(
        "self", target, draft_model, lambda: dict(zip(PROMPTS, expected, strict=True))
    )
    spec = report(d, 3)
    for k, a, b in zip(ks, spec, ref, strict=True):
        if k == 0:
            assert a.tops == b.tops == [()] * MAX_TOKENS
            assert a.logprobs == b.logprobs == [None] * MAX_TOKENS
            continue
        assert [len(t) for t in a.tops] == [k] * MAX_TOKENS
        for top_a, top_b, token, lp in zip(
            a.tops, b.tops, a.tokens, a.logprobs, strict=True
        ):
            assert [i for i, _ in top_a] == [i for i, _ in top_b]
            assert [v for _, v in top_a] == pytest.approx(
                [v for _, v in top_b], abs=1e-4
            )
            values = [v for _, v in top_a]
            assert values == sorted(values, reverse=True)
            assert top_a[0][0] == token  # greedy: the chosen token is the most likely
            assert top_a[0][1] == pytest.approx(lp, abs=1e-5)


@pytest.mark.parametrize("drafter", ["two-model-near", "self"])
def test_a_row_s_draft_cap_limits_only_its_own_drafts(
    target: CausalLM, draft_model: CausalLM, plain: PlainReference, drafter: str
) -> None:
    """`RowRequest.max_drafts` (a request's `num_draft_tokens`): in one
    batch drafting 4 a round, a row capped at 0 drafts nothing, one capped
    at 1 drafts at most one a round, an uncapped one drafts 4, and every
    row's output is plain decoding's."""
    params = SAMPLINGS["t0.7-topp-topk"]
    expected = plain(PROMPTS, params, MAX_TOKENS)
    d = make_drafter(
        drafter, target, draft_model, lambda: dict(zip(PROMPTS, expected, strict=True))
    )
    caps = [0, 1, None, 2]
    sinks = [CollectSink() for _ in PROMPTS]
    requests = [
        RowRequest(tuple(p), params, MAX_TOKENS, sink, max_drafts=cap)
        for p, sink, cap in zip(PROMPTS, sinks, caps, strict=True)
    ]
    results = generate_rows(target, requests, (), d, RoundOptions(depth=4))
    assert [list(s.tokens) for s in sinks] == expected
    zero, one, free, two = (r.metrics for r in results)
    assert zero.drafted == 0
    assert 0 < one.drafted <= one.rounds and len(one.drafted_at) == 1
    assert len(two.drafted_at) == 2
    assert len(free.drafted_at) == 4


def _logprobs(
    target: CausalLM, params: SamplingParams, drafter: Drafter | None, depth: int
) -> list[list[float | None]]:
    sinks = [CollectSink() for _ in PROMPTS]
    run(target, PROMPTS, params, drafter, depth, MAX_TOKENS, sinks=sinks, logprobs=True)
    return [s.logprobs for s in sinks]


@settings(
    max_examples=12,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    prompts=st.lists(
        st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=24).map(tuple),
        min_size=1,
        max_size=3,
    ),
    depth=st.integers(1, 7),
    seed=st.integers(0, 2**32 - 1),
    temperature=st.sampled_from([0.0, 0.7, 1.0]),
    device_round=st.booleans(),
    drafter=st.sampled_from(
        ["ngram", "two-model-near", "self", "hostile-count", "oracle"]
    ),
)
def test_speculative_equals_plain_on_random_prompts(
    target: CausalLM,
    draft_model: CausalLM,
    plain: PlainReference,
    prompts: list[tuple[int, ...]],
    depth: int,
    seed: int,
    temperature: float,
    device_round: bool,
    drafter: str,
) -> None:
    params = SamplingParams(temperature=temperature, top_p=0.95, seed=seed)
    budget = 12
    expected = plain(prompts, params, budget)
    truth = {p: e for p, e in zip(prompts, expected, strict=True)}
    d = make_drafter(drafter, target, draft_model, lambda: truth, seed=seed % 1000)
    tokens, results = run(
        target, prompts, params, d, depth, budget, device_round=device_round
    )
    assert tokens == expected
    assert all(r.finish == "length" for r in results)


# --- determinism and batching of plain decoding ------------------------------


@pytest.mark.parametrize(
    "sampling",
    [
        "greedy",
        "t1.0-topp-topk",
        "t0.8-penalty",
        "t1.0-minp",
        "t0.9-presence-frequency",
        "greedy-bias",
    ],
)
def test_plain_decoding_equals_a_naive_full_recompute(
    target: CausalLM, plain: PlainReference, sampling: str
) -> None:
    """The reference itself: each token from a fresh forward over the whole
    sequence (no cache reuse, no batching), sampled with step key (seed, i)."""
    params = SAMPLINGS[sampling]
    budget = 10
    expected = plain(PROMPTS, params, budget)
    for prompt, want in zip(PROMPTS, expected, strict=True):
        tokens = list(prompt)
        for step in range(budget):
            logits = target(mx.array([tokens]), target.make_cache(1), [0]).logits[
                :, -1, :
            ]
            history = mx.array([tokens[-params.history_context :]], dtype=mx.int32)
            seeds, steps = key_arrays([params.seed], [step])
            tokens.append(sample(logits, params, seeds, steps, history).item())
        assert tokens[len(prompt) :] == want


def test_same_seed_gives_identical_tokens(
    target: CausalLM, draft_model: CausalLM
) -> None:
    params = SamplingParams(temperature=1.0, seed=1234)
    first, _ = run(target, PROMPTS, params, TwoModelDrafter(draft_model), 3)
    second, _ = run(target, PROMPTS, params, TwoModelDrafter(draft_model), 3)
    third, _ = run(target, PROMPTS, params)
    assert first == second == third


def test_different_seed_gives_different_tokens(target: CausalLM) -> None:
    a, _ = run(target, PROMPTS, SamplingParams(temperature=1.0, seed=1))
    b, _ = run(target, PROMPTS, SamplingParams(temperature=1.0, seed=2))
    differing = [x != y for x, y in zip(a, b, strict=True)]
    assert all(differing), differing


@pytest.mark.parametrize("sampling", ["greedy", "t1.0-topp-topk", "t0.8-penalty"])
def test_batched_plain_rows_equal_each_row_alone(
    target: CausalLM, plain: PlainReference, sampling: str
) -> None:
    params = SAMPLINGS[sampling]
    batched = plain(PROMPTS, params, MAX_TOKENS)
    alone = [plain([p], params, MAX_TOKENS)[0] for p in PROMPTS]
    assert batched == alone


@pytest.mark.parametrize("sampling", ["greedy", "t1.0-topp-topk"])
def test_host_first_plain_equals_pipelined_plain(
    target: CausalLM, plain: PlainReference, sampling: str
) -> None:
    params = SAMPLINGS[sampling]
    host_first, results = run(
        target, PROMPTS, params, max_tokens=MAX_TOKENS, device_round=False
    )
    assert host_first == plain(PROMPTS, params, MAX_TOKENS)
    assert all(r.metrics.rounds == MAX_TOKENS for r in results)


@pytest.mark.parametrize("budgets", [(3, MAX_TOKENS, 7, 1), (1, 1, 1, 1), (2, 1, 2, 1)])
@pytest.mark.parametrize("drafter", ["plain", "two-model-near", "self"])
def test_rows_with_different_budgets_retire_and_the_rest_continue(
    target: CausalLM,
    draft_model: CausalLM,
    plain: PlainReference,
    budgets: tuple[int, ...],
    drafter: str,
) -> None:
    """A row that finishes early leaves the batch (its cache rows are dropped);
    the remaining rows still produce the plain output."""
    params = SAMPLINGS["t0.7-topp-topk"]
    expected = plain(PROMPTS, params, MAX_TOKENS)
    d = None if drafter == "plain" else make_drafter(drafter, target, draft_model, dict)
    sinks = [CollectSink() for _ in PROMPTS]
    requests = [
        RowRequest(p, params, n, s)
        for p, n, s in zip(PROMPTS, budgets, sinks, strict=True)
    ]
    results = generate_rows(target, requests, [], d, RoundOptions(depth=3))
    assert [s.tokens for s in sinks] == [
        e[:n] for e, n in zip(expected, budgets, strict=True)
    ]
    assert [r.finish for r in results] == ["length"] * 4
    assert [r.metrics.generated for r in results] == list(budgets)


LONG_PROMPTS = (
    tuple(
        (7 * i + 3) % VOCAB for i in range(250)
    ),  # decoding crosses the 256-slot cache step
    tuple((i * i) % VOCAB for i in range(520)),  # prefill takes two chunks of 512
    (4, 8, 15, 16, 23, 42),
)


@pytest.mark.parametrize(
    "drafter", ["ngram", "two-model-near", "self", "hostile-count"]
)
def test_long_prompts_growing_the_cache_are_lossless(
    target: CausalLM, draft_model: CausalLM, plain: PlainReference, drafter: str
) -> None:
    params = SAMPLINGS["t1.0-topp-topk"]
    expected = plain(LONG_PROMPTS, params, MAX_TOKENS)
    assert expected[0] == plain([LONG_PROMPTS[0]], params, MAX_TOKENS)[0]
    d = make_drafter(
        drafter,
        target,
        draft_model,
        lambda: dict(zip(LONG_PROMPTS, expected, strict=True)),
    )
    tokens, _ = run(target, LONG_PROMPTS, params, d, 7, MAX_TOKENS)
    assert tokens == expected
    # alone, the 250-token row's caches (target and draft) grow while decoding
    alone, _ = run(target, LONG_PROMPTS[:1], params, d, 7, MAX_TOKENS)
    assert alone == expected[:1]


# --- draft vocabularies (FR-Spec) and draft policies --------------------------


def _variant(name: str, target: CausalLM) -> Drafter:
    near = _near(target)
    if name == "self-fr-spec-all":
        return TwoModelDrafter(
            target, vocab=DraftVocabulary.create(range(VOCAB), VOCAB).unwrap()
        )
    if name == "self-fr-spec-even":
        even = DraftVocabulary.create(range(0, VOCAB, 2), VOCAB).unwrap()
        return TwoModelDrafter(target, vocab=even)
    if name == "near-fr-spec-even":
        even = DraftVocabulary.create(range(0, VOCAB, 2), VOCAB).unwrap()
        return TwoModelDrafter(near, vocab=even)
    if name == "near-greedy-policy":
        return TwoModelDrafter(near, DraftPolicy(greedy=True))
    if name == "near-hot-unfiltered-policy":
        return TwoModelDrafter(near, DraftPolicy(temperature=1.5, drop_filters=True))
    if name == "near-fr-spec-even-unstaged":
        even = DraftVocabulary.create(range(0, VOCAB, 2), VOCAB).unwrap()
        return TwoModelDrafter(near, DraftPolicy(staged=False), vocab=even)
    raise AssertionError(name)


def _near(target: CausalLM) -> CausalLM:
    if id(target) not in _near_cache:
        _near_cache[id(target)] = perturbed(target, seed=7, scale=0.3)
    return _near_cache[id(target)]


VARIANTS = (
    "self-fr-spec-all",
    "self-fr-spec-even",
    "near-fr-spec-even",
    "near-greedy-policy",
    "near-hot-unfiltered-policy",
    "near-fr-spec-even-unstaged",
)


@pytest.mark.parametrize("sampling", ["greedy", "t1.0-topp-topk", "t0.8-penalty"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_draft_vocabularies_and_policies_are_lossless(
    target: CausalLM, plain: PlainReference, variant: str, sampling: str
) -> None:
    params = SAMPLINGS[sampling]
    expected = plain(PROMPTS, params, MAX_TOKENS)
    depth = 3
    tokens, results = run(
        target,
        PROMPTS,
        params,
        _variant(variant, target),
        depth,
        MAX_TOKENS,
        device_round=VARIANTS.index(variant) % 2 == 0,
    )
    assert tokens == expected
    if variant == "self-fr-spec-all" and not params.needs_history:
        # a list of every id is the full vocabulary: the coupled draw agrees everywhere
        assert all(r.metrics.accepted == r.metrics.drafted > 0 for r in results)
    if variant == "self-fr-spec-even":
        # an odd token can never be drafted, so never accepted
        for r, t in zip(results, tokens, strict=True):
            assert r.metrics.accepted <= sum(1 for x in t if x % 2 == 0)
