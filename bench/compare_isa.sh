#!/usr/bin/env bash
# The portable build against a -march=native one, and its CPU kernel levels against each other,
# in one run: ResNet-20 (Fashion-MNIST shape, global batch 128, 2 CPU replicas) and ResNet-50
# 224x224 (global batch 16, 2 replicas), img/s. Each round runs every row once, in an order
# reversed every other round; ratios are against the native binary of the same round (these
# machines are shared and noisy: compare within a round). Rows: the portable binary at its
# default level, then forced to each lower level this CPU supports (REPLICA_CPU_ISA).
#   bench/compare_isa.sh PORTABLE_BUILD NATIVE_REPLICA_BINARY     ROUNDS=3 STEPS=30 R50_STEPS=3
# LEVELS=no leaves out the forced levels (two rows: for an A/B of two builds, NATIVE=another one).
# A native binary: cmake -S . -B build-native -G Ninja -DREPLICA_NATIVE=ON -DREPLICA_CUDA=OFF &&
#                  cmake --build build-native --target replica
set -euo pipefail
cd "$(dirname "$0")/.."
portable="$1/apps/replica"
native="$2"
rounds="${ROUNDS:-3}" steps="${STEPS:-30}" r50_steps="${R50_STEPS:-3}"
lscpu | grep -E "Model name" | sed 's/^/# /'
echo "# portable: $("$portable" --version | grep 'CPU kernels')"
best=$("$portable" --version | sed -n 's/.*CPU kernels: \([a-z0-9]*\) .*/\1/p')
levels=()
for l in $([ "${LEVELS:-yes}" = no ] || echo avx512 avx2 baseline); do
  [ "$l" = "$best" ] && continue
  REPLICA_CPU_ISA=$l "$portable" --version | grep -q "CPU kernels: $l " && levels+=("$l")
done
r20() { "$@" bench train --replicas 2 --steps "$steps" --warmup 5 2>/dev/null | awk '$1 == 2 {print $3}'; }
r50() {
  "$@" bench train --replicas 2 --steps "$r50_steps" --warmup 1 --set model.arch=resnet50 \
    --set data.dataset=synthetic --set "data.synthetic_shape=[224,224,3]" --set data.synthetic_size=256 \
    --set data.synthetic_classes=1000 --set train.global_batch=16 --set data.mean=[0.5,0.5,0.5] \
    --set data.std=[0.25,0.25,0.25] 2>/dev/null | awk '$1 == 2 {print $3}'
}
rows=("native" "portable ($best)")
for l in "${levels[@]}"; do rows+=("portable, REPLICA_CPU_ISA=$l"); done
run_row() {  # row name, model -> img/s
  case "$1" in
    native) "$2" "$native" ;;
    "portable ("*) "$2" "$portable" ;;
    *) (export REPLICA_CPU_ISA="${1##*=}"; "$2" "$portable") ;;
  esac
}
echo "| round | model | row | img/s | vs native |"
echo "|---|---|---|---|---|"
for round in $(seq 1 "$rounds"); do
  order=("${rows[@]}")
  if (( round % 2 == 0 )); then mapfile -t order < <(printf '%s\n' "${rows[@]}" | tac); fi
  for model in r20 r50; do
    declare -A got=()
    for row in "${order[@]}"; do got["$row"]=$(run_row "$row" "$model"); done
    for row in "${rows[@]}"; do
      echo "| $round | $([ $model = r20 ] && echo ResNet-20 || echo ResNet-50) | $row | ${got[$row]} | $(echo "scale=3; ${got[$row]} / ${got[native]}" | bc)x |"
    done
    unset got
  done
done
