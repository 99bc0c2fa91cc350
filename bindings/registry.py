"""The draft-provider registry: each kind owns how its artifact is recognised
(files only, never MLX) and how it is loaded.

Kinds are asked in registration order; a `fallback` kind is asked only after
every other declined, so a kind registered later is still detected ahead of
it. Model-free kinds (no artifact) are chosen by name only. Native kinds bind
to targets whose graph declares a draft head. Registries are immutable:
`register` returns a new one.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attrs import field, frozen
from returns.result import Failure, Result, Success

from bindings.capabilities import GraphCapabilities
from schemas.errors import BindingError

if TYPE_CHECKING:
    from specpipe.draft import Drafter
from schemas.request import DraftPolicy


class DraftArtifact:
    """A draft artifact folder, its config read lazily and at most once."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def has(self, name: str) -> bool:
        return (self.folder / name).exists()

    @cached_property
    def config(self) -> dict[str, Any] | None:
        try:
            value = json.loads((self.folder / "config.json").read_text())
        except (OSError, json.JSONDecodeError):
            return None
        return value if isinstance(value, dict) else None


@frozen(kw_only=True)
class DraftLoadRequest:
    target: (
        Any  # specpipe.load.LoadedModel (kept loose: bindings never import MLX models)
    )
    source: str | None = None  # the artifact reference; None for model-free kinds
    width: int | None = None
    ngram_min: int | None = None
    ngram_max: int | None = None
    policy: DraftPolicy = field(factory=DraftPolicy)
    # FR-Spec list: None = the companion's draft_vocab.json if any, "off", or a path
    draft_vocab: str | None = None
    dtype: str | None = None  # the pipeline's dtype, for drafts that load a model
    # the bits a draft's projections are quantized to at load (4, 8; 16:
    # float); None: its kind's default. Only kinds that `quantizes` take it
    draft_bits: int | None = None
    # whether a two-model draft that is a .gguf or a fixture keeps its
    # llama.cpp blocks quantized (`specpipe.load.load`'s `gguf_quantized`;
    # None: it does)
    gguf_quantized: bool | None = None


@frozen
class LoadedDraft:
    drafter: Drafter
    width: int
    kind: str
    # what a draft step runs, for calibration: a draft model, or a draft that
    # times its own step (`specpipe.calibrate.DraftStep`: an MTP head); None
    # for model-free (host-side) drafts, whose steps count as free
    model: Any = None
    source: str | None = None


@frozen(kw_only=True)
class DraftKind:
    kind: str
    artifact: bool
    default_width: int
    load: Callable[[DraftLoadRequest], Result[LoadedDraft, BindingError]]
    detect: Callable[[DraftArtifact], bool] | None = None
    fallback: bool = False
    bundled_companion: str | None = None  # subfolder of a target that bundles it
    quantizes: bool = False  # whether its loader takes `draft_bits`


@frozen
class NativeDraftKind:
    """Binds to a target whose graph declares a draft head of this kind."""

    kind: str
    create: Callable[[Any, DraftLoadRequest], Result[LoadedDraft, BindingError]]


@frozen
class DraftRegistry:
    kinds: tuple[DraftKind, ...] = ()
    natives: tuple[NativeDraftKind, ...] = ()

    def register(self, kind: DraftKind) -> DraftRegistry:
        if any(k.kind == kind.kind for k in self.kinds):
            raise ValueError(f"draft kind {kind.kind} is already registered")
        return DraftRegistry((*self.kinds, kind), self.natives)

    def register_native(self, kind: NativeDraftKind) -> DraftRegistry:
        if any(k.kind == kind.kind for k in self.natives):
            raise ValueError(f"native draft kind {kind.kind} is already registered")
        return DraftRegistry(self.kinds, (*self.natives, kind))

    def names(self) -> tuple[str, ...]:
        return tuple(k.kind for k in self.kinds)

    def get(self, kind: str) -> DraftKind | None:
        return next((k for k in self.kinds if k.kind == kind), None)

    def detect(self, folder: Path) -> Result[str, BindingError]:
        artifact = DraftArtifact(folder)
        asked = [k for k in self.kinds if k.detect is not None]
        for k in [
            *(k for k in asked if not k.fallback),
            *(k for k in asked if k.fallback),
        ]:
            assert k.detect is not None
            if k.detect(artifact):
                return Success(k.kind)
        return Failure(
            BindingError(f"{folder}: no registered draft kind recognises this artifact")
        )

    def load(
        self, kind: str, request: DraftLoadRequest
    ) -> Result[LoadedDraft, BindingError]:
        entry = self.get(kind)
        if entry is None:
            return Failure(
                BindingError(
                    f"unknown draft kind {kind!r} (registered: {', '.join(self.names())})"
                )
            )
        if request.draft_bits is not None and not entry.quantizes:
            return Failure(_bits_refused(kind))
        return entry.load(request)

    def companion(self, target_folder: Path | None) -> tuple[str, Path] | None:
        """A kind whose companion the target folder bundles, if any."""
        if target_folder is None:
            return None
        for k in self.kinds:
            if k.bundled_companion and (target_folder / k.bundled_companion).is_dir():
                return k.kind, target_folder / k.bundled_companion
        return None

    def native(
        self, graph: GraphCapabilities, request: DraftLoadRequest
    ) -> Result[LoadedDraft, BindingError] | None:
        """The draft the graph declares it carries, or None when it declares none."""
        declared = graph.native_draft
        if declared is None:
            return None
        entry = next((k for k in self.natives if k.kind == declared.kind), None)
        if entry is None:
            return Failure(
                BindingError(
                    f"the graph declares native draft {declared.kind}, "
                    "which no kind is registered for"
                )
            )
        if request.draft_bits is not None:
            return Failure(_bits_refused(f"native {declared.kind}"))
        return entry.create(request.target, request)


def _bits_refused(kind: str) -> BindingError:
    return BindingError(
        f"draft bits (--draft-bits) quantize a DFlash draft's projections at "
        f"load; a {kind} draft takes none: drop the option or choose such a draft"
    )
