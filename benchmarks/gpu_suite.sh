#!/usr/bin/env bash
# Everything specjax runs on the H200 in one call: install, benchmarks, GPU tests.
# Run through the device tool from the repo root, carrying .whl (the jax-triton 0.3.1 wheel):
#   bash benchmarks/gpu_suite.sh [all|bench|tests|attention|models|profile|multi|fused|anchors|methods|ab|cmdbuf|sampling|verify|prefill|schedule|moe|grouped|kgrid|dspark|suffix|tiles]
# (models: attention, proposer (chain and tree), end-to-end and training-step costs; profile:
# profiler traces of the engine step; multi: tensor / data parallel proposers and the
# tensor-parallel reference loop on >= 2 GPUs; fused: the K/V write inside the attention
# kernel: attend's fused_kv_write / kv_write_kernel arguments swept (benchmarks/attention_layers.py
# --kv-write; the default, fused_kv_write="auto", picks the fused write at small batches);
# anchors: specjax's plain / n-gram verify / EAGLE-3 fused steps beside the PyTorch anchors
# (benchmarks/torch_anchors.py: torch.compile + CUDA graph, same process) and the floor;
# methods: every device method's fused step beside the plain step (e2e.py --device-methods);
# both with JAX's default flags; ab: one parent-vs-head A/B (benchmarks/ab_step.py, AB_PARENT /
# AB_ARGS); cmdbuf: the fused step with command buffers on (JAX's default) and off, and XLA's
# log of command-buffer re-records; sampling: the engine step with the sampling features on
# (benchmarks/sampling.py: greedy, top-k/top-p, + penalties and min_p, + logprobs, processed
# logprobs, a mixed batch) against none, 8B target (128k vocab) at B = 1, 8 (SAMPLING_BATCH,
# SAMPLING_METHODS, default plain ngram eagle3); verify: the verify-and-propose entry plus the
# stack's own forward against the fused step (benchmarks/verify_entry.py, issue 48: <= 1.03x),
# 8B target, B = 1, 8, 32 (VERIFY_BATCH, VERIFY_METHODS, default plain ngram eagle3), 3 rounds;
# prefill: time to first token at 1k, 8k, 32k prompt tokens (benchmarks/prefill.py, issue 50):
# the engine's TTFT and the bare jitted prefill beside PyTorch's same forward (SDPA flash, eager
# and torch.compile, same process), the bf16 GEMM rate, and the attention alone per option
# (specjax's backends, jax.nn.dot_product_attention cuDNN, the Mosaic GPU example, torch SDPA);
# PREFILL_ARGS adds flags: "--prompts 131072 --parts engine" (the 128k prompt; then "--parts
# torch,torch_compile" in a second run: an 80 GB card holds one side only), "--batch-prefill" (B = 256
# requests of 1k tokens, plain and EAGLE-3, tokens/s), "--parts engine,forward,torch" (fewer);
# schedule: the engine's vLLM v1 scheduling (benchmarks/scheduling.py, issue 51), 8B target,
# plain and EAGLE-3: the running requests' ITL while a 32k prompt prefills in 512 / 1k / 2k
# chunks (every step a token each; chunk step / floor, goal <= 1.3) and a Poisson workload
# with and without chunked prefill (tokens/s, TTFT, ITL, preemptions); SCHED_ARGS adds flags:
# "--parts itl" or "--parts mixed" (one part), "--rate 8 --num-requests 128", "--warmup full",
# "--torch" (itl: PyTorch's chunk step at the same past, benchmarks/torch_chunk.py, first);
# moe: issue 54's MoE target (benchmarks/moe.py, MOE_BATCH; MOE_ARGS="--pair-max 0,32": the
# sorted grouped matmul against pair_matmul at decode); grouped: its grouped GEMM's
# tiles (benchmarks/grouped_tiles.py, GROUPED_ARGS); kgrid: issue 55's cost table
# (benchmarks/k_grid.py, KGRID_BATCH, KGRID_ARGS; "--policies adaptive_k adaptive_verification"
# adds each policy's tokens/s per (B, a) against the best static k and plain; "--mixed 0.9,0.3",
# "--falling 0.9,0.3": the adaptation cells; "--cost benchmarks/logs/k_grid_h100_2026-12-05b_*.log"
# reuses the H100's table; "--query-buckets exact": rows of K + 1 tokens, not padded to a power
# of two; "--check" alone drops the direct cells; "--forced-costs": each adaptive_k choice
# timed forced beside its profiled cost; "--explore 0.25": adaptive_k's discount on a choice
# not run yet; B = 64's mixed cell needs KGRID_S=540); dspark: issue 57, the demo DSpark head
# trained by the recipe (DFlash's budget; $OUT/heads/dspark, copy it to
# specjax/demo_models/dspark) and DSpark's propose beside DFlash's at B = 1, 8, 32 (8B-shaped,
# rank 256, goal <= 1.1x); suffix: issue 58, the device suffix speculator inside the device
# loop beside ngram_gpu and plain decoding, 8B-shaped target, B = 1, 64, 256 (SUFFIX_BATCH;
# SUFFIX_ITERS=30 keeps B = 256's pool inside an 80 GB H100),
# synthetic acceptance; none of these is part of `all`,
# each needs several minutes). `tests` runs every GPU test
# but tests/kernels/test_paged_attention.py (~4 min), `attention` that file (~7 min: the Pallas and
# Triton kernels, the EAGLE-3 propose per backend; its two-GPU cases need nvidia-h200-x2):
# one part per device call (10 minutes at most each).
# Each part runs under its own time limit (BENCH_S, NGRAM_S, TESTS_S, PREFILL_S, SCHED_S seconds) so one slow
# part cannot starve the others inside a device lease. Logs and JSON go to $OUT.
set -uo pipefail
OUT="${OUT:-$PWD/gpu_out}"; mkdir -p "$OUT"
what="${1:-all}"
export PYTHONUNBUFFERED=1
# `python` there is not the interpreter `pip` belongs to: always `python -m pip`.
python -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
python -m pip install -q --no-deps --target /tmp/site .whl/*.whl >>"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
export PYTHONPATH=/tmp/site
{
  date -u +%Y-%m-%dT%H:%MZ
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python -c 'import jax, jaxlib, triton, jax_triton, flax; print("jax", jax.__version__, "jaxlib", jaxlib.__version__, "triton", triton.__version__, "jax_triton", jax_triton.__version__, "flax", flax.__version__, jax.devices())'
} 2>&1 | tee "$OUT/env.txt"
rc=0
# JAX's own share of the GPU for the parts with no PyTorch in their process (its default, 0.75,
# leaves an 80 GB H100 short of an 8B target with a B = 256 pool or a 30B-A3B MoE's 58 GB)
JAXMEM="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}"
if [ "$what" = bench ] || [ "$what" = all ]; then
  timeout "${BENCH_S:-240}" python benchmarks/kernels.py --iters "${ITERS:-100}" --json "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.log" | tail -80
  timeout "${NGRAM_S:-90}" python benchmarks/ngram.py --gpu --quick --json "$OUT/ngram.json" 2>&1 | tee "$OUT/ngram.log" | tail -30
fi
TREE="[(0,), (1,), (0, 0), (1, 0), (0, 0, 0), (1, 0, 0)]"
if [ "$what" = models ]; then
  timeout "${ATTN_S:-170}" python benchmarks/attention.py --propose --out "$OUT/attention.json" 2>&1 | tee "$OUT/attention.log" | tail -20
  timeout "${PROP_S:-120}" python benchmarks/proposers.py --batches 1,8,64 --tree "$TREE" --json "$OUT/proposers.json" 2>&1 | tee "$OUT/proposers.log" | tail -10
  # JAX's default flags (command buffers are recorded once: part cmdbuf)
  timeout "${E2E_S:-420}" python benchmarks/e2e.py \
    --target 8b --batch 1,8,32 --context 1024 --k 3 --methods ngram eagle3 dflash --tree "$TREE" \
    --json "$OUT/e2e.jsonl" 2>&1 | tee "$OUT/e2e.log" | tail -25
  timeout "${TRAIN_S:-240}" python benchmarks/train_step.py --steps 30 2>&1 | tee "$OUT/train_step.log" | tail -6
fi
if [ "$what" = moe ]; then
  # issue 54: the engine's plain / EAGLE-3 decode with the Qwen3-30B-A3B-shaped MoE target
  # first, then its expert stack (8 layers: ragged_dot, the Pallas kernel, the Pallas Hopper
  # example; torch._grouped_mm in its own process first); MOE_ARGS adds flags ("--parts
  # experts --impls pallas", "--expert-layers 48", "--profile $OUT/prof": each plain decode
  # step's kernels); rows print as measured
  XLA_PYTHON_CLIENT_MEM_FRACTION=$JAXMEM timeout "${MOE_S:-540}" python benchmarks/moe.py --batch "${MOE_BATCH:-1,8,32}" --torch \
    --parts decode,experts ${MOE_ARGS:-} --json "$OUT/moe.json" 2>&1 | tee "$OUT/moe.log" | grep -v '\\x' | tail -40
fi
if [ "$what" = grouped ]; then
  # issue 54: the Pallas grouped matmul's tiles on the 30B-A3B decode / verify GEMMs beside
  # ragged_dot, a dense GEMM of the same bytes and the floor (GROUPED_ARGS adds flags)
  timeout "${GROUPED_S:-540}" python benchmarks/grouped_tiles.py ${GROUPED_ARGS:-} \
    --json "$OUT/grouped_tiles.json" 2>&1 | tee "$OUT/grouped_tiles.log" | tail -30
fi
if [ "$what" = dspark ]; then
  timeout "${TRAIN_S:-300}" python -m specjax.training.recipe --out "$OUT/heads" --stage heads \
    --target specjax/demo_models/target --heads dspark 2>&1 | tee "$OUT/train_dspark.log" | tail -12
  timeout "${PROP_S:-240}" python benchmarks/proposers.py --methods dflash dspark dspark-top64 --batches 1,8,32 \
    --json "$OUT/proposers_dspark.json" 2>&1 | tee "$OUT/proposers_dspark.log" | tail -10
fi
if [ "$what" = suffix ]; then
  XLA_PYTHON_CLIENT_MEM_FRACTION=$JAXMEM timeout "${SUFFIX_S:-560}" python benchmarks/loop.py --target 8b --batch "${SUFFIX_BATCH:-1,64,256}" \
    --n 8 --iters "${SUFFIX_ITERS:-100}" --repeat 1 --methods plain ngram_gpu suffix --out "$OUT/loop_suffix.json" \
    2>&1 | tee "$OUT/loop_suffix.log" | tail -20
fi
if [ "$what" = kgrid ]; then
  # issue 55: iteration time per (B, k), 8B target, EAGLE-3 synthetic; best static k per
  # (B, a) and the schedule that picks it; three cells run directly (KGRID_ARGS adds flags)
  XLA_PYTHON_CLIENT_MEM_FRACTION=$JAXMEM timeout "${KGRID_S:-560}" python benchmarks/k_grid.py --batch "${KGRID_BATCH:-1,8,32,64,128,256}" \
    --kmax 7 --iters 30 --repeat 1 --check 1:0.7 32:0.5 128:0.9 ${KGRID_ARGS:-} \
    --json "$OUT/k_grid.json" 2>&1 | tee "$OUT/k_grid.log" | tail -40
fi
if [ "$what" = profile ]; then
  timeout "${PROF_S:-250}" python benchmarks/profile_step.py --batch 1 --k 3 --propose --out /tmp/specjax_prof 2>&1 | tee "$OUT/profile.log" | grep "^###"
fi
if [ "$what" = fused ]; then
  # the K/V write inside the attention kernel against the write kernel and the scatters:
  # 32 layers of attend per program, one row per (B, q, fused_kv_write, kv_write_kernel)
  timeout "${PROP_S:-150}" python benchmarks/attention_layers.py --kv-write --batches 1,8,32,64 \
    --json "$OUT/fused.json" 2>&1 | grep -v Warning | tee -a "$OUT/fused.log" | tail -32
  # (63 tests, ~300 s: the compiles dominate)
  timeout "${TESTS_S:-330}" python -m pytest -m gpu -q -p no:cacheprovider tests/kernels/test_paged_attention.py 2>&1 | tail -5 | tee -a "$OUT/fused.log"
fi
if [ "$what" = multi ]; then
  # the Pallas attention kernel split by kv heads over 2 GPUs (custom_partitioning)
  timeout "${MULTI_TESTS_S:-200}" python -m pytest -m gpu -q -p no:cacheprovider tests/kernels/test_paged_attention.py \
    -k two_gpus 2>&1 | tail -5 | tee "$OUT/multi_tests.log"
  # on nvidia-h200-x4: MULTI_DEVICES=1,2,4 MULTI_EXTRA=--dp-tp (DP x TP: 2 groups of tp=2)
  timeout "${MULTI_S:-400}" python benchmarks/multi_gpu.py --devices "${MULTI_DEVICES:-1,2}" --batches 1,8,64 --local-argmax on --dp ${MULTI_EXTRA:-} \
    --iters 30 --out "$OUT/multi_gpu.json" 2>&1 | tee "$OUT/multi_gpu.log" | tail -12
  # the reference loop's step with the target and the proposer over 2 GPUs (Engine(mesh=))
  XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=" timeout "${E2E_S:-420}" python benchmarks/e2e.py \
    --target 8b --tp 2 --batch 1,8,32 --k 3 --methods ngram eagle3 --no-demo-tau \
    --json "$OUT/e2e_tp2.jsonl" 2>&1 | tee "$OUT/e2e_tp2.log" | tail -12
fi
if [ "$what" = anchors ]; then
  # the anchors' cached steps against an uncached forward first (tiny fp32, seconds)
  timeout 120 python -c 'import sys; sys.path.insert(0, "benchmarks"); import torch_anchors as t; print("torch anchors check:", t.check())' \
    2>&1 | tee "$OUT/anchors_check.log" | tail -3
  timeout "${ANCHORS_S:-540}" python benchmarks/e2e.py --target 8b --batch "${ANCHORS_BATCH:-1,8,32}" --context 1024 --k 3 \
    --methods ngram eagle3 --no-demo-tau --torch --json "$OUT/anchors.jsonl" --out "$OUT/anchors.json" \
    2>&1 | tee "$OUT/anchors.log" | grep -v Warning | tail -40
fi
if [ "$what" = methods ]; then
  timeout "${METHODS_S:-560}" python benchmarks/e2e.py --target 8b --batch "${METHODS_BATCH:-1,8,32}" --context 1024 --k 3 \
    --device-methods --no-t1-check --json "$OUT/methods.jsonl" --out "$OUT/methods.json" \
    2>&1 | tee "$OUT/methods.log" | grep -v Warning | tail -40
fi
if [ "$what" = ab ]; then
  # one A/B of benchmarks/ab_step.py: AB_PARENT (a folder holding specjax_parent/, made here by
  # `python benchmarks/ab_step.py --prepare REV --into DIR` and carried), AB_ARGS its flags
  timeout "${AB_S:-560}" python benchmarks/ab_step.py --parent "${AB_PARENT:-.ab}" --target 8b ${AB_ARGS:-} \
    --json "$OUT/ab_$(basename "${AB_PARENT:-.ab}").json" 2>&1 | grep -v Warning | tee -a "$OUT/ab.log" | tail -20
fi
if [ "$what" = cmdbuf ]; then
  # the fused step with JAX's default flags (command buffers on) against command buffers off,
  # one process each, then XLA's own log of command-buffer updates (re-records) per call
  for flags in "" "--xla_gpu_enable_command_buffer="; do
    echo "== XLA_FLAGS='$flags'" | tee -a "$OUT/cmdbuf.log"
    XLA_FLAGS="$flags" timeout "${CMDBUF_S:-150}" python benchmarks/e2e.py --target 8b --batch "${CMDBUF_BATCH:-1,8}" \
      --context 1024 --k 3 --methods eagle3 --no-demo-tau --no-t1-check 2>&1 | grep -v Warning | tee -a "$OUT/cmdbuf.log" | tail -8
  done
  TF_CPP_VMODULE=command_buffer_thunk=3 TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_MAX_VLOG_LEVEL=0 timeout "${CMDBUF_S:-150}" \
    python benchmarks/e2e.py --target 8b --batch 1 --context 1024 --k 3 --methods eagle3 --no-demo-tau --no-t1-check \
    --iters 20 >"$OUT/cmdbuf_vlog_stdout.txt" 2>"$OUT/cmdbuf_vlog.txt"
  echo "== command-buffer updates (XLA VLOG), by executions since the last update:" | tee -a "$OUT/cmdbuf.log"
  grep -o "after [0-9]* executions since last update" "$OUT/cmdbuf_vlog.txt" | sort | uniq -c | sort -rn | head | tee -a "$OUT/cmdbuf.log"
  grep -c "command buffer" "$OUT/cmdbuf_vlog.txt" | tee -a "$OUT/cmdbuf.log"
  gzip -f "$OUT/cmdbuf_vlog.txt"
fi
if [ "$what" = sampling ]; then
  # what the sampling features cost in the step; the JSON is rewritten after each (B, method)
  timeout "${SAMPLING_S:-560}" python benchmarks/sampling.py --target 8b --batch "${SAMPLING_BATCH:-1,8}" \
    --context 1024 --k 3 --methods ${SAMPLING_METHODS:-plain ngram eagle3} --rounds 3 --iters 20 \
    --json "$OUT/sampling.json" 2>&1 | grep -v Warning | tee "$OUT/sampling.log" | tail -45
fi
if [ "$what" = verify ]; then
  # interleaved rounds in one process; the JSON is rewritten after each (method, B)
  timeout "${VERIFY_S:-540}" python benchmarks/verify_entry.py --target 8b --batch "${VERIFY_BATCH:-1,8,32}" \
    --context 1024 --k 3 --methods ${VERIFY_METHODS:-plain ngram eagle3} --rounds 3 --iters 20 \
    --json "$OUT/verify.json" 2>&1 | grep -v Warning | tee "$OUT/verify.log" | tail -25
fi
if [ "$what" = prefill ]; then
  # one process: JAX gets half the GPU where a PyTorch part runs in it, else 0.92; the JSON is
  # rewritten after every row
  # (PREFILL_TAG names the files: a second prefill part in one call keeps the first's)
  timeout "${PREFILL_S:-540}" python benchmarks/prefill.py ${PREFILL_ARGS:-} --json "$OUT/${PREFILL_TAG:-prefill}.json" \
    2>&1 | grep -v Warning | tee "$OUT/${PREFILL_TAG:-prefill}.log" | tail -70
fi
if [ "$what" = tiles ]; then
  # issue 50: the flash kernel's tiles (benchmarks/flash_tiles.py): every knob on the 32k
  # prefill (Pallas), the quick grid on the 1k and 8k prefills, a chunked-prefill step, a 16k-token
  # batch step and a 512-token chunk after 32k keys (issue 51's ITL step; Pallas and the Triton twin)
  timeout "${TILES_S:-200}" python benchmarks/flash_tiles.py --backends pallas --cases "prefill 32768" \
    --json "$OUT/tiles_32k.json" 2>&1 | grep -v Warning | tee "$OUT/tiles.log" | tail -4
  timeout "${TILES_QUICK_S:-320}" python benchmarks/flash_tiles.py --quick --cases "prefill 1024,prefill 8192,chunks,batch,chunk 512/32768" \
    --json "$OUT/tiles_quick.json" 2>&1 | grep -v Warning | tee -a "$OUT/tiles.log" | tail -9
fi
if [ "$what" = schedule ]; then
  # one process; the JSON is rewritten after every row
  XLA_PYTHON_CLIENT_MEM_FRACTION=$JAXMEM timeout "${SCHED_S:-540}" python benchmarks/scheduling.py ${SCHED_ARGS:-} --json "$OUT/scheduling.json" \
    2>&1 | grep -v Warning | tee "$OUT/scheduling.log" | tail -40
fi
if [ "$what" = tests ] || [ "$what" = all ]; then
  timeout "${TESTS_S:-500}" python -m pytest -m gpu -q -p no:cacheprovider tests \
    --ignore=tests/kernels/test_paged_attention.py 2>&1 | tee "$OUT/pytest_gpu.log" | tail -25
  rc=${PIPESTATUS[0]}
fi
if [ "$what" = attention ]; then
  timeout "${ATTN_TESTS_S:-560}" python -m pytest -m gpu -q -p no:cacheprovider tests/kernels/test_paged_attention.py \
    2>&1 | tee "$OUT/pytest_gpu_attention.log" | tail -25
  rc=${PIPESTATUS[0]}
fi
exit $rc
