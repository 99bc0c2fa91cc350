"""A multi-turn conversation with and without the prompt cache, and mlx-lm
with its own prompt cache, in one process run: each turn's time to its first
token and the prompt tokens each side had to prefill.

Every turn's prompt is the whole conversation by the model's chat template
(the assistant turns: the replies as text). specpipe runs each turn twice,
from a pipeline without the cache and one with it (same loaded weights), and
the replies must be the same tokens (a difference fails the run). mlx-lm keeps
one `make_prompt_cache` for the conversation, as its server does: each turn
cuts the cache back to the tokens it shares with the new prompt
(`trim_prompt_cache`) and prefills the rest. Time to first token is from the
call to the first generated token reaching the caller (specpipe: its text
callback; mlx-lm: `generate_step`'s first yield); greedy.

    python bench/prompt_cache.py --target qwen2.5-coder-1.5b-instruct --draft ngram
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx
from common import RESULTS, machine_info, mlxlm_load, model_folder, table, write_json

TURNS = (
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Now add type hints and a docstring to it.",
    "Write three pytest tests for it.",
    "Rewrite the function to merge any number of sorted lists with heapq.",
)


def shared(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def specpipe_turn(
    pipeline: Any, messages: list[dict[str, str]], tokens: int
) -> dict[str, Any]:
    from schemas.request import GenerationLimits, SamplingParams

    first: list[float] = []

    def on_text(_text: str) -> None:
        if not first:
            first.append(time.perf_counter())

    mx.synchronize()
    t0 = time.perf_counter()
    result = pipeline.generate(
        messages, SamplingParams(), GenerationLimits(max_tokens=tokens), on_text=on_text
    ).unwrap()
    wall = time.perf_counter() - t0
    return {
        "tokens": list(result.tokens),
        "text": result.text,
        "prompt_tokens": result.prompt_tokens,
        "cached_tokens": result.stats.cached_tokens,
        "prefilled": result.prompt_tokens - 1 - result.stats.cached_tokens,
        "prompt_s": result.stats.prompt_seconds,
        "first_token_s": (first[0] - t0) if first else wall,
        "wall_s": wall,
        "decode_tps": result.stats.tokens_per_second,
    }


class MlxLmConversation:
    """mlx-lm with one prompt cache for the conversation, cut back per turn."""

    def __init__(self, model: Any) -> None:
        from mlx_lm.models.cache import make_prompt_cache

        self.model = model
        self.cache = make_prompt_cache(model)
        self.held: list[int] = []  # the tokens the cache holds

    def turn(self, ids: list[int], tokens: int, eos: frozenset[int]) -> dict[str, Any]:
        from mlx_lm.generate import generate_step
        from mlx_lm.models.cache import (
            can_trim_prompt_cache,
            make_prompt_cache,
            trim_prompt_cache,
        )

        keep = shared(self.held, ids[:-1])
        if keep < len(self.held):
            if not can_trim_prompt_cache(self.cache):
                self.cache = make_prompt_cache(self.model)
                keep = 0
            else:
                trim_prompt_cache(self.cache, len(self.held) - keep)
        rest = ids[keep:]
        out: list[int] = []
        mx.synchronize()
        t0 = time.perf_counter()
        first = None
        gen = generate_step(
            mx.array(rest, dtype=mx.uint32),
            self.model,
            max_tokens=tokens,
            sampler=lambda lp: mx.argmax(lp, axis=-1),
            prompt_cache=self.cache,
        )
        for token, _ in gen:
            if first is None:
                first = time.perf_counter() - t0
            if int(token) in eos:
                out.append(int(token))
                break
            out.append(int(token))
        gen.close()
        wall = time.perf_counter() - t0
        # the cache processed every yielded token but the last
        self.held = ids[:keep] + rest + out[:-1]
        return {
            "tokens": [t for t in out if t not in eos],
            "prefilled": len(rest) - 1,
            "first_token_s": first,
            "wall_s": wall,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--draft", default="ngram")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--no-mlxlm", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from attrs import evolve

    import specpipe

    cached = specpipe.load(
        args.target, draft=args.draft, dtype=args.dtype, prompt_cache=True
    ).unwrap()
    plain = evolve(cached, prompt_cache=None)
    tokenizer = cached.target.tokenizer
    eos = frozenset(tokenizer.eos_token_ids)
    peer = None
    if not args.no_mlxlm:
        folder = model_folder(args.target, args.dtype)
        peer = MlxLmConversation(mlxlm_load(folder, share_from=cached.target.model))
    # warm both paths (kernels, calibration) on a throwaway conversation
    warm = [{"role": "user", "content": "Say hi."}]
    specpipe_turn(plain, warm, 4)
    specpipe_turn(evolve(cached, prompt_cache=None).with_prompt_cache(1 << 30), warm, 4)

    messages: list[dict[str, str]] = []
    rows: list[dict[str, Any]] = []
    for number, question in enumerate(TURNS, 1):
        messages.append({"role": "user", "content": question})
        without = specpipe_turn(plain, messages, args.tokens)
        with_cache = specpipe_turn(cached, messages, args.tokens)
        if with_cache["tokens"] != without["tokens"]:
            raise SystemExit(f"turn {number}: the cached run's reply differs")
        row: dict[str, Any] = {
            "turn": number,
            "prompt_tokens": with_cache["prompt_tokens"],
            "specpipe": without,
            "specpipe_cached": with_cache,
        }
        if peer is not None:
            ids = list(
                tokenizer.encode(
                    tokenizer.apply_chat_template(messages), add_special_tokens=False
                )
            )
            row["mlx_lm_cached"] = peer.turn(ids, args.tokens, eos)
            row["mlx_lm_same_tokens"] = (
                row["mlx_lm_cached"]["tokens"] == with_cache["tokens"]
            )
        rows.append(row)
        messages.append({"role": "assistant", "content": with_cache["text"]})

    headers = [
        "turn",
        "prompt",
        "prefilled (cache)",
        "TTFT no cache ms",
        "TTFT cache ms",
        "ratio",
    ]
    if peer is not None:
        headers += [
            "mlx-lm prefilled",
            "mlx-lm TTFT ms",
            "specpipe/mlx-lm TTFT",
            "same tokens",
        ]
    lines = []
    for row in rows:
        a, b = row["specpipe"], row["specpipe_cached"]
        line = [
            row["turn"],
            row["prompt_tokens"],
            b["prefilled"],
            1000 * a["first_token_s"],
            1000 * b["first_token_s"],
            a["first_token_s"] / b["first_token_s"],
        ]
        if peer is not None:
            m = row["mlx_lm_cached"]
            line += [
                m["prefilled"],
                1000 * m["first_token_s"],
                b["first_token_s"] / m["first_token_s"],
                row["mlx_lm_same_tokens"],
            ]
        lines.append(line)
    print(table(headers, lines))
    out = Path(args.out) if args.out else RESULTS / "prompt-cache.json"
    write_json(
        out,
        {
            "command": "python " + " ".join(sys.argv),
            "date": time.strftime("%Y-%m-%d"),
            "machine": machine_info(),
            "args": vars(args),
            "turns": rows,
        },
    )


if __name__ == "__main__":
    main()
