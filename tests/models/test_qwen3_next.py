"""The own MLX Qwen3-Next (hybrid attention + GatedDeltaNet + MoE) against HF
transformers, and the recurrent state's per-position commit.

A tiny random config (4 layers: linear, full, linear, full attention; hidden
64; 4 query / 2 kv heads of 16; 2 key / 4 value linear heads of 8; 4 experts
top-2 plus a shared expert; layer 2 dense via `mlp_only_layers`; vocab 128)
runs in float32 on the CPU. Parameters are re-drawn after HF's init so the
zero-centred norms, A_log and dt_bias are non-trivial. Weights move through
`state_dict` -> `load_weights`, as an HF checkpoint would.

The rollback property: committing k positions of a verify window equals
decoding those k tokens one by one, for every k, every row.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest
import torch
import transformers
from attrs import evolve
from hypothesis import given, settings
from hypothesis import strategies as st
from returns.result import Failure, Success
from transformers.models.qwen3_next import modeling_qwen3_next as hf_qwen3_next

from models import gated_delta
from models.build import (
    ROUTER_BITS,
    build_model,
    load_weights,
    quantization_block,
    quantize_model,
)
from models.hybrid_cache import HybridCache
from models.layers import flat_parameters
from models.mtp import MtpHead, build_mtp
from models.qwen3_next import (
    PER_POSITION_MAX,
    Model,
    QuantizedSwitchLinear,
    SparseMoeBlock,
    SwitchGLU,
    sanitize_weights,
)
from schemas.converter import hf as hf_converter
from schemas.converter import structure, unstructure
from schemas.errors import ConfigError
from schemas.hf import DecoderArgs
from schemas.hf_hybrid import HybridArgs, hybrid_args
from tests.models import hybrid_support as support
from tests.models.hybrid_support import (
    ROLLBACK_TOL,
    TOL,
    VOCAB,
    TorchMtp,
    as_np,
    dequantized,
    hf_logits,
    hf_weights,
    mtp_weights,
    per_expert,
    randomize,
    step,
    token_ids,
)
from tests.models.rollback_support import (  # noqa: F401  (pytest collects them here)
    prefilled_cache,
    test_committing_k_of_a_window_equals_decoding_k_tokens,
    test_rows_keeping_different_counts_equal_each_row_alone,
)
from tests.rounding import same_math

pytestmark = pytest.mark.reference

TINY: dict[str, Any] = {
    **support.LAYOUT,
    **support.EXPERTS,
    "intermediate_size": 96,
    "mlp_only_layers": [2],
    "attn_implementation": "eager",
}


def make_hf(seed: int = 0, **overrides: Any) -> Any:
    config = transformers.Qwen3NextConfig(**{**TINY, **overrides})
    torch.manual_seed(seed)
    model = transformers.Qwen3NextForCausalLM(config).eval()
    randomize(model, seed)
    return model


def args_of(hf: Any) -> HybridArgs:
    parsed = hybrid_args(hf.config.to_dict(), "test config")
    assert isinstance(parsed, Success), parsed
    args: HybridArgs = parsed.unwrap()
    return args


def ours(hf: Any) -> Model:
    model: Model = support.ours(hf, Model)
    return model


@pytest.fixture(scope="module")
def pair() -> tuple[Any, Model]:
    hf = make_hf()
    return hf, ours(hf)


# --- config ---------------------------------------------------------------


def test_config_reads_rope_from_both_forms_and_derives_layer_types() -> None:
    base = {
        "model_type": "qwen3_next",
        "hidden_size": 64,
        "num_hidden_layers": 8,
        "intermediate_size": 96,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": VOCAB,
        "eos_token_id": 5,
    }
    legacy = hybrid_args(
        {**base, "rope_theta": 1e7, "partial_rotary_factor": 0.5}, "legacy"
    ).unwrap()
    modern = hybrid_args(
        {
            **base,
            "rope_parameters": {
                "rope_theta": 1e7,
                "rope_type": "default",
                "partial_rotary_factor": 0.5,
            },
        },
        "modern",
    ).unwrap()
    assert legacy == modern
    assert legacy.rope.theta == 1e7 and legacy.partial_rotary_factor == 0.5
    assert legacy.head_dim == 256  # transformers' default for this model type
    assert legacy.rotary_dims == 128
    assert legacy.eos_token_id == (5,)
    # full_attention_interval 4 (the default): every 4th layer is attention
    assert legacy.attention_layers == (3, 7)
    assert legacy.linear_layers == (0, 1, 2, 4, 5, 6)
    assert isinstance(legacy, DecoderArgs)  # what the pipeline reads on `args`
    again = structure(hf_converter, unstructure(hf_converter, legacy), HybridArgs, "x")
    assert again == Success(legacy)


@settings(max_examples=25, deadline=None)
@given(
    kinds=st.lists(
        st.sampled_from(["linear_attention", "full_attention"]), min_size=1, max_size=8
    ),
    factor=st.sampled_from([0.25, 0.5, 1.0]),
    experts=st.integers(0, 8),
    dense=st.lists(st.integers(0, 7), max_size=3),
    legacy_rope=st.booleans(),
)
def test_hybrid_args_round_trip_through_the_converter(
    kinds: list[str], factor: float, experts: int, dense: list[int], legacy_rope: bool
) -> None:
    raw: dict[str, Any] = {
        **TINY,
        "model_type": "qwen3_next",
        "num_hidden_layers": len(kinds),
        "layer_types": kinds,
        "num_experts": experts,
        "mlp_only_layers": dense,
    }
    if legacy_rope:
        raw.update(rope_theta=5e6, partial_rotary_factor=factor)
    else:
        raw["rope_parameters"] = {"rope_theta": 5e6, "partial_rotary_factor": factor}
    args = hybrid_args(raw, "cfg").unwrap()
    assert (args.rope.theta, args.partial_rotary_factor) == (5e6, factor)
    assert args.layer_types == tuple(kinds)
    assert [args.is_sparse(i) for i in range(len(kinds))] == [
        experts > 0 and i not in dense for i in range(len(kinds))
    ]
    again = structure(hf_converter, unstructure(hf_converter, args), HybridArgs, "x")
    assert again == Success(args)


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ({"layer_types": ["full_attention"] * 3}, "3 entries for 4 layers"),
        ({"layer_types": ["mamba"] * 4}, "unknown kinds ['mamba']"),
        ({"linear_num_key_heads": 3}, "must be a multiple"),
    ],
)
def test_bad_hybrid_layouts_are_config_errors_naming_the_key(
    override: dict[str, Any], named: str
) -> None:
    raw = {**TINY, "model_type": "qwen3_next", **override}
    result = hybrid_args(raw, "cfg")
    assert isinstance(result, Failure)
    assert named in result.failure().message


def test_qwen3_next_needs_hybrid_args() -> None:
    plain = DecoderArgs(
        model_type="qwen3_next",
        hidden_size=64,
        num_hidden_layers=1,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
    )
    result = build_model(plain)
    assert isinstance(result, Failure) and isinstance(result.failure(), ConfigError)
    assert "HybridArgs" in result.failure().message


# --- parity ---------------------------------------------------------------


def test_prefill_matches_transformers(pair: tuple[Any, Model]) -> None:
    hf, model = pair
    assert model.padding_safe is False
    assert support.prefill_error(hf, model) < TOL


@pytest.mark.parametrize("prompt", [6, PER_POSITION_MAX + 6])
def test_prefill_then_decode_matches_full_sequence(
    pair: tuple[Any, Model], prompt: int
) -> None:
    """Past PER_POSITION_MAX the prefill keeps only its final state (and HF
    takes its chunked path)."""
    hf, model = pair
    assert max(support.prefill_then_decode_errors(hf, model, prompt)) < TOL


@pytest.mark.parametrize("length", [1, 7, PER_POSITION_MAX - 1])
def test_a_prefill_window_keeps_only_its_final_state(
    pair: tuple[Any, Model], length: int
) -> None:
    """`prefill=True` (specpipe.prefill): the window carries one recurrent
    state per linear layer instead of one per position, and committing it
    leaves exactly the cache a verify-style window leaves."""
    _, model = pair
    ids = mx.array(token_ids((1, length), seed=5))
    caches = []
    for prefill in (False, True):
        cache = model.make_cache(1)
        out = model(ids, cache, [0], prefill=prefill)
        assert out.delta is not None
        windows = out.delta.windows
        assert all(w.per_position is not prefill for w in windows)
        kept = 1 if prefill else length
        assert all(not w.stacked and len(w.recurrent) == kept for w in windows)
        out.delta.commit([length])
        mx.eval(cache.arrays())
        caches.append(cache)
    verify, prefilled = caches
    for a, b in zip(verify.arrays(), prefilled.arrays(), strict=True):
        gap = mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item()
        assert gap <= same_math(0.0)  # identical on the CPU


def test_a_prefill_window_cannot_keep_a_part(pair: tuple[Any, Model]) -> None:
    _, model = pair
    cache = model.make_cache(1)
    out = model(mx.array(token_ids((1, 5), seed=5)), cache, [0], prefill=True)
    assert out.delta is not None
    with pytest.raises(AssertionError):
        out.delta.commit([3])


@pytest.mark.parametrize("stress", ["random", "same-keys-no-decay", "strong-decay"])
def test_chunked_rule_equals_the_step_recurrence(stress: str) -> None:
    """The prefill form (chunks of 64, blockwise triangular inverse) against
    the per-position recurrence over 150 positions (3 chunks, padded)."""
    mx.random.seed(0)
    batch, length, heads, dk, dv = 2, 150, 4, 16, 8
    q = gated_delta.l2_normalize(mx.random.normal((batch, length, heads, dk))) * 0.25
    k = gated_delta.l2_normalize(mx.random.normal((batch, length, heads, dk)))
    v = mx.random.normal((batch, length, heads, dv))
    g = -mx.exp(0.5 * mx.random.normal((heads,))) * mx.logaddexp(
        mx.random.normal((batch, length, heads)), 0.0
    )
    beta = mx.sigmoid(mx.random.normal((batch, length, heads)))
    if stress == "same-keys-no-decay":
        k = mx.broadcast_to(k[:, :1], k.shape)
        g, beta = mx.zeros_like(g), mx.full(beta.shape, 0.999)
    elif stress == "strong-decay":
        g = 20.0 * g
    state = 0.1 * mx.random.normal((batch, heads, dk, dv))
    out, states = gated_delta.gated_delta_rule(q, k, v, g, beta, state, True)
    chunked_out, final = gated_delta.chunked_gated_delta_rule(q, k, v, g, beta, state)
    bound = same_math(1e-5)
    assert np.abs(as_np(out) - as_np(chunked_out)).max() < bound
    assert np.abs(as_np(states[-1]) - as_np(final)).max() < bound


def test_take_rows_and_concat_rows_keep_rows_intact(pair: tuple[Any, Model]) -> None:
    _, model = pair
    singles = []
    for i, n in enumerate([4, 6, 5]):
        single = model.make_cache(1)
        step(model, single, token_ids((1, n), seed=30 + i), [0])
        singles.append(single)
    stacked = HybridCache.concat_rows(singles)
    picked = stacked.take_rows([2, 0])
    assert picked.batch == 2
    for got, row in zip([0, 1], [2, 0], strict=True):
        for ours_, theirs in zip(
            picked.take_rows([got]).arrays(), singles[row].arrays(), strict=True
        ):
            assert np.array_equal(as_np(ours_), as_np(theirs))
    # and decoding from the picked rows equals decoding from the originals
    nxt = token_ids((2, 1), seed=40)
    both = step(model, picked, nxt, [5, 4])
    for got, row, n in zip([0, 1], [2, 0], [5, 4], strict=True):
        alone = step(model, singles[row], nxt[got : got + 1], [n])
        assert np.abs(both[got] - alone[0]).max() < ROLLBACK_TOL


def test_a_delta_commits_once_and_long_windows_commit_all_or_nothing(
    pair: tuple[Any, Model],
) -> None:
    _, model = pair
    cache = model.make_cache(1)
    before = cache.arrays()
    out = model(mx.array(token_ids((1, 3)), dtype=mx.int32), cache, [0])
    assert out.delta is not None
    # the forward itself left the committed states alone
    assert all(
        a is b for a, b in zip(cache.conv + cache.recurrent, before[-4:], strict=True)
    )
    out.delta.commit([0])
    with pytest.raises(AssertionError):
        out.delta.commit([3])
    long = model(
        mx.array(token_ids((1, PER_POSITION_MAX + 1)), dtype=mx.int32), cache, [0]
    )
    assert long.delta is not None
    with pytest.raises(AssertionError):
        long.delta.commit([2])


def test_bfloat16_errs_like_transformers_bfloat16(pair: tuple[Any, Model]) -> None:
    """bf16 runs the CPU fallbacks of the routed experts (float32 gather for
    the prompt, taken expert weights for one token). This tiny random model
    amplifies rounding (routing flips), so the bound is HF's own bf16 error
    against float32 (measured ratio 0.55-1.3 over 6 prompts). The recurrent
    state stays float32; the conv state takes the model dtype."""
    hf, _ = pair
    args = args_of(hf)
    model = build_model(args).unwrap()
    assert isinstance(model, Model)
    weights = {k: v.astype(mx.bfloat16) for k, v in hf_weights(hf).items()}
    assert load_weights(model, weights, args) == Success(None)
    ids = token_ids((1, 6), seed=60)
    cache = model.make_cache(1)
    got = np.concatenate(
        [step(model, cache, ids[:, :5], [0]), step(model, cache, ids[:, 5:], [5])],
        axis=1,
    )
    exact = hf_logits(hf, ids)
    with torch.no_grad():
        theirs = make_hf().to(torch.bfloat16)(torch.tensor(ids)).logits.float().numpy()
    assert np.abs(got - exact).max() <= 1.5 * np.abs(theirs - exact).max()
    assert all(c.dtype == mx.bfloat16 for c in cache.conv)
    assert all(r.dtype == mx.float32 for r in cache.recurrent)


# --- weights --------------------------------------------------------------


def test_checkpoint_expert_names_and_mlx_layout_load_the_same(
    pair: tuple[Any, Model],
) -> None:
    hf, model = pair
    stacked = model.sanitize(hf_weights(hf))
    listed = model.sanitize(per_expert(hf_weights(hf)))
    assert stacked.keys() == listed.keys() == flat_parameters(model).keys()
    for key in stacked:
        assert np.array_equal(as_np(stacked[key]), as_np(listed[key])), key
    # MLX layout (what sanitize produced) passes through unchanged
    again = sanitize_weights(stacked, model.hybrid.num_experts)
    assert all(again[k] is stacked[k] for k in stacked)


def test_missing_weight_is_a_load_error_naming_it(pair: tuple[Any, Model]) -> None:
    hf, model = pair
    weights = hf_weights(hf)
    del weights["model.layers.0.linear_attn.A_log"]
    result = load_weights(model, weights, model.args)
    assert isinstance(result, Failure)
    assert "model.layers.0.linear_attn.A_log" in result.failure().message


def test_4bit_model_with_quantized_experts_computes_its_dequantized_weights(
    pair: tuple[Any, Model],
) -> None:
    hf, _ = pair
    model = ours(hf)
    quantize_model(model, bits=4, group_size=32)
    switch = model.model.layers[0].mlp
    assert isinstance(switch, SparseMoeBlock)
    assert isinstance(switch.switch_mlp.down_proj, QuantizedSwitchLinear)
    # the router and the shared expert's gate keep 8 bits, as mlx-lm's conversions
    assert (switch.gate.bits, switch.shared_expert_gate.bits) == (ROUTER_BITS, 8)
    assert switch.switch_mlp.down_proj.bits == 4
    block = quantization_block(model)
    assert block is not None and (block["bits"], block["group_size"]) == (4, 32)
    assert block["model.layers.0.mlp.gate"] == {"group_size": 32, "bits": 8}
    assert block["model.layers.0.mlp.shared_expert_gate"] == {
        "group_size": 32,
        "bits": 8,
    }
    ids = token_ids((2, 9), seed=70)
    quantized = step(model, model.make_cache(2), ids, [0, 0])
    saved = flat_parameters(model)
    assert "model.layers.0.mlp.switch_mlp.gate_proj.scales" in saved

    float_args = evolve(model.hybrid, quantization=None)
    simulated = build_model(float_args).unwrap()
    assert load_weights(simulated, dequantized(saved, 32), float_args) == Success(None)
    expected = step(simulated, simulated.make_cache(2), ids, [0, 0])
    assert np.abs(expected - quantized).max() < TOL

    # the saved checkpoint (MLX layout, `*.scales` beside packed experts) reloads
    fresh = build_model(model.args).unwrap()
    assert load_weights(fresh, saved, model.args) == Success(None)
    np.testing.assert_array_equal(
        step(fresh, fresh.make_cache(2), ids, [0, 0]), quantized
    )


# --- MTP head -------------------------------------------------------------


def torch_mtp(config: Any) -> TorchMtp:
    """The Qwen3-Next head's reference wiring (vLLM's
    `Qwen3NextMultiTokenPredictor`)."""
    return TorchMtp(
        config,
        hf_qwen3_next.Qwen3NextRMSNorm,
        hf_qwen3_next.Qwen3NextDecoderLayer,
        hf_qwen3_next.Qwen3NextRotaryEmbedding,
    )


@pytest.fixture(scope="module")
def mtp_pair(pair: tuple[Any, Model]) -> tuple[Any, Model, TorchMtp, MtpHead]:
    hf, model = pair
    reference = torch_mtp(hf.config).eval()
    randomize(reference, seed=7)
    checkpoint = {**hf_weights(hf), **per_expert(mtp_weights(reference))}
    main, mtp = model.split_mtp(checkpoint)
    assert not any(k.startswith("mtp.") for k in main)
    assert main.keys() == flat_parameters(model).keys()
    head = build_mtp(model.hybrid, mtp).unwrap()
    return hf, model, reference, head


def mtp_reference(
    hf: Any, reference: TorchMtp, ids: np.ndarray
) -> np.ndarray:  # [B, L-1, V]: token p+1 paired with the post-norm hidden at p
    return support.mtp_reference(hf.model, hf.lm_head, reference, ids)


def test_mtp_head_matches_its_reference_wiring(
    mtp_pair: tuple[Any, Model, TorchMtp, MtpHead],
) -> None:
    hf, model, reference, head = mtp_pair
    ids = token_ids((2, 10), seed=50)
    grid = mx.array(ids, dtype=mx.int32)
    out = model(grid, model.make_cache(2), [0, 0])
    context = model.final_norm(out.hidden)
    cache = head.make_cache(2)
    drafted = head(model.embed(grid[:, 1:]), context[:, :-1], cache, [0, 0])
    assert drafted.shape == (2, 9, model.args.hidden_size)
    logits = head.logits(drafted, model)
    assert logits.shape == (2, 9, VOCAB)
    assert np.abs(as_np(logits) - mtp_reference(hf, reference, ids)).max() < TOL


def test_mtp_kv_beyond_the_committed_length_is_overwritten(
    mtp_pair: tuple[Any, Model, TorchMtp, MtpHead],
) -> None:
    """Draft 4 junk positions past the committed 6, keep 1, continue: the
    stale keys/values are masked, then overwritten."""
    hf, model, reference, head = mtp_pair
    ids = token_ids((1, 12), seed=51)
    grid = mx.array(ids, dtype=mx.int32)
    out = model(grid, model.make_cache(1), [0])
    context = model.final_norm(out.hidden)
    embeds = model.embed(grid[:, 1:])
    cache = head.make_cache(1)
    head(embeds[:, :6], context[:, :6], cache, [0])
    junk = model.embed(mx.array(token_ids((1, 4), seed=52), dtype=mx.int32))
    head(junk, context[:, 6:10] * 3.0, cache, [6])
    head(embeds[:, 6:7], context[:, 6:7], cache, [6])  # the kept position
    rest = [
        head(embeds[:, p : p + 1], context[:, p : p + 1], cache, [p])
        for p in range(7, 11)
    ]
    logits = head.logits(mx.concatenate(rest, axis=1), model)
    expected = mtp_reference(hf, reference, ids)[:, 7:11]
    assert np.abs(as_np(logits) - expected).max() < TOL


def test_mtp_weights_that_do_not_fit_are_a_load_error(
    mtp_pair: tuple[Any, Model, TorchMtp, MtpHead],
) -> None:
    _, model, _, head = mtp_pair
    weights = dict(flat_parameters(head))
    del weights["fc.weight"]
    result = build_mtp(model.hybrid, weights)
    assert isinstance(result, Failure) and "fc.weight" in result.failure().message
    assert isinstance(
        build_mtp(evolve(model.hybrid), dict(flat_parameters(head))), Success
    )


def test_fused_projections_equal_separate_products() -> None:
    """attention q/k/v; shared expert gate/up: one product each, logits unchanged bit for bit."""
    fused, difference = support.fused_logit_difference(ours(make_hf()))
    assert fused > 0
    assert difference <= same_math(0.0)  # bit for bit on the CPU


@pytest.mark.parametrize("tokens", [1, 6, 7, 48])
def test_routed_experts_grouped_by_expert_equal_each_token_alone(tokens: int) -> None:
    # from SwitchGLU.SORT_MIN (token, expert) pairs on (7 tokens of top-10,
    # a 3-row verify window of 3, a prefill) the pairs are grouped by expert
    # before MLX's sorted gather_mm; each token's output must be its own. (On
    # MLX 0.32's CUDA backend an lhs whose unit axis was a view gave wrong
    # products there, relative error ~1: bench/gather_probe.py. The CPU pins
    # the arithmetic; on a GPU, MLX's TF32 float32 products of several rows
    # leave ~1e-3.)
    mx.random.seed(3)
    glu = SwitchGLU(64, 32, 16)
    x = mx.random.normal((tokens, 64))
    experts = mx.argsort(mx.random.uniform(shape=(tokens, 16)), axis=-1)[:, :10].astype(
        mx.int32
    )
    alone = mx.concatenate(
        [glu(x[i : i + 1], experts[i : i + 1]) for i in range(tokens)]
    )
    together = glu(x, experts)
    assert (tokens * 10 >= SwitchGLU.SORT_MIN) == (tokens >= 7)
    error = (mx.abs(together - alone).max() / mx.abs(alone).max()).item()
    assert error <= (1e-5 if mx.default_device() == mx.cpu else 5e-3), error
