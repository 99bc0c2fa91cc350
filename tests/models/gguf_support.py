"""Tiny GGUF files written with `gguf.GGUFWriter`, for tests that need no
checkpoint: known HF weights go in (Q/K rows permuted the way llama.cpp's
converter does for llama; a Gemma-4 model named and laid out as llama.cpp's
converter writes it), and `read_gguf` must give them back."""

from __future__ import annotations

import io
import random
from pathlib import Path
from typing import Any

import attrs
import gguf
import numpy as np
from gguf import (
    GGML_QUANT_SIZES,
    MODEL_TENSOR,
    TENSOR_NAMES,
    GGMLQuantizationType,
    GGUFWriter,
)
from gguf.quants import dequantize, quantize

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ Ġ", "ä ¸", "ä¸ Ń"]

TINY = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
HEAD_DIM = 16

_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def byte_alphabet() -> list[str]:
    """GPT-2's printable stand-in for each byte value 0..255 (bytes_to_unicode)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0x100)]
    spelled = {b: chr(b) for b in kept}
    extra = 0
    for b in range(256):
        if b not in spelled:
            spelled[b] = chr(256 + extra)
            extra += 1
    return [spelled[b] for b in range(256)]


def tiny_tokens() -> tuple[list[str], list[int]]:
    tokens = SPECIALS + byte_alphabet()
    for merge in MERGES:
        tokens.append(merge.replace(" ", ""))
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    return tokens, types


@attrs.frozen
class Vocab:
    """A GGUF tokenizer's metadata (llama.cpp's keys), for `write_tiny_gguf`."""

    model: str  # tokenizer.ggml.model
    tokens: list[str]
    types: list[int]
    scores: list[float] | None = None
    merges: list[str] | None = None
    bos: int = 1
    eos: int = 2
    unknown: int | None = None
    add_space_prefix: bool | None = None  # None: the key left out


def tiny_vocab(tokenizer_model: str = "gpt2") -> Vocab:
    tokens, types = tiny_tokens()
    return Vocab(tokenizer_model, tokens, types, merges=MERGES)


# SentencePiece's token kinds as llama.cpp numbers them (llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPM_WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "speculative",
    "decoding",
    "drafts",
    "tokens",
    "that",
    "the",
    "target",
    "model",
    "verifies",
    "accepts",
    "or",
    "rejects",
]


def train_sentencepiece(
    vocab_size: int = 500, add_dummy_prefix: bool = True
) -> tuple[Any, Vocab]:
    """A SentencePiece BPE model trained here on a made-up corpus (as Llama-2's:
    identity normalisation, spaces kept, byte fallback, digits split, a
    user-defined `<think>`), and its vocabulary as llama.cpp's converter
    writes it."""
    import sentencepiece

    rng = random.Random(0)
    lines = []
    for i in range(3000):
        line = " ".join(rng.choice(SPM_WORDS) for _ in range(rng.randint(3, 14)))
        if i % 7 == 0:
            line += f" {rng.randint(0, 99999)}"
        if i % 11 == 0:
            line = f"  {line}  naïve café"
        lines.append(line)
    proto = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=proto,
        vocab_size=vocab_size,
        model_type="bpe",
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=add_dummy_prefix,
        split_digits=True,
        user_defined_symbols=["<think>"],
        character_coverage=1.0,
        minloglevel=2,
    )
    processor = sentencepiece.SentencePieceProcessor(model_proto=proto.getvalue())
    tokens, scores, types = [], [], []
    for index in range(processor.get_piece_size()):
        tokens.append(processor.id_to_piece(index))
        scores.append(processor.get_score(index))
        if processor.is_unknown(index):
            types.append(UNKNOWN)
        elif processor.is_control(index):
            types.append(CONTROL)
        elif processor.is_byte(index):
            types.append(BYTE)
        elif processor.is_unused(index):
            types.append(UNUSED)
        elif tokens[-1] == "<think>":
            types.append(USER_DEFINED)
        else:
            types.append(NORMAL)
    vocab = Vocab(
        "llama",
        tokens,
        types,
        scores=scores,
        bos=processor.bos_id(),
        eos=processor.eos_id(),
        unknown=processor.unk_id(),
        add_space_prefix=None if add_dummy_prefix else False,
    )
    return processor, vocab


def tiny_weights(
    seed: int, vocab: int, model_type: str = "llama", tied: bool = True
) -> dict[str, np.ndarray]:  # HF name -> [O, I] / [V, H] / [O] float32
    """Random float32 weights with HF names and shapes."""
    rng = np.random.default_rng(seed)
    hidden, ffn = TINY["hidden_size"], TINY["intermediate_size"]
    q_rows = TINY["num_attention_heads"] * HEAD_DIM
    kv_rows = TINY["num_key_value_heads"] * HEAD_DIM

    def draw(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    weights = {"model.embed_tokens.weight": draw(vocab, hidden)}
    weights["model.norm.weight"] = draw(hidden)
    if not tied:
        weights["lm_head.weight"] = draw(vocab, hidden)
    for i in range(TINY["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = draw(hidden)
        weights[p + "post_attention_layernorm.weight"] = draw(hidden)
        weights[p + "self_attn.q_proj.weight"] = draw(q_rows, hidden)
        weights[p + "self_attn.k_proj.weight"] = draw(kv_rows, hidden)
        weights[p + "self_attn.v_proj.weight"] = draw(kv_rows, hidden)
        weights[p + "self_attn.o_proj.weight"] = draw(hidden, q_rows)
        weights[p + "mlp.gate_proj.weight"] = draw(ffn, hidden)
        weights[p + "mlp.up_proj.weight"] = draw(ffn, hidden)
        weights[p + "mlp.down_proj.weight"] = draw(hidden, ffn)
        if model_type == "qwen2":
            weights[p + "self_attn.q_proj.bias"] = draw(q_rows)
            weights[p + "self_attn.k_proj.bias"] = draw(kv_rows)
            weights[p + "self_attn.v_proj.bias"] = draw(kv_rows)
        if model_type == "qwen3":
            weights[p + "self_attn.q_norm.weight"] = draw(HEAD_DIM)
            weights[p + "self_attn.k_norm.weight"] = draw(HEAD_DIM)
    return weights


def write_vocab(
    writer: GGUFWriter, vocab: Vocab, pre: str, add_bos: bool | None
) -> None:
    writer.add_tokenizer_model(vocab.model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    writer.add_bos_token_id(vocab.bos)
    writer.add_eos_token_id(vocab.eos)
    optional: list[tuple[Any, Any]] = [  # (the writer's method, the value or None)
        (writer.add_token_scores, vocab.scores),
        (writer.add_token_merges, vocab.merges),
        (writer.add_unk_token_id, vocab.unknown),
        (writer.add_add_space_prefix, vocab.add_space_prefix),
        (writer.add_add_bos_token, add_bos),
    ]
    for add, value in optional:
        if value is not None:
            add(value)


def llamacpp_permute(
    weight: np.ndarray,  # [N*D, ...] HF row order
    n_heads: int,
) -> np.ndarray:  # [N*D, ...] llama.cpp row order
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute, as written there."""
    return (
        weight.reshape(n_heads, 2, weight.shape[0] // n_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def gguf_name(hf_name: str) -> str:
    module, _, suffix = hf_name.rpartition(".")
    top = {
        "model.embed_tokens": "token_embd",
        "model.norm": "output_norm",
        "lm_head": "output",
    }
    if module in top:
        return f"{top[module]}.{suffix}"
    _, _, index, rest = module.split(".", 3)
    return f"blk.{index}.{_LAYER[rest]}.{suffix}"


def write_tiny_gguf(
    path: Path,
    weights: dict[str, np.ndarray],  # HF name -> [O, I] / [V, H] / [O]
    *,
    arch: str = "llama",
    qtype: GGMLQuantizationType = GGMLQuantizationType.F32,
    tokenizer_model: str = "gpt2",
    pre: str = "default",
    add_bos: bool | None = False,  # None: the key left out
    vocab: Vocab | None = None,  # None: `tiny_vocab(tokenizer_model)`
    extra: dict[str, np.ndarray] | None = None,  # GGUF name -> any shape, as is
    blocks: dict[str, tuple[np.ndarray, GGMLQuantizationType]] | None = None,
) -> dict[str, np.ndarray]:
    """Write `weights` (HF names) as a GGUF; return what a reader must give back
    (the weights after a round trip through `qtype`). `blocks`: HF name ->
    raw blocks [rows, row bytes] of a type `gguf` cannot quantize to (Q6_K),
    written in that weight's place as they are (not llama's Q/K rows)."""
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(TINY["num_hidden_layers"])
    writer.add_context_length(256)
    writer.add_embedding_length(TINY["hidden_size"])
    writer.add_feed_forward_length(TINY["intermediate_size"])
    writer.add_head_count(TINY["num_attention_heads"])
    writer.add_head_count_kv(TINY["num_key_value_heads"])
    writer.add_rope_freq_base(50000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    if arch == "qwen3":
        writer.add_key_length(HEAD_DIM)
        writer.add_value_length(HEAD_DIM)
    write_vocab(writer, vocab or tiny_vocab(tokenizer_model), pre, add_bos)
    writer.add_chat_template(CHATML)
    expected: dict[str, np.ndarray] = {}
    heads = {
        "attn_q": TINY["num_attention_heads"],
        "attn_k": TINY["num_key_value_heads"],
    }
    for hf_name, value in weights.items():
        name = gguf_name(hf_name)
        stored = value
        kind = name.split(".")[-2]
        if arch == "llama" and kind in heads:
            stored = llamacpp_permute(value, heads[kind])
        if blocks is not None and hf_name in blocks:
            raw, raw_type = blocks[hf_name]
            writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=raw_type)
            expected[hf_name] = dequantize(raw, raw_type)
        elif value.ndim == 2 and qtype != GGMLQuantizationType.F32:
            raw = quantize(stored, qtype)
            writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qtype)
            # blocks run along a row, so permuting rows commutes with quantising
            expected[hf_name] = dequantize(quantize(value, qtype), qtype)
        else:
            writer.add_tensor(name, stored)
            expected[hf_name] = value
    for name, value in (extra or {}).items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


# -- Gemma-4 ------------------------------------------------------------------

GEMMA4_ARCH = gguf.MODEL_ARCH.GEMMA4
GEMMA4_ARCH_NAME = gguf.MODEL_ARCH_NAMES[GEMMA4_ARCH]  # "gemma4"


def gemma4_gguf_name(hf_name: str, layers: int) -> str:
    """The GGUF name llama.cpp's converter gives a Gemma4ForCausalLM tensor:
    Gemma4Model.filter_tensors (`layer_scalar` and the stacked experts gain
    `.weight`), Gemma4Model.modify_tensors (the router's `scale` and
    `per_expert_scale` become `.scale` tensors of ffn_gate_inp and
    ffn_down_exps), then gguf's own tensor map for the rest."""
    name = hf_name
    if name.endswith("layer_scalar") or (
        ".experts." in name and not name.endswith(".weight")
    ):
        name += ".weight"
    if name.endswith(("router.scale", "router.per_expert_scale")):
        bid = int(name.split(".")[2])
        kind = name.endswith("router.scale")
        tensor = MODEL_TENSOR.FFN_GATE_INP if kind else MODEL_TENSOR.FFN_DOWN_EXP
        return TENSOR_NAMES[tensor].format(bid=bid) + ".scale"
    mapped = gguf.get_tensor_name_map(GEMMA4_ARCH, layers).get_name(
        name, try_suffixes=(".weight", ".bias")
    )
    if mapped is None:
        raise ValueError(f"llama.cpp's gemma4 map has no name for {hf_name}")
    return mapped


def _stored_type(
    name: str, value: np.ndarray, qtype: GGMLQuantizationType
) -> GGMLQuantizationType:
    """The converter's choice: 1-D tensors and the router stay F32; a row that
    is not whole blocks of `qtype` falls back to F16."""
    if value.ndim == 1 or ".ffn_gate_inp." in name or qtype == GGMLQuantizationType.F32:
        return GGMLQuantizationType.F32
    if qtype == GGMLQuantizationType.F16:
        return qtype
    block, _ = GGML_QUANT_SIZES[qtype]
    return qtype if value.shape[-1] % block == 0 else GGMLQuantizationType.F16


def write_gemma4_gguf(
    path: Path,
    hparams: dict[str, Any],  # config.json keys, transformers' defaults filled
    state: dict[str, np.ndarray],  # Gemma4ForCausalLM state dict, float32
    *,
    qtype: GGMLQuantizationType = GGMLQuantizationType.F32,
    split_experts: bool = False,
    omit: tuple[str, ...] = (),  # metadata keys to leave out
    rope_freqs: np.ndarray | None = None,  # [global_head_dim / 2], else the converter's
    extra: dict[str, np.ndarray] | None = None,  # GGUF name -> array, as is
) -> dict[str, np.ndarray]:
    """Write a Gemma-4 text model as llama.cpp's converter does (conversion/
    gemma.py: Gemma4Model over Gemma3Model over TextModel) and return what a
    reader must give back: the weights (HF names) after a round trip through
    their stored types. Norms are stored as they are (Gemma-4's norm_shift is
    0), nothing is permuted, the full layers' proportional RoPE becomes
    `rope_freqs`. The tokenizer is the tiny byte-level BPE above (the `gemma4`
    vocabulary is tests/models/test_tokenizer_spm.py's). `split_experts` stores
    the experts' gate and up apart, a layout llama.cpp also loads."""
    h = hparams
    layers = int(h["num_hidden_layers"])
    kinds = list(h["layer_types"])
    rope = h["rope_parameters"]
    full_rope = rope["full_attention"]
    if full_rope["rope_type"] != "proportional":
        raise ValueError("llama.cpp's converter asserts a proportional full RoPE")
    if full_rope.get("factor", 1.0) != 1.0:
        raise ValueError("llama.cpp's converter drops the proportional RoPE factor")
    writer = GGUFWriter(str(path), GEMMA4_ARCH_NAME)
    # TextModel.set_gguf_parameters
    writer.add_block_count(layers)
    writer.add_context_length(h["max_position_embeddings"])
    writer.add_embedding_length(h["hidden_size"])
    writer.add_feed_forward_length(h["intermediate_size"])
    writer.add_head_count(h["num_attention_heads"])
    writer.add_head_count_kv(h["num_key_value_heads"])
    writer.add_rope_freq_base(full_rope["rope_theta"])
    writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    writer.add_layer_norm_rms_eps(h["rms_norm_eps"])
    if h.get("num_experts") is not None:
        writer.add_expert_count(h["num_experts"])
    if h.get("top_k_experts") is not None:
        writer.add_expert_used_count(h["top_k_experts"])
    writer.add_key_length(h["head_dim"])
    writer.add_value_length(h["head_dim"])
    # Gemma3Model.set_gguf_parameters
    if h.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(h["final_logit_softcapping"])
    writer.add_sliding_window(h["sliding_window"])
    # Gemma4Model.set_gguf_parameters
    shared = int(h["num_kv_shared_layers"])
    writer.add_shared_kv_layers(shared)
    writer.add_embedding_length_per_layer_input(
        h.get("hidden_size_per_layer_input") or 0
    )
    swa = [kind == "sliding_attention" for kind in kinds]
    writer.add_sliding_window_pattern(swa)
    writer.add_key_length(h["global_head_dim"])
    writer.add_value_length(h["global_head_dim"])
    writer.add_key_length_swa(h["head_dim"])
    writer.add_value_length_swa(h["head_dim"])
    if h.get("moe_intermediate_size") is not None:
        writer.add_expert_feed_forward_length(h["moe_intermediate_size"])
    if h.get("use_double_wide_mlp"):
        ff = h["intermediate_size"]
        writer.add_feed_forward_length(
            [ff if i < layers - shared else 2 * ff for i in range(layers)]
        )
    if h.get("num_global_key_value_heads") is not None:
        writer.add_head_count_kv(
            [
                h["num_key_value_heads"] if s else h["num_global_key_value_heads"]
                for s in swa
            ]
        )
    writer.add_rope_dimension_count(h["global_head_dim"])
    writer.add_rope_dimension_count_swa(
        int(h["head_dim"] * h.get("partial_rotary_factor", 1.0))
    )
    tokens, types = tiny_tokens()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(h["bos_token_id"])
    writer.add_eos_token_id(h["eos_token_id"])
    writer.add_add_bos_token(True)
    writer.add_chat_template(CHATML)
    for key in omit:
        del writer.kv_data[0][key]

    expected: dict[str, np.ndarray] = {}

    def add(name: str, value: np.ndarray) -> np.ndarray:
        kind = _stored_type(name, value, qtype)
        if kind == GGMLQuantizationType.F32:
            writer.add_tensor(name, value)
            return value
        if kind == GGMLQuantizationType.F16:
            writer.add_tensor(name, value.astype(np.float16))
            return value.astype(np.float16).astype(np.float32)
        raw = quantize(value, kind)
        writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=kind)
        back: np.ndarray = dequantize(raw, kind).reshape(value.shape)
        return back

    for hf_name, value in state.items():
        if hf_name == "lm_head.weight" and h["tie_word_embeddings"]:
            continue  # a tied checkpoint's file has no lm_head
        name = gemma4_gguf_name(hf_name, layers)
        if split_experts and name.endswith("ffn_gate_up_exps.weight"):
            half = value.shape[1] // 2
            stem = name[: -len("gate_up_exps.weight")]
            gate = add(stem + "gate_exps.weight", value[:, :half])
            up = add(stem + "up_exps.weight", value[:, half:])
            expected[hf_name] = np.concatenate([gate, up], axis=1)
        else:
            expected[hf_name] = add(name, value)
    # Gemma4Model.generate_extra_tensors
    dim = int(h["global_head_dim"])
    rotated = int(dim * full_rope["partial_rotary_factor"] / 2)
    freqs = [1.0] * rotated + [1e30] * (dim // 2 - rotated)
    if rope_freqs is None:
        rope_freqs = np.array(freqs, dtype=np.float32)
    writer.add_tensor("rope_freqs.weight", rope_freqs)
    for name, value in (extra or {}).items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected
