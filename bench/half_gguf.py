"""Write an F16 (or BF16) GGUF from another GGUF, as llama.cpp's
`--outtype f16` (`bf16`) lays one out: every weight matrix re-encoded in the
half type, vectors (norms, biases) kept F32, the metadata copied. For the
load, memory and speed figures of a half-precision GGUF in bench/RESULTS.md
(no fixture is one):

    python bench/half_gguf.py qwen2.5-coder-0.5b-instruct /tmp/q05-f16.gguf
    /usr/bin/time -f "%e s %M KB" specpipe generate "def quicksort(arr):" \\
        --model /tmp/q05-f16.gguf --max-tokens 32

The source's quantized matrices are dequantized first, so the copy holds
their values rounded to the half type, not the original model's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize, quantize
from tqdm import tqdm

from specpipe.fixtures import fixture_names, install_fixture

_TYPES = {"f16": GGMLQuantizationType.F16, "bf16": GGMLQuantizationType.BF16}


def source_path(ref: str) -> Path:
    if ref in fixture_names():
        return install_fixture(ref).unwrap()
    return Path(ref)


def write_half(source: Path, out: Path, kind: GGMLQuantizationType) -> None:
    reader = GGUFReader(str(source))
    arch = str(reader.fields["general.architecture"].contents())
    writer = GGUFWriter(str(out), arch)
    for name, field in reader.fields.items():
        # the header's own fields (version, counts, alignment) the writer sets
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub)
    for tensor in tqdm(reader.tensors, desc="re-encoding", unit="tensor"):
        values = dequantize(tensor.data, tensor.tensor_type)
        shape = [int(n) for n in reversed(tensor.shape.tolist())]
        values = values.reshape(shape).astype(np.float32)
        if values.ndim >= 2:
            raw = quantize(values, kind)
            writer.add_tensor(tensor.name, raw, raw_shape=raw.shape, raw_dtype=kind)
        else:
            writer.add_tensor(tensor.name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=True)
    writer.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="a .gguf file or a fixture name")
    parser.add_argument("out", type=Path)
    parser.add_argument("--type", choices=sorted(_TYPES), default="f16")
    args = parser.parse_args()
    write_half(source_path(args.source), args.out, _TYPES[args.type])
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e6:.0f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
