#!/bin/sh
# The CPU figures of bench/RESULTS.md, in the order they were taken.
set -e
cd "$(dirname "$0")/.."
. .venv/bin/activate
export PYTHONUNBUFFERED=1
python bench/plain.py --models smollm2-135m-instruct --dtypes float32,bfloat16 --tokens 64 --repeats 5 \
    --out bench/results/plain-cpu-smollm2.json
python bench/plain.py --models qwen2.5-coder-0.5b-instruct --dtypes float32,bfloat16 --tokens 32 --repeats 3 \
    --out bench/results/plain-cpu-0.5b.json
# 1.5B bf16 decodes at ~0.3 tok/s on this shared 2-core machine: a reduced matrix
python bench/speculative.py --dtype bfloat16 --tokens 32 --prompts code,edit,chat \
    --widths 1,2,3,4,5,6 --mlxlm-widths 2,4,6 --short-widths 4 --ngram-widths 2,4,6 --ngram-prompts edit \
    --out bench/results/speculative-cpu.json --plot bench/results/speculative-cpu.png
# taken after the speculative run, when the machine was less loaded
python bench/plain.py --models qwen2.5-coder-1.5b-instruct --dtypes bfloat16 --tokens 24 --repeats 4 \
    --out bench/results/plain-cpu-1.5b.json
python bench/round_order.py
python bench/plain.py --models smollm2-135m-instruct --dtypes float32 --tokens 48 --repeats 5 \
    --out bench/results/plain-cpu-smollm2-head.json
