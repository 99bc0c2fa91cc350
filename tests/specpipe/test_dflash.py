"""DFlash block drafting (models/dflash.py, specpipe/drafts/dflash.py).

- The draft's forward with its cached context equals the same forward
  computed in one piece from the module's formulas (context in two chunks,
  rows of different lengths, a causal sliding-window variant).
- A commit of any accepted counts leaves the draft where a draft opened
  fresh over the committed tokens is.
- Lossless: greedy and seeded sampled output == plain decoding, B=1 and B=4,
  depths up to the block.
- Binding: detection, the width pinned to the block, the target's taps; and
  clear errors for drafts that do not fit the target.
- Quantized projections: a DFlash2 draft loads its attention, MLP and fc
  projections at 4 bits by default (8 or float when asked; DFlash v1 float
  unless asked), its resident bytes drop by what the packing says, its
  output stays plain decoding's; a quantized checkpoint loads as it is.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
from block_support import (
    as_target,
    check_output_is_plain,
    features,
    padded,
    start_rows,
)
from mlx.utils import tree_flatten
from returns.result import Failure, Success
from spec_support import (
    PROMPTS,
    VOCAB,
    PlainReference,
    run,
    scale_matrices,
    tiny_model,
    write_artifact,
)

from bindings.kinds import default_registry
from bindings.registry import DraftLoadRequest
from models.base import CausalLM
from models.build import quantize_layers
from models.cache import on_gpu
from models.dflash import DFlashDraft, DFlashSettings, build_dflash, default_bits
from schemas.converter import hf, structure
from schemas.hf import DecoderArgs, normalize_hf_config
from schemas.request import SamplingParams
from specpipe.draft import Proposal
from specpipe.draft_vocab import DraftVocabulary, SubsetHead
from specpipe.drafts.dflash import DFlashDrafter, DFlashRows

MASK = VOCAB - 1
BLOCK = 5


def dflash_config(**overrides: Any) -> dict[str, Any]:
    """A tiny DFlash draft for the tiny target (hidden 64, two layers)."""
    config: dict[str, Any] = {
        "architectures": ["DFlashDraftModel"],
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
        "dflash_config": {
            "target_layer_ids": [0, 1],
            "block_size": BLOCK,
            "mask_token_id": MASK,
        },
    }
    config.update(overrides)
    return config


def dflash2_config() -> dict[str, Any]:
    """The same with DFlash2's convolutions and candidate selector."""
    config = dflash_config(architectures=["DFlash2DraftModel"])
    config["dflash_config"] = {
        **config["dflash_config"],
        "conv_kernel_size": 2,
        "conv_group_size": 16,
        "selector_rank": 8,
        "selector_top_k": 6,
    }
    return config


def draft_args(config: dict[str, Any]) -> DecoderArgs:
    return structure(hf, normalize_hf_config(config), DecoderArgs, "dflash").unwrap()


def random_draft(
    config: dict[str, Any], seed: int = 5, gain: float = 2.5
) -> DFlashDraft:
    mx.random.seed(seed)
    draft = DFlashDraft(draft_args(config), DFlashSettings.of(config).unwrap())
    scale_matrices(draft, gain)
    for layer in draft.layers:  # DFlash2's base kernels (zeros as built)
        if layer.convolved:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel = 0.3 * mx.random.normal(conv.base_kernel.shape)
    mx.eval(draft.parameters())
    return draft


def _rms(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    return x * mx.rsqrt(mx.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def reference_block(
    draft: DFlashDraft,
    features: mx.array,  # [1, P, n H] every context position's
    x: mx.array,  # [1, L, H] the block's embeddings
) -> mx.array:
    """The draft's output for one row, from the formulas of models/dflash.py,
    all context at once and no cache."""
    args, settings = draft.args, draft.settings
    eps = args.rms_norm_eps
    params = dict(tree_flatten(draft.parameters()))
    heads, kv, dim = args.num_attention_heads, args.num_key_value_heads, 16
    context_len, length = features.shape[1], x.shape[1]
    positions = mx.arange(context_len + length)
    ctx = _rms(features @ params["fc.weight"].T, params["hidden_norm.weight"], eps)

    def rope(t: mx.array, at: mx.array) -> mx.array:  # [n, heads, dim]
        half = dim // 2
        freqs = 1.0 / (10000.0 ** (mx.arange(half) * 2 / dim))
        angle = at[:, None, None] * freqs[None, None, :]
        a, b = t[..., :half], t[..., half:]
        cos, sin = mx.cos(angle), mx.sin(angle)
        return mx.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)

    h = x[0]
    for i in range(args.num_hidden_layers):
        p = f"layers.{i}."
        normed = _rms(h, params[p + "input_layernorm.weight"], eps)
        both = mx.concatenate([ctx[0], normed])
        q = (normed @ params[p + "self_attn.q_proj.weight"].T).reshape(
            length, heads, dim
        )
        k = (both @ params[p + "self_attn.k_proj.weight"].T).reshape(-1, kv, dim)
        v = (both @ params[p + "self_attn.v_proj.weight"].T).reshape(-1, kv, dim)
        q = rope(
            _rms(q, params[p + "self_attn.q_norm.weight"], eps), positions[context_len:]
        )
        k = rope(_rms(k, params[p + "self_attn.k_norm.weight"], eps), positions)
        k = mx.repeat(k, heads // kv, axis=1)
        v = mx.repeat(v, heads // kv, axis=1)
        scores = mx.einsum("qhd,khd->hqk", q, k) / dim**0.5
        query_pos = positions[context_len:][:, None]
        key_pos = positions[None, :]
        visible = mx.ones(scores.shape[1:], dtype=mx.bool_)
        causal, window = settings.attention[i]
        if causal:
            visible = visible & (key_pos <= query_pos)
        if window is not None:
            visible = visible & (mx.abs(query_pos - key_pos) < window)
        scores = mx.where(visible[None], scores, -mx.inf)
        attended = mx.einsum("hqk,khd->qhd", mx.softmax(scores, axis=-1), v)
        h = h + attended.reshape(length, -1) @ params[p + "self_attn.o_proj.weight"].T
        normed = _rms(h, params[p + "post_attention_layernorm.weight"], eps)
        gate = normed @ params[p + "mlp.gate_proj.weight"].T
        up = normed @ params[p + "mlp.up_proj.weight"].T
        h = h + (gate * mx.sigmoid(gate) * up) @ params[p + "mlp.down_proj.weight"].T
    return _rms(h, params["norm.weight"], eps)[None]


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"is_causal": True},
        {
            "layer_types": ["sliding_attention"] * 2,
            "sliding_window": 6,
            "use_sliding_window": True,
        },
        {
            "layer_types": ["full_attention", "sliding_attention"],
            "sliding_window": 3,
            "use_sliding_window": True,
            "is_causal": False,
        },
    ],
    ids=["bidirectional", "causal", "sliding-window", "mixed-layers"],
)
def test_the_cached_forward_is_the_one_piece_forward(
    tapped: CausalLM, overrides: dict[str, Any]
) -> None:
    config = dflash_config(**overrides)
    draft = random_draft(config)
    prompts = [list(range(3, 14)), [7, 8, 9, 10, 11]]  # 11 and 5 positions
    features = []
    for prompt in prompts:
        out = tapped(mx.array([prompt]), tapped.make_cache(1), [0])
        assert out.features is not None
        features.append(out.features)
    cache = draft.make_cache(2)
    # the context in two chunks per row, of different lengths
    first = [4, 2]
    padded = [
        mx.concatenate([f[:, :n], mx.zeros((1, 4 - n, f.shape[-1]))], axis=1)
        for f, n in zip(features, first, strict=True)
    ]
    draft.write_context(mx.concatenate(padded), cache, [0, 0])
    rest = [f[:, n:] for f, n in zip(features, first, strict=True)]
    longest = max(r.shape[1] for r in rest)
    padded = [
        mx.concatenate([r, mx.zeros((1, longest - r.shape[1], r.shape[-1]))], axis=1)
        for r in rest
    ]
    draft.write_context(mx.concatenate(padded), cache, first)
    block = mx.array([[20] + [MASK] * (BLOCK - 1), [30] + [MASK] * (BLOCK - 1)])
    x = tapped.embed(block)
    got = draft(x, cache, [len(p) for p in prompts])
    for b, prompt in enumerate(prompts):
        want = reference_block(draft, features[b][:, : len(prompt)], x[b : b + 1])
        assert mx.allclose(got[b : b + 1], want, atol=2e-4, rtol=2e-4).item(), b
    # attending over the whole capacity under the mask (as on a GPU) is the same
    cache.bucket_windows = True
    bucketed = draft(x, cache, [len(p) for p in prompts])
    assert cache.capacity > max(len(p) for p in prompts)
    assert mx.allclose(bucketed, got, atol=1e-5, rtol=1e-5).item()


@pytest.mark.parametrize("depth", [3, 0], ids=["drafted", "plain-round"])
def test_a_commit_leaves_the_draft_of_a_fresh_open(
    tapped: CausalLM, depth: int
) -> None:
    """After a round (drafted: accepted 0, 2 and 3 of 3; or a plain round,
    where the draft was not asked and stores nothing), the draft's context
    is a fresh draft's over the committed tokens."""
    draft = random_draft(dflash_config())
    drafter = DFlashDrafter(tapped, draft)
    prompts = [list(range(3, 14)), [7, 8, 9, 10, 11], [42]]
    rows = start_rows(prompts, SamplingParams())
    hidden = padded(
        [
            features(tapped, p[:-1]) if len(p) > 1 else mx.zeros((1, 0, 128))
            for p in prompts
        ]
    )
    state = drafter.open(rows, hidden)
    assert isinstance(state, DFlashRows)
    proposal = state.propose(rows, depth) if depth else Proposal.empty(len(rows))
    drafted = proposal.device.tolist() if proposal.device is not None else [[]] * 3
    # the verify window [pending, drafts] through the target, each row at its length
    windows = [[row.pending, *d] for row, d in zip(rows, drafted, strict=True)]
    verified = tapped(
        mx.array(windows), _prefilled(tapped, prompts), [row.length for row in rows]
    )
    accepted = [0, 2, 3] if depth else [0, 0, 0]
    committed = state.prepare_commit(
        rows, proposal, [tuple(d) for d in drafted], accepted, verified
    ).commit()
    assert isinstance(committed, DFlashRows)
    # the rows after the round: pending + accepted drafts committed, a new pending
    after = [
        row.advanced((*d[:a], 1 + b))
        for b, (row, d, a) in enumerate(zip(rows, drafted, accepted, strict=True))
    ]
    fresh_hidden = padded([features(tapped, list(r.tokens)[:-1]) for r in after])
    fresh = drafter.open(after, fresh_hidden)
    assert isinstance(fresh, DFlashRows)
    # the same context lengths, then the same block outputs
    assert (
        committed._store_pending()
        == fresh._store_pending()
        == tuple(r.length for r in after)
    )
    block = mx.array([[r.pending] + [MASK] * 3 for r in after])
    x = tapped.embed(block)
    lengths = [r.length for r in after]
    a = committed.draft(x, committed.cache, lengths)
    b = fresh.draft(x, fresh.cache, lengths)
    assert mx.allclose(a, b, atol=2e-4, rtol=2e-4).item()


def _prefilled(model: CausalLM, prompts: list[list[int]]) -> Any:
    """A target cache with each prompt's processed tokens (all but the last)."""
    cache = model.make_cache(len(prompts))
    longest = max(len(p) - 1 for p in prompts)
    grid = [p[:-1] + [0] * (longest - len(p) + 1) for p in prompts]
    if longest:
        model(mx.array(grid), cache, [0] * len(prompts))
    return cache


SAMPLINGS = {
    "greedy": SamplingParams(),
    "t0.8-topk": SamplingParams(temperature=0.8, top_k=20, seed=3),
    "t1.0-topp-minp": SamplingParams(temperature=1.0, top_p=0.9, min_p=0.02, seed=9),
}


@pytest.mark.parametrize("sampling", list(SAMPLINGS), ids=list(SAMPLINGS))
@pytest.mark.parametrize(
    ("generation", "depth"), [(1, 1), (1, 3), (1, BLOCK - 1), (2, BLOCK - 1)]
)
@pytest.mark.parametrize("batch", [1, 4])
def test_dflash_output_is_plain_decoding(
    tapped: CausalLM,
    plain: PlainReference,
    sampling: str,
    generation: int,
    depth: int,
    batch: int,
) -> None:
    prompts = PROMPTS[:batch]
    params = SAMPLINGS[sampling]
    config = dflash_config() if generation == 1 else dflash2_config()
    drafter = DFlashDrafter(tapped, random_draft(config, seed=7))
    check_output_is_plain(tapped, prompts, params, drafter, depth, plain)


@pytest.mark.parametrize("generation", [1, 2])
def test_dflash_in_the_host_first_round_and_ahead_is_plain_decoding(
    tapped: CausalLM, plain: PlainReference, generation: int
) -> None:
    """The round's other forms: host-first (drafts read back before the
    verify window is built) and with the next drafts launched ahead (a
    drafter without that form proposes as usual)."""
    params = SAMPLINGS["t0.8-topk"]
    config = dflash_config() if generation == 1 else dflash2_config()
    for device_round, ahead in ((False, False), (True, True)):
        drafter = DFlashDrafter(tapped, random_draft(config, seed=7))
        tokens, results = run(
            tapped,
            PROMPTS,
            params,
            drafter,
            depth=3,
            device_round=device_round,
            draft_ahead=ahead,
        )
        assert all(
            not r.metrics.draft_errors and r.metrics.drafted > 0 for r in results
        )
        assert tokens == plain(PROMPTS, params)


# --- binding -------------------------------------------------------------------


def _target() -> Any:
    return as_target(tiny_model(1))


def test_a_dflash2_artifact_binds_as_dflash2(tmp_path: Path) -> None:
    """Detected apart from DFlash; its checkpoint's codebooks without the
    `.weight` suffix (as released) load."""
    config = dflash2_config()
    draft = random_draft(config)
    folder = write_artifact(tmp_path / "d2", config, draft)
    weights = dict(tree_flatten(draft.parameters()))
    for book in ("predecessor_codebook", "successor_codebook"):
        name = f"candidate_selector.{book}"
        weights[name] = weights.pop(name + ".weight")
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    registry = default_registry()
    assert registry.detect(folder) == Success("dflash2")
    target = _target()
    loaded = registry.load(
        "dflash2", DraftLoadRequest(target=target, source=str(folder))
    )
    assert isinstance(loaded, Success), loaded
    assert (loaded.unwrap().kind, loaded.unwrap().width) == ("dflash2", BLOCK - 1)
    bound = loaded.unwrap().drafter
    assert isinstance(bound, DFlashDrafter)
    books = bound.draft.candidate_selector.predecessor_codebook.weight
    assert mx.array_equal(books, draft.candidate_selector.predecessor_codebook.weight)


def test_a_dflash_artifact_binds_with_its_block_width(tmp_path: Path) -> None:
    config = dflash_config()
    folder = write_artifact(tmp_path / "d", config, random_draft(config))
    registry = default_registry()
    assert registry.detect(folder) == Success("dflash")
    target = _target()
    assert target.model.taps == ()
    loaded = registry.load(
        "dflash", DraftLoadRequest(target=target, source=str(folder))
    )
    assert isinstance(loaded, Success), loaded
    assert loaded.unwrap().width == BLOCK - 1 and loaded.unwrap().kind == "dflash"
    assert target.model.taps == (0, 1)
    # a wider request is pinned to the block, a narrower one kept
    wide = registry.load(
        "dflash", DraftLoadRequest(target=_target(), source=str(folder), width=9)
    )
    assert wide.unwrap().width == BLOCK - 1
    narrow = registry.load(
        "dflash", DraftLoadRequest(target=_target(), source=str(folder), width=2)
    )
    assert narrow.unwrap().width == 2


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"hidden_size": 32, "intermediate_size": 64}, "hidden states of size 32"),
        (
            {"dflash_config": {"target_layer_ids": [0, 5], "mask_token_id": MASK}},
            "taps layers [5], which the target does not expose",
        ),
        (
            {"dflash_config": {"target_layer_ids": [0], "mask_token_id": VOCAB + 3}},
            "mask token",
        ),
        ({"dflash_config": {"target_layer_ids": [0]}}, "mask_token_id"),
        ({"architectures": ["DFlash2DraftModel"]}, "conv_kernel_size"),
        ({"layer_types": ["full_attention", "chunked_attention"]}, "layer_types"),
        ({"output_multiplier": "half"}, "must be numbers"),
    ],
    ids=["hidden", "layers", "mask", "no-mask", "dflash2", "layer-kinds", "multiplier"],
)
def test_a_dflash_draft_that_does_not_fit_is_refused(
    tmp_path: Path, change: dict[str, Any], message: str
) -> None:
    good = dflash_config()
    folder = write_artifact(tmp_path / "d", good, random_draft(good))
    (folder / "config.json").write_text(json.dumps({**good, **change}))
    target = _target()
    loaded = default_registry().load(
        "dflash", DraftLoadRequest(target=target, source=str(folder))
    )
    assert isinstance(loaded, Failure)
    assert message in loaded.failure().message, loaded.failure().message
    assert target.model.taps == ()  # nothing bound, nothing tapped


def test_dflash_weights_that_do_not_match_are_refused(tmp_path: Path) -> None:
    config = dflash_config()
    draft = random_draft(config)
    folder = write_artifact(tmp_path / "d", config, draft)
    weights = dict(tree_flatten(draft.parameters()))
    del weights["fc.weight"]
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    loaded = default_registry().load(
        "dflash", DraftLoadRequest(target=_target(), source=str(folder))
    )
    assert isinstance(loaded, Failure)
    assert "missing ['fc.weight']" in loaded.failure().message


def test_a_target_that_cannot_tap_is_refused(tmp_path: Path) -> None:
    config = dflash_config()
    folder = write_artifact(tmp_path / "d", config, random_draft(config))
    model = tiny_model(1)
    untappable = SimpleNamespace(
        model=SimpleNamespace(), args=model.args, source="tiny"
    )
    loaded = default_registry().load(
        "dflash", DraftLoadRequest(target=untappable, source=str(folder))
    )
    assert isinstance(loaded, Failure)
    assert "does not expose" in loaded.failure().message


# --- FR-Spec -----------------------------------------------------------------


def _subset(model: CausalLM, ids: list[int]) -> SubsetHead:
    return SubsetHead.of(model, DraftVocabulary.create(ids, VOCAB).unwrap())


@pytest.mark.parametrize("generation", [1, 2])
@pytest.mark.parametrize("sampling", ["greedy", "t0.8-topk"])
def test_dflash_drafts_over_a_draft_vocabulary_are_lossless(
    tapped: CausalLM, plain: PlainReference, generation: int, sampling: str
) -> None:
    """Drafts drawn over every third row of the head (token ids, not row
    indices, reach the round) leave the output plain decoding's."""
    listed = list(range(0, VOCAB, 3))
    config = dflash_config() if generation == 1 else dflash2_config()
    drafter = DFlashDrafter(
        tapped, random_draft(config, seed=7), subset=_subset(tapped, listed)
    )
    params = SAMPLINGS[sampling]
    tokens, results = run(tapped, PROMPTS, params, drafter, depth=BLOCK - 1)
    assert all(not r.metrics.draft_errors and r.metrics.drafted > 0 for r in results)
    assert tokens == plain(PROMPTS, params)
    # the drafts are token ids of the list
    rows = start_rows([list(range(3, 14))], params)
    features = tapped(
        mx.array([list(range(3, 13))]), tapped.make_cache(1), [0]
    ).features
    proposal = drafter.open(rows, features).propose(rows, BLOCK - 1)
    assert proposal.device is not None
    assert all(t in listed for t in proposal.device.tolist()[0])


@pytest.mark.parametrize("generation", [1, 2])
def test_a_draft_vocabulary_of_every_row_drafts_as_the_full_head(
    tapped: CausalLM, generation: int
) -> None:
    config = dflash_config() if generation == 1 else dflash2_config()
    draft = random_draft(config, seed=9)
    rows = start_rows(
        [list(range(3, 14)), [7, 8, 9, 10, 11]], SamplingParams(temperature=0.9, seed=4)
    )
    hidden = mx.concatenate(
        [
            tapped(mx.array([list(range(3, 13))]), tapped.make_cache(1), [0]).features,
            mx.concatenate(
                [
                    tapped(
                        mx.array([[7, 8, 9, 10]]), tapped.make_cache(1), [0]
                    ).features,
                    mx.zeros((1, 6, 128)),
                ],
                axis=1,
            ),
        ]
    )
    full = DFlashDrafter(tapped, draft).open(rows, hidden).propose(rows, 4)
    every = DFlashDrafter(tapped, draft, subset=_subset(tapped, list(range(VOCAB))))
    listed = every.open(rows, hidden).propose(rows, 4)
    assert full.device is not None and listed.device is not None
    assert full.device.tolist() == listed.device.tolist()


def test_a_dflash2_vocabulary_smaller_than_its_candidates_is_refused(
    tmp_path: Path,
) -> None:
    config = dflash2_config()
    folder = write_artifact(tmp_path / "d2", config, random_draft(config))
    DraftVocabulary.create([1, 2, 3], VOCAB).unwrap().write(tmp_path / "v.json")
    loaded = default_registry().load(
        "dflash2",
        DraftLoadRequest(
            target=_target(), source=str(folder), draft_vocab=str(tmp_path / "v.json")
        ),
    )
    assert isinstance(loaded, Failure)
    assert "fewer than the DFlash2 selector's 6" in loaded.failure().message
    # a list beside the drafter loads with it (as an MTP companion's does)
    DraftVocabulary.create(list(range(0, VOCAB, 2)), VOCAB).unwrap().write(
        folder / "draft_vocab.json"
    )
    bound = default_registry().load(
        "dflash2", DraftLoadRequest(target=_target(), source=str(folder), draft_bits=16)
    )
    drafter = bound.unwrap().drafter
    assert isinstance(drafter, DFlashDrafter) and drafter.subset is not None
    assert drafter.calibration_key == f"dflash2/vocab={len(range(0, VOCAB, 2))}"


# --- quantized projections ------------------------------------------------------

_SUBLAYERS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
PROJECTIONS = ("fc", *(f"layers.{i}.{sub}" for i in range(2) for sub in _SUBLAYERS))
# what stays float: the convolutions' kernel projections, the selector's
# hidden projection (Linear) and its codebooks (Embedding)
KEPT_FLOAT = (
    *(
        f"layers.{i}.{c}.kernel_projection"
        for i in range(2)
        for c in ("attention_conv", "mlp_conv")
    ),
    "candidate_selector.hidden_projection",
    "candidate_selector.predecessor_codebook",
    "candidate_selector.successor_codebook",
)


def _layers(draft: DFlashDraft) -> dict[str, nn.Module]:
    return dict(draft.named_modules())


def _resident(draft: DFlashDraft) -> int:
    """Bytes of the draft's parameters."""
    return sum(v.nbytes for _, v in tree_flatten(draft.parameters()))


def _loaded(
    folder: Path, kind: str = "dflash2", bits: int | None = None
) -> DFlashDrafter:
    loaded = default_registry().load(
        kind, DraftLoadRequest(target=_target(), source=str(folder), draft_bits=bits)
    )
    assert isinstance(loaded, Success), loaded
    drafter = loaded.unwrap().drafter
    assert isinstance(drafter, DFlashDrafter)
    return drafter


def test_the_default_bits_are_4_for_dflash2_on_a_gpu() -> None:
    """Float on the CPU (MLX's quantized products are its slow path) and
    for DFlash (v1) drafts."""
    dflash = DFlashSettings.of(dflash_config()).unwrap()
    dflash2 = DFlashSettings.of(dflash2_config()).unwrap()
    assert default_bits(dflash2, gpu=True) == 4
    assert default_bits(dflash2, gpu=False) == 16
    assert default_bits(dflash, gpu=True) == default_bits(dflash, gpu=False) == 16


def test_a_dflash2_draft_loads_its_projections_at_4_bits(tmp_path: Path) -> None:
    """At 4 bits (this device's default or asked): every projection a 4-bit
    affine QuantizedLinear in groups of 64, the rest float and unchanged;
    the parameters take exactly the packed bytes (4 bits a weight, a float32
    scale and bias per 64)."""
    config = dflash2_config()
    draft = random_draft(config)
    folder = write_artifact(tmp_path / "d2", config, draft)
    default = _loaded(folder)
    assert default.draft.quantized_bits == ((4,) if on_gpu() else ())
    drafter = _loaded(folder, bits=4)
    layers, floats = _layers(drafter.draft), _layers(draft)
    for path in PROJECTIONS:
        layer = layers[path]
        assert isinstance(layer, nn.QuantizedLinear), path
        assert (layer.bits, layer.group_size, layer.mode) == (4, 64, "affine"), path
    for path in KEPT_FLOAT:
        assert type(layers[path]) is type(floats[path]), path
        assert mx.array_equal(layers[path].weight, floats[path].weight), path
    assert drafter.draft.quantized_bits == (4,)
    assert drafter.calibration_key == "dflash2/bits=4"
    before, after = _resident(draft), _resident(drafter.draft)
    packed = 0
    for path in PROJECTIONS:
        rows, cols = floats[path].weight.shape
        packed += rows * cols * 4 - (rows * cols // 2 + 2 * rows * (cols // 64) * 4)
    assert after == before - packed
    assert after / before < 0.25, (before, after)  # (float32: 89,552 -> 81,728 B)


@pytest.mark.parametrize(
    ("generation", "asked", "bits"),
    [(2, 8, 8), (2, 16, None), (1, None, None), (1, 4, 4), (1, 8, 8)],
    ids=["dflash2-8", "dflash2-float", "dflash-default", "dflash-4", "dflash-8"],
)
def test_draft_bits_choose_the_projections_bits(
    tmp_path: Path, generation: int, asked: int | None, bits: int | None
) -> None:
    """8 bits, or float (16) when asked; a DFlash (v1) draft stays float
    unless asked, on any device."""
    config = dflash_config() if generation == 1 else dflash2_config()
    draft = random_draft(config)
    folder = write_artifact(tmp_path / "d", config, draft)
    drafter = _loaded(folder, "dflash" if generation == 1 else "dflash2", asked)
    layers = _layers(drafter.draft)
    for path in PROJECTIONS:
        if bits is None:
            assert type(layers[path]) is type(_layers(draft)[path]), path
        else:
            assert isinstance(layers[path], nn.QuantizedLinear), path
            assert layers[path].bits == bits, path
    assert drafter.draft.quantized_bits == (() if bits is None else (bits,))
    if bits is None:
        assert _resident(drafter.draft) == _resident(draft)
    else:
        assert _resident(drafter.draft) < _resident(draft) * (
            0.25 if bits == 4 else 0.4
        )


def _quantized(config: dict[str, Any], bits: int, seed: int = 7) -> DFlashDraft:
    """`random_draft(config, seed)` loaded with its projections at `bits`."""
    weights = dict(tree_flatten(random_draft(config, seed=seed).parameters()))
    settings = DFlashSettings.of(config).unwrap()
    draft = build_dflash(draft_args(config), settings, weights, bits=bits).unwrap()
    assert draft.quantized_bits == (bits,)
    return draft


@pytest.mark.parametrize("sampling", list(SAMPLINGS), ids=list(SAMPLINGS))
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("batch", [1, 4])
def test_a_quantized_dflash2_draft_is_plain_decoding(
    tapped: CausalLM, plain: PlainReference, sampling: str, bits: int, batch: int
) -> None:
    prompts = PROMPTS[:batch]
    params = SAMPLINGS[sampling]
    drafter = DFlashDrafter(tapped, _quantized(dflash2_config(), bits))
    tokens, results = run(tapped, prompts, params, drafter, depth=BLOCK - 1)
    assert all(not r.metrics.draft_errors and r.metrics.drafted > 0 for r in results)
    assert tokens == plain(prompts, params)


def test_a_dflash2_draft_loaded_at_4_bits_is_plain_decoding(
    tmp_path: Path, plain: PlainReference
) -> None:
    """Through the registry, greedy and sampled, B=4."""
    config = dflash2_config()
    folder = write_artifact(tmp_path / "d2", config, random_draft(config, seed=7))
    drafter = _loaded(folder, bits=4)
    assert drafter.draft.quantized_bits == (4,)
    for name in ("greedy", "t1.0-topp-minp"):
        params = SAMPLINGS[name]
        tokens, results = run(drafter.target, PROMPTS, params, drafter, depth=BLOCK - 1)
        assert all(
            not r.metrics.draft_errors and r.metrics.drafted > 0 for r in results
        )
        assert tokens == plain(PROMPTS, params), name


def test_the_quantized_forward_is_the_dequantized_weights_forward(
    tapped: CausalLM,
) -> None:
    """The 4-bit draft computes what a float draft holding its projections'
    dequantized weights (and every other weight as loaded) computes."""
    config = dflash2_config()
    quantized = _quantized(config, 4)
    layers = _layers(quantized)
    weights = {}
    for name, value in tree_flatten(quantized.parameters()):
        path, leaf = name.rsplit(".", 1)
        layer = layers[path]
        if isinstance(layer, nn.QuantizedLinear):
            if leaf == "weight":
                weights[name] = mx.dequantize(
                    value, layer.scales, layer.biases, layer.group_size, layer.bits
                )
        else:
            weights[name] = value
    settings = DFlashSettings.of(config).unwrap()
    dense = build_dflash(draft_args(config), settings, weights).unwrap()
    assert dense.quantized_bits == ()
    prompt = list(range(3, 14))
    features = tapped(mx.array([prompt]), tapped.make_cache(1), [0]).features
    assert features is not None
    x = tapped.embed(mx.array([[20] + [MASK] * (BLOCK - 1)]))
    outputs = []
    for draft in (quantized, dense):
        cache = draft.make_cache(1)
        draft.write_context(features, cache, [0])
        outputs.append(draft(x, cache, [len(prompt)]))
    assert mx.allclose(outputs[0], outputs[1], atol=1e-4, rtol=1e-4).item()


def test_a_quantized_checkpoint_loads_as_it_is(
    tmp_path: Path, plain: PlainReference
) -> None:
    """Weights with `.scales` load quantized as stored (8 bits stay 8, the
    codebooks and kernel projections too, where the checkpoint quantized
    them), drafting losslessly; asking other bits is refused."""
    config = dflash2_config()
    config["dflash_config"]["selector_rank"] = 64  # (codebook rows a group wide)
    draft = random_draft(config, seed=7)
    quantize_layers(draft, 8, 64)  # every layer it can: codebooks too
    stored = dict(tree_flatten(draft.parameters()))
    assert "candidate_selector.predecessor_codebook.scales" in stored
    folder = write_artifact(tmp_path / "q8", config, draft)
    for asked in (None, 8):
        drafter = _loaded(folder, bits=asked)
        assert drafter.draft.quantized_bits == (8,)
        got = dict(tree_flatten(drafter.draft.parameters()))
        assert got.keys() == stored.keys()
        assert all(mx.array_equal(got[k], v) for k, v in stored.items())
    layers = _layers(drafter.draft)
    assert isinstance(
        layers["candidate_selector.successor_codebook"], nn.QuantizedEmbedding
    )
    params = SAMPLINGS["t0.8-topk"]
    tokens, results = run(drafter.target, PROMPTS, params, drafter, depth=BLOCK - 1)
    assert all(not r.metrics.draft_errors and r.metrics.drafted > 0 for r in results)
    assert tokens == plain(PROMPTS, params)
    for asked in (4, 16):
        refused = default_registry().load(
            "dflash2",
            DraftLoadRequest(target=_target(), source=str(folder), draft_bits=asked),
        )
        assert isinstance(refused, Failure)
        message = refused.failure().message
        assert "quantized to 8 bits, which load as they are" in message, message


@pytest.mark.parametrize("bits", [0, 2, 5, 32])
def test_invalid_draft_bits_are_refused(tmp_path: Path, bits: int) -> None:
    config = dflash2_config()
    folder = write_artifact(tmp_path / "d2", config, random_draft(config))
    target = _target()
    refused = default_registry().load(
        "dflash2", DraftLoadRequest(target=target, source=str(folder), draft_bits=bits)
    )
    assert isinstance(refused, Failure)
    message = refused.failure().message
    assert "draft bits must be 4 or 8" in message and f"got {bits}" in message
    assert target.model.taps == ()  # refused before anything was bound
    settings = DFlashSettings.of(config).unwrap()
    weights = dict(tree_flatten(random_draft(config).parameters()))
    built = build_dflash(draft_args(config), settings, weights, bits=bits)
    assert isinstance(built, Failure) and f"got {bits}" in built.failure().message


def test_draft_bits_for_a_kind_without_them_are_refused() -> None:
    refused = default_registry().load(
        "ngram", DraftLoadRequest(target=_target(), draft_bits=4)
    )
    assert isinstance(refused, Failure)
    assert "a ngram draft takes none" in refused.failure().message


# --- a hybrid target (conftest.py's `hybrid`) ----------------------------------


@pytest.mark.parametrize("sampling", ["greedy", "t0.8-topk"])
@pytest.mark.parametrize("batch", [1, 4])
def test_dflash_on_a_hybrid_target_is_plain_decoding(
    hybrid: CausalLM, sampling: str, batch: int
) -> None:
    """The rounds' recurrent-state commits and the draft's context agree on
    a hybrid target too (its rows prefill one by one)."""
    prompts = PROMPTS[:batch]
    params = SAMPLINGS[sampling]
    plain, _ = run(hybrid, prompts, params, max_tokens=14)
    config = dflash_config()
    config["dflash_config"] = {**config["dflash_config"], "target_layer_ids": [0, 3]}
    drafter = DFlashDrafter(hybrid, random_draft(config, seed=13))
    spec, results = run(hybrid, prompts, params, drafter, depth=3, max_tokens=14)
    assert all(not r.metrics.draft_errors and r.metrics.drafted > 0 for r in results)
    assert spec == plain


@pytest.mark.parametrize("sampling", ["greedy", "t0.8-topk"])
@pytest.mark.parametrize("batch", [1, 3])
def test_dflash_on_a_gemma4_target_is_plain_decoding(sampling: str, batch: int) -> None:
    """A Gemma-4 target taps its layers as the others do; the draft projects
    through its softcapped head (`HeadWeights.softcap`) and reads its scaled
    embedding."""
    from tests.models.test_gemma4 import tiny_gemma

    target = tiny_gemma("shared-ple")
    prompts = PROMPTS[:batch]
    params = SAMPLINGS[sampling]
    plain, _ = run(target, prompts, params, max_tokens=14)
    config = dflash_config()
    config["dflash_config"] = {**config["dflash_config"], "target_layer_ids": [0, 3]}
    target.tap((0, 3))
    drafter = DFlashDrafter(target, random_draft(config, seed=17))
    spec, results = run(target, prompts, params, drafter, depth=3, max_tokens=14)
    assert all(not r.metrics.draft_errors and r.metrics.drafted > 0 for r in results)
    assert spec == plain


def test_tapped_columns_pick_a_draft_s_layers_from_the_target_s_taps() -> None:
    from models.base import tapped_columns

    features = mx.arange(2 * 3 * 4, dtype=mx.float32).reshape(2, 3, 4)  # taps (4, 0)
    assert tapped_columns((4, 0), (4, 0), features) is features
    swapped = tapped_columns((4, 0), (0, 4), features)
    assert mx.array_equal(
        swapped, mx.concatenate([features[..., 2:], features[..., :2]], -1)
    )
    assert mx.array_equal(tapped_columns((4, 0), (0,), features), features[..., 2:])
    with pytest.raises(ValueError, match=r"layers \[1\]"):
        tapped_columns((4, 0), (0, 1), features)


@pytest.mark.parametrize("sampling", ["greedy", "t0.8-topk"])
def test_two_dflash_drafts_bound_to_one_target_each_read_their_own_layers(
    tmp_path: Path, plain: PlainReference, sampling: str
) -> None:
    """Binding a second DFlash draft with other layers to the same target
    object taps the union; each draft reads its own layers' columns, so each
    drafts exactly what it drafts bound alone, and both are lossless."""
    configs = {
        name: dflash_config(
            dflash_config={
                "target_layer_ids": layers,
                "block_size": BLOCK,
                "mask_token_id": MASK,
            }
        )
        for name, layers in (("a", [0, 1]), ("b", [1, 0]), ("c", [1]))
    }
    folders = {
        name: write_artifact(tmp_path / name, config, random_draft(config, seed=11))
        for name, config in configs.items()
    }
    registry = default_registry()

    def bound(target: Any, name: str) -> DFlashDrafter:
        request = DraftLoadRequest(target=target, source=str(folders[name]))
        drafter = registry.load("dflash", request).unwrap().drafter
        assert isinstance(drafter, DFlashDrafter)
        return drafter

    shared = _target()
    together = {name: bound(shared, name) for name in folders}
    assert shared.model.taps == (0, 1)  # the union, in binding order
    params = SAMPLINGS[sampling]
    prompts = PROMPTS[:2]
    for name, drafter in together.items():
        alone = _target()
        solo = bound(alone, name)
        assert alone.model.taps == tuple(
            configs[name]["dflash_config"]["target_layer_ids"]
        )
        tokens, results = run(shared.model, prompts, params, drafter, depth=BLOCK - 1)
        solo_tokens, solo_results = run(
            alone.model, prompts, params, solo, depth=BLOCK - 1
        )
        assert tokens == solo_tokens == plain(prompts, params)
        assert all(
            not r.metrics.draft_errors and r.metrics.drafted > 0 for r in results
        )
        accepted = [r.metrics.accepted for r in results]
        assert accepted == [r.metrics.accepted for r in solo_results], name
        # the first round's drafts, from each target's own prefill features
        prompt = list(PROMPTS[0])
        rows = start_rows([prompt], params)
        drafts = []
        for target, drafter_of in ((shared, drafter), (alone, solo)):
            ids = mx.array([prompt[:-1]])
            features = target.model(ids, target.model.make_cache(1), [0]).features
            proposal = drafter_of.open(rows, features).propose(rows, BLOCK - 1)
            drafts.append(proposal.device.tolist())
        assert drafts[0] == drafts[1], name
