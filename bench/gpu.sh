#!/usr/bin/env bash
# The GPU check (bench/gpu_check.py): copus's training loop on a ~1B Llama (the TinyLlama-1.1B
# shape from a config.json, seq 2048), one rank per GPU, NCCL, bf16 (FSDP2 mixed precision),
# one process per leg, each under `timeout`: eager mb2 (+ GNS overhead), a batch growth, a layout
# switch (>= 2 GPUs), a throughput leg (the memory model's micro-batch, compile, selective AC;
# + GNS overhead) and torchtitan's Llama on the throughput leg's settings when torchtitan is
# importable. A leg that fails or times out is a row with its error; the next leg still runs.
#
# Budget: BUDGET_S (default 480 s = 8 min) for everything, startup included; each leg gets
# min(its cap, what is left - 20 s for the summary). Expected on one H200: ~5.5 min
# (docs/gpu-check.md). TTT=1 then runs the time-to-target comparison OUTSIDE that budget
# (another 6-10 min).
#
#   bash bench/gpu.sh                          # every GPU torch sees -> bench/results/gpu/
#   bash bench/gpu.sh --nproc 4 --out DIR      # 4 ranks (<= torch.cuda.device_count())
#   bash bench/gpu.sh --legs eager,throughput  # a subset of the legs
#   bash bench/gpu.sh --dry-run --out DIR      # the same code on 2 CPU ranks (gloo, fp32, tiny
#                                              # model, 8 steps): what CI runs (tests/bench)
#   TTT=1 bash bench/gpu.sh                    # then also bench/time_to_target.py (outside the budget)
#
# Writes DIR/gpu_check.json and DIR/gpu_check.md (per-leg files in DIR/legs, runs in DIR/runs).
set -uo pipefail
cd "$(dirname "$0")/.."
# the interpreter: $PYTHON, else the project's .venv (the README's install), else python on PATH
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON; elif [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python; fi
DRY=0
OUT=bench/results/gpu
NPROC=0
LEGS=eager,growth,switch,throughput,torchtitan
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1; shift ;;
    --out) OUT="$2"; shift 2 ;;
    --out=*) OUT="${1#--out=}"; shift ;;
    --nproc) NPROC="$2"; shift 2 ;;
    --nproc=*) NPROC="${1#--nproc=}"; shift ;;
    --legs) LEGS="$2"; shift 2 ;;
    --legs=*) LEGS="${1#--legs=}"; shift ;;
    *) echo "bench/gpu.sh: unknown argument '$1'; allowed: --dry-run, --out DIR, --nproc N, --legs a,b" >&2; exit 2 ;;
  esac
done
case "${NPROC}" in
  ''|*[!0-9]*) echo "bench/gpu.sh: --nproc '${NPROC}' is invalid; allowed: a whole number >= 1" >&2; exit 2 ;;
esac
for leg in ${LEGS//,/ }; do
  case "${leg}" in
    eager|growth|switch|throughput|torchtitan) ;;
    *) echo "bench/gpu.sh: --legs: unknown leg '${leg}'; allowed: eager, growth, switch, throughput, torchtitan" >&2; exit 2 ;;
  esac
done
if [ "${DRY}" = 1 ]; then
  BUDGET_S=${BUDGET_S:-300}
  DRYARG=--dry-run
  # per-leg caps (seconds) on 2 shared CPU cores
  declare -A CAP=([eager]=90 [growth]=90 [switch]=90 [throughput]=120 [torchtitan]=60)
else
  BUDGET_S=${BUDGET_S:-480}
  DRYARG=
  # per-leg caps on one H200 (expected: eager 45, growth 45, switch 60, throughput 130,
  # torchtitan 110 s; docs/gpu-check.md)
  declare -A CAP=([eager]=120 [growth]=100 [switch]=140 [throughput]=240 [torchtitan]=200)
fi
if [ -n "${LEG_TIMEOUT_S:-}" ]; then
  for leg in "${!CAP[@]}"; do CAP[$leg]=${LEG_TIMEOUT_S}; done
fi
T0=$(date +%s)
mkdir -p "${OUT}"
# the device count from torch (CUDA_VISIBLE_DEVICES and MIG honoured), not nvidia-smi
NPROC=$(timeout -k 5 120 "${PY}" bench/gpu_check.py --devices --nproc "${NPROC}" --out "${OUT}" ${DRYARG})
rc=$?
if [ "${rc}" = 2 ]; then exit 2; fi      # gpu_check printed the one-line reason
if [ "${rc}" != 0 ]; then
  echo "bench/gpu.sh: the device check failed (exit ${rc}$([ "${rc}" = 124 ] && echo ': no answer from torch.cuda within 120 s'))" >&2
  exit 2
fi
rm -rf "${OUT}/legs" && mkdir -p "${OUT}/legs"
echo "gpu.sh: ${NPROC} rank(s)$([ "${DRY}" = 1 ] && echo ' (dry run: CPU, gloo, fp32, tiny model)'), legs ${LEGS}, budget ${BUDGET_S} s -> ${OUT}"
for leg in ${LEGS//,/ }; do
  left=$(( BUDGET_S - ($(date +%s) - T0) - 20 ))
  cap=${CAP[$leg]}
  limit=$(( left < cap ? left : cap ))
  if [ "${limit}" -lt 15 ]; then
    echo "gpu.sh: leg ${leg}: skipped, the budget is spent"
    continue
  fi
  t=$(date +%s)
  # timeout signals the whole process group (the leg's ranks included); -k: SIGKILL 10 s later
  timeout -k 10 "${limit}" "${PY}" bench/gpu_check.py --leg "${leg}" --out "${OUT}" ${DRYARG} \
    > "${OUT}/legs/${leg}.log" 2>&1
  rc=$?
  echo "${rc} ${limit}" > "${OUT}/legs/${leg}.rc"
  echo "gpu.sh: leg ${leg}: exit ${rc} after $(( $(date +%s) - t )) s (limit ${limit} s)"
done
timeout -k 5 60 "${PY}" bench/gpu_check.py --collect --out "${OUT}" ${DRYARG} \
  --wall-s $(( $(date +%s) - T0 )) --budget-s "${BUDGET_S}"
rc=$?
if [ "${TTT:-0}" = 1 ] && [ "${DRY}" = 0 ]; then
  echo "gpu.sh: TTT=1: the time-to-target comparison, outside the check's budget"
  SEEDS=${SEEDS:-0}
  TOKENS=${TOKENS:-4000000}
  # static batches: multiples of the GPU count (dp can be the whole node); the policies run
  # are the static ones given plus every adaptive one (time_to_target's default)
  B0=$(( NPROC > 8 ? NPROC : 8 ))
  STATIC=${STATIC:-${B0},$((B0 * 4)),$((B0 * 16))}
  "${PY}" bench/time_to_target.py \
    --nproc "${NPROC}" --model small --seeds "${SEEDS}" --max-tokens "${TOKENS}" \
    --warmup-tokens $((TOKENS / 16)) --static "${STATIC}" --initial-batch "${B0}" \
    --eval-samples 128 --set 'parallel.backend="nccl"' \
    --runs "${OUT}/runs/time_to_target" --out "${OUT}/time_to_target_gpu.json"
fi
exit "${rc}"
