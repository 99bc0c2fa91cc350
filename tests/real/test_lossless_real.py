"""Speculative output == plain output on the real checkpoints, B=1 and B>1.

ngram on SmolLM2; two-model with the Qwen2.5-Coder 1.5B target and 0.5B draft.
"""

from __future__ import annotations

import pytest
from attrs import evolve

from schemas.request import GenerationLimits, SamplingParams
from specpipe.api import Pipeline, load
from tests.real.conftest import GEMMA3, QWEN_05, QWEN_15, SMOLLM2

CODE_EDIT = (
    "Rename the variable `total` to `acc` in this function and return it unchanged otherwise:\n"
    "def add_all(values):\n    total = 0\n    for v in values:\n        total += v\n    return total\n"
)
PROMPTS = ["def quicksort(arr):", "Write a short poem about the moon.", CODE_EDIT]
SAMPLINGS = [
    SamplingParams(),
    SamplingParams(temperature=0.7, top_p=0.9, top_k=40, seed=5),
    SamplingParams(temperature=1.0, seed=9),
]


def _tokens(
    pipeline: Pipeline, prompts: list[str], sampling: SamplingParams, n: int
) -> list[tuple[int, ...]]:
    results = pipeline.generate_batch(
        prompts, sampling, GenerationLimits(max_tokens=n), chat=True
    )
    return [r.tokens for r in results.unwrap()]


@pytest.fixture(scope="module")
def qwen_pair() -> Pipeline:
    """The 1.5B target with the 0.5B draft, both kept quantized (the default);
    its plain twin shares the target (one copy of its weights in memory)."""
    return load(QWEN_15, draft=QWEN_05, num_draft_tokens=4, adaptive=False).unwrap()


@pytest.mark.fixture
@pytest.mark.parametrize(
    "sampling", SAMPLINGS, ids=["greedy", "t0.7-topp-topk", "t1.0"]
)
def test_ngram_on_smollm2(smollm2: Pipeline, sampling: SamplingParams) -> None:
    ngram = (
        load(SMOLLM2, draft="ngram", num_draft_tokens=6, adaptive=False).unwrap().draft
    )
    spec = evolve(smollm2, draft=ngram)
    plain_batch = _tokens(smollm2, PROMPTS, sampling, 32)
    assert _tokens(spec, PROMPTS, sampling, 32) == plain_batch
    if sampling.greedy:
        for prompt, expected in zip(PROMPTS, plain_batch, strict=True):
            assert _tokens(spec, [prompt], sampling, 32) == [expected]


@pytest.mark.fixture
@pytest.mark.parametrize("sampling", SAMPLINGS[:2], ids=["greedy", "t0.7-topp-topk"])
def test_two_model_qwen_pair(qwen_pair: Pipeline, sampling: SamplingParams) -> None:
    plain_pipeline = evolve(qwen_pair, draft=None)
    prompts = PROMPTS[:2]
    plain = _tokens(plain_pipeline, prompts, sampling, 16)
    assert _tokens(qwen_pair, prompts, sampling, 16) == plain
    single = qwen_pair.generate(
        prompts[0], sampling, GenerationLimits(max_tokens=16), chat=True
    ).unwrap()
    assert single.tokens == plain[0]
    assert single.stats.accepted > 0


@pytest.mark.fixture
@pytest.mark.parametrize("sampling", SAMPLINGS[:2], ids=["greedy", "t0.7-topp-topk"])
def test_smollm2_kept_quantized_decodes_as_its_float_twin(
    smollm2_float: Pipeline, sampling: SamplingParams
) -> None:
    """SmolLM2's GGUF (Q4_1 matrices, a Q8_0 embedding) loaded as by default,
    its blocks kept quantized: the same weights in under a quarter of the
    bytes, so the same tokens as the float32 import, plainly and with an
    ngram draft."""
    kept = load(SMOLLM2, draft="ngram", num_draft_tokens=6, adaptive=False).unwrap()
    layer = kept.target.model.model.layers[0]
    assert type(layer.mlp.down_proj).__name__ == "QuantizedLinear"
    float_layer = smollm2_float.target.model.model.layers[0]  # type: ignore[attr-defined]
    assert type(float_layer.mlp.down_proj).__name__ == "Linear"
    expected = _tokens(smollm2_float, PROMPTS, sampling, 32)
    assert _tokens(evolve(kept, draft=None), PROMPTS, sampling, 32) == expected
    assert _tokens(kept, PROMPTS, sampling, 32) == expected


@pytest.mark.fixture
def test_qwen05_kept_quantized_decodes_as_its_float_twin(
    qwen05: Pipeline, qwen05_float: Pipeline
) -> None:
    """The Qwen2.5-Coder 0.5B GGUF kept quantized (the default) mixes 5-bit
    (Q5_0), 4-bit (Q4_K), 8-bit (Q8_0) layers in groups of 32 and 6-bit
    (Q6_K) ones in groups of 16: the same greedy tokens as its float32
    import."""
    kept = qwen05
    forms = {
        (module.bits, module.group_size)
        for _, module in kept.target.model.named_modules()
        if type(module).__name__.startswith("Quantized")
    }
    assert forms == {(4, 32), (5, 32), (6, 16), (8, 32)}
    sampling = SAMPLINGS[0]
    assert _tokens(kept, PROMPTS[:2], sampling, 16) == _tokens(
        qwen05_float, PROMPTS[:2], sampling, 16
    )


@pytest.mark.fixture
def test_a_kept_fixture_loads_from_its_cached_folder_as_from_its_gguf() -> None:
    """A fixture kept quantized is converted once into an MLX folder in the
    cache (`fixture_folder(name, kept=True)`) and loaded from there: the same
    model as reading its GGUF with the blocks kept, logits bit for bit."""
    import json

    import mlx.core as mx
    import numpy as np

    from specpipe.fixtures import install_fixture
    from specpipe.load import KEPT_FORM, fixture_folder
    from specpipe.load import load as load_model

    folder = fixture_folder(SMOLLM2, kept=True).unwrap()
    assert folder.name.endswith(f"-gguf-quantized.v{KEPT_FORM}")
    config = json.loads((folder / "config.json").read_text())
    assert config["quantization"]["group_size"] == 32
    cached = load_model(SMOLLM2).unwrap()
    assert cached.source == SMOLLM2
    direct = load_model(str(install_fixture(SMOLLM2).unwrap())).unwrap()
    ids = mx.array([[1, 504, 3458, 314, 260, 2367, 30]])
    logits = [
        np.array(m.model(ids, m.model.make_cache(1), [0]).logits)
        for m in (cached, direct)
    ]
    np.testing.assert_array_equal(logits[0], logits[1])


@pytest.mark.fixture
@pytest.mark.parametrize("sampling", SAMPLINGS[:2], ids=["greedy", "t0.7-topp-topk"])
def test_ngram_on_gemma3(gemma3: Pipeline, sampling: SamplingParams) -> None:
    """Gemma-3 270M (a base model: plain prompts, no chat template), its
    sliding-window layers and kept K blocks: n-gram speculation gives plain
    decoding's tokens, three rows at once."""
    ngram = (
        load(GEMMA3, draft="ngram", num_draft_tokens=6, adaptive=False).unwrap().draft
    )
    spec = evolve(gemma3, draft=ngram)
    limits = GenerationLimits(max_tokens=24)
    plain = gemma3.generate_batch(PROMPTS, sampling, limits).unwrap()
    got = spec.generate_batch(PROMPTS, sampling, limits).unwrap()
    assert [r.tokens for r in got] == [r.tokens for r in plain]
    assert sum(r.stats.drafted for r in got) > 0
