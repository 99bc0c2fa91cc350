"""The one-kernel MTP draft step (models/mtp_cuda.py), what can be checked
without a GPU: which heads and steps it takes, the RoPE frequencies it
rotates with (against MLX's own RoPE), the dispatch between it and the
compiled MLX step, and that its CUDA source (and the gated delta window
kernel's) compiles under NVRTC for the shapes the library builds, without
register spills. Its numbers are checked on a device (bench/fused_probe.py:
tokens, normed output and cached keys / values against the MLX step)."""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
from attrs import evolve
from nvrtc_support import compile_source, source

from models import gated_delta_cuda, mtp_cuda
from models.base import RoPE
from models.build import build_model
from models.fuse import fuse_projections
from models.mtp import MtpHead
from models.mtp_cuda import FusedStep, _inv_freq, fused_weights
from schemas.hf import RopeConfig
from schemas.hf_hybrid import hybrid_args
from schemas.request import SamplingParams
from specpipe.draft_vocab import DraftVocabulary, SubsetHead
from specpipe.drafts.mtp import HeadStep, _through_kernel

VOCAB = 512
BASE: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 256,
    "num_hidden_layers": 2,
    "layer_types": ["linear_attention", "full_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "partial_rotary_factor": 0.5,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "max_position_embeddings": 1024,
}
MOE = {
    "model_type": "qwen3_next",
    **BASE,
    "intermediate_size": 512,
    "num_experts": 8,
    "num_experts_per_tok": 3,
    "moe_intermediate_size": 256,
    "shared_expert_intermediate_size": 256,
}
DENSE = {
    "model_type": "qwen3_5_text",
    **BASE,
    "intermediate_size": 768,
    "attn_output_gate": True,
    "mtp_num_hidden_layers": 1,
}


def built(
    config: dict[str, Any], dtype: mx.Dtype = mx.bfloat16, fuse: bool = True
) -> tuple[Any, MtpHead]:
    args = hybrid_args(config, "test").unwrap()
    mx.random.seed(0)
    target = build_model(args).unwrap()
    target.set_dtype(dtype)
    head = MtpHead(args)
    head.set_dtype(dtype)
    if fuse:
        fuse_projections(target)
        fuse_projections(head)
    mx.eval(target.parameters(), head.parameters())
    return target, head


@pytest.fixture(scope="module")
def moe() -> tuple[Any, MtpHead]:
    return built(MOE)


@pytest.fixture(scope="module")
def dense() -> tuple[Any, MtpHead]:
    return built(DENSE)


def test_the_kernel_takes_moe_and_dense_heads(
    moe: tuple[Any, MtpHead], dense: tuple[Any, MtpHead]
) -> None:
    sparse = fused_weights(*moe, 0)
    assert sparse is not None
    assert not sparse.shape.dense
    assert (sparse.shape.experts, sparse.shape.top_experts) == (8, 3)
    assert sparse.shape.expert_intermediate == sparse.shape.shared_intermediate == 256
    assert sparse.shape.rotary == 32 and sparse.shape.head_dim == 64
    plain = fused_weights(*dense, 0)
    assert plain is not None
    assert plain.shape.dense and plain.shape.intermediate == 768
    assert plain.qkv.shape == (2 * 4 * 64 + 2 * 2 * 64, 256)  # q and gate, k, v
    assert plain.mlp[0].shape == (2 * 768, 256)  # gate and up, fused
    # the weights go to the kernel in its parameter order, between the
    # folded router's weights (after the RoPE frequencies) and the projection rows
    names = mtp_cuda._INPUTS
    assert names.index("w_rt") == names.index("inv_freq") + 1
    start = names.index("w_rt") + 1
    assert len(plain.arrays()) == names.index("w_head") - start
    assert plain.arrays()[names.index("w_qkv") - start] is plain.qkv
    assert plain.arrays()[names.index("mlp1") - start] is plain.mlp[1]


@pytest.mark.parametrize(
    "why",
    ["float32", "unfused", "quantized", "hidden 64"],
)
def test_heads_outside_the_kernel_s_scope_are_refused(why: str) -> None:
    config = dict(MOE)
    if why == "hidden 64":
        config |= {"hidden_size": 64, "head_dim": 16}
    target, head = built(
        config,
        mx.float32 if why == "float32" else mx.bfloat16,
        fuse=why != "unfused",
    )
    if why == "quantized":
        nn.quantize(head, group_size=64, bits=4)
        fuse_projections(head)
    assert fused_weights(target, head, 0) is None


@pytest.mark.parametrize(
    "config",
    [
        RopeConfig(theta=10000.0),
        RopeConfig(theta=1e6, rope_type="linear", factor=4.0),
        RopeConfig(theta=500000.0, rope_type="llama3", factor=8.0),
    ],
)
def test_rope_frequencies_rotate_as_mlx_rope(config: RopeConfig) -> None:
    dims, head_dim, position = 32, 64, 37
    rope = RoPE(dims, config)
    inv_freq = _inv_freq(rope)
    assert inv_freq is not None
    x = mx.random.normal((1, 1, 1, head_dim), key=mx.random.key(3))
    expected = rope(x, position)[0, 0, 0]
    half = dims // 2
    angle = position * inv_freq
    cos, sin = mx.cos(angle), mx.sin(angle)
    v = x[0, 0, 0]
    rotated = mx.concatenate(
        [
            v[:half] * cos - v[half:dims] * sin,
            v[half:dims] * cos + v[:half] * sin,
            v[dims:],
        ]
    )
    assert mx.allclose(rotated, expected, atol=1e-5).item()


def test_the_folded_router_weights_give_the_router_s_logits(
    moe: tuple[Any, MtpHead],
) -> None:
    """FOLD_ROUTER's weights: the router's rows and the shared expert's gate
    times the MoE norm's weights, transposed; a vector's logits are its
    product with them times the norm's scale (what the kernel sums per block
    in o_proj's phase), the router's and the shared gate's on the normed vector."""
    target, head = moe
    weights = fused_weights(target, head, 0)
    assert weights is not None and weights.router_t is not None
    layer = head.layers[0]
    hidden = weights.shape.hidden
    assert weights.router_t.shape == (hidden, weights.shape.experts + 1)
    mx.random.seed(3)
    out = mx.random.normal((2, hidden))
    norm = layer.post_attention_layernorm
    scale = mx.rsqrt(mx.mean(out * out, axis=-1, keepdims=True) + norm.eps)
    folded = (out @ weights.router_t) * scale
    normed = norm(out.astype(mx.bfloat16)).astype(mx.float32)
    router = normed @ layer.mlp.gate.weight.astype(mx.float32).T
    gate = normed @ layer.mlp.shared_expert_gate.weight.astype(mx.float32).T
    expected = mx.concatenate([router, gate], axis=-1)
    assert mx.allclose(folded, expected, atol=0.05, rtol=0.02).item()
    dense = fused_weights(*built(DENSE), 0)
    assert dense is not None and dense.router_t is None


def test_the_step_count_is_made_once_per_count() -> None:
    """A launch's `nsteps` input is one device array per count, not a device
    operation (and its evaluation) per launch."""
    three = mtp_cuda.count_array(3)
    assert mtp_cuda.count_array(3) is three and three.shape == (1,)
    assert three.item() == 3 and mtp_cuda.count_array(4).item() == 4


def test_traditional_rope_is_out_of_scope() -> None:
    assert _inv_freq(RoPE(32, RopeConfig(traditional=True))) is None


def test_step_sizes_and_draws_in_scope(moe: tuple[Any, MtpHead]) -> None:
    target, head = moe
    weights = fused_weights(target, head, 0)
    assert weights is not None
    step = FusedStep.make(weights, target.head_weights().weight, None, blocks=128)
    assert step is not None
    assert step.fits(1, 1, True, 0)
    assert step.fits(8, 1, False, 20)
    assert step.fits(4, 2, True, 0)
    assert not step.fits(9, 1, True, 0)  # more rows than warps of a block
    assert not step.fits(4, 4, True, 0)  # 16 window positions
    assert not step.fits(1, 1, False, 33)  # candidates one per lane
    assert step.supports(0.0, 0)  # greedy
    assert step.supports(0.7, 20)
    assert not step.supports(0.7, 0)  # top-p over the whole vocabulary
    assert not step.supports(0.7, 40)


def test_a_cpu_head_step_has_no_fused_step(
    moe: tuple[Any, MtpHead], cpu_default: None
) -> None:
    target, head = moe
    assert HeadStep(target, head, None).fused_step(0) is None


def test_without_a_cuda_driver_no_step_is_made(
    moe: tuple[Any, MtpHead], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The block count comes from the device (all blocks must be resident at
    once); no driver, no kernel."""
    target, head = moe
    weights = fused_weights(target, head, 0)
    assert weights is not None
    monkeypatch.setattr(mtp_cuda, "multiprocessors", lambda: None)
    assert FusedStep.make(weights, target.head_weights().weight, None) is None
    monkeypatch.setattr(mtp_cuda, "multiprocessors", lambda: 46)  # a smaller GPU
    step = FusedStep.make(weights, target.head_weights().weight, None)
    assert step is not None and step.blocks == 46


class FakeFused:
    """Stands in for a FusedStep: fits one-row, one-position steps only."""

    def __init__(self, failures: int = 0) -> None:
        self.calls: list[str] = []
        self.failed = failures
        self.checked: list[bool] = []

    def fits(self, rows: int, length: int, greedy: bool, top_k: int) -> bool:
        return rows == 1 and length == 1

    def failures(self) -> int:
        return self.failed

    def launch(self, first: bool, count: int, *args: Any) -> Any:
        def kernel(*arrays: mx.array) -> Any:
            self.calls.append("kernel" if count == 1 else f"launch of {count}")
            return arrays[:4]

        return kernel


def test_steps_the_kernel_cannot_take_run_the_compiled_step() -> None:
    fake = FakeFused()

    def compiled(*arrays: mx.array) -> Any:
        fake.calls.append("compiled")
        return arrays[:4]

    run = _through_kernel(fake, False, SamplingParams(), compiled)  # type: ignore[arg-type]
    one = (mx.zeros((1, 1), dtype=mx.int32), *[mx.zeros((1,))] * 7)
    two = (mx.zeros((2, 1), dtype=mx.int32), *[mx.zeros((2,))] * 7)
    run(*one)
    run(*two)
    run(*one)
    assert fake.calls == ["kernel", "compiled", "kernel"]


def test_chained_steps_go_to_the_kernel_s_chain_in_one_launch() -> None:
    fake = FakeFused()

    def compiled(*arrays: mx.array) -> Any:
        fake.calls.append("compiled")
        return arrays[:4]

    run = _through_kernel(fake, False, SamplingParams(), compiled, 3)  # type: ignore[arg-type]
    run(mx.zeros((1, 1), dtype=mx.int32), *[mx.zeros((1,))] * 7)
    run(mx.zeros((2, 1), dtype=mx.int32), *[mx.zeros((2,))] * 7)
    assert fake.calls == ["launch of 3", "compiled"]


@pytest.mark.parametrize(
    "filters", [SamplingParams(), SamplingParams(temperature=0.8, top_k=20, seed=5)]
)
def test_a_chain_of_steps_is_the_chained_steps_one_by_one(
    filters: SamplingParams,
) -> None:
    """A one-layer head's chained steps as one call in the step signature
    (`HeadStep._chain`, what `round` runs after its first step: one launch on
    a GPU) draft, output and cache what as many `chained` calls do (float32:
    compiled steps on the CPU, where bf16 products run in an eager kernel)."""
    target, head = built(MOE, mx.float32)
    step = HeadStep(target, head, None)
    rows, count = 2, 3
    mx.random.seed(3)
    token = mx.random.randint(0, VOCAB, (rows,)).astype(mx.int32)
    normed = mx.random.normal((rows, 1, 256))
    starts = mx.array([5, 9], dtype=mx.int32)
    seeds = mx.array([1, 2], dtype=mx.uint32)
    steps = mx.array([10, 20], dtype=mx.uint32)
    caches = []
    for _ in range(2):
        cache = head.make_cache(rows)
        cache.reserve(16)
        cache.keys[0] = mx.random.normal(cache.keys[0].shape) * 0.5
        cache.values[0] = mx.random.normal(cache.values[0].shape) * 0.5
        caches.append(cache)
    caches[1].keys[0], caches[1].values[0] = caches[0].keys[0], caches[0].values[0]
    tokens, last, caches[0].keys[0], caches[0].values[0] = step._chain(count, filters)(
        token[:, None], normed, starts, starts, caches[0].keys[0], caches[0].values[0],
        seeds, steps,
    )  # fmt: skip
    one_by_one = []
    t, n = token, normed
    for i in range(count):
        t, n = step.chained(
            caches[1], 1 + i, filters, t, n, starts + i, seeds, steps + i
        )
        one_by_one.append(t)
    assert tokens.shape == (rows, count)
    assert tokens.tolist() == mx.stack(one_by_one, axis=1).tolist()
    assert mx.array_equal(last, n).item()
    assert mx.array_equal(caches[0].keys[0], caches[1].keys[0]).item()
    assert mx.array_equal(caches[0].values[0], caches[1].values[0]).item()


def test_a_round_is_its_first_step_then_its_chained_steps() -> None:
    """HeadStep.round (a round's whole draft chain, one launch on a GPU)
    drafts and caches what the first step over the tail's window and the
    chained steps from each row's length on do (rows with different tails)."""
    target, head = built(MOE, mx.float32)
    step = HeadStep(target, head, None)
    filters = SamplingParams(temperature=0.8, top_k=20, seed=5)
    rows, width, depth = 2, 4, 3
    mx.random.seed(4)
    ids = mx.random.randint(0, VOCAB, (rows, width)).astype(mx.int32)
    hidden = mx.random.normal((rows, width, 256))
    last = mx.array([3, 1], dtype=mx.int32)  # tails of 4 and 2 pairs
    starts = mx.array([6, 11], dtype=mx.int32)
    seeds = mx.array([1, 2], dtype=mx.uint32)
    steps = mx.array([10, 20], dtype=mx.uint32)
    cache = head.make_cache(rows)
    cache.reserve(24)
    keys = mx.random.normal(cache.keys[0].shape) * 0.5
    values = mx.random.normal(cache.values[0].shape) * 0.5
    whole = step.round(filters, depth)
    assert whole is not None
    single = step.round(filters, 1)  # a one-step round: the first step alone
    assert single is not None
    alone = step(True, 0, filters)(
        ids, hidden, last, starts, keys, values, seeds, steps
    )
    assert single(ids, hidden, last, starts, keys, values, seeds, steps)[
        0
    ].tolist() == [[t] for t in alone[0].tolist()]
    tokens, normed, k1, v1 = whole(
        ids, hidden, last, starts, keys, values, seeds, steps
    )
    token, n, k2, v2 = step(True, 0, filters)(
        ids, hidden, last, starts, keys, values, seeds, steps
    )
    drafted = [token]
    for i in range(1, depth):
        at = starts + last + i
        token, n, k2, v2 = step(False, i, filters)(
            token[:, None], n, at, at, k2, v2, seeds, steps + i
        )
        drafted.append(token)
    assert tokens.tolist() == mx.stack(drafted, axis=1).tolist()
    assert mx.array_equal(normed, n).item()
    assert mx.array_equal(k1, k2).item() and mx.array_equal(v1, v2).item()


def test_a_kernel_whose_barriers_gave_up_is_not_used_again() -> None:
    fake = FakeFused(failures=1)

    def compiled(*arrays: mx.array) -> Any:
        fake.calls.append("compiled")
        return arrays[:4]

    run = _through_kernel(fake, False, SamplingParams(), compiled)  # type: ignore[arg-type]
    one = (mx.zeros((1, 1), dtype=mx.int32), *[mx.zeros((1,))] * 7)
    with pytest.warns(RuntimeWarning, match="grid barriers timed out"):
        run(*one)
    run(*one)
    assert fake.calls == ["kernel", "compiled", "compiled"]


def captured_kernel(monkeypatch: pytest.MonkeyPatch, module: Any) -> dict[str, Any]:
    """Replace `module._kernel` by one that records what it is called with."""
    seen: dict[str, Any] = {}

    def fake(*_args: Any) -> Any:
        def call(**kwargs: Any) -> list[mx.array]:
            seen.update(kwargs)
            return [
                mx.zeros(shape, dtype=dtype)
                for shape, dtype in zip(
                    kwargs["output_shapes"], kwargs["output_dtypes"], strict=True
                )
            ]

        return call

    monkeypatch.setattr(module, "_kernel", fake)
    return seen


def step_kernel_source(
    monkeypatch: pytest.MonkeyPatch,
    target: Any,
    head: MtpHead,
    shape: tuple[
        bool, bool, bool, int, int, int
    ],  # greedy, first, listed, rows, length, count
    constants: dict[str, str],
    profile: bool = False,
) -> tuple[list[mx.array], str]:
    """The step's outputs (the kernel replaced by zeros of its output shapes)
    and the CUDA translation unit MLX is given for it: the full head's or a
    FR-Spec list's (every third id) step, `rows` x `length` positions,
    `count` steps in one launch, template constants overridden by `constants`
    (NAME -> value), with a static assertion that the scratch the caller
    sizes is the kernel's (unless a size is overridden). Also
    bench/cubin_digest.py's."""
    greedy, first, listed, rows, length, count = shape
    weights = fused_weights(target, head, 0)
    assert weights is not None
    if listed:
        ids = list(range(0, VOCAB, 3))
        subset = SubsetHead.of(target, DraftVocabulary.create(ids, VOCAB).unwrap())
        step = FusedStep.make(weights, subset.weights.weight, subset.ids, blocks=96)
    else:
        step = FusedStep.make(weights, target.head_weights().weight, None, blocks=128)
    assert step is not None
    seen = captured_kernel(monkeypatch, mtp_cuda)
    cache = head.make_cache(rows)
    cache.reserve(64)
    outputs = step(
        first,
        greedy,
        0 if greedy else 20,
        mtp_cuda.draw_params(1e-6, 0.7, 0.8, 0.05),
        mx.zeros((rows, length), dtype=mx.int32),
        mx.zeros((rows, length, weights.shape.hidden), dtype=mx.bfloat16),
        mx.zeros((rows,), dtype=mx.int32),
        mx.zeros((rows,), dtype=mx.int32),
        cache.keys[0],
        cache.values[0],
        mx.zeros((rows,), dtype=mx.uint32),
        mx.zeros((rows,), dtype=mx.uint32),
        count=count,
        kv_out=first and count > 1,  # as HeadStep.round launches a whole round
        profile=profile,
    )
    return list(outputs), step_text(seen, constants)


def step_text(seen: dict[str, Any], constants: dict[str, str]) -> str:
    """The step kernel's translation unit as MLX is given it for the call
    `seen` recorded (`captured_kernel`), template constants overridden by
    `constants`, with a static assertion at its end that the scratch the
    caller sizes (`LayerShape.scratch`, a mirror of the kernel's offsets) is
    the kernel's: checked where it compiles, no code (left out where a size
    is overridden: E=512)."""
    text = source(
        "mtp_step",
        mtp_cuda.header_text(mtp_cuda.BF16_SHIFTS),
        mtp_cuda._COMPACT_SOURCE,
        list(zip(mtp_cuda._INPUTS, seen["inputs"], strict=True)),
        list(zip(mtp_cuda._OUTPUTS, seen["output_dtypes"], strict=True)),
        [(k, int(constants[k]) if k in constants else v) for k, v in seen["template"]],
    )
    if not set(constants) <= {"ATT_UNROLL", "HK"}:
        return text
    floats = math.prod(seen["output_shapes"][mtp_cuda._OUTPUTS.index("scratch")])
    tail = "\n}\n\n} // namespace mlx::core::cu\n"
    assert text.endswith(tail)
    check = (
        f"\n  static_assert(O_TS + (size_t)NBLK * PHASE_STAMPS == {floats}ull,"
        ' "the scratch LayerShape.scratch sizes is not the kernel\'s");'
    )
    return text[: -len(tail)] + check + tail


@pytest.mark.skipif(
    sys.platform != "linux", reason="NVIDIA's NVRTC wheels are Linux-only"
)
@pytest.mark.parametrize(
    ("kind", "greedy", "first", "listed", "rows", "length", "count", "switches"),
    [
        ("moe", False, True, True, 2, 2, 1, ()),
        ("moe", True, False, False, 1, 1, 1, ()),
        ("moe", False, False, True, 2, 1, 3, ()),  # three chained steps, one launch
        ("dense", False, False, False, 8, 1, 1, ()),
        ("dense", True, True, True, 1, 4, 1, ()),
        ("dense", True, False, False, 1, 1, 4, ()),
        (
            "moe",
            False,
            True,
            True,
            2,
            2,
            3,
            (),
        ),  # a whole round: first step, two chained
        ("dense", True, True, False, 1, 4, 3, ()),
        # the tuning switches' other arms (bench/fused_probe.py's flags)
        (
            "moe",
            True,
            True,
            True,
            1,
            2,
            3,
            ("PREFETCH_L2", "PAIR_ROWS", "ATT_SHARE=0", "FAST_SINCOS"),
        ),
        (
            "dense",
            False,
            False,
            True,
            2,
            1,
            2,
            ("PREFETCH_L2", "-EVICT_ALL", "ATT_SHARE=0", "-WIDE_LOADS"),
        ),
        # "NAME=N": the template constant as compiled (the router's top-k
        # past 128 experts takes its KE rounds of a warp argmax; one, two
        # and three rows)
        ("moe", True, False, False, 1, 1, 1, ("E=512",)),
        ("moe", False, False, True, 2, 1, 2, ("E=512",)),
        ("moe", False, False, False, 3, 1, 2, ("E=512",)),
        # the router's top-k by shuffles (REDUX_TOPK's off arm: ranks up to 128
        # experts, argmax rounds past), the sampled inverse CDF by shuffles
        # (SHARED_CDF's off arm): 512 experts and 64
        ("moe", True, False, False, 1, 1, 1, ("E=512", "-REDUX_TOPK")),
        ("moe", False, False, False, 3, 1, 2, ("E=512", "-REDUX_TOPK", "-SHARED_CDF")),
        ("moe", True, True, True, 1, 2, 3, ("-REDUX_TOPK",)),
        ("moe", False, True, True, 2, 2, 3, ("-REDUX_TOPK", "-SHARED_CDF")),
        # the router in a phase of its own (FOLD_ROUTER's off arm; greedy and sampled)
        ("moe", True, True, True, 1, 2, 3, ("-FOLD_ROUTER",)),
        ("moe", False, False, False, 3, 1, 2, ("-FOLD_ROUTER",)),
        # the draw's whole-list merge without the blocks' heads first, and
        # unrolled sorts (one row and three)
        ("moe", False, True, True, 1, 2, 3, ("-DRAW_HEADS", "-TIGHT_DRAW")),
        ("moe", False, False, False, 3, 1, 2, ("-DRAW_HEADS",)),
        ("moe", False, True, True, 1, 2, 3, ("HK=2",)),
        # the heads' runs sorted one after another, the whole network each
        # (DRAW_RUNS' off arm; one row and three)
        ("moe", False, True, True, 1, 2, 3, ("-DRAW_RUNS",)),
        ("moe", False, False, False, 3, 1, 2, ("-DRAW_RUNS", "HK=2")),
        # the warps' runs merged in turn by warp 0 (TREE_MERGE's off arm; one row and three)
        ("moe", False, True, True, 1, 2, 3, ("-TREE_MERGE",)),
        ("moe", False, False, False, 3, 1, 2, ("-TREE_MERGE", "-DRAW_HEADS")),
        # weight rows without the L2 evict-first policy (EVICT_ALL's off arm)
        ("moe", True, True, True, 1, 2, 3, ("-EVICT_ALL",)),
        ("dense", False, False, False, 2, 1, 2, ("-EVICT_ALL",)),
        # q/k/v's rows kept in L2 for the launch's next step too, and none of
        # the layer's (KEEP_FC / KEEP_O's off arm; greedy and sampled)
        ("moe", True, True, True, 1, 2, 3, ("KEEP_QKV",)),
        ("moe", False, False, False, 3, 1, 2, ("-KEEP_FC", "-KEEP_O")),
        # the grid barrier by sequentially consistent fences (ACQ_REL_BARRIER's
        # off arm; greedy and sampled)
        ("moe", True, True, True, 1, 2, 3, ("-ACQ_REL_BARRIER",)),
        ("moe", False, False, False, 3, 1, 2, ("-ACQ_REL_BARRIER",)),
        # attention's cache positions one per warp at a time (ATT_UNROLL's
        # other arm), and eight at once (greedy and sampled, dense and MoE)
        ("moe", True, True, True, 1, 2, 3, ("ATT_UNROLL=1",)),
        ("moe", False, False, False, 3, 1, 2, ("ATT_UNROLL=8",)),
        ("dense", False, True, False, 2, 1, 2, ("ATT_UNROLL=1",)),
        # a warp's cached positions at once NWARP apart (ATT_SPREAD, off)
        ("moe", True, True, True, 1, 2, 3, ("ATT_SPREAD", "ATT_UNROLL=8")),
        ("moe", False, False, False, 3, 1, 2, ("ATT_SPREAD",)),
        ("moe", True, False, False, 1, 1, 2, ("-ATT_PIPE",)),
        ("dense", False, True, False, 2, 1, 2, ("-ATT_PIPE", "ATT_UNROLL=8")),
        # attention per kv head, its keys and values staged in shared memory
        # (ATT_GROUPED, off): a round, a chain, a first step; dense and MoE
        ("moe", True, True, True, 1, 2, 3, ("ATT_GROUPED",)),
        ("moe", False, False, False, 3, 1, 2, ("ATT_GROUPED",)),
        ("dense", False, True, False, 2, 1, 2, ("ATT_GROUPED", "ATT_UNROLL=8")),
        ("dense", True, True, True, 1, 4, 1, ("ATT_GROUPED", "ATT_UNROLL=1")),
        # bfloat16 converted by the compiler (BF16_SHIFTS, on, off)
        ("moe", False, True, True, 1, 2, 3, ("-BF16_SHIFTS",)),
        ("dense", True, False, False, 1, 1, 4, ("-BF16_SHIFTS", "ATT_GROUPED")),
        # the timing diagnostics
        ("moe", False, True, False, 1, 2, 3, ("DIAG_NO_DRAW", "DIAG_NO_SORT")),
    ],
)
def test_the_step_kernel_compiles_without_spills(
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    kind: str,
    greedy: bool,
    first: bool,
    listed: bool,
    rows: int,
    length: int,
    count: int,
    switches: tuple[str, ...],
) -> None:
    constants = dict(c.split("=") for c in switches if "=" in c)
    for switch in (c for c in switches if "=" not in c):  # "-NAME" off, "NAME" on
        monkeypatch.setattr(mtp_cuda, switch.lstrip("-"), not switch.startswith("-"))
    target, head = request.getfixturevalue(kind)
    whole_round = first and count > 1  # as HeadStep.round launches it
    shape = (greedy, first, listed, rows, length, count)
    # (rows == 2: the phase stamps compile too)
    outputs, text = step_kernel_source(
        monkeypatch, target, head, shape, constants, rows == 2
    )
    tokens, normed, knew, vnew = outputs
    hidden = head.args.hidden_size
    assert tokens.shape == (rows, count) and normed.shape == (rows, 1, hidden)
    if whole_round:  # the new whole KV buffers (of a cache as the helper's)
        cache = head.make_cache(rows)
        cache.reserve(64)
        assert knew.shape == vnew.shape == cache.keys[0].shape
    else:  # the window, to scatter
        assert knew.shape == vnew.shape == (rows, 2, length + count - 1, 64)
    compiled = compile_source(text, tmp_path)
    assert compiled.ok, compiled.log[:4000]
    assert compiled.spill_bytes == 0, compiled.log
    # one block of 256 threads per multiprocessor must fit its register file
    assert compiled.registers is not None and compiled.registers * 256 <= 65536


def test_an_attention_unroll_below_one_is_refused(
    moe: tuple[Any, MtpHead], monkeypatch: pytest.MonkeyPatch
) -> None:
    """ATT_UNROLL 0 would never leave attention's loop: refused before a launch."""
    monkeypatch.setattr(mtp_cuda, "ATT_UNROLL", 0)
    with pytest.raises(ValueError, match="ATT_UNROLL must be at least 1, got 0"):
        step_kernel_source(monkeypatch, *moe, (True, False, False, 1, 1, 1), {})


def derived_round_call(
    target: Any,
    head: MtpHead,
    monkeypatch: pytest.MonkeyPatch,
    rows: int,
    width: int,
    greedy: bool,
) -> tuple[dict[str, Any], tuple[mx.array, ...]]:
    """What a whole derived round of `rows` x `width` positions (three
    steps, the full head) gives the kernel (`captured_kernel`), and its
    outputs, with its device inputs (samples, drafts, prev) last."""
    weights = fused_weights(target, head, 0)
    assert weights is not None
    step = FusedStep.make(weights, target.head_weights().weight, None, blocks=128)
    assert step is not None
    seen = captured_kernel(monkeypatch, mtp_cuda)
    cache = head.make_cache(rows)
    cache.reserve(64)
    samples = mx.zeros((rows, 4), dtype=mx.int32)
    drafts = mx.zeros((rows, 3), dtype=mx.int32)
    prev = mx.zeros((rows, 4), dtype=mx.uint32)
    tokens, knew, _, state = step.derived_round(
        greedy,
        0 if greedy else 20,
        mtp_cuda.draw_params(1e-6, 0.7, 0.8, 0.05),
        samples,
        drafts,
        prev,
        mx.zeros((rows, width, weights.shape.hidden), dtype=mx.bfloat16),
        cache.keys[0],
        cache.values[0],
        3,
    )
    return seen, (tokens, knew, state, cache.keys[0], samples, drafts, prev)


@pytest.mark.skipif(
    sys.platform != "linux", reason="NVIDIA's NVRTC wheels are Linux-only"
)
@pytest.mark.parametrize(("rows", "width", "greedy"), [(1, 1, True), (3, 2, False)])
def test_the_derived_round_compiles_and_reads_no_host_input(
    moe: tuple[Any, MtpHead],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    rows: int,
    width: int,
    greedy: bool,
) -> None:
    """The whole round that derives its per-row inputs on the device: the
    last round's draws, drafts and launch state go in, the kernel's state
    comes out, and the compiled form neither spills nor reads the host-built
    inputs (the placeholders it is given are the device arrays)."""
    seen, outputs = derived_round_call(*moe, monkeypatch, rows, width, greedy)
    tokens, knew, state, keys, samples, drafts, prev = outputs
    assert tokens.shape == (rows, 3) and state.shape == (rows, 4)
    assert knew.shape == keys.shape and state.dtype == mx.uint32
    template = dict(seen["template"])
    assert template["DERIVE"] and template["KV_OUT"] and template["FIRST"]
    assert template["M"] == rows * width and template["TT"] == width
    named = dict(zip(mtp_cuda._INPUTS, seen["inputs"], strict=True))
    assert (
        named["samples"] is samples
        and named["drafts"] is drafts
        and named["prev"] is prev
    )
    for host_built in (
        "last",
        "starts",
        "seeds",
        "steps",
    ):  # placeholders: device arrays
        assert named[host_built] is prev
    compiled = compile_source(step_text(seen, {}), tmp_path)
    assert compiled.ok, compiled.log[:4000]
    assert compiled.spill_bytes == 0, compiled.log


# Qwen3-Next's MTP layer as bench/draft_device.py times it (64 experts there):
# the template constants that set the kernel's register use (head_dim 256
# puts eight dims per lane in attention's loops; the tiny fixtures have two)
QWEN3_NEXT_CONSTANTS = {
    "H": 2048, "HQ": 16, "HKV": 2, "D": 256, "ROT": 64,
    "E": 64, "KE": 10, "IE": 512, "IS": 512, "V": 151936,
}  # fmt: skip


def qwen3_next_constants(
    moe: tuple[Any, MtpHead], rows: int, width: int, experts: int
) -> dict[str, str]:
    """The template constants that compile a derived round of `rows` x
    `width` positions at Qwen3-Next's sizes with `experts` experts (also
    bench/code_size.py's)."""
    constants = {k: str(v) for k, v in QWEN3_NEXT_CONSTANTS.items()}
    constants["M"] = str(rows * width)
    constants["E"] = str(experts)
    weights = fused_weights(*moe, 0)
    assert weights is not None
    # as FusedStep.folds: past 127 experts, the router has its own phase
    if not evolve(weights.shape, experts=experts).foldable:
        constants["FOLD"] = "0"
    return constants


@pytest.mark.skipif(
    sys.platform != "linux", reason="NVIDIA's NVRTC wheels are Linux-only"
)
@pytest.mark.parametrize(
    ("rows", "width", "greedy", "experts", "switches"),
    [
        (1, 3, True, 64, ()),
        (1, 3, False, 64, ()),
        (3, 2, True, 64, ()),
        (3, 2, False, 64, ()),
        (1, 3, False, 512, ()),  # the released model's 512: the router in its own phase
        (1, 3, True, 512, ("-REDUX_TOPK",)),
        (1, 3, False, 512, ("-DRAW_RUNS",)),
        (1, 3, False, 512, ("-REDUX_TOPK", "-SHARED_CDF")),
        (3, 2, False, 64, ("-REDUX_TOPK", "-SHARED_CDF")),
        # attention per kv head (ATT_GROUPED, off), bfloat16 by the compiler's
        # conversion (BF16_SHIFTS, on, off)
        (1, 3, True, 64, ("ATT_GROUPED",)),
        (1, 3, False, 64, ("ATT_GROUPED",)),
        (3, 2, False, 64, ("ATT_GROUPED",)),
        (1, 3, False, 64, ("-BF16_SHIFTS",)),
        (3, 2, True, 64, ("-BF16_SHIFTS", "ATT_GROUPED")),
        # attention's positions one iteration's loads at a time (ATT_PIPE's
        # off arm), and with eight positions at once (ATT_PIPE then off: with
        # it the sampled round spills, 255 registers, 88 bytes)
        (1, 3, True, 64, ("-ATT_PIPE",)),
        # (three sampled rows without ATT_PIPE spill 8 bytes with SHARED_CDF:
        # that arm keeps the draw's shuffles)
        (3, 2, False, 64, ("-ATT_PIPE", "-SHARED_CDF")),
        (1, 3, False, 64, ("ATT_UNROLL=8",)),
        # the round's KV copy one vector per thread at a time (the default: four)
        (1, 3, True, 64, ("COPY_UNROLL=1",)),
        (3, 2, False, 64, ("COPY_UNROLL=1",)),
        # attention's splits always the most, a short context's too (ATT_SHARE's
        # off arm; on: a short context's (row, head) in one split)
        (1, 3, True, 64, ("ATT_SHARE=0",)),
        (1, 3, False, 64, ("ATT_SHARE=0",)),
        (3, 2, False, 64, ("ATT_SHARE=0",)),
    ],
)
def test_the_round_at_qwen3_next_shape_compiles_without_spills(
    moe: tuple[Any, MtpHead],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    rows: int,
    width: int,
    greedy: bool,
    experts: int,
    switches: tuple[str, ...],
) -> None:
    """The derived whole round compiled at Qwen3-Next's sizes, for the
    H200's architecture as MLX compiles it (sm_90a), spills nothing and fits
    a 256-thread block's register file: the kernel's register use is set by
    the real sizes (252-254 registers with ATT_UNROLL=8, 2026-12-04), not by
    the fixtures'."""
    for switch in switches:  # "-NAME" off, "NAME" on, "NAME=N" an integer setting
        name, _, value = switch.partition("=")
        monkeypatch.setattr(
            mtp_cuda,
            name.lstrip("-"),
            int(value) if value else not switch.startswith("-"),
        )
    seen, _ = derived_round_call(*moe, monkeypatch, rows, width, greedy)
    constants = qwen3_next_constants(moe, rows, width, experts)
    compiled = compile_source(step_text(seen, constants), tmp_path, "sm_90a")
    assert compiled.ok, compiled.log[:4000]
    # The defaults spill nothing. The arms off by default, kept for timing
    # against the defaults, sit at 255 registers, where ptxas has spilled a
    # few bytes: NVRTC 13.0's ATT_PIPE off arm of the one-row greedy round
    # (4 bytes, H100, 2026-12-06; 13.5's none), and once in a full-suite run
    # 13.5's ATT_GROUPED arm of that round (4 bytes, 2026-12-06, after the
    # top-k became REDUX_TOPK's; no spill in ten runs of the arm alone). Up
    # to 8 bytes are allowed there.
    allowed = 8 if switches else 0
    assert compiled.spill_bytes is not None
    assert compiled.spill_bytes <= allowed, compiled.log
    assert compiled.registers is not None and compiled.registers * 256 <= 65536


@pytest.mark.skipif(
    sys.platform != "linux", reason="NVIDIA's NVRTC wheels are Linux-only"
)
@pytest.mark.parametrize(("greedy", "ceiling_kb"), [(True, 126.0), (False, 155.0)])
def test_the_step_loop_stays_short(greedy: bool, ceiling_kb: float) -> None:
    """The step loop a chained step runs (bench/code_size.py: the derived
    round at Qwen3-Next's sizes, 512 experts, one row of a 3-wide window)
    stays within a few KB of its size when its code was last trimmed
    (2026-12-07: 122.9 KB greedy, 151.6 KB sampled, from 141.3 / 169.8
    before), with no spill: a step is bound by fetching its code, so these
    bytes cost time (the trims took 1-12 us off a launch on an H100, more
    where they cut instructions every step runs than where they cut bytes
    alone). A change that lengthens it past the ceiling should be timed,
    and the ceiling moved only with the figures that justify it
    (bench/RESULTS.md)."""
    from bench.code_size import measure

    sized = measure(not greedy, 512, 1, 3, False)
    assert sized["spill_bytes"] == 0, sized
    assert sized["step_loop_bytes"] <= ceiling_kb * 1024, sized


@pytest.mark.skipif(
    sys.platform != "linux", reason="NVIDIA's NVRTC wheels are Linux-only"
)
@pytest.mark.parametrize("runtime_dims", [False, True])
@pytest.mark.parametrize("per_position", [False, True])
def test_the_window_kernel_compiles(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    runtime_dims: bool,
    per_position: bool,
) -> None:
    seen = captured_kernel(monkeypatch, gated_delta_cuda)
    b, length, hk, hv, dk, dv = 2, 3, 2, 4, 32, 32
    out, states = gated_delta_cuda.window_recurrence(
        mx.zeros((b, length, hk, dk)),
        mx.zeros((b, length, hk, dk)),
        mx.zeros((b, length, hv, dv)),
        mx.zeros((b, length, hv)),
        mx.zeros((b, length, hv)),
        mx.zeros((b, hv, dk, dv)),
        per_position,
        runtime_dims,
    )
    assert out.shape == (b, length, hv, dv)
    assert states.shape == ((length if per_position else 1), b, hv, dk, dv)
    body = (
        gated_delta_cuda._DIMS_FROM_SHAPE + gated_delta_cuda._SOURCE
        if runtime_dims
        else gated_delta_cuda._SOURCE
    )
    names = ["q", "k", "v", "decay", "beta", "state"]
    text = source(
        "gated_delta",
        "",
        body,
        list(zip(names, seen["inputs"], strict=True)),
        list(zip(["out", "states"], seen["output_dtypes"], strict=True)),
        seen["template"],
    )
    compiled = compile_source(text, tmp_path)
    assert compiled.ok, compiled.log[:4000]
    assert compiled.spill_bytes == 0, compiled.log


def chained_launch(
    moe: tuple[Any, MtpHead],
    monkeypatch: pytest.MonkeyPatch,
    counts: Sequence[int],
    capacity: int,
) -> list[tuple[dict[str, Any], tuple[mx.array, ...]]]:
    """What the kernel is given (`captured_kernel`) and returns for a
    one-row chain of each of `counts` greedy steps, full head, from a cache
    of `capacity` positions."""
    target, head = moe
    weights = fused_weights(target, head, 0)
    assert weights is not None
    step = FusedStep.make(weights, target.head_weights().weight, None, blocks=64)
    assert step is not None
    cache = head.make_cache(1)
    cache.reserve(capacity)
    launched = []
    for count in counts:
        seen = captured_kernel(monkeypatch, mtp_cuda)
        outputs = step(
            False,
            True,
            0,
            mtp_cuda.draw_params(1e-6, 0.0, 1.0, 0.0),
            mx.zeros((1, 1), dtype=mx.int32),
            mx.zeros((1, 1, 256), dtype=mx.bfloat16),
            mx.zeros((1,), dtype=mx.int32),
            mx.zeros((1,), dtype=mx.int32),
            cache.keys[0],
            cache.values[0],
            mx.zeros((1,), dtype=mx.uint32),
            mx.zeros((1,), dtype=mx.uint32),
            count=count,
        )
        launched.append((dict(seen), tuple(outputs)))
    return launched


def test_chains_of_any_length_share_one_compiled_kernel(
    moe: tuple[Any, MtpHead], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The step count is an input, not a template constant: adaptive depths
    compile no new kernel (each form takes seconds to compile on a GPU)."""
    templates, counts = [], []
    for count, (seen, outputs) in zip(
        (2, 5), chained_launch(moe, monkeypatch, (2, 5), 32), strict=True
    ):
        tokens, _, knew = outputs[:3]
        assert tokens.shape == (1, count) and knew.shape[2] == count
        templates.append(seen["template"])
        counts.append(seen["inputs"][mtp_cuda._INPUTS.index("nsteps")].tolist())
    assert templates[0] == templates[1]
    assert counts == [[2], [5]]


def test_grouped_attention_keeps_to_launches_whose_window_fits_a_tile(
    moe: tuple[Any, MtpHead], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ATT_GROUPED on, a launch whose window slots (its positions plus
    its chained steps) pass ATT_TILE compiles the per-query-head form: the
    grouped form stages the window in one tile."""
    monkeypatch.setattr(mtp_cuda, "ATT_GROUPED", True)
    counts = (mtp_cuda.ATT_TILE, mtp_cuda.ATT_TILE + 1)  # slots = count
    launched = chained_launch(moe, monkeypatch, counts, 64)
    grouped = [dict(seen["template"])["ATT_GROUPED"] for seen, _ in launched]
    assert grouped == [True, False]


def test_compact_source_drops_comments_and_indentation_only() -> None:
    text = (
        "  // a comment line\n"
        "\n"
        "    int x = 1;  // trailing\n"
        '  asm volatile("mov.u64 %0, %%globaltimer; // kept" : "=l"(t));\n'
        "#pragma unroll\n"
    )
    assert mtp_cuda.compact(text) == (
        'int x = 1;\nasm volatile("mov.u64 %0, %%globaltimer; // kept" : "=l"(t));\n#pragma unroll'
    )
    # the kernel's own text: every statement kept, a third shorter
    kept = mtp_cuda._COMPACT_SOURCE
    assert kept.count(";") == sum(
        line.split("//")[0].count(";") for line in mtp_cuda._SOURCE.split("\n")
    )
    assert len(kept) < 0.8 * len(mtp_cuda._SOURCE)
