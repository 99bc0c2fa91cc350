"""DSpark block drafting (models/dspark.py, specpipe/drafts/dspark.py).

- The draft's cached forward (context in two chunks, rows of different
  lengths) equals the one-piece forward of the formulas, and its drafts are
  the formulas' greedy drafts: slot 0 drafts the first token, each slot's
  logits corrected by its Markov head (vanilla, gated, rnn, none) for the
  token drawn before it; a zero Markov head drafts the base argmax.
- A commit of any accepted counts leaves the draft where a draft opened
  fresh over the committed tokens is.
- Lossless: greedy and seeded sampled output == plain decoding, B=1 and B=4,
  depths 1, 3 and the block, on a dense and on a hybrid target; the prompt
  cache resumes it.
- Binding: detection, the width pinned to the block, the target's taps; and
  clear errors for drafts that do not fit the target (a Gemma-4 drafter on
  this qwen2 target among them; test_dspark_gemma4.py runs it on Gemma-4).
"""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path
from typing import Any

import mlx.core as mx
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
from mlx.utils import tree_flatten
from returns.result import Success
from spec_support import (
    PROMPTS,
    VOCAB,
    PlainReference,
    run,
    scale_matrices,
    tiny_model,
    write_artifact,
)
from test_dflash import reference_block

from bindings.kinds import default_registry
from bindings.registry import DraftLoadRequest
from models.base import CausalLM
from models.dspark import DSparkDraft, DSparkSettings
from schemas.converter import hf, structure
from schemas.hf import DecoderArgs, normalize_hf_config
from schemas.request import SamplingParams
from specpipe.drafts.dspark import DSparkDrafter

MASK = VOCAB - 1
BLOCK = 4
RANK = 8


def dspark_config(**overrides: Any) -> dict[str, Any]:
    """A tiny DSpark draft for the tiny target (hidden 64, two layers), with
    DeepSpec's keys: a vanilla Markov head and a confidence head."""
    config: dict[str, Any] = {
        "architectures": ["Qwen3DSparkModel"],
        "model_type": "qwen3",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": VOCAB,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
        "layer_types": ["full_attention", "full_attention"],
        "num_target_layers": 2,
        "target_layer_ids": [0, 1],
        "block_size": BLOCK,
        "mask_token_id": MASK,
        "markov_rank": RANK,
        "markov_head_type": "vanilla",
        "enable_confidence_head": True,
        "confidence_head_with_markov": True,
        "num_anchors": 512,
    }
    config.update(overrides)
    return config


MARKOV = {
    "vanilla": {},
    "gated": {"markov_head_type": "gated"},
    "rnn": {"markov_head_type": "rnn"},
    "none": {"markov_rank": 0, "enable_confidence_head": False},
}


def draft_args(config: dict[str, Any]) -> DecoderArgs:
    return structure(hf, normalize_hf_config(config), DecoderArgs, "dspark").unwrap()


def random_draft(
    config: dict[str, Any], seed: int = 5, gain: float = 2.5
) -> DSparkDraft:
    mx.random.seed(seed)
    draft = DSparkDraft(draft_args(config), DSparkSettings.of(config).unwrap())
    scale_matrices(draft, gain)
    return draft


# --- the formulas ----------------------------------------------------------------


def _params(draft: DSparkDraft) -> dict[str, mx.array]:
    return dict(tree_flatten(draft.parameters()))


def reference_base(
    draft: DSparkDraft,
    features: mx.array,  # [1, P, n H] the context positions'
    pending: int,
    depth: int,
) -> tuple[mx.array, mx.array]:  # outputs [depth, H], base logits [depth, V]
    """The block [pending, mask, ...] of max(block_size, depth) slots,
    embedded with the draft's own embedding, through the layers in one piece
    (test_dflash's formulas); slot k's output and lm_head logits."""
    params = _params(draft)
    length = max(BLOCK, depth)
    block = mx.array([pending] + [MASK] * (length - 1))
    x = params["embed_tokens.weight"][block][None]
    normed = reference_block(draft, features, x)[0, :depth]
    return normed, normed @ params["lm_head.weight"].T


def reference_bias(
    params: dict[str, mx.array],
    kind: str,
    previous: int,
    hidden: mx.array,  # [H]
    state: mx.array | None,
) -> tuple[mx.array, mx.array | None]:
    """DeepSpec's Markov heads' bias for one slot (markov_head.py)."""
    p = "markov_head."
    embedded = params[p + "markov_w1.weight"][previous]
    w2 = params[p + "markov_w2.weight"]
    if kind == "vanilla":
        return w2 @ embedded, state
    if kind == "gated":
        gate_in = mx.concatenate([hidden, embedded])
        gate = mx.sigmoid(
            params[p + "gate_proj.weight"] @ gate_in + params[p + "gate_proj.bias"]
        )
        return w2 @ (gate * embedded), state
    assert kind == "rnn"
    s = mx.zeros((RANK,)) if state is None else state
    z = params[p + "joint_proj.weight"] @ mx.concatenate([s, embedded, hidden])
    z = z + params[p + "joint_proj.bias"]
    g, c, o = z[:RANK], z[RANK : 2 * RANK], z[2 * RANK :]
    s = mx.sigmoid(g) * s + (1 - mx.sigmoid(g)) * mx.tanh(c)
    return w2 @ mx.tanh(o), s


def reference_drafts(
    draft: DSparkDraft, kind: str, features: mx.array, pending: int, depth: int
) -> list[int]:
    """The greedy drafts: slot by slot, argmax of the base logits plus the
    Markov bias of the token drafted before (the pending token first)."""
    normed, base = reference_base(draft, features, pending, depth)
    params = _params(draft)
    previous, state, drafted = pending, None, []
    for k in range(depth):
        logits = base[k]
        if kind != "none":
            bias, state = reference_bias(params, kind, previous, normed[k], state)
            logits = logits + bias
        previous = int(mx.argmax(logits).item())
        drafted.append(previous)
    return drafted


@pytest.mark.parametrize("kind", list(MARKOV))
def test_the_cached_forward_and_drafts_are_the_formulas(
    tapped: CausalLM, kind: str
) -> None:
    config = dspark_config(**MARKOV[kind])
    draft = random_draft(config)
    prompts, context, cache = two_rows_in_context(tapped, draft)
    block = mx.array([[p[-1]] + [MASK] * (BLOCK - 1) for p in prompts])
    got = draft(draft.embed_tokens(block), cache, [len(p) - 1 for p in prompts])
    for b, prompt in enumerate(prompts):
        want, _ = reference_base(draft, context[b], prompt[-1], BLOCK)
        assert mx.allclose(got[b], want, atol=2e-4, rtol=2e-4).item(), b
    # the drafter's proposals: the formulas' greedy drafts, any depth
    check_greedy_drafts(
        DSparkDrafter(tapped, draft),
        prompts,
        context,
        (1, 3, BLOCK, BLOCK + 2),
        lambda row, pending, depth: reference_drafts(draft, kind, row, pending, depth),
    )


def test_the_markov_head_corrects_the_drafts(tapped: CausalLM) -> None:
    """A zero Markov head drafts the lm_head's argmax; the random one drafts
    argmax(base_k + markov_w2 @ markov_w1[previous draft]), which differs."""
    config = dspark_config()
    draft = random_draft(config, seed=11)
    prompt = list(range(3, 15))
    context = features(tapped, prompt[:-1])
    rows = start_rows([prompt], SamplingParams())
    _, base = reference_base(draft, context, prompt[-1], BLOCK)
    plain_argmax = mx.argmax(base, axis=-1).tolist()
    params = _params(draft)
    w1, w2 = (
        params["markov_head.markov_w1.weight"],
        params["markov_head.markov_w2.weight"],
    )
    by_hand, previous = [], prompt[-1]
    for k in range(BLOCK):
        previous = int(mx.argmax(base[k] + w2 @ w1[previous]).item())
        by_hand.append(previous)
    corrected = DSparkDrafter(tapped, draft).open(rows, context).propose(rows, BLOCK)
    assert corrected.device is not None
    assert corrected.device.tolist() == [by_hand]
    assert by_hand != plain_argmax  # the head matters for these weights
    draft.markov_head.markov_w2.weight = mx.zeros_like(w2)
    zeroed = DSparkDrafter(tapped, draft).open(rows, context).propose(rows, BLOCK)
    assert zeroed.device is not None
    assert zeroed.device.tolist() == [plain_argmax]


@pytest.mark.parametrize("depth", [BLOCK, 0], ids=["drafted", "plain-round"])
def test_a_commit_leaves_the_draft_of_a_fresh_open(
    tapped: CausalLM, depth: int
) -> None:
    """After a round (drafted: accepted 0, 2 and the whole block; or a
    plain round, where the draft stores nothing), the draft's context and
    drafts are a fresh draft's over the committed tokens."""
    drafter = DSparkDrafter(tapped, random_draft(dspark_config()))
    check_a_commit_leaves_a_fresh_open(tapped, drafter, depth, BLOCK, MASK, 128)


# --- lossless --------------------------------------------------------------------

SAMPLINGS = {
    "greedy": SamplingParams(),
    "t0.8-topk": SamplingParams(temperature=0.8, top_k=20, seed=3),
    "t1.0-topp-minp": SamplingParams(temperature=1.0, top_p=0.9, min_p=0.02, seed=9),
}


@pytest.mark.parametrize("sampling", list(SAMPLINGS), ids=list(SAMPLINGS))
@pytest.mark.parametrize(
    ("kind", "depth"),
    [("vanilla", 1), ("vanilla", 3), ("vanilla", BLOCK), ("rnn", BLOCK)],
)
@pytest.mark.parametrize("batch", [1, 4])
def test_dspark_output_is_plain_decoding(
    tapped: CausalLM,
    plain: PlainReference,
    sampling: str,
    kind: str,
    depth: int,
    batch: int,
) -> None:
    prompts = PROMPTS[:batch]
    params = SAMPLINGS[sampling]
    drafter = DSparkDrafter(tapped, random_draft(dspark_config(**MARKOV[kind]), 7))
    check_output_is_plain(tapped, prompts, params, drafter, depth, plain)


def bigram_draft(outputs: list[list[int]]) -> DSparkDraft:
    """A draft whose Markov head (of rank V) adds 50 to the logit of the
    token following the previous one in `outputs` (the last such pair where
    they disagree): that token is drafted wherever it is known, the
    backbone's argmax elsewhere."""
    follows = {}
    for sequence in outputs:
        follows.update(pairwise(sequence))
    draft = random_draft(dspark_config(markov_rank=VOCAB), seed=7)
    draft.markov_head.markov_w1.weight = mx.eye(VOCAB)
    table = [[0.0] * VOCAB for _ in range(VOCAB)]
    for previous, following in follows.items():
        table[following][previous] = 50.0
    draft.markov_head.markov_w2.weight = mx.array(table)
    return draft


@pytest.mark.parametrize("sampling", ["greedy", "t0.8-topk"])
def test_drafts_chained_by_the_markov_head_are_accepted(
    tapped: CausalLM, plain: PlainReference, sampling: str
) -> None:
    """A draft that knows plain decoding's bigrams drafts whole chains (each
    draft the successor of the one before it, drawn with its position's
    key): several drafts of a block are accepted, and the output stays
    plain decoding's."""
    params = SAMPLINGS[sampling]
    want = plain(PROMPTS, params)
    draft = bigram_draft([[*p, *o] for p, o in zip(PROMPTS, want, strict=True)])
    tokens, results = run(tapped, PROMPTS, params, DSparkDrafter(tapped, draft), BLOCK)
    assert tokens == want
    accepted_at = [sum(r.metrics.accepted_at[i] for r in results) for i in range(BLOCK)]
    assert accepted_at[0] >= 10 and accepted_at[1] >= 5 and accepted_at[2] > 0


@pytest.mark.parametrize("sampling", ["greedy", "t0.8-topk"])
@pytest.mark.parametrize("batch", [1, 4])
def test_dspark_on_a_hybrid_target_is_plain_decoding(
    hybrid: CausalLM, sampling: str, batch: int
) -> None:
    prompts = PROMPTS[:batch]
    params = SAMPLINGS[sampling]
    plain, _ = run(hybrid, prompts, params, max_tokens=14)
    draft = random_draft(dspark_config(target_layer_ids=[0, 3]), seed=13)
    drafter = DSparkDrafter(hybrid, draft)
    spec, results = run(hybrid, prompts, params, drafter, depth=BLOCK, max_tokens=14)
    assert all(not r.metrics.draft_errors and r.metrics.drafted > 0 for r in results)
    assert spec == plain


@pytest.mark.parametrize("sampling", ["greedy", "t0.8-topk"])
def test_the_prompt_cache_resumes_the_dspark_draft(
    tapped: CausalLM, sampling: str
) -> None:
    """A conversation's next turn starts from the first turn's checkpoint
    (the draft's captured context and pending features) and decodes as a
    run without the cache does, its drafts accepted as without the cache."""
    check_prompt_cache_resumes(
        tapped,
        SAMPLINGS[sampling],
        lambda output: DSparkDrafter(tapped, bigram_draft([output])),
        BLOCK,
    )


# --- binding -------------------------------------------------------------------


def _target() -> Any:
    return as_target(tiny_model(1))


@pytest.mark.parametrize(
    "change",
    [{}, {"architectures": ["DSparkDraftModel"]}, {"architectures": None}],
    ids=["deepspec", "community", "by-keys"],
)
def test_a_dspark_artifact_binds_with_its_block_width(
    tmp_path: Path, change: dict[str, Any]
) -> None:
    config = {**dspark_config(), **change}
    draft = random_draft(dspark_config())
    folder = write_artifact(tmp_path / "d", config, draft)
    bound = check_dspark_binds(
        folder, _target(), BLOCK, (0, 1), "dspark/l2/h64/taps0-1"
    )
    assert isinstance(bound.draft, DSparkDraft)
    assert mx.array_equal(bound.draft.lm_head.weight, draft.lm_head.weight)
    assert mx.array_equal(
        bound.draft.confidence_head.proj.weight, draft.confidence_head.proj.weight
    )
    registry = default_registry()
    wide = registry.load(
        "dspark", DraftLoadRequest(target=_target(), source=str(folder), width=9)
    )
    assert wide.unwrap().width == BLOCK
    narrow = registry.load(
        "dspark", DraftLoadRequest(target=_target(), source=str(folder), width=2)
    )
    assert narrow.unwrap().width == 2


def test_a_dflash_artifact_is_not_taken_for_dspark(tmp_path: Path) -> None:
    config = dspark_config(dflash_config={"target_layer_ids": [0, 1]})
    config["architectures"] = ["DFlashDraftModel"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert default_registry().detect(tmp_path) == Success("dflash")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"hidden_size": 32, "intermediate_size": 64}, "hidden states of size 32"),
        (
            {"target_layer_ids": [0, 5]},
            "taps layers [5], which the target does not expose",
        ),
        ({"vocab_size": VOCAB + 3}, f"vocabulary ({VOCAB + 3} tokens)"),
        ({"mask_token_id": VOCAB + 3}, "mask token"),
        ({"mask_token_id": None}, "mask_token_id"),
        ({"markov_head_type": "lstm"}, "markov_head_type"),
        ({"markov_rank": 4}, "markov_head.markov_w1.weight (97, 8) (config: (97, 4))"),
        ({"enable_confidence_head": False}, "unexpected ['confidence_head"),
        (
            {"architectures": ["Gemma4DSparkModel"], "model_type": "gemma4_text"},
            "a Gemma-4 DSpark draft (Gemma4DSparkModel) reads a Gemma-4 target's "
            "layer outputs; the target is qwen2",
        ),
    ],
    ids=[
        "hidden",
        "layers",
        "vocab",
        "mask",
        "no-mask",
        "markov-kind",
        "markov-rank",
        "confidence",
        "gemma4",
    ],
)
def test_a_dspark_draft_that_does_not_fit_is_refused(
    tmp_path: Path, change: dict[str, Any], message: str
) -> None:
    good = dspark_config()
    folder = write_artifact(tmp_path / "d", good, random_draft(good))
    (folder / "config.json").write_text(json.dumps({**good, **change}))
    check_dspark_refused(folder, _target(), message)
