"""The vocabulary projection as plain arrays, and its row subsets (FR-Spec).

Affine quantization packs along the input axis, so gathering rows of a
quantized head (weights, scales, biases alike) is exact: a subset head's
logits equal the full head's logits at those ids, bit for bit. A head whose
model caps its logits (Gemma-4's `final_logit_softcapping`: c * tanh(z / c))
carries the cap and applies it in `project`; the cap is per logit, so the
subset's capped logits are the full head's at those ids too.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from attrs import frozen

from models.parallel import project


@frozen
class HeadWeights:
    weight: mx.array  # [V, H] float, or [V, H * bits / 32] uint32 when quantized
    scales: mx.array | None = None  # [V, H / group]
    biases: mx.array | None = None  # [V, H / group]
    group_size: int = 64
    bits: int = 0  # 0: not quantized
    softcap: float | None = None  # logits c * tanh(z / c); None: as projected

    @classmethod
    def of(cls, module: nn.Module) -> HeadWeights:
        """From a Linear, QuantizedLinear, Embedding or QuantizedEmbedding."""
        if isinstance(module, nn.QuantizedLinear | nn.QuantizedEmbedding):
            return cls(
                module.weight,
                module.scales,
                module.biases,
                module.group_size,
                module.bits,
            )
        assert isinstance(module, nn.Linear | nn.Embedding)
        return cls(module.weight)

    @property
    def rows(self) -> int:
        return int(self.weight.shape[0])

    def take(self, ids: mx.array) -> HeadWeights:  # ids [N] int32, ascending
        def rows(a: mx.array | None) -> mx.array | None:
            return None if a is None else mx.take(a, ids, axis=0)

        taken = mx.take(self.weight, ids, axis=0)
        return HeadWeights(
            taken,
            rows(self.scales),
            rows(self.biases),
            self.group_size,
            self.bits,
            self.softcap,
        )

    def project(self, normed: mx.array) -> mx.array:  # [..., H] -> [..., N]
        logits = project(
            normed,
            self.weight,
            self.scales,
            self.biases,
            group_size=self.group_size,
            bits=self.bits,
        )
        return logits if self.softcap is None else softcapped(logits, self.softcap)


def softcapped(logits: mx.array, cap: float) -> mx.array:
    """cap * tanh(logits / cap), in the logits' dtype (transformers' order)."""
    return mx.tanh(logits / cap) * cap
