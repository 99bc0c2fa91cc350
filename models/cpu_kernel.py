"""bfloat16 and affine-quantized weight products on the CPU through small
vectorised C kernels.

MLX's CPU backend multiplies bfloat16 matrices with a generic loop: a
`[1, 1536] x [1536, 8960]` product took 24 ms against 16 ms in float32 on
OpenBLAS and 2.1 ms in `kernels/bf16_matmul.c` (2-core AVX2 machine,
bench/RESULTS.md). A decode step is bound by reading its weights, and bf16
weights are half the bytes of float32, so with this kernel a bf16 model is
the fastest way to decode on such a CPU, and a bf16 draft model costs a
fraction of a float32 target's step.

MLX's CPU quantized product reads the packed weights once per input row: a
5-row verify window took ~5x a single token's time, 5-6x float32's
(bench/RESULTS.md). `kernels/affine_matmul.c` unpacks each weight row once
into float32 values and runs every input row over them, for MLX affine
weights of 2, 3, 4, 5, 6 or 8 bits in groups of 16, 32, 64 or 128 (a GGUF's
kept Q4_*, Q5_*, Q8_0 and K-type blocks, `convert --quantize N` folders, MLX
checkpoints quantized so), and stacked MoE experts the same way, a call's
(token, expert) pairs grouped by expert (`affine_gather_product`, in place of
MLX's `gather_qmm`); other forms (MLX's microscaled mxfp4 / mxfp8 / nvfp4)
keep MLX's product.

The kernels are compiled from their C sources with the system C compiler on first
use (`$CC`, else `cc`; `-O3 -mavx2 -mfma -mf16c -ffp-contract=off`) into the cache folder
(`$SPECPIPE_CACHE/kernels`, default `~/.cache/specpipe/kernels`), written
under a temporary name and renamed into place, so a failed or interrupted
build leaves nothing half-written. Where it cannot be had (not x86-64 with
AVX2, FMA and F16C, no compiler, a failed build, or `SPECPIPE_CPU_KERNEL=off`),
bf16 and quantized products run on MLX's own kernels and a one-line notice
says why.

The call is eager: the input is evaluated, multiplied in C over the weight's
memory (no copy), and the result enters MLX as a new array. Every output
value is accumulated in the same order whatever the number of input rows
(see the C source), so a verify window's products equal a single token's bit
for bit, as the lossless guarantee wants.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from functools import cache
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from models.paths import cache_root

ENV = "SPECPIPE_CPU_KERNEL"
SOURCES = tuple(
    Path(__file__).resolve().parent / "kernels" / name
    for name in ("bf16_matmul.c", "affine_matmul.c")
)
HEADERS = tuple(  # both sources include them
    SOURCES[0].parent / name for name in ("fixed_sums.h", "row_threads.h")
)
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fPIC", "-shared")
# Products with fewer weights than this run on one thread: a thread's start
# costs more than its share of a small product, and a small weight is read
# from cache (the 0.5B draft's forward: 131 ms at this threshold, 141 ms at
# 2^19, 159 ms at 2^23 on the 2-core machine).
MIN_THREADED_WEIGHTS = 1 << 21


def _cpu_supported() -> bool:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    for line in info.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            return {"avx2", "fma", "f16c"} <= flags
    return False


def _build(compiler: str, out: Path) -> str | None:
    """Compile the kernel to `out` (atomically); an error message, or None."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=out.name + ".", suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        done = subprocess.run(
            [compiler, *FLAGS, "-o", tmp, *map(str, SOURCES), "-lpthread"],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            return f"{compiler} failed: {done.stderr.strip()[:300]}"
        os.replace(tmp, out)
        return None
    except OSError as exc:
        return f"{compiler} could not run: {exc}"
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@cache
def _library() -> ctypes.CDLL | str:
    """The loaded kernel, or why it is not available."""
    if os.environ.get(ENV, "").strip().lower() in ("off", "0", "false", "no"):
        return f"{ENV}=off"
    if not _cpu_supported():
        return "this CPU is not x86-64 with AVX2, FMA and F16C"
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        return f"no C compiler ({compiler}) on PATH"
    source = b"".join(path.read_bytes() for path in (*SOURCES, *HEADERS))
    digest = hashlib.sha256(source + " ".join(FLAGS).encode()).hexdigest()[:16]
    path = cache_root() / "kernels" / f"cpu_kernels-{digest}.so"
    if not path.is_file():
        error = _build(compiler, path)
        if error is not None:
            return error
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        return f"{path} did not load: {exc}"
    for fn in (lib.specpipe_bf16_matmul, lib.specpipe_f16_matmul):
        fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3 + [ctypes.c_int]
        fn.restype = None
    affine = lib.specpipe_affine_gather
    affine.argtypes = (
        [ctypes.c_void_p] * 5
        + [ctypes.c_long] * 3
        + [ctypes.c_void_p] * 2
        + [ctypes.c_int] * 4
    )
    affine.restype = ctypes.c_int
    return lib


_noticed = False


def ready() -> bool:
    """Whether the kernel is built and loaded here (no notice when not)."""
    return not isinstance(_library(), str)


def available() -> bool:
    """Whether bf16 CPU products run on the kernel (built on first call)."""
    global _noticed
    lib = _library()
    if isinstance(lib, str):
        if not _noticed:
            _noticed = True
            print(
                f"specpipe: CPU kernels not used ({lib}); bf16 and quantized "
                "products run on MLX's slower kernels",
                file=sys.stderr,
            )
        return False
    return True


def runs_here() -> bool:
    """Whether products on MLX's default device run on these kernels: it is
    the CPU, and the kernels are built and loaded (a notice when not)."""
    return mx.default_device().type == mx.DeviceType.cpu and available()


def usable(weight: mx.array) -> bool:
    """Whether `x @ weight.T` can run on the kernel here: a 2-D bf16 (or
    float16) weight on the CPU, laid out row after row."""
    return (
        weight.dtype in (mx.bfloat16, mx.float16) and weight.ndim == 2 and runs_here()
    )


def bf16_product(
    x: mx.array,  # [..., I]
    weight: mx.array,  # [O, I] bfloat16 or float16
    bias: mx.array | None,  # [O]
    threads: int,
) -> mx.array | None:  # [..., O] in x's dtype; None: use MLX's product
    """`x @ weight.T (+ bias)` on the kernel, accumulated in float32 and
    rounded once to x's dtype; None if the weight is not laid out row after
    row (a column slice), which MLX's product then takes. A float16 weight
    runs the same sums (its values converted exactly by F16C)."""
    lib = _library()
    assert not isinstance(lib, str), "bf16_product without the kernel"
    out_rows, inner = int(weight.shape[0]), int(weight.shape[1])
    bias32 = bias.astype(mx.float32) if bias is not None else None
    kernel = (
        lib.specpipe_f16_matmul
        if weight.dtype == mx.float16
        else lib.specpipe_bf16_matmul
    )

    def call(
        arrays: list[np.ndarray], xs: np.ndarray, y: np.ndarray, threads: int
    ) -> int:
        b = np.ascontiguousarray(np.asarray(bias32)) if bias32 is not None else None
        kernel(
            arrays[0].ctypes.data,
            xs.ctypes.data,
            b.ctypes.data if b is not None else None,
            y.ctypes.data,
            out_rows,
            inner,
            xs.shape[0],
            threads,
        )
        return 0

    also = [bias32] if bias32 is not None else []
    return _on_kernel(x, inner, out_rows, threads, [weight.view(mx.uint16)], call, also)


def _evaluated(*arrays: mx.array) -> bool:
    """Evaluate `arrays`; False inside a function transformation (a trace
    holds no values: MLX refuses the evaluation there)."""
    try:
        mx.eval(*arrays)
    except ValueError as exc:
        if "transformation" not in str(exc):
            raise
        return False
    return True


def takes(module: nn.Module) -> bool:
    """Whether any of `module`'s products runs on a CPU kernel here (a bf16
    or affine-quantized layer on the CPU): kernels evaluate their inputs, so
    a step that holds one is better left eager than traced."""
    if not runs_here():
        return False
    for _, layer in module.named_modules():
        weight = layer.get("weight") if isinstance(layer, nn.Module) else None
        if isinstance(weight, mx.array) and routes(
            weight,
            int(getattr(layer, "bits", 0)),
            int(getattr(layer, "group_size", 64)),
            str(getattr(layer, "mode", "affine")),
        ):
            return True
    return False


def routes(
    weight: mx.array, bits: int = 0, group_size: int = 64, mode: str = "affine"
) -> bool:
    """Whether a product with `weight` (quantized when `bits`; [E, O, ...]
    stacked experts when 3-D) runs on a CPU kernel here."""
    if bits:
        return affine_usable(weight, bits, group_size, mode, stacked=weight.ndim == 3)
    return usable(weight)


def _on_kernel(
    x: mx.array,  # [..., inner]
    inner: int,
    out_rows: int,
    threads: int,
    laid_out: Sequence[mx.array],
    call: Callable[[list[np.ndarray], np.ndarray, np.ndarray, int], int],
    also: Sequence[mx.array] = (),
) -> mx.array | None:  # [..., out_rows] in x's dtype
    """What both kernels' products share: `x`'s rows as contiguous float32
    `xs` [M, inner], the output `y` [M, out_rows] float32, the `laid_out`
    arrays as numpy views (None where one is not laid out row after row),
    one thread for a small product; `call(views, xs, y, threads)` runs the
    kernel (nonzero: it could not, None). Evaluates x, `laid_out` and `also`
    together; inside `mx.compile` (or another transformation), where nothing
    can be evaluated, None: MLX's product is traced instead."""
    lead = x.shape[:-1]
    flat = x.reshape(-1, inner).astype(mx.float32)
    if not _evaluated(flat, *laid_out, *also):
        return None
    views = [np.asarray(a) for a in laid_out]
    if not all(view.flags["C_CONTIGUOUS"] for view in views):
        return None
    xs = np.ascontiguousarray(np.asarray(flat))
    y = np.empty((xs.shape[0], out_rows), dtype=np.float32)
    if out_rows * inner < MIN_THREADED_WEIGHTS:
        threads = 1
    if call(views, xs, y, threads):
        return None
    return mx.array(y).reshape(*lead, out_rows).astype(x.dtype)


AFFINE_BITS = (2, 3, 4, 5, 6, 8)
AFFINE_GROUPS = (16, 32, 64, 128)  # 16: a GGUF's Q2_K, Q3_K, Q6_K


def affine_usable(
    weight: mx.array, bits: int, group_size: int, mode: str, stacked: bool = False
) -> bool:
    """Whether a quantized `x @ weight.T` can run on the affine kernel here:
    an MLX affine weight [O, I * bits / 32] (`stacked`: experts' weights
    [E, O, I * bits / 32]) of 2, 3, 4, 5, 6 or 8 bits in groups of 16, 32, 64
    or 128 on the CPU (I a multiple of 32)."""
    return (
        mode == "affine"
        and bits in AFFINE_BITS
        and group_size in AFFINE_GROUPS
        and weight.ndim == (3 if stacked else 2)
        and weight.dtype == mx.uint32
        and (int(weight.shape[-1]) * 32 // bits) % max(group_size, 32) == 0
        and runs_here()
    )


def _affine_run(
    arrays: list[np.ndarray],  # weight, and each segment's scales, biases (float32)
    xs: np.ndarray,  # [M, I] float32, grouped by expert
    y: np.ndarray,  # [M, O] float32
    experts: int,
    ids: np.ndarray,  # [S] int32: segment s's expert
    starts: np.ndarray,  # [S + 1] int64: segment s's rows of xs
    bits: int,
    group_size: int,
    threads: int,
) -> int:
    """The affine kernel over `xs`'s segments (nonzero: it could not run)."""
    lib = _library()
    assert not isinstance(lib, str), "the affine kernel without its library"
    w, s, b = arrays
    failed: int = lib.specpipe_affine_gather(
        w.ctypes.data,
        s.ctypes.data,
        b.ctypes.data,
        xs.ctypes.data,
        y.ctypes.data,
        int(w.shape[-2]),
        xs.shape[1],
        experts,
        ids.ctypes.data,
        starts.ctypes.data,
        len(ids),
        bits,
        group_size,
        threads,
    )
    return failed


def affine_product(
    x: mx.array,  # [..., I]
    weight: mx.array,  # [O, I * bits / 32] uint32
    scales: mx.array,  # [O, I / group_size]
    biases: mx.array,  # [O, I / group_size]
    bits: int,
    group_size: int,
    threads: int,
) -> mx.array | None:  # [..., O] in x's dtype; None: use MLX's product
    """`x @ dequantize(weight).T` on the affine kernel, accumulated in
    float32 and rounded once to x's dtype; None where the arrays are not
    laid out row after row or the kernel could not get its buffers."""
    inner = int(weight.shape[1]) * 32 // bits
    one = np.zeros(1, dtype=np.int32)

    def call(
        arrays: list[np.ndarray], xs: np.ndarray, y: np.ndarray, threads: int
    ) -> int:
        starts = np.array([0, xs.shape[0]], dtype=np.int64)
        return _affine_run(arrays, xs, y, 1, one, starts, bits, group_size, threads)

    laid_out = [weight, scales.astype(mx.float32), biases.astype(mx.float32)]
    return _on_kernel(x, inner, int(weight.shape[0]), threads, laid_out, call)


def affine_gather_product(
    x: mx.array,  # [..., 1, I]
    weight: mx.array,  # [E, O, I * bits / 32] uint32
    scales: mx.array,  # [E, O, I / group_size]
    biases: mx.array,  # [E, O, I / group_size]
    experts: mx.array,  # [...] int, broadcast against x's batch axes
    bits: int,
    group_size: int,
    threads: int,
) -> mx.array | None:  # [..., 1, O] in x's dtype; None: use MLX's product
    """`mx.gather_qmm(x, weight, ..., rhs_indices=experts, transpose=True)` on
    the affine kernel: each (row, expert) pair's product, the pairs grouped
    by expert so that every expert row used is unpacked once per call; each
    output sums as a lone row's does (a verify window's pairs equal single
    tokens' bit for bit). None as for `affine_product`."""
    assert x.shape[-2] == 1, "one row per (batch, expert) pair"
    inner = int(weight.shape[-1]) * 32 // bits
    batch = tuple(np.broadcast_shapes(tuple(x.shape[:-2]), tuple(experts.shape)))
    rows = mx.broadcast_to(x, (*batch, 1, inner)).reshape(-1, inner)
    chosen = mx.broadcast_to(experts, batch).reshape(-1)
    if not _evaluated(chosen):
        return None
    ids_all = np.asarray(chosen).astype(np.int32)
    order = np.argsort(ids_all, kind="stable")
    ids, counts = np.unique(ids_all[order], return_counts=True)
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    ids = ids.astype(np.int32)
    total = int(weight.shape[0])
    if len(ids) and (ids[0] < 0 or ids[-1] >= total):
        return None  # MLX's product says what is wrong

    def call(
        arrays: list[np.ndarray], xs: np.ndarray, y: np.ndarray, threads: int
    ) -> int:
        grouped = np.ascontiguousarray(xs[order])
        out = np.empty_like(y)
        failed = _affine_run(
            arrays, grouped, out, total, ids, starts, bits, group_size, threads
        )
        y[order] = out
        return failed

    # the used experts' scales and biases only, as float32 (a bf16 model's
    # whole stack converted at every call cost more than the product at decode)
    used = mx.array(ids)
    laid_out = [
        weight,
        mx.take(scales, used, axis=0).astype(mx.float32),
        mx.take(biases, used, axis=0).astype(mx.float32),
    ]
    out = _on_kernel(rows, inner, int(weight.shape[1]), threads, laid_out, call)
    return None if out is None else out.reshape(*batch, 1, -1)
