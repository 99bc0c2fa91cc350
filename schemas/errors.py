"""Error records returned through `Result` at the library's boundaries.

Each error names the problem and the fix in `message`; the CLI prints it as is
(no traceback) and exits with a non-zero code.
"""

from __future__ import annotations

from attrs import frozen


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
