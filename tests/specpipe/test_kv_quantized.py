"""Quantized keys and values (`--kv-bits`, `models.cache.QuantizedKVCache`):
what the cache stores and returns, speculation against plain decoding with
the same cache (a two-model draft and prompt lookup on a llama-family
target, an MTP head on a hybrid one), the prompt-cache file, and the
command line."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from models.cache import KVCache, KVQuantization, QuantizedKVCache
from schemas.request import GenerationLimits, SamplingParams
from specpipe.api import load
from specpipe.cli import main
from tests.cli.conftest import write_tiny_model
from tests.specpipe.test_mtp_companion import PROMPTS, write_hybrid

SAMPLINGS = [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9, seed=5)]


def _quantized(bits: int, batch: int = 2) -> QuantizedKVCache:
    return QuantizedKVCache(2, batch, 2, 64, mx.float16, KVQuantization(bits, 64))


@pytest.mark.parametrize("bits", [4, 8])
def test_the_cache_returns_each_position_quantized_on_its_own(bits: int) -> None:
    """A window written at once reads back as the same positions written one
    at a time (a position's groups lie along the head dimension): what makes
    a verify window store what plain decoding stores. The values are MLX's
    affine quantization of the keys and values; rows at different offsets,
    row copies and row stacks keep them; the buffers take a fraction of a
    float16 cache's bytes."""
    rng = np.random.default_rng(bits)
    keys = mx.array(rng.normal(0, 1, (2, 2, 5, 64)).astype(np.float16))
    values = mx.array(rng.normal(0, 1, (2, 2, 5, 64)).astype(np.float16))
    whole, steps = _quantized(bits), _quantized(bits)
    whole.reserve(8)
    steps.reserve(8)
    got_k, got_v = whole.write(1, keys, values, [1, 3])
    for i in range(5):
        step_k, step_v = steps.write(
            1, keys[:, :, i : i + 1], values[:, :, i : i + 1], [1 + i, 3 + i]
        )
    assert got_k.shape == (2, 2, 8, 64) and got_v.dtype == mx.float16
    for row, start in enumerate((1, 3)):
        span = slice(start, start + 5)
        assert mx.array_equal(got_k[row, :, span], step_k[row, :, span])
        assert mx.array_equal(got_v[row, :, span], step_v[row, :, span])
        want = mx.dequantize(
            *mx.quantize(keys[row], group_size=64, bits=bits), group_size=64, bits=bits
        ).astype(mx.float16)
        assert mx.array_equal(got_k[row, :, span], want)
    one = whole.take_rows([1], end=8)
    both = QuantizedKVCache.concat_rows([one, whole.take_rows([0])])
    assert isinstance(both, QuantizedKVCache) and both.batch == 2
    swapped_k, swapped_v = both.read(1, 8)
    assert mx.array_equal(swapped_k, got_k[::-1]) and mx.array_equal(
        swapped_v, got_v[::-1]
    )
    plain = KVCache(2, 2, 2, 64, mx.float16)
    plain.reserve(8)
    ratio = sum(a.nbytes for a in whole.arrays()) / sum(
        a.nbytes for a in plain.arrays()
    )
    assert ratio == pytest.approx((bits / 16) + 2 * 2 / 64 / 2, abs=1e-6)


def _tiny(folder: Path) -> Path:
    """A llama-family target whose heads are 32 wide (groups of 32)."""
    return write_tiny_model(folder, hidden_size=128)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("draft", ["self", "ngram"])
def test_speculation_with_quantized_keys_and_values_is_plain_decoding(
    tmp_path: Path, bits: int, draft: str
) -> None:
    """With `kv_bits`, drafted output (a two-model draft, prompt lookup;
    batches of rows, greedy and sampled) equals plain decoding with the same
    cache; the cache is a `QuantizedKVCache`."""
    folder = _tiny(tmp_path / "t")
    drafting = str(folder) if draft == "self" else draft
    options = {"kv_bits": bits, "kv_group_size": 32, "adaptive": False}
    plain = load(str(folder), **options).unwrap()
    spec = load(str(folder), draft=drafting, num_draft_tokens=3, **options).unwrap()
    assert isinstance(plain.target.model.make_cache(1), QuantizedKVCache)
    prompts = ["def fib(n):", "hello world hello world", "x"]
    limits = GenerationLimits(max_tokens=12)
    for sampling in SAMPLINGS:
        want = [
            r.tokens for r in plain.generate_batch(prompts, sampling, limits).unwrap()
        ]
        got = spec.generate_batch(prompts, sampling, limits).unwrap()
        assert [r.tokens for r in got] == want
        assert sum(r.stats.drafted for r in got) > 0


def test_an_mtp_head_on_a_hybrid_target_with_quantized_keys_and_values(
    tmp_path: Path,
) -> None:
    """A hybrid target's attention layers store quantized keys and values
    (its recurrent states stay float); its MTP head drafts, and the output
    is plain decoding's with the same cache."""
    from models.hybrid_cache import HybridCache

    folder = write_hybrid(tmp_path / "hybrid", head_dim=32)
    options = {"kv_bits": 8, "kv_group_size": 32, "adaptive": False}
    plain = load(str(folder), **options).unwrap()
    mtp = load(str(folder), draft="mtp", **options).unwrap()
    cache = plain.target.model.make_cache(1)
    assert isinstance(cache, HybridCache) and isinstance(cache.kv, QuantizedKVCache)
    limits = GenerationLimits(max_tokens=10)
    for sampling in SAMPLINGS:
        want = plain.generate_batch(list(PROMPTS), sampling, limits).unwrap()
        got = mtp.generate_batch(list(PROMPTS), sampling, limits).unwrap()
        assert [r.tokens for r in got] == [r.tokens for r in want]
        assert sum(r.stats.drafted for r in got) > 0


def test_a_prompt_cache_file_keeps_quantized_states(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--prompt-cache-file` with `--kv-bits`: the second run restores the
    quantized cache and gives the first run's output; a file written without
    `--kv-bits` is refused by a run with it (another cache layout)."""
    folder = _tiny(tmp_path / "t")
    path = tmp_path / "cache.safetensors"
    args = ["generate", "def fib(n):", "--model", str(folder), "--max-tokens", "6",
            "--json", "--kv-bits", "4", "--kv-group-size", "32",
            "--prompt-cache-file", str(path)]  # fmt: skip
    main(args)
    first = json.loads(capsys.readouterr().out)
    main(args)
    second = json.loads(capsys.readouterr().out)
    assert second["tokens"] == first["tokens"]
    assert second["stats"]["cached_tokens"] > 0
    other = tmp_path / "float.safetensors"
    main([*args[:6], "--json", "--prompt-cache-file", str(other)])
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main([*args[:-1], str(other)])
    assert "made for another model" in capsys.readouterr().err


def test_bad_kv_options_are_named(tmp_path: Path) -> None:
    folder = write_tiny_model(tmp_path / "t")  # heads 16 wide
    narrow = load(str(folder), kv_bits=8, kv_group_size=32)
    assert "cannot be quantized in groups of 32" in str(narrow.failure())
    bits = load(str(folder), kv_bits=7)
    assert "kv-bits must be one of 2, 3, 4, 5, 6, 8" in str(bits.failure())
