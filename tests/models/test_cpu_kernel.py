"""The bf16 CPU kernel (models/cpu_kernel.py, models/kernels/bf16_matmul.c).

It must compute float32 sums of bf16 weights times the inputs, the same
value for a row whatever else is in the product (window invariance: a verify
window's products equal a single token's bit for bit), agree with MLX's own
bf16 product to bf16 rounding, and step aside cleanly where it cannot run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from models import cpu_kernel
from models.parallel import Linear, dequantized, project
from schemas.request import GenerationLimits, SamplingParams
from specpipe.api import load
from tests.cli.conftest import write_tiny_model

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.skipif(
        not cpu_kernel._cpu_supported(),
        reason="the kernel is for x86-64 CPUs with AVX2, FMA and F16C",
    ),
    # CPU products only: on MLX's CUDA build the default device is the GPU
    pytest.mark.usefixtures("cpu_default"),
]


def _weights(
    rows: int, inner: int, seed: int, dtype: mx.Dtype = mx.bfloat16
) -> mx.array:
    mx.random.seed(seed)
    return (mx.random.normal((rows, inner)) * 0.05).astype(dtype)


def test_the_kernel_builds_here() -> None:
    assert cpu_kernel.available(), cpu_kernel._library()


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize(("rows", "inner"), [(250, 96), (37, 1000), (1152, 896)])
@pytest.mark.parametrize("window", [1, 3, 4, 7, 9])
def test_product_is_the_float32_sum(
    rows: int, inner: int, window: int, dtype: mx.Dtype
) -> None:
    """bf16 and float16 weights alike (float16 through F16C's exact conversion)."""
    weight = _weights(rows, inner, rows + window, dtype)
    assert cpu_kernel.usable(weight)
    x = mx.random.normal((2, window, inner))
    bias = mx.random.normal((rows,))
    got = project(x, weight, bias=bias)
    assert got.dtype == mx.float32 and got.shape == (2, window, rows)
    exact = np.asarray(x, dtype=np.float64) @ np.asarray(
        weight.astype(mx.float32), dtype=np.float64
    ).T + np.asarray(bias, dtype=np.float64)
    # float32 accumulation over `inner` terms
    assert np.allclose(np.asarray(got), exact, rtol=1e-5, atol=1e-5 * np.sqrt(inner))


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("inner", [96, 1000])  # 1000: a tail past the 16-wide steps
def test_each_row_is_computed_as_alone(
    threads: int, inner: int, dtype: mx.Dtype
) -> None:
    weight = _weights(301, inner, threads, dtype)
    bias = mx.random.normal((301,)).astype(dtype)
    x = mx.random.normal((1, 9, inner)).astype(dtype)
    window = cpu_kernel.bf16_product(x, weight, bias, threads)
    assert window is not None
    for i in range(9):
        for width in (1, 2, 5):
            part = x[:, i : i + width]
            alone = cpu_kernel.bf16_product(part, weight, bias, 1)
            assert alone is not None
            assert mx.array_equal(alone, window[:, i : i + part.shape[1]]).item()


def test_agrees_with_mlx_to_bf16_rounding() -> None:
    weight = _weights(512, 384, 3)
    x = mx.random.normal((4, 384)).astype(mx.bfloat16)
    ours = project(x, weight).astype(mx.float32)
    theirs = (x @ weight.T).astype(mx.float32)
    assert ours.dtype == theirs.dtype
    # at most a unit in bf16's last place (2^-8 of the magnitude) apart
    scale = mx.maximum(mx.abs(theirs), 1e-3)
    assert (mx.abs(ours - theirs) / scale).max().item() <= 2.0**-7


def test_layers_use_it_and_a_column_slice_falls_back() -> None:
    layer = Linear(1000, 37, bias=True)
    layer.set_dtype(mx.bfloat16)
    x = mx.random.normal((3, 1000)).astype(mx.bfloat16)
    assert mx.array_equal(
        layer(x), cpu_kernel.bf16_product(x, layer.weight, layer.bias, 2)
    ).item()
    wide = _weights(64, 200, 5)
    sliced = wide[:, :96]  # not row after row in memory
    y = mx.random.normal((2, 96)).astype(mx.bfloat16)
    assert cpu_kernel.bf16_product(y, sliced, None, 2) is None
    assert mx.array_equal(project(y, sliced), y @ sliced.T).item()


def _probe(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    code = (
        "import mlx.core as mx\n"
        "mx.set_default_device(mx.cpu)\n"
        "from models import cpu_kernel\n"
        "from models.parallel import project\n"
        "w = mx.ones((40, 32), dtype=mx.bfloat16)\n"
        "x = mx.ones((2, 32), dtype=mx.bfloat16)\n"
        "assert project(x, w).tolist() == [[32.0] * 40] * 2\n"
        "print('kernel', cpu_kernel.ready())\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )


def test_switched_off_it_says_so_and_mlx_multiplies(tmp_path: Path) -> None:
    done = _probe({"SPECPIPE_CPU_KERNEL": "off", "SPECPIPE_CACHE": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    assert "kernel False" in done.stdout
    assert "SPECPIPE_CPU_KERNEL=off" in done.stderr


def test_a_failed_build_leaves_nothing_behind(tmp_path: Path) -> None:
    failing = tmp_path / "cc"
    failing.write_text("#!/bin/sh\necho 'no such compiler' >&2\nexit 1\n")
    failing.chmod(0o755)
    cache = tmp_path / "cache"
    done = _probe({"CC": str(failing), "SPECPIPE_CACHE": str(cache)})
    assert done.returncode == 0, done.stderr
    assert "kernel False" in done.stdout
    assert "failed" in done.stderr and "no such compiler" in done.stderr
    assert list((cache / "kernels").iterdir()) == []  # no partial library
    built = _probe({"SPECPIPE_CACHE": str(cache)})  # a working compiler: built once
    assert "kernel True" in built.stdout, built.stderr
    assert [p.suffix for p in (cache / "kernels").iterdir()] == [".so"]


@pytest.mark.parametrize(
    "sampling", [SamplingParams(), SamplingParams(temperature=0.8, seed=4)]
)
def test_bf16_draft_for_a_float32_target_is_lossless(
    tmp_path: Path, sampling: SamplingParams
) -> None:
    target = write_tiny_model(tmp_path / "target")
    prompts = ["def fibonacci(n):", "Hello world! Hello world!"]
    limits = GenerationLimits(max_tokens=16)
    plain = (
        load(str(target), dtype="float32")
        .unwrap()
        .generate_batch(prompts, sampling, limits)
    )
    spec = load(
        str(target),
        draft=str(target),
        num_draft_tokens=3,
        dtype="float32",
        draft_dtype="bfloat16",
        adaptive=False,
    ).unwrap()
    assert spec.draft is not None and spec.draft.model is not None
    assert spec.draft.model.model.embed_tokens.weight.dtype == mx.bfloat16  # type: ignore[attr-defined]
    assert spec.target.model.model.embed_tokens.weight.dtype == mx.float32  # type: ignore[attr-defined]
    results = spec.generate_batch(prompts, sampling, limits).unwrap()
    assert [r.tokens for r in results] == [r.tokens for r in plain.unwrap()]
    assert sum(r.stats.accepted for r in results) > 0  # the bf16 copy agrees often


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_bf16_target_speculates_losslessly(tmp_path: Path, dtype: str) -> None:
    """bf16 (and float16) targets on the kernel: windows equal single steps."""
    target = write_tiny_model(tmp_path / "target")
    prompts = ["def fibonacci(n):", "Hello world! Hello world!"]
    limits = GenerationLimits(max_tokens=16)
    sampling = SamplingParams(temperature=0.7, top_p=0.9, seed=2)
    plain = (
        load(str(target), dtype=dtype)
        .unwrap()
        .generate_batch(prompts, sampling, limits)
    )
    spec = load(
        str(target), draft="ngram", num_draft_tokens=4, dtype=dtype, adaptive=False
    ).unwrap()
    layer = spec.target.model.model.layers[0].mlp.down_proj  # type: ignore[attr-defined]
    assert cpu_kernel.usable(layer.weight)
    results = spec.generate_batch(prompts, sampling, limits).unwrap()
    assert [r.tokens for r in results] == [r.tokens for r in plain.unwrap()]


# --- the affine (quantized) kernel: models/kernels/affine_matmul.c ---------


def _quantized(
    rows: int, inner: int, bits: int, group: int, seed: int, experts: int = 0
) -> tuple[mx.array, mx.array, mx.array]:
    """Random weights [rows, inner] quantized (`experts`: a stack of them);
    in groups of 16 (a GGUF's Q6_K form, which `mx.quantize` does not make),
    random codes with random scales and biases."""
    mx.random.seed(seed)
    shape = (experts, rows, inner) if experts else (rows, inner)
    if group == 16:
        lead = shape[:-1]
        halves = mx.random.randint(0, 1 << 16, (*lead, inner * bits // 32, 2))
        words = (halves[..., 0] << 16 | halves[..., 1]).astype(mx.uint32)  # codes
        scales = mx.random.uniform(0.001, 0.01, (*lead, inner // 16))
        return words, scales, -scales * (1 << (bits - 1))
    packed, scales, biases = mx.quantize(
        mx.random.normal(shape) * 0.05, group_size=group, bits=bits
    )
    return packed, scales, biases


def _dequantized(
    packed: mx.array, scales: mx.array, biases: mx.array, bits: int, group: int
) -> mx.array:
    if group == 16:
        return dequantized(packed, scales, biases, group, bits)
    return mx.dequantize(packed, scales, biases, group_size=group, bits=bits)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("group", [16, 32, 64, 128])
@pytest.mark.parametrize("window", [1, 3, 4, 7, 9])
def test_a_quantized_product_is_the_float32_sum_of_its_weights(
    bits: int, group: int, window: int
) -> None:
    """Through `project`, as every quantized layer calls it: the dequantized
    weights (MLX's own dequantize) times the inputs, plus the bias."""
    inner = 384
    packed, scales, biases = _quantized(251, inner, bits, group, bits * group + window)
    assert cpu_kernel.affine_usable(packed, bits, group, "affine")
    x = mx.random.normal((2, window, inner))
    bias = mx.random.normal((251,))
    got = project(x, packed, scales, biases, group_size=group, bits=bits, bias=bias)
    assert got.dtype == mx.float32 and got.shape == (2, window, 251)
    weights = _dequantized(packed, scales, biases, bits, group)
    exact = np.asarray(x, dtype=np.float64) @ np.asarray(
        weights, dtype=np.float64
    ).T + np.asarray(bias, dtype=np.float64)
    assert np.allclose(np.asarray(got), exact, rtol=1e-5, atol=1e-5 * np.sqrt(inner))


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("group", [64, 16])
def test_each_quantized_row_is_computed_as_alone(
    bits: int, threads: int, group: int
) -> None:
    """Window invariance, as for bf16: a verify window's rows equal single
    tokens' bit for bit (the weights' last chunk, read without loads past
    its end at 2, 3, 5 and 6 bits, included)."""
    packed, scales, biases = _quantized(301, 1024, bits, group, threads)
    x = mx.random.normal((1, 9, 1024)).astype(mx.bfloat16)
    window = cpu_kernel.affine_product(x, packed, scales, biases, bits, group, threads)
    assert window is not None and window.dtype == mx.bfloat16
    for i in range(9):
        for width in (1, 2, 5):
            part = x[:, i : i + width]
            alone = cpu_kernel.affine_product(
                part, packed, scales, biases, bits, group, 1
            )
            assert alone is not None
            assert mx.array_equal(alone, window[:, i : i + part.shape[1]]).item()


@pytest.mark.parametrize("bits", [3, 4, 6, 8])
@pytest.mark.parametrize(
    ("x_shape", "chosen_shape"),
    [
        ((5, 1, 1, 256), (5, 3)),  # gate / up: each token's row against its top-k
        ((5, 3, 1, 256), (5, 3)),  # down: each pair's own row
        ((7, 1, 256), (7,)),  # pairs sorted by expert (a long prefill)
    ],
)
def test_stacked_experts_are_the_float32_sums_of_their_weights(
    bits: int, x_shape: tuple[int, ...], chosen_shape: tuple[int, ...]
) -> None:
    """As `gather_qmm` (transposed) computes: each (row, expert) pair's
    product with that expert's dequantized weights, in the pair's place."""
    packed, scales, biases = _quantized(40, 256, bits, 64, bits, experts=6)
    assert cpu_kernel.affine_usable(packed, bits, 64, "affine", stacked=True)
    assert not cpu_kernel.affine_usable(packed, bits, 64, "affine")
    x = mx.random.normal(x_shape)
    chosen = mx.random.randint(0, 6, chosen_shape)
    got = cpu_kernel.affine_gather_product(
        x, packed, scales, biases, chosen, bits, 64, 2
    )
    expected = mx.gather_qmm(
        x, packed, scales, biases, rhs_indices=chosen, transpose=True,
        group_size=64, bits=bits,
    )  # fmt: skip
    assert got is not None and got.shape == expected.shape
    weights = np.asarray(
        mx.dequantize(packed, scales, biases, group_size=64, bits=bits),
        dtype=np.float64,
    )  # [E, O, I]
    batch = expected.shape[:-2]
    rows = np.broadcast_to(np.asarray(x, dtype=np.float64), (*batch, 1, 256))
    ids = np.broadcast_to(np.asarray(chosen), batch)
    exact = np.einsum("...i,...oi->...o", rows[..., 0, :], weights[ids])[..., None, :]
    assert np.allclose(np.asarray(got), exact, rtol=1e-5, atol=1e-5 * np.sqrt(256))
    assert np.allclose(np.asarray(got), np.asarray(expected), atol=1e-4)


@pytest.mark.parametrize("threads", [1, 2])
def test_each_expert_pair_is_computed_as_alone(threads: int) -> None:
    """A verify window's (token, expert) pairs equal each token's own, bit
    for bit, whichever tokens share an expert."""
    packed, scales, biases = _quantized(300, 512, 4, 64, threads, experts=8)
    x = mx.random.normal((6, 1, 1, 512)).astype(mx.bfloat16)
    chosen = mx.array(
        [[0, 1, 2], [2, 1, 7], [7, 0, 3], [3, 3, 3], [5, 1, 0], [6, 2, 4]]
    )
    window = cpu_kernel.affine_gather_product(
        x, packed, scales, biases, chosen, 4, 64, threads
    )
    assert window is not None and window.dtype == mx.bfloat16
    for t in range(6):
        alone = cpu_kernel.affine_gather_product(
            x[t : t + 1], packed, scales, biases, chosen[t : t + 1], 4, 64, 1
        )
        assert alone is not None
        assert mx.array_equal(alone, window[t : t + 1]).item()


def test_an_expert_id_past_the_stack_is_left_to_mlx() -> None:
    packed, scales, biases = _quantized(40, 256, 4, 64, 0, experts=4)
    x = mx.random.normal((2, 1, 1, 256))
    out = cpu_kernel.affine_gather_product(
        x, packed, scales, biases, mx.array([[0, 4], [1, 2]]), 4, 64, 1
    )
    assert out is None


def test_inside_a_trace_the_kernels_leave_the_product_to_mlx() -> None:
    """`mx.compile` holds no values to hand a kernel: traced, `project` and
    the experts' product are MLX's own (the same as called outside the
    kernels' reach), never an error."""
    x = mx.random.normal((3, 256))
    packed, scales, biases = _quantized(40, 256, 4, 64, 1)
    traced = mx.compile(
        lambda x: project(x, packed, scales, biases, group_size=64, bits=4)
    )
    expected = mx.quantized_matmul(x, packed, scales, biases, True, 64, 4)
    assert mx.array_equal(traced(x), expected).item()
    weight = _weights(40, 256, 2)
    traced_bf16 = mx.compile(lambda x: project(x, weight))
    assert mx.array_equal(traced_bf16(x), x @ weight.T).item()
    from models.qwen3_next import QuantizedSwitchLinear

    experts = QuantizedSwitchLinear(256, 40, 4, group_size=64, bits=4)
    experts.weight, experts.scales, experts.biases = _quantized(
        40, 256, 4, 64, 2, experts=4
    )
    chosen = mx.array([[0, 3], [1, 1], [2, 0]])
    rows = x[:, None, None, :]
    traced_experts = mx.compile(lambda rows, chosen: experts(rows, chosen))
    expected = mx.gather_qmm(
        rows, experts.weight, experts.scales, experts.biases, rhs_indices=chosen,
        transpose=True, group_size=64, bits=4,
    )  # fmt: skip
    assert mx.array_equal(traced_experts(rows, chosen), expected).item()


def test_other_quantized_forms_keep_mlx_product() -> None:
    """Microscaled floating-point forms (mxfp4, mxfp8, nvfp4) and a sliced
    weight are MLX's to multiply."""
    x = mx.random.normal((3, 256))
    for mode in ("mxfp4", "mxfp8", "nvfp4"):
        packed, scales = mx.quantize(mx.random.normal((40, 256)) * 0.05, mode=mode)
        bits, group = {"mxfp4": (4, 32), "mxfp8": (8, 32), "nvfp4": (4, 16)}[mode]
        assert not cpu_kernel.affine_usable(packed, bits, group, mode)
        assert mx.array_equal(
            project(x, packed, scales, None, group_size=group, bits=bits, mode=mode),
            mx.quantized_matmul(x, packed, scales, None, True, group, bits, mode),
        ).item()
    packed, scales, biases = _quantized(40, 256, 4, 64, 0)
    assert (
        cpu_kernel.affine_product(
            mx.ones((1, 256)), packed[::2], scales[::2], biases[::2], 4, 64, 1
        )
        is None
    )


@pytest.mark.parametrize(
    ("bits", "sampling"),
    [
        (4, SamplingParams()),
        (4, SamplingParams(temperature=0.8, seed=4)),
        (3, SamplingParams(temperature=0.8, seed=5)),
        (6, SamplingParams()),
    ],
)
def test_a_quantized_target_speculates_losslessly(
    tmp_path: Path, bits: int, sampling: SamplingParams
) -> None:
    """A quantized target (`convert --quantize N`'s form) with a draft of
    itself: the kernel's windows give plain decoding's tokens."""
    folder = write_tiny_model(tmp_path / "target")
    quantized = tmp_path / f"q{bits}"
    from specpipe.cli import main

    main(["convert", str(folder), str(quantized), "--quantize", str(bits)])
    prompts = ["def fibonacci(n):", "Hello world! Hello world!"]
    limits = GenerationLimits(max_tokens=16)
    plain = load(str(quantized)).unwrap().generate_batch(prompts, sampling, limits)
    spec = load(
        str(quantized), draft=str(quantized), num_draft_tokens=3, adaptive=False
    ).unwrap()
    layer = spec.target.model.model.layers[0].mlp.down_proj  # type: ignore[attr-defined]
    assert type(layer).__name__ == "QuantizedLinear" and layer.bits == bits
    assert cpu_kernel.affine_usable(
        layer.weight, layer.bits, layer.group_size, "affine"
    )
    results = spec.generate_batch(prompts, sampling, limits).unwrap()
    assert [r.tokens for r in results] == [r.tokens for r in plain.unwrap()]
    assert sum(r.stats.accepted for r in results) > 0
