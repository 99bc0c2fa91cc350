"""DeepSpec's Gemma-4 DSpark drafter (`Gemma4DSparkModel`: models/dspark.py's
`Gemma4DSparkDraft`) on a tiny Gemma-4 target (tests/models/test_gemma4.py).

- The draft's cached forward (context in two chunks, rows of different
  lengths) equals a one-piece forward of Gemma-4's formulas written here in
  numpy (float64): heads of `global_head_dim`, q/k RMSNorm times weight, v
  RMSNorm without one, "proportional" RoPE with a partial rotary factor and
  a factor, softmax scale 1, four norms and `layer_scalar` per layer, GeGLU,
  the embedding times sqrt(H), logits capped before the Markov bias; with
  v_proj and with `attention_k_eq_v` (one KV head, attention biases). Its
  greedy drafts are the formulas' at depths below, at and past the block.
- A commit of any accepted counts leaves the draft where a draft opened
  fresh over the committed tokens is.
- Lossless: greedy and seeded sampled output == plain decoding, B=1 and B=3,
  depth 1 and the block; a draft whose Markov head knows plain decoding's
  bigrams has whole chains accepted and stays lossless; the prompt cache
  resumes it.
- Binding: detection and loading from a folder (the width pinned to the
  block, the target's taps), and clear errors for drafts that do not fit
  (a non-Gemma-4 target, hidden size, taps, vocabulary, config keys the
  drafter does not have, weights of another config).
"""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from block_support import (
    as_target,
    check_a_commit_leaves_a_fresh_open,
    check_dspark_binds,
    check_dspark_refused,
    check_greedy_drafts,
    check_output_is_plain,
    check_prompt_cache_resumes,
    features,
    start_rows,
    two_rows_in_context,
)
from mlx.utils import tree_flatten, tree_unflatten
from returns.result import Failure, Success
from spec_support import PROMPTS, PlainReference, run, tiny_model, write_artifact

from bindings.kinds import default_registry
from bindings.registry import DraftLoadRequest
from models.dspark import DSparkSettings, Gemma4DSparkDraft, gemma4_draft_args
from models.gemma4 import Model
from models.vocab_head import HeadWeights
from schemas.request import SamplingParams
from specpipe.drafts.dspark import DSparkDrafter
from tests.models.test_gemma4 import tiny_gemma

pytestmark = pytest.mark.reference  # (the tiny target comes from test_gemma4)

VOCAB = 128  # the tiny Gemma-4 target's
HIDDEN = 64
MASK = VOCAB - 1
BLOCK = 4
RANK = 8
TAPS = [1, 4]  # of the target's six layers
FULL = "full_attention"


def gemma_dspark_config(**overrides: Any) -> dict[str, Any]:
    """A tiny Gemma-4 DSpark draft as DeepSpec writes one: its target's
    Gemma-4 text config (with the target's `per_layer_config`, whose layer
    indices are not the draft's), two full-attention layers, and DSpark's
    keys (a vanilla Markov head and a confidence head)."""
    config: dict[str, Any] = {
        "architectures": ["Gemma4DSparkModel"],
        "model_type": "gemma4_text",
        "target_model_type": "gemma4_text",
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_target_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "global_head_dim": 32,
        "num_global_key_value_heads": None,
        "attention_k_eq_v": False,
        "attention_bias": False,
        "per_layer_config": {"2": {"head_dim": 32}, "5": {"head_dim": 32}},
        "layer_types": [FULL, FULL],
        "sliding_window": 4,
        "hidden_size_per_layer_input": 0,
        "vocab_size_per_layer_input": VOCAB,
        "enable_moe_block": False,
        "num_kv_shared_layers": 0,
        "use_double_wide_mlp": False,
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 512,
        "final_logit_softcapping": 3.0,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            FULL: {
                "rope_type": "proportional",
                "partial_rotary_factor": 0.5,
                "rope_theta": 10_000.0,
                "factor": 2.0,
            },
        },
        "tie_word_embeddings": False,
        "target_layer_ids": TAPS,
        "block_size": BLOCK,
        "mask_token_id": MASK,
        "num_anchors": 512,
        "markov_rank": RANK,
        "markov_head_type": "vanilla",
        "enable_confidence_head": True,
        "confidence_head_with_markov": True,
    }
    config.update(overrides)
    return config


# the layers' variants: v_proj; keys = values (one KV head), attention
# biases, no Markov head
VARIANTS: dict[str, dict[str, Any]] = {
    "v-proj": {},
    "k-eq-v": {
        "attention_k_eq_v": True,
        "num_global_key_value_heads": 1,
        "attention_bias": True,
        "markov_rank": 0,
        "enable_confidence_head": False,
    },
}


def random_draft(
    config: dict[str, Any], seed: int = 5, gain: float = 2.5
) -> Gemma4DSparkDraft:
    """Random weights: matrices scaled by `gain`, norms and `layer_scalar`
    near 1, biases near 0 (none of them trivial)."""
    args = gemma4_draft_args(config, "test draft")
    assert isinstance(args, Success), args
    mx.random.seed(seed)
    draft = Gemma4DSparkDraft(args.unwrap(), DSparkSettings.of(config).unwrap())
    params = []
    for name, value in tree_flatten(draft.parameters()):
        noise = mx.random.normal(value.shape)
        if value.ndim >= 2:
            params.append((name, value * gain))
        elif name.endswith(".bias"):
            params.append((name, 0.1 * noise))
        else:
            params.append((name, 1.0 + 0.2 * noise))
    draft.update(tree_unflatten(params))
    mx.eval(draft.parameters())
    return draft


@pytest.fixture(scope="module")
def gemma() -> Model:
    """A tiny Gemma-4 target (sliding and full layers, a MoE block, full
    layers with keys = values, a kv-shared layer, capped logits; its greedy
    output varies, unlike the other tiny cases'), tapping the draft's layers."""
    model = tiny_gemma("moe-keqv")
    model.tap(TAPS)
    return model


@pytest.fixture(scope="module")
def gemma_plain(gemma: Model) -> PlainReference:
    return PlainReference(gemma)


# --- the formulas ----------------------------------------------------------------


def _np(x: mx.array) -> np.ndarray:
    return np.array(x.astype(mx.float32), dtype=np.float64)


def _rms(x: np.ndarray, weight: np.ndarray | None, eps: float) -> np.ndarray:
    normed = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return normed if weight is None else normed * weight


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))


def _proportional_rope(
    t: np.ndarray,  # [n, heads, D]
    positions: np.ndarray,  # [n]
    rope: dict[str, Any],
) -> np.ndarray:
    """transformers' proportional RoPE: rotate-half pairs (i, i + D/2), the
    first int(partial * D / 2) at theta^(-2i/D) / factor, the rest unrotated."""
    dim = t.shape[-1]
    pairs, rotated = dim // 2, int(rope["partial_rotary_factor"] * dim // 2)
    inverse = np.zeros(pairs)
    inverse[:rotated] = rope["rope_theta"] ** (-np.arange(rotated) * 2.0 / dim)
    inverse = inverse / rope["factor"]
    angle = positions[:, None, None] * np.concatenate([inverse, inverse])
    half = np.concatenate([-t[..., pairs:], t[..., :pairs]], axis=-1)
    return t * np.cos(angle) + half * np.sin(angle)


def reference_outputs(
    draft: Gemma4DSparkDraft,
    config: dict[str, Any],
    features: mx.array,  # [1, P, n H] the context positions'
    pending: int,
    length: int,
) -> tuple[np.ndarray, np.ndarray]:  # outputs [L, H], capped logits [L, V]
    """The block [pending, mask, ...] at positions P .. P + L - 1 over the
    context (positions 0 .. P - 1) in one piece, from the formulas."""
    p = {name: _np(value) for name, value in tree_flatten(draft.parameters())}
    eps, heads, dim = config["rms_norm_eps"], config["num_attention_heads"], 32
    shared = config["attention_k_eq_v"]
    kv = (
        config["num_global_key_value_heads"]
        if shared
        else config["num_key_value_heads"]
    )
    rope = config["rope_parameters"][FULL]

    def linear(x: np.ndarray, name: str) -> np.ndarray:
        out = x @ p[name + ".weight"].T
        return out + p[name + ".bias"] if name + ".bias" in p else out

    context = _np(features[0])
    start = context.shape[0]
    positions = np.arange(start + length, dtype=np.float64)
    ctx = _rms(context @ p["fc.weight"].T, p["hidden_norm.weight"], eps)
    h = p["embed_tokens.weight"][[pending] + [MASK] * (length - 1)] * np.sqrt(HIDDEN)
    for i in range(config["num_hidden_layers"]):
        a = f"layers.{i}."
        normed = _rms(h, p[a + "input_layernorm.weight"], eps)
        both = np.concatenate([ctx, normed])
        q = linear(normed, a + "self_attn.q_proj").reshape(length, heads, dim)
        k = linear(both, a + "self_attn.k_proj").reshape(-1, kv, dim)
        v = k if shared else linear(both, a + "self_attn.v_proj").reshape(-1, kv, dim)
        q = _proportional_rope(
            _rms(q, p[a + "self_attn.q_norm.weight"], eps), positions[start:], rope
        )
        k = _proportional_rope(
            _rms(k, p[a + "self_attn.k_norm.weight"], eps), positions, rope
        )
        v = _rms(v, None, eps)
        k, v = np.repeat(k, heads // kv, axis=1), np.repeat(v, heads // kv, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k)  # scale 1; every key visible
        weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
        weights = weights / weights.sum(axis=-1, keepdims=True)
        attended = np.einsum("hqk,khd->qhd", weights, v).reshape(length, -1)
        out = linear(attended, a + "self_attn.o_proj")
        h = h + _rms(out, p[a + "post_attention_layernorm.weight"], eps)
        m = _rms(h, p[a + "pre_feedforward_layernorm.weight"], eps)
        m = _gelu_tanh(linear(m, a + "mlp.gate_proj")) * linear(m, a + "mlp.up_proj")
        m = linear(m, a + "mlp.down_proj")
        h = (h + _rms(m, p[a + "post_feedforward_layernorm.weight"], eps)) * p[
            a + "layer_scalar"
        ]
    out = _rms(h, p["norm.weight"], eps)
    cap = config["final_logit_softcapping"]
    return out, cap * np.tanh(out @ p["lm_head.weight"].T / cap)


def reference_drafts(
    draft: Gemma4DSparkDraft,
    config: dict[str, Any],
    features: mx.array,
    pending: int,
    depth: int,
) -> list[int]:
    """Greedy, slot by slot: argmax of the capped logits plus the vanilla
    Markov bias markov_w2 @ markov_w1[previous] (the pending token first)."""
    _, logits = reference_outputs(draft, config, features, pending, max(BLOCK, depth))
    p = {name: _np(value) for name, value in tree_flatten(draft.parameters())}
    previous, drafted = pending, []
    for k in range(depth):
        step = logits[k]
        if config["markov_rank"]:
            w1 = p["markov_head.markov_w1.weight"]
            step = step + p["markov_head.markov_w2.weight"] @ w1[previous]
        previous = int(np.argmax(step))
        drafted.append(previous)
    return drafted


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_cached_forward_and_drafts_are_the_formulas(
    gemma: Model, variant: str
) -> None:
    config = gemma_dspark_config(**VARIANTS[variant])
    draft = random_draft(config)
    prompts, context, cache = two_rows_in_context(gemma, draft)
    block = mx.array([[p[-1]] + [MASK] * (BLOCK - 1) for p in prompts])
    starts = [len(p) - 1 for p in prompts]
    normed = draft(draft.embed(block), cache, starts)
    logits = draft.logits(normed, HeadWeights.of(draft.lm_head))
    for b, prompt in enumerate(prompts):
        want, capped = reference_outputs(draft, config, context[b], prompt[-1], BLOCK)
        np.testing.assert_allclose(_np(normed[b]), want, atol=2e-4, rtol=2e-4)
        np.testing.assert_allclose(_np(logits[b]), capped, atol=2e-4, rtol=2e-4)
    assert np.abs(_np(logits)).max() <= 3.0  # final_logit_softcapping
    # the drafter's proposals: the formulas' greedy drafts, any depth
    check_greedy_drafts(
        DSparkDrafter(gemma, draft),
        prompts,
        context,
        (1, BLOCK, BLOCK + 2),
        lambda row, pending, depth: reference_drafts(
            draft, config, row, pending, depth
        ),
    )


@pytest.mark.parametrize("depth", [BLOCK, 0], ids=["drafted", "plain-round"])
def test_a_commit_leaves_the_draft_of_a_fresh_open(gemma: Model, depth: int) -> None:
    """After a round (drafted: accepted 0, 2 and the whole block; or a
    plain round, where the draft stores nothing), the draft's context and
    drafts are a fresh draft's over the committed tokens."""
    drafter = DSparkDrafter(gemma, random_draft(gemma_dspark_config()))
    assert isinstance(drafter.draft, Gemma4DSparkDraft)
    width = len(TAPS) * HIDDEN
    check_a_commit_leaves_a_fresh_open(gemma, drafter, depth, BLOCK, MASK, width)


# --- lossless --------------------------------------------------------------------

SAMPLINGS = {
    "greedy": SamplingParams(),
    "t0.8-topk": SamplingParams(temperature=0.8, top_k=20, seed=3),
}


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
@pytest.mark.parametrize("depth", [1, BLOCK])
@pytest.mark.parametrize("batch", [1, 3])
def test_gemma4_dspark_output_is_plain_decoding(
    gemma: Model, gemma_plain: PlainReference, sampling: str, depth: int, batch: int
) -> None:
    prompts = PROMPTS[:batch]
    params = SAMPLINGS[sampling]
    drafter = DSparkDrafter(gemma, random_draft(gemma_dspark_config(), seed=7))
    check_output_is_plain(gemma, prompts, params, drafter, depth, gemma_plain)


def bigram_draft(outputs: list[list[int]]) -> Gemma4DSparkDraft:
    """A draft whose Markov head (of rank V) adds 50 to the (capped, so at
    most 3 in size) logit of the token that follows the previous one in
    `outputs`: it drafts whole chains wherever it knows them."""
    follows = {}
    for sequence in outputs:
        follows.update(pairwise(sequence))
    draft = random_draft(gemma_dspark_config(markov_rank=VOCAB), seed=7)
    draft.markov_head.markov_w1.weight = mx.eye(VOCAB)
    table = np.zeros((VOCAB, VOCAB), dtype=np.float32)
    for previous, following in follows.items():
        table[following, previous] = 50.0
    draft.markov_head.markov_w2.weight = mx.array(table)
    return draft


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
def test_drafts_chained_by_the_markov_head_are_accepted(
    gemma: Model, gemma_plain: PlainReference, sampling: str
) -> None:
    prompts = PROMPTS[:3]
    params = SAMPLINGS[sampling]
    want = gemma_plain(prompts, params)
    draft = bigram_draft([[*p, *o] for p, o in zip(prompts, want, strict=True)])
    tokens, results = run(gemma, prompts, params, DSparkDrafter(gemma, draft), BLOCK)
    assert tokens == want
    # half the tokens or more were accepted drafts, whole blocks among them
    # (where a bigram's successor is ambiguous, the chain breaks)
    assert sum(r.metrics.accepted for r in results) >= 24  # of 48
    assert sum(r.metrics.accepted_at[BLOCK - 1] for r in results) >= 3


def test_the_prompt_cache_resumes_the_gemma4_dspark_draft(gemma: Model) -> None:
    """A conversation's next turn starts from the first turn's checkpoint
    and decodes as a run without the cache does, its drafts accepted as
    without the cache."""
    check_prompt_cache_resumes(
        gemma,
        SAMPLINGS["t0.8-topk"],
        lambda output: DSparkDrafter(gemma, bigram_draft([output])),
        BLOCK,
    )


# --- binding -------------------------------------------------------------------


@pytest.mark.parametrize(
    "change", [{}, {"architectures": None}], ids=["deepspec", "by-keys"]
)
def test_a_gemma4_dspark_artifact_loads_and_binds(
    tmp_path: Path, gemma: Model, change: dict[str, Any]
) -> None:
    config = gemma_dspark_config()
    draft = random_draft(config)
    folder = write_artifact(tmp_path / "d", {**config, **change}, draft)
    target = as_target(tiny_gemma("plain"))
    bound = check_dspark_binds(
        folder, target, BLOCK, tuple(TAPS), "dspark/l2/h64/taps1-4"
    )
    assert isinstance(bound.draft, Gemma4DSparkDraft)
    assert bound.draft.dspark.softcap == 3.0
    for name, value in tree_flatten(draft.parameters()):
        assert mx.array_equal(dict(tree_flatten(bound.draft.parameters()))[name], value)
    # the loaded draft drafts as the one it was saved from
    prompt = list(range(3, 15))
    rows = start_rows([prompt], SamplingParams())
    context = features(gemma, prompt[:-1])
    want = DSparkDrafter(gemma, draft).open(rows, context).propose(rows, BLOCK)
    got = bound.open(rows, context).propose(rows, BLOCK)
    assert got.device is not None and want.device is not None
    assert got.device.tolist() == want.device.tolist()
    narrow = default_registry().load(
        "dspark",
        DraftLoadRequest(
            target=as_target(tiny_gemma("plain")), source=str(folder), width=2
        ),
    )
    assert narrow.unwrap().width == 2


REFUSALS: dict[str, tuple[dict[str, Any], str]] = {
    "hidden": (
        {"hidden_size": 32, "intermediate_size": 48},
        "the draft reads hidden states of size 32, the target's are 64",
    ),
    "taps": ({"target_layer_ids": [1, 6]}, "taps layers [6], which the target does"),
    "vocab": ({"vocab_size": VOCAB + 3}, f"vocabulary ({VOCAB + 3} tokens)"),
    "mask": ({"mask_token_id": VOCAB + 3}, "mask token"),
    "no-global-head-dim": (
        {"global_head_dim": None},
        "a Gemma-4 DSpark config needs global_head_dim",
    ),
    "k-eq-v-heads": (
        {"attention_k_eq_v": True},
        "attention_k_eq_v needs num_global_key_value_heads",
    ),
    "per-layer-inputs": (
        {"hidden_size_per_layer_input": 8},
        "hidden_size_per_layer_input (8): DeepSpec's Gemma-4 DSpark layers take "
        "no per-layer embeddings",
    ),
    "moe": (
        {
            "enable_moe_block": True,
            "num_experts": 2,
            "top_k_experts": 1,
            "moe_intermediate_size": 8,
        },
        "enable_moe_block: DeepSpec's Gemma-4 DSpark layers have no MoE block",
    ),
    "double-wide": (
        {"use_double_wide_mlp": True, "num_kv_shared_layers": 1},
        "use_double_wide_mlp with num_kv_shared_layers (1)",
    ),
    "sliding": (
        {"layer_types": ["sliding_attention", FULL]},
        "DSpark layer_types must name 2 full_attention layers",
    ),
    "rope": (
        {"rope_parameters": {"sliding_attention": {"rope_type": "default"}}},
        "rope_parameters has no entry for the 'full_attention' layers",
    ),
    "activation": (
        {"hidden_activation": "silu"},
        "hidden_activation 'silu' is not supported",
    ),
    "k-eq-v-weights": (
        {"attention_k_eq_v": True, "num_global_key_value_heads": 2},
        "unexpected ['layers.0.self_attn.v_proj.weight'",
    ),
    "head-width": (
        {"global_head_dim": 16},
        "self_attn.q_proj.weight (128, 64) (config: (64, 64))",
    ),
}


@pytest.mark.parametrize(("change", "message"), REFUSALS.values(), ids=list(REFUSALS))
def test_a_gemma4_dspark_draft_that_does_not_fit_is_refused(
    tmp_path: Path, change: dict[str, Any], message: str
) -> None:
    good = gemma_dspark_config()
    folder = write_artifact(tmp_path / "d", good, random_draft(good))
    (folder / "config.json").write_text(json.dumps({**good, **change}))
    check_dspark_refused(folder, as_target(tiny_gemma("plain")), message)


def test_a_gemma4_dspark_draft_needs_a_gemma4_target(tmp_path: Path) -> None:
    good = gemma_dspark_config()
    folder = write_artifact(tmp_path / "d", good, random_draft(good))
    target = as_target(tiny_model(1))  # a qwen2 target
    loaded = default_registry().load(
        "dspark", DraftLoadRequest(target=target, source=str(folder))
    )
    assert isinstance(loaded, Failure)
    assert loaded.failure().message == (
        f"{folder}: a Gemma-4 DSpark draft (Gemma4DSparkModel) reads a Gemma-4 "
        "target's layer outputs; the target is qwen2: use the Gemma-4 model it "
        "was trained for"
    )
    assert target.model.taps == ()
