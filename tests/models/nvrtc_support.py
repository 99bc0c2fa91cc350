"""Compile an `mx.fast.cuda_kernel` source with NVRTC as MLX's CUDA backend
would, without a GPU: the kernel's signature is generated the way MLX's
`build_kernel` (mlx/backend/cuda/custom_kernel.cpp) writes it (inputs as
`const T*`, `<name>_shape` when the source names it, outputs, then the
template constants), and compiled for sm_90 with the CUDA headers of the
`nvidia-cuda-runtime` / `nvidia-cuda-cccl` wheels (the dev extra; CCCL's
from MLX's CUDA build where that wheel is absent).

MLX's own device header is not in any wheel the tests can install; a
stand-in declares what the library's kernels use of it (`Shape`, with MLX's
MAX_NDIM). A kernel that compiles here has no syntax or type errors and no
register spills to report; whether it computes the right thing is checked on
a device (bench/fused_probe.py, bench/gdn_probe.py).
"""

from __future__ import annotations

import ctypes
import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

_TYPES = {
    mx.bfloat16: "__nv_bfloat16",
    mx.float16: "__half",
    mx.float32: "float",
    mx.int32: "int32_t",
    mx.uint32: "uint32_t",
    mx.uint64: "uint64_t",
}

_STAND_IN = """#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/array>
#include <cuda/std/cstdint>
#include <cuda/std/limits>
#define MAX_NDIM 8
namespace mlx::core::cu {
using Shape = cuda::std::array<int32_t, MAX_NDIM>;
using Strides = cuda::std::array<int64_t, MAX_NDIM>;
}
"""

_DEFAULT_HEADER = """#include "mlx/backend/cuda/device/utils.cuh"

#include <cooperative_groups.h>

#define inf cuda::std::numeric_limits<float>::infinity()

"""


@dataclass(frozen=True)
class Compiled:
    ok: bool
    log: str
    registers: int | None
    spill_bytes: int | None
    cubin: bytes = b""  # the machine code (comparing two sources' instructions)


def _cuda_root() -> Path:
    import nvidia  # the namespace package of NVIDIA's CUDA wheels

    for base in nvidia.__path__:
        root = Path(base) / "cu13"
        if (root / "lib" / "libnvrtc.so.13").is_file():
            return root
    raise FileNotFoundError(
        "NVRTC not found: install the dev extra (pip install -e '.[dev]'), which "
        "brings nvidia-cuda-nvrtc, nvidia-cuda-runtime and nvidia-cuda-cccl"
    )


def _cccl_dirs(root: Path) -> list[Path]:
    """CCCL's headers (`cuda/std/...`): the nvidia-cuda-cccl wheel's, else
    the copy MLX's CUDA build ships (`mlx/include/cccl`, what its JIT uses; a
    machine with mlx-cuda but not the dev extra)."""
    import mlx.core

    candidates = [
        root / "include" / "cccl",
        Path(mlx.core.__file__).parent / "include" / "cccl",
    ]
    return [path for path in candidates if path.is_dir()][:1]


@functools.cache
def _nvrtc() -> Any:
    lib = _cuda_root() / "lib"
    for builtins in sorted(lib.glob("libnvrtc-builtins.so*")):
        ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
    return ctypes.CDLL(str(lib / "libnvrtc.so.13"))


def source(
    name: str,
    header: str,
    body: str,
    inputs: Sequence[tuple[str, mx.array]],
    outputs: Sequence[tuple[str, mx.Dtype]],
    template: Sequence[tuple[str, Any]],
) -> str:
    """The translation unit MLX builds for a kernel called with these arrays."""
    text = _DEFAULT_HEADER + header
    text += "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
    # MLX names the kernel by its template values too (bools t / f, ints as
    # written, dtypes by name) and a hash: a value that is no part of an
    # identifier (a negative int's "-") does not compile
    named = "_".join(
        "t" if value is True else "f" if value is False
        else str(value) if isinstance(value, int) else str(value).removeprefix("mlx.core.")
        for _, value in template
    )  # fmt: skip
    text += f"__global__ void custom_kernel_{name}_{named}_0123456789abcdef(\n"
    for input_name, array in inputs:
        text += f"    const {_TYPES[array.dtype]}* {input_name},\n"
        if array.ndim > 0 and f"{input_name}_shape" in body:
            text += f"    const __grid_constant__ Shape {input_name}_shape,\n"
    text += ",\n".join(f"    {_TYPES[dtype]}* {n}" for n, dtype in outputs) + ") {\n"
    for constant, value in template:
        if isinstance(value, bool):
            text += f"  constexpr bool {constant} = {'true' if value else 'false'};\n"
        elif isinstance(value, int):
            text += f"  constexpr int {constant} = {value};\n"
        else:
            text += f"  using {constant} = {_TYPES[value]};\n"
    return text + "\n" + body + "\n}\n\n} // namespace mlx::core::cu\n"


def compile_source(
    text: str, workdir: Path, arch: str = "sm_90", line_info: bool = False
) -> Compiled:
    """Compile with NVRTC (ptxas verbose: registers and spills); `line_info`:
    with source line information (nvdisasm's `-gi`; the same instructions)."""
    stand_in = workdir / "mlx" / "backend" / "cuda" / "device" / "utils.cuh"
    stand_in.parent.mkdir(parents=True, exist_ok=True)
    stand_in.write_text(_STAND_IN)
    root = _cuda_root()
    includes = [workdir, root / "include", *_cccl_dirs(root)]
    options = [
        f"--gpu-architecture={arch}".encode(),
        # as MLX's JIT compiles (libmlx 0.32): unannotated functions, lambdas
        # included, are device code; NVRTC 13.0 refuses the kernels' generic
        # lambdas without it (13.5 infers it)
        b"--device-as-default-execution-space",
        b"--ptxas-options=--verbose",
        *([b"--generate-line-info"] if line_info else []),
        *[f"-I{path}".encode() for path in includes],
    ]
    nvrtc = _nvrtc()
    program = ctypes.c_void_p()
    created = nvrtc.nvrtcCreateProgram(
        ctypes.byref(program), text.encode(), b"kernel.cu", 0, None, None
    )
    assert created == 0, f"nvrtcCreateProgram: {created}"
    try:
        argv = (ctypes.c_char_p * len(options))(*options)
        result = nvrtc.nvrtcCompileProgram(program, len(options), argv)
        size = ctypes.c_size_t()
        nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size))
        buffer = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetProgramLog(program, buffer)
        cubin = b""
        if result == 0:
            nvrtc.nvrtcGetCUBINSize(program, ctypes.byref(size))
            code = ctypes.create_string_buffer(size.value)
            nvrtc.nvrtcGetCUBIN(program, code)
            cubin = code.raw
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(program))
    log = buffer.value.decode(errors="replace")
    registers = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores", log)
    return Compiled(
        result == 0,
        log,
        int(registers.group(1)) if registers else None,
        int(spills.group(1)) if spills else None,
        cubin,
    )
