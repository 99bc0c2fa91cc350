"""`specpipe serve`: the OpenAI-compatible endpoints answer with exactly the
library's output, stream it piece by piece, batch requests that wait
together, and name every bad request."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar, cast

import pytest

from schemas.request import GenerationLimits, SamplingParams
from specpipe.api import Pipeline, load
from specpipe.server import Defaults, Server, parse_request
from tests.cli.conftest import run

T = TypeVar("T")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pipeline(tiny_model: Path) -> Pipeline:
    """The tiny target drafting for itself (two-model, every round drafting),
    so each request speculates."""
    return load(str(tiny_model), draft=str(tiny_model), adaptive=False).unwrap()


def served(pipeline: Pipeline, client: Callable[[str], T], **options: Any) -> T:
    """`client(base_url)`'s value, run in a thread while the server computes
    in this one (as `specpipe serve` does)."""
    server = Server(pipeline, "tiny", port=0, **options)
    host, port = server.bind()
    stop = threading.Event()
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = client(f"http://{host}:{port}")
        except BaseException as exc:  # re-raised in the test's thread
            out["error"] = exc
        finally:
            stop.set()

    thread = threading.Thread(target=run)
    thread.start()
    server.serve(stop)
    thread.join()
    if "error" in out:
        raise out["error"]
    value: T = out["value"]
    return value


def post(url: str, body: Any) -> tuple[int, Any]:
    """The status and JSON body of a POST (an error status's too)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(
        url, data, {"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def get(url: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def events(url: str, body: dict[str, Any]) -> list[Any]:
    """A streamed request's server-sent events, "[DONE]" as the string."""
    data = json.dumps({**body, "stream": True}).encode()
    request = urllib.request.Request(
        url, data, {"Content-Type": "application/json"}, method="POST"
    )
    out: list[Any] = []
    with urllib.request.urlopen(request, timeout=120) as response:
        assert response.headers["Content-Type"] == "text/event-stream"
        for line in response.read().decode().split("\n\n"):
            if line:
                assert line.startswith("data: "), line
                payload = line[len("data: ") :]
                out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


SAMPLED = {"temperature": 0.9, "top_p": 0.95, "seed": 7}


def test_completions_equal_the_library_s_output(pipeline: Pipeline) -> None:
    """A completion (text, usage, finish reason) and a chat completion are
    the library's result for the same prompt, sampling and seed; streamed,
    their pieces join to the same text, after the chat's role and before the
    finish reason, the usage (when asked) and [DONE]."""
    sampling = SamplingParams(temperature=0.9, top_p=0.95, seed=7)
    limits = GenerationLimits(max_tokens=9)
    text = pipeline.generate("def fib", sampling, limits).unwrap()
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "def fib"},
    ]
    chat = pipeline.generate(messages, sampling, limits).unwrap()
    assert text.stats.drafted > 0 and chat.stats.drafted > 0

    def client(base: str) -> list[Any]:
        plain = {"prompt": "def fib", "max_tokens": 9, **SAMPLED}
        talk = {"messages": messages, "max_completion_tokens": 9, **SAMPLED}
        return [
            post(f"{base}/v1/completions", plain),
            post(f"{base}/v1/chat/completions", talk),
            events(f"{base}/v1/completions", plain),
            events(
                f"{base}/v1/chat/completions",
                {**talk, "stream_options": {"include_usage": True}},
            ),
        ]

    (code, done), (chat_code, chat_done), streamed, chat_streamed = served(
        pipeline, client
    )
    assert code == 200 and done["object"] == "text_completion"
    assert done["choices"][0]["text"] == text.text
    assert done["choices"][0]["finish_reason"] == text.finish_reason
    assert done["usage"] == {
        "prompt_tokens": text.prompt_tokens,
        "completion_tokens": text.generated_tokens,
        "total_tokens": text.prompt_tokens + text.generated_tokens,
    }
    assert done["model"] == "tiny" and done["id"].startswith("cmpl-")
    assert chat_code == 200 and chat_done["object"] == "chat.completion"
    assert chat_done["choices"][0]["message"] == {
        "role": "assistant",
        "content": chat.text,
    }
    assert chat_done["usage"]["prompt_tokens"] == chat.prompt_tokens

    assert streamed[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in streamed[:-1]) == text.text
    assert streamed[-2]["choices"][0]["finish_reason"] == text.finish_reason
    assert len(streamed) > 3  # in pieces, not one
    assert chat_streamed[0]["choices"][0]["delta"] == {
        "role": "assistant",
        "content": "",
    }
    assert chat_streamed[-1] == "[DONE]"
    usage = chat_streamed[-2]
    assert usage["choices"] == [] and usage["usage"] == chat_done["usage"]
    assert chat_streamed[-3]["choices"][0] == {
        "index": 0,
        "finish_reason": chat.finish_reason,
        "delta": {},
    }
    pieces = [e["choices"][0]["delta"].get("content", "") for e in chat_streamed[1:-3]]
    assert "".join(pieces) == chat.text
    assert {e["id"] for e in chat_streamed[:-1]} == {chat_streamed[0]["id"]}


def by_text(
    top: Sequence[tuple[int, float]], decode: Callable[[list[int]], str]
) -> dict[str, Any]:
    """A position's alternatives in a completion's form, text -> logprob:
    tokens of one text (pieces of a character) keep the likeliest's value."""
    out: dict[str, Any] = {}
    for token, lp in top:
        out.setdefault(decode([token]), pytest.approx(lp))
    return out


def test_logprobs_stop_strings_and_defaults(pipeline: Pipeline) -> None:
    """`logprobs` gives each token's log-probability (the library's) and,
    where asked, each position's likeliest tokens (a completion's
    `logprobs: k`, a chat's `top_logprobs: k`); `stop` ends the text before
    it, and what a request leaves out is the server's default (`specpipe
    serve --temperature ...`)."""
    sampling = SamplingParams(temperature=0.7, seed=3)
    limits = GenerationLimits(max_tokens=8, logprobs=True, top_logprobs=2)
    expected = pipeline.generate("def fib", sampling, limits).unwrap()
    assert expected.logprobs is not None and expected.top_logprobs is not None
    decode = pipeline.target.tokenizer.decode
    stop = expected.text[3:5]
    stopped = pipeline.generate(
        "def fib", sampling, GenerationLimits(max_tokens=8, stop=(stop,))
    ).unwrap()
    defaults = Defaults(sampling, GenerationLimits(max_tokens=8))

    def client(base: str) -> list[Any]:
        return [
            post(f"{base}/v1/completions", {"prompt": "def fib", "logprobs": 2}),
            post(
                f"{base}/v1/chat/completions",
                {
                    "messages": [{"role": "user", "content": "def fib"}],
                    "logprobs": True,
                    "top_logprobs": 3,
                },
            ),
            post(f"{base}/v1/completions", {"prompt": "def fib", "stop": stop}),
        ]

    (code, done), (_, chat), (_, cut) = served(pipeline, client, defaults=defaults)
    assert code == 200
    assert done["choices"][0]["text"] == expected.text
    logprobs = done["choices"][0]["logprobs"]
    assert logprobs["token_logprobs"] == pytest.approx(list(expected.logprobs))
    assert "".join(logprobs["tokens"]) == expected.text
    assert logprobs["text_offset"][0] == 0
    assert logprobs["top_logprobs"] == [
        by_text(top, decode) for top in expected.top_logprobs
    ]
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == chat["usage"]["completion_tokens"]
    assert all(isinstance(c["logprob"], float) and c["logprob"] <= 0 for c in content)
    for c in content:
        alternatives = c["top_logprobs"]
        assert len(alternatives) == 3
        values = [a["logprob"] for a in alternatives]
        assert values == sorted(values, reverse=True) and c["logprob"] <= values[0]
        assert all(bytes(a["bytes"]).decode() == a["token"] for a in alternatives)
    assert cut["choices"][0]["text"] == stopped.text
    assert stop not in cut["choices"][0]["text"]
    assert cut["choices"][0]["finish_reason"] == "stop"


def test_waiting_requests_join_the_live_rows(pipeline: Pipeline) -> None:
    """Continuous batching: queued requests join the live rows up to
    `max_batch`, the rest as rows end, each with its own sampling and limits,
    each the library's output alone; a row whose client went away fails
    alone."""
    asked = [
        ("def fib", {"temperature": 0.8, "seed": 5, "max_tokens": 7}),
        ("for i in", {"temperature": 0.0, "max_tokens": 12}),
        ("The quick brown", {"temperature": 1.1, "top_k": 5, "seed": 2}),
        ("def fib", {"temperature": 0.5, "seed": 9, "max_tokens": 4}),
        ("for i in", {"temperature": 0.7, "seed": 1, "stop": "i"}),
    ]
    defaults = Defaults(limits=GenerationLimits(max_tokens=9))
    parsed = [
        parse_request(pipeline, "completions", {"prompt": p, **v}, defaults).unwrap()
        for p, v in asked
    ]
    alone = [
        pipeline.generate(list(r.prompts[0]), r.sampling, r.limits).unwrap()
        for r in parsed
    ]
    lines: list[str] = []
    server = Server(pipeline, "tiny", port=0, max_batch=3, log=lines.append)
    server.bind()
    jobs = [server.submit(r)[0] for r in [*parsed, parsed[0]]]
    jobs[-1].gone = True  # its client left before its first piece
    stop = threading.Event()
    results = []

    def collect() -> None:
        try:
            gather()
        finally:
            stop.set()

    def gather() -> None:
        for job in jobs:
            while (event := job.events.get())[0] == "text":
                pass
            assert event[0] == "done", event
            results.append(event[1])

    thread = threading.Thread(target=collect)
    thread.start()
    server.serve(stop)
    thread.join()
    for result, single in zip(results, alone, strict=False):
        assert result.tokens == single.tokens and result.text == single.text
        assert result.finish_reason == single.finish_reason
    assert results[-1].finish_reason == "failed"
    joined = [int(line.split("joined ")[1].split(" ")[0]) for line in lines]
    assert len(joined) == len(asked)  # the departed client's row is not logged
    assert [job.batch for job in jobs[:3]] == [3, 3, 3]  # the first three at once
    assert max(job.batch for job in jobs) <= 3
    assert all(job.batch >= 1 for job in jobs[3:])  # the rest as rows ended


def test_bad_requests_are_named(pipeline: Pipeline, tiny_model: Path) -> None:
    """Each bad request is answered 4xx with an OpenAI error object naming
    the problem; the server goes on serving."""
    chat = [{"role": "user", "content": "hi"}]
    bad: list[tuple[str, Any, int, str]] = [
        ("/v1/completions", b"{not json", 400, "not JSON"),
        ("/v1/completions", [1, 2], 400, "must be a JSON object"),
        (
            "/v1/completions",
            {"prompt": "x", "temperature": "hot"},
            400,
            "'temperature' must be a number (float)",
        ),
        ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
        (
            "/v1/completions",
            {"prompt": "x", "max_tokens": 0},
            400,
            "max-tokens must be a positive",
        ),
        (
            "/v1/completions",
            {"prompt": "x", "n": 2},
            400,
            "'n' and 'best_of' must be 1",
        ),
        (
            "/v1/completions",
            {"prompt": "x", "suffix": "y"},
            400,
            "'suffix' and 'tools' are not supported",
        ),
        (
            "/v1/chat/completions",
            {"messages": chat, "echo": True},
            400,
            "'echo' is a completion's field",
        ),
        (
            "/v1/completions",
            {"prompt": "x", "echo": True, "stream": True},
            400,
            "answered without 'stream'",
        ),
        (
            "/v1/completions",
            {"prompt": "x", "max_tokens": 0},
            400,
            "max-tokens must be a positive number, got 0",
        ),
        (
            "/v1/completions",
            {"prompt": "x", "logprobs": 21},
            400,
            "'logprobs' must be a count of alternatives in [0, 20], got 21",
        ),
        (
            "/v1/chat/completions",
            {"messages": chat, "top_logprobs": 2},
            400,
            "'top_logprobs' needs 'logprobs': true",
        ),
        (
            "/v1/completions",
            {"prompt": "x", "max_tokens": 2.5},
            400,
            "'max_tokens' must be a number (int)",
        ),
        (
            "/v1/completions",
            {"prompt": "x", "presence_penalty": 0.5, "frequency_context_size": 0},
            400,
            "frequency context must be >= 1 token, got 0",
        ),
        ("/v1/completions", {"prompt": "x", "stop": [1]}, 400, "'stop' must be"),
        (
            "/v1/completions",
            {"prompt": "x", "logit_bias": {"99999999": 1}},
            400,
            "logit bias names token id 99999999, outside the model's vocabulary",
        ),
        (
            "/v1/completions",
            {"prompt": "x", "logit_bias": {"the": 1}},
            400,
            "logit bias keys must be token ids",
        ),
        ("/v1/completions", {"prompt": {"a": 1}}, 400, "'prompt' must be"),
        ("/v1/completions", {"prompt": "hello world " * 300}, 400, "context is 256"),
        (
            "/v1/completions",
            {"prompt": "x", "stream": True, "logprobs": 1},
            400,
            "answered without 'stream'",
        ),
        (
            "/v1/chat/completions",
            {"messages": []},
            400,
            "'messages' must be a non-empty list",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"content": "x"}]},
            400,
            "needs a 'role'",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            400,
            "only text content parts",
        ),
        (
            "/v1/chat/completions",
            {"messages": chat, "chat_template_kwargs": {"messages": 1}},
            400,
            "the renderer's own",
        ),
        ("/v1/embeddings", {"input": "x"}, 404, "no such endpoint"),
    ]

    def client(base: str) -> list[Any]:
        answers = [post(f"{base}{path}", body) for path, body, _, _ in bad]
        models = get(f"{base}/v1/models")
        health = get(f"{base}/health")
        preflight = urllib.request.Request(
            f"{base}/v1/chat/completions", method="OPTIONS"
        )
        with urllib.request.urlopen(preflight, timeout=30) as response:
            allowed = (response.status, dict(response.headers))
        missing = get(f"{base}/v2/nothing")
        # as OpenAI's clients send it: nulls and zeros for what they leave
        # out, fields the server has no use for, content as text parts
        parts = [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]
        client_style = {
            "messages": [{"role": "user", "content": parts}],
            "max_tokens": 2,
            "n": None,
            "presence_penalty": 0,
            "frequency_penalty": 0.0,
            "logprobs": False,
            "top_logprobs": None,
            "stream": False,
            "user": "someone",
        }
        ok = post(f"{base}/v1/chat/completions", client_style)
        return [answers, models, health, missing, ok, allowed]

    answers, models, health, missing, ok, allowed = served(pipeline, client)
    assert allowed[0] == 204
    assert allowed[1]["Access-Control-Allow-Origin"] == "*"
    assert "POST" in allowed[1]["Access-Control-Allow-Methods"]
    for (_path, body, status, needle), (code, answer) in zip(bad, answers, strict=True):
        assert code == status, (body, answer)
        assert needle in answer["error"]["message"], (needle, answer)
    assert models == (200, {"object": "list", "data": [models[1]["data"][0]]})
    assert models[1]["data"][0]["id"] == "tiny"
    assert health == (200, {"status": "ok"})
    assert missing[0] == 404
    assert ok[0] == 200 and ok[1]["usage"]["completion_tokens"] == 2
    hi = pipeline.encode([{"role": "user", "content": "hi"}]).unwrap()
    assert ok[1]["usage"]["prompt_tokens"] == len(hi)


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM])
def test_the_serve_command_answers_until_stopped(
    tiny_model: Path, tmp_path: Path, stop: signal.Signals
) -> None:
    """`specpipe serve --port 0` says where it listens, answers there with
    its options as defaults, and on Ctrl-C (SIGINT) or SIGTERM stops cleanly,
    writing its prompt cache to `--prompt-cache-file`."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cache = tmp_path / "served.cache"
    process = subprocess.Popen(
        [
            *(sys.executable, "-m", "specpipe", "serve", "--model", str(tiny_model)),
            *("--port", "0", "--max-tokens", "3", "--draft", "ngram", "--no-adaptive"),
            *("--prompt-cache-file", str(cache)),
        ],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    try:
        assert process.stderr is not None
        lines: Iterator[str] = iter(process.stderr.readline, "")
        said = []  # what it prints before it listens (none expected)
        found = None
        for line in lines:
            said.append(line)
            found = re.search(r"serving (.+) \(draft ngram\) at (http://\S+/v1)", line)
            if found:
                break
        assert found, "".join(said) + process.stderr.read()
        base = found.group(2)
        code, models = get(f"{base}/models")
        assert code == 200 and models["data"][0]["id"] == found.group(1)
        code, done = post(f"{base}/completions", {"prompt": "def fib"})
        assert code == 200 and done["usage"]["completion_tokens"] == 3
        assert "3 tokens" in next(lines)  # the completion's figures
        assert not cache.exists()
        process.send_signal(stop)
        assert process.wait(timeout=60) == 0
        assert "stopped" in process.stderr.read()
        assert cache.is_file()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_serve_options_are_checked(
    tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for argv, needle in (
        (["--port", "70000"], "--port must be 0-65535"),
        (["--max-batch", "0"], "--max-batch must be at least 1"),
        (["--temperature", "-1"], "temperature"),
    ):
        code, _out, err = run(capsys, "serve", "--model", str(tiny_model), *argv)
        assert code != 0 and needle in err and "Traceback" not in err, err


def test_a_request_s_values_go_over_the_server_s(pipeline: Pipeline) -> None:
    """What a request gives replaces the server's default, field by field;
    `max_completion_tokens` (OpenAI's newer name) goes before `max_tokens`."""
    defaults = Defaults(
        SamplingParams(temperature=0.5, top_k=4, seed=1),
        GenerationLimits(max_tokens=9, stop=("x",)),
    )
    body = {"prompt": "hi", "seed": 4, "max_tokens": 3, "max_completion_tokens": 5}
    parsed = parse_request(pipeline, "completions", body, defaults).unwrap()
    assert parsed.sampling == SamplingParams(temperature=0.5, top_k=4, seed=4)
    assert parsed.limits == GenerationLimits(max_tokens=5, stop=("x",))
    assert parsed.prompts == (pipeline.encode("hi").unwrap(),)
    assert not parsed.stream
    token_ids = parse_request(pipeline, "completions", {"prompt": [5, 6, 7]}, defaults)
    assert token_ids.unwrap().prompts == ((5, 6, 7),)
    # mlx_lm.server's penalty fields and OpenAI's logit_bias (ids as keys)
    penalised = {
        "prompt": "hi",
        "presence_penalty": 0.5,
        "frequency_penalty": 0.25,
        "frequency_context_size": 7,
        "repetition_context_size": 9,
        "logit_bias": {"12": -100, "3": 2},
    }
    sampling = parse_request(pipeline, "completions", penalised, defaults)
    assert sampling.unwrap().sampling == SamplingParams(
        temperature=0.5,
        top_k=4,
        seed=1,
        presence_penalty=0.5,
        frequency_penalty=0.25,
        frequency_context=7,
        repetition_context=9,
        logit_bias=((3, 2.0), (12, -100.0)),
    )
    # mlx_lm.server's per-request draft count, a cap on this row's drafts
    capped = {"prompt": "hi", "num_draft_tokens": 1}
    limits = parse_request(pipeline, "completions", capped, defaults).unwrap().limits
    assert limits.num_draft_tokens == 1
    negative = parse_request(
        pipeline, "completions", {"prompt": "hi", "num_draft_tokens": -2}, defaults
    )
    assert "num-draft-tokens must be >= 0" in negative.failure().message


def test_echo_scores_the_prompt_as_evaluation_harnesses_ask(
    pipeline: Pipeline,
) -> None:
    """A completion's `echo` (what lm-eval-harness's `local-completions`
    sends for log-likelihoods): the prompt's text before the completion and,
    with `logprobs`, each prompt token's log-probability given the tokens
    before it (the first has none) and the likeliest tokens there, then the
    generated tokens' as `generate` gives them; `max_tokens: 0` scores
    alone. The scores are `Pipeline.score`'s, which agree with generation's."""
    ids = list(pipeline.encode("def fibonacci(n):").unwrap())
    scored = pipeline.score(ids, top_logprobs=2).unwrap()
    assert scored.logprobs[0] is None and len(scored.logprobs) == len(ids)
    limits = GenerationLimits(max_tokens=4, top_logprobs=2)
    generated = pipeline.generate(ids, limits=limits).unwrap()
    assert generated.logprobs is not None
    # scoring the prompt and the completion gives generation's own scores
    whole = pipeline.score(ids + list(generated.tokens)).unwrap()
    assert whole.logprobs[len(ids) :] == pytest.approx(
        list(generated.logprobs), abs=1e-4
    )
    decode = pipeline.target.tokenizer.decode

    def client(base: str) -> list[Any]:
        alone = {"prompt": ids, "echo": True, "max_tokens": 0, "logprobs": 2}
        more = {"prompt": ids, "echo": True, "max_tokens": 4, "logprobs": 2}
        return [
            post(f"{base}/v1/completions", alone),
            post(f"{base}/v1/completions", more),
            post(
                f"{base}/v1/completions", {"prompt": ids, "echo": True, "max_tokens": 2}
            ),
        ]

    (code, alone), (_, more), (_, plain) = served(pipeline, client)
    assert code == 200
    choice = alone["choices"][0]
    assert choice["text"] == decode(ids)
    assert alone["usage"]["completion_tokens"] == 0
    lp = choice["logprobs"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx(list(scored.logprobs[1:]))
    for got, want in zip(lp["top_logprobs"][1:], scored.top[1:], strict=True):
        assert got == by_text(want, decode) and list(got) == list(by_text(want, decode))
    assert "".join(lp["tokens"]) == choice["text"]
    choice = more["choices"][0]
    assert choice["text"] == decode(ids) + generated.text
    lp = choice["logprobs"]
    assert lp["token_logprobs"][len(ids) :] == pytest.approx(list(generated.logprobs))
    assert lp["token_logprobs"][1 : len(ids)] == pytest.approx(
        list(scored.logprobs[1:])
    )
    assert len(lp["top_logprobs"]) == len(ids) + 4
    assert plain["choices"][0]["logprobs"] is None
    assert plain["choices"][0]["text"].startswith(decode(ids))


def test_an_evaluation_harness_s_log_likelihood_request(pipeline: Pipeline) -> None:
    """lm-eval-harness's `local-completions` log-likelihood request as it
    sends it (a batch of token-id prompts, `echo`, `max_tokens: 1`,
    `logprobs: 1`, temperature 0), read as it reads the answer: the sum of
    the continuation's `token_logprobs[ctxlen:-1]`, and greedy where each is
    its position's best `top_logprobs` value. Both agree with
    `Pipeline.score`: the continuation that greedy decoding produces is
    greedy, another is not."""
    context = list(pipeline.encode("def fibonacci(n):").unwrap())
    greedy = pipeline.generate(context, limits=GenerationLimits(max_tokens=3)).unwrap()
    other = [(greedy.tokens[0] + 1) % 50, *greedy.tokens[1:]]
    requests = [context + list(greedy.tokens), context + other]

    def client(base: str) -> list[Any]:
        body = {
            "model": "tiny",
            "prompt": requests,
            "temperature": 0,
            "max_tokens": 1,
            "logprobs": 1,
            "seed": 1234,
            "echo": True,
        }
        return [post(f"{base}/v1/completions", body)]

    [(code, answer)] = served(pipeline, client)
    assert code == 200
    read = []
    for choice in sorted(answer["choices"], key=lambda c: c["index"]):
        lps = choice["logprobs"]["token_logprobs"][len(context) : -1]
        tops = choice["logprobs"]["top_logprobs"][len(context) : -1]
        is_greedy = all(
            lp == max(top.values()) for lp, top in zip(lps, tops, strict=True)
        )
        read.append((sum(lps), is_greedy))
    for (total, _), tokens in zip(read, requests, strict=True):
        scored = pipeline.score(tokens).unwrap().logprobs[len(context) :]
        assert total == pytest.approx(sum(cast(list[float], scored)), abs=1e-4)
    assert [g for _, g in read] == [True, False]


def test_a_logit_bias_request_equals_the_library_s_output(pipeline: Pipeline) -> None:
    """A request with `logit_bias` and penalties is answered with what
    `generate` gives for the same values; the banned token never appears."""
    free = pipeline.generate("def fib", limits=GenerationLimits(max_tokens=8))
    banned = free.unwrap().tokens[0]
    sampling = SamplingParams(
        temperature=0.8, seed=2, frequency_penalty=0.5, logit_bias=((banned, -100.0),)
    )
    expected = pipeline.generate("def fib", sampling, GenerationLimits(max_tokens=8))
    assert banned not in expected.unwrap().tokens

    def client(base: str) -> list[Any]:
        body = {
            "prompt": "def fib",
            "max_tokens": 8,
            "temperature": 0.8,
            "seed": 2,
            "frequency_penalty": 0.5,
            "logit_bias": {str(banned): -100},
        }
        return [post(f"{base}/v1/completions", body)]

    [(code, answer)] = served(pipeline, client)
    assert code == 200
    assert answer["choices"][0]["text"] == expected.unwrap().text


def test_the_openai_client_reads_the_answers(pipeline: Pipeline) -> None:
    """OpenAI's own Python client, pointed at the server, reads its chat
    completions (whole and streamed), completions, model list and errors:
    the texts the library gives."""
    import openai

    sampling = SamplingParams(temperature=0.9, top_p=0.95, seed=7)
    limits = GenerationLimits(max_tokens=9)
    messages = [{"role": "user", "content": "def fib"}]
    chat = pipeline.generate(messages, sampling, limits).unwrap()
    text = pipeline.generate("def fib", sampling, limits).unwrap()

    def client(base: str) -> list[Any]:
        api = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        asked: dict[str, Any] = {"model": "tiny", "max_tokens": 9, **SAMPLED}
        whole = api.chat.completions.create(messages=messages, **asked)
        stream = api.chat.completions.create(messages=messages, stream=True, **asked)
        pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
        completion = api.completions.create(prompt="def fib", **asked)
        names = [m.id for m in api.models.list()]
        try:
            api.chat.completions.create(messages=[], model="tiny")
        except openai.BadRequestError as exc:
            refused = str(exc)
        return [whole, pieces, completion, names, refused]

    whole, pieces, completion, names, refused = served(pipeline, client)
    assert whole.choices[0].message.content == chat.text
    assert whole.choices[0].finish_reason == chat.finish_reason
    assert whole.usage.completion_tokens == chat.generated_tokens
    assert "".join(pieces) == chat.text
    assert completion.choices[0].text == text.text
    assert names == ["tiny"]
    assert "'messages' must be a non-empty list" in refused


def test_a_completion_of_several_prompts_answers_each(pipeline: Pipeline) -> None:
    """`prompt` as a list of texts or of token-id lists (as evaluation
    harnesses send them): a choice per prompt, in order, each the library's
    output alone, the usage summed; they run as rows of one batch. Streaming
    takes one prompt."""
    sampling = SamplingParams(temperature=0.6, seed=11)
    limits = GenerationLimits(max_tokens=6)
    ids = pipeline.encode("The quick").unwrap()
    prompts: list[Any] = ["def fib", "for i in", list(ids)]
    alone = [pipeline.generate(p, sampling, limits).unwrap() for p in prompts]

    def client(base: str) -> list[Any]:
        asked = {"max_tokens": 6, "temperature": 0.6, "seed": 11}
        return [
            post(f"{base}/v1/completions", {"prompt": prompts, **asked}),
            post(
                f"{base}/v1/completions",
                {"prompt": ["a", "b"], "stream": True, **asked},
            ),
        ]

    (code, done), (stream_code, refused) = served(pipeline, client)
    assert code == 200, done
    assert [c["index"] for c in done["choices"]] == [0, 1, 2]
    assert [c["text"] for c in done["choices"]] == [r.text for r in alone]
    assert done["usage"]["completion_tokens"] == sum(r.generated_tokens for r in alone)
    assert done["usage"]["prompt_tokens"] == sum(r.prompt_tokens for r in alone)
    assert stream_code == 400 and "stream one prompt" in refused["error"]["message"]
