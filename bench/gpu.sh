#!/usr/bin/env bash
# Time-to-target comparison (bench/time_to_target.py) on ONE GPU node: every policy, the `small`
# model, one rank per GPU, NCCL, bf16 autocast (train.dtype=auto). A few minutes on 8 GPUs.
#
#   bash bench/gpu.sh                 # all GPUs of this node, seeds 0,1
#   SEEDS=0 TOKENS=2000000 bash bench/gpu.sh
#
# Writes bench/results/time_to_target_gpu.json and .md; run folders in runs/time_to_target_gpu.
# Not run by the authors (no GPU where copus was developed): treat its first run as a test.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
NGPU=${NGPU:-$(nvidia-smi -L 2>/dev/null | wc -l)}
if [ "${NGPU}" -lt 1 ]; then
  echo "bench/gpu.sh: no GPU found (nvidia-smi -L); set NGPU or use bench/time_to_target.py" >&2
  exit 2
fi
SEEDS=${SEEDS:-0,1}
TOKENS=${TOKENS:-4000000}
# static batches: must be multiples of the GPU count (dp can be the whole node)
B0=$(( NGPU > 8 ? NGPU : 8 ))
STATIC=${STATIC:-${B0},$((B0 * 4)),$((B0 * 16))}
echo "gpu.sh: ${NGPU} GPU(s), seeds ${SEEDS}, ${TOKENS} tokens, static ${STATIC}"
exec "${PY}" bench/time_to_target.py \
  --nproc "${NGPU}" --model small --seeds "${SEEDS}" --max-tokens "${TOKENS}" \
  --warmup-tokens $((TOKENS / 16)) --static "${STATIC}" --initial-batch "${B0}" \
  --eval-samples 128 --set 'parallel.backend="nccl"' \
  --runs runs/time_to_target_gpu --out bench/results/time_to_target_gpu.json
