#!/usr/bin/env bash
# Side-by-side CPU comparison in one run: replica against PyTorch 2.x and JAX from PyPI (a
# virtual environment that bench/anchors/setup_venv.sh makes, the way a person would) on the
# same cores, ResNet-20 on Fashion-MNIST (batch 128, 28x28x1) and ResNet-50 at 224x224 (batch 16).
# Every pair runs ROUNDS times (default 2), alternating the programs, and each round is reported:
# the machines are shared and noisy, a ratio is only meaningful within one round. Debian's PyTorch
# (apt-get install python3-torch) adds a second anchor row when it is installed.
#   bench/compare_cpu.sh [BUILD_DIR]        STEPS=30 ROUNDS=2 R50_STEPS=3 ANCHOR_VENV=...
set -euo pipefail
cd "$(dirname "$0")/.."
build="${1:-build}"
py="$(bench/anchors/setup_venv.sh | tail -1)"
debian_py=/usr/bin/python3
"$debian_py" -c "import torch" 2>/dev/null || debian_py=""
steps="${STEPS:-30}"
rounds="${ROUNDS:-2}"
r50_steps="${R50_STEPS:-3}"
num() { grep -o "$1[0-9.]*" | head -1 | sed "s|$1||"; }
ratio() { echo "scale=2; $1 / $2" | bc; }
rows=()
# Each row is printed as it is measured (a run stopped early keeps what it had) and again in the
# table at the end.
row() {
  rows+=("| $1 | $2 | $3 | $4 | $(ratio "$2" "$4")x |")
  echo "${rows[-1]}"
}

for round in $(seq 1 "$rounds"); do
  echo "# round $round"
  # 1 thread, forward+backward
  r1=$("$build/bench/replica_bench_model" --steps "$steps" --shapes 0 | num "replica img/s ")
  t1=$(T=1 STEPS="$steps" "$py" bench/anchors/torch_resnet.py | num "img/s=")
  row "$round" "$r1" "ResNet-20, 1 thread fwd+bwd vs PyTorch $("$py" -c 'import torch; print(torch.__version__)') 1 thread" "$t1"
  if [ -n "$debian_py" ]; then
    d1=$(T=1 STEPS="$steps" "$debian_py" bench/anchors/torch_resnet.py | num "img/s=")
    row "$round" "$r1" "ResNet-20, 1 thread vs Debian PyTorch $("$debian_py" -c 'import torch; print(torch.__version__)') 1 thread" "$d1"
  fi
  # 2 cores
  r2=$("$build/apps/replica" bench train --replicas 2 --steps "$steps" --warmup 5 | awk '$1 == 2 {print $3}')
  t2=$(T=2 STEPS="$steps" "$py" bench/anchors/torch_resnet.py | num "img/s=")
  ddp=$(cd bench/anchors && "$py" torch_ddp.py | num "img/s=")
  jx=$(DEVICES=2 STEPS="$steps" "$py" bench/anchors/jax_pmap_resnet.py | num "img/s ")
  row "$round" "$r2" "ResNet-20, 2 CPU replicas vs PyTorch 2 threads" "$t2"
  row "$round" "$r2" "ResNet-20, 2 CPU replicas vs PyTorch DDP (gloo, 2 x 1 thread)" "$ddp"
  row "$round" "$r2" "ResNet-20, 2 CPU replicas vs JAX pmap (2 host devices)" "$jx"
  # ResNet-50 at 224x224, batch 16, synthetic data
  for n in 1 2; do
    r50=$("$build/apps/replica" bench train --replicas "$n" --steps "$r50_steps" --warmup 1 \
          --set model.arch=resnet50 --set data.dataset=synthetic --set "data.synthetic_shape=[224,224,3]" \
          --set data.synthetic_size=256 --set data.synthetic_classes=1000 --set train.global_batch=16 --set data.mean=[0.5,0.5,0.5] \
          --set data.std=[0.25,0.25,0.25] | awk -v n="$n" '$1 == n {print $3}')
    t50=$(T="$n" STEPS="$r50_steps" BS=16 "$py" bench/anchors/torch_resnet50_cpu.py | num "img/s=")
    row "$round" "$r50" "ResNet-50 224x224 batch 16, $n replica(s) vs PyTorch $n thread(s)" "$t50"
  done
done
echo
echo "| round | replica img/s | against | anchor img/s | ratio |"
echo "|---|---|---|---|---|"
printf '%s\n' "${rows[@]}"
