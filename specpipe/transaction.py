"""Prepared changes: state transitions that are applied all-or-nothing.

A participant (the target, a drafter) turns a round's outcome into a
`Prepared[T]`: a value whose `commit()` returns the participant's next state
and whose `dispose()` releases what was staged. Each is used exactly once.
`apply_all` prepares every participant first; only when all prepared does it
commit any, and on a failure while preparing it disposes those already
prepared, so every participant keeps the state it had.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

from attrs import define, field

T = TypeVar("T")


class SpentChange(RuntimeError):
    """A prepared change was used twice."""


@define
class Prepared(Generic[T]):
    _apply: Callable[[], T]
    _release: Callable[[], None] = field(default=lambda: None)
    _spent: bool = field(default=False, init=False)

    def commit(self) -> T:
        self._use()
        return self._apply()

    def dispose(self) -> None:
        self._use()
        self._release()

    @property
    def spent(self) -> bool:
        return self._spent

    def _use(self) -> None:
        if self._spent:
            raise SpentChange("a prepared change was already committed or disposed")
        self._spent = True


def ready(value: T) -> Prepared[T]:
    """A change that stages nothing: committing yields `value`."""
    return Prepared(lambda: value)


def apply_all(preparers: Sequence[Callable[[], Prepared[Any]]]) -> list[Any]:
    """Prepare every change, then commit all; on a failure dispose the prepared
    ones and re-raise, leaving every participant's state as it was."""
    prepared: list[Prepared[Any]] = []
    try:
        for prepare in preparers:
            prepared.append(prepare())
    except BaseException:
        for change in prepared:
            change.dispose()
        raise
    return [change.commit() for change in prepared]
