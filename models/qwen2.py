"""Qwen2 (Qwen2.5, Qwen2.5-Coder): llama with biases on q, k and v.

The biases are unconditional (transformers hard-codes them; the config has no
flag), o_proj and the MLP have none. Small checkpoints tie the embeddings.
Sliding-window attention (`use_sliding_window`) is off in every released
Qwen2.5 checkpoint and is not implemented.
Reference: transformers `models/qwen2/modeling_qwen2.py`.
"""

from __future__ import annotations

from models import llama
from models.layers import BlockSpec
from schemas.hf import DecoderArgs


class Model(llama.Model):
    @staticmethod
    def block_spec(args: DecoderArgs) -> BlockSpec:
        return BlockSpec(qkv_bias=True)
