"""The own MLX GLM-4.5 MoE (`glm4_moe`) against HF transformers.

Tiny random configs (hidden 64, 4 layers, the first dense, 8 routed experts
of 32, top-2, a shared expert; 4 query / 2 kv heads of 16, RoPE on half of
each head; vocab 128) run in float32 on the CPU. Parameters are re-drawn
after HF's init so biases, norms and the router's score correction are
non-trivial (HF initialises them to 0 / 1). Configs reach our model as real
folders do (`config.to_dict()` -> `glm4_moe_args`), weights through
`state_dict` -> `load_weights`, as an HF checkpoint would.

Also: the checkpoint layouts (per-expert names as released, transformers 5
stacked, MLX stacked), a folder with an MTP layer through the loader
(`split_mtp`), the decoder layer alone (as the MTP head will run it), MLX
affine quantization, and lossless speculative decoding on the tiny model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import torch
import transformers
from attrs import evolve
from mlx.utils import tree_unflatten
from returns.result import Failure, Success

from models.base import attention_mask, rope_offset
from models.build import build_model, load_weights, quantize_model
from models.cache import KVCache, position_mask, scatter_window
from models.fuse import fuse_projections
from models.glm4_moe import (
    DecoderLayer,
    Model,
    MoE,
    Router,
    sanitize_weights,
    split_mtp,
)
from models.layers import MLP, flat_parameters
from models.qwen3_next import QuantizedSwitchLinear
from schemas.converter import hf as hf_converter
from schemas.converter import structure, unstructure
from schemas.errors import LoadError
from schemas.hf import DecoderArgs
from schemas.hf_glm4_moe import Glm4MoeArgs, glm4_moe_args
from schemas.request import SamplingParams
from specpipe.load import load, save_folder
from tests.cli.conftest import write_tiny_model
from tests.models import hybrid_support as support
from tests.models import parity_support as parity
from tests.models.decoder_support import parsed_args
from tests.models.hybrid_support import (
    as_np,
    check_cached_decode,
    dequantized,
    forward,
    hf_logits,
    hf_weights,
    per_expert,
    redraw,
    token_ids,  # over hybrid_support's VOCAB, this module's
)
from tests.rounding import same_math

pytestmark = pytest.mark.reference

VOCAB = 128
TINY: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "moe_intermediate_size": 32,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "partial_rotary_factor": 0.5,
    "attention_bias": True,
    "max_position_embeddings": 512,
    "attn_implementation": "eager",
}
# name -> config overrides
CASES: dict[str, dict[str, Any]] = {
    # 2 groups of 4 experts, 1 kept: the group limit decides some choices
    "grouped-qk-norm": {
        "n_group": 2,
        "topk_group": 1,
        "use_qk_norm": True,
        "routed_scaling_factor": 2.5,
    },
    "one-group": {
        "n_group": 1,
        "topk_group": 1,
        "use_qk_norm": False,
        "norm_topk_prob": False,
        "n_shared_experts": 2,
    },
    "tied-quarter-rope": {
        "n_group": 4,
        "topk_group": 2,
        "use_qk_norm": True,
        "tie_word_embeddings": True,
        "head_dim": 32,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1e6,
            "partial_rotary_factor": 0.25,
        },
    },
}
TOL = 1e-4
# window-vs-one-by-one and batched-vs-alone: same math, other matmul shapes
# (a GPU's tiling rounds them apart: tests/rounding.py)
ROW_TOL = same_math(1e-5)


def make_hf(case: str = "grouped-qk-norm", seed: int = 0, **overrides: Any) -> Any:
    config = transformers.Glm4MoeConfig(**{**TINY, **CASES[case], **overrides})
    torch.manual_seed(seed)
    model = transformers.Glm4MoeForCausalLM(config).eval()
    redraw(model, seed, buffers={"e_score_correction_bias": (0.0, 0.3)})
    return model


def args_of(raw: dict[str, Any]) -> Glm4MoeArgs:
    return parsed_args(glm4_moe_args, raw)


def ours(hf: Any) -> Model:
    return support.ours(hf, Model, glm4_moe_args)


@pytest.fixture(scope="module", params=list(CASES))
def pair(request: pytest.FixtureRequest) -> tuple[Any, Model]:
    hf = make_hf(request.param)
    return hf, ours(hf)


# --- config ---------------------------------------------------------------


def test_config_reads_rope_from_both_forms_and_transformers_defaults() -> None:
    base = {
        "model_type": "glm4_moe",
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "intermediate_size": 96,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": VOCAB,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "eos_token_id": [5, 6],
        "rope_scaling": None,
    }
    legacy = args_of({**base, "rope_theta": 1e6, "partial_rotary_factor": 0.25})
    modern = args_of(
        {
            **base,
            "rope_parameters": {
                "rope_theta": 1e6,
                "rope_type": "default",
                "partial_rotary_factor": 0.25,
            },
        }
    )
    assert legacy == modern
    assert legacy.rope.theta == 1e6 and legacy.rotary_dims == 4
    assert legacy.eos_token_id == (5, 6)
    # transformers' Glm4MoeConfig defaults where the config is silent
    plain = args_of(base)
    assert plain.partial_rotary_factor == 0.5 and plain.rotary_dims == 8
    assert plain.rms_norm_eps == 1e-5
    assert plain.head_dim is None and plain.dim_per_head == 16
    assert (plain.n_group, plain.topk_group, plain.n_shared_experts) == (1, 1, 1)
    assert plain.first_k_dense_replace == 1 and plain.norm_topk_prob
    assert plain.num_nextn_predict_layers == 1
    assert args_of({**base, "num_mtp_layers": 2}).num_nextn_predict_layers == 2
    assert [plain.is_sparse(i) for i in range(5)] == [False, True, True, True, True]
    assert isinstance(plain, DecoderArgs)  # what the pipeline reads on `args`
    again = structure(hf_converter, unstructure(hf_converter, plain), Glm4MoeArgs, "x")
    assert again == Success(plain)


def test_hf_config_parses_to_what_transformers_runs() -> None:
    hf = make_hf("tied-quarter-rope")
    args = args_of(hf.config.to_dict())
    config = hf.config
    assert args.rotary_dims == 8 == int(config.head_dim * 0.25)
    assert args.rope.theta == 1e6
    assert (args.n_group, args.topk_group) == (config.n_group, config.topk_group)
    assert args.tie_word_embeddings and args.use_qk_norm


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"n_routed_experts": 8, "n_group": 3}, "n_group"),
        ({"n_routed_experts": 8, "n_group": 8}, "n_group"),
        ({"n_group": 4, "topk_group": 5}, "topk_group"),
        ({"n_group": 4, "topk_group": 1, "num_experts_per_tok": 3}, "topk_group"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ({"partial_rotary_factor": 0.1}, "partial_rotary_factor"),
    ],
)
def test_configs_it_cannot_run_are_errors_naming_the_key(
    overrides: dict[str, Any], named: str
) -> None:
    parity.check_refused_config(
        glm4_moe_args, {**TINY, "model_type": "glm4_moe", **overrides}, named
    )
    # args made in code (evolve) are refused when the model is built
    good = args_of({**TINY, "model_type": "glm4_moe"})
    built = build_model(evolve(good, **overrides))
    assert isinstance(built, Failure) and named in built.failure().message


def test_a_non_mlx_quantized_checkpoint_is_refused_naming_its_method() -> None:
    fp8 = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    raw = {**TINY, "model_type": "glm4_moe", "quantization_config": fp8}
    parsed = glm4_moe_args(raw, "cfg.json")
    assert isinstance(parsed, Failure)
    assert "'fp8'" in parsed.failure().message
    mlx = {"group_size": 64, "bits": 4}
    both = {**raw, "quantization": mlx, "quantization_config": mlx}
    assert args_of(both).quantization is not None


def test_glm4_moe_needs_glm4_moe_args() -> None:
    parity.check_needs_own_args({**TINY, "model_type": "glm4_moe"}, "Glm4MoeArgs")


# --- router ---------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_router_chooses_and_weighs_as_transformers(case: str) -> None:
    """Every token's chosen experts and their weights, over 256 tokens (the
    group limit and the score correction change some choices)."""
    hf = make_hf(case)
    reference = hf.model.layers[1].mlp.gate
    model = ours(hf)
    layer = model.model.layers[1].mlp
    assert isinstance(layer, MoE)
    x = np.random.default_rng(5).standard_normal((256, TINY["hidden_size"]))
    x = x.astype(np.float32)
    with torch.no_grad():
        _, their_weights, their_experts = reference(torch.tensor(x))
    experts, weights = layer.gate(mx.array(x))
    order = np.argsort(np.array(experts), axis=-1)
    their_order = np.argsort(their_experts.numpy(), axis=-1)
    np.testing.assert_array_equal(
        np.take_along_axis(np.array(experts), order, -1),
        np.take_along_axis(their_experts.numpy(), their_order, -1),
    )
    np.testing.assert_allclose(
        np.take_along_axis(np.array(weights), order, -1),
        np.take_along_axis(their_weights.numpy(), their_order, -1),
        rtol=1e-5,
        atol=1e-6,
    )
    if case == "grouped-qk-norm":
        # the group limit matters here: without it the choices differ
        free = Router(evolve(model.glm, n_group=1, topk_group=1))
        free.update(layer.gate.parameters())
        assert not np.array_equal(
            np.sort(np.array(free(mx.array(x))[0]), -1),
            np.sort(np.array(experts), -1),
        )


# --- parity ---------------------------------------------------------------


def test_prefill_matches_transformers(pair: tuple[Any, Model]) -> None:
    hf, model = pair
    ids = token_ids((2, 11))
    expected, out = parity.check_prefill(hf, model, ids, VOCAB, TOL)
    projected = as_np(model.project(model.final_norm(out.hidden)))
    assert np.abs(projected - expected.logits.numpy()).max() < TOL
    embedded = as_np(model.embed(mx.array(ids, dtype=mx.int32)))
    with torch.no_grad():
        their_embeds = hf.model.embed_tokens(torch.tensor(ids)).numpy()
    np.testing.assert_array_equal(embedded, their_embeds)
    parity.check_head_weights(hf, model)


def test_decode_with_cache_matches_full_sequence(pair: tuple[Any, Model]) -> None:
    hf, model = pair
    check_cached_decode(hf, model, token_ids((2, 12), seed=2), TOL, ROW_TOL)


def test_rows_at_different_offsets_match_rows_alone(pair: tuple[Any, Model]) -> None:
    hf, model = pair
    rows = token_ids((3, 12), seed=3)
    parity.check_rows_at_different_offsets(hf, model, rows, TOL, ROW_TOL)


def test_bfloat16_errs_like_transformers_bfloat16() -> None:
    """bf16 runs the CPU fallbacks of the routed experts (a float32 gather for
    the prompt, taken expert weights for one token); the router computes in
    float32. Tiny random models amplify rounding (routing flips), so the bound
    is HF's own bf16 error against float32."""
    hf = make_hf()
    args = args_of(hf.config.to_dict())
    model = build_model(args).unwrap()
    weights = {k: v.astype(mx.bfloat16) for k, v in hf_weights(hf).items()}
    assert load_weights(model, weights, args) == Success(None)
    ids = token_ids((1, 6), seed=60)
    cache = model.make_cache(1)
    assert cache.dtype == mx.bfloat16
    got = np.concatenate(
        [
            forward(model, ids[:, :5], cache, [0]),
            forward(model, ids[:, 5:], cache, [5]),
        ],
        axis=1,
    )
    exact = hf_logits(hf, ids)
    with torch.no_grad():
        theirs = make_hf().to(torch.bfloat16)(torch.tensor(ids)).logits.float().numpy()
    assert np.abs(got - exact).max() <= 1.5 * np.abs(theirs - exact).max()


def test_fused_projections_equal_separate_products() -> None:
    """attention q/k/v; dense and shared-expert gate/up: one product each,
    logits unchanged bit for bit on the CPU (to a GPU's rounding there)."""
    model = ours(make_hf())
    ids = token_ids((2, 12), seed=4)

    def logits() -> np.ndarray:
        cache = model.make_cache(2)
        head = forward(model, ids[:, :9], cache, [0, 0])
        return np.concatenate([head, forward(model, ids[:, 9:], cache, [9, 9])], axis=1)

    separate = logits()
    assert fuse_projections(model) == 4 + 4  # q/k/v per layer, gate/up per MLP
    assert np.abs(logits() - separate).max() <= same_math(0.0)


# --- the decoder layer alone (the MTP head's building block) ----------------


def test_a_decoder_layer_runs_alone_on_its_own_cache_slot() -> None:
    """Layer 2 rebuilt alone as `DecoderLayer(args, 2, kv_index=0)` on a
    one-layer cache equals the model's layer 2; `forward` with a scatter at
    device positions equals `__call__`; the MLP kind follows the index."""
    model = ours(make_hf())
    args = model.glm
    assert isinstance(DecoderLayer(args, 0).mlp, MLP)
    assert isinstance(DecoderLayer(args, args.num_hidden_layers).mlp, MoE)
    inner = model.model.layers[2]
    layer = DecoderLayer(args, 2, kv_index=0)
    assert layer.self_attn.kv_index == 0 and inner.self_attn.kv_index == 2
    layer.update(inner.parameters())

    x = mx.random.normal((2, 7, args.hidden_size), key=mx.random.key(0))
    offsets = [3, 5]
    reference_cache = model.make_cache(2)
    reference_cache.reserve(12)
    mask = attention_mask(offsets, 7, reference_cache.key_span(offsets, 7))
    expected = inner(x, reference_cache, offsets, mask, rope_offset(offsets))
    own = KVCache(1, 2, args.num_key_value_heads, args.dim_per_head, mx.float32)
    own.reserve(12)
    got = layer(x, own, offsets, mask, rope_offset(offsets))
    np.testing.assert_array_equal(as_np(got), as_np(expected))
    np.testing.assert_array_equal(as_np(own.keys[0]), as_np(reference_cache.keys[2]))

    keys, values = mx.zeros_like(own.keys[0]), mx.zeros_like(own.values[0])
    starts = mx.array(offsets, dtype=mx.int32)

    def write(k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        return scatter_window(keys, k, starts), scatter_window(values, v, starts)

    scattered = layer.forward(x, write, position_mask(starts, 7, keys.shape[2]), starts)
    assert np.abs(as_np(scattered) - as_np(expected)).max() < ROW_TOL


# --- weights --------------------------------------------------------------


def test_checkpoint_expert_layouts_load_the_same() -> None:
    hf = make_hf()
    model = ours(hf)
    stacked = model.sanitize(hf_weights(hf))
    listed = model.sanitize(per_expert(hf_weights(hf)))
    assert stacked.keys() == listed.keys() == flat_parameters(model).keys()
    for key in stacked:
        np.testing.assert_array_equal(as_np(stacked[key]), as_np(listed[key]), key)
    assert "model.layers.1.mlp.switch_mlp.gate_proj.weight" in stacked
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in stacked
    # the MLX layout (what sanitize produced) passes through unchanged
    again = sanitize_weights(stacked, model.glm.n_routed_experts)
    assert all(again[k] is stacked[k] for k in stacked)


def test_missing_expert_is_a_load_error_naming_it() -> None:
    hf = make_hf()
    args = args_of(hf.config.to_dict())
    weights = per_expert(hf_weights(hf))
    del weights["model.layers.2.mlp.experts.5.up_proj.weight"]
    result = load_weights(build_model(args).unwrap(), weights, args)
    assert isinstance(result, Failure) and isinstance(result.failure(), LoadError)
    message = result.failure().message
    assert "model.layers.2.mlp.experts.0.up_proj.weight" in message  # unstacked
    assert "model.layers.2.mlp.switch_mlp.up_proj.weight" in message  # missing


MTP_ONLY = (
    "eh_proj.weight",
    "enorm.weight",
    "hnorm.weight",
    "shared_head.norm.weight",
    "shared_head.head.weight",
)


def write_glm_folder(folder: Path, hf: Any, mtp_source: Any) -> None:
    """An HF-layout folder as GLM-4.5 ships: per-expert names, and an MTP
    layer `model.layers.{N}.*` (a decoder layer's weights, taken from layer
    N of `mtp_source`, a model one layer deeper, plus the MTP-only weights)."""
    write_tiny_model(folder)  # tokenizer files (config and weights replaced)
    n = hf.config.num_hidden_layers
    config = {**hf.config.to_dict(), "architectures": ["Glm4MoeForCausalLM"]}
    (folder / "config.json").write_text(json.dumps(config))
    weights = per_expert(hf_weights(hf))
    prefix = f"model.layers.{n}."
    layer = {
        k: v
        for k, v in per_expert(hf_weights(mtp_source)).items()
        if k.startswith(prefix)
    }
    hidden, vocab = hf.config.hidden_size, hf.config.vocab_size
    rng = np.random.default_rng(9)
    extra = {
        "eh_proj.weight": rng.standard_normal((hidden, 2 * hidden)),
        "enorm.weight": 1 + 0.1 * rng.standard_normal(hidden),
        "hnorm.weight": 1 + 0.1 * rng.standard_normal(hidden),
        "shared_head.norm.weight": 1 + 0.1 * rng.standard_normal(hidden),
        "shared_head.head.weight": rng.standard_normal((vocab, hidden)),
    }
    layer.update({prefix + k: mx.array(v.astype(np.float32)) for k, v in extra.items()})
    assert set(MTP_ONLY) == set(extra)
    mx.save_safetensors(str(folder / "model.safetensors"), {**weights, **layer})


@pytest.fixture(scope="module")
def glm_folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    vocab = 320  # the tiny tokenizer's ids fit
    hf = make_hf(vocab_size=vocab)
    deeper = make_hf(seed=1, vocab_size=vocab, num_hidden_layers=5)
    folder = tmp_path_factory.mktemp("glm") / "target"
    write_glm_folder(folder, hf, deeper)
    return folder, hf


def test_an_hf_folder_with_an_mtp_layer_loads_and_splits_it(
    glm_folder: tuple[Path, Any],
) -> None:
    folder, hf = glm_folder
    loaded = load(str(folder)).unwrap()
    model = loaded.model
    assert isinstance(model, Model) and isinstance(loaded.args, Glm4MoeArgs)
    assert model.padding_safe
    ids = token_ids((2, 9), seed=7, vocab=320)
    got = forward(model, ids, model.make_cache(2), [0, 0])
    assert np.abs(got - hf_logits(hf, ids)).max() < TOL

    checkpoint = dict(mx.load(str(folder / "model.safetensors")))
    n = loaded.args.num_hidden_layers
    assert any(k.startswith(f"model.layers.{n}.mlp.experts.0.") for k in checkpoint)
    main, mtp = model.split_mtp(checkpoint)
    assert main.keys() == flat_parameters(model).keys()
    # the MTP layer: a DecoderLayer(args, N)'s weights (experts stacked) and
    # the MTP-only ones, the `model.layers.{N}.` prefix removed
    layer = DecoderLayer(model.glm, n, kv_index=0)
    own = flat_parameters(layer)
    assert mtp.keys() == own.keys() | set(MTP_ONLY)
    assert "mlp.switch_mlp.gate_proj.weight" in mtp
    assert "mlp.gate.e_score_correction_bias" in mtp
    for key, value in own.items():
        assert mtp[key].shape == value.shape, key
    layer.update(tree_unflatten([(k, mtp[k]) for k in own]))
    assert split_mtp(checkpoint, model.glm)[1].keys() == mtp.keys()
    np.testing.assert_array_equal(
        as_np(mtp["mlp.switch_mlp.down_proj.weight"][3]),
        as_np(checkpoint[f"model.layers.{n}.mlp.experts.3.down_proj.weight"]),
    )
    # an MLX conversion without the MTP layer: nothing to split
    rest, none = model.split_mtp(main)
    assert rest.keys() == main.keys() and none == {}


def test_a_4bit_conversion_computes_its_dequantized_weights_and_reloads(
    glm_folder: tuple[Path, Any], tmp_path: Path
) -> None:
    """`convert --quantize 4`: linear layers and stacked experts quantized
    (group 32), the router and norms float; the converted folder (MLX
    layout, upstream config) loads and computes the same logits; a float
    model holding the dequantized weights computes them too."""
    folder, _ = glm_folder
    loaded = load(str(folder)).unwrap()
    out = save_folder(loaded, tmp_path / "q4", quantize=4, group_size=32).unwrap()
    model = loaded.model
    assert isinstance(model, Model)
    moe = model.model.layers[1].mlp
    assert isinstance(moe, MoE)
    assert isinstance(moe.switch_mlp.gate_proj, QuantizedSwitchLinear)
    assert isinstance(moe.shared_experts, MLP)
    assert isinstance(moe.shared_experts.up_proj, nn.QuantizedLinear)
    assert moe.gate.weight.dtype == mx.float32
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "glm4_moe"
    assert config["quantization"] == {"group_size": 32, "bits": 4}
    assert config["n_group"] == 2
    assert config["rope_parameters"]["partial_rotary_factor"] == 0.5

    ids = token_ids((2, 9), seed=8, vocab=320)
    quantized = forward(model, ids, model.make_cache(2), [0, 0])
    again = load(str(out)).unwrap().model
    np.testing.assert_array_equal(
        forward(again, ids, again.make_cache(2), [0, 0]), quantized
    )

    saved = flat_parameters(model)
    assert "model.layers.1.mlp.switch_mlp.gate_proj.scales" in saved
    assert "model.layers.1.mlp.gate.scales" not in saved
    float_args = evolve(model.glm, quantization=None)
    simulated = build_model(float_args).unwrap()
    assert load_weights(simulated, dequantized(saved, 32), float_args) == Success(None)
    expected = forward(simulated, ids, simulated.make_cache(2), [0, 0])
    assert np.abs(expected - quantized).max() < TOL


def test_in_memory_quantization_keeps_the_router_float() -> None:
    model = ours(make_hf())
    quantize_model(model, bits=4, group_size=32)
    moe = model.model.layers[3].mlp
    assert isinstance(moe, MoE) and isinstance(moe.gate, Router)
    assert isinstance(moe.switch_mlp.down_proj, QuantizedSwitchLinear)
    ids = token_ids((1, 6), seed=9)
    fresh = build_model(model.args).unwrap()
    assert load_weights(fresh, flat_parameters(model), model.args) == Success(None)
    np.testing.assert_array_equal(
        forward(fresh, ids, fresh.make_cache(1), [0]),
        forward(model, ids, model.make_cache(1), [0]),
    )


# --- lossless speculative decoding ------------------------------------------


def tiny_glm(seed: int = 1, gain: float = 2.5) -> Model:
    """Random weights, every matrix scaled by `gain` (varied greedy output,
    peaked but not one-hot sampling), as tests/specpipe/spec_support.py does."""
    args = args_of({**TINY, **CASES["grouped-qk-norm"], "model_type": "glm4_moe"})
    return parity.scaled_model(args, Model, seed, gain)


@pytest.fixture(scope="module")
def glm() -> Model:
    return tiny_glm()


@pytest.fixture(scope="module")
def glm_4bit() -> Model:
    """Its experts and projections at 4 bits: on the CPU the experts' products
    run on the affine kernel (`cpu_kernel.affine_gather_product`)."""
    model = tiny_glm()
    quantize_model(model, bits=4, group_size=32)
    return model


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(),
        SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=3),
    ],
    ids=["greedy", "sampled"],
)
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("form", ["glm", "glm_4bit"])
def test_ngram_speculation_equals_plain_decoding(
    request: pytest.FixtureRequest, form: str, sampling: SamplingParams, batch: int
) -> None:
    glm: Model = request.getfixturevalue(form)
    for r in parity.check_ngram_speculation(glm, batch, sampling, max_tokens=20):
        assert r.metrics.accepted <= r.metrics.drafted
