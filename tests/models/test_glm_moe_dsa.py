"""The own MLX GLM-5 (`glm_moe_dsa`) against HF transformers.

Tiny random configs (hidden 64, 4 layers, 4 heads; MLA with q rank 32, kv
rank 16, 8 + 8 query/key dims per head, values of 12; an indexer of 8 heads
of 16; 8 routed experts of 32, top-2, a shared expert; vocab 128) run in
float32 on the CPU with eager attention. Parameters are re-drawn after HF's
init so biases, norms and the router's score correction are non-trivial (HF
initialises them to 0 / 1). Configs reach our model as real folders do
(`config.to_dict()` -> `glm_moe_dsa_args`), weights through `state_dict` ->
`load_weights`, as an HF checkpoint would.

The cases: every layer "full" with `index_topk` above any context (the
selection keeps every position) and a dense-then-MoE mix with groups;
`index_topk` 4 with "full" and "shared" layers alternating (the selection
drops positions); `index_topk` 3 from an `index_topk_pattern`, explicit
`mlp_layer_types`, attention biases and a tied head. Also: the cache layout,
the checkpoint layouts (per-expert names, an MTP layer split off), a folder
through the loader (q_a / kv_a fused into one product; its MTP layer, named
as transformers names a decoder layer, kept for the native draft) and a
4-bit conversion (the MTP layer as a 4-bit `mtp/` companion), configs it
cannot run, and
lossless speculative decoding with sparse selection in the verify windows.
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
from returns.result import Failure, Success

from models.build import build_model, load_weights
from models.glm4_moe import MoE
from models.glm_moe_dsa import DecoderLayer, Indexer, Model
from models.layers import MLP, flat_parameters
from schemas.converter import hf as hf_converter
from schemas.converter import structure, unstructure
from schemas.errors import ConfigError
from schemas.hf import DecoderArgs
from schemas.hf_glm_moe_dsa import GlmMoeDsaArgs, glm_moe_dsa_args
from schemas.request import SamplingParams
from specpipe.load import load, save_folder
from tests.cli.conftest import write_tiny_model
from tests.models import hybrid_support as support
from tests.models import parity_support as parity
from tests.models.decoder_support import parsed_args
from tests.models.hybrid_support import (
    as_np,
    check_cached_decode,
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
    "num_key_value_heads": 4,
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8,
    "v_head_dim": 12,
    "index_head_dim": 16,
    "index_n_heads": 8,
    "moe_intermediate_size": 32,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "max_position_embeddings": 512,
    "attn_implementation": "eager",
}
# name -> config overrides
CASES: dict[str, dict[str, Any]] = {
    # the selection keeps every position; 2 dense layers, then MoE with 2
    # groups of 4 experts, 1 kept (the group limit decides some choices)
    "dense-selection-grouped": {
        "index_topk": 2048,
        "first_k_dense_replace": 2,
        "n_group": 2,
        "topk_group": 1,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e4},
    },
    # 4 of up to 12 positions per query; layers full, shared, full, shared
    "sparse-shared": {
        "index_topk": 4,
        "index_topk_freq": 2,
        "index_skip_topk_offset": 1,
        "first_k_dense_replace": 1,
        "n_group": 4,
        "topk_group": 2,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
    },
    # 3 positions; full, shared, shared, full; MoE, dense, MoE, dense
    "pattern-bias-tied": {
        "index_topk": 3,
        "index_topk_pattern": "FSSF",
        "mlp_layer_types": ["sparse", "dense", "sparse", "dense"],
        "attention_bias": True,
        "tie_word_embeddings": True,
        "norm_topk_prob": False,
        "routed_scaling_factor": 1.5,
    },
}
TOL = 1e-4
# window-vs-one-by-one and batched-vs-alone: same math, other matmul shapes
# (a GPU's tiling rounds them apart: tests/rounding.py)
ROW_TOL = same_math(1e-5)


def make_hf(case: str = "sparse-shared", seed: int = 0, **overrides: Any) -> Any:
    config = transformers.GlmMoeDsaConfig(**{**TINY, **CASES[case], **overrides})
    torch.manual_seed(seed)
    model = transformers.GlmMoeDsaForCausalLM(config).eval()
    redraw(model, seed, buffers={"e_score_correction_bias": (0.0, 0.3)})
    return model


def args_of(raw: dict[str, Any]) -> GlmMoeDsaArgs:
    return parsed_args(glm_moe_dsa_args, raw)


def ours(hf: Any) -> Model:
    return support.ours(hf, Model, glm_moe_dsa_args)


@pytest.fixture(scope="module", params=list(CASES))
def pair(request: pytest.FixtureRequest) -> tuple[Any, Model]:
    hf = make_hf(request.param)
    return hf, ours(hf)


# --- config ---------------------------------------------------------------


def test_config_derives_the_layer_lists_as_transformers_does() -> None:
    for overrides in (
        {},
        {"index_topk_freq": 2, "index_skip_topk_offset": 1},
        {"index_topk_freq": 3, "index_skip_topk_offset": 2, "num_hidden_layers": 9},
        {"index_topk_pattern": "FSSF"},
        {"indexer_types": ["full", "full", "shared", "full"]},
        {"first_k_dense_replace": 7},
        {"mlp_layer_types": ["dense", "sparse", "dense", "sparse"]},
    ):
        config = transformers.GlmMoeDsaConfig(**{**TINY, **overrides})
        # the HF dict (derived lists included) and the raw keys alone
        raw = {"model_type": "glm_moe_dsa", **TINY, **overrides}
        for given in (config.to_dict(), raw):
            args = args_of(given)
            layers = config.num_hidden_layers
            assert args.indexer_types == tuple(config.indexer_types), overrides
            assert [args.runs_indexer(i) for i in range(layers)] == [
                kind == "full" for kind in config.indexer_types
            ]
            assert [args.is_sparse(i) for i in range(layers)] == [
                kind == "sparse" for kind in config.mlp_layer_types
            ], overrides
    # transformers' defaults (GLM-5's sizes) where the config is silent
    plain = args_of({"model_type": "glm_moe_dsa"})
    assert (plain.hidden_size, plain.num_hidden_layers, plain.vocab_size) == (
        6144,
        78,
        154880,
    )
    assert (plain.q_lora_rank, plain.kv_lora_rank, plain.v_head_dim) == (2048, 512, 256)
    assert (plain.qk_nope_head_dim, plain.qk_rope_head_dim) == (192, 64)
    assert (plain.index_topk, plain.index_head_dim, plain.index_n_heads) == (
        2048,
        128,
        32,
    )
    assert (plain.n_routed_experts, plain.moe_intermediate_size) == (256, 2048)
    assert plain.routed_scaling_factor == 2.5 and plain.rms_norm_eps == 1e-5
    assert plain.first_k_dense_replace == 3 and plain.is_sparse(3)
    assert not plain.is_sparse(2) and plain.is_sparse(78)  # the MTP layer: MoE
    assert all(plain.runs_indexer(i) for i in range(78))
    assert plain.latent_dim == 576 and plain.qk_head_dim == 256
    assert isinstance(plain, DecoderArgs)  # what the pipeline reads on `args`
    again = structure(
        hf_converter, unstructure(hf_converter, plain), GlmMoeDsaArgs, "x"
    )
    assert again == Success(plain)


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"q_lora_rank": None}, "q_lora_rank"),
        ({"index_head_dim": 32}, "index_head_dim"),  # > kv rank 16 + rope 8
        ({"qk_rope_head_dim": 7}, "qk_rope_head_dim"),
        ({"index_topk": 0}, "index_topk"),
        ({"indexer_types": ["shared", "full", "full", "full"]}, "indexer_types"),
        ({"indexer_types": ["full", "full"]}, "indexer_types"),
        ({"index_topk_pattern": "FXFF"}, "indexer_types"),
        ({"mlp_layer_types": ["dense", "moe", "dense", "dense"]}, "mlp_layer_types"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_type"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_type"),
        ({"n_group": 3}, "n_group"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_configs_it_cannot_run_are_errors_naming_the_key(
    overrides: dict[str, Any], named: str
) -> None:
    raw = {**TINY, "model_type": "glm_moe_dsa", **overrides}
    parity.check_refused_config(glm_moe_dsa_args, raw, named)


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"index_head_dim": 25}, "index_head_dim"),
        ({"indexer_types": ("shared", "full", "full", "full")}, "indexer_types"),
        ({"q_lora_rank": 0}, "q_lora_rank"),
        ({"n_group": 3}, "n_group"),
    ],
)
def test_args_made_in_code_are_refused_when_the_model_is_built(
    overrides: dict[str, Any], named: str
) -> None:
    good = args_of({**TINY, "model_type": "glm_moe_dsa"})
    built = build_model(evolve(good, **overrides))
    assert isinstance(built, Failure) and isinstance(built.failure(), ConfigError)
    assert named in built.failure().message


def test_a_non_mlx_quantized_checkpoint_and_foreign_args_are_refused() -> None:
    fp8 = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    raw = {**TINY, "model_type": "glm_moe_dsa", "quantization_config": fp8}
    parsed = glm_moe_dsa_args(raw, "cfg.json")
    assert isinstance(parsed, Failure) and "'fp8'" in parsed.failure().message
    parity.check_needs_own_args({**TINY, "model_type": "glm_moe_dsa"}, "GlmMoeDsaArgs")


# --- parity ---------------------------------------------------------------


def test_prefill_matches_transformers(pair: tuple[Any, Model]) -> None:
    hf, model = pair
    parity.check_prefill(hf, model, token_ids((2, 12)), VOCAB, TOL)
    kinds = [
        "sparse" if isinstance(x.mlp, MoE) else "dense" for x in model.model.layers
    ]
    assert kinds == hf.config.mlp_layer_types
    parity.check_head_weights(hf, model)


def test_decode_with_cache_matches_full_sequence(pair: tuple[Any, Model]) -> None:
    hf, model = pair
    check_cached_decode(hf, model, token_ids((2, 12), seed=2), TOL, ROW_TOL)


def test_rows_at_different_offsets_match_rows_alone(pair: tuple[Any, Model]) -> None:
    """The junk a shorter row's prefill writes past its length is latents."""
    hf, model = pair
    rows = token_ids((3, 12), seed=3)
    parity.check_rows_at_different_offsets(hf, model, rows, TOL, ROW_TOL)


def test_sparse_selection_drops_positions_as_transformers_does() -> None:
    """With index_topk 4 of up to 12 positions the logits differ from the
    same weights attending everywhere, in transformers and here alike; a full
    layer's indexer keeps min(4, position + 1) positions per query, causal."""
    hf = make_hf("sparse-shared")
    model = ours(hf)
    assert model.glm.indexer_types == ("full", "shared", "full", "shared")
    ids = token_ids((2, 12), seed=4)
    sparse = forward(model, ids, model.make_cache(2), [0, 0])
    expected = hf_logits(hf, ids)
    assert np.abs(sparse - expected).max() < TOL

    everywhere = make_hf("sparse-shared", index_topk=2048)
    dense = forward(ours(everywhere), ids, model.make_cache(2), [0, 0])
    assert np.abs(dense - hf_logits(everywhere, ids)).max() < TOL
    assert np.abs(dense[:, 4:] - sparse[:, 4:]).max() > 100 * TOL
    # up to 4 positions there is nothing to drop
    assert np.abs(dense[:, :4] - sparse[:, :4]).max() < ROW_TOL

    attention = model.model.layers[0].self_attn
    indexer = attention.indexer
    assert isinstance(indexer, Indexer)
    assert model.model.layers[1].self_attn.indexer is None
    x = mx.random.normal((2, 12, TINY["hidden_size"]), key=mx.random.key(1))
    q_resid = mx.random.normal((2, 12, TINY["q_lora_rank"]), key=mx.random.key(2))
    keys = indexer.key_window(x, attention.rope, 0)
    causal = mx.arange(12)[None, None, None, :] <= mx.arange(12)[None, None, :, None]
    chosen = np.array(indexer.select(x, q_resid, keys, causal, attention.rope, 0))
    assert chosen.shape == (2, 1, 12, 12)
    assert not np.any(chosen & ~np.array(causal))
    kept = chosen.sum(axis=-1)[:, 0]  # [B, L]
    np.testing.assert_array_equal(
        kept, np.tile(np.minimum(4, np.arange(12) + 1), (2, 1))
    )


def test_a_shared_layer_without_a_selection_is_an_error() -> None:
    model = ours(make_hf("sparse-shared"))
    cache = model.make_cache(1)
    cache.reserve(6)
    x = mx.zeros((1, 6, TINY["hidden_size"]))
    layer = model.model.layers[1]
    assert isinstance(layer, DecoderLayer)
    with pytest.raises(ValueError, match="indexer_types"):
        layer(x, cache, [0], "causal", 0)
    # a full layer runs alone
    assert model.model.layers[0](x, cache, [0], "causal", 0).shape == x.shape


def test_the_cache_holds_latents_and_indexer_keys() -> None:
    """One head per layer of kv_lora_rank + qk_rope_head_dim: keys the normed
    latent (transformers' kv_a_layernorm output) then the rotated key part;
    values the indexer key, zero-padded (all zeros on a shared layer). RoPE
    at position 0 is the identity: there the whole indexer key and rotated
    part equal transformers' unrotated ones."""
    hf = make_hf("sparse-shared")
    model = ours(hf)
    args = model.glm
    cache = model.make_cache(2)
    assert (cache.kv_heads, cache.head_dim) == (1, args.latent_dim)
    ids = token_ids((2, 7), seed=5)
    forward(model, ids, cache, [0, 0])
    rank, index_dim, rope = args.kv_lora_rank, args.index_head_dim, 8
    theirs = hf.model.layers[0]
    with torch.no_grad():
        x = theirs.input_layernorm(hf.model.embed_tokens(torch.tensor(ids)))
        compressed = theirs.self_attn.kv_a_proj_with_mqa(x)
        latent = theirs.self_attn.kv_a_layernorm(compressed[..., :rank]).numpy()
        rotated = compressed[..., rank:].numpy()
        indexer = theirs.self_attn.indexer
        index_keys = indexer.k_norm(indexer.wk(x)).numpy()
    keys = as_np(cache.keys[0][:, 0, :7])
    np.testing.assert_allclose(keys[..., :rank], latent, atol=1e-6)
    np.testing.assert_allclose(keys[:, 0, rank:], rotated[:, 0], atol=1e-6)
    values = as_np(cache.values[0][:, 0, :7])
    np.testing.assert_allclose(values[:, 0, :index_dim], index_keys[:, 0], atol=1e-6)
    np.testing.assert_allclose(
        values[..., rope:index_dim], index_keys[..., rope:], atol=1e-6
    )
    assert not values[..., index_dim:].any()
    assert not as_np(cache.values[1]).any()  # layer 1 is shared


# --- layers and weights ---------------------------------------------------


def test_layers_and_checkpoint_layouts() -> None:
    """The MLP kinds follow the config; per-expert names load the same as
    transformers 5's stacked experts; an MTP layer is split off."""
    hf = make_hf("pattern-bias-tied")
    model = ours(hf)
    kinds = [type(layer.mlp) for layer in model.model.layers]
    assert kinds == [MoE, MLP, MoE, MLP]
    stacked = model.sanitize(hf_weights(hf))
    listed = model.sanitize(per_expert(hf_weights(hf)))
    assert stacked.keys() == listed.keys() == flat_parameters(model).keys()
    for key in stacked:
        np.testing.assert_array_equal(as_np(stacked[key]), as_np(listed[key]), key)
    assert "model.layers.0.self_attn.indexer.k_norm.bias" in stacked
    assert "model.layers.1.self_attn.indexer.wq_b.weight" not in stacked  # shared

    deeper = make_hf(
        "pattern-bias-tied",
        seed=1,
        num_hidden_layers=5,
        index_topk_pattern="FSSFF",
        mlp_layer_types=["sparse", "dense", "sparse", "dense", "sparse"],
    )
    mtp = {
        k: v
        for k, v in per_expert(hf_weights(deeper)).items()
        if k.startswith("model.layers.4.")
    }
    mtp["model.layers.4.eh_proj.weight"] = mx.zeros((64, 128))
    main, split = model.split_mtp({**per_expert(hf_weights(hf)), **mtp})
    assert main.keys() == stacked.keys()
    assert "eh_proj.weight" in split and "mlp.switch_mlp.up_proj.weight" in split
    assert "self_attn.kv_b_proj.weight" in split
    args = model.glm
    assert load_weights(model, {**hf_weights(hf), **mtp}, args) == Success(None)
    missing = dict(per_expert(hf_weights(hf)))
    del missing["model.layers.2.mlp.experts.5.up_proj.weight"]
    result = load_weights(build_model(args).unwrap(), missing, args)
    assert isinstance(result, Failure)
    assert "model.layers.2.mlp.switch_mlp.up_proj.weight" in result.failure().message


def write_dsa_folder(folder: Path, hf: Any) -> None:
    """An HF-layout folder as GLM-5 ships: per-expert names and an MTP layer
    (layer N of a transformers model one layer deeper, named as transformers
    names a decoder layer, its indexer included, plus eh_proj, enorm, hnorm
    and shared_head, here random)."""
    write_tiny_model(folder)  # tokenizer files (config and weights replaced)
    config = {**hf.config.to_dict(), "architectures": ["GlmMoeDsaForCausalLM"]}
    (folder / "config.json").write_text(json.dumps(config))
    weights = per_expert(hf_weights(hf))
    n = hf.config.num_hidden_layers
    deeper = make_hf(
        "sparse-shared",
        seed=3,
        vocab_size=hf.config.vocab_size,
        num_hidden_layers=n + 1,
    )
    prefix = f"model.layers.{n}."
    weights.update(
        {
            k: v
            for k, v in per_expert(hf_weights(deeper)).items()
            if k.startswith(prefix)
        }
    )
    noise = mx.random.normal((64, 128), key=mx.random.key(3))
    weights[f"{prefix}eh_proj.weight"] = 0.15 * noise
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        weights[f"{prefix}{norm}.weight"] = mx.ones((64,))
    weights[f"{prefix}shared_head.head.weight"] = weights["lm_head.weight"]
    mx.save_safetensors(str(folder / "model.safetensors"), weights)


def test_a_folder_loads_and_converts_to_4_bits(tmp_path: Path) -> None:
    vocab = 320  # the tiny tokenizer's ids fit
    hf = make_hf("sparse-shared", vocab_size=vocab)
    write_dsa_folder(tmp_path / "glm5", hf)
    loaded = load(str(tmp_path / "glm5")).unwrap()
    model = loaded.model
    assert isinstance(model, Model) and isinstance(loaded.args, GlmMoeDsaArgs)
    assert model.padding_safe
    # the MTP layer apart, for the native draft (models/glm_mtp.py)
    assert {"eh_proj.weight", "self_attn.indexer.wk.weight"} <= loaded.mtp.keys()
    assert "mlp.switch_mlp.gate_proj.weight" in loaded.mtp
    ids = token_ids((2, 9), seed=7, vocab=vocab)
    assert (
        np.abs(
            forward(model, ids, model.make_cache(2), [0, 0]) - hf_logits(hf, ids)
        ).max()
        < TOL
    )

    out = save_folder(loaded, tmp_path / "q4", quantize=4, group_size=32).unwrap()
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "glm_moe_dsa"
    assert config["quantization"] == {"group_size": 32, "bits": 4}
    assert config["indexer_types"] == ["full", "shared", "full", "shared"]
    assert config["index_topk"] == 4 and config["kv_lora_rank"] == 16
    # the MTP layer as an `mtp/` companion, quantized as the target is
    companion = json.loads((out / "mtp" / "config.json").read_text())
    assert companion["model_type"] == "glm_moe_dsa_mtp"
    assert companion["quantization"]["bits"] == 4
    quantized = forward(model, ids, model.make_cache(2), [0, 0])
    again = load(str(out)).unwrap().model
    assert isinstance(again, Model)
    assert isinstance(again.model.layers[0].self_attn.q_b_proj, nn.QuantizedLinear)
    np.testing.assert_array_equal(
        forward(again, ids, again.make_cache(2), [0, 0]), quantized
    )


# --- lossless speculative decoding ------------------------------------------


def tiny_dsa(seed: int = 1, gain: float = 2.5) -> Model:
    """Random weights, every matrix scaled by `gain` (varied greedy output),
    as tests/specpipe/spec_support.py does; the selection keeps 4 positions."""
    args = args_of({**TINY, **CASES["sparse-shared"], "model_type": "glm_moe_dsa"})
    return parity.scaled_model(args, Model, seed, gain)


@pytest.mark.parametrize("batch", [1, 3])
def test_ngram_speculation_equals_plain_decoding(batch: int) -> None:
    parity.check_ngram_speculation(tiny_dsa(), batch, SamplingParams(), max_tokens=16)
