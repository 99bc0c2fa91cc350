"""FR-Spec draft vocabulary: validation, coupling, and lossless drafting over a subset."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import mlx.core as mx
import pytest

from schemas.request import SamplingParams
from specpipe.api import load
from specpipe.draft_vocab import DRAFT_VOCAB_FILE, DraftVocabulary, configured
from specpipe.sampling import key_arrays, sample
from tests.cli.conftest import write_tiny_model


@pytest.mark.parametrize(
    ("ids", "needle"),
    [
        ([], "empty"),
        ([1, 2, 400], "outside the vocabulary"),
        ([-1, 2], "outside the vocabulary"),
        ([3, 2, 5], "ascending order"),
        ([2, 2, 5], "duplicated ids [2]"),
    ],
)
def test_invalid_lists_are_refused(ids: list[int], needle: str) -> None:
    result = DraftVocabulary.create(ids, 320)
    assert needle in result.failure().message


def test_file_roundtrip_and_strict_shape(tmp_path: Path) -> None:
    vocab = DraftVocabulary.create([0, 7, 9], 10).unwrap()
    path = tmp_path / DRAFT_VOCAB_FILE
    vocab.write(path)
    assert DraftVocabulary.read(path, 10).unwrap() == vocab
    path.write_text(json.dumps({"ids": [1, 2], "extra": 1}))
    assert "expected exactly" in DraftVocabulary.read(path, 10).failure().message
    assert configured("off", 10, tmp_path).unwrap() is None
    path.write_text(json.dumps({"ids": [1, 2]}))
    assert configured(None, 10, tmp_path).unwrap() == DraftVocabulary((1, 2))
    assert configured(None, 10, None).unwrap() is None


def test_from_counts_ranks_and_keeps_eos() -> None:
    counts = Counter({5: 10, 3: 10, 8: 1, 9: 7})
    vocab = DraftVocabulary.from_counts(counts, 3, 20, always=[0]).unwrap()
    assert vocab.ids == (0, 3, 5)


@pytest.mark.parametrize("temperature", [0.0, 0.6, 1.0])
def test_subset_draw_equals_full_draw_with_zero_mass_outside(
    temperature: float,
) -> None:
    mx.random.seed(0)
    V, N, draws = 500, 64, 400
    ids = mx.sort(mx.random.permutation(V)[:N]).astype(mx.int32)
    logits = mx.random.normal((draws, V)) * 3
    inside = mx.zeros((V,), dtype=mx.bool_).at[ids].add(True)
    full = mx.where(inside[None, :], logits, -mx.inf)
    params = SamplingParams(temperature=temperature, top_p=0.9, seed=3)
    seeds, steps = key_arrays([3] * draws, range(draws))
    from_full = sample(full, params, seeds, steps)
    from_subset = mx.take(ids, sample(logits[:, ids], params, seeds, steps))
    assert mx.array_equal(from_full, from_subset).item()


def test_two_model_with_draft_vocabulary_is_lossless(tmp_path: Path) -> None:
    target = write_tiny_model(tmp_path / "target")
    draft = write_tiny_model(
        tmp_path / "draft"
    )  # same weights: acceptance shows coupling
    prompts = ["def fibonacci(n):", "Hello world! The quick"]
    for temperature in (0.0, 0.8):
        sampling = SamplingParams(temperature=temperature, seed=11)
        plain = load(str(target)).unwrap().generate_batch(prompts, sampling).unwrap()
        off = load(
            str(target),
            draft=str(draft),
            num_draft_tokens=3,
            draft_vocab="off",
            adaptive=False,
        )
        unlisted = off.unwrap().generate_batch(prompts, sampling).unwrap()
        assert [r.tokens for r in unlisted] == [r.tokens for r in plain]
        assert sum(r.stats.accepted for r in unlisted) > 0
        # a list covering every id drafts exactly what the full head drafts
        DraftVocabulary.create(range(320), 320).unwrap().write(draft / DRAFT_VOCAB_FILE)
        full = load(
            str(target), draft=str(draft), num_draft_tokens=3, adaptive=False
        ).unwrap()
        results = full.generate_batch(prompts, sampling).unwrap()
        assert [r.tokens for r in results] == [r.tokens for r in plain]
        assert [(r.stats.drafted, r.stats.accepted) for r in results] == [
            (r.stats.drafted, r.stats.accepted) for r in unlisted
        ]
        # a small list: fewer acceptances, same output
        DraftVocabulary.create(range(0, 320, 3), 320).unwrap().write(
            draft / DRAFT_VOCAB_FILE
        )
        small = load(
            str(target), draft=str(draft), num_draft_tokens=3, adaptive=False
        ).unwrap()
        assert [r.tokens for r in small.generate_batch(prompts, sampling).unwrap()] == [
            r.tokens for r in plain
        ]


def test_bad_list_beside_draft_is_a_clear_error(tmp_path: Path) -> None:
    target = write_tiny_model(tmp_path / "target")
    draft = write_tiny_model(tmp_path / "draft")
    (draft / DRAFT_VOCAB_FILE).write_text(json.dumps({"ids": [5, 1]}))
    failure = load(str(target), draft=str(draft)).failure()
    assert "draft vocabulary" in failure.message and "ascending" in failure.message


@pytest.mark.parametrize("draft", [None, "none", "ngram"])
def test_a_list_nothing_would_use_is_a_clear_error(
    tmp_path: Path, draft: str | None
) -> None:
    """A draft vocabulary given to a run without a draft, or to prompt lookup
    (which projects onto no vocabulary), is refused, not silently ignored;
    "off" is always accepted."""
    target = write_tiny_model(tmp_path / "target")
    listed = tmp_path / DRAFT_VOCAB_FILE
    DraftVocabulary.create(range(0, 320, 3), 320).unwrap().write(listed)
    failure = load(str(target), draft=draft, draft_vocab=str(listed)).failure()
    assert "draft vocabulary" in failure.message and "drop" in failure.message
    assert load(str(target), draft=draft, draft_vocab="off", adaptive=False).unwrap()


def test_draft_vocab_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from specpipe.cli import main

    target = write_tiny_model(tmp_path / "target")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def fibonacci(n):\n    return n\n" * 20)
    out = tmp_path / DRAFT_VOCAB_FILE
    main(
        [
            "draft-vocab",
            "--model",
            str(target),
            "--corpus",
            str(corpus),
            "--size",
            "12",
            "-o",
            str(out),
        ]
    )
    vocab = DraftVocabulary.read(out, 320).unwrap()
    assert vocab.size == 12
    assert "covering" in capsys.readouterr().err


def test_two_model_calibration_times_the_listed_head(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A two-model draft with an FR-Spec list is calibrated apart from the
    full-head draft, and its draft step projects onto the listed rows only."""
    import specpipe.calibrate as calibrate_module
    from specpipe.api import calibrate

    monkeypatch.setenv("SPECPIPE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("SPECPIPE_CALIBRATION_CACHE", raising=False)
    target = write_tiny_model(tmp_path / "target")
    draft = write_tiny_model(tmp_path / "draft", seed=1)
    full = load(
        str(target), draft=str(draft), num_draft_tokens=2, adaptive=False
    ).unwrap()
    DraftVocabulary.create(range(0, 320, 4), 320).unwrap().write(
        draft / DRAFT_VOCAB_FILE
    )
    listed = load(
        str(target), draft=str(draft), num_draft_tokens=2, adaptive=False
    ).unwrap()
    assert full.draft is not None and listed.draft is not None
    assert full.draft.drafter.calibration_key == "two-model"  # type: ignore[attr-defined]
    assert listed.draft.drafter.calibration_key == "two-model/vocab=80"  # type: ignore[attr-defined]
    head = listed.draft.drafter.calibration_head()  # type: ignore[attr-defined]
    assert head is not None and head.rows == 80
    assert full.draft.drafter.calibration_head() is None  # type: ignore[attr-defined]

    heads: list[int | None] = []
    real_measure = calibrate_module.measure

    def spying_measure(*args: object, **kwargs: object) -> object:
        given = kwargs.get("draft_head")
        heads.append(None if given is None else given.rows)  # type: ignore[attr-defined]
        return real_measure(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(calibrate_module, "measure", spying_measure)
    calibrate(full.target, full.draft, None, max_width=2)
    calibrate(listed.target, listed.draft, None, max_width=2)
    assert heads == [None, 80]  # two cache entries, the second on the listed rows
    assert len(list((tmp_path / "cache" / "calibration").iterdir())) == 2
