"""Peak memory of one prefill window of a hybrid model, with and without the
prefill flag (`CausalLM.__call__(..., prefill=True)`, which specpipe's
prefill passes): without it, a window of <= 64 tokens keeps every
position's recurrent state of every linear layer until the commit.

Random bf16 weights of Qwen3-Next's per-layer shapes (`bench/mtp.py`);
memory above the model and its cache, MLX's peak counter, alternating runs.

    python bench/prefill_memory.py --layers 4 --tokens 64 --rows 1
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import models  # noqa: F401  before mlx: routes its BLAS (models/blas.py)

# isort: split
import mlx.core as mx

from bench.common import machine_info
from bench.mtp import SHAPES
from models.build import build_model
from schemas.hf_hybrid import hybrid_args


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    config = SHAPES["qwen3-next"](args.layers, 8, 2048, args.vocab)
    model = build_model(hybrid_args(config, "bench").unwrap()).unwrap()
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    ids = mx.random.randint(0, args.vocab, (args.rows, args.tokens)).astype(mx.int32)
    runs: dict[str, list[float]] = {"per_position": [], "prefill": []}
    for prefill in (False, True) * 2:
        cache = model.make_cache(args.rows)
        cache.reserve(args.tokens)
        mx.eval(cache.arrays())
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        out = model(ids, cache, [0] * args.rows, prefill=prefill)
        assert out.delta is not None
        out.delta.commit([args.tokens] * args.rows)
        mx.eval(cache.arrays())
        peak = (mx.get_peak_memory() - base) / 2**20
        runs["prefill" if prefill else "per_position"].append(round(peak, 1))
    report = {
        "machine": machine_info(),
        "device": str(mx.default_device()),
        "linear_layers": len(hybrid_args(config, "bench").unwrap().linear_layers),
        "tokens": args.tokens,
        "rows": args.rows,
        "peak_mib_above_model_and_cache": runs,
    }
    print(json.dumps(report["peak_mib_above_model_and_cache"]))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
