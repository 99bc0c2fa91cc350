"""Qwen3 (dense): llama with a per-head RMSNorm on q and k before RoPE.

`head_dim` is explicit in the config and need not equal hidden / heads.
Projections carry biases only when `attention_bias` is set (never in released
checkpoints); the MLP has none.
Reference: transformers `models/qwen3/modeling_qwen3.py`.
"""

from __future__ import annotations

from models import llama
from models.layers import BlockSpec
from schemas.hf import DecoderArgs


class Model(llama.Model):
    @staticmethod
    def block_spec(args: DecoderArgs) -> BlockSpec:
        return BlockSpec(
            qkv_bias=args.attention_bias,
            o_bias=args.attention_bias,
            qk_norm=True,
        )
