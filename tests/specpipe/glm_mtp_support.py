"""Shared pieces of the GLM MTP heads' tests (test_glm_mtp.py for GLM-4.5,
test_glm_dsa_mtp.py for GLM-5): a module made under a seed with its matrices
scaled, what a head's layer reads by the head's formula, the carried and
normed outputs of a step, lossless drafting on a tiny target, and a GLM HF
folder whose checkpoint holds the MTP layer at `model.layers.{N}`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import mlx.core as mx
from spec_support import PROMPTS, run
from test_mtp import scaled

from models.base import attention_mask
from models.build import build_model
from models.cache import KVCache
from models.layers import flat_parameters
from schemas.request import SamplingParams
from specpipe.drafts.mtp import MtpDrafter
from tests.cli.conftest import write_tiny_model

T = TypeVar("T")


def seeded(make: Callable[[], T], seed: int) -> T:
    """`make()` after `mx.random.seed(seed)`, then every matrix scaled
    (test_mtp's `scaled`, which seeds again): varied greedy output, peaked
    sampling."""
    mx.random.seed(seed)
    module = make()
    scaled(module, seed)
    return module


# --- the head's formula ------------------------------------------------------------


def layer_input(
    head: Any, embeds: mx.array, hidden: mx.array, offsets: Sequence[int]
) -> tuple[mx.array, KVCache, mx.array]:
    """What a GLM MTP head's layer reads, by the head's formula: fc over the
    normed embeddings (a row's pair at position 0 blanked) and normed hidden
    states; with a fresh cache of the head's and the window's mask."""
    batch, length = embeds.shape[:2]
    first = mx.array([offset == 0 for offset in offsets])[:, None, None]
    blanked = mx.where(first & (mx.arange(length) == 0)[None, :, None], 0, embeds)
    x = head.fc(
        mx.concatenate(
            [head.pre_fc_norm_embedding(blanked), head.pre_fc_norm_hidden(hidden)],
            axis=-1,
        )
    )
    cache = head.make_cache(batch)
    cache.reserve(max(offsets) + length)
    return x, cache, attention_mask(offsets, length, cache.key_span(offsets, length))


def check_carried_and_normed(head: Any, out: mx.array) -> None:
    """A chained step reads the layer's output itself; the draw reads its norm."""
    normed = head.normed(out)
    assert head.carried(out, normed) is out
    assert mx.allclose(normed, head.norm(out)).item()


# --- lossless --------------------------------------------------------------------


def check_mtp_output_equals_plain(
    target: Any,
    make_head: Callable[[], Any],
    params: SamplingParams,
    depth: int,
    batch: int,
) -> None:
    """The first `batch` of spec_support's prompts 0, 1 and 3 decoded with
    `make_head()` drafting `depth` tokens a round: plain decoding's 14
    tokens, the head drafting every round without errors."""
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[3]][:batch]
    plain, _ = run(target, prompts, params, max_tokens=14)
    drafter = MtpDrafter(target, make_head())
    spec, results = run(target, prompts, params, drafter, depth, max_tokens=14)
    assert spec == plain
    assert all(not r.metrics.draft_errors and r.metrics.drafted > 0 for r in results)


# --- a checkpoint in the HF layout -------------------------------------------------


def checkpoint_names(target: Any, head: Any) -> dict[str, mx.array]:
    """The target's and the head's weights as a GLM checkpoint names them:
    experts one by one, the MTP layer at `model.layers.{N}` with its
    `shared_head.head` (a copy of the target's head)."""
    n = target.glm.num_hidden_layers
    renamed = {
        "fc.": "eh_proj.",
        "pre_fc_norm_embedding.": "enorm.",
        "pre_fc_norm_hidden.": "hnorm.",
        "norm.": "shared_head.norm.",
        "layers.0.": "",
    }
    head_own = {}
    for key, value in flat_parameters(head).items():
        prefix = next(p for p in renamed if key.startswith(p))
        head_own[renamed[prefix] + key[len(prefix) :]] = value
    head_own["shared_head.head.weight"] = target.head_weights().weight
    out: dict[str, mx.array] = {}
    for weights, prefix in (
        (flat_parameters(target), ""),
        (head_own, f"model.layers.{n}."),
    ):
        for key, value in weights.items():
            key = prefix + key
            if ".switch_mlp." in key:
                stem, name = key.split(".switch_mlp.")
                for e in range(value.shape[0]):
                    out[f"{stem}.experts.{e}.{name}"] = value[e]
            else:
                out[key] = value
    return out


def write_glm_folder(
    folder: Path,
    config: dict[str, Any],
    architecture: str,
    args_of: Callable[..., Any],
    kind: type,
    head_kind: Callable[[Any], Any],
) -> Path:
    """A tiny GLM HF folder (320-token tokenizer) of `config`: a random
    `kind` target of `args_of(vocab_size=320)` and a random `head_kind`
    MTP layer, in the checkpoint's names."""
    write_tiny_model(folder)  # tokenizer files; config and weights replaced
    config = {**config, "vocab_size": 320, "architectures": [architecture]}
    (folder / "config.json").write_text(json.dumps(config))
    mx.random.seed(6)
    model = build_model(args_of(vocab_size=320)).unwrap()
    assert isinstance(model, kind)
    scaled(model, 6)
    head = head_kind(args_of(vocab_size=320))  # drawn on from seed 6, not its own
    scaled(head, 7)
    mx.save_safetensors(
        str(folder / "model.safetensors"), checkpoint_names(model, head)
    )
    return folder
