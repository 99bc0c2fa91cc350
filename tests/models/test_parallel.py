"""Products split over CPU threads (models/parallel.py) equal unsplit ones, bit for bit.

Splitting by output rows leaves each output value one dot product over the
same inputs, so split and unsplit products must agree exactly, float and
quantized, for thread counts that divide the rows and ones that do not; a
whole model's logits must agree exactly too.
"""

from __future__ import annotations

from collections.abc import Iterator

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import models.parallel as parallel
from models.build import build_model, quantize_model
from models.parallel import (
    Embedding,
    Linear,
    QuantizedEmbedding,
    QuantizedLinear,
    project,
)
from tests.devices import needs_cpu_build
from tests.models.decoder_support import tiny_args


@pytest.fixture(autouse=True)
def split_everything(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Split even the tiny products of these tests; restore the thread count.
    bf16 and quantized products take MLX's split path here, not the CPU
    kernels (their own tests: tests/models/test_cpu_kernel.py)."""
    monkeypatch.setattr(parallel, "MIN_SPLIT_WEIGHTS", 0)
    monkeypatch.setattr(parallel.cpu_kernel, "usable", lambda _weight: False)
    monkeypatch.setattr(parallel.cpu_kernel, "affine_usable", lambda *_: False)
    yield
    parallel.set_cpu_threads(None)


def _same(a: mx.array, b: mx.array) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert np.array_equal(
        np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32))
    )


@needs_cpu_build
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
@pytest.mark.parametrize("threads", [2, 3, 4])
@pytest.mark.parametrize("window", [1, 5])
def test_float_product_split_equals_whole(
    dtype: mx.Dtype, threads: int, window: int
) -> None:
    mx.random.seed(threads * 10 + window)
    weight = mx.random.normal((250, 96)).astype(
        dtype
    )  # 250 rows: not divisible by 3 or 4
    x = mx.random.normal((2, window, 96)).astype(dtype)
    parallel.set_cpu_threads(1)
    whole = project(x, weight)
    parallel.set_cpu_threads(threads)
    assert parallel._blocks(x, 250) == threads
    _same(project(x, weight), whole)
    _same(whole, x @ weight.T)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("window", [1, 5, 28])
@pytest.mark.parametrize("bias", [False, True])
def test_split_layers_equal_mlx_layers(
    dtype: mx.Dtype, window: int, bias: bool
) -> None:
    """The layers compute exactly what MLX's own do (a float bias is added
    inside the product, `addmm`, not after it: one rounding, not two)."""
    mx.random.seed(window)
    reference = nn.Linear(96, 250, bias=bias)
    reference.set_dtype(dtype)
    ours = Linear(96, 250, bias=bias)
    ours.update(reference.parameters())
    x = mx.random.normal((2, window, 96)).astype(dtype)
    parallel.set_cpu_threads(3)
    _same(ours(x), reference(x))
    q_reference = reference.to_quantized(group_size=32, bits=4)
    q_ours = ours.to_quantized(group_size=32, bits=4)
    assert isinstance(q_ours, QuantizedLinear)
    _same(q_ours(x), q_reference(x))
    table = nn.Embedding(250, 96)
    table.set_dtype(dtype)
    split_table = Embedding(250, 96)
    split_table.update(table.parameters())
    _same(split_table.as_linear(x), table.as_linear(x))
    q_table = split_table.to_quantized(group_size=32, bits=8)
    assert isinstance(q_table, QuantizedEmbedding)
    _same(q_table.as_linear(x), table.to_quantized(group_size=32, bits=8).as_linear(x))


@needs_cpu_build
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("threads", [2, 3])
def test_quantized_product_split_equals_whole(bits: int, threads: int) -> None:
    mx.random.seed(bits + threads)
    weight = mx.random.normal((130, 128))
    packed, scales, biases = mx.quantize(weight, group_size=64, bits=bits)
    x = mx.random.normal((3, 128))
    expected = mx.quantized_matmul(
        x, packed, scales, biases, transpose=True, group_size=64, bits=bits
    )
    parallel.set_cpu_threads(threads)
    assert parallel._blocks(x, 130) == threads
    _same(project(x, packed, scales, biases, group_size=64, bits=bits), expected)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("bits", [0, 4])
def test_model_logits_split_equal_whole(tied: bool, bits: int) -> None:
    mx.random.seed(7)
    model = build_model(tiny_args(tie_word_embeddings=tied)).unwrap()
    if bits:
        quantize_model(model, bits, 64)
        assert isinstance(model.model.layers[0].mlp.gate_proj, QuantizedLinear)
        if tied:
            assert isinstance(model.model.embed_tokens, QuantizedEmbedding)
    else:
        assert isinstance(model.model.layers[0].mlp.gate_proj, Linear)
    mx.eval(model.parameters())
    ids = mx.array([[5, 17, 99, 3, 250, 42, 8], [1, 2, 3, 4, 5, 6, 7]], dtype=mx.int32)

    def logits(threads: int) -> mx.array:
        parallel.set_cpu_threads(threads)
        cache = model.make_cache(2)
        cache.reserve(16)
        first = model(ids[:, :5], cache, [0, 0]).logits
        rest = model(ids[:, 5:], cache, [5, 5]).logits
        return mx.concatenate([first, rest], axis=1)

    _same(logits(3), logits(1))


@needs_cpu_build
def test_small_products_stay_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    parallel.set_cpu_threads(2)
    x = mx.zeros((1, 64))
    assert parallel._blocks(x, 3) == 1  # fewer rows than two per thread
    monkeypatch.setattr(parallel, "MIN_SPLIT_WEIGHTS", 64 * 100 + 1)
    assert parallel._blocks(x, 100) == 1
    assert parallel._blocks(x, 101) == 2


@needs_cpu_build
def test_thread_count_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="at least 1"):
        parallel.set_cpu_threads(0)
    parallel.set_cpu_threads(None)
    monkeypatch.setenv("SPECPIPE_CPU_THREADS", "3")
    assert parallel.cpu_threads() == 3
    parallel.set_cpu_threads(None)
    monkeypatch.setenv("SPECPIPE_CPU_THREADS", "many")
    with pytest.raises(
        ValueError, match="SPECPIPE_CPU_THREADS='many' is not a whole number"
    ):
        parallel.cpu_threads()
    parallel.set_cpu_threads(None)
    monkeypatch.setenv("SPECPIPE_CPU_THREADS", "0")
    with pytest.raises(ValueError, match="must be at least 1"):
        parallel.cpu_threads()
    parallel.set_cpu_threads(None)
    monkeypatch.delenv("SPECPIPE_CPU_THREADS")
    assert parallel.cpu_threads() >= 1


def test_no_split_where_mlx_has_its_cuda_backend(
    monkeypatch: pytest.MonkeyPatch, cpu_default: None
) -> None:
    """On MLX's CUDA build CPU products stay whole (split products of GPU-made
    arrays went wrong on an H200): by default, and with a warning when more
    threads are asked for."""
    monkeypatch.setattr(parallel, "_cuda_backend", lambda: True)
    monkeypatch.setattr(parallel, "_warned", False)
    monkeypatch.delenv("SPECPIPE_CPU_THREADS", raising=False)
    parallel.set_cpu_threads(None)
    assert parallel.cpu_threads() == 1
    assert parallel._blocks(mx.zeros((1, 64)), 1000) == 1
    parallel.set_cpu_threads(4)
    with pytest.warns(RuntimeWarning, match="4 CPU threads were asked for.*using 1"):
        assert parallel.cpu_threads() == 1
    assert parallel._blocks(mx.zeros((1, 64)), 1000) == 1
    monkeypatch.setattr(parallel, "_cuda_backend", lambda: False)
    assert parallel.cpu_threads() == 4
    assert parallel._blocks(mx.zeros((1, 64)), 1000) == 4


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [64, 128])
def test_single_group_weights_are_regrouped_on_a_gpu(
    monkeypatch: pytest.MonkeyPatch, bits: int, group: int
) -> None:
    """MLX's CUDA product is wrong for several rows when a weight row is one
    group of 64 or 128 (bench/quant_probe.py): on a GPU such a weight is
    described as two half groups, which dequantize to the very same weights
    and multiply to the same product; on the CPU nothing changes."""
    mx.random.seed(group + bits)
    packed, scales, biases = mx.quantize(
        mx.random.normal((40, group)), group_size=group, bits=bits
    )
    kept = parallel.gpu_safe_groups(scales, biases, group, mx.Device(mx.cpu))
    assert kept[0] is scales and kept[1] is biases and kept[2] == group
    twice, twice_biases, half = parallel.gpu_safe_groups(
        scales, biases, group, mx.Device(mx.gpu)
    )
    assert half == group // 2 and twice.shape == (40, 2)
    assert twice_biases is not None
    mx.eval(twice, twice_biases)
    # row-major: MLX's CUDA product refuses scales or biases with a zero stride
    assert memoryview(twice).c_contiguous and memoryview(twice_biases).c_contiguous
    _same(
        mx.dequantize(packed, twice, twice_biases, half, bits),
        mx.dequantize(packed, scales, biases, group, bits),
    )
    x = mx.random.normal((5, group))
    cpu = project(x, packed, scales, biases, group_size=group, bits=bits)
    asked: list[int] = []
    quantized_matmul = mx.quantized_matmul

    def spy(*args: object, **kwargs: object) -> mx.array:
        asked.append(int(kwargs["group_size"]))
        return quantized_matmul(*args, **kwargs)

    monkeypatch.setattr(parallel.mx, "quantized_matmul", spy)
    monkeypatch.setattr(parallel.mx, "default_device", lambda: mx.Device(mx.gpu))
    gpu_form = project(x, packed, scales, biases, group_size=group, bits=bits)
    monkeypatch.undo()
    assert asked == [group // 2]
    _same(gpu_form, cpu)


@pytest.mark.parametrize(
    ("group", "width"), [(32, 32), (64, 128), (64, 192), (128, 256)]
)
def test_other_weights_keep_their_groups_on_a_gpu(group: int, width: int) -> None:
    """32-value single groups and rows of two or more groups are right on a
    GPU as they are."""
    _, scales, biases = mx.quantize(
        mx.random.normal((8, width)), group_size=group, bits=4
    )
    got = parallel.gpu_safe_groups(scales, biases, group, mx.Device(mx.gpu))
    assert got[0] is scales and got[1] is biases and got[2] == group
