"""Route MLX's CPU float32 products to an optimised BLAS (Linux).

The Linux `mlx[cpu]` wheels link the reference BLAS of netlib's LAPACK
(`mlx_cpu.libs/libblas-*.so.3.10`), and MLX's CPU backend sends every float32
matrix product to its `cblas_sgemm`. That routine has no blocking and no
vector kernels: on an AVX2 core it multiplies at ~2 GFLOP/s, so a weight
product costs time in proportion to the rows it multiplies, and a verify
window of k+1 tokens costs nearly k+1 single-token steps — the one cost
speculative decoding needs to be small.

MLX resolves `cblas_sgemm` through the dynamic linker when its extension
loads, and the linker looks in the process's global scope before the
library's own dependencies. So if an OpenBLAS is loaded into the global scope
(`RTLD_GLOBAL`) before `mlx.core` is imported, MLX's products run on it: the
same calls, an optimised kernel, and a product's cost is its weight bytes
rather than its rows (bench/RESULTS.md, "float32 products on OpenBLAS").

`route_blas()` does that once per process; `models`, `specpipe`, `bindings`
and `schemas` call it on import, so it is in place whenever the library is
imported before MLX. Which library is used (`SPECPIPE_BLAS`):

- unset or `auto`: a system OpenBLAS if one is installed (Debian/Ubuntu:
  `apt install libopenblas0-pthread`; Fedora: `dnf install openblas`),
  otherwise MLX's bundled reference BLAS;
- `reference`: MLX's bundled BLAS, unchanged;
- a path to a shared library that exports `cblas_sgemm`.

OpenBLAS is told to use one thread: `models/parallel.py` already splits each
product over the CPU threads, one MLX stream each.

Numerics: OpenBLAS picks its kernel by the product's shape, so a window's
product and a single token's may round differently in the last bits (seen:
1e-6 on narrow products of 100-256 outputs; none on the model-sized products
checked). Greedy output can then differ from plain decoding only where two
logits tie to within that rounding. The reference BLAS computes every output
the same way at every width, which is what the byte-identity tests pin
(tests/conftest.py sets `SPECPIPE_BLAS=reference`).

On macOS MLX uses Accelerate and nothing is changed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

ENV = "SPECPIPE_BLAS"
_NAMES = ("libopenblas.so.0", "libopenblasp.so.0", "libopenblas.so")


@dataclass(frozen=True)
class BlasRoute:
    """Which BLAS MLX's CPU float32 products run on in this process."""

    library: str  # "openblas", "reference" (MLX's bundled), "platform" (macOS)
    path: str | None  # the loaded library, when routed
    reason: str  # why, for `specpipe --version`-style reports and benchmarks


_route: BlasRoute | None = None


def _find_openblas() -> str | None:
    found = ctypes.util.find_library("openblas")
    for name in ([found] if found else []) + list(_NAMES):
        try:
            ctypes.CDLL(name, mode=os.RTLD_LAZY | os.RTLD_LOCAL)
        except OSError:
            continue
        return name
    return None


def _load(path: str, named_by_user: bool) -> BlasRoute:
    try:
        handle = ctypes.CDLL(path, mode=os.RTLD_GLOBAL | os.RTLD_NOW)
    except OSError as error:
        if not named_by_user:
            return BlasRoute("reference", None, f"{path} did not load: {error}")
        raise ValueError(
            f"{ENV}={path!r}: cannot load it ({error}); set {ENV} to a BLAS "
            "shared library, to `auto` or to `reference`"
        ) from None
    if not hasattr(handle, "cblas_sgemm"):
        if named_by_user:
            raise ValueError(
                f"{ENV}={path!r} does not export cblas_sgemm; set it to an "
                "OpenBLAS (libopenblas.so.0), to `auto` or to `reference`"
            )
        return BlasRoute("reference", None, f"{path} has no cblas_sgemm")
    threads = getattr(handle, "openblas_set_num_threads", None)
    if threads is not None:
        threads(1)  # models/parallel.py splits products over the CPU threads
    return BlasRoute("openblas", path, "loaded before MLX")


def route_blas() -> BlasRoute:
    """Load an optimised BLAS into the global scope before MLX (once per
    process; see the module doc). Raises ValueError for a bad `SPECPIPE_BLAS`."""
    global _route
    if _route is not None:
        return _route
    setting = os.environ.get(ENV, "").strip()
    if platform.system() != "Linux":
        _route = BlasRoute("platform", None, "MLX uses the platform's BLAS")
    elif setting == "reference":
        _route = BlasRoute("reference", None, f"{ENV}=reference")
    elif setting not in ("", "auto") and not Path(setting).is_file():
        raise ValueError(
            f"{ENV}={setting!r} is not a file; set it to a BLAS shared library "
            "(e.g. /usr/lib/x86_64-linux-gnu/libopenblas.so.0), to `auto` or to "
            "`reference`"
        )
    elif "mlx.core" in sys.modules:
        _route = BlasRoute(
            "reference",
            None,
            "mlx was imported before specpipe; import specpipe (or models) first "
            "to use an optimised BLAS",
        )
    elif setting in ("", "auto"):
        found = _find_openblas()
        _route = (
            _load(found, named_by_user=False)
            if found is not None
            else BlasRoute(
                "reference",
                None,
                "no OpenBLAS found (Debian/Ubuntu: apt install libopenblas0-pthread)",
            )
        )
    else:
        _route = _load(setting, named_by_user=True)
    return _route
