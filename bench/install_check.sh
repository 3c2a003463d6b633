#!/usr/bin/env bash
# Installability (issue 28): does copus join an environment without downgrading, and are the
# README's two install commands as fast as before? Compares this branch with a reference clone.
#
#   bash bench/install_check.sh /tmp/fresh-main /tmp/fresh-this   # two fresh `git clone`s
#
# 1. resolution (pip --dry-run, no constraints): copus + transformers 4.57.6 / numpy 2.3.5 /
#    tqdm 4.67.1 (versions another stack may hold), and copus + the latest transformers;
# 2. wall time of the README's install commands on each fresh clone, interleaved (the tests
#    and `copus train` that follow them are the same on both trees and are not timed).
# Results: printed; the machine may be shared (load average printed beside each time).
set -u
ref=$1; new=$2; work=$(mktemp -d)
python3 -m venv "$work/venv"
P="$work/venv/bin/pip install -q --dry-run --ignore-installed"
for tree in "$ref" "$new"; do
  for extra in transformers "transformers==4.57.6" "numpy==2.3.5" "tqdm==4.67.1"; do
    $P "$tree" "$extra" > "$work/log" 2>&1
    echo "resolve $(basename "$tree") + $extra: rc=$? $(grep -m1 'ERROR' "$work/log" | head -c 160)"
  done
done
for kind in run dev; do
  for tree in "$new" "$ref"; do
    cd "$tree" && rm -rf .venv
    if [ -f constraints.txt ]; then c="-c constraints.txt"; else c=""; fi
    if [ $kind = run ]; then cmd="python3 -m venv .venv && .venv/bin/pip install -q $c -e ."
    else cmd="python3 -m venv .venv && .venv/bin/pip install -q $c -e '.[dev]'"; fi
    s=$(date +%s.%N); bash -c "$cmd" > /dev/null 2>&1; rc=$?; e=$(date +%s.%N)
    echo "install $(basename "$tree") $kind rc=$rc $(echo "$e - $s" | bc) s load=$(cut -d' ' -f1 /proc/loadavg) [$cmd]"
  done
done
rm -rf "$work"
