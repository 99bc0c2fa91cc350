"""The own MLX Qwen3.5 MoE (hybrid attention + GatedDeltaNet with split
projections + a sparse MoE block with shared expert in every layer) against
HF transformers, its config and checkpoint forms, its MoE MTP head, and
lossless speculation through the public API.

Tiny random models in float32 on the CPU (the layout of
tests/models/hybrid_support.py: 4 layers, linear / full / linear / full
attention, 4 experts top-2 plus a shared expert):
- `Qwen3_5MoeForCausalLM` (the text form, `qwen3_5_moe_text`, untied head,
  vocab 128) for parity and the recurrent state's per-position commit; its
  state dict carries the experts fused (`mlp.experts.gate_up_proj`);
- the same with vocab 320, saved by `save_pretrained` (which writes the
  experts per expert, the released checkpoints' form) and loaded through
  `specpipe.load.load`;
- `Qwen3_5MoeForConditionalGeneration` (the multimodal form, `qwen3_5_moe`,
  one-block vision tower, tied head, vocab 320), saved by `save_pretrained`
  plus an `mtp.*` head with an MoE layer in a second safetensors file.
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
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf_moe

from models.build import build_model, load_weights
from models.layers import flat_parameters
from models.mtp import build_mtp
from models.qwen3_5_moe import Model
from models.qwen3_next import PER_POSITION_MAX, SparseMoeBlock, SwitchGLU
from schemas.converter import hf as hf_converter
from schemas.converter import structure, unstructure
from schemas.hf_hybrid import HybridArgs, hybrid_args
from schemas.request import GenerationLimits, SamplingParams
from specpipe import api
from specpipe.load import LoadedModel, load
from tests.cli.conftest import write_tiny_model
from tests.models import hybrid_support as support
from tests.models.hybrid_support import (
    FOLDER_VOCAB,
    TOL,
    VISION,
    VOCAB,
    TorchMtp,
    as_np,
    hf_logits,
    hf_weights,
    mtp_weights,
    per_expert,
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
    **support.EXPERTS,
    "rope_parameters": support.QWEN3_5_ROPE,
}


def text_config(**overrides: Any) -> Any:
    settings: dict[str, Any] = {**TEXT, **overrides, "attn_implementation": "eager"}
    return transformers.Qwen3_5MoeTextConfig(**settings)


def make_hf(seed: int = 0, **overrides: Any) -> Any:
    torch.manual_seed(seed)
    model: Any = transformers.Qwen3_5MoeForCausalLM(text_config(**overrides))
    randomize(model, seed)
    return model.eval()


def wrapper_config(**text: Any) -> Any:
    return transformers.Qwen3_5MoeConfig(
        text_config={**TEXT, **text}, vision_config=VISION, tie_word_embeddings=True
    )


def make_multimodal(seed: int = 3) -> Any:
    config: Any = wrapper_config(vocab_size=FOLDER_VOCAB)
    config.text_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model: Any = transformers.Qwen3_5MoeForConditionalGeneration(config)
    randomize(model, seed)
    return model.eval()


def torch_mtp(config: Any) -> TorchMtp:
    """The head's reference wiring (vLLM's `Qwen3_5MultiTokenPredictor`): its
    layer is a full-attention `Qwen3_5MoeDecoderLayer`, MoE block included."""
    return TorchMtp(
        config,
        hf_moe.Qwen3_5MoeRMSNorm,
        hf_moe.Qwen3_5MoeDecoderLayer,
        hf_moe.Qwen3_5MoeTextRotaryEmbedding,
    )


@pytest.fixture(scope="module")
def pair() -> tuple[Any, Model]:
    hf = make_hf()
    model: Model = support.ours(hf, Model)
    return hf, model


# --- config ---------------------------------------------------------------


def test_text_and_multimodal_configs_parse_to_the_same_text_model() -> None:
    text = text_config(eos_token_id=[5, 6]).to_dict()
    wrapper = wrapper_config(mtp_num_hidden_layers=2).to_dict()
    wrapper["eos_token_id"] = 7  # on the wrapper only: fills the text's gap
    a = hybrid_args(text, "text").unwrap()
    b = hybrid_args(wrapper, "wrapper").unwrap()
    assert (a.model_type, b.model_type) == ("qwen3_5_moe_text", "qwen3_5_moe")
    for args in (a, b):
        assert (args.num_experts, args.num_experts_per_tok) == (4, 2)
        assert (args.moe_intermediate_size, args.shared_expert_intermediate_size) == (
            32,
            48,
        )
        assert all(args.is_sparse(i) for i in range(args.num_hidden_layers))
        assert args.norm_topk_prob  # transformers' router always renormalises
        assert args.intermediate_size == 0  # no dense MLP anywhere
        assert args.rope.theta == 1e6 and args.rope.rope_type == "default"
        assert args.rotary_dims == 8  # head_dim 16 * partial_rotary_factor 0.5
        assert args.attention_layers == (1, 3)
    assert (a.tie_word_embeddings, b.tie_word_embeddings) == (False, True)
    assert (a.eos_token_id, b.eos_token_id) == ((5, 6), (7,))
    assert (a.num_nextn_predict_layers, b.num_nextn_predict_layers) == (1, 2)
    for args in (a, b):
        again = structure(
            hf_converter, unstructure(hf_converter, args), HybridArgs, "x"
        )
        assert again == Success(args)


def test_config_defaults_are_transformers_and_dense_keys_are_ignored() -> None:
    """Omitted keys take Qwen3_5MoeTextConfig's defaults (256 experts, top-8,
    every 4th layer attention); keys transformers deletes for this model
    (`mlp_only_layers`, `decoder_sparse_step`, `norm_topk_prob`) change
    nothing."""
    raw: dict[str, Any] = {
        "model_type": "qwen3_5_moe_text",
        "hidden_size": 64,
        "num_hidden_layers": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": VOCAB,
    }
    args = hybrid_args(raw, "cfg").unwrap()
    reference = transformers.Qwen3_5MoeTextConfig(
        **{k: v for k, v in raw.items() if k != "model_type"}
    )
    assert (args.num_experts, args.num_experts_per_tok) == (
        reference.num_experts,
        reference.num_experts_per_tok,
    )
    assert (args.moe_intermediate_size, args.shared_expert_intermediate_size) == (
        reference.moe_intermediate_size,
        reference.shared_expert_intermediate_size,
    )
    assert list(args.layer_types) == reference.layer_types
    assert (args.head_dim, args.rotary_dims) == (256, 64)
    assert not hasattr(reference, "mlp_only_layers")
    ignored = {
        **raw,
        "mlp_only_layers": [1],
        "decoder_sparse_step": 2,
        "norm_topk_prob": False,
    }
    assert hybrid_args(ignored, "cfg").unwrap() == args


@pytest.mark.parametrize("form", ["text", "wrapper"])
def test_missing_required_key_is_a_config_error_naming_it(form: str) -> None:
    settings = {k: v for k, v in TEXT.items() if k != "hidden_size"}
    raw = (
        {**settings, "model_type": "qwen3_5_moe_text"}
        if form == "text"
        else {"model_type": "qwen3_5_moe", "text_config": settings}
    )
    result = hybrid_args(raw, "cfg")
    assert isinstance(result, Failure)
    assert "hidden_size" in result.failure().message


def test_qwen3_5_moe_needs_experts_in_every_layer(pair: tuple[Any, Model]) -> None:
    _, model = pair
    for args in (
        evolve(model.hybrid, num_experts=0),
        evolve(model.hybrid, mlp_only_layers=(2,)),
    ):
        result = build_model(args)
        assert isinstance(result, Failure)
        assert "every layer" in result.failure().message


# --- parity ---------------------------------------------------------------


def test_every_layer_is_a_sparse_moe_block(pair: tuple[Any, Model]) -> None:
    _, model = pair
    assert model.padding_safe is False
    assert all(isinstance(layer.mlp, SparseMoeBlock) for layer in model.model.layers)


def test_prefill_matches_transformers(pair: tuple[Any, Model]) -> None:
    hf, model = pair
    assert support.prefill_error(hf, model) < TOL


@pytest.mark.parametrize("prompt", [6, PER_POSITION_MAX + 6])
def test_prefill_then_decode_matches_full_sequence(
    pair: tuple[Any, Model], prompt: int
) -> None:
    """Past PER_POSITION_MAX the prefill keeps only its final state (and runs
    the chunked rule and the expert-sorted MoE path)."""
    hf, model = pair
    assert max(support.prefill_then_decode_errors(hf, model, prompt)) < TOL


# --- checkpoint forms -------------------------------------------------------


def test_fused_per_expert_and_mlx_expert_names_load_the_same(
    pair: tuple[Any, Model],
) -> None:
    """transformers' fused experts, the released per-expert names, and MLX
    conversions (`language_model.model.*`, stacked `switch_mlp`, norms +1,
    conv in MLX layout) all sanitize to the same weights."""
    hf, model = pair
    fused = hf_weights(hf)
    assert "model.layers.0.mlp.experts.gate_up_proj" in fused
    ours_ = flat_parameters(model)
    assert "model.layers.0.mlp.switch_mlp.gate_proj.weight" in ours_
    for named in (
        model.sanitize(fused),
        model.sanitize(per_expert(fused)),
        model.sanitize({f"language_model.{k}": v for k, v in ours_.items()}),
        model.sanitize({multimodal_name(k): v for k, v in fused.items()}),
    ):
        assert named.keys() == ours_.keys()
        for key in ours_:
            assert np.array_equal(as_np(named[key]), as_np(ours_[key])), key


def test_loaded_weights_are_row_major(pair: tuple[Any, Model]) -> None:
    """The halves of transformers' fused `gate_up_proj` are strided views
    after sanitizing; the loader copies them row-major (MLX's CUDA grouped
    expert product misread them: models.build.row_major)."""
    hf, model = pair
    sanitized = model.sanitize(hf_weights(hf))
    gate = sanitized["model.layers.0.mlp.switch_mlp.gate_proj.weight"]
    mx.eval(gate)
    assert not memoryview(gate).c_contiguous  # what the loader is given
    support.assert_row_major(model)


def multimodal_name(key: str) -> str:
    """A text-form HF name as `Qwen3_5MoeForConditionalGeneration` has it."""
    if key.startswith("model."):
        return "model.language_model." + key[len("model.") :]
    return key


def test_a_missing_expert_is_a_load_error_naming_it(pair: tuple[Any, Model]) -> None:
    hf, model = pair
    weights = per_expert(hf_weights(hf))
    del weights["model.layers.1.mlp.experts.3.up_proj.weight"]
    result = load_weights(model, weights, model.args)
    assert isinstance(result, Failure)
    message = result.failure().message
    # the stacked projection is missing; the other experts stay unstacked
    assert "model.layers.1.mlp.switch_mlp.up_proj.weight" in message
    assert "model.layers.1.mlp.experts.0.up_proj.weight" in message


def saved(folder: Path, hf: Any, extra: dict[str, mx.array] | None = None) -> Path:
    """An HF folder: the tiny tokenizer, then `save_pretrained` (config.json
    and model.safetensors replaced), plus `extra` weights in a second file."""
    write_tiny_model(folder, vocab=FOLDER_VOCAB)
    hf.save_pretrained(folder)
    if extra:
        mx.save_safetensors(str(folder / "mtp.safetensors"), extra)
    return folder


def test_text_folder_saved_by_transformers_loads(tmp_path: Path) -> None:
    hf = make_hf(seed=5, vocab_size=FOLDER_VOCAB)
    loaded = load(str(saved(tmp_path / "text", hf))).unwrap()
    model = loaded.model
    assert isinstance(model, Model)
    assert loaded.args.model_type == "qwen3_5_moe_text"
    assert not loaded.mtp
    ids = token_ids((2, 11), seed=30, vocab=FOLDER_VOCAB)
    logits = step(model, model.make_cache(2), ids, [0, 0])
    assert np.abs(logits - hf_logits(hf, ids)).max() < TOL


@pytest.fixture(scope="module")
def multimodal(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Any, TorchMtp, Path]:
    """The multimodal HF model, its MTP reference (experts per expert, as
    released), and a folder of both."""
    hf = make_multimodal()
    reference = torch_mtp(hf.config.text_config)
    randomize(reference, seed=7)
    reference.eval()
    folder = tmp_path_factory.mktemp("qwen3_5_moe") / "random"
    return hf, reference, saved(folder, hf, per_expert(mtp_weights(reference)))


@pytest.fixture(scope="module")
def loaded(multimodal: tuple[Any, TorchMtp, Path]) -> LoadedModel:
    result: LoadedModel = load(str(multimodal[2])).unwrap()
    return result


def test_multimodal_folder_loads_as_its_language_model(
    multimodal: tuple[Any, TorchMtp, Path], loaded: LoadedModel
) -> None:
    support.check_language_model_of(multimodal[0], loaded, Model, "qwen3_5_moe")


def test_mtp_head_has_an_moe_layer_matching_its_reference_wiring(
    multimodal: tuple[Any, TorchMtp, Path], loaded: LoadedModel
) -> None:
    hf, reference, _ = multimodal
    model = loaded.model
    assert isinstance(model, Model)
    head = build_mtp(model.hybrid, loaded.mtp).unwrap()
    support.assert_row_major(head)  # its experts too (models.mtp.build_mtp)
    moe = head.layers[0].mlp
    assert isinstance(moe, SparseMoeBlock) and isinstance(moe.switch_mlp, SwitchGLU)
    assert support.multimodal_mtp_error(hf, reference, model, head) < TOL


# --- lossless speculation through the public API ----------------------------


@pytest.mark.parametrize(
    "sampling", [SamplingParams(), SamplingParams(temperature=0.8, seed=3)]
)
def test_speculative_output_equals_plain_output(
    multimodal: tuple[Any, TorchMtp, Path], sampling: SamplingParams
) -> None:
    folder = str(multimodal[2])
    prompts = ["def fibonacci(n):", "Hello world! Hello world! Hello"]
    limits = GenerationLimits(max_tokens=12)
    plain = api.load(folder).unwrap().generate_batch(prompts, sampling, limits)
    pipeline = api.load(folder, draft="mtp", adaptive=False).unwrap()
    assert pipeline.draft_kind == "mtp"
    results = pipeline.generate_batch(prompts, sampling, limits).unwrap()
    assert [r.tokens for r in results] == [r.tokens for r in plain.unwrap()]
    assert not any(r.stats.draft_errors for r in results)
    assert sum(r.stats.drafted for r in results) > 0


def test_fused_projections_equal_separate_products() -> None:
    """Split linear-layer projections, attention q/k/v and the shared expert's
    gate/up: one product each, logits unchanged bit for bit."""
    model: Model = support.ours(make_hf(), Model)
    fused, difference = support.fused_logit_difference(model)
    assert fused > 0
    assert difference <= same_math(0.0)  # bit for bit on the CPU
