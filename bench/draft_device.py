"""The MTP draft phase's DEVICE time per round, full head against an FR-Spec
list, read by Nsight Compute: each round's draft launch (the fused kernel
of models/mtp_cuda.py, a whole round in one launch) timed on the GPU
(`gpu__time_duration`), without the host's share of a round (building the
launch's inputs in Python, MLX encoding it, the wait for the result), which
is the same for both heads.

    python3 bench/draft_device.py --depths 1,2,3,5 --rows 1,3 --repeats 15 \
        --cache-control all --out bench/results/draft-device-h200.json
    python3 bench/draft_device.py --check --rows 1,3 --depths 1,2,3

The script runs itself under `ncu` (as `--worker`): the worker opens rows on
a random Qwen3-Next-shaped target and head (bench/mtp.py's `opened_rows`:
after two real rounds, the second through the kernel, so that proposals
derive their inputs on the device as in steady-state decoding), warms every
(rows, head, depth) up, then proposes them in a shuffled alternation,
writing one label per launch; the driver pairs the labels with the last
kernel records of ncu's log. `--inputs` picks what the launches read:
`library` (steady state), `host` (inputs built from host values, as a
round after rows joined or left), `device` / `chained` (host inputs made
once and kept in device memory; diagnostics). `--cache-control all` flushes
the GPU's caches before each launch, as the verify forward between two
draft phases does in a round (its weights pass through L2); `none` leaves
L2 warm from the last launch. `--context` sets the rows' context (48 by
default): the head's attention reads all of it every step, for both heads
alike, so the cut falls at long contexts (bench/RESULTS.md, twenty-first
session: 1.85x at 4,096 positions, 1.46x at 32,768). `--check` times nothing: on rows that
accepted 0..all of their drafts, rounds deriving their inputs on the device
must draft what rounds with host-built inputs draft. Needs ncu (Nsight
Compute) on the PATH and MLX's CUDA backend; MLX's CUDA graphs are turned
off in the worker (kernels then launch one by one; their durations do not
depend on it).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

KERNEL = "specpipe_mtp_step"  # models.mtp_cuda's kernel name prefix
METRIC = "gpu__time_duration.sum"
UNITS = {
    "nsecond": 1e-3,
    "ns": 1e-3,
    "usecond": 1.0,
    "us": 1.0,
    "msecond": 1e3,
    "ms": 1e3,
    "second": 1e6,
    "s": 1e6,
}


def worker(args: argparse.Namespace) -> None:
    import models  # noqa: F401, I001  before mlx: routes its BLAS (models/blas.py)
    import mlx.core as mx

    from bench.mtp import (
        SAMPLINGS,
        apply_switches,
        bench_prompt,
        fr_list,
        opened_rows,
        random_target_and_head,
    )
    from schemas.request import DraftPolicy
    from specpipe.drafts.mtp import MtpDrafter

    apply_switches(args.kernel_switches)
    _, model, head = random_target_and_head(
        "qwen3-next", args.layers, args.experts, 2048, args.vocab, mx.bfloat16
    )
    prompt = bench_prompt(args.vocab) + tuple(range(max(0, args.context - 48)))
    sampling = SAMPLINGS[args.sampling]
    depths = [int(d) for d in args.depths.split(",")]
    drafters = {
        "full": MtpDrafter(model, head, DraftPolicy(compiled=True), vocab=None),
        "fr": MtpDrafter(
            model,
            head,
            DraftPolicy(compiled=True),
            vocab=fr_list(args.vocab, args.fr_size),
        ),
    }
    drafters = {
        name: d for name, d in drafters.items() if name in args.heads.split(",")
    }
    opened = {
        (rows, name): opened_rows(
            drafter, model, prompt, max(depths), sampling, rows, craft=args.check
        )
        for rows in (int(r) for r in args.rows.split(","))
        for name, drafter in drafters.items()
    }
    if mx.default_device() == mx.gpu:
        assert all(o.chain is not None for o, _ in opened.values()), "no device chain"
    if args.check:
        check(opened, depths)
        return
    for (o, rows), depth in ((o, d) for o in opened.values() for d in depths):
        for _ in range(2):  # traces, compiles, checks the barriers
            proposal = o.propose(rows, depth)
            assert proposal.device is not None
            mx.eval(proposal.device)
    labels = []
    order = random.Random(0)
    keys = [(rows, name, depth) for (rows, name) in opened for depth in depths]
    from attrs import evolve

    runs = {
        (rows, name, depth): propose_launch(*opened[(rows, name)], depth)
        if args.inputs == "library"
        else propose_launch(evolve(opened[(rows, name)][0], chain=None),
                            opened[(rows, name)][1], depth)
        if args.inputs == "host"
        else kept_launch(*opened[(rows, name)], depth, chained=args.inputs == "chained")
        for rows, name, depth in keys
    }  # fmt: skip
    for run in runs.values():
        mx.eval(run())
    for _ in range(args.repeats):
        order.shuffle(keys)
        for key in keys:
            mx.eval(runs[key]())
            labels.append({"rows": key[0], "head": key[1], "depth": key[2]})
    Path(args.labels).write_text(json.dumps(labels))


def check(opened: dict[tuple[int, str], Any], depths: list[int]) -> None:
    """Per rows, head and depth: the round's drafts with its inputs derived
    on the device equal those with its inputs built from host values."""
    import mlx.core as mx
    from attrs import evolve

    from specpipe.sampling import draw_filters

    failed = 0
    for (rows, name), (o, states) in opened.items():
        for depth in depths:
            derived = o.propose(states, depth)
            host = evolve(o, chain=None).propose(states, depth)
            assert derived.device is not None and host.device is not None
            mx.eval(derived.device, host.device)
            same = derived.device.tolist() == host.device.tolist()
            failed += not same
            params = [o.policy.draft_params(row.sampling) for row in states]
            fused = o.step.fused_step(0)
            width = 1 << (max(o.tail_lengths) - 1).bit_length()
            kernel = (
                o.step.derived(draw_filters(params[0]), depth) is not None
                and fused is not None
                and fused.fits(rows, width, params[0].greedy, params[0].top_k)
            )
            print("CHECK", json.dumps({"rows": rows, "head": name, "depth": depth,
                                       "tail": list(o.tail_lengths), "equal": same,
                                       "derived_by_kernel": kernel,
                                       "derived": derived.device.tolist(),
                                       "host": host.device.tolist()}), flush=True)  # fmt: skip
    if failed:
        sys.exit(
            f"{failed} derived rounds drafted other tokens than their host-built twins"
        )


def propose_launch(opened: Any, rows: Any, depth: int) -> Any:
    """A round's draft launch as decoding makes it: `propose` (its inputs
    derived on the device where the rows carry a chain, else built from host
    values)."""

    def run() -> Any:
        proposal = opened.propose(rows, depth)
        assert proposal.device is not None
        return proposal.device

    return run


def kept_launch(opened: Any, rows: Any, depth: int, chained: bool = False) -> Any:
    """The same launch on inputs made once and kept in device memory (each
    small input padded past MLX's 8-byte scalar pool, copied by a device
    operation, the kernel given a view of its first elements). Rounds do not
    work this way (their inputs change every round); this isolates what
    reading host-written inputs costs. `chained`: `depth` chained steps in
    one launch instead of a round's first step and depth - 1 chained ones
    (what a launch costs beyond its steps' work)."""
    import mlx.core as mx

    from specpipe.sampling import draw_filters

    params = [opened.policy.draft_params(row.sampling) for row in rows]
    filters = draw_filters(params[0])
    arrays = list(opened.round_arrays(rows, depth, params))
    whole = (
        opened.step._chain(depth, filters)
        if chained
        else opened.step.round(filters, depth)
    )
    if chained:  # one position per row, the tail's first state as the previous output
        arrays[0], arrays[1] = arrays[0][:, :1], arrays[1][:, :1]
    keep = list(arrays)
    gpu = (
        mx.default_device() == mx.gpu
    )  # (the fused kernel's; MLX's step takes no padding)
    for i in (0, 2, 3, 6, 7):  # ids, last, starts, seeds, steps
        a = arrays[i]
        flat = a.reshape(-1)
        if gpu and flat.size < 4:
            flat = mx.concatenate([flat, mx.zeros((4 - flat.size,), dtype=a.dtype)])
        keep.append(flat)
        arrays[i] = (flat + mx.zeros((1,), dtype=a.dtype))[: a.size].reshape(a.shape)
    mx.eval(arrays, keep)

    def run() -> Any:
        return whole(*arrays)[0]

    return run


def kernel_times(log: str) -> list[float]:
    """Microseconds of each profiled kernel in ncu's CSV log, in launch order."""
    lines = [line for line in log.splitlines() if line.startswith('"')]
    times: dict[int, float] = {}
    for row in csv.DictReader(lines):
        if row.get("Metric Name") == METRIC:
            value = float(row["Metric Value"].replace(",", ""))
            times[int(row["ID"])] = value * UNITS[row["Metric Unit"]]
    return [times[i] for i in sorted(times)]


def summary(labels: list[dict[str, Any]], times: list[float]) -> list[dict[str, Any]]:
    """Per (rows, depth): each head's median device us per launch, the cut of
    the medians and the median of per-repeat cuts."""
    per: dict[tuple[int, str, int], list[float]] = {}
    for label, t in zip(labels, times, strict=True):
        per.setdefault((label["rows"], label["head"], label["depth"]), []).append(t)
    out = []
    for rows, depth in sorted({(k[0], k[2]) for k in per}):
        full, fr = per[(rows, "full", depth)], per[(rows, "fr", depth)]
        out.append(
            {
                "rows": rows,
                "depth": depth,
                "launches": len(full),
                "full_us": statistics.median(full),
                "fr_us": statistics.median(fr),
                "cut": statistics.median(full) / statistics.median(fr),
                "paired_cut_median": statistics.median(
                    a / b for a, b in zip(full, fr, strict=True)
                ),
                "full_us_range": [min(full), max(full)],
                "fr_us_range": [min(fr), max(fr)],
            }
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--labels", help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--fr-size", type=int, default=32768)
    parser.add_argument(
        "--context",
        type=int,
        default=48,
        help="prompt tokens (the rows' context; the head's attention reads it)",
    )
    parser.add_argument("--depths", default="1,2,3,5")
    parser.add_argument("--rows", default="1")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--sampling", choices=("greedy", "qwen"), default="greedy")
    parser.add_argument(
        "--heads",
        default="full,fr",
        help="the worker's heads (profiling one head under other ncu options)",
    )
    parser.add_argument(
        "--kernel-switches",
        default="",
        help="comma-separated models.mtp_cuda switches on (NAME) or off (-NAME)",
    )
    parser.add_argument(
        "--inputs",
        choices=("library", "host", "device", "chained"),
        default="library",
        help="library: each launch through `propose` in steady state (its inputs "
        "derived on the device from the last round's); host: through "
        "`propose`, its inputs made from host values; device: the host "
        "inputs made once and kept in device memory; chained: as device, "
        "`depth` chained steps in one launch",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="no timing: check that rounds deriving their inputs on the device "
        "draft what rounds with host-built inputs draft (crafted acceptances)",
    )
    parser.add_argument("--cache-control", choices=("all", "none"), default="all")
    parser.add_argument("--ncu", default="ncu")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.worker or args.check:
        worker(args)
        return
    if args.out is None:
        parser.error("--out is required")
    ncu = shutil.which(args.ncu)
    if ncu is None:
        sys.exit(f"{args.ncu} (Nsight Compute) is not on the PATH: pass --ncu PATH")
    from bench.common import machine_info

    with tempfile.TemporaryDirectory() as tmp:
        labels_path, log_path = Path(tmp) / "labels.json", Path(tmp) / "ncu.csv"
        forwarded = [a for a in sys.argv[1:] if not a.startswith("--out")]
        if "--out" in sys.argv:
            i = sys.argv.index("--out")
            forwarded = sys.argv[1:i] + sys.argv[i + 2 :]
        command = [
            ncu,
            "--target-processes",
            "all",
            "--kernel-name",
            f"regex:{KERNEL}",
            "--metrics",
            METRIC,
            "--cache-control",
            args.cache_control,
            "--clock-control",
            "none",
            "--csv",
            "--log-file",
            str(log_path),
            sys.executable,
            str(Path(__file__).resolve()),
            "--worker",
            "--labels",
            str(labels_path),
            *forwarded,
        ]
        env = dict(os.environ, MLX_USE_CUDA_GRAPHS="0")
        done = subprocess.run(command, env=env)
        if done.returncode != 0:
            sys.exit(f"the profiled worker failed ({done.returncode})")
        labels = json.loads(labels_path.read_text())
        times = kernel_times(log_path.read_text())
    if len(times) < len(labels):
        sys.exit(
            f"ncu recorded {len(times)} {KERNEL} launches for {len(labels)} labels"
        )
    entries = summary(labels, times[len(times) - len(labels) :])
    for entry in entries:
        print("DEVICE", json.dumps(entry), flush=True)
    report = {
        "machine": machine_info(),
        "command": " ".join(sys.argv),
        "kernel_records": len(times),
        "entries": entries,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
