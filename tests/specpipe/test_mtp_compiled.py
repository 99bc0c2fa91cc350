"""The compiled MTP draft step (`HeadStep`, used on a GPU) drafts what the
eager step drafts: same tokens every round, for batched rows of different
lengths, sampled and greedy, with and without FR-Spec, with one and two head
layers; output stays equal to plain decoding. Run here on the CPU, where the
drafter compiles only when told to."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import mlx.core as mx
import pytest
from spec_support import run
from test_mtp import (
    CONFIG,
    PROMPTS,
    SAMPLINGS,
    VOCAB,
    copy_head,
    random_head,
    repeating_target,
    scaled,
)

from models import cpu_kernel
from models.build import build_model, quantize_layers
from models.cache import position_mask, scatter_window
from models.mtp import MtpHead
from schemas.hf_hybrid import hybrid_args
from schemas.request import DraftPolicy, SamplingParams
from specpipe.draft import Proposal
from specpipe.draft_vocab import DraftVocabulary
from specpipe.drafts.mtp import COMPILED_TAIL_MAX, MtpDrafter, MtpRows


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[list[list[int]]]]:
    """Every proposal's drafts, in order, as host lists."""
    seen: list[list[list[int]]] = []
    propose = MtpRows.propose

    def recording(self: MtpRows, rows: Any, depth: int) -> Proposal:
        proposal = propose(self, rows, depth)
        if proposal.device is not None:
            seen.append(proposal.device.tolist())
        return proposal

    monkeypatch.setattr(MtpRows, "propose", recording)
    yield seen


@pytest.fixture(scope="module")
def target() -> Any:
    mx.random.seed(0)
    model = build_model(hybrid_args(CONFIG, "test").unwrap()).unwrap()
    scaled(model, 0, 2.5)
    return model


def two_layer_head(seed: int) -> MtpHead:
    mx.random.seed(seed)
    head = MtpHead(hybrid_args({**CONFIG, "num_nextn_predict_layers": 2}, "t").unwrap())
    scaled(head, seed, 2.5)
    return head


def drafts_of(
    recorded: list[list[list[int]]],
    target: Any,
    head: MtpHead,
    prompts: Any,
    sampling: SamplingParams,
    depth: int,
    compiled: bool,
    vocab: DraftVocabulary | None = None,
) -> tuple[list[list[list[int]]], list[list[int]]]:
    recorded.clear()
    drafter = MtpDrafter(target, head, DraftPolicy(compiled=compiled), vocab=vocab)
    out, results = run(target, prompts, sampling, drafter, depth, max_tokens=14)
    assert all(r.metrics.draft_errors == [] for r in results)
    return list(recorded), out


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "t0.7-filters", "t1.0"])
@pytest.mark.parametrize("depth", [1, 3])
@pytest.mark.parametrize("vocab", [False, True], ids=["full", "fr-spec"])
def test_compiled_steps_draft_what_eager_steps_draft(
    recorded: list[list[list[int]]],
    target: Any,
    sampling: SamplingParams,
    depth: int,
    vocab: bool,
) -> None:
    listed = (
        DraftVocabulary.create(range(0, VOCAB, 2), VOCAB).unwrap() if vocab else None
    )
    plain, _ = run(target, PROMPTS, sampling, max_tokens=14)
    head = random_head(3)
    for prompts in (PROMPTS, PROMPTS[1:3]):  # first round eager (17 > 16), compiled
        eager, _ = drafts_of(
            recorded, target, head, prompts, sampling, depth, False, listed
        )
        compiled, out = drafts_of(
            recorded, target, head, prompts, sampling, depth, True, listed
        )
        assert compiled == eager
        assert len(compiled) > 3
        assert out == [plain[PROMPTS.index(p)] for p in prompts]


def test_compiled_steps_cycle_the_head_layers(
    recorded: list[list[list[int]]], target: Any
) -> None:
    head = two_layer_head(5)
    sampling = SAMPLINGS[1]
    eager, _ = drafts_of(recorded, target, head, PROMPTS, sampling, 4, False)
    compiled, _ = drafts_of(recorded, target, head, PROMPTS, sampling, 4, True)
    assert compiled == eager


def test_compiled_copy_head_keeps_every_draft(recorded: list[list[list[int]]]) -> None:
    repeating = repeating_target()
    prompts = [(3, 3, 3, 3), (7, 1, 7, 5, 5)]
    plain, _ = run(repeating, prompts, SamplingParams(), max_tokens=24)
    drafter = MtpDrafter(repeating, copy_head(repeating), DraftPolicy(compiled=True))
    spec, results = run(repeating, prompts, SamplingParams(), drafter, 4, max_tokens=24)
    assert spec == plain
    for r in results:
        assert r.metrics.accepted == r.metrics.drafted > 0


def test_rows_with_different_filters_draft_eagerly(
    recorded: list[list[list[int]]], target: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One compiled step serves one set of draw filters; a batch whose rows
    differ drafts through the eager step (and stays lossless)."""
    calls: list[int] = []
    compiled = MtpRows._propose_compiled

    def counting(self: MtpRows, *args: Any) -> Proposal:
        calls.append(1)
        return compiled(self, *args)

    monkeypatch.setattr(MtpRows, "_propose_compiled", counting)
    mixed = [SAMPLINGS[0], SAMPLINGS[1], SAMPLINGS[2]]
    prompts = PROMPTS[:3]
    plain, _ = run(target, prompts, mixed, max_tokens=10)
    drafter = MtpDrafter(target, random_head(3), DraftPolicy(compiled=True))
    spec, _ = run(target, prompts, mixed, drafter, 3, max_tokens=10)
    assert spec == plain
    assert calls == []
    plain, _ = run(target, prompts, SAMPLINGS[1], max_tokens=10)
    same, _ = run(target, prompts, SAMPLINGS[1], drafter, 3, max_tokens=10)
    assert same == plain
    assert calls


def test_a_tail_past_the_limit_pairs_eagerly(
    target: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt longer than COMPILED_TAIL_MAX is paired by the eager step in
    its first round; later rounds (short tails) compile."""
    tails: list[tuple[int, bool]] = []
    compiled = MtpRows._propose_compiled
    propose = MtpRows.propose

    def watching(self: MtpRows, rows: Any, depth: int) -> Proposal:
        tails.append((max(self.tail_lengths), False))
        return propose(self, rows, depth)

    def counting(self: MtpRows, *args: Any) -> Proposal:
        tails[-1] = (tails[-1][0], True)
        return compiled(self, *args)

    monkeypatch.setattr(MtpRows, "propose", watching)
    monkeypatch.setattr(MtpRows, "_propose_compiled", counting)
    prompt = tuple(range(1, COMPILED_TAIL_MAX + 3))
    drafter = MtpDrafter(target, random_head(3), DraftPolicy(compiled=True))
    run(target, [prompt], SAMPLINGS[0], drafter, 2, max_tokens=8)
    assert tails[0] == (len(prompt) - 1, False)  # the pending token is not paired yet
    assert tails[0][0] > COMPILED_TAIL_MAX
    assert all(used for _, used in tails[1:]) and len(tails) > 1


def test_scatter_window_writes_each_row_at_its_start() -> None:
    buffer = mx.zeros((3, 2, 8, 4))
    window = mx.arange(3 * 2 * 2 * 4, dtype=mx.float32).reshape(3, 2, 2, 4) + 1
    starts = mx.array([0, 3, 6], dtype=mx.int32)
    out = scatter_window(buffer, window, starts)
    for b, s in enumerate([0, 3, 6]):
        assert mx.array_equal(out[b, :, s : s + 2], window[b])
        untouched = [p for p in range(8) if not s <= p < s + 2]
        assert mx.all(out[b, :, untouched] == 0).item()


def test_position_mask_matches_each_row_s_causal_span() -> None:
    mask = position_mask(mx.array([0, 2], dtype=mx.int32), 2, 5)
    assert mask.shape == (2, 1, 2, 5)
    assert mask[0, 0].tolist() == [
        [True, False, False, False, False],
        [True, True, False, False, False],
    ]
    assert mask[1, 0].tolist() == [
        [True, True, True, False, False],
        [True, True, True, True, False],
    ]


@pytest.mark.parametrize("vocab", [False, True], ids=["full", "fr-spec"])
def test_the_compiled_calibration_step_drafts_the_eager_token(
    target: Any, vocab: bool
) -> None:
    """Calibration times the step rounds run: compiled where they compile,
    drafting the token the eager step drafts."""
    listed = (
        DraftVocabulary.create(range(1, VOCAB, 3), VOCAB).unwrap() if vocab else None
    )
    head = random_head(3)
    context = mx.array([[5, 9, 2, 31, 7, 44, 3]], dtype=mx.int32)
    cache = target.make_cache(1)
    cache.reserve(context.shape[1])
    hidden = target(context, cache, [0]).hidden
    tokens = []
    for compiled in (False, True):
        drafter = MtpDrafter(target, head, DraftPolicy(compiled=compiled), vocab=listed)
        step = drafter.calibration_step(context, hidden)
        tokens.append([step().item() for _ in range(3)])
    assert tokens[0] == tokens[1]
    assert len(set(tokens[0])) == 1  # each call times the same step
    if listed is not None:
        assert tokens[0][0] in listed.ids


def test_a_quantized_head_on_the_cpu_affine_kernel_drafts_eagerly(
    target: Any, cpu_default: None
) -> None:
    """The affine kernel evaluates its inputs too: a quantized head keeps the
    eager step on the CPU when compiling is asked for (a traced step raised
    inside the kernel and disabled the drafter), and drafts losslessly."""
    head = random_head(3)
    quantize_layers(head, 4, 32)
    assert type(head.fc).__name__ == "QuantizedLinear"
    drafter = MtpDrafter(target, head, DraftPolicy(compiled=True))
    assert drafter.compiles() is not cpu_kernel.available()
    plain, _ = run(target, PROMPTS, SAMPLINGS[1], max_tokens=10)
    spec, results = run(target, PROMPTS, SAMPLINGS[1], drafter, 3, max_tokens=10)
    assert spec == plain
    assert all(r.metrics.draft_errors == [] for r in results)
    assert sum(r.metrics.drafted for r in results) > 0


def test_a_head_on_the_bf16_cpu_kernel_drafts_eagerly(
    target: Any, cpu_default: None
) -> None:
    """The bf16 CPU kernel evaluates its inputs, which a trace cannot hold:
    on the CPU a bf16 head keeps the eager step even when compiling is asked
    for, and still drafts losslessly."""
    head = random_head(3)
    head.set_dtype(mx.bfloat16)
    drafter = MtpDrafter(target, head, DraftPolicy(compiled=True))
    assert drafter.compiles() is not cpu_kernel.available()
    assert MtpDrafter(target, random_head(3), DraftPolicy(compiled=True)).compiles()
    assert not MtpDrafter(target, random_head(3)).compiles()  # default: GPU only
    plain, _ = run(target, PROMPTS, SAMPLINGS[1], max_tokens=10)
    spec, results = run(target, PROMPTS, SAMPLINGS[1], drafter, 3, max_tokens=10)
    assert spec == plain
    assert all(r.metrics.draft_errors == [] for r in results)
