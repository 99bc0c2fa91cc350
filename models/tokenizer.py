"""Tokenizer: a `tokenizers.Tokenizer` plus the chat template and stop tokens.

Notable:
- A GGUF carries no tokenizer.json; `gguf_tokenizer` rebuilds its tokenizer
  from the metadata (tokens, merges or scores, token types): a byte-level BPE
  with the pre-tokenizer that llama.cpp selects by `tokenizer.ggml.pre`, or a
  SentencePiece BPE (`llama`; Gemma-4's `gemma4`, without the space prefix,
  as transformers reads it) whose merges, where the file lists none, are
  derived from the pieces' scores (`sentencepiece_merges`). Control tokens
  (type 3; SentencePiece's unknown one too) become special added tokens,
  user-defined ones (type 4) plain added tokens, as llama.cpp matches both
  whole; SentencePiece text between them is encoded stretch by stretch, a
  space prefixed to each (llama.cpp's rule; SentencePiece itself prefixes the
  whole text only).
- BOS/EOS insertion follows HF's fast tokenizers: when the config states
  `add_bos_token`/`add_eos_token`, the post-processor is a template that adds
  them, so `encode` and a saved folder loaded by transformers agree.
- Chat templates render in a sandboxed jinja2 environment set up as
  transformers does (trim_blocks, lstrip_blocks, loop controls, `tojson`,
  `raise_exception`, `strftime_now`).
- `StreamingDetokenizer` emits text as tokens arrive, holding back a tail that
  ends inside a UTF-8 character.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from attrs import field, frozen
from jinja2.sandbox import ImmutableSandboxedEnvironment
from returns.result import Failure, Result, Success
from tokenizers import (
    AddedToken,
    Regex,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)
from tokenizers import Tokenizer as Backend

from schemas.errors import LoadError

if TYPE_CHECKING:
    from models.gguf import GgufModel

# llama.cpp's token types (llama_token_type): 1 normal, 2 unknown, 3 control,
# 4 user-defined (5 unused and 6 byte take no part here)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED = 1, 2, 3, 4
# tokenizer.ggml.model of a SentencePiece BPE vocabulary, of Gemma-4's (the
# same pieces, no space prefix, the merges listed), and their space
_SENTENCEPIECE, _GEMMA4 = "llama", "gemma4"
_BYTE_LEVEL = "gpt2"  # tokenizer.ggml.model of a byte-level BPE
_SPACE = "\u2581"

# https://github.com/ggml-org/llama.cpp/blob/master/src/llama-vocab.cpp: the
# splits of LLAMA_VOCAB_PRE_TYPE_QWEN2 and _LLAMA3 (written in HF's regex form)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# llama.cpp ends generation on any control token spelled like one of these
# (llama-vocab.cpp, special_eog_ids), besides the file's eos/eot/eom ids.
_END_OF_GENERATION = frozenset(
    {
        "<|endoftext|>",
        "<|im_end|>",
        "<|eot_id|>",
        "<|eom_id|>",
        "<|end|>",
        "<end_of_turn>",
        "<|end_of_text|>",
        "<EOT>",
    }
)


def _split_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _gpt2_bytes() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _smollm() -> pre_tokenizers.PreTokenizer:
    # llama.cpp's "smollm": every digit alone, then GPT-2's split (= the
    # Digits + ByteLevel pair in SmolLM2's own tokenizer.json)
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), _gpt2_bytes()]
    )


_PRE_TOKENIZERS: dict[str, Callable[[], pre_tokenizers.PreTokenizer]] = {
    "default": _gpt2_bytes,
    "gpt-2": _gpt2_bytes,
    "gpt2": _gpt2_bytes,
    "smollm": _smollm,
    "qwen2": lambda: _split_then_bytes(_QWEN2_SPLIT),
    "deepseek-r1-qwen": lambda: _split_then_bytes(_QWEN2_SPLIT),
    "llama-bpe": lambda: _split_then_bytes(_LLAMA3_SPLIT),
    "llama3": lambda: _split_then_bytes(_LLAMA3_SPLIT),
}


def gguf_tokenizer(
    metadata: dict[str, Any], where: str
) -> tuple[Backend, dict[str, Any]] | LoadError:
    """The tokenizer and tokenizer_config.json a GGUF's metadata describe: a
    byte-level BPE (`tokenizer.ggml.model` 'gpt2') or a SentencePiece BPE
    ('llama': Llama-2, Mistral, TinyLlama; 'gemma4': Gemma-4's)."""
    kind = metadata.get("tokenizer.ggml.model")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if kind is None or not isinstance(tokens, list):
        return LoadError(f"{where}: no tokenizer in the GGUF metadata")
    types: list[int] = list(metadata.get("tokenizer.ggml.token_type") or [])
    if types and len(types) != len(tokens):
        return LoadError(
            f"{where}: {len(types)} token types for {len(tokens)} tokens (corrupt)"
        )
    merges = _gguf_merges(metadata, where)
    if isinstance(merges, LoadError):
        return merges
    if kind == _BYTE_LEVEL:
        backend = _byte_level_bpe(metadata, tokens, merges, where)
    elif kind in (_SENTENCEPIECE, _GEMMA4):
        backend = _sentencepiece_bpe(metadata, kind, tokens, types, merges, where)
    else:
        return LoadError(
            f"{where}: tokenizer model {kind!r} is not supported (supported as "
            "tokenizer.ggml.model: 'gpt2', byte-level BPE, and 'llama' and "
            "'gemma4', SentencePiece BPE); load the model's HF folder "
            "(tokenizer.json) instead"
        )
    if isinstance(backend, LoadError):
        return backend
    # SentencePiece's <unk> is a special token of its own type
    specials = {_CONTROL} if kind == _BYTE_LEVEL else {_CONTROL, _UNKNOWN}
    control = [t for t, k in zip(tokens, types, strict=False) if k in specials]
    user = [t for t, k in zip(tokens, types, strict=False) if k == _USER_DEFINED]
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in control]
    )
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])

    def token(name: str) -> str | None:
        return _named_token(metadata, tokens, name)

    # llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say;
    # Gemma-4's files say so too, but its chat template writes <bos> itself and
    # its own tokenizer adds none (as transformers reads these files)
    add_bos = metadata.get("tokenizer.ggml.add_bos_token", kind == _SENTENCEPIECE)
    if kind == _GEMMA4:
        add_bos = False
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "unk_token": token("unknown"),
        "pad_token": token("padding"),
        "add_bos_token": bool(add_bos),
        "add_eos_token": bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
    }
    template = metadata.get("tokenizer.chat_template")
    if isinstance(template, str):
        try:
            _compile_template(template)
        except jinja2.TemplateError as exc:
            return LoadError(f"{where}: the chat template does not compile: {exc}")
        config["chat_template"] = template
    ends = {t for t in control if t in _END_OF_GENERATION}
    ends.update(t for t in (token("eot"), token("eom")) if t is not None)
    # our own key: the stop tokens beyond eos_token (llama.cpp's end-of-generation)
    config["extra_eos_tokens"] = sorted(ends)
    _set_post_processor(backend, config)
    return backend, config


def _named_token(metadata: dict[str, Any], tokens: list[str], name: str) -> str | None:
    """The token `tokenizer.ggml.<name>_token_id` names, if it names one."""
    index = metadata.get(f"tokenizer.ggml.{name}_token_id")
    if isinstance(index, int) and 0 <= index < len(tokens):
        return str(tokens[index])
    return None


def _gguf_merges(
    metadata: dict[str, Any], where: str
) -> list[tuple[str, str]] | LoadError | None:
    """`tokenizer.ggml.merges` as pairs; None where the file has none."""
    raw = metadata.get("tokenizer.ggml.merges")
    if not raw:
        return None
    merges: list[tuple[str, str]] = []
    for merge in raw:
        left, sep, right = str(merge).partition(" ")
        if not sep:
            return LoadError(f"{where}: malformed merge {merge!r}")
        merges.append((left, right))
    return merges


def _byte_level_bpe(
    metadata: dict[str, Any],
    tokens: list[str],
    merges: list[tuple[str, str]] | None,
    where: str,
) -> Backend | LoadError:
    pre = str(metadata.get("tokenizer.ggml.pre", "default"))
    if pre not in _PRE_TOKENIZERS:
        return LoadError(
            f"{where}: pre-tokenizer {pre!r} is not supported "
            f"(supported: {', '.join(sorted(_PRE_TOKENIZERS))})"
        )
    backend = Backend(
        models.BPE(
            vocab={token: index for index, token in enumerate(tokens)},
            merges=merges or [],
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    backend.pre_tokenizer = _PRE_TOKENIZERS[pre]()
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(
    metadata: dict[str, Any],
    kind: str,
    tokens: list[str],
    types: list[int],
    merges: list[tuple[str, str]] | None,
    where: str,
) -> Backend | LoadError:
    """SentencePiece's BPE as llama.cpp runs a 'llama' vocabulary: spaces
    spelled U+2581, one prefixed to each stretch of text (the start and after
    every special token, `tokenizer.ggml.add_space_prefix`, default on), the
    adjacent pair whose joined piece scores best merged first, and characters
    outside the vocabulary spelled as byte pieces (`<0xNN>`). A 'gemma4'
    vocabulary (llama.cpp's converter writes Gemma-4's tokenizer.json pieces and
    merges) has no prefix unless its file asks for one."""
    if merges is None and kind == _GEMMA4:
        return LoadError(
            f"{where}: a gemma4 vocabulary needs tokenizer.ggml.merges (llama.cpp's "
            "converter writes them; the file is corrupt or cut short)"
        )
    if merges is None:
        scores = metadata.get("tokenizer.ggml.scores")
        if not isinstance(scores, list) or len(scores) != len(tokens):
            return LoadError(
                f"{where}: a SentencePiece vocabulary needs tokenizer.ggml.scores "
                "(one per token) or tokenizer.ggml.merges; the file has neither "
                "(corrupt or cut short)"
            )
        merges = sentencepiece_merges(tokens, [float(s) for s in scores], types)
    backend = Backend(
        models.BPE(
            vocab={token: index for index, token in enumerate(tokens)},
            merges=merges,
            dropout=None,
            unk_token=_named_token(metadata, tokens, "unknown"),
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    prefix = bool(
        metadata.get("tokenizer.ggml.add_space_prefix", kind == _SENTENCEPIECE)
    )
    spaces: list[normalizers.Normalizer] = [normalizers.Replace(" ", _SPACE)]
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend(_SPACE), *spaces] if prefix else spaces
    )
    steps: list[decoders.Decoder] = [
        decoders.Replace(_SPACE, " "),
        decoders.ByteFallback(),
        decoders.Fuse(),
    ]
    backend.decoder = decoders.Sequence(
        [*steps, decoders.Strip(" ", 1, 0)] if prefix else steps
    )
    return backend


def sentencepiece_merges(
    tokens: Sequence[str], scores: Sequence[float], types: Sequence[int] = ()
) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece BPE vocabulary implies: every way of
    cutting a piece into two pieces, the best-scoring joined piece first (its
    rank is the order SentencePiece merges in), a piece's cuts in the order of
    their left halves' ids. Only normal and user-defined pieces (or all, when
    `types` is empty) are joined or cut into; control, unknown, byte and
    unused pieces take no part."""
    ids = {
        token: index
        for index, token in enumerate(tokens)
        if not types or types[index] in (_NORMAL, _USER_DEFINED)
    }
    ranked: list[tuple[float, int, int, str, str]] = []
    for piece, index in ids.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in ids and right in ids:
                ranked.append((-scores[index], index, ids[left], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _set_post_processor(backend: Backend, config: dict[str, Any]) -> None:
    """BOS/EOS insertion as HF's TokenizersBackend.update_post_processor builds it."""
    bos = _token_text(config.get("bos_token"))
    eos = _token_text(config.get("eos_token"))
    add_bos = bool(config.get("add_bos_token")) and bos is not None
    add_eos = bool(config.get("add_eos_token")) and eos is not None
    first = f"{bos}:0 " if add_bos else ""
    last = f" {eos}:0" if add_eos else ""
    single = f"{first}$A:0{last}"
    pair = (
        f"{single}{f' {bos}:1' if add_bos else ''} $B:1{f' {eos}:1' if add_eos else ''}"
    )
    special: list[tuple[str, int]] = []
    for add, text in ((add_bos, bos), (add_eos, eos)):
        index = backend.token_to_id(text) if add and text is not None else None
        if add and text is not None and index is not None:
            special.append((text, index))
    backend.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=special
    )


def _token_text(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (HF's assistant-mask marker) as a no-op."""

    tags = {"generation"}  # noqa: RUF012 (jinja2's own declaration)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja2's own tojson escapes HTML characters; templates expect plain JSON
    return json.dumps(
        value,
        ensure_ascii=ensure_ascii,
        indent=indent,
        separators=separators,
        sort_keys=sort_keys,
    )


@functools.lru_cache(maxsize=32)
def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationBlock],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


@frozen(eq=False)
class Tokenizer:
    """Text <-> token ids, chat prompts and stop tokens of one model."""

    backend: Backend
    # tokenizer_config.json (chat_template, bos_token, eos_token, add_bos_token, ...)
    config: dict[str, Any]
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    _template: jinja2.Template | None = field(default=None, eq=False, repr=False)
    # ids of the `<0xNN>` byte pieces where the decoder has HF's ByteFallback
    # (which turns a whole run of them that is not UTF-8 into U+FFFDs)
    byte_piece_ids: frozenset[int] = field(default=frozenset(), repr=False)

    @staticmethod
    def make(
        backend: Backend, config: dict[str, Any], eos_ids: Sequence[int] = ()
    ) -> Tokenizer:
        """Tie `config` to `backend`: BOS/EOS template, stop ids, chat template.

        `eos_ids` are further stop ids (a config.json's `eos_token_id`); the
        config's `eos_token` and `extra_eos_tokens` are always stop tokens.
        """
        if "add_bos_token" in config or "add_eos_token" in config:
            _set_post_processor(backend, config)
        ends: list[int] = list(eos_ids)
        names = [_token_text(config.get("eos_token"))]
        names += list(config.get("extra_eos_tokens") or ())
        for name in names:
            index = backend.token_to_id(name) if name is not None else None
            if index is not None:
                ends.append(index)
        bos = _token_text(config.get("bos_token"))
        template = config.get("chat_template")
        return Tokenizer(
            backend=backend,
            config=config,
            eos_token_ids=tuple(dict.fromkeys(ends)),
            bos_token_id=backend.token_to_id(bos) if bos is not None else None,
            template=_compile_template(template) if isinstance(template, str) else None,
            byte_piece_ids=_byte_piece_ids(backend),
        )

    @staticmethod
    def from_gguf(model: GgufModel) -> Tokenizer:
        eos = model.config.get("eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) else list(eos or ())
        return Tokenizer.make(
            Backend.from_str(model.tokenizer_json),
            dict(model.tokenizer_config),
            eos_ids,
        )

    @staticmethod
    def from_folder(path: Path) -> Result[Tokenizer, LoadError]:
        """A HF tokenizer folder: tokenizer.json, tokenizer_config.json and the
        optional chat_template.jinja / config.json / generation_config.json."""
        folder = Path(path)
        source = folder / "tokenizer.json"
        if not source.is_file():
            return Failure(LoadError(f"{folder} has no tokenizer.json"))
        try:
            backend = Backend.from_file(str(source))
        except Exception as exc:  # tokenizers raises plain Exception on bad JSON
            return Failure(LoadError(f"{source} is not a valid tokenizer: {exc}"))
        config: dict[str, Any] = {}
        eos_ids: list[int] = []
        try:
            config = _read_json(folder / "tokenizer_config.json")
            jinja_file = folder / "chat_template.jinja"
            if jinja_file.is_file():
                config["chat_template"] = jinja_file.read_text(encoding="utf-8")
            for name in ("config.json", "generation_config.json"):
                eos = _read_json(folder / name).get("eos_token_id")
                eos_ids += [eos] if isinstance(eos, int) else list(eos or ())
        except (OSError, ValueError) as exc:
            return Failure(LoadError(f"{folder}: unreadable tokenizer files: {exc}"))
        template = config.get("chat_template")
        if isinstance(template, list):
            # older HF form: [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template}
            config["chat_template"] = named.get("default")
        try:
            return Success(Tokenizer.make(backend, config, eos_ids))
        except jinja2.TemplateError as exc:
            return Failure(
                LoadError(f"{folder}: the chat template does not compile: {exc}")
            )

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def chat_template(self) -> str | None:
        template = self.config.get("chat_template")
        return template if isinstance(template, str) else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` adds BOS/EOS as configured."""
        return list(
            self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        )

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def apply_chat_template(
        self,
        messages: list[dict[str, str]],
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """The prompt text of `messages`; extra `kwargs` reach the template."""
        if self._template is None:
            raise ValueError("this tokenizer has no chat template")
        # as transformers renders: tools/documents None unless given, and the
        # special tokens that are set
        values: dict[str, Any] = {"tools": None, "documents": None}
        for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
            text = _token_text(self.config.get(name))
            if text is not None:
                values[name] = text
        values.update(kwargs)
        return self._template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **values
        )

    def detokenizer(self, skip_special_tokens: bool = False) -> StreamingDetokenizer:
        return StreamingDetokenizer(self, skip_special_tokens)

    def save(self, folder: Path) -> None:
        """Write tokenizer.json and tokenizer_config.json (HF AutoTokenizer reads them)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        try:
            self.backend.save(str(folder / "tokenizer.json"))
        except Exception as exc:  # the tokenizers library's own (a full disk)
            raise OSError(f"cannot write tokenizer.json: {exc}") from exc
        config = {k: v for k, v in self.config.items() if v is not None}
        (folder / "tokenizer_config.json").write_text(
            json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
        )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return data


def _byte_piece_ids(backend: Backend) -> frozenset[int]:
    """The byte pieces' ids, where the decoder joins them by ByteFallback."""
    if "ByteFallback" not in repr(backend.decoder):
        return frozenset()
    return frozenset(
        index
        for piece, index in backend.get_vocab().items()
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">")
    )


class StreamingDetokenizer:
    """Text of a growing token stream, emitted without broken characters.

    Each `add` decodes the tokens since the last emission together with the
    tokens of the emission before (context, so decoders that depend on the
    previous token, e.g. a leading-space rule, see it) and returns the text
    beyond that context. A result ending in U+FFFD means the last token ends
    inside a UTF-8 character: nothing is emitted until a later token completes
    it (or `finish` flushes it). Nor is anything emitted while the last token
    is a byte piece of a ByteFallback decoder: that decoder turns a run of
    byte pieces that is not UTF-8 into one U+FFFD per byte, valid bytes of
    the run included, so a run is decoded only whole (and a skipped special
    token does not end a run: nothing is emitted after one either, there).
    The emitted pieces concatenate to `decode(all)`.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0  # start of the context window
        self._read = 0  # end of the tokens already emitted
        # the tokens after which nothing is emitted: byte pieces, and where
        # special tokens are skipped those too (a run of byte pieces goes on
        # through a skipped token)
        self._hold = tokenizer.byte_piece_ids
        if self._hold and skip_special_tokens:
            added = tokenizer.backend.get_added_tokens_decoder().items()
            self._hold |= {index for index, token in added if token.special}

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token: int) -> str:
        """Feed one token; return the text it completes (maybe empty)."""
        self.ids.append(token)
        return self._emit(final=False)

    def finish(self) -> str:
        """Flush what is held back (an unfinished character decodes as U+FFFD)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if not final and self.ids[-1] in self._hold:  # (`add` just appended it)
            return ""  # a byte run decodes whole (the class's note)
        start = self._prefix
        context = self._decode(self.ids[start : self._read])
        # A context that decodes to nothing (skipped special tokens, a lone
        # space) leaves a rule on the window's first character (SentencePiece's
        # leading-space strip) acting on the new text: widen it back to a token
        # that decodes to text.
        while not context and start > 0:
            start -= 1
            context = self._decode(self.ids[start : self._read])
        full = self._decode(self.ids[start:])
        if not final and full.endswith("\ufffd"):
            return ""
        piece = full[len(context) :]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += piece
        return piece
