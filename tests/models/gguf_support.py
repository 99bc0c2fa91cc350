"""Tiny GGUF files written with `gguf.GGUFWriter`, for tests that need no
checkpoint: known HF weights go in (Q/K rows permuted the way llama.cpp's
converter does for llama), and `read_gguf` must give them back."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
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
    add_bos: bool = False,
    extra: dict[str, np.ndarray] | None = None,  # GGUF name -> any shape, as is
) -> dict[str, np.ndarray]:
    """Write `weights` (HF names) as a GGUF; return what a reader must give back
    (the weights after a round trip through `qtype`)."""
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
    tokens, types = tiny_tokens()
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(add_bos)
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
        if value.ndim == 2 and qtype != GGMLQuantizationType.F32:
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
