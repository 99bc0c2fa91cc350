#!/bin/bash
# The H200 figures of bench/RESULTS.md: second of two device calls (see
# /work/shared/device/MLX_CUDA.md). Call 1 (carry .whlA: mlx, part_aa of
# mlx-cuda-13, the pure-Python wheels) ran:
#     mkdir -p $HOME/stash && cp .whlA/* $HOME/stash/
# Call 2 (carry .whlB: part_ab, tokq/ = the Qwen tokenizer files, src.tgz = the
# library + bench snapshot the CPU figures were taken with) runs this file:
#     bash .whlB/h200.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
S=$HOME/stash
REPO=$(pwd)
cat $S/part_aa .whlB/part_ab > $S/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl || exit 1
sha256sum $S/mlx_cuda_13-*.whl
python3 -m pip install -q --no-index --no-deps --no-compile --target $HOME/site $S/*.whl || exit 1
export PYTHONPATH=$HOME/site
mkdir -p /tmp/src && tar xzf .whlB/src.tgz -C /tmp/src || exit 1
cd /tmp/src
python3 -c "import mlx.core as mx; print(mx.__version__, mx.default_device())" || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader
R=/tmp/rand
python3 bench/random_weights.py --shape qwen2.5-0.5b --dtype bfloat16 --tokenizer $REPO/.whlB/tokq $R/qwen2.5-0.5b-bf16 || exit 1
python3 bench/random_weights.py --shape qwen2.5-1.5b --dtype bfloat16 --tokenizer $REPO/.whlB/tokq $R/qwen2.5-1.5b-bf16 || exit 1
export SPECPIPE_CACHE=/tmp/spcache
python3 bench/window.py --models $R/qwen2.5-0.5b-bf16,$R/qwen2.5-1.5b-bf16 --dtypes bfloat16 \
    --widths 1,2,3,4,5,7,9,17 --context 128 --repeats 20 --out $OUT/window-h200.json || echo "STEP FAILED: $?"
python3 bench/plain.py --models $R/qwen2.5-0.5b-bf16,$R/qwen2.5-1.5b-bf16 --dtypes bfloat16 \
    --tokens 256 --repeats 5 --no-assert --out $OUT/plain-h200.json || echo "STEP FAILED: $?"
python3 bench/speculative.py --target $R/qwen2.5-1.5b-bf16 --draft $R/qwen2.5-0.5b-bf16 --dtype bfloat16 \
    --tokens 128 --sweep-prompts code,chat,edit --ngram-widths 2,4,6 --no-assert \
    --out $OUT/speculative-h200.json --plot $OUT/speculative-h200.png || echo "STEP FAILED: $?"
