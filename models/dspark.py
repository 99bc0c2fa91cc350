"""DSpark: DeepSeek's block drafter (DeepSpec's `Qwen3DSparkModel`).

Its backbone is DFlash's (models/dflash.py: the context of the target's
tapped layers, `hidden_norm(fc(concat(taps)))`, written once per committed
position into the draft's KV cache; Qwen3 layers whose queries come from
the block and whose keys / values from [context, block], not causal, no
window), with three differences:

- the draft has its own embedding and vocabulary projection
  (`embed_tokens`, `lm_head`), used instead of the target's;
- block slot j (the block at positions n .. n + L - 1, slot 0 the pending
  token) predicts the token at position n + j + 1, so slot 0 already holds
  the first draft: a block of `block_size` drafts `block_size` tokens;
- a Markov head corrects each slot's logits by the token drawn before it
  (the pending token for slot 0), so the drafts are drawn in order:

      logits_k = lm_head(h_k) + markov_w2(markov_w1[prev])       (vanilla)
      gated:  markov_w2(sigmoid(gate_proj([h_k, markov_w1[prev]])) * markov_w1[prev])
      rnn:    z = joint_proj([s, markov_w1[prev], h_k]) = [g, c, o];
              s <- sigmoid(g) * s + (1 - sigmoid(g)) * tanh(c)  (s = 0 first);
              bias = markov_w2(tanh(o))

An optional confidence head (`confidence_head.proj`, over h_k, or
[h_k, markov_w1[prev]]) predicts each draft's acceptance; DeepSpec's default
threshold (0) drafts the whole block regardless, and so does this drafter:
its weights load, it never cuts a block.

DeepSpec's Gemma-4 drafter (`Gemma4DSparkModel`, `Gemma4DSparkDraft`) is
the same model over Gemma-4 layers (models/gemma4.py's `DecoderLayer`):
- its config is its target's Gemma-4 text config with its own layer count,
  every layer "full_attention": heads of `global_head_dim`, KV heads
  `num_global_key_value_heads` where `attention_k_eq_v` (values then k_proj's
  output, no v_proj), else `num_key_value_heads`; the full layers' RoPE
  ("proportional": `partial_rotary_factor`, `factor`); no per-layer
  embeddings, no MoE block, no kv sharing (`gemma4_draft_args`);
- attention: q and k normed per head (Gemma-4's RMSNorm, x / rms * w), v
  normed without weight, RoPE on q and k (context keys at their positions),
  softmax scale 1; a layer
      h = x + post_attention_layernorm(attn(input_layernorm(x)))
      out = (h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h))))
            * layer_scalar,    mlp GeGLU (tanh GELU);
- the block's embedding is `embed_tokens` times sqrt(H) (rounded to the
  weights' dtype), and its logits are capped, c * tanh(lm_head(h) / c) with
  c = `final_logit_softcapping`, before the Markov bias is added.
`fc`, `hidden_norm` and the final `norm`, the Markov and confidence heads,
the block and its slots are the Qwen3 drafter's.

References: deepseek-ai/DeepSpec `deepspec/modeling/dspark/qwen3/modeling.py`,
`gemma4/modeling.py`, `gemma4/config.py`, `markov_head.py`, `common.py`,
`eval/dspark/draft_ops.py`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from attrs import evolve, frozen
from returns.result import Failure, Result, Success

from models.cache import KVCache
from models.dflash import DFlashDraft, DFlashSettings, DraftLayer, load_exact
from models.gemma4 import Attention, DecoderLayer, scaled_embedding
from models.layers import model_dtype
from models.parallel import Linear
from schemas.errors import ConfigError, LoadError
from schemas.hf import DecoderArgs
from schemas.hf_gemma4 import FULL_ATTENTION, Gemma4Args, gemma4_text_args

MARKOV_KINDS = ("vanilla", "gated", "rnn")

# the architectures a DSpark drafter's config names (DeepSpec's Qwen3 one,
# and the community's); DeepSpec's Gemma-4 one (`Gemma4DSparkDraft`)
ARCHITECTURES = ("Qwen3DSparkModel", "DSparkDraftModel")
GEMMA4_ARCHITECTURE = "Gemma4DSparkModel"


@frozen
class DSparkSettings:
    """What a DSpark config adds to its Qwen3 layers' (top-level keys)."""

    target_layers: tuple[int, ...]
    block_size: int
    mask_token: int
    markov_rank: int = 0  # 0: no Markov head
    markov_kind: str = "vanilla"
    # the confidence head's input: None (none), "hidden" or "hidden+markov"
    confidence: str | None = None
    draft_layers: int = 1
    # the logits' cap (Gemma-4's `final_logit_softcapping`; None: none)
    softcap: float | None = None

    @property
    def backbone(self) -> DFlashSettings:
        """The DFlash settings of its backbone: bidirectional full attention
        in every layer, the target's layers tapped, the logits capped."""
        return DFlashSettings(
            self.target_layers,
            self.block_size,
            self.mask_token,
            tuple((False, None) for _ in range(self.draft_layers)),
            softcap=self.softcap,
        )

    @classmethod
    def of(cls, config: Mapping[str, Any]) -> Result[DSparkSettings, LoadError]:
        layers = config.get("target_layer_ids")
        if not (
            isinstance(layers, list)
            and layers
            and all(isinstance(i, int) and not isinstance(i, bool) for i in layers)
        ):
            return Failure(
                LoadError(
                    "a DSpark config needs target_layer_ids, a list of the target "
                    f"layers whose outputs it reads; got {layers!r}"
                )
            )
        mask = config.get("mask_token_id")
        if not isinstance(mask, int) or mask < 0:
            return Failure(
                LoadError(
                    "a DSpark config needs mask_token_id, the id of the token its "
                    f"blocks are filled with; got {mask!r}"
                )
            )
        block = config.get("block_size")
        if not isinstance(block, int) or block < 1:
            return Failure(
                LoadError(f"a DSpark block_size must be an integer >= 1, got {block!r}")
            )
        count = config.get("num_hidden_layers", 1)
        kinds = config.get("layer_types")
        if kinds is not None and (
            not isinstance(kinds, list)
            or len(kinds) != count
            or any(k != "full_attention" for k in kinds)
        ):
            return Failure(
                LoadError(
                    f"DSpark layer_types must name {count} full_attention layers "
                    f"(its attention is bidirectional over the block); got {kinds!r}"
                )
            )
        rank = config.get("markov_rank", 0)
        if not isinstance(rank, int) or rank < 0:
            return Failure(
                LoadError(f"a DSpark markov_rank must be an integer >= 0, got {rank!r}")
            )
        markov = str(config.get("markov_head_type", "vanilla")).lower()
        if rank and markov not in MARKOV_KINDS:
            return Failure(
                LoadError(
                    f"a DSpark markov_head_type must be one of {', '.join(MARKOV_KINDS)}"
                    f"; got {markov!r}"
                )
            )
        confidence = None
        if config.get("enable_confidence_head"):
            confidence = "hidden"
            if config.get("confidence_head_with_markov"):
                if not rank:
                    return Failure(
                        LoadError(
                            "a DSpark confidence head with the Markov head's "
                            "embedding needs markov_rank > 0"
                        )
                    )
                confidence = "hidden+markov"
        if config.get("log_snr_conditioning"):
            return Failure(
                LoadError(
                    "a DSpark config with log_snr_conditioning (log-SNR embeddings "
                    "added to the block) is not supported; DeepSpec's drafters have none"
                )
            )
        return Success(
            cls(
                tuple(layers),
                block,
                mask,
                rank,
                markov,
                confidence,
                int(count) if isinstance(count, int) else 1,
            )
        )


class MarkovHead(nn.Module):
    """The low-rank bias of the token drawn before a slot (`step`)."""

    def __init__(self, hidden: int, vocab: int, rank: int, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.rank = rank
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = Linear(rank, vocab, bias=False)
        if kind == "gated":
            self.gate_proj = Linear(hidden + rank, rank, bias=True)
        elif kind == "rnn":
            self.joint_proj = Linear(2 * rank + hidden, 3 * rank, bias=True)

    def step(
        self,
        previous: mx.array,  # [B] the token drawn before the slot
        hidden: mx.array,  # [B, H] the slot's output (after the draft's norm)
        state: mx.array | None,  # [B, r] the rnn head's (None: the first slot)
    ) -> tuple[mx.array, mx.array | None]:  # the bias [B, V], the next state
        embedded = self.markov_w1(previous).astype(hidden.dtype)
        if self.kind == "gated":
            gate = mx.sigmoid(self.gate_proj(mx.concatenate([hidden, embedded], -1)))
            return self.markov_w2(gate * embedded), state
        if self.kind == "rnn":
            if state is None:
                state = mx.zeros_like(embedded)
            joint = self.joint_proj(mx.concatenate([state, embedded, hidden], -1))
            g, c, o = mx.split(joint, 3, axis=-1)
            gate = mx.sigmoid(g)
            state = gate * state + (1.0 - gate) * mx.tanh(c)
            return self.markov_w2(mx.tanh(o)), state
        return self.markov_w2(embedded), state


class ConfidenceHead(nn.Module):
    """DeepSpec's acceptance predictor (loaded, not used for drafting)."""

    def __init__(self, inputs: int) -> None:
        super().__init__()
        self.proj = Linear(inputs, 1, bias=True)


class DSparkDraft(DFlashDraft):
    """The draft's modules, named as DeepSpec's checkpoints name them:
    DFlash's (`fc`, `hidden_norm`, `layers.*`, `norm`) and its own
    `embed_tokens`, `lm_head`, `markov_head.*` and `confidence_head.proj`."""

    def __init__(self, args: DecoderArgs, settings: DSparkSettings) -> None:
        super().__init__(args, settings.backbone)
        self.dspark = settings
        hidden, vocab = args.hidden_size, args.vocab_size
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.lm_head = Linear(hidden, vocab, bias=False)
        if settings.markov_rank:
            self.markov_head = MarkovHead(
                hidden, vocab, settings.markov_rank, settings.markov_kind
            )
        if settings.confidence is not None:
            extra = settings.markov_rank if settings.confidence != "hidden" else 0
            self.confidence_head = ConfidenceHead(hidden + extra)

    @property
    def family(self) -> str:
        return "dspark"

    @property
    def markov(self) -> MarkovHead | None:
        return self.markov_head if self.dspark.markov_rank else None

    def embed(self, ids: mx.array) -> mx.array:  # [B, L] -> [B, L, H]
        """The block's embedding (the draft's own)."""
        return self.embed_tokens(ids)


class Gemma4DSparkAttention(Attention):
    """A Gemma-4 full-attention layer's projections, norms, RoPE and scale
    (models/gemma4.py) split as DFlash's attention is: the context's keys
    and values (`context`, cached), and the block's queries over them and
    the block's own (`block`)."""

    def context(
        self,
        ctx: mx.array,  # [B, N, H] the projected target features
        rope_at: int | mx.array,
    ) -> tuple[mx.array, mx.array]:  # keys, values [B, Hkv, N, D]
        assert self.k_proj is not None, "a DSpark layer projects its own keys"
        k = self.k_proj(ctx)
        return self.keys_values(
            k, k if self.v_proj is None else self.v_proj(ctx), rope_at
        )

    def block(
        self,
        x: mx.array,  # [B, L, H] input-normed
        keys: mx.array,  # [B, Hkv, S, D] the context's
        values: mx.array,  # [B, Hkv, S, D]
        rope_at: int | mx.array,
        mask: mx.array,  # [B, 1, L, S + L] bool
    ) -> mx.array:  # [B, L, H]
        q, k, v = self._project(x)
        own_keys, own_values = self.keys_values(k, v, rope_at)
        return self.attend(
            self._rotated_queries(q, rope_at),
            mx.concatenate([keys, own_keys], axis=2),
            mx.concatenate([values, own_values], axis=2),
            mask,
        )


class Gemma4DSparkLayer(DecoderLayer):
    """A Gemma-4 decoder layer (its four norms, GeGLU MLP and
    `layer_scalar`) around `Gemma4DSparkAttention`, called as a DFlash
    draft layer is."""

    self_attn: Gemma4DSparkAttention

    def __init__(self, args: Gemma4Args, layer: int) -> None:
        super().__init__(args, layer, Gemma4DSparkAttention)

    def __call__(
        self,
        x: mx.array,  # [B, L, H]
        keys: mx.array,  # [B, Hkv, S, D]
        values: mx.array,  # [B, Hkv, S, D]
        rope_at: int | mx.array,
        mask: mx.array,  # [B, 1, L, S + L] bool
    ) -> mx.array:  # [B, L, H]
        attention = self.self_attn
        return self.run(
            x, lambda normed: attention.block(normed, keys, values, rope_at, mask), None
        )


class Gemma4DSparkDraft(DSparkDraft):
    """DeepSpec's `Gemma4DSparkModel` (see the module doc): DSpark's
    modules, named as its checkpoints name them, over Gemma-4 layers; the
    embedding scaled by sqrt(H), the logits capped as its config says."""

    def __init__(self, args: Gemma4Args, settings: DSparkSettings) -> None:
        super().__init__(args, evolve(settings, softcap=args.final_logit_softcapping))

    def make_layer(self, args: DecoderArgs, index: int) -> DraftLayer:
        assert isinstance(args, Gemma4Args), "a Gemma-4 DSpark draft has Gemma4Args"
        return Gemma4DSparkLayer(args, index)

    def embed(self, ids: mx.array) -> mx.array:  # [B, L] -> [B, L, H]
        return scaled_embedding(self.embed_tokens(ids))

    def make_cache(self, batch: int) -> KVCache:
        """The context keys / values of every layer, per row (full-attention
        heads: `global_head_dim` wide)."""
        args = self.args
        assert isinstance(args, Gemma4Args)
        return KVCache(
            len(self.layers),
            batch,
            args.kv_heads_of(FULL_ATTENTION),
            args.head_dim_of(FULL_ATTENTION),
            model_dtype(self),
        )


def gemma4_draft_args(
    config: Mapping[str, Any], where: str
) -> Result[Gemma4Args, ConfigError]:
    """A Gemma-4 DSpark config -> its layers' `Gemma4Args`, or a
    `ConfigError` naming `where`, the problem and the key. DeepSpec writes
    its target's Gemma-4 text config with its own `num_hidden_layers`, every
    layer "full_attention", and reads `global_head_dim` and (with
    `attention_k_eq_v`) `num_global_key_value_heads` as they stand; a
    `per_layer_config` there indexes the target's layers, and its
    `num_kv_shared_layers` the target's, so neither applies to the draft."""

    def refused(problem: str) -> Result[Gemma4Args, ConfigError]:
        return Failure(ConfigError(f"{where}: {problem}"))

    head = config.get("global_head_dim")
    if not isinstance(head, int) or isinstance(head, bool) or head < 2:
        return refused(
            "a Gemma-4 DSpark config needs global_head_dim, the head width of its "
            f"(full attention) layers; got {head!r}"
        )
    if (
        config.get("attention_k_eq_v")
        and config.get("num_global_key_value_heads") is None
    ):
        return refused(
            "a Gemma-4 DSpark config with attention_k_eq_v needs "
            "num_global_key_value_heads, its layers' key/value heads"
        )
    shared = config.get("num_kv_shared_layers") or 0
    if config.get("use_double_wide_mlp") and shared:
        return refused(
            f"use_double_wide_mlp with num_kv_shared_layers ({shared}) would widen "
            "some of the draft's MLPs by its target's kv sharing; DeepSpec's Gemma-4 "
            "DSpark drafters have none"
        )
    text = {
        k: v
        for k, v in config.items()
        if k not in ("per_layer_config", "num_kv_shared_layers", "layer_types")
    }
    text["num_kv_shared_layers"] = 0
    count = config.get("num_hidden_layers")
    if isinstance(count, int) and count >= 1:
        text["layer_types"] = [FULL_ATTENTION] * count

    def drafter_layers(args: Gemma4Args) -> Result[Gemma4Args, ConfigError]:
        if args.hidden_size_per_layer_input:
            return refused(
                f"hidden_size_per_layer_input ({args.hidden_size_per_layer_input}): "
                "DeepSpec's Gemma-4 DSpark layers take no per-layer embeddings; "
                "its drafters' configs set it to 0"
            )
        if args.enable_moe_block:
            return refused(
                "enable_moe_block: DeepSpec's Gemma-4 DSpark layers have no MoE "
                "block; its drafters' configs set it to false"
            )
        return Success(args)

    return gemma4_text_args(text, where).bind(drafter_layers)


def build_dspark(
    args: DecoderArgs,
    settings: DSparkSettings,
    weights: Mapping[str, mx.array],
    dtype: mx.Dtype | None = None,
) -> Result[DSparkDraft, LoadError]:
    """The draft with its checkpoint's weights (all of them, no more; HF
    names, optionally under `model.`), cast to `dtype` where given; a
    Gemma-4 one for `Gemma4Args` (`gemma4_draft_args`)."""
    names = {k.removeprefix("model."): v for k, v in weights.items()}
    draft = (
        Gemma4DSparkDraft(args, settings)
        if isinstance(args, Gemma4Args)
        else DSparkDraft(args, settings)
    )
    return load_exact(
        draft,
        names,
        "DSpark",
        "is this a DeepSpec DSpark checkpoint of this config (markov_rank, "
        "markov_head_type, enable_confidence_head; a Gemma-4 one's "
        "global_head_dim, attention_k_eq_v)?",
        dtype,
    )
