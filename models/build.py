"""Build a model from its `DecoderArgs` and load a checkpoint's weights into it.

Loading is strict: after `sanitize`, the checkpoint's names and shapes must
equal the model's parameters exactly; any difference is a `LoadError` that
names the weights. Quantized checkpoints (MLX affine, `*.scales` / `*.biases`
beside a packed `*.weight`) turn the matching layers into quantized layers
first. Bits and group size are read per layer from the packed shapes, so
mixed-precision checkpoints load too; `args.quantization` only marks a
checkpoint as quantized.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any, TypeAlias

import mlx.core as mx
import mlx.nn as nn
from attrs import evolve
from mlx.utils import tree_unflatten
from returns.result import Failure, Result, Success

from models import (
    gemma4,
    glm4_moe,
    glm_moe_dsa,
    llama,
    qwen2,
    qwen3,
    qwen3_5,
    qwen3_5_moe,
    qwen3_next,
)
from models.base import CausalLM
from models.layers import flat_parameters, model_dtype
from models.parallel import Embedding, Linear, dequantized, other_groups
from schemas.errors import ConfigError, LoadError
from schemas.hf import DecoderArgs, QuantizationConfig
from schemas.hf_gemma4 import Gemma4Args
from schemas.hf_glm4_moe import Glm4MoeArgs
from schemas.hf_glm_moe_dsa import GlmMoeDsaArgs
from schemas.hf_hybrid import HybridArgs

__all__ = [
    "ROUTER_BITS",
    "Model",
    "build_model",
    "is_router",
    "load_weights",
    "model_dtype",
    "quantization_block",
    "quantize_layers",
    "quantize_model",
    "quantized_layers",
]

Model: TypeAlias = (
    llama.Model
    | qwen2.Model
    | qwen3.Model
    | qwen3_next.Model
    | qwen3_5.Model
    | qwen3_5_moe.Model
    | glm4_moe.Model
    | glm_moe_dsa.Model
    | gemma4.Model
)


def _qwen3_next(args: DecoderArgs) -> qwen3_next.Model:
    # A qwen3_next config parses to HybridArgs (schemas/hf_hybrid.py).
    if not isinstance(args, HybridArgs):
        raise ValueError("needs HybridArgs (parse its config with hybrid_args)")
    return qwen3_next.Model(args)


def _qwen3_5(args: DecoderArgs) -> qwen3_5.Model:
    # `qwen3_5` (the multimodal wrapper) and `qwen3_5_text` parse to HybridArgs.
    if not isinstance(args, HybridArgs):
        raise ValueError("needs HybridArgs (parse its config with hybrid_args)")
    return qwen3_5.Model(args)


def _qwen3_5_moe(args: DecoderArgs) -> qwen3_5_moe.Model:
    # `qwen3_5_moe` (the multimodal wrapper) and `qwen3_5_moe_text` likewise.
    if not isinstance(args, HybridArgs):
        raise ValueError("needs HybridArgs (parse its config with hybrid_args)")
    return qwen3_5_moe.Model(args)


def _glm4_moe(args: DecoderArgs) -> glm4_moe.Model:
    # A glm4_moe config parses to Glm4MoeArgs (schemas/hf_glm4_moe.py).
    if not isinstance(args, Glm4MoeArgs):
        raise ValueError("needs Glm4MoeArgs (parse its config with glm4_moe_args)")
    return glm4_moe.Model(args)


def _glm_moe_dsa(args: DecoderArgs) -> glm_moe_dsa.Model:
    # A glm_moe_dsa config parses to GlmMoeDsaArgs (schemas/hf_glm_moe_dsa.py).
    if not isinstance(args, GlmMoeDsaArgs):
        raise ValueError("needs GlmMoeDsaArgs (parse its config with glm_moe_dsa_args)")
    return glm_moe_dsa.Model(args)


def _gemma4(args: DecoderArgs) -> gemma4.Model:
    # `gemma4` (the multimodal wrapper), `gemma4_text` and their Unified
    # versions (`gemma4_unified`, `gemma4_unified_text`) parse to Gemma4Args
    # (schemas/hf_gemma4.py).
    if not isinstance(args, Gemma4Args):
        raise ValueError("needs Gemma4Args (parse its config with gemma4_args)")
    return gemma4.Model(args)


_MODELS: dict[str, Callable[[DecoderArgs], Model]] = {
    "llama": llama.Model,
    "qwen2": qwen2.Model,
    "qwen3": qwen3.Model,
    "qwen3_next": _qwen3_next,
    "qwen3_5": _qwen3_5,
    "qwen3_5_text": _qwen3_5,
    "qwen3_5_moe": _qwen3_5_moe,
    "qwen3_5_moe_text": _qwen3_5_moe,
    "glm4_moe": _glm4_moe,
    "glm_moe_dsa": _glm_moe_dsa,
    "gemma4": _gemma4,
    "gemma4_text": _gemma4,
    "gemma4_unified": _gemma4,
    "gemma4_unified_text": _gemma4,
    "gemma3_text": _gemma4,  # Gemma-3's text model on the Gemma-4 decoder
    "gemma3": _gemma4,
}

# mypy proves here that every model satisfies the pipeline's protocol.
_AS_CAUSAL_LM: Callable[[DecoderArgs], CausalLM] = llama.Model
_HYBRID_AS_CAUSAL_LM: Callable[[HybridArgs], CausalLM] = qwen3_next.Model
_QWEN3_5_AS_CAUSAL_LM: Callable[[HybridArgs], CausalLM] = qwen3_5.Model
_QWEN3_5_MOE_AS_CAUSAL_LM: Callable[[HybridArgs], CausalLM] = qwen3_5_moe.Model
_GLM4_MOE_AS_CAUSAL_LM: Callable[[Glm4MoeArgs], CausalLM] = glm4_moe.Model
_GLM_MOE_DSA_AS_CAUSAL_LM: Callable[[GlmMoeDsaArgs], CausalLM] = glm_moe_dsa.Model
_GEMMA4_AS_CAUSAL_LM: Callable[[Gemma4Args], CausalLM] = gemma4.Model

AFFINE_BITS = (2, 3, 4, 5, 6, 8)
AFFINE_GROUPS = (32, 64, 128)  # MLX's affine group sizes
# Layers with `to_quantized` (the stacked experts of qwen3_next, glm4_moe,
# glm_moe_dsa and gemma4 included; GLM's router is a plain array and stays
# float, Gemma-4's `router.proj` is a Linear)
_QUANTIZABLE = (nn.Linear, nn.Embedding, qwen3_next.SwitchLinear)
# The bits of MoE routers (and Qwen's shared-expert gate) in a model quantized
# below them: the experts' choice is sensitive to the router's rounding, and
# the layers are small (mlx-lm's Qwen3-Next / Qwen3.5 conversions keep them at
# 8 bits too). Their paths' last parts: Qwen's `mlp.gate` and
# `shared_expert_gate`, Gemma-4's `router.proj`.
ROUTER_BITS = 8
_ROUTERS = ("mlp.gate", "shared_expert_gate", "router.proj")
_SHOWN = 5


def build_model(args: DecoderArgs) -> Result[Model, ConfigError]:
    """A model with random (lazy, never evaluated) weights; load them next."""
    make = _MODELS.get(args.model_type)
    if make is None:
        supported = ", ".join(sorted(_MODELS))
        return Failure(
            ConfigError(
                f"model_type {args.model_type!r} is not supported; supported: {supported}"
            )
        )
    try:
        return Success(make(args))
    except ValueError as exc:  # e.g. an unknown rope_type
        return Failure(ConfigError(f"model_type {args.model_type!r}: {exc}"))


def load_weights(
    model: Model, weights: Mapping[str, mx.array], args: DecoderArgs
) -> Result[None, LoadError]:
    """Sanitize, quantize the layers the checkpoint has quantized, load strictly."""
    named = model.sanitize(weights)
    return (
        _quantize_like(model, named, args)
        .bind(lambda _: _check_names_and_shapes(model, named, args))
        .map(lambda _: _assign(model, named))
    )


def quantize_model(model: Model, bits: int, group_size: int) -> None:
    """Quantize (MLX affine) every Linear / Embedding whose input width is a
    multiple of `group_size`; others stay in float. For conversion; updates
    `model.args.quantization` so a saved config records it.

    `bits` must be one of 2, 3, 4, 5, 6, 8 and `group_size` one of 32, 64, 128.
    """
    quantize_layers(model, bits, group_size)
    model.args = evolve(
        model.args, quantization=QuantizationConfig(group_size=group_size, bits=bits)
    )


def float_other_groups(module: nn.Module) -> int:
    """Replace each quantized layer whose groups MLX's own operations do not
    take (a GGUF's Q2_K, Q3_K and Q6_K groups of 16: `parallel.other_groups`)
    by a float layer of the same weights, in its scales' dtype, so that MLX
    and mlx-lm load a folder written from `module`; returns how many."""
    replaced: list[tuple[str, nn.Module]] = []
    for path, layer in module.named_modules():
        if not isinstance(
            layer,
            nn.QuantizedLinear
            | nn.QuantizedEmbedding
            | qwen3_next.QuantizedSwitchLinear,
        ):
            continue
        experts = isinstance(layer, qwen3_next.QuantizedSwitchLinear)
        if not other_groups(layer.group_size, getattr(layer, "mode", "affine")):
            continue
        biases = layer.get("biases")
        assert biases is not None, f"{path}: an affine layer without biases"
        weight = dequantized(
            layer["weight"], layer["scales"], biases, layer.group_size, layer.bits
        ).astype(layer["scales"].dtype)
        *stack, rows, inputs = (int(d) for d in weight.shape)
        floated: nn.Module
        if experts:
            floated = qwen3_next.SwitchLinear(inputs, rows, *stack)
        elif isinstance(layer, nn.QuantizedEmbedding):
            floated = Embedding(rows, inputs)
        else:
            floated = Linear(inputs, rows, bias="bias" in layer)
            if "bias" in layer:
                floated.bias = layer["bias"]
        floated.weight = weight
        replaced.append((path, floated))
    if replaced:
        module.update_modules(tree_unflatten(replaced))
    return len(replaced)


def quantize_layers(
    module: nn.Module,
    bits: int,
    group_size: int,
    where: Callable[[str, nn.Module], bool] | None = None,
) -> None:
    """`quantize_model`'s layer choice on any module (a draft head too): every
    float Linear / Embedding / stacked-expert layer whose input width is a
    multiple of `group_size` (and, given `where`, that `where(path, layer)`
    picks); norms and other layers stay in float."""
    assert bits in AFFINE_BITS, f"bits must be one of {AFFINE_BITS}"
    assert group_size in AFFINE_GROUPS, f"group_size must be one of {AFFINE_GROUPS}"
    router = {
        "group_size": group_size,
        "bits": max(bits, ROUTER_BITS),
        "mode": "affine",
    }

    def eligible(path: str, layer: nn.Module) -> bool | dict[str, Any]:
        if not (
            isinstance(layer, _QUANTIZABLE)
            and layer.weight.shape[-1] % group_size == 0
            and (where is None or where(path, layer))
        ):
            return False
        return dict(router) if is_router(path) else True

    nn.quantize(module, group_size=group_size, bits=bits, class_predicate=eligible)


def is_router(path: str) -> bool:
    """Whether the layer at `path` scores a MoE block's experts (or gates
    Qwen's shared expert): `quantize_layers` keeps these at `ROUTER_BITS`."""
    return any(path == s or path.endswith("." + s) for s in _ROUTERS)


def quantized_forms(module: nn.Module) -> dict[str, tuple[int, int]]:
    """Each quantized layer of `module` (one with `scales`): its path ->
    (group size, bits)."""
    layers: dict[str, tuple[int, int]] = {}
    for path, layer in module.named_modules():
        group_size = getattr(layer, "group_size", None)
        bits = getattr(layer, "bits", None)
        if isinstance(group_size, int) and isinstance(bits, int) and "scales" in layer:
            layers[path] = (group_size, bits)
    return layers


def quantization_block(module: nn.Module) -> dict[str, Any] | None:
    """The config `quantization` block that describes a model's or head's
    quantized layers (None when all are float): the most common bits and
    group size, and a per-layer entry (keyed by the layer's path, as mlx-lm
    writes them) for each layer that differs from them."""
    layers = quantized_forms(module)
    if not layers:
        return None
    (group_size, bits), _ = Counter(layers.values()).most_common(1)[0]
    block: dict[str, Any] = {"group_size": group_size, "bits": bits}
    for path, (g, b) in sorted(layers.items()):
        if (g, b) != (group_size, bits):
            block[path] = {"group_size": g, "bits": b}
    return block


def _quantize_like(
    model: Model, weights: Mapping[str, mx.array], args: DecoderArgs
) -> Result[None, LoadError]:
    if args.quantization is None and not any(k.endswith(".scales") for k in weights):
        return Success(None)
    settings, problems = quantized_layers(model, weights)
    if problems:
        return Failure(LoadError(f"{args.model_type}: " + "; ".join(problems[:_SHOWN])))
    nn.quantize(model, class_predicate=lambda path, _module: settings.get(path, False))
    return Success(None)


def quantized_layers(
    module: nn.Module, weights: Mapping[str, mx.array]
) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """The layers of (float) `module` that `weights` holds quantized (a
    `<path>.scales` beside a packed `<path>.weight`), each with its
    `to_quantized` arguments read from the packed shapes; and the problems
    (packed shapes that fit no affine quantization)."""
    settings: dict[str, dict[str, Any]] = {}
    problems: list[str] = []
    for path, layer in module.named_modules():
        if f"{path}.scales" not in weights or not isinstance(layer, _QUANTIZABLE):
            continue
        found = _quantized_shape(path, layer.weight.shape[-1], weights)
        if isinstance(found, str):
            problems.append(found)
        else:
            settings[path] = found
    return settings, problems


def _quantized_shape(
    path: str, in_dims: int, weights: Mapping[str, mx.array]
) -> dict[str, Any] | str:
    """`to_quantized` arguments read from the packed shapes, or a problem.

    MLX affine packs a row of `in_dims` values into `in_dims * bits / 32`
    uint32 words with one scale and one bias per `group_size` values.
    """
    packed = weights.get(f"{path}.weight")
    if packed is None:
        return f"{path}.weight is missing beside {path}.scales"
    words = packed.shape[-1]
    groups = weights[f"{path}.scales"].shape[-1]
    bits, bits_rest = divmod(words * 32, in_dims)
    group_size, group_rest = divmod(in_dims, groups) if groups else (0, 1)
    if bits_rest or group_rest or bits not in AFFINE_BITS:
        return (
            f"{path}: packed weight width {words} and {groups} scale groups do not fit "
            f"an affine quantization of {in_dims} inputs"
        )
    return {"group_size": group_size, "bits": bits, "mode": "affine"}


def _check_names_and_shapes(
    model: Model, weights: Mapping[str, mx.array], args: DecoderArgs
) -> Result[None, LoadError]:
    expected = flat_parameters(model)
    missing = sorted(expected.keys() - weights.keys())
    unexpected = sorted(weights.keys() - expected.keys())
    mismatched = [
        f"{k} {tuple(weights[k].shape)} (expected {tuple(expected[k].shape)})"
        for k in sorted(expected.keys() & weights.keys())
        if weights[k].shape != expected[k].shape
    ]
    problems = [
        _listing(what, names)
        for what, names in (
            ("missing weights", missing),
            ("unexpected weights", unexpected),
            ("weights of the wrong shape", mismatched),
        )
        if names
    ]
    if not problems:
        return Success(None)
    return Failure(
        LoadError(
            f"the checkpoint does not match a {args.model_type} model with this config: "
            + "; ".join(problems)
        )
    )


def _listing(what: str, names: list[str]) -> str:
    shown = ", ".join(names[:_SHOWN])
    more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return f"{len(names)} {what}: {shown}{more}"


def row_major(weights: Mapping[str, mx.array]) -> dict[str, mx.array]:
    """The weights as row-major arrays, ready to assign to a module.

    A sanitizer's slices (a fused `gate_up_proj` split in two, a transposed
    layout) are strided views of the checkpoint's arrays. MLX's CUDA kernels
    misread some views: on an H100 (mlx-cuda 0.32.4) the expert-grouped
    `gather_mm`, which a MoE block takes from `SwitchGLU.SORT_MIN`
    (token, expert) pairs on, gave a tiny Qwen3-Next's 63-token prefill
    wrong logits from position 0 with the halves of a fused `gate_up_proj`,
    and right ones once every weight was copied row-major. A weight that is
    already row-major is not copied."""
    return {name: mx.contiguous(value) for name, value in weights.items()}


def _assign(model: Model, weights: Mapping[str, mx.array]) -> None:
    model.update(tree_unflatten(list(row_major(weights).items())))
