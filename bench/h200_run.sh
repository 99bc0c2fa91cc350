#!/bin/bash
# The H200 figures of bench/RESULTS.md, run from the working tree on the lent
# machine (MLX CUDA backend). Two device calls before this one put the wheels
# in $HOME/stash (see ../shared/device/MLX_CUDA.md):
#   (the folders are ignored, so a new checkout makes them again, in seconds: pip download --no-deps
#    --only-binary=:all: --python-version 3.12 --implementation cp, platforms manylinux_2_35_x86_64 and
#    manylinux2014_x86_64, of mlx==0.32.4 and mlx-cuda-13==0.32.4, the latter split at 46m into part_aa
#    (.whlA) and part_ab (.whlB), with attrs cattrs returns gguf jinja2 markupsafe tqdm typing_extensions
#    pyyaml in .whlA: setup-min installs every wheel in the stash)
#   call 1 (carry .whlA): mkdir -p $HOME/stash && cp .whlA/* $HOME/stash/
#   call 2 (carry .whlB, with part_ab and tokq/ = the Qwen tokenizer files):
#       bash bench/h200_run.sh setup plain
#   call 3: bash bench/h200_run.sh spec mtp
# (2026-11-30, second session: call 2 `setup adaptive`, call 3 `adaptive-ngram mtp mtp-sampled`;
#  fifth session: call 2 `setup adaptive-ngram-best mtp-dense`, call 3 `adaptive-best`;
#  2026-12-01: call 2 `setup-min mtp-rows`; fourth session: call 2 `setup-min mtp-wide`, then `setup-min mtp-compiled`, `setup-min mtp-ab`, `setup adaptive-ngram adaptive-nolm`, then with REPEATS=7)
# (2026-12-02, seventh session: call 2 `setup-min mtp-steps` on two leases, `setup-min step-probe`,
#  `setup-min gdn`, then the `gdn-mtp` step's probe and one mtp.py run per kernel setting by hand)
# (eighth session: `ROWS=1,8 setup-min fused`, `ROWS=1,2,8 setup-min fused`, then fused_probe.py and
#  the `fused-mtp` step's mtp.py commands with --depths 3 / 1,3 by hand, PYTHONPATH=$HOME/site)
# (ninth session: `SHAPES=qwen3-next ROWS=1,2,8 PAIR_AB=1 setup-min fused gdn`, then on two more leases
#  `SHAPES=qwen3-next ROWS=1,2 PAIR_AB=1 REPEATS=15 setup-min fused` + `SAMPLINGS=greedy ROWS=1 fused-mtp`,
#  `ROWS=1 REPEATS=15 LIMIT=230 setup-min fused` + `fused-ab` + `SAMPLINGS=greedy ROWS=1 DEPTHS=1,3,5 fused-mtp`;
# (tenth session, four leases: `setup-min`, then fused_probe.py --rows 1 --samplings greedy by hand
#  with --prefetch / --stream-hints / --row-prefetch / --pair-rows, round_check.py --head fr / full,
#  `SAMPLINGS=greedy ROWS=1 DEPTHS=1,3,5 fused-mtp` and the `interleave` step;
#  the next: `setup-min interleave`, then `ROWS=1 PROBE_SAMPLINGS=greedy LIMIT=240 fused`, the same with
#  PROBE_FLAGS=--fast-sincos PROBE_TAG=-fastsincos (attention's query stretch), then --narrow-loads)
# (eleventh session, three leases: `setup-min parts`; fused_probe.py --rows 1 --samplings greedy with and
#  without --fast-sincos and round_parts.py by hand; the probe again, `interleave`, then mtp.py --steps fused)
# (next: fused_probe.py --rows 3 --samplings greedy,qwen --agree-only: is the three-row chain3 mismatch
#  the window form's only (`chain3_kv_out`), and sampled too?)
# (twelfth session: `setup-min device`, the draft phase's device time by Nsight Compute)
# (thirteenth session, five leases: fused_probe.py --agree-only --rows 1,3 --samplings greedy,qwen,
#  draft_device.py --check --sampling qwen, `SAMPLING=qwen|greedy DEPTHS=1,2,3 device`, fused_probe.py
#  --rows 1 --samplings qwen (segments); next: `setup-min switches`, the switches left off, on and off)
# (fourteenth session, three leases: `setup-min switches`, `setup-min draw`, `setup-min tight` (its
#  agreement run cut by the lease's end); next: the agreement run of `tight` with the defaults)
# (fifteenth session, two leases: `setup-min switches` with SETS of EVICT_ALL / COMPACT_PRODUCT, then
#  `pcsamp`; `setup-min switches` with STAGE_AHEAD / EVICT_ALL / FOLD_ROUTER, `agree` with
#  PROBE_FLAGS="--draw-heads-k 2" and "--evict-all", SAMPLINGS=qwen ROWS=1,3)
# (sixteenth session, one lease: `setup-min deep` (DEEP_LOADS timed, then `agree` with --deep-loads;
#  the step removed with the switch), `agree` with PROBE_FLAGS=--fold-router PROBE_TAG=-fold
#  SAMPLINGS=greedy,qwen ROWS=1,3, `SETS="none FOLD_ROUTER" NO_AGREE=1 DEPTHS=2,3 switches`, then
#  `SAMPLINGS="greedy qwen" DEPTHS=1,2,3 REPEATS=20 interleave`; a second lease: `setup-min merge` with
#  SETS "none TREE_MERGE EAGER_IDS TREE_MERGE,EAGER_IDS" and PROBE_FLAGS "--tree-merge --eager-ids",
#  before TREE_MERGE went on and the eager id loads became the only form; a third lease: `setup-min whole`,
#  its agreement run cut by the session's device time)
# (seventeenth session, one lease: `setup-min early` (EARLY_WEIGHTS, COPY_AROUND, PARALLEL_DERIVE and
#  TIGHT_WHOLE timed, derived rounds with all four checked against host-built ones; no gain, the
#  switches and the `early`, `early-agree` and `whole` steps removed), then draft_device.py
#  --depths 2 --sampling greedy by hand on this tree and on e3c51bb's in turn, and with --cache-control none;
#  two more leases: bench/mtp.py --draft-ahead by hand (greedy, qwen; --rows 1,3; float32);
#  next: `SAMPLINGS=" " bash bench/h200_run.sh setup-min batched-f32` (the install alone, then the step))
# (eighteenth session: `setup-min precision batched-f32` (MLX's TF32 float32 products on and off),
#  then `keep` (KEEP_FC / KEEP_QKV / KEEP_O timed, greedy), then SAMPLINGS=qwen with the best set;
#  bench/batch_probe.py and bench/gather_probe.py by hand (the MoE gather fault); a last lease ran
#  bench/device_parity.py on three families at once and printed nothing in 160 s; next: `setup-min parity`,
#  then `keep` (KEEP_HEAD against the defaults), with SAMPLINGS="greedy qwen")
# (twentieth session: `SETS="none KEEP_HEAD KEEP_HEAD,KEEP_HEAD_MB=36,-KEEP_FC,-KEEP_O" SAMPLINGS="greedy
#  qwen" DEPTHS=2,3 setup-min keep`, then `SETS="none BLOCKS=132" ... keep` and `parity` (no gain: KEEP_HEAD
#  removed; the dense family's CPU leg crashed); then bench/cpu_streams_probe.py and device_parity.py by hand
#  with SPECPIPE_CPU_THREADS=1 / 16, --devices cpu,gpu, --fresh-reference, --set tie_word_embeddings=false;
#  `setup-min streams`; a last lease `setup-min barrier` (its agreement run past its limit: fused_probe.py
#  --agree-only --acq-rel-barrier by hand, --rows 1 then --rows 3); next: `setup-min barrier-bisect`)
# (twenty-first session: `MASKS="0x3FF 0x1F 0x3E0" setup-min barrier-bisect` (the step since removed), then
#  fused_probe.py --rows 3 --agree-only with the defaults by hand: the same tokens as every mask; then
#  `SETS="none ACQ_REL_BARRIER" SAMPLINGS="greedy qwen" NO_AGREE=1 DEPTHS=2,3 switches` and fused_probe.py
#  --rows 1,3 --agree-only with and without --acq-rel-barrier: ACQ_REL_BARRIER on by default since; then
#  `TF32S=0 ROWS=1,3 setup-min batched-f32` and bench/mtp.py's --sampling qwen twin by hand; then
#  `CONTEXT=32768|4096 ... device` (attention found to dominate long contexts), then the same with
#  SWITCHES=ATT_UNROLL=8 at 32768, 4096, 48, and fused_probe.py --context 2048 --att-unroll 8 by hand:
#  ATT_UNROLL=8 on by default since)
# (twenty-second session, three leases: `setup-min` then `switches` with BLOCK=512 (could not launch: 254
#  registers at Qwen3-Next's sizes), then SETS of none / ATT_UNROLL=1 / -PACKED_KV / ATT_UNROLL=4 at CONTEXT=48,
#  4096 and 32768, fused_probe.py --context 2048 --att-unroll 4 --agree-only by hand: ATT_UNROLL=4 since;
#  next: `setup-min spread` (ATT_SPREAD with eight positions per warp against the defaults, then its drafts))
# (twenty-third session: no device lent; next: `setup-min grouped` (ATT_GROUPED's drafts at 4,096 positions,
#  then its time against the defaults at 32,768, 4,096 and 48), then `SETS="none BF16_SHIFTS" SAMPLINGS="greedy
#  qwen" DEPTHS=2,3 CONTEXT=48 NO_AGREE=1 switches`, then `spread`)
# (twenty-seventh session, one lease on an H100 (asked for an H200): `setup-min` then `SETS="none HEAD_WARM=192"
#  SAMPLINGS=greedy NO_AGREE=1 DEPTHS=2,3 CONTEXT=48 REPEATS=8 LIMIT=200 switches` (HEAD_WARM since removed),
#  `SETS=none SAMPLINGS=qwen ...` the same, draft_device.py --experts 512 by hand, `NO_AGREE=1 REPEATS=8 copy`
#  with COPY_UNROLL=4 then off by default, and its fused_probe.py --copy-unroll 4 agreement run by hand)
# (twenty-eighth session, one lease on an H100 (asked for an H200): `setup-min piped` (PIPE_PRODUCTS and
#  PIPE_HEAD timed against the defaults, greedy, depths 2 and 3, 48 positions: slower, both removed with the
#  step), then bench/phase_probe.py --contexts 48 --sets none --samplings greedy --heads fr,full by hand)
# (twenty-ninth session, one lease on an H100 (asked for an H200): `setup-min`, then `SETS="none ATT_SHARE=64
#  FOLD_BATCH" SAMPLINGS=greedy NO_AGREE=1 DEPTHS=2,3 CONTEXT=48 REPEATS=8 LIMIT=200 switches`, `agree` with
#  PROBE_FLAGS="--att-share 64 --context 40|200" and "--context 40", the same SETS (none, ATT_SHARE=64) with
#  SAMPLINGS=qwen, then CONTEXT=4096 and 48 with DEPTHS=2, `CONTEXTS=48 PSETS="none;ATT_SHARE=64" phases`:
#  ATT_SHARE=64 on by default since, FOLD_BATCH removed; on a second lease `setup-min`, `SETS="none ROW_PREFETCH"
#  SAMPLINGS=greedy ...` and `EXPERTS=512 SETS=none SAMPLINGS="greedy qwen" ...`: ROW_PREFETCH removed)
# (next, on an H200: `setup-min retime` (the defaults' cut, both samplings, 64 and 512 experts), then
#  `SETS="GATE_LATE SHARED_EARLY GATE_LATE,SHARED_EARLY ATT_SHARE=0" SAMPLINGS="greedy qwen" NO_AGREE=1 DEPTHS=2,3
#  CONTEXT=48 REPEATS=8 switches`, `EXPERTS=512 SETS="GATE_LATE,SHARED_EARLY"` the same, then
#  `ROWS=1,2 PROBE_FLAGS="--gate-late --shared-early --context 40" PROBE_TAG=-late LIMIT=280 agree` (their drafts
#  must equal the defaults' exactly: the same products in the same order; two rows: GATE_LATE's gates wait
#  for attention's phase at one and two rows, not at three), the same with --context 2048 (q/k/v keeps them))
# (thirtieth session: no device lent; prepared FOLD_FIXED (the folded router's block shares summed as
#  fixed-point integers: Qwen3-Next's 512 experts fold too) and TOPK_SPLIT (that router's top-k in two
#  ranking passes). Next, first on a lease (the realistic layer's cut, the one most likely below 2x):
#  call 2 `bash bench/h200_run.sh setup-min fixed` (512 experts: none / FOLD_FIXED / FOLD_FIXED,TOPK_SPLIT,
#  greedy, depths 2 and 3; then none / FOLD_FIXED at 64), then `SAMPLINGS=qwen NO_64=1 ... fixed`, then
#  `PART=agree ... fixed` (TOPK_SPLIT's drafts must equal FOLD_FIXED's alone exactly; FOLD_FIXED's agree with
#  the float32 MLX step as the defaults' do, near ties aside); then the GATE_LATE / SHARED_EARLY plan above,
#  with the 512-expert sets on top of the better of these)
# (thirty-first session: FOLD_FIXED, TOPK_SPLIT, GATE_LATE and SHARED_EARLY timed on an H100 at 64 and 512 experts,
#  no gain: removed with their code and the `fixed` step. Next, first on an H200: call 2 `bash bench/h200_run.sh
#  setup-min retime` (the defaults' cut at 64 and 512 experts, greedy and Qwen's sampling, depths 2 and 3: the
#  realistic 512-expert layer has never been timed on an H200))
# (thirty-second session, two H100 leases (asked for an H200): the DFlash / DSpark tests on the GPU by hand, then
#  bench/quant_probe.py --quick: MLX's single-group quantized product found wrong, regrouped in models/parallel.py.
#  Next, on any GPU: `setup-min quant` (the fix, gather_qmm, 5-bit products: a GGUF's kept Q5_* blocks); first on an H200: `setup-min retime`, or with
#  little device time left `EXPERTS=512 SETS=none SAMPLINGS=greedy NO_AGREE=1 DEPTHS=2,3 CONTEXT=48 REPEATS=8
#  bash bench/h200_run.sh setup-min switches` alone)
# (thirty-third session, three H100 leases (asked for an H200): `setup-min quant` (the regroup refused: repeat's
#  zero-stride scales; made fresh arrays, then the DFlash / DSpark tests 140 of 140), then pytest on four model
#  test files by hand, and the bisection of a wrong hybrid MoE prefill (now `kernels`): weights made row-major at
#  load. Next, on any GPU: `setup-min kernels` (the fix: `hybrid` must show 0 bad), then pytest
#  tests/models/test_qwen3_next.py tests/models/test_qwen3_5_moe.py -k 70 by hand; first on an H200: `setup-min
#  retime`, or the 512-expert `switches` line above alone)
# (thirty-fourth session, two H100 leases (asked for an H200): `setup-min kernels` (hybrid 0 bad) and the -k 70
#  tests (pass), then the suite by hand in batches (bench/RESULTS.md); a third call carried .whlC (transformers
#  5.23, tokenizers 0.23.3, safetensors 0.8.0, regex: the suite's pins; leave the machine's huggingface_hub,
#  2.4 needs httpx2: `rm -rf $HOME/site/huggingface_hub*` after setup). Next, first on an H200: `setup-min
#  retime`; on any GPU, with .whlC: pytest tests/models/test_mtp_cuda.py (the NVRTC option, checked off the GPU
#  with 13.0 only))
# (thirty-fifth session, five leases asked for an H200, an H100 each time: with .whlC, `setup-min` then
#  pytest tests/models/test_mtp_cuda.py (85 of 86: the -ATT_PIPE arm spills 4 bytes on NVRTC 13.0, allowed
#  since), the kept-GGUF tests (test_gguf_quant, test_gguf_gemma4, test_gemma4_assistant: 117 of 118, the
#  one fixed); then six H200-only tries that started no machine (~90 s of device time each); next, on an
#  H200: `setup-min retime` as above, or with little time left the 512-expert `switches` line alone;
#  nothing is waiting for an H100)
# (thirty-sixth session: an H200 at the third try: `EXPERTS=512 ... setup-min switches` (the 512-expert cut:
#  greedy 1.96x / 1.98x, Qwen's sampling 1.91x / 1.92x at depths 2 / 3), the 64-expert `switches` line, then
#  phase_probe.py --experts 512 / 64 by hand (the 512-expert top-k 8.5 us of a 100.8 us FR-Spec step);
#  on an H100: TOPK_WARPS's agree / phase_probe by hand (20.7 us against 9.0: reverted), then
#  `EXPERTS=512 SAMPLINGS=greedy setup-min pcsamp` (the top-k's instructions ~2.6 us of the stretch's 9);
#  next, on any GPU: `setup-min`, then python3 bench/phase_probe.py --experts 512 --contexts 48 --sets none
#  --samplings greedy,qwen --heads fr --out $OUT/phase-probe-e512.json (the stretch split by the stamps added
#  since: topk_logits / topk_choice / topk_after), then a top-k that keeps its code small; on an H200 the cut)
# (thirty-seventh session: seven requests started no machine (~1,025 s of device time in all), then an
#  H100: `setup-min redux` (REDUX_TOPK / SHARED_CDF: the 512-expert top-k 7.7 -> 1.9 us, drafts agree),
#  `EXPERTS=512 SETS="none REDUX_TOPK,SHARED_CDF" SAMPLINGS="greedy qwen" NO_AGREE=1 DEPTHS=2 CONTEXT=48
#  REPEATS=5 LIMIT=95 switches` (2.07x -> 2.13x greedy, 2.06x -> 2.10x sampled), then `EXPERTS=64 ROWS=1,3
#  PROBE_FLAGS="--redux-topk --shared-cdf" agree`; both switches on since. Next, on an H200 (the goal's
#  machine): call 2 `bash bench/h200_run.sh setup-min retime` (the new defaults' cut, 64 and 512 experts,
#  greedy and Qwen's sampling, depths 2 and 3))
# (thirty-eighth session: eight requests started no machine, one an H100: `EXPERTS=512 SETS="none
#  ROUTER_ROWS,DRAW_RUNS ROUTER_ROWS,DRAW_RUNS,ATT_EARLY" SAMPLINGS="greedy qwen" NO_AGREE=1 DEPTHS=2
#  CONTEXT=48 REPEATS=6 LIMIT=100 setup-min switches`, phase_probe.py with those sets by hand, then
#  `SETS="none DRAW_RUNS" SAMPLINGS=qwen ... switches` and `SAMPLINGS=qwen ROWS=1,3 PROBE_FLAGS=--draw-runs
#  agree`: ROUTER_ROWS and ATT_EARLY slower (removed), DRAW_RUNS on. Next, on an H200: call 2
#  `EXPERTS=512 SETS=none SAMPLINGS="greedy qwen" NO_AGREE=1 DEPTHS=2,3 CONTEXT=48 REPEATS=8 LIMIT=120
#  bash bench/h200_run.sh setup-min switches` (the defaults' cut on the goal's machine))
# (thirty-ninth session: the fifth request got an H200: `EXPERTS=512 SETS=none SAMPLINGS="greedy qwen"
#  NO_AGREE=1 DEPTHS=2,3 CONTEXT=48 REPEATS=8 LIMIT=150 setup-min switches`, then `EXPERTS=512 CONTEXTS=48
#  PSETS=none PSAMPLINGS=greedy,qwen HEADS=fr,full LIMIT=170 PROBE_TAG=-e512 phases`: 1.999x greedy, 1.98x
#  sampled drafting 2; six later requests started no machine. Next, FC_SPLIT and FAST_PROLOGUE (prepared,
#  off): call 2 `EXPERTS=512 SETS="none FC_SPLIT FAST_PROLOGUE FC_SPLIT,FAST_PROLOGUE" SAMPLINGS=greedy
#  NO_AGREE=1 DEPTHS=2,3 CONTEXT=48 REPEATS=8 LIMIT=150 bash bench/h200_run.sh setup-min switches`, call 3
#  the same with SAMPLINGS=qwen (no setup-min), call 4 `EXPERTS=64 ROWS=1,2 SAMPLINGS=greedy,qwen
#  PROBE_FLAGS=--fc-split PROBE_TAG=-fcsplit LIMIT=220 bash bench/h200_run.sh agree` and, for S in greedy,
#  qwen, `python3 bench/draft_device.py --check --rows 1,3 --depths 1,2,3 --sampling S
#  --kernel-switches=FAST_PROLOGUE,FC_SPLIT`)
# (fortieth session, no device: prepared, off, DOWN_AHEAD, O_AHEAD and STAGE_BATCH (nvdisasm: the down
#  product's loads in two DRAM round trips a row, residuals read after the sums, stagings' loads one L2
#  round trip after another) and WHOLE_ROLLED. Next: call 2 `EXPERTS=512 SETS="none
#  FC_SPLIT,FAST_PROLOGUE,DOWN_AHEAD,O_AHEAD,STAGE_BATCH DOWN_AHEAD,O_AHEAD,STAGE_BATCH FC_SPLIT,FAST_PROLOGUE"
#  SAMPLINGS="greedy qwen" NO_AGREE=1 DEPTHS=2 CONTEXT=48 REPEATS=8 LIMIT=120 bash bench/h200_run.sh
#  setup-min switches`; call 3 `EXPERTS=64 ROWS=1,2 SAMPLINGS=greedy,qwen PROBE_FLAGS="--fc-split
#  --down-ahead --o-ahead --stage-batch" PROBE_TAG=-ahead LIMIT=200 bash bench/h200_run.sh agree &&
#  SWITCHES=FAST_PROLOGUE,FC_SPLIT,DOWN_AHEAD,O_AHEAD,STAGE_BATCH DEPTHS=1,2 LIMIT=120 bash
#  bench/h200_run.sh derive-check`)
# (forty-first session: no device lent (twelve requests started no machine, three refused). Next: call 1 as
#  above, then call 2 (carry .whlB) `bash bench/h200_run.sh setup-min plan`: the fortieth session's calls 2
#  and 3 in one, in priority order, each part only where the call has time left (BUDGET, 540 s))
# (forty-second session: the sixth request for an H200 got an H100; `BUDGET=520 setup-min plan` (that step since
#  removed): its first two runs, the defaults, hit LIMIT=60 on the fresh machine (the first ncu run compiles
#  MLX's kernels: give a fresh machine's first run 150 s), the agreement run too; then `EXPERTS=512
#  SETS=none SAMPLINGS="greedy qwen" NO_AGREE=1 DEPTHS=2 CONTEXT=48 REPEATS=8 LIMIT=110 switches` and the
#  sets apart, and SETS=none at DEPTHS=3: no switch faster (FC_SPLIT,FAST_PROLOGUE slower), five removed,
#  FAST_PROLOGUE kept (off) as it was never timed apart from FC_SPLIT. Next, on the first lease (H200 or
#  H100): call 2 `EXPERTS=512 SETS="none FAST_PROLOGUE" SAMPLINGS="greedy qwen" NO_AGREE=1 DEPTHS=2
#  CONTEXT=48 REPEATS=8 LIMIT=150 bash bench/h200_run.sh setup-min switches`, then `SWITCHES=FAST_PROLOGUE
#  ROWS=1,3 DEPTHS=1,2 LIMIT=90 bash bench/h200_run.sh derive-check`)
# (forty-third session: three H100 leases: that call 2 (FAST_PROLOGUE no faster: removed), then
#  `EXPERTS=512 CONTEXTS=48 PSETS="none;DIAG_NO_DRAW,DIAG_NO_SORT;DIAG_NO_DRAW" PSAMPLINGS=greedy,qwen HEADS=fr
#  PROBE_TAG=-diag LIMIT=330 phases` (the sampled step's extra time is its draw's and sort's code), then
#  `EXPERTS=512 SETS="none TRIM_CODE" SAMPLINGS="greedy qwen" NO_AGREE=1 DEPTHS=2 CONTEXT=48 REPEATS=8
#  LIMIT=150 setup-min switches` and `SAMPLINGS=greedy,qwen ROWS=1,3 PROBE_FLAGS=--trim-code PROBE_TAG=-trim
#  LIMIT=200 agree`: TRIM_CODE ~10 us faster a launch, on since. TRIM_MORE prepared (off). Next, on the
#  first lease (H200: the goal's figure; H100: TRIM_MORE's choice): call 2 `EXPERTS=512 SETS="none
#  -TRIM_CODE TRIM_MORE" SAMPLINGS="greedy qwen" NO_AGREE=1 DEPTHS=2 CONTEXT=48 REPEATS=8 LIMIT=150 bash
#  bench/h200_run.sh setup-min switches`, call 3 `SAMPLINGS=greedy,qwen ROWS=1,3 PROBE_FLAGS=--trim-more
#  PROBE_TAG=-trimmore LIMIT=200 bash bench/h200_run.sh agree` and, on an H200, `EXPERTS=512 SETS=none
#  SAMPLINGS="greedy qwen" NO_AGREE=1 DEPTHS=3 CONTEXT=48 REPEATS=8 LIMIT=120 ... switches` (the
#  switches step's file names carry the depths since))
# (forty-fourth session: two H100 leases: that call 2 and the agree call (LIMIT=330: 200 s cut the first on a
#  fresh machine), then `EXPERTS=512 SETS="TRIM_MORE none" ... DEPTHS=3 ... setup-min switches`: TRIM_MORE
#  faster in all eight pairs, the same drafts; both TRIM switches removed, TRIM_MORE's code the only form.
#  Next, on an H200 (the goal's figure), one call after the stash call: `EXPERTS=512 SETS=none
#  SAMPLINGS="greedy qwen" NO_AGREE=1 DEPTHS=2,3 CONTEXT=48 REPEATS=8 LIMIT=240 bash bench/h200_run.sh
#  setup-min switches` (a first ncu run compiles: give it 150 s or more); two more requests got H100s: one given back, one ran the MTP suites
#  on the GPU, `PYTHONPATH=$HOME/site MLX_ENABLE_TF32=0 python3 -m pytest -q tests/specpipe/test_mtp.py
#  tests/specpipe/test_mtp_derived.py tests/specpipe/test_mtp_ahead.py`: 32 passed)
# (forty-fifth session: fourteen requests for an H200 started no machine; the next call stays the one above.
#  With less than ~600 s of device time left, call 2 with DEPTHS=2 LIMIT=170 alone, the goal's depth)
# (forty-sixth session: eight requests for an H200: six started no machine, two got H100s (a call naming
#  nvidia-h200 may run on an H100; needs_h200 is only for work that cannot fit one). The first was given back;
#  the second ran the GLM-5, GLM-4.5 and Gemma-3 model tests on the GPU (after `setup-min`, carry .whlB):
#  `PYTHONPATH=$HOME/site python3 -m pytest -q tests/models/test_glm_moe_dsa.py`, 34 passed; test_glm4_moe.py
#  39 passed; test_gemma3.py 9 passed. The next call stays the one above)
# (forty-seventh session: thirteen requests for an H200: three got H100s (given back), ten started no
#  machine (cooldowns, 75-180 s of device time each); 253 s left, too little to start one. The next call stays the one above)
# (forty-eighth session: fourteen requests for an H200 between 18:39 and 20:35 UTC, none started a machine
#  (cooldowns, 15-181 s each; 961 s of device time spent); the last was told no machine is lent at present.
#  The next call stays the one above)
# (forty-ninth session: fifteen requests for an H200 between 21:10 and 23:39 UTC: two got H100s (given back at
#  once), ten started no machine (90-180 s each), three fell in cooldowns; 1,399 s of device time spent, 401 s
#  left. A new checkout lacks .whlA/.whlB: the recipe above rebuilt them in under a minute. The next call
#  stays the one above)
# (fiftieth session, 2026-12-08: eleven requests for an H200 between 00:33 and 01:43 UTC, none started a
#  machine (five "could not be started", 90-180 s each; six in cooldowns, 15 s each); 961 s of device time
#  spent; then the device said no machine is lent at present and not to call again. The next call stays
#  the one above)
set -uo pipefail
export PYTHONUNBUFFERED=1
S=$HOME/stash
R=/tmp/rand
export PYTHONPATH=$HOME/site
export SPECPIPE_CACHE=/tmp/spcache
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)  # Nsight Compute
for step in "$@"; do
  case $step in
  setup|setup-min)
    cat $S/part_aa .whlB/part_ab > $S/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl || exit 1
    rm -f $S/part_aa
    python3 -m pip install -q --no-index --no-deps --no-compile --target $HOME/site $S/*.whl || exit 1
    python3 -c "import mlx.core as mx; print(mx.__version__, mx.default_device())" || exit 1
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    [ "$step" = setup-min ] && continue  # no random Qwen2.5 folders (MTP steps build their own model)
    mkdir -p $HOME/tokq && cp .whlB/tokq/* $HOME/tokq/
    python3 -c "import mlx_lm; print('mlx-lm', mlx_lm.__version__)" || echo "mlx-lm not importable"
    python3 bench/random_weights.py --shape qwen2.5-0.5b --dtype bfloat16 --tokenizer $HOME/tokq $R/qwen2.5-0.5b-bf16 || exit 1
    python3 bench/random_weights.py --shape qwen2.5-1.5b --dtype bfloat16 --tokenizer $HOME/tokq $R/qwen2.5-1.5b-bf16 || exit 1
    ;;
  plain)
    python3 bench/window.py --models $R/qwen2.5-0.5b-bf16,$R/qwen2.5-1.5b-bf16 --dtypes bfloat16 \
        --widths 1,2,3,4,5,7,9,17 --context 128 --repeats 20 --out $OUT/window-h200.json || echo "STEP FAILED: $?"
    python3 bench/plain.py --models $R/qwen2.5-0.5b-bf16,$R/qwen2.5-1.5b-bf16 --dtypes bfloat16 \
        --tokens 256 --repeats 3 --no-assert --out $OUT/plain-h200.json || echo "STEP FAILED: $?"
    ;;
  spec)
    python3 bench/speculative.py --target $R/qwen2.5-1.5b-bf16 --draft $R/qwen2.5-0.5b-bf16 --dtype bfloat16 \
        --tokens 128 --sweep-prompts code,chat,edit --ngram-widths 2,4,6 --no-assert \
        --out $OUT/speculative-h200.json --plot $OUT/speculative-h200.png || echo "STEP FAILED: $?"
    ;;
  adaptive)
    python3 bench/adaptive.py --target $R/qwen2.5-1.5b-bf16 --draft $R/qwen2.5-0.5b-bf16 --dtype bfloat16 \
        --tokens 128 --widths 1,2,3,4,6 --max-depth 6 --mlxlm-widths 2,4,6 --repeats ${REPEATS:-3} --no-assert \
        --out $OUT/adaptive-h200.json --plot $OUT/adaptive-h200.png || echo "STEP FAILED: $?"
    ;;
  adaptive-nolm)  # two-model adaptive without the mlx-lm peer (its wheel not carried)
    python3 bench/adaptive.py --target $R/qwen2.5-1.5b-bf16 --draft $R/qwen2.5-0.5b-bf16 --dtype bfloat16 \
        --tokens 128 --widths 1,2,4 --max-depth 6 --no-mlxlm --repeats ${REPEATS:-3} --no-assert \
        --out $OUT/adaptive-h200.json --plot $OUT/adaptive-h200.png || echo "STEP FAILED: $?"
    ;;
  adaptive-best)  # two-model adaptive with the mlx-lm peer, fastest repeat per configuration
    python3 bench/adaptive.py --target $R/qwen2.5-1.5b-bf16 --draft $R/qwen2.5-0.5b-bf16 --dtype bfloat16 \
        --tokens 128 --widths 1,2 --max-depth 6 --mlxlm-widths 2,4 --repeats ${REPEATS:-7} --peer-repeats 1 \
        --estimator best --no-assert --out $OUT/adaptive-h200-best.json --plot $OUT/adaptive-h200-best.png || echo "STEP FAILED: $?"
    ;;
  adaptive-ngram-best)
    python3 bench/adaptive.py --target $R/qwen2.5-1.5b-bf16 --draft ngram --dtype bfloat16 \
        --tokens 128 --widths 2,4,6,8 --max-depth 8 --no-mlxlm --repeats ${REPEATS:-9} --estimator best --no-assert \
        --out $OUT/adaptive-ngram-h200-best.json --plot $OUT/adaptive-ngram-h200-best.png || echo "STEP FAILED: $?"
    ;;
  mtp-dense)  # Qwen3.5-27B's dense MTP layer; its target cut to 8 layers (the draft chain does not read them)
    for v in 151936 248320; do
      python3 bench/mtp.py --shape qwen3.5-27b --layers 8 --vocab $v --dtype bfloat16 --tokens 32 --depths 1,3 \
          --fr-size 32768 --sampling qwen --rows 1,32,128 --out $OUT/mtp-dense-$v-sampled-h200.json || echo "STEP FAILED: $?"
    done
    python3 bench/mtp.py --shape qwen3.5-27b --layers 8 --vocab 151936 --dtype bfloat16 --tokens 32 --depths 1,3 \
        --fr-size 32768 --rows 1,32,128 --out $OUT/mtp-dense-151936-h200.json || echo "STEP FAILED: $?"
    ;;
  gate-ab)  # adaptive with its gate closed vs plain, interleaved pairs in random order
    python3 bench/gate_ab.py --target $R/qwen2.5-1.5b-bf16 --draft $R/qwen2.5-0.5b-bf16 --dtype bfloat16 \
        --tokens 128 --pairs ${PAIRS:-15} --out $OUT/gate-ab-h200.json || echo "STEP FAILED: $?"
    ;;
  ngram-ab)  # adaptive n-gram vs a fixed width (AGAINST, default 4), interleaved pairs
    python3 bench/gate_ab.py --target $R/qwen2.5-1.5b-bf16 --draft ngram --dtype bfloat16 --max-depth 8 \
        --tokens 128 --pairs ${PAIRS:-15} --against ${AGAINST:-4} --out $OUT/ngram-ab-h200.json || echo "STEP FAILED: $?"
    ;;
  topk)  # blockwise top-k in the sampled draw, and the MTP chain with it
    python3 bench/sampling_probe.py --rows 1,32,128 --out $OUT/sampling-probe-topk-h200.json || echo "STEP FAILED: $?"
    python3 bench/mtp.py --shape qwen3.5-27b --layers 8 --vocab 151936 --dtype bfloat16 --tokens 32 --depths 1,3 \
        --fr-size 32768 --sampling qwen --rows 1,32,128 --out $OUT/mtp-dense-151936-sampled-topk-h200.json || echo "STEP FAILED: $?"
    ;;
  topk-ab)  # the MTP chain with one-partition and blockwise top-k, both head sizes, one lease
    for v in 151936 248320; do i=0; for st in one auto one auto; do i=$((i+1))
      echo "vocab $v top-k $st ($i)"
      python3 bench/mtp.py --shape qwen3.5-27b --layers 4 --vocab $v --dtype bfloat16 --tokens 16 --depths 1,3 \
          --fr-size 32768 --sampling qwen --rows 1,32,128 --top-k-stages $st \
          --out $OUT/mtp-dense-$v-$st-$i.json | grep '"rows"' || echo "STEP FAILED: $?"
    done; done
    ;;
  adaptive-ngram)
    python3 bench/adaptive.py --target $R/qwen2.5-1.5b-bf16 --draft ngram --dtype bfloat16 \
        --tokens 128 --widths 2,4,6,8 --max-depth 8 --no-mlxlm --repeats ${REPEATS:-3} --no-assert \
        --out $OUT/adaptive-ngram-h200.json --plot $OUT/adaptive-ngram-h200.png || echo "STEP FAILED: $?"
    ;;
  mtp-sampled)
    python3 bench/mtp.py --layers 12 --experts 64 --dtype bfloat16 --tokens 64 --depths 1,2,3 \
        --fr-size 32768 --sampling qwen --out $OUT/mtp-sampled-h200.json || echo "STEP FAILED: $?"
    ;;
  round-order)
    python3 bench/round_order.py --target $R/qwen2.5-1.5b-bf16 --draft $R/qwen2.5-0.5b-bf16 --widths 1,2,4 \
        --tokens 128 --out $OUT/round-order-h200.json || echo "STEP FAILED: $?"
    ;;
  gemm)
    python3 bench/gemm_probe.py --out $OUT/gemm-probe-h200.json || echo "STEP FAILED: $?"
    python3 bench/gemm_probe.py --fused --rows 1,2,5,8 --out $OUT/gemm-probe-fused-h200.json || echo "STEP FAILED: $?"
    ;;
  mtp-rows)
    python3 bench/mtp.py --layers 12 --experts 64 --dtype bfloat16 --tokens 32 --depths 1,3 \
        --fr-size 32768 --sampling qwen --rows 1,8,32 --out $OUT/mtp-rows-sampled-h200.json || echo "STEP FAILED: $?"
    python3 bench/mtp.py --layers 12 --experts 64 --dtype bfloat16 --tokens 32 --depths 1,3 \
        --fr-size 32768 --rows 1,8,32 --out $OUT/mtp-rows-h200.json || echo "STEP FAILED: $?"
    ;;
  mtp-wide)
    python3 bench/sampling_probe.py --rows 1,8,32,128 --out $OUT/sampling-probe-h200.json || echo "STEP FAILED: $?"
    python3 bench/mtp.py --layers 12 --experts 64 --dtype bfloat16 --tokens 32 --depths 1,3 \
        --fr-size 32768 --sampling qwen --rows 1,32,64,128 --out $OUT/mtp-rows-wide-sampled-h200.json || echo "STEP FAILED: $?"
    python3 bench/mtp.py --layers 12 --experts 64 --dtype bfloat16 --tokens 32 --depths 1,3 \
        --fr-size 32768 --rows 1,32,128 --out $OUT/mtp-rows-wide-h200.json || echo "STEP FAILED: $?"
    ;;
  mtp-compiled)  # after sampling draws compile on a GPU (specpipe/sampling.py)
    python3 bench/mtp.py --layers 12 --experts 64 --dtype bfloat16 --tokens 32 --depths 1,3 \
        --fr-size 32768 --sampling qwen --rows 1,32,128 --out $OUT/mtp-rows-compiled-sampled-h200.json || echo "STEP FAILED: $?"
    ;;
  mtp-ab)  # compiled vs eager sampling draws, one lease
    for v in compiled eager compiled2 eager2; do
      flag=""; case $v in eager*) flag="--eager-sampling";; esac
      python3 bench/mtp.py --layers 12 --experts 64 --dtype bfloat16 --tokens 32 --depths 1,3 $flag \
          --fr-size 32768 --sampling qwen --rows 1,32,128 --out $OUT/mtp-ab-$v-h200.json || echo "STEP FAILED: $?"
    done
    ;;
  mtp-steps)  # eager vs compiled draft steps (specpipe.drafts.mtp.HeadStep), full head vs FR-Spec 32k
    python3 bench/mtp.py --shape qwen3.5-27b --layers 4 --vocab 151936 --dtype bfloat16 --tokens 32 --depths 1,3 \
        --fr-size 32768 --sampling qwen --rows 1,32,128 --out $OUT/mtp-steps-27b-151936-qwen-h200.json | grep -v '"rows"' || echo "STEP FAILED: $?"
    python3 bench/mtp.py --shape qwen3.5-27b --layers 4 --vocab 151936 --dtype bfloat16 --depths 1,3 --no-generate \
        --fr-size 32768 --sampling greedy --rows 1,32,128 --out $OUT/mtp-steps-27b-151936-greedy-h200.json | grep CUT || echo "STEP FAILED: $?"
    python3 bench/mtp.py --shape qwen3-next --layers 4 --experts 64 --vocab 151936 --dtype bfloat16 --tokens 32 --depths 1,3 \
        --fr-size 32768 --sampling qwen --rows 1,32,128 --out $OUT/mtp-steps-next-151936-qwen-h200.json | grep -v '"rows"' || echo "STEP FAILED: $?"
    python3 bench/mtp.py --shape qwen3.5-27b --layers 4 --vocab 248320 --dtype bfloat16 --depths 1,3 --no-generate \
        --fr-size 32768 --sampling qwen --rows 1,32,128 --out $OUT/mtp-steps-27b-248320-qwen-h200.json | grep CUT || echo "STEP FAILED: $?"
    ;;
  fused)  # the one-kernel MTP draft step vs the compiled MLX step: agreement, time, FR cut
    for shape in ${SHAPES:-qwen3-next qwen3.5-27b}; do
      # (a fresh machine compiles every kernel form, MLX's references' too: greedy
      # alone at one row fits ~120 s; both samplings at two row counts do not fit 280 s)
      timeout ${LIMIT:-280} python3 bench/fused_probe.py --shape $shape --rows ${ROWS:-1,4,8} --repeats ${REPEATS:-20} \
          --context ${CONTEXT:-64} --samplings ${PROBE_SAMPLINGS:-greedy,qwen} ${PROBE_FLAGS:-} \
          --out $OUT/fused-probe-$shape${PROBE_TAG:-}-h200.json | grep -v '^agree' || echo "STEP FAILED: $?"
      # two rows per warp (PAIR_ROWS, off by default): one row count, few repeats, a short limit
      [ -n "${PAIR_AB:-}" ] && { timeout 100 python3 bench/fused_probe.py --shape $shape --rows 1 \
          --repeats 5 --pair-rows --out $OUT/fused-probe-$shape-paired-h200.json > $OUT/paired-$shape.log 2>&1 \
          || echo "STEP FAILED: $?"; tail -c 1500 $OUT/paired-$shape.log; }
    done
    ;;
  fused-ab)  # the kernel with its L2 prefetch hints (greedy, one row; `fused` runs it without)
    timeout ${LIMIT:-150} python3 bench/fused_probe.py --shape ${SHAPES:-qwen3-next} --rows 1 --repeats ${REPEATS:-10} \
        --samplings greedy --prefetch --out $OUT/fused-probe-prefetch-h200.json | grep -v '^agree' || echo "STEP FAILED: $?"
    ;;
  round-check)  # a whole round in one kernel launch vs HeadStep.round's MLX steps (quick)
    timeout ${LIMIT:-120} python3 bench/round_check.py --head ${HEAD:-fr} --rows ${ROWS:-1,2} --repeats ${REPEATS:-10} \
        --out $OUT/round-check-h200.json || echo "STEP FAILED: $?"
    ;;
  fused-mtp)  # MTP rounds and draft chains, compiled MLX step vs the fused kernel (Qwen3-Next layer)
    for sampling in ${SAMPLINGS:-greedy qwen}; do
      timeout 250 python3 bench/mtp.py --shape qwen3-next --layers 4 --experts 64 --vocab 151936 --dtype bfloat16 \
          --tokens 32 --depths ${DEPTHS:-1,3} --fr-size 32768 --sampling $sampling --rows ${ROWS:-1,4,8} --repeats 10 \
          --steps compiled,fused ${WHOLE:+--whole-round} ${SWITCHES:+--kernel-switches=$SWITCHES} --out $OUT/fused-mtp-next-$sampling-h200.json || echo "STEP FAILED: $?"
    done
    ;;
  device)  # the draft phase's device time per round (Nsight Compute), full head vs FR-Spec list
    for cc in ${CACHE:-all none}; do
      timeout ${LIMIT:-230} python3 bench/draft_device.py --ncu "${NCU:-ncu}" --depths ${DEPTHS:-1,2,3,5} \
          --rows ${ROWS:-1,3} --repeats ${REPEATS:-20} --cache-control $cc --context ${CONTEXT:-48} \
          --sampling ${SAMPLING:-greedy} --inputs ${INPUTS:-library} ${SWITCHES:+--kernel-switches=$SWITCHES} \
          ${EXPERTS:+--experts $EXPERTS} --out $OUT/draft-device-$cc${TAG:-}-h200.json | grep DEVICE || echo "STEP FAILED: $?"
    done
    ;;
  derive-check)  # rounds deriving their inputs on the device against host-built twins, under SWITCHES
    for sampling in ${SAMPLINGS:-greedy qwen}; do
      timeout ${LIMIT:-150} python3 bench/draft_device.py --check --rows ${ROWS:-1,3} --depths ${DEPTHS:-1,2,3} \
          --sampling $sampling ${EXPERTS:+--experts $EXPERTS} ${SWITCHES:+--kernel-switches=$SWITCHES} \
          | grep CHECK | cut -c1-110 || echo "STEP FAILED: $?"
    done
    ;;
  switches)  # kernel switch sets (none: the defaults; NAME on, -NAME off): the drafts' agreement under
    # PROBE_FLAGS (fused_probe.py's flags), then each set's draft device time
    [ -n "${NO_AGREE:-}" ] || SAMPLINGS=greedy,qwen ROWS=1,3 PROBE_TAG=-switches \
        LIMIT=${LIMIT:-300} bash $0 agree
    dtag=${DEPTHS:-1,2,3}; dtag=${dtag//,/}  # (the depths in the file names: runs at other depths keep theirs)
    for sw in ${SETS:-none -FOLD_ROUTER}; do
      for sampling in ${SAMPLINGS:-greedy qwen}; do
        SWITCHES=$([ $sw = none ] || echo $sw) SAMPLING=$sampling DEPTHS=${DEPTHS:-1,2,3} ROWS=${ROWS:-1} \
            REPEATS=${REPEATS:-10} CACHE=all LIMIT=${LIMIT:-240} TAG=-$sampling-${sw//[,=]/-}${EXPERTS:+-e$EXPERTS}${CONTEXT:+-ctx$CONTEXT}-d$dtag \
        bash $0 device
      done
    done
    ;;
  merge)  # a sampled step's merges, the warps' runs pairwise (TREE_MERGE, on) and in turn: time, drafts
    SETS=${SETS:-none -TREE_MERGE} SAMPLINGS=qwen NO_AGREE=1 bash $0 switches
    SAMPLINGS=qwen ROWS=1,3 PROBE_FLAGS="--no-tree-merge" PROBE_TAG=-merge LIMIT=${LIMIT:-220} bash $0 agree
    ;;
  batched-f32)  # float32 MTP rows against the rows decoded plainly as one batch, with and without the
    # launch ahead, with MLX's TF32 float32 products (its default) and without (seventeenth session:
    # three rows differed from plain, also without the window kernel; one row did not)
    for tf32 in ${TF32S:-1 0}; do
      MLX_ENABLE_TF32=$tf32 timeout ${LIMIT:-200} python3 bench/mtp.py --shape qwen3-next --layers 4 --experts 64 \
          --vocab 151936 --fr-size 32768 --steps fused --draft-ahead --rows ${ROWS:-2,3} --depths 2 --dtype float32 \
          --tokens 24 --sampling greedy --repeats 1 --out $OUT/mtp-ahead-f32-tf32$tf32-h200.json \
          | grep AHEAD | cut -c1-330 || echo "STEP FAILED: $?"
    done
    ;;
  precision)  # a product's row computed in a window of M rows against the row alone, TF32 on and off
    for tf32 in 1 0; do
      MLX_ENABLE_TF32=$tf32 timeout ${LIMIT:-120} python3 bench/window_precision.py \
          --out $OUT/window-precision-tf32$tf32-h200.json | grep PRECISION || echo "STEP FAILED: $?"
    done
    ;;
  quant)  # MLX's quantized products against the dequantized weights' (single-group weights: wrong for 2+
    # rows on an H100, thirty-second session), specpipe's regrouped product and gather_qmm beside them;
    # then the DFlash / DSpark tests on the GPU (TF32 off), which found it
    for d in ${DTYPES:-float32}; do  # each --quick sweep ran past 200 s on an H100 (kernels compiled per shape)
      MLX_ENABLE_TF32=0 timeout ${LIMIT:-240} python3 bench/quant_probe.py --quick --dtype $d \
          --out $OUT/quant-probe-$d-h200.json | grep -E "wrong of|WRONG|refused" | head -40 || echo "STEP FAILED: $?"
    done
    MLX_ENABLE_TF32=0 timeout ${TEST_LIMIT:-300} python3 -m pytest -q -rf -p no:cacheprovider \
        tests/specpipe/test_dflash.py tests/specpipe/test_dspark.py 2>&1 | tail -25
    ;;
  kernels)  # attention, the short conv, the grouped experts (stacked and sliced weights) and a tiny
    # Qwen3-Next's prefill (GPU and CPU against HF) checked on the device (the device has torch and
    # transformers): the thirty-third session's bisection of a wrong GPU prefill, kept as a check
    MLX_ENABLE_TF32=0 timeout ${LIMIT:-200} python3 bench/gpu_kernels.py 2>&1 | grep -E "^--|BAD|refused|Error" \
        || echo "STEP FAILED: $?"
    ;;
  parity)  # the models on the GPU against the same float32 weights on the CPU (FAMILIES, one at a
    # time: the eighteenth session's run of all three printed nothing in 160 s)
    for fam in ${FAMILIES:-qwen2.5-0.5b qwen3-next qwen3.5-27b}; do
      MLX_ENABLE_TF32=0 timeout ${LIMIT:-150} python3 bench/device_parity.py --families $fam \
          --out $OUT/device-parity-$fam-h200.json | grep -E "stage|PARITY" | cut -c1-400 || echo "STEP FAILED: $?"
    done
    ;;
  streams)  # CPU products split over several streams after the GPU computed the arrays (models/parallel.py
    # refuses the split with MLX's CUDA backend): MLX alone, then the dense family split and not
    timeout ${LIMIT:-200} python3 bench/cpu_streams_probe.py --timeout 30 --out $OUT/cpu-streams-probe-h200.json \
        || echo "STEP FAILED: $?"
    for threads in 16 1; do
      MLX_ENABLE_TF32=0 timeout 60 python3 -X faulthandler bench/device_parity.py --families qwen2.5-0.5b \
          --split-threads $threads --out $OUT/device-parity-split$threads-h200.json 2>&1 \
          | grep -E "stage|PARITY|File|Fatal" | cut -c1-300; echo "rc ${PIPESTATUS[0]}"
    done
    ;;
  barrier)  # the grid barrier by release / acquire operations (ACQ_REL_BARRIER, on) against the fenced
    # form: time, then the fenced form's drafts (compare them with a defaults' `agree` run of the same ROWS:
    # the probe's inputs depend on the rows it runs in one process)
    SETS=${SETS:-none -ACQ_REL_BARRIER} SAMPLINGS=${SAMPLINGS:-greedy qwen} NO_AGREE=1 DEPTHS=${DEPTHS:-2,3} \
        bash $0 switches
    SAMPLINGS=greedy,qwen ROWS=${AGREE_ROWS:-1,3} PROBE_FLAGS="--no-acq-rel-barrier" PROBE_TAG=-fenced \
        LIMIT=${LIMIT:-200} bash $0 agree
    ;;
  unroll)  # attention's cached positions several per warp at once (ATT_UNROLL, 4) against one at a time,
    # in one lease, at each of CONTEXTS (draft device time), then (unless NO_AGREE) the drafts at a long context
    for c in ${CONTEXTS:-48 4096 32768}; do
      CONTEXT=$c SETS=${SETS:-none ATT_UNROLL=1} SAMPLINGS=${SAMPLINGS:-greedy qwen} NO_AGREE=1 \
          DEPTHS=${DEPTHS:-2,3} bash $0 switches
    done
    [ -n "${NO_AGREE:-}" ] || timeout ${LIMIT:-200} python3 bench/fused_probe.py --shape qwen3-next --rows ${ROWS:-1,3} \
        --samplings greedy,qwen --agree-only --repeats 1 --context ${AGREE_CONTEXT:-4096} \
        --out $OUT/fused-probe-next-ctx${AGREE_CONTEXT:-4096}-agree-h200.json | grep -v '^agree' || echo "STEP FAILED: $?"
    ;;
  spread)  # a warp's attention positions at once NWARP apart (ATT_SPREAD, off) with eight per warp, against
    # the defaults (ATT_UNROLL=4, adjacent): time at 48 positions (both samplings) and at 32,768 (greedy),
    # then the drafts at 2,048 positions (one and three rows)
    SETS=${SETS:-none ATT_SPREAD,ATT_UNROLL=8} SAMPLINGS=${SAMPLINGS:-greedy qwen} NO_AGREE=1 DEPTHS=${DEPTHS:-2,3} \
        CONTEXT=48 bash $0 switches
    SETS=${SETS:-none ATT_SPREAD,ATT_UNROLL=8} SAMPLINGS=greedy NO_AGREE=1 DEPTHS=2 CONTEXT=32768 bash $0 switches
    timeout ${LIMIT:-200} python3 bench/fused_probe.py --shape qwen3-next --rows ${ROWS:-1,3} --samplings greedy,qwen \
        --agree-only --repeats 1 --context 2048 --att-spread --att-unroll 8 \
        --out $OUT/fused-probe-next-spread-ctx2048-agree-h200.json | grep -v '^agree' || echo "STEP FAILED: $?"
    ;;
  phases)  # where a chained step's time goes (the kernel's phase stamps, bench/phase_probe.py) at each of
    # CONTEXTS and for each of PSETS (';' between sets), FR-Spec head unless HEADS
    timeout ${LIMIT:-240} python3 bench/phase_probe.py --contexts ${CONTEXTS:-48,4096,32768} \
        --sets "${PSETS:-none;-ATT_PIPE;ATT_GROUPED}" --samplings ${PSAMPLINGS:-greedy} \
        --heads ${HEADS:-fr} ${EXPERTS:+--experts $EXPERTS} --out $OUT/phase-probe${PROBE_TAG:-}-h200.json || echo "STEP FAILED: $?"
    ;;
  copy)  # a whole round's KV copy one vector per thread at a time against the defaults (COPY_UNROLL=4): time at
    # 32,768 and 4,096 positions (greedy, depth 2), then the drafts and KV buffers at 2,048 (one and three rows)
    for c in ${CONTEXTS:-32768 4096}; do
      SETS=${SETS:-none COPY_UNROLL=1} SAMPLINGS=greedy NO_AGREE=1 DEPTHS=${DEPTHS:-2} CONTEXT=$c bash $0 switches
    done
    [ -n "${NO_AGREE:-}" ] || timeout ${LIMIT:-200} python3 bench/fused_probe.py --shape qwen3-next --rows ${ROWS:-1,3} \
        --samplings greedy,qwen --agree-only --repeats 1 --context 2048 --copy-unroll 1 \
        --out $OUT/fused-probe-next-copy1-ctx2048-agree-h200.json | grep -v '^agree' || echo "STEP FAILED: $?"
    ;;
  grouped)  # attention per kv head, its cached keys and values staged in shared memory (ATT_GROUPED, off),
    # against the defaults: the drafts first (one row: two tiles a split at 4,096 positions; three rows: seven),
    # then the time at each of CONTEXTS (both samplings at 48 positions, greedy beyond)
    [ -n "${NO_AGREE:-}" ] || timeout ${LIMIT:-200} python3 bench/fused_probe.py --shape qwen3-next --rows ${ROWS:-1,3} \
        --samplings greedy,qwen --agree-only --repeats 1 --context ${AGREE_CONTEXT:-4096} --att-grouped \
        --out $OUT/fused-probe-next-grouped-ctx${AGREE_CONTEXT:-4096}-agree-h200.json | grep -v '^agree' || echo "STEP FAILED: $?"
    for c in ${CONTEXTS:-32768 4096 48}; do
      SETS=${SETS:-none ATT_GROUPED} SAMPLINGS=$([ $c = 48 ] && echo "greedy qwen" || echo greedy) NO_AGREE=1 \
          DEPTHS=${DEPTHS:-2} CONTEXT=$c bash $0 switches
    done
    ;;
  keep)  # the layer's rows kept in L2 for a launch's next step (KEEP_FC / KEEP_QKV / KEEP_O), device time
    # (defaults: fc and o_proj kept; a set may give integer settings too: BLOCKS=132, DRAW_HEADS_K=2)
    SETS=${SETS:-none -KEEP_FC,-KEEP_O} SAMPLINGS=${SAMPLINGS:-greedy} NO_AGREE=1 \
        DEPTHS=${DEPTHS:-1,2,3} bash $0 switches
    ;;
  retime)  # the defaults' FR-Spec cut at CONTEXT (48) positions: both samplings, depths 2 and 3, 64 experts
    # (the random layer's) then 512 (Qwen3-Next's own count)
    for e in 64 512; do
      SETS=none SAMPLINGS=${SAMPLINGS:-greedy qwen} NO_AGREE=1 DEPTHS=${DEPTHS:-2,3} CONTEXT=${CONTEXT:-48} \
          REPEATS=${REPEATS:-8} EXPERTS=$([ $e = 64 ] || echo $e) bash $0 switches
    done
    ;;
  agree)  # the kernel's drafts against the MLX step's (bf16 and float32), PROBE_FLAGS its switches
    timeout ${LIMIT:-280} python3 bench/fused_probe.py --shape qwen3-next --rows ${ROWS:-1,3} --samplings ${SAMPLINGS:-greedy,qwen} \
        --agree-only --repeats 2 ${PROBE_FLAGS:-} ${EXPERTS:+--experts $EXPERTS} --out $OUT/fused-probe-next${PROBE_TAG:-}-agree-h200.json \
        | grep -v '^agree' || echo "STEP FAILED: $?"
    ;;
  draw)  # a sampled draw: its parts' cost (diagnostics, wrong drafts), the blocks' heads merged first
    SETS=${SETS:--DRAW_HEADS,-TIGHT_DRAW none DIAG_NO_DRAW DIAG_NO_SORT DIAG_NO_DRAW,DIAG_NO_SORT} SAMPLINGS=qwen NO_AGREE=1 bash $0 switches
    for k in ${HEADS_K:-2}; do  # 2: the fallback taken in most draws (two of a row's best 20 in one block)
      SAMPLINGS=qwen ROWS=1,3 PROBE_FLAGS="--draw-heads-k $k" PROBE_TAG=-drawheads$k bash $0 agree
    done
    ;;
  tight)  # compact sampled-draw code; where a step's warps stall (ncu's stall reasons, sampled and greedy)
    SETS=${SETS:--TIGHT_DRAW none -DRAW_HEADS} SAMPLINGS=qwen NO_AGREE=1 bash $0 switches
    for sampling in qwen greedy; do
      MLX_USE_CUDA_GRAPHS=0 timeout ${LIMIT:-150} "${NCU:-ncu}" --target-processes all --kernel-name regex:specpipe_mtp_step \
          --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,smsp__inst_executed.sum,gpu__time_duration.sum' \
          --cache-control all --clock-control none --csv --page raw \
          python3 bench/draft_device.py --worker --labels $OUT/stalls-$sampling-labels.json --depths 3 --rows 1 \
          --repeats 3 --sampling $sampling ${SWITCHES:+--kernel-switches=$SWITCHES} > $OUT/stalls-$sampling.csv 2> $OUT/stalls-$sampling.err \
          || echo "STEP FAILED: $?"; tail -c 600 $OUT/stalls-$sampling.err
    done
    SAMPLINGS=qwen ROWS=1,3 PROBE_FLAGS="--draw-heads-k 2" PROBE_TAG=-tight LIMIT=${LIMIT:-200} bash $0 agree
    ;;
  redux)  # REDUX_TOPK / SHARED_CDF at EXPERTS (512), against the old defaults (`stretches`)
    PHASE_SETS="none;REDUX_TOPK,SHARED_CDF" PROBE_FLAGS="--redux-topk --shared-cdf" NAME=redux bash $0 stretches
    ;;
  stretches)  # PHASE_SETS at EXPERTS (512): each stretch (phase stamps, FR head), then the drafts against
    # the MLX step's with PROBE_FLAGS (ROWS, one: a 512-expert agreement run at three rows timed out before;
    # greedy and Qwen's sampling); NAME tags the files
    e=${EXPERTS:-512}
    timeout ${LIMIT:-200} python3 bench/phase_probe.py --experts $e --contexts 48 --sets "$PHASE_SETS" \
        --samplings greedy,qwen --heads fr --launches 5 --out $OUT/phase-probe-$NAME-e$e-h200.json > /dev/null \
        || echo "STEP FAILED: $?"
    EXPERTS=$e SAMPLINGS=greedy,qwen ROWS=${ROWS:-1} LIMIT=${AGREE_LIMIT:-240} PROBE_TAG=-$NAME-e$e bash $0 agree
    python3 bench/probe_summary.py $OUT/phase-probe-$NAME-e$e-h200.json $OUT/fused-probe-next-$NAME-e$e-agree-h200.json
    ;;
  pcsamp)  # where a step's warps stall, per SASS instruction (ncu's PC sampling), FR head, depth 3
    "${NCU:-ncu}" --version | tail -1
    for sampling in ${SAMPLINGS:-greedy qwen}; do
      MLX_USE_CUDA_GRAPHS=0 timeout ${LIMIT:-200} "${NCU:-ncu}" --target-processes all --kernel-name regex:specpipe_mtp_step \
          --launch-skip ${SKIP:-6} --launch-count 1 --section SourceCounters --section WarpStateStats \
          --cache-control all --clock-control none -f -o /tmp/pc-$sampling \
          python3 bench/draft_device.py --worker --labels /tmp/pc-labels.json --heads ${HEADS:-fr} --depths ${DEPTHS:-3} \
          --rows 1 --repeats 4 --sampling $sampling ${SWITCHES:+--kernel-switches=$SWITCHES} ${EXPERTS:+--experts $EXPERTS} \
          > $OUT/pc-$sampling.log 2>&1 \
          || echo "STEP FAILED: $?"; tail -c 300 $OUT/pc-$sampling.log
      "${NCU:-ncu}" --import /tmp/pc-$sampling.ncu-rep --page source --csv --print-source sass > $OUT/pc-$sampling-sass.csv \
          2> $OUT/pc-$sampling.err || echo "STEP FAILED: $?"
      "${NCU:-ncu}" --import /tmp/pc-$sampling.ncu-rep --page details --csv >> $OUT/pc-$sampling.log 2>&1 || echo "STEP FAILED: $?"
      head -c 400 $OUT/pc-$sampling-sass.csv; echo; wc -c $OUT/pc-$sampling-sass.csv
    done
    ;;
  interleave)  # a round's draft phase, full and FR-Spec heads timed in alternation, with its split
    for sampling in ${SAMPLINGS:-greedy}; do
      timeout ${LIMIT:-230} python3 bench/mtp.py --shape qwen3-next --layers 4 --experts 64 --vocab 151936 \
          --dtype bfloat16 --fr-size 32768 --rows ${ROWS:-1} --steps fused --interleave --tokens 8 \
          --sampling $sampling --depths ${DEPTHS:-1,3,5} --repeats ${REPEATS:-30} \
          ${SWITCHES:+--kernel-switches=$SWITCHES} --out $OUT/mtp-interleaved-$sampling-h200.json \
          | grep INTERLEAVED || echo "STEP FAILED: $?"
    done
    ;;
  parts)  # where a round's draft time goes beyond its kernel, with and without CUDA graphs
    timeout ${LIMIT:-280} python3 bench/round_parts.py --repeats ${REPEATS:-30} \
        --out $OUT/round-parts-h200.json | grep PARTS || echo "STEP FAILED: $?"
    MLX_USE_CUDA_GRAPHS=0 timeout ${LIMIT:-280} python3 bench/round_parts.py --repeats ${REPEATS:-30} \
        --out $OUT/round-parts-nographs-h200.json | grep PARTS || echo "STEP FAILED: $?"
    ;;
  step-probe)  # where a draft step's time goes, under different CUDA graph sizes
    for ops in 20 60 200; do
      MLX_MAX_OPS_PER_BUFFER=$ops python3 bench/step_probe.py --shape qwen3.5-27b --rows 1,32,128 \
          --out $OUT/step-probe-27b-ops$ops-h200.json || echo "STEP FAILED: $?"
    done
    MLX_USE_CUDA_GRAPHS=0 python3 bench/step_probe.py --shape qwen3.5-27b --rows 1,32,128 \
        --out $OUT/step-probe-27b-nographs-h200.json || echo "STEP FAILED: $?"
    for ops in 20 200; do
      MLX_MAX_OPS_PER_BUFFER=$ops python3 bench/step_probe.py --shape qwen3-next --rows 1,32,128 \
          --out $OUT/step-probe-next-ops$ops-h200.json || echo "STEP FAILED: $?"
    done
    ;;
  gdn)  # the gated delta rule over a verify window: per-position states vs MLX's fused kernel
    python3 bench/gdn_probe.py --rows 1,32 --windows 1,2,4,8 --out $OUT/gdn-probe-h200.json || echo "STEP FAILED: $?"
    ;;
  gdn-mtp)  # the window kernel (models/gated_delta_cuda.py): probe, then plain and MTP rounds with and without it
    python3 bench/gdn_probe.py --rows 1,32 --windows 1,2,4 --repeats 20 --out $OUT/gdn-kernel-probe-h200.json | cut -c1-400 || echo "STEP FAILED: $?"
    for k in on off on off; do flag=""; [ $k = off ] && flag="--no-window-kernel"
      python3 bench/mtp.py --shape qwen3.5-27b --layers 8 --vocab 151936 --dtype bfloat16 --tokens 32 --depths 1,3 \
          --fr-size 32768 --sampling qwen --rows 1 --steps compiled $flag --out $OUT/mtp-kernel-$k-h200.json | grep -v '"rows"' || echo "STEP FAILED: $?"
    done
    ;;
  mtp)
    python3 bench/mtp.py --layers 12 --experts 64 --dtype bfloat16 --tokens 64 --depths 1,2,3 \
        --fr-size 32768 --out $OUT/mtp-h200.json || echo "STEP FAILED: $?"
    ;;
  esac
done
