"""Prompt caches on disk: a `PromptCache`'s checkpoints in one safetensors file,
to start a later process's prompts from (a long document or system prompt
prefilled once; a conversation resumed).

The file holds every checkpoint's arrays (the target's cache row, the draft's
state) and, in its metadata, a JSON record of the checkpoints (tokens, cache
layouts, draft state kinds and scalars) and of the model they belong to: its
shape and a digest of its embedding. A file made for another model, or with
another layout, is refused with a message saying so. A save merges: under
an exclusive lock (`<file>.lock` beside it, left in place), it reads the
checkpoints the file already holds, adds its own as the most recently used
(its own replacing one of the same tokens and drafter), keeps what the
cache's byte budget and entry count admit, least recently used out first,
and writes the result (MLX reads a file's arrays lazily, and only the
checkpoints kept are read: a save or a load needs no more memory than the
budget, whatever the file holds); so processes sharing one file (two chats on one
document) each add their checkpoints instead of the last to save replacing
the others' (`merge=False`: replace the file). The file is written to a
temporary name of its own first and moved into place, so an interrupted
save leaves the old file (or none), never half of one.

Draft states round-trip through their attrs fields: ints and strings in the
record, arrays and caches as arrays. Only `DraftState` classes of specpipe's
own modules are rebuilt.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib
import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import attrs
import mlx.core as mx
import numpy as np
from returns.result import Failure, Result, Success

from models.cache import KVCache, KVQuantization, QuantizedKVCache, kv_quantization
from models.gemma4 import Gemma4Cache
from models.hybrid_cache import HybridCache
from schemas.errors import LoadError, succeeded
from specpipe.draft import DraftState
from specpipe.prompt_cache import Checkpoint, PromptCache

FORMAT = "specpipe-prompt-cache"
VERSION = 1
_DTYPES = {str(d): d for d in (mx.float32, mx.float16, mx.bfloat16)}


def model_fingerprint(model: Any) -> str:
    """The model's shape, a digest of its first embeddings and how it stores
    keys and values (`--kv-bits`): what a file's states are only valid for."""
    a = model.args
    digest = "none"
    embed = getattr(model, "embed", None)
    if embed is not None:
        rows = embed(mx.arange(8, dtype=mx.int32)[None]).astype(mx.float32)
        digest = hashlib.sha256(np.array(rows).tobytes()).hexdigest()[:16]
    quantized = kv_quantization(model)
    stored = (
        f"/kv{quantized.bits}g{quantized.group_size}" if quantized is not None else ""
    )
    return (
        f"{a.model_type}/h{a.hidden_size}/l{a.num_hidden_layers}/v{a.vocab_size}/"
        f"{digest}{stored}"
    )


def save_prompt_cache(
    cache: PromptCache, path: Path, *, merge: bool = True
) -> Result[Path, LoadError]:
    """Write every checkpoint of `cache` (least recently used first) to
    `path`, after the checkpoints the file there holds (`merge`, under the
    file's lock; a file of another model or a damaged one is refused, and
    left as it is), within `cache`'s budget. `cache` itself is unchanged."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with _locked(path) if merge else contextlib.nullcontext():
            kept = cache
            if merge and path.exists():
                merged = _with_file(cache, path)
                if not succeeded(merged):
                    return Failure(merged.failure())
                kept = merged.unwrap()
            return _write(kept, path)
    except OSError as exc:
        return Failure(LoadError(f"{path}: cannot write the prompt cache ({exc})"))


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock of `path`'s saves (its `.lock` file, made if missing:
    removing it would let a save that opened it a moment earlier lock a file
    no later save sees)."""
    lock = path.with_name(path.name + ".lock")
    with open(lock, "a+b") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _with_file(cache: PromptCache, path: Path) -> Result[PromptCache, LoadError]:
    """A new cache of `cache`'s model and budget holding the file's
    checkpoints, then `cache`'s (used last, so kept first)."""
    merged = PromptCache(
        cache.model,
        max_bytes=cache.max_bytes,
        max_entries=cache.max_entries,
        capture_prompts=cache.capture_prompts,
    )

    def merge(theirs: list[Checkpoint]) -> PromptCache:
        # only the file's checkpoints kept beside `cache`'s are read from it
        for checkpoint in merged.surviving([*theirs, *cache.checkpoints()]):
            merged.prepare_insert(checkpoint).commit()
        return merged

    return read_prompt_cache(path, cache.model).map(merge)


def _write(cache: PromptCache, path: Path) -> Result[Path, LoadError]:
    """`cache`'s checkpoints to `path`, staged under a name of this save's own."""
    arrays: dict[str, mx.array] = {}
    entries = []
    for number, checkpoint in enumerate(cache.checkpoints()):
        prefix = f"c{number}."
        entries.append(
            {
                "tokens": list(checkpoint.tokens),
                "target": _cache_out(checkpoint.target, prefix + "t.", arrays),
                "draft": None
                if checkpoint.draft is None
                else _state_out(checkpoint.draft, prefix + "d.", arrays),
            }
        )
    record = {
        "format": FORMAT,
        "version": VERSION,
        "model": model_fingerprint(cache.model),
        "entries": entries,
    }
    # a staging name of this save's own (saves that do not merge may race:
    # each writes its own file, and the last move wins, whole); MLX names a
    # file without the suffix `<name>.safetensors`
    staging = path.with_name(
        f"{path.name}.{os.getpid()}-{uuid.uuid4().hex[:12]}.partial.safetensors"
    )
    try:
        mx.save_safetensors(str(staging), arrays, metadata={FORMAT: json.dumps(record)})
        os.replace(staging, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            staging.unlink(missing_ok=True)
        return Failure(LoadError(f"{path}: cannot write the prompt cache ({exc})"))
    return Success(path)


def load_prompt_cache(path: Path, cache: PromptCache) -> Result[PromptCache, LoadError]:
    """`cache` with the checkpoints of the file at `path` added (in their
    order of use; the budget evicts as it does for any insert, and what it
    would evict is not read)."""

    def add(checkpoints: list[Checkpoint]) -> PromptCache:
        for checkpoint in cache.surviving(checkpoints):
            cache.prepare_insert(checkpoint).commit()
        return cache

    return read_prompt_cache(path, cache.model).map(add)


def read_prompt_cache(path: Path, model: Any) -> Result[list[Checkpoint], LoadError]:
    """The checkpoints of the file at `path` (`model`'s, else refused), least
    recently used first, their arrays not yet read (MLX loads lazily)."""
    path = Path(path)
    try:
        loaded = mx.load(str(path), format="safetensors", return_metadata=True)
    except Exception as exc:
        return Failure(
            LoadError(
                f"{path}: not a readable prompt-cache file ({exc}); delete it or "
                "give another path"
            )
        )
    arrays = cast(dict[str, mx.array], loaded[0])  # type: ignore[index]
    metadata = cast(dict[str, str], loaded[1])  # type: ignore[index]
    try:
        record = json.loads(metadata[FORMAT])
    except (KeyError, json.JSONDecodeError):
        return Failure(
            LoadError(f"{path}: not a specpipe prompt-cache file (no {FORMAT} record)")
        )
    if record.get("version") != VERSION:
        return Failure(
            LoadError(
                f"{path}: prompt-cache format version {record.get('version')}, this "
                f"specpipe reads {VERSION}; delete the file to start a new one"
            )
        )
    expected = model_fingerprint(model)
    if record.get("model") != expected:
        return Failure(
            LoadError(
                f"{path}: the prompt cache was made for another model "
                f"({record.get('model')}, this one is {expected}); give another "
                "path or delete it"
            )
        )
    try:
        checkpoints = [
            Checkpoint(
                tuple(int(t) for t in entry["tokens"]),
                _cache_in(entry["target"], arrays),
                None if entry["draft"] is None else _state_in(entry["draft"], arrays),
            )
            for entry in record["entries"]
        ]
    except (KeyError, TypeError, ValueError) as exc:
        return Failure(
            LoadError(f"{path}: a damaged prompt-cache record ({exc}); delete it")
        )
    return Success(checkpoints)


def _cache_out(cache: Any, prefix: str, arrays: dict[str, mx.array]) -> dict[str, Any]:
    """A cache row's layout (the record) and arrays (into `arrays`)."""
    if isinstance(cache, Gemma4Cache):
        return {
            "kind": "arenas",
            "prefix": prefix,
            "arenas": {
                kind: _cache_out(arena, f"{prefix}{kind}.", arrays)
                for kind, arena in cache.arenas.items()
            },
        }
    if isinstance(cache, HybridCache):
        for i, (conv, state) in enumerate(
            zip(cache.conv, cache.recurrent, strict=True)
        ):
            arrays[f"{prefix}conv.{i}"] = conv
            arrays[f"{prefix}rec.{i}"] = state
        return {
            "kind": "hybrid",
            "prefix": prefix,
            "kv": _cache_out(cache.kv, prefix + "kv.", arrays),
            "linear": len(cache.conv),
        }
    if isinstance(cache, KVCache):
        layout: dict[str, Any] = {
            "kind": "kv",
            "prefix": prefix,
            "layers": cache.num_layers,
            "batch": cache.batch,
            "kv_heads": cache.kv_heads,
            "head_dim": cache.head_dim,
            "dtype": str(cache.dtype),
            "capacity": cache.capacity,
        }
        if not isinstance(cache, QuantizedKVCache):
            for i, (k, v) in enumerate(zip(cache.keys, cache.values, strict=True)):
                arrays[f"{prefix}k.{i}"] = k
                arrays[f"{prefix}v.{i}"] = v
            return layout
        for i, (key_parts, value_parts) in enumerate(
            zip(cache.key_parts, cache.value_parts, strict=True)
        ):
            for j, (kp, vp) in enumerate(zip(key_parts, value_parts, strict=True)):
                arrays[f"{prefix}k.{i}.{j}"] = kp
                arrays[f"{prefix}v.{i}.{j}"] = vp
        quantization = cache.quantization
        return {
            **layout,
            "kind": "qkv",
            "bits": quantization.bits,
            "group_size": quantization.group_size,
        }
    raise TypeError(f"a {type(cache).__name__} cannot be kept in a prompt-cache file")


def _cache_in(layout: dict[str, Any], arrays: dict[str, mx.array]) -> Any:
    """The cache row a layout record and its arrays describe."""
    prefix = str(layout["prefix"])
    if layout["kind"] == "arenas":
        return Gemma4Cache(
            {
                str(kind): _cache_in(arena, arrays)
                for kind, arena in dict(layout["arenas"]).items()
            }
        )
    if layout["kind"] == "hybrid":
        count = int(layout["linear"])
        return HybridCache(
            _cache_in(layout["kv"], arrays),
            [arrays[f"{prefix}conv.{i}"] for i in range(count)],
            [arrays[f"{prefix}rec.{i}"] for i in range(count)],
        )
    if layout["kind"] not in ("kv", "qkv"):
        raise ValueError(f"unknown cache kind {layout['kind']!r}")
    dtype = _DTYPES.get(str(layout["dtype"]))
    if dtype is None:
        raise ValueError(f"unknown cache dtype {layout['dtype']!r}")
    layers, capacity = int(layout["layers"]), int(layout["capacity"])
    shape = (
        layers,
        int(layout["batch"]),
        int(layout["kv_heads"]),
        int(layout["head_dim"]),
        dtype,
    )
    if layout["kind"] == "qkv":
        quantization = KVQuantization(int(layout["bits"]), int(layout["group_size"]))
        quantized = QuantizedKVCache(*shape, quantization)
        if capacity:
            # one shape check: reserve the buffers, then compare each array's
            quantized.reserve(capacity)

            def parts(side: str, i: int) -> tuple[mx.array, mx.array, mx.array]:
                a, b, c = (arrays[f"{prefix}{side}.{i}.{j}"] for j in range(3))
                return a, b, c

            for side, stored in (
                ("k", quantized.key_parts),
                ("v", quantized.value_parts),
            ):
                for i in range(layers):
                    read = parts(side, i)
                    if any(
                        r.shape != e.shape for r, e in zip(read, stored[i], strict=True)
                    ):
                        raise ValueError(
                            f"quantized cache arrays under {prefix!r} do not fit "
                            f"its layout"
                        )
                    stored[i] = read
        return quantized
    cache = KVCache(*shape)
    if capacity:
        buffer = (cache.batch, cache.kv_heads, capacity, cache.head_dim)
        cache.keys = [arrays[f"{prefix}k.{i}"] for i in range(layers)]
        cache.values = [arrays[f"{prefix}v.{i}"] for i in range(layers)]
        if any(tuple(a.shape) != buffer for a in (*cache.keys, *cache.values)):
            raise ValueError(f"cache arrays under {prefix!r} are not of shape {buffer}")
        cache.capacity = capacity
    return cache


def _state_out(
    state: DraftState, prefix: str, arrays: dict[str, mx.array]
) -> dict[str, Any]:
    """A draft state's class and fields (the record) and arrays."""
    cls = type(state)
    fields: dict[str, Any] = {}
    for field in attrs.fields(cls):
        value = getattr(state, field.name)
        name = f"{prefix}{field.name}"
        if isinstance(value, mx.array):
            arrays[name] = value
            fields[field.name] = {"array": name}
        elif isinstance(value, KVCache | HybridCache | Gemma4Cache):
            fields[field.name] = {"cache": _cache_out(value, name + ".", arrays)}
        elif isinstance(value, int | str):
            fields[field.name] = {"value": value}
        else:
            raise TypeError(
                f"{cls.__name__}.{field.name} cannot be kept in a prompt-cache file"
            )
    return {"class": f"{cls.__module__}:{cls.__qualname__}", "fields": fields}


def _state_in(record: dict[str, Any], arrays: dict[str, mx.array]) -> DraftState:
    """The draft state a record describes (a `DraftState` of specpipe's own)."""
    module_name, _, name = str(record["class"]).partition(":")
    if not module_name.startswith("specpipe."):
        raise ValueError(f"draft state class {record['class']!r} is not specpipe's")
    cls = getattr(importlib.import_module(module_name), name, None)
    if not (isinstance(cls, type) and issubclass(cls, DraftState)):
        raise ValueError(f"{record['class']!r} is not a draft state class")
    values: dict[str, Any] = {}
    for field, stored in dict(record["fields"]).items():
        if "array" in stored:
            values[field] = arrays[str(stored["array"])]
        elif "cache" in stored:
            values[field] = _cache_in(stored["cache"], arrays)
        else:
            values[field] = stored["value"]
    state: DraftState = cls(**values)
    return state
