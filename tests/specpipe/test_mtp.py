"""Native MTP drafting on a hybrid (Qwen3-Next) target: lossless, batched,
with rollback of the target's recurrent state, and with FR-Spec."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten, tree_unflatten
from spec_support import run, scale_matrices

from models.build import build_model
from models.mtp import MtpHead
from schemas.hf_hybrid import HybridArgs, hybrid_args
from schemas.request import SamplingParams
from specpipe.draft_vocab import DraftVocabulary
from specpipe.drafts.mtp import MtpDrafter

VOCAB = 96
CONFIG: dict[str, Any] = {
    "model_type": "qwen3_next",
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "full_attention"] * 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
    "max_position_embeddings": 512,
}
PROMPTS = ((1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3), (9, 10, 11, 9, 10), (42, 7), (5,) * 17)
SAMPLINGS = [
    SamplingParams(),
    SamplingParams(temperature=0.7, top_p=0.9, top_k=30, seed=4),
    SamplingParams(temperature=1.0, seed=8),
]


def args() -> HybridArgs:
    parsed: HybridArgs = hybrid_args(CONFIG, "test").unwrap()
    return parsed


def scaled(module: Any, seed: int, gain: float = 2.5) -> None:
    """Every matrix times `gain`: varied greedy output, peaked sampling."""
    mx.random.seed(seed)
    scale_matrices(module, gain, stacked=True)


@pytest.fixture(scope="module")
def target() -> Any:
    mx.random.seed(0)
    model = build_model(args()).unwrap()
    scaled(model, 0, 2.5)  # varied greedy output, peaked sampling
    return model


def random_head(seed: int) -> MtpHead:
    mx.random.seed(seed)
    head = MtpHead(args())
    scaled(head, seed, 2.5)
    return head


def copy_head(target: Any) -> MtpHead:
    """A head whose output is its (normalised) hidden input: it drafts the
    target's own prediction for the position it pairs with, i.e. it proposes
    to repeat the pending token. On a target that repeats itself (greedy on
    unscaled random weights) every draft is accepted."""
    head = MtpHead(args())
    H = args().hidden_size
    params = dict(tree_flatten(head.parameters()))
    fc = mx.concatenate([mx.zeros((H, H)), mx.eye(H)], axis=1)
    updates = {"fc.weight": fc}
    for name, value in params.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            updates[name] = mx.zeros_like(value)  # the layer adds nothing: identity
        if name.startswith("layers.0.mlp.switch_mlp") or "shared_expert" in name:
            updates[name] = mx.zeros_like(value)
    head.update(tree_unflatten(list(updates.items())))
    mx.eval(head.parameters())
    return head


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "t0.7-filters", "t1.0"])
@pytest.mark.parametrize("depth", [1, 3])
@pytest.mark.parametrize("device_round", [True, False])
def test_mtp_output_equals_plain(
    target: Any, sampling: SamplingParams, depth: int, device_round: bool
) -> None:
    plain, _ = run(target, PROMPTS, sampling, max_tokens=14)
    drafter = MtpDrafter(target, random_head(3))
    spec, results = run(
        target,
        PROMPTS,
        sampling,
        drafter,
        depth,
        max_tokens=14,
        device_round=device_round,
    )
    assert spec == plain
    assert all(r.metrics.draft_errors == [] for r in results)
    assert all(r.metrics.drafted > 0 for r in results)
    for prompt, expected in zip(PROMPTS, plain, strict=True):
        single, _ = run(target, [prompt], sampling, drafter, depth, max_tokens=14)
        assert single == [expected]


def repeating_target() -> Any:
    """A target whose residual stream is its input embedding (every layer
    scaled to ~0) and whose head is that embedding: it predicts its input
    token, so greedy decoding repeats the pending token forever."""
    mx.random.seed(0)
    tied = hybrid_args({**CONFIG, "tie_word_embeddings": True}, "test").unwrap()
    return repeating(build_model(tied).unwrap())


def repeating(model: Any) -> Any:
    """`model` (tied embeddings) with every matrix but its embedding scaled
    to ~0: its residual stream is its input embedding, so it predicts its
    input token."""
    model.update(
        tree_unflatten(
            [
                (k, v if "embed_tokens" in k or v.ndim < 2 else v * 0.01)
                for k, v in tree_flatten(model.parameters())
            ]
        )
    )
    mx.eval(model.parameters())
    return model


def test_copy_head_gives_long_acceptances() -> None:
    repeating = repeating_target()
    prompts = [(3, 3, 3, 3), (7, 1, 7, 5, 5)]  # ending in a repeat, like the output
    plain, _ = run(repeating, prompts, SamplingParams(), max_tokens=24)
    assert plain == [[3] * 24, [5] * 24]  # the regime under test
    head = copy_head(repeating)
    spec, results = run(
        repeating,
        prompts,
        SamplingParams(),
        MtpDrafter(repeating, head),
        4,
        max_tokens=24,
    )
    assert spec == plain
    for r in results:
        assert r.metrics.accepted == r.metrics.drafted, r.metrics
        assert r.metrics.acceptance_length == pytest.approx(24 / 5, abs=0.3)


def test_mtp_with_draft_vocabulary(target: Any) -> None:
    for sampling in SAMPLINGS:
        plain, _ = run(target, PROMPTS, sampling, max_tokens=12)
        full = DraftVocabulary.create(range(VOCAB), VOCAB).unwrap()
        listed, with_full = run(
            target,
            PROMPTS,
            sampling,
            MtpDrafter(target, random_head(3), vocab=full),
            3,
            max_tokens=12,
        )
        _, unlisted = run(
            target,
            PROMPTS,
            sampling,
            MtpDrafter(target, random_head(3)),
            3,
            max_tokens=12,
        )
        assert listed == plain
        # a list of every id drafts exactly what the full head drafts
        assert [r.metrics.accepted for r in with_full] == [
            r.metrics.accepted for r in unlisted
        ]
        half = DraftVocabulary.create(range(0, VOCAB, 2), VOCAB).unwrap()
        small, _ = run(
            target,
            PROMPTS,
            sampling,
            MtpDrafter(target, random_head(3), vocab=half),
            3,
            max_tokens=12,
        )
        assert small == plain
