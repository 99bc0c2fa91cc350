"""GGUF SentencePiece vocabularies (`tokenizer.ggml.model` 'llama': Llama-2,
Mistral, TinyLlama): encoded and decoded as SentencePiece itself does, on a
model trained here, with llama.cpp's rules where it differs (a space prefixed
after every special token), read from a whole GGUF file too."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import attrs
import pytest
from gguf_support import (
    BYTE,
    CONTROL,
    Vocab,
    tiny_weights,
    train_sentencepiece,
    write_tiny_gguf,
)
from returns.result import Success

from models.gguf import read_gguf
from models.tokenizer import Tokenizer, gguf_tokenizer, sentencepiece_merges
from schemas.errors import LoadError

pytestmark = pytest.mark.reference  # sentencepiece, of the reference extra

TEXTS = [
    "the quick brown fox",
    " one leading space",
    "   three leading",
    "trailing spaces  ",
    "double  space and\nnew line\tand tab",
    "digits 12345 and 7",
    "naïve café",
    "outside the vocabulary: 中文, emoji 🙂, ½!",
    "",
    "a",
    "lazydogjumpsoverthe",
    "overoverover over",
]
# pieces of made-up text: words, their parts, spaces, characters it never saw
PARTS = [
    "the",
    " ",
    "  ",
    "fox",
    "qu",
    "ick",
    "x",
    "é",
    "🙂",
    "1",
    "23",
    "\n",
    "over",
    "ts",
]


def _metadata(vocab: Vocab, **extra: Any) -> dict[str, Any]:
    metadata: dict[str, Any] = {
        "tokenizer.ggml.model": vocab.model,
        "tokenizer.ggml.tokens": vocab.tokens,
        "tokenizer.ggml.token_type": vocab.types,
        "tokenizer.ggml.scores": vocab.scores,
        "tokenizer.ggml.bos_token_id": vocab.bos,
        "tokenizer.ggml.eos_token_id": vocab.eos,
        "tokenizer.ggml.unknown_token_id": vocab.unknown,
    }
    if vocab.add_space_prefix is not None:
        metadata["tokenizer.ggml.add_space_prefix"] = vocab.add_space_prefix
    metadata.update(extra)
    return {key: value for key, value in metadata.items() if value is not None}


def _tokenizer(metadata: dict[str, Any]) -> Tokenizer:
    built = gguf_tokenizer(metadata, "test.gguf")
    assert not isinstance(built, LoadError), built
    backend, config = built
    return Tokenizer.make(backend, config)


@pytest.fixture(scope="module")
def trained() -> tuple[Any, Vocab]:
    return train_sentencepiece()


@pytest.fixture(scope="module")
def ours(trained: tuple[Any, Vocab]) -> Tokenizer:
    return _tokenizer(_metadata(trained[1]))


def _random_texts(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choices(PARTS, k=rng.randint(0, 12))) for _ in range(count)]


def test_encodes_as_sentencepiece(trained: tuple[Any, Vocab], ours: Tokenizer) -> None:
    processor, _ = trained
    for text in TEXTS + _random_texts(800):
        assert ours.encode(text, add_special_tokens=False) == processor.encode(text), (
            text
        )


def test_decodes_as_sentencepiece(trained: tuple[Any, Vocab], ours: Tokenizer) -> None:
    processor, _ = trained
    for text in TEXTS + _random_texts(300, seed=1):
        ids = processor.encode(text)
        assert ours.decode(ids) == processor.decode(ids) == text


def test_bos_by_default_and_as_the_file_says(trained: tuple[Any, Vocab]) -> None:
    processor, vocab = trained
    plain = processor.encode("the fox")
    # llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say
    assert _tokenizer(_metadata(vocab)).encode("the fox") == [vocab.bos, *plain]
    without = _tokenizer(_metadata(vocab, **{"tokenizer.ggml.add_bos_token": False}))
    assert without.encode("the fox") == plain
    assert without.config["eos_token"] == "</s>"
    assert without.config["unk_token"] == "<unk>"


def test_special_tokens_stay_whole_and_prefix_the_next_text(
    trained: tuple[Any, Vocab], ours: Tokenizer
) -> None:
    """llama.cpp encodes each stretch of text between special (control,
    unknown, user-defined) tokens on its own, a space prefixed to each."""
    processor, vocab = trained
    ids = ours.encode("</s>the fox<think>over<unk>", add_special_tokens=False)
    expected = [vocab.eos, *processor.encode("the fox")]
    expected += [
        vocab.tokens.index("<think>"),
        *processor.encode("over"),
        vocab.unknown,
    ]
    assert ids == expected
    assert ours.decode(ids, skip_special_tokens=True) == "the fox<think> over"
    assert ours.eos_token_ids == (vocab.eos,)


def test_streaming_equals_decode(trained: tuple[Any, Vocab], ours: Tokenizer) -> None:
    """Streamed pieces concatenate to the whole decode: for encoded text
    (multi-byte characters arrive as byte pieces) and for random ids other
    than byte pieces, special tokens skipped or not (a skipped token leaves
    nothing to strip the leading space from)."""
    processor, vocab = trained
    for text in TEXTS + _random_texts(100, seed=2):
        assert _streamed(ours, processor.encode(text)) == text
    rng = random.Random(3)
    whole = [i for i, kind in enumerate(vocab.types) if kind != BYTE]
    _check_streams(ours, [rng.choices(whole, k=rng.randint(1, 10)) for _ in range(300)])


def _streamed(tokenizer: Tokenizer, ids: list[int], skip: bool = False) -> str:
    """`ids` fed one by one to a streaming detokenizer, its pieces joined."""
    detokenizer = tokenizer.detokenizer(skip_special_tokens=skip)
    return "".join(detokenizer.add(i) for i in ids) + detokenizer.finish()


def _check_streams(tokenizer: Tokenizer, cases: list[list[int]]) -> None:
    """Each case streams to its whole decode, special tokens skipped or not."""
    for skip in (False, True):
        for ids in cases:
            want = tokenizer.decode(ids, skip_special_tokens=skip)
            assert _streamed(tokenizer, ids, skip) == want, ids


def test_streaming_byte_pieces_equals_decode(
    trained: tuple[Any, Vocab], ours: Tokenizer
) -> None:
    """Random ids with byte pieces among them stream to the whole decode too:
    the ByteFallback decoder turns a run of byte pieces that is not UTF-8
    into one U+FFFD per byte, the run's valid bytes included ('A', then a
    lone 0xE2, then 'A' again decodes as three), so a run is emitted whole;
    where special tokens are skipped, a run goes on through one."""
    _, vocab = trained
    pieces = {t: i for i, t in enumerate(vocab.tokens)}
    assert ours.byte_piece_ids == {i for i, k in enumerate(vocab.types) if k == BYTE}
    word = next(i for i, k in enumerate(vocab.types) if k == 1 and i > 10)
    run = [pieces["<0x41>"], pieces["<0xE2>"], pieces["<0x41>"], word]
    assert ours.decode(run).startswith("\ufffd" * 3)
    rng = random.Random(4)
    everything = range(len(vocab.tokens))
    randoms = [rng.choices(everything, k=rng.randint(1, 12)) for _ in range(500)]
    _check_streams(ours, [run, *randoms])


def test_merges_from_the_file_equal_merges_from_scores(
    trained: tuple[Any, Vocab], ours: Tokenizer
) -> None:
    processor, vocab = trained
    merges = sentencepiece_merges(vocab.tokens, vocab.scores or [], vocab.types)
    assert len(merges) == len(set(merges)) > 200
    # no control, unknown or byte piece is joined or cut into
    banned = {t for t, k in zip(vocab.tokens, vocab.types, strict=True) if k != 1}
    assert not banned & {part for merge in merges for part in merge}
    written = [f"{left} {right}" for left, right in merges]
    from_file = _tokenizer(
        _metadata(
            vocab, **{"tokenizer.ggml.merges": written, "tokenizer.ggml.scores": None}
        )
    )
    for text in TEXTS + _random_texts(200, seed=4):
        assert (
            from_file.encode(text)
            == ours.encode(text)
            == [vocab.bos, *processor.encode(text)]
        )


def test_without_a_space_prefix() -> None:
    processor, vocab = train_sentencepiece(add_dummy_prefix=False)
    tok = _tokenizer(_metadata(vocab))
    for text in TEXTS + _random_texts(200, seed=5):
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == processor.encode(text), text
        assert tok.decode(ids) == text


def test_a_whole_gguf_file(trained: tuple[Any, Vocab], tmp_path: Path) -> None:
    processor, vocab = trained
    path = tmp_path / "spm.gguf"
    write_tiny_gguf(path, tiny_weights(0, len(vocab.tokens)), vocab=vocab, add_bos=None)
    result = read_gguf(path, load_weights=False)
    assert isinstance(result, Success), result
    tok = Tokenizer.from_gguf(result.unwrap())
    for text in TEXTS:
        assert tok.encode(text) == [vocab.bos, *processor.encode(text)]
    assert tok.bos_token_id == vocab.bos
    assert vocab.eos in tok.eos_token_ids


def test_saved_folder_loads_in_transformers_and_back(
    trained: tuple[Any, Vocab], ours: Tokenizer, tmp_path: Path
) -> None:
    """`specpipe convert` of a GGUF writes this tokenizer as tokenizer.json."""
    from transformers import AutoTokenizer

    processor, vocab = trained
    ours.save(tmp_path)
    theirs = AutoTokenizer.from_pretrained(str(tmp_path))
    loaded = Tokenizer.from_folder(tmp_path)
    assert isinstance(loaded, Success), loaded
    back = loaded.unwrap()
    for text in [*TEXTS, "</s>the fox<think>over<unk>", *_random_texts(100, seed=7)]:
        ids = ours.encode(text)
        assert theirs.encode(text) == back.encode(text) == ids, text
        assert theirs.decode(ids) == back.decode(ids) == ours.decode(ids), text
    assert ours.encode("the fox") == [vocab.bos, *processor.encode("the fox")]


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"tokenizer.ggml.scores": None}, "needs tokenizer.ggml.scores"),
        ({"tokenizer.ggml.scores": [0.0, 1.0]}, "needs tokenizer.ggml.scores"),
        ({"tokenizer.ggml.model": "t5"}, "tokenizer model 't5' is not supported"),
        ({"tokenizer.ggml.token_type": [CONTROL]}, "token types for"),
        ({"tokenizer.ggml.merges": ["nospace"]}, "malformed merge"),
    ],
)
def test_bad_vocabularies(
    trained: tuple[Any, Vocab], change: dict[str, Any], expected: str
) -> None:
    metadata = _metadata(trained[1])
    metadata.update(change)
    metadata = {key: value for key, value in metadata.items() if value is not None}
    error = gguf_tokenizer(metadata, "bad.gguf")
    assert isinstance(error, LoadError)
    assert "bad.gguf" in error.message
    assert expected in error.message


# -- Gemma-4's vocabulary ('gemma4': the pieces and merges of its tokenizer.json) --


def _gemma4_file(path: Path, **changes: Any) -> tuple[Any, Vocab]:
    processor, vocab = train_sentencepiece(add_dummy_prefix=False)
    merges = sentencepiece_merges(vocab.tokens, vocab.scores or [], vocab.types)
    settings: dict[str, Any] = {
        "model": "gemma4",
        "merges": [f"{left} {right}" for left, right in merges],
        "add_space_prefix": False,  # as llama.cpp's converter writes them
    }
    vocab = attrs.evolve(vocab, **(settings | changes))
    write_tiny_gguf(path, tiny_weights(0, len(vocab.tokens)), vocab=vocab, add_bos=True)
    return processor, vocab


def test_gemma4_vocabulary_encodes_as_transformers_reads_it(tmp_path: Path) -> None:
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        convert_gguf_tokenizer,
        get_gguf_tokenizer,
    )

    path = tmp_path / "gemma4.gguf"
    _gemma4_file(path)
    result = read_gguf(path, load_weights=False)
    assert isinstance(result, Success), result
    ours = Tokenizer.from_gguf(result.unwrap())
    architecture, metadata, config = get_gguf_tokenizer(str(path))
    theirs, _ = convert_gguf_tokenizer(architecture, metadata)
    # the file asks for BOS; Gemma-4's chat template writes it instead
    assert ours.config["add_bos_token"] is config["add_bos_token"] is False
    texts = [*TEXTS, "</s>the fox<think>over<unk>  x", *_random_texts(300, seed=6)]
    for text in texts:
        ids = ours.encode(text)
        assert ids == theirs.encode(text, add_special_tokens=False).ids, text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=False) == text
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(
            ids, skip_special_tokens=True
        )


def test_gemma4_vocabulary_without_merges_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "gemma4.gguf"
    _gemma4_file(path, merges=None)
    result = read_gguf(path, load_weights=False)
    assert not isinstance(result, Success)
    message = result.failure().message
    assert "gemma4 vocabulary needs tokenizer.ggml.merges" in message
    assert str(path) in message
