#!/usr/bin/env bash
# parallel.shard against the unsharded step, side by side in one run: 2 CPU replicas, AdamW,
# ResNet-20 (the default Fashion-MNIST configuration, batch 128) and ResNet-50 at 224x224 (batch
# 16, synthetic). Each round runs none / optimizer / gradients back to back, alternating which goes
# first, and reports each sharded img/s over the unsharded one of the same round (the machines are
# shared and noisy: a ratio is only meaningful within one round).
# PRECISION=bf16 (or fp16) runs mixed precision, where the sharded modes shard the fp32 masters too
# and all-gather the 16-bit copy.
#   bench/compare_shard.sh [BUILD_DIR]        ROUNDS=3 STEPS=20 R50_STEPS=3 PRECISION=fp32
set -euo pipefail
cd "$(dirname "$0")/.."
build="${1:-build}"
rounds="${ROUNDS:-3}"
steps="${STEPS:-20}"
r50_steps="${R50_STEPS:-3}"
precision="${PRECISION:-fp32}"
r50=(--set model.arch=resnet50 --set data.dataset=synthetic --set "data.synthetic_shape=[224,224,3]"
     --set data.synthetic_size=256 --set data.synthetic_classes=1000 --set train.global_batch=16
     --set "data.mean=[0.5,0.5,0.5]" --set "data.std=[0.25,0.25,0.25]")
imgs() {  # model mode -> img/s of 2 replicas
  local model="$1" mode="$2" extra=() n="$steps" warm=5
  if [ "$model" = resnet50 ]; then extra=("${r50[@]}"); n="$r50_steps"; warm=1; fi
  "$build/apps/replica" bench train --replicas 2 --steps "$n" --warmup "$warm" --set optim.name=adamw \
    --set optim.lr=0.001 --set train.precision="$precision" --set parallel.shard="$mode" "${extra[@]}" | awk '$1 == 2 {print $3}'
}
ratio() { echo "scale=3; $1 / $2" | bc; }
rows=()
for round in $(seq 1 "$rounds"); do
  for model in resnet20 resnet50; do
    modes=(none optimizer gradients)
    [ $((round % 2)) -eq 0 ] && modes=(gradients optimizer none)
    declare -A got=()
    for m in "${modes[@]}"; do got[$m]=$(imgs "$model" "$m"); done
    for m in optimizer gradients; do
      rows+=("| $round | $model | ${got[none]} | $m | ${got[$m]} | $(ratio "${got[$m]}" "${got[none]}")x |")
      echo "${rows[-1]}"
    done
    unset got
  done
done
echo
echo "| round | model | unsharded img/s | parallel.shard | sharded img/s | ratio |"
echo "|---|---|---|---|---|---|"
printf '%s\n' "${rows[@]}"
