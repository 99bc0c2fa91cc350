"""Our models on the real checkpoints against HF transformers loading the same GGUF.

transformers dequantises the GGUF to float32 itself, so this checks our GGUF
reader (incl. the llama.cpp Q/K un-permutation), our tokenizer and our forward
together.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from schemas.request import GenerationLimits
from specpipe.api import Pipeline
from specpipe.fixtures import install_fixture

PROMPTS = [
    "def fibonacci(n):",
    "The capital of France is",
    "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
]
NEW_TOKENS = 16


def _reference(name: str) -> torch.nn.Module:
    path = install_fixture(name, progress=False).unwrap()
    model = AutoModelForCausalLM.from_pretrained(
        str(Path(path).parent), gguf_file=Path(path).name, dtype=torch.float32
    )
    return model.eval()


def _compare(pipeline: Pipeline, name: str) -> None:
    reference = _reference(name)
    worst = 0.0
    for prompt in PROMPTS:
        ids = list(pipeline.encode(prompt).unwrap())
        cache = pipeline.target.model.make_cache(1)
        ours = pipeline.target.model(mx.array([ids]), cache, [0]).logits[0]
        with torch.no_grad():
            theirs = reference(torch.tensor([ids])).logits[0].numpy()
        diff = float(np.max(np.abs(np.array(ours) - theirs)))
        worst = max(worst, diff)
        assert diff < 2e-3, f"{name} {prompt!r}: max |logit diff| {diff}"
        with torch.no_grad():
            out = reference.generate(
                torch.tensor([ids]),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        expected = out[0, len(ids) :].tolist()
        result = pipeline.generate(
            ids, limits=GenerationLimits(max_tokens=NEW_TOKENS)
        ).unwrap()
        eos = set(pipeline.target.tokenizer.eos_token_ids)
        cut = next((i for i, t in enumerate(expected) if t in eos), len(expected))
        assert list(result.tokens) == expected[:cut], prompt
    print(
        f"\n{name}: max |logit diff| vs transformers over {len(PROMPTS)} prompts: {worst:.2e}"
    )


@pytest.mark.fixture
def test_smollm2_matches_transformers(smollm2: Pipeline) -> None:
    _compare(smollm2, "smollm2-135m-instruct")


@pytest.mark.fixture
def test_qwen05_matches_transformers(qwen05: Pipeline) -> None:
    _compare(qwen05, "qwen2.5-coder-0.5b-instruct")


@pytest.mark.fixture
def test_gemma3_matches_transformers(gemma3: Pipeline) -> None:
    """A gemma3 GGUF (llama.cpp's norms stored plus one, its fixed sliding
    pattern and RoPE bases) read as transformers reads it."""
    kinds = {
        (module.bits, module.group_size)
        for _, module in gemma3.target.model.named_modules()
        if type(module).__name__.startswith("Quantized")
    }
    assert (6, 16) in kinds and (5, 32) in kinds  # Q6_K and Q5_0 kept
    _compare(gemma3, "gemma-3-270m")


@pytest.mark.fixture
def test_gemma3_tokenizer_matches_transformers(gemma3: Pipeline) -> None:
    """The GGUF's SentencePiece vocabulary (no space prefix, byte fallback,
    Gemma's turn markers) encodes as transformers' GGUF tokenizer does."""
    from transformers import AutoTokenizer

    path = install_fixture("gemma-3-270m", progress=False).unwrap()
    reference = AutoTokenizer.from_pretrained(
        str(Path(path).parent), gguf_file=Path(path).name
    )
    for text in [
        *PROMPTS,
        "  Hello,  wörld! 日本語 <start_of_turn>user\nhi<end_of_turn>",
        "émoji 🎉 and tabs\tand\nnewlines",
    ]:
        ours = list(gemma3.encode(text).unwrap())
        assert ours == reference(text)["input_ids"], text
        assert gemma3.target.tokenizer.decode(ours[1:]) == text
