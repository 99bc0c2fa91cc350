"""The prompt cache (specpipe/prompt_cache.py): rows' states kept after a run
and restored for later prompts.

- A conversation's next turn (its prompt: the last prompt, the output, new
  tokens) and a repeated prompt start from checkpoints, with every drafter
  kind, on attention-only targets (dense, GLM-4.5 MoE with its MTP head)
  and a hybrid (recurrent) one, greedy and
  seeded sampling, one row and a batch of rows with hits and misses: the
  output is the one of a run without the cache, and the tokens restored are
  the ones the earlier run processed; the drafters offer the drafts they
  offer without the cache (the restored draft state is the computed one).
- Rows that end on an end-of-sequence token keep it as their pending token.
- Cancelled rows are never kept; a drafter of another namespace gets no
  draft state (one that reads the target's hidden states gets no hit).
- The store: a byte budget evicts the least recently used; an insert or use
  disposed changes nothing; another model's cache is refused.
- Files: a saved cache read into a new one serves the next turn as the
  original does; another model's file, a damaged one and an unwritable path
  are clear errors. Loading and merging keep what inserting would keep and
  read from the file only that (a file larger than the budget is not read
  whole).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from spec_support import PROMPTS, CollectSink, tiny_model
from test_dflash import dflash2_config, dflash_config, random_draft
from test_glm_mtp import glm_args
from test_glm_mtp import random_head as glm_head
from test_mtp import args as hybrid_args
from test_mtp import random_head, scaled

from models.base import CausalLM
from models.build import build_model
from models.glm4_moe import Model as GlmModel
from schemas.request import SamplingParams
from specpipe.draft import Drafter
from specpipe.drafts.dflash import DFlashDrafter, DFlashRows
from specpipe.drafts.mtp import MtpDrafter, MtpRows
from specpipe.drafts.ngram import NgramDrafter, NgramRows
from specpipe.drafts.two_model import TwoModelDrafter, TwoModelRows
from specpipe.loop import RoundOptions, RowRequest, RowResult, generate_rows
from specpipe.prompt_cache import Checkpoint, PromptCache
from specpipe.prompt_cache_file import load_prompt_cache, save_prompt_cache

SAMPLINGS = {
    "greedy": SamplingParams(),
    "sampled": SamplingParams(temperature=0.8, top_p=0.95, seed=11),
}
NEW_TURN = (3, 1, 4, 1, 5)  # the tokens a next turn adds after the output


def generate(
    model: CausalLM,
    prompts: Sequence[Sequence[int]],
    sampling: SamplingParams,
    drafter: Drafter | None,
    depth: int,
    store: PromptCache | None,
    eos: Sequence[int] = (),
    max_tokens: int = 12,
    cancelled: Callable[[], bool] | None = None,
) -> tuple[list[list[int]], list[RowResult]]:
    sinks = [CollectSink() for _ in prompts]
    requests = [
        RowRequest(tuple(p), sampling, max_tokens, sink, cancelled=cancelled)
        for p, sink in zip(prompts, sinks, strict=True)
    ]
    results = generate_rows(
        model,
        requests,
        eos,
        drafter,
        RoundOptions(depth=depth if drafter is not None else 0),
        prompt_cache=store,
    )
    assert all(not r.metrics.draft_errors for r in results), results
    return [s.tokens for s in sinks], results


@pytest.fixture(scope="module")
def dense() -> CausalLM:
    """An attention-only target tapping the DFlash drafts' layers."""
    model = tiny_model(1)
    model.tap((0, 1))  # type: ignore[attr-defined]
    return model


@pytest.fixture(scope="module")
def hybrid() -> CausalLM:
    """A hybrid (Qwen3-Next) target: linear-attention layers' recurrent states."""
    mx.random.seed(0)
    model: CausalLM = build_model(hybrid_args()).unwrap()
    scaled(model, 0, 2.5)
    return model


@pytest.fixture(scope="module")
def glm() -> CausalLM:
    """An attention-only GLM-4.5 MoE target, whose MTP head drafts for it."""
    mx.random.seed(1)
    model: CausalLM = build_model(glm_args()).unwrap()
    scaled(model, 1)
    return model


def drafter_of(kind: str, model: CausalLM) -> tuple[Drafter | None, int]:
    """A drafter of `kind` for `model` and the depth it drafts."""
    if kind == "none":
        return None, 0
    if kind == "ngram":
        return NgramDrafter(), 3
    if kind == "two-model":
        return TwoModelDrafter(tiny_model(2, vocab_size=model.args.vocab_size)), 3
    if kind == "mtp":
        head = glm_head(3) if isinstance(model, GlmModel) else random_head(3)
        return MtpDrafter(model, head), 2
    config = dflash_config() if kind == "dflash" else dflash2_config()
    return DFlashDrafter(model, random_draft(config, seed=7)), 3


CASES = [
    ("dense", "none"),
    ("dense", "ngram"),
    ("dense", "two-model"),
    ("dense", "dflash"),
    ("dense", "dflash2"),
    ("hybrid", "none"),
    ("hybrid", "ngram"),
    ("hybrid", "mtp"),
    ("glm", "ngram"),
    ("glm", "mtp"),
]


@pytest.fixture
def proposals(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every proposal the drafters make (read back), in order."""
    seen: list[Any] = []
    for rows in (NgramRows, TwoModelRows, MtpRows, DFlashRows):

        def spy(self: Any, rows: Any, depth: int, propose: Any = rows.propose) -> Any:
            proposal = propose(self, rows, depth)
            device = proposal.device
            seen.append(proposal.host if device is None else device.tolist())
            return proposal

        monkeypatch.setattr(rows, "propose", spy)
    return seen


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
@pytest.mark.parametrize(("target", "kind"), CASES, ids=["-".join(c) for c in CASES])
def test_a_next_turn_and_a_repeated_prompt_start_from_checkpoints(
    request: pytest.FixtureRequest,
    proposals: list[Any],
    target: str,
    kind: str,
    sampling: str,
) -> None:
    model: CausalLM = request.getfixturevalue(target)
    drafter, depth = drafter_of(kind, model)
    params = SAMPLINGS[sampling]
    store = PromptCache(model)
    first = [list(p) for p in PROMPTS[:3]]

    def both(prompts: list[list[int]]) -> tuple[list[list[int]], list[RowResult]]:
        """The run with the store, checked against one without it."""
        proposals.clear()
        tokens, results = generate(model, prompts, params, drafter, depth, store)
        offered = list(proposals)
        proposals.clear()
        fresh, _ = generate(model, prompts, params, drafter, depth, None)
        assert tokens == fresh
        # a resumed draft state is the one a prefill computes: the same drafts
        assert offered == proposals
        assert drafter is None or offered
        assert all(r.finish == "length" for r in results)
        return tokens, results

    out, results = both(first)
    assert [r.cached_tokens for r in results] == [0, 0, 0]
    # the next turn of rows 0 and 2, a new prompt, and row 1's prompt again
    turns = [
        first[0] + out[0] + list(NEW_TURN),
        first[2] + out[2] + list(NEW_TURN),
        [7, 7, 8, 9],
        first[1],
    ]
    _, results = both(turns)
    cached = [r.cached_tokens for r in results]
    # a row that ends keeps all but its last token, or all of them where a
    # plain step was already queued past its end (it processed that token)
    for row, n in ((0, cached[0]), (2, cached[1])):
        assert (
            len(first[row]) + len(out[row]) - 1 <= n <= len(first[row]) + len(out[row])
        )
    assert cached[2] == 0
    assert cached[3] == len(first[1]) - 1  # the prompt's state from its prefill
    assert store.stats.hits == 3 and store.stats.lookups == 7


@pytest.mark.parametrize(("target", "kind"), [("dense", "dflash"), ("hybrid", "mtp")])
def test_a_row_that_ends_on_eos_keeps_it_pending(
    request: pytest.FixtureRequest, target: str, kind: str
) -> None:
    """The next turn's prompt holds the end-of-sequence token after the output."""
    model: CausalLM = request.getfixturevalue(target)
    drafter, depth = drafter_of(kind, model)
    params = SAMPLINGS["greedy"]
    prompt = list(PROMPTS[0])
    long, _ = generate(model, [prompt], params, None, 0, None)
    eos = long[0][5]
    stop = long[0].index(eos)  # where the row ends
    store = PromptCache(model, capture_prompts=False)
    out, results = generate(model, [prompt], params, drafter, depth, store, (eos,))
    assert results[0].finish == "stop" and out[0] == long[0][:stop]
    ((tokens, _),) = store._entries  # the row's end
    assert tokens == tuple(prompt + out[0])  # its EOS pending, not processed
    turn = prompt + out[0] + [eos, *NEW_TURN]
    again, results = generate(model, [turn], params, drafter, depth, store, (eos,))
    fresh, _ = generate(model, [turn], params, drafter, depth, None, (eos,))
    assert again == fresh and results[0].cached_tokens == len(tokens)


def test_a_cancelled_row_is_not_kept(dense: CausalLM) -> None:
    store = PromptCache(dense, capture_prompts=False)
    drafter, depth = drafter_of("ngram", dense)
    generate(
        dense,
        [PROMPTS[0]],
        SAMPLINGS["greedy"],
        drafter,
        depth,
        store,
        cancelled=lambda: True,
    )
    assert len(store) == 0
    generate(dense, [PROMPTS[0]], SAMPLINGS["greedy"], drafter, depth, store)
    assert len(store) == 1


def test_draft_states_are_offered_to_their_own_namespace(hybrid: CausalLM) -> None:
    """Checkpoints made without the MTP head's state give it no hit (it reads
    the whole prompt's hidden states); plain decoding uses them."""
    params = SAMPLINGS["greedy"]
    store = PromptCache(hybrid)
    prompt = list(PROMPTS[0])
    generate(hybrid, [prompt], params, NgramDrafter(), 3, store)
    mtp, depth = drafter_of("mtp", hybrid)
    _, results = generate(hybrid, [prompt], params, mtp, depth, store)
    assert results[0].cached_tokens == 0  # and now its own are kept too
    _, results = generate(hybrid, [prompt], params, None, 0, store)
    assert results[0].cached_tokens == len(prompt) - 1
    _, results = generate(hybrid, [prompt], params, mtp, depth, store)
    assert results[0].cached_tokens == len(prompt) - 1


def test_the_byte_budget_evicts_the_least_recently_used(dense: CausalLM) -> None:
    params = SAMPLINGS["greedy"]
    probe = PromptCache(dense, capture_prompts=True)
    generate(dense, [PROMPTS[0]], params, None, 0, probe, max_tokens=2)
    size = max(c.nbytes for c in probe._entries.values())
    store = PromptCache(dense, max_bytes=2 * size, capture_prompts=False)
    prompts = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    outs = [
        generate(dense, [p], params, None, 0, store, max_tokens=2)[0][0]
        for p in prompts[:2]
    ]
    assert len(store) == 2
    # a hit marks the first used last: the third evicts the second
    turn = prompts[0] + outs[0] + [10]
    _, results = generate(dense, [turn], params, None, 0, store, max_tokens=2)
    assert results[0].cached_tokens >= 4
    starts = [tokens[:3] for tokens, _ in store._entries]
    assert starts == [(1, 2, 3), (1, 2, 3)]  # the hit one and the turn's end
    assert store.stats.evicted == 1 and store.nbytes <= 2 * size


def test_prepared_changes_disposed_change_nothing(dense: CausalLM) -> None:
    store = PromptCache(dense)
    cache = dense.make_cache(1)
    checkpoint = Checkpoint((1, 2), cache)
    store.prepare_insert(checkpoint).dispose()
    assert len(store) == 0 and store.stats.inserted == 0
    store.prepare_insert(checkpoint).commit()
    match = store.lookup((1, 2, 3), None, False)
    assert match is not None and match.length == 2
    store.prepare_use([match]).dispose()
    assert store.stats.hits == 0
    # a hit leaves the prompt's last token unprocessed: (1, 2) is served by
    # the attention-only state of its first token
    short = store.lookup((1, 2), None, False)
    assert short is not None and short.length == 1


def test_a_cache_serves_only_its_model(dense: CausalLM, hybrid: CausalLM) -> None:
    store = PromptCache(dense)
    with pytest.raises(ValueError, match="another model's states"):
        generate(hybrid, [PROMPTS[0]], SAMPLINGS["greedy"], None, 0, store)
    with pytest.raises(ValueError, match="positive byte budget"):
        PromptCache(dense, max_bytes=0)


def test_checkpoints_are_copies(dense: CausalLM) -> None:
    """Runs that start from a checkpoint leave its arrays as they were."""
    store = PromptCache(dense)
    params = SAMPLINGS["greedy"]
    generate(dense, [PROMPTS[0]], params, None, 0, store)
    before: dict[Any, list[Any]] = {
        key: [mx.array(a) for a in c.target.arrays()]
        for key, c in store._entries.items()
    }
    generate(dense, [PROMPTS[0]], params, None, 0, store)
    for key, arrays in before.items():
        after = store._entries[key].target.arrays()
        assert all(
            mx.array_equal(a, b).item() for a, b in zip(arrays, after, strict=True)
        )


@pytest.mark.parametrize(("target", "kind"), CASES, ids=["-".join(c) for c in CASES])
def test_a_checkpoint_cut_back_serves_a_shared_prefix(
    request: pytest.FixtureRequest, proposals: list[Any], target: str, kind: str
) -> None:
    """A prompt that leaves a row's output part of the way: an attention-only
    target starts from the checkpoint cut to the shared tokens (with the
    draft's state cut too); a hybrid one cannot cut its recurrent state."""
    model: CausalLM = request.getfixturevalue(target)
    drafter, depth = drafter_of(kind, model)
    params = SAMPLINGS["greedy"]
    store = PromptCache(model, capture_prompts=False)
    first = list(PROMPTS[0])
    (out,), _ = generate(model, [first], params, drafter, depth, store)
    ((kept, _),) = store._entries
    prompt = first + out[:4] + [(out[4] + 1) % 90, *NEW_TURN]
    shared = len(first) + 4
    assert kept[:shared] == tuple(prompt[:shared]) and kept[shared] != prompt[shared]
    proposals.clear()
    tokens, results = generate(model, [prompt], params, drafter, depth, store)
    offered = list(proposals)
    proposals.clear()
    fresh, _ = generate(model, [prompt], params, drafter, depth, None)
    assert tokens == fresh and offered == proposals
    # the MTP head's state cannot be cut (it reads the target's hidden states)
    cuts = target != "hybrid" and kind != "mtp"
    assert results[0].cached_tokens == (shared if cuts else 0)


def test_an_arrival_starts_from_a_row_that_ended_in_the_same_run(
    hybrid: CausalLM,
) -> None:
    """Continuous batching: a request admitted between rounds starts from
    the checkpoint a row of the same run left when it ended."""
    params = SAMPLINGS["sampled"]
    drafter, depth = drafter_of("mtp", hybrid)
    first = list(PROMPTS[0])
    (out,), _ = generate(hybrid, [first], params, drafter, depth, None, max_tokens=4)
    turn = first + out + list(NEW_TURN)
    (expected,), _ = generate(hybrid, [turn], params, drafter, depth, None)
    store = PromptCache(hybrid)
    sinks = [CollectSink() for _ in range(3)]
    requests = [
        RowRequest(tuple(first), params, 4, sinks[0]),
        RowRequest(tuple(PROMPTS[1]), params, 24, sinks[1]),
    ]
    waiting = [RowRequest(tuple(turn), params, 12, sinks[2])]

    def arrivals() -> list[RowRequest]:
        # the turn arrives once the first row has ended
        if waiting and len(sinks[0].tokens) == 4:
            return [waiting.pop()]
        return []

    results = generate_rows(
        hybrid,
        requests,
        (),
        drafter,
        RoundOptions(depth=depth),
        arrivals,
        prompt_cache=store,
    )
    assert sinks[0].tokens == out and sinks[2].tokens == expected
    assert results[1].finish == "length" and not waiting  # it joined a live batch
    assert results[2].cached_tokens == len(first) + len(out) - 1


FILE_CASES = [
    ("dense", "two-model"),
    ("dense", "dflash2"),
    ("hybrid", "mtp"),
    ("glm", "mtp"),
]


@pytest.mark.parametrize(
    ("target", "kind"), FILE_CASES, ids=["-".join(c) for c in FILE_CASES]
)
def test_a_saved_cache_serves_another_process_as_it_served_this_one(
    request: pytest.FixtureRequest,
    proposals: list[Any],
    tmp_path: Path,
    target: str,
    kind: str,
) -> None:
    """Checkpoints written to a file and read into a new cache give the next
    turn the same start, drafts and output as the cache they came from."""
    model: CausalLM = request.getfixturevalue(target)
    drafter, depth = drafter_of(kind, model)
    params = SAMPLINGS["sampled"]
    store = PromptCache(model)
    first = [list(p) for p in PROMPTS[:2]]
    out, _ = generate(model, first, params, drafter, depth, store)
    path = save_prompt_cache(store, tmp_path / "cache.safetensors").unwrap()
    assert not list(tmp_path.glob("*partial*"))
    reread = load_prompt_cache(path, PromptCache(model)).unwrap()
    assert [c.tokens for c in reread.checkpoints()] == [
        c.tokens for c in store.checkpoints()
    ]
    turns = [p + o + list(NEW_TURN) for p, o in zip(first, out, strict=True)]
    runs = []
    for cache in (store, reread):
        proposals.clear()
        tokens, results = generate(model, turns, params, drafter, depth, cache)
        runs.append((tokens, [r.cached_tokens for r in results], list(proposals)))
    assert runs[0] == runs[1]
    assert all(n > len(p) for n, p in zip(runs[1][1], first, strict=True))


def test_a_cache_file_of_another_model_or_damaged_is_refused(
    dense: CausalLM, hybrid: CausalLM, tmp_path: Path
) -> None:
    store = PromptCache(dense)
    generate(dense, [PROMPTS[0]], SAMPLINGS["greedy"], None, 0, store)
    path = save_prompt_cache(store, tmp_path / "dense.safetensors").unwrap()
    other = load_prompt_cache(path, PromptCache(hybrid)).failure()
    assert "made for another model" in other.message
    assert len(PromptCache(hybrid)) == 0
    plain = tmp_path / "weights.safetensors"
    mx.save_safetensors(str(plain), {"w": mx.zeros((2,))})
    assert "not a specpipe prompt-cache file" in (
        load_prompt_cache(plain, PromptCache(dense)).failure().message
    )
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(path.read_bytes()[:100])
    assert "not a readable prompt-cache file" in (
        load_prompt_cache(broken, PromptCache(dense)).failure().message
    )
    blocked = tmp_path / "file"
    blocked.write_text("")
    failed = save_prompt_cache(store, blocked / "cache.safetensors").failure()
    assert "cannot write the prompt cache" in failed.message


@pytest.mark.parametrize("merge", [True, False], ids=["merge", "replace"])
def test_saves_to_one_path_merge_under_its_lock_or_leave_one_whole_file(
    dense: CausalLM, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, merge: bool
) -> None:
    """Saves racing to one path (two processes, or threads) each stage under
    a name of their own, never in one another's staging file. Merging, they
    take the path's lock in turn and the file ends holding both caches'
    checkpoints; replacing, it ends holding one of them whole."""
    import os
    import threading

    import specpipe.prompt_cache_file as cache_file

    stores = []
    for prompt in (PROMPTS[0], PROMPTS[1]):
        store = PromptCache(dense)
        generate(dense, [list(prompt)], SAMPLINGS["greedy"], None, 0, store)
        stores.append(store)
    staged: list[str] = []
    moved = os.replace

    def replace(src: Any, dst: Any) -> None:
        staged.append(str(src))
        moved(src, dst)

    monkeypatch.setattr(cache_file.os, "replace", replace)
    path = tmp_path / "shared.safetensors"
    threads = [
        threading.Thread(
            target=save_prompt_cache, args=(store, path), kwargs={"merge": merge}
        )
        for store in stores
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(staged) == 2 and len(set(staged)) == 2
    assert not list(tmp_path.glob("*partial*"))
    reread = load_prompt_cache(path, PromptCache(dense)).unwrap()
    saved = [[c.tokens for c in s.checkpoints()] for s in stores]
    held = [c.tokens for c in reread.checkpoints()]
    if merge:  # the later save's after the earlier's
        assert held in (saved[0] + saved[1], saved[1] + saved[0])
    else:
        assert held in saved


def test_a_merging_save_keeps_the_newest_within_the_budget_and_refuses_a_foreign_file(
    dense: CausalLM, hybrid: CausalLM, tmp_path: Path
) -> None:
    """The file's checkpoints count as used before the saving cache's: a
    cache of one entry leaves the file holding its own only, and a
    checkpoint of the same tokens replaces the file's. A file of another
    model at the path is refused and left as it was."""
    first, second = PromptCache(dense), PromptCache(dense, max_entries=1)
    generate(dense, [list(PROMPTS[0])], SAMPLINGS["greedy"], None, 0, first)
    generate(dense, [list(PROMPTS[1])], SAMPLINGS["greedy"], None, 0, second)
    path = tmp_path / "cache.safetensors"
    save_prompt_cache(first, path).unwrap()
    ours = [c.tokens for c in first.checkpoints()]
    assert len(ours) >= 1 and len(second) == 1
    save_prompt_cache(second, path).unwrap()
    assert [
        c.tokens
        for c in load_prompt_cache(path, PromptCache(dense)).unwrap().checkpoints()
    ] == [c.tokens for c in second.checkpoints()]
    save_prompt_cache(first, path).unwrap()  # a budget of 64: both, ours last
    again = load_prompt_cache(path, PromptCache(dense)).unwrap()
    assert [c.tokens for c in again.checkpoints()] == [
        c.tokens for c in second.checkpoints()
    ] + ours
    save_prompt_cache(first, path).unwrap()  # the same tokens replace the file's
    assert len(load_prompt_cache(path, PromptCache(dense)).unwrap()) == len(again)
    foreign = PromptCache(hybrid)
    generate(hybrid, [list(PROMPTS[0])], SAMPLINGS["greedy"], None, 0, foreign)
    before = path.read_bytes()
    refused = save_prompt_cache(foreign, path).failure()
    assert "made for another model" in refused.message
    assert path.read_bytes() == before and not list(tmp_path.glob("*partial*"))
    assert save_prompt_cache(foreign, path, merge=False).unwrap() == path


@attrs.frozen
class _Sized:
    """A target state of `size` float32 values (what a checkpoint's size and
    evaluation need)."""

    size: int

    def arrays(self) -> tuple[mx.array, ...]:
        return (mx.zeros(self.size),)


@settings(max_examples=60, deadline=None)
@given(
    held=st.lists(st.tuples(st.integers(0, 5), st.integers(1, 12)), max_size=6),
    incoming=st.lists(st.tuples(st.integers(0, 5), st.integers(1, 12)), max_size=8),
    max_values=st.integers(4, 30),
    max_entries=st.integers(1, 5),
)
def test_surviving_is_what_inserting_keeps(
    dense: CausalLM,
    held: list[tuple[int, int]],
    incoming: list[tuple[int, int]],
    max_values: int,
    max_entries: int,
) -> None:
    """The checkpoints `surviving` picks from their sizes alone are the ones
    inserting them all keeps (repeated tokens replacing, larger-than-budget
    ones left out, the least recently used evicted). Inserting only those
    keeps at least what inserting all does (more of the cache's own where a
    checkpoint later replaced would have evicted them) for what the loaders
    give it: checkpoints of distinct tokens (a file's), or any into an empty
    cache (a merge). Not otherwise: an arrival replaced by a later one of
    the same tokens can, inserted, have made room for the cache's own by
    replacing one of them first."""

    def made(pairs: list[tuple[int, int]]) -> list[Checkpoint]:
        return [Checkpoint((key,), _Sized(size)) for key, size in pairs]

    budget = 4 * max_values  # bytes: float32 values
    before = made(held)

    def store() -> PromptCache:
        cache = PromptCache(dense, max_bytes=budget, max_entries=max_entries)
        for checkpoint in before:
            cache.prepare_insert(checkpoint).commit()
        return cache

    arriving = made(incoming)
    inserted = store()
    for checkpoint in arriving:
        inserted.prepare_insert(checkpoint).commit()
    picked = store()
    chosen = picked.surviving(arriving)
    for checkpoint in chosen:
        picked.prepare_insert(checkpoint).commit()
    kept = [id(c) for c in inserted.checkpoints()]
    assert [id(c) for c in chosen] == [id(c) for c in arriving if id(c) in kept]
    if not held or len({key for key, _ in incoming}) == len(incoming):
        assert set(kept) <= {id(c) for c in picked.checkpoints()}


def test_loading_or_merging_reads_only_the_checkpoints_kept(
    dense: CausalLM, tmp_path: Path
) -> None:
    """A file of many checkpoints loaded into (or merged with) a cache that
    keeps one reads that one: the peak memory of the load and of the merging
    save stays far below the file's arrays (it was the whole file before)."""
    many = PromptCache(dense)
    prompts = [[(7 * i + j) % 50 + 1 for j in range(40)] for i in range(24)]
    generate(dense, prompts, SAMPLINGS["greedy"], None, 0, many)
    path = save_prompt_cache(many, tmp_path / "cache.safetensors").unwrap()
    whole = many.nbytes
    assert len(many) == 2 * len(prompts) and whole > 4_000_000
    newest = many.checkpoints()[-1].tokens
    del many
    one = PromptCache(dense, max_entries=1)
    generate(dense, [[3, 1, 4, 1, 5, 9, 2, 6]], SAMPLINGS["greedy"], None, 0, one)
    mx.clear_cache()

    def peak(action: Callable[[], object]) -> int:
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        action()
        return mx.get_peak_memory() - base

    loaded = PromptCache(dense, max_entries=1)
    assert peak(lambda: load_prompt_cache(path, loaded).unwrap()) < whole / 20
    assert [c.tokens for c in loaded.checkpoints()] == [newest]
    assert peak(lambda: save_prompt_cache(one, path).unwrap()) < whole / 20
    merged = load_prompt_cache(path, PromptCache(dense)).unwrap()
    assert [c.tokens for c in merged.checkpoints()] == [
        c.tokens for c in one.checkpoints()
    ]
