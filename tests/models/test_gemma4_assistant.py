"""Gemma-4's assistant drafter (models/gemma4_assistant.py) against HF
transformers' `Gemma4AssistantForCausalLM`.

Tiny random configs in float32 on the CPU: the assistant's decoder has 3
layers (sliding, sliding, full) of 4 query heads whose widths (16 sliding,
32 full) are the target's (tests/models/test_gemma4.py's TINY), a hidden
size of 48 against the target's 64, a sliding window of 4. The keys and
values it reads are random arrays standing for the target's stored ones.

transformers 5.23 cannot build this model as it ships: its
`Gemma4TextConfig.kv_sharing_modes` raises when every layer is kv-shared
(no layer "produces" a cache), which an assistant's stack always is (and
so does `Gemma4UnifiedTextConfig`'s, a copy of it, for the unified
assistant). The `all_shared_stacks` fixture patches that one property of
both to answer "reuse" for every layer of such a stack, which is what the
assistant's attention reads.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
import torch
import transformers
from returns.result import Failure, Success
from transformers.models.gemma4 import configuration_gemma4
from transformers.models.gemma4_unified import configuration_gemma4_unified

from models.gemma4_assistant import Assistant
from models.layers import flat_parameters
from schemas.errors import ConfigError
from schemas.hf_gemma4_assistant import AssistantArgs, assistant_args
from specpipe.drafts.assistant import borrowed_masks
from tests.models.hybrid_support import hf_weights

pytestmark = pytest.mark.reference

VOCAB = 128
WINDOW = 4
BACKBONE = 64
SLIDING, FULL = "sliding_attention", "full_attention"
TEXT: dict[str, Any] = {
    "model_type": "gemma4_text",
    "vocab_size": VOCAB,
    "hidden_size": 48,
    "intermediate_size": 80,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "global_head_dim": 32,
    "layer_types": [SLIDING, SLIDING, FULL],
    "sliding_window": WINDOW,
    "hidden_size_per_layer_input": 0,
    "vocab_size_per_layer_input": 0,
    "num_kv_shared_layers": 3,
    "max_position_embeddings": 512,
}
TOL = 1e-4
# keys a unified text config does not have (no per-layer embeddings)
_PLE_KEYS = ("hidden_size_per_layer_input", "vocab_size_per_layer_input")


@pytest.fixture(scope="module", autouse=True)
def all_shared_stacks() -> Iterator[None]:
    """transformers 5.23's kv_sharing_modes (Gemma-4's and Gemma-4
    Unified's), answering "reuse" for a stack whose every layer is kv-shared
    (see the module doc)."""
    classes = (
        configuration_gemma4.Gemma4TextConfig,
        configuration_gemma4_unified.Gemma4UnifiedTextConfig,
    )
    shipped = {cls: cls.__dict__["kv_sharing_modes"] for cls in classes}

    def patched(original: Any) -> property:
        def modes(config: Any) -> list[str | None]:
            if config.num_kv_shared_layers == config.num_hidden_layers:
                return ["reuse"] * config.num_hidden_layers
            result: list[str | None] = original.fget(config)
            return result

        return property(modes)

    for cls, original in shipped.items():
        cls.kv_sharing_modes = patched(original)
    yield
    for cls, original in shipped.items():
        cls.kv_sharing_modes = original


def assistant_config(
    ordered: bool, unified: bool = False, **overrides: Any
) -> dict[str, Any]:
    """An assistant's config.json; `unified`: a `gemma4_unified_assistant`
    over a `gemma4_unified_text` stack (no per-layer-embedding keys)."""
    text = {**TEXT, **overrides}
    if unified:
        text = {k: v for k, v in text.items() if k not in _PLE_KEYS}
        text["model_type"] = "gemma4_unified_text"
    return {
        "model_type": "gemma4_unified_assistant" if unified else "gemma4_assistant",
        "text_config": text,
        "backbone_hidden_size": BACKBONE,
        "use_ordered_embeddings": ordered,
        "num_centroids": 8,
        "centroid_intermediate_top_k": 3,
    }


def hf_assistant(
    ordered: bool, seed: int = 0, unified: bool = False, **overrides: Any
) -> Any:
    """transformers' assistant (`Gemma4UnifiedAssistantForCausalLM` when
    `unified`) with random weights."""
    raw = assistant_config(ordered, unified, **overrides)
    text_class, config_class, model_class = (
        (
            transformers.Gemma4UnifiedTextConfig,
            transformers.Gemma4UnifiedAssistantConfig,
            transformers.Gemma4UnifiedAssistantForCausalLM,
        )
        if unified
        else (
            transformers.Gemma4TextConfig,
            transformers.Gemma4AssistantConfig,
            transformers.Gemma4AssistantForCausalLM,
        )
    )
    text = text_class(
        **{k: v for k, v in raw["text_config"].items() if k != "model_type"},
        attn_implementation="eager",
    )
    config = config_class(**{**raw, "text_config": text.to_dict()})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_class(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            scale = 0.1 if "norm" in name else 0.2
            param.copy_((1.0 if "norm" in name else 0.0) + scale * noise)
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.copy_(1.0 + 0.2 * torch.randn(buffer.shape, generator=gen))
            if name.endswith("token_ordering"):  # transformers inits it to zeros
                buffer.copy_(torch.randperm(VOCAB, generator=gen))
    return model


def parsed(raw: dict[str, Any]) -> AssistantArgs:
    result = assistant_args(raw, "test config")
    assert isinstance(result, Success), result
    args: AssistantArgs = result.unwrap()
    return args


def ours(hf: Any) -> Assistant:
    args = parsed(hf.config.to_dict())
    model = Assistant(args)
    model.load_weights(list(model.sanitize(hf_weights(hf)).items()), strict=True)
    return model


def random_kv(batch: int, length: int, seed: int) -> dict[str, tuple[Any, Any]]:
    """Per layer type, keys and values [B, 2, length, D] standing for the target's."""
    gen = torch.Generator().manual_seed(seed)
    return {
        kind: (
            torch.randn(batch, 2, length, dim, generator=gen),
            torch.randn(batch, 2, length, dim, generator=gen),
        )
        for kind, dim in ((SLIDING, 16), (FULL, 32))
    }


def hf_step(
    hf: Any, x: torch.Tensor, kv: dict[str, tuple[Any, Any]], position: int
) -> tuple[np.ndarray, np.ndarray]:
    """transformers' assistant at `position` over keys/values of positions < it."""
    length = kv[FULL][0].shape[2]
    with torch.no_grad():
        out = hf(
            inputs_embeds=x,
            position_ids=torch.tensor([[position]]),
            shared_kv_states=kv,
            attention_mask=torch.ones(x.shape[0], length + 1, dtype=torch.long),
        )
    return out.logits.numpy(), out.last_hidden_state.numpy()


def our_step(
    model: Assistant,
    x: torch.Tensor,
    kv: dict[str, tuple[Any, Any]],
    positions: list[int],
) -> tuple[np.ndarray, np.ndarray]:
    borrowed = {
        k: (mx.array(a.numpy()), mx.array(b.numpy())) for k, (a, b) in kv.items()
    }
    span = int(borrowed[FULL][0].shape[2])
    masks = borrowed_masks(positions, span, model.layer_types, model.sliding_window)
    rope_at: int | mx.array = (
        positions[0] if len(positions) == 1 else mx.array(positions, dtype=mx.int32)
    )
    logits, hidden = model(mx.array(x.numpy()), borrowed, masks, rope_at)
    return np.array(logits), np.array(hidden)


def test_the_config_reads_as_transformers_does() -> None:
    hf = hf_assistant(ordered=True)
    args = parsed(hf.config.to_dict())
    text = args.text
    assert (args.backbone_hidden_size, args.num_centroids) == (BACKBONE, 8)
    assert args.use_ordered_embeddings and args.centroid_intermediate_top_k == 3
    assert text.num_kv_shared_layers == 3 and text.layer_types == (
        SLIDING,
        SLIDING,
        FULL,
    )
    assert (text.head_dim_of(SLIDING), text.head_dim_of(FULL)) == (16, 32)
    # transformers' default: a nested config naming no shared layers shares all
    raw = assistant_config(False)
    raw["text_config"] = {**TEXT, "num_kv_shared_layers": 0}
    assert parsed(raw).text.num_kv_shared_layers == 3
    names = {k for k in flat_parameters(Assistant(args))}
    assert names == set(ours(hf).sanitize(dict.fromkeys(hf.state_dict(), mx.zeros(1))))


@pytest.mark.parametrize(
    ("raw", "named"),
    [
        ({**assistant_config(False), "model_type": "gemma4_text"}, "model_type"),
        ({**assistant_config(False), "text_config": None}, "text_config"),
        ({**assistant_config(True), "num_centroids": 7}, "num_centroids"),
        (
            {**assistant_config(True), "centroid_intermediate_top_k": 9},
            "centroid_intermediate_top_k",
        ),
        (
            {**assistant_config(False), "backbone_hidden_size": 0},
            "backbone_hidden_size",
        ),
        (assistant_config(False, hidden_size_per_layer_input=8), "per_layer_input"),
        (assistant_config(False, num_kv_shared_layers=2), "num_kv_shared_layers"),
        (
            assistant_config(
                False,
                enable_moe_block=True,
                num_experts=2,
                top_k_experts=1,
                moe_intermediate_size=8,
            ),
            "enable_moe_block",
        ),
    ],
)
def test_configs_it_cannot_run_are_errors_naming_the_key(
    raw: dict[str, Any], named: str
) -> None:
    result = assistant_args(raw, "draft/config.json")
    assert isinstance(result, Failure)
    error = result.failure()
    assert isinstance(error, ConfigError)
    assert "draft/config.json" in error.message and named in error.message


@pytest.mark.parametrize("ordered", [False, True])
@pytest.mark.parametrize("length", [3, 11])  # within, and past, the sliding window
def test_a_step_matches_transformers(ordered: bool, length: int) -> None:
    hf = hf_assistant(ordered, seed=length)
    model = ours(hf)
    kv = random_kv(1, length, seed=length)
    x = torch.randn(1, 1, 2 * BACKBONE, generator=torch.Generator().manual_seed(3))
    theirs = hf_step(hf, x, kv, length)
    mine = our_step(model, x, kv, [length])
    assert np.abs(mine[0] - theirs[0]).max() < TOL
    assert np.abs(mine[1] - theirs[1]).max() < TOL
    if ordered:  # the top clusters' tokens, and the fill below them
        assert (mine[0] == mine[0].min()).sum() == VOCAB - 3 * VOCAB // 8


def test_rows_at_different_positions_are_each_rows_own_step() -> None:
    """Rows of one batch read keys/values up to their own positions; each
    row's logits are its step alone (one row at a time against transformers)."""
    hf = hf_assistant(ordered=False, seed=5)
    model = ours(hf)
    kv = random_kv(2, 12, seed=7)
    x = torch.randn(2, 1, 2 * BACKBONE, generator=torch.Generator().manual_seed(4))
    positions = [12, 6]
    both = our_step(model, x, kv, positions)
    for row, p in enumerate(positions):
        alone = {
            k: (a[row : row + 1, :, :p], b[row : row + 1, :, :p])
            for k, (a, b) in kv.items()
        }
        theirs = hf_step(hf, x[row : row + 1], alone, p)
        assert np.abs(both[0][row] - theirs[0][0]).max() < TOL, row
        assert np.abs(both[1][row] - theirs[1][0]).max() < TOL, row


@pytest.mark.parametrize("group", [16, 32])
def test_the_centroid_head_reads_quantized_rows_of_any_group(group: int) -> None:
    """A kept GGUF target's head rows (groups of 32, or a K type's 16, which
    MLX's dequantize does not take) come back as the rows' float weights."""
    from models.gemma4_assistant import _head_rows
    from models.parallel import dequantized
    from models.vocab_head import HeadWeights

    mx.random.seed(group)
    rows, width = 40, 256
    halves = mx.random.randint(0, 1 << 16, (rows, width * 6 // 32, 2))
    packed = (halves[..., 0] << 16 | halves[..., 1]).astype(mx.uint32)
    scales = mx.random.uniform(0.001, 0.01, (rows, width // group))
    biases = -32 * scales
    head = HeadWeights(packed, scales, biases, group, 6)
    ids = mx.array([7, 0, 39, 7])
    want = np.array(dequantized(packed, scales, biases, group, 6))[[7, 0, 39, 7]]
    # (MLX's GPU dequantize, which groups of 32 take, rounds scale * q + bias
    # otherwise than the CPU: within float32's rounding, H100 2026-12-06)
    np.testing.assert_allclose(
        np.array(_head_rows(head, ids)), want, rtol=1e-5, atol=1e-7
    )
