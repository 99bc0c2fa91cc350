"""Hand-written stubs for the parts of `mlx.nn` this project uses.

mypy cannot follow mlx.nn's star re-exports, so `nn.Module` is undefined
without these. `typings/mlx` stays a namespace directory (no `__init__.pyi`)
so `mlx.core` still resolves to the stubs that ship in site-packages.
"""

from collections.abc import Callable
from typing import Any, Self

import mlx.core as mx

class Module(dict[str, Any]):
    def __init__(self) -> None: ...
    @property
    def training(self) -> bool: ...
    @property
    def state(self) -> dict[str, Any]: ...
    def load_weights(
        self,
        file_or_weights: str | list[tuple[str, mx.array]],
        strict: bool = True,
    ) -> Self: ...
    def save_weights(self, file: str) -> None: ...
    @staticmethod
    def is_module(value: object) -> bool: ...
    @staticmethod
    def valid_child_filter(module: Module, key: str, value: object) -> bool: ...
    @staticmethod
    def valid_parameter_filter(module: Module, key: str, value: object) -> bool: ...
    @staticmethod
    def trainable_parameter_filter(module: Module, key: str, value: object) -> bool: ...
    def filter_and_map(
        self,
        filter_fn: Callable[[Module, str, Any], bool],
        map_fn: Callable[[Any], Any] | None = None,
        is_leaf_fn: Callable[[Module, str, Any], bool] | None = None,
    ) -> dict[str, Any]: ...
    def parameters(self) -> dict[str, Any]: ...
    def trainable_parameters(self) -> dict[str, Any]: ...
    def children(self) -> dict[str, Any]: ...
    def leaf_modules(self) -> dict[str, Any]: ...
    # mlx overrides dict.update with a different signature.
    def update(  # type: ignore[override]
        self, parameters: dict[str, Any], strict: bool = True
    ) -> Self: ...
    def apply(
        self,
        map_fn: Callable[[mx.array], mx.array],
        filter_fn: Callable[[Module, str, Any], bool] | None = None,
    ) -> Self: ...
    def update_modules(self, modules: dict[str, Any], strict: bool = True) -> Self: ...
    def apply_to_modules(self, apply_fn: Callable[[str, Module], Any]) -> Self: ...
    def modules(self) -> list[Module]: ...
    def named_modules(self) -> list[tuple[str, Module]]: ...
    def freeze(
        self,
        *,
        recurse: bool = True,
        keys: str | list[str] | None = None,
        strict: bool = False,
    ) -> Self: ...
    def unfreeze(
        self,
        *,
        recurse: bool = True,
        keys: str | list[str] | None = None,
        strict: bool = False,
    ) -> Self: ...
    def train(self, mode: bool = True) -> Self: ...
    def eval(self) -> Self: ...
    def set_dtype(
        self,
        dtype: mx.Dtype,
        predicate: Callable[[mx.Dtype], bool] | None = ...,
    ) -> None: ...

class Identity(Module):
    def __init__(self, *args: Any, **kwargs: Any) -> None: ...
    def __call__(self, x: mx.array) -> mx.array: ...

class Sequential(Module):
    layers: list[Callable[[mx.array], mx.array]]
    def __init__(self, *modules: Callable[[mx.array], mx.array]) -> None: ...
    def __call__(self, x: mx.array) -> mx.array: ...

class Linear(Module):
    weight: mx.array  # [O, I]
    bias: mx.array  # [O]
    def __init__(
        self, input_dims: int, output_dims: int, bias: bool = True
    ) -> None: ...
    def __call__(self, x: mx.array) -> mx.array: ...
    def to_quantized(
        self,
        group_size: int | None = None,
        bits: int | None = None,
        mode: str = "affine",
        quantize_input: bool = False,
    ) -> Module: ...

class Embedding(Module):
    weight: mx.array  # [V, D]
    def __init__(self, num_embeddings: int, dims: int) -> None: ...
    def __call__(self, x: mx.array) -> mx.array: ...
    def as_linear(self, x: mx.array) -> mx.array: ...
    def to_quantized(
        self,
        group_size: int | None = None,
        bits: int | None = None,
        mode: str = "affine",
        quantize_input: bool = False,
    ) -> Module: ...

class QuantizedLinear(Module):
    group_size: int
    bits: int
    mode: str
    weight: mx.array  # [O, I * bits / 32] packed uint32
    scales: mx.array  # [O, I / group_size]
    biases: mx.array | None  # [O, I / group_size]
    bias: mx.array  # [O]
    def __init__(
        self,
        input_dims: int,
        output_dims: int,
        bias: bool = True,
        group_size: int | None = None,
        bits: int | None = None,
        mode: str = "affine",
    ) -> None: ...
    def __call__(self, x: mx.array) -> mx.array: ...
    @classmethod
    def from_linear(
        cls,
        linear_layer: Module,
        group_size: int | None = None,
        bits: int | None = None,
        mode: str = "affine",
    ) -> QuantizedLinear: ...

class QuantizedEmbedding(Module):
    group_size: int
    bits: int
    mode: str
    num_embeddings: int
    dims: int
    weight: mx.array  # [V, D * bits / 32] packed uint32
    scales: mx.array  # [V, D / group_size]
    biases: mx.array | None  # [V, D / group_size]
    def __init__(
        self,
        num_embeddings: int,
        dims: int,
        group_size: int | None = None,
        bits: int | None = None,
        mode: str = "affine",
    ) -> None: ...
    def __call__(self, x: mx.array) -> mx.array: ...
    def as_linear(self, x: mx.array) -> mx.array: ...
    @classmethod
    def from_embedding(
        cls,
        embedding_layer: Module,
        group_size: int | None = None,
        bits: int | None = None,
        mode: str = "affine",
    ) -> QuantizedEmbedding: ...

def quantize(
    model: Module,
    group_size: int | None = None,
    bits: int | None = None,
    *,
    mode: str = "affine",
    quantize_input: bool = False,
    class_predicate: Callable[[str, Module], bool | dict[str, Any]] | None = None,
) -> None: ...

class RMSNorm(Module):
    weight: mx.array  # [D]
    eps: float
    def __init__(self, dims: int, eps: float = 1e-5) -> None: ...
    def __call__(self, x: mx.array) -> mx.array: ...

class LayerNorm(Module):
    weight: mx.array  # [D]
    bias: mx.array  # [D]
    eps: float
    def __init__(
        self, dims: int, eps: float = 1e-5, affine: bool = True, bias: bool = True
    ) -> None: ...
    def __call__(self, x: mx.array) -> mx.array: ...

class Conv1d(Module):
    weight: mx.array  # [C_out, K, C_in / groups]
    bias: mx.array  # [C_out]
    stride: int
    padding: int
    dilation: int
    groups: int
    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        stride: int = 1,
        padding: int = 0,
        dilation: int = 1,
        groups: int = 1,
        bias: bool = True,
    ) -> None: ...
    def __call__(self, x: mx.array) -> mx.array: ...

class Dropout(Module):
    def __init__(self, p: float = 0.5) -> None: ...
    def __call__(self, x: mx.array) -> mx.array: ...

def silu(x: mx.array) -> mx.array: ...
def gelu(x: mx.array) -> mx.array: ...
def gelu_approx(x: mx.array) -> mx.array: ...
def gelu_fast_approx(x: mx.array) -> mx.array: ...
def relu(x: mx.array) -> mx.array: ...
def sigmoid(x: mx.array) -> mx.array: ...
def softplus(x: mx.array) -> mx.array: ...
def tanh(x: mx.array) -> mx.array: ...
def softmax(x: mx.array, axis: int = -1) -> mx.array: ...
def log_softmax(x: mx.array, axis: int = -1) -> mx.array: ...
def log_sigmoid(x: mx.array) -> mx.array: ...
def glu(x: mx.array, axis: int = -1) -> mx.array: ...
