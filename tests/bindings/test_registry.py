"""The draft-kind registry (detect, load, natives, companions) and `bind`, the
pure check of a draft kind's needs against a target graph's capabilities."""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from returns.result import Failure, Result, Success

from bindings.capabilities import (
    Binding,
    DraftNeeds,
    GraphCapabilities,
    LayerCapability,
    NativeDraft,
    bind,
)
from bindings.kinds import NGRAM, PROBE, TWO_MODEL, default_registry
from bindings.registry import (
    DraftArtifact,
    DraftKind,
    DraftLoadRequest,
    DraftRegistry,
    LoadedDraft,
    NativeDraftKind,
)
from schemas.converter import hf, structure
from schemas.errors import BindingError
from schemas.hf import DecoderArgs, normalize_hf_config

# --- helpers ----------------------------------------------------------------------


def _args(**overrides: Any) -> DecoderArgs:
    cfg = {
        "model_type": "qwen2",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 97,
        **overrides,
    }
    return structure(hf, normalize_hf_config(cfg), DecoderArgs, "test").unwrap()


def _loaded() -> LoadedDraft:
    return LoadedDraft(drafter=SimpleNamespace(kind="x"), width=1, kind="x")  # type: ignore[arg-type]


def _kind(
    name: str,
    detect: Callable[[DraftArtifact], bool] | None,
    fallback: bool = False,
    **kw: Any,
) -> DraftKind:
    def load(request: DraftLoadRequest) -> Result[LoadedDraft, BindingError]:
        return Success(LoadedDraft(SimpleNamespace(kind=name), 1, name))  # type: ignore[arg-type]

    return DraftKind(
        kind=name,
        artifact=detect is not None,
        default_width=2,
        load=load,
        detect=detect,
        fallback=fallback,
        **kw,
    )


def _has(name: str) -> Callable[[DraftArtifact], bool]:
    return lambda artifact: artifact.has(name)


def _model_type(value: str) -> Callable[[DraftArtifact], bool]:
    return lambda artifact: (artifact.config or {}).get("model_type") == value


def _graph(**overrides: Any) -> GraphCapabilities:
    base: dict[str, Any] = {
        "model_type": "qwen2",
        "vocab_size": 1000,
        "hidden_size": 64,
        "layers": (LayerCapability("attention", "position_overwrite"),) * 4,
        "tap_layers": (0, 1, 2, 3),
    }
    return GraphCapabilities(**{**base, **overrides})


def _message(result: Result[Any, BindingError]) -> str:
    assert isinstance(result, Failure), result
    error = result.failure()
    assert isinstance(error, BindingError)
    return error.message


# --- detect ---------------------------------------------------------------------------


def test_detect_asks_kinds_in_registration_order_and_the_fallback_last(
    tmp_path: Path,
) -> None:
    registry = (
        DraftRegistry()
        .register(_kind("catch-all", lambda a: True, fallback=True))
        .register(_kind("eagle", _has("eagle.marker")))
        .register(_kind("medusa", _model_type("medusa")))
    )
    assert registry.names() == ("catch-all", "eagle", "medusa")
    folder = tmp_path / "draft"
    folder.mkdir()
    assert registry.detect(folder) == Success("catch-all")
    (folder / "config.json").write_text(json.dumps({"model_type": "medusa"}))
    assert registry.detect(folder) == Success("medusa")
    (folder / "eagle.marker").write_text("")
    assert registry.detect(folder) == Success("eagle")  # registered before medusa


def test_several_fallbacks_keep_their_order_after_every_other_kind(
    tmp_path: Path,
) -> None:
    asked: list[str] = []

    def declines(name: str) -> Callable[[DraftArtifact], bool]:
        return lambda a: bool(asked.append(name))

    def accepts(name: str) -> Callable[[DraftArtifact], bool]:
        return lambda a: not asked.append(name)

    registry = (
        DraftRegistry()
        .register(_kind("f1", declines("f1"), fallback=True))
        .register(_kind("a", declines("a")))
        .register(_kind("f2", accepts("f2"), fallback=True))
        .register(_kind("b", declines("b")))
        .register(_kind("ngram-like", None))  # no artifact: never detected
    )
    assert registry.detect(tmp_path) == Success("f2")
    assert asked == ["a", "b", "f1", "f2"]


def test_the_default_registry_falls_back_to_two_model(tmp_path: Path) -> None:
    registry = default_registry()
    assert set(registry.names()) == {
        "dspark",
        "dflash2",
        "dflash",
        "assistant",
        "mtp",
        "two-model",
        "ngram",
    }
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert registry.detect(tmp_path) == Success("two-model")
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "gemma4_assistant"})
    )
    assert registry.detect(tmp_path) == Success("assistant")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_next_mtp"}))
    assert registry.detect(tmp_path) == Success("mtp")
    # a DFlash drafter: a qwen3 config carrying dflash_config (or its class name)
    dflash = {"model_type": "qwen3", "dflash_config": {"target_layer_ids": [1]}}
    (tmp_path / "config.json").write_text(json.dumps(dflash))
    assert registry.detect(tmp_path) == Success("dflash")
    named = {"model_type": "qwen3", "architectures": ["DFlashDraftModel"]}
    (tmp_path / "config.json").write_text(json.dumps(named))
    assert registry.detect(tmp_path) == Success("dflash")
    second = {"model_type": "qwen3", "architectures": ["DFlash2DraftModel"]}
    (tmp_path / "config.json").write_text(json.dumps(second))
    assert registry.detect(tmp_path) == Success("dflash2")
    assert [k.kind for k in registry.natives] == ["mtp"]


def test_a_kind_registered_after_the_default_fallback_is_detected_first(
    tmp_path: Path,
) -> None:
    registry = default_registry().register(_kind("eagle", _has("eagle.safetensors")))
    (tmp_path / "eagle.safetensors").write_bytes(b"")
    assert registry.detect(tmp_path) == Success("eagle")


def test_detect_fails_naming_the_folder_when_no_kind_recognises_it(
    tmp_path: Path,
) -> None:
    registry = (
        DraftRegistry().register(_kind("eagle", _has("eagle.marker"))).register(NGRAM)
    )
    message = _message(registry.detect(tmp_path))
    assert str(tmp_path) in message
    assert "no registered draft kind" in message


def test_an_artifact_reads_its_config_at_most_once(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "a"}))
    artifact = DraftArtifact(tmp_path)
    assert artifact.config == {"model_type": "a"}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "b"}))
    assert artifact.config == {"model_type": "a"}
    assert DraftArtifact(tmp_path).config == {"model_type": "b"}


@pytest.mark.parametrize("content", [None, "{not json", "[1, 2]"])
def test_an_artifact_without_a_readable_config_object_has_none(
    tmp_path: Path, content: str | None
) -> None:
    if content is not None:
        (tmp_path / "config.json").write_text(content)
    assert DraftArtifact(tmp_path).config is None


# --- names, duplicates, unknown kinds -------------------------------------------------


def test_registering_a_kind_twice_raises_and_leaves_the_registry_as_it_was() -> None:
    registry = default_registry()
    with pytest.raises(ValueError, match="ngram is already registered"):
        registry.register(_kind("ngram", None))
    assert registry.names() == default_registry().names()
    extended = registry.register(_kind("eagle", _has("x")))
    assert extended.names() == (*registry.names(), "eagle")
    assert registry.get("eagle") is None  # registries are immutable


def test_registering_a_native_kind_twice_raises() -> None:
    native = NativeDraftKind(kind="mtp", create=lambda target: Success(_loaded()))
    registry = DraftRegistry().register_native(native)
    with pytest.raises(ValueError, match="native draft kind mtp is already registered"):
        registry.register_native(native)


def test_loading_an_unknown_kind_lists_the_registered_kinds() -> None:
    request = DraftLoadRequest(target=SimpleNamespace(args=_args()))
    message = _message(default_registry().load("eagle3", request))
    assert "unknown draft kind 'eagle3'" in message
    assert "two-model" in message and "ngram" in message


# --- natives and companions -------------------------------------------------------------


def test_native_kinds_bind_to_graphs_that_declare_a_draft_head() -> None:
    created: list[Any] = []

    def create(
        target: Any, request: DraftLoadRequest
    ) -> Result[LoadedDraft, BindingError]:
        created.append(target)
        return Success(_loaded())

    registry = DraftRegistry().register_native(
        NativeDraftKind(kind="mtp", create=create)
    )
    target = object()
    request = DraftLoadRequest(target=target)
    assert registry.native(_graph(), request) is None
    declared = _graph(native_draft=NativeDraft(kind="mtp", width=2))
    assert isinstance(registry.native(declared, request), Success)
    assert created == [target]
    unknown = _graph(native_draft=NativeDraft(kind="eagle-head", width=2))
    result = registry.native(unknown, request)
    assert result is not None
    assert "eagle-head" in _message(result)


def test_draft_bits_reach_only_kinds_that_quantize() -> None:
    """A kind that does not declare `quantizes`, or a native head, refuses
    `draft_bits` before its loader runs; one that does gets them."""
    seen: list[int | None] = []

    def load(request: DraftLoadRequest) -> Result[LoadedDraft, BindingError]:
        seen.append(request.draft_bits)
        return Success(_loaded())

    registry = (
        DraftRegistry()
        .register(_kind("plain", None))
        .register(
            DraftKind(
                kind="block", artifact=False, default_width=2, load=load, quantizes=True
            )
        )
        .register_native(
            NativeDraftKind(
                kind="mtp", create=lambda target, request: Success(_loaded())
            )
        )
    )
    request = DraftLoadRequest(target=object(), draft_bits=4)
    assert isinstance(registry.load("block", request), Success) and seen == [4]
    assert "a plain draft takes none" in _message(registry.load("plain", request))
    declared = _graph(native_draft=NativeDraft(kind="mtp", width=2))
    native = registry.native(declared, request)
    assert native is not None and "a native mtp draft takes none" in _message(native)
    unasked = DraftLoadRequest(target=object())
    assert isinstance(registry.load("plain", unasked), Success)
    assert isinstance(registry.native(declared, unasked), Success)


def test_companion_finds_a_bundled_draft_folder(tmp_path: Path) -> None:
    registry = DraftRegistry().register(
        _kind("mtp", _has("x"), bundled_companion="mtp")
    )
    assert registry.companion(None) is None
    assert registry.companion(tmp_path) is None
    (tmp_path / "mtp").write_text("a file, not a folder")
    assert registry.companion(tmp_path) is None
    (tmp_path / "mtp").unlink()
    (tmp_path / "mtp").mkdir()
    assert registry.companion(tmp_path) == ("mtp", tmp_path / "mtp")


# --- bind -------------------------------------------------------------------------------


def test_bind_refuses_a_draft_vocabulary_larger_than_the_target() -> None:
    message = _message(
        bind(_graph(), DraftNeeds(kind="two-model", default_width=3, vocab_size=1001))
    )
    assert "two-model" in message
    assert "vocabulary" in message and "1001" in message and "1000" in message
    for fits in (1000, 500):
        assert isinstance(
            bind(
                _graph(), DraftNeeds(kind="two-model", default_width=3, vocab_size=fits)
            ),
            Success,
        )


def test_bind_refuses_a_hidden_size_mismatch() -> None:
    message = _message(
        bind(_graph(), DraftNeeds(kind="eagle", default_width=4, hidden_size=128))
    )
    assert "hidden" in message and "128" in message and "64" in message
    assert isinstance(
        bind(_graph(), DraftNeeds(kind="eagle", default_width=4, hidden_size=64)),
        Success,
    )


def test_bind_refuses_missing_tap_layers_naming_them() -> None:
    needs = DraftNeeds(kind="eagle", default_width=4, tap_layers=(1, 3, 7, 9))
    message = _message(bind(_graph(), needs))
    assert "[7, 9]" in message
    assert "taps" in message
    ok = DraftNeeds(kind="eagle", default_width=4, tap_layers=(0, 3))
    assert isinstance(bind(_graph(), ok), Success)


def test_bind_refuses_layers_that_cannot_roll_back() -> None:
    layers = (
        LayerCapability("attention", "position_overwrite"),
        LayerCapability("linear_recurrent", "none"),
        LayerCapability("linear_recurrent", "per_token_state"),
        LayerCapability("linear_recurrent", "snapshot_replay"),
    )
    message = _message(
        bind(_graph(layers=layers), DraftNeeds(kind="ngram", default_width=10))
    )
    assert "[1]" in message and "roll back" in message
    rollable = (*layers[:1], *layers[2:])
    assert isinstance(
        bind(_graph(layers=rollable), DraftNeeds(kind="ngram", default_width=10)),
        Success,
    )


@pytest.mark.parametrize("width", [0, -1, -10])
def test_bind_refuses_a_width_below_one(width: int) -> None:
    message = _message(
        bind(_graph(), DraftNeeds(kind="ngram", default_width=10), width)
    )
    assert "num-draft-tokens must be >= 1" in message
    assert str(width) in message


def test_bind_reports_every_problem_at_once() -> None:
    needs = DraftNeeds(
        kind="eagle", default_width=4, vocab_size=5000, hidden_size=32, tap_layers=(8,)
    )
    message = _message(bind(_graph(), needs, 0))
    for part in ("vocabulary", "hidden", "[8]", "num-draft-tokens"):
        assert part in message


def test_bind_width_default_adaptive_explicit_and_clamped() -> None:
    needs = DraftNeeds(kind="ngram", default_width=10)
    assert bind(_graph(), needs).unwrap() == Binding(_graph(), needs, 10)
    adaptive = _graph(adaptive_widths=(("ngram", 6), ("two-model", 2)))
    assert bind(adaptive, needs).unwrap().width == 6  # measured width beats the default
    assert bind(adaptive, needs, 3).unwrap().width == 3  # an explicit width beats both
    clamped = DraftNeeds(kind="ngram", default_width=10, max_width=4)
    assert bind(_graph(), clamped).unwrap().width == 4
    assert bind(_graph(), clamped, 9).unwrap().width == 4
    assert bind(_graph(), clamped, 2).unwrap().width == 2
    assert bind(adaptive, clamped).unwrap().width == 4
    assert bind(_graph(), clamped, 4).unwrap().width == 4


def test_graph_capabilities_of_a_decoder() -> None:
    graph = GraphCapabilities.for_decoder(_args(num_hidden_layers=3, vocab_size=151))
    assert (graph.model_type, graph.vocab_size, graph.hidden_size) == ("qwen2", 151, 64)
    assert graph.tap_layers == (0, 1, 2)
    assert graph.layers == (LayerCapability("attention", "position_overwrite"),) * 3
    assert graph.quantized_head is False
    quantized = _args(quantization={"group_size": 64, "bits": 4})
    assert GraphCapabilities.for_decoder(quantized).quantized_head is True


# --- the library's kinds --------------------------------------------------------------------


def test_default_widths_of_the_library_kinds() -> None:
    assert (
        NGRAM.default_width == 10 and NGRAM.artifact is False and NGRAM.detect is None
    )
    assert TWO_MODEL.default_width == 3 and TWO_MODEL.fallback is True


def test_loading_ngram_uses_its_default_width_and_sizes() -> None:
    target = SimpleNamespace(args=_args())
    loaded = default_registry().load("ngram", DraftLoadRequest(target=target)).unwrap()
    assert (loaded.kind, loaded.width) == ("ngram", 10)
    assert loaded.drafter.kind == "ngram"
    assert (loaded.drafter.min_n, loaded.drafter.max_n) == (2, 4)  # type: ignore[attr-defined]
    request = DraftLoadRequest(target=target, width=5, ngram_min=1, ngram_max=3)
    loaded = default_registry().load("ngram", request).unwrap()
    assert loaded.width == 5
    assert (loaded.drafter.min_n, loaded.drafter.max_n) == (1, 3)  # type: ignore[attr-defined]


@pytest.mark.parametrize(("low", "high"), [(3, 2), (0, 4), (-1, -1)])
def test_loading_ngram_refuses_bad_sizes(low: int, high: int) -> None:
    request = DraftLoadRequest(
        target=SimpleNamespace(args=_args()), ngram_min=low, ngram_max=high
    )
    message = _message(default_registry().load("ngram", request))
    assert f"min={low} max={high}" in message


def test_loading_ngram_refuses_a_zero_width() -> None:
    request = DraftLoadRequest(target=SimpleNamespace(args=_args()), width=0)
    assert "num-draft-tokens" in _message(default_registry().load("ngram", request))


class _Tokenizer:
    def __init__(self, shift: int = 0) -> None:
        self.shift = shift

    def encode(self, text: str) -> list[int]:
        return [ord(c) + self.shift for c in text]


@pytest.fixture
def fake_load(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Replace `specpipe.load.load` with a table of fake loaded models."""
    # `specpipe.load` the attribute is the API function; the module is this one
    module = importlib.import_module("specpipe.load")
    table: dict[str, Any] = {}

    def load(
        ref: str | None = None,
        dtype: str | None = None,
        gguf_quantized: bool | None = None,
    ) -> Any:
        from schemas.errors import LoadError

        assert not gguf_quantized, "these fakes are no GGUF files"

        if ref not in table:
            return Failure(LoadError(f"{ref}: no such model"))
        return Success(table[ref])

    monkeypatch.setattr(module, "load", load)
    return table


def _model(vocab: int = 97, shift: int = 0) -> Any:
    return SimpleNamespace(
        model=SimpleNamespace(name="draft", padding_safe=True),
        tokenizer=_Tokenizer(shift),
        args=_args(vocab_size=vocab),
        folder=None,
        source="fake",
    )


def test_loading_two_model_uses_its_default_width(fake_load: dict[str, Any]) -> None:
    fake_load["small"] = _model()
    request = DraftLoadRequest(target=_model(), source="small")
    loaded = default_registry().load("two-model", request).unwrap()
    assert (loaded.kind, loaded.width) == ("two-model", 3)
    assert loaded.drafter.model is fake_load["small"].model  # type: ignore[attr-defined]
    explicit = DraftLoadRequest(target=_model(), source="small", width=6)
    assert default_registry().load("two-model", explicit).unwrap().width == 6


def test_loading_two_model_refuses_a_different_tokenizer(
    fake_load: dict[str, Any],
) -> None:
    fake_load["other"] = _model(shift=1)
    assert _Tokenizer().encode(PROBE) != _Tokenizer(1).encode(PROBE)
    message = _message(
        default_registry().load(
            "two-model", DraftLoadRequest(target=_model(), source="other")
        )
    )
    assert "tokenizer" in message


def test_loading_two_model_refuses_a_larger_vocabulary(
    fake_load: dict[str, Any],
) -> None:
    fake_load["wide"] = _model(vocab=200)
    message = _message(
        default_registry().load(
            "two-model", DraftLoadRequest(target=_model(), source="wide")
        )
    )
    assert "vocabulary" in message and "200" in message and "97" in message


def test_loading_two_model_reports_a_draft_that_fails_to_load(
    fake_load: dict[str, Any],
) -> None:
    message = _message(
        default_registry().load(
            "two-model", DraftLoadRequest(target=_model(), source="missing")
        )
    )
    assert message.startswith("draft model:") and "missing" in message


def test_loading_two_model_refuses_a_recurrent_draft(fake_load: dict[str, Any]) -> None:
    recurrent = _model()
    recurrent.model.padding_safe = False
    fake_load["hybrid"] = recurrent
    message = _message(
        default_registry().load(
            "two-model", DraftLoadRequest(target=_model(), source="hybrid")
        )
    )
    assert "attention-only" in message
