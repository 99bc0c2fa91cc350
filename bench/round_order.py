"""Round order, host-first (drafts read back before the verify graph is built;
the default since commit 5acca65) vs device-first (one read per round), for
two-model rounds of the real 1.5B + 0.5B pair in bf16, code prompt, k=4,
32 tokens, in the order A B B A after a warm-up of each.

    python bench/round_order.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import PROMPTS, RESULTS, machine_info, model_folder, specpipe_run


def main() -> None:
    from attrs import evolve

    import specpipe

    target = model_folder("qwen2.5-coder-1.5b-instruct", "bfloat16")
    draft = model_folder("qwen2.5-coder-0.5b-instruct", "bfloat16")
    pipeline = specpipe.load(str(target), draft=str(draft), num_draft_tokens=4, dtype="bfloat16").unwrap()
    host, device = evolve(pipeline, device_round=False), evolve(pipeline, device_round=True)
    ids = list(pipeline.encode(*PROMPTS["code"]).unwrap())
    specpipe_run(host, ids, 4, "two-model")
    specpipe_run(device, ids, 4, "two-model")
    out = {"machine": machine_info(), "runs": []}
    for name, pipe in [("host-first", host), ("device-first", device), ("device-first", device), ("host-first", host)]:
        run = specpipe_run(pipe, ids, 32, "two-model")
        out["runs"].append({"order": name, **run.summary()})
        print(f"{name}: {run.decode_tps:.3f} tok/s  {run.ms_per_round:.0f} ms/round  "
              f"tokens/round {run.acceptance_length:.2f}  cpu/wall {run.cpu_s / run.wall_s:.2f}", flush=True)
    (RESULTS / "round-order-cpu.json").write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
