"""Tokenizer: the BPE rebuilt from GGUF metadata against transformers' own GGUF
tokenizer, chat templates, saving, and the streaming detokenizer."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import jinja2
import pytest
from gguf_support import (
    SPECIALS,
    byte_alphabet,
    tiny_tokens,
    tiny_weights,
    write_tiny_gguf,
)
from returns.result import Failure, Success

from models.gguf import read_gguf
from models.tokenizer import Tokenizer
from schemas.errors import LoadError

TEXTS = [
    "Hello world",
    " Hello  world ",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "```python\nimport numpy as np\nx = np.arange(10)**2  # squares\n```",
    "12345 67890 3.14159 1,000,000 x2y3 v1.2.3",
    "  leading spaces\tand\ttabs\n\n\n\nnewlines\r\nwindows\r\n",
    "    \n   \n",
    "a" * 40 + " " * 17 + "b",
    "Ünïcödé: café, naïve, Zürich, Ελληνικά, Русский, עברית, العربية",
    "中文测试：你好，世界！日本語のテキスト。한국어 텍스트",
    "emoji 👋🏽 🇫🇷 👨‍👩‍👧‍👦 🤖✨ 😀😀😀",
    "e\u0301 vs \u00e9, nbsp\u00a0thin\u2009ideo\u3000end",
    "it's they're we've I'm you'll he'd IT'S",
    "\x00\x01 control \x7f",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text<|endoftext|>",
    '<tool_call>{"name": "f"}</tool_call>',
    "<|fim_prefix|>def f():<|fim_suffix|>\n<|fim_middle|>",
    "<repo_name>x<file_sep>y",
    "",
    " ",
]

CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "Write fib in Python 🐍"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Write fib in Python"},
        {"role": "assistant", "content": "def fib(n): ..."},
        {"role": "user", "content": "中文?\n  indented"},
    ],
    [{"role": "system", "content": "Only a system prompt."}],
]

STREAM_TEXT = "emoji 👋🏽 🇫🇷 👨‍👩‍👧‍👦 中文测试，日本語。 Zürich 🤖✨\n" * 2

MODELS = ["smollm2", "qwen05"]


# -- the real checkpoints, against transformers -------------------------------


def _path(request: pytest.FixtureRequest, name: str) -> Path:
    fixture = {"smollm2": "smollm2_gguf", "qwen05": "qwen05_gguf"}[name]
    path = request.getfixturevalue(fixture)
    assert isinstance(path, Path)
    return path


@pytest.fixture(scope="session", params=MODELS)
def pair(request: pytest.FixtureRequest) -> tuple[str, Tokenizer, Any]:
    """(name, our tokenizer, transformers' tokenizer of the same GGUF)."""
    from transformers import AutoTokenizer

    path = _path(request, request.param)
    model = read_gguf(path, load_weights=False)
    assert isinstance(model, Success), model
    ours = Tokenizer.from_gguf(model.unwrap())
    reference = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return request.param, ours, reference


@pytest.mark.fixture
@pytest.mark.reference
def test_encode_matches_transformers(pair: tuple[str, Tokenizer, Any]) -> None:
    _, ours, reference = pair
    for text in TEXTS:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == reference.encode(
                text, add_special_tokens=special
            ), (text, special)


@pytest.mark.fixture
@pytest.mark.reference
def test_decode_matches_transformers(pair: tuple[str, Tokenizer, Any]) -> None:
    _, ours, reference = pair
    rng = random.Random(0)
    batches = [reference.encode(text, add_special_tokens=False) for text in TEXTS]
    batches += [
        [rng.randrange(ours.vocab_size) for _ in range(rng.randrange(1, 40))]
        for _ in range(50)
    ]
    for ids in batches:
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(
                ids, skip_special_tokens=skip
            ), (ids, skip)


@pytest.mark.fixture
@pytest.mark.reference
def test_chat_template_matches_transformers(pair: tuple[str, Tokenizer, Any]) -> None:
    _, ours, reference = pair
    for messages in CONVERSATIONS:
        for prompt in (True, False):
            assert ours.apply_chat_template(
                messages, add_generation_prompt=prompt
            ) == reference.apply_chat_template(
                messages, add_generation_prompt=prompt, tokenize=False
            )


@pytest.mark.fixture
@pytest.mark.reference
def test_qwen_chat_template_with_tools_matches_transformers(
    pair: tuple[str, Tokenizer, Any],
) -> None:
    name, ours, reference = pair
    if name != "qwen05":
        return  # SmolLM2's template has no tools section
    tools = [
        {
            "type": "function",
            "function": {
                "name": "weather",
                "description": "Weather in a city (°C)",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                },
            },
        }
    ]
    messages = CONVERSATIONS[1]
    assert ours.apply_chat_template(
        messages, tools=tools
    ) == reference.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False
    )


@pytest.mark.fixture
def test_stop_and_start_tokens(pair: tuple[str, Tokenizer, Any]) -> None:
    name, ours, _ = pair
    im_end = ours.backend.token_to_id("<|im_end|>")
    endoftext = ours.backend.token_to_id("<|endoftext|>")
    assert ours.eos_token_ids[0] == im_end
    assert set(ours.eos_token_ids) == {im_end, endoftext}
    expected = {"smollm2": (49152, 1), "qwen05": (151936, 151643)}[name]
    assert (ours.vocab_size, ours.bos_token_id) == expected
    assert ours.config["add_bos_token"] is False
    assert ours.encode("hi") == ours.encode("hi", add_special_tokens=False)


@pytest.mark.fixture
def test_streaming_equals_decode(pair: tuple[str, Tokenizer, Any]) -> None:
    _, ours, _ = pair
    ids = ours.encode(STREAM_TEXT)
    detokenizer = ours.detokenizer()
    pieces = [detokenizer.add(token) for token in ids] + [detokenizer.finish()]
    assert "".join(pieces) == ours.decode(ids) == STREAM_TEXT
    assert detokenizer.text == STREAM_TEXT
    assert not any("\ufffd" in piece for piece in pieces)
    # emoji and CJK characters span several byte-level tokens: some were held back
    assert sum(piece == "" for piece in pieces[:-1]) > 0


@pytest.mark.fixture
def test_streaming_random_ids_equal_decode(pair: tuple[str, Tokenizer, Any]) -> None:
    _, ours, _ = pair
    rng = random.Random(1)
    for _ in range(100):
        ids = [rng.randrange(ours.vocab_size) for _ in range(rng.randrange(1, 25))]
        detokenizer = ours.detokenizer()
        text = "".join(detokenizer.add(token) for token in ids) + detokenizer.finish()
        assert text == ours.decode(ids), ids


@pytest.mark.fixture
@pytest.mark.reference
def test_saved_folder_loads_in_transformers_and_back(
    pair: tuple[str, Tokenizer, Any], tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    _, ours, _ = pair
    ours.save(tmp_path)
    theirs = AutoTokenizer.from_pretrained(str(tmp_path))
    loaded = Tokenizer.from_folder(tmp_path)
    assert isinstance(loaded, Success), loaded
    back = loaded.unwrap()
    assert back.eos_token_ids == ours.eos_token_ids
    assert back.bos_token_id == ours.bos_token_id
    for text in TEXTS:
        ids = ours.encode(text)
        assert theirs.encode(text) == ids == back.encode(text), text
        assert theirs.decode(ids) == ours.decode(ids) == back.decode(ids), text
    for messages in CONVERSATIONS:
        expected = ours.apply_chat_template(messages)
        assert back.apply_chat_template(messages) == expected
        assert (
            theirs.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
            == expected
        )


# -- tiny tokenizers, no checkpoint -------------------------------------------


def _tiny(tmp_path: Path, add_bos: bool = False) -> Tokenizer:
    tokens, _ = tiny_tokens()
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, tiny_weights(0, len(tokens)), add_bos=add_bos)
    model = read_gguf(path, load_weights=False)
    assert isinstance(model, Success), model
    return Tokenizer.from_gguf(model.unwrap())


def _byte_id(byte: int) -> int:
    return len(SPECIALS) + byte


def test_tiny_encode_uses_merges_and_specials(tmp_path: Path) -> None:
    tok = _tiny(tmp_path)
    tokens, _ = tiny_tokens()
    ids = tok.encode(" the<|im_end|>")
    assert [tokens[i] for i in ids] == ["Ġthe", "<|im_end|>"]
    assert tok.decode(ids) == " the<|im_end|>"
    assert tok.decode(ids, skip_special_tokens=True) == " the"
    assert tok.eos_token_ids == (2, 0)  # <|im_end|>, then <|endoftext|>
    assert tok.bos_token_id == 1


def test_add_bos_token_is_honoured(tmp_path: Path) -> None:
    tok = _tiny(tmp_path, add_bos=True)
    assert tok.encode("the") == [1, *tok.encode("the", add_special_tokens=False)]


@pytest.mark.reference
def test_add_bos_token_survives_saving_for_transformers(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tok = _tiny(tmp_path, add_bos=True)
    tok.save(tmp_path / "saved")
    theirs = AutoTokenizer.from_pretrained(str(tmp_path / "saved"))
    assert theirs.encode("the in") == tok.encode("the in")
    assert theirs.encode("the in")[0] == 1


def test_streaming_holds_back_a_split_character(tmp_path: Path) -> None:
    tok = _tiny(tmp_path)
    # "中" is E4 B8 AD: three byte tokens, then an ASCII one
    ids = [_byte_id(0xE4), _byte_id(0xB8), _byte_id(0xAD), _byte_id(ord("x"))]
    detokenizer = tok.detokenizer()
    assert [detokenizer.add(i) for i in ids] == ["", "", "中", "x"]
    assert detokenizer.finish() == ""


def test_streaming_finish_flushes_an_unfinished_character(tmp_path: Path) -> None:
    tok = _tiny(tmp_path)
    ids = [_byte_id(ord("a")), _byte_id(0xE4), _byte_id(0xB8)]
    detokenizer = tok.detokenizer()
    pieces = [detokenizer.add(i) for i in ids]
    assert pieces == ["a", "", ""]
    assert "".join(pieces) + detokenizer.finish() == tok.decode(ids) == "a\ufffd"


def test_byte_alphabet_is_the_tokenizers_one() -> None:
    from tokenizers import pre_tokenizers

    assert sorted(byte_alphabet()) == sorted(pre_tokenizers.ByteLevel.alphabet())


def _folder(tmp_path: Path, config: dict[str, Any], jinja: str | None = None) -> Path:
    tok = _tiny(tmp_path)
    folder = tmp_path / "folder"
    folder.mkdir()
    tok.backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja is not None:
        (folder / "chat_template.jinja").write_text(jinja)
    return folder


def test_from_folder_reads_chat_template_jinja_and_eos_from_config(
    tmp_path: Path,
) -> None:
    folder = _folder(
        tmp_path,
        {"eos_token": "<|endoftext|>", "bos_token": None},
        jinja="{% for m in messages %}[{{ m.role }}]{{ m.content }}\n{% endfor %}",
    )
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    loaded = Tokenizer.from_folder(folder)
    assert isinstance(loaded, Success), loaded
    tok = loaded.unwrap()
    assert tok.eos_token_ids == (2, 0)
    assert tok.bos_token_id is None
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "[user]x\n"


def test_template_whitespace_control_matches_hf_settings(tmp_path: Path) -> None:
    template = "{% for m in messages %}\n    {% if m.role == 'user' %}\nU:{{ m.content }}\n    {% endif %}\n{% endfor %}"
    folder = _folder(tmp_path, {"chat_template": template})
    tok = Tokenizer.from_folder(folder).unwrap()
    # lstrip_blocks strips the indentation before a block tag, trim_blocks the newline after
    assert tok.apply_chat_template([{"role": "user", "content": "a"}]) == "U:a\n"


def test_raise_exception_in_template(tmp_path: Path) -> None:
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}ok"
    tok = Tokenizer.from_folder(_folder(tmp_path, {"chat_template": template})).unwrap()
    assert tok.apply_chat_template([{"role": "user", "content": ""}]) == "ok"
    with pytest.raises(jinja2.TemplateError, match="user first"):
        tok.apply_chat_template([{"role": "system", "content": ""}])


def test_template_sandbox_blocks_attribute_escape(tmp_path: Path) -> None:
    template = "{{ messages.__class__.__mro__ }}"
    tok = Tokenizer.from_folder(_folder(tmp_path, {"chat_template": template})).unwrap()
    with pytest.raises(jinja2.exceptions.SecurityError):
        tok.apply_chat_template([])


def test_tojson_keeps_unicode(tmp_path: Path) -> None:
    template = "{{ messages[0] | tojson }}"
    tok = Tokenizer.from_folder(_folder(tmp_path, {"chat_template": template})).unwrap()
    out = tok.apply_chat_template([{"role": "user", "content": "ü <b>"}])
    assert out == '{"role": "user", "content": "ü <b>"}'


def test_tools_and_missing_tokens_are_none_or_undefined_as_in_hf(
    tmp_path: Path,
) -> None:
    template = (
        "{% if tools is not none %}T{% endif %}{% if documents is none %}D{% endif %}"
        "{% if pad_token is defined %}P{% endif %}{{ eos_token }}"
    )
    folder = _folder(tmp_path, {"chat_template": template, "eos_token": "<|im_end|>"})
    tok = Tokenizer.from_folder(folder).unwrap()
    assert tok.apply_chat_template([]) == "D<|im_end|>"
    assert tok.apply_chat_template([], tools=[]) == "TD<|im_end|>"


def test_template_that_does_not_compile(tmp_path: Path) -> None:
    folder = _folder(tmp_path, {"chat_template": "{% for m in messages %}"})
    result = Tokenizer.from_folder(folder)
    assert isinstance(result, Failure)
    assert "the chat template does not compile" in result.failure().message


def test_no_template(tmp_path: Path) -> None:
    tok = Tokenizer.from_folder(_folder(tmp_path, {})).unwrap()
    assert tok.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_from_folder_errors(tmp_path: Path) -> None:
    missing = Tokenizer.from_folder(tmp_path)
    assert isinstance(missing, Failure)
    assert isinstance(missing.failure(), LoadError)
    assert "has no tokenizer.json" in missing.failure().message
    (tmp_path / "tokenizer.json").write_text("{not json")
    broken = Tokenizer.from_folder(tmp_path)
    assert isinstance(broken, Failure)
    assert "is not a valid tokenizer" in broken.failure().message
    folder = _folder(tmp_path, {})
    (folder / "tokenizer_config.json").write_text("[1, 2]")
    bad_config = Tokenizer.from_folder(folder)
    assert isinstance(bad_config, Failure)
    assert "unreadable tokenizer files" in bad_config.failure().message
