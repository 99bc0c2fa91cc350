"""Support for the pipeline tests: tiny random models, collecting sinks,
scripted drafters, a runner with a cache of plain-decoding references, and a
draft's weights and config written as a draft folder (`write_artifact`).

Every model here is a 2-layer, hidden-64 qwen2 with a 97-token vocabulary and
random weights from a fixed `mx.random.seed`, small enough that a whole
generation takes well under a second on a CPU.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from models.base import CausalLM, ModelOutput
from models.build import build_model
from models.cache import KVCache
from schemas.converter import hf, structure
from schemas.hf import DecoderArgs, normalize_hf_config
from schemas.request import SamplingParams
from specpipe.draft import Drafter, DraftRows, Proposal
from specpipe.loop import RoundOptions, RowRequest, RowResult, generate_rows
from specpipe.output import TopLogprobs
from specpipe.state import RowState
from specpipe.transaction import Prepared, ready

VOCAB = 97

TINY_CONFIG: dict[str, Any] = {
    "model_type": "qwen2",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": VOCAB,
    "rope_theta": 10000.0,
    "max_position_embeddings": 512,
}

# Four rows of prompt lengths 11, 5, 1 and 17; some repeat, so that prompt
# lookup finds drafts. A one-token prompt leaves nothing to prefill.
PROMPTS: tuple[tuple[int, ...], ...] = (
    (1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3),
    (9, 10, 11, 9, 10),
    (42,),
    (5,) * 17,
)


def tiny_args(**overrides: Any) -> DecoderArgs:
    cfg = {**TINY_CONFIG, **overrides}
    return structure(hf, normalize_hf_config(cfg), DecoderArgs, "tiny").unwrap()


# Random init gives near-uniform logits, and greedy decoding then repeats one
# token; scaling every matrix by GAIN gives varied greedy output and peaked
# (but not one-hot) sampling distributions.
GAIN = 2.5


def scale_matrices(module: Any, gain: float, stacked: bool = False) -> None:
    """Every matrix (2-D parameter) of `module` times `gain`, evaluated;
    `stacked`: every parameter of two or more dimensions (experts' stacks
    too)."""
    module.update(
        tree_unflatten(
            [
                (k, v * gain if (v.ndim >= 2 if stacked else v.ndim == 2) else v)
                for k, v in tree_flatten(module.parameters())
            ]
        )
    )
    mx.eval(module.parameters())


def write_artifact(folder: Path, config: dict[str, Any], draft: Any) -> Path:
    """`draft`'s weights and `config` as a draft folder."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(
        str(folder / "model.safetensors"), dict(tree_flatten(draft.parameters()))
    )
    return folder


def tiny_model(seed: int, gain: float = GAIN, **overrides: Any) -> CausalLM:
    mx.random.seed(seed)
    model = build_model(tiny_args(**overrides)).unwrap()
    scale_matrices(model, gain)
    return model


def perturbed(source: CausalLM, seed: int, scale: float) -> CausalLM:
    """A copy of `source` with Gaussian noise (`scale` x each tensor's std) on
    every weight: a draft model that agrees with the target part of the time."""
    model = build_model(source.args).unwrap()
    mx.random.seed(seed)
    noisy = [
        (k, v + scale * mx.std(v) * mx.random.normal(v.shape))
        for k, v in tree_flatten(source.parameters())
    ]
    model.update(tree_unflatten(noisy))
    mx.eval(model.parameters())
    return model


class CollectSink:
    """Records every published token (its log-probability and top alternatives)."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.logprobs: list[float | None] = []
        self.tops: list[TopLogprobs] = []

    def push(self, token: int, logprob: float | None, top: TopLogprobs = ()) -> bool:
        self.tokens.append(token)
        self.logprobs.append(logprob)
        self.tops.append(top)
        return True


def run(
    model: CausalLM,
    prompts: Sequence[Sequence[int]],
    sampling: SamplingParams | Sequence[SamplingParams],
    drafter: Drafter | None = None,
    depth: int = 0,
    max_tokens: int = 16,
    eos: Sequence[int] = (),
    device_round: bool = True,
    sinks: Sequence[Any] | None = None,
    logprobs: bool = False,
    cancelled: Sequence[Callable[[], bool] | None] | None = None,
    draft_ahead: bool = False,
    top_logprobs: Sequence[int] | None = None,
) -> tuple[list[list[int]], list[RowResult]]:
    """Generate every prompt as one batch; the tokens each sink saw, and results."""
    params = (
        [sampling] * len(prompts)
        if isinstance(sampling, SamplingParams)
        else list(sampling)
    )
    sinks = list(sinks) if sinks is not None else [CollectSink() for _ in prompts]
    stops = list(cancelled) if cancelled is not None else [None] * len(prompts)
    tops = list(top_logprobs) if top_logprobs is not None else [0] * len(prompts)
    requests = [
        RowRequest(tuple(p), s, max_tokens, sink, logprobs, stop, top_logprobs=k)
        for p, s, sink, stop, k in zip(prompts, params, sinks, stops, tops, strict=True)
    ]
    results = generate_rows(
        model,
        requests,
        eos,
        drafter,
        RoundOptions(depth=depth, device_round=device_round, draft_ahead=draft_ahead),
    )
    return [list(s.tokens) for s in sinks], results


class PlainReference:
    """Plain decoding outputs, computed once per (prompts, sampling, budget, eos)."""

    def __init__(self, model: CausalLM) -> None:
        self.model = model
        self._memo: dict[Any, list[list[int]]] = {}

    def __call__(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingParams | Sequence[SamplingParams],
        max_tokens: int = 16,
        eos: Sequence[int] = (),
    ) -> list[list[int]]:
        params = (
            (sampling,) * len(prompts)
            if isinstance(sampling, SamplingParams)
            else tuple(sampling)
        )
        key = (tuple(map(tuple, prompts)), params, max_tokens, tuple(eos))
        if key not in self._memo:
            tokens, results = run(
                self.model, prompts, params, max_tokens=max_tokens, eos=eos
            )
            assert all(r.finish in ("length", "stop") for r in results)
            self._memo[key] = tokens
        return [list(t) for t in self._memo[key]]


# --- scripted drafters -------------------------------------------------------


class HostileRows:
    """Proposes random ids: `depth` of them, or a random count 0..depth per row."""

    needs_target_hidden = False

    def __init__(self, rng: random.Random, random_count: bool) -> None:
        self.rng = rng
        self.random_count = random_count
        self.proposed: list[tuple[tuple[int, ...], ...]] = []

    def propose(self, rows: Sequence[RowState], depth: int) -> Proposal:
        drafts = tuple(
            tuple(
                self.rng.randrange(VOCAB)
                for _ in range(
                    self.rng.randint(0, depth) if self.random_count else depth
                )
            )
            for _ in rows
        )
        self.proposed.append(drafts)
        return Proposal(depth, host=drafts)

    def prepare_commit(
        self,
        rows: Sequence[RowState],
        proposal: Proposal,
        drafts: Sequence[tuple[int, ...]],
        accepted: Sequence[int],
        verified: ModelOutput,
    ) -> Prepared[DraftRows]:
        return ready(self)

    def take_rows(self, keep: Sequence[int]) -> DraftRows:
        return self

    def join(self, other: DraftRows) -> DraftRows:
        return self


class HostileDrafter:
    needs_target_hidden = False
    kind = "hostile"

    def __init__(self, seed: int, random_count: bool = False) -> None:
        self.seed = seed
        self.random_count = random_count

    def open(
        self, rows: Sequence[RowState], hidden: mx.array | None = None
    ) -> DraftRows:
        return HostileRows(random.Random(self.seed), self.random_count)


class OracleRows:
    """Proposes the true continuation (from a plain run), corrupted at a random
    position with probability `noise`, and cut to a random length."""

    needs_target_hidden = False

    def __init__(
        self, truth: dict[tuple[int, ...], list[int]], rng: random.Random, noise: float
    ) -> None:
        self.truth = truth
        self.rng = rng
        self.noise = noise

    def propose(self, rows: Sequence[RowState], depth: int) -> Proposal:
        drafts = []
        for row in rows:
            prompt = row.tokens[: row.prompt_len]
            done = len(row.tokens) - row.prompt_len
            true = list(self.truth[prompt][done : done + depth])
            true += [self.rng.randrange(VOCAB) for _ in range(depth - len(true))]
            if self.rng.random() < self.noise:
                i = self.rng.randrange(depth)
                true[i] = (true[i] + 1 + self.rng.randrange(VOCAB - 1)) % VOCAB
            drafts.append(tuple(true[: self.rng.randint(0, depth)]))
        return Proposal(depth, host=tuple(drafts))

    def prepare_commit(
        self,
        rows: Sequence[RowState],
        proposal: Proposal,
        drafts: Sequence[tuple[int, ...]],
        accepted: Sequence[int],
        verified: ModelOutput,
    ) -> Prepared[DraftRows]:
        return ready(self)

    def take_rows(self, keep: Sequence[int]) -> DraftRows:
        return self

    def join(self, other: DraftRows) -> DraftRows:
        return self


class OracleDrafter:
    needs_target_hidden = False
    kind = "oracle"

    def __init__(
        self, truth: dict[tuple[int, ...], list[int]], seed: int, noise: float = 0.5
    ) -> None:
        self.truth = truth
        self.seed = seed
        self.noise = noise

    def open(
        self, rows: Sequence[RowState], hidden: mx.array | None = None
    ) -> DraftRows:
        return OracleRows(self.truth, random.Random(self.seed), self.noise)


# --- helpers for state comparisons --------------------------------------------


def cache_prefix(cache: KVCache, lengths: Sequence[int]) -> list[list[Any]]:
    """Host copies of each row's committed prefix, per layer (keys then values)."""
    import numpy as np

    arrays = cache.arrays()
    mx.eval(arrays)
    return [[np.array(a[b, :, :n, :]) for b, n in enumerate(lengths)] for a in arrays]


def same_prefix(a: list[list[Any]], b: list[list[Any]]) -> bool:
    import numpy as np

    return len(a) == len(b) and all(
        len(x) == len(y)
        and all(np.array_equal(p, q) for p, q in zip(x, y, strict=True))
        for x, y in zip(a, b, strict=True)
    )
