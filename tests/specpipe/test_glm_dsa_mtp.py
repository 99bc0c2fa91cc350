"""GLM-5's native MTP layer (models/glm_mtp.py's `GlmDsaMtpHead`) drafting for
a glm_moe_dsa target.

A tiny random GLM-5 (two layers, full then shared; `index_topk` 4, so both
the target's and the head's DSA indexers drop positions from the fifth on)
with a random MTP layer of its kind:
- The head's forward is its formula (enorm / hnorm / eh_proj, the pair at
  position 0 with its embedding zeroed, a glm_moe_dsa decoder layer,
  shared_head's norm); its cache holds its own latents and its own indexer
  keys, and its indexer keeps `index_topk` of them per query. Cached and
  chunked, batched at per-row positions, and in the compiled step's form
  (`forward_at`), it computes what one piece over the same tokens does.
- Committing k drafts of a window (none, some, all: the fully accepted
  window's rule) and drafting again equals drafting fresh from the same
  context, eager and compiled, rows at different lengths.
- Lossless: greedy and seeded sampled output == plain decoding, B=1 and 3,
  depths 1 and 3, compiled steps too; a head that copies the target (on a
  target that repeats its input) has every draft accepted; a prompt-cache
  resume offers the drafts a fresh prefill offers.
- Loading: an HF-layout checkpoint's MTP layer is the native draft (`--draft
  mtp` and `auto`), a converted folder's `mtp/` companion binds; misfits
  (a layer without its indexer, GLM-4.5's layer, two MTP layers, another
  hidden size) are clear errors.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from attrs import evolve
from glm_mtp_support import (
    check_carried_and_normed,
    check_mtp_output_equals_plain,
    layer_input,
    seeded,
    write_glm_folder,
)
from mlx.utils import tree_unflatten
from spec_support import PROMPTS, run
from test_glm_mtp import glm_args
from test_mtp import repeating
from test_prompt_cache import generate

from models.base import ModelOutput, rope_offset
from models.build import build_model
from models.cache import KVCache
from models.glm_moe_dsa import DecoderLayer, Model
from models.glm_mtp import GlmDsaMtpHead, GlmMtpHead, build_glm_mtp
from models.layers import flat_parameters
from models.mtp import build_mtp
from schemas.hf_glm_moe_dsa import GlmMoeDsaArgs, glm_moe_dsa_args
from schemas.request import DraftPolicy, GenerationLimits, SamplingParams
from specpipe.api import load
from specpipe.draft import Proposal
from specpipe.drafts.mtp import MtpDrafter, MtpRows
from specpipe.load import load as load_model
from specpipe.load import save_folder
from specpipe.prompt_cache import PromptCache
from specpipe.state import RowState
from tests.models.decoder_support import parsed_args

VOCAB = 97
HIDDEN = 64
TOP_K = 4
CONFIG: dict[str, Any] = {
    "model_type": "glm_moe_dsa",
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8,
    "v_head_dim": 12,
    "index_head_dim": 16,
    "index_n_heads": 4,
    "index_topk": TOP_K,
    "index_topk_pattern": "FS",
    "moe_intermediate_size": 32,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "n_group": 2,
    "topk_group": 1,
    "routed_scaling_factor": 2.5,
    "max_position_embeddings": 512,
    "num_nextn_predict_layers": 1,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e4},
}
SAMPLINGS = {
    "greedy": SamplingParams(),
    "sampled": SamplingParams(temperature=0.8, top_p=0.9, top_k=30, seed=5),
}


def dsa_args(**overrides: Any) -> GlmMoeDsaArgs:
    return parsed_args(glm_moe_dsa_args, {**CONFIG, **overrides}, "test")


@pytest.fixture(scope="module")
def target() -> Model:
    model = seeded(lambda: build_model(dsa_args()).unwrap(), 1)
    assert isinstance(model, Model)
    return model


def random_head(seed: int, **overrides: Any) -> GlmDsaMtpHead:
    return seeded(lambda: GlmDsaMtpHead(dsa_args(**overrides)), seed)


def ids_of(shape: tuple[int, int], seed: int) -> mx.array:
    return mx.array(np.random.default_rng(seed).integers(0, VOCAB, shape))


# --- the head's forward ----------------------------------------------------------


def test_the_head_is_its_formula(target: Model) -> None:
    """Two rows, one from position 0 (its first pair's embedding zeroed), the
    other at 4: the indexer drops positions for the queries past the fourth."""
    head = random_head(3)
    batch, length, offsets = 2, 6, [0, 4]
    ids = ids_of((batch, length), 0)
    hidden = mx.random.normal((batch, length, HIDDEN), key=mx.random.key(2))
    cache = head.make_cache(batch)
    out = head(target.embed(ids), hidden, cache, offsets)

    x, again, mask = layer_input(head, target.embed(ids), hidden, offsets)
    layer = head.layers[0]
    assert isinstance(layer, DecoderLayer)  # GLM-5's, MTP layer N in slot 0
    expected = layer(x, again, offsets, mask, rope_offset(offsets))
    assert mx.allclose(out, expected, atol=1e-5).item()
    check_carried_and_normed(head, out)

    # its own latent cache (one head of kv_lora_rank + qk_rope_head_dim), the
    # values buffer holding its own indexer's keys of its own inputs
    args = head.dsa
    assert (cache.num_layers, cache.kv_heads, cache.head_dim) == (1, 1, args.latent_dim)
    attn = layer.self_attn
    assert attn.indexer is not None and attn.kv_index == 0
    keys = attn.indexer.key_window(
        layer.input_layernorm(x), attn.rope, mx.array(offsets)
    )
    for b, start in enumerate(offsets):
        stored = cache.values[0][b, 0, start : start + length, : args.index_head_dim]
        assert mx.allclose(stored, keys[b, 0], atol=1e-5).item()

    # the selection bites: a head keeping every position agrees on the
    # queries that see at most `index_topk` positions, not past them
    dense = random_head(3, index_topk=2048)
    wide = dense(target.embed(ids), hidden, dense.make_cache(batch), offsets)
    seen = np.array(offsets)[:, None] + np.arange(length) + 1  # [B, L]
    close = np.isclose(np.array(wide), np.array(out), atol=1e-5).all(axis=-1)
    assert close[seen <= TOP_K].all() and not close[seen > TOP_K].any()


def test_the_head_in_pieces_equals_one_piece(target: Model) -> None:
    """Cached and chunked, batched at per-row positions, and in the compiled
    step's form (whole buffers, device positions): one piece's output."""
    head = random_head(3)
    length = 12
    ids = ids_of((2, length), 4)
    hidden = mx.random.normal((2, length, HIDDEN), key=mx.random.key(5))
    embeds = target.embed(ids)
    whole = head(embeds, hidden, head.make_cache(2), [0, 0])

    cache = head.make_cache(2)
    pieces = [
        head(embeds[:, a:b], hidden[:, a:b], cache, [a, a])
        for a, b in ((0, 5), (5, 6), (6, 12))
    ]
    assert mx.allclose(mx.concatenate(pieces, axis=1), whole, atol=1e-4).item()

    # rows at per-row positions: row 0 from 0 over 9 pairs, row 1 from 3 over
    # its pairs 3..11 (its first 3 cached beforehand)
    staged = head.make_cache(1)
    head(embeds[1:, :3], hidden[1:, :3], staged, [0])
    batch = KVCache.concat_rows([head.make_cache(1), staged])
    tail = mx.concatenate([embeds[:1, :9], embeds[1:, 3:]])
    tail_hidden = mx.concatenate([hidden[:1, :9], hidden[1:, 3:]])
    out = head(tail, tail_hidden, batch, [0, 3])
    assert mx.allclose(out[0], whole[0, :9], atol=1e-4).item()
    assert mx.allclose(out[1], whole[1, 3:], atol=1e-4).item()

    # the compiled step's form: whole buffers in and out, positions on the device
    buffers = head.make_cache(2)
    buffers.reserve(length)
    keys, values = buffers.keys[0], buffers.values[0]
    starts = mx.array([0, 0], dtype=mx.int32)
    first, keys, values = head.forward_at(
        embeds[:, :7], hidden[:, :7], keys, values, starts
    )
    rest, keys, values = head.forward_at(
        embeds[:, 7:], hidden[:, 7:], keys, values, starts + 7
    )
    assert mx.allclose(mx.concatenate([first, rest], axis=1), whole, atol=1e-4).item()


# --- the drafter's commit rule ----------------------------------------------------


def target_hidden(target: Model, tokens: Sequence[int]) -> mx.array:  # [1, n, H]
    """The target's hidden states of `tokens` processed from position 0."""
    out = target(mx.array([list(tokens)], dtype=mx.int32), target.make_cache(1), [0])
    return out.hidden


def right_padded(parts: Sequence[mx.array]) -> mx.array:  # [B, T, H]
    width = max(p.shape[1] for p in parts)
    return mx.concatenate(
        [mx.pad(p, [(0, 0), (0, width - p.shape[1]), (0, 0)]) for p in parts]
    )


def opened(drafter: MtpDrafter, target: Model, rows: Sequence[RowState]) -> MtpRows:
    """Rows opened as after a prefill of all but their pending tokens."""
    hidden = right_padded([target_hidden(target, r.tokens[:-1]) for r in rows])
    return drafter.open(rows, hidden)


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("accepted", [(0, 3), (3, 1), (2, 0)])
def test_committing_k_of_a_window_equals_drafting_fresh(
    target: Model, accepted: tuple[int, int], compiled: bool
) -> None:
    """Two rows of lengths 10 and 4 draft 3 tokens; after committing
    `accepted` of them (3: the whole window, then a bonus token) the next
    round drafts, and writes into the head's cache, what rows opened fresh
    on the longer context do: rejected drafts' entries roll back by
    position, the accepted ones are rewritten from true hidden states."""
    depth = 3
    drafter = MtpDrafter(target, random_head(4), DraftPolicy(compiled=compiled))
    greedy = SamplingParams()
    rows = [RowState.start(p, 32, greedy) for p in (PROMPTS[0], PROMPTS[1])]
    state = opened(drafter, target, rows)
    proposal = state.propose(rows, depth)
    assert proposal.device is not None
    drafts = [tuple(d) for d in proposal.device.tolist()]
    # the verify window's hidden states, [pending, d1..d3] at each row's length
    window = right_padded(
        [
            target_hidden(target, [*r.tokens, *d])[:, r.length :]
            for r, d in zip(rows, drafts, strict=True)
        ]
    )
    committed = state.prepare_commit(
        rows, proposal, drafts, list(accepted), ModelOutput(window, window)
    ).commit()
    # the correction (or bonus) token: any token serves the head's pairing
    rows = [
        r.advanced((*d[:a], (7 * a + b) % VOCAB))
        for b, (r, d, a) in enumerate(zip(rows, drafts, accepted, strict=True))
    ]
    fresh = opened(drafter, target, rows)
    again = committed.propose(rows, depth)
    want = fresh.propose(rows, depth)
    assert again.device is not None and want.device is not None
    assert again.device.tolist() == want.device.tolist()
    # every position the round wrote (the tail's pairs and the chained steps')
    written = [r.length + depth - 1 for r in rows]
    for b, end in enumerate(written):
        for buffers in ("keys", "values"):
            got = getattr(committed.cache, buffers)[0][b, :, :end]
            expected = getattr(fresh.cache, buffers)[0][b, :, :end]
            assert mx.allclose(got, expected, atol=1e-4).item(), (b, buffers)


# --- lossless ---------------------------------------------------------------------


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
@pytest.mark.parametrize("depth", [1, 3])
@pytest.mark.parametrize("batch", [1, 3])
def test_glm5_mtp_output_equals_plain(
    target: Model, sampling: str, depth: int, batch: int
) -> None:
    check_mtp_output_equals_plain(
        target, lambda: random_head(4), SAMPLINGS[sampling], depth, batch
    )


def test_compiled_steps_are_lossless_too(target: Model) -> None:
    """The compiled step (`HeadStep`, a GPU's path) through the layer's
    scatter-written form; run on the CPU when told to compile."""
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[3]]
    params = SAMPLINGS["sampled"]
    plain, _ = run(target, prompts, params, max_tokens=14)
    drafter = MtpDrafter(target, random_head(4), DraftPolicy(compiled=True))
    assert drafter.compiles()
    spec, results = run(target, prompts, params, drafter, 3, max_tokens=14)
    assert spec == plain
    assert all(not r.metrics.draft_errors and r.metrics.drafted > 0 for r in results)


def repeating_target() -> Model:
    """A GLM-5 whose residual stream is its input embedding (every layer
    scaled to ~0) and whose head is that embedding: it predicts its input
    token, so greedy decoding repeats the pending token."""
    mx.random.seed(0)
    model = build_model(dsa_args(tie_word_embeddings=True)).unwrap()
    assert isinstance(model, Model)
    repeating(model)
    return model


def copy_head() -> GlmDsaMtpHead:
    """A head whose output is its normed hidden input: eh_proj reads the
    hidden half only, the attention's o_proj and the MoE's down projections
    are zero, so the layer adds nothing. It drafts the target's own
    prediction at the position it pairs with: the pending token again."""
    head = GlmDsaMtpHead(dsa_args(tie_word_embeddings=True))
    fc = mx.concatenate([mx.zeros((HIDDEN, HIDDEN)), mx.eye(HIDDEN)], axis=1)
    updates = {"fc.weight": fc}
    for name, value in flat_parameters(head).items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            updates[name] = mx.zeros_like(value)
    head.update(tree_unflatten(list(updates.items())))
    mx.eval(head.parameters())
    return head


def test_a_head_that_copies_the_target_has_every_draft_accepted() -> None:
    repeating = repeating_target()
    prompts = [(3, 3, 3, 3), (7, 1, 7, 5, 5)]
    plain, _ = run(repeating, prompts, SamplingParams(), max_tokens=20)
    assert plain == [[3] * 20, [5] * 20]  # the regime under test
    drafter = MtpDrafter(repeating, copy_head())
    spec, results = run(repeating, prompts, SamplingParams(), drafter, 4, max_tokens=20)
    assert spec == plain
    for r in results:
        assert r.metrics.drafted > 0 and r.metrics.accepted == r.metrics.drafted


@pytest.fixture
def proposals(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    """Every MTP proposal's drafts (read back), in order."""
    seen: list[Any] = []
    propose = MtpRows.propose

    def spy(self: MtpRows, rows: Any, depth: int) -> Proposal:
        proposal = propose(self, rows, depth)
        seen.append(None if proposal.device is None else proposal.device.tolist())
        return proposal

    monkeypatch.setattr(MtpRows, "propose", spy)
    yield seen


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
def test_a_prompt_cache_resume_drafts_as_a_fresh_prefill(
    target: Model, proposals: list[Any], sampling: str
) -> None:
    """A next turn and a repeated prompt start from checkpoints holding the
    head's latent cache and unpaired hidden states: the output and every
    draft are those of a run without the cache."""
    drafter = MtpDrafter(target, random_head(4))
    params = SAMPLINGS[sampling]
    store = PromptCache(target)
    first = [list(PROMPTS[0]), list(PROMPTS[1])]
    out, _ = generate(target, first, params, drafter, 2, store)
    turns = [first[0] + out[0] + [3, 1, 4], first[1]]
    proposals.clear()
    tokens, results = generate(target, turns, params, drafter, 2, store)
    resumed = list(proposals)
    proposals.clear()
    fresh, _ = generate(target, turns, params, drafter, 2, None)
    assert tokens == fresh and resumed == proposals and resumed
    assert results[0].cached_tokens >= len(first[0]) + len(out[0]) - 1
    assert results[1].cached_tokens == len(first[1]) - 1


# --- loading ------------------------------------------------------------------------


LIMITS = GenerationLimits(max_tokens=48)


@pytest.fixture(scope="module")
def glm5_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny GLM-5 HF folder (320-token tokenizer) with its MTP layer."""
    return write_glm_folder(
        tmp_path_factory.mktemp("glm5") / "target",
        CONFIG,
        "GlmMoeDsaForCausalLM",
        dsa_args,
        Model,
        GlmDsaMtpHead,
    )


def test_the_checkpoint_layer_is_the_native_draft(glm5_folder: Path) -> None:
    loaded = load_model(str(glm5_folder)).unwrap()
    assert {"eh_proj.weight", "self_attn.indexer.wq_b.weight"} <= loaded.mtp.keys()
    head = build_mtp(loaded.args, loaded.mtp).unwrap()
    assert isinstance(head, GlmDsaMtpHead)
    plain = load(str(glm5_folder)).unwrap()
    for draft in ("mtp", "auto"):
        pipeline = load(str(glm5_folder), draft=draft, adaptive=False).unwrap()
        assert pipeline.draft_kind == "mtp"
        for prompt in ("def fib", "hello world, the quick brown fox"):
            want = plain.generate(prompt, limits=LIMITS).unwrap()
            got = pipeline.generate(prompt, limits=LIMITS).unwrap()
            assert got.tokens == want.tokens
            assert got.stats.drafted > 0 and not got.stats.draft_errors


def test_a_converted_folder_keeps_the_head_as_a_companion(
    glm5_folder: Path, tmp_path: Path
) -> None:
    loaded = load_model(str(glm5_folder)).unwrap()
    out = save_folder(loaded, tmp_path / "converted").unwrap()
    companion = json.loads((out / "mtp" / "config.json").read_text())
    assert companion["model_type"] == "glm_moe_dsa_mtp"
    assert load_model(str(out)).unwrap().mtp == {}  # the target's folder: no layer N
    plain = load(str(out)).unwrap()
    pipeline = load(str(out), draft="mtp", adaptive=False).unwrap()
    assert pipeline.draft_kind == "mtp"
    want = plain.generate("for i in range", limits=LIMITS).unwrap()
    got = pipeline.generate("for i in range", limits=LIMITS).unwrap()
    assert got.tokens == want.tokens and got.stats.drafted > 0

    # a companion of another hidden size is refused before any forward
    companion["hidden_size"] = 32
    (out / "mtp" / "config.json").write_text(json.dumps(companion))
    failure = load(str(out), draft="mtp", adaptive=False).failure()
    assert "does not fit the target" in failure.message
    assert "hidden_size is 32" in failure.message


def test_misfit_heads_are_clear_errors(target: Model) -> None:
    args = target.glm
    weights = flat_parameters(random_head(4))
    assert isinstance(build_glm_mtp(args, weights).unwrap(), GlmDsaMtpHead)
    # the MTP layer's own indexer is required (it never borrows the target's)
    no_indexer = {k: v for k, v in weights.items() if ".indexer." not in k}
    failure = build_glm_mtp(args, no_indexer).failure()
    assert "do not match" in failure.message
    assert "layers.0.self_attn.indexer" in failure.message
    # GLM-4.5's layer (GQA attention) on a GLM-5 target
    glm45 = flat_parameters(GlmMtpHead(glm_args()))
    failure = build_mtp(args, glm45).failure()
    assert "do not match" in failure.message and "q_proj" in failure.message
    failure = build_mtp(evolve(args, num_nextn_predict_layers=2), weights).failure()
    assert "GLM heads of one layer" in failure.message
