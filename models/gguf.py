"""Import of llama.cpp GGUF checkpoints: HF config, weights, tokenizer.
Architectures: llama, qwen2, qwen3, gemma3 (read as a `gemma3_text` config,
its RMSNorm weights less the one llama.cpp's converter adds, and what its
graph fixes rather than stores: every sixth layer full, the sliding layers'
RoPE base 10,000) and gemma4 (read as a `gemma4_text` config and
transformers' Gemma4ForCausalLM weight names).

Notable:
- The header (metadata and tensor table) is parsed here, with bounds checks, so
  a truncated or corrupt file is refused with a message before any tensor is
  read; `gguf.GGUFReader` would also take seconds on a 150k-token vocabulary.
- Tensors are dequantised one at a time (and big ones in row blocks) with
  `gguf.quants.dequantize`, which knows every llama.cpp quant type, so peak
  memory is the float32 model plus about two copies of its largest tensor.
- A file whose weight matrices are all F16, or all BF16 (F32 beside them
  only where llama.cpp's converter keeps it: norms, biases, MoE routers),
  loads in that dtype, as an HF float16 / bfloat16 checkpoint does: its
  matrices as stored, without a float32 copy, the F32 tensors cast
  (`file_dtype`). Any other file loads as float32.
  With `keep_quantized`, Q4_*, Q5_*, Q8_0 and K-type (Q2_K to Q6_K)
  matrices are read into
  MLX affine triples instead, exactly (models/gguf_quant.py).
- llama.cpp's converter permutes the rows of a llama model's Q and K
  projections so that its RoPE can rotate adjacent pairs (traditional RoPE);
  the permutation is undone here, so the weights equal the HF checkpoint's and
  RoPE runs with traditional=False. Qwen2/Qwen3 files are not permuted.
- Gemma-4 (llama.cpp's `gemma4`) needs no weight transform: its converter
  stores norms as they are (Gemma-4's RMSNorm multiplies by w, not 1 + w),
  leaves Q/K unpermuted (its RoPE is NeoX-style, rotate-half) and stacked
  experts as transformers stacks them (gate rows first). What it moves into
  metadata is read back: per-layer arrays (`sliding_window_pattern`,
  `head_count_kv`, `feed_forward_length`), the two head widths
  (`key_length` full, `key_length_swa` sliding), the two RoPE bases, and
  the full layers' "proportional" RoPE, which it encodes as the
  `rope_freqs` tensor (factor 1 for a rotated pair, 1e30 for an unrotated
  one). Names are renamed back: `router.scale` <- `ffn_gate_inp.scale`,
  `router.per_expert_scale` <- `ffn_down_exps.scale`, `layer_scalar` <-
  `layer_output_scale`, the per-layer embeddings (PLE) <- `per_layer_*`,
  `inp_gate`, `proj`, `post_norm`. Values-as-keys layers are the full layers
  without `attn_v`. What the file cannot say as a Gemma-4 config is refused
  with the key or tensor named.

Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
Gemma-4: llama.cpp `conversion/gemma.py` (Gemma4Model, Gemma3Model,
TextModel.set_gguf_parameters), `src/models/gemma4*.cpp` (hparams, tensors,
graph), `gguf-py/gguf/constants.py` and `tensor_mapping.py` (names).
"""

from __future__ import annotations

import math
import mmap
import os
import re
import struct
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from attrs import frozen
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize
from returns.result import Failure, Result, Success

from models.base import FLOAT_DTYPES
from models.gguf_quant import AFFINE_TYPES, read_affine, row_blocks
from models.tokenizer import gguf_tokenizer
from schemas.errors import LoadError
from schemas.hf_gemma4 import (
    FULL_ATTENTION,
    GEMMA3_TEXT,
    GEMMA4_TEXT,
    SLIDING_ATTENTION,
)

MAGIC = b"GGUF"
GEMMA4 = "gemma4"
GEMMA3 = "gemma3"
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", GEMMA3, GEMMA4)
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
        return Failure(
            LoadError(f"{path}: corrupt or truncated GGUF ({exc}): download it again")
        )
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


def read_gguf(
    path: Path,
    load_weights: bool = True,
    keep_quantized: bool = False,
    dtype: mx.Dtype | None = None,
) -> Result[GgufModel, LoadError]:
    """Config, HF-layout weights and tokenizer of a llama, qwen2, qwen3,
    gemma3 or gemma4 GGUF. The float weights are in `dtype`; None: the
    file's (`file_dtype`, the config's `torch_dtype`): float32, or float16 /
    bfloat16 for a file of F16 / BF16 matrices, read as stored.

    With `load_weights=False` only the header is read (config and tokenizer),
    and a gemma4 file's `rope_freqs` (its RoPE, a few floats).
    `keep_quantized`: the weight matrices (and a gemma4 file's stacked
    experts) in a type MLX affine quantization holds exactly (Q4_*, Q5_*,
    Q8_0, Q2_K to Q6_K: `models/gguf_quant.py`) come as MLX triples
    (`.weight` packed, `.scales`, `.biases`, float32, groups of 32; Q2_K's,
    Q3_K's and Q6_K's of 16), which the loader turns into quantized layers;
    the rest are dequantized as without it.
    """
    return read_gguf_header(path).bind(
        lambda h: _model(h, load_weights, keep_quantized, dtype)
    )


def _model(
    header: GgufHeader,
    load_weights: bool,
    keep_quantized: bool = False,
    dtype: mx.Dtype | None = None,
) -> Result[GgufModel, LoadError]:
    config = gguf_config(header)
    if isinstance(config, LoadError):
        return Failure(config)
    tokenizer = gguf_tokenizer(header.metadata, str(header.path))
    if isinstance(tokenizer, LoadError):
        return Failure(tokenizer)
    backend, tokenizer_config = tokenizer
    weights: dict[str, mx.array] = {}
    if load_weights:
        loaded = _load_weights(
            header, config, keep_quantized, dtype or FLOAT_DTYPES[config["torch_dtype"]]
        )
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
    if arch == GEMMA4:
        return gemma4_config(header)
    if arch == GEMMA3:
        return gemma3_config(header)
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

    lacking = _lacking(header, arch, _REQUIRED)
    if lacking is not None:
        return lacking
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
        "torch_dtype": file_dtype(header),
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
    return {**config, **_token_ids(meta)}


# the metadata every decoder architecture's config needs (under `<arch>.`)
_REQUIRED = (
    "embedding_length",
    "block_count",
    "feed_forward_length",
    "attention.head_count",
)


def _lacking(
    header: GgufHeader, arch: str, required: tuple[str, ...]
) -> LoadError | None:
    """The error naming the `<arch>.` metadata keys the file lacks, if any."""
    missing = [f"{arch}.{k}" for k in required if f"{arch}.{k}" not in header.metadata]
    if missing:
        return LoadError(f"{header.path}: metadata lacks {', '.join(missing)}")
    return None


def _token_ids(meta: dict[str, Any]) -> dict[str, int]:
    """bos_token_id, eos_token_id and pad_token_id, where the tokenizer has them."""
    ids: dict[str, int] = {}
    for name in ("bos", "eos", "padding"):
        token = meta.get(f"tokenizer.ggml.{name}_token_id")
        if token is not None:
            ids["pad_token_id" if name == "padding" else f"{name}_token_id"] = int(
                token
            )
    return ids


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
    header: GgufHeader,
    config: dict[str, Any],
    keep_quantized: bool,
    dtype: mx.Dtype,  # the float weights' (kept triples stay float32)
) -> dict[str, mx.array] | LoadError:
    heads: dict[str, int] = {}
    if config["model_type"] == "llama":
        heads = {
            "attn_q": config["num_attention_heads"],
            "attn_k": config["num_key_value_heads"],
        }
    gemma = config["model_type"] == GEMMA4_TEXT
    gemma3 = config["model_type"] == GEMMA3_TEXT
    weight_name = gemma4_weight_name if gemma or gemma3 else hf_weight_name
    weights: dict[str, mx.array] = {}
    try:
        with header.path.open("rb") as handle:
            for info in header.tensors:
                name = weight_name(info.name)
                if name is None:  # gemma4's rope_freqs: read into the config
                    continue
                n_heads = heads.get(info.name.split(".")[-2])
                if keep_quantized and _kept(info):
                    weights.update(_read_affine(handle.fileno(), info, name, n_heads))
                    continue
                stored = _read_stored(handle.fileno(), info, n_heads, dtype)
                if stored is not None:
                    weights[name] = stored
                    continue
                value = _read_tensor(handle.fileno(), info, n_heads)
                if gemma3 and name.endswith("norm.weight"):
                    # llama.cpp stores Gemma-3's RMSNorm weights plus one
                    # (its norm multiplies by the weight); transformers'
                    # Gemma-3 norm adds the one itself
                    value = value - np.float32(1.0)
                weights[name] = mx.array(value).astype(dtype)
    except (OSError, ValueError, NotImplementedError) as exc:
        return LoadError(f"{header.path}: cannot read tensor data: {exc}")
    return _join_split_experts(weights) if gemma else weights


_FLOAT_FILES = {
    GGMLQuantizationType.F16: "float16",
    GGMLQuantizationType.BF16: "bfloat16",
}


def file_dtype(header: GgufHeader) -> str:
    """The dtype a file's weights load in: "float16" ("bfloat16") when every
    weight matrix that is not F32 is F16 (BF16), as llama.cpp's `--outtype
    f16` (`bf16`) writes a model; else "float32", which holds every other
    type's dequantized values exactly."""
    kinds = {
        info.qtype
        for info in header.tensors
        if len(info.shape) >= 2 and info.qtype != GGMLQuantizationType.F32
    }
    if len(kinds) != 1:
        return "float32"
    return _FLOAT_FILES.get(next(iter(kinds)), "float32")


def _read_stored(
    fd: int, info: TensorInfo, n_heads: int | None, dtype: mx.Dtype
) -> mx.array | None:
    """An F16 (BF16) tensor of a float16 (bfloat16) file as stored, in HF row
    order, without a float32 copy; None for any other tensor."""
    if (
        info.qtype not in _FLOAT_FILES
        or FLOAT_DTYPES[_FLOAT_FILES[info.qtype]] != dtype
    ):
        return None
    raw = os.pread(fd, info.nbytes, info.offset)
    if len(raw) != info.nbytes:
        raise ValueError(f"{info.name}: short read ({len(raw)} of {info.nbytes} bytes)")
    # numpy has no bfloat16: its 16 bits travel as uint16 and are viewed as it
    bits = np.frombuffer(raw, dtype=np.float16 if dtype == mx.float16 else np.uint16)
    value = bits.reshape(info.shape)
    if n_heads is not None:
        value = unpermute_rope_rows(value, n_heads)
    array = mx.array(np.ascontiguousarray(value))
    return array if dtype == mx.float16 else array.view(mx.bfloat16)


def _kept(info: TensorInfo) -> bool:
    """Whether `keep_quantized` keeps this tensor quantized: a weight matrix
    (or a gemma4 file's stack of experts' matrices) of a type MLX affine
    quantization holds exactly."""
    return (
        len(info.shape) in (2, 3)
        and info.name.endswith(".weight")
        and info.qtype in AFFINE_TYPES
    )


def _read_affine(
    fd: int, info: TensorInfo, name: str, n_heads: int | None
) -> dict[str, mx.array]:
    """The tensor as MLX affine `weight`, `scales` and `biases` (HF row order:
    llama's Q/K rows unpermuted alike in all three; stacked experts [E, O, I]
    read as E * O rows)."""
    *lead, width = info.shape
    rows = int(np.prod(lead))
    arrays: tuple[np.ndarray, ...] = tuple(
        a.reshape(*lead, -1)
        for a in read_affine(fd, info.qtype, (rows, width), info.offset, info.name)
    )
    if n_heads is not None:
        arrays = tuple(unpermute_rope_rows(a, n_heads) for a in arrays)
    base = name.removesuffix(".weight")
    return {
        f"{base}.{part}": mx.array(np.ascontiguousarray(a))
        for part, a in zip(("weight", "scales", "biases"), arrays, strict=True)
    }


def _read_tensor(
    fd: int, info: TensorInfo, n_heads: int | None
) -> np.ndarray:  # [*info.shape] float32, HF row order
    block, type_size = GGML_QUANT_SIZES[info.qtype]
    width = info.shape[-1]
    rows = info.nbytes // (width // block * type_size)
    out = np.empty((rows, width), dtype=np.float32)
    step = max(1, _BLOCK_ELEMENTS // width)
    for start, count, raw in row_blocks(
        fd, info.qtype, rows, width, info.offset, step, info.name
    ):
        # one flat row of whole blocks: gguf then dequantises it in one
        # vectorised call instead of looping over groups of 16 rows
        flat = raw.reshape(1, raw.size)
        out[start : start + count] = dequantize(flat, info.qtype).reshape(count, width)
    weight = out.reshape(info.shape)
    return weight if n_heads is None else unpermute_rope_rows(weight, n_heads)


# -- Gemma-4 (llama.cpp's `gemma4`) -------------------------------------------

# GGUF name -> transformers' Gemma4ForCausalLM name (gguf-py tensor_mapping.py;
# `.scale` names: llama.cpp conversion/gemma.py, Gemma4Model.modify_tensors)
_GEMMA4_TOP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",
    "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
    "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight",
}
# after "blk.N." -> after "model.layers.N."
_GEMMA4_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "pre_ffw_norm_2.weight": "pre_feedforward_layernorm_2.weight",
    "post_ffw_norm_1.weight": "post_feedforward_layernorm_1.weight",
    "post_ffw_norm_2.weight": "post_feedforward_layernorm_2.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "router.proj.weight",
    "ffn_gate_inp.scale": "router.scale",
    "ffn_down_exps.scale": "router.per_expert_scale",
    "ffn_gate_up_exps.weight": "experts.gate_up_proj",
    "ffn_down_exps.weight": "experts.down_proj",
    # llama.cpp also loads the experts' gate and up apart; joined on load
    "ffn_gate_exps.weight": "experts.gate_proj",
    "ffn_up_exps.weight": "experts.up_proj",
    "layer_output_scale.weight": "layer_scalar",
    "inp_gate.weight": "per_layer_input_gate.weight",
    "proj.weight": "per_layer_projection.weight",
    "post_norm.weight": "post_per_layer_input_norm.weight",
}
# the full layers' RoPE frequency factors: read into the config, not a weight
ROPE_FREQS = "rope_freqs.weight"
# llama.cpp's converter writes 1e30 for a pair that does not rotate; any
# factor this large turns a float32 angle into 0 for every position
_UNROTATED = 1e20
_GEMMA4_REQUIRED = (
    "embedding_length",
    "block_count",
    "feed_forward_length",
    "attention.head_count",
    "attention.layer_norm_rms_epsilon",
    "attention.sliding_window",
    "attention.sliding_window_pattern",
    "attention.key_length_swa",
    "embedding_length_per_layer_input",
)


class _Refused(Exception):
    """A gemma4 GGUF says what a Gemma-4 config cannot; the message names it."""


def gemma4_weight_name(name: str) -> str | None:
    """The transformers name of a gemma4 GGUF tensor; None for `rope_freqs`
    (config) and tensors a Gemma-4 text model has no place for."""
    if name in _GEMMA4_TOP:
        return _GEMMA4_TOP[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
        rest = _GEMMA4_LAYER.get(parts[2])
        if rest is not None:
            return f"model.layers.{parts[1]}.{rest}"
    return None


def gemma3_config(header: GgufHeader) -> dict[str, Any] | LoadError:
    """The `gemma3_text` config.json equivalent of a gemma3 GGUF, with what
    llama.cpp's gemma3 graph fixes rather than reads: every sixth layer full
    attention, the sliding layers' RoPE at base 10,000, the softmax scale
    head_dim^-0.5 (hidden / heads for the 62-layer 27B)."""
    meta = header.metadata
    tensors = {t.name: t for t in header.tensors}
    unknown = [n for n in tensors if gemma4_weight_name(n) is None]
    embed = tensors.get("token_embd.weight")
    if unknown or embed is None:
        return LoadError(
            f"{header.path}: "
            + (
                "tensors with no place in a Gemma-3 text model: "
                + ", ".join(unknown[:5])
                if unknown
                else "no token_embd.weight tensor"
            )
        )

    def key(name: str) -> str:
        return f"{GEMMA3}.{name}"

    required = (*_REQUIRED, "attention.key_length", "attention.sliding_window")
    lacking = _lacking(header, GEMMA3, required)
    if lacking is not None:
        return lacking
    layers = int(meta[key("block_count")])
    hidden = int(meta[key("embedding_length")])
    heads = int(meta[key("attention.head_count")])
    head_dim = int(meta[key("attention.key_length")])
    full: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": float(meta.get(key("rope.freq_base"), 1_000_000.0)),
    }
    if meta.get(key("rope.scaling.type")) == "linear":
        full = {**full, "rope_type": "linear"}
        full["factor"] = float(meta.get(key("rope.scaling.factor"), 1.0))
    config: dict[str, Any] = {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": GEMMA3_TEXT,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": int(meta[key("feed_forward_length")]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(key("attention.head_count_kv"), heads)),
        "head_dim": head_dim,
        "query_pre_attn_scalar": hidden // heads if layers == 62 else head_dim,
        "sliding_window": int(meta[key("attention.sliding_window")]),
        "layer_types": [
            FULL_ATTENTION if (i + 1) % 6 == 0 else SLIDING_ATTENTION
            for i in range(layers)
        ],
        "rope_parameters": {
            SLIDING_ATTENTION: {"rope_type": "default", "rope_theta": 10_000.0},
            FULL_ATTENTION: full,
        },
        "vocab_size": embed.shape[0],
        "rms_norm_eps": float(meta.get(key("attention.layer_norm_rms_epsilon"), 1e-6)),
        "max_position_embeddings": int(meta.get(key("context_length"), 32_768)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "final_logit_softcapping": meta.get(key("final_logit_softcapping")),
        "torch_dtype": file_dtype(header),
    }
    return {**config, **_token_ids(meta)}


def gemma4_config(header: GgufHeader) -> dict[str, Any] | LoadError:
    """The `gemma4_text` config.json equivalent of a gemma4 GGUF (transformers'
    Gemma4TextConfig keys), or what it cannot say, named."""
    try:
        return _gemma4_config(header)
    except _Refused as exc:
        return LoadError(f"{header.path}: {exc}")
    except (OSError, ValueError, NotImplementedError) as exc:
        return LoadError(f"{header.path}: cannot read {ROPE_FREQS}: {exc}")


def _gemma4_config(header: GgufHeader) -> dict[str, Any]:
    meta = header.metadata
    tensors = {t.name: t for t in header.tensors}
    unknown = [n for n in tensors if n != ROPE_FREQS and gemma4_weight_name(n) is None]
    if unknown:
        raise _Refused(
            "tensors with no place in a Gemma-4 text model (transformers' "
            f"Gemma4ForCausalLM): {', '.join(unknown[:5])}"
        )
    embed = tensors.get("token_embd.weight")
    if embed is None:
        raise _Refused("no token_embd.weight tensor")

    def key(name: str) -> str:
        return f"{GEMMA4}.{name}"

    missing = [key(k) for k in _GEMMA4_REQUIRED if key(k) not in meta]
    if missing:
        raise _Refused(
            f"metadata lacks {', '.join(missing)} (llama.cpp's gemma4 needs them "
            "too): convert the checkpoint again with a current llama.cpp, or load "
            "its HF folder"
        )
    layers = int(meta[key("block_count")])
    hidden = int(meta[key("embedding_length")])
    kinds = _gemma4_layer_types(meta[key("attention.sliding_window_pattern")], layers)
    heads = _uniform(
        _per_layer(meta, key("attention.head_count"), layers, None),
        key("attention.head_count"),
    )
    if heads < 1:
        raise _Refused(f"{key('attention.head_count')} is {heads}")
    kv = _per_layer(meta, key("attention.head_count_kv"), layers, heads)
    kv_of = {
        kind: _uniform(
            [kv[i] for i in range(layers) if kinds[i] == kind],
            f"{key('attention.head_count_kv')} of the {kind} layers",
        )
        for kind in sorted(set(kinds))
    }
    dims = _gemma4_head_dims(meta, kinds, hidden // heads)
    shared = int(meta.get(key("attention.shared_kv_layers"), 0))
    if not 0 <= shared <= layers:
        raise _Refused(
            f"{key('attention.shared_kv_layers')} ({shared}) exceeds the "
            f"{layers} layers"
        )
    intermediate, double_wide = _gemma4_mlp_widths(meta, layers, shared)
    keys_are_values = _keys_are_values(tensors, kinds, layers - shared)
    kv_full, kv_sliding = kv_of[FULL_ATTENTION], kv_of.get(SLIDING_ATTENTION)
    if not keys_are_values and kv_sliding is not None and kv_full != kv_sliding:
        raise _Refused(
            f"{key('attention.head_count_kv')} gives the full layers {kv_full} KV "
            f"heads and the sliding ones {kv_sliding}, but the full layers have "
            "their own values (attn_v): transformers' Gemma-4 gives its full "
            "layers a KV head count of their own only where they take values "
            "from the keys (attention_k_eq_v)"
        )
    base = float(meta.get(key("rope.freq_base"), 10_000.0))
    with header.path.open("rb") as handle:
        partial = _proportional_rope(handle.fileno(), tensors, dims[FULL_ATTENTION])
    per_layer = int(meta[key("embedding_length_per_layer_input")])
    ple = tensors.get("per_layer_token_embd.weight")
    ple_tensors = [n for n in tensors if n.startswith("per_layer_")]
    if bool(per_layer) != bool(ple_tensors) or (per_layer and ple is None):
        raise _Refused(
            f"{key('embedding_length_per_layer_input')} is {per_layer} but the "
            f"per-layer embedding tensors are {ple_tensors or 'absent'}"
        )
    softcap = meta.get(key("final_logit_softcapping"))
    config: dict[str, Any] = {
        "architectures": ["Gemma4ForCausalLM"],
        "model_type": GEMMA4_TEXT,
        "vocab_size": embed.shape[0],
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_sliding if kv_sliding is not None else kv_full,
        "head_dim": dims[SLIDING_ATTENTION],
        "global_head_dim": dims[FULL_ATTENTION],
        "num_global_key_value_heads": kv_full if keys_are_values else None,
        "attention_k_eq_v": keys_are_values,
        "layer_types": kinds,
        "sliding_window": int(meta[key("attention.sliding_window")]),
        "rope_parameters": {
            SLIDING_ATTENTION: {
                "rope_type": "default",
                # llama.cpp: the sliding layers' base defaults to the full ones'
                "rope_theta": float(meta.get(key("rope.freq_base_swa"), base)),
            },
            FULL_ATTENTION: {
                "rope_type": "proportional",
                "partial_rotary_factor": partial,
                "rope_theta": base,
            },
        },
        "rms_norm_eps": float(meta[key("attention.layer_norm_rms_epsilon")]),
        "max_position_embeddings": int(meta.get(key("context_length"), 131_072)),
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size_per_layer_input": per_layer,
        "vocab_size_per_layer_input": (embed if ple is None else ple).shape[0],
        "num_kv_shared_layers": shared,
        "use_double_wide_mlp": double_wide,
        **_gemma4_experts(meta, tensors, layers),
        # llama.cpp: 0 or absent is no cap
        "final_logit_softcapping": float(softcap) if softcap else None,
        "attention_bias": False,
        "tie_word_embeddings": "output.weight" not in tensors,
        "torch_dtype": file_dtype(header),
    }
    return {**config, **_token_ids(meta)}


def _per_layer(
    meta: dict[str, Any], name: str, layers: int, default: int | None
) -> list[int]:
    """A key llama.cpp reads as one value or one per layer, as a list."""
    value = meta.get(name, default)
    if isinstance(value, list):
        if len(value) != layers:
            raise _Refused(f"{name} lists {len(value)} values for {layers} layers")
        return [int(v) for v in value]
    if value is None:
        raise _Refused(f"metadata lacks {name}")
    return [int(value)] * layers


def _uniform(values: list[int], what: str) -> int:
    if len(set(values)) != 1:
        raise _Refused(
            f"{what} differ per layer ({sorted(set(values))}); a Gemma-4 config "
            "has one value per layer type"
        )
    return values[0]


def _gemma4_layer_types(pattern: Any, layers: int) -> list[str]:
    """`sliding_window_pattern` (one flag per layer, true: sliding) as
    transformers' `layer_types`."""
    name = f"{GEMMA4}.attention.sliding_window_pattern"
    if not isinstance(pattern, list) or len(pattern) != layers:
        raise _Refused(
            f"{name} must flag each of the {layers} layers as sliding or not, "
            f"got {pattern!r}"
        )
    kinds = [SLIDING_ATTENTION if flag else FULL_ATTENTION for flag in pattern]
    if kinds[-1] != FULL_ATTENTION:
        raise _Refused(
            f"{name}: the last layer is sliding, but transformers' Gemma-4 makes "
            "its last layer full attention (another head width: the weights "
            "would not fit)"
        )
    return kinds


def _gemma4_head_dims(
    meta: dict[str, Any], kinds: list[str], default: int
) -> dict[str, int]:
    """Each layer type's head width; refused where values or RoPE are not as
    wide as the keys (llama.cpp's defaults: key_length = hidden / heads,
    rope.dimension_count = key_length, rope.dimension_count_swa =
    rope.dimension_count)."""
    full = int(meta.get(f"{GEMMA4}.attention.key_length", default))
    dims = {
        FULL_ATTENTION: full,
        SLIDING_ATTENTION: int(meta[f"{GEMMA4}.attention.key_length_swa"]),
    }
    rot_full = int(meta.get(f"{GEMMA4}.rope.dimension_count", full))
    rotations = {
        FULL_ATTENTION: ("", rot_full),
        SLIDING_ATTENTION: (
            "_swa",
            int(meta.get(f"{GEMMA4}.rope.dimension_count_swa", rot_full)),
        ),
    }
    for kind in sorted(set(kinds)):
        suffix, rot = rotations[kind]
        dim = dims[kind]
        width = int(meta.get(f"{GEMMA4}.attention.value_length{suffix}", dim))
        if width != dim:
            raise _Refused(
                f"{GEMMA4}.attention.value_length{suffix} ({width}) differs from "
                f"key_length{suffix} ({dim}): Gemma-4's values are as wide as "
                "its keys"
            )
        if rot != dim:
            raise _Refused(
                f"{GEMMA4}.rope.dimension_count{suffix} ({rot}) is not the "
                f"{kind} layers' head width ({dim}): Gemma-4's RoPE spans the "
                "whole head (the full layers' partial rotation is rope_freqs')"
            )
    scaling = meta.get(f"{GEMMA4}.rope.scaling.type")
    factor = meta.get(f"{GEMMA4}.rope.scaling.factor")
    if scaling not in (None, "none", "linear") or factor not in (None, 0.0, 1.0):
        raise _Refused(
            f"RoPE scaling ({GEMMA4}.rope.scaling.type {scaling!r}, factor "
            f"{factor!r}): llama.cpp scales both layer types' RoPE by it, which "
            "a Gemma-4 config cannot say; load the HF folder instead"
        )
    return dims


def _gemma4_mlp_widths(
    meta: dict[str, Any], layers: int, shared: int
) -> tuple[int, bool]:
    """intermediate_size and use_double_wide_mlp from `feed_forward_length`
    (per layer where the kv-shared layers' MLPs are twice as wide)."""
    name = f"{GEMMA4}.feed_forward_length"
    widths = _per_layer(meta, name, layers, None)
    base = widths[0]
    if len(set(widths)) == 1:
        return base, False
    first = layers - shared
    if (
        shared
        and all(w == base for w in widths[:first])
        and all(w == 2 * base for w in widths[first:])
    ):
        return base, True
    raise _Refused(
        f"{name} {widths}: Gemma-4's MLPs are all as wide, or twice as wide in "
        "the kv-shared layers (use_double_wide_mlp)"
    )


def _keys_are_values(
    tensors: dict[str, TensorInfo], kinds: list[str], first_shared: int
) -> bool:
    """attention_k_eq_v: the full layers that compute keys have no attn_v
    (llama.cpp then takes the values from the key projection)."""
    missing = {
        kinds[i] for i in range(first_shared) if f"blk.{i}.attn_v.weight" not in tensors
    }
    present = {
        kinds[i] for i in range(first_shared) if f"blk.{i}.attn_v.weight" in tensors
    }
    if SLIDING_ATTENTION in missing:
        raise _Refused(
            "sliding layers without attn_v: Gemma-4 takes the values from the "
            "keys (attention_k_eq_v) in its full layers only"
        )
    if FULL_ATTENTION in missing and FULL_ATTENTION in present:
        raise _Refused(
            "some full layers have attn_v and some not: Gemma-4's full layers "
            "take the values from the keys (attention_k_eq_v) all or none"
        )
    return FULL_ATTENTION in missing


def _proportional_rope(
    fd: int, tensors: dict[str, TensorInfo], dim: int
) -> float:  # partial_rotary_factor
    """The full layers' "proportional" RoPE from `rope_freqs`: llama.cpp
    rotates pair i at theta^(-2i/D) / factor_i, and its converter writes
    factor 1 for the first partial_rotary_factor * D/2 pairs and 1e30 for the
    others (which then do not rotate), as transformers rotates them."""
    info = tensors.get(ROPE_FREQS)
    pairs = dim // 2
    if info is None:
        raise _Refused(
            f"no {ROPE_FREQS} tensor: llama.cpp's gemma4 keeps the full layers' "
            "proportional RoPE in it"
        )
    if info.shape != (pairs,):
        raise _Refused(
            f"{ROPE_FREQS} has shape {list(info.shape)}, not [{pairs}] (half the "
            "full layers' head width, key_length)"
        )
    factors = _read_tensor(fd, info, None)
    ones = factors == 1.0
    rotated = pairs if ones.all() else int(np.argmin(ones))
    if not np.all(factors[rotated:] >= _UNROTATED):
        raise _Refused(
            f"{ROPE_FREQS} holds factors other than 1 (a rotated pair) followed by "
            f"1e30 (an unrotated one): {factors.tolist()[:8]}...; not Gemma-4's "
            "proportional RoPE"
        )
    # transformers rotates int(factor * D // 2) pairs: make that exactly `rotated`
    factor = rotated / pairs
    while int(factor * dim // 2) < rotated:
        factor = math.nextafter(factor, 2.0)
    return factor


def _gemma4_experts(
    meta: dict[str, Any], tensors: dict[str, TensorInfo], layers: int
) -> dict[str, Any]:
    """The MoE block's config keys: present (in every layer) where the file
    has the router, `ffn_gate_inp`."""
    routed = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" in tensors]
    if not routed:
        return {
            "enable_moe_block": False,
            "num_experts": None,
            "top_k_experts": None,
            "moe_intermediate_size": None,
        }
    if len(routed) != layers:
        raise _Refused(
            f"the MoE block (ffn_gate_inp) is in layers {routed} only; Gemma-4's "
            "is in every layer or none"
        )
    names = ("expert_count", "expert_used_count", "expert_feed_forward_length")
    missing = [f"{GEMMA4}.{n}" for n in names if f"{GEMMA4}.{n}" not in meta]
    if missing:
        raise _Refused(f"MoE layers, but the metadata lacks {', '.join(missing)}")
    for i in routed:
        joined = f"blk.{i}.ffn_gate_up_exps.weight" in tensors
        apart = all(f"blk.{i}.ffn_{p}_exps.weight" in tensors for p in ("gate", "up"))
        if joined == apart:
            raise _Refused(
                f"blk.{i} needs either ffn_gate_up_exps or both ffn_gate_exps "
                "and ffn_up_exps"
            )
    count, used, width = (int(meta[f"{GEMMA4}.{n}"]) for n in names)
    return {
        "enable_moe_block": True,
        "num_experts": count,
        "top_k_experts": used,
        "moe_intermediate_size": width,
    }


_SPLIT_EXPERTS = re.compile(r"\.experts\.(gate|up)_proj(\.weight|\.scales|\.biases)?$")


def _join_split_experts(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Experts stored as gate and up apart ([E, I, H] each) -> transformers'
    `experts.gate_up_proj` [E, 2I, H], gate rows first (kept quantized: each
    of the weight, scales and biases so)."""
    out: dict[str, mx.array] = {}
    for name, value in weights.items():
        found = _SPLIT_EXPERTS.search(name)
        if found is None:
            out[name] = value
        elif found.group(1) == "gate":
            stem, part = name[: found.start()], found.group(2) or ""
            up = weights[f"{stem}.experts.up_proj{part}"]
            joined = mx.concatenate([value, up], axis=1)
            out[f"{stem}.experts.gate_up_proj{part}"] = joined
    return out
