"""Golden outputs on the real checkpoints, committed under tests/golden/.

Regenerate after an intended change with SPECPIPE_REGEN_GOLDEN=1.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from schemas.request import GenerationLimits, SamplingParams
from specpipe.api import Pipeline

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
CASES = {
    "smollm2-greedy-code": ("def fibonacci(n):", SamplingParams(), False),
    "smollm2-greedy-chat": ("What is the capital of France?", SamplingParams(), True),
    "smollm2-sampled-chat": (
        "Write a haiku about the sea.",
        SamplingParams(temperature=0.8, top_p=0.9, seed=7),
        True,
    ),
}


def check_golden(name: str, observed: dict[str, object]) -> None:
    path = GOLDEN / f"{name}.json"
    if os.environ.get("SPECPIPE_REGEN_GOLDEN") == "1":
        GOLDEN.mkdir(exist_ok=True)
        path.write_text(json.dumps(observed, indent=1, ensure_ascii=False) + "\n")
    expected = json.loads(path.read_text())
    assert observed == expected, (
        f"{name} differs from {path} (regenerate with SPECPIPE_REGEN_GOLDEN=1)"
    )


@pytest.mark.fixture
@pytest.mark.parametrize("name", sorted(CASES))
def test_smollm2_golden(smollm2: Pipeline, name: str) -> None:
    prompt, sampling, chat = CASES[name]
    result = smollm2.generate(
        prompt, sampling, GenerationLimits(max_tokens=32), chat=chat
    ).unwrap()
    check_golden(
        name, {"prompt": prompt, "tokens": list(result.tokens), "text": result.text}
    )
