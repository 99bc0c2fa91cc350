"""Gemma-3's text model (`gemma3_text`) on the own Gemma-4 decoder, against
HF transformers' Gemma3ForCausalLM.

Gemma-3 differs from Gemma-4 where `Gemma4Args` says so: softmax scale
query_pre_attn_scalar^-0.5, no value norm, RMSNorms of x / rms(x) * (1 +
weight), no `layer_scalar`, default RoPE on both layer types (the full
layers' with transformers' "linear" scaling where the config asks it). Tiny
random configs (hidden 64, 6 layers, sliding window 4) in float32 on the CPU
with eager attention; parameters re-drawn after HF's init so the norms'
weights are far from zero.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import transformers
from returns.result import Failure, Success

from models.gemma4 import Model, OffsetRMSNorm
from schemas.hf_gemma4 import Gemma4Args, gemma4_args
from specpipe.load import load, save_folder
from tests.cli.conftest import write_tiny_model
from tests.models import hybrid_support as support
from tests.models.hybrid_support import check_cached_decode, redraw
from tests.models.test_gemma4 import TINY as GEMMA4_TINY
from tests.rounding import same_math

_GEMMA4_ONLY = (
    "global_head_dim",
    "hidden_size_per_layer_input",
    "vocab_size_per_layer_input",
)

pytestmark = pytest.mark.reference

SLIDING, FULL = "sliding_attention", "full_attention"
# test_gemma4's tiny shape (hidden 64, 6 layers, sliding window 4, vocab
# 128) less Gemma-4's own keys, with Gemma-3's softmax scale
TINY: dict[str, Any] = {
    **{k: v for k, v in GEMMA4_TINY.items() if k not in _GEMMA4_ONLY},
    "query_pre_attn_scalar": 24,
}
VOCAB = int(TINY["vocab_size"])
CASES: dict[str, dict[str, Any]] = {
    "tied": {},
    "untied-linear": {
        "tie_word_embeddings": False,
        "attention_bias": True,
        "final_logit_softcapping": 20.0,
        "rope_parameters": {
            SLIDING: {"rope_type": "default", "rope_theta": 100.0},
            FULL: {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4},
        },
    },
}
TOL = 1e-4
ROW_TOL = same_math(1e-5)


def make_hf(case: str, seed: int = 0) -> Any:
    import torch

    torch.manual_seed(seed)
    config = transformers.Gemma3TextConfig(**{**TINY, **CASES[case]})
    model = transformers.Gemma3ForCausalLM(config).eval()
    redraw(model, seed)
    return model


def ours(hf: Any) -> Model:
    return support.ours(hf, Model, gemma4_args)


def write_folder(hf: Any, folder: Path, architecture: str) -> Path:
    """`hf` as a checkpoint folder (the tiny tokenizer's files beside it)."""
    import json

    import mlx.core as mx

    write_tiny_model(folder)  # tokenizer files (config and weights replaced)
    raw = {**hf.config.to_dict(), "architectures": [architecture]}
    (folder / "config.json").write_text(json.dumps(raw))
    mx.save_safetensors(str(folder / "model.safetensors"), support.hf_weights(hf))
    return folder


@pytest.fixture(scope="module", params=list(CASES))
def pair(request: pytest.FixtureRequest) -> tuple[Any, Model]:
    hf = make_hf(request.param)
    return hf, ours(hf)


def test_config_reads_gemma3_settings() -> None:
    raw = {"model_type": "gemma3_text", **TINY, **CASES["untied-linear"]}
    args = gemma4_args(raw, "config.json").unwrap()
    assert isinstance(args, Gemma4Args)
    assert args.attention_scale == pytest.approx(24**-0.5)
    assert (args.value_norm, args.norm_offset, args.layer_scalar) == (
        False,
        True,
        False,
    )
    assert args.global_head_dim == 16 and args.hidden_size_per_layer_input == 0
    assert (args.full_rope.rope_type, args.full_rope.factor) == ("linear", 4.0)
    # transformers 4.x keys (rope_theta, rope_local_base_freq, rope_scaling)
    old = {k: v for k, v in raw.items() if k != "rope_parameters"}
    old.update(
        rope_theta=1e4,
        rope_local_base_freq=100.0,
        rope_scaling={"rope_type": "linear", "factor": 4.0},
    )
    again = gemma4_args(old, "config.json").unwrap()
    assert (again.sliding_rope, again.full_rope) == (args.sliding_rope, args.full_rope)


def test_what_it_does_not_implement_is_refused() -> None:
    raw = {"model_type": "gemma3_text", **TINY, "attn_logit_softcapping": 50.0}
    result = gemma4_args(raw, "config.json")
    assert isinstance(result, Failure)
    assert "attn_logit_softcapping (50.0) is not supported" in result.failure().message


def test_logits_and_cached_decode_match_transformers(pair: tuple[Any, Model]) -> None:
    hf, model = pair
    assert isinstance(model.model.norm, OffsetRMSNorm)
    assert "layer_scalar" not in model.model.layers[0]
    ids = support.token_ids((2, 14), seed=2, vocab=VOCAB)
    check_cached_decode(hf, model, ids, TOL, ROW_TOL, support.hf_logits)


def test_a_folder_loads_and_converts(tmp_path: Path) -> None:
    """An HF folder through the loader, and `convert`'s folder of it: the
    same logits as transformers (the norms' weights written as stored), its
    config a `gemma3_text` one."""
    import json

    hf = make_hf("untied-linear", seed=3)
    folder = write_folder(hf, tmp_path / "hf", "Gemma3ForCausalLM")
    loaded = load(str(folder)).unwrap()
    ids = support.token_ids((1, 9), seed=5, vocab=VOCAB)
    want = support.hf_logits(hf, ids)
    got = support.forward(loaded.model, ids, loaded.model.make_cache(1), [0])
    assert np.abs(got - want).max() < TOL
    assert save_folder(loaded, tmp_path / "out") == Success(tmp_path / "out")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["model_type"] == "gemma3_text"
    again = load(str(tmp_path / "out")).unwrap()
    got = support.forward(again.model, ids, again.model.make_cache(1), [0])
    assert np.abs(got - want).max() < TOL


def test_a_multimodal_folder_runs_as_its_text_model(tmp_path: Path) -> None:
    """`gemma3` (Gemma3ForConditionalGeneration) loads as its text model: the
    vision tower and the multimodal projector dropped, transformers' text
    logits; `convert` writes the text model's folder."""
    import json

    import torch

    text = {k: v for k, v in TINY.items() if k != "attn_implementation"}
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "image_size": 28,
        "patch_size": 14,
    }
    config = transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4
    )
    config._attn_implementation = "eager"
    torch.manual_seed(1)
    hf = transformers.Gemma3ForConditionalGeneration(config).eval()
    redraw(hf, 1)
    folder = write_folder(hf, tmp_path / "gemma3", "Gemma3ForConditionalGeneration")
    loaded = load(str(folder)).unwrap()
    ids = support.token_ids((2, 9), seed=8, vocab=VOCAB)
    with torch.no_grad():
        want = hf(input_ids=torch.tensor(ids)).logits.numpy()
    got = support.forward(loaded.model, ids, loaded.model.make_cache(2), [0, 0])
    assert np.abs(got - want).max() < TOL
    out = save_folder(loaded, tmp_path / "text").unwrap()
    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == "gemma3_text"
    assert written["architectures"] == ["Gemma3ForCausalLM"]
    again = load(str(out)).unwrap()
    np.testing.assert_array_equal(
        support.forward(again.model, ids, again.model.make_cache(2), [0, 0]), got
    )


def test_gemma4_drafters_do_not_bind_to_it() -> None:
    """The Gemma-4 assistant borrows keys and values a Gemma-4 target lends
    (`lent_kv`); a Gemma-3 target on the same decoder lends none, so the
    assistant (and DeepSpec's Gemma-4 DSpark) refuse it."""
    from bindings.capabilities import lent_kv
    from schemas.hf_gemma4 import is_gemma4

    gemma3 = gemma4_args({"model_type": "gemma3_text", **TINY}, "c").unwrap()
    gemma4 = gemma4_args(
        {**TINY, "model_type": "gemma4_text", "hidden_size_per_layer_input": 0}, "c"
    ).unwrap()
    assert not is_gemma4(gemma3) and is_gemma4(gemma4)
    assert lent_kv(gemma3) == () and lent_kv(gemma4) != ()


@pytest.mark.parametrize("sampling", ["greedy", "sampled"])
def test_speculation_on_it_is_plain_decoding(tmp_path: Path, sampling: str) -> None:
    """An n-gram draft on a Gemma-3 target: the tokens plain decoding gives,
    greedy and sampled, two rows."""

    import torch

    from schemas.request import GenerationLimits, SamplingParams
    from specpipe.api import load as load_pipeline

    vocab = 320  # the tiny tokenizer's ids fit
    config = transformers.Gemma3TextConfig(**{**TINY, "vocab_size": vocab})
    torch.manual_seed(4)
    hf = transformers.Gemma3ForCausalLM(config).eval()
    redraw(hf, 4)
    folder = write_folder(hf, tmp_path / "gemma3", "Gemma3ForCausalLM")
    params = (
        SamplingParams()
        if sampling == "greedy"
        else SamplingParams(temperature=0.8, top_p=0.9, seed=7)
    )
    prompts = ["Hello world! Hello world!", "def fibonacci(n):"]
    limits = GenerationLimits(max_tokens=16)
    plain = load_pipeline(str(folder), adaptive=False).unwrap()
    spec = load_pipeline(
        str(folder), draft="ngram", num_draft_tokens=4, adaptive=False
    ).unwrap()
    want = plain.generate_batch(prompts, params, limits).unwrap()
    got = spec.generate_batch(prompts, params, limits).unwrap()
    assert [r.tokens for r in got] == [r.tokens for r in want]
    assert sum(r.stats.drafted for r in got) > 0
