"""Calibration: what a round costs on this machine, measured once and cached.

The target's forward over a window of width 1..W and one draft step are timed
on a short random context; the medians form the `CostModel` the adaptive
drafter maximises tokens per second against. A draft step is what the draft
kind runs per drafted token: a two-model draft's forward over one token and
its LM head's argmax; an MTP head's forward over one (token, hidden) pair and
the shared projection's argmax (onto its FR-Spec rows when it has a draft
vocabulary), timed by the drafter itself (`DraftStep`); nothing for ngram,
which drafts on the host. A draft that times whole rounds (`DraftRound`: the
MTP head, whose first step differs and whose round is one launch on a GPU)
is timed at depths 1 and `ROUND_DEPTH`, fitted as a fixed cost per round
plus a cost per drafted token. The result is cached per (target, draft kind and
source, dtype, device) under the model cache, and loaded automatically when
adaptive drafting is on.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Protocol, cast, runtime_checkable

import mlx.core as mx
from returns.result import Failure, Result

from models import cpu_kernel
from models.base import CausalLM
from models.blas import route_blas
from models.parallel import cpu_threads
from models.paths import cache_root
from models.vocab_head import HeadWeights
from schemas.converter import strict, structure
from schemas.errors import ConfigError
from specpipe.adaptive import CostModel

CONTEXT = 64
# what a calibration measures; a new field makes older caches stale
FORMAT = "cost-model-4"  # 3: plain_ms and catch_up_ms; 4: MTP rounds (draft_fixed_ms)
ROUND_DEPTH = 4  # the deeper of the two round depths a `DraftRound` is timed at
CATCH_UP = 16
async_eval = cast(Callable[..., None], mx.async_eval)  # untyped in MLX's stubs


@runtime_checkable
class DraftStep(Protocol):
    """A draft that is not a model of its own (an MTP head riding on the
    target) and sets up its own timed step."""

    def calibration_step(
        self, context: mx.array, hidden: mx.array
    ) -> Callable[[], mx.array]:
        """Having read `context` [1, C] and the target's hidden states for it
        (`hidden` [1, C, H], `ModelOutput.hidden`), a callable running one
        draft step and returning its (unevaluated) draft token ids."""
        ...


@runtime_checkable
class DraftRound(Protocol):
    """A draft whose rounds are not a sum of equal steps (an MTP head: its
    first step reads the target's new hidden states, and on a GPU a whole
    round is one kernel launch): it sets up whole rounds to time, and the
    calibration fits a round's draft cost as fixed + depth x per-step."""

    def calibration_round(
        self, context: mx.array, hidden: mx.array
    ) -> Callable[[int], mx.array]:
        """Having read `context` [1, C] and the target's hidden states for it
        (`hidden` [1, C, H]), a callable running one draft round of the given
        depth as decoding runs it (from a one-token tail) and returning its
        (unevaluated) draft token ids."""
        ...


def _median_ms(run: object, repeats: int) -> float:
    assert callable(run)
    run()  # warm-up (graph building, kernels)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) * 1000.0)
    return statistics.median(times)


def measure(
    target: CausalLM,
    draft: CausalLM | DraftStep | None,
    max_width: int = 8,
    repeats: int = 3,
    draft_head: HeadWeights | None = None,
) -> CostModel:
    """`draft`: a draft model, a `DraftStep` (MTP head), or None (no draft or
    a host-side one: draft steps cost 0). `draft_head`: the rows a draft
    model projects onto (an FR-Spec list), when not its whole head."""
    vocab = target.args.vocab_size
    context = mx.random.randint(0, vocab, (1, CONTEXT), key=mx.random.key(0)).astype(
        mx.int32
    )

    def prefilled(model: CausalLM) -> tuple[object, mx.array]:
        cache = model.make_cache(1)
        out = model(context, cache, [0])
        mx.eval(cache.arrays(), out.hidden)
        return cache, out.hidden

    target_cache, target_hidden = prefilled(target)
    verify_ms = []
    for width in range(1, max_width + 1):
        window = context[:, :width]

        def forward(window: mx.array = window) -> None:
            out = target(window, target_cache, [CONTEXT])
            mx.eval(mx.argmax(out.logits, axis=-1))

        verify_ms.append(_median_ms(forward, repeats))
    plain_ms = _pipelined_step_ms(target, target_cache, context[:, -1:], repeats)
    draft_ms = catch_up_ms = draft_fixed_ms = 0.0
    if isinstance(draft, DraftRound):
        run_round = draft.calibration_round(context, target_hidden)
        one, deep = (
            _median_ms(lambda d=d: mx.eval(run_round(d)), repeats)
            for d in (1, ROUND_DEPTH)
        )
        draft_ms = max((deep - one) / (ROUND_DEPTH - 1), 0.0)
        draft_fixed_ms = max(one - draft_ms, 0.0)
    elif isinstance(draft, DraftStep):
        step = draft.calibration_step(context, target_hidden)

        def head_step() -> None:
            mx.eval(step())

        draft_ms = _median_ms(head_step, repeats)
    elif draft is not None:
        model = draft
        draft_cache, _ = prefilled(model)
        token = context[:, :1]

        def project(hidden: mx.array) -> mx.array:
            if draft_head is None:
                return model.lm_head(hidden)
            return draft_head.project(model.final_norm(hidden))

        def draft_step() -> None:
            out = model(token, draft_cache, [CONTEXT])
            mx.eval(mx.argmax(project(out.hidden), axis=-1))

        draft_ms = _median_ms(draft_step, repeats)
        # a catch-up of CATCH_UP tokens (a gated row's draft reading what was
        # decoded plainly), as a cost per token beyond a single step
        window = context[:, :CATCH_UP]

        def catch_up() -> None:
            out = model(window, draft_cache, [CONTEXT])
            mx.eval(mx.argmax(project(out.hidden[:, -1:]), axis=-1))

        catch_up_ms = max(0.0, _median_ms(catch_up, repeats) - draft_ms) / (
            CATCH_UP - 1
        )
    return CostModel(
        tuple(verify_ms),
        draft_ms,
        draft_fixed_ms,
        plain_ms=plain_ms,
        catch_up_ms=catch_up_ms,
    )


def _pipelined_step_ms(
    target: CausalLM, cache: object, token: mx.array, repeats: int, steps: int = 8
) -> float:
    """One plain step as the decode loop runs it: step k+1 queued on the device
    before step k's token is read, so graph building overlaps the device (on a
    GPU this is cheaper than a lone width-1 forward)."""

    def run() -> None:
        current = token
        pending = None
        for i in range(steps):
            out = target(current, cache, [CONTEXT + i])
            current = mx.argmax(out.logits[:, -1:, :], axis=-1).astype(mx.int32)
            async_eval(current)
            if pending is not None:
                pending.item()  # the host reads step k while k + 1 runs
            pending = current
        assert pending is not None
        pending.item()

    return _median_ms(run, repeats) / steps


def calibration_path(
    target_source: str,
    draft_source: str | None,
    dtype: str,
    draft_kind: str | None = None,
) -> Path:
    """The cache file of a calibration: one per target, draft kind (with any
    detail that changes a step's cost, e.g. `mtp/vocab=N`) and source, dtype,
    device (with the CPU thread split and BLAS on a CPU) and MLX version."""
    device = str(mx.default_device())
    if mx.default_device().type == mx.DeviceType.cpu:
        device += f"/threads={cpu_threads()}/blas={route_blas().library}"
        device += f"/bf16-kernel={'on' if cpu_kernel.ready() else 'off'}"
    key = json.dumps(
        [
            FORMAT,
            target_source,
            draft_kind,
            draft_source,
            dtype,
            device,
            version("mlx"),
        ]
    )
    digest = hashlib.sha1(key.encode()).hexdigest()[:16]
    return calibration_root() / f"{digest}.json"


def calibration_root() -> Path:
    """Where calibrations are cached: `$SPECPIPE_CALIBRATION_CACHE`, else
    `calibration/` under the cache root."""
    override = os.environ.get("SPECPIPE_CALIBRATION_CACHE")
    return Path(override) if override else cache_root() / "calibration"


def load_cached(path: Path) -> Result[CostModel, ConfigError]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        return Failure(ConfigError(f"{path}: unreadable calibration ({exc})"))
    return structure(strict, data, CostModel, str(path))


def save(path: Path, cost: CostModel) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(strict.unstructure(cost), indent=2))
    tmp.replace(path)


def calibrated(
    target: CausalLM,
    draft: CausalLM | DraftStep | None,
    target_source: str,
    draft_source: str | None,
    dtype: str,
    max_width: int = 8,
    refresh: bool = False,
    draft_kind: str | None = None,
    draft_head: HeadWeights | None = None,
) -> CostModel:
    """The cached cost model, measuring (and caching) it when absent."""
    path = calibration_path(target_source, draft_source, dtype, draft_kind)
    if not refresh and path.is_file():
        cached = load_cached(path).value_or(None)
        if cached is not None and len(cached.verify_ms) >= max_width:
            return cached
    print(
        "specpipe: calibrating round costs on this machine (once) ...", file=sys.stderr
    )
    cost = measure(target, draft, max_width, draft_head=draft_head)
    save(path, cost)
    return cost
