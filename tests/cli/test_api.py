"""The Python API: stop strings, EOS, streaming, logprobs, phase timing, hub ids."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from models.cache import on_gpu
from schemas.request import GenerationLimits, SamplingParams
from specpipe.api import Arrival, Conversation, load
from specpipe.output import TextSink


class Letters:
    """A detokenizer that maps token i to chr(ord('a') + i % 26)."""

    def add(self, token: int) -> str:
        return chr(ord("a") + token % 26)

    def finish(self) -> str:
        return ""


def test_text_sink_cuts_at_a_stop_string_and_holds_back_partial_matches() -> None:
    streamed: list[str] = []
    sink = TextSink(Letters(), ("cde",), streamed.append)
    assert [sink.push(t, None) for t in (0, 1, 2, 3)] == [True, True, True, True]
    assert "".join(streamed) == "ab"  # "cd" may still become the stop string
    assert sink.push(4, None) is False
    assert sink.text == "ab" and "".join(streamed) == "ab" and sink.stopped


def test_stop_string_through_the_pipeline(tiny_model: Path) -> None:
    pipeline = load(str(tiny_model), draft="ngram").unwrap()
    plain = pipeline.generate(
        "for i in range(10):", limits=GenerationLimits(max_tokens=24)
    ).unwrap()
    assert len(plain.text) > 6
    stop = plain.text[3:6]
    cut = pipeline.generate(
        "for i in range(10):", limits=GenerationLimits(max_tokens=24, stop=(stop,))
    ).unwrap()
    assert cut.finish_reason == "stop"
    assert cut.text == plain.text[: plain.text.index(stop)]
    assert cut.generated_tokens <= plain.generated_tokens


def test_a_raising_text_consumer_fails_only_its_row(tiny_model: Path) -> None:
    """`on_text` raising fails its own row and no other, whether it raises
    on a piece mid-run or on the text a stop string held back to the end
    (flushed after the last round)."""
    pipeline = load(str(tiny_model), draft="ngram").unwrap()
    limits = GenerationLimits(max_tokens=10)
    prompts = ["def fib", "for i in", "def fib"]
    alone = [pipeline.generate(p, limits=limits).unwrap() for p in prompts]
    # a stop string that never occurs but whose first letter ends the text,
    # so the last piece is held back until the run closes
    tail = alone[2].text[-1]
    held = GenerationLimits(max_tokens=10, stop=(tail + "\x00",))

    def consumer(raise_at: str) -> Callable[[int, str], None]:
        def on_text(row: int, text: str) -> None:
            if row == 2 and (raise_at == "first piece" or text.endswith(tail)):
                raise ConnectionResetError("the client went away")

        return on_text

    for raise_at in ("first piece", "close"):
        results = pipeline.generate_batch(
            prompts, limits=held, on_text=consumer(raise_at)
        ).unwrap()
        assert results[2].finish_reason == "failed", raise_at
        assert "ConnectionResetError" in (results[2].error or "")
        for row in (0, 1):
            assert results[row].tokens == alone[row].tokens, raise_at
            assert results[row].finish_reason == alone[row].finish_reason


def test_requests_arriving_mid_run_equal_their_runs_alone(tiny_model: Path) -> None:
    """`Pipeline.generate_arriving`: requests that join between rounds, each
    with its own sampling and limits, each told its result as its row ends,
    give what `generate` gives each alone; a refused arrival is told why at
    once and the run goes on."""
    pipeline = load(str(tiny_model), draft=str(tiny_model), adaptive=False).unwrap()
    prompts = [pipeline.encode(p).unwrap() for p in ("def fib", "for i in", "The")]
    asked = [
        (
            prompts[0],
            SamplingParams(temperature=0.8, seed=3),
            GenerationLimits(max_tokens=12),
        ),
        (prompts[1], SamplingParams(), GenerationLimits(max_tokens=5, stop=("i",))),
        (
            prompts[2],
            SamplingParams(temperature=1.2, top_p=0.9, seed=4),
            GenerationLimits(max_tokens=9),
        ),
    ]
    alone = [pipeline.generate(list(p), s, lim).unwrap() for p, s, lim in asked]
    told: dict[int, Any] = {}
    texts: dict[int, list[str]] = {0: [], 1: [], 2: []}
    calls = 0

    def arrival(i: int) -> Arrival:
        prompt, sampling, limits = asked[i]
        return Arrival(
            prompt, lambda r: told.__setitem__(i, r), sampling, limits, texts[i].append
        )

    def arrivals() -> list[Arrival]:
        nonlocal calls
        calls += 1
        if calls == 1:
            return [arrival(0)]
        if calls == 3:  # joins the running row
            assert 0 not in told
            bad = Arrival((), lambda r: told.__setitem__(-1, r))
            return [arrival(1), bad, arrival(2)]
        return []

    pipeline.generate_arriving(arrivals)
    assert "1 to 255" in str(told[-1].failure())
    for i, single in enumerate(alone):
        result = told[i].unwrap()
        assert result.tokens == single.tokens and result.text == single.text
        assert result.finish_reason == single.finish_reason
        assert "".join(texts[i]) == single.text


def test_eos_ends_a_row(tiny_model: Path) -> None:
    """An end token (`with_end_tokens`, the CLI's `--extra-eos-token`) ends
    a row where plain decoding first reaches it, unemitted, with a draft as
    without; text that is not one token is refused."""
    limits = GenerationLimits(max_tokens=12)
    for draft in ("none", str(tiny_model)):
        pipeline = load(str(tiny_model), draft=draft, adaptive=False).unwrap()
        plain = pipeline.generate("def fib", limits=limits).unwrap()
        # make the 5th generated token an end-of-sequence token for this run
        eos = plain.tokens[4]
        first = plain.tokens.index(eos)
        text = pipeline.target.tokenizer.backend.id_to_token(eos)
        ended = (
            pipeline.with_end_tokens([text])
            .unwrap()
            .generate("def fib", limits=limits)
            .unwrap()
        )
        assert ended.finish_reason == "stop"
        assert ended.tokens == plain.tokens[:first]
    refused = pipeline.with_end_tokens(["def fib(n): return"])
    assert "is not one token" in str(refused.failure())


def test_stream_yields_the_generated_text(tiny_model: Path) -> None:
    pipeline = load(str(tiny_model)).unwrap()
    limits = GenerationLimits(max_tokens=10)
    assert "".join(pipeline.stream("Hello world", limits=limits)) == (
        pipeline.generate("Hello world", limits=limits).unwrap().text
    )


def test_logprobs_are_the_same_with_and_without_drafts(tiny_model: Path) -> None:
    limits = GenerationLimits(max_tokens=10, logprobs=True)
    sampling = SamplingParams(temperature=0.9, seed=4)
    plain = (
        load(str(tiny_model)).unwrap().generate("def fib", sampling, limits).unwrap()
    )
    spec = (
        load(str(tiny_model), draft=str(tiny_model), num_draft_tokens=3)
        .unwrap()
        .generate("def fib", sampling, limits)
        .unwrap()
    )
    assert plain.logprobs is not None and spec.logprobs is not None
    assert len(plain.logprobs) == plain.generated_tokens
    assert spec.tokens == plain.tokens
    assert spec.logprobs == pytest.approx(plain.logprobs, abs=1e-4)
    assert all(lp <= 0 for lp in plain.logprobs)


def test_a_request_s_draft_cap(tiny_model: Path) -> None:
    """`GenerationLimits(num_draft_tokens=k)` caps that request's drafts a
    round (0: none) under the pipeline's width; the text is the same."""
    pipeline = load(
        str(tiny_model), draft=str(tiny_model), num_draft_tokens=3, adaptive=False
    )
    pipeline = pipeline.unwrap()
    sampling = SamplingParams(temperature=0.9, seed=4)
    runs = [
        pipeline.generate(
            "def fib", sampling, GenerationLimits(max_tokens=10, num_draft_tokens=k)
        ).unwrap()
        for k in (None, 0, 1)
    ]
    assert len({r.tokens for r in runs}) == 1
    free, none, one = (r.stats for r in runs)
    assert free.drafted > 0 and len(free.per_position) == 3
    assert none.drafted == 0
    assert 0 < one.drafted <= one.rounds and len(one.per_position) == 1


def test_phase_timing_reports_every_phase(tiny_model: Path) -> None:
    timed = load(
        str(tiny_model), draft=str(tiny_model), phase_timing=True, adaptive=False
    ).unwrap()
    result = timed.generate("def fib", limits=GenerationLimits(max_tokens=8)).unwrap()
    phases = dict(result.stats.phase_ms)
    assert set(phases) == {"draft", "verify", "sample", "commit"}
    assert all(ms >= 0 for ms in phases.values()) and phases["verify"] > 0
    assert set(result.to_json()["stats"]["phase_ms"]) == set(phases)


def test_hub_id_without_network_is_a_clear_error_not_a_hang(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    start = time.perf_counter()
    failure = load("nobody/not-a-model").failure()
    assert time.perf_counter() - start < 60
    assert "nobody/not-a-model" in failure.message
    assert "could not be downloaded" in failure.message


def test_a_two_model_draft_takes_the_pipeline_dtype(
    tiny_model: Path, tiny_draft: Path
) -> None:
    import mlx.core as mx

    pipeline = load(str(tiny_model), draft=str(tiny_draft), dtype="bfloat16").unwrap()
    assert pipeline.draft is not None
    draft_model = pipeline.draft.drafter.model  # type: ignore[attr-defined]
    assert draft_model.model.embed_tokens.weight.dtype == mx.bfloat16
    assert pipeline.target.model.model.embed_tokens.weight.dtype == mx.bfloat16  # type: ignore[attr-defined]


def _dflash_folder(folder: Path, target: Path, second: bool = False) -> Path:
    """A random DFlash drafter (v1, or DFlash2 when `second`) for the tiny
    target: two layers reading the target's layers 0 and 1, blocks of 4."""
    from mlx.utils import tree_flatten

    from models.dflash import DFlashDraft, DFlashSettings
    from schemas.converter import hf, structure
    from schemas.hf import DecoderArgs, normalize_hf_config

    target_config = json.loads((target / "config.json").read_text())
    config = {
        **target_config,
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "head_dim": 16,
        "dflash_config": {
            "target_layer_ids": [0, 1],
            "block_size": 4,
            "mask_token_id": target_config["vocab_size"] - 1,
        },
    }
    if second:
        config["architectures"] = ["DFlash2DraftModel"]
        config["dflash_config"] |= {
            "conv_kernel_size": 2,
            "conv_group_size": 16,
            "selector_rank": 8,
            "selector_top_k": 6,
        }
    args = structure(hf, normalize_hf_config(config), DecoderArgs, "dflash").unwrap()
    mx.random.seed(3)
    draft = DFlashDraft(args, DFlashSettings.of(config).unwrap())
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(
        str(folder / "model.safetensors"), dict(tree_flatten(draft.parameters()))
    )
    return folder


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed", "adaptive"])
def test_a_dflash_draft_through_the_pipeline_is_plain_decoding(
    tiny_model: Path, tmp_path: Path, adaptive: bool
) -> None:
    """`--draft FOLDER` detects a DFlash drafter, binds it at its block's
    width and leaves the output plain decoding's (greedy and sampled);
    adaptive drafting calibrates its rounds first."""
    folder = _dflash_folder(tmp_path / "dflash", tiny_model)
    pipeline = load(str(tiny_model), draft=str(folder), adaptive=adaptive).unwrap()
    assert pipeline.draft is not None
    assert pipeline.draft.kind == "dflash" and pipeline.draft.width == 3
    limits = GenerationLimits(max_tokens=16)
    for sampling in (SamplingParams(), SamplingParams(temperature=0.8, seed=2)):
        plain = load(str(tiny_model)).unwrap().generate("def fib", sampling, limits)
        spec = pipeline.generate("def fib", sampling, limits).unwrap()
        assert spec.tokens == plain.unwrap().tokens
        assert spec.stats.draft_errors == ()
        if not adaptive:  # (adaptive drafting may judge a random draft not worth it)
            assert spec.stats.drafted > 0


@pytest.mark.parametrize(
    ("second", "draft_bits", "bits"),
    [
        (True, None, (4,) if on_gpu() else ()),
        (True, 4, (4,)),
        (True, 8, (8,)),
        (True, 16, ()),
        (False, None, ()),
    ],
    ids=["dflash2", "dflash2-4", "dflash2-8", "dflash2-float", "dflash"],
)
def test_draft_bits_through_the_pipeline(
    tiny_model: Path,
    tmp_path: Path,
    second: bool,
    draft_bits: int | None,
    bits: tuple[int, ...],
) -> None:
    """`draft_bits` reaches the DFlash loader (a DFlash2 draft's default: 4
    bits on a GPU, float on the CPU; a DFlash one's: float); the output
    stays plain decoding's."""
    folder = _dflash_folder(tmp_path / "dflash", tiny_model, second)
    pipeline = load(
        str(tiny_model), draft=str(folder), draft_bits=draft_bits, adaptive=False
    ).unwrap()
    assert pipeline.draft is not None
    assert pipeline.draft.kind == ("dflash2" if second else "dflash")
    assert pipeline.draft.drafter.draft.quantized_bits == bits  # type: ignore[attr-defined]
    limits = GenerationLimits(max_tokens=12)
    plain = load(str(tiny_model)).unwrap()
    for sampling in (SamplingParams(), SamplingParams(temperature=0.8, seed=2)):
        spec = pipeline.generate("def fib", sampling, limits).unwrap()
        assert (
            spec.tokens == plain.generate("def fib", sampling, limits).unwrap().tokens
        )
        assert spec.stats.draft_errors == () and spec.stats.drafted > 0


@pytest.mark.parametrize(
    ("draft", "draft_bits", "needle"),
    [
        ("dflash2", 5, "draft bits must be 4 or 8"),
        ("none", 4, "without a draft"),
        ("ngram", 4, "a ngram draft takes none"),
    ],
)
def test_bad_draft_bits_are_clear_errors(
    tiny_model: Path, tmp_path: Path, draft: str, draft_bits: int, needle: str
) -> None:
    if draft == "dflash2":
        draft = str(_dflash_folder(tmp_path / "dflash", tiny_model, second=True))
    loaded = load(str(tiny_model), draft=draft, draft_bits=draft_bits)
    assert needle in str(loaded.failure())


def test_a_conversation_through_the_prompt_cache(tiny_model: Path) -> None:
    """Messages render by the chat template; each turn starts from the last
    turn's kept state and answers as a pipeline without the cache does."""
    cached = load(str(tiny_model), draft="ngram", prompt_cache=True).unwrap()
    plain = load(str(tiny_model), draft="ngram").unwrap()
    assert cached.prompt_cache is not None and plain.prompt_cache is None
    limits = GenerationLimits(max_tokens=10)
    messages: list[dict[str, str]] = []
    previous = 0  # the last turn's processed prompt tokens
    for number, question in enumerate(("def fib", "for i in range", "hello")):
        messages.append({"role": "user", "content": question})
        turn = cached.generate(messages, limits=limits).unwrap()
        again = plain.generate(messages, limits=limits).unwrap()
        assert turn.tokens == again.tokens and turn.text == again.text
        assert again.stats.cached_tokens == 0
        if number:  # the last turn's prompt, at least, was kept
            assert previous <= turn.stats.cached_tokens < turn.prompt_tokens
        assert turn.to_json()["stats"]["cached_tokens"] == turn.stats.cached_tokens
        previous = turn.prompt_tokens - 1
        messages.append({"role": "assistant", "content": turn.text})
    assert cached.prompt_cache.stats.hits == 2


def test_a_conversation_continues_its_own_token_ids(tiny_model: Path) -> None:
    """`Conversation` turns keep the last turn's prompt and reply ids, so the
    prompt cache serves all of them but the reply's pending last token, even
    where the reply's text does not encode back to its tokens; its replies
    are a cache-less pipeline's to the same prompt ids."""
    cached = load(str(tiny_model), draft="ngram", prompt_cache=True).unwrap()
    plain = load(str(tiny_model), draft="ngram").unwrap()
    tok = cached.target.tokenizer
    limits = GenerationLimits(max_tokens=10)
    conversation = Conversation(({"role": "system", "content": "be brief"},))
    reencoded = []  # whether each reply's text encodes back to its tokens
    for number, question in enumerate(("def fib", "for i in range", "hello")):
        before = conversation
        conversation, turn = conversation.say(cached, question, limits=limits).unwrap()
        assert conversation.messages[-2:] == (
            {"role": "user", "content": question},
            {"role": "assistant", "content": turn.text},
        )
        assert before.messages == conversation.messages[:-2]  # a new value
        prompt = conversation.ids[: turn.prompt_tokens]
        assert conversation.ids == prompt + turn.tokens
        again = plain.generate(list(prompt), limits=limits).unwrap()
        assert again.tokens == turn.tokens
        if number:  # everything the last turn processed was kept
            assert prompt[: len(before.ids)] == before.ids
            assert turn.stats.cached_tokens >= len(before.ids) - 1
        reencoded.append(
            tuple(tok.encode(turn.text, add_special_tokens=False)) == turn.tokens
        )
    # the random model's replies are not their text's encoding: the case
    # that re-rendering alone would lose
    assert not all(reencoded)
    # a rendering that does not begin with the conversation's text is encoded whole
    rewritten = conversation.continued(tok, "something else entirely")
    assert rewritten == tuple(
        tok.encode("something else entirely", add_special_tokens=False)
    )
    fresh = conversation.reset()
    assert fresh.opening == conversation.opening
    assert (fresh.messages, fresh.ids) == ((), ())


def test_bad_messages_and_budgets_are_clear_errors(tiny_model: Path) -> None:
    pipeline = load(str(tiny_model)).unwrap()
    failure = pipeline.generate([{"role": "user"}]).failure()
    assert "needs a 'role' and a 'content' string" in failure.message
    mixed = pipeline.generate([1, {"role": "user", "content": "x"}])  # type: ignore[list-item]
    assert "not a mix of them" in mixed.failure().message
    budget = load(str(tiny_model), prompt_cache=-1).failure()
    assert "positive byte budget" in str(budget)


@pytest.mark.parametrize(
    ("sampling", "limits", "expected"),
    [
        (SamplingParams(temperature=-1.0), None, "temperature must be >= 0"),
        (SamplingParams(top_p=0.0, top_k=-2), None, "top-p must be in (0, 1]"),
        (None, GenerationLimits(max_tokens=0), "max-tokens must be a positive"),
        (None, GenerationLimits(stop=("",)), "stop strings must not be empty"),
        (None, GenerationLimits(top_logprobs=21), "top-logprobs must be in"),
        (
            SamplingParams(logit_bias=((1, 1.0), (10**6, -100.0))),
            None,
            "logit bias names token id 1000000, outside the model's vocabulary",
        ),
        (
            SamplingParams(logit_bias=((3, math.nan),)),
            None,
            "logit bias values must be finite",
        ),
    ],
)
def test_records_built_directly_are_checked_where_they_are_used(
    tiny_model: Path,
    sampling: SamplingParams | None,
    limits: GenerationLimits | None,
    expected: str,
) -> None:
    """A `SamplingParams` or `GenerationLimits` made without `create` is
    refused by generate, stream and a conversation as `create` refuses it,
    before any forward."""
    pipeline = load(str(tiny_model)).unwrap()
    failure = pipeline.generate("Hi", sampling, limits).failure()
    assert expected in failure.message
    with pytest.raises(ValueError, match=expected.replace("(", r"\(")):
        next(iter(pipeline.stream("Hi", sampling, limits)))
    said = Conversation().say(pipeline, "Hi", sampling, limits)
    assert expected in said.failure().message
