"""Frequency-ranked draft vocabulary (FR-Spec, Zhao et al. 2025,
https://arxiv.org/abs/2502.14856).

A drafter spends much of each step in the vocabulary projection. Drafts only
need to be likely tokens, so the draft projects onto the N most frequent rows
of the head. The target still verifies and samples over the full vocabulary,
so the output is unchanged; a token outside the list simply cannot be drafted.

Coupling is kept. The draw is an inverse CDF in token-id order from one
uniform of the step key (specpipe/sampling.py); the list is kept in ascending
id order, so a draw over the listed rows IS the full-vocabulary draw with zero
mass outside the list: same uniform, same order, same token.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol

import mlx.core as mx
from attrs import frozen
from returns.result import Failure, Result, Success

from models.vocab_head import HeadWeights
from schemas.errors import ConfigError

DRAFT_VOCAB_FILE = "draft_vocab.json"


@frozen
class DraftVocabulary:
    ids: tuple[int, ...]  # ascending, unique, all < the target's vocabulary size

    @property
    def size(self) -> int:
        return len(self.ids)

    def array(self) -> mx.array:  # [N] int32
        return mx.array(list(self.ids), dtype=mx.int32)

    @classmethod
    def create(
        cls, ids: Sequence[int], vocab_size: int, where: str = "draft vocabulary"
    ) -> Result[DraftVocabulary, ConfigError]:
        values = list(ids)
        if not values:
            return Failure(ConfigError(f"{where}: the id list is empty"))
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in values):
            return Failure(ConfigError(f"{where}: ids must be integers"))
        outside = [i for i in values if not 0 <= i < vocab_size]
        if outside:
            return Failure(
                ConfigError(
                    f"{where}: ids {outside[:5]} are outside the vocabulary [0, {vocab_size})"
                )
            )
        if len(set(values)) != len(values):
            dupes = sorted(i for i, n in Counter(values).items() if n > 1)
            return Failure(ConfigError(f"{where}: duplicated ids {dupes[:5]}"))
        if values != sorted(values):
            return Failure(
                ConfigError(
                    f"{where}: ids must be in ascending order (the coupled draw needs token-id order)"
                )
            )
        return Success(cls(tuple(values)))

    @classmethod
    def read(cls, path: Path, vocab_size: int) -> Result[DraftVocabulary, ConfigError]:
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            return Failure(
                ConfigError(f"{path}: cannot read the draft vocabulary ({exc})")
            )
        if (
            not isinstance(data, dict)
            or set(data) != {"ids"}
            or not isinstance(data["ids"], list)
        ):
            return Failure(ConfigError(f'{path}: expected exactly {{"ids": [...]}}'))
        return cls.create(data["ids"], vocab_size, str(path))

    def write(self, path: Path) -> Result[Path, ConfigError]:
        """The list as `{"ids": [...]}` at `path`, whole or not at all (a
        staging file beside it, moved into place; removed on failure)."""
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps({"ids": list(self.ids)}))
            os.replace(tmp, path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            return Failure(
                ConfigError(
                    f"{path}: cannot write the draft vocabulary ({exc.strerror or exc}); "
                    "give a writable file path (its folder must exist)"
                )
            )
        return Success(path)

    @classmethod
    def from_counts(
        cls,
        counts: Counter[int],
        size: int,
        vocab_size: int,
        always: Iterable[int] = (),
    ) -> Result[DraftVocabulary, ConfigError]:
        """The `size` most frequent ids (ties by id), plus `always` (e.g. EOS)."""
        if size <= 0:
            return Failure(
                ConfigError(f"the draft vocabulary size must be >= 1, got {size}")
            )
        keep = set(always)
        ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
        for token, _ in ranked:
            if len(keep) >= size:
                break
            keep.add(token)
        return cls.create(sorted(keep), vocab_size)


class HasHead(Protocol):
    def head_weights(self) -> HeadWeights: ...


@frozen
class SubsetHead:
    """A draft head over the listed ids only: the projection's rows at them."""

    ids: mx.array  # [N] int32, ascending
    weights: HeadWeights  # the head's rows at `ids`

    @classmethod
    def of(cls, model: HasHead, vocab: DraftVocabulary) -> SubsetHead:
        ids = vocab.array()
        weights = model.head_weights().take(ids)
        # gathered now, not inside a draft step (a 30k-row gather from a
        # 150k-row head takes as long as a few draft steps)
        mx.eval(ids, weights.weight, weights.scales, weights.biases)
        return cls(ids, weights)

    def project(self, normed: mx.array) -> mx.array:  # [..., H] -> [..., N]
        """Logits over the listed ids of an already normed hidden state."""
        return self.weights.project(normed)


def configured(
    setting: str | None, vocab_size: int, companion: Path | None
) -> Result[DraftVocabulary | None, ConfigError]:
    """The draft vocabulary to use. `setting`: None (use the list shipped as
    `draft_vocab.json` beside the companion, if any), "off", or a path."""
    if setting == "off":
        return Success(None)
    path = Path(setting) if setting else None
    if (
        path is None
        and companion is not None
        and (companion / DRAFT_VOCAB_FILE).is_file()
    ):
        path = companion / DRAFT_VOCAB_FILE
    if path is None:
        return Success(None)
    return DraftVocabulary.read(path, vocab_size)
