#!/usr/bin/env bash
# Train the five demo draft heads against the shipped target on two GPUs in parallel
# (one process per GPU), as run for benchmarks/RESULTS.md. Usage (on the GPU host):
#   BUDGET0=200 BUDGET1=130 OUT=/tmp/out bash benchmarks/train_demo_heads_x2.sh
set -uo pipefail
OUT=${OUT:-/tmp/heads_out}
T=specjax/demo_models/target
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
CUDA_VISIBLE_DEVICES=0 timeout ${LIMIT:-560} python -m specjax.training.recipe --out /tmp/h0 --stage heads \
  --target $T --heads eagle3,medusa --model-budget-s ${BUDGET0:-200} > $OUT/log_gpu0.txt 2>&1 &
CUDA_VISIBLE_DEVICES=1 timeout ${LIMIT:-560} python -m specjax.training.recipe --out /tmp/h1 --stage heads \
  --target $T --heads eagle,dflash,draft_model --model-budget-s ${BUDGET1:-130} > $OUT/log_gpu1.txt 2>&1 &
wait
cp /tmp/h0/report_heads.json $OUT/report_gpu0.json 2>/dev/null
cp /tmp/h1/report_heads.json $OUT/report_gpu1.json 2>/dev/null
mkdir -p /tmp/heads && cp -r /tmp/h0/*/ /tmp/h1/*/ /tmp/heads/ 2>/dev/null
(cd /tmp/heads && tar cf $OUT/heads.tar .)
tail -3 $OUT/log_gpu0.txt $OUT/log_gpu1.txt
