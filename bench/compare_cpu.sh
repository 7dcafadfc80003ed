#!/usr/bin/env bash
# Side-by-side CPU comparison in one run: replica against the PyTorch anchors
# (bench/anchors/, copies of ../shared/anchors/: ResNet-20 on Fashion-MNIST, batch 128).
# Needs PyTorch (Debian: apt-get install python3-torch). Prints images/s and ratios.
#   bench/compare_cpu.sh [BUILD_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
build="${1:-build}"
py="${PYTHON:-/usr/bin/python3}"
steps="${STEPS:-30}"
num() { grep -o "$1[0-9.]*" | head -1 | sed "s|$1||"; }

echo "# 1 thread: forward+backward of ResNet-20, batch 128, 28x28x1"
r1=$("$build/bench/replica_bench_model" --steps "$steps" --shapes 0 | num "replica img/s ")
t1=$(T=1 STEPS="$steps" "$py" bench/anchors/torch_resnet.py | num "img/s=")
echo "replica 1 replica       : $r1 img/s"
echo "pytorch 1 thread        : $t1 img/s"
echo "ratio                   : $(echo "scale=2; $r1 / $t1" | bc)x"

echo "# 2 cores: replica 2 CPU replicas vs PyTorch 2 threads and PyTorch DDP (gloo, 2 x 1 thread)"
out=$("$build/apps/replica" bench train --replicas 1 2 --steps "$steps" --warmup 5)
echo "$out"
r2=$(echo "$out" | awk '$1 == 2 {print $3}')
t2=$(T=2 STEPS="$steps" "$py" bench/anchors/torch_resnet.py | num "img/s=")
ddp=$(cd bench/anchors && "$py" torch_ddp.py | num "img/s=")
echo "replica 2 replicas      : $r2 img/s"
echo "pytorch 2 threads       : $t2 img/s   ratio $(echo "scale=2; $r2 / $t2" | bc)x"
echo "pytorch DDP gloo 2x1    : $ddp img/s   ratio $(echo "scale=2; $r2 / $ddp" | bc)x"
