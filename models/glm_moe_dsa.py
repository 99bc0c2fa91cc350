"""GLM-5 (`model_type` `glm_moe_dsa`): GLM-4.5's MoE decoder with DeepSeek's
multi-head latent attention (MLA) restricted by DeepSeek Sparse Attention
(DSA): per query, an indexer picks the `index_topk` positions the heads
attend to.

Notable:
- MLA: queries through a low-rank bottleneck, q_b_proj(q_a_layernorm(
  q_a_proj(x))), per head [qk_nope_head_dim | qk_rope_head_dim]. Keys and
  values come from one latent per position: kv_a_proj_with_mqa(x) =
  [kv_lora_rank latent | qk_rope_head_dim rotated part]; the latent, after
  kv_a_layernorm, expands through kv_b_proj into per-head
  [k_nope | values (v_head_dim)], and every head's key is [k_nope | the
  shared rotated part]. Softmax scale qk_head_dim**-0.5 (only "default"
  RoPE is accepted, so never yarn's mscale). The two low-rank norms have
  eps 1e-6 whatever `rms_norm_eps` says.
- RoPE is interleaved (pairs (x0, x1), (x2, x3), ...: `mx.fast.rope`'s
  traditional layout) over the rotated part. transformers writes each
  rotated vector de-interleaved (evens, then odds); queries and keys are
  permuted alike, so every dot product, and the output, is the same.
- The cache (models/cache.py's `KVCache`, one "head" per layer, head_dim =
  kv_lora_rank + qk_rope_head_dim): the keys buffer holds each position's
  [normed latent | rotated key part]; the values buffer holds the layer's
  indexer key for that position (index_head_dim values, zero-padded; zeros
  on layers without an indexer). Keys and values are expanded from the
  latents at attention time. Positions are overwritten, never appended, so
  rollback is by position and `padding_safe` is True.
- DSA indexer (`self_attn.indexer`, on layers whose `indexer_types` entry is
  "full"): queries wq_b(q_resid) (q_resid: the q_a_layernorm output), one
  key per position LayerNorm(wk(x)) (a LayerNorm with bias, eps 1e-6), both
  interleaved-RoPE'd on their first qk_rope_head_dim dimensions. A
  position's score is sum over heads of relu(q.k) * index_head_dim**-0.5 *
  weights_proj(x) * index_n_heads**-0.5, in float32; causally masked, the
  best `index_topk` positions per query (all, when there are no more) are
  those the query attends. "shared" layers attend under the selection of
  the last full layer before them in the same forward (`Selection`).
- The MLPs: GLM-4.5's (models/glm4_moe.py): dense SwiGLU on the layers
  `mlp_layer_types` calls dense (by default the first
  `first_k_dense_replace`), the sigmoid-routed MoE block with shared experts
  on the rest. Ordinary RMSNorms; a tied or untied head per
  `tie_word_embeddings`.

Checkpoint names are the reference's state dict's
(`self_attn.{q_a_proj,q_a_layernorm,q_b_proj,kv_a_proj_with_mqa,
kv_a_layernorm,kv_b_proj,o_proj}`, `self_attn.indexer.{wq_b,wk,k_norm,
weights_proj}`), the experts in the three forms glm4_moe's `sanitize_weights`
stacks. A checkpoint's MTP layer (`model.layers.{num_hidden_layers}.*`) is
not part of this model: `split_mtp` returns it apart, `sanitize` drops it;
models/glm_mtp.py's `GlmDsaMtpHead` runs it as the native MTP draft.
Reference: transformers `models/glm_moe_dsa/modeling_glm_moe_dsa.py` (built
on `deepseek_v32` and `deepseek_v3`).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import cast

import mlx.core as mx
import mlx.nn as nn
from attrs import evolve

from models import glm4_moe
from models.base import Mask, RoPE, args_as, refuse, run_stack
from models.cache import KVCache, KVWrite, position_mask
from models.fuse import FusedProjection, fuse, fused_or_none
from models.layers import PreNormLayer, model_dtype
from models.llama import Backbone
from models.parallel import Linear
from schemas.hf_glm_moe_dsa import GlmMoeDsaArgs, layout_problem

# the eps transformers gives the low-rank RMSNorms and the indexer's LayerNorm
_LOW_RANK_EPS = 1e-6


class Selection:
    """The attention mask the last "full" layer of a forward chose (its causal
    mask restricted to the indexer's positions), for the "shared" layers
    after it. One per forward: every layer sees the same window and span."""

    def __init__(self) -> None:
        self.mask: Mask = None
        self.made = False


class Indexer(nn.Module):
    """DSA's lightning indexer: which positions each query attends to."""

    def __init__(self, args: GlmMoeDsaArgs) -> None:
        super().__init__()
        self.heads = args.index_n_heads
        self.head_dim = args.index_head_dim
        self.top_k = args.index_topk
        self.scale = self.head_dim**-0.5
        self.wq_b = Linear(args.q_lora_rank, self.heads * self.head_dim, bias=False)
        self.wk = Linear(args.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=_LOW_RANK_EPS)
        self.weights_proj = Linear(args.hidden_size, self.heads, bias=False)

    def key_window(
        self,
        x: mx.array,  # [B, L, H]
        rope: RoPE,
        rope_at: int | mx.array,
    ) -> mx.array:  # [B, 1, L, index_head_dim]
        """The window's indexer keys, normed and rotated (what the cache holds)."""
        return rope(self.k_norm(self.wk(x))[:, None], rope_at)

    def select(
        self,
        x: mx.array,  # [B, L, H]
        q_resid: mx.array,  # [B, L, q_lora_rank]
        keys: mx.array,  # [B, 1, S, index_head_dim], every attended position's
        allowed: mx.array,  # [B or 1, 1, L, S] bool, the causal mask
        rope: RoPE,
        rope_at: int | mx.array,
    ) -> mx.array:  # [B, 1, L, S] bool
        """`allowed` restricted to each query's `top_k` best-scored positions
        (call only when there are more than `top_k` positions)."""
        batch, length, _ = x.shape
        q = self.wq_b(q_resid).reshape(batch, length, self.heads, self.head_dim)
        q = rope(q.transpose(0, 2, 1, 3), rope_at)  # [B, Hi, L, Di]
        logits = q.astype(mx.float32) @ keys.astype(mx.float32).swapaxes(-1, -2)
        per_head = mx.maximum(logits * self.scale, 0.0)  # [B, Hi, L, S]
        weights = self.weights_proj(x).astype(mx.float32) * self.heads**-0.5
        # [B, L, 1, Hi] @ [B, L, Hi, S]: the heads' weighted sum per query
        scores = (weights[:, :, None, :] @ per_head.transpose(0, 2, 1, 3))[:, :, 0]
        scores = mx.where(allowed[:, 0], scores, -mx.inf)  # [B, L, S]
        k = self.top_k
        best = mx.argpartition(-scores, kth=k - 1, axis=-1)[..., :k]  # [B, L, k]
        chosen = mx.put_along_axis(
            mx.zeros(scores.shape, dtype=mx.bool_), best, mx.array(True), axis=-1
        )
        return allowed & chosen[:, None]


class LatentAttention(nn.Module):
    """Multi-head latent attention over the latent cache, restricted to the
    positions DSA selects (see the module doc for the cache layout)."""

    def __init__(
        self, args: GlmMoeDsaArgs, layer: int, kv_index: int | None = None
    ) -> None:
        super().__init__()
        # this layer's slot in the KV cache (an MTP layer's: its head's own)
        self.kv_index = layer if kv_index is None else kv_index
        self.heads = args.num_attention_heads
        self.nope_dim = args.qk_nope_head_dim
        self.rope_dim = args.qk_rope_head_dim
        self.qk_dim = args.qk_head_dim
        self.v_dim = args.v_head_dim
        self.rank = args.kv_lora_rank
        self.latent_dim = args.latent_dim
        self.scale = self.qk_dim**-0.5
        hidden, bias = args.hidden_size, args.attention_bias
        self.q_a_proj = Linear(hidden, args.q_lora_rank, bias=bias)
        self.q_a_layernorm = nn.RMSNorm(args.q_lora_rank, eps=_LOW_RANK_EPS)
        self.q_b_proj = Linear(args.q_lora_rank, self.heads * self.qk_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(hidden, self.latent_dim, bias=bias)
        self.kv_a_layernorm = nn.RMSNorm(self.rank, eps=_LOW_RANK_EPS)
        self.kv_b_proj = Linear(
            self.rank, self.heads * (self.nope_dim + self.v_dim), bias=False
        )
        self.o_proj = Linear(self.heads * self.v_dim, hidden, bias=bias)
        # interleaved pairs over the first `rope_dim` dims (the rest pass)
        self.rope = RoPE(self.rope_dim, evolve(args.rope, traditional=True))
        self.indexer: Indexer | None = None
        if args.runs_indexer(layer):
            self.indexer = Indexer(args)
        self._qkv_a: FusedProjection | None = None

    def fuse_projections(self) -> bool:
        """Run q_a and kv_a (both of x) as one product from now on
        (models/fuse.py)."""
        self._qkv_a = fuse((self.q_a_proj, self.kv_a_proj_with_mqa))
        return self._qkv_a is not None

    def _project_a(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """[B, L, H] -> the q bottleneck [B, L, q_lora_rank] and the KV
        latent with its rotary part [B, L, latent_dim], both before norms."""
        parts = (self.q_a_proj, self.kv_a_proj_with_mqa)
        fused = fused_or_none(self._qkv_a, parts)
        if fused is None:
            return self.q_a_proj(x), self.kv_a_proj_with_mqa(x)
        both = fused(x)
        split = both.shape[-1] - self.latent_dim
        return both[..., :split], both[..., split:]

    def attend(
        self,
        x: mx.array,  # [B, L, H]
        write: KVWrite,
        mask: Mask,  # None, "causal" or [B, 1, L, S]
        rope_at: int | mx.array,  # each row's first position: scalar or [B]
        selection: Selection | None = None,
    ) -> mx.array:  # [B, L, H]
        """The attention with the window's latents and indexer keys stored by
        `write` (the cache's write, `DecoderLayer.__call__`; a scatter at
        device-valued positions in a compiled MTP step), which returns every
        attended position's ([B, 1, S, latent_dim] both)."""
        batch, length, _ = x.shape
        q_low, kv_low = self._project_a(x)
        q_resid = self.q_a_layernorm(q_low)
        q = self.q_b_proj(q_resid).reshape(batch, length, self.heads, self.qk_dim)
        q = q.transpose(0, 2, 1, 3)  # [B, Hq, L, qk_dim]
        q_rot = self.rope(q[..., self.nope_dim :], rope_at)
        q = mx.concatenate([q[..., : self.nope_dim], q_rot], axis=-1)

        latent = self.kv_a_layernorm(kv_low[..., : self.rank])[:, None]
        k_rot = self.rope(kv_low[..., self.rank :][:, None], rope_at)
        window = mx.concatenate([latent, k_rot], axis=-1)  # [B, 1, L, latent_dim]
        if self.indexer is not None:
            index_keys = self.indexer.key_window(x, self.rope, rope_at)
            pad = self.latent_dim - index_keys.shape[-1]
            index_window = mx.pad(index_keys, [(0, 0), (0, 0), (0, 0), (0, pad)])
        else:
            index_window = mx.zeros_like(window)
        cached, cached_index = write(window, index_window)
        span = cached.shape[2]

        kv = self.kv_b_proj(cached[:, 0, :, : self.rank])  # [B, S, Hq*(nope+v)]
        kv = kv.reshape(batch, span, self.heads, -1).transpose(0, 2, 1, 3)
        shared_rot = cached[:, :, :, self.rank :]  # [B, 1, S, rope_dim]
        shape = (batch, self.heads, span, self.rope_dim)
        keys = mx.concatenate(
            [kv[..., : self.nope_dim], mx.broadcast_to(shared_rot, shape)], axis=-1
        )
        values = kv[..., self.nope_dim :]
        attended = self._attended(
            x, q_resid, cached_index, mask, rope_at, selection, span
        )
        out = mx.fast.scaled_dot_product_attention(
            q, keys, values, scale=self.scale, mask=attended
        )  # [B, Hq, L, v_dim]
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(batch, length, -1))

    def _attended(
        self,
        x: mx.array,
        q_resid: mx.array,
        cached_index: mx.array,  # [B, 1, S, latent_dim], indexer keys first
        mask: Mask,
        rope_at: int | mx.array,
        selection: Selection | None,
        span: int,
    ) -> Mask:
        """The mask the heads attend under: `mask` itself when the indexer
        would keep every position, else restricted to its choice; a shared
        layer's is `selection`'s."""
        if self.indexer is None:
            if selection is None or not selection.made:
                raise ValueError(
                    f"layer {self.kv_index} shares the DSA selection of an earlier "
                    "'full' layer (indexer_types), which this forward did not run"
                )
            return selection.mask
        chosen = mask
        if self.indexer.top_k < span:
            keys = cached_index[..., : self.indexer.head_dim]
            starts = (
                rope_at
                if isinstance(rope_at, mx.array)
                else mx.array([rope_at], dtype=mx.int32)
            )
            allowed = (
                mask
                if isinstance(mask, mx.array)
                else position_mask(starts, x.shape[1], span)
            )
            chosen = self.indexer.select(x, q_resid, keys, allowed, self.rope, rope_at)
        if selection is not None:
            selection.mask, selection.made = chosen, True
        return chosen


class DecoderLayer(PreNormLayer):
    """One GLM-5 decoder layer: latent attention, then the MLP (dense or MoE
    per `args.is_sparse(layer)`, models/glm4_moe.py's)."""

    def __init__(
        self, args: GlmMoeDsaArgs, layer: int, kv_index: int | None = None
    ) -> None:
        super().__init__(args.hidden_size, args.rms_norm_eps)
        self.self_attn = LatentAttention(args, layer, kv_index)
        self.mlp = glm4_moe.make_mlp(args, layer)

    def __call__(
        self,
        x: mx.array,  # [B, L, H]
        cache: KVCache,
        offsets: Sequence[int],
        mask: Mask,  # None, "causal" or [B, 1, L, S]
        rope_at: int | mx.array,  # scalar or [B]
        selection: Selection | None = None,
    ) -> mx.array:  # [B, L, H]
        """`selection` carries a full layer's DSA choice to the shared layers
        after it (needed by a shared layer; None: a full layer keeps its own)."""

        return self.forward(
            x, cache.writer(self.self_attn.kv_index, offsets), mask, rope_at, selection
        )

    def forward(
        self,
        x: mx.array,  # [B, L, H]
        write: KVWrite,
        mask: Mask,
        rope_at: int | mx.array,
        selection: Selection | None = None,
    ) -> mx.array:  # [B, L, H]
        """The layer with its latents stored by `write` (`LatentAttention.attend`)."""
        return self.residual(
            x,
            lambda n: self.self_attn.attend(n, write, mask, rope_at, selection),
            self.mlp,
        )


class GlmMoeDsaModel(Backbone):
    """GLM-5's backbone: its decoder layers, one `Selection` per forward."""

    def __init__(self, args: GlmMoeDsaArgs) -> None:
        super().__init__(
            args, [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        )

    def __call__(
        self,
        ids: mx.array,  # [B, L] int32
        cache: KVCache,
        offsets: Sequence[int],
        taps: Sequence[int] = (),
        tapped: list[mx.array] | None = None,
    ) -> mx.array:  # [B, L, H], before the final norm
        selection = Selection()
        layers = cast("list[DecoderLayer]", self.layers)
        bound = [partial(layer, selection=selection) for layer in layers]
        return run_stack(self.embed_tokens, bound, ids, cache, offsets, taps, tapped)


class Model(glm4_moe.MoeLM):
    """The causal LM: implements `models.base.CausalLM` (`sanitize` and
    `split_mtp` are GLM-4.5's: the checkpoint's MTP layer kept apart)."""

    def __init__(self, args: GlmMoeDsaArgs) -> None:
        refuse(layout_problem(args))
        super().__init__(args, GlmMoeDsaModel(args))

    @property
    def glm(self) -> GlmMoeDsaArgs:
        return args_as(self.args, GlmMoeDsaArgs, "glm_moe_dsa")

    def make_cache(self, batch: int) -> KVCache:
        """One latent "head" per layer: keys [normed latent | rotated key],
        values the indexer's keys (zero-padded)."""
        glm = self.glm
        return KVCache(
            glm.num_hidden_layers, batch, 1, glm.latent_dim, model_dtype(self)
        )
