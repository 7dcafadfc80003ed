#!/usr/bin/env bash
# fp16 and bf16 training speed as a ratio of fp32 on the same build and machine: ResNet-20 on
# Fashion-MNIST, 1 CPU replica, global batch 128. The three runs alternate, ROUNDS times, so a
# noisy machine's slow phase hits all of them; each round's ratios and the medians are printed.
#   ROUNDS=6 STEPS=30 bench/compare_precision.sh [BUILD_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
build="${1:-build}"
rounds="${ROUNDS:-6}"
steps="${STEPS:-30}"
speed() {
  "$build/apps/replica" bench train --replicas 1 --steps "$steps" --warmup 3 --set "train.precision=$1" |
    awk '$1 == 1 {print $3}'
}
r16=() rbf=()
for ((i = 1; i <= rounds; ++i)); do
  f32=$(speed fp32) f16=$(speed fp16) bf=$(speed bf16)
  a=$(echo "scale=3; $f16 / $f32" | bc) b=$(echo "scale=3; $bf / $f32" | bc)
  r16+=("$a") rbf+=("$b")
  echo "round $i: fp32 $f32 img/s  fp16 $f16 (${a}x)  bf16 $bf (${b}x)"
done
median() { printf '%s\n' "$@" | sort -n | awk '{v[NR] = $1} END {print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2}'; }
echo "median over $rounds rounds: fp16 $(median "${r16[@]}")x  bf16 $(median "${rbf[@]}")x of fp32"
