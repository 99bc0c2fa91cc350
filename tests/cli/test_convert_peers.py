"""`specpipe convert` writes folders that transformers and mlx-lm load too."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from specpipe.api import load
from specpipe.cli import main

IDS = [[5, 17, 42, 99, 3, 250, 7]]


def convert(src: Path, out: Path, *flags: str) -> Path:
    main(["convert", str(src), str(out), *flags])
    return out


def ours(folder: Path) -> np.ndarray:
    model = load(str(folder)).unwrap().target.model
    return np.array(model(mx.array(IDS), model.make_cache(1), [0]).logits[0])


@pytest.mark.parametrize("model_type", ["qwen2", "llama"])
def test_transformers_loads_converted_folder(tmp_path: Path, model_type: str) -> None:
    from tests.cli.conftest import write_tiny_model

    src = write_tiny_model(tmp_path / "src", model_type=model_type)
    out = convert(src, tmp_path / "out")
    reference = AutoModelForCausalLM.from_pretrained(
        str(out), dtype=torch.float32
    ).eval()
    with torch.no_grad():
        theirs = reference(torch.tensor(IDS)).logits[0].numpy()
    assert np.max(np.abs(ours(out) - theirs)) < 1e-4
    # The tokenizer files are checked against transformers on the real
    # checkpoints (tests/models/test_tokenizer.py); transformers 5 builds a
    # tiny model's tokenizer from its model_type's class, not tokenizer.json.
    text = "def fibonacci(n):\n    return n  # 🦊"
    src_tok = load(str(src)).unwrap().target.tokenizer
    out_tok = load(str(out)).unwrap().target.tokenizer
    assert out_tok.encode(text) == src_tok.encode(text)
    assert out_tok.eos_token_ids == src_tok.eos_token_ids


@pytest.mark.parametrize("quantize", ["none", "4", "8"])
def test_mlx_lm_loads_converted_folder(
    tiny_model: Path, tmp_path: Path, quantize: str
) -> None:
    import mlx_lm

    out = convert(
        tiny_model,
        tmp_path / f"q{quantize}",
        "--quantize",
        quantize,
        "--group-size",
        "32",
    )
    model, _tokenizer = mlx_lm.load(str(out))
    theirs = np.array(model(mx.array(IDS))[0])
    assert np.max(np.abs(ours(out) - theirs)) < 1e-4
