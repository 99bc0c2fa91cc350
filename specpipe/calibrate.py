"""Calibration: what a round costs on this machine, measured once and cached.

The target's forward over a window of width 1..W and one draft step are timed
on a short random context; the medians form the `CostModel` the adaptive
drafter maximises tokens per second against. The result is cached per
(target, draft, dtype, device) under the model cache, and loaded
automatically when adaptive drafting is on.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import sys
import time
from importlib.metadata import version
from pathlib import Path

import mlx.core as mx
from returns.result import Failure, Result

from models.base import CausalLM
from schemas.converter import strict, structure
from schemas.errors import ConfigError
from specpipe.adaptive import CostModel
from specpipe.fixtures import cache_root

CONTEXT = 64


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
    target: CausalLM, draft: CausalLM | None, max_width: int = 8, repeats: int = 3
) -> CostModel:
    vocab = target.args.vocab_size
    context = mx.random.randint(0, vocab, (1, CONTEXT), key=mx.random.key(0)).astype(
        mx.int32
    )

    def prefilled(model: CausalLM) -> object:
        cache = model.make_cache(1)
        model(context, cache, [0])
        mx.eval(cache.arrays())
        return cache

    target_cache = prefilled(target)
    verify_ms = []
    for width in range(1, max_width + 1):
        window = context[:, :width]

        def forward(window: mx.array = window) -> None:
            out = target(window, target_cache, [CONTEXT])
            mx.eval(mx.argmax(out.logits, axis=-1))

        verify_ms.append(_median_ms(forward, repeats))
    draft_ms = 0.0
    if draft is not None:
        draft_cache = prefilled(draft)
        token = context[:, :1]

        def draft_step() -> None:
            out = draft(token, draft_cache, [CONTEXT])
            mx.eval(mx.argmax(draft.lm_head(out.hidden), axis=-1))

        draft_ms = _median_ms(draft_step, repeats)
    return CostModel(tuple(verify_ms), draft_ms)


def calibration_path(target_source: str, draft_source: str | None, dtype: str) -> Path:
    key = json.dumps(
        [target_source, draft_source, dtype, str(mx.default_device()), version("mlx")]
    )
    digest = hashlib.sha1(key.encode()).hexdigest()[:16]
    return cache_root() / "calibration" / f"{digest}.json"


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
    draft: CausalLM | None,
    target_source: str,
    draft_source: str | None,
    dtype: str,
    max_width: int = 8,
    refresh: bool = False,
) -> CostModel:
    """The cached cost model, measuring (and caching) it when absent."""
    path = calibration_path(target_source, draft_source, dtype)
    if not refresh and path.is_file():
        cached = load_cached(path).value_or(None)
        if cached is not None and len(cached.verify_ms) >= max_width:
            return cached
    print(
        "specpipe: calibrating round costs on this machine (once) ...", file=sys.stderr
    )
    cost = measure(target, draft, max_width)
    save(path, cost)
    return cost
