"""The own MLX Gemma-4 (`gemma4_text`, and `gemma4` run as its text part)
against HF transformers.

Tiny random configs (hidden 64, 6 layers of sliding / full attention, 4
query heads; sliding heads of 16, full heads of 32; a sliding window of 4,
so every context here is longer than it; vocab 128) run in float32 on the
CPU with eager attention. Parameters are re-drawn after HF's init so norms,
`layer_scalar`, the router's scales and biases are non-trivial. Configs
reach our model as real folders do (`config.to_dict()`, whose
`per_layer_config` carries the full layers' head width, or the raw
`global_head_dim` keys -> `gemma4_args`), weights through `state_dict` ->
`load_weights`, as an HF checkpoint would.

The cases: "plain" (a sliding / full mix, tied head); "shared-ple" (the
last 3 layers kv-shared with double-wide MLPs, per-layer embeddings,
softcapped logits, "proportional" RoPE with a factor, attention biases);
"moe-keqv" (the MoE block, full layers with `attention_k_eq_v` and one
global KV head, an untied head, softcapping). Also: configs it cannot run,
the assistant-facing API (a layer run around a borrowed attention, the
stored keys/values transformers' shared_kv_states hold), the multimodal and
MLX checkpoint layouts, a folder through the loader and a 4-bit conversion,
a prompt-cache file round trip, and lossless n-gram speculation.
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
from returns.result import Failure, Success

from models.build import build_model, load_weights
from models.fuse import fuse_projections
from models.gemma4 import (
    DecoderLayer,
    Gemma4Cache,
    Model,
    sliding_view,
)
from models.layers import flat_parameters
from schemas.converter import hf as hf_converter
from schemas.converter import structure, unstructure
from schemas.errors import ConfigError
from schemas.hf import DecoderArgs
from schemas.hf_gemma4 import Gemma4Args, gemma4_args, gemma4_text_args
from schemas.request import SamplingParams
from specpipe.draft_vocab import DraftVocabulary, SubsetHead
from specpipe.load import load, save_folder
from specpipe.loop import RoundOptions, RowRequest, generate_rows
from specpipe.prompt_cache import PromptCache
from specpipe.prompt_cache_file import load_prompt_cache, save_prompt_cache
from tests.cli.conftest import write_tiny_model
from tests.models import hybrid_support as support
from tests.models import parity_support as parity
from tests.models.decoder_support import parsed_args
from tests.models.hybrid_support import (
    as_np,
    check_cached_decode,
    forward,
    hf_weights,
    redraw,
    token_ids,  # over hybrid_support's VOCAB, this module's
)
from tests.rounding import same_math
from tests.specpipe.spec_support import PROMPTS, CollectSink

pytestmark = pytest.mark.reference

VOCAB = 128
WINDOW = 4
SLIDING, FULL = "sliding_attention", "full_attention"
TINY: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "global_head_dim": 32,
    "layer_types": [SLIDING, SLIDING, FULL, SLIDING, FULL, FULL],
    "sliding_window": WINDOW,
    "hidden_size_per_layer_input": 0,
    "vocab_size_per_layer_input": VOCAB,
    "max_position_embeddings": 512,
    "attn_implementation": "eager",
}
# name -> config overrides
CASES: dict[str, dict[str, Any]] = {
    "plain": {
        "rope_parameters": {
            SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
            FULL: {
                "rope_type": "proportional",
                "partial_rotary_factor": 0.25,
                "rope_theta": 1e6,
            },
        },
    },
    # layers 3-5 read the keys/values of layers 1 (sliding) and 2 (full)
    "shared-ple": {
        "num_kv_shared_layers": 3,
        "use_double_wide_mlp": True,
        "hidden_size_per_layer_input": 8,
        "final_logit_softcapping": 30.0,
        "attention_bias": True,
        "rope_parameters": {
            SLIDING: {"rope_type": "default", "rope_theta": 100.0},
            FULL: {
                "rope_type": "proportional",
                "partial_rotary_factor": 0.5,
                "rope_theta": 1e4,
                "factor": 2.0,
            },
        },
    },
    "moe-keqv": {
        "enable_moe_block": True,
        "num_experts": 4,
        "top_k_experts": 2,
        "moe_intermediate_size": 32,
        "attention_k_eq_v": True,
        "num_global_key_value_heads": 1,
        "tie_word_embeddings": False,
        "final_logit_softcapping": 5.0,
        "num_kv_shared_layers": 1,
    },
}
TOL = 1e-4
# window-vs-one-by-one and batched-vs-alone: same math, other matmul shapes
# (a GPU's tiling rounds them apart: tests/rounding.py)
ROW_TOL = same_math(1e-5)
# past ~300 positions: float32 RoPE angles (position * frequency) differ
# between MLX's kernel and transformers by ~1e-5 rad, each ~3e-5 from the
# exact angle (measured), which the tiny random layers amplify
LONG_TOL = 5e-4


def randomize(module: torch.nn.Module, seed: int) -> None:
    """`redraw` with Gemma-4's scales as norms and its layer scalars near 1."""
    redraw(
        module,
        seed,
        lambda name: "norm" in name or name.endswith("scale"),
        {"layer_scalar": (1.0, 0.2)},
    )


def text_config(case: str, **overrides: Any) -> Any:
    return transformers.Gemma4TextConfig(**{**TINY, **CASES[case], **overrides})


def make_hf(case: str = "plain", seed: int = 0, **overrides: Any) -> Any:
    torch.manual_seed(seed)
    model = transformers.Gemma4ForCausalLM(text_config(case, **overrides)).eval()
    randomize(model, seed)
    return model


def args_of(raw: dict[str, Any]) -> Gemma4Args:
    return parsed_args(gemma4_args, raw)


def ours(hf: Any, weights: dict[str, mx.array] | None = None) -> Model:
    return support.ours(hf, Model, gemma4_args, weights)


def hf_logits(hf: Any, ids: np.ndarray) -> np.ndarray:  # [B, L] -> [B, L, V]
    # output_hidden_states: transformers 5.23 otherwise slices the per-layer
    # inputs of a kv-shared stack without PLE (and fails)
    return support.hf_logits(hf, ids, output_hidden_states=True)


@pytest.fixture(scope="module", params=list(CASES))
def pair(request: pytest.FixtureRequest) -> tuple[Any, Model]:
    hf = make_hf(request.param)
    return hf, ours(hf)


# --- config ---------------------------------------------------------------


def test_config_reads_as_transformers_does() -> None:
    for case in CASES:
        config = text_config(case)
        raw = {"model_type": "gemma4_text", **TINY, **CASES[case]}
        # transformers' dict (`per_layer_config`) and the raw keys alike
        for given in (config.to_dict(), raw):
            args = args_of(given)
            assert args.layer_types == tuple(config.layer_types)
            for i, kind in enumerate(config.layer_types):
                layer = config.per_layer_config[i]
                assert args.head_dim_of(kind) == layer.head_dim, (case, i)
                assert args.kv_heads_of(kind) == layer.num_key_value_heads, (case, i)
            modes = config.kv_sharing_modes
            assert [args.is_kv_shared(i) for i in range(6)] == [
                m == "reuse" for m in modes
            ]
            stores = [i for i, m in enumerate(modes) if m == "store"]
            if stores:
                assert sorted(args.producer(k) for k in (SLIDING, FULL)) == stores
    # transformers' defaults where a config is silent
    plain = args_of({"model_type": "gemma4_text"})
    assert (plain.hidden_size, plain.num_hidden_layers, plain.vocab_size) == (
        2304,
        30,
        262144,
    )
    assert plain.layer_types == tuple(transformers.Gemma4TextConfig().layer_types)
    assert (plain.head_dim_of(SLIDING), plain.head_dim_of(FULL)) == (256, 512)
    assert (plain.kv_heads_of(SLIDING), plain.kv_heads_of(FULL)) == (4, 4)
    assert plain.hidden_size_per_layer_input == 256 and plain.tie_word_embeddings
    assert plain.sliding_rope.theta == 10_000.0 and plain.rope.theta == 10_000.0
    assert plain.full_rope.rope_type == "proportional"
    assert plain.full_rope.partial_rotary_factor == 0.25
    assert plain.eos_token_id == (1,) and plain.final_logit_softcapping is None
    # num_global_key_value_heads counts only with attention_k_eq_v, as in transformers
    ignored = args_of({"model_type": "gemma4_text", "num_global_key_value_heads": 1})
    assert ignored.kv_heads_of(FULL) == 4
    # the last layer is made full, as transformers makes it
    forced = args_of(
        {**TINY, "model_type": "gemma4_text", "layer_types": [SLIDING] * 6}
    )
    assert forced.layer_types[-1] == FULL
    # null per-layer inputs: none (not the default 256)
    nulled = {**TINY, "model_type": "gemma4_text", "hidden_size_per_layer_input": None}
    assert args_of(nulled).hidden_size_per_layer_input == 0
    assert isinstance(plain, DecoderArgs)  # what the pipeline reads on `args`
    again = structure(hf_converter, unstructure(hf_converter, plain), Gemma4Args, "x")
    assert again == Success(plain)


def test_the_multimodal_config_is_read_as_its_text_part() -> None:
    text = text_config("moe-keqv").to_dict()
    raw = {
        "model_type": "gemma4",
        "text_config": text,
        "vision_config": {"hidden_size": 32},
        "tie_word_embeddings": True,
        "eos_token_id": [1, 106],
        "quantization": {"group_size": 32, "bits": 4},
    }
    args = args_of(raw)
    assert args.model_type == "gemma4" and args.tie_word_embeddings
    assert args.eos_token_id == (1, 106) and args.quantization is not None
    assert args.enable_moe_block and args.kv_heads_of(FULL) == 1


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (
            {"layer_types": [SLIDING, "chunked", FULL, SLIDING, FULL, FULL]},
            "layer_types",
        ),
        ({"layer_types": [SLIDING, FULL]}, "layer_types"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, "keyed"),
        (
            {
                "rope_parameters": {
                    SLIDING: {"rope_type": "yarn", "rope_theta": 1.0},
                    FULL: {"rope_type": "default", "rope_theta": 1.0},
                }
            },
            "rope_type",
        ),
        ({"rope_parameters": {SLIDING: {"rope_type": "default"}}}, "full_attention"),
        (
            {"attention_k_eq_v": True, "num_global_key_value_heads": 3},
            "num_global_key_value_heads",
        ),
        ({"head_dim": 15}, "head_dim"),
        ({"hidden_activation": "gelu"}, "hidden_activation"),
        ({"num_kv_shared_layers": 6}, "num_kv_shared_layers"),
        ({"num_kv_shared_layers": 7}, "num_kv_shared_layers"),
        (  # the shared layers' type "sliding" has no producer
            {"layer_types": [FULL, FULL, FULL, SLIDING, FULL, FULL]},
            "sliding_attention",
        ),
        ({"enable_moe_block": True, "num_experts": 4}, "top_k_experts"),
        ({"per_layer_config": {"2": {"intermediate_size": 8}}}, "per_layer_config"),
        (
            {"per_layer_config": {"2": {"head_dim": 32}, "4": {"head_dim": 16}}},
            "per_layer_config",
        ),
        ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention"),
        ({"final_logit_softcapping": -1.0}, "final_logit_softcapping"),
        ({"sliding_window": "wide"}, "sliding_window"),
        ({"quantization_config": {"quant_method": "fp8"}}, "'fp8'"),
    ],
)
def test_configs_it_cannot_run_are_errors_naming_the_key(
    overrides: dict[str, Any], named: str
) -> None:
    raw = {**TINY, "model_type": "gemma4_text", **overrides}
    if "num_kv_shared_layers" not in overrides and "layer_types" in overrides:
        raw["num_kv_shared_layers"] = 3
    parity.check_refused_config(gemma4_args, raw, named)


def test_an_all_shared_stack_is_a_draft_config_not_a_target() -> None:
    """An assistant's nested text config: every layer kv-shared, no PLE. It
    parses as a stack of decoder layers (no k/v projections), but is no
    target: `gemma4_args` and `build_model` refuse it."""
    raw = {
        **TINY,
        "model_type": "gemma4_text",
        "num_hidden_layers": 2,
        "layer_types": [SLIDING, FULL],
        "num_kv_shared_layers": 2,
        "hidden_size_per_layer_input": None,
    }
    args = gemma4_text_args(raw, "assistant text_config").unwrap()
    assert all(args.is_kv_shared(i) for i in range(2))
    assert args.producer(SLIDING) is None and args.hidden_size_per_layer_input == 0
    layers = [DecoderLayer(args, i) for i in range(2)]
    names = set(flat_parameters(layers[1]))
    assert "self_attn.q_proj.weight" in names and "self_attn.k_proj.weight" not in names
    refused = gemma4_args(raw, "cfg.json")
    assert isinstance(refused, Failure)
    assert (
        "num_kv_shared_layers (2) equals num_hidden_layers" in refused.failure().message
    )
    built = build_model(args)
    assert isinstance(built, Failure) and isinstance(built.failure(), ConfigError)
    assert "assistant" in built.failure().message
    parity.check_needs_own_args({**TINY, "model_type": "gemma4_text"}, "Gemma4Args")


# --- parity ---------------------------------------------------------------


def test_prefill_matches_transformers(pair: tuple[Any, Model]) -> None:
    hf, model = pair
    ids = token_ids((2, 12))  # three times the sliding window
    _, out = parity.check_prefill(hf, model, ids, VOCAB, TOL)
    # the head as arrays: the logits it projects are the model's, softcap included
    head = model.head_weights()
    assert head.softcap == hf.config.final_logit_softcapping
    projected = as_np(head.project(model.final_norm(out.hidden)))
    assert np.abs(projected - as_np(out.logits)).max() < ROW_TOL
    parity.check_head_weights(hf, model)


def test_decode_with_cache_matches_full_sequence(pair: tuple[Any, Model]) -> None:
    hf, model = pair
    ids = token_ids((2, 14), seed=2)
    check_cached_decode(hf, model, ids, TOL, ROW_TOL, hf_logits)


def test_rows_at_different_offsets_match_transformers_per_row(
    pair: tuple[Any, Model],
) -> None:
    """Rows of prompt lengths 5, 9 and 3 prefilled right-padded as one batch,
    then a 3-token window and single tokens at each row's own offset: each
    row's logits are transformers' over that row's sequence."""
    hf, model = pair
    lengths = (5, 9, 3)
    rows = token_ids((3, 16), seed=3)
    padded = np.where(
        np.arange(9)[None, :] < np.array(lengths)[:, None], rows[:, :9], 0
    )
    cache = model.make_cache(3)
    forward(model, padded, cache, [0, 0, 0])  # junk past a row's length, overwritten
    window = np.stack([rows[b, n : n + 3] for b, n in enumerate(lengths)])
    got = [forward(model, window, cache, list(lengths))]
    for step in range(3, 7):
        ids = np.stack(
            [rows[b, n + step : n + step + 1] for b, n in enumerate(lengths)]
        )
        got.append(forward(model, ids, cache, [n + step for n in lengths]))
    batched = np.concatenate(got, axis=1)  # [3, 7, V]
    for b, n in enumerate(lengths):
        expected = hf_logits(hf, rows[b : b + 1, : n + 7])[0, n:]
        assert np.abs(batched[b] - expected).max() < TOL, (b, n)


def test_bucketed_spans_give_the_exact_spans_logits() -> None:
    """A GPU's short windows attend over the whole capacity (KVCache.key_span):
    the sliding layers' keys then start at a multiple of 256. Forced on here
    (CPU), past 256 positions, at per-row offsets: the logits of the exact
    span, and transformers'."""
    hf = make_hf("shared-ple", seed=3)
    model = ours(hf)
    ids = token_ids((2, 300), seed=4)
    outs = []
    for bucketed in (False, True):
        cache = model.make_cache(2)
        cache.bucket_windows = bucketed
        forward(model, ids[:, :290], cache, [0, 0])
        window = np.stack([ids[0, 290:293], ids[1, 280:283]])
        outs.append(forward(model, window, cache, [290, 280]))
        assert cache.key_span([290, 280], 3) == (512 if bucketed else 293)
    assert np.abs(outs[0] - outs[1]).max() < ROW_TOL
    expected = hf_logits(hf, ids[:1, :293])[0, 290:]
    assert np.abs(outs[1][0] - expected).max() < LONG_TOL
    view = sliding_view([290, 280], 3, 512, WINDOW)
    assert view.start == 256 and isinstance(view.mask, mx.array)
    assert view.mask.shape == (2, 1, 3, 256)
    # decode past the window: the keys cut to exactly the window, no mask
    single = sliding_view([290, 290], 1, 291, WINDOW)
    assert (single.start, single.mask) == (287, None)


# --- the API a KV-borrowing draft uses ----------------------------------------


def shared_kv_against_transformers(
    hf: Any, model: Model, kv_heads: dict[str, int]
) -> tuple[Any, np.ndarray]:
    """`model.shared_kv` of each layer type in `kv_heads` after a two-row
    prefill against the keys/values transformers hands an assistant
    (`shared_kv_states`): (rows, kv heads) and values within TOL. The cache
    and the ids."""
    ids = token_ids((2, 9), seed=5)
    with torch.no_grad():
        expected = hf(
            torch.tensor(ids), output_hidden_states=True, return_shared_kv_states=True
        ).shared_kv_states
    cache = model.make_cache(2)
    forward(model, ids, cache, [0, 0])
    for kind, heads in kv_heads.items():
        keys, values = model.shared_kv(cache, kind)
        assert keys.shape[:2] == (2, heads)
        theirs = expected[kind]
        assert np.abs(as_np(keys[:, :, :9]) - theirs[0].numpy()).max() < TOL
        assert np.abs(as_np(values[:, :, :9]) - theirs[1].numpy()).max() < TOL
    return cache, ids


def test_shared_kv_are_transformers_stored_keys_and_values() -> None:
    hf = make_hf("shared-ple", seed=1)
    model = ours(hf)
    cache, ids = shared_kv_against_transformers(hf, model, {SLIDING: 2, FULL: 2})
    assert (model.gemma.producer(SLIDING), model.gemma.producer(FULL)) == (1, 2)
    for kind in (SLIDING, FULL):
        keys, _ = model.shared_kv(cache, kind)
        assert keys.shape == (2, 2, cache.capacity, model.gemma.head_dim_of(kind))
    # without kv-shared layers: the last layer of the type
    plain = ours(make_hf("plain"))
    assert (plain.gemma.producer(SLIDING), plain.gemma.producer(FULL)) == (3, 5)
    cache = plain.make_cache(1)
    forward(plain, ids[:1], cache, [0])
    keys, _ = plain.shared_kv(cache, FULL)
    assert keys is cache.arenas[FULL].keys[2]  # layer 5: the third full layer
    with pytest.raises(ValueError, match="no positions"):
        plain.shared_kv(plain.make_cache(1), FULL)


def test_a_layer_runs_around_a_borrowed_attention() -> None:
    """`DecoderLayer.run` with the attention a KV-borrowing draft builds
    (`output(sdpa(queries(x), shared_kv keys, values))`) gives the target's
    own kv-shared layer's output."""
    hf = make_hf("shared-ple", seed=2)
    model = ours(hf)
    ids = token_ids((1, 7), seed=6)
    model.tap([2, 3, 4])
    cache = model.make_cache(1)
    out = model(mx.array(ids, dtype=mx.int32), cache, [0])
    model.tap([])
    assert out.features is not None
    width = model.args.hidden_size
    before = out.features[..., :width]
    per_layer = model.model.per_layer_inputs(mx.array(ids), model.embed(mx.array(ids)))
    assert per_layer is not None
    h = before
    for i in (3, 4):  # a sliding, then a full kv-shared layer
        layer = model.model.layers[i]
        attention = layer.self_attn
        kind = model.gemma.layer_types[i]
        keys, values = model.shared_kv(cache, kind)
        view = sliding_view([0], 7, 7, WINDOW) if kind == SLIDING else None
        mask = view.mask if view is not None else "causal"

        def attend(
            normed: mx.array,
            attention: Any = attention,
            keys: mx.array = keys[:, :, :7],
            values: mx.array = values[:, :, :7],
            mask: Any = mask,
        ) -> mx.array:
            queries = attention.queries(normed, 0)
            attended = mx.fast.scaled_dot_product_attention(
                queries, keys, values, scale=1.0, mask=mask
            )
            result: mx.array = attention.output(attended)
            return result

        h = layer.run(h, attend, per_layer[:, :, i])
        tapped = out.features[..., (i - 2) * width : (i - 1) * width]
        assert np.abs(as_np(h) - as_np(tapped)).max() < ROW_TOL, i
    with pytest.raises(ValueError, match="per-layer"):
        model.model.layers[3].run(before, lambda x: x, None)


# --- checkpoint layouts and loading -------------------------------------------


def multimodal_hf(seed: int = 0) -> Any:
    text = text_config("shared-ple")
    vision = transformers.Gemma4VisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
    )
    config = transformers.Gemma4Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(), audio_config=None
    )
    torch.manual_seed(seed)
    model = transformers.Gemma4ForConditionalGeneration(config).eval()
    randomize(model, seed)
    return model


def test_the_multimodal_and_mlx_layouts_load_as_the_text_model() -> None:
    """transformers' multimodal state dict (`model.language_model.*`, a
    vision tower), an MLX conversion's names (`language_model.model.*`) and
    a checkpoint listing kv-shared layers' k/v projections all load."""
    hf = multimodal_hf()
    weights = hf_weights(hf)
    assert any(k.startswith("model.vision_tower.") for k in weights)
    args = args_of(hf.config.to_dict())
    assert args.model_type == "gemma4"
    model = build_model(args).unwrap()
    assert isinstance(model, Model)
    assert load_weights(model, weights, args) == Success(None)
    ids = token_ids((2, 10), seed=7)
    with torch.no_grad():
        expected = hf(torch.tensor(ids)).logits.numpy()
    got = forward(model, ids, model.make_cache(2), [0, 0])
    assert np.abs(got - expected).max() < TOL

    text = model.sanitize(weights)
    assert text.keys() == flat_parameters(model).keys()
    mlx_names = {
        k.replace("model.", "language_model.model.", 1): v for k, v in text.items()
    }
    mlx_names["vision_tower.encoder.x.weight"] = mx.zeros((2,))
    # a shared layer's k/v weights, as released checkpoints list them
    mlx_names["language_model.model.layers.4.self_attn.k_proj.weight"] = mx.zeros((2,))
    again = model.sanitize(mlx_names)
    assert again.keys() == text.keys()


def test_stacked_experts_map_onto_the_switch_layers() -> None:
    """transformers' stacked experts split onto the switch layers; a model
    whose q and k (values are keys) run as one product gives the logits."""
    hf = make_hf("moe-keqv")
    model = ours(hf)
    # q/k(/v) of the non-shared layers 0-4, gate/up of the 6 dense MLPs
    assert fuse_projections(model) == 5 + 6
    ids = token_ids((2, 10), seed=11)
    assert (
        np.abs(
            forward(model, ids, model.make_cache(2), [0, 0]) - hf_logits(hf, ids)
        ).max()
        < TOL
    )
    weights = hf_weights(hf)
    named = model.sanitize(weights)
    stacked = weights["model.layers.0.experts.gate_up_proj"]  # [E, 2I, H]
    gate = named["model.layers.0.experts.switch_glu.gate_proj.weight"]
    up = named["model.layers.0.experts.switch_glu.up_proj.weight"]
    np.testing.assert_array_equal(as_np(gate), as_np(stacked[:, :32]))
    np.testing.assert_array_equal(as_np(up), as_np(stacked[:, 32:]))
    assert "model.layers.2.self_attn.v_proj.weight" not in named  # keys are values
    assert "model.layers.1.self_attn.v_proj.weight" in named
    assert "lm_head.weight" in named  # untied
    missing = dict(weights)
    del missing["model.layers.3.router.per_expert_scale"]
    result = load_weights(build_model(model.gemma).unwrap(), missing, model.gemma)
    assert isinstance(result, Failure)
    assert "model.layers.3.router.per_expert_scale" in result.failure().message


def test_a_multimodal_folder_loads_and_converts_to_4_bits(tmp_path: Path) -> None:
    vocab = 320  # the tiny tokenizer's ids fit
    text = text_config("shared-ple", vocab_size=vocab, vocab_size_per_layer_input=vocab)
    config = transformers.Gemma4Config(text_config=text.to_dict(), audio_config=None)
    torch.manual_seed(0)
    hf = transformers.Gemma4ForConditionalGeneration(config).eval()
    randomize(hf, 0)
    folder = tmp_path / "gemma4"
    write_tiny_model(folder)  # tokenizer files (config and weights replaced)
    raw = {**hf.config.to_dict(), "architectures": ["Gemma4ForConditionalGeneration"]}
    (folder / "config.json").write_text(json.dumps(raw))
    mx.save_safetensors(str(folder / "model.safetensors"), hf_weights(hf))
    loaded = load(str(folder)).unwrap()
    model = loaded.model
    assert isinstance(model, Model) and isinstance(loaded.args, Gemma4Args)
    assert model.padding_safe
    ids = token_ids((2, 9), seed=8, vocab=vocab)
    with torch.no_grad():
        expected = hf(torch.tensor(ids)).logits.numpy()
    got = forward(model, ids, model.make_cache(2), [0, 0])  # q/k/v fused on load
    assert np.abs(got - expected).max() < TOL

    # float conversion: the text model, as a gemma4_text folder
    out = save_folder(loaded, tmp_path / "text").unwrap()
    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == "gemma4_text"
    assert written["architectures"] == ["Gemma4ForCausalLM"]
    assert written["num_kv_shared_layers"] == 3
    again = load(str(out)).unwrap().model
    assert isinstance(again, Model) and again.args.model_type == "gemma4_text"
    np.testing.assert_array_equal(forward(again, ids, again.make_cache(2), [0, 0]), got)

    out = save_folder(loaded, tmp_path / "q4", quantize=4, group_size=32).unwrap()
    written = json.loads((out / "config.json").read_text())
    assert written["quantization"] == {"group_size": 32, "bits": 4}
    quantized = forward(model, ids, model.make_cache(2), [0, 0])
    again = load(str(out)).unwrap().model
    assert isinstance(again, Model)
    assert isinstance(again.model.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    np.testing.assert_array_equal(
        forward(again, ids, again.make_cache(2), [0, 0]), quantized
    )


# --- pipeline ------------------------------------------------------------------


def tiny_gemma(case: str, seed: int = 1, gain: float = 2.5) -> Model:
    """Random weights, every matrix scaled by `gain` (varied greedy output),
    as tests/specpipe/spec_support.py does."""
    return random_model(
        {**TINY, **CASES[case], "model_type": "gemma4_text"}, seed, gain
    )


def random_model(raw: dict[str, Any], seed: int = 1, gain: float = 2.5) -> Model:
    """`tiny_gemma`'s model of any Gemma-4 config dict."""
    return parity.scaled_model(args_of(raw), Model, seed, gain)


@pytest.mark.parametrize(("case", "batch"), [("shared-ple", 1), ("moe-keqv", 3)])
def test_ngram_speculation_equals_plain_decoding(case: str, batch: int) -> None:
    parity.check_ngram_speculation(
        tiny_gemma(case), batch, SamplingParams(), max_tokens=16
    )


def test_a_subset_head_sees_the_capped_logits() -> None:
    """FR-Spec: the head's rows at listed ids project the target's capped
    logits at those ids."""
    model = tiny_gemma("moe-keqv")
    vocab = DraftVocabulary.create([0, 3, 7, 40, 99], VOCAB).unwrap()
    subset = SubsetHead.of(model, vocab)
    hidden = mx.random.normal((2, 3, 64), key=mx.random.key(0))
    full = as_np(model.lm_head(hidden))
    capped = as_np(subset.project(model.final_norm(hidden)))
    assert np.abs(capped - full[..., list(vocab.ids)]).max() < ROW_TOL
    assert np.abs(full).max() <= 5.0  # final_logit_softcapping


def test_cache_rows_and_a_prompt_cache_file_round_trip(tmp_path: Path) -> None:
    model = tiny_gemma("shared-ple")
    first = model.make_cache(2)
    forward(model, token_ids((2, 6), seed=9), first, [0, 0])
    second = model.make_cache(1)
    forward(model, token_ids((1, 6), seed=10), second, [0])
    joined = Gemma4Cache.concat_rows([first, second])
    assert joined.batch == 3 and set(joined.arenas) == {SLIDING, FULL}
    assert joined.arenas[FULL].head_dim == 32 and joined.arenas[SLIDING].head_dim == 16
    taken = joined.take_rows([2, 0], 6)
    np.testing.assert_array_equal(
        as_np(taken.arenas[FULL].keys[0][0]), as_np(second.arenas[FULL].keys[0][0])
    )
    assert len(joined.arrays()) == 2 * (2 + 1)  # layers 0, 1 sliding; 2 full

    store = PromptCache(model)
    requests = [RowRequest(p, SamplingParams(), 4, CollectSink()) for p in PROMPTS[:2]]
    generate_rows(model, requests, (), None, RoundOptions(), prompt_cache=store)
    path = save_prompt_cache(store, tmp_path / "cache.safetensors").unwrap()
    reread = load_prompt_cache(path, PromptCache(model)).unwrap()
    before, after = store.checkpoints(), reread.checkpoints()
    assert [c.tokens for c in before] == [c.tokens for c in after] and before
    for a, b in zip(before, after, strict=True):
        assert isinstance(b.target, Gemma4Cache)
        for x, y in zip(a.target.arrays(), b.target.arrays(), strict=True):
            np.testing.assert_array_equal(as_np(x), as_np(y))
