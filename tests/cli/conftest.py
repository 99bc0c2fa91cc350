"""A tiny random model folder in the HF layout, made on the fly (no downloads), and
the command run in-process (`run`, `generate_json`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from models.build import build_model
from schemas.converter import hf, structure
from schemas.hf import DecoderArgs, normalize_hf_config
from specpipe.cli import main


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """The command's exit code, stdout and stderr for `argv`."""
    code = 0
    try:
        main(list(argv))
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def generate_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    """`specpipe generate ARGS --json`: exit code 0, its one JSON object."""
    code, out, err = run(capsys, "generate", *args, "--json")
    assert code == 0, err
    result = json.loads(out)
    assert isinstance(result, dict), out
    return result


CORPUS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "The quick brown fox jumps over the lazy dog. Hello world! " * 3,
    "for i in range(10):\n\tprint(i, i * i)\n",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tiny_model(
    folder: Path,
    vocab: int = 320,
    seed: int = 0,
    model_type: str = "qwen2",
    context: int = 256,
    tokenizer_vocab: int = 300,
    hidden_size: int = 64,
) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=tokenizer_vocab,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|endoftext|>", "chat_template": TEMPLATE})
    )
    config = {
        "model_type": model_type,
        "hidden_size": hidden_size,
        "num_hidden_layers": 2,
        "intermediate_size": 2 * hidden_size,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": vocab,
        "rope_theta": 10000.0,
        "max_position_embeddings": context,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
    }
    (folder / "config.json").write_text(json.dumps(config))
    args = structure(hf, normalize_hf_config(config), DecoderArgs, "tiny").unwrap()
    mx.random.seed(seed)
    model = build_model(args).unwrap()
    mx.save_safetensors(
        str(folder / "model.safetensors"), dict(tree_flatten(model.parameters()))
    )
    return folder


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "target")


@pytest.fixture(scope="session")
def tiny_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "draft", seed=1)
