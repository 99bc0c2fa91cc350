"""DFlash drafts against the reference implementation: z-lab's `dflash`
package (`dflash.model.DFlashDraftModel`, PyTorch, installed by `.ci/run`
without its benchmark dependencies), random weights of a tiny config.

The draft's output over a block (the context's features stored in its cache
first) equals the reference forward's over the same features and block, for
bidirectional, causal and sliding-window layers, and its logits equal the
reference's `compute_logits` with a multiplier and a soft cap.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest
import torch
from dflash.model import DFlash2DraftModel, DFlashDraftModel
from transformers import Qwen3Config

from models.dflash import DFlashSettings, build_dflash, default_target_layers
from models.vocab_head import HeadWeights
from schemas.converter import hf, structure
from schemas.hf import DecoderArgs, normalize_hf_config
from schemas.request import DraftPolicy, SamplingParams
from specpipe.drafts.dflash import DFlashRows
from specpipe.state import RowState

HIDDEN, VOCAB = 64, 97


def config(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": HIDDEN,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": VOCAB,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 512,
        "attention_bias": False,
        "num_target_layers": 4,
        "dflash_config": {
            "target_layer_ids": [0, 2, 3],
            "block_size": 4,
            "mask_token_id": VOCAB - 1,
            "output_multiplier": 0.5,
            "final_logit_softcapping": 8.0,
        },
    }
    base.update(overrides)
    return base


def reference(
    settings: dict[str, Any], kind: type[DFlashDraftModel] = DFlashDraftModel
) -> DFlashDraftModel:
    """The reference model (DFlash or DFlash2) with random weights larger than
    its init's 0.02 std, so that outputs differ."""
    torch.manual_seed(0)
    model = kind(Qwen3Config(**settings)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("base_kernel"):  # (DFlash2's: left uninitialized)
                p.copy_(0.5 * torch.randn_like(p))
            elif p.ndim == 2:
                p.mul_(10.0)
            elif name.endswith("norm.weight"):
                p.add_(0.3 * torch.randn_like(p))
    return model


def reference_block(
    model: DFlashDraftModel, rows: int, context: int, block: int, seed: int
) -> tuple[np.ndarray, np.ndarray, torch.Tensor]:
    """Random context features and block embeddings, and the reference's
    output over them (the context at positions 0 .., the block after it)."""
    rng = np.random.default_rng(seed)
    features = rng.standard_normal((rows, context, 3 * HIDDEN)).astype(np.float32)
    noise = rng.standard_normal((rows, block, HIDDEN)).astype(np.float32)
    with torch.no_grad():
        want = model(
            position_ids=torch.arange(context + block)[None],
            noise_embedding=torch.from_numpy(noise),
            target_hidden=torch.from_numpy(features),
        )
    return features, noise, want


def ours(settings: dict[str, Any], model: torch.nn.Module) -> Any:
    args = structure(hf, normalize_hf_config(settings), DecoderArgs, "dflash").unwrap()
    weights = {k: mx.array(v.detach().numpy()) for k, v in model.state_dict().items()}
    return build_dflash(args, DFlashSettings.of(settings).unwrap(), weights).unwrap()


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"is_causal": True},
        # a sliding layer type without use_sliding_window: causal, no window
        {"layer_types": ["sliding_attention"] * 2, "sliding_window": 5},
        {
            "layer_types": ["sliding_attention"] * 2,
            "sliding_window": 5,
            "use_sliding_window": True,
        },
        {
            "layer_types": ["sliding_attention"] * 2,
            "sliding_window": 5,
            "use_sliding_window": True,
            "is_causal": False,
        },
        # layer types from max_window_layers: full, then sliding
        {"sliding_window": 3, "use_sliding_window": True, "max_window_layers": 1},
    ],
    ids=[
        "bidirectional",
        "causal",
        "sliding-type-no-window",
        "sliding-causal",
        "sliding-bidirectional",
        "window-layers",
    ],
)
def test_the_draft_forward_is_the_reference_s(overrides: dict[str, Any]) -> None:
    settings = config(**overrides)
    model = reference(settings)
    draft = ours(settings, model)
    context = 9
    features, noise, reference_out = reference_block(model, 1, context, 4, seed=1)
    want = reference_out.numpy()
    cache = draft.make_cache(1)
    # the context stored in two writes, as rounds store it
    draft.write_context(mx.array(features[:, :5]), cache, [0])
    draft.write_context(mx.array(features[:, 5:]), cache, [5])
    got = np.array(draft(mx.array(noise), cache, [context]))
    assert np.allclose(got, want, atol=1e-4, rtol=1e-4), np.abs(got - want).max()

    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    with torch.no_grad():
        want_logits = model.compute_logits(torch.from_numpy(got), head).numpy()
    logits = draft.logits(
        mx.array(got), HeadWeights(mx.array(head.weight.detach().numpy()))
    )
    assert np.allclose(np.array(logits), want_logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("targets", "drafts"), [(36, 5), (28, 1), (48, 3), (64, 8)])
def test_target_layers_a_config_leaves_out_are_the_reference_s(
    targets: int, drafts: int
) -> None:
    settings = config(num_target_layers=targets, num_hidden_layers=drafts)
    settings["dflash_config"] = {"mask_token_id": VOCAB - 1}
    torch.manual_seed(0)
    want = DFlashDraftModel(Qwen3Config(**settings)).target_layer_ids
    assert default_target_layers(targets, drafts) == want
    got = DFlashSettings.of(settings).unwrap().target_layers
    assert list(got) == want


def config2(**overrides: Any) -> dict[str, Any]:
    """A DFlash2 draft: convolutions of kernel 2 over groups of 16 channels,
    a selector of rank 8 over 6 candidates."""
    settings = config(architectures=["DFlash2DraftModel"], **overrides)
    settings["dflash_config"] = {
        **settings["dflash_config"],
        "conv_kernel_size": 2,
        "conv_group_size": 16,
        "selector_rank": 8,
        "selector_top_k": 6,
    }
    return settings


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {
            "layer_types": ["sliding_attention"] * 2,
            "sliding_window": 4,
            "use_sliding_window": True,
            "is_causal": False,
        },
    ],
    ids=["full", "sliding"],
)
def test_the_dflash2_forward_and_greedy_selection_are_the_reference_s(
    overrides: dict[str, Any],
) -> None:
    settings = config2(**overrides)
    model = reference(settings, DFlash2DraftModel)
    draft = ours(settings, model)
    context = 7
    features, noise, want = reference_block(model, 2, context, 5, seed=2)
    cache = draft.make_cache(2)
    draft.write_context(mx.array(features), cache, [0, 0])
    got = draft(mx.array(noise), cache, [context, context])
    assert np.allclose(np.array(got), want.numpy(), atol=1e-4, rtol=1e-4)

    # the selector's greedy path over the draft positions (1 ..), from the
    # block's first token, through the reference's head
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    anchors = torch.tensor([5, 17])
    with torch.no_grad():
        path, _, _ = model.propose(want[:, 1:], anchors, head, 0.0)
    rows = DFlashRows(
        None,  # type: ignore[arg-type]  (the selection reads no target)
        draft,
        HeadWeights(mx.array(head.weight.detach().numpy())),
        DraftPolicy(),
        cache,
        (context, context),
        (mx.zeros((0, 3 * HIDDEN)),) * 2,
    )
    normed = got[:, 1:]
    logits = draft.logits(normed, rows.head)
    greedy = [RowState.start((1, 2, 3), 8, SamplingParams()) for _ in range(2)]
    params = [SamplingParams()] * 2
    selected = rows._select(normed, logits, mx.array(anchors.numpy()), greedy, params)
    assert np.array(selected).tolist() == path.numpy().tolist()
