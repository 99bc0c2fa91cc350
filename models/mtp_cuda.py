"""An MTP draft step as ONE CUDA kernel (MLX's CUDA backend, `mx.fast.cuda_kernel`).

As MLX operations a draft step of the MTP head (fc, the decoder layer, the
norm, the vocabulary projection, the draw) is some fifty kernels, and MLX's
CUDA backend spends ~10-15 us of host time encoding each: 0.4-0.8 ms a step
at one row against ~0.05 ms (Qwen3-Next's layer) of weight bytes, so a
frequency-ranked draft vocabulary (FR-Spec) could cut only the projection's
share of a step that fixed costs dominate (bench/step_probe.py,
bench/RESULTS.md). Here the whole step is one persistent kernel: NBLK
blocks (128, or the device's multiprocessor count where smaller: all
resident at once) run its phases in order and meet at a grid barrier
between phases (an atomic counter; a barrier that waits longer than 0.2 s
gives up and counts a failure in `sync[1]` instead of hanging the device,
so a broken launch yields wrong drafts, which verification rejects, never
wrong output):

1. fc over [norm(embed(token)), norm(hidden)] for every window position
   (the first step of a round: hidden through the target's final norm first);
2. q(+gate) / k / v of every position;
3. attention of each row's LAST position (q/k per-head norm, partial RoPE,
   the cached keys below the row's start and the window's own keys above),
   its positions split over the blocks (each split's max, sum and weighted
   values; a warp takes `ATT_UNROLL` cached positions at once, their loads in
   flight together); the window's keys and values are returned to be stored in the
   head's cache;
4. the splits combined, times sigmoid(gate), then o_proj plus the residual
   (with `FOLD_ROUTER`, the default for up to 127 experts, each block's share
   of the router's logits too: the router's phase and barrier are saved;
   past 127 experts the router keeps its own phase);
5-6. the MLP (dense SwiGLU), or the sparse MoE block (router softmax top-k,
   the chosen experts' SwiGLU, the sigmoid-gated shared expert), plus the
   residual;
7. the head's norm, the projection onto the full vocabulary or the FR-Spec
   rows (each block a contiguous chunk of rows), each block's best (greedy)
   or top-k candidates (sampled: its warps sort runs of 32 logits by bitonic
   networks of shuffles and merge them, pairwise with `TREE_MERGE`);
8. the draw, by every block for every row (the candidates merged the same
   way, the blocks' best four first, their whole lists only when one block
   holds four of the row's best top-k): the argmax, or Qwen-style
   temperature / top-k / top-p / min-p filtering and the coupled inverse-CDF draw of `specpipe.sampling` with the
   same (seed, step) uniform.

A round's chained steps (each drafting from the previous step's token and
normed output, one position further) run as ONE launch: the phases above
repeat per step (every block draws the step's tokens, greedy or sampled,
so the next step starts without a grid barrier), the
earlier steps' keys and values read back from the launch's own window
output (`FusedStep.chain`; the step count is an input, so one compiled
kernel serves every depth). With `WHOLE_ROUND` (the default) the round's
first step joins them, and the kernel writes the head's new KV buffers
itself instead of returning the window for two scatters
(`FusedStep.launch(..., kv_out=True)`, `HeadStep.round`). With
`DERIVED_INPUTS` (the default) a round that follows one of its kind takes
no input made from host values: the kernel derives its per-row inputs (the
accepted counts, the tail's ids, starts, step keys) from the last round's
draws, drafts and launch state, all device arrays (`FusedStep.derived_round`,
`derive_inputs`): arrays MLX makes from host values live in host memory,
which a launch's blocks read across the bus, or (over 8 bytes) in pages its
first read migrates.

Products read each weight row once with 16-byte loads (one warp per output
row, float32 sums; `PAIR_ROWS`: two rows per warp where rows are short)
from inputs staged, normed, in shared memory, under L2's evict-first policy
(`EVICT_ALL`) except fc's and o_proj's rows in a launch's non-final steps,
which the next step reads again from L2 (`KEEP_FC`, `KEEP_O`: evict-last).
Only the rows' last positions go
through attention, the MLP and the projection (a one-layer head needs no
other). The step is a draft: it
rounds differently from the MLX step (float32 throughout instead of rounding
to the weights' dtype after each operation), so a near-tie can draft another
token; verification keeps the output exactly plain decoding's either way.

Scope: float16 / bfloat16 weights that are not quantized, the fused q/k/v
and gate/up products (models/fuse.py), non-traditional RoPE, head_dim a
multiple of 32, hidden and intermediate sizes multiples of 256, at most
`MAX_VECTORS` window positions over at most 8 rows, greedy or top-k (<= 32)
sampling. Anything else keeps the compiled MLX step (`specpipe.drafts.mtp`).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from functools import cache
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from attrs import field, frozen

from models.base import RoPE
from models.cache import scatter_window
from models.vocab_head import HeadWeights

# (ids [B, L], hidden [B, L, H], last [B], starts [B], keys, values, seeds [B],
#  steps [B]) -> (tokens [B], normed [B, 1, H], keys, values), as
# specpipe.drafts.mtp.HeadStep's steps
StepFn = Callable[..., tuple[mx.array, mx.array, mx.array, mx.array]]

BLOCK = 256  # threads per block: 8 warps
MAX_ROWS = 8  # rows of one step (one warp per row in the per-row phases)
MAX_VECTORS = 8  # window positions of one step, all rows together
MAX_TOP_K = 32  # the sampled draw keeps its candidates one per lane
MAX_EXPERTS = 1024  # the router's top-k: 32 logits per lane in registers at most
# Blocks of the persistent kernel: at most one per multiprocessor, so that all
# are resident at once (the grid barrier needs it): this many, or the
# device's multiprocessor count where it has fewer (`multiprocessors`).
BLOCKS = 128
MAX_SHARED = 192 * 1024  # dynamic shared memory of one block, bytes
PHASE_STAMPS = 36  # floats per block at the scratch's end for `FusedStep.phase_times`
INNER_STAMPS = 12  # of them, points within phases (`FusedStep.stamp_table`)
# Whether a warp takes two rows of a one-input product at once (more loads in
# flight: a 2048-long q/k/v row is eight 16-byte loads per lane). On: an
# FR-Spec step 146 us against 155 without, the full head's 265 against
# 264-275 (H200, ten chained steps per launch, 2026-12-02 tenth session,
# `bench/fused_probe.py --pair-rows`).
PAIR_ROWS = True
# Whether a one-input product of one or two vectors keeps 16 loads per lane
# in flight instead of 8 (the same sums in the same order; fc's and o_proj's
# 4096-long rows in one DRAM round trip). Not yet measured against the other
# arm on a device (`bench/fused_probe.py --narrow-loads`).
WIDE_LOADS = True
# The switches below are off: measured on the H200 (tenth session, ten
# chained steps per launch, FR-Spec / full head) they did not help.
# Whether the kernel asks L2 ahead for the weights of its next phases (bulk
# prefetch hints while a latency-bound phase leaves DRAM idle): 181 / 274 us
# against 155 / 275 without (`bench/fused_probe.py --prefetch`).
PREFETCH_L2 = False
# Whether every weight row a step reads (each is read once per step) loads
# under the L2 evict-first policy, so that what L2 keeps between a step's
# phases and between chained steps is the kernel's code and the small
# activations, not the last megabytes of weights. On: H200, one row, FR-Spec
# 32k, same lease, full / FR us per launch at depths 1 / 2 / 3, Qwen's
# sampling 240.9 / 129.2, 467.6 / 244.3, 696.0 / 362.9 -> 239.9 / 128.0,
# 460.8 / 237.4, 682.6 / 348.1 (cut 1.91x -> 1.94x at depth 2, 1.92x ->
# 1.96x at depth 3: the sampled draw's code stays in L2); greedy ~1% faster (another lease: 228.2 / 119.4 -> 226.8 / 119.6 at
# depth 1, 647.5 / 324.6 -> 643.2 / 320.0 at depth 3). Drafts equal to the
# switch's off arm's on the device (fifteenth session, bench/RESULTS.md).
# (It replaces STREAM_HINTS, the policy for the projection's and the chosen
# experts' rows alone: 157 / 274 us against 155 / 275 without, tenth
# session.)
EVICT_ALL = True
# Whether a chained launch's fc / q(+gate)-k-v / o_proj rows load under L2's
# evict-last policy in every step but the last (with EVICT_ALL; the last
# step's loads stay evict-first): those rows are read again by the launch's
# next step, while the head's rows and the chosen experts' stream past under
# evict-first, so the next step finds them in L2 (50 MB on an H200) instead
# of DRAM. fc 16.8 MB, q/k/v 37.7 MB, o_proj 16.8 MB at Qwen3-Next's shape:
# not all three fit. fc and o_proj on: H200, one row, full / FR-Spec 32k us
# per launch, greedy depth 2 433.2 / 218.9 -> 430.1 / 214.1 (1.98x ->
# 2.01x), depth 3 638.4 / 315.9 -> 633.4 / 309.2 (2.02x -> 2.05x); Qwen's
# sampling depth 2 1.95x -> 1.97x, depth 3 1.97x -> 2.00x; depth 1 (no next
# step) unchanged. q/k/v alone ~1 us less; all three slower at depth 3
# (L2 overflows). Cache hints only: the same sums, the same drafts
# (eighteenth session, `bench/h200_run.sh keep`, bench/RESULTS.md).
KEEP_FC = True
KEEP_QKV = False
KEEP_O = True
# A diagnostic arm, off: RoPE angles by the hardware's approximate sin / cos
# (`__sincosf`, no range reduction: less accurate for large positions)
# instead of `sincosf`, to tell whether attention's query stretch (~12 us on
# the H200, tenth session) is the rotation's code (`bench/fused_probe.py
# --fast-sincos`).
FAST_SINCOS = False
# Whether a round whose inputs follow from the last round's (the same rows,
# every draft of the last round offered to every row) has the kernel derive
# them on the device (`FusedStep.derived_round`) instead of reading arrays
# made from host values: MLX keeps those in host memory, which the launch's
# blocks then read across the bus (~13 us of a one-row launch on an H200),
# or, over 8 bytes, in pages the first device read migrates (~180 us at
# three rows; bench/draft_device.py, 2026-12-02 twelfth session).
DERIVED_INPUTS = True
# Whether a launch whose shared memory (its staged inputs plus the kernel's
# static arrays) fits the 48 KB a kernel gets without opting in asks for just
# that, instead of at least 64 KiB (a guess at the first step's ~9 us spread
# of block starts: a multiprocessor switching its shared-memory / L1 split).
# Off: a one-row round's launch took 245.6 / 137.4 us (full head / FR-Spec,
# depth 1) against 249.1 / 144.0 without, within the run's spread (H200,
# `bench/draft_device.py --kernel-switches LEAN_SHARED`, twelfth session).
LEAN_SHARED = False
# Whether a sampled step's draw first merges only each block's best DRAW_HEADS_K
# candidates (512 of the 2,560 with 128 blocks), exactly: when no block has
# all of those among the row's best top-k, no block's later candidates can be
# among them either (each block's list is in the draw's order); otherwise
# every block (each sees the same candidates) merges the whole lists. A
# sampled step's draw is bound by fetching its code, not by its arithmetic
# (ncu: sampled FR steps stall on "no instruction" 2.1 per issue against 0.6
# greedy; the step's code is ~300 KB and the head's rows stream through L2
# before the draw): fewer merges run, less code. H200, one row, FR-Spec
# 32k, Qwen's sampling: 264.5 -> 248.7 us per depth-2 launch (the full
# head 486.1 -> 468.0), drafts equal to the float32 MLX step's with both
# paths taken (fourteenth session, bench/RESULTS.md).
DRAW_HEADS = True
DRAW_HEADS_K = 4
# Whether a sampled step's sorts, merges and (without SHARED_CDF) inverse
# CDF keep their loops rolled (compact code: the step's code is ~300 KB, re-read every step; the
# rolled loops take ~30 KB off). With DRAW_HEADS, H200: 248.7 -> 244.1 us
# per FR depth-2 launch, 373.8 -> 362.9 at depth 3 (fourteenth session).
TIGHT_DRAW = True
# Whether a sampled draw's heads-first merge sorts a warp's runs of the
# blocks' heads with their exchanges interleaved (`warp_sort_runs`: the
# runs' shuffle chains in flight together, not one run after another) and
# skips the sorting network's first stages (a run's groups of DRAW_HEADS_K
# are one block's heads, already in its list's order: loaded reversed where
# the network wants them worst first). The same runs, sorted: the same
# draws. On: H100, 512 experts, Qwen's sampling, the draw 4.8 -> 4.3 us a
# step (phase stamps, two runs), 603.3 / 287.9 -> 604.4 / 286.0 us per
# depth-2 launch (full / FR-Spec, 2.10x -> 2.11x); drafts against the
# float32 MLX step as the defaults' (one and three rows, every launch form;
# thirty-eighth session, bench/RESULTS.md).
DRAW_RUNS = True
# Whether a sampled step merges a block's eight warps' sorted runs pairwise
# (three merges in a row, a block barrier between) instead of warp 0 taking
# the seven others' in turn, in each block's candidates and in the draw's
# heads-first merge (the rare whole-list merge keeps its form); and a warp's
# first sorted run of the candidates is its list (not merged into an empty
# one). H200, one row, Qwen's sampling: 465.8 / 237.0 -> 462.0 / 233.5 us
# per depth-2 launch (full / FR-Spec), 689.9 / 347.5 -> 684.6 / 342.9 at
# depth 3; the same drafts as without it, one and three rows, every launch
# form (sixteenth session, bench/RESULTS.md).
TREE_MERGE = True
# Whether the grid barrier (~1.1-1.5 us, seven or eight a step) arrives by a
# release reduction and waits by acquire loads instead of a sequentially
# consistent fence (`__threadfence`) before the arrival and after the wait
# (the ordering a barrier needs and no more; CUTLASS's grid barrier has the
# same form). On: H200, one row, full / FR-Spec 32k us per launch, two leases
# (twentieth, twenty-first sessions), depth 2 greedy 435.5 / 215.1 -> 431.8 /
# 212.2 and 431.6 / 214.6 -> 428.7 / 211.6, Qwen's sampling 462.6 / 231.6 ->
# 460.2 / 230.2 and 458.1 / 231.5 -> 456.2 / 229.9; depth 3 greedy 635.9 /
# 309.6 -> 627.8 / 304.7. Its drafts equal the fenced form's token for token
# in every launch form, one and three rows, greedy and sampled, both heads
# (72 of 72 in one run each; bench/RESULTS.md). (The twentieth session read
# an ordering dependency into three rows' chained launches: it had compared
# runs on other inputs, the probe's rows 1 and 3 run apart instead of in one
# process; on the same inputs the two forms draft the same tokens.)
ACQ_REL_BARRIER = True
# Cache positions per warp and iteration in attention, their keys' and
# values' loads in flight together (held as loaded, converted where used),
# one softmax rescale per group (1: one position at a time, each load's
# round trip waited on before the next). A step's attention reads the whole
# context's keys and values, and one position at a time that loop was most
# of a step at long contexts (twenty-first session: 32,768 positions 1,153 /
# 939 us per depth-2 launch, full / FR-Spec 32k, against 684 / 468 with 8).
# 4, as measured in one lease (H200, one row, depth 2, full / FR us; 1 / 4 /
# 8): greedy at 48 positions 434.4 / 213.8, 435.0 / 213.0, 439.8 / 219.2
# (a split there holds six positions: adjacent groups of 8 put them all on
# one warp); Qwen's sampling 459.3 / 230.0, 463.4 / 233.0, 463.6 / 233.7;
# greedy at 4,096 positions 480.9 / 260.6 with 4, 485.5 / 264.3 with 8; at
# 32,768, 730.0 / 510.8 with 4, 695.3 / 473.2 with 8. Drafts at 2,048
# positions equal to the float32 MLX step's in every launch form, greedy
# and sampled, both heads (twenty-second session, bench/RESULTS.md).
ATT_UNROLL = 4
# Whether a warp's ATT_UNROLL cached positions at once are NWARP apart
# (positions w, w + 8, ... of a split for warp w; none loaded past the
# split's end) instead of adjacent: a short split's positions then go to
# several warps, one each, while a long split keeps ATT_UNROLL loads per
# warp in flight: 8 without the short-context cost, by design.
# Compile-checked (168-185 registers at Qwen3-Next's sizes with 8), not yet
# run on a device: `bash bench/h200_run.sh setup-min spread` times it at 48
# and 32,768 positions against the defaults, then checks its drafts.
ATT_SPREAD = False
# Whether attention's loop over cached positions issues its next iteration's
# ATT_UNROLL keys and values before it computes with the current ones (one
# iteration's loads always in flight: two DRAM round trips overlap instead of
# one per iteration). A long split's warp runs hundreds of iterations (512
# positions per warp at 32,768 positions, one row), each waiting for its
# loads; a short split's one or none are unchanged. Only with ATT_UNROLL <= 4
# (with 8 the sampled round spills at Qwen3-Next's sizes: 255 registers, 88
# bytes); 251-255 registers there with 4, no spills, one block per
# multiprocessor as before. On the H200 (2026-12-05, twenty-fifth session,
# greedy, depth 2, one row, full / FR-Spec us): 716.5 / 497.1 -> 655.4 /
# 437.6 at 32,768 positions (cut 1.44x -> 1.50x), 470.3 / 251.6 -> 469.3 /
# 249.8 at 4,096, 440.4 / 224.6 -> 444.8 / 224.7 at 48 (within the runs'
# ranges); a chained FR step's attention 112.6 -> 82.9 us at 32,768 positions
# (bench/phase_probe.py). The drafts and maximum differences equal the
# defaults' in all 72 of fused_probe's comparisons at 2,048 positions (1 and
# 3 rows, greedy and Qwen's sampling, full head and FR-Spec). On since.
ATT_PIPE = True
# Whether attention's items are (row, kv head, split) instead of (row, query
# head, split), where a kv head's query heads are at most a block's warps: a
# block stages its split's cached keys and values in shared memory, ATT_TILE
# positions a tile (asynchronous copies, the next tile in flight while the
# warps read the last), and each warp attends for one of the group's query
# heads. Qwen3-Next's eight query heads per kv head read each key and value
# from L2 eight times per step otherwise: at 32,768 positions 64 MB of keys
# and values, more than L2 holds. The row's cached positions are split over
# at most NBLK / (rows x kv heads) blocks, at least ATT_MIN_SHARE positions
# each. A launch whose window slots (positions plus chained steps) pass
# ATT_TILE keeps the per-query-head form. Compile-checked (165-168 registers
# at Qwen3-Next's sizes). On the H200 (2026-12-05, greedy, depth 2, one row;
# `bash bench/h200_run.sh setup-min grouped`): FR-Spec draft phase 506.9 ->
# 497.5 us at 32,768 positions (-1.9 %), 259.3 -> 324.9 us at 4,096 (+25 %):
# the redundant key and value reads were not what long contexts pay for. Its
# drafts were not checked (the agreement run at 4,096 positions outlasted its
# 200 s). Off. Since measured: the combine of a (row, head)'s splits read them
# one at a time (up to 66 at one row, one L2 round trip each, on the phase's
# critical path); their loads are now in flight together (eight per thread),
# the same sums in the same order. Stamped since (twenty-fifth session,
# bench/phase_probe.py, a chained FR step): its positions are the fastest
# (74 us at 32,768 positions against 113), but its partials and combine still
# take 27 us (the combiners wait for the last of 66 splits), so the step
# (194 us) loses to ATT_PIPE's (183); at 4,096 positions 126 against 108. Off.
ATT_GROUPED = False
ATT_TILE = 32
ATT_MIN_SHARE = 16
# The per-query-head form's splits: 0, always NBLK / (rows x query heads)
# (eight at one row of Qwen3-Next: six positions each at 48 positions, one
# load per warp, then a cross-block combine by the last split to finish: a
# fence, a counter and two more L2 round trips on the phase's critical
# path); N > 0, at most that many, each at least N positions, so that a
# short context's (row, head) is one block, whose warps' partials combine in
# shared memory and whose output is stored at once. Long contexts keep their
# splits (4,096 positions / 64 > 8), and their combine loops keep the
# compile-time split count (a runtime bound there cost 5-7 us per depth-2
# launch at 4,096 positions: the splits' loads no longer all in flight).
# Measured on an H100 (twenty-ninth session; no H200 was to be had), one
# row, 48 positions, full / FR-Spec us per launch against the defaults:
# greedy depth 2 571.6 / 258.7 against 574.4 / 261.1, depth 3 847.5 / 377.0
# against 849.3 / 378.7; Qwen's sampling 595.4 / 273.5 against 598.8 /
# 275.9, 888.8 / 404.8 against 891.3 / 406.3; a chained FR step's attention
# phase 7.2 us against 9.2 (bench/phase_probe.py); at 4,096 positions
# 614.7 / 297.5 against 613.1 / 297.5. Drafts at 40 and 200 positions (one
# and three rows, greedy and Qwen's sampling, both heads) equal to the
# float32 MLX step's in every launch form, and to the bf16 step's where the
# defaults' are. On since.
ATT_SHARE = 64
# A whole-round launch (`kv_out`) copies the head's KV buffers into its new
# ones: O(capacity) per round, ~34 us of a depth-2 launch at 32,768 positions
# on the H200 (twenty-first session's first-step figures). COPY_UNROLL
# 16-byte vectors of keys and as many of values per thread in flight at once
# (1: one of each at a time). 4: H100 (2026-12-05, twenty-seventh session,
# greedy, depth 2, one row, full head / FR-Spec 32k us per launch) 809.3 /
# 496.7 -> 796.0 / 482.6 at 32,768 positions, 614.7 / 300.5 -> 611.0 / 298.5
# at 4,096; the kernel's drafts at 2,048 positions (1 and 3 rows, greedy and
# Qwen's sampling, both heads) equal the bf16 MLX step's in the same launch
# forms as the defaults' on the H200 (bench/RESULTS.md); 251 registers as
# without it. (Copying only the rows' cached positions would leave the
# buffers' tails unwritten: MLX's attention over a bucketed span multiplies
# them by zero weights, which a NaN would survive.)
COPY_UNROLL = 4
# Whether bfloat16 weights, keys and values convert to float by a shift or a
# mask of their 32-bit words instead of the compiler's conversion (the same
# values): ptxas lowers a word's high half by inserting it into the result
# register's old bits, which keeps that register live from the kernel's
# start (nvdisasm's register life ranges, the compile test's sampled
# two-row first step: 50 registers live at the first instruction, 41 with
# the switch; such inserts 76 -> 2). On: the compile test's steps 1-4 % less code
# (bench/cubin_digest.py), Qwen3-Next's sampled round 291,864 -> 284,184
# bytes at the same 168 registers; a sampled step is bound by fetching its
# code (DRAW_HEADS's note). On the H200 (2026-12-05, twenty-fourth session):
# the same drafts as the compiler's conversion in all 72 of fused_probe's
# comparisons (1 and 3 rows, greedy and Qwen's sampling, full head and
# FR-Spec), and the draft phase 1.3-4.3 % shorter at 48 positions (FR-Spec
# depth 2 / 3: greedy 213.8 -> 209.5 / 307.7 -> 302.9 us, Qwen's sampling
# 232.2 -> 225.7 / 345.7 -> 330.8 us). On since.
BF16_SHIFTS = True
# Diagnostics, timing only (their drafts are wrong): a sampled step without
# the draw's merge and inverse CDF (each block's best candidate reduced as a
# greedy draw does), without each block's sort of its logits (its first
# top-k logits as its candidates), or both.
DIAG_NO_DRAW = False
DIAG_NO_SORT = False
# Whether a MoE step of at most 127 experts folds its router into o_proj's
# phase: the router's logits (and the shared expert's gate) are linear in the
# MoE's input before its norm's scale, so each block sums its o_proj rows'
# share of them (weights pre-multiplied by the norm's, transposed, float32)
# and every block adds the blocks' shares after the barrier it waits behind
# anyway, scaled by the norm; the shared expert's gate/up rows join the
# chosen experts' product. One grid barrier and the router's product phase
# fewer per step (the router's phase took ~3 us of a step on the H200, its
# barrier ~1.2, its input staging ~1.4; eleventh session's segments). On:
# ~1-4 us per launch on the H200, greedy (depth 2: 440.8 / 220.0 -> 438.0 /
# 218.1 us, depth 3: 650.8 / 321.6 -> 648.5 / 317.6), sampled within the
# spread (466.8 / 238.5 -> 466.6 / 238.2 at depth 2); drafts the same as the
# off arm's, one and three rows, greedy and sampled, every launch form
# (sixteenth session, bench/RESULTS.md). Qwen3-Next's 512 experts are past
# its limit: there the router keeps its phase.
FOLD_ROUTER = True
# Whether a MoE step picks its router's top-k experts in KE rounds of two
# one-instruction warp reductions (`__reduce_max_sync` over the logits as
# order-keyed ints, then `__reduce_min_sync` over the ids holding the
# largest), each lane keeping its best by a branch-free tree over its
# experts (~93 instructions a round), instead of (up to 128 experts) ranking
# every expert against all by shuffles or (past 128) KE rounds of a shuffle
# argmax over branchy per-lane scans (293 a round). One warp issues these
# while the block's seven others wait (PC sampling on an H100: ~9 us of a
# 512-expert step, thirty-sixth session's samples re-read). The same experts
# in the same order either way (ties to the lower id). On: H100, 512
# experts, FR-Spec step (phase stamps) 123.4 -> 116.8 us greedy, the top-k
# 7.7 -> 1.9 us; depth-2 launches with SHARED_CDF 590.0 / 284.6 -> 582.2 /
# 273.8 us greedy (2.07x -> 2.13x), 617.2 / 300.3 -> 605.9 / 288.3 Qwen's
# (2.06x -> 2.10x); drafts against the float32 MLX step as the old path's,
# 64 experts (one and three rows) and 512 (one row) (thirty-seventh
# session, bench/RESULTS.md).
REDUX_TOPK = True
# Whether a sampled draw's inverse CDF reads the warp's masses and ids back
# from shared memory (broadcast reads, unrolled) instead of two shuffles a
# candidate in a rolled loop; the same sums in the same order. On: the draw
# 5.7 -> 4.8 us a step (H100, with REDUX_TOPK, thirty-seventh session).
# With ATT_PIPE off it spills 8 bytes at three sampled rows (not an arm
# the tests compile).
SHARED_CDF = True

# The step's code is kept short, since a step is bound by fetching it
# (DRAW_HEADS's note; a chained step's code is re-read every step):
# Qwen3-Next's sampled chained step ran as fast as greedy's with the draw's
# and the head sort's code left out (H100 phase stamps, forty-third session:
# 126.6 us, 116.8 without them, greedy's 117.4), and the phases after the
# draw were slower with it (attention's positions 3.6 against 2.3 us). So no
# loop has a count the compiler cannot know (block sums and strided loops
# take SP_THREADS, staging loops from L2 a fixed count; such a loop is
# unrolled with remainders), the one-split attention output takes each
# warp's weight once for its sum and its output, loops with no need of
# unrolling keep one copy of their body (`#pragma unroll 1`: the stagings'
# loop over their vectors, fc's stage over a window's positions, thread 0's
# loops over attention's splits), and the router top-k's keys come from
# integer operations. The same sums in the same order, the same keys.
# Measured as switches (bench/RESULTS.md, forty-third and forty-fourth
# sessions; H100, 512 experts, one row, 48 positions, full / FR-Spec us):
# the first part (TRIM_CODE) took the step loop's code (bench/code_size.py)
# from 141.3 / 169.8 KB greedy / sampled to 131.3 / 159.8 and a depth-2
# launch from 581.1 / 273.0 to 570.0 / 262.9 greedy, 602.6 / 287.6 to
# 592.3 / 277.0 Qwen's; the rest (TRIM_MORE) to 122.9 / 151.6 KB and
# 568.7 / 262.0, 590.0 / 275.4 (depth 3: 825.8 / 366.0 -> 824.4 / 363.9
# greedy, 860.1 / 388.4 -> 854.9 / 382.4 Qwen's). Drafts the same as before
# in all of fused_probe's comparisons (one and three rows, both samplings,
# both heads, every launch form), registers as before.

_HEADER = r"""
namespace specpipe_mtp {

typedef unsigned long long u64;
#define SP_INF (cuda::std::numeric_limits<float>::infinity())

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// The larger of (value, index) pairs, the smaller index on a tie.
__device__ __forceinline__ void warp_argmax(float& v, int& i) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    float ov = __shfl_xor_sync(0xffffffffu, v, o);
    int oi = __shfl_xor_sync(0xffffffffu, i, o);
    if (ov > v || (ov == v && oi < i)) { v = ov; i = oi; }
  }
}

// Element i of the elements of W packed in raw. With SP_BF16_SHIFTS
// (`BF16_SHIFTS`) bfloat16 by a shift or a mask of its 32-bit word (the same
// value): the compiler's own conversion of a word's high half inserts it
// into its result register's old bits, which keeps that register live from
// the kernel's start.
template <typename W, typename P>
__device__ __forceinline__ float elem(const P& raw, int i) {
  if constexpr (SP_BF16_SHIFTS && cuda::std::is_same<W, __nv_bfloat16>::value) {
    const unsigned int w = reinterpret_cast<const unsigned int*>(&raw)[i >> 1];
    return __uint_as_float((i & 1) ? (w & 0xFFFF0000u) : (w << 16));
  } else {
    return static_cast<float>(reinterpret_cast<const W*>(&raw)[i]);
  }
}

// N elements of W from p (16, 8 or 4 bytes at once where they make that
// many; COHERENT: written by other blocks of this launch, read from L2).
template <typename W, int N, bool COHERENT>
__device__ __forceinline__ void load_n(const W* p, float* out) {
  if constexpr (N * sizeof(W) == 16) {
    const uint4 raw = COHERENT ? __ldcg(reinterpret_cast<const uint4*>(p))
                               : __ldg(reinterpret_cast<const uint4*>(p));
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = elem<W>(raw, i);
  } else if constexpr (N * sizeof(W) == 8) {
    const uint2 raw = COHERENT ? __ldcg(reinterpret_cast<const uint2*>(p))
                               : __ldg(reinterpret_cast<const uint2*>(p));
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = elem<W>(raw, i);
  } else if constexpr (N * sizeof(W) == 4) {
    const unsigned int raw = COHERENT ? __ldcg(reinterpret_cast<const unsigned int*>(p))
                                      : __ldg(reinterpret_cast<const unsigned int*>(p));
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = elem<W>(raw, i);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = static_cast<float>(p[i]);
  }
}

// N elements of a 2-byte W as one load keeps them (16, 8, 4 or 2 bytes),
// read-only for the launch; unpack_n converts them.
template <int BYTES> struct Packed;
template <> struct Packed<16> { using type = uint4; };
template <> struct Packed<8> { using type = uint2; };
template <> struct Packed<4> { using type = unsigned int; };
template <> struct Packed<2> { using type = unsigned short; };

template <typename W, int N>
__device__ __forceinline__ typename Packed<N * sizeof(W)>::type load_packed(const W* p) {
  return __ldg(reinterpret_cast<const typename Packed<N * sizeof(W)>::type*>(p));
}

// Asynchronous 16-byte copies from global into shared memory (sm_80+):
// issued, committed as a group, waited for (all but the newest N groups).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned int at = static_cast<unsigned int>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(at), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

template <typename W, int N, typename P>
__device__ __forceinline__ void unpack_n(const P& raw, float* out) {
  static_assert(sizeof(P) == N * sizeof(W), "a packed load of N elements");
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = elem<W>(raw, i);
}

// Eight weights (read-only for the launch) in one 16-byte load.
template <typename W>
__device__ __forceinline__ void load8(const W* p, float* out) {
  load_n<W, 8, false>(p, out);
}

// Eight floats written by other blocks of this launch (bypassing L1).
__device__ __forceinline__ void load8s(const float* p, float* out) {
  const float4 a = __ldcg(reinterpret_cast<const float4*>(p));
  const float4 b = __ldcg(reinterpret_cast<const float4*>(p + 4));
  out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w;
  out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
}

__device__ __forceinline__ float silu(float g) { return g / (1.0f + expf(-g)); }
__device__ __forceinline__ float sigmoid(float g) { return 1.0f / (1.0f + expf(-g)); }

__device__ __forceinline__ u64 now_ns() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Thread 0's halves of a grid barrier: the block counted in (`goal`, thread
// 0's, advances by the grid size per barrier), then the wait for all.
// ACQ_REL (`ACQ_REL_BARRIER`): the arrival a release reduction and the
// wait acquire loads (the PTX memory model's release / acquire patterns, as
// CUTLASS's grid barrier has them) instead of two sequentially consistent
// fences (`__threadfence`) around a relaxed reduction and volatile loads.
template <bool ACQ_REL>
__device__ __forceinline__ void grid_count_in(u64* bar, u64& goal) {
  goal += gridDim.x;
  if (ACQ_REL) {
    asm volatile("red.release.gpu.global.add.u64 [%0], 1;" ::"l"(bar) : "memory");
  } else {
    __threadfence();
    atomicAdd(bar, 1ULL);
  }
}
template <bool ACQ_REL>
__device__ __forceinline__ void grid_await(u64* bar, u64 goal, bool& gave_up) {
  if (!gave_up) {
    const u64 t0 = now_ns();
    while (true) {
      u64 seen;
      if (ACQ_REL)
        asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(seen) : "l"(bar) : "memory");
      else seen = *(volatile u64*)bar;
      if (seen >= goal) break;
      if (now_ns() - t0 > 200000000ULL) {
        gave_up = true;
        atomicAdd(bar + 1, 1ULL);
        break;
      }
    }
  }
  if (!ACQ_REL) __threadfence();
}

// Every block's threads arrive; thread 0 counts the block in and waits for
// all.
template <bool ACQ_REL = true>
__device__ __forceinline__ void grid_sync(u64* bar, u64& goal, bool& gave_up) {
  __syncthreads();
  if (threadIdx.x == 0) {
    grid_count_in<ACQ_REL>(bar, goal);
    grid_await<ACQ_REL>(bar, goal, gave_up);
  }
  __syncthreads();
}

// A hint: ask L2 to fetch `bytes` bytes at p (16-byte aligned).
__device__ __forceinline__ void prefetch_range(const void* p, size_t bytes) {
  const unsigned int n = (unsigned int)(bytes / 16 * 16);
  if (n == 0) return;
#if __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(n) : "memory");
#else
  for (unsigned int o = 0; o < n; o += 128)
    asm volatile("prefetch.global.L2 [%0];" ::"l"(static_cast<const char*>(p) + o));
#endif
}

// A hint: ask L2 to fetch this block's share (1 / gridDim.x) of the first
// min(bytes, cap) bytes at p (16-byte aligned), one bulk prefetch (sm_90).
// Weights a later phase reads arrive while the current one, latency-bound,
// leaves DRAM idle. Called by one thread of the block.
__device__ __forceinline__ void prefetch_share(const void* p, size_t bytes, size_t cap) {
  bytes = bytes < cap ? bytes : cap;
  const size_t share = ((bytes + gridDim.x - 1) / gridDim.x + 15) / 16 * 16;
  const size_t lo = (size_t)blockIdx.x * share;
  if (lo >= bytes) return;
  prefetch_range(static_cast<const char*>(p) + lo, min(share, bytes - lo));
}

constexpr int SP_THREADS = 256;  // threads per block (BLOCK)
// A strided loop's step: unsigned, as blockDim.x is (an int step costs such a
// loop one more instruction).
constexpr unsigned SP_STRIDE = SP_THREADS;

// Sum over the block (all threads get it); `red` holds one float per warp.
// The warps are counted as the launch's SP_THREADS / 32, a constant (counted
// from blockDim, the loop's count is unknown and the compiler unrolls it with
// remainders: ~100 instructions a call against ~10).
__device__ __forceinline__ float block_sum(float v, float* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float t = 0.0f;
#pragma unroll
  for (int i = 0; i < SP_THREADS / 32; ++i) t += red[i];
  return t;
}
constexpr int PHASE_STAMPS = @STAMPS@;  // floats of phase stamps
constexpr int INNER_STAMPS = @INNER@;  // of them, points within phases (the last ones)

// 8-element groups of an n-vector per thread (n a multiple of 256).
__host__ __device__ constexpr int groups8(int n) { return (n / 8 + SP_THREADS - 1) / SP_THREADS; }

// N floats (N a multiple of 4, both ends 16-byte aligned) from scratch (L2)
// into shared memory, 16-byte loads: a loop of known count, fully unrolled
// (not one whose count depends on the thread's index, which the compiler
// unrolls with remainders).
template <int N>
__device__ __forceinline__ void stage_l2(float* to, const float* from) {
  const float4* src = reinterpret_cast<const float4*>(from);
  float4* dst = reinterpret_cast<float4*>(to);
  constexpr int V = N / 4;
  constexpr int G = (V + SP_THREADS - 1) / SP_THREADS;
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const int i = threadIdx.x + g * SP_THREADS;
    if (i < V) dst[i] = __ldcg(src + i);
  }
}

// RMSNorm of `count` scratch vectors of N floats into `to` (float32, shared
// memory): x * rsqrt(mean(x^2) + eps) * w, each thread's elements read once
// (16-byte loads, all in flight together); `copy`, when given, also gets
// them in the weights' dtype; `inv`, when given (shared), each vector's
// rsqrt(mean(x^2) + eps).
template <typename W, int N>
__device__ __forceinline__ void stage_normed(
    float* to, const float* from, int count, const W* w, float eps, float* red, W* copy,
    float* inv = nullptr) {
  constexpr int NG = groups8(N);
  #pragma unroll 1
  for (int m = 0; m < count; ++m) {
    float x[NG][8];
    float s = 0.0f;
#pragma unroll
    for (int g = 0; g < NG; ++g) {
      const int k = (threadIdx.x + g * SP_THREADS) * 8;
      if (k < N) {
        load8s(from + (size_t)m * N + k, x[g]);
#pragma unroll
        for (int i = 0; i < 8; ++i) s += x[g][i] * x[g][i];
      }
    }
    const float iv = rsqrtf(block_sum(s, red) / N + eps);
    if (inv != nullptr && threadIdx.x == 0) inv[m] = iv;
#pragma unroll
    for (int g = 0; g < NG; ++g) {
      const int k = (threadIdx.x + g * SP_THREADS) * 8;
      if (k < N) {
        float wv[8];
        load8(w + k, wv);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const float v = x[g][i] * iv * wv[i];
          to[(size_t)m * N + k + i] = v;
          if (copy != nullptr) copy[(size_t)m * N + k + i] = static_cast<W>(v);
        }
      }
    }
  }
  __syncthreads();
}

// A float's bits as an int in the floats' order (-0 as +0), NaN the least;
// and back.
#define SP_KEY_MIN (-2147483647 - 1)
__device__ __forceinline__ int order_key(float x) {
  const int u = __float_as_int(x);
  // (integer operations: a negative float's magnitude bits flipped, either
  // zero 0; one predicate, used at once, where float compares' predicates
  // outlived the registers for them: 32 moves to registers for 16 keys)
  const int k = ((unsigned int)u << 1) == 0u ? 0 : u ^ ((u >> 31) & 0x7fffffff);
  return x != x ? SP_KEY_MIN : k;
}
__device__ __forceinline__ float key_value(int k) { return __int_as_float(k >= 0 ? k : k ^ 0x7fffffff); }

// A warp's largest and least int (one instruction from sm_80).
__device__ __forceinline__ int warp_max_int(int v) {
#if __CUDA_ARCH__ >= 800
  return __reduce_max_sync(0xffffffffu, v);
#else
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
#endif
}
__device__ __forceinline__ int warp_min_int(int v) {
#if __CUDA_ARCH__ >= 800
  return __reduce_min_sync(0xffffffffu, v);
#else
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
#endif
}

// A 16-byte read-only weight load. STREAM (`EVICT_ALL`): under an L2
// evict-first policy (every weight row is read once per step), so that L2
// keeps the kernel's code and the small activations instead.
// KEEP (`KEEP_FC`, `KEEP_QKV`, `KEEP_O`) with `keep` set: under evict-last
// instead, for a row the launch's next chained step reads again.
template <bool STREAM, bool KEEP = false>
__device__ __forceinline__ uint4 load_w(const void* p, bool keep = false) {
#if __CUDA_ARCH__ >= 800
  if constexpr (STREAM) {
    uint4 r;
    u64 policy;
    if constexpr (KEEP) {
      if (keep) asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
      else asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    } else {
      asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    }
    asm("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
        : "l"(p), "l"(policy));
    return r;
  }
#endif
  return __ldg(reinterpret_cast<const uint4*>(p));
}

// A product's tile: R rows per warp at once, U 16-byte loads per lane and
// weight row in flight (see `product`).
template <int NV, int NDOT, bool PAIRS, bool WIDE>
struct Tile {
  static constexpr int R = (PAIRS && NDOT == 1 && NV <= 2) ? 2 : 1;
  // WIDE: a one-input product of one or two vectors keeps 16 loads per lane
  // in flight (a 4096-long row in one DRAM round trip instead of two)
  static constexpr int U = (WIDE && R == 1 && NDOT == 1 && NV <= 2) ? 16 : (NDOT * NV <= 4 ? 8 : 4);
};

// Rows r = first, first + stride, ... of a product: NV input vectors times
// NDOT weight rows per r (rowf(r, j)), K inputs (a multiple of 256), one warp
// per r, U 16-byte loads per lane in flight. xf(v, r, k, x8) writes input v's
// elements k .. k + 7 (from shared memory), r the first of the tile's R
// rows: an xf whose input depends on r (the chosen experts') needs R == 1
// (sixteenth session: a deeper tile there mixed rows' inputs); of(r, acc)
// gets the sums (every lane holds them). PAIRS: a warp takes two of its
// rows at once (their loads in flight together: half the DRAM round trips
// where a warp has several short rows), for one weight row of at most two
// inputs.
template <typename W, int NV, int NDOT, bool PAIRS, bool WIDE, bool STREAM, bool KEEP = false,
          typename RF, typename XF, typename OF>
__device__ __forceinline__ void product(
    int rows, int K, int first, int stride, RF rowf, XF xf, OF of, bool keep = false) {
  constexpr int R = Tile<NV, NDOT, PAIRS, WIDE>::R, U = Tile<NV, NDOT, PAIRS, WIDE>::U;
  const int lane = threadIdx.x & 31;
  for (int r0 = first; r0 < rows; r0 += stride * R) {
    const W* wr[R][NDOT];
    bool live[R];
#pragma unroll
    for (int q = 0; q < R; ++q) {
      live[q] = r0 + q * stride < rows;
#pragma unroll
      for (int j = 0; j < NDOT; ++j) wr[q][j] = rowf(live[q] ? r0 + q * stride : r0, j);
    }
    float acc[R][NV][NDOT];
#pragma unroll
    for (int q = 0; q < R; ++q)
#pragma unroll
      for (int v = 0; v < NV; ++v)
#pragma unroll
        for (int j = 0; j < NDOT; ++j) acc[q][v][j] = 0.0f;
    for (int k0 = lane * 8; k0 < K; k0 += 256 * U) {
      uint4 raw[R][U][NDOT];
#pragma unroll
      for (int q = 0; q < R; ++q)
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
          for (int j = 0; j < NDOT; ++j)
            raw[q][u][j] = (k0 + u * 256 < K)
                ? load_w<STREAM, KEEP>(wr[q][j] + k0 + u * 256, keep)
                : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int k = k0 + u * 256;
        if (k >= K) break;
#pragma unroll
        for (int v = 0; v < NV; ++v) {
          float x[8];
          xf(v, r0, k, x);
#pragma unroll
          for (int q = 0; q < R; ++q)
#pragma unroll
            for (int j = 0; j < NDOT; ++j) {
              float s = 0.0f;
#pragma unroll
              for (int i = 0; i < 8; ++i) s += elem<W>(raw[q][u][j], i) * x[i];
              acc[q][v][j] += s;
            }
        }
      }
    }
#pragma unroll
    for (int q = 0; q < R; ++q)
#pragma unroll
      for (int v = 0; v < NV; ++v)
#pragma unroll
        for (int j = 0; j < NDOT; ++j) acc[q][v][j] = warp_sum(acc[q][v][j]);
#pragma unroll
    for (int q = 0; q < R; ++q)
      if (live[q]) of(r0 + q * stride, acc[q]);
  }
}

// Eight staged floats from shared memory.
__device__ __forceinline__ void smem8(const float* p, float* out) {
  const float4 a = *reinterpret_cast<const float4*>(p);
  const float4 b = *reinterpret_cast<const float4*>(p + 4);
  out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w;
  out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
}

__host__ __device__ constexpr size_t align8(size_t n) { return (n + 7) / 8 * 8; }

// Whether (av, ai) goes before (bv, bi): the larger value, the smaller id on
// a tie (the order of `specpipe.sampling`'s top-k candidates).
__device__ __forceinline__ bool ahead(float av, int ai, float bv, int bi) {
  return av > bv || (av == bv && ai < bi);
}

// The warp's 32 (value, id) pairs sorted best first (lane 0 the best): a
// bitonic network by shuffles, 15 exchanges.
template <int U = 32>  // U: the loops' unrolling (1: compact code)
__device__ __forceinline__ void warp_sort(float& v, int& i) {
  const int lane = threadIdx.x & 31;
#pragma unroll U
  for (int k = 2; k <= 32; k <<= 1) {
#pragma unroll U
    for (int j = k >> 1; j > 0; j >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, v, j);
      const int oi = __shfl_xor_sync(0xffffffffu, i, j);
      // the lower lane of a pair keeps the better where its run goes best first
      const bool better = ((lane & k) == 0) == ((lane & j) == 0);
      if (better ? ahead(ov, oi, v, i) : ahead(v, i, ov, oi)) { v = ov; i = oi; }
    }
  }
}

// The warp's N runs of 32 (value, id) pairs each sorted best first, as
// `warp_sort` sorts one, their exchanges interleaved (N independent chains
// of shuffles in flight), from the network's stage of runs of FROM: 2, the
// whole network; 2K, each run's pairs in groups of K already ordered as the
// network's earlier stages leave them (best first where lane & K is clear,
// worst first where it is set), whose exchanges are skipped.
template <int U, int N, int FROM = 2>
__device__ __forceinline__ void warp_sort_runs(float (&v)[N], int (&i)[N]) {
  const int lane = threadIdx.x & 31;
#pragma unroll U
  for (int k = FROM; k <= 32; k <<= 1) {
#pragma unroll U
    for (int j = k >> 1; j > 0; j >>= 1) {
      const bool better = ((lane & k) == 0) == ((lane & j) == 0);
      float ov[N];
      int oi[N];
#pragma unroll
      for (int r = 0; r < N; ++r) {
        ov[r] = __shfl_xor_sync(0xffffffffu, v[r], j);
        oi[r] = __shfl_xor_sync(0xffffffffu, i[r], j);
      }
#pragma unroll
      for (int r = 0; r < N; ++r)
        if (better ? ahead(ov[r], oi[r], v[r], i[r]) : ahead(v[r], i[r], ov[r], oi[r])) {
          v[r] = ov[r];
          i[r] = oi[r];
        }
    }
  }
}

// The best 32 of two sorted runs of 32 (each best first, one pair per lane):
// (v, i) becomes them, best first. The elementwise better of the one run and
// the other reversed is bitonic; five exchanges sort it.
template <int U = 32>
__device__ __forceinline__ void warp_merge(float& v, int& i, float bv, int bi) {
  const int lane = threadIdx.x & 31;
  const float rv = __shfl_sync(0xffffffffu, bv, 31 - lane);
  const int ri = __shfl_sync(0xffffffffu, bi, 31 - lane);
  if (ahead(rv, ri, v, i)) { v = rv; i = ri; }
#pragma unroll U
  for (int j = 16; j > 0; j >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, j);
    const int oi = __shfl_xor_sync(0xffffffffu, i, j);
    if (((lane & j) == 0) ? ahead(ov, oi, v, i) : ahead(v, i, ov, oi)) { v = ov; i = oi; }
  }
}

// Warp 0's (v, i) becomes the best 32 of the block's warps' runs (each best
// first): the runs through shared memory (sv / si, 32 per warp), merged in
// warp order, or (TREE) pairwise, half the warps taking the other half's
// runs each level (three merges in a row instead of seven; the best 32 by
// `ahead`, a total order, do not depend on the order of the merges). Every
// thread calls it.
template <int U = 32, bool TREE = false>
__device__ __forceinline__ void merge_runs(float& v, int& i, float* sv, int* si) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if constexpr (TREE) {
    // level `half`: warps [half, 2 half) publish, warps [0, half) merge them
    // (each level's slots its own: no slot is written after a level read it)
    auto level = [&](int half) {
      if (warp >= half && warp < 2 * half) {
        sv[warp * 32 + lane] = v;
        si[warp * 32 + lane] = i;
      }
      __syncthreads();
      if (warp < half) warp_merge<U>(v, i, sv[(warp + half) * 32 + lane], si[(warp + half) * 32 + lane]);
    };
    if constexpr (U == 1) {
#pragma unroll 1
      for (int half = SP_THREADS / 64; half > 0; half >>= 1) level(half);
    } else {
      for (int half = SP_THREADS / 64; half > 0; half >>= 1) level(half);
    }
    return;
  }
  sv[warp * 32 + lane] = v;
  si[warp * 32 + lane] = i;
  __syncthreads();
  if (warp == 0) {  // (U > 1: no pragma, the compiler's choice, as measured)
    if constexpr (U == 1) {
#pragma unroll 1
      for (int w = 1; w < SP_THREADS / 32; ++w) warp_merge<U>(v, i, sv[w * 32 + lane], si[w * 32 + lane]);
    } else {
      for (int w = 1; w < SP_THREADS / 32; ++w) warp_merge<U>(v, i, sv[w * 32 + lane], si[w * 32 + lane]);
    }
  }
}

__device__ __forceinline__ unsigned int mix32(unsigned int x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  return x ^ (x >> 16);
}

// specpipe.sampling.step_uniforms
__device__ __forceinline__ float step_uniform(unsigned int seed, unsigned int step) {
  unsigned int h = mix32(mix32(seed ^ 0x9E3779B9u) + step);
  h = mix32(h ^ 0x85EBCA6Bu);
  return ((float)(h >> 8) + 0.5f) * (1.0f / 16777216.0f);
}

}  // namespace specpipe_mtp
""".replace("@STAMPS@", str(PHASE_STAMPS)).replace("@INNER@", str(INNER_STAMPS))

_SOURCE = r"""
  using namespace specpipe_mtp;
  using W = T;
  constexpr int NWARP = 8;
  constexpr int QKVN = 2 * HQ * D + 2 * HKV * D;
  constexpr int DPL = D / 32;
  constexpr int HALF = ROT / 2;
  constexpr int GROUP = HQ / HKV;
  constexpr int KC = GREEDY ? 1 : TOPK;
  constexpr int SU = TIGHT_DRAW ? 1 : 32;  // a sampled step's sorts and draw unrolled, or compact
  constexpr bool TREE = TREE_MERGE;
  constexpr int AU = ATT_UNROLL;
  // The launch's small per-row inputs, read once into shared memory at the
  // start, all loads in flight together (the host writes them each round:
  // unified memory a first GPU read may have to fetch from the host; read
  // later, phase by phase, each such read stalled its phase).
  __shared__ int s_in_ids[M], s_in_last[B], s_in_start[B], s_in_steps;
  __shared__ unsigned int s_in_seed[B], s_in_step[B];
  // DERIVE: a round's per-row inputs derived on the device from the last
  // round's (no host-written input: MLX keeps arrays made from host values
  // in host memory, which a kernel reads across the bus, or in pages the
  // first device read migrates): its accepted count (the leading drafts the
  // verify window's draws agree with), the tail's ids (those draws up to the
  // bonus token, padded with it), the start one past the last round's tail,
  // the step key moved by the tokens the round emitted
  if (DERIVE) {
    if (threadIdx.x < B) {
      const int b = threadIdx.x, dp = drafts_shape[1], sw = samples_shape[1];
      int a = 0;
      while (a < dp && (int)drafts[b * dp + a] == (int)samples[b * sw + a]) ++a;
      s_in_last[b] = a;
      s_in_start[b] = (int)(prev[b * 4] + prev[b * 4 + 1] + 1u);
      s_in_step[b] = prev[b * 4 + 2] + (unsigned int)a + 1u;
      s_in_seed[b] = prev[b * 4 + 3];
    }
    __syncthreads();
    if (threadIdx.x < M) {
      const int b = threadIdx.x / TT, t = threadIdx.x % TT;
      s_in_ids[threadIdx.x] = (int)samples[b * samples_shape[1] + min(t, s_in_last[b])];
    }
  } else {
    if (threadIdx.x < M) s_in_ids[threadIdx.x] = ids[threadIdx.x];
    if (threadIdx.x < B) {
      s_in_last[threadIdx.x] = TT == 1 ? 0 : last[threadIdx.x];
      s_in_start[threadIdx.x] = starts[threadIdx.x];
      s_in_seed[threadIdx.x] = seeds[threadIdx.x];
      s_in_step[threadIdx.x] = steps[threadIdx.x];
    }
  }
  if (threadIdx.x == 0) s_in_steps = nsteps[0];
  __syncthreads();
  if (blockIdx.x == 0 && threadIdx.x < B) {  // this launch's inputs, for the next one to derive from
    const int b = threadIdx.x;
    state[b * 4] = (unsigned int)s_in_start[b];
    state[b * 4 + 1] = (unsigned int)s_in_last[b];
    state[b * 4 + 2] = s_in_step[b];
    state[b * 4 + 3] = s_in_seed[b];
  }
  // steps of this launch (a value, not a template constant: one compiled
  // kernel serves every chain length)
  const int STEPS = s_in_steps;
  const int KW = TT + STEPS - 1;  // window slots of knew / vnew (without KV_OUT)
  constexpr size_t PF_CAP = 24u << 20;  // bytes of one array prefetched ahead, at most
  constexpr size_t PF_HEAD = 128u << 10;  // bytes of a block's projection rows prefetched ahead
  constexpr size_t WB = sizeof(W);
  constexpr size_t O_H0 = 0;
  constexpr size_t O_QKV = O_H0 + align8((size_t)M * H);
  constexpr size_t O_ATT = O_QKV + align8((size_t)M * QKVN);
  // attention partials per (row, head, split): max, sum, D weighted values
  constexpr int SPLITS = NBLK / (B * HQ) > 0 ? NBLK / (B * HQ) : 1;
  constexpr int PART = D + 2;
  // ATT_GROUPED (where a kv head's query heads fit a block's warps): per
  // (row, kv head) splits instead, GROUP heads' partials each
  constexpr bool GROUPED = ATT_GROUPED && GROUP <= NWARP;
  constexpr int GSPLITS = NBLK / (B * HKV) > 0 ? NBLK / (B * HKV) : 1;
  // each (row, head)'s splits combined, times sigmoid(gate): o_proj's input
  constexpr size_t O_COMB = O_ATT + align8((size_t)B * HQ * (GROUPED ? GSPLITS : SPLITS) * PART);
  constexpr size_t O_R1 = O_COMB + align8((size_t)B * HQ * D);
  constexpr size_t O_ACT = O_R1 + align8((size_t)B * H);
  // MoE: router logits and shared gate [B, E + 1] | shared act [B, IS] |
  // expert act [B, KE, IE] | expert weights [B, KE] | expert ids [B, KE]
  constexpr size_t O_ROUT = O_ACT;
  constexpr size_t O_SACT = O_ROUT + align8((size_t)B * (E + 1));
  constexpr size_t O_EACT = O_SACT + align8((size_t)B * IS);
  constexpr size_t O_EW = O_EACT + align8((size_t)B * KE * IE);
  constexpr size_t O_EI = O_EW + align8((size_t)B * KE);
  constexpr size_t ACTN = DENSE ? align8((size_t)B * IM) : (O_EI + align8((size_t)B * KE) - O_ACT);
  constexpr size_t O_R2 = O_ACT + ACTN;
  constexpr size_t O_CV = O_R2 + align8((size_t)B * H);
  constexpr size_t O_CI = O_CV + align8((size_t)B * NBLK * KC);
  constexpr int CHUNK = (V + NBLK - 1) / NBLK;
  // FOLD: the router's (and the shared gate's) logits before the norm's
  // scale, each block's share of them: [B, E + 1, NBLK]
  constexpr int EP = E + 1;
  constexpr size_t O_RP = O_CI + align8((size_t)B * NBLK * KC);
  constexpr size_t O_TS = O_RP + (FOLD ? align8((size_t)B * EP * NBLK) : 0);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int blk = blockIdx.x;
  const int gwarp = blk * NWARP + warp;
  constexpr int NW = NBLK * NWARP;
  const int C = keys_shape[2];
  const float eps = fparams[0];
  float* S = scratch;
  u64* bar = (u64*)(sync);
  u64 goal = 0;
  bool gave_up = false;

  extern __shared__ __align__(16) float dyn[];  // the head's normed inputs [B, H], then logits
  __shared__ float red[NWARP];
  __shared__ float s_m[NWARP], s_l[NWARP];
  __shared__ float s_acc[NWARP][D];
  constexpr int TOPN = NWARP * (B > 32 ? B : 32);  // (greedy: B per warp; sampled: a run of 32)
  __shared__ float s_topv[TOPN];
  __shared__ int s_topi[TOPN];
  __shared__ int s_tok[B];  // a step's tokens, drawn by every block
  __shared__ bool s_crowded;  // DRAW_HEADS: the blocks' heads not enough
  __shared__ int s_eid[B][KE > 0 ? KE : 1];
  __shared__ float s_split[2 * SPLITS];  // a combining block's split (max, sum)s, then weights
  __shared__ bool s_combines;
  __shared__ int s_ticket;  // GROUPED: a split's arrival order
  __shared__ float s_ew[B][KE > 0 ? KE : 1];
  __shared__ float s_inv[B], s_rlog[FOLD ? B * EP : 1];  // FOLD: the norm's scale, the router's logits

  if (tid == 0) {  // launches run one after another: the counter is a
    // multiple of NBLK at each start, and no block passes the first barrier
    // before this one arrives
    const u64 c = *(volatile u64*)bar;
    goal = c - c % (u64)NBLK;
  }
  // PROFILE: every block stamps the time (the global timer's low 32 bits,
  // ns) at its start, on arriving at and leaving each grid barrier, and at
  // its end, PHASE_STAMPS per block at the scratch's end
  // (the launch's LAST step: after the first, its code has run once on
  // every multiprocessor, as in a round's chained steps)
  int stamps = 0;
  bool profiling = PROFILE && STEPS == 1;
  auto stamp_at = [&](int slot) {  // this block's stamp `slot`, when profiling
    if (profiling && tid == 0)
      S[O_TS + (size_t)blk * PHASE_STAMPS + slot] = __uint_as_float((unsigned int)now_ns());
  };
  auto stamp = [&]() {
    if (stamps < PHASE_STAMPS - INNER_STAMPS) stamp_at(stamps);
    ++stamps;
  };
  auto barrier = [&]() {
    stamp();
    grid_sync<ACQ_REL_BARRIER>(bar, goal, gave_up);
    stamp();
  };
  // PROFILE, the last step: stamp k (< INNER_STAMPS) of points within the
  // phases (after a phase's inputs are staged, where its product starts)
  auto mark = [&](int k) { stamp_at(PHASE_STAMPS - INNER_STAMPS + k); };
  stamp();

  // this block's first projection rows (its chunk of phase 7)
  auto prefetch_head = [&]() {
    const int first = blk * CHUNK;
    if (first < V)
      prefetch_range(w_head + (size_t)first * H,
                     min((size_t)min(CHUNK, V - first) * H * WB, PF_HEAD));
  };
  // the products' weight rows (row r, weight row j of it)
  auto fc_row = [&](int r, int) { return w_fc + (size_t)r * 2 * H; };
  auto qkv_row = [&](int r, int) { return w_qkv + (size_t)r * H; };
  auto o_row = [&](int r, int) { return w_o + (size_t)r * HQ * D; };
  auto mlp1_row = [&](int r, int) { return mlp1 + (size_t)r * IM; };
  // the projection: this block's chunk of the head's rows, two adjacent rows
  // per warp (more loads in flight; an odd last row pairs with itself and
  // its second sum is dropped)
  const int h_lo = blk * CHUNK, h_hi = min(V, h_lo + CHUNK);
  const int h_pairs = (max(0, h_hi - h_lo) + 1) / 2;
  auto head_row = [&](int q, int j) { return w_head + (size_t)min(h_lo + 2 * q + j, h_hi - 1) * H; };
  float* xs = dyn;  // each phase's staged input vectors
  constexpr int NGH = groups8(H);
#pragma unroll 1
  for (int s = 0; s < STEPS; ++s) {  // chained steps: each drafts from the last
  if (PROFILE && s > 0 && s == STEPS - 1) {  // the profiled step starts
    profiling = true;
    stamps = 0;
    stamp();
  }
  // ---- 1. fc over [norm(embed(token)), norm(hidden)], every position -----
  if (PREFETCH && tid == 0) prefetch_share(w_qkv, (size_t)QKVN * H * WB, PF_CAP);
  // (step s > 0: the previous step's token and normed output, this launch's)
  #pragma unroll 1
  for (int m = 0; m < M; ++m) {
    // (a later step's window positions all take the row's one pair: their
    // duplicate products cost no extra weight reads)
    const int id = s == 0 ? s_in_ids[m]
                          : s_tok[m / TT];
    const W* e = embed + (size_t)id * H;
    const W* h = s == 0 ? hid + (size_t)m * H : normed + (size_t)(m / TT) * H;
    float ev[NGH][8], hv[NGH][8];
    float se = 0.0f, sh = 0.0f;
#pragma unroll
    for (int g = 0; g < NGH; ++g) {
      const int k = (tid + g * SP_THREADS) * 8;
      if (k < H) {
        load8(e + k, ev[g]);
        if (s == 0) load8(h + k, hv[g]);
        else load_n<W, 8, true>(h + k, hv[g]);
#pragma unroll
        for (int i = 0; i < 8; ++i) { se += ev[g][i] * ev[g][i]; sh += hv[g][i] * hv[g][i]; }
      }
    }
    const float ie = rsqrtf(block_sum(se, red) / H + eps);
    float ih = rsqrtf(block_sum(sh, red) / H + eps);
    if (FIRST && s == 0) {  // the target's final norm first, then the head's
      float s2 = 0.0f;
#pragma unroll
      for (int g = 0; g < NGH; ++g) {
        const int k = (tid + g * SP_THREADS) * 8;
        if (k < H) {
          float wf[8];
          load8(w_final + k, wf);
#pragma unroll
          for (int i = 0; i < 8; ++i) { hv[g][i] *= ih * wf[i]; s2 += hv[g][i] * hv[g][i]; }
        }
      }
      ih = rsqrtf(block_sum(s2, red) / H + eps);
    }
#pragma unroll
    for (int g = 0; g < NGH; ++g) {
      const int k = (tid + g * SP_THREADS) * 8;
      if (k < H) {
        float we[8], wh[8];
        load8(w_norm_e + k, we);
        load8(w_norm_h + k, wh);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          xs[(size_t)m * 2 * H + k + i] = ev[g][i] * ie * we[i];
          xs[(size_t)m * 2 * H + H + k + i] = hv[g][i] * ih * wh[i];
        }
      }
    }
  }
  __syncthreads();
  mark(0);
  if (KV_OUT && s == 0) {
    // KV_OUT: knew / vnew are the new whole buffers: the cache copied (the
    // window's slots are written after this phase's barrier)
    const uint4* ks = reinterpret_cast<const uint4*>(keys);
    const uint4* vs = reinterpret_cast<const uint4*>(values);
    uint4* kd = reinterpret_cast<uint4*>(knew);
    uint4* vd = reinterpret_cast<uint4*>(vnew);
    constexpr size_t GRID = (size_t)NBLK * SP_THREADS;
    const size_t n = (size_t)B * HKV * C * D / 8;  // 16-byte vectors of 8 elements
    if constexpr (COPY_UNROLL > 1) {
      // COPY_UNROLL vectors of keys and of values per thread in flight at once
      constexpr int CU = COPY_UNROLL;
#pragma unroll 1
      for (size_t i0 = (size_t)blk * SP_THREADS + tid; i0 < n; i0 += CU * GRID) {
        uint4 a[CU], c[CU];
#pragma unroll
        for (int u = 0; u < CU; ++u) {
          const size_t i = i0 + u * GRID;
          if (i < n) { a[u] = __ldg(ks + i); c[u] = __ldg(vs + i); }
        }
#pragma unroll
        for (int u = 0; u < CU; ++u) {
          const size_t i = i0 + u * GRID;
          if (i < n) { kd[i] = a[u]; vd[i] = c[u]; }
        }
      }
    } else {
#pragma unroll 1
      for (size_t i = (size_t)blk * SP_THREADS + tid; i < n; i += GRID) {
        const uint4 a = __ldg(ks + i), c = __ldg(vs + i);
        kd[i] = a;
        vd[i] = c;
      }
    }
  }
  product<W, M, 1, PAIR_ROWS, WIDE_LOADS, EVICT_ALL, KEEP_FC>(
      H, 2 * H, gwarp, NW, fc_row,
      [&](int v, int, int k, float* x) { smem8(xs + (size_t)v * 2 * H + k, x); },
      [&](int r, float (&acc)[M][1]) {
        if (lane == 0)
          for (int v = 0; v < M; ++v) S[O_H0 + (size_t)v * H + r] = acc[v][0];
      },
      KEEP_FC && s + 1 < STEPS);
  barrier();

  // ---- 2. q(+gate), k, v of every position ---------------------------------
  // Row b's attention splits this step (per query head), of `positions`
  // positions: ATT_SHARE > 0, at most SPLITS of at least ATT_SHARE each (a
  // short context's one split combines its own warps' partials and stores
  // the head's output: no cross-block combine)
  auto splits_for = [&](int positions) {
    return ATT_SHARE > 0 ? min(SPLITS, max(1, (positions + ATT_SHARE - 1) / ATT_SHARE)) : SPLITS;
  };
  // each row's query vector of this step
  auto query_vec = [&](int b) { return b * TT + s_in_last[b]; };
  stage_normed<W, H>(xs, S + O_H0, M, w_in, eps, red, nullptr);
  mark(1);
  product<W, M, 1, PAIR_ROWS, WIDE_LOADS, EVICT_ALL, KEEP_QKV>(
      QKVN, H, gwarp, NW, qkv_row,
      [&](int v, int, int k, float* x) { smem8(xs + (size_t)v * H + k, x); },
      [&](int r, float (&acc)[M][1]) {
        if (lane == 0)
          for (int v = 0; v < M; ++v) S[O_QKV + (size_t)v * QKVN + r] = acc[v][0];
      },
      KEEP_QKV && s + 1 < STEPS);
  barrier();

  // ---- 3. attention of each row's last position ---------------------------
  if (PREFETCH && tid == 0) prefetch_share(w_o, (size_t)H * HQ * D * WB, PF_CAP);
  // A warp holds DPL consecutive dims per lane; RoPE pairs dim d < HALF with
  // d + HALF, HALF / DPL lanes away. Lane j computes the angles of the
  // frequencies j, j + 32, ... once and the lanes that rotate read them by
  // shuffle (one sincosf per lane: unrolled per dim, as inlined code at
  // every call site, the rotation was a quarter of the kernel's code).
  constexpr int NF = (HALF + 31) / 32;
  // (`marks` >= 0: inner stamps `marks` after the norm and `marks` + 1
  // after the angles)
  auto normed_roped = [&](const float* src, const W* wn, int pos, float* x, int marks) {
    float ss = 0.0f;
#pragma unroll
    for (int i = 0; i < DPL; ++i) { x[i] = __ldcg(src + lane * DPL + i); ss += x[i] * x[i]; }
    const float inv = rsqrtf(warp_sum(ss) / D + eps);
#pragma unroll
    for (int i = 0; i < DPL; ++i) x[i] *= inv * static_cast<float>(wn[lane * DPL + i]);
    if (marks >= 0) mark(marks);
    float sn_f[NF], cs_f[NF];
#pragma unroll
    for (int c = 0; c < NF; ++c) {
      const int f = lane + 32 * c;
      sn_f[c] = 0.0f;
      cs_f[c] = 1.0f;
      if (f < HALF) {
        // FAST_SINCOS (a diagnostic arm): the hardware approximation,
        // without sincosf's range reduction code
        if (FAST_SINCOS) __sincosf((float)pos * inv_freq[f], &sn_f[c], &cs_f[c]);
        else sincosf((float)pos * inv_freq[f], &sn_f[c], &cs_f[c]);
      }
    }
    if (marks >= 0) mark(marks + 1);
    constexpr int OFF = HALF / DPL;
#pragma unroll
    for (int i = 0; i < DPL; ++i) {
      const int d = lane * DPL + i;
      const int src_lane = d < HALF ? lane + OFF : (d < ROT ? lane - OFF : lane);
      const float other = __shfl_sync(0xffffffffu, x[i], src_lane & 31);
      const int f = d < HALF ? d : (d < ROT ? d - HALF : 0);
      float sn = 0.0f, cs = 1.0f;
#pragma unroll
      for (int c = 0; c < NF; ++c) {
        const float sc = __shfl_sync(0xffffffffu, sn_f[c], f & 31);
        const float cc = __shfl_sync(0xffffffffu, cs_f[c], f & 31);
        if ((f >> 5) == c) { sn = sc; cs = cc; }
      }
      if (d < ROT) x[i] = d < HALF ? x[i] * cs - other * sn : x[i] * cs + other * sn;
    }
  };
  const float scale = rsqrtf((float)D);
  // a window position's key (normed, roped at `pos`) and value of kv head g
  // from its q/k/v row, rounded to the weights' dtype as the cache holds them
  auto window_kv = [&](const float* row, int g, int pos, float* k, float* v) {
    normed_roped(row + 2 * HQ * D + g * D, w_kn, pos, k, -1);
#pragma unroll
    for (int i = 0; i < DPL; ++i) {
      k[i] = static_cast<float>(static_cast<W>(k[i]));
      v[i] = static_cast<float>(static_cast<W>(__ldcg(row + 2 * HQ * D + HKV * D + g * D + lane * DPL + i)));
    }
  };
  // online softmax (max mx_, sum l, weighted values acc) over n positions,
  // AU per iteration from position j_first on, every j_step (u_step apart
  // within an iteration): `kv(j, kr, vr)` loads position j's key and value
  // (packed, DPL elements of W each), all AU loads in flight together, the
  // dots reduced by interleaved shuffles, one rescale per AU positions
  using KV = typename Packed<DPL * sizeof(W)>::type;
  auto attend = [&](const float (&q)[DPL], int n, int j_first, int j_step, int u_step, auto&& kv,
                    float& mx_, float& l, float (&acc)[DPL]) {
    // the AU positions from j0 on (SPREAD, past the end: no load, zeros)
    auto fetch = [&](int j0, KV (&kf)[AU], KV (&vf)[AU]) {
#pragma unroll
      for (int u = 0; u < AU; ++u) {
        const int j = j0 + u * u_step;
        if (!SPREAD || j < n) kv(min(j, n - 1), kf[u], vf[u]);
        else { kf[u] = KV{}; vf[u] = KV{}; }
      }
    };
    // (held as loaded, converted where used: half the registers of
    // floats; at head_dim 256 and eight positions the floats took the
    // kernel to 254 registers, packed 168-182, at the same time per launch)
    KV kr[AU], vr[AU];
    // PIPE (`ATT_PIPE`): the next iteration's loads in flight during this one
    if (PIPE && j_first < n) fetch(j_first, kr, vr);
    for (int j0 = j_first; j0 < n; j0 += j_step) {
      KV kn[AU], vn[AU];
      if (!PIPE) fetch(j0, kr, vr);
      else if (j0 + j_step < n) fetch(j0 + j_step, kn, vn);
      float dots[AU];
#pragma unroll
      for (int u = 0; u < AU; ++u) {
        float k[DPL];
        unpack_n<W, DPL>(kr[u], k);
        dots[u] = 0.0f;
#pragma unroll
        for (int i = 0; i < DPL; ++i) dots[u] += q[i] * k[i];
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1)
#pragma unroll
        for (int u = 0; u < AU; ++u) dots[u] += __shfl_xor_sync(0xffffffffu, dots[u], o);
      float mnew = mx_;
#pragma unroll
      for (int u = 0; u < AU; ++u)
        if (j0 + u * u_step < n) mnew = fmaxf(mnew, dots[u]);
      const float corr = expf(mx_ - mnew);
      l *= corr;
#pragma unroll
      for (int i = 0; i < DPL; ++i) acc[i] *= corr;
#pragma unroll
      for (int u = 0; u < AU; ++u) {
        const float e = j0 + u * u_step < n ? expf(dots[u] - mnew) : 0.0f;
        l += e;
        float v[DPL];
        unpack_n<W, DPL>(vr[u], v);
#pragma unroll
        for (int i = 0; i < DPL; ++i) acc[i] += e * v[i];
      }
      mx_ = mnew;
      if (PIPE) {
#pragma unroll
        for (int u = 0; u < AU; ++u) { kr[u] = kn[u]; vr[u] = vn[u]; }
      }
    }
  };
  // position j's key and value, packed loads: of the cache (read-only for
  // the launch) from position a0 of cache row `row`, or of a tile staged in
  // shared memory ([positions, D] keys at k, values at v)
  auto cached_kv = [&](size_t row, int a0) {
    return [=](int j, KV& kr, KV& vr) {
      const size_t at = (row + a0 + j) * D + lane * DPL;
      kr = load_packed<W, DPL>(keys + at);
      vr = load_packed<W, DPL>(values + at);
    };
  };
  auto shared_kv = [&](const W* k, const W* v) {
    return [=](int j, KV& kr, KV& vr) {
      kr = *reinterpret_cast<const KV*>(k + j * D + lane * DPL);
      vr = *reinterpret_cast<const KV*>(v + j * D + lane * DPL);
    };
  };
  // step s (s > 0: a chained step) sits s positions after the first step's
  // query, at window slot lb + s: the window's slots below it hold the first
  // step's keys / values (0 .. TT - 1) overwritten from lb + 1 on by the
  // later steps' (knew, vnew, this launch's)
  if constexpr (GROUPED) {
    // GROUPED (`ATT_GROUPED`): items (row, kv head, split); a block stages
    // its split's cached keys and values in shared memory, TP positions a
    // tile (cp.async, the next tile's copies in flight while the warps read
    // the last), and its warps attend for the group's GROUP query heads
    // (warp w: head w % GROUP, every NSUB-th group of AU positions): each
    // key and value crosses DRAM and L2 once per step instead of once per
    // query head. Split 0 also takes the window's slots (computed, stored
    // for the cache, attended from shared memory). Each (row, head)'s splits
    // are combined by one of the group's first min(splits, GROUP) blocks
    // to finish, once all have (a counter tagged with the step's grid
    // barrier target: nothing to reset, no stale count from an earlier
    // launch).
    constexpr int NSUB = NWARP / GROUP;
    constexpr int TP = ATT_TILE;
    constexpr int TILE = TP * D;  // elements of a tile's keys (and of its values)
    constexpr int CH = 16 / (int)sizeof(W);  // elements per 16-byte copy
    W* tiles = reinterpret_cast<W*>(dyn);  // 2 stages of [keys TP x D | values TP x D]
    const int hw = warp % GROUP, sub = warp / GROUP;
    const bool active = warp < NSUB * GROUP;
    for (int item = blk; item < B * HKV * GSPLITS; item += NBLK) {
      const int split = item % GSPLITS, bg = item / GSPLITS;
      const int b = bg / HKV, g = bg % HKV, hq = g * GROUP + hw;
      const int lb = s_in_last[b], st0 = s_in_start[b], qslot = lb + s;
      const int mq = b * TT + lb;
      // splits of the row's cached positions: at least ATT_MIN_SHARE each
      const int nsp = min(GSPLITS, max(1, (st0 + ATT_MIN_SHARE - 1) / ATT_MIN_SHARE));
      if (split >= nsp) continue;  // (the whole block)
      const size_t window_row = KV_OUT ? ((size_t)b * HKV + g) * C + st0 : ((size_t)b * HKV + g) * KW;
      const size_t cache_row = ((size_t)b * HKV + g) * C;
      const int share = (st0 + nsp - 1) / nsp;
      const int a0 = split * share, n_c = max(0, min(st0, a0 + share) - a0);
      const int ntiles = (n_c + TP - 1) / TP;
      auto issue = [&](int t) {  // tile t of the split's positions into stage t & 1
        W* sk = tiles + (size_t)(t & 1) * 2 * TILE;
        const int np = min(TP, n_c - t * TP);
        const W* gk = keys + (cache_row + a0 + t * TP) * D;
        const W* gv = values + (cache_row + a0 + t * TP) * D;
        for (int i = tid; i < np * D / CH; i += SP_STRIDE) {
          cp_async16(sk + i * CH, gk + i * CH);
          cp_async16(sk + TILE + i * CH, gv + i * CH);
        }
        cp_async_commit();
      };
      if (ntiles > 0) issue(0);
      float q[DPL];
      normed_roped(S + O_QKV + (size_t)mq * QKVN + (size_t)hq * 2 * D, w_qn, st0 + qslot, q,
                   item == blk ? 8 : -1);
#pragma unroll
      for (int i = 0; i < DPL; ++i) q[i] *= scale;
      if (item == blk) mark(2);
      float mx_ = -SP_INF, l = 0.0f, acc[DPL];
#pragma unroll
      for (int i = 0; i < DPL; ++i) acc[i] = 0.0f;
      const int j_first = active ? sub * AU : TP, j_step = NSUB * AU;
      if (split == 0) {
        // the window's slots through stage 1 (tile 0 loads into stage 0
        // meanwhile): the first step's TT slots (all stored, 0 .. lb
        // attended), a later step's 0 .. qslot (qslot computed and stored,
        // the slots below it read back); at most TP (the host sees to it:
        // in TP-slot chunks the loop took the kernel to 255 registers)
        const int n_slot = min(TP, s == 0 ? TT : qslot + 1);
        W* wk = tiles + 2 * TILE;
        {
          for (int j = warp; j < n_slot; j += NWARP) {
            float k[DPL], v[DPL];
            if (s > 0 && j < qslot) {  // an earlier step of this launch
              load_n<W, DPL, true>(knew + (window_row + j) * D + lane * DPL, k);
              load_n<W, DPL, true>(vnew + (window_row + j) * D + lane * DPL, v);
            } else {
              window_kv(S + O_QKV + (size_t)(s == 0 ? b * TT + j : mq) * QKVN, g, st0 + j, k, v);
              const size_t at = (window_row + j) * D + lane * DPL;
#pragma unroll
              for (int i = 0; i < DPL; ++i) {
                knew[at + i] = static_cast<W>(k[i]);
                vnew[at + i] = static_cast<W>(v[i]);
              }
            }
#pragma unroll
            for (int i = 0; i < DPL; ++i) {
              wk[j * D + lane * DPL + i] = static_cast<W>(k[i]);
              wk[TILE + j * D + lane * DPL + i] = static_cast<W>(v[i]);
            }
          }
          __syncthreads();
          attend(q, min(qslot + 1, n_slot), j_first, j_step, 1, shared_kv(wk, wk + TILE), mx_, l, acc);
          __syncthreads();
        }
      }
      for (int t = 0; t < ntiles; ++t) {
        if (t + 1 < ntiles) {
          issue(t + 1);
          cp_async_wait<1>();
        } else {
          cp_async_wait<0>();
        }
        __syncthreads();
        const W* sk = tiles + (size_t)(t & 1) * 2 * TILE;
        attend(q, min(TP, n_c - t * TP), j_first, j_step, 1, shared_kv(sk, sk + TILE), mx_, l, acc);
        __syncthreads();
      }
      if (lane == 0) { s_m[warp] = mx_; s_l[warp] = l; }
#pragma unroll
      for (int i = 0; i < DPL; ++i) s_acc[warp][lane * DPL + i] = acc[i];
      __syncthreads();
      if (item == blk) mark(3);
      // this split's partial of each head of the group (its NSUB warps'
      // combined): max, sum, weighted values (unscaled)
      for (int x = tid; x < GROUP * PART; x += SP_STRIDE) {
        const int h = x / PART, d = x % PART;
        float top = -SP_INF;
#pragma unroll
        for (int u = 0; u < NSUB; ++u)
          if (s_l[h + u * GROUP] > 0.0f) top = fmaxf(top, s_m[h + u * GROUP]);
        float r = top;
        if (d > 0) {
          r = 0.0f;
#pragma unroll
          for (int u = 0; u < NSUB; ++u) {
            const int w = h + u * GROUP;
            if (s_l[w] > 0.0f) r += (d == 1 ? s_l[w] : s_acc[w][d - 2]) * expf(s_m[w] - top);
          }
        }
        S[O_ATT + ((size_t)(b * HQ + g * GROUP + h) * GSPLITS + split) * PART + d] = r;
      }
      __threadfence();
      __syncthreads();
      const int n_comb = min(nsp, GROUP);
      if (tid == 0) {
        u64* count = bar + GCOUNT + bg;  // (goal << 16) | splits finished
        u64 old = *(volatile u64*)count;
        while (true) {
          const u64 next = (old >> 16) == goal ? old + 1 : ((goal << 16) | 1ULL);
          const u64 seen = atomicCAS(reinterpret_cast<unsigned long long*>(count), old, next);
          if (seen == old) break;
          old = seen;
        }
        const int ticket = (old >> 16) == goal ? (int)(old & 0xFFFFu) : 0;
        s_ticket = ticket;
        if (ticket < n_comb && !gave_up) {  // a combiner: all splits first
          const u64 t0 = now_ns();
          while (true) {
            const u64 c = *(volatile u64*)count;
            if ((c >> 16) == goal && (int)(c & 0xFFFFu) >= nsp) break;
            if (now_ns() - t0 > 200000000ULL) {
              gave_up = true;
              atomicAdd(bar + 1, 1ULL);
              break;
            }
          }
        }
        __threadfence();
      }
      __syncthreads();
      const int ticket = s_ticket;
      float* wts = dyn;  // (the tiles are spent) each split's weight exp(max_s - max) / sum
      for (int h = ticket; h < GROUP && ticket < n_comb; h += n_comb) {
        const int bh = b * HQ + g * GROUP + h;
        const float* parts = S + O_ATT + (size_t)bh * GSPLITS * PART;
        // (every split's loads in flight at once: up to 66 splits at one
        // row, each a round trip to L2 on the phase's critical path)
        if (warp == 0) {
          constexpr int SPL = (GSPLITS + 31) / 32;  // splits per lane
          float pm[SPL], pl[SPL];
#pragma unroll
          for (int u = 0; u < SPL; ++u) {
            const int sp = lane + 32 * u;
            pl[u] = sp < nsp ? __ldcg(parts + sp * PART + 1) : 0.0f;
            pm[u] = sp < nsp ? __ldcg(parts + sp * PART) : -SP_INF;
          }
          float top = -SP_INF;
#pragma unroll
          for (int u = 0; u < SPL; ++u)
            if (pl[u] > 0.0f) top = fmaxf(top, pm[u]);
          top = warp_max(top);
          float den = 0.0f;
#pragma unroll
          for (int u = 0; u < SPL; ++u) {
            const float e = pl[u] > 0.0f ? expf(pm[u] - top) : 0.0f;  // 0: an empty split
            if (lane + 32 * u < nsp) wts[lane + 32 * u] = e;
            den += pl[u] * e;
          }
          den = warp_sum(den);
          __syncwarp();
          for (int sp = lane; sp < nsp; sp += 32) wts[sp] /= den;
        }
        __syncthreads();
        const float* gate = S + O_QKV + (size_t)mq * QKVN + (size_t)(g * GROUP + h) * 2 * D + D;
        constexpr int CU = 8;  // splits' loads in flight per thread
        for (int d = tid; d < D; d += SP_STRIDE) {
          float n = 0.0f;
          int sp = 0;
#pragma unroll 1
          for (; sp + CU <= nsp; sp += CU) {
            float x[CU];
#pragma unroll
            for (int u = 0; u < CU; ++u) x[u] = __ldcg(parts + (sp + u) * PART + 2 + d);
#pragma unroll
            for (int u = 0; u < CU; ++u) n += x[u] * wts[sp + u];
          }
#pragma unroll 1
          for (; sp < nsp; ++sp) n += __ldcg(parts + sp * PART + 2 + d) * wts[sp];
          S[O_COMB + (size_t)bh * D + d] = n * sigmoid(__ldcg(gate + d));
        }
        __syncthreads();
      }
    }
  } else {
    // items (row, head, split): a split attends over one contiguous share of
    // the row's positions; phase 4 combines the splits (flash-decoding)
    for (int item = blk; item < B * HQ * SPLITS; item += NBLK) {
      const int split = item % SPLITS, bh = item / SPLITS;
      const int b = bh / HQ, hq = bh % HQ, g = hq / GROUP;
      const int lb = s_in_last[b], st0 = s_in_start[b], qslot = lb + s;
      const int positions = st0 + qslot + 1, nsp = splits_for(positions);
      if (split >= nsp) continue;  // (the whole block)
      const int mq = query_vec(b);  // every step's query row (later steps: all rows alike)
      // slot 0 of the window in knew / vnew (KV_OUT: whole buffers, at the start)
      const size_t window_row = KV_OUT ? ((size_t)b * HKV + g) * C + st0 : ((size_t)b * HKV + g) * KW;
      float q[DPL];
      normed_roped(S + O_QKV + (size_t)mq * QKVN + (size_t)hq * 2 * D, w_qn, st0 + qslot, q,
                   item == blk ? 8 : -1);
  #pragma unroll
      for (int i = 0; i < DPL; ++i) q[i] *= scale;
      if (item == blk) mark(2);
      float mx_ = -SP_INF, l = 0.0f, acc[DPL];
  #pragma unroll
      for (int i = 0; i < DPL; ++i) acc[i] = 0.0f;
      const size_t cache_row = ((size_t)b * HKV + g) * C;
      const int share = (positions + nsp - 1) / nsp;
      const int a0 = split * share, n_att = max(0, min(positions, a0 + share) - a0);
      // AU > 1 (`ATT_UNROLL`): the split's positions in the cache (before
      // the window's) AU per warp at once (`attend_cached`)
      const int wa0 = AU > 1 ? max(a0, min(st0, a0 + n_att)) : a0;  // the rest from here on
      if constexpr (AU > 1)
        attend(q, wa0 - a0, SPREAD ? warp : warp * AU, NWARP * AU, SPREAD ? NWARP : 1,
               cached_kv(cache_row, a0), mx_, l, acc);
      // one loop, one copy of the window keys' code: first the window slots
      // this item stores for head g (split 0 of its group's first head: the
      // step's own slots), then the positions it attends over (from wa0 on)
      const int n_store = (hq % GROUP == 0 && split == 0) ? (s == 0 ? TT : 1) : 0;
      const int n_rest = a0 + n_att - wa0;
      for (int j = warp; j < n_store + n_rest; j += NWARP) {
        const bool store = j < n_store;
        const int p = store ? st0 + (s == 0 ? j : qslot) : wa0 + j - n_store;
        float k[DPL], v[DPL];
        const int slot = p - st0;
        if (slot < 0) {
          load_n<W, DPL, false>(keys + (cache_row + p) * D + lane * DPL, k);
          load_n<W, DPL, false>(values + (cache_row + p) * D + lane * DPL, v);
        } else if (s > 0 && slot < qslot) {  // an earlier step of this launch
          load_n<W, DPL, true>(knew + (window_row + slot) * D + lane * DPL, k);
          load_n<W, DPL, true>(vnew + (window_row + slot) * D + lane * DPL, v);
        } else {
          window_kv(S + O_QKV + (size_t)(s == 0 ? b * TT + slot : mq) * QKVN, g, p, k, v);
        }
        if (store) {
          const size_t at = (window_row + slot) * D + lane * DPL;
  #pragma unroll
          for (int i = 0; i < DPL; ++i) {
            knew[at + i] = static_cast<W>(k[i]);
            vnew[at + i] = static_cast<W>(v[i]);
          }
          continue;
        }
        float dot = 0.0f;
  #pragma unroll
        for (int i = 0; i < DPL; ++i) dot += q[i] * k[i];
        dot = warp_sum(dot);
        const float mnew = fmaxf(mx_, dot);
        const float corr = expf(mx_ - mnew);
        const float e = expf(dot - mnew);
        l = l * corr + e;
  #pragma unroll
        for (int i = 0; i < DPL; ++i) acc[i] = acc[i] * corr + e * v[i];
        mx_ = mnew;
      }
      if (lane == 0) { s_m[warp] = mx_; s_l[warp] = l; }
  #pragma unroll
      for (int i = 0; i < DPL; ++i) s_acc[warp][lane * DPL + i] = acc[i];
      __syncthreads();
      if (item == blk) mark(3);
      // this split's partial: its max, its sum, its weighted values (unscaled)
      float top = -SP_INF;
      for (int w = 0; w < NWARP; ++w) top = fmaxf(top, s_l[w] > 0.0f ? s_m[w] : -SP_INF);
      if (ATT_SHARE > 0 && nsp == 1) {
        // the only split: the head's output, weighted as the combine below
        // weights one split (1 / its sum), times sigmoid(gate)
        const float* gate = S + O_QKV + (size_t)mq * QKVN + (size_t)hq * 2 * D + D;
        // (one loop over the warps: each warp's weight taken once for the
        // sum and the output)
        for (int d = tid; d < D; d += SP_THREADS) {
          float den = 0.0f, num = 0.0f;
          for (int w = 0; w < NWARP; ++w)
            if (s_l[w] > 0.0f) {
              const float e = expf(s_m[w] - top);
              den += s_l[w] * e;
              num += s_acc[w][d] * e;
            }
          const float out = 0.0f + num * (1.0f / den);
          S[O_COMB + (size_t)bh * D + d] = out * sigmoid(__ldcg(gate + d));
        }
        __syncthreads();  // (s_m, s_l, s_acc: the block's next item)
        continue;
      }
      float* part = S + O_ATT + (size_t)item * PART;
      for (int d = tid; d < D; d += SP_STRIDE) {
        float num = 0.0f;
        for (int w = 0; w < NWARP; ++w)
          if (s_l[w] > 0.0f) num += s_acc[w][d] * expf(s_m[w] - top);
        part[2 + d] = num;
      }
      if (tid == 0) {
        float den = 0.0f;
        for (int w = 0; w < NWARP; ++w)
          if (s_l[w] > 0.0f) den += s_l[w] * expf(s_m[w] - top);
        part[0] = top;
        part[1] = den;  // 0 for an empty split
      }
      // the last of the (row, head)'s splits to finish combines them (its
      // counter back to 0 for the next step: no split of it is left to count)
      __threadfence();
      __syncthreads();
      if (tid == 0) {
        u64* count = bar + 2 + bh;
        s_combines = atomicAdd(count, 1ULL) == (u64)(nsp - 1);
        if (s_combines) *count = 0ULL;
      }
      __syncthreads();
      if (s_combines) {
        __threadfence();
        const float* parts = S + O_ATT + (size_t)bh * SPLITS * PART;
        if (tid < 2 * SPLITS) s_split[tid] = __ldcg(parts + (tid >> 1) * PART + (tid & 1));
        __syncthreads();
        if (tid == 0) {  // each split's weight exp(max_s - max) / sum
          float top = -SP_INF;
          #pragma unroll 1
          for (int sp = 0; sp < SPLITS; ++sp)
            if (sp < nsp && s_split[2 * sp + 1] > 0.0f) top = fmaxf(top, s_split[2 * sp]);
          float den = 0.0f;
          #pragma unroll 1
          for (int sp = 0; sp < SPLITS; ++sp) {
            const float l = sp < nsp ? s_split[2 * sp + 1] : 0.0f;  // (past nsp: none this step)
            s_split[2 * sp] = l > 0.0f ? expf(s_split[2 * sp] - top) : 0.0f;  // 0: an empty split
            den += l * s_split[2 * sp];
          }
          #pragma unroll 1
          for (int sp = 0; sp < SPLITS; ++sp) s_split[2 * sp] /= den;
        }
        __syncthreads();
        const float* gate = S + O_QKV + (size_t)mq * QKVN + (size_t)hq * 2 * D + D;
        for (int d = tid; d < D; d += SP_STRIDE) {
          float n = 0.0f;
  #pragma unroll
          for (int sp = 0; sp < SPLITS; ++sp)
            if (sp < nsp) n += __ldcg(parts + sp * PART + 2 + d) * s_split[2 * sp];
          S[O_COMB + (size_t)bh * D + d] = n * sigmoid(__ldcg(gate + d));
        }
        __syncthreads();
      }
    }
  }
  // the shared expert's gate (j 0) / up (1) row r % IS
  auto shared_row = [&](int r, int j) { return mlp5 + ((size_t)(r % IS) + (size_t)j * IS) * H; };
  // the MLP's first product, weight row j of its output r: dense, gate
  // (j 0) / up (1) row r; MoE, router row r < E (j == 1 reads the same row),
  // the shared expert's gate (r == E), then its gate / up row r - E - 1
  constexpr int MLP0_ROWS = DENSE ? IM : E + 1 + IS;
  auto mlp0_row = [&](int r, int j) {
    if (DENSE) return mlp0 + ((size_t)r + (size_t)j * IM) * H;
    if (r < E) return mlp0 + (size_t)r * H;
    if (r == E) return mlp1;
    return mlp5 + ((size_t)(r - E - 1) + (size_t)j * IS) * H;
  };
  barrier();

  // ---- 4. o_proj plus the residual ------------------------------------------
  if (PREFETCH && tid == 0) {  // the MLP's first product
    if (DENSE) {
      prefetch_share(mlp0, (size_t)2 * IM * H * WB, PF_CAP);
    } else {
      prefetch_share(mlp0, (size_t)E * H * WB, PF_CAP);
      prefetch_share(mlp5, (size_t)2 * IS * H * WB, PF_CAP);
    }
  }
  // the attention's output (its splits combined by each head's last split)
  stage_l2<B * HQ * D>(xs, S + O_COMB);
  __syncthreads();
  mark(4);
  // FOLD: the router's logits (and the shared expert's gate) are linear in
  // the MoE's input before its norm's scale: sum_r w_rt[r, e] * out[r], with
  // w_rt the router rows times the norm's weights, transposed (float32,
  // [H, E + 1]). Each lane keeps its logits' sums over the warp's rows of
  // this product (lane l: logits l, l + 32, ...; their w_rt read ahead for
  // the warp's first two rows)
  constexpr int EPL = FOLD ? (EP + 31) / 32 : 1;
  float rsum[B][EPL], rt_ahead[2][EPL];
  // the residual o_proj's row r adds to: row b's hidden state at its last token
  auto residual = [&](int b, int r) { return __ldcg(S + O_H0 + (size_t)(b * TT + s_in_last[b]) * H + r); };
#pragma unroll
  for (int j = 0; j < EPL; ++j) {
#pragma unroll
    for (int b = 0; b < B; ++b) rsum[b][j] = 0.0f;
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const int r = gwarp + q * NW, e = lane + 32 * j;
      rt_ahead[q][j] = (FOLD && r < H && e < EP) ? __ldg(w_rt + (size_t)r * EP + e) : 0.0f;
    }
  }
  product<W, B, 1, PAIR_ROWS, WIDE_LOADS, EVICT_ALL, KEEP_O>(
      H, HQ * D, gwarp, NW, o_row,
      [&](int v, int, int k, float* x) { smem8(xs + (size_t)v * HQ * D + k, x); },
      [&](int r, float (&acc)[B][1]) {
        if constexpr (FOLD) {
          const int q = (r - gwarp) / NW;
#pragma unroll
          for (int b = 0; b < B; ++b) {
            const float out = acc[b][0] + residual(b, r);
            if (lane == 0) S[O_R1 + (size_t)b * H + r] = out;
#pragma unroll
            for (int j = 0; j < EPL; ++j) {
              const int e = lane + 32 * j;
              const float wt = q == 0 ? rt_ahead[0][j] : q == 1 ? rt_ahead[1][j]
                             : (e < EP ? __ldg(w_rt + (size_t)r * EP + e) : 0.0f);
              rsum[b][j] += wt * out;
            }
          }
        } else if (lane == 0) {
          for (int b = 0; b < B; ++b) S[O_R1 + (size_t)b * H + r] = acc[b][0] + residual(b, r);
        }
      },
      KEEP_O && s + 1 < STEPS);
  if constexpr (FOLD) {  // the block's share: its warps' sums in warp order
    __syncthreads();  // (xs: the product's input)
#pragma unroll
    for (int b = 0; b < B; ++b)
#pragma unroll
      for (int j = 0; j < EPL; ++j)
        if (lane + 32 * j < EP) xs[((size_t)warp * B + b) * EP + lane + 32 * j] = rsum[b][j];
    __syncthreads();
    for (int t = tid; t < B * EP; t += SP_THREADS) {
      float sum = 0.0f;
      for (int w = 0; w < NWARP; ++w) sum += xs[(size_t)w * B * EP + t];
      S[O_RP + (size_t)t * NBLK + blk] = sum;
    }
  }
  barrier();

  // ---- 5-6. the MLP plus the residual ----------------------------------------
  if (PREFETCH && tid == 0) {  // the MLP's last product (the MoE's shared down)
    if (DENSE) prefetch_share(mlp1, (size_t)H * IM * WB, PF_CAP);
    else prefetch_share(mlp6, (size_t)H * IS * WB, PF_CAP);
  }
  stage_normed<W, H>(xs, S + O_R1, B, w_post, eps, red, nullptr, FOLD ? s_inv : nullptr);
  if constexpr (DENSE) {
    product<W, B, 2, false, WIDE_LOADS, EVICT_ALL>(
        MLP0_ROWS, H, gwarp, NW, mlp0_row,
        [&](int v, int, int k, float* x) { smem8(xs + (size_t)v * H + k, x); },
        [&](int r, float (&acc)[B][2]) {
          if (lane == 0)
            for (int b = 0; b < B; ++b)
              S[O_ACT + (size_t)b * IM + r] = silu(acc[b][0]) * acc[b][1];
        });
    barrier();
    if (PREFETCH && tid == 0) prefetch_head();
    stage_l2<B * IM>(xs, S + O_ACT);
    __syncthreads();
    product<W, B, 1, PAIR_ROWS, WIDE_LOADS, EVICT_ALL>(
        H, IM, gwarp, NW, mlp1_row,
        [&](int v, int, int k, float* x) { smem8(xs + (size_t)v * IM + k, x); },
        [&](int r, float (&acc)[B][1]) {
          if (lane == 0)
            for (int b = 0; b < B; ++b)
              S[O_R2 + (size_t)b * H + r] = acc[b][0] + __ldcg(S + O_R1 + (size_t)b * H + r);
        });
    barrier();
  } else {
    if constexpr (FOLD) {
      // the router's (and the shared gate's) logits: each warp sums its
      // logits' NBLK block shares (lane l: blocks l, l + 32, ...), times the
      // norm's scale; every block the same sums in the same order
#pragma unroll 4
      for (int t = warp; t < B * EP; t += NWARP) {
        float part = 0.0f;
        for (int c = lane; c < NBLK; c += 32) part += __ldcg(S + O_RP + (size_t)t * NBLK + c);
        part = warp_sum(part);
        if (lane == 0) s_rlog[t] = part * s_inv[t / EP];
      }
      __syncthreads();
    } else {
      // router logits (E rows), the shared expert's gate (1), its act (IS pairs)
      product<W, B, 2, false, WIDE_LOADS, EVICT_ALL>(
          MLP0_ROWS, H, gwarp, NW, mlp0_row,
          [&](int v, int, int k, float* x) { smem8(xs + (size_t)v * H + k, x); },
          [&](int r, float (&acc)[B][2]) {
            if (lane == 0)
              for (int b = 0; b < B; ++b) {
                if (r <= E) S[O_ROUT + (size_t)b * (E + 1) + r] = acc[b][0];
                else S[O_SACT + (size_t)b * IS + (r - E - 1)] = silu(acc[b][0]) * acc[b][1];
              }
          });
      barrier();
    }
    // every block: softmax top-KE of each row's router (warp b for row b)
    if (warp < B) {
      const int b = warp;
      const float* lg = S + O_ROUT + (size_t)b * (E + 1);
      // the row's logits read once, lane j holding experts j, j + 32, ...
      constexpr int EPL = (E + 31) / 32;
      float lv[EPL];
      float top = -SP_INF;
#pragma unroll
      for (int j = 0; j < EPL; ++j) {
        const int e = lane + 32 * j;
        lv[j] = e < E ? (FOLD ? s_rlog[b * EP + e] : __ldcg(lg + e)) : -SP_INF;
        if (e < E) top = fmaxf(top, lv[j]);
      }
      top = warp_max(top);
      float z = 0.0f;
#pragma unroll
      for (int j = 0; j < EPL; ++j)
        if (lane + 32 * j < E) z += expf(lv[j] - top);
      z = warp_sum(z);
      mark(10);  // (row 0's warp: its logits read, their max and sum)
      if constexpr (!REDUX_TOPK && EPL <= 4) {
        // each expert's rank among the row's (larger first, ties to the
        // lower id), every lane its EPL experts against all E by shuffles at
        // once: the chosen are the ranks below KE, in the order the KE
        // rounds of a warp argmax (~3.5 us on the H200) picked them
        int rank[EPL];
#pragma unroll
        for (int j = 0; j < EPL; ++j) rank[j] = 0;
        for (int src = 0; src < 32; ++src) {
#pragma unroll
          for (int i = 0; i < EPL; ++i) {
            const float o = __shfl_sync(0xffffffffu, lv[i], src);
            const int oe = src + 32 * i;
#pragma unroll
            for (int j = 0; j < EPL; ++j) {
              const int e = lane + 32 * j;
              rank[j] += oe < E && (o > lv[j] || (o == lv[j] && oe < e));
            }
          }
        }
#pragma unroll
        for (int j = 0; j < EPL; ++j) {
          const int e = lane + 32 * j;
          if (e < E && rank[j] < KE) {
            s_eid[b][rank[j]] = e;
            s_ew[b][rank[j]] = expf(lv[j] - top) / z;
          }
        }
        __syncwarp();
      } else if constexpr (!REDUX_TOPK) {
        // KE rounds of a warp argmax, a chosen expert's bit set in its
        // lane's mask
        unsigned int taken = 0u;
        for (int c = 0; c < KE; ++c) {
          float bv = -SP_INF;
          int bi = 0x7fffffff;
#pragma unroll
          for (int j = 0; j < EPL; ++j) {
            const int e = lane + 32 * j;
            if (e < E && !((taken >> j) & 1u) && (lv[j] > bv || (lv[j] == bv && e < bi))) {
              bv = lv[j];
              bi = e;
            }
          }
          warp_argmax(bv, bi);
          if ((bi & 31) == lane && bi < E) taken |= 1u << (bi >> 5);
          if (lane == 0) { s_eid[b][c] = bi; s_ew[b][c] = expf(bv - top) / z; }
          __syncwarp();
        }
      } else {
        // KE rounds, each taking the largest logit left (ties to the lower
        // id), so the slots come best first. A logit's key is an int in the
        // floats' order (NaN the least), so a round is two one-instruction
        // warp reductions: the largest key, then the lowest id holding it;
        // each lane finds its own best by a tree over its EPL keys, and the
        // winner's key drops to the least (a round past the real experts
        // finds none: its slot gets an id past E, expert 0 below)
        int key[EPL];
#pragma unroll
        for (int j = 0; j < EPL; ++j) key[j] = lane + 32 * j < E ? order_key(lv[j]) : SP_KEY_MIN;
        int kept_key = SP_KEY_MIN, kept_id = 0x7fffffff;  // lane c: round c's
#pragma unroll 1
        for (int c = 0; c < KE; ++c) {
          int tk[EPL], tj[EPL];
#pragma unroll
          for (int j = 0; j < EPL; ++j) { tk[j] = key[j]; tj[j] = j; }
#pragma unroll
          for (int w = 1; w < EPL; w <<= 1)
#pragma unroll
            for (int j = 0; j + w < EPL; j += 2 * w)
              if (tk[j + w] > tk[j]) { tk[j] = tk[j + w]; tj[j] = tj[j + w]; }
          const int top_key = warp_max_int(tk[0]);
          const int won = warp_min_int(tk[0] == top_key ? lane + 32 * tj[0] : 0x7fffffff);
          if (lane == c) { kept_key = top_key; kept_id = top_key == SP_KEY_MIN ? 0x7fffffff : won; }
#pragma unroll
          for (int j = 0; j < EPL; ++j)
            if (lane + 32 * j == won) key[j] = SP_KEY_MIN;
        }
        if (lane < KE) {
          s_eid[b][lane] = kept_id;
          s_ew[b][lane] = kept_key == SP_KEY_MIN ? 0.0f : expf(key_value(kept_key) - top) / z;
        }
        __syncwarp();
      }
      mark(11);  // (the experts chosen)
      // NaN logits (a broken hidden state) tie ranks or are never picked,
      // so a slot may be left as it was (ranks: an earlier step's expert,
      // or before any, whatever the memory held) or past E (the rounds'
      // none): an id outside the experts becomes expert 0, so the experts'
      // loads stay inside their weights (wrong drafts, which verification
      // rejects, never a fault)
      if (lane < KE && (unsigned int)s_eid[b][lane] >= (unsigned int)E) s_eid[b][lane] = 0;
      float total = 0.0f;  // the chosen's mass, summed in their order
      for (int c = 0; c < KE; ++c) total += s_ew[b][c];
      __syncwarp();
      if (NORM_TOPK && lane < KE) s_ew[b][lane] /= total;
      __syncwarp();
      if (blk == 0 && lane < KE) {
        S[O_EW + (size_t)b * KE + lane] = s_ew[b][lane];
        S[O_EI + (size_t)b * KE + lane] = (float)s_eid[b][lane];
      }
    }
    __syncthreads();
    mark(5);
    if (PREFETCH && tid < B * KE)  // the chosen experts' down rows
      prefetch_share(mlp4 + (size_t)s_eid[tid / KE][tid % KE] * H * IE, (size_t)H * IE * WB, PF_CAP);
    // the chosen experts' gate/up: rows (b, c, j); FOLD: then the shared
    // expert's (b, row, j)
    constexpr int ROUTED = B * KE * IE;
    product<W, 1, 2, false, WIDE_LOADS, EVICT_ALL>(
        ROUTED + (FOLD ? B * IS : 0), H, gwarp, NW,
        [&](int r, int j) {
          if (FOLD && r >= ROUTED) return shared_row(r - ROUTED, j);
          const int b = r / (KE * IE), c = (r / IE) % KE, row = r % IE;
          const W* base = j == 0 ? mlp2 : mlp3;
          return base + ((size_t)s_eid[b][c] * IE + row) * H;
        },
        [&](int, int r, int k, float* x) {
          const int b = (FOLD && r >= ROUTED) ? (r - ROUTED) / IS : r / (KE * IE);
          smem8(xs + (size_t)b * H + k, x);
        },
        [&](int r, float (&acc)[1][2]) {
          if (lane == 0) {
            if (FOLD && r >= ROUTED) S[O_SACT + (r - ROUTED)] = silu(acc[0][0]) * acc[0][1];
            else S[O_EACT + r] = silu(acc[0][0]) * acc[0][1];
          }
        });
    barrier();
    // down: per output (b, h) the weighted experts plus the gated shared one
    if (PREFETCH && tid == 0) prefetch_head();
    float* xe = xs;                               // [B, KE, IE]
    float* xsh = xs + (size_t)B * KE * IE;        // [B, IS]
    stage_l2<B * KE * IE>(xe, S + O_EACT);
    stage_l2<B * IS>(xsh, S + O_SACT);
    __syncthreads();
    mark(6);
    constexpr int CH = IE / 256, SCH = IS / 256;  // 16-byte loads per lane per row
    constexpr bool BATCHED = KE * CH + SCH <= 24;     // all of a row's loads at once
    for (int r = gwarp; r < B * H; r += NW) {
      const int b = r / H, hr = r % H;
      const float sg = sigmoid(FOLD ? s_rlog[b * EP + E] : __ldcg(S + O_ROUT + (size_t)b * (E + 1) + E));
      float part = 0.0f;
      if constexpr (BATCHED) {
        uint4 raw[KE * CH + SCH > 0 ? KE * CH + SCH : 1];
#pragma unroll
        for (int c = 0; c < KE; ++c)
#pragma unroll
          for (int q = 0; q < CH; ++q)
            raw[c * CH + q] = load_w<EVICT_ALL>(
                mlp4 + ((size_t)s_eid[b][c] * H + hr) * IE + q * 256 + lane * 8);
#pragma unroll
        for (int q = 0; q < SCH; ++q)
          raw[KE * CH + q] = load_w<EVICT_ALL>(mlp6 + (size_t)hr * IS + q * 256 + lane * 8);
#pragma unroll
        for (int c = 0; c <= KE; ++c) {
          const float weight = c < KE ? s_ew[b][c] : sg;
          const float* xa = c < KE ? xe + ((size_t)b * KE + c) * IE : xsh + (size_t)b * IS;
          float s = 0.0f;
#pragma unroll
          for (int q = 0; q < (c < KE ? CH : SCH); ++q) {
            float x[8];
            smem8(xa + q * 256 + lane * 8, x);
#pragma unroll
            for (int i = 0; i < 8; ++i) s += elem<W>(raw[c * CH + q], i) * x[i];
          }
          part += weight * s;
        }
      } else {
        for (int c = 0; c < KE; ++c) {
          const W* wr = mlp4 + ((size_t)s_eid[b][c] * H + hr) * IE;
          const float* xa = xe + ((size_t)b * KE + c) * IE;
          for (int k = lane * 8; k < IE; k += 256) {
            float w[8], x[8];
            load8(wr + k, w);
            smem8(xa + k, x);
            float s = 0.0f;
#pragma unroll
            for (int i = 0; i < 8; ++i) s += w[i] * x[i];
            part += s_ew[b][c] * s;
          }
        }
        const W* wr = mlp6 + (size_t)hr * IS;
        for (int k = lane * 8; k < IS; k += 256) {
          float w[8], x[8];
          load8(wr + k, w);
          smem8(xsh + (size_t)b * IS + k, x);
          float s = 0.0f;
#pragma unroll
          for (int i = 0; i < 8; ++i) s += w[i] * x[i];
          part += sg * s;
        }
      }
      part = warp_sum(part);
      if (lane == 0) S[O_R2 + (size_t)b * H + hr] = part + __ldcg(S + O_R1 + (size_t)b * H + hr);
    }
    barrier();
  }

  // ---- 7. the head's norm, the projection, each block's candidates -------
  // xs: [B, H] normed; lg: [B, CHUNK] this block's logits (sampled)
  float* lg = dyn + (size_t)B * H;
  stage_normed<W, H>(xs, S + O_R2, B, w_hnorm, eps, red, blk == 0 ? normed : nullptr);
  mark(7);
  const int lo = h_lo, hi = h_hi;
  float best_v[B];
  int best_i[B];
#pragma unroll
  for (int b = 0; b < B; ++b) { best_v[b] = -SP_INF; best_i[b] = 0x7fffffff; }
  product<W, B, 2, false, WIDE_LOADS, EVICT_ALL>(
      h_pairs, H, warp, NWARP, head_row,
      [&](int v, int, int k, float* x) { smem8(xs + (size_t)v * H + k, x); },
      [&](int q, float (&acc)[B][2]) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int r = lo + 2 * q + j;
          if (r >= hi) break;
#pragma unroll
          for (int b = 0; b < B; ++b) {
            if (GREEDY) {
              if (acc[b][j] > best_v[b]) { best_v[b] = acc[b][j]; best_i[b] = r; }
            } else if (lane == 0) {
              lg[(size_t)b * CHUNK + (r - lo)] = acc[b][j];
            }
          }
        }
      });
  // sampled: warp 0's best KC of row b (best first) as this block's candidates
  auto keep_candidates = [&](int b, float tv, int ti) {
    if (warp == 0 && lane < KC) {
      S[O_CV + ((size_t)b * NBLK + blk) * KC + lane] = tv;
      S[O_CI + ((size_t)b * NBLK + blk) * KC + lane] = (float)(tv == -SP_INF ? -1 : ti);
    }
  };
  if constexpr (GREEDY) {
    if (lane == 0)
      for (int b = 0; b < B; ++b) { s_topv[warp * B + b] = best_v[b]; s_topi[warp * B + b] = best_i[b]; }
    __syncthreads();
    if (tid < B) {
      float v = -SP_INF;
      int id = 0x7fffffff;
      for (int w = 0; w < NWARP; ++w) {
        const float ov = s_topv[w * B + tid];
        const int oi = s_topi[w * B + tid];
        if (ov > v || (ov == v && oi < id)) { v = ov; id = oi; }
      }
      S[O_CV + (size_t)tid * NBLK + blk] = v;
      S[O_CI + (size_t)tid * NBLK + blk] = (float)id;
    }
  } else {
    __syncthreads();
    // this block's best KC of each row, best first: every warp sorts its
    // batches of 32 logits into its best 32, then warp 0 merges the warps'
    const int n = hi - lo;
    for (int b = 0; b < B; ++b) {
      const float* vals = lg + (size_t)b * CHUNK;
      float tv = -SP_INF;
      int ti = 0x7fffffff;
      if constexpr (DIAG_NO_SORT) {
        tv = lane < n ? vals[lane] : -SP_INF;
        ti = lane < n ? lo + lane : 0x7fffffff;
      } else {
      for (int p0 = warp * 32; p0 < n; p0 += NWARP * 32) {
        const int p = p0 + lane;
        float v = p < n ? vals[p] : -SP_INF;
        int id = p < n ? lo + p : 0x7fffffff;
        warp_sort<SU>(v, id);
        if (TREE && p0 == warp * 32) {
          tv = v;
          ti = id;
        } else {
          warp_merge<SU>(tv, ti, v, id);
        }
      }
      merge_runs<SU, TREE>(tv, ti, s_topv, s_topi);
      }
      keep_candidates(b, tv, ti);
      __syncthreads();
    }
  }
  barrier();

  // ---- 8. the draw: greedy, every block draws every row (warp b row b:
  // the next step reads its token from shared memory, no grid barrier
  // between); sampled, block b draws row b ----------------------------------
  if (PREFETCH && tid == 0 && s + 1 < STEPS)  // the next step's fc
    prefetch_share(w_fc, (size_t)H * 2 * H * WB, PF_CAP);
  if (GREEDY && warp < B) {
    const int b = warp;
    float v = -SP_INF;
    int id = 0x7fffffff;
    for (int c = lane; c < NBLK; c += 32) {
      const float ov = __ldcg(S + O_CV + (size_t)b * NBLK + c);
      const int oi = (int)__ldcg(S + O_CI + (size_t)b * NBLK + c);
      if (ov > v || (ov == v && oi < id)) { v = ov; id = oi; }
    }
    warp_argmax(v, id);
    if (lane == 0) {
      if ((unsigned int)id >= (unsigned int)V) id = 0;  // (NaN logits: none is the best)
      const int token = SUBSET ? sub_ids[id] : id;
      s_tok[b] = token;
      if (blk == 0) tokens[(size_t)b * STEPS + s] = token;
    }
  }
  if (!GREEDY) {
    // every block draws every row (the same candidates, the same code: the
    // same token; the next step reads it from shared memory, no grid barrier
    // between): the best KC of the row's NBLK block lists (each best first),
    // warp w merging lists w, w + NWARP, ..., then warp 0 the warps' runs
    constexpr int LPW = (NBLK + NWARP - 1) / NWARP;
    for (int b = 0; b < B; ++b) {
      float tv = -SP_INF;  // warp 0: the row's best 32, best first
      int ti = 0x7fffffff;
      if constexpr (DIAG_NO_DRAW) {
        if (warp == 0) {
          for (int c = lane; c < NBLK; c += 32) {
            const float ov = __ldcg(S + O_CV + ((size_t)b * NBLK + c) * KC);
            const int oi = (int)__ldcg(S + O_CI + ((size_t)b * NBLK + c) * KC);
            if (ov > tv || (ov == tv && oi < ti)) { tv = ov; ti = oi; }
          }
          warp_argmax(tv, ti);
        }
      } else {
        bool whole = true;  // DRAW_HEADS: whether the blocks' whole lists are merged
        if constexpr (DRAW_HEADS) {
          static_assert(32 % HK == 0, "a run of 32 holds whole blocks' heads");
          // runs of 32: LPR blocks' best HK each; warp w the runs w * RUNS ...
          constexpr int LPR = 32 / HK;
          constexpr int RUNS = (NBLK + NWARP * LPR - 1) / (NWARP * LPR);
          float rv[RUNS];
          int ri[RUNS];
#pragma unroll
          for (int r = 0; r < RUNS; ++r) {
            const int c = (warp * RUNS + r) * LPR + lane / HK;
            // DRAW_RUNS: a block's heads worst first where lane & HK is set
            // (its list is best first): the runs then hold groups of HK as
            // the sorting network's first stages leave them
            const int g = lane % HK, at_g = (DRAW_RUNS && (lane & HK)) ? HK - 1 - g : g;
            const size_t at = ((size_t)b * NBLK + c) * KC + at_g;
            rv[r] = c < NBLK ? __ldcg(S + O_CV + at) : -SP_INF;
            // (the id loaded beside its logit, both in flight at once)
            const int id = c < NBLK ? (int)__ldcg(S + O_CI + at) : 0x7fffffff;
            ri[r] = rv[r] != -SP_INF ? id : 0x7fffffff;
          }
          if constexpr (DRAW_RUNS) {
            warp_sort_runs<SU, RUNS, (2 * HK < 32 ? 2 * HK : 32)>(rv, ri);
          } else {
#pragma unroll
            for (int r = 0; r < RUNS; ++r) warp_sort<SU>(rv[r], ri[r]);
          }
          tv = rv[0];
          ti = ri[0];
#pragma unroll
          for (int r = 1; r < RUNS; ++r) warp_merge<SU>(tv, ti, rv[r], ri[r]);
          __syncthreads();  // (s_topv: the last row's merge read them)
          merge_runs<SU, TREE>(tv, ti, s_topv, s_topi);
          if (warp == 0) {
            // a block with all its HK heads among the best KC may hold more
            const bool in = lane < KC && tv != -SP_INF;
            const unsigned int same = __match_any_sync(0xffffffffu, in ? ti / CHUNK : -1 - lane);
            const bool crowded = __any_sync(0xffffffffu, in && __popc(same) >= HK);
            if (lane == 0) s_crowded = crowded;
          }
          __syncthreads();
          whole = s_crowded;
        }
        if (whole) {  // (rarely run; unrolled)
          tv = -SP_INF;
          ti = 0x7fffffff;
          float pv[LPW];
          int pi[LPW];
#pragma unroll
          for (int q = 0; q < LPW; ++q) {
            const int c = warp + q * NWARP;
            const size_t at = ((size_t)b * NBLK + c) * KC + lane;
            pv[q] = (c < NBLK && lane < KC) ? __ldcg(S + O_CV + at) : -SP_INF;
            pi[q] = (c < NBLK && lane < KC && pv[q] != -SP_INF) ? (int)__ldcg(S + O_CI + at) : 0x7fffffff;
          }
          tv = pv[0];
          ti = pi[0];
#pragma unroll
          for (int q = 1; q < LPW; ++q) warp_merge<32>(tv, ti, pv[q], pi[q]);
          __syncthreads();  // (s_topv: the last row's merge read them)
          merge_runs<32, false>(tv, ti, s_topv, s_topi);
        }
      }
      if (DIAG_NO_DRAW && warp == 0) {
        if (lane == 0) {
          const int token = SUBSET ? sub_ids[ti] : ti;
          s_tok[b] = token;
          if (blk == 0) tokens[(size_t)b * STEPS + s] = token;
        }
      } else if (warp == 0) {
        // lane j: the j-th largest logit (descending), or none
        const bool have = lane < KC && tv != -SP_INF;
        const float sc = have ? tv * fparams[1] : -SP_INF;
        const int id = have ? ti : 0x7fffffff;
        const float smax = __shfl_sync(0xffffffffu, sc, 0);
        float e = have ? expf(sc - smax) : 0.0f;
        const float z = warp_sum(e);
        float p = e / z;
        const float top_p = fparams[2], min_p = fparams[3];
        if (top_p < 1.0f) {
          float before = 0.0f;  // exclusive prefix sum in descending order
          float run = p;
#pragma unroll
          for (int o = 1; o < 32; o <<= 1) {
            const float up = __shfl_up_sync(0xffffffffu, run, o);
            if (lane >= o) run += up;
          }
          before = run - p;
          const float kept = (have && before < top_p) ? p : SP_INF;
          float cutoff = kept;
#pragma unroll
          for (int o = 16; o > 0; o >>= 1) cutoff = fminf(cutoff, __shfl_xor_sync(0xffffffffu, cutoff, o));
          if (p < cutoff) p = 0.0f;
        }
        if (min_p > 0.0f) {
          const float pmax = __shfl_sync(0xffffffffu, p, 0);
          if (p < min_p * pmax) p = 0.0f;
        }
        // inverse CDF in id order with the (seed, step) uniform: each lane
        // the mass of the ids <= its own, summed in lane order
        float below = 0.0f;
        if constexpr (SHARED_CDF) {
          // the warp's masses and ids read back as broadcasts from warp 0's
          // own slots (no other warp reads them before the next row's block
          // barrier)
          s_topv[lane] = p;
          s_topi[lane] = id;
          __syncwarp();
#pragma unroll 8
          for (int j = 0; j < 32; ++j)
            if (s_topi[j] <= id) below += s_topv[j];
        } else {
          auto add_below = [&](int j) {
            const float pj = __shfl_sync(0xffffffffu, p, j);
            const int ij = __shfl_sync(0xffffffffu, id, j);
            if (ij <= id) below += pj;
          };
          if constexpr (TIGHT_DRAW) {
#pragma unroll 1
            for (int j = 0; j < 32; ++j) add_below(j);
          } else {
            for (int j = 0; j < 32; ++j) add_below(j);
          }
        }
        const float total = warp_sum(p);
        const float u = step_uniform(s_in_seed[b], s_in_step[b] + (unsigned int)s);
        const float target = u * total;
        int pick = (p > 0.0f && below >= target) ? id : 0x7fffffff;
        int last_id = p > 0.0f ? id : -1;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
          pick = min(pick, __shfl_xor_sync(0xffffffffu, pick, o));
          last_id = max(last_id, __shfl_xor_sync(0xffffffffu, last_id, o));
        }
        if (pick == 0x7fffffff) pick = last_id;
        if ((unsigned int)pick >= (unsigned int)V) pick = 0;  // (NaN logits: no candidate)
        if (lane == 0) {
          const int token = SUBSET ? sub_ids[pick] : pick;
          s_tok[b] = token;
          if (blk == 0) tokens[(size_t)b * STEPS + s] = token;
        }
      }
    }
  }
  __syncthreads();  // (s_tok)
  stamp();
  }  // steps
"""

# Phases that end in a grid barrier: dense 1, 2, 3, 4, 5, 6, 7; MoE adds one.
_BARRIERS = {True: 7, False: 8}

_INPUTS = [
    "ids", "hid", "last", "starts", "keys", "values", "seeds", "steps",
    "fparams", "inv_freq", "w_rt", "embed", "w_norm_e", "w_norm_h", "w_final", "w_fc",
    "w_in", "w_qkv", "w_qn", "w_kn", "w_o", "w_post", "mlp0", "mlp1", "mlp2",
    "mlp3", "mlp4", "mlp5", "mlp6", "w_hnorm", "w_head", "sub_ids", "sync",
    "nsteps", "samples", "drafts", "prev",
]  # fmt: skip
_OUTPUTS = ["tokens", "normed", "knew", "vnew", "scratch", "state"]


def derive_inputs(
    samples: mx.array,  # [B, W] the verify window's draws
    drafts: mx.array,  # [B, W - 1] the round's drafts
    prev: mx.array,  # [B, 4] uint32: the round's launch inputs (`state_of`)
    width: int,  # the next round's tail width
) -> tuple[mx.array, mx.array, mx.array, mx.array, mx.array]:
    """The next round's (ids [B, width], last, starts, seeds, steps) as the
    kernel's DERIVE prologue computes them, in MLX operations (its
    specification, and what tests compare with the inputs a round builds
    from host values): each row's accepted count is its leading drafts that
    the draws agree with; the tail's ids are the draws up to the bonus token
    (the accepted drafts, then the row's new pending token), padded with it;
    the start moves one past the last round's tail; the step key moves by the
    tokens the round emitted."""
    agree = drafts.astype(mx.int32) == samples[:, : drafts.shape[1]].astype(mx.int32)
    accepted = mx.cumprod(agree.astype(mx.int32), axis=1).sum(axis=1)
    at = mx.minimum(mx.arange(width)[None, :], accepted[:, None])
    ids = mx.take_along_axis(samples.astype(mx.int32), at, axis=1)
    prev = prev.astype(mx.uint32)
    starts = (prev[:, 0] + prev[:, 1] + 1).astype(mx.int32)
    steps = prev[:, 2] + accepted.astype(mx.uint32) + 1
    return ids, accepted.astype(mx.int32), starts, prev[:, 3], steps


def state_of(
    last: mx.array, starts: mx.array, seeds: mx.array, steps: mx.array
) -> mx.array:  # [B, 4] uint32
    """A round's launch inputs as the kernel's `state` output holds them
    (start, last, step key, seed per row): what the next round derives from."""
    return mx.stack(
        [starts.astype(mx.uint32), last.astype(mx.uint32), steps.astype(mx.uint32),
         seeds.astype(mx.uint32)],
        axis=1,
    )  # fmt: skip


def device_copy(array: mx.array) -> mx.array:
    """`array` as the output of a device operation, evaluated. MLX (0.32)
    keeps an array made from host values in host memory: one of at most 8
    bytes in its pool of host-mapped scalars, a larger one in managed pages
    that a kernel's first read migrates (and a host write near them moves
    back); a kernel reading either pays the bus or a page fault at every
    launch. A device operation's output lives in device memory. Call it
    outside any trace."""
    out = array + mx.zeros((1,), dtype=array.dtype)
    mx.eval(out)
    return out


@cache
def count_array(count: int) -> mx.array:
    """`count` as the kernel's `nsteps` input, made once per count and kept in
    device memory (`device_copy` of 16 bytes, of which the kernel reads the
    first element). Made outside any trace (`FusedStep.launch` asks for it
    before compiling)."""
    return device_copy(mx.array([count, 0, 0, 0], dtype=mx.int32))[:1]


def compact(text: str) -> str:
    """CUDA source without its `//` comments, indentation and blank lines:
    the same program in ~30 % fewer characters. MLX hashes a custom
    kernel's whole source at every launch (to find its compiled module), so
    its length is host time per launch."""
    lines = []
    for line in text.split("\n"):
        cut = line.find("//")
        if cut >= 0 and line.count('"', 0, cut) % 2 == 0:  # not inside a string
            line = line[:cut]
        if line.strip():
            lines.append(line.strip())
    return "\n".join(lines)


def header_text(shifts: bool) -> str:
    """The kernel's header with `BF16_SHIFTS` as given (a macro: the
    header's conversions are not templates of the kernel's constants)."""
    return f"#define SP_BF16_SHIFTS {int(shifts)}\n" + _COMPACT_HEADER


@cache
def _kernel(shared: int, shifts: bool) -> Callable[..., list[mx.array]]:
    return cast(
        Callable[..., list[mx.array]],
        mx.fast.cuda_kernel(
            name=f"specpipe_mtp_step_{shared}" + ("_shifts" if shifts else ""),
            input_names=_INPUTS,
            output_names=_OUTPUTS,
            source=_COMPACT_SOURCE,
            header=header_text(shifts),
            shared_memory=shared,
        ),
    )


_COMPACT_SOURCE, _COMPACT_HEADER = compact(_SOURCE), compact(_HEADER)


@frozen
class LayerShape:
    """The sizes a fused step is built for (template constants)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    rotary: int
    dense: bool
    intermediate: int  # dense MLP; 0 for MoE
    experts: int  # MoE; 0 for dense
    top_experts: int
    expert_intermediate: int
    shared_intermediate: int
    norm_top: bool

    def grouped(self, slots: int) -> bool:
        """Whether attention takes items per kv head (`ATT_GROUPED`) in a
        launch whose window slots (its positions plus its chained steps) are
        `slots`: where a kv head's query heads are at most a block's warps
        and the slots fit one tile."""
        return (
            ATT_GROUPED
            and self.heads // self.kv_heads <= BLOCK // 32
            and slots <= ATT_TILE
            and 2 * 2 * ATT_TILE * self.head_dim * 2 <= MAX_SHARED
        )

    @property
    def foldable(self) -> bool:
        """Whether the kernel can fold the router into o_proj's phase
        (`FOLD_ROUTER`): a MoE layer of at most 127 experts."""
        return not self.dense and 0 < self.experts <= 127

    def scratch(
        self,
        vectors: int,
        rows: int,
        candidates: int,
        blocks: int,
        fold: bool = False,
        grouped: bool = False,
    ) -> int:
        """Floats of the kernel's scratch output (mirrors the source's offsets)."""
        h = self.hidden
        qkv = 2 * self.heads * self.head_dim + 2 * self.kv_heads * self.head_dim
        # attention's splits per (row, head): per (row, kv head) when grouped
        per = self.kv_heads if grouped else self.heads
        splits = max(1, blocks // (rows * per))
        parts = [
            vectors * h,
            vectors * qkv,
            rows * self.heads * splits * (self.head_dim + 2),
            rows * self.heads * self.head_dim,
            rows * h,
        ]
        if self.dense:
            parts.append(rows * self.intermediate)
        else:
            parts += [
                rows * (self.experts + 1),
                rows * self.shared_intermediate,
                rows * self.top_experts * self.expert_intermediate,
                rows * self.top_experts,
                rows * self.top_experts,
            ]
        parts += [rows * h, rows * blocks * candidates, rows * blocks * candidates]
        if fold:
            parts.append(rows * (self.experts + 1) * blocks)
        return sum(_align8(n) for n in parts) + blocks * PHASE_STAMPS

    def shared_bytes(
        self,
        vectors: int,
        rows: int,
        vocab: int,
        greedy: bool,
        blocks: int,
        grouped: bool = False,
    ) -> int:
        """Dynamic shared memory of a step: the largest of the phases' staged
        input vectors (float32), the head's (plus the block's logits when
        sampling), grouped attention's tiles."""
        h = self.hidden
        mlp = (
            rows * self.intermediate
            if self.dense
            else rows * (self.top_experts * self.expert_intermediate
                         + self.shared_intermediate)
        )  # fmt: skip
        chunk = -(-vocab // blocks)
        floats = max(
            vectors * 2 * h,
            rows * self.heads * self.head_dim,
            mlp,
            rows * h + (0 if greedy else rows * chunk),
            BLOCK
            // 32
            * rows
            * (self.experts + 1),  # FOLD: o_proj's warps' router sums
        )
        # grouped attention's two stages of a tile's keys and values (2-byte
        # elements), then its combining weights (at most `blocks` floats)
        tiles = 2 * 2 * ATT_TILE * self.head_dim * 2 if grouped else 0
        return max(4 * floats, tiles, 4 * blocks)

    def static_shared(self, rows: int, blocks: int) -> int:
        """Bytes of the kernel's static shared arrays, over-counted (mirrors
        the source's `__shared__` declarations, plus 1 KiB for the small ones)."""
        warps = BLOCK // 32
        top = warps * max(rows, 32)
        splits = max(1, blocks // (rows * self.heads))  # s_split's (row, head) splits
        experts = max(self.top_experts, 1)
        return (
            4
            * (
                warps * self.head_dim  # s_acc
                + 2 * top  # s_topv, s_topi
                + 2 * rows * experts  # s_eid, s_ew
                + rows * (self.experts + 2)  # s_inv, s_rlog
                + 2 * splits
                + 4 * MAX_VECTORS
                + 6 * rows
            )
            + 1024
        )


def _align8(n: int) -> int:
    return -(-n // 8) * 8


@frozen(eq=False)
class FusedWeights:
    """The arrays one fused step reads (all of one 2-byte float dtype)."""

    shape: LayerShape
    embed: mx.array  # [Vemb, H]
    norm_embedding: mx.array
    norm_hidden: mx.array
    final_norm: mx.array  # the target's
    fc: mx.array  # [H, 2H]
    input_norm: mx.array
    qkv: mx.array  # [2 Hq D + 2 Hkv D, H]
    q_norm: mx.array
    k_norm: mx.array
    o: mx.array  # [H, Hq D]
    post_norm: mx.array
    mlp: tuple[mx.array, ...]  # seven arrays, see `_SOURCE` (mlp0 .. mlp6)
    head_norm: mx.array
    inv_freq: mx.array  # [rotary / 2] f32
    eps: float
    # MoE with at most 127 experts: the router's rows and the shared expert's
    # gate times the MoE norm's weights, transposed: [H, E + 1] f32 (`FOLD_ROUTER`)
    router_t: mx.array | None = None

    def arrays(self) -> list[mx.array]:
        """The weights in the kernel's input order (`_INPUTS`, embed .. w_hnorm)."""
        return [
            self.embed,
            self.norm_embedding,
            self.norm_hidden,
            self.final_norm,
            self.fc,
            self.input_norm,
            self.qkv,
            self.q_norm,
            self.k_norm,
            self.o,
            self.post_norm,
            *self.mlp,
            self.head_norm,
        ]


def _float2(arrays: Sequence[mx.array]) -> mx.Dtype | None:
    dtypes = {a.dtype for a in arrays}
    if len(dtypes) != 1:
        return None
    (dtype,) = dtypes
    return dtype if dtype in (mx.bfloat16, mx.float16) else None


def _inv_freq(rope: RoPE) -> mx.array | None:
    """RoPE's inverse frequencies as `mx.fast.rope` applies them (positions
    times scale times base^(-2i/dims), or times 1/freqs when given)."""
    if rope.traditional:
        return None
    half = rope.dims // 2
    freqs = rope._freqs
    if freqs is not None:
        inverse: mx.array = rope.scale / freqs.astype(mx.float32)
        return inverse.astype(mx.float32)
    if rope.base is None:
        return None
    exponents = mx.arange(half, dtype=mx.float32) * (2.0 / rope.dims)
    powers: mx.array = mx.power(float(rope.base), -exponents)
    return (rope.scale * powers).astype(mx.float32)


def _weight(module: Any) -> mx.array | None:
    """A float Linear's weight (None when quantized or biased)."""
    if not isinstance(module, nn.Linear) or "bias" in module:
        return None
    if isinstance(module, nn.QuantizedLinear):
        return None
    weight: mx.array = module.weight
    return weight


def fused_weights(target: Any, head: Any, layer_index: int) -> FusedWeights | None:
    """The fused step's arrays for layer `layer_index` of `head` on `target`
    (a models.qwen3_next.Model), or None when the step is outside the fused
    kernel's scope (the module doc)."""
    # imported here: models.qwen3_next imports the hybrid stack
    from models.layers import MLP
    from models.qwen3_next import SparseMoeBlock, SwitchLinear

    if not getattr(head, "fused_kernel", False):
        return None
    layer = head.layers[layer_index]
    attn = layer.self_attn
    embed = target.model.embed_tokens
    if not isinstance(embed, nn.Embedding) or isinstance(embed, nn.QuantizedEmbedding):
        return None
    qkv = attn._qkv
    if (
        qkv is None
        or qkv.bits
        or "bias" in qkv.arrays
        or not qkv.current((attn.q_proj, attn.k_proj, attn.v_proj))
    ):
        return None
    fc, o = _weight(head.fc), _weight(attn.o_proj)
    inv_freq = _inv_freq(attn.rope)
    if fc is None or o is None or inv_freq is None:
        return None
    hidden = int(fc.shape[0])
    head_dim, rotary = attn.head_dim, attn.rope.dims
    mlp = layer.mlp
    mlp_arrays: list[mx.array]
    if isinstance(mlp, MLP):
        gate_up = mlp._gate_up
        down = _weight(mlp.down_proj)
        if gate_up is None or gate_up.bits or "bias" in gate_up.arrays or down is None:
            return None
        intermediate = mlp.intermediate
        shape = LayerShape(
            hidden, attn.heads, attn.kv_heads, head_dim, rotary, True,
            intermediate, 0, 0, 0, 0, False,
        )  # fmt: skip
        mlp_arrays = [gate_up.arrays["weight"], down]
    elif isinstance(mlp, SparseMoeBlock):
        switch, shared = mlp.switch_mlp, mlp.shared_expert
        router, shared_gate = _weight(mlp.gate), _weight(mlp.shared_expert_gate)
        parts = (switch.gate_proj, switch.up_proj, switch.down_proj)
        gate_up = shared._gate_up
        shared_down = _weight(shared.down_proj)
        if (
            router is None
            or shared_gate is None
            or not all(isinstance(p, SwitchLinear) for p in parts)
            or gate_up is None
            or gate_up.bits
            or "bias" in gate_up.arrays
            or shared_down is None
        ):
            return None
        experts, expert_inter, _ = switch.gate_proj.weight.shape
        shape = LayerShape(
            hidden, attn.heads, attn.kv_heads, head_dim, rotary, False, 0,
            int(experts), mlp.top_k, int(expert_inter), shared.intermediate,
            bool(mlp.norm_topk_prob),
        )  # fmt: skip
        mlp_arrays = [
            router,
            shared_gate,
            switch.gate_proj.weight,
            switch.up_proj.weight,
            switch.down_proj.weight,
            gate_up.arrays["weight"],
            shared_down,
        ]
    else:
        return None
    sizes = [hidden, hidden * 2, shape.intermediate, shape.expert_intermediate]
    sizes.append(shape.shared_intermediate)
    sizes.append(attn.heads * head_dim)
    if (
        any(n % 256 for n in sizes)
        or head_dim % 32
        or rotary % 2
        or (rotary // 2) % (head_dim // 32)
        or rotary > head_dim
        or attn.heads % attn.kv_heads
        or head_dim > BLOCK
        or (not shape.dense and (shape.top_experts > 32 or shape.experts > MAX_EXPERTS))
    ):
        return None
    while len(mlp_arrays) < 7:  # unused slots of the dense form
        mlp_arrays.append(mlp_arrays[0][:1, :8])
    router_t = None
    if shape.foldable:
        gates = mx.concatenate([mlp_arrays[0], mlp_arrays[1]], axis=0).astype(
            mx.float32
        )
        post = layer.post_attention_layernorm.weight.astype(mx.float32)
        router_t = mx.contiguous((gates * post[None, :]).T)
        mx.eval(router_t)
    weights = FusedWeights(
        shape,
        embed.weight,
        head.pre_fc_norm_embedding.weight,
        head.pre_fc_norm_hidden.weight,
        target.model.norm.weight,
        fc,
        layer.input_layernorm.weight,
        qkv.arrays["weight"],
        attn.q_norm.weight,
        attn.k_norm.weight,
        o,
        layer.post_attention_layernorm.weight,
        tuple(mlp_arrays),
        head.norm.weight,
        inv_freq,
        float(head.norm.eps),
        router_t,
    )
    return weights if _float2(weights.arrays()) is not None else None


# Whether a CUDA GPU drafts MTP steps in scope through the fused kernel. Its
# MoE form as it stands agrees with the MLX step on float32 copies of the
# weights on an H200 (bf16 rounding, the same greedy drafts, single steps and
# three chained steps in one launch; bench/fused_probe.py, bench/RESULTS.md
# 2026-12-02 ninth session), as an earlier revision of its dense form did;
# `bench/mtp.py --steps compiled` turns it off to compare.
FUSED_ON_GPU = True
# Whether a round's first step and its chained steps share one launch that
# writes the head's new KV buffers itself (`HeadStep.round`), or the first
# step launches alone before the chain's, each followed by two scatters. On:
# checked on the H200 against HeadStep.round's MLX steps (bf16 and float32
# weights, greedy, FR-Spec and full head, 1 and 2 rows: every draft equal;
# bench/round_check.py, bench/fused_probe.py's round3) and its draft phase
# 1.7x faster at depth 3 (bench/RESULTS.md, tenth session).
WHOLE_ROUND = True


@frozen(eq=False)
class FusedStep:
    """One MTP draft step, or a round's chained steps, as one kernel launch
    (then the two KV scatters, or none where the kernel writes the new KV
    buffers itself)."""

    weights: FusedWeights
    head: mx.array  # [V, H] projection rows (the FR-Spec rows when listed)
    subset_ids: mx.array | None  # [V] int32, ascending
    sync: mx.array  # [2] uint64: barrier counter, failed barriers
    blocks: int  # of the persistent kernel, all resident at once
    profiled: list[mx.array] = field(factory=list, init=False)  # the last scratch
    # [sound] once a first launch was evaluated and its grid barriers checked
    # (`specpipe.drafts.mtp._through_kernel`)
    checked: list[bool] = field(factory=list, init=False)
    traced: dict[tuple[bool, int, float, float, float, int, bool], StepFn] = field(
        factory=dict, init=False
    )

    @classmethod
    def make(
        cls,
        weights: FusedWeights,
        head: mx.array,
        subset_ids: mx.array | None,
        blocks: int | None = None,  # None: BLOCKS, or fewer on a smaller device
    ) -> FusedStep | None:
        if head.dtype != weights.embed.dtype or head.shape[1] != weights.shape.hidden:
            return None
        if blocks is None:
            count = multiprocessors()
            if count is None:
                return None
            blocks = min(BLOCKS, count)
        # the grid barrier's counter, the barriers that gave up, then a
        # counter of finished attention splits per (row, head)
        # (ATT_GROUPED: then a tagged counter per (row, kv head))
        shape = weights.shape
        sync = mx.zeros(
            (2 + MAX_ROWS * (shape.heads + shape.kv_heads),), dtype=mx.uint64
        )
        mx.eval(sync)
        # the subset's ids, which every block's draw reads, in device memory
        ids = None if subset_ids is None else device_copy(subset_ids)
        return cls(weights, head, ids, sync, blocks)

    @classmethod
    def for_head(
        cls,
        target: Any,
        head: Any,
        layer: int,
        subset: tuple[mx.array, HeadWeights] | None,  # FR-Spec (ids [N], their rows)
    ) -> FusedStep | None:
        """The fused step of `head`'s layer `layer` over the target's full
        vocabulary projection or the FR-Spec `subset`, or None when out of
        the kernel's scope (float, unquantized, uncapped logits, the shapes
        in the module doc)."""
        weights = fused_weights(target, head, layer)
        ids, projection = (None, target.head_weights()) if subset is None else subset
        if weights is None or projection.bits or projection.softcap is not None:
            return None
        return cls.make(weights, projection.weight, ids)

    def supports(self, temperature: float, top_k: int) -> bool:
        """Whether draws with these filters run in the kernel: greedy, or
        sampling that keeps at most MAX_TOP_K candidates."""
        return temperature == 0.0 or 0 < top_k <= min(MAX_TOP_K, self.vocab - 1)

    @property
    def vocab(self) -> int:
        return int(self.head.shape[0])

    def fits(self, rows: int, length: int, greedy: bool, top_k: int) -> bool:
        """Whether a step of `rows` x `length` positions with this draw is in
        the kernel's scope (else the caller keeps the MLX step)."""
        shape = self.weights.shape
        return (
            rows <= MAX_ROWS
            and rows * length <= MAX_VECTORS
            and (greedy or 0 < top_k <= MAX_TOP_K)
            and top_k < self.vocab
            and shape.shared_bytes(rows * length, rows, self.vocab, greedy, self.blocks)
            <= MAX_SHARED
        )

    def step(
        self, first: bool, temperature: float, top_p: float, min_p: float, top_k: int
    ) -> StepFn:
        """The step for one draw setting (temperature 0: greedy) as a compiled
        function of HeadStep's step signature: the kernel, then the window's
        keys / values scattered into the buffers at `starts`."""
        return self.launch(first, 1, temperature, top_p, min_p, top_k)

    def chain(
        self, count: int, temperature: float, top_p: float, min_p: float, top_k: int
    ) -> StepFn:
        """`count` chained steps in one launch, as a compiled function of
        (token [B, 1], normed [B, 1, H], last (unread), starts [B], keys,
        values, seeds, steps) -> (tokens [B, count], the last step's normed,
        keys, values): step i drafts at `starts + i` with step key `steps + i`,
        as `count` calls of the chained `step` would."""
        return self.launch(False, count, temperature, top_p, min_p, top_k)

    def launch(
        self,
        first: bool,
        count: int,
        temperature: float,
        top_p: float,
        min_p: float,
        top_k: int,
        kv_out: bool = False,
    ) -> StepFn:
        """`count` steps in one launch as a compiled function of HeadStep's
        step signature, tokens [B, count] (one step without `kv_out`: [B],
        as HeadStep's steps): a first step (its
        window's last position `last`, drafting at starts + last) or a chained
        one (at `starts`), then count - 1 chained steps, step i one position
        further with step key `steps + i`; the window's keys / values of
        every step scattered into the buffers from `starts` on (`kv_out`:
        written by the kernel into new whole buffers, no scatter)."""
        key = (first, count, temperature, top_p, min_p, top_k, kv_out)
        traced = self.traced.get(key)
        if traced is None:
            count_array(count)  # made here, outside the trace
            greedy = temperature == 0.0
            dist = draw_params(self.weights.eps, temperature, top_p, min_p)

            def run(*arrays: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
                # arrays: ids, hidden, last, starts, keys, values, seeds, steps
                starts, keys, values = arrays[3], arrays[4], arrays[5]
                tokens, normed, knew, vnew = self(
                    first, greedy, 0 if greedy else top_k, dist, *arrays, count=count,
                    kv_out=kv_out,
                )  # fmt: skip
                if kv_out:
                    return tokens, normed, knew, vnew
                return (
                    tokens[:, 0] if count == 1 else tokens,
                    normed,
                    scatter_window(keys, knew, starts),
                    scatter_window(values, vnew, starts),
                )

            traced = cast(StepFn, mx.compile(run))
            self.traced[key] = traced
        return traced

    def failures(self) -> int:
        """How many grid barriers gave up waiting so far (0 on a sound device)."""
        count: int = self.sync[1].tolist()  # type: ignore[assignment]
        return count

    def __call__(
        self,
        first: bool,
        greedy: bool,
        top_k: int,
        dist: mx.array,  # [4] f32: eps, 1 / temperature, top_p, min_p
        ids: mx.array,  # [B, L] int32
        hidden: mx.array,  # [B, L, H]
        last: mx.array,  # [B] int32
        starts: mx.array,  # [B] int32
        keys: mx.array,  # [B, Hkv, C, D]
        values: mx.array,
        seeds: mx.array,  # [B] uint32
        steps: mx.array,  # [B] uint32
        *,
        count: int = 1,
        kv_out: bool = False,
        profile: bool = False,
    ) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        tokens, normed, knew, vnew, _ = self.outputs(
            first, greedy, top_k, dist, ids, hidden, last, starts, keys, values,
            seeds, steps, count=count, kv_out=kv_out, profile=profile,
        )  # fmt: skip
        return tokens, normed, knew, vnew

    def derived_round(
        self,
        greedy: bool,
        top_k: int,
        dist: mx.array,
        samples: mx.array,  # [B, W] the last round's verify window's draws
        drafts: mx.array,  # [B, W - 1] the last round's drafts
        prev: mx.array,  # [B, 4] uint32: the last launch's `state`
        hidden: mx.array,  # [B, L, H] the tail (the verify window's hidden states)
        keys: mx.array,
        values: mx.array,
        count: int,
    ) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """A whole round (a first step over the tail, count - 1 chained ones,
        the new KV buffers written by the kernel) whose per-row inputs the
        kernel derives from the last round's (`derive_inputs` says how):
        (tokens [B, count], keys, values, state [B, 4] uint32, this launch's
        inputs for the next round to derive from)."""
        tokens, _, knew, vnew, state = self.outputs(
            True, greedy, top_k, dist, samples, hidden, prev, prev, keys, values,
            prev, prev, count=count, kv_out=True, derive=(samples, drafts, prev),
        )  # fmt: skip
        return tokens, knew, vnew, state

    def outputs(
        self,
        first: bool,
        greedy: bool,
        top_k: int,
        dist: mx.array,
        ids: mx.array,
        hidden: mx.array,
        last: mx.array,
        starts: mx.array,
        keys: mx.array,
        values: mx.array,
        seeds: mx.array,
        steps: mx.array,
        *,
        count: int = 1,
        kv_out: bool = False,
        profile: bool = False,
        derive: tuple[mx.array, mx.array, mx.array] | None = None,
    ) -> tuple[mx.array, mx.array, mx.array, mx.array, mx.array]:
        """(tokens [B, count], normed [B, 1, H], knew, vnew [B, Hkv, L + count
        - 1, D]): one step over a window of L positions (a first step, or a
        chained step of one), then `count` - 1 chained steps in the same
        launch, each drafting from the previous step's token and normed
        output one position further (window slot last + i); the window's
        keys and values for the caller to store at `starts` (`kv_out`: knew
        / vnew are `keys` / `values` with the window written in, new arrays
        of their shape). `profile`: stamp the phases of the launch's last
        step (`stamp_table`), state [B, 4] uint32 (the launch's start, last,
        step key and seed per row). `derive` (samples, drafts, prev): the
        per-row inputs derived by the kernel (`derived_round`); `ids`, `last`,
        `starts`, `seeds` and `steps` are then not read (`ids` is
        `samples`)."""
        if ATT_UNROLL < 1:  # (0 would never leave attention's loop)
            raise ValueError(
                f"models.mtp_cuda.ATT_UNROLL must be at least 1, got {ATT_UNROLL}"
            )
        w, s = self.weights, self.weights.shape
        rows, length = hidden.shape[0], hidden.shape[1]
        if count > 1 and not first and length != 1:
            raise ValueError("chained steps take one position each")
        vectors = rows * length
        candidates = 1 if greedy else top_k
        fold = self.folds
        # MLX lifts a kernel's shared-memory limit only for more than 48000
        # dynamic bytes, and the static arrays count too: ask for at least 64 KiB
        # (one block per multiprocessor anyway), in steps of 16 KiB.
        grouped = s.grouped(length + count - 1)
        needed = s.shared_bytes(vectors, rows, self.vocab, greedy, self.blocks, grouped)
        shared = max(64 * 1024, -(-needed // (16 * 1024)) * (16 * 1024))
        lean = -(-needed // 1024) * 1024
        if LEAN_SHARED and lean + s.static_shared(rows, self.blocks) <= 48000:
            shared = lean
        template: list[tuple[str, Any]] = [
            ("T", w.embed.dtype),
            ("NBLK", self.blocks),
            ("H", s.hidden),
            ("M", vectors),
            ("B", rows),
            ("TT", length),
            ("HQ", s.heads),
            ("HKV", s.kv_heads),
            ("D", s.head_dim),
            ("ROT", s.rotary),
            ("DENSE", s.dense),
            ("IM", max(s.intermediate, 1)),
            ("E", max(s.experts, 1)),
            ("KE", max(s.top_experts, 1)),
            ("IE", max(s.expert_intermediate, 1)),
            ("IS", max(s.shared_intermediate, 1)),
            ("NORM_TOPK", s.norm_top),
            ("V", self.vocab),
            ("SUBSET", self.subset_ids is not None),
            ("GREEDY", greedy),
            ("TOPK", max(top_k, 1)),
            ("FIRST", first),
            ("PROFILE", profile),
            ("PAIR_ROWS", PAIR_ROWS),
            ("PREFETCH", PREFETCH_L2),
            ("KV_OUT", kv_out),
            ("WIDE_LOADS", WIDE_LOADS),
            ("EVICT_ALL", EVICT_ALL),
            ("KEEP_FC", KEEP_FC),
            ("KEEP_QKV", KEEP_QKV),
            ("KEEP_O", KEEP_O),
            ("FAST_SINCOS", FAST_SINCOS),
            ("DRAW_HEADS", DRAW_HEADS and not greedy and max(top_k, 1) > DRAW_HEADS_K),
            ("HK", DRAW_HEADS_K),
            ("TIGHT_DRAW", TIGHT_DRAW),
            ("DRAW_RUNS", DRAW_RUNS),
            ("TREE_MERGE", TREE_MERGE),
            ("ACQ_REL_BARRIER", ACQ_REL_BARRIER),
            ("ATT_UNROLL", ATT_UNROLL),
            ("SPREAD", ATT_SPREAD),
            ("PIPE", ATT_PIPE and ATT_UNROLL <= 4),
            ("ATT_GROUPED", grouped),
            ("ATT_TILE", ATT_TILE),
            ("ATT_MIN_SHARE", ATT_MIN_SHARE),
            ("ATT_SHARE", ATT_SHARE),
            ("COPY_UNROLL", COPY_UNROLL),
            ("GCOUNT", 2 + MAX_ROWS * s.heads),
            ("DIAG_NO_DRAW", DIAG_NO_DRAW),
            ("DIAG_NO_SORT", DIAG_NO_SORT),
            ("FOLD", fold),
            ("REDUX_TOPK", REDUX_TOPK),
            ("SHARED_CDF", SHARED_CDF),
            ("DERIVE", derive is not None),
        ]
        window = (
            keys.shape if kv_out else (rows, s.kv_heads, length + count - 1, s.head_dim)
        )
        sub_ids = self.subset_ids if self.subset_ids is not None else last
        outputs = _kernel(shared, BF16_SHIFTS)(
            inputs=[
                ids.reshape(-1),
                hidden.reshape(vectors, s.hidden),
                last,
                starts,
                keys,
                values,
                seeds,
                steps,
                dist,
                w.inv_freq,
                w.router_t if fold else w.inv_freq,  # (unread without FOLD)
                *w.arrays(),
                self.head,
                sub_ids,
                self.sync,
                count_array(count),
                *(derive if derive is not None else (ids, ids, steps)),
            ],
            template=template,
            grid=(self.blocks * BLOCK, 1, 1),
            threadgroup=(BLOCK, 1, 1),
            output_shapes=[
                (rows, count),
                (rows, 1, s.hidden),
                window,
                window,
                (s.scratch(vectors, rows, candidates, self.blocks, fold, grouped),),
                (rows, 4),
            ],
            output_dtypes=[mx.int32, w.embed.dtype, w.embed.dtype, w.embed.dtype,
                           mx.float32, mx.uint32],
        )  # fmt: skip
        if profile:
            self.profiled[:] = [outputs[4]]
        return outputs[0], outputs[1], outputs[2], outputs[3], outputs[5]

    def stamp_table(self, *args: Any, count: int = 1) -> list[list[float]]:
        """One profiled launch of `__call__(*args, count=count)`: per block,
        its PHASE_STAMPS stamps in microseconds from the first block's
        start of the launch's last step: that start, its arrival at and
        departure from each grid barrier of the step, the draw's end, then
        (the last INNER_STAMPS) the points within phases where their
        products start: fc, q/k/v, attention's query roped and its
        positions done, o_proj, the experts' gate/up, their down, the
        projection, then attention's query normed and its angles computed.
        A point a block does not pass (no attention item) holds whatever
        the scratch held."""
        outputs = self(*args, count=count, profile=True)
        scratch = self.profiled[0]
        mx.eval(*outputs, scratch)
        raw = scratch[-self.blocks * PHASE_STAMPS :].view(mx.uint32)
        table: list[list[int]] = raw.reshape(self.blocks, PHASE_STAMPS).tolist()  # type: ignore[assignment]
        origin = min(row[0] for row in table)
        return [
            [round(((ns - origin) & 0xFFFFFFFF) / 1000.0, 2) for ns in row]
            for row in table
        ]

    def phase_times(self, *args: Any) -> list[tuple[float, float, float, int]]:
        """One profiled launch of `__call__(*args)`: first the blocks'
        starts (0, the last start twice, the last-starting block), then per
        grid barrier of the (last) step and for the draw's end,
        microseconds from the first block's start to (the first block's
        arrival, the last block's arrival, the last block's departure), and
        the last-arriving block; the draw's end has its last block's end
        three times. The last arrival less the previous
        barrier's last departure is the phase's work on its slowest block;
        the departure less the last arrival, the barrier's own cost."""
        return phases_of(self.stamp_table(*args), self.barriers)

    @property
    def barriers(self) -> int:
        """Grid barriers of one step (the folded router's phase has none)."""
        return _BARRIERS[self.weights.shape.dense] - self.folds

    @property
    def folds(self) -> bool:
        """Whether launches fold the router into o_proj's phase (`FOLD_ROUTER`)."""
        return FOLD_ROUTER and self.weights.router_t is not None


def phases_of(
    table: list[list[float]], barriers: int
) -> list[tuple[float, float, float, int]]:
    """`FusedStep.phase_times` of a `stamp_table` whose step has `barriers`
    grid barriers."""
    blocks = range(len(table))
    starts = [row[0] for row in table]
    late = max(blocks, key=starts.__getitem__)
    phases = [(0.0, starts[late], starts[late], late)]
    for i in range(barriers):
        arrive = [row[1 + 2 * i] for row in table]
        leave = [row[2 + 2 * i] for row in table]
        last = max(blocks, key=arrive.__getitem__)
        phases.append((min(arrive), arrive[last], max(leave), last))
    ends = [row[1 + 2 * barriers] for row in table]
    last = max(blocks, key=ends.__getitem__)
    phases.append((ends[last], ends[last], ends[last], last))
    return phases


@cache
def multiprocessors() -> int | None:
    """The CUDA device's multiprocessor count, asked of the driver (device
    0, MLX's), or None where there is no driver."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    device, count = ctypes.c_int(), ctypes.c_int()
    multiprocessor_count = 16  # CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
    if (
        driver.cuInit(0)
        or driver.cuDeviceGet(ctypes.byref(device), 0)
        or driver.cuDeviceGetAttribute(
            ctypes.byref(count), multiprocessor_count, device
        )
    ):
        return None
    return int(count.value)


def draw_params(eps: float, temperature: float, top_p: float, min_p: float) -> mx.array:
    """The kernel's float parameters (every thread reads the norms' epsilon
    at the launch's start), in device memory (`device_copy`)."""
    inverse = 1.0 / temperature if temperature > 0 else 0.0
    return device_copy(mx.array([eps, inverse, top_p, min_p], dtype=mx.float32))
