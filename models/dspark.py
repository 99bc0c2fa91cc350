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

References: deepseek-ai/DeepSpec `deepspec/modeling/dspark/qwen3/modeling.py`,
`markov_head.py`, `common.py`, `eval/dspark/draft_ops.py`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from attrs import frozen
from returns.result import Failure, Result, Success

from models.dflash import DFlashDraft, DFlashSettings, load_exact
from models.parallel import Linear
from schemas.errors import LoadError
from schemas.hf import DecoderArgs

MARKOV_KINDS = ("vanilla", "gated", "rnn")

# the architectures a DSpark drafter's config names (DeepSpec's, and the
# community's); a Gemma-4 one is DSpark too, for a target specpipe lacks
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

    @property
    def backbone(self) -> DFlashSettings:
        """The DFlash settings of its backbone: bidirectional full attention
        in every layer, the target's layers tapped."""
        return DFlashSettings(
            self.target_layers,
            self.block_size,
            self.mask_token,
            tuple((False, None) for _ in range(self.draft_layers)),
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


def build_dspark(
    args: DecoderArgs,
    settings: DSparkSettings,
    weights: Mapping[str, mx.array],
    dtype: mx.Dtype | None = None,
) -> Result[DSparkDraft, LoadError]:
    """The draft with its checkpoint's weights (all of them, no more; HF
    names, optionally under `model.`), cast to `dtype` where given."""
    names = {k.removeprefix("model."): v for k, v in weights.items()}
    return load_exact(
        DSparkDraft(args, settings),
        names,
        "DSpark",
        "is this a DeepSpec DSpark checkpoint of this config (markov_rank, "
        "markov_head_type, enable_confidence_head)?",
        dtype,
    )
