"""Import of llama.cpp GGUF checkpoints: HF config, float32 weights, tokenizer.

Notable:
- The header (metadata and tensor table) is parsed here, with bounds checks, so
  a truncated or corrupt file is refused with a message before any tensor is
  read; `gguf.GGUFReader` would also take seconds on a 150k-token vocabulary.
- Tensors are dequantised one at a time (and big ones in row blocks) with
  `gguf.quants.dequantize`, which knows every llama.cpp quant type, so peak
  memory is the float32 model plus about two copies of its largest tensor.
- llama.cpp's converter permutes the rows of a llama model's Q and K
  projections so that its RoPE can rotate adjacent pairs (traditional RoPE);
  the permutation is undone here, so the weights equal the HF checkpoint's and
  RoPE runs with traditional=False. Qwen2/Qwen3 files are not permuted.

Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from attrs import frozen
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize
from returns.result import Failure, Result, Success

from models.tokenizer import gguf_tokenizer
from schemas.errors import LoadError

MAGIC = b"GGUF"
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")
_ARCH_CLASS = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
_DEFAULT_ALIGNMENT = 32
# elements dequantised per call: bounds the temporaries of gguf's numpy kernels
_BLOCK_ELEMENTS = 1 << 22

# GGUF metadata value types -> struct format (8 string and 9 array are special)
_SCALARS: dict[int, str] = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY, _FLOAT32 = 8, 9, 6

# GGUF tensor name (after "blk.N.") -> HF module path inside "model.layers.N."
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


@frozen
class TensorInfo:
    name: str
    # HF (row-major) order: GGUF lists dims fastest-first, so this is reversed
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    # absolute byte offset in the file
    offset: int
    nbytes: int


@frozen
class GgufHeader:
    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: tuple[TensorInfo, ...]


@frozen(eq=False)
class GgufModel:
    """A GGUF checkpoint as an HF-style config, float32 weights and a tokenizer."""

    path: Path
    # HF config.json keys (model_type, hidden_size, rope_theta, ...)
    config: dict[str, Any]
    # HF weight names -> float32 arrays in HF layout ([O, I] linear, [V, H]
    # embedding, [O] bias and norm); empty if not loaded
    weights: dict[str, mx.array]
    # a serialised `tokenizers.Tokenizer`
    tokenizer_json: str
    # HF tokenizer_config.json keys (chat_template, bos_token, add_bos_token, ...)
    tokenizer_config: dict[str, Any]


class _Corrupt(Exception):
    """A header field is out of bounds; the message says which."""


class _Cursor:
    """Little-endian reads over the mapped file, checked against its end."""

    def __init__(self, buffer: mmap.mmap) -> None:
        self.buffer = buffer
        self.pos = 0
        self.size = len(buffer)

    def take(self, count: int, what: str) -> bytes:
        end = self.pos + count
        if count < 0 or end > self.size:
            raise _Corrupt(
                f"{what} at byte {self.pos} needs {count} bytes, "
                f"but the file ends at byte {self.size} (truncated?)"
            )
        data = self.buffer[self.pos : end]
        self.pos = end
        return data

    def scalar(self, fmt: str, what: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        length = self.scalar("<Q", what)
        raw = self.take(length, what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise _Corrupt(f"{what} is not UTF-8 ({exc})") from exc

    def value(self, kind: int, what: str) -> Any:
        if kind == _STRING:
            return self.string(what)
        if kind == _ARRAY:
            item = self.scalar("<I", what)
            count = self.scalar("<Q", what)
            if item == _STRING:
                return [self.string(what) for _ in range(count)]
            if item in _SCALARS:
                dtype = np.dtype(_SCALARS[item])
                raw = self.take(count * dtype.itemsize, what)
                return np.frombuffer(raw, dtype=dtype).tolist()
            if item == _ARRAY:
                return [self.value(_ARRAY, what) for _ in range(count)]
            raise _Corrupt(f"{what} has unknown array item type {item}")
        if kind in _SCALARS:
            raw = self.scalar(_SCALARS[kind], what)
            # float32 metadata (eps, rope base) as the decimal it was written from
            return float(str(np.float32(raw))) if kind == _FLOAT32 else raw
        raise _Corrupt(f"{what} has unknown value type {kind}")


def read_gguf_header(path: Path) -> Result[GgufHeader, LoadError]:
    """The metadata and tensor table of the GGUF at `path`; no tensor data read."""
    path = Path(path)
    if not path.is_file():
        return Failure(LoadError(f"GGUF file {path} does not exist"))
    try:
        with path.open("rb") as handle:
            size = path.stat().st_size
            if size < 24:
                return Failure(
                    LoadError(f"{path} is not a GGUF file: only {size} bytes")
                )
            with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
                return _parse_header(path, _Cursor(buffer))
    except _Corrupt as exc:
        return Failure(LoadError(f"{path}: corrupt or truncated GGUF: {exc}"))
    except OSError as exc:
        return Failure(LoadError(f"cannot read GGUF file {path}: {exc}"))


def _parse_header(path: Path, cursor: _Cursor) -> Result[GgufHeader, LoadError]:
    magic = cursor.take(4, "magic")
    if magic != MAGIC:
        return Failure(
            LoadError(
                f"{path} is not a GGUF file (starts with {magic!r}, not {MAGIC!r})"
            )
        )
    version = cursor.scalar("<I", "version")
    if version not in (2, 3):
        return Failure(
            LoadError(
                f"{path}: GGUF version {version} is not supported (2 and 3 are; "
                f"a big-endian file reads as a huge version): re-convert it with a "
                f"current llama.cpp"
            )
        )
    n_tensors = cursor.scalar("<Q", "tensor count")
    n_values = cursor.scalar("<Q", "metadata count")
    # every entry takes at least 8 bytes, so larger counts are garbage
    if max(n_tensors, n_values) * 8 > cursor.size:
        raise _Corrupt(f"counts {n_tensors} tensors / {n_values} values are too big")
    metadata: dict[str, Any] = {}
    for index in range(n_values):
        key = cursor.string(f"metadata key #{index}")
        kind = cursor.scalar("<I", f"type of {key}")
        metadata[key] = cursor.value(kind, f"metadata {key}")
    raw_tensors = []
    for index in range(n_tensors):
        name = cursor.string(f"tensor name #{index}")
        n_dims = cursor.scalar("<I", f"dims of {name}")
        if not 0 < n_dims <= 4:
            raise _Corrupt(f"tensor {name} has {n_dims} dimensions")
        dims = [cursor.scalar("<Q", f"shape of {name}") for _ in range(n_dims)]
        kind = cursor.scalar("<I", f"type of {name}")
        offset = cursor.scalar("<Q", f"offset of {name}")
        raw_tensors.append((name, dims, kind, offset))
    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    if alignment <= 0:
        raise _Corrupt(f"general.alignment is {alignment}")
    data_start = -(-cursor.pos // alignment) * alignment
    tensors = []
    for name, dims, kind, offset in raw_tensors:
        try:
            qtype = GGMLQuantizationType(kind)
        except ValueError:
            raise _Corrupt(f"tensor {name} has unknown type {kind}") from None
        block, type_size = GGML_QUANT_SIZES[qtype]
        if dims[0] % block:
            raise _Corrupt(f"tensor {name}: row of {dims[0]} is not whole {qtype.name}")
        nbytes = int(np.prod(dims, dtype=np.uint64)) // block * type_size
        start = data_start + offset
        if start + nbytes > cursor.size:
            raise _Corrupt(
                f"tensor {name} spans bytes {start}..{start + nbytes}, but the file "
                f"has {cursor.size} bytes (truncated: download it again)"
            )
        tensors.append(TensorInfo(name, tuple(reversed(dims)), qtype, start, nbytes))
    return Success(GgufHeader(path, version, metadata, tuple(tensors)))


def read_gguf(path: Path, load_weights: bool = True) -> Result[GgufModel, LoadError]:
    """Config, float32 HF-layout weights and tokenizer of a llama/qwen2/qwen3 GGUF.

    With `load_weights=False` only the header is read (config and tokenizer).
    """
    return read_gguf_header(path).bind(lambda h: _model(h, load_weights))


def _model(header: GgufHeader, load_weights: bool) -> Result[GgufModel, LoadError]:
    config = gguf_config(header)
    if isinstance(config, LoadError):
        return Failure(config)
    tokenizer = gguf_tokenizer(header.metadata, str(header.path))
    if isinstance(tokenizer, LoadError):
        return Failure(tokenizer)
    backend, tokenizer_config = tokenizer
    weights: dict[str, mx.array] = {}
    if load_weights:
        loaded = _load_weights(header, config)
        if isinstance(loaded, LoadError):
            return Failure(loaded)
        weights = loaded
    return Success(
        GgufModel(
            path=header.path,
            config=config,
            weights=weights,
            tokenizer_json=backend.to_str(),
            tokenizer_config=tokenizer_config,
        )
    )


def gguf_config(header: GgufHeader) -> dict[str, Any] | LoadError:
    """The HF `config.json` equivalent of a GGUF's metadata."""
    meta = header.metadata
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        return LoadError(
            f"{header.path}: architecture {arch!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    names = {t.name: t for t in header.tensors}
    embed = names.get("token_embd.weight")
    if embed is None:
        return LoadError(f"{header.path}: no token_embd.weight tensor")
    if "rope_freqs.weight" in names:
        # Llama 3.1-style scaling: llama.cpp keeps only the scaled frequencies,
        # not the factors HF's config needs to rebuild them
        return LoadError(
            f"{header.path}: carries rope_freqs (Llama 3.1-style RoPE scaling), "
            f"which this importer does not support; load the HF checkpoint instead"
        )
    unknown = [t.name for t in header.tensors if hf_weight_name(t.name) is None]
    if unknown:
        return LoadError(
            f"{header.path}: tensors with no place in a {arch} model: "
            f"{', '.join(unknown[:5])}"
        )

    def key(name: str) -> str:
        return f"{arch}.{name}"

    required = (
        "embedding_length",
        "block_count",
        "feed_forward_length",
        "attention.head_count",
    )
    missing = [key(k) for k in required if key(k) not in meta]
    if missing:
        return LoadError(f"{header.path}: metadata lacks {', '.join(missing)}")
    heads = int(meta[key("attention.head_count")])
    config: dict[str, Any] = {
        "architectures": [_ARCH_CLASS[arch]],
        "model_type": arch,
        "hidden_size": int(meta[key("embedding_length")]),
        "num_hidden_layers": int(meta[key("block_count")]),
        "intermediate_size": int(meta[key("feed_forward_length")]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(key("attention.head_count_kv"), heads)),
        "vocab_size": embed.shape[0],
        "rms_norm_eps": float(meta.get(key("attention.layer_norm_rms_epsilon"), 1e-6)),
        "rope_theta": float(meta.get(key("rope.freq_base"), 10000.0)),
        "max_position_embeddings": int(meta.get(key("context_length"), 2048)),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "torch_dtype": "float32",
    }
    head_dim = meta.get(key("attention.key_length"))
    if head_dim is None and arch == "llama":
        head_dim = meta.get(key("rope.dimension_count"))
    if head_dim is not None:
        config["head_dim"] = int(head_dim)
    scaling = meta.get(key("rope.scaling.type"))
    if scaling not in (None, "none"):
        rope_scaling: dict[str, Any] = {"rope_type": scaling}
        if key("rope.scaling.factor") in meta:
            rope_scaling["factor"] = float(meta[key("rope.scaling.factor")])
        if key("rope.scaling.original_context_length") in meta:
            rope_scaling["original_max_position_embeddings"] = int(
                meta[key("rope.scaling.original_context_length")]
            )
        config["rope_scaling"] = rope_scaling
    for name in ("bos", "eos", "padding"):
        token = meta.get(f"tokenizer.ggml.{name}_token_id")
        if token is not None:
            config["pad_token_id" if name == "padding" else f"{name}_token_id"] = int(
                token
            )
    return config


def hf_weight_name(name: str) -> str | None:
    """The HF name of GGUF tensor `name`, or None if a decoder has no place for it."""
    module, _, suffix = name.rpartition(".")
    if module in _TOP_NAMES:
        return f"{_TOP_NAMES[module]}.{suffix}"
    parts = module.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    return None


def unpermute_rope_rows(
    weight: np.ndarray,  # [N*D, ...] llama.cpp row order
    n_heads: int,
) -> np.ndarray:  # [N*D, ...] HF row order
    """Undo llama.cpp's Q/K row permutation.

    Per head of D rows, HF orders rows as two halves [x_0..x_{D/2-1},
    y_0..y_{D/2-1}] (RoPE rotates x_i with y_i, "rotate_half"); llama.cpp's
    converter interleaves them as [x_0, y_0, x_1, y_1, ...] for its adjacent-pair
    RoPE: reshape(N, 2, D/2).swapaxes(1, 2). This is the inverse.
    https://github.com/ggml-org/llama.cpp/blob/master/convert_hf_to_gguf.py (LlamaModel.permute)
    """
    rest = weight.shape[1:]
    half = weight.shape[0] // n_heads // 2
    grouped = weight.reshape(n_heads, half, 2, *rest)
    return grouped.swapaxes(1, 2).reshape(weight.shape)


def _load_weights(
    header: GgufHeader, config: dict[str, Any]
) -> dict[str, mx.array] | LoadError:
    heads: dict[str, int] = {}
    if config["model_type"] == "llama":
        heads = {
            "attn_q": config["num_attention_heads"],
            "attn_k": config["num_key_value_heads"],
        }
    weights: dict[str, mx.array] = {}
    try:
        with header.path.open("rb") as handle:
            for info in header.tensors:
                name = hf_weight_name(info.name)
                if name is None:
                    continue
                n_heads = heads.get(info.name.split(".")[-2])
                weights[name] = mx.array(_read_tensor(handle.fileno(), info, n_heads))
    except (OSError, ValueError, NotImplementedError) as exc:
        return LoadError(f"{header.path}: cannot read tensor data: {exc}")
    return weights


def _read_tensor(
    fd: int, info: TensorInfo, n_heads: int | None
) -> np.ndarray:  # [*info.shape] float32, HF row order
    block, type_size = GGML_QUANT_SIZES[info.qtype]
    width = info.shape[-1]
    row_bytes = width // block * type_size
    rows = info.nbytes // row_bytes
    out = np.empty((rows, width), dtype=np.float32)
    step = max(1, _BLOCK_ELEMENTS // width)
    for start in range(0, rows, step):
        count = min(step, rows - start)
        size = count * row_bytes
        raw = os.pread(fd, size, info.offset + start * row_bytes)
        if len(raw) != size:
            raise ValueError(f"{info.name}: short read ({len(raw)} of {size} bytes)")
        # one flat row of whole blocks: gguf then dequantises it in one
        # vectorised call instead of looping over groups of 16 rows
        flat = np.frombuffer(raw, dtype=np.uint8).reshape(1, size)
        out[start : start + count] = dequantize(flat, info.qtype).reshape(count, width)
    weight = out.reshape(info.shape)
    return weight if n_heads is None else unpermute_rope_rows(weight, n_heads)
