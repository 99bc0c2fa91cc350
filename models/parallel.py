"""Weight products split over CPU threads.

MLX's CPU backend runs each stream's work on one thread, so a model decoded
on the CPU uses one core however many the machine has (on Linux the bundled
BLAS is single-threaded too, and an OpenBLAS routed in by models/blas.py is
set to one thread). Every projection in these models goes through
`project`, which on the CPU splits the weight by output rows into one block
per thread, multiplies each block on its own CPU stream (its own thread) and
concatenates the blocks. Each output value is still one dot product over the
same inputs by the same kernel, so the result is bit-identical to the
unsplit product (tests/models/test_parallel.py checks that).

On a GPU, and for products too small to be worth a thread handoff, nothing
is split. bfloat16 weights on the CPU go to `models/cpu_kernel.py` instead
(a vectorised kernel that threads its own products). The thread count defaults to the CPUs this process may run on
(Linux; 1 on macOS, whose Accelerate BLAS threads its own products); the
environment variable `SPECPIPE_CPU_THREADS` or `set_cpu_threads` overrides it
(1 turns the split off).

Where MLX has its CUDA backend the count is 1 whatever is asked (with a
warning when more was): on an H200 (mlx-cuda 0.32.4), decoding a model on
the GPU and then the same weights on the CPU in one process, with the CPU
products split over 16 streams, crashed, hung or gave wrong logits (a
relative error of 1.4e-2) in each of seven runs, and was right in every run
without the split or with the weights copied into CPU-made arrays first
(bench/RESULTS.md, twentieth session). MLX's operations alone, split the
same way over GPU-made arrays, did not fail (bench/cpu_streams_probe.py),
so the trigger is not pinned down; the CPU is a fallback on such a machine.
"""

from __future__ import annotations

import os
import platform
import warnings
from functools import cache
from typing import TypeVar

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from models import cpu_kernel

# Products with fewer than this many weights (inputs x outputs) stay whole:
# below ~0.5M weights a CPU product takes well under a millisecond and the
# handoff between threads is a visible share of it.
MIN_SPLIT_WEIGHTS = 1 << 19

_ENV = "SPECPIPE_CPU_THREADS"
_threads: int | None = None
_warned = False  # the CUDA backend's one-thread warning given


def _detected_threads() -> int:
    if platform.system() == "Darwin" or _cuda_backend():
        return 1
    affinity = getattr(os, "sched_getaffinity", None)
    count = len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)
    return max(1, min(count, 16))


def _env_threads() -> int | None:
    raw = os.environ.get(_ENV)
    if raw is None or not raw.strip():
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(
            f"{_ENV}={raw!r} is not a whole number; set it to the number of CPU "
            "threads to use (1 turns the split off) or unset it"
        ) from None
    if value < 1:
        raise ValueError(f"{_ENV}={raw!r} must be at least 1 (1 turns the split off)")
    return value


@cache
def _cuda_backend() -> bool:
    """Whether this MLX has its CUDA backend and a device for it."""
    cuda = getattr(mx, "cuda", None)
    return cuda is not None and bool(cuda.is_available())


def cpu_threads() -> int:
    """The number of CPU threads a product is split over."""
    global _threads, _warned
    if _threads is None:
        _threads = _env_threads() or _detected_threads()
    if _threads > 1 and _cuda_backend():
        if not _warned:
            _warned = True
            warnings.warn(
                f"{_threads} CPU threads were asked for (SPECPIPE_CPU_THREADS or "
                "set_cpu_threads), but CPU products are not split where MLX has its "
                "CUDA backend (split products of GPU-made arrays went wrong there: "
                "models/parallel.py); using 1",
                RuntimeWarning,
                stacklevel=2,
            )
        return 1
    return _threads


def set_cpu_threads(count: int | None) -> None:
    """Split CPU products over `count` threads (1: no split; None: detect again)."""
    global _threads
    if count is not None and count < 1:
        raise ValueError(f"CPU threads must be at least 1, got {count}")
    _threads = count


@cache
def _streams(count: int) -> tuple[mx.Stream, ...]:
    return tuple(mx.new_stream(mx.cpu) for _ in range(count))


def _blocks(x: mx.array, rows: int) -> int:
    """How many row blocks a product of `x` with `rows` output rows splits into."""
    if mx.default_device().type != mx.DeviceType.cpu:
        return 1
    threads = cpu_threads()
    if threads < 2 or rows < 2 * threads or rows * x.shape[-1] < MIN_SPLIT_WEIGHTS:
        return 1
    return threads


def project(
    x: mx.array,  # [..., I]
    weight: mx.array,  # [O, I] float, or [O, I * bits / 32] packed
    scales: mx.array | None = None,
    biases: mx.array | None = None,
    *,
    group_size: int = 64,
    bits: int = 0,  # 0: float weight
    mode: str = "affine",
    bias: mx.array | None = None,  # [O], added inside the float product
) -> mx.array:  # [..., O]
    """`x @ weight.T (+ bias)` (quantized when `bits`), split over CPU threads.

    A float product adds `bias` inside the product (`addmm`, as `nn.Linear`
    does: one rounding); a quantized one adds it after, as
    `nn.QuantizedLinear` does."""

    if bits and mode == "affine" and scales is not None:
        scales, biases, group_size = gpu_safe_groups(
            scales, biases, group_size, mx.default_device()
        )

    def product(rows: slice, stream: mx.Stream | None) -> mx.array:
        if not bits:
            if bias is not None:
                return mx.addmm(bias[rows], x, weight[rows].T, stream=stream)
            return mx.matmul(x, weight[rows].T, stream=stream)
        assert scales is not None, "a quantized product needs its scales"
        if other_groups(group_size, mode):
            # (K types' groups of 16 off the CPU kernel: its weights in float32,
            # the product accumulated in float32 as the kernel's is)
            assert biases is not None, "an affine product needs its biases"
            dense = dequantized(
                weight[rows], scales[rows], biases[rows], group_size, bits
            )
            y32 = mx.matmul(x.astype(mx.float32), dense.T, stream=stream)
            return y32.astype(x.dtype)
        return mx.quantized_matmul(
            x,
            weight[rows],
            scales[rows],
            biases[rows] if biases is not None else None,
            transpose=True,
            group_size=group_size,
            bits=bits,
            mode=mode,
            stream=stream,
        )

    if (
        bits
        and scales is not None
        and biases is not None
        and cpu_kernel.affine_usable(weight, bits, group_size, mode)
    ):
        # affine weights on the CPU: unpacked once per call, threaded on its own
        out = cpu_kernel.affine_product(
            x, weight, scales, biases, bits, group_size, cpu_threads()
        )
        if out is not None:
            return out + bias if bias is not None else out
    if not bits and cpu_kernel.usable(weight):
        # bf16 on the CPU: the vectorised kernel, threaded on its own
        out = cpu_kernel.bf16_product(x, weight, bias, cpu_threads())
        if out is not None:
            return out
    rows = int(weight.shape[0])
    count = 1 if bits and other_groups(group_size, mode) else _blocks(x, rows)
    if count == 1:
        y = product(slice(None), None)
    else:
        step = -(-rows // count)
        parts = [
            product(slice(start, min(start + step, rows)), stream)
            for start, stream in zip(
                range(0, rows, step), _streams(count), strict=False
            )
        ]
        y = mx.concatenate(parts, axis=-1)
    return y + bias if bits and bias is not None else y


# The group sizes MLX's affine operations take throughout (mlx 0.32.4: its
# `quantize`, and so its quantized layers' construction and mlx-lm's loading,
# refuses 16; its CPU product takes 16 for one input row and refuses it for
# more; its CPU dequantize takes it). A GGUF's Q2_K, Q3_K and Q6_K blocks
# load as groups of 16 (models/gguf_quant.py): the CPU kernel multiplies
# them as they are; elsewhere (a GPU, a traced product, a CPU without the
# kernel) `dequantized` expands them to float32 for each product.
MLX_GROUP_SIZES = (32, 64, 128)


def unpacked(weight: mx.array, bits: int) -> mx.array:
    """MLX affine's packed values as uint32: [..., W] words -> [..., W * 32 /
    bits] values (value i at bit i * bits of the row's little-endian bit
    stream; one value may span two words)."""
    words = int(weight.shape[-1])
    at = np.arange(words * 32 // bits, dtype=np.int64) * bits
    first, shift = at // 32, at % 32
    spans = shift + bits > 32
    low = mx.take(weight, mx.array(first.astype(np.int32)), axis=-1) >> mx.array(
        shift.astype(np.uint32)
    )
    high = mx.take(
        weight, mx.array(np.minimum(first + 1, words - 1).astype(np.int32)), axis=-1
    ) << mx.array(np.where(spans, 32 - shift, 0).astype(np.uint32))
    high = high & mx.array(np.where(spans, 0xFFFFFFFF, 0).astype(np.uint32))
    return (low | high) & mx.array((1 << bits) - 1, dtype=mx.uint32)


def dequantized(
    weight: mx.array,  # [..., I * bits / 32] uint32
    scales: mx.array,  # [..., I / group_size]
    biases: mx.array,  # [..., I / group_size]
    group_size: int,
    bits: int,
) -> mx.array:  # [..., I] float32
    """An affine weight's values, scale * q + bias (each rounded, as the CPU
    kernel computes them), for any group size (MLX's own operations take
    groups of 16 in some cases only: `MLX_GROUP_SIZES`)."""
    q = unpacked(weight, bits).astype(mx.float32)
    lead = tuple(q.shape[:-1])
    grouped = q.reshape(*lead, -1, group_size)
    s = scales.astype(mx.float32)[..., None]
    b = biases.astype(mx.float32)[..., None]
    return ((grouped * s) + b).reshape(*lead, -1)


_Q = TypeVar("_Q", bound=nn.QuantizedLinear | nn.QuantizedEmbedding)


def _placeholder(
    cls: type[_Q],
    source: nn.Module,
    group_size: int | None,
    bits: int | None,
    mode: str,
) -> _Q:
    """A `cls` layer for `source`'s weight shape in groups MLX's operations
    do not take, holding placeholder arrays (a checkpoint's replace them):
    built without `mx.quantize`, which takes MLX's group sizes only."""
    assert group_size is not None and bits is not None
    rows, inputs = source["weight"].shape
    layer = cls.__new__(cls)
    nn.Module.__init__(layer)
    layer.group_size, layer.bits, layer.mode = group_size, bits, mode
    layer.weight = mx.zeros((rows, inputs * bits // 32), dtype=mx.uint32)
    layer.scales = mx.zeros((rows, inputs // group_size), dtype=mx.float32)
    layer.biases = mx.zeros((rows, inputs // group_size), dtype=mx.float32)
    return layer


def other_groups(group_size: int | None, mode: str = "affine") -> bool:
    """Whether an affine layer's groups are ones MLX's operations do not take
    (a GGUF's K types' 16): the CPU kernel's, or `dequantized`'s."""
    return (
        mode == "affine"
        and group_size is not None
        and group_size not in MLX_GROUP_SIZES
    )


# MLX's CUDA quantized product (mlx-cuda 0.32.4, transposed weights, as
# nn.QuantizedLinear calls it) is wrong for more than one input row when a
# weight row is a single group of 64 or 128 values: errors of the size of the
# outputs, at 4 and 8 bits, float32 and bfloat16 inputs (H100,
# bench/quant_probe.py). One row is right, and so are 32-value single groups
# and every width of two or more groups.
_SINGLE_GROUP_SIZES = (64, 128)


def gpu_safe_groups(
    scales: mx.array,  # [..., O, groups]
    biases: mx.array | None,
    group_size: int,
    device: mx.Device,
) -> tuple[mx.array, mx.array | None, int]:
    """The same affine weight in groups MLX's GPU product computes right.

    On a GPU, a weight whose rows are one group of 64 or 128 values is
    described again as two groups of half the size, each with the whole
    row's scale and bias: every weight dequantizes to the same value, and
    the packed words are unchanged (they hold values, not groups). Elsewhere
    (and for every other shape) the arguments come back as they are."""
    if (
        device.type == mx.DeviceType.cpu
        or group_size not in _SINGLE_GROUP_SIZES
        or scales.shape[-1] != 1
    ):
        return scales, biases, group_size
    # Fresh row-major arrays: MLX's GPU product refuses ("No implementation for
    # problem shape") scales or biases with a zero stride, which `repeat` of a
    # one-column array can give.
    return (
        mx.concatenate([scales, scales], axis=-1),
        mx.concatenate([biases, biases], axis=-1) if biases is not None else None,
        group_size // 2,
    )


class Linear(nn.Linear):
    """`nn.Linear` whose product is split over CPU threads."""

    def __call__(self, x: mx.array) -> mx.array:
        return project(x, self.weight, bias=self.get("bias"))

    def to_quantized(
        self,
        group_size: int | None = None,
        bits: int | None = None,
        mode: str = "affine",
        quantize_input: bool = False,
    ) -> nn.Module:
        if mode != "affine" or quantize_input:
            return super().to_quantized(group_size, bits, mode, quantize_input)
        return QuantizedLinear.from_linear(self, group_size, bits, mode)


def _quantized_product(
    layer: nn.QuantizedLinear | nn.QuantizedEmbedding,
    x: mx.array,
    bias: mx.array | None = None,
) -> mx.array:
    return project(
        x,
        layer["weight"],
        layer["scales"],
        layer.get("biases"),
        group_size=layer.group_size,
        bits=layer.bits,
        mode=layer.mode,
        bias=bias,
    )


class QuantizedLinear(nn.QuantizedLinear):
    """`nn.QuantizedLinear` whose product is split over CPU threads (and
    which holds K types' groups of 16 too)."""

    def __call__(self, x: mx.array) -> mx.array:
        return _quantized_product(self, x, self.get("bias"))

    @classmethod
    def from_linear(
        cls,
        linear_layer: nn.Module,
        group_size: int | None = None,
        bits: int | None = None,
        mode: str = "affine",
    ) -> QuantizedLinear:
        if not other_groups(group_size, mode):
            layer = super().from_linear(linear_layer, group_size, bits, mode)
            assert isinstance(layer, QuantizedLinear)
            return layer
        layer = _placeholder(cls, linear_layer, group_size, bits, mode)
        if "bias" in linear_layer:
            layer.bias = linear_layer["bias"]
        layer.freeze()
        return layer


class Embedding(nn.Embedding):
    """`nn.Embedding` whose tied-head use (`as_linear`) is split over CPU threads."""

    def as_linear(self, x: mx.array) -> mx.array:
        return project(x, self.weight)

    def to_quantized(
        self,
        group_size: int | None = None,
        bits: int | None = None,
        mode: str = "affine",
        quantize_input: bool = False,
    ) -> nn.Module:
        if mode != "affine" or quantize_input:
            return super().to_quantized(group_size, bits, mode, quantize_input)
        return QuantizedEmbedding.from_embedding(self, group_size, bits, mode)


class QuantizedEmbedding(nn.QuantizedEmbedding):
    """`nn.QuantizedEmbedding` whose `as_linear` is split over CPU threads
    (and which holds K types' groups of 16 too)."""

    def __call__(self, x: mx.array) -> mx.array:
        if not other_groups(self.group_size, self.mode):
            return super().__call__(x)
        biases = self.get("biases")
        assert biases is not None, "an affine embedding needs its biases"
        return dequantized(
            self["weight"][x], self["scales"][x], biases[x], self.group_size, self.bits
        )

    def as_linear(self, x: mx.array) -> mx.array:
        return _quantized_product(self, x)

    @classmethod
    def from_embedding(
        cls,
        embedding_layer: nn.Module,
        group_size: int | None = None,
        bits: int | None = None,
        mode: str = "affine",
    ) -> QuantizedEmbedding:
        if not other_groups(group_size, mode):
            layer = super().from_embedding(embedding_layer, group_size, bits, mode)
            assert isinstance(layer, QuantizedEmbedding)
            return layer
        layer = _placeholder(cls, embedding_layer, group_size, bits, mode)
        layer.num_embeddings, layer.dims = embedding_layer["weight"].shape
        layer.freeze()
        return layer
