"""Digests of the MTP step kernel's machine code, without a GPU.

For each default-switch case of the kernel's compile test
(tests/models/test_mtp_cuda.py, `test_the_step_kernel_compiles_without_spills`:
greedy and sampled, full head and FR-Spec list, first and chained steps, one
and several rows, dense and MoE heads) this compiles the CUDA source exactly
as MLX would be given it (NVRTC, sm_90; the dev extra's CUDA wheels) and
prints the cubin's size, registers and SHA-256. Two trees whose digests are
equal run the same instructions, so a change that should not touch the
measured kernel (removing a switch that is off, a comment, a refactor) is
checked without device time: run it before and after and compare.
`--switches` compiles another arm (`NAME` on, `-NAME` off).

    python bench/cubin_digest.py > /tmp/before.txt   # then after the change:
    python bench/cubin_digest.py | diff /tmp/before.txt - && echo same code
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "models"))
import models  # noqa: F401  before mlx: routes its BLAS (models/blas.py)

# isort: split

import mlx.core as mx
import pytest

from models import mtp_cuda
from models.mtp_cuda import FusedStep, fused_weights
from specpipe.draft_vocab import DraftVocabulary, SubsetHead


def default_cases(test_module: Any) -> list[tuple[Any, ...]]:
    """The compile test's parameter rows with no switches of their own."""
    marks = test_module.test_the_step_kernel_compiles_without_spills.pytestmark
    rows = next(m.args[1] for m in marks if m.name == "parametrize")
    return [row for row in rows if not row[-1]]


def digest(test_module: Any, fixtures: dict[str, Any], case: tuple[Any, ...]) -> str:
    from nvrtc_support import compile_source, source

    kind, greedy, first, listed, rows, length, count, _ = case
    target, head = fixtures[kind]
    weights = fused_weights(target, head, 0)
    assert weights is not None
    vocab = test_module.VOCAB
    if listed:
        ids = list(range(0, vocab, 3))
        subset = SubsetHead.of(target, DraftVocabulary.create(ids, vocab).unwrap())
        step = FusedStep.make(weights, subset.weights.weight, subset.ids, blocks=96)
    else:
        step = FusedStep.make(weights, target.head_weights().weight, None, blocks=128)
    assert step is not None
    patch = pytest.MonkeyPatch()
    try:
        seen = test_module.captured_kernel(patch, mtp_cuda)
        cache = head.make_cache(rows)
        cache.reserve(64)
        step(
            first,
            greedy,
            0 if greedy else 20,
            mtp_cuda.draw_params(1e-6, 0.7, 0.8, 0.05),
            mx.zeros((rows, length), dtype=mx.int32),
            mx.zeros((rows, length, weights.shape.hidden), dtype=mx.bfloat16),
            mx.zeros((rows,), dtype=mx.int32),
            mx.zeros((rows,), dtype=mx.int32),
            cache.keys[0],
            cache.values[0],
            mx.zeros((rows,), dtype=mx.uint32),
            mx.zeros((rows,), dtype=mx.uint32),
            count=count,
            kv_out=first and count > 1,
        )
    finally:
        patch.undo()
    text = source(
        "mtp_step",
        mtp_cuda._COMPACT_HEADER,
        mtp_cuda._COMPACT_SOURCE,
        list(zip(mtp_cuda._INPUTS, seen["inputs"], strict=True)),
        list(zip(mtp_cuda._OUTPUTS, seen["output_dtypes"], strict=True)),
        list(seen["template"]),
    )
    with tempfile.TemporaryDirectory() as work:
        compiled = compile_source(text, Path(work))
    assert compiled.ok, compiled.log[:4000]
    code = hashlib.sha256(compiled.cubin).hexdigest()[:16]
    return f"{len(compiled.cubin)} bytes, {compiled.registers} registers, sha256 {code}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--switches", default="", help="comma-separated NAME (on) / -NAME (off)")
    args = parser.parse_args()
    from bench.mtp import apply_switches

    apply_switches(args.switches)
    import test_mtp_cuda

    fixtures = {"moe": test_mtp_cuda.built(test_mtp_cuda.MOE), "dense": test_mtp_cuda.built(test_mtp_cuda.DENSE)}
    for case in default_cases(test_mtp_cuda):
        kind, greedy, first, listed, rows, length, count, _ = case
        label = (f"{kind} {'greedy' if greedy else 'sampled'} {'first' if first else 'chained'} "
                 f"{'fr' if listed else 'full'} rows={rows} length={length} steps={count}")  # fmt: skip
        print(f"{label}: {digest(test_mtp_cuda, fixtures, case)}", flush=True)


if __name__ == "__main__":
    main()
