"""Row state: where each request stands in its token stream.

A row's `tokens` hold the prompt and every generated token; all but the last
have been processed into the target's state, the last is the *pending* token.
Everything else (processed length, pending token) is derived, so a committed
row is one immutable value.
"""

from __future__ import annotations

from attrs import evolve, frozen

from schemas.request import SamplingParams


@frozen
class RowState:
    tokens: tuple[int, ...]
    prompt_len: int
    step: int  # index of the next generated token (its step key)
    remaining: int  # generated tokens still allowed
    sampling: SamplingParams

    @property
    def pending(self) -> int:
        return self.tokens[-1]

    @property
    def length(self) -> int:
        """Tokens processed into the target's state."""
        return len(self.tokens) - 1

    def advanced(self, emitted: tuple[int, ...]) -> RowState:
        """The row after `emitted` were published and all but the last processed."""
        return evolve(
            self,
            tokens=self.tokens + emitted,
            step=self.step + len(emitted),
            remaining=self.remaining - len(emitted),
        )

    @classmethod
    def start(
        cls, prompt: tuple[int, ...], max_tokens: int, sampling: SamplingParams
    ) -> RowState:
        return cls(
            tokens=prompt,
            prompt_len=len(prompt),
            step=0,
            remaining=max_tokens,
            sampling=sampling,
        )
