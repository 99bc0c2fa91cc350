"""Write a random-weight HF-layout MLX folder of a real model's shape, through
specpipe's own build and save path (`models.build.build_model` +
`specpipe.load.save_folder`, the code `specpipe convert` runs), so timing
runs on a device need no weights to travel: time per token does not depend
on the weights' values. Outputs are meaningless, and greedy acceptance of a
random draft by a random target is near zero: use it for forward cost, tok/s
and ms per round, never for acceptance.

The tokenizer is copied from a real folder of the same family (`--tokenizer`,
a folder with tokenizer.json and tokenizer_config.json; a `tokenizer.json.gz`
is unpacked), so prompts encode as they would for the real model.

    python bench/random_weights.py --shape qwen2.5-1.5b --dtype bfloat16 \
        --tokenizer ~/.cache/specpipe/models/qwen2.5-coder-1.5b-instruct OUT
"""

from __future__ import annotations

import argparse
import gzip
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import models  # noqa: F401  before mlx: routes its BLAS (models/blas.py)

# isort: split

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

_QWEN = {
    "model_type": "qwen2",
    "vocab_size": 151936,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 32768,
    "bos_token_id": 151643,
    "eos_token_id": [151645],
}

# config.json values of the released checkpoints (Qwen2.5 / Qwen2.5-Coder)
SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": {
        **_QWEN,
        "hidden_size": 896,
        "num_hidden_layers": 24,
        "intermediate_size": 4864,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
    },
    "qwen2.5-1.5b": {
        **_QWEN,
        "hidden_size": 1536,
        "num_hidden_layers": 28,
        "intermediate_size": 8960,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
    },
    "qwen2.5-7b": {
        **_QWEN,
        "vocab_size": 152064,
        "hidden_size": 3584,
        "num_hidden_layers": 28,
        "intermediate_size": 18944,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "tie_word_embeddings": False,
    },
}


def tokenizer_folder(source: Path) -> Path:
    """`source` itself, or a temp copy with tokenizer.json.gz unpacked."""
    if (source / "tokenizer.json").is_file():
        return source
    packed = source / "tokenizer.json.gz"
    if not packed.is_file():
        raise SystemExit(f"{source}: no tokenizer.json or tokenizer.json.gz")
    tmp = Path(tempfile.mkdtemp(prefix="tok-"))
    with gzip.open(packed, "rb") as src, open(tmp / "tokenizer.json", "wb") as dst:
        shutil.copyfileobj(src, dst)
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        if (source / name).is_file():
            shutil.copy(source / name, tmp / name)
    return tmp


def write_random(
    shape: str, dtype: str, tokenizer: Path, out: Path, quantize: int | None, seed: int
) -> Path:
    from models.build import build_model
    from models.tokenizer import Tokenizer
    from specpipe.load import LoadedModel, args_from_config, save_folder

    config = dict(SHAPES[shape])
    args = args_from_config(config, f"random {shape}").unwrap()
    mx.random.seed(seed)
    model: Any = build_model(args).unwrap()
    target = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}[
        dtype
    ]
    # MLX's default initialisers (uniform +-1/sqrt(fan_in), N(0,1) embeddings) in the target dtype
    model.update(
        tree_map(
            lambda p: p.astype(target) if mx.issubdtype(p.dtype, mx.floating) else p,
            model.parameters(),
        )
    )
    mx.eval(model.parameters())
    tok = Tokenizer.from_folder(tokenizer_folder(tokenizer)).unwrap()
    loaded = LoadedModel(model, tok, args, f"random:{shape}", None)
    path = save_folder(loaded, out, quantize).unwrap()
    count = sum(v.size for _, v in tree_flatten(model.parameters()))
    print(
        f"wrote {path}: {shape} random weights, {count / 1e6:.0f}M values, {dtype}"
        + (f", {quantize}-bit" if quantize else ""),
        file=sys.stderr,
    )
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-0.5b")
    parser.add_argument(
        "--dtype", choices=["float32", "float16", "bfloat16"], default="bfloat16"
    )
    parser.add_argument("--quantize", type=int, choices=[4, 8], default=None)
    parser.add_argument(
        "--tokenizer", required=True, help="folder with the family's tokenizer files"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    write_random(
        args.shape,
        args.dtype,
        Path(args.tokenizer).expanduser(),
        Path(args.out),
        args.quantize,
        args.seed,
    )


if __name__ == "__main__":
    main()
