"""Speculative decoding: specpipe (plain, ngram, two-model) and mlx-lm (plain,
speculative with `draft_model=`) on the same prompts, in one process run.

Every specpipe output must equal specpipe's plain greedy decode of the same
prompt (that is the library's promise; a difference fails the run unless
--no-assert); mlx-lm's outputs are compared to it too and reported. Speedup
is decode tok/s over the same library's plain decode tok/s.

Weights are loaded once: the two-model pipeline comes from the public
`specpipe.load(target, draft=..., num_draft_tokens=1)`, the other widths and
the plain / ngram pipelines share its loaded target (`attrs.evolve` of the
Pipeline record with another LoadedDraft).

    python bench/speculative.py --dtype bfloat16 --tokens 48
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    PROMPTS,
    RESULTS,
    Run,
    Styles,
    field_column,
    first_difference,
    ints,
    machine_info,
    mlxlm_load,
    mlxlm_plain,
    mlxlm_speculative,
    model_folder,
    runs_table,
    specpipe_run,
    speedup_plot,
    write_json,
)


def main() -> None:
    from specpipe.precision import prefer_exact_float32

    # float32 outputs are checked against plain decoding: full-float32 products
    # unless the environment chose (README "Exactness", specpipe/precision.py)
    prefer_exact_float32()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--prompts", default="code,chat,edit")
    parser.add_argument(
        "--widths",
        default="1,2,3,4,5,6",
        help="specpipe two-model widths (sweep prompts)",
    )
    parser.add_argument(
        "--mlxlm-widths",
        default="1,2,3,4,5,6",
        help="mlx-lm speculative widths (sweep prompts)",
    )
    parser.add_argument(
        "--sweep-prompts", default="code", help="prompts that run every width"
    )
    parser.add_argument(
        "--short-widths",
        default="2,4,6",
        help="widths for the other prompts (both libraries)",
    )
    parser.add_argument("--ngram-widths", default="2,4,6")
    parser.add_argument("--ngram-prompts", default="edit,code,chat")
    parser.add_argument("--two-model-prompts", default="code,chat,edit")
    parser.add_argument(
        "--draft-vocab",
        help="an FR-Spec list (draft_vocab.json): also run two-model "
        "with the draft projecting onto it (method 'two-model-fr', same widths)",
    )
    parser.add_argument(
        "--draft-dtype",
        default=None,
        help="dtype of the FR-Spec drafts (--draft-vocab), e.g. bfloat16 on a CPU "
        "(models/cpu_kernel.py); the full-vocabulary draft and mlx-lm's keep --dtype",
    )
    parser.add_argument(
        "--compare-unstaged",
        action="store_true",
        help="also run the FR-Spec two-model draft unstaged (DraftPolicy.staged=False)",
    )
    parser.add_argument("--no-mlxlm", action="store_true")
    parser.add_argument(
        "--own-weights",
        action="store_true",
        help="let mlx-lm load its own copy of the weights (default: share specpipe's buffers)",
    )
    parser.add_argument("--out", default=str(RESULTS / "speculative.json"))
    parser.add_argument("--plot", default=str(RESULTS / "speculative.png"))
    parser.add_argument("--no-assert", action="store_true")
    parser.add_argument(
        "--replot",
        metavar="JSON",
        help="only redraw --plot (and print the tables) from a result file",
    )
    args = parser.parse_args()
    if args.replot:
        import json

        payload = json.loads(Path(args.replot).read_text())
        report(payload)
        plot(payload, Path(args.plot))
        return

    from attrs import evolve

    import specpipe
    from bindings.registry import DraftLoadRequest
    from schemas.request import DraftPolicy

    started = time.perf_counter()
    machine = machine_info()
    target_folder = model_folder(args.target, args.dtype)
    draft_folder = model_folder(args.draft, args.dtype)
    fr_dtype = args.draft_dtype or args.dtype
    fr_folder = (
        model_folder(args.draft, fr_dtype) if fr_dtype != args.dtype else draft_folder
    )
    print(f"target {target_folder}\ndraft  {draft_folder}", file=sys.stderr, flush=True)

    two = specpipe.load(
        str(target_folder),
        draft=str(draft_folder),
        num_draft_tokens=1,
        dtype=args.dtype,
        adaptive=False,
    ).unwrap()
    assert two.draft is not None
    plain = evolve(two, draft=None)
    registry = two.registry
    widths, lm_widths, ng_widths = (
        ints(args.widths),
        ints(args.mlxlm_widths),
        ints(args.ngram_widths),
    )
    short = ints(args.short_widths)
    widths = sorted(set(widths) | set(short))
    two_model = {k: evolve(two, draft=evolve(two.draft, width=k)) for k in widths}
    two_model_fr: dict[int, Any] = {}
    if args.draft_vocab:
        fr = registry.load(
            "two-model",
            DraftLoadRequest(
                target=two.target,
                source=str(fr_folder),
                width=1,
                draft_vocab=args.draft_vocab,
                dtype=fr_dtype,
            ),
        ).unwrap()
        two_model_fr = {k: evolve(two, draft=evolve(fr, width=k)) for k in widths}
    two_model_unstaged: dict[int, Any] = {}
    if args.compare_unstaged:
        assert args.draft_vocab, (
            "--compare-unstaged compares the FR-Spec draft: give --draft-vocab"
        )
        chain = registry.load(
            "two-model",
            DraftLoadRequest(
                target=two.target,
                source=str(fr_folder),
                width=1,
                draft_vocab=args.draft_vocab,
                dtype=fr_dtype,
                policy=DraftPolicy(staged=False),
            ),
        ).unwrap()
        two_model_unstaged = {
            k: evolve(two, draft=evolve(chain, width=k)) for k in widths
        }
    ngram = {
        k: evolve(
            plain,
            draft=registry.load(
                "ngram", DraftLoadRequest(target=plain.target, width=k)
            ).unwrap(),
        )
        for k in ng_widths
    }
    draft_model: Any = two.draft.drafter.model  # type: ignore[attr-defined]
    from models.layers import model_dtype

    dtypes = {
        "specpipe_target": str(model_dtype(plain.target.model)),
        "specpipe_draft": str(model_dtype(draft_model)),
        "specpipe_fr_draft": fr_dtype,
    }
    peer = peer_draft = None
    if not args.no_mlxlm:
        peer = mlxlm_load(
            target_folder, None if args.own_weights else plain.target.model
        )
        peer_draft = mlxlm_load(draft_folder, None if args.own_weights else draft_model)
    eos = frozenset(plain.target.tokenizer.eos_token_ids)

    # warm-up, excluded: every code path once, a few tokens
    warm_ids = list(plain.encode("def f(x):", False).unwrap())
    specpipe_run(plain, warm_ids, 4, "plain")
    specpipe_run(two_model[widths[0]], warm_ids, 4, "two-model")
    if two_model_fr:
        specpipe_run(two_model_fr[widths[0]], warm_ids, 4, "two-model-fr")
    if two_model_unstaged:
        specpipe_run(
            two_model_unstaged[widths[0]], warm_ids, 4, "two-model-fr-unstaged"
        )
    if ng_widths:
        specpipe_run(ngram[ng_widths[0]], warm_ids, 4, "ngram")
    if peer is not None:
        mlxlm_plain(peer, warm_ids, 4, eos)
        if lm_widths or short:
            mlxlm_speculative(peer, peer_draft, warm_ids, 4, 2, eos)

    payload: dict[str, Any] = {
        "machine": machine,
        "target": str(target_folder),
        "draft": str(draft_folder),
        "dtype": args.dtype,
        "model_dtypes": dtypes,
        "mlx_lm_weights": "own copy"
        if args.own_weights
        else "shared with specpipe (same buffers)",
        "max_tokens": args.tokens,
        "draft_vocab": args.draft_vocab,
        "prompts": {},
    }
    failures: list[str] = []

    def record(prompt: str, run: Run, reference: list[int]) -> dict[str, Any]:
        diff = first_difference(run.tokens, reference)
        entry = run.summary()
        entry["equals_specpipe_plain"] = diff is None
        entry["first_difference"] = diff
        block = payload["prompts"][prompt]
        base = block["plain"].get(run.library)
        entry["speedup"] = run.decode_tps / base["decode_tps"] if base else 1.0
        entry["wall_speedup"] = base["wall_s"] / run.wall_s if base else 1.0
        # by process CPU time (whole call): robust to time-slicing on a shared machine
        entry["cpu_speedup"] = entry["cpu_tps"] / base["cpu_tps"] if base else 1.0
        block["runs"].append(entry)
        if diff is not None and run.library == "specpipe":
            failures.append(
                f"{prompt}: specpipe {run.method} k={run.width} differs at token {diff}"
            )
        write_json(Path(args.out), payload)
        print(
            f"  {prompt:5s} {run.library:8s} {run.method:11s} k={run.width}: {run.decode_tps:.3f} tok/s "
            f"x{entry['speedup']:.2f} (cpu x{entry['cpu_speedup']:.2f})  acc.len {run.acceptance_length:.2f}  {run.ms_per_round:.0f} ms/round  "
            f"cpu/wall {entry['cpu_per_wall']:.2f}  {'==' if diff is None else f'DIFF@{diff}'}  "
            f"[{time.perf_counter() - started:.0f}s]",
            file=sys.stderr,
            flush=True,
        )
        return entry

    for prompt in args.prompts.split(","):
        text, chat = PROMPTS[prompt]
        ids = list(plain.encode(text, chat).unwrap())
        payload["prompts"][prompt] = {
            "prompt_tokens": len(ids),
            "plain": {},
            "runs": [],
        }
        block = payload["prompts"][prompt]
        ref_run = specpipe_run(plain, ids, args.tokens, "plain")
        reference = ref_run.tokens
        block["reference_text"] = plain.target.tokenizer.decode(reference)
        block["plain"]["specpipe"] = ref_run.summary()
        record(prompt, ref_run, reference)
        if peer is not None:
            lm_plain = mlxlm_plain(peer, ids, args.tokens, eos)
            block["plain"]["mlx-lm"] = lm_plain.summary()
            record(prompt, lm_plain, reference)
        if prompt in args.ngram_prompts.split(","):
            for k in ng_widths:
                record(
                    prompt, specpipe_run(ngram[k], ids, args.tokens, "ngram"), reference
                )
        if prompt in args.two_model_prompts.split(","):
            sweep = prompt in args.sweep_prompts.split(",")
            sp_k = ints(args.widths) if sweep else short
            lm_k = lm_widths if sweep else short
            # interleave the two libraries width by width, so slow drifts in
            # machine load hit both alike
            for k in sorted(set(sp_k) | set(lm_k)):
                if k in sp_k:
                    record(
                        prompt,
                        specpipe_run(two_model[k], ids, args.tokens, "two-model"),
                        reference,
                    )
                if k in sp_k and k in two_model_fr:
                    record(
                        prompt,
                        specpipe_run(two_model_fr[k], ids, args.tokens, "two-model-fr"),
                        reference,
                    )
                if k in sp_k and k in two_model_unstaged:
                    record(
                        prompt,
                        specpipe_run(
                            two_model_unstaged[k],
                            ids,
                            args.tokens,
                            "two-model-fr-unstaged",
                        ),
                        reference,
                    )
                if peer is not None and k in lm_k:
                    record(
                        prompt,
                        mlxlm_speculative(peer, peer_draft, ids, args.tokens, k, eos),
                        reference,
                    )

    payload["elapsed_s"] = time.perf_counter() - started
    write_json(Path(args.out), payload)
    report(payload)
    if args.plot:
        plot(payload, Path(args.plot))
    if failures:
        print("\nLOSSLESSNESS FAILURES:\n  " + "\n  ".join(failures))
        if not args.no_assert:
            raise SystemExit(1)


REPORT_COLUMNS = [
    field_column("speedup (CPU time)", "cpu_speedup"),
    field_column("tokens/round", "acceptance_length"),
    field_column("ms/round", "ms_per_round"),
    field_column("wall s", "wall_s"),
]
STYLES: Styles = {
    ("specpipe", "two-model"): ("C0", "o-", "specpipe two-model"),
    ("specpipe", "two-model-fr"): ("C3", "D-", "specpipe two-model, FR-Spec draft"),
    ("specpipe", "two-model-fr-unstaged"): (
        "C4",
        "v:",
        "specpipe two-model, FR-Spec, unstaged",
    ),
    ("mlx-lm", "speculative"): ("C1", "s--", "mlx-lm speculative"),
    ("specpipe", "ngram"): ("C2", "^-", "specpipe ngram"),
}


def report(payload: dict[str, Any]) -> None:
    m = payload["machine"]
    print(
        f"\nspeculative decoding, {Path(payload['target']).name} + {Path(payload['draft']).name} "
        f"[{payload['dtype']}], {payload['max_tokens']} tokens, {m['device']} ({m['cpu']}), {m['date']}"
    )
    for prompt, block in payload["prompts"].items():
        print(f"\nprompt '{prompt}' ({block['prompt_tokens']} prompt tokens)")
        print(runs_table(block["runs"], REPORT_COLUMNS))


def plot(payload: dict[str, Any], path: Path) -> None:
    def width_ticks(ax: Any, runs: list[dict[str, Any]]) -> None:
        ax.set_xticks(range(1, 1 + max((r["width"] for r in runs), default=1)))

    speedup_plot(
        payload,
        path,
        STYLES,
        "",
        "draft width k (draft tokens per round)",
        width_ticks,
    )


if __name__ == "__main__":
    main()
