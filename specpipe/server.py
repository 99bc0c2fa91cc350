"""An OpenAI-compatible HTTP server over one pipeline (`specpipe serve`).

`POST /v1/completions` and `POST /v1/chat/completions` (streamed as
server-sent events with `"stream": true`), `GET /v1/models` and
`GET /health`, as `mlx_lm.server` and vLLM answer them, with the pipeline's
drafter speculating for every request: the output is the target's own, as
with `specpipe generate`.

- One thread computes: the one that calls `Server.serve` (MLX's streams
  belong to the thread that made them). Handler threads parse, encode and
  answer; a request waits in a queue for its turn.
- Continuous batching: between rounds, waiting requests join the live rows
  (up to `max_batch` rows), each with its own sampling and limits and each
  row accepting its own drafts; a row leaves as soon as it ends.
- The pipeline's prompt cache (`specpipe serve` keeps one) serves a request
  that begins with what an earlier one processed, e.g. a chat's next turn.
- A request's sampling values default to the server's (`specpipe serve
  --temperature ...`); `seed` fixes its draws as `--seed` does.
- A client that goes away mid-stream fails only its own row.

The request's parsing and the response's objects are pure functions of their
inputs (`parse_request`, `completion_body`, `chunk_body`), tested apart from
the sockets.
"""

from __future__ import annotations

import json
import queue
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Mapping, Sequence
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Literal, TypeVar

from attrs import define, evolve, field, frozen
from returns.result import Failure, Result, Success

from schemas.errors import RequestError, succeeded
from schemas.request import (
    MAX_TOP_LOGPROBS,
    GenerationLimits,
    SamplingParams,
    logit_bias_entries,
)
from specpipe.api import Arrival, GenerationResult, GenerationStats, Pipeline
from specpipe.output import TopLogprobs
from specpipe.score import TokenScores

Endpoint = Literal["completions", "chat"]

# the largest request body read (a long chat's JSON is far smaller)
MAX_BODY_BYTES = 32 << 20

# a request's sampling fields (mlx_lm.server's names): SamplingParams' name, type
_SAMPLING_FIELDS: dict[str, tuple[str, type[int] | type[float]]] = {
    "temperature": ("temperature", float),
    "top_p": ("top_p", float),
    "top_k": ("top_k", int),
    "min_p": ("min_p", float),
    "repetition_penalty": ("repetition_penalty", float),
    "repetition_context_size": ("repetition_context", int),
    "presence_penalty": ("presence_penalty", float),
    "presence_context_size": ("presence_context", int),
    "frequency_penalty": ("frequency_penalty", float),
    "frequency_context_size": ("frequency_context", int),
    "seed": ("seed", int),
}


@frozen
class ParsedRequest:
    """What one completion request asks for, checked."""

    endpoint: Endpoint
    # each prompt's token ids: a chat's one, or a completion's texts or id
    # lists (each answered as a choice of its own, index in order)
    prompts: tuple[tuple[int, ...], ...]
    sampling: SamplingParams
    limits: GenerationLimits
    stream: bool = False
    include_usage: bool = False
    # a completion's `echo`: the prompt's text (and, with logprobs, its
    # tokens' scores) before the generated ones
    echo: bool = False
    # false for an echo with max_tokens 0: the prompt scored, nothing generated
    generates: bool = True


@frozen
class Defaults:
    """The server's values for what a request leaves out."""

    sampling: SamplingParams = field(factory=SamplingParams)
    limits: GenerationLimits = field(factory=GenerationLimits)


def _refuse(message: str) -> Failure[RequestError]:
    return Failure(RequestError(message))


_Number = TypeVar("_Number", int, float)


def _typed(
    body: Mapping[str, Any], name: str, kind: type[_Number]
) -> Result[_Number | None, RequestError]:
    """`body[name]` as a number of `kind` (an int is a float too, a bool is
    neither), or None where it is absent or null."""
    value = body.get(name)
    if value is None:
        return Success(None)
    takes = (int, float) if kind is float else (int,)
    if isinstance(value, bool) or not isinstance(value, takes):
        return _refuse(f"'{name}' must be a number ({kind.__name__}), got {value!r}")
    return Success(kind(value))


def _asked_logprobs(
    endpoint: Endpoint, body: Mapping[str, Any]
) -> Result[tuple[bool, int], RequestError]:
    """Whether the request asks for its tokens' log-probabilities, and for
    how many alternatives a position: a completion's `logprobs` is that
    count (`true`: the chosen tokens' alone), a chat's is true or false with
    the count in `top_logprobs`."""
    logprobs = body.get("logprobs")
    top = _typed(body, "top_logprobs", int)
    if not succeeded(top):
        return Failure(top.failure())
    if endpoint == "completions":
        if logprobs is None or isinstance(logprobs, bool):
            return Success((bool(logprobs), 0))
        if isinstance(logprobs, int) and 0 <= logprobs <= MAX_TOP_LOGPROBS:
            return Success((logprobs > 0, logprobs))
        return _refuse(
            f"'logprobs' must be a count of alternatives in [0, "
            f"{MAX_TOP_LOGPROBS}], got {logprobs!r}"
        )
    if not (logprobs is None or isinstance(logprobs, bool)):
        return _refuse(f"'logprobs' must be true or false, got {logprobs!r}")
    count = top.unwrap() or 0
    if not 0 <= count <= MAX_TOP_LOGPROBS:
        return _refuse(
            f"'top_logprobs' must be in [0, {MAX_TOP_LOGPROBS}], got {count}"
        )
    if count and not logprobs:
        return _refuse("'top_logprobs' needs 'logprobs': true")
    return Success((bool(logprobs), count))


def _stop_strings(
    body: Mapping[str, Any],
) -> Result[tuple[str, ...] | None, RequestError]:
    stop = body.get("stop")
    if stop is None:
        return Success(None)
    if isinstance(stop, str):
        return Success((stop,))
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return Success(tuple(stop))
    return _refuse(f"'stop' must be a string or a list of strings, got {stop!r}")


def _message_text(number: int, message: Any) -> Result[dict[str, str], RequestError]:
    """A chat message with its content as text (OpenAI's list of text parts
    joined); other parts (images, audio) are refused."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        return _refuse(f"message {number} needs a 'role' string, got {message!r}")
    content = message.get("content")
    if content is None:
        content = ""
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"):
                return _refuse(
                    f"message {number}: only text content parts are taken, got {part!r}"
                )
            texts.append(str(part.get("text", "")))
        content = "".join(texts)
    if not isinstance(content, str):
        return _refuse(f"message {number}'s 'content' must be text, got {content!r}")
    return Success({"role": message["role"], "content": content})


def _prompt_ids(
    pipeline: Pipeline, endpoint: Endpoint, body: Mapping[str, Any]
) -> Result[tuple[tuple[int, ...], ...], RequestError]:
    """The request's prompts as token ids: a chat's messages rendered by the
    template (with `chat_template_kwargs`), a completion's text or ids, or a
    list of texts or of id lists."""
    if endpoint == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return _refuse("'messages' must be a non-empty list of chat messages")
        texts = []
        for number, message in enumerate(messages):
            text = _message_text(number, message)
            if not succeeded(text):
                return Failure(text.failure())
            texts.append(text.unwrap())
        values = body.get("chat_template_kwargs")
        if values is not None:
            if not isinstance(values, dict):
                return _refuse(
                    f"'chat_template_kwargs' must be an object, got {values!r}"
                )
            templated = pipeline.with_template_args(values)
            if not succeeded(templated):
                return Failure(templated.failure())
            pipeline = templated.unwrap()
        return pipeline.encode(texts).map(lambda ids: (ids,))
    prompt = body.get("prompt")
    prompts = prompt if isinstance(prompt, list) and prompt else [prompt]
    if _token_ids(prompts):
        prompts = [prompts]  # one prompt of token ids
    encoded = []
    for one in prompts:
        if not (isinstance(one, str) or (isinstance(one, list) and _token_ids(one))):
            return _refuse(
                "'prompt' must be a string, a list of token ids, or a list of "
                f"either, got {prompt!r}"
            )
        ids = pipeline.encode(one)
        if not succeeded(ids):
            return Failure(ids.failure())
        encoded.append(ids.unwrap())
    return Success(tuple(encoded))


def _token_ids(values: list[Any]) -> bool:
    return bool(values) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in values
    )


def parse_request(
    pipeline: Pipeline,
    endpoint: Endpoint,
    body: Any,
    defaults: Defaults,
) -> Result[ParsedRequest, RequestError]:
    """A request body's prompt ids, sampling and limits, checked, over the
    server's `defaults`; the first problem is named."""
    if not isinstance(body, dict):
        return _refuse(f"the request body must be a JSON object, got {body!r}")
    if body.get("n") not in (None, 1) or body.get("best_of") not in (None, 1):
        return _refuse("one completion a request: 'n' and 'best_of' must be 1")
    if body.get("suffix") or body.get("tools"):
        return _refuse(
            "'suffix' and 'tools' are not supported (put tools in "
            "'chat_template_kwargs' for a template that reads them)"
        )
    echo = body.get("echo", False)
    if echo not in (None, False, True):
        return _refuse(f"'echo' must be true or false, got {echo!r}")
    if echo and endpoint == "chat":
        return _refuse(
            "'echo' is a completion's field; chat completions do not take it"
        )
    sampled: dict[str, Any] = {}
    for name, (param, kind) in _SAMPLING_FIELDS.items():
        value = _typed(body, name, kind)
        if not succeeded(value):
            return Failure(value.failure())
        if value.unwrap() is not None:
            sampled[param] = value.unwrap()
    if body.get("logit_bias") is not None:
        bias = logit_bias_entries(body["logit_bias"])
        if not succeeded(bias):
            return Failure(bias.failure())
        sampled["logit_bias"] = bias.unwrap()
    sampling = evolve(defaults.sampling, **sampled).checked()
    if not succeeded(sampling):
        return Failure(sampling.failure())
    tokens: int | None = None
    for name in ("max_completion_tokens", "max_tokens"):
        value = _typed(body, name, int)
        if not succeeded(value):
            return Failure(value.failure())
        tokens = value.unwrap() if tokens is None else tokens
    stop = _stop_strings(body)
    if not succeeded(stop):
        return Failure(stop.failure())
    scores = _asked_logprobs(endpoint, body)
    if not succeeded(scores):
        return Failure(scores.failure())
    wants_logprobs, top = scores.unwrap()
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        return _refuse(f"'stream' must be true or false, got {stream!r}")
    if stream and (wants_logprobs or echo):
        return _refuse(
            "'logprobs' and 'echo' are answered without 'stream'; leave one out"
        )
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        return _refuse(f"'stream_options' must be an object, got {options!r}")
    drafts = _typed(body, "num_draft_tokens", int)
    if not succeeded(drafts):
        return Failure(drafts.failure())
    cap, stops = drafts.unwrap(), stop.unwrap()
    # an echo may generate nothing (an evaluation harness scoring a text)
    generates = not (echo and tokens == 0)
    limits = GenerationLimits.create(
        num_draft_tokens=defaults.limits.num_draft_tokens if cap is None else cap,
        max_tokens=defaults.limits.max_tokens
        if tokens is None
        else (tokens if generates else 1),
        stop=defaults.limits.stop if stops is None else stops,
        logprobs=wants_logprobs,
        top_logprobs=top,
    )
    if not succeeded(limits):
        return Failure(limits.failure())
    ids = _prompt_ids(pipeline, endpoint, body)
    if not succeeded(ids):
        return Failure(ids.failure())
    if stream and len(ids.unwrap()) > 1:
        return _refuse(
            "stream one prompt a request; send several prompts without 'stream'"
        )
    return Success(
        ParsedRequest(
            endpoint,
            ids.unwrap(),
            sampling.unwrap(),
            limits.unwrap(),
            stream,
            bool(options.get("include_usage", False)),
            bool(echo),
            generates,
        )
    )


def usage(results: Sequence[GenerationResult]) -> dict[str, int]:
    prompt = sum(r.prompt_tokens for r in results)
    generated = sum(r.generated_tokens for r in results)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": generated,
        "total_tokens": prompt + generated,
    }


def _logprobs(
    request: ParsedRequest,
    result: GenerationResult,
    decode: Callable[[Sequence[int]], str],
    echoed: TokenScores | None = None,
) -> dict[str, Any] | None:
    """A choice's `logprobs`: the generated tokens', after the prompt's where
    it is echoed (its first token has none)."""
    endpoint, asked_top = request.endpoint, request.limits.top_logprobs > 0
    if not (request.limits.logprobs or asked_top):
        return None
    tokens: list[int] = list(result.tokens)
    chosen: list[float | None] = list(result.logprobs or ())
    tops: list[TopLogprobs | None] = list(result.top_logprobs or [()] * len(tokens))
    if echoed is not None:
        tokens = [*echoed.tokens, *tokens]
        chosen = [*echoed.logprobs, *chosen]
        tops = [None, *echoed.top[1:], *tops]
    pieces = [decode([t]) for t in tokens]
    alternatives = [
        None if top is None else [(decode([t]), lp) for t, lp in top] for top in tops
    ]
    if endpoint == "chat":

        def entry(piece: str, lp: float | None) -> dict[str, Any]:
            return {"token": piece, "logprob": lp, "bytes": list(piece.encode("utf-8"))}

        return {
            "content": [
                {
                    **entry(piece, lp),
                    "top_logprobs": [entry(*alt) for alt in top or ()],
                }
                for piece, lp, top in zip(pieces, chosen, alternatives, strict=False)
            ]
        }
    offsets, at = [], 0
    for piece in pieces:
        offsets.append(at)
        at += len(piece)
    return {
        "tokens": pieces,
        "token_logprobs": chosen,
        "top_logprobs": [None if top is None else _by_text(top) for top in alternatives]
        if asked_top
        else None,
        "text_offset": offsets,
    }


def _by_text(top: Sequence[tuple[str, float]]) -> dict[str, float]:
    """A completion's alternatives, text -> logprob, likeliest first; tokens
    of one text (pieces of a character) keep the likeliest's value."""
    out: dict[str, float] = {}
    for text, lp in top:
        out.setdefault(text, lp)
    return out


def completion_body(
    request: ParsedRequest,
    results: Sequence[GenerationResult],
    ident: str,
    model: str,
    created: int,
    decode: Callable[[Sequence[int]], str],
    echoed: Sequence[TokenScores] = (),
) -> dict[str, Any]:
    """The whole response of a request that did not stream: a choice per
    prompt, in order; with `echo`, each prompt's text (`echoed`: its scored
    tokens) before its completion."""
    choices = []
    for index, result in enumerate(results):
        prompt = echoed[index] if request.echo else None
        choice: dict[str, Any] = {
            "index": index,
            "finish_reason": result.finish_reason,
            "logprobs": _logprobs(request, result, decode, prompt),
        }
        if request.endpoint == "chat":
            choice["message"] = {"role": "assistant", "content": result.text}
        else:
            before = decode(prompt.tokens) if prompt is not None else ""
            choice["text"] = before + result.text
        choices.append(choice)
    return {
        "id": ident,
        "object": "chat.completion"
        if request.endpoint == "chat"
        else "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage(results),
    }


def chunk_body(
    endpoint: Endpoint,
    ident: str,
    model: str,
    created: int,
    text: str | None,
    finish_reason: str | None = None,
    role: bool = False,
) -> dict[str, Any]:
    """One streamed event: a piece of text, the opening role (chat), or the
    closing finish reason."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason}
    if endpoint == "chat":
        delta: dict[str, str] = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
        choice["logprobs"] = None
    return {
        "id": ident,
        "object": "chat.completion.chunk" if endpoint == "chat" else "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
    }


def error_body(message: str, kind: str = "invalid_request_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


# A job's events, from the computing thread to its handler: ("scored",
# TokenScores) first for an echo, ("text", str), ("done", GenerationResult),
# ("error", (status, message))
Event = tuple[str, Any]


@define
class _Job:
    request: ParsedRequest
    index: int = 0  # which of the request's prompts
    events: queue.Queue[Event] = field(factory=queue.Queue)
    gone: bool = False  # the client went away: its row fails at its next text
    batch: int = 0  # the live rows once it joined


class _ClientGone(Exception):
    pass


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    app: Server


@define
class Server:
    """A pipeline behind an OpenAI-compatible HTTP endpoint. `serve` computes
    in the calling thread until `stop` is set (or Ctrl-C)."""

    pipeline: Pipeline
    model: str  # the name /v1/models lists and responses carry
    host: str = "127.0.0.1"
    port: int = 8080  # 0: any free port (`bind` tells which)
    defaults: Defaults = field(factory=Defaults)
    max_batch: int = 8
    log: Callable[[str], None] = field(
        default=lambda line: print(f"specpipe: {line}", file=sys.stderr)
    )
    _jobs: queue.Queue[_Job] = field(factory=queue.Queue, init=False)
    _httpd: _HTTPServer | None = field(default=None, init=False)

    def __attrs_post_init__(self) -> None:
        if self.max_batch < 1:
            raise ValueError(f"max-batch must be at least 1, got {self.max_batch}")

    def bind(self) -> tuple[str, int]:
        """Open the socket (an error names the address in use); the address
        it listens on."""
        if self._httpd is None:
            try:
                self._httpd = _HTTPServer((self.host, self.port), _Handler)
            except OSError as exc:
                raise OSError(
                    f"cannot listen on {self.host}:{self.port}: {exc.strerror or exc} "
                    "(another server there? give --port)"
                ) from exc
            self._httpd.app = self
        host, port = self._httpd.server_address[:2]
        return str(host), int(port)

    def serve(self, stop: threading.Event | None = None) -> None:
        stop = stop or threading.Event()
        self.bind()
        httpd = self._httpd
        assert httpd is not None
        listener = threading.Thread(target=httpd.serve_forever, daemon=True)
        listener.start()
        try:
            while not stop.is_set():
                try:
                    first = self._jobs.get(timeout=0.05)
                except queue.Empty:
                    continue
                self._run_arriving(first, stop)
        finally:
            httpd.shutdown()
            httpd.server_close()
            self._httpd = None
            while not self._jobs.empty():
                self._jobs.get().events.put(
                    ("error", (HTTPStatus.SERVICE_UNAVAILABLE, "the server stopped"))
                )

    def submit(self, request: ParsedRequest) -> list[_Job]:
        """A job per prompt of `request`, queued for the computing thread."""
        jobs = [_Job(request, index) for index in range(len(request.prompts))]
        for job in jobs:
            self._jobs.put(job)
        return jobs

    def _run_arriving(self, first: _Job, stop: threading.Event) -> None:
        """Continuous batching from `first` on: between rounds, waiting jobs
        join the live rows up to `max_batch`, each as soon as there is room
        (`Pipeline.generate_arriving`); the run ends when no row is live and
        none waits."""
        waiting: list[_Job] = [first]
        running: dict[int, _Job] = {}  # the live jobs by id

        def arrivals() -> list[Arrival]:
            if stop.is_set():
                return []
            while True:
                try:
                    waiting.append(self._jobs.get_nowait())
                except queue.Empty:
                    break
            room = self.max_batch - len(running)
            joining, waiting[:] = waiting[:room], waiting[room:]
            running.update((id(job), job) for job in joining)
            arriving = []
            for job in joining:
                job.batch = len(running)
                if job.request.echo and not self._echo(job):
                    running.pop(id(job))  # answered: scored alone, or failed
                    continue
                arriving.append(self._arrival(job, running))
            return arriving

        try:
            self.pipeline.generate_arriving(arrivals)
        except Exception as exc:  # a bug: answer each request, keep serving
            self.log("".join(traceback.format_exception(exc)).rstrip())
            message = f"{type(exc).__name__}: {exc}"
            for job in running.values():
                job.events.put(("error", (HTTPStatus.INTERNAL_SERVER_ERROR, message)))
        for job in waiting:  # left behind by a stop
            self._jobs.put(job)

    def _echo(self, job: _Job) -> bool:
        """Score an echoed prompt (in the computing thread, between rounds)
        and tell its handler; whether the job goes on to generate."""
        request = job.request
        ids = request.prompts[job.index]
        scored = self.pipeline.score(list(ids), request.limits.top_logprobs)
        if not succeeded(scored):
            job.events.put(
                ("error", (HTTPStatus.BAD_REQUEST, scored.failure().message))
            )
            return False
        job.events.put(("scored", scored.unwrap()))
        if request.generates:
            return True
        stats = GenerationStats(0.0, 0.0, 0.0, 0, 0, 0, 0.0, self.pipeline.draft_kind)
        nothing = GenerationResult("", (), len(ids), 0, "length", stats, logprobs=())
        job.events.put(("done", nothing))
        return False

    def _arrival(self, job: _Job, running: dict[int, _Job]) -> Arrival:
        def on_text(text: str) -> None:
            if job.gone:
                raise _ClientGone
            job.events.put(("text", text))

        def on_done(outcome: Result[GenerationResult, RequestError]) -> None:
            running.pop(id(job), None)
            if not succeeded(outcome):
                status = HTTPStatus.BAD_REQUEST
                job.events.put(("error", (status, outcome.failure().message)))
                return
            result = outcome.unwrap()
            if not job.gone:
                where = f"{job.request.endpoint}, joined {job.batch} live row(s)"
                self.log(f"{where}: {result.summary()}")
            job.events.put(("done", result))

        request = job.request
        ids = request.prompts[job.index]
        return Arrival(ids, on_done, request.sampling, request.limits, on_text)


class _Handler(BaseHTTPRequestHandler):
    server: _HTTPServer
    server_version = "specpipe"

    def log_message(self, format: str, *args: Any) -> None:
        pass  # the computing thread logs each completion's figures

    @property
    def app(self) -> Server:
        return self.server.app

    def end_headers(self) -> None:
        # any origin may call it, as mlx_lm.server's default (a browser page)
        self.send_header("Access-Control-Allow-Origin", "*")
        super().end_headers()

    def do_OPTIONS(self) -> None:
        """A browser's preflight before a cross-origin POST."""
        self.send_response(HTTPStatus.NO_CONTENT)
        self.send_header("Access-Control-Allow-Methods", "GET, POST, OPTIONS")
        self.send_header("Access-Control-Allow-Headers", "Content-Type, Authorization")
        self.end_headers()

    def _json(self, status: int, body: Mapping[str, Any]) -> None:
        data = json.dumps(body, ensure_ascii=False).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str) -> None:
        kind = "invalid_request_error" if status < 500 else "server_error"
        if status == HTTPStatus.NOT_FOUND:
            kind = "not_found_error"
        self._json(status, error_body(message, kind))

    def do_GET(self) -> None:
        path = self.path.split("?")[0].rstrip("/")
        if path in ("/health", "/v1/health"):
            self._json(HTTPStatus.OK, {"status": "ok"})
        elif path == "/v1/models":
            self._json(
                HTTPStatus.OK,
                {
                    "object": "list",
                    "data": [
                        {
                            "id": self.app.model,
                            "object": "model",
                            "created": int(time.time()),
                            "owned_by": "specpipe",
                        }
                    ],
                },
            )
        else:
            self._error(HTTPStatus.NOT_FOUND, f"no such endpoint: GET {path}")

    def do_POST(self) -> None:
        path = self.path.split("?")[0].rstrip("/")
        endpoints: dict[str, Endpoint] = {
            "/v1/completions": "completions",
            "/v1/chat/completions": "chat",
        }
        endpoint = endpoints.get(path)
        if endpoint is None:
            self._error(HTTPStatus.NOT_FOUND, f"no such endpoint: POST {path}")
            return
        body = self._body()
        if body is None:
            return
        parsed = parse_request(self.app.pipeline, endpoint, body, self.app.defaults)
        if not succeeded(parsed):
            self._error(HTTPStatus.BAD_REQUEST, parsed.failure().message)
            return
        request = parsed.unwrap()
        jobs = self.app.submit(request)
        prefix = "chatcmpl" if endpoint == "chat" else "cmpl"
        ident = f"{prefix}-{uuid.uuid4().hex}"
        created = int(time.time())
        if request.stream:
            self._stream(jobs[0], ident, created)
            return
        results: list[GenerationResult] = []
        echoed: list[TokenScores] = []
        for job in jobs:
            while (event := job.events.get())[0] in ("text", "scored"):
                if event[0] == "scored":
                    echoed.append(event[1])
            kind, value = event
            if kind == "error":
                self._error(*value)
                return
            if value.finish_reason == "failed":
                message = value.error or "generation failed"
                self._error(HTTPStatus.INTERNAL_SERVER_ERROR, message)
                return
            results.append(value)
        tok = self.app.pipeline.target.tokenizer
        self._json(
            HTTPStatus.OK,
            completion_body(
                request,
                results,
                ident,
                self.app.model,
                created,
                tok.decode,
                echoed,
            ),
        )

    def _body(self) -> Any | None:
        """The request's JSON, or None after answering why there is none."""
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self._error(
                HTTPStatus.LENGTH_REQUIRED, "send the body with a Content-Length"
            )
            return None
        if int(length) > MAX_BODY_BYTES:
            self._error(
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                f"the body is {length} bytes; at most {MAX_BODY_BYTES} are read",
            )
            return None
        raw = self.rfile.read(int(length))
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            self._error(HTTPStatus.BAD_REQUEST, f"the request body is not JSON: {exc}")
            return None

    def _stream(self, job: _Job, ident: str, created: int) -> None:
        endpoint, model = job.request.endpoint, self.app.model
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()

        def send(body: Mapping[str, Any] | str) -> None:
            data = (
                body if isinstance(body, str) else json.dumps(body, ensure_ascii=False)
            )
            self.wfile.write(f"data: {data}\n\n".encode())
            self.wfile.flush()

        try:
            if endpoint == "chat":
                send(chunk_body(endpoint, ident, model, created, "", role=True))
            while True:
                kind, value = job.events.get()
                if kind == "text":
                    send(chunk_body(endpoint, ident, model, created, value))
                    continue
                if kind == "error":
                    send(error_body(value[1]))
                elif value.finish_reason == "failed":
                    send(error_body(value.error or "generation failed", "server_error"))
                else:
                    send(
                        chunk_body(
                            endpoint, ident, model, created, None, value.finish_reason
                        )
                    )
                    if job.request.include_usage:
                        last = chunk_body(endpoint, ident, model, created, None)
                        last["choices"] = []
                        last["usage"] = usage([value])
                        send(last)
                send("[DONE]")
                return
        except OSError:  # the client went away: its row stops at its next text
            job.gone = True
