"""Qwen3.5 MoE (`model_type` `qwen3_5_moe_text`, and `qwen3_5_moe`, the
multimodal wrapper run as a text model): Qwen3.5's linear-attention
projection layout with Qwen3-Next's sparse MoE blocks.

What differs from Qwen3.5 dense (models/qwen3_5.py), and nothing else does:
- Every layer's MLP is a sparse MoE block (models/qwen3_next.py
  `SparseMoeBlock`: softmax router, top-k, plus a shared expert scaled by
  sigmoid(shared_expert_gate)); there is no dense MLP. transformers'
  Qwen3_5Moe config has no `mlp_only_layers`, `decoder_sparse_step` or
  `norm_topk_prob` and its router always renormalises the top-k weights;
  schemas/hf_hybrid.py fixes `HybridArgs` accordingly.
- The MTP head's layer (`mtp.*`, models/mtp.py) has the same MoE block, as in
  vLLM's `Qwen3_5DecoderLayer` for `qwen3_5_moe_text`; `make_mlp` already
  picks it from `args`.
What differs from Qwen3-Next: only the split GatedDeltaNet projections
(`SplitGatedDeltaNet`) and the checkpoint forms below.

Checkpoint names: the Qwen3.5 forms (text `model.*`, multimodal
`model.language_model.*` with the vision tower dropped, MLX
`language_model.model.*`), mapped by `qwen3_5.text_weights`. Experts come as
transformers 5 stores them (`mlp.experts.gate_up_proj` [E, 2I, H], gate rows
first, and `mlp.experts.down_proj` [E, H, I]), as per-expert linears
(`mlp.experts.{e}.gate_proj.weight`, ...), or MLX-stacked
(`mlp.switch_mlp.{gate,up,down}_proj.weight`); `qwen3_next.sanitize_weights`
maps the first two onto the third, MTP layer included.
References: transformers `models/qwen3_5_moe/modular_qwen3_5_moe.py`; vLLM
`model_executor/models/qwen3_5.py` and `qwen3_5_mtp.py`.
"""

from __future__ import annotations

from models import qwen3_5
from schemas.hf_hybrid import HybridArgs


class Model(qwen3_5.SplitModel):
    """The causal LM: implements `models.base.CausalLM` (the Qwen3.5 model with
    a sparse MoE block in every layer; see the module doc)."""

    def __init__(self, args: HybridArgs) -> None:
        dense = [i for i in range(args.num_hidden_layers) if not args.is_sparse(i)]
        if dense:
            raise ValueError(
                f"Qwen3.5 MoE has experts in every layer (dense layers {dense}; "
                "parse its config with hybrid_args)"
            )
        super().__init__(args)
