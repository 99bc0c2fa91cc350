"""GLM-4.5's native MTP head (models/glm_mtp.py) drafting for a glm4_moe target.

- The head's forward is its formula: enorm / hnorm / eh_proj (the pair at
  position 0 with its embedding zeroed), a GLM decoder layer, shared_head's
  norm; a chained step carries the layer's output, not its norm.
- Lossless: greedy and seeded sampled output == plain decoding, B=1 and 3,
  depths 1 and 3, with FR-Spec too, and through the prompt cache.
- Binding: an HF-layout checkpoint's MTP layer (`model.layers.{N}.*`) loads
  as the native draft (`--draft mtp` and `auto`), and a converted folder's
  `mtp/` companion binds too; a head of another architecture is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from glm_mtp_support import (
    check_carried_and_normed,
    check_mtp_output_equals_plain,
    layer_input,
    seeded,
    write_glm_folder,
)
from spec_support import PROMPTS, run

from models.base import rope_offset
from models.build import build_model
from models.glm4_moe import Model
from models.glm_mtp import GlmMtpHead, build_glm_mtp, head_weights
from models.layers import flat_parameters
from schemas.hf_glm4_moe import Glm4MoeArgs, glm4_moe_args
from schemas.request import SamplingParams
from specpipe.api import load
from specpipe.draft_vocab import DraftVocabulary
from specpipe.drafts.mtp import MtpDrafter
from specpipe.load import load as load_model
from specpipe.load import save_folder
from tests.models.decoder_support import parsed_args

VOCAB = 97
CONFIG: dict[str, Any] = {
    "model_type": "glm4_moe",
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "moe_intermediate_size": 32,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "n_group": 2,
    "topk_group": 1,
    "use_qk_norm": True,
    "routed_scaling_factor": 2.5,
    "partial_rotary_factor": 0.5,
    "attention_bias": True,
    "max_position_embeddings": 512,
    "num_nextn_predict_layers": 1,
}
SAMPLINGS = {
    "greedy": SamplingParams(),
    "sampled": SamplingParams(temperature=0.8, top_p=0.9, top_k=30, seed=5),
}


def glm_args(**overrides: Any) -> Glm4MoeArgs:
    return parsed_args(glm4_moe_args, {**CONFIG, **overrides}, "test")


def tiny_glm() -> Model:
    """The GLM-4.5 target: seed 1, its matrices scaled."""
    model = seeded(lambda: build_model(glm_args()).unwrap(), 1)
    assert isinstance(model, Model)
    return model


@pytest.fixture(scope="module")
def target() -> Model:
    return tiny_glm()


def random_head(seed: int) -> GlmMtpHead:
    return seeded(lambda: GlmMtpHead(glm_args()), seed)


def test_the_head_is_its_formula(target: Model) -> None:
    """Two rows, one from position 0 (its first pair's embedding zeroed)."""
    head = random_head(3)
    batch, length, offsets = 2, 5, [0, 4]
    ids = mx.array(np.random.default_rng(0).integers(0, VOCAB, (batch, length)))
    hidden = mx.random.normal((batch, length, 64), key=mx.random.key(2))
    out = head(target.embed(ids), hidden, head.make_cache(batch), offsets)

    x, cache, mask = layer_input(head, target.embed(ids), hidden, offsets)
    expected = head.layers[0](x, cache, offsets, mask, rope_offset(offsets))
    assert mx.allclose(out, expected, atol=1e-5).item()
    check_carried_and_normed(head, out)


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
@pytest.mark.parametrize("depth", [1, 3])
@pytest.mark.parametrize("batch", [1, 3])
def test_glm_mtp_output_equals_plain(
    target: Model, sampling: str, depth: int, batch: int
) -> None:
    check_mtp_output_equals_plain(
        target, lambda: random_head(4), SAMPLINGS[sampling], depth, batch
    )


def test_glm_mtp_with_a_draft_vocabulary(target: Model) -> None:
    vocab = DraftVocabulary(tuple(range(0, VOCAB, 2)))
    drafter = MtpDrafter(target, random_head(4), vocab=vocab)
    params = SAMPLINGS["sampled"]
    plain, _ = run(target, PROMPTS[:2], params, max_tokens=12)
    spec, results = run(target, PROMPTS[:2], params, drafter, 2, max_tokens=12)
    assert spec == plain and all(r.metrics.drafted > 0 for r in results)


# --- a checkpoint in the HF layout ---------------------------------------------


@pytest.fixture(scope="module")
def glm_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny GLM-4.5 HF folder (320-token tokenizer) with its MTP layer."""
    return write_glm_folder(
        tmp_path_factory.mktemp("glm") / "target",
        CONFIG,
        "Glm4MoeForCausalLM",
        glm_args,
        Model,
        GlmMtpHead,
    )


def test_the_checkpoint_layer_is_the_native_draft(glm_folder: Path) -> None:
    loaded = load_model(str(glm_folder)).unwrap()
    assert loaded.mtp and "eh_proj.weight" in loaded.mtp
    # the layer's weights under the head's names, the shared copies dropped
    renamed = head_weights(loaded.mtp)
    assert "fc.weight" in renamed and "layers.0.mlp.gate.weight" in renamed
    assert not any(k.startswith(("shared_head.", "embed_tokens")) for k in renamed)
    head = build_glm_mtp(loaded.args, loaded.mtp).unwrap()  # type: ignore[arg-type]
    assert isinstance(head, GlmMtpHead)
    plain = load(str(glm_folder)).unwrap()
    for draft in ("mtp", "auto"):
        pipeline = load(str(glm_folder), draft=draft, adaptive=False).unwrap()
        assert pipeline.draft_kind == "mtp"
        for prompt in ("def fib", "hello world"):
            want = plain.generate(prompt).unwrap()
            got = pipeline.generate(prompt).unwrap()
            assert got.tokens == want.tokens
            assert got.stats.drafted > 0 and not got.stats.draft_errors


def test_a_converted_folder_keeps_the_head_as_a_companion(
    glm_folder: Path, tmp_path: Path
) -> None:
    loaded = load_model(str(glm_folder)).unwrap()
    out = tmp_path / "converted"
    save_folder(loaded, out).unwrap()
    assert (out / "mtp" / "config.json").is_file()
    plain = load(str(out)).unwrap()
    pipeline = load(str(out), draft="mtp", adaptive=False).unwrap()
    assert pipeline.draft_kind == "mtp"
    want = plain.generate("for i in range").unwrap()
    got = pipeline.generate("for i in range").unwrap()
    assert got.tokens == want.tokens and got.stats.drafted > 0


def test_a_qwen_head_does_not_bind_to_a_glm_target(glm_folder: Path) -> None:
    """The head's weights must be this architecture's: a strict load error."""
    loaded = load_model(str(glm_folder)).unwrap()
    wrong = {"fc.weight": mx.zeros((64, 128)), "bogus.weight": mx.zeros((3,))}
    failure = build_glm_mtp(loaded.args, wrong).failure()  # type: ignore[arg-type]
    assert "do not match" in failure.message and "bogus" in failure.message


def test_a_bfloat16_load_keeps_the_router_bias_in_float32(glm_folder: Path) -> None:
    """transformers keeps `e_score_correction_bias` in float32; a bfloat16
    copy could reorder near-tied experts."""
    loaded = load_model(str(glm_folder), "bfloat16").unwrap()
    params = flat_parameters(loaded.model)
    biases = [v for k, v in params.items() if k.endswith("e_score_correction_bias")]
    assert biases and all(b.dtype == mx.float32 for b in biases)
    assert params["model.embed_tokens.weight"].dtype == mx.bfloat16
    assert loaded.mtp["mlp.gate.e_score_correction_bias"].dtype == mx.float32
    pipeline = load(str(glm_folder), draft="mtp", dtype="bfloat16", adaptive=False)
    assert pipeline.unwrap().generate("def fib").unwrap().generated_tokens > 0


@pytest.mark.parametrize("generation", [1, 2])
def test_block_drafters_on_a_glm_target_are_plain_decoding(generation: int) -> None:
    """DFlash and DFlash2 read a GLM-4.5 MoE target's tapped layers too."""
    from test_dflash import dflash2_config, dflash_config, random_draft

    from specpipe.drafts.dflash import DFlashDrafter

    model = tiny_glm()
    model.tap((0, 1))
    config = dflash_config() if generation == 1 else dflash2_config()
    drafter = DFlashDrafter(model, random_draft(config, seed=7))
    params = SAMPLINGS["sampled"]
    plain, _ = run(model, PROMPTS[:3], params, max_tokens=12)
    spec, results = run(model, PROMPTS[:3], params, drafter, 3, max_tokens=12)
    assert spec == plain
    assert all(not r.metrics.draft_errors and r.metrics.drafted > 0 for r in results)
