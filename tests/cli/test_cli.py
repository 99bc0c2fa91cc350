"""The command line: output contract and clear errors for bad input."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from schemas.request import GenerationLimits, SamplingParams
from specpipe.api import load
from tests.cli.conftest import generate_json, run, write_tiny_model


def fails_with(capsys: pytest.CaptureFixture[str], needle: str, *argv: str) -> str:
    code, _out, err = run(capsys, *argv)
    assert code != 0, f"expected a failure for {argv}"
    assert "Traceback" not in err
    assert err.startswith("specpipe: error: "), err
    assert needle in err, err
    return err


def test_json_contract(tiny_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = generate_json(
        capsys, "def fib", "--model", str(tiny_model), "--max-tokens", "7"
    )
    assert set(result) >= {
        "text",
        "tokens",
        "prompt_tokens",
        "generated_tokens",
        "finish_reason",
        "stats",
    }
    assert result["generated_tokens"] == len(result["tokens"]) == 7
    assert result["finish_reason"] == "length"
    assert set(result["stats"]) >= {
        "tokens_per_second",
        "prompt_seconds",
        "decode_seconds",
        "rounds",
        "drafted",
        "accepted",
        "acceptance_length",
        "draft",
    }
    assert result["stats"]["draft"] == "none"


def test_streaming_text_equals_json_text(
    tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, streamed, _ = run(
        capsys, "generate", "for i in", "--model", str(tiny_model), "--max-tokens", "9"
    )
    result = generate_json(
        capsys, "for i in", "--model", str(tiny_model), "--max-tokens", "9"
    )
    assert streamed == result["text"] + "\n"


def fib_args(model: Path) -> list[str]:
    """`generate`'s arguments for a short code prompt, 12 tokens."""
    return ["def fib", "--model", str(model), "--max-tokens", "12"]


def test_draft_stats_and_same_tokens(
    tiny_model: Path, tiny_draft: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = fib_args(tiny_model)
    plain = generate_json(capsys, *base)
    for draft in (str(tiny_draft), str(tiny_model), "ngram"):
        result = generate_json(
            capsys, *base, "--draft", draft, "--num-draft-tokens", "3"
        )
        assert result["tokens"] == plain["tokens"]
        assert result["stats"]["draft"] == (
            "ngram" if draft == "ngram" else "two-model"
        )
        assert result["stats"]["rounds"] <= 12


def test_bf16_draft_for_a_float32_target(
    tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["def fib", "--model", str(tiny_model), "--max-tokens", "12"]
    plain = generate_json(capsys, *base, "--dtype", "float32")
    result = generate_json(
        capsys,
        *base,
        "--dtype",
        "float32",
        "--draft",
        str(tiny_model),
        "--draft-dtype",
        "bfloat16",
        "--num-draft-tokens",
        "3",
        "--no-adaptive",
    )
    assert result["tokens"] == plain["tokens"]
    assert result["stats"]["draft"] == "two-model" and result["stats"]["drafted"] > 0
    code, _, err = run(
        capsys, "generate", *base, "--draft", "ngram", "--draft-dtype", "int3"
    )
    assert code != 0 and "--draft-dtype" in err


def test_prompts_file_batch(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = ["def fib", "Hello world", "for i in range(10):"]
    file = tmp_path / "p.jsonl"
    file.write_text("\n".join(json.dumps({"prompt": p}) for p in prompts) + "\n")
    code, out, _ = run(
        capsys,
        "generate",
        "--model",
        str(tiny_model),
        "--prompts-file",
        str(file),
        "--max-tokens",
        "6",
        "--draft",
        str(tiny_model),
    )
    assert code == 0
    lines = [json.loads(line) for line in out.splitlines()]
    assert len(lines) == 3
    for prompt, line in zip(prompts, lines, strict=True):
        single = generate_json(
            capsys, prompt, "--model", str(tiny_model), "--max-tokens", "6"
        )
        assert line["tokens"] == single["tokens"]


@pytest.mark.parametrize(
    ("flag", "value", "needle"),
    [
        ("--temperature", "-0.5", "temperature must be >= 0"),
        ("--top-p", "0", "top-p must be in (0, 1]"),
        ("--top-p", "1.5", "top-p must be in (0, 1]"),
        ("--top-k", "-1", "top-k must be >= 0"),
        ("--min-p", "1.0", "min-p must be in [0, 1)"),
        ("--max-tokens", "0", "max-tokens must be a positive number"),
        ("--num-draft-tokens", "0", "num-draft-tokens must be in [1, 128]"),
        ("--num-draft-tokens", "100000", "num-draft-tokens must be in [1, 128]"),
        ("--draft-temperature", "-1", "draft temperature must be > 0"),
        ("--draft-temperature", "nan", "draft temperature must be > 0"),
    ],
)
def test_invalid_values(
    tiny_model: Path,
    capsys: pytest.CaptureFixture[str],
    flag: str,
    value: str,
    needle: str,
) -> None:
    fails_with(
        capsys,
        needle,
        "generate",
        "x",
        "--model",
        str(tiny_model),
        "--draft",
        "ngram",
        flag,
        value,
    )


def test_draft_bits(
    tiny_model: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`--draft-bits` reaches the loader (a DFlash2 draft at 8 bits drafts
    plain decoding's tokens); other values, or a draft without bits, are
    clear errors."""
    import specpipe.cli as cli
    from tests.cli.test_api import _dflash_folder

    folder = _dflash_folder(tmp_path / "dflash2", tiny_model, second=True)
    asked: list[int | None] = []
    real_load = cli.load

    def load(*args: Any, **kwargs: Any) -> Any:
        asked.append(kwargs.get("draft_bits"))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(cli, "load", load)
    base = [*fib_args(tiny_model), "--no-adaptive"]
    plain = generate_json(capsys, *base)
    result = generate_json(capsys, *base, "--draft", str(folder), "--draft-bits", "8")
    assert asked == [None, 8]
    assert result["tokens"] == plain["tokens"]
    assert result["stats"]["draft"] == "dflash2" and result["stats"]["drafted"] > 0
    argv = ["generate", *base, "--json"]
    code, _, err = run(capsys, *argv, "--draft", str(folder), "--draft-bits", "5")
    assert code == 2 and "--draft-bits: invalid choice: 5" in err
    fails_with(
        capsys,
        "a ngram draft takes none",
        *argv,
        "--draft",
        "ngram",
        "--draft-bits",
        "4",
    )


def test_missing_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fails_with(
        capsys,
        "no such folder or file",
        "generate",
        "x",
        "--model",
        str(tmp_path / "nope"),
    )


def test_missing_gguf(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fails_with(
        capsys,
        "no such GGUF file",
        "generate",
        "x",
        "--model",
        str(tmp_path / "m.gguf"),
    )


def test_corrupt_safetensors(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model, broken)
    data = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 2])
    fails_with(capsys, "model.safetensors", "generate", "x", "--model", str(broken))


def test_config_missing_keys(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = tmp_path / "nokeys"
    shutil.copytree(tiny_model, broken)
    config = json.loads((broken / "config.json").read_text())
    del config["hidden_size"]
    (broken / "config.json").write_text(json.dumps(config))
    fails_with(capsys, "hidden_size", "generate", "x", "--model", str(broken))


def test_unknown_model_type(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = tmp_path / "unknown"
    shutil.copytree(tiny_model, broken)
    config = json.loads((broken / "config.json").read_text())
    config["model_type"] = "mamba9"
    (broken / "config.json").write_text(json.dumps(config))
    fails_with(
        capsys,
        "unsupported model_type 'mamba9'",
        "generate",
        "x",
        "--model",
        str(broken),
    )


def test_prompt_past_context(
    tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fails_with(
        capsys,
        "context is 256",
        "generate",
        "hello world " * 300,
        "--model",
        str(tiny_model),
    )


def test_max_tokens_past_the_context_stop_at_the_context(
    tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A prompt plus --max-tokens past the context: the row is cut where the
    context ends and finishes with "length" (README's --max-tokens note)."""
    result = generate_json(
        capsys, "hello world " * 38, "--model", str(tiny_model), "--max-tokens", "100"
    )
    assert 200 < result["prompt_tokens"] < 256  # (so 100 more would pass 256)
    assert result["prompt_tokens"] + result["generated_tokens"] == 256
    assert result["finish_reason"] == "length"


def test_draft_with_other_tokenizer(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = write_tiny_model(tmp_path / "other", tokenizer_vocab=280)
    fails_with(
        capsys,
        "tokenizer differs",
        "generate",
        "x",
        "--model",
        str(tiny_model),
        "--draft",
        str(other),
    )


def test_draft_vocab_too_large(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    wide = write_tiny_model(tmp_path / "wide", vocab=400)
    fails_with(
        capsys,
        "does not fit",
        "generate",
        "x",
        "--model",
        str(tiny_model),
        "--draft",
        str(wide),
    )


def test_draft_not_a_model(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    fails_with(
        capsys,
        "missing config.json",
        "generate",
        "x",
        "--model",
        str(tiny_model),
        "--draft",
        str(empty),
    )


def test_unknown_draft_kind(
    tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fails_with(
        capsys,
        "no such folder or file",
        "generate",
        "x",
        "--model",
        str(tiny_model),
        "--draft",
        "eagle7",
    )


def test_convert_roundtrip_and_no_half_written_output(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "converted"
    code, _, _ = run(
        capsys,
        "convert",
        str(tiny_model),
        str(out),
        "--quantize",
        "8",
        "--group-size",
        "32",
    )
    assert code == 0
    assert {p.name for p in out.iterdir()} >= {
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "model.safetensors",
    }
    assert json.loads((out / "config.json").read_text())["quantization"] == {
        "group_size": 32,
        "bits": 8,
    }
    result = generate_json(capsys, "def fib", "--model", str(out), "--max-tokens", "4")
    assert result["generated_tokens"] == 4
    missing = tmp_path / "never"
    fails_with(
        capsys, "no such folder", "convert", str(tmp_path / "nope"), str(missing)
    )
    assert not missing.exists()
    assert not any(p.name.startswith(".never") for p in tmp_path.iterdir())


def test_adaptive_is_the_default_and_no_adaptive_drafts_every_round(
    tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = fib_args(tiny_model)
    base += ["--draft", str(tiny_model), "--num-draft-tokens", "3"]
    default = generate_json(capsys, *base)
    fixed = generate_json(capsys, *base, "--no-adaptive")
    explicit = generate_json(capsys, *base, "--adaptive")
    stats = {
        name: result["stats"]
        for name, result in (
            ("default", default),
            ("fixed", fixed),
            ("explicit", explicit),
        )
    }
    # adaptive rows report the depths they chose; fixed-width rows do not
    assert stats["default"].get("depths") and stats["explicit"].get("depths")
    assert "depths" not in stats["fixed"]
    # fixed width: every round drafts 3 (the last rounds may be cut by the budget)
    assert stats["fixed"]["drafted"] >= 3 * (stats["fixed"]["rounds"] - 2)
    tokens = {result["tokens"].__repr__() for result in (default, fixed, explicit)}
    assert len(tokens) == 1  # the width never changes the output


def test_calibrate_measures_once_and_caches(
    tiny_model: Path,
    tiny_draft: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`calibrate` measures the pair once (not once at load and again), prints
    the costs it caches, and measures afresh when run again."""
    monkeypatch.setenv("SPECPIPE_CALIBRATION_CACHE", str(tmp_path))
    argv = ["calibrate", "--model", str(tiny_model), "--draft", str(tiny_draft)]
    for _ in range(2):
        code, out, err = run(capsys, *argv, "--max-width", "3")
        assert code == 0, err
        assert err.count("calibrating round costs") == 1
        cost = json.loads(out)
        assert len(cost["verify_ms"]) >= 3 and cost["draft_ms"] > 0
        assert all(ms > 0 for ms in cost["verify_ms"])
    cached = [json.loads(p.read_text()) for p in tmp_path.rglob("*.json")]
    assert [c["verify_ms"] for c in cached] == [cost["verify_ms"]]


def test_chat_keeps_earlier_turns_in_the_prompt_cache(
    tiny_model: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One JSON object per turn; /reset starts over (from the cache's states)."""
    turns = "def fib\n\nfor i in range\n/reset\ndef fib\n"
    monkeypatch.setattr("sys.stdin", io.StringIO(turns))
    code, out, err = run(
        capsys, "chat", "--model", str(tiny_model), "--json", "--max-tokens", "6"
    )
    assert code == 0, err
    replies = [json.loads(line) for line in out.splitlines()]
    assert len(replies) == 3
    first, second, again = replies
    assert first["stats"]["cached_tokens"] == 0
    # the second turn's prompt continues the first turn's prompt and reply
    # ids: all of them but the reply's pending last token come from the cache
    kept = first["prompt_tokens"] + first["generated_tokens"] - 1
    assert kept <= second["stats"]["cached_tokens"]
    assert second["stats"]["cached_tokens"] < second["prompt_tokens"]
    # after /reset the same first message: its prompt's state was kept
    assert again["tokens"] == first["tokens"]
    assert again["stats"]["cached_tokens"] == first["prompt_tokens"] - 1


def test_chat_rejects_a_bad_budget(
    tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fails_with(
        capsys,
        "--prompt-cache-mb must be positive",
        "chat",
        "--model",
        str(tiny_model),
        "--prompt-cache-mb",
        "0",
    )


def test_a_prompt_cache_file_serves_a_later_run(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The second process-level run starts from the first one's states."""
    path = tmp_path / "prompt.safetensors"
    runs = []
    for _ in range(2):
        runs.append(
            generate_json(
                capsys,
                "def fibonacci(n):",
                "--model",
                str(tiny_model),
                "--max-tokens",
                "6",
                "--prompt-cache-file",
                str(path),
            )
        )
        assert path.is_file()
    first, second = runs
    assert first["stats"]["cached_tokens"] == 0
    assert second["stats"]["cached_tokens"] == first["prompt_tokens"] - 1
    assert second["tokens"] == first["tokens"]
    fails_with(
        capsys,
        "made for another model",
        "generate",
        "x",
        "--model",
        str(write_tiny_model(tmp_path / "other", seed=5)),
        "--prompt-cache-file",
        str(path),
    )


def test_logprobs_need_json_and_an_empty_stdin_is_no_prompt(
    tiny_model: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`--logprobs` and `--top-logprobs` without `--json` (whose object
    carries them) are refused rather than ignored, as is a count past 20; an
    empty stdin is refused rather than generating from nothing."""
    model = ("--model", str(tiny_model), "--max-tokens", "3")
    fails_with(capsys, "--logprobs needs --json", "generate", "x", *model, "--logprobs")
    assert len(generate_json(capsys, "x", *model, "--logprobs")["logprobs"]) == 3
    top = ("--top-logprobs", "2")
    fails_with(capsys, "--top-logprobs needs --json", "generate", "x", *model, *top)
    out = generate_json(capsys, "x", *model, *top)
    assert len(out["logprobs"]) == len(out["top_logprobs"]) == 3
    for chosen, alternatives in zip(out["tokens"], out["top_logprobs"], strict=True):
        assert alternatives[0]["id"] == chosen  # greedy: the likeliest
        assert alternatives[0]["logprob"] >= alternatives[1]["logprob"]
    fails_with(
        capsys,
        "top-logprobs must be in [0, 20] (0 = off), got 21",
        "generate",
        "x",
        *model,
        "--json",
        "--top-logprobs",
        "21",
    )
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    fails_with(capsys, "stdin was empty", "generate", *model)


def test_the_prompt_as_an_option(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--prompt` / `-p` (as mlx_lm.generate takes it) is the positional
    PROMPT under another spelling; giving the prompt twice, or beside
    `--prompts-file`, is refused rather than one of them ignored."""
    model = ("--model", str(tiny_model), "--max-tokens", "5")
    positional = generate_json(capsys, "def fib", *model)
    assert positional["prompt_tokens"] > 0
    for flag in ("--prompt", "-p"):
        result = generate_json(capsys, flag, "def fib", *model)
        assert result["prompt_tokens"] == positional["prompt_tokens"]
        assert result["tokens"] == positional["tokens"]
        assert result["text"] == positional["text"]
    fails_with(
        capsys, "either PROMPT or --prompt", "generate", "x", "--prompt", "y", *model
    )
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "x"}\n')
    fails_with(
        capsys,
        "--prompts-file, not both",
        "generate",
        "--prompt",
        "y",
        "--prompts-file",
        str(prompts),
        *model,
    )


def test_a_system_prompt_goes_before_each_prompt(
    tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`generate --system-prompt TEXT` (mlx_lm.generate's spelling; `--system`
    as `chat` names it) runs each prompt as a chat after that system message:
    the same prompt and tokens as the library given the two messages (a base
    model's refusal:
    `test_chat_needs_a_chat_model_and_a_script_s_failed_turn_fails`)."""
    model = ("--model", str(tiny_model), "--max-tokens", "6")
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "def fib"},
    ]
    expected = (
        load(str(tiny_model))
        .unwrap()
        .generate(messages, limits=GenerationLimits(max_tokens=6))
        .unwrap()
    )
    chat_only = generate_json(capsys, "def fib", "--chat", *model)
    for flag in ("--system-prompt", "--system"):
        result = generate_json(capsys, "def fib", flag, "Be brief.", *model)
        assert result["prompt_tokens"] == expected.prompt_tokens
        assert result["prompt_tokens"] > chat_only["prompt_tokens"]
        assert result["tokens"] == list(expected.tokens)


def test_chat_template_values_reach_the_template(
    tiny_model: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`--chat-template-config JSON` (mlx_lm.generate's option; the library's
    `Pipeline.with_template_args`) hands its values to the chat template, as
    Qwen3's reads `enable_thinking`: the same prompt and tokens as the
    library, for generate (where it implies --chat) and each chat turn. A
    value that is not a JSON object, the renderer's own names, and a value
    the template cannot use are refused by name."""
    folder = tmp_path / "thinking"
    shutil.copytree(tiny_model, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] += (
        "{% if enable_thinking is defined and enable_thinking is false %}"
        "<think>\n\n</think>\n\n{% endif %}"
        "{% for t in tools or [] %}{{ t }}{% endfor %}"
    )
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    pipeline = load(str(folder)).unwrap()
    limits = GenerationLimits(max_tokens=5)
    plain = pipeline.generate("def fib", limits=limits, chat=True).unwrap()
    quiet = pipeline.with_template_args({"enable_thinking": False}).unwrap()
    expected = quiet.generate("def fib", limits=limits, chat=True).unwrap()
    assert expected.prompt_tokens > plain.prompt_tokens
    # the values add up; a later value for a name replaces the earlier one
    again = quiet.with_template_args({"enable_thinking": True}).unwrap()
    assert dict(again.template_args) == {"enable_thinking": True}
    assert (
        again.encode("def fib", chat=True).unwrap()
        == pipeline.encode("def fib", chat=True).unwrap()
    )

    model = ("--model", str(folder), "--max-tokens", "5")
    values = '{"enable_thinking": false}'
    result = generate_json(capsys, "def fib", "--chat-template-config", values, *model)
    assert result["prompt_tokens"] == expected.prompt_tokens
    assert result["tokens"] == list(expected.tokens)
    monkeypatch.setattr("sys.stdin", io.StringIO("def fib\n"))
    code, out, err = run(
        capsys, "chat", "--chat-template-config", values, "--json", *model
    )
    assert code == 0, err
    turn = json.loads(out)
    assert turn["prompt_tokens"] == expected.prompt_tokens
    assert turn["tokens"] == list(expected.tokens)

    for bad, needle in (
        ("{enable_thinking: false}", "not JSON"),
        ("[1, 2]", "give a JSON object of names and values"),
    ):
        code, _out, err = run(
            capsys, "generate", "x", "--chat-template-config", bad, *model
        )
        assert code == 2 and needle in err and "Traceback" not in err, err
    for name in ("messages", "add_generation_prompt"):
        refused = pipeline.with_template_args({name: 1})
        assert "the renderer's own" in str(refused.failure())
    fails_with(
        capsys,
        "cannot use the values given (tools)",
        "generate",
        "x",
        "--chat-template-config",
        '{"tools": 3}',
        *model,
    )


def test_penalties_and_a_logit_bias_from_the_command_line(
    tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--logit-bias JSON` (OpenAI's object) and the penalty options give
    the library's output for the same values, with or without drafts; a
    banned token never appears; a bad object is refused by argparse."""
    model = ("--model", str(tiny_model), "--max-tokens", "8")
    free = generate_json(capsys, "def fib", *model)
    banned = free["tokens"][0]
    options = (
        "--logit-bias",
        json.dumps({str(banned): -100, "3": 1.5}),
        "--presence-penalty",
        "0.6",
        "--frequency-penalty",
        "0.4",
        "--frequency-context-size",
        "5",
    )
    plain = generate_json(capsys, "def fib", *model, *options)
    drafted = generate_json(capsys, "def fib", *model, *options, "--draft", "ngram")
    sampling = SamplingParams(
        logit_bias=((banned, -100.0), (3, 1.5)),
        presence_penalty=0.6,
        frequency_penalty=0.4,
        frequency_context=5,
    )
    expected = (
        load(str(tiny_model))
        .unwrap()
        .generate("def fib", sampling, GenerationLimits(max_tokens=8))
    )
    assert plain["tokens"] == drafted["tokens"] == list(expected.unwrap().tokens)
    assert banned not in plain["tokens"]
    for bad, needle in (("{3: 1}", "not JSON"), ('{"x": 1}', "keys must be token ids")):
        code, _out, err = run(capsys, "generate", "x", "--logit-bias", bad, *model)
        assert code == 2 and needle in err and "Traceback" not in err, err


def test_a_streamed_run_ends_with_its_figures_on_stderr(
    tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Streamed text goes to stdout alone; one line on stderr gives the
    run's tokens, speed, prompt, the draft's acceptance and peak memory (as
    mlx_lm.generate prints them); `--json` carries them in its object and
    prints nothing more."""
    model = ("--model", str(tiny_model), "--max-tokens", "6")
    draft = ("--draft", str(tiny_model), "--no-adaptive")
    result = generate_json(capsys, "def fib", *model, *draft)
    assert result["stats"]["drafted"] > 0
    code, out, err = run(capsys, "generate", "def fib", *model, *draft)
    assert code == 0
    assert out == result["text"] + "\n"
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    summary = lines[0]
    assert summary.startswith(f"[{result['generated_tokens']} tokens, ")
    assert f"prompt {result['prompt_tokens']} tokens in " in summary
    stats = result["stats"]
    assert f"{stats['acceptance_length']:.2f} tokens a round" in summary
    assert f"{stats['accepted']} of {stats['drafted']} drafts accepted" in summary
    assert "; peak memory " in summary and summary.endswith(("MB]", "GB]"))
    code, _out, err = run(capsys, "generate", "def fib", *model)
    assert code == 0 and "tokens a round" not in err and "peak memory" in err
    code, _out, err = run(capsys, "generate", "def fib", *model, "--json")
    assert code == 0 and err == ""


def test_extra_eos_tokens_end_the_run(
    tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--extra-eos-token T...` (mlx_lm.generate's) ends the run where plain
    decoding first reaches T, without emitting it; text that is not one of
    the model's tokens is refused by name."""
    model = ("--model", str(tiny_model), "--max-tokens", "12")
    plain = generate_json(capsys, "def fib", *model)
    end = plain["tokens"][4]
    text = load(str(tiny_model)).unwrap().target.tokenizer.backend.id_to_token(end)
    ended = generate_json(capsys, "def fib", *model, "--extra-eos-token", text)
    assert ended["finish_reason"] == "stop"
    assert ended["tokens"] == plain["tokens"][: plain["tokens"].index(end)]
    fails_with(
        capsys,
        "end token 'def fib(n): return' is not one token",
        "generate",
        "x",
        *model,
        "--extra-eos-token",
        "def fib(n): return",
    )


def test_mlx_lm_spellings_are_the_same_options(
    tiny_model: Path, tiny_draft: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """mlx_lm.generate's `-m`, `--temp` and `--draft-model` spell
    `--max-tokens`, `--temperature` and `--draft`: the same run, token for
    token, sampled with one seed."""
    common = ("def fib", "--model", str(tiny_model), "--seed", "5", "--top-k", "8")
    own = generate_json(
        capsys,
        *common,
        "--max-tokens",
        "6",
        "--temperature",
        "0.8",
        "--draft",
        str(tiny_draft),
    )
    theirs = generate_json(
        capsys, *common, "-m", "6", "--temp", "0.8", "--draft-model", str(tiny_draft)
    )
    assert theirs["generated_tokens"] == 6
    assert theirs["tokens"] == own["tokens"]
    assert theirs["stats"]["draft"] == own["stats"]["draft"] == "two-model"


@pytest.mark.parametrize(
    ("key", "value", "needle"),
    [
        ("num_attention_heads", 0, "num_attention_heads must be positive, got 0"),
        ("hidden_size", -1, "hidden_size must be positive, got -1"),
        ("num_key_value_heads", 3, "num_key_value_heads (3) must divide"),
        ("rope_theta", "abc", "rope_theta must be a number, got 'abc'"),
        ("hidden_act", "gelu", "hidden_act 'gelu' is not supported"),
        # (read as 576 before: transformers keeps the string and fails later)
        ("hidden_size", "576", "hidden_size must be a whole number, got '576' (a str)"),
        ("vocab_size", 300.0, "vocab_size must be a whole number, got 300.0 (a float)"),
    ],
)
def test_config_values_no_model_has_are_named(
    tiny_model: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    key: str,
    value: object,
    needle: str,
) -> None:
    """Sizes no model has and values of the wrong kind are refused naming the
    config file and the key (a division by zero or a bare ValueError before)."""
    broken = tmp_path / "badvalue"
    shutil.copytree(tiny_model, broken)
    config = json.loads((broken / "config.json").read_text())
    config[key] = value
    (broken / "config.json").write_text(json.dumps(config))
    err = fails_with(capsys, needle, "generate", "x", "--model", str(broken))
    assert "config.json" in err


def test_convert_refuses_a_file_and_groups_mlx_does_not_take(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "a-file"
    target.write_text("x")
    for force in ((), ("--force",)):
        fails_with(
            capsys,
            "is a file, not a folder",
            "convert",
            str(tiny_model),
            str(target),
            *force,
        )
    assert target.read_text() == "x"
    out = tmp_path / "out"
    for group in ("7", "0", "256"):
        fails_with(
            capsys,
            f"--group-size must be one of 32, 64, 128 (MLX's affine groups), got {group}",
            "convert",
            str(tiny_model),
            str(out),
            "--quantize",
            "4",
            "--group-size",
            group,
        )
    assert not out.exists()


def test_draft_vocab_that_cannot_be_written_is_a_clear_error(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def fibonacci(n): return n\n" * 4)
    base = ("draft-vocab", "--model", str(tiny_model), "--corpus", str(corpus))
    missing = tmp_path / "no-such-folder" / "dv.json"
    fails_with(
        capsys,
        "cannot write the draft vocabulary",
        *base,
        "--size",
        "8",
        "-o",
        str(missing),
    )
    folder = tmp_path / "a-folder"
    folder.mkdir()
    fails_with(
        capsys, "give a writable file path", *base, "--size", "8", "-o", str(folder)
    )
    assert not [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")]


def test_chat_needs_a_chat_model_and_a_script_s_failed_turn_fails(
    tiny_model: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A base model (no chat template) is refused by `chat` at its start and
    by `generate --chat`, `--system-prompt` and `--chat-template-config`
    (naming the option); a turn
    that fails when stdin is a script ends the command with status 1."""
    base = tmp_path / "base"
    shutil.copytree(tiny_model, base)
    config = json.loads((base / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (base / "tokenizer_config.json").write_text(json.dumps(config))
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n"))
    fails_with(
        capsys, "has no chat template (a base model)", "chat", "--model", str(base)
    )
    fails_with(
        capsys,
        "no chat template (a base model)",
        "generate",
        "hello",
        "--chat",
        "--model",
        str(base),
    )
    for option, value in (
        ("--system-prompt", "Be brief."),
        ("--chat-template-config", '{"enable_thinking": false}'),
    ):
        fails_with(
            capsys,
            f"{option} needs a chat template",
            "generate",
            "hello",
            option,
            value,
            "--model",
            str(base),
        )
    monkeypatch.setattr("sys.stdin", io.StringIO("hello world " * 300 + "\n"))
    code, _out, err = run(
        capsys, "chat", "--model", str(tiny_model), "--max-tokens", "2"
    )
    assert code == 1 and "context is 256" in err and "Traceback" not in err


def test_an_empty_draft_and_a_cache_file_that_is_a_folder_are_named(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = ("--model", str(tiny_model), "--max-tokens", "2")
    fails_with(capsys, "the draft is empty", "generate", "x", *model, "--draft", "")
    fails_with(
        capsys,
        "is a folder; give a file path",
        "generate",
        "x",
        *model,
        "--prompt-cache-file",
        str(tmp_path),
    )


def test_a_prompt_cache_file_that_cannot_be_saved_is_named_before_the_run(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "no-such-folder" / "c.cache"
    fails_with(
        capsys,
        "does not exist",
        "generate",
        "x",
        "--model",
        str(tiny_model),
        "--prompt-cache-file",
        str(missing),
    )
    assert not missing.parent.exists()


def test_the_readme_s_usage_block_names_only_real_options() -> None:
    """Every option the README's command-line block shows is one its command
    takes (brace groups expanded), and every command it shows exists."""
    import argparse
    import re

    from specpipe.cli import build_parser

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = readme.split("## Command line", 1)[1].split("```text", 1)[1]
    block = block.split("```", 1)[0]
    parser = build_parser()
    commands = next(
        a for a in parser._actions if isinstance(a, argparse._SubParsersAction)
    ).choices
    taken = {
        name: {o for a in sub._actions for o in a.option_strings}
        for name, sub in commands.items()
    }
    shared = {o for a in parser._actions for o in a.option_strings}
    checked = 0
    for entry in re.split(r"\n(?=specpipe )", block.strip()):
        words = entry.split()
        command = words[1] if words[1] in commands else None
        assert command is not None or words[1].startswith("["), entry
        for option in re.findall(
            r"--(?:\[no-\])?(?:\{[a-z,]+\})?[a-z][a-z0-9-]*", entry
        ):
            forms = [option]
            if match := re.match(r"--\{([a-z,]+)\}(.*)", option):
                forms = [f"--{word}{match[2]}" for word in match[1].split(",")]
            forms = [f.replace("--[no-]", "--") for f in forms]
            for form in forms:
                known = taken[command] if command is not None else shared
                assert form in known or form in shared, (command, form)
                checked += 1
    assert checked > 40
