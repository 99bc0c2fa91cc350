"""Records for generation requests: sampling parameters and per-request limits.

Named constructors validate and return `Result`; the records themselves are
plain frozen values, so one built directly is checked where it is used
(`checked`: the pipeline's entry points refuse it as `create` would).
"""

from __future__ import annotations

import math

from attrs import asdict, evolve, frozen
from returns.result import Failure, Result, Success

from schemas.errors import RequestError


@frozen(kw_only=True)
class SamplingParams:
    """How the target picks each token. temperature 0 means greedy (argmax).

    Filters apply in this order: logit bias, repetition penalty, presence
    penalty, frequency penalty, temperature, top-k, top-p, min-p. Every
    random draw uses the step key of (seed, step).

    `logit_bias` adds a value to given token ids' logits, (id, value) pairs
    in ascending id order (OpenAI's `logit_bias`; -100 all but bans a token).

    The three penalties read the last `*_context` tokens before the one
    drawn (prompt included), as mlx-lm's logits processors do: the
    repetition penalty divides a positive logit of a token among them by
    `repetition_penalty` (multiplies a negative one), the presence penalty
    subtracts `presence_penalty` once from each such token's logit, the
    frequency penalty subtracts `frequency_penalty` per occurrence (OpenAI's
    additive penalties, over a window instead of the whole text).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    repetition_context: int = 20
    presence_penalty: float = 0.0
    presence_context: int = 20
    frequency_penalty: float = 0.0
    frequency_context: int = 20
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def argmax_only(self) -> bool:
        """Whether a token is the argmax of the raw logits (greedy, nothing
        added to them)."""
        return self.greedy and not self.needs_history and not self.logit_bias

    @property
    def needs_history(self) -> bool:
        """Whether a penalty reads the token history."""
        return bool(self.history_windows)

    @property
    def history_windows(self) -> tuple[tuple[str, float, int], ...]:
        """The penalties that are on, in the order they apply, each as
        (kind, value, context)."""
        on = (
            ("repetition", self.repetition_penalty, self.repetition_context, 1.0),
            ("presence", self.presence_penalty, self.presence_context, 0.0),
            ("frequency", self.frequency_penalty, self.frequency_context, 0.0),
        )
        return tuple((kind, v, c) for kind, v, c, off in on if v != off)

    @property
    def history_context(self) -> int:
        """How many past tokens the penalties that are on read (0: none)."""
        return max((c for _, _, c in self.history_windows), default=0)

    def checked(self) -> Result[SamplingParams, RequestError]:
        """This record, or `create`'s error for its values (a record built
        directly skips `create`'s checks)."""
        return SamplingParams.create(**asdict(self))

    @classmethod
    def create(
        cls,
        *,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        repetition_context: int = 20,
        presence_penalty: float = 0.0,
        presence_context: int = 20,
        frequency_penalty: float = 0.0,
        frequency_context: int = 20,
        logit_bias: tuple[tuple[int, float], ...] = (),
        seed: int = 0,
    ) -> Result[SamplingParams, RequestError]:
        problems: list[str] = []
        if not math.isfinite(temperature) or temperature < 0:
            problems.append(f"temperature must be >= 0 (0 = greedy), got {temperature}")
        if not (0.0 < top_p <= 1.0) or math.isnan(top_p):
            problems.append(f"top-p must be in (0, 1] (1 = off), got {top_p}")
        if top_k < 0:
            problems.append(f"top-k must be >= 0 (0 = off), got {top_k}")
        if not (0.0 <= min_p < 1.0) or math.isnan(min_p):
            problems.append(f"min-p must be in [0, 1) (0 = off), got {min_p}")
        if not math.isfinite(repetition_penalty) or repetition_penalty <= 0:
            problems.append(
                f"repetition penalty must be > 0 (1 = off), got {repetition_penalty}"
            )
        for kind, penalty in (
            ("presence", presence_penalty),
            ("frequency", frequency_penalty),
        ):
            if not math.isfinite(penalty):
                problems.append(
                    f"{kind} penalty must be a finite number (0 = off), got {penalty}"
                )
        for kind, context in (
            ("repetition", repetition_context),
            ("presence", presence_context),
            ("frequency", frequency_context),
        ):
            if context < 1:
                problems.append(f"{kind} context must be >= 1 token, got {context}")
        bias = tuple(sorted((int(i), float(v)) for i, v in logit_bias))
        if any(i < 0 for i, _ in bias):
            problems.append(f"logit bias token ids must be >= 0, got {bias}")
        if any(not math.isfinite(v) for _, v in bias):
            problems.append(
                "logit bias values must be finite numbers (-100 all but bans a token)"
            )
        if len({i for i, _ in bias}) < len(bias):
            problems.append("logit bias names a token id twice")
        if not (0 <= seed < 2**32):
            problems.append(f"seed must be in [0, 2**32), got {seed}")
        if problems:
            return Failure(RequestError("; ".join(problems)))
        return Success(
            cls(
                temperature=float(temperature),
                top_p=float(top_p),
                top_k=int(top_k),
                min_p=float(min_p),
                repetition_penalty=float(repetition_penalty),
                repetition_context=int(repetition_context),
                presence_penalty=float(presence_penalty),
                presence_context=int(presence_context),
                frequency_penalty=float(frequency_penalty),
                frequency_context=int(frequency_context),
                logit_bias=bias,
                seed=int(seed),
            )
        )


def logit_bias_entries(
    value: object,
) -> Result[tuple[tuple[int, float], ...], RequestError]:
    """OpenAI's `logit_bias` object, `{"token id": bias, ...}` (ids as text,
    as JSON keys are), as `SamplingParams.logit_bias` pairs."""
    if not isinstance(value, dict):
        return Failure(
            RequestError(
                f"logit bias must be an object of token ids and values, e.g. "
                f'{{"50256": -100}}, got {value!r}'
            )
        )
    pairs: list[tuple[int, float]] = []
    for key, bias in value.items():
        text = str(key).strip()
        if not text.lstrip("-").isdigit():
            return Failure(
                RequestError(f"logit bias keys must be token ids, got {key!r}")
            )
        if isinstance(bias, bool) or not isinstance(bias, int | float):
            return Failure(
                RequestError(
                    f"logit bias for token {text} must be a number, got {bias!r}"
                )
            )
        pairs.append((int(text), float(bias)))
    return Success(tuple(pairs))


# the most alternatives a position reports (OpenAI's limit for top_logprobs)
MAX_TOP_LOGPROBS = 20


def top_logprobs_problem(count: int) -> str | None:
    """What is wrong with a count of alternatives a position, or None."""
    if 0 <= count <= MAX_TOP_LOGPROBS:
        return None
    return f"top-logprobs must be in [0, {MAX_TOP_LOGPROBS}] (0 = off), got {count}"


@frozen(kw_only=True)
class GenerationLimits:
    """How long a row runs, where it stops, and what it reports besides its
    tokens: `logprobs`, each token's log-probability by the target; and
    `top_logprobs`, each position's k most likely tokens with theirs (which
    reports the chosen tokens' too). `num_draft_tokens` caps the drafts a
    round of this request's row (0: none; None: the pipeline's width, which
    also caps it); the output does not depend on it."""

    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    num_draft_tokens: int | None = None

    def checked(self) -> Result[GenerationLimits, RequestError]:
        """This record, or `create`'s error for its values."""
        return GenerationLimits.create(**asdict(self))

    @classmethod
    def create(
        cls,
        *,
        max_tokens: int = 256,
        stop: tuple[str, ...] = (),
        logprobs: bool = False,
        top_logprobs: int = 0,
        num_draft_tokens: int | None = None,
    ) -> Result[GenerationLimits, RequestError]:
        if max_tokens <= 0:
            return Failure(
                RequestError(f"max-tokens must be a positive number, got {max_tokens}")
            )
        if any(s == "" for s in stop):
            return Failure(RequestError("stop strings must not be empty"))
        if problem := top_logprobs_problem(top_logprobs):
            return Failure(RequestError(problem))
        if num_draft_tokens is not None and num_draft_tokens < 0:
            return Failure(
                RequestError(
                    f"num-draft-tokens must be >= 0 (0 = no drafts), got {num_draft_tokens}"
                )
            )
        return Success(
            cls(
                max_tokens=max_tokens,
                stop=tuple(stop),
                logprobs=logprobs,
                top_logprobs=top_logprobs,
                num_draft_tokens=num_draft_tokens,
            )
        )


@frozen
class DraftPolicy:
    """How a drafter samples its proposals.

    Verification is exact token match and the target samples its own token
    with the step key of each position, independent of the draft, so no policy
    can change the output; it changes only how often drafts are accepted and
    what they cost. The default draws each draft with the request's own sampler
    and the step key of the position it predicts (a coupled draw). Every option
    is off by default: `greedy` drafts argmax (drops the coupling at
    temperature > 0), `temperature` samples the draft at its own temperature,
    `drop_filters` drops top-k / top-p / min-p from the draft (cheaper, rarely
    different at low temperature). The draft never applies the repetition,
    presence or frequency penalties (they would need the token history on the
    device for every step) nor the logit bias (a reduced draft vocabulary
    has other ids).

    `staged` (draft models): each draft forward also checks prompt-lookup
    guesses, so one forward may yield several drafts (the same ones; see
    specpipe/drafts/two_model.py). None, the default, stages on a CPU, where
    it measured 1.18-1.25x faster on an edit prompt and within the noise on
    code and chat (bench/RESULTS.md), and not on a GPU, where the unstaged
    chain runs as one lazy graph without host reads.

    `compiled` (MTP heads): each draft step runs as one compiled function
    (specpipe/drafts/mtp.py, the same drafts). None, the default, compiles on
    a GPU, where draft chains measured 7-22 % faster on an H200 (its first use
    on a machine builds the fused kernels once), and not on the CPU, whose
    bf16 products run eagerly in specpipe's own kernel.
    """

    greedy: bool = False
    temperature: float | None = None
    drop_filters: bool = False
    staged: bool | None = None
    compiled: bool | None = None

    def stages(self, on_gpu: bool) -> bool:
        """Whether a draft model stages its forwards on this device."""
        return (not on_gpu) if self.staged is None else self.staged

    def compiles(self, on_gpu: bool) -> bool:
        """Whether an MTP head drafts through compiled steps on this device."""
        return on_gpu if self.compiled is None else self.compiled

    def draft_params(self, params: SamplingParams) -> SamplingParams:
        out = evolve(
            params,
            repetition_penalty=1.0,
            presence_penalty=0.0,
            frequency_penalty=0.0,
            logit_bias=(),
        )
        if self.greedy:
            return evolve(out, temperature=0.0)
        if self.temperature is not None:
            out = evolve(out, temperature=self.temperature)
        if self.drop_filters:
            out = evolve(out, top_p=1.0, top_k=0, min_p=0.0)
        return out
