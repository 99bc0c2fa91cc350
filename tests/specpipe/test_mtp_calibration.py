"""Calibration with an MTP draft: one head step is timed (not counted free),
cached apart from other draft kinds, and adaptive drafting with it stays
lossless."""

from __future__ import annotations

import itertools
from pathlib import Path

import mlx.core as mx
import pytest
from test_mtp_companion import LIMITS, PROMPTS, write_hybrid

from schemas.request import SamplingParams
from specpipe.adaptive import CostModel
from specpipe.api import calibrate, load
from specpipe.calibrate import (
    DraftRound,
    DraftStep,
    calibration_path,
    load_cached,
    measure,
)
from specpipe.draft_vocab import DraftVocabulary
from specpipe.drafts.mtp import MtpDrafter
from tests.devices import needs_cpu_build


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hybrid(tmp_path_factory.mktemp("calhybrid") / "target")


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SPECPIPE_CACHE", str(tmp_path / "cache"))
    # the default place, under the cache root (tests/conftest.py moves it)
    monkeypatch.delenv("SPECPIPE_CALIBRATION_CACHE", raising=False)
    return tmp_path / "cache"


def test_mtp_calibration_times_the_head(hybrid: Path, cache: Path) -> None:
    plain = load(str(hybrid)).unwrap()
    mtp = load(str(hybrid), draft="mtp").unwrap()
    assert mtp.draft is not None and isinstance(mtp.draft.drafter, DraftStep)

    none_cost = calibrate(plain.target, None, None, max_width=3)
    mtp_cost = calibrate(mtp.target, mtp.draft, None, max_width=3)
    assert none_cost.draft_ms == 0.0
    assert mtp_cost.draft_ms > 0.0
    # an MTP round is timed whole: a fixed part per round besides its steps
    assert isinstance(mtp.draft.drafter, DraftRound)
    assert mtp_cost.draft_fixed_ms >= 0.0 and none_cost.draft_fixed_ms == 0.0
    # (each depth's draft share grows by one timed step; the verify widths'
    # own times are measurements, not monotone on a loaded machine)
    shares = [mtp_cost.round_ms(d) - mtp_cost.verify(d + 1) for d in range(1, 5)]
    assert shares[0] == pytest.approx(mtp_cost.draft_ms + mtp_cost.draft_fixed_ms)
    for before, after in itertools.pairwise(shares):
        assert after - before == pytest.approx(mtp_cost.draft_ms)
    assert mtp_cost.plain_ms > 0.0 and none_cost.plain_ms > 0.0  # pipelined plain step
    assert len(mtp_cost.verify_ms) == 3

    source = str(hybrid)
    none_path = calibration_path(source, None, "native")
    mtp_path = calibration_path(source, mtp.draft.source, "native", "mtp")
    assert none_path != mtp_path
    assert load_cached(mtp_path).unwrap() == mtp_cost
    assert load_cached(none_path).unwrap() == none_cost
    assert {p.name for p in (cache / "calibration").iterdir()} == {
        none_path.name,
        mtp_path.name,
    }
    # the same source under another kind (a two-model draft) is another entry
    assert calibration_path(source, mtp.draft.source, "native", "two-model") != mtp_path
    # ngram drafts on the host: free, and cached apart from no draft
    ngram = load(str(hybrid), draft="ngram").unwrap()
    assert calibrate(ngram.target, ngram.draft, None, max_width=3).draft_ms == 0.0
    assert calibration_path(source, None, "native", "ngram") != none_path
    # a second call reads the cache (a measurement would differ in time)
    assert calibrate(mtp.target, mtp.draft, None, max_width=3) == mtp_cost


def test_a_calibration_round_drafts_from_the_same_state_each_call(hybrid: Path) -> None:
    pipeline = load(str(hybrid), draft="mtp").unwrap()
    assert pipeline.draft is not None
    drafter = pipeline.draft.drafter
    assert isinstance(drafter, MtpDrafter)
    model = pipeline.target.model
    context = mx.random.randint(0, 320, (1, 24), key=mx.random.key(4)).astype(mx.int32)
    cache = model.make_cache(1)
    hidden = model(context, cache, [0]).hidden
    run = drafter.calibration_round(context, hidden)
    deep, shallow, again = run(3), run(1), run(3)
    assert deep.shape == (1, 3) and shallow.shape == (1, 1)
    # greedy, and the rounds' KV writes are scratch: the same drafts each time
    assert deep.tolist() == again.tolist()
    assert deep[:, :1].tolist() == shallow.tolist()


def test_mtp_step_with_a_draft_vocabulary(hybrid: Path) -> None:
    pipeline = load(str(hybrid), draft="mtp").unwrap()
    assert pipeline.draft is not None
    drafter = pipeline.draft.drafter
    assert isinstance(drafter, MtpDrafter)
    vocab = DraftVocabulary.create(range(0, 320, 4), 320).unwrap()
    subset = MtpDrafter(drafter.target, drafter.head, vocab=vocab)
    assert subset.calibration_key == "mtp/vocab=80"
    assert drafter.calibration_key == "mtp"
    cost = measure(pipeline.target.model, subset, max_width=2, repeats=2)
    assert cost.draft_ms > 0.0


@pytest.mark.parametrize(
    "sampling", [SamplingParams(), SamplingParams(temperature=0.8, seed=3)]
)
def test_adaptive_mtp_output_equals_plain(
    hybrid: Path, cache: Path, sampling: SamplingParams
) -> None:
    plain = load(str(hybrid)).unwrap().generate_batch(PROMPTS, sampling, LIMITS)
    pipeline = load(str(hybrid), draft="mtp", num_draft_tokens=3, adaptive=True)
    adaptive = pipeline.unwrap()
    assert adaptive.adaptive is not None and adaptive.adaptive.cost.draft_ms > 0.0
    results = adaptive.generate_batch(PROMPTS, sampling, LIMITS).unwrap()
    assert [r.tokens for r in results] == [r.tokens for r in plain.unwrap()]
    assert all(sum(n for _, n in r.stats.depths) > 0 for r in results)
    assert all(not r.stats.draft_errors for r in results)
    # a cost model that makes drafting pay: rows draft, output unchanged
    cheap = CostModel(verify_ms=(10.0, 10.1, 10.2, 10.3), draft_ms=0.1)
    eager = load(str(hybrid), draft="mtp", num_draft_tokens=3, adaptive=cheap)
    eager_results = eager.unwrap().generate_batch(PROMPTS, sampling, LIMITS).unwrap()
    assert [r.tokens for r in eager_results] == [r.tokens for r in plain.unwrap()]
    assert all(r.stats.drafted > 0 for r in eager_results)


@needs_cpu_build
def test_cpu_thread_split_is_part_of_the_calibration_key(cpu_default: None) -> None:
    """A calibration taken with products split over N CPU threads does not
    stand for another split (the costs differ by up to ~1.7x). The CPU's
    settings key CPU calibrations only (pinned: a GPU build defaults to the
    GPU), and only MLX's CPU build splits."""
    import models.parallel as parallel

    try:
        parallel.set_cpu_threads(1)
        one = calibration_path("some/model", None, "bfloat16")
        parallel.set_cpu_threads(2)
        two = calibration_path("some/model", None, "bfloat16")
    finally:
        parallel.set_cpu_threads(None)
    assert mx.default_device().type == mx.DeviceType.cpu
    assert one != two


def test_the_cpu_blas_is_part_of_the_calibration_key(
    monkeypatch: pytest.MonkeyPatch, cpu_default: None
) -> None:
    """Costs measured on MLX's reference BLAS do not stand for OpenBLAS (a
    verify window of 5 costs ~2.3 steps on one, ~1.1 on the other)."""
    import specpipe.calibrate as calibrate
    from models.blas import BlasRoute

    routes = {name: BlasRoute(name, None, "test") for name in ("reference", "openblas")}
    paths = []
    for route in routes.values():
        monkeypatch.setattr(calibrate, "route_blas", lambda route=route: route)
        paths.append(calibration_path("some/model", None, "float32"))
    assert paths[0] != paths[1]
