"""Where a speculative round's time goes on the device: phase timing and a
profile of one two-model and one ngram run (random weights; see h200_run.sh)."""

import cProfile
import json
import pstats
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from schemas.request import GenerationLimits
from specpipe.api import load

target, draft, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
prompt = "def merge_sorted(a, b):\n    " * 4
report = {}
for name, spec, k in (
    ("two-model", draft, 2),
    ("ngram", "ngram", 2),
    ("plain", None, None),
):
    for timing in (True, False):
        p = load(
            target, draft=spec, num_draft_tokens=k, phase_timing=timing, adaptive=False
        ).unwrap()
        p.generate(prompt, limits=GenerationLimits(max_tokens=8))
        r = p.generate(prompt, limits=GenerationLimits(max_tokens=64)).unwrap()
        report[f"{name}-{'timed' if timing else 'free'}"] = r.to_json()["stats"]
        print(name, timing, json.dumps(r.to_json()["stats"]), flush=True)
p = load(target, draft=draft, num_draft_tokens=2, adaptive=False).unwrap()
prof = cProfile.Profile()
prof.enable()
p.generate(prompt, limits=GenerationLimits(max_tokens=64))
prof.disable()
pstats.Stats(prof).sort_stats("cumtime").print_stats(25)
out.write_text(json.dumps(report, indent=1))
