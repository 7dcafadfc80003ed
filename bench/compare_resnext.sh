#!/bin/sh
# ResNeXt-50 32x4d (grouped 3x3 convolutions) at 224x224, batch 16, synthetic data: replica with
# 1 and 2 CPU replicas against PyTorch with 1 and 2 threads (bench/anchors/torch_resnet50_cpu.py,
# ARCH=resnext50_32x4d), and ResNet-50 beside it, two rounds alternated.
# Usage: bench/compare_resnext.sh [BUILD_DIR] [PYTHON]   (PYTHON: bench/anchors/setup_venv.sh's)
set -eu
build=${1:-build}
py=${2:-$(bench/anchors/setup_venv.sh | tail -1)}
steps=${STEPS:-3}
for round in 1 2; do
  for arch in resnext50_32x4d resnet50; do
    for n in 1 2; do
      r=$("$build/apps/replica" bench train --replicas "$n" --steps "$steps" --warmup 1 \
          --set model.arch=$arch --set data.dataset=synthetic --set "data.synthetic_shape=[224,224,3]" \
          --set data.synthetic_size=256 --set data.synthetic_classes=1000 --set train.global_batch=16 \
          --set "data.mean=[0.5,0.5,0.5]" --set "data.std=[0.25,0.25,0.25]" | awk -v n="$n" '$1 == n {print $3}')
      t=$(T="$n" STEPS="$steps" BS=16 ARCH=$arch "$py" bench/anchors/torch_resnet50_cpu.py | sed 's/.*img\/s=//')
      echo "round $round $arch: replica $n replica(s) $r img/s, PyTorch $n thread(s) $t img/s, ratio $(echo "$r $t" | awk '{printf "%.2f", $1 / $2}')x"
    done
  done
done
