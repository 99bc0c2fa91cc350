"""MTP heads as the registry finds them: native `mtp.*` weights in a hybrid
checkpoint, the `mtp/` companion `convert` writes, `--draft auto`, and clear
refusals for heads that do not fit."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from test_mtp import CONFIG, scaled

from models.build import build_model
from models.mtp import DEFAULT_BLOCK_SIZE, MtpHead
from schemas.hf_hybrid import hybrid_args
from schemas.request import GenerationLimits, SamplingParams
from specpipe.api import Arrival, load
from specpipe.cli import main
from tests.cli.conftest import write_tiny_model

VOCAB = 320  # the tiny tokenizer's ids fit
LIMITS = GenerationLimits(max_tokens=12)
PROMPTS = ["def fibonacci(n):", "Hello world! The quick"]


def write_hybrid(
    folder: Path,
    with_mtp: bool = True,
    block_size: int | None = 3,
    **overrides: Any,
) -> Path:
    write_tiny_model(folder)  # tokenizer files (the weights are replaced)
    config = {**CONFIG, "vocab_size": VOCAB, **overrides}
    if block_size is not None:
        config["block_size"] = block_size
    (folder / "config.json").write_text(json.dumps(config))
    args = hybrid_args(config, "test").unwrap()
    mx.random.seed(0)
    model = build_model(args).unwrap()
    scaled(model, 0, 2.5)
    weights = dict(tree_flatten(model.parameters()))
    if with_mtp:
        mx.random.seed(1)
        head = MtpHead(args)
        scaled(head, 1, 2.5)
        weights.update({f"mtp.{k}": v for k, v in tree_flatten(head.parameters())})
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    return folder


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hybrid(tmp_path_factory.mktemp("hybrid") / "target")


def tokens(pipeline: Any, sampling: SamplingParams) -> list[tuple[int, ...]]:
    return [
        r.tokens for r in pipeline.generate_batch(PROMPTS, sampling, LIMITS).unwrap()
    ]


def test_a_head_without_a_block_size_drafts_as_its_converted_companion(
    tmp_path: Path,
) -> None:
    """A bundled head whose config names no block and the companion convert
    writes for it (which records the default block) draft the same width."""
    folder = write_hybrid(tmp_path / "target", block_size=None)
    native = load(str(folder), draft="auto").unwrap()
    assert native.draft is not None
    assert native.draft.width == DEFAULT_BLOCK_SIZE - 1 == 2
    out = tmp_path / "converted"
    main(["convert", str(folder), str(out)])
    companion = json.loads((out / "mtp" / "config.json").read_text())
    assert companion["block_size"] == DEFAULT_BLOCK_SIZE
    converted = load(str(out), draft="auto").unwrap()
    assert converted.draft is not None and converted.draft.width == native.draft.width


@pytest.mark.parametrize(
    "sampling", [SamplingParams(), SamplingParams(temperature=0.8, seed=3)]
)
def test_native_head_and_converted_companion(
    hybrid: Path, tmp_path: Path, sampling: SamplingParams
) -> None:
    plain = tokens(load(str(hybrid)).unwrap(), sampling)
    native = load(str(hybrid), draft="auto").unwrap()
    assert native.draft_kind == "mtp"
    assert native.draft is not None and native.draft.width == 2  # block_size 3
    assert tokens(native, sampling) == plain

    out = tmp_path / "converted"
    main(["convert", str(hybrid), str(out)])
    assert (out / "mtp" / "config.json").is_file()
    companion = json.loads((out / "mtp" / "config.json").read_text())
    assert companion["model_type"] == "qwen3_next_mtp"
    assert not any(
        k.startswith("mtp.") for k in mx.load(str(out / "model.safetensors"))
    )
    bundled = load(str(out), draft="auto", num_draft_tokens=3, adaptive=False).unwrap()
    assert bundled.draft_kind == "mtp" and bundled.draft is not None
    assert bundled.draft.width == 3
    results = bundled.generate_batch(PROMPTS, sampling, LIMITS).unwrap()
    assert [r.tokens for r in results] == plain
    assert all(r.stats.drafted > 0 and not r.stats.draft_errors for r in results)
    # the companion folder alone, passed as --draft
    by_path = load(str(out), draft=str(out / "mtp")).unwrap()
    assert by_path.draft_kind == "mtp"
    assert tokens(by_path, sampling) == plain


def test_head_that_does_not_fit_is_refused(hybrid: Path, tmp_path: Path) -> None:
    out = tmp_path / "converted"
    main(["convert", str(hybrid), str(out)])
    wide = tmp_path / "wide-mtp"
    shutil.copytree(out / "mtp", wide)
    config = json.loads((wide / "config.json").read_text())
    config["hidden_size"] = 128
    (wide / "config.json").write_text(json.dumps(config))
    message = load(str(out), draft=str(wide)).failure().message
    assert "does not fit" in message and "hidden_size is 128" in message
    config["hidden_size"] = CONFIG["hidden_size"]
    config["vocab_size"] = 999
    (wide / "config.json").write_text(json.dumps(config))
    assert "vocab_size is 999" in load(str(out), draft=str(wide)).failure().message


def test_mtp_head_on_a_non_hybrid_target(hybrid: Path, tmp_path: Path) -> None:
    out = tmp_path / "converted"
    main(["convert", str(hybrid), str(out)])
    dense = write_tiny_model(tmp_path / "dense")
    message = load(str(dense), draft=str(out / "mtp")).failure().message
    assert "drafts for the model it was trained with" in message and "qwen2" in message


def test_mtp_by_name_without_a_head(tmp_path: Path) -> None:
    plain = write_hybrid(tmp_path / "nohead", with_mtp=False)
    assert "carries no such head" in load(str(plain), draft="mtp").failure().message
    assert load(str(plain), draft="auto").unwrap().draft_kind == "ngram"


def test_drafts_ahead_through_the_api_and_the_command_line(
    hybrid: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`load(..., draft_ahead=True)` and `generate --draft-ahead` launch the
    MTP head's next rounds before the host read (compiled steps here, on the
    CPU), and the output is plain decoding's, its top log-probabilities too."""
    from models.cache import on_gpu
    from schemas.request import DraftPolicy
    from specpipe.drafts.mtp import MtpRows

    launched = {"n": 0}
    launch = MtpRows.launch_ahead

    def counting(self: MtpRows, *args: Any) -> Any:
        out = launch(self, *args)
        launched["n"] += out is not None
        return out

    monkeypatch.setattr(MtpRows, "launch_ahead", counting)
    sampling = SamplingParams(temperature=0.8, seed=3)
    plain = tokens(load(str(hybrid)).unwrap(), sampling)
    ahead = load(str(hybrid), draft="auto", adaptive=False, draft_ahead=True,
                 policy=DraftPolicy(compiled=True)).unwrap()  # fmt: skip
    assert ahead.draft_ahead
    # by default: on a GPU only
    default = load(str(hybrid), draft="auto", adaptive=False).unwrap()
    assert default.draft_ahead == on_gpu()
    assert tokens(ahead, sampling) == plain
    assert launched["n"] > 0
    launched["n"] = 0
    capsys.readouterr()
    main(["generate", PROMPTS[0], "--model", str(hybrid), "--draft", "auto", "--no-adaptive",
          "--compiled-draft", "on", "--draft-ahead", "on", "--max-tokens", "12", "--json",
          "--temperature", "0.8", "--seed", "3", "--top-logprobs", "3"])  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert tuple(out["tokens"]) == plain[0]
    assert launched["n"] > 0
    alone = (
        load(str(hybrid))
        .unwrap()
        .generate(PROMPTS[0], sampling, GenerationLimits(max_tokens=12, top_logprobs=3))
    )
    want = alone.unwrap()
    assert want.top_logprobs is not None and want.logprobs is not None
    assert out["logprobs"] == pytest.approx(list(want.logprobs), abs=1e-4)
    assert [[a["id"] for a in top] for top in out["top_logprobs"]] == [
        [token for token, _ in top] for top in want.top_logprobs
    ]


def test_scoring_a_text_on_a_hybrid_target(hybrid: Path) -> None:
    """`Pipeline.score` on a target with recurrent layers: chunked or whole,
    the scores are the same, and a completion's are the log-probabilities
    its generation reported (the recurrent state carried across chunks)."""
    from specpipe.score import score_tokens

    pipeline = load(str(hybrid)).unwrap()
    limits = GenerationLimits(max_tokens=8, logprobs=True)
    result = pipeline.generate(PROMPTS[0], limits=limits).unwrap()
    assert result.logprobs is not None
    ids = [*pipeline.encode(PROMPTS[0]).unwrap(), *result.tokens]
    whole = pipeline.score(ids, top_logprobs=3).unwrap()
    chunked = score_tokens(pipeline.target.model, ids, top=3, chunk=3)
    assert whole.tokens == chunked.tokens == tuple(ids)
    assert whole.logprobs[0] is None and chunked.logprobs[0] is None
    assert chunked.logprobs[1:] == pytest.approx(whole.logprobs[1:], abs=1e-4)
    assert [[t for t, _ in top] for top in chunked.top] == [
        [t for t, _ in top] for top in whole.top
    ]
    prompt = len(ids) - len(result.tokens)
    assert whole.logprobs[prompt:] == pytest.approx(list(result.logprobs), abs=1e-4)
    assert "top-logprobs must be in" in str(pipeline.score(ids, 21).failure())


def test_mtp_rows_arriving_mid_run_equal_their_runs_alone(hybrid: Path) -> None:
    """Continuous batching on a hybrid target drafting with its MTP head
    (`Pipeline.generate_arriving`, what `specpipe serve` runs on): rows that
    join between rounds, with their own sampling, and one that starts from
    the prompt cache, each give what `generate` gives it alone."""
    pipeline = load(str(hybrid), draft="mtp", adaptive=False, prompt_cache=True)
    pipeline = pipeline.unwrap()
    asked = [
        (PROMPTS[0], SamplingParams()),
        (PROMPTS[1], SamplingParams(temperature=0.9, seed=4)),
        (PROMPTS[0], SamplingParams(temperature=0.7, top_k=8, seed=2)),
    ]
    encoded = [pipeline.encode(p).unwrap() for p, _ in asked]
    alone = [
        load(str(hybrid), draft="mtp", adaptive=False)
        .unwrap()
        .generate(list(ids), sampling, LIMITS)
        .unwrap()
        for ids, (_, sampling) in zip(encoded, asked, strict=True)
    ]
    told: dict[int, Any] = {}
    calls = 0

    def arrival(i: int) -> Arrival:
        return Arrival(
            encoded[i], lambda r: told.__setitem__(i, r.unwrap()), asked[i][1], LIMITS
        )

    def arrivals() -> list[Arrival]:
        nonlocal calls
        calls += 1
        return {1: [arrival(0)], 3: [arrival(1)], 5: [arrival(2)]}.get(calls, [])

    pipeline.generate_arriving(arrivals)
    for i, single in enumerate(alone):
        assert told[i].tokens == single.tokens, i
        assert told[i].stats.drafted > 0
    assert told[2].stats.cached_tokens > 0  # the first row's prompt, kept
