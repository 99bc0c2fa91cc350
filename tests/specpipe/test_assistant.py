"""The KV-borrowing assistant drafter (specpipe/drafts/assistant.py) on a
Gemma-4 target (models/gemma4.py), with models/gemma4_assistant.py.

- Its first round's drafts are transformers' (`Gemma4AssistantForCausalLM`
  driven as transformers' candidate generator drives it after a prefill),
  on the same random target and assistant weights.
- A commit of any accepted counts leaves the rows where rows opened fresh
  over the committed tokens are: the same hidden state, the same next drafts
  (the round's stale keys past a row's length are masked).
- Lossless: greedy and seeded sampled output == plain decoding, B=1 and
  B=3, depths 1 and 3, on a target with kv-shared layers and per-layer
  embeddings and on the MoE one; a target and assistant whose logits are
  all zero accept every draft (the fully accepted commit); the prompt cache
  resumes it.
- Binding: detection, clear errors for a draft that does not fit its target
  (not a Gemma-4 target, head widths, hidden size, vocabulary), the option
  it refuses.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
import torch
from mlx.utils import tree_flatten, tree_unflatten
from returns.result import Failure, Success
from spec_support import PROMPTS, run, tiny_model, write_artifact
from test_prompt_cache import NEW_TURN, generate

from bindings.kinds import default_registry
from bindings.registry import DraftLoadRequest
from models.gemma4 import Model
from models.gemma4_assistant import Assistant
from schemas.hf_gemma4_assistant import assistant_args
from schemas.request import DraftPolicy, GenerationLimits, SamplingParams
from specpipe.drafts.assistant import AssistantDrafter, AssistantRows
from specpipe.prompt_cache import PromptCache
from specpipe.state import RowState
from tests.models.test_gemma4 import make_hf, ours, tiny_gemma
from tests.models.test_gemma4_assistant import (
    all_shared_stacks,  # noqa: F401  (the fixture transformers' assistant needs)
    assistant_config,
    hf_assistant,
)

pytestmark = pytest.mark.reference

SAMPLINGS = {
    "greedy": SamplingParams(),
    "t0.8-topk": SamplingParams(temperature=0.8, top_k=20, seed=7),
}


def random_assistant(
    seed: int, gain: float = 2.5, ordered: bool = False, **text: Any
) -> Assistant:
    parsed = assistant_args(assistant_config(ordered, **text), "test assistant")
    assert isinstance(parsed, Success), parsed
    mx.random.seed(seed)
    draft = Assistant(parsed.unwrap())
    params = [
        (k, v * gain if v.ndim >= 2 and mx.issubdtype(v.dtype, mx.floating) else v)
        for k, v in tree_flatten(draft.parameters())
    ]
    draft.update(tree_unflatten(params))
    if draft.masked_embedding is not None:
        order = np.random.default_rng(seed).permutation(128)
        draft.masked_embedding.token_ordering = mx.array(order, dtype=mx.int32)
    mx.eval(draft.parameters())
    return draft


def drafter_of(target: Model, draft: Assistant) -> AssistantDrafter:
    return AssistantDrafter(target, draft, target.args.hidden_size, DraftPolicy())


@pytest.fixture(scope="module")
def shared() -> Model:
    """A target whose last layers are kv-shared (per-layer embeddings, capped logits)."""
    return tiny_gemma("shared-ple")


def opened(
    target: Model, drafter: AssistantDrafter, prompts: list[list[int]]
) -> tuple[AssistantRows, Any, list[RowState]]:
    """Rows over equal-length prompts, prefilled (all but the pending token)."""
    rows = [RowState.start(tuple(p), 32, SamplingParams()) for p in prompts]
    cache = target.make_cache(len(rows))
    ids = mx.array([list(r.tokens[:-1]) for r in rows], dtype=mx.int32)
    out = target(ids, cache, [0] * len(rows), prefill=True)
    draft_rows = drafter.open(rows, out.hidden)
    assert isinstance(draft_rows, AssistantRows)
    return draft_rows, cache, rows


def drafted(
    rows: AssistantRows, cache: Any, states: list[RowState], depth: int
) -> list[list[int]]:
    proposal = rows.propose_over(cache, states, depth)
    assert proposal.device is not None
    result: list[list[int]] = proposal.device.tolist()  # type: ignore[assignment]
    return result


def transformers_first_round(
    hf_target: Any, hf_draft: Any, prompt: list[int], depth: int
) -> tuple[int, list[int]]:
    """The target's greedy token after `prompt`, and the `depth` greedy
    drafts transformers' candidate generator asks of the assistant next:
    after a prefill, it feeds the assistant [embed(the new token), the
    target's last hidden state] at the new token's position over the
    target's stored keys/values, then its own projected state and draft,
    at the same position."""
    n = len(prompt)
    with torch.no_grad():
        out = hf_target(
            torch.tensor([prompt]),
            output_hidden_states=True,
            return_shared_kv_states=True,
        )
        token = out.logits[:, -1:].argmax(-1)
        hidden = out.hidden_states[-1][:, -1:]
        embed = hf_target.get_input_embeddings()
        theirs = []
        for _ in range(depth):
            step = hf_draft(
                inputs_embeds=torch.cat([embed(token), hidden], dim=-1),
                position_ids=torch.tensor([[n]]),
                shared_kv_states=out.shared_kv_states,
                attention_mask=torch.ones(1, n + 1, dtype=torch.long),
            )
            token = step.logits.argmax(-1)
            hidden = step.last_hidden_state
            theirs.append(int(token))
    return int(out.logits[0, -1].argmax()), theirs


def test_the_first_round_drafts_are_transformers() -> None:
    hf_target = make_hf("shared-ple", seed=3)
    target = ours(hf_target)
    hf_draft = hf_assistant(ordered=True, seed=4)
    from tests.models.test_gemma4_assistant import ours as our_assistant

    draft = our_assistant(hf_draft)
    prompt = [5, 17, 3, 99, 42, 8, 61, 23, 11]  # past the sliding window of 4
    first, theirs = transformers_first_round(hf_target, hf_draft, prompt, 4)
    rows, cache, states = opened(target, drafter_of(target, draft), [[*prompt, first]])
    assert drafted(rows, cache, states, 4) == [theirs]


@pytest.mark.parametrize("accepted", [[0, 3], [2, 1], [3, 3]])
def test_a_commit_leaves_the_rows_a_fresh_open_has(
    shared: Model, accepted: list[int]
) -> None:
    drafter = drafter_of(shared, random_assistant(2))
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 9, 10, 12, 13, 2]]
    rows, cache, states = opened(shared, drafter, prompts)
    proposal = rows.propose_over(cache, states, 3)
    assert proposal.device is not None
    drafts: list[list[int]] = proposal.device.tolist()  # type: ignore[assignment]
    window = mx.array([[s.pending, *d] for s, d in zip(states, drafts, strict=True)])
    verified = shared(window, cache, [s.length for s in states])
    nexts = [7, 19]  # each row's new pending token (any token: the commit keeps it)
    committed = rows.prepare_commit(
        states, proposal, [tuple(d) for d in drafts], accepted, verified
    ).commit()
    assert isinstance(committed, AssistantRows)
    after = [
        s.advanced((*d[:a], x))
        for s, d, a, x in zip(states, drafts, accepted, nexts, strict=True)
    ]
    assert committed.lengths == tuple(s.length for s in after)
    # fresh rows over the committed tokens, one at a time (their lengths differ)
    for b, row in enumerate(after):
        fresh, fresh_cache, fresh_states = opened(shared, drafter, [list(row.tokens)])
        gap = np.abs(np.array(committed.hidden[b]) - np.array(fresh.hidden[0])).max()
        assert gap < 1e-5, b
        alone = committed.take_rows([b])
        assert isinstance(alone, AssistantRows)
        one_cache = cache.take_rows([b])
        assert drafted(alone, one_cache, [row], 3) == drafted(
            fresh, fresh_cache, fresh_states, 3
        )


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
@pytest.mark.parametrize(
    ("case", "batch", "depth"),
    [
        ("shared-ple", 1, 3),
        ("shared-ple", 3, 1),
        ("moe-keqv", 3, 3),
    ],
)
def test_speculation_equals_plain_decoding(
    sampling: str, case: str, batch: int, depth: int
) -> None:
    target = tiny_gemma(case)
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[3]][:batch]
    params = SAMPLINGS[sampling]
    plain, _ = run(target, prompts, params, max_tokens=14)
    drafter = drafter_of(target, random_assistant(5, ordered=case == "moe-keqv"))
    spec, results = run(target, prompts, params, drafter, depth=depth, max_tokens=14)
    assert spec == plain
    assert all(not r.metrics.draft_errors and r.metrics.drafted > 0 for r in results)


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
def test_zero_logits_accept_every_draft(sampling: str) -> None:
    """Target and assistant with all-zero logits (final norms of weight 0)
    draw the same token at every position, so every draft is accepted:
    the fully accepted commit (the bonus position's hidden state) runs
    every round, and the output is still plain decoding's."""
    target = tiny_gemma("plain")
    target.model.norm.weight = mx.zeros_like(target.model.norm.weight)
    draft = random_assistant(6)
    draft.model.norm.weight = mx.zeros_like(draft.model.norm.weight)
    params = SAMPLINGS[sampling]
    plain, _ = run(target, PROMPTS[:2], params, max_tokens=13)
    spec, results = run(
        target, PROMPTS[:2], params, drafter_of(target, draft), depth=3, max_tokens=13
    )
    assert spec == plain
    for r in results:
        assert r.metrics.drafted > 0 and r.metrics.accepted == r.metrics.drafted


def test_the_prompt_cache_resumes_the_assistant(shared: Model) -> None:
    params = SAMPLINGS["greedy"]
    drafter = drafter_of(shared, random_assistant(8))
    prompt = list(PROMPTS[0])
    first, _ = generate(shared, [prompt], params, None, 0, None)
    turn = prompt + first[0] + list(NEW_TURN)
    second, _ = generate(shared, [turn], params, None, 0, None)
    store = PromptCache(shared)
    out, _ = generate(shared, [prompt], params, drafter, 3, store)
    assert out == first
    again, results = generate(shared, [turn], params, drafter, 3, store)
    fresh, fresh_results = generate(shared, [turn], params, drafter, 3, None)
    assert results[0].cached_tokens > 0
    assert again == fresh == second
    assert results[0].metrics.accepted_at == fresh_results[0].metrics.accepted_at


# --- binding -------------------------------------------------------------------


def load_request(target: Any, folder: Path, **extra: Any) -> DraftLoadRequest:
    from types import SimpleNamespace

    loaded = SimpleNamespace(model=target, args=target.args)
    return DraftLoadRequest(target=loaded, source=str(folder), **extra)


def test_an_assistant_folder_is_detected_and_loads(
    shared: Model, tmp_path: Path
) -> None:
    draft = random_assistant(9, ordered=True)
    folder = write_artifact(tmp_path / "assistant", assistant_config(True), draft)
    registry = default_registry()
    assert registry.detect(folder) == Success("assistant")
    loaded = registry.load("assistant", load_request(shared, folder))
    assert isinstance(loaded, Success), loaded
    assert (loaded.unwrap().kind, loaded.unwrap().width) == ("assistant", 3)
    drafter = loaded.unwrap().drafter
    assert isinstance(drafter, AssistantDrafter)
    spec, _ = run(shared, PROMPTS[:1], SamplingParams(), drafter, depth=3, max_tokens=8)
    plain, _ = run(shared, PROMPTS[:1], SamplingParams(), max_tokens=8)
    assert spec == plain


@pytest.mark.parametrize(
    ("target_kind", "text", "top", "named"),
    [
        ("llama", {}, {}, "does not lend"),
        ("gemma", {"head_dim": 8}, {}, "dims"),
        ("gemma", {}, {"backbone_hidden_size": 32}, "hidden states of size 32"),
        ("gemma", {"vocab_size": 256}, {}, "vocabulary"),
        (
            "gemma",
            {"num_attention_heads": 3, "num_key_value_heads": 1},
            {},
            "query heads",
        ),
    ],
)
def test_a_draft_that_does_not_fit_is_refused_naming_why(
    shared: Model,
    tmp_path: Path,
    target_kind: str,
    text: dict[str, Any],
    top: dict[str, Any],
    named: str,
) -> None:
    config = {**assistant_config(False, **text), **top}
    target: Any = tiny_model(1) if target_kind == "llama" else shared
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "config.json").write_text(json.dumps(config))
    result = default_registry().load("assistant", load_request(target, tmp_path / "a"))
    assert isinstance(result, Failure)
    assert named in result.failure().message, result.failure().message


def test_a_draft_vocabulary_is_refused(shared: Model, tmp_path: Path) -> None:
    folder = write_artifact(
        tmp_path / "a", assistant_config(False), random_assistant(1)
    )
    result = default_registry().load(
        "assistant", load_request(shared, folder, draft_vocab="vocab.json")
    )
    assert isinstance(result, Failure)
    assert "own head" in result.failure().message


def test_the_pipeline_loads_a_gemma_target_with_its_assistant(tmp_path: Path) -> None:
    """`specpipe.load(target folder, draft=assistant folder)`: detected as
    an assistant, bound, and generating what the target alone generates."""
    from tests.models.test_gemma4 import CASES, TINY

    vocab = 320  # the tiny tokenizer's ids fit
    raw = {
        **TINY,
        **CASES["shared-ple"],
        "model_type": "gemma4_text",
        "vocab_size": vocab,
        "vocab_size_per_layer_input": vocab,
    }
    check_pipeline_load(tmp_path, raw, assistant_config(False, vocab_size=vocab))


def check_pipeline_load(
    tmp_path: Path, raw: dict[str, Any], config: dict[str, Any]
) -> None:
    """A random target of config `raw` and a random assistant of `config`,
    written as folders (the tiny tokenizer's), loaded through `specpipe.load`:
    the assistant drafts every round, and the output is the target's alone."""
    from specpipe.api import load
    from tests.cli.conftest import write_tiny_model

    folder = write_tiny_model(tmp_path / "target")
    raw = {k: v for k, v in raw.items() if k != "attn_implementation"}
    (folder / "config.json").write_text(json.dumps(raw))
    mx.random.seed(3)
    target = Model(ours_args(raw))
    mx.save_safetensors(
        str(folder / "model.safetensors"), dict(tree_flatten(target.parameters()))
    )
    parsed = assistant_args(config, "assistant").unwrap()
    mx.random.seed(4)
    folder_a = write_artifact(tmp_path / "assistant", config, Assistant(parsed))
    limits = GenerationLimits(max_tokens=12)
    plain = load(str(folder)).unwrap().generate("def fib", limits=limits).unwrap()
    pipeline = load(
        str(folder), draft=str(folder_a), num_draft_tokens=2, adaptive=False
    ).unwrap()  # (adaptive drafting may judge a random draft not worth it)
    spec = pipeline.generate("def fib", limits=limits).unwrap()
    assert spec.tokens == plain.tokens and spec.generated_tokens == 12
    assert spec.stats.draft == "assistant" and spec.stats.drafted > 0


def ours_args(raw: dict[str, Any]) -> Any:
    from schemas.hf_gemma4 import gemma4_args

    return gemma4_args(raw, "test").unwrap()


def test_a_calibration_round_drafts_from_the_same_state_each_call(
    shared: Model,
) -> None:
    from specpipe.calibrate import DraftRound, measure

    drafter = drafter_of(shared, random_assistant(10))
    assert isinstance(drafter, DraftRound)
    context = mx.random.randint(0, 97, (1, 12), key=mx.random.key(4)).astype(mx.int32)
    hidden = shared(context, shared.make_cache(1), [0]).hidden
    round_of = drafter.calibration_round(context, hidden)
    deep, shallow, again = round_of(3), round_of(1), round_of(3)
    assert deep.shape == (1, 3) and shallow.shape == (1, 1)
    assert deep.tolist() == again.tolist()  # greedy, from one state
    assert deep[:, :1].tolist() == shallow.tolist()
    assert measure(shared, drafter, max_width=2, repeats=1).draft_ms > 0.0
