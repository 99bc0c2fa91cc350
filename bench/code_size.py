"""The MTP step kernel's code size, without a GPU.

A chained draft step is bound by fetching its code (models/mtp_cuda.py,
`DRAW_HEADS`'s note and the one on its trimmed code): its code does not stay in the
multiprocessor's instruction cache from one step to the next, so the bytes a
step runs cost time. This compiles the round a steady-state launch runs
(derived inputs, the full head) at Qwen3-Next's sizes, as the compile test
does (tests/models/test_mtp_cuda.py, NVRTC, sm_90a), and prints:

- the step loop's bytes: the chained steps' code, from the loop's first
  instruction to its backward branch (code a step jumps over included);
- the registers and spills;
- with `--phases`, the loop's bytes by the kernel phase their source lines
  sit in (nvdisasm's inline line info: an inlined helper's instructions
  count for the phase that calls it).

    python bench/code_size.py --sampling qwen --phases
    python bench/code_size.py --switches=-REDUX_TOPK     # an arm against the defaults

Needs nvdisasm: NVIDIA's wheel (`pip install "nvidia-cuda-nvdisasm>=13,<14"`)
or one on PATH; NVRTC and the CUDA headers come with the dev extra.
"""

from __future__ import annotations

import collections
import json
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "models"))
import models  # noqa: F401  before mlx: routes its BLAS (models/blas.py)

# isort: split

import pytest

_ADDRESS = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_TARGET = re.compile(r"`\((\.L_x_\d+)\)")
_PHASE = re.compile(r"//\s*----\s*([0-9][0-9-]*)\.\s*(.*?)\s*-*$")


def nvdisasm() -> str:
    """nvdisasm's path: NVIDIA's CUDA 13 wheel's, else one on PATH."""
    try:
        import nvidia

        for base in nvidia.__path__:
            found = Path(base) / "cu13" / "bin" / "nvdisasm"
            if found.is_file():
                return str(found)
    except ImportError:
        pass
    on_path = shutil.which("nvdisasm")
    if on_path is None:
        raise FileNotFoundError(
            'nvdisasm not found: pip install "nvidia-cuda-nvdisasm>=13,<14" '
            "(or put CUDA's nvdisasm on PATH)"
        )
    return on_path


def round_text(sampled: bool, experts: int, rows: int, width: int) -> str:
    """The derived round's translation unit at Qwen3-Next's sizes, with the
    kernel's commented source (the same code as the compact one MLX gets:
    comments mark the phases), as the compile test builds it."""
    import test_mtp_cuda as t

    from models import mtp_cuda

    moe = t.built(t.MOE)
    patch = pytest.MonkeyPatch()
    try:
        patch.setattr(mtp_cuda, "_COMPACT_SOURCE", mtp_cuda._SOURCE)
        seen, _ = t.derived_round_call(*moe, patch, rows, width, not sampled)
        return t.step_text(seen, t.qwen3_next_constants(moe, rows, width, experts))
    finally:
        patch.undo()


def instructions(sass: str) -> Iterator[tuple[int, str, int | None]]:
    """(address, instruction, the kernel body's outermost source line) of
    nvdisasm's `-c -gi` listing; labels resolve to the next address."""
    line: int | None = None
    for text in sass.splitlines():
        if "//##" in text:
            lines = [int(n) for n in re.findall(r"line (\d+)", text)]
            line = lines[-1] if lines else None  # the last: "inlined at" the caller
            continue
        found = _ADDRESS.search(text)
        if found:
            yield int(found.group(1), 16), found.group(2), line


def step_loop(sass: str) -> tuple[int, int]:
    """The step loop's [first, end) addresses: the backward branch spanning
    the most code (the chained steps' loop holds every other)."""
    labels: dict[str, int] = {}
    pending: list[str] = []
    for text in sass.splitlines():
        label = _LABEL.match(text)
        if label:
            pending.append(label.group(1))
            continue
        found = _ADDRESS.search(text)
        if found:
            for name in pending:
                labels[name] = int(found.group(1), 16)
            pending = []
    best = (0, 0)
    for address, instruction, _ in instructions(sass):
        target = _TARGET.search(instruction)
        if "BRA" in instruction and target and target.group(1) in labels:
            start = labels[target.group(1)]
            if start < address and address - start > best[1] - best[0]:
                best = (start, address + 16)
    if best == (0, 0):
        raise ValueError("no backward branch: not the step kernel's listing")
    return best


def phases(text: str) -> list[tuple[int, str]]:
    """(first line, name) of the kernel's phases, from its `// ---- N.`
    comments, the kernel's top before them."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if "custom_kernel_" in line) + 1
    marks = [(1, "header functions"), (start, "the kernel's top")]
    for number, line in enumerate(lines, start=1):
        found = _PHASE.search(line)
        if found and number > start:
            marks.append((number, f"{found.group(1)}. {found.group(2)}"))
    return marks


def measure(
    sampled: bool, experts: int, rows: int, width: int, with_phases: bool
) -> dict[str, Any]:
    from nvrtc_support import compile_source

    text = round_text(sampled, experts, rows, width)
    with tempfile.TemporaryDirectory() as work:
        compiled = compile_source(text, Path(work), "sm_90a", line_info=True)
        assert compiled.ok, compiled.log[:4000]
        cubin = Path(work) / "round.cubin"
        cubin.write_bytes(compiled.cubin)
        sass = subprocess.run(
            [nvdisasm(), "-c", "-gi", str(cubin)],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    first, end = step_loop(sass)
    out: dict[str, Any] = {
        "sampling": "qwen" if sampled else "greedy",
        "experts": experts,
        "rows": rows,
        "width": width,
        "registers": compiled.registers,
        "spill_bytes": compiled.spill_bytes,
        "step_loop_bytes": end - first,
    }
    if with_phases:
        marks = phases(text)
        counts: collections.Counter[str] = collections.Counter()
        for address, _, line in instructions(sass):
            if first <= address < end:
                name = "unknown"
                for begin, label in marks:
                    if line is not None and line >= begin:
                        name = label
                counts[name] += 16
        out["phases"] = dict(counts.most_common())
    return out


def main() -> None:
    from bench.mtp import apply_switches, switches_parser

    parser = switches_parser(__doc__)
    parser.add_argument("--sampling", default="greedy,qwen", help="of greedy, qwen")
    parser.add_argument("--experts", type=int, default=512)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument(
        "--width", type=int, default=3, help="the window's positions a row"
    )
    parser.add_argument("--phases", action="store_true", help="bytes by phase too")
    args = parser.parse_args()
    apply_switches(args.switches)
    for sampling in args.sampling.split(","):
        if sampling not in ("greedy", "qwen"):
            parser.error(f"--sampling: greedy or qwen, got {sampling!r}")
        result = measure(
            sampling == "qwen", args.experts, args.rows, args.width, args.phases
        )
        result["switches"] = args.switches
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
