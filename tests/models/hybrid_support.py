"""Shared pieces of the hybrid models' tests (tests/models/test_qwen3_next.py,
test_qwen3_5.py, test_qwen3_5_moe.py; the HF weights, parameter re-drawing,
loading, forward, logits and array helpers and the cached-decode check also
the GLM and Gemma-4 parity tests'): the tiny layouts, HF parameter
re-drawing, forward-and-commit helpers, the parity and rollback checks every
hybrid model must pass against transformers (tests/models/rollback_support.py
runs the rollback ones as tests), a multimodal folder's language model, and
the MTP head's reference wiring from HF building blocks.

The tiny layout: 4 layers (linear, full, linear, full attention); hidden 64;
4 query / 2 kv heads of 16; 2 key / 4 value linear heads of 8; vocab 128.
The MoE models add 4 experts (top-2) of 32 and a shared expert of 48.
Everything runs in float32 on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import mlx.core as mx
import numpy as np
import torch
from returns.result import Result, Success

from models.build import build_model, load_weights
from models.hybrid_cache import HybridCache
from models.layers import flat_parameters
from models.qwen3_next import Model
from schemas.hf_hybrid import hybrid_args
from specpipe.load import LoadedModel
from tests.rounding import same_math

VOCAB = 128
LAYOUT: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "layer_types": [
        "linear_attention",
        "full_attention",
        "linear_attention",
        "full_attention",
    ],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "max_position_embeddings": 512,
}
EXPERTS: dict[str, Any] = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
}
# Qwen3.5's multimodal RoPE settings (for text: the plain partial RoPE)
QWEN3_5_ROPE: dict[str, Any] = {
    "rope_type": "default",
    "rope_theta": 1e6,
    "partial_rotary_factor": 0.5,
    "mrope_section": [2, 1, 1],
    "mrope_interleaved": True,
}
# a one-block vision tower for the Qwen3.5 multimodal wrappers
VISION: dict[str, Any] = {
    "depth": 1,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "out_hidden_size": 64,
    "patch_size": 4,
    "temporal_patch_size": 1,
    "num_position_embeddings": 16,
}
FOLDER_VOCAB = 320  # the tiny tokenizer's (tests/cli/conftest.py) ids fit
TOL = 1e-4
# window-vs-one-by-one: same math, different matmul shapes, so at most the
# last bits may differ (measured on CPU float32: bit-identical; a GPU's
# allowance: tests/rounding.py)
ROLLBACK_TOL = same_math(2e-5)


def dequantized(weights: dict[str, mx.array], group_size: int) -> dict[str, mx.array]:
    """A float checkpoint holding exactly the values a quantized (MLX affine)
    one encodes, each layer's bits read from its packed width (a MoE's
    routers keep more bits than its experts)."""
    out = dict(weights)
    for name in [k for k in weights if k.endswith(".scales")]:
        prefix = name.removesuffix(".scales")
        packed, scales = out.pop(f"{prefix}.weight"), out.pop(f"{prefix}.scales")
        out[f"{prefix}.weight"] = mx.dequantize(
            packed,
            scales,
            out.pop(f"{prefix}.biases"),
            group_size=group_size,
            bits=packed.shape[-1] * 32 // (scales.shape[-1] * group_size),
        )
    return out


def randomize(module: torch.nn.Module, seed: int) -> None:
    """Re-draw every parameter so the zero-centred norms, A_log and dt_bias
    are non-trivial (HF's init leaves them at 0 / fixed values)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if name.endswith("linear_attn.norm.weight"):
                param.copy_(1.0 + 0.1 * noise)  # an ordinary RMSNorm weight
            elif "norm" in name:
                param.copy_(0.1 * noise)  # zero-centred: an offset from 1
            elif name.endswith(("A_log", "dt_bias")):
                param.copy_(0.5 * noise)
            else:
                param.copy_(0.15 * noise)


def redraw(
    module: torch.nn.Module,
    seed: int,
    is_norm: Callable[[str], bool] = lambda name: "norm" in name,
    buffers: Mapping[str, tuple[float, float]] | None = None,
) -> None:
    """Every parameter re-drawn as a trained checkpoint's might look (one
    generator, N(0, 1) noise in parameter order): biases 0.1 x noise, norm
    weights (`is_norm` of the name) 1 + 0.1 x noise, the rest 0.15 x noise;
    then each buffer whose name ends with a key of `buffers` (offset, scale),
    offset + scale x noise (HF's init leaves them all trivial)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if name.endswith(".bias"):
                param.copy_(0.1 * noise)
            elif is_norm(name):
                param.copy_(1.0 + 0.1 * noise)
            else:
                param.copy_(0.15 * noise)
        for name, buffer in module.named_buffers():
            for suffix, (offset, scale) in (buffers or {}).items():
                if name.endswith(suffix):
                    noise = torch.randn(buffer.shape, generator=gen)
                    buffer.copy_(offset + scale * noise)


def hf_weights(module: torch.nn.Module, prefix: str = "") -> dict[str, mx.array]:
    return {
        prefix + k: mx.array(v.detach().numpy()) for k, v in module.state_dict().items()
    }


M = TypeVar("M")


def ours(
    hf: Any,
    kind: type[M],
    parse: Callable[[dict[str, Any], str], Result[Any, Any]] = hybrid_args,
    weights: dict[str, mx.array] | None = None,
) -> M:
    """The HF model's config parsed (`parse`: its family's) and its state
    dict (or `weights`) loaded into our model (which must be a `kind`), as
    an HF checkpoint would be."""
    args = parse(hf.config.to_dict(), "test config").unwrap()
    model = build_model(args).unwrap()
    assert isinstance(model, kind), type(model)
    loaded = load_weights(model, hf_weights(hf) if weights is None else weights, args)
    assert loaded == Success(None), loaded
    return model


def hf_logits(
    hf: Any, ids: np.ndarray, **options: Any
) -> np.ndarray:  # [B, L] -> [B, L, V]
    with torch.no_grad():
        logits: np.ndarray = hf(input_ids=torch.tensor(ids), **options).logits.numpy()
    return logits


def as_np(x: mx.array) -> np.ndarray:
    return np.array(x.astype(mx.float32))


def token_ids(shape: tuple[int, ...], seed: int = 1, vocab: int = VOCAB) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, size=shape)


def forward(
    model: Any,  # an attention-only model (nothing to commit)
    ids: np.ndarray | Sequence[Sequence[int]],  # [B, L]
    cache: Any,
    offsets: Sequence[int],
) -> np.ndarray:  # [B, L, V]
    """One forward's logits (the GLM and Gemma-4 parity tests')."""
    out = model(mx.array(np.asarray(ids), dtype=mx.int32), cache, offsets)
    return as_np(out.logits)


def check_cached_decode(
    hf: Any,
    model: Any,  # an attention-only model
    ids: np.ndarray,  # [2, L], L > 8
    tol: float,
    row_tol: float,
    logits: Callable[[Any, np.ndarray], np.ndarray] = hf_logits,
) -> None:
    """Two rows' logits in one forward match transformers' (`logits`), and
    decoding them with a cache (five positions, three, then one at a time)
    gives the one forward's (the same math in other matmul shapes)."""
    full = forward(model, ids, model.make_cache(2), [0, 0])
    assert np.abs(full - logits(hf, ids)).max() < tol
    cache = model.make_cache(2)
    got = [forward(model, ids[:, :5], cache, [0, 0])]
    got.append(forward(model, ids[:, 5:8], cache, [5, 5]))
    got += [
        forward(model, ids[:, p : p + 1], cache, [p, p]) for p in range(8, ids.shape[1])
    ]
    assert np.abs(np.concatenate(got, axis=1) - full).max() < row_tol


def step(
    model: Any,  # a hybrid model (`Any`: loaded models are typed as CausalLM)
    cache: HybridCache,
    ids: np.ndarray | Sequence[Sequence[int]],  # [B, L]
    offsets: Sequence[int],
    kept: Sequence[int] | None = None,
) -> np.ndarray:  # [B, L, V]
    """One forward, then commit `kept` (default: every position)."""
    grid = mx.array(np.asarray(ids), dtype=mx.int32)
    out = model(grid, cache, offsets)
    assert out.delta is not None
    out.delta.commit(
        list(kept) if kept is not None else [grid.shape[1]] * grid.shape[0]
    )
    mx.eval(out.logits, *cache.arrays())
    return as_np(out.logits)


def one_by_one(
    model: Model, cache: HybridCache, tokens: Sequence[int], offset: int
) -> np.ndarray:  # [len(tokens), V] for one row
    return np.stack(
        [step(model, cache, [[t]], [offset + i])[0, 0] for i, t in enumerate(tokens)]
    )


def per_expert(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """transformers 5 stacked experts -> the per-expert names of released
    checkpoints (`mlp.experts.{e}.gate_proj.weight`, ...)."""
    out: dict[str, mx.array] = {}
    for key, value in weights.items():
        if key.endswith("experts.gate_up_proj"):
            stem, half = key[: -len("gate_up_proj")], value.shape[1] // 2
            for e in range(value.shape[0]):
                out[f"{stem}{e}.gate_proj.weight"] = value[e, :half]
                out[f"{stem}{e}.up_proj.weight"] = value[e, half:]
        elif key.endswith("experts.down_proj"):
            stem = key[: -len("down_proj")]
            for e in range(value.shape[0]):
                out[f"{stem}{e}.down_proj.weight"] = value[e]
        else:
            out[key] = value
    return out


# --- checks every hybrid model passes ----------------------------------------


def prefill_error(hf: Any, model: Model) -> float:
    """Max |ours - HF| over the logits of a 2-row, 12-token prefill."""
    ids = token_ids((2, 12))
    logits = step(model, model.make_cache(2), ids, [0, 0])
    return float(np.abs(logits - hf_logits(hf, ids)).max())


def prefill_then_decode_errors(
    hf: Any, model: Model, prompt: int
) -> tuple[float, float]:
    """Max |ours - HF| of a `prompt`-token prefill, then of 5 tokens decoded
    one by one, against HF's logits of the whole sequence."""
    ids = token_ids((1, prompt + 5), seed=2)
    reference = hf_logits(hf, ids)[0]
    cache = model.make_cache(1)
    head = step(model, cache, ids[:, :prompt], [0])[0]
    decoded = one_by_one(model, cache, list(ids[0, prompt:]), prompt)
    return (
        float(np.abs(head - reference[:prompt]).max()),
        float(np.abs(decoded - reference[prompt:]).max()),
    )


def prefilled(model: Model) -> tuple[HybridCache, int]:
    """A cache after a 7-token prompt, and that length."""
    prompt = token_ids((1, 7), seed=3)
    cache = model.make_cache(1)
    step(model, cache, prompt, [0])
    return cache, prompt.shape[1]


def check_commit_k_of_a_window(
    model: Model,
    base: HybridCache,
    length: int,
    kept: int,
    window: Sequence[int],
    further: Sequence[int],
) -> float:
    """Committing `kept` positions of a verify window, then decoding
    `further`, equals decoding the kept tokens one by one, then `further`:
    the logits and the committed linear-layer states (the KV beyond each
    row's length may differ: stale drafts there are masked, then
    overwritten). Returns the largest difference seen."""
    spec = base.take_rows([0])
    verified = step(model, spec, [window], [length], kept=[kept])[0]
    after_spec = one_by_one(model, spec, further, length + kept)

    plain = base.take_rows([0])
    accepted = one_by_one(model, plain, window[:kept], length) if kept else None
    after_plain = one_by_one(model, plain, further, length + kept)

    diffs = [np.abs(after_spec - after_plain).max()]
    if accepted is not None:
        diffs.append(np.abs(verified[:kept] - accepted).max())
    diffs += [
        np.abs(as_np(ours_) - as_np(theirs)).max()
        for ours_, theirs in zip(
            spec.conv + spec.recurrent, plain.conv + plain.recurrent, strict=True
        )
    ]
    worst = float(max(diffs))
    assert worst < ROLLBACK_TOL, worst
    return worst


def check_rows_keeping_different_counts(model: Model) -> float:
    """B=3 rows at different offsets keep (1, 4, 2) of a window of 4, then
    decode two more tokens together; each row equals itself run alone.
    Returns the largest difference seen."""
    lengths, kept = [5, 9, 7], [1, 4, 2]
    prompts = [list(token_ids((n,), seed=10 + i)) for i, n in enumerate(lengths)]
    windows = token_ids((3, 4), seed=20)
    further = token_ids((3, 2), seed=21)

    singles = []
    for prompt in prompts:
        single = model.make_cache(1)
        step(model, single, [prompt], [0])
        singles.append(single)
    batch = HybridCache.concat_rows(singles)
    verified = step(model, batch, windows, lengths, kept=kept)
    ends = [n + k for n, k in zip(lengths, kept, strict=True)]
    after = [
        step(model, batch, further[:, i : i + 1], [e + i for e in ends])
        for i in range(2)
    ]

    worst = 0.0
    for row, prompt in enumerate(prompts):
        alone = model.make_cache(1)
        step(model, alone, [prompt], [0])
        accepted = one_by_one(
            model, alone, list(windows[row, : kept[row]]), lengths[row]
        )
        tail = one_by_one(model, alone, list(further[row]), ends[row])
        got = np.stack([a[row, 0] for a in after])
        worst = max(
            worst,
            float(np.abs(verified[row, : kept[row]] - accepted).max()),
            float(np.abs(got - tail).max()),
        )
    assert worst < ROLLBACK_TOL, worst
    return worst


# --- a multimodal folder ------------------------------------------------------


def check_language_model_of(
    hf: Any, loaded: LoadedModel, kind: type, model_type: str
) -> None:
    """A multimodal HF folder (`hf`: its transformers model, vocab
    FOLDER_VOCAB) loads as its language model alone: a `kind` of the
    wrapper's `model_type` and tied head, without the vision tower's or an
    lm_head's weights, computing transformers' logits."""
    model = loaded.model
    assert isinstance(model, kind) and loaded.args.model_type == model_type
    assert loaded.args.tie_word_embeddings  # the wrapper's setting
    assert not any("visual" in k or "lm_head" in k for k in flat_parameters(model))
    ids = token_ids((2, 11), seed=40, vocab=FOLDER_VOCAB)
    logits = step(model, model.make_cache(2), ids, [0, 0])
    assert np.abs(logits - hf_logits(hf, ids)).max() < TOL


# --- the MTP head's reference wiring ------------------------------------------


class TorchMtp(torch.nn.Module):
    """An MTP head from HF building blocks (the family's RMSNorm, decoder layer
    and rotary embedding classes), wired as vLLM's `*MultiTokenPredictor`
    (transformers ships no MTP module). Its layer is built at the index of
    the first full-attention layer, so its MLP is of the kind MTP layer 0
    has."""

    def __init__(self, config: Any, norm: Any, layer: Any, rotary: Any) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.pre_fc_norm_embedding = norm(hidden, eps)
        self.pre_fc_norm_hidden = norm(hidden, eps)
        self.fc = torch.nn.Linear(2 * hidden, hidden, bias=False)
        full = config.layer_types.index("full_attention")
        self.layers = torch.nn.ModuleList([layer(config, full)])
        self.norm = norm(hidden, eps)
        self.rotary = rotary(config)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        length = embeds.shape[1]
        x = self.fc(
            torch.cat(
                [self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)],
                dim=-1,
            )
        )
        positions = torch.arange(length)[None]
        causal = torch.full((length, length), float("-inf")).triu(1)[None, None]
        x = self.layers[0](
            x,
            position_embeddings=self.rotary(x, positions),
            attention_mask=causal,
            position_ids=positions,
        )
        normed: torch.Tensor = self.norm(x)
        return normed


def mtp_weights(reference: TorchMtp) -> dict[str, mx.array]:
    """The reference head's weights under checkpoint names (`mtp.*`)."""
    return {
        k: v
        for k, v in hf_weights(reference, "mtp.").items()
        if not k.startswith("mtp.rotary")
    }


def mtp_reference(
    language: Any, lm_head: Any, reference: TorchMtp, ids: np.ndarray
) -> np.ndarray:  # [B, L-1, V]: token p+1 paired with the post-norm hidden at p
    """HF's text model `language` (its output after the final norm), the
    head's reference wiring, and HF's `lm_head`."""
    tokens = torch.tensor(ids)
    with torch.no_grad():
        hidden = language(input_ids=tokens).last_hidden_state
        embeds = language.embed_tokens(tokens)
        logits: np.ndarray = lm_head(reference(embeds[:, 1:], hidden[:, :-1])).numpy()
    return logits


def multimodal_mtp_error(hf: Any, reference: TorchMtp, model: Any, head: Any) -> float:
    """Max |ours - reference| over the drafted logits of 2 rows of 10
    tokens: `head` (loaded from a multimodal folder of vocab FOLDER_VOCAB,
    drafting for `model`) against its reference wiring on `hf`'s language
    model and lm_head."""
    ids = token_ids((2, 10), seed=50, vocab=FOLDER_VOCAB)
    grid = mx.array(ids, dtype=mx.int32)
    context = model.final_norm(model(grid, model.make_cache(2), [0, 0]).hidden)
    drafted = head(
        model.embed(grid[:, 1:]), context[:, :-1], head.make_cache(2), [0, 0]
    )
    logits = as_np(head.logits(drafted, model))
    expected = mtp_reference(hf.model.language_model, hf.lm_head, reference, ids)
    return float(np.abs(logits - expected).max())


def assert_row_major(module: Any) -> None:
    """Every parameter of `module` is a row-major array (models.build.row_major)."""
    for name, weight in flat_parameters(module).items():
        mx.eval(weight)
        assert memoryview(weight).c_contiguous, name


def fused_logit_difference(model: Model) -> tuple[int, float]:
    """Fuse `model`'s projection groups (models/fuse.py); return how many fused
    and max |fused - separate| over a 2-row 9-token prefill then a 3-token
    window (0.0 expected on the CPU: the same dot products)."""
    from models.fuse import fuse_projections

    ids = token_ids((2, 12), seed=4)

    def run() -> np.ndarray:
        cache = model.make_cache(2)
        head = step(model, cache, ids[:, :9], [0, 0])
        return np.concatenate([head, step(model, cache, ids[:, 9:], [9, 9])], axis=1)

    separate = run()
    fused = fuse_projections(model)
    return fused, float(np.abs(run() - separate).max())
