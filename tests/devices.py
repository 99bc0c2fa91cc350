"""Which MLX build the suite runs on, for tests whose subject exists on one
build only."""

from __future__ import annotations

import pytest

import models.parallel as parallel

# CPU products split over threads where MLX is CPU-only: with its CUDA backend
# CPU products stay whole by design (split products of GPU-made arrays went
# wrong on an H200: models/parallel.py), so tests that need a split to happen
# apply to the CPU build only. CI runs them; a GPU machine checks the refusal.
needs_cpu_build = pytest.mark.skipif(
    parallel._cuda_backend(),
    reason="MLX's CUDA build never splits CPU products (models/parallel.py)",
)
