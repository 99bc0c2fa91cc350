"""The Python API: load a pipeline, generate (one prompt or a batch of rows),
stream text. Boundary errors come back as `Result` failures."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any, cast

import jinja2
import mlx.core as mx
import mlx.nn as nn
from attrs import asdict, evolve, field, frozen
from returns.result import Failure, Result, Success

from bindings.capabilities import GraphCapabilities, NativeDraft
from bindings.kinds import default_registry
from bindings.registry import DraftLoadRequest, DraftRegistry, LoadedDraft
from models.build import quantized_forms
from models.cache import KVQuantization, QuantizedKVCache, on_gpu
from models.dflash import bits_problem
from models.hybrid_cache import HybridCache
from schemas.errors import LoadError, RequestError, SpecpipeError, succeeded
from schemas.request import (
    DraftPolicy,
    GenerationLimits,
    SamplingParams,
    top_logprobs_problem,
)
from specpipe.adaptive import AdaptivePolicy, CostModel
from specpipe.calibrate import calibrated
from specpipe.load import LoadedModel
from specpipe.load import load as load_model
from specpipe.loop import (
    RoundOptions,
    RowRequest,
    RowResult,
    generate_rows,
    generate_stepwise,
)
from specpipe.output import TextSink, TopLogprobs
from specpipe.precision import notice_tf32
from specpipe.prompt_cache import DEFAULT_MAX_BYTES, PromptCache
from specpipe.prompt_cache_file import load_prompt_cache, save_prompt_cache
from specpipe.score import TokenScores, score_tokens

# the names the chat template renderer passes itself (`Pipeline.with_template_args`)
_RENDER_NAMES = frozenset({"messages", "add_generation_prompt"})


def _read_only(values: Mapping[str, Any]) -> Mapping[str, Any]:
    return MappingProxyType(dict(values))


# the widest draft a round may verify (--num-draft-tokens): no drafter's block
# or chain comes near it, and a wider window only costs a verify forward
MAX_DRAFT_TOKENS = 128

# a chat message: {"role": ..., "content": ...}
Message = Mapping[str, str]
# text (with `chat`: one user message), token ids, or a conversation's
# messages (rendered by the model's chat template, `chat` or not)
Prompt = str | Sequence[int] | Sequence[Message]


@frozen
class GenerationStats:
    tokens_per_second: float
    prompt_seconds: float
    decode_seconds: float
    rounds: int
    drafted: int
    accepted: int
    acceptance_length: float
    draft: str
    per_position: tuple[float, ...] = ()
    ms_per_round: float = 0.0
    draft_errors: tuple[str, ...] = ()
    depths: tuple[tuple[int, int], ...] = ()  # adaptive: (depth, rounds) chosen
    gated_share: float = 0.0  # adaptive: share of a row's rounds decoded plainly
    phase_ms: tuple[tuple[str, float], ...] = ()  # opt-in: draft/verify/sample/commit
    cached_tokens: int = 0  # prompt tokens restored from the prompt cache


@frozen
class GenerationResult:
    text: str
    tokens: tuple[int, ...]
    prompt_tokens: int
    generated_tokens: int
    finish_reason: str
    stats: GenerationStats
    logprobs: tuple[float, ...] | None = None
    error: str | None = None
    # each position's most likely tokens, (id, logprob), where asked for
    top_logprobs: tuple[TopLogprobs, ...] | None = None

    def summary(self) -> str:
        """The run's figures in one line, as `mlx_lm.generate` prints them
        after a run (the command line's stderr; `to_json` has them all)."""
        stats = self.stats
        cached = (
            f", {stats.cached_tokens} from the prompt cache"
            if stats.cached_tokens
            else ""
        )
        accepted = (
            f"{stats.accepted} of {stats.drafted} drafts accepted"
            if stats.drafted
            else "no drafts made"
        )
        drafting = (
            f"; draft {stats.draft}: {stats.acceptance_length:.2f} tokens a round, {accepted}"
            if stats.draft != "none"
            else ""
        )
        peak = mx.get_peak_memory()
        memory = f"{peak / 1e9:.2f} GB" if peak >= 1e9 else f"{peak / 1e6:.1f} MB"
        return (
            f"[{self.generated_tokens} tokens, {stats.tokens_per_second:.1f} tok/s; "
            f"prompt {self.prompt_tokens} tokens in {stats.prompt_seconds:.2f} s{cached}"
            f"{drafting}; peak memory {memory}]"
        )

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "text": self.text,
            "tokens": list(self.tokens),
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "finish_reason": self.finish_reason,
            "stats": {
                "tokens_per_second": self.stats.tokens_per_second,
                "prompt_seconds": self.stats.prompt_seconds,
                "decode_seconds": self.stats.decode_seconds,
                "rounds": self.stats.rounds,
                "drafted": self.stats.drafted,
                "accepted": self.stats.accepted,
                "acceptance_length": self.stats.acceptance_length,
                "draft": self.stats.draft,
                "per_position_acceptance": list(self.stats.per_position),
                "ms_per_round": self.stats.ms_per_round,
                "cached_tokens": self.stats.cached_tokens,
            },
        }
        if self.stats.draft_errors:
            out["stats"]["draft_errors"] = list(self.stats.draft_errors)
        if self.stats.phase_ms:
            out["stats"]["phase_ms"] = dict(self.stats.phase_ms)
        if self.stats.depths:
            out["stats"]["depths"] = {str(d): n for d, n in self.stats.depths}
            out["stats"]["gated_share"] = self.stats.gated_share
        if self.logprobs is not None:
            out["logprobs"] = list(self.logprobs)
        if self.top_logprobs is not None:
            out["top_logprobs"] = [
                [{"id": token, "logprob": lp} for token, lp in top]
                for top in self.top_logprobs
            ]
        if self.error is not None:
            out["error"] = self.error
        return out


@frozen
class _PreparedBatch:
    """A validated batch: encoded prompts, their sinks and row requests."""

    pipeline: Pipeline
    encoded: list[tuple[int, ...]]
    sinks: list[TextSink]
    requests: list[RowRequest]
    options: RoundOptions

    def run(self) -> list[RowResult]:
        """Generate the batch's rows (`specpipe.loop.generate_rows`)."""
        return generate_rows(**self._arguments())

    def stepwise(self) -> Generator[None, None, list[RowResult]]:
        """The same, a round at a time (`specpipe.loop.generate_stepwise`)."""
        return generate_stepwise(**self._arguments())

    def _arguments(self) -> dict[str, Any]:
        return {"requests": self.requests, **self.pipeline._loop(self.options)}

    def results(self, rows: Sequence[RowResult]) -> list[GenerationResult]:
        return [
            self.pipeline._result(ids, sink, _closed(sink, row))
            for ids, sink, row in zip(self.encoded, self.sinks, rows, strict=True)
        ]


def _closed(sink: TextSink, row: RowResult) -> RowResult:
    """`row` after its sink flushed the text held back for stop strings; a
    consumer that raises there fails only its own row."""
    try:
        sink.close()
    except Exception as exc:
        if row.finish != "failed":
            return evolve(row, finish="failed", error=f"{type(exc).__name__}: {exc}")
    return row


@frozen
class Arrival:
    """A request that joins a running batch (`Pipeline.generate_arriving`):
    its prompt ids, and `on_done`, told its result as soon as its row ends (a
    failure where the arrival itself is refused)."""

    prompt: tuple[int, ...]
    on_done: Callable[[Result[GenerationResult, RequestError]], None]
    sampling: SamplingParams = field(factory=SamplingParams)
    limits: GenerationLimits = field(factory=GenerationLimits)
    on_text: Callable[[str], None] | None = None  # its text as it is generated


@frozen
class Pipeline:
    target: LoadedModel
    draft: LoadedDraft | None = None
    device_round: bool = False  # see RoundOptions.device_round
    registry: DraftRegistry = field(factory=default_registry)
    adaptive: AdaptivePolicy | None = None
    phase_timing: bool = False  # evaluate between phases to time them (slower)
    draft_ahead: bool = False  # see RoundOptions.draft_ahead
    # rows' states kept between calls, to start later prompts from
    # (`specpipe.prompt_cache`; `with_prompt_cache`)
    prompt_cache: PromptCache | None = None
    # more values for the chat template (`with_template_args`)
    template_args: Mapping[str, Any] = field(
        factory=dict, converter=_read_only, repr=False
    )

    @property
    def draft_kind(self) -> str:
        return self.draft.kind if self.draft is not None else "none"

    def with_prompt_cache(
        self, max_bytes: int = DEFAULT_MAX_BYTES, capture_prompts: bool = True
    ) -> Pipeline:
        """This pipeline keeping rows' states within `max_bytes` between
        calls: a prompt that begins with what an earlier call processed (the
        next turn of a conversation, a repeated prompt) prefills only the
        rest. The output is unchanged."""
        cache = PromptCache(
            self.target.model, max_bytes, capture_prompts=capture_prompts
        )
        return evolve(self, prompt_cache=cache)

    def with_end_tokens(self, tokens: Sequence[str]) -> Result[Pipeline, RequestError]:
        """This pipeline also ending a row at each of `tokens` (token texts
        of the model's vocabulary, as mlx_lm's `--extra-eos-token`): an end
        token is not emitted, as the model's own end-of-sequence tokens are
        not. Text that is not one token is refused, naming it."""
        tok = self.target.tokenizer
        ids = list(tok.eos_token_ids)
        for text in tokens:
            index = tok.backend.token_to_id(text)
            if index is None:
                pieces = tok.encode(text, add_special_tokens=False)
                if len(pieces) != 1:
                    return Failure(
                        RequestError(
                            f"end token {text!r} is not one token of {self.target.source}'s "
                            f"vocabulary (it encodes as {len(pieces)}); give a token "
                            "the model has, or use --stop for text"
                        )
                    )
                index = pieces[0]
            ids.append(index)
        tokenizer = evolve(tok, eos_token_ids=tuple(dict.fromkeys(ids)))
        return Success(evolve(self, target=evolve(self.target, tokenizer=tokenizer)))

    def with_template_args(
        self, values: Mapping[str, Any]
    ) -> Result[Pipeline, RequestError]:
        """This pipeline rendering chat messages with `values` beside them (as
        mlx_lm's `--chat-template-config`: e.g. `{"enable_thinking": False}`
        for Qwen3's and Qwen3.5's templates, or `tools`), over any given
        before. The names the renderer itself passes are refused."""
        for name in values:
            if not isinstance(name, str) or not name.isidentifier():
                return Failure(
                    RequestError(
                        f"a chat template value's name must be an identifier, got {name!r}"
                    )
                )
            if name in _RENDER_NAMES:
                return Failure(
                    RequestError(
                        f"the chat template value {name!r} is the renderer's own; "
                        "give the conversation as messages instead"
                    )
                )
        return Success(evolve(self, template_args={**self.template_args, **values}))

    def load_prompt_cache(self, path: str | Path) -> Result[Pipeline, SpecpipeError]:
        """This pipeline with the checkpoints a `save_prompt_cache` file holds
        added to its prompt cache (made with the default budget if it has
        none). A file of another model is refused."""
        pipeline = self if self.prompt_cache is not None else self.with_prompt_cache()
        assert pipeline.prompt_cache is not None
        loaded = load_prompt_cache(Path(path), pipeline.prompt_cache)
        if not succeeded(loaded):
            return Failure(loaded.failure())
        return Success(pipeline)

    def save_prompt_cache(
        self, path: str | Path, *, merge: bool = True
    ) -> Result[Path, SpecpipeError]:
        """Write the prompt cache's checkpoints to `path` (one safetensors
        file, written whole or not at all; `specpipe.prompt_cache_file`),
        after those the file already holds (`merge`: several processes
        saving to one file each add theirs), within the cache's budget."""
        if self.prompt_cache is None:
            return Failure(
                RequestError(
                    "this pipeline keeps no prompt cache; make it with "
                    "with_prompt_cache() or load(..., prompt_cache=True)"
                )
            )
        saved = save_prompt_cache(self.prompt_cache, Path(path), merge=merge)
        if not succeeded(saved):
            return Failure(saved.failure())
        return Success(saved.unwrap())

    def encode(
        self, prompt: Prompt, chat: bool = False
    ) -> Result[tuple[int, ...], RequestError]:
        tok = self.target.tokenizer
        items = list(prompt) if not isinstance(prompt, str) else []
        if items and all(isinstance(m, Mapping) for m in items):
            rendered = _render(tok, cast(list[Message], items), self.template_args)
            if not succeeded(rendered):
                return Failure(rendered.failure())
            ids = tuple(tok.encode(rendered.unwrap(), add_special_tokens=False))
        elif not isinstance(prompt, str):
            if not all(isinstance(t, int) for t in items):
                return Failure(
                    RequestError(
                        "a prompt is text, a sequence of token ids or a sequence "
                        'of chat messages ({"role": ..., "content": ...}), not a '
                        "mix of them"
                    )
                )
            ids = tuple(cast(list[int], items))
        else:
            text = prompt
            if chat:
                rendered = _render(
                    tok, [{"role": "user", "content": prompt}], self.template_args
                )
                if not succeeded(rendered):
                    return Failure(rendered.failure())
                text = rendered.unwrap()
            ids = tuple(tok.encode(text, add_special_tokens=not chat))
        if not ids:
            bos = tok.bos_token_id
            if bos is None:
                return Failure(
                    RequestError(
                        "the prompt is empty and the model has no BOS token; give a prompt"
                    )
                )
            ids = (bos,)
        context = self.target.args.max_position_embeddings
        if len(ids) >= context:
            return Failure(
                RequestError(
                    f"the prompt has {len(ids)} tokens but the model's context is {context}; "
                    "shorten the prompt"
                )
            )
        return Success(ids)

    def score(
        self, prompt: Prompt, top_logprobs: int = 0, chat: bool = False
    ) -> Result[TokenScores, RequestError]:
        """Each token of the encoded prompt scored by the target given the
        tokens before it (`TokenScores`; the first has none), with the
        `top_logprobs` likeliest tokens at each position (at most 20): the
        log-likelihoods an evaluation harness reads through a completion's
        `echo`."""
        if problem := top_logprobs_problem(top_logprobs):
            return Failure(RequestError(problem))
        ids = self.encode(prompt, chat)
        if not succeeded(ids):
            return Failure(ids.failure())
        return Success(score_tokens(self.target.model, ids.unwrap(), top_logprobs))

    def generate_batch(
        self,
        prompts: Sequence[Prompt],
        sampling: SamplingParams | None = None,
        limits: GenerationLimits | None = None,
        chat: bool = False,
        on_text: Callable[[int, str], None] | None = None,
    ) -> Result[list[GenerationResult], RequestError]:
        """Every prompt as one batch of rows; `on_text(row, text)` streams."""
        prepared = self._prepare(prompts, sampling, limits, chat, on_text)
        if not succeeded(prepared):
            return Failure(prepared.failure())
        batch = prepared.unwrap()
        rows = batch.run()
        return Success(batch.results(rows))

    def generate(
        self,
        prompt: Prompt,
        sampling: SamplingParams | None = None,
        limits: GenerationLimits | None = None,
        chat: bool = False,
        on_text: Callable[[str], None] | None = None,
    ) -> Result[GenerationResult, RequestError]:
        callback: Callable[[int, str], None] | None = None
        if on_text is not None:
            sink_text = on_text

            def callback(_row: int, text: str) -> None:
                sink_text(text)

        return self.generate_batch([prompt], sampling, limits, chat, callback).map(
            lambda r: r[0]
        )

    def stream(
        self,
        prompt: Prompt,
        sampling: SamplingParams | None = None,
        limits: GenerationLimits | None = None,
        chat: bool = False,
    ) -> Iterator[str]:
        """Text pieces as they are generated (in the caller's thread: MLX
        streams belong to the thread that made them). Raises ValueError with
        the boundary error's message for a bad request."""
        pieces: list[str] = []
        prepared = self._prepare(
            [prompt], sampling, limits, chat, lambda _row, text: pieces.append(text)
        )
        if not succeeded(prepared):
            raise ValueError(prepared.failure().message)
        batch = prepared.unwrap()
        rounds = batch.stepwise()
        while True:
            try:
                next(rounds)
            except StopIteration as done:
                batch.results(done.value)  # closes the sink: flushes held text
                yield from pieces
                return
            yield from pieces
            pieces.clear()

    def _prepare(
        self,
        prompts: Sequence[Prompt],
        sampling: SamplingParams | None,
        limits: GenerationLimits | None,
        chat: bool,
        on_text: Callable[[int, str], None] | None,
    ) -> Result[_PreparedBatch, RequestError]:
        checked = self._checked(
            sampling or SamplingParams(), limits or GenerationLimits()
        )
        if not succeeded(checked):
            return Failure(checked.failure())
        sampling, limits = checked.unwrap()
        encoded: list[tuple[int, ...]] = []
        for prompt in prompts:
            result = self.encode(prompt, chat)
            if not succeeded(result):
                return Failure(result.failure())
            encoded.append(result.unwrap())
        if not encoded:
            return Failure(RequestError("no prompts given"))
        sinks = [self._sink(limits, _row_text(on_text, i)) for i in range(len(encoded))]
        requests = [
            self._row_request(ids, sampling, limits, sink)
            for ids, sink in zip(encoded, sinks, strict=True)
        ]
        return Success(_PreparedBatch(self, encoded, sinks, requests, self._options()))

    def _checked(
        self, sampling: SamplingParams, limits: GenerationLimits
    ) -> Result[tuple[SamplingParams, GenerationLimits], RequestError]:
        """A request's values as their `create` checks them, and its logit
        bias's ids within the target's vocabulary."""
        checked_sampling = sampling.checked()
        if not succeeded(checked_sampling):
            return Failure(checked_sampling.failure())
        checked_limits = limits.checked()
        if not succeeded(checked_limits):
            return Failure(checked_limits.failure())
        vocab = self.target.args.vocab_size
        outside = [i for i, _ in checked_sampling.unwrap().logit_bias if i >= vocab]
        if outside:
            return Failure(
                RequestError(
                    f"logit bias names token id {outside[0]}, outside the model's "
                    f"vocabulary of {vocab} ids"
                )
            )
        return Success((checked_sampling.unwrap(), checked_limits.unwrap()))

    def _sink(
        self, limits: GenerationLimits, on_text: Callable[[str], None] | None
    ) -> TextSink:
        return TextSink(self.target.tokenizer.detokenizer(), limits.stop, on_text)

    def _row_request(
        self,
        ids: tuple[int, ...],
        sampling: SamplingParams,
        limits: GenerationLimits,
        sink: TextSink,
        on_finish: Callable[[RowResult], None] | None = None,
    ) -> RowRequest:
        """A checked request's row: its budget capped where the prompt plus
        the output would pass the model's context."""
        context = self.target.args.max_position_embeddings
        budget = min(limits.max_tokens, context - len(ids))
        return RowRequest(
            ids,
            sampling,
            budget,
            sink,
            limits.logprobs,
            on_finish=on_finish,
            top_logprobs=limits.top_logprobs,
            max_drafts=limits.num_draft_tokens,
        )

    def _options(self) -> RoundOptions:
        return RoundOptions(
            depth=self.draft.width if self.draft is not None else 0,
            device_round=self.device_round,
            adaptive=self.adaptive if self.draft is not None else None,
            phase_timing=self.phase_timing,
            draft_ahead=self.draft_ahead,
        )

    def _loop(self, options: RoundOptions) -> dict[str, Any]:
        """`generate_rows`'s arguments but the requests (and arrivals)."""
        target, draft = self.target, self.draft
        return {
            "model": target.model,
            "eos_ids": target.tokenizer.eos_token_ids,
            "drafter": draft.drafter if draft is not None else None,
            "options": options,
            "prompt_cache": self.prompt_cache,
        }

    def generate_arriving(self, arrivals: Callable[[], Sequence[Arrival]]) -> None:
        """Continuous batching: `arrivals` is asked for requests before the
        first round and between rounds; they are prefilled and join the live
        rows (each with its own sampling, limits and drafts accepted), and
        each one's `on_done` is told its result as soon as its row ends.
        Returns when no row is live and `arrivals` has none. An arrival
        whose values are bad, or whose prompt is empty or fills the context,
        is told so at once and does not join. Every row's output is the one
        `generate` gives it alone."""
        context = self.target.args.max_position_embeddings

        def admitted() -> list[RowRequest]:
            out = []
            for arrival in arrivals():
                request = self._arriving(arrival, context)
                if not succeeded(request):
                    arrival.on_done(Failure(request.failure()))
                    continue
                out.append(request.unwrap())
            return out

        first = admitted()
        if first:
            generate_rows(
                requests=first, arrivals=admitted, **self._loop(self._options())
            )

    def _arriving(
        self, arrival: Arrival, context: int
    ) -> Result[RowRequest, RequestError]:
        """An arrival's row request, its values checked."""
        checked = self._checked(arrival.sampling, arrival.limits)
        if not succeeded(checked):
            return Failure(checked.failure())
        sampling, limits = checked.unwrap()
        ids = arrival.prompt
        if not ids or len(ids) >= context:
            return Failure(
                RequestError(
                    f"the prompt has {len(ids)} tokens; the model takes 1 to "
                    f"{context - 1} (its context is {context})"
                )
            )
        sink = self._sink(limits, arrival.on_text)

        def finished(row: RowResult) -> None:
            arrival.on_done(Success(self._result(ids, sink, _closed(sink, row))))

        return Success(self._row_request(ids, sampling, limits, sink, finished))

    def _result(
        self, ids: tuple[int, ...], sink: TextSink, row: RowResult
    ) -> GenerationResult:
        m = row.metrics
        generated = len(sink.tokens)
        decode = row.decode_seconds
        stats = GenerationStats(
            tokens_per_second=generated / decode if decode > 0 else 0.0,
            prompt_seconds=row.prompt_seconds,
            decode_seconds=decode,
            rounds=m.rounds,
            drafted=m.drafted,
            accepted=m.accepted,
            acceptance_length=m.acceptance_length,
            draft=self.draft_kind,
            per_position=tuple(m.per_position()),
            ms_per_round=sum(row.round_ms) / len(row.round_ms) if row.round_ms else 0.0,
            draft_errors=tuple(m.draft_errors),
            depths=tuple(sorted((row.depths or {}).items())),
            gated_share=m.gated / m.rounds if m.rounds else 0.0,
            phase_ms=tuple(asdict(row.phase_ms).items()) if row.phase_ms else (),
            cached_tokens=row.cached_tokens,
        )
        return GenerationResult(
            text=sink.text,
            tokens=tuple(sink.tokens),
            prompt_tokens=len(ids),
            generated_tokens=generated,
            finish_reason=row.finish,
            stats=stats,
            logprobs=tuple(sink.logprobs) if sink.logprobs else None,
            error=row.error,
            top_logprobs=tuple(sink.top_logprobs) if sink.top_logprobs else None,
        )


@frozen
class Conversation:
    """A chat whose turns continue each other's token ids.

    Each turn renders the whole conversation by the chat template, as a
    stateless `Pipeline.generate(messages)` does; where that text begins with
    the text of the last turn's prompt and reply (`ids`), the turn's prompt is
    those very ids followed by the encoded rest. A reply's tokens need not be
    the ones its text encodes to, and a checkpoint of a hybrid target's
    recurrent state serves only a prompt that begins with exactly the tokens
    it processed: so a turn keeps the prompt cache's hit whole. Where the
    rendering does not begin with them (a template that rewrites earlier
    turns, e.g. dropping their reasoning), the turn encodes the whole text.
    Turns return a new conversation (`say`); this one is unchanged."""

    opening: tuple[Message, ...] = ()  # e.g. a system message, kept by `reset`
    messages: tuple[Message, ...] = ()  # the turns so far, after the opening
    ids: tuple[int, ...] = ()  # the last turn's prompt and reply tokens

    def reset(self) -> Conversation:
        """The conversation back at its opening."""
        return Conversation(self.opening)

    def say(
        self,
        pipeline: Pipeline,
        content: str,
        sampling: SamplingParams | None = None,
        limits: GenerationLimits | None = None,
        on_text: Callable[[str], None] | None = None,
    ) -> Result[tuple[Conversation, GenerationResult], RequestError]:
        """The reply to a user message, and the conversation with both."""
        said: tuple[Message, ...] = ({"role": "user", "content": content},)
        messages = (*self.opening, *self.messages, *said)
        tok = pipeline.target.tokenizer
        rendered = _render(tok, list(messages), pipeline.template_args)
        if not succeeded(rendered):
            return Failure(rendered.failure())
        ids = self.continued(tok, rendered.unwrap())
        turn = pipeline.generate(list(ids), sampling, limits, on_text=on_text)
        if not succeeded(turn):
            return Failure(turn.failure())
        result = turn.unwrap()
        reply: Message = {"role": "assistant", "content": result.text}
        return Success(
            (
                Conversation(
                    self.opening,
                    (*self.messages, *said, reply),
                    ids + result.tokens,
                ),
                result,
            )
        )

    def continued(self, tokenizer: Any, rendered: str) -> tuple[int, ...]:
        """The prompt ids of the rendered conversation: `ids` and the encoded
        text past theirs, where it begins with their text; else all of it
        encoded."""
        if self.ids:
            before = tokenizer.decode(list(self.ids))
            if before and rendered.startswith(before):
                rest = rendered[len(before) :]
                return self.ids + tuple(
                    tokenizer.encode(rest, add_special_tokens=False) if rest else ()
                )
        return tuple(tokenizer.encode(rendered, add_special_tokens=False))


def _render(
    tokenizer: Any, messages: list[Message], values: Mapping[str, Any]
) -> Result[str, RequestError]:
    """A conversation's prompt text by the model's chat template, with the
    pipeline's more `values` for it."""
    for number, message in enumerate(messages):
        if not isinstance(message.get("role"), str) or not isinstance(
            message.get("content"), str
        ):
            return Failure(
                RequestError(
                    f"chat message {number} needs a 'role' and a 'content' string, "
                    f"got {dict(message)!r}"
                )
            )
    try:
        return Success(
            tokenizer.apply_chat_template([dict(m) for m in messages], **values)
        )
    except ValueError as exc:  # no template (a base model)
        return Failure(
            RequestError(
                f"{exc} (a base model): give the prompt as plain text or token ids, "
                "without chat formatting (no --chat; `specpipe chat` needs a chat model)"
            )
        )
    except jinja2.TemplateError as exc:  # e.g. the template's raise_exception
        return Failure(RequestError(f"the chat template refused the messages: {exc}"))
    except TypeError as exc:  # a value of the wrong type (tools=3)
        if not values:
            raise
        return Failure(
            RequestError(
                f"the chat template cannot use the values given ({', '.join(values)}): {exc}"
            )
        )


def _row_text(
    on_text: Callable[[int, str], None] | None, row: int
) -> Callable[[str], None] | None:
    if on_text is None:
        return None
    report = on_text

    def forward(text: str) -> None:
        report(row, text)

    return forward


# mlx_lm's --kv-bits values and the group sizes MLX quantizes in
KV_BITS = (2, 3, 4, 5, 6, 8)
KV_GROUP_SIZES = (32, 64, 128)


def _quantize_kv(
    target: LoadedModel, quantization: KVQuantization
) -> Result[None, RequestError]:
    """Make the target store its keys and values quantized, or say why its
    caches cannot be."""
    model: Any = target.model
    model.kv_quantization = quantization
    try:
        cache = model.make_cache(1)
    except ValueError as exc:
        return Failure(RequestError(f"--kv-bits: {exc}"))
    kv = cache.kv if isinstance(cache, HybridCache) else cache
    if not isinstance(kv, QuantizedKVCache):
        model.kv_quantization = None
        return Failure(
            RequestError(
                f"--kv-bits is not supported for {target.args.model_type} targets yet "
                "(their attention caches are not quantized); leave it out"
            )
        )
    return Success(None)


def load(
    ref: str | None = None,
    *,
    draft: str | None = None,
    num_draft_tokens: int | None = None,
    dtype: str | None = None,
    ngram_min: int | None = None,
    ngram_max: int | None = None,
    policy: DraftPolicy | None = None,
    device_round: bool = False,
    registry: DraftRegistry | None = None,
    draft_vocab: str | None = None,
    adaptive: bool | CostModel | None = None,
    phase_timing: bool = False,
    draft_dtype: str | None = None,
    draft_ahead: bool | None = None,
    prompt_cache: bool | int = False,
    draft_bits: int | None = None,
    gguf_quantized: bool | None = None,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
) -> Result[Pipeline, SpecpipeError]:
    """Load a target (default: the embedded default model) and, optionally, a
    draft: "none", "ngram", "auto" (a companion the target bundles, else
    ngram), a registered kind name, or any model reference the loader takes.
    `draft_vocab`: an FR-Spec id list (path), "off", or None for the list the
    draft ships as draft_vocab.json. `adaptive` (on by default when drafting):
    choose each row's depth per round, up to the draft width, from measured
    costs, decoding plainly where no depth pays (None or True: the cached
    calibration of this machine, measured on first use; a ready `CostModel`;
    False: every round drafts the full width). `draft_dtype`: a draft model's
    dtype when it differs from the target's (e.g. a bfloat16 draft for a
    float32 target on a CPU, models/cpu_kernel.py); drafts change speed only.
    `draft_ahead`: launch the next round's drafts before a round's host read
    where the drafter can (`RoundOptions.draft_ahead`: an MTP head's rounds;
    None: on a GPU, where it measured faster, not on a CPU, where the launch
    competes with the host for the cores). `prompt_cache`: keep rows' states
    between calls (`Pipeline.with_prompt_cache`; True: a 2 GiB budget, or
    the budget in bytes). `draft_bits`: the bits a DFlash draft's
    projections are quantized to at load (4 or 8, MLX affine; 16: float;
    None: 4 for a DFlash2 draft on a GPU, float on the CPU and for DFlash
    v1: `models.dflash.default_bits`; a checkpoint already quantized loads
    as it is). `gguf_quantized`: a .gguf (or fixture) target keeps its
    Q4_*, Q5_*, Q8_0 and K-type matrices quantized (`specpipe.load.load`), and so
    does a two-model draft that is one (None, the default: they do; True:
    the target must be one; False: both dequantized to float). `kv_bits`:
    the target's attention keys and values are stored quantized to that many
    bits in groups of `kv_group_size` (`models.cache.QuantizedKVCache`;
    mlx_lm's --kv-bits), a fraction of their memory; None: at the model's
    dtype."""
    if draft_bits is not None and (problem := bits_problem(draft_bits)):
        return Failure(RequestError(problem))
    if kv_bits is not None and (
        kv_bits not in KV_BITS or kv_group_size not in KV_GROUP_SIZES
    ):
        return Failure(
            RequestError(
                f"kv-bits must be one of {', '.join(map(str, KV_BITS))} and the "
                f"kv group size one of {', '.join(map(str, KV_GROUP_SIZES))}, got "
                f"{kv_bits} and {kv_group_size}"
            )
        )
    if prompt_cache is not True and prompt_cache is not False and prompt_cache <= 0:
        return Failure(
            RequestError(
                f"a prompt cache needs a positive byte budget, got {prompt_cache}"
            )
        )
    ahead = on_gpu() if draft_ahead is None else draft_ahead
    registry = registry or default_registry()
    if num_draft_tokens is not None and not 1 <= num_draft_tokens <= MAX_DRAFT_TOKENS:
        return Failure(
            RequestError(
                f"num-draft-tokens must be in [1, {MAX_DRAFT_TOKENS}], got "
                f"{num_draft_tokens} (a round verifies that many positions at once)"
            )
        )
    if draft is not None and not draft.strip():
        return Failure(
            RequestError(
                "the draft is empty: give none, ngram, mtp, auto or a draft model "
                "reference"
            )
        )
    draft_temperature = policy.temperature if policy is not None else None
    if draft_temperature is not None and not (
        math.isfinite(draft_temperature) and draft_temperature > 0
    ):
        return Failure(
            RequestError(
                f"draft temperature must be > 0, got {draft_temperature} (leave it "
                "out to draft at the request's own temperature; --greedy-draft for argmax)"
            )
        )
    loaded = load_model(ref, dtype, gguf_quantized)
    if not succeeded(loaded):
        return Failure(loaded.failure())
    target = loaded.unwrap()
    notice_tf32(target.model)
    if kv_bits is not None:
        stored = _quantize_kv(target, KVQuantization(kv_bits, kv_group_size))
        if not succeeded(stored):
            return Failure(stored.failure())
    if draft is None or draft == "none":
        if draft_vocab not in (None, "off"):
            return Failure(
                RequestError(
                    "a draft vocabulary (--draft-vocab) was given without a draft: it "
                    "narrows a draft's projection (--draft mtp, auto or a model); "
                    "drop it or choose a draft"
                )
            )
        if draft_bits is not None:
            return Failure(
                RequestError(
                    "draft bits (--draft-bits) were given without a draft: they set "
                    "a DFlash draft's projection bits; drop them or choose a draft"
                )
            )
        plain = Pipeline(
            target,
            None,
            device_round,
            registry,
            phase_timing=phase_timing,
            draft_ahead=ahead,
        )
        return Success(_cached(plain, prompt_cache))
    request = DraftLoadRequest(
        target=target,
        width=num_draft_tokens,
        ngram_min=ngram_min,
        ngram_max=ngram_max,
        policy=policy or DraftPolicy(),
        draft_vocab=draft_vocab,
        dtype=draft_dtype or dtype,
        draft_bits=draft_bits,
        gguf_quantized=gguf_quantized,
    )
    result = _resolve_draft(registry, draft, target, request)
    if not succeeded(result):
        return Failure(result.failure())
    loaded_draft = result.unwrap()
    policy_adaptive = None
    if isinstance(adaptive, CostModel):
        policy_adaptive = AdaptivePolicy(adaptive)
    elif adaptive is None or adaptive:
        key = (
            dtype
            if draft_dtype in (None, dtype)
            else f"{dtype or 'native'}/draft={draft_dtype}"
        )
        cost = calibrate(target, loaded_draft, key, loaded_draft.width + 1)
        policy_adaptive = AdaptivePolicy(cost)
    pipeline = Pipeline(
        target,
        loaded_draft,
        device_round,
        registry,
        policy_adaptive,
        phase_timing,
        ahead,
    )
    return Success(_cached(pipeline, prompt_cache))


def _cached(pipeline: Pipeline, prompt_cache: bool | int) -> Pipeline:
    """`pipeline` with the prompt cache `load` was asked for, if any."""
    if prompt_cache is False:
        return pipeline
    budget = DEFAULT_MAX_BYTES if prompt_cache is True else prompt_cache
    return pipeline.with_prompt_cache(budget)


def calibrate(
    target: LoadedModel,
    draft: LoadedDraft | None,
    dtype: str | None,
    max_width: int,
    refresh: bool = False,
) -> CostModel:
    """The pipeline's cached cost model (measured on first use): the target's
    windows, and a step of the draft as its kind runs one (a draft model's
    forward, an MTP head's forward and projection, nothing for host-side
    drafts), cached apart per draft kind and source, and per quantization
    of the target (a GGUF loaded kept quantized and dequantized has one
    source)."""
    precision = _precision_key(target, dtype, draft.model if draft else None)
    if draft is None:
        return calibrated(
            target.model,
            None,
            target.source,
            None,
            precision,
            max_width,
            refresh,
        )
    key = getattr(draft.drafter, "calibration_key", None)  # e.g. mtp/vocab=N
    head = getattr(
        draft.drafter, "calibration_head", None
    )  # FR-Spec rows of a draft model
    return calibrated(
        target.model,
        draft.model,
        target.source,
        draft.source,
        precision,
        max_width,
        refresh,
        draft_kind=key if isinstance(key, str) else draft.kind,
        draft_head=head() if callable(head) else None,
    )


def _resolve_draft(
    registry: DraftRegistry, draft: str, target: LoadedModel, request: DraftLoadRequest
) -> Result[LoadedDraft, SpecpipeError]:
    """`draft` names a model-free kind, "auto", a kind the target carries (a
    bundled companion or a native head), an artifact folder, or a model
    reference (a two-model draft)."""
    from attrs import evolve

    entry = registry.get(draft)
    if entry is not None and not entry.artifact:
        return registry.load(draft, request)
    if draft == "auto" or entry is not None:
        bundled = registry.companion(target.folder)
        if bundled is not None and (draft == "auto" or bundled[0] == draft):
            kind, folder = bundled
            return registry.load(kind, evolve(request, source=str(folder)))
        graph = _graph(target)
        if graph.native_draft is not None and draft in (
            "auto",
            graph.native_draft.kind,
        ):
            native = registry.native(graph, request)
            assert native is not None
            return native
        if draft == "auto":
            return registry.load("ngram", request)
    path = Path(draft).expanduser()
    if path.is_dir():
        kind_result = registry.detect(path)
        if not succeeded(kind_result):
            return Failure(kind_result.failure())
        return registry.load(kind_result.unwrap(), evolve(request, source=str(path)))
    if entry is not None:
        return Failure(
            LoadError(
                f"draft kind {draft!r}: the target bundles no {draft}/ companion and "
                "carries no such head; pass the artifact folder"
            )
        )
    return registry.load("two-model", evolve(request, source=draft))


def _graph(target: LoadedModel) -> GraphCapabilities:
    native = NativeDraft("mtp", 2) if target.mtp else None
    return GraphCapabilities.for_decoder(target.args, native)


def _precision_key(
    target: LoadedModel, dtype: str | None, draft: object | None = None
) -> str:
    """The calibration cache's dtype key, with the target's quantization and
    a draft model's (every form of quantized layer, with its count: a GGUF
    whose Q6_K layers are kept costs other than one whose Q6_K layers are
    float, with the same most common form)."""
    key = dtype or "native"
    for prefix, model in (("", target.model), ("draft:", draft)):
        forms = _quantized_forms(model)
        if forms:
            key += f"/{prefix}{forms}"
    return key


def _quantized_forms(model: object) -> str:
    """A model's quantized layers as `q<bits>g<group>x<count>` forms ('' when
    it holds none)."""
    if not isinstance(model, nn.Module):
        return ""
    counts = Counter((bits, group) for group, bits in quantized_forms(model).values())
    return ",".join(f"q{b}g{g}x{n}" for (b, g), n in sorted(counts.items()))
