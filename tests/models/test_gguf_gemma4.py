"""Gemma-4 GGUF files (llama.cpp's `gemma4`) as Gemma-4 targets.

test_gemma4's tiny random models are written the way llama.cpp's converter
writes them (`gguf_support.write_gemma4_gguf`: its names, metadata keys,
`rope_freqs`, stored types) and must come back as the HF model: the same
weights, the same config (as `Gemma4Args`), and logits equal to
transformers' Gemma4ForCausalLM on the weights the file holds. The cases are
test_gemma4's, without what llama.cpp's format cannot carry (attention
biases, a proportional RoPE factor): "plain"; "shared-ple" (kv-shared
layers with double-wide MLPs, per-layer embeddings, softcapping);
"moe-keqv" (the MoE block, full layers taking values from the keys with
their own KV head count, an untied head, a kv-shared layer).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
import torch
import transformers
from attrs import evolve
from gguf import GGMLQuantizationType
from gguf_support import tiny_tokens, write_gemma4_gguf
from returns.result import Failure, Success

from models.gguf import GgufModel, gguf_config, read_gguf, read_gguf_header
from schemas.errors import LoadError
from schemas.hf_gemma4 import Gemma4Args
from specpipe.load import LoadedModel, load, save_folder
from tests.models.test_gemma4 import (
    CASES,
    FULL,
    SLIDING,
    TINY,
    TOL,
    args_of,
    forward,
    hf_logits,
    make_hf,
    token_ids,
)

pytestmark = pytest.mark.reference

Q = GGMLQuantizationType
VOCAB = len(tiny_tokens()[0])  # the file's tokenizer; the embedding as wide
# what llama.cpp's format carries of each test_gemma4 case
GGUF_CASES: dict[str, dict[str, Any]] = {
    "plain": {},
    "shared-ple": {
        "attention_bias": False,  # llama.cpp's gemma4 has no attention biases
        "rope_parameters": {  # ... and no proportional RoPE factor
            SLIDING: {"rope_type": "default", "rope_theta": 100.0},
            FULL: {
                "rope_type": "proportional",
                "partial_rotary_factor": 0.5,
                "rope_theta": 1e4,
            },
        },
    },
    "moe-keqv": {},
}


def raw_config(case: str) -> dict[str, Any]:
    """The case's config.json keys (test_gemma4's, as llama.cpp carries them)."""
    return {
        **TINY,
        **CASES[case],
        **GGUF_CASES[case],
        "vocab_size": VOCAB,
        "vocab_size_per_layer_input": VOCAB,
    }


def gemma_hf(case: str) -> Any:
    return make_hf(case, **raw_config(case))


def write(path: Path, case: str, hf: Any, **options: Any) -> dict[str, np.ndarray]:
    """The case as a GGUF at `path`; what a reader must give back."""
    state = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    # transformers' defaults filled, as the converter reads a config.json
    hparams = {**hf.config.to_dict(), **raw_config(case)}
    return write_gemma4_gguf(path, hparams, state, **options)


def read(path: Path, load_weights: bool = True) -> GgufModel:
    result = read_gguf(path, load_weights=load_weights)
    assert isinstance(result, Success), result
    return result.unwrap()


def refusal(result: Any) -> str:
    assert isinstance(result, Failure), result
    error = result.failure()
    assert isinstance(error, LoadError)
    return error.message


def comparable(args: Gemma4Args) -> Gemma4Args:
    """`args` with the full layers' KV heads spelled one way (transformers'
    `per_layer_config` gives them always, config.json's keys only with
    attention_k_eq_v)."""
    return evolve(args, num_global_key_value_heads=args.kv_heads_of(FULL))


@pytest.fixture(scope="module", params=list(GGUF_CASES))
def case_hf(request: pytest.FixtureRequest) -> tuple[str, Any]:
    return request.param, gemma_hf(request.param)


# -- the file's contents --------------------------------------------------------


@pytest.mark.parametrize(
    ("qtype", "split_experts"),
    [(Q.F32, False), (Q.F16, False), (Q.Q8_0, False), (Q.F32, True)],
    ids=["F32", "F16", "Q8_0", "F32-experts-apart"],
)
def test_weights_come_back_with_transformers_names(
    tmp_path: Path,
    case_hf: tuple[str, Any],
    qtype: GGMLQuantizationType,
    split_experts: bool,
) -> None:
    case, hf = case_hf
    path = tmp_path / "g.gguf"
    expected = write(path, case, hf, qtype=qtype, split_experts=split_experts)
    model = read(path)
    assert set(model.weights) == set(expected)
    # a file of F16 matrices loads as float16, its F32 vectors rounded to it
    dtype = mx.float16 if qtype == Q.F16 else mx.float32
    assert model.config["torch_dtype"] == str(dtype).removeprefix("mlx.core.")
    for name, want in expected.items():
        got = model.weights[name]
        assert got.dtype == dtype, name
        rounded = np.array(mx.array(want).astype(dtype).astype(mx.float32))
        np.testing.assert_array_equal(
            np.array(got.astype(mx.float32)), rounded, err_msg=name
        )
    assert model.config["model_type"] == "gemma4_text"


def test_config_round_trips_as_transformers_reads_it(
    tmp_path: Path, case_hf: tuple[str, Any]
) -> None:
    case, hf = case_hf
    write(tmp_path / "g.gguf", case, hf)
    config = read(tmp_path / "g.gguf", load_weights=False).config
    want = comparable(args_of(hf.config.to_dict()))
    assert comparable(args_of(config)) == want
    # transformers reads the same config from it
    again = transformers.Gemma4TextConfig(**config)
    assert comparable(args_of(again.to_dict())) == want
    assert config["attention_k_eq_v"] is (case == "moe-keqv")
    assert config["enable_moe_block"] is (case == "moe-keqv")
    assert config["use_double_wide_mlp"] is (case == "shared-ple")


# -- parity ----------------------------------------------------------------------


def loaded(path: Path, dtype: str | None = None) -> LoadedModel:
    result = load(str(path), dtype)
    assert isinstance(result, Success), result
    return result.unwrap()


def assert_logits_match(model: Any, hf: Any) -> None:
    ids = token_ids((2, 11), seed=4, vocab=VOCAB)
    want = hf_logits(hf, ids)
    got = forward(model, ids, model.make_cache(2), [0, 0])
    np.testing.assert_allclose(got, want, atol=TOL, rtol=TOL)


@pytest.mark.parametrize(
    ("case", "qtype"),
    [
        ("shared-ple", Q.F32),
        ("moe-keqv", Q.F16),
        ("plain", Q.Q8_0),
        ("shared-ple", Q.Q8_0),
        ("moe-keqv", Q.Q8_0),
    ],
    ids=[
        "shared-ple-F32",
        "moe-keqv-F16",
        "plain-Q8_0",
        "shared-ple-Q8_0",
        "moe-keqv-Q8_0",
    ],
)
def test_logits_equal_transformers(
    tmp_path: Path, case: str, qtype: GGMLQuantizationType
) -> None:
    """A quantized file's matrices load kept quantized (the default for a
    GGUF; stacked experts and rows that are not whole blocks, which the
    converter stores as F16, as floats), holding the weights transformers is
    given. An F16 file, which loads as float16, is compared in float32
    (`--dtype float32`), as transformers computes."""
    hf = gemma_hf(case)
    expected = write(tmp_path / "g.gguf", case, hf, qtype=qtype)
    # transformers on the weights the file holds (rounded by its stored types)
    hf.load_state_dict(
        {k: torch.from_numpy(v) for k, v in expected.items()}, strict=False
    )
    if qtype == Q.F16:
        half = loaded(tmp_path / "g.gguf").model
        assert half.model.embed_tokens.weight.dtype == mx.float16
    dtype = "float32" if qtype == Q.F16 else None
    model = loaded(tmp_path / "g.gguf", dtype).model
    kinds = {type(m).__name__ for _, m in model.named_modules()}
    assert ("QuantizedLinear" in kinds) is (qtype == Q.Q8_0)
    assert ("QuantizedSwitchLinear" in kinds) is (
        qtype == Q.Q8_0 and case == "moe-keqv"
    )
    assert_logits_match(model, hf)


def test_experts_stored_apart_are_kept_joined(tmp_path: Path) -> None:
    """Q8_0 experts stored as gate and up apart load kept, joined as
    transformers' `gate_up_proj` is (weights, scales and biases alike)."""
    hf = gemma_hf("moe-keqv")
    expected = write(
        tmp_path / "g.gguf", "moe-keqv", hf, qtype=Q.Q8_0, split_experts=True
    )
    hf.load_state_dict(
        {k: torch.from_numpy(v) for k, v in expected.items()}, strict=False
    )
    kept = loaded(tmp_path / "g.gguf")
    experts = kept.model.model.layers[0].experts.switch_glu
    assert type(experts.gate_proj).__name__ == "QuantizedSwitchLinear"
    assert_logits_match(kept.model, hf)
    # and `convert --quantize keep`'s folder of it loads the same
    assert save_folder(kept, tmp_path / "out") == Success(tmp_path / "out")
    again = loaded(tmp_path / "out").model
    assert type(again.model.layers[0].experts.switch_glu.down_proj).__name__ == (
        "QuantizedSwitchLinear"
    )
    assert_logits_match(again, hf)


def test_convert_writes_a_folder_that_loads(tmp_path: Path) -> None:
    hf = gemma_hf("shared-ple")
    write(tmp_path / "g.gguf", "shared-ple", hf)
    folder = save_folder(loaded(tmp_path / "g.gguf"), tmp_path / "out")
    assert folder == Success(tmp_path / "out")
    assert_logits_match(loaded(tmp_path / "out").model, hf)


# -- what it refuses ---------------------------------------------------------------


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("gemma4")
    for case in ("plain", "moe-keqv"):
        write(folder / f"{case}.gguf", case, gemma_hf(case))
    return {case: folder / f"{case}.gguf" for case in ("plain", "moe-keqv")}


@pytest.mark.parametrize(
    "key",
    ["gemma4.attention.key_length_swa", "gemma4.attention.sliding_window_pattern"],
)
def test_a_missing_required_key_is_named(tmp_path: Path, key: str) -> None:
    path = tmp_path / "g.gguf"
    write(path, "plain", gemma_hf("plain"), omit=(key,))
    message = refusal(read_gguf(path))
    assert str(path) in message
    assert f"metadata lacks {key}" in message
    assert "llama.cpp" in message


@pytest.mark.parametrize(
    ("case", "changes", "named"),
    [
        (  # full layers with KV heads of their own, but values of their own too
            "plain",
            {"gemma4.attention.head_count_kv": [2, 2, 1, 2, 1, 1]},
            "attention_k_eq_v",
        ),
        ("plain", {"gemma4.attention.sliding_window_pattern": [True] * 6}, "last"),
        ("plain", {"gemma4.rope.scaling.factor": 8.0}, "RoPE scaling"),
        ("plain", {"gemma4.rope.dimension_count_swa": 8}, "dimension_count_swa (8)"),
        ("plain", {"gemma4.attention.value_length": 16}, "value_length (16)"),
        ("plain", {"gemma4.feed_forward_length": [96, 192] + [96] * 4}, "double"),
        ("plain", {"gemma4.attention.head_count": [4, 4, 2, 4, 4, 4]}, "differ"),
        ("plain", {"gemma4.embedding_length_per_layer_input": 8}, "per-layer"),
        ("moe-keqv", {"gemma4.expert_used_count": None}, "expert_used_count"),
    ],
)
def test_metadata_a_gemma4_config_cannot_say_is_refused(
    files: dict[str, Path], case: str, changes: dict[str, Any], named: str
) -> None:
    header = read_gguf_header(files[case]).unwrap()
    for key, value in changes.items():
        if value is None:
            del header.metadata[key]
        else:
            header.metadata[key] = value
    config = gguf_config(header)
    assert isinstance(config, LoadError), config
    assert named in config.message and str(files[case]) in config.message


def test_tensors_it_cannot_place_are_named(tmp_path: Path) -> None:
    path = tmp_path / "g.gguf"
    bias = np.zeros(64, dtype=np.float32)
    write(path, "plain", gemma_hf("plain"), extra={"blk.0.attn_q.bias": bias})
    message = refusal(read_gguf(path))
    assert "no place in a Gemma-4 text model" in message
    assert "blk.0.attn_q.bias" in message


@pytest.mark.parametrize(
    ("freqs", "named"),
    [
        (np.array([1.0] * 4 + [2.0] * 12, dtype=np.float32), "factors other than 1"),
        (np.ones(8, dtype=np.float32), "not [16]"),
    ],
)
def test_rope_freqs_that_are_not_proportional_rope_are_refused(
    tmp_path: Path, freqs: np.ndarray, named: str
) -> None:
    path = tmp_path / "g.gguf"
    write(path, "plain", gemma_hf("plain"), rope_freqs=freqs)
    assert named in refusal(read_gguf(path))


def test_without_rope_freqs_the_full_layers_rope_is_unknown(
    files: dict[str, Path],
) -> None:
    header = read_gguf_header(files["plain"]).unwrap()
    kept = tuple(t for t in header.tensors if t.name != "rope_freqs.weight")
    config = gguf_config(evolve(header, tensors=kept))
    assert isinstance(config, LoadError)
    assert "no rope_freqs.weight tensor" in config.message
