"""GGUF import: config, weights (dequantised, llama Q/K un-permuted), errors.

Tiny files written by `gguf_support` check the round trip without any
checkpoint; the real fixtures are checked against transformers' own GGUF
import (the same per-tensor path as `load_gguf_checkpoint`).
"""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Any
from unittest import mock

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize
from gguf_support import (
    HEAD_DIM,
    TINY,
    llamacpp_permute,
    tiny_tokens,
    tiny_weights,
    write_tiny_gguf,
)
from mlx.utils import tree_flatten
from returns.result import Failure, Success

from models.gguf import GgufModel, read_gguf, unpermute_rope_rows
from schemas.converter import hf, structure
from schemas.errors import LoadError
from schemas.hf import DecoderArgs, normalize_hf_config
from specpipe.load import load

Q = GGMLQuantizationType


def _ok(path: Path, load_weights: bool = True) -> GgufModel:
    result = read_gguf(path, load_weights=load_weights)
    assert isinstance(result, Success), result
    return result.unwrap()


def _error(path: Path) -> str:
    result = read_gguf(path)
    assert isinstance(result, Failure), result
    error = result.failure()
    assert isinstance(error, LoadError)
    return error.message


def _assert_weights(
    model: GgufModel,
    expected: dict[str, np.ndarray],  # HF name -> [O, I] / [V, H] / [O] float32
    dtype: mx.Dtype = mx.float32,
) -> None:
    """The weights are `expected` in `dtype` (the F32 norms of a float16 or
    bfloat16 file rounded to it, as an HF checkpoint in that dtype holds
    them)."""
    assert set(model.weights) == set(expected)
    for name, want in expected.items():
        got = model.weights[name]
        assert got.dtype == dtype, name
        rounded = np.array(mx.array(want).astype(dtype).astype(mx.float32))
        np.testing.assert_array_equal(
            np.array(got.astype(mx.float32)), rounded, err_msg=name
        )


# -- tiny files ---------------------------------------------------------------

# a file of F16 (BF16) matrices loads as float16 (bfloat16); any other as float32
_FILE_DTYPE = {Q.F16: mx.float16, Q.BF16: mx.bfloat16}


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q4_1, Q.Q5_0, Q.Q8_0])
def test_tiny_llama_round_trip_undoes_the_qk_permutation(
    tmp_path: Path, qtype: GGMLQuantizationType
) -> None:
    tokens, _ = tiny_tokens()
    weights = tiny_weights(0, len(tokens))
    expected = write_tiny_gguf(tmp_path / "tiny.gguf", weights, qtype=qtype)
    model = _ok(tmp_path / "tiny.gguf")
    dtype = _FILE_DTYPE.get(qtype, mx.float32)
    _assert_weights(model, expected, dtype)
    assert model.config["torch_dtype"] == str(dtype).removeprefix("mlx.core.")
    assert model.config["model_type"] == "llama"
    assert model.config["tie_word_embeddings"] is True
    assert model.config["num_key_value_heads"] == TINY["num_key_value_heads"]
    assert model.config["rope_theta"] == 50000.0
    assert model.config["rms_norm_eps"] == 1e-5


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16], ids=lambda q: q.name)
def test_a_half_precision_file_loads_in_its_own_dtype(
    tmp_path: Path, qtype: GGMLQuantizationType
) -> None:
    """A file of F16 (BF16) matrices, as llama.cpp's `--outtype f16` (`bf16`)
    writes one, loads in float16 (bfloat16): half the bytes of the float32
    load `--dtype float32` still gives, the same values, logits within the
    dtype's rounding."""
    tokens, _ = tiny_tokens()
    path = tmp_path / "half.gguf"
    weights = tiny_weights(3, len(tokens), model_type="qwen2")
    write_tiny_gguf(path, weights, arch="qwen2", qtype=qtype)
    own = load(str(path)).unwrap()
    wide = load(str(path), dtype="float32").unwrap()
    dtype = _FILE_DTYPE[qtype]
    own_params = dict(tree_flatten(own.model.parameters()))
    wide_params = dict(tree_flatten(wide.model.parameters()))
    assert {v.dtype for v in own_params.values()} == {dtype}
    assert {v.dtype for v in wide_params.values()} == {mx.float32}
    for name, value in own_params.items():
        np.testing.assert_array_equal(
            np.array(value.astype(mx.float32)),
            np.array(wide_params[name].astype(dtype).astype(mx.float32)),
            err_msg=name,
        )
    assert 2 * sum(v.nbytes for v in own_params.values()) == sum(
        v.nbytes for v in wide_params.values()
    )
    ids = mx.array([[1, 5, 9, 12, 3, 7]])
    got, want = (
        m.model(ids, m.model.make_cache(1), [0]).logits.astype(mx.float32)
        for m in (own, wide)
    )
    assert got.dtype == mx.float32 and not bool(mx.any(mx.isnan(got)))
    # float16 (bfloat16) activations: the logits (up to ~30 here) differ
    # by 2e-3 (1e-2) of their scale, measured
    scale = float(mx.abs(want).max())
    tolerance = (5e-3 if qtype == Q.F16 else 2.5e-2) * scale
    np.testing.assert_allclose(np.array(got), np.array(want), atol=tolerance)


@pytest.mark.parametrize(
    ("other", "dtype"),
    [(Q.F32, "float16"), (Q.Q8_0, "float32"), (Q.BF16, "float32")],
    ids=["f32-router", "q8_0", "bf16"],
)
def test_a_file_mixing_matrix_types_loads_as_float32(
    tmp_path: Path, other: GGMLQuantizationType, dtype: str
) -> None:
    """F16 matrices beside one of another type: F32 (as llama.cpp keeps an
    MoE router) leaves the file float16; a quantized or BF16 matrix makes it
    float32, which holds both exactly."""
    tokens, _ = tiny_tokens()
    weights = tiny_weights(5, len(tokens))
    name = "model.layers.0.mlp.down_proj.weight"
    value = weights[name]
    raw = (
        value.view(np.uint8)
        if other == Q.F32
        else gguf_quantize(value, other).reshape(value.shape[0], -1)
    )
    path = tmp_path / "mixed.gguf"
    write_tiny_gguf(path, weights, qtype=Q.F16, blocks={name: (raw, other)})
    model = _ok(path)
    assert model.config["torch_dtype"] == dtype
    assert {str(v.dtype) for v in model.weights.values()} == {f"mlx.core.{dtype}"}


def test_tiny_qwen2_is_not_permuted_and_keeps_biases(tmp_path: Path) -> None:
    tokens, _ = tiny_tokens()
    weights = tiny_weights(1, len(tokens), model_type="qwen2", tied=False)
    expected = write_tiny_gguf(tmp_path / "q.gguf", weights, arch="qwen2")
    model = _ok(tmp_path / "q.gguf")
    _assert_weights(model, expected)
    assert model.config["attention_bias"] is True
    assert model.config["tie_word_embeddings"] is False
    assert "lm_head.weight" in model.weights


def test_tiny_qwen3_reads_head_dim_and_qk_norms(tmp_path: Path) -> None:
    tokens, _ = tiny_tokens()
    weights = tiny_weights(2, len(tokens), model_type="qwen3")
    expected = write_tiny_gguf(tmp_path / "q3.gguf", weights, arch="qwen3")
    model = _ok(tmp_path / "q3.gguf")
    _assert_weights(model, expected)
    assert model.config["head_dim"] == HEAD_DIM
    assert "model.layers.1.self_attn.q_norm.weight" in model.weights


def test_config_parses_into_decoder_args(tmp_path: Path) -> None:
    tokens, _ = tiny_tokens()
    write_tiny_gguf(tmp_path / "t.gguf", tiny_weights(0, len(tokens)))
    config = _ok(tmp_path / "t.gguf", load_weights=False).config
    args = structure(hf, normalize_hf_config(config), DecoderArgs, "config")
    assert isinstance(args, Success), args
    decoded = args.unwrap()
    assert decoded.rope.theta == 50000.0
    assert decoded.rope.traditional is False
    assert decoded.vocab_size == len(tokens)
    assert decoded.eos_token_id == (2,)


def test_without_weights_reads_only_the_header(tmp_path: Path) -> None:
    tokens, _ = tiny_tokens()
    write_tiny_gguf(tmp_path / "t.gguf", tiny_weights(0, len(tokens)))
    model = _ok(tmp_path / "t.gguf", load_weights=False)
    assert model.weights == {}
    assert model.tokenizer_config["chat_template"].startswith("{% for message")


@pytest.mark.parametrize("n_heads", [1, 3, 4])
def test_unpermute_inverts_llamacpp_permute(n_heads: int) -> None:
    rng = np.random.default_rng(n_heads)
    for shape in [(n_heads * 8, 5), (n_heads * 8,)]:
        weight = rng.standard_normal(shape).astype(np.float32)
        permuted = llamacpp_permute(weight, n_heads)
        assert not np.array_equal(permuted, weight)
        np.testing.assert_array_equal(unpermute_rope_rows(permuted, n_heads), weight)


def test_permuted_rows_with_traditional_rope_equal_hf_rows_with_split_rope() -> None:
    # Why the un-permute is needed: llama.cpp's rows (pairs interleaved) rotated
    # with adjacent-pair RoPE equal the HF rows rotated with rotate-half RoPE,
    # up to the same row order. So HF-layout weights must run traditional=False.
    heads, dim, length = 3, 16, 5
    rng = np.random.default_rng(0)
    q_hf = rng.standard_normal((1, heads, length, dim)).astype(np.float32)
    order = llamacpp_permute(np.arange(dim), 1)  # llama.cpp row i holds HF row order[i]
    q_cpp = q_hf[..., order]
    split = mx.fast.rope(
        mx.array(q_hf), dim, traditional=False, base=1e4, scale=1.0, offset=3
    )
    pairs = mx.fast.rope(
        mx.array(q_cpp), dim, traditional=True, base=1e4, scale=1.0, offset=3
    )
    np.testing.assert_allclose(np.array(pairs), np.array(split)[..., order], atol=1e-5)


# -- errors -------------------------------------------------------------------


def test_missing_file(tmp_path: Path) -> None:
    message = _error(tmp_path / "nope.gguf")
    assert "nope.gguf" in message and "does not exist" in message


def test_not_a_gguf(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_text("{" + '"not": "a gguf"' * 10 + "}")
    message = _error(path)
    assert "is not a GGUF file" in message and str(path) in message


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    assert "is not a GGUF file: only 0 bytes" in _error(path)


@pytest.fixture
def tiny_file(tmp_path: Path) -> Path:
    tokens, _ = tiny_tokens()
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, tiny_weights(0, len(tokens)), qtype=Q.Q8_0)
    return path


@pytest.mark.parametrize("keep", [0.2, 0.6, 0.999])
def test_truncated_file(tiny_file: Path, keep: float) -> None:
    data = tiny_file.read_bytes()
    tiny_file.write_bytes(data[: int(len(data) * keep)])
    message = _error(tiny_file)
    assert str(tiny_file) in message
    assert "truncated" in message


def test_unsupported_version(tiny_file: Path) -> None:
    data = bytearray(tiny_file.read_bytes())
    data[4:8] = (1).to_bytes(4, "little")
    tiny_file.write_bytes(bytes(data))
    assert "GGUF version 1 is not supported" in _error(tiny_file)


def test_corrupt_length_field(tiny_file: Path) -> None:
    data = bytearray(tiny_file.read_bytes())
    data[24:32] = (1 << 60).to_bytes(8, "little")  # length of the first key
    tiny_file.write_bytes(bytes(data))
    message = _error(tiny_file)
    assert "corrupt or truncated GGUF" in message and "metadata key #0" in message


def test_unsupported_architecture(tmp_path: Path) -> None:
    tokens, _ = tiny_tokens()
    path = tmp_path / "phi.gguf"
    write_tiny_gguf(path, tiny_weights(0, len(tokens)), arch="phi3")
    message = _error(path)
    assert "architecture 'phi3' is not supported" in message and str(path) in message


def test_a_gemma3_file_lacking_its_keys_is_named(tmp_path: Path) -> None:
    """A gemma3 GGUF needs its head width and sliding window (llama.cpp's
    converter writes both); the message names the keys."""
    tokens, _ = tiny_tokens()
    path = tmp_path / "gemma.gguf"
    write_tiny_gguf(path, tiny_weights(0, len(tokens)), arch="gemma3")
    message = _error(path)
    assert "metadata lacks gemma3.attention.key_length" in message
    assert "gemma3.attention.sliding_window" in message and str(path) in message


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ("blk.0.attn_qkv.weight", "tensors with no place in a llama model"),
        ("rope_freqs.weight", "rope_freqs (Llama 3.1-style RoPE scaling)"),
    ],
)
def test_tensors_we_cannot_place(tmp_path: Path, extra: str, expected: str) -> None:
    tokens, _ = tiny_tokens()
    path = tmp_path / "odd.gguf"
    block = np.ones((8, 32), dtype=np.float32)
    write_tiny_gguf(path, tiny_weights(0, len(tokens)), extra={extra: block})
    assert expected in _error(path)


def test_unsupported_tokenizer(tmp_path: Path) -> None:
    tokens, _ = tiny_tokens()
    path = tmp_path / "t5.gguf"
    write_tiny_gguf(path, tiny_weights(0, len(tokens)), tokenizer_model="t5")
    message = _error(path)
    assert "tokenizer model 't5' is not supported" in message
    assert "'gpt2'" in message and "'llama'" in message and "tokenizer.json" in message


# -- the real checkpoints -----------------------------------------------------


@pytest.fixture(scope="session")
def smollm2_model(smollm2_gguf: Path) -> GgufModel:
    start = time.perf_counter()
    model = _ok(smollm2_gguf)
    print(f"read_gguf(SmolLM2-135M): {time.perf_counter() - start:.1f} s")
    return model


@pytest.fixture(scope="session")
def qwen05_model(qwen05_gguf: Path) -> GgufModel:
    start = time.perf_counter()
    model = _ok(qwen05_gguf)
    print(f"read_gguf(Qwen2.5-Coder-0.5B): {time.perf_counter() - start:.1f} s")
    return model


@pytest.mark.fixture
def test_smollm2_config(smollm2_model: GgufModel) -> None:
    config = smollm2_model.config
    assert config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 30
    assert config["hidden_size"] == 576
    assert config["intermediate_size"] == 1536
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert config["head_dim"] == 64
    assert config["rope_theta"] == 100000.0
    assert config["rms_norm_eps"] == 1e-5
    assert config["vocab_size"] == 49152
    assert config["max_position_embeddings"] == 8192
    assert config["tie_word_embeddings"] is True
    assert "lm_head.weight" not in smollm2_model.weights
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert len(smollm2_model.weights) == 2 + 30 * 9


@pytest.mark.fixture
def test_qwen05_config(qwen05_model: GgufModel) -> None:
    config = qwen05_model.config
    assert config["model_type"] == "qwen2"
    assert config["num_hidden_layers"] == 24
    assert config["hidden_size"] == 896
    assert config["intermediate_size"] == 4864
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (14, 2)
    assert config["rope_theta"] == 1e6
    assert config["attention_bias"] is True
    assert config["vocab_size"] == 151936
    # this GGUF carries its own output.weight
    assert config["tie_word_embeddings"] is False
    assert qwen05_model.weights["lm_head.weight"].shape == (151936, 896)
    assert len(qwen05_model.weights) == 3 + 24 * 12


def _transformers_reference(
    path: Path, names: list[str]
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:  # config, name -> HF-shaped float32
    """transformers' config and dequantised tensors for a GGUF: its own name map
    and tensor processors (llama: Q/K reverse permutation), as in
    `load_gguf_checkpoint`, for the tensors `names` only.

    Two pure, slow steps are shared, not changed: the file is parsed once (the
    config loader would parse it again) and gguf's tensor-name table is built
    once per (arch, layers) (transformers rebuilds it for every submodule).
    """
    import gguf
    import torch
    from gguf.quants import dequantize
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    reader = gguf.GGUFReader(path)
    name_map = functools.cache(gguf.get_tensor_name_map)
    with (
        mock.patch("gguf.GGUFReader", lambda *_, **__: reader),
        mock.patch("gguf.get_tensor_name_map", name_map),
    ):
        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
        arch = reader.fields["general.architecture"].contents()
        processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(
            config=config.to_dict()
        )
        mapping = get_gguf_hf_weights_map(skeleton, processor)
    tensors: dict[str, np.ndarray] = {}
    for tensor in reader.tensors:
        if mapping.get(tensor.name) not in names:
            continue
        result = processor.process(
            weights=dequantize(tensor.data, tensor.tensor_type),
            name=tensor.name,
            tensor_key_mapping=mapping,
            parsed_parameters={},
        )
        tensors[mapping[result.name]] = np.asarray(result.weights)
    return config.to_dict(), tensors


def _compare_with_transformers(model: GgufModel, path: Path, names: list[str]) -> None:
    config, tensors = _transformers_reference(path, names)
    assert set(tensors) == set(names)
    for name in names:
        np.testing.assert_array_equal(
            np.array(model.weights[name]), tensors[name], err_msg=name
        )
    for key in (
        "model_type",
        "hidden_size",
        "num_hidden_layers",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
        "max_position_embeddings",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
    ):
        assert model.config[key] == config[key], key
    assert model.config["rope_theta"] == config["rope_parameters"]["rope_theta"]
    assert model.config["rms_norm_eps"] == pytest.approx(
        config["rms_norm_eps"], rel=1e-6
    )


@pytest.mark.fixture
@pytest.mark.reference
def test_smollm2_matches_transformers(
    smollm2_model: GgufModel, smollm2_gguf: Path
) -> None:
    names = [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.17.self_attn.q_proj.weight",
        "model.layers.29.self_attn.k_proj.weight",
        "model.layers.29.self_attn.v_proj.weight",
        "model.layers.5.mlp.down_proj.weight",
        "model.layers.5.input_layernorm.weight",
        "model.norm.weight",
    ]
    _compare_with_transformers(smollm2_model, smollm2_gguf, names)


@pytest.mark.fixture
@pytest.mark.reference
def test_qwen05_matches_transformers(
    qwen05_model: GgufModel, qwen05_gguf: Path
) -> None:
    names = [
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.layers.3.self_attn.q_proj.weight",
        "model.layers.3.self_attn.q_proj.bias",
        "model.layers.3.self_attn.k_proj.weight",
        "model.layers.3.self_attn.k_proj.bias",
        "model.layers.3.self_attn.v_proj.weight",
        "model.layers.3.mlp.down_proj.weight",
        "model.layers.23.mlp.gate_proj.weight",
        "model.norm.weight",
    ]
    _compare_with_transformers(qwen05_model, qwen05_gguf, names)
