"""What the benchmarks share: model folders, prompts, machine facts, and the
two ways to decode (specpipe and the peer, mlx-lm) timed the same way.

Timing: every run is measured twice.
- `wall_s`: the whole call, prompt included, closed by `mx.synchronize()`.
- `decode_tps`: steady-state decode speed. specpipe reports it itself
  (generated tokens over its decode time, which starts after the prompt is
  processed); for mlx-lm it is (N - 1) over the time between the first and
  the last yielded token (mlx-lm's own definition). Both measure the time of
  one decode forward; the ratio of the two libraries uses this figure, and
  the wall-clock ratio is reported beside it.
Both libraries get the same prompt ids (specpipe's encoding), greedy sampling,
the same token budget, and stop at the same EOS ids.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import models  # noqa: E402,F401  before mlx: routes its BLAS (models/blas.py)

# isort: split

import mlx.core as mx  # noqa: E402

RESULTS = HERE / "results"

# ---------------------------------------------------------------- prompts

CODE_PROMPT = '''def merge_sorted(a: list[int], b: list[int]) -> list[int]:
    """Merge two sorted lists into one sorted list."""
'''

CHAT_PROMPT = "Write a Python function that checks whether a string is a palindrome, ignoring case and spaces. Keep it short."

EDIT_SOURCE = """def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item["price"] * item["quantity"]
    return subtotal * (1 + tax_rate)
"""

EDIT_PROMPT = (
    "Rename the function `total_price` to `order_total` and the variable `subtotal` "
    "to `net` in this code. Reply with the full updated code only.\n\n```python\n"
    + EDIT_SOURCE
    + "```"
)

PROSE_PROMPT = (
    "Write a short paragraph for a general audience about why the printing press "
    "changed Europe in the fifteenth century."
)

# name -> (text, chat template?)
PROMPTS: dict[str, tuple[str, bool]] = {
    "code": (CODE_PROMPT, False),
    "chat": (CHAT_PROMPT, True),
    "edit": (EDIT_PROMPT, True),
    "prose": (PROSE_PROMPT, True),
}


# ---------------------------------------------------------------- machine


def machine_info() -> dict[str, Any]:
    import importlib.metadata as md

    from models.blas import route_blas
    from models.parallel import cpu_threads

    model = "unknown"
    try:
        out = subprocess.run(
            ["lscpu"], capture_output=True, text=True, check=False
        ).stdout
        for line in out.splitlines():
            if line.lower().startswith("model name"):
                model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    gpu = None
    try:
        out = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=name,memory.total,driver_version",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        gpu = out.stdout.strip() or None
    except OSError:
        pass

    def version(name: str) -> str | None:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return None

    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "cpu": model,
        "cores": os.cpu_count(),
        "specpipe_cpu_threads": cpu_threads(),
        "blas": route_blas().library,
        "blas_path": route_blas().path,
        "gpu": gpu,
        "device": str(mx.default_device()),
        "python": platform.python_version(),
        "mlx": version("mlx"),
        "mlx-lm": version("mlx-lm"),
        "mlx-cuda": version("mlx-cuda-13") or version("mlx-cuda"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "library_sha256": library_fingerprint(),
    }


def library_fingerprint() -> str:
    """SHA-256 over the library's sources (specpipe, models, schemas, bindings):
    other engineers edit them while benchmarks run; this ties a result to a version."""
    import hashlib

    digest = hashlib.sha256()
    for folder in ("specpipe", "models", "schemas", "bindings"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            digest.update(str(path.relative_to(ROOT)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


# ---------------------------------------------------------------- folders


def bench_cache() -> Path:
    from specpipe.load import cache_root

    return cache_root() / "bench"


def model_folder(ref: str, dtype: str) -> Path:
    """An HF-layout MLX folder of `ref` stored in `dtype`.

    A path is used as it is (its stored dtype must match). A fixture's float32
    folder is specpipe's own converted cache; other dtypes are written once
    with `specpipe convert REF OUT --dtype DTYPE` under the bench cache.
    """
    path = Path(ref).expanduser()
    if path.is_dir():
        return path
    if dtype == "float32":
        from specpipe.load import fixture_folder

        return fixture_folder(ref).unwrap()
    out = bench_cache() / f"{ref}-{dtype}"
    if not (out / "config.json").is_file():
        cmd = [
            sys.executable,
            "-m",
            "specpipe",
            "convert",
            ref,
            str(out),
            "--dtype",
            dtype,
            "--force",
        ]
        print("+", " ".join(cmd), file=sys.stderr, flush=True)
        subprocess.run(cmd, check=True, cwd=ROOT)
    return out


def stored_dtype(folder: Path) -> str:
    cfg = json.loads((folder / "config.json").read_text())
    return str(cfg.get("torch_dtype", "?"))


# ---------------------------------------------------------------- runs


@dataclass
class Run:
    library: str  # "specpipe" | "mlx-lm"
    method: str  # "plain" | "ngram" | "two-model" | "speculative"
    width: int  # draft tokens per round (0 for plain)
    tokens: list[int]
    wall_s: float
    decode_s: float
    decode_tps: float
    rounds: int
    acceptance_length: float  # tokens per round
    ms_per_round: float
    drafted: int = 0
    accepted: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    cpu_s: float = 0.0  # process CPU time of the call (MLX decodes on one thread: cpu/wall ~1 when alone)
    load: float = 0.0  # 1-minute load average after the call

    def summary(self) -> dict[str, Any]:
        d = asdict(self)
        d["n_tokens"] = len(self.tokens)
        d["cpu_per_wall"] = self.cpu_s / self.wall_s if self.wall_s else 0.0
        d["cpu_tps"] = len(self.tokens) / self.cpu_s if self.cpu_s else 0.0
        return d


class Clock:
    """Wall and process-CPU time of one call, closed by mx.synchronize()."""

    def __enter__(self) -> Clock:
        mx.synchronize()
        self.t0 = time.perf_counter()
        self.c0 = time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        mx.synchronize()
        self.wall = time.perf_counter() - self.t0
        self.cpu = time.process_time() - self.c0
        self.load = os.getloadavg()[0]


def mlxlm_load(folder: Path, share_from: Any = None) -> Any:
    """mlx-lm's model of `folder`. With `share_from` (a specpipe model loaded
    from the same folder), mlx-lm loads lazily and then takes specpipe's
    weight arrays (both keep the HF names), so the weights are in memory
    once: the same values, the same buffers. Falls back to mlx-lm's own
    weights when the names, shapes or dtypes differ."""
    import mlx_lm
    from mlx.utils import tree_flatten

    if share_from is None:
        return mlx_lm.load(str(folder))[0]
    from models.layers import flat_parameters

    model, _ = mlx_lm.load(str(folder), lazy=True)
    theirs = dict(tree_flatten(model.parameters()))
    ours = flat_parameters(share_from)
    same = theirs.keys() == ours.keys() and all(
        theirs[k].shape == ours[k].shape and theirs[k].dtype == ours[k].dtype
        for k in ours
    )
    if not same:
        print(
            f"mlx-lm: weights of {folder} not shareable; loading its own copy",
            file=sys.stderr,
        )
        mx.eval(model.parameters())
        return model
    model.load_weights(list(ours.items()), strict=True)
    return model


def greedy_sampler(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


def specpipe_run(
    pipeline: Any, ids: Sequence[int], max_tokens: int, method: str
) -> Run:
    from schemas.request import GenerationLimits, SamplingParams

    sampling = SamplingParams.create(temperature=0.0).unwrap()
    limits = GenerationLimits.create(max_tokens=max_tokens).unwrap()
    with Clock() as clock:
        result = pipeline.generate(list(ids), sampling, limits).unwrap()
    wall = clock.wall
    s = result.stats
    if result.error:
        raise RuntimeError(f"specpipe failed: {result.error}")
    if s.draft_errors:
        raise RuntimeError(f"specpipe drafter errors: {s.draft_errors}")
    return Run(
        library="specpipe",
        method=method,
        width=pipeline.draft.width if pipeline.draft is not None else 0,
        tokens=list(result.tokens),
        wall_s=wall,
        decode_s=s.decode_seconds,
        decode_tps=s.tokens_per_second,
        rounds=s.rounds,
        acceptance_length=s.acceptance_length,
        ms_per_round=s.ms_per_round,
        drafted=s.drafted,
        accepted=s.accepted,
        extra={
            "prompt_s": s.prompt_seconds,
            "finish": result.finish_reason,
            **(
                {
                    "depths": {str(d): n for d, n in s.depths},
                    "gated_share": s.gated_share,
                }
                if s.depths
                else {}
            ),
        },
        cpu_s=clock.cpu,
        load=clock.load,
    )


def mlxlm_plain(
    model: Any, ids: Sequence[int], max_tokens: int, eos: frozenset[int]
) -> Run:
    from mlx_lm.generate import generate_step

    prompt = mx.array(list(ids), dtype=mx.uint32)
    tokens: list[int] = []
    stamps: list[float] = []
    with Clock() as clock:
        t0 = clock.t0
        gen = generate_step(
            prompt, model, max_tokens=max_tokens, sampler=greedy_sampler
        )
        for token, _ in gen:
            stamps.append(time.perf_counter())
            if token in eos:
                break
            tokens.append(int(token))
        gen.close()
    wall = clock.wall
    decode = stamps[-1] - stamps[0]
    n = len(stamps)
    return Run(
        library="mlx-lm",
        method="plain",
        width=0,
        tokens=tokens,
        wall_s=wall,
        decode_s=decode,
        decode_tps=(n - 1) / decode if decode > 0 else 0.0,
        rounds=n,
        acceptance_length=1.0,
        ms_per_round=1000.0 * decode / max(n - 1, 1),
        extra={"first_token_s": stamps[0] - t0},
        cpu_s=clock.cpu,
        load=clock.load,
    )


def mlxlm_speculative(
    model: Any,
    draft: Any,
    ids: Sequence[int],
    max_tokens: int,
    width: int,
    eos: frozenset[int],
) -> Run:
    """mlx-lm's speculative_generate_step. A round yields its accepted drafts
    (from_draft=True) and then one target token, so rounds = target tokens."""
    from mlx_lm.generate import speculative_generate_step

    prompt = mx.array(list(ids), dtype=mx.uint32)
    tokens: list[int] = []
    stamps: list[float] = []
    round_ends: list[float] = []
    from_draft = 0
    with Clock() as clock:
        t0 = clock.t0
        gen = speculative_generate_step(
            prompt,
            model,
            draft,
            num_draft_tokens=width,
            max_tokens=max_tokens,
            sampler=greedy_sampler,
        )
        for token, _, drafted in gen:
            now = time.perf_counter()
            stamps.append(now)
            if token in eos:
                round_ends.append(now)
                break
            tokens.append(int(token))
            if drafted:
                from_draft += 1
            else:
                round_ends.append(now)
        gen.close()
    wall = clock.wall
    if not round_ends or round_ends[-1] != stamps[-1]:
        round_ends.append(stamps[-1])  # the budget ran out inside a round
    rounds = len(round_ends)
    # Decode time: from the end of the first round to the end of the last
    # (the first round carries the prompt's prefill, as mlx-lm's own timer).
    decode = round_ends[-1] - round_ends[0]
    later = len(tokens) - _tokens_through_first_round(stamps, round_ends[0])
    return Run(
        library="mlx-lm",
        method="speculative",
        width=width,
        tokens=tokens,
        wall_s=wall,
        decode_s=decode,
        decode_tps=later / decode if decode > 0 else 0.0,
        rounds=rounds,
        acceptance_length=len(tokens) / rounds if rounds else 0.0,
        ms_per_round=1000.0 * decode / max(rounds - 1, 1),
        drafted=width * rounds,
        accepted=from_draft,
        extra={"first_round_s": round_ends[0] - t0},
        cpu_s=clock.cpu,
        load=clock.load,
    )


def _tokens_through_first_round(stamps: list[float], first_end: float) -> int:
    return sum(1 for s in stamps if s <= first_end)


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token, len of the shorter if one is a
    prefix of the other, or None when equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    if len(a) != len(b):
        return min(len(a), len(b))
    return None


def ints(text: str) -> list[int]:
    """A comma-separated list of ints (empty items ignored)."""
    return [int(x) for x in text.split(",") if x.strip()]


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else 0.0


def median_ms(fn: Any, repeats: int, warmup: int = 3) -> float:
    """Median wall time of `mx.eval(fn())` over `repeats` calls, in ms, after
    `warmup` untimed calls (first traces and kernel builds)."""
    for _ in range(warmup):
        mx.eval(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(fn())
        times.append((time.perf_counter() - start) * 1000.0)
    return statistics.median(times)


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2))
    print(f"wrote {path}", file=sys.stderr)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |"
        for r in cells
    ]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


# a column of a run table: its header and how a run record gives its cell
Column = tuple[str, Callable[[dict[str, Any]], Any]]


def field_column(header: str, key: str) -> Column:
    """A column of a field every run record has."""
    return header, lambda r: r[key]


def runs_table(runs: Sequence[dict[str, Any]], middle: Sequence[Column]) -> str:
    """A prompt's runs (speculative.py / adaptive.py records): library, method,
    width, tokens, tok/s and speedup, then `middle`, then the losslessness mark."""
    columns: list[Column] = [
        field_column("library", "library"),
        field_column("method", "method"),
        field_column("k", "width"),
        field_column("tokens", "n_tokens"),
        field_column("tok/s", "decode_tps"),
        field_column("speedup", "speedup"),
        *middle,
        (
            "== specpipe plain",
            lambda r: (
                "yes" if r["equals_specpipe_plain"] else f"NO @{r['first_difference']}"
            ),
        ),
    ]
    return table(
        [header for header, _ in columns],
        [[cell(r) for _, cell in columns] for r in runs],
    )


# a line of a speedup plot: (library, method) -> (colour, style, label)
Styles = dict[tuple[str, str], tuple[str, str, str]]


def speedup_plot(
    payload: dict[str, Any],
    path: Path,
    styles: Styles,
    title_prefix: str,
    xlabel: str,
    extra: Callable[[Any, list[dict[str, Any]]], None] | None = None,
) -> None:
    """One panel a prompt: each method's speedup over its library's plain
    decode against the draft width; `extra(ax, runs)` adds to a panel."""
    try:
        import matplotlib
    except ImportError:
        print(f"no plot ({path}): matplotlib is not installed", file=sys.stderr)
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    prompts = list(payload["prompts"])
    fig, axes = plt.subplots(
        1, len(prompts), figsize=(5 * len(prompts), 4), squeeze=False, sharey=True
    )
    for ax, prompt in zip(axes[0], prompts, strict=True):
        runs = payload["prompts"][prompt]["runs"]
        for (lib, method), (color, style, label) in styles.items():
            points = sorted(
                (r["width"], r["speedup"])
                for r in runs
                if r["library"] == lib and r["method"] == method
            )
            if points:
                ax.plot(
                    [x for x, _ in points],
                    [y for _, y in points],
                    style,
                    color=color,
                    label=label,
                )
        ax.axhline(1.0, color="grey", lw=0.8)
        if extra is not None:
            extra(ax, runs)
        ax.set_title(f"prompt '{prompt}'")
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("decode tok/s over the same library's plain decode")
    handles: dict[str, Any] = {}
    for ax in axes[0]:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, handle)
    axes[0][0].legend(handles.values(), handles.keys(), fontsize=8)
    m = payload["machine"]
    fig.suptitle(
        f"{title_prefix}{Path(payload['target']).name} + {Path(payload['draft']).name} "
        f"[{payload['dtype']}], {payload['max_tokens']} tokens, {m['device']} {m['cpu']}",
        fontsize=9,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"wrote {path}", file=sys.stderr)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"
    return str(value)


def recorded_decode(
    tokenizer: Any, data: dict[str, Any], name: str
) -> tuple[list[int], list[int]]:
    """`(prompt ids, specpipe's plain output)` of prompt `name` in a result file
    (the prompt re-encoded as the bench encodes it, checked against the record)."""
    text, chat = PROMPTS[name]
    if chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}])
    prompt = list(tokenizer.encode(text, add_special_tokens=not chat))
    block = data["prompts"][name]
    assert block["prompt_tokens"] == len(prompt), "not the recorded prompt"
    return prompt, list(block["plain"]["specpipe"]["tokens"])


def split_ms(fn: Callable[[], Any], repeats: int) -> dict[str, float]:
    """Median build / encode / wait of `fn`'s graph."""
    for _ in range(3):
        mx.eval(fn())
    parts: dict[str, list[float]] = {"build": [], "encode": [], "wait": []}
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        t1 = time.perf_counter()
        mx.async_eval(out)
        t2 = time.perf_counter()
        mx.synchronize()
        t3 = time.perf_counter()
        for key, value in zip(parts, (t1 - t0, t2 - t1, t3 - t2), strict=True):
            value and parts[key].append(value * 1000.0)
    return {k: statistics.median(v) for k, v in parts.items()}
