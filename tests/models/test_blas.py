"""models/blas.py: MLX's CPU float32 products routed to an optimised BLAS.

Each case runs in a fresh interpreter: the route is taken once per process,
before MLX loads (tests/conftest.py pins this process to the reference BLAS).
"""

from __future__ import annotations

import _ctypes
import ctypes
import ctypes.util
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[2]

_REPORT = """
import json, sys
{before}
import specpipe
from models.blas import route_blas
route = route_blas()
import mlx.core as mx
import numpy as np
rng = np.random.default_rng(0)
x = rng.standard_normal((3, 4096)).astype(np.float32)
w = rng.standard_normal((100, 4096)).astype(np.float32)
y = np.array(mx.array(x) @ mx.array(w).T)
exact = x.astype(np.float64) @ w.astype(np.float64).T
print(json.dumps({{
    "library": route.library,
    "reason": route.reason,
    "error": float(np.abs(y - exact).max()),
}}))
"""


def _run(
    blas: str | None, before: str = "", debug: bool = False
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "SPECPIPE_BLAS"}
    if blas is not None:
        env["SPECPIPE_BLAS"] = blas
    if debug:  # the dynamic linker reports where each symbol binds
        env["LD_DEBUG"] = "bindings"
    # the checkout first, then whatever path the suite itself runs with
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(_ROOT), os.environ.get("PYTHONPATH", "")) if p
    )
    return subprocess.run(
        [sys.executable, "-c", _REPORT.format(before=before)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _report(blas: str | None, before: str = "") -> dict[str, object]:
    done = _run(blas, before)
    assert done.returncode == 0, done.stderr
    report: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return report


def _mlx_sgemm_binding(blas: str) -> str:
    """The library MLX's `cblas_sgemm` was bound to in a fresh process."""
    done = _run(blas, debug=True)
    assert done.returncode == 0, done.stderr[-2000:]
    bound = [
        line.split(" to ", 1)[1]
        for line in done.stderr.splitlines()
        if "cblas_sgemm" in line and "libmlx" in line.split(" to ", 1)[0]
    ]
    assert bound, "no binding of MLX's cblas_sgemm reported"
    return bound[0]


def _bundled(bound: str) -> bool:
    """Whether a binding is to the BLAS MLX's wheel bundles: the CPU build's
    (`mlx_cpu.libs`) or a CUDA build's (`mlx_cuda_13.libs`)."""
    return re.search(r"mlx_(cpu|cuda_\d+)\.libs", bound) is not None


def _openblas_installed() -> bool:
    found = ctypes.util.find_library("openblas")
    for name in ([found] if found else []) + ["libopenblas.so.0"]:
        try:
            ctypes.CDLL(name)
        except OSError:
            continue
        return True
    return False


linux_only = pytest.mark.skipif(
    platform.system() != "Linux", reason="MLX uses Accelerate on macOS"
)


@linux_only
def test_the_reference_setting_keeps_mlx_bundled_blas() -> None:
    report = _report("reference")
    assert report["library"] == "reference"
    assert report["reason"] == "SPECPIPE_BLAS=reference"
    assert isinstance(report["error"], float) and report["error"] < 1e-3


@linux_only
def test_auto_routes_products_to_an_installed_openblas() -> None:
    auto = _report("auto")
    assert isinstance(auto["error"], float) and auto["error"] < 1e-3
    bound = _mlx_sgemm_binding("auto")
    if _openblas_installed():
        assert auto["library"] == "openblas"
        assert "openblas" in bound  # MLX's own calls run on it
    else:
        assert auto["library"] == "reference"
        assert "no OpenBLAS found" in str(auto["reason"])
        assert _bundled(bound)
    assert _bundled(_mlx_sgemm_binding("reference"))


@linux_only
def test_mlx_imported_first_keeps_the_reference_blas_and_says_why() -> None:
    report = _report("auto", before="import mlx.core")
    assert report["library"] == "reference"
    assert "import specpipe (or models) first" in str(report["reason"])


@linux_only
def test_a_missing_library_path_is_a_clear_error() -> None:
    done = _run(str(_ROOT / "no-such-blas.so"))
    assert done.returncode != 0
    assert "SPECPIPE_BLAS" in done.stderr and "is not a file" in done.stderr


@linux_only
def test_a_library_without_cblas_sgemm_is_a_clear_error() -> None:
    not_a_blas = _ctypes.__file__  # a shared library that exports no BLAS
    assert not_a_blas is not None
    done = _run(not_a_blas)
    assert done.returncode != 0
    assert "does not export cblas_sgemm" in done.stderr
