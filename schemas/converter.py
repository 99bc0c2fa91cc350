"""The cattrs converters: `strict` for our own files, `hf` for upstream configs.

`strict` forbids extra keys (a typo in a pipeline file is an error); `hf`
ignores them (upstream configs carry many keys we never read). Every failure
becomes a `ConfigError` naming the offending paths.
"""

from __future__ import annotations

from typing import Any, TypeVar

import cattrs
from cattrs.errors import ClassValidationError
from returns.result import Failure, Result, Success

from schemas.errors import ConfigError

T = TypeVar("T")

strict = cattrs.Converter(forbid_extra_keys=True)
hf = cattrs.Converter(forbid_extra_keys=False)


def _describe(exc: Exception) -> str:
    if isinstance(exc, ClassValidationError):
        return "; ".join(cattrs.transform_error(exc))
    return str(exc)


def structure(
    converter: cattrs.Converter, data: Any, cls: type[T], what: str
) -> Result[T, ConfigError]:
    """Structure `data` into `cls`, or a `ConfigError` that says where and why."""
    try:
        return Success(converter.structure(data, cls))
    except (ClassValidationError, ValueError, TypeError, KeyError) as exc:
        return Failure(ConfigError(f"{what}: {_describe(exc)}"))


def unstructure(converter: cattrs.Converter, value: object) -> Any:
    return converter.unstructure(value)
