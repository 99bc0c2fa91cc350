"""Qwen3.5 dense (`model_type` `qwen3_5_text`, and `qwen3_5`, the multimodal
wrapper run as a text model): the Qwen3-Next hybrid with a different
linear-attention projection layout and no experts.

What differs from Qwen3-Next (models/qwen3_next.py), and nothing else does:
- GatedDeltaNet input projections are four separate linears, `in_proj_qkv`
  (q, k, v channels head-major, already the conv's channel order),
  `in_proj_z`, `in_proj_b` and `in_proj_a`, instead of Qwen3-Next's
  `in_proj_qkvz` / `in_proj_ba` grouped by key head.
- Every layer's MLP is a dense SwiGLU of `intermediate_size`
  (`HybridArgs.num_experts` is 0; the config defines no MoE keys).
- RoPE is multimodal (`mrope_section`), which for text (temporal, height and
  width positions all equal to the token's) is the plain partial RoPE.
Shared unchanged: the gated attention, the zero-centred norms (`sanitize`
adds 1 to HF weights), the gated delta rule and the per-position commit of
recurrent state (`HybridDelta`, so `padding_safe` is False), and the MTP
head (`mtp.*`, a full-attention layer with a dense MLP: models/mtp.py).

Checkpoint names: the text form ships `model.*` and `lm_head.weight`; the
multimodal form `model.language_model.*`, `lm_head.weight` and the vision
tower `model.visual.*`; MLX (mlx-lm / mlx-vlm) conversions
`language_model.model.*`, `language_model.lm_head.weight` and
`vision_tower.*`. `sanitize` maps all of them onto the text model's names and
drops the vision tower: specpipe decodes text only, so a multimodal
checkpoint loads as its language model and images are not supported.
`SplitModel` is all of the above but the dense-MLP check; Qwen3.5 MoE
(models/qwen3_5_moe.py) builds on it with MoE blocks instead.
References: transformers `models/qwen3_5/modular_qwen3_5.py`; vLLM
`model_executor/models/qwen3_5_mtp.py` (MTP weights under top-level `mtp.`).
"""

from __future__ import annotations

from collections.abc import Mapping

import mlx.core as mx

from models import qwen3_next
from models.fuse import FusedProjection, fuse, fused_or_none, split_last
from models.gated_delta import GatedDeltaMixer
from models.parallel import Linear
from schemas.hf_hybrid import HybridArgs

# Prefixes of vision-tower weights (HF multimodal, MLX-VLM conversions).
VISION_PREFIXES = ("model.visual.", "visual.", "vision_tower.", "model.vision_tower.")
# Text-model prefixes of the multimodal forms -> this model's names.
_TEXT_PREFIXES = (
    ("model.language_model.", "model."),  # HF Qwen3_5ForConditionalGeneration
    ("language_model.model.", "model."),  # MLX conversions
    ("language_model.", ""),  # MLX conversions: lm_head, mtp
)


class SplitGatedDeltaNet(GatedDeltaMixer):
    """GatedDeltaNet with Qwen3.5's four separate input projections."""

    def __init__(self, args: HybridArgs) -> None:
        super().__init__(args)
        hidden = args.hidden_size
        values = self.value_heads * self.value_dim
        self.in_proj_qkv = Linear(hidden, self.conv_channels, bias=False)
        self.in_proj_z = Linear(hidden, values, bias=False)
        self.in_proj_b = Linear(hidden, self.value_heads, bias=False)
        self.in_proj_a = Linear(hidden, self.value_heads, bias=False)
        self._in: FusedProjection | None = None

    def _parts(self) -> tuple[Linear, Linear, Linear, Linear]:
        return (self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)

    def fuse_projections(self) -> bool:
        """Run the four input projections as one product from now on (models/fuse.py)."""
        self._in = fuse(self._parts())
        return self._in is not None

    def project(
        self,
        x: mx.array,  # [B, L, H]
    ) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        batch, length, _ = x.shape
        fused = fused_or_none(self._in, self._parts())
        if fused is None:
            qkv, z, b, a = (part(x) for part in self._parts())
        else:
            qkv, z, b, a = split_last(fused(x), fused.sizes)
        z = z.reshape(batch, length, self.value_heads, self.value_dim)
        return qkv, z, b, a


class SplitModel(qwen3_next.Model):
    """The Qwen3-Next causal LM with `SplitGatedDeltaNet` linear layers and the
    Qwen3.5 checkpoint forms (module doc): what Qwen3.5 dense and Qwen3.5 MoE
    (models/qwen3_5_moe.py) share. The MLPs follow `args` (`make_mlp`)."""

    def __init__(self, args: HybridArgs) -> None:
        super().__init__(args, SplitGatedDeltaNet)

    def split_mtp(
        self, weights: Mapping[str, mx.array]
    ) -> tuple[dict[str, mx.array], dict[str, mx.array]]:
        """Sanitized weights of this model, and of the MTP head (`mtp.` removed,
        names as in `models.mtp.MtpHead`); any checkpoint form (module doc)."""
        return super().split_mtp(text_weights(weights))


class Model(SplitModel):
    """The causal LM: implements `models.base.CausalLM` (the Qwen3-Next model
    with `SplitGatedDeltaNet` linear layers and dense MLPs; see the module
    doc)."""

    def __init__(self, args: HybridArgs) -> None:
        if args.num_experts:
            raise ValueError(
                "Qwen3.5 dense has no experts (parse its config with hybrid_args)"
            )
        super().__init__(args)


def text_weights(weights: Mapping[str, mx.array]) -> dict[str, mx.array]:
    """The text model's weights under its own names: multimodal prefixes
    mapped, vision-tower weights dropped. Text-form names pass unchanged."""
    out: dict[str, mx.array] = {}
    for key, value in weights.items():
        if key.startswith(VISION_PREFIXES):
            continue
        for prefix, replacement in _TEXT_PREFIXES:
            if key.startswith(prefix):
                key = replacement + key[len(prefix) :]
                break
        out[key] = value
    return out
