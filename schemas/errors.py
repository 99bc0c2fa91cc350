"""Error records returned through `Result` at the library's boundaries.

Each error names the problem and the fix in `message`; the CLI prints it as is
(no traceback) and exits with a non-zero code.
"""

from __future__ import annotations

from typing import TypeVar

from attrs import frozen
from returns.result import Result, Success
from typing_extensions import TypeIs

_T = TypeVar("_T")
_E = TypeVar("_E")


def succeeded(result: Result[_T, _E]) -> TypeIs[Success[_T]]:
    """Whether `result` holds a value. Unlike `isinstance(result, Success)`,
    which narrows to `Success[Any]` (whose `unwrap()` mypy cannot check),
    this keeps the value's type where it holds one, and the error's
    (`result.failure()`) where it does not."""
    return isinstance(result, Success)


@frozen
class SpecpipeError:
    """Base of every boundary error: a message a person can act on."""

    message: str

    def __str__(self) -> str:
        return self.message


@frozen
class ConfigError(SpecpipeError):
    """A config file is missing keys, has wrong types, or names an unknown model."""


@frozen
class LoadError(SpecpipeError):
    """A model reference cannot be resolved or its files are missing/corrupt."""


@frozen
class RequestError(SpecpipeError):
    """A generation request is invalid (sampling values, budget, context)."""


@frozen
class BindingError(SpecpipeError):
    """A draft cannot be bound to a target (vocabulary, tokenizer, state)."""


class SpecpipeException(Exception):
    """Carries an error record across code that cannot return a `Result`."""

    def __init__(self, error: SpecpipeError) -> None:
        super().__init__(error.message)
        self.error = error
