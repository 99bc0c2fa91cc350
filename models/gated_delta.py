"""Gated DeltaNet: the linear-attention (recurrent) layer of Qwen3-Next and
Qwen3.5.

Per token, a depthwise causal conv (kernel K, SiLU) mixes the q, k, v
channels with the K-1 previous tokens' inputs; then, per value head h, the
gated delta rule updates a memory S of shape [Dk, Dv] (Yang et al., "Gated
Delta Networks", https://arxiv.org/abs/2412.06464):

    S_t = a_t * S_{t-1}                        a_t = exp(g_t), the decay
    S_t = S_t + k_t (beta_t (v_t - S_t^T k_t))^T   the delta-rule write
    o_t = S_t^T q_t

with q, k L2-normalised (q also scaled by Dk^-1/2),
g_t = -exp(A_log) * softplus(a_t + dt_bias) and beta_t = sigmoid(b_t).
The output is RMS-normalised per head, gated by SiLU(z), and projected.
Key heads are shared by `Hv / Hk` consecutive value heads.

The two model families differ only in the input projections: Qwen3-Next
fuses them per key head (`GatedDeltaNet` here), Qwen3.5 keeps four separate
ones (models/qwen3_5.py); `GatedDeltaMixer` is everything after them.

The layer never writes its committed states: it reads the conv state
[B, K-1, C] and the recurrent state [B, Hv, Dk, Dv] and returns the window's
states (see models/hybrid_cache.py), one per position for short windows, the
final one only for long prefill chunks. On a CUDA GPU those windows run
as one kernel (models/gated_delta_cuda.py); long prefill chunks take the
chunked form everywhere.
Reference: transformers `models/qwen3_next/modeling_qwen3_next.py`
(`Qwen3NextGatedDeltaNet`, `torch_recurrent_gated_delta_rule`).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from models.cache import cuda_backend, on_gpu
from models.gated_delta_cuda import window_recurrence
from models.hybrid_cache import WindowStates
from models.parallel import Linear
from schemas.hf_hybrid import HybridArgs


class GatedRMSNorm(nn.Module):
    """RMSNorm over the last axis, then a SiLU gate: `norm(x) * w * silu(z)`."""

    def __init__(self, dims: int, eps: float) -> None:
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x: mx.array, gate: mx.array) -> mx.array:
        normed = mx.fast.rms_norm(x, self.weight, self.eps)
        return (normed * nn.silu(gate.astype(mx.float32))).astype(x.dtype)


def l2_normalize(x: mx.array, eps: float = 1e-6) -> mx.array:
    """x / sqrt(sum(x^2) + eps) over the last axis (the FLA convention)."""
    return x * mx.rsqrt((x * x).sum(axis=-1, keepdims=True) + eps)


def _delta_step(
    state: mx.array,  # [B, Hv, Dk, Dv] f32
    q: mx.array,  # [B, Hv, Dk]
    k: mx.array,  # [B, Hv, Dk]
    v: mx.array,  # [B, Hv, Dv]
    decay: mx.array,  # [B, Hv], exp(g)
    beta: mx.array,  # [B, Hv]
) -> tuple[mx.array, mx.array]:  # output [B, Hv, Dv], state [B, Hv, Dk, Dv]
    state = state * decay[..., None, None]
    recalled = (state * k[..., None]).sum(axis=-2)  # S^T k: [B, Hv, Dv]
    write = (v - recalled) * beta[..., None]
    state = state + k[..., None] * write[..., None, :]
    return (state * q[..., None]).sum(axis=-2), state


# One fused graph per step shape: the step is elementwise work plus two
# reductions over Dk, memory-bound on the state.
delta_step = mx.compile(_delta_step)


# Windows without per-position states and at least this long run the
# chunked form (prefill); its chunk length, a power of two.
CHUNK = 64

# Whether a GPU runs the per-position recurrence as one CUDA kernel per
# window (models/gated_delta_cuda.py); benchmarks turn it off to compare.
WINDOW_KERNEL_ON_GPU = True


def uses_window_kernel(length: int, per_position: bool) -> bool:
    """Whether a window of `length` runs `window_recurrence` (CUDA) rather than
    the recurrence as MLX operations: on a CUDA GPU, for every window that
    does not take the chunked form."""
    return (
        WINDOW_KERNEL_ON_GPU
        and (per_position or length < CHUNK)
        and on_gpu()
        and cuda_backend()
    )


def gated_delta_rule(
    q: mx.array,  # [B, L, Hv, Dk] f32, normalised and scaled
    k: mx.array,  # [B, L, Hv, Dk] f32, normalised
    v: mx.array,  # [B, L, Hv, Dv] f32
    g: mx.array,  # [B, L, Hv] f32, log decay
    beta: mx.array,  # [B, L, Hv] f32
    state: mx.array,  # [B, Hv, Dk, Dv] f32
    per_position: bool,
) -> tuple[mx.array, tuple[mx.array, ...]]:
    """Run the recurrence over L positions from `state`.

    Returns the outputs [B, L, Hv, Dv] and the states after positions 1..L
    (per_position) or only the state after position L.
    """
    if not per_position and q.shape[1] >= CHUNK:
        out, final = chunked_gated_delta_rule(q, k, v, g, beta, state)
        return out, (final,)
    decay = mx.exp(g)
    outputs: list[mx.array] = []
    states: list[mx.array] = []
    for t in range(q.shape[1]):
        out, state = delta_step(
            state, q[:, t], k[:, t], v[:, t], decay[:, t], beta[:, t]
        )
        outputs.append(out)
        if per_position:
            states.append(state)
    return mx.stack(outputs, axis=1), tuple(states) if per_position else (state,)


def unit_lower_inverse(strict: mx.array) -> mx.array:  # [..., n, n] -> [..., n, n]
    """(I + strict)^-1 for a strictly lower-triangular `strict`, n a power of 2.

    Blockwise, bottom-up: with inverses A^-1, B^-1 of two neighbouring
    diagonal blocks and C the block below A,
        [[A, 0], [C, B]]^-1 = [[A^-1, 0], [-B^-1 C A^-1, B^-1]].
    log2(n) levels of batched matmuls, no sequential substitution and no
    solver (MLX's triangular solvers run on the CPU only)."""
    n = strict.shape[-1]
    lead = strict.shape[:-2]
    inverse = mx.ones((*lead, n, 1, 1), dtype=strict.dtype)  # n blocks of 1x1
    size = 1
    while size < n:
        pairs = n // (2 * size)
        # the lower-left [size, size] block of each [2 size, 2 size] diagonal block
        grid = strict.reshape(*lead, pairs, 2 * size, pairs, 2 * size)
        lower = mx.stack(
            [grid[..., p, size:, p, :size] for p in range(pairs)], axis=-3
        )  # [..., pairs, size, size]
        upper_inv = inverse[..., 0::2, :, :]
        lower_inv = inverse[..., 1::2, :, :]
        bridge = -(lower_inv @ lower @ upper_inv)
        zeros = mx.zeros_like(upper_inv)
        inverse = mx.concatenate(
            [
                mx.concatenate([upper_inv, zeros], axis=-1),
                mx.concatenate([bridge, lower_inv], axis=-1),
            ],
            axis=-2,
        )  # [..., pairs, 2 size, 2 size]
        size *= 2
    return inverse.reshape(*lead, n, n)


def chunked_gated_delta_rule(
    q: mx.array,  # [B, L, Hv, Dk] f32
    k: mx.array,  # [B, L, Hv, Dk] f32
    v: mx.array,  # [B, L, Hv, Dv] f32
    g: mx.array,  # [B, L, Hv] f32
    beta: mx.array,  # [B, L, Hv] f32
    state: mx.array,  # [B, Hv, Dk, Dv] f32
) -> tuple[mx.array, mx.array]:  # outputs [B, L, Hv, Dv], final state
    """The same recurrence, CHUNK positions at a time (the WY / UT form of
    Yang et al., as in flash-linear-attention and transformers'
    `torch_chunk_gated_delta_rule`).

    Within a chunk, with G the cumulative log decay and D_ij = exp(G_i - G_j)
    for j <= i: the delta-rule writes solve (I + tril(beta k k^T * D, -1)) U =
    [beta v, beta k exp(G)]; then per chunk, in order,
        V' = U_v - U_k S,   O = (q exp(G)) S + tril(q k^T * D) V',
        S  = exp(G_last) S + (k exp(G_last - G))^T V'.
    Padding (k = 0, beta = 0, g = 0) leaves the state unchanged.
    """
    batch, length, heads, _ = k.shape
    dv = v.shape[-1]
    pad = -length % CHUNK
    if pad:
        q, k, v = (mx.pad(x, [(0, 0), (0, pad), (0, 0), (0, 0)]) for x in (q, k, v))
        g, beta = (mx.pad(x, [(0, 0), (0, pad), (0, 0)]) for x in (g, beta))
    count = (length + pad) // CHUNK

    def chunked(x: mx.array) -> mx.array:  # [B, L, Hv, D] -> [B, Hv, N, C, D]
        return x.reshape(batch, count, CHUNK, heads, -1).transpose(0, 3, 1, 2, 4)

    q, k, v = chunked(q), chunked(k), chunked(v)
    g = g.reshape(batch, count, CHUNK, heads).transpose(0, 3, 1, 2)  # [B, Hv, N, C]
    beta = beta.reshape(batch, count, CHUNK, heads).transpose(0, 3, 1, 2)
    cum = mx.cumsum(g, axis=-1)  # G
    position = mx.arange(CHUNK)
    causal = position[:, None] >= position[None, :]
    strictly = position[:, None] > position[None, :]
    gap = cum[..., :, None] - cum[..., None, :]  # G_i - G_j
    decay = mx.where(causal, mx.exp(mx.where(causal, gap, 0.0)), 0.0)
    k_beta = k * beta[..., None]
    solve = unit_lower_inverse(
        mx.where(strictly, (k_beta @ k.swapaxes(-1, -2)) * decay, 0.0)
    )
    written = solve @ (v * beta[..., None])  # [B, Hv, N, C, Dv]
    reads = solve @ (k_beta * mx.exp(cum)[..., None])  # [B, Hv, N, C, Dk]
    within = (q @ k.swapaxes(-1, -2)) * decay  # [B, Hv, N, C, C]
    q_decayed = q * mx.exp(cum)[..., None]
    k_decayed = k * mx.exp(cum[..., -1:] - cum)[..., None]
    chunk_decay = mx.exp(cum[..., -1])[..., None, None]  # [B, Hv, N, 1, 1]
    outputs = []
    for i in range(count):
        fresh = written[:, :, i] - reads[:, :, i] @ state
        outputs.append(q_decayed[:, :, i] @ state + within[:, :, i] @ fresh)
        state = (
            state * chunk_decay[:, :, i] + k_decayed[:, :, i].swapaxes(-1, -2) @ fresh
        )
    out = mx.stack(outputs, axis=2)  # [B, Hv, N, C, Dv]
    out = out.transpose(0, 2, 3, 1, 4).reshape(batch, count * CHUNK, heads, dv)
    return out[:, :length], state


class GatedDeltaMixer(nn.Module):
    """What every GatedDeltaNet layout shares: the causal conv, the gated delta
    rule, the gated norm and the output projection (HF names `conv1d`,
    `A_log`, `dt_bias`, `norm`, `out_proj`). A subclass owns the input
    projections and says, in `project`, how they yield q, k, v, z, b and a.

    `conv1d.weight` is stored in MLX layout [C, K, 1] (HF: [C, 1, K]; the
    model's `sanitize` transposes).
    """

    def __init__(self, args: HybridArgs) -> None:
        super().__init__()
        self.key_heads = args.linear_num_key_heads
        self.value_heads = args.linear_num_value_heads
        self.key_dim = args.linear_key_head_dim
        self.value_dim = args.linear_value_head_dim
        self.kernel = args.linear_conv_kernel_dim
        self.group = self.value_heads // self.key_heads
        keys = self.key_heads * self.key_dim
        values = self.value_heads * self.value_dim
        self.conv_channels = 2 * keys + values
        self.conv1d = nn.Conv1d(
            self.conv_channels,
            self.conv_channels,
            self.kernel,
            groups=self.conv_channels,
            bias=False,
        )
        self.dt_bias = mx.ones((self.value_heads,))
        self.A_log = mx.zeros((self.value_heads,))
        self.norm = GatedRMSNorm(self.value_dim, args.rms_norm_eps)
        self.out_proj = Linear(values, args.hidden_size, bias=False)

    @property
    def dims(self) -> tuple[int, int, int, int, int]:
        """Key heads, value heads, key and value head widths, and value heads
        per key head (`group`), in that order."""
        return (
            self.key_heads,
            self.value_heads,
            self.key_dim,
            self.value_dim,
            self.group,
        )

    def project(
        self,
        x: mx.array,  # [B, L, H]
    ) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """The conv input [B, L, C] (q: Hk*Dk, k: Hk*Dk, v: Hv*Dv channels,
        head-major), the gate z [B, L, Hv, Dv], b and a [B, L, Hv]."""
        raise NotImplementedError

    def __call__(
        self,
        x: mx.array,  # [B, L, H]
        conv_state: mx.array,  # [B, K-1, C]
        recurrent_state: mx.array,  # [B, Hv, Dk, Dv] f32
        per_position: bool,
    ) -> tuple[mx.array, WindowStates]:  # [B, L, H], the window's states
        batch, length, _ = x.shape
        hk, hv, dk, dv, r = self.dims
        qkv, z, b, a = self.project(x)
        window = mx.concatenate(
            [conv_state, qkv.astype(conv_state.dtype)], axis=1
        )  # [B, K-1+L, C]
        mixed = nn.silu(
            mx.conv1d(window, self.conv1d.weight, groups=self.conv_channels)
        ).astype(x.dtype)  # [B, L, C]
        keys = hk * dk
        q = mixed[..., :keys].reshape(batch, length, hk, dk).astype(mx.float32)
        k = mixed[..., keys : 2 * keys].reshape(batch, length, hk, dk)
        v = mixed[..., 2 * keys :].reshape(batch, length, hv, dv)

        q = l2_normalize(q) * dk**-0.5
        k = l2_normalize(k.astype(mx.float32))
        beta = mx.sigmoid(b).astype(mx.float32)
        g = -mx.exp(self.A_log.astype(mx.float32)) * nn.softplus(
            a.astype(mx.float32) + self.dt_bias.astype(mx.float32)
        )
        if uses_window_kernel(length, per_position):
            out, stacked = window_recurrence(
                q,
                k,
                v.astype(mx.float32),
                mx.exp(g),
                beta,
                recurrent_state,
                per_position,
            )
            states = WindowStates(window, (stacked,), per_position, stacked=True)
        else:
            # value head h reads key head h // r (transformers' repeat_interleave)
            out, each = gated_delta_rule(
                mx.repeat(q, r, axis=2),
                mx.repeat(k, r, axis=2),
                v.astype(mx.float32),
                g,
                beta,
                recurrent_state,
                per_position,
            )
            states = WindowStates(window, each, per_position)
        out = self.norm(out.astype(x.dtype), z).reshape(batch, length, hv * dv)
        return self.out_proj(out), states


class GatedDeltaNet(GatedDeltaMixer):
    """The Qwen3-Next layout: two fused input projections, `in_proj_qkvz` and
    `in_proj_ba`, their outputs grouped by key head."""

    def __init__(self, args: HybridArgs) -> None:
        super().__init__(args)
        keys = self.key_heads * self.key_dim
        values = self.value_heads * self.value_dim
        hidden = args.hidden_size
        self.in_proj_qkvz = Linear(hidden, 2 * keys + 2 * values, bias=False)
        self.in_proj_ba = Linear(hidden, 2 * self.value_heads, bias=False)

    def project(
        self,
        x: mx.array,  # [B, L, H]
    ) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        batch, length, _ = x.shape
        hk, hv, dk, dv, r = self.dims
        # Per key head: [q, k, v (r heads), z (r heads)] and [b (r), a (r)].
        qkvz = self.in_proj_qkvz(x).reshape(batch, length, hk, 2 * dk + 2 * r * dv)
        ba = self.in_proj_ba(x).reshape(batch, length, hk, 2 * r)
        q = qkvz[..., :dk].reshape(batch, length, hk * dk)
        k = qkvz[..., dk : 2 * dk].reshape(batch, length, hk * dk)
        v = qkvz[..., 2 * dk : 2 * dk + r * dv].reshape(batch, length, hv * dv)
        z = qkvz[..., 2 * dk + r * dv :].reshape(batch, length, hv, dv)
        b = ba[..., :r].reshape(batch, length, hv)
        a = ba[..., r:].reshape(batch, length, hv)
        return mx.concatenate([q, k, v], axis=-1), z, b, a
