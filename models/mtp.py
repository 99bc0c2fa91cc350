"""The Qwen3-Next multi-token-prediction (MTP) head: a one-layer drafter the
checkpoints carry under `mtp.*`.

    x   = fc([pre_fc_norm_embedding(embed(token)), pre_fc_norm_hidden(hidden)])
    out = layer(x)                      a full-attention decoder layer of the
                                        target's kind, with its own KV cache
    logits = target projection(norm(out))

Which norm applies where (following vLLM's `qwen3_next_mtp.py`, the reference
serving implementation, and SGLang's, which agrees):
- `hidden` for the first draft step is the target's hidden AFTER the target's
  final norm (`Model.final_norm(ModelOutput.hidden)`): vLLM's target forward
  returns post-norm hidden states and feeds those to the MTP module.
- the head's own norm `mtp.norm` replaces the target's final norm: logits are
  the target's vocabulary projection (`Model.project`, shared, no norm) of
  `norm(out)`, and the next chained draft step reads `norm(out)` as its hidden.
- the embedding is the target's (`Model.embed`), shared.
A token at position p+1 is paired with the hidden of position p; the pair sits
at RoPE position p (vLLM passes the target's positions), so `offsets` are the
hidden's positions.

Qwen3.5 (models/qwen3_5.py, models/qwen3_5_moe.py) wires its head the same
way (vLLM's `qwen3_5_mtp.py`); the layer's MLP is the target's kind, picked
from `args` by `make_mlp`: dense for Qwen3.5, a sparse MoE block for Qwen3-Next
and Qwen3.5 MoE.

Weights: `split_mtp` in models/qwen3_next.py returns them with `mtp.` removed
and HF conventions converted (zero-centred norms +1, experts stacked). MLX
affine-quantized heads (`.scales` / `.biases` beside a packed `.weight`) load
into quantized layers, bits and group size read per layer from the packed
shapes; a companion's config block is checked against them
(`DeclaredQuantization`), and `models.build.quantization_block` writes one.
Reference: https://github.com/vllm-project/vllm/blob/main/vllm/model_executor/models/qwen3_next_mtp.py
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import mlx.core as mx
import mlx.nn as nn
from attrs import frozen
from mlx.utils import tree_unflatten
from returns.result import Failure, Result, Success

from models.base import attention_mask, rope_offset
from models.build import quantized_layers, row_major
from models.cache import KVCache, position_mask, scatter_window
from models.fuse import fuse_projections
from models.layers import decoder_cache, flat_parameters
from models.parallel import Linear
from models.qwen3_next import AttentionLayer
from schemas.errors import LoadError
from schemas.hf import DecoderArgs
from schemas.hf_hybrid import HybridArgs

# The draft block of a head whose config names none (`block_size`): the
# target's token plus two drafts, the MTP width Qwen recommends for its
# hybrid models. A bundled head and the companion `specpipe convert` writes
# (which records it) default to the same width, block - 1.
DEFAULT_BLOCK_SIZE = 3


class HeadLayer(Protocol):
    """A head's decoder layer (Qwen's `AttentionLayer`, GLM's `DecoderLayer`)."""

    def __call__(
        self,
        x: mx.array,
        cache: KVCache,
        offsets: Sequence[int],
        mask: Any,
        rope_at: int | mx.array,
    ) -> mx.array: ...

    def forward(
        self, x: mx.array, write: Any, mask: Any, rope_at: int | mx.array
    ) -> mx.array: ...


class SharedProjection(Protocol):
    """What the head borrows from its target: the vocabulary projection."""

    def project(self, normed: mx.array) -> mx.array: ...


class MtpHead(nn.Module):
    """`num_nextn_predict_layers` MTP layers (released checkpoints: one); draft
    step s uses layer s mod that count, as vLLM does."""

    def __init__(self, args: HybridArgs) -> None:
        super().__init__()
        self.args: DecoderArgs = args
        hidden, eps = args.hidden_size, args.rms_norm_eps
        self.pre_fc_norm_embedding = nn.RMSNorm(hidden, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(hidden, eps=eps)
        self.fc = Linear(2 * hidden, hidden, bias=False)
        # vLLM numbers the MTP layers from 0 for the dense-vs-MoE choice too.
        self.layers: list[HeadLayer] = [
            AttentionLayer(args, i, i) for i in range(args.num_nextn_predict_layers)
        ]
        self.norm = nn.RMSNorm(hidden, eps=eps)

    def __call__(
        self,
        token_embeds: mx.array,  # [B, L, H], target.embed(tokens at p+1)
        hidden: mx.array,  # [B, L, H], post-norm hidden at p (see module doc)
        cache: KVCache,
        offsets: Sequence[int],  # per row, the position of hidden[:, 0]
        step: int = 0,
    ) -> mx.array:  # [B, L, H], before `norm`
        batch, length, _ = token_embeds.shape
        assert hidden.shape == token_embeds.shape, "one hidden per token"
        assert len(offsets) == batch, "one offset per row"
        cache.reserve(max(offsets) + length)
        x = self.fused_input(token_embeds, hidden)
        layer = self.layers[step % len(self.layers)]
        return layer(
            x,
            cache,
            offsets,
            attention_mask(offsets, length, cache.key_span(offsets, length)),
            rope_offset(offsets),
        )

    def forward_at(
        self,
        token_embeds: mx.array,  # [B, L, H]
        hidden: mx.array,  # [B, L, H], as for __call__
        keys: mx.array,  # [B, Hkv, C, D], layer `step mod n`'s whole key buffer
        values: mx.array,  # [B, Hkv, C, D]
        starts: mx.array,  # [B] int32, per row the position of hidden[:, 0]
        step: int = 0,
    ) -> tuple[mx.array, mx.array, mx.array]:  # out [B, L, H], keys, values
        """`__call__` with the positions as device values and the layer's
        buffers passed in and returned (written at `starts`, the queries
        attending over all C positions under a position mask): no host value
        enters the graph, so one trace serves every round (`mx.compile`)."""
        length = token_embeds.shape[1]
        x = self.fused_input(token_embeds, hidden)
        written: list[mx.array] = []

        def write(k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
            written[:] = [
                scatter_window(keys, k, starts),
                scatter_window(values, v, starts),
            ]
            return written[0], written[1]

        layer = self.layers[step % len(self.layers)]
        mask = position_mask(starts, length, keys.shape[2])
        out = layer.forward(x, write, mask, starts)
        return out, written[0], written[1]

    # Whether models/mtp_cuda.py's one-kernel step computes this head's layer
    # (Qwen's gated attention and MLP kinds); a head of another family says no.
    fused_kernel = True

    def carried(self, out: mx.array, normed: mx.array) -> mx.array:
        """What the next chained step reads as its hidden, of a step's output
        `out` and its `normed(out)`: Qwen's heads carry the normed output
        (vLLM's `qwen3_next_mtp.py` returns `norm(out)`)."""
        return normed

    def fused_input(self, token_embeds: mx.array, hidden: mx.array) -> mx.array:
        """fc([norm(embed), norm(hidden)]): the layer's input, [B, L, H]."""
        return self.fc(
            mx.concatenate(
                [
                    self.pre_fc_norm_embedding(token_embeds),
                    self.pre_fc_norm_hidden(hidden),
                ],
                axis=-1,
            )
        )

    def normed(self, out: mx.array) -> mx.array:  # [..., H] -> [..., H]
        """`mtp.norm(out)`: what the projection and the next step read."""
        return self.norm(out)

    def logits(self, out: mx.array, target: SharedProjection) -> mx.array:
        """[..., H] head output -> [..., V] through the target's projection."""
        return target.project(self.normed(out))

    def make_cache(self, batch: int) -> KVCache:
        return decoder_cache(self, self.args, len(self.layers), batch)


@frozen
class DeclaredQuantization:
    """What a head's config.json says its weights are: the MLX `quantization`
    block (`{"group_size": g, "bits": b}`, optionally with per-layer entries
    keyed by the layer's path in the head, each such a dict or `false` for a
    float layer), or None where the config declares no quantization."""

    block: Mapping[str, Any] | None

    def layer(self, path: str) -> dict[str, Any] | None:
        """The declared bits and group size of a layer (None: float)."""
        if self.block is None:
            return None
        entry = self.block.get(path, self.block) if path else self.block
        if not isinstance(entry, Mapping):
            return None
        return _plain(entry)

    def problems(self, found: Mapping[str, Mapping[str, Any]]) -> list[str]:
        """How the weights' quantized layers (`found`: path -> settings read
        from the packed shapes) disagree with this declaration."""
        fix = "re-convert the target with `specpipe convert --quantize N`"
        if self.block is None:
            if not found:
                return []
            return [
                f"the weights are quantized ({_described(found)}) but config.json "
                'declares no quantization; add its "quantization" block '
                f"(group_size, bits) or {fix}"
            ]
        mode = self.block.get("mode", "affine")
        if mode != "affine":
            return [
                f"config.json declares {mode!r} quantization; only MLX affine "
                f"quantization is supported ({fix})"
            ]
        if not found:
            return [
                f"config.json declares {_setting(self.layer(''))} quantization but "
                f"the weights are float; drop its quantization block or {fix}"
            ]
        wrong = [
            f"{path} is {_setting(got)} in the weights, "
            f"{_setting(self.layer(path))} in config.json"
            for path, got in sorted(found.items())
            if self.layer(path) != _plain(got)
        ]
        if not wrong:
            return []
        shown = "; ".join(wrong[:5]) + (" ..." if len(wrong) > 5 else "")
        return [
            f"config.json's quantization does not match the weights ({shown}); "
            f"fix its quantization block or {fix}"
        ]


def _plain(settings: Mapping[str, Any]) -> dict[str, Any]:
    return {"group_size": settings.get("group_size"), "bits": settings.get("bits")}


def _setting(settings: Mapping[str, Any] | None) -> str:
    if settings is None:
        return "float"
    return f"{settings.get('bits')}-bit (group size {settings.get('group_size')})"


def _described(found: Mapping[str, Mapping[str, Any]]) -> str:
    kinds = Counter(_setting(s) for s in found.values())
    return ", ".join(f"{n} layers {what}" for what, n in kinds.most_common())


def build_mtp(
    args: DecoderArgs,
    weights: Mapping[str, mx.array],
    declared: DeclaredQuantization | None = None,
) -> Result[MtpHead, LoadError]:
    """The MTP head of a target of `args` (a Qwen hybrid's, or GLM-4.5's or
    GLM-5's: models/glm_mtp.py), loaded strictly from its target's `split_mtp`'s
    second dict: the names and shapes must equal the head's parameters.
    Layers the weights hold quantized become quantized layers first (bits
    and group size per layer, from the packed shapes); `declared`, when
    given, must agree with them."""
    from models.glm_mtp import build_glm_mtp  # it builds on this module
    from schemas.hf_glm4_moe import MoeArgs

    if isinstance(args, MoeArgs):  # GLM-4.5 MoE or GLM-5
        return build_glm_mtp(args, weights, declared)
    if not isinstance(args, HybridArgs):
        return Failure(
            LoadError(
                f"a {args.model_type} model has no MTP head (Qwen3-Next / Qwen3.5, "
                "GLM-4.5 MoE and GLM-5 models do)"
            )
        )
    return load_head(MtpHead(args), weights, declared)


def load_head(
    head: MtpHead,
    weights: Mapping[str, mx.array],
    declared: DeclaredQuantization | None = None,
) -> Result[MtpHead, LoadError]:
    """`head` with `weights` loaded strictly (as `build_mtp` says), its
    projections fused."""
    settings, problems = quantized_layers(head, weights)
    if not problems and declared is not None:
        problems = declared.problems(settings)
    if problems:
        return Failure(
            LoadError("the MTP weights' quantization: " + "; ".join(problems[:5]))
        )
    if settings:
        nn.quantize(head, class_predicate=lambda path, _m: settings.get(path, False))
    expected = flat_parameters(head)
    missing = sorted(expected.keys() - weights.keys())
    unexpected = sorted(weights.keys() - expected.keys())
    mismatched = sorted(
        k
        for k in expected.keys() & weights.keys()
        if weights[k].shape != expected[k].shape
    )
    if missing or unexpected or mismatched:
        listed = [
            f"{what}: {', '.join(names[:5])}" + (" ..." if len(names) > 5 else "")
            for what, names in (
                ("missing", missing),
                ("unexpected", unexpected),
                ("wrong shape", mismatched),
            )
            if names
        ]
        return Failure(
            LoadError("the MTP weights do not match this config: " + "; ".join(listed))
        )
    head.update(tree_unflatten(list(row_major(weights).items())))
    fuse_projections(head)  # one product for q/k/v and for gate/up (models/fuse.py)
    return Success(head)
