"""The own MLX Qwen3.5 dense (hybrid attention + GatedDeltaNet with split
projections + dense MLP) against HF transformers, its checkpoint forms, its
MTP head, and lossless speculation through the public API.

Two tiny random models run in float32 on the CPU (4 layers: linear, full,
linear, full attention; hidden 64; 4 query / 2 kv heads of 16; 2 key / 4
value linear heads of 8):
- `Qwen3_5ForCausalLM` (the text form, `qwen3_5_text`, untied head, vocab
  128) for parity and the recurrent state's per-position commit;
- `Qwen3_5ForConditionalGeneration` (the multimodal form, `qwen3_5`, with a
  one-block vision tower, tied head, vocab 320 so the tiny tokenizer fits),
  saved as an HF folder with an `mtp.*` head and loaded through
  `specpipe.load.load` and `specpipe.api.load`.
Parameters are re-drawn after HF's init so the zero-centred norms, A_log and
dt_bias are non-trivial.
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
from returns.result import Failure, Success
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf_qwen3_5

from models.build import build_model, load_weights
from models.layers import flat_parameters
from models.mtp import MtpHead, build_mtp
from models.qwen3_5 import Model
from models.qwen3_next import PER_POSITION_MAX
from schemas.converter import hf as hf_converter
from schemas.converter import structure, unstructure
from schemas.hf_hybrid import HybridArgs, hybrid_args
from schemas.request import GenerationLimits, SamplingParams
from specpipe import api
from specpipe.load import LoadedModel, load, save_folder
from tests.cli.conftest import write_tiny_model
from tests.models import hybrid_support as support
from tests.models.hybrid_support import (
    FOLDER_VOCAB,
    TOL,
    VISION,
    VOCAB,
    TorchMtp,
    hf_weights,
    mtp_weights,
    randomize,
    step,
    token_ids,
)
from tests.models.rollback_support import (  # noqa: F401  (pytest collects them here)
    prefilled_cache,
    test_committing_k_of_a_window_equals_decoding_k_tokens,
    test_rows_keeping_different_counts_equal_each_row_alone,
)
from tests.rounding import same_math

pytestmark = pytest.mark.reference

TEXT: dict[str, Any] = {
    **support.LAYOUT,
    "intermediate_size": 96,
    "rope_parameters": support.QWEN3_5_ROPE,
}


def text_config(**overrides: Any) -> Any:
    settings: dict[str, Any] = {**TEXT, **overrides, "attn_implementation": "eager"}
    return transformers.Qwen3_5TextConfig(**settings)


def make_hf(seed: int = 0) -> Any:
    torch.manual_seed(seed)
    model: Any = transformers.Qwen3_5ForCausalLM(text_config())
    randomize(model, seed)
    return model.eval()


def make_multimodal(seed: int = 3) -> Any:
    config: Any = transformers.Qwen3_5Config(
        text_config={**TEXT, "vocab_size": FOLDER_VOCAB},
        vision_config=VISION,
        tie_word_embeddings=True,
    )
    config.text_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model: Any = transformers.Qwen3_5ForConditionalGeneration(config)
    randomize(model, seed)
    return model.eval()


def ours(hf: Any) -> Model:
    model: Model = support.ours(hf, Model)
    return model


@pytest.fixture(scope="module")
def pair() -> tuple[Any, Model]:
    hf = make_hf()
    return hf, ours(hf)


# --- config ---------------------------------------------------------------


def test_text_and_multimodal_configs_parse_to_the_same_text_model() -> None:
    text = text_config(eos_token_id=[5, 6]).to_dict()
    wrapper = transformers.Qwen3_5Config(
        text_config={**TEXT, "mtp_num_hidden_layers": 2},
        vision_config=VISION,
        tie_word_embeddings=True,
    ).to_dict()
    wrapper["eos_token_id"] = 7  # on the wrapper only: fills the text's gap
    wrapper["quantization"] = {"group_size": 64, "bits": 4}
    a = hybrid_args(text, "text").unwrap()
    b = hybrid_args(wrapper, "wrapper").unwrap()
    assert (a.model_type, b.model_type) == ("qwen3_5_text", "qwen3_5")
    for args in (a, b):
        assert args.num_experts == 0  # dense: every layer an MLP
        assert not any(args.is_sparse(i) for i in range(args.num_hidden_layers))
        assert args.rope.theta == 1e6 and args.rope.rope_type == "default"
        assert args.rotary_dims == 8  # head_dim 16 * partial_rotary_factor 0.5
        assert args.attention_layers == (1, 3)
    assert (a.tie_word_embeddings, b.tie_word_embeddings) == (False, True)
    assert (a.eos_token_id, b.eos_token_id) == ((5, 6), (7,))
    assert (a.num_nextn_predict_layers, b.num_nextn_predict_layers) == (1, 2)
    assert a.quantization is None and b.quantization is not None
    for args in (a, b):
        again = structure(
            hf_converter, unstructure(hf_converter, args), HybridArgs, "x"
        )
        assert again == Success(args)


def test_config_defaults_and_the_legacy_mrope_form() -> None:
    """transformers' defaults (head_dim 256, partial factor 0.25, every 4th
    layer attention) for keys a config omits; `rope_scaling: {type: mrope}`
    is the plain RoPE for text."""
    raw = {
        "model_type": "qwen3_5_text",
        "hidden_size": 64,
        "num_hidden_layers": 8,
        "intermediate_size": 96,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": VOCAB,
        "rope_theta": 1e7,
        "rope_scaling": {"type": "mrope", "mrope_section": [11, 11, 10]},
    }
    args = hybrid_args(raw, "cfg").unwrap()
    assert (args.head_dim, args.rotary_dims, args.rope.theta) == (256, 64, 1e7)
    assert args.rope.rope_type == "default"
    assert args.attention_layers == (3, 7)
    settings: dict[str, Any] = {k: v for k, v in raw.items() if k != "rope_scaling"}
    reference = transformers.Qwen3_5TextConfig(**settings)
    assert list(args.layer_types) == reference.layer_types
    bad = hybrid_args({**raw, "linear_num_key_heads": 3}, "cfg")
    assert isinstance(bad, Failure) and "must be a multiple" in bad.failure().message


def test_qwen3_5_needs_dense_hybrid_args(pair: tuple[Any, Model]) -> None:
    _, model = pair
    result = build_model(evolve(model.hybrid, num_experts=4))
    assert isinstance(result, Failure) and "no experts" in result.failure().message


# --- parity ---------------------------------------------------------------


def test_prefill_matches_transformers(pair: tuple[Any, Model]) -> None:
    hf, model = pair
    assert model.padding_safe is False
    assert support.prefill_error(hf, model) < TOL


@pytest.mark.parametrize("prompt", [6, PER_POSITION_MAX + 6])
def test_prefill_then_decode_matches_full_sequence(
    pair: tuple[Any, Model], prompt: int
) -> None:
    """Past PER_POSITION_MAX the prefill keeps only its final state (and runs
    the chunked rule)."""
    hf, model = pair
    assert max(support.prefill_then_decode_errors(hf, model, prompt)) < TOL


# --- checkpoint forms -------------------------------------------------------


def test_missing_split_projection_is_a_load_error_naming_it(
    pair: tuple[Any, Model],
) -> None:
    hf, model = pair
    weights = hf_weights(hf)
    del weights["model.layers.2.linear_attn.in_proj_b.weight"]
    result = load_weights(model, weights, model.args)
    assert isinstance(result, Failure)
    assert "model.layers.2.linear_attn.in_proj_b.weight" in result.failure().message


def torch_mtp(config: Any) -> TorchMtp:
    """The Qwen3.5 head's reference wiring (vLLM's
    `Qwen3_5MultiTokenPredictor`)."""
    return TorchMtp(
        config,
        hf_qwen3_5.Qwen3_5RMSNorm,
        hf_qwen3_5.Qwen3_5DecoderLayer,
        hf_qwen3_5.Qwen3_5TextRotaryEmbedding,
    )


def checkpoint(hf: Any, reference: TorchMtp) -> dict[str, mx.array]:
    """HF names and conventions: `model.language_model.*`, `model.visual.*`,
    a tied `lm_head.weight`, zero-centred norms, and the head under `mtp.*`."""
    return {**hf_weights(hf), **mtp_weights(reference)}


def write_folder(folder: Path, hf: Any, weights: dict[str, mx.array]) -> Path:
    write_tiny_model(folder, vocab=FOLDER_VOCAB)  # tokenizer files
    hf.config.save_pretrained(folder)  # replaces config.json: the wrapper form
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    return folder


@pytest.fixture(scope="module")
def multimodal(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Any, TorchMtp, Path]:
    """The multimodal HF model, its MTP reference, and a saved HF folder of
    both."""
    hf = make_multimodal()
    reference = torch_mtp(hf.config.text_config)
    randomize(reference, seed=7)
    reference.eval()
    folder = tmp_path_factory.mktemp("qwen3_5") / "random"
    return hf, reference, write_folder(folder, hf, checkpoint(hf, reference))


@pytest.fixture(scope="module")
def echoing(
    multimodal: tuple[Any, TorchMtp, Path], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The same checkpoint with every layer's output scaled to ~0: the
    residual stream stays near the input embedding, so with the tied head the
    model mostly repeats its last token (which ngram drafts find). Its MTP
    head copies its hidden input (fc = [0 | I], the layer adding nothing), so
    it drafts the target's own prediction for the previous position: the
    pending token, right whenever the target repeats itself."""
    hf, reference, _ = multimodal
    weights = checkpoint(hf, reference)
    outputs = ("o_proj.weight", "out_proj.weight", "down_proj.weight")
    for key, value in weights.items():
        if key.startswith("model.language_model.layers.") and key.endswith(outputs):
            weights[key] = value * 0.01
        elif key.startswith("mtp.layers.0.") and key.endswith(outputs):
            weights[key] = mx.zeros_like(value)
    hidden = hf.config.text_config.hidden_size
    weights["mtp.fc.weight"] = mx.concatenate(
        [mx.zeros((hidden, hidden)), mx.eye(hidden)], axis=1
    )
    folder = tmp_path_factory.mktemp("qwen3_5") / "echoing"
    return write_folder(folder, hf, weights)


@pytest.fixture(scope="module")
def loaded(multimodal: tuple[Any, TorchMtp, Path]) -> LoadedModel:
    _, _, folder = multimodal
    result: LoadedModel = load(str(folder)).unwrap()
    return result


def test_multimodal_folder_loads_as_its_language_model(
    multimodal: tuple[Any, TorchMtp, Path], loaded: LoadedModel
) -> None:
    support.check_language_model_of(multimodal[0], loaded, Model, "qwen3_5")


def test_mlx_conversion_names_load_the_same(
    multimodal: tuple[Any, TorchMtp, Path], loaded: LoadedModel
) -> None:
    """mlx-lm / mlx-vlm name the text model `language_model.model.*` (norms
    already +1, conv in MLX layout) and the tower `vision_tower.*`."""
    hf, _, _ = multimodal
    model = loaded.model
    assert isinstance(model, Model)
    ours_ = flat_parameters(model)
    converted = {f"language_model.{k}": v for k, v in ours_.items()} | {
        "vision_tower.patch_embed.proj.weight": mx.zeros((4, 4))
    }
    named = model.sanitize(converted)
    assert named.keys() == ours_.keys()
    assert all(named[k] is ours_[k] for k in ours_)  # passed through unchanged
    hf_named = model.sanitize(hf_weights(hf))
    assert hf_named.keys() == ours_.keys()


def test_mtp_head_of_the_checkpoint_matches_its_reference_wiring(
    multimodal: tuple[Any, TorchMtp, Path], loaded: LoadedModel
) -> None:
    hf, reference, _ = multimodal
    model = loaded.model
    assert isinstance(model, Model)
    head = build_mtp(model.hybrid, loaded.mtp).unwrap()
    assert isinstance(head, MtpHead)
    assert support.multimodal_mtp_error(hf, reference, model, head) < TOL


def test_converted_folder_reloads_with_its_mtp_companion(
    loaded: LoadedModel, tmp_path: Path
) -> None:
    out = save_folder(loaded, tmp_path / "converted").unwrap()
    again = load(str(out)).unwrap()
    assert again.args == loaded.args
    ids = token_ids((1, 9), seed=60, vocab=FOLDER_VOCAB)
    first, second = (
        step(m.model, m.model.make_cache(1), ids, [0]) for m in (loaded, again)
    )
    np.testing.assert_array_equal(first, second)
    assert (out / "mtp" / "config.json").read_text().count('"qwen3_5_mtp"') == 1


# --- lossless speculation through the public API ----------------------------

PROMPTS = ["def fibonacci(n):", "Hello world! Hello world! Hello"]
LIMITS = GenerationLimits(max_tokens=16)


def generated(pipeline: api.Pipeline, sampling: SamplingParams) -> list[Any]:
    return pipeline.generate_batch(PROMPTS, sampling, LIMITS).unwrap()


@pytest.mark.parametrize(
    "sampling", [SamplingParams(), SamplingParams(temperature=0.8, seed=3)]
)
@pytest.mark.parametrize("weights", ["random", "echoing"])
def test_speculative_output_equals_plain_output(
    multimodal: tuple[Any, TorchMtp, Path],
    echoing: Path,
    weights: str,
    sampling: SamplingParams,
) -> None:
    """Random weights: drafts are rejected (every round commits 1 position).
    Echoing weights: drafts are accepted (rounds commit several)."""
    folder = echoing if weights == "echoing" else multimodal[2]
    plain = [r.tokens for r in generated(api.load(str(folder)).unwrap(), sampling)]
    for draft in ("ngram", "mtp"):
        pipeline = api.load(str(folder), draft=draft, adaptive=False).unwrap()
        assert pipeline.draft_kind == draft
        results = generated(pipeline, sampling)
        assert [r.tokens for r in results] == plain, draft
        assert not any(r.stats.draft_errors for r in results)
        assert sum(r.stats.drafted for r in results) > 0, draft
        if weights == "echoing":
            assert sum(r.stats.accepted for r in results) > 0, draft


def test_fused_projections_equal_separate_products() -> None:
    """linear layers: 4 input projections; attention q/k/v; dense gate/up: one product each, logits unchanged bit for bit."""
    fused, difference = support.fused_logit_difference(ours(make_hf()))
    assert fused > 0
    assert difference <= same_math(0.0)  # bit for bit on the CPU
