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

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from returns.result import Success
from spec_support import PROMPTS, run
from test_mtp import scaled

from models.base import attention_mask, rope_offset
from models.build import build_model
from models.cache import KVCache
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
from tests.cli.conftest import write_tiny_model

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
    parsed = glm4_moe_args({**CONFIG, **overrides}, "test")
    assert isinstance(parsed, Success), parsed
    args: Glm4MoeArgs = parsed.unwrap()
    return args


@pytest.fixture(scope="module")
def target() -> Model:
    mx.random.seed(1)
    model = build_model(glm_args()).unwrap()
    assert isinstance(model, Model)
    scaled(model, 1)
    return model


def random_head(seed: int) -> GlmMtpHead:
    mx.random.seed(seed)
    head = GlmMtpHead(glm_args())
    scaled(head, seed)
    return head


def layer_input(
    head: GlmMtpHead, embeds: mx.array, hidden: mx.array, offsets: Sequence[int]
) -> tuple[mx.array, KVCache, mx.array]:
    """What a GLM MTP head's layer reads, by the head's formula: fc over the
    normed embeddings (a row's pair at position 0 blanked) and normed hidden
    states; with a fresh cache of the head's and the window's mask."""
    batch, length = embeds.shape[:2]
    first = mx.array([offset == 0 for offset in offsets])[:, None, None]
    blanked = mx.where(first & (mx.arange(length) == 0)[None, :, None], 0, embeds)
    x = head.fc(
        mx.concatenate(
            [head.pre_fc_norm_embedding(blanked), head.pre_fc_norm_hidden(hidden)],
            axis=-1,
        )
    )
    cache = head.make_cache(batch)
    cache.reserve(max(offsets) + length)
    return x, cache, attention_mask(offsets, length, cache.key_span(offsets, length))


def check_carried_and_normed(head: GlmMtpHead, out: mx.array) -> None:
    """A chained step reads the layer's output itself; the draw reads its norm."""
    normed = head.normed(out)
    assert head.carried(out, normed) is out
    assert mx.allclose(normed, head.norm(out)).item()


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
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[3]][:batch]
    params = SAMPLINGS[sampling]
    plain, _ = run(target, prompts, params, max_tokens=14)
    drafter = MtpDrafter(target, random_head(4))
    spec, results = run(target, prompts, params, drafter, depth, max_tokens=14)
    assert spec == plain
    assert all(not r.metrics.draft_errors and r.metrics.drafted > 0 for r in results)


def test_glm_mtp_with_a_draft_vocabulary(target: Model) -> None:
    vocab = DraftVocabulary(tuple(range(0, VOCAB, 2)))
    drafter = MtpDrafter(target, random_head(4), vocab=vocab)
    params = SAMPLINGS["sampled"]
    plain, _ = run(target, PROMPTS[:2], params, max_tokens=12)
    spec, results = run(target, PROMPTS[:2], params, drafter, 2, max_tokens=12)
    assert spec == plain and all(r.metrics.drafted > 0 for r in results)


# --- a checkpoint in the HF layout ---------------------------------------------


def checkpoint_names(target: Model, head: GlmMtpHead) -> dict[str, mx.array]:
    """The target's and the head's weights as a GLM-4.5 checkpoint names
    them: experts one by one, the MTP layer at `model.layers.{N}`."""
    n = CONFIG["num_hidden_layers"]
    out: dict[str, mx.array] = {}
    renamed = {
        "fc.": "eh_proj.",
        "pre_fc_norm_embedding.": "enorm.",
        "pre_fc_norm_hidden.": "hnorm.",
        "norm.": "shared_head.norm.",
        "layers.0.": "",
    }
    head_own = {}
    for key, value in flat_parameters(head).items():
        prefix = next(p for p in renamed if key.startswith(p))
        head_own[renamed[prefix] + key[len(prefix) :]] = value
    head_own["shared_head.head.weight"] = target.head_weights().weight
    sources = [
        (flat_parameters(target), ""),
        (head_own, f"model.layers.{n}."),
    ]
    for weights, prefix in sources:
        for key, value in weights.items():
            key = prefix + key
            if ".switch_mlp." in key:
                stem, name = key.split(".switch_mlp.")
                for e in range(value.shape[0]):
                    out[f"{stem}.experts.{e}.{name}"] = value[e]
            else:
                out[key] = value
    return out


@pytest.fixture(scope="module")
def glm_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny GLM-4.5 HF folder (320-token tokenizer) with its MTP layer."""
    folder = tmp_path_factory.mktemp("glm") / "target"
    write_tiny_model(folder)  # tokenizer files; config and weights replaced
    config = {**CONFIG, "vocab_size": 320, "architectures": ["Glm4MoeForCausalLM"]}
    (folder / "config.json").write_text(json.dumps(config))
    mx.random.seed(6)
    model = build_model(glm_args(vocab_size=320)).unwrap()
    assert isinstance(model, Model)
    scaled(model, 6)
    head = GlmMtpHead(glm_args(vocab_size=320))
    scaled(head, 7)
    weights = checkpoint_names(model, head)
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    return folder


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

    mx.random.seed(1)
    model = build_model(glm_args()).unwrap()
    assert isinstance(model, Model)
    scaled(model, 1)
    model.tap((0, 1))
    config = dflash_config() if generation == 1 else dflash2_config()
    drafter = DFlashDrafter(model, random_draft(config, seed=7))
    params = SAMPLINGS["sampled"]
    plain, _ = run(model, PROMPTS[:3], params, max_tokens=12)
    spec, results = run(model, PROMPTS[:3], params, drafter, 3, max_tokens=12)
    assert spec == plain
    assert all(not r.metrics.draft_errors and r.metrics.drafted > 0 for r in results)
