"""HTTP serving under concurrent clients: `specpipe serve` vs `mlx_lm.server`.

Each server runs as its own process on the SAME HF-layout MLX folder. After
one untimed warm-up request, `--clients` threads each send one greedy chat
completion at once (the prompts of `common.PROMPTS`, in turn), `--tokens`
each; a repeat's figure is all their completion tokens over the wall time
from the first send to the last answer. Reported: the median over
`--repeats` of that aggregate tok/s, the mean latency of a request, and each
specpipe configuration's ratio to mlx_lm.server in the same run. Both servers'
float32 products run on the same BLAS (`models/blas.py`: an OpenBLAS where one
is installed). The answers'
texts are compared with mlx_lm.server's (greedy: the same up to near-ties of
the two libraries' float arithmetic) and the count that match is reported.

    python bench/serve.py --model smollm2-135m-instruct --clients 4 --tokens 96 \
        --repeats 3 --out bench/results/serve-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from common import PROMPTS, machine_info, median, model_folder, table, write_json  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    data = json.dumps(body).encode()
    request = urllib.request.Request(
        url, data, {"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=1800) as response:
        answer: dict[str, Any] = json.loads(response.read())
        return answer


def wait_ready(base: str, process: subprocess.Popen[bytes], limit: float) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with status {process.returncode}")
        try:
            with urllib.request.urlopen(f"{base}/v1/models", timeout=5):
                return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"the server did not answer within {limit:.0f} s")


def requests(clients: int, tokens: int) -> list[dict[str, Any]]:
    texts = [text for text, _chat in PROMPTS.values()]
    return [
        {
            "messages": [{"role": "user", "content": texts[i % len(texts)]}],
            "max_tokens": tokens,
            "temperature": 0.0,
        }
        for i in range(clients)
    ]


def burst(base: str, bodies: list[dict[str, Any]]) -> dict[str, Any]:
    """All `bodies` sent at once: aggregate tok/s, mean latency, answers."""
    answers: list[dict[str, Any] | None] = [None] * len(bodies)
    latency = [0.0] * len(bodies)
    start = time.perf_counter()

    def one(i: int) -> None:
        sent = time.perf_counter()
        answers[i] = post(f"{base}/v1/chat/completions", bodies[i])
        latency[i] = time.perf_counter() - sent

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    done = [a for a in answers if a is not None]
    if len(done) != len(bodies):
        raise RuntimeError("a request got no answer")
    generated = sum(a["usage"]["completion_tokens"] for a in done)
    return {
        "tok_s": generated / wall,
        "wall_s": wall,
        "mean_latency_s": sum(latency) / len(latency),
        "completion_tokens": generated,
        "texts": [a["choices"][0]["message"]["content"] for a in done],
    }


def run_server(
    name: str, command: list[str], port: int, bodies: list[dict[str, Any]], repeats: int
) -> dict[str, Any]:
    print(f"== {name}: {' '.join(command)}", file=sys.stderr, flush=True)
    env = {**os.environ, "PYTHONPATH": str(HERE.parent)}
    process = subprocess.Popen(command, env=env, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, process, 600)
        post(f"{base}/v1/chat/completions", {**bodies[0], "max_tokens": 8})
        runs = [burst(base, bodies) for _ in range(repeats)]
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
    out = {
        "name": name,
        "command": command,
        "tok_s": median([r["tok_s"] for r in runs]),
        "mean_latency_s": median([r["mean_latency_s"] for r in runs]),
        "runs": [{k: v for k, v in r.items() if k != "texts"} for r in runs],
        "texts": runs[-1]["texts"],
    }
    print(f"   {out['tok_s']:.1f} tok/s", file=sys.stderr, flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--drafts",
        default="none,ngram",
        help="specpipe's --draft values to run (comma-separated)",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    folder = str(model_folder(args.model, args.dtype))
    bodies = requests(args.clients, args.tokens)
    results = []
    port = free_port()
    # mlx_lm.server with the same BLAS as specpipe (models/blas.py routes
    # MLX's float32 products when it is imported before mlx)
    launch = (
        "import models, runpy, sys; sys.argv[0] = 'mlx_lm.server'; "
        "runpy.run_module('mlx_lm.server', run_name='__main__')"
    )
    peer = [sys.executable, "-c", launch, "--model", folder]
    peer += ["--port", str(port), "--max-tokens", str(args.tokens)]
    peer += ["--decode-concurrency", str(args.clients)]
    results.append(run_server("mlx_lm.server", peer, port, bodies, args.repeats))
    for draft in args.drafts.split(","):
        for batch in sorted({1, args.clients}):
            port = free_port()
            command = [sys.executable, "-m", "specpipe", "serve", "--model", folder]
            command += ["--port", str(port), "--max-tokens", str(args.tokens)]
            command += ["--draft", draft, "--max-batch", str(batch)]
            name = f"specpipe serve --draft {draft} --max-batch {batch}"
            results.append(run_server(name, command, port, bodies, args.repeats))
    peer_result = results[0]
    rows = []
    for r in results:
        same = sum(
            a == b for a, b in zip(r["texts"], peer_result["texts"], strict=True)
        )
        r["same_text_as_peer"] = same
        r["ratio_to_peer"] = r["tok_s"] / peer_result["tok_s"]
        rows.append(
            [
                r["name"],
                f"{r['tok_s']:.1f}",
                f"{r['mean_latency_s']:.2f}",
                f"{r['ratio_to_peer']:.2f}x",
                f"{same}/{len(bodies)}",
            ]
        )
    print(
        table(
            ["server", "tok/s (all clients)", "mean latency s", "vs mlx_lm", "same text"],
            rows,
        )
    )
    if args.out is not None:
        write_json(
            args.out,
            {
                "machine": machine_info(),
                "model": args.model,
                "folder": folder,
                "clients": args.clients,
                "tokens": args.tokens,
                "repeats": args.repeats,
                "command": " ".join(sys.argv),
                "results": results,
            },
        )


if __name__ == "__main__":
    main()
