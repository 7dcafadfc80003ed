#!/usr/bin/env bash
# 2 processes x 1 replica (MPI) beside 1 process x 2 replicas and PyTorch DDP (gloo, 2 x 1
# thread), ResNet-20 on Fashion-MNIST, global batch 128, in one run.
#   bench/compare_mpi.sh [BUILD_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
build="${1:-build}"
py="${PYTHON:-/usr/bin/python3}"
steps="${STEPS:-30}"
mpirun=(mpirun --allow-run-as-root --oversubscribe --bind-to none -np 2)
one=$("$build/apps/replica" bench train --replicas 2 --steps "$steps" | awk '$1 == 2 {print $3}')
two=$("${mpirun[@]}" "$build/apps/replica" bench train --replicas 1 --steps "$steps" | awk '$1 == 2 {print $3}')
ddp=$(cd bench/anchors && "$py" torch_ddp.py | grep -o "img/s=[0-9.]*" | cut -d= -f2)
echo "1 process x 2 replicas (host)     : $one img/s"
echo "2 processes x 1 replica (MPI)     : $two img/s   ratio to in-process $(echo "scale=2; $two / $one" | bc)x"
echo "PyTorch DDP gloo, 2 x 1 thread    : $ddp img/s   MPI ratio to DDP $(echo "scale=2; $two / $ddp" | bc)x"
