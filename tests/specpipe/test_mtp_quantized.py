"""Quantized MTP heads: `convert --quantize N` quantizes the `mtp/` companion
as it quantizes the target, a target that bundles quantized `mtp.*` weights
loads its head quantized, drafting with either stays lossless, and a
companion whose config does not describe its tensors is refused clearly."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from spec_support import run
from test_mtp import CONFIG, copy_head, repeating_target, scaled
from test_mtp_companion import LIMITS, PROMPTS, write_hybrid

from models.build import (
    build_model,
    quantization_block,
    quantize_layers,
    quantize_model,
)
from models.mtp import MtpHead
from schemas.hf_hybrid import hybrid_args
from schemas.request import SamplingParams
from specpipe.api import load
from specpipe.cli import main
from specpipe.drafts.mtp import MtpDrafter
from tests.cli.conftest import write_tiny_model

VOCAB = 320
SAMPLINGS = [SamplingParams(), SamplingParams(temperature=0.8, top_k=40, seed=3)]


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hybrid(tmp_path_factory.mktemp("qhybrid") / "target")


@pytest.fixture(scope="module", params=[4, 8])
def converted(
    request: pytest.FixtureRequest,
    hybrid: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[int, Path]:
    bits: int = request.param
    out = tmp_path_factory.mktemp(f"q{bits}") / "converted"
    main(["convert", str(hybrid), str(out), "--quantize", str(bits)])
    return bits, out


def float_head() -> MtpHead:
    """The head `write_hybrid` stores under `mtp.*` (same seed and scaling)."""
    args = hybrid_args({**CONFIG, "vocab_size": VOCAB}, "test").unwrap()
    mx.random.seed(1)
    head = MtpHead(args)
    scaled(head, 1, 2.5)
    return head


# a 4-bit head's per-layer entries: its MoE router and shared-expert gate
ROUTERS_AT_8 = {
    "layers.0.mlp.gate": {"group_size": 64, "bits": 8},
    "layers.0.mlp.shared_expert_gate": {"group_size": 64, "bits": 8},
}


def tokens(pipeline: Any, sampling: SamplingParams) -> list[tuple[int, ...]]:
    results = pipeline.generate_batch(PROMPTS, sampling, LIMITS).unwrap()
    assert all(not r.stats.draft_errors for r in results)
    return [r.tokens for r in results]


def head_logits(head: MtpHead, target: Any) -> mx.array:
    """The head's logits over a fixed window of (token, hidden) pairs."""
    ids = mx.array([[5, 17, 3, 200, 41, 9, 77]], dtype=mx.int32)
    hidden = target.final_norm(target(ids, target.make_cache(1), [0]).hidden)
    out = head(target.embed(ids[:, 1:]), hidden[:, :-1], head.make_cache(1), [0])
    logits = head.logits(out, target)
    mx.eval(logits)
    return logits


def test_convert_quantizes_the_companion(converted: tuple[int, Path]) -> None:
    bits, out = converted
    config = json.loads((out / "mtp" / "config.json").read_text())
    assert config["model_type"] == "qwen3_next_mtp"
    # the router and the shared expert's gate keep 8 bits (as mlx-lm's
    # conversions), in the target's config too, under its layers' paths
    routers = {} if bits == 8 else ROUTERS_AT_8
    target = json.loads((out / "config.json").read_text())["quantization"]
    assert (target["group_size"], target["bits"]) == (64, bits)
    assert {k for k in target if "." in k} == {
        f"model.layers.{i}.mlp.{name}"
        for i in range(CONFIG["num_hidden_layers"])
        for name in ("gate", "shared_expert_gate")
        if bits < 8
    }
    assert config["quantization"] == {"group_size": 64, "bits": bits, **routers}
    assert config["quantization_config"] == config["quantization"]
    weights = mx.load(str(out / "mtp" / "model.safetensors"))
    assert isinstance(weights, dict)
    hidden = CONFIG["hidden_size"]
    assert weights["layers.0.mlp.gate.weight"].shape[-1] == hidden * 8 // 32
    assert weights["fc.weight"].shape[-1] == 2 * hidden * bits // 32
    assert weights["fc.weight"].dtype == mx.uint32
    assert weights["layers.0.self_attn.q_proj.weight"].dtype == mx.uint32
    assert weights["layers.0.mlp.switch_mlp.gate_proj.weight"].dtype == mx.uint32
    # norms stay float; the shared embedding / projection are not in the head
    for name in (
        "norm.weight",
        "pre_fc_norm_hidden.weight",
        "pre_fc_norm_embedding.weight",
    ):
        assert weights[name].dtype == mx.float32
    assert not any(k.startswith(("embed", "lm_head")) for k in weights)
    # down_proj's input width (32) is no multiple of 64: float, as in the target
    assert weights["layers.0.mlp.switch_mlp.down_proj.weight"].dtype == mx.float32


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "t0.8"])
def test_quantized_companion_drafts_losslessly(
    converted: tuple[int, Path], sampling: SamplingParams
) -> None:
    _, out = converted
    plain = tokens(load(str(out)).unwrap(), sampling)
    for draft in ("auto", "mtp", str(out / "mtp")):
        pipeline = load(
            str(out), draft=draft, num_draft_tokens=3, adaptive=False
        ).unwrap()
        assert pipeline.draft_kind == "mtp" and pipeline.draft is not None
        head = pipeline.draft.drafter.head  # type: ignore[attr-defined]
        assert isinstance(head.fc, nn.QuantizedLinear)
        results = pipeline.generate_batch(PROMPTS, sampling, LIMITS).unwrap()
        assert [r.tokens for r in results] == plain
        assert all(r.stats.drafted > 0 and not r.stats.draft_errors for r in results)


def test_quantized_companion_logits(converted: tuple[int, Path]) -> None:
    """The companion's head is exactly the float head quantized in memory by
    `quantize_model`, and close to the float head."""
    bits, out = converted
    pipeline = load(str(out), draft="auto").unwrap()
    assert pipeline.draft is not None
    target = pipeline.target.model
    loaded = pipeline.draft.drafter.head  # type: ignore[attr-defined]
    reference = float_head()
    expected_float = head_logits(reference, target)
    quantize_model(reference, bits, 64)  # type: ignore[arg-type]
    in_memory = head_logits(reference, target)
    got = head_logits(loaded, target)
    assert np.array_equal(np.array(got), np.array(in_memory))
    error = np.abs(np.array(got) - np.array(expected_float)).max()
    scale = np.abs(np.array(expected_float)).max()
    # measured: 4-bit ~0.13, 8-bit ~0.01 of the largest logit
    assert 0 < error < (0.25 if bits == 4 else 0.03) * scale, (error, scale)


def test_bundled_quantized_head(tmp_path: Path) -> None:
    """A target folder whose checkpoint holds its `mtp.*` weights quantized
    (an MLX conversion that kept the head) loads the head quantized."""
    folder = write_tiny_model(tmp_path / "bundled")
    config = {
        **CONFIG,
        "vocab_size": VOCAB,
        "quantization": {"group_size": 64, "bits": 4},
    }
    (folder / "config.json").write_text(json.dumps(config))
    args = hybrid_args(config, "test").unwrap()
    mx.random.seed(0)
    model = build_model(args).unwrap()
    scaled(model, 0, 2.5)
    quantize_model(model, 4, 64)
    head = float_head()
    quantize_layers(head, 8, 32)  # the head's own precision: read from the shapes
    weights = dict(tree_flatten(model.parameters()))
    weights.update({f"mtp.{k}": v for k, v in tree_flatten(head.parameters())})
    mx.save_safetensors(str(folder / "model.safetensors"), weights)

    for sampling in SAMPLINGS:
        plain = tokens(load(str(folder)).unwrap(), sampling)
        native = load(str(folder), draft="auto").unwrap()
        assert native.draft_kind == "mtp" and native.draft is not None
        loaded = native.draft.drafter.head  # type: ignore[attr-defined]
        assert loaded.fc.bits == 8 and loaded.fc.group_size == 32
        assert tokens(native, sampling) == plain
    target = native.target.model
    assert np.array_equal(
        np.array(head_logits(loaded, target)), np.array(head_logits(head, target))
    )

    # converting it again keeps the head's quantized layers and describes them
    out = tmp_path / "reconverted"
    main(["convert", str(folder), str(out)])
    companion = json.loads((out / "mtp" / "config.json").read_text())
    assert companion["quantization"] == {"group_size": 32, "bits": 8}
    again = load(str(out), draft="auto").unwrap()
    assert tokens(again, SAMPLINGS[0]) == tokens(load(str(out)).unwrap(), SAMPLINGS[0])


def test_quantized_copy_head_is_accepted() -> None:
    """A quantized head drafts what its float self drafts where that is
    exact: the copy head (0/1 weights) on a repeating target."""
    repeating = repeating_target()
    head = copy_head(repeating)
    quantize_layers(head, 4, 64)
    assert quantization_block(head) == {"group_size": 64, "bits": 4, **ROUTERS_AT_8}
    prompts = [(3, 3, 3, 3), (7, 1, 7, 5, 5)]
    plain, _ = run(repeating, prompts, SamplingParams(), max_tokens=16)
    spec, results = run(
        repeating,
        prompts,
        SamplingParams(),
        MtpDrafter(repeating, head),
        3,
        max_tokens=16,
    )
    assert spec == plain
    assert all(r.metrics.accepted == r.metrics.drafted > 0 for r in results)


def edited(companion: Path, where: Path, **changes: Any) -> Path:
    shutil.copytree(companion, where)
    config = json.loads((where / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (where / "config.json").write_text(json.dumps(config))
    return where


def test_companion_quantization_mismatches_are_refused(
    hybrid: Path, tmp_path: Path
) -> None:
    quantized = tmp_path / "q4"
    main(["convert", str(hybrid), str(quantized), "--quantize", "4"])
    plain = tmp_path / "float"
    main(["convert", str(hybrid), str(plain)])

    def message(folder: Path) -> str:
        return str(load(str(quantized), draft=str(folder)).failure().message)

    undeclared = edited(
        quantized / "mtp", tmp_path / "a", quantization=None, quantization_config=None
    )
    text = message(undeclared)
    assert "quantized" in text and "declares no quantization" in text
    assert "specpipe convert --quantize" in text

    wrong_bits = edited(
        quantized / "mtp",
        tmp_path / "b",
        quantization={"group_size": 64, "bits": 8},
        quantization_config=None,
    )
    text = message(wrong_bits)
    assert "does not match the weights" in text
    assert "fc is 4-bit (group size 64) in the weights, 8-bit" in text

    per_layer = edited(
        quantized / "mtp",
        tmp_path / "c",
        quantization={"group_size": 64, "bits": 4, "fc": False},
    )
    assert "fc is 4-bit (group size 64) in the weights, float" in message(per_layer)

    declared_float = edited(
        plain / "mtp", tmp_path / "d", quantization={"group_size": 64, "bits": 4}
    )
    text = message(declared_float)
    assert "declares 4-bit (group size 64) quantization" in text
    assert "weights are float" in text

    malformed = edited(quantized / "mtp", tmp_path / "e", quantization={"bits": "four"})
    assert "integer bits and group_size" in message(malformed)

    other_mode = edited(
        quantized / "mtp",
        tmp_path / "f",
        quantization={"group_size": 32, "bits": 4, "mode": "mxfp4"},
    )
    assert "only MLX affine" in message(other_mode)

    # per-layer entries override the top level, layer by layer
    mixed = edited(
        quantized / "mtp",
        tmp_path / "g",
        quantization={"group_size": 64, "bits": 8, "fc": {"group_size": 64, "bits": 4}},
    )
    text = message(mixed)
    assert (
        "layers.0.mlp.switch_mlp.gate_proj is 4-bit (group size 64) in the weights, 8-bit"
        in text
    )
    assert "fc is" not in text and "mlp.gate is" not in text
    matching = edited(
        quantized / "mtp",
        tmp_path / "h",
        quantization={
            "group_size": 64,
            "bits": 4,
            "fc": {"group_size": 64, "bits": 4},
            **ROUTERS_AT_8,
        },
    )
    assert load(str(quantized), draft=str(matching)).unwrap().draft_kind == "mtp"
