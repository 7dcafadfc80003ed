#!/usr/bin/env bash
# `replica plan`'s predictions against runs made here (#31): fits the host all-reduce and MPI's
# from `replica bench allreduce`, predicts ResNet-20 (Fashion-MNIST) and ResNet-50 (synthetic
# 96x96x3) on 1-4 in-process CPU replicas and on 2 and 4 MPI processes from a profile measured
# per micro-batch, runs the same configurations with `replica bench train`, and prints predicted
# img/s, measured img/s and the error for each.
#   bench/compare_plan.sh [BUILD_DIR]   STEPS=20 ROUNDS=3 (ResNet-50: STEPS50=12 ROUNDS50=2) PROFILE_STEPS=10
set -euo pipefail
cd "$(dirname "$0")/.."
build="${1:-build}"
bin="$build/apps/replica"
steps="${STEPS:-20}"
rounds="${ROUNDS:-3}"
psteps="${PROFILE_STEPS:-10}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mpirun=(mpirun --allow-run-as-root --oversubscribe --bind-to none)
r20=(--set train.global_batch=96)
r50=(--set model.arch=resnet50 --set data.dataset=synthetic --set "data.synthetic_shape=[96,96,3]"
     --set data.synthetic_size=1024 --set "data.mean=[0.5,0.5,0.5]" --set "data.std=[0.25,0.25,0.25]"
     --set train.global_batch=24)
"$bin" bench allreduce --devices cpu:2 -b 1K -e 64M -f 4 -n 20 > "$work/host.txt"
"${mpirun[@]}" -np 2 "$bin" bench allreduce --devices cpu:1 -b 1K -e 64M -f 4 -n 20 > "$work/mpi.txt"
grep -h "replica bench allreduce" "$work/host.txt" "$work/mpi.txt"

# Predicted img/s for N devices: plan's table (devices, link, micro x acc, step, img/s, ...).
predict() {  # N LINK_FILE MODEL_ARGS...
  local n="$1" link="$2"; shift 2
  "$bin" plan "$@" --devices "$n" --link-file "$link" --profile-steps "$psteps" --no-memory 2>/dev/null |
    awk '$2 == "host" || $2 == "mpi" {print $7}'
}
measure() {  # N MODEL_ARGS...   (N in-process replicas)
  local n="$1"; shift
  "$bin" bench train "$@" --replicas "$n" --steps "$steps" --warmup 3 2>/dev/null | awk -v n="$n" '$1 == n {print $3}'
}
measure_mpi() {  # NP MODEL_ARGS...   (NP processes x 1 replica)
  local np="$1"; shift
  "${mpirun[@]}" -np "$np" "$bin" bench train "$@" --replicas 1 --steps "$steps" --warmup 3 2>/dev/null |
    awk -v n="$np" '$1 == n {print $3}'
}
# The machine's speed drifts by 10-20% over minutes: each round profiles and predicts, then runs at
# once; the table gives every round's pair and the median ratio.
echo "| model | layout | predicted / measured img/s, each round | median ratio |"
echo "|---|---|---|---|"
layout() {  # NAME KIND N MODEL_ARGS...
  local name="$1" kind="$2" n="$3"; shift 3
  local pairs="" ratios=() p m
  for ((round = 1; round <= rounds; round++)); do
    if [ "$kind" = mpi ]; then p=$(predict "$n" "$work/mpi.txt" "$@"); m=$(measure_mpi "$n" "$@")
    else p=$(predict "$n" "$work/host.txt" "$@"); m=$(measure "$n" "$@"); fi
    pairs+="$(printf '%.0f / %.0f' "$p" "$m"); "
    ratios+=("$(awk -v p="$p" -v m="$m" 'BEGIN {printf "%.3f", p / m}')")
  done
  local med
  med=$(printf '%s\n' "${ratios[@]}" | sort -g | awk '{a[NR] = $1} END {print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2}')
  echo "| $name | $([ "$kind" = mpi ] && echo "$n MPI processes x 1" || echo "$n in-process replica(s)") | ${pairs%; } | $med |"
}
for n in 1 2 3 4; do layout "ResNet-20 28x28 b96" host "$n" "${r20[@]}"; done
for n in 2 4; do layout "ResNet-20 28x28 b96" mpi "$n" "${r20[@]}"; done
rounds="${ROUNDS50:-2}" steps="${STEPS50:-12}"
for n in 1 2 3 4; do layout "ResNet-50 96x96 b24" host "$n" "${r50[@]}"; done
for n in 2 4; do layout "ResNet-50 96x96 b24" mpi "$n" "${r50[@]}"; done
