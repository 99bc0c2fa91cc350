"""The KV-borrowing assistant drafter on Gemma-4 Unified: a
`gemma4_unified_assistant` (models/gemma4_assistant.py) over a
`gemma4_unified_text` target (models/gemma4.py), with
tests/specpipe/test_assistant.py's helpers.

- Its first round's drafts are transformers' (`Gemma4UnifiedForCausalLM`
  with `Gemma4UnifiedAssistantForCausalLM`, as its candidate generator
  drives them), on the same random weights.
- Lossless: greedy and seeded sampled output == plain decoding, B=1 and
  B=3, on a unified target with kv-shared layers and keys-as-values full
  layers of one KV head.
- Loading: a unified target folder with a unified assistant folder through
  `specpipe.load`; an assistant of one family binds to a target of the
  other where the shapes fit, and is refused, naming why, where not.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from returns.result import Failure, Success
from spec_support import PROMPTS, run, write_artifact
from test_assistant import (
    SAMPLINGS,
    check_pipeline_load,
    drafted,
    drafter_of,
    load_request,
    opened,
    random_assistant,
    shared,  # noqa: F401  (the plain Gemma-4 target fixture)
    transformers_first_round,
)

from bindings.kinds import default_registry
from models.gemma4 import Model
from schemas.request import SamplingParams
from specpipe.drafts.assistant import AssistantDrafter
from tests.models.test_gemma4 import ours, random_model
from tests.models.test_gemma4_assistant import (
    all_shared_stacks,  # noqa: F401  (the fixture transformers' assistant needs)
    assistant_config,
    hf_assistant,
)
from tests.models.test_gemma4_assistant import ours as our_assistant
from tests.models.test_gemma4_unified import make_unified, unified_raw

pytestmark = pytest.mark.reference


@pytest.fixture(scope="module")
def unified() -> Model:
    """A unified target: layers 3-5 kv-shared, keys-as-values full layers."""
    return random_model(unified_raw("shared-keqv"))


def test_the_first_round_drafts_are_transformers() -> None:
    hf_target = make_unified("shared-keqv", seed=3)
    target = ours(hf_target)
    # transformers groups the query heads by the assistant's own KV head
    # counts: the target's (one for the full layers) here
    hf_draft = hf_assistant(
        ordered=True,
        seed=4,
        unified=True,
        attention_k_eq_v=True,
        num_global_key_value_heads=1,
    )
    draft = our_assistant(hf_draft)
    prompt = [5, 17, 3, 99, 42, 8, 61, 23, 11]  # past the sliding window of 4
    first, theirs = transformers_first_round(hf_target, hf_draft, prompt, 4)
    rows, cache, states = opened(target, drafter_of(target, draft), [[*prompt, first]])
    assert drafted(rows, cache, states, 4) == [theirs]


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
@pytest.mark.parametrize(("batch", "depth"), [(1, 3), (3, 2)])
def test_speculation_equals_plain_decoding(
    unified: Model, sampling: str, batch: int, depth: int
) -> None:
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[3]][:batch]
    params = SAMPLINGS[sampling]
    plain, _ = run(unified, prompts, params, max_tokens=14)
    draft = random_assistant(5, ordered=batch > 1, unified=True)
    drafter = drafter_of(unified, draft)
    spec, results = run(unified, prompts, params, drafter, depth=depth, max_tokens=14)
    assert spec == plain
    assert all(not r.metrics.draft_errors and r.metrics.drafted > 0 for r in results)


def test_the_pipeline_loads_a_unified_target_with_its_assistant(
    tmp_path: Path,
) -> None:
    """`specpipe.load(target folder, draft=assistant folder)`: a
    `gemma4_unified_text` target, a `gemma4_unified_assistant` draft,
    detected, bound, and generating what the target alone generates."""
    vocab = 320  # the tiny tokenizer's ids fit
    raw = unified_raw("shared-keqv", vocab_size=vocab)
    config = assistant_config(False, unified=True, vocab_size=vocab)
    check_pipeline_load(tmp_path, raw, config)


@pytest.mark.parametrize(
    ("on_unified", "assistant_unified"), [(False, True), (True, False)]
)
def test_an_assistant_binds_across_the_families_where_the_shapes_fit(
    unified: Model,
    shared: Model,  # noqa: F811
    tmp_path: Path,
    on_unified: bool,
    assistant_unified: bool,
) -> None:
    """A unified assistant on a Gemma-4 target and a Gemma-4 assistant on a
    unified target: the same head widths, hidden size and vocabulary, so
    each binds, and speculation is plain decoding."""
    target = unified if on_unified else shared
    config = assistant_config(False, unified=assistant_unified)
    draft = random_assistant(9, unified=assistant_unified)
    folder = write_artifact(tmp_path / "assistant", config, draft)
    registry = default_registry()
    assert registry.detect(folder) == Success("assistant")
    loaded = registry.load("assistant", load_request(target, folder))
    assert isinstance(loaded, Success), loaded
    drafter = loaded.unwrap().drafter
    assert isinstance(drafter, AssistantDrafter)
    greedy = SamplingParams()
    spec, _ = run(target, PROMPTS[:1], greedy, drafter, depth=3, max_tokens=8)
    plain, _ = run(target, PROMPTS[:1], greedy, max_tokens=8)
    assert spec == plain


@pytest.mark.parametrize(
    ("text", "top", "named"),
    [
        ({"head_dim": 8}, {}, "dims"),
        ({}, {"backbone_hidden_size": 3840}, "hidden states of size 3840"),
        ({"vocab_size": 256}, {}, "vocabulary"),
        ({"num_attention_heads": 3, "num_key_value_heads": 1}, {}, "query heads"),
    ],
)
def test_a_unified_assistant_that_does_not_fit_is_refused_naming_why(
    unified: Model,
    tmp_path: Path,
    text: dict[str, Any],
    top: dict[str, Any],
    named: str,
) -> None:
    config = {**assistant_config(False, unified=True, **text), **top}
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "config.json").write_text(json.dumps(config))
    result = default_registry().load("assistant", load_request(unified, tmp_path / "a"))
    assert isinstance(result, Failure)
    assert named in result.failure().message, result.failure().message
