"""Digests of the MTP step kernel's machine code, without a GPU.

For each default-switch case of the kernel's compile test
(tests/models/test_mtp_cuda.py, `test_the_step_kernel_compiles_without_spills`:
greedy and sampled, full head and FR-Spec list, first and chained steps, one
and several rows, dense and MoE heads), and for three whole rounds that
derive their inputs on the device (the form a steady-state round launches),
this compiles the CUDA source exactly as MLX would be given it (NVRTC,
sm_90; the dev extra's CUDA wheels) and
prints the cubin's size, registers and SHA-256. Two trees whose digests are
equal run the same instructions, so a change that should not touch the
measured kernel (removing a switch that is off, a comment, a refactor) is
checked without device time: run it before and after and compare.
`--switches=SET` compiles another arm (`NAME` on, `-NAME` off; the `=` form, since an off arm starts with a dash).
Some forms compile to other bytes from one run to the next on the same
source, with the same size and registers (seen 2026-12-04: the dense
sampled eight-row step often, the dense greedy first step once; 2026-12-05
the MoE sampled two-row three-step chain once): rerun a differing form
before reading a change into it. The cubin holds the
kernel's name, which MLX builds from its template values (as
tests/models/nvrtc_support.py mirrors since 2026-12-05): a change that adds a
template constant changes every digest and size by its name alone, so compare
such trees by the `code` digest instead: the SHA-256 of the cubin's `.text`
sections alone (the kernel's instructions, whatever its name).

    python bench/cubin_digest.py > /tmp/before.txt   # then after the change:
    python bench/cubin_digest.py | diff /tmp/before.txt - && echo same code
"""

from __future__ import annotations

import hashlib
import struct
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "models"))
import models  # noqa: F401  before mlx: routes its BLAS (models/blas.py)

# isort: split

import pytest


def default_cases(test_module: Any) -> list[tuple[Any, ...]]:
    """The compile test's parameter rows with no switches of their own."""
    marks = test_module.test_the_step_kernel_compiles_without_spills.pytestmark
    rows = next(m.args[1] for m in marks if m.name == "parametrize")
    return [row for row in rows if not row[-1]]


def digest(test_module: Any, fixtures: dict[str, Any], case: tuple[Any, ...]) -> str:
    kind, greedy, first, listed, rows, length, count, _ = case
    target, head = fixtures[kind]
    patch = pytest.MonkeyPatch()
    try:
        shape = (greedy, first, listed, rows, length, count)
        _, text = test_module.step_kernel_source(patch, target, head, shape, {})
    finally:
        patch.undo()
    return described(text)


def described(text: str) -> str:
    """A translation unit compiled: its cubin's size, registers and digests."""
    from nvrtc_support import compile_source

    with tempfile.TemporaryDirectory() as work:
        compiled = compile_source(text, Path(work))
    assert compiled.ok, compiled.log[:4000]
    whole = hashlib.sha256(compiled.cubin).hexdigest()[:16]
    code = hashlib.sha256(text_sections(compiled.cubin)).hexdigest()[:16]
    return f"{len(compiled.cubin)} bytes, {compiled.registers} registers, sha256 {whole}, code {code}"


def derived_digest(
    test_module: Any, fixture: Any, rows: int, width: int, greedy: bool
) -> str:
    """The same for a whole round that derives its inputs on the device
    (`test_the_derived_round_compiles_and_reads_no_host_input`'s form)."""
    patch = pytest.MonkeyPatch()
    try:
        seen, _ = test_module.derived_round_call(*fixture, patch, rows, width, greedy)
    finally:
        patch.undo()
    return described(test_module.step_text(seen, {}))


def text_sections(cubin: bytes) -> bytes:
    """The bytes of a cubin's `.text.*` sections (its instructions), in
    section order: an ELF64 little-endian file, as NVRTC writes one."""
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2 or cubin[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF cubin")
    shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)

    def header(i: int) -> tuple[int, int, int]:
        name, _, _, _, offset, size = struct.unpack_from(
            "<IIQQQQ", cubin, shoff + i * shentsize
        )
        return name, offset, size

    _, names_at, _ = header(shstrndx)
    out = b""
    for i in range(shnum):
        name, offset, size = header(i)
        end = cubin.index(b"\0", names_at + name)
        if cubin[names_at + name : end].startswith(b".text."):
            out += cubin[offset : offset + size]
    return out


def main() -> None:
    from bench.mtp import apply_switches, switches_parser

    parser = switches_parser(__doc__)
    args = parser.parse_args()
    apply_switches(args.switches)
    import test_mtp_cuda

    fixtures = {
        "moe": test_mtp_cuda.built(test_mtp_cuda.MOE),
        "dense": test_mtp_cuda.built(test_mtp_cuda.DENSE),
    }
    for case in default_cases(test_mtp_cuda):
        kind, greedy, first, listed, rows, length, count, _ = case
        label = (f"{kind} {'greedy' if greedy else 'sampled'} {'first' if first else 'chained'} "
                 f"{'fr' if listed else 'full'} rows={rows} length={length} steps={count}")  # fmt: skip
        print(f"{label}: {digest(test_mtp_cuda, fixtures, case)}", flush=True)
    for rows, width, greedy in ((1, 3, True), (1, 3, False), (3, 2, False)):
        label = f"moe {'greedy' if greedy else 'sampled'} derived round rows={rows} width={width}"
        digest_text = derived_digest(
            test_mtp_cuda, fixtures["moe"], rows, width, greedy
        )
        print(f"{label}: {digest_text}", flush=True)


if __name__ == "__main__":
    main()
