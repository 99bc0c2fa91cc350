"""Output delivery: verified tokens reach each row's consumer one at a time.

Publishing token by token keeps a consumer's contract: it may stop inside a
burst of accepted drafts, and what it saw is exactly what plain decoding would
have streamed. A consumer that raises fails only its own row; a cancelled row
stops before its next token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal, Protocol

from attrs import define, field, frozen

from specpipe.walk import Acceptance

FinishReason = Literal["stop", "length", "cancelled", "failed"]

# A position's most likely tokens by the model, most likely first: (id, logprob).
TopLogprobs = tuple[tuple[int, float], ...]


class TokenSink(Protocol):
    def push(self, token: int, logprob: float | None, top: TopLogprobs = ()) -> bool:
        """Take one published token (with its log-probability and the
        position's top alternatives where the row asked for them); return
        False to stop the row."""
        ...


@frozen
class Delivered:
    published: int
    finish: FinishReason | None  # None: the row continues
    error: str | None = None


def deliver(
    acceptance: Acceptance,
    sink: TokenSink,
    logprobs: Sequence[float] | None,
    cancelled: Callable[[], bool] | None = None,
    tops: Sequence[TopLogprobs] | None = None,
) -> Delivered:
    published = 0
    try:
        for token in acceptance.emitted:
            if cancelled is not None and cancelled():
                return Delivered(published, "cancelled")
            more = sink.push(
                token,
                logprobs[published] if logprobs is not None else None,
                tops[published] if tops is not None else (),
            )
            published += 1
            if not more:
                return Delivered(published, "stop")
    except Exception as exc:
        return Delivered(published, "failed", f"{type(exc).__name__}: {exc}")
    if acceptance.finish == "continue":
        return Delivered(published, None)
    return Delivered(published, acceptance.finish)


class Detokenizer(Protocol):
    def add(self, token: int) -> str: ...

    def finish(self) -> str: ...


@define
class TextSink:
    """Collects tokens and text; ends the row at a stop string (which is cut).

    Text goes to `on_text` as soon as no stop string can still begin in it.
    """

    detokenizer: Detokenizer
    stop: tuple[str, ...] = ()
    on_text: Callable[[str], None] | None = None
    tokens: list[int] = field(factory=list)
    logprobs: list[float] = field(factory=list)
    top_logprobs: list[TopLogprobs] = field(factory=list)
    text: str = ""
    _sent: int = 0
    stopped: bool = False

    def push(self, token: int, logprob: float | None, top: TopLogprobs = ()) -> bool:
        self.tokens.append(token)
        if logprob is not None:
            self.logprobs.append(logprob)
        if top:
            self.top_logprobs.append(top)
        before = len(self.text)
        self.text += self.detokenizer.add(token)
        if self.stop:
            # a stop string can only complete in the text this token added
            hit = min(
                (
                    i
                    for s in self.stop
                    if (i := self.text.find(s, max(0, before - len(s) + 1))) >= 0
                ),
                default=-1,
            )
            if hit >= 0:
                self.text = self.text[:hit]
                self.stopped = True
                self._emit(len(self.text))
                return False
            hold = max(len(s) for s in self.stop) - 1
            self._emit(max(self._sent, len(self.text) - hold))
        else:
            self._emit(len(self.text))
        return True

    def close(self) -> None:
        if not self.stopped:
            self.text += self.detokenizer.finish()
        self._emit(len(self.text))

    def _emit(self, upto: int) -> None:
        if upto > self._sent:
            if self.on_text is not None:
                self.on_text(self.text[self._sent : upto])
            self._sent = upto
