#!/usr/bin/env bash
# The GPU check (bench/gpu_check.py): copus's training loop on a ~1B Llama (the TinyLlama-1.1B
# shape from a config.json, seq 2048), one rank per GPU, NCCL, bf16 (FSDP2 mixed precision): step time, MFU,
# peak memory against the memory model, GNS overhead, a batch growth and, on >= 2 GPUs, a
# layout switch. About 2 minutes on one GPU (budget: 8).
#
#   bash bench/gpu.sh                          # all GPUs of this node -> bench/results/gpu/
#   bash bench/gpu.sh --out DIR                # results into DIR
#   bash bench/gpu.sh --dry-run --out DIR      # the same code on 2 CPU ranks (gloo, fp32, tiny
#                                              # model, 8 steps): what CI runs (tests/bench)
#   TTT=1 bash bench/gpu.sh                    # then also the time-to-target comparison
#                                              # (bench/time_to_target.py, `small`, every policy)
#
# Writes DIR/gpu_check.json and DIR/gpu_check.md (run folders in DIR/runs).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
DRY=0
OUT=bench/results/gpu
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1; shift ;;
    --out) OUT="$2"; shift 2 ;;
    --out=*) OUT="${1#--out=}"; shift ;;
    *) echo "bench/gpu.sh: unknown argument '$1'; allowed: --dry-run, --out DIR" >&2; exit 2 ;;
  esac
done
if [ "${DRY}" = 1 ]; then
  echo "gpu.sh: dry run (2 CPU ranks, gloo, fp32, tiny model) -> ${OUT}"
  exec "${PY}" bench/gpu_check.py --dry-run --out "${OUT}"
fi
NGPU=${NGPU:-$(nvidia-smi -L 2>/dev/null | wc -l)}
if [ "${NGPU}" -lt 1 ]; then
  echo "bench/gpu.sh: no GPU found (nvidia-smi -L); allowed: a CUDA host, or --dry-run" >&2
  exit 2
fi
echo "gpu.sh: ${NGPU} GPU(s) -> ${OUT}"
"${PY}" bench/gpu_check.py --nproc "${NGPU}" --out "${OUT}"
if [ "${TTT:-0}" = 1 ]; then
  SEEDS=${SEEDS:-0}
  TOKENS=${TOKENS:-4000000}
  # static batches: multiples of the GPU count (dp can be the whole node); the policies run
  # are the static ones given plus every adaptive one (time_to_target's default)
  B0=$(( NGPU > 8 ? NGPU : 8 ))
  STATIC=${STATIC:-${B0},$((B0 * 4)),$((B0 * 16))}
  "${PY}" bench/time_to_target.py \
    --nproc "${NGPU}" --model small --seeds "${SEEDS}" --max-tokens "${TOKENS}" \
    --warmup-tokens $((TOKENS / 16)) --static "${STATIC}" --initial-batch "${B0}" \
    --eval-samples 128 --set 'parallel.backend="nccl"' \
    --runs "${OUT}/runs/time_to_target" --out "${OUT}/time_to_target_gpu.json"
fi
