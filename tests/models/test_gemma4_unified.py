"""Gemma-4 Unified (`gemma4_unified_text`, the multimodal `gemma4_unified`
run as its text part, and the `gemma4_unified_assistant` drafter) on the
own MLX Gemma-4 models, against HF transformers' `Gemma4UnifiedForCausalLM`,
`Gemma4UnifiedForConditionalGeneration` and
`Gemma4UnifiedAssistantForCausalLM`.

The unified text model is Gemma-4's decoder without per-layer embeddings
and without the MoE block, with other config defaults; its multimodal
wrapper has no vision or audio tower (an encoder-free `embed_vision` and
`embed_audio`). Tiny random float32 configs on the CPU, built as
tests/models/test_gemma4.py's (its TINY less the per-layer-embedding keys):
"plain" (tied head), and "shared-keqv" (the last 3 layers kv-shared with
double-wide MLPs, keys-as-values full layers of one KV head, an untied
head, softcapped logits, attention biases, "proportional" RoPE with a
factor). Every context is past the sliding window of 4. The assistant is
tests/models/test_gemma4_assistant.py's, over a unified text stack.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
import torch
import transformers
from returns.result import Failure

from models.gemma4 import Model
from models.gemma4_assistant import Assistant
from models.layers import flat_parameters
from schemas.errors import ConfigError
from schemas.hf_gemma4 import gemma4_args
from schemas.hf_gemma4_assistant import assistant_args
from specpipe.load import load, save_folder
from tests.cli.conftest import write_tiny_model
from tests.models import test_gemma4 as gemma4
from tests.models.parity_support import check_refused_config
from tests.models.test_gemma4 import (
    CASES,
    TINY,
    TOL,
    VOCAB,
    args_of,
    forward,
    hf_weights,
    ours,
    randomize,
    token_ids,
)
from tests.models.test_gemma4_assistant import (
    BACKBONE,
    all_shared_stacks,  # noqa: F401  (the fixture transformers' assistant needs)
    assistant_config,
    hf_assistant,
    hf_step,
    our_step,
    parsed,
    random_kv,
)
from tests.models.test_gemma4_assistant import ours as our_assistant

pytestmark = pytest.mark.reference

SLIDING, FULL = "sliding_attention", "full_attention"
UNIFIED = "gemma4_unified_text"
PLE_KEYS = ("hidden_size_per_layer_input", "vocab_size_per_layer_input")
UNIFIED_TINY = {k: v for k, v in TINY.items() if k not in PLE_KEYS}
UNIFIED_CASES: dict[str, dict[str, Any]] = {
    "plain": CASES["plain"],
    # layers 3-5 read the keys/values of layers 1 (sliding) and 2 (full)
    "shared-keqv": {
        "num_kv_shared_layers": 3,
        "use_double_wide_mlp": True,
        "attention_k_eq_v": True,
        "num_global_key_value_heads": 1,
        "tie_word_embeddings": False,
        "final_logit_softcapping": 30.0,
        "attention_bias": True,
        "rope_parameters": CASES["shared-ple"]["rope_parameters"],
    },
}


def unified_config(case: str, **overrides: Any) -> Any:
    return transformers.Gemma4UnifiedTextConfig(
        **{**UNIFIED_TINY, **UNIFIED_CASES[case], **overrides}
    )


def make_unified(case: str = "plain", seed: int = 0, **overrides: Any) -> Any:
    torch.manual_seed(seed)
    config = unified_config(case, **overrides)
    model = transformers.Gemma4UnifiedForCausalLM(config).eval()
    randomize(model, seed)
    return model


def unified_raw(case: str, **overrides: Any) -> dict[str, Any]:
    """A `gemma4_unified_text` config.json's keys (as a person writes them)."""
    return {**UNIFIED_TINY, **UNIFIED_CASES[case], "model_type": UNIFIED, **overrides}


# --- config ---------------------------------------------------------------


def test_config_reads_as_transformers_does() -> None:
    for case in UNIFIED_CASES:
        config = unified_config(case)
        for given in (config.to_dict(), unified_raw(case)):
            args = args_of(given)
            assert args.model_type == UNIFIED
            assert args.layer_types == tuple(config.layer_types)
            for i, kind in enumerate(config.layer_types):
                layer = config.per_layer_config[i]
                assert args.head_dim_of(kind) == layer.head_dim, (case, i)
                assert args.kv_heads_of(kind) == layer.num_key_value_heads, (case, i)
            modes = config.kv_sharing_modes
            assert [args.is_kv_shared(i) for i in range(6)] == [
                m == "reuse" for m in modes
            ]
            stores = sorted(i for i, m in enumerate(modes) if m == "store")
            if stores:
                assert sorted(args.producer(k) for k in (SLIDING, FULL)) == stores
    # the unified defaults where a config is silent (not Gemma-4's)
    silent = args_of({"model_type": UNIFIED})
    theirs = transformers.Gemma4UnifiedTextConfig()
    assert (silent.sliding_window, silent.max_position_embeddings) == (1024, 262_144)
    assert (silent.sliding_window, silent.max_position_embeddings) == (
        theirs.sliding_window,
        theirs.max_position_embeddings,
    )
    assert (
        silent.use_bidirectional_attention
        == "vision"
        == theirs.use_bidirectional_attention
    )
    assert silent.layer_types == tuple(theirs.layer_types)
    assert (silent.head_dim_of(SLIDING), silent.head_dim_of(FULL)) == (256, 512)
    assert silent.hidden_size_per_layer_input == 0 and not silent.enable_moe_block
    assert args_of({"model_type": "gemma4_text"}).sliding_window == 512


def test_per_layer_embedding_and_moe_keys_are_ignored_as_transformers_does() -> None:
    """transformers' unified config accepts Gemma-4's PLE and MoE keys and
    its model has neither: the same parameters, the same logits."""
    extra = {
        "hidden_size_per_layer_input": 8,
        "vocab_size_per_layer_input": VOCAB,
        "enable_moe_block": True,
        "num_experts": 4,
        "top_k_experts": 2,
        "moe_intermediate_size": 8,
    }
    hf = make_unified("plain", seed=4, **extra)
    args = args_of(unified_raw("plain", **extra))
    assert args.hidden_size_per_layer_input == 0 and not args.enable_moe_block
    model = ours(hf)
    assert set(model.sanitize(hf_weights(hf))) == set(flat_parameters(model))
    ids = token_ids((1, 9), seed=4)
    assert (
        np.abs(
            forward(model, ids, model.make_cache(1), [0]) - gemma4.hf_logits(hf, ids)
        ).max()
        < TOL
    )


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention"),
        ({"num_kv_shared_layers": 6}, "num_kv_shared_layers"),
        (  # the shared layers' type "sliding" has no producer
            {
                "layer_types": [FULL, FULL, FULL, SLIDING, FULL, FULL],
                "num_kv_shared_layers": 3,
            },
            "sliding_attention",
        ),
        ({"global_head_dim": 15}, "global_head_dim"),
        ({"quantization_config": {"quant_method": "fp8"}}, "'fp8'"),
    ],
)
@pytest.mark.parametrize("wrapped", [False, True])
def test_configs_it_cannot_run_are_errors_naming_the_key(
    overrides: dict[str, Any], named: str, wrapped: bool
) -> None:
    raw = unified_raw("plain", **overrides)
    if wrapped:  # the multimodal config, its text part nested
        top = {"quantization_config": raw.pop("quantization_config", None)}
        raw = {"model_type": "gemma4_unified", "text_config": raw, **top}
    check_refused_config(gemma4_args, raw, named)


# --- parity -----------------------------------------------------------------


@pytest.mark.parametrize("case", list(UNIFIED_CASES))
def test_gemma4s_parity_checks_hold_for_the_unified_model(case: str) -> None:
    """tests/models/test_gemma4.py's parity checks on Gemma4UnifiedForCausalLM:
    prefill (logits, final-normed hidden state, the head as arrays), a
    cached prefill, window and single-token steps, and rows of three prompt
    lengths at their own offsets, against transformers."""
    hf = make_unified(case)
    pair = (hf, ours(hf))
    assert pair[1].args.model_type == UNIFIED
    gemma4.test_prefill_matches_transformers(pair)
    gemma4.test_decode_with_cache_matches_full_sequence(pair)
    gemma4.test_rows_at_different_offsets_match_transformers_per_row(pair)


def test_shared_kv_are_transformers_stored_keys_and_values() -> None:
    """What a KV-borrowing draft reads: the keys/values transformers' unified
    model hands its assistant (`shared_kv_states`)."""
    hf = make_unified("shared-keqv", seed=1)
    gemma4.shared_kv_against_transformers(hf, ours(hf), {SLIDING: 2, FULL: 1})


# --- the multimodal wrapper through a folder -------------------------------------


def multimodal_unified(vocab: int, seed: int = 0) -> Any:
    """transformers' `Gemma4UnifiedForConditionalGeneration`: the
    "shared-keqv" text model (head tied, as the wrapper ties it) with a tiny
    encoder-free vision embedder and audio embedder."""
    text = unified_config("shared-keqv", vocab_size=vocab, tie_word_embeddings=True)
    vision = transformers.Gemma4UnifiedVisionConfig(
        patch_size=2,
        pooling_kernel_size=2,
        mm_embed_dim=16,
        mm_posemb_size=8,
        output_proj_dims=16,
    )
    audio = transformers.Gemma4UnifiedAudioConfig(audio_embed_dim=8)
    config = transformers.Gemma4UnifiedConfig(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        audio_config=audio.to_dict(),
    )
    torch.manual_seed(seed)
    model = transformers.Gemma4UnifiedForConditionalGeneration(config).eval()
    randomize(model, seed)
    return model


def test_a_multimodal_folder_loads_as_its_text_model_and_converts(
    tmp_path: Path,
) -> None:
    """A `gemma4_unified` folder (transformers' names: `model.language_model.*`,
    the encoder-free `model.embed_vision.*` / `model.embed_audio.*`) loads
    through the loader as the text model, with the wrapper's logits; its
    conversion is a `gemma4_unified_text` folder that specpipe and
    transformers' `Gemma4UnifiedForCausalLM` read back."""
    vocab = 320  # the tiny tokenizer's ids fit
    hf = multimodal_unified(vocab)
    weights = hf_weights(hf)
    assert "model.embed_vision.patch_dense.weight" in weights
    assert "model.embed_audio.embedding_projection.weight" in weights
    assert not any("tower" in k for k in weights)  # no vision or audio tower
    folder = write_tiny_model(tmp_path / "unified")
    raw = {
        **hf.config.to_dict(),
        "architectures": ["Gemma4UnifiedForConditionalGeneration"],
    }
    (folder / "config.json").write_text(json.dumps(raw))
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    loaded = load(str(folder)).unwrap()
    model = loaded.model
    assert isinstance(model, Model) and loaded.args.model_type == "gemma4_unified"
    assert loaded.args.sliding_window == 4 and loaded.args.tie_word_embeddings
    ids = token_ids((2, 11), seed=8, vocab=vocab)
    with torch.no_grad():
        expected = hf(torch.tensor(ids)).logits.numpy()
    got = forward(model, ids, model.make_cache(2), [0, 0])  # q/k/v fused on load
    assert np.abs(got - expected).max() < TOL

    out = save_folder(loaded, tmp_path / "text").unwrap()
    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == UNIFIED
    assert written["architectures"] == ["Gemma4UnifiedForCausalLM"]
    assert "vision_config" not in written and written["num_kv_shared_layers"] == 3
    again = load(str(out)).unwrap().model
    assert isinstance(again, Model) and again.args.model_type == UNIFIED
    np.testing.assert_array_equal(forward(again, ids, again.make_cache(2), [0, 0]), got)
    theirs = transformers.Gemma4UnifiedForCausalLM.from_pretrained(
        str(out), attn_implementation="eager"
    ).eval()
    assert np.abs(gemma4.hf_logits(theirs, ids) - got).max() < TOL


# --- the unified assistant -------------------------------------------------------


def test_the_unified_assistant_config_reads_as_transformers_does() -> None:
    hf = hf_assistant(ordered=True, unified=True)
    args = parsed(hf.config.to_dict())
    assert args.model_type == "gemma4_unified_assistant"
    assert args.text.model_type == UNIFIED and args.backbone_hidden_size == BACKBONE
    assert all(args.text.is_kv_shared(i) for i in range(3))
    names = set(flat_parameters(Assistant(args)))
    assert names == set(
        our_assistant(hf).sanitize(dict.fromkeys(hf.state_dict(), mx.zeros(1)))
    )
    # transformers' defaults: backbone 3840, a nested config of the unified
    # text model (its sliding window 1024), every layer shared
    raw = assistant_config(False, unified=True)
    del raw["backbone_hidden_size"]
    raw["text_config"] = {
        k: v
        for k, v in raw["text_config"].items()
        if k not in ("model_type", "sliding_window", "num_kv_shared_layers")
    }
    theirs = transformers.Gemma4UnifiedAssistantConfig(text_config=raw["text_config"])
    silent = parsed(raw)
    assert silent.backbone_hidden_size == theirs.backbone_hidden_size == 3840
    assert silent.text.sliding_window == theirs.text_config.sliding_window == 1024
    assert silent.text.num_kv_shared_layers == theirs.text_config.num_kv_shared_layers


@pytest.mark.parametrize(
    ("ordered", "length", "wide"),
    [(False, 3, False), (True, 11, False), (False, 11, True)],
)
def test_a_unified_assistant_step_matches_transformers(
    ordered: bool, length: int, wide: bool
) -> None:
    """One step within, and past, the sliding window; the unified assistant
    may have double-wide MLPs (its config, unlike Gemma-4's, allows them)."""
    hf = hf_assistant(ordered, seed=length, unified=True, use_double_wide_mlp=wide)
    model = our_assistant(hf)
    if wide:
        assert model.model.layers[0].mlp.intermediate == 2 * 80
    kv = random_kv(1, length, seed=length)
    x = torch.randn(1, 1, 2 * BACKBONE, generator=torch.Generator().manual_seed(3))
    theirs = hf_step(hf, x, kv, length)
    mine = our_step(model, x, kv, [length])
    assert np.abs(mine[0] - theirs[0]).max() < TOL
    assert np.abs(mine[1] - theirs[1]).max() < TOL


@pytest.mark.parametrize(
    ("raw", "named"),
    [
        (
            assistant_config(False, unified=True, num_kv_shared_layers=2),
            "num_kv_shared_layers",
        ),
        (assistant_config(False, unified=True, sliding_window=0), "sliding_window"),
        (
            {**assistant_config(False, unified=True), "backbone_hidden_size": -1},
            "backbone_hidden_size",
        ),
        # transformers' Gemma4AssistantConfig refuses it (the unified one does not)
        (assistant_config(False, use_double_wide_mlp=True), "use_double_wide_mlp"),
    ],
)
def test_assistant_configs_it_cannot_run_are_errors_naming_the_key(
    raw: dict[str, Any], named: str
) -> None:
    result = assistant_args(raw, "draft/config.json")
    assert isinstance(result, Failure)
    error = result.failure()
    assert isinstance(error, ConfigError)
    assert "draft/config.json" in error.message and named in error.message, error
