"""The gated delta rule over a short window as one CUDA kernel (MLX's CUDA
backend, `mx.fast.cuda_kernel`).

As MLX operations, each position of the recurrence (models/gated_delta.py,
`delta_step`) is several kernels, two of them reductions over the key axis
of the [Dk, Dv] memory, and costs ~0.13 ms per layer on an H200 at one row,
against ~2 us of bytes (bench/gdn_probe.py). Here one thread owns one value
column j of one (row, value head): it keeps S[:, j] (Dk floats) in registers
and runs every window position in order,

    S[:, j] *= a_t;  r = k_t . S[:, j];  w = beta_t (v_t[j] - r)
    S[:, j] += w k_t;  o_t[j] = q_t . S[:, j]

writing o_t[j] and, for per-position windows, S[:, j] after each position
(coalesced across j). q and k come with their Hk key heads (value head h
reads key head h // (Hv / Hk)), so they need no repeat. Sums run in
position-then-key order in float32, the same for a window of any width, so a
verify window's positions compute exactly what single-token steps compute.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any, cast

import mlx.core as mx

_SOURCE = """
    const size_t index = cooperative_groups::this_grid().thread_rank();
    if (index >= (size_t)ROWS * HV * DV) return;
    const int j = index % DV;
    const int h = (index / DV) % HV;
    const int b = index / ((size_t)DV * HV);
    const int hk = h / (HV / HK);
    float s[DK];
    const float* start = state + (((size_t)b * HV + h) * DK) * DV + j;
    for (int i = 0; i < DK; ++i) s[i] = start[(size_t)i * DV];
    for (int t = 0; t < LENGTH; ++t) {
        const size_t bt = (size_t)b * LENGTH + t;
        const float* kt = k + (bt * HK + hk) * DK;
        const float* qt = q + (bt * HK + hk) * DK;
        const float a = decay[bt * HV + h];
        float recalled = 0.0f;
        for (int i = 0; i < DK; ++i) {
            s[i] *= a;
            recalled += s[i] * kt[i];
        }
        const float w = (v[(bt * HV + h) * DV + j] - recalled) * beta[bt * HV + h];
        float o = 0.0f;
        for (int i = 0; i < DK; ++i) {
            s[i] += kt[i] * w;
            o += s[i] * qt[i];
        }
        out[(bt * HV + h) * DV + j] = o;
        if (PER_POSITION) {
            float* kept = states + ((((size_t)t * ROWS + b) * HV + h) * DK) * DV + j;
            for (int i = 0; i < DK; ++i) kept[(size_t)i * DV] = s[i];
        }
    }
    if (!PER_POSITION) {
        float* kept = states + (((size_t)b * HV + h) * DK) * DV + j;
        for (int i = 0; i < DK; ++i) kept[(size_t)i * DV] = s[i];
    }
"""


# The rows and the window length read at run time from v's shape (MLX passes
# `v_shape` to a kernel whose source names it) instead of compiled in: one
# build per model instead of one per (rows, window). Off until measured on a
# device (bench/gdn_probe.py checks it); the compiled-in form is the one
# validated there.
RUNTIME_DIMS = False
_DIMS_FROM_SHAPE = """
    const int ROWS = v_shape[0];
    const int LENGTH = v_shape[1];
"""


@cache
def _kernel(runtime_dims: bool) -> Callable[..., list[mx.array]]:
    return cast(
        Callable[..., list[mx.array]],
        mx.fast.cuda_kernel(
            name="specpipe_gated_delta_window" + ("_dims" if runtime_dims else ""),
            input_names=["q", "k", "v", "decay", "beta", "state"],
            output_names=["out", "states"],
            source=(_DIMS_FROM_SHAPE + _SOURCE) if runtime_dims else _SOURCE,
        ),
    )


def window_recurrence(
    q: mx.array,  # [B, L, Hk, Dk] f32, normalised and scaled
    k: mx.array,  # [B, L, Hk, Dk] f32, normalised
    v: mx.array,  # [B, L, Hv, Dv] f32
    decay: mx.array,  # [B, L, Hv] f32, exp(g)
    beta: mx.array,  # [B, L, Hv] f32
    state: mx.array,  # [B, Hv, Dk, Dv] f32
    per_position: bool,
    runtime_dims: bool | None = None,  # None: RUNTIME_DIMS
) -> tuple[mx.array, mx.array]:  # out [B, L, Hv, Dv], states [K, B, Hv, Dk, Dv]
    """`models.gated_delta.gated_delta_rule` on the GPU: the outputs and, in
    one array, the states after positions 1..L (per_position, K = L) or after
    L only (K = 1). A commit gathers the state it keeps out of it
    (`models.hybrid_cache.HybridDelta`), so the window's other states are freed."""
    rows, length, key_heads, dk = q.shape
    value_heads, dv = v.shape[2], v.shape[3]
    kept = length if per_position else 1
    dims = RUNTIME_DIMS if runtime_dims is None else runtime_dims
    template: list[tuple[str, Any]] = (
        [] if dims else [("ROWS", rows), ("LENGTH", length)]
    )
    template += [
        ("HK", key_heads),
        ("HV", value_heads),
        ("DK", dk),
        ("DV", dv),
        ("PER_POSITION", per_position),
    ]
    threads = rows * value_heads * dv
    out, states = _kernel(dims)(
        inputs=[q, k, v, decay, beta, state],
        template=template,
        grid=(threads, 1, 1),
        threadgroup=(min(dv, 256), 1, 1),
        output_shapes=[
            (rows, length, value_heads, dv),
            (kept, rows, value_heads, dk, dv),
        ],
        output_dtypes=[mx.float32, mx.float32],
    )
    return out, states
