"""Qwen3-Next (`model_type` `qwen3_next`): a hybrid of gated full attention
and GatedDeltaNet linear attention, with sparse MoE blocks.

Notable:
- `layer_types` picks each layer's token mixer: "full_attention" (gated
  GQA, per-head q/k RMSNorm, RoPE on the first `partial_rotary_factor` of
  each head) or "linear_attention" (models/gated_delta.py). The attention
  output is multiplied by sigmoid(gate), the gate coming from the second half
  of each head's q_proj output.
- Every layer's MLP is a sparse MoE block (softmax router, top-k, optional
  renormalisation, plus a shared expert scaled by sigmoid(shared_expert_gate))
  or, where `mlp_only_layers` / `decoder_sparse_step` say so, a dense SwiGLU.
- Zero-centred RMSNorm: HF stores these norms' weights as offsets from 1
  (`x_hat * (1 + w)`). This module stores `1 + w` (the MLX convention, as
  mlx-lm's converted checkpoints do) and `sanitize` adds the 1 to HF weights.
  The gated norm inside the linear layers is an ordinary RMSNorm in both.
- Recurrent layers cannot roll back by position, so a forward returns a
  `HybridDelta` (models/hybrid_cache.py) and `padding_safe` is False.
- `mtp.*` weights (the multi-token-prediction head, models/mtp.py) are kept
  out of this model; `split_mtp` returns them apart.
Reference: transformers `models/qwen3_next/modeling_qwen3_next.py`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence

import mlx.core as mx
import mlx.nn as nn

from models import cpu_kernel
from models.base import (
    Mask,
    ModelOutput,
    RoPE,
    Tapping,
    args_as,
    attention_mask,
    rope_offset,
)
from models.cache import KVWrite, kv_cache, kv_quantization
from models.fuse import FusedProjection, fuse, fused_or_none, split_last
from models.gated_delta import GatedDeltaMixer, GatedDeltaNet
from models.hybrid_cache import HybridCache, HybridDelta, WindowStates
from models.layers import MLP, AttentionBlock, HeadedLM, PreNormLayer, model_dtype
from models.parallel import (
    Embedding,
    Linear,
    cpu_threads,
    dequantized,
    other_groups,
)
from schemas.hf_hybrid import LINEAR_ATTENTION, HybridArgs

# Windows up to this length keep the recurrent state after every position
# (verify windows); longer ones and prefill chunks (`prefill=True`: at 64
# tokens, 2 MB per position per linear layer of Qwen3-Next's shape, per row)
# keep only the final state.
PER_POSITION_MAX = 64


class GatedAttention(nn.Module):
    """Grouped-query attention with a sigmoid output gate, per-head q/k norm
    and partial RoPE, over the shared KV cache (slot `kv_index`)."""

    def __init__(self, args: HybridArgs, kv_index: int) -> None:
        super().__init__()
        self.kv_index = kv_index
        self.heads = args.num_attention_heads
        self.kv_heads = args.num_key_value_heads
        self.head_dim = args.dim_per_head
        self.scale = self.head_dim**-0.5
        hidden, bias = args.hidden_size, args.attention_bias
        self.q_proj = Linear(hidden, 2 * self.heads * self.head_dim, bias=bias)
        self.k_proj = Linear(hidden, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(hidden, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.heads * self.head_dim, hidden, bias=bias)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
        self.rope = RoPE(args.rotary_dims, args.rope)
        self._qkv: FusedProjection | None = None

    def fuse_projections(self) -> bool:
        """Run q(+gate), k and v as one product from now on (models/fuse.py)."""
        self._qkv = fuse((self.q_proj, self.k_proj, self.v_proj))
        return self._qkv is not None

    def attend(
        self,
        x: mx.array,  # [B, L, H]
        write: KVWrite,  # stores the window's keys/values (KVCache.write, scatter_window)
        mask: Mask,  # None, "causal" or [B, 1, L, S]
        rope_at: int | mx.array,  # scalar or [B]
    ) -> mx.array:  # [B, L, H]
        """The layer with its window's keys/values stored by `write` (its one
        entry point: AttentionLayer passes the cache's write, the MTP head's
        compiled step a scatter at device-valued positions)."""
        batch, length, _ = x.shape
        d = self.head_dim
        fused = fused_or_none(self._qkv, (self.q_proj, self.k_proj, self.v_proj))
        if fused is None:
            qg, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        else:
            qg, k, v = split_last(fused(x), fused.sizes)
        # q_proj holds, per head, the query then the gate: [B, L, Hq, 2D]
        q_gate = qg.reshape(batch, length, self.heads, 2 * d)
        gate = q_gate[..., d:].reshape(batch, length, self.heads * d)
        q = self.q_norm(q_gate[..., :d])
        k = self.k_norm(k.reshape(batch, length, self.kv_heads, d))
        v = v.reshape(batch, length, self.kv_heads, d)
        q = self.rope(q.transpose(0, 2, 1, 3), rope_at)  # [B, Hq, L, D]
        k = self.rope(k.transpose(0, 2, 1, 3), rope_at)  # [B, Hkv, L, D]
        keys, values = write(k, v.transpose(0, 2, 1, 3))
        out = mx.fast.scaled_dot_product_attention(
            q, keys, values, scale=self.scale, mask=mask
        )  # [B, Hq, L, D]
        out = out.transpose(0, 2, 1, 3).reshape(batch, length, -1)
        return self.o_proj(out * mx.sigmoid(gate))


class SwitchLinear(nn.Module):
    """Per-expert linear maps, stacked: weight [E, O, I]."""

    def __init__(self, input_dims: int, output_dims: int, experts: int) -> None:
        super().__init__()
        scale = input_dims**-0.5
        self.weight = mx.random.uniform(
            -scale, scale, (experts, output_dims, input_dims)
        )

    def __call__(
        self,
        x: mx.array,  # [..., 1, I]
        experts: mx.array,  # [...] int, broadcast against x's batch axes
        sorted_experts: bool = False,
        float32: bool = False,
    ) -> mx.array:  # [..., 1, O]
        weight = self.weight.astype(mx.float32) if float32 else self.weight
        return mx.gather_mm(
            x,
            weight.swapaxes(-1, -2),
            rhs_indices=experts,
            sorted_indices=sorted_experts,
        )

    def taken(
        self,
        x: mx.array,  # [N, 1, 1, I]
        experts: mx.array,  # [N, k] int
    ) -> mx.array:  # [N, k, 1, O]
        """The same map through gathered weight copies [N, k, O, I]."""
        return x @ mx.take(self.weight, experts, axis=0).swapaxes(-1, -2)

    def to_quantized(
        self, group_size: int = 64, bits: int = 4, mode: str = "affine"
    ) -> QuantizedSwitchLinear:
        """For `nn.quantize` (MLX affine, per expert and output row); in
        groups `mx.quantize` does not take (a GGUF's K types' 16), a layer
        of placeholder arrays for a checkpoint's to replace."""
        assert mode == "affine", "experts quantize MLX affine only"
        experts, output_dims, input_dims = self.weight.shape
        out = QuantizedSwitchLinear(input_dims, output_dims, experts, group_size, bits)
        if other_groups(group_size):
            return out
        out.weight, out.scales, out.biases = mx.quantize(
            self.weight, group_size=group_size, bits=bits
        )
        return out


class QuantizedSwitchLinear(nn.Module):
    """`SwitchLinear` with MLX affine weights: weight [E, O, I * bits / 32]
    uint32, scales and biases [E, O, I / group_size]."""

    def __init__(
        self,
        input_dims: int,
        output_dims: int,
        experts: int,
        group_size: int = 64,
        bits: int = 4,
    ) -> None:
        super().__init__()
        self.group_size = group_size
        self.bits = bits
        packed, groups = input_dims * bits // 32, input_dims // group_size
        self.weight = mx.zeros((experts, output_dims, packed), dtype=mx.uint32)
        self.scales = mx.zeros((experts, output_dims, groups))
        self.biases = mx.zeros((experts, output_dims, groups))

    def __call__(
        self,
        x: mx.array,  # [..., 1, I]
        experts: mx.array,  # [...] int
        sorted_experts: bool = False,
        float32: bool = False,
    ) -> mx.array:  # [..., 1, O]
        if cpu_kernel.affine_usable(
            self.weight, self.bits, self.group_size, "affine", stacked=True
        ):  # each expert row used unpacked once (MLX's CPU product: per row)
            out = cpu_kernel.affine_gather_product(
                x,
                self.weight,
                self.scales,
                self.biases,
                experts,
                self.bits,
                self.group_size,
                cpu_threads(),
            )
            if out is not None:
                return out
        if other_groups(self.group_size):
            # (K types' groups of 16 off the kernel: the chosen experts'
            # weights expanded, the products in float32 as the kernel's)
            weights = dequantized(
                self.weight[experts],
                self.scales[experts],
                self.biases[experts],
                self.group_size,
                self.bits,
            )  # [..., O, I]
            y32 = x.astype(mx.float32) @ weights.swapaxes(-1, -2)
            return y32.astype(x.dtype)
        # gather_qmm computes in the activation dtype on every device
        return mx.gather_qmm(
            x,
            self.weight,
            self.scales,
            self.biases,
            rhs_indices=experts,
            transpose=True,
            group_size=self.group_size,
            bits=self.bits,
            sorted_indices=sorted_experts,
        )


class SwitchGLU(nn.Module):
    """The routed experts: a gated MLP per expert (SwiGLU; `activation`
    another gate, e.g. Gemma-4's GeGLU), applied to each token's top-k.

    MLX's CPU `gather_mm` computes in float32 only. On the CPU, float experts
    of other dtypes take the selected experts' weights (when there are no more
    (token, expert) pairs than experts: decode and verify windows) or cast the
    stacked weights to float32 (prefill). Quantized experts (`gather_qmm`;
    on the CPU the affine kernel, `QuantizedSwitchLinear`) need neither."""

    # Above this many (token, expert) pairs, group the pairs by expert first
    # so the gathered matmuls read each expert's weights once.
    SORT_MIN = 64

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        experts: int,
        activation: Callable[[mx.array], mx.array] = nn.silu,
    ) -> None:
        super().__init__()
        self.experts = experts
        self.activation = activation
        self.gate_proj: SwitchLinear | QuantizedSwitchLinear = SwitchLinear(
            hidden, intermediate, experts
        )
        self.up_proj: SwitchLinear | QuantizedSwitchLinear = SwitchLinear(
            hidden, intermediate, experts
        )
        self.down_proj: SwitchLinear | QuantizedSwitchLinear = SwitchLinear(
            intermediate, hidden, experts
        )

    def _expert_mlp(
        self, x: mx.array, experts: mx.array, sorted_experts: bool, float32: bool
    ) -> mx.array:
        gate = self.gate_proj(x, experts, sorted_experts, float32)
        up = self.up_proj(x, experts, sorted_experts, float32)
        return self.down_proj(
            self.activation(gate) * up, experts, sorted_experts, float32
        )

    def __call__(
        self,
        x: mx.array,  # [N, H]
        experts: mx.array,  # [N, k] int32
    ) -> mx.array:  # [N, k, H]
        tokens, top_k = experts.shape
        hidden = x.shape[-1]
        pairs = tokens * top_k
        gate_proj, up_proj, down_proj = self.gate_proj, self.up_proj, self.down_proj
        float32 = (
            x.dtype != mx.float32
            and mx.default_device() == mx.cpu
            and isinstance(gate_proj, SwitchLinear)
        )
        if float32 and pairs <= self.experts:
            assert isinstance(gate_proj, SwitchLinear)
            assert isinstance(up_proj, SwitchLinear)
            assert isinstance(down_proj, SwitchLinear)
            rows = x[:, None, None, :]
            gate = gate_proj.taken(rows, experts)
            up = up_proj.taken(rows, experts)
            out = down_proj.taken(self.activation(gate) * up, experts)
            return out.reshape(tokens, top_k, hidden)
        dtype = x.dtype
        if float32:
            x = x.astype(mx.float32)
        if pairs < self.SORT_MIN:
            out = self._expert_mlp(x[:, None, None, :], experts, False, float32)
            return out.reshape(tokens, top_k, hidden).astype(dtype)
        flat = experts.reshape(-1)
        order = mx.argsort(flat)
        # [N*k, 1, H] by reshape, not `[:, None, :]`: MLX 0.32's CUDA
        # gather_mm with sorted indices misreads an lhs whose unit axis is
        # an inserted view axis (wrong products, not rounding: bench/gather_probe.py)
        rows = x[order // top_k].reshape(pairs, 1, hidden)
        out = self._expert_mlp(rows, flat[order], True, float32).reshape(-1, hidden)
        return out[mx.argsort(order)].reshape(tokens, top_k, hidden).astype(dtype)


class SparseMoeBlock(nn.Module):
    def __init__(self, args: HybridArgs) -> None:
        super().__init__()
        self.top_k = args.num_experts_per_tok
        self.norm_topk_prob = args.norm_topk_prob
        hidden = args.hidden_size
        self.gate = Linear(hidden, args.num_experts, bias=False)
        self.switch_mlp = SwitchGLU(
            hidden, args.moe_intermediate_size, args.num_experts
        )
        self.shared_expert = MLP(hidden, args.shared_expert_intermediate_size, False)
        self.shared_expert_gate = Linear(hidden, 1, bias=False)

    def __call__(self, x: mx.array) -> mx.array:  # [B, L, H] -> [B, L, H]
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])  # [N, H]
        probs = mx.softmax(self.gate(tokens).astype(mx.float32), axis=-1)  # [N, E]
        k = self.top_k
        experts = mx.argpartition(-probs, kth=k - 1, axis=-1)[:, :k]  # [N, k]
        weights = mx.take_along_axis(probs, experts, axis=-1)  # [N, k]
        if self.norm_topk_prob:
            weights = weights / weights.sum(axis=-1, keepdims=True)
        routed = self.switch_mlp(tokens, experts.astype(mx.int32))  # [N, k, H]
        routed = (routed * weights.astype(x.dtype)[..., None]).sum(axis=1)
        shared = mx.sigmoid(self.shared_expert_gate(tokens)) * self.shared_expert(
            tokens
        )
        return (routed + shared).reshape(shape)


def make_mlp(args: HybridArgs, layer: int) -> SparseMoeBlock | MLP:
    if args.is_sparse(layer):
        return SparseMoeBlock(args)
    return MLP(args.hidden_size, args.intermediate_size, False)


class AttentionLayer(AttentionBlock):
    """A full-attention decoder layer (also the MTP head's layer):
    `GatedAttention`, then the layer's MLP."""

    def __init__(self, args: HybridArgs, layer: int, kv_index: int) -> None:
        super().__init__(args.hidden_size, args.rms_norm_eps)
        self.self_attn = GatedAttention(args, kv_index)
        self.mlp = make_mlp(args, layer)


class LinearLayer(PreNormLayer):
    """A GatedDeltaNet decoder layer; state slot `linear_index` of the cache.
    `mixer` picks the projection layout (Qwen3-Next's fused one by default)."""

    def __init__(
        self,
        args: HybridArgs,
        layer: int,
        linear_index: int,
        mixer: type[GatedDeltaMixer] = GatedDeltaNet,
    ) -> None:
        super().__init__(args.hidden_size, args.rms_norm_eps)
        self.linear_index = linear_index
        self.linear_attn = mixer(args)
        self.mlp = make_mlp(args, layer)

    def __call__(
        self, x: mx.array, cache: HybridCache, per_position: bool
    ) -> tuple[mx.array, WindowStates]:  # [B, L, H], this layer's window states
        i = self.linear_index
        mixed, states = self.linear_attn(
            self.input_layernorm(x), cache.conv[i], cache.recurrent[i], per_position
        )
        h = x + mixed
        return h + self.mlp(self.post_attention_layernorm(h)), states


class Qwen3NextModel(nn.Module):
    """Embedding, layers and the final norm (applied by `Model.lm_head`)."""

    def __init__(
        self, args: HybridArgs, mixer: type[GatedDeltaMixer] = GatedDeltaNet
    ) -> None:
        super().__init__()
        self.embed_tokens: nn.Embedding | nn.QuantizedEmbedding = Embedding(
            args.vocab_size, args.hidden_size
        )
        self.layers: list[AttentionLayer | LinearLayer] = []
        linear = attention = 0
        for i, kind in enumerate(args.layer_types):
            if kind == LINEAR_ATTENTION:
                self.layers.append(LinearLayer(args, i, linear, mixer))
                linear += 1
            else:
                self.layers.append(AttentionLayer(args, i, attention))
                attention += 1
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(
        self,
        ids: mx.array,  # [B, L] int32
        cache: HybridCache,
        offsets: Sequence[int],
        prefill: bool = False,
        taps: Sequence[int] = (),
        tapped: list[mx.array] | None = None,
    ) -> tuple[mx.array, list[WindowStates]]:  # [B, L, H] before the final norm
        """The last layer's output and the linear layers' window states; the
        outputs of layers `taps` appended to `tapped` in that order."""
        batch, length = ids.shape
        assert len(offsets) == batch, "one offset per row"
        cache.reserve(max(offsets) + length)
        mask = attention_mask(offsets, length, cache.kv.key_span(offsets, length))
        rope_at = rope_offset(offsets)
        # a prefill chunk keeps all of itself: only the final state is needed
        per_position = not prefill and length <= PER_POSITION_MAX
        windows: list[WindowStates] = []
        h = self.embed_tokens(ids)
        outputs: dict[int, mx.array] = {}
        for i, layer in enumerate(self.layers):
            if isinstance(layer, LinearLayer):
                h, states = layer(h, cache, per_position)
                windows.append(states)
            else:
                h = layer(h, cache.kv, offsets, mask, rope_at)
            if i in taps:
                outputs[i] = h
        if tapped is not None:
            tapped.extend(outputs[i] for i in taps)
        return h, windows


class Model(HeadedLM, Tapping):
    """The causal LM: implements `models.base.CausalLM` (its `args` the
    protocol's type, always a HybridArgs here: see `hybrid`)."""

    padding_safe = False
    model: Qwen3NextModel

    def __init__(
        self, args: HybridArgs, mixer: type[GatedDeltaMixer] = GatedDeltaNet
    ) -> None:
        super().__init__(args, Qwen3NextModel(args, mixer))

    def __call__(
        self,
        ids: mx.array,  # [B, L] int32
        cache: HybridCache,
        offsets: Sequence[int],
        *,
        prefill: bool = False,
    ) -> ModelOutput:
        tapped: list[mx.array] = []
        hidden, windows = self.model(ids, cache, offsets, prefill, self.taps, tapped)
        delta = HybridDelta(
            cache, ids.shape[1], self.hybrid.linear_conv_kernel_dim, windows
        )
        return ModelOutput(
            logits=self.lm_head(hidden),
            hidden=hidden,
            delta=delta,
            features=self.features(tapped),
        )

    @property
    def hybrid(self) -> HybridArgs:
        return args_as(self.args, HybridArgs, "qwen3_next")

    def make_cache(self, batch: int) -> HybridCache:
        args = self.hybrid
        dtype = model_dtype(self)
        kv = kv_cache(
            len(args.attention_layers),
            batch,
            args.num_key_value_heads,
            args.dim_per_head,
            dtype,
            kv_quantization(self),
        )
        channels = (
            2 * args.linear_num_key_heads * args.linear_key_head_dim
            + args.linear_num_value_heads * args.linear_value_head_dim
        )
        conv_shape = (batch, args.linear_conv_kernel_dim - 1, channels)
        state_shape = (
            batch,
            args.linear_num_value_heads,
            args.linear_key_head_dim,
            args.linear_value_head_dim,
        )
        linear = len(args.linear_layers)
        return HybridCache(
            kv,
            [mx.zeros(conv_shape, dtype) for _ in range(linear)],
            [mx.zeros(state_shape, mx.float32) for _ in range(linear)],
        )

    def sanitize(self, weights: Mapping[str, mx.array]) -> dict[str, mx.array]:
        """HF / MLX checkpoint names -> this model's parameter names (no `mtp.*`)."""
        return self.split_mtp(weights)[0]

    def split_mtp(
        self, weights: Mapping[str, mx.array]
    ) -> tuple[dict[str, mx.array], dict[str, mx.array]]:
        """Sanitized weights of this model, and of the MTP head (`mtp.` removed,
        names as in `models.mtp.MtpHead`)."""
        named = sanitize_weights(weights, self.hybrid.num_experts)
        main = {k: v for k, v in named.items() if not k.startswith("mtp.")}
        mtp = {k[4:]: v for k, v in named.items() if k.startswith("mtp.")}
        if self.args.tie_word_embeddings:
            # HF state dicts of tied models still list the shared tensor.
            main.pop("lm_head.weight", None)
        return main, mtp


# Norms HF stores as offsets from 1 (zero-centred); the linear layers' gated
# norm (`linear_attn.norm`) is not one of them.
_ZERO_CENTRED = re.compile(
    r"(input_layernorm|post_attention_layernorm|q_norm|k_norm|"
    r"pre_fc_norm_embedding|pre_fc_norm_hidden)\.weight$|(^model|^mtp)\.norm\.weight$"
)
_EXPERT = re.compile(
    r"^(.*\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$"
)


def is_hf_layout(weights: Mapping[str, mx.array]) -> bool:
    """Whether weights come from an HF checkpoint / state dict rather than an
    MLX conversion: the conv weight is [C, 1, K] (MLX: [C, K, 1]) or experts
    are listed under `mlp.experts` (MLX: stacked under `mlp.switch_mlp`)."""
    return any(
        (k.endswith("conv1d.weight") and v.ndim == 3 and v.shape[-1] != 1)
        or ".mlp.experts." in k
        for k, v in weights.items()
    )


def sanitize_weights(
    weights: Mapping[str, mx.array], num_experts: int
) -> dict[str, mx.array]:
    """HF -> MLX conventions for every `qwen3_next` weight (MTP included):
    conv layout, +1 on zero-centred norms, experts stacked per projection.
    MLX-converted weights pass unchanged."""
    out = {k: v for k, v in weights.items() if not k.endswith("rotary_emb.inv_freq")}
    if not is_hf_layout(out):
        return out
    experts: dict[tuple[str, str], dict[int, mx.array]] = {}
    for key in list(out):
        value = out[key]
        if key.endswith("conv1d.weight") and value.shape[-1] != 1:
            out[key] = value.swapaxes(1, 2)  # [C, 1, K] -> [C, K, 1]
        elif _ZERO_CENTRED.search(key) and value.ndim == 1:
            out[key] = value + 1.0
        else:
            take_expert(out, key, experts)
    stack_experts(out, experts, num_experts)
    return out


def take_expert(
    out: dict[str, mx.array],
    key: str,
    listed: dict[tuple[str, str], dict[int, mx.array]],
) -> None:
    """An HF expert weight at `key` of `out` under MLX's `switch_mlp` names:
    one expert's projection moved to `listed` (per (MoE prefix, projection),
    by expert index) for `stack_experts`; transformers 5's stacked
    `experts.gate_up_proj` ([E, 2I, H], gate rows first) split, and its
    `experts.down_proj` renamed. Other keys stay."""
    if match := _EXPERT.match(key):
        prefix, index, name = match.groups()
        listed.setdefault((prefix, name), {})[int(index)] = out.pop(key)
    elif key.endswith(".mlp.experts.gate_up_proj"):
        value = out.pop(key)
        prefix = key[: -len(".experts.gate_up_proj")]
        half = value.shape[1] // 2
        out[f"{prefix}.switch_mlp.gate_proj.weight"] = value[:, :half]
        out[f"{prefix}.switch_mlp.up_proj.weight"] = value[:, half:]
    elif key.endswith(".mlp.experts.down_proj"):
        prefix = key[: -len(".experts.down_proj")]
        out[f"{prefix}.switch_mlp.down_proj.weight"] = out.pop(key)


def stack_experts(
    out: dict[str, mx.array],
    listed: dict[tuple[str, str], dict[int, mx.array]],
    experts: int,
) -> None:
    """`take_expert`'s per-expert weights stacked per projection into `out`;
    a projection missing some of the `experts` is left under its own names,
    for the strict loader to report."""
    for (prefix, name), per_expert in listed.items():
        if sorted(per_expert) != list(range(experts)):
            out.update(
                {
                    f"{prefix}.experts.{e}.{name}.weight": w
                    for e, w in per_expert.items()
                }
            )
            continue
        stacked = mx.stack([per_expert[e] for e in range(experts)])
        out[f"{prefix}.switch_mlp.{name}.weight"] = stacked
